//! AVX2 kernels of the legacy formats: blocks of 32 weights against [`Q8Row`]s.
//!
//! A block's quantized weights become 32 bytes in one register: unsigned values (4 or 5
//! bits, the offset of `Q4_0`/`Q5_0` taken out through the activations' block sums) or,
//! for `Q8_0`, their magnitudes with the signs moved onto the activations. One
//! `maddubs` + `madd` pair then yields the block's integer dot product in eight lanes.

use std::arch::x86_64::*;

use super::{hsum_ps, load32, load_f16, mul_sum_u8_i8};
use crate::matmul::activation::{Q8Row, QK8};
use crate::matmul::portable::{Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q8_0_BYTES};

/// One block unpacked for all tokens.
#[derive(Clone, Copy)]
struct Unpacked {
    /// The block's scale.
    d: f32,
    /// The block's offset (`Q4_1`, `Q5_1`), else 0.
    m: f32,
    /// The 32 quantized weights as unsigned bytes (for `Q8_0`, their magnitudes).
    q: __m256i,
    /// For `Q8_0`, the signed weights whose signs go onto the activations.
    signs: __m256i,
}

/// How one legacy format unpacks and multiplies.
trait Legacy {
    const BYTES: usize;
    /// Whether the format has an offset `m`, applied through the activations' sums.
    const HAS_MIN: bool;

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `block..block + BYTES` must be readable.
    unsafe fn unpack(block: *const u8) -> Unpacked;

    /// The block's integer dot product with `qx` (of block sum `isum`), in eight lanes.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    unsafe fn int(w: &Unpacked, qx: __m256i, isum: i32) -> __m256i;
}

