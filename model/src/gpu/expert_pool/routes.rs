//! A pass's routes split: each to a resident expert's slot, to a link slot in one of
//! the pass's rounds, or to the host; and the promotions the misses call for.

use super::layer::{arrived, fill_free, promote, Slot};
use super::link::over_the_link;
use super::{ExpertPools, AGING_ROUTES_PER_EXPERT};
use crate::cpu::Pick;
use crate::gpu::gpu;
use crate::ModelError;

/// How a layer's routes were split: how many go to the host, and in how many rounds of
/// products the device's go (none without any; else one, and one more for each time
/// the link slots fill up).
pub(in crate::gpu) struct Split {
    pub on_host: usize,
    pub rounds: usize,
}

/// A layer's routes counted: each route's resident slot (`None`: missed), and the
/// missed experts not in the pool, in the order first routed.
pub(super) struct Counted {
    pub slots: Vec<Option<usize>>,
    pub missed: Vec<usize>,
}

/// A missed expert brought over the link: its round and link slot.
pub(super) struct Linked {
    pub expert: usize,
    pub round: usize,
    pub slot: usize,
}

impl ExpertPools {
    /// Splits the `n · k` routes read back ([`ExpertPools::read_routes`]) of layer
    /// `layer` between the device (the slots of resident experts and of the link's, in
    /// `host.slot_ids` a round after another, with their weights in
    /// `host.device_weights`; the host's routes are slot -1, weighted 0) and the host
    /// (`host.picks`), and queues the promotions of missed experts.
    pub fn split(&mut self, layer: usize, n: usize, k: usize) -> Result<Split, ModelError> {
        self.clock += 1;
        let clock = self.clock;
        self.land(None)?;
        let Some(Some(pool)) = self.layers.get_mut(layer) else {
            unreachable!("only a layer with experts is pooled")
        };
        arrived(pool, &mut self.spare_events, clock)?;
        let routes = n * k;
        let ids = self.host.ids.as_slice().map_err(gpu("the routes"))?[..routes].to_vec();
        let counted = self.count_routes(layer, &ids)?;
        let Some(Some(pool)) = self.layers.get(layer) else {
            unreachable!("only a layer with experts is pooled")
        };
        let host = &mut self.host;
        let weights = host.weights.as_slice().map_err(gpu("the routes"))?;
        let slot_ids = host.slot_ids.as_mut_slice().map_err(gpu("the routes"))?;
        let device_weights = host
            .device_weights
            .as_mut_slice()
            .map_err(gpu("the routes"))?;
        host.picks.clear();
        let mut in_use = vec![false; pool.slots.len()];
        for (i, slot) in counted.slots.iter().enumerate() {
            match *slot {
                Some(s) => {
                    in_use[s] = true;
                    slot_ids[i] = s as i32;
                    device_weights[i] = weights[i];
                }
                None => {
                    host.picks.push(Pick {
                        token: i / k,
                        rank: i % k,
                        expert: ids[i] as usize,
                        weight: weights[i],
                    });
                    device_weights[i] = 0.0;
                    slot_ids[i] = -1;
                }
            }
        }
        let missed_routes = host.picks.len();
        // Some of the missed experts over the link, when it is ready: in rounds of as
        // many as there are link slots, each round's routes in slot ids of their own
        // (the routes of the others -1: left out of that round's products).
        host.linked.clear();
        let mut rounds = 1;
        if self.link_slots > 0 && self.link.poll().is_some() {
            let per_round = self.link_slots;
            let linked = over_the_link(&host.picks, n, per_round);
            rounds = linked.len().div_ceil(per_round).max(1);
            slot_ids[routes..rounds * routes].fill(-1);
            host.linked
                .extend(linked.into_iter().enumerate().map(|(j, expert)| Linked {
                    expert,
                    round: j / per_round,
                    slot: self.slots_per_layer + j % per_round,
                }));
            let linked = &host.linked;
            host.picks.retain(|p| {
                let Some(l) = linked.iter().find(|l| l.expert == p.expert) else {
                    return true;
                };
                let i = p.token * k + p.rank;
                slot_ids[l.round * routes + i] = l.slot as i32;
                device_weights[i] = p.weight;
                false
            });
        }
        let on_host = host.picks.len();
        self.stats.linked += (missed_routes - on_host) as u64;
        self.admit(layer, routes, counted.missed, &in_use);
        Ok(Split {
            on_host,
            rounds: if on_host < routes { rounds } else { 0 },
        })
    }

