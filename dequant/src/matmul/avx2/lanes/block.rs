//! The integer lanes of one super-block, for the tests that hold them to the portable
//! kernels'.

use super::*;

/// The integer lanes of one super-block of `ty`: what the portable `*_lanes` functions
/// return.
pub(crate) fn block_lanes(
    _proof: crate::matmul::avx2::Avx2,
    ty: gguf_format::GgmlType,
    block: &[u8],
    qx: &[i8],
    bsums: &[i16],
) -> crate::matmul::portable::LaneInts {
    use crate::matmul::activation::{BSUM_GROUP, QK_K};
    use gguf_format::GgmlType as T;
    assert!(qx.len() >= QK_K && bsums.len() >= QK_K / BSUM_GROUP);
    #[target_feature(enable = "avx2,fma,f16c")]
    fn ints<const F: u8>(block: &[u8], qx: &[i8], bsums: &[i16]) -> (__m256i, __m256i, u8) {
        assert!(block.len() >= block_bytes(F));
        // SAFETY: the lengths were checked; the features are present, as calling this
        // function requires.
        let ([dots], [extra]) =
            unsafe { lane_ints::<F, 1>(block.as_ptr(), [qx.as_ptr()], [bsums.as_ptr()]) };
        (dots, extra, kind_of(F))
    }
    // SAFETY: `_proof` shows the CPU has the features.
    let (dots, extra, kind) = unsafe {
        match ty {
            T::Q2_K => ints::<{ format::Q2_K }>(block, qx, bsums),
            T::Q3_K => ints::<{ format::Q3_K }>(block, qx, bsums),
            T::IQ4_XS => ints::<{ format::IQ4_XS }>(block, qx, bsums),
            T::IQ3_S => ints::<{ format::IQ3_S }>(block, qx, bsums),
            T::IQ3_XXS => ints::<{ format::IQ3_XXS }>(block, qx, bsums),
            T::IQ2_XXS => ints::<{ format::IQ2_XXS }>(block, qx, bsums),
            T::IQ2_XS => ints::<{ format::IQ2_XS }>(block, qx, bsums),
            T::IQ2_S => ints::<{ format::IQ2_S }>(block, qx, bsums),
            T::IQ1_S => ints::<{ format::IQ1_S }>(block, qx, bsums),
            T::IQ1_M => ints::<{ format::IQ1_M }>(block, qx, bsums),
            T::TQ1_0 => ints::<{ format::TQ1_0 }>(block, qx, bsums),
            T::TQ2_0 => ints::<{ format::TQ2_0 }>(block, qx, bsums),
            other => panic!("{other} is not a lane format"),
        }
    };
    let lanes = |v: __m256i| {
        let mut out = [0i32; 8];
        // SAFETY: `out` holds eight i32; `storeu` has no alignment requirement.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), v) };
        out
    };
    let (mins, deltas) = match kind {
        kind::MINS | kind::TERNARY => (lanes(extra), [0; 8]),
        kind::DELTA_SUM | kind::DELTA_LANES => ([0; 8], lanes(extra)),
        _ => ([0; 8], [0; 8]),
    };
    crate::matmul::portable::LaneInts {
        dots: lanes(dots),
        mins,
        deltas,
    }
}
