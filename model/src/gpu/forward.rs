//! The layer's work on the GPU, queued on a stream: the buffers it runs in and the
//! sequence of kernels, the same for a captured decode step and for a prompt's chunks.

use std::sync::atomic::AtomicBool;

use dequant::gpu::matmul;
use dequant::gpu::matvec::{self, q8_bytes, takes_q8, GpuActivations, GpuMatrix};
use gguf_format::GgmlType;
use half::f16;
use hip_backend::{ArenaBuffer, Device, DeviceView, DeviceViewMut, HipError, PinnedBuffer, Stream};

use super::kernels::{self, attention_chunk, AttentionShape, HeadExtras, HeadShape, Pages};
use super::weights::{FfnWeights, Globals, LayerWeights, Matrix};
use super::{arena, MAX_BATCH};
use crate::config::{Activation, ModelConfig, RopeStyle};
use crate::plan::ExecutionPlan;
use crate::ModelError;

mod experts;

fn gpu(op: &'static str) -> impl Fn(HipError) -> ModelError {
    move |source| ModelError::Gpu { op, source }
}

/// Alignment of every buffer in the arena.
const ALIGN: usize = 256;

/// The batch products' input: per-token scales (the first `scales_bytes`), then the
/// tokens' activations divided by them, in f16; and the room their products split
/// their columns in (partial sums, and tile counters that hold zeros between products).
pub(super) struct BatchInput {
    buf: ArenaBuffer,
    scales_bytes: usize,
    partials: ArenaBuffer,
    counters: ArenaBuffer,
    /// Whether the device runs the skinny batch products
    /// ([`matmul::skinny_available`]).
    skinny: bool,
}

impl BatchInput {
    /// Whether the products of `m` on `n` tokens take the batch products ([`matmul`],
    /// f32 input) rather than the decode products (Q8 blocks for quantized weights): past
    /// [`MAX_BATCH`] tokens always; from [`SKINNY_FROM`] tokens where the device runs the
    /// skinny products, they take the type (`matmul::skinny_prefers`) and the matrix holds
    /// at least [`SKINNY_MIN_BYTES`], where they are faster (ARCHITECTURE.md says by how
    /// much).
    fn takes(&self, m: &Matrix, n: usize) -> bool {
        batched(n)
            || (self.skinny
                && n >= SKINNY_FROM
                && matmul::skinny_prefers(m.ty)
                && m.byte_len() >= SKINNY_MIN_BYTES)
    }

    /// The batch products' input for `n` tokens of `input` (f32, the width of `mats`):
    /// the f16 activations and their per-token scales ([`matmul::row_scales`]), with the
    /// room to split the products.
    fn prepare(
        &mut self,
        input: DeviceView<'_, f32>,
        n: usize,
        mats: &[&Matrix],
        stream: &Stream,
    ) -> Result<
        (
            DeviceView<'_, f16>,
            DeviceView<'_, f32>,
            matmul::SplitScratch<'_>,
        ),
        ModelError,
    > {
        let (split, cols) = (self.scales_bytes, mats[0].cols);
        let cut = gpu("viewing the batch input");
        let whole = self.buf.view_mut::<u8>().map_err(&cut)?;
        let (s, x16) = whole.split_at_mut(split).map_err(&cut)?;
        let s = s
            .cast_mut::<f32>()
            .and_then(|v| v.slice_mut(0..n))
            .map_err(&cut)?;
        let x16 = x16
            .cast_mut::<f16>()
            .and_then(|v| v.slice_mut(0..n * cols))
            .map_err(&cut)?;
        matmul::row_scales(input, n, cols, s, x16, stream).map_err(matvec_error(mats))?;
        let whole = self.buf.view::<u8>().map_err(&cut)?;
        let s = whole
            .slice(0..split)
            .and_then(|v| v.cast::<f32>())
            .and_then(|v| v.slice(0..n))
            .map_err(&cut)?;
        let x16 = whole
            .slice(split..split + 2 * n * cols)
            .and_then(|v| v.cast::<f16>())
            .map_err(&cut)?;
        let room = matmul::SplitScratch {
            partials: view_mut::<f32>(&mut self.partials, matmul::SPLIT_PARTIALS)?,
            counters: view_mut::<u32>(&mut self.counters, matmul::SPLIT_COUNTERS)?,
        };
        Ok((x16, s, room))
    }
}

/// How many sequences a paged batch holds at most, and the cache's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PageShape {
    /// Blocks of the cache (its rows: `n_blocks << block_shift`).
    pub n_blocks: usize,
    /// log2 of the positions per block.
    pub block_shift: u32,
    /// Most sequences (and rows of logits) in one batch.
    pub max_sequences: usize,
    /// Most blocks of one sequence's table.
    pub table_len: usize,
}

impl PageShape {
    /// The i32 values of a batch's layout: positions and table starts of every token,
    /// the rows that get logits, and every sequence's table.
    pub fn meta_len(&self, batch: usize) -> usize {
        2 * batch + self.max_sequences + self.max_sequences * self.table_len
    }
}

/// One sequence's rows of a paged batch.
#[derive(Clone, Copy, Debug)]
pub(super) struct PagedSegment {
    /// Its first row among the batch's tokens, and how many.
    pub first_row: usize,
    pub len: usize,
    /// Where its block table starts among the batch's tables, and its length.
    pub table_at: usize,
    pub table_len: usize,
}

/// A batch of tokens of several sequences, as laid out in `Buffers::meta`:
/// `[positions (n) | table starts (n) | logit rows (m) | tables]`.
#[derive(Clone, Debug)]
pub(super) struct PagedBatch {
    pub segments: Vec<PagedSegment>,
    pub n_tokens: usize,
    pub n_logits: usize,
    pub block_shift: u32,
}

impl PagedBatch {
    fn tables_at(&self) -> usize {
        2 * self.n_tokens + self.n_logits
    }
}

/// How the tokens of a forward pass find their positions and their keys and values.
#[derive(Clone, Copy)]
pub(super) enum Layout<'a> {
    /// One sequence: tokens at positions `pos[0]..`, its cache rows in position order.
    Contiguous,
    /// Several sequences in the cache's blocks, as `Buffers::meta` lays them out.
    Paged(&'a PagedBatch),
}

