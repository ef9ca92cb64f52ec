//! `cargo xtask synth-model`: a synthetic llama-architecture GGUF (or Qwen 3 MoE, for
//! the mixture-of-experts presets) with real shapes and random quantized weights, for load-time and throughput work at sizes no real model
//! here has.
//!
//! The file goes through our own `GgufWriter` (its `layout()` gives the header and every
//! tensor's offset, so multi-GiB data streams straight to disk). Quantized blocks are
//! random bytes with their f16 scales set to small finite values, so every weight
//! decodes to a finite number; norms are F32 near 1. The tokenizer (vocabulary, merges,
//! special tokens, chat template) is copied from SmolLM2's metadata, so tools that load
//! a model can tokenize with it. Only timings may be read from such a model, never text.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use gguf_format::{GgmlType, GgufWriter};
use model::sampling::Xoshiro256;

mod presets;

pub use presets::{fallback, MoeStyle, Preset, Routing, PRESETS};

const USAGE: &str = "usage: cargo xtask synth-model --preset PRESET --out FILE \
                     [--seed N] [--tokenizer-from GGUF]\n       \
                     cargo xtask synth-model --tokenizer-only --out FILE [--tokenizer-from GGUF]\n\
     PRESET: 7b-q4k, 70b-q4k, 1b-q4k, 135m-q4_1, tiny-q4_1, or Llama-2-7B's shapes in a\n        \
     llama-quantize mix: 7b-q2_k, 7b-q3_k_s, 7b-q3_k_m, 7b-q3_k_l, 7b-q4_k_s,\n        \
     7b-iq4_xs, 7b-iq3_m, 7b-iq2_m; or a Qwen 3 MoE: qwen3moe-30b-a3b-q4k (Qwen3-30B-A3B's\n        \
     shapes), qwen3moe-30b-a3b-skewed-q4k (the same, its routers favouring some experts\n        \
     as Qwen3-30B-A3B's do), qwen3moe-30b-a3b-mxfp4 (the same in llama-quantize's\n        \
     MXFP4_MOE: MXFP4 experts, Q8_0 elsewhere), qwen3moe-small-q4k; or gpt-oss-20b-mxfp4\n        \
     (gpt-oss-20b's shapes)";

/// Parses the task's arguments and writes the model.
pub fn run(args: &[String]) -> Result<()> {
    let (mut preset, mut out, mut seed, mut tokenizer) = (None, None, 1u64, None);
    let mut tokenizer_only = false;
    crate::each_flag(args, USAGE, |flag, value| {
        match flag {
            "--preset" => preset = Some(value()?.clone()),
            "--out" => out = Some(PathBuf::from(value()?)),
            "--seed" => seed = value()?.parse().context("--seed takes a number")?,
            "--tokenizer-from" => tokenizer = Some(PathBuf::from(value()?)),
            "--tokenizer-only" => tokenizer_only = true,
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
        Ok(())
    })?;
    let out = out.with_context(|| format!("--out is required\n{USAGE}"))?;
    let tokenizer = tokenizer
        .unwrap_or_else(|| crate::fetch::models_dir().join(crate::fetch::SMOLLM2.file_name));
    if tokenizer_only {
        let bytes = write_tokenizer(&tokenizer, &out)?;
        println!(
            "wrote {} (tokenizer metadata only, {bytes} bytes)",
            out.display()
        );
        return Ok(());
    }
    let preset_name = preset.with_context(|| format!("--preset is required\n{USAGE}"))?;
    let preset = PRESETS
        .iter()
        .find(|p| p.name == preset_name)
        .with_context(|| format!("unknown preset {preset_name:?}\n{USAGE}"))?;
    let started = Instant::now();
    let bytes = write_model(preset, &tokenizer, &out, seed)?;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "wrote {} ({}, {bytes} bytes) in {secs:.2} s ({:.2} GB/s)",
        out.display(),
        preset.name,
        bytes as f64 / secs / 1e9
    );
    Ok(())
}

