//! The generation loop on the real models: greedy decoding reproduces llama.cpp's first
//! 16 tokens of every golden prompt, streamed text is the decoded tokens, seeded sampling
//! repeats itself, and each way of stopping reports itself.

use std::ops::ControlFlow;
use std::sync::atomic::AtomicBool;

use model::generate::{generate, GenerateError, GenerateOptions, Generation, StopReason};
use model::sampling::SamplingParams;
use model::tokenizer::{DecodeOptions, Tokenizer};
use model::{AttentionMethod, Model};
use tensor_store::TensorStore;

use crate::common::{golden, golden_flash, ids, model_path, GEMMA3, SMOLLM2};

/// Tokens of each golden continuation that must match exactly.
const GREEDY_TOKENS: usize = 16;

fn load(file: &str) -> (Model, Tokenizer) {
    let store = TensorStore::open(model_path(file)).expect("model opens");
    let tokenizer = Tokenizer::from_metadata(store.metadata()).expect("tokenizer builds");
    (Model::load(&store).expect("model loads"), tokenizer)
}

fn greedy(max_tokens: usize, context_size: usize) -> GenerateOptions {
    GenerateOptions {
        sampling: SamplingParams::greedy().validate().unwrap(),
        max_tokens,
        context_size,
        // The golden outputs were made with flash attention off.
        attention: AttentionMethod::Matmul,
        kv_types: Default::default(),
        context_shift: None,
    }
}

/// Runs `generate`, collecting the streamed pieces.
fn run(
    model: &Model,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    options: &GenerateOptions,
) -> (Generation, Vec<String>) {
    let mut pieces = Vec::new();
    let stop = AtomicBool::new(false);
    let output = generate(model, tokenizer, prompt, options, &stop, |piece| {
        pieces.push(piece.to_owned());
        ControlFlow::Continue(())
    })
    .expect("generation runs");
    (output, pieces)
}

fn greedy_matches_llama_cpp(file: &str) {
    let (model, tokenizer) = load(file);
    for case in golden(file)["cases"].as_array().expect("cases") {
        let prompt = ids(&case["prompt_tokens"]);
        let expected = ids(&case["greedy_tokens"]);
        let n = GREEDY_TOKENS.min(expected.len());
        let (output, pieces) = run(&model, &tokenizer, &prompt, &greedy(n, 4096));
        assert_eq!(output.tokens, expected[..n], "{file}: {:?}", case["prompt"]);
        assert_eq!(output.stop_reason, StopReason::MaxTokens);
        assert_eq!(output.prompt_tokens, prompt);
        assert_eq!(pieces.concat(), output.text);
        let decoded = tokenizer
            .decode(&output.tokens, DecodeOptions::TEXT)
            .expect("decodes");
        assert_eq!(output.text, decoded);
        let timings = output.timings;
        assert_eq!(timings.prompt_tokens, prompt.len());
        assert_eq!(timings.decode_passes, n - 1);
        assert!(timings.prompt_tokens_per_s().is_some() && timings.decode_tokens_per_s().is_some());
    }
}

#[test]
fn smollm2_greedy_generation_matches_llama_cpp() {
    greedy_matches_llama_cpp(SMOLLM2);
}

#[test]
fn gemma3_greedy_generation_matches_llama_cpp() {
    greedy_matches_llama_cpp(GEMMA3);
}

/// Bound on |ours - llama.cpp| for a logit printed to 5 decimals: its rounding.
const PRINTED: f32 = 1e-4;

/// With flash attention, llama.cpp's default on a CPU: every prompt position's and every
/// greedy step's top-10 logits and log-sum-exp to the printed digit (each step fed
/// llama.cpp's token), and `generate` gives all 32 greedy tokens.
fn flash_greedy_matches_llama_cpp(file: &str) {
    let (model, tokenizer) = load(file);
    let n_vocab = model.config().n_vocab;
    let reference = golden_flash(file);
    assert_eq!(reference["flash_attn"], "on");
    let check_row = |what: &str, row: &[f32], expected: &serde_json::Value| {
        let lse = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let sum: f64 = row.iter().map(|&v| f64::from(v - lse).exp()).sum();
        let lse = lse + sum.ln() as f32;
        let want = expected["logsumexp"].as_f64().expect("logsumexp") as f32;
        assert!(
            (lse - want).abs() <= PRINTED,
            "{what}: log-sum-exp {lse} vs {want}"
        );
        let logits = expected["logits"].as_array().expect("logits");
        for (id, want) in ids(&expected["ids"]).into_iter().zip(logits) {
            let want = want.as_f64().expect("a logit") as f32;
            let got = row[id as usize];
            assert!(
                (got - want).abs() <= PRINTED,
                "{what}: logit of {id} {got} vs {want}"
            );
        }
    };
    for case in reference["cases"].as_array().expect("cases") {
        let name = format!("{file}: {:?}", case["prompt"]);
        let prompt = ids(&case["tokens"]);
        let expected = ids(&case["greedy_tokens"]);
        assert_eq!(expected.len(), 32, "{name}");
        let context = prompt.len() + expected.len();
        let mut cache = model
            .new_cache(context)
            .with_attention(AttentionMethod::Flash)
            .with_context(context.max(64));
        let all = model
            .forward_all_logits(&prompt, &mut cache)
            .expect("prompt");
        for (pos, expected) in case["positions"]
            .as_array()
            .expect("rows")
            .iter()
            .enumerate()
        {
            check_row(
                &format!("{name} position {pos}"),
                &all[pos * n_vocab..][..n_vocab],
                expected,
            );
        }
        let mut cache = model
            .new_cache(context)
            .with_attention(AttentionMethod::Flash)
            .with_context(context.max(64));
        let mut row = model.forward(&prompt, &mut cache).expect("prompt");
        let rows = case["greedy_positions"].as_array().expect("greedy rows");
        for (step, (&token, expected)) in expected.iter().zip(rows).enumerate() {
            check_row(&format!("{name} greedy step {step}"), &row, expected);
            row = model.forward(&[token], &mut cache).expect("decode");
        }
        // The user's path: the generation loop with its defaults' attention.
        let options = GenerateOptions {
            attention: AttentionMethod::Flash,
            kv_types: Default::default(),
            context_shift: None,
            ..greedy(expected.len(), 4096)
        };
        let (output, _) = run(&model, &tokenizer, &prompt, &options);
        assert_eq!(output.tokens, expected, "{name}");
    }
}

