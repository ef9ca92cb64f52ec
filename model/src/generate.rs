//! The generation loop: the prompt in one batch, then one token at a time until an
//! end-of-generation token, the token limit, a full context, or a stop request.
//!
//! Text is handed out as it is produced, in pieces that are always valid UTF-8 (a
//! character whose bytes span several tokens comes out whole once its last byte is in).
//! End-of-generation tokens end the loop and are neither returned nor printed, as in
//! llama.cpp's CLI. The prompt's tokens count as "recent" for the repetition penalty,
//! also as in llama.cpp.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::gpu::GpuModel;
use crate::sampling::{Sampler, SamplingConfig, SamplingError, SamplingMode};
use crate::tokenizer::{TokenId, Tokenizer, TokenizerError};
use crate::{AttentionMethod, KvCache, Model, ModelError};

/// What a forward pass hands the generation loop.
pub enum Next<'a> {
    /// The logits of the last token, for the sampler.
    Logits(&'a [f32]),
    /// The greedy choice, already taken (where the device takes it, only the token
    /// travels back).
    Token(TokenId),
}

/// A model with its KV cache, on whichever device computes it: the generation loop's
/// view of a back end.
pub trait Session {
    /// Appends `tokens` to the cache and returns what comes after the last one: its
    /// logits, or with `greedy` possibly the argmax alone (the first highest logit, as
    /// the greedy sampler picks it).
    fn eval(&mut self, tokens: &[TokenId], greedy: bool) -> Result<Next<'_>, ModelError>;

    /// Makes room in a full context (llama.cpp's context shift): positions
    /// `keep..keep + discard` leave the cache and the later ones move down by `discard`.
    /// `kept` is every token the cache holds afterwards, in order, for a back end that
    /// computes them again instead of moving its keys.
    fn shift(&mut self, keep: usize, discard: usize, kept: &[TokenId]) -> Result<(), ModelError>;
}

/// The CPU back end: a model and its cache.
pub struct CpuSession<'m> {
    model: &'m Model,
    cache: KvCache,
    logits: Vec<f32>,
}

impl<'m> CpuSession<'m> {
    /// A session with an empty cache of `positions` positions.
    pub fn new(model: &'m Model, positions: usize) -> CpuSession<'m> {
        CpuSession::with_cache(model, model.new_cache(positions))
    }

    /// A session over `cache`, which must be empty.
    pub fn with_cache(model: &'m Model, cache: KvCache) -> CpuSession<'m> {
        CpuSession {
            model,
            cache,
            logits: Vec::new(),
        }
    }
}

impl Session for CpuSession<'_> {
    fn eval(&mut self, tokens: &[TokenId], _greedy: bool) -> Result<Next<'_>, ModelError> {
        self.logits = self.model.forward(tokens, &mut self.cache)?;
        Ok(Next::Logits(&self.logits))
    }

    /// Moves the kept keys as llama.cpp does (their RoPE turned back).
    fn shift(&mut self, keep: usize, discard: usize, _kept: &[TokenId]) -> Result<(), ModelError> {
        self.model.shift_cache(&mut self.cache, keep, discard)
    }
}

/// A GPU back end's [`Session`]: the greedy token taken on the device, and a context
/// shift that computes the kept tokens again (the device's cache does not move its keys:
/// the same room made, the kept positions' keys and values those of the shorter text).
macro_rules! gpu_session {
    ($($ty:ty),*) => {$(
        impl Session for $ty {
            fn eval(&mut self, tokens: &[TokenId], greedy: bool) -> Result<Next<'_>, ModelError> {
                if greedy {
                    return self.forward_argmax(tokens).map(Next::Token);
                }
                self.forward_logits(tokens).map(Next::Logits)
            }

            fn shift(
                &mut self,
                _keep: usize,
                _discard: usize,
                kept: &[TokenId],
            ) -> Result<(), ModelError> {
                self.clear()?;
                if !kept.is_empty() {
                    self.forward_logits(kept)?;
                }
                Ok(())
            }
        }
    )*};
}