/// Declares the preset's metadata and tensors, in the order a forward pass reads them.
pub fn declare(preset: &Preset, tokenizer: &gguf_format::Metadata) -> Result<GgufWriter> {
    let mut w = GgufWriter::new();
    let tokens = tokenizer
        .get_string_array("tokenizer.ggml.tokens")
        .context("the tokenizer source has no tokenizer.ggml.tokens")?;
    let n_vocab = tokens.len() as u64;
    let head_dim = preset
        .experts
        .map_or(preset.n_embd / u64::from(preset.n_heads), |e| e.head_dim);
    let q_dim = head_dim * u64::from(preset.n_heads);
    let kv_dim = head_dim * u64::from(preset.n_kv_heads);
    let style = preset.experts.map(|e| e.style);
    let gpt_oss = style == Some(MoeStyle::GptOss);
    let arch = match style {
        None => "llama",
        Some(MoeStyle::Qwen3) => "qwen3moe",
        Some(MoeStyle::GptOss) => "gpt-oss",
    };
    let key = |k: &str| format!("{arch}.{k}");
    w.add_metadata("general.architecture", arch)?;
    w.add_metadata(
        "general.name",
        format!("synthetic {}", preset.name).as_str(),
    )?;
    w.add_metadata("general.file_type", preset.file_type)?;
    w.add_metadata("general.quantization_version", 2u32)?;
    w.add_metadata(&key("block_count"), preset.n_layers)?;
    w.add_metadata(&key("context_length"), preset.context_length)?;
    w.add_metadata(&key("embedding_length"), preset.n_embd as u32)?;
    w.add_metadata(&key("feed_forward_length"), preset.n_ff as u32)?;
    w.add_metadata(&key("attention.head_count"), preset.n_heads)?;
    w.add_metadata(&key("attention.head_count_kv"), preset.n_kv_heads)?;
    w.add_metadata(&key("rope.freq_base"), preset.rope_freq_base)?;
    w.add_metadata(&key("rope.dimension_count"), head_dim as u32)?;
    w.add_metadata(&key("attention.layer_norm_rms_epsilon"), preset.rms_eps)?;
    w.add_metadata(&key("vocab_size"), n_vocab as u32)?;
    if let Some(e) = preset.experts {
        w.add_metadata(&key("attention.key_length"), head_dim as u32)?;
        w.add_metadata(&key("attention.value_length"), head_dim as u32)?;
        w.add_metadata(&key("expert_count"), e.count)?;
        w.add_metadata(&key("expert_used_count"), e.used)?;
        w.add_metadata(&key("expert_feed_forward_length"), e.n_ff as u32)?;
    }
    if gpt_oss {
        w.add_metadata(&key("attention.sliding_window"), 128u32)?;
        w.add_metadata(&key("rope.scaling.type"), "yarn")?;
        w.add_metadata(&key("rope.scaling.factor"), 32f32)?;
        w.add_metadata(&key("rope.scaling.original_context_length"), 4096u32)?;
    }
    for (key, value) in tokenizer.iter() {
        if key.starts_with("tokenizer.") {
            w.add_metadata(key, value.clone())?;
        }
    }
    let (d, ff) = (preset.n_embd, preset.n_ff);
    w.add_tensor(
        "token_embd.weight",
        preset.embd_tensor_type(),
        &[d, n_vocab],
    )?;
    for l in 0..preset.n_layers {
        let m = |role: &str| preset.layer_type(role, l);
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        w.add_tensor(&name("attn_norm"), GgmlType::F32, &[d])?;
        w.add_tensor(&name("attn_q"), m("attn_q"), &[d, q_dim])?;
        w.add_tensor(&name("attn_k"), m("attn_k"), &[d, kv_dim])?;
        w.add_tensor(&name("attn_v"), m("attn_v"), &[d, kv_dim])?;
        let bias = |s: &str| format!("blk.{l}.{s}.bias");
        if gpt_oss {
            w.add_tensor(&bias("attn_q"), GgmlType::F32, &[q_dim])?;
            w.add_tensor(&bias("attn_k"), GgmlType::F32, &[kv_dim])?;
            w.add_tensor(&bias("attn_v"), GgmlType::F32, &[kv_dim])?;
        } else if preset.experts.is_some() {
            w.add_tensor(&name("attn_q_norm"), GgmlType::F32, &[head_dim])?;
            w.add_tensor(&name("attn_k_norm"), GgmlType::F32, &[head_dim])?;
        }
        w.add_tensor(&name("attn_output"), m("attn_output"), &[q_dim, d])?;
        if gpt_oss {
            w.add_tensor(&bias("attn_output"), GgmlType::F32, &[d])?;
            let heads = u64::from(preset.n_heads);
            w.add_tensor(&name("attn_sinks"), GgmlType::F32, &[heads])?;
            w.add_tensor(&name("post_attention_norm"), GgmlType::F32, &[d])?;
        } else {
            w.add_tensor(&name("ffn_norm"), GgmlType::F32, &[d])?;
        }
        match preset.experts {
            Some(e) => {
                let (n, ff) = (u64::from(e.count), e.n_ff);
                w.add_tensor(&name("ffn_gate_inp"), GgmlType::F32, &[d, n])?;
                let (gate, up, down) = if gpt_oss {
                    (
                        preset.ffn_down_type,
                        preset.ffn_down_type,
                        preset.ffn_down_type,
                    )
                } else {
                    (
                        m("ffn_gate"),
                        m("ffn_up"),
                        fallback(preset.ffn_down_type, ff),
                    )
                };
                w.add_tensor(&name("ffn_gate_exps"), gate, &[d, ff, n])?;
                w.add_tensor(&name("ffn_up_exps"), up, &[d, ff, n])?;
                w.add_tensor(&name("ffn_down_exps"), down, &[ff, d, n])?;
                if gpt_oss {
                    w.add_tensor(&bias("ffn_gate_inp"), GgmlType::F32, &[n])?;
                    w.add_tensor(&bias("ffn_gate_exps"), GgmlType::F32, &[ff, n])?;
                    w.add_tensor(&bias("ffn_up_exps"), GgmlType::F32, &[ff, n])?;
                    w.add_tensor(&bias("ffn_down_exps"), GgmlType::F32, &[d, n])?;
                }
            }
            None => {
                w.add_tensor(&name("ffn_gate"), m("ffn_gate"), &[d, ff])?;
                w.add_tensor(&name("ffn_up"), m("ffn_up"), &[d, ff])?;
                w.add_tensor(&name("ffn_down"), m("ffn_down"), &[ff, d])?;
            }
        }
    }
    w.add_tensor("output_norm.weight", GgmlType::F32, &[d])?;
    if let Some(ty) = preset.output_tensor_type() {
        w.add_tensor("output.weight", ty, &[d, n_vocab])?;
    }
    Ok(w)
}

