//! Experts resident by use: a mixture of experts larger than its GPU budget.
//!
//! Everything but the routed experts' matrices stays on the device (attention, norms,
//! the router, shared experts, the experts' biases, the head). What is left of the
//! budget becomes a pool per layer of the same number of slots, each holding one
//! expert's `gate`, `up` and `down` matrices as the file's blocks. A token's routes are
//! read back after the router, layer by layer: the routes to a resident expert are
//! multiplied on the device (the routed products read slot indices instead of expert
//! indices), the others on the CPU from the mapped file with the CPU's own kernels
//! ([`crate::cpu::routed_part`]), at the same time, and the CPU's weighted sum is added
//! on the device.
//!
//! A missed expert is promoted in the background: a thread copies its bytes from the
//! mapped file into a page-locked staging buffer (`promoter`), a later pass queues their
//! copy to the slot on a stream of its own, and the slot serves routes once that copy has
//! landed. A pass never waits for either. Free slots take every missed expert (its first
//! route uploads it), and the most routed experts not in the pool yet; a full pool admits
//! a missed expert only when it was routed at least twice as often lately as the
//! least-recently-routed expert it would evict (counts halved every few routes), so that
//! a router that spreads its tokens evenly does not churn the pool, and one that favours
//! some experts keeps those.
//!
//! A few more slots a layer, the link slots, hold no expert for long: once the
//! experts' span of the mapped file is registered with the runtime (`link`), a pass
//! copies some of the experts its pool misses straight from the mapping into them, at
//! the link's rate (about 55 GB/s over an H200's PCIe 5, where 16 cores multiply one or
//! two experts' few routes at 25 GB/s), and multiplies their routes on the device with
//! the resident ones; the CPU takes the others. A few tokens leave the CPU a third of
//! their misses (the least routed), so that both sides finish at about the same time,
//! and give the link at most one round of them; a prompt's chunk gives the link every
//! missed expert, a round of products for each fill of the link slots (the CPU's
//! products of many tokens an expert are far slower than the link's copy).
//!
//! Once the mapping is registered (and the device reads it as one run), a pass of a few
//! tokens whose routed products are the decode products in tiles of one slot reads its
//! missed experts in place instead (`in_place`): a kernel copies them from the mapping
//! over the link into a room of their own, and the products read every expert through
//! a table of addresses (its slot, or that room), with nothing read back before them
//! and no route on the CPU; the routes are read back after the products and counted at
//! the layer's next pass, which promotes and evicts as a split does. Such a pass gives
//! the bits of a pass with every expert resident. While the passes read more than about
//! 12 MB of experts a layer from the host, on average, they split their routes instead:
//! the link alone then carries them slower than the link and the CPU together
//! (`in_place::IN_PLACE_MAX_AWAY_BYTES`).
//!
//! The tokens of passes whose routes split depend on residency only within the GPU's
//! tolerance: a route's product is
//! the CPU's bits or the GPU's, and the two halves' sums are added in a different order
//! than one device's.

mod in_place;
mod layer;
mod link;
mod promoter;
mod routes;
mod stats;

use hip_backend::{Device, DeviceBuffer, DeviceView, DeviceViewMut, Event, PinnedBuffer, Stream};
use tensor_store::TensorHandle;

use super::gpu;
use crate::cpu::{on_the_pool, routed_part, MoeScratch, Pick};
use crate::plan::{ExecutionPlan, ExpertMatrices, ExpertsPlan, FfnPlan};
use crate::ModelError;
pub(in crate::gpu) use in_place::tables_of;
use in_place::{Away, InPlace};
use layer::{arrived, fill_free, LayerPool, PoolMatrix, Slot};
pub(in crate::gpu) use link::link_slots;
use link::Link;
use promoter::Promoter;
use routes::Linked;
pub use stats::ExpertStats;

/// A layer's route counts are halved once it has routed this many tokens per expert.
pub(super) const AGING_ROUTES_PER_EXPERT: u64 = 8;

/// Bytes of one expert's matrices (`gate` if any, `up`, `down`) of each layer with
/// experts, in layer order: what a slot of that layer's pool takes.
pub(super) fn slot_bytes(plan: &ExecutionPlan) -> Vec<u64> {
    plan.layers
        .iter()
        .filter_map(|l| match &l.ffn {
            FfnPlan::Experts(e) => Some(matrices(e).map(expert_bytes).sum()),
            FfnPlan::Dense(_) => None,
        })
        .collect()
}

