//! AVX2 kernels of the k-quants: super-blocks of 256 weights against [`Q8KRow`]s.
//!
//! Each super-block's weights are unpacked 32 at a time into unsigned bytes (4, 5 or 6
//! bits); `maddubs` multiplies them with the activations and a `madd` against the
//! sub-block's scale (broadcast to every i16 lane by one `pshufb`) both widens and
//! weights the sums, so one i32 vector holds the whole super-block's scaled integer dot
//! product, lane `i` covering values `4i .. 4i + 4` of every 32. The mins of
//! `Q4_K`/`Q5_K` and `Q6_K`'s offset of 32 come from the activations' sums per 16.
//!
//! The float arithmetic after the integers follows llama.cpp's x86 kernels, so that
//! products agree with it to the last bit:
//! - `Q4_K` matrices of a multiple of 8 rows as its repacked kernels (which it uses for
//!   them on AVX2 machines): the integer sums are reduced to one value per super-block
//!   (the GEMV, for single tokens and the last `n % 4` tokens of a batch) or per 64
//!   values (the GEMM, for the batch's groups of four), fused into one accumulator at
//!   `d · dx`, the mins into another at `dmin · dx`, and the two subtracted at the end;
//!   other `Q4_K` matrices as `Q5_K`;
//! - `Q6_K` one token at a time as its dot product: eight lanes fused at `d · dx`,
//!   reduced at the end; and for batches of
//!   [`GEMM_MIN_TOKENS`](crate::matmul::activation::GEMM_MIN_TOKENS) or more as its tiled
//!   GEMM: per super-block `d · Σ` rounded, then fused at `dx` into one accumulator;
//! - `Q5_K` one token at a time as its dot product (the eight lanes; the mins summed
//!   per super-block and fused at `−dx · dmin` into one scalar, added at the end), in
//!   batches of eight or more as its tiled GEMM (per super-block `d · Σ` rounded,
//!   `dmin · Σmin` fused off it, the result fused at `dx` into one accumulator).

use std::arch::x86_64::*;
use std::mem::{offset_of, size_of};

use super::grouped::{gemm_step8, scales8};
use super::{
    hsum_epi32, hsum_epi32_128, hsum_ps, lanes_of, lanes_of_128, lanes_of_epi32_128, load32,
};
use crate::blocks::{BlockQ4_K, BlockQ5_K, BlockQ6_K};
use crate::matmul::activation::{Q8KRow, BSUM_GROUP, QK_K};

pub(crate) const Q4_K_BYTES: usize = size_of::<BlockQ4_K>();
pub(crate) const Q5_K_BYTES: usize = size_of::<BlockQ5_K>();
pub(crate) const Q6_K_BYTES: usize = size_of::<BlockQ6_K>();

// `f16_pair` reads d and dmin together from the start of a Q4_K/Q5_K block.
const _: () = assert!(offset_of!(BlockQ4_K, d) == 0 && offset_of!(BlockQ4_K, dmin) == 2);
const _: () = assert!(offset_of!(BlockQ5_K, d) == 0 && offset_of!(BlockQ5_K, dmin) == 2);

/// Groups of 16 per super-block.
pub(crate) const GROUPS: usize = QK_K / BSUM_GROUP;

