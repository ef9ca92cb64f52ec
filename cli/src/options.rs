//! Argument handling shared by the subcommands: where a prompt comes from, llama.cpp's
//! `-n -1`, the sampling flags, the device flags, the worker-thread count, and the
//! tuning flags.

use std::io::Read;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use hip_backend::Device;
use model::gpu::{GpuOptions, GpuTuning, PROMPT_BATCH};
use model::sampling::{defaults, SamplingParams};
use rocmforge::tuning::Tuning;
use tensor_store::device::StagingRing;
use tensor_store::{LoadMode, TensorStore};

use crate::device_choice::DeviceArg;
use crate::generate::parse_batch_size;
use crate::load::LoadModeArg;
use crate::models;

/// The sampling flags `generate` and `chat` share, with llama.cpp's defaults.
#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy.
    #[arg(long, visible_alias = "temp", default_value_t = defaults::TEMPERATURE,
          allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep the K most likely tokens; 0 keeps all.
    #[arg(long, default_value_t = defaults::TOP_K, allow_negative_numbers = true)]
    pub top_k: usize,
    /// Keep the most likely tokens up to this probability mass, in (0, 1]; 1 keeps all.
    #[arg(long, default_value_t = defaults::TOP_P, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one, in [0, 1].
    #[arg(long, default_value_t = defaults::MIN_P, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalty for tokens seen in the last --repeat-last-n tokens; 1 is none.
    #[arg(long, default_value_t = defaults::REPEAT_PENALTY, allow_negative_numbers = true)]
    pub repeat_penalty: f32,
    /// How many recent tokens the repetition penalty looks at.
    #[arg(long, default_value_t = defaults::REPEAT_LAST_N)]
    pub repeat_last_n: usize,
    /// Seed of the sampler; random when not given.
    #[arg(long, short = 's')]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The parameters with `seed` (the given one, or one drawn by the caller).
    pub fn params(&self, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed,
        }
    }
}

/// The model `generate` and `chat` run, how its file is read, and the CPU's threads.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// The GGUF model (any shard of a split model). Default: SmolLM2-135M-Instruct from
    /// the models cache ($ROCMFORGE_MODELS, else ~/.cache/rocmforge/models), fetched
    /// there on first use.
    #[arg(long, short = 'm', visible_alias = "model", value_name = "FILE")]
    pub gguf: Option<PathBuf>,
    /// Worker threads for the computation (default and most: one per core).
    #[arg(long, short = 't')]
    pub threads: Option<NonZeroUsize>,
    /// Read the file instead of mapping it.
    #[arg(long)]
    pub no_mmap: bool,
    /// Never download: without --gguf, the default model must be in the cache already
    /// (also ROCMFORGE_OFFLINE=1).
    #[arg(long)]
    pub offline: bool,
}

impl ModelArgs {
    /// The model's file, fetched if need be (the download's progress shown on stderr
    /// even when it is not a terminal where `progress` says), opened and its header
    /// parsed.
    pub fn open(&self, progress: bool) -> Result<(PathBuf, TensorStore)> {
        let path = models::model_path(
            self.gguf.as_deref(),
            Some(models::Fetch {
                offline: self.offline,
                progress,
            }),
        )?;
        let mode = if self.no_mmap {
            LoadMode::Read
        } else {
            LoadMode::Mmap
        };
        let store = TensorStore::open_with(&path, mode)?;
        Ok((path, store))
    }
}

/// Where `generate` and `chat` compute, and how a GPU takes the model.
#[derive(clap::Args, Clone)]
pub struct DeviceArgs {
    /// Where to compute: the GPU when one is usable (auto), the GPU or an error (gpu),
    /// or the CPU.
    #[arg(long, value_enum, default_value = "auto")]
    pub device: DeviceArg,
    /// On a GPU, when the weights go to the device: all before the prompt (eager), in
    /// the background while the first layers already compute (background), or each
    /// tensor when first used (lazy).
    #[arg(long, value_enum, default_value = "background")]
    pub load_mode: LoadModeArg,
    /// On a GPU, the device memory the weights may take, in MiB; below the model's
    /// size, layers are uploaded again as they are needed. Default: the whole model.
    #[arg(long, value_name = "MIB")]
    pub gpu_budget_mib: Option<u64>,
    /// On a GPU, most prompt tokens one forward pass takes: longer prompts run in chunks
    /// of this many (the device memory for activations grows with it).
    #[arg(long, short = 'b', default_value_t = PROMPT_BATCH, value_parser = parse_batch_size)]
    pub batch_size: usize,
    #[command(flatten)]
    pub placement: PlacementArgs,
}

