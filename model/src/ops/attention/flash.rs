//! Flash attention computed the way llama.cpp's CPU backend computes it (`-fa on`, which
//! its default, `-fa auto`, turns on for the CPU).
//!
//! Flash attention never forms the probability matrix: each query keeps a running
//! maximum `M`, a running sum `S` and an output accumulator, rescaled whenever a larger
//! score arrives. ggml has three kernels for it, chosen by the shape of the call, and each
//! rounds differently, so each is reproduced here:
//!
//! - **one position at a time** (batches of fewer than [`Q_TILE`] queries): the query is
//!   rounded to f16 and each score is ggml's f16 dot product
//!   ([`Lanes::Dot`](super::Lanes)); `exp` is the C library's `expf`; the
//!   accumulator is f16, each step `acc = f16(fma(v, p, acc))` and a new maximum
//!   `acc = f16(acc · e^(M_old − M))`; `S = fma(S, ms, p)`; the output is
//!   `f32(acc) · (1/S)`.
//! - **tiles** (batches of [`Q_TILE`] queries or more): keys and values in tiles of
//!   [`KV_TILE`] cache positions from position 0; a score is one chain of fused
//!   multiply-adds over the head's dimensions with the query in f32; per tile the
//!   maximum, `exp` by ggml's vectorised polynomial ([`crate::ops::expf`]) summed per group of
//!   eight like its softmax, and `acc += p · v` as one chain per output element in f32.
//!   Tiles with no visible position are skipped.
//! - **split keys** (a single query whose view of the cache is at least
//!   [`SPLIT_MIN_KV`] positions): the view is cut into one chunk per thread, each chunk
//!   runs the first kernel without the final division, and the chunks' partial results
//!   are combined in order.
//!
//! A cache whose keys or values are quantized (`q8_0`, `q4_0`) takes none of these
//! three: ggml runs the first kernel over the whole view for every batch and view size
//! ([`head_mixed`]). Its query goes to the keys' dot product type (`Q8_0` blocks for
//! quantized keys, f16 otherwise) and each score is that type's dot product; quantized
//! value rows are decoded to f32 and accumulate in f32 (`acc = fma(v, p, acc)`, scaled
//! by `e^(M_old − M)` in f32), f16 ones as in the first kernel.
//!
//! The third kernel depends on two things outside the call: llama.cpp's view of the
//! cache (the positions used, rounded up to [`KV_PAD`], at most the context) and its
//! thread count. [`FlashContext`] carries them.

use dequant::matmul::rows::{dequantize_row, Q8Vector};

use super::{dot_f16_lanes, reduce8, AttentionShape, CacheRows, Layout};
use crate::ops::{expf, fma_round_f16, round_f16, scale_round_f16};

mod blocks;
mod values;

pub(super) use blocks::{tiled_blocks, Batch};
use values::tile_values;

/// Queries per tile; batches of at least this many take the tiled kernel.
pub const Q_TILE: usize = 64;
/// Cache positions per tile of the tiled kernel.
pub const KV_TILE: usize = 64;
/// A single query's view of at least this many positions is split across threads.
pub const SPLIT_MIN_KV: usize = 512;
/// llama.cpp's cache view grows in steps of this many positions.
pub const KV_PAD: usize = 256;

/// What the split-keys kernel needs to know of the engine around the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashContext {
    /// The context (KV cache) size in positions (`-c`): the view never exceeds it.
    pub context: usize,
    /// Threads the split kernel divides the view between (llama.cpp's `-t`).
    pub threads: usize,
}

impl FlashContext {
    /// llama.cpp's view of the cache when `used` positions are filled: the used
    /// positions rounded up to [`KV_PAD`], at most the context, which llama.cpp also
    /// rounds up to [`KV_PAD`].
    pub fn view(&self, used: usize) -> usize {
        let context = self.context.div_ceil(KV_PAD) * KV_PAD;
        context.min(KV_PAD.max(used.div_ceil(KV_PAD) * KV_PAD))
    }
}

/// Running state of one query: maximum, sum and the accumulator of the first kernel,
/// held at f16 precision (f16 values) or in f32 (quantized values).
struct Online<'s> {
    m: f32,
    s: f32,
    acc: &'s mut [f32],
    f16: bool,
}

