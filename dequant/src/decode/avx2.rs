//! AVX2 kernels (with F16C for the f16 scales) of the formats that models use most and
//! of the grid formats.
//!
//! Each kernel is bit-identical to its reference decoder: it performs the same f32
//! operations in the same order, a product and then a sum or difference, never fused,
//! eight values at a time. Quants are unpacked to signed bytes in registers (nibbles by
//! shift and mask, high bits by a byte shuffle and compare, non-linear levels by a
//! `pshufb` table lookup) and widened to f32 eight at a time.
//!
//! Every function here is compiled for AVX2 and F16C and may run only on a CPU that
//! has them. [`Avx2`] is the proof: it is made only by [`Avx2::detect`], and the safe
//! entry points take it by value.

use std::arch::x86_64::*;

use super::grids::{KVALUES_IQ4NL, KVALUES_MXFP4};
use super::scalar::{self, e8m0_to_f32_half, k_scales_mins, q3_k_scales, Put};
use crate::blocks::*;

/// Proof that the CPU supports AVX2 and F16C.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// The proof, when the CPU has the features.
    pub(crate) fn detect() -> Option<Avx2> {
        let present = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c");
        present.then_some(Avx2(()))
    }
}

/// A safe method of [`Avx2`] per kernel, over matching slices of blocks and outputs.
macro_rules! entry {
    ($($name:ident: $block:ty => $n:expr,)*) => {
        impl Avx2 {
            $(
                pub(crate) fn $name(self, blocks: &[$block], out: &mut [[f32; $n]]) {
                    // SAFETY: `self` exists only when `detect` found AVX2 and F16C on
                    // this CPU, the kernel's only requirement.
                    unsafe { $name(blocks, out) }
                }
            )*
        }
    };
}

entry! {
    f16_: [u8; 2] => 1,
    bf16_: [u8; 2] => 1,
    q4_0: BlockQ4_0 => QK,
    q4_1: BlockQ4_1 => QK,
    q5_0: BlockQ5_0 => QK,
    q5_1: BlockQ5_1 => QK,
    q8_0: BlockQ8_0 => QK,
    iq4_nl: BlockIQ4_NL => QK,
    mxfp4: BlockMXFP4 => QK,
    q2_k: BlockQ2_K => QK_K,
    q3_k: BlockQ3_K => QK_K,
    q4_k: BlockQ4_K => QK_K,
    q5_k: BlockQ5_K => QK_K,
    q6_k: BlockQ6_K => QK_K,
    iq4_xs: BlockIQ4_XS => QK_K,
    tq2_0: BlockTQ2_0 => QK_K,
    iq2_xxs: BlockIQ2_XXS => QK_K,
    iq2_xs: BlockIQ2_XS => QK_K,
    iq2_s: BlockIQ2_S => QK_K,
    iq3_xxs: BlockIQ3_XXS => QK_K,
    iq3_s: BlockIQ3_S => QK_K,
    iq1_s: BlockIQ1_S => QK_K,
    iq1_m: BlockIQ1_M => QK_K,
}

// ---------------------------------------------------------------------------------------
// Loads, stores and conversions.

/// An f16 widened to f32 (exact) by `vcvtph2ps`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn f16_to_f32(h: F16Le) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32)))
}

/// The 16 bytes at `bytes[at..at + 16]`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn load16(bytes: &[u8], at: usize) -> __m128i {
    let src = &bytes[at..at + 16];
    // SAFETY: `src` is 16 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm_loadu_si128(src.as_ptr().cast()) }
}

/// The 32 bytes at `bytes[at..at + 32]`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn load32(bytes: &[u8], at: usize) -> __m256i {
    let src = &bytes[at..at + 32];
    // SAFETY: `src` is 32 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(src.as_ptr().cast()) }
}

/// Stores eight values at `y[at..at + 8]`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn store8(y: &mut [f32], at: usize, v: __m256) {
    let dst = &mut y[at..at + 8];
    // SAFETY: `dst` is 8 writable f32; `storeu` has no alignment requirement.
    unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), v) }
}

/// The eight signed bytes in the low half of `q`, as f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn widen8(q: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))
}

/// How a value is formed from its quant `q`, scale `d` and offset `m`.
#[derive(Clone, Copy)]
enum Op {
    /// `d * q`.
    Mul,
    /// `d * q + m`.
    MulAdd,
    /// `d * q - m`.
    MulSub,
}

