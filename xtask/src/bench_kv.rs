//! `cargo xtask bench-kv`: decode and prompt speed on a GPU with a deep context, for
//! each KV cache type, ROCmForge beside llama.cpp's CUDA or HIP build, in one run, on
//! the same file.
//!
//! For each cache type (`--types`, default `f16,q8_0,q4_0`; keys and values alike) and
//! depth (`--depths`, default `0,4096`): tg N (`--tokens`, default 64), the tokens/s of
//! decoding N tokens one at a time after a context of that many tokens, and pp N
//! (`--prompt`, default 512; 0 skips it), the tokens/s of an N-token prompt after it,
//! as `llama-bench -d D -n N -p P -fa 1 -ctk T -ctv T` measures them (the context is
//! computed before each run and not timed). Ours through the library (`GpuModel`,
//! weights resident, greedy tokens chosen on the device and fed back), the median of
//! `--repeat` runs. It prints both, the ratio, and each type's speed against f16's at
//! the same depth, ours and llama.cpp's.
//!
//! Without a usable GPU it says why in one line and exits non-zero.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use hip_backend::Device;
use model::gpu::{GpuModel, GpuOptions};
use model::{KvType, KvTypes, Model};
use serde_json::json;
use tensor_store::device::UploadMode;
use tensor_store::TensorStore;

use crate::bench_gpu::llama_bench_with;

struct Options {
    model: PathBuf,
    llama_bench: Option<PathBuf>,
    types: Vec<KvType>,
    depths: Vec<usize>,
    tokens: usize,
    prompt: usize,
    repeat: usize,
    json: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut model = None;
    let mut o = Options {
        model: PathBuf::new(),
        llama_bench: None,
        types: vec![KvType::F16, KvType::Q8_0, KvType::Q4_0],
        depths: vec![0, 4096],
        tokens: 64,
        prompt: 512,
        repeat: 3,
        json: None,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--gguf" => model = Some(PathBuf::from(value()?)),
            "--llama-bench" => o.llama_bench = Some(value()?.into()),
            "--types" => {
                o.types = value()?
                    .split(',')
                    .map(|t| KvType::parse(t.trim()).map_err(anyhow::Error::msg))
                    .collect::<Result<_>>()
                    .context("--types")?;
            }
            "--depths" => {
                o.depths = value()?
                    .split(',')
                    .map(|d| d.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .context("--depths takes token counts like 0,4096,32768")?;
            }
            "--tokens" => o.tokens = value()?.parse().context("--tokens")?,
            "--prompt" => o.prompt = value()?.parse().context("--prompt")?,
            "--repeat" => o.repeat = value()?.parse().context("--repeat")?,
            "--json" => o.json = Some(value()?.into()),
            other => bail!("bench-kv: unknown option {other:?}"),
        }
    }
    o.model = model.context("bench-kv: name the model with --gguf FILE")?;
    if o.tokens == 0 || o.repeat == 0 || o.types.is_empty() || o.depths.is_empty() {
        bail!("bench-kv: --tokens, --repeat, --types and --depths must not be empty or 0");
    }
    Ok(o)
}

