//! The synthetic models' specs: one per architecture, head layout and weight type the
//! references cover.

use gguf_format::GgmlType;

use super::{Arch, Blocks, Spec, VocabStyle, N_EMBD, N_FF};

const LLAMA: Spec = Spec {
    name: "",
    arch: Arch::Llama,
    vocab: VocabStyle::SmolLm,
    n_embd: N_EMBD,
    n_layers: 2,
    n_heads: 4,
    n_kv_heads: 2,
    head_dim: 64,
    matrices: GgmlType::F32,
    overrides: &[],
    token_embd: GgmlType::Q8_0,
    blocks: Blocks::Quantized,
    output: None,
    rope_freq_base: 100_000.0,
    rope_freqs: false,
    sliding_window: 0,
    swa_pattern: 0,
    rope_freq_base_swa: 0.0,
    rope_scale: 0.0,
    yarn: (0.0, 0),
    attn_softcap: 0.0,
    final_softcap: 0.0,
    rope_original_context: 0,
    experts: (0, 0, 0),
    shared_ff: 0,
    expert_gate: true,
    router: GgmlType::F32,
    prompt:
        "<|im_start|>user\nThe cat sat on the mat, and the dog sat on the log in 2024!<|im_end|>",
    seed: 0,
};

/// Gemma 2: alternating sliding-window and global layers (the default pattern), no
/// Q/K norms, soft-capped attention scores and logits (caps small enough to bend most
/// values), 8 heads of 64 on 4 KV heads, its Q4_K_M mix, output tied.
const GEMMA2: Spec = Spec {
    name: "gemma2",
    arch: Arch::Gemma2,
    vocab: VocabStyle::Gemma,
    n_layers: 4,
    n_heads: 8,
    n_kv_heads: 4,
    head_dim: 64,
    matrices: GgmlType::Q4_K,
    overrides: &[("attn_v", GgmlType::Q6_K), ("ffn_down", GgmlType::Q6_K)],
    token_embd: GgmlType::Q6_K,
    output: None,
    rope_freq_base: 10_000.0,
    sliding_window: 8,
    attn_softcap: 8.0,
    final_softcap: 12.0,
    prompt: "<start_of_turn>user\nThe cat sat on the mat. Is it 42? Où?<end_of_turn>",
    seed: 20,
    ..LLAMA
};

/// A llama model whose matrices and untied output are all `ty`.
const fn llama_typed(name: &'static str, ty: GgmlType, token_embd: GgmlType, seed: u64) -> Spec {
    Spec {
        name,
        matrices: ty,
        token_embd,
        output: Some(ty),
        seed,
        ..LLAMA
    }
}

/// A llama model whose matrices and untied output are all `ty`, every quantized tensor
/// random in every field.
const fn llama_random(name: &'static str, ty: GgmlType, seed: u64) -> Spec {
    Spec {
        name,
        matrices: ty,
        output: Some(ty),
        blocks: Blocks::Random,
        seed,
        ..LLAMA
    }
}

const QWEN_PROMPT: &str = "<|im_start|>user\nThe cat sat on the mat. Is it a café? 42<|im_end|>";
const GEMMA_PROMPT: &str =
    "<start_of_turn>user\nThe cat sat on the mat. Is it 42? Où?<end_of_turn>";

/// Every expert tensor in MXFP4 (the other matrices in the spec's `matrices`).
const MXFP4_EXPERTS: &[(&str, GgmlType)] = &[
    ("ffn_gate_exps", GgmlType::MXFP4),
    ("ffn_up_exps", GgmlType::MXFP4),
    ("ffn_down_exps", GgmlType::MXFP4),
];

