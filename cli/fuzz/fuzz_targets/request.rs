//! A request body, as the chat or the text completions endpoint receives it, through the
//! server's checks: the JSON parsed, every field validated, and the constraint the body
//! asks for (`response_format` `json_schema`/`json_object`, `grammar`, `regex`, or the
//! calls a `tool_choice` requires) compiled with `llguidance` against a real
//! vocabulary. The property: the checks end, without a panic, in a request for the
//! scheduler or a 400 (never another status).
//!
//! The first byte picks the endpoint (odd: chat), the rest is the body. The model is a
//! tiny llama written here once per process: a byte-level BPE vocabulary of the 256
//! bytes, a few merges and ChatML's control tokens, with the Hermes tool-calling
//! template of `cli/tests/templates`, loaded as `rocmforge serve --device cpu` loads
//! a file.

#![no_main]
// The server's modules are compiled here as the `rocmforge` binary compiles them; what
// the binary alone uses is dead code in this crate.
#![allow(dead_code, unused_imports)]

#[path = "../../../testdata/byte_alphabet.rs"]
mod byte_alphabet;
#[path = "../../src/models.rs"]
mod models;
#[path = "../../src/options.rs"]
mod options;
#[path = "../../src/serve/mod.rs"]
mod serve;

use std::sync::OnceLock;

use byte_alphabet::byte_char;
use gguf_format::{GgmlType, GgufWriter};
use libfuzzer_sys::fuzz_target;
use serve::fuzzing::Checker;

const N_EMBD: usize = 64;
const N_FF: usize = 128;
const N_HEADS: usize = 2;
const HEAD_DIM: usize = N_EMBD / N_HEADS;

/// Control tokens first, as SmolLM2's vocabulary has them.
const SPECIALS: [&str; 5] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
];

/// Merges of the byte alphabet, in rank order: JSON punctuation and a few words.
const MERGES: &[(&str, &str)] = &[
    ("\"", ":"),
    ("{", "\""),
    ("\"", "}"),
    ("Ġ", "t"),
    ("h", "e"),
    ("n", "a"),
    ("m", "e"),
    ("na", "me"),
    ("t", "r"),
    ("u", "e"),
    ("tr", "ue"),
    ("1", "2"),
];

/// Small weights that differ from one another (the values do not matter here).
fn values(n: usize, seed: usize) -> Vec<u8> {
    (0..n)
        .map(|i| 0.02 * ((i * 7 + seed * 13) as f32 * 0.37).sin())
        .flat_map(f32::to_le_bytes)
        .collect()
}

/// The tiny model's GGUF file.
fn model_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    let dim = |n: usize| gguf_format::Value::from(n as u32);
    let hyper: [(&str, gguf_format::Value); 10] = [
        ("general.architecture", "llama".into()),
        ("llama.context_length", dim(512)),
        ("llama.embedding_length", dim(N_EMBD)),
        ("llama.block_count", dim(1)),
        ("llama.feed_forward_length", dim(N_FF)),
        ("llama.attention.head_count", dim(N_HEADS)),
        ("llama.attention.head_count_kv", dim(N_HEADS)),
        ("llama.rope.freq_base", 10000f32.into()),
        ("llama.rope.dimension_count", dim(HEAD_DIM)),
        ("llama.attention.layer_norm_rms_epsilon", 1e-5f32.into()),
    ];
    for (key, value) in hyper {
        w.add_metadata(key, value).expect("a metadata key");
    }

    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| (*s).to_owned()).collect();
    let mut types = vec![3i32; tokens.len()];
    for b in 0..=255u8 {
        tokens.push(byte_char(b).to_string());
        types.push(1);
    }
    for &(left, right) in MERGES {
        tokens.push(format!("{left}{right}"));
        types.push(1);
    }
    let n_vocab = tokens.len();
    let merges: Vec<String> = MERGES.iter().map(|(l, r)| format!("{l} {r}")).collect();
    let template = include_str!("../../tests/templates/hermes-tools.jinja");
    let vocabulary: [(&str, gguf_format::Value); 9] = [
        ("tokenizer.ggml.model", "gpt2".into()),
        ("tokenizer.ggml.pre", "smollm".into()),
        ("tokenizer.ggml.tokens", tokens.into()),
        ("tokenizer.ggml.token_type", types.into()),
        ("tokenizer.ggml.merges", merges.into()),
        // <|im_start|> and <|im_end|>.
        ("tokenizer.ggml.bos_token_id", 1u32.into()),
        ("tokenizer.ggml.eos_token_id", 2u32.into()),
        ("tokenizer.ggml.add_bos_token", false.into()),
        ("tokenizer.chat_template", template.into()),
    ];
    for (key, value) in vocabulary {
        w.add_metadata(key, value).expect("a metadata key");
    }

    let mut data = Vec::new();
    let mut tensor = |w: &mut GgufWriter, name: &str, shape: &[usize]| {
        let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        w.add_tensor(name, GgmlType::F32, &dims).expect("a tensor");
        data.push(values(shape.iter().product(), data.len()));
    };
    tensor(&mut w, "token_embd.weight", &[N_EMBD, n_vocab]);
    tensor(&mut w, "blk.0.attn_norm.weight", &[N_EMBD]);
    for role in ["attn_q", "attn_k", "attn_v", "attn_output"] {
        tensor(&mut w, &format!("blk.0.{role}.weight"), &[N_EMBD, N_EMBD]);
    }
    tensor(&mut w, "blk.0.ffn_norm.weight", &[N_EMBD]);
    tensor(&mut w, "blk.0.ffn_gate.weight", &[N_EMBD, N_FF]);
    tensor(&mut w, "blk.0.ffn_up.weight", &[N_EMBD, N_FF]);
    tensor(&mut w, "blk.0.ffn_down.weight", &[N_FF, N_EMBD]);
    tensor(&mut w, "output_norm.weight", &[N_EMBD]);
    let data: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    w.to_bytes(&data).expect("a GGUF file")
}

/// The model, written to a temporary file and loaded once per process.
fn checker() -> &'static Checker {
    static CHECKER: OnceLock<Checker> = OnceLock::new();
    CHECKER.get_or_init(|| {
        let path = std::env::temp_dir().join(format!(
            "rocmforge-fuzz-request-{}.gguf",
            std::process::id()
        ));
        std::fs::write(&path, model_file()).expect("writing the model");
        let checker = Checker::load(&path, None).expect("loading the model");
        // The weights are mapped: the file's name can go.
        let _ = std::fs::remove_file(&path);
        assert!(checker.has_grammars(), "the vocabulary takes constraints");
        assert!(checker.has_tools(), "the template offers tools");
        checker
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, body)) = data.split_first() else {
        return;
    };
    if let Err((status, message)) = checker().check(first & 1 == 1, body) {
        assert_eq!(status, 400, "{message}");
    }
});
