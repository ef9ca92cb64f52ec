//! llama.cpp's `llama-bench`, run beside ours: its tg and pp for one model, on the GPUs
//! and with the placement a row compares with.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::Theirs;

/// llama-bench's average tokens/s for `-n tokens` (generation after an empty context)
/// and, unless `prompt` is 0, `-p prompt` (one batch of prompt tokens), `ngl` layers on
/// the GPU (99: all).
pub(super) fn llama_bench(
    bench: &Path,
    model: &Path,
    tokens: usize,
    prompt: usize,
    repeat: usize,
    ngl: usize,
) -> Result<Theirs> {
    llama_bench_with(
        bench,
        model,
        tokens,
        prompt,
        repeat,
        &["-ngl", &ngl.to_string()],
    )
}

/// llama-bench's tg and pp with the placement and settings `placement` (`-ngl N`,
/// `-ncmoe N`, a cache type, a depth).
pub(crate) fn llama_bench_with(
    bench: &Path,
    model: &Path,
    tokens: usize,
    prompt: usize,
    repeat: usize,
    placement: &[&str],
) -> Result<Theirs> {
    llama_bench_on(bench, model, tokens, prompt, repeat, placement, "")
}

/// [`llama_bench_with`] on the GPUs `visible` names (CUDA's and HIP's visible-device
/// lists: `0,1`); empty, the process's own.
pub(super) fn llama_bench_on(
    bench: &Path,
    model: &Path,
    tokens: usize,
    prompt: usize,
    repeat: usize,
    placement: &[&str],
    visible: &str,
) -> Result<Theirs> {
    let mut command = Command::new(bench);
    if !visible.is_empty() {
        command
            .env("CUDA_VISIBLE_DEVICES", visible)
            .env("HIP_VISIBLE_DEVICES", visible);
    }
    let output = command
        .args(["-m"])
        .arg(model)
        .args(placement)
        .args(["-p", &prompt.to_string(), "-n", &tokens.to_string()])
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