/// The paged layout of rows `rows` of `batch`, viewed in `meta`.
fn pages<'a>(
    meta: &'a ArenaBuffer,
    batch: &PagedBatch,
    rows: std::ops::Range<usize>,
) -> Result<Pages<'a>, ModelError> {
    let n = batch.n_tokens;
    let tables_at = batch.tables_at();
    let tables_end = batch
        .segments
        .iter()
        .map(|s| s.table_at + s.table_len)
        .max()
        .unwrap_or(0);
    Ok(Pages {
        positions: view_at::<i32>(meta, rows.clone())?,
        table_start: view_at::<i32>(meta, n + rows.start..n + rows.end)?,
        tables: view_at::<i32>(meta, tables_at..tables_at + tables_end.max(1))?,
        block_shift: batch.block_shift,
    })
}

/// The activations of a prompt's chunk (and the Q8 blocks and logits of up to
/// [`MAX_BATCH`] tokens, or of a paged batch's sequences), the position counter and the
/// f16 KV cache, all carved from one arena allocated once.
pub(super) struct Buffers {
    x: ArenaBuffer,
    h: ArenaBuffer,
    q8: ArenaBuffer,
    q: ArenaBuffer,
    k: ArenaBuffer,
    v: ArenaBuffer,
    attn: ArenaBuffer,
    proj: ArenaBuffer,
    gate: ArenaBuffer,
    up: ArenaBuffer,
    act: ArenaBuffer,
    logits: ArenaBuffer,
    part_ml: ArenaBuffer,
    part_acc: ArenaBuffer,
    /// The attention's counters of finished chunks: zero between launches.
    done: ArenaBuffer,
    /// The batch products' input.
    batch_in: BatchInput,
    raw: ArenaBuffer,
    tokens: ArenaBuffer,
    pos: ArenaBuffer,
    bad: ArenaBuffer,
    /// A paged batch's layout (`PagedBatch`); empty without pages.
    meta: ArenaBuffer,
    k_cache: Vec<ArenaBuffer>,
    v_cache: Vec<ArenaBuffer>,
    attention: AttentionShape,
    row_bytes: usize,
    /// Most queries of one launch of the split attention (its scratch's rows).
    attn_rows: usize,
    /// Most rows of logits.
    logit_rows: usize,
    /// Whether a prompt's attention may take the matrix units (`GpuTuning::flash_mma`).
    flash_mma: bool,
    /// The experts' room, for a model with a mixture of experts.
    moe: Option<experts::MoeBuffers>,
}

