//! AVX-512 kernels of the symmetric legacy formats (`Q4_0`, `Q5_0`, `Q8_0`, `IQ4_NL`) in
//! batches: one row against two to four tokens, two tokens a 512-bit step.
//!
//! A block's 32 weight magnitudes fill both 256-bit halves of a vector, and two tokens'
//! 32 activations, negated where the weight is negative (a mask from the weights' sign
//! bits: no `vpsignb` at this width, and a zero weight's magnitude already zeroes its
//! product), the two halves of another. One `vpdpbusd` then gives each token's eight
//! lanes of four products, the very integers of the AVX2 kernel's `maddubs` and `madd`
//! (whose i16 pair sums never saturate for these formats: magnitudes of at most 128
//! times activations of at most 127). The AVX2 kernel's float operations follow lane for
//! lane: the block's `d · dx` of each token (the same product of the same values) times
//! the lanes, fused into each token's eight accumulators block after block, and the
//! lanes summed at the end as its `hsum_ps` does. So the products are the AVX2 kernel's
//! bits, and llama.cpp's.
//!
//! Single tokens (four rows a call), the formats with an offset (`Q4_1`, `Q5_1`), the
//! repacked layouts and `MXFP4`'s paired batches take their AVX2 kernels.

use std::arch::x86_64::*;
use std::mem::offset_of;

use crate::blocks::BlockQ5_0;
use crate::matmul::activation::{Q8Row, QK8};
use crate::matmul::avx2::legacy::{
    blocks, nibbles, token_scales, Legacy, IQ4NL as IQ4NLFormat, Q4_0 as Q4_0Format,
    Q5_0 as Q5_0Format, Q8_0 as Q8_0Format,
};
use crate::matmul::avx2::{hsum_ps, load32};

/// A symmetric format's block as this file's kernel takes it: the 32 weights'
/// magnitudes as unsigned bytes, and a mask of the negative ones.
trait Symmetric: Legacy {
    /// # Safety
    /// The CPU must support the AVX-512 path's features; `block..block + BYTES` must
    /// be readable.
    unsafe fn unpack(block: *const u8) -> (__m256i, u32);
}

/// The AVX2 kernel's magnitudes, and the signs' bits as the mask.
///
/// # Safety
/// As [`Symmetric::unpack`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn from_quants<L: Legacy>(block: *const u8) -> (__m256i, u32) {
    // SAFETY: per the contract, which covers `quants`'.
    let quants = unsafe { L::quants(block) };
    (quants.q, _mm256_movepi8_mask(quants.signs))
}

macro_rules! symmetric_from_quants {
    ($($format:ty),+) => {$(
        impl Symmetric for $format {
            #[inline]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
            unsafe fn unpack(block: *const u8) -> (__m256i, u32) {
                // SAFETY: per the contract.
                unsafe { from_quants::<Self>(block) }
            }
        }
    )+};
}

symmetric_from_quants!(Q4_0Format, Q8_0Format, IQ4NLFormat);

impl Symmetric for Q5_0Format {
    /// A weight is its nibble `n` plus 16 times its high bit, less 16: negative exactly
    /// where the high bit is clear, and then of magnitude `16 - n`. So the high bits,
    /// inverted, are the mask, and one masked subtraction gives the magnitudes (where
    /// the AVX2 kernel spreads the bits into bytes, adds, subtracts and takes signs).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(block: *const u8) -> (__m256i, u32) {
        let (qs, qh) = (offset_of!(BlockQ5_0, qs), offset_of!(BlockQ5_0, qh));
        // SAFETY: the block is readable per the contract; qs and qh lie inside it.
        let (low, high) = unsafe {
            (
                nibbles(block.add(qs)),
                block.add(qh).cast::<u32>().read_unaligned(),
            )
        };
        let negative = !high;
        (
            _mm256_mask_sub_epi8(low, negative, _mm256_set1_epi8(16), low),
            negative,
        )
    }
}

