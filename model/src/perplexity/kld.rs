//! The KL divergence of one position's distribution from the base model's, the sums
//! over the scored tokens, and the statistics printed from them; each in llama.cpp's
//! precision (`f32` per token, `f64` sums).

use super::base::decode_row;

/// The running sums of a KL-divergence run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KldStats {
    pub sum_nll: f64,
    pub sum_nll2: f64,
    pub sum_nll_base: f64,
    pub sum_nll_base2: f64,
    pub sum_nll_nll_base: f64,
    pub sum_kld: f64,
    pub sum_kld2: f64,
    pub sum_p_diff: f64,
    pub sum_p_diff2: f64,
    pub sum_p_diff4: f64,
    pub max_p_diff: f32,
    /// Tokens whose most likely token is the base model's.
    pub n_same_top: usize,
    pub count: usize,
}

impl KldStats {
    /// A window's sums added to the totals.
    pub fn merge(&mut self, other: &KldStats) {
        self.sum_nll += other.sum_nll;
        self.sum_nll2 += other.sum_nll2;
        self.sum_nll_base += other.sum_nll_base;
        self.sum_nll_base2 += other.sum_nll_base2;
        self.sum_nll_nll_base += other.sum_nll_nll_base;
        self.sum_kld += other.sum_kld;
        self.sum_kld2 += other.sum_kld2;
        self.sum_p_diff += other.sum_p_diff;
        self.sum_p_diff2 += other.sum_p_diff2;
        self.sum_p_diff4 += other.sum_p_diff4;
        self.n_same_top += other.n_same_top;
        if self.max_p_diff < other.max_p_diff {
            self.max_p_diff = other.max_p_diff;
        }
        self.count += other.count;
    }

    /// The figures llama.cpp prints from the sums.
    pub fn summary(&self) -> KldSummary {
        let log_ppl = mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count);
        let log_ppl_base = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count);
        let cov = covariance(
            self.sum_nll,
            self.sum_nll_base,
            self.sum_nll_nll_base,
            self.count,
        );
        let ppl = exp_of(log_ppl);
        let ppl_base = exp_of(log_ppl_base);
        let log_ratio = Uncertain {
            value: log_ppl.value - log_ppl_base.value,
            error: (log_ppl.error * log_ppl.error + log_ppl_base.error * log_ppl_base.error
                - 2.0 * cov)
                .sqrt(),
        };
        let ppl_cov = ppl.value * ppl_base.value * cov;
        let p_diff_mse = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count);
        let rms = p_diff_mse.value.sqrt();
        let same_top = self.n_same_top as f64 / self.count as f64;
        KldSummary {
            ppl,
            ppl_base,
            log_ppl_correlation: cov / (log_ppl.error * log_ppl_base.error),
            log_ppl_ratio: log_ratio,
            ppl_ratio: exp_of(log_ratio),
            ppl_diff: Uncertain {
                value: ppl.value - ppl_base.value,
                error: (ppl.error * ppl.error + ppl_base.error * ppl_base.error - 2.0 * ppl_cov)
                    .sqrt(),
            },
            kld: mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count),
            p_diff: mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, self.count),
            p_diff_rms: Uncertain {
                value: rms,
                error: 0.5 / rms * p_diff_mse.error,
            },
            same_top: Uncertain {
                value: same_top,
                error: (same_top * (1.0 - same_top) / (self.count as f64 - 1.0)).sqrt(),
            },
        }
    }
}

/// A value and its standard error.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Uncertain {
    pub value: f64,
    pub error: f64,
}

/// `exp(x) ± exp(x) · dx`.
fn exp_of(x: Uncertain) -> Uncertain {
    let value = x.value.exp();
    Uncertain {
        value,
        error: value * x.error,
    }
}

/// The figures of a KL-divergence run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KldSummary {
    pub ppl: Uncertain,
    pub ppl_base: Uncertain,
    pub log_ppl_correlation: f64,
    pub log_ppl_ratio: Uncertain,
    pub ppl_ratio: Uncertain,
    pub ppl_diff: Uncertain,
    pub kld: Uncertain,
    pub p_diff: Uncertain,
    pub p_diff_rms: Uncertain,
    /// The share of tokens whose most likely token is the base model's.
    pub same_top: Uncertain,
}

