use std::io::Write;

/// Several sequences at once: batched steps and the scheduler, against each alone.
#[path = "gpu/batched.rs"]
mod batched;
/// Each model's prompt and decoding steps, the GPU against the CPU.
#[path = "gpu/check.rs"]
mod check;
/// Requests held to a grammar on the scheduler, on the GPU (and the CPU beside it).
#[path = "gpu/constrained.rs"]
mod constrained;
/// Stop requests, injected allocation failures and budgets beyond the device.
#[path = "../gpu/faults.rs"]
mod faults;
/// A quantized KV cache, the GPU against the CPU.
#[path = "gpu/kv_types.rs"]
mod kv_types;
/// A mixture of experts over its budget, its experts resident by use.
#[path = "gpu/pooled.rs"]
mod pooled;
/// A model split by layers over several GPUs (or several stages of one), against one.
#[path = "gpu/split.rs"]
mod split;
/// A model split by tensors over two GPUs, against one.
#[path = "gpu/tensor.rs"]
mod tensor;

use model::gpu::{GpuModel, GpuOptions, GpuTuning, PROMPT_BATCH};
use model::tokenizer::{EncodeOptions, Tokenizer};
use model::{AttentionMethod, Model};
use tensor_store::device::UploadMode;
use tensor_store::TensorStore;

use super::generate::{build_decoded, Blocks, SPECS};
use super::{argmax, load_file, open_spec, spec};
use batched::{batched, embeddings_on_gpu, scheduler_on, scheduler_on_gpu};
use check::check;
use constrained::{constrained_on_cpu, constrained_on_gpu};

/// The spread of a row: its standard deviation.
fn spread(row: &[f32]) -> f32 {
    let n = row.len() as f64;
    let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = row
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    var.sqrt() as f32
}

/// Bounds on a row's largest difference and on its root mean square, as fractions of
/// its spread.
const MAX_OF_SPREAD: f32 = 0.5;
const RMS_OF_SPREAD: f32 = 0.15;

/// The bound for a row's largest difference (also the near-tie margin).
fn tolerance(row: &[f32]) -> f32 {
    MAX_OF_SPREAD * spread(row)
}

/// The largest difference between two rows and its root mean square.
fn differences(a: &[f32], b: &[f32]) -> (f32, f32) {
    let max = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let sq = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f32>();
    (max, (sq / a.len() as f32).sqrt())
}

/// How far a CPU row strays from the exact one (the same weights decoded to F32, met
/// by unquantized activations): its largest difference and root mean square, as
/// fractions of the exact row's spread. Zero without an exact row.
fn stray(cpu: &[f32], exact: Option<&[f32]>) -> (f32, f32) {
    let Some(exact) = exact else {
        return (0.0, 0.0);
    };
    let sigma = spread(exact).max(f32::MIN_POSITIVE);
    let (max, rms) = differences(cpu, exact);
    (max / sigma, rms / sigma)
}

/// The bounds of a row (largest, root mean square, as fractions of the spread) given
/// how far the CPU's own arithmetic strays from the exact row. Re-quantizing the
/// activations costs some models more than others: on blocks random in every field
/// (large sub-block minimums and offsets that cancel in each product) the CPU's rows
/// strayed up to 0.98 of the spread from the exact ones (`gemma2-random`; 0.52 for
/// `llama-q2_k-random`), the GPU's, whose activation blocks are 32 values rather
/// than Q8_K's 256, at most 0.44 (measured on an H200). A GPU no further from the
/// exact row than the CPU differs from the CPU by at most twice the CPU's stray, so
/// the bounds widen to that, and the GPU is held to them against the exact row too.
fn bounds(stray: (f32, f32)) -> (f32, f32) {
    (
        MAX_OF_SPREAD.max(2.0 * stray.0),
        RMS_OF_SPREAD.max(2.0 * stray.1),
    )
}

