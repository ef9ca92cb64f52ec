//! The kernels against a plain reference: every weight row dequantized to f32 by the
//! crate's scalar decoder ([`crate::Decoder::scalar`]) and multiplied in f64.
//!
//! Two references per output value:
//! - with the activations exactly as the kernels quantized them, the only difference is
//!   f32 rounding: within `1e-5 · Σ|w·x̂|` (a few hundred ulps of the terms' magnitude,
//!   for rows of at most a few thousand values);
//! - with the original activations, the quantization of the activations adds at most
//!   half a quantization step per value: `Σ |w_i| · step_i / 2`.
//!
//! `Q4_1` and `Q5_1` see one more rounding that a dequantized row cannot show: the
//! activations' block sums rounded to f16 (as llama.cpp stores them), which multiply
//! the weights' offsets. [`sum_rounding`] computes what it adds, and both references
//! include it.
//!
//! Where the paths must compute the same integers (the block dot products), AVX-512,
//! AVX2 and portable results are compared exactly, and so are whole products, a
//! batch's rows and the same tokens multiplied one at a time.

mod api;
mod kernels;
mod real_models;

use gguf_format::GgmlType;

use super::activation::{ActSet, Q8KActs, Q8_0Acts, Q8_1Acts, QK8, QK_K};
use super::{is_path_available, QuantizedMatrix};
use crate::blocks::{BlockQ4_1, BlockQ5_1};
pub(super) use crate::splitmix::Rng;
use crate::DecodePath;

/// Every type the CPU multiplies ([`super::is_supported`]), so that a type made
/// supported is tested here at once.
pub(super) fn types() -> impl Iterator<Item = GgmlType> {
    GgmlType::ALL
        .into_iter()
        .filter(|&ty| super::is_supported(ty))
}

