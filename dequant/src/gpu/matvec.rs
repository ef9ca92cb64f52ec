//! Products of weight matrices in device memory with a few tokens' activations, on the
//! weights' own blocks: the GPU twin of [`crate::matmul::QuantizedMatrix::matmul`] for
//! decoding (one token) and short batches (up to [`MAX_TOKENS`]).
//!
//! Quantized weights meet activations quantized once per product to Q8 activation blocks
//! ([`quantize_q8`]: 32 int8 values, an f32 scale and the sums of the two halves' values,
//! [`Q8_BLOCK_BYTES`] bytes) in integer dot products (the blocks' int8 values first, token
//! by token, then one f32 scale per block, then one int of half sums per block); float
//! weights (F32, F16, BF16) meet f32 activations. The kernels
//! (`kernels/matvec.hip`) say how each block type is read. Results agree with the CPU
//! kernels to rounding, not bit for bit: the GPU sums in another order and quantizes the
//! activations of every type in blocks of 32.
//!
//! Up to three matrices of one type and width (a layer's q, k, v, or gate and up) run in
//! one launch: [`matvec`] takes a slice of them and one output per matrix.

use gguf_format::GgmlType;
#[cfg(hip_platform = "none")]
use hip_backend::HipError;
use hip_backend::{DeviceView, DeviceViewMut, Stream};

use super::{check_device, GpuDequantError};
use crate::DequantError;

/// Bytes of one Q8 activation block: 32 int8 values, their f32 scale, and the sums of
/// each half's values (two i16 in one 32-bit word) that weights with offsets or minimums
/// take.
pub const Q8_BLOCK_BYTES: usize = 40;
/// Values per Q8 activation block.
pub const Q8_BLOCK_VALUES: usize = 32;
/// Most tokens one product takes.
pub const MAX_TOKENS: usize = 8;
/// Most tokens one product of float weights takes (on f32 input): the launch runs them
/// [`MAX_TOKENS`] at a time.
pub const MAX_FLOAT_TOKENS: usize = 65_535 * MAX_TOKENS;
/// Most matrices one product takes.
pub const MAX_MATRICES: usize = 3;

/// Bytes of the Q8 activation blocks of `n_tokens` rows of `n_cols` values.
pub fn q8_bytes(n_tokens: usize, n_cols: usize) -> usize {
    n_tokens * (n_cols / Q8_BLOCK_VALUES) * Q8_BLOCK_BYTES
}

/// Whether the GPU multiplies weights of type `ty` on their blocks: every type the CPU
/// does ([`crate::matmul::is_supported`]) but the ternary TQ1_0 and TQ2_0.
pub fn is_supported_on_gpu(ty: GgmlType) -> bool {
    crate::matmul::is_supported(ty) && !matches!(ty, GgmlType::TQ1_0 | GgmlType::TQ2_0)
}

/// Whether products with weights of type `ty` take Q8 activation blocks (quantized
/// types) rather than f32 values (F32, F16, BF16).
pub fn takes_q8(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// A `rows × cols` weight matrix of type `ty` in device memory, in its GGUF block layout.
#[derive(Clone, Copy, Debug)]
pub struct GpuMatrix<'a> {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    bytes: DeviceView<'a, u8>,
}

impl<'a> GpuMatrix<'a> {
    /// Checks that `ty` has a product kernel, that rows are whole blocks (and whole Q8
    /// activation blocks), and that `bytes` holds exactly the matrix.
    pub fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: DeviceView<'a, u8>,
    ) -> Result<GpuMatrix<'a>, DequantError> {
        let expected = matrix_bytes(ty, rows, cols)?;
        if bytes.len() != expected {
            return Err(DequantError::WeightBytes {
                ty,
                rows,
                cols,
                expected,
                actual: bytes.len(),
            });
        }
        Ok(GpuMatrix {
            ty,
            rows,
            cols,
            bytes,
        })
    }

    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The matrix's blocks.
    pub fn bytes(&self) -> DeviceView<'a, u8> {
        self.bytes
    }
}

