//! A request being served: its tokens, blocks, sampler and stop strings, and how it
//! chooses its next token.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use crate::constraint::{Constraint, TokenMask};
use crate::logprobs::{top_logprobs, TokenLogprob};
use crate::sampling::Sampler;
use crate::tokenizer::{StreamDecoder, TokenId};

use super::stop::StopMatcher;
use super::{Event, EventSink, Finish, FinishReason, LogprobsRequest};
use crate::kv_pool::BlockId;

/// A request being served.
pub(super) struct Sequence<'t> {
    /// Prompt and generated tokens.
    pub(super) tokens: Vec<TokenId>,
    pub(super) prompt_len: usize,
    /// Positions whose keys and values are in the sequence's blocks.
    pub(super) computed: usize,
    pub(super) table: Vec<BlockId>,
    /// Blocks of `table` offered to the pool's registry so far.
    pub(super) offered: usize,
    pub(super) max_tokens: usize,
    pub(super) generated: usize,
    pub(super) sampler: Sampler,
    pub(super) decoder: StreamDecoder<'t>,
    pub(super) stop: StopMatcher,
    pub(super) presence_penalty: f32,
    pub(super) frequency_penalty: f32,
    pub(super) logit_bias: Vec<(TokenId, f32)>,
    /// Whether no token appears twice in `logit_bias` (the device adds them all at once).
    pub(super) bias_distinct: bool,
    /// Occurrences of each generated token (for the OpenAI penalties).
    pub(super) counts: HashMap<TokenId, u32>,
    /// The grammar its output follows, if any.
    pub(super) constraint: Option<Constraint>,
    pub(super) cancel: Arc<AtomicBool>,
    pub(super) events: EventSink,
    /// Where its tokens' log-probabilities go, when it asks for them.
    pub(super) logprobs: Option<LogprobsRequest>,
    /// The log-probabilities of the token [`Sequence::choose`] chose last (taken with
    /// the token): the token's own, and the top ones.
    pub(super) chosen_logprobs: Option<(TokenLogprob, Vec<TokenLogprob>)>,
    /// The grammar's mask for its next token, when the step computed it already (on the
    /// GPU, while the device ran the pass); taken by the token's choice.
    pub(super) next_mask: Option<Result<TokenMask, String>>,
    /// How long the grammar's mask took for the token [`Sequence::choose`] chose last
    /// (taken by the step into [`super::SchedulerMetrics::constraint_mask`]).
    pub(super) mask_time: Option<std::time::Duration>,
    pub(super) arrived: Instant,
    pub(super) last_token: Option<Instant>,
    pub(super) cached_tokens: usize,
    /// Whether it counts against the queue's limit while waiting (new requests do,
    /// preempted ones do not).
    pub(super) counted: bool,
    /// Set when its context was shifted: it goes back to the queue to compute its
    /// tokens again.
    pub(super) shifted: bool,
}

impl Sequence<'_> {
    /// Whether its next token is the first highest logit of the model's logits with its
    /// biases added (as [`Sequence::choose`] adds them): greedy, with no penalty, and
    /// biases of distinct tokens (the device adds them all at once), and no
    /// log-probabilities (they are computed from the row here). A grammar's mask goes to
    /// the device with the step.
    pub(super) fn takes_device_argmax(&self) -> bool {
        self.logprobs.is_none()
            && self.sampler.is_plain_greedy()
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.bias_distinct
    }

    pub(super) fn send(&mut self, event: Event) -> bool {
        (self.events)(event)
    }

    /// Its next token from its row of the step's logits, which it changes in place (the
    /// step is done with them): the biases, then the OpenAI penalties, then the grammar's
    /// mask, then the sampler. A sequence that asks for log-probabilities keeps them of
    /// the row as the sampler gets it (before its own repeat penalty and temperature).
    pub(super) fn choose(&mut self, logits: &mut [f32]) -> Result<TokenId, String> {
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
            let mask = match self.next_mask.take() {
                Some(mask) => mask?,
                None => {
                    let began = Instant::now();
                    let mask = constraint.next_mask(logits.len())?;
                    self.mask_time = Some(began.elapsed());
                    mask
                }
            };
            mask.apply(logits);
        }
        if let Some(asked) = &self.logprobs {
            let (softmax, top) = top_logprobs(logits, asked.top);
            // The sampler leaves the row as it is, to read the chosen token's logit.
            let token = self.sampler.sample(logits).map_err(|e| e.to_string())?;
            let logprob = softmax.of(logits[token as usize]);
            self.chosen_logprobs = Some((TokenLogprob { token, logprob }, top));
            return Ok(token);
        }
        self.sampler
            .sample_in_place(logits)
            .map_err(|e| e.to_string())
    }

    pub(super) fn finish(&self, reason: FinishReason) -> Finish {
        Finish {
            reason,
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated,
            cached_tokens: self.cached_tokens,
        }
    }
}

/// Whether no token appears twice among `biases`.
pub(super) fn distinct_tokens(biases: &[(TokenId, f32)]) -> bool {
    match biases.len() {
        0 | 1 => true,
        _ => {
            let mut tokens: Vec<TokenId> = biases.iter().map(|&(t, _)| t).collect();
            tokens.sort_unstable();
            tokens.windows(2).all(|w| w[0] != w[1])
        }
    }
}