/// Super-blocks that every row and activation row can supply.
pub(crate) fn blocks<const R: usize, const N: usize>(
    rows: &[&[u8]; R],
    bytes: usize,
    acts: &[Q8KRow<'_>; N],
) -> usize {
    let n = rows
        .iter()
        .fold(usize::MAX, |n, row| n.min(row.len() / bytes));
    acts.iter().fold(n, |n, a| {
        n.min(a.qs.len() / QK_K)
            .min(a.d.len())
            .min(a.bsums.len() / GROUPS)
    })
}

/// The activation pointers of super-block `b` for each token.
///
/// # Safety
/// `b` must be below [`blocks`] for these rows.
#[inline]
pub(crate) unsafe fn act_ptrs<const N: usize>(
    acts: &[Q8KRow<'_>; N],
    b: usize,
) -> ([*const i8; N], [*const i16; N]) {
    let mut qx = [std::ptr::null(); N];
    let mut bsums = [std::ptr::null(); N];
    for t in 0..N {
        // SAFETY: `b < blocks(..)`, so both offsets stay inside their slices.
        unsafe {
            qx[t] = acts[t].qs.as_ptr().add(b * QK_K);
            bsums[t] = acts[t].bsums.as_ptr().add(b * GROUPS);
        }
    }
    (qx, bsums)
}

/// `_mm256_shuffle_epi8` control that broadcasts i16 lane `lo` of each 128-bit half to
/// the low half's eight lanes and i16 lane `hi` to the high half's.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn pick_i16(lo: usize, hi: usize) -> __m256i {
    let lo = (0x0100 + 0x0202 * lo as i16) as i64 * 0x0001_0001_0001_0001;
    let hi = (0x0100 + 0x0202 * hi as i16) as i64 * 0x0001_0001_0001_0001;
    _mm256_setr_epi64x(lo, lo, hi, hi)
}

/// The eight 6-bit scales and eight 6-bit mins packed in the 12 bytes at `p`, as i16:
/// scales in lanes 0–7, mins in lanes 8–15.
///
/// # Safety
/// `p..p + 12` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_scales_mins(p: *const u8) -> __m256i {
    // SAFETY: readable per the contract.
    let (scales, mins) = unsafe { k_scales_mins_bytes(p) };
    _mm256_cvtepu8_epi16(_mm_set_epi64x(mins as i64, scales as i64))
}

/// The eight 6-bit scales and eight 6-bit mins packed in the 12 bytes at `p`, one a
/// byte: (scales, mins). Bytes 0–3 hold scales 0–3 in their low six bits, bytes 4–7
/// mins 0–3; bytes 8–11 hold scales 4–7 (low nibbles) and mins 4–7 (high nibbles),
/// whose top two bits sit in the spare bits of bytes 0–3 and 4–7.
///
/// # Safety
/// `p..p + 12` must be readable.
#[inline(always)]
pub(crate) unsafe fn k_scales_mins_bytes(p: *const u8) -> (u64, u64) {
    // SAFETY: readable per the contract; `read_unaligned` has no alignment requirement.
    let [w0, w1, w2] = unsafe { [0, 4, 8].map(|at| p.add(at).cast::<u32>().read_unaligned()) };
    let (low6, low4, low2) = (0x3F3F_3F3Fu32, 0x0F0F_0F0Fu32, 0x0303_0303u32);
    let scales_hi = (w2 & low4) | (((w0 >> 6) & low2) << 4);
    let mins_hi = ((w2 >> 4) & low4) | (((w1 >> 6) & low2) << 4);
    let scales = u64::from(w0 & low6) | (u64::from(scales_hi) << 32);
    let mins = u64::from(w1 & low6) | (u64::from(mins_hi) << 32);
    (scales, mins)
}

