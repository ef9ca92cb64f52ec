//! `cargo xtask bench-gpu`: decode speed on a GPU, ROCmForge beside llama.cpp's CUDA or
//! HIP build, in one run, on the same files.
//!
//! For each model: tg N (default 128), the tokens/s of decoding N tokens one at a time
//! after an empty context, as `llama-bench -n N -p 0` measures it; ours through the
//! library (`GpuModel`, weights resident, greedy tokens chosen on the device and fed
//! back), the median of `--repeat` runs. It prints both, the ratio, and our achieved
//! memory bandwidth: the bytes of every weight read once per token (of a mixture of
//! experts' expert tensors, the share of the experts a token is routed to), times
//! tokens/s, against the device's measured copy bandwidth. Then pp N (`--prompt`, default 512; 0
//! skips it): the tokens/s of one N-token prompt in one call, as `llama-bench -p N`
//! measures it, and the arithmetic rate of the layers' products it implies.
//!
//! With `--parallel 8,32,64`: batched decoding, as `llama-batched-bench -npp P -ntg T
//! -npl 8,32,64` measures it (`--npp`, `--ntg`, default 128 each): N sequences' prompts
//! run together (`GpuModel::forward_batch`, batches of up to 512 tokens over one paged
//! KV cache), then T steps that each decode one token of every sequence, greedy on the
//! device. It prints the prompt, generation and overall tokens/s of all sequences
//! together (S_PP, S_TG, S), beside `llama-batched-bench`'s (`--llama-batched-bench
//! PATH`, run with every layer on the GPU, flash attention on, `-b 2048 -ub 512`).
//! The decoding steps replay a graph captured per number of sequences;
//! `--no-batch-graphs` queues their launches one by one (for comparisons).
//!
//! With `--budgets 25,50,75`: the same tg and pp with the weights' device budget
//! (`GpuOptions::budget`) at those percentages of the model's size, beside `llama-bench`
//! with `-ngl` at the same share of the layers (rounded). The layers the budget does not
//! hold are computed on the host while decoding and streamed through the budget's room for
//! a prompt; llama.cpp computes its other layers on the CPU.
//!
//! With `--cpu-moe 12,24,36,48` (a mixture of experts): tg and pp with the weights'
//! budget at what llama.cpp's `-ncmoe N` keeps on the GPU (every weight but the routed
//! experts of the first N layers, from the tensors' sizes), beside `llama-bench -ngl 99
//! -ncmoe N`. Ours holds every weight but the routed experts, and in the rest a pool of
//! each layer's experts resident by use; the routes to the others run on the host. Its
//! decoded tokens there are a fixed pseudo-random sequence rather than the greedy token
//! fed back, so that the routes spread over the experts as a text's do (a random model
//! fed its own greedy tokens repeats a few, and so a few experts).
//!
//! With `--devices 0,1` (and `--tensor-split 3,1`): tg and pp with the model split by
//! layers over those GPUs, and the time to have it resident, beside one GPU's and
//! `llama-bench -sm layer` and `-sm tensor` over the same GPUs (`bench_gpu/split.rs`);
//! then split by tensors (`bench_gpu/tensor.rs`; the collectives library from
//! `ROCMFORGE_COLLECTIVES`, else the loader's search path).
//!
//! Without a usable GPU it says why in one line and exits non-zero.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use hip_backend::Device;
use model::gpu::{BatchSegment, GpuModel, GpuOptions, PageOptions};
use model::Model;
use serde_json::{json, Value};
use tensor_store::device::UploadMode;
use tensor_store::{TensorHandle, TensorStore};

mod cpu_moe;
mod llama;
mod rates;
mod split;
mod tensor;
use cpu_moe::cpu_moe_rows;
pub(crate) use llama::llama_bench_with;
use llama::{llama_bench, llama_bench_on};
use split::split_rows;

