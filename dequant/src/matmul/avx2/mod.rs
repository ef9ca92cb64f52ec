//! The AVX2 kernels (with FMA for the accumulation and F16C for the f16 scales).
//!
//! Every function here is compiled for those features and may run only on a CPU that
//! has them. [`Avx2`] is the proof: it is made only by [`Avx2::detect`], and the safe
//! entry point [`RowKernels::rows`] takes it by value. The loops (`rows`) also drive the
//! AVX-512 path's kernels (`super::avx512`).
//!
//! Each kernel computes one weight row against `N` tokens at once (`N` ≤ 4), so a
//! block's weights are unpacked once and meet every token of the batch while they sit
//! in registers (the AVX-512 set also has tiles of four rows for some formats).

/// The kernel entry points `$name`, each `R` rows against `N` tokens of activation rows
/// `$row`, by the module's `dot` for the format `$format`; `$doc` says what they take.
macro_rules! entries {
    ($doc:literal, $row:ident: $($name:ident => $format:ty),+ $(,)?) => {$(
        #[doc = $doc]
        ///
        /// # Safety
        /// The CPU must support AVX2, FMA and F16C.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(crate) unsafe fn $name<const R: usize, const N: usize>(
            rows: [&[u8]; R],
            acts: [$row<'_>; N],
        ) -> [[f32; N]; R] {
            // SAFETY: the features are present per this function's contract.
            unsafe { dot::<$format, R, N>(rows, acts) }
        }
    )+};
}

pub(crate) mod float;
pub(crate) mod grouped;
pub(crate) mod kquants;
pub(crate) mod lanes;
pub(crate) mod legacy;

use std::arch::x86_64::*;
use std::ops::Range;

use super::activation::ActSet;
use super::driver::{rows_per_block, token_tile, Out};
use super::formats::Kernel;

/// Proof that the CPU supports AVX2, FMA and F16C.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// The proof, when the CPU has the features.
    pub(crate) fn detect() -> Option<Avx2> {
        let present = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        present.then_some(Avx2(()))
    }
}

