//! Decoding and multiplying every ggml block format on the CPU.
//!
//! A GGUF tensor's bytes are blocks of quantized values. This crate turns them into
//! numbers: [`decode_f32`] and [`decode_f16`] decode a whole tensor (or any whole
//! number of blocks), and [`matmul`] multiplies by quantized weights without decoding
//! them first.
//!
//! - [`blocks`]: the byte layout of every block type as a `#[repr(C)]` plain-old-data
//!   struct of alignment 1, viewed in place over any byte slice.
//! - Decoding: a scalar reference decoder per type, written straight from the block
//!   layouts and bit-identical to the reference implementation that ships with
//!   llama.cpp (gguf-py); AVX2+F16C kernels, chosen at run time and bit-identical to
//!   the reference, for F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K … Q6_K, IQ4_NL,
//!   IQ4_XS, TQ2_0, MXFP4 and the grid formats (IQ1_S … IQ3_S); rayon across blocks for
//!   large inputs.
//!   [`Decoder`] picks a path explicitly, for tests and benchmarks.
//! - [`gpu`]: the same decoders as HIP kernels (AMD and NVIDIA) over device memory,
//!   bit-identical to the reference; with no GPU platform built in they return a typed
//!   error.
//!
//! Types decoded: F32, F16, BF16, F64, I8, I16, I32, I64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//! Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
//! IQ1_S, IQ1_M, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0 and MXFP4: every type of
//! [`gguf_format::GgmlType`]. F64 and the wide integers are rounded to the nearest f32.
//!
//! This crate never opens files: callers hand it bytes (usually a slice of a mapped
//! model), and it never panics on their length. It has no cargo features.

pub mod blocks;
mod decode;
mod error;
pub mod gpu;
pub mod matmul;
#[cfg(test)]
mod splitmix;

use gguf_format::GgmlType;
use half::f16;

/// The lookup tables of the IQ formats (grids, sign patterns, non-linear levels), for
/// writers and quantizers that need ggml's exact entries.
pub use decode::grids;
pub use error::DequantError;

/// Which kernels run: for decoding, and for the [`matmul`] products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodePath {
    /// The reference decoders (and plain-Rust products), on any CPU.
    Scalar,
    /// x86-64 AVX2 with F16C for the types that have such kernels (the reference
    /// decoders for the others), when the CPU has them. The products also need FMA.
    Avx2,
    /// x86-64 AVX-512 (F, BW, VL) with VNNI, besides AVX2, FMA and F16C: the
    /// [`matmul`] products of the types that have such kernels, which give the AVX2
    /// kernels' bits (the AVX2 kernels for the others). Decoding has no AVX-512
    /// kernels: on this path it runs the AVX2 ones.
    Avx512,
}

impl DecodePath {
    /// The fastest path this CPU supports for decoding (AVX2 at best: the decoders
    /// have no AVX-512 kernels; [`matmul::best_path`] is the products' choice).
    pub fn detect() -> DecodePath {
        if DecodePath::Avx2.is_available() {
            DecodePath::Avx2
        } else {
            DecodePath::Scalar
        }
    }

    /// Whether this CPU can run the path.
    pub fn is_available(self) -> bool {
        match self {
            DecodePath::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            DecodePath::Avx2 => decode::avx2::Avx2::detect().is_some(),
            #[cfg(target_arch = "x86_64")]
            DecodePath::Avx512 => matmul::is_path_available(DecodePath::Avx512),
            #[cfg(not(target_arch = "x86_64"))]
            DecodePath::Avx2 | DecodePath::Avx512 => false,
        }
    }

    /// A short lower-case name (`"avx2"`, `"avx512"`, `"scalar"`).
    pub fn name(self) -> &'static str {
        match self {
            DecodePath::Scalar => "scalar",
            DecodePath::Avx2 => "avx2",
            DecodePath::Avx512 => "avx512",
        }
    }
}

/// A configured decoder: which kernels, and whether large inputs use rayon's pool.
#[derive(Clone, Copy, Debug)]
pub struct Decoder {
    path: DecodePath,
    plan: decode::Plan,
}

