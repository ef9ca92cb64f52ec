//! The scheduler thread's loop: it admits requests, runs the steps' forward passes (on
//! the CPU or a GPU), samples and hands the text out.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::gpu::{BatchSegment, GpuModel, GpuOptions, PageOptions, MAX_BATCH, PROMPT_BATCH};
use crate::logprobs::TokenLogprob;
use crate::sampling::Sampler;
use crate::tokenizer::{TokenId, Tokenizer};
use crate::{Model, ModelError};

use super::batch::{self, Segment};
use super::pool::KvPool;
use super::sequence::{distinct_tokens, Sequence};
use super::stop::{StopCheck, StopMatcher};
mod embed;

use super::{
    EmbedRequest, Event, FinishReason, LogprobEntry, Message, SchedulerConfig, SchedulerMetrics,
    ServeError, StepPhase, TokenLogprobs,
};

/// The scheduler thread's state: the model, the KV pool and the sequences waiting and
/// running.
pub(super) struct Loop<'m> {
    model: &'m Model,
    tokenizer: &'m Tokenizer,
    config: SchedulerConfig,
    metrics: Arc<SchedulerMetrics>,
    waiting_count: Arc<AtomicUsize>,
    pool: KvPool,
    /// The GPU that computes the steps (the CPU when `None`).
    gpu: Option<GpuModel>,
    waiting: VecDeque<Sequence<'m>>,
    running: Vec<Sequence<'m>>,
    /// Embeddings requests, oldest first, with the vectors of their first inputs.
    embeds: VecDeque<(EmbedRequest, Vec<Vec<f32>>)>,
    /// Set by a shutdown: when the running sequences are cut off.
    deadline: Option<Instant>,
    /// The step's logits, kept from step to step: its pages stay mapped, and each
    /// sequence's biases, penalties and sampling work on its row in place.
    logits: Vec<f32>,
}

/// When a step's forward pass ran, and how long its sampling took.
struct StepTimes {
    forward_began: Instant,
    forward_ended: Instant,
    sample: Duration,
}

