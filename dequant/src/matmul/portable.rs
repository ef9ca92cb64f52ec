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

/// `Q4_0` block: `Σ q · qx` with `q` the signed weight, the nibble minus 8.
pub(crate) fn q4_0_block(block: &BlockQ4_0, qx: &[i8]) -> i32 {
    dot_offset::<32>(&nibbles(&block.qs), 8, qx)
}

/// `Q4_1` block: `Σ q · qx`; the offset `m` is applied in f32.
pub(crate) fn q4_1_block(block: &BlockQ4_1, qx: &[i8]) -> i32 {
    dot_u8::<32>(&nibbles(&block.qs), qx)
}

/// `Q5_0` block: `Σ q · qx` with `q` the signed weight, the 5-bit value minus 16.
pub(crate) fn q5_0_block(block: &BlockQ5_0, qx: &[i8]) -> i32 {
    dot_offset::<32>(&five_bit(&block.qh, &block.qs), 16, qx)
}

/// `Q5_1` block: `Σ q · qx`; the offset `m` is applied in f32.
pub(crate) fn q5_1_block(block: &BlockQ5_1, qx: &[i8]) -> i32 {
    dot_u8::<32>(&five_bit(&block.qh, &block.qs), qx)
}

/// `Q8_0` block: `Σ q · qx`, both signed.
pub(crate) fn q8_0_block(block: &BlockQ8_0, qx: &[i8]) -> i32 {
    // |q · x| ≤ 128 · 127 fits an i16.
    let mut sum = 0i32;
    for (&q, &x) in block.qs.iter().zip(&qx[..QK8]) {
        sum += i32::from(i16::from(q) * i16::from(x));
    }
    sum
}

pub(crate) fn dot_q4_0(row: &[u8], act: Q8Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, block) in whole_blocks::<BlockQ4_0>(row).iter().enumerate() {
        let int = q4_0_block(block, &act.qs[b * QK8..]);
        acc += block.d.to_f32() * act.ds[b][0] * int as f32;
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
        acc += block.d.to_f32() * act.ds[b][0] * int as f32;
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

/// `Σ scale_j · Σ q · qx` over the eight sub-blocks of 32 of a `Q4_K`/`Q5_K` super-block:
/// sub-blocks `2c` and `2c + 1` are the low and high nibbles of `qs[32c..32c + 32]`,
/// plus, with `qh`, bit `j` of `qh[l]` as the fifth bit of value `l` of sub-block `j`.
#[inline]
fn k_scaled_dot(scales: &[u8; 8], qs: &[u8; 128], qh: Option<&[u8; 32]>, qx: &[i8]) -> i32 {
    let mut sum = 0i32;
    for c in 0..4 {
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
        sum += i32::from(scales[2 * c]) * dot_u8::<32>(&lo, &qx[64 * c..]);
        sum += i32::from(scales[2 * c + 1]) * dot_u8::<32>(&hi, &qx[64 * c + 32..]);
    }
    sum
}

/// `Q4_K` super-block: `(Σ scale_j · Σ q · qx, Σ min_j · Σ qx)` over its eight
/// sub-blocks; the value is `d · first − dmin · second` in activation units.
pub(crate) fn q4_k_block(block: &BlockQ4_K, qx: &[i8], bsums: &[i16]) -> (i32, i32) {
    let (scales, mins) = k_scales_mins(&block.scales);
    (
        k_scaled_dot(&scales, &block.qs, None, qx),
        k_min_sum(&mins, bsums),
    )
}

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

/// `Σ w_i · x_i` with the weights decoded by `weight(i)`, eight at a time into eight
/// partial sums, which compilers keep in vector registers. (A plain multiply and add:
/// `mul_add` is a library call on CPUs without FMA.)
#[inline]
fn dot_floats(n: usize, weight: impl Fn(usize) -> f32, x: &[f32]) -> f32 {
    let n = n.min(x.len());
    let mut lanes = [0.0f32; 8];
    let mut i = 0;
    while i + 8 <= n {
        let mut w = [0.0f32; 8];
        for (k, w) in w.iter_mut().enumerate() {
            *w = weight(i + k);
        }
        for k in 0..8 {
            lanes[k] += w[k] * x[i + k];
        }
        i += 8;
    }
    let tail: f32 = (i..n).map(|j| weight(j) * x[j]).sum();
    lanes.iter().sum::<f32>() + tail
}

pub(crate) fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    let weight =
        |i: usize| f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]);
    dot_floats(row.len() / 4, weight, x)
}

pub(crate) fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    let weight = |i: usize| half::f16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32();
    dot_floats(row.len() / 2, weight, x)
}

pub(crate) fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    let weight = |i: usize| {
        f32::from_bits(u32::from(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])) << 16)
    };
    dot_floats(row.len() / 2, weight, x)
}
