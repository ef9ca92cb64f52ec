//! Synthetic models against llama.cpp: the architectures, head layouts and weight types
//! that no real model here covers (`qwen2` with its Q/K/V biases and NeoX RoPE, `qwen3`
//! with its per-head Q/K norms, Llama 3's tokenizer and RoPE divisors, multi-head and
//! multi-query attention, Gemma 3's sliding window and global layer and its optional keys,
//! Gemma 2's alternating windows and soft-capping, Phi-3's fused tensors and long and
//! short RoPE factors, every weight type the kernels claim, tied and untied outputs), and
//! each block type and architecture again with blocks random in every field (`*-random`:
//! all 256 values of every grid-index, sign and sub-scale byte, which a quantizer's
//! output alone does not reach).
//!
//! Each model is generated here, bit for bit, from a spec in `synthetic/generate.rs`;
//! llama.cpp's tokens and teacher-forced logits for the same bytes are in
//! `tests/data/oracle/NAME.json`, made by `tests/data/logitref.cpp` (the commands are in
//! `tests/data/README.md`). Each reference records the SHA-256 of the file it was made
//! from, so a change to the generator fails here until the references are made again.
//!
//! What is compared: the prompt's tokens (our tokenizer against llama.cpp's, on each
//! small vocabulary), then per position of the sequence the argmax, each of llama.cpp's
//! top-8 logits, and the log-sum-exp of the whole row (a change anywhere in the row
//! moves it).
//! See [`Tolerance`] for the bounds and what dominates the differences.

#[path = "synthetic/generate.rs"]
mod generate;
#[path = "synthetic/quantize.rs"]
mod quantize;
#[path = "synthetic/vocab.rs"]
mod vocab;

use std::path::PathBuf;

use gguf_format::GgmlType;
use model::tokenizer::{EncodeOptions, Tokenizer};
use model::{AttentionMethod, Model};
use sha2::{Digest, Sha256};
use tensor_store::TensorStore;

use generate::{build, spec, SPECS};

/// The bounds a synthetic model must meet.
///
/// Both engines compute the same function of the same bytes with the same arithmetic:
/// our kernels reproduce llama.cpp's x86 AVX2 backend (see ARCHITECTURE.md), float
/// weights (F32, F16, BF16) included, and the references come from that build. Every
/// model here (each block and float type, Llama 2/3, Qwen2, Qwen3, Phi-3, Gemma 2 and 3,
/// the mixtures of experts) matches to the references' 5 printed decimals, measured
/// 0.0000: `EXACT` allows their rounding.
///
/// A real defect is far outside the bound: ignoring Llama 3's RoPE divisors moved
/// logits by 9.4, and a router product summed in another order moved one position of
/// a mixture of experts by 0.014. The RMS bound over all compared logits catches
/// systematic shifts that stay under the maximum.
#[derive(Clone, Copy, Debug)]
struct Tolerance {
    /// Largest |ours - llama.cpp| for a top-8 logit or a row's log-sum-exp.
    max: f32,
    /// Root mean square of those differences over the sequence.
    rms: f32,
}

const EXACT: Tolerance = Tolerance {
    max: 1e-4,
    rms: 1e-4,
};

struct Position {
    ids: Vec<u32>,
    logits: Vec<f32>,
    logsumexp: f32,
}

struct Reference {
    sha256: String,
    prompt: String,
    n_vocab: usize,
    tokens: Vec<u32>,
    positions: Vec<Position>,
    /// Greedy decoding from the prompt, one token per batch: the tokens, and the rows
    /// they were taken from (flash attention's references have them).
    greedy_tokens: Vec<u32>,
    greedy_positions: Vec<Position>,
}

/// llama.cpp's references with flash attention off (`oracle/`) and on (`oracle-fa/`).
fn oracle_dir_for(method: AttentionMethod) -> PathBuf {
    let dir = match method {
        AttentionMethod::Matmul => "tests/data/oracle",
        AttentionMethod::Flash => "tests/data/oracle-fa",
    };
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(dir)
}

fn reference(name: &str, method: AttentionMethod) -> Reference {
    let path = oracle_dir_for(method).join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let json: serde_json::Value = serde_json::from_str(&text).expect("reference is JSON");
    let u32s = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .expect("an array")
            .iter()
            .map(|x| x.as_u64().expect("an id") as u32)
            .collect()
    };
    let f32_of = |v: &serde_json::Value| v.as_f64().expect("a number") as f32;
    let positions = |v: &serde_json::Value| -> Vec<Position> {
        v.as_array()
            .map(|a| a.as_slice())
            .unwrap_or_default()
            .iter()
            .map(|p| Position {
                ids: u32s(&p["ids"]),
                logits: p["logits"]
                    .as_array()
                    .expect("logits")
                    .iter()
                    .map(f32_of)
                    .collect(),
                logsumexp: f32_of(&p["logsumexp"]),
            })
            .collect()
    };
    Reference {
        sha256: json["sha256"].as_str().expect("sha256").to_owned(),
        prompt: json["prompt"].as_str().expect("prompt").to_owned(),
        n_vocab: json["n_vocab"].as_u64().expect("n_vocab") as usize,
        tokens: u32s(&json["tokens"]),
        positions: positions(&json["positions"]),
        greedy_tokens: if json["greedy_tokens"].is_null() {
            Vec::new()
        } else {
            u32s(&json["greedy_tokens"])
        },
        greedy_positions: positions(&json["greedy_positions"]),
    }
}

fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

fn logsumexp(row: &[f32]) -> f32 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = row.iter().map(|&v| f64::from(v - max).exp()).sum();
    (f64::from(max) + sum.ln()) as f32
}

/// What one model measured against its reference.
struct Measured {
    positions: usize,
    argmax_agree: usize,
    /// Disagreements where llama.cpp's top two logits are closer than twice the
    /// tolerance: an argmax decided by rounding, not by the model.
    near_ties: usize,
    max_top_diff: f32,
    max_lse_diff: f32,
    /// Root mean square of every top-8 and log-sum-exp difference.
    rms_diff: f32,
}

fn compare(name: &str, tolerance: Tolerance, method: AttentionMethod) -> Measured {
    let spec = spec(name).unwrap_or_else(|| panic!("no synthetic spec named {name}"));
    let reference = reference(name, method);
    let bytes = build(spec).expect("the generator writes a valid file");
    assert_eq!(
        hex_sha256(&bytes),
        reference.sha256,
        "{name}: the generated file differs from the one the reference was made from; \
         make the references again (tests/data/README.md)"
    );
    assert_eq!(spec.prompt, reference.prompt, "{name}: prompt changed");

    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join(format!("{name}.gguf"));
    std::fs::write(&path, &bytes).expect("writing the model");
    let store = TensorStore::open(&path).expect("model opens");
    let model = Model::load(&store).expect("model loads");
    let n_vocab = model.config().n_vocab;
    assert_eq!(n_vocab, reference.n_vocab, "{name}: vocabulary size");

    let tokenizer = Tokenizer::from_metadata(store.metadata()).expect("tokenizer builds");
    let options = EncodeOptions {
        add_special: true,
        parse_special: true,
    };
    let ours = tokenizer
        .encode(spec.prompt, options)
        .expect("prompt encodes");
    assert_eq!(
        ours, reference.tokens,
        "{name}: tokens of {:?}",
        spec.prompt
    );

    let tokens = &reference.tokens;
    // llama.cpp's context in the references: the sequence, at least 64 positions.
    let context = (tokens.len() + reference.greedy_tokens.len()).max(64);
    let mut cache = model
        .new_cache(tokens.len())
        .with_attention(method)
        .with_context(context);
    let logits = model
        .forward_all_logits(tokens, &mut cache)
        .expect("forward pass");
    assert_eq!(
        reference.positions.len(),
        tokens.len(),
        "{name}: every position"
    );
    let mut m = Measured {
        positions: 0,
        argmax_agree: 0,
        near_ties: 0,
        max_top_diff: 0.0,
        max_lse_diff: 0.0,
        rms_diff: 0.0,
    };
    let (mut sum_sq, mut count) = (0f64, 0usize);
    let mut measure = |row: &[f32], expected: &Position| {
        m.positions += 1;
        if argmax(row) == expected.ids[0] as usize {
            m.argmax_agree += 1;
        } else if expected.logits[0] - expected.logits[1] <= 2.0 * tolerance.max {
            m.near_ties += 1;
        }
        for (&id, &value) in expected.ids.iter().zip(&expected.logits) {
            let diff = row[id as usize] - value;
            m.max_top_diff = m.max_top_diff.max(diff.abs());
            sum_sq += f64::from(diff * diff);
        }
        let diff = logsumexp(row) - expected.logsumexp;
        m.max_lse_diff = m.max_lse_diff.max(diff.abs());
        sum_sq += f64::from(diff * diff);
        count += expected.ids.len() + 1;
    };
    for (pos, expected) in reference.positions.iter().enumerate() {
        measure(&logits[pos * n_vocab..(pos + 1) * n_vocab], expected);
    }
    // Greedy decoding as llama.cpp ran it: the prompt in one batch, then one token per
    // batch (the single-token kernels), each step fed llama.cpp's token so that a near
    // tie does not carry over.
    if !reference.greedy_tokens.is_empty() {
        assert_eq!(
            reference.greedy_positions.len(),
            reference.greedy_tokens.len(),
            "{name}: a row per greedy token"
        );
        let mut cache = model
            .new_cache(context)
            .with_attention(method)
            .with_context(context);
        let mut row = model.forward(tokens, &mut cache).expect("prompt");
        for (step, (expected, &token)) in reference
            .greedy_positions
            .iter()
            .zip(&reference.greedy_tokens)
            .enumerate()
        {
            measure(&row, expected);
            if step + 1 < reference.greedy_tokens.len() {
                row = model.forward(&[token], &mut cache).expect("decode");
            }
        }
    }
    m.rms_diff = (sum_sq / count as f64).sqrt() as f32;
    m
}

fn check(name: &str) {
    check_with(name, AttentionMethod::Matmul);
    check_with(name, AttentionMethod::Flash);
}

