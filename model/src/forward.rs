//! The CPU forward pass: weights read straight from the mapped file, multiplied on their
//! quantized blocks.

use std::borrow::Cow;

use dequant::matmul::QuantizedMatrix;
use tensor_store::TensorHandle;

use crate::config::{Activation, ModelConfig};
use crate::kv_cache::KvCache;
use crate::offload::{split_linears, RowOffload};
use crate::ops::{self, AttentionShape};
use crate::plan::{ExecutionPlan, LayerPlan, Linear, Vector};
use crate::ModelError;

/// Which positions of a batch get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position (generation).
    Last,
    /// Every position (scoring, teacher forcing).
    All,
}

/// Runs `tokens` through the model after the positions already in `cache`, appends their
/// keys and values to it, and returns `n_vocab` logits per requested position.
pub(crate) fn forward(
    config: &ModelConfig,
    plan: &ExecutionPlan,
    tokens: &[u32],
    cache: &mut KvCache,
    logits: Logits,
) -> Result<Vec<f32>, ModelError> {
    if tokens.is_empty() {
        return Err(ModelError::EmptyInput);
    }
    cache.check_room(tokens.len())?;
    let first_pos = cache.len();
    let result = on_the_pool(|| run_layers(config, plan, tokens, cache, first_pos, logits));
    match result {
        Ok(mut x) => {
            cache.commit(tokens.len());
            let mut logits = Vec::new();
            output_logits(config, plan, &mut x, &mut logits)?;
            Ok(logits)
        }
        Err(e) => {
            // Leave the cache as it was before the failed batch.
            cache.truncate(first_pos);
            Err(e)
        }
    }
}

/// Runs `work` on one of rayon's worker threads. A forward pass starts a few hundred
/// parallel loops (each product, each attention); started from a thread outside the
/// pool, each one hands its work over and puts the caller to sleep until it is done,
/// and those handovers cost more than a small model's products at decode time. From a
/// worker, a loop starts where the worker stands and only the other workers are woken.
pub(crate) fn on_the_pool<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        work()
    } else {
        rayon::join(work, || ()).0
    }
}

/// The tracing target of the event the forward pass of a batch of several tokens emits
/// after each layer, with fields `layer` (1-based), `layers` and `tokens`.
pub const PROGRESS_TARGET: &str = "model::progress";

fn run_layers(
    config: &ModelConfig,
    plan: &ExecutionPlan,
    tokens: &[u32],
    cache: &mut KvCache,
    first_pos: usize,
    logits: Logits,
) -> Result<Vec<f32>, ModelError> {
    let _span = tracing::debug_span!("forward", n_tokens = tokens.len(), first_pos).entered();
    let mut x = embed(config, &plan.token_embd, tokens)?;
    let mut scratch = Scratch::default();
    let last = plan.layers.len() - 1;
    for (layer_idx, layer) in plan.layers.iter().enumerate() {
        // After the last layer's attention only the positions that get logits matter.
        let rows = if layer_idx == last && logits == Logits::Last {
            Rows::Last
        } else {
            Rows::All
        };
        let batch = Batch { first_pos, rows };
        layer_forward(
            config,
            layer,
            layer_idx,
            &mut x,
            cache,
            batch,
            &mut scratch,
            None,
        )?;
        if tokens.len() > 1 {
            // Progress of a prompt, for a front end that shows it (one event per layer;
            // a long prompt spends seconds in each).
            tracing::trace!(
                target: PROGRESS_TARGET,
                layer = layer_idx + 1,
                layers = plan.layers.len(),
                tokens = tokens.len(),
                "layer done"
            );
        }
    }
    Ok(x)
}

