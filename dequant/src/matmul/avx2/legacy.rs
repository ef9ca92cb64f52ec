//! AVX2 kernels of the legacy formats: blocks of 32 weights against [`Q8Row`]s.
//!
//! A block's 32 quantized weights become 32 bytes in one register: unsigned values (4
//! or 5 bits) for the formats with an offset `m` (`Q4_1`, `Q5_1`), or, for the
//! symmetric ones, the signed values (`q - 8` for `Q4_0`, `q - 16` for `Q5_0`, `q` for
//! `Q8_0`) as magnitudes with the signs moved onto the activations. One `maddubs` +
//! `madd` pair then yields the block's integer dot product `Σ q · qx` in eight lanes of
//! four products each.
//!
//! The block contributes `d · dx · Σ q qx (+ m · s)`, where `dx` is the activations'
//! scale and `s` their sum. The (d, m) pairs of a block in up to four rows are widened
//! together by one `vcvtph2ps` and multiplied by the activations' (dx, s) pairs in one
//! `vmulps`; each `d · dx` is then broadcast to scale its row's integer lanes, fused
//! into eight f32 accumulators, and the `m · s` lanes accumulate on their own.
//!
//! This is llama.cpp's x86 arithmetic to the last bit (eight lanes, one fused
//! multiply-add per block, the lanes reduced at the end, the offsets summed apart), so
//! products agree with it exactly. `IQ4_NL` looks its 16 levels up with one `pshufb` and
//! is multiplied as a symmetric format; a single token's product takes its dot
//! product's two sets of lanes (even and odd blocks) and a last odd block apart.
//! `MXFP4` is multiplied the same way (its table, its E8M0 scale), paired in batches
//! too, since llama.cpp has no GEMM for it.

use std::arch::x86_64::*;
use std::mem::{offset_of, size_of};

use super::{hsum_epi32, hsum_ps, lanes_of, load32, mul_sum_u8_i8};
use crate::blocks::{
    BlockIQ4_NL, BlockMXFP4, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0,
};
use crate::decode::grids::{KVALUES_IQ4NL, KVALUES_MXFP4};
use crate::decode::scalar::e8m0_to_f32_half;
use crate::matmul::activation::{Q8Row, QK8};

// `scales` reads d (and m) from the first four bytes of every legacy block.
const _: () = assert!(offset_of!(BlockQ4_0, d) == 0 && offset_of!(BlockQ5_0, d) == 0);
const _: () = assert!(offset_of!(BlockQ8_0, d) == 0 && offset_of!(BlockIQ4_NL, d) == 0);
const _: () = assert!(offset_of!(BlockQ4_1, d) == 0 && offset_of!(BlockQ4_1, m) == 2);
const _: () = assert!(offset_of!(BlockQ5_1, d) == 0 && offset_of!(BlockQ5_1, m) == 2);

/// One block's quantized weights, unpacked once for all tokens.
#[derive(Clone, Copy)]
pub(crate) struct Quants {
    /// The 32 weights as unsigned bytes (for the symmetric formats, their magnitudes).
    pub(crate) q: __m256i,
    /// For the symmetric formats, the signed weights whose signs go onto the
    /// activations.
    pub(crate) signs: __m256i,
}

/// How one legacy format unpacks and multiplies. Every block starts with its f16
/// scale `d`, followed by the f16 offset `m` in the formats that have one.
pub(crate) trait Legacy {
    const BYTES: usize;
    /// The second f16 of a block is its offset `m`.
    const HAS_M: bool;
    /// Each block's integers are reduced to one value and fused into one accumulator
    /// (llama.cpp's repacked kernels) instead of eight lanes reduced at the end.
    const TOTALS: bool = false;
    /// A single token's product takes two sets of lanes, for even and odd blocks, and
    /// a last odd block's total apart (llama.cpp's `IQ4_NL` dot product); batches take
    /// the one set of lanes.
    const PAIRED: bool = false;
    /// Batches are paired too: llama.cpp has no GEMM for the format (`MXFP4`).
    const PAIRED_BATCH: bool = false;
    /// The block starts with an E8M0 exponent, whose scale is half its power of two
    /// (`MXFP4`), instead of an f16 `d`.
    const E8M0: bool = false;

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `block..block + BYTES` must be readable.
    unsafe fn quants(block: *const u8) -> Quants;

