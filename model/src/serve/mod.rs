//! Continuous batching: one scheduler thread owns the model and serves many requests at
//! once.
//!
//! Each step runs one forward pass over a batch made of one token for every sequence
//! that is decoding and a chunk of the prompts being read, under a budget of tokens per
//! step, so a long new prompt delays the running streams by at most one chunk. When no
//! sequence is decoding, nothing waits on the step, and prompts are read whole. Prompt
//! and decode are the same thing here: a sequence has tokens the model has not seen yet,
//! and the step that feeds the last of them gives it logits to sample from.
//!
//! Sequences keep their keys and values in one shared [`pool`] of blocks: a sequence
//! takes blocks as it grows and gives them back when it ends, so the context is not split
//! into fixed slots. A prompt that starts with blocks some earlier request computed (a
//! system prompt, the earlier turns of a chat) takes them instead of computing them. A
//! request waits while its prompt does not fit; when the running sequences outgrow the
//! pool, the youngest is pushed back to the queue and recomputed later (from the blocks
//! still cached, where they survived). A cancelled request (its client is gone) is
//! dropped at the start of the next step, and its blocks freed.
//!
//! The scheduler is plain threads and channels; requests come with a callback that
//! receives their text, so any front end (the HTTP server in `cli`) can drive it.
//!
//! The step's forward pass runs on the CPU ([`batch`], the pool holding the keys and
//! values) or, started with [`Scheduler::start_on_gpu`], on a GPU: a
//! [`GpuModel`] whose paged KV cache has the pool's blocks, so the pool only keeps the
//! books (which block holds what) and the tables go to the device as they are.

mod batch;
mod metrics;
pub(crate) mod pool;
mod stop;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::constraint::Constraint;
use crate::gpu::{BatchSegment, GpuModel, GpuOptions, PageOptions, MAX_BATCH, PROMPT_BATCH};
use crate::sampling::{Sampler, SamplingConfig};
use crate::tokenizer::{StreamDecoder, TokenId, Tokenizer};
use crate::{Model, ModelError};

pub use metrics::{Histogram, HistogramSnapshot, SchedulerMetrics, StepPhase, LATENCY_BUCKETS};

use batch::Segment;
use pool::{BlockId, KvPool};
use stop::{StopCheck, StopMatcher};

/// Why a request was refused, or the scheduler could not start.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServeError {
    #[error("the prompt has no tokens: there is nothing to continue")]
    EmptyPrompt,
    #[error("the prompt has {prompt_tokens} tokens but the context holds {context_size}")]
    PromptTooLong {
        prompt_tokens: usize,
        context_size: usize,
    },
    #[error("the queue is full ({limit} requests waiting): try again later")]
    QueueFull { limit: usize },
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("invalid scheduler setting: {0}")]
    InvalidConfig(String),
    #[error("token id {token} is outside the vocabulary of {n_vocab}")]
    TokenOutOfRange { token: TokenId, n_vocab: usize },
    #[error("setting the model up on the GPU: {0}")]
    Gpu(String),
}

/// How the scheduler shares the machine between requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences computed at once.
    pub max_sequences: usize,
    /// Most requests waiting to start; more are refused.
    pub max_queue: usize,
    /// Most tokens one step runs (decoding sequences always get their token; prompts
    /// share what is left, in chunks).
    pub step_tokens: usize,
    /// Most positions of one sequence, prompt included.
    pub context_size: usize,
    /// Positions of the shared KV pool (all sequences together); at least
    /// `context_size`, so that any request fits when alone.
    pub pool_positions: usize,
    /// Positions per block of the pool.
    pub block_size: usize,
    /// How the CPU computes attention (the GPU has one way of its own).
    pub attention: crate::ops::AttentionMethod,
}