/// The metadata of the GGUF the tokenizer is copied from.
fn tokenizer_source(path: &Path) -> Result<tensor_store::TensorStore> {
    tensor_store::TensorStore::open_with(path, tensor_store::LoadMode::Read).with_context(|| {
        format!(
            "reading the tokenizer from {} (run `cargo xtask fetch-models`, or name another \
             GGUF with --tokenizer-from)",
            path.display()
        )
    })
}

/// Writes a GGUF holding only the tokenizer's metadata (a few MiB: small enough to take
/// to a machine without the models cache, as --tokenizer-from there).
pub fn write_tokenizer(tokenizer_from: &Path, out: &Path) -> Result<u64> {
    let source = tokenizer_source(tokenizer_from)?;
    let mut w = GgufWriter::new();
    for (key, value) in source.metadata().iter() {
        if key.starts_with("tokenizer.") {
            w.add_metadata(key, value.clone())?;
        }
    }
    let layout = w.layout()?;
    std::fs::write(out, &layout.header).with_context(|| format!("writing {}", out.display()))?;
    Ok(layout.file_len)
}

/// Writes the model to `out` and returns its size in bytes.
pub fn write_model(preset: &Preset, tokenizer_from: &Path, out: &Path, seed: u64) -> Result<u64> {
    let source = tokenizer_source(tokenizer_from)?;
    let writer = declare(preset, source.metadata())?;
    let layout = writer.layout()?;
    let file = File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut sink = BufWriter::with_capacity(CHUNK, file);
    sink.write_all(&layout.header)?;
    let data_start = layout.header.len() as u64;
    // One thread generates blocks while this one writes: two buffers in flight.
    let (filled, to_write) = std::sync::mpsc::sync_channel::<(usize, Vec<u8>)>(2);
    let (emptied, to_fill) = std::sync::mpsc::channel::<Vec<u8>>();
    for _ in 0..3 {
        emptied.send(vec![0u8; CHUNK]).expect("receiver alive");
    }
    let tensors = writer.tensors();
    let skewed = preset
        .experts
        .filter(|e| e.routing == Routing::Skewed)
        .map(|e| (e.count as usize, preset.n_embd as usize));
    std::thread::scope(|s| -> Result<()> {
        s.spawn(move || {
            let mut rng = Rng::new(seed);
            for (t, decl) in tensors.iter().enumerate() {
                let block_bytes = decl.ggml_type.type_size() as usize;
                // Whole blocks per buffer, so every block is patched in one piece.
                let per_fill = CHUNK / block_bytes * block_bytes;
                let mut left = decl.size as usize;
                while left > 0 {
                    let Ok(mut buffer) = to_fill.recv() else {
                        return;
                    };
                    let n = left.min(per_fill);
                    buffer.resize(n, 0);
                    if decl.name.ends_with("ffn_gate_inp.weight") {
                        fill_router(&mut buffer, &mut rng);
                        if let Some((count, width)) = skewed {
                            let first = (decl.size as usize - left) / 4;
                            skew_router(&mut buffer, first, width, count, layer_of(&decl.name));
                        }
                    } else {
                        fill_blocks(decl.ggml_type, &mut buffer, &mut rng);
                    }
                    if filled.send((t, buffer)).is_err() {
                        return;
                    }
                    left -= n;
                }
            }
        });
        // Owned here, so an early return (a failed write) drops them and the
        // generator, waiting for a buffer, stops.
        let (emptied, to_write) = (emptied, to_write);
        let mut written = data_start;
        let mut current = None;
        for (t, buffer) in to_write {
            if current != Some(t) {
                pad_to(
                    &mut sink,
                    &mut written,
                    data_start + layout.tensor_offsets[t],
                )?;
                current = Some(t);
            }
            sink.write_all(&buffer)?;
            written += buffer.len() as u64;
            // The generator may be gone after its last buffer.
            let _ = emptied.send(buffer);
        }
        pad_to(&mut sink, &mut written, layout.file_len)
    })?;
    let mut file = sink.into_inner().map_err(|e| e.into_error())?;
    if file.metadata()?.is_file() {
        // The final padding may be a seek hole: make the length exact.
        file.seek(SeekFrom::Start(layout.file_len))?;
        file.set_len(layout.file_len)?;
    }
    Ok(layout.file_len)
}

