//! Causal attention computed the way llama.cpp's CPU backend computes it.
//!
//! The logits of a deep model are sensitive to the last bit of every attention output:
//! later layers quantize their activations to 8-bit blocks, and a value that lands on the
//! other side of a rounding boundary changes the next matrix product by a whole step.
//! So this module does not only use the same precisions as llama.cpp (without flash
//! attention, f16 KV cache, x86 with AVX2 and FMA) but the same order of operations.
//! ggml computes both products of attention as matrix products whose kernel depends on
//! the batch: for two or more tokens its tiled GEMM, for a single token its f16 dot
//! product. Each sums fused multiply-adds in lanes and reduces the lanes at the end:
//!
//! - batches ([`Lanes::Gemm`]): eight lanes, element `i` in lane `i % 8`, reduced as
//!   `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`;
//! - single tokens ([`Lanes::Dot`]): four registers of eight lanes, element `i` in lane
//!   `i % 32`; the registers are added as `(r0+r2)+(r1+r3)`, then the eight lanes as
//!   `((l0+l4)+(l1+l5)) + ((l2+l6)+(l3+l7))`.
//!
//! The rest is common to both:
//! - `Q·Kᵀ`: the query is rounded to f16; each score is a lane sum over the head's
//!   dimensions, then multiplied by the scale;
//! - softmax: `exp` is ggml's vectorised polynomial ([`super::expf`]); the sum is taken
//!   per aligned group of eight cache positions, reduced like a GEMM's lanes, and the
//!   groups' sums are added in f64; the probabilities are `e · (1 / sum)`, rounded to
//!   f16;
//! - `P·V`: each output element is a lane sum over cache positions, position `j` in
//!   the lane of index `j`.
//!
//! Masked positions contribute exact zeros in llama.cpp, so skipping them changes
//! nothing. Lanes follow cache positions, which equal token positions for one sequence
//! whose cache has not wrapped around.
//!
//! That is llama.cpp's attention with flash attention off (`-fa off`). With it on (its
//! default on CPUs), [`flash`] computes it instead; [`AttentionMethod`] chooses.

mod flash;

use gguf_format::GgmlType;
use rayon::prelude::*;

pub use flash::{FlashContext, KV_PAD};

use super::{expf, round_f16};

/// Which of llama.cpp's two CPU attention computations to reproduce: they round
/// differently, so greedy text can part where two tokens' logits nearly tie.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionMethod {
    /// Flash attention (`-fa on`; what llama.cpp's default, `-fa auto`, picks on a CPU).
    #[default]
    Flash,
    /// Two matrix products around a softmax (`-fa off`).
    Matmul,
}

/// A layer's stored keys or values, as the attention reads them: position `p`'s row is
/// row `p` (or the row a paged layout maps it to), heads side by side.
#[derive(Clone, Copy, Debug)]
pub enum CacheRows<'a> {
    /// f16 values as f32, `dim` a row.
    F16(&'a [f32]),
    /// Rows of blocks of `ty`, `row_bytes` a row.
    Quant {
        ty: GgmlType,
        bytes: &'a [u8],
        row_bytes: usize,
    },
}

/// The shapes of one attention call.
pub struct AttentionShape<'a> {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    /// Position of the batch's first token.
    pub first_pos: usize,
    /// Keys more than `window - 1` positions back are masked.
    pub window: Option<usize>,
    pub scale: f32,
    /// Scores `s` become `cap · tanh(s · (1/cap))` before the scale (Gemma 2's logit
    /// soft-capping, applied as llama.cpp's graph applies it).
    pub softcap: Option<f32>,
    /// One learned logit per query head that joins the softmax's denominator with no
    /// value (gpt-oss's attention sinks), as ggml adds it: to the maximum and the sum
    /// after the scores.
    pub sinks: Option<&'a [f32]>,
    /// Which computation to reproduce.
    pub method: AttentionMethod,
    /// The context around the call, which flash attention's split kernel depends on.
    pub flash: FlashContext,
}

impl AttentionShape<'_> {
    /// The cache positions token `t` of the call sees: from the first in its window to
    /// its own, both included.
    pub(crate) fn seen_by(&self, t: usize) -> (usize, usize) {
        let pos = self.first_pos + t;
        (self.window.map_or(0, |w| (pos + 1).saturating_sub(w)), pos)
    }
}

