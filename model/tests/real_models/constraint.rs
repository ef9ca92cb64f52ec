//! Output constraints on the real vocabularies: SmolLM2's byte-level BPE and Gemma 3's
//! SentencePiece with byte fallback turned into `llguidance`'s trie, each token as the
//! bytes it decodes to, and JSON held to a schema whatever the logits.

use std::sync::Arc;

use model::constraint::{token_words, ConstraintSpec, Grammars};
use model::sampling::Xoshiro256;
use model::tokenizer::{DecodeOptions, TokenId, Tokenizer};

use crate::common::{model_path, read_metadata, GEMMA3, SMOLLM2};

fn tokenizer(file: &str) -> Arc<Tokenizer> {
    let metadata = read_metadata(&model_path(file));
    Arc::new(Tokenizer::from_metadata(&metadata).expect("the tokenizer"))
}

/// Every text token's trie bytes decode back to it, among them each of `examples`
/// (a token and its bytes); control tokens are marked special.
fn words_are_the_decoded_bytes(file: &str, examples: &[(&str, &[u8])]) {
    let t = tokenizer(file);
    let words = token_words(&t, t.n_tokens());
    let mut special = 0;
    for (id, word) in words.iter().enumerate() {
        let id = id as TokenId;
        let text = t.token_bytes(id, false).unwrap();
        if !text.is_empty() {
            // Also the byte token of 0xFF, which reads as the special marker (it is
            // never part of UTF-8 text, so no grammar wants it).
            assert_eq!(word.as_slice(), text, "{id}");
        } else if !word.is_empty() {
            special += 1;
            assert_eq!(word[0], 0xFF, "{id}");
            assert_eq!(&word[1..], t.token_bytes(id, true).unwrap(), "{id}");
        }
    }
    assert!(special > 0, "no control token");
    for &eog in t.end_of_generation_tokens() {
        assert_eq!(words[eog as usize].first(), Some(&0xFF), "{eog}");
    }
    // A whole sentence: the concatenated words are the decoded text.
    let ids = t
        .encode(
            " {\"name\": \"Zoë\", \"n\": 12}\n",
            model::tokenizer::EncodeOptions::TEXT,
        )
        .unwrap();
    let joined: Vec<u8> = ids
        .iter()
        .flat_map(|&i| words[i as usize].clone())
        .collect();
    assert_eq!(joined, t.decode_bytes(&ids, DecodeOptions::TEXT).unwrap());
    for &(token, bytes) in examples {
        let id = t.token_id(token).expect(token);
        assert_eq!(words[id as usize], bytes);
    }
}

#[test]
fn smollm2_byte_level_tokens_are_their_bytes() {
    words_are_the_decoded_bytes(SMOLLM2, &[("Ġthe", b" the"), ("Ċ", b"\n")]);
}

#[test]
fn gemma3_byte_fallback_tokens_are_their_bytes() {
    words_are_the_decoded_bytes(
        GEMMA3,
        &[("<0x41>", b"A"), ("<0xE2>", &[0xE2]), ("▁the", b" the")],
    );
}

/// Random logits under a schema: the output is JSON of it, ended by the grammar or an
/// end-of-generation token it allowed.
fn schema_holds_random_logits(file: &str) {
    let t = tokenizer(file);
    let grammars = Grammars::new(Arc::clone(&t), t.n_tokens()).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 999}
        },
        "required": ["ok", "n"],
        "additionalProperties": false
    });
    let spec = ConstraintSpec::JsonSchema(schema);
    for seed in 0..3 {
        let mut c = grammars.compile(&spec).unwrap();
        let mut rng = Xoshiro256::seed_from_u64(seed);
        let mut out = Vec::new();
        let mut ended = false;
        for _ in 0..64 {
            let mut logits: Vec<f32> = (0..t.n_tokens()).map(|_| rng.next_f64() as f32).collect();
            c.mask(&mut logits).unwrap();
            let token = (0..logits.len())
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                .unwrap() as TokenId;
            if t.is_end_of_generation(token) {
                ended = true;
                break;
            }
            out.extend_from_slice(t.token_bytes(token, false).unwrap());
            if c.commit(token).unwrap() {
                ended = true;
                break;
            }
        }
        let text = String::from_utf8(out).unwrap();
        assert!(ended, "{file}: {text:?}");
        let value: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{file}: {text:?}: {e}"));
        assert!(value["ok"].is_boolean() && value["n"].is_i64(), "{text}");
    }
}

#[test]
fn smollm2_schema_holds_random_logits() {
    schema_holds_random_logits(SMOLLM2);
}

#[test]
fn gemma3_schema_holds_random_logits() {
    schema_holds_random_logits(GEMMA3);
}
