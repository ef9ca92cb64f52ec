//! Activations prepared for the dot products: quantized to 8-bit blocks for the
//! quantized weight formats, rounded to the weights' precision for the float ones.
//!
//! The quantization follows llama.cpp's CPU backend step for step, so that a matrix
//! product here sees the same activations as the reference engine does and logits agree
//! to the last few bits rather than only to the quantization noise:
//! - blocks of 32 (the legacy formats): `amax = max|x|`, the scale `d = amax / 127` is
//!   stored as f16 and used as that f16 value; each value is `x · (127 / amax)` rounded
//!   to the nearest integer, ties to even. The `Q8_1` flavour (for `Q4_1` and `Q5_1`)
//!   also keeps the block's sum `s = d · Σq` rounded to f16, computed with the f32 `d`;
//! - super-blocks of 256 (the k-quants): `iscale = 127 / amax`, each value is
//!   `x · iscale` rounded to the nearest integer, ties to even, and the scale is
//!   `1 / iscale` in f32, with sums of each 16 quantized values;
//! - f16 and bf16 weights see activations rounded to f16 and bf16.
//!
//! Every set holds `n_tokens` rows of `cols` values, token-major, and every quantized
//! value lies in `-127..=127`.

use std::sync::OnceLock;

/// Elements per block of the legacy formats (`Q4_0` … `Q8_0`) and of [`Q8Acts`].
pub(crate) const QK8: usize = 32;
/// Elements per super-block of the k-quants and of [`Q8KActs`].
pub(crate) const QK_K: usize = 256;
/// Elements summed into one entry of [`Q8KRow::bsums`].
pub(crate) const BSUM_GROUP: usize = 16;

/// A set of prepared activations, one row per token.
pub(crate) trait ActSet: Sync + 'static {
    /// A borrowed view of one token's row.
    type Row<'a>: Copy
    where
        Self: 'a;

    /// Prepares `n_tokens` rows of `cols` values from `x` (`x.len() == n_tokens * cols`,
    /// `cols` a multiple of the set's block).
    fn prepare(x: &[f32], n_tokens: usize, cols: usize) -> Self;

    /// Token `t`'s row.
    fn row(&self, t: usize) -> Self::Row<'_>;

    /// Values per row.
    fn cols(&self) -> usize;

    /// Bytes one row of `cols` values occupies, to size tiles and splits.
    fn row_bytes(cols: usize) -> usize;

    /// Told the row count of the matrix the set is about to meet, and whether its tokens
    /// are a router's (`MUL_MAT_ID`'s), before any product: llama.cpp's choice of
    /// kernel depends on them.
    fn for_product(&mut self, _rows: usize, _routed: bool) {}
}

/// Values from which quantization is shared out over rayon's pool, by blocks.
const PARALLEL_VALUES: usize = 1 << 16;

/// Adding and subtracting 1.5 · 2^23 rounds an f32 of magnitude below 2^22 to the
/// nearest integer, ties to even (the default rounding mode), as `round_ties_even`
/// does; unlike it, this needs no SSE4.1 and no library call on baseline x86-64.
const ROUNDER: f32 = 12_582_912.0;

/// Quantizes one block into `qs` with the step `127 / max|x|` and returns `max|x|`:
/// eight values a step on AVX2 machines, with the bits of [`quantize_block_scalar`].
fn quantize_block(x: &[f32], qs: &mut [i8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if x.len().is_multiple_of(QK8) && qs.len() == x.len() && std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present; the lengths are checked above.
        return unsafe { quantize_block_avx2(x, qs) };
    }
    quantize_block_scalar(x, qs)
}

/// [`quantize_block`], one value at a time.
fn quantize_block_scalar(x: &[f32], qs: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    for (q, v) in qs.iter_mut().zip(x) {
        // |v · id| ≤ 127 (up to rounding) for finite input; the clamp keeps a value
        // rounded up past 127 in range, and `as` maps NaN to 0.
        *q = ((v * id + ROUNDER) - ROUNDER).clamp(-127.0, 127.0) as i8;
    }
    amax
}

