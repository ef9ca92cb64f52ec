//! The portable kernels: plain Rust, one weight row against one token.
//!
//! Each quantized format splits into an integer part, the exact dot product of a
//! block's quantized weights with the quantized activations (`*_block` functions), and
//! an f32 part that scales and accumulates it, adding the block's offset (`m`, `-8 d`
//! or `-16 d`) times the activations' sum. The AVX2 kernels compute the same
//! integers, so the two paths are compared exactly on them.

use std::mem::size_of;

use crate::blocks::{
    cast_blocks, Block, BlockQ4_0, BlockQ4_1, BlockQ4_K, BlockQ5_0, BlockQ5_1, BlockQ5_K,
    BlockQ6_K, BlockQ8_0,
};
use crate::matmul::activation::{Q8KRow, Q8Row, BSUM_GROUP, QK8, QK_K};

/// The whole blocks at the start of `bytes` (all of a validated row).
pub(crate) fn whole_blocks<B: Block>(bytes: &[u8]) -> &[B] {
    let whole = bytes.len() / size_of::<B>() * size_of::<B>();
    cast_blocks(&bytes[..whole]).unwrap_or_default()
}

/// Sum of `u[i] * s[i]`: unsigned weights against signed activations.
#[inline]
fn dot_u8_i8(u: impl Iterator<Item = u8>, s: &[i8]) -> i32 {
    u.zip(s).map(|(u, &s)| i32::from(u) * i32::from(s)).sum()
}

/// The 32 unsigned 4-bit values of a legacy block: low nibbles first, then high ones.
#[inline]
fn nibbles(qs: &[u8; 16]) -> impl Iterator<Item = u8> + '_ {
    qs.iter().map(|b| b & 0x0F).chain(qs.iter().map(|b| b >> 4))
}

/// The 32 unsigned 5-bit values of a `Q5_0`/`Q5_1` block: nibbles plus bit `i` of `qh`.
#[inline]
fn five_bit<'a>(qh: &[u8; 4], qs: &'a [u8; 16]) -> impl Iterator<Item = u8> + 'a {
    let high = u32::from_le_bytes(*qh);
    nibbles(qs)
        .enumerate()
        .map(move |(i, q)| q | ((((high >> i) & 1) as u8) << 4))
}

/// `Q4_0` block: `Σ q · qx` with `q` the unsigned nibble; the offset `-8 d` is applied
/// in f32.
pub(crate) fn q4_0_block(block: &BlockQ4_0, qx: &[i8]) -> i32 {
    dot_u8_i8(nibbles(&block.qs), qx)
}

/// `Q4_1` block: `Σ q · qx`; the offset `m` is applied in f32.
pub(crate) fn q4_1_block(block: &BlockQ4_1, qx: &[i8]) -> i32 {
    dot_u8_i8(nibbles(&block.qs), qx)
}

/// `Q5_0` block: `Σ q · qx` with `q` the unsigned 5-bit value; the offset `-16 d` is
/// applied in f32.
pub(crate) fn q5_0_block(block: &BlockQ5_0, qx: &[i8]) -> i32 {
    dot_u8_i8(five_bit(&block.qh, &block.qs), qx)
}

/// `Q5_1` block: `Σ q · qx`; the offset `m` is applied in f32.
pub(crate) fn q5_1_block(block: &BlockQ5_1, qx: &[i8]) -> i32 {
    dot_u8_i8(five_bit(&block.qh, &block.qs), qx)
}

/// `Q8_0` block: `Σ q · qx`, both signed.
pub(crate) fn q8_0_block(block: &BlockQ8_0, qx: &[i8]) -> i32 {
    block
        .qs
        .iter()
        .zip(qx)
        .map(|(&q, &x)| i32::from(q) * i32::from(x))
        .sum()
}

pub(crate) fn dot_q4_0(row: &[u8], act: Q8Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, block) in whole_blocks::<BlockQ4_0>(row).iter().enumerate() {
        let int = q4_0_block(block, &act.qs[b * QK8..]);
        let ([dx, s], d) = (act.ds[b], block.d.to_f32());
        acc += d * dx * int as f32 + -8.0 * d * s;
    }
    acc
}

pub(crate) fn dot_q4_1(row: &[u8], act: Q8Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, block) in whole_blocks::<BlockQ4_1>(row).iter().enumerate() {
        let int = q4_1_block(block, &act.qs[b * QK8..]);
        let [d, s] = act.ds[b];
        acc += block.d.to_f32() * d * int as f32 + block.m.to_f32() * s;
    }
    acc
}

pub(crate) fn dot_q5_0(row: &[u8], act: Q8Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, block) in whole_blocks::<BlockQ5_0>(row).iter().enumerate() {
        let int = q5_0_block(block, &act.qs[b * QK8..]);
        let ([dx, s], d) = (act.ds[b], block.d.to_f32());
        acc += d * dx * int as f32 + -16.0 * d * s;
    }
    acc
}

pub(crate) fn dot_q5_1(row: &[u8], act: Q8Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, block) in whole_blocks::<BlockQ5_1>(row).iter().enumerate() {
        let int = q5_1_block(block, &act.qs[b * QK8..]);
        let [d, s] = act.ds[b];
        acc += block.d.to_f32() * d * int as f32 + block.m.to_f32() * s;
    }
    acc
}

