//! Counters the scheduler keeps for monitoring: plain atomics, read at any time from any
//! thread without stopping the scheduler.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency histograms' buckets, in seconds.
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Upper bounds of the constraint mask histogram's buckets, in seconds: 10 µs to 100 ms,
/// about three to a decade (a mask over a large vocabulary takes tens of microseconds to
/// milliseconds).
pub const MASK_BUCKETS: [f64; 13] = [
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
];

/// A latency histogram with [`LATENCY_BUCKETS`] (the default) or other bounds
/// ([`Histogram::with_bounds`]); cumulative counts are computed when read.
#[derive(Debug)]
pub struct Histogram {
    /// Upper bounds of the buckets, ascending.
    bounds: &'static [f64],
    /// Observations per bucket, the last one for those above every bound.
    buckets: Box<[AtomicU64]>,
    /// Sum of the observations in nanoseconds.
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Histogram {
        Histogram::with_bounds(&LATENCY_BUCKETS)
    }
}

/// A histogram as read at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct HistogramSnapshot {
    /// `(upper bound, observations at or below it)`, cumulative, bounds ascending.
    pub buckets: Vec<(f64, u64)>,
    pub sum_seconds: f64,
    pub count: u64,
}

impl Histogram {
    /// An empty histogram with buckets up to each of `bounds` (ascending, in seconds).
    pub fn with_bounds(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, value: Duration) {
        let s = value.as_secs_f64();
        let at = self
            .bounds
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(self.bounds.len());
        self.buckets[at].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(value.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut total = 0;
        let buckets = self
            .bounds
            .iter()
            .zip(&self.buckets)
            .map(|(&bound, n)| {
                total += n.load(Ordering::Relaxed);
                (bound, total)
            })
            .collect();
        HistogramSnapshot {
            buckets,
            sum_seconds: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
            count: self.count.load(Ordering::Relaxed),
        }
    }
}

impl Histogram {
    /// Adds `other`'s observations (a histogram of the same bounds) to this one's.
    fn add_from(&self, other: &Histogram) {
        debug_assert_eq!(self.bounds, other.bounds, "histograms of other bounds");
        for (mine, theirs) in self.buckets.iter().zip(&*other.buckets) {
            mine.fetch_add(theirs.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        let add = |mine: &AtomicU64, theirs: &AtomicU64| {
            mine.fetch_add(theirs.load(Ordering::Relaxed), Ordering::Relaxed);
        };
        add(&self.sum_ns, &other.sum_ns);
        add(&self.count, &other.count);
    }
}

/// A [`Histogram`] with [`MASK_BUCKETS`].
#[derive(Debug)]
pub struct MaskHistogram(Histogram);

impl Default for MaskHistogram {
    fn default() -> MaskHistogram {
        MaskHistogram(Histogram::with_bounds(&MASK_BUCKETS))
    }
}

impl std::ops::Deref for MaskHistogram {
    type Target = Histogram;

    fn deref(&self) -> &Histogram {
        &self.0
    }
}

/// The parts of a scheduler step outside its forward pass, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepPhase {
    /// Taking new requests and cancellations, admitting waiting requests.
    Admit,
    /// Laying the batch out: tokens per sequence, KV blocks, the segments.
    Schedule,
    /// Choosing tokens from the logits: biases, penalties, the sampler.
    Sample,
    /// Handing the tokens out (detokenizing, stop strings, the requests' events), ending
    /// finished sequences, the gauges.
    Deliver,
}

impl StepPhase {
    pub const ALL: [StepPhase; 4] = [
        StepPhase::Admit,
        StepPhase::Schedule,
        StepPhase::Sample,
        StepPhase::Deliver,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StepPhase::Admit => "admit",
            StepPhase::Schedule => "schedule",
            StepPhase::Sample => "sample",
            StepPhase::Deliver => "deliver",
        }
    }
}

/// Everything the scheduler counts.
#[derive(Debug, Default)]
pub struct SchedulerMetrics {
    /// Requests accepted into the queue.
    pub requests_received: AtomicU64,
    /// Finished requests by reason.
    pub finished_stop: AtomicU64,
    pub finished_length: AtomicU64,
    /// Requests cancelled (client gone, or the server stopping).
    pub cancelled: AtomicU64,
    /// Requests refused because the queue was full.
    pub rejected_queue_full: AtomicU64,
    /// Requests that failed in the model.
    pub failed: AtomicU64,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens taken from the pool instead of computed.
    pub prompt_tokens_cached: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Tokens run through the model (prompt chunks and decoded tokens).
    pub computed_tokens: AtomicU64,
    /// Scheduler steps (forward passes).
    pub steps: AtomicU64,
    /// Embeddings requests accepted into the queue, and the tokens of their inputs
    /// computed.
    pub embedding_requests: AtomicU64,
    pub embedding_tokens: AtomicU64,
    /// Sequences pushed back to the queue to free blocks for others.
    pub preemptions: AtomicU64,
    /// Sequences whose full context was shifted to go on (`context_shift`).
    pub context_shifts: AtomicU64,
    /// Requests waiting to start.
    pub waiting: AtomicU64,
    /// Sequences being computed.
    pub running: AtomicU64,
    /// Blocks of the KV pool: total, held by sequences, kept only for reuse.
    pub kv_blocks_total: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_cached: AtomicU64,
    /// Positions per block.
    pub kv_block_size: AtomicU64,
    /// From a request's arrival to its first token.
    pub time_to_first_token: Histogram,
    /// Between two tokens of one sequence.
    pub inter_token: Histogram,
    /// From arrival to the end.
    pub request_duration: Histogram,
    /// Each scheduler step that ran a forward pass, whole: taking new requests,
    /// admitting them, the forward pass, sampling and handing the text out. Their sum
    /// over a stretch of wall time is how busy the scheduler thread was.
    pub step_duration: Histogram,
    /// The forward pass alone, a part of each step: the model's share of the steps.
    pub forward_duration: Histogram,
    /// Each constrained sequence's grammar mask, computed for every token it samples
    /// ([`MASK_BUCKETS`]): inline, between the forward pass and the sampler, so part of
    /// the step's sample phase.
    pub constraint_mask: MaskHistogram,
    /// Nanoseconds of the steps outside their forward passes, by [`StepPhase`]: with the
    /// forward passes they add up to the steps' time.
    step_phase_ns: [AtomicU64; StepPhase::ALL.len()],
    /// The counters of the device cache holding the weights, when a GPU computes.
    device_cache: std::sync::Mutex<Option<tensor_store::device::CacheStats>>,
    /// What the pools of experts resident by use did, when a GPU computes a mixture of
    /// experts over its budget.
    expert_pools: std::sync::Mutex<Option<crate::gpu::ExpertStats>>,
}

impl SchedulerMetrics {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn set(gauge: &AtomicU64, n: u64) {
        gauge.store(n, Ordering::Relaxed);
    }

