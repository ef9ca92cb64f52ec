//! One transformer layer on the CPU, written once: the attention block, then the
//! feed-forward block, over either place a batch's keys and values live ([`Kv`]): one
//! sequence's contiguous [`KvCache`] (generation, scoring, the layers a GPU model does
//! not hold) or the scheduler's paged pool, several sequences' segments in one batch.
//! Both run the same operations in the same order on the same rows, so a sequence alone
//! in a scheduler step gets the bits [`crate::Model::forward`] gives it.

use crate::config::{Activation, ModelConfig};
use crate::kv_cache::KvCache;
use crate::kv_pool::{BlockId, KvPool};
use crate::kv_type::fwht;
use crate::ops::{self, AttentionMethod, AttentionShape, FlashContext, Layout};
use crate::plan::{FfnPlan, LayerPlan};
use crate::ModelError;

use super::moe::{experts_block, MoeScratch};
use super::offload::{split_linears, RowOffload};
use super::products::{add, resize, vector};

/// Where a batch's keys and values go, and whose positions its rows are.
pub(crate) enum Kv<'a, 's> {
    /// One sequence: the batch's rows at the positions after `cache.len()`, appended to
    /// the cache (the caller commits them once every layer has its rows).
    Cache(&'a mut KvCache),
    /// Several sequences: each segment's rows, in segment order, at its positions,
    /// written into its blocks of the pool.
    Pool {
        pool: &'a mut KvPool,
        segments: &'a [Segment<'s>],
        context: Context,
    },
}

/// One sequence's part of a batch in the pool.
pub(crate) struct Segment<'a> {
    /// Tokens to run, at positions `first_pos..first_pos + tokens.len()`.
    pub tokens: &'a [u32],
    pub first_pos: usize,
    /// The sequence's blocks, covering every position up to the last of `tokens`.
    pub table: &'a [BlockId],
    /// Whether the last token gets logits.
    pub logits: bool,
}

/// What a sequence's single-sequence cache would be: its size in positions (which
/// chooses Phi-3's RoPE factors and bounds flash attention's view of it) and how its
/// attention is computed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Context {
    pub size: usize,
    pub attention: AttentionMethod,
}

impl Kv<'_, '_> {
    /// The positions of the batch's rows, in row order.
    fn positions(&self, n: usize) -> Vec<usize> {
        match self {
            Kv::Cache(cache) => (cache.len()..cache.len() + n).collect(),
            Kv::Pool { segments, .. } => segments
                .iter()
                .flat_map(|s| s.first_pos..s.first_pos + s.tokens.len())
                .collect(),
        }
    }

    /// The context RoPE is computed for (Phi-3 takes its long factors beyond its
    /// original context).
    fn rope_context(&self) -> usize {
        match self {
            Kv::Cache(cache) => cache.capacity(),
            Kv::Pool { context, .. } => context.size,
        }
    }