impl Buffers {
    pub fn new(
        device: &Device,
        config: &ModelConfig,
        plan: &ExecutionPlan,
        capacity: usize,
        batch: usize,
        paged: Option<&PageShape>,
        flash_mma: bool,
    ) -> Result<Buffers, ModelError> {
        // Activations for a prompt's chunk of `batch` tokens; Q8 blocks for the few
        // tokens of the decode products; logits and the split attention's scratch for
        // those, or for one token of each sequence of a paged batch.
        let (b, w) = (batch.max(MAX_BATCH), MAX_BATCH);
        let rows = paged.map_or(w, |p| p.max_sequences.max(w));
        let c = config;
        let q_dim = c.n_heads * c.head_dim;
        let kv_dim = c.n_kv_heads * c.head_dim;
        let v_dim = c.n_kv_heads * c.head_dim_v;
        let attn_dim = c.n_heads * c.head_dim_v;
        let chunk = attention_chunk(capacity);
        let n_chunks = capacity.div_ceil(chunk);
        let attention = AttentionShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            head_dim_v: c.head_dim_v,
            window: None,
            scale: if c.scale_queries {
                1.0
            } else {
                c.attention_scale
            },
            softcap: c.attn_logit_softcap,
            n_chunks,
            chunk,
        };
        let embd_ty = plan.token_embd.weight.ggml_type();
        let row_bytes = embd_ty.row_bytes(c.n_embd as u64).unwrap_or(0) as usize;
        // The dense feed-forward's width, or the shared expert's.
        let n_ff = c
            .n_ff
            .max(c.experts.and_then(|e| e.shared_n_ff).unwrap_or(0));
        let width = c.n_embd.max(attn_dim).max(n_ff);
        let scales_bytes = (4 * b).div_ceil(ALIGN) * ALIGN;
        // Positions the cache keeps: whole chunks of the attention kernel, and every
        // block of a paged cache.
        let positions = attention
            .positions()
            .max(paged.map_or(0, |p| p.n_blocks << p.block_shift));
        let f32s = |n: usize| n * 4;
        let sizes = [
            f32s(b * c.n_embd),                     // x
            f32s(b * c.n_embd),                     // h
            q8_bytes(w, width.div_ceil(32) * 32),   // q8
            f32s(b * q_dim),                        // q
            f32s(b * kv_dim),                       // k
            f32s(b * v_dim),                        // v
            f32s(b * attn_dim),                     // attn
            f32s(b * c.n_embd),                     // proj
            f32s(b * n_ff),                         // gate
            f32s(b * n_ff),                         // up
            f32s(b * n_ff),                         // act
            f32s(rows * c.n_vocab),                 // logits
            f32s(attention.ml_len(rows)),           // part_ml
            f32s(attention.acc_len(rows)),          // part_acc
            4 * attention.done_len(rows),           // done
            scales_bytes + 2 * b * width,           // scales, f16 input
            4 * matmul::SPLIT_PARTIALS,             // split partial sums
            4 * matmul::SPLIT_COUNTERS,             // split counters
            b * row_bytes,                          // raw embedding rows
            4 * b,                                  // tokens
            4,                                      // pos
            4,                                      // bad
            4 * paged.map_or(0, |p| p.meta_len(b)), // meta
        ];
        let moe_sizes = experts::MoeBuffers::sizes(c, b);
        let total = sizes
            .iter()
            .chain(moe_sizes.iter().flatten())
            .map(|&s| s.max(4).div_ceil(ALIGN) * ALIGN)
            .sum::<usize>()
            + c.n_layers * (2 * positions * kv_dim).div_ceil(ALIGN) * ALIGN
            + c.n_layers * (2 * positions * v_dim).div_ceil(ALIGN) * ALIGN;
        let arena = arena(device, total)?;
        let alloc = |bytes: usize| {
            arena
                .alloc(bytes.max(4), ALIGN)
                .map_err(gpu("carving the activation arena"))
        };
        let mut it = sizes.into_iter().chain(moe_sizes.into_iter().flatten());
        let mut next = || alloc(it.next().expect("one size per buffer"));
        let bufs = Buffers {
            x: next()?,
            h: next()?,
            q8: next()?,
            q: next()?,
            k: next()?,
            v: next()?,
            attn: next()?,
            proj: next()?,
            gate: next()?,
            up: next()?,
            act: next()?,
            logits: next()?,
            part_ml: next()?,
            part_acc: next()?,
            done: next()?,
            batch_in: BatchInput {
                buf: next()?,
                scales_bytes,
                partials: next()?,
                counters: next()?,
                skinny: matmul::skinny_available(device),
            },
            raw: next()?,
            tokens: next()?,
            pos: next()?,
            bad: next()?,
            meta: next()?,
            k_cache: (0..c.n_layers)
                .map(|_| alloc(2 * positions * kv_dim))
                .collect::<Result<_, _>>()?,
            v_cache: (0..c.n_layers)
                .map(|_| alloc(2 * positions * v_dim))
                .collect::<Result<_, _>>()?,
            attention,
            row_bytes,
            attn_rows: rows,
            logit_rows: rows,
            flash_mma,
            moe: moe_sizes
                .is_some()
                .then(|| experts::MoeBuffers::new(&mut next))
                .transpose()?,
        };
        // The arena's buffers free their ranges when dropped; the allocation itself
        // lives as long as any of them.
        drop(arena);
        Ok(bufs)
    }

    /// Bytes of one embedding row, in the table's blocks.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Room for `n` embedding rows in the table's blocks.
    pub fn raw_rows_mut(&mut self, n: usize) -> Result<DeviceViewMut<'_, u8>, ModelError> {
        view_mut(&mut self.raw, n * self.row_bytes)
    }

    pub fn tokens_mut(&mut self, n: usize) -> Result<DeviceViewMut<'_, u32>, ModelError> {
        view_mut::<u32>(&mut self.tokens, n)
    }

    pub fn logits_mut(&mut self, len: usize) -> Result<DeviceViewMut<'_, f32>, ModelError> {
        view_mut::<f32>(&mut self.logits, len)
    }

    pub fn logits_view(&self, len: usize) -> Result<DeviceView<'_, f32>, ModelError> {
        view::<f32>(&self.logits, len)
    }

    pub fn tokens_view(&self, n: usize) -> Result<DeviceView<'_, u32>, ModelError> {
        view::<u32>(&self.tokens, n)
    }

    pub fn meta_mut(&mut self, len: usize) -> Result<DeviceViewMut<'_, i32>, ModelError> {
        view_mut::<i32>(&mut self.meta, len)
    }

    /// The residual stream: `len` values from the first token's.
    pub fn x_view(&self, len: usize) -> Result<DeviceView<'_, f32>, ModelError> {
        view::<f32>(&self.x, len)
    }

    pub fn x_mut(&mut self, len: usize) -> Result<DeviceViewMut<'_, f32>, ModelError> {
        view_mut::<f32>(&mut self.x, len)
    }

    /// The position counter of the contiguous layout.
    pub fn pos_mut(&mut self) -> Result<DeviceViewMut<'_, i32>, ModelError> {
        view_mut::<i32>(&mut self.pos, 1)
    }

    /// Values per position of a layer's cached keys, and of its values.
    pub fn kv_dims(&self) -> (usize, usize) {
        let a = &self.attention;
        (a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim_v)
    }

    /// `layer`'s cached keys and values of `positions`, in the contiguous layout of one
    /// sequence (position `p`'s row at `p`).
    pub fn kv_view(
        &self,
        layer: usize,
        positions: std::ops::Range<usize>,
    ) -> Result<(DeviceView<'_, f16>, DeviceView<'_, f16>), ModelError> {
        let (kd, vd) = self.kv_dims();
        let (s, e) = (positions.start, positions.end);
        Ok((
            view_at::<f16>(&self.k_cache[layer], s * kd..e * kd)?,
            view_at::<f16>(&self.v_cache[layer], s * vd..e * vd)?,
        ))
    }

    /// As [`Buffers::kv_view`], to write.
    pub fn kv_mut(
        &mut self,
        layer: usize,
        positions: std::ops::Range<usize>,
    ) -> Result<(DeviceViewMut<'_, f16>, DeviceViewMut<'_, f16>), ModelError> {
        let (kd, vd) = self.kv_dims();
        let (s, e) = (positions.start, positions.end);
        Ok((
            view_mut_at::<f16>(&mut self.k_cache[layer], s * kd..e * kd)?,
            view_mut_at::<f16>(&mut self.v_cache[layer], s * vd..e * vd)?,
        ))
    }

    /// Most rows of logits one pass computes.
    pub fn logit_rows(&self) -> usize {
        self.logit_rows
    }

    /// Sets the position counter to `len` through `host` (page-locked, at least one
    /// element; queued, not waited for), and clears the attention's chunk counters and
    /// the split products' tile counters (which a failed launch may have left midway).
    pub fn set_position(
        &mut self,
        stream: &Stream,
        host: &mut PinnedBuffer<i32>,
        len: usize,
    ) -> Result<(), ModelError> {
        let value = i32::try_from(len).map_err(|_| ModelError::ContextFull {
            needed: len,
            capacity: i32::MAX as usize,
        })?;
        let counters = self.attention.done_len(self.attn_rows);
        stream
            .memset_async(view_mut::<u32>(&mut self.done, counters)?, 0)
            .map_err(gpu("clearing the attention counters"))?;
        stream
            .memset_async(
                view_mut::<u32>(&mut self.batch_in.counters, matmul::SPLIT_COUNTERS)?,
                0,
            )
            .map_err(gpu("clearing the products' counters"))?;
        let dst = view_mut::<i32>(&mut self.pos, 1)?;
        stream
            .write_staged(host, &[value], dst)
            .map_err(gpu("setting the position"))
    }
}

