//! The forward pass of one scheduler step: the new tokens of several sequences in one
//! batch, their keys and values in the shared [`KvPool`].
//!
//! Rows of all sequences go through the matrix products together, so each weight block
//! is read once per step whatever the number of sequences (`dequant`'s batch kernels);
//! each sequence's attention runs on its own rows against its own positions, read in
//! place from its blocks in position order. A sequence alone in a step therefore computes what
//! [`crate::Model::forward`] computes for the same tokens: the same products of the same
//! rows, the same attention over the same cache, the last layer carrying only the rows
//! that get logits.

use crate::config::{Activation, ModelConfig};
use crate::forward::{
    add, embed, linear, linears, on_the_pool, output_logits, resize, rope_table, vector, RopeTables,
};
use crate::ops::{self, AttentionShape, Layout};
use crate::plan::{ExecutionPlan, LayerPlan};
use crate::ModelError;

use super::pool::{BlockId, KvPool};

/// One sequence's part of a step.
/// What a sequence's single-sequence cache would be: its size in positions (which
/// chooses Phi-3's RoPE factors and bounds flash attention's view of it) and how its
/// attention is computed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Context {
    pub size: usize,
    pub attention: ops::AttentionMethod,
}

pub(crate) struct Segment<'a> {
    /// Tokens to run, at positions `first_pos..first_pos + tokens.len()`.
    pub tokens: &'a [u32],
    pub first_pos: usize,
    /// The sequence's blocks, covering every position up to the last of `tokens`.
    pub table: &'a [BlockId],
    /// Whether the last token gets logits.
    pub logits: bool,
}

