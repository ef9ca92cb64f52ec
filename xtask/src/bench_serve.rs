//! `cargo xtask bench-serve`: `rocmforge serve` under a bounded concurrency sweep.
//!
//! Starts the server on a free loopback port, then for each number of clients (1, 8 and
//! 32 by default) sends streamed completions of a 128-token prompt and 128 generated
//! tokens with the official `openai` client (`xtask/scripts/bench_serve.py`): 4 per
//! client by default (`--requests N`: N per level), so that each client sends several
//! in a row and most of the run has every client streaming, not only the ramp-up of the
//! connections and the prompts. It reports time to first token (p50, p99), time per
//! output token, aggregate tokens/s over the whole run, the output tokens/s of the
//! steady state (while every client streams), and from the server's `/metrics` how much
//! of the wall time its scheduler spent in steps and in the model's forward passes (the
//! rest of the wall time the scheduler waited for requests: time spent in HTTP, in the
//! client, or on the CPU they share), and a step's host work (its time outside the
//! forward pass) by part. The clients are threads of several Python
//! processes, 8 at most in each (`--clients-per-process`): the `openai` client spends a
//! few hundred microseconds of CPU on each streamed chunk under one interpreter lock per
//! process, so 32 streams in one process cap the tokens/s of a fast server by
//! themselves; the client's CPU time per chunk is printed. With `--llama-batched-bench PATH`, llama.cpp's engine-level reference for the
//! same model, shapes and threads is run in the same invocation, and its aggregate
//! tokens/s (prompt and generated tokens of all sequences over the whole run) is printed
//! beside ours with the ratio (ours / llama.cpp, above 1 when we are faster).
//!
//! `--device gpu` serves on the GPU (and runs llama.cpp with every layer there, with
//! flash attention); the default is the CPU. `--devices LIST` and `--split-mode MODE`
//! go to the server as they are: `--devices 0,1` serves on two GPUs (a copy of the
//! model on each when it fits each); llama.cpp's reference keeps its own defaults (on
//! a machine with several GPUs, its layers split over all of them). `--python PATH` runs the client with an
//! interpreter that already has `openai` (on a machine without the package registry)
//! instead of the pinned virtual environment made under `target/`.
//!
//! `--constrained json_schema` (or `grammar`) runs every level twice with the same
//! clients: unconstrained, then with every request held to a nested JSON schema
//! (`response_format`) or a Lark grammar, and reports both levels' tokens/s, their ratio,
//! and the grammar mask's cost per token, p50 and p99, from the bucket deltas of the
//! server's `rocmforge_constraint_mask_seconds` histogram over the constrained run
//! (interpolated within a bucket, as Prometheus' `histogram_quantile` does, so only as
//! fine as the buckets), and warns when a level generated more constrained tokens than
//! the server computed masks. On a GPU the server computes the masks while the device
//! runs the step; on the CPU, after the forward pass and before the sampler.
//!
//! The two do not measure quite the same thing: ours is end to end, through HTTP and the
//! Python client (which shares the CPU), requests arriving as clients are free;
//! `llama-batched-bench` runs exactly one batch of N sequences inside the library.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

use crate::fetch::{models_dir, SMOLLM2};

struct Options {
    rocmforge: Option<PathBuf>,
    gguf: Option<PathBuf>,
    clients: Vec<usize>,
    /// Requests per level; `None`: 4 per client.
    requests: Option<usize>,
    /// Most client threads in one Python process.
    clients_per_process: usize,
    prompt_tokens: usize,
    gen_tokens: usize,
    threads: Option<usize>,
    llama_batched_bench: Option<PathBuf>,
    python: Option<PathBuf>,
    gpu: bool,
    /// `--devices` and `--split-mode`, passed to the server as they are.
    devices: Option<String>,
    split_mode: Option<String>,
    json: bool,
    /// `json_schema` or `grammar`: each level also run with that constraint.
    constrained: Option<String>,
}

