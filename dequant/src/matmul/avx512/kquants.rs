//! AVX-512 kernels of `Q4_K`, `Q5_K` and `Q6_K`: the AVX2 kernels' integers with half
//! the instructions, then their float operations.
//!
//! A 512-bit step covers 64 weights: for `Q4_K` the low nibbles of 32 bytes (in the low
//! 256 bits) and their high nibbles (in the high 256 bits), which are 64 consecutive
//! weights, from one broadcast load and a variable shift; for `Q6_K` 64 consecutive
//! weights from 64 bytes of `ql` and 32 of `qh`. `maddubs` multiplies them with 64
//! consecutive activations into i16 pair sums, as the AVX2 kernels do, and `vpdpwssd`
//! multiplies those by the sub-block's scale (one per 128-bit part for `Q6_K`'s groups
//! of 16, one per 256-bit half for `Q4_K`'s sub-blocks of 32) and adds them into i32
//! lanes. Lane `l` and lane `l + 8` then cover values `4l .. 4l + 4` of their 32 each,
//! so their sum is the AVX2 kernels' lane `l`.

use std::arch::x86_64::*;
use std::mem::offset_of;

use super::{hsum4_epi32_128, hsum4_epi32_512, hsum_epi32_512, spread_i16};
use crate::blocks::{BlockQ4_K, BlockQ5_K, BlockQ6_K};
use crate::matmul::activation::Q8KRow;
use crate::matmul::avx2::grouped::{gemm_step8, scales8};
use crate::matmul::avx2::kquants::{
    act_ptrs, blocks, f16_pair, k_scales_mins_bytes, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES,
};
use crate::matmul::avx2::{
    hsum_epi32, hsum_epi32_128, hsum_ps, join_tiles, lanes_of, lanes_of_128, lanes_of_epi32_128,
};

/// `Q4_K`/`Q5_K` super-block for each token: the scaled dot product
/// `Σ scale_j Σ q qx` in 16 i32 lanes (zeros with `SPLIT`; lanes `l` and `l + 8`
/// together are the AVX2 kernel's lane `l`), the min term `Σ min_j Σ qx` in four,
/// lane `k` the sub-blocks `2k` and `2k + 1`, and with `SPLIT` the dot product of each
/// 64 values (sub-blocks `2k`, `2k + 1`) in lane `k` (zeros without).
///
/// # Safety
/// The CPU must support the AVX-512 path's features; the super-block (`Q5_K` when
/// `FIVE`, else `Q4_K`) and 256 activations and 16 sums behind each pointer must be
/// readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q45_k_ints<const FIVE: bool, const SPLIT: bool, const N: usize>(
    block: *const u8,
    qx: [*const i8; N],
    bsums: [*const i16; N],
) -> ([__m512i; N], [__m128i; N], [__m128i; N]) {
    // The scales, qh and qs sit at the same offsets in both formats but qs.
    const _: () = assert!(offset_of!(BlockQ4_K, scales) == offset_of!(BlockQ5_K, scales));
    // SAFETY: the 12 scale bytes lie inside the readable block.
    let (scales, mins) = unsafe { k_scales_mins_bytes(block.add(offset_of!(BlockQ4_K, scales))) };
    let scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(scales as i64)));
    let mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins as i64));
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
    let low4 = _mm512_set1_epi8(0x0F);
    let halves = |lo: i16, hi: i16| {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi16(lo)),
            _mm256_set1_epi16(hi),
        )
    };
    // The low nibbles stay in the low 256 bits; the high ones come down in the high.
    let nibbles = halves(0, 4);
    // Bit 2j of qh[l] is the fifth bit of low value l, bit 2j + 1 of the high one.
    let (fifth, bit4) = (halves(4, 3), _mm512_set1_epi8(0x10));
    let (qs_at, mut high) = if FIVE {
        // SAFETY: Q5_K's qh (32 bytes) lies inside the readable block.
        let qh = unsafe { _mm256_loadu_si256(block.add(offset_of!(BlockQ5_K, qh)).cast()) };
        (offset_of!(BlockQ5_K, qs), _mm512_broadcast_i64x4(qh))
    } else {
        (offset_of!(BlockQ4_K, qs), _mm512_setzero_si512())
    };
    let mut dots = [_mm512_setzero_si512(); N];
    let mut parts = [[_mm512_setzero_si512(); 4]; N];
    #[allow(clippy::needless_range_loop)] // j picks the scales and the activations too
    for j in 0..4 {
        // SAFETY: the 32 bytes of chunk j lie inside the readable block.
        let packed = unsafe { _mm256_loadu_si256(block.add(qs_at + 32 * j).cast()) };
        // Values 64j .. 64j + 64: sub-block 2j low, 2j + 1 high.
        let mut q = _mm512_and_si512(
            _mm512_srlv_epi16(_mm512_broadcast_i64x4(packed), nibbles),
            low4,
        );
        if FIVE {
            q = _mm512_or_si512(q, _mm512_and_si512(_mm512_sllv_epi16(high, fifth), bit4));
            high = _mm512_srli_epi16::<2>(high);
        }
        let (lo, hi) = (2 * j as i16, 2 * j as i16 + 1);
        let scale = _mm512_permutexvar_epi16(spread_i16([lo, lo, hi, hi]), scales);
        for t in 0..N {
            // SAFETY: 256 activations are readable behind each pointer per the contract.
            let x = unsafe { _mm512_loadu_si512(qx[t].add(64 * j).cast()) };
            let pairs = _mm512_maddubs_epi16(q, x);
            if SPLIT {
                parts[t][j] = _mm512_madd_epi16(pairs, scale);
            } else {
                dots[t] = _mm512_dpwssd_epi32(dots[t], pairs, scale);
            }
        }
    }
    let split = parts.map(|p| {
        if SPLIT {
            hsum4_epi32_512(p)
        } else {
            _mm_setzero_si128()
        }
    });
    (dots, min_sums, split)
}

