//! `rocmforge load`: puts a model's weights on a GPU, as their raw GGUF blocks, and says
//! how long each stage took, with a progress bar while it runs.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use std::time::Instant;

use anyhow::{Context, Result};
use hip_backend::Device;
use model::{ExecutionPlan, ModelConfig};
use serde_json::json;
use tensor_store::device::{
    CacheConfig, DeviceCache, HipTarget, Progress, UploadMode, UploadOrder,
};
use tensor_store::TensorStore;

use crate::interrupt::install_ctrl_c;
use crate::models::model_path;
use crate::options::Placement;

#[derive(clap::Args)]
pub struct LoadArgs {
    /// The model; without it, the default model from the models cache.
    #[arg(long, short = 'm', visible_alias = "model", value_name = "FILE")]
    gguf: Option<PathBuf>,
    /// When tensors go to the device: all before returning (eager), in the background
    /// while the first layers are waited for (background), or each layer when asked
    /// for, here in layer order (lazy).
    #[arg(long, value_enum, default_value = "background")]
    load_mode: LoadModeArg,
    /// The GPU's ordinal, as `rocmforge devices` lists them.
    #[arg(long, default_value_t = 0, conflicts_with = "devices")]
    device: usize,
    /// Several GPUs (`--devices 0,1`): each uploads its share of the layers at the same
    /// time, as `generate --devices` splits the model.
    #[command(flatten)]
    placement: crate::options::PlacementArgs,
    /// Device memory the weights may use, in MiB; layers beyond it are evicted least
    /// recently used first. Default: the whole model.
    #[arg(long)]
    budget_mib: Option<u64>,
    /// Reader threads copying from the file into the staging ring.
    #[arg(long)]
    readers: Option<usize>,
    /// Read the file with O_DIRECT, past the page cache.
    #[arg(long)]
    direct_io: bool,
    #[command(flatten)]
    staging: crate::options::StagingArgs,
    /// Never draw the progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LoadModeArg {
    Eager,
    Background,
    Lazy,
}

impl From<LoadModeArg> for UploadMode {
    fn from(mode: LoadModeArg) -> UploadMode {
        match mode {
            LoadModeArg::Eager => UploadMode::Eager,
            LoadModeArg::Background => UploadMode::Background,
            LoadModeArg::Lazy => UploadMode::Lazy,
        }
    }
}

/// Loads shorter than this draw no progress bar.
const QUIET_MS: u64 = 250;

pub fn run(args: &LoadArgs) -> Result<()> {
    // Ctrl-C stops the upload between two chunks and frees what it took; `main` turns
    // the interruption into status 130.
    let stop = install_ctrl_c()?;
    let placement = args.placement.placement()?;
    let path = model_path(args.gguf.as_deref(), None)?;
    let device_ordinal = match placement {
        Placement::Layers(split) => return run_split(args, &path, &split, stop),
        Placement::Tensors(split) => return run_tensors(args, &path, &split, stop),
        Placement::One(_) if args.placement.devices.is_empty() => args.device,
        Placement::One(device) => device,
    };
    let start = Instant::now();
    let ms = move || start.elapsed().as_secs_f64() * 1e3;

    tracing::info!(path = %path.display(), "model file");
    let device = Device::open(device_ordinal)
        .with_context(|| format!("cannot use GPU {device_ordinal} to load {}", path.display()))?;
    let device_ms = ms();
    tracing::info!(device = %device.info().name, ms = format_args!("{device_ms:.1}"), "device");
    let store = TensorStore::open(&path)?;
    let config = ModelConfig::from_metadata(store.metadata())
        .with_context(|| format!("{}", path.display()))?;
    let plan =
        ExecutionPlan::build(&store, &config).with_context(|| format!("{}", path.display()))?;
    let order = UploadOrder::by_layer(plan.handles());
    let plan_ms = ms();
    tracing::info!(
        tensors = order.tensors().len(),
        ms = format_args!("{plan_ms:.1}"),
        "plan built"
    );
    let bar = ProgressBar::new(!args.no_progress && !args.json && std::io::stderr().is_terminal());
    let bar_in_callback = bar.clone();
    let loaded = upload(args, &device, &store, order, stop, move |p| {
        bar_in_callback.update(p, start)
    })
    .map(|(cache, first_layer)| (cache, first_layer.duration_since(start).as_secs_f64() * 1e3));
    // The bar's line ends before anything else is printed, error or report.
    bar.finish();
    let (cache, first_layer_ms) = loaded?;
    let all_ms = ms();
    tracing::info!(
        first_layer_ms = format_args!("{first_layer_ms:.1}"),
        all_ms = format_args!("{all_ms:.1}"),
        "loaded"
    );

    let progress = cache.progress();
    let stats = cache.stats();
    let allocations = device.allocation_counters();
    let gb_per_s = progress.bytes_uploaded as f64 / (all_ms - plan_ms).max(1e-3) / 1e6;
    if args.json {
        println!(
            "{}",
            json!({
                "file": path.display().to_string(),
                "device": device.info().name,
                "mode": format!("{:?}", UploadMode::from(args.load_mode)).to_lowercase(),
                "tensors": progress.tensors_done,
                "bytes": progress.bytes_uploaded,
                "device_ms": device_ms,
                "plan_ms": plan_ms,
                "first_layer_ms": first_layer_ms,
                "all_resident_ms": all_ms,
                "upload_gb_per_s": gb_per_s,
                "device_allocations": allocations.device_allocations,
                "evictions": stats.evictions,
            })
        );
    } else {
        println!(
            "{}: {} tensors, {:.1} MiB on {} ({:?})",
            path.display(),
            progress.tensors_done,
            progress.bytes_uploaded as f64 / (1u64 << 20) as f64,
            device.info().name,
            UploadMode::from(args.load_mode),
        );
        println!("  device ready     {device_ms:8.1} ms");
        println!("  model planned    {plan_ms:8.1} ms");
        println!("  first layer      {first_layer_ms:8.1} ms");
        println!("  all resident     {all_ms:8.1} ms  ({gb_per_s:.1} GB/s)");
        println!(
            "  device allocations {}, evictions {}",
            allocations.device_allocations, stats.evictions
        );
    }
    Ok(())
}

