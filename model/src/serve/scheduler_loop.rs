//! The scheduler thread's loop: it admits requests, runs the steps' forward passes (on
//! the CPU or a GPU), samples and hands the text out.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use crate::gpu::{GpuEngine, GpuOptions, PageOptions, SplitOptions, PROMPT_BATCH};
use crate::logprobs::TokenLogprob;
use crate::sampling::Sampler;
use crate::tokenizer::Tokenizer;
use crate::{Model, ModelError};

use super::batch;
use super::sequence::{distinct_tokens, Sequence};
use super::stop::{StopCheck, StopMatcher};
use crate::kv_pool::KvPool;
mod embed;
mod step;

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
    gpu: Option<GpuEngine>,
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

impl<'m> Loop<'m> {
    pub(super) fn new(
        model: &'m Model,
        tokenizer: &'m Tokenizer,
        config: SchedulerConfig,
        metrics: Arc<SchedulerMetrics>,
        waiting_count: Arc<AtomicUsize>,
    ) -> Loop<'m> {
        let pool = KvPool::for_model(
            model.config(),
            config.pool_positions,
            config.block_size,
            config.kv_types,
        );
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
    pub(super) fn start_gpu(
        &mut self,
        options: GpuOptions,
        split: Option<&SplitOptions>,
    ) -> Result<(), ModelError> {
        let options = GpuOptions {
            context_size: self.config.context_size,
            kv_types: self.config.kv_types,
            stop: None,
            ..options
        };
        let pages = PageOptions {
            block_size: self.pool.block_size(),
            n_blocks: self.pool.n_blocks(),
            max_sequences: self.config.max_sequences,
        };
        let mut gpu = GpuEngine::with_pages(self.model, &options, split, PROMPT_BATCH, pages)?;
        gpu.wait_loaded()?;
        gpu.wait_experts_resident()?;
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
                    next_mask: None,
                    mask_time: None,
                    arrived,
                    last_token: None,
                    cached_tokens: 0,
                    counted: true,
                    shifted: false,
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

    /// The CPU's batches' context: the window and how attention is computed.
    fn batch_context(&self) -> batch::Context {
        batch::Context {
            size: self.config.context_size,
            attention: self.config.attention,
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

    /// Takes `token` as `running[i]`'s next and hands out its text. Returns how the
    /// sequence ends, if it does.
    fn take_token(&mut self, i: usize, token: u32) -> Option<Result<FinishReason, String>> {
        let context_size = self.config.context_size;
        let shift_context = self.config.context_shift;
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
        if seq.generated >= seq.max_tokens {
            return Some(Ok(FinishReason::Length));
        }
        if seq.computed >= context_size {
            match shift_context.map(|keep| shift(seq, keep)) {
                Some(true) => {}
                _ => return Some(Ok(FinishReason::Length)),
            }
        }
        None
    }

    /// Sends the sequences whose context was shifted back to the front of the queue,
    /// their blocks freed: the next admission computes what they keep.
    fn requeue_shifted(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if !self.running[i].shifted {
                i += 1;
                continue;
            }
            let mut seq = self.running.remove(i);
            seq.shifted = false;
            self.release(&mut seq);
            SchedulerMetrics::add(&self.metrics.context_shifts, 1);
            self.waiting.push_front(seq);
        }
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
            m.set_device_cache(gpu.cache_stats());
            m.set_expert_pools(gpu.expert_stats());
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

/// Drops the oldest half of `seq`'s tokens after its first `keep` (llama.cpp's context
/// shift) and marks it for the queue; false when nothing can go.
fn shift(seq: &mut Sequence<'_>, keep: usize) -> bool {
    // Every token but the newest has its keys and values in the context.
    let held = seq.tokens.len() - 1;
    let keep = keep.min(held);
    let discard = (held - keep) / 2;
    if discard == 0 {
        return false;
    }
    seq.tokens.drain(keep..keep + discard);
    seq.shifted = true;
    tracing::debug!(keep, discard, "context shifted");
    true
}