    /// Counts the routes `ids` of layer `layer` (the pass now, `self.clock`): each
    /// expert's uses, and each resident one's last pass, with the hits and misses; gives
    /// each route's resident slot and the experts missed that are not in the pool.
    pub(super) fn count_routes(
        &mut self,
        layer: usize,
        ids: &[i32],
    ) -> Result<Counted, ModelError> {
        let clock = self.clock;
        let Some(Some(pool)) = self.layers.get_mut(layer) else {
            unreachable!("only a layer with experts is pooled")
        };
        let count = pool.slot_of.len();
        let mut counted = Counted {
            slots: Vec::with_capacity(ids.len()),
            missed: Vec::new(),
        };
        // The experts not resident, distinct: the bytes the pass reads from the host.
        let mut away: Vec<usize> = Vec::new();
        for &id in ids {
            let expert = usize::try_from(id)
                .ok()
                .filter(|&x| x < count)
                .ok_or_else(|| {
                    ModelError::InvalidBatch(format!(
                        "layer {layer}'s router chose expert {id} of {count}"
                    ))
                })?;
            pool.uses[expert] = pool.uses[expert].saturating_add(1);
            match pool.slot_of[expert].map(|s| (s, &mut pool.slots[s])) {
                Some((s, Slot::Resident { last, .. })) => {
                    *last = clock;
                    counted.slots.push(Some(s));
                }
                _ => {
                    counted.slots.push(None);
                    if !away.contains(&expert) {
                        away.push(expert);
                    }
                    if pool.slot_of[expert].is_none() && !counted.missed.contains(&expert) {
                        counted.missed.push(expert);
                    }
                }
            }
        }
        let expert_bytes: usize = pool.mats.iter().map(|m| m.expert_bytes).sum();
        self.note_away(away.len() * expert_bytes);
        let hits = counted.slots.iter().filter(|s| s.is_some()).count();
        self.stats.hits += hits as u64;
        self.stats.misses += (ids.len() - hits) as u64;
        Ok(counted)
    }

    /// After layer `layer`'s `routes` routes were counted: ages its counts, and
    /// promotes the experts `missed` (not in the pool) that earn a slot, evicting at
    /// most one expert not `in_use` by the pass, then fills the free slots.
    pub(super) fn admit(
        &mut self,
        layer: usize,
        routes: usize,
        mut missed: Vec<usize>,
        in_use: &[bool],
    ) {
        let Some(Some(pool)) = self.layers.get_mut(layer) else {
            unreachable!("only a layer with experts is pooled")
        };
        let count = pool.slot_of.len();
        pool.routes += routes as u64;
        if pool.routes >= AGING_ROUTES_PER_EXPERT * count as u64 {
            pool.routes = 0;
            pool.uses.iter_mut().for_each(|u| *u /= 2);
        }
        // The most routed of the missed first.
        missed.sort_by_key(|&x| std::cmp::Reverse(pool.uses[x]));
        let mut evicted_now = false;
        for expert in missed {
            let Some(buffer) = self.promoter.buffer() else {
                break;
            };
            let slot = match pool.slots.iter().position(|s| matches!(s, Slot::Free)) {
                Some(free) => Some(free),
                // One eviction a layer a pass, of the least recently routed expert not in
                // use now, routed at most half as often lately as the newcomer: an even
                // router's counts differ by chance, and each eviction copies an expert.
                None if !evicted_now => pool
                    .slots
                    .iter()
                    .enumerate()
                    .filter_map(|(s, slot)| match slot {
                        Slot::Resident { expert, last }
                            if !in_use.get(s).copied().unwrap_or(false) =>
                        {
                            Some((s, *expert, *last))
                        }
                        _ => None,
                    })
                    .min_by_key(|&(_, _, last)| last)
                    .filter(|&(_, old, _)| pool.uses[expert] >= 2 * pool.uses[old] + 2)
                    .map(|(s, old, _)| {
                        pool.slot_of[old] = None;
                        self.stats.evictions += 1;
                        evicted_now = true;
                        tracing::debug!(layer, expert = old, "expert evicted");
                        s
                    }),
                None => None,
            };
            let Some(slot) = slot else {
                self.promoter.give_back(buffer);
                break;
            };
            promote(
                &mut self.promoter,
                &mut self.stats,
                pool,
                layer,
                slot,
                expert,
                buffer,
            );
        }
        // Free slots take the most routed experts not in the pool yet.
        fill_free(&mut self.promoter, &mut self.stats, pool, layer);
    }
}