/// gpt-oss: biased projections, attention sinks, alternating sliding-window (8) and
/// global layers, YaRN RoPE (gpt-oss's factor 32 over 4096 positions, so the ramp between
/// kept and interpolated angles falls inside the head), 8 MXFP4 experts of which 4 per
/// token with biases, Q8_0 attention, F32 router, biases and sinks.
const GPT_OSS: Spec = Spec {
    name: "gpt-oss",
    arch: Arch::GptOss,
    vocab: VocabStyle::Qwen2,
    n_layers: 4,
    n_heads: 8,
    n_kv_heads: 2,
    head_dim: 32,
    matrices: GgmlType::Q8_0,
    overrides: MXFP4_EXPERTS,
    token_embd: GgmlType::Q8_0,
    output: Some(GgmlType::Q8_0),
    rope_freq_base: 150_000.0,
    sliding_window: 8,
    yarn: (32.0, 4096),
    experts: (8, 4, 256),
    prompt: QWEN_PROMPT,
    seed: 140,
    ..LLAMA
};

/// Every synthetic model the references cover.
pub const SPECS: &[Spec] = &[
    // One llama per weight type: every layer matrix and the output in that type. The
    // BF16 model's embeddings are BF16 too (they failed to load while the embedding
    // lookup decoded only F32, F16 and Q8_0).
    llama_typed("llama-q4_0", GgmlType::Q4_0, GgmlType::Q8_0, 1),
    llama_typed("llama-q4_1", GgmlType::Q4_1, GgmlType::Q8_0, 2),
    llama_typed("llama-q5_0", GgmlType::Q5_0, GgmlType::Q8_0, 3),
    llama_typed("llama-q5_1", GgmlType::Q5_1, GgmlType::Q8_0, 4),
    llama_typed("llama-q8_0", GgmlType::Q8_0, GgmlType::Q8_0, 5),
    llama_typed("llama-q2_k", GgmlType::Q2_K, GgmlType::Q8_0, 20),
    llama_typed("llama-q3_k", GgmlType::Q3_K, GgmlType::Q8_0, 19),
    llama_typed("llama-q4_k", GgmlType::Q4_K, GgmlType::Q8_0, 6),
    llama_typed("llama-q5_k", GgmlType::Q5_K, GgmlType::Q8_0, 7),
    llama_typed("llama-q6_k", GgmlType::Q6_K, GgmlType::Q8_0, 8),
    llama_typed("llama-iq4_xs", GgmlType::IQ4_XS, GgmlType::Q8_0, 21),
    // The per-tensor mixes of llama-quantize's presets for this model, as
    // llama_tensor_get_type (llama-quant.cpp) picks them for a dense llama of two layers
    // with two query heads per KV head (n_gqa 2, below the rules' 4), an untied output,
    // no importance matrix, and rows of 256 and 512 values (whole k-quant blocks, so no
    // fallback type applies). Each preset starts from its base type (the matrices and,
    // with no rule of their own but in IQ2_M, the embeddings); the output takes Q6_K
    // (Q5_K in the IQ1, IQ2 and IQ3_XXS presets). With two layers, the rules for the
    // first eighth or sixteenth of the layers (n_layer/8 = 0) never apply, and those for
    // the first 2 or 4 attn_v tensors take both layers:
    //   Q2_K    attn_v Q3_K (Q4_K from n_gqa 4), ffn_down Q3_K, attn_output Q3_K
    //   Q3_K_S  no exceptions
    //   Q3_K_M  attn_v Q5_K (the first 2), ffn_down Q4_K (Q5_K in the first 1/16),
    //           attn_output Q4_K
    //   Q3_K_L  attn_v, ffn_down and attn_output Q5_K
    //   Q4_K_S  attn_v Q5_K (the first 4); ffn_down Q5_K in the first 1/8
    //   IQ4_XS  attn_v Q5_K only from n_gqa 4; ffn_down Q5_K in the first 1/8 (without
    //           an importance matrix)
    //   IQ3_M   attn_v and attn_output Q4_K; ffn_down Q4_K in the first 1/8
    //   IQ2_M   attn_v IQ3_S (Q4_K from n_gqa 4), attn_output IQ3_S, ffn_down IQ3_S in
    //           the first 1/8; the embeddings IQ3_S, the output Q5_K
    Spec {
        name: "llama-q2_k-mix",
        matrices: GgmlType::Q2_K,
        overrides: &[
            ("attn_v", GgmlType::Q3_K),
            ("ffn_down", GgmlType::Q3_K),
            ("attn_output", GgmlType::Q3_K),
        ],
        token_embd: GgmlType::Q2_K,
        output: Some(GgmlType::Q6_K),
        seed: 31,
        ..LLAMA
    },
    Spec {
        name: "llama-q3_k_m-mix",
        matrices: GgmlType::Q3_K,
        overrides: &[
            ("attn_v", GgmlType::Q5_K),
            ("ffn_down", GgmlType::Q4_K),
            ("attn_output", GgmlType::Q4_K),
        ],
        token_embd: GgmlType::Q3_K,
        output: Some(GgmlType::Q6_K),
        seed: 32,
        ..LLAMA
    },
    Spec {
        name: "llama-q3_k_s-mix",
        matrices: GgmlType::Q3_K,
        token_embd: GgmlType::Q3_K,
        output: Some(GgmlType::Q6_K),
        seed: 33,
        ..LLAMA
    },
    Spec {
        name: "llama-q3_k_l-mix",
        matrices: GgmlType::Q3_K,
        overrides: &[
            ("attn_v", GgmlType::Q5_K),
            ("ffn_down", GgmlType::Q5_K),
            ("attn_output", GgmlType::Q5_K),
        ],
        token_embd: GgmlType::Q3_K,
        output: Some(GgmlType::Q6_K),
        seed: 34,
        ..LLAMA
    },
    Spec {
        name: "llama-q4_k_s-mix",
        matrices: GgmlType::Q4_K,
        overrides: &[("attn_v", GgmlType::Q5_K)],
        token_embd: GgmlType::Q4_K,
        output: Some(GgmlType::Q6_K),
        seed: 35,
        ..LLAMA
    },
    Spec {
        name: "llama-iq4_xs-mix",
        matrices: GgmlType::IQ4_XS,
        token_embd: GgmlType::IQ4_XS,
        output: Some(GgmlType::Q6_K),
        seed: 36,
        ..LLAMA
    },
    Spec {
        name: "llama-iq3_m-mix",
        matrices: GgmlType::IQ3_S,
        overrides: &[
            ("attn_v", GgmlType::Q4_K),
            ("attn_output", GgmlType::Q4_K),
        ],
        token_embd: GgmlType::IQ3_S,
        output: Some(GgmlType::Q6_K),
        seed: 37,
        ..LLAMA
    },
    Spec {
        name: "llama-iq2_m-mix",
        matrices: GgmlType::IQ2_S,
        overrides: &[
            ("attn_v", GgmlType::IQ3_S),
            ("attn_output", GgmlType::IQ3_S),
        ],
        token_embd: GgmlType::IQ3_S,
        output: Some(GgmlType::Q5_K),
        seed: 38,
        ..LLAMA
    },
    // MXFP4: as IQ4_NL (288 wide, the layers' matrices repacked by llama.cpp, the
    // output not, rows of 9 blocks).
    Spec {
        name: "llama-mxfp4",
        n_embd: 288,
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 32,
        matrices: GgmlType::MXFP4,
        output: Some(GgmlType::MXFP4),
        seed: 30,
        ..LLAMA
    },
    llama_typed("llama-iq3_s", GgmlType::IQ3_S, GgmlType::Q8_0, 23),
    llama_typed("llama-iq3_xxs", GgmlType::IQ3_XXS, GgmlType::Q8_0, 24),
    llama_typed("llama-iq2_xxs", GgmlType::IQ2_XXS, GgmlType::Q8_0, 25),
    llama_typed("llama-iq2_xs", GgmlType::IQ2_XS, GgmlType::Q8_0, 26),
    llama_typed("llama-iq2_s", GgmlType::IQ2_S, GgmlType::Q8_0, 27),
    llama_typed("llama-iq1_s", GgmlType::IQ1_S, GgmlType::Q8_0, 28),
    llama_typed("llama-iq1_m", GgmlType::IQ1_M, GgmlType::Q8_0, 29),
    llama_typed("llama-tq1_0", GgmlType::TQ1_0, GgmlType::Q8_0, 39),
    llama_typed("llama-tq2_0", GgmlType::TQ2_0, GgmlType::Q8_0, 40),
    // IQ4_NL: 288 wide (rows of 9 blocks, which llama.cpp's single-token dot product
    // takes in pairs and one apart), 9 heads of 32 on 3 KV heads; every matrix but the
    // output (300 rows) has a multiple of 8 rows, which llama.cpp repacks.
    Spec {
        name: "llama-iq4_nl",
        n_embd: 288,
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 32,
        matrices: GgmlType::IQ4_NL,
        output: Some(GgmlType::IQ4_NL),
        seed: 22,
        ..LLAMA
    },
    llama_typed("llama-f16", GgmlType::F16, GgmlType::F16, 9),
    llama_typed("llama-bf16", GgmlType::BF16, GgmlType::BF16, 10),
    llama_typed("llama-f32", GgmlType::F32, GgmlType::F32, 11),
    // Head layouts: multi-head with the output tied to Q6_K embeddings (as small
    // Q4_K_M models have it; refused, like BF16, before the lookup decoded every
    // type); multi-query with a Q4_K_M-like mix.
    Spec {
        name: "llama-mha-tied",
        n_layers: 3,
        n_kv_heads: 4,
        matrices: GgmlType::Q4_K,
        token_embd: GgmlType::Q6_K,
        seed: 12,
        ..LLAMA
    },
    Spec {
        name: "llama-mqa",
        n_kv_heads: 1,
        matrices: GgmlType::Q4_K,
        overrides: &[("ffn_down", GgmlType::Q6_K), ("attn_v", GgmlType::Q6_K)],
        token_embd: GgmlType::F16,
        output: Some(GgmlType::Q6_K),
        seed: 13,
        ..LLAMA
    },
    // Llama 3: its BPE tokenizer, 8 heads of 32 sharing 2 KV heads, RoPE base 500,000
    // with per-frequency divisors (which the forward pass once ignored: logits off by
    // up to 9.4).
    Spec {
        name: "llama3",
        vocab: VocabStyle::Llama3,
        n_layers: 3,
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 32,
        matrices: GgmlType::Q5_K,
        overrides: &[("ffn_down", GgmlType::Q6_K)],
        output: Some(GgmlType::Q6_K),
        rope_freq_base: 500_000.0,
        rope_freqs: true,
        prompt: "<|start_header_id|>user<|end_header_id|>\n\nThe cat sat on the mat 12345 times; isn't it?<|eot_id|>",
        seed: 14,
        ..LLAMA
    },
    // Qwen 2: biased Q/K/V, NeoX RoPE.
    Spec {
        name: "qwen2-tied",
        arch: Arch::Qwen2,
        vocab: VocabStyle::Qwen2,
        matrices: GgmlType::Q8_0,
        rope_freq_base: 1_000_000.0,
        prompt: "<|im_start|>user\nThe cat sat on the mat. Is it a café? 42<|im_end|>",
        seed: 15,
        ..LLAMA
    },
    Spec {
        name: "qwen2-gqa4",
        arch: Arch::Qwen2,
        vocab: VocabStyle::Qwen2,
        n_layers: 3,
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 32,
        matrices: GgmlType::Q4_0,
        overrides: &[("attn_v", GgmlType::Q5_1), ("ffn_down", GgmlType::Q4_1)],
        token_embd: GgmlType::F16,
        output: Some(GgmlType::Q6_K),
        rope_freq_base: 1_000_000.0,
        prompt: "<|im_start|>user\nThe cat sat on the mat. Is it a café? 42<|im_end|>",
        seed: 16,
        ..LLAMA
    },
    // Qwen 3: per-head RMSNorm of queries and keys, no biases; 8 heads of 64 (wider
    // than the model, as in Qwen3-0.6B, so the head size comes from `key_length`) on 2
    // KV heads; a Q4_K_M-like mix with the output tied to Q6_K embeddings.
    Spec {
        name: "qwen3",
        arch: Arch::Qwen3,
        vocab: VocabStyle::Qwen2,
        n_layers: 3,
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 64,
        matrices: GgmlType::Q4_K,
        overrides: &[("attn_v", GgmlType::Q6_K), ("ffn_down", GgmlType::Q6_K)],
        token_embd: GgmlType::Q6_K,
        rope_freq_base: 1_000_000.0,
        prompt: "<|im_start|>user\nThe cat sat on the mat. Is it a café? 42<|im_end|>",
        seed: 19,
        ..LLAMA
    },
    // Gemma 3: six layers so that the sixth is global and the others slide over 8
    // positions; 4 query heads of 128 (wider than the model) on one KV head; the real
    // Q4_K_M file's mix of types; tied output.
    Spec {
        name: "gemma3",
        arch: Arch::Gemma3,
        vocab: VocabStyle::Gemma,
        n_layers: 6,
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: 128,
        matrices: GgmlType::Q5_0,
        overrides: &[
            ("attn_v", GgmlType::Q8_0),
            ("attn_output", GgmlType::Q4_K),
            ("ffn_down", GgmlType::Q6_K),
        ],
        token_embd: GgmlType::Q8_0,
        output: None,
        rope_freq_base: 1_000_000.0,
        sliding_window: 8,
        prompt: "<start_of_turn>user\nThe cat sat on the mat. Is it 42? Où?<end_of_turn>",
        seed: 17,
        ..LLAMA
    },
    // Gemma 3's optional keys, read rather than defaulted: a sliding-window pattern of
    // 3 (layers 2 and 5 global), the local layers' own RoPE base, linear RoPE scaling
    // (global layers only, as in Gemma 3 4B and up) and soft-capped logits.
    Spec {
        name: "gemma3-keys",
        arch: Arch::Gemma3,
        vocab: VocabStyle::Gemma,
        n_layers: 6,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        matrices: GgmlType::Q8_0,
        overrides: &[("ffn_down", GgmlType::Q6_K)],
        token_embd: GgmlType::Q8_0,
        output: None,
        rope_freq_base: 1_000_000.0,
        sliding_window: 6,
        swa_pattern: 3,
        rope_freq_base_swa: 20_000.0,
        rope_scale: 4.0,
        final_softcap: 12.0,
        prompt: "<start_of_turn>user\nThe cat sat on the mat. Is it 42? Où?<end_of_turn>",
        seed: 21,
        ..LLAMA
    },
    GEMMA2,
    // Phi-3: fused Q/K/V and gate/up tensors, NeoX RoPE with the long-context models'
    // frequency factors and attention factor, its SentencePiece vocabulary whose chat
    // tokens swallow the new lines after them. With an original context of 4096 both
    // engines rotate by the short factors; with 16, shorter than the prompt, by the
    // long ones.
    Spec {
        name: "phi3",
        arch: Arch::Phi3,
        vocab: VocabStyle::Phi3,
        n_layers: 3,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        matrices: GgmlType::Q4_K,
        overrides: &[("attn_qkv", GgmlType::Q5_K), ("ffn_down", GgmlType::Q6_K)],
        token_embd: GgmlType::Q4_K,
        output: Some(GgmlType::Q6_K),
        rope_freq_base: 10_000.0,
        rope_original_context: 4096,
        prompt: "<|user|>\nThe cat sat on the mat. Is it 42? Où?<|end|>\n<|assistant|>\nThe cat",
        seed: 22,
        ..LLAMA
    },
    Spec {
        name: "phi3-long",
        arch: Arch::Phi3,
        vocab: VocabStyle::Phi3,
        n_layers: 3,
        n_heads: 4,
        n_kv_heads: 4,
        head_dim: 64,
        matrices: GgmlType::Q8_0,
        overrides: &[("ffn_up", GgmlType::Q4_0)],
        token_embd: GgmlType::Q8_0,
        output: Some(GgmlType::Q8_0),
        rope_freq_base: 10_000.0,
        rope_original_context: 16,
        prompt: "<|system|>\nBe brief.<|end|>\n<|user|>\nThe cat sat on the mat. Is it 42?<|end|>\n<|assistant|>\n",
        seed: 23,
        ..LLAMA
    },
    // Long prompts: a batch of 64 queries or more takes llama.cpp's tiled flash
    // attention, and decoding beyond 256 positions its split one (the view of the cache
    // then 512 positions, cut between the threads).
    Spec {
        name: "llama-q4_k-long",
        matrices: GgmlType::Q4_K,
        output: Some(GgmlType::Q6_K),
        prompt: "<|im_start|>user\nThe cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! <|im_end|>",
        seed: 41,
        ..LLAMA
    },
    Spec {
        name: "gemma2-long",
        sliding_window: 100,
        prompt: "<start_of_turn>user\nThe cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? The cat sat on the mat. Is it 42? Où? <end_of_turn>",
        seed: 42,
        ..GEMMA2
    },
    Spec {
        name: "gemma3-f16",
        arch: Arch::Gemma3,
        vocab: VocabStyle::Gemma,
        n_layers: 6,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        matrices: GgmlType::F16,
        token_embd: GgmlType::F16,
        output: Some(GgmlType::F32),
        rope_freq_base: 1_000_000.0,
        sliding_window: 8,
        prompt: "<start_of_turn>user\nThe cat sat on the mat. Is it 42? Où?<end_of_turn>",
        seed: 18,
        ..LLAMA
    },
    // Blocks random in every field (`Blocks::Random`): one llama per block type, its
    // Q8_0 embeddings random too, then each other architecture with a few of the types.
    llama_random("llama-q4_0-random", GgmlType::Q4_0, 101),
    llama_random("llama-q4_1-random", GgmlType::Q4_1, 102),
    llama_random("llama-q5_0-random", GgmlType::Q5_0, 103),
    llama_random("llama-q5_1-random", GgmlType::Q5_1, 104),
    llama_random("llama-q8_0-random", GgmlType::Q8_0, 105),
    llama_random("llama-q2_k-random", GgmlType::Q2_K, 106),
    llama_random("llama-q3_k-random", GgmlType::Q3_K, 107),
    llama_random("llama-q4_k-random", GgmlType::Q4_K, 108),
    llama_random("llama-q5_k-random", GgmlType::Q5_K, 109),
    llama_random("llama-q6_k-random", GgmlType::Q6_K, 110),
    llama_random("llama-iq2_xxs-random", GgmlType::IQ2_XXS, 111),
    llama_random("llama-iq2_xs-random", GgmlType::IQ2_XS, 112),
    llama_random("llama-iq2_s-random", GgmlType::IQ2_S, 113),
    llama_random("llama-iq3_xxs-random", GgmlType::IQ3_XXS, 114),
    llama_random("llama-iq3_s-random", GgmlType::IQ3_S, 115),
    llama_random("llama-iq1_s-random", GgmlType::IQ1_S, 116),
    llama_random("llama-iq1_m-random", GgmlType::IQ1_M, 117),
    llama_random("llama-iq4_nl-random", GgmlType::IQ4_NL, 118),
    llama_random("llama-iq4_xs-random", GgmlType::IQ4_XS, 119),
    llama_random("llama-tq1_0-random", GgmlType::TQ1_0, 120),
    llama_random("llama-tq2_0-random", GgmlType::TQ2_0, 121),
    llama_random("llama-mxfp4-random", GgmlType::MXFP4, 122),
    // Qwen 2 with its biases, the output tied to the random embeddings.
    Spec {
        name: "qwen2-random",
        arch: Arch::Qwen2,
        vocab: VocabStyle::Qwen2,
        matrices: GgmlType::IQ2_XXS,
        blocks: Blocks::Random,
        rope_freq_base: 1_000_000.0,
        prompt: QWEN_PROMPT,
        seed: 123,
        ..LLAMA
    },
    Spec {
        name: "qwen3-random",
        arch: Arch::Qwen3,
        vocab: VocabStyle::Qwen2,
        n_heads: 8,
        matrices: GgmlType::IQ2_S,
        overrides: &[("attn_v", GgmlType::IQ3_XXS), ("ffn_down", GgmlType::Q3_K)],
        token_embd: GgmlType::Q6_K,
        blocks: Blocks::Random,
        rope_freq_base: 1_000_000.0,
        prompt: QWEN_PROMPT,
        seed: 124,
        ..LLAMA
    },
    // Phi-3 with 4 heads and 4 KV heads of 64, Q8_0 throughout, no RoPE scaling keys;
    // then with the 2-bit grids and the long and short factors.
    Spec {
        name: "phi3-random",
        arch: Arch::Phi3,
        vocab: VocabStyle::Phi3,
        n_kv_heads: 4,
        output: Some(GgmlType::Q8_0),
        matrices: GgmlType::Q8_0,
        blocks: Blocks::Random,
        rope_freq_base: 10_000.0,
        prompt: "<|user|>\nThe cat sat on the mat. Is it 42? Où?<|end|>\n<|assistant|>\nThe cat",
        seed: 125,
        ..LLAMA
    },
    Spec {
        name: "phi3-iq2_xs-random",
        arch: Arch::Phi3,
        vocab: VocabStyle::Phi3,
        matrices: GgmlType::IQ2_XS,
        overrides: &[("ffn_down", GgmlType::IQ4_NL)],
        output: Some(GgmlType::Q6_K),
        blocks: Blocks::Random,
        rope_freq_base: 10_000.0,
        rope_original_context: 16,
        prompt: "<|system|>\nBe brief.<|end|>\n<|user|>\nThe cat sat on the mat. Is it 42?<|end|>\n<|assistant|>\n",
        seed: 126,
        ..LLAMA
    },
    Spec {
        name: "gemma2-random",
        matrices: GgmlType::IQ2_XS,
        overrides: &[("attn_v", GgmlType::IQ3_S), ("ffn_down", GgmlType::Q5_K)],
        token_embd: GgmlType::Q4_K,
        blocks: Blocks::Random,
        seed: 127,
        ..GEMMA2
    },
    Spec {
        name: "gemma3-random",
        arch: Arch::Gemma3,
        vocab: VocabStyle::Gemma,
        n_layers: 6,
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: 128,
        matrices: GgmlType::IQ3_S,
        overrides: &[
            ("attn_output", GgmlType::IQ1_M),
            ("ffn_down", GgmlType::Q5_1),
        ],
        token_embd: GgmlType::Q5_0,
        blocks: Blocks::Random,
        rope_freq_base: 1_000_000.0,
        sliding_window: 8,
        prompt: GEMMA_PROMPT,
        seed: 128,
        ..LLAMA
    },
    // Mixtures of experts. Qwen 3 MoE: 32 experts, 4 per token, so the ranking runs
    // GCC's introsort rather than only its insertion sort; repacked Q4_K experts (one
    // token at a time) and Q6_K down projections (the tiled GEMM for 8 tokens or more).
    Spec {
        name: "qwen3moe-random",
        arch: Arch::Qwen3Moe,
        vocab: VocabStyle::Qwen2,
        n_heads: 8,
        matrices: GgmlType::Q4_K,
        overrides: &[("attn_v", GgmlType::IQ3_S), ("ffn_down_exps", GgmlType::Q6_K)],
        token_embd: GgmlType::Q6_K,
        output: Some(GgmlType::Q5_K),
        blocks: Blocks::Random,
        rope_freq_base: 1_000_000.0,
        experts: (32, 4, 256),
        prompt: QWEN_PROMPT,
        seed: 129,
        ..LLAMA
    },
    // Qwen 2 MoE: 8 experts, 2 per token, weights not renormalized, Q5_0 experts (dot
    // products of one token for every group) and IQ4_XS down projections, the shared
    // expert behind its sigmoid gate.
    Spec {
        name: "qwen2moe-random",
        arch: Arch::Qwen2Moe,
        vocab: VocabStyle::Qwen2,
        matrices: GgmlType::Q5_0,
        overrides: &[("ffn_down_exps", GgmlType::IQ4_XS), ("ffn_down_shexp", GgmlType::Q8_0)],
        token_embd: GgmlType::Q8_0,
        // llama.cpp requires Qwen 2 MoE's output matrix.
        output: Some(GgmlType::Q6_K),
        blocks: Blocks::Random,
        rope_freq_base: 1_000_000.0,
        experts: (8, 2, 256),
        shared_ff: 512,
        prompt: QWEN_PROMPT,
        seed: 130,
        ..LLAMA
    },
    // Mixtral's layout: a `llama` file with 4 experts, 2 per token, each as wide as the
    // feed-forward length, an F16 router, IQ4_NL experts and Q3_K down projections.
    Spec {
        name: "llama-moe-random",
        matrices: GgmlType::IQ4_NL,
        overrides: &[("ffn_down_exps", GgmlType::Q3_K)],
        output: Some(GgmlType::Q8_0),
        blocks: Blocks::Random,
        experts: (4, 2, N_FF),
        router: GgmlType::F16,
        seed: 131,
        ..LLAMA
    },
    // Every expert used by every token (the ranking decides only the order of the sum).
    Spec {
        name: "qwen3moe-all-random",
        arch: Arch::Qwen3Moe,
        vocab: VocabStyle::Qwen2,
        matrices: GgmlType::Q5_K,
        overrides: &[("ffn_down_exps", GgmlType::IQ3_XXS)],
        token_embd: GgmlType::Q4_K,
        output: Some(GgmlType::Q4_K),
        blocks: Blocks::Random,
        rope_freq_base: 1_000_000.0,
        experts: (4, 4, 256),
        prompt: QWEN_PROMPT,
        seed: 132,
        ..LLAMA
    },
    // One expert per token, and no expert gate: SiLU of the up projection.
    Spec {
        name: "llama-moe-top1-random",
        matrices: GgmlType::Q8_0,
        overrides: &[("ffn_down_exps", GgmlType::Q2_K)],
        output: Some(GgmlType::Q8_0),
        blocks: Blocks::Random,
        experts: (8, 1, N_FF),
        expert_gate: false,
        seed: 133,
        ..LLAMA
    },
    // Qwen 3 MoE as llama-quantize's MXFP4_MOE writes it: MXFP4 experts without biases,
    // Q8_0 elsewhere. 32 experts, 4 per token: on the GPU, prompts of 16 tokens or more
    // take MXFP4's int8 tiles for every routed product, down's included, and the
    // weighted sum then runs on its own.
    Spec {
        name: "qwen3moe-mxfp4-random",
        arch: Arch::Qwen3Moe,
        vocab: VocabStyle::Qwen2,
        n_heads: 8,
        matrices: GgmlType::Q8_0,
        overrides: MXFP4_EXPERTS,
        token_embd: GgmlType::Q8_0,
        output: Some(GgmlType::Q8_0),
        blocks: Blocks::Random,
        rope_freq_base: 1_000_000.0,
        experts: (32, 4, 256),
        prompt: QWEN_PROMPT,
        seed: 134,
        ..LLAMA
    },
    GPT_OSS,
    // Experts 2048 wide: the GPU's routed products take tiles of four slots from three
    // slots an expert (a 7-token prompt, a batch of six sequences or more).
    Spec {
        name: "gpt-oss-wide",
        experts: (8, 4, 2048),
        seed: 142,
        ..GPT_OSS
    },
    // A prompt of about 470 tokens, beyond gpt-oss's own window of 128: flash
    // attention's tiled kernel and, decoding past 512 positions, its split one, whose
    // first chunk then sees no position but the sink.
    Spec {
        name: "gpt-oss-long",
        head_dim: 64,
        n_heads: 4,
        sliding_window: 128,
        experts: (4, 2, 256),
        prompt: "<|im_start|>user\nThe cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! The cat sat on the mat, and the dog sat on the log in 2024! <|im_end|>",
        seed: 141,
        ..GPT_OSS
    },
];
