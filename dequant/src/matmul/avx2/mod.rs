//! The AVX2 kernels (with FMA for the accumulation and F16C for the f16 scales).
//!
//! Every function here is compiled for those features and may run only on a CPU that
//! has them. [`Avx2`] is the proof: it is made only by [`Avx2::detect`], and the safe
//! entry point [`Avx2::rows`] takes it by value.
//!
//! Each kernel computes one weight row against `N` tokens at once (`N` ≤ 4), so a
//! block's weights are unpacked once and meet every token of the batch while they sit
//! in registers.

pub(crate) mod float;
pub(crate) mod kquants;
pub(crate) mod legacy;

use std::arch::x86_64::*;

use super::activation::ActSet;
use super::driver::token_tile;
use super::formats::Kernel;

/// Proof that the CPU supports AVX2, FMA and F16C.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// The proof, when the CPU has the features.
    pub(crate) fn detect() -> Option<Avx2> {
        let present = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        present.then_some(Avx2(()))
    }

    /// `out[r * n_tokens + t]` = row `r` of `w` (rows of `row_bytes`, whole blocks) ·
    /// token `t` of `acts`, for every row and token.
    pub(crate) fn rows<K: Kernel>(
        self,
        w: &[u8],
        row_bytes: usize,
        acts: &K::Acts,
        n_tokens: usize,
        out: &mut [f32],
    ) {
        // SAFETY: `self` exists only when `detect` found AVX2, FMA and F16C on this CPU,
        // the only requirement of `rows`.
        unsafe { rows::<K>(w, row_bytes, acts, n_tokens, out) }
    }
}

/// The tiled loop of [`Avx2::rows`]: for each tile of tokens small enough to stay in
/// L1, every row of the chunk passes over it, four tokens per kernel call.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows<K: Kernel>(
    w: &[u8],
    row_bytes: usize,
    acts: &K::Acts,
    n_tokens: usize,
    out: &mut [f32],
) {
    if row_bytes == 0 || n_tokens == 0 {
        return;
    }
    let tile = token_tile(acts.row_bytes());
    for t0 in (0..n_tokens).step_by(tile) {
        let t1 = (t0 + tile).min(n_tokens);
        for (row, out_row) in w
            .chunks_exact(row_bytes)
            .zip(out.chunks_exact_mut(n_tokens))
        {
            let mut t = t0;
            while t + 4 <= t1 {
                group::<K, 4>(row, acts, t, out_row);
                t += 4;
            }
            match t1 - t {
                3 => group::<K, 3>(row, acts, t, out_row),
                2 => group::<K, 2>(row, acts, t, out_row),
                1 => group::<K, 1>(row, acts, t, out_row),
                _ => {}
            }
        }
    }
}

/// `out_row[t0..t0 + N]` = `row` · tokens `t0..t0 + N`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn group<K: Kernel, const N: usize>(row: &[u8], acts: &K::Acts, t0: usize, out_row: &mut [f32]) {
    let rows = std::array::from_fn(|i| acts.row(t0 + i));
    // SAFETY: the features are present, as calling this function requires; that is the
    // kernels' only requirement (they bound every access by their slices' lengths).
    let dots = unsafe { K::dot_avx2::<N>(row, rows) };
    out_row[t0..t0 + N].copy_from_slice(&dots);
}

/// The sum of the eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum_ps(v: __m256) -> f32 {
    let sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
    _mm_cvtss_f32(_mm_add_ss(sum2, _mm_movehdup_ps(sum2)))
}

/// The sum of the four lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum_epi32_128(v: __m128i) -> i32 {
    let sum2 = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    _mm_cvtsi128_si32(_mm_add_epi32(sum2, _mm_shuffle_epi32::<0b01>(sum2)))
}

/// The sum of the eight lanes.
#[cfg(test)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum_epi32(v: __m256i) -> i32 {
    hsum_epi32_128(_mm_add_epi32(
        _mm256_castsi256_si128(v),
        _mm256_extracti128_si256::<1>(v),
    ))
}

/// `Σ u[i] · s[i]` in eight i32 lanes, each lane summing four neighbouring products:
/// unsigned bytes against signed ones. The pairwise i16 sums cannot saturate as long as
/// `u` ≤ 128 and |s| ≤ 127, which every caller keeps.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn mul_sum_u8_i8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// [`mul_sum_u8_i8`] weighted per 16 values: lanes 0–3 by the i16 in `scales`' low
/// half, lanes 4–7 by its high half (each half holding one scale eight times).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn mul_sum_u8_i8_scaled(u: __m256i, s: __m256i, scales: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scales)
}

/// 32 bytes read from `p`, which may be unaligned.
///
/// # Safety
/// `p..p + 32` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn load32(p: *const u8) -> __m256i {
    // SAFETY: readable per the contract; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// The little-endian f16 at `p`, widened with F16C.
///
/// # Safety
/// `p..p + 2` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn load_f16(p: *const u8) -> f32 {
    // SAFETY: readable per the contract; `read_unaligned` has no alignment requirement.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}
