//! Model hyper-parameters, read from GGUF metadata.

use gguf_format::Metadata;

use crate::ModelError;

/// The architectures this crate runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 1/2/3, Mistral, SmolLM and other `llama`-tagged models.
    Llama,
    /// Qwen 2 and 2.5: llama with biases on the Q, K and V projections and NeoX RoPE.
    Qwen2,
    /// Qwen 3: Qwen 2 without the biases, with a per-head RMSNorm of queries and keys.
    Qwen3,
    /// Phi-3 and 3.5: llama with NeoX RoPE, fused Q/K/V and gate/up weights, and RoPE
    /// frequency factors for long contexts.
    Phi3,
    /// Gemma 2: pre- and post-norms, GELU, alternating sliding-window layers, scaled
    /// embeddings, soft-capped attention scores and logits.
    Gemma2,
    /// Gemma 3: QK-norm, pre- and post-norms, GELU, sliding-window layers, scaled embeddings.
    Gemma3,
    /// Qwen 2 MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen 2's attention, a mixture of experts
    /// whose routed weights are not renormalized, and a shared expert behind a sigmoid gate.
    Qwen2Moe,
    /// Qwen 3 MoE (Qwen3-30B-A3B, 235B-A22B): Qwen 3's attention, a mixture of experts
    /// whose routed weights are renormalized.
    Qwen3Moe,
    /// gpt-oss (20B, 120B): biased projections, a learned attention sink per head,
    /// alternating sliding-window and global layers, YaRN RoPE, and a mixture of experts
    /// with biased router and experts, weighted by a softmax of the chosen experts'
    /// logits, whose activation is the clamped SwiGLU of [`ExpertActivation::SwigluOai`].
    GptOss,
}

impl Architecture {
    /// Names accepted in `general.architecture`.
    pub const SUPPORTED: [&'static str; 9] = [
        "llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen2moe", "qwen3moe", "gpt-oss",
    ];

    /// Mixture-of-experts architectures llama.cpp runs and this engine does not yet:
    /// refused naming what they are, rather than as unknown names.
    const MOE_NOT_YET: [&'static str; 7] = [
        "deepseek2",
        "glm4moe",
        "llama4",
        "qwen3next",
        "qwen35moe",
        "phimoe",
        "olmoe",
    ];

    fn from_name(name: &str) -> Option<Architecture> {
        match name {
            "llama" => Some(Architecture::Llama),
            "qwen2" => Some(Architecture::Qwen2),
            "qwen3" => Some(Architecture::Qwen3),
            "phi3" => Some(Architecture::Phi3),
            "gemma2" => Some(Architecture::Gemma2),
            "gemma3" => Some(Architecture::Gemma3),
            "qwen2moe" => Some(Architecture::Qwen2Moe),
            "qwen3moe" => Some(Architecture::Qwen3Moe),
            "gpt-oss" => Some(Architecture::GptOss),
            _ => None,
        }
    }

    /// The architectures the GPU forward pass (`crate::gpu`) runs.
    pub const GPU_SUPPORTED: [Architecture; 9] = [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Phi3,
        Architecture::Gemma2,
        Architecture::Gemma3,
        Architecture::Qwen2Moe,
        Architecture::Qwen3Moe,
        Architecture::GptOss,
    ];

    /// The `general.architecture` name, also the prefix of its metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Phi3 => "phi3",
            Architecture::Gemma2 => "gemma2",
            Architecture::Gemma3 => "gemma3",
            Architecture::Qwen2Moe => "qwen2moe",
            Architecture::Qwen3Moe => "qwen3moe",
            Architecture::GptOss => "gpt-oss",
        }
    }
}

/// How rotary position embeddings pair the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])`: ggml's "normal" mode, used by llama GGUFs
    /// (whose Q and K weights the converter permuted to match).
    Interleaved,
    /// Halves `(x[i], x[i + d/2])`: ggml's NeoX mode (Qwen 2, Gemma).
    Halves,
}

/// The feed-forward gate's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: `silu(gate) * up`.
    Silu,
    /// GeGLU with the tanh approximation of GELU.
    GeluTanh,
}