fn parse_options(args: &[String]) -> Result<Options> {
    let mut o = Options {
        rocmforge: None,
        gguf: None,
        clients: vec![1, 8, 32],
        requests: None,
        clients_per_process: 8,
        prompt_tokens: 128,
        gen_tokens: 128,
        threads: None,
        llama_batched_bench: None,
        python: None,
        gpu: false,
        devices: None,
        split_mode: None,
        json: false,
        constrained: None,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--rocmforge" => o.rocmforge = Some(value()?.into()),
            "--gguf" => o.gguf = Some(value()?.into()),
            "--clients" => {
                o.clients = value()?
                    .split(',')
                    .map(|c| {
                        c.trim()
                            .parse()
                            .context("--clients: numbers, comma-separated")
                    })
                    .collect::<Result<_>>()?
            }
            "--requests" => o.requests = Some(value()?.parse().context("--requests")?),
            "--clients-per-process" => {
                o.clients_per_process = value()?.parse().context("--clients-per-process")?
            }
            "--prompt-tokens" => o.prompt_tokens = value()?.parse().context("--prompt-tokens")?,
            "--gen-tokens" => o.gen_tokens = value()?.parse().context("--gen-tokens")?,
            "--threads" => o.threads = Some(value()?.parse().context("--threads")?),
            "--llama-batched-bench" => o.llama_batched_bench = Some(value()?.into()),
            "--python" => o.python = Some(value()?.into()),
            "--device" => {
                o.gpu = match value()?.as_str() {
                    "cpu" => false,
                    "gpu" => true,
                    other => bail!("--device: cpu or gpu, not {other:?}"),
                }
            }
            "--devices" => o.devices = Some(value()?.clone()),
            "--split-mode" => o.split_mode = Some(value()?.clone()),
            "--json" => o.json = true,
            "--constrained" => {
                let kind = value()?;
                ensure!(
                    ["json_schema", "grammar"].contains(&kind.as_str()),
                    "--constrained: json_schema or grammar, not {kind:?}"
                );
                o.constrained = Some(kind.clone());
            }
            other => bail!("bench-serve: unknown option {other:?}"),
        }
    }
    ensure!(
        o.gpu || (o.devices.is_none() && o.split_mode.is_none()),
        "--devices and --split-mode need --device gpu"
    );
    // Bounded: a benchmark never runs away with the machine.
    ensure!(
        !o.clients.is_empty() && o.clients.iter().all(|&c| (1..=256).contains(&c)),
        "--clients: between 1 and 256 each"
    );
    ensure!(
        (1..=256).contains(&o.clients_per_process),
        "--clients-per-process: between 1 and 256"
    );
    ensure!(
        o.requests.is_none_or(|r| (1..=4096).contains(&r)),
        "--requests: between 1 and 4096"
    );
    ensure!(
        o.prompt_tokens > 0 && o.gen_tokens > 0 && o.prompt_tokens + o.gen_tokens <= 8192,
        "--prompt-tokens and --gen-tokens: positive, 8192 together at most"
    );
    Ok(o)
}

/// `--rocmforge`, or the release binary, built now.
fn binary(o: &Options) -> Result<PathBuf> {
    if let Some(path) = &o.rocmforge {
        return Ok(path.clone());
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--release", "-p", "rocmforge"])
        .current_dir(crate::workspace_root())
        .status()
        .context("building rocmforge")?;
    ensure!(status.success(), "cargo build failed ({status})");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::workspace_root().join("target"));
    Ok(target.join("release/rocmforge"))
}

/// Stops the server when dropped, whatever happened.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