/// The mean of `count` values from their sum and sum of squares, and its standard error
/// (0 for 10 values or fewer, or no spread).
pub fn mean_and_uncertainty(sum: f64, sum2: f64, count: usize) -> Uncertain {
    if count < 1 {
        return Uncertain {
            value: 0.0,
            error: 0.0,
        };
    }
    let n = count as f64;
    let mean = sum / n;
    let var = sum2 / n - mean * mean;
    let error = if var > 0.0 && count > 10 {
        (var / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    Uncertain { value: mean, error }
}

/// The covariance of the two means (0 under 10 values).
fn covariance(sum_a: f64, sum_b: f64, sum_ab: f64, count: usize) -> f64 {
    if count < 10 {
        return 0.0;
    }
    let n = count as f64;
    (sum_ab / n - (sum_a / n) * (sum_b / n)) / (n - 1.0)
}

/// The value at `fraction` of the sorted `values`, interpolated between neighbours in
/// `f32`. `values` must not be empty.
pub fn percentile(values: &[f32], fraction: f32) -> f32 {
    if fraction <= 0.0 {
        return values[0];
    }
    if fraction >= 1.0 {
        return values[values.len() - 1];
    }
    let mut p = fraction * (values.len() - 1) as f32;
    let at = p as usize;
    p -= at as f32;
    (1.0 - p) * values[at] + p * values[(at + 1).min(values.len() - 1)]
}

/// The median of the sorted `values` (the mean of the middle two for an even count).
pub fn median(values: &[f32]) -> f32 {
    let n = values.len();
    if n.is_multiple_of(2) {
        0.5 * (values[n / 2] + values[n / 2 - 1])
    } else {
        values[n / 2]
    }
}

/// One scored position: `logits` against the base row `base` (see
/// [`super::base`]), the next token `token`. Adds to `stats` and returns the position's
/// KL divergence and the difference of the token's probabilities (model − base).
pub fn kld_row(logits: &[f32], base: &[u16], token: usize, stats: &mut KldStats) -> (f64, f32) {
    let mut max = logits[0];
    let mut imax = 0;
    for (i, &v) in logits.iter().enumerate().skip(1) {
        if v > max {
            max = v;
            imax = i;
        }
    }
    let log_sum_exp = super::sum_exp(logits, max).ln() as f32;
    let (scale, min_log_prob, q) = decode_row(base);

    let nll = max + log_sum_exp - logits[token];
    stats.sum_nll += f64::from(nll);
    stats.sum_nll2 += f64::from(nll * nll);
    let nll_base = -(scale * f32::from(q[token]) + min_log_prob);
    stats.sum_nll_base += f64::from(nll_base);
    stats.sum_nll_base2 += f64::from(nll_base * nll_base);
    stats.sum_nll_nll_base += f64::from(nll * nll_base);

    let log_norm = max + log_sum_exp;
    let mut kld = 0.0f64;
    let mut imax_base = 0;
    let mut base_max = 0.0f32;
    for (i, (&v, &qi)) in logits.iter().zip(q).enumerate() {
        let p_log_base = scale * f32::from(qi) + min_log_prob;
        if i == 0 || p_log_base > base_max {
            base_max = p_log_base;
            imax_base = i;
        }
        if p_log_base > -16.0 {
            let p_base = p_log_base.exp();
            kld += f64::from(p_base * (p_log_base - v + log_norm));
        }
    }
    stats.sum_kld += kld;
    stats.sum_kld2 += kld * kld;
    stats.count += 1;
    if imax == imax_base {
        stats.n_same_top += 1;
    }

    let p_diff = (-nll).exp() - (-nll_base).exp();
    stats.sum_p_diff += f64::from(p_diff);
    let p_diff2 = f64::from(p_diff * p_diff);
    stats.sum_p_diff2 += p_diff2;
    stats.sum_p_diff4 += p_diff2 * p_diff2;
    if stats.max_p_diff < p_diff.abs() {
        stats.max_p_diff = p_diff.abs();
    }
    (kld, p_diff)
}
