//! One layer's pool: its slots, which expert each holds, how lately and how often each
//! expert was routed, and the choices those make (which slots have landed, which
//! expert a free slot takes, which expert a newcomer evicts).

use hip_backend::{Event, PinnedBuffer};
use tensor_store::TensorHandle;

use super::promoter::{Job, Promoter};
use super::ExpertStats;
use crate::gpu::gpu;
use crate::plan::ExpertsPlan;
use crate::ModelError;

/// A slot of a layer's pool.
pub(super) enum Slot {
    Free,
    /// Its expert's bytes are being staged on the host.
    Staging,
    /// Its expert's copy is queued; it serves routes once `done` has passed.
    Arriving {
        expert: usize,
        done: Event,
    },
    /// Serving routes; `last`: the pass that last routed a token to it.
    Resident {
        expert: usize,
        last: u64,
    },
}

/// One of a pooled expert's matrices: where its slots are in the pools' memory, and
/// where the experts' bytes are in the file.
pub(super) struct PoolMatrix {
    /// The slots' bytes within `ExpertPools::memory`.
    pub(super) at: usize,
    pub(super) expert_bytes: usize,
    pub(super) tensor: TensorHandle,
}

/// The pool of one layer with experts.
pub(super) struct LayerPool {
    pub(super) plan: ExpertsPlan,
    /// `gate` (if the experts have one), `up`, `down`.
    pub(super) mats: Vec<PoolMatrix>,
    /// Each expert's slot, resident or arriving.
    pub(super) slot_of: Vec<Option<usize>>,
    pub(super) slots: Vec<Slot>,
    /// Routes to each expert lately (halved every `AGING_ROUTES_PER_EXPERT · count`).
    pub(super) uses: Vec<u32>,
    pub(super) routes: u64,
}

/// The slots of `pool` whose copies have landed become resident (`clock`: now).
pub(super) fn arrived(
    pool: &mut LayerPool,
    spare: &mut Vec<Event>,
    clock: u64,
) -> Result<(), ModelError> {
    for slot in pool.slots.iter_mut() {
        if let Slot::Arriving { expert, done } = slot {
            if done.is_complete().map_err(gpu("a promotion's copy"))? {
                let expert = *expert;
                let resident = Slot::Resident {
                    expert,
                    last: clock,
                };
                let Slot::Arriving { done, .. } = std::mem::replace(slot, resident) else {
                    unreachable!("matched just above")
                };
                spare.push(done);
            }
        }
    }
    Ok(())
}

/// Hands expert `expert` of layer `layer` to the promoter, for slot `slot` of its pool,
/// staged in `buffer`.
pub(super) fn promote(
    promoter: &mut Promoter,
    stats: &mut ExpertStats,
    pool: &mut LayerPool,
    layer: usize,
    slot: usize,
    expert: usize,
    buffer: PinnedBuffer<u8>,
) {
    pool.slots[slot] = Slot::Staging;
    pool.slot_of[expert] = Some(slot);
    let parts = pool
        .mats
        .iter()
        .map(|m| {
            let eb = m.expert_bytes;
            (m.tensor.clone(), expert * eb..(expert + 1) * eb)
        })
        .collect();
    promoter.send(Job {
        layer,
        slot,
        expert,
        parts,
        buffer,
        failed: None,
    });
    stats.promotions += 1;
    tracing::debug!(layer, expert, slot, "expert promoted");
}

/// While `pool` has free slots and the promoter staging buffers, promotes the experts
/// routed most often lately (the lowest index first among equals) that are not in it.
pub(super) fn fill_free(
    promoter: &mut Promoter,
    stats: &mut ExpertStats,
    pool: &mut LayerPool,
    layer: usize,
) {
    while let Some(slot) = pool.slots.iter().position(|s| matches!(s, Slot::Free)) {
        let Some(expert) = (0..pool.slot_of.len())
            .filter(|&x| pool.slot_of[x].is_none())
            .max_by_key(|&x| (pool.uses[x], std::cmp::Reverse(x)))
        else {
            return;
        };
        let Some(buffer) = promoter.buffer() else {
            return;
        };
        promote(promoter, stats, pool, layer, slot, expert, buffer);
    }
}
