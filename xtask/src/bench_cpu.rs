//! `cargo xtask bench-cpu`: CPU prefill and decode speed of ROCmForge and llama.cpp,
//! side by side, in one run.
//!
//! For each real model: prefill of 64 and 512 tokens and decode of 128 tokens, with the
//! same thread count for both engines (llama.cpp through `llama-bench`, when its path is
//! given); the wall time of a whole `generate --max-tokens 1` process against
//! `llama-completion -n 1`; and how much resident memory loading costs before the first
//! token. Decode is also given as memory bandwidth: the weight bytes a token reads times
//! the rate, against the machine's own read bandwidth at the same thread count
//! (measured first, [`read_bandwidth`]). Prints a table, and JSON with `--json`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use model::Model;
use serde_json::{json, Value};
use tensor_store::TensorStore;

use crate::fetch::{models_dir, GEMMA3, SMOLLM2};

struct Options {
    threads: usize,
    repetitions: usize,
    llama_bench: Option<PathBuf>,
    llama_completion: Option<PathBuf>,
    rocmforge: Option<PathBuf>,
    json: bool,
    models: Vec<PathBuf>,
}

fn parse_options(args: &[String]) -> Result<Options> {
    let mut o = Options {
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        repetitions: 3,
        llama_bench: None,
        llama_completion: None,
        rocmforge: None,
        json: false,
        models: Vec::new(),
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--threads" => o.threads = value()?.parse().context("--threads")?,
            "--repetitions" => o.repetitions = value()?.parse().context("--repetitions")?,
            "--llama-bench" => o.llama_bench = Some(value()?.into()),
            "--llama-completion" => o.llama_completion = Some(value()?.into()),
            "--rocmforge" => o.rocmforge = Some(value()?.into()),
            "--gguf" => o.models.push(value()?.into()),
            "--json" => o.json = true,
            other => bail!("bench-cpu: unknown option {other:?}"),
        }
    }
    ensure!(
        o.threads > 0 && o.repetitions > 0,
        "threads and repetitions must be positive"
    );
    if o.models.is_empty() {
        let dir = models_dir();
        o.models = vec![dir.join(SMOLLM2.file_name), dir.join(GEMMA3.file_name)];
    }
    if o.llama_completion.is_none() {
        // llama-completion normally sits beside llama-bench.
        o.llama_completion = o
            .llama_bench
            .as_ref()
            .map(|b| b.with_file_name("llama-completion"))
            .filter(|p| p.exists());
    }
    Ok(o)
}

pub fn run(args: &[String]) -> Result<()> {
    let o = parse_options(args)?;
    rayon::ThreadPoolBuilder::new()
        .num_threads(o.threads)
        .build_global()
        .context("sizing the thread pool")?;
    let bandwidth = read_bandwidth();
    eprintln!(
        "this machine reads memory at {:.1} GB/s with {} threads; the products take the {:?} kernels",
        bandwidth / 1e9,
        o.threads,
        dequant::matmul::best_path()
    );
    let mut results = Vec::new();
    for model in &o.models {
        ensure!(
            model.exists(),
            "{} is missing: run `cargo xtask fetch-models`",
            model.display()
        );
        eprintln!(
            "benchmarking {} with {} threads",
            model.display(),
            o.threads
        );
        let mut result = bench_model(model, &o)?;
        result["read_bandwidth_bytes_per_s"] = json!(bandwidth);
        results.push(result);
    }
    if o.json {
        println!("{}", serde_json::to_string_pretty(&Value::Array(results))?);
    } else {
        print_table(&results);
    }
    Ok(())
}