pub fn run(args: &[String]) -> Result<()> {
    let o = parse_options(args)?;
    let model = o
        .gguf
        .clone()
        .unwrap_or_else(|| models_dir().join(SMOLLM2.file_name));
    ensure!(
        model.exists(),
        "{} is missing: run `cargo xtask fetch-models` or pass --gguf",
        model.display()
    );
    let rocmforge = binary(&o)?;
    let python = match &o.python {
        Some(python) => python.clone(),
        None => crate::openai_client::python()?,
    };
    // The same thread count on both sides, also when none was asked for (the server's
    // default is one per core, llama.cpp's is its own).
    let threads = match o.threads {
        Some(t) => t,
        None => std::thread::available_parallelism().map_or(1, usize::from),
    };
    let (server, base) = start_server(&rocmforge, &model, &o, threads)?;
    let model_id = model
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("model")
        .trim_end_matches(".gguf")
        .to_owned();
    let output = run_client(&python, &base, &model_id, &o)?;
    drop(server);
    ensure!(
        output.status.success(),
        "the benchmark client failed ({})",
        output.status
    );
    let lines: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .context("the benchmark client's output")?;
    let (constrained, ours): (Vec<Value>, Vec<Value>) = lines
        .into_iter()
        .partition(|level| level["phase"] == "constrained");
    let constrained = o
        .constrained
        .as_ref()
        .map(|_| compare_constrained(&ours, &constrained));
    let llama = match &o.llama_batched_bench {
        Some(path) => Some(llama_batched_bench(path, &model, &o, threads)?),
        None => None,
    };
    let comparison = llama.as_ref().map(|rows| compare_llama(&ours, rows));
    let report = json!({
        "model": model_id,
        "prompt_tokens": o.prompt_tokens,
        "gen_tokens": o.gen_tokens,
        "threads": threads,
        "rocmforge": ours,
        "llama_batched_bench": llama,
        "comparison": comparison,
        "constraint": o.constrained,
        "constrained": constrained,
    });
    if o.json {
        println!("{report:#}");
    } else {
        print_table(&report);
        if let Some(rows) = &constrained {
            print_constrained(o.constrained.as_deref().unwrap_or("?"), rows);
        }
    }
    let failures: u64 = ours
        .iter()
        .chain(constrained.iter().flatten())
        .filter_map(|l| l["n_failures"].as_u64())
        .sum();
    ensure!(failures == 0, "{failures} requests failed");
    Ok(())
}

/// Starts `rocmforge serve` on a free loopback port, sized for the largest level and
/// with `threads` threads; returns it and the address it listens on.
fn start_server(
    rocmforge: &Path,
    model: &Path,
    o: &Options,
    threads: usize,
) -> Result<(Server, String)> {
    let max_clients = o.clients.iter().copied().max().unwrap_or(1);
    let context = o.prompt_tokens + o.gen_tokens;

    let mut command = Command::new(rocmforge);
    command
        .arg("serve")
        .arg("--gguf")
        .arg(model)
        .args(["--host", "127.0.0.1", "--port", "0"])
        .args(["--max-sequences", &max_clients.to_string()])
        .args([
            "--max-queue",
            &o.requests
                .unwrap_or(4 * max_clients)
                .max(max_clients)
                .to_string(),
        ])
        .args(["--device", if o.gpu { "gpu" } else { "cpu" }])
        .args(["--ctx-size", &context.to_string()])
        .args(["--kv-pool", &(context * max_clients).to_string()])
        .stderr(Stdio::piped());
    command.args(["--threads", &threads.to_string()]);
    if let Some(devices) = &o.devices {
        command.args(["--devices", devices]);
    }
    if let Some(mode) = &o.split_mode {
        command.args(["--split-mode", mode]);
    }
    let mut server = Server(command.spawn().context("starting rocmforge serve")?);
    let stderr = server.0.stderr.take().context("the server's stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    let base = loop {
        let Some(line) = lines.next() else {
            bail!("the server exited before listening");
        };
        let line = line?;
        if let Some(addr) = line.strip_prefix("listening on ") {
            break addr.trim().to_owned();
        }
    };
    // Keep reading the server's stderr so that it never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    Ok((server, base))
}