/// `Q4_K`/`Q5_K` super-block for each token: the scaled dot product `Σ scale_j Σ q qx`
/// in eight i32 lanes and the min term `Σ min_j Σ qx` in four, lane `k` the sub-blocks
/// `2k` and `2k + 1`. With `SPLIT`, also the dot product of each 64 values (sub-blocks
/// `2k`, `2k + 1`) reduced to one integer; zeros without.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the super-block (`Q5_K` when `FIVE`, else
/// `Q4_K`) and 256 activations and 16 sums behind each pointer must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q45_k_ints<const FIVE: bool, const SPLIT: bool, const N: usize>(
    block: *const u8,
    qx: [*const i8; N],
    bsums: [*const i16; N],
) -> ([__m256i; N], [__m128i; N], [[i32; 4]; N]) {
    // The scales, qh and qs sit at the same offsets in both formats but qs.
    const _: () = assert!(offset_of!(BlockQ4_K, scales) == offset_of!(BlockQ5_K, scales));
    // SAFETY: the 12 scale bytes lie inside the readable block.
    let scales_mins = unsafe { k_scales_mins(block.add(offset_of!(BlockQ4_K, scales))) };
    let mins = _mm256_extracti128_si256::<1>(scales_mins);
    let scales = _mm256_permute2x128_si256::<0x00>(scales_mins, scales_mins);
    let mut min_sums = [_mm_setzero_si128(); N];
    for t in 0..N {
        // SAFETY: 16 sums are readable behind each pointer per the contract.
        let sums = unsafe { _mm256_loadu_si256(bsums[t].cast()) };
        // Sums of 32 values of |q| ≤ 127 fit an i16.
        let pairs = _mm_hadd_epi16(
            _mm256_castsi256_si128(sums),
            _mm256_extracti128_si256::<1>(sums),
        );
        min_sums[t] = _mm_madd_epi16(mins, pairs);
    }
    let low4 = _mm256_set1_epi8(0x0F);
    let (qs_at, mut high) = if FIVE {
        // SAFETY: Q5_K's qh (32 bytes) lies inside the readable block.
        let qh = unsafe { load32(block.add(offset_of!(BlockQ5_K, qh))) };
        (offset_of!(BlockQ5_K, qs), qh)
    } else {
        (offset_of!(BlockQ4_K, qs), _mm256_setzero_si256())
    };
    let mut dots = [_mm256_setzero_si256(); N];
    let mut parts = [[0i32; 4]; N];
    #[allow(clippy::needless_range_loop)] // j picks the scales and the activations too
    for j in 0..4 {
        // SAFETY: the 32 bytes of chunk j lie inside the readable block.
        let packed = unsafe { load32(block.add(qs_at + 32 * j)) };
        let mut lo = _mm256_and_si256(packed, low4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), low4);
        if FIVE {
            // Bit 2j of qh[l] is the fifth bit of low value l, bit 2j + 1 of the high one.
            let bit4 = _mm256_set1_epi8(0x10);
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16::<4>(high), bit4));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16::<3>(high), bit4));
            high = _mm256_srli_epi16::<2>(high);
        }
        let scale_lo = _mm256_shuffle_epi8(scales, pick_i16(2 * j, 2 * j));
        let scale_hi = _mm256_shuffle_epi8(scales, pick_i16(2 * j + 1, 2 * j + 1));
        for t in 0..N {
            // SAFETY: 256 activations are readable behind each pointer per the contract.
            let (x_lo, x_hi) = unsafe {
                (
                    load32(qx[t].add(64 * j).cast()),
                    load32(qx[t].add(64 * j + 32).cast()),
                )
            };
            let dot_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x_lo), scale_lo);
            let dot_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x_hi), scale_hi);
            let dot = _mm256_add_epi32(dot_lo, dot_hi);
            dots[t] = _mm256_add_epi32(dots[t], dot);
            if SPLIT {
                parts[t][j] = hsum_epi32(dot);
            }
        }
    }
    (dots, min_sums, parts)
}

/// The 6-bit values (`q + 32`, in `0..64`) of half `half` of a `Q6_K` super-block, in
/// order, 32 a vector: values `128 · half + 32k ..` in vector `k`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the super-block must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q6_k_values(block: *const u8, half: usize) -> [__m256i; 4] {
    let (ql_at, qh_at) = (offset_of!(BlockQ6_K, ql), offset_of!(BlockQ6_K, qh));
    let low4 = _mm256_set1_epi8(0x0F);
    let bits45 = _mm256_set1_epi8(0x30);
    // SAFETY: ql and qh lie inside the readable block.
    let (ql0, ql1, qh) = unsafe {
        (
            load32(block.add(ql_at + 64 * half)),
            load32(block.add(ql_at + 64 * half + 32)),
            load32(block.add(qh_at + 32 * half)),
        )
    };
    // Values 32k + l take the low or high nibble of ql and bits 2k, 2k + 1 of qh[l].
    [
        _mm256_or_si256(
            _mm256_and_si256(ql0, low4),
            _mm256_and_si256(_mm256_slli_epi16::<4>(qh), bits45),
        ),
        _mm256_or_si256(
            _mm256_and_si256(ql1, low4),
            _mm256_and_si256(_mm256_slli_epi16::<2>(qh), bits45),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low4),
            _mm256_and_si256(qh, bits45),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low4),
            _mm256_and_si256(_mm256_srli_epi16::<2>(qh), bits45),
        ),
    ]
}

