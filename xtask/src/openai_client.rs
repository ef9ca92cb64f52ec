//! The official `openai` Python package, which the server tests and `bench-serve` use
//! as their client, and SGLang's router (`sglang-router`), which the replicas' test
//! puts in front of two servers: installed by package name, at pinned versions, into a
//! virtual environment of their own under `target/`.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{ensure, Context, Result};

/// The version the tests are written against.
pub const OPENAI_VERSION: &str = "3.57.0";
/// The router's version the replicas' test is written against.
pub const ROUTER_VERSION: &str = "0.3.2";

/// The Python of a virtual environment with `openai` at [`OPENAI_VERSION`] and
/// `sglang-router` at [`ROUTER_VERSION`], made or updated as needed.
pub fn python() -> Result<PathBuf> {
    let venv = crate::workspace_root().join("target/openai-venv");
    let python = venv.join("bin/python");
    if !python.exists() {
        eprintln!("creating {}", venv.display());
        let status = Command::new(crate::fetch::python())
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .context("running python3 -m venv (is Python 3 with venv installed?)")?;
        ensure!(status.success(), "python3 -m venv failed ({status})");
    }
    let check = format!(
        "import sys, openai, importlib.metadata as m; \
         sys.exit(openai.__version__ != {OPENAI_VERSION:?} \
         or m.version('sglang-router') != {ROUTER_VERSION:?})"
    );
    let installed = Command::new(&python)
        .args(["-c", &check])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !installed {
        eprintln!(
            "installing openai=={OPENAI_VERSION} and sglang-router=={ROUTER_VERSION} with pip"
        );
        let status = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet"])
            .arg(format!("openai=={OPENAI_VERSION}"))
            .arg(format!("sglang-router=={ROUTER_VERSION}"))
            .status()
            .context("running pip")?;
        ensure!(
            status.success(),
            "pip install openai sglang-router failed ({status})"
        );
    }
    Ok(python)
}
