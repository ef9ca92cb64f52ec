//! The portable kernels: plain Rust, one weight row against one token.
//!
//! Each quantized format splits into an integer part, the exact dot product of a
//! block's quantized weights with the quantized activations, and an f32 part that scales
//! and accumulates it. The integers are kept in the AVX2 kernels' eight lanes (lane `l`
//! summing values `4l .. 4l + 4` of every 32) and the f32 part repeats their
//! operations one for one (fused multiply-adds per lane, the same reductions, the same
//! kernel choice per batch), so both paths give the same bits, which are llama.cpp's
//! on x86: the results do not depend on the CPU. The `*_block` functions give the
//! integer totals, against which the AVX2 integer code is checked.

use std::mem::size_of;

use crate::blocks::{
    cast_blocks, Block, BlockIQ4_NL, BlockMXFP4, BlockQ4_0, BlockQ4_1, BlockQ4_K, BlockQ5_0,
    BlockQ5_1, BlockQ5_K, BlockQ6_K, BlockQ8_0,
};
use crate::decode::grids::{KVALUES_IQ4NL, KVALUES_MXFP4};
use crate::decode::scalar::e8m0_to_f32_half;
use crate::matmul::activation::{Q8KRow, Q8Row, BSUM_GROUP, QK8, QK_K};

mod float;
mod superblock;

pub(crate) use float::{
    bf16_at, dot_bf16, dot_f16, dot_f32, f16_at, f32_at, finish_chains, FloatKind,
};
pub(crate) use superblock::{
    dot_iq1_m, dot_iq1_s, dot_iq2_s, dot_iq2_xs, dot_iq2_xxs, dot_iq3_s, dot_iq3_xxs, dot_iq4_xs,
    dot_q2_k, dot_q3_k, dot_tq1_0, dot_tq2_0, kind,
};
#[cfg(test)]
pub(crate) use superblock::{
    grid_lanes, iq4_xs_lanes, q2_k_lanes, q3_k_lanes, tq1_0_lanes, tq2_0_lanes, LaneInts,
};

/// The whole blocks at the start of `bytes` (all of a validated row).
pub(crate) fn whole_blocks<B: Block>(bytes: &[u8]) -> &[B] {
    let whole = bytes.len() / size_of::<B>() * size_of::<B>();
    cast_blocks(&bytes[..whole]).unwrap_or_default()
}

#[cfg(test)]
/// `Σ q[i] · x[i]` over `N` values: unsigned weights against signed activations. Plain
/// loops over arrays, which compilers turn into vector code on any target.
#[inline]
fn dot_u8<const N: usize>(q: &[u8], x: &[i8]) -> i32 {
    let (q, x) = (&q[..N], &x[..N]);
    // Every caller's q is below 64, so each product fits an i16: widening i16 products
    // into an i32 sum is the pattern vector units multiply-add best.
    let mut sum = 0i32;
    for i in 0..N {
        sum += i32::from(i16::from(q[i]) * i16::from(x[i]));
    }
    sum
}

#[cfg(test)]
/// `Σ (q − offset) · x` over `N` values, for weights stored with an offset.
#[inline]
fn dot_offset<const N: usize>(q: &[u8], offset: i16, x: &[i8]) -> i32 {
    let (q, x) = (&q[..N], &x[..N]);
    // |q − offset| ≤ 16 and |x| ≤ 127: each product fits an i16.
    let mut sum = 0i32;
    for i in 0..N {
        sum += i32::from((i16::from(q[i]) - offset) * i16::from(x[i]));
    }
    sum
}

/// The 32 unsigned 4-bit values of a legacy block: low nibbles first, then high ones.
#[inline]
fn nibbles(qs: &[u8; 16]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = qs[j] & 0x0F;
        q[j + 16] = qs[j] >> 4;
    }
    q
}

/// For each byte value, the eight bytes `0x10 · bit i` of its bits, little-endian.
const SPREAD_BITS: [u64; 256] = {
    let mut table = [0u64; 256];
    let mut byte = 0;
    while byte < 256 {
        let mut bit = 0;
        while bit < 8 {
            if byte & (1 << bit) != 0 {
                table[byte] |= 0x10 << (8 * bit);
            }
            bit += 1;
        }
        byte += 1;
    }
    table
};

