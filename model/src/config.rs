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
    /// Gemma 3: QK-norm, pre- and post-norms, GELU, sliding-window layers, scaled embeddings.
    Gemma3,
}

impl Architecture {
    /// Names accepted in `general.architecture`.
    pub const SUPPORTED: [&'static str; 4] = ["llama", "qwen2", "qwen3", "gemma3"];

    fn from_name(name: &str) -> Option<Architecture> {
        match name {
            "llama" => Some(Architecture::Llama),
            "qwen2" => Some(Architecture::Qwen2),
            "qwen3" => Some(Architecture::Qwen3),
            "gemma3" => Some(Architecture::Gemma3),
            _ => None,
        }
    }

    /// The architectures the GPU forward pass (`crate::gpu`) runs.
    pub const GPU_SUPPORTED: [Architecture; 3] = [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Gemma3,
    ];

    /// The `general.architecture` name, also the prefix of its metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3",
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

/// The hyper-parameters of one attention layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttention {
    /// Keys further back than this many positions are masked (`None`: full causal).
    pub sliding_window: Option<usize>,
    /// RoPE base frequency for this layer.
    pub rope_freq_base: f32,
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
    /// Positions are divided by this factor (linear RoPE scaling); 1 when absent.
    pub rope_scale: f32,
    pub activation: Activation,
    /// Scale of the attention scores (usually `1/sqrt(head_dim)`).
    pub attention_scale: f32,
    /// Where the scale applies: to the queries before `Q·Kᵀ` (Gemma, as llama.cpp's
    /// graph does for it) or to the scores after it (the others). The two round
    /// differently unless the scale is a power of two.
    pub scale_queries: bool,
    /// Embeddings are multiplied by this after lookup (Gemma: `sqrt(n_embd)`), else 1.
    pub embedding_scale: f32,
    /// Per layer: window and RoPE base.
    pub layers: Vec<LayerAttention>,
}

/// Caps on hyper-parameters read from a file, so a hostile header cannot make the
/// engine allocate without bound before any weight is checked.
const MAX_LAYERS: usize = 1024;
const MAX_DIM: usize = 1 << 20;

impl ModelConfig {
    /// Reads the configuration from GGUF metadata. Pure: needs no weights.
    pub fn from_metadata(metadata: &Metadata) -> Result<ModelConfig, ModelError> {
        let arch_name = metadata.get_str("general.architecture")?;
        let architecture = Architecture::from_name(arch_name).ok_or_else(|| {
            ModelError::UnsupportedArchitecture {
                name: arch_name.to_owned(),
                supported: Architecture::SUPPORTED.join(", "),
            }
        })?;
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
        let n_ff = dim("feed_forward_length")?;
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
        let rope_scale = match metadata.get_opt::<&str>(&key("rope.scaling.type"))? {
            None | Some("none") | Some("linear") => metadata
                .get_opt::<f32>(&key("rope.scaling.factor"))?
                .filter(|f| *f > 0.0)
                .unwrap_or(1.0),
            Some(other) => {
                return Err(ModelError::InvalidConfig {
                    key: key("rope.scaling.type"),
                    reason: format!("{other:?} RoPE scaling is not supported (only linear)"),
                })
            }
        };
        if !(rope_freq_base.is_finite() && rope_freq_base > 0.0) {
            return Err(ModelError::InvalidConfig {
                key: key("rope.freq_base"),
                reason: format!("{rope_freq_base} is not a positive number"),
            });
        }

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
            activation: Activation::Silu,
            attention_scale: 1.0 / (head_dim as f32).sqrt(),
            scale_queries: false,
            embedding_scale: 1.0,
            layers: vec![
                LayerAttention {
                    sliding_window: None,
                    rope_freq_base,
                };
                n_layers
            ],
        };
        match architecture {
            Architecture::Llama => {}
            Architecture::Qwen2 | Architecture::Qwen3 => config.rope_style = RopeStyle::Halves,
            Architecture::Gemma3 => gemma3_specifics(&mut config, metadata)?,
        }
        Ok(config)
    }

