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
//! Where both paths must compute the same integers (the block dot products), AVX2 and
//! portable results are compared exactly, and so are a batch's rows and the same
//! tokens multiplied one at a time.

use gguf_format::GgmlType;

use super::activation::{ActSet, Q8Acts, Q8KActs, BSUM_GROUP, QK8, QK_K};
use super::{is_path_available, portable, QuantizedMatrix};
use crate::{DecodePath, DequantError};

const TYPES: [GgmlType; 11] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// splitmix64: small, seedable, good enough for test data.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * unit
    }

    fn bytes(&mut self, out: &mut [u8]) {
        for b in out {
            *b = self.next_u64() as u8;
        }
    }
}

fn put_f16(bytes: &mut [u8], at: usize, v: f32) {
    bytes[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
}

/// A random `rows × cols` matrix of `ty`: random quantized values, small finite scales.
pub(crate) fn random_matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
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
                other => panic!("no generator for {other}"),
            };
            for b in bytes.chunks_exact_mut(block) {
                for &(at, signed) in fields {
                    let sign = if signed && rng.next_u64() % 2 == 0 {
                        -1.0
                    } else {
                        1.0
                    };
                    put_f16(b, at, sign * rng.uniform(0.001, 0.05));
                }
            }
        }
    }
    bytes
}

/// Activations: mostly within ±2, with an occasional outlier that sets a block's scale.
fn random_x(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..len)
        .map(|i| rng.uniform(-2.0, 2.0) * if i % 61 == 7 { 8.0 } else { 1.0 })
        .collect()
}

/// The reference: one row decoded to f32 by the crate's scalar decoder.
fn dequantize_row(ty: GgmlType, row: &[u8]) -> Vec<f32> {
    let mut out = vec![0.0f32; crate::decoded_len(ty, row.len()).unwrap()];
    crate::Decoder::scalar()
        .parallel(false)
        .decode_f32(ty, row, &mut out)
        .unwrap();
    out
}

/// The activations as the kernels see them (`x̂`) and each value's quantization step.
fn quantized_view(ty: GgmlType, x: &[f32], n_tokens: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    match ty.block_size() {
        1 => (x.to_vec(), vec![0.0; x.len()]),
        32 => {
            let acts = Q8Acts::prepare(x, n_tokens, cols);
            let mut xq = Vec::new();
            let mut step = Vec::new();
            for t in 0..n_tokens {
                let row = acts.row(t);
                xq.extend(
                    row.qs
                        .iter()
                        .enumerate()
                        .map(|(i, &q)| f32::from(q) * row.ds[i / QK8][0]),
                );
                step.extend((0..cols).map(|i| row.ds[i / QK8][0]));
            }
            (xq, step)
        }
        _ => {
            let acts = Q8KActs::prepare(x, n_tokens, cols);
            let mut xq = Vec::new();
            let mut step = Vec::new();
            for t in 0..n_tokens {
                let row = acts.row(t);
                xq.extend(
                    row.qs
                        .iter()
                        .enumerate()
                        .map(|(i, &q)| f32::from(q) * row.d[i / QK_K]),
                );
                step.extend((0..cols).map(|i| row.d[i / QK_K]));
            }
            (xq, step)
        }
    }
}

fn paths() -> Vec<DecodePath> {
    [DecodePath::Scalar, DecodePath::Avx2]
        .into_iter()
        .filter(|&p| is_path_available(p))
        .collect()
}

/// Checks one product of `ty` on both references, for every available path.
fn check_against_reference(ty: GgmlType, rows: usize, cols: usize, n_tokens: usize, seed: u64) {
    let bytes = random_matrix(ty, rows, cols, seed);
    let x = random_x(n_tokens * cols, seed ^ 0xA5A5);
    let w: Vec<Vec<f32>> = bytes
        .chunks_exact(bytes.len() / rows)
        .map(|r| dequantize_row(ty, r))
        .collect();
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
                let on_quantized: f64 = w_r
                    .iter()
                    .zip(xq_t)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum();
                let magnitude: f64 = w_r
                    .iter()
                    .zip(xq_t)
                    .map(|(&a, &b)| f64::from(a * b).abs())
                    .sum();
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
                    .sum();
                assert!(
                    (got - exact).abs() <= quantization + rounding,
                    "{context}: {got} vs {exact} on the exact activations (bound {quantization} + {rounding})"
                );
            }
        }
    }
}

