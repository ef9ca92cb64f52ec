//! Log-probabilities of a row of logits: the log-softmax of one token and the `n` most
//! likely tokens, in two passes over the row and without sorting it.
//!
//! The distribution is the softmax of the logits as given. The scheduler gives the
//! logits a sequence's sampler chooses from before the sampler's own steps: the model's
//! logits with the request's `logit_bias`, presence and frequency penalties added and the
//! grammar's mask applied (a masked token has logit `-inf`, so probability 0), but before
//! the repeat penalty, the temperature and the truncations (`top_k`, `top_p`, `min_p`).
//! For a greedy request the chosen token is then the most likely one.

use crate::tokenizer::TokenId;

/// Most alternatives a request may ask for per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One token and its log-probability (natural logarithm).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: TokenId,
    pub logprob: f32,
}

/// The log-softmax of one row of logits, in the pieces a response needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogSoftmax {
    /// `ln(sum(exp(logits)))`, `-inf` when every logit is `-inf` (or NaN).
    log_sum: f64,
}

impl LogSoftmax {
    /// The log-probability of a token whose logit is `logit` (`-inf` for a masked token,
    /// and for any token of a row with no finite logit).
    pub fn of(&self, logit: f32) -> f32 {
        if logit == f32::NEG_INFINITY || !self.log_sum.is_finite() || logit.is_nan() {
            return f32::NEG_INFINITY;
        }
        // At most 0: no logit is above the log of the sum.
        (f64::from(logit) - self.log_sum).min(0.0) as f32
    }
}

/// The `n` highest logits of `logits` with the normaliser of their softmax: two passes
/// (the selection, which also finds the maximum, then the sum of the exponentials
/// shifted by it), the selection a buffer of `n` kept in order. NaN logits count as
/// `-inf`; `-inf` logits (masked, or biased away) are never among the top ones, so fewer
/// than `n` come back when fewer tokens are possible.
///
/// The top ones come in descending order, ties by lower token id.
pub fn top_logprobs(logits: &[f32], n: usize) -> (LogSoftmax, Vec<TokenLogprob>) {
    // The maximum is the first of the top ones: select at least one.
    let top = top_n(logits, n.max(1));
    let Some(&(_, max)) = top.first() else {
        let none = LogSoftmax {
            log_sum: f64::NEG_INFINITY,
        };
        return (none, Vec::new());
    };
    // exp(x - max) <= 1, and the maximum itself adds 1: the sum is in [1, len].
    let sum: f64 = logits
        .iter()
        .filter(|x| !x.is_nan())
        .map(|&x| f64::from((x - max).exp()))
        .sum();
    let softmax = LogSoftmax {
        log_sum: f64::from(max) + sum.ln(),
    };
    let top = top
        .into_iter()
        .take(n)
        .map(|(token, logit)| TokenLogprob {
            token,
            logprob: softmax.of(logit),
        })
        .collect();
    (softmax, top)
}

/// The (at most) `n` highest finite-or-`+inf` logits above `-inf`, highest first, ties
/// by lower index. A buffer of `n` in order: a logit that does not beat the smallest kept
/// costs one comparison, so a row costs one pass whatever `n` (at most
/// [`MAX_TOP_LOGPROBS`] in practice).
fn top_n(logits: &[f32], n: usize) -> Vec<(TokenId, f32)> {
    let mut top: Vec<(TokenId, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    for (id, &x) in logits.iter().enumerate() {
        // NaN and -inf fail this too.
        if x <= f32::NEG_INFINITY || x.is_nan() {
            continue;
        }
        // Strictly greater than the smallest kept: an equal logit of a higher id loses.
        if top.len() == n && x <= top[n - 1].1 {
            continue;
        }
        // After every kept logit at least as high: ties stay in id order.
        let at = top.partition_point(|&(_, y)| y >= x);
        top.insert(at, (id as TokenId, x));
        top.truncate(n);
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prob_sum(logits: &[f32]) -> f64 {
        let (softmax, _) = top_logprobs(logits, 0);
        logits.iter().map(|&x| f64::from(softmax.of(x)).exp()).sum()
    }

    #[test]
    fn probabilities_sum_to_one() {
        let logits: Vec<f32> = (0..151_936)
            .map(|i| ((i * 7919) % 1000) as f32 / 37.0)
            .collect();
        assert!(
            (prob_sum(&logits) - 1.0).abs() < 1e-4,
            "{}",
            prob_sum(&logits)
        );
        // Large logits do not overflow the exponentials.
        let big = [1000.0f32, 999.0, 998.0];
        assert!((prob_sum(&big) - 1.0).abs() < 1e-6);
        let (softmax, top) = top_logprobs(&big, 3);
        let expected = -(1.0f64 + (-1.0f64).exp() + (-2.0f64).exp()).ln();
        assert!((f64::from(top[0].logprob) - expected).abs() < 1e-6);
        assert_eq!(softmax.of(1000.0), top[0].logprob);
    }

    #[test]
    fn top_ones_descend_with_ties_by_lower_id() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0, 2.0];
        let (_, top) = top_logprobs(&logits, 4);
        let ids: Vec<TokenId> = top.iter().map(|t| t.token).collect();
        assert_eq!(ids, [1, 3, 2, 5]);
        assert!(top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        assert_eq!(top[0].logprob, top[1].logprob);
        // A full buffer keeps the lower id of a tie at its end.
        let (_, top) = top_logprobs(&[0.0, 5.0, 0.0, 0.0], 2);
        assert_eq!(top.iter().map(|t| t.token).collect::<Vec<_>>(), [1, 0]);
    }

    #[test]
    fn masked_logits_have_no_probability() {
        let inf = f32::NEG_INFINITY;
        let logits = [inf, 0.0, inf, 0.0, f32::NAN];
        let (softmax, top) = top_logprobs(&logits, 5);
        // Only the two possible tokens, each of half the mass.
        assert_eq!(top.len(), 2);
        assert_eq!((top[0].token, top[1].token), (1, 3));
        assert!((top[0].logprob - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(softmax.of(inf), inf);
        assert!((prob_sum(&logits) - 1.0).abs() < 1e-6);
        // Nothing possible: no top ones, every token -inf, never NaN.
        let (softmax, top) = top_logprobs(&[inf, inf], 3);
        assert!(top.is_empty());
        assert_eq!(softmax.of(0.0), inf);
        assert_eq!(top_logprobs(&[], 2).1, []);
    }

    #[test]
    fn no_top_ones_still_gives_the_normaliser() {
        let logits = [0.0f32, 0.0, 0.0, 0.0];
        let (softmax, top) = top_logprobs(&logits, 0);
        assert!(top.is_empty());
        assert!((softmax.of(0.0) - 0.25f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn the_selection_is_the_head_of_a_sort() {
        let logits: Vec<f32> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) % 97) as f32 * 0.25)
            .collect();
        let mut sorted: Vec<(TokenId, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &x)| (i as TokenId, x))
            .collect();
        sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for n in [1, 5, 20] {
            let (_, top) = top_logprobs(&logits, n);
            let ids: Vec<TokenId> = top.iter().map(|t| t.token).collect();
            let want: Vec<TokenId> = sorted[..n].iter().map(|&(i, _)| i).collect();
            assert_eq!(ids, want, "n = {n}");
        }
    }
}