/// `R` rows against `N` tokens (one of them 1, the other at most 4): the batched
/// kernel of this file for one row and two tokens or more of a format it takes, else the
/// AVX2 kernel.
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot<L: Symmetric, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8Row<'_>; N],
) -> [[f32; N]; R] {
    if R == 1 && N >= 2 {
        let mut out = [[0.0f32; N]; R];
        // SAFETY: the features are present per this function's contract.
        out[0] = unsafe { dot_tokens::<L, N>(rows[0], acts) };
        return out;
    }
    // SAFETY: every AVX-512 CPU has AVX2, FMA and F16C (which `Avx512::detect` checks).
    unsafe { crate::matmul::avx2::legacy::dot::<L, R, N>(rows, acts) }
}

/// One row against `N` ≤ 4 tokens of a symmetric format, as the AVX2 kernel's
/// `dot_tokens` computes them.
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_tokens<L: Symmetric, const N: usize>(row: &[u8], acts: [Q8Row<'_>; N]) -> [f32; N] {
    const { assert!(N <= 4) };
    // What makes a format symmetric here: no offset, eight lanes fused block by block.
    const { assert!(!(L::HAS_M || L::TOTALS || L::E8M0 || (L::PAIRED && L::PAIRED_BATCH))) };
    let rows = [row];
    let nb = blocks(&rows, L::BYTES, &acts);
    // Tokens 2p and 2p + 1 in the halves of pair p's accumulators; an odd last token in
    // 256 bits, as the AVX2 kernel holds it.
    let mut pairs_acc = [_mm512_setzero_ps(); 2];
    let mut last_acc = _mm256_setzero_ps();
    for b in 0..nb {
        // The scales as the AVX2 kernel forms them (lane 2t holds d · dx_t).
        // SAFETY: `b < nb` keeps the block inside the row and the activation rows; the
        // features are present per this function's contract.
        let (products, (magnitudes256, negative256)) = unsafe {
            (
                token_scales::<L, N>(row, &acts, b),
                L::unpack(row.as_ptr().add(b * L::BYTES)),
            )
        };
        let (magnitudes, negative) = widen(magnitudes256, negative256);
        for (p, acc) in pairs_acc.iter_mut().enumerate().take(N / 2) {
            // SAFETY: `b < nb` bounds both loads by the activation rows' lengths.
            let (x0, x1) = unsafe { (qx(&acts[2 * p], b), qx(&acts[2 * p + 1], b)) };
            let int = pair_lanes(magnitudes, negative, x0, x1);
            // Lane 2t of the products in every lane of token t's half (t = 2p, 2p + 1).
            let (l0, l1) = (4 * p as i32, 4 * p as i32 + 2);
            let scale = _mm512_permutexvar_ps(
                _mm512_setr_epi32(
                    l0, l0, l0, l0, l0, l0, l0, l0, l1, l1, l1, l1, l1, l1, l1, l1,
                ),
                _mm512_castps256_ps512(products),
            );
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(int), scale, *acc);
        }
        if N % 2 == 1 {
            let t = N - 1;
            // SAFETY: `b < nb` bounds the load by the activation row's length.
            let x = unsafe { qx(&acts[t], b) };
            let int = single_lanes(magnitudes256, negative256, x);
            let scale = _mm256_permutevar8x32_ps(products, _mm256_set1_epi32(2 * t as i32));
            last_acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int), scale, last_acc);
        }
    }
    let mut out = [0.0f32; N];
    for (t, o) in out.iter_mut().enumerate() {
        let acc = if t == N - 1 && N % 2 == 1 {
            last_acc
        } else if t % 2 == 0 {
            _mm512_castps512_ps256(pairs_acc[t / 2])
        } else {
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(
                pairs_acc[t / 2],
            )))
        };
        // The AVX2 kernel adds its offsets' lanes, zeros for these formats.
        *o = hsum_ps(acc) + 0.0;
    }
    out
}

/// A block's magnitudes and negative weights' mask repeated for both halves of a
/// 512-bit step.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn widen(magnitudes: __m256i, negative: u32) -> (__m512i, u64) {
    (
        _mm512_broadcast_i64x4(magnitudes),
        u64::from(negative) | (u64::from(negative) << 32),
    )
}

