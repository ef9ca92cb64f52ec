//! `cargo xtask bench-load`: how fast a model becomes resident on the device, per upload
//! mode, next to the limits of the same machine.
//!
//! ```text
//! cargo xtask bench-load --gguf FILE [--device gpu|cpu] [--mode eager|background|lazy|all]
//!     [--cold] [--json [FILE]] [--readers N] [--staging N] [--chunk-mib N] [--direct]
//!     [--budget-mib N] [--repeat N] [--verify]
//! ```
//!
//! Without `--device`, the GPU if this build and machine have one, else the cpu.
//!
//! Per run: parse (open the store), plan built (the model's execution plan), first layer
//! resident (embeddings and block 0), all resident, each from the start of the load;
//! effective GB/s; peak resident host memory (VmHWM, reset before each run); device
//! allocations. Limits measured first: file read bandwidth with the loader's own reader
//! count and chunk size (from a cold page cache with `--cold`), and pinned host→device
//! copy bandwidth (on `--device cpu`: host `memcpy` bandwidth, where the "device" is host
//! memory). `--cold` drops the page cache before every run (all caches as root, else the
//! file's pages). `ROCMFORGE_STAGING_RING=separate` allocates the staging buffers one at
//! a time, as `rocmforge load --staging-ring separate` does.

pub mod measure;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tensor_store::device::{
    CacheConfig, DeviceCache, DeviceTarget, HipTarget, HostTarget, UploadMode, UploadOrder,
};
use tensor_store::TensorStore;

const USAGE: &str = "usage: cargo xtask bench-load --gguf FILE [--device gpu|cpu] \
    [--mode eager|background|lazy|all] [--cold] [--json [FILE]] [--readers N] [--staging N] \
    [--chunk-mib N] [--direct] [--budget-mib N] [--repeat N] [--verify]";

struct Options {
    gguf: PathBuf,
    gpu: bool,
    /// `--device` given: no falling back to the cpu.
    device_named: bool,
    modes: Vec<UploadMode>,
    cold: bool,
    json: Option<Option<PathBuf>>,
    config: CacheConfig,
    repeat: usize,
    verify: bool,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        gguf: PathBuf::new(),
        gpu: true,
        device_named: false,
        modes: vec![UploadMode::Eager, UploadMode::Background, UploadMode::Lazy],
        cold: false,
        json: None,
        config: CacheConfig {
            staging_ring: crate::tuning().gpu.staging_ring,
            ..CacheConfig::default()
        },
        repeat: 1,
        verify: false,
    };
    let mut gguf = None;
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        let value = |i: usize| {
            args.get(i + 1)
                .with_context(|| format!("{flag} needs a value\n{USAGE}"))
        };
        let number = |i: usize| -> Result<usize> {
            value(i)?
                .parse()
                .with_context(|| format!("{flag} takes a number"))
        };
        let mut took = 1;
        match flag {
            "--gguf" => (gguf, took) = (Some(PathBuf::from(value(i)?)), 2),
            "--device" => {
                o.gpu = match value(i)?.as_str() {
                    "gpu" => true,
                    "cpu" => false,
                    other => bail!("--device {other:?}: expected gpu or cpu"),
                };
                o.device_named = true;
                took = 2;
            }
            "--mode" => {
                o.modes = match value(i)?.as_str() {
                    "eager" => vec![UploadMode::Eager],
                    "background" => vec![UploadMode::Background],
                    "lazy" => vec![UploadMode::Lazy],
                    "all" => vec![UploadMode::Eager, UploadMode::Background, UploadMode::Lazy],
                    other => bail!("--mode {other:?}: expected eager, background, lazy or all"),
                };
                took = 2;
            }
            "--cold" => o.cold = true,
            "--json" => match args.get(i + 1).filter(|a| !a.starts_with("--")) {
                Some(file) => (o.json, took) = (Some(Some(PathBuf::from(file))), 2),
                None => o.json = Some(None),
            },
            "--readers" => {
                // However much of the file the page cache holds.
                o.config.readers = number(i)?;
                o.config.cold_readers = o.config.readers;
                took = 2;
            }
            "--staging" => (o.config.staging_buffers, took) = (number(i)?, 2),
            "--chunk-mib" => (o.config.chunk_bytes, took) = (number(i)? << 20, 2),
            "--direct" => o.config.direct_io = true,
            "--budget-mib" => (o.config.budget, took) = (Some((number(i)? as u64) << 20), 2),
            "--repeat" => (o.repeat, took) = (number(i)?.max(1), 2),
            "--verify" => o.verify = true,
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
        i += took;
    }
    o.gguf = gguf.with_context(|| format!("--gguf is required\n{USAGE}"))?;
    Ok(o)
}

