//! The grid formats' blocks unpacked for the products: `IQ3_S`, `IQ3_XXS`, `IQ2_XXS`,
//! `IQ2_XS`, `IQ2_S`, `IQ1_S`, `IQ1_M`.
//!
//! Each sub-block of 32 values is four runs of 8 grid magnitudes with a sign byte per
//! run, a scale per half of 16 values and, for the IQ1 formats, a shift per run, all
//! small integers: what both the portable
//! and the AVX2 kernels multiply with the activations. Unpacking is plain integer code
//! shared by both paths, so they cannot disagree on it; the decoders
//! (`decode::scalar::iquants`) read the same fields into floats.

use std::mem::offset_of;

use crate::blocks::{
    Block, BlockIQ1_M, BlockIQ1_S, BlockIQ2_S, BlockIQ2_XS, BlockIQ2_XXS, BlockIQ3_S, BlockIQ3_XXS,
};
use crate::decode::grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
};
use crate::decode::scalar::iq1_m_scale;

// The kernels read every grid format's f16 super-block scale `d` from its first bytes
// (but `IQ1_M`'s, which has none: see [`Grid::d`]).
const _: () = assert!(offset_of!(BlockIQ3_S, d) == 0 && offset_of!(BlockIQ3_XXS, d) == 0);
const _: () = assert!(offset_of!(BlockIQ2_XXS, d) == 0 && offset_of!(BlockIQ1_S, d) == 0);
const _: () = assert!(offset_of!(BlockIQ2_S, d) == 0 && offset_of!(BlockIQ2_XS, d) == 0);

/// One sub-block of 32 values of a grid format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct GridSub {
    /// Run `k`'s magnitudes: byte `j` is the magnitude of value `8k + j`.
    pub grid: [u64; 4],
    /// Run `k`'s signs: bit `j` set negates value `8k + j`.
    pub signs: [u8; 4],
    /// The integer scales of values `0..16` and `16..32`.
    pub scales: [i16; 2],
    /// Run `k`'s shift `δ` (±1) of the IQ1 formats, whose values are `g + δ/8`; 0 for
    /// the others.
    pub deltas: [i8; 4],
}

/// The grid formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Grid {
    IQ3S,
    IQ3XXS,
    IQ2XXS,
    IQ2XS,
    IQ2S,
    IQ1S,
    IQ1M,
}

impl Grid {
    /// Bytes of one super-block.
    pub(crate) const fn block_bytes(self) -> usize {
        match self {
            Grid::IQ3S => size_of::<BlockIQ3_S>(),
            Grid::IQ3XXS => size_of::<BlockIQ3_XXS>(),
            Grid::IQ2XXS => size_of::<BlockIQ2_XXS>(),
            Grid::IQ2XS => size_of::<BlockIQ2_XS>(),
            Grid::IQ2S => size_of::<BlockIQ2_S>(),
            Grid::IQ1S => size_of::<BlockIQ1_S>(),
            Grid::IQ1M => size_of::<BlockIQ1_M>(),
        }
    }

    /// The power of two that llama.cpp folds into the super-block scale `d` (its dot
    /// products multiply the reduced sum by it; its GEMM multiplies `d` by it first).
    pub(crate) const fn factor(self) -> f32 {
        match self {
            Grid::IQ3S => 1.0,
            Grid::IQ3XXS => 0.25,
            Grid::IQ2XXS => 0.125,
            Grid::IQ2XS => 0.125,
            Grid::IQ2S => 0.125,
            Grid::IQ1S | Grid::IQ1M => 0.125,
        }
    }

    /// The super-block scale `d` of `block`: the f16 at its start, or for `IQ1_M` the
    /// one spread over the top nibbles of its scales.
    #[inline]
    pub(crate) fn d(self, block: &[u8]) -> f32 {
        match self {
            Grid::IQ1M => iq1_m_scale(&one::<BlockIQ1_M>(block).scales),
            _ => half::f16::from_le_bytes([block[0], block[1]]).to_f32(),
        }
    }

    /// Sub-block `s` (of 8) of the super-block `block` (at least
    /// [`Grid::block_bytes`] long).
    #[inline(always)]
    pub(crate) fn sub(self, block: &[u8], s: usize) -> GridSub {
        match self {
            Grid::IQ3S => iq3_s(one(block), s),
            Grid::IQ3XXS => iq3_xxs(one(block), s),
            Grid::IQ2XXS => iq2_xxs(one(block), s),
            Grid::IQ2XS => iq2_xs(one(block), s),
            Grid::IQ2S => iq2_s(one(block), s),
            Grid::IQ1S => iq1_s(one(block), s),
            Grid::IQ1M => iq1_m(one(block), s),
        }
    }
}

