//! AVX2 kernels of the super-block formats that llama.cpp's AVX2 build multiplies lane
//! by lane: `Q2_K`, `Q3_K`, `IQ4_XS`, the grid formats (`IQ3_S`, `IQ3_XXS`, `IQ2_XXS`,
//! `IQ2_XS`, `IQ2_S`, `IQ1_S`, `IQ1_M`) and the ternary formats (`TQ1_0`, `TQ2_0`, whose
//! batches all take the dot product: llama.cpp has no GEMM for them).
//!
//! For each super-block and token the integers come out as llama.cpp's dot products
//! hold them: the weights unpacked 32 at a time into bytes, `maddubs` against the
//! activations, a `madd` against the group's scale (broadcast by one `pshufb`), so that
//! lane `l` of one i32 vector covers values `4l .. 4l + 4` of every 32. What follows is
//! shared by the formats ([`dot_lanes`]) and repeats llama.cpp's float operations: one
//! token at a time its dot product (eight lanes fused at `dx · d`, reduced at the end),
//! in batches of [`GEMM_MIN_TOKENS`](crate::matmul::activation::GEMM_MIN_TOKENS) or more
//! its tiled GEMM (per super-block `d · Σ` rounded, then fused at `dx`).

use std::arch::x86_64::*;
use std::mem::{offset_of, size_of};

use super::kquants::{act_ptrs, blocks, pick_i16};
use super::{hsum_epi32, hsum_ps, load32, load_f16};
use crate::blocks::{BlockIQ4_XS, BlockQ2_K, BlockQ3_K, BlockTQ1_0, BlockTQ2_0};
use crate::decode::grids::KVALUES_IQ4NL;
use crate::matmul::activation::Q8KRow;
use crate::matmul::grids::Grid;
use crate::matmul::portable::kind;

/// The formats of this module, as the const parameter of [`dot_lanes`].
pub(crate) mod format {
    pub const Q2_K: u8 = 0;
    pub const Q3_K: u8 = 1;
    pub const IQ4_XS: u8 = 2;
    pub const IQ3_S: u8 = 3;
    pub const IQ3_XXS: u8 = 4;
    pub const IQ1_S: u8 = 8;
    pub const IQ1_M: u8 = 9;
    pub const IQ2_S: u8 = 7;
    pub const IQ2_XS: u8 = 6;
    pub const IQ2_XXS: u8 = 5;
    pub const TQ1_0: u8 = 10;
    pub const TQ2_0: u8 = 11;
}

/// The grid format of `F`, if it is one.
const fn grid_of(f: u8) -> Option<Grid> {
    match f {
        format::IQ3_S => Some(Grid::IQ3S),
        format::IQ3_XXS => Some(Grid::IQ3XXS),
        format::IQ2_XXS => Some(Grid::IQ2XXS),
        format::IQ2_XS => Some(Grid::IQ2XS),
        format::IQ2_S => Some(Grid::IQ2S),
        format::IQ1_S => Some(Grid::IQ1S),
        format::IQ1_M => Some(Grid::IQ1M),
        _ => None,
    }
}

/// The power of two folded into `d` (see [`Grid::factor`]); 1 for the others.
const fn factor(f: u8) -> f32 {
    match grid_of(f) {
        Some(grid) => grid.factor(),
        None => 1.0,
    }
}

/// Bytes of one super-block of `format` `F`.
const fn block_bytes(f: u8) -> usize {
    match f {
        format::Q2_K => size_of::<BlockQ2_K>(),
        format::Q3_K => size_of::<BlockQ3_K>(),
        format::IQ4_XS => size_of::<BlockIQ4_XS>(),
        format::TQ1_0 => size_of::<BlockTQ1_0>(),
        format::TQ2_0 => size_of::<BlockTQ2_0>(),
        _ => match grid_of(f) {
            Some(grid) => grid.block_bytes(),
            None => panic!("not a lane format"),
        },
    }
}

/// What format `F` adds to its lanes ([`kind`]).
const fn kind_of(f: u8) -> u8 {
    match f {
        format::Q2_K => kind::MINS,
        format::IQ1_S => kind::DELTA_SUM,
        format::IQ1_M => kind::DELTA_LANES,
        format::TQ1_0 | format::TQ2_0 => kind::TERNARY,
        _ => kind::PLAIN,
    }
}

