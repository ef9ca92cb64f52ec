//! `tokenize` and greedy `generate` against llama.cpp's outputs in `testdata/golden`.

use super::*;

/// llama.cpp's reference outputs for a model, from the repository's `testdata/golden`.
fn golden(file: &str) -> serde_json::Value {
    let text = match file {
        SMOLLM2 => include_str!("../../../testdata/golden/SmolLM2-135M-Instruct.Q4_1.json"),
        GEMMA3 => include_str!("../../../testdata/golden/gemma-3-270m-q4_k_m.json"),
        other => panic!("no reference outputs for {other}"),
    };
    serde_json::from_str(text).expect("golden file is JSON")
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

        let json = tokenize_json(&model, prompt);
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

fn greedy_matches_golden(file: &str) {
    let model = model_path(file);
    for case in golden(file)["cases"].as_array().expect("cases") {
        let prompt = case["prompt"].as_str().expect("prompt");
        // The golden outputs were made with flash attention off.
        let json = greedy_json(
            &model,
            prompt,
            &["--max-tokens", "16", "--flash-attn", "off"],
        );
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

/// `generate` with its defaults (flash attention, as llama.cpp's own default on a CPU)
/// gives the 32 tokens llama.cpp gives with its defaults.
fn default_greedy_matches_golden_flash(file: &str) {
    let model = model_path(file);
    let text = match file {
        SMOLLM2 => include_str!("../../../testdata/golden-fa/SmolLM2-135M-Instruct.Q4_1.json"),
        GEMMA3 => include_str!("../../../testdata/golden-fa/gemma-3-270m-q4_k_m.json"),
        other => panic!("no reference outputs for {other}"),
    };
    let reference: serde_json::Value = serde_json::from_str(text).expect("golden file is JSON");
    for case in reference["cases"].as_array().expect("cases") {
        let prompt = case["prompt"].as_str().expect("prompt");
        // The CPU's defaults: only the attention flag is left to its default.
        let json = greedy_json(&model, prompt, &["--max-tokens", "32", "--device", "cpu"]);
        assert_eq!(
            ids(&json["prompt_tokens"]),
            ids(&case["tokens"]),
            "{prompt:?}"
        );
        assert_eq!(
            ids(&json["tokens"]),
            ids(&case["greedy_tokens"]),
            "{file}: {prompt:?}"
        );
    }
}

#[test]
fn default_greedy_generate_matches_llama_cpp_s_default_on_smollm2() {
    default_greedy_matches_golden_flash(SMOLLM2);
}

#[test]
fn default_greedy_generate_matches_llama_cpp_s_default_on_gemma3() {
    default_greedy_matches_golden_flash(GEMMA3);
}
