//! Experts read in place: once the experts' span of the mapped file is registered and
//! the device reads it as one run, a pass whose routed products are the decode products
//! in tiles of one slot (a few tokens) finds each expert where it is: a resident expert
//! in its slot, any other in the registered mapping, through a table of each expert's
//! address per matrix ([`GpuExperts::from_table`]). A kernel on the device first stages
//! the pass's missed experts from the mapping into a room of their own
//! (`kernels::moe_stage`: loads of whole lines over the link, where the products' own
//! loads of a few bytes there ran at about 30 GB/s) and writes the pass's tables; the
//! products then read device memory. Nothing is read back before the products and the
//! CPU computes no route, so a layer queues its launches as it would with every expert
//! resident and the host runs ahead of the device; the products are the same bits as
//! with every expert resident.
//!
//! The pools still learn from the routes: each layer's are read back after its products
//! (into `log`), and counted at the layer's next pass (the pass before has ended by then:
//! every pass ends synchronized), which promotes and evicts as a split would. A table is
//! sent again only when its layer's residents have changed, before the layer's products
//! of the pass that sees the change. A slot taken from an expert is safe to overwrite
//! once every pass queued before the decision has run: the tables sent after it no
//! longer name the slot for that expert, and the promotion's copy into it waits, on its
//! own stream, for the work queued before it lands (`ExpertPools::land`).

use dequant::gpu::experts::GpuExperts;
use hip_backend::{DeviceBuffer, DeviceView, PinnedBuffer, Stream};

use super::layer::{arrived, Slot};
use super::{ExpertPools, LayerPool};
use crate::gpu::{gpu, kernels};
use crate::ModelError;

/// The most bytes of experts not resident that a layer's pass has read from the host
/// lately (a moving average over layers' passes, [`Away`]) for the
/// passes to keep reading them in place; above it they split their routes, and the CPU
/// takes part of them. Measured on an H200 with 16 cores (`cargo xtask bench-gpu
/// --tokens 64 --prompt 0 --repeat 2 --cpu-moe 12,24,36`, decode tokens/s, in place /
/// split): Qwen3-30B-A3B's shape, about 3 MB an expert, with an even router 102.5 /
/// 91.7 at 7 MB a layer's pass, 64.4 / 65.4 at 13 MB, 47.4 / 56.2 at 19 MB; with the
/// router that favours some experts 221.6 / 182.9 at 1 MB, 124.2 / 115.8 at 4 MB, 74.6
/// / 72.2 at 10 MB; gpt-oss-20b's, 13 MB an expert, 73.0 / 81.7 at 18 MB and 35.3 /
/// 47.1 at 53 MB. Reading in place wins while the link alone carries a layer's misses
/// faster than the link and the CPU together once the split's round trip is paid.
pub(super) const IN_PLACE_MAX_AWAY_BYTES: f64 = 12.0 * 1024.0 * 1024.0;

/// The weight of a layer's pass in the moving average of the bytes read from the host.
const AWAY_WEIGHT: f64 = 1.0 / 64.0;

/// The moving average of the bytes of experts not resident that a layer's pass read,
/// and whether it sends the passes that could read in place to a split (each change
/// logged).
#[derive(Default)]
pub(super) struct Away {
    bytes: f64,
    splitting: bool,
}

impl Away {
    /// Adds a layer's pass that read `bytes`.
    pub fn note(&mut self, bytes: usize) {
        self.bytes += AWAY_WEIGHT * (bytes as f64 - self.bytes);
    }

    /// Whether the passes split their routes now: the average above
    /// [`IN_PLACE_MAX_AWAY_BYTES`].
    pub fn splits(&mut self) -> bool {
        let split = self.bytes > IN_PLACE_MAX_AWAY_BYTES;
        if split != self.splitting {
            self.splitting = split;
            tracing::debug!(
                mib_a_layer = self.bytes / (1024.0 * 1024.0),
                "passes of a few tokens {} their missed experts",
                if split {
                    "split the routes to"
                } else {
                    "read in place"
                }
            );
        }
        split
    }
}

/// Slots a pass read in place may have, in experts a token uses: the room to stage
/// their experts in (device memory outside the budget) holds this many a token.
const STAGED_TOKENS: usize = 2;

