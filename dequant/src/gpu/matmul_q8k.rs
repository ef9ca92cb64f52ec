//! Batch products of `Q4_K` matrices on the GPU's int8 matrix units, from activations
//! quantized once per token to 8 bits in blocks of 256 ([`quantize_q8k`]: the layout of
//! the CPU's `Q8_K`, the input its own `Q4_K` dot products take).
//!
//! The f16 tiles of [`super::matmul`] turn every weight into f16 with its sub-block's
//! scale and minimum for each tile of tokens; these multiply the weights' 4-bit values
//! as they are stored, sum each sub-block of 32 in 32-bit integers, weight the sums by the
//! 6-bit sub-block scales in integers, and meet the floats (the super-block's scales, the
//! minimums against the activations' sub-block sums, the activations' block scale) once
//! per super-block (`kernels/tiles_q8k.h`). Results agree with the CPU's to the rounding
//! of the activations to 8 bits per block of 256 (the CPU's own for `Q4_K`), of the
//! sub-block sums to f16 above 2048, and of f32 sums in another order.
//!
//! NVIDIA devices of compute capability 8.0 and later ([`q8k_available`]); elsewhere the
//! f16 tiles are the batch products.

use gguf_format::GgmlType;
#[cfg(hip_platform = "none")]
use hip_backend::HipError;
use hip_backend::{DeviceView, DeviceViewMut, Stream};

use super::check_device;
use super::matmul::SplitScratch;
use super::matvec::{check_group, GpuMatrix};
use super::GpuDequantError;
use crate::DequantError;

/// Values a block of the `Q8_K` input.
pub const Q8K_BLOCK: usize = 256;

/// Bytes of the `Q8_K` input of `n_tokens` rows of `cols` values (a multiple of
/// [`Q8K_BLOCK`]): the int8 values row by row; one f32 scale a block, row by row; from the
/// next 16-byte boundary, one f16 sum a sub-block of 32 values, row by row (`q8k_bytes`
/// in `kernels/tiles_q8k.h`). None when the count overflows.
pub fn q8k_bytes(n_tokens: usize, cols: usize) -> Option<usize> {
    let values = n_tokens.checked_mul(cols)?;
    let scales = (values / Q8K_BLOCK).checked_mul(4)?;
    let sums_at = values.checked_add(scales.div_ceil(16) * 16)?;
    sums_at.checked_add((values / 32).checked_mul(2)?)
}

/// Whether [`matmul_q8k`] multiplies matrices of `ty` and width `cols` on `device`:
/// `Q4_K`, whole super-blocks, on a device with the int8 matrix units' path
/// ([`super::matmul::skinny_available`]).
pub fn q8k_takes(ty: GgmlType, cols: usize, device: &hip_backend::Device) -> bool {
    ty == GgmlType::Q4_K
        && cols.is_multiple_of(Q8K_BLOCK)
        && cols <= i32::MAX as usize
        && super::matmul::skinny_available(device)
}

/// `n_tokens` rows of `cols` f32 values `x` (a multiple of [`Q8K_BLOCK`]) as `Q8_K` blocks
/// into `out` ([`q8k_bytes`] bytes): each block's scale its largest magnitude / 127, its
/// values rounded to the nearest multiple of it. A block of zeros, or with a non-finite
/// value, becomes zeros with scale 0. `x` and `out` must start 16-byte aligned.
pub fn quantize_q8k(
    x: DeviceView<'_, f32>,
    n_tokens: usize,
    cols: usize,
    mut out: DeviceViewMut<'_, u8>,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    check_width(cols)?;
    if n_tokens == 0 || n_tokens > i32::MAX as usize {
        return Err(DequantError::InputLength {
            n_tokens,
            cols,
            expected: n_tokens.saturating_mul(cols),
            actual: x.len(),
        }
        .into());
    }
    DequantError::check_input(x.len(), n_tokens, cols)?;
    let bytes = q8k_bytes(n_tokens, cols).ok_or(DequantError::InputLength {
        n_tokens,
        cols,
        expected: usize::MAX,
        actual: out.len(),
    })?;
    DequantError::check_input_of(out.len(), n_tokens, cols, bytes)?;
    let device = check_device(stream, x.device_ordinal(), out.device_ordinal())?;
    launch_quantize(x, n_tokens, cols, &mut out, device, stream)
}