    /// The counters of several schedulers (replicas of one model) added up as read now:
    /// counts, histograms, step phases, and the gauges (requests running and waiting,
    /// blocks of the pools) too; the block size is theirs, the device caches' and the
    /// experts' pools' counters added.
    pub fn total(parts: &[&SchedulerMetrics]) -> SchedulerMetrics {
        let total = SchedulerMetrics::default();
        for part in parts {
            for (mine, theirs) in total.summed().into_iter().zip(part.summed()) {
                SchedulerMetrics::add(mine, SchedulerMetrics::get(theirs));
            }
            total.kv_block_size.fetch_max(
                SchedulerMetrics::get(&part.kv_block_size),
                Ordering::Relaxed,
            );
            total
                .time_to_first_token
                .add_from(&part.time_to_first_token);
            total.inter_token.add_from(&part.inter_token);
            total.request_duration.add_from(&part.request_duration);
            total.step_duration.add_from(&part.step_duration);
            total.forward_duration.add_from(&part.forward_duration);
            total.constraint_mask.add_from(&part.constraint_mask);
            for (mine, theirs) in total.step_phase_ns.iter().zip(&part.step_phase_ns) {
                SchedulerMetrics::add(mine, SchedulerMetrics::get(theirs));
            }
            if let Some(stats) = part.device_cache() {
                let sum = total.device_cache().map_or(stats, |t| t + stats);
                total.set_device_cache(sum);
            }
            if let Some(stats) = part.expert_pools() {
                let sum = total.expert_pools().map_or(stats, |t| t + stats);
                total.set_expert_pools(Some(sum));
            }
        }
        total
    }

    /// The counters and gauges that add up over replicas.
    fn summed(&self) -> [&AtomicU64; 20] {
        [
            &self.requests_received,
            &self.finished_stop,
            &self.finished_length,
            &self.cancelled,
            &self.rejected_queue_full,
            &self.failed,
            &self.prompt_tokens,
            &self.prompt_tokens_cached,
            &self.generated_tokens,
            &self.computed_tokens,
            &self.steps,
            &self.embedding_requests,
            &self.embedding_tokens,
            &self.preemptions,
            &self.context_shifts,
            &self.waiting,
            &self.running,
            &self.kv_blocks_total,
            &self.kv_blocks_used,
            &self.kv_blocks_cached,
        ]
    }

    /// Seconds the steps spent in `phase`, summed.
    pub fn step_phase_seconds(&self, phase: StepPhase) -> f64 {
        self.step_phase_ns[phase as usize].load(Ordering::Relaxed) as f64 / 1e9
    }