fn view<T: bytemuck::Pod>(buf: &ArenaBuffer, len: usize) -> Result<DeviceView<'_, T>, ModelError> {
    buf.view::<T>()
        .and_then(|v| v.slice(0..len))
        .map_err(gpu("viewing a buffer"))
}

fn view_at<T: bytemuck::Pod>(
    buf: &ArenaBuffer,
    range: std::ops::Range<usize>,
) -> Result<DeviceView<'_, T>, ModelError> {
    buf.view::<T>()
        .and_then(|v| v.slice(range))
        .map_err(gpu("viewing a buffer"))
}

fn view_mut<T: bytemuck::Pod>(
    buf: &mut ArenaBuffer,
    len: usize,
) -> Result<DeviceViewMut<'_, T>, ModelError> {
    view_mut_at(buf, 0..len)
}

fn view_mut_at<T: bytemuck::Pod>(
    buf: &mut ArenaBuffer,
    range: std::ops::Range<usize>,
) -> Result<DeviceViewMut<'_, T>, ModelError> {
    buf.view_mut::<T>()
        .and_then(|v| v.slice_mut(range))
        .map_err(gpu("viewing a buffer"))
}

fn gpu_matrix<'a>(m: &'a Matrix) -> Result<GpuMatrix<'a>, ModelError> {
    GpuMatrix::new(m.ty, m.rows, m.cols, m.bytes()?).map_err(|source| ModelError::Matmul {
        name: m.name().to_owned(),
        source,
    })
}

fn matvec_error<'a>(
    mats: &'a [&'a Matrix],
) -> impl Fn(dequant::gpu::GpuDequantError) -> ModelError + 'a {
    product_error("matrix product", move || {
        mats.iter()
            .map(|m| m.name())
            .collect::<Vec<_>>()
            .join(" + ")
    })
}

/// A product's failure as the model's error: a layout refused names the matrices
/// (`name()`), a runtime failure says it came during `op`.
pub(super) fn product_error<'a>(
    op: &'static str,
    name: impl Fn() -> String + 'a,
) -> impl Fn(dequant::gpu::GpuDequantError) -> ModelError + 'a {
    move |error| match error {
        dequant::gpu::GpuDequantError::Layout(source) => ModelError::Matmul {
            name: name(),
            source,
        },
        dequant::gpu::GpuDequantError::Hip(source) => ModelError::Gpu { op, source },
    }
}

/// Whether `n` tokens are a prompt's chunk (tiled attention, batch products for every
/// matrix) rather than a few tokens (split attention, decode products where
/// [`BatchInput::takes`] says so).
fn batched(n: usize) -> bool {
    n > MAX_BATCH
}

/// The fewest tokens whose products take the skinny batch products rather than the
/// decode products, for the types the skinny products take: at 2 tokens the decode
/// products are as fast or faster on every type measured, from 3 on the skinny ones are
/// faster (ARCHITECTURE.md, `dequant`).
const SKINNY_FROM: usize = 3;

/// The smallest matrix whose products of a few tokens take the skinny batch products:
/// their shortest launch takes 5.7-9 µs, where the decode products multiply a matrix of
/// about a megabyte (a SmolLM2-135M's) by 8 tokens in 2.7-4.5 µs (H200). A 135M's
/// output matrix (18 MB in Q4_1) is already faster in the skinny products from 3 tokens,
/// a 7B's (9 MB and more) from 3 as well.
const SKINNY_MIN_BYTES: usize = 4 << 20;

/// Whether the products of `m` on `n` tokens take Q8 blocks.
fn takes_q8_for(m: &Matrix, n: usize, batch_in: &BatchInput) -> bool {
    takes_q8(m.ty) && !batch_in.takes(m, n)
}

/// What the products of some matrices on `n` tokens need from a norm: f32 rows, Q8
/// blocks, or both.
fn needs(mats: &[&Matrix], n: usize, batch_in: &BatchInput) -> (bool, bool) {
    let q8 = mats.iter().any(|m| takes_q8_for(m, n, batch_in));
    let f32 = mats.iter().any(|m| !takes_q8_for(m, n, batch_in));
    (f32, q8)
}

/// The end of the run of matrices from `start` that share its type, its width and its
/// kind of product (`batch_of`) (at most three, what one product launch takes).
fn run_end(mats: &[&Matrix], batch_of: &[bool], start: usize) -> usize {
    let mut end = start + 1;
    while end < mats.len()
        && end - start < matvec::MAX_MATRICES
        && mats[end].ty == mats[start].ty
        && mats[end].cols == mats[start].cols
        && batch_of[end] == batch_of[start]
    {
        end += 1;
    }
    end
}

/// `outs[i] (+)= input · mats[i]ᵀ`, one launch per run of matrices of one type and width:
/// decode products for a few tokens, batch products for more. `f32_in`/`q8_in` hold the input in
/// the two forms (each present when some matrix takes it).
#[allow(clippy::too_many_arguments)]
fn products(
    mats: &[&Matrix],
    f32_in: Option<DeviceView<'_, f32>>,
    q8_in: Option<DeviceView<'_, u8>>,
    n: usize,
    outs: Vec<DeviceViewMut<'_, f32>>,
    accumulate: bool,
    batch_in: &mut BatchInput,
    stream: &Stream,
) -> Result<(), ModelError> {
    // For the batch products, the input once in f16 with its per-token scales, and the
    // room to split the products.
    let batch_of: Vec<bool> = mats.iter().map(|m| batch_in.takes(m, n)).collect();
    let mut batch_input = if batch_of.iter().any(|&b| b) {
        let input = f32_in.expect("f32 input prepared for the batch products");
        Some(batch_in.prepare(input, n, mats, stream)?)
    } else {
        None
    };
    // Runs of matrices of one type and width in one launch each.
    let mut outs = outs;
    let mut start = 0;
    while start < mats.len() {
        let end = run_end(mats, &batch_of, start);
        let group = &mats[start..end];
        let gms = group
            .iter()
            .map(|m| gpu_matrix(m))
            .collect::<Result<Vec<_>, _>>()?;
        let mut group_outs: Vec<DeviceViewMut<'_, f32>> = outs.drain(..end - start).collect();
        match batch_input.as_mut().filter(|_| batch_of[start]) {
            Some((x16, s, room)) => matmul::matmul(
                &gms,
                *x16,
                *s,
                n,
                &mut group_outs,
                accumulate,
                Some(room.reborrow()),
                stream,
            ),
            None => {
                let x = if takes_q8(group[0].ty) {
                    GpuActivations::Q8(q8_in.expect("Q8 input prepared for quantized weights"))
                } else {
                    GpuActivations::F32(f32_in.expect("f32 input prepared for float weights"))
                };
                matvec::matvec(&gms, x, n, &mut group_outs, accumulate, stream)
            }
        }
        .map_err(matvec_error(group))?;
        start = end;
    }
    Ok(())
}