/// `Q6_K` super-block for each token: `Σ scale_g Σ (q - 32) qx` in eight i32 lanes.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the super-block and 256 activations and
/// 16 sums behind each pointer must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_ints<const N: usize>(
    block: *const u8,
    qx: [*const i8; N],
    bsums: [*const i16; N],
) -> [__m256i; N] {
    // SAFETY: the 16 signed scales lie inside the readable block.
    let scales = unsafe { _mm_loadu_si128(block.add(offset_of!(BlockQ6_K, scales)).cast()) };
    let scales = _mm256_cvtepi8_epi16(scales);
    let mut dots = [_mm256_setzero_si256(); N];
    let scales32 = _mm256_slli_epi16::<5>(scales);
    for t in 0..N {
        // The offset: -32 Σ scale_g bsum_g, spread over the lanes by pairs of groups
        // (as llama.cpp's dot product spreads it).
        // SAFETY: 16 sums are readable behind each pointer per the contract.
        let sums = unsafe { _mm256_loadu_si256(bsums[t].cast()) };
        dots[t] = _mm256_sub_epi32(dots[t], _mm256_madd_epi16(scales32, sums));
    }
    for half in 0..2 {
        // Groups 8·half .. 8·half + 8, in both 128-bit lanes.
        let groups = if half == 0 {
            _mm256_permute2x128_si256::<0x00>(scales, scales)
        } else {
            _mm256_permute2x128_si256::<0x11>(scales, scales)
        };
        // SAFETY: the block is readable per this function's contract.
        let values = unsafe { q6_k_values(block, half) };
        for (k, &q) in values.iter().enumerate() {
            // Values 32k..32k + 32 span groups 2k and 2k + 1 of this half: one scale
            // per 128-bit lane of the i16 products.
            let scale = _mm256_shuffle_epi8(groups, pick_i16(2 * k, 2 * k + 1));
            for t in 0..N {
                // SAFETY: 256 activations are readable behind each pointer.
                let x = unsafe { load32(qx[t].add(128 * half + 32 * k).cast()) };
                dots[t] = _mm256_add_epi32(
                    dots[t],
                    _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), scale),
                );
            }
        }
    }
    dots
}

/// The f16 pair at `p` (`d`, then `dmin` or anything), widened.
///
/// # Safety
/// `p..p + 4` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn f16_pair(p: *const u8) -> __m128 {
    // SAFETY: readable per the contract; `read_unaligned` has no alignment requirement.
    _mm_cvtph_ps(_mm_cvtsi32_si128(unsafe {
        p.cast::<i32>().read_unaligned()
    }))
}