    pub(crate) fn add_step_phase(&self, phase: StepPhase, time: Duration) {
        let ns = u64::try_from(time.as_nanos()).unwrap_or(u64::MAX);
        self.step_phase_ns[phase as usize].fetch_add(ns, Ordering::Relaxed);
    }

    /// The device cache's counters as last published by the scheduler (`None` while the
    /// model computes on the CPU).
    pub fn device_cache(&self) -> Option<tensor_store::device::CacheStats> {
        self.device_cache.lock().map_or(None, |c| *c)
    }

    pub(crate) fn set_device_cache(&self, stats: tensor_store::device::CacheStats) {
        if let Ok(mut c) = self.device_cache.lock() {
            *c = Some(stats);
        }
    }

    /// The pools of experts' counters (`None`: no pools).
    pub fn expert_pools(&self) -> Option<crate::gpu::ExpertStats> {
        self.expert_pools.lock().map_or(None, |c| *c)
    }

    pub(crate) fn set_expert_pools(&self, stats: Option<crate::gpu::ExpertStats>) {
        if let Ok(mut c) = self.expert_pools.lock() {
            *c = stats;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_count_cumulatively_and_sum() {
        let h = Histogram::default();
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_millis(60));
        h.observe(Duration::from_secs(100));
        let s = h.snapshot();
        assert_eq!(s.count, 3);
        assert_eq!(s.buckets[0], (0.005, 1));
        assert_eq!(s.buckets[3], (0.05, 1));
        assert_eq!(s.buckets[4], (0.075, 2));
        assert_eq!(s.buckets.last(), Some(&(30.0, 2)));
        assert!((s.sum_seconds - 100.063).abs() < 1e-9);
    }

    #[test]
    fn mask_histograms_have_microsecond_buckets() {
        let h = MaskHistogram::default();
        h.observe(Duration::from_micros(7));
        h.observe(Duration::from_micros(30));
        h.observe(Duration::from_millis(200));
        let s = h.snapshot();
        assert_eq!(s.buckets.len(), MASK_BUCKETS.len());
        assert_eq!(s.buckets[0], (1e-5, 1));
        assert_eq!(s.buckets[2], (5e-5, 2));
        assert_eq!(s.buckets.last(), Some(&(0.1, 2)));
        assert_eq!(s.count, 3);
        assert!((s.sum_seconds - 0.200037).abs() < 1e-12);
    }

    #[test]
    fn replicas_counters_add_up() {
        let (a, b) = (SchedulerMetrics::default(), SchedulerMetrics::default());
        SchedulerMetrics::add(&a.generated_tokens, 5);
        SchedulerMetrics::add(&b.generated_tokens, 7);
        SchedulerMetrics::set(&a.running, 3);
        SchedulerMetrics::set(&b.running, 1);
        SchedulerMetrics::set(&a.kv_block_size, 16);
        SchedulerMetrics::set(&b.kv_block_size, 16);
        a.time_to_first_token.observe(Duration::from_millis(3));
        b.time_to_first_token.observe(Duration::from_millis(60));
        b.add_step_phase(StepPhase::Sample, Duration::from_nanos(900));
        let t = SchedulerMetrics::total(&[&a, &b]);
        assert_eq!(SchedulerMetrics::get(&t.generated_tokens), 12);
        assert_eq!(SchedulerMetrics::get(&t.running), 4);
        assert_eq!(SchedulerMetrics::get(&t.kv_block_size), 16);
        let ttft = t.time_to_first_token.snapshot();
        assert_eq!(ttft.count, 2);
        assert_eq!(ttft.buckets[0], (0.005, 1));
        assert_eq!(ttft.buckets[3], (0.05, 1));
        assert_eq!(ttft.buckets[4], (0.075, 2));
        assert!((t.step_phase_seconds(StepPhase::Sample) - 9e-7).abs() < 1e-15);
        assert_eq!(t.device_cache(), None);
    }

    #[test]
    fn step_phases_sum_nanoseconds_apart() {
        let m = SchedulerMetrics::default();
        m.add_step_phase(StepPhase::Sample, Duration::from_nanos(1_500));
        m.add_step_phase(StepPhase::Sample, Duration::from_nanos(700));
        m.add_step_phase(StepPhase::Deliver, Duration::from_millis(3));
        assert!((m.step_phase_seconds(StepPhase::Sample) - 2.2e-6).abs() < 1e-15);
        assert!((m.step_phase_seconds(StepPhase::Deliver) - 3e-3).abs() < 1e-15);
        assert_eq!(m.step_phase_seconds(StepPhase::Admit), 0.0);
        let names: Vec<&str> = StepPhase::ALL.iter().map(|p| p.as_str()).collect();
        assert_eq!(names, ["admit", "schedule", "sample", "deliver"]);
    }
}
