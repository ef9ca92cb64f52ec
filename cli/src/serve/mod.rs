//! `rocmforge serve`: an OpenAI-compatible HTTP server over `model::serve::Scheduler`.
//!
//! The server listens at once; the model loads on a thread of its own while `/health`
//! answers 503 with the progress. Handlers run on tokio and only parse, tokenize and
//! format: the scheduler thread computes, and hands text back through channels.

mod api;
mod format;
#[cfg(fuzzing)]
pub mod fuzzing;
mod gpus;
mod metrics;
mod pool;
mod tools;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use model::chat::ChatTemplate;
use model::constraint::Grammars;
use model::gpu::{GpuOptions, GpuTuning};
use model::serve::{Replicas, Scheduler, SchedulerConfig};
use model::tokenizer::Tokenizer;
use model::Model;
use tensor_store::device::{CacheStats, UploadMode};
use tensor_store::TensorStore;

use crate::models::{model_path, Fetch};
use gpus::{gpu_usable, start_replicas, Gpus};
use pool::{pool_positions, PoolSize};

/// llama.cpp's default context size.
const DEFAULT_CTX_SIZE: usize = 4096;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// The GGUF model. Default: SmolLM2-135M-Instruct from the models cache, fetched
    /// there on first use.
    #[arg(long, value_name = "FILE")]
    gguf: Option<PathBuf>,
    /// Never download: without --gguf, the default model must be in the cache already
    /// (also ROCMFORGE_OFFLINE=1).
    #[arg(long)]
    offline: bool,
    /// Address to listen on (loopback by default).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on; 0 picks a free one (printed on stderr).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Where to compute: auto (a GPU when one is usable and runs the model, else the
    /// CPU), cpu or gpu.
    #[arg(long, default_value = "auto", value_parser = ["auto", "cpu", "gpu"])]
    device: String,
    /// The GPUs to serve on (`--devices`, default GPU 0), and how several share the
    /// model: a copy on each (`replicate`, the default when the model fits each GPU),
    /// the requests spread over the copies; or split by layers (`layer`, the default
    /// when it does not), whose steps run the GPUs one after the other.
    #[command(flatten)]
    placement: crate::options::PlacementArgs,
    /// Most positions of one request (prompt and generated tokens); 0 means the model's
    /// training context.
    #[arg(long, default_value_t = DEFAULT_CTX_SIZE)]
    ctx_size: usize,
    /// Positions of the KV pool all requests share (at least one context); default:
    /// twice the context size. Memory is only touched as it is used.
    #[arg(long, conflicts_with = "kv_pool_mib")]
    kv_pool: Option<usize>,
    /// The KV pool as device (or host) memory, in MiB: as many positions as that many
    /// bytes hold at the cache's types (`--ctk`/`--ctv`; about twice f16's at q8_0).
    /// Must hold at least one context.
    #[arg(long, value_name = "MIB")]
    kv_pool_mib: Option<u64>,
    /// On the CPU, flash attention (on; auto is on, as in llama.cpp on a CPU) or two
    /// matrix products around a softmax (off), each as llama.cpp computes it.
    #[arg(long, visible_alias = "fa", value_enum, default_value = "auto")]
    flash_attn: crate::options::FlashAttn,
    #[command(flatten)]
    cache_types: crate::options::CacheTypeArgs,
    /// When a request fills its context, keep its first --keep tokens (and a BOS
    /// token) and drop half of the rest instead of finishing it with reason `length`
    /// (llama.cpp's --context-shift); the request then computes what it keeps again.
    #[arg(long)]
    context_shift: bool,
    /// With --context-shift, the first tokens of each request that always stay.
    #[arg(long, default_value_t = 0, requires = "context_shift")]
    keep: usize,
    /// Most requests computed at once.
    #[arg(long, default_value_t = 8)]
    max_sequences: usize,
    /// Most requests waiting to start; more are answered 503.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Most tokens one step computes: decoding sequences take one each, prompts are read
    /// in chunks of what is left.
    #[arg(long, default_value_t = 256)]
    step_tokens: usize,
    /// Bearer key the API requires (`/health` stays open).
    #[arg(long, conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// A file whose first line is the key.
    #[arg(long, value_name = "FILE")]
    api_key_file: Option<PathBuf>,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    /// Seconds in-flight requests may take to finish after SIGTERM or Ctrl-C.
    #[arg(long, default_value_t = 10)]
    shutdown_grace: u64,
    /// Worker threads for the computation (default: one per core).
    #[arg(long)]
    threads: Option<std::num::NonZeroUsize>,
    /// Another name the model answers to (repeatable); `/v1/models` lists them after the
    /// file's stem, and responses carry the name a request used.
    #[arg(long = "alias", value_name = "NAME")]
    aliases: Vec<String>,
    /// Refuse (400) a request naming a model other than the file's stem or an alias.
    /// Without it such a request is served by the loaded model, as llama-server does, so
    /// that clients written for other servers (`"model": "gpt-4o"`) work unchanged.
    #[arg(long)]
    strict_model_names: bool,
    /// A web origin (`https://app.example`) whose pages may call the API from a browser
    /// (repeatable; `*` allows any): preflight requests are answered and responses carry
    /// the CORS headers. Off by default.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origins: Vec<String>,
    /// A Jinja chat template to use instead of the model's own (llama-server's flag):
    /// for a model whose template does not render `tools`, say.
    #[arg(long, value_name = "FILE")]
    chat_template_file: Option<PathBuf>,
    /// Slows loading down by this long (for testing `/health` while loading).
    #[arg(long, hide = true, default_value_t = 0)]
    debug_load_delay_ms: u64,
    #[command(flatten)]
    tuning: crate::options::TuningArgs,
}

