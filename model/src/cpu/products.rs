//! The products and small vector helpers of the CPU forward pass: weights read straight
//! from the mapped file and multiplied on their quantized blocks (`dequant::matmul`).

use std::borrow::Cow;

use dequant::matmul::QuantizedMatrix;
use tensor_store::TensorHandle;

use crate::plan::{Linear, Vector};
use crate::ModelError;

/// Several linear layers of one input. For a single token whose weights share a type
/// and width, one fused product (the activations prepared once, one parallel loop);
/// otherwise one product each. The results are the same bits either way.
pub(crate) fn linears<const K: usize>(
    lins: [&Linear; K],
    x: &[f32],
    n: usize,
    mut outs: [&mut Vec<f32>; K],
) -> Result<(), ModelError> {
    let fusable = n == 1
        && lins
            .iter()
            .all(|l| l.weight.ggml_type() == lins[0].weight.ggml_type() && l.cols == lins[0].cols);
    if !fusable {
        for (lin, out) in lins.iter().zip(outs.iter_mut()) {
            linear(lin, x, n, out)?;
        }
        return Ok(());
    }
    let mut matrices = Vec::with_capacity(K);
    for (lin, out) in lins.iter().zip(outs.iter_mut()) {
        matrices.push(matrix(lin)?);
        resize_for_overwrite(out, lin.rows);
    }
    let mut ys = outs.each_mut().map(|o| o.as_mut_slice());
    QuantizedMatrix::matvec_many(&matrices, x, &mut ys).map_err(|source| ModelError::Matmul {
        name: lins
            .iter()
            .map(|l| l.weight.name())
            .collect::<Vec<_>>()
            .join(" + "),
        source,
    })?;
    for (lin, out) in lins.iter().zip(outs.iter_mut()) {
        add_bias(lin, out)?;
    }
    Ok(())
}

/// The weight of `lin` as a matrix over its mapped bytes (its rows' part of them).
fn matrix(lin: &Linear) -> Result<QuantizedMatrix<'_>, ModelError> {
    matrix_rows(lin, 0..lin.rows)
}

/// Rows `rows` of `lin`'s weight as a matrix over its mapped bytes.
pub(crate) fn matrix_rows(
    lin: &Linear,
    rows: std::ops::Range<usize>,
) -> Result<QuantizedMatrix<'_>, ModelError> {
    let mut bytes = lin.weight.bytes()?;
    // Rows of every matrix of the tensor: one, or a 3-D tensor's experts one after
    // the other.
    let tensor_rows: u64 = lin.weight.shape().iter().skip(1).product();
    let whole = lin.rows as u64 == tensor_rows;
    if lin.first_row != 0 || !whole || rows != (0..lin.rows) {
        let ty = lin.weight.ggml_type();
        let row_bytes = ty.row_bytes(lin.cols as u64).unwrap_or(0) as usize;
        let start = (lin.first_row + rows.start) * row_bytes;
        bytes = bytes
            .get(start..start + rows.len() * row_bytes)
            .unwrap_or_default();
    }
    QuantizedMatrix::new(lin.weight.ggml_type(), rows.len(), lin.cols, bytes).map_err(|source| {
        ModelError::Matmul {
            name: lin.weight.name().to_owned(),
            source,
        }
    })
}

/// Adds `lin`'s bias, if it has one, to every token's row of `out`.
pub(crate) fn add_bias(lin: &Linear, out: &mut [f32]) -> Result<(), ModelError> {
    if let Some(bias) = &lin.bias {
        let b = values(bias)?;
        for row in out.chunks_exact_mut(lin.rows) {
            add(row, &b);
        }
    }
    Ok(())
}

/// `out = x · Wᵀ (+ bias)` for `n` tokens.
pub(crate) fn linear(
    lin: &Linear,
    x: &[f32],
    n: usize,
    out: &mut Vec<f32>,
) -> Result<(), ModelError> {
    resize_for_overwrite(out, n * lin.rows);
    matrix(lin)?
        .matmul(x, n, out)
        .map_err(|source| ModelError::Matmul {
            name: lin.weight.name().to_owned(),
            source,
        })?;
    add_bias(lin, out)
}

pub(crate) fn vector(v: &Vector) -> Result<Cow<'_, [f32]>, ModelError> {
    values(&v.handle)
}

/// A small float tensor as f32: borrowed when the bytes are aligned f32, else decoded.
pub(crate) fn values(handle: &TensorHandle) -> Result<Cow<'_, [f32]>, ModelError> {
    let bytes = handle.bytes()?;
    if handle.ggml_type() == gguf_format::GgmlType::F32 {
        if let Ok(floats) = bytemuck::try_cast_slice::<u8, f32>(bytes) {
            return Ok(Cow::Borrowed(floats));
        }
    }
    let mut out = vec![0f32; handle.info().n_elements() as usize];
    decode_row(handle.name(), handle.ggml_type(), bytes, &mut out)?;
    Ok(Cow::Owned(out))
}

pub(crate) fn resize(buf: &mut Vec<f32>, len: usize) {
    buf.clear();
    buf.resize(len, 0.0);
}

/// `buf` at `len` values for a product that writes every one of them: only room it did
/// not have is zeroed, not what the product overwrites anyway.
fn resize_for_overwrite(buf: &mut Vec<f32>, len: usize) {
    buf.truncate(len);
    buf.resize(len, 0.0);
}

pub(crate) fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Decodes whole blocks of `bytes` into `out`, whatever their type.
pub(crate) fn decode_row(
    name: &str,
    ty: gguf_format::GgmlType,
    bytes: &[u8],
    out: &mut [f32],
) -> Result<(), ModelError> {
    dequant::decode_f32(ty, bytes, out).map_err(|source| ModelError::Decode {
        name: name.to_owned(),
        source,
    })
}
