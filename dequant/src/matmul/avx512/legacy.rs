//! AVX-512 kernels of the symmetric legacy formats (`Q4_0`, `Q5_0`, `Q8_0`, `IQ4_NL`):
//! batches in tiles of up to four rows against two to eight tokens ([`dot_tile`]), two
//! tokens a 512-bit step, and single tokens four rows a call, two blocks a step
//! ([`dot_rows`]).
//!
//! Each weight is taken as an unsigned byte, `w + OFFSET` ([`Offset`]), and each lane's
//! accumulation starts at `-OFFSET` times the sum of its four activations
//! ([`offset_start`]), so that one `vpdpbusd` gives a row's block the very integers of
//! the AVX2 kernel's `maddubs` and `madd` on signed weights (exact sums, whose i16 pair
//! sums never saturate there: magnitudes of at most 128 times activations of at most
//! 127). The AVX2 kernel's float operations follow lane for lane: the block's `d · dx`
//! of each token (the same product of the same values) times the lanes, fused into each
//! token's eight accumulators block after block, and the lanes summed at the end as its
//! `hsum_ps` does. So the products are the AVX2 kernel's bits, and llama.cpp's.
//!
//! `IQ4_NL`'s single tokens (whose dot product pairs its blocks), the formats with an
//! offset (`Q4_1`, `Q5_1`), the repacked layouts and `MXFP4` take their AVX2 kernels.

use std::arch::x86_64::*;
use std::mem::offset_of;

use crate::blocks::{BlockIQ4_NL, BlockQ4_0, BlockQ5_0, BlockQ8_0};
use crate::decode::grids::KVALUES_IQ4NL;
use crate::matmul::activation::{Q8Row, QK8};
use crate::matmul::avx2::legacy::{
    blocks, nibbles, scales, Legacy, IQ4NL as IQ4NLFormat, Q4_0 as Q4_0Format, Q5_0 as Q5_0Format,
    Q8_0 as Q8_0Format,
};
use crate::matmul::avx2::{hsum_ps, load32};

/// A symmetric format's weights as unsigned bytes, `w + OFFSET`.
trait Offset: Legacy {
    /// What the bytes add to the weights (each sum fits a byte).
    const OFFSET: u8;

    /// # Safety
    /// The CPU must support the AVX-512 path's features; `block..block + BYTES` must
    /// be readable.
    unsafe fn offset_quants(block: *const u8) -> __m256i;
}

impl Offset for Q4_0Format {
    const OFFSET: u8 = 8;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn offset_quants(block: *const u8) -> __m256i {
        // SAFETY: the block is readable per the contract; qs lies inside it.
        unsafe { nibbles(block.add(offset_of!(BlockQ4_0, qs))) }
    }
}

impl Offset for Q5_0Format {
    const OFFSET: u8 = 16;

    /// The nibble plus 16 where the high bit is set.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn offset_quants(block: *const u8) -> __m256i {
        let (qs, qh) = (offset_of!(BlockQ5_0, qs), offset_of!(BlockQ5_0, qh));
        // SAFETY: the block is readable per the contract; qs and qh lie inside it.
        let (low, high) = unsafe {
            (
                nibbles(block.add(qs)),
                block.add(qh).cast::<u32>().read_unaligned(),
            )
        };
        _mm256_mask_add_epi8(low, high, low, _mm256_set1_epi8(16))
    }
}

impl Offset for Q8_0Format {
    const OFFSET: u8 = 128;

    /// The byte's sign bit flipped.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn offset_quants(block: *const u8) -> __m256i {
        // SAFETY: the block is readable per the contract; qs (32 bytes) lies inside it.
        let q = unsafe { load32(block.add(offset_of!(BlockQ8_0, qs))) };
        _mm256_xor_si256(q, _mm256_set1_epi8(i8::MIN))
    }
}

impl Offset for IQ4NLFormat {
    const OFFSET: u8 = 128;

    /// The level looked up in the table of levels plus 128.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn offset_quants(block: *const u8) -> __m256i {
        const TABLE: [u8; 16] = {
            let mut t = [0u8; 16];
            let mut i = 0;
            while i < 16 {
                t[i] = (KVALUES_IQ4NL[i] as i16 + 128) as u8;
                i += 1;
            }
            t
        };
        // SAFETY: the block is readable per the contract; qs lies inside it; the table
        // holds 16 bytes.
        let (q, table) = unsafe {
            (
                nibbles(block.add(offset_of!(BlockIQ4_NL, qs))),
                _mm_loadu_si128(TABLE.as_ptr().cast()),
            )
        };
        _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), q)
    }
}