pub fn run(args: &[String]) -> Result<()> {
    let o = parse(args)?;
    let device = Device::open(0).map_err(|e| anyhow::anyhow!("bench-kv needs a GPU: {e}"))?;
    println!("device: {} ({})", device.name(), device.arch());
    drop(device);
    let store =
        TensorStore::open(&o.model).with_context(|| format!("opening {}", o.model.display()))?;
    let model = Model::load(&store).with_context(|| format!("{}", o.model.display()))?;
    let name = o
        .model
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into());
    let mut rows = Vec::new();
    for &depth in &o.depths {
        // f16's figures at this depth, ours and theirs, for the types' ratios.
        let mut f16_speeds: Option<[Option<f64>; 4]> = None;
        for &ty in &o.types {
            let types = KvTypes { k: ty, v: ty };
            let ours = ours(&model, types, depth, &o)?;
            let theirs = match &o.llama_bench {
                Some(bench) => Some(llama_bench(bench, &o, types, depth)?),
                None => None,
            };
            let speeds = [
                Some(ours.0),
                ours.1,
                theirs.map(|t| t.0),
                theirs.and_then(|t| t.1),
            ];
            let f16 = *f16_speeds.get_or_insert(speeds);
            let tests = [
                (format!("tg{}", o.tokens), 0usize),
                (format!("pp{}", o.prompt), 1usize),
            ];
            for (test, i) in tests {
                let Some(ours) = speeds[i] else { continue };
                let llama = speeds[2 + i];
                let of_f16 = |s: Option<f64>, f: Option<f64>| s.zip(f).map(|(s, f)| s / f);
                let ours_of_f16 = of_f16(Some(ours), f16[i]);
                let llama_of_f16 = of_f16(llama, f16[2 + i]);
                println!(
                    "{name} {test} @ d{depth} {}: ours {ours:.1} t/s, llama.cpp {} ({}); \
                     of f16: ours {}, llama.cpp {}",
                    ty.name(),
                    fmt(llama, 1),
                    llama.map_or_else(|| "-".to_owned(), |l| format!("{:.2}x", ours / l)),
                    fmt(ours_of_f16, 3),
                    fmt(llama_of_f16, 3),
                );
                rows.push(json!({
                    "model": o.model.display().to_string(),
                    "test": test,
                    "depth": depth,
                    "cache_type": ty.name(),
                    "ours_tokens_per_s": ours,
                    "llama_cpp_tokens_per_s": llama,
                    "ratio": llama.map(|l| ours / l),
                    "ours_of_f16": ours_of_f16,
                    "llama_cpp_of_f16": llama_of_f16,
                    "kv_bytes_per_token": types.bytes_per_position(model.config()),
                }));
            }
        }
    }
    if let Some(out) = &o.json {
        let doc = json!({ "results": rows });
        std::fs::write(out, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

fn fmt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

fn median(runs: &mut [f64]) -> f64 {
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

/// Our tg and pp (tokens/s, medians) after a context of `depth` tokens, the cache of
/// `types`.
fn ours(model: &Model, types: KvTypes, depth: usize, o: &Options) -> Result<(f64, Option<f64>)> {
    let options = GpuOptions {
        kv_types: types,
        tuning: crate::tuning().gpu,
        ..GpuOptions::new(UploadMode::Eager, depth + o.tokens.max(o.prompt).max(4) + 1)
    };
    let mut gpu = GpuModel::new(model, &options).context("setting the model up on the GPU")?;
    let n_vocab = model.config().n_vocab as u64;
    let ids = |n: usize, seed: u64| -> Vec<u32> {
        (0..n as u64)
            .map(|i| (1 + (i * 7919 + seed) % (n_vocab - 1)) as u32)
            .collect()
    };
    let context = ids(depth, 17);
    let fill = |gpu: &mut GpuModel| -> Result<()> {
        gpu.clear()?;
        if !context.is_empty() {
            gpu.forward_argmax(&context)?;
        }
        Ok(())
    };
    // Warm-up: every weight used once (and the decode step captured).
    fill(&mut gpu)?;
    let mut token = gpu.forward_argmax(&[1])?;
    for _ in 0..3 {
        token = gpu.forward_argmax(&[token])?;
    }
    let mut tg = Vec::new();
    for _ in 0..o.repeat {
        fill(&mut gpu)?;
        let start = Instant::now();
        let mut token = 1;
        for _ in 0..o.tokens {
            token = gpu.forward_argmax(&[token])?;
        }
        tg.push(o.tokens as f64 / start.elapsed().as_secs_f64());
    }
    let pp = if o.prompt > 0 {
        let prompt = ids(o.prompt, 29);
        let mut runs = Vec::new();
        for _ in 0..o.repeat {
            fill(&mut gpu)?;
            let start = Instant::now();
            gpu.forward_argmax(&prompt)?;
            runs.push(o.prompt as f64 / start.elapsed().as_secs_f64());
        }
        Some(median(&mut runs))
    } else {
        None
    };
    Ok((median(&mut tg), pp))
}

/// llama-bench's tg and pp after `depth` tokens, every layer on the GPU, flash
/// attention on, the cache of `types`.
fn llama_bench(
    bench: &Path,
    o: &Options,
    types: KvTypes,
    depth: usize,
) -> Result<(f64, Option<f64>)> {
    let depth = depth.to_string();
    let settings = [
        "-ngl",
        "99",
        "-fa",
        "1",
        "-d",
        &depth,
        "-ctk",
        types.k.name(),
        "-ctv",
        types.v.name(),
    ];
    let theirs = llama_bench_with(bench, &o.model, o.tokens, o.prompt, o.repeat, &settings)?;
    Ok((theirs.tg, theirs.pp))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn types_and_depths_are_lists() {
        let o = parse(&args(&[
            "--gguf",
            "m.gguf",
            "--types",
            "f16, q8_0",
            "--depths",
            "0,4096",
        ]))
        .expect("parses");
        assert_eq!(o.types, [KvType::F16, KvType::Q8_0]);
        assert_eq!(o.depths, [0, 4096]);
        for bad in [
            &["--types", "q5_1"][..],
            &["--depths", "4k"],
            &["--tokens", "0"],
        ] {
            let mut list = vec!["--gguf", "m.gguf"];
            list.extend_from_slice(bad);
            assert!(parse(&args(&list)).is_err(), "{bad:?} should be refused");
        }
        assert!(parse(&args(&["--types", "f16"])).is_err(), "no model");
    }
}
