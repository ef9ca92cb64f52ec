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

use rayon::prelude::*;

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
    linear(&plan.router, h, n, &mut s.logits)?;
    route_tokens(e, &s.logits, &mut s.probs, &mut s.chosen);
    let picks: Vec<Pick> = (s.chosen.iter().enumerate())
        .map(|(i, &(expert, weight))| Pick {
            token: i / e.used,
            rank: i % e.used,
            expert: expert as usize,
            weight,
        })
        .collect();
    resize(out, n * d);
    routed_part(plan, h, &picks, s, out)?;
    if let Some((ffn, gate)) = &plan.shared {
        shared_expert(ffn, gate, h, n, s, out)?;
    }
    Ok(())
}

/// One token's route to one expert: the token's row, the expert's rank among the
/// token's choices, the expert and its weight.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Pick {
    pub token: usize,
    pub rank: usize,
    pub expert: usize,
    pub weight: f32,
}

/// `out[t] = Σ w · expert(h[t])` over the `picks` of each token `t` (rows of `h`, which
/// holds `out.len() / d` rows), in the order of their ranks: the routed experts of
/// [`experts_block`] (every route), or the part of them that another device does not
/// compute (no router, no shared expert). Each expert multiplies its tokens in token
/// order, as llama.cpp's `MUL_MAT_ID` groups them.
pub(crate) fn routed_part(
    plan: &ExpertsPlan,
    h: &[f32],
    picks: &[Pick],
    s: &mut MoeScratch,
    out: &mut [f32],
) -> Result<(), ModelError> {
    let d = plan.up.cols;
    let biases = ExpertBiases::of(plan)?;
    out.fill(0.0);
    if one_token_part(plan, &biases, h, picks, s, out)? {
        return Ok(());
    }
    let mut by_expert: Vec<usize> = (0..picks.len()).collect();
    by_expert.sort_by_key(|&i| (picks[i].expert, picks[i].token));
    let groups: Vec<&[usize]> = by_expert
        .chunk_by(|&a, &b| picks[a].expert == picks[b].expert)
        .collect();
    // The experts side by side (each product's rows are its own whichever thread
    // computes them), then the weighted outputs of each pick, summed per token in rank
    // order.
    let downs = groups
        .par_iter()
        .map(|group| {
            let mut scratch = MoeScratch::default();
            let tokens: Vec<(usize, usize)> = group
                .iter()
                .map(|&p| (picks[p].token, picks[p].rank))
                .collect();
            expert_ffn(
                plan,
                &biases,
                picks[group[0]].expert,
                h,
                &tokens,
                &mut scratch,
            )?;
            Ok(scratch.down)
        })
        .collect::<Result<Vec<Vec<f32>>, ModelError>>()?;
    resize(&mut s.ranked, picks.len() * d);
    for (group, down) in groups.iter().zip(&downs) {
        for (row, &p) in down.chunks_exact(d).zip(*group) {
            let weight = picks[p].weight;
            for (o, &v) in s.ranked[p * d..(p + 1) * d].iter_mut().zip(row) {
                *o = v * weight;
            }
        }
    }
    // Each token's first rank copied, the others added in rank order (so a row of
    // negative zeros stays one); a token without picks keeps zeros.
    let mut by_rank: Vec<usize> = (0..picks.len()).collect();
    by_rank.sort_by_key(|&p| (picks[p].token, picks[p].rank));
    let mut last = None;
    for p in by_rank {
        let t = picks[p].token;
        let (row, value) = (&mut out[t * d..(t + 1) * d], &s.ranked[p * d..(p + 1) * d]);
        if last == Some(t) {
            add(row, value);
        } else {
            row.copy_from_slice(value);
        }
        last = Some(t);
    }
    Ok(())
}