/// [`quantize_block_scalar`] eight values a step. The maximum of the magnitudes is the
/// same whatever the order (a NaN is passed over either way: `max_ps` returns its second
/// operand, the running maximum, when the first is NaN), and each value takes the same
/// multiplication, rounding and clamp; a NaN product becomes 0, as `as i8` makes it.
///
/// # Safety
/// The CPU must support AVX2; `x.len()` must be a multiple of 32 and `qs` as long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(x: &[f32], qs: &mut [i8]) -> f32 {
    use std::arch::x86_64::*;
    debug_assert!(x.len().is_multiple_of(QK8) && qs.len() == x.len());
    let load = |i: usize| {
        // SAFETY: the callers keep i + 8 within x.
        unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) }
    };
    let sign = _mm256_set1_ps(-0.0);
    let mut max = _mm256_setzero_ps();
    for i in (0..x.len()).step_by(8) {
        max = _mm256_max_ps(_mm256_andnot_ps(sign, load(i)), max);
    }
    let max = _mm_max_ps(_mm256_castps256_ps128(max), _mm256_extractf128_ps::<1>(max));
    let max = _mm_max_ps(max, _mm_movehl_ps(max, max));
    let amax = _mm_cvtss_f32(_mm_max_ss(max, _mm_shuffle_ps::<1>(max, max)));
    let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
    let (rounder, low, high) = (
        _mm256_set1_ps(ROUNDER),
        _mm256_set1_ps(-127.0),
        _mm256_set1_ps(127.0),
    );
    let ints = |i: usize| {
        let v = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(load(i), id), rounder), rounder);
        let v = _mm256_and_ps(v, _mm256_cmp_ps::<_CMP_ORD_Q>(v, v));
        _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, low), high))
    };
    for i in (0..x.len()).step_by(QK8) {
        // Packing works within 128-bit lanes: the permutation puts the bytes in order.
        let words = _mm256_packs_epi32(ints(i), ints(i + 8));
        let words_hi = _mm256_packs_epi32(ints(i + 16), ints(i + 24));
        let bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(words, words_hi),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
        );
        // SAFETY: i + 32 ≤ qs.len() per the contract.
        unsafe { _mm256_storeu_si256(qs.as_mut_ptr().add(i).cast(), bytes) };
    }
    amax
}

/// One block of 32 quantized as llama.cpp's `quantize_row_q8_0` does: the values into
/// `qs`, the scale returned (to be stored as f16).
pub(crate) fn quantize_q8_0_block(x: &[f32], qs: &mut [i8]) -> f32 {
    quantize_block(x, qs) / 127.0
}