struct Options {
    models: Vec<PathBuf>,
    llama_bench: Option<PathBuf>,
    tokens: usize,
    prompt: usize,
    repeat: usize,
    json: Option<PathBuf>,
    parallel: Vec<usize>,
    npp: usize,
    ntg: usize,
    llama_batched_bench: Option<PathBuf>,
    budgets: Vec<u64>,
    /// `--cpu-moe`: llama.cpp's `-ncmoe` values to match.
    cpu_moe: Vec<usize>,
    /// `--no-batch-graphs`: the batched decoding steps' launches queued one by one.
    batch_graphs: bool,
    /// `--devices 0,1`: also split by layers over these GPUs.
    devices: Vec<usize>,
    /// `--tensor-split 3,1`: the split's shares.
    tensor_split: Option<Vec<f64>>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        models: Vec::new(),
        llama_bench: None,
        tokens: 128,
        prompt: 512,
        repeat: 3,
        json: None,
        parallel: Vec::new(),
        npp: 128,
        ntg: 128,
        llama_batched_bench: None,
        budgets: Vec::new(),
        cpu_moe: Vec::new(),
        batch_graphs: true,
        devices: Vec::new(),
        tensor_split: None,
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
            "--parallel" => {
                o.parallel = numbers(value()?).context("--parallel takes counts like 8,32,64")?;
            }
            "--npp" => o.npp = value()?.parse().context("--npp")?,
            "--ntg" => o.ntg = value()?.parse().context("--ntg")?,
            "--llama-batched-bench" => o.llama_batched_bench = Some(value()?.into()),
            "--budgets" => {
                o.budgets =
                    numbers(value()?).context("--budgets takes percentages like 25,50,75")?;
            }
            "--cpu-moe" => {
                o.cpu_moe = numbers(value()?).context("--cpu-moe takes layer counts like 12,24")?;
            }
            "--no-batch-graphs" => o.batch_graphs = false,
            "--devices" => {
                o.devices = numbers(value()?).context("--devices takes ordinals like 0,1")?;
            }
            "--tensor-split" => {
                o.tensor_split =
                    Some(numbers(value()?).context("--tensor-split takes shares like 3,1")?);
            }
            other => bail!("bench-gpu: unknown option {other:?}"),
        }
    }
    if o.models.is_empty() {
        bail!("bench-gpu: name at least one model with --gguf FILE");
    }
    if o.tokens == 0 || o.repeat == 0 {
        bail!("bench-gpu: --tokens and --repeat must be positive");
    }
    if o.budgets.iter().any(|&p| p == 0 || p >= 100) {
        bail!("bench-gpu: --budgets are percentages of the model, between 1 and 99");
    }
    if o.parallel.contains(&0) || (!o.parallel.is_empty() && (o.npp == 0 || o.ntg == 0)) {
        bail!("bench-gpu: --parallel, --npp and --ntg must be positive");
    }
    Ok(o)
}