impl<'s> Online<'s> {
    /// A query's state before any position: `acc` cleared to `dim` zeros.
    fn start(acc: &'s mut Vec<f32>, dim: usize, f16: bool) -> Online<'s> {
        acc.clear();
        acc.resize(dim, 0.0);
        Online {
            m: f32::NEG_INFINITY,
            s: 0.0,
            acc,
            f16,
        }
    }

    /// Adds cache position `j` with score `score` (already scaled and capped).
    #[inline(always)]
    fn push(&mut self, score: f32, v: &[f32]) {
        let (ms, vs) = if score > self.m {
            let ms = (self.m - score).exp();
            self.m = score;
            if self.f16 {
                scale_round_f16(self.acc, ms);
            } else {
                self.acc.iter_mut().for_each(|a| *a *= ms);
            }
            (ms, 1.0)
        } else {
            (1.0, (score - self.m).exp())
        };
        if self.f16 {
            fma_round_f16(self.acc, v, vs);
        } else {
            for (a, &x) in self.acc.iter_mut().zip(v) {
                *a = x.mul_add(vs, *a);
            }
        }
        self.s = self.s.mul_add(ms, vs);
    }
}

/// Adds an attention sink's logit `sink` to a query's running maximum `m`, sum and
/// f32 accumulator, as ggml does after the scores: a sink above the maximum rescales
/// the accumulator and becomes the maximum, else it adds its exponential to the sum.
#[inline(always)]
fn add_sink(sink: f32, m: &mut f32, sum: &mut f32, acc: &mut [f32]) {
    let (ms, vs) = if sink > *m {
        let ms = (*m - sink).exp();
        *m = sink;
        for a in acc.iter_mut() {
            *a *= ms;
        }
        (ms, 1.0)
    } else {
        (1.0, (sink - *m).exp())
    };
    *sum = sum.mul_add(ms, vs);
}

/// The scaled (and, with a cap, soft-capped) score of a raw dot product.
#[inline(always)]
fn score(shape: &AttentionShape, dot: f32) -> f32 {
    match shape.softcap {
        None => dot * shape.scale,
        Some(cap) => cap * (dot * (shape.scale / cap)).tanh(),
    }
}

/// Scratch of one (token, head) pair.
#[derive(Default)]
pub(super) struct Scratch {
    q: Vec<f32>,
    acc: Vec<f32>,
    part: Vec<f32>,
    scores: Vec<f32>,
}

/// Where one (token, head) pair reads its cache rows.
#[derive(Clone, Copy)]
pub(super) struct Rows<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub layout: Layout<'a>,
    pub k_off: usize,
    pub v_off: usize,
    pub k_stride: usize,
    pub v_stride: usize,
}

impl<'a> Rows<'a> {
    /// Key head `kvh`'s rows of an f16 cache's `keys` and `values`, heads side by side.
    pub(super) fn of_kv_head(
        keys: &'a [f32],
        values: &'a [f32],
        layout: Layout<'a>,
        shape: &AttentionShape,
        kvh: usize,
    ) -> Rows<'a> {
        let (hd, hdv, n_kv) = (shape.head_dim, shape.head_dim_v, shape.n_kv_heads);
        Rows {
            keys,
            values,
            layout,
            k_off: kvh * hd,
            v_off: kvh * hdv,
            k_stride: n_kv * hd,
            v_stride: n_kv * hdv,
        }
    }

    #[inline(always)]
    fn key(&self, j: usize, hd: usize) -> &[f32] {
        &self.keys[self.layout.row(j) * self.k_stride + self.k_off..][..hd]
    }
    #[inline(always)]
    fn value(&self, j: usize, hdv: usize) -> &[f32] {
        &self.values[self.layout.row(j) * self.v_stride + self.v_off..][..hdv]
    }
}