/// Which GPUs take the model, and how it is split over several.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct PlacementArgs {
    /// The GPUs to use, by ordinal (`rocmforge devices` lists them), comma-separated, in
    /// the order of the layers when the model is split. Default: GPU 0, or every GPU,
    /// split by layers, when the model's weights do not fit GPU 0's free memory and no
    /// `--gpu-budget-mib` is given.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub devices: Vec<usize>,
    /// How a model is spread over several GPUs: `none` (one GPU), `layer` (each GPU a
    /// contiguous run of layers and their KV cache; the residual stream crosses between
    /// them), `tensor` (each GPU a share of every layer's heads and feed-forward rows,
    /// added up by NCCL or RCCL after each block; one sequence at a time, so not for
    /// `serve`), or `replicate` (`serve` only: each GPU a whole copy of the model and
    /// its own KV pool, the requests spread over them). Default: `layer` when `--devices`
    /// names several GPUs (for `serve`: `replicate` when the model fits each of them),
    /// else `none`.
    #[arg(long, value_enum)]
    pub split_mode: Option<SplitMode>,
    /// With `--split-mode layer`, each GPU's share of the weights, comma-separated in
    /// the order of `--devices` (e.g. `3,1`). Default: equal shares.
    #[arg(long, value_name = "RATIOS", value_delimiter = ',')]
    pub tensor_split: Vec<f64>,
    /// With `--split-mode tensor`, the collectives library to load (NCCL's
    /// `libnccl.so.2` on NVIDIA, RCCL's `librccl.so.1` on AMD). Default: the
    /// `ROCMFORGE_COLLECTIVES` environment variable, else those names through the
    /// dynamic loader's search path (`LD_LIBRARY_PATH`).
    #[arg(long, value_name = "PATH")]
    pub collectives: Option<std::path::PathBuf>,
}

/// `--split-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SplitMode {
    None,
    Layer,
    Tensor,
    Replicate,
}

/// Where a model goes: one GPU, or several split by layers or by tensors.
#[derive(Clone, Debug, PartialEq)]
pub enum Placement {
    One(usize),
    Layers(model::gpu::SplitOptions),
    Tensors(model::gpu::TensorOptions),
}

impl Placement {
    /// The GPU the model goes to, or the first of a split's.
    pub fn first_device(&self) -> usize {
        match self {
            Placement::One(device) => *device,
            Placement::Layers(split) => split.devices[0],
            Placement::Tensors(split) => split.devices[0],
        }
    }
}

impl PlacementArgs {
    /// The placement the flags ask for, or an error naming the flag that cannot be
    /// honoured.
    pub fn placement(&self) -> Result<Placement> {
        let devices = if self.devices.is_empty() {
            vec![0]
        } else {
            self.devices.clone()
        };
        let mode = self.split_mode.unwrap_or(if devices.len() > 1 {
            SplitMode::Layer
        } else {
            SplitMode::None
        });
        let ratios = (!self.tensor_split.is_empty()).then(|| self.tensor_split.clone());
        match mode {
            SplitMode::Replicate => bail!(
                "--split-mode replicate is for `serve`, which spreads requests over the \
                 copies: one stream runs on one copy (use --split-mode layer or tensor to \
                 spread one model over several GPUs)"
            ),
            SplitMode::Tensor if devices.len() < 2 => {
                bail!("--split-mode tensor needs several GPUs: name them with --devices (e.g. 0,1)")
            }
            SplitMode::Tensor if ratios.is_some() => bail!(
                "--tensor-split applies to --split-mode layer: a split by tensors gives each \
                 GPU an equal share of the heads and rows"
            ),
            SplitMode::Tensor => Ok(Placement::Tensors(model::gpu::TensorOptions {
                devices,
                library: self
                    .collectives
                    .clone()
                    .or_else(|| std::env::var_os("ROCMFORGE_COLLECTIVES").map(Into::into)),
            })),
            SplitMode::None if devices.len() > 1 => bail!(
                "--devices names {} GPUs but --split-mode none uses one: name one GPU, or \
                 use --split-mode layer",
                devices.len()
            ),
            SplitMode::None if ratios.is_some() => {
                bail!("--tensor-split needs --split-mode layer and several --devices")
            }
            SplitMode::None => Ok(Placement::One(devices[0])),
            SplitMode::Layer => {
                if let Some(r) = &ratios {
                    if r.len() != devices.len() {
                        bail!(
                            "--tensor-split gives {} ratios for {} devices: one a device",
                            r.len(),
                            devices.len()
                        );
                    }
                }
                if devices.len() == 1 {
                    return Ok(Placement::One(devices[0]));
                }
                Ok(Placement::Layers(model::gpu::SplitOptions {
                    devices,
                    ratios,
                    chunk: None,
                }))
            }
        }
    }