    /// Writes the batch's keys and values of layer `layer_idx` and computes each row's
    /// attention into `out`. With `carry_last`, only the rows that get logits are needed
    /// past the attention (the last of the batch, or of each segment that asks): rows of
    /// segments that get none are not attended. Returns the rows to carry.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &mut self,
        config: &ModelConfig,
        layer_idx: usize,
        sinks: Option<&[f32]>,
        q: &mut [f32],
        k: &mut [f32],
        v: &mut [f32],
        out: &mut [f32],
        carry_last: bool,
    ) -> Carry {
        let n = q.len() / (config.n_heads * config.head_dim);
        // A quantized cache holds rotated rows, as llama.cpp's does (kv_type.rs).
        let types = match self {
            Kv::Cache(cache) => cache.types(),
            Kv::Pool { pool, .. } => pool.types(),
        };
        if let Some(n_rot) = types.k_rotation(config.head_dim) {
            fwht(q, n_rot);
            fwht(k, n_rot);
        }
        let v_rotation = types.v_rotation(config.head_dim_v);
        if let Some(n_rot) = v_rotation {
            fwht(v, n_rot);
        }
        let carry = self.attend_rows(config, layer_idx, sinks, q, k, v, out, carry_last, n);
        if let Some(n_rot) = v_rotation {
            fwht(out, n_rot);
        }
        carry
    }

    /// [`Kv::attend`] once the rows are in the cache's frame.
    #[allow(clippy::too_many_arguments)]
    fn attend_rows(
        &mut self,
        config: &ModelConfig,
        layer_idx: usize,
        sinks: Option<&[f32]>,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
        carry_last: bool,
        n: usize,
    ) -> Carry {
        match self {
            Kv::Cache(cache) => {
                let shape = attention_shape(
                    config,
                    layer_idx,
                    cache.len(),
                    cache.attention(),
                    cache.context(),
                    sinks,
                );
                cache.append(layer_idx, k, v);
                // A token's step after a context shift walks llama.cpp's cells (its
                // flash kernels; a sliding window's cache is one of its own there).
                cache.place(n);
                let one_flash = n == 1 && shape.method == AttentionMethod::Flash;
                let layout = match cache.cells() {
                    Some(pos) if one_flash && shape.window.is_none() => Layout::Cells { pos },
                    _ => Layout::Contiguous,
                };
                let (keys, values) = cache.layer(layer_idx);
                ops::attention_in(q, keys, values, &shape, layout, out);
                if carry_last && n > 1 {
                    Carry::Rows(vec![n - 1])
                } else {
                    Carry::All
                }
            }
            Kv::Pool {
                pool,
                segments,
                context,
            } => {
                let (q_dim, k_dim, v_dim) = (
                    config.n_heads * config.head_dim,
                    config.n_kv_heads * config.head_dim,
                    config.n_kv_heads * config.head_dim_v,
                );
                let out_dim = config.n_heads * config.head_dim_v;
                let mut kept = Vec::new();
                let mut row = 0;
                for seg in segments.iter() {
                    let len = seg.tokens.len();
                    if len == 0 {
                        continue;
                    }
                    let rows = row..row + len;
                    row = rows.end;
                    pool.write(
                        layer_idx,
                        seg.table,
                        seg.first_pos,
                        &k[rows.start * k_dim..rows.end * k_dim],
                        &v[rows.start * v_dim..rows.end * v_dim],
                    );
                    if carry_last && !seg.logits {
                        continue;
                    }
                    let shape = attention_shape(
                        config,
                        layer_idx,
                        seg.first_pos,
                        context.attention,
                        context.size,
                        sinks,
                    );
                    let (keys, values) = pool.layer(layer_idx);
                    let layout = Layout::Paged {
                        table: seg.table,
                        block_size: pool.block_size(),
                    };
                    // With `carry_last` only the last row matters; attending with it
                    // alone would change the lanes (a single token takes the dot
                    // product's path), so every row attends, as for one sequence.
                    ops::attention_in(
                        &q[rows.start * q_dim..rows.end * q_dim],
                        keys,
                        values,
                        &shape,
                        layout,
                        &mut out[rows.start * out_dim..rows.end * out_dim],
                    );
                    kept.push(rows.end - 1);
                }
                if carry_last {
                    Carry::Rows(kept)
                } else {
                    Carry::All
                }
            }
        }
    }

    /// The rows of a batch of `n` that get logits: the last one, or the last of each
    /// segment that asks for them.
    fn logit_rows(&self, n: usize) -> Vec<usize> {
        match self {
            Kv::Cache(_) => vec![n - 1],
            Kv::Pool { segments, .. } => {
                let mut rows = Vec::new();
                let mut end = 0;
                for seg in segments.iter() {
                    end += seg.tokens.len();
                    if !seg.tokens.is_empty() && seg.logits {
                        rows.push(end - 1);
                    }
                }
                rows
            }
        }
    }
}

/// The attention of layer `layer_idx` for rows from `first_pos` on, computed by
/// `method` in a context of `context` positions.
fn attention_shape<'a>(
    config: &ModelConfig,
    layer_idx: usize,
    first_pos: usize,
    method: AttentionMethod,
    context: usize,
    sinks: Option<&'a [f32]>,
) -> AttentionShape<'a> {
    AttentionShape {
        n_heads: config.n_heads,
        n_kv_heads: config.n_kv_heads,
        head_dim: config.head_dim,
        head_dim_v: config.head_dim_v,
        first_pos,
        window: config.layers[layer_idx].sliding_window,
        // Models that scale their queries before the product (Gemma) have it done.
        scale: if config.scale_queries {
            1.0
        } else {
            config.attention_scale
        },
        softcap: config.attn_logit_softcap,
        sinks,
        method,
        flash: FlashContext {
            context,
            threads: rayon::current_num_threads(),
        },
    }
}