/// 16 bytes of packed nibbles → 32 bytes: low nibbles first, then high ones.
///
/// # Safety
/// `p..p + 16` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: readable per the contract; `loadu` has no alignment requirement.
    let packed = unsafe { _mm_loadu_si128(p.cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// The 32 high bits at `p` (little-endian) as bytes: 0x10 where bit `i` is set.
///
/// # Safety
/// `p..p + 4` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn high_bits(p: *const u8) -> __m256i {
    // SAFETY: readable per the contract; `read_unaligned` has no alignment requirement.
    let bits = unsafe { p.cast::<u32>().read_unaligned() };
    // Byte i receives the byte of `bits` holding bit i (each 128-bit lane holds a copy).
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

struct Q4_0;
struct Q4_1;
struct Q5_0;
struct Q5_1;
struct Q8_0;

impl Legacy for Q4_0 {
    const BYTES: usize = Q4_0_BYTES;
    const HAS_MIN: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(block: *const u8) -> Unpacked {
        // SAFETY: the block is readable per the contract; qs lies at 2..18.
        let (d, q) = unsafe { (load_f16(block), nibbles(block.add(2))) };
        Unpacked {
            d,
            m: 0.0,
            q,
            signs: q,
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Unpacked, qx: __m256i, isum: i32) -> __m256i {
        // Σ (q - 8) qx = Σ q qx - 8 isum, the 8 isum spread over the eight lanes.
        _mm256_sub_epi32(mul_sum_u8_i8(w.q, qx), _mm256_set1_epi32(isum))
    }
}

impl Legacy for Q4_1 {
    const BYTES: usize = Q4_1_BYTES;
    const HAS_MIN: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(block: *const u8) -> Unpacked {
        // SAFETY: the block is readable per the contract; d, m, qs lie at 0, 2, 4..20.
        let (d, m, q) = unsafe {
            (
                load_f16(block),
                load_f16(block.add(2)),
                nibbles(block.add(4)),
            )
        };
        Unpacked { d, m, q, signs: q }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Unpacked, qx: __m256i, _isum: i32) -> __m256i {
        mul_sum_u8_i8(w.q, qx)
    }
}

impl Legacy for Q5_0 {
    const BYTES: usize = Q5_0_BYTES;
    const HAS_MIN: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(block: *const u8) -> Unpacked {
        // SAFETY: the block is readable per the contract; d, qh, qs lie at 0, 2..6, 6..22.
        let (d, low, high) = unsafe {
            (
                load_f16(block),
                nibbles(block.add(6)),
                high_bits(block.add(2)),
            )
        };
        let q = _mm256_or_si256(low, high);
        Unpacked {
            d,
            m: 0.0,
            q,
            signs: q,
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Unpacked, qx: __m256i, isum: i32) -> __m256i {
        // Σ (q - 16) qx = Σ q qx - 16 isum, the 16 isum spread over the eight lanes.
        _mm256_sub_epi32(mul_sum_u8_i8(w.q, qx), _mm256_set1_epi32(2 * isum))
    }
}

impl Legacy for Q5_1 {
    const BYTES: usize = Q5_1_BYTES;
    const HAS_MIN: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(block: *const u8) -> Unpacked {
        // SAFETY: the block is readable per the contract; d, m, qh, qs lie at 0, 2, 4..8,
        // 8..24.
        let (d, m, low, high) = unsafe {
            (
                load_f16(block),
                load_f16(block.add(2)),
                nibbles(block.add(8)),
                high_bits(block.add(4)),
            )
        };
        let q = _mm256_or_si256(low, high);
        Unpacked { d, m, q, signs: q }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Unpacked, qx: __m256i, _isum: i32) -> __m256i {
        mul_sum_u8_i8(w.q, qx)
    }
}

impl Legacy for Q8_0 {
    const BYTES: usize = Q8_0_BYTES;
    const HAS_MIN: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(block: *const u8) -> Unpacked {
        // SAFETY: the block is readable per the contract; d, qs lie at 0, 2..34.
        let (d, signed) = unsafe { (load_f16(block), load32(block.add(2))) };
        // |q| as unsigned bytes: -128 becomes 128, which maddubs reads correctly.
        Unpacked {
            d,
            m: 0.0,
            q: _mm256_sign_epi8(signed, signed),
            signs: signed,
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Unpacked, qx: __m256i, _isum: i32) -> __m256i {
        // q · qx = |q| · (qx with q's sign); zero weights zero the activation.
        mul_sum_u8_i8(w.q, _mm256_sign_epi8(qx, w.signs))
    }
}

/// Blocks that every row and activation row can supply.
fn blocks<const R: usize, const N: usize>(
    rows: &[&[u8]; R],
    bytes: usize,
    acts: &[Q8Row<'_>; N],
) -> usize {
    let n = rows
        .iter()
        .fold(usize::MAX, |n, row| n.min(row.len() / bytes));
    acts.iter().fold(n, |n, a| {
        n.min(a.qs.len() / QK8)
            .min(a.d.len())
            .min(a.isum.len())
            .min(a.s.len())
    })
}

/// `R` rows against `N` tokens. Each block's activations are loaded once for the `R`
/// rows and each row's block is unpacked once for the `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot<L: Legacy, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8Row<'_>; N],
) -> [[f32; N]; R] {
    let nb = blocks(&rows, L::BYTES, &acts);
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    let mut mins = [[0.0f32; N]; R];
    for b in 0..nb {
        let mut qx = [_mm256_setzero_si256(); N];
        let (mut isum, mut dx, mut sx) = ([0i32; N], [0.0f32; N], [0.0f32; N]);
        for t in 0..N {
            let a = &acts[t];
            // SAFETY: `b < nb` bounds every index by the activation row's lengths.
            unsafe {
                qx[t] = load32(a.qs.as_ptr().add(b * QK8).cast());
                isum[t] = *a.isum.get_unchecked(b);
                dx[t] = *a.d.get_unchecked(b);
                sx[t] = *a.s.get_unchecked(b);
            }
        }
        for r in 0..R {
            // SAFETY: `b < nb` keeps the block inside the row; the features are present
            // per this function's contract.
            let w = unsafe { L::unpack(rows[r].as_ptr().add(b * L::BYTES)) };
            for t in 0..N {
                // SAFETY: the features are present per this function's contract.
                let int = unsafe { L::int(&w, qx[t], isum[t]) };
                acc[r][t] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(int),
                    _mm256_set1_ps(w.d * dx[t]),
                    acc[r][t],
                );
                if L::HAS_MIN {
                    mins[r][t] += w.m * sx[t];
                }
            }
        }
    }
    let mut out = [[0.0f32; N]; R];
    for r in 0..R {
        for t in 0..N {
            out[r][t] = hsum_ps(acc[r][t]) + mins[r][t];
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
            acts: [Q8Row<'_>; N],
        ) -> [[f32; N]; R] {
            // SAFETY: the features are present per this function's contract.
            unsafe { dot::<$format, R, N>(rows, acts) }
        }
    };
}

entry!(dot_q4_0, Q4_0);
entry!(dot_q4_1, Q4_1);
entry!(dot_q5_0, Q5_0);
entry!(dot_q5_1, Q5_1);
entry!(dot_q8_0, Q8_0);

/// The integer dot product of one block with 32 activations, summed over the lanes:
/// the quantity the portable `*_block` functions compute.
#[cfg(test)]
pub(crate) fn block_int(
    _proof: super::Avx2,
    ty: gguf_format::GgmlType,
    block: &[u8],
    qx: &[i8],
    isum: i32,
) -> i32 {
    use gguf_format::GgmlType as T;
    #[target_feature(enable = "avx2,fma,f16c")]
    fn int<L: Legacy>(block: &[u8], qx: &[i8], isum: i32) -> i32 {
        assert!(block.len() >= L::BYTES && qx.len() >= QK8);
        // SAFETY: the lengths were just checked; the features are present, as calling
        // this function requires.
        unsafe {
            super::hsum_epi32(L::int(
                &L::unpack(block.as_ptr()),
                load32(qx.as_ptr().cast()),
                isum,
            ))
        }
    }
    // SAFETY: `_proof` shows the CPU has the features.
    unsafe {
        match ty {
            T::Q4_0 => int::<Q4_0>(block, qx, isum),
            T::Q4_1 => int::<Q4_1>(block, qx, isum),
            T::Q5_0 => int::<Q5_0>(block, qx, isum),
            T::Q5_1 => int::<Q5_1>(block, qx, isum),
            T::Q8_0 => int::<Q8_0>(block, qx, isum),
            other => panic!("{other} is not a legacy format"),
        }
    }
}