/// The block at the start of `bytes` (at least one block long).
#[inline(always)]
fn one<B: Block>(bytes: &[u8]) -> &B {
    bytemuck::from_bytes(&bytes[..size_of::<B>()])
}

/// `2 · ls + 1` for a 4-bit `ls`: the odd scales of the IQ2 and IQ3 formats.
#[inline]
fn odd(ls: u8) -> i16 {
    2 * i16::from(ls & 0x0F) + 1
}

/// `IQ3_S`: run `k` of sub-block `s` is the two 4-value entries of `IQ3S_GRID` at
/// indices `8s + 2k` and `8s + 2k + 1` (the low 8 bits in `qs`, the ninth bit `i % 8`
/// of `qh[i / 8]`), signed by `signs[4s + k]`; one scale per 32 values, a nibble of
/// `scales[s / 2]`.
#[inline(always)]
fn iq3_s(b: &BlockIQ3_S, s: usize) -> GridSub {
    let index = |i: usize| usize::from(b.qs[i]) | (usize::from((b.qh[i / 8] >> (i % 8)) & 1) << 8);
    let entry = |i: usize| u64::from(IQ3S_GRID[index(i)]);
    let scale = odd(b.scales[s / 2] >> (4 * (s % 2)));
    GridSub {
        grid: std::array::from_fn(|k| {
            let i = 8 * s + 2 * k;
            entry(i) | (entry(i + 1) << 32)
        }),
        signs: std::array::from_fn(|k| b.signs[4 * s + k]),
        scales: [scale, scale],
        deltas: [0; 4],
    }
}

/// The u32 of sign indices and scale of sub-block `s` of the formats that keep one per
/// 32 values (`IQ2_XXS`, `IQ3_XXS`): run `k`'s signs are `KSIGNS_IQ2XS` at bits
/// `7k .. 7k + 7` (seven signs, the eighth their parity), the 4-bit scale in the top bits.
#[inline]
fn signs_and_scale(aux: u32) -> ([u8; 4], i16) {
    let signs = std::array::from_fn(|k| KSIGNS_IQ2XS[((aux >> (7 * k)) & 0x7F) as usize]);
    (signs, odd((aux >> 28) as u8))
}

/// `IQ3_XXS`: run `k` of sub-block `s` is the two 4-value entries of `IQ3XXS_GRID` at
/// `qs[8s + 2k]` and `qs[8s + 2k + 1]`; the u32 at `qs[64 + 4s]` holds the signs and
/// the scale.
#[inline(always)]
fn iq3_xxs(b: &BlockIQ3_XXS, s: usize) -> GridSub {
    let at = 64 + 4 * s;
    let aux = u32::from_le_bytes([b.qs[at], b.qs[at + 1], b.qs[at + 2], b.qs[at + 3]]);
    let (signs, scale) = signs_and_scale(aux);
    let entry = |i: usize| u64::from(IQ3XXS_GRID[usize::from(b.qs[i])]);
    GridSub {
        grid: std::array::from_fn(|k| entry(8 * s + 2 * k) | (entry(8 * s + 2 * k + 1) << 32)),
        signs,
        scales: [scale, scale],
        deltas: [0; 4],
    }
}

/// `IQ2_XXS`: sub-block `s` is the 8 bytes of `qs[4s .. 4s + 4]`: four indices into
/// `IQ2XXS_GRID` (8 magnitudes each, one per run), then the u32 of signs and scale.
#[inline(always)]
fn iq2_xxs(b: &BlockIQ2_XXS, s: usize) -> GridSub {
    let bytes: [u8; 8] = std::array::from_fn(|i| b.qs[4 * s + i / 2].0[i % 2]);
    let aux = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    let (signs, scale) = signs_and_scale(aux);
    GridSub {
        grid: std::array::from_fn(|k| IQ2XXS_GRID[usize::from(bytes[k])]),
        signs,
        scales: [scale, scale],
        deltas: [0; 4],
    }
}

/// The odd scales of the halves of sub-block `s` of the formats with a scale per 16
/// values (`IQ2_XS`, `IQ2_S`): the nibbles of `scales[s]`, low one first.
#[inline]
fn half_scales(scales: &[u8; 8], s: usize) -> [i16; 2] {
    [odd(scales[s]), odd(scales[s] >> 4)]
}