/// `v` rounded to the nearest f16, back as f32.
fn round_f16(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

/// `v` rounded to the nearest bf16, back as f32.
fn round_bf16(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// Runs `each` over matching chunks of `x` (`n` values each), of `qs` and of `out` (one
/// per chunk), on rayon's pool when `x` is large.
fn for_each_block<A: Send>(
    x: &[f32],
    n: usize,
    qs: &mut [i8],
    out: &mut [A],
    each: impl Fn(&[f32], &mut [i8], &mut A) + Sync,
) {
    use rayon::prelude::*;
    if x.len() < PARALLEL_VALUES {
        for ((xb, qb), a) in x.chunks_exact(n).zip(qs.chunks_exact_mut(n)).zip(out) {
            each(xb, qb, a);
        }
    } else {
        let blocks = x.par_chunks_exact(n).zip(qs.par_chunks_exact_mut(n));
        blocks
            .zip(out.par_iter_mut())
            .with_min_len(256)
            .for_each(|((xb, qb), a)| each(xb, qb, a));
    }
}

fn isum(qs: &[i8]) -> i32 {
    qs.iter().map(|&q| i32::from(q)).sum()
}

/// Activations in blocks of 32 with an f16 scale each, for the legacy formats.
/// `ROUND_SUM` picks the `Q8_1` flavour, whose block sums are rounded to f16 as
/// llama.cpp stores them; without it (`Q8_0`) the sums are exact products.
pub(crate) struct Q8Acts<const ROUND_SUM: bool> {
    cols: usize,
    /// Whether the set holds one token.
    single: bool,
    qs: Vec<i8>,
    ds: Vec<[f32; 2]>,
}

/// One token's row of [`Q8Acts`].
#[derive(Clone, Copy)]
pub(crate) struct Q8Row<'a> {
    /// `cols` quantized values.
    pub qs: &'a [i8],
    /// Per block, its scale `d` and its sum `s` as the integer kernels see it (about `d`
    /// times the sum of the quantized values); side by side so that one 8-byte load
    /// fetches both.
    pub ds: &'a [[f32; 2]],
    /// Whether the set holds one token: llama.cpp multiplies single tokens with its dot
    /// products and batches with its GEMM, whose float order differs for some formats
    /// (`IQ4_NL`).
    pub single: bool,
}

/// Activations for the weight formats llama.cpp multiplies with `Q8_0` blocks.
pub(crate) type Q8_0Acts = Q8Acts<false>;
/// Activations for the weight formats llama.cpp multiplies with `Q8_1` blocks.
pub(crate) type Q8_1Acts = Q8Acts<true>;

impl<const ROUND_SUM: bool> ActSet for Q8Acts<ROUND_SUM> {
    type Row<'a> = Q8Row<'a>;

    fn prepare(x: &[f32], n_tokens: usize, cols: usize) -> Self {
        debug_assert_eq!(x.len(), n_tokens * cols);
        debug_assert_eq!(cols % QK8, 0);
        let n_blocks = x.len() / QK8;
        let mut acts = Q8Acts {
            cols,
            single: n_tokens == 1,
            qs: vec![0; x.len()],
            ds: vec![[0.0; 2]; n_blocks],
        };
        for_each_block(x, QK8, &mut acts.qs, &mut acts.ds, |xb, qb, ds| {
            let d = quantize_q8_0_block(xb, qb);
            let d16 = round_f16(d);
            let sum = isum(qb) as f32;
            *ds = if ROUND_SUM {
                [d16, round_f16(d * sum)]
            } else {
                [d16, d16 * sum]
            };
        });
        acts
    }

    fn row(&self, t: usize) -> Q8Row<'_> {
        let nb = self.cols / QK8;
        Q8Row {
            qs: &self.qs[t * self.cols..(t + 1) * self.cols],
            ds: &self.ds[t * nb..(t + 1) * nb],
            single: self.single,
        }
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn row_bytes(cols: usize) -> usize {
        cols + cols / QK8 * 12
    }
}

/// Activations in super-blocks of 256 with one f32 scale and sums per 16 values, for
/// the k-quants.
pub(crate) struct Q8KActs {
    cols: usize,
    gemm: bool,
    /// Tokens that llama.cpp's repacked GEMM takes: the whole groups of four.
    packed_gemm_tokens: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    bsums: Vec<[i16; QK_K / BSUM_GROUP]>,
    /// A batch's whole groups of [`GROUP_TOKENS`] tokens, interleaved (see
    /// [`Q8KGroup`]), made when a kernel first asks for one.
    groups: OnceLock<(Vec<i8>, Vec<i32>)>,
    n_tokens: usize,
}

/// Consecutive tokens that [`Q8KGroup`] interleaves.
pub(crate) const GROUP_TOKENS: usize = 8;

/// Token `t`'s group of [`Q8KActs`], which starts at `t` ([`GroupRef::get`] makes it).
#[derive(Clone, Copy)]
pub(crate) struct GroupRef<'a> {
    acts: &'a Q8KActs,
    t: usize,
}

impl<'a> GroupRef<'a> {
    /// Whether `rows` are the group's tokens, in order (the rows a tile holds, from the
    /// group's first).
    pub fn covers(&self, rows: &[Q8KRow<'_>; GROUP_TOKENS]) -> bool {
        let first = self.t * self.acts.cols;
        rows.iter().enumerate().all(|(j, row)| {
            let at = first + j * self.acts.cols;
            self.acts
                .qs
                .get(at..at + self.acts.cols)
                .map(<[i8]>::as_ptr)
                == Some(row.qs.as_ptr())
                && row.qs.len() == self.acts.cols
        })
    }

    /// The group's interleaved activations, made for every group of the batch on the
    /// first call (by any token).
    pub fn get(self) -> Q8KGroup<'a> {
        let acts = self.acts;
        let (qs, bsums) = acts
            .groups
            .get_or_init(|| interleave_groups(&acts.qs, &acts.bsums, acts.n_tokens, acts.cols));
        let g = self.t / GROUP_TOKENS;
        let (n_qs, n_sums) = (
            GROUP_TOKENS * acts.cols,
            GROUP_TOKENS * acts.cols / BSUM_GROUP,
        );
        Q8KGroup {
            qs: &qs[g * n_qs..(g + 1) * n_qs],
            bsums: &bsums[g * n_sums..(g + 1) * n_sums],
        }
    }
}

