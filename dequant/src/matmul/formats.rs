//! One zero-sized type per weight format, tying its activation set to its kernels.

use super::activation::{ActSet, BF16Acts, F16Acts, F32Acts, Q8KActs, Q8_0Acts, Q8_1Acts};
use super::portable;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};

/// The row kernels of one weight format.
pub(crate) trait Kernel {
    /// How the activations are prepared for this format.
    type Acts: ActSet;

    /// Whether the AVX-512 path multiplies a batch four rows at a time
    /// ([`Kernel::tile_avx512`]); else one.
    const AVX512_TILES: bool = false;

    /// Whether the AVX2 path multiplies a batch four rows at a time, eight tokens a call
    /// ([`Kernel::tile8_avx2`]); else one row at a time. The AVX-512 path takes these
    /// tiles too where the format has none of its own ([`Kernel::AVX512_TILES`]), in
    /// its own tile of eight tokens where the format has one ([`Kernel::tile8_avx512`]).
    const AVX2_TILES: bool = false;

    /// One row of weights (whole blocks) · one token's activations, portable code.
    fn dot(row: &[u8], act: <Self::Acts as ActSet>::Row<'_>) -> f32;

    /// `R` rows of weights · `N` tokens' activations, AVX2 code: `out[r][t]`. Covers
    /// the blocks that every row and activation row hold in full.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2<const R: usize, const N: usize>(
        rows: [&[u8]; R],
        acts: [<Self::Acts as ActSet>::Row<'_>; N],
    ) -> [[f32; N]; R];

    /// As [`Kernel::dot_avx2`], with the same bits, for CPUs with AVX-512 F, BW, VL
    /// and VNNI: the format's AVX-512 kernel where it has one, else its AVX2 kernel.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA, F16C and AVX-512 F, BW, VL and VNNI.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx512<const R: usize, const N: usize>(
        rows: [&[u8]; R],
        acts: [<Self::Acts as ActSet>::Row<'_>; N],
    ) -> [[f32; N]; R];

    /// Four rows of weights · eight tokens on the AVX2 path, with the bits of
    /// [`Kernel::dot_avx2`] row by row and four tokens at a time (which this default
    /// calls).
    ///
    /// # Safety
    /// As [`Kernel::dot_avx2`].
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn tile8_avx2(
        rows: [&[u8]; 4],
        acts: [<Self::Acts as ActSet>::Row<'_>; 8],
    ) -> [[f32; 8]; 4] {
        let [a0, a1, a2, a3, a4, a5, a6, a7] = acts;
        let tile = |acts| {
            // SAFETY: the caller upholds this function's contract, which is the callee's.
            rows.map(|row| unsafe { Self::dot_avx2::<1, 4>([row], acts) }[0])
        };
        avx2::join_tiles(tile([a0, a1, a2, a3]), tile([a4, a5, a6, a7]))
    }

    /// Four rows of weights · `N` ≤ 4 tokens on the AVX-512 path, with the bits of
    /// [`Kernel::dot_avx512`] row by row (which this default calls).
    ///
    /// # Safety
    /// As [`Kernel::dot_avx512`].
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn tile_avx512<const N: usize>(
        rows: [&[u8]; 4],
        acts: [<Self::Acts as ActSet>::Row<'_>; N],
    ) -> [[f32; N]; 4] {
        // SAFETY: the caller upholds this function's contract, which is the callee's.
        rows.map(|row| unsafe { Self::dot_avx512::<1, N>([row], acts) }[0])
    }

    /// Four rows of weights · eight tokens on the AVX-512 path, with the bits of
    /// [`Kernel::tile_avx512`] (by default two of its tiles of four) where the format
    /// has AVX-512 tiles, else of [`Kernel::tile8_avx2`] (by default that tile itself).
    ///
    /// # Safety
    /// As [`Kernel::dot_avx512`].
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn tile8_avx512(
        rows: [&[u8]; 4],
        acts: [<Self::Acts as ActSet>::Row<'_>; 8],
    ) -> [[f32; 8]; 4] {
        if !Self::AVX512_TILES {
            // SAFETY: the caller upholds this function's contract, which covers the
            // callee's.
            return unsafe { Self::tile8_avx2(rows, acts) };
        }
        let [a0, a1, a2, a3, a4, a5, a6, a7] = acts;
        // SAFETY: the caller upholds this function's contract, which is the callee's.
        let (lo, hi) = unsafe {
            (
                Self::tile_avx512::<4>(rows, [a0, a1, a2, a3]),
                Self::tile_avx512::<4>(rows, [a4, a5, a6, a7]),
            )
        };
        avx2::join_tiles(lo, hi)
    }
}

/// A `Kernel` impl's method `$method` (`tile8_avx2`, `tile8_avx512`): four rows ·
/// eight tokens by `$tile`.
macro_rules! tile8_method {
    ($method:ident, $tile:path) => {
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn $method(
            rows: [&[u8]; 4],
            acts: [<Self::Acts as ActSet>::Row<'_>; 8],
        ) -> [[f32; 8]; 4] {
            // SAFETY: the caller upholds this function's contract, which is the callee's.
            unsafe { $tile(rows, acts) }
        }
    };
}

macro_rules! kernel {
    ($name:ident, $acts:ty, $portable:path, $avx2:path) => {
        kernel!($name, $acts, $portable, $avx2, $avx2);
    };
    ($name:ident, $acts:ty, $portable:path, $avx2:path, $avx512:path,
     avx2_tiles = $tile8:path) => {
        kernel!($name, $acts, $portable, $avx2, $avx512, {
            const AVX2_TILES: bool = true;
            tile8_method!(tile8_avx2, $tile8);
        });
    };
    ($name:ident, $acts:ty, $portable:path, $avx2:path, $avx512:path,
     avx2_tiles = $tile8:path, avx512_tile8 = $tile8_512:path) => {
        kernel!($name, $acts, $portable, $avx2, $avx512, {
            const AVX2_TILES: bool = true;
            tile8_method!(tile8_avx2, $tile8);
            tile8_method!(tile8_avx512, $tile8_512);
        });
    };
    ($name:ident, $acts:ty, $portable:path, $avx2:path, $avx512:path, tiles = $tile:path) => {
        kernel!($name, $acts, $portable, $avx2, $avx512, {
            const AVX512_TILES: bool = true;

            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn tile_avx512<const N: usize>(
                rows: [&[u8]; 4],
                acts: [<Self::Acts as ActSet>::Row<'_>; N],
            ) -> [[f32; N]; 4] {
                // SAFETY: the caller upholds this function's contract, which is the
                // callee's.
                unsafe { $tile(rows, acts) }
            }

            tile8_method!(tile8_avx512, $tile);
        });
    };
    ($name:ident, $acts:ty, $portable:path, $avx2:path, $avx512:path) => {
        kernel!($name, $acts, $portable, $avx2, $avx512, {});
    };
    ($name:ident, $acts:ty, $portable:path, $avx2:path, $avx512:path, {$($tiles:tt)*}) => {
        #[allow(non_camel_case_types)]
        pub(crate) struct $name;

        impl Kernel for $name {
            type Acts = $acts;
            $($tiles)*

            #[inline]
            fn dot(row: &[u8], act: <Self::Acts as ActSet>::Row<'_>) -> f32 {
                $portable(row, act)
            }

            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn dot_avx2<const R: usize, const N: usize>(
                rows: [&[u8]; R],
                acts: [<Self::Acts as ActSet>::Row<'_>; N],
            ) -> [[f32; N]; R] {
                // SAFETY: the caller upholds this function's contract, which is the
                // callee's.
                unsafe { $avx2(rows, acts) }
            }

            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn dot_avx512<const R: usize, const N: usize>(
                rows: [&[u8]; R],
                acts: [<Self::Acts as ActSet>::Row<'_>; N],
            ) -> [[f32; N]; R] {
                // SAFETY: the caller upholds this function's contract, which covers the
                // callee's (an AVX-512 kernel's, or an AVX2 kernel's).
                unsafe { $avx512(rows, acts) }
            }
        }
    };
}

kernel!(F32, F32Acts, portable::dot_f32, avx2::float::dot_f32);
kernel!(F16, F16Acts, portable::dot_f16, avx2::float::dot_f16);
kernel!(BF16, BF16Acts, portable::dot_bf16, avx2::float::dot_bf16);
kernel!(
    Q4_0,
    Q8_0Acts,
    portable::dot_q4_0,
    avx2::legacy::dot_q4_0,
    avx512::legacy::dot_q4_0,
    tiles = avx512::legacy::tile_q4_0
);
// `Q4_0` matrices whose row count is a multiple of 8, which llama.cpp repacks on AVX2
// machines and multiplies block by block.
kernel!(
    Q4_0Packed,
    Q8_0Acts,
    portable::dot_q4_0_packed,
    avx2::legacy::dot_q4_0_packed
);
kernel!(Q4_1, Q8_1Acts, portable::dot_q4_1, avx2::legacy::dot_q4_1);
kernel!(
    Q5_0,
    Q8_0Acts,
    portable::dot_q5_0,
    avx2::legacy::dot_q5_0,
    avx512::legacy::dot_q5_0,
    tiles = avx512::legacy::tile_q5_0
);
kernel!(Q5_1, Q8_1Acts, portable::dot_q5_1, avx2::legacy::dot_q5_1);
kernel!(
    Q8_0,
    Q8_0Acts,
    portable::dot_q8_0,
    avx2::legacy::dot_q8_0,
    avx512::legacy::dot_q8_0,
    tiles = avx512::legacy::tile_q8_0
);
kernel!(
    IQ4_NL,
    Q8_0Acts,
    portable::dot_iq4_nl,
    avx2::legacy::dot_iq4_nl,
    avx512::legacy::dot_iq4_nl,
    tiles = avx512::legacy::tile_iq4_nl
);
// `IQ4_NL` matrices whose row count is a multiple of 8, which llama.cpp repacks on AVX2
// machines and multiplies block by block.
kernel!(
    IQ4_NLPacked,
    Q8_0Acts,
    portable::dot_iq4_nl_packed,
    avx2::legacy::dot_iq4_nl_packed
);
kernel!(
    MXFP4,
    Q8_0Acts,
    portable::dot_mxfp4,
    avx2::legacy::dot_mxfp4
);
// `MXFP4` matrices whose row count is a multiple of 8, which llama.cpp repacks on AVX2
// machines and multiplies block by block.
kernel!(
    MXFP4Packed,
    Q8_0Acts,
    portable::dot_mxfp4_packed,
    avx2::legacy::dot_mxfp4_packed
);
kernel!(
    Q4_K,
    Q8KActs,
    portable::dot_q4_k,
    avx2::kquants::dot_q4_k,
    avx512::kquants::dot_q4_k
);
// `Q4_K` matrices whose row count is a multiple of 8, which llama.cpp repacks on AVX2
// machines.
kernel!(
    Q4_KPacked,
    Q8KActs,
    portable::dot_q4_k_packed,
    avx2::kquants::dot_q4_k_packed,
    avx512::kquants::dot_q4_k_packed,
    avx2_tiles = avx2::kquants::tile8_q4_k_packed,
    avx512_tile8 = avx512::kquants::tile8_q4_k_packed
);
kernel!(Q2_K, Q8KActs, portable::dot_q2_k, avx2::lanes::dot_q2_k);
kernel!(Q3_K, Q8KActs, portable::dot_q3_k, avx2::lanes::dot_q3_k);
kernel!(
    IQ4_XS,
    Q8KActs,
    portable::dot_iq4_xs,
    avx2::lanes::dot_iq4_xs
);
kernel!(IQ3_S, Q8KActs, portable::dot_iq3_s, avx2::lanes::dot_iq3_s);
kernel!(
    IQ3_XXS,
    Q8KActs,
    portable::dot_iq3_xxs,
    avx2::lanes::dot_iq3_xxs
);
kernel!(
    IQ2_XXS,
    Q8KActs,
    portable::dot_iq2_xxs,
    avx2::lanes::dot_iq2_xxs
);
kernel!(
    IQ2_XS,
    Q8KActs,
    portable::dot_iq2_xs,
    avx2::lanes::dot_iq2_xs
);
kernel!(IQ2_S, Q8KActs, portable::dot_iq2_s, avx2::lanes::dot_iq2_s);
kernel!(IQ1_S, Q8KActs, portable::dot_iq1_s, avx2::lanes::dot_iq1_s);
kernel!(IQ1_M, Q8KActs, portable::dot_iq1_m, avx2::lanes::dot_iq1_m);
kernel!(TQ1_0, Q8KActs, portable::dot_tq1_0, avx2::lanes::dot_tq1_0);
kernel!(TQ2_0, Q8KActs, portable::dot_tq2_0, avx2::lanes::dot_tq2_0);
kernel!(
    Q5_K,
    Q8KActs,
    portable::dot_q5_k,
    avx2::kquants::dot_q5_k,
    avx512::kquants::dot_q5_k
);
kernel!(
    Q6_K,
    Q8KActs,
    portable::dot_q6_k,
    avx2::kquants::dot_q6_k,
    avx512::kquants::dot_q6_k,
    avx2_tiles = avx2::kquants::tile8_q6_k,
    avx512_tile8 = avx512::kquants::tile8_q6_k
);
