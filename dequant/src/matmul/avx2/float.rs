//! AVX2 kernels of the float weight types against f32 activations: F32, F16 (widened
//! with F16C) and BF16 (widened by a shift).

use std::arch::x86_64::*;

use super::hsum_ps;

/// How one float type loads eight weights as f32.
trait Float {
    const BYTES: usize;

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `p..p + 8 * BYTES` must be readable.
    unsafe fn load8(p: *const u8) -> __m256;

    /// One weight, for the tail of a row.
    fn one(bytes: &[u8]) -> f32;
}

struct F32;
struct F16;
struct BF16;

impl Float for F32 {
    const BYTES: usize = 4;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 32 bytes are readable per the contract; `loadu` needs no alignment.
        unsafe { _mm256_loadu_ps(p.cast()) }
    }

    fn one(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl Float for F16 {
    const BYTES: usize = 2;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 16 bytes are readable per the contract; `loadu` needs no alignment.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
    }

    fn one(b: &[u8]) -> f32 {
        half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
    }
}

impl Float for BF16 {
    const BYTES: usize = 2;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 16 bytes are readable per the contract; `loadu` needs no alignment.
        let bits = _mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(p.cast()) });
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits))
    }

    fn one(b: &[u8]) -> f32 {
        f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
    }
}

/// One row against `N` tokens, sixteen weights per step into two sets of accumulators.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot<W: Float, const N: usize>(row: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    let n = xs.iter().fold(row.len() / W::BYTES, |n, x| n.min(x.len()));
    let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); N], [_mm256_setzero_ps(); N]);
    let w = row.as_ptr();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 ≤ n keeps every load inside `row` and each `x`; the features
        // are present per this function's contract.
        unsafe {
            let (w0, w1) = (
                W::load8(w.add(i * W::BYTES)),
                W::load8(w.add((i + 8) * W::BYTES)),
            );
            for t in 0..N {
                let x = xs[t].as_ptr().add(i);
                acc0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc0[t]);
                acc1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.add(8)), acc1[t]);
            }
        }
        i += 16;
    }
    if i + 8 <= n {
        // SAFETY: i + 8 ≤ n keeps every load inside `row` and each `x`; the features are
        // present per this function's contract.
        unsafe {
            let w0 = W::load8(w.add(i * W::BYTES));
            for t in 0..N {
                acc0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs[t].as_ptr().add(i)), acc0[t]);
            }
        }
        i += 8;
    }
    let mut out = [0.0f32; N];
    for t in 0..N {
        out[t] = hsum_ps(_mm256_add_ps(acc0[t], acc1[t]));
        for j in i..n {
            out[t] += W::one(&row[j * W::BYTES..]) * xs[t][j];
        }
    }
    out
}

macro_rules! entry {
    ($name:ident, $format:ty) => {
        /// One row against `N` tokens.
        ///
        /// # Safety
        /// The CPU must support AVX2, FMA and F16C.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(crate) unsafe fn $name<const N: usize>(row: &[u8], xs: [&[f32]; N]) -> [f32; N] {
            // SAFETY: the features are present per this function's contract.
            unsafe { dot::<$format, N>(row, xs) }
        }
    };
}

entry!(dot_f32, F32);
entry!(dot_f16, F16);
entry!(dot_bf16, BF16);
