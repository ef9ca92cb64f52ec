//! The mixture-of-experts feed-forward block on the CPU, as llama.cpp's graph and CPU
//! backend compute it (`build_moe_ffn`): the router's logits, their softmax, the `used`
//! most probable experts (ranked as ggml's `argsort` ranks them), their probabilities
//! (renormalized where the architecture does), each expert's gated feed-forward over the
//! tokens routed to it (multiplied as `MUL_MAT_ID` multiplies them:
//! [`dequant::matmul::QuantizedMatrix::matmul_routed`]), the outputs weighted and summed
//! in the order of the ranks, and Qwen 2 MoE's shared expert behind its sigmoid gate.
//! gpt-oss ranks the experts by the router's (biased) logits and weighs the chosen ones
//! by the softmax of their logits; its experts add a bias to each product and activate
//! with the clamped SwiGLU ([`ops::swiglu_oai`]).

use std::borrow::Cow;

use crate::config::{ExpertActivation, Experts, Gating, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT};
use crate::ops::{self, route};
use crate::plan::{DenseFfn, ExpertMatrices, ExpertsPlan, Linear};
use crate::ModelError;

use super::products::{add, linear, linears, matrix_rows, resize, values};

/// Buffers of the block, kept between layers.
#[derive(Default)]
pub(crate) struct MoeScratch {
    logits: Vec<f32>,
    probs: Vec<f32>,
    /// Per token, its experts and their weights, `used` of each.
    chosen: Vec<(u32, f32)>,
    x: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    /// Each token's weighted expert outputs, rank by rank.
    ranked: Vec<f32>,
    shared: Vec<f32>,
}

/// `out = Σ_r w_r · expert_r(h)` for the `n` rows of `h` (plus the shared expert).
pub(crate) fn experts_block(
    plan: &ExpertsPlan,
    h: &[f32],
    n: usize,
    s: &mut MoeScratch,
    out: &mut Vec<f32>,
) -> Result<(), ModelError> {
    let e = &plan.experts;
    let d = h.len() / n;
    let up_bias = biases(&plan.up)?;
    let gate_bias = match &plan.gate {
        Some(gate) => biases(gate)?,
        None => None,
    };
    let down_bias = biases(&plan.down)?;
    linear(&plan.router, h, n, &mut s.logits)?;
    route_tokens(e, &s.logits, &mut s.probs, &mut s.chosen);

    // The tokens of each expert, in token order (as MUL_MAT_ID groups them), with the
    // rank each gave it.
    let mut routed: Vec<Vec<(usize, usize)>> = vec![Vec::new(); e.count];
    for (i, &(expert, _)) in s.chosen.iter().enumerate() {
        routed[expert as usize].push((i / e.used, i % e.used));
    }
    resize(&mut s.ranked, n * e.used * d);
    for (expert, tokens) in routed.iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        let m = tokens.len();
        s.x.clear();
        for &(t, _) in tokens {
            s.x.extend_from_slice(&h[t * d..(t + 1) * d]);
        }
        routed_product(&plan.up.expert(expert), &s.x, m, &mut s.up)?;
        add_expert_bias(&up_bias, plan.up.rows, expert, &mut s.up);
        match &plan.gate {
            Some(gate) => {
                routed_product(&gate.expert(expert), &s.x, m, &mut s.gate)?;
                add_expert_bias(&gate_bias, gate.rows, expert, &mut s.gate);
            }
            // No gate: SiLU of the up projection alone (`silu(x) · 1` is `silu(x)`).
            None => {
                std::mem::swap(&mut s.gate, &mut s.up);
                s.up.clear();
                s.up.resize(s.gate.len(), 1.0);
            }
        }
        match e.activation {
            ExpertActivation::Silu => ops::swiglu(&mut s.gate, &s.up, e.n_ff),
            ExpertActivation::SwigluOai => {
                ops::swiglu_oai(&mut s.gate, &s.up, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)
            }
        }
        routed_product(&plan.down.expert(expert), &s.gate, m, &mut s.down)?;
        add_expert_bias(&down_bias, plan.down.rows, expert, &mut s.down);
        for (row, &(t, rank)) in s.down.chunks_exact(d).zip(tokens) {
            let weight = s.chosen[t * e.used + rank].1;
            let at = (t * e.used + rank) * d;
            for (o, &v) in s.ranked[at..at + d].iter_mut().zip(row) {
                *o = v * weight;
            }
        }
    }
    resize(out, n * d);
    for (o, ranks) in out
        .chunks_exact_mut(d)
        .zip(s.ranked.chunks_exact(e.used * d))
    {
        o.copy_from_slice(&ranks[..d]);
        for rank in ranks[d..].chunks_exact(d) {
            add(o, rank);
        }
    }
    if let Some((ffn, gate)) = &plan.shared {
        shared_expert(ffn, gate, h, n, s, out)?;
    }
    Ok(())
}

