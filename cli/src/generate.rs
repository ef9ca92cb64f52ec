//! `rocmforge generate`: a prompt in, text streamed out.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use hip_backend::Device;
use model::chat::ChatTemplate;
use model::generate::{generate, generate_with, GenerateOptions, Generation, StopReason};
use model::gpu::{GpuEngine, GpuOptions, GpuTuning};
use model::sampling::Xoshiro256;
use model::tokenizer::{EncodeOptions, TokenId, Tokenizer};
use model::Model;
use rocmforge::tuning::Tuning;
use serde_json::json;
use tensor_store::device::{read_ahead, ReadAhead};
use tensor_store::TensorStore;

use crate::device_choice::{Chosen, DeviceArg, GpuStart};
use crate::interrupt::{install_ctrl_c, EXIT_INTERRUPTED};
use crate::load::LoadModeArg;
use crate::on_gpu;
use crate::options;

/// llama.cpp's default context size.
pub const DEFAULT_CTX_SIZE: usize = 4096;

#[derive(clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: options::ModelArgs,
    /// The text to continue.
    #[arg(
        long,
        short = 'p',
        required_unless_present = "file",
        conflicts_with = "file"
    )]
    prompt: Option<String>,
    /// Read the text to continue from a file; `-` reads stdin.
    #[arg(long, short = 'f', value_name = "PATH")]
    file: Option<PathBuf>,
    /// Most tokens to generate; -1: until the context is full.
    #[arg(long, short = 'n', default_value = "256", value_parser = options::parse_max_tokens,
          allow_negative_numbers = true)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: options::SamplingArgs,
    /// Wrap the prompt in the model's chat template, as one user message.
    #[arg(long)]
    chat: bool,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Most positions (prompt and generated tokens); 0 means the model's training context.
    #[arg(long, short = 'c', default_value_t = DEFAULT_CTX_SIZE)]
    ctx_size: usize,
    #[command(flatten)]
    gpu: options::DeviceArgs,
    /// Show the prompt's progress on stderr even when it is not a terminal, however short.
    #[arg(long)]
    pub progress: bool,
    /// On the CPU, flash attention (on; auto is on, as in llama.cpp on a CPU) or two
    /// matrix products around a softmax (off), each as llama.cpp computes it.
    #[arg(long, visible_alias = "fa", value_enum, default_value = "auto")]
    pub flash_attn: options::FlashAttn,
    #[command(flatten)]
    pub cache_types: options::CacheTypeArgs,
    /// When the context fills, keep its first tokens (--keep) and drop half of the rest
    /// instead of stopping (llama.cpp's --context-shift), so generation goes on to
    /// --max-tokens.
    #[arg(long)]
    pub context_shift: bool,
    /// With --context-shift, the prompt's first tokens that always stay (a BOS token is
    /// kept besides); -1 keeps the whole prompt.
    #[arg(
        long,
        default_value_t = 0,
        allow_negative_numbers = true,
        requires = "context_shift"
    )]
    pub keep: i64,
    #[command(flatten)]
    pub tuning: options::TuningArgs,
}

/// The positions a context shift keeps, as llama.cpp counts them: `--keep` tokens of
/// the prompt and the BOS token the tokenizer adds, or the whole prompt for a negative
/// count or one past its end.
fn kept_positions(keep: i64, prompt: usize, tokenizer: &Tokenizer) -> usize {
    match usize::try_from(keep) {
        Ok(keep) if keep <= prompt => options::kept_by_shift(keep, tokenizer).min(prompt),
        _ => prompt,
    }
}

/// Set to `0`, a GPU's upload reads a cold model file with its readers alone; set to a
/// number, the read-ahead reads with that many threads (default
/// [`read_ahead::STREAMS`], at most 8).
pub const READ_AHEAD_ENV: &str = "ROCMFORGE_READ_AHEAD";

