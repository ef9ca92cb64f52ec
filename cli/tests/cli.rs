//! The `rocmforge` binary end to end: `generate` and `tokenize` on the real models against
//! llama.cpp's outputs in `testdata/golden`, and the errors a user can cause. The models
//! come from `cargo xtask fetch-models`; tests that need them fail, saying so, when they
//! are missing.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
#[path = "cli/context.rs"]
mod context;
#[path = "cli/golden.rs"]
mod golden;
#[path = "cli/interrupt.rs"]
mod interrupt;
#[path = "../../testdata/models.rs"]
mod models;
#[path = "cli/placement.rs"]
mod placement;
#[path = "cli/replicas.rs"]
mod replicas;
#[path = "common/stderr.rs"]
mod stderr;

use common::{ctrl_c, read_stderr, run_piped, wait_briefly};
use models::model_path;
use stderr::{assert_stderr_has, stderr};

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

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

/// The tuning flags' values are checked by the argument parser, and on the CPU the
/// AVX-512 kernels give the AVX2 ones' tokens: `--cpu-avx512 off` and
/// `ROCMFORGE_CPU_AVX512=0` change nothing but the speed.
#[test]
fn tuning_flags_are_checked_and_keep_the_cpu_s_tokens() {
    for (flag, value) in [
        ("--host-rows-on-gpu", "1.5"),
        ("--staging-ring", "rings"),
        ("--flash-mma", "0"),
    ] {
        let output = run(&[
            "generate",
            "--gguf",
            "/nonexistent.gguf",
            "--prompt",
            "hi",
            flag,
            value,
        ]);
        assert!(!output.status.success());
        let err = stderr(&output);
        assert!(
            err.starts_with(&format!("error: invalid value '{value}' for '{flag} <")),
            "{err}"
        );
    }
    let model = model_path(GEMMA3);
    let args = ["--max-tokens", "8", "--device", "cpu"];
    let tokens = |json: serde_json::Value| ids(&json["tokens"]);
    let default = tokens(greedy_json(&model, "The capital of France is", &args));
    let flag = [&args[..], &["--cpu-avx512", "off"]].concat();
    assert_eq!(
        tokens(greedy_json(&model, "The capital of France is", &flag)),
        default
    );
    let mut command = vec!["generate", "--gguf", model.to_str().unwrap()];
    command.extend(["--prompt", "The capital of France is", "--temperature", "0"]);
    command.push("--json");
    command.extend(args);
    let output = run_with(&command, &[("ROCMFORGE_CPU_AVX512", "0")], b"");
    assert_eq!(tokens(stdout_json(&output)), default);
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
    // `generate` would fetch the default model, but not offline; `tokenize` never does.
    for args in [&["generate", "--prompt", "hi"][..], &["tokenize", "hi"][..]] {
        let output = rocmforge()
            .args(args)
            .env("ROCMFORGE_MODELS", dir.path())
            .env("ROCMFORGE_OFFLINE", "1")
            .output()
            .unwrap();
        let expected = dir.path().join(SMOLLM2);
        assert_fails_with(&output, expected.to_str().unwrap());
        assert_stderr_has(&output, "run `rocmforge pull`");
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

/// `tokenize --json` of `text` on `model`.
fn tokenize_json(model: &Path, text: &str) -> serde_json::Value {
    let output = run(&[
        "tokenize",
        "--gguf",
        model.to_str().unwrap(),
        "--json",
        text,
    ]);
    serde_json::from_slice(&output.stdout).expect("one JSON object")
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
    let expected = tokenize_json(&model, rendered);
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

/// Runs `rocmforge` with `stdin` as its input and extra environment.
fn run_with(args: &[&str], env: &[(&str, &str)], stdin: &[u8]) -> Output {
    run_piped(rocmforge().args(args).envs(env.iter().copied()), stdin)
}

fn stdout_json(output: &Output) -> serde_json::Value {
    assert!(output.status.success(), "{}", stderr(output));
    serde_json::from_slice(&output.stdout).expect("one JSON object")
}

#[test]
fn long_prompts_come_from_a_file_or_stdin() {
    let model = model_path(SMOLLM2);
    let model = model.to_str().unwrap();
    // 200,000 characters: more than one argument may hold on Linux (128 KiB).
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(4445);
    assert!(text.len() > 200_000);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, &text).unwrap();
    let file = file.to_str().unwrap();
    let from_stdin = stdout_json(&run_with(
        &["tokenize", "-m", model, "--json", "-f", "-"],
        &[],
        text.as_bytes(),
    ));
    let from_file = stdout_json(&run(&[
        "tokenize", "--model", model, "--json", "--file", file,
    ]));
    assert_eq!(from_stdin, from_file);
    // Ten tokens a sentence, and the trailing space.
    assert_eq!(ids(&from_file["tokens"]).len(), 4445 * 10 + 1);
    let short = "The capital of France is";
    let by_flag = greedy_json(Path::new(model), short, &["--max-tokens", "3"]);
    let by_stdin = stdout_json(&run_with(
        &[
            "generate",
            "--gguf",
            model,
            "-f",
            "-",
            "--temperature",
            "0",
            "-n",
            "3",
            "--json",
        ],
        &[],
        short.as_bytes(),
    ));
    assert_eq!(by_flag["tokens"], by_stdin["tokens"]);
    assert_eq!(by_flag["prompt_tokens"], by_stdin["prompt_tokens"]);
    // A directory or a missing file is named; the text and --file together are refused.
    let dir_path = dir.path().to_str().unwrap();
    assert_fails_with(
        &run(&["generate", "-m", model, "-f", dir_path]),
        "is a directory",
    );
    assert_fails_with(
        &run(&["tokenize", "-m", model, "-f", "/nonexistent/prompt.txt"]),
        "/nonexistent/prompt.txt",
    );
    let both = run(&["generate", "-m", model, "-p", "hi", "-f", file]);
    assert!(!both.status.success());
    assert_stderr_has(&both, "cannot be used with");
}

#[test]
fn prompt_progress_goes_to_stderr_when_asked_and_never_to_stdout() {
    let model = model_path(SMOLLM2);
    let model = model.to_str().unwrap();
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(8);
    let args = [
        "generate", "-m", model, "-p", &prompt, "-n", "2", "--temp", "0",
    ];
    let asked = run(&[&args[..], &["--progress"]].concat());
    assert!(asked.status.success(), "{}", stderr(&asked));
    let err = stderr(&asked);
    assert!(
        err.contains("prompt: 81 tokens, layer 30/30 (100%)"),
        "{err}"
    );
    let out = String::from_utf8(asked.stdout).unwrap();
    assert!(!out.contains("layer"), "{out}");
    // stderr is a pipe here: without --progress, nothing is drawn.
    let quiet = run(&args);
    assert!(quiet.status.success());
    assert!(!stderr(&quiet).contains("layer"), "{}", stderr(&quiet));
    assert_eq!(quiet.stdout, out.as_bytes());
}

#[test]
fn info_logs_name_the_stages_without_colours_in_a_file() {
    let model = model_path(SMOLLM2);
    let model = model.to_str().unwrap();
    let env = [("ROCMFORGE_LOG", "info")];
    let output = run_with(
        &[
            "generate", "-m", model, "-p", "Hi", "-n", "2", "--temp", "0",
        ],
        &env,
        b"",
    );
    assert!(output.status.success(), "{}", stderr(&output));
    let err = stderr(&output);
    for stage in [
        "model file",
        "mapped",
        "model loaded",
        "device: cpu",
        "prompt",
        "prompt processed",
        "decoded",
    ] {
        assert!(err.contains(stage), "no {stage:?} in {err}");
    }
    assert!(!err.contains('\u{1b}'), "colours in a pipe: {err:?}");
    let inspect = run_with(&["inspect", model], &env, b"");
    assert_stderr_has(&inspect, "mapped");
    let load = run_with(&["load", "-m", model], &env, b"");
    assert_stderr_has(&load, "model file");
}

#[test]
fn too_many_threads_are_capped_with_a_warning() {
    let model = model_path(SMOLLM2);
    let start = Instant::now();
    let output = run(&[
        "generate",
        "-m",
        model.to_str().unwrap(),
        "-p",
        "Hi",
        "-n",
        "2",
        "--threads",
        "100000",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(start.elapsed() < Duration::from_secs(60));
    let err = stderr(&output);
    assert!(
        err.contains("warning: --threads 100000 is more than the"),
        "{err}"
    );
}

#[test]
fn a_directory_or_a_text_file_as_the_model_is_said_plainly() {
    let dir = tempfile::tempdir().unwrap();
    let dir_path = dir.path().to_str().unwrap();
    for args in [
        &["generate", "--gguf", dir_path, "-p", "hi"][..],
        &["inspect", dir_path][..],
        &["tokenize", "-m", dir_path, "hi"][..],
    ] {
        let output = run(args);
        assert_fails_with(&output, &format!("{dir_path}: is a directory"));
        assert!(!stderr(&output).contains("mapping failed"));
    }
    let text = dir.path().join("hello.gguf");
    std::fs::write(&text, "hello world").unwrap();
    assert_fails_with(
        &run(&["inspect", text.to_str().unwrap()]),
        "not a GGUF file: it starts with \"hell\", expected \"GGUF\"",
    );
}

#[test]
fn a_sampled_run_is_reproduced_from_its_json() {
    let model = model_path(SMOLLM2);
    let model = model.to_str().unwrap();
    let args = [
        "generate",
        "-m",
        model,
        "-p",
        "Once upon a time",
        "-n",
        "8",
        "--json",
    ];
    let first = stdout_json(&run(&args));
    let seed = first["seed"].as_u64().expect("the seed is in the JSON");
    let again = stdout_json(&run(&[&args[..], &["-s", &seed.to_string()]].concat()));
    assert_eq!(again["seed"], first["seed"]);
    assert_eq!(again["tokens"], first["tokens"]);
}

#[test]
fn chat_without_a_template_says_which_built_in_one() {
    // Gemma 3 270M carries no chat template.
    let model = model_path(GEMMA3);
    let output = run(&[
        "generate",
        "-m",
        model.to_str().unwrap(),
        "-p",
        "Hi",
        "--chat",
        "-n",
        "1",
        "--temp",
        "0",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let err = stderr(&output);
    assert!(
        err.contains("has no chat template: using the built-in Gemma template"),
        "{err}"
    );
    // SmolLM2 has its own: nothing is said.
    let smol = model_path(SMOLLM2);
    let output = run(&[
        "generate",
        "-m",
        smol.to_str().unwrap(),
        "-p",
        "Hi",
        "--chat",
        "-n",
        "1",
    ]);
    assert!(
        !stderr(&output).contains("chat template"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn the_summary_counts_in_words_and_warns_of_a_long_context() {
    let model = model_path(SMOLLM2);
    let model = model.to_str().unwrap();
    let one = run(&[
        "generate",
        "-m",
        model,
        "-p",
        "The capital of France is",
        "-n",
        "1",
        "--temp",
        "0",
    ]);
    assert!(one.status.success(), "{}", stderr(&one));
    let err = stderr(&one);
    assert!(err.contains("prompt 5 tokens in"), "{err}");
    assert!(err.contains("generated 1 token;"), "{err}");
    assert!(!err.contains("(-"), "{err}");
    let none = run(&["generate", "-m", model, "-p", "Hi", "-n", "0"]);
    assert!(none.status.success());
    let err = stderr(&none);
    assert!(
        err.contains("prompt of 1 token not processed; generated 0 tokens;"),
        "{err}"
    );
    let long = run(&[
        "generate", "-m", model, "-p", "Hi", "-n", "1", "-c", "100000",
    ]);
    assert!(long.status.success());
    assert_stderr_has(
        &long,
        "warning: --ctx-size 100000 is beyond the model's training context of 8192 tokens",
    );
}

#[test]
fn inspect_json_has_the_name_and_hyper_parameters_and_takes_gguf() {
    let model = model_path(SMOLLM2);
    let model = model.to_str().unwrap();
    let by_position = stdout_json(&run(&["inspect", model, "--json"]));
    let by_flag = stdout_json(&run(&["inspect", "--gguf", model, "--json"]));
    let by_alias = stdout_json(&run(&["inspect", "-m", model, "--json"]));
    assert_eq!(by_position, by_flag);
    assert_eq!(by_position, by_alias);
    assert_eq!(by_position["name"], "Smollm2 135M 8k Lc100K Mix1 Ep2");
    let hp = &by_position["hyper_parameters"];
    assert_eq!(hp["block_count"], 30, "{hp}");
    assert_eq!(hp["context_length"], 8192, "{hp}");
    assert_eq!(hp["attention.head_count_kv"], 3, "{hp}");
    assert_eq!(hp["vocab_size"], 49152, "{hp}");
    let neither = run(&["inspect"]);
    assert!(!neither.status.success());
}

#[test]
fn llama_cpp_spellings_are_accepted() {
    let model = model_path(SMOLLM2);
    let model = model.to_str().unwrap();
    let prompt = "The capital of France is";
    let long = stdout_json(&run(&[
        "generate",
        "--gguf",
        model,
        "--prompt",
        prompt,
        "--temperature",
        "0.7",
        "--seed",
        "42",
        "--ctx-size",
        "64",
        "--threads",
        "1",
        "--max-tokens",
        "6",
        "--json",
    ]));
    let short = stdout_json(&run(&[
        "generate", "-m", model, "-p", prompt, "--temp", "0.7", "-s", "42", "-c", "64", "-t", "1",
        "-n", "6", "--json",
    ]));
    let spelled = stdout_json(&run(&[
        "generate", "--model", model, "-p", prompt, "--temp", "0.7", "-s", "42", "-c", "64", "-n",
        "6", "--json",
    ]));
    assert_eq!(long["tokens"], short["tokens"]);
    assert_eq!(long["tokens"], spelled["tokens"]);
    // -n -1: until the context is full.
    let full = stdout_json(&run(&[
        "generate", "-m", model, "-p", prompt, "--temp", "0", "-c", "12", "-n", "-1", "--json",
    ]));
    assert_eq!(full["stop_reason"], "context_full", "{full}");
    assert_eq!(ids(&full["tokens"]).len(), 12 - 5 + 1, "{full}");
    let bad = run(&["generate", "-m", model, "-p", prompt, "-n", "-2"]);
    assert!(!bad.status.success());
    assert_stderr_has(&bad, "-1 (until the context is full)");
}

/// A runtime status is named once (`hipErrorNoDevice (100)`), not again as its own
/// description. Without a GPU runtime (`platform: none`) there is no status to name.
#[test]
fn devices_names_a_runtime_status_once() {
    let output = run(&["devices"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = String::from_utf8(output.stdout).unwrap();
    for line in text.lines() {
        for word in line.split(|c: char| !c.is_ascii_alphanumeric()) {
            if word.starts_with("hipError") || word.starts_with("cudaError") {
                assert_eq!(line.matches(word).count(), 1, "{line}");
            }
        }
    }
}

/// The Python that has the packages `modules` name (`openai`, `sglang_router`):
/// `$ROCMFORGE_PYTHON` (set by `cargo xtask test`, which installs the pinned packages),
/// else `python3`.
fn python_with(modules: &[&str]) -> String {
    let python = std::env::var("ROCMFORGE_PYTHON").unwrap_or_else(|_| "python3".into());
    for module in modules {
        let found = Command::new(&python)
            .args(["-c", &format!("import {module}")])
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            found,
            "{python} cannot import {module}: run `cargo xtask test`, which installs it"
        );
    }
    python
}

/// Runs the check script `tests/SCRIPT` against this build's `rocmforge` and SmolLM2
/// with a Python that has `modules`; fails unless every check passed. Returns what the
/// script printed.
fn python_checks(script: &str, modules: &[&str]) -> String {
    let model = model_path(SMOLLM2);
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(script);
    let output = Command::new(python_with(modules))
        .arg(&script)
        .arg(env!("CARGO_BIN_EXE_rocmforge"))
        .arg(&model)
        .output()
        .expect("python runs");
    let out = String::from_utf8_lossy(&output.stdout).into_owned();
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{out}\n{err}");
    assert!(out.contains(" passed, 0 failed"), "{out}\n{err}");
    out
}

/// `rocmforge serve` on loopback, driven by the official `openai` client: loading,
/// completions and chat (whole and streamed) against `generate`, stop strings, seeds,
/// eight clients at once, cancellation, prefix reuse, every bad input, a full queue,
/// a bounded load test and SIGTERM (`serve_openai.py` says what each check does).
#[test]
fn serve_answers_the_openai_client() {
    python_checks("serve_openai.py", &["openai"]);
}

/// `serve --device gpu` without a usable GPU is one line saying why and exit 1, before
/// it listens.
#[test]
fn serve_on_a_missing_gpu_is_refused() {
    if hip_backend::Device::open(0).is_ok() {
        let line = "SKIPPED serve_on_a_missing_gpu_is_refused: a GPU is present\n";
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        return;
    }
    let model = model_path(SMOLLM2);
    let output = run(&[
        "serve",
        "--gguf",
        model.to_str().unwrap(),
        "--port",
        "0",
        "--device",
        "gpu",
    ]);
    assert_fails_with(&output, "--device gpu: no usable GPU");
    assert_eq!(output.status.code(), Some(1));
}

/// `--device`: without a usable GPU (no device here, or a build without GPU support),
/// `gpu` is one line saying why and exit 1, `auto` computes on the CPU and says so, and
/// the JSON timings carry the device and the times from the process's start.
#[test]
fn the_device_is_chosen_and_reported() {
    let model = model_path(SMOLLM2);
    if hip_backend::Device::open(0).is_ok() {
        let line = "SKIPPED the_device_is_chosen_and_reported: a GPU is present\n";
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        return;
    }
    let model_arg = model.to_str().unwrap();
    let gpu = run(&[
        "generate", "-m", model_arg, "-p", "Hi", "-n", "2", "--device", "gpu",
    ]);
    assert_fails_with(&gpu, "--device gpu: no usable GPU");
    assert_eq!(gpu.status.code(), Some(1));
    let auto = greedy_json(&model, "The capital of France is", &["-n", "3"]);
    let cpu = greedy_json(
        &model,
        "The capital of France is",
        &["-n", "3", "--device", "cpu"],
    );
    assert_eq!(auto["device"], "cpu");
    assert_eq!(auto["tokens"], cpu["tokens"]);
    let timings = &auto["timings"];
    assert_eq!(timings["device"], "cpu");
    for gpu_only in ["context_ms", "upload_ms", "weights_ms"] {
        assert!(timings[gpu_only].is_null(), "{gpu_only}: {timings}");
    }
    let first = timings["first_token_ms"].as_f64().expect("first_token_ms");
    assert!(first > 0.0, "{timings}");
    // Parse, plan, prompt, first token: in the order they happen.
    let moments: Vec<f64> = [
        "parsed_ms",
        "planned_ms",
        "prompt_start_ms",
        "first_token_ms",
    ]
    .iter()
    .map(|key| timings[key].as_f64().expect(key))
    .collect();
    assert!(moments.windows(2).all(|w| w[0] <= w[1]), "{timings}");
}
