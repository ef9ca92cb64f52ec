//! Several schedulers serving one model, each with its own copy of the weights and its
//! own KV pool (one a GPU, for a model that one GPU holds), behind one queue of
//! requests: [`Replicas`] sends each request to one of them.
//!
//! The choice follows the prompt's cache first, the load second, as prefix-aware
//! routers do between servers. Each replica's pool keeps the blocks of earlier prompts
//! for reuse, so a conversation's next turn, or a prompt sharing a long system prompt,
//! computes less on the replica that read its beginning. [`Replicas`] remembers which
//! full blocks of prompts it sent where (chained hashes of their tokens, as many as the
//! replica's pool holds) and sends a prompt to the replica holding its longest run of
//! leading blocks, unless that replica has more requests in flight than the least
//! loaded one by more than [`slack`]; then, and for prompts no replica has seen, the
//! least loaded replica takes it (ties in turn). A replica whose queue is full, or
//! whose scheduler has stopped, passes the request to the next in that order.
//!
//! With one replica this is the scheduler itself: nothing is hashed or counted.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::ServeError;
use super::{EmbedRequest, LogprobsRequest, Request, Scheduler, SchedulerConfig, SchedulerMetrics};
use crate::tokenizer::TokenId;

/// The schedulers of one model and the books of where prompts went.
pub struct Replicas {
    schedulers: Vec<Scheduler>,
    /// Completions sent to each replica and not yet ended (their event sinks alive).
    in_flight: Vec<Arc<AtomicUsize>>,
    prefixes: Mutex<Vec<PrefixIndex>>,
    /// Where ties start, moved on by each choice.
    turn: AtomicUsize,
}

impl Replicas {
    /// Serves with `schedulers` (at least one), all running the same model.
    ///
    /// # Panics
    /// If `schedulers` is empty.
    pub fn new(schedulers: Vec<Scheduler>) -> Replicas {
        assert!(!schedulers.is_empty(), "replicas of no scheduler");
        let prefixes = schedulers
            .iter()
            .map(|s| PrefixIndex::new(s.config.pool_positions / s.config.block_size.max(1)))
            .collect();
        Replicas {
            in_flight: schedulers.iter().map(|_| Arc::default()).collect(),
            schedulers,
            prefixes: Mutex::new(prefixes),
            turn: AtomicUsize::new(0),
        }
    }

    /// How many replicas serve.
    pub fn len(&self) -> usize {
        self.schedulers.len()
    }

    /// Always false: there is at least one replica.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The replicas' schedulers, in the order they were given.
    pub fn schedulers(&self) -> &[Scheduler] {
        &self.schedulers
    }

    /// Each replica's configuration is this one (its pool its own).
    pub fn config(&self) -> &SchedulerConfig {
        self.schedulers[0].config()
    }

    /// The counters of every replica added up (gauges too: requests running and
    /// waiting, blocks of the pools), or the one replica's own.
    pub fn metrics(&self) -> Arc<SchedulerMetrics> {
        match self.schedulers.as_slice() {
            [one] => Arc::clone(one.metrics()),
            all => {
                let parts: Vec<&SchedulerMetrics> = all.iter().map(|s| &**s.metrics()).collect();
                Arc::new(SchedulerMetrics::total(&parts))
            }
        }
    }

    /// Queues a request on the replica [`Replicas`] chooses for its prompt.
    pub fn submit(&self, request: Request) -> Result<(), ServeError> {
        self.submit_with(request, None)
    }

