//! The float weight types (`F32`, `F16`, `BF16`), as llama.cpp's CPU backend multiplies
//! them: llamafile's GEMM for batches, its dot products otherwise.

use crate::matmul::activation::FloatRow;

/// The float weight types, which llama.cpp's dot products finish differently.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum FloatKind {
    F32,
    F16,
    BF16,
}

/// `Σ w_i · x_i` as llama.cpp's CPU backend computes it for float weights (AVX2 build),
/// with the weights decoded by `weight(i)`:
/// - in llamafile's GEMM ([`FloatRow::gemm`]): one fused multiply-add chain per lane of
///   eight, the lanes summed as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`;
/// - in its dot product: four chains of eight lanes over each 32 values, added as
///   `(c0+c2)+(c1+c3)`, the halves of that folded (`l_i + l_{i+4}`), then
///   `(h0+h1)+(h2+h3)` (F32, F16) or `(h0+h2)+(h1+h3)` (BF16); the values past the last
///   32 fused on one by one (F32), or their f32 products added in f64 (F16, BF16).
#[inline]
pub(crate) fn float_dot(
    kind: FloatKind,
    n: usize,
    weight: impl Fn(usize) -> f32,
    act: FloatRow<'_>,
) -> f32 {
    let x = act.x;
    let n = n.min(x.len());
    if act.gemm {
        let mut lanes = [0.0f32; 8];
        for i in (0..n / 8 * 8).step_by(8) {
            for (l, lane) in lanes.iter_mut().enumerate() {
                *lane = weight(i + l).mul_add(x[i + l], *lane);
            }
        }
        return hsum8(&lanes);
    }
    let whole = n / 32 * 32;
    let mut chains = [[0.0f32; 8]; 4];
    for i in (0..whole).step_by(32) {
        for (c, chain) in chains.iter_mut().enumerate() {
            for (l, lane) in chain.iter_mut().enumerate() {
                let j = i + 8 * c + l;
                *lane = weight(j).mul_add(x[j], *lane);
            }
        }
    }
    let v: [f32; 8] =
        std::array::from_fn(|l| (chains[0][l] + chains[2][l]) + (chains[1][l] + chains[3][l]));
    finish_chains(kind, &v, weight, x, whole..n)
}

/// The end of [`float_dot`]'s dot product: the four chains' sum `v` reduced, and the
/// values in `tail` added.
#[inline]
pub(crate) fn finish_chains(
    kind: FloatKind,
    v: &[f32; 8],
    weight: impl Fn(usize) -> f32,
    x: &[f32],
    tail: std::ops::Range<usize>,
) -> f32 {
    let h = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
    let (whole, n) = (tail.start, tail.end);
    match kind {
        FloatKind::F32 => {
            let mut sum = (h[0] + h[1]) + (h[2] + h[3]);
            for (j, &xj) in x.iter().enumerate().take(n).skip(whole) {
                sum = weight(j).mul_add(xj, sum);
            }
            sum
        }
        FloatKind::F16 | FloatKind::BF16 => {
            let reduced = if kind == FloatKind::F16 {
                (h[0] + h[1]) + (h[2] + h[3])
            } else {
                (h[0] + h[2]) + (h[1] + h[3])
            };
            let mut sum = f64::from(reduced);
            for (j, &xj) in x.iter().enumerate().take(n).skip(whole) {
                sum += f64::from(weight(j) * xj);
            }
            sum as f32
        }
    }
}

/// Eight lanes summed as llamafile's `hsum` sums them.
#[inline]
pub(crate) fn hsum8(l: &[f32; 8]) -> f32 {
    let h = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (h[0] + h[2]) + (h[1] + h[3])
}

pub(crate) fn f32_at(row: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]])
}

pub(crate) fn f16_at(row: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32()
}

pub(crate) fn bf16_at(row: &[u8], i: usize) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])) << 16)
}

pub(crate) fn dot_f32(row: &[u8], act: FloatRow<'_>) -> f32 {
    float_dot(FloatKind::F32, row.len() / 4, |i| f32_at(row, i), act)
}

pub(crate) fn dot_f16(row: &[u8], act: FloatRow<'_>) -> f32 {
    float_dot(FloatKind::F16, row.len() / 2, |i| f16_at(row, i), act)
}

pub(crate) fn dot_bf16(row: &[u8], act: FloatRow<'_>) -> f32 {
    float_dot(FloatKind::BF16, row.len() / 2, |i| bf16_at(row, i), act)
}
