//! Small synthetic models with random weights, written through our own GGUF writer.
//!
//! Every model is 256 wide (a multiple of the k-quants' 256-value super-blocks; one
//! `IQ4_NL` model is 288 wide) with a 512-wide feed-forward, a few layers and a
//! vocabulary of a few hundred tokens; what varies is the architecture, the head layout
//! and the weight types. Weights are drawn
//! with variances chosen so that activations stay of order one through the layers,
//! attention is neither uniform nor one-hot, and the logits spread over several units,
//! so that the argmax is well defined. Quantized tensors are quantized from those f32
//! draws ([`super::quantize`]): realistic blocks with small, finite scales. The models
//! named `*-random` write their blocks random in every field instead, only the scales
//! fixed ([`Blocks::Random`]): the grid indices, signs and sub-scales no quantizer of ours
//! writes, as files from other writers hold them.

use gguf_format::{GgmlType, GgufError, GgufWriter};

use super::quantize::{quantize, random_blocks, Rng};
use super::vocab::{add_tokenizer, VocabStyle};

#[path = "specs.rs"]
mod specs;

pub use specs::SPECS;

pub const N_EMBD: usize = 256;
pub const N_FF: usize = 512;
const CONTEXT_LENGTH: u32 = 1024;

/// The architecture a synthetic model declares (its `general.architecture` name).
pub use model::Architecture as Arch;

/// What a quantized tensor's blocks hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocks {
    /// The f32 draws quantized: what a quantizer writes.
    Quantized,
    /// Every byte random but the scales ([`random_blocks`]), with the weights' RMS the
    /// draws' standard deviation.
    Random,
}

/// One synthetic model.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    pub name: &'static str,
    pub arch: Arch,
    pub vocab: VocabStyle,
    /// Model width: [`N_EMBD`] but for one model whose rows are an odd number of blocks
    /// of 32.
    pub n_embd: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Type of every layer matrix not named in `overrides`.
    pub matrices: GgmlType,
    /// Per-role types (`"ffn_down"`, `"attn_v"`, ...), as llama.cpp's mixes do.
    pub overrides: &'static [(&'static str, GgmlType)],
    pub token_embd: GgmlType,
    /// How the quantized tensors (embeddings and output included) are written.
    pub blocks: Blocks,
    /// `output.weight`'s type; `None` ties the output to the embeddings.
    pub output: Option<GgmlType>,
    pub rope_freq_base: f32,
    /// Llama 3's per-frequency RoPE divisors (`rope_freqs.weight`).
    pub rope_freqs: bool,
    /// Gemma's sliding window.
    pub sliding_window: u32,
    /// Gemma's `attention.sliding_window_pattern` (0: the key is absent).
    pub swa_pattern: u32,
    /// Gemma's `rope.freq_base_swa` (0: absent).
    pub rope_freq_base_swa: f32,
    /// Linear RoPE scaling factor (0: no `rope.scaling.*` keys).
    pub rope_scale: f32,
    /// YaRN RoPE scaling: its factor and original context (0: none).
    pub yarn: (f32, u32),
    /// `attn_logit_softcapping` and `final_logit_softcapping` (0: absent).
    pub attn_softcap: f32,
    pub final_softcap: f32,
    /// Phi-3's `rope_factors_long`/`_short` tensors, with its
    /// `rope.scaling.original_context_length` and `rope.scaling.attn_factor` (0: none
    /// of them).
    pub rope_original_context: u32,
    /// A mixture of experts in every layer: (experts, used per token, each one's width);
    /// 0 experts: dense feed-forward blocks.
    pub experts: (usize, usize, usize),
    /// Qwen 2 MoE's shared expert's width.
    pub shared_ff: usize,
    /// Whether the experts have a gate (`ffn_gate_exps`; some Mixtral-style files do
    /// not, and their experts apply SiLU to the up projection).
    pub expert_gate: bool,
    /// The router's type (F32 in the files converters write).
    pub router: GgmlType,
    /// Text the reference tokenizes; its tokens are the sequence evaluated.
    pub prompt: &'static str,
    pub seed: u64,
}

/// The spec named `name`.
pub fn spec(name: &str) -> Option<&'static Spec> {
    SPECS.iter().find(|s| s.name == name)
}

/// Scales of the random draws. Matrices have standard deviation `gain / sqrt(cols)`, so
/// each output of a product of a unit-RMS input is about `gain` in size.
const QK_GAIN: f32 = 1.5;
/// Token embeddings and the output matrix: logits of about 4 in standard deviation
/// (`sqrt(n_embd) * 0.25` for unit-gain output norms).
const EMBD_STD: f32 = 0.25;

