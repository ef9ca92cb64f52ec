//! Reference decoders of the grid formats: `IQ2_XXS`, `IQ2_XS`, `IQ2_S`, `IQ3_XXS`,
//! `IQ3_S`, `IQ1_S` and `IQ1_M`.
//!
//! Values come in runs of 8 (or 4) from a lattice grid picked by an index, each value's
//! sign from a sign pattern, all scaled per 16 or 32 values. As in the other reference
//! decoders, the f32 operations follow gguf-py's in its order: the group scale is
//! rounded to f32 first, then `scale * grid` per value, then the sign (an exact
//! negation).
//!
//! Each decoder is generic over [`Put`], which writes one run of 8 values: [`Scalar`]
//! one value at a time (the reference), the AVX2 kernels eight at once. The index and
//! scale logic is shared; the AVX2 runs are tested against the scalar ones, and both
//! against gguf-py's values.

use crate::blocks::{
    BlockIQ1_M, BlockIQ1_S, BlockIQ2_S, BlockIQ2_XS, BlockIQ2_XXS, BlockIQ3_S, BlockIQ3_XXS, QK_K,
};
use crate::decode::grids::{
    IQ1S_DELTA, IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
};

/// Writes one run of 8 values from a grid entry (value `j` in byte `j` of `grid`).
pub(crate) trait Put: Copy {
    /// `y[j] = ±(scale * grid byte j)`, negated where bit `j` of `signs` is set.
    fn signed(self, y: &mut [f32], scale: f32, grid: u64, signs: u8);
    /// `y[j] = scale * (signed grid byte j + delta)`, for the IQ1 grid.
    fn shifted(self, y: &mut [f32], scale: f32, grid: u64, delta: f32);
}

/// The reference [`Put`]: one value at a time.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scalar;

impl Put for Scalar {
    #[inline(always)]
    fn signed(self, y: &mut [f32], scale: f32, grid: u64, signs: u8) {
        for (j, y) in y.iter_mut().take(8).enumerate() {
            let v = scale * ((grid >> (8 * j)) & 0xFF) as f32;
            // Negation flips the sign bit (as `-v` does), here without a branch.
            let sign = (((signs >> j) & 1) as u32) << 31;
            *y = f32::from_bits(v.to_bits() ^ sign);
        }
    }

    #[inline(always)]
    fn shifted(self, y: &mut [f32], scale: f32, grid: u64, delta: f32) {
        for (j, y) in y.iter_mut().take(8).enumerate() {
            let g = ((grid >> (8 * j)) & 0xFF) as u8 as i8;
            *y = scale * (g as f32 + delta);
        }
    }
}

/// The decoders over the reference [`Put`].
macro_rules! reference {
    ($($name:ident => $with:ident: $block:ty,)*) => {
        $(
            pub(crate) fn $name(b: &$block, y: &mut [f32; QK_K]) {
                $with(Scalar, b, y)
            }
        )*
    };
}

/// Calls `$kernels!` with every grid format: its decoder's name, the generic decoder it
/// comes from, and its block type.
macro_rules! for_grid_formats {
    ($kernels:ident) => {
        $kernels! {
            iq2_xxs => iq2_xxs_with: BlockIQ2_XXS,
            iq2_xs => iq2_xs_with: BlockIQ2_XS,
            iq2_s => iq2_s_with: BlockIQ2_S,
            iq3_xxs => iq3_xxs_with: BlockIQ3_XXS,
            iq3_s => iq3_s_with: BlockIQ3_S,
            iq1_s => iq1_s_with: BlockIQ1_S,
            iq1_m => iq1_m_with: BlockIQ1_M,
        }
    };
}
pub(crate) use for_grid_formats;

for_grid_formats!(reference);

/// `d * (0.5 + ls) * k`, the group scale of the IQ2/IQ3 formats (`k` is 0.25 or 0.5).
#[inline(always)]
fn half_step_scale(d: f32, ls: u32, k: f32) -> f32 {
    d * (0.5 + ls as f32) * k
}

#[inline(always)]
fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

#[inline(always)]
pub(crate) fn iq2_xxs_with<P: Put>(put: P, b: &BlockIQ2_XXS, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    for ib in 0..8 {
        // Per 32 values: a u32 of four grid indices, then a u32 of four 7-bit sign
        // indices and a 4-bit scale.
        let q = &b.qs[4 * ib..4 * ib + 4];
        let indices = [q[0].0[0], q[0].0[1], q[1].0[0], q[1].0[1]];
        let aux = (q[2].get() as u32) | ((q[3].get() as u32) << 16);
        let db = half_step_scale(d, aux >> 28, 0.25);
        for k in 0..4 {
            let signs = KSIGNS_IQ2XS[((aux >> (7 * k)) & 0x7F) as usize];
            let grid = IQ2XXS_GRID[indices[k] as usize];
            put.signed(&mut y[32 * ib + 8 * k..][..8], db, grid, signs);
        }
    }
}

#[inline(always)]
pub(crate) fn iq2_xs_with<P: Put>(put: P, b: &BlockIQ2_XS, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    for (i, q) in b.qs.iter().enumerate() {
        // Each u16: a 9-bit grid index and a 7-bit sign index; a scale per 16 values.
        let q = q.get();
        let ls = (b.scales[i / 4] >> (4 * ((i / 2) % 2))) & 0x0F;
        let db = half_step_scale(d, ls as u32, 0.25);
        let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
        put.signed(
            &mut y[8 * i..][..8],
            db,
            IQ2XS_GRID[(q & 511) as usize],
            signs,
        );
    }
}