/// Runs every segment's tokens and leaves in `logits` (a buffer kept from step to step,
/// so that its pages stay mapped) `n_vocab` logits for each segment that asks, in
/// segment order.
/// `context` is what a KV cache of [`crate::Model::forward`] would be for one sequence.
pub(crate) fn forward_batch(
    config: &ModelConfig,
    plan: &ExecutionPlan,
    pool: &mut KvPool,
    segments: &[Segment<'_>],
    context: Context,
    logits: &mut Vec<f32>,
) -> Result<(), ModelError> {
    logits.clear();
    if segments.iter().all(|s| s.tokens.is_empty()) {
        return Err(ModelError::EmptyInput);
    }
    on_the_pool(|| run(config, plan, pool, segments, context, logits))
}

#[derive(Default)]
struct Buffers {
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    rope: RopeTables,
}

fn run(
    config: &ModelConfig,
    plan: &ExecutionPlan,
    pool: &mut KvPool,
    segments: &[Segment<'_>],
    context: Context,
    logits: &mut Vec<f32>,
) -> Result<(), ModelError> {
    let tokens: Vec<u32> = segments
        .iter()
        .flat_map(|s| s.tokens.iter().copied())
        .collect();
    let _span = tracing::debug_span!(
        "step",
        n_tokens = tokens.len(),
        n_sequences = segments.len()
    )
    .entered();
    let mut x = embed(config, &plan.token_embd, &tokens)?;
    let mut b = Buffers::default();
    let last = plan.layers.len() - 1;
    for (layer_idx, layer) in plan.layers.iter().enumerate() {
        layer_forward(
            config,
            layer,
            layer_idx,
            layer_idx == last,
            &mut x,
            pool,
            segments,
            context,
            &mut b,
        )?;
    }
    let n = x.len() / config.n_embd;
    if n == 0 {
        return Ok(());
    }
    output_logits(config, plan, &mut x, logits)
}

#[allow(clippy::too_many_arguments)]
fn layer_forward(
    config: &ModelConfig,
    layer: &LayerPlan,
    layer_idx: usize,
    is_last: bool,
    x: &mut Vec<f32>,
    pool: &mut KvPool,
    segments: &[Segment<'_>],
    context: Context,
    b: &mut Buffers,
) -> Result<(), ModelError> {
    let n = x.len() / config.n_embd;
    let eps = config.rms_norm_eps;
    let attn_cfg = config.layers[layer_idx];
    let (q_dim, k_dim, v_dim) = (
        config.n_heads * config.head_dim,
        config.n_kv_heads * config.head_dim,
        config.n_kv_heads * config.head_dim_v,
    );
    let out_dim = config.n_heads * config.head_dim_v;

    resize(&mut b.h, x.len());
    ops::rms_norm(x, &vector(&layer.attn_norm)?, eps, &mut b.h);
    linears(
        [&layer.wq, &layer.wk, &layer.wv],
        &b.h,
        n,
        [&mut b.q, &mut b.k, &mut b.v],
    )?;
    if let Some(norm) = &layer.q_norm {
        ops::rms_norm_in_place(&mut b.q, &vector(norm)?, eps);
    }
    if let Some(norm) = &layer.k_norm {
        ops::rms_norm_in_place(&mut b.k, &vector(norm)?, eps);
    }
    let table = rope_table(&mut b.rope, config, layer, layer_idx, context.size, || {
        segments
            .iter()
            .flat_map(|s| s.first_pos..s.first_pos + s.tokens.len())
    })?;
    ops::apply_rope(
        &mut b.q,
        config.head_dim,
        config.rope_dims,
        config.rope_style,
        table,
    );
    ops::apply_rope(
        &mut b.k,
        config.head_dim,
        config.rope_dims,
        config.rope_style,
        table,
    );
    if config.scale_queries {
        for q in b.q.iter_mut() {
            *q *= config.attention_scale;
        }
    }

    // Attention, one sequence at a time; in the last layer only the rows that get
    // logits are kept past it.
    resize(&mut b.attn, n * out_dim);
    let mut kept_x = Vec::new();
    let mut kept_attn = Vec::new();
    let mut row = 0;
    for seg in segments {
        let len = seg.tokens.len();
        if len == 0 {
            continue;
        }
        let rows = row..row + len;
        pool.write(
            layer_idx,
            seg.table,
            seg.first_pos,
            &b.k[rows.start * k_dim..rows.end * k_dim],
            &b.v[rows.start * v_dim..rows.end * v_dim],
        );
        let shape = AttentionShape {
            n_heads: config.n_heads,
            n_kv_heads: config.n_kv_heads,
            head_dim: config.head_dim,
            head_dim_v: config.head_dim_v,
            first_pos: seg.first_pos,
            window: attn_cfg.sliding_window,
            scale: if config.scale_queries {
                1.0
            } else {
                config.attention_scale
            },
            softcap: config.attn_logit_softcap,
            method: context.attention,
            flash: ops::FlashContext {
                context: context.size,
                threads: rayon::current_num_threads(),
            },
        };
        let out = &mut b.attn[rows.start * out_dim..rows.end * out_dim];
        let (keys, values) = pool.layer(layer_idx);
        let layout = Layout::Paged {
            table: seg.table,
            block_size: pool.block_size(),
        };
        if is_last {
            if seg.logits {
                // Only the last row matters: attend with it alone would change the
                // lanes (a single token takes the dot-product path), so attend with
                // every row, as the single-sequence pass does, and keep the last.
                ops::attention_in(
                    &b.q[rows.start * q_dim..rows.end * q_dim],
                    keys,
                    values,
                    &shape,
                    layout,
                    out,
                );
                kept_attn.extend_from_slice(&out[(len - 1) * out_dim..]);
                let e = config.n_embd;
                kept_x.extend_from_slice(&x[(rows.end - 1) * e..rows.end * e]);
            }
        } else {
            ops::attention_in(
                &b.q[rows.start * q_dim..rows.end * q_dim],
                keys,
                values,
                &shape,
                layout,
                out,
            );
        }
        row = rows.end;
    }
    let n = if is_last {
        *x = kept_x;
        b.attn = kept_attn;
        x.len() / config.n_embd
    } else {
        n
    };
    if n == 0 {
        return Ok(());
    }
    linear(&layer.wo, &b.attn, n, &mut b.proj)?;
    if let Some(norm) = &layer.post_attn_norm {
        ops::rms_norm_in_place(&mut b.proj, &vector(norm)?, eps);
    }
    add(x, &b.proj);

    resize(&mut b.h, x.len());
    ops::rms_norm(x, &vector(&layer.ffn_norm)?, eps, &mut b.h);
    linears([&layer.gate, &layer.up], &b.h, n, [&mut b.gate, &mut b.up])?;
    match config.activation {
        Activation::Silu => ops::swiglu(&mut b.gate, &b.up, config.n_ff),
        Activation::GeluTanh => ops::geglu(&mut b.gate, &b.up),
    }
    linear(&layer.down, &b.gate, n, &mut b.proj)?;
    if let Some(norm) = &layer.post_ffn_norm {
        ops::rms_norm_in_place(&mut b.proj, &vector(norm)?, eps);
    }
    add(x, &b.proj);
    Ok(())
}