/// A comma-separated list of numbers, spaces allowed around each.
fn numbers<T: std::str::FromStr>(list: &str) -> Result<Vec<T>, T::Err> {
    list.split(',').map(|n| n.trim().parse::<T>()).collect()
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
        let ours = ours(path, o.tokens, o.prompt, o.repeat, None)?;
        // Beside a split, llama.cpp's one-GPU figures come from its first GPU alone.
        let first = o.devices.first().map_or_else(String::new, usize::to_string);
        let theirs = match &o.llama_bench {
            Some(bench) => Some(llama_bench_on(
                bench,
                path,
                o.tokens,
                o.prompt,
                o.repeat,
                &["-ngl", "99"],
                &first,
            )?),
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
                "reads {:.2} GB a token -> {gbs:.0} GB/s ({:.0}% of copy)",
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
            print_row(&name, &test, tokens_per_s, llama, &note);
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
        if !o.parallel.is_empty() {
            rows.extend(parallel_rows(&o, path, &name)?);
        }
        for &percent in &o.budgets {
            rows.extend(budget_rows(&o, path, &name, percent)?);
        }
        for &layers in &o.cpu_moe {
            rows.extend(cpu_moe_rows(&o, path, &name, layers)?);
        }
        if o.devices.len() > 1 {
            rows.extend(split_rows(&o, path, &name, &o.devices)?);
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
    n_layers: usize,
    /// Layers a decode step computed on the host (over budget).
    host_layers: usize,
}

/// llama-bench's figures for one model.
#[derive(Clone, Copy)]
pub(crate) struct Theirs {
    pub tg: f64,
    pub pp: Option<f64>,
}

/// Whether `h` is a mixture of experts' 3-D expert tensor (`ffn_{gate,up,down}_exps`) or
/// its biases.
fn is_experts(h: &TensorHandle) -> bool {
    h.name().contains("_exps.")
}

/// The share of each weight a token reads: all of it, or of a mixture's expert tensors,
/// the `used` of `count` experts it is routed to.
pub(crate) fn token_share(model: &Model) -> impl Fn(&TensorHandle) -> f64 {
    let routed = model
        .config()
        .experts
        .map_or(1.0, |e| e.used as f64 / e.count as f64);
    move |h| if is_experts(h) { routed } else { 1.0 }
}

/// Our tg and pp, the weights held within `budget` device bytes (`None`: all of them).
fn ours(
    path: &Path,
    tokens: usize,
    prompt: usize,
    repeat: usize,
    budget: Option<u64>,
) -> Result<Ours> {
    ours_with_stats(path, tokens, prompt, repeat, budget, false).map(|(ours, _)| ours)
}

/// [`ours`], with what the pools of experts did over every run (a mixture of experts
/// over its budget; their waits and host time those of the decode runs alone). `varied`: the decoded tokens are a fixed pseudo-random sequence,
/// not the greedy token fed back (which on a random model repeats a few tokens, and so
/// a few experts).
fn ours_with_stats(
    path: &Path,
    tokens: usize,
    prompt: usize,
    repeat: usize,
    budget: Option<u64>,
    varied: bool,
) -> Result<(Ours, Option<model::gpu::ExpertStats>)> {
    let store = TensorStore::open(path).with_context(|| format!("opening {}", path.display()))?;
    let model = Model::load(&store).with_context(|| format!("{}", path.display()))?;
    let share = token_share(&model);
    let weight_bytes = model
        .plan()
        .handles()
        .iter()
        .map(|h| h.size() as f64 * share(h))
        .sum::<f64>() as u64;
    let weight_values = model
        .plan()
        .handles()
        .iter()
        // The layers' matrices: every prompt token meets them (the output matrix only
        // the last token, the embeddings none), a mixture's experts their routed share.
        .filter(|h| h.name().starts_with("blk.") && (h.shape().len() == 2 || is_experts(h)))
        .map(|h| h.shape().iter().product::<u64>() as f64 * share(h))
        .sum::<f64>() as u64;
    // Room for the warm-up's four positions too.
    let options = GpuOptions {
        budget,
        tuning: crate::tuning().gpu,
        ..GpuOptions::new(UploadMode::Eager, tokens.max(prompt).max(4) + 1)
    };
    let mut gpu = GpuModel::new(&model, &options).context("setting the model up on the GPU")?;
    // Over budget, the pools of experts filled as a server's are before it serves.
    gpu.wait_experts_resident()?;
    // Warm-up: every weight used once (and the decode step captured).
    let mut token = gpu.forward_argmax(&[1])?;
    for _ in 0..3 {
        token = gpu.forward_argmax(&[token])?;
    }
    let n_vocab = model.config().n_vocab as u64;
    let before_tg = gpu.expert_stats();
    let mut runs = Vec::new();
    for _ in 0..repeat {
        gpu.clear()?;
        let start = Instant::now();
        let mut token = 1;
        for i in 0..tokens {
            let next = gpu.forward_argmax(&[token])?;
            token = if varied {
                (1 + (i as u64 * 7919 + runs.len() as u64 * 104_729) % (n_vocab - 1)) as u32
            } else {
                next
            };
        }
        runs.push(tokens as f64 / start.elapsed().as_secs_f64());
    }
    let after_tg = gpu.expert_stats();
    // A prompt of `prompt` tokens in one call, as llama-bench's pp test feeds it.
    let prompt_result = if prompt > 0 {
        let ids = rates::prompt_ids(n_vocab, prompt);
        let pp_runs = rates::prompt_rates(repeat, &ids, &mut gpu, GpuModel::clear, |g, ids| {
            g.forward_argmax(ids).map(drop)
        })?;
        Some((median(&pp_runs), pp_runs))
    } else {
        None
    };
    Ok((
        Ours {
            tokens_per_s: median(&runs),
            runs,
            weight_bytes,
            weight_values,
            prompt: prompt_result,
            n_layers: model.config().n_layers,
            host_layers: gpu.host_layers(),
        },
        gpu.expert_stats().map(|end| {
            // The decode runs' own share of the waits and the host's time.
            let (b, a) = (before_tg.unwrap_or_default(), after_tg.unwrap_or_default());
            model::gpu::ExpertStats {
                wait_ns: a.wait_ns - b.wait_ns,
                host_ns: a.host_ns - b.host_ns,
                host_passes: a.host_passes - b.host_passes,
                host_product_ns: a.host_product_ns - b.host_product_ns,
                queue_ns: a.queue_ns - b.queue_ns,
                ..end
            }
        }),
    ))
}

/// tg and pp with the weights' budget at `percent` of the model, beside llama-bench with
/// that share of the layers on the GPU: printed, and returned as JSON rows.
fn budget_rows(o: &Options, path: &Path, name: &str, percent: u64) -> Result<Vec<Value>> {
    let store = TensorStore::open(path).with_context(|| format!("opening {}", path.display()))?;
    let bytes: u64 = Model::load(&store)?
        .plan()
        .handles()
        .iter()
        .map(|h| h.size())
        .sum();
    drop(store);
    let budget = bytes * percent / 100;
    let ours = ours(path, o.tokens, o.prompt, o.repeat, Some(budget))?;
    let ngl = ((ours.n_layers as u64 * percent + 50) / 100) as usize;
    let theirs = match &o.llama_bench {
        Some(bench) => Some(llama_bench(bench, path, o.tokens, o.prompt, o.repeat, ngl)?),
        None => None,
    };
    let note = format!(
        "budget {} MiB: {} of {} layers on the host; llama.cpp -ngl {ngl}",
        budget >> 20,
        ours.host_layers,
        ours.n_layers
    );
    let fields = json!({
        "budget_bytes": budget,
        "host_layers": ours.host_layers,
        "llama_cpp_gpu_layers": ngl,
    });
    Ok(tg_pp_rows(
        o,
        path,
        name,
        &format!("{percent}%"),
        &ours,
        theirs,
        &note,
        fields,
    ))
}

/// Our tg and pp beside llama.cpp's, labelled `test@label`: printed with `note`, and
/// returned as JSON rows with `fields` added.
#[allow(clippy::too_many_arguments)]
fn tg_pp_rows(
    o: &Options,
    path: &Path,
    name: &str,
    label: &str,
    ours: &Ours,
    theirs: Option<Theirs>,
    note: &str,
    fields: Value,
) -> Vec<Value> {
    let mut tests = vec![(
        format!("tg{}", o.tokens),
        ours.tokens_per_s,
        theirs.map(|t| t.tg),
    )];
    if let Some((pp, _)) = ours.prompt {
        tests.push((format!("pp{}", o.prompt), pp, theirs.and_then(|t| t.pp)));
    }
    let mut rows = Vec::new();
    for (test, mine, llama) in tests {
        let label = format!("{test}@{label}");
        print_row(name, &label, mine, llama, note);
        let mut row = json!({
            "model": path.display().to_string(),
            "test": label,
            "ours_tokens_per_s": mine,
            "llama_cpp_tokens_per_s": llama,
            "ratio": llama.map(|t| mine / t),
        });
        if let (Some(row), Some(fields)) = (row.as_object_mut(), fields.as_object()) {
            row.extend(fields.clone());
        }
        rows.push(row);
    }
    rows
}

/// Batched decoding of each of `o.parallel` sequence counts, ours beside
/// llama-batched-bench's: printed, and returned as JSON rows.
fn parallel_rows(o: &Options, path: &Path, name: &str) -> Result<Vec<Value>> {
    let ours = ours_parallel(path, o)?;
    let theirs = match &o.llama_batched_bench {
        Some(bench) => crate::bench_serve::run_llama_batched_bench(
            bench,
            path,
            o.npp,
            o.ntg,
            &o.parallel,
            &["-ngl", "99", "-fa", "on", "-b", "2048", "-ub", "512"],
        )?,
        None => Vec::new(),
    };
    let mut rows = Vec::new();
    for (&n, speeds) in o.parallel.iter().zip(&ours) {
        let line = theirs.iter().find(|r| r["pl"].as_u64() == Some(n as u64));
        for (test, mine, key) in [
            ("S_PP", speeds.pp, "speed_pp"),
            ("S_TG", speeds.tg, "speed_tg"),
            ("S", speeds.all, "speed"),
        ] {
            let llama = line.and_then(|r| r[key].as_f64());
            let label = format!("npl{n} {test}");
            let note = format!("{n} sequences of {} + {} tokens", o.npp, o.ntg);
            print_row(name, &label, mine, llama, &note);
            rows.push(json!({
                "model": path.display().to_string(),
                "test": label,
                "sequences": n,
                "ours_tokens_per_s": mine,
                "llama_cpp_tokens_per_s": llama,
                "ratio": llama.map(|t| mine / t),
            }));
        }
    }
    Ok(rows)
}

/// One line of the table: our tokens/s, llama.cpp's and the ratio, and a note.
fn print_row(model: &str, test: &str, ours: f64, llama: Option<f64>, note: &str) {
    println!(
        "{model:<32} {test:<10} ours {ours:>8.1} t/s  llama.cpp {:>10}  ratio {:>6}  {note}",
        llama.map_or_else(|| "-".into(), |t| format!("{t:.1} t/s")),
        llama.map_or_else(|| "-".into(), |t| format!("{:.2}x", ours / t)),
    );
}

/// Aggregate tokens/s of one batched run: prompts, generation, and the whole run.
#[derive(Clone, Copy, Debug)]
struct Speeds {
    pp: f64,
    tg: f64,
    all: f64,
}

/// For each count in `levels`: that many sequences of `npp` prompt tokens, run together
/// in batches of at most 512 tokens, then `ntg` steps of one token each, greedy on the
/// device, on one paged cache; the run with the median overall time of `repeat`.
fn ours_parallel(path: &Path, o: &Options) -> Result<Vec<Speeds>> {
    const BLOCK: usize = 32;
    let (levels, npp, ntg, repeat) = (&o.parallel, o.npp, o.ntg, o.repeat);
    const BATCH: usize = 512;
    let store = TensorStore::open(path).with_context(|| format!("opening {}", path.display()))?;
    let model = Model::load(&store).with_context(|| format!("{}", path.display()))?;
    let most = levels.iter().copied().max().unwrap_or(1);
    let context = npp + ntg;
    let per_seq = context.div_ceil(BLOCK);
    let options = GpuOptions {
        tuning: crate::tuning().gpu,
        ..GpuOptions::new(UploadMode::Eager, context)
    };
    let pages = PageOptions {
        block_size: BLOCK,
        n_blocks: most * per_seq,
        max_sequences: most,
    };
    let mut gpu = GpuModel::with_pages(&model, &options, BATCH, pages)
        .context("setting the model up on the GPU with a paged cache")?;
    gpu.set_batch_graphs(o.batch_graphs);
    let n_vocab = model.config().n_vocab as u64;
    let mut out = Vec::new();
    for &n in levels.iter() {
        let tables: Vec<Vec<u32>> = (0..n)
            .map(|s| (0..per_seq).map(|j| (s * per_seq + j) as u32).collect())
            .collect();
        let prompts: Vec<Vec<u32>> = (0..n as u64)
            .map(|s| {
                (0..npp as u64)
                    .map(|i| (1 + (s * 104_729 + i * 7919) % (n_vocab - 1)) as u32)
                    .collect()
            })
            .collect();
        let mut runs = Vec::new();
        // One run more than asked: the first warms up (weights used once, kernels loaded).
        for _ in 0..=repeat {
            let start = Instant::now();
            // Prompts: whole sequences, or pieces of one, filling batches of BATCH tokens.
            let mut next = vec![0u32; n];
            let (mut seq, mut done) = (0, 0);
            while seq < n {
                let mut segments = Vec::new();
                let mut room = BATCH;
                while seq < n && room > 0 {
                    let take = (npp - done).min(room);
                    segments.push((seq, done, take));
                    room -= take;
                    done += take;
                    if done == npp {
                        seq += 1;
                        done = 0;
                    }
                }
                let batch: Vec<BatchSegment<'_>> = segments
                    .iter()
                    .map(|&(s, first, len)| BatchSegment {
                        tokens: &prompts[s][first..first + len],
                        first_pos: first,
                        table: &tables[s],
                        logits: first + len == npp,
                    })
                    .collect();
                let tokens = gpu.forward_batch_argmax(&batch)?;
                let finished = segments.iter().filter(|&&(_, f, l)| f + l == npp);
                for (&(s, _, _), token) in finished.zip(tokens) {
                    next[s] = token;
                }
            }
            let prompt_done = Instant::now();
            for step in 0..ntg {
                let fed = next.clone();
                let batch: Vec<BatchSegment<'_>> = (0..n)
                    .map(|s| BatchSegment {
                        tokens: std::slice::from_ref(&fed[s]),
                        first_pos: npp + step,
                        table: &tables[s],
                        logits: true,
                    })
                    .collect();
                next = gpu.forward_batch_argmax(&batch)?;
            }
            let end = Instant::now();
            let t_pp = (prompt_done - start).as_secs_f64();
            let t_tg = (end - prompt_done).as_secs_f64();
            runs.push(Speeds {
                pp: (n * npp) as f64 / t_pp,
                tg: (n * ntg) as f64 / t_tg,
                all: (n * (npp + ntg)) as f64 / (t_pp + t_tg),
            });
        }
        runs.remove(0);
        runs.sort_by(|a, b| a.all.total_cmp(&b.all));
        out.push(runs[runs.len() / 2]);
    }
    Ok(out)
}

/// The middle of `runs` (the upper middle of an even count).
fn median(runs: &[f64]) -> f64 {
    let mut sorted = runs.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
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

#[cfg(test)]
mod tests {
    use super::parse;
    use crate::args;

    #[test]
    fn budgets_are_percentages_below_the_whole_model() {
        let o = parse(&args(&["--gguf", "m.gguf", "--budgets", "25, 50,75"])).expect("parses");
        assert_eq!(o.budgets, [25, 50, 75]);
        assert!(parse(&args(&["--gguf", "m.gguf"]))
            .expect("parses")
            .budgets
            .is_empty());
        for bad in ["0", "100", "25,120", "half"] {
            assert!(
                parse(&args(&["--gguf", "m.gguf", "--budgets", bad])).is_err(),
                "--budgets {bad} should be refused"
            );
        }
    }
}