/// The 32 unsigned 5-bit values of a `Q5_0`/`Q5_1` block: nibbles plus bit `i` of `qh`.
#[inline]
fn five_bit(qh: &[u8; 4], qs: &[u8; 16]) -> [u8; 32] {
    let mut q = nibbles(qs);
    for (k, &bits) in qh.iter().enumerate() {
        let high = SPREAD_BITS[usize::from(bits)].to_le_bytes();
        for i in 0..8 {
            q[8 * k + i] |= high[i];
        }
    }
    q
}

#[cfg(test)]
/// `Q4_0` block: `Σ q · qx` with `q` the signed weight, the nibble minus 8.
pub(crate) fn q4_0_block(block: &BlockQ4_0, qx: &[i8]) -> i32 {
    dot_offset::<32>(&nibbles(&block.qs), 8, qx)
}

#[cfg(test)]
/// `Q4_1` block: `Σ q · qx`; the offset `m` is applied in f32.
pub(crate) fn q4_1_block(block: &BlockQ4_1, qx: &[i8]) -> i32 {
    dot_u8::<32>(&nibbles(&block.qs), qx)
}

#[cfg(test)]
/// `Q5_0` block: `Σ q · qx` with `q` the signed weight, the 5-bit value minus 16.
pub(crate) fn q5_0_block(block: &BlockQ5_0, qx: &[i8]) -> i32 {
    dot_offset::<32>(&five_bit(&block.qh, &block.qs), 16, qx)
}

#[cfg(test)]
/// `Q5_1` block: `Σ q · qx`; the offset `m` is applied in f32.
pub(crate) fn q5_1_block(block: &BlockQ5_1, qx: &[i8]) -> i32 {
    dot_u8::<32>(&five_bit(&block.qh, &block.qs), qx)
}

#[cfg(test)]
/// `Q8_0` block: `Σ q · qx`, both signed.
pub(crate) fn q8_0_block(block: &BlockQ8_0, qx: &[i8]) -> i32 {
    // |q · x| ≤ 128 · 127 fits an i16.
    let mut sum = 0i32;
    for (&q, &x) in block.qs.iter().zip(&qx[..QK8]) {
        sum += i32::from(i16::from(q) * i16::from(x));
    }
    sum
}

/// Products of values `4l .. 4l + 4`, summed into lane `l`: `maddubs` then `madd`
/// against ones, as the AVX2 kernels (and llama.cpp's) compute them.
#[inline]
fn lanes<const N: usize>(product: impl Fn(usize) -> i32) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for (l, lane) in lanes.iter_mut().enumerate() {
        for i in (4 * l..N).step_by(32) {
            *lane += product(i) + product(i + 1) + product(i + 2) + product(i + 3);
        }
    }
    lanes
}

/// The horizontal sum of eight f32 lanes in the order of `hsum_ps` (and llama.cpp's
/// `hsum_float_8`): the upper half onto the lower, then lanes two apart, then the pair.
#[inline]
pub(crate) fn reduce8(l: &[f32; 8]) -> f32 {
    let a = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (a[0] + a[2]) + (a[1] + a[3])
}

/// A legacy-format row: per block its scale `d`, its offset `m` (0 without one) and its
/// eight integer lanes; each lane fused at `d · dx` into its accumulator, the offsets
/// `m · s` added apart, the lanes reduced at the end.
#[inline]
fn legacy_dot(
    n_blocks: usize,
    act: Q8Row<'_>,
    block: impl Fn(usize) -> (f32, f32, [i32; 8]),
) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut offsets = 0.0f32;
    for b in 0..n_blocks {
        let (d, m, ints) = block(b);
        let [dx, s] = act.ds[b];
        let scale = d * dx;
        for (acc, &int) in acc.iter_mut().zip(&ints) {
            *acc = (int as f32).mul_add(scale, *acc);
        }
        offsets += m * s;
    }
    reduce8(&acc) + offsets
}

/// Lanes of unsigned weights `q` against the activations `x`.
#[inline]
fn lanes_u8(q: &[u8; 32], x: &[i8]) -> [i32; 8] {
    lanes::<32>(|i| i32::from(q[i]) * i32::from(x[i]))
}

/// Lanes of weights stored with an offset, `q − offset`, against `x`.
#[inline]
fn lanes_offset(q: &[u8; 32], offset: i32, x: &[i8]) -> [i32; 8] {
    lanes::<32>(|i| (i32::from(q[i]) - offset) * i32::from(x[i]))
}