/// The activations of [`GROUP_TOKENS`] consecutive tokens of a batch, interleaved for
/// kernels that multiply four bytes of a weight row with every token of the group at
/// once (`vpdpbusd`, a weight's four bytes broadcast against one vector): for each
/// super-block `b` and each four values `4k .. 4k + 4`, the tokens' four bytes in token
/// order (`qs[(b · 64 + k) · 32 + 4t ..][..4]`), and for each group `g` of 16 values
/// the tokens' sums as i32 (`bsums[(b · 16 + g) · 8 + t]`). The same numbers as the
/// tokens' rows, in another order.
#[derive(Clone, Copy)]
pub(crate) struct Q8KGroup<'a> {
    pub qs: &'a [i8],
    pub bsums: &'a [i32],
}

/// One token's row of [`Q8KActs`].
#[derive(Clone, Copy)]
pub(crate) struct Q8KRow<'a> {
    /// `cols` quantized values.
    pub qs: &'a [i8],
    /// One scale per super-block of 256.
    pub d: &'a [f32],
    /// The sum of each group of 16 quantized values (16 per super-block).
    pub bsums: &'a [i16],
    /// Whether the set is a batch that llama.cpp multiplies with its tiled GEMM
    /// ([`GEMM_MIN_TOKENS`] tokens or more), whose float arithmetic differs from its
    /// one-token dot products; the kernels follow the same choice.
    pub gemm: bool,
    /// Whether llama.cpp's repacked `Q4_K` GEMM takes this token (the batch's tokens in
    /// whole groups of four) rather than its GEMV.
    pub packed_gemm: bool,
    /// For the first token of a whole group of [`GROUP_TOKENS`] in a batch of
    /// [`GEMM_MIN_TOKENS`] or more (token `t` with `t % 8 == 0`), the group's
    /// interleaved activations; `None` for the others.
    pub group: Option<GroupRef<'a>>,
}

/// The whole groups of [`GROUP_TOKENS`] tokens of `qs` (token-major rows of `cols`)
/// and their sums per 16, interleaved as [`Q8KGroup`] lays them out, group after group.
fn interleave_groups(
    qs: &[i8],
    bsums: &[[i16; QK_K / BSUM_GROUP]],
    n_tokens: usize,
    cols: usize,
) -> (Vec<i8>, Vec<i32>) {
    const SUMS: usize = QK_K / BSUM_GROUP;
    let (groups, nb) = (n_tokens / GROUP_TOKENS, cols / QK_K);
    let mut group_qs = vec![0i8; groups * GROUP_TOKENS * cols];
    let mut group_bsums = vec![0i32; groups * GROUP_TOKENS * nb * SUMS];
    let quads = group_qs.chunks_exact_mut(4 * GROUP_TOKENS);
    for (i, quad) in quads.enumerate() {
        // Quad `i`: group `i / (cols / 4)`, values `4k .. 4k + 4` of each token's row.
        let (g, k) = (i / (cols / 4), i % (cols / 4));
        for (t, dst) in quad.chunks_exact_mut(4).enumerate() {
            let at = (g * GROUP_TOKENS + t) * cols + 4 * k;
            dst.copy_from_slice(&qs[at..at + 4]);
        }
    }
    for (i, dst) in group_bsums.chunks_exact_mut(GROUP_TOKENS).enumerate() {
        // Entry `i`: group `i / (nb · 16)`, super-block `b`, sum `s` of each token.
        let (g, b, s) = (i / (nb * SUMS), i / SUMS % nb, i % SUMS);
        for (t, sum) in dst.iter_mut().enumerate() {
            *sum = i32::from(bsums[(g * GROUP_TOKENS + t) * nb + b][s]);
        }
    }
    (group_qs, group_bsums)
}