/// How a product's fused multiply-add chains are laid out and reduced.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Lanes {
    /// ggml's GEMM for batches: one register of eight lanes.
    Gemm,
    /// ggml's f16 dot product for single tokens: four registers of eight lanes.
    Dot,
}

/// Lanes of one AVX register of f32.
const LANES: usize = 8;
/// Lanes of [`Lanes::Dot`]'s four registers.
const DOT_LANES: usize = 32;

/// Causal multi-head attention with grouped key/value heads, as described in the module
/// documentation.
///
/// `q` is `n_tokens × n_heads × head_dim`; `keys` and `values` hold every cached
/// position up to and including the batch (`positions × n_kv_heads × head_dim`), at f16
/// precision; `out` receives `n_tokens × n_heads × head_dim_v`. Work is split across
/// (token, head) pairs.
#[cfg(test)]
pub fn attention(q: &[f32], keys: &[f32], values: &[f32], shape: &AttentionShape, out: &mut [f32]) {
    let (keys, values) = (CacheRows::F16(keys), CacheRows::F16(values));
    attention_in(q, keys, values, shape, Layout::Contiguous, out);
}

/// Where a cache position's keys and values are stored.
#[derive(Clone, Copy)]
pub enum Layout<'a> {
    /// Position `j` in row `j`.
    Contiguous,
    /// In blocks of `block_size` rows: position `j` in row
    /// `table[j / block_size] * block_size + j % block_size` (the scheduler's KV pool).
    Paged { table: &'a [u32], block_size: usize },
    /// A single token's step after a context shift, visiting the positions in the order
    /// of llama.cpp's cache cells: cell `j` holds position `pos[j]` (`-1`: empty), stored
    /// in row `pos[j]`; the last cell is the last occupied one. Flash attention's sums follow the cells, as llama.cpp's do,
    /// which is what keeps its logits after a shift (the one-position kernel and the
    /// split one; the tiled kernel and `-fa off` take the positions in order).
    Cells { pos: &'a [i32] },
}

impl Layout<'_> {
    #[inline(always)]
    pub(super) fn row(self, j: usize) -> usize {
        match self {
            Layout::Contiguous => j,
            Layout::Paged { table, block_size } => {
                table[j / block_size] as usize * block_size + j % block_size
            }
            Layout::Cells { pos } => pos[j] as usize,
        }
    }

    /// Whether index `j` of a range the kernels walk holds a position a query at `pos`
    /// sees, `start` the first it sees: always for positions (the ranges are clipped
    /// to them), for cells only an occupied one in the window.
    #[inline(always)]
    pub(super) fn sees(self, j: usize, start: usize, pos: usize) -> bool {
        match self {
            Layout::Cells { pos: cells } => {
                let p = cells[j];
                p >= 0 && (p as usize) >= start && (p as usize) <= pos
            }
            _ => true,
        }
    }

    /// The indices the kernels walk for a query at `pos` seeing from `start`, and the
    /// cells in use as llama.cpp counts them (every cell; the positions up to `pos`
    /// without cells).
    pub(super) fn walk(self, start: usize, pos: usize) -> (std::ops::Range<usize>, usize) {
        match self {
            Layout::Cells { pos: cells } => (0..cells.len(), cells.len()),
            _ => (start..pos + 1, pos + 1),
        }
    }
}

/// [`attention`] over keys and values stored as `layout` says, at the precisions they
/// were stored at. The sums are the same whatever the layout: lanes follow cache
/// positions, not rows. A quantized cache is always computed as flash attention
/// (llama.cpp's only way for quantized values; [`crate::KvTypes::check`] refuses the
/// other method for one).
pub fn attention_in(
    q: &[f32],
    keys: CacheRows<'_>,
    values: CacheRows<'_>,
    shape: &AttentionShape,
    layout: Layout<'_>,
    out: &mut [f32],
) {
    let (hd, hdv) = (shape.head_dim, shape.head_dim_v);
    let n_tokens = q.len() / (shape.n_heads * hd).max(1);
    let fma = super::has_fma();
    if let (AttentionMethod::Flash, CacheRows::F16(k), CacheRows::F16(v)) =
        (shape.method, keys, values)
    {
        if n_tokens >= flash::Q_TILE {
            let batch = flash::Batch {
                q,
                keys: k,
                values: v,
                shape,
                layout,
            };
            flash::tiled_blocks(&batch, n_tokens, fma, out);
            return;
        }
    }
    out.par_chunks_mut(hdv)
        .zip(q.par_chunks(hd))
        .enumerate()
        .for_each_init(Scratch::default, |s, (idx, (o, qh))| {
            let head = Head {
                t: idx / shape.n_heads,
                h: idx % shape.n_heads,
                n_tokens,
                layout,
            };
            #[cfg(target_arch = "x86_64")]
            if fma {
                // SAFETY: `has_fma` found FMA on this CPU, the feature `head_fma` needs.
                unsafe { head_fma(head, qh, keys, values, shape, s, o) };
                return;
            }
            let _ = fma;
            head_any(head, qh, keys, values, shape, s, o);
        });
}