struct Tensors {
    writer: GgufWriter,
    data: Vec<Vec<u8>>,
    seed: u64,
    blocks: Blocks,
    /// Write every tensor as the F32 values its blocks decode to ([`build_decoded`]).
    decoded: bool,
    /// Changes a tensor's shape before it is drawn ([`build_edited`]).
    edit: Edit,
}

/// A change to the shape of the tensor named by the first argument.
pub type Edit = fn(&str, &mut Vec<usize>);

impl Tensors {
    /// A norm's weights: `n` f32 values around 1.
    fn add_norm(&mut self, name: &str, n: usize) -> Result<(), GgufError> {
        self.add(name, GgmlType::F32, &[n], 1.0, 0.1)
    }

    fn add(
        &mut self,
        name: &str,
        ty: GgmlType,
        shape: &[usize],
        mean: f32,
        std: f32,
    ) -> Result<(), GgufError> {
        let mut shape = shape.to_vec();
        (self.edit)(name, &mut shape);
        let shape = shape.as_slice();
        let n: usize = shape.iter().product();
        if self.random(ty) {
            assert_eq!(mean, 0.0, "{name}: random blocks are centred");
            let bytes = random_blocks(ty, n, std, &mut Rng::for_tensor(self.seed, name));
            return self.add_bytes(name, ty, shape, bytes);
        }
        let values = Rng::for_tensor(self.seed, name).normals(n, mean, std);
        self.add_values(name, ty, shape, &values)
    }

    /// Whether a tensor of type `ty` gets random blocks.
    fn random(&self, ty: GgmlType) -> bool {
        self.blocks == Blocks::Random && ty.is_quantized()
    }

    /// One tensor of `cols` columns made of parts of `rows` rows each, drawn with their
    /// own standard deviations (a fused Q/K/V or gate/up weight).
    fn add_fused(
        &mut self,
        name: &str,
        ty: GgmlType,
        cols: usize,
        parts: &[(usize, f32)],
    ) -> Result<(), GgufError> {
        let rows = parts.iter().map(|&(rows, _)| rows).sum();
        if self.random(ty) {
            let mut bytes = Vec::new();
            for (i, &(rows, std)) in parts.iter().enumerate() {
                let mut rng = Rng::for_tensor(self.seed, &format!("{name}#{i}"));
                bytes.extend(random_blocks(ty, rows * cols, std, &mut rng));
            }
            return self.add_bytes(name, ty, &[cols, rows], bytes);
        }
        let mut values = Vec::new();
        for (i, &(rows, std)) in parts.iter().enumerate() {
            let part = format!("{name}#{i}");
            values.extend(Rng::for_tensor(self.seed, &part).normals(rows * cols, 0.0, std));
        }
        self.add_values(name, ty, &[cols, rows], &values)
    }

    fn add_values(
        &mut self,
        name: &str,
        ty: GgmlType,
        shape: &[usize],
        values: &[f32],
    ) -> Result<(), GgufError> {
        self.add_bytes(name, ty, shape, quantize(ty, values))
    }

    fn add_bytes(
        &mut self,
        name: &str,
        ty: GgmlType,
        shape: &[usize],
        bytes: Vec<u8>,
    ) -> Result<(), GgufError> {
        let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        if self.decoded && ty != GgmlType::F32 {
            let mut values = vec![0f32; dims.iter().product::<u64>() as usize];
            dequant::decode_f32(ty, &bytes, &mut values).expect("whole blocks decode");
            self.writer.add_tensor(name, GgmlType::F32, &dims)?;
            self.data
                .push(values.iter().flat_map(|v| v.to_le_bytes()).collect());
            return Ok(());
        }
        self.writer.add_tensor(name, ty, &dims)?;
        self.data.push(bytes);
        Ok(())
    }
}

/// The whole GGUF file of `spec`.
pub fn build(spec: &Spec) -> Result<Vec<u8>, GgufError> {
    write(spec, false, |_, _| {})
}

/// The file of `spec` with the shapes of some tensors changed by `edit` (and their data
/// drawn for the changed shapes): a well-formed file of a malformed model.
pub fn build_edited(spec: &Spec, edit: Edit) -> Result<Vec<u8>, GgufError> {
    write(spec, false, edit)
}

/// The model of `spec` with every weight stored as the F32 values its blocks decode to:
/// the same function, computed without quantizing the activations (F32 weights meet f32
/// activations). Against it, the rounding of the quantized model's own arithmetic shows.
pub fn build_decoded(spec: &Spec) -> Result<Vec<u8>, GgufError> {
    write(spec, true, |_, _| {})
}

