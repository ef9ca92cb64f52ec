//! The super-block formats that llama.cpp's AVX2 build multiplies lane by lane, one
//! driver for all ([`lane_dot`]): each format only says how its blocks unpack into eight
//! integer lanes (`Q2_K`, `Q3_K`, `IQ4_XS`, the ternary and the grid formats).

use crate::blocks::{
    Block, BlockIQ1_M, BlockIQ1_S, BlockIQ2_S, BlockIQ2_XS, BlockIQ2_XXS, BlockIQ3_S, BlockIQ3_XXS,
    BlockIQ4_XS, BlockQ2_K, BlockQ3_K, BlockTQ1_0, BlockTQ2_0,
};
use crate::decode::grids::KVALUES_IQ4NL;
use crate::decode::scalar::{q3_k_scales, trit};
use crate::matmul::activation::{Q8KRow, BSUM_GROUP, QK_K};
use crate::matmul::grids::Grid;

use super::{lanes, reduce8, whole_blocks};

/// The integers of one super-block as llama.cpp's AVX2 dot products hold them, for the
/// formats that [`lane_dot`] multiplies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LaneInts {
    /// The scaled dot product `Σ scale · q · qx`, lane `l` holding values `4l .. 4l + 4`
    /// of every 32.
    pub dots: [i32; 8],
    /// The min terms `Σ min · Σ qx` of the formats with mins (lane `l` holding groups
    /// `2l` and `2l + 1` of 16); for the ternary formats the activations' sums in those
    /// lanes, which take their values' offset of 1 back off; zeros for the others.
    pub mins: [i32; 8],
    /// The IQ1 formats' shift terms `Σ scale · δ · qx` (`δ = ±1` per run), in the lanes
    /// of `dots`; zeros for the others.
    pub deltas: [i32; 8],
}

/// What a lane format adds to its dot product's lanes (the const parameter of
/// [`lane_dot`]).
pub(crate) mod kind {
    /// Nothing.
    pub const PLAIN: u8 = 0;
    /// Mins, fused apart before the lanes (`Q2_K`).
    pub const MINS: u8 = 1;
    /// A shift per run whose terms the dot product sums to one integer per super-block
    /// and fuses into a scalar (`IQ1_S`).
    pub const DELTA_SUM: u8 = 2;
    /// A shift per run whose terms the dot product keeps in lanes of their own
    /// (`IQ1_M`).
    pub const DELTA_LANES: u8 = 3;
    /// The ternary formats (`TQ1_0`, `TQ2_0`): values stored with an offset of 1, the
    /// activations' sums (the min lanes) subtracted in the integers. llama.cpp has no
    /// tiled GEMM for them: every batch takes the dot product.
    pub const TERNARY: u8 = 4;
}

/// A super-block's scales as [`lane_dot`] applies them: `d` (with any constant factor
/// of the format folded in) and `dmin` (0 without mins).
pub(crate) struct LaneScales {
    pub d: f32,
    pub dmin: f32,
}