/// A mixture-of-experts feed-forward block: a router picks `used` of `count` experts
/// per token, whose outputs are summed weighted by the router's probabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Experts {
    /// Experts per layer (`expert_count`).
    pub count: usize,
    /// Experts each token is routed to (`expert_used_count`).
    pub used: usize,
    /// Width of each expert's feed-forward (`expert_feed_forward_length`, else
    /// `feed_forward_length / used` as llama.cpp derives it; Mixtral-style `llama`
    /// files: `feed_forward_length`).
    pub n_ff: usize,
    /// Whether the selected experts' probabilities are renormalized to sum to 1
    /// (Qwen 3 MoE, Mixtral) or used as the softmax gave them (Qwen 2 MoE).
    pub normalize: bool,
    /// Width of the shared expert every token also runs, scaled by a sigmoid gate of its
    /// own (Qwen 2 MoE: `expert_shared_feed_forward_length`, else `feed_forward_length`).
    pub shared_n_ff: Option<usize>,
    /// How the router's logits become the chosen experts' weights.
    pub gating: Gating,
    /// The experts' gate activation.
    pub activation: ExpertActivation,
}

/// How a router's logits choose experts and weigh them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// The softmax of every expert's logit ranks the experts; the chosen ones weigh by
    /// their probabilities (renormalized where [`Experts::normalize`] says).
    Softmax,
    /// The logits rank the experts; the chosen ones weigh by the softmax of their own
    /// logits (gpt-oss).
    SoftmaxOfChosen,
}

/// The activation of an expert's gate and up projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertActivation {
    /// `silu(gate) · up`.
    Silu,
    /// gpt-oss's clamped SwiGLU: `g · sigmoid(alpha · g) · (u + 1)` with the gate `g`
    /// capped at `limit` from above and the up projection `u` clamped to `±limit`
    /// ([`SWIGLU_OAI_ALPHA`], [`SWIGLU_OAI_LIMIT`], as llama.cpp fixes them).
    SwigluOai,
}

/// gpt-oss's SwiGLU slope.
pub const SWIGLU_OAI_ALPHA: f32 = 1.702;
/// gpt-oss's SwiGLU clamp.
pub const SWIGLU_OAI_LIMIT: f32 = 7.0;

/// YaRN RoPE scaling (`rope.scaling.type = "yarn"`), with the parameters llama.cpp
/// gives it: every pair's angle mixes the interpolated angle (divided by the scaling
/// factor) and the original one by a ramp between the correction dimensions of
/// `beta_fast` and `beta_slow` rotations over `original_context` positions, and the
/// cosines and sines are scaled by `attn_factor · (1 + 0.1 ln factor)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// Weight of the extrapolated angle in the ramp (llama.cpp: 1 for YaRN).
    pub ext_factor: f32,
    /// Magnitude factor of the cosines and sines, before YaRN's own (llama.cpp cancels
    /// YaRN's magnitude correction here and applies it again in RoPE, each rounded).
    pub attn_factor: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// `rope.scaling.original_context_length`, else the training context.
    pub original_context: usize,
}

/// The most experts a layer may have (as llama.cpp allows).
pub const MAX_EXPERTS: usize = 1024;