/// Runs the benchmark.
pub fn run(args: &[String]) -> Result<()> {
    let mut o = parse(args)?;
    let file_bytes = std::fs::metadata(&o.gguf)
        .with_context(|| format!("reading {}", o.gguf.display()))?
        .len();
    let device = if o.gpu {
        open_gpu(o.device_named)?
    } else {
        None
    };
    if o.gpu && device.is_none() {
        o.gpu = false;
    }
    let (context_ms, device) = match device {
        Some((ms, d)) => (Some(ms), Some(d)),
        None => (None, None),
    };
    let limits = measure_limits(&o, device.as_ref())?;
    let mut runs = Vec::new();
    for &mode in &o.modes {
        for _ in 0..o.repeat {
            let dropped = if o.cold {
                Some(measure::drop_page_cache(&o.gguf)?)
            } else {
                None
            };
            let mut run = match &device {
                Some(device) => run_mode(
                    &o,
                    mode,
                    |arena| HipTarget::new(device, arena).map_err(Into::into),
                    verify_gpu,
                )?,
                None => run_mode(&o, mode, |_| Ok(HostTarget::new()), verify_host)?,
            };
            run["page_cache"] = json!(dropped.map_or("warm", |d| d.name()));
            runs.push(run);
        }
    }
    let report = json!({
        "file": o.gguf.display().to_string(),
        "file_bytes": file_bytes,
        "device": if o.gpu { "gpu" } else { "cpu" },
        "device_name": device.as_ref().map(|d| d.name().to_owned()),
        "context_ms": context_ms,
        "config": {
            "readers": o.config.readers,
            "cold_readers": o.config.cold_readers,
            "staging_buffers": o.config.staging_buffers,
            "chunk_bytes": o.config.chunk_bytes,
            "staging_ring": o.config.staging_ring.name(),
            "direct_io": o.config.direct_io,
            "budget": o.config.budget,
        },
        "limits": limits,
        "runs": runs,
    });
    print_table(&report);
    match &o.json {
        Some(Some(path)) => std::fs::write(path, serde_json::to_string_pretty(&report)?)?,
        Some(None) => println!("{}", serde_json::to_string_pretty(&report)?),
        None => {}
    }
    Ok(())
}