/// `R` `Q4_K`/`Q5_K` rows against `N` tokens. `PACKED` (`Q4_K` matrices that llama.cpp
/// repacks) takes its repacked kernels' arithmetic; otherwise, as llama.cpp multiplies
/// them, tokens of a batch of [`GEMM_MIN_TOKENS`](crate::matmul::activation::GEMM_MIN_TOKENS)
/// or more take its tiled GEMM's (per super-block `d · Σ − dmin · Σmin`, then fused at
/// `dx`) and single tokens its dot product's (eight lanes, mins apart).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q45_k<const FIVE: bool, const PACKED: bool, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    let bytes = if FIVE { Q5_K_BYTES } else { Q4_K_BYTES };
    let nb = blocks(&rows, bytes, &acts);
    let mut out = [[0.0f32; N]; R];
    // One row after another: interleaving rows would run out of registers.
    for r in 0..R {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut acc_min = [_mm_setzero_ps(); N];
        // The repacked kernels' and the tiled GEMM's single accumulators.
        let mut sum = [0.0f32; N];
        // The repacked kernels' mins and `Q5_K`'s dot product's scalar of mins.
        let mut sum_min = [0.0f32; N];
        for b in 0..nb {
            // SAFETY: b < nb bounds the block and the activations; the features are
            // present per this function's contract.
            let (d_dmin, (dots, min_sums, parts)) = unsafe {
                let (qx, bsums) = act_ptrs(&acts, b);
                let block = rows[r].as_ptr().add(b * bytes);
                (
                    f16_pair(block),
                    q45_k_ints::<FIVE, PACKED, N>(block, qx, bsums),
                )
            };
            for t in 0..N {
                let scaled = _mm_mul_ps(d_dmin, _mm_set1_ps(acts[t].d[b]));
                if !PACKED && acts[t].gemm {
                    let w = lanes_of_128(d_dmin);
                    let main = w[0] * hsum_epi32(dots[t]) as f32;
                    let res = (-w[1]).mul_add(hsum_epi32_128(min_sums[t]) as f32, main);
                    sum[t] = res.mul_add(acts[t].d[b], sum[t]);
                    continue;
                }
                if !PACKED {
                    let d = _mm256_broadcastss_ps(scaled);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[t]), d, acc[t]);
                    if FIVE {
                        // Q5_K's dot product sums each super-block's mins and fuses
                        // them at −dx · dmin into one scalar.
                        let dmin = -lanes_of_128(scaled)[1];
                        let total = hsum_epi32_128(min_sums[t]) as f32;
                        sum_min[t] = dmin.mul_add(total, sum_min[t]);
                    } else {
                        let dmin = _mm_permute_ps::<0b01_01_01_01>(scaled);
                        let mins = _mm_cvtepi32_ps(min_sums[t]);
                        acc_min[t] = _mm_fmadd_ps(mins, dmin, acc_min[t]);
                    }
                    continue;
                }
                let d = lanes_of_128(scaled);
                if acts[t].packed_gemm {
                    // The GEMM adds each 64 values' sums on their own.
                    let mins = lanes_of_epi32_128(min_sums[t]);
                    for j in 0..4 {
                        sum[t] = (parts[t][j] as f32).mul_add(d[0], sum[t]);
                        sum_min[t] = (mins[j] as f32).mul_add(d[1], sum_min[t]);
                    }
                } else {
                    // The GEMV adds each super-block's sums at once.
                    sum[t] = (hsum_epi32(dots[t]) as f32).mul_add(d[0], sum[t]);
                    sum_min[t] = (hsum_epi32_128(min_sums[t]) as f32).mul_add(d[1], sum_min[t]);
                }
            }
        }
        for t in 0..N {
            out[r][t] = if PACKED {
                sum[t] - sum_min[t]
            } else if acts[t].gemm {
                sum[t]
            } else if FIVE {
                hsum_ps(acc[t]) + sum_min[t]
            } else {
                let mins =
                    _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(acc_min[t]), _mm_setzero_ps());
                hsum_ps(acc[t]) - hsum_ps(mins)
            };
        }
    }
    out
}

/// The sums of eight vectors' i32 lanes: lane `k` of the result is `Σ v[k]` (exact, in
/// any order).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum8_epi32(v: [__m256i; 8]) -> __m256i {
    // Each 128-bit half of `low` holds v[0..4]'s sums over that half; `high` v[4..8]'s.
    let low = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    let high = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(low, high),
        _mm256_permute2x128_si256::<0x31>(low, high),
    )
}