impl<'m> Loop<'m> {
    pub(super) fn new(
        model: &'m Model,
        tokenizer: &'m Tokenizer,
        config: SchedulerConfig,
        metrics: Arc<SchedulerMetrics>,
        waiting_count: Arc<AtomicUsize>,
    ) -> Loop<'m> {
        let pool = KvPool::for_model(model.config(), config.pool_positions, config.block_size);
        SchedulerMetrics::set(&metrics.kv_blocks_total, pool.n_blocks() as u64);
        SchedulerMetrics::set(&metrics.kv_block_size, pool.block_size() as u64);
        Loop {
            model,
            tokenizer,
            config,
            metrics,
            waiting_count,
            pool,
            gpu: None,
            waiting: VecDeque::new(),
            running: Vec::new(),
            embeds: VecDeque::new(),
            deadline: None,
            logits: Vec::new(),
        }
    }

    /// Moves the steps to a GPU whose paged cache has the pool's blocks, and waits for
    /// every weight to be there. The pool then keeps only the books.
    pub(super) fn start_gpu(&mut self, options: GpuOptions) -> Result<(), ModelError> {
        let options = GpuOptions {
            context_size: self.config.context_size,
            stop: None,
            ..options
        };
        let pages = PageOptions {
            block_size: self.pool.block_size(),
            n_blocks: self.pool.n_blocks(),
            max_sequences: self.config.max_sequences,
        };
        let gpu = GpuModel::with_pages(self.model, &options, PROMPT_BATCH, pages)?;
        gpu.wait_loaded()?;
        self.pool.drop_storage();
        self.gpu = Some(gpu);
        self.update_gauges();
        Ok(())
    }

    pub(super) fn run(&mut self, receiver: &mpsc::Receiver<Message>) {
        loop {
            let mut began = Instant::now();
            if self.running.is_empty() && self.waiting.is_empty() && self.embeds.is_empty() {
                if self.deadline.is_some() {
                    break;
                }
                match receiver.recv() {
                    Ok(message) => {
                        // The wait for work is not part of the step.
                        began = Instant::now();
                        self.handle(message);
                    }
                    Err(_) => break,
                }
            }
            while let Ok(message) = receiver.try_recv() {
                self.handle(message);
            }
            self.drop_cancelled();
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                for seq in std::mem::take(&mut self.running) {
                    self.end_with_error(seq, &ServeError::ShuttingDown.to_string());
                }
            }
            // Embeddings are work of their own: their time is no part of the step's.
            let embed_began = Instant::now();
            self.embed_some();
            began += embed_began.elapsed();
            self.admit();
            let admitted = Instant::now();
            let stepped = self.step();
            self.update_gauges();
            if let Some(times) = stepped {
                let ended = Instant::now();
                let m = &self.metrics;
                m.add_step_phase(StepPhase::Admit, admitted - began);
                m.add_step_phase(StepPhase::Schedule, times.forward_began - admitted);
                m.add_step_phase(StepPhase::Sample, times.sample);
                m.add_step_phase(
                    StepPhase::Deliver,
                    (ended - times.forward_ended).saturating_sub(times.sample),
                );
                // Last: a reader that sees the step counted sees all of it.
                m.step_duration.observe(ended - began);
            }
        }
        self.update_gauges();
    }

    fn handle(&mut self, message: Message) {
        match message {
            Message::Submit(request, logprobs, arrived) => {
                let request = *request;
                let mut sampler = Sampler::new(request.sampling);
                for &token in &request.prompt {
                    sampler.accept(token);
                }
                let max_tokens = request.max_tokens;
                let seq = Sequence {
                    prompt_len: request.prompt.len(),
                    tokens: request.prompt,
                    computed: 0,
                    table: Vec::new(),
                    offered: 0,
                    max_tokens,
                    generated: 0,
                    sampler,
                    decoder: self.tokenizer.stream_decoder(false),
                    stop: StopMatcher::new(request.stop),
                    presence_penalty: request.presence_penalty,
                    frequency_penalty: request.frequency_penalty,
                    bias_distinct: distinct_tokens(&request.logit_bias),
                    logit_bias: request.logit_bias,
                    counts: HashMap::new(),
                    constraint: request.constraint,
                    cancel: request.cancel,
                    events: request.events,
                    logprobs,
                    chosen_logprobs: None,
                    mask_time: None,
                    arrived,
                    last_token: None,
                    cached_tokens: 0,
                    counted: true,
                };
                if self.deadline.is_some() {
                    self.end_with_error(seq, &ServeError::ShuttingDown.to_string());
                } else if seq.max_tokens == 0 {
                    self.end(seq, FinishReason::Length);
                } else {
                    self.waiting.push_back(seq);
                }
            }
            Message::Embed(request) => {
                if self.deadline.is_some() {
                    self.end_embed(*request, Err(ServeError::ShuttingDown.to_string()));
                } else {
                    self.embeds.push_back((*request, Vec::new()));
                }
            }
            Message::Shutdown(grace) => {
                self.deadline = Some(Instant::now() + grace);
                for (request, _) in std::mem::take(&mut self.embeds) {
                    self.end_embed(request, Err(ServeError::ShuttingDown.to_string()));
                }
                for seq in std::mem::take(&mut self.waiting) {
                    self.end_with_error(seq, &ServeError::ShuttingDown.to_string());
                }
            }
        }
    }

    fn release(&mut self, seq: &mut Sequence<'_>) {
        for &block in &seq.table {
            self.pool.release(block);
        }
        seq.table.clear();
        seq.offered = 0;
        seq.computed = 0;
        if std::mem::take(&mut seq.counted) {
            self.waiting_count.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn drop_cancelled(&mut self) {
        let cancelled = |s: &Sequence<'_>| s.cancel.load(Ordering::Relaxed);
        // Most steps have none: then nothing moves.
        if !self.running.iter().chain(&self.waiting).any(cancelled) {
            return;
        }
        let mut gone = Vec::new();
        let (out, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(cancelled);
        self.running = kept;
        gone.extend(out);
        let (out, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(cancelled);
        self.waiting = kept.into();
        gone.extend(out);
        for mut seq in gone {
            self.release(&mut seq);
            SchedulerMetrics::add(&self.metrics.cancelled, 1);
        }
    }

    /// Moves waiting requests to running while there is room for their prompts.
    fn admit(&mut self) {
        let bs = self.pool.block_size();
        while self.running.len() < self.config.max_sequences && self.deadline.is_none() {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            // Whole blocks of the prompt already in the pool; the last token is always
            // computed, for its logits.
            let reusable = (seq.tokens.len() - 1) / bs;
            let mut parent = None;
            for j in 0..reusable {
                match self
                    .pool
                    .take_cached(parent, &seq.tokens[j * bs..(j + 1) * bs])
                {
                    Some(id) => {
                        seq.table.push(id);
                        parent = Some(id);
                    }
                    None => break,
                }
            }
            let needed = (seq.tokens.len() + 1).div_ceil(bs) - seq.table.len();
            if needed > self.pool.blocks_available() && !self.running.is_empty() {
                for &block in &seq.table {
                    self.pool.release(block);
                }
                seq.table.clear();
                self.waiting.push_front(seq);
                break;
            }
            seq.computed = seq.table.len() * bs;
            seq.offered = seq.table.len();
            if seq.generated == 0 {
                seq.cached_tokens = seq.computed;
                SchedulerMetrics::add(&self.metrics.prompt_tokens, seq.prompt_len as u64);
                SchedulerMetrics::add(&self.metrics.prompt_tokens_cached, seq.computed as u64);
            }
            if std::mem::take(&mut seq.counted) {
                self.waiting_count.fetch_sub(1, Ordering::SeqCst);
            }
            self.running.push(seq);
        }
    }

    /// Makes sure `running[i]` has blocks up to `positions`, pushing the youngest
    /// sequences back to the queue while the pool is full (`running[i]` itself when it
    /// is the youngest: then it is no longer at `i`, and this returns false). An error
    /// when it is alone and still does not fit.
    fn reserve(&mut self, i: usize, positions: usize) -> Result<bool, ()> {
        let bs = self.pool.block_size();
        while self.running[i].table.len() * bs < positions {
            match self.pool.allocate() {
                Some(id) => self.running[i].table.push(id),
                None => {
                    if self.running.len() == 1 {
                        return Err(());
                    }
                    let mut young = self.running.pop().expect("a younger sequence");
                    self.release(&mut young);
                    SchedulerMetrics::add(&self.metrics.preemptions, 1);
                    self.waiting.push_front(young);
                    if self.running.len() == i {
                        return Ok(false);
                    }
                }
            }
        }
        Ok(true)
    }

    /// One forward pass over every running sequence; when it ran one, its times.
    fn step(&mut self) -> Option<StepTimes> {
        if self.running.is_empty() {
            return None;
        }
        let mut feed = self.feed();
        self.reserve_feed(&mut feed);
        let segments: Vec<Segment<'_>> = self
            .running
            .iter()
            .zip(&feed)
            .map(|(seq, &n)| Segment {
                tokens: &seq.tokens[seq.computed..seq.computed + n],
                first_pos: seq.computed,
                table: &seq.table,
                logits: n > 0 && seq.computed + n == seq.tokens.len(),
            })
            .collect();
        if segments.iter().all(|s| s.tokens.is_empty()) {
            return None;
        }
        let computed: usize = feed.iter().sum();
        // On the GPU, when every sequence that takes a token this step takes the first
        // highest logit (its biases added), the device adds the biases and picks them,
        // and only the tokens come back.
        let argmax = self.gpu.is_some()
            && self
                .running
                .iter()
                .zip(&segments)
                .filter(|(_, s)| s.logits)
                .all(|(seq, _)| seq.takes_device_argmax());
        let forward_began = Instant::now();
        let logits = &mut self.logits;
        let result = match &mut self.gpu {
            Some(gpu) if argmax => {
                let biases: Vec<&[(TokenId, f32)]> = self
                    .running
                    .iter()
                    .map(|seq| seq.logit_bias.as_slice())
                    .collect();
                gpu_step_argmax(gpu, &segments, &biases).map(StepOut::Tokens)
            }
            Some(gpu) => gpu_step(gpu, &segments, logits).map(|()| StepOut::Logits),
            None => batch::forward_batch(
                self.model.config(),
                self.model.plan(),
                &mut self.pool,
                &segments,
                batch::Context {
                    size: self.config.context_size,
                    attention: self.config.attention,
                },
                logits,
            )
            .map(|()| StepOut::Logits),
        };
        let forward_ended = Instant::now();
        self.metrics
            .forward_duration
            .observe(forward_ended - forward_began);
        let mut times = StepTimes {
            forward_began,
            forward_ended,
            sample: Duration::ZERO,
        };
        let wants: Vec<bool> = segments.iter().map(|s| s.logits).collect();
        drop(segments);
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
    /// of the step's logits.
    fn sample(
        &mut self,
        out: StepOut,
        wants: &[bool],
        times: &mut StepTimes,
    ) -> Vec<Result<TokenId, String>> {
        match out {
            StepOut::Tokens(tokens) => tokens.into_iter().map(Ok).collect(),
            StepOut::Logits => {
                let began = Instant::now();
                let n_vocab = self.model.config().n_vocab;
                let mut rows: Vec<(&mut Sequence<'m>, &mut [f32])> = self
                    .running
                    .iter_mut()
                    .zip(wants)
                    .filter_map(|(seq, &want)| want.then_some(seq))
                    .zip(self.logits.chunks_exact_mut(n_vocab))
                    .collect();
                let tokens = choose_all(&mut rows);
                for (seq, _) in &mut rows {
                    if let Some(time) = seq.mask_time.take() {
                        self.metrics.constraint_mask.observe(time);
                    }
                }
                times.sample = began.elapsed();
                tokens
            }
        }
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
    }

    /// Takes `token` as `running[i]`'s next and hands out its text. Returns how the
    /// sequence ends, if it does.
    fn take_token(&mut self, i: usize, token: u32) -> Option<Result<FinishReason, String>> {
        let context_size = self.config.context_size;
        let metrics = Arc::clone(&self.metrics);
        let tokenizer = self.tokenizer;
        let seq = &mut self.running[i];
        seq.sampler.accept(token);
        let now = Instant::now();
        match seq.last_token {
            None => metrics.time_to_first_token.observe(now - seq.arrived),
            Some(last) => metrics.inter_token.observe(now - last),
        }
        seq.last_token = Some(now);
        if tokenizer.is_end_of_generation(token) {
            return Some(Ok(FinishReason::Stop));
        }
        seq.generated += 1;
        SchedulerMetrics::add(&metrics.generated_tokens, 1);
        *seq.counts.entry(token).or_insert(0) += 1;
        seq.tokens.push(token);
        let complete = match seq.constraint.as_mut().map(|c| c.commit(token)) {
            None => false,
            Some(Ok(complete)) => complete,
            Some(Err(message)) => return Some(Err(message)),
        };
        if let (Some(asked), Some((chosen, top))) = (&mut seq.logprobs, seq.chosen_logprobs.take())
        {
            (asked.sink)(token_logprobs(tokenizer, chosen, &top));
        }
        let piece = match seq.decoder.push(token) {
            Ok(piece) => piece,
            Err(e) => return Some(Err(e.to_string())),
        };
        match seq.stop.push(&piece) {
            StopCheck::Go(text) => {
                if !text.is_empty() && !seq.send(Event::Text(text)) {
                    seq.cancel.store(true, Ordering::Relaxed);
                }
            }
            StopCheck::Stop(text) => {
                if !text.is_empty() {
                    seq.send(Event::Text(text));
                }
                seq.stop = StopMatcher::new(Vec::new());
                // The decoder's pending bytes belong after the stop string: drop them.
                seq.decoder = tokenizer.stream_decoder(false);
                return Some(Ok(FinishReason::Stop));
            }
        }
        // The grammar is complete: nothing but its end may follow.
        if complete {
            return Some(Ok(FinishReason::Stop));
        }
        if seq.generated >= seq.max_tokens || seq.computed >= context_size {
            return Some(Ok(FinishReason::Length));
        }
        None
    }

    /// Hands out the text still held and the final event, and frees the blocks.
    fn end(&mut self, mut seq: Sequence<'m>, reason: FinishReason) {
        let decoder = std::mem::replace(&mut seq.decoder, self.tokenizer.stream_decoder(false));
        let mut reason = reason;
        let mut text = match seq.stop.push(&decoder.finish()) {
            StopCheck::Go(text) => text,
            StopCheck::Stop(text) => {
                reason = FinishReason::Stop;
                seq.stop = StopMatcher::new(Vec::new());
                text
            }
        };
        text.push_str(&seq.stop.finish());
        if !text.is_empty() {
            seq.send(Event::Text(text));
        }
        let finish = seq.finish(reason);
        seq.send(Event::Done(finish));
        if seq.last_token.is_none() {
            self.metrics
                .time_to_first_token
                .observe(seq.arrived.elapsed());
        }
        self.metrics.request_duration.observe(seq.arrived.elapsed());
        SchedulerMetrics::add(
            match reason {
                FinishReason::Stop => &self.metrics.finished_stop,
                FinishReason::Length => &self.metrics.finished_length,
            },
            1,
        );
        self.release(&mut seq);
    }

    fn end_with_error(&mut self, mut seq: Sequence<'m>, message: &str) {
        seq.send(Event::Error(message.to_owned()));
        SchedulerMetrics::add(&self.metrics.cancelled, 1);
        self.release(&mut seq);
    }

    fn update_gauges(&self) {
        let m = &self.metrics;
        SchedulerMetrics::set(&m.waiting, self.waiting.len() as u64);
        SchedulerMetrics::set(&m.running, self.running.len() as u64);
        SchedulerMetrics::set(&m.kv_blocks_used, self.pool.blocks_in_use() as u64);
        SchedulerMetrics::set(&m.kv_blocks_cached, self.pool.blocks_cached() as u64);
        if let Some(gpu) = &self.gpu {
            m.set_device_cache(gpu.cache().stats());
        }
    }
}

/// The log-probabilities of a chosen token and the top ones, with their bytes (control
/// tokens as their text).
fn token_logprobs(
    tokenizer: &Tokenizer,
    chosen: TokenLogprob,
    top: &[TokenLogprob],
) -> TokenLogprobs {
    let entry = |t: &TokenLogprob| LogprobEntry {
        token: t.token,
        logprob: t.logprob,
        bytes: tokenizer
            .token_bytes(t.token, true)
            .map_or_else(|_| Vec::new(), <[u8]>::to_vec),
    };
    TokenLogprobs {
        chosen: entry(&chosen),
        top: top.iter().map(entry).collect(),
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
/// `logits`.
fn gpu_step(
    gpu: &mut GpuModel,
    segments: &[Segment<'_>],
    logits: &mut Vec<f32>,
) -> Result<(), ModelError> {
    logits.clear();
    in_batches(gpu, segments, |gpu, batch, _| {
        logits.extend_from_slice(gpu.forward_batch(batch)?);
        Ok(())
    })
}

/// As [`gpu_step`], the greedy tokens taken on the device instead of the logits, each
/// segment's row first added its `biases` there.
fn gpu_step_argmax(
    gpu: &mut GpuModel,
    segments: &[Segment<'_>],
    biases: &[&[(TokenId, f32)]],
) -> Result<Vec<u32>, ModelError> {
    let mut tokens = Vec::new();
    let mut entries = Vec::new();
    in_batches(gpu, segments, |gpu, batch, origins| {
        entries.clear();
        let rows = batch.iter().zip(origins).filter(|(s, _)| s.logits);
        for (row, (_, &origin)) in rows.enumerate() {
            entries.extend(biases[origin].iter().map(|&(t, b)| (row, t, b)));
        }
        tokens.extend(gpu.forward_batch_argmax_biased(batch, &entries)?);
        Ok(())
    })?;
    Ok(tokens)
}

/// Runs `segments` through `run` in batches of at most the model's batch of tokens, in
/// order; `run` also gets, for each of the batch's pieces, the index of its segment.
fn in_batches(
    gpu: &mut GpuModel,
    segments: &[Segment<'_>],
    mut run: impl FnMut(&mut GpuModel, &[BatchSegment<'_>], &[usize]) -> Result<(), ModelError>,
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