/// Flash attention of one query over the visible cache positions `start..=pos`, into
/// `o`, with the query head's attention sink if it has one. `n_tokens` is the call's
/// batch, which picks the kernel.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn head(
    qh: &[f32],
    rows: Rows<'_>,
    shape: &AttentionShape,
    n_tokens: usize,
    start: usize,
    pos: usize,
    sink: Option<f32>,
    s: &mut Scratch,
    o: &mut [f32],
) {
    if n_tokens >= Q_TILE {
        tiled(qh, rows, shape, start, pos, sink, s, o);
        return;
    }
    let (range, used) = rows.layout.walk(start, pos);
    let view = shape.flash.view(used);
    if n_tokens == 1 && view >= SPLIT_MIN_KV {
        split(qh, rows, shape, view, start, pos, sink, s, o);
        return;
    }
    let (mut m, mut sum) = one_chunk(qh, rows, shape, range, (start, pos), s);
    if let Some(sink) = sink {
        add_sink(sink, &mut m, &mut sum, &mut s.acc);
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for (o, &a) in o.iter_mut().zip(&s.acc) {
        *o = a * inv;
    }
}

/// The first kernel over cache positions (or cells) `range`, those a query at
/// `seen.1` sees from `seen.0` only, leaving the unnormalised accumulator in `s.acc`;
/// returns `(M, S)`.
#[inline(always)]
fn one_chunk(
    qh: &[f32],
    rows: Rows<'_>,
    shape: &AttentionShape,
    range: std::ops::Range<usize>,
    seen: (usize, usize),
    s: &mut Scratch,
) -> (f32, f32) {
    let (hd, hdv) = (shape.head_dim, shape.head_dim_v);
    s.q.clear();
    s.q.extend(qh.iter().map(|&v| round_f16(v)));
    let mut state = Online::start(&mut s.acc, hdv, true);
    for j in range {
        if !rows.layout.sees(j, seen.0, seen.1) {
            continue;
        }
        let sc = score(shape, dot_f16_lanes(&s.q, rows.key(j, hd)));
        state.push(sc, rows.value(j, hdv));
    }
    (state.m, state.s)
}

/// The split-keys kernel: `view` positions cut into one chunk per thread. The sink
/// joins the first chunk, even one with no visible position.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn split(
    qh: &[f32],
    rows: Rows<'_>,
    shape: &AttentionShape,
    view: usize,
    start: usize,
    pos: usize,
    sink: Option<f32>,
    s: &mut Scratch,
    o: &mut [f32],
) {
    let hdv = shape.head_dim_v;
    let threads = shape.flash.threads.max(1);
    let chunk = view.div_ceil(threads);
    let (mut m_final, mut s_final) = (f32::NEG_INFINITY, 0.0f32);
    let mut fin = std::mem::take(&mut s.part);
    fin.clear();
    fin.resize(hdv, 0.0);
    // Positions are clipped to the visible ones; cells are looked at one by one.
    let walked = rows.layout.walk(start, pos).0;
    for c in 0..threads {
        let (lo, hi) = (c * chunk, ((c + 1) * chunk).min(view));
        let (lo, hi) = (lo.max(walked.start), hi.min(walked.end));
        let sink = sink.filter(|_| c == 0);
        if lo >= hi && sink.is_none() {
            continue;
        }
        let range = lo..hi.max(lo);
        let (mut m_chunk, mut s_chunk) = one_chunk(qh, rows, shape, range, (start, pos), s);
        if let Some(sink) = sink {
            add_sink(sink, &mut m_chunk, &mut s_chunk, &mut s.acc);
        }
        if s_chunk == 0.0 {
            continue;
        }
        let m_new = m_final.max(m_chunk);
        let scale_old = (m_final - m_new).exp();
        let scale_new = (m_chunk - m_new).exp();
        for (f, &a) in fin.iter_mut().zip(&s.acc) {
            *f = f.mul_add(scale_old, a * scale_new);
        }
        s_final = s_final.mul_add(scale_old, s_chunk * scale_new);
        m_final = m_new;
    }
    let inv = if s_final != 0.0 { 1.0 / s_final } else { 1.0 };
    for (o, &f) in o.iter_mut().zip(&fin) {
        *o = f * inv;
    }
    s.part = fin;
}

/// The tiled kernel for one query row.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tiled(
    qh: &[f32],
    rows: Rows<'_>,
    shape: &AttentionShape,
    start: usize,
    pos: usize,
    sink: Option<f32>,
    s: &mut Scratch,
    o: &mut [f32],
) {
    let (hd, hdv) = (shape.head_dim, shape.head_dim_v);
    s.acc.clear();
    s.acc.resize(hdv, 0.0);
    let mut state = (f32::NEG_INFINITY, 0.0f32);
    let mut tile = start / KV_TILE * KV_TILE;
    while tile <= pos {
        let visible = tile.max(start)..(tile + KV_TILE).min(pos + 1);
        // Scores of the visible positions; the others are −∞.
        s.scores.clear();
        s.scores.resize(KV_TILE, f32::NEG_INFINITY);
        tile_dots(
            qh,
            rows,
            hd,
            visible.clone(),
            &mut s.scores[visible.start - tile..],
        );
        tile_softmax(
            shape,
            tile,
            visible.clone(),
            &mut s.scores,
            &mut state,
            &mut s.acc,
        );
        tile_values(rows, hdv, tile, visible, &s.scores, &mut s.acc);
        tile += KV_TILE;
    }
    tiled_output(state, sink, &mut s.acc, o);
}

