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

/// The folder of shared reference data (`ROCMFORGE_SHARED`, else `../shared` beside the
/// repository).
pub fn shared_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ROCMFORGE_SHARED") {
        return PathBuf::from(dir);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared")
}

/// llama.cpp's reference outputs for a model.
pub fn golden(file: &str) -> serde_json::Value {
    let name = file.trim_end_matches(".gguf");
    let path = shared_dir().join("golden").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).expect("golden file is JSON")
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
