use model::{KvType, KvTypes};

use super::*;

/// The cache types of a test named by their short names.
pub(super) fn types(k: &str, v: &str) -> KvTypes {
    KvTypes {
        k: KvType::parse(k).expect("a cache type"),
        v: KvType::parse(v).expect("a cache type"),
    }
}

/// Σ p·ln(p/q) of the softmaxes of two rows of logits.
fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let log_softmax = |row: &[f32]| -> Vec<f64> {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let sum = row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>();
        row.iter().map(|&v| v as f64 - max - sum.ln()).collect()
    };
    let (lp, lq) = (log_softmax(p_logits), log_softmax(q_logits));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

/// Teacher-forced rows of logits: every position of `prompt` in one pass, then one
/// row per token of `fed` decoded one at a time, on the CPU with a cache of `types`.
fn cpu_rows(
    model: &Model,
    types: KvTypes,
    context: usize,
    prompt: &[u32],
    fed: &[u32],
) -> Vec<Vec<f32>> {
    let n_vocab = model.config().n_vocab;
    let mut cache = model
        .new_cache(context)
        .with_types(model.config(), types)
        .expect("cache types");
    let all = model
        .forward_all_logits(prompt, &mut cache)
        .expect("cpu prompt");
    let mut rows: Vec<Vec<f32>> = all.chunks(n_vocab).map(<[f32]>::to_vec).collect();
    for &token in fed {
        rows.push(model.forward(&[token], &mut cache).expect("cpu decode"));
    }
    rows
}

/// As [`cpu_rows`], on a GPU model whose cache is of the same types.
fn gpu_rows(gpu: &mut GpuModel, n_vocab: usize, prompt: &[u32], fed: &[u32]) -> Vec<Vec<f32>> {
    gpu.clear().expect("clear");
    let all = gpu.forward_all_logits(prompt).expect("gpu prompt");
    let mut rows: Vec<Vec<f32>> = all.chunks(n_vocab).map(<[f32]>::to_vec).collect();
    for &token in fed {
        rows.push(gpu.forward(&[token]).expect("gpu decode"));
    }
    rows
}

fn mean_kld(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| kl_divergence(x, y))
        .sum::<f64>()
        / a.len() as f64
}

/// A quantized KV cache on the GPU against the CPU's of the same types (llama.cpp's
/// numbers: the CPU's logits with these types are llama.cpp's bit for bit), teacher-
/// forced over a prompt of 100 tokens (its attention tiled) and 40 decoded ones (split
/// along the keys, past 128 positions).
///
/// The bound. Both sides quantize the same keys and values, which they computed with
/// the small differences of their arithmetic (measured with an f16 cache: `base`, the
/// GPU's mean KL divergence from the CPU); where a value sits near a rounding boundary
/// its quant lands one step apart on the two sides, a step as large as the
/// quantization's own error. What the quantization does (`cost`: the CPU's KL
/// divergence from its own f16 cache) is the scale of those steps. A GPU that quantized
/// other numbers than the CPU (another rotation, or none where the CPU rotates) would
/// add errors independent of the CPU's, about twice the cost; a wrong layout, garbage.
/// Quantizing the same numbers, the GPU strayed 0.05 to 0.46 of the cost above its
/// base on these models (an H200; heads of 32, which are not rotated, as much as
/// rotated ones: it is the models' arithmetic, not the frame), so it is held to 0.6.
pub(super) fn quantized_cache(name: &str, types: KvTypes) {
    let test = format!("gpu_kv_{}_{}_{name}", types.k, types.v);
    let (_dir, store, model) = open_spec(name);
    if let Err(refused) = types.check(model.config(), AttentionMethod::Flash) {
        panic!("{test}: {refused}");
    }
    let tokens = check::spec_prompt(name, &store);
    let n_vocab = model.config().n_vocab;
    let prompt: Vec<u32> = tokens.iter().copied().cycle().take(100).collect();
    let fed: Vec<u32> = tokens.iter().rev().copied().cycle().take(40).collect();
    let context = prompt.len() + fed.len();
    let f16 = KvTypes::default();
    let f16_options = GpuOptions::new(UploadMode::Eager, context);
    let Some(mut gpu) = gpu_model_of(&test, &model, &f16_options, PROMPT_BATCH) else {
        return;
    };
    let gpu_f16 = gpu_rows(&mut gpu, n_vocab, &prompt, &fed);
    drop(gpu);
    let q_options = GpuOptions {
        kv_types: types,
        ..f16_options
    };
    let mut gpu = gpu_model_of(&test, &model, &q_options, PROMPT_BATCH).expect("a GPU");
    let gpu_q = gpu_rows(&mut gpu, n_vocab, &prompt, &fed);
    let cpu_f16 = cpu_rows(&model, f16, context, &prompt, &fed);
    let cpu_q = cpu_rows(&model, types, context, &prompt, &fed);
    let base = mean_kld(&cpu_f16, &gpu_f16);
    let cost = mean_kld(&cpu_f16, &cpu_q);
    let stray = mean_kld(&cpu_q, &gpu_q);
    let agree = cpu_q
        .iter()
        .zip(&gpu_q)
        .filter(|(c, g)| argmax(c) == argmax(g))
        .count();
    let line = format!(
        "{test}: mean KL divergence GPU from CPU {stray:.6} (f16 cache: {base:.6}); the \
         cache's own cost on the CPU {cost:.6}; top token the same {agree}/{}\n",
        cpu_q.len()
    );
    let _ = std::io::stderr().write_all(line.as_bytes());
    let bound = base + 0.6 * cost + 1e-5;
    assert!(
        stray <= bound,
        "{test}: the GPU's quantized cache strays {stray:.6} from the CPU's, bound \
         {bound:.6}"
    );
}