    /// `Σ q · qx` in eight lanes.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    unsafe fn int(w: &Quants, qx: __m256i) -> __m256i;
}

/// 16 bytes of packed nibbles → 32 bytes: low nibbles first, then high ones.
///
/// # Safety
/// `p..p + 16` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: readable per the contract; `loadu` has no alignment requirement.
    let packed = unsafe { _mm_loadu_si128(p.cast()) };
    // Both halves hold the 16 bytes; the upper one shifted right by 4.
    let both = _mm256_broadcastsi128_si256(packed);
    let shifted = _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
}

/// The 32 high bits at `p` (little-endian) as bytes: 0x10 where bit `i` is set.
///
/// # Safety
/// `p..p + 4` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn high_bits(p: *const u8) -> __m256i {
    // SAFETY: readable per the contract; `read_unaligned` has no alignment requirement.
    let bits = unsafe { p.cast::<u32>().read_unaligned() };
    // Byte i receives the byte of `bits` holding bit i (each 128-bit lane holds a copy).
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

pub(crate) struct Q4_0;
/// `Q4_0` as llama.cpp's repacked kernels multiply it (matrices of a multiple of 8 rows).
struct Q4_0Packed;
struct Q4_1;
pub(crate) struct Q5_0;
struct Q5_1;
pub(crate) struct Q8_0;
pub(crate) struct IQ4NL;
/// `IQ4_NL` as llama.cpp's repacked kernels multiply it (matrices of a multiple of 8 rows).
struct IQ4NLPacked;
struct MXFP4;
/// `MXFP4` as llama.cpp's repacked kernels multiply it (matrices of a multiple of 8 rows).
struct MXFP4Packed;

