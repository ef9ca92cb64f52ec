//! Architecture invariants, checked as tests (`cargo test -p xtask`).
//!
//! What ARCHITECTURE.md promises about the layers is verified here rather than hoped for:
//! the allowed dependency edges between our crates, which crates may start a runtime or
//! install a subscriber, crate docs, and source hygiene.

use std::collections::{BTreeMap, BTreeSet};
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

/// The library crates, which other projects may use one by one.
const LIBRARIES: &[&str] = &[
    "gguf-format",
    "tensor-store",
    "hip-backend",
    "dequant",
    "model",
];

/// The folders of a library crate that hold its code (build scripts, in `build.rs` and
/// `build/`, and integration tests, in `tests/`, lie outside them).
const LIBRARY_CODE: &[&str] = &["src", "include", "csrc", "kernels"];

/// Files under `dir` whose extension is one of `extensions`.
fn files_with(dir: &Path, extensions: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files_with(&path, extensions, out);
        } else if path
            .extension()
            .is_some_and(|e| extensions.iter().any(|x| e == *x))
        {
            out.push(path);
        }
    }
}

/// The files of the `#[cfg(test)]` modules that `file` declares out of line
/// (`#[cfg(test)]`, other attributes such as `#[path = "…"]`, then `mod name;`), and the
/// folders of their own submodules.
fn test_module_files(file: &Path, text: &str) -> Vec<PathBuf> {
    let here = file.parent().expect("a file has a folder");
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let children = if matches!(stem, "mod" | "lib" | "main") {
        here.to_owned()
    } else {
        here.join(stem)
    };
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if *line != "#[cfg(test)]" {
            continue;
        }
        let mut path = None;
        let mut next = i + 1;
        while let Some(attribute) = lines.get(next).filter(|l| l.starts_with("#[")) {
            if let Some(value) = attribute
                .strip_prefix("#[path = \"")
                .and_then(|rest| rest.strip_suffix("\"]"))
            {
                path = Some(here.join(value));
            }
            next += 1;
        }
        let Some(name) = lines
            .get(next)
            .map(|l| {
                l.trim_start_matches("pub(crate) ")
                    .trim_start_matches("pub ")
            })
            .and_then(|l| l.strip_prefix("mod "))
            .and_then(|l| l.strip_suffix(';'))
        else {
            continue;
        };
        match path {
            Some(path) => {
                if path.ends_with("mod.rs") {
                    found.extend(path.parent().map(Path::to_owned));
                }
                found.push(path);
            }
            None => {
                found.push(children.join(format!("{name}.rs")));
                found.push(children.join(name));
            }
        }
    }
    found
}

/// `files` with their texts, but those of out-of-line `#[cfg(test)]` modules (and
/// their submodules) that a Rust file among them declares.
fn sources_outside_tests(files: Vec<PathBuf>) -> Vec<(PathBuf, String)> {
    let texts: Vec<(PathBuf, String)> = files
        .into_iter()
        .map(|file| {
            let text = std::fs::read_to_string(&file).expect("readable");
            (file, text)
        })
        .collect();
    let tests: Vec<PathBuf> = texts
        .iter()
        .filter(|(file, _)| file.extension().is_some_and(|e| e == "rs"))
        .flat_map(|(file, text)| test_module_files(file, text))
        .collect();
    texts
        .into_iter()
        .filter(|(file, _)| !tests.iter().any(|t| file.starts_with(t)))
        .collect()
}

/// `text` without its whole-line comments and its inline `#[cfg(test)]` modules (as
/// rustfmt lays them out: `mod name {` after the attributes, closed by a `}` alone at the
/// attribute's indentation), each remaining line with its index.
fn code_outside_tests(text: &str) -> Vec<(usize, &str)> {
    let lines: Vec<&str> = text.lines().collect();
    let opens_module = |line: &str| {
        let line = line.trim_start();
        let line = line
            .strip_prefix("pub(crate) ")
            .or_else(|| line.strip_prefix("pub "))
            .unwrap_or(line);
        line.starts_with("mod ") && line.ends_with('{')
    };
    let mut code = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        if trimmed == "#[cfg(test)]" {
            let mut item = i + 1;
            while lines
                .get(item)
                .is_some_and(|l| l.trim_start().starts_with("#["))
            {
                item += 1;
            }
            if lines.get(item).is_some_and(|l| opens_module(l)) {
                let close = format!("{}}}", &line[..line.len() - trimmed.len()]);
                i = (item + 1..lines.len())
                    .find(|&j| lines[j] == close)
                    .map_or(lines.len(), |j| j + 1);
                continue;
            }
        }
        if !trimmed.starts_with("//") {
            code.push((i, line));
        }
        i += 1;
    }
    code
}

/// A library does not change behaviour on an environment variable its caller never set
/// (and a binary's `--help` could not show): it takes every setting as an option, and
/// only the binaries read the environment (`rocmforge::tuning`). Build scripts and tests
/// may.
#[test]
fn libraries_never_read_the_environment() {
    // `std::env::var`, `env::var_os`, `std::env::vars`; C's `getenv(`.
    let needles = ["env::var", "getenv("];
    let root = crate::workspace_root();
    let mut scanned = 0;
    for library in LIBRARIES {
        let mut files = Vec::new();
        for dir in LIBRARY_CODE {
            files_with(
                &root.join(library).join(dir),
                &["rs", "h", "hpp", "hip", "c", "cc", "cpp", "cu", "cuh"],
                &mut files,
            );
        }
        for (file, text) in &sources_outside_tests(files) {
            scanned += 1;
            for (number, line) in code_outside_tests(text) {
                for needle in needles {
                    assert!(
                        !line.contains(needle),
                        "{}:{} reads the environment (`{needle}`): take the setting as an \
                         option of the library and let the binaries read the variable \
                         (cli/src/tuning.rs)",
                        file.display(),
                        number + 1
                    );
                }
            }
        }
    }
    assert!(scanned > 50, "scanned only {scanned} library files");
}