/// Bytes generated and written at a time.
const CHUNK: usize = 16 << 20;

fn pad_to(sink: &mut impl Write, written: &mut u64, to: u64) -> Result<()> {
    if to < *written {
        bail!("layout goes backwards: at {written}, next tensor at {to}");
    }
    let zeros = [0u8; 64];
    while *written < to {
        let n = (to - *written).min(zeros.len() as u64) as usize;
        sink.write_all(&zeros[..n])?;
        *written += n as u64;
    }
    Ok(())
}

/// xoshiro256++: fast, and plenty for random weights.
pub struct Rng([u64; 4]);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        // splitmix64 spreads the seed over the state.
        Rng(Xoshiro256::state_from_u64(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &self.0;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        Xoshiro256::advance(&mut self.0);
        result
    }

    pub fn fill(&mut self, out: &mut [u8]) {
        let mut words = out.chunks_exact_mut(8);
        for word in &mut words {
            word.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let tail = words.into_remainder();
        let last = self.next_u64().to_le_bytes();
        let n = tail.len();
        tail.copy_from_slice(&last[..n]);
    }
}

/// A small positive f16 (about 6e-5 to 1e-3), from random bits: every scale this writes
/// is finite and keeps the decoded weights small.
fn small_f16(bits: u64) -> u16 {
    let exponent = 1 + (bits % 5) as u16; // 2^-14 .. 2^-10
    let mantissa = ((bits >> 8) & 0x3ff) as u16;
    (exponent << 10) | mantissa
}

/// Byte offsets of the f16 fields in a block of `ty`, and whether each is a minimum
/// (stored negative, as real models' minima are).
fn f16_fields(ty: GgmlType) -> &'static [(usize, bool)] {
    match ty {
        GgmlType::Q4_0
        | GgmlType::Q5_0
        | GgmlType::Q8_0
        | GgmlType::IQ4_NL
        | GgmlType::IQ4_XS
        | GgmlType::IQ3_S
        | GgmlType::IQ3_XXS
        | GgmlType::IQ2_S
        | GgmlType::IQ2_XS
        | GgmlType::IQ2_XXS
        | GgmlType::IQ1_S => &[(0, false)],
        GgmlType::Q4_1 | GgmlType::Q5_1 => &[(0, false), (2, true)],
        GgmlType::Q2_K => &[(80, false), (82, false)],
        GgmlType::Q3_K => &[(108, false)],
        GgmlType::Q4_K | GgmlType::Q5_K => &[(0, false), (2, false)],
        GgmlType::Q6_K => &[(208, false)],
        _ => &[],
    }
}