/// Per-thread scratch: the query rounded to f16, the scores, the lanes of `P·V`.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    scores: Vec<f32>,
    lanes: Vec<f32>,
    /// Flash attention's.
    flash: flash::Scratch,
}

/// One (token, head) pair of a call, the call's token count (which picks the kernels), and where the cache's
/// rows are.
#[derive(Clone, Copy)]
struct Head<'a> {
    t: usize,
    h: usize,
    /// Tokens in the call, which choose the kernels.
    n_tokens: usize,
    layout: Layout<'a>,
}

/// [`head_any`] compiled with FMA instructions, so that `mul_add` is one instruction
/// instead of a library call. Results are the same bit for bit: a fused multiply-add is
/// exactly specified either way.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn head_fma(
    head: Head<'_>,
    qh: &[f32],
    keys: CacheRows<'_>,
    values: CacheRows<'_>,
    shape: &AttentionShape,
    s: &mut Scratch,
    o: &mut [f32],
) {
    head_any(head, qh, keys, values, shape, s, o);
}

/// Attention of one query head of one token into `o`, by the shape's method.
#[inline(always)]
fn head_any(
    head: Head<'_>,
    qh: &[f32],
    keys: CacheRows<'_>,
    values: CacheRows<'_>,
    shape: &AttentionShape,
    s: &mut Scratch,
    o: &mut [f32],
) {
    match (shape.method, keys, values) {
        (AttentionMethod::Matmul, CacheRows::F16(keys), CacheRows::F16(values)) => {
            head_impl(head, qh, keys, values, shape, s, o)
        }
        _ => flash_impl(head, qh, keys, values, shape, &mut s.flash, o),
    }
}

/// Flash attention of one query head of one token, into `o`.
#[inline(always)]
fn flash_impl(
    head: Head<'_>,
    qh: &[f32],
    keys: CacheRows<'_>,
    values: CacheRows<'_>,
    shape: &AttentionShape,
    s: &mut flash::Scratch,
    o: &mut [f32],
) {
    let kvh = head.h / (shape.n_heads / shape.n_kv_heads);
    let (start, pos) = shape.seen_by(head.t);
    let sink = shape.sinks.map(|sinks| sinks[head.h]);
    let (CacheRows::F16(keys), CacheRows::F16(values)) = (keys, values) else {
        let rows = flash::MixedRows {
            keys,
            values,
            layout: head.layout,
            kvh,
        };
        flash::head_mixed(qh, rows, shape, start, pos, sink, s, o);
        return;
    };
    let rows = flash::Rows::of_kv_head(keys, values, head.layout, shape, kvh);
    flash::head(qh, rows, shape, head.n_tokens, start, pos, sink, s, o);
}