/// Four rows of a `Q4_K` matrix llama.cpp repacks against eight tokens: where every
/// token is in a whole group of four of the batch (its repacked GEMM's), the GEMM's
/// float operations on eight lanes, lane `t` token `t`'s, each 64 values' integer sum
/// reduced across the tokens' vectors at once; otherwise two calls of
/// [`dot_q4_k_packed`]'s four tokens. Every row and token gets the bits of
/// [`dot_q4_k_packed`]: for each super-block and each 64 values in order, the sum fused
/// at `d · dx` and the mins at `dmin · dx`, then one subtracted from the other.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile8_q4_k_packed(rows: [&[u8]; 4], acts: [Q8KRow<'_>; 8]) -> [[f32; 8]; 4] {
    if !acts.iter().all(|a| a.packed_gemm) {
        let [a0, a1, a2, a3, a4, a5, a6, a7] = acts;
        // SAFETY: the features are present per this function's contract.
        let tile = |acts| rows.map(|row| unsafe { dot_q4_k_packed::<1, 4>([row], acts) }[0]);
        return super::join_tiles(tile([a0, a1, a2, a3]), tile([a4, a5, a6, a7]));
    }
    let nb = blocks(&rows, Q4_K_BYTES, &acts);
    if let Some(group) = acts[0].group.filter(|g| g.covers(&acts)) {
        // SAFETY: the features are present per this function's contract.
        return unsafe { super::grouped::q4_k_grouped(rows, &acts, group.get(), nb) }
            .map(|v| lanes_of(v));
    }
    let low4 = _mm256_set1_epi8(0x0F);
    let mut sums = [_mm256_setzero_ps(); 4];
    let mut sum_mins = [_mm256_setzero_ps(); 4];
    for b in 0..nb {
        // SAFETY: b < nb bounds the activations.
        let (qx, bsums) = unsafe { act_ptrs(&acts, b) };
        let dx = scales8(&acts, b);
        // Each token's sums of its eight sub-blocks (32 values of |q| ≤ 127: an i16
        // each), as four i32 lanes of pairs (sub-blocks 2j, 2j + 1)...
        let pairs = bsums.map(|bsums| {
            // SAFETY: 16 sums are readable behind each pointer.
            let sums16 = unsafe { _mm256_loadu_si256(bsums.cast()) };
            _mm_hadd_epi16(
                _mm256_castsi256_si128(sums16),
                _mm256_extracti128_si256::<1>(sums16),
            )
        });
        // ... turned so that `by_j[j]`'s lane t is token t's pair j.
        let y: [__m256i; 4] = std::array::from_fn(|t| {
            _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(pairs[t]), pairs[t + 4])
        });
        let (t01, t23) = (
            [
                _mm256_unpacklo_epi32(y[0], y[1]),
                _mm256_unpackhi_epi32(y[0], y[1]),
            ],
            [
                _mm256_unpacklo_epi32(y[2], y[3]),
                _mm256_unpackhi_epi32(y[2], y[3]),
            ],
        );
        let by_j = [
            _mm256_unpacklo_epi64(t01[0], t23[0]),
            _mm256_unpackhi_epi64(t01[0], t23[0]),
            _mm256_unpacklo_epi64(t01[1], t23[1]),
            _mm256_unpackhi_epi64(t01[1], t23[1]),
        ];
        for r in 0..4 {
            // SAFETY: b < nb bounds the block, whose fields these read.
            let (d_dmin, scales_mins, (_, mins), qs) = unsafe {
                let block = rows[r].as_ptr().add(b * Q4_K_BYTES);
                let scales = block.add(offset_of!(BlockQ4_K, scales));
                (
                    lanes_of_128(f16_pair(block)),
                    k_scales_mins(scales),
                    k_scales_mins_bytes(scales),
                    block.add(offset_of!(BlockQ4_K, qs)),
                )
            };
            let d = _mm256_mul_ps(_mm256_set1_ps(d_dmin[0]), dx);
            let dmin = _mm256_mul_ps(_mm256_set1_ps(d_dmin[1]), dx);
            let scales = _mm256_permute2x128_si256::<0x00>(scales_mins, scales_mins);
            let (mut sum, mut sum_min) = (sums[r], sum_mins[r]);
            #[allow(clippy::needless_range_loop)] // j picks the scales and the activations too
            for j in 0..4 {
                // SAFETY: the 32 bytes of chunk j lie inside the block.
                let packed = unsafe { load32(qs.add(32 * j)) };
                let lo = _mm256_and_si256(packed, low4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), low4);
                let scale_lo = _mm256_shuffle_epi8(scales, pick_i16(2 * j, 2 * j));
                let scale_hi = _mm256_shuffle_epi8(scales, pick_i16(2 * j + 1, 2 * j + 1));
                let dots = qx.map(|qx| {
                    // SAFETY: 256 activations are readable behind each pointer.
                    let (x_lo, x_hi) = unsafe {
                        (
                            load32(qx.add(64 * j).cast()),
                            load32(qx.add(64 * j + 32).cast()),
                        )
                    };
                    _mm256_add_epi32(
                        _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x_lo), scale_lo),
                        _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x_hi), scale_hi),
                    )
                });
                let part = _mm256_cvtepi32_ps(hsum8_epi32(dots));
                // The mins of sub-blocks 2j and 2j + 1, as one i16 pair against each
                // token's pair of sums.
                let pair = ((mins >> (16 * j)) & 0xFF) | (((mins >> (16 * j + 8)) & 0xFF) << 16);
                let min = _mm256_madd_epi16(by_j[j], _mm256_set1_epi32(pair as i32));
                sum = _mm256_fmadd_ps(part, d, sum);
                sum_min = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min), dmin, sum_min);
            }
            (sums[r], sum_mins[r]) = (sum, sum_min);
        }
    }
    std::array::from_fn(|r| lanes_of(_mm256_sub_ps(sums[r], sum_mins[r])))
}