#[inline(always)]
pub(crate) fn iq2_s_with<P: Put>(put: P, b: &BlockIQ2_S, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    let (indices, signs) = b.qs.split_at(QK_K / 8);
    for i in 0..QK_K / 8 {
        let high = ((b.qh[i / 4] >> (2 * (i % 4))) & 0x03) as usize;
        let index = indices[i] as usize | (high << 8);
        let ls = (b.scales[i / 4] >> (4 * ((i / 2) % 2))) & 0x0F;
        let db = half_step_scale(d, ls as u32, 0.25);
        put.signed(&mut y[8 * i..][..8], db, IQ2S_GRID[index], signs[i]);
    }
}

#[inline(always)]
pub(crate) fn iq3_xxs_with<P: Put>(put: P, b: &BlockIQ3_XXS, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    let (indices, scales_signs) = b.qs.split_at(QK_K / 4);
    for ib in 0..8 {
        let aux = u32_at(scales_signs, 4 * ib);
        let db = half_step_scale(d, aux >> 28, 0.5);
        for k in 0..4 {
            let signs = KSIGNS_IQ2XS[((aux >> (7 * k)) & 0x7F) as usize];
            let i = 8 * ib + 2 * k;
            let grid0 = IQ3XXS_GRID[indices[i] as usize] as u64;
            let grid1 = IQ3XXS_GRID[indices[i + 1] as usize] as u64;
            put.signed(
                &mut y[32 * ib + 8 * k..][..8],
                db,
                grid0 | (grid1 << 32),
                signs,
            );
        }
    }
}

#[inline(always)]
pub(crate) fn iq3_s_with<P: Put>(put: P, b: &BlockIQ3_S, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    for ib in 0..8 {
        let ls = (b.scales[ib / 2] >> (4 * (ib % 2))) & 0x0F;
        let db = d * (1 + 2 * ls) as f32;
        for k in 0..4 {
            let i = 8 * ib + 2 * k;
            let index =
                |i: usize| b.qs[i] as usize | ((((b.qh[i / 8] >> (i % 8)) & 1) as usize) << 8);
            let grid0 = IQ3S_GRID[index(i)] as u64;
            let grid1 = IQ3S_GRID[index(i + 1)] as u64;
            let signs = b.signs[4 * ib + k];
            put.signed(
                &mut y[32 * ib + 8 * k..][..8],
                db,
                grid0 | (grid1 << 32),
                signs,
            );
        }
    }
}

#[inline(always)]
pub(crate) fn iq1_s_with<P: Put>(put: P, b: &BlockIQ1_S, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    for ib in 0..8 {
        // Per 32 values, a u16: four 3-bit high index parts, a 3-bit scale, the sign of
        // the shift.
        let qh = b.qh[ib].get();
        let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
        let delta = if qh & 0x8000 != 0 {
            -IQ1S_DELTA
        } else {
            IQ1S_DELTA
        };
        for k in 0..4 {
            let index = b.qs[4 * ib + k] as usize | ((((qh >> (3 * k)) & 7) as usize) << 8);
            put.shifted(&mut y[32 * ib + 8 * k..][..8], dl, IQ1S_GRID[index], delta);
        }
    }
}

/// The f16 super-block scale of an `IQ1_M` block, spread over the top nibbles of the
/// four u16 of `scales` (lowest nibble first).
pub(crate) fn iq1_m_scale(scales: &[u8; 8]) -> f32 {
    let sc = |i: usize| u16::from_le_bytes([scales[2 * i], scales[2 * i + 1]]);
    let bits = (sc(0) >> 12) | ((sc(1) >> 8) & 0x00F0) | ((sc(2) >> 4) & 0x0F00) | (sc(3) & 0xF000);
    half::f16::from_bits(bits).to_f32()
}

/// `IQ1_M`, following ggml's layout: each 8 values have a nibble of `qh` whose low three
/// bits extend the grid index and whose bit 3 makes the shift negative. (gguf-py 0.19.0
/// reads that bit as `qh & 0x08 == 0`, which Python parses as `qh & False`, so it always
/// subtracts the shift; this type is absent from the test vectors for that reason.)
#[inline(always)]
pub(crate) fn iq1_m_with<P: Put>(put: P, b: &BlockIQ1_M, y: &mut [f32; QK_K]) {
    let d = iq1_m_scale(&b.scales);
    for s in 0..16 {
        // A 3-bit scale per 16 values, four per u16.
        let word = u16::from_le_bytes([b.scales[2 * (s / 4)], b.scales[2 * (s / 4) + 1]]);
        let dl = d * (2 * ((word >> (3 * (s % 4))) & 7) + 1) as f32;
        for k in 2 * s..2 * s + 2 {
            let nibble = (b.qh[k / 2] >> (4 * (k % 2))) & 0x0F;
            let index = b.qs[k] as usize | (((nibble & 7) as usize) << 8);
            let delta = if nibble & 0x08 != 0 {
                -IQ1S_DELTA
            } else {
                IQ1S_DELTA
            };
            put.shifted(&mut y[8 * k..][..8], dl, IQ1S_GRID[index], delta);
        }
    }
}
