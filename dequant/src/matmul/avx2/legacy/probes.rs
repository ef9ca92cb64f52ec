//! What the legacy kernels compute for one block, for the tests that hold them to the
//! portable code and to the AVX-512 kernels.

use std::arch::x86_64::*;

use super::{load32, Legacy, IQ4NL, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, QK8};

/// The eight i32 lanes of a symmetric legacy format's block (`Q4_0`, `Q5_0`, `Q8_0`,
/// `IQ4_NL`) against 32 activations, as the batched kernels fuse them into their
/// accumulators.
pub(crate) fn block_lanes(
    _proof: crate::matmul::avx2::Avx2,
    ty: gguf_format::GgmlType,
    block: &[u8],
    qx: &[i8],
) -> [i32; 8] {
    use gguf_format::GgmlType as T;
    #[target_feature(enable = "avx2,fma,f16c")]
    fn lanes<L: Legacy>(block: &[u8], qx: &[i8]) -> [i32; 8] {
        assert!(block.len() >= L::BYTES && qx.len() >= QK8);
        let mut out = [0i32; 8];
        // SAFETY: the lengths were just checked; the features are present, as calling
        // this function requires; `out` holds eight i32.
        unsafe {
            let int = L::int(&L::quants(block.as_ptr()), load32(qx.as_ptr().cast()));
            _mm256_storeu_si256(out.as_mut_ptr().cast(), int);
        }
        out
    }
    // SAFETY: `_proof` shows the CPU has the features.
    unsafe {
        match ty {
            T::Q4_0 => lanes::<Q4_0>(block, qx),
            T::Q5_0 => lanes::<Q5_0>(block, qx),
            T::Q8_0 => lanes::<Q8_0>(block, qx),
            T::IQ4_NL => lanes::<IQ4NL>(block, qx),
            other => panic!("{other} is not a symmetric legacy format"),
        }
    }
}

/// The integer dot product `Σ q · qx` of one block with 32 activations, summed over
/// the lanes: the quantity the portable `*_block` functions compute.
pub(crate) fn block_int(
    _proof: crate::matmul::avx2::Avx2,
    ty: gguf_format::GgmlType,
    block: &[u8],
    qx: &[i8],
) -> i32 {
    use gguf_format::GgmlType as T;
    #[target_feature(enable = "avx2,fma,f16c")]
    fn int<L: Legacy>(block: &[u8], qx: &[i8]) -> i32 {
        assert!(block.len() >= L::BYTES && qx.len() >= QK8);
        // SAFETY: the lengths were just checked; the features are present, as calling
        // this function requires.
        unsafe {
            crate::matmul::avx2::hsum_epi32(L::int(
                &L::quants(block.as_ptr()),
                load32(qx.as_ptr().cast()),
            ))
        }
    }
    // SAFETY: `_proof` shows the CPU has the features.
    unsafe {
        match ty {
            T::Q4_0 => int::<Q4_0>(block, qx),
            T::Q4_1 => int::<Q4_1>(block, qx),
            T::Q5_0 => int::<Q5_0>(block, qx),
            T::Q5_1 => int::<Q5_1>(block, qx),
            T::Q8_0 => int::<Q8_0>(block, qx),
            T::IQ4_NL => int::<IQ4NL>(block, qx),
            T::MXFP4 => int::<MXFP4>(block, qx),
            other => panic!("{other} is not a legacy format"),
        }
    }
}