impl SchedulerConfig {
    fn validate(&self) -> Result<(), ServeError> {
        let bad = |what: &str| Err(ServeError::InvalidConfig(what.to_owned()));
        if self.max_sequences == 0 {
            return bad("max_sequences must be at least 1");
        }
        if self.step_tokens == 0 {
            return bad("step_tokens must be at least 1");
        }
        if self.context_size == 0 {
            return bad("context_size must be at least 1");
        }
        if self.block_size == 0 {
            return bad("block_size must be at least 1");
        }
        if self.pool_positions < self.context_size {
            return Err(ServeError::InvalidConfig(format!(
                "the KV pool ({} positions) must hold at least one whole context ({})",
                self.pool_positions, self.context_size
            )));
        }
        Ok(())
    }
}

/// Why a finished sequence ended, in the API's words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// The end of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Finish {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose keys and values came from the pool instead of being computed.
    pub cached_tokens: usize,
}

/// What a request's callback receives, in order: text pieces, then one `Done` or `Error`.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// New text: whole characters, never part of a stop string.
    Text(String),
    Done(Finish),
    /// The request ended early: the server is stopping, or the model failed.
    Error(String),
}

/// A callback for a request's events; it returns `false` when nobody listens any more,
/// which cancels the request.
pub type EventSink = Box<dyn FnMut(Event) -> bool + Send>;

/// One completion to compute.
pub struct Request {
    pub prompt: Vec<TokenId>,
    /// Most tokens to generate (the context may end it sooner).
    pub max_tokens: usize,
    pub sampling: SamplingConfig,
    /// Strings that end generation; they are not part of the text.
    pub stop: Vec<String>,
    /// Subtracted from the logit of every token generated before (OpenAI's).
    pub presence_penalty: f32,
    /// Subtracted once per earlier occurrence among the generated tokens (OpenAI's).
    pub frequency_penalty: f32,
    /// Added to the logits of these tokens before sampling.
    pub logit_bias: Vec<(TokenId, f32)>,
    /// The grammar the output must follow (a compiled JSON schema, grammar or regular
    /// expression): each step only the tokens it allows are sampled from, and the
    /// sequence stops when the grammar is complete.
    pub constraint: Option<Constraint>,
    /// Set it to cancel the request; the scheduler drops it at its next step.
    pub cancel: Arc<AtomicBool>,
    pub events: EventSink,
}

enum Message {
    Submit(Box<Request>, Instant),
    Shutdown(Duration),
}