/// Stores the 16 signed bytes of `q` as f32 values `op(d, q, m)` at `y[at..at + 16]`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn store16(y: &mut [f32], at: usize, q: __m128i, op: Op, d: __m256, m: __m256) {
    for (k, q) in [q, _mm_unpackhi_epi64(q, q)].into_iter().enumerate() {
        let dq = _mm256_mul_ps(d, widen8(q));
        let v = match op {
            Op::Mul => dq,
            Op::MulAdd => _mm256_add_ps(dq, m),
            Op::MulSub => _mm256_sub_ps(dq, m),
        };
        store8(y, at + 8 * k, v);
    }
}

/// [`store16`] for the 32 signed bytes of `q`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn store32(y: &mut [f32], at: usize, q: __m256i, op: Op, d: __m256, m: __m256) {
    store16(y, at, _mm256_castsi256_si128(q), op, d, m);
    store16(y, at + 16, _mm256_extracti128_si256::<1>(q), op, d, m);
}

/// 16 bytes of packed nibbles → (low nibbles, high nibbles), 16 bytes each.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn nibbles16(bytes: &[u8], at: usize) -> (__m128i, __m128i) {
    let packed = load16(bytes, at);
    let mask = _mm_set1_epi8(0x0F);
    (
        _mm_and_si128(packed, mask),
        _mm_and_si128(_mm_srli_epi16::<4>(packed), mask),
    )
}

/// 32 bytes of packed nibbles → (low nibbles, high nibbles), 32 bytes each.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn nibbles32(bytes: &[u8], at: usize) -> (__m256i, __m256i) {
    let packed = load32(bytes, at);
    let mask = _mm256_set1_epi8(0x0F);
    (
        _mm256_and_si256(packed, mask),
        _mm256_and_si256(_mm256_srli_epi16::<4>(packed), mask),
    )
}

/// 16 bits → 16 bytes: 0x10 where bit `i` of `bits` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn high_bits16(bits: u16) -> __m128i {
    // Byte i receives the byte of `bits` that holds bit i, then tests its own bit.
    let spread = _mm_shuffle_epi8(
        _mm_set1_epi16(bits as i16),
        _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
    );
    let bit = _mm_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit);
    _mm_and_si128(set, _mm_set1_epi8(0x10))
}

/// 0x10 in each byte of `qh` whose bit `bit` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn bit_to_0x10(qh: __m256i, bit: u32) -> __m256i {
    let mask = _mm256_set1_epi8((1u8 << bit) as i8);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, mask), mask);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

// ---------------------------------------------------------------------------------------
// Plain floats.

#[target_feature(enable = "avx2,f16c")]
fn f16_(blocks: &[[u8; 2]], out: &mut [[f32; 1]]) {
    let (x, y) = (blocks.as_flattened(), out.as_flattened_mut());
    let n = y.len().min(blocks.len());
    let mut i = 0;
    while i + 8 <= n {
        store8(y, i, _mm256_cvtph_ps(load16(x, 2 * i)));
        i += 8;
    }
    for (y, x) in y[i..n].iter_mut().zip(&blocks[i..n]) {
        *y = f16_to_f32(F16Le(*x));
    }
}

#[target_feature(enable = "avx2,f16c")]
fn bf16_(blocks: &[[u8; 2]], out: &mut [[f32; 1]]) {
    let (x, y) = (blocks.as_flattened(), out.as_flattened_mut());
    let n = y.len().min(blocks.len());
    let mut i = 0;
    while i + 8 <= n {
        let bits = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(load16(x, 2 * i)));
        store8(y, i, _mm256_castsi256_ps(bits));
        i += 8;
    }
    for (y, x) in y[i..n].iter_mut().zip(&blocks[i..n]) {
        *y = f32::from_bits((u16::from_le_bytes(*x) as u32) << 16);
    }
}

// ---------------------------------------------------------------------------------------
// Blocks of 32.

#[target_feature(enable = "avx2,f16c")]
fn q4_0(blocks: &[BlockQ4_0], out: &mut [[f32; QK]]) {
    let (eight, zero) = (_mm_set1_epi8(8), _mm256_setzero_ps());
    for (b, y) in blocks.iter().zip(out) {
        let d = _mm256_set1_ps(f16_to_f32(b.d));
        let (lo, hi) = nibbles16(&b.qs, 0);
        store16(y, 0, _mm_sub_epi8(lo, eight), Op::Mul, d, zero);
        store16(y, 16, _mm_sub_epi8(hi, eight), Op::Mul, d, zero);
    }
}