#[test]
fn smollm2_flash_greedy_generation_matches_llama_cpp() {
    flash_greedy_matches_llama_cpp(SMOLLM2);
}

#[test]
fn gemma3_flash_greedy_generation_matches_llama_cpp() {
    flash_greedy_matches_llama_cpp(GEMMA3);
}

#[test]
fn generation_stops_for_each_reason() {
    let (model, tokenizer) = load(SMOLLM2);
    let case = &golden(SMOLLM2)["cases"][0];
    let prompt = ids(&case["prompt_tokens"]);
    let expected = ids(&case["greedy_tokens"]);

    // A context three positions longer than the prompt: three tokens are fed back, the
    // fourth is sampled and then there is no room.
    let (output, _) = run(&model, &tokenizer, &prompt, &greedy(100, prompt.len() + 3));
    assert_eq!(output.stop_reason, StopReason::ContextFull);
    assert_eq!(output.tokens, expected[..4]);

    let e = generate(
        &model,
        &tokenizer,
        &prompt,
        &greedy(8, prompt.len() - 1),
        &AtomicBool::new(false),
        |_| ControlFlow::Continue(()),
    )
    .unwrap_err();
    assert!(matches!(e, GenerateError::PromptTooLong { .. }), "{e}");

    let stopped = AtomicBool::new(true);
    let output = generate(
        &model,
        &tokenizer,
        &prompt,
        &greedy(8, 64),
        &stopped,
        |_| ControlFlow::Continue(()),
    )
    .unwrap();
    assert_eq!(
        (output.stop_reason, output.tokens.len()),
        (StopReason::Interrupted, 0)
    );

    let never = AtomicBool::new(false);
    let output = generate(&model, &tokenizer, &prompt, &greedy(8, 64), &never, |_| {
        ControlFlow::Break(())
    })
    .unwrap();
    assert_eq!(
        (output.stop_reason, output.tokens.len()),
        (StopReason::CallbackStopped, 1)
    );
}

#[test]
fn end_of_generation_ends_the_loop_unprinted() {
    let (model, tokenizer) = load(SMOLLM2);
    // The chat format makes the model close its turn with <|im_end|> after a short answer.
    let text = "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n";
    let prompt = tokenizer
        .encode(text, model::tokenizer::EncodeOptions::PROMPT)
        .unwrap();
    let (output, pieces) = run(&model, &tokenizer, &prompt, &greedy(64, 4096));
    assert_eq!(
        output.stop_reason,
        StopReason::EndOfGeneration,
        "{:?}",
        output.text
    );
    let end = output.end_token.expect("end token");
    assert!(tokenizer.is_end_of_generation(end));
    assert!(!output.tokens.contains(&end));
    assert!(!pieces.concat().contains("<|im_end|>"));
}

#[test]
fn seeded_sampling_repeats_itself() {
    let (model, tokenizer) = load(SMOLLM2);
    let prompt = ids(&golden(SMOLLM2)["cases"][0]["prompt_tokens"]);
    let sampled = |seed| {
        let params = SamplingParams {
            temperature: 1.5,
            seed,
            ..SamplingParams::default()
        };
        let options = GenerateOptions {
            sampling: params.validate().unwrap(),
            max_tokens: 12,
            context_size: 4096,
            attention: AttentionMethod::Matmul,
            kv_types: Default::default(),
            context_shift: None,
        };
        run(&model, &tokenizer, &prompt, &options).0.tokens
    };
    let first = sampled(11);
    assert_eq!(first.len(), 12);
    assert_eq!(first, sampled(11));
    assert_ne!(first, sampled(12));
}
