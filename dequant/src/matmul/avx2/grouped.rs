//! AVX2 kernels of `Q4_K` (the matrices llama.cpp repacks) and `Q6_K` on a whole group
//! of eight tokens of a batch ([`Q8KGroup`]): each row's super-block unpacked to one
//! byte a weight once, and each four weights, broadcast, against the eight tokens' four
//! activations side by side in one `maddubs`, so that lane `t` of every vector is token
//! `t`'s and the GEMM's float steps need no reduction across lanes first. The integers
//! are the other kernels' exact sums; the float operations are theirs, lane by lane.

use std::arch::x86_64::*;
use std::mem::offset_of;

use super::kquants::{
    f16_pair, hsum8_epi32, k_scales_mins_bytes, q6_k_values, GROUPS, Q4_K_BYTES, Q6_K_BYTES,
};
use super::{lanes_of_128, load32};
use crate::blocks::{BlockQ4_K, BlockQ6_K};
use crate::matmul::activation::{Q8KGroup, Q8KRow, QK_K};

/// Token `t`'s activation scale of super-block `b`, for each of eight tokens: lane `t`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn scales8(acts: &[Q8KRow<'_>; 8], b: usize) -> __m256 {
    _mm256_setr_ps(
        acts[0].d[b],
        acts[1].d[b],
        acts[2].d[b],
        acts[3].d[b],
        acts[4].d[b],
        acts[5].d[b],
        acts[6].d[b],
        acts[7].d[b],
    )
}

/// One super-block's step of llama.cpp's tiled GEMM for one row and eight tokens, lane
/// `t` token `t`'s: the integer sum of each token's eight lanes `dots[t]`, rounded at
/// `d`, fused at the token's scale `dx` into `acc` (for each lane, `dot_q6_k`'s scalar
/// `(d · Σ).mul_add(dx, acc)`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn gemm_step8(acc: __m256, d: f32, dots: [__m256i; 8], dx: __m256) -> __m256 {
    fused8(acc, d, hsum8_epi32(dots), dx)
}

/// [`gemm_step8`] on the eight tokens' integer totals, lane `t` token `t`'s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn fused8(acc: __m256, d: f32, totals: __m256i, dx: __m256) -> __m256 {
    let scaled = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(totals));
    _mm256_fmadd_ps(scaled, dx, acc)
}

/// A super-block's 256 weights of four rows as unsigned bytes, row after row, for the
/// kernels on a [`Q8KGroup`], which broadcast four of them at a time.
#[repr(C, align(64))]
pub(crate) struct Codes(pub [[u8; QK_K]; 4]);

/// Writes the 4-bit values of a `Q4_K` super-block to `out`, in order: sub-block 2j
/// is the low nibbles of bytes `32j .. 32j + 32` of `qs`, sub-block 2j + 1 their high
/// ones.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the super-block must be readable and 256
/// bytes writable at `out`, 32-byte aligned.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_k_codes(block: *const u8, out: *mut u8) {
    let low4 = _mm256_set1_epi8(0x0F);
    for j in 0..4 {
        // SAFETY: per the contract.
        unsafe {
            let packed = load32(block.add(offset_of!(BlockQ4_K, qs) + 32 * j));
            _mm256_store_si256(out.add(64 * j).cast(), _mm256_and_si256(packed, low4));
            _mm256_store_si256(
                out.add(64 * j + 32).cast(),
                _mm256_and_si256(_mm256_srli_epi16::<4>(packed), low4),
            );
        }
    }
}

/// Each token's sums of groups `2i` and `2i + 1` of 16 of super-block `b`'s sums in a
/// [`Q8KGroup`] (`step` 1), or of sub-blocks `2i` and `2i + 1` of 32 (`step` 2, each
/// the sum of two groups), as one i16 pair a lane (sums of at most 32 values of
/// magnitude 127 fit): lane `t` of vector `i`, token `t`'s pair.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `bsums` must point at super-block `b`'s
/// 16 · 8 sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn sum_pairs<const PAIRS: usize>(bsums: *const i32) -> [__m256i; PAIRS] {
    let step = 8 / PAIRS;
    // SAFETY: 16 vectors of eight sums are readable per the contract.
    let sum = |k: usize| unsafe {
        (0..step).fold(_mm256_setzero_si256(), |acc, i| {
            _mm256_add_epi32(
                acc,
                _mm256_loadu_si256(bsums.add(8 * (step * k + i)).cast()),
            )
        })
    };
    std::array::from_fn(|i| {
        _mm256_or_si256(
            _mm256_and_si256(sum(2 * i), _mm256_set1_epi32(0xFFFF)),
            _mm256_slli_epi32::<16>(sum(2 * i + 1)),
        )
    })
}

/// The i16 pair `(lo, hi)` as one i32, for `madd` against [`sum_pairs`].
#[inline(always)]
pub(crate) fn i16_pair(lo: i32, hi: i32) -> i32 {
    (lo as i16 as u16 as u32 | (u32::from(hi as i16 as u16) << 16)) as i32
}

