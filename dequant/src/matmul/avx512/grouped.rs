//! AVX-512 kernels of `Q4_K` (the matrices llama.cpp repacks) and `Q6_K` on a whole
//! group of eight tokens of a batch ([`Q8KGroup`]): as `avx2::grouped`, with `vpdpbusd`
//! taking each four weights, broadcast, against the eight tokens' four activations
//! straight into i32 lanes, and the sub-block's sum then times its scale (`vpmulld`).

use std::arch::x86_64::*;

use crate::matmul::activation::{Q8KGroup, Q8KRow, BSUM_GROUP, QK_K};
use crate::matmul::avx2::grouped::{
    fused8, i16_pair, q4_k_rows, q6_k_rows, scales8, sum_pairs, Codes,
};

/// For each of four rows, `vpdpbusd` of `N` consecutive fours of its codes (from four
/// `k`), each broadcast, with the interleaved group's activations: lane `t` the row's
/// products with token `t`, summed in i32. Each four activations are loaded once for
/// the four rows.
///
/// # Safety
/// The CPU must support the AVX-512 path's features; the group's `32k .. 32(k + N)`
/// activation bytes must be readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn quads_dpbusd<const N: usize>(codes: &Codes, xs: *const i8, k: usize) -> [__m256i; 4] {
    let mut raw = [_mm256_setzero_si256(); 4];
    for i in k..k + N {
        // SAFETY: per the contract.
        let x = unsafe { _mm256_loadu_si256(xs.add(32 * i).cast()) };
        for (raw, codes) in raw.iter_mut().zip(&codes.0) {
            let w = i32::from_le_bytes([
                codes[4 * i],
                codes[4 * i + 1],
                codes[4 * i + 2],
                codes[4 * i + 3],
            ]);
            *raw = _mm256_dpbusd_epi32(*raw, _mm256_set1_epi32(w), x);
        }
    }
    raw
}

/// The repacked `Q4_K` GEMM's tile on a whole group of eight tokens, lane `t` token
/// `t`'s: each row's super-block unpacked to its 4-bit values once, `vpdpbusd` against
/// the interleaved group as in [`q6_k_grouped`], each sub-block's sum times its scale;
/// then, for each 64 values in order, the GEMM's float operations on the exact integers
/// (the two sub-blocks' sum fused at `d · dx`, their mins against the tokens' sums fused
/// at `dmin · dx`), and at the end one accumulator less the other.
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q4_k_grouped(
    rows: [&[u8]; 4],
    acts: &[Q8KRow<'_>; 8],
    group: Q8KGroup<'_>,
    nb: usize,
) -> [__m256; 4] {
    const SUMS: usize = QK_K / BSUM_GROUP;
    assert!(group.qs.len() >= nb * QK_K * 8 && group.bsums.len() >= nb * SUMS * 8);
    let mut codes = Codes([[0; QK_K]; 4]);
    let (mut sums, mut sum_mins) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
    for b in 0..nb {
        let dx = scales8(acts, b);
        // SAFETY: the assertion above bounds super-block b's activations and sums.
        let (xs, bsums) = unsafe {
            (
                group.qs.as_ptr().add(b * QK_K * 8),
                group.bsums.as_ptr().add(b * SUMS * 8),
            )
        };
        // SAFETY: as above.
        let pairs = unsafe { sum_pairs::<4>(bsums) };
        // SAFETY: b < nb bounds the rows' blocks.
        let (d, dmin, scales_mins) = unsafe { q4_k_rows(&rows, b, dx, &mut codes) };
        for (j, &pair) in pairs.iter().enumerate() {
            // SAFETY: values 64j .. 64j + 64 of the eight tokens, inside super-block b.
            let raw = unsafe {
                [
                    quads_dpbusd::<8>(&codes, xs, 16 * j),
                    quads_dpbusd::<8>(&codes, xs, 16 * j + 8),
                ]
            };
            #[allow(clippy::needless_range_loop)] // r picks the row's scales and sums alike
            for r in 0..4 {
                let (scales, mins) = scales_mins[r];
                let byte = |v: u64, k: usize| ((v >> (8 * k)) & 0xFF) as i32;
                let part = _mm256_add_epi32(
                    _mm256_mullo_epi32(raw[0][r], _mm256_set1_epi32(byte(scales, 2 * j))),
                    _mm256_mullo_epi32(raw[1][r], _mm256_set1_epi32(byte(scales, 2 * j + 1))),
                );
                let factors = i16_pair(byte(mins, 2 * j), byte(mins, 2 * j + 1));
                let min = _mm256_madd_epi16(pair, _mm256_set1_epi32(factors));
                sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part), d[r], sums[r]);
                sum_mins[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min), dmin[r], sum_mins[r]);
            }
        }
    }
    std::array::from_fn(|r| _mm256_sub_ps(sums[r], sum_mins[r]))
}

/// [`tile8_q6_k`] on a whole group of eight tokens: each row's super-block unpacked to
/// its 6-bit values (`q + 32`) once, then `vpdpbusd` multiplies each four of them,
/// broadcast, with the eight tokens' four activations of the interleaved group (one
/// 256-bit vector), so lane `t` of a row's accumulator sums token `t`'s products; per
/// group of 16 values that sum less `32 · bsum` times the group's scale joins the row's
/// integer total, exact as the other kernels' totals, which then takes the same float
/// step ([`gemm_step8`]'s: `d` times the total, fused at the token's scale).
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q6_k_grouped(
    rows: [&[u8]; 4],
    acts: &[Q8KRow<'_>; 8],
    group: Q8KGroup<'_>,
    nb: usize,
) -> [__m256; 4] {
    const SUMS: usize = QK_K / BSUM_GROUP;
    assert!(group.qs.len() >= nb * QK_K * 8 && group.bsums.len() >= nb * SUMS * 8);
    let mut codes = Codes([[0; QK_K]; 4]);
    let mut acc = [_mm256_setzero_ps(); 4];
    for b in 0..nb {
        let dx = scales8(acts, b);
        // SAFETY: b < nb bounds the rows' blocks.
        let (d, scales) = unsafe { q6_k_rows(&rows, b, &mut codes) };
        // SAFETY: the assertion above bounds super-block b's activations and sums.
        let (xs, sums) = unsafe {
            (
                group.qs.as_ptr().add(b * QK_K * 8),
                group.bsums.as_ptr().add(b * SUMS * 8),
            )
        };
        let mut total = [_mm256_setzero_si256(); 4];
        #[allow(clippy::needless_range_loop)] // g picks the scales and the activations too
        for g in 0..SUMS {
            // SAFETY: values 16g .. 16g + 16 of the eight tokens, inside super-block b.
            let raw = unsafe { quads_dpbusd::<4>(&codes, xs, 4 * g) };
            // SAFETY: sum g of the eight tokens, inside super-block b's.
            let bias =
                unsafe { _mm256_slli_epi32::<5>(_mm256_loadu_si256(sums.add(8 * g).cast())) };
            for r in 0..4 {
                let scale = scales[r][g];
                let part = _mm256_sub_epi32(raw[r], bias);
                total[r] =
                    _mm256_add_epi32(total[r], _mm256_mullo_epi32(part, _mm256_set1_epi32(scale)));
            }
        }
        for r in 0..4 {
            acc[r] = fused8(acc[r], d[r], total[r], dx);
        }
    }
    acc
}