    /// As [`Scheduler::submit_with`], on the replica chosen for the prompt.
    pub fn submit_with(
        &self,
        mut request: Request,
        logprobs: Option<LogprobsRequest>,
    ) -> Result<(), ServeError> {
        if let [one] = self.schedulers.as_slice() {
            return one.submit_with(request, logprobs);
        }
        let block = self.config().block_size.max(1);
        let hashes = block_hashes(&request.prompt, block);
        let replica = {
            let mut prefixes = self.prefixes.lock().map_err(|_| ServeError::ShuttingDown)?;
            let matched: Vec<usize> = prefixes.iter().map(|p| p.matched(&hashes)).collect();
            let order = choose(&self.loads(), &matched, self.next_turn());
            // The first replica in that order that runs and has room in its queue takes
            // it (another request may take that room first: then this one is refused as
            // a full queue is, as on one scheduler).
            let limit = self.config().max_queue;
            let takes = |i: usize| {
                let s = &self.schedulers[i];
                s.is_running() && s.waiting.load(Ordering::SeqCst) < limit
            };
            let replica = order
                .iter()
                .copied()
                .find(|&i| takes(i))
                .unwrap_or(order[0]);
            prefixes[replica].insert(&hashes);
            replica
        };
        let counter = Arc::clone(&self.in_flight[replica]);
        counter.fetch_add(1, Ordering::SeqCst);
        let guard = InFlight(counter);
        let mut events = request.events;
        request.events = Box::new(move |event| {
            let _ = &guard;
            events(event)
        });
        self.schedulers[replica].submit_with(request, logprobs)
    }

    /// Queues an embeddings request on the least loaded replica that runs.
    pub fn embed(&self, request: EmbedRequest) -> Result<(), ServeError> {
        let order = choose(&self.loads(), &vec![0; self.len()], self.next_turn());
        let replica = order
            .iter()
            .copied()
            .find(|&i| self.schedulers[i].is_running())
            .unwrap_or(order[0]);
        self.schedulers[replica].embed(request)
    }

    /// Stops every replica as [`Scheduler::shutdown`] does, all at once.
    pub fn shutdown(&self, grace: Duration) {
        std::thread::scope(|scope| {
            for scheduler in &self.schedulers {
                scope.spawn(move || scheduler.shutdown(grace));
            }
        });
    }

    /// Each replica's load: completions sent and not ended, plus requests of either kind
    /// still in its queue (a completion waiting to start counts twice: it has the most
    /// time ahead of it).
    fn loads(&self) -> Vec<usize> {
        self.schedulers
            .iter()
            .zip(&self.in_flight)
            .map(|(s, n)| n.load(Ordering::SeqCst) + s.waiting.load(Ordering::SeqCst))
            .collect()
    }

    fn next_turn(&self) -> usize {
        self.turn.fetch_add(1, Ordering::Relaxed)
    }
}

/// Counts a completion in flight on a replica until its event sink is dropped (when the
/// scheduler ends or drops the request, or refuses it).
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How many more requests than the least loaded replica's `min_load` the replica
/// holding a prompt's prefix may have in flight and still take it: a quarter more, and
/// at least two (a prefix saves its prompt's computation, not more than a few
/// sequences' share of the steps).
fn slack(min_load: usize) -> usize {
    (min_load / 4).max(2)
}

/// The replicas in the order to try them, for loads `loads` (requests in flight) and
/// `matched` (leading blocks of the prompt each holds): the one with the longest match
/// first if it is within [`slack`] of the least load, else by load; ties go in turn
/// from `turn`.
fn choose(loads: &[usize], matched: &[usize], turn: usize) -> Vec<usize> {
    let n = loads.len();
    let min_load = loads.iter().copied().min().unwrap_or(0);
    let rotated = |i: usize| (i + n - turn % n) % n;
    let mut order: Vec<usize> = (0..n).collect();
    // By load, then the longer match, then in turn.
    order.sort_by_key(|&i| (loads[i], std::cmp::Reverse(matched[i]), rotated(i)));
    let best = (0..n)
        .filter(|&i| matched[i] > 0 && loads[i] <= min_load + slack(min_load))
        .max_by_key(|&i| {
            (
                matched[i],
                std::cmp::Reverse(loads[i]),
                std::cmp::Reverse(rotated(i)),
            )
        });
    if let Some(best) = best {
        order.retain(|&i| i != best);
        order.insert(0, best);
    }
    order
}

