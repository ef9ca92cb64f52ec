//! The presets: each a model's shapes and the block type of every tensor, as
//! llama-quantize's mixes choose them.

use gguf_format::GgmlType;

/// Shapes and block types of a preset.
pub struct Preset {
    pub name: &'static str,
    pub n_layers: u32,
    pub n_embd: u64,
    pub n_ff: u64,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub context_length: u32,
    pub rope_freq_base: f32,
    pub rms_eps: f32,
    /// Before [`fallback`] ([`Preset::embd_tensor_type`]).
    pub embd_type: GgmlType,
    /// Attention matrices, gate and up.
    pub matrix_type: GgmlType,
    pub ffn_down_type: GgmlType,
    /// `None`: the output reuses the token embeddings (tied). Before llama-quantize's
    /// output rule and [`fallback`] ([`Preset::output_tensor_type`]).
    pub output_type: Option<GgmlType>,
    /// `general.file_type` (llama.cpp's `LLAMA_FTYPE_*`).
    pub file_type: u32,
    /// Per-tensor exceptions of a llama-quantize preset.
    pub mix: Mix,
    /// A mixture of experts in every layer (`qwen3moe` or `gpt-oss`, as
    /// [`MoeShape::style`] says), or `None` for a dense `llama`.
    pub experts: Option<MoeShape>,
}

/// Which architecture a mixture-of-experts preset writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeStyle {
    /// `qwen3moe`: per-head query and key norms, an F32 router, experts in
    /// `matrix_type` (gate, up) and `ffn_down_type` (down).
    Qwen3,
    /// `gpt-oss`: biased projections and router, a sink per head, alternating
    /// sliding-window (128) and full attention, YaRN RoPE (factor 32 over 4096
    /// positions), MXFP4 experts with biases, `post_attention_norm` before the experts.
    GptOss,
}

/// The experts of a [`Preset`]: their count, how many a token is routed to, and the
/// width of each. Their gate and up projections take `matrix_type`, the down projection
/// `ffn_down_type`, the router F32 (as converters write it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    pub count: u32,
    pub used: u32,
    pub n_ff: u64,
    /// Query and key head width (`attention.key_length`; Qwen 3 MoE's is 128 whatever
    /// the width).
    pub head_dim: u64,
    pub style: MoeStyle,
    /// How often the router picks each expert.
    pub routing: Routing,
}

/// How a preset's routers spread tokens over the experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// Every expert about equally often (each router row noise of one scale).
    Even,
    /// Some experts far more often than others, as a trained router's do: each layer's
    /// experts ranked in an order of their own, the router row of the expert at rank
    /// `r` scaled by `exp(ROUTER_SKEW * logit((r + 1/2) / count))`, so that its logits
    /// spread wider and it lands in a token's top k more often. With 128 experts and 8
    /// a token, [`ROUTER_SKEW`] puts 90% of a layer's routes on its 65 most-used experts
    /// and 4.3% on the first, the figures published for Qwen3-30B-A3B's routers on
    /// diverse text (llama-imatrix's per-expert counts: 65 of 128 experts for 90% of the
    /// routes, the busiest expert 4.3%; with their uniform share, 90% would take 115).
    Skewed,
}

/// [`Routing::Skewed`]'s spread (found by sampling top-8 of 128 logits so scaled).
pub const ROUTER_SKEW: f64 = 0.27;

