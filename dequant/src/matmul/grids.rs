//! The grid formats' blocks unpacked for the products: `IQ3_S`.
//!
//! Each sub-block of 32 values is four runs of 8 grid magnitudes with a sign byte per
//! run, and a scale per half of 16 values, all small integers: what both the portable
//! and the AVX2 kernels multiply with the activations. Unpacking is plain integer code
//! shared by both paths, so they cannot disagree on it; the decoders
//! (`decode::scalar::iquants`) read the same fields into floats.

use std::mem::offset_of;

use crate::blocks::{cast_blocks, Block, BlockIQ3_S};
use crate::decode::grids::IQ3S_GRID;

// The kernels read every grid format's f16 super-block scale `d` from its first bytes.
const _: () = assert!(offset_of!(BlockIQ3_S, d) == 0);

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
}

impl Grid {
    /// Bytes of one super-block.
    pub(crate) const fn block_bytes(self) -> usize {
        match self {
            Grid::IQ3S => size_of::<BlockIQ3_S>(),
        }
    }

    /// The power of two that llama.cpp folds into the super-block scale `d` (its dot
    /// products multiply the reduced sum by it; its GEMM multiplies `d` by it first).
    pub(crate) const fn factor(self) -> f32 {
        match self {
            Grid::IQ3S => 1.0,
        }
    }

    /// Sub-block `s` (of 8) of the super-block `block` (at least
    /// [`Grid::block_bytes`] long).
    #[inline]
    pub(crate) fn sub(self, block: &[u8], s: usize) -> GridSub {
        match self {
            Grid::IQ3S => iq3_s(one(block), s),
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
