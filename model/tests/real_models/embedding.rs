//! Embeddings: the last hidden states after the final norm, mean-pooled and scaled to
//! unit length, against llama.cpp's `llama-embedding --pooling mean --embd-normalize 2`
//! (`testdata/embedding/`, made as its README says).
//!
//! Tolerance. The CPU pass reproduces llama.cpp's arithmetic step for step (its logits
//! match the golden files' to their printed decimals, `forward.rs`), so the hidden rows
//! are llama.cpp's to float rounding; what is left is the pooling (llama.cpp: a product
//! with a matrix of 1/n in f32, then the norm in f64; here sums in f64) and the seven
//! decimals llama.cpp prints (half of 1e-7). `TOLERANCE` is ten times that last printed
//! digit: measured, the worst component differs by 6e-8 with either attention method
//! (print rounding and a unit of f32 rounding), while the other attention method (flash
//! against two products, f16 against f32 values) moves components by up to 1e-2.

use model::pooling::{mean_pool, mean_pool_normalized};
use model::{AttentionMethod, Model};
use tensor_store::TensorStore;

use crate::common::{ids, model_path, SMOLLM2};

const TOLERANCE: f32 = 1e-6;

fn reference() -> serde_json::Value {
    let text = include_str!("../../../testdata/embedding/SmolLM2-135M-Instruct.Q4_1.json");
    serde_json::from_str(text).expect("the reference parses")
}

fn floats(value: &serde_json::Value) -> Vec<f32> {
    value
        .as_array()
        .expect("a list")
        .iter()
        .map(|v| v.as_f64().expect("a number") as f32)
        .collect()
}

fn load() -> Model {
    let store = TensorStore::open(model_path(SMOLLM2)).expect("model opens");
    Model::load(&store).expect("model loads")
}

fn embedding(model: &Model, tokens: &[u32], attention: AttentionMethod) -> Vec<f32> {
    let mut cache = model.new_cache(tokens.len()).with_attention(attention);
    let rows = model
        .hidden_states(tokens, &mut cache)
        .expect("hidden states");
    assert_eq!(rows.len(), tokens.len() * model.config().n_embd);
    assert_eq!(cache.len(), tokens.len(), "the tokens are in the cache");
    mean_pool_normalized(&rows, model.config().n_embd)
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn mean_pooled_hidden_states_are_llama_cpp_embeddings() {
    let model = load();
    let reference = reference();
    let tokens = ids(&reference["tokens"]);
    for (attention, key) in [
        (AttentionMethod::Flash, "flash_attention_on"),
        (AttentionMethod::Matmul, "flash_attention_off"),
    ] {
        let ours = embedding(&model, &tokens, attention);
        let theirs = floats(&reference[key]);
        let diff = worst(&ours, &theirs);
        eprintln!("{key}: worst difference from llama.cpp {diff:e}");
        assert!(diff <= TOLERANCE, "{key}: worst difference {diff}");
    }
}

/// The reference text's tokens and their hidden states, in one call.
fn reference_hidden_states(model: &Model) -> (Vec<u32>, Vec<f32>) {
    let tokens = ids(&reference()["tokens"]);
    let mut cache = model.new_cache(tokens.len());
    let rows = model
        .hidden_states(&tokens, &mut cache)
        .expect("hidden states");
    (tokens, rows)
}

#[test]
fn the_pooled_vector_is_the_plain_mean_scaled_to_unit_length() {
    let model = load();
    let d = model.config().n_embd;
    let (tokens, rows) = reference_hidden_states(&model);
    // Straightforwardly: sum each component in f32, divide, then divide by the length.
    let n = tokens.len() as f32;
    let mean: Vec<f32> = (0..d)
        .map(|j| rows.iter().skip(j).step_by(d).sum::<f32>() / n)
        .collect();
    let length = mean.iter().map(|v| v * v).sum::<f32>().sqrt();
    let plain: Vec<f32> = mean.iter().map(|v| v / length).collect();
    let pooled = mean_pool_normalized(&rows, d);
    assert!(worst(&pooled, &plain) < 1e-6, "{}", worst(&pooled, &plain));
    assert!(worst(&mean_pool(&rows, d), &mean) < 1e-6);
    let norm = pooled.iter().map(|v| v * v).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-6, "{norm}");
}

#[test]
fn hidden_states_of_a_prompt_are_those_of_its_tokens_one_by_one() {
    let model = load();
    let d = model.config().n_embd;
    let (tokens, whole) = reference_hidden_states(&model);
    let mut cache = model.new_cache(tokens.len());
    let mut stepped = Vec::new();
    for &token in &tokens {
        stepped.extend(
            model
                .hidden_states(&[token], &mut cache)
                .expect("one token"),
        );
    }
    // One token at a time takes the products of a batch of one, which may round
    // otherwise (on SmolLM2's Q4_1 they round the same: no difference at all).
    eprintln!("whole against stepped: {:e}", worst(&whole, &stepped));
    assert!(
        worst(&whole, &stepped) < 1e-3,
        "{}",
        worst(&whole, &stepped)
    );
    // The first position sees only itself either way.
    assert!(worst(&whole[..d], &stepped[..d]) < 1e-3);
}