/// What the handlers need once the model is ready.
pub struct Loaded {
    /// One scheduler, or one a GPU the model is copied to.
    pub scheduler: Replicas,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    /// How the template's model writes tool calls; why tools cannot be offered when
    /// they cannot.
    pub tool_syntax: Result<tools::ToolSyntax, String>,
    pub model_id: String,
    /// The file's architecture, as GGUF names it (`llama`, `qwen3moe`).
    pub architecture: &'static str,
    pub context_size: usize,
    pub n_vocab: usize,
    /// The vocabulary's trie for output constraints, built once; why not, when the
    /// vocabulary cannot be used for them.
    pub grammars: Result<Grammars, String>,
    /// The counters of the device cache holding the weights, when the model computes on
    /// a device; `None` on the CPU (its metrics then read 0).
    pub device_cache: Option<DeviceCacheStats>,
}

/// Reads a device cache's counters (the cache's target type stays out of [`Loaded`]).
pub type DeviceCacheStats = Box<dyn Fn() -> CacheStats + Send + Sync>;

/// Shared by every handler.
pub struct AppState {
    /// Loading progress in [0, 1], as f32 bits.
    progress: AtomicU32,
    loaded: OnceLock<Loaded>,
    load_error: OnceLock<String>,
    api_key: Option<String>,
    shutting_down: AtomicBool,
    started: Instant,
    max_body_bytes: usize,
    aliases: Vec<String>,
    strict_model_names: bool,
    cors_origins: Vec<String>,
    /// Requests that carried each field no field of ours takes, by name (at most
    /// [`MAX_UNKNOWN_NAMES`] names; the others count under [`OTHER_UNKNOWN`]).
    unknown_fields: Mutex<BTreeMap<String, u64>>,
}

/// Most names of unknown request fields counted one by one.
const MAX_UNKNOWN_NAMES: usize = 64;
/// Longest name of an unknown field counted under its own name.
const MAX_UNKNOWN_NAME_BYTES: usize = 64;
/// What the unknown fields past those limits count under.
const OTHER_UNKNOWN: &str = "(other)";