/// The embedding rows of the `n` tokens in `bufs.tokens`, decoded into `x` (the
/// embeddings on the device: `globals.token_embd`).
pub(super) fn embed(
    config: &ModelConfig,
    globals: &Globals,
    bufs: &mut Buffers,
    n: usize,
    stream: &Stream,
) -> Result<(), ModelError> {
    let Some(table) = &globals.token_embd else {
        unreachable!("the embeddings are fetched for every pass that embeds on the device")
    };
    kernels::gather_rows(
        table.bytes()?,
        bufs.row_bytes,
        view::<u32>(&bufs.tokens, n)?,
        view_mut::<u8>(&mut bufs.raw, n * bufs.row_bytes)?,
        view_mut::<i32>(&mut bufs.bad, 1)?,
        stream,
    )?;
    decode_embeddings(config, table.ty, table.name(), bufs, n, stream)
}

/// The `n` embedding rows of the table `name` (of type `ty`) gathered in `bufs.raw`,
/// decoded into `x` and scaled as the model says.
pub(super) fn decode_embeddings(
    config: &ModelConfig,
    ty: GgmlType,
    name: &str,
    bufs: &mut Buffers,
    n: usize,
    stream: &Stream,
) -> Result<(), ModelError> {
    dequant::gpu::decode_f32(
        ty,
        view::<u8>(&bufs.raw, n * bufs.row_bytes)?,
        view_mut::<f32>(&mut bufs.x, n * config.n_embd)?,
        stream,
    )
    .map_err(|source| match source {
        dequant::gpu::GpuDequantError::Layout(source) => ModelError::Decode {
            name: name.to_owned(),
            source,
        },
        dequant::gpu::GpuDequantError::Hip(source) => ModelError::Gpu {
            op: "embedding",
            source,
        },
    })?;
    if config.embedding_scale != 1.0 {
        kernels::scale(
            view_mut::<f32>(&mut bufs.x, n * config.n_embd)?,
            config.embedding_scale,
            stream,
        )?;
    }
    Ok(())
}

/// One transformer block over the `n` tokens in `x`.
pub(super) fn layer(
    config: &ModelConfig,
    layer_idx: usize,
    w: &LayerWeights,
    bufs: &mut Buffers,
    n: usize,
    layout: Layout<'_>,
    stream: &Stream,
) -> Result<(), ModelError> {
    let c = config;
    let d = c.n_embd;
    let eps = c.rms_norm_eps;
    let q_dim = c.n_heads * c.head_dim;
    let kv_dim = c.n_kv_heads * c.head_dim;
    let v_dim = c.n_kv_heads * c.head_dim_v;
    let attn_dim = c.n_heads * c.head_dim_v;
    let layer_cfg = c.layers[layer_idx];

    // Attention block.
    let qkv = [&w.wq, &w.wk, &w.wv];
    let (want_f32, want_q8) = needs(&qkv, n, &bufs.batch_in);
    kernels::rms_norm(
        view(&bufs.x, n * d)?,
        w.attn_norm.weight(),
        n,
        d,
        eps,
        want_f32
            .then(|| view_mut::<f32>(&mut bufs.h, n * d))
            .transpose()?,
        false,
        want_q8
            .then(|| view_mut::<u8>(&mut bufs.q8, q8_bytes(n, d)))
            .transpose()?,
        stream,
    )?;
    products(
        &qkv,
        want_f32.then(|| view(&bufs.h, n * d)).transpose()?,
        want_q8
            .then(|| view(&bufs.q8, q8_bytes(n, d)))
            .transpose()?,
        n,
        vec![
            view_mut::<f32>(&mut bufs.q, n * q_dim)?,
            view_mut::<f32>(&mut bufs.k, n * kv_dim)?,
            view_mut::<f32>(&mut bufs.v, n * v_dim)?,
        ],
        false,
        &mut bufs.batch_in,
        stream,
    )?;
    let head_shape = HeadShape {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        head_dim_v: c.head_dim_v,
        rope_dims: c.rope_dims,
        neox: c.rope_style == RopeStyle::Halves,
        theta_scale: layer_cfg.rope_freq_base.powf(-2.0 / c.rope_dims as f32),
        freq_scale: 1.0 / layer_cfg.rope_scale,
        attn_factor: c.rope_attn_factor,
        q_scale: if c.scale_queries {
            c.attention_scale
        } else {
            1.0
        },
        eps,
    };
    let extras = HeadExtras {
        bq: w.bq.as_ref().map(|f| f.view()).transpose()?,
        bk: w.bk.as_ref().map(|f| f.view()).transpose()?,
        bv: w.bv.as_ref().map(|f| f.view()).transpose()?,
        q_norm: w.q_norm.as_ref().map(|n| n.weight()),
        k_norm: w.k_norm.as_ref().map(|n| n.weight()),
        freq_factors: w.rope_freqs.as_ref().map(|f| f.view()).transpose()?,
    };
    let cache_len = bufs.k_cache[layer_idx].len() / 2 / kv_dim.max(1);
    let token_pages = match layout {
        Layout::Contiguous => None,
        Layout::Paged(batch) => Some(pages(&bufs.meta, batch, 0..n)?),
    };
    kernels::qk_rope_kv(
        view_mut::<f32>(&mut bufs.q, n * q_dim)?,
        view(&bufs.k, n * kv_dim)?,
        view(&bufs.v, n * v_dim)?,
        extras,
        &head_shape,
        n,
        view(&bufs.pos, 1)?,
        token_pages,
        view_mut::<f16>(&mut bufs.k_cache[layer_idx], cache_len * kv_dim)?,
        view_mut::<f16>(&mut bufs.v_cache[layer_idx], cache_len * v_dim)?,
        stream,
    )?;
    let shape = AttentionShape {
        window: layer_cfg.sliding_window,
        ..bufs.attention
    };
    // The attention's output goes to the output projection quantized when it takes Q8
    // blocks and the heads are whole blocks: the attention kernel quantizes it itself.
    let fused_q8 = takes_q8_for(&w.wo, n, &bufs.batch_in) && c.head_dim_v.is_multiple_of(32);
    if let Layout::Paged(batch) = layout {
        paged_attention(batch, layer_idx, &shape, fused_q8, bufs, stream)?;
    } else if batched(n) {
        // A prompt's chunk: one launch over every query, tiled over queries and keys.
        kernels::flash_attention(
            view(&bufs.q, n * q_dim)?,
            view::<f16>(&bufs.k_cache[layer_idx], cache_len * kv_dim)?,
            view::<f16>(&bufs.v_cache[layer_idx], cache_len * v_dim)?,
            &shape,
            n,
            view(&bufs.pos, 1)?,
            None,
            view_mut::<f32>(&mut bufs.attn, n * attn_dim)?,
            bufs.flash_mma,
            stream,
        )?;
    } else {
        // A few tokens (at most MAX_BATCH, the scratch the split attention has room for):
        // each query split along the keys, so that a short chunk still fills the device.
        kernels::attention(
            view(&bufs.q, n * q_dim)?,
            view::<f16>(&bufs.k_cache[layer_idx], cache_len * kv_dim)?,
            view::<f16>(&bufs.v_cache[layer_idx], cache_len * v_dim)?,
            &shape,
            n,
            view(&bufs.pos, 1)?,
            None,
            view_mut::<f32>(&mut bufs.part_ml, shape.ml_len(n))?,
            view_mut::<f32>(&mut bufs.part_acc, shape.acc_len(n))?,
            view_mut::<u32>(&mut bufs.done, shape.done_len(n))?,
            view_mut::<f32>(&mut bufs.attn, n * attn_dim)?,
            fused_q8
                .then(|| view_mut::<u8>(&mut bufs.q8, q8_bytes(n, attn_dim)))
                .transpose()?,
            stream,
        )?;
    }
    let post_attn = w.post_attn_norm.as_ref();
    project(
        &w.wo,
        attn_dim,
        fused_q8,
        post_attn.map(|n| n.weight()),
        bufs,
        n,
        eps,
        stream,
    )?;

    // Feed-forward block.
    let post_ffn = w.post_ffn_norm.as_ref().map(|n| n.weight());
    match &w.ffn {
        FfnWeights::Dense { gate, up, down } => {
            dense_ffn(c, [gate, up, down], &w.ffn_norm, post_ffn, bufs, n, stream)
        }
        FfnWeights::Experts(e) => experts::block(c, e, &w.ffn_norm, bufs, n, stream),
    }
}