/// The tables of experts' addresses, the room to stage missed experts in, and the routes
/// read back.
pub(super) struct InPlace {
    /// Every pooled layer's tables, a matrix's after another (`gate` if any, `up`,
    /// `down`), each the address of each expert's matrix as the device reads it.
    tables: DeviceBuffer<u64>,
    /// The tables a pass's products read (its staged experts in their rooms), and the
    /// rooms: `staged_slots` of the largest layer's room.
    pass: DeviceBuffer<u64>,
    staged: DeviceBuffer<u8>,
    staged_slots: usize,
    /// The device's addresses of the registered mapping.
    mapped: std::ops::Range<u64>,
    /// Per layer (`None` without experts): where its tables start in `tables`, what
    /// they hold as last sent, its page-locked copy on the way, and the device's
    /// address of each matrix's experts in the registered mapping.
    layers: Vec<Option<LayerTables>>,
    /// Each layer's routes of its last pass, `staged_slots` entries a layer.
    log: PinnedBuffer<i32>,
    /// Layers whose routes in `log` are not counted yet, and how many they are.
    pending: Vec<(usize, usize)>,
}

struct LayerTables {
    at: usize,
    mat_bytes: Vec<usize>,
    /// A slot's room to stage this layer's experts in (`kernels::stage_room`).
    room: usize,
    sent: Option<Vec<u64>>,
    staging: PinnedBuffer<u64>,
    mapped: Vec<u64>,
}

impl InPlace {
    /// Tables for `layers` (the pools' own, by layer), the experts' bytes in the mapping
    /// at the device addresses `address` gives for a matrix's first expert (`mapped`:
    /// the mapping's); `None` where the mapping holds some matrix only in part.
    pub fn new(
        device: &hip_backend::Device,
        layers: &[Option<LayerPool>],
        address: impl Fn(&super::PoolMatrix) -> Option<u64>,
        mapped: std::ops::Range<u64>,
    ) -> Result<Option<InPlace>, ModelError> {
        let alloc = gpu("the tables of experts read in place");
        let (mut total, mut most, mut room, mut used) = (0, 0, 0, 0);
        let mut tables = Vec::with_capacity(layers.len());
        for pool in layers {
            let Some(pool) = pool else {
                tables.push(None);
                continue;
            };
            let count = pool.slot_of.len();
            let mut bases = Vec::with_capacity(pool.mats.len());
            for m in &pool.mats {
                let Some(base) = address(m) else {
                    return Ok(None);
                };
                bases.push(base);
            }
            let entries = count * pool.mats.len();
            let mat_bytes: Vec<usize> = pool.mats.iter().map(|m| m.expert_bytes).collect();
            let layer_room = kernels::stage_room(&mat_bytes).0;
            room = room.max(layer_room);
            most = most.max(entries);
            used = used.max(pool.plan.experts.used);
            tables.push(Some(LayerTables {
                at: total,
                mat_bytes,
                room: layer_room,
                sent: None,
                staging: device.alloc_pinned::<u64>(entries).map_err(&alloc)?,
                mapped: bases,
            }));
            total += entries;
        }
        let staged_slots = STAGED_TOKENS * used.max(1);
        tracing::info!(
            mib = (staged_slots * room) >> 20,
            "room to stage the missed experts of a pass read in place, outside the budget"
        );
        Ok(Some(InPlace {
            tables: device.alloc::<u64>(total.max(1)).map_err(&alloc)?,
            pass: device.alloc::<u64>(most.max(1)).map_err(&alloc)?,
            staged: device
                .alloc::<u8>((staged_slots * room).max(1))
                .map_err(&alloc)?,
            staged_slots,
            mapped,
            layers: tables,
            log: device
                .alloc_pinned::<i32>((staged_slots * layers.len()).max(1))
                .map_err(&alloc)?,
            pending: Vec::new(),
        }))
    }
}

