//! AVX2 kernels of the k-quants: super-blocks of 256 weights against [`Q8KRow`]s.
//!
//! Each super-block's weights are unpacked 32 at a time into unsigned bytes (4, 5 or 6
//! bits); `maddubs` multiplies them with the activations and a `madd` against the
//! sub-block scales both widens and weights the sums, so one i32 vector holds the whole
//! super-block's scaled integer dot product. `Q6_K`'s offset of 32 and the mins of
//! `Q4_K`/`Q5_K` come from the activations' sums per 16.

use std::arch::x86_64::*;

use super::{hsum_epi32_128, hsum_ps, load32, load_f16, mul_sum_u8_i8_scaled};
use crate::matmul::activation::{Q8KRow, BSUM_GROUP, QK_K};
use crate::matmul::portable::{k_scales_mins, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES};

/// Groups of 16 per super-block.
const GROUPS: usize = QK_K / BSUM_GROUP;

/// Super-blocks that every row and activation row can supply.
fn blocks<const R: usize, const N: usize>(
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
unsafe fn act_ptrs<const N: usize>(
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

/// `Σ mins_j · (bsums[2j] + bsums[2j+1])` for the eight sub-blocks of 32.
///
/// # Safety
/// `bsums..bsums + 16` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn min_sum(mins16: __m128i, bsums: *const i16) -> i32 {
    // SAFETY: readable per the contract.
    let sums = unsafe { _mm256_loadu_si256(bsums.cast()) };
    // 16 values of |q| ≤ 127 per sum: a pair of them fits an i16.
    let pairs = _mm_hadd_epi16(
        _mm256_castsi256_si128(sums),
        _mm256_extracti128_si256::<1>(sums),
    );
    hsum_epi32_128(_mm_madd_epi16(mins16, pairs))
}

/// The 4-bit-scale k-quants (`Q4_K`, `Q5_K`): `(Σ scale_j Σ q qx` in eight lanes,
/// `Σ min_j Σ qx)` of one super-block for each token.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the super-block (`Q5_K` when `FIVE`, else
/// `Q4_K`) and 256 activations and 16 sums behind each pointer must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q45_k_ints<const FIVE: bool, const N: usize>(
    block: *const u8,
    qx: [*const i8; N],
    bsums: [*const i16; N],
) -> ([__m256i; N], [i32; N]) {
    // SAFETY: the 12 scale bytes lie at 4..16 of the readable block.
    let (scales, mins) = k_scales_mins(unsafe { std::slice::from_raw_parts(block.add(4), 12) });
    let mins16 = _mm_cvtepu8_epi16(_mm_set_epi64x(0, i64::from_le_bytes(mins)));
    let mut min_sums = [0i32; N];
    for t in 0..N {
        // SAFETY: 16 sums are readable behind each pointer per the contract.
        min_sums[t] = unsafe { min_sum(mins16, bsums[t]) };
    }
    let low4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let (qs_at, mut high) = if FIVE {
        // SAFETY: Q5_K's qh lies at 16..48 of the readable block.
        (48, unsafe { load32(block.add(16)) })
    } else {
        (16, _mm256_setzero_si256())
    };
    let mut sums = [_mm256_setzero_si256(); N];
    for j in 0..4 {
        // SAFETY: the 32 bytes of chunk j lie inside the readable block.
        let packed = unsafe { load32(block.add(qs_at + 32 * j)) };
        let mut lo = _mm256_and_si256(packed, low4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), low4);
        if FIVE {
            // Bit 2j of qh[l] is the fifth bit of the low value l, bit 2j+1 of the high.
            lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(high, one)));
            let next = _mm256_and_si256(_mm256_srli_epi16::<1>(high), one);
            hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(next));
            high = _mm256_srli_epi16::<2>(high);
        }
        let scale_lo = _mm256_set1_epi16(i16::from(scales[2 * j]));
        let scale_hi = _mm256_set1_epi16(i16::from(scales[2 * j + 1]));
        for t in 0..N {
            // SAFETY: 256 activations are readable behind each pointer per the contract.
            let (x_lo, x_hi) = unsafe {
                (
                    load32(qx[t].add(64 * j).cast()),
                    load32(qx[t].add(64 * j + 32).cast()),
                )
            };
            let dot = _mm256_add_epi32(
                mul_sum_u8_i8_scaled(lo, x_lo, scale_lo),
                mul_sum_u8_i8_scaled(hi, x_hi, scale_hi),
            );
            sums[t] = _mm256_add_epi32(sums[t], dot);
        }
    }
    (sums, min_sums)
}

/// The low two bits of each byte of `shifted`, moved to bits 4 and 5.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn high2(shifted: __m256i, two_bits: __m256i) -> __m256i {
    _mm256_slli_epi16::<4>(_mm256_and_si256(shifted, two_bits))
}