/// `Q2_K` super-block for each token: `Σ scale_g Σ q qx` in eight i32 lanes, and the
/// min terms `min_g · Σ qx` in eight more (lane `l` holding groups `2l`, `2l + 1`, one
/// `madd` of the mins against the activations' sums per 16).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the super-block and 256 activations and 16
/// sums behind each pointer must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q2_k_ints<const N: usize>(
    block: *const u8,
    qx: [*const i8; N],
    bsums: [*const i16; N],
) -> ([__m256i; N], [__m256i; N]) {
    // SAFETY: the 16 scale bytes lie inside the readable block.
    let packed = unsafe { _mm_loadu_si128(block.add(offset_of!(BlockQ2_K, scales)).cast()) };
    let m4 = _mm_set1_epi8(0x0F);
    let scales = _mm256_cvtepi8_epi16(_mm_and_si128(packed, m4));
    let mins = _mm256_cvtepi8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(packed), m4));
    let mut min_terms = [_mm256_setzero_si256(); N];
    for t in 0..N {
        // SAFETY: 16 sums are readable behind each pointer per the contract.
        let sums = unsafe { _mm256_loadu_si256(bsums[t].cast()) };
        min_terms[t] = _mm256_madd_epi16(mins, sums);
    }
    let halves = [
        _mm256_permute2x128_si256::<0x00>(scales, scales),
        _mm256_permute2x128_si256::<0x11>(scales, scales),
    ];
    let m3 = _mm256_set1_epi8(3);
    let mut dots = [_mm256_setzero_si256(); N];
    for (c, &scales) in halves.iter().enumerate() {
        // SAFETY: the 32 bytes of qs for values 128c .. 128c + 128 lie inside the block.
        let bits = unsafe { load32(block.add(offset_of!(BlockQ2_K, qs) + 32 * c)) };
        for s in 0..4 {
            let q = _mm256_and_si256(_mm256_srl_epi16(bits, _mm_cvtsi32_si128(2 * s)), m3);
            let scale = _mm256_shuffle_epi8(scales, pick_i16(2 * s as usize, 2 * s as usize + 1));
            for t in 0..N {
                // SAFETY: 256 activations are readable behind each pointer.
                let x = unsafe { load32(qx[t].add(128 * c + 32 * s as usize).cast()) };
                let p = _mm256_maddubs_epi16(q, x);
                dots[t] = _mm256_add_epi32(dots[t], _mm256_madd_epi16(scale, p));
            }
        }
    }
    (dots, min_terms)
}

/// The sixteen 6-bit scales of a `Q3_K` super-block minus 32, as i16: scale `k` has its
/// low four bits in byte `k % 8` (low nibble for `k < 8`) and its top two bits in byte
/// `8 + k % 4` (bits `2 (k / 4)`).
///
/// # Safety
/// `p..p + 12` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q3_k_scales(p: *const u8) -> __m256i {
    // SAFETY: readable per the contract; `read_unaligned` has no alignment requirement.
    let [a0, a1, a2] = unsafe { [0, 4, 8].map(|at| p.add(at).cast::<u32>().read_unaligned()) };
    let (low2, low4) = (0x0303_0303u32, 0x0F0F_0F0Fu32);
    let s0 = (a0 & low4) | ((a2 & low2) << 4);
    let s1 = (a1 & low4) | (((a2 >> 2) & low2) << 4);
    let s2 = ((a0 >> 4) & low4) | (((a2 >> 4) & low2) << 4);
    let s3 = ((a1 >> 4) & low4) | (((a2 >> 6) & low2) << 4);
    let packed = _mm_setr_epi32(s0 as i32, s1 as i32, s2 as i32, s3 as i32);
    _mm256_cvtepi8_epi16(_mm_sub_epi8(packed, _mm_set1_epi8(32)))
}