/// Runs the residual stream `x` (`n_embd` values per token) of tokens at positions
/// `cache.len()..` through the transformer blocks `layers`, appending their keys and
/// values to those layers of `cache` without committing them: the caller commits once
/// every layer of the batch has its rows. Every position's row comes out (no layer drops
/// rows), stopping before a layer once `stop` is set. A GPU model whose budget is smaller than its weights computes the blocks it
/// does not hold with this, on the mapped file, for a few tokens at a time, with the
/// first rows of their products on the device when `offload` is given.
pub(crate) fn layers_on_host(
    config: &ModelConfig,
    plan: &ExecutionPlan,
    layers: std::ops::Range<usize>,
    x: &mut Vec<f32>,
    cache: &mut KvCache,
    stop: Option<&std::sync::atomic::AtomicBool>,
    mut offload: Option<&mut (dyn RowOffload + Send)>,
) -> Result<(), ModelError> {
    let n = x.len() / config.n_embd.max(1);
    cache.check_room(n)?;
    let batch = Batch {
        first_pos: cache.len(),
        rows: Rows::All,
    };
    on_the_pool(|| {
        let mut scratch = Scratch::default();
        for layer_idx in layers {
            if stop.is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed)) {
                return Err(ModelError::Interrupted);
            }
            let layer = &plan.layers[layer_idx];
            let offload = reborrow(&mut offload);
            layer_forward(
                config,
                layer,
                layer_idx,
                x,
                cache,
                batch,
                &mut scratch,
                offload,
            )?;
        }
        Ok(())
    })
}

/// `offload` for one call, the option kept for the next.
fn reborrow<'s>(
    offload: &'s mut Option<&mut (dyn RowOffload + Send)>,
) -> Option<&'s mut (dyn RowOffload + Send + 's)> {
    match offload {
        Some(o) => Some(&mut **o),
        None => None,
    }
}

/// Where a batch stands and what a layer keeps of it.
#[derive(Clone, Copy)]
struct Batch {
    /// Position of the batch's first token.
    first_pos: usize,
    rows: Rows,
}

/// Which positions of a batch a layer carries past its attention.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rows {
    All,
    /// Only the last: its residual stream alone goes through the output projection and
    /// the feed-forward block. This saves their work for the other positions of a
    /// prompt, and it is what llama.cpp does, so the matrix products there see one token
    /// and take the same kernels (and roundings) as llama.cpp's.
    Last,
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
            );
            tables.push((key, table));
            tables.len() - 1
        }
    };
    Ok(&tables[at].1)
}

#[allow(clippy::too_many_arguments)]
fn layer_forward(
    config: &ModelConfig,
    layer: &LayerPlan,
    layer_idx: usize,
    x: &mut Vec<f32>,
    cache: &mut KvCache,
    batch: Batch,
    s: &mut Scratch,
    mut offload: Option<&mut (dyn RowOffload + Send)>,
) -> Result<(), ModelError> {
    let Batch { first_pos, rows } = batch;
    let n = x.len() / config.n_embd;
    let eps = config.rms_norm_eps;
    let attn_cfg = config.layers[layer_idx];

    // Attention block.
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
        cache.capacity(),
        || first_pos..first_pos + n,
    )?;
    ops::apply_rope(
        &mut s.q,
        config.head_dim,
        config.rope_dims,
        config.rope_style,
        table,
    );
    ops::apply_rope(
        &mut s.k,
        config.head_dim,
        config.rope_dims,
        config.rope_style,
        table,
    );
    if config.scale_queries {
        for q in s.q.iter_mut() {
            *q *= config.attention_scale;
        }
    }
    cache.append(layer_idx, &s.k, &s.v);
    let (keys, values) = cache.layer(layer_idx);
    resize(&mut s.attn, n * config.n_heads * config.head_dim_v);
    let shape = AttentionShape {
        n_heads: config.n_heads,
        n_kv_heads: config.n_kv_heads,
        head_dim: config.head_dim,
        head_dim_v: config.head_dim_v,
        first_pos,
        window: attn_cfg.sliding_window,
        scale: if config.scale_queries {
            1.0
        } else {
            config.attention_scale
        },
        softcap: config.attn_logit_softcap,
        method: cache.attention(),
        flash: ops::FlashContext {
            context: cache.context(),
            threads: rayon::current_num_threads(),
        },
    };
    ops::attention(&s.q, keys, values, &shape, &mut s.attn);
    let n = if rows == Rows::Last && n > 1 {
        s.attn.drain(..(n - 1) * config.n_heads * config.head_dim_v);
        x.drain(..(n - 1) * config.n_embd);
        1
    } else {
        n
    };
    split_linears(
        reborrow(&mut offload),
        [&layer.wo],
        &s.attn,
        n,
        [&mut s.proj],
    )?;
    if let Some(norm) = &layer.post_attn_norm {
        ops::rms_norm_in_place(&mut s.proj, &vector(norm)?, eps);
    }
    add(x, &s.proj);

    // Feed-forward block.
    resize(&mut s.h, x.len());
    ops::rms_norm(x, &vector(&layer.ffn_norm)?, eps, &mut s.h);
    split_linears(
        reborrow(&mut offload),
        [&layer.gate, &layer.up],
        &s.h,
        n,
        [&mut s.gate, &mut s.up],
    )?;
    match config.activation {
        Activation::Silu => ops::swiglu(&mut s.gate, &s.up, config.n_ff),
        Activation::GeluTanh => ops::geglu(&mut s.gate, &s.up),
    }
    split_linears(offload, [&layer.down], &s.gate, n, [&mut s.proj])?;
    if let Some(norm) = &layer.post_ffn_norm {
        ops::rms_norm_in_place(&mut s.proj, &vector(norm)?, eps);
    }
    add(x, &s.proj);
    Ok(())
}

