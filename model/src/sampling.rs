//! Choosing the next token from a row of logits.
//!
//! The stages run in the order of llama.cpp's default sampler chain, so that the same
//! settings mean the same thing in both engines:
//!
//! 1. **repetition penalty** over the last `repeat_last_n` tokens (prompt included): a
//!    positive logit is divided by the penalty, a zero or negative one multiplied by it;
//! 2. **top-k**: keep the `k` highest logits;
//! 3. **top-p** (nucleus): keep the smallest prefix of the candidates, highest first,
//!    whose probabilities sum to at least `p`;
//! 4. **min-p**: keep the candidates whose probability is at least `p` times the most
//!    likely one's;
//! 5. **temperature**: divide the logits by `t`;
//! 6. **draw** one candidate from the softmax of what is left, with a seeded RNG.
//!
//! Top-p and min-p therefore see the distribution *before* temperature, as in llama.cpp.
//! Temperature 0 is greedy: the highest logit after the penalty wins, ties going to the
//! lowest id, and the other stages are skipped (they never remove the top token).
//!
//! The RNG is xoshiro256** seeded through SplitMix64: a given seed draws the same numbers
//! on every run and platform, so a seeded run reproduces its tokens.

use std::collections::VecDeque;

/// Invalid sampling settings, or logits that cannot be sampled from.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {value}")]
    InvalidTemperature { value: f32 },
    #[error("top-p must be in (0, 1], got {value}")]
    InvalidTopP { value: f32 },
    #[error("min-p must be in [0, 1], got {value}")]
    InvalidMinP { value: f32 },
    #[error("repeat penalty must be a finite number > 0, got {value}")]
    InvalidRepeatPenalty { value: f32 },
    #[error("no logits to sample from")]
    EmptyLogits,
    #[error("logit of token {token} is {value}, not a number that can be sampled")]
    BadLogit { token: u32, value: f32 },
    #[error("every logit is -inf: no token can be chosen")]
    AllMasked,
}

/// llama.cpp's CLI defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, no
/// repetition penalty, penalty window 64.
pub mod defaults {
    pub const TEMPERATURE: f32 = 0.8;
    pub const TOP_K: usize = 40;
    pub const TOP_P: f32 = 0.95;
    pub const MIN_P: f32 = 0.05;
    pub const REPEAT_PENALTY: f32 = 1.0;
    pub const REPEAT_LAST_N: usize = 64;
}

/// Sampling settings as a user gives them; [`SamplingParams::validate`] turns them into a
/// [`SamplingMode`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 1 disables top-p.
    pub top_p: f32,
    /// 0 disables min-p.
    pub min_p: f32,
    /// 1 disables the penalty.
    pub repeat_penalty: f32,
    /// How many of the latest tokens the penalty looks at; 0 disables it.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> SamplingParams {
        SamplingParams {
            temperature: defaults::TEMPERATURE,
            top_k: defaults::TOP_K,
            top_p: defaults::TOP_P,
            min_p: defaults::MIN_P,
            repeat_penalty: defaults::REPEAT_PENALTY,
            repeat_last_n: defaults::REPEAT_LAST_N,
            seed: 0,
        }
    }
}

/// The repetition penalty, when one applies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RepeatPenalty {
    pub penalty: f32,
    pub last_n: usize,
}

/// How the next token is chosen: a closed set of validated choices.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SamplingMode {
    /// The highest logit.
    Greedy,
    /// A random draw after the filters; `None` means that filter is off.
    Random {
        temperature: f32,
        top_k: Option<usize>,
        top_p: Option<f32>,
        min_p: Option<f32>,
        seed: u64,
    },
}

/// Validated settings: the mode and the optional penalty.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingConfig {
    pub mode: SamplingMode,
    pub penalty: Option<RepeatPenalty>,
}

impl SamplingConfig {
    /// True when tokens are drawn at random (so the seed matters).
    pub fn is_random(&self) -> bool {
        matches!(self.mode, SamplingMode::Random { .. })
    }
}

