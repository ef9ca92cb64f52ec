use std::sync::Arc;

use super::*;
use crate::sampling::Xoshiro256;
use crate::tokenizer::{token_type, VocabSpec};

/// A SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte-fallback tokens, a
/// few merged pieces, and an unused token last.
fn spm() -> Tokenizer {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut types = vec![
        token_type::UNKNOWN,
        token_type::CONTROL,
        token_type::CONTROL,
    ];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(token_type::BYTE);
    }
    for piece in [
        "▁{", "{\"", "\":", "true", "false", "▁hello", "name", "\"}", "12",
    ] {
        tokens.push(piece.into());
        types.push(token_type::NORMAL);
    }
    tokens.push("<unused0>".into());
    types.push(token_type::UNUSED);
    Tokenizer::new(VocabSpec {
        model: "llama".into(),
        tokens: tokens.into(),
        token_types: Some(types),
        bos_id: Some(1),
        eos_id: Some(2),
        unk_id: Some(0),
        add_space_prefix: Some(false),
        ..VocabSpec::default()
    })
    .unwrap()
}

/// GPT-2's byte alphabet: printable bytes stand for themselves, the others for the
/// characters from U+0100 on, in order.
fn gpt2_char(b: u8) -> char {
    let printable = |x: u8| matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        char::from(b)
    } else {
        let n = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + n).unwrap()
    }
}

fn byte(b: u8) -> TokenId {
    3 + TokenId::from(b)
}

#[test]
fn tokens_become_the_bytes_they_decode_to() {
    let t = spm();
    let words = token_words(&t, t.n_tokens() + 2);
    assert_eq!(words.len(), t.n_tokens() + 2);
    // Byte fallback: the byte itself, also outside ASCII.
    assert_eq!(words[byte(b'A') as usize], b"A");
    assert_eq!(words[byte(0xE2) as usize], [0xE2]);
    // SentencePiece's visible space is a space.
    let hello = t.token_id("▁hello").unwrap() as usize;
    assert_eq!(words[hello], b" hello");
    // Control and unknown tokens are special, never text.
    assert_eq!(words[2], b"\xff</s>");
    assert_eq!(words[0], b"\xff<unk>");
    // Unused tokens and ids past the tokenizer's vocabulary stand for nothing.
    let unused = t.token_id("<unused0>").unwrap() as usize;
    assert!(words[unused].is_empty());
    assert!(words[t.n_tokens()].is_empty());
}

#[test]
fn byte_level_bpe_tokens_map_back_to_bytes() {
    // GPT-2's byte alphabet: 'Ġ' is the space, 'Ċ' the newline, 'Ã' and '©' the bytes
    // of "é".
    let mut tokens: Vec<String> = (0..=255u8).map(|b| gpt2_char(b).to_string()).collect();
    tokens.extend(["Ġthe", "ĠÃ©", "ĊĊ", "<|endoftext|>"].map(String::from));
    let mut types = vec![token_type::NORMAL; tokens.len()];
    *types.last_mut().unwrap() = token_type::CONTROL;
    let t = Tokenizer::new(VocabSpec {
        model: "gpt2".into(),
        pre: Some("gpt2".into()),
        tokens: tokens.into(),
        token_types: Some(types),
        eos_id: Some(259),
        ..VocabSpec::default()
    })
    .unwrap();
    let words = token_words(&t, t.n_tokens());
    assert_eq!(words[256], b" the");
    assert_eq!(words[257], " é".as_bytes());
    assert_eq!(words[258], b"\n\n");
    assert_eq!(words[259], b"\xff<|endoftext|>");
    for b in 0..=255u8 {
        assert_eq!(words[b as usize], [b], "byte {b}");
    }
    let grammars = Grammars::new(Arc::new(t), 260).unwrap();
    assert_eq!(grammars.token_bytes(256), b" the");
}