fn check_with(name: &str, method: AttentionMethod) {
    let tolerance = EXACT;
    let m = compare(name, tolerance, method);
    eprintln!(
        "synthetic {name:<15} {method:?} argmax {:>2}/{:<2} ({} near ties)  max |Δ| top-8 {:.4}  \
         log-sum-exp {:.4}  rms {:.4}  (bounds {} / {})",
        m.argmax_agree,
        m.positions,
        m.near_ties,
        m.max_top_diff,
        m.max_lse_diff,
        m.rms_diff,
        tolerance.max,
        tolerance.rms
    );
    assert_eq!(
        m.argmax_agree + m.near_ties,
        m.positions,
        "{name}: the argmax differs at a position that is not a near tie"
    );
    assert!(
        m.max_top_diff <= tolerance.max && m.max_lse_diff <= tolerance.max,
        "{name}: logits differ by {:.4} (top-8) / {:.4} (log-sum-exp) > {}",
        m.max_top_diff,
        m.max_lse_diff,
        tolerance.max
    );
    assert!(
        m.rms_diff <= tolerance.rms,
        "{name}: logits differ by {:.4} in RMS > {}",
        m.rms_diff,
        tolerance.rms
    );
}

macro_rules! matches_llama_cpp {
    ($($test:ident => $name:literal),* $(,)?) => {$(
        #[test]
        fn $test() {
            check($name);
        }
    )*};
}

matches_llama_cpp! {
    llama_q4_0_matches_llama_cpp => "llama-q4_0",
    llama_q4_1_matches_llama_cpp => "llama-q4_1",
    llama_q5_0_matches_llama_cpp => "llama-q5_0",
    llama_q5_1_matches_llama_cpp => "llama-q5_1",
    llama_q8_0_matches_llama_cpp => "llama-q8_0",
    llama_q2_k_matches_llama_cpp => "llama-q2_k",
    llama_q3_k_matches_llama_cpp => "llama-q3_k",
    llama_q4_k_matches_llama_cpp => "llama-q4_k",
    llama_q5_k_matches_llama_cpp => "llama-q5_k",
    llama_q6_k_matches_llama_cpp => "llama-q6_k",
    llama_iq4_xs_matches_llama_cpp => "llama-iq4_xs",
    llama_iq4_nl_matches_llama_cpp => "llama-iq4_nl",
    llama_iq3_s_matches_llama_cpp => "llama-iq3_s",
    llama_iq3_xxs_matches_llama_cpp => "llama-iq3_xxs",
    llama_iq2_xxs_matches_llama_cpp => "llama-iq2_xxs",
    llama_iq2_xs_matches_llama_cpp => "llama-iq2_xs",
    llama_iq2_s_matches_llama_cpp => "llama-iq2_s",
    llama_iq1_s_matches_llama_cpp => "llama-iq1_s",
    llama_iq1_m_matches_llama_cpp => "llama-iq1_m",
    llama_tq1_0_matches_llama_cpp => "llama-tq1_0",
    llama_tq2_0_matches_llama_cpp => "llama-tq2_0",
    llama_mxfp4_matches_llama_cpp => "llama-mxfp4",
    llama_q2_k_mix_matches_llama_cpp => "llama-q2_k-mix",
    llama_q3_k_m_mix_matches_llama_cpp => "llama-q3_k_m-mix",
    llama_q3_k_s_mix_matches_llama_cpp => "llama-q3_k_s-mix",
    llama_q3_k_l_mix_matches_llama_cpp => "llama-q3_k_l-mix",
    llama_q4_k_s_mix_matches_llama_cpp => "llama-q4_k_s-mix",
    llama_iq4_xs_mix_matches_llama_cpp => "llama-iq4_xs-mix",
    llama_iq3_m_mix_matches_llama_cpp => "llama-iq3_m-mix",
    llama_iq2_m_mix_matches_llama_cpp => "llama-iq2_m-mix",
    llama_f16_matches_llama_cpp => "llama-f16",
    llama_bf16_matches_llama_cpp => "llama-bf16",
    llama_f32_matches_llama_cpp => "llama-f32",
    llama_mha_tied_matches_llama_cpp => "llama-mha-tied",
    llama_mqa_matches_llama_cpp => "llama-mqa",
    llama3_matches_llama_cpp => "llama3",
    qwen2_tied_matches_llama_cpp => "qwen2-tied",
    qwen2_gqa4_matches_llama_cpp => "qwen2-gqa4",
    qwen3_matches_llama_cpp => "qwen3",
    gemma3_matches_llama_cpp => "gemma3",
    gemma3_f16_matches_llama_cpp => "gemma3-f16",
    gemma3_keys_matches_llama_cpp => "gemma3-keys",
    gemma2_matches_llama_cpp => "gemma2",
    phi3_matches_llama_cpp => "phi3",
    phi3_long_matches_llama_cpp => "phi3-long",
    llama_q4_k_long_matches_llama_cpp => "llama-q4_k-long",
    gemma2_long_matches_llama_cpp => "gemma2-long",
    llama_q4_0_random_matches_llama_cpp => "llama-q4_0-random",
    llama_q4_1_random_matches_llama_cpp => "llama-q4_1-random",
    llama_q5_0_random_matches_llama_cpp => "llama-q5_0-random",
    llama_q5_1_random_matches_llama_cpp => "llama-q5_1-random",
    llama_q8_0_random_matches_llama_cpp => "llama-q8_0-random",
    llama_q2_k_random_matches_llama_cpp => "llama-q2_k-random",
    llama_q3_k_random_matches_llama_cpp => "llama-q3_k-random",
    llama_q4_k_random_matches_llama_cpp => "llama-q4_k-random",
    llama_q5_k_random_matches_llama_cpp => "llama-q5_k-random",
    llama_q6_k_random_matches_llama_cpp => "llama-q6_k-random",
    llama_iq2_xxs_random_matches_llama_cpp => "llama-iq2_xxs-random",
    llama_iq2_xs_random_matches_llama_cpp => "llama-iq2_xs-random",
    llama_iq2_s_random_matches_llama_cpp => "llama-iq2_s-random",
    llama_iq3_xxs_random_matches_llama_cpp => "llama-iq3_xxs-random",
    llama_iq3_s_random_matches_llama_cpp => "llama-iq3_s-random",
    llama_iq1_s_random_matches_llama_cpp => "llama-iq1_s-random",
    llama_iq1_m_random_matches_llama_cpp => "llama-iq1_m-random",
    llama_iq4_nl_random_matches_llama_cpp => "llama-iq4_nl-random",
    llama_iq4_xs_random_matches_llama_cpp => "llama-iq4_xs-random",
    llama_tq1_0_random_matches_llama_cpp => "llama-tq1_0-random",
    llama_tq2_0_random_matches_llama_cpp => "llama-tq2_0-random",
    llama_mxfp4_random_matches_llama_cpp => "llama-mxfp4-random",
    qwen2_random_matches_llama_cpp => "qwen2-random",
    qwen3_random_matches_llama_cpp => "qwen3-random",
    phi3_random_matches_llama_cpp => "phi3-random",
    phi3_iq2_xs_random_matches_llama_cpp => "phi3-iq2_xs-random",
    gemma2_random_matches_llama_cpp => "gemma2-random",
    gemma3_random_matches_llama_cpp => "gemma3-random",
    qwen3moe_random_matches_llama_cpp => "qwen3moe-random",
    qwen2moe_random_matches_llama_cpp => "qwen2moe-random",
    llama_moe_random_matches_llama_cpp => "llama-moe-random",
    qwen3moe_all_random_matches_llama_cpp => "qwen3moe-all-random",
    llama_moe_top1_random_matches_llama_cpp => "llama-moe-top1-random",
    gpt_oss_matches_llama_cpp => "gpt-oss",
    gpt_oss_long_matches_llama_cpp => "gpt-oss-long",
}

/// The CPU scheduler runs a mixture of experts as `generate` does: the same layer over
/// the paged pool, so a request alone gets `generate`'s text. (The prompts share no
/// block: a prompt that starts on cached blocks computes only its rest, and with experts
/// a different batch groups the tokens differently, which changes the kernels llama.cpp
/// would take for them, and so ours.)
#[test]
fn moe_requests_alone_in_the_scheduler_give_generates_text() {
    for name in ["qwen3moe-random", "llama-moe-random", "gpt-oss"] {
        let spec = spec(name).expect("a spec");
        let bytes = build(spec).expect("the generator writes a valid file");
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join(format!("{name}.gguf"));
        std::fs::write(&path, &bytes).expect("writing the model");
        let store = TensorStore::open(&path).expect("model opens");
        let model = Model::load(&store).expect("model loads");
        let tokenizer = Tokenizer::from_metadata(store.metadata()).expect("tokenizer builds");
        let long = spec.prompt.repeat(3);
        crate::serve::alone_in_the_scheduler_matches_generate(
            name,
            model,
            std::sync::Arc::new(tokenizer),
            &["The cat", &long],
        );
    }
}