/// `R` `Q4_K` rows against `N` tokens, of a matrix llama.cpp does not repack.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_k<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_q45_k::<false, false, R, N>(rows, acts) }
}

/// `R` `Q4_K` rows against `N` tokens, of a matrix llama.cpp repacks (a multiple of 8
/// rows).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_k_packed<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_q45_k::<false, true, R, N>(rows, acts) }
}

/// `R` `Q5_K` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q5_k<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_q45_k::<true, false, R, N>(rows, acts) }
}

/// `R` `Q6_K` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q6_k<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    let nb = blocks(&rows, Q6_K_BYTES, &acts);
    let mut out = [[0.0f32; N]; R];
    // One row after another: interleaving rows would run out of registers.
    for r in 0..R {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut gemm = [0.0f32; N];
        for b in 0..nb {
            // SAFETY: b < nb bounds the block and the activations; the features are
            // present per this function's contract.
            let (d, dots) = unsafe {
                let (qx, bsums) = act_ptrs(&acts, b);
                let block = rows[r].as_ptr().add(b * Q6_K_BYTES);
                (
                    super::load_f16(block.add(offset_of!(BlockQ6_K, d))),
                    q6_k_ints::<N>(block, qx, bsums),
                )
            };
            for t in 0..N {
                if acts[t].gemm {
                    let scaled = d * hsum_epi32(dots[t]) as f32;
                    gemm[t] = scaled.mul_add(acts[t].d[b], gemm[t]);
                } else {
                    let scale = _mm256_set1_ps(d * acts[t].d[b]);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[t]), scale, acc[t]);
                }
            }
        }
        for t in 0..N {
            out[r][t] = if acts[t].gemm {
                gemm[t]
            } else {
                hsum_ps(acc[t])
            };
        }
    }
    out
}

/// Four `Q6_K` rows against eight tokens: in a batch that llama.cpp multiplies with its
/// tiled GEMM, that GEMM's float operations on eight lanes, lane `t` token `t`'s, each
/// super-block's integers unpacked once for the eight tokens and their sums reduced
/// across the tokens' vectors at once ([`gemm_step8`]); otherwise two calls of
/// [`dot_q6_k`]'s four tokens. Every row and token gets the bits of [`dot_q6_k`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile8_q6_k(rows: [&[u8]; 4], acts: [Q8KRow<'_>; 8]) -> [[f32; 8]; 4] {
    if !acts.iter().all(|a| a.gemm) {
        let [a0, a1, a2, a3, a4, a5, a6, a7] = acts;
        // SAFETY: the features are present per this function's contract.
        let tile = |acts| rows.map(|row| unsafe { dot_q6_k::<1, 4>([row], acts) }[0]);
        return super::join_tiles(tile([a0, a1, a2, a3]), tile([a4, a5, a6, a7]));
    }
    let nb = blocks(&rows, Q6_K_BYTES, &acts);
    if let Some(group) = acts[0].group.filter(|g| g.covers(&acts)) {
        // SAFETY: the features are present per this function's contract.
        return unsafe { super::grouped::q6_k_grouped(rows, &acts, group.get(), nb) }
            .map(|v| lanes_of(v));
    }
    let mut acc = [_mm256_setzero_ps(); 4];
    for b in 0..nb {
        // SAFETY: b < nb bounds the activations.
        let (qx, bsums) = unsafe { act_ptrs(&acts, b) };
        let dx = scales8(&acts, b);
        for r in 0..4 {
            // SAFETY: b < nb bounds the block; the features are present per this
            // function's contract.
            let (d, dots) = unsafe {
                let block = rows[r].as_ptr().add(b * Q6_K_BYTES);
                (
                    super::load_f16(block.add(offset_of!(BlockQ6_K, d))),
                    q6_k_ints::<8>(block, qx, bsums),
                )
            };
            acc[r] = gemm_step8(acc[r], d, dots, dx);
        }
    }
    acc.map(|v| lanes_of(v))
}