/// `R` `Q4_K` rows against `N` tokens, of a matrix llama.cpp repacks (a multiple of 8
/// rows): `avx2::kquants::dot_q4_k_packed`'s float operations on the same integers.
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_k_packed<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    if let (Ok(four), [act]) = (<[&[u8]; 4]>::try_from(&rows[..]), &acts[..]) {
        if !act.packed_gemm {
            // SAFETY: the features are present per this function's contract.
            let dots = unsafe { q4_k_gemv4(four, *act) };
            let mut out = [[0.0f32; N]; R];
            for (out, dot) in out.iter_mut().zip(dots) {
                out[0] = dot;
            }
            return out;
        }
    }
    if let ([row], Ok(four)) = (&rows[..], <[Q8KRow<'_>; 4]>::try_from(&acts[..])) {
        if four.iter().all(|a| a.packed_gemm) {
            // SAFETY: the features are present per this function's contract.
            let dots = unsafe { q4_k_gemm4(row, four) };
            let mut out = [[0.0f32; N]; R];
            out[0].copy_from_slice(&dots);
            return out;
        }
    }
    if acts.iter().any(|a| a.packed_gemm) {
        // SAFETY: the features are present per this function's contract.
        unsafe { q4_k_packed::<true, R, N>(rows, acts) }
    } else {
        // SAFETY: the features are present per this function's contract.
        unsafe { q4_k_packed::<false, R, N>(rows, acts) }
    }
}

