//! The launchers of `kernels/dequant.hip` and their typed wrappers: for every type two
//! kernels (to f32, to f16), each with one wrapper that checks lengths and devices and is
//! its launcher's only caller.
//!
//! Every launcher has the C signature
//! `int rf_dequant_NAME_OUT(const void* src, size_t n, void* dst, int device, void* stream)`:
//! `src` points at `n` blocks (or plain elements) in device memory, `dst` at exactly
//! `n * values-per-block` outputs (f32, or f16 bits), `device` is the ordinal the stream
//! belongs to (the launcher makes it current), and `stream` is the runtime's stream
//! handle. It queues the kernel and returns the launch status as the platform's native
//! error code. It never reads or writes outside those two ranges.

use gguf_format::GgmlType;
use half::{bf16, f16};
#[cfg(hip_platform = "none")]
use hip_backend::HipError;
use hip_backend::{DeviceView, DeviceViewMut, Stream};

use super::{check_device, check_lengths, GpuDequantError};
use crate::blocks::*;

/// Queues the launcher `$sym` over `$n` elements of `$src` into `$dst`; the caller has
/// checked lengths and devices.
#[cfg(not(hip_platform = "none"))]
macro_rules! launch {
    ($sym:ident, $src:ident, $n:ident, $dst:ident, $device:ident, $stream:ident) => {{
        if $n == 0 {
            return Ok(());
        }
        // SAFETY: `$src` views `$n` elements and `$dst` exactly as many outputs as they
        // decode to (checked by `check_lengths` just before), both on the stream's device
        // (`check_device`); both borrow device memory that stays allocated while the
        // kernel is queued (the runtime's free waits for queued work); the launcher reads
        // and writes only those ranges and takes the stream handle, live while `$stream`
        // is borrowed, and the device ordinal it belongs to.
        let status = unsafe {
            sys::$sym(
                $src.as_ptr(),
                $n,
                $dst.as_mut_ptr(),
                $device,
                $stream.as_raw(),
            )
        };
        hip_backend::check_status(stringify!($sym), status).map_err(GpuDequantError::from)
    }};
}

/// Built without GPU support: the arguments were checked, nothing can run.
#[cfg(hip_platform = "none")]
macro_rules! launch {
    ($sym:ident, $src:ident, $n:ident, $dst:ident, $device:ident, $stream:ident) => {{
        let _ = (&$src, $n, &mut $dst, $device, $stream);
        Err(GpuDequantError::Hip(HipError::BuiltWithoutGpu))
    }};
}

/// One typed wrapper.
macro_rules! wrapper {
    (
        $ty:ident, $src:ty, $values:literal, $where:literal,
        $name:ident, $out:ty, $out_doc:literal, $sym:ident
    ) => {
        #[doc = concat!(
            "Decodes `", stringify!($ty), "` data into `dst` as ", $out_doc,
            ", queued on `stream`.\n\n",
            "- `src`: `n` elements of `", stringify!($src), "` in device memory (",
            $where, "), each decoding to ", stringify!($values), " value(s);\n",
            "- `dst`: exactly `", stringify!($values), " * n` values, in order (16-byte ",
            "alignment lets the kernel use vector stores);\n",
            "- both on `stream`'s device.\n\n",
            "Launches `", stringify!($sym), "`. Errors: [`crate::DequantError::OutputLength`] ",
            "for a wrong `dst` length, [`hip_backend::HipError::DeviceMismatch`], a failed launch, or ",
            "[`hip_backend::HipError::BuiltWithoutGpu`]."
        )]
        pub fn $name(
            src: DeviceView<'_, $src>,
            mut dst: DeviceViewMut<'_, $out>,
            stream: &Stream,
        ) -> Result<(), GpuDequantError> {
            let n = src.len();
            check_lengths(GgmlType::$ty, $values, n, dst.len())?;
            let device = check_device(stream, src.device_ordinal(), dst.device_ordinal())?;
            launch!($sym, src, n, dst, device, stream)
        }
    };
}

