//! The forward pass against llama.cpp: teacher-forced logits and greedy decoding.
//!
//! Tolerances. The kernels reproduce the arithmetic of llama.cpp's x86 CPU backend (the
//! golden files were made with it) step for step, on every CPU: the same activation
//! quantization, the same lanes and reductions in every dot product, the same
//! exponential, the same kernel choice per batch size. The logits are then llama.cpp's
//! own, so we require every argmax to agree (the bar is 98%), every top-10 logit
//! to match within `EXACT_TOLERANCE`, the rounding of the golden files' four printed
//! decimals, and every golden greedy token (the bar is the first 16).

use model::{AttentionMethod, Model, ModelConfig};
use tensor_store::TensorStore;

use crate::common::{golden, ids, model_path, GEMMA3, SMOLLM2};

/// Largest accepted |ours − llama.cpp| for a top-10 logit: half the last printed
/// decimal, plus f32 rounding.
const EXACT_TOLERANCE: f32 = 1e-4;

fn load(file: &str) -> Model {
    let store = TensorStore::open(model_path(file)).expect("model opens");
    Model::load(&store).expect("model loads")
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn teacher_forcing(file: &str) {
    let model = load(file);
    let n_vocab = model.config().n_vocab;
    let golden = golden(file);
    let (mut agree, mut total) = (0usize, 0usize);
    let mut worst = 0f32;
    for case in golden["cases"].as_array().expect("cases") {
        let mut seq = ids(&case["prompt_tokens"]);
        seq.extend(ids(&case["greedy_tokens"]));
        let mut cache = model
            .new_cache(seq.len())
            .with_attention(AttentionMethod::Matmul);
        let logits = model.forward_all_logits(&seq, &mut cache).expect("forward");
        let positions = case["top10_per_position"].as_array().expect("top10");
        assert_eq!(positions.len(), seq.len(), "golden covers every position");
        for (pos, reference) in positions.iter().enumerate() {
            let ours = &logits[pos * n_vocab..(pos + 1) * n_vocab];
            let ref_ids = ids(&reference["ids"]);
            let ref_logits: Vec<f32> = reference["logits"]
                .as_array()
                .expect("logits")
                .iter()
                .map(|v| v.as_f64().expect("a logit") as f32)
                .collect();
            total += 1;
            agree += usize::from(argmax(ours) == ref_ids[0]);
            let mut pos_worst = 0f32;
            for (&id, &l) in ref_ids.iter().zip(&ref_logits) {
                pos_worst = pos_worst.max((ours[id as usize] - l).abs());
            }
            worst = worst.max(pos_worst);
        }
    }
    let rate = agree as f64 / total as f64;
    eprintln!("{file}: argmax agrees at {agree}/{total} positions; worst top-10 logit difference {worst:.6}");
    assert!(
        agree == total,
        "{file}: argmax agrees at {agree}/{total} positions ({rate:.3})"
    );
    assert!(
        worst <= EXACT_TOLERANCE,
        "{file}: a top-10 logit differs by {worst:.6} > {EXACT_TOLERANCE}"
    );
}

fn greedy(file: &str) {
    let model = load(file);
    let golden = golden(file);
    for case in golden["cases"].as_array().expect("cases") {
        let prompt = ids(&case["prompt_tokens"]);
        let expected = ids(&case["greedy_tokens"]);
        let n = expected.len();
        let mut cache = model
            .new_cache(prompt.len() + n)
            .with_attention(AttentionMethod::Matmul);
        let mut logits = model.forward(&prompt, &mut cache).expect("prompt");
        let mut produced = Vec::new();
        for _ in 0..n {
            let next = argmax(&logits);
            produced.push(next);
            logits = model.forward(&[next], &mut cache).expect("decode");
        }
        assert_eq!(
            produced,
            expected[..n],
            "{file}: greedy tokens for {:?}",
            case["prompt"]
        );
    }
}

#[test]
fn smollm2_teacher_forced_logits_match_llama_cpp() {
    teacher_forcing(SMOLLM2);
}

#[test]
fn gemma3_teacher_forced_logits_match_llama_cpp() {
    teacher_forcing(GEMMA3);
}

#[test]
fn smollm2_greedy_decoding_matches_llama_cpp() {
    greedy(SMOLLM2);
}

#[test]
fn gemma3_greedy_decoding_matches_llama_cpp() {
    greedy(GEMMA3);
}

#[test]
fn configs_read_from_real_metadata() {
    let store = TensorStore::open(model_path(SMOLLM2)).unwrap();
    let c = ModelConfig::from_metadata(store.metadata()).unwrap();
    assert_eq!(
        (c.n_layers, c.n_embd, c.n_heads, c.n_kv_heads, c.head_dim),
        (30, 576, 9, 3, 64)
    );
    let store = TensorStore::open(model_path(GEMMA3)).unwrap();
    let c = ModelConfig::from_metadata(store.metadata()).unwrap();
    assert_eq!(
        (c.n_layers, c.n_embd, c.n_heads, c.n_kv_heads, c.head_dim),
        (18, 640, 4, 1, 256)
    );
    let global: Vec<usize> = (0..18)
        .filter(|&i| c.layers[i].sliding_window.is_none())
        .collect();
    assert_eq!(global, [5, 11, 17]);
}