/// [`dot_q4_k_packed`], with each 64 values' sums apart (`SPLIT`, which the tokens of
/// the repacked GEMM need) or not (the GEMV's tokens only).
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_k_packed<const SPLIT: bool, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    let nb = blocks(&rows, Q4_K_BYTES, &acts);
    let mut out = [[0.0f32; N]; R];
    for r in 0..R {
        let mut sum = [0.0f32; N];
        let mut sum_min = [0.0f32; N];
        for b in 0..nb {
            // SAFETY: b < nb bounds the block and the activations; the features are
            // present per this function's contract.
            let (d_dmin, (dots, min_sums, parts)) = unsafe {
                let (qx, bsums) = act_ptrs(&acts, b);
                let block = rows[r].as_ptr().add(b * Q4_K_BYTES);
                (
                    f16_pair(block),
                    q45_k_ints::<false, SPLIT, N>(block, qx, bsums),
                )
            };
            for t in 0..N {
                let d = lanes_of_128(_mm_mul_ps(d_dmin, _mm_set1_ps(acts[t].d[b])));
                if acts[t].packed_gemm {
                    // The GEMM adds each 64 values' sums on their own.
                    let (parts, mins) = (
                        lanes_of_epi32_128(parts[t]),
                        lanes_of_epi32_128(min_sums[t]),
                    );
                    for j in 0..4 {
                        sum[t] = (parts[j] as f32).mul_add(d[0], sum[t]);
                        sum_min[t] = (mins[j] as f32).mul_add(d[1], sum_min[t]);
                    }
                } else {
                    // The GEMV adds each super-block's sums at once.
                    let total = if SPLIT {
                        hsum_epi32_128(parts[t])
                    } else {
                        hsum_epi32_512(dots[t])
                    };
                    sum[t] = (total as f32).mul_add(d[0], sum[t]);
                    sum_min[t] = (hsum_epi32_128(min_sums[t]) as f32).mul_add(d[1], sum_min[t]);
                }
            }
        }
        for t in 0..N {
            out[r][t] = sum[t] - sum_min[t];
        }
    }
    out
}

/// Four `Q4_K` rows (of a matrix llama.cpp repacks) against one token of its GEMV: each
/// super-block's integers for the four rows side by side, its activations loaded once
/// for them, and the GEMV's float operations on the four lanes of one vector (for each
/// row, its super-block's sums fused at `d · dx` and its mins at `dmin · dx`, in block
/// order, then one subtracted from the other), each lane the single row's operations.
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_k_gemv4(rows: [&[u8]; 4], act: Q8KRow<'_>) -> [f32; 4] {
    let acts = [act];
    let nb = blocks(&rows, Q4_K_BYTES, &acts);
    let low4 = _mm512_set1_epi8(0x0F);
    // The 32 values of a sub-block in each 256-bit half: sub-blocks (0, 2), (1, 3),
    // (4, 6), (5, 7), as the low and high nibbles of 64 bytes of qs hold them.
    let picks = [(0, 2), (1, 3), (4, 6), (5, 7)].map(|(a, b)| spread_i16([a, a, b, b]));
    // Each lane's d · dx, then dmin · dx, from the interleaved pairs of the four rows.
    let deinterleave = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    let (mut sums, mut sum_mins) = (_mm_setzero_ps(), _mm_setzero_ps());
    for b in 0..nb {
        // SAFETY: b < nb bounds the activations.
        let ([qx], [bsums]) = unsafe { act_ptrs(&acts, b) };
        // SAFETY: 256 activations and 16 sums are readable behind the pointers.
        let (x, sums16) = unsafe {
            (
                [0, 64, 128, 192].map(|at| _mm512_loadu_si512(qx.add(at).cast())),
                _mm256_loadu_si256(bsums.cast()),
            )
        };
        // Sub-blocks (0, 2), (1, 3), (4, 6), (5, 7) of the activations.
        let x = [
            _mm512_shuffle_i64x2::<0x44>(x[0], x[1]),
            _mm512_shuffle_i64x2::<0xEE>(x[0], x[1]),
            _mm512_shuffle_i64x2::<0x44>(x[2], x[3]),
            _mm512_shuffle_i64x2::<0xEE>(x[2], x[3]),
        ];
        // Sums of 32 values of |q| ≤ 127 fit an i16.
        let pairs = _mm_hadd_epi16(
            _mm256_castsi256_si128(sums16),
            _mm256_extracti128_si256::<1>(sums16),
        );
        let mut dots = [_mm512_setzero_si512(); 4];
        let mut min_sums = [_mm_setzero_si128(); 4];
        let mut d_dmin = [0i32; 4];
        for r in 0..4 {
            // SAFETY: b < nb bounds the block, whose fields these read.
            let ((scales, mins), q) = unsafe {
                let block = rows[r].as_ptr().add(b * Q4_K_BYTES);
                let qs = block.add(offset_of!(BlockQ4_K, qs));
                d_dmin[r] = block.cast::<i32>().read_unaligned();
                (
                    k_scales_mins_bytes(block.add(offset_of!(BlockQ4_K, scales))),
                    [
                        _mm512_loadu_si512(qs.cast()),
                        _mm512_loadu_si512(qs.add(64).cast()),
                    ],
                )
            };
            let scales =
                _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(scales as i64)));
            let mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins as i64));
            min_sums[r] = _mm_madd_epi16(mins, pairs);
            let values = [
                _mm512_and_si512(q[0], low4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(q[0]), low4),
                _mm512_and_si512(q[1], low4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(q[1]), low4),
            ];
            for k in 0..4 {
                let scale = _mm512_permutexvar_epi16(picks[k], scales);
                let pairs = _mm512_maddubs_epi16(values[k], x[k]);
                dots[r] = _mm512_dpwssd_epi32(dots[r], pairs, scale);
            }
        }
        let totals = _mm_cvtepi32_ps(hsum4_epi32_512(dots));
        let mins = _mm_cvtepi32_ps(hsum4_epi32_128(min_sums));
        // The rows' (d, dmin) · dx, as the single-row kernel's one product each.
        let d_dmin = _mm256_cvtph_ps(_mm_setr_epi32(d_dmin[0], d_dmin[1], d_dmin[2], d_dmin[3]));
        let scaled = _mm256_permutevar8x32_ps(
            _mm256_mul_ps(d_dmin, _mm256_set1_ps(act.d[b])),
            deinterleave,
        );
        sums = _mm_fmadd_ps(totals, _mm256_castps256_ps128(scaled), sums);
        sum_mins = _mm_fmadd_ps(mins, _mm256_extractf128_ps::<1>(scaled), sum_mins);
    }
    lanes_of_128(_mm_sub_ps(sums, sum_mins))
}