    /// The first GPU the model goes to (the one whose runtime starts first).
    pub fn first_device(&self) -> usize {
        self.devices.first().copied().unwrap_or(0)
    }
}

impl DeviceArgs {
    /// The options of a model on `device`, its KV cache `context_size` positions long
    /// of `kv_types`, stopped between two layers once `stop` is set (an error `main`
    /// turns into status 130).
    pub fn gpu_options(
        &self,
        device: &Device,
        context_size: usize,
        kv_types: model::KvTypes,
        stop: &Arc<AtomicBool>,
        tuning: GpuTuning,
    ) -> GpuOptions {
        GpuOptions {
            device: device.ordinal(),
            mode: self.load_mode.into(),
            budget: self.gpu_budget_mib.map(|mib| mib.saturating_mul(1 << 20)),
            context_size,
            kv_types,
            stop: Some(Arc::clone(stop)),
            tuning,
        }
    }
}

/// The text given with `--prompt`, or read from `--file PATH` (`-` is stdin), for prompts
/// longer than a command line may be.
pub fn prompt_text(prompt: Option<&str>, file: Option<&Path>) -> Result<String> {
    match (prompt, file) {
        (Some(text), None) => Ok(text.to_owned()),
        (None, Some(path)) if path == Path::new("-") => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("reading the prompt from stdin")?;
            Ok(text)
        }
        (None, Some(path)) => {
            if path.is_dir() {
                bail!("{}: is a directory, not a prompt file", path.display());
            }
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the prompt from {}", path.display()))
        }
        (Some(_), Some(_)) => bail!("give the text or --file, not both"),
        (None, None) => bail!("no text given: pass it, or --file PATH (- reads stdin)"),
    }
}

/// `--max-tokens`: a count, or -1 (as in llama.cpp) for "until the context is full".
pub fn parse_max_tokens(text: &str) -> Result<usize, String> {
    if text.trim() == "-1" {
        return Ok(usize::MAX);
    }
    text.trim().parse().map_err(|_| {
        format!("expected a count of tokens or -1 (until the context is full), got {text:?}")
    })
}

