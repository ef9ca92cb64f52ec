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
#[path = "synthetic/kv_cache.rs"]
mod kv_cache;
#[path = "synthetic/quantize.rs"]
mod quantize;
#[path = "synthetic/vocab.rs"]
mod vocab;

use std::path::PathBuf;

use gguf_format::GgmlType;
use model::tokenizer::{EncodeOptions, Tokenizer};
use model::{AttentionMethod, KvTypes, Model};
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
    reference_at(oracle_dir_for(method).join(format!("{name}.json")))
}

fn reference_at(path: PathBuf) -> Reference {
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
    let reference = reference(name, method);
    compare_to(name, tolerance, method, KvTypes::default(), reference)
}

fn compare_to(
    name: &str,
    tolerance: Tolerance,
    method: AttentionMethod,
    types: KvTypes,
    reference: Reference,
) -> Measured {
    let spec = spec(name).unwrap_or_else(|| panic!("no synthetic spec named {name}"));
    let bytes = build(spec).expect("the generator writes a valid file");
    assert_eq!(
        hex_sha256(&bytes),
        reference.sha256,
        "{name}: the generated file differs from the one the reference was made from; \
         make the references again (tests/data/README.md)"
    );
    assert_eq!(spec.prompt, reference.prompt, "{name}: prompt changed");

    let (_dir, store, model) = load_file(&format!("{name}.gguf"), &bytes);
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
        .with_context(context)
        .with_types(model.config(), types)
        .expect("the model takes the cache types");
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
            .with_context(context)
            .with_types(model.config(), types)
            .expect("the model takes the cache types");
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

/// The threads llama.cpp computed the references with (`--threads 2`, as
/// tests/data/README.md records). Its flash attention cuts a long view of the cache for
/// one query into a chunk per thread, and ours follows it, so the comparison runs on a
/// pool of that many threads whatever the machine has.
const REFERENCE_THREADS: usize = 2;

fn check_with(name: &str, method: AttentionMethod) {
    let m = rayon::ThreadPoolBuilder::new()
        .num_threads(REFERENCE_THREADS)
        .build()
        .expect("a thread pool")
        .install(|| compare(name, EXACT, method));
    assert_measured(name, &format!("{method:?}"), &m);
}

fn assert_measured(name: &str, what: &str, m: &Measured) {
    let tolerance = EXACT;
    eprintln!(
        "synthetic {name:<15} {what} argmax {:>2}/{:<2} ({} near ties)  max |Δ| top-8 {:.4}  \
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

/// A test `$test` for each synthetic model `$name`, running `check` (as the caller has
/// it) on it.
macro_rules! checks {
    ($($test:ident => $name:literal),* $(,)?) => {$(
        #[test]
        fn $test() {
            check($name);
        }
    )*};
}

checks! {
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
    qwen3moe_mxfp4_random_matches_llama_cpp => "qwen3moe-mxfp4-random",
    gpt_oss_matches_llama_cpp => "gpt-oss",
    gpt_oss_wide_matches_llama_cpp => "gpt-oss-wide",
    gpt_oss_long_matches_llama_cpp => "gpt-oss-long",
}

/// The synthetic model `name`, written to a temporary folder (kept while the guard
/// lives), opened and loaded.
fn open_spec(name: &str) -> (tempfile::TempDir, TensorStore, Model) {
    let spec = spec(name).expect("a spec");
    let bytes = build(spec).expect("the generator writes a valid file");
    load_file(&format!("{name}.gguf"), &bytes)
}

/// `bytes` written as `file` to a temporary folder (kept while the guard lives), opened
/// and loaded.
fn load_file(file: &str, bytes: &[u8]) -> (tempfile::TempDir, TensorStore, Model) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join(file);
    std::fs::write(&path, bytes).expect("writing the model");
    let store = TensorStore::open(&path).expect("model opens");
    let model = Model::load(&store).expect("model loads");
    (dir, store, model)
}

/// The CPU scheduler runs a mixture of experts as `generate` does: the same layer over
/// the paged pool, so a request alone gets `generate`'s text. (The prompts share no
/// block: a prompt that starts on cached blocks computes only its rest, and with experts
/// a different batch groups the tokens differently, which changes the kernels llama.cpp
/// would take for them, and so ours.)
#[test]
fn moe_requests_alone_in_the_scheduler_give_generates_text() {
    for name in ["qwen3moe-random", "llama-moe-random", "gpt-oss"] {
        let (_dir, store, model) = open_spec(name);
        let tokenizer = Tokenizer::from_metadata(store.metadata()).expect("tokenizer builds");
        let long = spec(name).expect("a spec").prompt.repeat(3);
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
#[path = "synthetic/gpu.rs"]
mod gpu;