#[test]
fn every_type_matches_the_reference_on_random_blocks() {
    for (i, ty) in TYPES.into_iter().enumerate() {
        let block = ty.block_size() as usize;
        let unit = if block == 1 { 8 } else { block };
        // Odd and even block counts, one token and batches around the kernels' width of 4.
        for (rows, blocks, n_tokens) in [(5, 1, 1), (3, 3, 2), (7, 2, 4), (4, 5, 5), (6, 4, 9)] {
            check_against_reference(
                ty,
                rows,
                blocks * unit,
                n_tokens,
                1000 * i as u64 + rows as u64,
            );
        }
    }
}

#[test]
fn float_rows_with_tails_match_the_reference() {
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for cols in [1, 7, 9, 15, 17, 33] {
            check_against_reference(ty, 3, cols, 3, cols as u64);
        }
    }
}

#[test]
fn model_shaped_products_match_the_reference() {
    // SmolLM2 attention and the Gemma 3 feed-forward widths, large enough for many chunks.
    check_against_reference(GgmlType::Q4_1, 96, 576, 3, 1);
    check_against_reference(GgmlType::Q8_0, 1000, 256, 1, 2);
    check_against_reference(GgmlType::Q8_0, 1000, 256, 6, 3);
    check_against_reference(GgmlType::Q4_K, 64, 2048, 2, 4);
    check_against_reference(GgmlType::Q6_K, 40, 640 / 128 * 256, 5, 5);
}

/// Blocks whose values sit at the extremes of their ranges, and random ones.
fn block_cases(ty: GgmlType, rng: &mut Rng) -> Vec<Vec<u8>> {
    let size = ty.type_size() as usize;
    let mut cases = vec![
        vec![0xFF; size],
        vec![0x00; size],
        vec![0x80; size],
        vec![0x7F; size],
    ];
    for _ in 0..200 {
        let mut b = vec![0u8; size];
        rng.bytes(&mut b);
        cases.push(b);
    }
    cases
}

/// The one block of type `B` that `bytes` hold.
fn one<B: crate::blocks::Block>(bytes: &[u8]) -> B {
    crate::blocks::cast_blocks::<B>(bytes).unwrap()[0]
}

fn activation_cases(len: usize, rng: &mut Rng) -> Vec<Vec<i8>> {
    let mut cases = vec![vec![127; len], vec![-127; len], vec![0; len]];
    cases.push(
        (0..len)
            .map(|i| if i % 2 == 0 { 127 } else { -127 })
            .collect(),
    );
    for _ in 0..20 {
        cases.push(
            (0..len)
                .map(|_| (rng.next_u64() % 255) as i8 as i16 as i8)
                .map(|q| q.max(-127))
                .collect(),
        );
    }
    cases
}

#[test]
fn avx2_block_integers_equal_the_portable_ones_exactly() {
    #[cfg(target_arch = "x86_64")]
    {
        let Some(proof) = super::avx2::Avx2::detect() else {
            eprintln!("skipped: this cpu has no avx2, fma and f16c");
            return;
        };
        let mut rng = Rng(42);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
        ] {
            for block in block_cases(ty, &mut rng) {
                for qx in activation_cases(QK8, &mut rng) {
                    let expected = match ty {
                        GgmlType::Q4_0 => portable::q4_0_block(&one(&block), &qx),
                        GgmlType::Q4_1 => portable::q4_1_block(&one(&block), &qx),
                        GgmlType::Q5_0 => portable::q5_0_block(&one(&block), &qx),
                        GgmlType::Q5_1 => portable::q5_1_block(&one(&block), &qx),
                        _ => portable::q8_0_block(&one(&block), &qx),
                    };
                    let got = super::avx2::legacy::block_int(proof, ty, &block, &qx);
                    assert_eq!(got, expected, "{ty} block {block:?} activations {qx:?}");
                }
            }
        }
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
            for block in block_cases(ty, &mut rng) {
                for qx in activation_cases(QK_K, &mut rng) {
                    let bsums: Vec<i16> = qx
                        .chunks_exact(BSUM_GROUP)
                        .map(|g| g.iter().map(|&q| i16::from(q)).sum())
                        .collect();
                    let expected = match ty {
                        GgmlType::Q4_K => portable::q4_k_block(&one(&block), &qx, &bsums),
                        GgmlType::Q5_K => portable::q5_k_block(&one(&block), &qx, &bsums),
                        _ => (portable::q6_k_block(&one(&block), &qx, &bsums), 0),
                    };
                    let got = super::avx2::kquants::block_ints(proof, ty, &block, &qx, &bsums);
                    assert_eq!(got, expected, "{ty} block {block:?} activations {qx:?}");
                }
            }
        }
    }
}

