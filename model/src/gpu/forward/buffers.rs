//! The arena a pass runs in: the activations, the batch products' input, the position
//! counter and the KV cache (f16 or quantized), carved from one allocation; and the layout of a paged
//! batch's tokens in it.

use dequant::gpu::experts;
use dequant::gpu::matmul;
use dequant::gpu::matmul_q8k::{q8k_bytes, q8k_takes, Q8K_BLOCK};
use dequant::gpu::matvec::q8_bytes;
use half::f16;
use hip_backend::{ArenaBuffer, Device, DeviceView, DeviceViewMut, PinnedBuffer, Stream};

use super::products::BatchInput;
use super::{view, view_at, view_mut, view_mut_at};
use crate::config::ModelConfig;
use crate::gpu::expert_pool::ExpertPools;
use crate::gpu::gpu;
use crate::gpu::kernels::{attention_chunk, AttentionShape, CacheView, CacheViewMut, Pages};
use crate::gpu::{arena, MAX_BATCH};
use crate::kv_type::KvTypes;
use crate::plan::{ExecutionPlan, FfnPlan};
use crate::ModelError;

/// Alignment of every buffer in the arena.
const ALIGN: usize = 256;

/// Whether some matrix of a layer (attention, dense or shared feed-forward, routed experts)
/// is of a type the int8 tiles take on `device` ([`q8k_takes`]).
fn int8_types(plan: &ExecutionPlan, device: &Device) -> bool {
    let takes = |ty| q8k_takes(ty, Q8K_BLOCK, device);
    plan.layers.iter().any(|layer| {
        let attention = [&layer.wq, &layer.wk, &layer.wv, &layer.wo];
        let dense = |d: &crate::plan::DenseFfn| {
            [&d.gate, &d.up, &d.down]
                .iter()
                .any(|m| takes(m.weight.ggml_type()))
        };
        attention.iter().any(|m| takes(m.weight.ggml_type()))
            || match &layer.ffn {
                FfnPlan::Dense(d) => dense(d),
                FfnPlan::Experts(e) => {
                    e.gate
                        .iter()
                        .chain([&e.up, &e.down])
                        .any(|m| takes(m.weight.ggml_type()))
                        || e.shared.as_ref().is_some_and(|(d, _)| dense(d))
                }
            }
    })
}

