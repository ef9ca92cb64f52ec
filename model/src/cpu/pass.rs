//! The CPU forward pass of one sequence: the embeddings, the layers over its contiguous
//! [`KvCache`], the logits.

use crate::config::ModelConfig;
use crate::kv_cache::KvCache;
use crate::ops;
use crate::plan::{ExecutionPlan, Linear};
use crate::ModelError;

use super::layer::{layer, reborrow, Kv, Scratch};
use super::offload::RowOffload;
use super::products::{decode_row, linear, vector};

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
    for (layer_idx, layer_plan) in plan.layers.iter().enumerate() {
        // After the last layer's attention only the positions that get logits matter.
        let carry_last = layer_idx == last && logits == Logits::Last;
        layer(
            config,
            layer_plan,
            layer_idx,
            &mut x,
            &mut Kv::Cache(cache),
            carry_last,
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

/// Runs `tokens` through the model after the positions already in `cache`, appends their
/// keys and values to it, and returns every token's last hidden state after the final
/// norm (`n_embd` values per token): what the output projection would read.
pub(crate) fn hidden_states(
    config: &ModelConfig,
    plan: &ExecutionPlan,
    tokens: &[u32],
    cache: &mut KvCache,
) -> Result<Vec<f32>, ModelError> {
    if tokens.is_empty() {
        return Err(ModelError::EmptyInput);
    }
    cache.check_room(tokens.len())?;
    let first_pos = cache.len();
    let result = on_the_pool(|| run_layers(config, plan, tokens, cache, first_pos, Logits::All));
    match result {
        Ok(mut x) => {
            cache.commit(tokens.len());
            final_norm(config, plan, &mut x)?;
            Ok(x)
        }
        Err(e) => {
            cache.truncate(first_pos);
            Err(e)
        }
    }
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
    on_the_pool(|| {
        let mut scratch = Scratch::default();
        for layer_idx in layers {
            if stop.is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed)) {
                return Err(ModelError::Interrupted);
            }
            layer(
                config,
                &plan.layers[layer_idx],
                layer_idx,
                x,
                &mut Kv::Cache(cache),
                false,
                &mut scratch,
                reborrow(&mut offload),
            )?;
        }
        Ok(())
    })
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
    final_norm(config, plan, x)?;
    linear(&plan.output, x, n, logits)?;
    if let Some(cap) = config.final_logit_softcap {
        let inv = 1.0 / cap;
        for l in logits.iter_mut() {
            *l = (*l * inv).tanh() * cap;
        }
    }
    Ok(())
}

/// The final norm of the residual rows `x`, in place: the last hidden states, as the
/// output projection reads them.
pub(crate) fn final_norm(
    config: &ModelConfig,
    plan: &ExecutionPlan,
    x: &mut [f32],
) -> Result<(), ModelError> {
    ops::rms_norm_in_place(x, &vector(&plan.output_norm)?, config.rms_norm_eps);
    Ok(())
}