gpu_session!(GpuModel, crate::gpu::LayerSplit, crate::gpu::TensorSplit);

/// A model on one GPU or split over several.
impl Session for crate::gpu::GpuEngine {
    fn eval(&mut self, tokens: &[TokenId], greedy: bool) -> Result<Next<'_>, ModelError> {
        match self {
            crate::gpu::GpuEngine::One(gpu) => gpu.eval(tokens, greedy),
            crate::gpu::GpuEngine::Split(gpu) => gpu.eval(tokens, greedy),
            crate::gpu::GpuEngine::Tensor(gpu) => gpu.eval(tokens, greedy),
        }
    }

    fn shift(&mut self, keep: usize, discard: usize, kept: &[TokenId]) -> Result<(), ModelError> {
        match self {
            crate::gpu::GpuEngine::One(gpu) => gpu.shift(keep, discard, kept),
            crate::gpu::GpuEngine::Split(gpu) => gpu.shift(keep, discard, kept),
            crate::gpu::GpuEngine::Tensor(gpu) => gpu.shift(keep, discard, kept),
        }
    }
}

/// Why generation could not run.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("the prompt has no tokens: there is nothing to continue")]
    EmptyPrompt,
    #[error("the prompt has {prompt_tokens} tokens but the context holds {context_size}")]
    PromptTooLong {
        prompt_tokens: usize,
        context_size: usize,
    },
    #[error("context size must be at least 1")]
    ZeroContext,
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
}

/// What to generate and how.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GenerateOptions {
    pub sampling: SamplingConfig,
    /// Most tokens to generate (end-of-generation tokens not counted).
    pub max_tokens: usize,
    /// Most positions, prompt included, the KV cache may hold.
    pub context_size: usize,
    /// How the CPU computes attention (the GPU has one way of its own).
    pub attention: AttentionMethod,
    /// The precisions the CPU's KV cache stores keys and values at (the GPU's is f16).
    pub kv_types: crate::KvTypes,
    /// When the context fills: stop (`None`), or shift it (llama.cpp's
    /// `--context-shift`), keeping this many first positions and dropping half of the
    /// rest, so generation goes on up to `max_tokens`.
    pub context_shift: Option<usize>,
}

/// Why the loop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-generation token.
    EndOfGeneration,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The context is full.
    ContextFull,
    /// The stop flag was set (Ctrl-C).
    Interrupted,
    /// The text callback asked to stop.
    CallbackStopped,
}

impl StopReason {
    /// A short lower-case name for reports (`end_of_generation`, `max_tokens`, ...).
    pub fn name(self) -> &'static str {
        match self {
            StopReason::EndOfGeneration => "end_of_generation",
            StopReason::MaxTokens => "max_tokens",
            StopReason::ContextFull => "context_full",
            StopReason::Interrupted => "interrupted",
            StopReason::CallbackStopped => "callback_stopped",
        }
    }
}

/// Where the time went.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    /// The prompt's forward pass.
    pub prompt: Duration,
    pub prompt_tokens: usize,
    /// Everything after the prompt: sampling, decoding and single-token forward passes.
    pub decode: Duration,
    /// Single-token forward passes after the prompt (the first generated token comes from
    /// the prompt's logits, so this is one less than the tokens generated, or equal when
    /// the last one was fed back before a stop).
    pub decode_passes: usize,
    /// When the first token was chosen (after the prompt's forward pass).
    pub first_token: Option<Instant>,
}

impl Timings {
    pub fn prompt_ms(&self) -> f64 {
        self.prompt.as_secs_f64() * 1e3
    }

    pub fn decode_ms(&self) -> f64 {
        self.decode.as_secs_f64() * 1e3
    }

    /// `None` when no prompt was processed.
    pub fn prompt_tokens_per_s(&self) -> Option<f64> {
        rate(self.prompt_tokens, self.prompt)
    }

    /// `None` when no token was decoded after the prompt.
    pub fn decode_tokens_per_s(&self) -> Option<f64> {
        rate(self.decode_passes, self.decode)
    }
}