/// One `Q4_K` row (of a matrix llama.cpp repacks) against a group of four tokens of its
/// GEMM: the GEMM's float operations (for each token, each 64 values' sums fused at
/// `d · dx` in order, the mins at `dmin · dx`, then one subtracted from the other) on
/// the four lanes of one vector, each lane a token's operations.
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_k_gemm4(row: &[u8], acts: [Q8KRow<'_>; 4]) -> [f32; 4] {
    let nb = blocks(&[row], Q4_K_BYTES, &acts);
    let low4 = _mm512_set1_epi8(0x0F);
    // The low nibbles stay in the low 256 bits; the high ones come down in the high.
    let nibbles = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
    let picks = [0, 1, 2, 3].map(|j| spread_i16([2 * j, 2 * j, 2 * j + 1, 2 * j + 1]));
    let (mut sums, mut sum_mins) = (_mm_setzero_ps(), _mm_setzero_ps());
    for b in 0..nb {
        // SAFETY: b < nb bounds the block and the activations; the block's fields and
        // 256 activations and 16 sums behind each pointer are readable.
        let (d_dmin, (scales, mins), qs, (qx, bsums)) = unsafe {
            let block = row.as_ptr().add(b * Q4_K_BYTES);
            (
                lanes_of_128(f16_pair(block)),
                k_scales_mins_bytes(block.add(offset_of!(BlockQ4_K, scales))),
                block.add(offset_of!(BlockQ4_K, qs)),
                act_ptrs(&acts, b),
            )
        };
        let dx = _mm_setr_ps(acts[0].d[b], acts[1].d[b], acts[2].d[b], acts[3].d[b]);
        let (d, dmin) = (
            _mm_mul_ps(_mm_set1_ps(d_dmin[0]), dx),
            _mm_mul_ps(_mm_set1_ps(d_dmin[1]), dx),
        );
        let scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(scales as i64)));
        let mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins as i64));
        let min_sums = bsums.map(|bsums| {
            // SAFETY: 16 sums are readable behind each pointer.
            let sums16 = unsafe { _mm256_loadu_si256(bsums.cast()) };
            // Sums of 32 values of |q| ≤ 127 fit an i16.
            let pairs = _mm_hadd_epi16(
                _mm256_castsi256_si128(sums16),
                _mm256_extracti128_si256::<1>(sums16),
            );
            _mm_madd_epi16(mins, pairs)
        });
        for (j, pick) in picks.iter().enumerate() {
            // SAFETY: the 32 bytes of chunk j lie inside the block.
            let packed = unsafe { _mm256_loadu_si256(qs.add(32 * j).cast()) };
            let q = _mm512_and_si512(
                _mm512_srlv_epi16(_mm512_broadcast_i64x4(packed), nibbles),
                low4,
            );
            let scale = _mm512_permutexvar_epi16(*pick, scales);
            let parts = qx.map(|qx| {
                // SAFETY: 256 activations are readable behind each pointer.
                let x = unsafe { _mm512_loadu_si512(qx.add(64 * j).cast()) };
                _mm512_madd_epi16(_mm512_maddubs_epi16(q, x), scale)
            });
            let part = _mm_cvtepi32_ps(hsum4_epi32_512(parts));
            sums = _mm_fmadd_ps(part, d, sums);
        }
        // The mins of sub-blocks 2j and 2j + 1 for each token: min_sums' lanes j.
        let (lo, hi) = (
            [
                _mm_unpacklo_epi32(min_sums[0], min_sums[1]),
                _mm_unpacklo_epi32(min_sums[2], min_sums[3]),
            ],
            [
                _mm_unpackhi_epi32(min_sums[0], min_sums[1]),
                _mm_unpackhi_epi32(min_sums[2], min_sums[3]),
            ],
        );
        for m in [
            _mm_unpacklo_epi64(lo[0], lo[1]),
            _mm_unpackhi_epi64(lo[0], lo[1]),
            _mm_unpacklo_epi64(hi[0], hi[1]),
            _mm_unpackhi_epi64(hi[0], hi[1]),
        ] {
            sum_mins = _mm_fmadd_ps(_mm_cvtepi32_ps(m), dmin, sum_mins);
        }
    }
    lanes_of_128(_mm_sub_ps(sums, sum_mins))
}

