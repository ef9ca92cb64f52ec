//! A step of the scheduler's loop: which tokens each running sequence feeds, the
//! forward pass over all of them (on the CPU or a GPU), and the tokens it gives them.
//!
//! On a GPU the host computes the grammars' masks while the device runs the pass, and a
//! step whose sequences all take their first highest logit (greedy, with or without a
//! grammar) takes its tokens on the device: the biases and masks go over with the step.

use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::constraint::{Constraint, TokenMask};
use crate::gpu::{BatchSegment, GpuEngine, MAX_BATCH};
use crate::tokenizer::TokenId;
use crate::ModelError;

use super::super::batch::{self, Segment};
use super::super::sequence::Sequence;
use super::super::SchedulerMetrics;
use super::Loop;

/// When a step's forward pass ran, and how long its sampling took.
pub(super) struct StepTimes {
    pub(super) forward_began: Instant,
    pub(super) forward_ended: Instant,
    pub(super) sample: Duration,
}

impl<'m> Loop<'m> {
    /// One forward pass over every running sequence; when it ran one, its times.
    pub(super) fn step(&mut self) -> Option<StepTimes> {
        if self.running.is_empty() {
            return None;
        }
        let mut feed = self.feed();
        self.reserve_feed(&mut feed);
        let wants: Vec<bool> = self
            .running
            .iter()
            .zip(&feed)
            .map(|(seq, &n)| n > 0 && seq.computed + n == seq.tokens.len())
            .collect();
        if feed.iter().all(|&n| n == 0) {
            return None;
        }
        let computed: usize = feed.iter().sum();
        // On the GPU, the grammars' masks for this step are computed while the device
        // runs its pass: the constraints leave their sequences for the pass's length.
        let mut masks = StepMasks::default();
        if self.gpu.is_some() {
            masks.n_vocab = self.model.config().n_vocab;
            for (i, seq) in self.running.iter_mut().enumerate() {
                if !wants[i] {
                    continue;
                }
                if let Some(c) = seq.constraint.take() {
                    masks.constraints.push((i, c));
                }
            }
        }
        // On the GPU, when every sequence that takes a token this step takes the first
        // highest logit (its biases added, held to its grammar), the device adds the
        // biases, applies the masks and picks them, and only the tokens come back.
        let argmax = self.gpu.is_some()
            && self
                .running
                .iter()
                .zip(&wants)
                .filter(|(_, &want)| want)
                .all(|(seq, _)| seq.takes_device_argmax());
        let segments: Vec<Segment<'_>> = self
            .running
            .iter()
            .zip(&feed)
            .zip(&wants)
            .map(|((seq, &n), &logits)| Segment {
                tokens: &seq.tokens[seq.computed..seq.computed + n],
                first_pos: seq.computed,
                table: &seq.table,
                logits,
            })
            .collect();
        let context = self.batch_context();
        let forward_began = Instant::now();
        let logits = &mut self.logits;
        let result = match &mut self.gpu {
            Some(gpu) if argmax => {
                let biases: Vec<&[(TokenId, f32)]> = self
                    .running
                    .iter()
                    .map(|seq| seq.logit_bias.as_slice())
                    .collect();
                gpu_step_argmax(gpu, &segments, &biases, &mut masks).map(StepOut::Tokens)
            }
            Some(gpu) => gpu_step(gpu, &segments, logits, &mut masks).map(|()| StepOut::Logits),
            None => batch::forward_batch(
                self.model.config(),
                self.model.plan(),
                &mut self.pool,
                &segments,
                context,
                logits,
            )
            .map(|()| StepOut::Logits),
        };
        let forward_ended = Instant::now();
        drop(segments);
        masks.hand_back(&mut self.running);
        self.metrics
            .forward_duration
            .observe(forward_ended - forward_began);
        let mut times = StepTimes {
            forward_began,
            forward_ended,
            sample: Duration::ZERO,
        };
        SchedulerMetrics::add(&self.metrics.steps, 1);
        SchedulerMetrics::add(&self.metrics.computed_tokens, computed as u64);
        let out = match result {
            Ok(out) => out,
            Err(e) => {
                SchedulerMetrics::add(&self.metrics.failed, self.running.len() as u64);
                for seq in std::mem::take(&mut self.running) {
                    self.end_with_error(seq, &e.to_string());
                }
                return Some(times);
            }
        };
        let takers = self.mark_computed(&feed, &wants);
        let tokens = self.sample(out, &wants, &mut times);
        self.take_tokens(&takers, tokens);
        Some(times)
    }