/// `IQ2_XS`: run `k` of sub-block `s` is the u16 `qs[4s + k]`: a 9-bit index into
/// `IQ2XS_GRID` and a 7-bit `KSIGNS_IQ2XS` index.
#[inline(always)]
fn iq2_xs(b: &BlockIQ2_XS, s: usize) -> GridSub {
    let q = |k: usize| b.qs[4 * s + k].get();
    GridSub {
        grid: std::array::from_fn(|k| IQ2XS_GRID[usize::from(q(k) & 511)]),
        signs: std::array::from_fn(|k| KSIGNS_IQ2XS[usize::from(q(k) >> 9)]),
        scales: half_scales(&b.scales, s),
        deltas: [0; 4],
    }
}

/// `IQ2_S`: run `k` of sub-block `s` is the `IQ2S_GRID` entry at `qs[4s + k]` (low 8
/// bits) and bits `2k, 2k + 1` of `qh[s]` (high 2), signed by `qs[32 + 4s + k]`.
#[inline(always)]
fn iq2_s(b: &BlockIQ2_S, s: usize) -> GridSub {
    let index =
        |k: usize| usize::from(b.qs[4 * s + k]) | (usize::from((b.qh[s] >> (2 * k)) & 3) << 8);
    GridSub {
        grid: std::array::from_fn(|k| IQ2S_GRID[index(k)]),
        signs: std::array::from_fn(|k| b.qs[32 + 4 * s + k]),
        scales: half_scales(&b.scales, s),
        deltas: [0; 4],
    }
}

/// An `IQ1S_GRID` entry (values -1, 0, 1, one per byte) as magnitudes and sign bits.
#[inline(always)]
fn ternary(entry: u64) -> (u64, u8) {
    let magnitudes = entry & 0x0101_0101_0101_0101;
    // The top bit of each byte (set for -1), gathered into one byte: bit j from byte j.
    let tops = (entry >> 7) & 0x0101_0101_0101_0101;
    let signs = (tops.wrapping_mul(0x0102_0408_1020_4080) >> 56) as u8;
    (magnitudes, signs)
}

/// The shift `δ` of a set sign bit (-1) or a clear one (+1).
#[inline]
fn shift(negative: bool) -> i8 {
    if negative {
        -1
    } else {
        1
    }
}

/// `IQ1_S`: the u16 `qh[s]` holds the high 3 bits of the four runs' 11-bit indices
/// (bits `3k .. 3k + 3`), a 3-bit scale (bits 12–14) and the sign of the shift (bit
/// 15); the low 8 bits are `qs[4s + k]`.
#[inline(always)]
fn iq1_s(b: &BlockIQ1_S, s: usize) -> GridSub {
    let hw = b.qh[s].get();
    let runs = std::array::from_fn(|k| {
        ternary(IQ1S_GRID[usize::from(b.qs[4 * s + k]) | (usize::from((hw >> (3 * k)) & 7) << 8)])
    });
    let scale = odd(((hw >> 12) & 7) as u8);
    GridSub {
        grid: runs.map(|r: (u64, u8)| r.0),
        signs: runs.map(|r| r.1),
        scales: [scale, scale],
        deltas: [shift(hw & 0x8000 != 0); 4],
    }
}

/// `IQ1_M`: run `k` of sub-block `s` takes the low 8 bits of its index from
/// `qs[4s + k]` and a nibble of `qh[2s + k / 2]` (low nibble for even `k`): three high
/// index bits and the sign of its shift; the 3-bit scales of the two halves sit at bits
/// `6 (s % 2)` and `6 (s % 2) + 3` of the u16 `scales[s / 2]`.
#[inline(always)]
fn iq1_m(b: &BlockIQ1_M, s: usize) -> GridSub {
    let nibble = |k: usize| (b.qh[2 * s + k / 2] >> (4 * (k % 2))) & 0x0F;
    let runs = std::array::from_fn(|k| {
        ternary(IQ1S_GRID[usize::from(b.qs[4 * s + k]) | (usize::from(nibble(k) & 7) << 8)])
    });
    let word = u16::from_le_bytes([b.scales[2 * (s / 2)], b.scales[2 * (s / 2) + 1]]);
    let sh = 6 * (s % 2);
    GridSub {
        grid: runs.map(|r: (u64, u8)| r.0),
        signs: runs.map(|r| r.1),
        scales: [
            odd(((word >> sh) & 7) as u8),
            odd(((word >> (sh + 3)) & 7) as u8),
        ],
        deltas: std::array::from_fn(|k| shift(nibble(k) & 0x08 != 0)),
    }
}
