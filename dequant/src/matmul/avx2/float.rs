//! AVX2 kernels of the float weight types against f32 activations: F32, F16 (widened
//! with F16C) and BF16 (widened by a shift).

use std::arch::x86_64::*;

use super::hsum_ps;

use super::super::activation::FloatRow;
use super::super::portable::{bf16_at, f16_at, f32_at, finish_chains, FloatKind};

/// How one float type loads eight weights as f32.
trait Float {
    const BYTES: usize;
    const KIND: FloatKind;

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `p..p + 8 * BYTES` must be readable.
    unsafe fn load8(p: *const u8) -> __m256;

    /// Weight `i` of a row, for the tail of a row.
    fn one(row: &[u8], i: usize) -> f32;
}

struct F32;
struct F16;
struct BF16;

impl Float for F32 {
    const BYTES: usize = 4;
    const KIND: FloatKind = FloatKind::F32;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 32 bytes are readable per the contract; `loadu` needs no alignment.
        unsafe { _mm256_loadu_ps(p.cast()) }
    }

    fn one(row: &[u8], i: usize) -> f32 {
        f32_at(row, i)
    }
}

impl Float for F16 {
    const BYTES: usize = 2;
    const KIND: FloatKind = FloatKind::F16;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 16 bytes are readable per the contract; `loadu` needs no alignment.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
    }

    fn one(row: &[u8], i: usize) -> f32 {
        f16_at(row, i)
    }
}

impl Float for BF16 {
    const BYTES: usize = 2;
    const KIND: FloatKind = FloatKind::BF16;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 16 bytes are readable per the contract; `loadu` needs no alignment.
        let bits = _mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(p.cast()) });
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits))
    }

    fn one(row: &[u8], i: usize) -> f32 {
        bf16_at(row, i)
    }
}

/// `R` rows against `N` tokens, in the arithmetic [`FloatRow::gemm`] says (the
/// portable `float_dot`'s, lane for lane).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot<W: Float, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [FloatRow<'_>; N],
) -> [[f32; N]; R] {
    let n = rows
        .iter()
        .fold(usize::MAX, |n, row| n.min(row.len() / W::BYTES));
    let n = acts.iter().fold(n, |n, a| n.min(a.x.len()));
    let mut out = [[0.0f32; N]; R];
    if !acts.iter().all(|a| a.gemm) {
        for r in 0..R {
            for t in 0..N {
                // SAFETY: as this function.
                out[r][t] = unsafe { chains::<W>(rows[r], acts[t].x, n) };
            }
        }
        return out;
    }
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    for i in (0..n / 8 * 8).step_by(8) {
        let mut x = [_mm256_setzero_ps(); N];
        for t in 0..N {
            // SAFETY: i + 8 ≤ n keeps the load inside the token's row.
            x[t] = unsafe { _mm256_loadu_ps(acts[t].x.as_ptr().add(i)) };
        }
        for r in 0..R {
            // SAFETY: i + 8 ≤ n keeps the load inside the row; the features are present
            // per this function's contract.
            let w = unsafe { W::load8(rows[r].as_ptr().add(i * W::BYTES)) };
            for t in 0..N {
                acc[r][t] = _mm256_fmadd_ps(w, x[t], acc[r][t]);
            }
        }
    }
    for r in 0..R {
        for t in 0..N {
            out[r][t] = hsum_ps(acc[r][t]);
        }
    }
    out
}

/// One row against one token as llama.cpp's dot product computes it: four chains over
/// each 32 values, finished as the portable kernel finishes them.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chains<W: Float>(row: &[u8], x: &[f32], n: usize) -> f32 {
    let whole = n / 32 * 32;
    let mut c = [_mm256_setzero_ps(); 4];
    for i in (0..whole).step_by(32) {
        for (j, c) in c.iter_mut().enumerate() {
            let at = i + 8 * j;
            // SAFETY: at + 8 ≤ whole ≤ n keeps both loads in bounds.
            let (w, xv) = unsafe {
                (
                    W::load8(row.as_ptr().add(at * W::BYTES)),
                    _mm256_loadu_ps(x.as_ptr().add(at)),
                )
            };
            *c = _mm256_fmadd_ps(w, xv, *c);
        }
    }
    let v = _mm256_add_ps(_mm256_add_ps(c[0], c[2]), _mm256_add_ps(c[1], c[3]));
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds eight f32; `storeu` has no alignment requirement.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
    finish_chains(W::KIND, &lanes, |i| W::one(row, i), x, whole..n)
}

entries!("`R` rows against `N` tokens.", FloatRow: dot_f32 => F32, dot_f16 => F16, dot_bf16 => BF16);