/// The rows of the model of `name` with its weights decoded to F32, for the models
/// random in every field (whose own arithmetic strays furthest) and the mixtures of
/// experts that route (whose CPU rows stray from the exact ones up to 0.47 of the
/// spread on the gpt-oss model's 7-token prompt, its activations' Q8 rounding moving
/// the gated products, where the GPU's tiles of one slot round their own); `None` for
/// the others, held to the plain bounds.
struct Exact {
    _dir: tempfile::TempDir,
    _store: TensorStore,
    model: Model,
}

impl Exact {
    fn of(name: &str) -> Option<Exact> {
        let spec = spec(name).expect("a spec");
        let (experts, used, _) = spec.experts;
        if spec.blocks != Blocks::Random && used == experts {
            return None;
        }
        let bytes = build_decoded(spec).expect("the generator writes a valid file");
        let (dir, store, model) = load_file(&format!("{name}-f32.gguf"), &bytes);
        Some(Exact {
            _dir: dir,
            _store: store,
            model,
        })
    }

    fn cache(&self, context: usize) -> model::KvCache {
        self.model
            .new_cache(context)
            .with_attention(AttentionMethod::Matmul)
    }

    /// The last row of `prompt`.
    fn last(&self, prompt: &[u32], context: usize) -> Vec<f32> {
        self.model
            .forward(prompt, &mut self.cache(context))
            .expect("exact prompt")
    }
}

/// The gap between a row's two largest values.
fn margin(row: &[f32]) -> f32 {
    let best = argmax(row);
    let second = row
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != best)
        .fold(f32::NEG_INFINITY, |m, (_, &v)| m.max(v));
    row[best] - second
}

/// Prompt lengths whose last logits are held against the CPU's: one token (the
/// captured decode step), a few (the decode products and the split attention), and
/// past `MAX_BATCH` (the batch products and the tiled prompt attention) within one
/// chunk, one token short of a chunk, and four chunks of [`PROMPT_BATCH`] (chunks
/// that start past position 0 and see the keys of the chunks before).
const PREFILL_LENGTHS: [usize; 6] = [1, 7, 64, 150, 511, 2048];

/// (chunk size, prompt length) pairs run with a chunk smaller than the prompt: chunks
/// that start at positions no multiple of a tile, short last chunks past `MAX_BATCH`
/// (511 = 5·100 + 11, 2048 = 20·100 + 48), and chunks of the decode path (64 =
/// 12·5 + 4).
const SMALL_BATCHES: [(usize, usize); 3] = [(100, 511), (100, 2048), (5, 64)];

/// The last logits of a prompt, GPU against CPU, under the rule of the teacher-forced
/// rows: every logit within the tolerance, the same argmax unless the CPU's top two
/// are within it. Returns the largest difference as a fraction of the spread.
fn check_prefill(name: &str, len: usize, batch: usize, cpu: &[f32], gpu: &[f32]) -> f32 {
    check_prefill_within(name, len, batch, cpu, gpu, MAX_OF_SPREAD)
}

/// As [`check_prefill`], with the bound `bound` of the spread.
/// Whether a prompt's last logits are within `bound` of the CPU's (see
/// [`check_prefill_within`]).
fn prefill_within(cpu: &[f32], gpu: &[f32], bound: f32) -> bool {
    let tol = bound * spread(cpu).max(f32::MIN_POSITIVE);
    let diff = cpu
        .iter()
        .zip(gpu)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    diff <= tol && (argmax(cpu) == argmax(gpu) || margin(cpu) <= tol)
}

/// Rows rerouted: a mixture of experts that picks some of its experts per token
/// decides discontinuously. Where two experts' router probabilities lie within the
/// GPU's rounding of the router's input (its activations quantized in other blocks
/// than the CPU's, sums in another order), the GPU may pick the other one, and that
/// row then differs by the swapped experts' contributions, beyond any bound derived
/// from the arithmetic. Such rows are counted rather than bounded, and held to at most
/// one in [`REROUTED_ONE_IN`] of the rows checked: routing that is wrong (an expert,
/// its weights, a tile) changes most rows, not a few. A dense model, or one whose
/// tokens use every expert, allows none.
pub(super) struct Reroutes {
    routes: bool,
    pub rows: usize,
    checked: usize,
}

