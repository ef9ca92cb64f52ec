//! The tiled kernel of [`super`] by blocks of queries: a batch's (token, head) pairs
//! in tasks of [`Q_BLOCK`] tokens that share each tile of keys.

use std::ops::Range;

use super::{tile_softmax, tile_values, tiled_output, AttentionShape, Layout, Rows, KV_TILE};

/// Tokens a task of [`tiled_blocks`] takes, each with all its query heads.
const Q_BLOCK: usize = 16;

/// A batch's queries and the cache they attend to: `q` is `n_tokens × n_heads ×
/// head_dim`, `keys` and `values` an f16 cache's rows, heads side by side.
pub(in super::super) struct Batch<'a> {
    pub q: &'a [f32],
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub shape: &'a AttentionShape<'a>,
    pub layout: Layout<'a>,
}

/// Scratch of one task of [`tiled_blocks`].
#[derive(Default)]
struct BlockScratch {
    /// A tile of one key head's keys, dimension-major: dimension `d` of position
    /// `tile + l` at `d · KV_TILE + l`.
    kt: Vec<f32>,
    /// Each query's running maximum and sum.
    state: Vec<(f32, f32)>,
    /// Each query's accumulator, `head_dim_v` values apiece.
    acc: Vec<f32>,
    /// One token's group of queries' weights of a tile's positions, [`KV_TILE`] apiece.
    probs: Vec<f32>,
    /// Whether the CPU has AVX2, which [`transpose_keys`] moves eight values at a time
    /// with (asked once a batch).
    avx2: bool,
}

/// The tiled kernel (see [`tiled`](super::tiled)) for every (token, head) pair of a
/// batch of `n_tokens`, at least [`Q_TILE`](super::Q_TILE), into `out` (`n_tokens ×
/// n_heads × head_dim_v`), in tasks of [`Q_BLOCK`] tokens. A task turns each tile of a
/// key head's keys dimension-major once ([`BlockScratch::kt`]) and scores every query
/// of the block that sees the tile from it, a vector of positions at a time, where the
/// one-query kernel reads each key whole for every query; a token's group of query
/// heads takes each value row together. Each score is still one chain of fused
/// multiply-adds over the head's dimensions in order, from zero, and the rest is
/// [`tile_softmax`], [`tile_values`] and [`tiled_output`]: the results are
/// [`tiled`](super::tiled)'s, bit for bit. `fma`: the CPU has FMA instructions.
pub(in super::super) fn tiled_blocks(
    batch: &Batch<'_>,
    n_tokens: usize,
    fma: bool,
    out: &mut [f32],
) {
    use rayon::prelude::*;
    let width = batch.shape.n_heads * batch.shape.head_dim_v;
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    let avx2 = false;
    // Where the products take their AVX-512 kernels, so does this: 32 vector registers
    // hold two queries' scores of a tile of keys, which spill from AVX2's 16.
    #[cfg(target_arch = "x86_64")]
    let wide = fma && dequant::matmul::best_path() == dequant::DecodePath::Avx512;
    let scratch = || BlockScratch {
        avx2,
        ..BlockScratch::default()
    };
    out.par_chunks_mut(Q_BLOCK * width)
        .enumerate()
        .for_each_init(scratch, |s, (b, o)| {
            let tokens = b * Q_BLOCK..(b * Q_BLOCK + Q_BLOCK).min(n_tokens);
            #[cfg(target_arch = "x86_64")]
            if wide {
                // SAFETY: the products' AVX-512 path is taken only where the CPU has
                // AVX-512 F and VL (and FMA, which every such CPU has, asked too).
                unsafe { block_avx512(batch, tokens, s, o) };
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if fma {
                // SAFETY: the caller found FMA on this CPU, the feature `block_fma` needs.
                unsafe { block_fma(batch, tokens, s, o) };
                return;
            }
            let _ = fma;
            block(batch, tokens, s, o);
        });
}

/// [`block`] compiled with FMA instructions (a fused multiply-add is exactly
/// specified either way: the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn block_fma(batch: &Batch<'_>, tokens: Range<usize>, s: &mut BlockScratch, o: &mut [f32]) {
    block(batch, tokens, s, o);
}

/// [`block`] compiled for AVX-512 (F and VL) with FMA: the same chains of fused
/// multiply-adds lane by lane, so the same bits, in wider vectors and more registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,fma")]
fn block_avx512(batch: &Batch<'_>, tokens: Range<usize>, s: &mut BlockScratch, o: &mut [f32]) {
    block(batch, tokens, s, o);
}