impl SamplingParams {
    /// Greedy decoding without penalty.
    pub fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        }
    }

    /// Checks every value and drops the filters that are switched off.
    pub fn validate(&self) -> Result<SamplingConfig, SamplingError> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return Err(SamplingError::InvalidTemperature { value: t });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::InvalidTopP { value: self.top_p });
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::InvalidMinP { value: self.min_p });
        }
        let r = self.repeat_penalty;
        if !r.is_finite() || r <= 0.0 {
            return Err(SamplingError::InvalidRepeatPenalty { value: r });
        }
        let penalty = (r != 1.0 && self.repeat_last_n > 0).then_some(RepeatPenalty {
            penalty: r,
            last_n: self.repeat_last_n,
        });
        let mode = if t == 0.0 {
            SamplingMode::Greedy
        } else {
            SamplingMode::Random {
                temperature: t,
                top_k: (self.top_k > 0).then_some(self.top_k),
                top_p: (self.top_p < 1.0).then_some(self.top_p),
                min_p: (self.min_p > 0.0).then_some(self.min_p),
                seed: self.seed,
            }
        };
        Ok(SamplingConfig { mode, penalty })
    }
}

/// xoshiro256**: a small, fast generator with a 256-bit state, identical on every
/// platform.
#[derive(Clone, Debug)]
pub struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    /// Expands `seed` into the state with SplitMix64 (so seed 0 is fine).
    pub fn seed_from_u64(seed: u64) -> Xoshiro256 {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Xoshiro256 {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1), from the top 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// One candidate token during filtering.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Candidate {
    id: u32,
    logit: f32,
}

/// Picks tokens according to a [`SamplingConfig`], remembering the recent tokens the
/// repetition penalty needs. Buffers are reused from one token to the next.
#[derive(Clone, Debug)]
pub struct Sampler {
    config: SamplingConfig,
    rng: Xoshiro256,
    recent: VecDeque<u32>,
    scratch: Vec<f32>,
    candidates: Vec<Candidate>,
    probs: Vec<f64>,
}

impl Sampler {
    pub fn new(config: SamplingConfig) -> Sampler {
        let seed = match config.mode {
            SamplingMode::Random { seed, .. } => seed,
            SamplingMode::Greedy => 0,
        };
        Sampler {
            config,
            rng: Xoshiro256::seed_from_u64(seed),
            recent: VecDeque::new(),
            scratch: Vec::new(),
            candidates: Vec::new(),
            probs: Vec::new(),
        }
    }

    pub fn config(&self) -> &SamplingConfig {
        &self.config
    }

    /// Records a token (of the prompt or generated) for the repetition penalty.
    pub fn accept(&mut self, token: u32) {
        let Some(penalty) = self.config.penalty else {
            return;
        };
        if self.recent.len() == penalty.last_n {
            self.recent.pop_front();
        }
        self.recent.push_back(token);
    }

    /// True when [`sample`](Sampler::sample) is the first highest logit as it is: greedy,
    /// without a repeat penalty (so a device's argmax of the logits is the same token).
    pub fn is_plain_greedy(&self) -> bool {
        self.config.mode == SamplingMode::Greedy && self.config.penalty.is_none()
    }

    /// Chooses the next token from `logits` (one per vocabulary entry). Does not
    /// [`accept`](Sampler::accept) it.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        check_logits(logits)?;
        if self.is_plain_greedy() {
            // Nothing changes the logits: no copy (a whole vocabulary per token, for
            // every sequence of a batch).
            return Ok(argmax(logits));
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(logits);
        if let Some(penalty) = self.config.penalty {
            apply_repeat_penalty(&mut self.scratch, &self.recent, penalty.penalty);
        }
        match self.config.mode {
            SamplingMode::Greedy => Ok(argmax(&self.scratch)),
            SamplingMode::Random {
                temperature,
                top_k,
                top_p,
                min_p,
                ..
            } => {
                self.candidates.clear();
                self.candidates
                    .extend(
                        self.scratch
                            .iter()
                            .enumerate()
                            .map(|(id, &logit)| Candidate {
                                id: id as u32,
                                logit,
                            }),
                    );
                match top_k {
                    Some(k) => top_k_sorted(&mut self.candidates, k),
                    None => sort_descending(&mut self.candidates),
                }
                if let Some(p) = top_p {
                    top_p_filter(&mut self.candidates, p, &mut self.probs);
                }
                if let Some(p) = min_p {
                    min_p_filter(&mut self.candidates, p);
                }
                Ok(draw(
                    &self.candidates,
                    temperature,
                    &mut self.probs,
                    &mut self.rng,
                ))
            }
        }
    }
}

