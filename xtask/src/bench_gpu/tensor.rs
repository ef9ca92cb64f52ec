//! `bench-gpu --devices 0,1`: the model split by tensors over those GPUs
//! (`TensorSplit`), beside our one-GPU figures of the same run and llama.cpp's best
//! split (`-sm layer` or `-sm tensor`) over the same GPUs: tg, pp, the time to have every
//! share resident, and how far its logits stray from the one GPU's (the devices add
//! their partial sums in another order). A model the split cannot cut is said in one
//! line, not measured.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use model::gpu::{GpuOptions, TensorOptions, TensorSplit};
use model::Model;
use serde_json::{json, Value};

use super::rates::{decode_rates, prompt_ids, prompt_rates};
use super::{median, print_row, Options};

/// What the rows are held against: llama.cpp's best split's tg and pp, our one GPU's
/// tg (same run), the one GPU's logits of `probe` and of a decode step after it, and
/// its resident time.
pub(super) struct Against<'a> {
    pub llama_tg: Option<f64>,
    pub llama_pp: Option<f64>,
    pub one_tg: f64,
    pub one_s: f64,
    pub probe: &'a [u32],
    pub one_logits: &'a [Vec<f32>; 2],
}

/// Our tg and pp split by tensors over `devices`: printed, and returned as JSON.
#[allow(clippy::too_many_arguments)]
pub(super) fn tensor_rows(
    o: &Options,
    path: &Path,
    name: &str,
    devices: &[usize],
    model: &Model,
    options: &GpuOptions,
    against: &Against<'_>,
) -> Result<Vec<Value>> {
    let split = TensorOptions {
        devices: devices.to_vec(),
        library: std::env::var_os("ROCMFORGE_COLLECTIVES").map(Into::into),
    };
    let label = format!(
        "tensor {}",
        devices
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",")
    );
    let start = Instant::now();
    let mut gpu = match TensorSplit::new(model, options, &split, model::gpu::PROMPT_BATCH) {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("{name:<32} split by tensors: not measured: {e}");
            return Ok(vec![json!({
                "model": path.display().to_string(),
                "test": format!("refused@{label}"),
                "reason": e.to_string(),
            })]);
        }
    };
    let split_s = start.elapsed().as_secs_f64();
    let (library, version) = gpu.library();
    let logits = [
        gpu.forward_logits(against.probe)?.to_vec(),
        gpu.forward_logits(&[3])?.to_vec(),
    ];
    // The largest difference from the one GPU's logits, as a fraction of their spread,
    // and whether the greedy tokens agree (or the one GPU's top two lie closer than that
    // difference: a near tie, which either order of the sums may break either way).
    let stray: Vec<(f64, bool)> = against
        .one_logits
        .iter()
        .zip(&logits)
        .map(|(a, b)| {
            let largest = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            let agree = argmax(a) == argmax(b) || margin(a) <= largest;
            (largest_of_spread(a, b), agree)
        })
        .collect();
    let mut token = gpu.forward_argmax(&[1])?;
    for _ in 0..3 {
        token = gpu.forward_argmax(&[token])?;
    }
    let tg = decode_rates(o.repeat, o.tokens, &mut gpu, TensorSplit::clear, |g, t| {
        g.forward_argmax(&[t])
    })?;
    let mut pp = Vec::new();
    if o.prompt > 0 {
        let ids = prompt_ids(model.config().n_vocab as u64, o.prompt);
        pp = prompt_rates(o.repeat, &ids, &mut gpu, TensorSplit::clear, |g, ids| {
            g.forward_argmax(ids).map(drop)
        })?;
    }
    drop(gpu);
    // What one of a decode step's sums costs alone: two a layer.
    let sum_us = all_reduce_us(devices, model.config().n_embd, &split)?;
    println!(
        "{name:<32} all-reduce of {} values, in a captured graph: {sum_us:.1} µs; {:.0} µs \
         a token for {} layers",
        model.config().n_embd,
        2.0 * sum_us * model.config().n_layers as f64,
        model.config().n_layers
    );
    let note = format!(
        "{library} ({}); logits stray {:.3}/{:.3} of their spread, greedy tokens {}; \
         tg {:.2}x our one GPU's",
        version.map_or("-".into(), |v| v.to_string()),
        stray[0].0,
        stray[1].0,
        if stray.iter().all(|s| s.1) {
            "the same but for near ties"
        } else {
            "DIFFER"
        },
        median(&tg) / against.one_tg,
    );
    let mut rows = Vec::new();
    let mut tests = vec![(format!("tg{}", o.tokens), tg, against.llama_tg)];
    if !pp.is_empty() {
        tests.push((format!("pp{}", o.prompt), pp, against.llama_pp));
    }
    for (test, runs, llama) in tests {
        let test = format!("{test}@{label}");
        let mine = median(&runs);
        print_row(name, &test, mine, llama, &note);
        rows.push(json!({
            "model": path.display().to_string(),
            "test": test,
            "devices": devices,
            "collectives": library,
            "collectives_version": version,
            "ours_tokens_per_s": mine,
            "ours_runs": runs,
            "ours_one_gpu_tg": against.one_tg,
            "llama_cpp_best_split_tokens_per_s": llama,
            "ratio": llama.map(|t| mine / t),
            "logits_largest_difference_of_spread": stray.iter().map(|s| s.0).collect::<Vec<_>>(),
            "greedy_tokens_agree": stray.iter().all(|s| s.1),
        }));
    }
    println!(
        "{name:<32} resident  one GPU {:.2} s, split by tensors {split_s:.2} s ({:.2}x)",
        against.one_s,
        split_s / against.one_s
    );
    rows.push(json!({
        "model": path.display().to_string(),
        "test": format!("all_reduce@{label}"),
        "values": model.config().n_embd,
        "microseconds": sum_us,
    }));
    rows.push(json!({
        "model": path.display().to_string(),
        "test": format!("resident@{label}"),
        "one_gpu_s": against.one_s,
        "split_s": split_s,
        "ratio": split_s / against.one_s,
    }));
    Ok(rows)
}