/// `R` `Q4_K`/`Q5_K` rows against `N` tokens, of matrices llama.cpp does not repack:
/// `avx2::kquants::dot_q45_k`'s float operations on the same integers (its dot
/// product's eight lanes for single tokens, its tiled GEMM's per super-block sums for
/// batches of [`GEMM_MIN_TOKENS`](crate::matmul::activation::GEMM_MIN_TOKENS) or more).
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q45_k<const FIVE: bool, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    let bytes = if FIVE { Q5_K_BYTES } else { Q4_K_BYTES };
    let nb = blocks(&rows, bytes, &acts);
    let mut out = [[0.0f32; N]; R];
    for r in 0..R {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut acc_min = [_mm_setzero_ps(); N];
        // The tiled GEMM's single accumulator.
        let mut sum = [0.0f32; N];
        // `Q5_K`'s dot product's scalar of mins.
        let mut sum_min = [0.0f32; N];
        for b in 0..nb {
            // SAFETY: b < nb bounds the block and the activations; the features are
            // present per this function's contract.
            let (d_dmin, (dots, min_sums, _)) = unsafe {
                let (qx, bsums) = act_ptrs(&acts, b);
                let block = rows[r].as_ptr().add(b * bytes);
                (
                    f16_pair(block),
                    q45_k_ints::<FIVE, false, N>(block, qx, bsums),
                )
            };
            for t in 0..N {
                if acts[t].gemm {
                    let w = lanes_of_128(d_dmin);
                    let main = w[0] * hsum_epi32_512(dots[t]) as f32;
                    let res = (-w[1]).mul_add(hsum_epi32_128(min_sums[t]) as f32, main);
                    sum[t] = res.mul_add(acts[t].d[b], sum[t]);
                    continue;
                }
                let scaled = _mm_mul_ps(d_dmin, _mm_set1_ps(acts[t].d[b]));
                let d = _mm256_broadcastss_ps(scaled);
                let lanes = _mm256_add_epi32(
                    _mm512_castsi512_si256(dots[t]),
                    _mm512_extracti64x4_epi64::<1>(dots[t]),
                );
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), d, acc[t]);
                if FIVE {
                    // Q5_K's dot product sums each super-block's mins and fuses them
                    // at −dx · dmin into one scalar.
                    let dmin = -lanes_of_128(scaled)[1];
                    let total = hsum_epi32_128(min_sums[t]) as f32;
                    sum_min[t] = dmin.mul_add(total, sum_min[t]);
                } else {
                    let dmin = _mm_permute_ps::<0b01_01_01_01>(scaled);
                    let mins = _mm_cvtepi32_ps(min_sums[t]);
                    acc_min[t] = _mm_fmadd_ps(mins, dmin, acc_min[t]);
                }
            }
        }
        for t in 0..N {
            out[r][t] = if acts[t].gemm {
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

/// `R` `Q4_K` rows against `N` tokens, of a matrix llama.cpp does not repack.
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q5_k<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_q45_k::<true, R, N>(rows, acts) }
}