/// [`routed_part`] when every pick is one token's (a decode step): the gate and up
/// products of all its experts in one parallel loop over the token's activations
/// prepared once, then the down products side by side. Each product is the bits its own
/// `matvec` gives. Returns false, doing nothing, for other picks or experts without a
/// gate or whose gate and up differ in type.
fn one_token_part(
    plan: &ExpertsPlan,
    biases: &ExpertBiases<'_>,
    h: &[f32],
    picks: &[Pick],
    s: &mut MoeScratch,
    out: &mut [f32],
) -> Result<bool, ModelError> {
    let Some(gate) = &plan.gate else {
        return Ok(false);
    };
    let Some(first) = picks.first() else {
        return Ok(true);
    };
    if picks.iter().any(|p| p.token != first.token)
        || gate.weight.ggml_type() != plan.up.weight.ggml_type()
    {
        return Ok(false);
    }
    let d = plan.up.cols;
    let ff = plan.up.rows;
    let t = first.token;
    let x = &h[t * d..(t + 1) * d];
    let lins: Vec<Linear> = picks
        .iter()
        .flat_map(|p| [gate.expert(p.expert), plan.up.expert(p.expert)])
        .collect();
    let mats = lins
        .iter()
        .map(|l| matrix_rows(l, 0..l.rows))
        .collect::<Result<Vec<_>, _>>()?;
    resize(&mut s.gate, 2 * picks.len() * ff);
    let mut ys: Vec<&mut [f32]> = s.gate.chunks_exact_mut(ff).collect();
    dequant::matmul::QuantizedMatrix::matvec_many(&mats, x, &mut ys).map_err(|source| {
        ModelError::Matmul {
            name: format!("{} + {}", gate.weight.name(), plan.up.weight.name()),
            source,
        }
    })?;
    let e = &plan.experts;
    let acts: Vec<Vec<f32>> = picks
        .iter()
        .zip(s.gate.chunks_exact(2 * ff))
        .map(|(p, gate_up)| {
            let (mut g, mut u) = (gate_up[..ff].to_vec(), gate_up[ff..].to_vec());
            add_expert_bias(&biases.gate, ff, p.expert, &mut g);
            add_expert_bias(&biases.up, ff, p.expert, &mut u);
            match e.activation {
                ExpertActivation::Silu => ops::swiglu(&mut g, &u, e.n_ff),
                ExpertActivation::SwigluOai => {
                    ops::swiglu_oai(&mut g, &u, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)
                }
            }
            g
        })
        .collect();
    let downs = picks
        .par_iter()
        .zip(&acts)
        .map(|(p, act)| {
            let mut down = Vec::new();
            routed_product(&plan.down.expert(p.expert), act, 1, &mut down)?;
            add_expert_bias(&biases.down, plan.down.rows, p.expert, &mut down);
            Ok(down)
        })
        .collect::<Result<Vec<Vec<f32>>, ModelError>>()?;
    // Weighted, then summed in rank order.
    let mut order: Vec<usize> = (0..picks.len()).collect();
    order.sort_by_key(|&i| picks[i].rank);
    // The first rank's weighted output is copied, the others added, as `experts_block`
    // sums them (so a row of negative zeros stays one).
    let o = &mut out[t * d..(t + 1) * d];
    for (n, i) in order.into_iter().enumerate() {
        let weight = picks[i].weight;
        for (o, &v) in o.iter_mut().zip(&downs[i]) {
            *o = if n == 0 { v * weight } else { *o + v * weight };
        }
    }
    Ok(true)
}

/// The experts' biases (gpt-oss), every expert's row, as f32.
struct ExpertBiases<'a> {
    gate: Option<Cow<'a, [f32]>>,
    up: Option<Cow<'a, [f32]>>,
    down: Option<Cow<'a, [f32]>>,
}