#[test]
fn a_batch_equals_its_tokens_multiplied_one_at_a_time_exactly() {
    for (i, ty) in TYPES.into_iter().enumerate() {
        let (rows, cols, n_tokens) = (9, 2 * QK_K, 11);
        let bytes = random_matrix(ty, rows, cols, 77 + i as u64);
        let x = random_x(n_tokens * cols, 5 + i as u64);
        let matrix = QuantizedMatrix::new(ty, rows, cols, &bytes).unwrap();
        for path in paths() {
            let mut batch = vec![0.0; n_tokens * rows];
            matrix.matmul_with(path, &x, n_tokens, &mut batch).unwrap();
            for t in 0..n_tokens {
                let mut single = vec![0.0; rows];
                matrix
                    .matvec_with(path, &x[t * cols..(t + 1) * cols], &mut single)
                    .unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&batch[t * rows..(t + 1) * rows]),
                    bits(&single),
                    "{ty} token {t} on {path:?}"
                );
            }
        }
    }
}

/// Runs `f` on a pool of `threads` threads, from inside it.
fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

#[test]
fn every_split_gives_the_serial_results_exactly() {
    use super::driver::{split_for, Split};
    // (rows, cols, tokens) covering each split, with chunks ending inside a group of 4.
    let cases = [
        (1002, 256, 1),
        (1002, 256, 3),
        (130, 512, 37),
        (64, 256, 64),
        (7, 256, 1),
        (515, 1024, 2),
    ];
    let mut seen = Vec::new();
    for ty in [
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q6_K,
        GgmlType::F16,
    ] {
        for (rows, cols, n_tokens) in cases {
            let bytes = random_matrix(ty, rows, cols, rows as u64);
            let x = random_x(n_tokens * cols, 3);
            let m = QuantizedMatrix::new(ty, rows, cols, &bytes).unwrap();
            for path in paths() {
                let run = || {
                    let mut y = vec![0.0f32; n_tokens * rows];
                    m.matmul_with(path, &x, n_tokens, &mut y).unwrap();
                    (
                        split_for(&m, n_tokens),
                        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    )
                };
                let (serial_split, serial) = in_pool(1, run);
                assert_eq!(serial_split, Split::Serial);
                let (split, parallel) = in_pool(2, run);
                let context = format!(
                    "{ty} {rows}x{cols} x {n_tokens} tokens split as {split:?} on {path:?}"
                );
                assert_eq!(parallel, serial, "{context}");
                seen.push(split);
            }
        }
    }
    for kind in [Split::Serial, Split::Rows(0), Split::Tokens(0)] {
        let same = |s: &Split| std::mem::discriminant(s) == std::mem::discriminant(&kind);
        assert!(seen.iter().any(same), "no {kind:?} among {seen:?}");
    }
}

#[test]
fn zero_activations_give_zero() {
    for ty in TYPES {
        let cols = QK_K;
        let bytes = random_matrix(ty, 4, cols, 9);
        let matrix = QuantizedMatrix::new(ty, 4, cols, &bytes).unwrap();
        for path in paths() {
            let mut y = vec![1.0; 4];
            matrix.matvec_with(path, &vec![0.0; cols], &mut y).unwrap();
            assert_eq!(y, vec![0.0; 4], "{ty} on {path:?}");
        }
    }
}

#[test]
fn empty_shapes_are_fine() {
    let m = QuantizedMatrix::new(GgmlType::Q8_0, 0, 64, &[]).unwrap();
    m.matmul(&vec![1.0; 3 * 64], 3, &mut []).unwrap();
    let m = QuantizedMatrix::new(GgmlType::Q8_0, 4, 0, &[]).unwrap();
    let mut y = vec![5.0; 8];
    m.matmul(&[], 2, &mut y).unwrap();
    assert_eq!(y, vec![0.0; 8]);
    let bytes = random_matrix(GgmlType::Q4_K, 2, 256, 1);
    let m = QuantizedMatrix::new(GgmlType::Q4_K, 2, 256, &bytes).unwrap();
    m.matmul(&[], 0, &mut []).unwrap();
}

#[test]
fn an_unsupported_type_is_refused() {
    let err = QuantizedMatrix::new(GgmlType::Q2_K, 1, 256, &[0; 84]).unwrap_err();
    assert!(
        matches!(err, DequantError::NoProductKernel { ty: GgmlType::Q2_K }),
        "{err}"
    );
}

