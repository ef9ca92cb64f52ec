//! `cargo xtask bench-gpu`: decode speed on a GPU, ROCmForge beside llama.cpp's CUDA or
//! HIP build, in one run, on the same files.
//!
//! For each model: tg N (default 128), the tokens/s of decoding N tokens one at a time
//! after an empty context, as `llama-bench -n N -p 0` measures it; ours through the
//! library (`GpuModel`, weights resident, greedy tokens chosen on the device and fed
//! back), the median of `--repeat` runs. It prints both, the ratio, and our achieved
//! memory bandwidth: the bytes of every weight read once per token, times tokens/s,
//! against the device's measured copy bandwidth. Then pp N (`--prompt`, default 512; 0
//! skips it): the tokens/s of one N-token prompt in one call, as `llama-bench -p N`
//! measures it, and the arithmetic rate of the layers' products it implies.
//!
//! Without a usable GPU it says why in one line and exits non-zero.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use hip_backend::Device;
use model::gpu::{GpuModel, GpuOptions};
use model::Model;
use serde_json::{json, Value};
use tensor_store::device::UploadMode;
use tensor_store::TensorStore;

struct Options {
    models: Vec<PathBuf>,
    llama_bench: Option<PathBuf>,
    tokens: usize,
    prompt: usize,
    repeat: usize,
    json: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        models: Vec::new(),
        llama_bench: None,
        tokens: 128,
        prompt: 512,
        repeat: 3,
        json: None,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--gguf" => o.models.push(value()?.into()),
            "--llama-bench" => o.llama_bench = Some(value()?.into()),
            "--tokens" => o.tokens = value()?.parse().context("--tokens")?,
            "--prompt" => o.prompt = value()?.parse().context("--prompt")?,
            "--repeat" => o.repeat = value()?.parse().context("--repeat")?,
            "--json" => o.json = Some(value()?.into()),
            other => bail!("bench-gpu: unknown option {other:?}"),
        }
    }
    if o.models.is_empty() {
        bail!("bench-gpu: name at least one model with --gguf FILE");
    }
    if o.tokens == 0 || o.repeat == 0 {
        bail!("bench-gpu: --tokens and --repeat must be positive");
    }
    Ok(o)
}