/// Microseconds one all-reduce of `values` floats over `devices` takes, alone: each
/// device captures 64 of them in a graph (its own thread, as the split drives them), and
/// the graphs are replayed 20 times.
fn all_reduce_us(devices: &[usize], values: usize, split: &TensorOptions) -> Result<f64> {
    use hip_backend::{Collectives, Communicator, Device, HipError};
    const SUMS: usize = 64;
    const REPLAYS: usize = 20;
    let library = Collectives::load(split.library.as_deref())?;
    let opened = devices
        .iter()
        .map(|&d| Device::open(d))
        .collect::<Result<Vec<_>, _>>()?;
    let comms = Communicator::for_devices(&library, &opened)?;
    let ready = std::sync::Barrier::new(devices.len());
    let times: Vec<Result<f64, HipError>> = std::thread::scope(|scope| {
        let threads: Vec<_> = opened
            .iter()
            .zip(comms)
            .map(|(device, comm)| {
                let ready = &ready;
                scope.spawn(move || -> Result<f64, HipError> {
                    device.make_current()?;
                    let mut buf = device.alloc::<f32>(values)?;
                    let stream = device.new_stream()?;
                    // The connections are made outside the capture.
                    comm.all_reduce_sum(buf.view_mut(), &stream)?;
                    stream.synchronize()?;
                    let graph = stream.capture(|s| {
                        (0..SUMS).try_for_each(|_| comm.all_reduce_sum(buf.view_mut(), s))
                    })?;
                    graph.launch(&stream)?;
                    stream.synchronize()?;
                    ready.wait();
                    let start = Instant::now();
                    for _ in 0..REPLAYS {
                        graph.launch(&stream)?;
                    }
                    stream.synchronize()?;
                    let us = start.elapsed().as_secs_f64() * 1e6 / (SUMS * REPLAYS) as f64;
                    // The graph holds the communicator's work: it goes first.
                    drop(graph);
                    drop(comm);
                    Ok(us)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let mut slowest = 0f64;
    for t in times {
        slowest = slowest.max(t?);
    }
    Ok(slowest)
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0
}

/// How far a row's highest value lies above its second.
fn margin(row: &[f32]) -> f32 {
    let best = argmax(row);
    let second = row
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != best)
        .fold(f32::NEG_INFINITY, |m, (_, &v)| m.max(v));
    row[best] - second
}

/// The largest difference between two rows over `a`'s standard deviation.
fn largest_of_spread(a: &[f32], b: &[f32]) -> f64 {
    let n = a.len() as f64;
    let mean = a.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = a
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    let max = a
        .iter()
        .zip(b)
        .fold(0f64, |m, (x, y)| m.max(f64::from((x - y).abs())));
    max / var.sqrt().max(f64::MIN_POSITIVE)
}
