//! The execution plan: per layer, lazy handles to the weights the forward pass reads.
//!
//! Building a plan checks that every tensor the architecture needs exists with the shape
//! and a type the kernels support, and keeps only [`TensorHandle`]s: no weight is read,
//! copied or uploaded here. A weight's bytes are touched the first time the forward pass
//! multiplies by it.

use gguf_format::GgmlType;
use tensor_store::{TensorHandle, TensorStore};

use crate::config::{Architecture, ModelConfig};
use crate::ModelError;

/// A matrix weight of `rows` output features by `cols` input features, with its bias:
/// the rows `first_row..first_row + rows` of its tensor (a part of a fused tensor, such
/// as Phi-3's `attn_qkv`; rows are whole blocks, so a part is a range of the tensor's
/// bytes), usually all of them.
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: TensorHandle,
    pub bias: Option<TensorHandle>,
    pub rows: usize,
    pub cols: usize,
    pub first_row: usize,
}

/// A vector weight of `len` f32 values (norm scales).
#[derive(Clone, Debug)]
pub struct Vector {
    pub handle: TensorHandle,
    pub len: usize,
}

/// The weights of one transformer block.
#[derive(Clone, Debug)]
pub struct LayerPlan {
    pub attn_norm: Vector,
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub wo: Linear,
    /// Divisors of each rotary pair's angle (Llama 3's `rope_freqs.weight`, one tensor
    /// shared by every layer).
    pub rope_freqs: Option<Vector>,
    /// Phi-3's divisors for contexts longer than the original one and for the others
    /// (`rope_factors_long.weight`, `rope_factors_short.weight`, shared by every layer).
    pub rope_factors_long: Option<Vector>,
    pub rope_factors_short: Option<Vector>,
    /// Per-head RMSNorm of queries and keys (Qwen 3, Gemma 3).
    pub q_norm: Option<Vector>,
    pub k_norm: Option<Vector>,
    /// Norm of the attention output before the residual add (Gemma 2 and 3).
    pub post_attn_norm: Option<Vector>,
    /// One logit per query head joining each softmax's denominator (gpt-oss's
    /// `attn_sinks`).
    pub attn_sinks: Option<Vector>,
    pub ffn_norm: Vector,
    pub ffn: FfnPlan,
    /// Norm of the feed-forward output before the residual add (Gemma 2 and 3).
    pub post_ffn_norm: Option<Vector>,
}

/// A layer's feed-forward block.
#[derive(Clone, Debug)]
pub enum FfnPlan {
    /// One gated feed-forward network for every token.
    Dense(DenseFfn),
    /// A mixture of experts ([`crate::config::Experts`]).
    Experts(Box<ExpertsPlan>),
}

impl FfnPlan {
    /// The dense block, or `None` for a mixture of experts.
    pub fn dense(&self) -> Option<&DenseFfn> {
        match self {
            FfnPlan::Dense(d) => Some(d),
            FfnPlan::Experts(_) => None,
        }
    }
}

