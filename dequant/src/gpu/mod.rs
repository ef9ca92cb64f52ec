//! Decoding on the GPU: every type the CPU decoders handle, to f32 or to f16, from block
//! bytes already in device memory into a device buffer, queued on a [`Stream`].
//!
//! Products on the blocks live in [`matvec`]: quantized weights against Q8 activation
//! blocks in integer dot products, for decoding and short batches; and in [`matmul`]:
//! weight tiles decoded to f16 in shared memory on the matrix units, for many tokens; and
//! for `Q4_K` in [`matmul_q8k`]: the weights' 4-bit values against 8-bit activations on
//! the int8 matrix units.
//!
//! Two layers:
//! - one typed wrapper per kernel ([`q4_k_to_f32`], [`iq2_xs_to_f16`], [`bf16_to_f32`] …),
//!   taking a view of blocks ([`BlockQ4_K`](crate::blocks::BlockQ4_K) …) or of plain
//!   elements (`f32`, [`half::f16`], [`half::bf16`], `f64`, `i8` … `i64`). It is the only
//!   caller of its kernel's launcher and checks the lengths and devices before launching;
//! - [`decode_f32`] and [`decode_f16`], which take the type at run time and the tensor's
//!   raw bytes, as [`crate::decode_f32`] does on the CPU.
//!
//! Results are bit-identical to the CPU reference decoders (and so to gguf-py): each
//! kernel performs the same f32 operations in the same order, products are never fused
//! into multiply-adds (`__fmul_rn` and friends on NVIDIA, `#pragma clang fp
//! contract(off)` on AMD), denormals are kept, and f16 output rounds to nearest even. The
//! one exception is NaN: a NaN decodes to a NaN, but its payload may differ from the CPU's.
//! The IQ lookup tables are generated at build time from the CPU decoders' tables
//! (`src/decode/grids.rs`): in constant memory for the decoders, in global memory for the
//! products (whose lanes read different entries at once).
//!
//! Built for platform `none` (see hip-backend), every function compiles and returns
//! [`HipError::BuiltWithoutGpu`] (inside [`GpuDequantError::Hip`]) after checking its
//! arguments.

pub mod experts;
mod kernels;
#[cfg(not(hip_platform = "none"))]
mod launchers;
pub mod matmul;
pub mod matmul_q8k;
pub mod matvec;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_experts;
#[cfg(test)]
mod tests_experts_sum;
#[cfg(test)]
mod tests_experts_table;
#[cfg(test)]
mod tests_experts_tiles;
#[cfg(test)]
mod tests_matvec;

use gguf_format::GgmlType;
use half::f16;
use hip_backend::{DeviceView, DeviceViewMut, HipError, Stream};

use crate::DequantError;

pub use kernels::*;

/// What can go wrong when decoding on the GPU.
#[derive(Debug, thiserror::Error)]
pub enum GpuDequantError {
    /// The input is not a whole number of blocks, or the output does not hold exactly
    /// the values the input decodes to: the same errors the CPU decoders return.
    #[error(transparent)]
    Layout(#[from] DequantError),
    /// No GPU support or no device, views of another device than the stream's, a view
    /// not aligned for its element type, or a failed launch.
    #[error(transparent)]
    Hip(#[from] HipError),
}

impl GpuDequantError {
    /// True when there is no GPU to run on (built without GPU support, or no device).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, GpuDequantError::Hip(error) if error.is_unavailable())
    }
}

/// The product launchers of `ty`, or the error of a type without products.
#[cfg(not(hip_platform = "none"))]
fn launchers(ty: GgmlType) -> Result<launchers::Launchers, GpuDequantError> {
    launchers::launchers(ty).ok_or(GpuDequantError::Layout(DequantError::NoProductKernel {
        ty,
    }))
}

/// Decodes `src`, whole blocks of type `ty` in device memory, into `dst` as f32, queued
/// on `stream` (the host does not wait). `dst` must hold exactly as many values as the
/// blocks do ([`crate::decoded_len`]). The bytes of block formats may start at any
/// address; those of plain types (F32, F16, …, I64) must be aligned for their element.
pub fn decode_f32(
    ty: GgmlType,
    src: DeviceView<'_, u8>,
    dst: DeviceViewMut<'_, f32>,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    crate::decoded_len(ty, src.len())?;
    kernels::dispatch_f32(ty, src, dst, stream)
}

/// As [`decode_f32`], with the values rounded to f16 (to nearest, ties to even). F16
/// input is copied unchanged.
pub fn decode_f16(
    ty: GgmlType,
    src: DeviceView<'_, u8>,
    dst: DeviceViewMut<'_, f16>,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    crate::decoded_len(ty, src.len())?;
    kernels::dispatch_f16(ty, src, dst, stream)
}

/// Checks a launch: `n_blocks` blocks of `values` values each must fill `dst_len`
/// outputs exactly. Returns the number of values.
fn check_lengths(
    ty: GgmlType,
    values: usize,
    n_blocks: usize,
    dst_len: usize,
) -> Result<usize, DequantError> {
    match n_blocks.checked_mul(values) {
        Some(expected) if expected == dst_len => Ok(expected),
        expected => Err(DequantError::OutputLength {
            ty,
            blocks: n_blocks,
            expected: expected.unwrap_or(usize::MAX),
            actual: dst_len,
        }),
    }
}

/// Checks that every view lives on the stream's device and returns its ordinal as the
/// launchers take it.
fn check_device(stream: &Stream, src: usize, dst: usize) -> Result<i32, HipError> {
    let expected = stream.device_ordinal();
    for (what, found) in [("the source", src), ("the destination", dst)] {
        if found != expected {
            return Err(HipError::DeviceMismatch {
                what,
                expected,
                found,
            });
        }
    }
    i32::try_from(expected).map_err(|_| HipError::InvalidDevice {
        ordinal: expected,
        count: i32::MAX as usize,
    })
}
