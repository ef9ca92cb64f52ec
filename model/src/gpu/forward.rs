//! The layer's work on the GPU, queued on a stream: the buffers it runs in and the
//! sequence of kernels, the same for a captured decode step and for a prompt's chunks.

mod attention;
mod buffers;
mod experts;
mod ffn;
mod pooled;
mod products;
mod routing;

use std::sync::atomic::AtomicBool;

use dequant::gpu::matvec::{self, q8_bytes};
use gguf_format::GgmlType;
use hip_backend::{ArenaBuffer, DeviceView, DeviceViewMut, Stream};

use super::kernels;
use super::weights::{FfnWeights, Globals, LayerWeights};
use super::{gpu, MAX_BATCH};
use crate::config::ModelConfig;
use crate::plan::ExecutionPlan;
use crate::ModelError;
pub(super) use buffers::{Buffers, Layout, PageShape, PagedBatch, PagedSegment};
use ffn::dense_ffn;
pub(super) use products::product_error;
use products::{needs, products, takes_q8_for, SKINNY_FROM};

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

/// One transformer block over the `n` tokens in `x`. `next_follows`: the caller runs the
/// next layer right after this one, on the same stream (which may then add this layer's
/// last sum to `x` in its first launch: `Buffers::pending_sum`).
#[allow(clippy::too_many_arguments)]
pub(super) fn layer(
    config: &ModelConfig,
    layer_idx: usize,
    w: &LayerWeights,
    bufs: &mut Buffers,
    n: usize,
    layout: Layout<'_>,
    next_follows: bool,
    stream: &Stream,
) -> Result<(), ModelError> {
    let c = config;
    attention::block(c, layer_idx, w, bufs, n, layout, stream)?;

    // Feed-forward block.
    let post_ffn = w.post_ffn_norm.as_ref().map(|n| n.weight());
    match &w.ffn {
        FfnWeights::Dense { gate, up, down } => {
            dense_ffn(c, [gate, up, down], &w.ffn_norm, post_ffn, bufs, n, stream)
        }
        FfnWeights::Experts(e) => experts::block(c, e, &w.ffn_norm, bufs, n, next_follows, stream),
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
    let Some(head) = &globals.head else {
        unreachable!("logits are computed by the part of the model that has the head")
    };
    let out = &head.output;
    let (want_f32, want_q8) = needs(&[out], rows, &bufs.batch_in);
    kernels::rms_norm(
        input,
        head.output_norm.weight(),
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
    advance(bufs, n, stream)
}

/// The whole forward pass of `n` tokens with every weight held (of a stage of a layer
/// split without the head: its layers, and the position advanced).
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
    if globals.head.is_none() {
        return advance(bufs, n, stream);
    }
    finish(config, globals, bufs, n, last_only, stream)?;
    tail(config, bufs, n, last_only, stream)
}

/// The position advanced past `n` tokens.
pub(super) fn advance(bufs: &mut Buffers, n: usize, stream: &Stream) -> Result<(), ModelError> {
    kernels::advance(view_mut::<i32>(&mut bufs.pos, 1)?, n, stream)?;
    Ok(())
}

/// The embeddings (where this part of the model makes them: a later stage of a layer
/// split finds its residual stream copied in) and every transformer block of `n` tokens
/// laid out as `layout`, with every weight held; stopping before a layer once `stop` is
/// set.
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
    // (A pass stopped between two layers may have left a sum for the next.)
    bufs.pending_sum = None;
    if globals.token_embd.is_some() {
        embed(config, globals, bufs, n, stream)?;
    }
    for (layer_idx, w) in layers.iter().enumerate() {
        super::check_stop(stop)?;
        let next_follows = layer_idx + 1 < layers.len();
        layer(config, layer_idx, w, bufs, n, layout, next_follows, stream)?;
    }
    debug_assert!(bufs.pending_sum.is_none(), "the last layer leaves no sum");
    Ok(())
}

/// The first `len` elements of an arena buffer, as `T`.
fn view<T: bytemuck::Pod>(buf: &ArenaBuffer, len: usize) -> Result<DeviceView<'_, T>, ModelError> {
    buf.view::<T>()
        .and_then(|v| v.slice(0..len))
        .map_err(gpu("viewing a buffer"))
}

/// Elements `range` of an arena buffer, as `T`.
fn view_at<T: bytemuck::Pod>(
    buf: &ArenaBuffer,
    range: std::ops::Range<usize>,
) -> Result<DeviceView<'_, T>, ModelError> {
    buf.view::<T>()
        .and_then(|v| v.slice(range))
        .map_err(gpu("viewing a buffer"))
}

/// The first `len` elements of an arena buffer, as `T`, to write.
fn view_mut<T: bytemuck::Pod>(
    buf: &mut ArenaBuffer,
    len: usize,
) -> Result<DeviceViewMut<'_, T>, ModelError> {
    view_mut_at(buf, 0..len)
}

/// Elements `range` of an arena buffer, as `T`, to write.
fn view_mut_at<T: bytemuck::Pod>(
    buf: &mut ArenaBuffer,
    range: std::ops::Range<usize>,
) -> Result<DeviceViewMut<'_, T>, ModelError> {
    buf.view_mut::<T>()
        .and_then(|v| v.slice_mut(range))
        .map_err(gpu("viewing a buffer"))
}