/// The hyper-parameters of one attention layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttention {
    /// Keys further back than this many positions are masked (`None`: full causal).
    pub sliding_window: Option<usize>,
    /// RoPE base frequency for this layer.
    pub rope_freq_base: f32,
    /// Positions are divided by this factor in this layer (linear RoPE scaling): the
    /// model's [`ModelConfig::rope_scale`], or 1 in Gemma 3's sliding-window layers.
    pub rope_scale: f32,
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Dimension of each query and key head.
    pub head_dim: usize,
    /// Dimension of each value head.
    pub head_dim_v: usize,
    pub n_vocab: usize,
    /// Context length the model was trained with.
    pub n_ctx_train: usize,
    pub rms_norm_eps: f32,
    /// Dimensions of each head that RoPE rotates (the first `rope_dims`).
    pub rope_dims: usize,
    pub rope_style: RopeStyle,
    /// The rotary cosines and sines are multiplied by this (`rope.scaling.attn_factor`,
    /// Phi-3's long-context models); 1 when absent.
    pub rope_attn_factor: f32,
    /// The context the model was trained with before its context was extended
    /// (`rope.scaling.original_context_length`, else `n_ctx_train`): a KV cache for more
    /// positions than this takes Phi-3's long RoPE factors, as llama.cpp's context does.
    pub rope_original_context: usize,
    /// Positions are divided by this factor (linear RoPE scaling); 1 when absent. Each
    /// layer's own is in [`LayerAttention::rope_scale`].
    pub rope_scale: f32,
    /// YaRN scaling of every layer's RoPE (`rope.scaling.type = "yarn"`), whose
    /// interpolated angles divide by the layer's `rope_scale`.
    pub rope_yarn: Option<Yarn>,
    pub activation: Activation,
    /// Scale of the attention scores (usually `1/sqrt(head_dim)`).
    pub attention_scale: f32,
    /// Where the scale applies: to the queries before `Q·Kᵀ` (Gemma, as llama.cpp's
    /// graph does for it) or to the scores after it (the others). The two round
    /// differently unless the scale is a power of two.
    pub scale_queries: bool,
    /// Embeddings are multiplied by this after lookup (Gemma: `sqrt(n_embd)`), else 1.
    pub embedding_scale: f32,
    /// Attention scores `s` become `cap · tanh(s / cap)` before the softmax (Gemma 2).
    pub attn_logit_softcap: Option<f32>,
    /// Logits `l` become `cap · tanh(l / cap)` (Gemma 2, some Gemma 3).
    pub final_logit_softcap: Option<f32>,
    /// Per layer: window, RoPE base and scale.
    pub layers: Vec<LayerAttention>,
    /// The mixture of experts every layer's feed-forward block is, or `None` for dense
    /// feed-forward blocks.
    pub experts: Option<Experts>,
    /// The last layer runs every row of a batch, its rows narrowed to those that get
    /// logits only after it (gpt-oss, as llama.cpp's graph for it does); otherwise they
    /// are narrowed after the last attention.
    pub full_last_layer: bool,
}

/// Caps on hyper-parameters read from a file, so a hostile header cannot make the
/// engine allocate without bound before any weight is checked.
const MAX_LAYERS: usize = 1024;
const MAX_DIM: usize = 1 << 20;