#[target_feature(enable = "avx2,f16c")]
fn q4_1(blocks: &[BlockQ4_1], out: &mut [[f32; QK]]) {
    for (b, y) in blocks.iter().zip(out) {
        let d = _mm256_set1_ps(f16_to_f32(b.d));
        let m = _mm256_set1_ps(f16_to_f32(b.m));
        let (lo, hi) = nibbles16(&b.qs, 0);
        store16(y, 0, lo, Op::MulAdd, d, m);
        store16(y, 16, hi, Op::MulAdd, d, m);
    }
}

/// The 5-bit quants of a `Q5_0`/`Q5_1` block: (values 0..16, values 16..32).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn five_bit(qh: [u8; 4], qs: &[u8; QK / 2]) -> (__m128i, __m128i) {
    let qh = u32::from_le_bytes(qh);
    let (lo, hi) = nibbles16(qs, 0);
    (
        _mm_or_si128(lo, high_bits16(qh as u16)),
        _mm_or_si128(hi, high_bits16((qh >> 16) as u16)),
    )
}

#[target_feature(enable = "avx2,f16c")]
fn q5_0(blocks: &[BlockQ5_0], out: &mut [[f32; QK]]) {
    let (sixteen, zero) = (_mm_set1_epi8(16), _mm256_setzero_ps());
    for (b, y) in blocks.iter().zip(out) {
        let d = _mm256_set1_ps(f16_to_f32(b.d));
        let (lo, hi) = five_bit(b.qh, &b.qs);
        store16(y, 0, _mm_sub_epi8(lo, sixteen), Op::Mul, d, zero);
        store16(y, 16, _mm_sub_epi8(hi, sixteen), Op::Mul, d, zero);
    }
}

#[target_feature(enable = "avx2,f16c")]
fn q5_1(blocks: &[BlockQ5_1], out: &mut [[f32; QK]]) {
    for (b, y) in blocks.iter().zip(out) {
        let d = _mm256_set1_ps(f16_to_f32(b.d));
        let m = _mm256_set1_ps(f16_to_f32(b.m));
        let (lo, hi) = five_bit(b.qh, &b.qs);
        store16(y, 0, lo, Op::MulAdd, d, m);
        store16(y, 16, hi, Op::MulAdd, d, m);
    }
}

#[target_feature(enable = "avx2,f16c")]
fn q8_0(blocks: &[BlockQ8_0], out: &mut [[f32; QK]]) {
    let zero = _mm256_setzero_ps();
    for (b, y) in blocks.iter().zip(out) {
        let d = _mm256_set1_ps(f16_to_f32(b.d));
        let q = load32(bytemuck::bytes_of(&b.qs), 0);
        store32(y, 0, q, Op::Mul, d, zero);
    }
}

/// Nibble-indexed lookups of a 16-entry signed byte table in the 16 bytes at
/// `qs[at..at + 16]`: (low nibbles' values, high nibbles' values).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn lookup16(table: &[i8; 16], qs: &[u8], at: usize) -> (__m128i, __m128i) {
    let table = load16(bytemuck::bytes_of(table), 0);
    let (lo, hi) = nibbles16(qs, at);
    (_mm_shuffle_epi8(table, lo), _mm_shuffle_epi8(table, hi))
}

#[target_feature(enable = "avx2,f16c")]
fn iq4_nl(blocks: &[BlockIQ4_NL], out: &mut [[f32; QK]]) {
    let zero = _mm256_setzero_ps();
    for (b, y) in blocks.iter().zip(out) {
        let d = _mm256_set1_ps(f16_to_f32(b.d));
        let (lo, hi) = lookup16(&KVALUES_IQ4NL, &b.qs, 0);
        store16(y, 0, lo, Op::Mul, d, zero);
        store16(y, 16, hi, Op::Mul, d, zero);
    }
}

#[target_feature(enable = "avx2,f16c")]
fn mxfp4(blocks: &[BlockMXFP4], out: &mut [[f32; QK]]) {
    let zero = _mm256_setzero_ps();
    for (b, y) in blocks.iter().zip(out) {
        let d = _mm256_set1_ps(e8m0_to_f32_half(b.e));
        let (lo, hi) = lookup16(&KVALUES_MXFP4, &b.qs, 0);
        store16(y, 0, lo, Op::Mul, d, zero);
        store16(y, 16, hi, Op::Mul, d, zero);
    }
}

// ---------------------------------------------------------------------------------------
// k-quants.

/// The two-bit fields `s` (0..4) of 32 bytes: values `32 s .. 32 s + 32` of a chunk of
/// 128 in `Q2_K`, `Q3_K` and `TQ2_0`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn crumbs(q: __m256i, s: usize) -> __m256i {
    let shifted = match s {
        0 => q,
        1 => _mm256_srli_epi16::<2>(q),
        2 => _mm256_srli_epi16::<4>(q),
        _ => _mm256_srli_epi16::<6>(q),
    };
    _mm256_and_si256(shifted, _mm256_set1_epi8(3))
}

