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
//! Sequences keep their keys and values in one shared [pool](crate::kv_pool) of blocks: a sequence
//! takes blocks as it grows and gives them back when it ends, so the context is not split
//! into fixed slots. A prompt that starts with blocks some earlier request computed (a
//! system prompt, the earlier turns of a chat) takes them instead of computing them. A
//! request waits while its prompt does not fit; when the running sequences outgrow the
//! pool, the youngest is pushed back to the queue and recomputed later (from the blocks
//! still cached, where they survived). A cancelled request (its client is gone) is
//! dropped at the start of the next step, and its blocks freed.
//!
//! Embeddings requests ([`Scheduler::embed`]) are work of another kind: between two
//! steps the loop runs some of their inputs (a step's budget of tokens) through the same
//! model to the last hidden states, in blocks of the pool it frees at once, and pools
//! them ([`crate::pooling`]).
//!
//! The scheduler is plain threads and channels; requests come with a callback that
//! receives their text, so any front end (the HTTP server in `cli`) can drive it.
//!
//! The step's forward pass runs on the CPU ([`batch`], the pool holding the keys and
//! values) or, started with [`Scheduler::start_on_gpu`], on a GPU: a
//! [`GpuModel`] whose paged KV cache has the pool's blocks, so the pool only keeps the
//! books (which block holds what) and the tables go to the device as they are.
//!
//! [`GpuModel`]: crate::gpu::GpuModel

mod batch;
mod metrics;
mod replicas;
mod scheduler_loop;
mod sequence;
mod stop;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::constraint::Constraint;
use crate::gpu::GpuOptions;
use crate::logprobs::MAX_TOP_LOGPROBS;
use crate::sampling::SamplingConfig;
use crate::tokenizer::{TokenId, Tokenizer};
use crate::Model;

pub use metrics::{
    Histogram, HistogramSnapshot, MaskHistogram, SchedulerMetrics, StepPhase, LATENCY_BUCKETS,
    MASK_BUCKETS,
};

pub use replicas::Replicas;
use scheduler_loop::Loop;

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
    /// The precisions the CPU's pool stores keys and values at (the GPU's cache is
    /// f16 and refuses others).
    pub kv_types: crate::KvTypes,
    /// When a sequence fills its context: finish it (`None`, reason `length`), or shift
    /// its context (llama.cpp's `--context-shift`): its first this-many tokens stay,
    /// half of the rest leaves, and the sequence goes back to the queue to compute the
    /// tokens it keeps again (from the pool's shared blocks where it can).
    pub context_shift: Option<usize>,
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

/// One token of a request's output with its log-probability (natural logarithm) and
/// its bytes: the bytes the tokenizer gives it alone (a control token's text; part of a
/// character where the token holds part of one).
#[derive(Clone, Debug, PartialEq)]
pub struct LogprobEntry {
    pub token: TokenId,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// The log-probabilities of one generated token: the token taken and the most likely
/// ones (see [`crate::logprobs`] for the distribution they are of).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub chosen: LogprobEntry,
    /// Highest first, ties by lower token id; `-inf` ones (masked) are left out.
    pub top: Vec<LogprobEntry>,
}

/// What a request that wants log-probabilities adds to [`Request`]: how many of the most
/// likely tokens each generated token lists (at most [`MAX_TOP_LOGPROBS`]), and where
/// they go. The scheduler calls `sink` for every generated token but the end of
/// generation, before the [`Event::Text`] that holds its text, on the thread that calls
/// `events`.
pub struct LogprobsRequest {
    pub top: usize,
    pub sink: Box<dyn FnMut(TokenLogprobs) + Send>,
}

/// Where an embeddings request's vectors go: one per input, in order, or why the
/// request failed. Called once, on the scheduler thread.
pub type EmbedReply = Box<dyn FnOnce(Result<Vec<Vec<f32>>, String>) + Send>;

/// Texts to embed, as token ids: each input's vector is the mean of its last hidden
/// states after the final norm, scaled to unit length ([`crate::pooling`]). The inputs
/// run between the steps of the completions, through the same model, in blocks of the
/// pool that are freed as soon as they are computed: they leave no keys and values
/// behind.
pub struct EmbedRequest {
    pub inputs: Vec<Vec<TokenId>>,
    pub reply: EmbedReply,
}