/// One task of [`tiled_blocks`]: the queries of `tokens`, into `o` (their rows of the
/// output).
#[inline(always)]
fn block(batch: &Batch<'_>, tokens: Range<usize>, s: &mut BlockScratch, o: &mut [f32]) {
    let shape = batch.shape;
    let (hd, hdv) = (shape.head_dim, shape.head_dim_v);
    let (n_heads, n_kv) = (shape.n_heads, shape.n_kv_heads);
    let group = n_heads / n_kv;
    // The positions any query of the block sees: from the first token's first to the
    // last token's own.
    let first = shape.seen_by(tokens.start).0;
    let last = shape.seen_by(tokens.end - 1).1;
    let n_queries = tokens.len() * group;
    // Positions of a tile past the block's last keep the keys of an earlier tile: no
    // query sees them.
    s.kt.resize(hd * KV_TILE, 0.0);
    s.probs.resize(group * KV_TILE, 0.0);
    for kvh in 0..n_kv {
        let rows = Rows::of_kv_head(batch.keys, batch.values, batch.layout, shape, kvh);
        s.state.clear();
        s.state.resize(n_queries, (f32::NEG_INFINITY, 0.0));
        s.acc.clear();
        s.acc.resize(n_queries * hdv, 0.0);
        let mut tile = first / KV_TILE * KV_TILE;
        while tile <= last {
            let n = (tile + KV_TILE).min(last + 1) - tile;
            transpose_keys(&rows, tile, n, hd, s.avx2, &mut s.kt);
            for (i, t) in tokens.clone().enumerate() {
                let (start, pos) = shape.seen_by(t);
                // The tiles the one-query kernel visits: those from its first visible
                // position's to its own.
                if tile > pos || tile + KV_TILE <= start {
                    continue;
                }
                let visible = tile.max(start)..(tile + KV_TILE).min(pos + 1);
                let seen = visible.start - tile..visible.end - tile;
                // The group's dot products, two queries a pass where there are two.
                let q_of = |g: usize| &batch.q[(t * n_heads + kvh * group + g) * hd..][..hd];
                for g0 in (0..group).step_by(2) {
                    let dots = if g0 + 1 < group {
                        kt_dots([q_of(g0), q_of(g0 + 1)], &s.kt)
                    } else {
                        let [dots] = kt_dots([q_of(g0)], &s.kt);
                        [dots, [0.0; KV_TILE]]
                    };
                    for g in g0..(g0 + 2).min(group) {
                        let mut scores = [f32::NEG_INFINITY; KV_TILE];
                        scores[seen.clone()].copy_from_slice(&dots[g - g0][seen.clone()]);
                        let query = i * group + g;
                        tile_softmax(
                            shape,
                            tile,
                            visible.clone(),
                            &mut scores,
                            &mut s.state[query],
                            &mut s.acc[query * hdv..][..hdv],
                        );
                        s.probs[g * KV_TILE..][..KV_TILE].copy_from_slice(&scores);
                    }
                }
                // The group's queries take the tile's values together.
                tile_values(
                    rows,
                    hdv,
                    tile,
                    visible,
                    &s.probs,
                    &mut s.acc[i * group * hdv..][..group * hdv],
                );
            }
            tile += KV_TILE;
        }
        for i in 0..tokens.len() {
            for g in 0..group {
                let (h, query) = (kvh * group + g, i * group + g);
                tiled_output(
                    s.state[query],
                    shape.sinks.map(|sinks| sinks[h]),
                    &mut s.acc[query * hdv..][..hdv],
                    &mut o[(i * n_heads + h) * hdv..][..hdv],
                );
            }
        }
    }
}

/// The dot products of `Q` queries with the [`KV_TILE`] keys of a dimension-major tile
/// `kt`: for each query and position one chain of fused multiply-adds over the
/// dimensions in order, from zero, as [`tile_dots`](super::tile_dots) takes it; the
/// positions side by side, so a step is a few vector instructions, and the tile's rows
/// read once for the `Q` queries.
#[inline(always)]
fn kt_dots<const Q: usize>(qs: [&[f32]; Q], kt: &[f32]) -> [[f32; KV_TILE]; Q] {
    let mut acc = [[0.0f32; KV_TILE]; Q];
    for (d, row) in kt.chunks_exact(KV_TILE).enumerate().take(qs[0].len()) {
        let qd = qs.map(|q| q[d]);
        for (l, &k) in row.iter().enumerate() {
            for (a, &x) in acc.iter_mut().zip(&qd) {
                a[l] = k.mul_add(x, a[l]);
            }
        }
    }
    acc
}

/// The keys of positions `tile .. tile + n` of `rows` into `kt`, dimension-major
/// (dimension `d` of position `tile + l` at `d · KV_TILE + l`): eight positions by
/// eight dimensions at a time where the CPU has AVX2 (`avx2`), else one value at a
/// time. Only moves values.
#[inline(always)]
fn transpose_keys(rows: &Rows<'_>, tile: usize, n: usize, hd: usize, avx2: bool, kt: &mut [f32]) {
    let mut l0 = 0;
    #[cfg(not(target_arch = "x86_64"))]
    let _ = avx2;
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(8) && avx2 {
        while l0 + 8 <= n {
            let keys: [&[f32]; 8] = std::array::from_fn(|j| rows.key(tile + l0 + j, hd));
            for d0 in (0..hd).step_by(8) {
                // SAFETY: AVX2 is present (`avx2`); every key holds `hd` values
                // and `kt` holds `hd` rows of KV_TILE, so the eight reads of eight
                // values at `d0` and the eight writes of eight at `l0` are in bounds.
                unsafe { transpose8(&keys, d0, &mut kt[d0 * KV_TILE + l0..]) };
            }
            l0 += 8;
        }
    }
    for l in l0..n {
        for (d, &k) in rows.key(tile + l, hd).iter().enumerate() {
            kt[d * KV_TILE + l] = k;
        }
    }
}