/// `down · act(gate · h) ⊙ (up · h)`.
#[derive(Clone, Debug)]
pub struct DenseFfn {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

/// The weights of a mixture-of-experts block.
#[derive(Clone, Debug)]
pub struct ExpertsPlan {
    /// How tokens are routed: the configuration's experts.
    pub experts: crate::config::Experts,
    /// `ffn_gate_inp`: one logit per expert.
    pub router: Linear,
    /// `ffn_gate_exps`, absent from some Mixtral-style files (the experts then apply
    /// SiLU to their up projection alone).
    pub gate: Option<ExpertMatrices>,
    pub up: ExpertMatrices,
    pub down: ExpertMatrices,
    /// Qwen 2 MoE's shared expert and its gate (`ffn_gate_inp_shexp`, one row).
    pub shared: Option<(DenseFfn, Linear)>,
}

/// A 3-D expert tensor (`ffn_{gate,up,down}_exps`): `count` matrices of `rows` by
/// `cols`, one after the other, with their biases (gpt-oss: a 2-D tensor of `count`
/// rows of `rows` values).
#[derive(Clone, Debug)]
pub struct ExpertMatrices {
    pub weight: TensorHandle,
    pub bias: Option<TensorHandle>,
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
}

impl ExpertMatrices {
    /// Expert `e`'s matrix: its rows of the tensor.
    pub fn expert(&self, e: usize) -> Linear {
        Linear {
            weight: self.weight.clone(),
            bias: None,
            rows: self.rows,
            cols: self.cols,
            first_row: e * self.rows,
        }
    }
}

/// Everything the forward pass reads, as lazy handles.
#[derive(Clone, Debug)]
pub struct ExecutionPlan {
    /// `n_vocab` rows of `n_embd`: rows are gathered and decoded, so any type the
    /// decoder knows will do, unless the output is tied to it.
    pub token_embd: Linear,
    pub layers: Vec<LayerPlan>,
    pub output_norm: Vector,
    /// `output.weight`, or the token embeddings when the model ties them.
    pub output: Linear,
}

impl ExecutionPlan {
    /// Resolves and checks every weight of `config`'s architecture in `store`.
    pub fn build(store: &TensorStore, config: &ModelConfig) -> Result<ExecutionPlan, ModelError> {
        let b = Builder { store };
        let (d, q_dim, kv_dim, v_dim) = (
            config.n_embd,
            config.n_heads * config.head_dim,
            config.n_kv_heads * config.head_dim,
            config.n_kv_heads * config.head_dim_v,
        );
        let gemma = matches!(
            config.architecture,
            Architecture::Gemma2 | Architecture::Gemma3
        );
        let qk_norm = matches!(
            config.architecture,
            Architecture::Qwen3 | Architecture::Gemma3 | Architecture::Qwen3Moe
        );
        let biased = matches!(
            config.architecture,
            Architecture::Qwen2 | Architecture::Qwen2Moe
        );
        // gpt-oss: optional Q/K/V biases (as llama.cpp reads them), a required output
        // bias and sinks, and `post_attention_norm` as the feed-forward's norm.
        let gpt_oss = config.architecture == Architecture::GptOss;
        let token_embd = b.matrix("token_embd.weight", config.n_vocab, d)?;
        let rope_freqs = match store.get("rope_freqs.weight") {
            Some(_) if config.architecture == Architecture::Llama => {
                Some(b.vector("rope_freqs.weight", config.rope_dims / 2)?)
            }
            _ => None,
        };
        let phi3 = config.architecture == Architecture::Phi3;
        let factors = |name: &str| match store.get(name) {
            Some(_) if phi3 => b.vector(name, config.rope_dims / 2).map(Some),
            _ => Ok(None),
        };
        let rope_factors_long = factors("rope_factors_long.weight")?;
        let rope_factors_short = factors("rope_factors_short.weight")?;
        let layers = (0..config.n_layers)
            .map(|i| {
                let n = |s: &str| format!("blk.{i}.{s}");
                // Phi-3 fuses Q, K and V in one tensor, and the gate and up projections.
                let qkv = n("attn_qkv.weight");
                let [wq, wk, wv] = if phi3 && store.get(&qkv).is_some() {
                    b.parts(&qkv, [q_dim, kv_dim, v_dim], d)?
                } else {
                    let linear = |name: &str, rows: usize| -> Result<Linear, ModelError> {
                        let mut lin = b.linear(&n(name), rows, d, biased)?;
                        if gpt_oss {
                            lin.bias = b.optional_bias(&n(name), rows)?;
                        }
                        Ok(lin)
                    };
                    [
                        linear("attn_q.weight", q_dim)?,
                        linear("attn_k.weight", kv_dim)?,
                        linear("attn_v.weight", v_dim)?,
                    ]
                };
                let ffn = match &config.experts {
                    Some(e) => FfnPlan::Experts(Box::new(b.experts(i, config, e)?)),
                    None if phi3 => {
                        let [gate, up] =
                            b.parts(&n("ffn_up.weight"), [config.n_ff, config.n_ff], d)?;
                        let down = b.linear(&n("ffn_down.weight"), d, config.n_ff, false)?;
                        FfnPlan::Dense(DenseFfn { gate, up, down })
                    }
                    None => FfnPlan::Dense(b.dense(i, "", d, config.n_ff)?),
                };
                Ok(LayerPlan {
                    attn_norm: b.vector(&n("attn_norm.weight"), d)?,
                    rope_freqs: rope_freqs.clone(),
                    rope_factors_long: rope_factors_long.clone(),
                    rope_factors_short: rope_factors_short.clone(),
                    wq,
                    wk,
                    wv,
                    wo: b.linear(
                        &n("attn_output.weight"),
                        d,
                        config.n_heads * config.head_dim_v,
                        gpt_oss,
                    )?,
                    q_norm: qk_norm
                        .then(|| b.vector(&n("attn_q_norm.weight"), config.head_dim))
                        .transpose()?,
                    k_norm: qk_norm
                        .then(|| b.vector(&n("attn_k_norm.weight"), config.head_dim))
                        .transpose()?,
                    post_attn_norm: gemma
                        .then(|| b.vector(&n("post_attention_norm.weight"), d))
                        .transpose()?,
                    attn_sinks: gpt_oss
                        .then(|| b.vector(&n("attn_sinks.weight"), config.n_heads))
                        .transpose()?,
                    ffn_norm: if gpt_oss {
                        b.vector(&n("post_attention_norm.weight"), d)?
                    } else {
                        b.vector(&n("ffn_norm.weight"), d)?
                    },
                    ffn,
                    post_ffn_norm: gemma
                        .then(|| b.vector(&n("post_ffw_norm.weight"), d))
                        .transpose()?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        // Gemma 2's output is its embeddings, whatever else the file holds (as llama.cpp
        // reads it).
        let output = match store.get("output.weight") {
            // gpt-oss's output matrix is required.
            None if gpt_oss => b.linear("output.weight", config.n_vocab, d, false)?,
            Some(_) if config.architecture != Architecture::Gemma2 => {
                b.linear("output.weight", config.n_vocab, d, false)?
            }
            _ => {
                b.check_kernel(&token_embd.weight)?;
                token_embd.clone()
            }
        };
        Ok(ExecutionPlan {
            token_embd,
            layers,
            output_norm: b.vector("output_norm.weight", d)?,
            output,
        })
    }

    /// Every weight handle of the plan, in the order the forward pass first reads them.
    pub fn handles(&self) -> Vec<&TensorHandle> {
        let mut out = vec![&self.token_embd.weight];
        for (layer_idx, l) in self.layers.iter().enumerate() {
            out.push(&l.attn_norm.handle);
            for lin in [&l.wq, &l.wk, &l.wv] {
                push_once(&mut out, &lin.weight);
                out.extend(lin.bias.as_ref());
            }
            out.extend(l.q_norm.iter().chain(&l.k_norm).map(|v| &v.handle));
            if layer_idx == 0 {
                // Shared by every layer.
                let shared = [&l.rope_freqs, &l.rope_factors_long, &l.rope_factors_short];
                out.extend(shared.into_iter().flatten().map(|v| &v.handle));
            }
            out.push(&l.wo.weight);
            out.extend(l.wo.bias.as_ref());
            out.extend(l.attn_sinks.as_ref().map(|v| &v.handle));
            out.extend(l.post_attn_norm.as_ref().map(|v| &v.handle));
            out.push(&l.ffn_norm.handle);
            match &l.ffn {
                FfnPlan::Dense(f) => {
                    for lin in [&f.gate, &f.up, &f.down] {
                        push_once(&mut out, &lin.weight);
                    }
                }
                FfnPlan::Experts(e) => {
                    out.push(&e.router.weight);
                    out.extend(e.router.bias.as_ref());
                    for m in e.gate.iter().chain([&e.up, &e.down]) {
                        out.push(&m.weight);
                        out.extend(m.bias.as_ref());
                    }
                    if let Some((f, gate)) = &e.shared {
                        out.push(&gate.weight);
                        out.extend([&f.gate.weight, &f.up.weight, &f.down.weight]);
                    }
                }
            }
            out.extend(l.post_ffn_norm.as_ref().map(|v| &v.handle));
        }
        out.push(&self.output_norm.handle);
        if self.output.weight.index() != self.token_embd.weight.index() {
            out.push(&self.output.weight);
        }
        out
    }
}

/// Pushes `handle` unless it is the last one pushed (the parts of a fused tensor).
fn push_once<'a>(out: &mut Vec<&'a TensorHandle>, handle: &'a TensorHandle) {
    if out.last().map(|h| h.index()) != Some(handle.index()) {
        out.push(handle);
    }
}

struct Builder<'a> {
    store: &'a TensorStore,
}

impl Builder<'_> {
    fn handle(&self, name: &str, expected: &[u64]) -> Result<TensorHandle, ModelError> {
        let handle = self
            .store
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_owned(),
            })?;
        // GGUF may drop trailing dimensions of 1.
        let found: Vec<u64> = handle.shape().to_vec();
        let trim = |dims: &[u64]| {
            let mut dims = dims.to_vec();
            while dims.len() > 1 && dims.last() == Some(&1) {
                dims.pop();
            }
            dims
        };
        if trim(&found) != trim(expected) {
            return Err(ModelError::TensorShape {
                name: name.to_owned(),
                expected: expected.to_vec(),
                found,
            });
        }
        Ok(handle)
    }

