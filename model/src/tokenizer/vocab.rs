//! The resolved vocabulary: texts, scores, attributes, text→id lookup, the special ids
//! with llama.cpp's defaults applied, and the end-of-generation set.

use std::borrow::Cow;

use gguf_format::StringArray;

use super::index::TokenIndex;
use super::spec::{token_type, VocabSpec};
use super::{TokenId, TokenizerError};

/// Token attributes, a bit set (a token may be both user-defined and control).
pub(super) mod attr {
    pub const UNDEFINED: u8 = 0;
    pub const UNKNOWN: u8 = 1 << 0;
    pub const UNUSED: u8 = 1 << 1;
    pub const NORMAL: u8 = 1 << 2;
    pub const CONTROL: u8 = 1 << 3;
    pub const USER_DEFINED: u8 = 1 << 4;
    pub const BYTE: u8 = 1 << 5;
    /// White space after the token in the input is dropped when it is matched.
    pub const RSTRIP: u8 = 1 << 6;
}

/// Texts that end a turn when the metadata names no EOT token, in order of preference.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<end_of_utterance>",
];

/// Texts of tokens that end generation whatever the metadata says. llama.cpp marks these
/// as control tokens even when the file calls them user-defined, which changes how text
/// containing them is split: Gemma 3's `</s>`, for one, is then only recognised when
/// special tokens are parsed.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// Fill-in-the-middle tokens that also end generation (pad, repository, file separator):
/// the first text found in each group counts.
const FIM_EOG_GROUPS: &[&[&str]] = &[
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    &[
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ],
    &["<|file_sep|>"],
];

/// Which algorithm turns a piece of text into tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum VocabKind {
    /// `gpt2`: byte-level BPE with merges.
    BytePairEncoding,
    /// `llama`: SentencePiece with scores and byte fallback.
    SentencePiece,
}

/// Special token ids; `None` where the model has none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<TokenId>,
    pub eos: Option<TokenId>,
    pub eot: Option<TokenId>,
    pub eom: Option<TokenId>,
    pub unk: Option<TokenId>,
    pub pad: Option<TokenId>,
}

pub(super) struct Vocab {
    pub kind: VocabKind,
    /// Token texts, indexed by id; usually shared with the file's metadata.
    pub texts: StringArray,
    /// SentencePiece merge scores, by id; empty for byte-level BPE, which merges by rank.
    pub scores: Vec<f32>,
    pub attrs: Vec<u8>,
    index: TokenIndex,
    pub special: SpecialTokens,
    /// Sorted ids that end generation.
    pub eog: Vec<TokenId>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
}

impl Vocab {
    /// Applies llama.cpp's defaults for `kind` and the metadata's overrides to `spec`,
    /// taking its texts, scores and types without copying them. `bpe_adds_bos` is the
    /// pre-tokenizer's default for BPE vocabularies.
    pub fn new(
        spec: VocabSpec,
        kind: VocabKind,
        bpe_adds_bos: bool,
    ) -> Result<Vocab, TokenizerError> {
        let n_tokens = spec.tokens.len();
        if n_tokens == 0 {
            return Err(TokenizerError::EmptyVocabulary);
        }
        if u32::try_from(n_tokens).is_err() {
            return Err(TokenizerError::TooManyTokens { n_tokens });
        }
        let texts = with_placeholders(spec.tokens);
        if u32::try_from(texts.text_len()).is_err() {
            return Err(TokenizerError::VocabularyTooLarge {
                bytes: texts.text_len(),
            });
        }
        let index =
            TokenIndex::new(&texts).map_err(|(first, second)| TokenizerError::DuplicateToken {
                text: texts[second as usize].to_owned(),
                first,
                second,
            })?;
        let mut scores = per_token(spec.scores, "tokenizer.ggml.scores", n_tokens, 0.0)?;
        if kind == VocabKind::BytePairEncoding {
            scores = Vec::new();
        }
        let attrs = match spec.token_types {
            None => vec![attr::NORMAL; n_tokens],
            Some(types) if types.len() < n_tokens => {
                return Err(TokenizerError::ArrayTooShort {
                    key: "tokenizer.ggml.token_type",
                    len: types.len(),
                    n_tokens,
                })
            }
            Some(types) => types[..n_tokens].iter().map(|&t| attr_of_type(t)).collect(),
        };

        let (defaults, add_bos, add_space_prefix) = match kind {
            VocabKind::SentencePiece => (
                SpecialTokens {
                    bos: Some(1),
                    eos: Some(2),
                    unk: Some(0),
                    ..SpecialTokens::default()
                },
                true,
                true,
            ),
            VocabKind::BytePairEncoding => (
                SpecialTokens {
                    bos: Some(11),
                    eos: Some(11),
                    ..SpecialTokens::default()
                },
                bpe_adds_bos,
                false,
            ),
        };
        // A default outside the vocabulary is dropped; a metadata id outside it is ignored.
        let pick = |default: Option<TokenId>, from_file: Option<u32>| {
            let default = default.filter(|&id| (id as usize) < n_tokens);
            match from_file {
                Some(id) if (id as usize) < n_tokens => Some(id),
                _ => default,
            }
        };
        let special = SpecialTokens {
            bos: pick(defaults.bos, spec.bos_id),
            eos: pick(defaults.eos, spec.eos_id),
            eot: pick(None, spec.eot_id),
            eom: pick(None, spec.eom_id),
            unk: pick(defaults.unk, spec.unk_id),
            pad: pick(None, spec.pad_id),
        };
        let mut vocab = Vocab {
            kind,
            texts,
            scores,
            attrs,
            index,
            special,
            eog: Vec::new(),
            add_bos: spec.add_bos.unwrap_or(add_bos),
            add_eos: spec.add_eos.unwrap_or(false),
            add_space_prefix: spec.add_space_prefix.unwrap_or(add_space_prefix),
        };
        vocab.find_end_tokens();
        if let Some(name) = &spec.model_name {
            vocab.set_name_attributes(name);
        }
        Ok(vocab)
    }

