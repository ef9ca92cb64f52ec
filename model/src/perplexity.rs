//! The perplexity of a model over a text, and the KL divergence of its token
//! distributions from a base model's, as llama.cpp's `llama-perplexity` computes them.
//!
//! The text's tokens (BOS first where the vocabulary adds it) are cut into
//! non-overlapping windows of `n_ctx` tokens; each window runs on an empty cache, its
//! first token replaced by BOS where the vocabulary adds it, and only its second half is
//! scored: the logits at positions `n_ctx / 2 .. n_ctx - 1` against the tokens that
//! follow them, `n_ctx - 1 - n_ctx / 2` tokens a window. The arithmetic is llama.cpp's
//! operation for operation (`f32` logits, the exponentials summed in `f64`, each
//! window's sums added to the running totals), so the printed figures are its figures.
//!
//! [`perplexity`] can also write what [`kl_divergence`] later reads: the base model's
//! log-probabilities, in llama.cpp's file format ([`base`]), so either program can read
//! the other's file.

pub mod base;
mod kld;
#[cfg(test)]
mod tests;

use std::io::Write;

pub use kld::{kld_row, mean_and_uncertainty, median, percentile, KldStats, KldSummary, Uncertain};

use crate::gpu::GpuModel;
use crate::kv_cache::KvCache;
use crate::model::Model;
use crate::ops::AttentionMethod;
use crate::ModelError;
use base::{BaseFileError, BaseReader};

/// What can go wrong computing a perplexity or a KL divergence.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PerplexityError {
    /// The text is shorter than two windows (llama.cpp's minimum).
    #[error(
        "the text has {tokens} tokens, but a context of {n_ctx} needs at least {needed} \
         (two windows)"
    )]
    TooFewTokens {
        tokens: usize,
        n_ctx: usize,
        needed: usize,
    },
    /// A window this small scores no token.
    #[error("a context of {n_ctx} scores no token: it must be at least 3")]
    ContextTooSmall { n_ctx: usize },
    #[error("{what} must be at least 1")]
    Zero { what: &'static str },
    /// A base file made for another model or another context.
    #[error("the base file's {field} is {file}, but {here_what} is {here}")]
    BaseMismatch {
        field: &'static str,
        file: usize,
        here_what: &'static str,
        here: usize,
    },
    /// The logits source returned a buffer of the wrong size.
    #[error("{got} logits for {tokens} tokens of a vocabulary of {n_vocab}")]
    LogitsShape {
        got: usize,
        tokens: usize,
        n_vocab: usize,
    },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Base(#[from] BaseFileError),
    #[error("writing the base file: {0}")]
    Write(#[source] std::io::Error),
}

/// A model that gives every position's logits, one window at a time.
pub trait WindowLogits {
    /// Logits a position.
    fn n_vocab(&self) -> usize;
    /// Forgets the previous window: the next call starts at position 0.
    fn start_window(&mut self) -> Result<(), ModelError>;
    /// Appends `tokens` to the window and returns `n_vocab` logits for each of them.
    fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError>;
}

/// The CPU model over a cache of one window.
pub struct CpuWindows<'m> {
    model: &'m Model,
    cache: KvCache,
}

impl<'m> CpuWindows<'m> {
    /// A cache of `n_ctx` positions, attention computed as `attention` says.
    pub fn new(model: &'m Model, n_ctx: usize, attention: AttentionMethod) -> CpuWindows<'m> {
        let cache = model
            .new_cache(n_ctx)
            .with_attention(attention)
            .with_context(n_ctx);
        CpuWindows { model, cache }
    }

    /// The same, with keys and values stored at `types`, or an error when the model or
    /// the attention method cannot take them.
    pub fn with_types(self, types: crate::KvTypes) -> Result<CpuWindows<'m>, ModelError> {
        let cache = self.cache.with_types(self.model.config(), types)?;
        Ok(CpuWindows { cache, ..self })
    }
}

impl WindowLogits for CpuWindows<'_> {
    fn n_vocab(&self) -> usize {
        self.model.config().n_vocab
    }

    fn start_window(&mut self) -> Result<(), ModelError> {
        self.cache.clear();
        Ok(())
    }

    fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.model.forward_all_logits(tokens, &mut self.cache)
    }
}