/// Runs the benchmark client against the server at `base`, every level in turn; its
/// standard output holds one JSON line a level.
fn run_client(
    python: &Path,
    base: &str,
    model_id: &str,
    o: &Options,
) -> Result<std::process::Output> {
    let levels = o
        .clients
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let script = crate::workspace_root().join("xtask/scripts/bench_serve.py");
    Command::new(python)
        .arg(&script)
        .args([base, model_id, &levels])
        .args([
            // 0: 4 per client.
            o.requests.unwrap_or(0).to_string(),
            o.prompt_tokens.to_string(),
            o.gen_tokens.to_string(),
            o.clients_per_process.to_string(),
            o.constrained.clone().unwrap_or_else(|| "none".into()),
        ])
        .stderr(Stdio::inherit())
        .output()
        .context("running the benchmark client")
}

/// Each level's aggregate tokens/s beside llama-batched-bench's for as many sequences
/// (`rows`), with their ratio.
fn compare_llama(ours: &[Value], rows: &[Value]) -> Vec<Value> {
    ours.iter()
        .map(|level| {
            let theirs = rows
                .iter()
                .find(|r| r["pl"] == level["clients"])
                .and_then(|r| r["speed"].as_f64());
            let mine = level["total_tokens_per_s"].as_f64();
            json!({
                "clients": level["clients"],
                "rocmforge_tokens_per_s": mine,
                "llama_cpp_tokens_per_s": theirs,
                "ratio": mine.zip(theirs).map(|(m, t)| m / t),
            })
        })
        .collect()
}

/// llama.cpp's `llama-batched-bench` on the same model and shapes: one line per
/// parallel-sequence count, with its prompt and generation speeds.
fn llama_batched_bench(
    path: &Path,
    model: &Path,
    o: &Options,
    threads: usize,
) -> Result<Vec<Value>> {
    let threads = threads.to_string();
    // On the GPU, every layer there and flash attention, as `bench-gpu` runs it.
    let extra: &[&str] = if o.gpu {
        &["-ngl", "99", "-fa", "on"]
    } else {
        &["-t", &threads, "-tb", &threads]
    };
    run_llama_batched_bench(
        path,
        model,
        o.prompt_tokens,
        o.gen_tokens,
        &o.clients,
        extra,
    )
}

/// Runs `llama-batched-bench` for `levels` parallel sequences of `prompt_tokens` +
/// `gen_tokens` each, with `extra` arguments, and returns its JSON lines (`pl`,
/// `speed_pp`, `speed_tg`, `speed`, …), one per level.
pub(crate) fn run_llama_batched_bench(
    path: &Path,
    model: &Path,
    prompt_tokens: usize,
    gen_tokens: usize,
    levels: &[usize],
    extra: &[&str],
) -> Result<Vec<Value>> {
    let max = levels.iter().copied().max().unwrap_or(1);
    let levels = levels
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut command = Command::new(path);
    command
        .arg("-m")
        .arg(model)
        .args(["-c", &((prompt_tokens + gen_tokens) * max).to_string()])
        .args(["-npp", &prompt_tokens.to_string()])
        .args(["-ntg", &gen_tokens.to_string()])
        .args(["-npl", &levels])
        .args(["--output-format", "jsonl"])
        .args(extra);
    let output = command
        .output()
        .with_context(|| format!("running {}", path.display()))?;
    ensure!(
        output.status.success(),
        "llama-batched-bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("pl").is_some())
        .collect())
}