/// The bytes of a `rows × cols` matrix of type `ty`, once its width is checked (whole
/// blocks of a type with a product kernel) and its sides fit the kernels' indices.
pub(super) fn matrix_bytes(ty: GgmlType, rows: usize, cols: usize) -> Result<usize, DequantError> {
    check_width(ty, cols)?;
    let overflow = DequantError::MatrixTooLarge { ty, rows, cols };
    if rows > i32::MAX as usize || cols > i32::MAX as usize {
        return Err(overflow);
    }
    (cols / ty.block_size() as usize)
        .checked_mul(ty.type_size() as usize)
        .and_then(|row| row.checked_mul(rows))
        .ok_or(overflow)
}

/// The input of a product: Q8 activation blocks for quantized weights, f32 values for
/// float weights, `n_tokens` rows of the matrices' width either way.
#[derive(Clone, Copy, Debug)]
pub enum GpuActivations<'a> {
    Q8(DeviceView<'a, u8>),
    F32(DeviceView<'a, f32>),
}

/// Quantizes `n_tokens` rows of `n_cols` f32 values (`n_cols` a multiple of 32) into Q8
/// activation blocks in `out` ([`q8_bytes`] bytes), queued on `stream`.
pub fn quantize_q8(
    x: DeviceView<'_, f32>,
    n_tokens: usize,
    n_cols: usize,
    mut out: DeviceViewMut<'_, u8>,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    if !n_cols.is_multiple_of(Q8_BLOCK_VALUES) {
        return Err(DequantError::PartialRow {
            ty: GgmlType::Q8_0,
            cols: n_cols,
            block_size: Q8_BLOCK_VALUES,
        }
        .into());
    }
    DequantError::check_input(x.len(), n_tokens, n_cols)?;
    if out.len() != q8_bytes(n_tokens, n_cols) {
        return Err(DequantError::ProductOutputLength {
            n_tokens,
            rows: n_cols / Q8_BLOCK_VALUES * Q8_BLOCK_BYTES,
            expected: q8_bytes(n_tokens, n_cols),
            actual: out.len(),
        }
        .into());
    }
    let device = check_device(stream, x.device_ordinal(), out.device_ordinal())?;
    launch_quantize(x, n_tokens, n_cols, &mut out, device, stream)
}

/// Checks that the GPU multiplies `ty` and that rows of `cols` values are whole blocks
/// of it and of the Q8 activations it takes.
fn check_width(ty: GgmlType, cols: usize) -> Result<(), DequantError> {
    if !is_supported_on_gpu(ty) {
        return Err(DequantError::NoProductKernel { ty });
    }
    let block_size = ty.block_size() as usize;
    let unit = if takes_q8(ty) {
        block_size.max(Q8_BLOCK_VALUES)
    } else {
        block_size
    };
    if !cols.is_multiple_of(unit) {
        return Err(DequantError::PartialRow {
            ty,
            cols,
            block_size: unit,
        });
    }
    Ok(())
}

/// The first of one launch's matrices, once they are 1 to [`MAX_MATRICES`] of one type
/// and width with one output each.
pub(super) fn check_group<'m, 'a>(
    mats: &'m [GpuMatrix<'a>],
    outputs: usize,
) -> Result<&'m GpuMatrix<'a>, DequantError> {
    let first = mats.first().ok_or(DequantError::ProductCount {
        matrices: 0,
        outputs,
    })?;
    if mats.len() != outputs || mats.len() > MAX_MATRICES {
        return Err(DequantError::ProductCount {
            matrices: mats.len(),
            outputs,
        });
    }
    for m in mats {
        if m.ty != first.ty || m.cols != first.cols {
            return Err(DequantError::MixedProducts {
                first: (first.ty, first.cols),
                other: (m.ty, m.cols),
            });
        }
    }
    Ok(first)
}

