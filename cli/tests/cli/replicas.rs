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
    let out = python_checks("serve_router.py", &["openai", "sglang_router"]);
    // What the clients saw when the replica died, in the test's output.
    println!("{out}");
}