/// The rows a layer carries past its attention.
enum Carry {
    All,
    /// These rows, in order: only their residual streams go through the output
    /// projection and the feed-forward block. That saves the work of the others, and it
    /// is what llama.cpp does, so those products see the batch llama.cpp's see and take
    /// the same kernels (and roundings).
    Rows(Vec<usize>),
}

/// Reusable buffers of one forward call.
#[derive(Default)]
pub(crate) struct Scratch {
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    rope: RopeTables,
    moe: MoeScratch,
}

/// RoPE tables of one forward call's positions, one per base and scale the layers use:
/// layers of one base and scale rotate by the same angles (the frequency factors, where
/// a model has them, are one tensor for all layers).
pub(crate) type RopeTables = Vec<((u32, u32), Vec<(f32, f32)>)>;

/// The table of `layer_idx`'s angles at `positions`, from `tables` or computed into it,
/// for a context (KV cache) of `context` positions: beyond the model's original context,
/// Phi-3 rotates with its long factors, as llama.cpp does for a context that long.
pub(crate) fn rope_table<'t, I: Iterator<Item = usize>>(
    tables: &'t mut RopeTables,
    config: &ModelConfig,
    layer: &LayerPlan,
    layer_idx: usize,
    context: usize,
    positions: impl FnOnce() -> I,
) -> Result<&'t [(f32, f32)], ModelError> {
    let attn_cfg = config.layers[layer_idx];
    let key = (
        attn_cfg.rope_freq_base.to_bits(),
        attn_cfg.rope_scale.to_bits(),
    );
    let at = match tables.iter().position(|(k, _)| *k == key) {
        Some(at) => at,
        None => {
            let factors = layer
                .rope_freqs
                .as_ref()
                .or(if context > config.rope_original_context {
                    layer.rope_factors_long.as_ref()
                } else {
                    layer.rope_factors_short.as_ref()
                });
            let freq_factors = factors.map(vector).transpose()?;
            let table = ops::rope_table(
                positions(),
                config.rope_dims,
                attn_cfg.rope_freq_base,
                attn_cfg.rope_scale,
                freq_factors.as_deref(),
                config.rope_attn_factor,
                config.rope_yarn.as_ref(),
            );
            tables.push((key, table));
            tables.len() - 1
        }
    };
    Ok(&tables[at].1)
}

/// `offload` for one call, the option kept for the next.
pub(crate) fn reborrow<'s>(
    offload: &'s mut Option<&mut (dyn RowOffload + Send)>,
) -> Option<&'s mut (dyn RowOffload + Send + 's)> {
    match offload {
        Some(o) => Some(&mut **o),
        None => None,
    }
}

/// Runs the residual stream `x` (`n_embd` values per row) through transformer block
/// `layer_idx`: its attention block, then its feed-forward block. With `carry_last`,
/// `x` keeps only the rows that get logits (see [`Kv::attend`]); it may then be empty.
/// With `offload`, the first rows of each product are computed on its side.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer(
    config: &ModelConfig,
    layer: &LayerPlan,
    layer_idx: usize,
    x: &mut Vec<f32>,
    kv: &mut Kv<'_, '_>,
    carry_last: bool,
    s: &mut Scratch,
    mut offload: Option<&mut (dyn RowOffload + Send)>,
) -> Result<(), ModelError> {
    // Architectures whose last layer runs every row narrow them after it.
    let late = carry_last && config.full_last_layer;
    attention_block(
        config,
        layer,
        layer_idx,
        x,
        kv,
        carry_last && !late,
        s,
        reborrow(&mut offload),
    )?;
    if x.is_empty() {
        return Ok(());
    }
    ffn_block(config, layer, x, s, offload)?;
    if late {
        let e = config.n_embd;
        let rows = kv.logit_rows(x.len() / e);
        *x = rows
            .iter()
            .flat_map(|&r| x[r * e..(r + 1) * e].iter().copied())
            .collect();
    }
    Ok(())
}