/// Refuses empty rows, ids past `u32`, NaN and +inf (a -inf logit is a masked token).
fn check_logits(logits: &[f32]) -> Result<(), SamplingError> {
    if logits.is_empty() {
        return Err(SamplingError::EmptyLogits);
    }
    if let Some((token, &value)) = logits
        .iter()
        .enumerate()
        .find(|(_, l)| l.is_nan() || **l == f32::INFINITY)
    {
        return Err(SamplingError::BadLogit {
            token: token as u32,
            value,
        });
    }
    if logits.iter().all(|&l| l == f32::NEG_INFINITY) {
        return Err(SamplingError::AllMasked);
    }
    Ok(())
}

/// The index of the highest value; the first one on ties.
fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate().skip(1) {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// Penalizes each distinct token of `recent` once, as llama.cpp does.
fn apply_repeat_penalty(logits: &mut [f32], recent: &VecDeque<u32>, penalty: f32) {
    let mut seen: Vec<u32> = recent.iter().copied().collect();
    seen.sort_unstable();
    seen.dedup();
    for token in seen {
        if let Some(logit) = logits.get_mut(token as usize) {
            if *logit <= 0.0 {
                *logit *= penalty;
            } else {
                *logit /= penalty;
            }
        }
    }
}

/// Highest logit first; ties by lower id, so results do not depend on the sort.
fn by_logit_descending(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

fn sort_descending(candidates: &mut [Candidate]) {
    candidates.sort_unstable_by(by_logit_descending);
}

/// Keeps the `k` highest, sorted.
fn top_k_sorted(candidates: &mut Vec<Candidate>, k: usize) {
    if k < candidates.len() {
        candidates.select_nth_unstable_by(k - 1, by_logit_descending);
        candidates.truncate(k);
    }
    sort_descending(candidates);
}

/// Softmax of `scale` × the logits of sorted candidates into `probs`, in f64 (the
/// largest logit is first).
fn softmax_sorted(candidates: &[Candidate], scale: f64, probs: &mut Vec<f64>) {
    probs.clear();
    let max = f64::from(candidates[0].logit);
    probs.extend(
        candidates
            .iter()
            .map(|c| ((f64::from(c.logit) - max) * scale).exp()),
    );
    let sum: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
}

/// Keeps the shortest sorted prefix whose probability mass reaches `p` (at least one).
fn top_p_filter(candidates: &mut Vec<Candidate>, p: f32, probs: &mut Vec<f64>) {
    softmax_sorted(candidates, 1.0, probs);
    let mut cumulative = 0.0;
    let mut keep = candidates.len();
    for (i, prob) in probs.iter().enumerate() {
        cumulative += prob;
        if cumulative >= f64::from(p) {
            keep = i + 1;
            break;
        }
    }
    candidates.truncate(keep);
}

/// Keeps candidates with probability >= `p` × the top probability, i.e. logit >= top
/// logit + ln p. The sorted order keeps the top candidate.
fn min_p_filter(candidates: &mut Vec<Candidate>, p: f32) {
    let threshold = f64::from(candidates[0].logit) + f64::from(p).ln();
    let keep = candidates
        .iter()
        .take_while(|c| f64::from(c.logit) >= threshold)
        .count();
    candidates.truncate(keep.max(1));
}

/// Draws one of the sorted candidates with probability softmax(logit / temperature).
/// The temperature divides differences to the top logit, so a tiny temperature cannot
/// overflow to inf - inf.
fn draw(
    candidates: &[Candidate],
    temperature: f32,
    probs: &mut Vec<f64>,
    rng: &mut Xoshiro256,
) -> u32 {
    softmax_sorted(candidates, 1.0 / f64::from(temperature), probs);
    let u = rng.next_f64();
    let mut cumulative = 0.0;
    for (c, p) in candidates.iter().zip(probs.iter()) {
        cumulative += p;
        if u < cumulative {
            return c.id;
        }
    }
    // Rounding left the sum a hair under 1 and u landed above it: the last one with any
    // probability takes it.
    let last = probs.iter().rposition(|&p| p > 0.0).unwrap_or(0);
    candidates[last].id
}

#[cfg(test)]
#[path = "sampling_tests.rs"]
mod tests;