/// Sets up rayon's pool with `requested` threads, at most one per core: more only make
/// the threads wait for each other (a thousand take minutes for what two do at once).
/// Returns the count in use.
pub fn worker_threads(requested: Option<NonZeroUsize>) -> Result<usize> {
    let cores = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
    let Some(requested) = requested else {
        return Ok(rayon::current_num_threads());
    };
    let threads = requested.get().min(cores);
    if threads < requested.get() {
        eprintln!(
            "warning: --threads {requested} is more than the {cores} cores here: using {cores}"
        );
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .context("setting up the worker threads")?;
    Ok(threads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minus_one_means_no_limit() {
        assert_eq!(parse_max_tokens("-1"), Ok(usize::MAX));
        assert_eq!(parse_max_tokens("12"), Ok(12));
        assert!(parse_max_tokens("-2").unwrap_err().contains("-1"));
        assert!(parse_max_tokens("many").is_err());
    }
}

/// `--flash-attn` (llama.cpp's `-fa`): how the CPU computes attention. llama.cpp's two
/// computations round differently, and greedy text can part where two tokens nearly
/// tie, so the text is llama.cpp's for the same setting. `auto` is `on`, as llama.cpp's
/// `auto` is on a CPU. The GPU computes attention one way of its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum FlashAttn {
    #[default]
    Auto,
    On,
    Off,
}

impl FlashAttn {
    /// The computation this setting asks of the CPU.
    pub fn method(self) -> model::AttentionMethod {
        match self {
            FlashAttn::Auto | FlashAttn::On => model::AttentionMethod::Flash,
            FlashAttn::Off => model::AttentionMethod::Matmul,
        }
    }
}

/// `--cache-type-k` and `--cache-type-v`: the precisions the KV cache keeps keys and
/// values at, as llama.cpp's `-ctk` and `-ctv` name them.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct CacheTypeArgs {
    /// The precision of the KV cache's keys: f16, q8_0 or q4_0 (quantized types with
    /// flash attention; on a GPU, with every layer on the device).
    #[arg(long = "cache-type-k", visible_alias = "ctk", value_name = "TYPE",
          default_value = "f16", value_parser = model::KvType::parse)]
    pub k: model::KvType,
    /// The precision of the KV cache's values: f16, q8_0 or q4_0 (as for keys).
    #[arg(long = "cache-type-v", visible_alias = "ctv", value_name = "TYPE",
          default_value = "f16", value_parser = model::KvType::parse)]
    pub v: model::KvType,
}

impl CacheTypeArgs {
    pub fn types(self) -> model::KvTypes {
        model::KvTypes {
            k: self.k,
            v: self.v,
        }
    }
}

/// The first positions a context shift keeps for `--keep N`, as llama.cpp counts them:
/// N tokens and the BOS token the tokenizer adds.
pub fn kept_by_shift(keep: usize, tokenizer: &model::tokenizer::Tokenizer) -> usize {
    let bos = tokenizer.adds_bos() && tokenizer.special_tokens().bos.is_some();
    keep + usize::from(bos)
}

/// `on` or `off`, for the tuning flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    On,
    Off,
}

impl Switch {
    fn on(self) -> bool {
        self == Switch::On
    }
}

/// The flags that choose between two ways of doing the same work, to measure or test
/// one against the other. A flag not given takes its environment variable's setting
/// ([`rocmforge::tuning`]), else the default.
#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Tuning (each also from its ROCMFORGE_* variable)")]
pub struct TuningArgs {
    /// Whether the CPU's products may take the AVX-512 kernels where the CPU has them:
    /// the same bits as the AVX2 ones, faster. Default: on, unless ROCMFORGE_CPU_AVX512=0.
    #[arg(long, value_enum)]
    cpu_avx512: Option<Switch>,
    /// On NVIDIA GPUs of compute capability 9.0 and later, whether a kernel may start
    /// while the one before it finishes (chained launches). Default: on, unless
    /// ROCMFORGE_CHAINED_LAUNCH=0.
    #[arg(long, value_enum)]
    chained_launch: Option<Switch>,
    /// On NVIDIA GPUs of compute capability 8.0 and later, whether a prompt's attention
    /// takes the matrix units; off takes the f32 kernel AMD runs. Default: on, unless
    /// ROCMFORGE_FLASH_MMA=0.
    #[arg(long, value_enum)]
    flash_mma: Option<Switch>,
    /// On a GPU, whether a decode step's attention over f16 caches with heads of 32, 64
    /// or 128 values gives each 32-lane group blocks of 32 keys, a key a lane; off takes
    /// the kernel every cache type runs. Default: on, unless ROCMFORGE_WARP_ATTENTION=0.
    #[arg(long, value_enum)]
    warp_attention: Option<Switch>,
    /// On NVIDIA GPUs of compute capability 8.0 and later, whether the products of Q4_K
    /// matrices on a prompt's chunk or a batch of sequences take the int8 matrix units
    /// (activations quantized to 8 bits in blocks of 256); off takes the f16 tiles and
    /// skinny products. Default: on, unless ROCMFORGE_INT8_PROMPTS=0.
    #[arg(long, value_enum)]
    int8_prompts: Option<Switch>,
    /// On a GPU that does not hold the whole model, the device's share (0 to 1) of the
    /// rows of the layers the CPU computes while decoding; 0 leaves them all to the CPU.
    /// Default: ROCMFORGE_HOST_ROWS_ON_GPU, else the share the CPU's threads give.
    #[arg(long, value_name = "SHARE", value_parser = rocmforge::tuning::parse_share)]
    host_rows_on_gpu: Option<f64>,
    /// For a mixture of experts over the GPU's budget, the link slots a layer: slots of
    /// the budget that take the experts a pass misses, copied from the mapped file,
    /// rather than holding experts resident (a budget without a slot gets them outside
    /// it, shared by the layers); 0 leaves every missed expert's routes to the CPU.
    /// Default: ROCMFORGE_EXPERT_LINK_SLOTS, else up to 4 (a quarter of the slots at
    /// most).
    #[arg(long, value_name = "N")]
    expert_link_slots: Option<usize>,
    /// For a mixture of experts over the GPU's budget, whether a pass of a few tokens
    /// reads the experts its pools miss in place, from the mapped file over the link,
    /// once the file is registered; off splits their routes between the link slots and
    /// the CPU. Default: on, unless ROCMFORGE_EXPERTS_IN_PLACE=0.
    #[arg(long, value_enum)]
    experts_in_place: Option<Switch>,
    #[command(flatten)]
    staging: StagingArgs,
}