/// A set of row kernels that [`rows`] can drive, a proof that the CPU can run them:
/// the AVX2 kernels ([`Avx2`]) or the AVX-512 ones
/// ([`Avx512`](crate::matmul::avx512::Avx512)), each made only by its `detect`.
pub(crate) trait RowKernels: Copy {
    /// `K`'s `R` rows · `N` tokens in this set.
    fn dot<K: Kernel, const R: usize, const N: usize>(
        self,
        rows: [&[u8]; R],
        acts: [<K::Acts as ActSet>::Row<'_>; N],
    ) -> [[f32; N]; R];

    /// Whether a batch takes `K`'s rows four at a time in this set ([`RowKernels::tile`]).
    fn tiles<K: Kernel>(self) -> bool {
        false
    }

    /// Whether the tiles also take the tokens past a batch's groups of eight, four or
    /// fewer at a time ([`RowKernels::tile`]); else the one-row kernels do.
    fn small_tiles<K: Kernel>(self) -> bool {
        self.tiles::<K>()
    }

    /// `K`'s four rows · `N` tokens in this set, with the bits of [`RowKernels::dot`]
    /// row by row (which this default calls).
    fn tile<K: Kernel, const N: usize>(
        self,
        rows: [&[u8]; 4],
        acts: [<K::Acts as ActSet>::Row<'_>; N],
    ) -> [[f32; N]; 4] {
        rows.map(|row| self.dot::<K, 1, N>([row], acts)[0])
    }

    /// `K`'s four rows · eight tokens in this set, with the bits of two
    /// [`RowKernels::tile`]s of four (which this default calls).
    fn tile8<K: Kernel>(
        self,
        rows: [&[u8]; 4],
        acts: [<K::Acts as ActSet>::Row<'_>; 8],
    ) -> [[f32; 8]; 4] {
        let [a0, a1, a2, a3, a4, a5, a6, a7] = acts;
        let (lo, hi) = (
            self.tile::<K, 4>(rows, [a0, a1, a2, a3]),
            self.tile::<K, 4>(rows, [a4, a5, a6, a7]),
        );
        join_tiles(lo, hi)
    }

    /// Every row of `w` (rows of `row_bytes`, whole blocks) against `tokens` of `acts`.
    fn rows<K: Kernel>(
        self,
        w: &[u8],
        row_bytes: usize,
        acts: &K::Acts,
        tokens: Range<usize>,
        out: Out<'_>,
    ) {
        // SAFETY: `self` exists only when its `detect` found AVX2, FMA and F16C (and, for
        // the AVX-512 set, its own features) on this CPU, the only requirement of `rows`.
        unsafe { rows::<K, Self>(self, w, row_bytes, acts, tokens, out) }
    }
}

impl RowKernels for Avx2 {
    #[inline(always)]
    fn dot<K: Kernel, const R: usize, const N: usize>(
        self,
        rows: [&[u8]; R],
        acts: [<K::Acts as ActSet>::Row<'_>; N],
    ) -> [[f32; N]; R] {
        // SAFETY: `self` exists only when `detect` found AVX2, FMA and F16C on this CPU,
        // the kernels' only requirement (they bound every access by their slices).
        unsafe { K::dot_avx2::<R, N>(rows, acts) }
    }

    fn tiles<K: Kernel>(self) -> bool {
        K::AVX2_TILES
    }

    fn small_tiles<K: Kernel>(self) -> bool {
        false
    }

    #[inline(always)]
    fn tile8<K: Kernel>(
        self,
        rows: [&[u8]; 4],
        acts: [<K::Acts as ActSet>::Row<'_>; 8],
    ) -> [[f32; 8]; 4] {
        // SAFETY: as `dot`'s.
        unsafe { K::tile8_avx2(rows, acts) }
    }
}

/// Two tiles of four rows · four tokens as one of four rows · eight (`lo`'s tokens
/// first).
pub(crate) fn join_tiles(lo: [[f32; 4]; 4], hi: [[f32; 4]; 4]) -> [[f32; 8]; 4] {
    std::array::from_fn(|r| std::array::from_fn(|t| if t < 4 { lo[r][t] } else { hi[r][t - 4] }))
}

/// The loops of [`RowKernels::rows`], for either set: `P` is the kernels' set. One
/// token: four rows per kernel call, which shares each activation load between them and
/// keeps four independent accumulations in flight. A batch: blocks of rows small enough
/// to stay in L2, and for each, tiles of tokens small enough to stay in L1 passing over
/// every row, four tokens per kernel call, so each weight block is unpacked once for
/// four tokens; four rows at a time too where the set has tiles for the format
/// ([`RowKernels::tiles`]), so each token's block is loaded once for four rows, and
/// those tiles take eight tokens a call ([`RowKernels::tile8`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C (which every `P` proves).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn rows<K: Kernel, P: RowKernels>(
    kernels: P,
    w: &[u8],
    row_bytes: usize,
    acts: &K::Acts,
    tokens: Range<usize>,
    out: Out<'_>,
) {
    if row_bytes == 0 || tokens.is_empty() {
        return;
    }
    let act_rows: Vec<_> = tokens.map(|t| acts.row(t)).collect();
    let (n_rows, n_tokens) = (w.len() / row_bytes, act_rows.len());
    let mut at = Tile::<K, P> {
        w,
        row_bytes,
        acts: &act_rows,
        out,
        kernels,
    };
    if n_tokens == 1 {
        let (mut r, mut fetched) = (0, 0);
        while r + 4 <= n_rows {
            fetched = prefetch(w, fetched, (r + 4) * row_bytes + PREFETCH_BYTES);
            at.run::<4, 1>(r, 0);
            r += 4;
        }
        for r in r..n_rows {
            at.run::<1, 1>(r, 0);
        }
        return;
    }
    let mut tile = token_tile(K::Acts::row_bytes(acts.cols()));
    let tiles = kernels.tiles::<K>();
    if tiles && !kernels.small_tiles::<K>() {
        // Whole tiles of eight tokens. They read a block's activations of eight tokens
        // at a time, a few KiB, for their four rows: wide rows still take eight a call.
        tile = (tile / 8 * 8).max(8);
    }
    let block = rows_per_block(row_bytes);
    for r0 in (0..n_rows).step_by(block) {
        for t0 in (0..n_tokens).step_by(tile) {
            let t1 = (t0 + tile).min(n_tokens);
            let r1 = (r0 + block).min(n_rows);
            let mut r = r0;
            // The tokens the tiles leave to the one-row kernels in the rows they take.
            let mut rest = t0;
            if tiles {
                rest = if kernels.small_tiles::<K>() || t1 - t0 >= 8 {
                    t1
                } else {
                    t0
                };
                while r + 4 <= r1 {
                    at.run_tile(r, t0, rest);
                    r += 4;
                }
            }
            for row in r0..r {
                at.run_tokens(row, rest, t1);
            }
            for row in r..r1 {
                at.run_tokens(row, t0, t1);
            }
        }
    }
}

/// How far past the next group of rows a single token's loop asks for weights ahead.
/// Four rows are four short interleaved streams (a few hundred bytes each), which the
/// hardware prefetchers pick up too late: on the 2-core VM, asking for the next group
/// while multiplying this one doubled a whole decode step's weight throughput (SmolLM2
/// 5 → 12 GB/s on one thread; Gemma 3 3.6 → 7.6 GB/s on two).
const PREFETCH_BYTES: usize = 1024;

/// Asks for the cache lines of `w[from..to]` (clamped to `w`) to be brought into the
/// cache, returning where it stopped, to resume from there.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch(w: &[u8], from: usize, to: usize) -> usize {
    let to = to.min(w.len());
    let mut at = from;
    while at < to {
        _mm_prefetch::<_MM_HINT_T0>(w[at..].as_ptr().cast());
        at += 64;
    }
    at.max(from)
}

/// A task's weights, activations and output, multiplied by the kernels `P`.
struct Tile<'a, 'r, 'o, K: Kernel, P> {
    w: &'a [u8],
    row_bytes: usize,
    acts: &'r [<K::Acts as ActSet>::Row<'a>],
    out: Out<'o>,
    kernels: P,
}

impl<K: Kernel, P: RowKernels> Tile<'_, '_, '_, K, P> {
    /// Rows `r0..r0 + 4` · tokens `t0..t1` by the four-row tiles, eight tokens a call
    /// (then four, then the rest).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn run_tile(&mut self, r0: usize, t0: usize, t1: usize) {
        let mut t = t0;
        while t + 8 <= t1 {
            let rows = std::array::from_fn(|i| {
                &self.w[(r0 + i) * self.row_bytes..(r0 + i + 1) * self.row_bytes]
            });
            let acts = std::array::from_fn(|j| self.acts[t + j]);
            let dots = self.kernels.tile8::<K>(rows, acts);
            self.store(r0, t, &dots);
            t += 8;
        }
        while t + 4 <= t1 {
            self.tile::<4>(r0, t);
            t += 4;
        }
        match t1 - t {
            3 => self.tile::<3>(r0, t),
            2 => self.tile::<2>(r0, t),
            1 => self.tile::<1>(r0, t),
            _ => {}
        }
    }

    /// Row `r` · tokens `t0..t1` by the one-row kernels, four tokens a call (then the
    /// rest).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn run_tokens(&mut self, r: usize, t0: usize, t1: usize) {
        let mut t = t0;
        while t + 4 <= t1 {
            self.run::<1, 4>(r, t);
            t += 4;
        }
        match t1 - t {
            3 => self.run::<1, 3>(r, t),
            2 => self.run::<1, 2>(r, t),
            1 => self.run::<1, 1>(r, t),
            _ => {}
        }
    }

    /// Rows `r0..r0 + 4` · tokens `t0..t0 + N` into the output, by the tiles.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn tile<const N: usize>(&mut self, r0: usize, t0: usize) {
        let rows = std::array::from_fn(|i| {
            &self.w[(r0 + i) * self.row_bytes..(r0 + i + 1) * self.row_bytes]
        });
        let acts = std::array::from_fn(|j| self.acts[t0 + j]);
        let dots = self.kernels.tile::<K, N>(rows, acts);
        self.store(r0, t0, &dots);
    }

    /// Rows `r0..r0 + R` · tokens `t0..t0 + N` into the output.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn run<const R: usize, const N: usize>(&mut self, r0: usize, t0: usize) {
        let mut rows = [&self.w[..0]; R];
        for (i, row) in rows.iter_mut().enumerate() {
            *row = &self.w[(r0 + i) * self.row_bytes..(r0 + i + 1) * self.row_bytes];
        }
        let mut acts = [self.acts[t0]; N];
        acts.copy_from_slice(&self.acts[t0..t0 + N]);
        let dots = self.kernels.dot::<K, R, N>(rows, acts);
        self.store(r0, t0, &dots);
    }

    /// `dots[i][j]` as row `r0 + i`'s product with token `t0 + j`.
    #[inline]
    fn store<const R: usize, const N: usize>(
        &mut self,
        r0: usize,
        t0: usize,
        dots: &[[f32; N]; R],
    ) {
        for (i, dots) in dots.iter().enumerate() {
            for (j, &v) in dots.iter().enumerate() {
                self.out.set(r0 + i, t0 + j, v);
            }
        }
    }
}