/// The handle of the scheduler thread. Dropping it stops the thread, cancelling what
/// is in flight.
pub struct Scheduler {
    sender: Mutex<mpsc::Sender<Message>>,
    metrics: Arc<SchedulerMetrics>,
    accepting: AtomicBool,
    waiting: Arc<AtomicUsize>,
    config: SchedulerConfig,
    n_vocab: usize,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Scheduler {
    /// Starts the scheduler thread with `model`, computing on the CPU.
    pub fn start(
        model: Model,
        tokenizer: Arc<Tokenizer>,
        config: SchedulerConfig,
    ) -> Result<Scheduler, ServeError> {
        Scheduler::start_with(model, tokenizer, config, None)
    }

    /// Starts the scheduler thread with `model` computing on a GPU (`options`; its
    /// context size is `config.context_size`), its KV cache the pool's blocks (whose
    /// size must be a power of two). Returns once every weight is on the device, or
    /// with the reason the model cannot run there.
    pub fn start_on_gpu(
        model: Model,
        tokenizer: Arc<Tokenizer>,
        config: SchedulerConfig,
        options: GpuOptions,
    ) -> Result<Scheduler, ServeError> {
        Scheduler::start_with(model, tokenizer, config, Some(options))
    }

    fn start_with(
        model: Model,
        tokenizer: Arc<Tokenizer>,
        config: SchedulerConfig,
        gpu: Option<GpuOptions>,
    ) -> Result<Scheduler, ServeError> {
        config.validate()?;
        let (sender, receiver) = mpsc::channel();
        let metrics = Arc::new(SchedulerMetrics::default());
        let waiting = Arc::new(AtomicUsize::new(0));
        let n_vocab = model.config().n_vocab;
        // The thread says whether its engine is ready before it serves.
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<(), ServeError>>(1);
        let thread = {
            let metrics = Arc::clone(&metrics);
            let waiting = Arc::clone(&waiting);
            std::thread::Builder::new()
                .name("scheduler".into())
                .spawn(move || {
                    let mut looper = Loop::new(&model, &tokenizer, config, metrics, waiting);
                    if let Some(Err(e)) = gpu.map(|options| looper.start_gpu(options)) {
                        let _ = ready_tx.send(Err(ServeError::Gpu(e.to_string())));
                        return;
                    }
                    let _ = ready_tx.send(Ok(()));
                    looper.run(&receiver);
                })
                .map_err(|e| ServeError::InvalidConfig(format!("starting the thread: {e}")))?
        };
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(ServeError::Gpu("the scheduler thread ended".into()));
            }
        }
        Ok(Scheduler {
            sender: Mutex::new(sender),
            metrics,
            accepting: AtomicBool::new(true),
            waiting,
            config,
            n_vocab,
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn metrics(&self) -> &Arc<SchedulerMetrics> {
        &self.metrics
    }

    /// Queues a request, or says at once why it can never run or cannot run now.
    pub fn submit(&self, request: Request) -> Result<(), ServeError> {
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(ServeError::ShuttingDown);
        }
        let n = request.prompt.len();
        if n == 0 {
            return Err(ServeError::EmptyPrompt);
        }
        if n > self.config.context_size {
            return Err(ServeError::PromptTooLong {
                prompt_tokens: n,
                context_size: self.config.context_size,
            });
        }
        if let Some(&token) = request
            .prompt
            .iter()
            .chain(request.logit_bias.iter().map(|(t, _)| t))
            .find(|&&t| t as usize >= self.n_vocab)
        {
            return Err(ServeError::TokenOutOfRange {
                token,
                n_vocab: self.n_vocab,
            });
        }
        let limit = self.config.max_queue;
        let admitted = self
            .waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
                (w < limit).then_some(w + 1)
            });
        if admitted.is_err() {
            SchedulerMetrics::add(&self.metrics.rejected_queue_full, 1);
            return Err(ServeError::QueueFull { limit });
        }
        SchedulerMetrics::add(&self.metrics.requests_received, 1);
        let sent = self
            .sender
            .lock()
            .map_err(|_| ServeError::ShuttingDown)?
            .send(Message::Submit(Box::new(request), Instant::now()));
        if sent.is_err() {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ServeError::ShuttingDown);
        }
        Ok(())
    }

    /// Stops admitting requests: waiting ones end with an error event at once, running
    /// ones may finish within `grace`, then end with an error event. Returns when the
    /// scheduler thread has ended.
    pub fn shutdown(&self, grace: Duration) {
        self.accepting.store(false, Ordering::SeqCst);
        if let Ok(sender) = self.sender.lock() {
            let _ = sender.send(Message::Shutdown(grace));
        }
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shutdown(Duration::ZERO);
    }
}

/// A request being served.
struct Sequence<'t> {
    /// Prompt and generated tokens.
    tokens: Vec<TokenId>,
    prompt_len: usize,
    /// Positions whose keys and values are in the sequence's blocks.
    computed: usize,
    table: Vec<BlockId>,
    /// Blocks of `table` offered to the pool's registry so far.
    offered: usize,
    max_tokens: usize,
    generated: usize,
    sampler: Sampler,
    decoder: StreamDecoder<'t>,
    stop: StopMatcher,
    presence_penalty: f32,
    frequency_penalty: f32,
    logit_bias: Vec<(TokenId, f32)>,
    /// Whether no token appears twice in `logit_bias` (the device adds them all at once).
    bias_distinct: bool,
    /// Occurrences of each generated token (for the OpenAI penalties).
    counts: HashMap<TokenId, u32>,
    /// The grammar its output follows, if any.
    constraint: Option<Constraint>,
    cancel: Arc<AtomicBool>,
    events: EventSink,
    arrived: Instant,
    last_token: Option<Instant>,
    cached_tokens: usize,
    /// Whether it counts against the queue's limit while waiting (new requests do,
    /// preempted ones do not).
    counted: bool,
}

