//! The AVX-512 kernels (F, BW and VL, with VNNI), which give the AVX2 kernels' bits.
//!
//! The AVX2 kernels' integer lanes are exact sums, which any order of additions
//! reproduces; only the float operations after them fix the result. So these kernels
//! compute the same integers with wider vectors and fewer instructions (a 512-bit
//! vector holds two of the AVX2 kernels' 256-bit steps; `vpdpwssd` multiplies the
//! 16-bit pair sums by their scales and accumulates in one instruction), fold them into
//! the lanes the AVX2 kernels hold, and then repeat the AVX2 kernels' float operations
//! one for one on the same values in the same order. The pair sums come from the same
//! `maddubs` as the AVX2 kernels', whose operands never saturate its i16 results (6-bit
//! weights times activations of at most 127: at most 16002).
//!
//! [`Avx512`] is the proof that the CPU has the features, made only by
//! [`Avx512::detect`]; the safe entry point [`RowKernels::rows`] takes it by value. The
//! loops around the kernels are the AVX2 path's (`avx2::rows`); the formats without
//! AVX-512 kernels run their AVX2 kernels there (every AVX-512 CPU has AVX2).

pub(crate) mod grouped;
pub(crate) mod kquants;
pub(crate) mod legacy;

use std::arch::x86_64::*;

use super::activation::ActSet;
use super::avx2::RowKernels;
use super::formats::Kernel;

/// Proof that the CPU supports AVX-512 F, BW, VL and VNNI, and AVX2, FMA and F16C.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512(());

impl Avx512 {
    /// The proof, when the CPU has the features.
    pub(crate) fn detect() -> Option<Avx512> {
        let present = super::avx2::Avx2::detect().is_some()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni");
        present.then_some(Avx512(()))
    }
}

impl RowKernels for Avx512 {
    #[inline(always)]
    fn dot<K: Kernel, const R: usize, const N: usize>(
        self,
        rows: [&[u8]; R],
        acts: [<K::Acts as ActSet>::Row<'_>; N],
    ) -> [[f32; N]; R] {
        // SAFETY: `self` exists only when `detect` found every feature the kernels need
        // on this CPU, their only requirement (they bound every access by their slices).
        unsafe { K::dot_avx512::<R, N>(rows, acts) }
    }

    /// A format's AVX-512 tiles, else its AVX2 tiles of eight tokens: with the same
    /// bits, on a 2-core Zen 4 the AVX2 tile of repacked `Q4_K` took batches at 1.35
    /// times the rate of this path's one row of four tokens (Gemma 3's `attn_output`
    /// at 512 tokens, 2 threads).
    fn tiles<K: Kernel>(self) -> bool {
        K::AVX512_TILES || K::AVX2_TILES
    }

    fn small_tiles<K: Kernel>(self) -> bool {
        K::AVX512_TILES
    }

    #[inline(always)]
    fn tile<K: Kernel, const N: usize>(
        self,
        rows: [&[u8]; 4],
        acts: [<K::Acts as ActSet>::Row<'_>; N],
    ) -> [[f32; N]; 4] {
        // SAFETY: as `dot`'s.
        unsafe { K::tile_avx512::<N>(rows, acts) }
    }

    #[inline(always)]
    fn tile8<K: Kernel>(
        self,
        rows: [&[u8]; 4],
        acts: [<K::Acts as ActSet>::Row<'_>; 8],
    ) -> [[f32; 8]; 4] {
        // SAFETY: as `dot`'s.
        unsafe { K::tile8_avx512(rows, acts) }
    }
}

/// The i32 lanes of `v` summed: the lanes of each 128-bit part, then the parts, as the
/// AVX2 kernels' sums (all exact: the order does not matter).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) fn hsum_epi32_512(v: __m512i) -> i32 {
    super::avx2::hsum_epi32(_mm256_add_epi32(
        _mm512_castsi512_si256(v),
        _mm512_extracti64x4_epi64::<1>(v),
    ))
}

/// The sums of four vectors' i32 lanes: lane `k` of the result is `Σ v[k]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) fn hsum4_epi32_512(v: [__m512i; 4]) -> __m128i {
    // Pairs of lanes, then quads: each 128-bit part then holds v[0..4]'s sums over it.
    let a = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[0], v[1]),
        _mm512_unpackhi_epi32(v[0], v[1]),
    );
    let b = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[2], v[3]),
        _mm512_unpackhi_epi32(v[2], v[3]),
    );
    let parts = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    let half = _mm256_add_epi32(
        _mm512_castsi512_si256(parts),
        _mm512_extracti64x4_epi64::<1>(parts),
    );
    _mm_add_epi32(
        _mm256_castsi256_si128(half),
        _mm256_extracti128_si256::<1>(half),
    )
}

/// The sums of four vectors' i32 lanes: lane `k` of the result is `Σ v[k]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) fn hsum4_epi32_128(v: [__m128i; 4]) -> __m128i {
    let a = _mm_add_epi32(
        _mm_unpacklo_epi32(v[0], v[1]),
        _mm_unpackhi_epi32(v[0], v[1]),
    );
    let b = _mm_add_epi32(
        _mm_unpacklo_epi32(v[2], v[3]),
        _mm_unpackhi_epi32(v[2], v[3]),
    );
    _mm_add_epi32(_mm_unpacklo_epi64(a, b), _mm_unpackhi_epi64(a, b))
}

/// `_mm512_permutexvar_epi16` control that copies i16 lane `lanes[k]` into every i16 of
/// the 128-bit part `k`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) fn spread_i16(lanes: [i16; 4]) -> __m512i {
    let part = |k: usize| i64::from(lanes[k] as u16) * 0x0001_0001_0001_0001;
    _mm512_set_epi64(
        part(3),
        part(3),
        part(2),
        part(2),
        part(1),
        part(1),
        part(0),
        part(0),
    )
}