fn rate(count: usize, time: Duration) -> Option<f64> {
    (count > 0 && !time.is_zero()).then(|| count as f64 / time.as_secs_f64())
}

/// The result of a generation.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    pub prompt_tokens: Vec<TokenId>,
    /// Generated tokens, without the end-of-generation token.
    pub tokens: Vec<TokenId>,
    /// The end-of-generation token, when that is why the loop stopped.
    pub end_token: Option<TokenId>,
    /// All text handed to the callback.
    pub text: String,
    pub stop_reason: StopReason,
    pub timings: Timings,
    /// How many times the context was shifted to make room (`context_shift`).
    pub context_shifts: usize,
}

/// Continues `prompt_tokens` with `model` on the CPU, handing each new piece of text to
/// `on_text` (return [`ControlFlow::Break`] to stop). Setting `stop` ends the loop before
/// the next forward pass; what was generated so far is returned.
pub fn generate<F>(
    model: &Model,
    tokenizer: &Tokenizer,
    prompt_tokens: &[TokenId],
    options: &GenerateOptions,
    stop: &AtomicBool,
    on_text: F,
) -> Result<Generation, GenerateError>
where
    F: FnMut(&str) -> ControlFlow<()>,
{
    check_prompt(prompt_tokens.len(), options.context_size)?;
    // The last sampled token is never fed back, so this many positions suffice.
    let positions = prompt_tokens
        .len()
        .saturating_add(options.max_tokens.saturating_sub(1))
        .min(options.context_size);
    let cache = model
        .new_cache(positions)
        .with_attention(options.attention)
        .with_context(options.context_size)
        .with_types(model.config(), options.kv_types)?;
    let mut session = CpuSession::with_cache(model, cache);
    generate_with(
        &mut session,
        tokenizer,
        prompt_tokens,
        options,
        stop,
        on_text,
    )
}