/// `outs[i] (+)= x · mats[i]ᵀ` for `n_tokens` tokens (1 to [`MAX_TOKENS`]; for float
/// weights, 1 to [`MAX_FLOAT_TOKENS`]), every matrix of one type and width, queued on
/// `stream`. `outs[i]` holds `n_tokens × rows` values,
/// token by token; with `accumulate` the products are added to what it holds (a residual
/// connection) instead of replacing it.
pub fn matvec(
    mats: &[GpuMatrix<'_>],
    x: GpuActivations<'_>,
    n_tokens: usize,
    outs: &mut [DeviceViewMut<'_, f32>],
    accumulate: bool,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    let first = check_group(mats, outs.len())?;
    let max = if takes_q8(first.ty) {
        MAX_TOKENS
    } else {
        MAX_FLOAT_TOKENS
    };
    if n_tokens == 0 || n_tokens > max {
        return Err(DequantError::InputLength {
            n_tokens,
            cols: first.cols,
            expected: max * first.cols,
            actual: n_tokens * first.cols,
        }
        .into());
    }
    let x_device = match (x, takes_q8(first.ty)) {
        (GpuActivations::Q8(q), true) => {
            let expected = q8_bytes(n_tokens, first.cols);
            DequantError::check_input_of(q.len(), n_tokens, first.cols, expected)?;
            q.device_ordinal()
        }
        (GpuActivations::F32(f), false) => {
            DequantError::check_input(f.len(), n_tokens, first.cols)?;
            f.device_ordinal()
        }
        _ => {
            return Err(DequantError::NoProductKernel { ty: first.ty }.into());
        }
    };
    let device = check_device(stream, x_device, x_device)?;
    for (m, out) in mats.iter().zip(outs.iter()) {
        check_device(stream, m.bytes.device_ordinal(), out.device_ordinal())?;
        DequantError::check_output(out.len(), n_tokens, m.rows)?;
    }
    launch_matvec(mats, x, n_tokens, outs, accumulate, device, stream)
}

/// Loads the code of the kernel that [`matvec`] launches for `n_tokens` tokens of `ty`
/// rows `cols` wide, on the stream's device, and queues nothing. The runtimes load a
/// weight type's products at the first use of one of their kernels, which the first
/// launch pays for (about a millisecond); a caller that waits anyway (for weights still
/// arriving, say) can pay it then. Returns at once when the code is loaded already.
pub fn load_matvec(
    ty: GgmlType,
    cols: usize,
    n_tokens: usize,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    check_width(ty, cols)?;
    if n_tokens == 0 || n_tokens > MAX_TOKENS {
        return Err(DequantError::ProductTokens {
            n_tokens,
            max: MAX_TOKENS,
        }
        .into());
    }
    if cols > i32::MAX as usize {
        return Err(DequantError::MatrixTooLarge { ty, rows: 1, cols }.into());
    }
    let device = check_device(stream, stream.device_ordinal(), stream.device_ordinal())?;
    load_kernel(ty, cols, n_tokens, device)
}

#[cfg(not(hip_platform = "none"))]
mod sys {
    use std::ffi::{c_int, c_void};
    extern "C" {
        pub(super) fn rf_quantize_q8(
            x: *const c_void,
            n_tokens: usize,
            n_cols: usize,
            out: *mut c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
    }
}

#[cfg(not(hip_platform = "none"))]
fn launch_quantize(
    x: DeviceView<'_, f32>,
    n_tokens: usize,
    n_cols: usize,
    out: &mut DeviceViewMut<'_, u8>,
    device: i32,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    // SAFETY: `x` holds `n_tokens × n_cols` f32 values and `out` exactly their Q8 blocks
    // (checked by `quantize_q8`), both on the stream's device and borrowed, so alive, while
    // the kernel is queued (the runtime's free waits for queued work). The kernel reads
    // and writes only those ranges.
    let status = unsafe {
        sys::rf_quantize_q8(
            x.as_ptr(),
            n_tokens,
            n_cols,
            out.as_mut_ptr(),
            device,
            stream.as_raw(),
        )
    };
    hip_backend::check_status("rf_quantize_q8", status).map_err(GpuDequantError::from)
}

/// The arrays of weights, outputs and row counts that the launchers of several matrices
/// in one launch take (`mats` and `outs` of one length, checked by `check_group`).
#[cfg(not(hip_platform = "none"))]
pub(super) struct MatrixArrays {
    pub(super) weights: Vec<*const std::ffi::c_void>,
    pub(super) outs: Vec<*mut std::ffi::c_void>,
    pub(super) rows: Vec<std::ffi::c_int>,
}

#[cfg(not(hip_platform = "none"))]
impl MatrixArrays {
    pub(super) fn new(mats: &[GpuMatrix<'_>], outs: &mut [DeviceViewMut<'_, f32>]) -> Self {
        MatrixArrays {
            weights: mats.iter().map(|m| m.bytes.as_ptr()).collect(),
            outs: outs.iter_mut().map(|o| o.as_mut_ptr()).collect(),
            rows: mats.iter().map(|m| m.rows as std::ffi::c_int).collect(),
        }
    }
}

#[cfg(not(hip_platform = "none"))]
fn launch_matvec(
    mats: &[GpuMatrix<'_>],
    x: GpuActivations<'_>,
    n_tokens: usize,
    outs: &mut [DeviceViewMut<'_, f32>],
    accumulate: bool,
    device: i32,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    use std::ffi::c_int;
    let arrays = MatrixArrays::new(mats, outs);
    let x_ptr = match x {
        GpuActivations::Q8(q) => q.as_ptr(),
        GpuActivations::F32(f) => f.as_ptr(),
    };
    let first = &mats[0];
    // The unit of the matrices' type (one type per launch, `check_group`).
    let launcher = super::launchers(first.ty)?.matvec;
    // SAFETY: `matvec` checked every length: each weight view holds exactly its matrix,
    // each output `n_tokens × rows` f32, the input `n_tokens` rows of the width in the
    // form the type takes; all are on the stream's device and stay borrowed (alive) while
    // the kernel is queued. The pointer arrays live through the call, which copies them
    // into the kernel's arguments. Rows and columns fit in `c_int` (`GpuMatrix::new`).
    let status = unsafe {
        launcher(
            arrays.weights.as_ptr(),
            arrays.outs.as_ptr(),
            arrays.rows.as_ptr(),
            mats.len() as c_int,
            first.cols as c_int,
            x_ptr,
            n_tokens as c_int,
            c_int::from(accumulate),
            device,
            stream.as_raw(),
        )
    };
    hip_backend::check_status("rf_matvec", status).map_err(GpuDequantError::from)
}

#[cfg(not(hip_platform = "none"))]
fn load_kernel(
    ty: GgmlType,
    cols: usize,
    n_tokens: usize,
    device: i32,
) -> Result<(), GpuDequantError> {
    use std::ffi::c_int;
    let load = super::launchers(ty)?.matvec_load;
    // SAFETY: the loader only asks the runtime for one kernel's attributes; `cols` fits
    // in `c_int` and `n_tokens` is 1 to MAX_TOKENS (checked by `load_matvec`).
    let status = unsafe { load(cols as c_int, n_tokens as c_int, device) };
    hip_backend::check_status("rf_matvec_load", status).map_err(GpuDequantError::from)
}

#[cfg(hip_platform = "none")]
fn launch_quantize(
    _: DeviceView<'_, f32>,
    _: usize,
    _: usize,
    _: &mut DeviceViewMut<'_, u8>,
    _: i32,
    _: &Stream,
) -> Result<(), GpuDequantError> {
    Err(HipError::BuiltWithoutGpu.into())
}

#[cfg(hip_platform = "none")]
fn launch_matvec(
    _: &[GpuMatrix<'_>],
    _: GpuActivations<'_>,
    _: usize,
    _: &mut [DeviceViewMut<'_, f32>],
    _: bool,
    _: i32,
    _: &Stream,
) -> Result<(), GpuDequantError> {
    Err(HipError::BuiltWithoutGpu.into())
}

#[cfg(hip_platform = "none")]
fn load_kernel(_: GgmlType, _: usize, _: usize, _: i32) -> Result<(), GpuDequantError> {
    Err(HipError::BuiltWithoutGpu.into())
}