/// The 6-bit values (`q + 32`, in `0..64`) of half `half` of a `Q6_K` super-block, in
/// order: values `128 · half .. + 64` in the first vector, the next 64 in the second.
///
/// # Safety
/// The CPU must support the AVX-512 path's features; the super-block must be readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6_k_values(block: *const u8, half: usize) -> [__m512i; 2] {
    let (ql_at, qh_at) = (offset_of!(BlockQ6_K, ql), offset_of!(BlockQ6_K, qh));
    let low4 = _mm512_set1_epi8(0x0F);
    let bits45 = _mm512_set1_epi8(0x30);
    // qh's bits for values 0..32 and 32..64 of each 128 (shifted left), and for values
    // 64..96 and 96..128 (shifted right), in the low and high 256 bits.
    let halves = |lo: i16, hi: i16| {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi16(lo)),
            _mm256_set1_epi16(hi),
        )
    };
    let (left, right) = (halves(4, 2), halves(0, 2));
    // SAFETY: ql and qh lie inside the readable block.
    let (ql, qh) = unsafe {
        (
            _mm512_loadu_si512(block.add(ql_at + 64 * half).cast()),
            _mm512_broadcast_i64x4(_mm256_loadu_si256(block.add(qh_at + 32 * half).cast())),
        )
    };
    // Values 32k + l take the low or high nibble of ql and bits 2k, 2k + 1 of qh[l].
    [
        _mm512_or_si512(
            _mm512_and_si512(ql, low4),
            _mm512_and_si512(_mm512_sllv_epi16(qh, left), bits45),
        ),
        _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(ql), low4),
            _mm512_and_si512(_mm512_srlv_epi16(qh, right), bits45),
        ),
    ]
}