/// Attention of one query head of one token, into `o`.
#[inline(always)]
fn head_impl(
    head: Head<'_>,
    qh: &[f32],
    keys: &[f32],
    values: &[f32],
    shape: &AttentionShape,
    s: &mut Scratch,
    o: &mut [f32],
) {
    let (hd, hdv) = (shape.head_dim, shape.head_dim_v);
    let kvh = head.h / (shape.n_heads / shape.n_kv_heads);
    let k_stride = shape.n_kv_heads * hd;
    let v_stride = shape.n_kv_heads * hdv;
    let (start, pos) = shape.seen_by(head.t);
    let lanes = if head.n_tokens >= 2 {
        Lanes::Gemm
    } else {
        Lanes::Dot
    };
    let width = match lanes {
        Lanes::Gemm => LANES,
        Lanes::Dot => DOT_LANES,
    };

    s.q.clear();
    s.q.extend(qh.iter().map(|&v| round_f16(v)));
    s.scores.clear();
    let mut max = f32::NEG_INFINITY;
    for j in start..=pos {
        let k = &keys[head.layout.row(j) * k_stride + kvh * hd..][..hd];
        let score = match shape.softcap {
            None => dot(lanes, &s.q, k) * shape.scale,
            Some(cap) => (dot(lanes, &s.q, k) * (1.0 / cap)).tanh() * cap * shape.scale,
        };
        max = max.max(score);
        s.scores.push(score);
    }
    let sink = shape.sinks.map(|sinks| sinks[head.h]);
    if let Some(sink) = sink {
        max = if max > sink { max } else { sink };
    }

    // exp, summed per aligned group of eight cache positions.
    let mut sum = 0.0f64;
    let mut group_lanes = [0.0f32; LANES];
    for (j, score) in (start..=pos).zip(s.scores.iter_mut()) {
        *score = expf(*score - max);
        group_lanes[j % LANES] = *score;
        if j % LANES == LANES - 1 || j == pos {
            sum += f64::from(reduce8(&group_lanes));
            group_lanes = [0.0; LANES];
        }
    }
    if let Some(sink) = sink {
        sum += f64::from((sink - max).exp());
    }
    let inv = (1.0 / sum) as f32;

    s.lanes.clear();
    s.lanes.resize(width * hdv, 0.0);
    for (j, &e) in (start..=pos).zip(s.scores.iter()) {
        let p = round_f16(e * inv);
        let v = &values[head.layout.row(j) * v_stride + kvh * hdv..][..hdv];
        let lane = &mut s.lanes[j % width * hdv..][..hdv];
        for (acc, &vv) in lane.iter_mut().zip(v) {
            *acc = p.mul_add(vv, *acc);
        }
    }
    for (d, o) in o.iter_mut().enumerate() {
        *o = match lanes {
            Lanes::Gemm => reduce8(&std::array::from_fn(|l| s.lanes[l * hdv + d])),
            Lanes::Dot => reduce32(&std::array::from_fn(|l| s.lanes[l * hdv + d])),
        };
    }
}

/// ggml's f16 dot product ([`Lanes::Dot`]) of two rows held at f16 precision.
#[inline(always)]
pub(super) fn dot_f16_lanes(a: &[f32], b: &[f32]) -> f32 {
    dot(Lanes::Dot, a, b)
}

/// `Σ a·b` as fused multiply-add chains laid out and reduced as `lanes` says.
#[inline(always)]
fn dot(lanes: Lanes, a: &[f32], b: &[f32]) -> f32 {
    match lanes {
        Lanes::Gemm => reduce8(&lane_sums::<LANES>(a, b)),
        Lanes::Dot => reduce32(&lane_sums::<DOT_LANES>(a, b)),
    }
}