/// Starts reading the model's weights into the page cache in the order a GPU pass first
/// takes them ([`model::gpu::first_use_order`]) when the GPU may compute, the upload runs
/// ahead of use (eager or background) and the page cache holds less than half of the
/// file ([`ReadAhead::when_cold`]). It only helps: a failure to start it is logged, not
/// returned.
fn read_ahead(args: &GenerateArgs, model: &Model) -> Option<ReadAhead> {
    let streams = match std::env::var(READ_AHEAD_ENV) {
        Ok(value) => value.trim().parse::<usize>().unwrap_or_else(|_| {
            tracing::warn!(%value, "{READ_AHEAD_ENV} is not a number of threads");
            read_ahead::STREAMS
        }),
        Err(_) => read_ahead::STREAMS,
    };
    if streams == 0 || args.gpu.device == DeviceArg::Cpu || args.gpu.load_mode == LoadModeArg::Lazy
    {
        return None;
    }
    match ReadAhead::when_cold(&model::gpu::first_use_order(model), streams) {
        Ok(ahead) => {
            if let Some(ahead) = &ahead {
                tracing::info!(
                    bytes = ahead.total_bytes(),
                    "reading the cold model file ahead"
                );
            }
            ahead
        }
        Err(error) => {
            tracing::warn!(%error, "no read-ahead");
            None
        }
    }
}

/// `--batch-size`: a whole number of tokens, at least 1.
pub fn parse_batch_size(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("a prompt chunk must hold at least 1 token".to_owned()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{text:?} is not a number of tokens (at least 1)")),
    }
}

/// The tokens of a prompt, as llama.cpp makes them: BOS where the model asks for it,
/// control tokens written in the text recognised.
pub fn prompt_tokens(tokenizer: &Tokenizer, text: &str) -> Result<Vec<TokenId>> {
    Ok(tokenizer.encode(text, EncodeOptions::PROMPT)?)
}