/// `R` rows against `N` tokens (one of them 1, the other at most 4): this file's
/// kernels for the shapes and formats they take, else the AVX2 kernel.
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot<L: Offset, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8Row<'_>; N],
) -> [[f32; N]; R] {
    if N == 1 && !L::PAIRED {
        // SAFETY: the features are present per this function's contract.
        return unsafe { dot_rows::<L, R>(rows, acts[0]) }.map(|dot| [dot; N]);
    }
    if R == 1 && N >= 2 {
        // SAFETY: the features are present per this function's contract.
        return unsafe { dot_tile::<L, R, N>(rows, acts) };
    }
    // SAFETY: every AVX-512 CPU has AVX2, FMA and F16C (which `Avx512::detect` checks).
    unsafe { crate::matmul::avx2::legacy::dot::<L, R, N>(rows, acts) }
}

/// `R` ≤ 4 rows against `N` (2 to 8) tokens of a symmetric format, each product as the
/// AVX2 kernel's `dot_tokens` computes it: one `vpdpbusd` a row's block and a pair of
/// tokens, each pair's [`offset_start`] taken once a block, and a block's pairs of
/// tokens and its rows each loaded and unpacked once for the whole tile (so a tile of
/// eight tokens unpacks each row's block once for four pairs).
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_tile<L: Offset, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8Row<'_>; N],
) -> [[f32; N]; R] {
    const { assert!(R <= 4 && N <= MAX_PAIRS * 2) };
    if N < 2 {
        // (Through a tile of exactly one token, so that no other width of the single-row
        // kernels is instantiated.)
        let one = [acts[0]];
        // SAFETY: the features are present per this function's contract.
        let dots = unsafe { dot_columns::<L, R, 1>(rows, one) };
        return std::array::from_fn(|r| std::array::from_fn(|_| dots[r][0]));
    }
    const { assert!(!(L::HAS_M || L::TOTALS || L::E8M0 || (L::PAIRED && L::PAIRED_BATCH))) };
    let nb = blocks(&rows, L::BYTES, &acts);
    let pairs = N / 2;
    let zero = _mm512_setzero_si512();
    // Pair p's tokens in the halves of accumulators [r][p]; an odd last token in 256 bits.
    let mut acc = [[_mm512_setzero_ps(); MAX_PAIRS]; R];
    let mut last = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let (mut x, mut start, mut dx) = (
            [zero; MAX_PAIRS],
            [zero; MAX_PAIRS],
            [_mm512_setzero_ps(); MAX_PAIRS],
        );
        for p in 0..pairs {
            let (a0, a1) = (&acts[2 * p], &acts[2 * p + 1]);
            // SAFETY: `b < nb` bounds both loads by the activation rows' lengths.
            let (x0, x1) = unsafe { (qx(a0, b), qx(a1, b)) };
            x[p] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x0), x1);
            start[p] = offset_start::<L>(x[p]);
            dx[p] = _mm512_mask_broadcastss_ps(
                _mm512_set1_ps(a0.ds[b][0]),
                0xFF00,
                _mm_set_ss(a1.ds[b][0]),
            );
        }
        let (mut x_last, mut start_last, mut dx_last) = (
            _mm256_setzero_si256(),
            _mm256_setzero_si256(),
            _mm256_setzero_ps(),
        );
        if N % 2 == 1 {
            let a = &acts[N - 1];
            // SAFETY: `b < nb` bounds the load by the activation row's length.
            x_last = unsafe { qx(a, b) };
            start_last = offset_start_256::<L>(x_last);
            dx_last = _mm256_set1_ps(a.ds[b][0]);
        }
        // SAFETY: block b lies inside every row.
        let d = _mm512_castps256_ps512(unsafe { scales::<L, R>(&rows, b) });
        for r in 0..R {
            // SAFETY: block b lies inside row r.
            let u256 = unsafe { L::offset_quants(rows[r].as_ptr().add(b * L::BYTES)) };
            let u = _mm512_broadcast_i64x4(u256);
            let dr = _mm512_permutexvar_ps(_mm512_set1_epi32(2 * r as i32), d);
            for p in 0..pairs {
                let int = _mm512_dpbusd_epi32(start[p], u, x[p]);
                let scale = _mm512_mul_ps(dr, dx[p]);
                acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(int), scale, acc[r][p]);
            }
            if N % 2 == 1 {
                let int = _mm256_dpbusd_epi32(start_last, u256, x_last);
                let scale = _mm256_mul_ps(_mm512_castps512_ps256(dr), dx_last);
                last[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int), scale, last[r]);
            }
        }
    }
    let mut out = [[0.0f32; N]; R];
    for r in 0..R {
        for (t, o) in out[r].iter_mut().enumerate() {
            let lanes = if t == N - 1 && N % 2 == 1 {
                last[r]
            } else if t % 2 == 0 {
                _mm512_castps512_ps256(acc[r][t / 2])
            } else {
                high_half(acc[r][t / 2])
            };
            // The AVX2 kernel adds its offsets' lanes, zeros for these formats.
            *o = hsum_ps(lanes) + 0.0;
        }
    }
    out
}