/// Uploads `order` from `store` to `device` as `args` say (the load mode, the weights'
/// budget, the readers, the staging), reporting progress to `progress`: the cache once
/// every tensor has been uploaded, and the moment the first block (and the embeddings)
/// was resident.
fn upload(
    args: &LoadArgs,
    device: &Device,
    store: &TensorStore,
    order: UploadOrder,
    stop: Arc<AtomicBool>,
    progress: impl Fn(&Progress) + Send + Sync + 'static,
) -> Result<(DeviceCache<HipTarget>, Instant)> {
    let model_bytes = HipTarget::arena_bytes_for(order.tensors().iter().map(|t| t.size()));
    let budget = args.budget_mib.map(|mib| mib.saturating_mul(1 << 20));
    let target = HipTarget::new(device, budget.map_or(model_bytes, |b| model_bytes.min(b)))?;
    let mut cache_config = CacheConfig {
        mode: args.load_mode.into(),
        budget,
        direct_io: args.direct_io,
        staging_ring: args.staging.staging_ring(),
        stop: Some(stop),
        ..CacheConfig::default()
    };
    if let Some(readers) = args.readers {
        // However much of the file the page cache holds.
        cache_config.readers = readers.max(1);
        cache_config.cold_readers = cache_config.readers;
    }
    // What a forward pass needs first: the embeddings and the first block (of a later
    // device of a split, its own first block).
    let groups = order.groups();
    let first_groups: Vec<usize> = (groups.iter().position(|g| g.name == "input").into_iter())
        .chain(groups.iter().position(|g| g.name.starts_with("blk.")))
        .collect();
    let cache = DeviceCache::with_progress(target, store, order, cache_config, progress)?;
    for &g in &first_groups {
        drop(cache.get_group(g)?);
    }
    let first_layer = Instant::now();
    if let LoadModeArg::Lazy = args.load_mode {
        // Each layer asked for in turn, as a forward pass would.
        for g in 0..cache.order().groups().len() {
            drop(cache.get_group(g)?);
        }
    }
    cache.wait_idle()?;
    Ok((cache, first_layer))
}