impl<'a> ExpertBiases<'a> {
    fn of(plan: &'a ExpertsPlan) -> Result<ExpertBiases<'a>, ModelError> {
        Ok(ExpertBiases {
            gate: match &plan.gate {
                Some(gate) => biases(gate)?,
                None => None,
            },
            up: biases(&plan.up)?,
            down: biases(&plan.down)?,
        })
    }
}

/// Expert `expert`'s gated feed-forward of the rows `tokens` name (`(token, rank)`) of
/// `h`, into `s.down`, a row per token.
fn expert_ffn(
    plan: &ExpertsPlan,
    biases: &ExpertBiases<'_>,
    expert: usize,
    h: &[f32],
    tokens: &[(usize, usize)],
    s: &mut MoeScratch,
) -> Result<(), ModelError> {
    let e = &plan.experts;
    let d = plan.up.cols;
    let m = tokens.len();
    s.x.clear();
    for &(t, _) in tokens {
        s.x.extend_from_slice(&h[t * d..(t + 1) * d]);
    }
    routed_product(&plan.up.expert(expert), &s.x, m, &mut s.up)?;
    add_expert_bias(&biases.up, plan.up.rows, expert, &mut s.up);
    match &plan.gate {
        Some(gate) => {
            routed_product(&gate.expert(expert), &s.x, m, &mut s.gate)?;
            add_expert_bias(&biases.gate, gate.rows, expert, &mut s.gate);
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
    add_expert_bias(&biases.down, plan.down.rows, expert, &mut s.down);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Experts;
    use crate::cpu::offload::tests::q4_k_rows;
    use gguf_format::{GgmlType, GgufWriter};
    use tensor_store::TensorStore;

    /// One token's routes alone, handed to `routed_part`, give that token's row of the
    /// whole experts block bit for bit (its experts multiplied without the other tokens,
    /// fused for one token), and zeros elsewhere; no route gives zeros.
    #[test]
    fn a_tokens_routes_alone_give_its_row_of_the_block() {
        let (d, ff, count, used) = (256usize, 256usize, 8usize, 3usize);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("moe.gguf");
        let mut writer = GgufWriter::new();
        writer
            .add_metadata("general.architecture", "qwen3moe")
            .unwrap();
        let names = ["gate", "up", "down"];
        let mut data: Vec<Vec<u8>> = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let (cols, rows) = if *name == "down" { (ff, d) } else { (d, ff) };
                writer
                    .add_tensor(
                        name,
                        GgmlType::Q4_K,
                        &[cols as u64, rows as u64, count as u64],
                    )
                    .unwrap();
                q4_k_rows(rows * count, cols, 5 + i as u64)
            })
            .collect();
        writer
            .add_tensor("router", GgmlType::F32, &[d as u64, count as u64])
            .unwrap();
        data.push(
            (0..d * count)
                .flat_map(|i| (((i * 7919 % 211) as f32 - 105.0) / 400.0).to_le_bytes())
                .collect(),
        );
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        std::fs::write(&path, writer.to_bytes(&refs).unwrap()).unwrap();
        let store = TensorStore::open(&path).unwrap();
        let matrices = |name: &str, rows, cols| ExpertMatrices {
            weight: store.tensor(name).unwrap(),
            bias: None,
            count,
            rows,
            cols,
        };
        let plan = ExpertsPlan {
            experts: Experts {
                count,
                used,
                n_ff: ff,
                normalize: true,
                shared_n_ff: None,
                gating: Gating::Softmax,
                activation: ExpertActivation::Silu,
            },
            router: Linear {
                weight: store.tensor("router").unwrap(),
                bias: None,
                rows: count,
                cols: d,
                first_row: 0,
            },
            gate: Some(matrices("gate", ff, d)),
            up: matrices("up", ff, d),
            down: matrices("down", d, ff),
            shared: None,
        };
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for n in [1, 4] {
            let h: Vec<f32> = (0..n * d)
                .map(|i| ((i * 31 % 97) as f32 - 48.0) / 24.0)
                .collect();
            let mut s = MoeScratch::default();
            let mut whole = Vec::new();
            experts_block(&plan, &h, n, &mut s, &mut whole).unwrap();
            let mut logits = Vec::new();
            linear(&plan.router, &h, n, &mut logits).unwrap();
            let (mut probs, mut chosen) = (Vec::new(), Vec::new());
            route_tokens(&plan.experts, &logits, &mut probs, &mut chosen);
            let picks: Vec<Pick> = chosen
                .iter()
                .enumerate()
                .map(|(i, &(expert, weight))| Pick {
                    token: i / used,
                    rank: i % used,
                    expert: expert as usize,
                    weight,
                })
                .collect();
            let mut part = vec![f32::NAN; n * d];
            // One token's routes alone: its row of the block, and nothing elsewhere.
            let t = n - 1;
            let own: Vec<Pick> = picks.iter().copied().filter(|p| p.token == t).collect();
            routed_part(&plan, &h, &own, &mut s, &mut part).unwrap();
            for (row, (got, want)) in part.chunks(d).zip(whole.chunks(d)).enumerate() {
                if row == t {
                    assert_eq!(bits(got), bits(want), "{n} tokens, token {t}'s routes");
                } else {
                    assert!(got.iter().all(|&v| v == 0.0), "{n} tokens, row {row}");
                }
            }
            let empty: Vec<Pick> = Vec::new();
            routed_part(&plan, &h, &empty, &mut s, &mut part).unwrap();
            assert!(part.iter().all(|&v| v == 0.0), "{n} tokens: no route");
        }
    }
}