impl ModelConfig {
    /// Reads the configuration from GGUF metadata. Pure: needs no weights.
    pub fn from_metadata(metadata: &Metadata) -> Result<ModelConfig, ModelError> {
        let arch_name = metadata.get_str("general.architecture")?;
        let architecture = find_architecture(arch_name)?;
        let key = |k: &str| format!("{}.{k}", architecture.name());
        let dim = |k: &str| -> Result<usize, ModelError> {
            let v: usize = metadata.get_as(&key(k))?;
            check_range(&key(k), v, 1, MAX_DIM)
        };
        let opt_dim = |k: &str| -> Result<Option<usize>, ModelError> {
            match metadata.get_opt::<usize>(&key(k))? {
                Some(v) => check_range(&key(k), v, 1, MAX_DIM).map(Some),
                None => Ok(None),
            }
        };

        let n_layers: usize = metadata.get_as(&key("block_count"))?;
        let n_layers = check_range(&key("block_count"), n_layers, 1, MAX_LAYERS)?;
        let n_embd = dim("embedding_length")?;
        // gpt-oss's experts have their own width; its dense width is optional.
        let n_ff = if architecture == Architecture::GptOss {
            opt_dim("feed_forward_length")?.unwrap_or(0)
        } else {
            dim("feed_forward_length")?
        };
        let n_heads = dim("attention.head_count")?;
        let n_kv_heads = opt_dim("attention.head_count_kv")?.unwrap_or(n_heads);
        if n_heads % n_kv_heads != 0 {
            return Err(ModelError::InvalidConfig {
                key: key("attention.head_count_kv"),
                reason: format!("{n_kv_heads} does not divide the {n_heads} query heads"),
            });
        }
        let head_dim = match opt_dim("attention.key_length")? {
            Some(d) => d,
            None if n_embd % n_heads == 0 => n_embd / n_heads,
            None => {
                return Err(ModelError::InvalidConfig {
                    key: key("attention.head_count"),
                    reason: format!("{n_heads} heads do not divide the width {n_embd}"),
                })
            }
        };
        let head_dim_v = opt_dim("attention.value_length")?.unwrap_or(head_dim);
        let rope_dims = opt_dim("rope.dimension_count")?.unwrap_or(head_dim);
        if rope_dims > head_dim || rope_dims % 2 != 0 {
            return Err(ModelError::InvalidConfig {
                key: key("rope.dimension_count"),
                reason: format!("{rope_dims} must be even and at most the head size {head_dim}"),
            });
        }
        let n_vocab = match metadata.get_opt::<usize>(&key("vocab_size"))? {
            Some(v) => v,
            None => metadata.get_array("tokenizer.ggml.tokens")?.len(),
        };
        let n_vocab = check_range("tokenizer.ggml.tokens", n_vocab, 1, 1 << 24)?;
        let n_ctx_train = opt_dim("context_length")?.unwrap_or(4096);
        let rms_norm_eps = metadata
            .get_opt::<f32>(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5);
        let rope_freq_base = metadata
            .get_opt::<f32>(&key("rope.freq_base"))?
            .unwrap_or(10_000.0);
        let scaling_type = metadata.get_opt::<&str>(&key("rope.scaling.type"))?;
        let rope_scale = rope_scale(metadata, &key, scaling_type)?;
        let rope_attn_factor = rope_attn_factor(metadata, &key)?;
        let rope_original_context =
            opt_dim("rope.scaling.original_context_length")?.unwrap_or(n_ctx_train);
        if !(rope_freq_base.is_finite() && rope_freq_base > 0.0) {
            return Err(ModelError::InvalidConfig {
                key: key("rope.freq_base"),
                reason: format!("{rope_freq_base} is not a positive number"),
            });
        }
        let rope_yarn = (scaling_type == Some("yarn")).then(|| Yarn {
            ext_factor: 1.0,
            attn_factor: yarn_attn_factor(1.0 / (1.0 / rope_scale)) * rope_attn_factor,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_context: rope_original_context,
        });

        let experts = experts(architecture, metadata, n_ff)?;
        let n_ff = match experts {
            Some(e) if n_ff == 0 => e.n_ff,
            _ => n_ff,
        };
        let mut config = ModelConfig {
            architecture,
            n_layers,
            n_embd,
            n_ff,
            n_heads,
            n_kv_heads,
            head_dim,
            head_dim_v,
            n_vocab,
            n_ctx_train,
            rms_norm_eps,
            rope_dims,
            rope_style: RopeStyle::Interleaved,
            rope_scale,
            rope_attn_factor,
            rope_original_context,
            rope_yarn,
            activation: Activation::Silu,
            attention_scale: 1.0 / (head_dim as f32).sqrt(),
            scale_queries: false,
            embedding_scale: 1.0,
            attn_logit_softcap: None,
            final_logit_softcap: None,
            layers: vec![
                LayerAttention {
                    sliding_window: None,
                    rope_freq_base,
                    rope_scale,
                };
                n_layers
            ],
            experts,
            full_last_layer: false,
        };
        architecture_specifics(&mut config, metadata)?;
        Ok(config)
    }

    /// Refuses, naming the architecture, a model the GPU forward pass does not compute.
    pub fn check_gpu_support(&self) -> Result<(), ModelError> {
        if !Architecture::GPU_SUPPORTED.contains(&self.architecture) {
            return Err(ModelError::GpuUnsupported {
                what: format!("architecture {:?}", self.architecture.name()),
                supported: Architecture::GPU_SUPPORTED
                    .map(Architecture::name)
                    .join(", "),
            });
        }
        Ok(())
    }
}

/// The architecture `general.architecture` names, or an error listing the supported ones.
fn find_architecture(arch_name: &str) -> Result<Architecture, ModelError> {
    Architecture::from_name(arch_name).ok_or_else(|| {
        if Architecture::MOE_NOT_YET.contains(&arch_name) {
            ModelError::UnsupportedExperts {
                what: format!("architecture {arch_name:?}"),
            }
        } else {
            ModelError::UnsupportedArchitecture {
                name: arch_name.to_owned(),
                supported: Architecture::SUPPORTED.join(", "),
            }
        }
    })
}

