//! `bench-gpu --devices 0,1`: the model split by layers over those GPUs
//! (`LayerSplit`), then by tensors (`bench_gpu/tensor.rs`), beside our one-GPU figures of the same run and llama.cpp's `-sm
//! layer` and `-sm tensor` over the same GPUs: tg, pp and the time to have every weight
//! resident (warm page cache, eager upload).

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use model::gpu::{GpuModel, GpuOptions, LayerSplit, SplitOptions};
use model::Model;
use serde_json::{json, Value};
use tensor_store::device::UploadMode;
use tensor_store::TensorStore;

use super::rates::{decode_rates, prompt_ids, prompt_rates};
use super::tensor::{tensor_rows, Against};
use super::{llama_bench_on, median, print_row, Options, Theirs};

/// Our tg and pp split over `devices`, and the resident time of one GPU and of the
/// split, beside llama-bench's splits over the same GPUs: printed, and returned as JSON.
pub(super) fn split_rows(
    o: &Options,
    path: &Path,
    name: &str,
    devices: &[usize],
) -> Result<Vec<Value>> {
    let store = TensorStore::open(path).with_context(|| format!("opening {}", path.display()))?;
    let model = Model::load(&store).with_context(|| format!("{}", path.display()))?;
    let context = o.tokens.max(o.prompt).max(4) + 1;
    let options = GpuOptions {
        tuning: crate::tuning().gpu,
        ..GpuOptions::new(UploadMode::Eager, context)
    };
    // Resident times: the model on the first GPU alone, then split (each eager upload
    // from the page cache, which the first has filled).
    let start = Instant::now();
    let mut one = GpuModel::new(
        &model,
        &GpuOptions {
            device: devices[0],
            ..options.clone()
        },
    )?;
    let one_s = start.elapsed().as_secs_f64();
    // The logits of a prompt and of a decode step after it, to hold the split's against.
    let n_vocab = model.config().n_vocab as u64;
    let probe: Vec<u32> = (0..(context - 2).min(77) as u64)
        .map(|i| (1 + (i * 104_729) % (n_vocab - 1)) as u32)
        .collect();
    let one_logits = [one.forward(&probe)?, one.forward(&[3])?];
    // Our one GPU's tg, the split by tensors' yardstick.
    one.forward_argmax(&[1])?;
    let one_tg = decode_rates(o.repeat, o.tokens, &mut one, GpuModel::clear, |g, t| {
        g.forward_argmax(&[t])
    })?;
    drop(one);
    let split = SplitOptions {
        devices: devices.to_vec(),
        ratios: o.tensor_split.clone(),
        chunk: None,
    };
    let start = Instant::now();
    let mut gpu = LayerSplit::new(&model, &options, &split, model::gpu::PROMPT_BATCH)?;
    let split_s = start.elapsed().as_secs_f64();
    let stages = gpu.stages();
    let split_logits = [
        gpu.forward_logits(&probe)?.to_vec(),
        gpu.forward_logits(&[3])?.to_vec(),
    ];
    let same_bits = one_logits.iter().zip(&split_logits).all(|(a, b)| {
        a.iter()
            .map(|v| v.to_bits())
            .eq(b.iter().map(|v| v.to_bits()))
    });
    // Warm-up: every weight used once, every stage's decode step captured.
    let mut token = gpu.forward_argmax(&[1])?;
    for _ in 0..3 {
        token = gpu.forward_argmax(&[token])?;
    }
    let tg = decode_rates(o.repeat, o.tokens, &mut gpu, LayerSplit::clear, |g, t| {
        g.forward_argmax(&[t])
    })?;
    // The prompt cut into chunks for the pipeline (the default), and in one chunk.
    let mut pp = Vec::new();
    let mut pp_whole = Vec::new();
    if o.prompt > 0 {
        let ids = prompt_ids(n_vocab, o.prompt);
        for (chunk, runs) in [(None, &mut pp), (Some(o.prompt), &mut pp_whole)] {
            gpu.set_chunk(chunk);
            *runs = prompt_rates(o.repeat, &ids, &mut gpu, LayerSplit::clear, |g, ids| {
                g.forward_argmax(ids).map(drop)
            })?;
        }
    }
    drop(gpu);
    let visible = devices
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let theirs = |mode: &str| -> Option<Theirs> {
        let bench = o.llama_bench.as_ref()?;
        let args = ["-ngl", "99", "-sm", mode];
        match llama_bench_on(bench, path, o.tokens, o.prompt, o.repeat, &args, &visible) {
            Ok(t) => Some(t),
            Err(e) => {
                println!("llama-bench -sm {mode}: {e}");
                None
            }
        }
    };
    let (layer, tensor) = (theirs("layer"), theirs("tensor"));
    let best = |pick: fn(&Theirs) -> Option<f64>| {
        [layer, tensor]
            .iter()
            .flatten()
            .filter_map(pick)
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
    };
    let label = format!("split {visible}");
    let note = format!(
        "layers {}; logits {}; llama.cpp -sm layer {} / -sm tensor {}",
        stages
            .iter()
            .map(|(d, l)| format!("{}..{} on {d}", l.start, l.end))
            .collect::<Vec<_>>()
            .join(", "),
        if same_bits {
            "the one GPU's bit for bit"
        } else {
            "DIFFER from the one GPU's"
        },
        layer.map_or("-".into(), |t| format!("{:.1}/{}", t.tg, fmt(t.pp))),
        tensor.map_or("-".into(), |t| format!("{:.1}/{}", t.tg, fmt(t.pp))),
    );
    let mut rows = Vec::new();
    let mut tests = vec![(
        format!("tg{}", o.tokens),
        median(&tg),
        tg.clone(),
        best(|t| Some(t.tg)),
    )];
    if !pp.is_empty() {
        tests.push((
            format!("pp{} whole", o.prompt),
            median(&pp_whole),
            pp_whole.clone(),
            best(|t| t.pp),
        ));
        tests.push((
            format!("pp{}", o.prompt),
            median(&pp),
            pp.clone(),
            best(|t| t.pp),
        ));
    }
    for (test, mine, runs, llama) in tests {
        let test = format!("{test}@{label}");
        print_row(name, &test, mine, llama, &note);
        rows.push(json!({
            "model": path.display().to_string(),
            "test": test,
            "devices": devices,
            "stages": stages.iter().map(|(d, l)| json!({"device": d, "layers": [l.start, l.end]})).collect::<Vec<_>>(),
            "ours_tokens_per_s": mine,
            "ours_runs": runs,
            "llama_cpp_best_split_tokens_per_s": llama,
            "llama_cpp_layer": layer.map(|t| json!({"tg": t.tg, "pp": t.pp})),
            "llama_cpp_tensor": tensor.map(|t| json!({"tg": t.tg, "pp": t.pp})),
            "ratio": llama.map(|t| mine / t),
            "logits_bit_for_bit": same_bits,
        }));
    }
    println!(
        "{name:<32} resident  one GPU {one_s:.2} s, split over {visible} {split_s:.2} s ({:.2}x)",
        split_s / one_s
    );
    let against = Against {
        llama_tg: best(|t| Some(t.tg)),
        llama_pp: best(|t| t.pp),
        one_tg: median(&one_tg),
        one_s,
        probe: &probe,
        one_logits: &one_logits,
    };
    rows.push(json!({
        "model": path.display().to_string(),
        "test": format!("resident@{label}"),
        "one_gpu_s": one_s,
        "split_s": split_s,
        "ratio": split_s / one_s,
    }));
    rows.extend(tensor_rows(
        o, path, name, devices, &model, &options, &against,
    )?);
    Ok(rows)
}

fn fmt(pp: Option<f64>) -> String {
    pp.map_or("-".into(), |p| format!("{p:.0}"))
}
