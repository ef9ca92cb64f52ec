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
//!
//! A server samples for every sequence of a batch at every step, so the cost per token
//! matters: the logits are checked and their maximum found in passes that the compiler
//! vectorizes; nothing copies the row unless a repetition penalty must change it (and
//! [`Sampler::sample_in_place`] changes the caller's row instead); top-k keeps its
//! candidates in one pass that skips any run of logits below the `k`-th best so far; a
//! whole vocabulary (no top-k) is ordered by a radix sort. Each of these gives the
//! order, the sums and therefore the tokens that a plain sort of every candidate gives.

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
        Xoshiro256 {
            s: Xoshiro256::state_from_u64(seed),
        }
    }

    /// The state SplitMix64 expands `seed` into, as every xoshiro256 generator seeds.
    pub fn state_from_u64(seed: u64) -> [u64; 4] {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        [next(), next(), next(), next()]
    }

    /// Advances a xoshiro256 state one step: the same for xoshiro256** and
    /// xoshiro256++, which differ only in the output they take from the state first.
    pub fn advance(s: &mut [u64; 4]) {
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        Xoshiro256::advance(&mut self.s);
        result
    }

    /// Uniform in [0, 1), from the top 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

impl SamplingMode {
    /// The generator of the draws, seeded with the mode's seed (0 for greedy, which
    /// draws nothing).
    fn rng(&self) -> Xoshiro256 {
        let seed = match *self {
            SamplingMode::Random { seed, .. } => seed,
            SamplingMode::Greedy => 0,
        };
        Xoshiro256::seed_from_u64(seed)
    }
}

/// Adds `token` to the `recent` tokens the repetition penalty of `config` looks at,
/// dropping the oldest past its window (nothing without a penalty).
fn remember(recent: &mut VecDeque<u32>, config: &SamplingConfig, token: u32) {
    let Some(penalty) = config.penalty else {
        return;
    };
    if recent.len() == penalty.last_n {
        recent.pop_front();
    }
    recent.push_back(token);
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
    /// A copy of the logits for the repetition penalty to change ([`Sampler::sample`]).
    scratch: Vec<f32>,
    candidates: Vec<Candidate>,
    /// The radix sort's second buffer.
    spare: Vec<Candidate>,
    probs: Vec<f64>,
}

impl Sampler {
    pub fn new(config: SamplingConfig) -> Sampler {
        Sampler {
            rng: config.mode.rng(),
            config,
            recent: VecDeque::new(),
            scratch: Vec::new(),
            candidates: Vec::new(),
            spare: Vec::new(),
            probs: Vec::new(),
        }
    }

    pub fn config(&self) -> &SamplingConfig {
        &self.config
    }

    /// Records a token (of the prompt or generated) for the repetition penalty.
    pub fn accept(&mut self, token: u32) {
        remember(&mut self.recent, &self.config, token);
    }

    /// True when [`sample`](Sampler::sample) is the first highest logit as it is: greedy,
    /// without a repeat penalty (so a device's argmax of the logits is the same token).
    pub fn is_plain_greedy(&self) -> bool {
        self.config.mode == SamplingMode::Greedy && self.config.penalty.is_none()
    }

