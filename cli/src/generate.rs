//! `rocmforge generate`: a prompt in, text streamed out.

use std::io::Write;
use std::num::NonZeroUsize;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use model::chat::ChatTemplate;
use model::generate::{generate, GenerateOptions, Generation, StopReason};
use model::sampling::{defaults, SamplingParams, Xoshiro256};
use model::tokenizer::{EncodeOptions, TokenId, Tokenizer};
use model::Model;
use serde_json::json;
use tensor_store::{LoadMode, TensorStore};

/// The model used when `--gguf` is not given, from the models cache.
pub const DEFAULT_MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// llama.cpp's default context size.
const DEFAULT_CTX_SIZE: usize = 4096;
/// The conventional exit status of a process stopped by SIGINT.
const EXIT_INTERRUPTED: u8 = 130;

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// The GGUF model (any shard of a split model). Default: SmolLM2-135M-Instruct from
    /// the models cache ($ROCMFORGE_MODELS, else ~/.cache/rocmforge/models).
    #[arg(long, value_name = "FILE")]
    gguf: Option<PathBuf>,
    /// The text to continue.
    #[arg(long, short = 'p')]
    prompt: String,
    /// Most tokens to generate.
    #[arg(long, short = 'n', default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = defaults::TEMPERATURE, allow_negative_numbers = true)]
    temperature: f32,
    /// Keep the K most likely tokens; 0 keeps all.
    #[arg(long, default_value_t = defaults::TOP_K, allow_negative_numbers = true)]
    top_k: usize,
    /// Keep the most likely tokens up to this probability mass, in (0, 1]; 1 keeps all.
    #[arg(long, default_value_t = defaults::TOP_P, allow_negative_numbers = true)]
    top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one, in [0, 1].
    #[arg(long, default_value_t = defaults::MIN_P, allow_negative_numbers = true)]
    min_p: f32,
    /// Penalty for tokens seen in the last --repeat-last-n tokens; 1 is none.
    #[arg(long, default_value_t = defaults::REPEAT_PENALTY, allow_negative_numbers = true)]
    repeat_penalty: f32,
    /// How many recent tokens the repetition penalty looks at.
    #[arg(long, default_value_t = defaults::REPEAT_LAST_N)]
    repeat_last_n: usize,
    /// Seed of the sampler; random when not given.
    #[arg(long)]
    seed: Option<u64>,
    /// Worker threads for the computation (default: one per core).
    #[arg(long)]
    threads: Option<NonZeroUsize>,
    /// Wrap the prompt in the model's chat template, as one user message.
    #[arg(long)]
    chat: bool,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Read the file instead of mapping it.
    #[arg(long)]
    no_mmap: bool,
    /// Most positions (prompt and generated tokens); 0 means the model's training context.
    #[arg(long, default_value_t = DEFAULT_CTX_SIZE)]
    ctx_size: usize,
}

/// `$ROCMFORGE_MODELS`, else `~/.cache/rocmforge/models`.
pub fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ROCMFORGE_MODELS") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache/rocmforge/models")
}

/// `--gguf`, or the default model, which must have been fetched.
pub fn model_path(gguf: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = gguf {
        return Ok(path.to_owned());
    }
    let path = models_dir().join(DEFAULT_MODEL);
    if !path.exists() {
        bail!(
            "the default model {} is missing: run `cargo xtask fetch-models`, or pass --gguf FILE",
            path.display()
        );
    }
    Ok(path)
}

/// The tokens of a prompt, as llama.cpp makes them: BOS where the model asks for it,
/// control tokens written in the text recognised.
pub fn prompt_tokens(tokenizer: &Tokenizer, text: &str) -> Result<Vec<TokenId>> {
    Ok(tokenizer.encode(text, EncodeOptions::PROMPT)?)
}