/// `Q3_K` super-block for each token: `Σ scale_g Σ q qx` in eight i32 lanes, `q` the
/// value in `-4..=3`. As llama.cpp does, the low two bits and the inverted high bit
/// (4 where it is clear) meet the activations in two `maddubs`, whose difference is
/// the signed product.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the super-block and 256 activations behind
/// each pointer must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q3_k_ints<const N: usize>(block: *const u8, qx: [*const i8; N]) -> [__m256i; N] {
    // SAFETY: the scales and hmask lie inside the readable block.
    let (scales, hbits) = unsafe {
        (
            q3_k_scales(block.add(offset_of!(BlockQ3_K, scales))),
            load32(block.add(offset_of!(BlockQ3_K, hmask))),
        )
    };
    let halves = [
        _mm256_permute2x128_si256::<0x00>(scales, scales),
        _mm256_permute2x128_si256::<0x11>(scales, scales),
    ];
    let (m3, four) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
    let mut dots = [_mm256_setzero_si256(); N];
    for (c, &scales) in halves.iter().enumerate() {
        // SAFETY: the 32 bytes of qs for values 128c .. 128c + 128 lie inside the block.
        let bits = unsafe { load32(block.add(offset_of!(BlockQ3_K, qs) + 32 * c)) };
        for s in 0..4 {
            let low = _mm256_and_si256(_mm256_srl_epi16(bits, _mm_cvtsi32_si128(2 * s)), m3);
            let bit = _mm256_set1_epi8((1u8 << (4 * c as i32 + s)) as i8);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(hbits, bit), bit);
            let high = _mm256_andnot_si256(set, four);
            let scale = _mm256_shuffle_epi8(scales, pick_i16(2 * s as usize, 2 * s as usize + 1));
            for t in 0..N {
                // SAFETY: 256 activations are readable behind each pointer.
                let x = unsafe { load32(qx[t].add(128 * c + 32 * s as usize).cast()) };
                let p =
                    _mm256_sub_epi16(_mm256_maddubs_epi16(low, x), _mm256_maddubs_epi16(high, x));
                dots[t] = _mm256_add_epi32(dots[t], _mm256_madd_epi16(scale, p));
            }
        }
    }
    dots
}

/// `IQ4_XS` super-block for each token: `Σ (ls_g − 32) Σ kvalues[q] qx` in eight i32
/// lanes. As llama.cpp does, one `pshufb` looks the table up for 16 nibbles, and the
/// signed values meet the activations as `maddubs(|w|, sign(qx, w))`: `|w| ≤ 127`, so
/// the pairwise i16 sums cannot saturate.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the super-block and 256 activations behind
/// each pointer must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_xs_ints<const N: usize>(block: *const u8, qx: [*const i8; N]) -> [__m256i; N] {
    // SAFETY: the table holds 16 bytes; the scales lie inside the readable block.
    let (table, scales_h, scales_l) = unsafe {
        (
            _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast()),
            block
                .add(offset_of!(BlockIQ4_XS, scales_h))
                .cast::<u16>()
                .read_unaligned(),
            block
                .add(offset_of!(BlockIQ4_XS, scales_l))
                .cast::<[u8; 4]>()
                .read_unaligned(),
        )
    };
    let m4 = _mm_set1_epi8(0x0F);
    let mut dots = [_mm256_setzero_si256(); N];
    for g in 0..8 {
        // SAFETY: the 16 bytes of group g lie inside the readable block.
        let bits =
            unsafe { _mm_loadu_si128(block.add(offset_of!(BlockIQ4_XS, qs) + 16 * g).cast()) };
        let w = _mm256_set_m128i(
            _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(bits), m4)),
            _mm_shuffle_epi8(table, _mm_and_si128(bits, m4)),
        );
        let low = (scales_l[g / 2] >> (4 * (g % 2))) & 0x0F;
        let high = ((scales_h >> (2 * g)) & 3) as u8;
        let scale = _mm256_set1_epi16(i16::from(low | (high << 4)) - 32);
        let magnitude = _mm256_sign_epi8(w, w);
        for t in 0..N {
            // SAFETY: 256 activations are readable behind each pointer.
            let x = unsafe { load32(qx[t].add(32 * g).cast()) };
            let p = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, w));
            dots[t] = _mm256_add_epi32(dots[t], _mm256_madd_epi16(p, scale));
        }
    }
    dots
}