pub(crate) fn dot_q4_0(row: &[u8], act: Q8Row<'_>) -> f32 {
    let blocks = whole_blocks::<BlockQ4_0>(row);
    legacy_dot(blocks.len(), act, |b| {
        let ints = lanes_offset(&nibbles(&blocks[b].qs), 8, &act.qs[b * QK8..]);
        (blocks[b].d.to_f32(), 0.0, ints)
    })
}

/// `Q4_0` as llama.cpp's repacked kernels multiply it: each block's integers reduced to
/// one value, fused at `d · dx` into one accumulator.
pub(crate) fn dot_q4_0_packed(row: &[u8], act: Q8Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, block) in whole_blocks::<BlockQ4_0>(row).iter().enumerate() {
        let ints = lanes_offset(&nibbles(&block.qs), 8, &act.qs[b * QK8..]);
        let total: i32 = ints.iter().sum();
        acc = (total as f32).mul_add(block.d.to_f32() * act.ds[b][0], acc);
    }
    acc
}

pub(crate) fn dot_q4_1(row: &[u8], act: Q8Row<'_>) -> f32 {
    let blocks = whole_blocks::<BlockQ4_1>(row);
    legacy_dot(blocks.len(), act, |b| {
        let ints = lanes_u8(&nibbles(&blocks[b].qs), &act.qs[b * QK8..]);
        (blocks[b].d.to_f32(), blocks[b].m.to_f32(), ints)
    })
}

pub(crate) fn dot_q5_0(row: &[u8], act: Q8Row<'_>) -> f32 {
    let blocks = whole_blocks::<BlockQ5_0>(row);
    legacy_dot(blocks.len(), act, |b| {
        let q = five_bit(&blocks[b].qh, &blocks[b].qs);
        (
            blocks[b].d.to_f32(),
            0.0,
            lanes_offset(&q, 16, &act.qs[b * QK8..]),
        )
    })
}

pub(crate) fn dot_q5_1(row: &[u8], act: Q8Row<'_>) -> f32 {
    let blocks = whole_blocks::<BlockQ5_1>(row);
    legacy_dot(blocks.len(), act, |b| {
        let q = five_bit(&blocks[b].qh, &blocks[b].qs);
        let ints = lanes_u8(&q, &act.qs[b * QK8..]);
        (blocks[b].d.to_f32(), blocks[b].m.to_f32(), ints)
    })
}

pub(crate) fn dot_q8_0(row: &[u8], act: Q8Row<'_>) -> f32 {
    let blocks = whole_blocks::<BlockQ8_0>(row);
    legacy_dot(blocks.len(), act, |b| {
        let (q, x) = (&blocks[b].qs, &act.qs[b * QK8..]);
        let ints = lanes::<32>(|i| i32::from(q[i]) * i32::from(x[i]));
        (blocks[b].d.to_f32(), 0.0, ints)
    })
}

/// The 32 signed values of an `IQ4_NL` block: the table's entries for the low nibbles,
/// then for the high ones.
#[inline]
fn iq4_nl_values(qs: &[u8; 16]) -> [i8; 32] {
    nibbles(qs).map(|n| KVALUES_IQ4NL[usize::from(n)])
}

/// `IQ4_NL` block in lanes: `Σ kvalues[q] · qx`.
#[inline]
fn iq4_nl_lanes(block: &BlockIQ4_NL, qx: &[i8]) -> [i32; 8] {
    let q = iq4_nl_values(&block.qs);
    lanes::<32>(|i| i32::from(q[i]) * i32::from(qx[i]))
}

#[cfg(test)]
/// `IQ4_NL` block: `Σ kvalues[q] · qx`.
pub(crate) fn iq4_nl_block(block: &BlockIQ4_NL, qx: &[i8]) -> i32 {
    iq4_nl_lanes(block, qx).iter().sum()
}

/// `IQ4_NL` of a matrix llama.cpp does not repack. A batch as its GEMM (llamafile's)
/// multiplies it, which is [`legacy_dot`]; a single token as its dot product does:
/// [`paired_dot`].
pub(crate) fn dot_iq4_nl(row: &[u8], act: Q8Row<'_>) -> f32 {
    let blocks = whole_blocks::<BlockIQ4_NL>(row);
    let lanes_of = |b: usize| iq4_nl_lanes(&blocks[b], &act.qs[b * QK8..]);
    let d = |b: usize| blocks[b].d.to_f32();
    if !act.single {
        return legacy_dot(blocks.len(), act, |b| (d(b), 0.0, lanes_of(b)));
    }
    paired_dot(blocks.len(), act, d, lanes_of)
}