/// A GPU back end's windows: its cache cleared, and every token's logits.
macro_rules! gpu_windows {
    ($($ty:ty),*) => {$(
        impl WindowLogits for $ty {
            fn n_vocab(&self) -> usize {
                self.n_vocab()
            }

            fn start_window(&mut self) -> Result<(), ModelError> {
                self.clear()
            }

            fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
                self.forward_all_logits(tokens)
            }
        }
    )*};
}

gpu_windows!(GpuModel, crate::gpu::LayerSplit, crate::gpu::TensorSplit);

impl WindowLogits for crate::gpu::GpuEngine {
    fn n_vocab(&self) -> usize {
        match self {
            crate::gpu::GpuEngine::One(gpu) => gpu.n_vocab(),
            crate::gpu::GpuEngine::Split(gpu) => gpu.n_vocab(),
            crate::gpu::GpuEngine::Tensor(gpu) => gpu.n_vocab(),
        }
    }

    fn start_window(&mut self) -> Result<(), ModelError> {
        self.clear()
    }

    fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        match self {
            crate::gpu::GpuEngine::One(gpu) => gpu.forward_all_logits(tokens),
            crate::gpu::GpuEngine::Split(gpu) => gpu.forward_all_logits(tokens),
            crate::gpu::GpuEngine::Tensor(gpu) => gpu.forward_all_logits(tokens),
        }
    }
}

/// How a text is cut: `n_chunk` windows of `n_ctx` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Windows {
    pub n_ctx: usize,
    pub n_chunk: usize,
}

impl Windows {
    /// The windows of a text of `n_tokens` tokens: as many whole ones as it holds, at
    /// most `chunks`. Like llama.cpp, a text shorter than two windows is refused.
    pub fn plan(
        n_tokens: usize,
        n_ctx: usize,
        chunks: Option<usize>,
    ) -> Result<Windows, PerplexityError> {
        if n_ctx < 3 {
            return Err(PerplexityError::ContextTooSmall { n_ctx });
        }
        if chunks == Some(0) {
            return Err(PerplexityError::Zero {
                what: "the number of chunks",
            });
        }
        let needed = 2 * n_ctx;
        if n_tokens < needed {
            return Err(PerplexityError::TooFewTokens {
                tokens: n_tokens,
                n_ctx,
                needed,
            });
        }
        let most = n_tokens / n_ctx;
        Ok(Windows {
            n_ctx,
            n_chunk: chunks.map_or(most, |c| c.min(most)),
        })
    }

    /// The first scored position of a window.
    pub fn first(&self) -> usize {
        self.n_ctx / 2
    }

    /// Tokens scored a window.
    pub fn scored(&self) -> usize {
        self.n_ctx - 1 - self.first()
    }
}

/// The largest logit, as `std::max` folds it.
fn max_logit(logits: &[f32]) -> f32 {
    logits[1..]
        .iter()
        .fold(logits[0], |m, &v| if m < v { v } else { m })
}

/// `Σ exp(logit - max)`, each exponential in `f32`, the sum in `f64`.
fn sum_exp(logits: &[f32], max: f32) -> f64 {
    logits
        .iter()
        .fold(0.0f64, |sum, &v| sum + f64::from((v - max).exp()))
}

/// `-log p(token)` under `logits`, as a plain perplexity run computes it: the token's
/// shifted logit in `f32`, the logarithm of the sum in `f64`.
pub fn nll(logits: &[f32], token: usize) -> f64 {
    let max = max_logit(logits);
    let sum = sum_exp(logits, max);
    -(f64::from(logits[token] - max) - sum.ln())
}

/// The running sums of the negative log-likelihoods.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NllSums {
    pub nll: f64,
    pub nll2: f64,
    pub count: usize,
}

/// The final perplexity and its uncertainty.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    pub ppl: f64,
    pub error: f64,
}

impl NllSums {
    /// One scored token.
    pub fn add(&mut self, nll: f64) {
        self.nll += nll;
        self.nll2 += nll * nll;
        self.count += 1;
    }

    /// A window's sums added to the totals.
    pub fn merge(&mut self, window: &NllSums) {
        self.nll += window.nll;
        self.nll2 += window.nll2;
        self.count += window.count;
    }

