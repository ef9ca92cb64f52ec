//! `rocmforge perplexity` on the real models against llama.cpp's `llama-perplexity`
//! outputs in `testdata/perplexity` (its README says how they were made): the printed
//! figures must be the same to the last digit, and a base file of log-probabilities the
//! same bytes. The models come from `cargo xtask fetch-models`; the tests fail, saying
//! so, when they are missing.

use std::path::Path;
use std::process::{Command, Output};

use sha2::{Digest, Sha256};

#[path = "../../testdata/models.rs"]
mod models;
#[path = "common/stderr.rs"]
mod stderr;

use models::model_path;
use stderr::{assert_stderr_has, stderr};

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

fn text_path() -> String {
    format!(
        "{}/../testdata/perplexity/alice-chapter-1.txt",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn perplexity(model: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rocmforge"))
        .args(["perplexity", "--device", "cpu", "-t", "2", "-m"])
        .arg(model)
        .args(args)
        .output()
        .expect("rocmforge runs")
}

/// The run's standard output, which must have succeeded.
fn stdout(output: &Output) -> String {
    assert!(output.status.success(), "{}", stderr(output));
    String::from_utf8(output.stdout.clone()).expect("UTF-8")
}

/// A failure: non-zero exit, one line on stderr containing `expected`, no panic.
fn assert_fails_with(output: &Output, expected: &str) {
    let err = stderr(output);
    assert!(!output.status.success(), "succeeded: {err}");
    assert!(err.contains(expected), "stderr lacks {expected:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn smollm2_gives_llama_cpp_s_perplexity() {
    let model = model_path(SMOLLM2);
    let text = text_path();
    let output = perplexity(
        &model,
        &["-f", &text, "-c", "128", "-b", "128", "--chunks", "4"],
    );
    assert_eq!(
        stdout(&output),
        include_str!("../../testdata/perplexity/SmolLM2-135M-Instruct.Q4_1.c128.chunks4.txt")
    );
    assert_stderr_has(&output, "3087 tokens, 4 windows of 128, 63 scored each");
}

/// Batches under 64 tokens take another attention kernel, in llama.cpp as here: other
/// figures, llama.cpp's for the same `-b`.
#[test]
fn smollm2_small_batches_give_llama_cpp_s_figures_for_that_batch() {
    let model = model_path(SMOLLM2);
    let text = text_path();
    let output = perplexity(
        &model,
        &["-f", &text, "-c", "128", "-b", "32", "--chunks", "4"],
    );
    assert_eq!(
        stdout(&output),
        include_str!("../../testdata/perplexity/SmolLM2-135M-Instruct.Q4_1.c128.b32.chunks4.txt")
    );
}

/// The whole text, 24 windows: about a minute on two cores.
#[test]
#[ignore]
fn smollm2_gives_llama_cpp_s_perplexity_over_the_whole_text() {
    let model = model_path(SMOLLM2);
    let text = text_path();
    let output = perplexity(&model, &["-f", &text, "-c", "128", "-b", "128"]);
    assert_eq!(
        stdout(&output),
        include_str!("../../testdata/perplexity/SmolLM2-135M-Instruct.Q4_1.c128.txt")
    );
}

#[test]
fn gemma3_gives_llama_cpp_s_perplexity_with_bos_in_each_window() {
    let model = model_path(GEMMA3);
    let text = text_path();
    // Smaller batches than the window: the same figures.
    let output = perplexity(
        &model,
        &["-f", &text, "-c", "128", "-b", "64", "--chunks", "4"],
    );
    assert_eq!(
        stdout(&output),
        include_str!("../../testdata/perplexity/gemma-3-270m-q4_k_m.c128.chunks4.txt")
    );
}

/// A quantized KV cache (`-ctk`/`-ctv`): llama.cpp's figures for the same cache types,
/// its rotation of what the cache holds and its kernels on the quantized rows included.
#[test]
fn quantized_caches_give_llama_cpp_s_perplexity() {
    let text = text_path();
    for (model, types, expected) in [
        (
            SMOLLM2,
            ["q8_0", "q8_0"],
            include_str!(
                "../../testdata/perplexity/SmolLM2-135M-Instruct.Q4_1.c128.chunks4.ctk-q8_0.ctv-q8_0.txt"
            ),
        ),
        (
            SMOLLM2,
            ["q4_0", "q4_0"],
            include_str!(
                "../../testdata/perplexity/SmolLM2-135M-Instruct.Q4_1.c128.chunks4.ctk-q4_0.ctv-q4_0.txt"
            ),
        ),
        (
            GEMMA3,
            ["q8_0", "q8_0"],
            include_str!(
                "../../testdata/perplexity/gemma-3-270m-q4_k_m.c128.chunks4.ctk-q8_0.ctv-q8_0.txt"
            ),
        ),
    ] {
        let output = perplexity(
            &model_path(model),
            &[
                "-f", &text, "-c", "128", "-b", "128", "--chunks", "4", "--ctk", types[0],
                "--ctv", types[1],
            ],
        );
        assert_eq!(stdout(&output), expected, "{model} {types:?}");
    }
}

/// Cache types the model or the settings cannot take are refused in one line.
#[test]
fn cache_types_that_cannot_be_computed_are_refused() {
    let model = model_path(SMOLLM2);
    let text = text_path();
    let output = perplexity(
        &model,
        &[
            "-f",
            &text,
            "-c",
            "128",
            "--ctv",
            "q8_0",
            "--flash-attn",
            "off",
        ],
    );
    assert_fails_with(&output, "flash attention");
    let output = perplexity(&model, &["-f", &text, "-c", "128", "--ctk", "q5_1"]);
    assert_fails_with(&output, "\"q5_1\" is not one of f16, q8_0, q4_0");
}

/// Writes SmolLM2's base file; checks it is llama.cpp's to the byte, then compares the
/// model with itself and, with flash attention off, with the base computed with it on.
#[test]
fn smollm2_base_file_is_llama_cpp_s_and_its_kl_divergence_too() {
    let model = model_path(SMOLLM2);
    let text = text_path();
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("smollm2.kld");
    let base_arg = base.to_str().unwrap();
    let output = perplexity(
        &model,
        &[
            "-f",
            &text,
            "-c",
            "128",
            "-b",
            "128",
            "--chunks",
            "4",
            "--kl-divergence-base",
            base_arg,
        ],
    );
    // Writing the base, llama.cpp takes each token's log-likelihood in f32.
    assert_eq!(
        stdout(&output),
        include_str!("../../testdata/perplexity/SmolLM2-135M-Instruct.Q4_1.c128.chunks4.base.txt")
    );
    let digest = Sha256::digest(std::fs::read(&base).unwrap());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        hex,
        include_str!(
            "../../testdata/perplexity/SmolLM2-135M-Instruct.Q4_1.c128.chunks4.base.sha256"
        )
        .trim()
    );

    let output = perplexity(
        &model,
        &["--kl-divergence-base", base_arg, "--kl-divergence"],
    );
    let same = stdout(&output);
    assert_eq!(
        same,
        include_str!(
            "../../testdata/perplexity/SmolLM2-135M-Instruct.Q4_1.c128.chunks4.kld-self.txt"
        )
    );
    assert!(same.contains("Same top p: 100.000 ± 0.000 %"), "{same}");
    assert!(same.contains("Mean    KLD:   0.000000 ±"), "{same}");

    let output = perplexity(
        &model,
        &[
            "--kl-divergence-base",
            base_arg,
            "--kl-divergence",
            "--fa",
            "off",
        ],
    );
    assert_eq!(
        stdout(&output),
        include_str!(
            "../../testdata/perplexity/SmolLM2-135M-Instruct.Q4_1.c128.chunks4.kld-fa-off.txt"
        )
    );

    // A base file for another context or another vocabulary is refused, by field.
    let output = perplexity(
        &model,
        &[
            "--kl-divergence-base",
            base_arg,
            "--kl-divergence",
            "-c",
            "256",
        ],
    );
    assert_fails_with(&output, "n_ctx is 128, but --ctx-size is 256");
    let gemma = model_path(GEMMA3);
    let output = perplexity(
        &gemma,
        &["--kl-divergence-base", base_arg, "--kl-divergence"],
    );
    assert_fails_with(
        &output,
        "n_vocab is 49152, but the model's vocabulary is 262144",
    );
}

#[test]
fn bad_inputs_are_one_line_errors_naming_the_problem() {
    let model = model_path(SMOLLM2);
    let dir = tempfile::tempdir().unwrap();

    let short = dir.path().join("short.txt");
    std::fs::write(&short, "Too short a text for two windows.").unwrap();
    let output = perplexity(&model, &["-f", short.to_str().unwrap(), "-c", "128"]);
    assert_fails_with(&output, "but a context of 128 needs at least 256");

    let missing = dir.path().join("missing.txt");
    let output = perplexity(&model, &["-f", missing.to_str().unwrap()]);
    assert_fails_with(&output, "missing.txt");

    let garbage = dir.path().join("garbage.kld");
    std::fs::write(&garbage, b"_logits_\x80\x00\x00\x00\x00\x00\x00\x00").unwrap();
    let output = perplexity(
        &model,
        &[
            "--kl-divergence-base",
            garbage.to_str().unwrap(),
            "--kl-divergence",
        ],
    );
    assert_fails_with(&output, "header is cut short");

    let output = perplexity(
        &model,
        &[
            "--kl-divergence-base",
            missing.to_str().unwrap(),
            "--kl-divergence",
        ],
    );
    assert_fails_with(&output, "opening the base file");

    let output = perplexity(&model, &["-f", &text_path(), "--chunks", "0"]);
    assert_fails_with(&output, "at least 1 window");
}
