//! The attention block of a layer: the queries, keys and values, their rotation into
//! the KV cache, attention over one sequence's positions or a paged batch's blocks, and
//! the output projection into the residual stream.

use dequant::gpu::matvec::{self, q8_bytes};
use hip_backend::Stream;

use super::buffers::{pages, Buffers, Layout, PagedBatch};
use super::products::{batched, matvec_error, needs, products, residual, takes_q8_for, Residual};
use super::{view, view_at, view_mut, view_mut_at};
use crate::config::{ModelConfig, RopeStyle};
use crate::gpu::kernels::{self, AttentionShape, HeadExtras, HeadShape};
use crate::gpu::weights::{LayerWeights, Matrix};
use crate::gpu::MAX_BATCH;
use crate::ModelError;

/// The attention block of layer `layer_idx` over the `n` tokens in `x`, its output
/// added to `x`.
pub(super) fn block(
    config: &ModelConfig,
    layer_idx: usize,
    w: &LayerWeights,
    bufs: &mut Buffers,
    n: usize,
    layout: Layout<'_>,
    stream: &Stream,
) -> Result<(), ModelError> {
    let c = config;
    let eps = c.rms_norm_eps;
    let attn_dim = c.n_heads * c.head_dim_v;
    qkv(c, w, bufs, n, stream)?;
    rope_kv(c, layer_idx, w, bufs, n, layout, stream)?;
    let fused_q8 = attend(c, layer_idx, w, bufs, n, layout, stream)?;
    let post_attn = w.post_attn_norm.as_ref();
    project(
        &w.wo,
        w.bo.as_ref().map(|b| b.view()).transpose()?,
        attn_dim,
        fused_q8,
        post_attn.map(|n| n.weight()),
        bufs,
        n,
        eps,
        stream,
    )?;
    Ok(())
}

/// The queries, keys and values of the `n` tokens in `x`, through the attention's norm.
fn qkv(
    c: &ModelConfig,
    w: &LayerWeights,
    bufs: &mut Buffers,
    n: usize,
    stream: &Stream,
) -> Result<(), ModelError> {
    let d = c.n_embd;
    let eps = c.rms_norm_eps;
    let q_dim = c.n_heads * c.head_dim;
    let kv_dim = c.n_kv_heads * c.head_dim;
    let v_dim = c.n_kv_heads * c.head_dim_v;
    let qkv = [&w.wq, &w.wk, &w.wv];
    let (want_f32, want_q8) = needs(&qkv, n, &bufs.batch_in);
    let out = want_f32
        .then(|| view_mut::<f32>(&mut bufs.h, n * d))
        .transpose()?;
    let out_q8 = want_q8
        .then(|| view_mut::<u8>(&mut bufs.q8, q8_bytes(n, d)))
        .transpose()?;
    match bufs.pending_sum.take() {
        // The last layer's experts, summed into x on the way.
        Some(used) => {
            let Some(moe) = bufs.moe.as_ref() else {
                unreachable!("a pending sum is a mixture of experts'")
            };
            let sum = kernels::SlotSum {
                outputs: view(&moe.out, n * used * d)?,
                weights: view(&moe.weights, n * used)?,
                used,
            };
            let x = view_mut::<f32>(&mut bufs.x, n * d)?;
            let norm = w.attn_norm.weight();
            kernels::rms_norm_summed(x, sum, norm, n, d, eps, out, false, out_q8, stream)?;
        }
        None => {
            let x = view(&bufs.x, n * d)?;
            kernels::rms_norm(
                x,
                w.attn_norm.weight(),
                n,
                d,
                eps,
                out,
                false,
                out_q8,
                stream,
            )?;
        }
    }
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
    Ok(())
}