/// Declares the launchers `$sym`, all of the one C signature the module's header gives.
#[cfg(not(hip_platform = "none"))]
macro_rules! launchers {
    ($($sym:ident)*) => {
        extern "C" {
            $(
                pub(super) fn $sym(
                    src: *const c_void,
                    n: usize,
                    dst: *mut c_void,
                    device: c_int,
                    stream: *mut c_void,
                ) -> c_int;
            )*
        }
    };
}

/// A decoder that takes the type at run time: each type's bytes to its wrapper.
macro_rules! dispatch {
    ($(#[$doc:meta])* $name:ident, $out:ty, $($ty:ident => $wrapper:ident),*) => {
        $(#[$doc])*
        pub(super) fn $name(
            ty: GgmlType,
            src: DeviceView<'_, u8>,
            dst: DeviceViewMut<'_, $out>,
            stream: &Stream,
        ) -> Result<(), GpuDequantError> {
            match ty {
                $(GgmlType::$ty => $wrapper(src.cast()?, dst, stream),)*
            }
        }
    };
}

/// The table of GPU decoders: type, source element, values per element, where the source
/// may start, the two wrappers and the two launchers. Keep in step with the list at the
/// end of `kernels/dequant.hip`.
macro_rules! gpu_decoders {
    ($(
        $ty:ident, $src:ty, $values:literal, $where:literal,
        $to_f32:ident, $to_f16:ident, $sym_f32:ident, $sym_f16:ident;
    )*) => {
        #[cfg(not(hip_platform = "none"))]
        mod sys {
            use std::ffi::{c_int, c_void};
            launchers!($($sym_f32 $sym_f16)*);
        }

        $(
            wrapper!($ty, $src, $values, $where, $to_f32, f32, "f32", $sym_f32);
            wrapper!(
                $ty, $src, $values, $where, $to_f16, f16,
                "f16 (rounded to nearest, ties to even; F16 input is copied)", $sym_f16
            );
        )*

        dispatch!(
            /// [`super::decode_f32`] once the input length is known to be whole blocks.
            dispatch_f32, f32, $($ty => $to_f32),*
        );
        dispatch!(
            /// [`super::decode_f16`] once the input length is known to be whole blocks.
            dispatch_f16, f16, $($ty => $to_f16),*
        );
    };
}

gpu_decoders! {
    F32, f32, 1, "aligned to 4 bytes", f32_to_f32, f32_to_f16, rf_dequant_f32_f32, rf_dequant_f32_f16;
    F16, f16, 1, "aligned to 2 bytes", f16_to_f32, f16_to_f16, rf_dequant_f16_f32, rf_dequant_f16_f16;
    BF16, bf16, 1, "aligned to 2 bytes", bf16_to_f32, bf16_to_f16, rf_dequant_bf16_f32, rf_dequant_bf16_f16;
    F64, f64, 1, "aligned to 8 bytes", f64_to_f32, f64_to_f16, rf_dequant_f64_f32, rf_dequant_f64_f16;
    I8, i8, 1, "any address", i8_to_f32, i8_to_f16, rf_dequant_i8_f32, rf_dequant_i8_f16;
    I16, i16, 1, "aligned to 2 bytes", i16_to_f32, i16_to_f16, rf_dequant_i16_f32, rf_dequant_i16_f16;
    I32, i32, 1, "aligned to 4 bytes", i32_to_f32, i32_to_f16, rf_dequant_i32_f32, rf_dequant_i32_f16;
    I64, i64, 1, "aligned to 8 bytes", i64_to_f32, i64_to_f16, rf_dequant_i64_f32, rf_dequant_i64_f16;
    Q4_0, BlockQ4_0, 32, "any address", q4_0_to_f32, q4_0_to_f16, rf_dequant_q4_0_f32, rf_dequant_q4_0_f16;
    Q4_1, BlockQ4_1, 32, "any address", q4_1_to_f32, q4_1_to_f16, rf_dequant_q4_1_f32, rf_dequant_q4_1_f16;
    Q5_0, BlockQ5_0, 32, "any address", q5_0_to_f32, q5_0_to_f16, rf_dequant_q5_0_f32, rf_dequant_q5_0_f16;
    Q5_1, BlockQ5_1, 32, "any address", q5_1_to_f32, q5_1_to_f16, rf_dequant_q5_1_f32, rf_dequant_q5_1_f16;
    Q8_0, BlockQ8_0, 32, "any address", q8_0_to_f32, q8_0_to_f16, rf_dequant_q8_0_f32, rf_dequant_q8_0_f16;
    Q8_1, BlockQ8_1, 32, "any address", q8_1_to_f32, q8_1_to_f16, rf_dequant_q8_1_f32, rf_dequant_q8_1_f16;
    Q2_K, BlockQ2_K, 256, "any address", q2_k_to_f32, q2_k_to_f16, rf_dequant_q2_k_f32, rf_dequant_q2_k_f16;
    Q3_K, BlockQ3_K, 256, "any address", q3_k_to_f32, q3_k_to_f16, rf_dequant_q3_k_f32, rf_dequant_q3_k_f16;
    Q4_K, BlockQ4_K, 256, "any address", q4_k_to_f32, q4_k_to_f16, rf_dequant_q4_k_f32, rf_dequant_q4_k_f16;
    Q5_K, BlockQ5_K, 256, "any address", q5_k_to_f32, q5_k_to_f16, rf_dequant_q5_k_f32, rf_dequant_q5_k_f16;
    Q6_K, BlockQ6_K, 256, "any address", q6_k_to_f32, q6_k_to_f16, rf_dequant_q6_k_f32, rf_dequant_q6_k_f16;
    Q8_K, BlockQ8_K, 256, "any address", q8_k_to_f32, q8_k_to_f16, rf_dequant_q8_k_f32, rf_dequant_q8_k_f16;
    IQ2_XXS, BlockIQ2_XXS, 256, "any address", iq2_xxs_to_f32, iq2_xxs_to_f16, rf_dequant_iq2_xxs_f32, rf_dequant_iq2_xxs_f16;
    IQ2_XS, BlockIQ2_XS, 256, "any address", iq2_xs_to_f32, iq2_xs_to_f16, rf_dequant_iq2_xs_f32, rf_dequant_iq2_xs_f16;
    IQ2_S, BlockIQ2_S, 256, "any address", iq2_s_to_f32, iq2_s_to_f16, rf_dequant_iq2_s_f32, rf_dequant_iq2_s_f16;
    IQ3_XXS, BlockIQ3_XXS, 256, "any address", iq3_xxs_to_f32, iq3_xxs_to_f16, rf_dequant_iq3_xxs_f32, rf_dequant_iq3_xxs_f16;
    IQ3_S, BlockIQ3_S, 256, "any address", iq3_s_to_f32, iq3_s_to_f16, rf_dequant_iq3_s_f32, rf_dequant_iq3_s_f16;
    IQ1_S, BlockIQ1_S, 256, "any address", iq1_s_to_f32, iq1_s_to_f16, rf_dequant_iq1_s_f32, rf_dequant_iq1_s_f16;
    IQ1_M, BlockIQ1_M, 256, "any address", iq1_m_to_f32, iq1_m_to_f16, rf_dequant_iq1_m_f32, rf_dequant_iq1_m_f16;
    IQ4_NL, BlockIQ4_NL, 32, "any address", iq4_nl_to_f32, iq4_nl_to_f16, rf_dequant_iq4_nl_f32, rf_dequant_iq4_nl_f16;
    IQ4_XS, BlockIQ4_XS, 256, "any address", iq4_xs_to_f32, iq4_xs_to_f16, rf_dequant_iq4_xs_f32, rf_dequant_iq4_xs_f16;
    TQ1_0, BlockTQ1_0, 256, "any address", tq1_0_to_f32, tq1_0_to_f16, rf_dequant_tq1_0_f32, rf_dequant_tq1_0_f16;
    TQ2_0, BlockTQ2_0, 256, "any address", tq2_0_to_f32, tq2_0_to_f16, rf_dequant_tq2_0_f32, rf_dequant_tq2_0_f16;
    MXFP4, BlockMXFP4, 32, "any address", mxfp4_to_f32, mxfp4_to_f16, rf_dequant_mxfp4_f32, rf_dequant_mxfp4_f16;
}