fn put_f16(bytes: &mut [u8], at: usize, v: f32) {
    bytes[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
}

/// Stores `v` as `IQ1_M`'s f16 super-block scale: nibble `k` of its bits in the top
/// nibble of the block's u16 scale word `k`.
pub(super) fn put_iq1_m_scale(block: &mut [u8], v: f32) {
    let at = std::mem::offset_of!(crate::blocks::BlockIQ1_M, scales);
    let bits = half::f16::from_f32(v).to_bits();
    for k in 0..4 {
        let byte = &mut block[at + 2 * k + 1];
        *byte = (*byte & 0x0F) | ((((bits >> (4 * k)) & 0xF) as u8) << 4);
    }
}

/// A random `rows × cols` matrix of `ty`: random quantized values, small finite scales.
pub(super) fn random_matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    let n = rows * cols;
    let mut bytes = vec![0u8; (ty.row_bytes(n as u64).expect("whole blocks")) as usize];
    rng.bytes(&mut bytes);
    let block = ty.type_size() as usize;
    match ty {
        GgmlType::F32 => {
            for (i, v) in bytes.chunks_exact_mut(4).enumerate() {
                let x = rng.uniform(-1.0, 1.0) * if i % 97 == 0 { 30.0 } else { 1.0 };
                v.copy_from_slice(&x.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for v in bytes.chunks_exact_mut(2) {
                put_f16(v, 0, rng.uniform(-1.0, 1.0));
            }
        }
        GgmlType::BF16 => {
            for v in bytes.chunks_exact_mut(2) {
                let bits = rng.uniform(-1.0, 1.0).to_bits();
                v.copy_from_slice(&((bits >> 16) as u16).to_le_bytes());
            }
        }
        _ => {
            // (offset of an f16 field, whether it may be negative)
            use crate::blocks::*;
            use std::mem::offset_of;
            let fields: &[(usize, bool)] = match ty {
                GgmlType::Q4_0 => &[(offset_of!(BlockQ4_0, d), true)],
                GgmlType::Q5_0 => &[(offset_of!(BlockQ5_0, d), true)],
                GgmlType::Q8_0 => &[(offset_of!(BlockQ8_0, d), true)],
                GgmlType::Q4_1 => &[
                    (offset_of!(BlockQ4_1, d), true),
                    (offset_of!(BlockQ4_1, m), true),
                ],
                GgmlType::Q5_1 => &[
                    (offset_of!(BlockQ5_1, d), true),
                    (offset_of!(BlockQ5_1, m), true),
                ],
                GgmlType::Q4_K => &[
                    (offset_of!(BlockQ4_K, d), false),
                    (offset_of!(BlockQ4_K, dmin), false),
                ],
                GgmlType::Q5_K => &[
                    (offset_of!(BlockQ5_K, d), false),
                    (offset_of!(BlockQ5_K, dmin), false),
                ],
                GgmlType::Q6_K => &[(offset_of!(BlockQ6_K, d), true)],
                GgmlType::Q3_K => &[(offset_of!(BlockQ3_K, d), true)],
                GgmlType::IQ4_XS => &[(offset_of!(BlockIQ4_XS, d), true)],
                GgmlType::IQ4_NL => &[(offset_of!(BlockIQ4_NL, d), true)],
                GgmlType::IQ3_S => &[(offset_of!(BlockIQ3_S, d), true)],
                GgmlType::IQ3_XXS => &[(offset_of!(BlockIQ3_XXS, d), true)],
                GgmlType::IQ2_XXS => &[(offset_of!(BlockIQ2_XXS, d), true)],
                GgmlType::IQ2_XS => &[(offset_of!(BlockIQ2_XS, d), true)],
                GgmlType::IQ2_S => &[(offset_of!(BlockIQ2_S, d), true)],
                GgmlType::IQ1_S => &[(offset_of!(BlockIQ1_S, d), true)],
                GgmlType::TQ1_0 => &[(offset_of!(BlockTQ1_0, d), true)],
                GgmlType::TQ2_0 => &[(offset_of!(BlockTQ2_0, d), true)],
                // IQ1_M's scale is in the top nibbles of its scales: set apart below.
                GgmlType::IQ1_M => &[],
                // MXFP4's E8M0 exponent: set apart below.
                GgmlType::MXFP4 => &[],
                GgmlType::Q2_K => &[
                    (offset_of!(BlockQ2_K, d), false),
                    (offset_of!(BlockQ2_K, dmin), false),
                ],
                other => panic!("no generator for {other}"),
            };
            for b in bytes.chunks_exact_mut(block) {
                for &(at, signed) in fields {
                    let sign = if signed && rng.next_u64().is_multiple_of(2) {
                        -1.0
                    } else {
                        1.0
                    };
                    put_f16(b, at, sign * rng.uniform(0.001, 0.05));
                }
                if ty == GgmlType::IQ1_M {
                    put_iq1_m_scale(b, rng.uniform(0.001, 0.05));
                }
                if ty == GgmlType::MXFP4 {
                    // Half of 2^(e - 127): 2^-12 .. 2^-5.
                    b[0] = 116 + (rng.next_u64() % 8) as u8;
                }
            }
        }
    }
    bytes
}

/// Activations: mostly within ±2, with an occasional outlier that sets a block's scale.
pub(super) fn random_x(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..len)
        .map(|i| rng.uniform(-2.0, 2.0) * if i % 61 == 7 { 8.0 } else { 1.0 })
        .collect()
}

/// The reference: one row decoded to f32 by the crate's scalar decoder.
pub(super) fn dequantize_row(ty: GgmlType, row: &[u8]) -> Vec<f32> {
    let mut out = vec![0.0f32; crate::decoded_len(ty, row.len()).unwrap()];
    crate::Decoder::scalar()
        .parallel(false)
        .decode_f32(ty, row, &mut out)
        .unwrap();
    out
}

/// The activations as the kernels see them (`x̂`) and each value's quantization step.
pub(super) fn quantized_view(
    ty: GgmlType,
    x: &[f32],
    n_tokens: usize,
    cols: usize,
) -> (Vec<f32>, Vec<f32>) {
    match ty.block_size() {
        1 => {
            // Float weights see the activations rounded to their own type.
            let xq: Vec<f32> = match ty {
                GgmlType::F16 => x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
                GgmlType::BF16 => x
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_f32())
                    .collect(),
                _ => x.to_vec(),
            };
            let step = x
                .iter()
                .zip(&xq)
                .map(|(a, b)| 2.0 * (a - b).abs())
                .collect();
            (xq, step)
        }
        32 => {
            let acts = Q8_0Acts::prepare(x, n_tokens, cols);
            let rows = (0..n_tokens).map(|t| {
                let row = acts.row(t);
                (row.qs, (0..cols).map(|i| row.ds[i / QK8][0]).collect())
            });
            // A value is off by at most half the exact step plus 127 times the scale's
            // rounding to f16 (2^-11 of it): within half of this `step`.
            scaled_rows(rows, 1.0 + 127.0 / 1024.0)
        }
        _ => {
            let acts = Q8KActs::prepare(x, n_tokens, cols);
            let rows = (0..n_tokens).map(|t| {
                let row = acts.row(t);
                (row.qs, (0..cols).map(|i| row.d[i / QK_K]).collect())
            });
            scaled_rows(rows, 1.0)
        }
    }
}

