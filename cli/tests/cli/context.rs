//! `generate --context-shift` end to end on SmolLM2.

use super::{assert_stderr_has, greedy_json, ids, model_path, run};

/// `--context-shift`: when the context fills, its first `--keep` tokens stay and half of
/// the rest leaves, so generation goes on to `--max-tokens`; until the first shift the
/// text is the text of a run that stops when the context is full. With a quantized
/// cache too.
#[test]
fn context_shift_continues_past_a_full_context() {
    let model = model_path("SmolLM2-135M-Instruct.Q4_1.gguf");
    let prompt = "The history of the printing press";
    let full = greedy_json(&model, prompt, &["--max-tokens", "100", "-c", "48"]);
    assert_eq!(full["stop_reason"], "context_full", "{full}");
    let stopped = ids(&full["tokens"]);
    for cache in ["f16", "q8_0"] {
        let json = greedy_json(
            &model,
            prompt,
            &[
                "--max-tokens",
                "100",
                "-c",
                "48",
                "--context-shift",
                "--keep",
                "4",
                "--ctk",
                cache,
                "--ctv",
                cache,
            ],
        );
        assert_eq!(json["stop_reason"], "max_tokens", "{json}");
        let tokens = ids(&json["tokens"]);
        assert_eq!(tokens.len(), 100, "{json}");
        assert!(json["context_shifts"].as_u64().unwrap() >= 2, "{json}");
        // 30 layers of 3 KV heads of 64: f16 two bytes a value, q8_0 34 per 32.
        let bytes = json["kv_cache"]["bytes_per_token"].as_u64().unwrap();
        assert_eq!(
            bytes,
            if cache == "f16" { 23_040 } else { 12_240 },
            "{json}"
        );
        if cache == "f16" {
            // The shift comes one position before the plain run stops.
            let before = stopped.len() - 1;
            assert_eq!(tokens[..before], stopped[..before], "{json}");
        }
    }
    let output = run(&[
        "generate",
        "--gguf",
        model.to_str().unwrap(),
        "--prompt",
        prompt,
        "--keep",
        "4",
    ]);
    assert!(!output.status.success());
    assert_stderr_has(&output, "--context-shift");
}

/// Past every shift, the text is llama.cpp's for the same settings, character for
/// character: its `llama-completion --context-shift` (a context of 256, two threads, as
/// the split attention's chunks depend on them) on SmolLM2 with each cache type (600
/// tokens, three shifts) and on Gemma 3 (400 tokens, two shifts; a BOS token kept
/// besides `--keep`, sliding-window layers). After a shift llama.cpp's later tokens take
/// the cells the shift freed, ahead of the moved ones, and its attention sums follow
/// the cells: so do ours.
#[test]
fn context_shift_gives_llama_cpp_s_text() {
    let smollm2 = "SmolLM2-135M-Instruct.Q4_1.gguf";
    let printing = "The history of the printing press";
    let runs = [
        (
            smollm2,
            printing,
            "f16",
            "600",
            "4",
            3,
            include_str!(
                "../../../testdata/context-shift/SmolLM2-135M-Instruct.Q4_1.c256.keep4.n600.f16.txt"
            ),
        ),
        (
            smollm2,
            printing,
            "q8_0",
            "600",
            "4",
            3,
            include_str!(
                "../../../testdata/context-shift/SmolLM2-135M-Instruct.Q4_1.c256.keep4.n600.q8_0.txt"
            ),
        ),
        (
            smollm2,
            printing,
            "q4_0",
            "600",
            "4",
            3,
            include_str!(
                "../../../testdata/context-shift/SmolLM2-135M-Instruct.Q4_1.c256.keep4.n600.q4_0.txt"
            ),
        ),
        (
            "gemma-3-270m-q4_k_m.gguf",
            "Once upon a time",
            "f16",
            "400",
            "2",
            2,
            include_str!(
                "../../../testdata/context-shift/gemma-3-270m-q4_k_m.c256.keep2.n400.f16.txt"
            ),
        ),
    ];
    for (model, prompt, cache, tokens, keep, shifts, reference) in runs {
        let json = greedy_json(
            &model_path(model),
            prompt,
            &[
                "--max-tokens",
                tokens,
                "-c",
                "256",
                "--context-shift",
                "--keep",
                keep,
                "--threads",
                "2",
                "--device",
                "cpu",
                "--ctk",
                cache,
                "--ctv",
                cache,
            ],
        );
        let run = format!("{model} {cache}");
        assert_eq!(json["stop_reason"], "max_tokens", "{run}: {json}");
        assert_eq!(json["context_shifts"], shifts, "{run}: {json}");
        let text = format!("{prompt}{}", json["text"].as_str().expect("text"));
        // llama-completion ends its output with a blank line.
        assert_eq!(
            reference.strip_suffix("\n\n"),
            Some(text.as_str()),
            "{run}: the text leaves llama.cpp's"
        );
    }
}