/// A row of a super-block format that llama.cpp's AVX2 build multiplies lane by lane:
/// one token at a time its dot product (for each super-block the min lanes fused at
/// `−dx · dmin`, then the eight lanes at `dx · d`, reduced at the end), in batches of
/// [`GEMM_MIN_TOKENS`](crate::matmul::activation::GEMM_MIN_TOKENS) or more its tiled GEMM (per
/// super-block `d · Σ` rounded, `dmin · Σmin` fused off it, the result fused at `dx`
/// into one accumulator). `KIND` says what the format adds to its lanes ([`kind`]);
/// `factor` is a power of two that the dot product multiplies the reduced sum by (for
/// the IQ1 formats, the reduced shift terms) and the GEMM `d` (1 for the k-quants). The
/// IQ1 formats' GEMM takes `8 Σ + Σδ` (values `8 g + δ`, `factor` 1/8). The ternary
/// formats' lanes are `Σ q · qx − Σ qx` (the mins subtracted), fused at `dx · d`, at
/// every batch size.
#[inline]
fn lane_dot<B: Block, const KIND: u8>(
    row: &[u8],
    act: Q8KRow<'_>,
    factor: f32,
    block: impl Fn(&B, &[i8], &[i16]) -> (LaneScales, LaneInts),
) -> f32 {
    let delta = KIND == kind::DELTA_SUM || KIND == kind::DELTA_LANES;
    let use_gemm = act.gemm && KIND != kind::TERNARY;
    let mut acc = [0.0f32; 8];
    let mut acc_delta = [0.0f32; 8];
    let mut sum_delta = 0.0f32;
    let mut gemm = 0.0f32;
    for (b, blk) in whole_blocks::<B>(row).iter().enumerate() {
        let (w, mut ints) = block(blk, &act.qs[b * QK_K..], &act.bsums[b * 16..]);
        let dx = act.d[b];
        if KIND == kind::TERNARY {
            for (dot, &sum) in ints.dots.iter_mut().zip(&ints.mins) {
                *dot -= sum;
            }
        }
        let dots: i32 = ints.dots.iter().sum();
        let deltas: i32 = ints.deltas.iter().sum();
        if use_gemm {
            let total = if delta { 8 * dots + deltas } else { dots };
            let mut res = (w.d * factor) * total as f32;
            if KIND == kind::MINS {
                res = (-w.dmin).mul_add(ints.mins.iter().sum::<i32>() as f32, res);
            }
            gemm = res.mul_add(dx, gemm);
            continue;
        }
        if KIND == kind::MINS {
            let dmin = -dx * w.dmin;
            for (acc, &int) in acc.iter_mut().zip(&ints.mins) {
                *acc = (int as f32).mul_add(dmin, *acc);
            }
        }
        let d = dx * w.d;
        for (acc, &int) in acc.iter_mut().zip(&ints.dots) {
            *acc = (int as f32).mul_add(d, *acc);
        }
        if KIND == kind::DELTA_SUM {
            sum_delta = d.mul_add(deltas as f32, sum_delta);
        } else if KIND == kind::DELTA_LANES {
            for (acc, &int) in acc_delta.iter_mut().zip(&ints.deltas) {
                *acc = (int as f32).mul_add(d, *acc);
            }
        }
    }
    if use_gemm {
        gemm
    } else if KIND == kind::DELTA_SUM {
        reduce8(&acc) + factor * sum_delta
    } else if KIND == kind::DELTA_LANES {
        reduce8(&acc) + factor * reduce8(&acc_delta)
    } else {
        factor * reduce8(&acc)
    }
}

/// `Q2_K` in lanes: `Σ scale_g · q · qx` over the sixteen groups of 16 (value
/// `128c + 32s + l` in bits `2s, 2s + 1` of `qs[32c + l]`, group scales in the low
/// nibbles of `scales`), and the min terms `min_g · Σ qx` (mins in the high nibbles),
/// lane `l` holding groups `2l` and `2l + 1`.
pub(crate) fn q2_k_lanes(block: &BlockQ2_K, qx: &[i8], bsums: &[i16]) -> LaneInts {
    let value = |i: usize| {
        let (c, s, l) = (i / 128, i % 128 / 32, i % 32);
        i32::from((block.qs[32 * c + l] >> (2 * s)) & 3)
    };
    let scale = |g: usize| i32::from(block.scales[g] & 0x0F);
    let min = |g: usize| i32::from(block.scales[g] >> 4);
    let dots = lanes::<QK_K>(|i| scale(i / BSUM_GROUP) * value(i) * i32::from(qx[i]));
    let mut mins = [0i32; 8];
    for (l, lane) in mins.iter_mut().enumerate() {
        *lane = min(2 * l) * i32::from(bsums[2 * l]) + min(2 * l + 1) * i32::from(bsums[2 * l + 1]);
    }
    LaneInts {
        dots,
        mins,
        deltas: [0; 8],
    }
}

/// `Q2_K`: see [`lane_dot`].
pub(crate) fn dot_q2_k(row: &[u8], act: Q8KRow<'_>) -> f32 {
    lane_dot::<BlockQ2_K, { kind::MINS }>(row, act, 1.0, |block, qx, bsums| {
        let (d, dmin) = (block.d.to_f32(), block.dmin.to_f32());
        (LaneScales { d, dmin }, q2_k_lanes(block, qx, bsums))
    })
}

/// The 256 signed values of a `Q3_K` super-block in element order (`-4..=3`): value
/// `128c + 32s + l` takes bits `2s, 2s + 1` of `qs[32c + l]` and, inverted, bit `4c + s`
/// of `hmask[l]` as its sign (a clear bit subtracts 4).
fn q3_k_values(block: &BlockQ3_K) -> [i8; QK_K] {
    let mut values = [0i8; QK_K];
    for c in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                let low = ((block.qs[32 * c + l] >> (2 * s)) & 3) as i8;
                let high = (block.hmask[l] >> (4 * c + s)) & 1;
                values[128 * c + 32 * s + l] = low - 4 * (1 - high as i8);
            }
        }
    }
    values
}

/// `Q3_K` in lanes: `Σ scale_g · q · qx` over the sixteen groups of 16.
pub(crate) fn q3_k_lanes(block: &BlockQ3_K, qx: &[i8]) -> LaneInts {
    let (scales, values) = (q3_k_scales(&block.scales), q3_k_values(block));
    let dots = lanes::<QK_K>(|i| {
        i32::from(scales[i / BSUM_GROUP]) * i32::from(values[i]) * i32::from(qx[i])
    });
    LaneInts {
        dots,
        mins: [0; 8],
        deltas: [0; 8],
    }
}