/// The attention block: `x += post_norm(W_o · attention(rope(W_qkv · norm(x))))`.
#[allow(clippy::too_many_arguments)]
fn attention_block(
    config: &ModelConfig,
    layer: &LayerPlan,
    layer_idx: usize,
    x: &mut Vec<f32>,
    kv: &mut Kv<'_, '_>,
    carry_last: bool,
    s: &mut Scratch,
    mut offload: Option<&mut (dyn RowOffload + Send)>,
) -> Result<(), ModelError> {
    let n = x.len() / config.n_embd;
    let eps = config.rms_norm_eps;
    resize(&mut s.h, x.len());
    ops::rms_norm(x, &vector(&layer.attn_norm)?, eps, &mut s.h);
    split_linears(
        reborrow(&mut offload),
        [&layer.wq, &layer.wk, &layer.wv],
        &s.h,
        n,
        [&mut s.q, &mut s.k, &mut s.v],
    )?;
    if let Some(norm) = &layer.q_norm {
        ops::rms_norm_in_place(&mut s.q, &vector(norm)?, eps);
    }
    if let Some(norm) = &layer.k_norm {
        ops::rms_norm_in_place(&mut s.k, &vector(norm)?, eps);
    }
    let table = rope_table(
        &mut s.rope,
        config,
        layer,
        layer_idx,
        kv.rope_context(),
        || kv.positions(n).into_iter(),
    )?;
    for m in [&mut s.q, &mut s.k] {
        ops::apply_rope(
            m,
            config.head_dim,
            config.rope_dims,
            config.rope_style,
            table,
        );
    }
    if config.scale_queries {
        for q in s.q.iter_mut() {
            *q *= config.attention_scale;
        }
    }
    let out_dim = config.n_heads * config.head_dim_v;
    resize(&mut s.attn, n * out_dim);
    let sinks = layer.attn_sinks.as_ref().map(vector).transpose()?;
    let carry = kv.attend(
        config,
        layer_idx,
        sinks.as_deref(),
        &mut s.q,
        &mut s.k,
        &mut s.v,
        &mut s.attn,
        carry_last,
    );
    if let Carry::Rows(rows) = carry {
        let e = config.n_embd;
        *x = rows
            .iter()
            .flat_map(|&r| x[r * e..(r + 1) * e].iter().copied())
            .collect();
        s.attn = rows
            .iter()
            .flat_map(|&r| s.attn[r * out_dim..(r + 1) * out_dim].iter().copied())
            .collect();
    }
    let n = x.len() / config.n_embd;
    if n == 0 {
        return Ok(());
    }
    split_linears(offload, [&layer.wo], &s.attn, n, [&mut s.proj])?;
    if let Some(norm) = &layer.post_attn_norm {
        ops::rms_norm_in_place(&mut s.proj, &vector(norm)?, eps);
    }
    add(x, &s.proj);
    Ok(())
}

/// The feed-forward block: `x += post_norm(W_down · act(W_gate · h) ⊙ (W_up · h))` with
/// `h = norm(x)`, or for a mixture of experts `x += Σ w_r · expert_r(h)`.
fn ffn_block(
    config: &ModelConfig,
    layer: &LayerPlan,
    x: &mut [f32],
    s: &mut Scratch,
    mut offload: Option<&mut (dyn RowOffload + Send)>,
) -> Result<(), ModelError> {
    let n = x.len() / config.n_embd;
    let eps = config.rms_norm_eps;
    resize(&mut s.h, x.len());
    ops::rms_norm(x, &vector(&layer.ffn_norm)?, eps, &mut s.h);
    let ffn = match &layer.ffn {
        FfnPlan::Dense(ffn) => ffn,
        FfnPlan::Experts(plan) => {
            if offload.is_some() {
                return Err(ModelError::GpuUnsupported {
                    what: "a mixture-of-experts layer".to_owned(),
                    supported: "dense layers".to_owned(),
                });
            }
            experts_block(plan, &s.h, n, &mut s.moe, &mut s.proj)?;
            add(x, &s.proj);
            return Ok(());
        }
    };
    split_linears(
        reborrow(&mut offload),
        [&ffn.gate, &ffn.up],
        &s.h,
        n,
        [&mut s.gate, &mut s.up],
    )?;
    match config.activation {
        Activation::Silu => ops::swiglu(&mut s.gate, &s.up, config.n_ff),
        Activation::GeluTanh => ops::geglu(&mut s.gate, &s.up),
    }
    split_linears(offload, [&ffn.down], &s.gate, n, [&mut s.proj])?;
    if let Some(norm) = &layer.post_ffn_norm {
        ops::rms_norm_in_place(&mut s.proj, &vector(norm)?, eps);
    }
    add(x, &s.proj);
    Ok(())
}