/// `Q6_K`: `Σ scale_g Σ (q - 32) qx` of one super-block in eight lanes, per token.
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
    // SAFETY: the 16 signed scales lie at 192..208 of the readable block.
    let scales8 = unsafe { _mm_loadu_si128(block.add(192).cast()) };
    let scales16 = _mm256_cvtepi8_epi16(scales8);
    let mut sums = [_mm256_setzero_si256(); N];
    for t in 0..N {
        // The offset: -32 Σ scale_g bsum_g, spread over the lanes.
        // SAFETY: 16 sums are readable behind each pointer per the contract.
        let group_sums = unsafe { _mm256_loadu_si256(bsums[t].cast()) };
        sums[t] = _mm256_sub_epi32(
            sums[t],
            _mm256_slli_epi32::<5>(_mm256_madd_epi16(scales16, group_sums)),
        );
    }
    let low4 = _mm256_set1_epi8(0x0F);
    let two_bits = _mm256_set1_epi8(3);
    for half in 0..2 {
        // SAFETY: ql (0..128) and qh (128..192) lie inside the readable block.
        let (ql0, ql1, qh) = unsafe {
            (
                load32(block.add(64 * half)),
                load32(block.add(64 * half + 32)),
                load32(block.add(128 + 32 * half)),
            )
        };
        let values = [
            _mm256_or_si256(_mm256_and_si256(ql0, low4), high2(qh, two_bits)),
            _mm256_or_si256(
                _mm256_and_si256(ql1, low4),
                high2(_mm256_srli_epi16::<2>(qh), two_bits),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low4),
                high2(_mm256_srli_epi16::<4>(qh), two_bits),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low4),
                high2(_mm256_srli_epi16::<6>(qh), two_bits),
            ),
        ];
        for (k, &q) in values.iter().enumerate() {
            // Values 32k..32k+32 of this half span groups 2p and 2p+1: one scale per
            // 128-bit lane of the i16 products.
            let p = (4 * half + k) as i64;
            let pick = _mm_set_epi64x(
                0x0101_0101_0101_0101 * (2 * p + 1),
                0x0101_0101_0101_0101 * (2 * p),
            );
            let scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales8, pick));
            for t in 0..N {
                // SAFETY: 256 activations are readable behind each pointer.
                let x = unsafe { load32(qx[t].add(128 * half + 32 * k).cast()) };
                sums[t] = _mm256_add_epi32(sums[t], mul_sum_u8_i8_scaled(q, x, scale));
            }
        }
    }
    sums
}

/// `R` `Q4_K`/`Q5_K` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q45_k<const FIVE: bool, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    let bytes = if FIVE { Q5_K_BYTES } else { Q4_K_BYTES };
    let nb = blocks(&rows, bytes, &acts);
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    let mut mins = [[0.0f32; N]; R];
    for b in 0..nb {
        // SAFETY: b < nb bounds the activations.
        let (qx, bsums) = unsafe { act_ptrs(&acts, b) };
        for r in 0..R {
            // SAFETY: b < nb bounds the block; the features are present per this
            // function's contract.
            let (d, dmin, (sums, min_sums)) = unsafe {
                let block = rows[r].as_ptr().add(b * bytes);
                (
                    load_f16(block),
                    load_f16(block.add(2)),
                    q45_k_ints::<FIVE, N>(block, qx, bsums),
                )
            };
            for t in 0..N {
                let dx = acts[t].d[b];
                acc[r][t] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(sums[t]),
                    _mm256_set1_ps(d * dx),
                    acc[r][t],
                );
                mins[r][t] += dmin * dx * min_sums[t] as f32;
            }
        }
    }
    let mut out = [[0.0f32; N]; R];
    for r in 0..R {
        for t in 0..N {
            out[r][t] = hsum_ps(acc[r][t]) - mins[r][t];
        }
    }
    out
}

/// `R` `Q4_K` rows against `N` tokens.
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
    unsafe { dot_q45_k::<false, R, N>(rows, acts) }
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
    unsafe { dot_q45_k::<true, R, N>(rows, acts) }
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
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    for b in 0..nb {
        // SAFETY: b < nb bounds the activations.
        let (qx, bsums) = unsafe { act_ptrs(&acts, b) };
        for r in 0..R {
            // SAFETY: b < nb bounds the block; the features are present per this
            // function's contract.
            let (d, sums) = unsafe {
                let block = rows[r].as_ptr().add(b * Q6_K_BYTES);
                (load_f16(block.add(208)), q6_k_ints::<N>(block, qx, bsums))
            };
            for t in 0..N {
                acc[r][t] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(sums[t]),
                    _mm256_set1_ps(d * acts[t].d[b]),
                    acc[r][t],
                );
            }
        }
    }
    let mut out = [[0.0f32; N]; R];
    for r in 0..R {
        for t in 0..N {
            out[r][t] = hsum_ps(acc[r][t]);
        }
    }
    out
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
        // SAFETY: the caller checked the lengths; the features are present, as calling
        // this function requires.
        unsafe {
            match ty {
                T::Q4_K => {
                    let ([sum], [min]) = q45_k_ints::<false, 1>(block, [qx], [bsums]);
                    (super::hsum_epi32(sum), min)
                }
                T::Q5_K => {
                    let ([sum], [min]) = q45_k_ints::<true, 1>(block, [qx], [bsums]);
                    (super::hsum_epi32(sum), min)
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