/// The activations' sums per 16 of each token in the lanes of the dot products (lane
/// `l` holding groups `2l` and `2l + 1`), which the ternary formats subtract.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; 16 sums behind each pointer must be
/// readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sum_lanes<const N: usize>(bsums: [*const i16; N]) -> [__m256i; N] {
    let ones = _mm256_set1_epi16(1);
    // SAFETY: 16 sums are readable behind each pointer per the contract.
    bsums.map(|p| _mm256_madd_epi16(unsafe { _mm256_loadu_si256(p.cast()) }, ones))
}

/// Stored ternary values (0, 1, 2) against 32 activations of each token: `maddubs`,
/// then a `madd` against ones into the lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ternary_madd(q: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1))
}

/// `TQ2_0` super-block for each token: `Σ q · qx` in eight i32 lanes (`q` the stored
/// 0, 1 or 2, value `128c + 32s + l` in bits `2s, 2s + 1` of `qs[32c + l]`), and the
/// activations' sums per 16 in eight more.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the super-block and 256 activations and 16
/// sums behind each pointer must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tq2_0_ints<const N: usize>(
    block: *const u8,
    qx: [*const i8; N],
    bsums: [*const i16; N],
) -> ([__m256i; N], [__m256i; N]) {
    let m3 = _mm256_set1_epi8(3);
    let mut dots = [_mm256_setzero_si256(); N];
    for c in 0..2 {
        // SAFETY: the 32 bytes of qs for values 128c .. 128c + 128 lie inside the block.
        let bits = unsafe { load32(block.add(offset_of!(BlockTQ2_0, qs) + 32 * c)) };
        for s in 0..4 {
            let q = _mm256_and_si256(_mm256_srl_epi16(bits, _mm_cvtsi32_si128(2 * s)), m3);
            for t in 0..N {
                // SAFETY: 256 activations are readable behind each pointer.
                let x = unsafe { load32(qx[t].add(128 * c + 32 * s as usize).cast()) };
                dots[t] = _mm256_add_epi32(dots[t], ternary_madd(q, x));
            }
        }
    }
    // SAFETY: forwarded contract.
    (dots, unsafe { sum_lanes(bsums) })
}

/// The top base-3 digit (0, 1 or 2) of each byte, `b · 3 >> 8`, as llama.cpp computes
/// it: one saturating decrement and two averages make `(3b) / 4` without overflow, of
/// which the top two bits are the digit.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn top_trits(b: __m256i) -> __m256i {
    let b = _mm256_subs_epu8(b, _mm256_set1_epi8(1));
    let three_quarters = _mm256_avg_epu8(b, _mm256_avg_epu8(b, _mm256_setzero_si256()));
    _mm256_and_si256(_mm256_srli_epi16::<6>(three_quarters), _mm256_set1_epi8(3))
}

/// Bytes times 3 and times 9, modulo 256.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn times3(b: __m256i) -> __m256i {
    _mm256_add_epi8(b, _mm256_add_epi8(b, b))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn times9(b: __m256i) -> __m256i {
    let eight = _mm256_and_si256(_mm256_slli_epi16::<3>(b), _mm256_set1_epi8(-8));
    _mm256_add_epi8(eight, b)
}