/// Rows of quantized values `q` and the scale `d` of each, as the values `q · d` they
/// stand for and the steps `d · step_per_scale`.
fn scaled_rows<'a>(
    rows: impl Iterator<Item = (&'a [i8], Vec<f32>)>,
    step_per_scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let (mut xq, mut step) = (Vec::new(), Vec::new());
    for (qs, scales) in rows {
        xq.extend(qs.iter().zip(&scales).map(|(&q, &d)| f32::from(q) * d));
        step.extend(scales.iter().map(|&d| d * step_per_scale));
    }
    (xq, step)
}

/// What the f16 rounding of the activations' block sums adds to one row's product with
/// one token's activations `x_t`: `Σ_b m_b · (s_b − d_b · Σq_b)` over the row's blocks,
/// for the formats with an offset `m` per block (`Q4_1`, `Q5_1`); 0 for the others.
pub(super) fn sum_rounding(ty: GgmlType, row: &[u8], x_t: &[f32]) -> f64 {
    let m_at = match ty {
        GgmlType::Q4_1 => std::mem::offset_of!(BlockQ4_1, m),
        GgmlType::Q5_1 => std::mem::offset_of!(BlockQ5_1, m),
        _ => return 0.0,
    };
    let acts = Q8_1Acts::prepare(x_t, 1, x_t.len());
    let act = acts.row(0);
    row.chunks_exact(ty.type_size() as usize)
        .enumerate()
        .map(|(b, block)| {
            let m = half::f16::from_le_bytes([block[m_at], block[m_at + 1]]).to_f32();
            let sum: i32 = act.qs[b * QK8..][..QK8].iter().map(|&q| i32::from(q)).sum();
            let [d, s] = act.ds[b];
            f64::from(m) * (f64::from(s) - f64::from(d) * f64::from(sum))
        })
        .sum()
}

/// A row's product `w_r · xq_t` with one token's quantized activations, in f64, and the
/// sum of its terms' magnitudes, which bounds its rounding.
pub(super) fn dot_and_magnitude(w_r: &[f32], xq_t: &[f32]) -> (f64, f64) {
    let dot = w_r
        .iter()
        .zip(xq_t)
        .map(|(&a, &b)| f64::from(a) * f64::from(b))
        .sum::<f64>();
    let magnitude = w_r
        .iter()
        .zip(xq_t)
        .map(|(&a, &b)| f64::from(a * b).abs())
        .sum();
    (dot, magnitude)
}

pub(super) fn paths() -> Vec<DecodePath> {
    [DecodePath::Scalar, DecodePath::Avx2, DecodePath::Avx512]
        .into_iter()
        .filter(|&p| is_path_available(p))
        .collect()
}

/// Checks one product of `ty` on both references, for every available path.
pub(super) fn check_against_reference(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n_tokens: usize,
    seed: u64,
) {
    let bytes = random_matrix(ty, rows, cols, seed);
    let x = random_x(n_tokens * cols, seed ^ 0xA5A5);
    let row_bytes: Vec<&[u8]> = bytes.chunks_exact(bytes.len() / rows).collect();
    let w: Vec<Vec<f32>> = row_bytes.iter().map(|r| dequantize_row(ty, r)).collect();
    let (xq, step) = quantized_view(ty, &x, n_tokens, cols);
    let matrix = QuantizedMatrix::new(ty, rows, cols, &bytes).unwrap();
    for path in paths() {
        let mut y = vec![f32::NAN; n_tokens * rows];
        matrix.matmul_with(path, &x, n_tokens, &mut y).unwrap();
        for t in 0..n_tokens {
            let (x_t, xq_t, step_t) = (
                &x[t * cols..][..cols],
                &xq[t * cols..][..cols],
                &step[t * cols..][..cols],
            );
            for (r, w_r) in w.iter().enumerate() {
                let got = f64::from(y[t * rows + r]);
                let sums = sum_rounding(ty, row_bytes[r], x_t);
                let (dot, magnitude) = dot_and_magnitude(w_r, xq_t);
                let on_quantized = sums + dot;
                let rounding = 1e-5 * magnitude + 1e-30;
                let context = format!("{ty} {rows}x{cols} token {t} row {r} on {}", path.name());
                assert!(
                    (got - on_quantized).abs() <= rounding,
                    "{context}: {got} vs {on_quantized} on the quantized activations (tolerance {rounding})"
                );
                let exact: f64 = w_r
                    .iter()
                    .zip(x_t)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum();
                let quantization: f64 = w_r
                    .iter()
                    .zip(step_t)
                    .map(|(&a, &s)| f64::from(a.abs() * s) / 2.0)
                    .sum::<f64>()
                    + sums.abs();
                assert!(
                    (got - exact).abs() <= quantization + rounding,
                    "{context}: {got} vs {exact} on the exact activations (bound {quantization} + {rounding})"
                );
            }
        }
    }
}

/// Runs `f` on a pool of `threads` threads, from inside it.
pub(super) fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}