impl TuningArgs {
    /// The settings: the flags given, over the environment's.
    pub fn tuning(&self) -> Tuning {
        let mut tuning = Tuning::from_vars(|name| std::env::var(name).ok());
        if let Some(switch) = self.cpu_avx512 {
            tuning.cpu_avx512 = switch.on();
        }
        if let Some(switch) = self.chained_launch {
            tuning.chained_launch = switch.on();
        }
        if let Some(switch) = self.flash_mma {
            tuning.gpu.flash_mma = switch.on();
        }
        if let Some(switch) = self.int8_prompts {
            tuning.gpu.int8_prompts = switch.on();
        }
        if let Some(switch) = self.warp_attention {
            tuning.gpu.warp_attention = switch.on();
        }
        if let Some(share) = self.host_rows_on_gpu {
            tuning.gpu.host_rows_share = Some(share);
        }
        if let Some(slots) = self.expert_link_slots {
            tuning.gpu.expert_link_slots = Some(slots);
        }
        if let Some(switch) = self.experts_in_place {
            tuning.gpu.experts_in_place = switch.on();
        }
        if let Some(ring) = self.staging.staging_ring {
            tuning.gpu.staging_ring = ring.into();
        }
        tuning
    }

    /// [`TuningArgs::tuning`], its process-wide settings handed to the libraries at once
    /// (before any product or kernel).
    pub fn apply(&self) -> Tuning {
        let tuning = self.tuning();
        tuning.apply_process_wide();
        tuning
    }
}

/// `--staging-ring`, of every command that uploads weights to a GPU.
#[derive(clap::Args, Clone, Debug)]
pub struct StagingArgs {
    /// On a GPU, how the upload's page-locked staging buffers are allocated: in two
    /// regions, each registered at once (region), or one at a time (separate).
    /// Default: ROCMFORGE_STAGING_RING, else region.
    #[arg(long, value_enum)]
    staging_ring: Option<StagingRingArg>,
}

impl StagingArgs {
    /// The flag, else the environment's setting.
    pub fn staging_ring(&self) -> StagingRing {
        match self.staging_ring {
            Some(ring) => ring.into(),
            None => {
                Tuning::from_vars(|name| std::env::var(name).ok())
                    .gpu
                    .staging_ring
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum StagingRingArg {
    Region,
    Separate,
}

impl From<StagingRingArg> for StagingRing {
    fn from(ring: StagingRingArg) -> StagingRing {
        match ring {
            StagingRingArg::Region => StagingRing::Region,
            StagingRingArg::Separate => StagingRing::Separate,
        }
    }
}