pub fn run(args: &GenerateArgs) -> Result<ExitCode> {
    let seed = args.sampling.seed.unwrap_or_else(random_seed);
    let sampling = args.sampling.params(seed).validate()?;
    let tuning = args.tuning.apply();
    let threads = options::worker_threads(args.model.threads)?;
    let user_text = options::prompt_text(args.prompt.as_deref(), args.file.as_deref())?;
    let stop = install_ctrl_c()?;
    let placement = args.gpu.placement.placement()?;
    // The GPU runtime starts while the file is read and parsed, and the host memory of
    // the upload's staging ring is made resident meanwhile.
    let gpu_start = start_gpu(args, &tuning);

    let load_start = Instant::now();
    let (path, store) = args.model.open(args.progress)?;
    tracing::info!(path = %path.display(), "model file");
    let parsed_at = Instant::now();
    let tokenizer = Tokenizer::from_metadata(store.metadata())
        .with_context(|| format!("{}: tokenizer", path.display()))?;
    let model = Model::load(&store).with_context(|| format!("{}", path.display()))?;
    // A cold file streams into the page cache, in the order the upload takes it, while
    // the GPU runtime starts; the upload's readers then find it there.
    let _read_ahead = read_ahead(args, &model);
    let planned_at = Instant::now();
    let load_ms = load_start.elapsed().as_secs_f64() * 1e3;
    tracing::info!(
        layers = model.config().n_layers,
        load_ms = format_args!("{load_ms:.0}"),
        "model loaded: execution plan built"
    );
    // `auto` computes on the CPU what the GPU does not run; `gpu` fails below, saying so.
    let (chosen, placement) = on_gpu::choose(
        gpu_start.finish()?,
        &model,
        args.gpu.device,
        &args.gpu.placement,
        placement,
        args.gpu.gpu_budget_mib,
        args.cache_types.types(),
    );

    let text = if args.chat {
        chat_prompt(&store, &tokenizer, &path, &user_text)?
    } else {
        user_text
    };
    let prompt = prompt_tokens(&tokenizer, &text)?;
    let context_size = context_size(args.ctx_size, model.config().n_ctx_train);
    tracing::info!(tokens = prompt.len(), context_size, "prompt");
    let options = GenerateOptions {
        sampling,
        max_tokens: args.max_tokens,
        context_size,
        attention: args.flash_attn.method(),
        kv_types: args.cache_types.types(),
        context_shift: args
            .context_shift
            .then(|| kept_positions(args.keep, prompt.len(), &tokenizer)),
    };

    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut write_error = None;
    let mut on_text = |piece: &str| {
        if args.json {
            return ControlFlow::Continue(());
        }
        match out.write_all(piece.as_bytes()).and_then(|()| out.flush()) {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                write_error = Some(e);
                ControlFlow::Break(())
            }
        }
    };
    let since_start = |t: Instant| t.duration_since(crate::process_start()).as_secs_f64() * 1e3;
    // The GPU model outlives the output: its device memory, page-locked buffers and
    // registrations are given back after the user has the tokens.
    let mut gpu_model = None;
    let (output, device) = match chosen {
        Chosen::Gpu { device, ready_at } => {
            tracing::info!(gpu = device.name(), "device: gpu");
            let gpu_options =
                gpu_options(args, &device, prompt.len(), context_size, &stop, tuning.gpu);
            let mut gpu = on_gpu::engine(&model, &gpu_options, &placement, args.gpu.batch_size)
                .with_context(|| format!("{} ({})", path.display(), device.name()))?;
            let session: &mut dyn model::generate::Session = &mut gpu;
            let output =
                generate_with(session, &tokenizer, &prompt, &options, &stop, &mut on_text)?;
            let report = DeviceReport {
                name: "gpu",
                context_ms: Some(since_start(ready_at)),
                upload_ms: gpu.uploaded_at().map(since_start),
                weights_ms: gpu.first_pass_weights_at().map(since_start),
            };
            gpu_model = Some(gpu);
            (output, report)
        }
        Chosen::Cpu { reason } => {
            tracing::info!(threads, reason = %reason, "device: cpu");
            hip_backend::release_prepared_rings();
            let output = generate(&model, &tokenizer, &prompt, &options, &stop, &mut on_text)?;
            let report = DeviceReport {
                name: "cpu",
                context_ms: None,
                upload_ms: None,
                weights_ms: None,
            };
            (output, report)
        }
    };
    let moments = Moments {
        parsed_ms: since_start(parsed_at),
        planned_ms: since_start(planned_at),
        prompt_start_ms: output
            .timings
            .first_token
            .and_then(|t| t.checked_sub(output.timings.prompt))
            .map(since_start),
        first_token_ms: output.timings.first_token.map(since_start),
    };
    if let Some(e) = write_error {
        return Err(e).context("writing to stdout");
    }
    log_timings(&output);
    if args.json {
        let kv = (args.cache_types.types(), model.config());
        let json = to_json(&output, load_ms, seed, &device, &moments, kv);
        serde_json::to_writer(&mut out, &json)?;
        writeln!(out)?;
    } else {
        writeln!(out)?;
        eprintln!("{}", summary(&output, load_ms, seed, sampling.is_random()));
    }
    out.flush()?;
    give_back(gpu_model);
    Ok(match output.stop_reason {
        StopReason::Interrupted => ExitCode::from(EXIT_INTERRUPTED),
        _ => ExitCode::SUCCESS,
    })
}

/// Starts the GPU runtime (unless the CPU was asked for) and makes the host memory of
/// the upload's staging ring resident meanwhile, where a GPU may be found: faulting in
/// those tens of MiB costs a CPU-only machine a tenth of a second of a core, taken from
/// the prompt.
fn start_gpu(args: &GenerateArgs, tuning: &Tuning) -> GpuStart {
    let gpu_start = GpuStart::begin(args.gpu.device, args.gpu.placement.first_device());
    if args.gpu.device != DeviceArg::Cpu && gpu_driver_present() {
        tensor_store::device::CacheConfig {
            staging_ring: tuning.gpu.staging_ring,
            ..Default::default()
        }
        .prepare_gpu_staging();
    }
    gpu_start
}

