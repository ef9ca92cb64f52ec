//! More than one machine: `serve` replicas behind SGLang's router, an existing
//! prefix-aware router from the package registry (`serve_router.py` says what each
//! check does).

use super::*;

/// Two CPU replicas on loopback behind `sglang-router`, the official `openai` client
/// through it: the router registers both and lists their model, a conversation's second
/// turn reuses its first turn's KV blocks on the replica that computed it, and a replica
/// killed mid-run drops out while the run finishes on the other.
#[test]
fn replicas_serve_behind_a_prefix_aware_router() {
    let model = model_path(SMOLLM2);
    let python = openai_python();
    let found = Command::new(&python)
        .args(["-c", "import sglang_router"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "{python} cannot import sglang_router: run `cargo xtask test`, which installs it"
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve_router.py");
    let output = Command::new(&python)
        .arg(&script)
        .arg(env!("CARGO_BIN_EXE_rocmforge"))
        .arg(&model)
        .output()
        .expect("python runs");
    let out = String::from_utf8_lossy(&output.stdout);
    let err = String::from_utf8_lossy(&output.stderr);
    // What the clients saw when the replica died, in the test's output.
    println!("{out}");
    assert!(output.status.success(), "{out}\n{err}");
    assert!(out.contains(" passed, 0 failed"), "{out}\n{err}");
}