fn print_table(report: &Value) {
    let num = |v: &Value| {
        v.as_f64()
            .map_or_else(|| "-".to_owned(), |x| format!("{x:.1}"))
    };
    println!(
        "{} — prompt {} + generated {} tokens per request, {} threads",
        report["model"].as_str().unwrap_or("?"),
        report["prompt_tokens"],
        report["gen_tokens"],
        report["threads"]
    );
    println!(
        "{:>7} {:>8} {:>12} {:>12} {:>12} {:>12} {:>12} {:>15} {:>7} {:>14}",
        "clients",
        "requests",
        "ttft p50 ms",
        "ttft p99 ms",
        "tpot p50 ms",
        "out tok/s",
        "total tok/s",
        "llama total t/s",
        "ratio",
        "llama S_TG t/s"
    );
    let llama = report["llama_batched_bench"].as_array();
    for level in report["rocmforge"].as_array().into_iter().flatten() {
        let row = llama.and_then(|rows| rows.iter().find(|r| r["pl"] == level["clients"]));
        let field = |name: &str| row.map_or(Value::Null, |r| r[name].clone());
        let ratio = level["total_tokens_per_s"]
            .as_f64()
            .zip(field("speed").as_f64())
            .map_or_else(|| "-".to_owned(), |(m, t)| format!("{:.2}x", m / t));
        println!(
            "{:>7} {:>8} {:>12} {:>12} {:>12} {:>12} {:>12} {:>15} {:>7} {:>14}",
            level["clients"].as_u64().unwrap_or(0),
            level["completed"].as_u64().unwrap_or(0),
            num(&level["ttft_p50_ms"]),
            num(&level["ttft_p99_ms"]),
            num(&level["tpot_p50_ms"]),
            num(&level["output_tokens_per_s"]),
            num(&level["total_tokens_per_s"]),
            num(&field("speed")),
            ratio,
            num(&field("speed_tg")),
        );
    }
    if llama.is_some() {
        println!(
            "total t/s: prompt and generated tokens of every request over the wall time; \
             ratio: ours / llama-batched-bench (one batch of N sequences, in-process)"
        );
    }
    println!();
    println!(
        "{:>7} {:>8} {:>16} {:>8} {:>12} {:>12} {:>12} {:>8} {:>8} {:>15}",
        "clients",
        "wall s",
        "steady out t/s",
        "steps",
        "tok/step",
        "step ms",
        "forward ms",
        "step %",
        "fwd %",
        "client us/chunk"
    );
    let pct = |v: &Value| {
        v.as_f64()
            .map_or_else(|| "-".to_owned(), |x| format!("{:.1}", 100.0 * x))
    };
    for level in report["rocmforge"].as_array().into_iter().flatten() {
        println!(
            "{:>7} {:>8} {:>16} {:>8} {:>12} {:>12} {:>12} {:>8} {:>8} {:>15}",
            level["clients"].as_u64().unwrap_or(0),
            num(&level["wall_s"]),
            num(&level["steady_output_tokens_per_s"]),
            level["steps"].as_u64().unwrap_or(0),
            num(&level["tokens_per_step"]),
            num(&level["step_ms_mean"]),
            num(&level["forward_ms_mean"]),
            pct(&level["step_share"]),
            pct(&level["forward_share"]),
            num(&level["client_cpu_us_per_chunk"]),
        );
    }
    println!(
        "steady: while every client streams; step % / fwd %: the scheduler's time in steps / \
         in forward passes, of the wall time (from the server's /metrics; summed over the \
         schedulers of a server with a copy of the model on each of several GPUs)"
    );
    println!();
    println!(
        "{:>7} {:>12} {:>10} {:>12} {:>10} {:>11}",
        "clients", "host ms", "admit", "schedule", "sample", "deliver"
    );
    let ms = |v: &Value| {
        v.as_f64()
            .map_or_else(|| "-".to_owned(), |x| format!("{x:.3}"))
    };
    for level in report["rocmforge"].as_array().into_iter().flatten() {
        println!(
            "{:>7} {:>12} {:>10} {:>12} {:>10} {:>11}",
            level["clients"].as_u64().unwrap_or(0),
            ms(&level["host_ms_mean"]),
            ms(&level["admit_ms_mean"]),
            ms(&level["schedule_ms_mean"]),
            ms(&level["sample_ms_mean"]),
            ms(&level["deliver_ms_mean"]),
        );
    }
    println!(
        "host ms: a step's mean time outside its forward pass, and its parts (/metrics' \
         rocmforge_step_phase_seconds_total)"
    );
}