/// `Q6_K` super-block for each token: `Σ scale_g Σ (q - 32) qx` in the AVX2 kernel's
/// eight i32 lanes.
///
/// # Safety
/// The CPU must support the AVX-512 path's features; the super-block and 256
/// activations and 16 sums behind each pointer must be readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6_k_ints<const N: usize>(
    block: *const u8,
    qx: [*const i8; N],
    bsums: [*const i16; N],
) -> [__m256i; N] {
    // SAFETY: the 16 signed scales lie inside the readable block.
    let scales = unsafe { _mm_loadu_si128(block.add(offset_of!(BlockQ6_K, scales)).cast()) };
    let scales = _mm256_cvtepi8_epi16(scales);
    let scales32 = _mm256_slli_epi16::<5>(scales);
    let scales = _mm512_castsi256_si512(scales);
    let mut dots = [_mm512_setzero_si512(); N];
    for half in 0..2 {
        // SAFETY: the block is readable per this function's contract.
        let values = unsafe { q6_k_values(block, half) };
        for (k, &q) in values.iter().enumerate() {
            // Values 64k .. 64k + 64 of this half: groups 8·half + 4k .. + 4, one a
            // 128-bit part.
            let g = (8 * half + 4 * k) as i16;
            let scale = _mm512_permutexvar_epi16(spread_i16([g, g + 1, g + 2, g + 3]), scales);
            for t in 0..N {
                // SAFETY: 256 activations are readable behind each pointer.
                let x = unsafe { _mm512_loadu_si512(qx[t].add(128 * half + 64 * k).cast()) };
                dots[t] = _mm512_dpwssd_epi32(dots[t], _mm512_maddubs_epi16(q, x), scale);
            }
        }
    }
    let mut lanes = [_mm256_setzero_si256(); N];
    for t in 0..N {
        // The offset: -32 Σ scale_g bsum_g, spread over the lanes by pairs of groups
        // (as the AVX2 kernel spreads it).
        // SAFETY: 16 sums are readable behind each pointer per the contract.
        let sums = unsafe { _mm256_loadu_si256(bsums[t].cast()) };
        let folded = _mm256_add_epi32(
            _mm512_castsi512_si256(dots[t]),
            _mm512_extracti64x4_epi64::<1>(dots[t]),
        );
        lanes[t] = _mm256_sub_epi32(folded, _mm256_madd_epi16(scales32, sums));
    }
    lanes
}

/// `R` `Q6_K` rows against `N` tokens: `avx2::kquants::dot_q6_k`'s float operations on
/// the same integer lanes.
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q6_k<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    let nb = blocks(&rows, Q6_K_BYTES, &acts);
    let mut out = [[0.0f32; N]; R];
    // One row after another, as the AVX2 kernel.
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
                    crate::matmul::avx2::load_f16(block.add(offset_of!(BlockQ6_K, d))),
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

/// Four `Q6_K` rows against eight tokens: `avx2::kquants::tile8_q6_k` on this path's
/// integers (the AVX2 kernel's lanes), so every row and token gets the bits of
/// [`dot_q6_k`].
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn tile8_q6_k(rows: [&[u8]; 4], acts: [Q8KRow<'_>; 8]) -> [[f32; 8]; 4] {
    if !acts.iter().all(|a| a.gemm) {
        let [a0, a1, a2, a3, a4, a5, a6, a7] = acts;
        // SAFETY: the features are present per this function's contract.
        let tile = |acts| rows.map(|row| unsafe { dot_q6_k::<1, 4>([row], acts) }[0]);
        return join_tiles(tile([a0, a1, a2, a3]), tile([a4, a5, a6, a7]));
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
                    crate::matmul::avx2::load_f16(block.add(offset_of!(BlockQ6_K, d))),
                    q6_k_ints::<8>(block, qx, bsums),
                )
            };
            acc[r] = gemm_step8(acc[r], d, dots, dx);
        }
    }
    acc.map(|v| lanes_of(v))
}