fn write(spec: &Spec, decoded: bool, edit: Edit) -> Result<Vec<u8>, GgufError> {
    let mut w = GgufWriter::new();
    let arch = spec.arch.name();
    let key = |k: &str| format!("{arch}.{k}");
    w.add_metadata("general.architecture", arch)?;
    w.add_metadata("general.name", spec.name)?;
    w.add_metadata(&key("context_length"), CONTEXT_LENGTH)?;
    w.add_metadata(&key("embedding_length"), spec.n_embd as u32)?;
    w.add_metadata(&key("block_count"), spec.n_layers as u32)?;
    w.add_metadata(&key("feed_forward_length"), N_FF as u32)?;
    w.add_metadata(&key("attention.head_count"), spec.n_heads as u32)?;
    w.add_metadata(&key("attention.head_count_kv"), spec.n_kv_heads as u32)?;
    w.add_metadata(&key("rope.freq_base"), spec.rope_freq_base)?;
    let eps: f32 = if spec.arch == Arch::Llama { 1e-5 } else { 1e-6 };
    w.add_metadata(&key("attention.layer_norm_rms_epsilon"), eps)?;
    let (n_experts, n_used, expert_ff) = spec.experts;
    if n_experts != 0 {
        w.add_metadata(&key("expert_count"), n_experts as u32)?;
        w.add_metadata(&key("expert_used_count"), n_used as u32)?;
        if spec.arch != Arch::Llama {
            w.add_metadata(&key("expert_feed_forward_length"), expert_ff as u32)?;
        }
        if spec.shared_ff != 0 {
            w.add_metadata(
                &key("expert_shared_feed_forward_length"),
                spec.shared_ff as u32,
            )?;
        }
    }
    match spec.arch {
        Arch::Llama => w.add_metadata(&key("rope.dimension_count"), spec.head_dim as u32)?,
        Arch::Qwen2 | Arch::Qwen2Moe => {}
        Arch::Qwen3 | Arch::Qwen3Moe => {
            w.add_metadata(&key("attention.key_length"), spec.head_dim as u32)?;
            w.add_metadata(&key("attention.value_length"), spec.head_dim as u32)?;
        }
        Arch::Phi3 => {
            w.add_metadata(&key("rope.dimension_count"), spec.head_dim as u32)?;
            if spec.rope_original_context != 0 {
                let scale = CONTEXT_LENGTH as f32 / spec.rope_original_context as f32;
                let attn_factor = (1.0 + scale.ln() / (spec.rope_original_context as f32).ln())
                    .sqrt()
                    .max(1.0);
                w.add_metadata(
                    &key("rope.scaling.original_context_length"),
                    spec.rope_original_context,
                )?;
                w.add_metadata(&key("rope.scaling.attn_factor"), attn_factor)?;
            }
        }
        Arch::Gemma2 | Arch::Gemma3 | Arch::GptOss => {
            w.add_metadata(&key("attention.key_length"), spec.head_dim as u32)?;
            w.add_metadata(&key("attention.value_length"), spec.head_dim as u32)?;
            w.add_metadata(&key("attention.sliding_window"), spec.sliding_window)?;
        }
    }
    if spec.yarn.0 != 0.0 {
        w.add_metadata(&key("rope.scaling.type"), "yarn")?;
        w.add_metadata(&key("rope.scaling.factor"), spec.yarn.0)?;
        w.add_metadata(&key("rope.scaling.original_context_length"), spec.yarn.1)?;
    }
    if spec.swa_pattern != 0 {
        w.add_metadata(&key("attention.sliding_window_pattern"), spec.swa_pattern)?;
    }
    if spec.rope_freq_base_swa != 0.0 {
        w.add_metadata(&key("rope.freq_base_swa"), spec.rope_freq_base_swa)?;
    }
    if spec.rope_scale != 0.0 {
        w.add_metadata(&key("rope.scaling.type"), "linear")?;
        w.add_metadata(&key("rope.scaling.factor"), spec.rope_scale)?;
    }
    if spec.attn_softcap != 0.0 {
        w.add_metadata(&key("attn_logit_softcapping"), spec.attn_softcap)?;
    }
    if spec.final_softcap != 0.0 {
        w.add_metadata(&key("final_logit_softcapping"), spec.final_softcap)?;
    }
    let n_vocab = add_tokenizer(&mut w, spec.vocab)?;

    let mut t = Tensors {
        writer: w,
        data: Vec::new(),
        seed: spec.seed,
        blocks: spec.blocks,
        decoded,
        edit,
    };
    let gemma = matches!(spec.arch, Arch::Gemma2 | Arch::Gemma3);
    let qk_norm = matches!(spec.arch, Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen3Moe);
    let phi3 = spec.arch == Arch::Phi3;
    // Gemma multiplies embeddings by sqrt(n_embd) = 16: draw them 16 times smaller, and
    // when they are also the output matrix, make up for it in the final norm.
    let embd_std = if gemma { EMBD_STD / 16.0 } else { EMBD_STD };
    let out_norm = if gemma && spec.output.is_none() {
        16.0
    } else {
        1.0
    };
    t.add(
        "token_embd.weight",
        spec.token_embd,
        &[spec.n_embd, n_vocab],
        0.0,
        embd_std,
    )?;
    if spec.rope_freqs {
        t.add_values(
            "rope_freqs.weight",
            GgmlType::F32,
            &[spec.head_dim / 2],
            &llama3_divisors(spec.head_dim / 2),
        )?;
    }
    if spec.rope_original_context != 0 {
        // Phi-3.5's shapes: short factors near 1, long ones growing to tens.
        let pairs = spec.head_dim / 2;
        let ramp = |to: f32| -> Vec<f32> {
            (0..pairs)
                .map(|i| 1.0 + (to - 1.0) * (i as f32 / (pairs - 1) as f32).powi(2))
                .collect()
        };
        t.add_values(
            "rope_factors_long.weight",
            GgmlType::F32,
            &[pairs],
            &ramp(40.0),
        )?;
        t.add_values(
            "rope_factors_short.weight",
            GgmlType::F32,
            &[pairs],
            &ramp(1.6),
        )?;
    }
    let (q_dim, kv_dim) = (
        spec.n_heads * spec.head_dim,
        spec.n_kv_heads * spec.head_dim,
    );
    let std = |cols: usize| 1.0 / (cols as f32).sqrt();
    let ty = |role: &str| {
        spec.overrides
            .iter()
            .find(|(r, _)| *r == role)
            .map_or(spec.matrices, |&(_, ty)| ty)
    };
    for i in 0..spec.n_layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        t.add_norm(&n("attn_norm.weight"), spec.n_embd)?;
        let qk = QK_GAIN * std(spec.n_embd);
        let parts = [(q_dim, qk), (kv_dim, qk), (kv_dim, std(spec.n_embd))];
        if phi3 {
            t.add_fused(&n("attn_qkv.weight"), ty("attn_qkv"), spec.n_embd, &parts)?;
        } else {
            for (role, (rows, spread)) in ["attn_q", "attn_k", "attn_v"].into_iter().zip(parts) {
                let name = n(&format!("{role}.weight"));
                t.add(&name, ty(role), &[spec.n_embd, rows], 0.0, spread)?;
            }
        }
        if matches!(spec.arch, Arch::Qwen2 | Arch::Qwen2Moe | Arch::GptOss) {
            t.add(&n("attn_q.bias"), GgmlType::F32, &[q_dim], 0.0, 0.5)?;
            t.add(&n("attn_k.bias"), GgmlType::F32, &[kv_dim], 0.0, 0.5)?;
            t.add(&n("attn_v.bias"), GgmlType::F32, &[kv_dim], 0.0, 0.1)?;
        }
        if qk_norm {
            t.add_norm(&n("attn_q_norm.weight"), spec.head_dim)?;
            t.add_norm(&n("attn_k_norm.weight"), spec.head_dim)?;
        }
        t.add(
            &n("attn_output.weight"),
            ty("attn_output"),
            &[q_dim, spec.n_embd],
            0.0,
            std(q_dim),
        )?;
        if spec.arch == Arch::GptOss {
            // Sinks around the scores' size, some above them all.
            t.add(
                &n("attn_output.bias"),
                GgmlType::F32,
                &[spec.n_embd],
                0.0,
                0.1,
            )?;
            t.add(
                &n("attn_sinks.weight"),
                GgmlType::F32,
                &[spec.n_heads],
                0.0,
                2.0,
            )?;
        }
        // gpt-oss's feed-forward norm is named `post_attention_norm`.
        if gemma || spec.arch == Arch::GptOss {
            t.add_norm(&n("post_attention_norm.weight"), spec.n_embd)?;
        }
        if spec.arch != Arch::GptOss {
            t.add_norm(&n("ffn_norm.weight"), spec.n_embd)?;
        }
        if n_experts != 0 {
            add_experts(&mut t, spec, &n, &ty)?;
        } else if phi3 {
            // The gate's rows first, then the up projection's.
            let parts = [(N_FF, std(spec.n_embd)), (N_FF, std(spec.n_embd))];
            t.add_fused(&n("ffn_up.weight"), ty("ffn_up"), spec.n_embd, &parts)?;
        } else {
            for role in ["ffn_gate", "ffn_up"] {
                let name = n(&format!("{role}.weight"));
                t.add(&name, ty(role), &[spec.n_embd, N_FF], 0.0, std(spec.n_embd))?;
            }
        }
        if n_experts == 0 {
            t.add(
                &n("ffn_down.weight"),
                ty("ffn_down"),
                &[N_FF, spec.n_embd],
                0.0,
                std(N_FF),
            )?;
        }
        if gemma {
            t.add_norm(&n("post_ffw_norm.weight"), spec.n_embd)?;
        }
    }
    t.add(
        "output_norm.weight",
        GgmlType::F32,
        &[spec.n_embd],
        out_norm,
        0.1 * out_norm,
    )?;
    if let Some(ty) = spec.output {
        t.add("output.weight", ty, &[spec.n_embd, n_vocab], 0.0, EMBD_STD)?;
    }
    let data: Vec<&[u8]> = t.data.iter().map(Vec::as_slice).collect();
    t.writer.to_bytes(&data)
}