/// Whether this build has a GPU platform whose driver's device node exists here (the
/// staging memory is only prepared ahead where it may be used; without it, an upload
/// maps its own).
fn gpu_driver_present() -> bool {
    match hip_backend::PLATFORM {
        hip_backend::Platform::None => false,
        hip_backend::Platform::Amd => Path::new("/dev/kfd").exists(),
        hip_backend::Platform::Nvidia => Path::new("/dev/nvidiactl").exists(),
    }
}

/// The GPU model's options: the upload, the budget, the context the run needs.
fn gpu_options(
    args: &GenerateArgs,
    device: &Device,
    prompt_len: usize,
    context_size: usize,
    stop: &Arc<AtomicBool>,
    tuning: GpuTuning,
) -> GpuOptions {
    // The prompt and every generated token but the last, as on the CPU.
    let context_size = prompt_len
        .saturating_add(args.max_tokens.saturating_sub(1))
        .clamp(1, context_size.max(1));
    // Ctrl-C during the upload, or during a prompt's pass, stops it.
    args.gpu
        .gpu_options(device, context_size, args.cache_types.types(), stop, tuning)
}

/// Drops the GPU model, its device memory, page-locked buffers and registrations, and
/// logs how long that took.
fn give_back(gpu_model: Option<GpuEngine>) {
    if let Some(gpu) = gpu_model {
        let started = Instant::now();
        drop(gpu);
        tracing::debug!(
            ms = started.elapsed().as_secs_f64() * 1e3,
            "the GPU model's memory given back"
        );
    }
}

/// The user's text in the model's chat template ([`chat_template`]), as one user
/// message.
fn chat_prompt(
    store: &TensorStore,
    tokenizer: &Tokenizer,
    path: &Path,
    user_text: &str,
) -> Result<String> {
    let template = chat_template(store, path)?;
    Ok(template.user_prompt(user_text, tokenizer.adds_bos())?)
}

/// The model's chat template, saying on stderr when the file has none and a built-in
/// one stands in.
pub fn chat_template(store: &TensorStore, path: &Path) -> Result<ChatTemplate> {
    let template = ChatTemplate::from_metadata(store.metadata())
        .with_context(|| format!("{}: chat template", path.display()))?;
    if let Some(name) = template.built_in_name() {
        eprintln!(
            "note: {} has no chat template: using the built-in {name} template",
            path.display()
        );
    }
    Ok(template)
}

/// `--ctx-size`: 0 is the training context; more than it is cut to it, with a warning
/// (the model has never seen positions past it).
pub fn context_size(requested: usize, n_ctx_train: usize) -> usize {
    match requested {
        0 => n_ctx_train,
        n if n > n_ctx_train => {
            eprintln!(
                "warning: --ctx-size {n} is beyond the model's training context of \
                 {n_ctx_train} tokens: using {n_ctx_train}"
            );
            n_ctx_train
        }
        n => n,
    }
}

/// The prompt and decode stages, for `ROCMFORGE_LOG=info`.
fn log_timings(output: &Generation) {
    let t = &output.timings;
    tracing::info!(
        tokens = t.prompt_tokens,
        ms = format_args!("{:.0}", t.prompt_ms()),
        "prompt processed"
    );
    tracing::info!(
        tokens = output.tokens.len(),
        ms = format_args!("{:.0}", t.decode_ms()),
        stop = output.stop_reason.name(),
        "decoded"
    );
}

/// Which device computed, and when (milliseconds from the process's start) its runtime
/// was ready, its first pass had the weights it waits for, and every weight had been
/// uploaded.
struct DeviceReport {
    name: &'static str,
    context_ms: Option<f64>,
    upload_ms: Option<f64>,
    weights_ms: Option<f64>,
}