/// As [`generate`], on any [`Session`] (whose cache must be empty and hold
/// `options.context_size` positions, or as many as the prompt and `max_tokens` need).
pub fn generate_with<F>(
    session: &mut dyn Session,
    tokenizer: &Tokenizer,
    prompt_tokens: &[TokenId],
    options: &GenerateOptions,
    stop: &AtomicBool,
    mut on_text: F,
) -> Result<Generation, GenerateError>
where
    F: FnMut(&str) -> ControlFlow<()>,
{
    check_prompt(prompt_tokens.len(), options.context_size)?;
    let mut output = Generation {
        prompt_tokens: prompt_tokens.to_vec(),
        tokens: Vec::new(),
        end_token: None,
        text: String::new(),
        stop_reason: StopReason::MaxTokens,
        timings: Timings::default(),
        context_shifts: 0,
    };
    if options.max_tokens == 0 {
        return Ok(output);
    }
    if stop.load(Ordering::Relaxed) {
        output.stop_reason = StopReason::Interrupted;
        return Ok(output);
    }
    let mut sampler = Sampler::new(options.sampling);
    for &token in prompt_tokens {
        sampler.accept(token);
    }
    // Greedy without a penalty needs no logits: a device may take the argmax itself.
    let greedy =
        matches!(options.sampling.mode, SamplingMode::Greedy) && options.sampling.penalty.is_none();

    let start = Instant::now();
    let mut decode_start = start;
    let mut positions = 0usize;
    let mut input: Vec<TokenId> = prompt_tokens.to_vec();
    // With a context shift, the tokens the cache holds, in order.
    let mut held: Vec<TokenId> = Vec::new();
    let mut decoder = tokenizer.stream_decoder(false);
    let stop_reason = loop {
        let token = {
            let _span = tracing::trace_span!("forward", n_tokens = input.len()).entered();
            match session.eval(&input, greedy) {
                Ok(Next::Token(token)) => token,
                Ok(Next::Logits(logits)) => sampler.sample(logits)?,
                // A back end that honours the stop flag itself (the GPU's, between
                // layers) stopped within the pass: the cache is as before it.
                Err(ModelError::Interrupted) => break StopReason::Interrupted,
                Err(error) => return Err(error.into()),
            }
        };
        positions += input.len();
        if options.context_shift.is_some() {
            held.extend_from_slice(&input);
        }
        if output.timings.first_token.is_none() {
            decode_start = Instant::now();
            output.timings.prompt = decode_start - start;
            output.timings.prompt_tokens = prompt_tokens.len();
            output.timings.first_token = Some(decode_start);
        } else {
            output.timings.decode_passes += 1;
        }
        sampler.accept(token);
        if tokenizer.is_end_of_generation(token) {
            output.end_token = Some(token);
            break StopReason::EndOfGeneration;
        }
        output.tokens.push(token);
        let piece = decoder.push(token)?;
        if !piece.is_empty() {
            output.text.push_str(&piece);
            if on_text(&piece).is_break() {
                break StopReason::CallbackStopped;
            }
        }
        if output.tokens.len() >= options.max_tokens {
            break StopReason::MaxTokens;
        }
        match options.context_shift {
            None if positions >= options.context_size => break StopReason::ContextFull,
            // As llama.cpp: when the next token would fill the context, the first `keep`
            // stay and half of the rest leaves.
            Some(keep) if positions + 1 >= options.context_size => {
                let keep = keep.min(positions);
                let discard = (positions - keep) / 2;
                if discard == 0 {
                    break StopReason::ContextFull;
                }
                held.drain(keep..keep + discard);
                match session.shift(keep, discard, &held) {
                    Ok(()) => {}
                    Err(ModelError::Interrupted) => break StopReason::Interrupted,
                    Err(error) => return Err(error.into()),
                }
                positions -= discard;
                output.context_shifts += 1;
                tracing::debug!(keep, discard, positions, "context shifted");
            }
            _ => {}
        }
        if stop.load(Ordering::Relaxed) {
            break StopReason::Interrupted;
        }
        input.clear();
        input.push(token);
    };
    let rest = decoder.finish();
    if !rest.is_empty() {
        output.text.push_str(&rest);
        // The loop is over either way; a request to stop changes nothing here.
        let _ = on_text(&rest);
    }
    output.timings.decode = decode_start.elapsed();
    output.stop_reason = stop_reason;
    Ok(output)
}

/// The checks done before any work: a prompt that exists and fits.
fn check_prompt(prompt_tokens: usize, context_size: usize) -> Result<(), GenerateError> {
    if context_size == 0 {
        return Err(GenerateError::ZeroContext);
    }
    if prompt_tokens == 0 {
        return Err(GenerateError::EmptyPrompt);
    }
    if prompt_tokens > context_size {
        return Err(GenerateError::PromptTooLong {
            prompt_tokens,
            context_size,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_checks_name_the_sizes() {
        assert!(matches!(
            check_prompt(1, 0),
            Err(GenerateError::ZeroContext)
        ));
        assert!(matches!(
            check_prompt(0, 8),
            Err(GenerateError::EmptyPrompt)
        ));
        let e = check_prompt(9, 8).unwrap_err();
        assert!(matches!(
            e,
            GenerateError::PromptTooLong {
                prompt_tokens: 9,
                context_size: 8
            }
        ));
        assert_eq!(
            e.to_string(),
            "the prompt has 9 tokens but the context holds 8"
        );
        assert!(check_prompt(8, 8).is_ok());
    }

    #[test]
    fn rates_are_absent_without_work() {
        let t = Timings {
            prompt: Duration::from_millis(500),
            prompt_tokens: 10,
            decode: Duration::ZERO,
            decode_passes: 0,
            first_token: None,
        };
        assert_eq!(t.prompt_tokens_per_s(), Some(20.0));
        assert_eq!(t.decode_tokens_per_s(), None);
        assert_eq!(t.prompt_ms(), 500.0);
        assert_eq!(Timings::default().prompt_tokens_per_s(), None);
    }
}