impl ExpertPools {
    /// The tables of layer `layer`'s matrices (`gate` if any, `up`, `down`) for a pass
    /// of the routes `ids` whose products are the decode products in tiles of one slot,
    /// once the experts can be read in place (else `None`: the pass splits its routes).
    /// Counts the routes of the passes before, lands promotions, queues the layer's
    /// tables on `stream` where its residents have changed, and stages the pass's
    /// missed experts.
    pub fn in_place(
        &mut self,
        layer: usize,
        ids: DeviceView<'_, i32>,
        stream: &Stream,
    ) -> Result<Option<Vec<DeviceView<'_, u64>>>, ModelError> {
        let routes = ids.len();
        if !self.open_in_place() {
            return Ok(None);
        }
        let Some(ip) = self.in_place.as_mut() else {
            unreachable!("opened just above")
        };
        if routes > ip.staged_slots {
            return Ok(None);
        }
        if ip.pending.iter().any(|&(l, _)| l == layer) {
            self.count_in_place()?;
        }
        if self.away.splits() {
            return Ok(None);
        }
        self.land(Some(stream))?;
        self.clock += 1;
        let Some(Some(pool)) = self.layers.get_mut(layer) else {
            unreachable!("only a layer with experts is pooled")
        };
        arrived(pool, &mut self.spare_events, self.clock)?;
        let Some(ip) = self.in_place.as_mut() else {
            unreachable!("set above")
        };
        let Some(Some(tables)) = ip.layers.get_mut(layer) else {
            unreachable!("a pooled layer has tables")
        };
        let pool: &LayerPool = pool;
        let count = pool.slot_of.len();
        let want = table(pool, &tables.mapped, self.memory.view().as_ptr() as u64);
        let entries = want.len();
        if tables.sent.as_ref() != Some(&want) {
            let send = gpu("sending a layer's table of experts");
            let staging = tables.staging.as_mut_slice().map_err(&send)?;
            staging.copy_from_slice(&want);
            let dst = ip
                .tables
                .slice_mut(tables.at..tables.at + entries)
                .map_err(&send)?;
            stream
                .copy_h2d_async(&mut tables.staging, 0..entries, dst)
                .map_err(&send)?;
            tables.sent = Some(want);
        }
        // The missed experts staged over the link, and the tables that find them.
        let stage = gpu("staging a pass's missed experts");
        let staging = kernels::Staging {
            tables: ip
                .tables
                .slice(tables.at..tables.at + entries)
                .map_err(&stage)?,
            count,
            mat_bytes: &tables.mat_bytes,
            mapped: ip.mapped.clone(),
        };
        kernels::moe_stage(
            ids,
            &staging,
            ip.staged
                .slice_mut(0..routes * tables.room)
                .map_err(&stage)?,
            ip.pass.slice_mut(0..entries).map_err(&stage)?,
            stream,
        )?;
        (0..pool.mats.len())
            .map(|m| {
                let from = m * count;
                ip.pass
                    .slice(from..from + count)
                    .map_err(gpu("a layer's table of experts"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// Whether the passes may read in place: the tables and the room made once the link
    /// is registered (the passes split until then, and for good where the device does
    /// not read the mapping as one run or the allocations fail: reading in place only
    /// spares them their round trips).
    fn open_in_place(&mut self) -> bool {
        if !self.in_place_allowed || self.in_place.is_some() {
            return self.in_place_allowed;
        }
        let Some(registered) = self.link.poll() else {
            return false;
        };
        let address = |m: &super::PoolMatrix| {
            let last = m.tensor.size().checked_sub(1)?;
            registered.device_address(&m.tensor, last)?;
            registered.device_address(&m.tensor, 0)
        };
        let mapped = registered.device_range().unwrap_or(0..0);
        match InPlace::new(&self.device, &self.layers, address, mapped) {
            Ok(Some(in_place)) => {
                tracing::info!("missed experts read in place over the link");
                self.in_place = Some(in_place);
            }
            Ok(None) => {
                tracing::info!(
                    "missed experts copied over the link: the mapping is not read in place"
                );
                self.in_place_allowed = false;
            }
            Err(error) => {
                let why = "missed experts copied over the link, not read in place";
                tracing::info!(%error, "{why}");
                self.in_place_allowed = false;
            }
        }
        self.in_place_allowed
    }

    /// Queues the read back of layer `layer`'s routes `ids` (a pass read in place), to be
    /// counted at the layer's next pass.
    pub fn log_routes(
        &mut self,
        layer: usize,
        ids: DeviceView<'_, i32>,
        stream: &Stream,
    ) -> Result<(), ModelError> {
        let Some(ip) = self.in_place.as_mut() else {
            unreachable!("only a pass read in place logs its routes")
        };
        let at = layer * ip.staged_slots;
        stream
            .copy_d2h_async(ids, &mut ip.log, at..at + ids.len())
            .map_err(gpu("reading a layer's routes back"))?;
        ip.pending.push((layer, ids.len()));
        Ok(())
    }

    /// Adds a layer's pass that read `bytes` of experts not resident (from the mapping,
    /// over the link or on the CPU) to the average the passes choose by.
    pub(super) fn note_away(&mut self, bytes: usize) {
        self.away.note(bytes);
    }

    /// Counts the routes logged by passes read in place (they have ended: their log's
    /// copies are waited for), as a split counts its own, with their promotions.
    fn count_in_place(&mut self) -> Result<(), ModelError> {
        let Some(ip) = self.in_place.as_mut() else {
            return Ok(());
        };
        let per_layer = ip.staged_slots;
        let log = ip.log.as_slice().map_err(gpu("the routes read back"))?;
        // The pending layers' routes alone, out of the log (the counting needs `self`).
        let pending: Vec<(usize, Vec<i32>)> = std::mem::take(&mut ip.pending)
            .into_iter()
            .map(|(layer, n)| (layer, log[layer * per_layer..][..n].to_vec()))
            .collect();
        for (layer, ids) in pending {
            let n = ids.len();
            self.clock += 1;
            let counted = self.count_routes(layer, &ids)?;
            let hits = counted.slots.iter().filter(|s| s.is_some()).count();
            self.stats.in_place += (n - hits) as u64;
            self.admit(layer, n, counted.missed, &[]);
        }
        Ok(())
    }
}

/// The table of `pool`'s matrices: each expert's address in the pools' `memory` while
/// it is resident, else in the mapping (at `mapped[m]` for matrix `m`'s first expert).
fn table(pool: &LayerPool, mapped: &[u64], memory: u64) -> Vec<u64> {
    let count = pool.slot_of.len();
    let mut table = Vec::with_capacity(count * pool.mats.len());
    for (m, &mapped) in pool.mats.iter().zip(mapped) {
        let eb = m.expert_bytes as u64;
        table.extend((0..count).map(|x| match pool.slot_of[x] {
            Some(slot) if matches!(pool.slots[slot], Slot::Resident { .. }) => {
                memory + m.at as u64 + slot as u64 * eb
            }
            _ => mapped + x as u64 * eb,
        }));
    }
    table
}

/// Layer matrix `index`'s experts (`tensor`) where `tables[index]` places them.
pub(in crate::gpu) fn tables_of<'a>(
    tables: &[DeviceView<'a, u64>],
    tensor: &crate::gpu::weights::ExpertTensor,
    index: usize,
) -> Result<GpuExperts<'a>, ModelError> {
    let Some(&table) = tables.get(index) else {
        unreachable!("a table a pooled matrix")
    };
    // SAFETY: each entry is the address of one of the tensor's experts: its slot in the
    // pools' memory (which lives as long as the pools) while resident, else its bytes in
    // the registered mapping (registered as long as the pools, which wait for the device
    // before dropping it). A slot's entry is replaced before the pass that follows the
    // slot's reassignment, and the promotion's copy into it lands after that decision.
    unsafe { GpuExperts::from_table(tensor.ty, tensor.rows, tensor.cols, table) }.map_err(
        |source| ModelError::Matmul {
            name: tensor.name().to_owned(),
            source,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_split_once_they_read_more_than_the_threshold_from_the_host_lately() {
        const MB: usize = 1 << 20;
        let mut away = Away::default();
        assert!(!away.splits(), "a pool starts reading in place");
        // One heavy pass moves the average by a 64th of its bytes: gpt-oss-20b's
        // four missed experts of 13 MB do not switch it alone.
        away.note(53 * MB);
        assert!(!away.splits());
        // Layers' passes of 19 MB (Qwen3-30B-A3B's shape at -ncmoe 36) switch it.
        for _ in 0..200 {
            away.note(19 * MB);
        }
        assert!(away.splits());
        // Passes of 7 MB (its -ncmoe 12) bring the passes back in place.
        for _ in 0..200 {
            away.note(7 * MB);
        }
        assert!(!away.splits());
        // Just below and just above the threshold, once the average has settled.
        let settled = |bytes: usize| {
            let mut away = Away::default();
            for _ in 0..2000 {
                away.note(bytes);
            }
            away.splits()
        };
        assert!(!settled(12 * MB - 4096));
        assert!(settled(12 * MB + 4096));
    }
}