/// llama.cpp's dot products of `IQ4_NL` and `MXFP4`: the eight lanes of even blocks
/// fused at `d · dx` into one set of accumulators and those of odd blocks into another,
/// the two added lane by lane and reduced, and a last odd block's integer total fused
/// on at `d · dx`.
#[inline]
fn paired_dot(
    n_blocks: usize,
    act: Q8Row<'_>,
    d: impl Fn(usize) -> f32,
    lanes_of: impl Fn(usize) -> [i32; 8],
) -> f32 {
    let mut acc = [[0.0f32; 8]; 2];
    let pairs = n_blocks / 2 * 2;
    for b in 0..pairs {
        let scale = act.ds[b][0] * d(b);
        for (acc, &int) in acc[b % 2].iter_mut().zip(&lanes_of(b)) {
            *acc = (int as f32).mul_add(scale, *acc);
        }
    }
    let sum: [f32; 8] = std::array::from_fn(|l| acc[0][l] + acc[1][l]);
    let mut total = reduce8(&sum);
    if pairs < n_blocks {
        let b = pairs;
        let scale = act.ds[b][0] * d(b);
        let int: i32 = lanes_of(b).iter().sum();
        total = scale.mul_add(int as f32, total);
    }
    total
}

/// `MXFP4` block in lanes: `Σ kvalues_mxfp4[q] · qx` (the FP4 values doubled, as
/// integers; the E8M0 scale is halved to match).
#[inline]
fn mxfp4_lanes(block: &BlockMXFP4, qx: &[i8]) -> [i32; 8] {
    let q = nibbles(&block.qs).map(|n| KVALUES_MXFP4[usize::from(n)]);
    lanes::<32>(|i| i32::from(q[i]) * i32::from(qx[i]))
}

#[cfg(test)]
/// `MXFP4` block: `Σ kvalues_mxfp4[q] · qx`.
pub(crate) fn mxfp4_block(block: &BlockMXFP4, qx: &[i8]) -> i32 {
    mxfp4_lanes(block, qx).iter().sum()
}

/// `MXFP4` of a matrix llama.cpp does not repack: its dot product for every batch
/// ([`paired_dot`]), having no GEMM for the format.
pub(crate) fn dot_mxfp4(row: &[u8], act: Q8Row<'_>) -> f32 {
    let blocks = whole_blocks::<BlockMXFP4>(row);
    let d = |b: usize| e8m0_to_f32_half(blocks[b].e);
    paired_dot(blocks.len(), act, d, |b| {
        mxfp4_lanes(&blocks[b], &act.qs[b * QK8..])
    })
}

/// `MXFP4` as llama.cpp's repacked kernels multiply it (matrices of a multiple of 8
/// rows): as [`dot_q4_0_packed`], with its table and scale.
pub(crate) fn dot_mxfp4_packed(row: &[u8], act: Q8Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, block) in whole_blocks::<BlockMXFP4>(row).iter().enumerate() {
        let total: i32 = mxfp4_lanes(block, &act.qs[b * QK8..]).iter().sum();
        acc = (total as f32).mul_add(e8m0_to_f32_half(block.e) * act.ds[b][0], acc);
    }
    acc
}

/// `IQ4_NL` as llama.cpp's repacked kernels multiply it (matrices of a multiple of 8
/// rows): as [`dot_q4_0_packed`], with the table's values.
pub(crate) fn dot_iq4_nl_packed(row: &[u8], act: Q8Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, block) in whole_blocks::<BlockIQ4_NL>(row).iter().enumerate() {
        let total: i32 = iq4_nl_lanes(block, &act.qs[b * QK8..]).iter().sum();
        acc = (total as f32).mul_add(block.d.to_f32() * act.ds[b][0], acc);
    }
    acc
}

/// The eight 6-bit scales and eight 6-bit mins packed in the 12 bytes of a
/// `Q4_K`/`Q5_K` super-block: sub-blocks 0–3 in the low six bits of bytes 0–3 (scales)
/// and 4–7 (mins); sub-blocks 4–7 in the nibbles of bytes 8–11 with their top two bits
/// in the spare high bits of bytes 0–7.
#[inline]
fn k_scales_mins(packed: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let mut scales = [0u8; 8];
    let mut mins = [0u8; 8];
    for j in 0..4 {
        scales[j] = packed[j] & 63;
        mins[j] = packed[j + 4] & 63;
        scales[j + 4] = (packed[j + 8] & 0x0F) | ((packed[j] >> 6) << 4);
        mins[j + 4] = (packed[j + 8] >> 4) | ((packed[j + 4] >> 6) << 4);
    }
    (scales, mins)
}