/// The RoPE scaling factor (1 without scaling); only linear and YaRN scaling are read.
fn rope_scale(
    metadata: &Metadata,
    key: &dyn Fn(&str) -> String,
    scaling_type: Option<&str>,
) -> Result<f32, ModelError> {
    let rope_scale = match scaling_type {
        None | Some("none") | Some("linear") | Some("yarn") => metadata
            .get_opt::<f32>(&key("rope.scaling.factor"))?
            .filter(|f| *f > 0.0)
            .unwrap_or(1.0),
        Some(other) => {
            return Err(ModelError::InvalidConfig {
                key: key("rope.scaling.type"),
                reason: format!("{other:?} RoPE scaling is not supported (only linear and yarn)"),
            })
        }
    };
    if !rope_scale.is_finite() {
        return Err(ModelError::InvalidConfig {
            key: key("rope.scaling.factor"),
            reason: format!("{rope_scale} is not a finite number"),
        });
    }
    Ok(rope_scale)
}

/// `rope.scaling.attn_factor`, 1 when absent.
fn rope_attn_factor(metadata: &Metadata, key: &dyn Fn(&str) -> String) -> Result<f32, ModelError> {
    let rope_attn_factor = metadata
        .get_opt::<f32>(&key("rope.scaling.attn_factor"))?
        .unwrap_or(1.0);
    if !(rope_attn_factor.is_finite() && rope_attn_factor > 0.0) {
        return Err(ModelError::InvalidConfig {
            key: key("rope.scaling.attn_factor"),
            reason: format!("{rope_attn_factor} is not a positive number"),
        });
    }
    Ok(rope_attn_factor)
}

/// What an architecture changes from the defaults `from_metadata` starts with.
fn architecture_specifics(config: &mut ModelConfig, metadata: &Metadata) -> Result<(), ModelError> {
    match config.architecture {
        Architecture::Llama => {}
        Architecture::Qwen2
        | Architecture::Qwen3
        | Architecture::Qwen2Moe
        | Architecture::Qwen3Moe => config.rope_style = RopeStyle::Halves,
        Architecture::Phi3 => {
            // Queries are scaled before `Q·Kᵀ`, as llama.cpp's graph does; a sliding
            // window in the metadata is ignored, as llama.cpp ignores it for Phi-3.
            config.rope_style = RopeStyle::Halves;
            config.scale_queries = true;
        }
        Architecture::Gemma2 | Architecture::Gemma3 => gemma_specifics(config, metadata)?,
        Architecture::GptOss => gpt_oss_specifics(config, metadata)?,
    }
    Ok(())
}

/// The mixture of experts of `architecture`'s feed-forward blocks, as llama.cpp reads
/// it: `expert_count` and `expert_used_count` (at least one used, at most all), the
/// experts' width, and for Qwen 2 MoE the shared expert's. A dense architecture whose
/// file declares experts is refused for them, not for a missing dense tensor later.
fn experts(
    architecture: Architecture,
    metadata: &Metadata,
    n_ff: usize,
) -> Result<Option<Experts>, ModelError> {
    let arch = architecture.name();
    let key = |k: &str| format!("{arch}.{k}");
    let count = metadata
        .get_opt::<usize>(&key("expert_count"))?
        .unwrap_or(0);
    let moe_arch = matches!(
        architecture,
        Architecture::Qwen2Moe | Architecture::Qwen3Moe | Architecture::GptOss
    );
    if count == 0 {
        if moe_arch {
            return Err(ModelError::InvalidConfig {
                key: key("expert_count"),
                reason: format!("a {arch} model needs experts, and this one has none"),
            });
        }
        return Ok(None);
    }
    if !(moe_arch || architecture == Architecture::Llama) {
        return Err(ModelError::UnsupportedExperts {
            what: format!("a {arch} model with {count} experts"),
        });
    }
    let count = check_range(&key("expert_count"), count, 1, MAX_EXPERTS)?;
    let used: usize = metadata.get_as(&key("expert_used_count"))?;
    let used = check_range(&key("expert_used_count"), used, 1, count)?;
    let width = |k: &str| -> Result<Option<usize>, ModelError> {
        match metadata.get_opt::<usize>(&key(k))? {
            Some(v) => check_range(&key(k), v, 1, MAX_DIM).map(Some),
            None => Ok(None),
        }
    };
    let (n_ff_exp, normalize, shared_n_ff) = match architecture {
        Architecture::Qwen3Moe => (
            width("expert_feed_forward_length")?.unwrap_or(n_ff / used),
            true,
            None,
        ),
        Architecture::Qwen2Moe => (
            width("expert_feed_forward_length")?.unwrap_or(n_ff / used),
            false,
            Some(width("expert_shared_feed_forward_length")?.unwrap_or(n_ff)),
        ),
        // gpt-oss: the experts' width is required, as llama.cpp requires it.
        Architecture::GptOss => {
            let v: usize = metadata.get_as(&key("expert_feed_forward_length"))?;
            (v, false, None)
        }
        // Mixtral and the other experts of `llama` files: each as wide as the
        // feed-forward length says.
        _ => (n_ff, true, None),
    };
    let n_ff_exp = check_range(&key("expert_feed_forward_length"), n_ff_exp, 1, MAX_DIM)?;
    let (gating, activation) = if architecture == Architecture::GptOss {
        (Gating::SoftmaxOfChosen, ExpertActivation::SwigluOai)
    } else {
        (Gating::Softmax, ExpertActivation::Silu)
    };
    Ok(Some(Experts {
        count,
        used,
        n_ff: n_ff_exp,
        normalize,
        shared_n_ff,
        gating,
        activation,
    }))
}