/// One tile of the tiled kernel after its scores, but for its values: `scores` holds
/// the tile's [`KV_TILE`] raw dot products (−∞ outside `visible`) and becomes the
/// positions' weights; the query's running maximum and sum (`state`) take the tile in,
/// and its accumulator `acc` is rescaled for it. [`tile_values`] then adds the values.
#[inline(always)]
fn tile_softmax(
    shape: &AttentionShape,
    tile: usize,
    visible: std::ops::Range<usize>,
    scores: &mut [f32],
    state: &mut (f32, f32),
    acc: &mut [f32],
) {
    let (m, sum) = state;
    let scale = match shape.softcap {
        None => shape.scale,
        Some(cap) => shape.scale / cap,
    };
    for sc in &mut scores[visible.start - tile..visible.end - tile] {
        *sc *= scale;
        if let Some(cap) = shape.softcap {
            *sc = sc.tanh() * cap;
        }
    }
    let tile_max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let m_new = m.max(tile_max);
    if m_new > *m {
        let ms = (*m - m_new).exp();
        for a in acc.iter_mut() {
            *a *= ms;
        }
        *sum *= ms;
    }
    *m = m_new;
    // ggml's softmax: exp per lane, each group of eight reduced and added in f64.
    let mut total = 0.0f64;
    for group in scores.chunks_exact_mut(8) {
        for e in group.iter_mut() {
            *e = expf(*e - m_new);
        }
        let lanes: &[f32; 8] = (&*group).try_into().expect("eight lanes");
        total += f64::from(reduce8(lanes));
    }
    *sum = (f64::from(*sum) + total) as f32;
}

/// The tiled kernel's output from a query's final maximum and sum (`state`) and its
/// accumulator, the sink joining first.
#[inline(always)]
fn tiled_output(state: (f32, f32), sink: Option<f32>, acc: &mut [f32], o: &mut [f32]) {
    let (mut m, mut sum) = state;
    if let Some(sink) = sink {
        // ggml leaves the maximum as it was here; nothing reads it after.
        add_sink(sink, &mut m, &mut sum, acc);
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for (o, &a) in o.iter_mut().zip(acc.iter()) {
        *o = a * inv;
    }
}

/// Positions scored together by [`tile_dots`].
const DOTS_AT_ONCE: usize = 8;

/// `out[i]` = the query's dot product with the key of position `positions.start + i`,
/// each one chain of fused multiply-adds over the head's dimensions in order (ggml's
/// tiled kernel's score). A chain waits for its previous step, so the chains of
/// [`DOTS_AT_ONCE`] positions advance side by side: the same steps in the same order for
/// each score, several in flight at once.
#[inline(always)]
fn tile_dots(
    qh: &[f32],
    rows: Rows<'_>,
    hd: usize,
    positions: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let qh = &qh[..hd];
    let mut j = positions.start;
    while j + DOTS_AT_ONCE <= positions.end {
        let k = |l: usize| rows.key(j + l, hd).iter();
        let mut a = [0.0f32; DOTS_AT_ONCE];
        // Zipped, not indexed: no bounds check between the steps.
        let steps = qh.iter().zip(k(0)).zip(k(1)).zip(k(2)).zip(k(3));
        let steps = steps.zip(k(4)).zip(k(5)).zip(k(6)).zip(k(7));
        for ((((((((&q, &k0), &k1), &k2), &k3), &k4), &k5), &k6), &k7) in steps {
            a[0] = k0.mul_add(q, a[0]);
            a[1] = k1.mul_add(q, a[1]);
            a[2] = k2.mul_add(q, a[2]);
            a[3] = k3.mul_add(q, a[3]);
            a[4] = k4.mul_add(q, a[4]);
            a[5] = k5.mul_add(q, a[5]);
            a[6] = k6.mul_add(q, a[6]);
            a[7] = k7.mul_add(q, a[7]);
        }
        out[j - positions.start..][..DOTS_AT_ONCE].copy_from_slice(&a);
        j += DOTS_AT_ONCE;
    }
    for j in j..positions.end {
        let mut acc = 0.0f32;
        for (&k, &q) in rows.key(j, hd).iter().zip(qh) {
            acc = k.mul_add(q, acc);
        }
        out[j - positions.start] = acc;
    }
}

/// Where one (token, head) pair reads its cache rows when either keys or values are
/// quantized.
#[derive(Clone, Copy)]
pub(super) struct MixedRows<'a> {
    pub keys: CacheRows<'a>,
    pub values: CacheRows<'a>,
    pub layout: Layout<'a>,
    /// The key/value head the query head reads.
    pub kvh: usize,
}