/// The two kernels of a decode step's attention over an f16 cache
/// (`GpuTuning::warp_attention`: a key a lane in 32-lane groups, or a key over a few
/// lanes), teacher-forced over a prompt of 200 tokens and 60 decoded ones, which the
/// warps kernel splits into two chunks of 128 keys merged by the last to finish (and
/// which pass gpt-oss's and gemma2's sliding windows). The kernels differ only in the
/// order of the attention's sums, so each stays as close to the CPU as the other: the
/// warps kernel's mean KL divergence from the CPU over the decoded rows is held to
/// twice the other's (a wrong key, weight or chunk would stray by orders of magnitude
/// more), and the two give the same top token wherever the CPU's top two are not
/// within the logits' tolerance of each other.
pub(super) fn decode_kernels(name: &str, types: KvTypes) {
    let test = format!("gpu_decode_kernels_{name}");
    let (_dir, store, model) = open_spec(name);
    let tokens = check::spec_prompt(name, &store);
    let n_vocab = model.config().n_vocab;
    let prompt: Vec<u32> = tokens.iter().copied().cycle().take(200).collect();
    let fed: Vec<u32> = tokens.iter().rev().copied().cycle().take(60).collect();
    let context = prompt.len() + fed.len();
    let mut decoded = Vec::new();
    for warp_attention in [true, false] {
        let options = GpuOptions {
            kv_types: types,
            tuning: GpuTuning {
                warp_attention,
                ..GpuTuning::default()
            },
            ..GpuOptions::new(UploadMode::Eager, context)
        };
        let Some(mut gpu) = gpu_model_of(&test, &model, &options, PROMPT_BATCH) else {
            return;
        };
        let rows = gpu_rows(&mut gpu, n_vocab, &prompt, &fed);
        decoded.push(rows[prompt.len()..].to_vec());
    }
    let cpu = cpu_rows(&model, types, context, &prompt, &fed)[prompt.len()..].to_vec();
    let (warps, split) = (&decoded[0], &decoded[1]);
    let (kl_warps, kl_split) = (mean_kld(&cpu, warps), mean_kld(&cpu, split));
    let line = format!(
        "{test}: mean KL divergence from the CPU over {} decoded rows: {kl_warps:.3e} (a key \
         a lane), {kl_split:.3e} (a key over a few lanes)\n",
        cpu.len()
    );
    let _ = std::io::stderr().write_all(line.as_bytes());
    let bound = 2.0 * kl_split + 1e-7;
    assert!(
        kl_warps <= bound,
        "{test}: the warps kernel strays {kl_warps:.3e} from the CPU, bound {bound:.3e}"
    );
    for (i, ((w, s), c)) in warps.iter().zip(split).zip(&cpu).enumerate() {
        assert!(
            argmax(w) == argmax(s) || margin(c) <= tolerance(c),
            "{test}: decoded row {i}: the kernels' top tokens differ ({} and {}) past a \
             near tie",
            argmax(w),
            argmax(s)
        );
    }
}