pub fn run(args: &GenerateArgs) -> Result<ExitCode> {
    let seed = args.seed.unwrap_or_else(random_seed);
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        repeat_last_n: args.repeat_last_n,
        seed,
    };
    let sampling = params.validate()?;
    if let Some(threads) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads.get())
            .build_global()
            .context("setting up the worker threads")?;
    }
    let stop = install_ctrl_c()?;

    let load_start = Instant::now();
    let path = model_path(args.gguf.as_deref())?;
    let mode = if args.no_mmap {
        LoadMode::Read
    } else {
        LoadMode::Mmap
    };
    let store = TensorStore::open_with(&path, mode)?;
    let tokenizer = Tokenizer::from_metadata(store.metadata())
        .with_context(|| format!("{}: tokenizer", path.display()))?;
    let model = Model::load(&store).with_context(|| format!("{}", path.display()))?;
    let load_ms = load_start.elapsed().as_secs_f64() * 1e3;

    let text = if args.chat {
        let template = ChatTemplate::from_metadata(store.metadata())
            .with_context(|| format!("{}: chat template", path.display()))?;
        template.user_prompt(&args.prompt, tokenizer.adds_bos())?
    } else {
        args.prompt.clone()
    };
    let prompt = prompt_tokens(&tokenizer, &text)?;
    let n_ctx_train = model.config().n_ctx_train;
    let context_size = match args.ctx_size {
        0 => n_ctx_train,
        n => n.min(n_ctx_train),
    };
    let options = GenerateOptions {
        sampling,
        max_tokens: args.max_tokens,
        context_size,
    };

    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut write_error = None;
    let output = generate(&model, &tokenizer, &prompt, &options, &stop, |piece| {
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
    })?;
    if let Some(e) = write_error {
        return Err(e).context("writing to stdout");
    }
    if args.json {
        serde_json::to_writer(&mut out, &to_json(&output, load_ms))?;
        writeln!(out)?;
    } else {
        writeln!(out)?;
        eprintln!("{}", summary(&output, load_ms, seed, sampling.is_random()));
    }
    out.flush()?;
    Ok(match output.stop_reason {
        StopReason::Interrupted => ExitCode::from(EXIT_INTERRUPTED),
        _ => ExitCode::SUCCESS,
    })
}

fn to_json(output: &Generation, load_ms: f64) -> serde_json::Value {
    let t = &output.timings;
    json!({
        "prompt_tokens": output.prompt_tokens,
        "tokens": output.tokens,
        "text": output.text,
        "stop_reason": output.stop_reason.name(),
        "timings": {
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
    let per_s = |rate: Option<f64>| rate.map_or_else(|| "-".to_owned(), |r| format!("{r:.1}"));
    let seed = if random {
        format!(", seed {seed}")
    } else {
        String::new()
    };
    format!(
        "[load {load_ms:.0} ms; prompt {} tokens in {:.0} ms ({} tokens/s); generated {} tokens ({} tokens/s); stop: {}{seed}]",
        t.prompt_tokens,
        t.prompt_ms(),
        per_s(t.prompt_tokens_per_s()),
        output.tokens.len(),
        per_s(t.decode_tokens_per_s()),
        output.stop_reason.name(),
    )
}

/// A seed from the clock and the process id, for runs without `--seed`.
fn random_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mixed = nanos ^ (u64::from(std::process::id()) << 32);
    Xoshiro256::seed_from_u64(mixed).next_u64()
}

/// The first Ctrl-C sets the returned flag, so generation ends cleanly after the current
/// token; a second one exits at once.
fn install_ctrl_c() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    let presses = AtomicUsize::new(0);
    let flag = Arc::clone(&stop);
    ctrlc::set_handler(move || {
        if presses.fetch_add(1, Ordering::SeqCst) > 0 {
            std::process::exit(i32::from(EXIT_INTERRUPTED));
        }
        flag.store(true, Ordering::SeqCst);
    })
    .context("installing the Ctrl-C handler")?;
    Ok(stop)
}