/// Gathers the embedding rows of `tokens`, decoded, scaled for architectures that ask.
pub(crate) fn embed(
    config: &ModelConfig,
    table: &Linear,
    tokens: &[u32],
) -> Result<Vec<f32>, ModelError> {
    let d = config.n_embd;
    let ty = table.weight.ggml_type();
    let row_bytes = ty.row_bytes(d as u64).unwrap_or(0) as usize;
    let bytes = table.weight.bytes()?;
    let mut x = vec![0f32; tokens.len() * d];
    for (&token, row) in tokens.iter().zip(x.chunks_exact_mut(d)) {
        let id = token as usize;
        if id >= config.n_vocab {
            return Err(ModelError::TokenOutOfRange {
                token,
                n_vocab: config.n_vocab,
            });
        }
        let src = &bytes[id * row_bytes..(id + 1) * row_bytes];
        decode_row(table.weight.name(), ty, src, row)?;
        if config.embedding_scale != 1.0 {
            row.iter_mut().for_each(|v| *v *= config.embedding_scale);
        }
    }
    Ok(x)
}

/// The logits of the residual rows `x`: the final norm, the output projection, and the
/// soft-capping of models that have it (`cap · tanh(l · (1/cap))`, as llama.cpp's graph).
pub(crate) fn output_logits(
    config: &ModelConfig,
    plan: &ExecutionPlan,
    x: &mut [f32],
    logits: &mut Vec<f32>,
) -> Result<(), ModelError> {
    let n = x.len() / config.n_embd;
    ops::rms_norm_in_place(x, &vector(&plan.output_norm)?, config.rms_norm_eps);
    linear(&plan.output, x, n, logits)?;
    if let Some(cap) = config.final_logit_softcap {
        let inv = 1.0 / cap;
        for l in logits.iter_mut() {
            *l = (*l * inv).tanh() * cap;
        }
    }
    Ok(())
}

/// `out = x · Wᵀ (+ bias)` for `n` tokens.
/// Several linear layers of one input. For a single token whose weights share a type
/// and width, one fused product (the activations prepared once, one parallel loop);
/// otherwise one product each. The results are the same bits either way.
pub(crate) fn linears<const K: usize>(
    lins: [&Linear; K],
    x: &[f32],
    n: usize,
    mut outs: [&mut Vec<f32>; K],
) -> Result<(), ModelError> {
    let fusable = n == 1
        && lins
            .iter()
            .all(|l| l.weight.ggml_type() == lins[0].weight.ggml_type() && l.cols == lins[0].cols);
    if !fusable {
        for (lin, out) in lins.iter().zip(outs.iter_mut()) {
            linear(lin, x, n, out)?;
        }
        return Ok(());
    }
    let mut matrices = Vec::with_capacity(K);
    for (lin, out) in lins.iter().zip(outs.iter_mut()) {
        matrices.push(matrix(lin)?);
        resize(out, lin.rows);
    }
    let mut ys = outs.each_mut().map(|o| o.as_mut_slice());
    QuantizedMatrix::matvec_many(&matrices, x, &mut ys).map_err(|source| ModelError::Matmul {
        name: lins
            .iter()
            .map(|l| l.weight.name())
            .collect::<Vec<_>>()
            .join(" + "),
        source,
    })?;
    for (lin, out) in lins.iter().zip(outs.iter_mut()) {
        add_bias(lin, out)?;
    }
    Ok(())
}