/// Several GPUs: each uploads its part of a layer split, all at once, each with a cache
/// of its own, as `args` say; reports each device's bytes and time, and the time until
/// every one is resident.
fn run_split(
    args: &LoadArgs,
    path: &std::path::Path,
    split: &model::gpu::SplitOptions,
    stop: Arc<AtomicBool>,
) -> Result<()> {
    let start = Instant::now();
    let ms = move || start.elapsed().as_secs_f64() * 1e3;
    let store = TensorStore::open(path)?;
    let model = model::Model::load(&store).with_context(|| format!("{}", path.display()))?;
    let ranges = model::gpu::split_layers(&model, split.devices.len(), split.ratios.as_deref())
        .with_context(|| format!("{}", path.display()))?;
    let orders = model::gpu::stage_orders(&model, &ranges);
    let plan_ms = ms();
    let loads: Vec<Result<(f64, u64, String)>> = std::thread::scope(|scope| {
        let threads: Vec<_> = split
            .devices
            .iter()
            .zip(orders)
            .map(|(&ordinal, order)| {
                let (store, stop) = (&store, Arc::clone(&stop));
                scope.spawn(move || -> Result<(f64, u64, String)> {
                    let device = Device::open(ordinal)
                        .with_context(|| format!("cannot use GPU {ordinal}"))?;
                    let (cache, _) = upload(args, &device, store, order, stop, |_| {})?;
                    let uploaded = cache.progress().bytes_uploaded;
                    Ok((ms(), uploaded, device.info().name.clone()))
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let all_ms = ms();
    let mut devices = Vec::new();
    for ((&ordinal, layers), load) in split.devices.iter().zip(&ranges).zip(loads) {
        let (done_ms, bytes, name) = load?;
        devices.push(json!({
            "device": ordinal,
            "name": name,
            "layers": [layers.start, layers.end],
            "bytes": bytes,
            "resident_ms": done_ms,
        }));
    }
    let total: u64 = devices.iter().filter_map(|d| d["bytes"].as_u64()).sum();
    let gb_per_s = total as f64 / (all_ms - plan_ms).max(1e-3) / 1e6;
    if args.json {
        println!(
            "{}",
            json!({
                "file": path.display().to_string(),
                "mode": format!("{:?}", UploadMode::from(args.load_mode)).to_lowercase(),
                "devices": devices,
                "plan_ms": plan_ms,
                "all_resident_ms": all_ms,
                "upload_gb_per_s": gb_per_s,
            })
        );
    } else {
        println!(
            "{}: split by layers over {} GPUs ({:?})",
            path.display(),
            devices.len(),
            UploadMode::from(args.load_mode)
        );
        println!("  model planned    {plan_ms:8.1} ms");
        for d in &devices {
            println!(
                "  GPU {} layers {}..{}: {:.1} MiB resident at {:.1} ms",
                d["device"],
                d["layers"][0],
                d["layers"][1],
                d["bytes"].as_u64().unwrap_or(0) as f64 / (1u64 << 20) as f64,
                d["resident_ms"].as_f64().unwrap_or(0.0)
            );
        }
        println!("  all resident     {all_ms:8.1} ms  ({gb_per_s:.1} GB/s)");
    }
    Ok(())
}

/// `load --split-mode tensor`: every GPU's share of the model uploaded (each its parts
/// of the matrices it cuts, and the weights it holds whole), timed to the moment all are
/// resident.
fn run_tensors(
    args: &LoadArgs,
    path: &std::path::Path,
    split: &model::gpu::TensorOptions,
    stop: Arc<AtomicBool>,
) -> Result<()> {
    let start = Instant::now();
    let ms = move || start.elapsed().as_secs_f64() * 1e3;
    let store = TensorStore::open(path)?;
    let model = model::Model::load(&store).with_context(|| format!("{}", path.display()))?;
    let plan_ms = ms();
    let mut options = model::gpu::GpuOptions::new(UploadMode::Eager, 1);
    options.device = split.devices[0];
    options.stop = Some(stop);
    let gpu = model::gpu::TensorSplit::new(&model, &options, split, 1)
        .with_context(|| format!("split by tensors over GPUs {:?}", split.devices))?;
    let all_ms = ms();
    let (library, version) = gpu.library();
    let bytes = crate::on_gpu::weight_bytes(&model);
    let gb_per_s = bytes as f64 / (all_ms - plan_ms).max(1e-3) / 1e6;
    if args.json {
        println!(
            "{}",
            json!({
                "file": path.display().to_string(),
                "mode": "tensor",
                "devices": split.devices,
                "collectives": library,
                "collectives_version": version,
                "plan_ms": plan_ms,
                "all_resident_ms": all_ms,
                "model_gb_per_s": gb_per_s,
            })
        );
    } else {
        println!(
            "{}: split by tensors over GPUs {:?} ({library})",
            path.display(),
            split.devices
        );
        println!("  model planned    {plan_ms:8.1} ms");
        println!("  all resident     {all_ms:8.1} ms  ({gb_per_s:.1} GB/s of the model)");
    }
    Ok(())
}

/// A one-line progress bar on stderr, drawn only once a load has taken longer than
/// [`QUIET_MS`], at most every 100 ms.
#[derive(Clone)]
struct ProgressBar {
    enabled: bool,
    /// Milliseconds since the start when the bar was last drawn (0: never).
    last_drawn: Arc<AtomicU64>,
}

impl ProgressBar {
    fn new(enabled: bool) -> ProgressBar {
        ProgressBar {
            enabled,
            last_drawn: Arc::new(AtomicU64::new(0)),
        }
    }

    fn update(&self, p: &Progress, start: Instant) {
        if !self.enabled {
            return;
        }
        let now = start.elapsed().as_millis() as u64;
        let last = self.last_drawn.load(Ordering::Relaxed);
        if now < QUIET_MS || (last != 0 && now < last + 100) {
            return;
        }
        self.last_drawn.store(now, Ordering::Relaxed);
        let fraction = if p.bytes_total == 0 {
            1.0
        } else {
            p.bytes_done as f64 / p.bytes_total as f64
        };
        let filled = (fraction * 30.0).round() as usize;
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let mut err = std::io::stderr().lock();
        // A failed write to stderr only loses the bar.
        let _ = write!(
            err,
            "\r[{}{}] {:3.0}%  {:.2}/{:.2} GiB  {}/{} tensors",
            "#".repeat(filled),
            ".".repeat(30 - filled),
            fraction * 100.0,
            gib(p.bytes_done),
            gib(p.bytes_total),
            p.tensors_done,
            p.tensors_total,
        );
        let _ = err.flush();
    }

    fn finish(&self) {
        if self.enabled && self.last_drawn.load(Ordering::Relaxed) != 0 {
            let _ = writeln!(std::io::stderr());
        }
    }
}