/// The queries rotated in place, and the keys (rotated) and values written into layer
/// `layer_idx`'s cache at their positions (`layout`), with the layer's biases, norms and
/// RoPE factors.
fn rope_kv(
    c: &ModelConfig,
    layer_idx: usize,
    w: &LayerWeights,
    bufs: &mut Buffers,
    n: usize,
    layout: Layout<'_>,
    stream: &Stream,
) -> Result<(), ModelError> {
    let eps = c.rms_norm_eps;
    let q_dim = c.n_heads * c.head_dim;
    let kv_dim = c.n_kv_heads * c.head_dim;
    let v_dim = c.n_kv_heads * c.head_dim_v;
    let layer_cfg = c.layers[layer_idx];
    let (yarn, attn_factor) = crate::ops::yarn_mix(
        c.rope_dims,
        layer_cfg.rope_freq_base,
        layer_cfg.rope_scale,
        c.rope_attn_factor,
        c.rope_yarn.as_ref(),
    );
    let head_shape = HeadShape {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        head_dim_v: c.head_dim_v,
        rope_dims: c.rope_dims,
        neox: c.rope_style == RopeStyle::Halves,
        theta_scale: layer_cfg.rope_freq_base.powf(-2.0 / c.rope_dims as f32),
        freq_scale: 1.0 / layer_cfg.rope_scale,
        attn_factor,
        yarn,
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
    let token_pages = match layout {
        Layout::Contiguous => None,
        Layout::Paged(batch) => Some(pages(&bufs.meta, batch, 0..n)?),
    };
    let q = view_mut::<f32>(&mut bufs.q, n * q_dim)?;
    let (k, v) = (view(&bufs.k, n * kv_dim)?, view(&bufs.v, n * v_dim)?);
    let pos = view(&bufs.pos, 1)?;
    let (k_cache, v_cache) = bufs.kv.views_mut(layer_idx)?;
    kernels::qk_rope_kv(
        q,
        k,
        v,
        extras,
        &head_shape,
        n,
        pos,
        token_pages,
        k_cache,
        v_cache,
        stream,
    )?;
    Ok(())
}

/// Attention of the `n` queries over layer `layer_idx`'s cache into `attn`: one launch
/// tiled over a prompt's chunk, split along the keys for a few tokens, or a paged
/// batch's sequences on their blocks. Returns whether the output's Q8 blocks were
/// written too, for the output projection.
fn attend(
    c: &ModelConfig,
    layer_idx: usize,
    w: &LayerWeights,
    bufs: &mut Buffers,
    n: usize,
    layout: Layout<'_>,
    stream: &Stream,
) -> Result<bool, ModelError> {
    let q_dim = c.n_heads * c.head_dim;
    let attn_dim = c.n_heads * c.head_dim_v;
    let layer_cfg = c.layers[layer_idx];
    let shape = AttentionShape {
        window: layer_cfg.sliding_window,
        ..bufs.attention
    };
    let sinks = w.sinks.as_ref().map(|s| s.view()).transpose()?;
    // The attention's output goes to the output projection quantized when it takes Q8
    // blocks and the heads are whole blocks: the attention kernel quantizes it itself.
    let fused_q8 = takes_q8_for(&w.wo, n, &bufs.batch_in) && c.head_dim_v.is_multiple_of(32);
    if let Layout::Paged(batch) = layout {
        paged_attention(batch, layer_idx, &shape, sinks, fused_q8, bufs, stream)?;
    } else if batched(n) {
        // A prompt's chunk: one launch over every query, tiled over queries and keys.
        let (k_cache, v_cache) = bufs.kv.views(layer_idx)?;
        kernels::flash_attention(
            view(&bufs.q, n * q_dim)?,
            k_cache,
            v_cache,
            &shape,
            sinks,
            n,
            view(&bufs.pos, 1)?,
            None,
            view_mut::<f32>(&mut bufs.attn, n * attn_dim)?,
            bufs.flash_mma,
            stream,
        )?;
        turn_back(bufs, c.head_dim_v, 0..n, stream)?;
    } else {
        // A few tokens (at most MAX_BATCH, the scratch the split attention has room for):
        // each query split along the keys, so that a short chunk still fills the device.
        let (k_cache, v_cache) = bufs.kv.views(layer_idx)?;
        kernels::attention(
            view(&bufs.q, n * q_dim)?,
            k_cache,
            v_cache,
            &shape,
            sinks,
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
    Ok(fused_q8)
}

/// Attention of a paged batch: a sequence with more than [`MAX_BATCH`] tokens in one
/// launch tiled over its queries; the others' rows together, split along the keys, in
/// launches of at most `attn_rows` rows. `fused_q8` (the Q8 blocks of the output too)
/// only when every row fits one launch.
fn paged_attention(
    batch: &PagedBatch,
    layer_idx: usize,
    shape: &AttentionShape,
    sinks: Option<hip_backend::DeviceView<'_, f32>>,
    fused_q8: bool,
    bufs: &mut Buffers,
    stream: &Stream,
) -> Result<(), ModelError> {
    let n = batch.n_tokens;
    let q_dim = shape.n_heads * shape.head_dim;
    let attn_dim = shape.n_heads * shape.head_dim_v;
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
        let (k_cache, v_cache) = bufs.kv.views(layer_idx)?;
        kernels::attention(
            view_at(&bufs.q, rows.start * q_dim..rows.end * q_dim)?,
            k_cache,
            v_cache,
            shape,
            sinks,
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
        let (k_cache, v_cache) = bufs.kv.views(layer_idx)?;
        kernels::flash_attention(
            view_at(&bufs.q, rows.start * q_dim..rows.end * q_dim)?,
            k_cache,
            v_cache,
            shape,
            sinks,
            seg.len,
            view_at::<i32>(&bufs.meta, rows.start..rows.start + 1)?,
            Some((view_at::<i32>(&bufs.meta, table)?, batch.block_shift)),
            view_mut_at::<f32>(&mut bufs.attn, rows.start * attn_dim..rows.end * attn_dim)?,
            bufs.flash_mma,
            stream,
        )?;
        turn_back(bufs, shape.head_dim_v, rows, stream)?;
    }
    if let Some(p) = pending {
        split(p, bufs)?;
    }
    Ok(())
}

/// Turns the tiled attention's output of rows `rows` back out of the rotation a
/// quantized value cache holds its values in (the split kernel turns its own back).
fn turn_back(
    bufs: &mut Buffers,
    head_dim_v: usize,
    rows: std::ops::Range<usize>,
    stream: &Stream,
) -> Result<(), ModelError> {
    if bufs.kv.types.v_rotation(head_dim_v).is_none() {
        return Ok(());
    }
    let width = bufs.attention.n_heads * head_dim_v;
    let out = view_mut_at::<f32>(&mut bufs.attn, rows.start * width..rows.end * width)?;
    kernels::hadamard64(out, stream)?;
    Ok(())
}

/// The output projection of attention: quantizes `attn` (`width` per token) when the
/// matrix takes Q8 blocks and the attention kernel has not (`quantized`), then adds the
/// product and its `bias` to the residual stream.
#[allow(clippy::too_many_arguments)]
fn project(
    m: &Matrix,
    bias: Option<hip_backend::DeviceView<'_, f32>>,
    width: usize,
    quantized: bool,
    post_norm: Option<kernels::NormWeight<'_>>,
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
        team: bufs.team.as_ref(),
    };
    residual(m, bias, f32_in, q8_in, post_norm, into, n, eps, stream)
}
