//! Products of a weight matrix in device memory with many tokens' activations (a prompt,
//! or one token of each of several sequences), on the GPU's matrix units: the batch twin
//! of [`super::matvec`], for any number of tokens.
//!
//! The activations go to f16 once per input ([`row_scales`]); each workgroup then decodes
//! tiles of the weights' blocks to f16 in shared memory (never outside it), while the
//! matrix units multiply the previous tile with the activations' tile, with f32 sums
//! (`kernels/matmul.hip`). It takes every type a [`GpuMatrix`] may hold
//! (`matvec::is_supported_on_gpu`, which `GpuMatrix::new` checks).
//! Results agree with the CPU kernels to rounding: weights and activations are rounded
//! to f16 (11 significant bits) where the CPU quantizes activations to 8 bits. So that no
//! activation overflows f16, each token's are divided by a power of two first
//! ([`row_scales`]) and its results multiplied by it, both exactly.

use gguf_format::GgmlType;
use half::f16;
#[cfg(hip_platform = "none")]
use hip_backend::HipError;
use hip_backend::{DeviceView, DeviceViewMut, Stream};

use super::check_device;
use super::matvec::{check_group, GpuMatrix};
use super::GpuDequantError;
use crate::DequantError;

/// The input of [`matmul`] from `n_tokens` rows of `cols` f32 values `x`: each row's scale
/// into `out` (`n_tokens` values), the power of two that brings the row's largest
/// magnitude into [2^14, 2^15) once divided by it (1 for a row of zeros or with a
/// non-finite value), and the row divided by it, rounded to f16, into `x16` (`n_tokens ×
/// cols` values).
pub fn row_scales(
    x: DeviceView<'_, f32>,
    n_tokens: usize,
    cols: usize,
    mut out: DeviceViewMut<'_, f32>,
    mut x16: DeviceViewMut<'_, f16>,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    let expected = n_tokens.saturating_mul(cols);
    if n_tokens == 0 || cols == 0 || x.len() != expected || n_tokens > i32::MAX as usize {
        return Err(DequantError::InputLength {
            n_tokens,
            cols,
            expected,
            actual: x.len(),
        }
        .into());
    }
    if out.len() != n_tokens || cols > i32::MAX as usize {
        return Err(DequantError::ProductOutputLength {
            n_tokens,
            rows: 1,
            expected: n_tokens,
            actual: out.len(),
        }
        .into());
    }
    DequantError::check_output(x16.len(), n_tokens, cols)?;
    let device = check_device(stream, x.device_ordinal(), out.device_ordinal())?;
    check_device(stream, x16.device_ordinal(), out.device_ordinal())?;
    launch_scales(x, n_tokens, cols, &mut out, &mut x16, device, stream)
}

/// Device memory a batch product may split its columns in, when its tiles alone would
/// leave the device idle (a few tokens against a matrix of few rows): the splits' partial
/// sums, and one counter per tile, which must hold zeros (the product leaves them so).
/// [`SPLIT_PARTIALS`] and [`SPLIT_COUNTERS`] are sizes that let every product split as
/// far as it would; with less, products split less or not at all.
pub struct SplitScratch<'a> {
    pub partials: DeviceViewMut<'a, f32>,
    pub counters: DeviceViewMut<'a, u32>,
}

impl SplitScratch<'_> {
    /// The same room, lent again for one more launch.
    pub fn reborrow(&mut self) -> SplitScratch<'_> {
        SplitScratch {
            partials: self.partials.reborrow(),
            counters: self.counters.reborrow(),
        }
    }
}

/// Partial sums that let a split product fill a device of up to 128 multiprocessors and
/// more: a split product keeps at most about four workgroups' tiles (of 128 × 128 sums)
/// per multiprocessor.
pub const SPLIT_PARTIALS: usize = 8 << 20;
/// Tile counters a split product may use at most (it splits only grids of fewer
/// workgroups than twice the multiprocessors).
pub const SPLIT_COUNTERS: usize = 512;