impl<'a> MixedRows<'a> {
    /// Head `kvh`'s part of cache position `j` in `rows`, whose heads hold `dim` values
    /// each: `(Some(floats), None)` for f16 rows, `(None, Some(blocks))` for quantized.
    #[inline(always)]
    fn part(
        rows: CacheRows<'a>,
        layout: Layout<'_>,
        j: usize,
        kvh: usize,
        dim: usize,
        n_kv_heads: usize,
    ) -> (Option<&'a [f32]>, Option<&'a [u8]>) {
        let row = layout.row(j);
        match rows {
            CacheRows::F16(f) => {
                let stride = n_kv_heads * dim;
                (Some(&f[row * stride + kvh * dim..][..dim]), None)
            }
            CacheRows::Quant {
                bytes, row_bytes, ..
            } => {
                let head = row_bytes / n_kv_heads;
                (None, Some(&bytes[row * row_bytes + kvh * head..][..head]))
            }
        }
    }
}

/// Flash attention of one query over positions `start..=pos` of a cache whose keys or
/// values (or both) are quantized, into `o`, as ggml's first kernel computes it (the
/// module documentation says how).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn head_mixed(
    qh: &[f32],
    rows: MixedRows<'_>,
    shape: &AttentionShape,
    start: usize,
    pos: usize,
    sink: Option<f32>,
    s: &mut Scratch,
    o: &mut [f32],
) {
    let (hd, hdv, nkv) = (shape.head_dim, shape.head_dim_v, shape.n_kv_heads);
    // The query in the keys' dot product type. Head sizes are whole blocks: the cache
    // refuses others when it is made.
    let q8 = match rows.keys {
        CacheRows::Quant { .. } => Q8Vector::new(qh).ok(),
        CacheRows::F16(_) => {
            s.q.clear();
            s.q.extend(qh.iter().map(|&v| round_f16(v)));
            None
        }
    };
    let f16_values = matches!(rows.values, CacheRows::F16(_));
    s.part.clear();
    s.part.resize(hdv, 0.0);
    let mut state = Online::start(&mut s.acc, hdv, f16_values);
    for j in rows.layout.walk(start, pos).0 {
        if !rows.layout.sees(j, start, pos) {
            continue;
        }
        let dot = match MixedRows::part(rows.keys, rows.layout, j, rows.kvh, hd, nkv) {
            (Some(k), _) => dot_f16_lanes(&s.q, k),
            (None, Some(blocks)) => match (rows.keys, &q8) {
                (CacheRows::Quant { ty, .. }, Some(q8)) => q8.dot(ty, blocks).unwrap_or(f32::NAN),
                _ => f32::NAN,
            },
            (None, None) => f32::NAN,
        };
        let sc = score(shape, dot);
        let v: &[f32] = match MixedRows::part(rows.values, rows.layout, j, rows.kvh, hdv, nkv) {
            (Some(v), _) => v,
            (None, Some(blocks)) => {
                if let CacheRows::Quant { ty, .. } = rows.values {
                    if dequantize_row(ty, blocks, &mut s.part).is_err() {
                        s.part.fill(f32::NAN);
                    }
                }
                &s.part
            }
            (None, None) => &s.part,
        };
        state.push(sc, v);
    }
    let (mut m, mut sum) = (state.m, state.s);
    if let Some(sink) = sink {
        add_sink(sink, &mut m, &mut sum, &mut s.acc);
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for (o, &a) in o.iter_mut().zip(&s.acc) {
        *o = a * inv;
    }
}