/// Mixture-of-experts files whose expert tensors or router do not fit the metadata are
/// refused at load, naming the tensor and both shapes.
#[test]
fn malformed_expert_tensors_are_refused_naming_the_tensor() {
    let cases: [(&str, generate::Edit, &str); 7] = [
        (
            "qwen3moe-random",
            |name, shape| {
                if name == "blk.1.ffn_up_exps.weight" {
                    shape[2] -= 1;
                }
            },
            "blk.1.ffn_up_exps.weight",
        ),
        (
            "llama-moe-random",
            |name, shape| {
                if name == "blk.0.ffn_down_exps.weight" {
                    shape.swap(0, 1);
                }
            },
            "blk.0.ffn_down_exps.weight",
        ),
        (
            "qwen2moe-random",
            |name, shape| {
                if name == "blk.0.ffn_gate_inp.weight" {
                    shape[1] += 1;
                }
            },
            "blk.0.ffn_gate_inp.weight",
        ),
        (
            "qwen3moe-all-random",
            |name, shape| {
                if name == "blk.0.ffn_gate_exps.weight" {
                    shape.pop();
                }
            },
            "blk.0.ffn_gate_exps.weight",
        ),
        (
            "gpt-oss",
            |name, shape| {
                if name == "blk.2.ffn_down_exps.bias" {
                    shape.swap(0, 1);
                }
            },
            "blk.2.ffn_down_exps.bias",
        ),
        (
            "gpt-oss",
            |name, shape| {
                if name == "blk.1.attn_sinks.weight" {
                    shape[0] += 1;
                }
            },
            "blk.1.attn_sinks.weight",
        ),
        (
            "gpt-oss",
            |name, shape| {
                if name == "blk.0.ffn_gate_inp.bias" {
                    shape.push(2);
                }
            },
            "blk.0.ffn_gate_inp.bias",
        ),
    ];
    for (name, edit, tensor) in cases {
        let spec = spec(name).expect("a spec");
        let bytes = generate::build_edited(spec, edit).expect("a well-formed file");
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join(format!("{name}.gguf"));
        std::fs::write(&path, &bytes).expect("writing the model");
        let store = TensorStore::open(&path).expect("the file parses");
        match Model::load(&store) {
            Err(model::ModelError::TensorShape { name: found, .. }) => {
                assert_eq!(found, tensor, "{name}")
            }
            Err(other) => panic!("{name}: refused for another reason: {other}"),
            Ok(_) => panic!("{name}: a malformed {tensor} was accepted"),
        }
    }
}

#[test]
fn every_spec_has_a_reference_and_a_test() {
    for method in [AttentionMethod::Matmul, AttentionMethod::Flash] {
        every_spec_has_a_reference_for(method);
    }
}