/// `TQ1_0` super-block for each token: `Σ q · qx` in eight i32 lanes (`q` the stored
/// 0, 1 or 2: digit `p` of byte `b` of the first 32 bytes of `qs` is value `32p + b`, of
/// the next 16 value `160 + 16p + b`, digit `p` of `qh[b]` value `240 + 4p + b`; each
/// byte times `3^p` brings digit `p` to the top), and the activations' sums per 16 in
/// eight more.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the super-block and 256 activations and 16
/// sums behind each pointer must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tq1_0_ints<const N: usize>(
    block: *const u8,
    qx: [*const i8; N],
    bsums: [*const i16; N],
) -> ([__m256i; N], [__m256i; N]) {
    // SAFETY: qs (48 bytes) and qh (4 bytes) lie inside the readable block.
    let (wide, narrow, qh) = unsafe {
        (
            load32(block.add(offset_of!(BlockTQ1_0, qs))),
            _mm_loadu_si128(block.add(offset_of!(BlockTQ1_0, qs) + 32).cast()),
            block
                .add(offset_of!(BlockTQ1_0, qh))
                .cast::<[u8; 4]>()
                .read_unaligned(),
        )
    };
    let (w3, w9) = (times3(wide), times9(wide));
    let narrow = _mm256_set_m128i(narrow, narrow);
    let (n3, n9) = (times3(narrow), times9(narrow));
    // qh's four bytes times 1, 3, 9 and 27, byte 4p + b holding qh[b] · 3^p.
    let high: [u8; 16] = std::array::from_fn(|i| qh[i % 4].wrapping_mul([1, 3, 9, 27][i / 4]));
    // SAFETY: `high` holds 16 bytes; `loadu` has no alignment requirement.
    let high = unsafe { _mm_loadu_si128(high.as_ptr().cast()) };
    // The 32 stored values meeting activations 32k .. 32k + 32, for each k.
    let chunks = [
        wide,
        w3,
        w9,
        times9(w3),
        times9(w9),
        _mm256_blend_epi32::<0xF0>(narrow, n3),
        _mm256_blend_epi32::<0xF0>(n9, times9(n3)),
        _mm256_set_m128i(high, _mm256_castsi256_si128(times9(n9))),
    ]
    .map(|b| top_trits(b));
    let mut dots = [_mm256_setzero_si256(); N];
    for (k, &q) in chunks.iter().enumerate() {
        for t in 0..N {
            // SAFETY: 256 activations are readable behind each pointer.
            let x = unsafe { load32(qx[t].add(32 * k).cast()) };
            dots[t] = _mm256_add_epi32(dots[t], ternary_madd(q, x));
        }
    }
    // SAFETY: forwarded contract.
    (dots, unsafe { sum_lanes(bsums) })
}

/// A grid format's super-block for each token: per sub-block of 32, the four runs'
/// magnitudes in one register, their sign bits spread to byte masks that negate the
/// activations (`(x ^ m) − m`, as llama.cpp does), one `maddubs` and a `madd` against
/// the halves' scales. Magnitudes are below 64, so no pair saturates. For the IQ1
/// formats also the shift terms: the activations signed by each run's `δ`, summed in
/// pairs by a `maddubs` against ones, and the same `madd`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the super-block and 256 activations behind
/// each pointer must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn grid_ints<const N: usize>(
    grid: Grid,
    block: *const u8,
    qx: [*const i8; N],
) -> ([__m256i; N], [__m256i; N]) {
    // SAFETY: the whole super-block is readable per the contract.
    let bytes = unsafe { std::slice::from_raw_parts(block, grid.block_bytes()) };
    // Byte j of run k (byte 8k + j of the register) tests bit j of sign byte k.
    let spread = _mm256_setr_epi64x(
        0,
        0x0101_0101_0101_0101,
        0x0202_0202_0202_0202,
        0x0303_0303_0303_0303,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let ones = _mm256_set1_epi8(1);
    let shifted = matches!(grid, Grid::IQ1S | Grid::IQ1M);
    let mut dots = [_mm256_setzero_si256(); N];
    let mut deltas = [_mm256_setzero_si256(); N];
    for s in 0..8 {
        let sub = grid.sub(bytes, s);
        let magnitudes = _mm256_setr_epi64x(
            sub.grid[0] as i64,
            sub.grid[1] as i64,
            sub.grid[2] as i64,
            sub.grid[3] as i64,
        );
        let signs = _mm256_shuffle_epi8(_mm256_set1_epi32(i32::from_le_bytes(sub.signs)), spread);
        let negate = _mm256_cmpeq_epi8(_mm256_and_si256(signs, bit), bit);
        let scale = _mm256_set_m128i(_mm_set1_epi16(sub.scales[1]), _mm_set1_epi16(sub.scales[0]));
        // Each run's δ (±1) in its 8 bytes.
        let run = |k: usize| (u64::from(sub.deltas[k] as u8) * 0x0101_0101_0101_0101) as i64;
        let shifts = _mm256_setr_epi64x(run(0), run(1), run(2), run(3));
        for t in 0..N {
            // SAFETY: 256 activations are readable behind each pointer.
            let x = unsafe { load32(qx[t].add(32 * s).cast()) };
            let signed = _mm256_sub_epi8(_mm256_xor_si256(x, negate), negate);
            let p = _mm256_maddubs_epi16(magnitudes, signed);
            dots[t] = _mm256_add_epi32(dots[t], _mm256_madd_epi16(p, scale));
            if shifted {
                let p = _mm256_maddubs_epi16(ones, _mm256_sign_epi8(x, shifts));
                deltas[t] = _mm256_add_epi32(deltas[t], _mm256_madd_epi16(p, scale));
            }
        }
    }
    (dots, deltas)
}

/// The integer lanes of format `F` for each token: the dot products and the min terms
/// (zeros without mins).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the super-block and 256 activations and 16
/// sums behind each pointer must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_ints<const F: u8, const N: usize>(
    block: *const u8,
    qx: [*const i8; N],
    bsums: [*const i16; N],
) -> ([__m256i; N], [__m256i; N]) {
    let zeros = [_mm256_setzero_si256(); N];
    // SAFETY: forwarded contract.
    unsafe {
        match F {
            format::Q2_K => q2_k_ints::<N>(block, qx, bsums),
            format::Q3_K => (q3_k_ints::<N>(block, qx), zeros),
            format::IQ4_XS => (iq4_xs_ints::<N>(block, qx), zeros),
            format::TQ1_0 => tq1_0_ints::<N>(block, qx, bsums),
            format::TQ2_0 => tq2_0_ints::<N>(block, qx, bsums),
            _ => match grid_of(F) {
                Some(grid) => grid_ints::<N>(grid, block, qx),
                None => unreachable!("not a lane format"),
            },
        }
    }
}