/// Two tokens' eight integer lanes against a block (`widen`'s), token 0's in the low
/// half: their activations negated where the weight is negative, one `vpdpbusd`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn pair_lanes(magnitudes: __m512i, negative: u64, x0: __m256i, x1: __m256i) -> __m512i {
    let x = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x0), x1);
    let zero = _mm512_setzero_si512();
    _mm512_dpbusd_epi32(zero, magnitudes, _mm512_mask_sub_epi8(x, negative, zero, x))
}

/// One token's eight integer lanes against a block, as [`pair_lanes`] in 256 bits.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn single_lanes(magnitudes: __m256i, negative: u32, x: __m256i) -> __m256i {
    let zero = _mm256_setzero_si256();
    _mm256_dpbusd_epi32(zero, magnitudes, _mm256_mask_sub_epi8(x, negative, zero, x))
}

/// Block `b`'s 32 activations of token row `a`.
///
/// # Safety
/// The CPU must support AVX2; `b` must be below the row's count of blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn qx(a: &Q8Row<'_>, b: usize) -> __m256i {
    // SAFETY: in bounds per the contract.
    unsafe { load32(a.qs.as_ptr().add(b * QK8).cast()) }
}

macro_rules! avx512_entries {
    ($($name:ident => $format:ty),+ $(,)?) => {$(
        /// `R` rows against `N` tokens: one of them must be 1, the other at most 4.
        ///
        /// # Safety
        /// The CPU must support the AVX-512 path's features.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        pub(crate) unsafe fn $name<const R: usize, const N: usize>(
            rows: [&[u8]; R],
            acts: [Q8Row<'_>; N],
        ) -> [[f32; N]; R] {
            // SAFETY: the features are present per this function's contract.
            unsafe { dot::<$format, R, N>(rows, acts) }
        }
    )+};
}

avx512_entries!(
    dot_q4_0 => Q4_0Format,
    dot_q5_0 => Q5_0Format,
    dot_q8_0 => Q8_0Format,
    dot_iq4_nl => IQ4NLFormat,
);

/// The eight i32 lanes of a block against 32 activations as [`dot_tokens`] computes
/// them, in both halves of a pair and alone (the AVX2 kernel's, by
/// `avx2::legacy::block_lanes`).
#[cfg(test)]
pub(crate) fn block_lanes(
    _proof: super::Avx512,
    ty: gguf_format::GgmlType,
    block: &[u8],
    qx: &[i8],
) -> [i32; 8] {
    use gguf_format::GgmlType as T;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn lanes<L: Symmetric>(block: &[u8], qx: &[i8]) -> [i32; 8] {
        assert!(block.len() >= L::BYTES && qx.len() >= QK8);
        let (mut pair, mut single) = ([0i32; 16], [0i32; 8]);
        // SAFETY: the lengths were just checked; the features are present, as calling
        // this function requires; the outputs hold sixteen and eight i32.
        unsafe {
            let (magnitudes, negative) = L::unpack(block.as_ptr());
            let x = load32(qx.as_ptr().cast());
            let (wide, mask) = widen(magnitudes, negative);
            _mm512_storeu_si512(pair.as_mut_ptr().cast(), pair_lanes(wide, mask, x, x));
            _mm256_storeu_si256(
                single.as_mut_ptr().cast(),
                single_lanes(magnitudes, negative, x),
            );
        }
        assert_eq!(pair[..8], pair[8..], "the two halves of a pair differ");
        assert_eq!(
            pair[..8],
            single,
            "a pair's lanes differ from a single token's"
        );
        single
    }
    // SAFETY: `_proof` shows the CPU has the features.
    unsafe {
        match ty {
            T::Q4_0 => lanes::<Q4_0Format>(block, qx),
            T::Q5_0 => lanes::<Q5_0Format>(block, qx),
            T::Q8_0 => lanes::<Q8_0Format>(block, qx),
            T::IQ4_NL => lanes::<IQ4NLFormat>(block, qx),
            other => panic!("{other} is not a symmetric legacy format"),
        }
    }
}