    /// The attributes llama.cpp gives tokens by the model's name: a Phi-3 file's special
    /// tokens (and `</s>`) drop the white space after them, except `<unk>`, `<s>` and
    /// `<|endoftext|>`.
    fn set_name_attributes(&mut self, name: &str) {
        let name = name.to_lowercase();
        if !(name.contains("phi-3") || name.contains("phi3")) {
            return;
        }
        for id in 0..self.len() as TokenId {
            if self.is_special_text(id) {
                self.attrs[id as usize] |= attr::RSTRIP;
            }
        }
        let mut set = |text: &str, on: bool| {
            if let Some(id) = self.id(text) {
                let a = &mut self.attrs[id as usize];
                *a = if on {
                    *a | attr::RSTRIP
                } else {
                    *a & !attr::RSTRIP
                };
            }
        };
        set("</s>", true);
        for text in ["<unk>", "<s>", "<|endoftext|>"] {
            set(text, false);
        }
    }

    /// Finds EOT/EOM by text when the metadata does not name them, and builds the
    /// end-of-generation set; tokens found by text become control tokens.
    fn find_end_tokens(&mut self) {
        if self.special.eot.is_none() {
            self.special.eot = EOT_TEXTS.iter().find_map(|t| self.id(t));
            if let Some(id) = self.special.eot {
                self.attrs[id as usize] |= attr::CONTROL;
            }
        }
        if self.special.eom.is_none() {
            self.special.eom = self.id("<|eom_id|>");
            if let Some(id) = self.special.eom {
                self.attrs[id as usize] |= attr::CONTROL;
            }
        }
        let fim = FIM_EOG_GROUPS
            .iter()
            .filter_map(|group| group.iter().find_map(|t| self.id(t)));
        let mut eog: Vec<TokenId> = EOG_TEXTS
            .iter()
            .filter_map(|t| self.id(t))
            .chain(fim)
            .collect();
        for &id in &eog {
            self.attrs[id as usize] |= attr::CONTROL;
        }
        eog.extend(
            [self.special.eos, self.special.eot, self.special.eom]
                .into_iter()
                .flatten(),
        );
        eog.sort_unstable();
        eog.dedup();
        self.eog = eog;
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    /// The id of the token whose text is exactly `text`.
    pub fn id(&self, text: &str) -> Option<TokenId> {
        self.index.get(&self.texts, text)
    }

    pub fn attr(&self, id: TokenId) -> u8 {
        self.attrs[id as usize]
    }

    /// Control, user-defined and unknown tokens: matched as whole tokens in input text
    /// (control and unknown only when special tokens are parsed).
    pub fn is_special_text(&self, id: TokenId) -> bool {
        self.attr(id) & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0
    }
}

/// The texts, with a placeholder for each empty one (which could never be matched), as
/// llama.cpp does; shared as they are when none is empty.
fn with_placeholders(texts: StringArray) -> StringArray {
    if !texts.lens().any(|len| len == 0) {
        return texts;
    }
    texts
        .iter()
        .enumerate()
        .map(|(id, text)| match text {
            "" => Cow::Owned(format!("[EMPTY_{id}]")),
            text => Cow::Borrowed(text),
        })
        .collect()
}

/// A per-token array of the file, `n_tokens` long, or `default` for each token without
/// one.
fn per_token<T: Copy>(
    values: Option<Vec<T>>,
    key: &'static str,
    n_tokens: usize,
    default: T,
) -> Result<Vec<T>, TokenizerError> {
    match values {
        None => Ok(vec![default; n_tokens]),
        Some(v) if v.len() < n_tokens => Err(TokenizerError::ArrayTooShort {
            key,
            len: v.len(),
            n_tokens,
        }),
        Some(mut v) => {
            v.truncate(n_tokens);
            Ok(v)
        }
    }
}

fn attr_of_type(t: i32) -> u8 {
    match t {
        token_type::NORMAL => attr::NORMAL,
        token_type::UNKNOWN => attr::UNKNOWN,
        token_type::CONTROL => attr::CONTROL,
        token_type::USER_DEFINED => attr::USER_DEFINED,
        token_type::UNUSED => attr::UNUSED,
        token_type::BYTE => attr::BYTE,
        _ => attr::UNDEFINED,
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Tokenizer, TokenizerError, VocabSpec};

    fn spec(model: &str, tokens: &[&str]) -> VocabSpec {
        VocabSpec {
            model: model.into(),
            tokens: tokens.iter().map(|s| s.to_string()).collect(),
            ..VocabSpec::default()
        }
    }

    fn twelve() -> Vec<String> {
        (0..12).map(|i| format!("t{i}")).collect()
    }

    #[test]
    fn sentencepiece_defaults_follow_llama_cpp() {
        let t = Tokenizer::new(spec("llama", &["<unk>", "<s>", "</s>", "a"])).unwrap();
        let s = t.special_tokens();
        assert_eq!((s.unk, s.bos, s.eos), (Some(0), Some(1), Some(2)));
        assert!(t.adds_bos() && !t.adds_eos());
        assert_eq!(t.end_of_generation_tokens(), [2]);
    }

    #[test]
    fn bpe_defaults_follow_llama_cpp() {
        // BOS and EOS default to id 11, when the vocabulary is that large.
        let mut small = spec("gpt2", &["a", "b"]);
        small.pre = Some("gpt2".into());
        let s = Tokenizer::new(small).unwrap().special_tokens();
        assert_eq!((s.bos, s.eos), (None, None));
        let mut big = VocabSpec {
            tokens: twelve().into(),
            ..spec("gpt2", &[])
        };
        let t = Tokenizer::new(big.clone()).unwrap();
        assert_eq!((t.special_tokens().bos, t.adds_bos()), (Some(11), false));
        // Llama 3 vocabularies add BOS unless told otherwise; the metadata wins.
        big.pre = Some("llama-bpe".into());
        assert!(Tokenizer::new(big.clone()).unwrap().adds_bos());
        big.add_bos = Some(false);
        assert!(!Tokenizer::new(big).unwrap().adds_bos());
    }

    #[test]
    fn metadata_ids_outside_the_vocabulary_are_ignored() {
        let mut s = spec("llama", &["<unk>", "<s>", "</s>"]);
        s.bos_id = Some(7);
        s.eos_id = Some(0);
        let t = Tokenizer::new(s).unwrap();
        assert_eq!(t.special_tokens().bos, Some(1));
        assert_eq!(t.special_tokens().eos, Some(0));
    }

    #[test]
    fn end_tokens_found_by_text_become_control_tokens() {
        let mut s = spec("gpt2", &["<|im_start|>", "<|im_end|>", "x"]);
        s.token_types = Some(vec![3, 1, 1]);
        let t = Tokenizer::new(s).unwrap();
        assert_eq!(t.special_tokens().eot, Some(1));
        assert!(t.is_end_of_generation(1));
        // As a control token it is not rendered unless asked.
        assert_eq!(t.token_bytes(1, false).unwrap(), b"");
        assert_eq!(t.token_bytes(1, true).unwrap(), b"<|im_end|>");
    }

    #[test]
    fn malformed_vocabularies_are_refused() {
        let err = Tokenizer::new(spec("llama", &[])).unwrap_err();
        assert!(matches!(err, TokenizerError::EmptyVocabulary), "{err}");
        let err = Tokenizer::new(spec("llama", &["a", "b", "a"])).unwrap_err();
        assert!(
            matches!(&err, TokenizerError::DuplicateToken { text, first: 0, second: 2 } if text == "a"),
            "{err}"
        );
        let mut short = spec("llama", &["a", "b"]);
        short.scores = Some(vec![0.0]);
        let err = Tokenizer::new(short).unwrap_err();
        assert!(
            matches!(
                err,
                TokenizerError::ArrayTooShort {
                    len: 1,
                    n_tokens: 2,
                    ..
                }
            ),
            "{err}"
        );
        let err = Tokenizer::new(spec("bert", &["a"])).unwrap_err();
        assert!(
            matches!(&err, TokenizerError::UnsupportedModel { model } if model == "bert"),
            "{err}"
        );
    }

    #[test]
    fn empty_texts_get_a_placeholder_and_missing_bos_is_an_error() {
        let mut s = spec("gpt2", &["", "a"]);
        s.add_bos = Some(true);
        let t = Tokenizer::new(s).unwrap();
        assert_eq!(t.token_text(0).unwrap(), "[EMPTY_0]");
        let err = t
            .encode("a", super::super::EncodeOptions::PROMPT)
            .unwrap_err();
        assert!(
            matches!(err, TokenizerError::MissingSpecialToken { which: "bos" }),
            "{err}"
        );
        let err = t.token_text(2).unwrap_err();
        assert!(
            matches!(err, TokenizerError::TokenOutOfRange { id: 2, n_tokens: 2 }),
            "{err}"
        );
    }
}