/// For each of four rows, the products of `N` consecutive fours of its codes (from
/// four `k`) with the interleaved group's activations, summed in i16 lanes, two a token
/// (each `maddubs` lane at most `2 · 63 · 127`; the callers bound `N` so the sums cannot
/// wrap). Each four activations are loaded once for the four rows.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; codes `4k .. 4(k + N)` of each row and the
/// group's `32k .. 32(k + N)` activation bytes must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quads_i16<const N: usize>(codes: &Codes, xs: *const i8, k: usize) -> [__m256i; 4] {
    let mut sums = [_mm256_setzero_si256(); 4];
    for i in k..k + N {
        // SAFETY: per the contract.
        let x = unsafe { load32(xs.add(32 * i).cast()) };
        for (sum, codes) in sums.iter_mut().zip(&codes.0) {
            let w = i32::from_le_bytes([
                codes[4 * i],
                codes[4 * i + 1],
                codes[4 * i + 2],
                codes[4 * i + 3],
            ]);
            *sum = _mm256_add_epi16(*sum, _mm256_maddubs_epi16(_mm256_set1_epi32(w), x));
        }
    }
    sums
}

/// Super-block `b` of four `Q6_K` rows for a grouped tile: each row's `d` and 16
/// scales, and its values (`q + 32`) unpacked into `codes`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; each row must hold super-block `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q6_k_rows(
    rows: &[&[u8]; 4],
    b: usize,
    codes: &mut Codes,
) -> ([f32; 4], [[i32; GROUPS]; 4]) {
    let mut d = [0.0f32; 4];
    let mut scales = [[0i32; GROUPS]; 4];
    for r in 0..4 {
        // SAFETY: the block is readable per the contract; `codes` holds 256 bytes a row.
        unsafe {
            let block = rows[r].as_ptr().add(b * Q6_K_BYTES);
            d[r] = super::load_f16(block.add(offset_of!(BlockQ6_K, d)));
            let at = block.add(offset_of!(BlockQ6_K, scales)).cast::<i8>();
            scales[r] = std::array::from_fn(|g| i32::from(at.add(g).read()));
            q6_k_codes(block, codes.0[r].as_mut_ptr());
        }
    }
    (d, scales)
}

/// Super-block `b` of four `Q4_K` rows for a grouped tile: each row's `d · dx` and
/// `dmin · dx` (lane `t` token `t`'s, as the GEMM rounds them), its scales and mins a
/// byte each, and its values unpacked into `codes`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; each row must hold super-block `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_k_rows(
    rows: &[&[u8]; 4],
    b: usize,
    dx: __m256,
    codes: &mut Codes,
) -> ([__m256; 4], [__m256; 4], [(u64, u64); 4]) {
    let mut d = [_mm256_setzero_ps(); 4];
    let mut dmin = [_mm256_setzero_ps(); 4];
    let mut scales_mins = [(0u64, 0u64); 4];
    for r in 0..4 {
        // SAFETY: the block is readable per the contract; `codes` holds 256 bytes a row.
        unsafe {
            let block = rows[r].as_ptr().add(b * Q4_K_BYTES);
            let d_dmin = lanes_of_128(f16_pair(block));
            d[r] = _mm256_mul_ps(_mm256_set1_ps(d_dmin[0]), dx);
            dmin[r] = _mm256_mul_ps(_mm256_set1_ps(d_dmin[1]), dx);
            scales_mins[r] = k_scales_mins_bytes(block.add(offset_of!(BlockQ4_K, scales)));
            q4_k_codes(block, codes.0[r].as_mut_ptr());
        }
    }
    (d, dmin, scales_mins)
}