/// A mixture-of-experts block's tensors: the router, the 3-D expert tensors and Qwen 2
/// MoE's shared expert with its one-row gate (1-D, as converters write it).
fn add_experts(
    t: &mut Tensors,
    spec: &Spec,
    n: &dyn Fn(&str) -> String,
    ty: &dyn Fn(&str) -> GgmlType,
) -> Result<(), GgufError> {
    let (count, _, ff) = spec.experts;
    let d = spec.n_embd;
    let std = |cols: usize| 1.0 / (cols as f32).sqrt();
    // gpt-oss: gates and up projections large enough that its clamp at 7 bites.
    let gpt_oss = spec.arch == Arch::GptOss;
    let gain = if gpt_oss { 3.0 } else { 1.0 };
    t.add(
        &n("ffn_gate_inp.weight"),
        spec.router,
        &[d, count],
        0.0,
        std(d),
    )?;
    if spec.expert_gate {
        t.add(
            &n("ffn_gate_exps.weight"),
            ty("ffn_gate_exps"),
            &[d, ff, count],
            0.0,
            gain * std(d),
        )?;
    }
    t.add(
        &n("ffn_up_exps.weight"),
        ty("ffn_up_exps"),
        &[d, ff, count],
        0.0,
        gain * std(d),
    )?;
    if gpt_oss {
        t.add(&n("ffn_gate_inp.bias"), GgmlType::F32, &[count], 0.0, 0.5)?;
        for (name, shape, spread) in [
            ("ffn_gate_exps.bias", [ff, count], 0.5),
            ("ffn_up_exps.bias", [ff, count], 0.5),
            ("ffn_down_exps.bias", [d, count], 0.1),
        ] {
            t.add(&n(name), GgmlType::F32, &shape, 0.0, spread)?;
        }
    }
    t.add(
        &n("ffn_down_exps.weight"),
        ty("ffn_down_exps"),
        &[ff, d, count],
        0.0,
        std(ff),
    )?;
    if spec.shared_ff != 0 {
        let ff = spec.shared_ff;
        t.add(
            &n("ffn_gate_inp_shexp.weight"),
            GgmlType::F32,
            &[d],
            0.0,
            std(d),
        )?;
        t.add(
            &n("ffn_gate_shexp.weight"),
            ty("ffn_gate_shexp"),
            &[d, ff],
            0.0,
            std(d),
        )?;
        t.add(
            &n("ffn_up_shexp.weight"),
            ty("ffn_up_shexp"),
            &[d, ff],
            0.0,
            std(d),
        )?;
        t.add(
            &n("ffn_down_shexp.weight"),
            ty("ffn_down_shexp"),
            &[ff, d],
            0.0,
            std(ff),
        )?;
    }
    Ok(())
}

/// Llama 3's shape of RoPE divisors: 1 for the fast frequencies, 8 for the slow ones, a
/// linear ramp between. (Llama 3.1 derives the ramp from wavelengths; any values in the
/// file are what both engines must apply, and this shape changes angles at the
/// positions a short sequence reaches.)
fn llama3_divisors(n: usize) -> Vec<f32> {
    let (ramp_start, ramp_end) = (n / 8, n / 2);
    (0..n)
        .map(|i| {
            if i < ramp_start {
                1.0
            } else if i >= ramp_end {
                8.0
            } else {
                1.0 + 7.0 * (i - ramp_start) as f32 / (ramp_end - ramp_start) as f32
            }
        })
        .collect()
}