/// A super-block's `d` (with the format's constant factor) and `dmin` (0 without).
///
/// # Safety
/// The super-block at `block` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_scales<const F: u8>(block: *const u8) -> (f32, f32) {
    // SAFETY: the scales lie inside the readable block.
    unsafe {
        match F {
            format::Q2_K => (
                load_f16(block.add(offset_of!(BlockQ2_K, d))),
                load_f16(block.add(offset_of!(BlockQ2_K, dmin))),
            ),
            format::Q3_K => (load_f16(block.add(offset_of!(BlockQ3_K, d))), 0.0),
            format::IQ4_XS => (load_f16(block.add(offset_of!(BlockIQ4_XS, d))), 0.0),
            format::TQ1_0 => (load_f16(block.add(offset_of!(BlockTQ1_0, d))), 0.0),
            format::TQ2_0 => (load_f16(block.add(offset_of!(BlockTQ2_0, d))), 0.0),
            format::IQ1_M => (
                Grid::IQ1M.d(std::slice::from_raw_parts(block, Grid::IQ1M.block_bytes())),
                0.0,
            ),
            // Every other grid format starts with its f16 `d` (checked in `grids`).
            _ => (load_f16(block), 0.0),
        }
    }
}

/// `R` rows of format `F` against `N` tokens: per super-block, one token at a time the
/// min lanes (if any) fused at `−dx · dmin` and the dot product's lanes at `dx · d`,
/// reduced at the end; in batches of
/// [`GEMM_MIN_TOKENS`](crate::matmul::activation::GEMM_MIN_TOKENS) or more `d · Σ`
/// rounded, `dmin · Σmin` fused off it, the result fused at `dx` into one accumulator.
/// The ternary formats subtract the activations' sums from the lanes and take the dot
/// product at every batch size.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_lanes<const F: u8, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    let bytes = block_bytes(F);
    let nb = blocks(&rows, bytes, &acts);
    let kind = kind_of(F);
    let delta = kind == kind::DELTA_SUM || kind == kind::DELTA_LANES;
    let gemm = acts.map(|a| a.gemm && kind != kind::TERNARY);
    let mut out = [[0.0f32; N]; R];
    // One row after another: interleaving rows would run out of registers.
    for r in 0..R {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut acc_delta = [_mm256_setzero_ps(); N];
        let mut sum_delta = [0.0f32; N];
        let mut gemm_acc = [0.0f32; N];
        for b in 0..nb {
            // SAFETY: b < nb bounds the block and the activations; the features are
            // present per this function's contract.
            let ((d, dmin), (mut dots, extra)) = unsafe {
                let (qx, bsums) = act_ptrs(&acts, b);
                let block = rows[r].as_ptr().add(b * bytes);
                (lane_scales::<F>(block), lane_ints::<F, N>(block, qx, bsums))
            };
            for t in 0..N {
                let dx = acts[t].d[b];
                if kind == kind::TERNARY {
                    dots[t] = _mm256_sub_epi32(dots[t], extra[t]);
                }
                if gemm[t] {
                    let total = if delta {
                        8 * hsum_epi32(dots[t]) + hsum_epi32(extra[t])
                    } else {
                        hsum_epi32(dots[t])
                    };
                    let mut res = (d * factor(F)) * total as f32;
                    if kind == kind::MINS {
                        res = (-dmin).mul_add(hsum_epi32(extra[t]) as f32, res);
                    }
                    gemm_acc[t] = res.mul_add(dx, gemm_acc[t]);
                    continue;
                }
                if kind == kind::MINS {
                    let scale = _mm256_set1_ps(-dx * dmin);
                    acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(extra[t]), acc[t]);
                }
                let scale = dx * d;
                let vscale = _mm256_set1_ps(scale);
                acc[t] = _mm256_fmadd_ps(vscale, _mm256_cvtepi32_ps(dots[t]), acc[t]);
                if kind == kind::DELTA_SUM {
                    sum_delta[t] = scale.mul_add(hsum_epi32(extra[t]) as f32, sum_delta[t]);
                } else if kind == kind::DELTA_LANES {
                    let ints = _mm256_cvtepi32_ps(extra[t]);
                    acc_delta[t] = _mm256_fmadd_ps(vscale, ints, acc_delta[t]);
                }
            }
        }
        for t in 0..N {
            out[r][t] = if gemm[t] {
                gemm_acc[t]
            } else if kind == kind::DELTA_SUM {
                hsum_ps(acc[t]) + factor(F) * sum_delta[t]
            } else if kind == kind::DELTA_LANES {
                hsum_ps(acc[t]) + factor(F) * hsum_ps(acc_delta[t])
            } else {
                factor(F) * hsum_ps(acc[t])
            };
        }
    }
    out
}