/// Per level, the constrained run beside the unconstrained one: tokens/s of each, their
/// ratio, and the mask's cost per token from the histogram's bucket deltas.
fn compare_constrained(plain: &[Value], constrained: &[Value]) -> Vec<Value> {
    constrained
        .iter()
        .map(|c| {
            let p = plain.iter().find(|p| p["clients"] == c["clients"]);
            let field = |level: Option<&Value>, name: &str| level.and_then(|l| l[name].as_f64());
            let ratio = |name: &str| field(Some(c), name).zip(field(p, name)).map(|(c, p)| c / p);
            let buckets: Vec<(f64, u64)> = c["mask_buckets"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|b| Some((b[0].as_f64()?, b[1].as_u64()?)))
                .collect();
            let count = c["mask_count"].as_u64().unwrap_or(0);
            let us = |q: f64| bucket_quantile(&buckets, count, q).map(|s| s * 1e6);
            json!({
                "clients": c["clients"],
                "requests": c["completed"],
                "tokens_per_request": field(Some(c), "output_tokens_per_s")
                    .zip(field(Some(c), "wall_s"))
                    .zip(c["completed"].as_f64().filter(|&n| n > 0.0))
                    .map(|((tps, wall), n)| tps * wall / n),
                "plain_output_tokens_per_s": field(p, "output_tokens_per_s"),
                "constrained_output_tokens_per_s": field(Some(c), "output_tokens_per_s"),
                "output_ratio": ratio("output_tokens_per_s"),
                "plain_total_tokens_per_s": field(p, "total_tokens_per_s"),
                "constrained_total_tokens_per_s": field(Some(c), "total_tokens_per_s"),
                "total_ratio": ratio("total_tokens_per_s"),
                "plain_tpot_p50_ms": field(p, "tpot_p50_ms"),
                "constrained_tpot_p50_ms": field(Some(c), "tpot_p50_ms"),
                "masks": count,
                "generated": c["output_tokens"],
                "mask_mean_us": c["mask_sum_s"]
                    .as_f64()
                    .filter(|_| count > 0)
                    .map(|s| s / count as f64 * 1e6),
                "mask_p50_us": us(0.5),
                "mask_p99_us": us(0.99),
                "plain_sample_ms_mean": field(p, "sample_ms_mean"),
                "constrained_sample_ms_mean": field(Some(c), "sample_ms_mean"),
            })
        })
        .collect()
}

/// The `q` quantile (0 to 1) of what a histogram counted, from its cumulative
/// `(upper bound, observations at or below it)` buckets, bounds ascending, and `total`,
/// every observation (those above the last bound included): interpolated linearly
/// within the bucket that holds it, the first from 0, as Prometheus'
/// `histogram_quantile` does; the last bound when it lies above every bound. `None`
/// when nothing was counted.
pub(crate) fn bucket_quantile(buckets: &[(f64, u64)], total: u64, q: f64) -> Option<f64> {
    if total == 0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let (mut lower, mut below) = (0.0, 0u64);
    for &(bound, count) in buckets {
        if count as f64 >= rank && count > below {
            let share = (rank - below as f64) / (count - below) as f64;
            return Some(lower + (bound - lower) * share);
        }
        (lower, below) = (bound, count);
    }
    buckets.last().map(|&(bound, _)| bound)
}