/// The integers of one super-block, summed over the lanes: what the portable
/// `q4_k_block`/`q5_k_block` return, and `(q6_k_block, 0)` for `Q6_K`.
#[cfg(test)]
pub(crate) fn block_ints(
    _proof: super::Avx2,
    ty: gguf_format::GgmlType,
    block: &[u8],
    qx: &[i8],
    bsums: &[i16],
) -> (i32, i32) {
    use gguf_format::GgmlType as T;
    assert!(qx.len() >= QK_K && bsums.len() >= GROUPS);
    let bytes = match ty {
        T::Q4_K => Q4_K_BYTES,
        T::Q5_K => Q5_K_BYTES,
        T::Q6_K => Q6_K_BYTES,
        other => panic!("{other} is not a k-quant"),
    };
    assert!(block.len() >= bytes);
    #[target_feature(enable = "avx2,fma,f16c")]
    fn ints(
        ty: gguf_format::GgmlType,
        block: *const u8,
        qx: *const i8,
        bsums: *const i16,
    ) -> (i32, i32) {
        let hsum4 = |v: __m128i| super::hsum_epi32_128(v);
        // SAFETY: the caller checked the lengths; the features are present, as calling
        // this function requires.
        unsafe {
            match ty {
                T::Q4_K => {
                    let ([dot], [min], _) = q45_k_ints::<false, false, 1>(block, [qx], [bsums]);
                    (super::hsum_epi32(dot), hsum4(min))
                }
                T::Q5_K => {
                    let ([dot], [min], _) = q45_k_ints::<true, false, 1>(block, [qx], [bsums]);
                    (super::hsum_epi32(dot), hsum4(min))
                }
                _ => (
                    super::hsum_epi32(q6_k_ints::<1>(block, [qx], [bsums])[0]),
                    0,
                ),
            }
        }
    }
    // SAFETY: `_proof` shows the CPU has the features.
    unsafe { ints(ty, block.as_ptr(), qx.as_ptr(), bsums.as_ptr()) }
}

/// The eight integer lanes of one `Q6_K` super-block.
#[cfg(test)]
pub(crate) fn q6_k_block_lanes(
    _proof: super::Avx2,
    block: &[u8],
    qx: &[i8],
    bsums: &[i16],
) -> [i32; 8] {
    assert!(qx.len() >= QK_K && bsums.len() >= GROUPS && block.len() >= Q6_K_BYTES);
    #[target_feature(enable = "avx2,fma,f16c")]
    fn lanes(block: *const u8, qx: *const i8, bsums: *const i16) -> [i32; 8] {
        // SAFETY: the caller checked the lengths; the features are present, as calling
        // this function requires.
        let [lanes] = unsafe { q6_k_ints::<1>(block, [qx], [bsums]) };
        let mut out = [0i32; 8];
        // SAFETY: `out` holds eight i32; `storeu` has no alignment requirement.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), lanes) };
        out
    }
    // SAFETY: `_proof` shows the CPU has the features.
    unsafe { lanes(block.as_ptr(), qx.as_ptr(), bsums.as_ptr()) }
}

/// The integer lanes of one `Q4_K` (`five` false) or `Q5_K` super-block: the dot
/// product's eight and the mins' four.
#[cfg(test)]
pub(crate) fn q45_k_block_lanes(
    _proof: super::Avx2,
    five: bool,
    block: &[u8],
    qx: &[i8],
    bsums: &[i16],
) -> ([i32; 8], [i32; 4]) {
    let bytes = if five { Q5_K_BYTES } else { Q4_K_BYTES };
    assert!(qx.len() >= QK_K && bsums.len() >= GROUPS && block.len() >= bytes);
    #[target_feature(enable = "avx2,fma,f16c")]
    fn lanes(
        five: bool,
        block: *const u8,
        qx: *const i8,
        bsums: *const i16,
    ) -> ([i32; 8], [i32; 4]) {
        // SAFETY: the caller checked the lengths; the features are present, as calling
        // this function requires.
        let ([dots], [mins], _) = unsafe {
            if five {
                q45_k_ints::<true, false, 1>(block, [qx], [bsums])
            } else {
                q45_k_ints::<false, false, 1>(block, [qx], [bsums])
            }
        };
        let mut out = [0i32; 8];
        // SAFETY: `out` holds eight i32; `storeu` has no alignment requirement.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), dots) };
        (out, super::lanes_of_epi32_128(mins))
    }
    // SAFETY: `_proof` shows the CPU has the features.
    unsafe { lanes(five, block.as_ptr(), qx.as_ptr(), bsums.as_ptr()) }
}
