//! The `rocmforge` binary end to end: `generate` and `tokenize` on the real models against
//! llama.cpp's outputs in `shared/golden`, and the errors a user can cause. The models
//! come from `cargo xtask fetch-models`; tests that need them fail, saying so, when they
//! are missing.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ROCMFORGE_MODELS") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache/rocmforge/models")
}

fn model_path(file: &str) -> PathBuf {
    let path = models_dir().join(file);
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask fetch-models` first",
        path.display()
    );
    path
}

fn golden(file: &str) -> serde_json::Value {
    let shared = match std::env::var_os("ROCMFORGE_SHARED") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"),
    };
    let path = shared
        .join("golden")
        .join(format!("{}.json", file.trim_end_matches(".gguf")));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).expect("golden file is JSON")
}

fn ids(value: &serde_json::Value) -> Vec<u64> {
    value
        .as_array()
        .expect("an array")
        .iter()
        .map(|v| v.as_u64().expect("an id"))
        .collect()
}

fn rocmforge() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rocmforge"))
}

fn run(args: &[&str]) -> Output {
    rocmforge().args(args).output().expect("rocmforge runs")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A failure: non-zero exit, one line on stderr containing `expected`, no panic.
fn assert_fails_with(output: &Output, expected: &str) {
    let err = stderr(output);
    assert!(!output.status.success(), "succeeded: {err}");
    assert!(err.contains(expected), "stderr lacks {expected:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
}

#[test]
fn bad_sampling_values_are_refused_before_loading() {
    let cases = [
        (
            "--temperature",
            "-1",
            "temperature must be a finite number >= 0, got -1",
        ),
        (
            "--temperature",
            "NaN",
            "temperature must be a finite number >= 0, got NaN",
        ),
        ("--top-p", "1.5", "top-p must be in (0, 1], got 1.5"),
        ("--top-p", "0", "top-p must be in (0, 1], got 0"),
        ("--min-p", "-0.1", "min-p must be in [0, 1], got -0.1"),
        (
            "--repeat-penalty",
            "0",
            "repeat penalty must be a finite number > 0, got 0",
        ),
    ];
    for (flag, value, message) in cases {
        // The file does not exist: the value is refused before it is looked for.
        let output = run(&[
            "generate",
            "--gguf",
            "/nonexistent.gguf",
            "--prompt",
            "hi",
            flag,
            value,
        ]);
        assert_fails_with(&output, message);
    }
    let output = run(&[
        "generate",
        "--gguf",
        "/nonexistent.gguf",
        "--prompt",
        "hi",
        "--top-k",
        "-3",
    ]);
    assert!(!output.status.success());
    // A usage error from the argument parser: its message names the flag and the value.
    assert!(!output.status.success());
    let err = stderr(&output);
    assert!(
        err.starts_with("error: invalid value '-3' for '--top-k <TOP_K>'"),
        "{err}"
    );
}

#[test]
fn a_missing_model_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nothing-here.gguf");
    let missing = missing.to_str().unwrap();
    assert_fails_with(
        &run(&["generate", "--gguf", missing, "--prompt", "hi"]),
        missing,
    );
    assert_fails_with(&run(&["tokenize", "--gguf", missing, "hi"]), missing);
}

#[test]
fn a_missing_default_model_says_how_to_fetch_it() {
    let dir = tempfile::tempdir().unwrap();
    for args in [&["generate", "--prompt", "hi"][..], &["tokenize", "hi"][..]] {
        let output = rocmforge()
            .args(args)
            .env("ROCMFORGE_MODELS", dir.path())
            .output()
            .unwrap();
        let expected = dir.path().join(SMOLLM2);
        assert_fails_with(&output, expected.to_str().unwrap());
        assert!(
            stderr(&output).contains("cargo xtask fetch-models"),
            "{}",
            stderr(&output)
        );
    }
}

#[test]
fn a_garbage_file_is_one_line_without_panic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("garbage.gguf");
    let bytes: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&path, bytes).unwrap();
    let path = path.to_str().unwrap();
    assert_fails_with(&run(&["generate", "--gguf", path, "--prompt", "hi"]), path);
    assert_fails_with(&run(&["tokenize", "--gguf", path, "hi"]), path);
}

fn tokenize_matches_golden(file: &str) {
    let model = model_path(file);
    for case in golden(file)["cases"].as_array().expect("cases") {
        let prompt = case["prompt"].as_str().expect("prompt");
        let expected = ids(&case["prompt_tokens"]);
        let output = run(&["tokenize", "--gguf", model.to_str().unwrap(), prompt]);
        assert!(output.status.success(), "{}", stderr(&output));
        let text = String::from_utf8(output.stdout).unwrap();
        let got: Vec<u64> = text
            .split_whitespace()
            .map(|id| id.parse().unwrap())
            .collect();
        assert_eq!(got, expected, "{file}: {prompt:?}");
        assert!(text.ends_with('\n'));

        let output = run(&[
            "tokenize",
            "--gguf",
            model.to_str().unwrap(),
            "--json",
            prompt,
        ]);
        let json: serde_json::Value =
            serde_json::from_slice(&output.stdout).expect("one JSON object");
        assert_eq!(ids(&json["tokens"]), expected);
    }
}

#[test]
fn tokenize_gives_llama_cpp_ids_on_smollm2() {
    tokenize_matches_golden(SMOLLM2);
}

#[test]
fn tokenize_gives_llama_cpp_ids_and_bos_on_gemma3() {
    tokenize_matches_golden(GEMMA3);
}

fn greedy_json(model: &Path, prompt: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "generate",
        "--gguf",
        model.to_str().unwrap(),
        "--prompt",
        prompt,
    ];
    args.extend_from_slice(&["--temperature", "0", "--json"]);
    args.extend_from_slice(extra);
    let output = run(&args);
    assert!(output.status.success(), "{}", stderr(&output));
    serde_json::from_slice(&output.stdout).expect("one JSON object")
}

fn greedy_matches_golden(file: &str) {
    let model = model_path(file);
    for case in golden(file)["cases"].as_array().expect("cases") {
        let prompt = case["prompt"].as_str().expect("prompt");
        let json = greedy_json(&model, prompt, &["--max-tokens", "16"]);
        assert_eq!(
            ids(&json["prompt_tokens"]),
            ids(&case["prompt_tokens"]),
            "{prompt:?}"
        );
        assert_eq!(
            ids(&json["tokens"]),
            ids(&case["greedy_tokens"])[..16],
            "{file}: {prompt:?}"
        );
        let golden_text = case["greedy_text"].as_str().unwrap();
        assert!(
            golden_text.starts_with(json["text"].as_str().unwrap()),
            "{json}"
        );
        let timings = &json["timings"];
        for key in [
            "load_ms",
            "prompt_ms",
            "prompt_tokens_per_s",
            "decode_tokens_per_s",
        ] {
            assert!(
                timings[key].as_f64().is_some_and(|v| v > 0.0),
                "{key}: {timings}"
            );
        }
    }
}

#[test]
fn greedy_generate_matches_llama_cpp_on_smollm2() {
    greedy_matches_golden(SMOLLM2);
}

#[test]
fn greedy_generate_matches_llama_cpp_on_gemma3() {
    greedy_matches_golden(GEMMA3);
}

#[test]
fn generate_streams_text_and_stops_at_max_tokens() {
    let model = model_path(SMOLLM2);
    let json = greedy_json(&model, "The capital of France is", &["--max-tokens", "8"]);
    let output = run(&[
        "generate",
        "--gguf",
        model.to_str().unwrap(),
        "--prompt",
        "The capital of France is",
        "--temperature",
        "0",
        "--max-tokens",
        "8",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = String::from_utf8(output.stdout).unwrap();
    assert_eq!(text, format!("{}\n", json["text"].as_str().unwrap()));
    assert_eq!(json["stop_reason"], "max_tokens");
    assert_eq!(ids(&json["tokens"]).len(), 8);
}

#[test]
fn chat_wraps_the_prompt_in_the_template() {
    let model = model_path(SMOLLM2);
    let json = greedy_json(
        &model,
        "What is the capital of France?",
        &["--chat", "--max-tokens", "4"],
    );
    // SmolLM2's own template adds its default system message.
    let rendered = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
                    <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
    let output = run(&[
        "tokenize",
        "--gguf",
        model.to_str().unwrap(),
        "--json",
        rendered,
    ]);
    let expected: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("one JSON object");
    assert_eq!(json["prompt_tokens"], expected["tokens"]);
    // <|im_start|> is id 1 and <|im_end|> id 2 in SmolLM2's vocabulary.
    let prompt = ids(&json["prompt_tokens"]);
    assert_eq!(
        (prompt[0], prompt.iter().filter(|&&id| id == 2).count()),
        (1, 2)
    );
}

#[test]
fn an_over_long_prompt_is_refused() {
    let model = model_path(SMOLLM2);
    let output = run(&[
        "generate",
        "--gguf",
        model.to_str().unwrap(),
        "--prompt",
        "The capital of France is",
        "--ctx-size",
        "3",
    ]);
    assert_fails_with(&output, "the prompt has 5 tokens but the context holds 3");
}

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
    let interrupt = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupt.success());
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let start = Instant::now();
    let status = child.wait().unwrap();
    assert!(start.elapsed() < Duration::from_secs(30));
    assert_eq!(status.code(), Some(130));
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(err.contains("stop: interrupted"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let text = String::from_utf8([&first[..], &rest].concat()).unwrap();
    assert!(text.starts_with(" Paris"), "{text:?}");
}

/// `load` on a machine where this build can use no GPU says why, in one line, and
/// fails; on a machine with one it loads and reports. (A GPU is needed for the success
/// path: it runs in the GPU suite on the device machine.)
#[test]
fn load_says_why_there_is_no_gpu_or_loads() {
    let model = model_path(SMOLLM2);
    let model = model.to_str().expect("a UTF-8 path");
    let output = run(&["load", "--gguf", model, "--json", "--load-mode", "eager"]);
    if output.status.success() {
        let report: serde_json::Value =
            serde_json::from_slice(&output.stdout).expect("one JSON object");
        assert_eq!(report["tensors"], 272, "{report}");
        assert!(
            report["device_allocations"].as_u64().unwrap() <= 4,
            "{report}"
        );
    } else {
        assert_fails_with(&output, "cannot use GPU 0");
    }
    let missing = run(&["load", "--gguf", "/nonexistent/model.gguf"]);
    assert!(!missing.status.success());
    assert!(!stderr(&missing).contains("panicked"));
}

/// The Python that has the `openai` package: `$ROCMFORGE_PYTHON` (set by `cargo xtask
/// test`, which installs the pinned package), else `python3`.
fn openai_python() -> String {
    let python = std::env::var("ROCMFORGE_PYTHON").unwrap_or_else(|_| "python3".into());
    let found = Command::new(&python)
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "{python} cannot import the openai package: run `cargo xtask test`, which installs it"
    );
    python
}

/// `rocmforge serve` on loopback, driven by the official `openai` client: loading,
/// completions and chat (whole and streamed) against `generate`, stop strings, seeds,
/// eight clients at once, cancellation, prefix reuse, every bad input, a full queue,
/// a bounded load test and SIGTERM (`serve_openai.py` says what each check does).
#[test]
fn serve_answers_the_openai_client() {
    let model = model_path(SMOLLM2);
    let python = openai_python();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve_openai.py");
    let output = Command::new(python)
        .arg(&script)
        .arg(env!("CARGO_BIN_EXE_rocmforge"))
        .arg(&model)
        .output()
        .expect("python runs");
    let out = String::from_utf8_lossy(&output.stdout);
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{out}\n{err}");
    assert!(out.contains(" passed, 0 failed"), "{out}\n{err}");
}