/// `x += down(act(gate(h)) · up(h))` with `h = rms_norm(x)`, through the post-norm when
/// the model has one.
fn dense_ffn(
    c: &ModelConfig,
    [gate, up, down]: [&Matrix; 3],
    norm: &super::weights::Norm,
    post_ffn: Option<super::kernels::NormWeight<'_>>,
    bufs: &mut Buffers,
    n: usize,
    stream: &Stream,
) -> Result<(), ModelError> {
    let (d, eps) = (c.n_embd, c.rms_norm_eps);
    let gate_up = [gate, up];
    let (want_f32, want_q8) = needs(&gate_up, n, &bufs.batch_in);
    kernels::rms_norm(
        view(&bufs.x, n * d)?,
        norm.weight(),
        n,
        d,
        eps,
        want_f32
            .then(|| view_mut::<f32>(&mut bufs.h, n * d))
            .transpose()?,
        false,
        want_q8
            .then(|| view_mut::<u8>(&mut bufs.q8, q8_bytes(n, d)))
            .transpose()?,
        stream,
    )?;
    products(
        &gate_up,
        want_f32.then(|| view(&bufs.h, n * d)).transpose()?,
        want_q8
            .then(|| view(&bufs.q8, q8_bytes(n, d)))
            .transpose()?,
        n,
        vec![
            view_mut::<f32>(&mut bufs.gate, n * c.n_ff)?,
            view_mut::<f32>(&mut bufs.up, n * c.n_ff)?,
        ],
        false,
        &mut bufs.batch_in,
        stream,
    )?;
    let down_q8 = takes_q8_for(down, n, &bufs.batch_in);
    kernels::gated(
        Some(view(&bufs.gate, n * c.n_ff)?),
        view(&bufs.up, n * c.n_ff)?,
        c.n_ff,
        c.activation == Activation::GeluTanh,
        (!down_q8)
            .then(|| view_mut::<f32>(&mut bufs.act, n * c.n_ff))
            .transpose()?,
        down_q8
            .then(|| view_mut::<u8>(&mut bufs.q8, q8_bytes(n, c.n_ff)))
            .transpose()?,
        stream,
    )?;
    let (x, proj, batch_in) = (&mut bufs.x, &mut bufs.proj, &mut bufs.batch_in);
    let (f32_in, q8_in) = if down_q8 {
        (None, Some(view(&bufs.q8, q8_bytes(n, c.n_ff))?))
    } else {
        (Some(view(&bufs.act, n * c.n_ff)?), None)
    };
    let into = Residual { x, proj, batch_in };
    residual(down, f32_in, q8_in, post_ffn, into, n, eps, stream)
}