/// Values `d0 .. d0 + 8` of eight keys, transposed: value `d0 + j` of key `i` to
/// `out[j · KV_TILE + i]`.
///
/// # Safety
/// The CPU must support AVX2; each key must hold `d0 + 8` values, `out` at least
/// `7 · KV_TILE + 8`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose8(keys: &[&[f32]; 8], d0: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    debug_assert!(out.len() >= 7 * KV_TILE + 8 && keys.iter().all(|k| k.len() >= d0 + 8));
    // SAFETY: in bounds per the contract.
    let r: [__m256; 8] =
        std::array::from_fn(|i| unsafe { _mm256_loadu_ps(keys[i].as_ptr().add(d0)) });
    let t = [
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    ];
    let u = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    let c = [
        _mm256_permute2f128_ps::<0x20>(u[0], u[4]),
        _mm256_permute2f128_ps::<0x20>(u[1], u[5]),
        _mm256_permute2f128_ps::<0x20>(u[2], u[6]),
        _mm256_permute2f128_ps::<0x20>(u[3], u[7]),
        _mm256_permute2f128_ps::<0x31>(u[0], u[4]),
        _mm256_permute2f128_ps::<0x31>(u[1], u[5]),
        _mm256_permute2f128_ps::<0x31>(u[2], u[6]),
        _mm256_permute2f128_ps::<0x31>(u[3], u[7]),
    ];
    for (j, c) in c.into_iter().enumerate() {
        // SAFETY: in bounds per the contract.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(j * KV_TILE), c) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::AttentionMethod;
    use super::super::{tiled, FlashContext, Scratch};
    use super::*;
    use crate::ops::round_f16;

    /// Values in [-2, 2) from xorshift64 with 24 significant bits.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 22) as f32 - 2.0
            })
            .collect()
    }

    /// [`values`] rounded to f16, as a cache holds them.
    fn cached(n: usize, seed: u64) -> Vec<f32> {
        values(n, seed).into_iter().map(round_f16).collect()
    }

    /// The blocks of [`tiled_blocks`] against [`tiled`](super::super::tiled) query by
    /// query, bit for bit: groups of 1, 2, 3, 4 and 8 heads, a window, a soft cap, sinks,
    /// a batch that starts past position 0 and ends inside a block.
    #[test]
    fn query_blocks_give_the_one_query_kernels_bits() {
        let cases = [
            // (heads, kv heads, head dim, value dim, first position, tokens, window,
            // cap, sinks)
            (4, 1, 256, 256, 0, 100, None, None, false),
            (9, 3, 64, 64, 37, 130, None, None, false),
            (8, 4, 32, 48, 5, 64, Some(40), Some(30.0), true),
            (2, 2, 16, 16, 200, 77, Some(100), None, true),
            // Eight heads a key head, and value rows past the last whole chunk.
            (8, 1, 32, 40, 3, 40, None, None, false),
        ];
        for (n, &(nh, nkv, hd, hdv, first_pos, n_tokens, window, softcap, sinks)) in
            cases.iter().enumerate()
        {
            let positions = first_pos + n_tokens;
            let q = values(n_tokens * nh * hd, 1 + n as u64);
            let keys = cached(positions * nkv * hd, 100 + n as u64);
            let vals = cached(positions * nkv * hdv, 200 + n as u64);
            let sink_logits = values(nh, 300 + n as u64);
            let shape = AttentionShape {
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                head_dim_v: hdv,
                first_pos,
                window,
                scale: 1.0 / (hd as f32).sqrt(),
                softcap,
                sinks: sinks.then_some(&sink_logits[..]),
                method: AttentionMethod::Flash,
                flash: FlashContext {
                    context: positions,
                    threads: 2,
                },
            };
            let mut blocks = vec![0.0f32; n_tokens * nh * hdv];
            let fma = crate::ops::has_fma();
            let layout = Layout::Contiguous;
            let batch = Batch {
                q: &q,
                keys: &keys,
                values: &vals,
                shape: &shape,
                layout,
            };
            tiled_blocks(&batch, n_tokens, fma, &mut blocks);
            let mut s = Scratch::default();
            for t in 0..n_tokens {
                for h in 0..nh {
                    let kvh = h / (nh / nkv);
                    let rows = Rows::of_kv_head(&keys, &vals, layout, &shape, kvh);
                    let pos = first_pos + t;
                    let start = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    let sink = shape.sinks.map(|s| s[h]);
                    let mut one = vec![0.0f32; hdv];
                    let qh = &q[(t * nh + h) * hd..][..hd];
                    tiled(qh, rows, &shape, start, pos, sink, &mut s, &mut one);
                    let got = &blocks[(t * nh + h) * hdv..][..hdv];
                    for (d, (a, b)) in one.iter().zip(got).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "case {n}, token {t}, head {h}, dimension {d}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}
