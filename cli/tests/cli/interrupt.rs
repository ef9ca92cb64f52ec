//! Ctrl-C during a generation and during a load: a clean stop and exit status 130.

use super::*;

#[test]
fn ctrl_c_stops_cleanly_with_status_130() {
    let model = model_path(SMOLLM2);
    let mut child = rocmforge()
        .args([
            "generate",
            "--gguf",
            model.to_str().unwrap(),
            "--prompt",
            "The capital of France is",
        ])
        .args([
            "--temperature",
            "0",
            "--max-tokens",
            "100000",
            "--ctx-size",
            "0",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("rocmforge starts");
    // Wait for the first streamed bytes, then interrupt.
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).expect("text streams");
    ctrl_c(&child);
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let status = wait_briefly(&mut child);
    assert_eq!(status.code(), Some(130));
    let err = read_stderr(&mut child);
    assert!(err.contains("stop: interrupted"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let text = String::from_utf8([&first[..], &rest].concat()).unwrap();
    assert!(text.starts_with(" Paris"), "{text:?}");
}

/// Ctrl-C while `load` sets up the device or uploads: it stops, frees what it took, says
/// so in one line and exits 130. Without a usable GPU, `load` fails first, saying why.
#[test]
fn ctrl_c_during_a_load_exits_130() {
    use std::io::BufRead;
    let model = model_path(SMOLLM2);
    let mut child = rocmforge()
        .args(["load", "--gguf", model.to_str().unwrap()])
        .args(["--load-mode", "eager", "--no-progress"])
        .env("ROCMFORGE_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("rocmforge starts");
    // The handler is in place before the first log line: interrupt once it appears.
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut err = String::new();
    while stderr.read_line(&mut err).expect("stderr") > 0 && !err.contains("model file") {}
    ctrl_c(&child);
    stderr.read_to_string(&mut err).unwrap();
    let status = wait_briefly(&mut child);
    assert!(!err.contains("panicked"), "{err}");
    if err.contains("cannot use GPU") {
        assert_eq!(status.code(), Some(1), "{err}");
        let line = "SKIPPED ctrl_c_during_a_load_exits_130: no usable GPU\n";
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        return;
    }
    assert_eq!(status.code(), Some(130), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(last.starts_with("interrupted: "), "{err}");
}