fn print_constrained(kind: &str, rows: &[Value]) {
    let num = |v: &Value, digits: usize| {
        v.as_f64()
            .map_or_else(|| "-".to_owned(), |x| format!("{x:.digits$}"))
    };
    println!();
    println!("constrained ({kind}) beside unconstrained, same clients and prompts:");
    println!(
        "{:>7} {:>8} {:>9} {:>11} {:>11} {:>7} {:>11} {:>11} {:>7} {:>9} {:>9} {:>9} {:>9}",
        "clients",
        "requests",
        "tok/req",
        "plain out/s",
        "cons. out/s",
        "ratio",
        "plain tot/s",
        "cons. tot/s",
        "ratio",
        "masks",
        "mean us",
        "p50 us",
        "p99 us"
    );
    for r in rows {
        println!(
            "{:>7} {:>8} {:>9} {:>11} {:>11} {:>7} {:>11} {:>11} {:>7} {:>9} {:>9} {:>9} {:>9}",
            r["clients"].as_u64().unwrap_or(0),
            r["requests"].as_u64().unwrap_or(0),
            num(&r["tokens_per_request"], 1),
            num(&r["plain_output_tokens_per_s"], 1),
            num(&r["constrained_output_tokens_per_s"], 1),
            num(&r["output_ratio"], 2),
            num(&r["plain_total_tokens_per_s"], 1),
            num(&r["constrained_total_tokens_per_s"], 1),
            num(&r["total_ratio"], 2),
            r["masks"].as_u64().unwrap_or(0),
            num(&r["mask_mean_us"], 1),
            num(&r["mask_p50_us"], 1),
            num(&r["mask_p99_us"], 1),
        );
    }
    for r in rows {
        let (masks, generated) = (r["masks"].as_u64(), r["generated"].as_u64());
        if let (Some(masks), Some(generated)) = (masks, generated) {
            if masks < generated {
                println!(
                    "WARNING: {} clients: {generated} tokens generated under the grammar \
                     but only {masks} masks: some constrained tokens were not masked",
                    r["clients"]
                );
            }
        }
    }
    println!(
        "out/s: generated tokens/s, tot/s: with the prompts', over the wall time; ratio: \
         constrained / unconstrained. Mask: the grammar's token mask, once per generated \
         token (at least as many masks as tokens), timed in the server \
         (rocmforge_constraint_mask_seconds); p50/p99 are interpolated within its buckets \
         (10 us to 100 ms), the mean is exact. On a GPU the masks are computed while the \
         device runs the step; on the CPU, between the forward pass and the sampler. Constrained requests end where the format does (tok/req), unconstrained \
         ones run the full --gen-tokens."
    );
}

#[cfg(test)]
mod tests {
    use super::bucket_quantile;

    #[test]
    fn quantiles_interpolate_within_the_bucket_that_holds_them() {
        // 100 observations: none up to 10 us, 50 up to 25 us, 40 more up to 50 us, the
        // last 10 up to 100 us.
        let buckets = [(1e-5, 0), (2.5e-5, 50), (5e-5, 90), (1e-4, 100)];
        let q = |q| bucket_quantile(&buckets, 100, q).unwrap();
        assert!((q(0.5) - 2.5e-5).abs() < 1e-12);
        assert!((q(0.25) - 1.75e-5).abs() < 1e-12);
        assert!((q(0.99) - 9.5e-5).abs() < 1e-12);
        assert!((q(1.0) - 1e-4).abs() < 1e-12);
        // The first bucket starts at 0.
        assert!((bucket_quantile(&[(1e-5, 4), (2e-5, 4)], 4, 0.5).unwrap() - 5e-6).abs() < 1e-12);
    }

    #[test]
    fn quantiles_above_every_bound_are_the_last_bound_and_nothing_counted_is_none() {
        // 10 observations, 2 of them above the last bound.
        let buckets = [(1e-5, 5), (1e-4, 8)];
        assert_eq!(bucket_quantile(&buckets, 10, 0.99), Some(1e-4));
        assert!((bucket_quantile(&buckets, 10, 0.5).unwrap() - 1e-5).abs() < 1e-12);
        assert_eq!(bucket_quantile(&buckets, 0, 0.5), None);
        assert_eq!(bucket_quantile(&[], 3, 0.5), None);
    }
}