#[test]
fn the_environment_check_skips_comments_and_test_modules() {
    let text = "fn f() {}\n\
                // std::env::var in a comment\n\
                #[cfg(test)]\n\
                mod tests {\n    fn g() { std::env::var(\"X\"); }\n}\n\
                fn h() { std::env::var(\"Y\"); }\n";
    let code: Vec<&str> = code_outside_tests(text)
        .into_iter()
        .map(|(_, l)| l)
        .collect();
    assert_eq!(code, ["fn f() {}", "fn h() { std::env::var(\"Y\"); }"]);
    let file = Path::new("/c/src/gpu/mod.rs");
    let text =
        "#[cfg(test)]\nmod tests;\n#[cfg(test)]\n#[path = \"t.rs\"]\nmod other;\nmod kept;\n";
    assert_eq!(
        test_module_files(file, text),
        [
            PathBuf::from("/c/src/gpu/tests.rs"),
            PathBuf::from("/c/src/gpu/tests"),
            PathBuf::from("/c/src/gpu/t.rs"),
        ]
    );
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

/// Most lines a source file may hold: past it a file wants splitting by what it does.
const MOST_LINES: usize = 800;

/// No source file (Rust, HIP, C headers) is over [`MOST_LINES`], generated tables aside
/// (their first lines say they are generated).
#[test]
fn no_source_file_is_over_the_line_limit() {
    let root = crate::workspace_root();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    for dir in ["dequant", "model", "hip-backend"] {
        for code in LIBRARY_CODE {
            files_with(
                &root.join(dir).join(code),
                &["hip", "h", "cu", "c"],
                &mut files,
            );
        }
    }
    assert!(files.len() > 200, "found only {} source files", files.len());
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable");
        let generated = text
            .lines()
            .take(3)
            .any(|l| l.contains("GENERATED FILE") || l.contains("@generated"));
        let lines = text.lines().count();
        assert!(
            generated || lines <= MOST_LINES,
            "{} has {lines} lines, over {MOST_LINES}: split it by what its parts do",
            file.display()
        );
    }
}

/// The modules that `file` (under `model/src`) names through `crate::`, among `tops`, in
/// its code outside comments and test modules.
fn crate_modules_named(text: &str, tops: &BTreeSet<String>) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    for (_, line) in code_outside_tests(text) {
        let code = line.split("//").next().unwrap_or("");
        for (at, _) in code.match_indices("crate::") {
            let rest = &code[at + "crate::".len()..];
            // `crate::{a, b::c}` names several.
            let names: Vec<&str> = match rest.strip_prefix('{') {
                Some(group) => group
                    .split(['}', ','])
                    .map(|n| n.trim().split("::").next().unwrap_or(""))
                    .collect(),
                None => vec![rest
                    .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .next()
                    .unwrap_or("")],
            };
            named.extend(
                names
                    .into_iter()
                    .filter(|n| tops.contains(*n))
                    .map(String::from),
            );
        }
    }
    named
}

/// The `model` crate's top-level modules (`cpu`, `gpu`, `serve`, `error`, ...) use each
/// other in one direction only: no chain of `use crate::…` leads from a module back to
/// itself. A circle means no module of it can be read, tested or moved alone.
#[test]
fn the_model_crates_modules_import_in_no_circle() {
    let src = crate::workspace_root().join("model/src");
    let tops: BTreeSet<String> = std::fs::read_dir(&src)
        .expect("model/src")
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            match name.strip_suffix(".rs") {
                Some("lib") => None,
                Some(stem) => Some(stem.to_owned()),
                None => e.path().is_dir().then_some(name),
            }
        })
        .collect();
    assert!(tops.contains("gpu") && tops.contains("serve"), "{tops:?}");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut uses: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (file, text) in &sources_outside_tests(files) {
        let rel = file.strip_prefix(&src).expect("under model/src");
        let first = rel.components().next().expect("a path");
        let top = first.as_os_str().to_string_lossy();
        let top = top.strip_suffix(".rs").unwrap_or(&top).to_owned();
        if top == "lib" {
            continue;
        }
        let named = crate_modules_named(text, &tops);
        uses.entry(top.clone())
            .or_default()
            .extend(named.into_iter().filter(|n| *n != top));
    }
    // A depth-first walk from each module: reaching it again is a circle.
    for start in &tops {
        let mut stack: Vec<Vec<&String>> = vec![vec![start]];
        let mut seen: BTreeSet<&String> = BTreeSet::new();
        while let Some(path) = stack.pop() {
            let last = *path.last().expect("non-empty");
            for next in uses.get(last).into_iter().flatten() {
                assert!(
                    next != start,
                    "model's modules import in a circle: {} -> {start}",
                    path.iter()
                        .map(|m| m.as_str())
                        .collect::<Vec<_>>()
                        .join(" -> ")
                );
                if seen.insert(next) {
                    let mut longer = path.clone();
                    longer.push(next);
                    stack.push(longer);
                }
            }
        }
    }
}