/// Which kernel a batch product runs ([`matmul_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchKernel {
    /// The one measured fastest for the type and the count of tokens: the skinny
    /// kernel up to [`SKINNY_MAX_TOKENS`] tokens for the types it prefers
    /// ([`skinny_prefers`]) where it runs, the tiled one otherwise; past whole tiles of
    /// 128 tokens, up to 32 tokens left over take the skinny kernel (a second launch)
    /// rather than a mostly empty tile, for matrices of at least 16 MiB together. What
    /// [`matmul`] runs.
    Fastest,
    /// The tiled kernel: shared-memory stages of 64 or 128 rows × 128 tokens, for any
    /// count (split when given room and its tiles leave the device idle).
    Tiles,
    /// The skinny kernel: each warp decodes its rows' blocks straight into the matrix
    /// instructions' registers, for up to [`SKINNY_MAX_TOKENS`] tokens of any type, on
    /// NVIDIA devices of compute capability 8.0 and later, from weights aligned as its
    /// loads need (16 bytes for `Q4_K` and `Q5_K`, 8 for `Q5_1`, 4 for `Q4_1`).
    /// Elsewhere the launch is refused.
    Skinny,
}

/// The most tokens the skinny kernel takes in one launch (`kSkinnyMaxTokens` in
/// `kernels/skinny.hip`).
pub const SKINNY_MAX_TOKENS: usize = 64;

/// Whether [`BatchKernel::Fastest`] takes the skinny kernel for a matrix of `ty` (up to
/// [`SKINNY_MAX_TOKENS`] tokens, where it runs): the types it reads with loads of their
/// own (`SkinnyFast` in `kernels/skinny.hip`). The others it decodes a byte at a time,
/// slower than the tiled kernel.
pub fn skinny_prefers(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4_K | Q5_K | Q6_K | MXFP4
    )
}

/// Whether [`BatchKernel::Skinny`] runs on `device`.
pub fn skinny_available(device: &hip_backend::Device) -> bool {
    #[cfg(not(hip_platform = "none"))]
    {
        let Ok(ordinal) = std::ffi::c_int::try_from(device.ordinal()) else {
            return false;
        };
        // SAFETY: a query of the device's properties by ordinal; it touches no memory of
        // ours.
        unsafe { sys::rf_matmul_skinny_available(ordinal) == 1 }
    }
    #[cfg(hip_platform = "none")]
    {
        let _ = device;
        false
    }
}

/// `outs[i] (+)= x · mats[i]ᵀ` for `n_tokens` tokens (any number from 1), queued on
/// `stream`, for one to [`MAX_MATRICES`](super::matvec::MAX_MATRICES) matrices of one
/// type and width in one launch (a layer's q, k and v, or gate and up): `x16` and
/// `scales` are what [`row_scales`] made of the `n_tokens × cols` activations, and each
/// output holds `n_tokens × rows`, token by token; with `accumulate` the products are
/// added to what the outputs hold. The width must be a multiple of 8.
///
/// Given `scratch` with room, a launch whose tiles alone would leave the device idle
/// splits its columns over several workgroups per tile: the same products, summed in a
/// fixed order (so repeated calls give the same bits), in a different order from the
/// unsplit product's.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    mats: &[GpuMatrix<'_>],
    x16: DeviceView<'_, f16>,
    scales: DeviceView<'_, f32>,
    n_tokens: usize,
    outs: &mut [DeviceViewMut<'_, f32>],
    accumulate: bool,
    scratch: Option<SplitScratch<'_>>,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    matmul_with(
        BatchKernel::Fastest,
        mats,
        x16,
        scales,
        n_tokens,
        outs,
        accumulate,
        scratch,
        stream,
    )
}