    /// A matrix of `rows` by `cols` of any type, checked for shape only.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Linear, ModelError> {
        Ok(Linear {
            weight: self.handle(name, &[cols as u64, rows as u64])?,
            bias: None,
            rows,
            cols,
            first_row: 0,
        })
    }

    /// The consecutive row ranges of one fused tensor of `cols` columns, `rows[i]` rows
    /// each, covering it.
    fn parts<const K: usize>(
        &self,
        name: &str,
        rows: [usize; K],
        cols: usize,
    ) -> Result<[Linear; K], ModelError> {
        let total: usize = rows.iter().sum();
        let weight = self.handle(name, &[cols as u64, total as u64])?;
        self.check_kernel(&weight)?;
        let mut first_row = 0;
        Ok(rows.map(|rows| {
            let part = Linear {
                weight: weight.clone(),
                bias: None,
                rows,
                cols,
                first_row,
            };
            first_row += rows;
            part
        }))
    }

    /// The dense feed-forward weights `ffn_{gate,up,down}{suffix}` of layer `i`, `n_ff`
    /// wide.
    fn dense(&self, i: usize, suffix: &str, d: usize, n_ff: usize) -> Result<DenseFfn, ModelError> {
        let n = |s: &str| format!("blk.{i}.ffn_{s}{suffix}.weight");
        Ok(DenseFfn {
            gate: self.linear(&n("gate"), n_ff, d, false)?,
            up: self.linear(&n("up"), n_ff, d, false)?,
            down: self.linear(&n("down"), d, n_ff, false)?,
        })
    }

    /// The mixture-of-experts weights of layer `i`: the router, the 3-D expert tensors
    /// (`[cols, rows, count]` in GGUF's order), and the shared expert of Qwen 2 MoE.
    fn experts(
        &self,
        i: usize,
        config: &ModelConfig,
        e: &crate::config::Experts,
    ) -> Result<ExpertsPlan, ModelError> {
        let d = config.n_embd;
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        // gpt-oss biases the router and each expert's products.
        let biased = config.architecture == Architecture::GptOss;
        let matrices = |name: &str, rows: usize, cols: usize| -> Result<_, ModelError> {
            let weight = self.handle(name, &[cols as u64, rows as u64, e.count as u64])?;
            self.check_kernel(&weight)?;
            let bias = if biased {
                let bias_name = name.replace(".weight", ".bias");
                let bias = self.handle(&bias_name, &[rows as u64, e.count as u64])?;
                self.check_float(&bias)?;
                Some(bias)
            } else {
                None
            };
            Ok(ExpertMatrices {
                weight,
                bias,
                count: e.count,
                rows,
                cols,
            })
        };
        let gate_name = n("ffn_gate_exps");
        // Only Mixtral-style `llama` files may leave the experts' gate out.
        let gate =
            if config.architecture == Architecture::Llama && self.store.get(&gate_name).is_none() {
                None
            } else {
                Some(matrices(&gate_name, e.n_ff, d)?)
            };
        let shared = match e.shared_n_ff {
            Some(n_ff) => Some((
                self.dense(i, "_shexp", d, n_ff)?,
                self.linear(&n("ffn_gate_inp_shexp"), 1, d, false)?,
            )),
            None => None,
        };
        Ok(ExpertsPlan {
            experts: *e,
            router: self.linear(&n("ffn_gate_inp"), e.count, d, biased)?,
            gate,
            up: matrices(&n("ffn_up_exps"), e.n_ff, d)?,
            down: matrices(&n("ffn_down_exps"), d, e.n_ff)?,
            shared,
        })
    }

    /// Refuses a weight that no product kernel multiplies.
    fn check_kernel(&self, weight: &TensorHandle) -> Result<(), ModelError> {
        if !dequant::matmul::is_supported(weight.ggml_type()) {
            return Err(ModelError::UnsupportedTensorType {
                name: weight.name().to_owned(),
                ggml_type: weight.ggml_type(),
            });
        }
        Ok(())
    }

    fn linear(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        bias: bool,
    ) -> Result<Linear, ModelError> {
        let weight = self.handle(name, &[cols as u64, rows as u64])?;
        self.check_kernel(&weight)?;
        let bias = if bias {
            let bias_name = name.replace(".weight", ".bias");
            Some(self.vector(&bias_name, rows)?.handle)
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            rows,
            cols,
            first_row: 0,
        })
    }

    /// The bias of the matrix `name` (`.weight`), `rows` long, if the file has one.
    fn optional_bias(&self, name: &str, rows: usize) -> Result<Option<TensorHandle>, ModelError> {
        let bias_name = name.replace(".weight", ".bias");
        match self.store.get(&bias_name) {
            Some(_) => Ok(Some(self.vector(&bias_name, rows)?.handle)),
            None => Ok(None),
        }
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vector, ModelError> {
        let handle = self.handle(name, &[len as u64])?;
        self.check_float(&handle)?;
        Ok(Vector { handle, len })
    }

    /// Refuses a small tensor (norms, biases, sinks) that is not stored as floats.
    fn check_float(&self, handle: &TensorHandle) -> Result<(), ModelError> {
        if !matches!(
            handle.ggml_type(),
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16
        ) {
            return Err(ModelError::UnsupportedTensorType {
                name: handle.name().to_owned(),
                ggml_type: handle.ggml_type(),
            });
        }
        Ok(())
    }
}