/// `W` fused multiply-add chains, element `i` in chain `i % W`.
#[inline(always)]
fn lane_sums<const W: usize>(a: &[f32], b: &[f32]) -> [f32; W] {
    let mut acc = [0f32; W];
    let mut ca = a.chunks_exact(W);
    let mut cb = b.chunks_exact(W);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..W {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    for (l, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[l] = x.mul_add(*y, acc[l]);
    }
    acc
}

/// The horizontal sum of one AVX register as ggml's GEMM and softmax compute it: the
/// upper half added to the lower, then lanes two apart, then the last pair.
#[inline(always)]
pub(super) fn reduce8(l: &[f32; LANES]) -> f32 {
    let a = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (a[0] + a[2]) + (a[1] + a[3])
}

/// The sum of four AVX registers as ggml's f16 dot product computes it: registers
/// `(r0+r2)+(r1+r3)`, the upper half onto the lower, then two pairwise additions.
#[inline(always)]
fn reduce32(l: &[f32; DOT_LANES]) -> f32 {
    let r: [f32; LANES] = std::array::from_fn(|i| (l[i] + l[16 + i]) + (l[8 + i] + l[24 + i]));
    let a = [r[0] + r[4], r[1] + r[5], r[2] + r[6], r[3] + r[7]];
    (a[0] + a[1]) + (a[2] + a[3])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_uses_eight_fused_lanes_and_ggml_reduction() {
        // Lane 3 holds -1·1, then (1 + 2^-12)² = 1 + 2^-11 + 2^-24 is fused onto it:
        // 2^-11 + 2^-24 exactly, where a separate multiplication would round the
        // square to 1 + 2^-11 first and leave 2^-11.
        let x = 1.0 + 1.0 / 4096.0;
        let mut a = [0.0f32; 16];
        let mut b = [0.0f32; 16];
        (a[3], b[3]) = (-1.0, 1.0);
        (a[11], b[11]) = (x, x);
        assert_eq!(dot(Lanes::Gemm, &a, &b), 1.0 / 2048.0 + 1.0 / 16_777_216.0);
        assert_eq!(dot(Lanes::Dot, &a, &b), 1.0 / 2048.0);
        assert_eq!(x * x - 1.0, 1.0 / 2048.0);
        // The reduction pairs lanes 0 and 4, 1 and 5 first: with 2^24 in lane 0 and 1
        // in lanes 1 and 5, it gives 2^24 + 2, a left-to-right sum 2^24 (each + 1 is a
        // tie that rounds back to even).
        let mut l = [0.0f32; 8];
        l[0] = 16_777_216.0;
        l[1] = 1.0;
        l[5] = 1.0;
        assert_eq!(reduce8(&l), 16_777_218.0);
        assert_eq!(l.iter().sum::<f32>(), 16_777_216.0);
        // The dot product adds registers as (r0 + r2) + (r1 + r3): 2^24 + 1 is a tie
        // and rounds back to 2^24, then 1 + 1 joins it as 2; summed in order, each 1
        // would be lost.
        let mut l32 = [0.0f32; 32];
        l32[0] = 16_777_216.0;
        l32[16] = 1.0;
        l32[8] = 1.0;
        l32[24] = 1.0;
        assert_eq!(reduce32(&l32), 16_777_218.0);
    }

    #[test]
    fn attention_of_one_position_returns_its_value() {
        let shape = AttentionShape {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            head_dim_v: 4,
            first_pos: 0,
            window: None,
            scale: 0.5,
            softcap: None,
            sinks: None,
            method: AttentionMethod::Matmul,
            flash: FlashContext {
                context: 64,
                threads: 1,
            },
        };
        let q = [1.0; 8];
        let k = [0.3; 4];
        let v = [1.0, 2.0, 3.0, 4.0];
        let mut out = [0.0; 8];
        attention(&q, &k, &v, &shape, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn sliding_window_masks_old_positions() {
        // Two positions, window 1: the second token sees only itself.
        let shape = AttentionShape {
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 2,
            head_dim_v: 1,
            first_pos: 1,
            window: Some(1),
            scale: 1.0,
            softcap: None,
            sinks: None,
            method: AttentionMethod::Matmul,
            flash: FlashContext {
                context: 64,
                threads: 1,
            },
        };
        let k = [1.0, 0.0, 0.0, 1.0];
        let v = [10.0, 20.0];
        let mut out = [0.0];
        attention(&[1.0, 1.0], &k, &v, &shape, &mut out);
        assert_eq!(out, [20.0]);
    }

    #[test]
    fn attention_matches_a_plain_softmax_closely() {
        // Twelve positions, two heads sharing one KV head: the emulated roundings stay
        // within f16 precision of a plain f64 computation.
        let (hd, n) = (16, 12);
        let val = |i: usize| ((i * 7919 % 113) as f32 - 56.0) / 40.0;
        let keys: Vec<f32> = (0..n * hd).map(|i| round_f16(val(i))).collect();
        let values: Vec<f32> = (0..n * hd).map(|i| round_f16(val(i + 5000))).collect();
        let q: Vec<f32> = (0..2 * hd).map(|i| val(i + 9000)).collect();
        let shape = AttentionShape {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: hd,
            head_dim_v: hd,
            first_pos: n - 1,
            window: None,
            scale: 0.25,
            softcap: None,
            sinks: None,
            method: AttentionMethod::Matmul,
            flash: FlashContext {
                context: 64,
                threads: 1,
            },
        };
        let mut out = vec![0.0; 2 * hd];
        attention(&q, &keys, &values, &shape, &mut out);
        for h in 0..2 {
            let qh = &q[h * hd..][..hd];
            let scores: Vec<f64> = (0..n)
                .map(|j| {
                    let k = &keys[j * hd..][..hd];
                    0.25 * qh
                        .iter()
                        .zip(k)
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum::<f64>()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::MIN, f64::max);
            let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
            for d in 0..hd {
                let expected: f64 = (0..n)
                    .map(|j| (scores[j] - max).exp() / sum * f64::from(values[j * hd + d]))
                    .sum();
                let got = f64::from(out[h * hd + d]);
                assert!(
                    (got - expected).abs() < 2e-3,
                    "head {h} dim {d}: {got} vs {expected}"
                );
            }
        }
    }
}