/// The routed experts' 3-D tensors: what the pools hold instead of the device cache.
pub(super) fn pooled_tensors(plan: &ExecutionPlan) -> Vec<TensorHandle> {
    plan.layers
        .iter()
        .filter_map(|l| match &l.ffn {
            FfnPlan::Experts(e) => Some(matrices(e).map(|m| m.weight.clone())),
            FfnPlan::Dense(_) => None,
        })
        .flatten()
        .collect()
}

fn matrices(e: &ExpertsPlan) -> impl Iterator<Item = &ExpertMatrices> {
    e.gate.iter().chain([&e.up, &e.down])
}

/// Bytes of one expert of `m`.
fn expert_bytes(m: &ExpertMatrices) -> u64 {
    m.weight.size() / m.count.max(1) as u64
}

/// The host side of a pooled layer's routes: read back from the device, split, and the
/// host's half of the sum on its way back.
struct HostSide {
    ids: PinnedBuffer<i32>,
    weights: PinnedBuffer<f32>,
    h: PinnedBuffer<f32>,
    slot_ids: PinnedBuffer<i32>,
    device_weights: PinnedBuffer<f32>,
    partial: PinnedBuffer<f32>,
    picks: Vec<Pick>,
    /// The experts of this pass that come over the link.
    linked: Vec<Linked>,
    scratch: MoeScratch,
}

/// The pools of every layer with experts, and what their passes share.
pub(in crate::gpu) struct ExpertPools {
    /// Every pool's slots, in one allocation.
    memory: DeviceBuffer<u8>,
    /// Indexed by layer; `None` for a dense layer.
    layers: Vec<Option<LayerPool>>,
    /// Slots of experts resident by use, and after them the link slots.
    slots_per_layer: usize,
    link_slots: usize,
    link: Link,
    promoter: Promoter,
    /// Promotions' copies, and the event that orders them after a pass's work.
    copies: Stream,
    order: Event,
    /// Whether passes may read missed experts in place once the link is ready, and
    /// what they read them through.
    in_place_allowed: bool,
    in_place: Option<InPlace>,
    /// The bytes of experts not resident that a layer's pass read lately, and whether
    /// they send the passes that could read in place to a split.
    away: Away,
    device: Device,
    spare_events: Vec<Event>,
    /// Passes routed so far, the clock of `Slot::Resident::last`.
    clock: u64,
    stats: ExpertStats,
    host: HostSide,
    /// The slot of each route, as the device's products read it.
    pub(super) slot_ids: DeviceBuffer<i32>,
    /// The host's weighted sum, and ones to add it with.
    pub(super) partial: DeviceBuffer<f32>,
    pub(super) ones: DeviceBuffer<f32>,
}