#[target_feature(enable = "avx2,f16c")]
fn q2_k(blocks: &[BlockQ2_K], out: &mut [[f32; QK_K]]) {
    for (b, y) in blocks.iter().zip(out) {
        let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
        for c in 0..2 {
            let q = load32(&b.qs, 32 * c);
            for s in 0..4 {
                let q = crumbs(q, s);
                let halves = [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)];
                for (half, q) in halves.into_iter().enumerate() {
                    let i = 128 * c + 32 * s + 16 * half;
                    let sc = b.scales[i / 16];
                    let dl = _mm256_set1_ps(d * (sc & 0x0F) as f32);
                    let ml = _mm256_set1_ps(dmin * (sc >> 4) as f32);
                    store16(y, i, q, Op::MulSub, dl, ml);
                }
            }
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
fn q3_k(blocks: &[BlockQ3_K], out: &mut [[f32; QK_K]]) {
    let (four, zero) = (_mm256_set1_epi8(4), _mm256_setzero_ps());
    for (b, y) in blocks.iter().zip(out) {
        let d = f16_to_f32(b.d);
        let scales = q3_k_scales(&b.scales);
        let hmask = load32(&b.hmask, 0);
        for c in 0..2 {
            let q = load32(&b.qs, 32 * c);
            for s in 0..4 {
                // The high bit is stored inverted: q = low - 4 + (bit set ? 4 : 0).
                let bit = _mm256_set1_epi8((1u8 << (4 * c + s)) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, bit), bit);
                let high = _mm256_and_si256(set, four);
                let q = _mm256_sub_epi8(_mm256_add_epi8(crumbs(q, s), high), four);
                let halves = [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)];
                for (half, q) in halves.into_iter().enumerate() {
                    let i = 128 * c + 32 * s + 16 * half;
                    let dl = _mm256_set1_ps(d * scales[i / 16] as f32);
                    store16(y, i, q, Op::Mul, dl, zero);
                }
            }
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
fn q4_k(blocks: &[BlockQ4_K], out: &mut [[f32; QK_K]]) {
    for (b, y) in blocks.iter().zip(out) {
        let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
        let (sc, m) = k_scales_mins(&b.scales);
        for c in 0..4 {
            let (lo, hi) = nibbles32(&b.qs, 32 * c);
            for (g, q) in [(2 * c, lo), (2 * c + 1, hi)] {
                let dl = _mm256_set1_ps(d * sc[g] as f32);
                let ml = _mm256_set1_ps(dmin * m[g] as f32);
                store32(y, 32 * g, q, Op::MulSub, dl, ml);
            }
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
fn q5_k(blocks: &[BlockQ5_K], out: &mut [[f32; QK_K]]) {
    for (b, y) in blocks.iter().zip(out) {
        let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
        let (sc, m) = k_scales_mins(&b.scales);
        let qh = load32(&b.qh, 0);
        for c in 0..4 {
            let (lo, hi) = nibbles32(&b.qs, 32 * c);
            for (g, q) in [(2 * c, lo), (2 * c + 1, hi)] {
                let q = _mm256_or_si256(q, bit_to_0x10(qh, g as u32));
                let dl = _mm256_set1_ps(d * sc[g] as f32);
                let ml = _mm256_set1_ps(dmin * m[g] as f32);
                store32(y, 32 * g, q, Op::MulSub, dl, ml);
            }
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
fn q6_k(blocks: &[BlockQ6_K], out: &mut [[f32; QK_K]]) {
    let (mask4, mask_hi) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let (thirty_two, zero) = (_mm256_set1_epi8(32), _mm256_setzero_ps());
    for (b, y) in blocks.iter().zip(out) {
        let d = f16_to_f32(b.d);
        for h in 0..2 {
            let ql0 = load32(&b.ql, 64 * h);
            let ql1 = load32(&b.ql, 64 * h + 32);
            let qh = load32(&b.qh, 32 * h);
            // Runs of 32: low nibbles of ql0, of ql1, high nibbles of ql0, of ql1; the
            // top two bits are the successive crumbs of qh, moved to bits 4 and 5.
            let runs = [
                (_mm256_and_si256(ql0, mask4), _mm256_slli_epi16::<4>(qh)),
                (_mm256_and_si256(ql1, mask4), _mm256_slli_epi16::<2>(qh)),
                (_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), mask4), qh),
                (
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), mask4),
                    _mm256_srli_epi16::<2>(qh),
                ),
            ];
            for (k, (low, high)) in runs.into_iter().enumerate() {
                let q = _mm256_or_si256(low, _mm256_and_si256(high, mask_hi));
                let q = _mm256_sub_epi8(q, thirty_two);
                let i = 128 * h + 32 * k;
                let d0 = _mm256_set1_ps(d * b.scales[i / 16] as f32);
                let d1 = _mm256_set1_ps(d * b.scales[i / 16 + 1] as f32);
                store16(y, i, _mm256_castsi256_si128(q), Op::Mul, d0, zero);
                store16(
                    y,
                    i + 16,
                    _mm256_extracti128_si256::<1>(q),
                    Op::Mul,
                    d1,
                    zero,
                );
            }
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
fn iq4_xs(blocks: &[BlockIQ4_XS], out: &mut [[f32; QK_K]]) {
    let zero = _mm256_setzero_ps();
    for (b, y) in blocks.iter().zip(out) {
        let d = f16_to_f32(b.d);
        let scales_h = b.scales_h.get();
        for g in 0..8 {
            let low = (b.scales_l[g / 2] >> (4 * (g % 2))) & 0x0F;
            let high = ((scales_h >> (2 * g)) & 0x03) as u8;
            let dl = _mm256_set1_ps(d * ((low | (high << 4)) as i8 - 32) as f32);
            let (lo, hi) = lookup16(&KVALUES_IQ4NL, &b.qs, 16 * g);
            store16(y, 32 * g, lo, Op::Mul, dl, zero);
            store16(y, 32 * g + 16, hi, Op::Mul, dl, zero);
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
fn tq2_0(blocks: &[BlockTQ2_0], out: &mut [[f32; QK_K]]) {
    let (one, zero) = (_mm256_set1_epi8(1), _mm256_setzero_ps());
    for (b, y) in blocks.iter().zip(out) {
        let d = _mm256_set1_ps(f16_to_f32(b.d));
        for c in 0..2 {
            let q = load32(&b.qs, 32 * c);
            for s in 0..4 {
                let q = _mm256_sub_epi8(crumbs(q, s), one);
                store32(y, 128 * c + 32 * s, q, Op::Mul, d, zero);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Grid formats: the reference decoders' index and scale logic, with runs of 8 values
// written by AVX2.

impl Put for Avx2 {
    #[inline(always)]
    fn signed(self, y: &mut [f32], scale: f32, grid: u64, signs: u8) {
        // SAFETY: `self` exists only when `detect` found AVX2 and F16C on this CPU.
        unsafe { put_signed(y, scale, grid, signs) }
    }

    #[inline(always)]
    fn shifted(self, y: &mut [f32], scale: f32, grid: u64, delta: f32) {
        // SAFETY: `self` exists only when `detect` found AVX2 and F16C on this CPU.
        unsafe { put_shifted(y, scale, grid, delta) }
    }
}

/// [`Put::signed`] for eight values: the grid bytes widened, scaled, and their sign
/// bits flipped where `signs` has a bit set.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn put_signed(y: &mut [f32], scale: f32, grid: u64, signs: u8) {
    let g = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(grid as i64)));
    let v = _mm256_mul_ps(_mm256_set1_ps(scale), g);
    let bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    let set = _mm256_cmpeq_epi32(
        _mm256_and_si256(_mm256_set1_epi32(signs as i32), bits),
        bits,
    );
    let sign = _mm256_castsi256_ps(_mm256_slli_epi32::<31>(set));
    store8(y, 0, _mm256_xor_ps(v, sign));
}

/// [`Put::shifted`] for eight values: the signed grid bytes widened, shifted by
/// `delta`, then scaled.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn put_shifted(y: &mut [f32], scale: f32, grid: u64, delta: f32) {
    let g = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(grid as i64)));
    let v = _mm256_add_ps(g, _mm256_set1_ps(delta));
    store8(y, 0, _mm256_mul_ps(_mm256_set1_ps(scale), v));
}

/// A kernel per grid format: the generic decoder, inlined here so that it is compiled
/// for AVX2, with [`Avx2`] as its [`Put`].
macro_rules! grid_kernels {
    ($($name:ident => $with:ident: $block:ty,)*) => {
        $(
            #[target_feature(enable = "avx2,f16c")]
            fn $name(blocks: &[$block], out: &mut [[f32; QK_K]]) {
                // This function runs only where AVX2 and F16C are present, which is
                // what the proof states.
                let proof = Avx2(());
                for (b, y) in blocks.iter().zip(out) {
                    scalar::$with(proof, b, y);
                }
            }
        )*
    };
}

scalar::for_grid_formats!(grid_kernels);