    /// `exp(mean nll)`.
    pub fn ppl(&self) -> f64 {
        (self.nll / self.count as f64).exp()
    }

    /// The perplexity and its standard error, `ppl · sqrt(var(nll) / (count - 1))`;
    /// `None` when the variance is not positive (too few tokens, or all alike).
    pub fn estimate(&self) -> Option<Estimate> {
        let n = self.count as f64;
        let mean = self.nll / n;
        let ppl = mean.exp();
        let var = self.nll2 / n - mean * mean;
        (var > 0.0).then(|| Estimate {
            ppl,
            error: (var / (n - 1.0)).sqrt() * ppl,
        })
    }
}

/// The settings of a run.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Tokens a window.
    pub n_ctx: usize,
    /// Most tokens a forward call takes (a call never spans two windows). On the CPU a
    /// call of fewer than 64 tokens computes attention with another kernel, as
    /// llama.cpp's does for the same batch, which moves the figures slightly.
    pub batch: usize,
    /// Most windows; all the text holds when `None`.
    pub chunks: Option<usize>,
    /// The token that replaces each window's first, when the vocabulary adds BOS.
    pub bos: Option<u32>,
}

/// The outcome of [`perplexity`].
#[derive(Clone, Copy, Debug)]
pub struct Outcome {
    pub windows: Windows,
    pub sums: NllSums,
}

/// Runs window `w` of `tokens` through `source` in calls of at most `batch` tokens and
/// hands each scored position's logits to `row` (with the position in the window).
fn run_window<S: WindowLogits + ?Sized>(
    source: &mut S,
    window: &[u32],
    bos: Option<u32>,
    batch: usize,
    first: usize,
    mut row: impl FnMut(usize, &[f32]) -> Result<(), PerplexityError>,
) -> Result<(), PerplexityError> {
    let n_ctx = window.len();
    let n_vocab = source.n_vocab();
    let mut input = window.to_vec();
    if let Some(bos) = bos {
        input[0] = bos;
    }
    source.start_window()?;
    let mut start = 0;
    while start < n_ctx {
        let end = (start + batch).min(n_ctx);
        let logits = source.forward(&input[start..end])?;
        if logits.len() != (end - start) * n_vocab {
            return Err(PerplexityError::LogitsShape {
                got: logits.len(),
                tokens: end - start,
                n_vocab,
            });
        }
        for pos in start.max(first)..end.min(n_ctx - 1) {
            let at = (pos - start) * n_vocab;
            row(pos, &logits[at..at + n_vocab])?;
        }
        start = end;
    }
    Ok(())
}

/// The perplexity of `source` over `tokens` (the text's tokens, BOS first where the
/// vocabulary adds it). `on_chunk` gets each window's number (from 1) and the running
/// perplexity. With `base_out`, the scored positions' log-probabilities are written to
/// it in llama.cpp's format, for [`kl_divergence`]; the negative log-likelihoods are
/// then computed as llama.cpp does when it writes them, in `f32`.
pub fn perplexity<S: WindowLogits + ?Sized>(
    source: &mut S,
    tokens: &[u32],
    options: &Options,
    mut base_out: Option<&mut dyn Write>,
    on_chunk: &mut dyn FnMut(usize, f64),
) -> Result<Outcome, PerplexityError> {
    if options.batch == 0 {
        return Err(PerplexityError::Zero {
            what: "the batch size",
        });
    }
    let windows = Windows::plan(tokens.len(), options.n_ctx, options.chunks)?;
    let (n_ctx, first) = (windows.n_ctx, windows.first());
    let n_vocab = source.n_vocab();
    let row_len = base::row_len(n_vocab);
    let mut rows = Vec::new();
    if let Some(out) = base_out.as_deref_mut() {
        base::write_header(out, n_ctx, n_vocab, &tokens[..windows.n_chunk * n_ctx])
            .map_err(PerplexityError::Write)?;
        rows = vec![0u16; windows.scored() * row_len];
    }
    let mut sums = NllSums::default();
    for chunk in 0..windows.n_chunk {
        let window = &tokens[chunk * n_ctx..(chunk + 1) * n_ctx];
        let mut local = NllSums::default();
        let writing = base_out.is_some();
        run_window(
            source,
            window,
            options.bos,
            options.batch,
            first,
            |pos, logits| {
                let token = window[pos + 1] as usize;
                let nll = if writing {
                    let row = &mut rows[(pos - first) * row_len..][..row_len];
                    f64::from(base::encode_row(logits, token, row))
                } else {
                    nll(logits, token)
                };
                local.add(nll);
                Ok(())
            },
        )?;
        if let Some(out) = base_out.as_deref_mut() {
            base::write_rows(out, &rows).map_err(PerplexityError::Write)?;
        }
        sums.merge(&local);
        on_chunk(chunk + 1, sums.ppl());
    }
    if let Some(out) = base_out {
        out.flush().map_err(PerplexityError::Write)?;
    }
    Ok(Outcome { windows, sums })
}