/// The weight of `lin` as a matrix over its mapped bytes (its rows' part of them).
fn matrix(lin: &Linear) -> Result<QuantizedMatrix<'_>, ModelError> {
    matrix_rows(lin, 0..lin.rows)
}

/// Rows `rows` of `lin`'s weight as a matrix over its mapped bytes.
pub(crate) fn matrix_rows(
    lin: &Linear,
    rows: std::ops::Range<usize>,
) -> Result<QuantizedMatrix<'_>, ModelError> {
    let mut bytes = lin.weight.bytes()?;
    let whole = lin.rows as u64 == lin.weight.shape().get(1).copied().unwrap_or(1);
    if lin.first_row != 0 || !whole || rows != (0..lin.rows) {
        let ty = lin.weight.ggml_type();
        let row_bytes = ty.row_bytes(lin.cols as u64).unwrap_or(0) as usize;
        let start = (lin.first_row + rows.start) * row_bytes;
        bytes = bytes
            .get(start..start + rows.len() * row_bytes)
            .unwrap_or_default();
    }
    QuantizedMatrix::new(lin.weight.ggml_type(), rows.len(), lin.cols, bytes).map_err(|source| {
        ModelError::Matmul {
            name: lin.weight.name().to_owned(),
            source,
        }
    })
}

/// Adds `lin`'s bias, if it has one, to every token's row of `out`.
pub(crate) fn add_bias(lin: &Linear, out: &mut [f32]) -> Result<(), ModelError> {
    if let Some(bias) = &lin.bias {
        let b = values(bias)?;
        for row in out.chunks_exact_mut(lin.rows) {
            add(row, &b);
        }
    }
    Ok(())
}

pub(crate) fn linear(
    lin: &Linear,
    x: &[f32],
    n: usize,
    out: &mut Vec<f32>,
) -> Result<(), ModelError> {
    resize(out, n * lin.rows);
    matrix(lin)?
        .matmul(x, n, out)
        .map_err(|source| ModelError::Matmul {
            name: lin.weight.name().to_owned(),
            source,
        })?;
    add_bias(lin, out)
}

pub(crate) fn vector(v: &Vector) -> Result<Cow<'_, [f32]>, ModelError> {
    values(&v.handle)
}

/// A small float tensor as f32: borrowed when the bytes are aligned f32, else decoded.
fn values(handle: &TensorHandle) -> Result<Cow<'_, [f32]>, ModelError> {
    let bytes = handle.bytes()?;
    if handle.ggml_type() == gguf_format::GgmlType::F32 {
        if let Ok(floats) = bytemuck::try_cast_slice::<u8, f32>(bytes) {
            return Ok(Cow::Borrowed(floats));
        }
    }
    let mut out = vec![0f32; handle.info().n_elements() as usize];
    decode_row(handle.name(), handle.ggml_type(), bytes, &mut out)?;
    Ok(Cow::Owned(out))
}

pub(crate) fn resize(buf: &mut Vec<f32>, len: usize) {
    buf.clear();
    buf.resize(len, 0.0);
}

pub(crate) fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Decodes whole blocks of `bytes` into `out`, whatever their type.
fn decode_row(
    name: &str,
    ty: gguf_format::GgmlType,
    bytes: &[u8],
    out: &mut [f32],
) -> Result<(), ModelError> {
    dequant::decode_f32(ty, bytes, out).map_err(|source| ModelError::Decode {
        name: name.to_owned(),
        source,
    })
}
