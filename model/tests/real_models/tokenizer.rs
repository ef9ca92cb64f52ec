//! The tokenizer against llama.cpp on both real models (and on SmolLM2's vocabulary under
//! the other BPE pre-tokenizers): the golden prompts and the corpus
//! in `tests/data` (ids made by llama.cpp's own tokenizer, see `tests/data/README.md`),
//! llama.cpp's detokenized text, and streaming decode round trips.

use std::path::PathBuf;
use std::sync::OnceLock;

use gguf_format::Value;
use model::tokenizer::{keys, DecodeOptions, EncodeOptions, TokenId, Tokenizer};

use crate::common::{golden, ids, model_path, read_metadata, GEMMA3, SMOLLM2};

/// Special tokens added but not parsed in the text: llama-cpp-python's `tokenize` default.
const ADD_ONLY: EncodeOptions = EncodeOptions {
    add_special: true,
    parse_special: false,
};

fn tokenizer(file: &'static str) -> &'static Tokenizer {
    static SMOLLM2_TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    static GEMMA3_TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    let cell = match file {
        SMOLLM2 => &SMOLLM2_TOKENIZER,
        GEMMA3 => &GEMMA3_TOKENIZER,
        other => panic!("no tokenizer cache for {other}"),
    };
    cell.get_or_init(|| {
        Tokenizer::from_metadata(&read_metadata(&model_path(file))).expect("tokenizer builds")
    })
}

fn data_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn read_json(name: &str) -> serde_json::Value {
    let path = data_path(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn corpus() -> Vec<String> {
    read_json("tokenizer_corpus.json")
        .as_array()
        .expect("the corpus is an array")
        .iter()
        .map(|v| v.as_str().expect("corpus entries are strings").to_owned())
        .collect()
}

fn references(file: &str) -> Vec<serde_json::Value> {
    match file {
        SMOLLM2 => references_in("tokenizer_refs_smollm2.json", file),
        _ => references_in("tokenizer_refs_gemma3.json", file),
    }
}

fn references_in(name: &str, model_file: &str) -> Vec<serde_json::Value> {
    let refs = read_json(name);
    assert_eq!(
        refs["model"], model_file,
        "{name} was made for another model"
    );
    let cases = refs["cases"].as_array().expect("cases").clone();
    let corpus = corpus();
    assert_eq!(
        cases.len(),
        corpus.len(),
        "{name} and the corpus differ in length"
    );
    for (case, text) in cases.iter().zip(&corpus) {
        assert_eq!(
            case["text"],
            text.as_str(),
            "{name} is out of date with the corpus"
        );
    }
    cases
}

/// Encodes every case both ways and decodes llama.cpp's ids; returns what differs.
fn compare(tokenizer: &Tokenizer, cases: &[serde_json::Value]) -> Vec<String> {
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().expect("text");
        for (options, key) in [
            (EncodeOptions::PROMPT, "parse_special"),
            (ADD_ONLY, "plain"),
        ] {
            let expected = ids(&case[key]);
            let ours = tokenizer.encode(text, options).expect("encodes");
            if ours != expected {
                failures.push(format!(
                    "{key} {text:?}\n   ours:      {ours:?}\n   llama.cpp: {expected:?}"
                ));
            }
        }
        let decoded = tokenizer
            .decode(&ids(&case["parse_special"]), DecodeOptions::VERBATIM)
            .expect("known ids");
        let expected = case["detokenized"].as_str().expect("detokenized");
        if decoded != expected {
            failures.push(format!(
                "decode {text:?}\n   ours:      {decoded:?}\n   llama.cpp: {expected:?}"
            ));
        }
    }
    failures
}

/// Every corpus entry encodes to llama.cpp's ids, with special tokens parsed (its CLI's
/// default) and not parsed, and llama.cpp's ids decode to its text; all mismatches are
/// listed.
fn corpus_matches_llama_cpp(file: &'static str) {
    let cases = references(file);
    let failures = compare(tokenizer(file), &cases);
    assert!(
        failures.is_empty(),
        "{file}: {} of {} checks differ from llama.cpp:\n{}",
        failures.len(),
        3 * cases.len(),
        failures.join("\n")
    );
}

#[test]
fn smollm2_corpus_matches_llama_cpp() {
    corpus_matches_llama_cpp(SMOLLM2);
}

#[test]
fn gemma3_corpus_matches_llama_cpp() {
    corpus_matches_llama_cpp(GEMMA3);
}

fn golden_prompts_match(file: &'static str) {
    let tokenizer = tokenizer(file);
    let golden = golden(file);
    let cases = golden["cases"].as_array().expect("cases");
    assert!(!cases.is_empty());
    for case in cases {
        let prompt = case["prompt"].as_str().expect("prompt");
        let expected = ids(&case["prompt_tokens"]);
        assert_eq!(
            tokenizer.encode(prompt, EncodeOptions::PROMPT).unwrap(),
            expected,
            "{prompt:?}"
        );
        assert_eq!(
            tokenizer.encode(prompt, ADD_ONLY).unwrap(),
            expected,
            "{prompt:?}"
        );
        // llama.cpp's greedy continuation decodes to its text.
        let generated = ids(&case["greedy_tokens"]);
        let text = tokenizer.decode(&generated, DecodeOptions::TEXT).unwrap();
        assert_eq!(
            text,
            case["greedy_text"].as_str().expect("greedy_text"),
            "{prompt:?}"
        );
    }
}

#[test]
fn smollm2_golden_prompts_match() {
    golden_prompts_match(SMOLLM2);
}

#[test]
fn gemma3_golden_prompts_match() {
    golden_prompts_match(GEMMA3);
}

/// SmolLM2's vocabulary under the other BPE pre-tokenizers: llama.cpp's ids for each come
/// from a vocabulary-only copy of the file with `tokenizer.ggml.pre` changed.
#[test]
fn other_bpe_pre_tokenizers_match_llama_cpp() {
    let metadata = read_metadata(&model_path(SMOLLM2));
    let mut failures = Vec::new();
    for pre in ["llama-bpe", "qwen2", "gpt-2", "default"] {
        let mut variant = metadata.clone();
        variant.set(keys::PRE, Value::String(pre.to_owned()));
        let tokenizer = Tokenizer::from_metadata(&variant).expect("tokenizer builds");
        let name = format!("tokenizer_refs_smollm2_pre_{pre}.json");
        let cases = references_in(&name, &format!("variant-{pre}.gguf"));
        failures.extend(
            compare(&tokenizer, &cases)
                .into_iter()
                .map(|f| format!("{pre}: {f}")),
        );
    }
    assert!(
        failures.is_empty(),
        "{} differences:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn stream(tokenizer: &Tokenizer, ids: &[TokenId]) -> (String, usize) {
    let mut decoder = tokenizer.stream_decoder(true);
    let mut text = String::new();
    let mut waits = 0;
    for &id in ids {
        let chunk = decoder.push(id).expect("known id");
        waits += usize::from(decoder.has_pending());
        text.push_str(&chunk);
    }
    text.push_str(&decoder.finish());
    (text, waits)
}

/// Plain text survives encode → streaming decode unchanged, one token at a time, and
/// the stream equals the whole-sequence decode. Returns how often the decoder had to
/// hold back part of a character.
fn streaming_round_trip(file: &'static str, lossless: impl Fn(&str) -> bool) -> usize {
    let tokenizer = tokenizer(file);
    let mut held_back = 0;
    for text in corpus() {
        let ids = tokenizer.encode(&text, EncodeOptions::TEXT).unwrap();
        let (streamed, waits) = stream(tokenizer, &ids);
        held_back += waits;
        assert_eq!(
            streamed,
            tokenizer.decode(&ids, DecodeOptions::VERBATIM).unwrap(),
            "{text:?}"
        );
        if lossless(&text) {
            assert_eq!(streamed, text, "{ids:?}");
        }
    }
    held_back
}

#[test]
fn smollm2_streaming_round_trip() {
    // Byte-level BPE is lossless, and this vocabulary asks for no clean-up of spaces.
    let held_back = streaming_round_trip(SMOLLM2, |_| true);
    assert!(
        held_back > 0,
        "the corpus should split some character across tokens"
    );
}

#[test]
fn gemma3_streaming_round_trip() {
    // SentencePiece writes spaces as U+2581, so a U+2581 in the input comes back a space.
    let held_back = streaming_round_trip(GEMMA3, |text| !text.contains('\u{2581}'));
    assert!(
        held_back > 0,
        "the corpus should need byte fallback somewhere"
    );
}

#[test]
fn special_tokens_follow_the_metadata() {
    let smollm2 = tokenizer(SMOLLM2);
    let special = smollm2.special_tokens();
    assert_eq!((special.bos, special.eos), (Some(1), Some(2)));
    assert!(!smollm2.adds_bos());
    assert_eq!(smollm2.n_tokens(), 49152);
    // As llama.cpp lists them: <|endoftext|>, <|im_end|> and the repository-name token.
    assert_eq!(smollm2.end_of_generation_tokens(), [0, 2, 4]);
    assert!(smollm2.is_end_of_generation(smollm2.token_id("<|im_end|>").unwrap()));
    assert!(!smollm2.is_end_of_generation(smollm2.token_id("<|im_start|>").unwrap()));

    let gemma3 = tokenizer(GEMMA3);
    let special = gemma3.special_tokens();
    assert_eq!(
        (special.bos, special.eos, special.eot),
        (Some(2), Some(1), Some(106))
    );
    assert!(gemma3.adds_bos() && !gemma3.adds_eos());
    assert_eq!(gemma3.n_tokens(), 262_144);
    assert_eq!(gemma3.end_of_generation_tokens(), [1, 106, 212]);
    assert_eq!(gemma3.encode("", EncodeOptions::PROMPT).unwrap(), [2]);
    assert_eq!(
        gemma3.decode(&[2, 818, 5279], DecodeOptions::TEXT).unwrap(),
        "The capital",
        "control tokens give no text unless asked"
    );
}