/// Attention of a paged batch: a sequence with more than [`MAX_BATCH`] tokens in one
/// launch tiled over its queries; the others' rows together, split along the keys, in
/// launches of at most `attn_rows` rows. `fused_q8` (the Q8 blocks of the output too)
/// only when every row fits one launch.
fn paged_attention(
    batch: &PagedBatch,
    layer_idx: usize,
    shape: &AttentionShape,
    fused_q8: bool,
    bufs: &mut Buffers,
    stream: &Stream,
) -> Result<(), ModelError> {
    let n = batch.n_tokens;
    let q_dim = shape.n_heads * shape.head_dim;
    let attn_dim = shape.n_heads * shape.head_dim_v;
    let cache_len = bufs.k_cache[layer_idx].len() / 2;
    let v_cache_len = bufs.v_cache[layer_idx].len() / 2;
    let tables_at = batch.tables_at();
    if fused_q8 && n > bufs.attn_rows {
        return Err(ModelError::InvalidBatch(format!(
            "{n} rows with their attention quantized in one launch, which takes {}",
            bufs.attn_rows
        )));
    }
    // Rows of the split kernel waiting for a launch.
    let mut pending: Option<std::ops::Range<usize>> = None;
    let split = |rows: std::ops::Range<usize>, bufs: &mut Buffers| -> Result<(), ModelError> {
        let m = rows.len();
        kernels::attention(
            view_at(&bufs.q, rows.start * q_dim..rows.end * q_dim)?,
            view::<f16>(&bufs.k_cache[layer_idx], cache_len)?,
            view::<f16>(&bufs.v_cache[layer_idx], v_cache_len)?,
            shape,
            m,
            view(&bufs.pos, 1)?,
            Some(pages(&bufs.meta, batch, rows.clone())?),
            view_mut::<f32>(&mut bufs.part_ml, shape.ml_len(m))?,
            view_mut::<f32>(&mut bufs.part_acc, shape.acc_len(m))?,
            view_mut::<u32>(&mut bufs.done, shape.done_len(m))?,
            view_mut_at::<f32>(&mut bufs.attn, rows.start * attn_dim..rows.end * attn_dim)?,
            fused_q8
                .then(|| view_mut::<u8>(&mut bufs.q8, q8_bytes(n, attn_dim)))
                .transpose()?,
            stream,
        )?;
        Ok(())
    };
    for seg in &batch.segments {
        let rows = seg.first_row..seg.first_row + seg.len;
        if seg.len <= MAX_BATCH {
            pending = Some(match pending.take() {
                Some(p) if rows.end - p.start <= bufs.attn_rows => p.start..rows.end,
                Some(p) => {
                    split(p, bufs)?;
                    rows
                }
                None => rows,
            });
            continue;
        }
        if let Some(p) = pending.take() {
            split(p, bufs)?;
        }
        let table = seg.table_at + tables_at..seg.table_at + tables_at + seg.table_len;
        kernels::flash_attention(
            view_at(&bufs.q, rows.start * q_dim..rows.end * q_dim)?,
            view::<f16>(&bufs.k_cache[layer_idx], cache_len)?,
            view::<f16>(&bufs.v_cache[layer_idx], v_cache_len)?,
            shape,
            seg.len,
            view_at::<i32>(&bufs.meta, rows.start..rows.start + 1)?,
            Some((view_at::<i32>(&bufs.meta, table)?, batch.block_shift)),
            view_mut_at::<f32>(&mut bufs.attn, rows.start * attn_dim..rows.end * attn_dim)?,
            bufs.flash_mma,
            stream,
        )?;
    }
    if let Some(p) = pending {
        split(p, bufs)?;
    }
    Ok(())
}

/// The output projection of attention: quantizes `attn` (`width` per token) when the
/// matrix takes Q8 blocks and the attention kernel has not (`quantized`), then adds the
/// product to the residual stream.
#[allow(clippy::too_many_arguments)]
fn project(
    m: &Matrix,
    width: usize,
    quantized: bool,
    post_norm: Option<super::kernels::NormWeight<'_>>,
    bufs: &mut Buffers,
    n: usize,
    eps: f32,
    stream: &Stream,
) -> Result<(), ModelError> {
    let q8_in = if takes_q8_for(m, n, &bufs.batch_in) {
        if !quantized {
            matvec::quantize_q8(
                view(&bufs.attn, n * width)?,
                n,
                width,
                view_mut::<u8>(&mut bufs.q8, q8_bytes(n, width))?,
                stream,
            )
            .map_err(matvec_error(&[m]))?;
        }
        Some(view(&bufs.q8, q8_bytes(n, width))?)
    } else {
        None
    };
    let f32_in = match q8_in {
        Some(_) => None,
        None => Some(view(&bufs.attn, n * width)?),
    };
    let into = Residual {
        x: &mut bufs.x,
        proj: &mut bufs.proj,
        batch_in: &mut bufs.batch_in,
    };
    residual(m, f32_in, q8_in, post_norm, into, n, eps, stream)
}

/// Where a residual product writes: the residual stream `x`, `proj` for a post-norm's
/// input, and the batch products' input.
struct Residual<'a> {
    x: &'a mut ArenaBuffer,
    proj: &'a mut ArenaBuffer,
    batch_in: &'a mut BatchInput,
}

/// `x += input · mᵀ`, or with a post-norm `x += rms_norm(input · mᵀ)` (through `proj`).
#[allow(clippy::too_many_arguments)]
fn residual(
    m: &Matrix,
    f32_in: Option<DeviceView<'_, f32>>,
    q8_in: Option<DeviceView<'_, u8>>,
    post_norm: Option<super::kernels::NormWeight<'_>>,
    into: Residual<'_>,
    n: usize,
    eps: f32,
    stream: &Stream,
) -> Result<(), ModelError> {
    let d = m.rows;
    let Residual { x, proj, batch_in } = into;
    match post_norm {
        None => products(
            &[m],
            f32_in,
            q8_in,
            n,
            vec![view_mut::<f32>(x, n * d)?],
            true,
            batch_in,
            stream,
        ),
        Some(norm) => {
            products(
                &[m],
                f32_in,
                q8_in,
                n,
                vec![view_mut::<f32>(proj, n * d)?],
                false,
                batch_in,
                stream,
            )?;
            kernels::rms_norm(
                view(proj, n * d)?,
                norm,
                n,
                d,
                eps,
                Some(view_mut::<f32>(x, n * d)?),
                true,
                None,
                stream,
            )?;
            Ok(())
        }
    }
}

/// The final norm and the output product: of the last token only (`last_only`), into
/// the first row of `logits`, or of every token.
pub(super) fn finish(
    config: &ModelConfig,
    globals: &Globals,
    bufs: &mut Buffers,
    n: usize,
    last_only: bool,
    stream: &Stream,
) -> Result<(), ModelError> {
    let (first, rows) = if last_only { (n - 1, 1) } else { (0, n) };
    output_logits(config, globals, bufs, Rows::OfX(first), rows, stream)
}