/// Runs a "model" of random logits under `spec` until the grammar ends it (or `limit`
/// tokens): the text, and whether it ended.
fn random_run(
    grammars: &Grammars,
    t: &Tokenizer,
    spec: &ConstraintSpec,
    seed: u64,
) -> (String, bool) {
    let mut c = grammars.compile(spec).unwrap();
    let mut rng = Xoshiro256::seed_from_u64(seed);
    let mut out = Vec::new();
    for _ in 0..200 {
        let mut logits: Vec<f32> = (0..t.n_tokens()).map(|_| rng.next_f64() as f32).collect();
        c.mask(&mut logits).unwrap();
        let best = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap();
        assert!(logits[best].is_finite(), "the mask allows nothing");
        let token = best as TokenId;
        if t.is_end_of_generation(token) {
            return (String::from_utf8(out).unwrap(), true);
        }
        out.extend_from_slice(t.token_bytes(token, false).unwrap());
        if c.commit(token).unwrap() {
            return (String::from_utf8(out).unwrap(), true);
        }
    }
    (String::from_utf8(out).unwrap(), false)
}

#[test]
fn random_logits_under_a_schema_give_json_of_that_schema() {
    let t = Arc::new(spm());
    let grammars = Grammars::new(Arc::clone(&t), t.n_tokens()).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "tag": {"enum": ["hello", "name"]}
        },
        "required": ["ok", "n", "tag"],
        "additionalProperties": false
    });
    let spec = ConstraintSpec::JsonSchema(schema);
    for seed in 0..8 {
        let (text, ended) = random_run(&grammars, &t, &spec, seed);
        assert!(ended, "{text}");
        let value: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(value["ok"].is_boolean(), "{text}");
        assert!(value["n"].as_u64().is_some_and(|n| n <= 99), "{text}");
        assert!(
            matches!(value["tag"].as_str(), Some("hello" | "name")),
            "{text}"
        );
        assert_eq!(value.as_object().unwrap().len(), 3, "{text}");
    }
}

#[test]
fn random_logits_under_a_regex_match_it_whole() {
    let t = Arc::new(spm());
    let grammars = Grammars::new(Arc::clone(&t), t.n_tokens()).unwrap();
    let spec = ConstraintSpec::Regex("(yes|no) [0-9]{3}".into());
    for seed in 0..8 {
        let (text, ended) = random_run(&grammars, &t, &spec, seed);
        assert!(ended, "{text}");
        let (word, digits) = text.split_once(' ').unwrap_or_else(|| panic!("{text:?}"));
        assert!(word == "yes" || word == "no", "{text:?}");
        assert!(
            digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()),
            "{text:?}"
        );
    }
}

#[test]
fn a_lark_grammar_holds_the_output() {
    let t = Arc::new(spm());
    let grammars = Grammars::new(Arc::clone(&t), t.n_tokens()).unwrap();
    let spec = ConstraintSpec::Lark("start: \"a\" mid \"z\"\nmid: /[b-d]{2}/\n".into());
    for seed in 0..4 {
        let (text, ended) = random_run(&grammars, &t, &spec, seed);
        assert!(ended, "{text}");
        assert_eq!(text.len(), 4, "{text:?}");
        assert!(text.starts_with('a') && text.ends_with('z'), "{text:?}");
    }
}

#[test]
fn a_json_object_is_an_object() {
    let t = Arc::new(spm());
    let grammars = Grammars::new(Arc::clone(&t), t.n_tokens()).unwrap();
    let mut c = grammars.compile(&ConstraintSpec::JsonObject).unwrap();
    let mut logits = vec![0.0; t.n_tokens()];
    c.mask(&mut logits).unwrap();
    // Only an opening brace may start it (no optional white space either).
    let allowed: Vec<TokenId> = (0..logits.len() as TokenId)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    let brace = byte(b'{');
    let brace_quote = t.token_id("{\"").unwrap();
    assert!(
        allowed.contains(&brace) && allowed.contains(&brace_quote),
        "{allowed:?}"
    );
    assert!(allowed
        .iter()
        .all(|&i| t.token_bytes(i, false).unwrap().starts_with(b"{")));
    // Not complete until the object is closed; the end of generation only then.
    assert!(!c.commit(brace).unwrap());
    assert!(!c.is_accepting());
    assert!(c.commit(byte(b'}')).unwrap() || c.is_accepting());
}