pub(crate) fn dot_q8_0(row: &[u8], act: Q8Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, block) in whole_blocks::<BlockQ8_0>(row).iter().enumerate() {
        let int = q8_0_block(block, &act.qs[b * QK8..]);
        acc += block.d.to_f32() * act.ds[b][0] * int as f32;
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

/// `Σ mins[j] · (sum of sub-block j's activations)` for the eight sub-blocks of 32.
#[inline]
fn k_min_sum(mins: &[u8; 8], bsums: &[i16]) -> i32 {
    let pair = |j: usize| i32::from(bsums[2 * j]) + i32::from(bsums[2 * j + 1]);
    (0..8).map(|j| i32::from(mins[j]) * pair(j)).sum()
}

/// `Σ scale_j · Σ q · qx` over the eight sub-blocks of 32 whose unsigned values
/// `value(j, l)` gives.
#[inline]
fn k_scaled_dot(scales: &[u8; 8], qx: &[i8], value: impl Fn(usize, usize) -> u8) -> i32 {
    (0..8)
        .map(|j| i32::from(scales[j]) * dot_u8_i8((0..32).map(|l| value(j, l)), &qx[32 * j..]))
        .sum()
}

/// `Q4_K` super-block: `(Σ scale_j · Σ q · qx, Σ min_j · Σ qx)` over its eight
/// sub-blocks; the value is `d · first − dmin · second` in activation units.
pub(crate) fn q4_k_block(block: &BlockQ4_K, qx: &[i8], bsums: &[i16]) -> (i32, i32) {
    let (scales, mins) = k_scales_mins(&block.scales);
    // Sub-blocks 2c and 2c + 1 are the low and high nibbles of bytes 32c..32c + 32.
    let value = |j: usize, l: usize| (block.qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
    (k_scaled_dot(&scales, qx, value), k_min_sum(&mins, bsums))
}

/// `Q5_K` super-block: as [`q4_k_block`] with the fifth bit of value `l` of sub-block
/// `j` in bit `j` of `qh[l]`.
pub(crate) fn q5_k_block(block: &BlockQ5_K, qx: &[i8], bsums: &[i16]) -> (i32, i32) {
    let (scales, mins) = k_scales_mins(&block.scales);
    let value = |j: usize, l: usize| {
        let low = (block.qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
        low | (((block.qh[l] >> j) & 1) << 4)
    };
    (k_scaled_dot(&scales, qx, value), k_min_sum(&mins, bsums))
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

/// `Q6_K` super-block: `Σ scale_g · Σ (q - 32) · qx` over its sixteen groups of 16.
pub(crate) fn q6_k_block(block: &BlockQ6_K, qx: &[i8], bsums: &[i16]) -> i32 {
    let values = q6_k_values(block);
    let mut sum = 0i32;
    for (g, &scale) in block.scales.iter().enumerate() {
        let range = g * BSUM_GROUP..(g + 1) * BSUM_GROUP;
        let dot = dot_u8_i8(values[range.clone()].iter().copied(), &qx[range]);
        sum += i32::from(scale) * (dot - 32 * i32::from(bsums[g]));
    }
    sum
}

pub(crate) fn dot_q4_k(row: &[u8], act: Q8KRow<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, block) in whole_blocks::<BlockQ4_K>(row).iter().enumerate() {
        let (sum, min_sum) = q4_k_block(block, &act.qs[b * QK_K..], &act.bsums[b * 16..]);
        let (d, dmin) = (block.d.to_f32() * act.d[b], block.dmin.to_f32() * act.d[b]);
        acc += d * sum as f32 - dmin * min_sum as f32;
    }
    acc
}

pub(crate) fn dot_q5_k(row: &[u8], act: Q8KRow<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, block) in whole_blocks::<BlockQ5_K>(row).iter().enumerate() {
        let (sum, min_sum) = q5_k_block(block, &act.qs[b * QK_K..], &act.bsums[b * 16..]);
        let (d, dmin) = (block.d.to_f32() * act.d[b], block.dmin.to_f32() * act.d[b]);
        acc += d * sum as f32 - dmin * min_sum as f32;
    }
    acc
}

pub(crate) fn dot_q6_k(row: &[u8], act: Q8KRow<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, block) in whole_blocks::<BlockQ6_K>(row).iter().enumerate() {
        let sum = q6_k_block(block, &act.qs[b * QK_K..], &act.bsums[b * 16..]);
        acc += block.d.to_f32() * act.d[b] * sum as f32;
    }
    acc
}

/// Eight partial sums, so that the compiler can keep them in one vector register.
/// (A plain multiply and add: `mul_add` is a library call on CPUs without FMA.)
#[inline]
fn dot_floats(weights: impl Iterator<Item = f32>, x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    for (i, (w, &v)) in weights.zip(x).enumerate() {
        lanes[i % 8] += w * v;
    }
    lanes.iter().sum()
}

pub(crate) fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    let weights = row
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    dot_floats(weights, x)
}

pub(crate) fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    let weights = row
        .chunks_exact(2)
        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32());
    dot_floats(weights, x)
}

pub(crate) fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    let weights = row
        .chunks_exact(2)
        .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16));
    dot_floats(weights, x)
}