/// How a preset's layer matrices depart from `matrix_type` and `ffn_down_type`, as
/// llama-quantize's presets do: the rules of `llama_tensor_get_type` in `llama-quant.cpp`
/// for a dense llama (no experts, not the 70B size, whose attn_v gets more bits) without
/// an importance matrix. "The first k" counts layers (llama.cpp counts attn_v tensors,
/// one a layer); "the first 1/8" is the first `n_layers / 8` layers; "gqa4" is four or
/// more query heads per KV head. Any type whose blocks do not divide a row falls back
/// as [`fallback`] says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mix {
    /// No exceptions (also `Q3_K_S`, whose only exception is its Q6_K output).
    Plain,
    /// `Q2_K`: attn_v Q3_K (Q4_K with gqa4), attn_output Q3_K (ffn_down's Q3_K is
    /// `ffn_down_type`).
    Q2K,
    /// `Q3_K_M`: attn_v Q5_K in the first 2, Q4_K after; ffn_down Q5_K in the first 1/16,
    /// `ffn_down_type` (Q4_K) after; attn_output Q4_K.
    Q3KM,
    /// `Q3_K_L`: attn_v and attn_output Q5_K (ffn_down's Q5_K is `ffn_down_type`).
    Q3KL,
    /// `Q4_K_S`: attn_v Q5_K in the first 4; ffn_down Q5_K in the first 1/8.
    Q4KS,
    /// `IQ4_XS`: attn_v Q5_K only with gqa4; ffn_down Q5_K in the first 1/8 (an
    /// importance matrix would keep it IQ4_XS).
    IQ4XS,
    /// `IQ3_M`: attn_v and attn_output Q4_K; ffn_down Q4_K in the first 1/8.
    IQ3M,
    /// `IQ2_M`: attn_v IQ3_S (Q4_K with gqa4); attn_output IQ3_S; ffn_down IQ3_S in the
    /// first 1/8.
    IQ2M,
    /// `Q4_K_M` of a 70B: attn_v and ffn_down Q6_K in the layers `use_more_bits` picks
    /// (the first and last eighths, and every third between); elsewhere attn_v Q5_K (the
    /// 70B size's rule lifts its Q4_K) and ffn_down `ffn_down_type` (Q4_K).
    Q4KM70B,
    /// `MXFP4_MOE`: every expert tensor (gate, up and down: `ffn_down_type`) MXFP4, the
    /// other matrices `matrix_type` (Q8_0), as llama-quant.cpp's rule for 3-D tensors.
    Mxfp4Moe,
}

/// llama-quant.cpp's `use_more_bits`: the layers a `_M` mix gives more bits.
fn use_more_bits(layer: u32, n_layers: u32) -> bool {
    let eighth = n_layers / 8;
    layer < eighth || layer >= 7 * n_layers / 8 || (layer - eighth) % 3 == 2
}

impl Preset {
    /// The type of layer `layer`'s matrix `role` (`attn_q`, `ffn_down`, ...).
    pub fn layer_type(&self, role: &str, layer: u32) -> GgmlType {
        use GgmlType::*;
        let first = |part: u32| layer < self.n_layers / part;
        let gqa4 = self.n_heads / self.n_kv_heads >= 4;
        let rule = match (self.mix, role) {
            (Mix::Q2K, "attn_v") => Some(if gqa4 { Q4_K } else { Q3_K }),
            (Mix::Q2K, "attn_output") => Some(Q3_K),
            (Mix::Q3KM, "attn_v") => Some(if layer < 2 { Q5_K } else { Q4_K }),
            (Mix::Q3KM, "ffn_down") if first(16) => Some(Q5_K),
            (Mix::Q3KM, "attn_output") => Some(Q4_K),
            (Mix::Q3KL, "attn_v" | "attn_output") => Some(Q5_K),
            (Mix::Q4KS, "attn_v") if layer < 4 => Some(Q5_K),
            (Mix::Q4KS | Mix::IQ4XS, "ffn_down") if first(8) => Some(Q5_K),
            (Mix::IQ4XS, "attn_v") if gqa4 => Some(Q5_K),
            (Mix::IQ3M, "attn_v" | "attn_output") => Some(Q4_K),
            (Mix::IQ3M, "ffn_down") if first(8) => Some(Q4_K),
            (Mix::IQ2M, "attn_v") => Some(if gqa4 { Q4_K } else { IQ3_S }),
            (Mix::IQ2M, "attn_output") => Some(IQ3_S),
            (Mix::IQ2M, "ffn_down") if first(8) => Some(IQ3_S),
            (Mix::Q4KM70B, "attn_v") => Some(if use_more_bits(layer, self.n_layers) {
                Q6_K
            } else {
                Q5_K
            }),
            (Mix::Q4KM70B, "ffn_down") if use_more_bits(layer, self.n_layers) => Some(Q6_K),
            (Mix::Mxfp4Moe, "ffn_gate" | "ffn_up") => Some(MXFP4),
            _ => None,
        };
        let ty = rule.unwrap_or(if role == "ffn_down" {
            self.ffn_down_type
        } else {
            self.matrix_type
        });
        // Rows are `n_ff` wide for ffn_down, `n_embd` for every other matrix.
        let cols = if role == "ffn_down" {
            self.n_ff
        } else {
            self.n_embd
        };
        fallback(ty, cols)
    }