/// Loads the code of the output product of one token, the one [`finish`] runs for a
/// prompt's last: a decode product (`batched(1)` is false and one token is below
/// `SKINNY_FROM`). A pass whose output matrix arrives after its layers loads it while it
/// waits for them, rather than after the matrix lands.
pub(super) fn load_last_token_head(
    plan: &ExecutionPlan,
    stream: &Stream,
) -> Result<(), ModelError> {
    const _: () = assert!(MAX_BATCH >= 1 && SKINNY_FROM > 1);
    let out = &plan.output;
    matvec::load_matvec(out.weight.ggml_type(), out.cols, 1, stream)
        .map_err(product_error("loading the output product", || {
            out.weight.name().to_owned()
        }))
}

/// Where the rows that get logits are: consecutive rows of the residual stream `x` from
/// the one given, or gathered into `proj` first.
#[derive(Clone, Copy)]
enum Rows {
    OfX(usize),
    InProj,
}

/// The final norm, the output product and the final soft cap of `rows` rows, into the
/// first rows of `logits`.
fn output_logits(
    config: &ModelConfig,
    globals: &Globals,
    bufs: &mut Buffers,
    from: Rows,
    rows: usize,
    stream: &Stream,
) -> Result<(), ModelError> {
    let d = config.n_embd;
    let input = match from {
        Rows::OfX(first) => view_at(&bufs.x, first * d..(first + rows) * d)?,
        Rows::InProj => view(&bufs.proj, rows * d)?,
    };
    let out = &globals.output;
    let (want_f32, want_q8) = needs(&[out], rows, &bufs.batch_in);
    kernels::rms_norm(
        input,
        globals.output_norm.weight(),
        rows,
        d,
        config.rms_norm_eps,
        want_f32
            .then(|| view_mut::<f32>(&mut bufs.h, rows * d))
            .transpose()?,
        false,
        want_q8
            .then(|| view_mut::<u8>(&mut bufs.q8, q8_bytes(rows, d)))
            .transpose()?,
        stream,
    )?;
    products(
        &[out],
        want_f32.then(|| view(&bufs.h, rows * d)).transpose()?,
        want_q8
            .then(|| view(&bufs.q8, q8_bytes(rows, d)))
            .transpose()?,
        rows,
        vec![view_mut::<f32>(&mut bufs.logits, rows * config.n_vocab)?],
        false,
        &mut bufs.batch_in,
        stream,
    )?;
    cap_logits(config, bufs, rows, stream)
}

/// The final soft cap of the first `rows` rows of logits, for models that have one.
fn cap_logits(
    config: &ModelConfig,
    bufs: &mut Buffers,
    rows: usize,
    stream: &Stream,
) -> Result<(), ModelError> {
    if let Some(cap) = config.final_logit_softcap {
        kernels::softcap(
            view_mut::<f32>(&mut bufs.logits, rows * config.n_vocab)?,
            cap,
            stream,
        )?;
    }
    Ok(())
}

/// The final norm and the output product of a paged batch's rows that get logits (its
/// logit rows, in `meta`), into the first rows of `logits`; with `argmax`, each row's
/// greedy token into `tokens`.
pub(super) fn finish_rows(
    config: &ModelConfig,
    globals: &Globals,
    bufs: &mut Buffers,
    batch: &PagedBatch,
    argmax: bool,
    stream: &Stream,
) -> Result<(), ModelError> {
    let d = config.n_embd;
    let (n, m) = (batch.n_tokens, batch.n_logits);
    if m == 0 {
        return Ok(());
    }
    kernels::select_rows(
        view(&bufs.x, n * d)?,
        d,
        view_at::<i32>(&bufs.meta, 2 * n..2 * n + m)?,
        view_mut::<f32>(&mut bufs.proj, m * d)?,
        stream,
    )?;
    output_logits(config, globals, bufs, Rows::InProj, m, stream)?;
    if argmax {
        argmax_rows(config, bufs, m, stream)?;
    }
    Ok(())
}

/// The greedy token of each of the first `m` rows of logits into `tokens`.
pub(super) fn argmax_rows(
    config: &ModelConfig,
    bufs: &mut Buffers,
    m: usize,
    stream: &Stream,
) -> Result<(), ModelError> {
    kernels::argmax(
        view(&bufs.logits, m * config.n_vocab)?,
        view_mut::<u32>(&mut bufs.tokens, m)?,
        stream,
    )?;
    Ok(())
}

/// After the logits: the greedy token of the last row into `tokens[0]` (when only the
/// last row was computed), and the position advanced past the `n` tokens.
pub(super) fn tail(
    config: &ModelConfig,
    bufs: &mut Buffers,
    n: usize,
    last_only: bool,
    stream: &Stream,
) -> Result<(), ModelError> {
    if last_only {
        argmax_rows(config, bufs, 1, stream)?;
    }
    kernels::advance(view_mut::<i32>(&mut bufs.pos, 1)?, n, stream)?;
    Ok(())
}

/// The whole forward pass of `n` tokens with every weight held.
pub(super) fn step(
    config: &ModelConfig,
    layers: &[LayerWeights],
    globals: &Globals,
    bufs: &mut Buffers,
    n: usize,
    last_only: bool,
    stream: &Stream,
) -> Result<(), ModelError> {
    // Captured once and replayed whole: no stop between its layers.
    body(
        config,
        layers,
        globals,
        bufs,
        n,
        Layout::Contiguous,
        stream,
        None,
    )?;
    finish(config, globals, bufs, n, last_only, stream)?;
    tail(config, bufs, n, last_only, stream)
}

/// The embeddings and every transformer block of `n` tokens laid out as `layout`, with
/// every weight held; stopping before a layer once `stop` is set.
#[allow(clippy::too_many_arguments)]
pub(super) fn body(
    config: &ModelConfig,
    layers: &[LayerWeights],
    globals: &Globals,
    bufs: &mut Buffers,
    n: usize,
    layout: Layout<'_>,
    stream: &Stream,
    stop: Option<&AtomicBool>,
) -> Result<(), ModelError> {
    embed(config, globals, bufs, n, stream)?;
    for (layer_idx, w) in layers.iter().enumerate() {
        super::check_stop(stop)?;
        layer(config, layer_idx, w, bufs, n, layout, stream)?;
    }
    Ok(())
}