    /// Refuses, naming the architecture, a model the GPU forward pass does not compute.
    pub fn check_gpu_support(&self) -> Result<(), ModelError> {
        if Architecture::GPU_SUPPORTED.contains(&self.architecture) {
            return Ok(());
        }
        Err(ModelError::GpuUnsupported {
            what: format!("architecture {:?}", self.architecture.name()),
            supported: Architecture::GPU_SUPPORTED
                .map(Architecture::name)
                .join(", "),
        })
    }

    /// Query heads sharing one key/value head.
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}

/// Gemma 3: five sliding-window layers with RoPE base 10,000 for every global layer,
/// which keeps the file's base; GELU; embeddings scaled by `sqrt(n_embd)`.
fn gemma3_specifics(config: &mut ModelConfig, metadata: &Metadata) -> Result<(), ModelError> {
    const GLOBAL_EVERY: usize = 6;
    const LOCAL_ROPE_BASE: f32 = 10_000.0;
    config.rope_style = RopeStyle::Halves;
    config.activation = Activation::GeluTanh;
    config.embedding_scale = (config.n_embd as f32).sqrt();
    config.scale_queries = true;
    let window: usize = metadata.get_as("gemma3.attention.sliding_window")?;
    let window = check_range("gemma3.attention.sliding_window", window, 1, usize::MAX)?;
    for (layer_idx, layer) in config.layers.iter_mut().enumerate() {
        if (layer_idx + 1) % GLOBAL_EVERY != 0 {
            layer.sliding_window = Some(window);
            layer.rope_freq_base = LOCAL_ROPE_BASE;
        }
    }
    Ok(())
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
mod tests {
    use gguf_format::{Array, Value};

    use super::*;

    /// The metadata of a small model of `arch`, with `extra` keys (`ARCH.` is prefixed
    /// to keys that start with a dot).
    fn metadata(arch: &str, extra: &[(&str, Value)]) -> Metadata {
        let mut m = Metadata::new();
        m.set("general.architecture", Value::String(arch.into()));
        let key = |k: &str| format!("{arch}.{k}");
        m.set(&key("block_count"), Value::U32(4));
        m.set(&key("embedding_length"), Value::U32(256));
        m.set(&key("feed_forward_length"), Value::U32(512));
        m.set(&key("attention.head_count"), Value::U32(4));
        m.set(&key("attention.head_count_kv"), Value::U32(2));
        m.set(
            "tokenizer.ggml.tokens",
            Value::Array(Array::String(["a", "b"].iter().collect())),
        );
        for (k, v) in extra {
            let k = match k.strip_prefix('.') {
                Some(rest) => key(rest),
                None => (*k).to_owned(),
            };
            m.set(&k, v.clone());
        }
        m
    }

    #[test]
    fn unknown_architectures_are_refused_naming_the_supported_ones() {
        let err = ModelConfig::from_metadata(&metadata("mamba", &[])).unwrap_err();
        let ModelError::UnsupportedArchitecture { name, supported } = &err else {
            panic!("{err}");
        };
        assert_eq!(name, "mamba");
        for arch in Architecture::SUPPORTED {
            assert!(supported.contains(arch), "{supported}");
        }
    }

    #[test]
    fn qwen3_has_neox_rope_and_its_own_head_size() {
        let m = metadata("qwen3", &[(".attention.key_length", Value::U32(128))]);
        let c = ModelConfig::from_metadata(&m).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3);
        assert_eq!(c.rope_style, RopeStyle::Halves);
        assert_eq!((c.head_dim, c.head_dim_v, c.rope_dims), (128, 128, 128));
        assert!(!c.scale_queries);
        let err = c.check_gpu_support().unwrap_err();
        assert!(err.to_string().contains("\"qwen3\""), "{err}");
    }
}