/// Four rows of a `Q4_K` matrix llama.cpp repacks against eight tokens: on a whole
/// group of eight tokens that its repacked GEMM takes, [`q4_k_grouped`]; otherwise
/// `avx2::kquants::tile8_q4_k_packed`. Both give the bits of [`dot_q4_k_packed`].
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn tile8_q4_k_packed(rows: [&[u8]; 4], acts: [Q8KRow<'_>; 8]) -> [[f32; 8]; 4] {
    if acts.iter().all(|a| a.packed_gemm) {
        if let Some(group) = acts[0].group.filter(|g| g.covers(&acts)) {
            let nb = blocks(&rows, Q4_K_BYTES, &acts);
            // SAFETY: the features are present per this function's contract.
            return unsafe { super::grouped::q4_k_grouped(rows, &acts, group.get(), nb) }
                .map(|v| lanes_of(v));
        }
    }
    // SAFETY: the AVX-512 path's features include the AVX2 kernel's.
    unsafe { crate::matmul::avx2::kquants::tile8_q4_k_packed(rows, acts) }
}

/// The integers of one `Q4_K` super-block, summed over the lanes, as the AVX2 kernel's
/// `block_ints` returns them: `(dot, min)`, from the GEMV's single sum, checked against
/// the GEMM's sums of each 64 values, whose totals must agree.
#[cfg(test)]
pub(crate) fn q4_k_block_ints(
    _proof: super::Avx512,
    block: &[u8],
    qx: &[i8],
    bsums: &[i16],
) -> (i32, i32) {
    use crate::matmul::activation::QK_K;
    use crate::matmul::avx2::kquants::GROUPS;
    assert!(qx.len() >= QK_K && bsums.len() >= GROUPS && block.len() >= Q4_K_BYTES);
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn ints(block: *const u8, qx: *const i8, bsums: *const i16) -> (i32, i32) {
        // SAFETY: the caller checked the lengths; the features are present, as calling
        // this function requires.
        let (([dot], [min], _), (_, [min_split], [parts])) = unsafe {
            (
                q45_k_ints::<false, false, 1>(block, [qx], [bsums]),
                q45_k_ints::<false, true, 1>(block, [qx], [bsums]),
            )
        };
        let (dot, min) = (hsum_epi32_512(dot), hsum_epi32_128(min));
        assert_eq!(hsum_epi32_128(parts), dot, "the GEMM's parts");
        assert_eq!(hsum_epi32_128(min_split), min, "the GEMM's mins");
        (dot, min)
    }
    // SAFETY: `_proof` shows the CPU has the features.
    unsafe { ints(block.as_ptr(), qx.as_ptr(), bsums.as_ptr()) }
}

/// The eight integer lanes of one `Q6_K` super-block, which the AVX2 kernel's must
/// equal one by one (its single-token products fuse them lane by lane).
#[cfg(test)]
pub(crate) fn q6_k_block_lanes(
    _proof: super::Avx512,
    block: &[u8],
    qx: &[i8],
    bsums: &[i16],
) -> [i32; 8] {
    use crate::matmul::activation::QK_K;
    use crate::matmul::avx2::kquants::GROUPS;
    assert!(qx.len() >= QK_K && bsums.len() >= GROUPS && block.len() >= Q6_K_BYTES);
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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

/// The integer lanes of one `Q4_K` (`five` false) or `Q5_K` super-block, folded as the
/// plain kernels fold them: the dot product's eight lanes and the mins' four, which
/// the AVX2 kernel's must equal one by one (its single-token products fuse them lane
/// by lane).
#[cfg(test)]
pub(crate) fn q45_k_block_lanes(
    _proof: super::Avx512,
    five: bool,
    block: &[u8],
    qx: &[i8],
    bsums: &[i16],
) -> ([i32; 8], [i32; 4]) {
    use crate::matmul::activation::QK_K;
    use crate::matmul::avx2::kquants::GROUPS;
    let bytes = if five { Q5_K_BYTES } else { Q4_K_BYTES };
    assert!(qx.len() >= QK_K && bsums.len() >= GROUPS && block.len() >= bytes);
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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
        let folded = _mm256_add_epi32(
            _mm512_castsi512_si256(dots),
            _mm512_extracti64x4_epi64::<1>(dots),
        );
        let mut out = [0i32; 8];
        // SAFETY: `out` holds eight i32; `storeu` has no alignment requirement.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), folded) };
        (out, lanes_of_epi32_128(mins))
    }
    // SAFETY: `_proof` shows the CPU has the features.
    unsafe { lanes(five, block.as_ptr(), qx.as_ptr(), bsums.as_ptr()) }
}