/// The moments a run passed, in milliseconds from the process's start.
struct Moments {
    /// The file opened and its header parsed.
    parsed_ms: f64,
    /// The tokenizer and the execution plan built.
    planned_ms: f64,
    /// The prompt's forward pass began (on a GPU: once the device was set up).
    prompt_start_ms: Option<f64>,
    /// The first token chosen.
    first_token_ms: Option<f64>,
}

fn to_json(
    output: &Generation,
    load_ms: f64,
    seed: u64,
    device: &DeviceReport,
    moments: &Moments,
    (kv_types, config): (model::KvTypes, &model::ModelConfig),
) -> serde_json::Value {
    let t = &output.timings;
    json!({
        "prompt_tokens": output.prompt_tokens,
        "tokens": output.tokens,
        "text": output.text,
        "stop_reason": output.stop_reason.name(),
        "context_shifts": output.context_shifts,
        "kv_cache": {
            "type_k": kv_types.k.name(),
            "type_v": kv_types.v.name(),
            "bytes_per_token": kv_types.bytes_per_position(config),
        },
        "seed": seed,
        "device": device.name,
        "timings": {
            "device": device.name,
            "context_ms": device.context_ms,
            "upload_ms": device.upload_ms,
            "weights_ms": device.weights_ms,
            "parsed_ms": moments.parsed_ms,
            "planned_ms": moments.planned_ms,
            "prompt_start_ms": moments.prompt_start_ms,
            "first_token_ms": moments.first_token_ms,
            "load_ms": load_ms,
            "prompt_ms": t.prompt_ms(),
            "prompt_tokens_per_s": t.prompt_tokens_per_s(),
            "decode_tokens_per_s": t.decode_tokens_per_s(),
        },
    })
}

/// One line for stderr after streamed text.
fn summary(output: &Generation, load_ms: f64, seed: u64, random: bool) -> String {
    let t = &output.timings;
    let rate = |rate: Option<f64>| rate.map_or_else(String::new, |r| format!(", {r:.1} tokens/s"));
    let seed = if random {
        format!(", seed {seed}")
    } else {
        String::new()
    };
    let prompt = if t.prompt_tokens == 0 {
        format!(
            "prompt of {} not processed",
            tokens(output.prompt_tokens.len())
        )
    } else {
        format!(
            "prompt {} in {:.0} ms{}",
            tokens(t.prompt_tokens),
            t.prompt_ms(),
            rate(t.prompt_tokens_per_s())
        )
    };
    format!(
        "[load {load_ms:.0} ms; {prompt}; generated {}{}; stop: {}{seed}]",
        tokens(output.tokens.len()),
        rate(t.decode_tokens_per_s()),
        output.stop_reason.name(),
    )
}

/// "1 token", "2 tokens".
fn tokens(n: usize) -> String {
    if n == 1 {
        "1 token".to_owned()
    } else {
        format!("{n} tokens")
    }
}

/// A seed from the clock and the process id, for runs without `--seed`.
pub fn random_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mixed = nanos ^ (u64::from(std::process::id()) << 32);
    Xoshiro256::seed_from_u64(mixed).next_u64()
}

#[cfg(test)]
mod tests {
    use super::parse_batch_size;

    #[test]
    fn batch_size_is_a_positive_number_of_tokens() {
        assert_eq!(parse_batch_size("1"), Ok(1));
        assert_eq!(parse_batch_size("100"), Ok(100));
        let zero = parse_batch_size("0").unwrap_err();
        assert!(zero.contains("at least 1 token"), "{zero}");
        for bad in ["-1", "", "1.5", "many"] {
            let error = parse_batch_size(bad).unwrap_err();
            assert!(error.contains("not a number of tokens"), "{bad}: {error}");
        }
    }
}