/// The eight lanes of `v`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn lanes_of(v: __m256) -> [f32; 8] {
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds eight f32; `storeu` has no alignment requirement.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
    lanes
}

/// The four lanes of `v`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn lanes_of_128(v: __m128) -> [f32; 4] {
    let mut lanes = [0.0f32; 4];
    // SAFETY: `lanes` holds four f32; `storeu` has no alignment requirement.
    unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), v) };
    lanes
}

/// The four i32 lanes of `v`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn lanes_of_epi32_128(v: __m128i) -> [i32; 4] {
    let mut lanes = [0i32; 4];
    // SAFETY: `lanes` holds four i32; `storeu` has no alignment requirement.
    unsafe { _mm_storeu_si128(lanes.as_mut_ptr().cast(), v) };
    lanes
}

/// The sum of the eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum_ps(v: __m256) -> f32 {
    let sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
    _mm_cvtss_f32(_mm_add_ss(sum2, _mm_movehdup_ps(sum2)))
}

/// The sum of the four lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum_epi32_128(v: __m128i) -> i32 {
    let sum2 = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    _mm_cvtsi128_si32(_mm_add_epi32(sum2, _mm_shuffle_epi32::<0b01>(sum2)))
}

/// The sum of the eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum_epi32(v: __m256i) -> i32 {
    hsum_epi32_128(_mm_add_epi32(
        _mm256_castsi256_si128(v),
        _mm256_extracti128_si256::<1>(v),
    ))
}

/// `Σ u[i] · s[i]` in eight i32 lanes, each lane summing four neighbouring products:
/// unsigned bytes against signed ones. The pairwise i16 sums cannot saturate as long as
/// `u` ≤ 128 and |s| ≤ 127, which every caller keeps.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn mul_sum_u8_i8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// 32 bytes read from `p`, which may be unaligned.
///
/// # Safety
/// `p..p + 32` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn load32(p: *const u8) -> __m256i {
    // SAFETY: readable per the contract; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// The little-endian f16 at `p`, widened with F16C.
///
/// # Safety
/// `p..p + 2` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn load_f16(p: *const u8) -> f32 {
    // SAFETY: readable per the contract; `read_unaligned` has no alignment requirement.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}