impl Q8KActs {
    /// Token `t`'s group, when `t` starts a whole one in a batch of
    /// [`GEMM_MIN_TOKENS`] or more.
    fn group(&self, t: usize) -> Option<GroupRef<'_>> {
        let whole = t.is_multiple_of(GROUP_TOKENS) && t + GROUP_TOKENS <= self.n_tokens;
        (self.gemm && whole).then_some(GroupRef { acts: self, t })
    }
}

/// Tokens from which llama.cpp's CPU backend multiplies k-quant weights with its tiled
/// GEMM rather than row-by-row dot products.
pub(crate) const GEMM_MIN_TOKENS: usize = 8;

impl ActSet for Q8KActs {
    type Row<'a> = Q8KRow<'a>;

    fn prepare(x: &[f32], n_tokens: usize, cols: usize) -> Self {
        debug_assert_eq!(x.len(), n_tokens * cols);
        debug_assert_eq!(cols % QK_K, 0);
        let n_blocks = x.len() / QK_K;
        let mut qs = vec![0; x.len()];
        let mut sums = vec![(0.0f32, [0i16; QK_K / BSUM_GROUP]); n_blocks];
        for_each_block(x, QK_K, &mut qs, &mut sums, |xb, qb, (d, bsums)| {
            let amax = quantize_block(xb, qb);
            *d = if amax != 0.0 {
                1.0 / (127.0 / amax)
            } else {
                0.0
            };
            for (sum, group) in bsums.iter_mut().zip(qb.chunks_exact(BSUM_GROUP)) {
                // 16 values of at most 127 in magnitude: the sum fits in an i16.
                *sum = isum(group) as i16;
            }
        });
        Q8KActs {
            cols,
            gemm: n_tokens >= GEMM_MIN_TOKENS,
            packed_gemm_tokens: n_tokens - n_tokens % 4,
            qs,
            d: sums.iter().map(|s| s.0).collect(),
            bsums: sums.iter().map(|s| s.1).collect(),
            groups: OnceLock::new(),
            n_tokens,
        }
    }

    fn for_product(&mut self, _rows: usize, routed: bool) {
        // `MUL_MAT_ID` multiplies a repacked matrix with its GEMV, token by token.
        if routed {
            self.packed_gemm_tokens = 0;
        }
    }

    fn row(&self, t: usize) -> Q8KRow<'_> {
        let nb = self.cols / QK_K;
        Q8KRow {
            qs: &self.qs[t * self.cols..(t + 1) * self.cols],
            d: &self.d[t * nb..(t + 1) * nb],
            bsums: self.bsums[t * nb..(t + 1) * nb].as_flattened(),
            gemm: self.gemm,
            packed_gemm: t < self.packed_gemm_tokens,
            group: self.group(t),
        }
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn row_bytes(cols: usize) -> usize {
        cols + cols / QK_K * 4 + cols / BSUM_GROUP * 2
    }
}

/// Activations as f32 values, for float weights. `ROUND` is what they are rounded
/// through first, as llama.cpp converts them to the weights' type: one of
/// [`KEEP_F32`], [`ROUND_F16`], [`ROUND_BF16`].
pub(crate) struct FloatActs<const ROUND: u8> {
    cols: usize,
    n_tokens: usize,
    x: Vec<f32>,
    /// See [`FloatRow::gemm`].
    gemm: bool,
}

/// One token's row of [`FloatActs`].
#[derive(Clone, Copy)]
pub(crate) struct FloatRow<'a> {
    pub x: &'a [f32],
    /// Whether llama.cpp multiplies this set with llamafile's GEMM (two tokens or more,
    /// a width that is a multiple of 8 and a matrix of a multiple of 4 rows): one
    /// eight-lane chain of fused multiply-adds per output. Otherwise its dot product:
    /// four such chains over each 32 values, and the rest one by one.
    pub gemm: bool,
}

/// [`FloatActs`] kept as they are.
pub(crate) const KEEP_F32: u8 = 0;
/// [`FloatActs`] rounded to f16.
pub(crate) const ROUND_F16: u8 = 1;
/// [`FloatActs`] rounded to bf16.
pub(crate) const ROUND_BF16: u8 = 2;

/// Activations for f32 weights.
pub(crate) type F32Acts = FloatActs<KEEP_F32>;
/// Activations for f16 weights.
pub(crate) type F16Acts = FloatActs<ROUND_F16>;
/// Activations for bf16 weights.
pub(crate) type BF16Acts = FloatActs<ROUND_BF16>;