/// Device 0 with its runtime started, and how long starting took; `None` (with a note)
/// when this build or machine has no GPU and `--device gpu` was not asked for.
fn open_gpu(required: bool) -> Result<Option<(f64, hip_backend::Device)>> {
    let started = Instant::now();
    let device = match hip_backend::Device::open(0) {
        Ok(device) => device,
        Err(error) if error.is_unavailable() && !required => {
            eprintln!(
                "note: no gpu ({error}); measuring the pipeline into host memory (--device cpu)"
            );
            return Ok(None);
        }
        Err(error) => return Err(error.into()),
    };
    // The runtime creates its context lazily: make it now, outside the timed load.
    device.memory_info()?;
    Ok(Some((ms(started), device)))
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn measure_limits(o: &Options, device: Option<&hip_backend::Device>) -> Result<Value> {
    let c = &o.config;
    if o.cold {
        measure::drop_page_cache(&o.gguf)?;
    }
    // Warm runs: this pass also fills the page cache.
    let read =
        measure::file_read_bandwidth(&o.gguf, c.readers, c.chunk_bytes, c.direct_io, u64::MAX)?;
    let copy_bytes = 256 << 20;
    let (copy_name, copy) = match device {
        Some(device) => (
            "pinned_h2d_gbps",
            measure::pinned_h2d_bandwidth(device, copy_bytes, 8)?,
        ),
        None => (
            "host_memcpy_gbps",
            measure::host_copy_bandwidth(copy_bytes, 5),
        ),
    };
    Ok(json!({
        "read_gbps": read / 1e9,
        "read_page_cache": if o.cold { "cold" } else { "warm" },
        copy_name: copy / 1e9,
    }))
}

/// One load in `mode`: the figures of one run.
fn run_mode<T: DeviceTarget>(
    o: &Options,
    mode: UploadMode,
    make_target: impl FnOnce(u64) -> Result<T>,
    verify: fn(&DeviceCache<T>) -> Result<usize>,
) -> Result<Value> {
    measure::reset_peak_rss()?;
    let (_, rss_before) = measure::rss()?;
    let start = Instant::now();
    let store = TensorStore::open(&o.gguf)?;
    let parse_ms = ms(start);
    let order = plan_order(&store)?;
    let plan_ms = ms(start);
    let first_groups: Vec<usize> = ["input", "blk.0"]
        .iter()
        .filter_map(|name| order.groups().iter().position(|g| g.name == *name))
        .collect();
    let target = make_target(HipTarget::arena_bytes_for(
        order.tensors().iter().map(|t| t.size()),
    ))?;
    let target_ms = ms(start);
    // When each group first became resident, from the publisher's callback.
    let group_done: Arc<Mutex<Vec<Option<f64>>>> =
        Arc::new(Mutex::new(vec![None; order.groups().len()]));
    let log = Arc::clone(&group_done);
    let config = CacheConfig {
        mode,
        ..o.config.clone()
    };
    let cache = DeviceCache::with_progress(target, &store, order, config, move |p| {
        if let Some(g) = p.completed_group {
            log.lock().expect("not poisoned")[g] = Some(ms(start));
        }
    })?;
    let ready_ms = ms(start);
    match mode {
        UploadMode::Eager => {}
        UploadMode::Background => {
            // What compute does first: wait for the embeddings and block 0.
            for &g in &first_groups {
                drop(cache.get_group(g)?);
            }
        }
        UploadMode::Lazy => {
            // A forward pass: each layer asked for when it runs.
            for g in 0..cache.order().groups().len() {
                drop(cache.get_group(g)?);
            }
        }
    }
    cache.wait_idle()?;
    let all_ms = ms(start);
    let (peak_rss, _) = measure::rss()?;
    let progress = cache.progress();
    let first_layer_ms = {
        let done = group_done.lock().expect("not poisoned");
        first_groups
            .iter()
            .map(|&g| done[g])
            .try_fold(0f64, |acc, t| t.map(|t| acc.max(t)))
    };
    let verified = if o.verify {
        Some(verify(&cache)?)
    } else {
        None
    };
    let stats = cache.stats();
    Ok(json!({
        "mode": format!("{mode:?}").to_lowercase(),
        "parse_ms": parse_ms,
        "plan_ms": plan_ms,
        "target_ms": target_ms,
        "returned_ms": ready_ms,
        "first_layer_ms": first_layer_ms,
        "all_resident_ms": all_ms,
        "tensors": progress.tensors_done,
        "bytes": progress.bytes_done,
        "effective_gbps": progress.bytes_done as f64 / (all_ms / 1e3) / 1e9,
        "peak_rss_bytes": peak_rss,
        // With the cpu "device", tensors live in host memory: what the loader itself
        // holds is the peak less the tensors.
        "peak_rss_excluding_tensors_bytes": (!o.gpu).then(|| peak_rss.saturating_sub(stats.resident_bytes)),
        "rss_before_bytes": rss_before,
        "device_allocations": cache.target().device_allocations(),
        "uploads": stats.uploads,
        "reads_direct": cache.reads_direct(),
        "verified_tensors": verified,
    }))
}

/// The model's tensors in the order its forward pass first reads them, by layer.
fn plan_order(store: &TensorStore) -> Result<UploadOrder> {
    let config = model::ModelConfig::from_metadata(store.metadata())?;
    let plan = model::ExecutionPlan::build(store, &config)?;
    Ok(UploadOrder::by_layer(plan.handles()))
}

/// Compares every resident tensor with the file's bytes, read independently.
fn verify_with<T: DeviceTarget>(
    cache: &DeviceCache<T>,
    mut device_bytes: impl FnMut(&tensor_store::device::DeviceTensor<T>) -> Result<Vec<u8>>,
) -> Result<usize> {
    let mut checked = 0;
    for handle in cache.order().tensors() {
        let tensor = cache.get(handle)?;
        let mut expected = vec![0u8; handle.size() as usize];
        read_file_range(handle.path(), handle.file_range().start, &mut expected)?;
        if device_bytes(&tensor)? != expected {
            bail!(
                "tensor {} differs from the file on the device",
                handle.name()
            );
        }
        checked += 1;
    }
    Ok(checked)
}

fn read_file_range(path: &Path, offset: u64, out: &mut [u8]) -> Result<()> {
    use std::os::unix::fs::FileExt;
    std::fs::File::open(path)?.read_exact_at(out, offset)?;
    Ok(())
}

fn verify_host(cache: &DeviceCache<HostTarget>) -> Result<usize> {
    verify_with(cache, |t| Ok(t.buffer().as_slice().to_vec()))
}

fn verify_gpu(cache: &DeviceCache<HipTarget>) -> Result<usize> {
    let stream = cache.target().device().new_stream()?;
    verify_with(cache, |t| {
        let mut out = vec![0u8; t.size() as usize];
        stream.read_to_host(t.buffer().bytes(), &mut out)?;
        Ok(out)
    })
}

fn print_table(report: &Value) {
    let gb = |v: &Value| v.as_f64().map_or("-".to_owned(), |x| format!("{x:.2}"));
    let msf = |v: &Value| v.as_f64().map_or("-".to_owned(), |x| format!("{x:.1}"));
    let mib = |v: &Value| {
        v.as_u64()
            .map_or("-".to_owned(), |x| format!("{}", x >> 20))
    };
    println!(
        "bench-load: {} ({} bytes) on {}{}",
        report["file"].as_str().unwrap_or("?"),
        report["file_bytes"],
        report["device"].as_str().unwrap_or("?"),
        report["device_name"]
            .as_str()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default()
    );
    let c = &report["config"];
    println!(
        "config: {} readers ({} when the page cache holds less than half of the file), {} \
         staging buffers of {} MiB ({} ring), direct io {}, context start {} ms",
        c["readers"],
        c["cold_readers"],
        c["staging_buffers"],
        mib(&c["chunk_bytes"]),
        c["staging_ring"].as_str().unwrap_or("?"),
        c["direct_io"],
        msf(&report["context_ms"])
    );
    let l = &report["limits"];
    let copy = l
        .get("pinned_h2d_gbps")
        .map(|v| ("pinned h2d", v))
        .or_else(|| l.get("host_memcpy_gbps").map(|v| ("host memcpy", v)));
    println!(
        "limits: file read {} GB/s ({} page cache), {} {} GB/s",
        gb(&l["read_gbps"]),
        l["read_page_cache"].as_str().unwrap_or("?"),
        copy.map_or("copy", |c| c.0),
        copy.map_or("-".to_owned(), |c| gb(c.1))
    );
    println!(
        "{:<11} {:<6} {:>8} {:>8} {:>9} {:>12} {:>12} {:>8} {:>9} {:>7}",
        "mode",
        "cache",
        "parse",
        "plan",
        "returned",
        "first layer",
        "all resident",
        "GB/s",
        "peak RSS",
        "allocs"
    );
    for r in report["runs"].as_array().into_iter().flatten() {
        println!(
            "{:<11} {:<6} {:>6}ms {:>6}ms {:>7}ms {:>10}ms {:>10}ms {:>8} {:>5} MiB {:>7}",
            r["mode"].as_str().unwrap_or("?"),
            if r["page_cache"] == "warm" {
                "warm"
            } else {
                "cold"
            },
            msf(&r["parse_ms"]),
            msf(&r["plan_ms"]),
            msf(&r["returned_ms"]),
            msf(&r["first_layer_ms"]),
            msf(&r["all_resident_ms"]),
            gb(&r["effective_gbps"]),
            mib(&r["peak_rss_bytes"]),
            r["device_allocations"],
        );
    }
}