/// Most rerouted rows: one in this many of the rows checked.
const REROUTED_ONE_IN: usize = 8;

impl Reroutes {
    pub fn of(name: &str) -> Reroutes {
        let (count, used, _) = spec(name).expect("a spec").experts;
        Reroutes {
            routes: used < count,
            rows: 0,
            checked: 0,
        }
    }

    /// Whether a row beyond the bounds may be a rerouted one.
    pub fn allowed(&self) -> bool {
        self.routes
    }

    /// Counts a row; true when it is beyond the bounds and taken as rerouted.
    pub fn count(&mut self, beyond: bool) -> bool {
        self.checked += 1;
        let rerouted = beyond && self.routes;
        self.rows += usize::from(rerouted);
        rerouted
    }

    pub fn check(&self, name: &str) {
        assert!(
            self.rows * REROUTED_ONE_IN <= self.checked,
            "{name}: {} of {} rows beyond the bounds, more than routing ties explain",
            self.rows,
            self.checked
        );
        if self.rows > 0 {
            eprintln!(
                "gpu {name}: {} of {} rows rerouted",
                self.rows, self.checked
            );
        }
    }
}

fn check_prefill_within(
    name: &str,
    len: usize,
    batch: usize,
    cpu: &[f32],
    gpu: &[f32],
    bound: f32,
) -> f32 {
    assert_eq!(
        gpu.len(),
        cpu.len(),
        "{name}: logits of a {len}-token prompt"
    );
    let sigma = spread(cpu).max(f32::MIN_POSITIVE);
    let tol = bound * sigma;
    let diff = cpu
        .iter()
        .zip(gpu)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        diff <= tol && (argmax(cpu) == argmax(gpu) || margin(cpu) <= tol),
        "{name}: after a {len}-token prompt in chunks of {batch}, logits differ by {:.3} \
         of their spread (bound {bound:.3}), argmax {} vs {}",
        diff / sigma,
        argmax(cpu),
        argmax(gpu)
    );
    diff / sigma
}