    /// How many tokens each running sequence feeds the step, within the step's budget.
    fn feed(&self) -> Vec<usize> {
        // Decoding sequences first (one token each), then prompt chunks, oldest first.
        let mut feed = vec![0usize; self.running.len()];
        let mut budget = self.config.step_tokens;
        for (i, seq) in self.running.iter().enumerate() {
            if seq.tokens.len() - seq.computed == 1 {
                feed[i] = 1;
                budget = budget.saturating_sub(1);
            }
        }
        // With no stream waiting on this step, prompts are read whole: a prompt alone is
        // then one batch, as `generate` computes it.
        if feed.iter().all(|&n| n == 0) {
            budget = usize::MAX;
        }
        for (i, seq) in self.running.iter().enumerate() {
            let pending = seq.tokens.len() - seq.computed;
            if pending > 1 && budget > 0 {
                feed[i] = pending.min(budget);
                budget -= feed[i];
            }
        }
        feed
    }

    /// Reserves the blocks for each sequence's `feed`, in order, until the pool is full;
    /// a sequence that alone does not fit ends with an error.
    fn reserve_feed(&mut self, feed: &mut Vec<usize>) {
        let mut i = 0;
        while i < self.running.len() {
            let target = self.running[i].computed + feed[i];
            if feed[i] == 0 {
                i += 1;
                continue;
            }
            match self.reserve(i, target) {
                Ok(true) => i += 1,
                Ok(false) => break,
                Err(()) => {
                    // Alone it does not fit: cannot happen with a pool of a whole
                    // context, but never loop on it.
                    let seq = self.running.remove(i);
                    feed.remove(i);
                    self.end_with_error(seq, "the KV pool is too small for this request");
                }
            }
        }
        feed.truncate(self.running.len());
    }

    /// Counts each sequence's fed tokens as computed and offers its full blocks to the
    /// pool's registry; returns the sequences that take a token.
    fn mark_computed(&mut self, feed: &[usize], wants: &[bool]) -> Vec<usize> {
        let bs = self.pool.block_size();
        let mut takers = Vec::new();
        for (i, (&n, &want)) in feed.iter().zip(wants).enumerate() {
            let seq = &mut self.running[i];
            seq.computed += n;
            let full = seq.computed / bs;
            while seq.offered < full {
                let j = seq.offered;
                let parent = j.checked_sub(1).map(|p| seq.table[p]);
                self.pool
                    .register(seq.table[j], parent, &seq.tokens[j * bs..(j + 1) * bs]);
                seq.offered += 1;
            }
            if want {
                takers.push(i);
            }
        }
        takers
    }