/// Most pairs of tokens of a [`dot_tile`].
const MAX_PAIRS: usize = 4;

/// Where the lanes of each token of `x` start against unsigned weights: `-OFFSET`
/// times the sum of the lane's four activations, so that `vpdpbusd` from there gives
/// the signed weights' integers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn offset_start<L: Offset>(x: __m512i) -> __m512i {
    let zero = _mm512_setzero_si512();
    let sums = _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(L::OFFSET as i8), x);
    _mm512_sub_epi32(zero, sums)
}

/// [`offset_start`] for one token's block, in 256 bits.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn offset_start_256<L: Offset>(x: __m256i) -> __m256i {
    let zero = _mm256_setzero_si256();
    let sums = _mm256_dpbusd_epi32(zero, _mm256_set1_epi8(L::OFFSET as i8), x);
    _mm256_sub_epi32(zero, sums)
}

/// Block `b`'s 32 activations of token row `a`.
///
/// # Safety
/// The CPU must support AVX2; `b` must be below the row's count of blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn qx(a: &Q8Row<'_>, b: usize) -> __m256i {
    // SAFETY: in bounds per the contract.
    unsafe { load32(a.qs.as_ptr().add(b * QK8).cast()) }
}

/// `R` ≤ 4 rows against one token of a symmetric format, as the AVX2 kernel's
/// `dot_rows` computes them, two blocks a 512-bit step.
///
/// The weights are unsigned bytes, `w + OFFSET`, as in [`dot_tile`]: the token's two
/// blocks are loaded once with the `OFFSET` share of their lanes for every row, and
/// each row's two blocks take one `vpdpbusd` and one conversion. The eight lanes of
/// the first block are then fused into the row's accumulators before those of the
/// second, as the AVX2 kernel fuses them block after block.
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_rows<L: Offset, const R: usize>(rows: [&[u8]; R], act: Q8Row<'_>) -> [f32; R] {
    const { assert!(R <= 4) };
    const { assert!(!(L::HAS_M || L::TOTALS || L::E8M0)) };
    // A paired format's single tokens sum even and odd blocks apart.
    debug_assert!(!L::PAIRED);
    let nb = blocks(&rows, L::BYTES, &[act]);
    let mut acc = [_mm256_setzero_ps(); R];
    // Lanes 2r of a block's products with the token's scale: row r's d · dx.
    let products = |b: usize| {
        // SAFETY: the callers keep block b inside every row and the activation row.
        unsafe { _mm256_mul_ps(scales::<L, R>(&rows, b), _mm256_set1_ps(act.ds[b][0])) }
    };
    let unsigned = |r: usize, b: usize| {
        // SAFETY: the callers keep block b inside row r.
        unsafe { L::offset_quants(rows[r].as_ptr().add(b * L::BYTES)) }
    };
    let mut b = 0;
    while b + 2 <= nb {
        // SAFETY: blocks b and b + 1 lie inside the activation row: 64 readable bytes.
        let x = unsafe { _mm512_loadu_si512(act.qs.as_ptr().add(b * QK8).cast()) };
        let start = offset_start::<L>(x);
        let both = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castps_pd(_mm512_castps256_ps512(products(b))),
            _mm256_castps_pd(products(b + 1)),
        ));
        for (r, acc) in acc.iter_mut().enumerate() {
            let u =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(unsigned(r, b)), unsigned(r, b + 1));
            let lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, u, x));
            let (l0, l1) = (2 * r as i32, 2 * r as i32 + 8);
            let scale = _mm512_permutexvar_ps(
                _mm512_setr_epi32(
                    l0, l0, l0, l0, l0, l0, l0, l0, l1, l1, l1, l1, l1, l1, l1, l1,
                ),
                both,
            );
            *acc = _mm256_fmadd_ps(
                _mm512_castps512_ps256(lanes),
                _mm512_castps512_ps256(scale),
                *acc,
            );
            *acc = _mm256_fmadd_ps(high_half(lanes), high_half(scale), *acc);
        }
        b += 2;
    }
    if b < nb {
        // SAFETY: block b lies inside the activation row.
        let x = unsafe { qx(&act, b) };
        let start = offset_start_256::<L>(x);
        let products = products(b);
        for (r, acc) in acc.iter_mut().enumerate() {
            let lanes = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(start, unsigned(r, b), x));
            let scale = _mm256_permutevar8x32_ps(products, _mm256_set1_epi32(2 * r as i32));
            *acc = _mm256_fmadd_ps(lanes, scale, *acc);
        }
    }
    // The AVX2 kernel adds its offsets' lanes, zeros for these formats.
    acc.map(|acc| hsum_ps(acc) + 0.0)
}