    /// Chooses the next token from `logits` (one per vocabulary entry). Does not
    /// [`accept`](Sampler::accept) it.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        if self.config.penalty.is_none() {
            // Nothing changes the logits: read them where they are.
            let best = scan(logits)?;
            return self.choose(logits, best);
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        scratch.extend_from_slice(logits);
        let token = self.sample_in_place(&mut scratch);
        self.scratch = scratch;
        token
    }

    /// As [`sample`](Sampler::sample), the same token, for a caller that is done with
    /// `logits`: the repetition penalty changes them in place instead of a copy (a whole
    /// vocabulary per token, for every sequence of a batch).
    pub fn sample_in_place(&mut self, logits: &mut [f32]) -> Result<u32, SamplingError> {
        // The checks see the logits as they come, before the penalty.
        let best = scan(logits)?;
        match self.config.penalty {
            None => self.choose(logits, best),
            Some(penalty) => {
                apply_repeat_penalty(logits, &self.recent, penalty.penalty);
                let best = first_max(logits).index;
                self.choose(logits, best)
            }
        }
    }

    /// The token from checked, penalized `logits` whose first highest is `best`.
    fn choose(&mut self, logits: &[f32], best: usize) -> Result<u32, SamplingError> {
        let SamplingMode::Random {
            temperature,
            top_k,
            top_p,
            min_p,
            ..
        } = self.config.mode
        else {
            return Ok(best as u32);
        };
        match top_k {
            Some(k) if k < logits.len() => top_k_of(logits, k, &mut self.candidates),
            _ => {
                self.candidates.clear();
                let all = logits.iter().enumerate().map(|(id, &logit)| Candidate {
                    id: id as u32,
                    logit,
                });
                match (top_p, min_p) {
                    // Min-p alone keeps the logits above a line drawn from the highest:
                    // only those need ordering.
                    (None, Some(p)) => {
                        let threshold = min_p_threshold(logits[best], p);
                        self.candidates
                            .extend(all.filter(|c| f64::from(c.logit) >= threshold));
                    }
                    _ => self.candidates.extend(all),
                }
                sort_descending(&mut self.candidates, &mut self.spare);
            }
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

/// Checks `logits` as [`check_logits`] does and returns the index of the first highest,
/// in one pass over the row.
fn scan(logits: &[f32]) -> Result<usize, SamplingError> {
    if logits.is_empty() {
        return Err(SamplingError::EmptyLogits);
    }
    let found = first_max(logits);
    if found.unusable {
        // Rare: the plain check names the first bad logit.
        check_logits(logits)?;
    }
    if found.value == f32::NEG_INFINITY {
        return Err(SamplingError::AllMasked);
    }
    Ok(found.index)
}

/// What [`first_max`] finds.
struct FirstMax {
    /// The first index of the highest value (0 when there is none: a NaN).
    index: usize,
    value: f32,
    /// Whether a NaN or +inf was seen.
    unusable: bool,
}

/// Values compared at once by [`first_max`] and [`top_k_of`]: lanes of the vector
/// registers.
const LANES: usize = 16;

/// The first index of the highest value, as a scan that keeps the first of equals finds
/// it, and whether any value is NaN or +inf. Two passes without a dependence from one
/// value to the next, so that both compile to vector instructions: each of [`LANES`]
/// lanes keeps its highest, then the first value equal to the highest of the lanes is
/// looked for, a run of [`LANES`] at a time.
fn first_max(values: &[f32]) -> FirstMax {
    let mut high = [f32::NEG_INFINITY; LANES];
    let mut unusable = [false; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for j in 0..LANES {
            let v = chunk[j];
            unusable[j] |= v.is_nan() | (v == f32::INFINITY);
            high[j] = if v > high[j] { v } else { high[j] };
        }
    }
    let mut value = f32::NEG_INFINITY;
    for &v in high.iter().chain(tail) {
        value = if v > value { v } else { value };
    }
    let bad = unusable.iter().any(|&u| u) || tail.iter().any(|v| v.is_nan() || *v == f32::INFINITY);
    // A NaN equals nothing: with one there is no index to find, and the caller fails.
    let index = values
        .chunks(LANES)
        .position(|c| c.iter().fold(false, |any, &v| any | (v == value)))
        .and_then(|c| {
            let at = c * LANES;
            values[at..]
                .iter()
                .position(|&v| v == value)
                .map(|j| at + j)
        })
        .unwrap_or(0);
    FirstMax {
        index,
        value,
        unusable: bad,
    }
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

/// `logit`'s place in [`f32::total_cmp`]'s order as an unsigned number: higher logits
/// give higher numbers, -0 below +0.
fn order_key(logit: f32) -> u32 {
    let bits = logit.to_bits();
    // Negative: every bit flipped (a larger magnitude is lower); positive: the sign set.
    let sign = ((bits as i32) >> 31) as u32;
    bits ^ (sign | 1 << 31)
}

/// Below this many candidates a comparison sort beats the radix sort's passes.
const RADIX_MIN: usize = 512;

/// Sorts in [`by_logit_descending`]'s order. Many candidates in ascending id order (a
/// whole row) take a stable radix sort on the logits' order keys, which keeps equal
/// logits in id order: the same order.
fn sort_descending(candidates: &mut Vec<Candidate>, spare: &mut Vec<Candidate>) {
    let ascending_ids = candidates.windows(2).all(|w| w[0].id < w[1].id);
    if candidates.len() < RADIX_MIN || !ascending_ids {
        candidates.sort_unstable_by(by_logit_descending);
        return;
    }
    // Three passes of 11 bits over the inverted keys (ascending there is descending in
    // the logits), least significant first.
    const BITS: u32 = 11;
    const DIGITS: usize = 1 << BITS;
    let key = |c: &Candidate| !order_key(c.logit);
    let mut counts = [[0u32; DIGITS]; 3];
    for c in candidates.iter() {
        let k = key(c);
        for (pass, count) in counts.iter_mut().enumerate() {
            count[(k >> (BITS * pass as u32)) as usize % DIGITS] += 1;
        }
    }
    let n = candidates.len();
    spare.clear();
    spare.resize(n, Candidate { id: 0, logit: 0.0 });
    for (pass, count) in counts.iter().enumerate() {
        // A digit every key shares moves nothing.
        if count.iter().any(|&c| c as usize == n) {
            continue;
        }
        let mut next = [0u32; DIGITS];
        let mut at = 0;
        for (slot, &c) in next.iter_mut().zip(count.iter()) {
            *slot = at;
            at += c;
        }
        let shift = BITS * pass as u32;
        for c in candidates.iter() {
            let digit = (key(c) >> shift) as usize % DIGITS;
            spare[next[digit] as usize] = *c;
            next[digit] += 1;
        }
        std::mem::swap(candidates, spare);
    }
}

/// The `k` highest of `logits` (`0 < k < logits.len()`, no NaN) into `out`, sorted as
/// [`by_logit_descending`] sorts them. One pass keeps candidates in a buffer of `2k`;
/// when it fills, the best `k` stay and the `k`-th becomes a floor. A later logit at or
/// below the floor can never be among the best `k` (at the floor, its id is higher than
/// the `k`-th's), so it is skipped, a run of [`LANES`] at a time when all of them are
/// below it.
fn top_k_of(logits: &[f32], k: usize, out: &mut Vec<Candidate>) {
    out.clear();
    let room = 2 * k.max(LANES);
    // The `k`-th best so far, as a logit and as its order key.
    let mut floor: Option<(f32, u32)> = None;
    let mut base = 0u32;
    for chunk in logits.chunks(LANES) {
        // Below in the float order is below in the total order (-0 is not below +0,
        // and the exact test below sorts that out).
        let skip =
            floor.is_some_and(|(low, _)| !chunk.iter().fold(false, |any, &l| any | (l >= low)));
        if !skip {
            for (j, &logit) in chunk.iter().enumerate() {
                if floor.is_some_and(|(_, key)| order_key(logit) <= key) {
                    continue;
                }
                out.push(Candidate {
                    id: base + j as u32,
                    logit,
                });
                if out.len() >= room {
                    out.select_nth_unstable_by(k - 1, by_logit_descending);
                    out.truncate(k);
                    let low = out[k - 1].logit;
                    floor = Some((low, order_key(low)));
                }
            }
        }
        base = base.wrapping_add(LANES as u32);
    }
    if k < out.len() {
        out.select_nth_unstable_by(k - 1, by_logit_descending);
        out.truncate(k);
    }
    out.sort_unstable_by(by_logit_descending);
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
    let threshold = min_p_threshold(candidates[0].logit, p);
    let keep = candidates
        .iter()
        .take_while(|c| f64::from(c.logit) >= threshold)
        .count();
    candidates.truncate(keep.max(1));
}

/// The lowest logit min-p keeps beside `top`, the highest.
fn min_p_threshold(top: f32, p: f32) -> f64 {
    f64::from(top) + f64::from(p).ln()
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