/// A test per line `test => model: K / V`, each calling `$check(model, types)`.
macro_rules! gpu_kv_tests {
    ($check:ident: $($test:ident => $name:literal: $k:literal / $v:literal),* $(,)?) => {$(
        #[test]
        fn $test() {
            $check($name, types($k, $v));
        }
    )*};
}

// Heads of 32 (no rotation), 64 and 128 (rotated by 64 and 128), a soft cap and a
// sliding window (gemma2), per-head norms (qwen3), sinks (gpt-oss), mixed types.
gpu_kv_tests! { quantized_cache:
    gpu_kv_q8_0_llama_q4_k => "llama-q4_k": "q8_0" / "q8_0",
    gpu_kv_q4_0_llama_q4_k => "llama-q4_k": "q4_0" / "q4_0",
    gpu_kv_q8_0_f16_llama_q4_k => "llama-q4_k": "q8_0" / "f16",
    gpu_kv_f16_q4_0_llama_q4_k => "llama-q4_k": "f16" / "q4_0",
    gpu_kv_q8_0_qwen3 => "qwen3": "q8_0" / "q8_0",
    gpu_kv_q4_0_qwen3 => "qwen3": "q4_0" / "q4_0",
    gpu_kv_q8_0_gemma2 => "gemma2": "q8_0" / "q8_0",
    gpu_kv_q4_0_gemma2 => "gemma2": "q4_0" / "q4_0",
    gpu_kv_q8_0_gemma3 => "gemma3": "q8_0" / "q8_0",
    gpu_kv_q4_0_gemma3 => "gemma3": "q4_0" / "q4_0",
    gpu_kv_q8_0_gpt_oss => "gpt-oss": "q8_0" / "q8_0",
    gpu_kv_q4_0_gpt_oss => "gpt-oss": "q4_0" / "q4_0",
    gpu_kv_q8_0_phi3 => "phi3": "q8_0" / "q8_0",
    gpu_kv_q8_0_qwen2_gqa4 => "qwen2-gqa4": "q8_0" / "q8_0",
    gpu_kv_q4_0_gemma2_long => "gemma2-long": "q4_0" / "q4_0",
}

// Heads of 64 (llama), 32 with four query heads a key head (qwen2), 128 with per-head
// norms (gemma3), a soft cap and a sliding window (gemma2), sinks and a window (gpt-oss).
gpu_kv_tests! { decode_kernels:
    gpu_decode_kernels_llama_q4_k => "llama-q4_k": "f16" / "f16",
    gpu_decode_kernels_qwen2_gqa4 => "qwen2-gqa4": "f16" / "f16",
    gpu_decode_kernels_gemma3 => "gemma3": "f16" / "f16",
    gpu_decode_kernels_gemma2 => "gemma2": "f16" / "f16",
    gpu_decode_kernels_gpt_oss => "gpt-oss": "f16" / "f16",
}

// A server's paged cache of these types against the contiguous one.
gpu_kv_tests! { batched:
    gpu_batched_q8_0_llama_q4_k => "llama-q4_k": "q8_0" / "q8_0",
    gpu_batched_q8_0_gemma3 => "gemma3": "q8_0" / "q8_0",
    gpu_batched_q4_0_llama_q4_k => "llama-q4_k": "q4_0" / "q4_0",
    gpu_batched_q8_0_gpt_oss => "gpt-oss": "q8_0" / "q8_0",
}

/// A quantized cache with layers over the weights' budget (computed on the host, whose
/// keys cross as f16) is refused, naming the types, rather than computed in f16.
#[test]
fn gpu_kv_quantized_over_budget_is_refused() {
    let (_dir, _store, model) = open_spec("llama-q4_k");
    let options = GpuOptions {
        budget: Some(1 << 16),
        kv_types: types("q8_0", "q8_0"),
        ..GpuOptions::new(UploadMode::Eager, 64)
    };
    match GpuModel::new(&model, &options) {
        Err(model::ModelError::GpuUnsupported { what, .. }) => {
            assert!(what.contains("q8_0/q8_0"), "{what}")
        }
        Err(model::ModelError::Gpu { source, .. }) if source.is_unavailable() => {}
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a quantized cache over budget was accepted"),
    }
}