fn every_spec_has_a_reference_for(method: AttentionMethod) {
    let mut references: Vec<String> = std::fs::read_dir(oracle_dir_for(method))
        .expect("tests/data/oracle")
        .map(|e| {
            e.expect("a directory entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter_map(|f| f.strip_suffix(".json").map(str::to_owned))
        .collect();
    references.sort();
    let mut specs: Vec<String> = SPECS.iter().map(|s| s.name.to_owned()).collect();
    specs.sort();
    assert_eq!(references, specs, "one reference per synthetic model");
    let source = include_str!("synthetic.rs");
    for name in &specs {
        assert!(
            source.contains(&format!("=> \"{name}\"")),
            "{name} has no test in synthetic.rs"
        );
    }
}

/// Every `-mix` model has the types llama-quantize's preset gives its tensors:
/// `tests/data/mixes/NAME.txt` is llama.cpp's own choice for each tensor (its
/// `llama_tensor_get_type`, run by `tests/data/mixref.cpp` on the generated file), and
/// every matrix of the file must be listed there with the same type.
#[test]
fn every_mix_has_llama_quantize_s_types() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/mixes");
    let mixes: Vec<_> = SPECS.iter().filter(|s| s.name.ends_with("-mix")).collect();
    assert!(mixes.len() >= 2, "the mixes are found by name");
    for spec in mixes {
        let name = spec.name;
        let path = dir.join(format!("{name}.txt"));
        let listing = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let mut expected: Vec<(String, GgmlType)> = listing
            .lines()
            .map(|line| {
                let (tensor, ty) = line
                    .split_once(' ')
                    .unwrap_or_else(|| panic!("{name}: bad line {line:?}"));
                let ty = GgmlType::ALL
                    .into_iter()
                    .find(|t| t.name().eq_ignore_ascii_case(ty))
                    .unwrap_or_else(|| panic!("{name}: unknown type {ty}"));
                (tensor.to_owned(), ty)
            })
            .collect();
        let bytes = build(spec).expect("the generator writes a valid file");
        let file = gguf_format::parse(&bytes).expect("the generated file parses");
        let mut ours: Vec<(String, GgmlType)> = file
            .tensors
            .iter()
            .filter(|t| t.shape.len() >= 2)
            .map(|t| (t.name.clone(), t.ggml_type))
            .collect();
        expected.sort();
        ours.sort();
        assert_eq!(ours, expected, "{name}: types differ from llama-quantize's");
    }
}

/// The reference quantizers make blocks that decode (with the dequant crate, which is
/// checked against gguf-py's decoders) close to the values they were made from: the
/// synthetic weights are realistic, not random bits.
#[test]
fn synthetic_quantizers_round_trip_within_their_precision() {
    // Relative RMS error bounds: about half a quantization step over the spread of a
    // normal block for each width, with room for the simple (non-searching) scales.
    let cases = [
        (GgmlType::Q4_0, 0.12),
        (GgmlType::Q4_1, 0.10),
        (GgmlType::Q5_0, 0.06),
        (GgmlType::Q5_1, 0.05),
        (GgmlType::Q8_0, 0.006),
        (GgmlType::Q2_K, 0.35),
        (GgmlType::Q3_K, 0.17),
        (GgmlType::Q4_K, 0.10),
        (GgmlType::Q5_K, 0.05),
        (GgmlType::Q6_K, 0.03),
        (GgmlType::IQ4_NL, 0.09),
        (GgmlType::IQ4_XS, 0.09),
        (GgmlType::IQ3_S, 0.15),
        (GgmlType::IQ3_XXS, 0.21),
        (GgmlType::IQ2_XXS, 0.38),
        (GgmlType::IQ2_XS, 0.34),
        (GgmlType::IQ2_S, 0.29),
        (GgmlType::IQ1_S, 0.5),
        (GgmlType::IQ1_M, 0.48),
        (GgmlType::TQ1_0, 0.52),
        (GgmlType::TQ2_0, 0.52),
        (GgmlType::MXFP4, 0.13),
        (GgmlType::F16, 0.001),
        (GgmlType::BF16, 0.005),
        (GgmlType::F32, 0.0),
    ];
    let values = quantize::Rng::new(7).normals(4096, 0.01, 0.05);
    let rms = |v: &[f32]| (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
    for (ty, bound) in cases {
        let bytes = quantize::quantize(ty, &values);
        let mut decoded = vec![0f32; values.len()];
        dequant::decode_f32(ty, &bytes, &mut decoded).expect("blocks decode");
        let error: Vec<f32> = decoded.iter().zip(&values).map(|(d, v)| d - v).collect();
        let relative = rms(&error) / rms(&values);
        assert!(
            relative <= bound,
            "{ty}: relative RMS error {relative:.4} > {bound}"
        );
    }
}

/// The GPU forward pass against the CPU's on every synthetic model, on the GPU machine
/// (SKIPPED without a device).
///
/// The tolerance, derived rather than fixed. Both compute the same function of the same
/// bytes, but activations are re-quantized to 8 bits before every product, and the GPU
/// does it in blocks of 32 for every weight type (the CPU, like llama.cpp, in blocks of
/// 256 for the k-quants) and sums in another order: where a value lands on the other
/// side of a rounding boundary, the two pick neighbouring 8-bit steps, and from there each
/// is one draw of the quantization noise. On these small random models that noise is
/// what separates them: with float weights (no re-quantization) the logits agree to
/// 0.006 of the row's standard deviation; with quantized weights, measured on the H100
/// over all these models, the largest difference in a vocabulary row reached 0.33 of it
/// and the row's root mean square 0.09. The bounds are half again as much: 0.5 for the
/// largest difference (the extreme of thousands of draws) and 0.15 for the root mean
/// square; the argmax must agree wherever the CPU's top two are further apart than the
/// first bound. A wrong head layout, a wrong RoPE pair or a missing norm moves logits by
/// the order of the spread itself.
///
/// Models random in every field are also run with their weights decoded to F32, and each
/// row's bounds widen to twice what the CPU's own arithmetic strays from that exact row
/// (see [`bounds`]).
///
/// Prompts of every length class are held to the same bound ([`PREFILL_LENGTHS`]), also
/// in chunks smaller than the prompt ([`SMALL_BATCHES`]). The synthetic models are small
/// (a few layers of 256 values, vocabularies of a few hundred tokens): the CPU computes
/// even the 2048-token prompt of each in seconds, so no length is skipped.
mod gpu {
    use std::io::Write;

    /// Stop requests, injected allocation failures and budgets beyond the device.
    #[path = "faults.rs"]
    mod faults;

    use model::gpu::{GpuModel, GpuOptions, GpuTuning, PROMPT_BATCH};
    use model::tokenizer::{EncodeOptions, Tokenizer};
    use model::{AttentionMethod, Model};
    use tensor_store::device::UploadMode;
    use tensor_store::TensorStore;

    use super::generate::{build, build_decoded, Blocks, SPECS};
    use super::{argmax, spec};

    /// The spread of a row: its standard deviation.
    fn spread(row: &[f32]) -> f32 {
        let n = row.len() as f64;
        let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let var = row
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n;
        var.sqrt() as f32
    }

    /// Bounds on a row's largest difference and on its root mean square, as fractions of
    /// its spread.
    const MAX_OF_SPREAD: f32 = 0.5;
    const RMS_OF_SPREAD: f32 = 0.15;

    /// The bound for a row's largest difference (also the near-tie margin).
    fn tolerance(row: &[f32]) -> f32 {
        MAX_OF_SPREAD * spread(row)
    }

    /// The largest difference between two rows and its root mean square.
    fn differences(a: &[f32], b: &[f32]) -> (f32, f32) {
        let max = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        let sq = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f32>();
        (max, (sq / a.len() as f32).sqrt())
    }

    /// How far a CPU row strays from the exact one (the same weights decoded to F32, met
    /// by unquantized activations): its largest difference and root mean square, as
    /// fractions of the exact row's spread. Zero without an exact row.
    fn stray(cpu: &[f32], exact: Option<&[f32]>) -> (f32, f32) {
        let Some(exact) = exact else {
            return (0.0, 0.0);
        };
        let sigma = spread(exact).max(f32::MIN_POSITIVE);
        let (max, rms) = differences(cpu, exact);
        (max / sigma, rms / sigma)
    }

    /// The bounds of a row (largest, root mean square, as fractions of the spread) given
    /// how far the CPU's own arithmetic strays from the exact row. Re-quantizing the
    /// activations costs some models more than others: on blocks random in every field
    /// (large sub-block minimums and offsets that cancel in each product) the CPU's rows
    /// strayed up to 0.98 of the spread from the exact ones (`gemma2-random`; 0.52 for
    /// `llama-q2_k-random`), the GPU's, whose activation blocks are 32 values rather
    /// than Q8_K's 256, at most 0.44 (measured on an H200). A GPU no further from the
    /// exact row than the CPU differs from the CPU by at most twice the CPU's stray, so
    /// the bounds widen to that, and the GPU is held to them against the exact row too.
    fn bounds(stray: (f32, f32)) -> (f32, f32) {
        (
            MAX_OF_SPREAD.max(2.0 * stray.0),
            RMS_OF_SPREAD.max(2.0 * stray.1),
        )
    }

    /// The rows of the model of `name` with its weights decoded to F32, for the models
    /// random in every field (whose own arithmetic strays furthest); `None` for the
    /// others, held to the plain bounds.
    struct Exact {
        _dir: tempfile::TempDir,
        _store: TensorStore,
        model: Model,
    }

    impl Exact {
        fn of(name: &str) -> Option<Exact> {
            let spec = spec(name).expect("a spec");
            if spec.blocks != Blocks::Random {
                return None;
            }
            let bytes = build_decoded(spec).expect("the generator writes a valid file");
            let dir = tempfile::tempdir().expect("a temporary directory");
            let path = dir.path().join(format!("{name}-f32.gguf"));
            std::fs::write(&path, &bytes).expect("writing the model");
            let store = TensorStore::open(&path).expect("model opens");
            let model = Model::load(&store).expect("model loads");
            Some(Exact {
                _dir: dir,
                _store: store,
                model,
            })
        }

        fn cache(&self, context: usize) -> model::KvCache {
            self.model
                .new_cache(context)
                .with_attention(AttentionMethod::Matmul)
        }

        /// The last row of `prompt`.
        fn last(&self, prompt: &[u32], context: usize) -> Vec<f32> {
            self.model
                .forward(prompt, &mut self.cache(context))
                .expect("exact prompt")
        }
    }

    /// The gap between a row's two largest values.
    fn margin(row: &[f32]) -> f32 {
        let best = argmax(row);
        let second = row
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != best)
            .fold(f32::NEG_INFINITY, |m, (_, &v)| m.max(v));
        row[best] - second
    }

    /// Prompt lengths whose last logits are held against the CPU's: one token (the
    /// captured decode step), a few (the decode products and the split attention), and
    /// past `MAX_BATCH` (the batch products and the tiled prompt attention) within one
    /// chunk, one token short of a chunk, and four chunks of [`PROMPT_BATCH`] (chunks
    /// that start past position 0 and see the keys of the chunks before).
    const PREFILL_LENGTHS: [usize; 6] = [1, 7, 64, 150, 511, 2048];

    /// (chunk size, prompt length) pairs run with a chunk smaller than the prompt: chunks
    /// that start at positions no multiple of a tile, short last chunks past `MAX_BATCH`
    /// (511 = 5·100 + 11, 2048 = 20·100 + 48), and chunks of the decode path (64 =
    /// 12·5 + 4).
    const SMALL_BATCHES: [(usize, usize); 3] = [(100, 511), (100, 2048), (5, 64)];

    /// The last logits of a prompt, GPU against CPU, under the rule of the teacher-forced
    /// rows: every logit within the tolerance, the same argmax unless the CPU's top two
    /// are within it. Returns the largest difference as a fraction of the spread.
    fn check_prefill(name: &str, len: usize, batch: usize, cpu: &[f32], gpu: &[f32]) -> f32 {
        check_prefill_within(name, len, batch, cpu, gpu, MAX_OF_SPREAD)
    }

    /// As [`check_prefill`], with the bound `bound` of the spread.
    /// Whether a prompt's last logits are within `bound` of the CPU's (see
    /// [`check_prefill_within`]).
    fn prefill_within(cpu: &[f32], gpu: &[f32], bound: f32) -> bool {
        let tol = bound * spread(cpu).max(f32::MIN_POSITIVE);
        let diff = cpu
            .iter()
            .zip(gpu)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        diff <= tol && (argmax(cpu) == argmax(gpu) || margin(cpu) <= tol)
    }

    /// Rows rerouted: a mixture of experts that picks some of its experts per token
    /// decides discontinuously. Where two experts' router probabilities lie within the
    /// GPU's rounding of the router's input (its activations quantized in other blocks
    /// than the CPU's, sums in another order), the GPU may pick the other one, and that
    /// row then differs by the swapped experts' contributions, beyond any bound derived
    /// from the arithmetic. Such rows are counted rather than bounded, and held to at most
    /// one in [`REROUTED_ONE_IN`] of the rows checked: routing that is wrong (an expert,
    /// its weights, a tile) changes most rows, not a few. A dense model, or one whose
    /// tokens use every expert, allows none.
    pub(super) struct Reroutes {
        routes: bool,
        pub rows: usize,
        checked: usize,
    }

    /// Most rerouted rows: one in this many of the rows checked.
    const REROUTED_ONE_IN: usize = 8;

    impl Reroutes {
        pub fn of(name: &str) -> Reroutes {
            let (count, used, _) = spec(name).expect("a spec").experts;
            Reroutes {
                routes: used < count,
                rows: 0,
                checked: 0,
            }
        }

        /// Whether a row beyond the bounds may be a rerouted one.
        pub fn allowed(&self) -> bool {
            self.routes
        }

        /// Counts a row; true when it is beyond the bounds and taken as rerouted.
        pub fn count(&mut self, beyond: bool) -> bool {
            self.checked += 1;
            let rerouted = beyond && self.routes;
            self.rows += usize::from(rerouted);
            rerouted
        }

        pub fn check(&self, name: &str) {
            assert!(
                self.rows * REROUTED_ONE_IN <= self.checked,
                "{name}: {} of {} rows beyond the bounds, more than routing ties explain",
                self.rows,
                self.checked
            );
            if self.rows > 0 {
                eprintln!(
                    "gpu {name}: {} of {} rows rerouted",
                    self.rows, self.checked
                );
            }
        }
    }

    fn check_prefill_within(
        name: &str,
        len: usize,
        batch: usize,
        cpu: &[f32],
        gpu: &[f32],
        bound: f32,
    ) -> f32 {
        assert_eq!(
            gpu.len(),
            cpu.len(),
            "{name}: logits of a {len}-token prompt"
        );
        let sigma = spread(cpu).max(f32::MIN_POSITIVE);
        let tol = bound * sigma;
        let diff = cpu
            .iter()
            .zip(gpu)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff <= tol && (argmax(cpu) == argmax(gpu) || margin(cpu) <= tol),
            "{name}: after a {len}-token prompt in chunks of {batch}, logits differ by {:.3} \
             of their spread (bound {bound:.3}), argmax {} vs {}",
            diff / sigma,
            argmax(cpu),
            argmax(gpu)
        );
        diff / sigma
    }

    /// The synthetic model `name`, written to a temporary folder (kept while the guard
    /// lives), opened and loaded.
    fn open_spec(name: &str) -> (tempfile::TempDir, TensorStore, Model) {
        let spec = spec(name).expect("a spec");
        let bytes = build(spec).expect("the generator writes a valid file");
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join(format!("{name}.gguf"));
        std::fs::write(&path, &bytes).expect("writing the model");
        let store = TensorStore::open(&path).expect("model opens");
        let model = Model::load(&store).expect("model loads");
        (dir, store, model)
    }

    fn skip(test: &str, why: &str) {
        let line = format!("SKIPPED {test}: {why}\n");
        let _ = std::io::stderr().write_all(line.as_bytes());
    }

    /// A GPU model of `model`, or `None` after saying why the test is skipped.
    fn gpu_model(test: &str, model: &Model, mode: UploadMode, context: usize) -> Option<GpuModel> {
        gpu_model_with_batch(test, model, mode, context, PROMPT_BATCH)
    }

    /// As [`gpu_model`], with prompts in chunks of `batch` tokens.
    fn gpu_model_with_batch(
        test: &str,
        model: &Model,
        mode: UploadMode,
        context: usize,
        batch: usize,
    ) -> Option<GpuModel> {
        let options = GpuOptions {
            device: 0,
            mode,
            budget: None,
            context_size: context,
            stop: None,
            tuning: GpuTuning::default(),
        };
        match GpuModel::with_prompt_batch(model, &options, batch) {
            Ok(gpu) => Some(gpu),
            Err(model::ModelError::Gpu { source, .. }) if source.is_unavailable() => {
                skip(test, &source.to_string());
                None
            }
            Err(error) => panic!("{test}: {error}"),
        }
    }

    fn check(name: &str) {
        let test = format!("gpu_{name}");
        let (_dir, store, model) = open_spec(name);
        let tokenizer = Tokenizer::from_metadata(store.metadata()).expect("tokenizer");
        let options = EncodeOptions {
            add_special: true,
            parse_special: true,
        };
        let tokens = tokenizer
            .encode(spec(name).expect("a spec").prompt, options)
            .expect("prompt encodes");
        let n_vocab = model.config().n_vocab;
        let greedy_len = 32;
        // The prompts of PREFILL_LENGTHS are the first tokens of the prompt repeated.
        let longest = PREFILL_LENGTHS.into_iter().max().expect("lengths");
        let sequence: Vec<u32> = tokens.iter().copied().cycle().take(longest).collect();
        let context = (tokens.len() + greedy_len).max(longest + 1);
        let Some(mut gpu) = gpu_model(&test, &model, UploadMode::Background, context) else {
            return;
        };
        let exact = Exact::of(name);
        let mut reroutes = Reroutes::of(name);
        let may_reroute = reroutes.allowed();
        // The CPU's largest stray from the exact rows, and the GPU's.
        let (mut cpu_stray, mut gpu_stray) = (0f32, 0f32);
        // Each row's bounds; the GPU held to them against the exact row too (a row of a
        // model that routes may be rerouted instead: `Reroutes`). Also whether it is.
        let mut measure_stray = |c: &[f32], g: &[f32], e: Option<&[f32]>| {
            let c_stray = stray(c, e);
            let (g_max, g_rms) = stray(g, e);
            let (max, rms) = bounds(c_stray);
            cpu_stray = cpu_stray.max(c_stray.0);
            gpu_stray = gpu_stray.max(g_max);
            let within = g_max <= max && g_rms <= rms;
            assert!(
                within || may_reroute,
                "{name}: the GPU strays {g_max:.3} (largest) and {g_rms:.3} (rms) of the \
                 spread from the exact logits, bounds {max:.3} and {rms:.3}"
            );
            (max, rms, !within)
        };

        // Teacher-forced logits, every position.
        // The GPU's tolerance was derived against this computation.
        let mut cache = model
            .new_cache(context)
            .with_attention(AttentionMethod::Matmul);
        let cpu = model
            .forward_all_logits(&tokens, &mut cache)
            .expect("cpu forward");
        let got = gpu.forward_all_logits(&tokens).expect("gpu forward");
        assert_eq!(got.len(), cpu.len(), "{name}: logits of every position");
        let exact_rows = exact.as_ref().map(|e| {
            e.model
                .forward_all_logits(&tokens, &mut e.cache(context))
                .expect("exact forward")
        });
        let (mut agree, mut near, mut worst, mut worst_rms) = (0, 0, 0f32, 0f32);
        for (pos, (c, g)) in cpu.chunks(n_vocab).zip(got.chunks(n_vocab)).enumerate() {
            let e = exact_rows
                .as_ref()
                .map(|rows| &rows[pos * n_vocab..(pos + 1) * n_vocab]);
            let (max_bound, rms_bound, strays) = measure_stray(c, g, e);
            let sigma = spread(c).max(f32::MIN_POSITIVE);
            let tol = max_bound * sigma;
            let (diff, rms) = differences(c, g);
            if reroutes.count(strays || diff > tol || rms > rms_bound * sigma) {
                continue;
            }
            assert!(
                diff <= tol && rms <= rms_bound * sigma,
                "{name}: position {pos}: logits differ by {:.3} (largest) and {:.3} (rms) of \
                 their spread, bounds {max_bound:.3} and {rms_bound:.3}",
                diff / sigma,
                rms / sigma
            );
            worst = worst.max(diff / sigma);
            worst_rms = worst_rms.max(rms / sigma);
            if argmax(c) == argmax(g) {
                agree += 1;
            } else if margin(c) <= tol {
                near += 1;
            }
        }
        let positions = tokens.len() - reroutes.rows;
        assert_eq!(
            agree + near,
            positions,
            "{name}: argmax differs past a near tie"
        );
        assert!(
            agree * 100 >= positions * 99 || positions - agree <= near,
            "{name}: argmax agrees at {agree}/{positions}"
        );

        // Prompts of each length in one call: their last logits.
        let mut cpu_last = Vec::new();
        let mut worst_prefill = 0f32;
        for len in PREFILL_LENGTHS {
            let prompt = &sequence[..len];
            // The GPU's tolerance was derived against this computation.
            let mut cache = model
                .new_cache(context)
                .with_attention(AttentionMethod::Matmul);
            let c = model.forward(prompt, &mut cache).expect("cpu prompt");
            gpu.clear().expect("clear");
            let g = gpu.forward(prompt).expect("gpu prompt");
            let e = exact.as_ref().map(|e| e.last(prompt, context));
            let (bound, _, strays) = measure_stray(&c, &g, e.as_deref());
            if !reroutes.count(strays || !prefill_within(&c, &g, bound)) {
                let d = check_prefill_within(name, len, PROMPT_BATCH, &c, &g, bound);
                worst_prefill = worst_prefill.max(d);
            }
            cpu_last.push((len, c, e));
        }
        // The same prompts in chunks smaller than themselves.
        for (batch, len) in SMALL_BATCHES {
            let Some(mut chunked) =
                gpu_model_with_batch(&test, &model, UploadMode::Eager, context, batch)
            else {
                return;
            };
            assert_eq!(chunked.prompt_batch(), batch, "{name}: chunk size");
            let (_, c, e) = cpu_last
                .iter()
                .find(|(l, _, _)| *l == len)
                .expect("a length of PREFILL_LENGTHS");
            let g = chunked
                .forward(&sequence[..len])
                .expect("gpu chunked prompt");
            let (bound, _, strays) = measure_stray(c, &g, e.as_deref());
            if !reroutes.count(strays || !prefill_within(c, &g, bound)) {
                let d = check_prefill_within(name, len, batch, c, &g, bound);
                worst_prefill = worst_prefill.max(d);
            }
        }

        // Greedy text: the GPU (device argmax, the captured decode step) against the CPU,
        // identical until the CPU's top two come within the tolerance.
        gpu.clear().expect("clear");
        // The GPU's tolerance was derived against this computation.
        let mut cache = model
            .new_cache(context)
            .with_attention(AttentionMethod::Matmul);
        let mut cpu_logits = model.forward(&tokens, &mut cache).expect("cpu prompt");
        let mut gpu_token = gpu.forward_argmax(&tokens).expect("gpu prompt");
        let mut exact_cache = exact.as_ref().map(|e| (e, e.cache(context)));
        let mut exact_logits = exact_cache
            .as_mut()
            .map(|(e, cache)| e.model.forward(&tokens, cache).expect("exact prompt"));
        let mut same = 0;
        for _ in 0..greedy_len - 1 {
            let cpu_token = argmax(&cpu_logits) as u32;
            if cpu_token != gpu_token {
                let (bound, _) = bounds(stray(&cpu_logits, exact_logits.as_deref()));
                let near_tie = margin(&cpu_logits) <= bound * spread(&cpu_logits);
                // A rerouted step of a model that routes ends the comparison too.
                reroutes.count(!near_tie);
                assert!(
                    near_tie || reroutes.allowed(),
                    "{name}: greedy token {same} differs ({cpu_token} vs {gpu_token}) \
                     with a clear CPU margin"
                );
                break;
            }
            same += 1;
            cpu_logits = model.forward(&[cpu_token], &mut cache).expect("cpu decode");
            gpu_token = gpu.forward_argmax(&[cpu_token]).expect("gpu decode");
            exact_logits = exact_cache
                .as_mut()
                .map(|(e, cache)| e.model.forward(&[cpu_token], cache).expect("exact decode"));
        }
        reroutes.check(name);
        eprintln!(
            "gpu {name:<15} argmax {agree}/{positions} ({near} near ties), largest |Δ| {worst:.3} \
             and rms {worst_rms:.3} of the spread, prompts of 1 to {longest} tokens {:.3}, \
             greedy {same}/{} tokens identical{}",
            worst_prefill,
            greedy_len - 1,
            if exact.is_some() {
                format!(
                    "; from the exact logits the CPU strays {cpu_stray:.3}, the GPU \
                     {gpu_stray:.3}"
                )
            } else {
                String::new()
            }
        );
    }

    macro_rules! gpu_matches_cpu {
        ($($test:ident => $name:literal),* $(,)?) => {$(
            #[test]
            fn $test() {
                check($name);
            }
        )*};
    }

    gpu_matches_cpu! {
        gpu_llama_q4_0 => "llama-q4_0",
        gpu_llama_q4_1 => "llama-q4_1",
        gpu_llama_q5_0 => "llama-q5_0",
        gpu_llama_q5_1 => "llama-q5_1",
        gpu_llama_q8_0 => "llama-q8_0",
        gpu_llama_q2_k => "llama-q2_k",
        gpu_llama_q3_k => "llama-q3_k",
        gpu_llama_q4_k => "llama-q4_k",
        gpu_llama_q5_k => "llama-q5_k",
        gpu_llama_q6_k => "llama-q6_k",
        gpu_llama_iq4_xs => "llama-iq4_xs",
        gpu_llama_iq4_nl => "llama-iq4_nl",
        gpu_llama_iq3_s => "llama-iq3_s",
        gpu_llama_iq3_xxs => "llama-iq3_xxs",
        gpu_llama_iq2_xxs => "llama-iq2_xxs",
        gpu_llama_iq2_xs => "llama-iq2_xs",
        gpu_llama_iq2_s => "llama-iq2_s",
        gpu_llama_iq1_s => "llama-iq1_s",
        gpu_llama_iq1_m => "llama-iq1_m",
        gpu_llama_mxfp4 => "llama-mxfp4",
        gpu_llama_q2_k_mix => "llama-q2_k-mix",
        gpu_llama_q3_k_m_mix => "llama-q3_k_m-mix",
        gpu_llama_q3_k_s_mix => "llama-q3_k_s-mix",
        gpu_llama_q3_k_l_mix => "llama-q3_k_l-mix",
        gpu_llama_q4_k_s_mix => "llama-q4_k_s-mix",
        gpu_llama_iq4_xs_mix => "llama-iq4_xs-mix",
        gpu_llama_iq3_m_mix => "llama-iq3_m-mix",
        gpu_llama_iq2_m_mix => "llama-iq2_m-mix",
        gpu_llama_f16 => "llama-f16",
        gpu_llama_bf16 => "llama-bf16",
        gpu_llama_f32 => "llama-f32",
        gpu_llama_mha_tied => "llama-mha-tied",
        gpu_llama_mqa => "llama-mqa",
        gpu_llama3 => "llama3",
        gpu_qwen2_tied => "qwen2-tied",
        gpu_qwen2_gqa4 => "qwen2-gqa4",
        gpu_qwen3 => "qwen3",
        gpu_gemma2 => "gemma2",
        gpu_gemma3 => "gemma3",
        gpu_gemma3_keys => "gemma3-keys",
        gpu_phi3 => "phi3",
        gpu_phi3_long => "phi3-long",
        gpu_llama_q4_k_long => "llama-q4_k-long",
        gpu_gemma2_long => "gemma2-long",
        gpu_gemma3_f16 => "gemma3-f16",
        gpu_llama_q4_0_random => "llama-q4_0-random",
        gpu_llama_q4_1_random => "llama-q4_1-random",
        gpu_llama_q5_0_random => "llama-q5_0-random",
        gpu_llama_q5_1_random => "llama-q5_1-random",
        gpu_llama_q8_0_random => "llama-q8_0-random",
        gpu_llama_q2_k_random => "llama-q2_k-random",
        gpu_llama_q3_k_random => "llama-q3_k-random",
        gpu_llama_q4_k_random => "llama-q4_k-random",
        gpu_llama_q5_k_random => "llama-q5_k-random",
        gpu_llama_q6_k_random => "llama-q6_k-random",
        gpu_llama_iq2_xxs_random => "llama-iq2_xxs-random",
        gpu_llama_iq2_xs_random => "llama-iq2_xs-random",
        gpu_llama_iq2_s_random => "llama-iq2_s-random",
        gpu_llama_iq3_xxs_random => "llama-iq3_xxs-random",
        gpu_llama_iq3_s_random => "llama-iq3_s-random",
        gpu_llama_iq1_s_random => "llama-iq1_s-random",
        gpu_llama_iq1_m_random => "llama-iq1_m-random",
        gpu_llama_iq4_nl_random => "llama-iq4_nl-random",
        gpu_llama_iq4_xs_random => "llama-iq4_xs-random",
        gpu_llama_mxfp4_random => "llama-mxfp4-random",
        gpu_qwen2_random => "qwen2-random",
        gpu_qwen3_random => "qwen3-random",
        gpu_phi3_random => "phi3-random",
        gpu_phi3_iq2_xs_random => "phi3-iq2_xs-random",
        gpu_gemma2_random => "gemma2-random",
        gpu_gemma3_random => "gemma3-random",
        gpu_qwen3moe_random => "qwen3moe-random",
        gpu_qwen2moe_random => "qwen2moe-random",
        gpu_llama_moe_random => "llama-moe-random",
        gpu_qwen3moe_all_random => "qwen3moe-all-random",
        gpu_llama_moe_top1_random => "llama-moe-top1-random",
    }

    /// A model the GPU does not run (a weight type only the CPU multiplies: `ty`) is
    /// refused before any device work, with an error naming it, rather than computed
    /// wrongly.
    fn refuses(name: &str, ty: &str) {
        let (_dir, _store, model) = open_spec(name);
        let named = ty;
        assert!(
            model.check_gpu_support().is_err(),
            "{name}: reported as supported"
        );
        let options = GpuOptions {
            device: 0,
            mode: UploadMode::Background,
            budget: None,
            context_size: 16,
            stop: None,
            tuning: GpuTuning::default(),
        };
        match GpuModel::new(&model, &options) {
            Err(model::ModelError::GpuUnsupported { what, .. }) => {
                assert!(what.contains(named), "{name}: {what}")
            }
            Err(other) => panic!("{name}: refused for another reason: {other}"),
            Ok(_) => panic!("{name}: the GPU accepted {named}, which it does not run"),
        }
    }

    macro_rules! gpu_refuses_type {
        ($($test:ident => $name:literal: $ty:literal),* $(,)?) => {$(
            #[test]
            fn $test() {
                refuses($name, $ty);
            }
        )*};
    }

    gpu_refuses_type! {
        gpu_llama_tq1_0 => "llama-tq1_0": "TQ1_0",
        gpu_llama_tq2_0 => "llama-tq2_0": "TQ2_0",
        gpu_llama_tq1_0_random => "llama-tq1_0-random": "TQ1_0",
        gpu_llama_tq2_0_random => "llama-tq2_0-random": "TQ2_0",
        gpu_gpt_oss => "gpt-oss": "gpt-oss",
        gpu_gpt_oss_long => "gpt-oss-long": "gpt-oss",
    }

    /// Several sequences of different lengths in one paged cache, run together as a
    /// server's steps run them, each against the same sequence run alone (the contiguous
    /// cache, its decode step captured): prompts of 1 to 40 tokens (the split attention
    /// and, past `MAX_BATCH`, the tiled one), a prompt that arrives while the others
    /// decode, one that starts on a block another sequence computed (a shared prefix), and
    /// blocks handed out out of order. Teacher-forced with the tokens each sequence chose
    /// alone, every row of logits is held to the tolerance rule above. The decoding
    /// steps' captured graphs give the bits of the same launches queued one by one.
    fn batched(name: &str) {
        use model::gpu::{BatchSegment, PageOptions};
        let test = format!("gpu_batched_{name}");
        let (_dir, _store, model) = open_spec(name);
        let n_vocab = model.config().n_vocab as u32;
        let (context, block, steps) = (96usize, 16usize, 12usize);
        let stream = |seed: u32, len: usize| -> Vec<u32> {
            (0..len as u32)
                .map(|i| (seed.wrapping_mul(7919) + i * 31 + i * i) % n_vocab)
                .collect()
        };
        // (prompt, the step it arrives at, positions already in the pool (shared)).
        let long = stream(5, 40);
        let mut shared = long[..block].to_vec();
        shared.extend(stream(6, 6));
        let seqs: Vec<(Vec<u32>, usize, usize)> = vec![
            (stream(1, 3), 0, 0),
            (stream(2, 9), 0, 0),
            (stream(3, 20), 0, 0),
            (stream(4, 1), 0, 0),
            (long, 2, 0),
            (shared, 4, block),
        ];
        let Some(mut alone) = gpu_model(&test, &model, UploadMode::Eager, context) else {
            return;
        };
        // Alone: the logits after the prompt and after each greedy token.
        let mut expected: Vec<(Vec<u32>, Vec<Vec<f32>>)> = Vec::new();
        for (prompt, _, _) in &seqs {
            alone.clear().expect("clear");
            let mut rows = vec![alone.forward(prompt).expect("prompt alone")];
            let mut fed = Vec::new();
            for _ in 0..steps {
                let token = argmax(rows.last().expect("a row")) as u32;
                fed.push(token);
                rows.push(alone.forward(&[token]).expect("decode alone"));
            }
            expected.push((fed, rows));
        }
        drop(alone);
        let options = GpuOptions {
            device: 0,
            mode: UploadMode::Eager,
            budget: None,
            context_size: context,
            stop: None,
            tuning: GpuTuning::default(),
        };
        let pages = PageOptions {
            block_size: block,
            n_blocks: 64,
            max_sequences: 8,
        };
        let mut gpu = GpuModel::with_pages(&model, &options, PROMPT_BATCH, pages)
            .unwrap_or_else(|e| panic!("{test}: {e}"));
        // Blocks out of order (7 is prime to 64); the shared sequence's first block is
        // the long one's.
        let mut tables: Vec<Vec<u32>> = (0..seqs.len())
            .map(|i| {
                (0..context / block)
                    .map(|j| ((i * 6 + j) * 7 % 64) as u32)
                    .collect()
            })
            .collect();
        tables[5][0] = tables[4][0];
        let (mut worst, mut rows_checked) = (0f32, 0);
        let mut reroutes = Reroutes::of(name);
        for step in 0..steps + 6 {
            // Each sequence's feed at this step: its prompt, then one token a step.
            let mut feeds = Vec::new();
            for (i, (prompt, arrives, skip)) in seqs.iter().enumerate() {
                let Some(k) = step.checked_sub(*arrives) else {
                    continue;
                };
                if k > steps {
                    continue;
                }
                let fed = &expected[i].0;
                let (first_pos, tokens) = if k == 0 {
                    (*skip, &prompt[*skip..])
                } else {
                    (prompt.len() + k - 1, &fed[k - 1..k])
                };
                feeds.push((i, k, first_pos, tokens));
            }
            if feeds.is_empty() {
                break;
            }
            let segments: Vec<BatchSegment<'_>> = feeds
                .iter()
                .map(|&(i, _, first_pos, tokens)| BatchSegment {
                    tokens,
                    first_pos,
                    table: &tables[i],
                    logits: true,
                })
                .collect();
            let logits = gpu
                .forward_batch(&segments)
                .unwrap_or_else(|e| panic!("{test}: step {step}: {e}"))
                .to_vec();
            assert_eq!(logits.len(), feeds.len() * n_vocab as usize, "{test}: rows");
            // A step of one token per sequence replays the graph captured for that many
            // sequences (at other positions, over other blocks, the first time it met
            // them); the same launches queued one by one give the same bits.
            gpu.set_batch_graphs(false);
            let direct = gpu
                .forward_batch(&segments)
                .unwrap_or_else(|e| panic!("{test}: step {step}, launched one by one: {e}"));
            assert!(
                direct
                    .iter()
                    .zip(&logits)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{test}: step {step}: the captured step's logits differ from its launches'"
            );
            gpu.set_batch_graphs(true);
            for (row, &(i, k, _, _)) in logits.chunks(n_vocab as usize).zip(&feeds) {
                let want = &expected[i].1[k];
                let sigma = spread(want).max(f32::MIN_POSITIVE);
                let tol = tolerance(want);
                let diff = want
                    .iter()
                    .zip(row)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                let within = diff <= tol && (argmax(want) == argmax(row) || margin(want) <= tol);
                if reroutes.count(!within) {
                    rows_checked += 1;
                    continue;
                }
                assert!(
                    diff <= tol && (argmax(want) == argmax(row) || margin(want) <= tol),
                    "{test}: step {step}, sequence {i}, row {k}: logits differ by {:.3} of \
                     their spread from the sequence alone, argmax {} vs {}",
                    diff / sigma,
                    argmax(want),
                    argmax(row)
                );
                worst = worst.max(diff / sigma);
                rows_checked += 1;
            }
            // The same step again (it writes the same keys and values), greedy on the
            // device: each row's first highest logit.
            let tokens = gpu.forward_batch_argmax(&segments).expect("argmax batch");
            let want: Vec<u32> = logits
                .chunks(n_vocab as usize)
                .map(|r| argmax(r) as u32)
                .collect();
            assert_eq!(tokens, want, "{test}: step {step}: device argmax");
            // And with biases added on the device (each row's best token banned, another
            // raised): the first highest of the rows with the biases added here.
            let nv = n_vocab as usize;
            let biases: Vec<(usize, u32, f32)> = want
                .iter()
                .enumerate()
                .flat_map(|(row, &top)| {
                    let other = (top + 1 + 7 * row as u32) % n_vocab;
                    [(row, top, f32::NEG_INFINITY), (row, other, 0.75)]
                })
                .collect();
            let biased = gpu
                .forward_batch_argmax_biased(&segments, &biases)
                .expect("biased argmax batch");
            let want: Vec<u32> = logits
                .chunks(nv)
                .enumerate()
                .map(|(row, r)| {
                    let mut r = r.to_vec();
                    for &(_, t, b) in biases.iter().filter(|e| e.0 == row) {
                        r[t as usize] += b;
                    }
                    argmax(&r) as u32
                })
                .collect();
            assert_eq!(
                biased, want,
                "{test}: step {step}: device argmax of biased rows"
            );
        }
        assert_eq!(
            rows_checked,
            seqs.len() * (steps + 1),
            "{test}: rows checked"
        );
        reroutes.check(&test);
        eprintln!(
            "gpu batched {name:<13} {rows_checked} rows of {} sequences, largest |Δ| {worst:.3} \
             of the spread from each alone",
            seqs.len()
        );
    }

    /// The continuous-batching scheduler on a GPU (the steps through
    /// `GpuModel::forward_batch`, the pool's blocks its paged cache): eight concurrent
    /// greedy requests of different lengths, sharing a prefix, each give the text of the
    /// same prompt run alone on the GPU's contiguous cache, or part ways at a near tie of
    /// the alone run (its top two within the tolerance rule); the device cache's counters
    /// reach the scheduler's metrics.
    fn scheduler_on_gpu(name: &str) {
        use std::sync::atomic::AtomicBool;
        use std::sync::{mpsc, Arc};
        use std::time::Duration;

        use model::sampling::SamplingParams;
        use model::serve::{Event, Request, Scheduler, SchedulerConfig};

        let test = format!("gpu_scheduler_{name}");
        let (_dir, store, model) = open_spec(name);
        let tokenizer = Arc::new(Tokenizer::from_metadata(store.metadata()).expect("tokenizer"));
        let n_vocab = model.config().n_vocab as u32;
        let (context, max_tokens) = (160usize, 24usize);
        let stream = |seed: u32, len: usize| -> Vec<u32> {
            (0..len as u32)
                .map(|i| 1 + (seed.wrapping_mul(7919) + i * 31 + i * i) % (n_vocab - 1))
                .collect()
        };
        let shared = stream(9, 40);
        let mut prompts: Vec<Vec<u32>> = [1, 5, 9, 17, 33, 70]
            .iter()
            .enumerate()
            .map(|(i, &len)| stream(i as u32 + 1, len))
            .collect();
        for tail in [3, 11] {
            let mut p = shared.clone();
            p.extend(stream(20 + tail, tail as usize));
            prompts.push(p);
        }
        // Alone: greedy tokens (to the first end-of-generation token) and the logits
        // each was chosen from.
        let Some(mut alone) = gpu_model(&test, &model, UploadMode::Eager, context) else {
            return;
        };
        let mut expected = Vec::new();
        for prompt in &prompts {
            alone.clear().expect("clear");
            let mut logits = alone.forward(prompt).expect("prompt alone");
            let (mut tokens, mut rows) = (Vec::new(), Vec::new());
            while tokens.len() < max_tokens {
                let token = argmax(&logits) as u32;
                rows.push(logits.clone());
                tokens.push(token);
                if tokenizer.is_end_of_generation(token) {
                    break;
                }
                logits = alone.forward(&[token]).expect("decode alone");
            }
            expected.push((tokens, rows));
        }
        drop(alone);
        let config = SchedulerConfig {
            max_sequences: 8,
            max_queue: 16,
            step_tokens: 64,
            context_size: context,
            pool_positions: 4 * context,
            block_size: 16,
            attention: model::AttentionMethod::default(),
        };
        let options = GpuOptions {
            device: 0,
            mode: UploadMode::Background,
            budget: None,
            context_size: context,
            stop: None,
            tuning: GpuTuning::default(),
        };
        let scheduler =
            Scheduler::start_on_gpu(model.clone(), Arc::clone(&tokenizer), config, options)
                .unwrap_or_else(|e| panic!("{test}: {e}"));
        let receivers: Vec<_> = prompts
            .iter()
            .map(|prompt| {
                let (tx, rx) = mpsc::channel();
                let request = Request {
                    prompt: prompt.clone(),
                    max_tokens,
                    sampling: SamplingParams::greedy().validate().expect("greedy"),
                    stop: Vec::new(),
                    presence_penalty: 0.0,
                    frequency_penalty: 0.0,
                    logit_bias: Vec::new(),
                    constraint: None,
                    cancel: Arc::new(AtomicBool::new(false)),
                    events: Box::new(move |event| tx.send(event).is_ok()),
                };
                scheduler.submit(request).expect("submitted");
                rx
            })
            .collect();
        // The text the scheduler hands out as each alone token arrives: its stream
        // decoder's output so far (whole characters only), then the rest at the end.
        let emitted = |tokens: &[u32]| -> (Vec<String>, String) {
            let mut decoder = tokenizer.stream_decoder(false);
            let (mut text, mut after) = (String::new(), vec![String::new()]);
            for &t in tokens {
                if tokenizer.is_end_of_generation(t) {
                    break;
                }
                text.push_str(&decoder.push(t).expect("decodes"));
                after.push(text.clone());
            }
            text.push_str(&decoder.finish());
            (after, text)
        };
        let mut identical = 0;
        for (i, (rx, (tokens, rows))) in receivers.iter().zip(&expected).enumerate() {
            let mut got = String::new();
            loop {
                match rx.recv_timeout(Duration::from_secs(120)).expect("an event") {
                    Event::Text(piece) => got.push_str(&piece),
                    Event::Done(_) => break,
                    Event::Error(e) => panic!("{test}: request {i} failed: {e}"),
                }
            }
            let (after, want) = emitted(tokens);
            if got == want {
                identical += 1;
                continue;
            }
            // The first alone token whose text the batched run did not hand out; a
            // character's bytes wait in the decoder over at most three tokens, so the
            // runs parted ways at one of the four tokens up to it, which must be a near
            // tie of the alone run.
            let k = (1..after.len())
                .find(|&k| !got.starts_with(&after[k]))
                .map_or(after.len() - 1, |k| k - 1);
            let window = k.saturating_sub(3)..=k.min(rows.len() - 1);
            assert!(
                window
                    .clone()
                    .any(|j| margin(&rows[j]) <= tolerance(&rows[j])),
                "{test}: request {i}: batched {got:?} vs alone {want:?}: no near tie at \
                 tokens {window:?}"
            );
        }
        let metrics = scheduler.metrics();
        let cache = metrics.device_cache().expect("the device cache's counters");
        assert!(
            cache.hits > 0 && cache.uploaded_bytes > 0,
            "{test}: device cache counters {cache:?}"
        );
        eprintln!(
            "gpu scheduler {name:<12} {identical} of {} texts identical to alone",
            prompts.len()
        );
    }

    #[test]
    fn gpu_scheduler_llama_q4_k() {
        scheduler_on_gpu("llama-q4_k");
    }

    #[test]
    fn gpu_scheduler_gemma3() {
        scheduler_on_gpu("gemma3");
    }

    #[test]
    fn gpu_scheduler_qwen2_gqa4() {
        scheduler_on_gpu("qwen2-gqa4");
    }

    macro_rules! gpu_batched_matches_alone {
        ($($test:ident => $name:literal),* $(,)?) => {$(
            #[test]
            fn $test() {
                batched($name);
            }
        )*};
    }

    gpu_batched_matches_alone! {
        gpu_batched_llama_q4_k => "llama-q4_k",
        gpu_batched_llama_q8_0 => "llama-q8_0",
        gpu_batched_qwen2_gqa4 => "qwen2-gqa4",
        gpu_batched_gemma3 => "gemma3",
        gpu_batched_llama_mqa => "llama-mqa",
        gpu_batched_qwen3moe_random => "qwen3moe-random",
        gpu_batched_qwen2moe_random => "qwen2moe-random",
    }

    /// A mixture of experts whose weights do not fit the GPU budget is refused, naming the
    /// experts and the sizes, rather than run with experts the device cannot hold.
    /// (Without a GPU the device is refused first.)
    #[test]
    fn gpu_experts_over_budget_are_refused() {
        let (_dir, _store, model) = open_spec("qwen3moe-random");
        let options = GpuOptions {
            device: 0,
            mode: UploadMode::Eager,
            budget: Some(1 << 16),
            context_size: 16,
            stop: None,
            tuning: GpuTuning::default(),
        };
        match GpuModel::new(&model, &options) {
            Err(model::ModelError::GpuUnsupported { what, .. }) => {
                assert!(what.contains("32 experts"), "{what}")
            }
            Err(model::ModelError::Gpu { .. }) => {}
            Err(other) => panic!("refused for another reason: {other}"),
            Ok(_) => panic!("a mixture of experts over its budget was accepted"),
        }
    }

    #[test]
    fn gpu_every_spec_has_a_test() {
        let source = include_str!("synthetic.rs");
        for spec in SPECS {
            assert!(
                source.contains(&format!(
                    "gpu_{} => \"{}\"",
                    spec.name.replace(['-', '.'], "_"),
                    spec.name
                )),
                "{} has no GPU test in synthetic.rs",
                spec.name
            );
        }
    }

    /// A prompt chunk of no token is refused, before any device work (so also without a
    /// GPU).
    #[test]
    fn gpu_prompt_batch_of_zero_is_refused() {
        let (_dir, _store, model) = open_spec("llama-q4_0");
        let options = GpuOptions {
            device: 0,
            mode: UploadMode::Lazy,
            budget: None,
            context_size: 16,
            stop: None,
            tuning: GpuTuning::default(),
        };
        match GpuModel::with_prompt_batch(&model, &options, 0) {
            Err(model::ModelError::InvalidPromptBatch { tokens: 0 }) => {}
            Err(other) => panic!("refused for another reason: {other}"),
            Ok(_) => panic!("a prompt chunk of 0 tokens was accepted"),
        }
    }

    /// A budget smaller than the model: the first layers stay, and the others pass
    /// through the rest of the budget for a long chunk, whose logits are the full
    /// upload's bit for bit (the same kernels on the same bytes). A pass of a few tokens
    /// computes those layers on the host instead, within the GPU's tolerance of the full
    /// upload's logits. The keys and values each side computed reach the other: decode
    /// steps after a prompt read the prompt's from the device, a chunk after decode steps
    /// reads theirs from the host, and decode steps follow again.
    #[test]
    fn gpu_over_budget_gives_the_full_uploads_logits() {
        let test = "gpu_over_budget_gives_the_full_uploads_logits";
        let (_dir, _store, model) = open_spec("llama-q4_k");
        let weights: u64 = model.plan().handles().iter().map(|h| h.size()).sum();
        let prompt: Vec<u32> = (1..40).collect();
        let chunk: Vec<u32> = (50..70).collect();
        assert!(prompt.len().min(chunk.len()) > model::gpu::HOST_TOKENS);
        // The full upload's passes, and the tokens it decoded (the others decode the same).
        let mut full: Vec<Vec<f32>> = Vec::new();
        let mut decoded: Vec<u32> = Vec::new();
        // Below the model's size, above what the shared tensors and a passing layer
        // take. Over budget the embeddings (most of this small model) stay on the host,
        // so the budgets hold the output and part of the layers.
        let plan = model.plan();
        let embd = plan.token_embd.weight.size();
        let layers: u64 = plan
            .handles()
            .iter()
            .filter(|h| h.name().starts_with("blk."))
            .map(|h| h.size())
            .sum();
        let shared = weights - embd - layers;
        for budget in [
            None,
            Some(shared + layers * 9 / 10),
            Some(shared + layers * 3 / 4),
        ] {
            let options = GpuOptions {
                device: 0,
                mode: UploadMode::Background,
                budget,
                context_size: 96,
                stop: None,
                tuning: GpuTuning::default(),
            };
            let mut gpu = match GpuModel::new(&model, &options) {
                Ok(gpu) => gpu,
                Err(model::ModelError::Gpu { source, .. }) if source.is_unavailable() => {
                    skip(test, &source.to_string());
                    return;
                }
                Err(error) => panic!("{test}: budget {budget:?}: {error}"),
            };
            let host_layers = gpu.host_layers();
            let mut passes = vec![gpu.forward(&prompt).expect("prompt")];
            let mut step = 0;
            let mut decode = |gpu: &mut GpuModel, passes: &mut Vec<Vec<f32>>, steps: usize| {
                for _ in 0..steps {
                    if budget.is_none() {
                        decoded.push(argmax(passes.last().expect("a pass")) as u32);
                    }
                    passes.push(gpu.forward(&[decoded[step]]).expect("decode"));
                    step += 1;
                }
            };
            decode(&mut gpu, &mut passes, 4);
            passes.push(gpu.forward(&chunk).expect("a chunk after decoding"));
            decode(&mut gpu, &mut passes, 3);
            // A few tokens with the logits of each.
            passes.push(gpu.forward_all_logits(&[7, 8, 9]).expect("all logits"));
            let evictions = gpu.cache().stats().evictions;
            if budget.is_none() {
                assert_eq!(host_layers, 0, "{test}: the full upload holds every layer");
                full = passes;
                continue;
            }
            assert!(evictions > 0, "{test}: budget {budget:?} evicted nothing");
            assert!(
                host_layers > 0,
                "{test}: budget {budget:?}: no layer on the host"
            );
            assert!(
                passes[0] == full[0],
                "{test}: budget {budget:?}: the streamed prompt's logits differ from the \
                 full upload's"
            );
            let n_vocab = model.config().n_vocab;
            for (i, (got, want)) in passes.iter().zip(&full).enumerate().skip(1) {
                assert_eq!(got.len(), want.len(), "{test}: pass {i}");
                for (row, (g, w)) in got.chunks(n_vocab).zip(want.chunks(n_vocab)).enumerate() {
                    let name = format!("{test}: budget {budget:?}, pass {i}, row {row}");
                    check_prefill(&name, i, 1, w, g);
                }
            }
        }
    }

    /// The upload (and a cold file's read-ahead) takes the layers in turn, then the final
    /// norm and the output matrix, and the token embeddings last; embeddings that are the
    /// output matrix too come first, with the final norm.
    #[test]
    fn upload_order_takes_the_embeddings_last_unless_they_are_the_output() {
        for (name, tied) in [("llama-q4_k", false), ("llama-mha-tied", true)] {
            let (_dir, _store, model) = open_spec(name);
            let order = model::gpu::first_use_order(&model);
            let names: Vec<&str> = order.tensors().iter().map(|t| t.name()).collect();
            let mut every: Vec<&str> = model.plan().handles().iter().map(|h| h.name()).collect();
            every.sort_unstable();
            every.dedup();
            let mut sorted = names.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, every, "{name}: each tensor once");
            if tied {
                assert_eq!(
                    names[..2],
                    ["output_norm.weight", "token_embd.weight"],
                    "{name}"
                );
            } else {
                assert!(names[0].starts_with("blk.0."), "{name}: {names:?}");
                assert_eq!(
                    names[names.len() - 3..],
                    ["output_norm.weight", "output.weight", "token_embd.weight"],
                    "{name}"
                );
            }
            let layers: Vec<usize> = names
                .iter()
                .filter_map(|n| n.strip_prefix("blk.")?.split('.').next()?.parse().ok())
                .collect();
            assert!(
                layers.windows(2).all(|w| w[0] <= w[1]),
                "{name}: {layers:?}"
            );
        }
    }

    /// While the embeddings are not on the device (lazy: nothing is until asked for), a
    /// prompt gathers its rows on the host from the file rather than wait for them: the
    /// same bits as with every weight resident. The first decoding step fetches them.
    #[test]
    fn gpu_a_prompt_does_not_wait_for_the_embeddings() {
        let test = "gpu_a_prompt_does_not_wait_for_the_embeddings";
        let (_dir, _store, model) = open_spec("llama-q4_k");
        let embd = &model.plan().token_embd.weight;
        // Rows of more than one task of the host's decoding.
        let prompt: Vec<u32> = (0..70).map(|i| 1 + (i * 37) % 200).collect();
        let mut results = Vec::new();
        for mode in [UploadMode::Eager, UploadMode::Lazy] {
            let Some(mut gpu) = gpu_model(test, &model, mode, 80) else {
                return;
            };
            assert!(gpu.first_pass_weights_at().is_none(), "{test}: {mode:?}");
            let first = gpu.forward(&prompt).expect("prompt");
            let waited = mode == UploadMode::Eager;
            assert_eq!(
                gpu.is_resident(embd),
                waited,
                "{test}: {mode:?} after the prompt"
            );
            // The prompt had its weights in hand after the whole upload (eager), or
            // before it ended (lazy: the embeddings are still to come).
            let weights = gpu.first_pass_weights_at().expect("set by the prompt");
            match gpu.uploaded_at() {
                Some(all) => assert!(waited && all <= weights, "{test}: {mode:?}"),
                None => assert!(!waited, "{test}: {mode:?}"),
            }
            let next = gpu.forward(&[argmax(&first) as u32]).expect("decode");
            assert!(gpu.is_resident(embd), "{test}: {mode:?} after a step");
            assert_eq!(
                gpu.first_pass_weights_at(),
                Some(weights),
                "{test}: {mode:?}"
            );
            results.push((first, next));
        }
        assert!(
            results[0] == results[1],
            "{test}: host and device embeddings differ"
        );
    }

    /// Eager, background and lazy uploads run one code path: the same logits, bit for bit.
    #[test]
    fn gpu_upload_modes_give_the_same_logits() {
        let test = "gpu_upload_modes_give_the_same_logits";
        let (_dir, _store, model) = open_spec("llama-q4_k");
        let tokens: Vec<u32> = (1..12).collect();
        let mut results = Vec::new();
        for mode in [UploadMode::Eager, UploadMode::Background, UploadMode::Lazy] {
            let Some(mut gpu) = gpu_model(test, &model, mode, 16) else {
                return;
            };
            results.push(gpu.forward_all_logits(&tokens).expect("forward"));
        }
        assert!(results.windows(2).all(|w| w[0] == w[1]), "modes differ");
    }

    /// A prompt of several chunks whose weights are still to arrive (lazy: none is on the
    /// device yet) runs layer by layer over its chunks; with every weight resident (eager)
    /// chunk by chunk. Both run the same launches on the same values: the prompt's logits
    /// and the decoding after it are the same bits.
    #[test]
    fn gpu_prompt_chunks_by_layer_give_the_chunks_bits() {
        let test = "gpu_prompt_chunks_by_layer_give_the_chunks_bits";
        let (_dir, _store, model) = open_spec("llama-q4_k");
        // Four chunks of 16, the last of 3: the split attention's few-token path too.
        let prompt: Vec<u32> = (0..51).map(|i| 1 + (i * 37) % 200).collect();
        let mut results = Vec::new();
        for mode in [UploadMode::Eager, UploadMode::Lazy] {
            let Some(mut gpu) = gpu_model_with_batch(test, &model, mode, 64, 16) else {
                return;
            };
            let mut rows = vec![gpu.forward(&prompt).expect("prompt")];
            let mut token = argmax(&rows[0]) as u32;
            for _ in 0..3 {
                rows.push(gpu.forward(&[token]).expect("decode"));
                token = argmax(rows.last().expect("a row")) as u32;
            }
            assert_eq!(gpu.len(), prompt.len() + 3, "{test}: {mode:?}: positions");
            results.push(rows);
        }
        assert!(
            results[0] == results[1],
            "{test}: the prompt run layer by layer differs from its chunks run one by one"
        );
    }
}