/// The chained hashes of the full blocks of `prompt` (`block` tokens each): the k-th
/// stands for the prompt's first k+1 blocks.
fn block_hashes(prompt: &[TokenId], block: usize) -> Vec<u64> {
    let mut hasher = DefaultHasher::new();
    prompt
        .chunks_exact(block.max(1))
        .map(|tokens| {
            tokens.hash(&mut hasher);
            hasher.finish()
        })
        .collect()
}

/// The prompt blocks sent to one replica, the most recent `capacity` kept (as many as
/// its pool holds: older ones it has most likely evicted).
struct PrefixIndex {
    /// Block hash → when it was last sent.
    blocks: HashMap<u64, u64>,
    clock: u64,
    capacity: usize,
}

impl PrefixIndex {
    fn new(capacity: usize) -> PrefixIndex {
        PrefixIndex {
            blocks: HashMap::new(),
            clock: 0,
            capacity: capacity.max(1),
        }
    }

    /// Leading blocks of `hashes` sent here.
    fn matched(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count()
    }

    fn insert(&mut self, hashes: &[u64]) {
        for &h in hashes {
            self.clock += 1;
            self.blocks.insert(h, self.clock);
        }
        if self.blocks.len() > 2 * self.capacity {
            let keep_from = self.clock.saturating_sub(self.capacity as u64);
            self.blocks.retain(|_, &mut at| at > keep_from);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unseen_prompts_go_to_the_least_loaded_replica_in_turn() {
        assert_eq!(choose(&[3, 1, 2], &[0, 0, 0], 0), [1, 2, 0]);
        // Equal loads: each turn starts one further.
        assert_eq!(choose(&[0, 0], &[0, 0], 0)[0], 0);
        assert_eq!(choose(&[0, 0], &[0, 0], 1)[0], 1);
        assert_eq!(choose(&[0, 0], &[0, 0], 2)[0], 0);
    }

    #[test]
    fn a_prefix_keeps_its_replica_within_the_slack() {
        // Replica 0 holds four blocks of the prompt, replica 1 none.
        assert_eq!(choose(&[2, 0], &[4, 0], 0), [0, 1]);
        assert_eq!(choose(&[3, 0], &[4, 0], 1), [1, 0]);
        assert_eq!(choose(&[10, 8], &[4, 0], 0), [0, 1]);
        assert_eq!(choose(&[11, 8], &[4, 0], 0), [1, 0]);
        // The longer match wins among replicas within the slack.
        assert_eq!(choose(&[1, 0, 0], &[2, 5, 1], 0), [1, 2, 0]);
        assert_eq!(slack(0), 2);
        assert_eq!(slack(40), 10);
    }

    #[test]
    fn block_hashes_chain_whole_blocks() {
        let a = block_hashes(&[1, 2, 3, 4, 5], 2);
        let b = block_hashes(&[1, 2, 3, 9], 2);
        let c = block_hashes(&[7, 2, 3, 4], 2);
        assert_eq!(a.len(), 2);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        // A block's hash stands for every block before it too.
        assert_ne!(a[1], c[1]);
        assert!(block_hashes(&[1], 2).is_empty());
    }

    #[test]
    fn the_index_matches_leading_blocks_and_forgets_the_oldest() {
        let mut index = PrefixIndex::new(4);
        let first = block_hashes(&[1, 2, 3, 4, 5, 6], 2);
        index.insert(&first);
        assert_eq!(index.matched(&first), 3);
        assert_eq!(index.matched(&block_hashes(&[1, 2, 3, 4, 0, 0], 2)), 2);
        assert_eq!(index.matched(&block_hashes(&[0, 2, 3, 4, 5, 6], 2)), 0);
        // Past twice its capacity it keeps the most recent blocks.
        for p in 10..20u32 {
            index.insert(&block_hashes(&[p, p], 2));
        }
        assert!(index.blocks.len() <= 8);
        assert_eq!(index.matched(&first), 0);
        assert_eq!(index.matched(&block_hashes(&[19, 19], 2)), 1);
    }
}