/// The biases of an expert tensor, every expert's row, as f32.
fn biases(m: &ExpertMatrices) -> Result<Option<Cow<'_, [f32]>>, ModelError> {
    m.bias.as_ref().map(values).transpose()
}

/// Adds expert `expert`'s bias row (`width` values), if the experts have biases, to
/// each row of `out`.
fn add_expert_bias(bias: &Option<Cow<'_, [f32]>>, width: usize, expert: usize, out: &mut [f32]) {
    if let Some(bias) = bias {
        let row = &bias[expert * width..(expert + 1) * width];
        for o in out.chunks_exact_mut(width) {
            add(o, row);
        }
    }
}

/// Each token's experts and weights from the router's `logits` (`count` per token) into
/// `chosen`.
fn route_tokens(e: &Experts, logits: &[f32], probs: &mut Vec<f32>, chosen: &mut Vec<(u32, f32)>) {
    resize(probs, e.count);
    chosen.clear();
    for row in logits.chunks_exact(e.count) {
        let ranked = match e.gating {
            Gating::Softmax => {
                route::soft_max(row, probs);
                route::argsort_desc(probs)
            }
            Gating::SoftmaxOfChosen => {
                let ranked = route::argsort_desc(row);
                let chosen_logits: Vec<f32> =
                    ranked[..e.used].iter().map(|&x| row[x as usize]).collect();
                route::soft_max(&chosen_logits, &mut probs[..e.used]);
                let weights = probs[..e.used].to_vec();
                chosen.extend(ranked[..e.used].iter().copied().zip(weights));
                continue;
            }
        };
        let mut weights: Vec<f32> = ranked[..e.used]
            .iter()
            .map(|&x| probs[x as usize])
            .collect();
        if e.normalize {
            route::renormalize(&mut weights);
        }
        chosen.extend(ranked[..e.used].iter().copied().zip(weights));
    }
}

/// `out = x · Wᵀ` for the `m` tokens routed to the expert whose matrix `lin` is.
fn routed_product(lin: &Linear, x: &[f32], m: usize, out: &mut Vec<f32>) -> Result<(), ModelError> {
    resize(out, m * lin.rows);
    matrix_rows(lin, 0..lin.rows)?
        .matmul_routed(x, m, out)
        .map_err(|source| ModelError::Matmul {
            name: format!(
                "{} (expert {})",
                lin.weight.name(),
                lin.first_row / lin.rows
            ),
            source,
        })
}

/// Qwen 2 MoE's shared expert, added to `out`: a dense feed-forward of `h` scaled per
/// token by `sigmoid(g · h)`, the sigmoid computed as llama.cpp's graph does, as
/// `silu(x) / x` (SiLU of a one-value row by the C library's exponential).
fn shared_expert(
    ffn: &DenseFfn,
    gate: &Linear,
    h: &[f32],
    n: usize,
    s: &mut MoeScratch,
    out: &mut [f32],
) -> Result<(), ModelError> {
    linears([&ffn.gate, &ffn.up], h, n, [&mut s.gate, &mut s.up])?;
    ops::swiglu(&mut s.gate, &s.up, ffn.gate.rows);
    linear(&ffn.down, &s.gate, n, &mut s.shared)?;
    linear(gate, h, n, &mut s.logits)?;
    let d = out.len() / n;
    for ((o, y), &g) in out
        .chunks_exact_mut(d)
        .zip(s.shared.chunks_exact(d))
        .zip(s.logits.iter())
    {
        let silu = g / (1.0 + (-g).exp());
        let scale = silu / g;
        for (o, &y) in o.iter_mut().zip(y) {
            *o += y * scale;
        }
    }
    Ok(())
}