/// [`matmul`] on a chosen kernel (for comparisons and tests): the same function, summed
/// in another order. A kernel that does not apply to the product (see [`BatchKernel`])
/// fails with the launch's error.
#[allow(clippy::too_many_arguments)]
pub fn matmul_with(
    kernel: BatchKernel,
    mats: &[GpuMatrix<'_>],
    x16: DeviceView<'_, f16>,
    scales: DeviceView<'_, f32>,
    n_tokens: usize,
    outs: &mut [DeviceViewMut<'_, f32>],
    accumulate: bool,
    mut scratch: Option<SplitScratch<'_>>,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    let first = check_group(mats, outs.len())?;
    let cols = first.cols();
    if !cols.is_multiple_of(8) {
        return Err(DequantError::PartialRow {
            ty: first.ty(),
            cols,
            block_size: 8,
        }
        .into());
    }
    let too_large = DequantError::MatrixTooLarge {
        ty: first.ty(),
        rows: first.rows(),
        cols,
    };
    if n_tokens == 0 || n_tokens > i32::MAX as usize {
        return Err(DequantError::InputLength {
            n_tokens,
            cols,
            expected: cols,
            actual: x16.len(),
        }
        .into());
    }
    n_tokens.checked_mul(cols).ok_or(too_large)?;
    DequantError::check_input(x16.len(), n_tokens, cols)?;
    DequantError::check_input(scales.len(), n_tokens, 1)?;
    let device = check_device(stream, x16.device_ordinal(), scales.device_ordinal())?;
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
        kernel,
        mats,
        x16,
        scales,
        n_tokens,
        outs,
        accumulate,
        scratch.as_mut(),
        device,
        stream,
    )
}

#[cfg(not(hip_platform = "none"))]
mod sys {
    use std::ffi::{c_int, c_void};
    extern "C" {
        pub(super) fn rf_matmul_skinny_available(device: c_int) -> c_int;
        pub(super) fn rf_row_scales(
            x: *const c_void,
            n_tokens: c_int,
            cols: c_int,
            scales: *mut c_void,
            x16: *mut c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
    }
}

#[cfg(not(hip_platform = "none"))]
fn launch_scales(
    x: DeviceView<'_, f32>,
    n_tokens: usize,
    cols: usize,
    out: &mut DeviceViewMut<'_, f32>,
    x16: &mut DeviceViewMut<'_, f16>,
    device: i32,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    use std::ffi::c_int;
    // SAFETY: `row_scales` checked that `x` and `x16` hold `n_tokens × cols` values (f32,
    // f16) and `out` `n_tokens` f32, all on the stream's device and borrowed while the
    // kernel is queued; both counts fit in `c_int`. The kernel reads and writes only those
    // ranges.
    let status = unsafe {
        sys::rf_row_scales(
            x.as_ptr(),
            n_tokens as c_int,
            cols as c_int,
            out.as_mut_ptr(),
            x16.as_mut_ptr(),
            device,
            stream.as_raw(),
        )
    };
    hip_backend::check_status("rf_row_scales", status).map_err(GpuDequantError::from)
}

#[cfg(not(hip_platform = "none"))]
#[allow(clippy::too_many_arguments)]
fn launch(
    kernel: BatchKernel,
    mats: &[GpuMatrix<'_>],
    x16: DeviceView<'_, f16>,
    scales: DeviceView<'_, f32>,
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
    // The unit of the matrices' type (one type per launch, `check_group`).
    let launcher = super::launchers(mats[0].ty())?.matmul;
    // SAFETY: `matmul` checked every length: each weight view holds exactly its matrix
    // (`GpuMatrix::new`), `x16` `n_tokens × cols` f16, `scales` `n_tokens` f32 and each
    // output `n_tokens × rows` f32, all on the stream's device and borrowed (alive) while
    // the kernel is queued; the three arrays hold `mats.len()` (1 to 3) entries and are
    // read during the call only. Rows, columns and tokens fit in `c_int`. The split
    // scratch, when given, is `partial_floats` f32 and `n_counters` u32 on the same device,
    // borrowed while the kernel is queued; the launcher splits only as far as they hold.
    // The kernel reads and writes only those ranges.
    let status = unsafe {
        launcher(
            arrays.weights.as_ptr(),
            arrays.outs.as_ptr(),
            arrays.rows.as_ptr(),
            mats.len() as c_int,
            mats[0].cols() as c_int,
            x16.as_ptr(),
            scales.as_ptr(),
            n_tokens as c_int,
            c_int::from(accumulate),
            partials,
            partial_floats,
            counters,
            n_counters,
            match kernel {
                BatchKernel::Fastest => 0,
                BatchKernel::Tiles => 1,
                BatchKernel::Skinny => 2,
            },
            device,
            stream.as_raw(),
        )
    };
    hip_backend::check_status("rf_matmul", status).map_err(GpuDequantError::from)
}

#[cfg(hip_platform = "none")]
fn launch_scales(
    _: DeviceView<'_, f32>,
    _: usize,
    _: usize,
    _: &mut DeviceViewMut<'_, f32>,
    _: &mut DeviceViewMut<'_, f16>,
    _: i32,
    _: &Stream,
) -> Result<(), GpuDequantError> {
    Err(HipError::BuiltWithoutGpu.into())
}

#[cfg(hip_platform = "none")]
#[allow(clippy::too_many_arguments)]
fn launch(
    _: BatchKernel,
    _: &[GpuMatrix<'_>],
    _: DeviceView<'_, f16>,
    _: DeviceView<'_, f32>,
    _: usize,
    _: &mut [DeviceViewMut<'_, f32>],
    _: bool,
    _: Option<&mut SplitScratch<'_>>,
    _: i32,
    _: &Stream,
) -> Result<(), GpuDequantError> {
    Err(HipError::BuiltWithoutGpu.into())
}