impl AppState {
    /// Counts a request's unknown fields, and logs each name the first time it comes.
    fn note_unknown_fields<'a>(&self, names: impl Iterator<Item = &'a String>) {
        let Ok(mut counts) = self.unknown_fields.lock() else {
            return;
        };
        for name in names {
            let known = counts.contains_key(name.as_str());
            let key = if known
                || (counts.len() < MAX_UNKNOWN_NAMES && name.len() <= MAX_UNKNOWN_NAME_BYTES)
            {
                name.as_str()
            } else {
                OTHER_UNKNOWN
            };
            if !known && key == name.as_str() {
                tracing::info!(field = %name, "ignoring a request field this server does not know");
            }
            *counts.entry(key.to_owned()).or_default() += 1;
        }
    }

    /// The counts of [`AppState::note_unknown_fields`], by name.
    fn unknown_field_counts(&self) -> Vec<(String, u64)> {
        self.unknown_fields
            .lock()
            .map(|c| c.iter().map(|(k, v)| (k.clone(), *v)).collect())
            .unwrap_or_default()
    }

    fn progress(&self) -> f32 {
        f32::from_bits(self.progress.load(Ordering::Relaxed))
    }

    fn set_progress(&self, p: f32) {
        self.progress
            .store(p.clamp(0.0, 1.0).to_bits(), Ordering::Relaxed);
    }
}

pub fn run(args: &ServeArgs) -> Result<()> {
    // Said before listening, as every other refusal.
    let gpus = Gpus::of(&args.placement)?;
    if let Gpus::Placement(crate::options::Placement::Tensors(_)) = gpus {
        anyhow::bail!(
            "--split-mode tensor runs one sequence at a time; the server batches many: use \
             --split-mode replicate or layer over several GPUs, or one GPU"
        );
    }
    let gpu = args.placement.first_device();
    if args.device == "gpu" {
        // Said before listening: nothing could be served.
        if let Err(e) = hip_backend::Device::open(gpu) {
            bail!("--device gpu: no usable GPU {gpu}: {e}");
        }
    }
    if args.max_sequences == 0 || args.step_tokens == 0 {
        bail!("--max-sequences and --step-tokens must be at least 1");
    }
    let tuning = args.tuning.apply();
    if let Some(threads) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads.get())
            .build_global()
            .context("setting up the worker threads")?;
    }
    let api_key = match (&args.api_key, &args.api_key_file) {
        (Some(key), _) => Some(key.clone()),
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading the API key from {}", file.display()))?;
            let key = text.lines().next().unwrap_or("").trim().to_owned();
            if key.is_empty() {
                bail!("{} holds no key", file.display());
            }
            Some(key)
        }
        (None, None) => None,
    };
    let template_source = match &args.chat_template_file {
        Some(file) => Some(
            std::fs::read_to_string(file)
                .with_context(|| format!("reading the chat template {}", file.display()))?,
        ),
        None => None,
    };
    let path = model_path(
        args.gguf.as_deref(),
        Some(Fetch {
            offline: args.offline,
            progress: false,
        }),
    )?;
    let state = Arc::new(AppState {
        progress: AtomicU32::new(0f32.to_bits()),
        loaded: OnceLock::new(),
        load_error: OnceLock::new(),
        api_key,
        shutting_down: AtomicBool::new(false),
        started: Instant::now(),
        max_body_bytes: args.max_body_bytes,
        aliases: args.aliases.clone(),
        strict_model_names: args.strict_model_names,
        cors_origins: args.cors_origins.clone(),
        unknown_fields: Mutex::new(BTreeMap::new()),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(serve(args, gpus, tuning.gpu, path, template_source, state))
}

async fn serve(
    args: &ServeArgs,
    gpus: Gpus,
    gpu_tuning: GpuTuning,
    path: PathBuf,
    template_source: Option<String>,
    state: Arc<AppState>,
) -> Result<()> {
    let addr: SocketAddr = format!("{}:{}", bracket(&args.host), args.port)
        .parse()
        .with_context(|| format!("--host {} --port {}", args.host, args.port))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("listening on {addr}"))?;
    let local = listener.local_addr()?;
    eprintln!("listening on http://{local}");

    let config = LoadConfig {
        ctx_size: args.ctx_size,
        kv_pool: match (args.kv_pool, args.kv_pool_mib) {
            (Some(positions), _) => Some(PoolSize::Positions(positions)),
            (None, Some(mib)) => Some(PoolSize::Mib(mib)),
            (None, None) => None,
        },
        flash_attn: args.flash_attn,
        kv_types: args.cache_types.types(),
        context_shift: args.context_shift.then_some(args.keep),
        max_sequences: args.max_sequences,
        max_queue: args.max_queue,
        step_tokens: args.step_tokens,
        device: args.device.clone(),
        gpus,
        gpu_tuning,
        delay: Duration::from_millis(args.debug_load_delay_ms),
        template_source,
    };
    {
        let state = Arc::clone(&state);
        std::thread::Builder::new()
            .name("load".into())
            .spawn(move || {
                let start = Instant::now();
                match load(&path, &config, &state) {
                    Ok(loaded) => {
                        eprintln!(
                            "model {} ready in {:.0} ms",
                            loaded.model_id,
                            start.elapsed().as_secs_f64() * 1e3
                        );
                        let _ = state.loaded.set(loaded);
                        state.set_progress(1.0);
                    }
                    Err(e) => {
                        eprintln!("error: loading {}: {e:#}", path.display());
                        let _ = state.load_error.set(format!("{e:#}"));
                    }
                }
            })
            .context("starting the loading thread")?;
    }

    let app = api::router(Arc::clone(&state));
    let grace = Duration::from_secs(args.shutdown_grace);
    let shutdown_state = Arc::clone(&state);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            wait_for_signal().await;
            eprintln!("stopping: no new requests, finishing those in flight");
            shutdown_state.shutting_down.store(true, Ordering::SeqCst);
            let state = Arc::clone(&shutdown_state);
            let _ = tokio::task::spawn_blocking(move || {
                if let Some(loaded) = state.loaded.get() {
                    loaded.scheduler.shutdown(grace);
                }
            })
            .await;
        })
        .await
        .context("serving")?;
    eprintln!("stopped");
    Ok(())
}

