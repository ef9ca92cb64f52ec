//! The tokenizer's description as a GGUF file stores it, before any defaults are applied.

use gguf_format::{Array, Metadata, StringArray};

use super::TokenizerError;

/// Metadata keys of the tokenizer (`tokenizer.ggml.*`).
pub mod keys {
    pub const MODEL: &str = "tokenizer.ggml.model";
    pub const PRE: &str = "tokenizer.ggml.pre";
    pub const TOKENS: &str = "tokenizer.ggml.tokens";
    pub const SCORES: &str = "tokenizer.ggml.scores";
    pub const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
    pub const MERGES: &str = "tokenizer.ggml.merges";
    pub const BOS_ID: &str = "tokenizer.ggml.bos_token_id";
    pub const EOS_ID: &str = "tokenizer.ggml.eos_token_id";
    pub const EOT_ID: &str = "tokenizer.ggml.eot_token_id";
    pub const EOM_ID: &str = "tokenizer.ggml.eom_token_id";
    pub const UNK_ID: &str = "tokenizer.ggml.unknown_token_id";
    pub const PAD_ID: &str = "tokenizer.ggml.padding_token_id";
    pub const ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
    pub const ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
    pub const ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
    /// Not a tokenizer key: llama.cpp gives some families' special tokens attributes by
    /// the model's name.
    pub const GENERAL_NAME: &str = "general.name";
}

/// The `tokenizer.ggml.token_type` values.
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Everything a tokenizer is built from, as stored in the file: `None` where a key is
/// absent (the tokenizer then applies llama.cpp's defaults for the model type).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VocabSpec {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer of a BPE vocabulary.
    pub pre: Option<String>,
    /// The token texts; the index is the token id. Read from a file's metadata, this
    /// shares the metadata's buffer rather than copying it.
    pub tokens: StringArray,
    /// Per-token scores (SentencePiece merge priorities).
    pub scores: Option<Vec<f32>>,
    /// Per-token types (see [`token_type`]).
    pub token_types: Option<Vec<i32>>,
    /// BPE merges in priority order, each `"left right"` (shared like `tokens`).
    pub merges: StringArray,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub eot_id: Option<u32>,
    pub eom_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    /// `general.name`: Phi-3's special tokens swallow the white space after them when
    /// the name says Phi-3, as in llama.cpp.
    pub model_name: Option<String>,
}

impl VocabSpec {
    /// Reads the tokenizer keys of a GGUF file's metadata.
    pub fn from_metadata(metadata: &Metadata) -> Result<VocabSpec, TokenizerError> {
        let scores = match metadata.get(keys::SCORES) {
            None => None,
            Some(_) => Some(match metadata.get_array(keys::SCORES)? {
                // Some converters store integer scores; llama.cpp accepts those too.
                Array::I32(values) => values.iter().map(|&v| v as f32).collect(),
                _ => metadata.get_f32_array(keys::SCORES)?.to_vec(),
            }),
        };
        let token_types = match metadata.get(keys::TOKEN_TYPE) {
            None => None,
            Some(_) => Some(metadata.get_i32_array(keys::TOKEN_TYPE)?.to_vec()),
        };
        let merges = match metadata.get(keys::MERGES) {
            None => StringArray::new(),
            Some(_) => metadata.get_string_array(keys::MERGES)?.clone(),
        };
        Ok(VocabSpec {
            model: metadata.get_str(keys::MODEL)?.to_owned(),
            pre: metadata.get_opt::<&str>(keys::PRE)?.map(str::to_owned),
            tokens: metadata.get_string_array(keys::TOKENS)?.clone(),
            scores,
            token_types,
            merges,
            bos_id: metadata.get_opt(keys::BOS_ID)?,
            eos_id: metadata.get_opt(keys::EOS_ID)?,
            eot_id: metadata.get_opt(keys::EOT_ID)?,
            eom_id: metadata.get_opt(keys::EOM_ID)?,
            unk_id: metadata.get_opt(keys::UNK_ID)?,
            pad_id: metadata.get_opt(keys::PAD_ID)?,
            add_bos: metadata.get_opt(keys::ADD_BOS)?,
            add_eos: metadata.get_opt(keys::ADD_EOS)?,
            add_space_prefix: metadata.get_opt(keys::ADD_SPACE_PREFIX)?,
            model_name: metadata
                .get_opt::<&str>(keys::GENERAL_NAME)?
                .map(str::to_owned),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf_format::{GgufError, Value};

    fn metadata(entries: Vec<(&str, Value)>) -> Metadata {
        let mut m = Metadata::new();
        for (k, v) in entries {
            m.set(k, v);
        }
        m
    }

    fn strings(items: &[&str]) -> Value {
        Value::Array(Array::String(items.iter().collect()))
    }

    #[test]
    fn reads_present_keys_and_leaves_absent_ones_unset() {
        let m = metadata(vec![
            (keys::MODEL, Value::String("gpt2".into())),
            (keys::PRE, Value::String("smollm".into())),
            (keys::TOKENS, strings(&["a", "b", "ab"])),
            (keys::MERGES, strings(&["a b"])),
            (keys::BOS_ID, Value::U32(1)),
            (keys::ADD_BOS, Value::Bool(false)),
            (keys::SCORES, Value::Array(Array::I32(vec![0, -1, -2]))),
        ]);
        let spec = VocabSpec::from_metadata(&m).unwrap();
        // The texts are the metadata's, not a copy.
        let tokens = m.get_string_array(keys::TOKENS).unwrap();
        assert!(spec.tokens.shares_buffer_with(tokens));
        assert_eq!(spec.model, "gpt2");
        assert_eq!(spec.pre.as_deref(), Some("smollm"));
        assert_eq!(spec.tokens, ["a", "b", "ab"]);
        assert_eq!(spec.merges, ["a b"]);
        assert_eq!(spec.bos_id, Some(1));
        assert_eq!(spec.eos_id, None);
        assert_eq!(spec.add_bos, Some(false));
        assert_eq!(spec.add_space_prefix, None);
        assert_eq!(spec.scores, Some(vec![0.0, -1.0, -2.0]));
        assert_eq!(spec.token_types, None);
    }

    #[test]
    fn wrong_types_name_the_key() {
        let m = metadata(vec![
            (keys::MODEL, Value::String("llama".into())),
            (keys::TOKENS, strings(&["a"])),
            (keys::ADD_BOS, Value::U32(1)),
        ]);
        let err = VocabSpec::from_metadata(&m).unwrap_err();
        assert!(
            matches!(&err, TokenizerError::Metadata(GgufError::WrongType { key, .. }) if key == keys::ADD_BOS),
            "{err}"
        );
        let m = metadata(vec![(keys::MODEL, Value::String("llama".into()))]);
        let err = VocabSpec::from_metadata(&m).unwrap_err();
        assert!(
            matches!(&err, TokenizerError::Metadata(GgufError::MissingKey { key }) if key == keys::TOKENS),
            "{err}"
        );
    }
}