impl Sequence<'_> {
    /// Whether its next token is the first highest logit of the model's logits with its
    /// biases added (as [`Sequence::choose`] adds them): greedy, with no penalty, and
    /// biases of distinct tokens (the device adds them all at once), and no grammar (its
    /// mask is computed here).
    fn takes_device_argmax(&self) -> bool {
        self.constraint.is_none()
            && self.sampler.is_plain_greedy()
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.bias_distinct
    }

    fn send(&mut self, event: Event) -> bool {
        (self.events)(event)
    }

    /// Its next token from its row of the step's logits, which it changes in place (the
    /// step is done with them): the biases, then the OpenAI penalties, then the grammar's
    /// mask, then the sampler.
    fn choose(&mut self, logits: &mut [f32]) -> Result<TokenId, String> {
        for &(token, bias) in &self.logit_bias {
            logits[token as usize] += bias;
        }
        // With a bias, as without one, the penalties' subtractions are as they always
        // were (even of a zero: -0 - 0 stays -0, but x - -0 does not).
        if !self.logit_bias.is_empty()
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
        {
            for (&token, &count) in &self.counts {
                logits[token as usize] -=
                    self.presence_penalty + self.frequency_penalty * count as f32;
            }
        }
        if let Some(constraint) = &mut self.constraint {
            constraint.mask(logits)?;
        }
        self.sampler
            .sample_in_place(logits)
            .map_err(|e| e.to_string())
    }

    fn finish(&self, reason: FinishReason) -> Finish {
        Finish {
            reason,
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated,
            cached_tokens: self.cached_tokens,
        }
    }
}

struct Loop<'m> {
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
    fn new(
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
            deadline: None,
            logits: Vec::new(),
        }
    }

    /// Moves the steps to a GPU whose paged cache has the pool's blocks, and waits for
    /// every weight to be there. The pool then keeps only the books.
    fn start_gpu(&mut self, options: GpuOptions) -> Result<(), ModelError> {
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

    fn run(&mut self, receiver: &mpsc::Receiver<Message>) {
        loop {
            let mut began = Instant::now();
            if self.running.is_empty() && self.waiting.is_empty() {
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
            Message::Submit(request, arrived) => {
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
            Message::Shutdown(grace) => {
                self.deadline = Some(Instant::now() + grace);
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
        let bs = self.pool.block_size();
        let mut takers = Vec::new();
        for (i, (&n, &want)) in feed.iter().zip(&wants).enumerate() {
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
        let tokens = match out {
            StepOut::Tokens(tokens) => tokens.into_iter().map(Ok).collect(),
            StepOut::Logits => {
                let began = Instant::now();
                let n_vocab = self.model.config().n_vocab;
                let mut rows: Vec<(&mut Sequence<'m>, &mut [f32])> = self
                    .running
                    .iter_mut()
                    .zip(&wants)
                    .filter_map(|(seq, &want)| want.then_some(seq))
                    .zip(self.logits.chunks_exact_mut(n_vocab))
                    .collect();
                let tokens = choose_all(&mut rows);
                times.sample = began.elapsed();
                tokens
            }
        };
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
        Some(times)
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

/// Whether no token appears twice among `biases`.
fn distinct_tokens(biases: &[(TokenId, f32)]) -> bool {
    match biases.len() {
        0 | 1 => true,
        _ => {
            let mut tokens: Vec<TokenId> = biases.iter().map(|&(t, _)| t).collect();
            tokens.sort_unstable();
            tokens.windows(2).all(|w| w[0] != w[1])
        }
    }
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