/// Bytes of memory the pool's threads read per second, the best of three passes over a
/// buffer of 1 GiB (far past any cache), each thread summing its share: the ceiling of
/// a decode step, which streams the weights once.
fn read_bandwidth() -> f64 {
    use rayon::prelude::*;
    const BYTES: usize = 1 << 30;
    let buffer: Vec<u64> = (0..BYTES / 8).into_par_iter().map(|i| i as u64).collect();
    let chunk = buffer.len().div_ceil(4 * rayon::current_num_threads());
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let sum = buffer
            .par_chunks(chunk)
            .map(|c| c.iter().fold(0u64, |a, &v| a.wrapping_add(v)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
        best = best.max(BYTES as f64 / t.elapsed().as_secs_f64());
    }
    best
}

/// The weight bytes one decoded token reads: every tensor of the plan once (a mixture's
/// experts, the share a token is routed to), but of token embeddings that are not also
/// the output matrix, one row.
fn decode_bytes(model: &Model) -> u64 {
    let plan = model.plan();
    let embd = plan.token_embd.weight.index();
    let tied = embd == plan.output.weight.index();
    let share = crate::bench_gpu::token_share(model);
    plan.handles()
        .iter()
        .map(|h| {
            if h.index() == embd && !tied {
                h.size() / h.shape().iter().skip(1).product::<u64>().max(1)
            } else {
                (h.size() as f64 * share(h)) as u64
            }
        })
        .sum()
}

/// The process's resident set (0 where `/proc/self/status` does not say).
fn resident_bytes() -> u64 {
    crate::bench_load::measure::rss().map_or(0, |(_, current)| current)
}

/// Deterministic pseudo-random token ids, as llama-bench feeds random tokens.
fn tokens(n: usize, n_vocab: usize, seed: u64) -> Vec<u32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n_vocab as u64) as u32
        })
        .collect()
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

fn bench_model(path: &Path, o: &Options) -> Result<Value> {
    let rss_before = resident_bytes();
    let start = Instant::now();
    let store = TensorStore::open(path)?;
    let model = Model::load(&store)?;
    let tokenizer = model::tokenizer::Tokenizer::from_metadata(store.metadata())?;
    let load_ms = start.elapsed().as_secs_f64() * 1e3;
    let rss_growth = resident_bytes().saturating_sub(rss_before);
    drop(tokenizer);
    let n_vocab = model.config().n_vocab;

    // Warm the page cache and the kernels once, untimed.
    let mut cache = model.new_cache(64);
    model.forward(&tokens(8, n_vocab, 1), &mut cache)?;

    let mut ours = serde_json::Map::new();
    for n in [64usize, 512] {
        let mut rates = Vec::new();
        for r in 0..o.repetitions {
            let prompt = tokens(n, n_vocab, 10 + r as u64);
            let mut cache = model.new_cache(n);
            let t = Instant::now();
            model.forward(&prompt, &mut cache)?;
            rates.push(n as f64 / t.elapsed().as_secs_f64());
        }
        ours.insert(format!("pp{n}"), json!(mean(&rates)));
    }
    let mut rates = Vec::new();
    for r in 0..o.repetitions {
        let mut cache = model.new_cache(129);
        let mut next = tokens(1, n_vocab, 100 + r as u64);
        let t = Instant::now();
        for step in 0..128 {
            let logits = model.forward(&next, &mut cache)?;
            // Feed a token that depends on the output, as generation does.
            next = vec![(logits.len() as u32 + step) % n_vocab as u32];
        }
        rates.push(128.0 / t.elapsed().as_secs_f64());
    }
    ours.insert("tg128".into(), json!(mean(&rates)));

    let llama = match &o.llama_bench {
        Some(bench) => llama_bench(bench, path, o)?,
        None => Value::Null,
    };
    let process = whole_process(path, o)?;
    Ok(json!({
        "model": path.file_name().map(|n| n.to_string_lossy().into_owned()),
        "model_bytes": std::fs::metadata(path)?.len(),
        "decode_bytes_per_token": decode_bytes(&model),
        "threads": o.threads,
        "load_ms": load_ms,
        "rss_growth_bytes": rss_growth,
        "rocmforge": ours,
        "llama_cpp": llama,
        "first_token_process": process,
    }))
}

