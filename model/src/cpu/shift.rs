//! A context shift on the CPU's cache, as llama.cpp's `--context-shift` does it: the
//! positions `keep..keep + discard` are removed, the later ones move down by `discard`,
//! and their keys are turned back by `discard` positions of RoPE (the values carry no
//! position). A quantized key row is decoded, turned back out of the cache's rotation,
//! rotated by RoPE, rotated into the cache's frame again and quantized, as llama.cpp's
//! `build_rope_shift` does.

use crate::config::ModelConfig;
use crate::kv_cache::KvCache;
use crate::kv_type::fwht;
use crate::ops;
use crate::plan::ExecutionPlan;
use crate::ModelError;

use super::layer::{rope_table, RopeTables};

/// Removes positions `keep..keep + discard` of `cache` and re-positions the later keys.
pub(crate) fn shift(
    config: &ModelConfig,
    plan: &ExecutionPlan,
    cache: &mut KvCache,
    keep: usize,
    discard: usize,
) -> Result<(), ModelError> {
    let len = cache.len();
    if discard == 0 || keep >= len {
        return Ok(());
    }
    let discard = discard.min(len - keep);
    cache.remove_positions(keep..keep + discard);
    let moved = keep..cache.len();
    if moved.is_empty() {
        return Ok(());
    }
    let k_dim = config.n_kv_heads * config.head_dim;
    let rotation = cache.types().k_rotation(config.head_dim);
    let context = cache.capacity();
    let mut row = vec![0.0f32; k_dim];
    for (layer_idx, layer) in plan.layers.iter().enumerate() {
        // One position's angles, negated: a rotation by −discard positions (cos is
        // even and sin odd, so these are ggml's angles for a shift of −discard). The
        // table's cosines and sines carry the layer's RoPE magnitude (an attention or
        // YaRN factor), which the keys already have: it is taken out, so that a moved key
        // is the key of its new position. (llama.cpp applies it a second time.)
        let attn = config.layers[layer_idx];
        let (_, magnitude) = ops::yarn_mix(
            config.rope_dims,
            attn.rope_freq_base,
            attn.rope_scale,
            config.rope_attn_factor,
            config.rope_yarn.as_ref(),
        );
        let mut tables = RopeTables::new();
        let table: Vec<(f32, f32)> =
            rope_table(&mut tables, config, layer, layer_idx, context, || {
                std::iter::once(discard)
            })?
            .iter()
            .map(|&(cos, sin)| match magnitude == 1.0 {
                true => (cos, -sin),
                false => (cos / magnitude, -sin / magnitude),
            })
            .collect();
        let keys = cache.keys_mut(layer_idx);
        for r in moved.clone() {
            keys.read(r, &mut row);
            if let Some(n) = rotation {
                fwht(&mut row, n);
            }
            ops::apply_rope(
                &mut row,
                config.head_dim,
                config.rope_dims,
                config.rope_style,
                &table,
            );
            if let Some(n) = rotation {
                fwht(&mut row, n);
            }
            // Stored as a new row is: rounded to f16, or quantized.
            keys.write(r, &row);
        }
    }
    Ok(())
}