impl ExpertPools {
    /// Pools of `slots` slots (`link_slots` of them link slots) for each layer of
    /// `plan` with experts, on `device`, for passes of up to `max_tokens` tokens.
    pub fn new(
        device: &Device,
        plan: &ExecutionPlan,
        slots: usize,
        link_slots: usize,
        in_place: bool,
        max_tokens: usize,
        d: usize,
    ) -> Result<ExpertPools, ModelError> {
        // Without a slot in the budget, the link slots are scratch that every layer
        // shares (a layer's routed products finish before the next layer's copies, in
        // the stream's order): one region a matrix, as large as its largest expert.
        let shared_link = slots == 0 && link_slots > 0;
        let link_slots = if shared_link {
            link_slots
        } else {
            link_slots.min(slots)
        };
        let slots = slots - link_slots.min(slots);
        let alloc = gpu("the experts' pools");
        let mut layers = Vec::with_capacity(plan.layers.len());
        let (mut used, mut most_experts) = (0, 0);
        let mut total = 0;
        let mut shared_at = Vec::new();
        if shared_link {
            for layer in &plan.layers {
                let FfnPlan::Experts(e) = &layer.ffn else {
                    continue;
                };
                for (i, m) in matrices(e).enumerate() {
                    if shared_at.len() <= i {
                        shared_at.push(0);
                    }
                    shared_at[i] = shared_at[i].max(expert_bytes(m) as usize);
                }
            }
            for at in shared_at.iter_mut() {
                let bytes = (link_slots * *at).next_multiple_of(256);
                *at = total;
                total += bytes;
            }
            tracing::info!(
                link_slots,
                mib = total >> 20,
                "no slot of experts fits the budget: link slots shared by every layer, \
                 outside it"
            );
        }
        for layer in &plan.layers {
            let FfnPlan::Experts(e) = &layer.ffn else {
                layers.push(None);
                continue;
            };
            used = used.max(e.experts.used);
            most_experts = most_experts.max(e.experts.count);
            let mats: Vec<PoolMatrix> = matrices(e)
                .enumerate()
                .map(|(i, m)| {
                    let expert_bytes = expert_bytes(m) as usize;
                    // Each matrix's slots start on a 256-byte boundary.
                    let at = match shared_at.get(i) {
                        Some(&at) => at,
                        None => {
                            let at = total;
                            total += ((slots + link_slots) * expert_bytes).next_multiple_of(256);
                            at
                        }
                    };
                    PoolMatrix {
                        at,
                        expert_bytes,
                        tensor: m.weight.clone(),
                    }
                })
                .collect();
            let count = e.experts.count;
            layers.push(Some(LayerPool {
                plan: (**e).clone(),
                mats,
                slot_of: vec![None; count],
                slots: (0..slots).map(|_| Slot::Free).collect(),
                uses: vec![0; count],
                routes: 0,
            }));
        }
        let staging = slot_bytes(plan).into_iter().max().unwrap_or(0) as usize;
        let promoter = Promoter::new(device, staging)?;
        let routes = max_tokens * used.max(1);
        // The most rounds a pass takes: every expert of a layer over the link.
        let max_rounds = most_experts.div_ceil(link_slots.max(1)).max(1);
        let pinned = |len: usize| device.alloc_pinned::<f32>(len.max(1)).map_err(&alloc);
        let pinned_i32 = |len: usize| device.alloc_pinned::<i32>(len.max(1)).map_err(&alloc);
        let mut ones = device.alloc::<f32>(max_tokens.max(1)).map_err(&alloc)?;
        let stream = device.new_stream().map_err(gpu("stream"))?;
        stream
            .write_from_host(&vec![1.0f32; max_tokens.max(1)], ones.view_mut())
            .map_err(&alloc)?;
        let memory = device
            .alloc::<u8>(total.max(1))
            .map_err(|source| match source {
                hip_backend::HipError::OutOfMemory { .. } => {
                    super::out_of_memory(device, "the pools of experts", total as u64)
                }
                other => ModelError::Gpu {
                    op: "the experts' pools",
                    source: other,
                },
            })?;
        Ok(ExpertPools {
            memory,
            layers,
            slots_per_layer: slots,
            link_slots,
            link: Link::new(device, pooled_tensors(plan), link_slots),
            promoter,
            copies: stream,
            order: device.new_event().map_err(gpu("event"))?,
            in_place_allowed: in_place,
            in_place: None,
            away: Away::default(),
            device: device.clone(),
            spare_events: Vec::new(),
            clock: 0,
            stats: ExpertStats::default(),
            host: HostSide {
                ids: pinned_i32(routes)?,
                weights: pinned(routes)?,
                h: pinned(max_tokens * d)?,
                slot_ids: pinned_i32(routes * max_rounds)?,
                device_weights: pinned(routes)?,
                partial: pinned(max_tokens * d)?,
                picks: Vec::new(),
                linked: Vec::new(),
                scratch: MoeScratch::default(),
            },
            slot_ids: device.alloc::<i32>(routes.max(1)).map_err(&alloc)?,
            partial: device
                .alloc::<f32>((max_tokens * d).max(1))
                .map_err(&alloc)?,
            ones,
        })
    }

    /// Slots of each layer's pool as the routed products index them: the resident
    /// ones, then the link slots.
    pub fn device_slots(&self) -> usize {
        self.slots_per_layer + self.link_slots
    }

    pub fn stats(&self) -> ExpertStats {
        ExpertStats {
            slots_per_layer: self.slots_per_layer,
            link_slots: if self.link.ready() {
                self.link_slots
            } else {
                0
            },
            resident: self
                .layers
                .iter()
                .flatten()
                .flat_map(|l| &l.slots)
                .filter(|s| matches!(s, Slot::Resident { .. }))
                .count(),
            ..self.stats
        }
    }