/// Fills an F32 router (`ffn_gate_inp`) with noise centred on 0 (±0.1, uniform): each
/// expert's logit is then a token's own, and tokens spread over the experts about evenly.
/// (Rows near 1, like a norm's, share one large component: every token of a layer then
/// chose the same few experts, which no trained router does.)
pub fn fill_router(out: &mut [u8], rng: &mut Rng) {
    for value in out.chunks_exact_mut(4) {
        let noise = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        value.copy_from_slice(&(0.2 * noise - 0.1).to_le_bytes());
    }
}

/// [`Routing::Skewed`]: scales the router rows of layer `layer` in `out`, whose first
/// value is the router's `first`-th (rows of `width`, one per expert of `count`).
fn skew_router(out: &mut [u8], first: usize, width: usize, count: usize, layer: usize) {
    let scales = router_scales(count, layer);
    for (i, value) in out.chunks_exact_mut(4).enumerate() {
        let expert = (first + i) / width;
        let v = f32::from_le_bytes(value.try_into().expect("4 bytes"));
        value.copy_from_slice(&(v * scales[expert]).to_le_bytes());
    }
}

/// The router row scale of each of `count` experts in layer `layer`
/// ([`Routing::Skewed`]): the ranks in an order of the layer's own (a stride coprime
/// with `count`, offset by the layer), so each layer favours other experts.
pub fn router_scales(count: usize, layer: usize) -> Vec<f32> {
    let mut stride = (count * 3 / 10) | 1;
    while gcd(stride, count) != 1 {
        stride += 2;
    }
    let mut scales = vec![1.0f32; count];
    for rank in 0..count {
        let p = (rank as f64 + 0.5) / count as f64;
        let spread = (presets::ROUTER_SKEW * ((1.0 - p) / p).ln()).exp();
        scales[(rank * stride + layer * 7) % count] = spread as f32;
    }
    scales
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The layer of a tensor named `blk.N.…` (0 for others).
fn layer_of(name: &str) -> usize {
    name.strip_prefix("blk.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Fills whole blocks of `ty` with random bits and sets their scales to small finite
/// values; F32 data gets values near 1 (norm weights).
pub fn fill_blocks(ty: GgmlType, out: &mut [u8], rng: &mut Rng) {
    match ty {
        GgmlType::F32 => {
            for value in out.chunks_exact_mut(4) {
                let noise = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                value.copy_from_slice(&(0.9 + 0.2 * noise).to_le_bytes());
            }
        }
        // One power-of-two scale a block (E8M0, a biased exponent): 2^-9 .. 2^-5.
        GgmlType::MXFP4 => {
            rng.fill(out);
            for b in out.chunks_exact_mut(ty.type_size() as usize) {
                b[0] = 118 + (rng.next_u64() % 5) as u8;
            }
        }
        _ => {
            rng.fill(out);
            let fields = f16_fields(ty);
            let block = ty.type_size() as usize;
            for b in out.chunks_exact_mut(block) {
                let bits = rng.next_u64();
                for (n, &(at, negative)) in fields.iter().enumerate() {
                    let mut h = small_f16(bits >> (n * 20));
                    if negative {
                        h |= 0x8000;
                    }
                    b[at..at + 2].copy_from_slice(&h.to_le_bytes());
                }
                centre_k_quant(ty, b);
            }
        }
    }
}

/// Makes a `Q4_K` or `Q5_K` block's weights average 0, as trained weights about do: every
/// group's scale 2 and minimum 15 (`Q4_K`, quants 0 to 15) or 31 (`Q5_K`, 0 to 31), with
/// `dmin` equal to `d`, so a group decodes to `d · (2q − 15)` or `d · (2q − 31)`. With
/// random scales and minima every weight of a matrix leans one way, every output of a
/// layer shares one large component, and a mixture of experts' router sends every token
/// of a layer to the same few experts.
fn centre_k_quant(ty: GgmlType, b: &mut [u8]) {
    let min: u8 = match ty {
        GgmlType::Q4_K => 15,
        GgmlType::Q5_K => 31,
        _ => return,
    };
    let d = [b[0], b[1]];
    b[2..4].copy_from_slice(&d);
    // Groups 0-3: the scale in bytes 0-3 and the minimum in bytes 4-7 (low six bits);
    // groups 4-7: the low four bits of each in bytes 8-11, the top two of the minimum in
    // the top bits of bytes 4-7 (those of the scale, in bytes 0-3, stay 0).
    let scales = &mut b[4..16];
    scales[..4].fill(2);
    scales[4..8].fill(min | (min >> 4) << 6);
    scales[8..].fill(2 | (min & 0xf) << 4);
}

#[cfg(test)]
mod tests;