impl Default for Decoder {
    fn default() -> Decoder {
        Decoder::new()
    }
}

impl Decoder {
    /// The fastest path this CPU supports, parallel for large inputs.
    pub fn new() -> Decoder {
        let path = DecodePath::detect();
        Decoder::with_path(path).unwrap_or(Decoder::scalar())
    }

    /// The reference decoders, parallel for large inputs.
    pub fn scalar() -> Decoder {
        Decoder {
            path: DecodePath::Scalar,
            plan: decode::Plan {
                avx2: None,
                parallel: true,
            },
        }
    }

    /// The kernels of `path`, parallel for large inputs, or an error when this CPU
    /// cannot run them.
    pub fn with_path(path: DecodePath) -> Result<Decoder, DequantError> {
        match path {
            DecodePath::Scalar => Ok(Decoder::scalar()),
            #[cfg(target_arch = "x86_64")]
            DecodePath::Avx2 | DecodePath::Avx512 => {
                if !path.is_available() {
                    return Err(DequantError::PathUnavailable { path });
                }
                let avx2 =
                    decode::avx2::Avx2::detect().ok_or(DequantError::PathUnavailable { path })?;
                Ok(Decoder {
                    path,
                    plan: decode::Plan {
                        avx2: Some(avx2),
                        parallel: true,
                    },
                })
            }
            #[cfg(not(target_arch = "x86_64"))]
            DecodePath::Avx2 | DecodePath::Avx512 => Err(DequantError::PathUnavailable { path }),
        }
    }

    /// The same kernels, splitting large inputs across rayon's pool or not.
    pub fn parallel(self, parallel: bool) -> Decoder {
        Decoder {
            plan: decode::Plan {
                parallel,
                ..self.plan
            },
            ..self
        }
    }

    /// The kernels this decoder runs.
    pub fn path(&self) -> DecodePath {
        self.path
    }

    /// Decodes `bytes`, whole blocks of type `ty`, into `out`, which must hold exactly
    /// as many values as the blocks do.
    pub fn decode_f32(
        &self,
        ty: GgmlType,
        bytes: &[u8],
        out: &mut [f32],
    ) -> Result<(), DequantError> {
        decode::to_f32(self.plan, ty, bytes, out)
    }

    /// As [`Decoder::decode_f32`], then rounded to f16 (to nearest, ties to even).
    /// F16 input is copied unchanged.
    pub fn decode_f16(
        &self,
        ty: GgmlType,
        bytes: &[u8],
        out: &mut [f16],
    ) -> Result<(), DequantError> {
        decode::to_f16(self.plan, ty, bytes, out)
    }
}

/// Decodes `bytes`, whole blocks of type `ty`, into `out` with the fastest kernels
/// this CPU has. `out` must hold exactly as many values as the blocks do
/// ([`decoded_len`]).
pub fn decode_f32(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    Decoder::new().decode_f32(ty, bytes, out)
}

/// As [`decode_f32`], then rounded to f16 (to nearest, ties to even). F16 input is
/// copied unchanged.
pub fn decode_f16(ty: GgmlType, bytes: &[u8], out: &mut [f16]) -> Result<(), DequantError> {
    Decoder::new().decode_f16(ty, bytes, out)
}

/// How many values `n_bytes` bytes of type `ty` decode to, or an error when they are
/// not a whole number of blocks.
pub fn decoded_len(ty: GgmlType, n_bytes: usize) -> Result<usize, DequantError> {
    // Block geometry is small (at most 292 bytes, 256 values), so these fit in usize.
    let (block_bytes, block_values) = (ty.type_size() as usize, ty.block_size() as usize);
    if !n_bytes.is_multiple_of(block_bytes) {
        return Err(DequantError::PartialBlock {
            ty,
            bytes: n_bytes,
            block_bytes,
        });
    }
    Ok((n_bytes / block_bytes).saturating_mul(block_values))
}