    /// Reads back the device's routing of `n` tokens (`ids` and `weights`, `k` routes
    /// each) and the layer's normed input `h` (`d` wide), and waits for them.
    pub fn read_routes(
        &mut self,
        stream: &Stream,
        ids: DeviceView<'_, i32>,
        weights: DeviceView<'_, f32>,
        h: DeviceView<'_, f32>,
    ) -> Result<(), ModelError> {
        let read = gpu("reading a layer's routes back");
        let began = std::time::Instant::now();
        let host = &mut self.host;
        stream
            .copy_d2h_async(ids, &mut host.ids, 0..ids.len())
            .map_err(&read)?;
        stream
            .copy_d2h_async(weights, &mut host.weights, 0..weights.len())
            .map_err(&read)?;
        stream
            .copy_d2h_async(h, &mut host.h, 0..h.len())
            .map_err(&read)?;
        stream.synchronize().map_err(&read)?;
        self.stats.wait_ns += began.elapsed().as_nanos() as u64;
        Ok(())
    }

    /// Counts `spent` splitting routes and queueing copies ([`ExpertStats::queue_ns`]).
    pub fn queued(&mut self, spent: std::time::Duration) {
        self.stats.queue_ns += spent.as_nanos() as u64;
    }

    /// Lands the staged experts, promotes more into free slots, and says whether every
    /// slot of every pool is resident and the link's registration has ended: a step of
    /// waiting for the pools to fill without a pass (the passes fill them too, by use).
    pub fn fill(&mut self) -> Result<bool, ModelError> {
        self.land(None)?;
        self.link.poll();
        let mut full = self.link.settled();
        for (layer, pool) in self.layers.iter_mut().enumerate() {
            let Some(pool) = pool else { continue };
            arrived(pool, &mut self.spare_events, self.clock)?;
            fill_free(&mut self.promoter, &mut self.stats, pool, layer);
            full &= pool
                .slots
                .iter()
                .all(|s| matches!(s, Slot::Resident { .. }));
        }
        Ok(full)
    }

    /// Queues the copies of the experts staged on the host since the last call into
    /// their slots, which serve routes once they have landed; `after` them, the work
    /// queued so far on that stream (a pass read in place that may still read a slot
    /// taken from its expert).
    fn land(&mut self, after: Option<&Stream>) -> Result<(), ModelError> {
        let staged = self.promoter.staged();
        if staged.is_empty() {
            return Ok(());
        }
        if let Some(stream) = after {
            let order = gpu("ordering a promotion after the passes");
            self.order.record(stream).map_err(&order)?;
            self.copies.wait_event(&self.order).map_err(&order)?;
        }
        // A job that could not read its expert frees its slot and fails the call, once
        // every other job has landed.
        let mut failure = None;
        for mut job in staged {
            let Some(Some(pool)) = self.layers.get_mut(job.layer) else {
                unreachable!("a job is sent for a pooled layer")
            };
            if let Some(error) = job.failed.take() {
                pool.slots[job.slot] = Slot::Free;
                pool.slot_of[job.expert] = None;
                self.promoter.give_back(job.buffer);
                failure.get_or_insert(error);
                continue;
            }
            let copy = gpu("promoting an expert");
            let mut from = 0;
            for m in &pool.mats {
                let eb = m.expert_bytes;
                let to = m.at + job.slot * eb;
                let dst = self.memory.slice_mut(to..to + eb).map_err(&copy)?;
                self.copies
                    .copy_h2d_async(&mut job.buffer, from..from + eb, dst)
                    .map_err(&copy)?;
                from += eb;
            }
            let done = match self.spare_events.pop() {
                Some(event) => event,
                None => self.device.new_event().map_err(gpu("event"))?,
            };
            done.record(&self.copies).map_err(&copy)?;
            pool.slots[job.slot] = Slot::Arriving {
                expert: job.expert,
                done,
            };
            self.promoter.give_back(job.buffer);
        }
        failure.map_or(Ok(()), Err)
    }

    /// Queues the copies of the `routes` device routes' weights (into `weights`) that
    /// [`ExpertPools::split`] made, and of the slots of its first round.
    pub fn send_routes(
        &mut self,
        stream: &Stream,
        routes: usize,
        weights: DeviceViewMut<'_, f32>,
    ) -> Result<(), ModelError> {
        let send = gpu("sending a layer's device routes");
        stream
            .copy_h2d_async(&mut self.host.device_weights, 0..routes, weights)
            .map_err(&send)?;
        self.send_round(stream, routes, 0)
    }

