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

/// `R` rows against `N` tokens, sixteen weights per step.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot<W: Float, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    xs: [&[f32]; N],
) -> [[f32; N]; R] {
    let n = rows
        .iter()
        .fold(usize::MAX, |n, row| n.min(row.len() / W::BYTES));
    let n = xs.iter().fold(n, |n, x| n.min(x.len()));
    // Two sets of accumulators, for the two halves of each step of 16 weights: twice as
    // many independent FMA chains, and a register allocation that keeps them all in
    // registers (with one set, one accumulator of four ended up on the stack for F16).
    let mut acc = [[[_mm256_setzero_ps(); N]; R]; 2];
    let mut i = 0;
    while i + 8 <= n {
        for (half, acc) in acc.iter_mut().enumerate() {
            let at = i + 8 * half;
            if at + 8 > n {
                break;
            }
            let mut x = [_mm256_setzero_ps(); N];
            for t in 0..N {
                // SAFETY: at + 8 ≤ n keeps the load inside `xs[t]`.
                x[t] = unsafe { _mm256_loadu_ps(xs[t].as_ptr().add(at)) };
            }
            for r in 0..R {
                // SAFETY: at + 8 ≤ n keeps the load inside the row; the features are
                // present per this function's contract.
                let w = unsafe { W::load8(rows[r].as_ptr().add(at * W::BYTES)) };
                for t in 0..N {
                    acc[r][t] = _mm256_fmadd_ps(w, x[t], acc[r][t]);
                }
            }
        }
        i = (i + 16).min(n / 8 * 8);
    }
    let mut out = [[0.0f32; N]; R];
    for r in 0..R {
        for t in 0..N {
            out[r][t] = hsum_ps(_mm256_add_ps(acc[0][r][t], acc[1][r][t]));
            for j in i..n {
                out[r][t] += W::one(&rows[r][j * W::BYTES..]) * xs[t][j];
            }
        }
    }
    out
}

macro_rules! entry {
    ($name:ident, $format:ty) => {
        /// `R` rows against `N` tokens.
        ///
        /// # Safety
        /// The CPU must support AVX2, FMA and F16C.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(crate) unsafe fn $name<const R: usize, const N: usize>(
            rows: [&[u8]; R],
            xs: [&[f32]; N],
        ) -> [[f32; N]; R] {
            // SAFETY: the features are present per this function's contract.
            unsafe { dot::<$format, R, N>(rows, xs) }
        }
    };
}

entry!(dot_f32, F32);
entry!(dot_f16, F16);
entry!(dot_bf16, BF16);