    /// The token embeddings' type (rows of `n_embd`).
    pub fn embd_tensor_type(&self) -> GgmlType {
        fallback(self.embd_type, self.n_embd)
    }

    /// The output's type, `None` when tied: Q8_0 where the base type's blocks do not
    /// divide a row (llama-quant.cpp's output rule), before the fallback.
    pub fn output_tensor_type(&self) -> Option<GgmlType> {
        let whole = self.n_embd.is_multiple_of(self.matrix_type.block_size());
        self.output_type
            .map(|ty| fallback(if whole { ty } else { GgmlType::Q8_0 }, self.n_embd))
    }
}

/// llama-quantize's type for rows of `cols` values that are not whole blocks of `ty`
/// (`tensor_type_fallback`): the i-quants go to IQ4_NL, Q2_K, Q3_K and the ternary types
/// to Q4_0, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0; F16 where even that does not fit.
pub fn fallback(ty: GgmlType, cols: u64) -> GgmlType {
    use GgmlType::*;
    if cols.is_multiple_of(ty.block_size()) {
        return ty;
    }
    let to = match ty {
        IQ1_S | IQ1_M | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S | IQ4_XS => IQ4_NL,
        Q2_K | Q3_K | TQ1_0 | TQ2_0 => Q4_0,
        Q4_K => Q5_0,
        Q5_K => Q5_1,
        Q6_K => Q8_0,
        other => other,
    };
    if cols.is_multiple_of(to.block_size()) {
        to
    } else {
        F16
    }
}

/// Llama-2-7B's shapes in the Q4_K_M mix (Q6_K for ffn_down and the output): the base of
/// the 7B mixes, which change only the types.
const LLAMA2_7B: Preset = Preset {
    name: "7b-q4k",
    n_layers: 32,
    n_embd: 4096,
    n_ff: 11008,
    n_heads: 32,
    n_kv_heads: 32,
    context_length: 4096,
    rope_freq_base: 10_000.0,
    rms_eps: 1e-5,
    embd_type: GgmlType::Q4_K,
    matrix_type: GgmlType::Q4_K,
    ffn_down_type: GgmlType::Q6_K,
    output_type: Some(GgmlType::Q6_K),
    file_type: 15,
    mix: Mix::Plain,
    experts: None,
};

/// SmolLM2-135M's shapes and types: Q4_1, Q8_0 embeddings, tied output.
const SMOLLM2_135M: Preset = Preset {
    name: "135m-q4_1",
    n_layers: 30,
    n_embd: 576,
    n_ff: 1536,
    n_heads: 9,
    n_kv_heads: 3,
    context_length: 8192,
    rope_freq_base: 100_000.0,
    embd_type: GgmlType::Q8_0,
    matrix_type: GgmlType::Q4_1,
    ffn_down_type: GgmlType::Q4_1,
    output_type: None,
    file_type: 3,
    ..LLAMA2_7B
};

/// Qwen3-30B-A3B's shapes in the Q4_K_M mix: 48 layers, 2048 wide, 32 query heads and 4
/// KV heads of 128, 128 experts of 768, 8 per token (16 GiB).
const QWEN3MOE_30B_A3B: Preset = Preset {
    name: "qwen3moe-30b-a3b-q4k",
    n_layers: 48,
    n_embd: 2048,
    n_ff: 6144,
    n_heads: 32,
    n_kv_heads: 4,
    context_length: 40960,
    rope_freq_base: 1_000_000.0,
    rms_eps: 1e-6,
    experts: Some(MoeShape {
        count: 128,
        used: 8,
        n_ff: 768,
        head_dim: 128,
        style: MoeStyle::Qwen3,
        routing: Routing::Even,
    }),
    ..LLAMA2_7B
};

