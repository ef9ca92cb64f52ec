//! Where the real models and llama.cpp's reference outputs are.

use std::path::PathBuf;

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

/// `$ROCMFORGE_MODELS`, else `~/.cache/rocmforge/models`.
pub fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ROCMFORGE_MODELS") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache/rocmforge/models")
}

/// The path of a real model; panics with the command that fetches it when it is missing.
pub fn model_path(file: &str) -> PathBuf {
    let path = models_dir().join(file);
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask fetch-models` first",
        path.display()
    );
    path
}

/// llama.cpp's reference outputs for a model, from the repository's `testdata/golden`
/// (compiled into the test binary, so it runs from anywhere).
pub fn golden(file: &str) -> serde_json::Value {
    let text = match file {
        SMOLLM2 => include_str!("../../../testdata/golden/SmolLM2-135M-Instruct.Q4_1.json"),
        GEMMA3 => include_str!("../../../testdata/golden/gemma-3-270m-q4_k_m.json"),
        other => panic!("no reference outputs for {other}"),
    };
    serde_json::from_str(text).expect("golden file is JSON")
}

/// llama.cpp's outputs with flash attention on (its default on a CPU), from the
/// repository's `testdata/golden-fa`: per golden prompt, the tokens, the top-10 logits and
/// log-sum-exp of every prompt position, and 32 greedy tokens with the rows they were
/// taken from.
pub fn golden_flash(file: &str) -> serde_json::Value {
    let text = match file {
        SMOLLM2 => include_str!("../../../testdata/golden-fa/SmolLM2-135M-Instruct.Q4_1.json"),
        GEMMA3 => include_str!("../../../testdata/golden-fa/gemma-3-270m-q4_k_m.json"),
        other => panic!("no flash-attention reference outputs for {other}"),
    };
    serde_json::from_str(text).expect("golden file is JSON")
}

/// A JSON array of integers as token ids.
pub fn ids(value: &serde_json::Value) -> Vec<u32> {
    value
        .as_array()
        .expect("an array of ids")
        .iter()
        .map(|v| v.as_u64().expect("an id") as u32)
        .collect()
}