/// Gemma 2 and 3, as llama.cpp reads them: GELU, embeddings scaled by `sqrt(n_embd)`,
/// queries scaled before `Q·Kᵀ` (by `1/sqrt(n_embd / n_heads)` in the 27B models, which
/// llama.cpp knows by their layer count, else by `1/sqrt(head_dim)`), and sliding-window
/// layers: every layer but the last of each group of `sliding_window_pattern` (2 for
/// Gemma 2, 6 for Gemma 3, or a per-layer list), with their own RoPE base
/// (`rope.freq_base_swa`; Gemma 2: the file's base, Gemma 3: 10,000) and, in Gemma 3,
/// without the file's RoPE scaling. Gemma 2 soft-caps attention scores (50) and logits
/// (30); Gemma 3 caps logits when its file says so.
fn gemma_specifics(config: &mut ModelConfig, metadata: &Metadata) -> Result<(), ModelError> {
    let gemma2 = config.architecture == Architecture::Gemma2;
    let arch_name = config.architecture.name();
    let key = |k: &str| format!("{arch_name}.{k}");
    config.rope_style = RopeStyle::Halves;
    config.activation = Activation::GeluTanh;
    config.embedding_scale = (config.n_embd as f32).sqrt();
    config.scale_queries = true;
    let layers_27b = if gemma2 { 46 } else { 62 };
    if config.n_layers == layers_27b {
        config.attention_scale = 1.0 / ((config.n_embd / config.n_heads) as f32).sqrt();
    }

    let softcap = |k: &str, default: Option<f32>| -> Result<Option<f32>, ModelError> {
        match metadata.get_opt::<f32>(&key(k))?.or(default) {
            // Gemma 3's converter writes 0 for "none"; Gemma 2 always caps.
            Some(cap) if cap == 0.0 && !gemma2 => Ok(None),
            Some(cap) if !(cap.is_finite() && cap > 0.0) => Err(ModelError::InvalidConfig {
                key: key(k),
                reason: format!("{cap} is not a positive number"),
            }),
            cap => Ok(cap),
        }
    };
    config.final_logit_softcap = softcap("final_logit_softcapping", gemma2.then_some(30.0))?;
    if gemma2 {
        config.attn_logit_softcap = softcap("attn_logit_softcapping", Some(50.0))?;
    }

    let window = match metadata.get_opt::<usize>(&key("attention.sliding_window"))? {
        Some(0) | None if !gemma2 => return Ok(()),
        Some(w) => w,
        None => 4096,
    };
    let window = check_range(&key("attention.sliding_window"), window, 1, usize::MAX)?;
    let sliding = sliding_layers(
        metadata,
        &key("attention.sliding_window_pattern"),
        config.n_layers,
        if gemma2 { 2 } else { 6 },
    )?;
    let file_base = config.layers[0].rope_freq_base;
    let base = metadata
        .get_opt::<f32>(&key("rope.freq_base_swa"))?
        .unwrap_or(if gemma2 { file_base } else { 10_000.0 });
    if !(base.is_finite() && base > 0.0) {
        return Err(ModelError::InvalidConfig {
            key: key("rope.freq_base_swa"),
            reason: format!("{base} is not a positive number"),
        });
    }
    let scale = if gemma2 { config.rope_scale } else { 1.0 };
    for (layer, sliding) in config.layers.iter_mut().zip(sliding) {
        if sliding {
            layer.sliding_window = Some(window);
            layer.rope_freq_base = base;
            layer.rope_scale = scale;
        }
    }
    Ok(())
}