/// `Q3_K`: see [`lane_dot`].
pub(crate) fn dot_q3_k(row: &[u8], act: Q8KRow<'_>) -> f32 {
    lane_dot::<BlockQ3_K, { kind::PLAIN }>(row, act, 1.0, |block, qx, _| {
        let d = block.d.to_f32();
        (LaneScales { d, dmin: 0.0 }, q3_k_lanes(block, qx))
    })
}

/// `IQ4_XS` in lanes: `Σ (ls_g − 32) · kvalues[q] · qx` over the eight groups of 32
/// (value `j < 16` of group `g` in the low nibble of `qs[16g + j]`, value `j + 16` in
/// its high nibble; the 6-bit `ls_g` from a nibble of `scales_l` and two bits of
/// `scales_h`).
pub(crate) fn iq4_xs_lanes(block: &BlockIQ4_XS, qx: &[i8]) -> LaneInts {
    let scales_h = block.scales_h.get();
    let scale = |g: usize| {
        let low = (block.scales_l[g / 2] >> (4 * (g % 2))) & 0x0F;
        let high = ((scales_h >> (2 * g)) & 3) as u8;
        i32::from(low | (high << 4)) - 32
    };
    let value = |i: usize| {
        let (g, j) = (i / 32, i % 32);
        let byte = block.qs[16 * g + j % 16];
        let nibble = if j < 16 { byte & 0x0F } else { byte >> 4 };
        i32::from(KVALUES_IQ4NL[usize::from(nibble)])
    };
    LaneInts {
        dots: lanes::<QK_K>(|i| scale(i / 32) * value(i) * i32::from(qx[i])),
        mins: [0; 8],
        deltas: [0; 8],
    }
}

/// `IQ4_XS`: see [`lane_dot`].
pub(crate) fn dot_iq4_xs(row: &[u8], act: Q8KRow<'_>) -> f32 {
    lane_dot::<BlockIQ4_XS, { kind::PLAIN }>(row, act, 1.0, |block, qx, _| {
        let d = block.d.to_f32();
        (LaneScales { d, dmin: 0.0 }, iq4_xs_lanes(block, qx))
    })
}

/// A ternary super-block in lanes from its stored values `q` (0, 1, 2 for −1, 0, 1):
/// `Σ q · qx`, and as mins the activations' sums per 16 (lane `l` holding groups `2l`
/// and `2l + 1`), which llama.cpp subtracts from the lanes.
fn ternary_lanes(values: &[u8; QK_K], qx: &[i8], bsums: &[i16]) -> LaneInts {
    let mut mins = [0i32; 8];
    for (l, lane) in mins.iter_mut().enumerate() {
        *lane = i32::from(bsums[2 * l]) + i32::from(bsums[2 * l + 1]);
    }
    LaneInts {
        dots: lanes::<QK_K>(|i| i32::from(values[i]) * i32::from(qx[i])),
        mins,
        deltas: [0; 8],
    }
}

/// `TQ1_0` in lanes: digit `p` (base 3, [`trit`]) of byte `b` of the first 32 bytes of
/// `qs` is value `32p + b`, of the next 16 value `160 + 16p + b`, and digit `p` of `qh[b]`
/// value `240 + 4p + b`.
pub(crate) fn tq1_0_lanes(block: &BlockTQ1_0, qx: &[i8], bsums: &[i16]) -> LaneInts {
    let mut values = [0u8; QK_K];
    let mut i = 0;
    for (bytes, digits) in [
        (&block.qs[..32], 5),
        (&block.qs[32..], 5),
        (&block.qh[..], 4),
    ] {
        for p in 0..digits {
            for &byte in bytes {
                values[i] = trit(byte, p) as u8;
                i += 1;
            }
        }
    }
    ternary_lanes(&values, qx, bsums)
}

/// `TQ2_0` in lanes: value `128c + 32s + l` in bits `2s, 2s + 1` of `qs[32c + l]`.
pub(crate) fn tq2_0_lanes(block: &BlockTQ2_0, qx: &[i8], bsums: &[i16]) -> LaneInts {
    let values: [u8; QK_K] =
        std::array::from_fn(|i| (block.qs[32 * (i / 128) + i % 32] >> (2 * (i % 128 / 32))) & 3);
    ternary_lanes(&values, qx, bsums)
}