/// How many sequences a paged batch holds at most, and the cache's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::gpu) struct PageShape {
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
pub(in crate::gpu) struct PagedSegment {
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
pub(in crate::gpu) struct PagedBatch {
    pub segments: Vec<PagedSegment>,
    pub n_tokens: usize,
    pub n_logits: usize,
    pub block_shift: u32,
}

impl PagedBatch {
    pub(super) fn tables_at(&self) -> usize {
        2 * self.n_tokens + self.n_logits
    }
}

/// How the tokens of a forward pass find their positions and their keys and values.
#[derive(Clone, Copy)]
pub(in crate::gpu) enum Layout<'a> {
    /// One sequence: tokens at positions `pos[0]..`, its cache rows in position order.
    Contiguous,
    /// Several sequences in the cache's blocks, as `Buffers::meta` lays them out.
    Paged(&'a PagedBatch),
}

/// The paged layout of rows `rows` of `batch`, viewed in `meta`.
pub(super) fn pages<'a>(
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
/// KV cache, all carved from one arena allocated once.
pub(in crate::gpu) struct Buffers {
    pub(super) x: ArenaBuffer,
    pub(super) h: ArenaBuffer,
    pub(super) q8: ArenaBuffer,
    pub(super) q: ArenaBuffer,
    pub(super) k: ArenaBuffer,
    pub(super) v: ArenaBuffer,
    pub(super) attn: ArenaBuffer,
    pub(super) proj: ArenaBuffer,
    pub(super) gate: ArenaBuffer,
    pub(super) up: ArenaBuffer,
    pub(super) act: ArenaBuffer,
    pub(super) logits: ArenaBuffer,
    pub(super) part_ml: ArenaBuffer,
    pub(super) part_acc: ArenaBuffer,
    /// The attention's counters of finished chunks: zero between launches.
    pub(super) done: ArenaBuffer,
    /// The batch products' input.
    pub(super) batch_in: BatchInput,
    pub(super) raw: ArenaBuffer,
    pub(super) tokens: ArenaBuffer,
    pub(super) pos: ArenaBuffer,
    pub(super) bad: ArenaBuffer,
    /// A paged batch's layout (`PagedBatch`); empty without pages.
    pub(super) meta: ArenaBuffer,
    /// Every layer's cached keys and values.
    pub(super) kv: KvBuffers,
    pub(super) attention: AttentionShape,
    pub(super) row_bytes: usize,
    /// Most queries of one launch of the split attention (its scratch's rows).
    pub(super) attn_rows: usize,
    /// Most rows of logits.
    logit_rows: usize,
    /// Whether a prompt's attention may take the matrix units (`GpuTuning::flash_mma`).
    pub(super) flash_mma: bool,
    /// The experts' room, for a model with a mixture of experts.
    pub(super) moe: Option<MoeBuffers>,
    /// Over its budget, a mixture of experts' pools of resident experts (set by the
    /// model once it has placed its weights).
    pub(in crate::gpu) experts: Option<ExpertPools>,
    /// Split by tensors: the devices' communicator, whose all-reduce sums the partial
    /// products of the matrices cut by columns (set by the split once built).
    pub(in crate::gpu) team: Option<hip_backend::Communicator>,
    /// The experts a token used, while a mixture of experts' weighted sum of `moe.out`
    /// is not yet in `x`: the next layer's norm adds it, in the same launch
    /// (`experts::block` leaves it only where that norm comes next).
    pub(super) pending_sum: Option<usize>,
}

impl Buffers {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        device: &Device,
        config: &ModelConfig,
        plan: &ExecutionPlan,
        capacity: usize,
        batch: usize,
        paged: Option<&PageShape>,
        flash_mma: bool,
        warp_attention: bool,
        int8_prompts: bool,
        kv_types: KvTypes,
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
            warps: warp_attention,
        };
        let embd_ty = plan.token_embd.weight.ggml_type();
        let row_bytes = embd_ty.row_bytes(c.n_embd as u64).unwrap_or(0) as usize;
        // The dense feed-forward's width, or the shared expert's.
        let n_ff = c
            .n_ff
            .max(c.experts.and_then(|e| e.shared_n_ff).unwrap_or(0));
        let width = c.n_embd.max(attn_dim).max(n_ff);
        let scales_bytes = (4 * b).div_ceil(ALIGN) * ALIGN;
        // The int8 products' input, where the device runs them and some layer's matrix is
        // of their type (for the widest input, rounded up to whole blocks).
        let int8 = int8_prompts && int8_types(plan, device);
        let q8k_len = if int8 {
            q8k_bytes(b, width.div_ceil(Q8K_BLOCK) * Q8K_BLOCK).unwrap_or(usize::MAX)
        } else {
            0
        };
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
            q8k_len,                                // Q8_K input
            4 * matmul::SPLIT_PARTIALS,             // split partial sums
            4 * matmul::SPLIT_COUNTERS,             // split counters
            b * row_bytes,                          // raw embedding rows
            4 * b,                                  // tokens
            4,                                      // pos
            4,                                      // bad
            4 * paged.map_or(0, |p| p.meta_len(b)), // meta
        ];
        let moe_sizes = MoeBuffers::sizes(c, b);
        let total = sizes
            .iter()
            .chain(moe_sizes.iter().flatten())
            .map(|&s| s.max(4).div_ceil(ALIGN) * ALIGN)
            .sum::<usize>()
            + c.n_layers * (positions * kv_types.k.row_bytes(kv_dim)).div_ceil(ALIGN) * ALIGN
            + c.n_layers * (positions * kv_types.v.row_bytes(v_dim)).div_ceil(ALIGN) * ALIGN;
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
                q8k: next()?,
                int8,
                partials: next()?,
                counters: next()?,
                skinny: matmul::skinny_available(device),
            },
            raw: next()?,
            tokens: next()?,
            pos: next()?,
            bad: next()?,
            meta: next()?,
            kv: KvBuffers {
                k: (0..c.n_layers)
                    .map(|_| alloc(positions * kv_types.k.row_bytes(kv_dim)))
                    .collect::<Result<_, _>>()?,
                v: (0..c.n_layers)
                    .map(|_| alloc(positions * kv_types.v.row_bytes(v_dim)))
                    .collect::<Result<_, _>>()?,
                types: kv_types,
                positions,
                k_dim: kv_dim,
                v_dim,
            },
            attention,
            row_bytes,
            attn_rows: rows,
            logit_rows: rows,
            flash_mma,
            experts: None,
            team: None,
            pending_sum: None,
            moe: moe_sizes
                .is_some()
                .then(|| MoeBuffers::new(&mut next))
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

    /// The elements of `positions` in a layer's cached keys, and in its values (the
    /// contiguous layout of one sequence).
    fn kv_ranges(
        &self,
        positions: std::ops::Range<usize>,
    ) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (kd, vd) = self.kv_dims();
        let (s, e) = (positions.start, positions.end);
        (s * kd..e * kd, s * vd..e * vd)
    }

    /// `layer`'s cached keys and values of `positions`, in the contiguous layout of one
    /// sequence (position `p`'s row at `p`), of an f16 cache (a quantized one is
    /// refused).
    pub fn kv_view(
        &self,
        layer: usize,
        positions: std::ops::Range<usize>,
    ) -> Result<(DeviceView<'_, f16>, DeviceView<'_, f16>), ModelError> {
        self.f16_only()?;
        let (k, v) = self.kv_ranges(positions);
        Ok((
            view_at::<f16>(&self.kv.k[layer], k)?,
            view_at::<f16>(&self.kv.v[layer], v)?,
        ))
    }

    /// As [`Buffers::kv_view`], to write.
    pub fn kv_mut(
        &mut self,
        layer: usize,
        positions: std::ops::Range<usize>,
    ) -> Result<(DeviceViewMut<'_, f16>, DeviceViewMut<'_, f16>), ModelError> {
        self.f16_only()?;
        let (k, v) = self.kv_ranges(positions);
        Ok((
            view_mut_at::<f16>(&mut self.kv.k[layer], k)?,
            view_mut_at::<f16>(&mut self.kv.v[layer], v)?,
        ))
    }

    fn f16_only(&self) -> Result<(), ModelError> {
        let types = self.kv.types;
        if types.is_quantized() {
            return Err(ModelError::CacheType {
                reason: format!(
                    "a {}/{} cache's rows cross to the host as f16 only",
                    types.k, types.v
                ),
            });
        }
        Ok(())
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

/// Every layer's cached keys and values: `positions` rows each, of the types' bytes.
pub(in crate::gpu) struct KvBuffers {
    k: Vec<ArenaBuffer>,
    v: Vec<ArenaBuffer>,
    pub(super) types: KvTypes,
    positions: usize,
    k_dim: usize,
    v_dim: usize,
}

impl KvBuffers {
    /// Every position of `layer`'s cached keys and values.
    pub fn views(&self, layer: usize) -> Result<(CacheView<'_>, CacheView<'_>), ModelError> {
        let (p, t) = (self.positions, self.types);
        Ok((
            CacheView {
                bytes: view::<u8>(&self.k[layer], p * t.k.row_bytes(self.k_dim))?,
                ty: t.k,
                positions: p,
                dim: self.k_dim,
            },
            CacheView {
                bytes: view::<u8>(&self.v[layer], p * t.v.row_bytes(self.v_dim))?,
                ty: t.v,
                positions: p,
                dim: self.v_dim,
            },
        ))
    }

    /// As [`KvBuffers::views`], to write.
    pub fn views_mut(
        &mut self,
        layer: usize,
    ) -> Result<(CacheViewMut<'_>, CacheViewMut<'_>), ModelError> {
        let (p, t) = (self.positions, self.types);
        Ok((
            CacheViewMut {
                bytes: view_mut::<u8>(&mut self.k[layer], p * t.k.row_bytes(self.k_dim))?,
                ty: t.k,
                positions: p,
                dim: self.k_dim,
            },
            CacheViewMut {
                bytes: view_mut::<u8>(&mut self.v[layer], p * t.v.row_bytes(self.v_dim))?,
                ty: t.v,
                positions: p,
                dim: self.v_dim,
            },
        ))
    }
}

/// The room of the experts' block for up to `tokens` tokens: router logits, the routing,
/// the layer's input in Q8 blocks, the experts' intermediate and output rows, and for
/// the products on the matrix units (prompts) the f16 input with its row scales and the
/// experts' activations in f32.
pub(in crate::gpu) struct MoeBuffers {
    pub(super) logits: ArenaBuffer,
    pub(super) shared_gate: ArenaBuffer,
    pub(super) ids: ArenaBuffer,
    pub(super) weights: ArenaBuffer,
    pub(super) tiles: ArenaBuffer,
    pub(super) order: ArenaBuffer,
    pub(super) q8_in: ArenaBuffer,
    pub(super) q8_act: ArenaBuffer,
    pub(super) gate: ArenaBuffer,
    pub(super) up: ArenaBuffer,
    pub(super) out: ArenaBuffer,
    pub(super) x16: ArenaBuffer,
    pub(super) scales: ArenaBuffer,
    pub(super) act: ArenaBuffer,
}

impl MoeBuffers {
    /// Bytes of each buffer, in the order [`MoeBuffers::new`] takes them.
    pub fn sizes(config: &ModelConfig, tokens: usize) -> Option<[usize; 14]> {
        let e = config.experts?;
        let slots = tokens * e.used;
        // The tiles as a device with either skinny products, or without them, cuts them.
        let choices = [
            experts::SkinnyTiles::No,
            experts::SkinnyTiles::F16,
            experts::SkinnyTiles::Q8,
        ]
        .map(|skinny| {
            let tile_tokens = experts::tile_tokens_for(slots, e.count, e.n_ff, skinny);
            let f16 = experts::takes_f16(tile_tokens, skinny);
            (experts::max_tiles(slots, e.count, tile_tokens), f16)
        });
        // Fewer slots take no more tiles than slots (tiles of one, or tiles of four from
        // three slots an expert) or than the most's tiles.
        let tiles = choices.iter().map(|c| c.0).max().unwrap_or(0).max(slots);
        let d = config.n_embd;
        // The matrix units' input and activations, where some count of tokens takes them.
        let mm = choices.iter().any(|c| c.1);
        let mm_rows = if mm { slots } else { 0 };
        Some([
            4 * tokens * e.count,
            4 * tokens,
            4 * slots,
            4 * slots,
            4 * 3 * tiles,
            4 * slots,
            q8_bytes(tokens, d),
            q8_bytes(slots, e.n_ff),
            4 * slots * e.n_ff,
            4 * slots * e.n_ff,
            4 * slots * d,
            2 * mm_rows * d.max(e.n_ff),
            4 * mm_rows,
            4 * mm_rows * e.n_ff,
        ])
    }

    pub fn new(
        mut next: impl FnMut() -> Result<ArenaBuffer, ModelError>,
    ) -> Result<MoeBuffers, ModelError> {
        Ok(MoeBuffers {
            logits: next()?,
            shared_gate: next()?,
            ids: next()?,
            weights: next()?,
            tiles: next()?,
            order: next()?,
            q8_in: next()?,
            q8_act: next()?,
            gate: next()?,
            up: next()?,
            out: next()?,
            x16: next()?,
            scales: next()?,
            act: next()?,
        })
    }
}
