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
use crate::cpu::{embed, layer, on_the_pool, output_logits, Kv, Scratch};
use crate::plan::ExecutionPlan;
use crate::ModelError;

use super::pool::KvPool;

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
    on_the_pool(|| run(config, plan, pool, segments, context, logits))
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
    let mut scratch = Scratch::default();
    let last = plan.layers.len() - 1;
    let mut kv = Kv::Pool {
        pool,
        segments,
        context,
    };
    for (layer_idx, layer_plan) in plan.layers.iter().enumerate() {
        // The last layer carries only the rows of the segments that get logits.
        layer(
            config,
            layer_plan,
            layer_idx,
            &mut x,
            &mut kv,
            layer_idx == last,
            &mut scratch,
            None,
        )?;
    }
    if x.is_empty() {
        return Ok(());
    }
    output_logits(config, plan, &mut x, logits)
}