/// `TQ1_0`: see [`lane_dot`].
pub(crate) fn dot_tq1_0(row: &[u8], act: Q8KRow<'_>) -> f32 {
    lane_dot::<BlockTQ1_0, { kind::TERNARY }>(row, act, 1.0, |block, qx, bsums| {
        let d = block.d.to_f32();
        (LaneScales { d, dmin: 0.0 }, tq1_0_lanes(block, qx, bsums))
    })
}

/// `TQ2_0`: see [`lane_dot`].
pub(crate) fn dot_tq2_0(row: &[u8], act: Q8KRow<'_>) -> f32 {
    lane_dot::<BlockTQ2_0, { kind::TERNARY }>(row, act, 1.0, |block, qx, bsums| {
        let d = block.d.to_f32();
        (LaneScales { d, dmin: 0.0 }, tq2_0_lanes(block, qx, bsums))
    })
}

/// A grid format's super-block in lanes: per sub-block of 32, `scale · Σ ±grid · qx`
/// (lane `l` the values `4l .. 4l + 4`, in the half of 16 whose scale it takes).
pub(crate) fn grid_lanes(grid: Grid, block: &[u8], qx: &[i8]) -> LaneInts {
    let mut dots = [0i32; 8];
    let mut deltas = [0i32; 8];
    for s in 0..8 {
        let sub = grid.sub(block, s);
        let value = |i: usize| {
            let magnitude = ((sub.grid[i / 8] >> (8 * (i % 8))) & 0xFF) as i32;
            if (sub.signs[i / 8] >> (i % 8)) & 1 == 1 {
                -magnitude
            } else {
                magnitude
            }
        };
        let x = &qx[32 * s..32 * s + 32];
        for l in 0..8 {
            let scale = i32::from(sub.scales[l / 4]);
            let values = 4 * l..4 * l + 4;
            dots[l] += scale
                * values
                    .clone()
                    .map(|i| value(i) * i32::from(x[i]))
                    .sum::<i32>();
            let shift = i32::from(sub.deltas[l / 2]);
            deltas[l] += scale * shift * values.map(|i| i32::from(x[i])).sum::<i32>();
        }
    }
    LaneInts {
        dots,
        mins: [0; 8],
        deltas,
    }
}

/// A row of grid format `grid` (blocks of type `B`): see [`lane_dot`].
fn grid_dot<B: Block, const KIND: u8>(grid: Grid, row: &[u8], act: Q8KRow<'_>) -> f32 {
    lane_dot::<B, KIND>(row, act, grid.factor(), |block, qx, _| {
        let bytes = bytemuck::bytes_of(block);
        let d = grid.d(bytes);
        (LaneScales { d, dmin: 0.0 }, grid_lanes(grid, bytes, qx))
    })
}

/// `IQ1_S`: see [`lane_dot`].
pub(crate) fn dot_iq1_s(row: &[u8], act: Q8KRow<'_>) -> f32 {
    grid_dot::<BlockIQ1_S, { kind::DELTA_SUM }>(Grid::IQ1S, row, act)
}

/// `IQ1_M`: see [`lane_dot`].
pub(crate) fn dot_iq1_m(row: &[u8], act: Q8KRow<'_>) -> f32 {
    grid_dot::<BlockIQ1_M, { kind::DELTA_LANES }>(Grid::IQ1M, row, act)
}

/// `IQ3_S`: see [`lane_dot`].
pub(crate) fn dot_iq3_s(row: &[u8], act: Q8KRow<'_>) -> f32 {
    grid_dot::<BlockIQ3_S, { kind::PLAIN }>(Grid::IQ3S, row, act)
}

/// `IQ3_XXS`: see [`lane_dot`].
pub(crate) fn dot_iq3_xxs(row: &[u8], act: Q8KRow<'_>) -> f32 {
    grid_dot::<BlockIQ3_XXS, { kind::PLAIN }>(Grid::IQ3XXS, row, act)
}

/// `IQ2_S`: see [`lane_dot`].
pub(crate) fn dot_iq2_s(row: &[u8], act: Q8KRow<'_>) -> f32 {
    grid_dot::<BlockIQ2_S, { kind::PLAIN }>(Grid::IQ2S, row, act)
}

/// `IQ2_XS`: see [`lane_dot`].
pub(crate) fn dot_iq2_xs(row: &[u8], act: Q8KRow<'_>) -> f32 {
    grid_dot::<BlockIQ2_XS, { kind::PLAIN }>(Grid::IQ2XS, row, act)
}

/// `IQ2_XXS`: see [`lane_dot`].
pub(crate) fn dot_iq2_xxs(row: &[u8], act: Q8KRow<'_>) -> f32 {
    grid_dot::<BlockIQ2_XXS, { kind::PLAIN }>(Grid::IQ2XXS, row, act)
}