pub const PRESETS: &[Preset] = &[
    LLAMA2_7B,
    // TinyLlama-1.1B's shapes (grouped-query attention, 4 KV heads).
    Preset {
        name: "1b-q4k",
        n_layers: 22,
        n_embd: 2048,
        n_ff: 5632,
        n_kv_heads: 4,
        context_length: 2048,
        ..LLAMA2_7B
    },
    SMOLLM2_135M,
    // Llama-2-70B's shapes (80 layers, 8192 wide, 64 query heads and 8 KV heads, FFN
    // 28,672) in the Q4_K_M mix as llama-quantize makes it for a 70B (about 39 GiB).
    Preset {
        name: "70b-q4k",
        n_layers: 80,
        n_embd: 8192,
        n_ff: 28_672,
        n_heads: 64,
        n_kv_heads: 8,
        ffn_down_type: GgmlType::Q4_K,
        file_type: 15,
        mix: Mix::Q4KM70B,
        ..LLAMA2_7B
    },
    // Two layers of 64 with SmolLM2's vocabulary: a forward pass that costs little but
    // the output projection, so that a server's host work per step shows on a CPU.
    Preset {
        name: "tiny-q4_1",
        n_layers: 2,
        n_embd: 64,
        n_ff: 256,
        n_heads: 2,
        n_kv_heads: 1,
        rope_freq_base: 10_000.0,
        ..SMOLLM2_135M
    },
    // Llama-2-7B's shapes in llama-quantize's Q2_K mix (LLAMA_FTYPE_MOSTLY_Q2_K).
    Preset {
        name: "7b-q2_k",
        embd_type: GgmlType::Q2_K,
        matrix_type: GgmlType::Q2_K,
        ffn_down_type: GgmlType::Q3_K,
        file_type: 10,
        mix: Mix::Q2K,
        ..LLAMA2_7B
    },
    // Llama-2-7B's shapes in llama-quantize's Q3_K_M mix (LLAMA_FTYPE_MOSTLY_Q3_K_M).
    Preset {
        name: "7b-q3_k_m",
        embd_type: GgmlType::Q3_K,
        matrix_type: GgmlType::Q3_K,
        ffn_down_type: GgmlType::Q4_K,
        file_type: 12,
        mix: Mix::Q3KM,
        ..LLAMA2_7B
    },
    // Llama-2-7B's shapes in llama-quantize's Q3_K_S mix (LLAMA_FTYPE_MOSTLY_Q3_K_S).
    Preset {
        name: "7b-q3_k_s",
        embd_type: GgmlType::Q3_K,
        matrix_type: GgmlType::Q3_K,
        ffn_down_type: GgmlType::Q3_K,
        file_type: 11,
        ..LLAMA2_7B
    },
    // Llama-2-7B's shapes in llama-quantize's Q3_K_L mix (LLAMA_FTYPE_MOSTLY_Q3_K_L).
    Preset {
        name: "7b-q3_k_l",
        embd_type: GgmlType::Q3_K,
        matrix_type: GgmlType::Q3_K,
        ffn_down_type: GgmlType::Q5_K,
        file_type: 13,
        mix: Mix::Q3KL,
        ..LLAMA2_7B
    },
    // Llama-2-7B's shapes in llama-quantize's Q4_K_S mix (LLAMA_FTYPE_MOSTLY_Q4_K_S).
    Preset {
        name: "7b-q4_k_s",
        ffn_down_type: GgmlType::Q4_K,
        file_type: 14,
        mix: Mix::Q4KS,
        ..LLAMA2_7B
    },
    // Llama-2-7B's shapes in llama-quantize's IQ4_XS mix (LLAMA_FTYPE_MOSTLY_IQ4_XS).
    Preset {
        name: "7b-iq4_xs",
        embd_type: GgmlType::IQ4_XS,
        matrix_type: GgmlType::IQ4_XS,
        ffn_down_type: GgmlType::IQ4_XS,
        file_type: 30,
        mix: Mix::IQ4XS,
        ..LLAMA2_7B
    },
    // Llama-2-7B's shapes in llama-quantize's IQ3_M mix (LLAMA_FTYPE_MOSTLY_IQ3_M).
    Preset {
        name: "7b-iq3_m",
        embd_type: GgmlType::IQ3_S,
        matrix_type: GgmlType::IQ3_S,
        ffn_down_type: GgmlType::IQ3_S,
        file_type: 27,
        mix: Mix::IQ3M,
        ..LLAMA2_7B
    },
    // Llama-2-7B's shapes in llama-quantize's IQ2_M mix (LLAMA_FTYPE_MOSTLY_IQ2_M):
    // IQ3_S embeddings, a Q5_K output.
    Preset {
        name: "7b-iq2_m",
        embd_type: GgmlType::IQ3_S,
        matrix_type: GgmlType::IQ2_S,
        ffn_down_type: GgmlType::IQ2_S,
        output_type: Some(GgmlType::Q5_K),
        file_type: 29,
        mix: Mix::IQ2M,
        ..LLAMA2_7B
    },
    QWEN3MOE_30B_A3B,
    // The same, its routers favouring some experts as Qwen3-30B-A3B's do
    // ([`Routing::Skewed`]).
    Preset {
        name: "qwen3moe-30b-a3b-skewed-q4k",
        experts: Some(MoeShape {
            routing: Routing::Skewed,
            ..QWEN3MOE_30B_A3B.experts.unwrap()
        }),
        ..QWEN3MOE_30B_A3B
    },
    // The same shapes as llama-quantize's MXFP4_MOE writes them: MXFP4 experts, Q8_0
    // attention, embeddings and output (about 17 GiB).
    Preset {
        name: "qwen3moe-30b-a3b-mxfp4",
        embd_type: GgmlType::Q8_0,
        matrix_type: GgmlType::Q8_0,
        ffn_down_type: GgmlType::MXFP4,
        output_type: Some(GgmlType::Q8_0),
        file_type: 38,
        mix: Mix::Mxfp4Moe,
        ..QWEN3MOE_30B_A3B
    },
    // The same layout, small enough for a CPU: 8 layers, 1024 wide, 64 experts of 512,
    // 8 per token (0.5 GiB).
    Preset {
        name: "qwen3moe-small-q4k",
        n_layers: 8,
        n_embd: 1024,
        n_ff: 3072,
        n_heads: 16,
        experts: Some(MoeShape {
            count: 64,
            n_ff: 512,
            ..QWEN3MOE_30B_A3B.experts.unwrap()
        }),
        ..QWEN3MOE_30B_A3B
    },
    // gpt-oss-20b's shapes as its MXFP4 release stores them: 24 layers, 2880 wide, 64
    // query heads and 8 KV heads of 64, 32 experts of 2880, 4 per token, Q8_0 attention,
    // embeddings and output (about 11 GiB with this vocabulary).
    Preset {
        name: "gpt-oss-20b-mxfp4",
        n_layers: 24,
        n_embd: 2880,
        n_ff: 2880,
        n_heads: 64,
        n_kv_heads: 8,
        context_length: 131_072,
        rope_freq_base: 150_000.0,
        embd_type: GgmlType::Q8_0,
        matrix_type: GgmlType::Q8_0,
        ffn_down_type: GgmlType::MXFP4,
        output_type: Some(GgmlType::Q8_0),
        file_type: 38,
        experts: Some(MoeShape {
            count: 32,
            used: 4,
            n_ff: 2880,
            head_dim: 64,
            style: MoeStyle::GptOss,
            routing: Routing::Even,
        }),
        ..LLAMA2_7B
    },
];