#[cfg(test)]
/// `Σ mins[j] · (sum of sub-block j's activations)` for the eight sub-blocks of 32.
#[inline]
fn k_min_sum(mins: &[u8; 8], bsums: &[i16]) -> i32 {
    let pair = |j: usize| i32::from(bsums[2 * j]) + i32::from(bsums[2 * j + 1]);
    (0..8).map(|j| i32::from(mins[j]) * pair(j)).sum()
}

/// The values of chunk `c` (64 values) of a `Q4_K`/`Q5_K` super-block: sub-blocks `2c`
/// and `2c + 1` are the low and high nibbles of `qs[32c..32c + 32]`, plus, with `qh`,
/// bit `j` of `qh[l]` as the fifth bit of value `l` of sub-block `j`.
#[inline]
fn k_chunk(qs: &[u8; 128], qh: Option<&[u8; 32]>, c: usize) -> ([u8; 32], [u8; 32]) {
    let (mut lo, mut hi) = ([0u8; 32], [0u8; 32]);
    for l in 0..32 {
        lo[l] = qs[32 * c + l] & 0x0F;
        hi[l] = qs[32 * c + l] >> 4;
    }
    if let Some(qh) = qh {
        for l in 0..32 {
            lo[l] |= ((qh[l] >> (2 * c)) & 1) << 4;
            hi[l] |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
        }
    }
    (lo, hi)
}

#[cfg(test)]
/// `Σ scale_j · Σ q · qx` over the eight sub-blocks of 32 of a `Q4_K`/`Q5_K` super-block
/// (values as [`k_chunk`] lays them out).
#[inline]
fn k_scaled_dot(scales: &[u8; 8], qs: &[u8; 128], qh: Option<&[u8; 32]>, qx: &[i8]) -> i32 {
    let mut sum = 0i32;
    for c in 0..4 {
        let (lo, hi) = k_chunk(qs, qh, c);
        sum += i32::from(scales[2 * c]) * dot_u8::<32>(&lo, &qx[64 * c..]);
        sum += i32::from(scales[2 * c + 1]) * dot_u8::<32>(&hi, &qx[64 * c + 32..]);
    }
    sum
}

#[cfg(test)]
/// `Q4_K` super-block: `(Σ scale_j · Σ q · qx, Σ min_j · Σ qx)` over its eight
/// sub-blocks; the value is `d · first − dmin · second` in activation units.
pub(crate) fn q4_k_block(block: &BlockQ4_K, qx: &[i8], bsums: &[i16]) -> (i32, i32) {
    let (scales, mins) = k_scales_mins(&block.scales);
    (
        k_scaled_dot(&scales, &block.qs, None, qx),
        k_min_sum(&mins, bsums),
    )
}

#[cfg(test)]
/// `Q5_K` super-block: as [`q4_k_block`] with the fifth bits from `qh`.
pub(crate) fn q5_k_block(block: &BlockQ5_K, qx: &[i8], bsums: &[i16]) -> (i32, i32) {
    let (scales, mins) = k_scales_mins(&block.scales);
    (
        k_scaled_dot(&scales, &block.qs, Some(&block.qh), qx),
        k_min_sum(&mins, bsums),
    )
}