    /// Queues the copy of the slots of the `routes` routes in round `round` into
    /// `slot_ids` (after the products of the round before, which read them).
    pub fn send_round(
        &mut self,
        stream: &Stream,
        routes: usize,
        round: usize,
    ) -> Result<(), ModelError> {
        let send = gpu("sending a layer's device routes");
        let slots = self.slot_ids.slice_mut(0..routes).map_err(&send)?;
        let from = round * routes;
        stream
            .copy_h2d_async(&mut self.host.slot_ids, from..from + routes, slots)
            .map_err(&send)
    }

    /// Queues the copies of the experts [`ExpertPools::split`] gave the link in round
    /// `round` into their link slots of layer `layer`, from the registered mapping.
    pub fn fetch_linked(
        &mut self,
        stream: &Stream,
        layer: usize,
        round: usize,
    ) -> Result<(), ModelError> {
        if !self.host.linked.iter().any(|l| l.round == round) {
            return Ok(());
        }
        let Some(registered) = self.link.poll() else {
            unreachable!("experts go over the link only once it is ready")
        };
        let Some(Some(pool)) = self.layers.get(layer) else {
            unreachable!("only a layer with experts is pooled")
        };
        let fetch = gpu("copying a missed expert over the link");
        let linked = self.host.linked.iter().filter(|l| l.round == round);
        for &Linked { expert, slot, .. } in linked {
            for m in &pool.mats {
                let eb = m.expert_bytes;
                let to = m.at + slot * eb;
                let dst = self.memory.slice_mut(to..to + eb).map_err(&fetch)?;
                // SAFETY: the registration lives as long as the pools, whose drop waits
                // for the device first.
                unsafe { registered.copy(stream, &m.tensor, expert * eb, dst) }.map_err(&fetch)?;
            }
        }
        Ok(())
    }

    /// Layer `layer`'s pool's matrices as the routed products take them.
    pub fn matrices(&self, layer: usize) -> Result<Vec<DeviceView<'_, u8>>, ModelError> {
        let pool = self.layer(layer);
        let slots = self.device_slots();
        pool.mats
            .iter()
            .map(|m| {
                self.memory
                    .slice(m.at..m.at + slots * m.expert_bytes)
                    .map_err(gpu("a pool's slots"))
            })
            .collect()
    }

    fn layer(&self, layer: usize) -> &LayerPool {
        let Some(Some(pool)) = self.layers.get(layer) else {
            unreachable!("only a layer with experts is pooled")
        };
        pool
    }

    /// Computes the host's routes of layer `layer` on the `n` rows (`d` wide) of its
    /// normed input read back, and queues the copy of their weighted sums, a row per
    /// token, into `partial`.
    pub fn host_part(
        &mut self,
        stream: &Stream,
        layer: usize,
        n: usize,
        d: usize,
    ) -> Result<(), ModelError> {
        let began = std::time::Instant::now();
        let Some(Some(pool)) = self.layers.get(layer) else {
            unreachable!("only a layer with experts is pooled")
        };
        let host = &mut self.host;
        let h = host.h.as_slice().map_err(gpu("the layer's input"))?;
        let send = gpu("sending the host's experts' sum");
        let partial = host.partial.as_mut_slice().map_err(&send)?;
        let products = std::time::Instant::now();
        // On one of the pool's workers: the products' parallel loops then start where it
        // stands, instead of each handing its work over from this thread and sleeping
        // until the pool is done (two hand-overs a pass, each a thread woken).
        let (plan, picks, scratch) = (&pool.plan, &host.picks, &mut host.scratch);
        on_the_pool(|| routed_part(plan, &h[..n * d], picks, scratch, &mut partial[..n * d]))?;
        self.stats.host_product_ns += products.elapsed().as_nanos() as u64;
        self.stats.host_passes += 1;
        let dst = self.partial.slice_mut(0..n * d).map_err(&send)?;
        stream
            .copy_h2d_async(&mut host.partial, 0..n * d, dst)
            .map_err(&send)?;
        self.stats.host_ns += began.elapsed().as_nanos() as u64;
        Ok(())
    }
}

impl Drop for ExpertPools {
    fn drop(&mut self) {
        // The staging buffers go once the copies from them have run, and the link's
        // registration once the passes' copies from it have.
        self.copies.synchronize().ok();
        if self.link.ready() {
            self.device.synchronize().ok();
        }
    }
}