impl<const ROUND: u8> ActSet for FloatActs<ROUND> {
    type Row<'a> = FloatRow<'a>;

    fn prepare(x: &[f32], n_tokens: usize, cols: usize) -> Self {
        let x = match ROUND {
            ROUND_F16 => x.iter().map(|&v| round_f16(v)).collect(),
            ROUND_BF16 => x.iter().map(|&v| round_bf16(v)).collect(),
            _ => x.to_vec(),
        };
        FloatActs {
            cols,
            n_tokens,
            x,
            gemm: false,
        }
    }

    fn row(&self, t: usize) -> FloatRow<'_> {
        FloatRow {
            x: &self.x[t * self.cols..(t + 1) * self.cols],
            gemm: self.gemm,
        }
    }

    fn for_product(&mut self, rows: usize, _routed: bool) {
        self.gemm = self.n_tokens >= 2 && self.cols.is_multiple_of(8) && rows.is_multiple_of(4);
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn row_bytes(cols: usize) -> usize {
        cols * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize, mul: usize, modulo: usize, step: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * mul % modulo) as f32 - (modulo / 2) as f32) * step)
            .collect()
    }

    /// The AVX2 quantizer gives the scalar one's values and maximum, bit for bit, on
    /// random blocks of 32 and 256 at many magnitudes, and on blocks holding zeros, ties,
    /// NaNs, infinities, subnormals and values far past the rounding trick's range.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_quantizer_gives_the_scalar_bits() {
        if !std::is_x86_feature_detected!("avx2") {
            eprintln!("SKIPPED the_avx2_quantizer_gives_the_scalar_bits: no AVX2");
            return;
        }
        let mut rng = crate::splitmix::Rng(7);
        let specials = [
            0.0,
            -0.0,
            0.5,
            -2.5,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE / 4.0,
            1e30,
            -1e-30,
        ];
        for case in 0..400 {
            let n = if case % 2 == 0 { QK8 } else { QK_K };
            let scale = 10f32.powi(case % 13 - 6);
            let mut x: Vec<f32> = (0..n).map(|_| rng.uniform(-1.0, 1.0) * scale).collect();
            if case % 3 == 0 {
                for _ in 0..1 + case % 4 {
                    let at = rng.next_u64() as usize % n;
                    x[at] = specials[rng.next_u64() as usize % specials.len()];
                }
            }
            if case % 50 == 7 {
                x.iter_mut().for_each(|v| *v = 0.0);
            }
            let (mut simd, mut scalar) = (vec![0i8; n], vec![0i8; n]);
            // SAFETY: AVX2 is present; n is a multiple of 32 and both buffers hold n.
            let amax = unsafe { quantize_block_avx2(&x, &mut simd) };
            let amax_scalar = quantize_block_scalar(&x, &mut scalar);
            assert_eq!(amax.to_bits(), amax_scalar.to_bits(), "case {case}: {x:?}");
            assert_eq!(simd, scalar, "case {case}: {x:?}");
        }
    }

    #[test]
    fn q8_blocks_round_trip_within_half_a_step() {
        let x = sample(128, 37, 101, 0.013);
        let acts = Q8_0Acts::prepare(&x, 2, 64);
        for t in 0..2 {
            let row = acts.row(t);
            for (i, &q) in row.qs.iter().enumerate() {
                let xi = x[t * 64 + i];
                let block = &x[t * 64 + i / QK8 * QK8..][..QK8];
                let d = block.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
                let d16 = row.ds[i / QK8][0];
                // Half a step, plus the scale's rounding to f16 times the largest value.
                let bound = d * 0.5 + 127.0 * (d16 - d).abs() + 1e-7;
                let err = (f32::from(q) * d16 - xi).abs();
                assert!(err <= bound, "value {i}: error {err}, bound {bound}");
            }
            for b in 0..2 {
                let block = &row.qs[b * QK8..(b + 1) * QK8];
                assert_eq!(row.ds[b][1], row.ds[b][0] * isum(block) as f32);
                assert_eq!(block.iter().map(|q| q.unsigned_abs()).max(), Some(127));
            }
        }
    }

    #[test]
    fn q8_scale_is_stored_as_f16_but_values_use_the_exact_step() {
        // amax = 1: the step is 127 exactly, the scale 1/127 rounds to f16 0.0078735...
        // x[1] · 127 = 100.497 rounds to 100; dividing by the f16 scale instead would
        // give 100.503 and 101, so this value tells the two apart.
        let mut x = [0.0f32; 32];
        x[0] = -1.0;
        x[1] = 100.497 / 127.0;
        x[2] = 0.5; // 63.5, a tie: 64
        let acts = Q8_0Acts::prepare(&x, 1, 32);
        let row = acts.row(0);
        assert_eq!(row.ds[0][0], half::f16::from_f32(1.0 / 127.0).to_f32());
        assert_eq!(row.ds[0][0], 0.007_873_535);
        assert_eq!(&row.qs[..3], &[-127, 100, 64]);
    }

    #[test]
    fn q8_1_sums_are_rounded_to_f16_from_the_f32_scale() {
        let x = sample(64, 29, 83, 0.021);
        let acts = Q8_1Acts::prepare(&x, 1, 64);
        let row = acts.row(0);
        for b in 0..2 {
            let block = &x[b * QK8..][..QK8];
            let d = block.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
            let sum = isum(&row.qs[b * QK8..][..QK8]) as f32;
            assert_eq!(row.ds[b][1], half::f16::from_f32(d * sum).to_f32());
            assert_eq!(row.ds[b][0], half::f16::from_f32(d).to_f32());
        }
        // The quantized values are those of the Q8_0 flavour.
        assert_eq!(Q8_0Acts::prepare(&x, 1, 64).qs, acts.qs);
    }

    #[test]
    fn q8k_scale_is_the_inverse_of_the_step() {
        let x = sample(512, 53, 97, 0.7);
        let acts = Q8KActs::prepare(&x, 1, 512);
        let row = acts.row(0);
        for b in 0..2 {
            let block = &x[b * QK_K..][..QK_K];
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let id = 127.0 / amax;
            assert_eq!(row.d[b], 1.0 / id);
            for (j, &v) in block.iter().enumerate() {
                assert_eq!(row.qs[b * QK_K + j], (v * id).round_ties_even() as i8);
            }
        }
    }

    #[test]
    fn q8k_bsums_sum_each_group_of_sixteen() {
        let x = sample(512, 53, 97, 0.7);
        let acts = Q8KActs::prepare(&x, 1, 512);
        let row = acts.row(0);
        assert_eq!(row.d.len(), 2);
        assert_eq!(row.bsums.len(), 32);
        for (g, &s) in row.bsums.iter().enumerate() {
            let expected = isum(&row.qs[g * 16..(g + 1) * 16]);
            assert_eq!(i32::from(s), expected, "group {g}");
        }
    }

    #[test]
    fn zero_blocks_get_zero_scales_and_values() {
        let acts = Q8_1Acts::prepare(&[0.0; 32], 1, 32);
        let row = acts.row(0);
        assert_eq!(row.ds[0], [0.0, 0.0]);
        assert!(row.qs.iter().all(|&q| q == 0));
        let acts = Q8KActs::prepare(&[0.0; 256], 1, 256);
        assert_eq!(acts.row(0).d, &[0.0]);
        assert!(acts.row(0).qs.iter().all(|&q| q == 0));
    }

    #[test]
    fn ties_round_to_even() {
        // With max 127 the step is exactly 1, so 2.5 and -3.5 are ties.
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        let acts = Q8_0Acts::prepare(&x, 1, 32);
        assert_eq!(&acts.row(0).qs[..3], &[127, 2, -4]);
    }

    #[test]
    fn float_activations_are_rounded_to_the_weights_type() {
        let x = [1.0f32 + 1.0 / 4096.0, -3.3, 65504.0, 1e-9];
        let cols = x.len();
        assert_eq!(F32Acts::prepare(&x, 1, cols).row(0).x, &x);
        let f16: Vec<f32> = x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
        assert_eq!(F16Acts::prepare(&x, 1, cols).row(0).x, &f16[..]);
        let bf16: Vec<f32> = x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        assert_eq!(BF16Acts::prepare(&x, 1, cols).row(0).x, &bf16[..]);
        assert_ne!(f16[0], x[0]);
    }
}
