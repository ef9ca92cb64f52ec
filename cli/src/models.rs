//! The models cache from the command line: `rocmforge pull`, `rocmforge list`, and the
//! default model, fetched on first use by `generate`, `chat` and `serve`. The environment
//! is read here (`ROCMFORGE_MODELS`, by `rocmforge::cache::models_dir`, `ROCMFORGE_OFFLINE`,
//! `PYTHON`); the work is the
//! library's (`rocmforge::pull`, `rocmforge::cache`).

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rocmforge::cache::models_dir;
use rocmforge::pull::{self, ProgressMode, PullOptions, Pulled, Source, DEFAULT_MODEL};
use serde_json::json;

/// Set (to anything but `0`, `false`, `no`, `off` or nothing), no command downloads.
pub const OFFLINE_ENV: &str = "ROCMFORGE_OFFLINE";

#[derive(clap::Args)]
pub struct PullArgs {
    /// What to fetch: an https:// URL, hf://ORG/REPO/FILE.gguf (a file of a Hugging Face
    /// repository's main branch), or a known model: smollm2 (the default model) or
    /// gemma3. Default: the default model.
    #[arg(value_name = "SOURCE")]
    source: Option<String>,
    /// Where to write the model, instead of the models cache.
    #[arg(long, short = 'o', value_name = "FILE")]
    out: Option<PathBuf>,
    /// The sha256 the file must have (known models are always checked).
    #[arg(long, value_name = "HEX", value_parser = parse_sha256)]
    sha256: Option<String>,
    /// Show the download's progress even when stderr is not a terminal.
    #[arg(long)]
    progress: bool,
    /// Times a dropped connection is resumed before giving up.
    #[arg(long, default_value_t = 3)]
    retries: u32,
    /// Never download (also ROCMFORGE_OFFLINE=1): only say whether the model is there.
    #[arg(long)]
    offline: bool,
}

#[derive(clap::Args)]
pub struct ListArgs {
    /// Print one JSON array instead of a table.
    #[arg(long)]
    json: bool,
}

/// How a command may fetch the default model when it is missing.
#[derive(Clone, Copy, Debug)]
pub struct Fetch {
    /// `--offline`: never.
    pub offline: bool,
    /// `--progress`: show the download's progress even off a terminal.
    pub progress: bool,
}

/// `--offline`, or `ROCMFORGE_OFFLINE` set.
fn offline(flag: bool) -> bool {
    flag || std::env::var(OFFLINE_ENV).is_ok_and(|v| {
        !matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "" | "0" | "false" | "no" | "off"
        )
    })
}

fn progress_mode(forced: bool) -> ProgressMode {
    match (forced, std::io::stderr().is_terminal()) {
        (_, true) => ProgressMode::Terminal,
        (true, false) => ProgressMode::Lines,
        (false, false) => ProgressMode::Off,
    }
}

fn options(dir: PathBuf, progress: bool) -> PullOptions {
    let mut options = PullOptions::new(dir);
    options.progress = progress_mode(progress);
    if let Ok(python) = std::env::var("PYTHON") {
        options.python = python;
    }
    options
}

/// `--gguf`, or the default model from the cache; when it is missing and `fetch` allows,
/// it is fetched first, saying so on stderr.
pub fn model_path(gguf: Option<&Path>, fetch: Option<Fetch>) -> Result<PathBuf> {
    if let Some(path) = gguf {
        return Ok(path.to_owned());
    }
    let dir = models_dir();
    let path = dir.join(DEFAULT_MODEL.file_name);
    if path.exists() {
        return Ok(path);
    }
    let Some(fetch) = fetch else {
        bail!(
            "the default model {} is missing: run `rocmforge pull`, or pass --gguf FILE",
            path.display()
        );
    };
    if offline(fetch.offline) {
        bail!(
            "the default model {} is missing and downloads are off (--offline or \
             {OFFLINE_ENV}): run `rocmforge pull` while online, or pass --gguf FILE",
            path.display()
        );
    }
    eprintln!(
        "the default model {} is not in {}: fetching it ({:.0} MB, once)",
        DEFAULT_MODEL.name,
        dir.display(),
        DEFAULT_MODEL.size as f64 / 1e6
    );
    let pulled = pull::pull(&Source::Known(DEFAULT_MODEL), &options(dir, fetch.progress))
        .with_context(|| format!("fetching the default model into {}", path.display()))?;
    Ok(pulled.path().to_owned())
}

/// `rocmforge pull`: prints the model's path on stdout once it is there.
pub fn run_pull(args: &PullArgs) -> Result<()> {
    let source = Source::parse(args.source.as_deref().unwrap_or("default"))?;
    let mut options = options(models_dir(), args.progress);
    options.out = args.out.clone();
    options.sha256 = args.sha256.clone();
    options.retries = args.retries;
    let target = pull::destination(&source, &options)?;
    let path = if offline(args.offline) {
        if !target.exists() {
            bail!(
                "{} is not there and downloads are off (--offline or {OFFLINE_ENV}): not \
                 fetching {source}",
                target.display()
            );
        }
        eprintln!("{}: present (offline: not checked)", target.display());
        target
    } else {
        match pull::pull(&source, &options)? {
            Pulled::Present(path) | Pulled::Downloaded(path) => path,
        }
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", path.display())?;
    out.flush()?;
    Ok(())
}

/// `rocmforge list`: the cache's models, one a line.
pub fn run_list(args: &ListArgs) -> Result<()> {
    let dir = models_dir();
    let models = rocmforge::cache::list(&dir)
        .with_context(|| format!("listing the models cache {}", dir.display()))?;
    let mut out = std::io::stdout().lock();
    if args.json {
        let rows: Vec<serde_json::Value> = models
            .iter()
            .map(|m| {
                json!({
                    "name": m.name,
                    "path": m.path.display().to_string(),
                    "size": m.size,
                    "partial": m.partial,
                    "architecture": m.architecture,
                    "quant": m.quant,
                    "error": m.error,
                })
            })
            .collect();
        serde_json::to_writer(&mut out, &rows)?;
        writeln!(out)?;
        return Ok(());
    }
    if models.is_empty() {
        eprintln!(
            "no models in {}: `rocmforge pull` fetches the default one",
            dir.display()
        );
        return Ok(());
    }
    let width = models
        .iter()
        .map(|m| m.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    writeln!(
        out,
        "{:width$}  {:>9}  {:12}  QUANT",
        "NAME", "SIZE", "ARCH"
    )?;
    for m in &models {
        let (arch, quant) = if m.partial {
            ("(partial)", "")
        } else if m.error.is_some() {
            ("(unreadable)", "")
        } else {
            (
                m.architecture.as_deref().unwrap_or("?"),
                m.quant.as_deref().unwrap_or("?"),
            )
        };
        writeln!(
            out,
            "{:width$}  {:>9}  {arch:12}  {quant}",
            m.name,
            size(m.size)
        )?;
    }
    out.flush()?;
    Ok(())
}

/// `98.4 MB`, `4.1 GB`.
fn size(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.1} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else {
        format!("{:.1} kB", b / 1e3)
    }
}

fn parse_sha256(text: &str) -> Result<String, String> {
    let text = text.trim();
    if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(text.to_ascii_lowercase())
    } else {
        Err(format!("{text:?} is not a sha256 (64 hexadecimal digits)"))
    }
}