impl Legacy for Q4_0 {
    const BYTES: usize = size_of::<BlockQ4_0>();
    const HAS_M: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(block: *const u8) -> Quants {
        // SAFETY: the block is readable per the contract; qs lies inside it.
        let q = unsafe { nibbles(block.add(offset_of!(BlockQ4_0, qs))) };
        signed(_mm256_sub_epi8(q, _mm256_set1_epi8(8)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Quants, qx: __m256i) -> __m256i {
        signed_int(w, qx)
    }
}

impl Legacy for Q4_0Packed {
    const BYTES: usize = size_of::<BlockQ4_0>();
    const HAS_M: bool = false;
    const TOTALS: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(block: *const u8) -> Quants {
        // SAFETY: the contract is Q4_0's.
        unsafe { Q4_0::quants(block) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Quants, qx: __m256i) -> __m256i {
        // SAFETY: the contract is Q4_0's.
        unsafe { Q4_0::int(w, qx) }
    }
}

impl Legacy for Q4_1 {
    const BYTES: usize = size_of::<BlockQ4_1>();
    const HAS_M: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(block: *const u8) -> Quants {
        // SAFETY: the block is readable per the contract; qs lies inside it.
        let q = unsafe { nibbles(block.add(offset_of!(BlockQ4_1, qs))) };
        Quants { q, signs: q }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Quants, qx: __m256i) -> __m256i {
        mul_sum_u8_i8(w.q, qx)
    }
}

impl Legacy for Q5_0 {
    const BYTES: usize = size_of::<BlockQ5_0>();
    const HAS_M: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(block: *const u8) -> Quants {
        let (qs, qh) = (offset_of!(BlockQ5_0, qs), offset_of!(BlockQ5_0, qh));
        // SAFETY: the block is readable per the contract; qs and qh lie inside it.
        let q = unsafe { _mm256_or_si256(nibbles(block.add(qs)), high_bits(block.add(qh))) };
        signed(_mm256_sub_epi8(q, _mm256_set1_epi8(16)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Quants, qx: __m256i) -> __m256i {
        signed_int(w, qx)
    }
}

impl Legacy for Q5_1 {
    const BYTES: usize = size_of::<BlockQ5_1>();
    const HAS_M: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(block: *const u8) -> Quants {
        let (qs, qh) = (offset_of!(BlockQ5_1, qs), offset_of!(BlockQ5_1, qh));
        // SAFETY: the block is readable per the contract; qs and qh lie inside it.
        let q = unsafe { _mm256_or_si256(nibbles(block.add(qs)), high_bits(block.add(qh))) };
        Quants { q, signs: q }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Quants, qx: __m256i) -> __m256i {
        mul_sum_u8_i8(w.q, qx)
    }
}

impl Legacy for Q8_0 {
    const BYTES: usize = size_of::<BlockQ8_0>();
    const HAS_M: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(block: *const u8) -> Quants {
        // SAFETY: the block is readable per the contract; qs (32 bytes) lies inside it.
        signed(unsafe { load32(block.add(offset_of!(BlockQ8_0, qs))) })
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Quants, qx: __m256i) -> __m256i {
        signed_int(w, qx)
    }
}

impl Legacy for IQ4NL {
    const BYTES: usize = size_of::<BlockIQ4_NL>();
    const HAS_M: bool = false;
    const PAIRED: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(block: *const u8) -> Quants {
        // SAFETY: the block is readable per the contract; qs lies inside it.
        unsafe { lookup(block.add(offset_of!(BlockIQ4_NL, qs)), &KVALUES_IQ4NL) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Quants, qx: __m256i) -> __m256i {
        signed_int(w, qx)
    }
}

impl Legacy for IQ4NLPacked {
    const BYTES: usize = size_of::<BlockIQ4_NL>();
    const HAS_M: bool = false;
    const TOTALS: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(block: *const u8) -> Quants {
        // SAFETY: the contract is IQ4_NL's.
        unsafe { IQ4NL::quants(block) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Quants, qx: __m256i) -> __m256i {
        // SAFETY: the contract is IQ4_NL's.
        unsafe { IQ4NL::int(w, qx) }
    }
}

/// The 32 values of a block of 16 nibble bytes at `p` looked up in the 16-entry
/// `table`, as signed weights.
///
/// # Safety
/// `p..p + 16` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lookup(p: *const u8, table: &[i8; 16]) -> Quants {
    // SAFETY: readable per the contract; the table holds 16 bytes.
    let (q, table) = unsafe { (nibbles(p), _mm_loadu_si128(table.as_ptr().cast())) };
    // |value| ≤ 127: the magnitudes and signs of `signed` fit maddubs.
    signed(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), q))
}

impl Legacy for MXFP4 {
    const BYTES: usize = size_of::<BlockMXFP4>();
    const HAS_M: bool = false;
    const PAIRED: bool = true;
    const PAIRED_BATCH: bool = true;
    const E8M0: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(block: *const u8) -> Quants {
        // SAFETY: the block is readable per the contract; qs lies inside it.
        unsafe { lookup(block.add(offset_of!(BlockMXFP4, qs)), &KVALUES_MXFP4) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Quants, qx: __m256i) -> __m256i {
        signed_int(w, qx)
    }
}

impl Legacy for MXFP4Packed {
    const BYTES: usize = size_of::<BlockMXFP4>();
    const HAS_M: bool = false;
    const TOTALS: bool = true;
    const E8M0: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(block: *const u8) -> Quants {
        // SAFETY: the contract is MXFP4's.
        unsafe { MXFP4::quants(block) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int(w: &Quants, qx: __m256i) -> __m256i {
        signed_int(w, qx)
    }
}

/// Signed weights as [`Quants`]: their magnitudes, and themselves for the signs.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed(q: __m256i) -> Quants {
    // |q| as unsigned bytes: -128 becomes 128, which maddubs reads correctly.
    Quants {
        q: _mm256_sign_epi8(q, q),
        signs: q,
    }
}

/// `Σ q · qx` of signed weights: `|q| · (qx with q's sign)`; zero weights zero the
/// activation.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed_int(w: &Quants, qx: __m256i) -> __m256i {
    mul_sum_u8_i8(w.q, _mm256_sign_epi8(qx, w.signs))
}

/// Blocks that every row and activation row can supply.
pub(crate) fn blocks<const R: usize, const N: usize>(
    rows: &[&[u8]; R],
    bytes: usize,
    acts: &[Q8Row<'_>; N],
) -> usize {
    let n = rows
        .iter()
        .fold(usize::MAX, |n, row| n.min(row.len() / bytes));
    acts.iter()
        .fold(n, |n, a| n.min(a.qs.len() / QK8).min(a.ds.len()))
}

/// Block `b`'s scale and offset in each of `R` ≤ 4 rows, widened: lane `2r` holds row
/// `r`'s `d`, lane `2r + 1` its offset `m`, or 0.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; block `b` must lie inside every row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn scales<L: Legacy, const R: usize>(rows: &[&[u8]; R], b: usize) -> __m256 {
    const { assert!(R <= 4) };
    if L::E8M0 {
        let mut scales = [0.0f32; 8];
        for r in 0..R {
            // SAFETY: block b lies inside row r per the contract; its first byte is the
            // exponent.
            scales[2 * r] = e8m0_to_f32_half(unsafe { *rows[r].as_ptr().add(b * L::BYTES) });
        }
        // SAFETY: `scales` holds eight f32; `loadu` has no alignment requirement.
        return unsafe { _mm256_loadu_ps(scales.as_ptr()) };
    }
    let mut words = [0i32; 4];
    for r in 0..R {
        // SAFETY: block b lies inside row r per the contract, and every block is longer
        // than the 4 bytes read.
        words[r] = unsafe {
            rows[r]
                .as_ptr()
                .add(b * L::BYTES)
                .cast::<i32>()
                .read_unaligned()
        };
    }
    let mut halves = _mm_setr_epi32(words[0], words[1], words[2], words[3]);
    if !L::HAS_M {
        // The upper half of each word is the start of the quants, not an offset.
        halves = _mm_and_si128(halves, _mm_set1_epi32(0xFFFF));
    }
    _mm256_cvtph_ps(halves)
}

/// The bits of token row `a`'s (scale, sum) pair of block `b`, as one 8-byte value.
///
/// # Safety
/// `b` must be below `a.ds.len()`.
#[inline]
unsafe fn ds_bits(a: &Q8Row<'_>, b: usize) -> u64 {
    // SAFETY: in bounds per the contract; [f32; 2] has no padding, and an unaligned read
    // needs no alignment.
    unsafe { a.ds.as_ptr().add(b).cast::<u64>().read_unaligned() }
}

/// The lanes `2i + 1` of `offsets` (the accumulated offset terms), or zeros.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn odd_lanes<L: Legacy>(offsets: __m256) -> [f32; 4] {
    let mut lanes = [0.0f32; 8];
    if L::HAS_M {
        // SAFETY: `lanes` holds eight f32; `storeu` has no alignment requirement.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), offsets) };
    }
    [lanes[1], lanes[3], lanes[5], lanes[7]]
}

/// `R` ≤ 4 rows against one token. The token's (dx, s) pair, repeated, meets the rows'
/// (d, offset) pairs in one multiply.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows<L: Legacy, const R: usize>(rows: [&[u8]; R], act: Q8Row<'_>) -> [f32; R] {
    let nb = blocks(&rows, L::BYTES, &[act]);
    let paired = L::PAIRED && (act.single || L::PAIRED_BATCH);
    // The blocks that go into lanes: all, or with `paired`, the whole pairs.
    let laned = if paired { nb / 2 * 2 } else { nb };
    let mut acc = [_mm256_setzero_ps(); R];
    let mut odd = [_mm256_setzero_ps(); R];
    let mut totals = [0.0f32; R];
    let mut tails = [(0.0f32, 0.0f32); R];
    let mut offsets = _mm256_setzero_ps();
    for b in 0..nb {
        // SAFETY: `b < nb` bounds every index by the rows' and the activations' lengths;
        // the features are present per this function's contract.
        let (qx, products) = unsafe {
            let ds = _mm256_castpd_ps(_mm256_set1_pd(f64::from_bits(ds_bits(&act, b))));
            (
                load32(act.qs.as_ptr().add(b * QK8).cast()),
                _mm256_mul_ps(scales::<L, R>(&rows, b), ds),
            )
        };
        if L::HAS_M {
            offsets = _mm256_add_ps(offsets, products);
        }
        let scales = lanes_of(products);
        for r in 0..R {
            // SAFETY: as above.
            let int = unsafe { L::int(&L::quants(rows[r].as_ptr().add(b * L::BYTES)), qx) };
            if L::TOTALS {
                totals[r] = (hsum_epi32(int) as f32).mul_add(scales[2 * r], totals[r]);
            } else if b >= laned {
                tails[r] = (scales[2 * r], hsum_epi32(int) as f32);
            } else {
                let scale = _mm256_permutevar8x32_ps(products, _mm256_set1_epi32(2 * r as i32));
                let acc = if paired && b % 2 == 1 {
                    &mut odd[r]
                } else {
                    &mut acc[r]
                };
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int), scale, *acc);
            }
        }
    }
    let offsets = odd_lanes::<L>(offsets);
    let mut out = [0.0f32; R];
    for r in 0..R {
        out[r] = if L::TOTALS {
            totals[r]
        } else if paired {
            let sum = hsum_ps(_mm256_add_ps(acc[r], odd[r]));
            if laned < nb {
                tails[r].0.mul_add(tails[r].1, sum)
            } else {
                sum
            }
        } else {
            hsum_ps(acc[r]) + offsets[r]
        };
    }
    out
}

/// Block `b`'s products of one row's (d, offset) pair with each of `N` ≤ 4 tokens'
/// (dx, s) pairs: lane `2t` holds `d · dx_t`, lane `2t + 1` the offset's term. The
/// tokens' pairs fill the lanes of one vector and meet the block's pair, repeated, in
/// one multiply.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; block `b` must lie inside the row and every
/// activation row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn token_scales<L: Legacy, const N: usize>(
    row: &[u8],
    acts: &[Q8Row<'_>; N],
    b: usize,
) -> __m256 {
    const { assert!(N <= 4) };
    let mut pairs = [0.0f64; 4];
    for t in 0..N {
        // SAFETY: block b lies inside the activation row per the contract.
        pairs[t] = f64::from_bits(unsafe { ds_bits(&acts[t], b) });
    }
    let ds = _mm256_castpd_ps(_mm256_setr_pd(pairs[0], pairs[1], pairs[2], pairs[3]));
    // SAFETY: block b lies inside the row per the contract.
    let dm = unsafe { scales::<L, 1>(&[row], b) };
    let dm = _mm256_castpd_ps(_mm256_broadcastsd_pd(_mm256_castpd256_pd128(
        _mm256_castps_pd(dm),
    )));
    _mm256_mul_ps(dm, ds)
}

/// One row against `N` ≤ 4 tokens. The tokens' (dx, s) pairs fill the lanes of one
/// vector and meet the block's (d, offset) pair, repeated, in one multiply.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_tokens<L: Legacy, const N: usize>(row: &[u8], acts: [Q8Row<'_>; N]) -> [f32; N] {
    const { assert!(N <= 4) };
    // Several tokens come from a set of several: a batch, paired only for the formats
    // llama.cpp has no GEMM for.
    debug_assert!(acts.iter().all(|a| !a.single));
    let paired = L::PAIRED && L::PAIRED_BATCH;
    let rows = [row];
    let nb = blocks(&rows, L::BYTES, &acts);
    let laned = if paired { nb / 2 * 2 } else { nb };
    let mut acc = [_mm256_setzero_ps(); N];
    let mut odd = [_mm256_setzero_ps(); N];
    let mut tails = [(0.0f32, 0.0f32); N];
    let mut totals = [0.0f32; N];
    let mut offsets = _mm256_setzero_ps();
    for b in 0..nb {
        // SAFETY: `b < nb` keeps the block inside the row and the activation rows; the
        // features are present per this function's contract.
        let (products, quants) = unsafe {
            (
                token_scales::<L, N>(row, &acts, b),
                L::quants(row.as_ptr().add(b * L::BYTES)),
            )
        };
        if L::HAS_M {
            offsets = _mm256_add_ps(offsets, products);
        }
        let scales = lanes_of(products);
        for t in 0..N {
            // SAFETY: `b < nb` bounds the load by the activation row's length; the
            // features are present per this function's contract.
            let int = unsafe { L::int(&quants, load32(acts[t].qs.as_ptr().add(b * QK8).cast())) };
            if L::TOTALS {
                totals[t] = (hsum_epi32(int) as f32).mul_add(scales[2 * t], totals[t]);
            } else if b >= laned {
                tails[t] = (scales[2 * t], hsum_epi32(int) as f32);
            } else {
                let scale = _mm256_permutevar8x32_ps(products, _mm256_set1_epi32(2 * t as i32));
                let acc = if paired && b % 2 == 1 {
                    &mut odd[t]
                } else {
                    &mut acc[t]
                };
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int), scale, *acc);
            }
        }
    }
    let offsets = odd_lanes::<L>(offsets);
    let mut out = [0.0f32; N];
    for t in 0..N {
        out[t] = if L::TOTALS {
            totals[t]
        } else if paired {
            let sum = hsum_ps(_mm256_add_ps(acc[t], odd[t]));
            if laned < nb {
                tails[t].0.mul_add(tails[t].1, sum)
            } else {
                sum
            }
        } else {
            hsum_ps(acc[t]) + offsets[t]
        };
    }
    out
}

