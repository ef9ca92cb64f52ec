//! `cargo xtask testdata`: remakes the reference data in `testdata/` (see its README).
//!
//! Each kind of data comes from a pinned Python package, installed with pip by package
//! name into a virtual environment under `target/`:
//!
//! - `testdata/vectors/dequant_vectors.gguf`: random valid blocks of 24 tensor types and
//!   gguf-py's decoding of them (`gguf`, [`GGUF_PY`]);
//! - `testdata/golden/<model>.json`: llama.cpp's tokenization, greedy text and top-10
//!   logits on the two real models (`llama-cpp-python`, [`LLAMA_CPP_PYTHON`], built from
//!   its source package for AVX2, the build the CPU path reproduces).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};

use crate::fetch;

/// gguf-py, the reference Python implementation that ships with llama.cpp.
pub const GGUF_PY: &str = "gguf==0.19.0";
/// llama.cpp's Python binding; its source package vendors llama.cpp's sources.
pub const LLAMA_CPP_PYTHON: &str = "llama-cpp-python==0.3.36";
/// The llama.cpp build the golden outputs come from: AVX2 with FMA and F16C, nothing
/// chosen from the build machine (its float order depends on the instruction set).
const LLAMA_CPP_CMAKE_ARGS: &str = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
                                    -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF";

struct Options {
    vectors: bool,
    golden: bool,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        vectors: false,
        golden: false,
    };
    for arg in args {
        match arg.as_str() {
            "--vectors" => o.vectors = true,
            "--golden" => o.golden = true,
            other => bail!("testdata: unknown option {other:?}"),
        }
    }
    if !o.vectors && !o.golden {
        o.vectors = true;
        o.golden = true;
    }
    Ok(o)
}

pub fn run(args: &[String]) -> Result<()> {
    let o = parse(args)?;
    let root = crate::workspace_root();
    let testdata = root.join("testdata");
    let scripts = testdata.join("scripts");
    let python = venv(&root.join("target/testdata-venv"))?;
    if o.vectors {
        pip_install(&python, &[GGUF_PY], &[])?;
        let out = testdata.join("vectors/dequant_vectors.gguf");
        run_python(
            &python,
            &scripts.join("make_vectors.py"),
            &[out.as_os_str()],
        )?;
        eprintln!("wrote {}", out.display());
    }
    if o.golden {
        let models = fetch::fetch_models(&fetch::models_dir())?;
        pip_install(
            &python,
            &[LLAMA_CPP_PYTHON],
            &[
                ("CMAKE_ARGS", LLAMA_CPP_CMAKE_ARGS),
                ("FORCE_CMAKE", "1"),
                ("CMAKE_BUILD_PARALLEL_LEVEL", "2"),
            ],
        )?;
        for model in models {
            let stem = model
                .file_stem()
                .and_then(|s| s.to_str())
                .context("a model file name")?;
            let out = testdata.join("golden").join(format!("{stem}.json"));
            run_python(
                &python,
                &scripts.join("make_golden.py"),
                &[model.as_os_str(), out.as_os_str()],
            )?;
            eprintln!("wrote {}", out.display());
        }
    }
    Ok(())
}

/// A virtual environment at `dir` (made when missing); returns its python.
fn venv(dir: &Path) -> Result<PathBuf> {
    let python = dir.join("bin/python");
    if !python.exists() {
        let base = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        eprintln!("making a Python virtual environment in {}", dir.display());
        let status = Command::new(&base)
            .args(["-m", "venv"])
            .arg(dir)
            .status()
            .with_context(|| format!("running {base} -m venv (is Python 3 installed?)"))?;
        ensure!(status.success(), "{base} -m venv failed ({status})");
    }
    Ok(python)
}

/// `pip install` of pinned packages, from source for llama.cpp (its wheels are built for
/// whatever the build machine had), with pip's progress shown.
fn pip_install(python: &Path, packages: &[&str], env: &[(&str, &str)]) -> Result<()> {
    eprintln!("pip install {}", packages.join(" "));
    let mut cmd = Command::new(python);
    cmd.args(["-m", "pip", "install", "--no-binary", "llama-cpp-python"])
        .args(packages);
    for (key, value) in env {
        cmd.env(key, value);
    }
    let status = cmd.status().context("running pip")?;
    ensure!(
        status.success(),
        "pip install {} failed ({status})",
        packages.join(" ")
    );
    Ok(())
}

fn run_python(python: &Path, script: &Path, args: &[&std::ffi::OsStr]) -> Result<()> {
    let status = Command::new(python)
        .arg(script)
        .args(args)
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    ensure!(status.success(), "{} failed ({status})", script.display());
    Ok(())
}
