//! The public API's edges: every error variant, empty shapes, missing paths.

use gguf_format::GgmlType;

use super::{paths, random_matrix, types};
use crate::matmul::activation::QK_K;
use crate::matmul::{is_path_available, QuantizedMatrix};
use crate::{DecodePath, DequantError};

#[test]
fn zero_activations_give_zero() {
    for ty in types() {
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
    let err = QuantizedMatrix::new(GgmlType::Q8_K, 1, 256, &[0; 292]).unwrap_err();
    assert!(
        matches!(err, DequantError::NoProductKernel { ty: GgmlType::Q8_K }),
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
    for path in [DecodePath::Avx2, DecodePath::Avx512] {
        let result = m.matvec_with(path, &[0.5; 32], &mut [0.0]);
        if is_path_available(path) {
            assert!(result.is_ok());
        } else {
            assert!(matches!(
                result,
                Err(DequantError::PathUnavailable { path: p }) if p == path
            ));
        }
    }
}

#[test]
fn fused_single_token_products_give_each_matrix_its_own_bits() {
    use super::{in_pool, random_x};
    for (i, ty) in types().enumerate() {
        let cols = 2 * QK_K;
        let shapes = [96usize, 32, 160];
        let bytes: Vec<Vec<u8>> = shapes
            .iter()
            .enumerate()
            .map(|(k, &rows)| random_matrix(ty, rows, cols, 300 + 10 * i as u64 + k as u64))
            .collect();
        let matrices: Vec<QuantizedMatrix<'_>> = shapes
            .iter()
            .zip(&bytes)
            .map(|(&rows, b)| QuantizedMatrix::new(ty, rows, cols, b).unwrap())
            .collect();
        let x = random_x(cols, 9 + i as u64);
        for threads in [1, 2, 4] {
            let mut outs: Vec<Vec<f32>> = shapes.iter().map(|&r| vec![f32::NAN; r]).collect();
            in_pool(threads, || {
                let mut ys: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                QuantizedMatrix::matvec_many(&matrices, &x, &mut ys).unwrap();
            });
            for (m, out) in matrices.iter().zip(&outs) {
                let mut single = vec![0.0; m.rows()];
                m.matvec(&x, &mut single).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(out),
                    bits(&single),
                    "{ty} {} rows, {threads} threads",
                    m.rows()
                );
            }
        }
    }
}

#[test]
fn fused_products_refuse_mixed_or_mismatched_inputs() {
    let a_bytes = random_matrix(GgmlType::Q8_0, 8, 64, 1);
    let b_bytes = random_matrix(GgmlType::Q4_0, 8, 64, 2);
    let a = QuantizedMatrix::new(GgmlType::Q8_0, 8, 64, &a_bytes).unwrap();
    let b = QuantizedMatrix::new(GgmlType::Q4_0, 8, 64, &b_bytes).unwrap();
    let x = vec![0.5; 64];
    let (mut y0, mut y1) = (vec![0.0; 8], vec![0.0; 8]);
    let err = QuantizedMatrix::matvec_many(&[a, b], &x, &mut [&mut y0, &mut y1]).unwrap_err();
    assert!(matches!(err, DequantError::MixedProducts { .. }), "{err}");
    let err = QuantizedMatrix::matvec_many(&[a, a], &x, &mut [&mut y0]).unwrap_err();
    assert!(matches!(err, DequantError::ProductCount { .. }), "{err}");
    let mut short = vec![0.0; 7];
    let err = QuantizedMatrix::matvec_many(&[a], &x, &mut [&mut short]).unwrap_err();
    assert!(
        matches!(err, DequantError::ProductOutputLength { .. }),
        "{err}"
    );
    let err = QuantizedMatrix::matvec_many(&[a], &x[..32], &mut [&mut y0]).unwrap_err();
    assert!(matches!(err, DequantError::InputLength { .. }), "{err}");
}

#[test]
fn fused_q4_0_products_of_repacked_and_plain_shapes_match_their_own() {
    use super::random_x;
    let cols = 2 * QK_K;
    let (a_bytes, b_bytes) = (
        random_matrix(GgmlType::Q4_0, 16, cols, 71),
        random_matrix(GgmlType::Q4_0, 13, cols, 72),
    );
    let a = QuantizedMatrix::new(GgmlType::Q4_0, 16, cols, &a_bytes).unwrap();
    let b = QuantizedMatrix::new(GgmlType::Q4_0, 13, cols, &b_bytes).unwrap();
    let x = random_x(cols, 73);
    let (mut ya, mut yb) = (vec![0.0; 16], vec![0.0; 13]);
    QuantizedMatrix::matvec_many(&[a, b], &x, &mut [&mut ya, &mut yb]).unwrap();
    let (mut sa, mut sb) = (vec![0.0; 16], vec![0.0; 13]);
    a.matvec(&x, &mut sa).unwrap();
    b.matvec(&x, &mut sb).unwrap();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&ya), bits(&sa));
    assert_eq!(bits(&yb), bits(&sb));
}

/// Routed tokens (`MUL_MAT_ID`) get their own dot products' bits, except that 8 or more
/// of them meet a k-quant or i-quant matrix that is not repacked in the tiled GEMM, as a
/// dense batch of as many does: never llamafile's GEMM (float and legacy formats) nor
/// the repacked GEMM (`Q4_K` of a multiple of 8 rows).
#[test]
fn routed_tokens_get_their_dot_products_or_the_tiled_gemm() {
    use super::random_x;
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (i, ty) in types().enumerate() {
        for rows in [12, 16] {
            let cols = 2 * QK_K;
            let bytes = random_matrix(ty, rows, cols, 300 + i as u64);
            let m = QuantizedMatrix::new(ty, rows, cols, &bytes).unwrap();
            for n in [3, 9] {
                let x = random_x(n * cols, 40 + i as u64);
                let mut routed = vec![0.0; n * rows];
                m.matmul_routed(&x, n, &mut routed).unwrap();
                let mut dense = vec![0.0; n * rows];
                m.matmul(&x, n, &mut dense).unwrap();
                let mut alone = vec![0.0; n * rows];
                for (xt, yt) in x.chunks_exact(cols).zip(alone.chunks_exact_mut(rows)) {
                    m.matvec(xt, yt).unwrap();
                }
                use GgmlType::*;
                let superblocks = !matches!(
                    ty,
                    F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | IQ4_NL | MXFP4
                );
                let repacked = ty == Q4_K && rows % 8 == 0;
                let expected = if n >= 8 && superblocks && !repacked {
                    &dense
                } else {
                    &alone
                };
                assert_eq!(
                    bits(&routed),
                    bits(expected),
                    "{ty}, {rows} rows, {n} tokens"
                );
            }
        }
    }
}