enum Message {
    Submit(Box<Request>, Option<LogprobsRequest>, Instant),
    Embed(Box<EmbedRequest>),
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
        Scheduler::start_with(model, tokenizer, config, Some((options, None)))
    }

    /// As [`Scheduler::start_on_gpu`], the model split by layers over several GPUs as
    /// `split` says (each device its layers' part of every block of the pool).
    pub fn start_on_gpus(
        model: Model,
        tokenizer: Arc<Tokenizer>,
        config: SchedulerConfig,
        options: GpuOptions,
        split: crate::gpu::SplitOptions,
    ) -> Result<Scheduler, ServeError> {
        Scheduler::start_with(model, tokenizer, config, Some((options, Some(split))))
    }

    fn start_with(
        model: Model,
        tokenizer: Arc<Tokenizer>,
        config: SchedulerConfig,
        gpu: Option<(GpuOptions, Option<crate::gpu::SplitOptions>)>,
    ) -> Result<Scheduler, ServeError> {
        config.validate()?;
        config
            .kv_types
            .check(model.config(), config.attention)
            .map_err(|e| ServeError::InvalidConfig(e.to_string()))?;
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
                    let started =
                        gpu.map(|(options, split)| looper.start_gpu(options, split.as_ref()));
                    if let Some(Err(e)) = started {
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

    /// Whether the scheduler takes requests: not shut down, its thread not ended (a
    /// thread that panicked has).
    pub fn is_running(&self) -> bool {
        self.accepting.load(Ordering::SeqCst)
            && self
                .thread
                .lock()
                .is_ok_and(|t| t.as_ref().is_some_and(|t| !t.is_finished()))
    }

    pub fn metrics(&self) -> &Arc<SchedulerMetrics> {
        &self.metrics
    }

    /// Queues a request, or says at once why it can never run or cannot run now.
    pub fn submit(&self, request: Request) -> Result<(), ServeError> {
        self.submit_with(request, None)
    }

    /// As [`Scheduler::submit`], the request's generated tokens also giving their
    /// log-probabilities to `logprobs` when it is set. Such a sequence's logits come to
    /// the host every step (the device does not pick its tokens).
    pub fn submit_with(
        &self,
        request: Request,
        logprobs: Option<LogprobsRequest>,
    ) -> Result<(), ServeError> {
        if let Some(asked) = &logprobs {
            if asked.top > MAX_TOP_LOGPROBS {
                return Err(ServeError::InvalidConfig(format!(
                    "at most {MAX_TOP_LOGPROBS} top log-probabilities, not {}",
                    asked.top
                )));
            }
        }
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(ServeError::ShuttingDown);
        }
        self.check_prompt(&request.prompt)?;
        self.check_tokens(request.logit_bias.iter().map(|&(t, _)| t))?;
        let message = Message::Submit(Box::new(request), logprobs, Instant::now());
        self.enqueue(message, &self.metrics.requests_received)
    }

    /// Queues an embeddings request, or says at once why it can never run or cannot run
    /// now: no inputs, an empty one, one longer than the context or with a token outside
    /// the vocabulary. It waits in the queue as a completion does.
    pub fn embed(&self, request: EmbedRequest) -> Result<(), ServeError> {
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(ServeError::ShuttingDown);
        }
        if request.inputs.is_empty() {
            return Err(ServeError::EmptyPrompt);
        }
        for input in &request.inputs {
            self.check_prompt(input)?;
        }
        let message = Message::Embed(Box::new(request));
        self.enqueue(message, &self.metrics.embedding_requests)
    }

    /// A prompt the scheduler can run: some tokens, within the context and the vocabulary.
    fn check_prompt(&self, prompt: &[TokenId]) -> Result<(), ServeError> {
        let n = prompt.len();
        if n == 0 {
            return Err(ServeError::EmptyPrompt);
        }
        if n > self.config.context_size {
            return Err(ServeError::PromptTooLong {
                prompt_tokens: n,
                context_size: self.config.context_size,
            });
        }
        self.check_tokens(prompt.iter().copied())
    }

    fn check_tokens(&self, mut tokens: impl Iterator<Item = TokenId>) -> Result<(), ServeError> {
        match tokens.find(|&t| t as usize >= self.n_vocab) {
            Some(token) => Err(ServeError::TokenOutOfRange {
                token,
                n_vocab: self.n_vocab,
            }),
            None => Ok(()),
        }
    }

    /// Sends `message` to the scheduler thread if the queue has room, counting it in
    /// `received`.
    fn enqueue(&self, message: Message, received: &AtomicU64) -> Result<(), ServeError> {
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
        SchedulerMetrics::add(received, 1);
        let sent = self
            .sender
            .lock()
            .map_err(|_| ServeError::ShuttingDown)?
            .send(message);
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