pub fn run(args: &[String]) -> Result<()> {
    let o = parse(args)?;
    let device = Device::open(0).map_err(|e| anyhow::anyhow!("bench-gpu needs a GPU: {e}"))?;
    let copy_gbs = copy_bandwidth(&device)?;
    println!(
        "device: {} ({}), device-to-device copy {:.0} GB/s (read + write)",
        device.name(),
        device.arch(),
        copy_gbs
    );
    let mut rows = Vec::new();
    for path in &o.models {
        let ours = ours(path, o.tokens, o.prompt, o.repeat)?;
        let theirs = match &o.llama_bench {
            Some(bench) => Some(llama_bench(bench, path, o.tokens, o.prompt, o.repeat)?),
            None => None,
        };
        let name = path
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into());
        let gbs = ours.weight_bytes as f64 * ours.tokens_per_s / 1e9;
        let mut tests = vec![(
            format!("tg{}", o.tokens),
            ours.tokens_per_s,
            ours.runs.clone(),
            theirs.map(|t| t.tg),
            format!(
                "weights {:.2} GB -> {gbs:.0} GB/s ({:.0}% of copy)",
                ours.weight_bytes as f64 / 1e9,
                100.0 * gbs / copy_gbs
            ),
        )];
        if let Some((pp, runs)) = &ours.prompt {
            // Two operations per weight and token.
            let tflops = 2.0 * ours.weight_values as f64 * pp / 1e12;
            tests.push((
                format!("pp{}", o.prompt),
                *pp,
                runs.clone(),
                theirs.and_then(|t| t.pp),
                format!("{tflops:.0} TFLOP/s in the products"),
            ));
        }
        for (test, tokens_per_s, runs, llama, note) in tests {
            println!(
                "{name:<32} {test:<6} ours {:>8.1} t/s  llama.cpp {:>10}  ratio {:>6}  {note}",
                tokens_per_s,
                llama.map_or_else(|| "-".into(), |t| format!("{t:.1} t/s")),
                llama.map_or_else(|| "-".into(), |t| format!("{:.2}x", tokens_per_s / t)),
            );
            rows.push(json!({
                "model": path.display().to_string(),
                "test": test,
                "ours_tokens_per_s": tokens_per_s,
                "ours_runs": runs,
                "llama_cpp_tokens_per_s": llama,
                "ratio": llama.map(|t| tokens_per_s / t),
                "weight_bytes": ours.weight_bytes,
                "achieved_gb_per_s": gbs,
                "copy_gb_per_s": copy_gbs,
            }));
        }
    }
    if let Some(out) = &o.json {
        let doc = json!({ "device": device.name(), "results": rows });
        std::fs::write(out, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

struct Ours {
    tokens_per_s: f64,
    runs: Vec<f64>,
    weight_bytes: u64,
    /// Values of the weight matrices (two operations each per token).
    weight_values: u64,
    /// Prompt tokens/s (median) and every run's.
    prompt: Option<(f64, Vec<f64>)>,
}

/// llama-bench's figures for one model.
#[derive(Clone, Copy)]
struct Theirs {
    tg: f64,
    pp: Option<f64>,
}

fn ours(path: &Path, tokens: usize, prompt: usize, repeat: usize) -> Result<Ours> {
    let store = TensorStore::open(path).with_context(|| format!("opening {}", path.display()))?;
    let model = Model::load(&store).with_context(|| format!("{}", path.display()))?;
    let weight_bytes = model.plan().handles().iter().map(|h| h.size()).sum();
    let weight_values = model
        .plan()
        .handles()
        .iter()
        // The layers' matrices: every prompt token meets them (the output matrix only
        // the last token, the embeddings none).
        .filter(|h| h.shape().len() == 2 && h.name().starts_with("blk."))
        .map(|h| h.shape().iter().product::<u64>())
        .sum();
    let options = GpuOptions {
        device: 0,
        mode: UploadMode::Eager,
        budget: None,
        context_size: tokens.max(prompt) + 1,
    };
    let mut gpu = GpuModel::new(&model, &options).context("setting the model up on the GPU")?;
    // Warm-up: every weight used once (and the decode step captured).
    let mut token = gpu.forward_argmax(&[1])?;
    for _ in 0..3 {
        token = gpu.forward_argmax(&[token])?;
    }
    let median = |runs: &[f64]| {
        let mut sorted = runs.to_vec();
        sorted.sort_by(f64::total_cmp);
        sorted[sorted.len() / 2]
    };
    let mut runs = Vec::new();
    for _ in 0..repeat {
        gpu.clear()?;
        let start = Instant::now();
        let mut token = 1;
        for _ in 0..tokens {
            token = gpu.forward_argmax(&[token])?;
        }
        runs.push(tokens as f64 / start.elapsed().as_secs_f64());
    }
    // A prompt of `prompt` tokens in one call, as llama-bench's pp test feeds it.
    let prompt_result = if prompt > 0 {
        let n_vocab = model.config().n_vocab as u64;
        let ids: Vec<u32> = (0..prompt as u64)
            .map(|i| (1 + (i * 7919) % (n_vocab - 1)) as u32)
            .collect();
        gpu.clear()?;
        gpu.forward_argmax(&ids)?;
        let mut pp_runs = Vec::new();
        for _ in 0..repeat {
            gpu.clear()?;
            let start = Instant::now();
            gpu.forward_argmax(&ids)?;
            pp_runs.push(prompt as f64 / start.elapsed().as_secs_f64());
        }
        Some((median(&pp_runs), pp_runs))
    } else {
        None
    };
    Ok(Ours {
        tokens_per_s: median(&runs),
        runs,
        weight_bytes,
        weight_values,
        prompt: prompt_result,
    })
}

/// llama-bench's average tokens/s for `-n tokens` (generation after an empty context)
/// and, unless `prompt` is 0, `-p prompt` (one batch of prompt tokens), all layers on
/// the GPU.
fn llama_bench(
    bench: &Path,
    model: &Path,
    tokens: usize,
    prompt: usize,
    repeat: usize,
) -> Result<Theirs> {
    let output = Command::new(bench)
        .args(["-m"])
        .arg(model)
        .args([
            "-ngl",
            "99",
            "-p",
            &prompt.to_string(),
            "-n",
            &tokens.to_string(),
        ])
        .args(["-r", &repeat.to_string(), "-o", "json"])
        .output()
        .with_context(|| format!("running {}", bench.display()))?;
    if !output.status.success() {
        bail!(
            "{} failed: {}",
            bench.display(),
            String::from_utf8_lossy(&output.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
    }
    let doc: Value = serde_json::from_slice(&output.stdout).context("llama-bench's JSON")?;
    let runs = doc.as_array().context("llama-bench's JSON is not a list")?;
    // Each test is one entry: n_prompt > 0 for the prompt test, n_gen > 0 for generation.
    let find = |key: &str| {
        runs.iter()
            .find(|r| r[key].as_u64().is_some_and(|n| n > 0))
            .and_then(|r| r["avg_ts"].as_f64())
    };
    Ok(Theirs {
        tg: find("n_gen").context("llama-bench printed no generation test")?,
        pp: if prompt > 0 {
            Some(find("n_prompt").context("llama-bench printed no prompt test")?)
        } else {
            None
        },
    })
}

/// Device-to-device copy bandwidth (bytes read plus bytes written per second), the
/// practical ceiling of a kernel that streams its weights.
fn copy_bandwidth(device: &Device) -> Result<f64> {
    let len = 1usize << 30;
    let src = device.alloc::<u8>(len)?;
    let mut dst = device.alloc::<u8>(len)?;
    let stream = device.new_stream()?;
    let start = device.new_event()?;
    let end = device.new_event()?;
    stream.copy_d2d_async(src.view(), dst.view_mut())?;
    start.record(&stream)?;
    for _ in 0..5 {
        stream.copy_d2d_async(src.view(), dst.view_mut())?;
    }
    end.record(&stream)?;
    end.synchronize()?;
    let ms = f64::from(end.elapsed_ms_since(&start)?);
    Ok(5.0 * 2.0 * len as f64 / (ms / 1e3) / 1e9)
}
