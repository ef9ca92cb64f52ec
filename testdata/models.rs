//! Where the tests of every crate find the real models (`cargo xtask fetch-models`).
//! Each test suite compiles this file in with `#[path]`: the crates below `rocmforge`
//! cannot depend on its `cache::models_dir`, which reads the same variable.

use std::path::PathBuf;

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