/// `R` `Q2_K` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q2_k<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_lanes::<{ format::Q2_K }, R, N>(rows, acts) }
}

/// `R` `Q3_K` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q3_k<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_lanes::<{ format::Q3_K }, R, N>(rows, acts) }
}

/// `R` `IQ4_XS` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq4_xs<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_lanes::<{ format::IQ4_XS }, R, N>(rows, acts) }
}

/// `R` `IQ3_S` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq3_s<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_lanes::<{ format::IQ3_S }, R, N>(rows, acts) }
}

/// `R` `IQ3_XXS` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq3_xxs<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_lanes::<{ format::IQ3_XXS }, R, N>(rows, acts) }
}

/// `R` `IQ2_XXS` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq2_xxs<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_lanes::<{ format::IQ2_XXS }, R, N>(rows, acts) }
}

/// `R` `IQ2_XS` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq2_xs<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_lanes::<{ format::IQ2_XS }, R, N>(rows, acts) }
}

/// `R` `IQ2_S` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq2_s<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_lanes::<{ format::IQ2_S }, R, N>(rows, acts) }
}

/// `R` `IQ1_S` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq1_s<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_lanes::<{ format::IQ1_S }, R, N>(rows, acts) }
}

/// `R` `IQ1_M` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq1_m<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_lanes::<{ format::IQ1_M }, R, N>(rows, acts) }
}

/// `R` `TQ1_0` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_tq1_0<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_lanes::<{ format::TQ1_0 }, R, N>(rows, acts) }
}

/// `R` `TQ2_0` rows against `N` tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_tq2_0<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8KRow<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    unsafe { dot_lanes::<{ format::TQ2_0 }, R, N>(rows, acts) }
}

#[cfg(test)]
mod block;
#[cfg(test)]
pub(crate) use block::block_lanes;