fn skip(test: &str, why: &str) {
    let line = format!("SKIPPED {test}: {why}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// A GPU model of `model`, or `None` after saying why the test is skipped.
fn gpu_model(test: &str, model: &Model, mode: UploadMode, context: usize) -> Option<GpuModel> {
    gpu_model_with_batch(test, model, mode, context, PROMPT_BATCH)
}

/// As [`gpu_model`], with prompts in chunks of `batch` tokens.
fn gpu_model_with_batch(
    test: &str,
    model: &Model,
    mode: UploadMode,
    context: usize,
    batch: usize,
) -> Option<GpuModel> {
    gpu_model_within(
        test,
        model,
        mode,
        context,
        batch,
        None,
        GpuTuning::default(),
    )
}

/// As [`gpu_model_with_batch`], the weights within `budget` bytes, tuned as `tuning`
/// says.
fn gpu_model_within(
    test: &str,
    model: &Model,
    mode: UploadMode,
    context: usize,
    batch: usize,
    budget: Option<u64>,
    tuning: GpuTuning,
) -> Option<GpuModel> {
    let options = GpuOptions {
        budget,
        tuning,
        ..GpuOptions::new(mode, context)
    };
    gpu_model_of(test, model, &options, batch)
}

/// A GPU model of `model` set up as `options` says, prompts in chunks of `batch`
/// tokens, or `None` after saying why the test is skipped.
fn gpu_model_of(test: &str, model: &Model, options: &GpuOptions, batch: usize) -> Option<GpuModel> {
    match GpuModel::with_prompt_batch(model, options, batch) {
        Ok(gpu) => Some(gpu),
        Err(model::ModelError::Gpu { source, .. }) if source.is_unavailable() => {
            skip(test, &source.to_string());
            None
        }
        Err(error) => panic!("{test}: {error}"),
    }
}

checks! {
    gpu_llama_q4_0 => "llama-q4_0",
    gpu_llama_q4_1 => "llama-q4_1",
    gpu_llama_q5_0 => "llama-q5_0",
    gpu_llama_q5_1 => "llama-q5_1",
    gpu_llama_q8_0 => "llama-q8_0",
    gpu_llama_q2_k => "llama-q2_k",
    gpu_llama_q3_k => "llama-q3_k",
    gpu_llama_q4_k => "llama-q4_k",
    gpu_llama_q5_k => "llama-q5_k",
    gpu_llama_q6_k => "llama-q6_k",
    gpu_llama_iq4_xs => "llama-iq4_xs",
    gpu_llama_iq4_nl => "llama-iq4_nl",
    gpu_llama_iq3_s => "llama-iq3_s",
    gpu_llama_iq3_xxs => "llama-iq3_xxs",
    gpu_llama_iq2_xxs => "llama-iq2_xxs",
    gpu_llama_iq2_xs => "llama-iq2_xs",
    gpu_llama_iq2_s => "llama-iq2_s",
    gpu_llama_iq1_s => "llama-iq1_s",
    gpu_llama_iq1_m => "llama-iq1_m",
    gpu_llama_mxfp4 => "llama-mxfp4",
    gpu_llama_q2_k_mix => "llama-q2_k-mix",
    gpu_llama_q3_k_m_mix => "llama-q3_k_m-mix",
    gpu_llama_q3_k_s_mix => "llama-q3_k_s-mix",
    gpu_llama_q3_k_l_mix => "llama-q3_k_l-mix",
    gpu_llama_q4_k_s_mix => "llama-q4_k_s-mix",
    gpu_llama_iq4_xs_mix => "llama-iq4_xs-mix",
    gpu_llama_iq3_m_mix => "llama-iq3_m-mix",
    gpu_llama_iq2_m_mix => "llama-iq2_m-mix",
    gpu_llama_f16 => "llama-f16",
    gpu_llama_bf16 => "llama-bf16",
    gpu_llama_f32 => "llama-f32",
    gpu_llama_mha_tied => "llama-mha-tied",
    gpu_llama_mqa => "llama-mqa",
    gpu_llama3 => "llama3",
    gpu_qwen2_tied => "qwen2-tied",
    gpu_qwen2_gqa4 => "qwen2-gqa4",
    gpu_qwen3 => "qwen3",
    gpu_gemma2 => "gemma2",
    gpu_gemma3 => "gemma3",
    gpu_gemma3_keys => "gemma3-keys",
    gpu_phi3 => "phi3",
    gpu_phi3_long => "phi3-long",
    gpu_llama_q4_k_long => "llama-q4_k-long",
    gpu_gemma2_long => "gemma2-long",
    gpu_gemma3_f16 => "gemma3-f16",
    gpu_llama_q4_0_random => "llama-q4_0-random",
    gpu_llama_q4_1_random => "llama-q4_1-random",
    gpu_llama_q5_0_random => "llama-q5_0-random",
    gpu_llama_q5_1_random => "llama-q5_1-random",
    gpu_llama_q8_0_random => "llama-q8_0-random",
    gpu_llama_q2_k_random => "llama-q2_k-random",
    gpu_llama_q3_k_random => "llama-q3_k-random",
    gpu_llama_q4_k_random => "llama-q4_k-random",
    gpu_llama_q5_k_random => "llama-q5_k-random",
    gpu_llama_q6_k_random => "llama-q6_k-random",
    gpu_llama_iq2_xxs_random => "llama-iq2_xxs-random",
    gpu_llama_iq2_xs_random => "llama-iq2_xs-random",
    gpu_llama_iq2_s_random => "llama-iq2_s-random",
    gpu_llama_iq3_xxs_random => "llama-iq3_xxs-random",
    gpu_llama_iq3_s_random => "llama-iq3_s-random",
    gpu_llama_iq1_s_random => "llama-iq1_s-random",
    gpu_llama_iq1_m_random => "llama-iq1_m-random",
    gpu_llama_iq4_nl_random => "llama-iq4_nl-random",
    gpu_llama_iq4_xs_random => "llama-iq4_xs-random",
    gpu_llama_mxfp4_random => "llama-mxfp4-random",
    gpu_qwen2_random => "qwen2-random",
    gpu_qwen3_random => "qwen3-random",
    gpu_phi3_random => "phi3-random",
    gpu_phi3_iq2_xs_random => "phi3-iq2_xs-random",
    gpu_gemma2_random => "gemma2-random",
    gpu_gemma3_random => "gemma3-random",
    gpu_qwen3moe_random => "qwen3moe-random",
    gpu_qwen2moe_random => "qwen2moe-random",
    gpu_llama_moe_random => "llama-moe-random",
    gpu_qwen3moe_all_random => "qwen3moe-all-random",
    gpu_llama_moe_top1_random => "llama-moe-top1-random",
    gpu_qwen3moe_mxfp4_random => "qwen3moe-mxfp4-random",
    gpu_gpt_oss => "gpt-oss",
    gpu_gpt_oss_wide => "gpt-oss-wide",
    gpu_gpt_oss_long => "gpt-oss-long",
}

/// A model the GPU does not run (a weight type only the CPU multiplies: `ty`) is
/// refused before any device work, with an error naming it, rather than computed
/// wrongly.
fn refuses(name: &str, ty: &str) {
    let (_dir, _store, model) = open_spec(name);
    let named = ty;
    assert!(
        model.check_gpu_support().is_err(),
        "{name}: reported as supported"
    );
    let options = GpuOptions::new(UploadMode::Background, 16);
    match GpuModel::new(&model, &options) {
        Err(model::ModelError::GpuUnsupported { what, .. }) => {
            assert!(what.contains(named), "{name}: {what}")
        }
        Err(other) => panic!("{name}: refused for another reason: {other}"),
        Ok(_) => panic!("{name}: the GPU accepted {named}, which it does not run"),
    }
}

macro_rules! gpu_refuses_type {
    ($($test:ident => $name:literal: $ty:literal),* $(,)?) => {$(
        #[test]
        fn $test() {
            refuses($name, $ty);
        }
    )*};
}

gpu_refuses_type! {
    gpu_llama_tq1_0 => "llama-tq1_0": "TQ1_0",
    gpu_llama_tq2_0 => "llama-tq2_0": "TQ2_0",
    gpu_llama_tq1_0_random => "llama-tq1_0-random": "TQ1_0",
    gpu_llama_tq2_0_random => "llama-tq2_0-random": "TQ2_0",
}

#[test]
fn gpu_constrained_llama_q4_k() {
    constrained_on_gpu("llama-q4_k");
}

#[test]
fn gpu_constrained_gemma3() {
    constrained_on_gpu("gemma3");
}

#[test]
fn cpu_constrained_llama_q4_k() {
    constrained_on_cpu("llama-q4_k");
}

#[test]
fn cpu_constrained_gemma3() {
    constrained_on_cpu("gemma3");
}

#[test]
fn gpu_scheduler_llama_q4_k() {
    scheduler_on_gpu("llama-q4_k");
}

#[test]
fn gpu_scheduler_gemma3() {
    scheduler_on_gpu("gemma3");
}

#[test]
fn gpu_scheduler_qwen2_gqa4() {
    scheduler_on_gpu("qwen2-gqa4");
}

#[test]
fn gpu_scheduler_gpt_oss() {
    scheduler_on_gpu("gpt-oss");
}

#[test]
fn gpu_scheduler_gpt_oss_wide() {
    scheduler_on_gpu("gpt-oss-wide");
}

#[test]
fn gpu_embeddings_llama_q4_k() {
    embeddings_on_gpu("llama-q4_k");
}

#[test]
fn gpu_embeddings_gemma3() {
    embeddings_on_gpu("gemma3");
}

macro_rules! gpu_batched_matches_alone {
    ($($test:ident => $name:literal),* $(,)?) => {$(
        #[test]
        fn $test() {
            batched($name, model::KvTypes::default());
        }
    )*};
}

gpu_batched_matches_alone! {
    gpu_batched_llama_q4_k => "llama-q4_k",
    gpu_batched_llama_q8_0 => "llama-q8_0",
    gpu_batched_qwen2_gqa4 => "qwen2-gqa4",
    gpu_batched_gemma3 => "gemma3",
    gpu_batched_llama_mqa => "llama-mqa",
    gpu_batched_qwen3moe_random => "qwen3moe-random",
    gpu_batched_qwen2moe_random => "qwen2moe-random",
    gpu_batched_qwen3moe_mxfp4_random => "qwen3moe-mxfp4-random",
    gpu_batched_gpt_oss => "gpt-oss",
    gpu_batched_gpt_oss_wide => "gpt-oss-wide",
}

/// A mixture of experts whose weights other than the routed experts do not fit the GPU
/// budget is refused, naming the experts and the sizes. (Without a GPU the device is
/// refused first.)
#[test]
fn gpu_experts_over_budget_are_refused() {
    let (_dir, _store, model) = open_spec("qwen3moe-random");
    let options = GpuOptions {
        budget: Some(1 << 16),
        ..GpuOptions::new(UploadMode::Eager, 16)
    };
    match GpuModel::new(&model, &options) {
        Err(model::ModelError::GpuUnsupported { what, .. }) => {
            assert!(
                what.contains("32 experts") && what.contains("other than the routed experts"),
                "{what}"
            )
        }
        Err(model::ModelError::Gpu { .. }) => {}
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a mixture of experts over its budget was accepted"),
    }
}

#[test]
fn gpu_every_spec_has_a_test() {
    let source = include_str!("gpu.rs");
    for spec in SPECS {
        assert!(
            source.contains(&format!(
                "gpu_{} => \"{}\"",
                spec.name.replace(['-', '.'], "_"),
                spec.name
            )),
            "{} has no GPU test in synthetic/gpu.rs",
            spec.name
        );
    }
}

/// A prompt chunk of no token is refused, before any device work (so also without a
/// GPU).
#[test]
fn gpu_prompt_batch_of_zero_is_refused() {
    let (_dir, _store, model) = open_spec("llama-q4_0");
    let options = GpuOptions::new(UploadMode::Lazy, 16);
    match GpuModel::with_prompt_batch(&model, &options, 0) {
        Err(model::ModelError::InvalidPromptBatch { tokens: 0 }) => {}
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a prompt chunk of 0 tokens was accepted"),
    }
}

/// A budget smaller than the model: the first layers stay, and the others pass
/// through the rest of the budget for a long chunk, whose logits are the full
/// upload's bit for bit (the same kernels on the same bytes). A pass of a few tokens
/// computes those layers on the host instead, within the GPU's tolerance of the full
/// upload's logits. The keys and values each side computed reach the other: decode
/// steps after a prompt read the prompt's from the device, a chunk after decode steps
/// reads theirs from the host, and decode steps follow again.
#[test]
fn gpu_over_budget_gives_the_full_uploads_logits() {
    let test = "gpu_over_budget_gives_the_full_uploads_logits";
    let (_dir, _store, model) = open_spec("llama-q4_k");
    let weights: u64 = model.plan().handles().iter().map(|h| h.size()).sum();
    let prompt: Vec<u32> = (1..40).collect();
    let chunk: Vec<u32> = (50..70).collect();
    assert!(prompt.len().min(chunk.len()) > model::gpu::HOST_TOKENS);
    // The full upload's passes, and the tokens it decoded (the others decode the same).
    let mut full: Vec<Vec<f32>> = Vec::new();
    let mut decoded: Vec<u32> = Vec::new();
    // Below the model's size, above what the shared tensors and a passing layer
    // take. Over budget the embeddings (most of this small model) stay on the host,
    // so the budgets hold the output and part of the layers.
    let plan = model.plan();
    let embd = plan.token_embd.weight.size();
    let layers: u64 = plan
        .handles()
        .iter()
        .filter(|h| h.name().starts_with("blk."))
        .map(|h| h.size())
        .sum();
    let shared = weights - embd - layers;
    for budget in [
        None,
        Some(shared + layers * 9 / 10),
        Some(shared + layers * 3 / 4),
    ] {
        let options = GpuOptions {
            budget,
            ..GpuOptions::new(UploadMode::Background, 96)
        };
        let mut gpu = match GpuModel::new(&model, &options) {
            Ok(gpu) => gpu,
            Err(model::ModelError::Gpu { source, .. }) if source.is_unavailable() => {
                skip(test, &source.to_string());
                return;
            }
            Err(error) => panic!("{test}: budget {budget:?}: {error}"),
        };
        let host_layers = gpu.host_layers();
        let mut passes = vec![gpu.forward(&prompt).expect("prompt")];
        let mut step = 0;
        let mut decode = |gpu: &mut GpuModel, passes: &mut Vec<Vec<f32>>, steps: usize| {
            for _ in 0..steps {
                if budget.is_none() {
                    decoded.push(argmax(passes.last().expect("a pass")) as u32);
                }
                passes.push(gpu.forward(&[decoded[step]]).expect("decode"));
                step += 1;
            }
        };
        decode(&mut gpu, &mut passes, 4);
        passes.push(gpu.forward(&chunk).expect("a chunk after decoding"));
        decode(&mut gpu, &mut passes, 3);
        // A few tokens with the logits of each.
        passes.push(gpu.forward_all_logits(&[7, 8, 9]).expect("all logits"));
        let evictions = gpu.cache().stats().evictions;
        if budget.is_none() {
            assert_eq!(host_layers, 0, "{test}: the full upload holds every layer");
            full = passes;
            continue;
        }
        assert!(evictions > 0, "{test}: budget {budget:?} evicted nothing");
        assert!(
            host_layers > 0,
            "{test}: budget {budget:?}: no layer on the host"
        );
        assert!(
            passes[0] == full[0],
            "{test}: budget {budget:?}: the streamed prompt's logits differ from the \
             full upload's"
        );
        let n_vocab = model.config().n_vocab;
        for (i, (got, want)) in passes.iter().zip(&full).enumerate().skip(1) {
            assert_eq!(got.len(), want.len(), "{test}: pass {i}");
            for (row, (g, w)) in got.chunks(n_vocab).zip(want.chunks(n_vocab)).enumerate() {
                let name = format!("{test}: budget {budget:?}, pass {i}, row {row}");
                check_prefill(&name, i, 1, w, g);
            }
        }
    }
}

/// The upload (and a cold file's read-ahead) takes the layers in turn, then the final
/// norm and the output matrix, and the token embeddings last; embeddings that are the
/// output matrix too come first, with the final norm.
#[test]
fn upload_order_takes_the_embeddings_last_unless_they_are_the_output() {
    for (name, tied) in [("llama-q4_k", false), ("llama-mha-tied", true)] {
        let (_dir, _store, model) = open_spec(name);
        let order = model::gpu::first_use_order(&model);
        let names: Vec<&str> = order.tensors().iter().map(|t| t.name()).collect();
        let mut every: Vec<&str> = model.plan().handles().iter().map(|h| h.name()).collect();
        every.sort_unstable();
        every.dedup();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, every, "{name}: each tensor once");
        if tied {
            assert_eq!(
                names[..2],
                ["output_norm.weight", "token_embd.weight"],
                "{name}"
            );
        } else {
            assert!(names[0].starts_with("blk.0."), "{name}: {names:?}");
            assert_eq!(
                names[names.len() - 3..],
                ["output_norm.weight", "output.weight", "token_embd.weight"],
                "{name}"
            );
        }
        let layers: Vec<usize> = names
            .iter()
            .filter_map(|n| n.strip_prefix("blk.")?.split('.').next()?.parse().ok())
            .collect();
        assert!(
            layers.windows(2).all(|w| w[0] <= w[1]),
            "{name}: {layers:?}"
        );
    }
}

/// While the embeddings are not on the device (lazy: nothing is until asked for), a
/// prompt gathers its rows on the host from the file rather than wait for them: the
/// same bits as with every weight resident. The first decoding step fetches them.
#[test]
fn gpu_a_prompt_does_not_wait_for_the_embeddings() {
    let test = "gpu_a_prompt_does_not_wait_for_the_embeddings";
    let (_dir, _store, model) = open_spec("llama-q4_k");
    let embd = &model.plan().token_embd.weight;
    // Rows of more than one task of the host's decoding.
    let prompt: Vec<u32> = (0..70).map(|i| 1 + (i * 37) % 200).collect();
    let mut results = Vec::new();
    for mode in [UploadMode::Eager, UploadMode::Lazy] {
        let Some(mut gpu) = gpu_model(test, &model, mode, 80) else {
            return;
        };
        assert!(gpu.first_pass_weights_at().is_none(), "{test}: {mode:?}");
        let first = gpu.forward(&prompt).expect("prompt");
        let waited = mode == UploadMode::Eager;
        assert_eq!(
            gpu.is_resident(embd),
            waited,
            "{test}: {mode:?} after the prompt"
        );
        // The prompt had its weights in hand after the whole upload (eager), or
        // before it ended (lazy: the embeddings are still to come).
        let weights = gpu.first_pass_weights_at().expect("set by the prompt");
        match gpu.uploaded_at() {
            Some(all) => assert!(waited && all <= weights, "{test}: {mode:?}"),
            None => assert!(!waited, "{test}: {mode:?}"),
        }
        let next = gpu.forward(&[argmax(&first) as u32]).expect("decode");
        assert!(gpu.is_resident(embd), "{test}: {mode:?} after a step");
        assert_eq!(
            gpu.first_pass_weights_at(),
            Some(weights),
            "{test}: {mode:?}"
        );
        results.push((first, next));
    }
    assert!(
        results[0] == results[1],
        "{test}: host and device embeddings differ"
    );
}

/// Eager, background and lazy uploads run one code path: the same logits, bit for bit.
#[test]
fn gpu_upload_modes_give_the_same_logits() {
    let test = "gpu_upload_modes_give_the_same_logits";
    let (_dir, _store, model) = open_spec("llama-q4_k");
    let tokens: Vec<u32> = (1..12).collect();
    let mut results = Vec::new();
    for mode in [UploadMode::Eager, UploadMode::Background, UploadMode::Lazy] {
        let Some(mut gpu) = gpu_model(test, &model, mode, 16) else {
            return;
        };
        results.push(gpu.forward_all_logits(&tokens).expect("forward"));
    }
    assert!(results.windows(2).all(|w| w[0] == w[1]), "modes differ");
}

/// A prompt of several chunks whose weights are still to arrive (lazy: none is on the
/// device yet) runs layer by layer over its chunks; with every weight resident (eager)
/// chunk by chunk. Both run the same launches on the same values: the prompt's logits
/// and the decoding after it are the same bits.
#[test]
fn gpu_prompt_chunks_by_layer_give_the_chunks_bits() {
    let test = "gpu_prompt_chunks_by_layer_give_the_chunks_bits";
    let (_dir, _store, model) = open_spec("llama-q4_k");
    // Four chunks of 16, the last of 3: the split attention's few-token path too.
    let prompt: Vec<u32> = (0..51).map(|i| 1 + (i * 37) % 200).collect();
    let mut results = Vec::new();
    for mode in [UploadMode::Eager, UploadMode::Lazy] {
        let Some(mut gpu) = gpu_model_with_batch(test, &model, mode, 64, 16) else {
            return;
        };
        let mut rows = vec![gpu.forward(&prompt).expect("prompt")];
        let mut token = argmax(&rows[0]) as u32;
        for _ in 0..3 {
            rows.push(gpu.forward(&[token]).expect("decode"));
            token = argmax(rows.last().expect("a row")) as u32;
        }
        assert_eq!(gpu.len(), prompt.len() + 3, "{test}: {mode:?}: positions");
        results.push(rows);
    }
    assert!(
        results[0] == results[1],
        "{test}: the prompt run layer by layer differs from its chunks run one by one"
    );
}
