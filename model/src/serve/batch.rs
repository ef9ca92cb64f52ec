//! The forward pass of one scheduler step: the new tokens of several sequences in one
//! batch, their keys and values in the shared [`KvPool`].
//!
//! Rows of all sequences go through the matrix products together, so each weight block
//! is read once per step whatever the number of sequences (`dequant`'s batch kernels);
//! each sequence's attention runs on its own rows against its own positions, read in
//! place from its blocks in position order. The layer is the CPU's one
//! ([`crate::cpu::layer`]), so a sequence alone in a step computes what
//! [`crate::Model::forward`] computes for the same tokens: the same products of the same
//! rows, the same attention over the same cache, the last layer carrying only the rows
//! that get logits.

use crate::config::ModelConfig;
use crate::cpu::{embed, final_norm, layer, on_the_pool, output_logits, Kv, Scratch};
use crate::plan::ExecutionPlan;
use crate::ModelError;

use crate::kv_pool::KvPool;

pub(crate) use crate::cpu::{Context, Segment};

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
    on_the_pool(|| run(config, plan, pool, segments, context, Out::Logits(logits)))
}

/// Runs every segment's tokens and returns the last hidden state of each of them after
/// the final norm, `n_embd` per token in segment order (embeddings: every row, whatever
/// the segments' `logits`).
pub(crate) fn hidden_batch(
    config: &ModelConfig,
    plan: &ExecutionPlan,
    pool: &mut KvPool,
    segments: &[Segment<'_>],
    context: Context,
) -> Result<Vec<f32>, ModelError> {
    if segments.iter().all(|s| s.tokens.is_empty()) {
        return Err(ModelError::EmptyInput);
    }
    let mut rows = Vec::new();
    on_the_pool(|| {
        run(
            config,
            plan,
            pool,
            segments,
            context,
            Out::Hidden(&mut rows),
        )
    })?;
    Ok(rows)
}

/// What a batch leaves: the logits of the segments that ask, or every row's hidden state.
enum Out<'a> {
    Logits(&'a mut Vec<f32>),
    Hidden(&'a mut Vec<f32>),
}

fn run(
    config: &ModelConfig,
    plan: &ExecutionPlan,
    pool: &mut KvPool,
    segments: &[Segment<'_>],
    context: Context,
    out: Out<'_>,
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
    let mut scratch = Scratch::default();
    let last = plan.layers.len() - 1;
    let mut kv = Kv::Pool {
        pool,
        segments,
        context,
    };
    let every_row = matches!(out, Out::Hidden(_));
    for (layer_idx, layer_plan) in plan.layers.iter().enumerate() {
        // The last layer carries only the rows of the segments that get logits.
        layer(
            config,
            layer_plan,
            layer_idx,
            &mut x,
            &mut kv,
            layer_idx == last && !every_row,
            &mut scratch,
            None,
        )?;
    }
    match out {
        Out::Hidden(rows) => {
            final_norm(config, plan, &mut x)?;
            *rows = x;
            Ok(())
        }
        Out::Logits(_) if x.is_empty() => Ok(()),
        Out::Logits(logits) => output_logits(config, plan, &mut x, logits),
    }
}