/// `llama-bench -p 64,512 -n 128` as JSON: tokens per second per test.
fn llama_bench(bench: &Path, model: &Path, o: &Options) -> Result<Value> {
    let out = Command::new(bench)
        .arg("-m")
        .arg(model)
        .args(["-t", &o.threads.to_string(), "-p", "64,512", "-n", "128"])
        .args(["-r", &o.repetitions.to_string(), "-o", "json"])
        .output()
        .with_context(|| format!("running {}", bench.display()))?;
    ensure!(
        out.status.success(),
        "llama-bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let runs: Value = serde_json::from_slice(&out.stdout).context("llama-bench JSON")?;
    let mut result = serde_json::Map::new();
    for run in runs.as_array().context("llama-bench JSON is an array")? {
        let (p, n) = (
            run["n_prompt"].as_u64().unwrap_or(0),
            run["n_gen"].as_u64().unwrap_or(0),
        );
        let name = if n > 0 {
            format!("tg{n}")
        } else {
            format!("pp{p}")
        };
        result.insert(name, run["avg_ts"].clone());
    }
    Ok(Value::Object(result))
}

/// Wall time of whole processes that load the model and produce one token.
fn whole_process(model: &Path, o: &Options) -> Result<Value> {
    let time = |cmd: &mut Command| -> Result<Vec<f64>> {
        let mut walls = Vec::new();
        for _ in 0..o.repetitions {
            let t = Instant::now();
            let out = cmd.output().context("running a first-token process")?;
            ensure!(
                out.status.success(),
                "{:?} failed: {}",
                cmd,
                String::from_utf8_lossy(&out.stderr)
            );
            walls.push(t.elapsed().as_secs_f64() * 1e3);
        }
        walls.sort_by(f64::total_cmp);
        Ok(walls)
    };
    let ours = match &o.rocmforge {
        Some(bin) => {
            let mut cmd = Command::new(bin);
            cmd.arg("generate").arg("--gguf").arg(model);
            cmd.args([
                "--prompt",
                "Hello",
                "--max-tokens",
                "1",
                "--temperature",
                "0",
            ]);
            cmd.args(["--threads", &o.threads.to_string()]);
            json!(time(&mut cmd)?)
        }
        None => Value::Null,
    };
    let llama = match &o.llama_completion {
        Some(bin) => {
            let mut cmd = Command::new(bin);
            cmd.arg("-m").arg(model);
            cmd.args([
                "-t",
                &o.threads.to_string(),
                "-p",
                "Hello",
                "-n",
                "1",
                "-no-cnv",
            ]);
            json!(time(&mut cmd)?)
        }
        None => Value::Null,
    };
    Ok(json!({ "rocmforge_ms": ours, "llama_cpp_ms": llama }))
}

fn print_table(results: &[Value]) {
    let ratio = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "-".into(),
    };
    let num = |v: &Value| v.as_f64().map_or("-".into(), |x| format!("{x:.1}"));
    for r in results {
        println!(
            "\n{} ({} threads; load {:.0} ms; RSS +{:.1} MiB = {:.1}% of the file)",
            r["model"].as_str().unwrap_or("?"),
            r["threads"],
            r["load_ms"].as_f64().unwrap_or(0.0),
            r["rss_growth_bytes"].as_f64().unwrap_or(0.0) / (1u64 << 20) as f64,
            100.0 * r["rss_growth_bytes"].as_f64().unwrap_or(0.0)
                / r["model_bytes"].as_f64().unwrap_or(1.0)
        );
        println!(
            "  {:<8} {:>12} {:>12} {:>8}",
            "test", "rocmforge", "llama.cpp", "ratio"
        );
        for test in ["pp64", "pp512", "tg128"] {
            let ours = &r["rocmforge"][test];
            let theirs = &r["llama_cpp"][test];
            println!(
                "  {:<8} {:>12} {:>12} {:>8}",
                test,
                num(ours),
                num(theirs),
                ratio(ours, theirs)
            );
        }
        // Decode as bandwidth: the weights a token reads times the rate, and that as a
        // share of what this machine's threads can read.
        let per_token = r["decode_bytes_per_token"].as_f64().unwrap_or(0.0);
        let machine = r["read_bandwidth_bytes_per_s"].as_f64().unwrap_or(0.0);
        let bandwidth = |v: &Value| {
            v.as_f64().map_or("-".into(), |tg| {
                let bytes = tg * per_token;
                format!("{:.1} GB/s ({:.0}%)", bytes / 1e9, 100.0 * bytes / machine)
            })
        };
        println!(
            "  tg128 reads {:.0} MB a token: ours {}, llama.cpp {}, of the machine's {:.1} GB/s",
            per_token / 1e6,
            bandwidth(&r["rocmforge"]["tg128"]),
            bandwidth(&r["llama_cpp"]["tg128"]),
            machine / 1e9
        );
        let p = &r["first_token_process"];
        let median = |v: &Value| {
            v.as_array()
                .and_then(|a| a.get(a.len() / 2))
                .cloned()
                .unwrap_or(Value::Null)
        };
        println!(
            "  {:<8} {:>12} {:>12} {:>8}   (whole process to one token, median ms; ratio < 1 is faster)",
            "1-token",
            num(&median(&p["rocmforge_ms"])),
            num(&median(&p["llama_cpp_ms"])),
            ratio(&median(&p["rocmforge_ms"]), &median(&p["llama_cpp_ms"]))
        );
    }
}