/// gpt-oss, as llama.cpp reads it: NeoX RoPE, scores scaled by `1/sqrt(n_rot)` (so the
/// rotated dimensions must be the whole head), a required sliding window in every layer
/// but the last of each pair (or as `attention.sliding_window_pattern` says), those
/// layers at `rope.freq_base_swa` when the file has it, and every row through the last
/// layer.
fn gpt_oss_specifics(config: &mut ModelConfig, metadata: &Metadata) -> Result<(), ModelError> {
    let key = |k: &str| format!("{}.{k}", config.architecture.name());
    config.rope_style = RopeStyle::Halves;
    config.full_last_layer = true;
    if config.rope_dims != config.head_dim || config.head_dim_v != config.head_dim {
        return Err(ModelError::InvalidConfig {
            key: key("rope.dimension_count"),
            reason: format!(
                "{} rotated dimensions, keys of {} and values of {}: gpt-oss needs all three equal",
                config.rope_dims, config.head_dim, config.head_dim_v
            ),
        });
    }
    config.attention_scale = 1.0 / (config.rope_dims as f32).sqrt();
    let window: usize = metadata.get_as(&key("attention.sliding_window"))?;
    let window = check_range(&key("attention.sliding_window"), window, 1, usize::MAX)?;
    let sliding = sliding_layers(
        metadata,
        &key("attention.sliding_window_pattern"),
        config.n_layers,
        2,
    )?;
    let base = match metadata.get_opt::<f32>(&key("rope.freq_base_swa"))? {
        Some(b) if !(b.is_finite() && b > 0.0) => {
            return Err(ModelError::InvalidConfig {
                key: key("rope.freq_base_swa"),
                reason: format!("{b} is not a positive number"),
            })
        }
        Some(b) => b,
        None => config.layers[0].rope_freq_base,
    };
    for (layer, sliding) in config.layers.iter_mut().zip(sliding) {
        if sliding {
            layer.sliding_window = Some(window);
            layer.rope_freq_base = base;
        }
    }
    Ok(())
}

/// The magnitude factor llama.cpp's context gives YaRN RoPE for a scaling `factor`
/// (before the file's `rope.scaling.attn_factor`): YaRN's `1 + 0.1 ln factor` (1 for a
/// factor of at most 1) times the reciprocal of `1 + 0.1 ln factor`, which RoPE then
/// applies again, each step rounded to f32 without fused operations.
fn yarn_attn_factor(factor: f32) -> f32 {
    let correction = 0.1f32 * factor.ln() + 1.0;
    let mscale = if factor <= 1.0 { 1.0 } else { correction };
    mscale * (1.0 / correction)
}

/// Which layers use the sliding window: `key` holds either a period `n` (every layer but
/// the last of each `n`; 0: every layer) or one boolean per layer; absent, the period is
/// `default_period`.
fn sliding_layers(
    metadata: &Metadata,
    key: &str,
    n_layers: usize,
    default_period: usize,
) -> Result<Vec<bool>, ModelError> {
    if let Some(gguf_format::Value::Array(gguf_format::Array::Bool(flags))) = metadata.get(key) {
        if flags.len() != n_layers {
            return Err(ModelError::InvalidConfig {
                key: key.to_owned(),
                reason: format!("{} flags for {n_layers} layers", flags.len()),
            });
        }
        return Ok(flags.clone());
    }
    let period = metadata.get_opt::<usize>(key)?.unwrap_or(default_period);
    Ok((0..n_layers)
        .map(|i| period == 0 || i % period < period - 1)
        .collect())
}

fn check_range(key: &str, value: usize, min: usize, max: usize) -> Result<usize, ModelError> {
    if value < min || value > max {
        return Err(ModelError::InvalidConfig {
            key: key.to_owned(),
            reason: format!("{value} is outside {min}..={max}"),
        });
    }
    Ok(value)
}

#[cfg(test)]
mod tests;
