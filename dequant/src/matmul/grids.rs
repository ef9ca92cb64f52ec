//! The grid formats' blocks unpacked for the products: `IQ3_S`, `IQ3_XXS`, `IQ2_XXS`,
//! `IQ2_XS`, `IQ2_S`.
//!
//! Each sub-block of 32 values is four runs of 8 grid magnitudes with a sign byte per
//! run, and a scale per half of 16 values, all small integers: what both the portable
//! and the AVX2 kernels multiply with the activations. Unpacking is plain integer code
//! shared by both paths, so they cannot disagree on it; the decoders
//! (`decode::scalar::iquants`) read the same fields into floats.

use std::mem::offset_of;

use crate::blocks::{
    cast_blocks, Block, BlockIQ2_S, BlockIQ2_XS, BlockIQ2_XXS, BlockIQ3_S, BlockIQ3_XXS,
};
use crate::decode::grids::{
    IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
};

// The kernels read every grid format's f16 super-block scale `d` from its first bytes.
const _: () = assert!(offset_of!(BlockIQ3_S, d) == 0 && offset_of!(BlockIQ3_XXS, d) == 0);
const _: () = assert!(offset_of!(BlockIQ2_XXS, d) == 0);
const _: () = assert!(offset_of!(BlockIQ2_S, d) == 0);
const _: () = assert!(offset_of!(BlockIQ2_XS, d) == 0);

/// One sub-block of 32 values of a grid format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct GridSub {
    /// Run `k`'s magnitudes: byte `j` is the magnitude of value `8k + j`.
    pub grid: [u64; 4],
    /// Run `k`'s signs: bit `j` set negates value `8k + j`.
    pub signs: [u8; 4],
    /// The integer scales of values `0..16` and `16..32`.
    pub scales: [i16; 2],
}

/// The grid formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Grid {
    IQ3S,
    IQ3XXS,
    IQ2XXS,
    IQ2XS,
    IQ2S,
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
        }
    }

    /// Sub-block `s` (of 8) of the super-block `block` (at least
    /// [`Grid::block_bytes`] long).
    #[inline]
    pub(crate) fn sub(self, block: &[u8], s: usize) -> GridSub {
        match self {
            Grid::IQ3S => iq3_s(one(block), s),
            Grid::IQ3XXS => iq3_xxs(one(block), s),
            Grid::IQ2XXS => iq2_xxs(one(block), s),
            Grid::IQ2XS => iq2_xs(one(block), s),
            Grid::IQ2S => iq2_s(one(block), s),
        }
    }
}

/// The block at the start of `bytes`.
#[inline]
fn one<B: Block>(bytes: &[u8]) -> &B {
    &cast_blocks::<B>(&bytes[..size_of::<B>()]).expect("a whole block")[0]
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
#[inline]
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
#[inline]
fn iq3_xxs(b: &BlockIQ3_XXS, s: usize) -> GridSub {
    let at = 64 + 4 * s;
    let aux = u32::from_le_bytes([b.qs[at], b.qs[at + 1], b.qs[at + 2], b.qs[at + 3]]);
    let (signs, scale) = signs_and_scale(aux);
    let entry = |i: usize| u64::from(IQ3XXS_GRID[usize::from(b.qs[i])]);
    GridSub {
        grid: std::array::from_fn(|k| entry(8 * s + 2 * k) | (entry(8 * s + 2 * k + 1) << 32)),
        signs,
        scales: [scale, scale],
    }
}

/// `IQ2_XXS`: sub-block `s` is the 8 bytes of `qs[4s .. 4s + 4]`: four indices into
/// `IQ2XXS_GRID` (8 magnitudes each, one per run), then the u32 of signs and scale.
#[inline]
fn iq2_xxs(b: &BlockIQ2_XXS, s: usize) -> GridSub {
    let bytes: [u8; 8] = std::array::from_fn(|i| b.qs[4 * s + i / 2].0[i % 2]);
    let aux = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    let (signs, scale) = signs_and_scale(aux);
    GridSub {
        grid: std::array::from_fn(|k| IQ2XXS_GRID[usize::from(bytes[k])]),
        signs,
        scales: [scale, scale],
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
#[inline]
fn iq2_xs(b: &BlockIQ2_XS, s: usize) -> GridSub {
    let q = |k: usize| b.qs[4 * s + k].get();
    GridSub {
        grid: std::array::from_fn(|k| IQ2XS_GRID[usize::from(q(k) & 511)]),
        signs: std::array::from_fn(|k| KSIGNS_IQ2XS[usize::from(q(k) >> 9)]),
        scales: half_scales(&b.scales, s),
    }
}

/// `IQ2_S`: run `k` of sub-block `s` is the `IQ2S_GRID` entry at `qs[4s + k]` (low 8
/// bits) and bits `2k, 2k + 1` of `qh[s]` (high 2), signed by `qs[32 + 4s + k]`.
#[inline]
fn iq2_s(b: &BlockIQ2_S, s: usize) -> GridSub {
    let index =
        |k: usize| usize::from(b.qs[4 * s + k]) | (usize::from((b.qh[s] >> (2 * k)) & 3) << 8);
    GridSub {
        grid: std::array::from_fn(|k| IQ2S_GRID[index(k)]),
        signs: std::array::from_fn(|k| b.qs[32 + 4 * s + k]),
        scales: half_scales(&b.scales, s),
    }
}