#[test]
fn specs_that_do_not_compile_say_why() {
    let t = Arc::new(spm());
    let grammars = Grammars::new(Arc::clone(&t), t.n_tokens()).unwrap();
    for spec in [
        ConstraintSpec::JsonSchema(serde_json::json!({"type": "no-such-type"})),
        ConstraintSpec::JsonSchema(serde_json::json!("object")),
        ConstraintSpec::Regex("(unclosed".into()),
        ConstraintSpec::Lark("start: undefined_rule".into()),
        ConstraintSpec::Lark("this is not a grammar".into()),
    ] {
        match grammars.compile(&spec) {
            Err(ConstraintError::Compile(message)) => assert!(!message.is_empty(), "{spec:?}"),
            other => panic!("{spec:?} compiled: {other:?}"),
        }
    }
}

#[test]
fn a_mask_applies_its_bits_to_any_row() {
    // 70 ids: two whole words and six bits of a third.
    let allowed = [0, 5, 31, 32, 63, 64, 69];
    let mask = TokenMask::from_tokens(70, allowed.iter().copied().chain([70, 1000]));
    assert_eq!(mask.words().len(), 3);
    assert_eq!(
        mask.words()[2] >> 6,
        0,
        "bits past the vocabulary are clear"
    );
    for len in [70, 64, 100] {
        let mut row = vec![1.5f32; len];
        mask.apply(&mut row);
        for (id, &v) in row.iter().enumerate() {
            let want = allowed.contains(&(id as TokenId));
            assert_eq!(v.is_finite(), want, "row of {len}, id {id}");
            assert_eq!(mask.allows(id as TokenId), want, "id {id}");
        }
    }
}

#[test]
fn a_grammars_mask_is_its_bits_and_ends_with_any_end_token() {
    let t = Arc::new(spm());
    // Ids past the tokenizer's (a model's padded output) are never allowed.
    let n_vocab = t.n_tokens() + 40;
    let grammars = Grammars::new(Arc::clone(&t), n_vocab).unwrap();
    let mut c = grammars
        .compile(&ConstraintSpec::Regex("a?".into()))
        .unwrap();
    let mask = c.next_mask(n_vocab).unwrap();
    assert_eq!(mask.n_vocab(), n_vocab);
    let allowed: Vec<TokenId> = (0..n_vocab as TokenId)
        .filter(|&i| mask.allows(i))
        .collect();
    // The empty text is whole, so the end (</s>) is allowed, beside "a".
    assert_eq!(allowed, vec![2, byte(b'a')]);
    let mut logits = vec![0.0; n_vocab];
    c.mask(&mut logits).unwrap();
    let finite: Vec<TokenId> = (0..n_vocab as TokenId)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    assert_eq!(finite, allowed);
    // After "a" the grammar is whole and allows nothing more: it is complete.
    assert!(c.commit(byte(b'a')).unwrap());
}

#[test]
fn a_token_the_grammar_does_not_allow_is_refused() {
    let t = Arc::new(spm());
    let grammars = Grammars::new(Arc::clone(&t), t.n_tokens()).unwrap();
    let mut c = grammars
        .compile(&ConstraintSpec::Regex("[a-c]+".into()))
        .unwrap();
    assert!(!c.commit(byte(b'a')).unwrap());
    let refused = c.commit(byte(b'z')).unwrap_err();
    assert!(refused.contains(&byte(b'z').to_string()), "{refused}");
    // After a refusal the grammar gives no mask: the sequence cannot go on.
    assert!(c.next_mask(t.n_tokens()).is_err());
}