/// `::1` as `[::1]`, so that a port can follow.
fn bracket(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

struct LoadConfig {
    ctx_size: usize,
    kv_pool: Option<PoolSize>,
    flash_attn: crate::options::FlashAttn,
    kv_types: model::KvTypes,
    /// Tokens a context shift keeps (a BOS token besides), or none without one.
    context_shift: Option<usize>,
    max_sequences: usize,
    max_queue: usize,
    step_tokens: usize,
    /// `auto`, `cpu` or `gpu`.
    device: String,
    /// The GPU, the GPUs a split takes, or the GPUs with a copy each.
    gpus: Gpus,
    gpu_tuning: GpuTuning,
    delay: Duration,
    /// `--chat-template-file`'s template, in place of the file's.
    template_source: Option<String>,
}

/// Opens the model, reads every weight page once (so the first requests do not wait on
/// the disk), and starts the scheduler, reporting progress as it goes.
fn load(path: &std::path::Path, config: &LoadConfig, state: &AppState) -> Result<Loaded> {
    let store = TensorStore::open(path)?;
    state.set_progress(0.02);
    let tokenizer = Arc::new(Tokenizer::from_metadata(store.metadata()).context("tokenizer")?);
    let model = Model::load(&store)?;
    let template = match &config.template_source {
        Some(source) => {
            let template =
                ChatTemplate::from_source_and_metadata(source.as_str(), store.metadata())?;
            template
                .render(&[model::chat::ChatMessage::user("hi")], true)
                .context("--chat-template-file")?;
            Some(template)
        }
        None => ChatTemplate::from_metadata(store.metadata()).ok(),
    };
    let tool_syntax = match &template {
        Some(template) => tools::ToolSyntax::of_template(template),
        None => Err("the model has no chat template".to_owned()),
    };
    if let Ok(syntax) = tool_syntax {
        tracing::info!(syntax = syntax.name(), "tool calls");
    }
    state.set_progress(0.05);
    let on_gpu = match config.device.as_str() {
        "cpu" => false,
        device => match gpu_usable(&model, &config.gpus) {
            Ok(()) => true,
            Err(why) if device == "auto" => {
                tracing::info!(%why, "serving on the CPU");
                false
            }
            Err(why) => bail!("--device gpu: {why}"),
        },
    };
    // On the CPU every weight page is read once, so that the first requests do not wait
    // on the disk; on a GPU the upload reads them.
    let handles: Vec<_> = if on_gpu {
        Vec::new()
    } else {
        store.tensors().collect()
    };
    let total = store.tensor_bytes().max(1);
    let mut done = 0u64;
    let mut checksum = 0u8;
    for handle in &handles {
        let bytes = handle.bytes()?;
        for page in bytes.chunks(4096) {
            checksum ^= page[0];
        }
        done += handle.size();
        state.set_progress(0.05 + 0.9 * done as f32 / total as f32);
        if !config.delay.is_zero() {
            std::thread::sleep(config.delay / handles.len().max(1) as u32);
        }
    }
    tracing::debug!(checksum, "weights read");
    let n_ctx_train = model.config().n_ctx_train;
    let context_size = match config.ctx_size {
        0 => n_ctx_train,
        n => n.min(n_ctx_train),
    };
    let per_position = config.kv_types.bytes_per_position(model.config());
    let pool = pool_positions(config.kv_pool, per_position, context_size).with_context(|| {
        format!(
            "--kv-pool-mib: a {}/{} cache takes {per_position} bytes a position",
            config.kv_types.k, config.kv_types.v
        )
    })?;
    tracing::info!(
        positions = pool,
        mib = (pool as u64 * per_position as u64) >> 20,
        "KV pool"
    );
    let model_id = path
        .file_name()
        .and_then(|n| n.to_str())
        .map(|n| n.trim_end_matches(".gguf").to_owned())
        .unwrap_or_else(|| "model".to_owned());
    let n_vocab = model.config().n_vocab;
    let architecture = model.config().architecture.name();
    let scheduler_config = SchedulerConfig {
        max_sequences: config.max_sequences,
        max_queue: config.max_queue,
        step_tokens: config.step_tokens,
        context_size,
        pool_positions: pool,
        block_size: 16,
        attention: config.flash_attn.method(),
        kv_types: config.kv_types,
        context_shift: config
            .context_shift
            .map(|keep| crate::options::kept_by_shift(keep, &tokenizer)),
    };
    let grammars = Grammars::new(Arc::clone(&tokenizer), n_vocab).map_err(|e| {
        tracing::warn!(error = %e, "output constraints are not available");
        e.to_string()
    });
    let tokens = Arc::clone(&tokenizer);
    let (scheduler, device_cache) = if on_gpu {
        let options = |device| GpuOptions {
            device,
            mode: UploadMode::Background,
            budget: None,
            context_size,
            kv_types: config.kv_types,
            stop: None,
            tuning: config.gpu_tuning,
        };
        let pool_bytes = pool as u64 * per_position as u64;
        let schedulers = match config.gpus.clone().resolve(&model, pool_bytes)? {
            Gpus::Placement(crate::options::Placement::One(device)) => {
                vec![Scheduler::start_on_gpu(
                    model,
                    tokens,
                    scheduler_config,
                    options(device),
                )?]
            }
            Gpus::Placement(crate::options::Placement::Layers(split)) => {
                tracing::info!(devices = ?split.devices, "the model split by layers");
                let first = options(split.devices[0]);
                vec![Scheduler::start_on_gpus(
                    model,
                    tokens,
                    scheduler_config,
                    first,
                    split,
                )?]
            }
            Gpus::Replicas(devices) => {
                start_replicas(&model, &tokens, scheduler_config, &devices, options)?
            }
            Gpus::Placement(crate::options::Placement::Tensors(_)) | Gpus::Choose(_) => {
                unreachable!("`run` refuses a split by tensors before loading; `resolve` chose")
            }
        };
        tracing::info!(device = "gpu", replicas = schedulers.len(), "serving");
        let metrics: Vec<_> = schedulers.iter().map(|s| Arc::clone(s.metrics())).collect();
        let stats: DeviceCacheStats = Box::new(move || {
            metrics
                .iter()
                .filter_map(|m| m.device_cache())
                .reduce(|a, b| a + b)
                .unwrap_or_default()
        });
        (Replicas::new(schedulers), Some(stats))
    } else {
        tracing::info!(device = "cpu", "serving");
        (
            Replicas::new(vec![Scheduler::start(model, tokens, scheduler_config)?]),
            None,
        )
    };
    Ok(Loaded {
        scheduler,
        tokenizer,
        template,
        tool_syntax,
        model_id,
        architecture,
        context_size,
        n_vocab,
        grammars,
        device_cache,
    })
}