/// `R` rows against `N` tokens: one of them must be 1, the other at most 4.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot<L: Legacy, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    acts: [Q8Row<'_>; N],
) -> [[f32; N]; R] {
    const { assert!((R == 1 || N == 1) && R <= 4 && N <= 4) };
    let mut out = [[0.0f32; N]; R];
    if N == 1 {
        // SAFETY: the features are present per this function's contract.
        let dots = unsafe { dot_rows::<L, R>(rows, acts[0]) };
        for r in 0..R {
            out[r][0] = dots[r];
        }
    } else {
        // SAFETY: the features are present per this function's contract.
        out[0] = unsafe { dot_tokens::<L, N>(rows[0], acts) };
    }
    out
}

entries!(
    "`R` rows against `N` tokens: one of them must be 1, the other at most 4.",
    Q8Row:
    dot_q4_0 => Q4_0,
    dot_q4_0_packed => Q4_0Packed,
    dot_q4_1 => Q4_1,
    dot_q5_0 => Q5_0,
    dot_q5_1 => Q5_1,
    dot_q8_0 => Q8_0,
    dot_iq4_nl => IQ4NL,
    dot_iq4_nl_packed => IQ4NLPacked,
    dot_mxfp4 => MXFP4,
    dot_mxfp4_packed => MXFP4Packed,
);

#[cfg(test)]
mod probes;
#[cfg(test)]
pub(crate) use probes::{block_int, block_lanes};