/// The upper eight lanes of `v`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn high_half(v: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
}

/// One row's products at a time: a tile's single token.
///
/// # Safety
/// The CPU must support the AVX-512 path's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_columns<L: Offset, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8Row<'_>; N],
) -> [[f32; N]; R] {
    // SAFETY: the features are present per this function's contract.
    rows.map(|row| unsafe { dot::<L, 1, N>([row], acts) }[0])
}

macro_rules! avx512_entries {
    ($($name:ident, $tile:ident => $format:ty),+ $(,)?) => {$(
        /// `R` rows against `N` tokens: one of them must be 1, the other at most 4.
        ///
        /// # Safety
        /// The CPU must support the AVX-512 path's features.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        pub(crate) unsafe fn $name<const R: usize, const N: usize>(
            rows: [&[u8]; R],
            acts: [Q8Row<'_>; N],
        ) -> [[f32; N]; R] {
            // SAFETY: the features are present per this function's contract.
            unsafe { dot::<$format, R, N>(rows, acts) }
        }

        /// Four rows against `N` ≤ 8 tokens, a batch's tile.
        ///
        /// # Safety
        /// The CPU must support the AVX-512 path's features.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        pub(crate) unsafe fn $tile<const N: usize>(
            rows: [&[u8]; 4],
            acts: [Q8Row<'_>; N],
        ) -> [[f32; N]; 4] {
            // SAFETY: the features are present per this function's contract.
            unsafe { dot_tile::<$format, 4, N>(rows, acts) }
        }
    )+};
}

avx512_entries!(
    dot_q4_0, tile_q4_0 => Q4_0Format,
    dot_q5_0, tile_q5_0 => Q5_0Format,
    dot_q8_0, tile_q8_0 => Q8_0Format,
    dot_iq4_nl, tile_iq4_nl => IQ4NLFormat,
);

/// The eight i32 lanes of a block against 32 activations as this file's kernels
/// compute them, for a pair of tokens and for one (the AVX2 kernel's, by
/// `avx2::legacy::block_lanes`).
#[cfg(test)]
pub(crate) fn block_lanes(
    _proof: super::Avx512,
    ty: gguf_format::GgmlType,
    block: &[u8],
    qx: &[i8],
) -> [i32; 8] {
    use gguf_format::GgmlType as T;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn lanes<L: Offset>(block: &[u8], qx: &[i8]) -> [i32; 8] {
        assert!(block.len() >= L::BYTES && qx.len() >= QK8);
        let (mut pair, mut single) = ([0i32; 16], [0i32; 8]);
        // SAFETY: the lengths were just checked; the features are present, as calling
        // this function requires; the outputs hold sixteen and eight i32.
        unsafe {
            let u = L::offset_quants(block.as_ptr());
            let x = load32(qx.as_ptr().cast());
            let xx = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x), x);
            let int = _mm512_dpbusd_epi32(offset_start::<L>(xx), _mm512_broadcast_i64x4(u), xx);
            _mm512_storeu_si512(pair.as_mut_ptr().cast(), int);
            let int = _mm256_dpbusd_epi32(offset_start_256::<L>(x), u, x);
            _mm256_storeu_si256(single.as_mut_ptr().cast(), int);
        }
        assert_eq!(pair[..8], pair[8..], "the two halves of a pair differ");
        assert_eq!(
            pair[..8],
            single,
            "a pair's lanes differ from a single token's"
        );
        single
    }
    // SAFETY: `_proof` shows the CPU has the features.
    unsafe {
        match ty {
            T::Q4_0 => lanes::<Q4_0Format>(block, qx),
            T::Q5_0 => lanes::<Q5_0Format>(block, qx),
            T::Q8_0 => lanes::<Q8_0Format>(block, qx),
            T::IQ4_NL => lanes::<IQ4NLFormat>(block, qx),
            other => panic!("{other} is not a symmetric legacy format"),
        }
    }
}