/// `outs[i] (+)= x · mats[i]ᵀ` for `n_tokens` tokens, queued on `stream`, for one to
/// three `Q4_K` matrices of one width in one launch: `xq` is what [`quantize_q8k`] made of
/// the `n_tokens × cols` activations, each output holds `n_tokens × rows`, token by token;
/// with `accumulate` the products are added to what the outputs hold. With `scratch`, a
/// product whose tiles alone leave the device idle (a batch of a few dozen decoding
/// sequences) splits its columns as the f16 products do ([`super::matmul::matmul`]), with
/// the same bits on every call. Refused (the launch's error) where [`q8k_takes`] does not
/// hold or the weights or input do not start 16-byte aligned.
pub fn matmul_q8k(
    mats: &[GpuMatrix<'_>],
    xq: DeviceView<'_, u8>,
    n_tokens: usize,
    outs: &mut [DeviceViewMut<'_, f32>],
    accumulate: bool,
    mut scratch: Option<SplitScratch<'_>>,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    let first = check_group(mats, outs.len())?;
    let cols = first.cols();
    check_width(cols)?;
    if first.ty() != GgmlType::Q4_K {
        return Err(DequantError::NoProductKernel { ty: first.ty() }.into());
    }
    if n_tokens == 0 || n_tokens > i32::MAX as usize {
        return Err(DequantError::InputLength {
            n_tokens,
            cols,
            expected: cols,
            actual: xq.len(),
        }
        .into());
    }
    let bytes = q8k_bytes(n_tokens, cols).ok_or(DequantError::MatrixTooLarge {
        ty: first.ty(),
        rows: first.rows(),
        cols,
    })?;
    DequantError::check_input_of(xq.len(), n_tokens, cols, bytes)?;
    let device = check_device(stream, xq.device_ordinal(), xq.device_ordinal())?;
    for (m, out) in mats.iter().zip(outs.iter()) {
        check_device(stream, m.bytes().device_ordinal(), out.device_ordinal())?;
        DequantError::check_output(out.len(), n_tokens, m.rows())?;
    }
    if let Some(room) = &scratch {
        check_device(
            stream,
            room.partials.device_ordinal(),
            room.counters.device_ordinal(),
        )?;
    }
    launch(
        mats,
        xq,
        n_tokens,
        outs,
        accumulate,
        scratch.as_mut(),
        device,
        stream,
    )
}

/// Refuses a width that is not whole blocks of [`Q8K_BLOCK`] (or past `c_int`).
fn check_width(cols: usize) -> Result<(), DequantError> {
    if cols == 0 || !cols.is_multiple_of(Q8K_BLOCK) || cols > i32::MAX as usize {
        return Err(DequantError::PartialRow {
            ty: GgmlType::Q8_K,
            cols,
            block_size: Q8K_BLOCK,
        });
    }
    Ok(())
}

#[cfg(not(hip_platform = "none"))]
mod sys {
    use std::ffi::{c_int, c_void};
    extern "C" {
        pub(super) fn rf_quantize_q8k(
            x: *const c_void,
            n_tokens: c_int,
            cols: c_int,
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
    cols: usize,
    out: &mut DeviceViewMut<'_, u8>,
    device: i32,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    use std::ffi::c_int;
    // SAFETY: `quantize_q8k` checked that `x` holds `n_tokens × cols` f32 and `out`
    // `q8k_bytes(n_tokens, cols)` bytes, both on the stream's device and borrowed while the
    // kernel is queued; both counts fit in `c_int`. The launcher refuses unaligned
    // pointers; the kernel reads and writes only those ranges.
    let status = unsafe {
        sys::rf_quantize_q8k(
            x.as_ptr(),
            n_tokens as c_int,
            cols as c_int,
            out.as_mut_ptr(),
            device,
            stream.as_raw(),
        )
    };
    hip_backend::check_status("rf_quantize_q8k", status).map_err(GpuDequantError::from)
}

#[cfg(not(hip_platform = "none"))]
#[allow(clippy::too_many_arguments)]
fn launch(
    mats: &[GpuMatrix<'_>],
    xq: DeviceView<'_, u8>,
    n_tokens: usize,
    outs: &mut [DeviceViewMut<'_, f32>],
    accumulate: bool,
    scratch: Option<&mut SplitScratch<'_>>,
    device: i32,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    use std::ffi::c_int;
    let arrays = super::matvec::MatrixArrays::new(mats, outs);
    let (partials, partial_floats, counters, n_counters) = match scratch {
        Some(room) => (
            room.partials.as_mut_ptr(),
            i64::try_from(room.partials.len()).unwrap_or(i64::MAX),
            room.counters.as_mut_ptr(),
            c_int::try_from(room.counters.len()).unwrap_or(c_int::MAX),
        ),
        None => (std::ptr::null_mut(), 0, std::ptr::null_mut(), 0),
    };
    let launcher = super::launchers(mats[0].ty())?.matmul_q8k;
    // SAFETY: `matmul_q8k` checked every length: each weight view holds exactly its
    // matrix (`GpuMatrix::new`), `xq` the `Q8_K` bytes of `n_tokens × cols` values and each
    // output `n_tokens × rows` f32, all on the stream's device and borrowed while the
    // kernel is queued; the arrays hold `mats.len()` (1 to 3) entries and are read during
    // the call only. Rows, columns and tokens fit in `c_int`. The split scratch, when
    // given, is `partial_floats` f32 and `n_counters` u32 on the same device, borrowed
    // while the kernel is queued; the launcher splits only as far as they hold. The
    // launcher refuses unaligned pointers; the kernel reads and writes only those ranges.
    let status = unsafe {
        launcher(
            arrays.weights.as_ptr(),
            arrays.outs.as_ptr(),
            arrays.rows.as_ptr(),
            mats.len() as c_int,
            mats[0].cols() as c_int,
            xq.as_ptr(),
            n_tokens as c_int,
            c_int::from(accumulate),
            partials.cast(),
            partial_floats,
            counters.cast(),
            n_counters,
            device,
            stream.as_raw(),
        )
    };
    hip_backend::check_status("rf_matmul_q8k", status).map_err(GpuDequantError::from)
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
#[allow(clippy::too_many_arguments)]
fn launch(
    _: &[GpuMatrix<'_>],
    _: DeviceView<'_, u8>,
    _: usize,
    _: &mut [DeviceViewMut<'_, f32>],
    _: bool,
    _: Option<&mut SplitScratch<'_>>,
    _: i32,
    _: &Stream,
) -> Result<(), GpuDequantError> {
    Err(HipError::BuiltWithoutGpu.into())
}