    /// The tokens of the sequences that `wants`: the device's, or sampled from their rows
    /// of the step's logits. A sequence whose grammar failed to give a mask gets its
    /// error instead of a token.
    fn sample(
        &mut self,
        out: StepOut,
        wants: &[bool],
        times: &mut StepTimes,
    ) -> Vec<Result<TokenId, String>> {
        let began = Instant::now();
        let takers = self
            .running
            .iter_mut()
            .zip(wants)
            .filter_map(|(seq, &want)| want.then_some(seq));
        let tokens = match out {
            StepOut::Tokens(tokens) => takers
                .zip(tokens)
                .map(|(seq, token)| match seq.next_mask.take() {
                    Some(Err(message)) => Err(message),
                    _ => Ok(token),
                })
                .collect(),
            StepOut::Logits => {
                let n_vocab = self.model.config().n_vocab;
                let mut rows: Vec<(&mut Sequence<'m>, &mut [f32])> =
                    takers.zip(self.logits.chunks_exact_mut(n_vocab)).collect();
                choose_all(&mut rows)
            }
        };
        for seq in &mut self.running {
            if let Some(time) = seq.mask_time.take() {
                self.metrics.constraint_mask.observe(time);
            }
        }
        times.sample = began.elapsed();
        tokens
    }

    /// Takes each taker's token and ends the sequences it finishes.
    fn take_tokens(&mut self, takers: &[usize], tokens: Vec<Result<TokenId, String>>) {
        let mut finished = Vec::new();
        for (&i, token) in takers.iter().zip(tokens) {
            let ends = match token {
                Ok(token) => self.take_token(i, token),
                Err(message) => Some(Err(message)),
            };
            if let Some(reason) = ends {
                finished.push((i, reason));
            }
        }
        for (i, reason) in finished.into_iter().rev() {
            let seq = self.running.remove(i);
            match reason {
                Ok(reason) => self.end(seq, reason),
                Err(message) => self.end_with_error(seq, &message),
            }
        }
        self.requeue_shifted();
    }
}

/// What a step gives the sequences that take a token: rows of logits (in the loop's
/// buffer), or (the device's argmax) the tokens themselves.
enum StepOut {
    Logits,
    Tokens(Vec<u32>),
}

/// Below this many sequences taking a token, or worker threads, their sampling runs on
/// the scheduler thread alone. From it on, the rows go to the worker threads: a row of a
/// large vocabulary takes microseconds to scan from memory, about what waking a worker
/// costs. With fewer workers (a small CPU, where the forward pass and the clients take
/// every core) the hand-over measured slower than one row after the other.
const PARALLEL_SAMPLING: usize = 4;

/// Each sequence's next token from its row of logits, in order. The sequences sample
/// independently (each its own sampler, biases and row), so many of them share the
/// worker threads when there are enough: the same tokens as one after the other.
fn choose_all(rows: &mut [(&mut Sequence<'_>, &mut [f32])]) -> Vec<Result<TokenId, String>> {
    if rows.len() < PARALLEL_SAMPLING || rayon::current_num_threads() < PARALLEL_SAMPLING {
        return rows.iter_mut().map(|(seq, row)| seq.choose(row)).collect();
    }
    crate::cpu::on_the_pool(|| {
        rows.par_iter_mut()
            .map(|(seq, row)| seq.choose(row))
            .collect()
    })
}

/// A step on the GPU: the segments in batches of at most the model's batch of tokens (a
/// long prompt in pieces, each after the ones before it), their logits in order into
/// `logits`; `masks` computed while the device runs the first batch.
fn gpu_step(
    gpu: &mut GpuEngine,
    segments: &[Segment<'_>],
    logits: &mut Vec<f32>,
    masks: &mut StepMasks,
) -> Result<(), ModelError> {
    logits.clear();
    in_batches(gpu, segments, |gpu, batch, _| {
        let launched = gpu.launch_batch(batch)?;
        masks.compute();
        logits.extend_from_slice(launched.logits()?);
        Ok(())
    })
}

/// As [`gpu_step`], the greedy tokens taken on the device instead of the logits, each
/// segment's row first added its `biases` there and held to its grammar's mask.
fn gpu_step_argmax(
    gpu: &mut GpuEngine,
    segments: &[Segment<'_>],
    biases: &[&[(TokenId, f32)]],
    masks: &mut StepMasks,
) -> Result<Vec<u32>, ModelError> {
    let mut tokens = Vec::new();
    let mut entries = Vec::new();
    in_batches(gpu, segments, |gpu, batch, origins| {
        let launched = gpu.launch_batch(batch)?;
        masks.compute();
        entries.clear();
        let mut row_masks = Vec::new();
        let rows = batch.iter().zip(origins).filter(|(s, _)| s.logits);
        for (row, (_, &origin)) in rows.enumerate() {
            entries.extend(biases[origin].iter().map(|&(t, b)| (row, t, b)));
            if let Some(mask) = masks.of(origin) {
                row_masks.push((row, mask));
            }
        }
        tokens.extend(launched.argmax(&entries, &row_masks)?);
        Ok(())
    })?;
    Ok(tokens)
}

/// The grammars' masks of a step on the GPU: the constraints of the sequences that take a
/// token (out of their sequences while the pass runs), and once computed, their masks
/// and how long each took.
#[derive(Default)]
struct StepMasks {
    n_vocab: usize,
    /// `(index among the running sequences, its constraint)`.
    constraints: Vec<(usize, Constraint)>,
    computed: Vec<(Result<TokenMask, String>, Duration)>,
}

impl StepMasks {
    /// Computes every mask, once: on the worker threads when there are many.
    fn compute(&mut self) {
        if !self.computed.is_empty() || self.constraints.is_empty() {
            return;
        }
        let n_vocab = self.n_vocab;
        let one = |(_, c): &mut (usize, Constraint)| {
            let began = Instant::now();
            let mask = c.next_mask(n_vocab);
            (mask, began.elapsed())
        };
        self.computed = if self.constraints.len() < PARALLEL_SAMPLING
            || rayon::current_num_threads() < PARALLEL_SAMPLING
        {
            self.constraints.iter_mut().map(one).collect()
        } else {
            crate::cpu::on_the_pool(|| self.constraints.par_iter_mut().map(one).collect())
        };
    }

    /// The mask of running sequence `i`, when it has one that was computed.
    fn of(&self, i: usize) -> Option<&TokenMask> {
        let at = self.constraints.iter().position(|&(j, _)| j == i)?;
        self.computed.get(at)?.0.as_ref().ok()
    }

    /// Gives the constraints back to their sequences, each with its computed mask (for
    /// its sampling, or its error) and the mask's time.
    fn hand_back(self, running: &mut [Sequence<'_>]) {
        let mut computed = self.computed.into_iter();
        for (i, constraint) in self.constraints {
            let seq = &mut running[i];
            seq.constraint = Some(constraint);
            if let Some((mask, time)) = computed.next() {
                seq.next_mask = Some(mask);
                seq.mask_time = Some(time);
            }
        }
    }
}

/// Runs `segments` through `run` in batches of at most the model's batch of tokens, in
/// order; `run` also gets, for each of the batch's pieces, the index of its segment.
pub(super) fn in_batches(
    gpu: &mut GpuEngine,
    segments: &[Segment<'_>],
    mut run: impl FnMut(&mut GpuEngine, &[BatchSegment<'_>], &[usize]) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    let room = gpu.prompt_batch().max(MAX_BATCH);
    let mut batch: Vec<BatchSegment<'_>> = Vec::new();
    let mut origins: Vec<usize> = Vec::new();
    let mut used = 0;
    for (origin, seg) in segments.iter().enumerate() {
        let mut first = 0;
        while first < seg.tokens.len() {
            if used == room {
                run(gpu, &batch, &origins)?;
                batch.clear();
                origins.clear();
                used = 0;
            }
            let take = (seg.tokens.len() - first).min(room - used);
            batch.push(BatchSegment {
                tokens: &seg.tokens[first..first + take],
                first_pos: seg.first_pos + first,
                table: seg.table,
                logits: seg.logits && first + take == seg.tokens.len(),
            });
            origins.push(origin);
            used += take;
            first += take;
        }
    }
    if !batch.is_empty() {
        run(gpu, &batch, &origins)?;
    }
    Ok(())
}