/// The 256 unsigned 6-bit values of a `Q6_K` super-block, in element order.
fn q6_k_values(block: &BlockQ6_K) -> [u8; QK_K] {
    let mut values = [0u8; QK_K];
    for half in 0..2 {
        let ql = &block.ql[64 * half..64 * half + 64];
        let qh = &block.qh[32 * half..32 * half + 32];
        let out = &mut values[128 * half..128 * half + 128];
        for l in 0..32 {
            out[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
            out[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
            out[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            out[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    values
}

#[cfg(test)]
/// `Q6_K` super-block: `Σ scale_g · Σ (q - 32) · qx` over its sixteen groups of 16.
pub(crate) fn q6_k_block(block: &BlockQ6_K, qx: &[i8], bsums: &[i16]) -> i32 {
    let values = q6_k_values(block);
    let mut sum = 0i32;
    for (g, &scale) in block.scales.iter().enumerate() {
        let at = g * BSUM_GROUP;
        let dot = dot_u8::<BSUM_GROUP>(&values[at..], &qx[at..]);
        sum += i32::from(scale) * (dot - 32 * i32::from(bsums[g]));
    }
    sum
}

/// A `Q4_K`/`Q5_K` super-block in lanes: for each 64 values `c` (sub-blocks `2c`, `2c +
/// 1`), the eight lanes of `scale · Σ q · qx`, and the min term `min · Σ qx` of the pair.
fn k_lanes(
    scales: &[u8; 8],
    mins: &[u8; 8],
    qs: &[u8; 128],
    qh: Option<&[u8; 32]>,
    qx: &[i8],
    bsums: &[i16],
) -> ([[i32; 8]; 4], [i32; 4]) {
    let mut dots = [[0i32; 8]; 4];
    let mut min_terms = [0i32; 4];
    let pair = |j: usize| i32::from(bsums[2 * j]) + i32::from(bsums[2 * j + 1]);
    for c in 0..4 {
        let (lo, hi) = k_chunk(qs, qh, c);
        let (sc_lo, sc_hi) = (i32::from(scales[2 * c]), i32::from(scales[2 * c + 1]));
        let lo_lanes = lanes_u8(&lo, &qx[64 * c..]);
        let hi_lanes = lanes_u8(&hi, &qx[64 * c + 32..]);
        for l in 0..8 {
            dots[c][l] = sc_lo * lo_lanes[l] + sc_hi * hi_lanes[l];
        }
        min_terms[c] =
            i32::from(mins[2 * c]) * pair(2 * c) + i32::from(mins[2 * c + 1]) * pair(2 * c + 1);
    }
    (dots, min_terms)
}

/// `Q4_K` of a matrix that llama.cpp repacks (a multiple of 8 rows), as its repacked
/// kernels multiply it: the integers of each 64 values (its GEMM, for tokens in a
/// batch's groups of four) or of each super-block (its GEMV) fused into one accumulator
/// at `d · dx`, the mins into another at `dmin · dx`.
pub(crate) fn dot_q4_k_packed(row: &[u8], act: Q8KRow<'_>) -> f32 {
    let (mut sum, mut sum_min) = (0.0f32, 0.0f32);
    for (b, block) in whole_blocks::<BlockQ4_K>(row).iter().enumerate() {
        let (scales, mins) = k_scales_mins(&block.scales);
        let (qx, bsums) = (&act.qs[b * QK_K..], &act.bsums[b * 16..]);
        let (dots, min_terms) = k_lanes(&scales, &mins, &block.qs, None, qx, bsums);
        let parts = dots.map(|lanes| lanes.iter().sum::<i32>());
        let (d, dmin) = (block.d.to_f32() * act.d[b], block.dmin.to_f32() * act.d[b]);
        if act.packed_gemm {
            for c in 0..4 {
                sum = (parts[c] as f32).mul_add(d, sum);
                sum_min = (min_terms[c] as f32).mul_add(dmin, sum_min);
            }
        } else {
            sum = (parts.iter().sum::<i32>() as f32).mul_add(d, sum);
            sum_min = (min_terms.iter().sum::<i32>() as f32).mul_add(dmin, sum_min);
        }
    }
    sum - sum_min
}

/// A `Q4_K` or `Q5_K` row as llama.cpp multiplies matrices it does not repack: one
/// token at a time its dot product (eight lanes fused at `d · dx`, reduced at the end;
/// the mins of `Q4_K` in four lanes fused at `dmin · dx` and reduced apart, those of
/// `Q5_K` (`SCALAR_MINS`) summed per super-block and fused at `−dx · dmin` into one
/// scalar added at the end), in batches of eight or more its tiled GEMM (per
/// super-block `d · Σ`, `dmin · Σmin` fused off it, the result fused at `dx`).
fn k_dot<B: Block, const SCALAR_MINS: bool>(
    row: &[u8],
    act: Q8KRow<'_>,
    parts: impl Fn(&B) -> (f32, f32, [u8; 8], [u8; 8], &[u8; 128], Option<&[u8; 32]>),
) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut acc_min = [0.0f32; 4];
    let mut sum_min = 0.0f32;
    let mut gemm = 0.0f32;
    for (b, block) in whole_blocks::<B>(row).iter().enumerate() {
        let (dw, dminw, scales, mins, qs, qh) = parts(block);
        let (qx, bsums) = (&act.qs[b * QK_K..], &act.bsums[b * 16..]);
        let (dots, min_terms) = k_lanes(&scales, &mins, qs, qh, qx, bsums);
        if act.gemm {
            let total: i32 = dots.iter().flatten().sum();
            let min_total: i32 = min_terms.iter().sum();
            let res = (-dminw).mul_add(min_total as f32, dw * total as f32);
            gemm = res.mul_add(act.d[b], gemm);
            continue;
        }
        let (d, dmin) = (dw * act.d[b], dminw * act.d[b]);
        for l in 0..8 {
            let int = dots[0][l] + dots[1][l] + dots[2][l] + dots[3][l];
            acc[l] = (int as f32).mul_add(d, acc[l]);
        }
        if SCALAR_MINS {
            let min_total: i32 = min_terms.iter().sum();
            sum_min = (-dmin).mul_add(min_total as f32, sum_min);
            continue;
        }
        for c in 0..4 {
            acc_min[c] = (min_terms[c] as f32).mul_add(dmin, acc_min[c]);
        }
    }
    if act.gemm {
        return gemm;
    }
    if SCALAR_MINS {
        return reduce8(&acc) + sum_min;
    }
    let mins = [
        acc_min[0], acc_min[1], acc_min[2], acc_min[3], 0.0, 0.0, 0.0, 0.0,
    ];
    reduce8(&acc) - reduce8(&mins)
}

/// `Q4_K` of a matrix llama.cpp does not repack: see [`k_dot`].
pub(crate) fn dot_q4_k(row: &[u8], act: Q8KRow<'_>) -> f32 {
    k_dot::<BlockQ4_K, false>(row, act, |block| {
        let (scales, mins) = k_scales_mins(&block.scales);
        let (d, dmin) = (block.d.to_f32(), block.dmin.to_f32());
        (d, dmin, scales, mins, &block.qs, None)
    })
}

/// `Q5_K`: see [`k_dot`].
pub(crate) fn dot_q5_k(row: &[u8], act: Q8KRow<'_>) -> f32 {
    k_dot::<BlockQ5_K, true>(row, act, |block| {
        let (scales, mins) = k_scales_mins(&block.scales);
        let (d, dmin) = (block.d.to_f32(), block.dmin.to_f32());
        (d, dmin, scales, mins, &block.qs, Some(&block.qh))
    })
}

/// `Q6_K` in lanes: lane `l` holds `scale · (q − 32) · qx` of values `4l .. 4l + 4` of
/// every 32, the offset taken as `32 · scale · bsum` for groups `2l` and `2l + 1`, as
/// llama.cpp spreads it.
fn q6_k_lanes(block: &BlockQ6_K, qx: &[i8], bsums: &[i16]) -> [i32; 8] {
    let values = q6_k_values(block);
    let scale = |i: usize| i32::from(block.scales[i / BSUM_GROUP]);
    let mut lanes = lanes::<QK_K>(|i| scale(i) * i32::from(values[i]) * i32::from(qx[i]));
    for (l, lane) in lanes.iter_mut().enumerate() {
        let offset = i32::from(block.scales[2 * l]) * i32::from(bsums[2 * l])
            + i32::from(block.scales[2 * l + 1]) * i32::from(bsums[2 * l + 1]);
        *lane -= 32 * offset;
    }
    lanes
}

/// `Q6_K` as llama.cpp multiplies it: one token at a time its dot product (eight lanes
/// fused at `d · dx`), in batches of eight or more its tiled GEMM (`d · Σ` rounded per
/// super-block, then fused at `dx`).
pub(crate) fn dot_q6_k(row: &[u8], act: Q8KRow<'_>) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut gemm = 0.0f32;
    for (b, block) in whole_blocks::<BlockQ6_K>(row).iter().enumerate() {
        let lanes = q6_k_lanes(block, &act.qs[b * QK_K..], &act.bsums[b * 16..]);
        let d = block.d.to_f32();
        if act.gemm {
            let scaled = d * lanes.iter().sum::<i32>() as f32;
            gemm = scaled.mul_add(act.d[b], gemm);
        } else {
            let scale = d * act.d[b];
            for (acc, &int) in acc.iter_mut().zip(&lanes) {
                *acc = (int as f32).mul_add(scale, *acc);
            }
        }
    }
    if act.gemm {
        gemm
    } else {
        reduce8(&acc)
    }
}