/// The settings of a KL-divergence run; the windows are the base file's.
#[derive(Clone, Copy, Debug)]
pub struct KldOptions {
    /// Most tokens a forward call takes.
    pub batch: usize,
    /// Most windows; all the base file holds when `None`.
    pub chunks: Option<usize>,
    /// The token that replaces each window's first, when the vocabulary adds BOS.
    pub bos: Option<u32>,
}

/// The outcome of [`kl_divergence`]: the sums and every scored token's KL divergence
/// and probability difference, in order.
#[derive(Clone, Debug)]
pub struct KldOutcome {
    pub stats: KldStats,
    pub kld_values: Vec<f32>,
    pub p_diff_values: Vec<f32>,
}

/// Compares `source`'s distributions with the base model's log-probabilities read by
/// `base`, over the base file's own tokens and windows. `on_chunk` gets each window's
/// number (from 1) and the running sums.
pub fn kl_divergence<S: WindowLogits + ?Sized, R: std::io::Read>(
    source: &mut S,
    base: &mut BaseReader<R>,
    options: &KldOptions,
    on_chunk: &mut dyn FnMut(usize, &KldStats),
) -> Result<KldOutcome, PerplexityError> {
    if options.batch == 0 {
        return Err(PerplexityError::Zero {
            what: "the batch size",
        });
    }
    if options.chunks == Some(0) {
        return Err(PerplexityError::Zero {
            what: "the number of chunks",
        });
    }
    let header = base.header().clone();
    let n_vocab = source.n_vocab();
    if header.n_vocab != n_vocab {
        return Err(PerplexityError::BaseMismatch {
            field: "n_vocab",
            file: header.n_vocab,
            here_what: "the model's vocabulary",
            here: n_vocab,
        });
    }
    if let Some(&token) = header.tokens.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(PerplexityError::Model(ModelError::TokenOutOfRange {
            token,
            n_vocab,
        }));
    }
    let windows = Windows {
        n_ctx: header.n_ctx,
        n_chunk: options
            .chunks
            .map_or(header.n_chunk, |c| c.min(header.n_chunk)),
    };
    let (n_ctx, first, scored) = (windows.n_ctx, windows.first(), windows.scored());
    let row_len = base::row_len(n_vocab);
    let mut stats = KldStats::default();
    let mut kld_values = Vec::with_capacity(windows.n_chunk * scored);
    let mut p_diff_values = Vec::with_capacity(windows.n_chunk * scored);
    let mut rows = Vec::new();
    for chunk in 0..windows.n_chunk {
        base.read_chunk(&mut rows)?;
        let window = &header.tokens[chunk * n_ctx..(chunk + 1) * n_ctx];
        let mut local = KldStats::default();
        run_window(
            source,
            window,
            options.bos,
            options.batch,
            first,
            |pos, logits| {
                let token = window[pos + 1] as usize;
                let row = &rows[(pos - first) * row_len..][..row_len];
                let (kld, p_diff) = kld_row(logits, row, token, &mut local);
                kld_values.push(kld as f32);
                p_diff_values.push(p_diff);
                Ok(())
            },
        )?;
        stats.merge(&local);
        on_chunk(chunk + 1, &stats);
    }
    Ok(KldOutcome {
        stats,
        kld_values,
        p_diff_values,
    })
}