/// [`tile8_q6_k`] on a whole group of eight tokens, lane `t` token `t`'s: each row's
/// super-block unpacked to its 6-bit values (`q + 32`) once; each four of them,
/// broadcast, meet the eight tokens' four activations in one `maddubs`, two of those
/// summed in i16 and a `madd` against the group's scale gives `scale · Σ q qx` in
/// i32; the offset `32 · Σ scale bsum` comes from `madd`s of the scales' pairs against
/// the sums' ([`sum_pairs`]). The integer totals are the other kernels' (exact), and
/// take the same float step ([`fused8`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q6_k_grouped(
    rows: [&[u8]; 4],
    acts: &[Q8KRow<'_>; 8],
    group: Q8KGroup<'_>,
    nb: usize,
) -> [__m256; 4] {
    assert!(group.qs.len() >= nb * QK_K * 8 && group.bsums.len() >= nb * GROUPS * 8);
    let mut codes = Codes([[0; QK_K]; 4]);
    let mut acc = [_mm256_setzero_ps(); 4];
    for b in 0..nb {
        let dx = scales8(acts, b);
        // SAFETY: the assertion above bounds super-block b's activations and sums.
        let (xs, pairs) = unsafe {
            (
                group.qs.as_ptr().add(b * QK_K * 8),
                sum_pairs::<8>(group.bsums.as_ptr().add(b * GROUPS * 8)),
            )
        };
        // SAFETY: b < nb bounds the rows' blocks.
        let (d, scales) = unsafe { q6_k_rows(&rows, b, &mut codes) };
        let mut total = [_mm256_setzero_si256(); 4];
        #[allow(clippy::needless_range_loop)] // g picks the scales and the activations too
        for g in 0..GROUPS {
            // SAFETY: values 16g .. 16g + 16 of the eight tokens, inside super-block b.
            let halves = unsafe {
                [
                    quads_i16::<2>(&codes, xs, 4 * g),
                    quads_i16::<2>(&codes, xs, 4 * g + 2),
                ]
            };
            for r in 0..4 {
                let factor = _mm256_set1_epi16(scales[r][g] as i16);
                let scaled = _mm256_add_epi32(
                    _mm256_madd_epi16(halves[0][r], factor),
                    _mm256_madd_epi16(halves[1][r], factor),
                );
                total[r] = _mm256_add_epi32(total[r], scaled);
            }
        }
        for r in 0..4 {
            let mut offset = _mm256_setzero_si256();
            for (i, &pair) in pairs.iter().enumerate() {
                let factors = _mm256_set1_epi32(i16_pair(scales[r][2 * i], scales[r][2 * i + 1]));
                offset = _mm256_add_epi32(offset, _mm256_madd_epi16(pair, factors));
            }
            let total = _mm256_sub_epi32(total[r], _mm256_slli_epi32::<5>(offset));
            acc[r] = fused8(acc[r], d[r], total, dx);
        }
    }
    acc
}

/// Writes the 6-bit values (`q + 32`) of a `Q6_K` super-block to `out`, in order.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the super-block must be readable and 256
/// bytes writable at `out`, 32-byte aligned.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_codes(block: *const u8, out: *mut u8) {
    for half in 0..2 {
        // SAFETY: per the contract.
        unsafe {
            for (k, v) in q6_k_values(block, half).into_iter().enumerate() {
                _mm256_store_si256(out.add(128 * half + 32 * k).cast(), v);
            }
        }
    }
}

/// The repacked `Q4_K` GEMM's tile on a whole group of eight tokens, lane `t` token
/// `t`'s: each row's super-block unpacked to its 4-bit values once ([`q4_k_codes`]);
/// each four of them, broadcast, meet the eight tokens' four activations in one
/// `maddubs` (a lane at most `2 · 15 · 127`), a sub-block's eight of those summed in
/// i16 and a `madd` against its scale gives `scale · Σ q qx` in i32; then, for each 64
/// values in order, the GEMM's float operations on the exact integers (the two
/// sub-blocks' sum fused at `d · dx`, their mins against the tokens' sums fused at
/// `dmin · dx`), and at the end one accumulator less the other: the bits of
/// [`tile8_q4_k_packed`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_k_grouped(
    rows: [&[u8]; 4],
    acts: &[Q8KRow<'_>; 8],
    group: Q8KGroup<'_>,
    nb: usize,
) -> [__m256; 4] {
    assert!(group.qs.len() >= nb * QK_K * 8 && group.bsums.len() >= nb * GROUPS * 8);
    let mut codes = Codes([[0; QK_K]; 4]);
    let (mut sums, mut sum_mins) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
    for b in 0..nb {
        let dx = scales8(acts, b);
        // SAFETY: the assertion above bounds super-block b's activations and sums.
        let (xs, pairs) = unsafe {
            (
                group.qs.as_ptr().add(b * QK_K * 8),
                sum_pairs::<4>(group.bsums.as_ptr().add(b * GROUPS * 8)),
            )
        };
        // SAFETY: b < nb bounds the rows' blocks.
        let (d, dmin, scales_mins) = unsafe { q4_k_rows(&rows, b, dx, &mut codes) };
        let byte = |v: u64, k: usize| ((v >> (8 * k)) & 0xFF) as i32;
        for (j, &pair) in pairs.iter().enumerate() {
            // SAFETY: values 64j .. 64j + 64 of the eight tokens, inside super-block b.
            let subs = unsafe {
                [
                    quads_i16::<8>(&codes, xs, 16 * j),
                    quads_i16::<8>(&codes, xs, 16 * j + 8),
                ]
            };
            for r in 0..4 {
                let (scales, mins) = scales_mins[r];
                let sub = |h: usize| {
                    let factor = _mm256_set1_epi16(byte(scales, 2 * j + h) as i16);
                    _mm256_madd_epi16(subs[h][r], factor)
                };
                let part = _mm256_add_epi32(sub(0), sub(1));
                let factors = _mm256_set1_epi32(i16_pair(byte(mins, 2 * j), byte(mins, 2 * j + 1)));
                let min = _mm256_madd_epi16(pair, factors);
                sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part), d[r], sums[r]);
                sum_mins[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min), dmin[r], sum_mins[r]);
            }
        }
    }
    std::array::from_fn(|r| _mm256_sub_ps(sums[r], sum_mins[r]))
}