#[test]
fn a_partial_block_is_refused() {
    let err = QuantizedMatrix::new(GgmlType::Q4_K, 1, 200, &[0; 144]).unwrap_err();
    assert!(
        matches!(
            err,
            DequantError::PartialRow {
                cols: 200,
                block_size: 256,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_size_overflow_is_refused() {
    let err = QuantizedMatrix::new(GgmlType::Q8_0, usize::MAX / 2, 64, &[]).unwrap_err();
    assert!(matches!(err, DequantError::MatrixTooLarge { .. }), "{err}");
}

#[test]
fn wrong_weight_bytes_are_refused() {
    let err = QuantizedMatrix::new(GgmlType::Q8_0, 2, 64, &[0; 135]).unwrap_err();
    assert!(
        matches!(
            err,
            DequantError::WeightBytes {
                expected: 136,
                actual: 135,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "a 2x64 Q8_0 matrix takes 136 bytes, got 135"
    );
}

#[test]
fn wrong_input_and_output_lengths_are_refused() {
    let bytes = random_matrix(GgmlType::Q4_0, 3, 64, 1);
    let m = QuantizedMatrix::new(GgmlType::Q4_0, 3, 64, &bytes).unwrap();
    let err = m.matvec(&[0.0; 63], &mut [0.0; 3]).unwrap_err();
    assert!(
        matches!(
            err,
            DequantError::InputLength {
                expected: 64,
                actual: 63,
                ..
            }
        ),
        "{err}"
    );
    let err = m.matmul(&[0.0; 128], 2, &mut [0.0; 5]).unwrap_err();
    assert!(
        matches!(
            err,
            DequantError::ProductOutputLength {
                expected: 6,
                actual: 5,
                ..
            }
        ),
        "{err}"
    );
    let err = m
        .matmul(&[0.0; 128], usize::MAX, &mut [0.0; 6])
        .unwrap_err();
    assert!(matches!(err, DequantError::InputLength { .. }), "{err}");
}

#[test]
fn a_missing_path_is_a_typed_error() {
    let bytes = random_matrix(GgmlType::Q8_0, 1, 32, 1);
    let m = QuantizedMatrix::new(GgmlType::Q8_0, 1, 32, &bytes).unwrap();
    let result = m.matvec_with(DecodePath::Avx2, &[0.5; 32], &mut [0.0]);
    if is_path_available(DecodePath::Avx2) {
        assert!(result.is_ok());
    } else {
        assert!(matches!(
            result,
            Err(DequantError::PathUnavailable {
                path: DecodePath::Avx2
            })
        ));
    }
}

/// `$ROCMFORGE_MODELS`, else `~/.cache/rocmforge/models` (`cargo xtask fetch-models`).
fn models_dir() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("ROCMFORGE_MODELS") {
        return dir.into();
    }
    let home = std::env::var_os("HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_default();
    home.join(".cache/rocmforge/models")
}

#[test]
fn real_model_weights_match_the_reference() {
    // The first rows of one tensor per distinct (type, shape) of each model: real scale
    // distributions, real outliers.
    const ROWS: usize = 48;
    for file in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gemma-3-270m-q4_k_m.gguf",
    ] {
        let path = models_dir().join(file);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run `cargo xtask fetch-models` first",
                path.display()
            )
        });
        let gguf = gguf_format::parse(&bytes).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for tensor in gguf.tensors.iter().filter(|t| t.shape.len() == 2) {
            let (ty, cols, rows) = (
                tensor.ggml_type,
                tensor.shape[0] as usize,
                tensor.shape[1] as usize,
            );
            if !seen.insert((ty, cols, rows)) {
                continue;
            }
            let range = gguf.tensor_range(tensor);
            let data = &bytes[range.start as usize..range.end as usize];
            let row_bytes = data.len() / rows;
            let rows = rows.min(ROWS);
            let weights = &data[..rows * row_bytes];
            let m = QuantizedMatrix::new(ty, rows, cols, weights).unwrap();
            let w: Vec<Vec<f32>> = weights
                .chunks_exact(row_bytes)
                .map(|r| dequantize_row(ty, r))
                .collect();
            let n_tokens = 3;
            let x = random_x(n_tokens * cols, rows as u64);
            let (xq, _) = quantized_view(ty, &x, n_tokens, cols);
            for path in paths() {
                let mut y = vec![0.0f32; n_tokens * rows];
                m.matmul_with(path, &x, n_tokens, &mut y).unwrap();
                for t in 0..n_tokens {
                    for (r, w_r) in w.iter().enumerate() {
                        let xq_t = &xq[t * cols..(t + 1) * cols];
                        let reference: f64 = w_r
                            .iter()
                            .zip(xq_t)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum();
                        let magnitude: f64 = w_r
                            .iter()
                            .zip(xq_t)
                            .map(|(&a, &b)| f64::from(a * b).abs())
                            .sum();
                        let got = f64::from(y[t * rows + r]);
                        assert!(
                            (got - reference).abs() <= 1e-5 * magnitude + 1e-30,
                            "{file} {} ({ty}) row {r} token {t} on {path:?}: {got} vs {reference}",
                            tensor.name
                        );
                    }
                }
            }
        }
        assert!(
            seen.len() >= 5,
            "{file}: only {} distinct matrices",
            seen.len()
        );
    }
}
