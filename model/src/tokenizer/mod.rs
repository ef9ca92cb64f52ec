//! Text ↔ token ids, built from a GGUF file's `tokenizer.ggml.*` metadata, giving the ids
//! llama.cpp gives.
//!
//! Two vocabulary kinds are supported: byte-level BPE (`gpt2`, with the pre-tokenizers of
//! [`pretokenize`]) and SentencePiece (`llama`, with scores, byte fallback and the
//! leading-space rule). Special tokens written in the text are recognised as llama.cpp
//! does; [`EncodeOptions`] says which. Decoding gives bytes per token, whole texts, or a
//! [`StreamDecoder`] that yields valid UTF-8 as tokens arrive.
//!
//! This is our own implementation rather than the `tokenizers` crate: the target is
//! llama.cpp's ids, and llama.cpp differs from the Hugging Face pipelines in ways that
//! show in ids (SentencePiece merges by score rather than by merge list, hand-written
//! pre-tokenizer rules, its rules for which special tokens are matched in text).

mod bpe;
mod decode;
mod error;
mod index;
mod pretokenize;
mod spec;
mod special;
mod spm;
mod stream;
mod unicode;
mod vocab;

use gguf_format::Metadata;

use bpe::BpeModel;
use pretokenize::PreTokenizer;
use special::{Fragment, SpecialMatcher};
use spm::SpmModel;
use vocab::{Vocab, VocabKind};

pub use decode::DecodeOptions;
pub use error::TokenizerError;
pub use spec::{keys, token_type, VocabSpec};
pub use stream::StreamDecoder;
pub use vocab::SpecialTokens;

/// A token id: an index into the vocabulary.
pub type TokenId = u32;

/// How [`Tokenizer::encode`] treats special tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Add BOS (and EOS) where the model's metadata asks for them.
    pub add_special: bool,
    /// Recognise control tokens written in the text (`<|im_start|>`). User-defined tokens
    /// are recognised either way, as in llama.cpp.
    pub parse_special: bool,
}

impl EncodeOptions {
    /// A prompt: BOS/EOS as the metadata says, special tokens in the text recognised.
    /// This is what `llama-tokenize` does by default.
    pub const PROMPT: EncodeOptions = EncodeOptions {
        add_special: true,
        parse_special: true,
    };
    /// Plain text: nothing added, control tokens in the text tokenized as text.
    pub const TEXT: EncodeOptions = EncodeOptions {
        add_special: false,
        parse_special: false,
    };
}

enum Model {
    Bpe(BpeModel),
    Spm(SpmModel),
}

/// A tokenizer for one model's vocabulary.
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    special_matcher: SpecialMatcher,
    pieces: decode::Pieces,
    clean_spaces: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.vocab.kind)
            .field("n_tokens", &self.vocab.len())
            .field("special", &self.vocab.special)
            .finish_non_exhaustive()
    }
}

/// The `which` special token (`id`) when `wanted`; an error when wanted and the
/// vocabulary has none.
fn added_special(
    wanted: bool,
    id: Option<TokenId>,
    which: &'static str,
) -> Result<Option<TokenId>, TokenizerError> {
    match (wanted, id) {
        (false, _) => Ok(None),
        (true, Some(id)) => Ok(Some(id)),
        (true, None) => Err(TokenizerError::MissingSpecialToken { which }),
    }
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes.
    pub fn from_metadata(metadata: &Metadata) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::new(VocabSpec::from_metadata(metadata)?)
    }

    /// Builds a tokenizer from its description.
    pub fn new(mut spec: VocabSpec) -> Result<Tokenizer, TokenizerError> {
        let merges = std::mem::take(&mut spec.merges);
        let (vocab, model, clean_spaces) = match spec.model.as_str() {
            "gpt2" => {
                let pre = PreTokenizer::from_name(spec.pre.as_deref())?;
                let vocab =
                    Vocab::new(spec, VocabKind::BytePairEncoding, pre.adds_bos_by_default())?;
                let model = Model::Bpe(BpeModel::new(pre, &merges, &vocab));
                (vocab, model, pre.cleans_spaces())
            }
            "llama" => {
                let vocab = Vocab::new(spec, VocabKind::SentencePiece, false)?;
                let model = Model::Spm(SpmModel::new(&vocab));
                (vocab, model, false)
            }
            other => {
                return Err(TokenizerError::UnsupportedModel {
                    model: other.to_owned(),
                })
            }
        };
        let special_matcher = SpecialMatcher::new(&vocab);
        let alphabet = match &model {
            Model::Bpe(bpe) => Some(&bpe.alphabet),
            Model::Spm(_) => None,
        };
        let pieces = decode::Pieces::new(&vocab, alphabet);
        Ok(Tokenizer {
            vocab,
            model,
            special_matcher,
            pieces,
            clean_spaces,
        })
    }

    /// Turns `text` into token ids.
    pub fn encode(
        &self,
        text: &str,
        options: EncodeOptions,
    ) -> Result<Vec<TokenId>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        out.extend(added_special(
            options.add_special && self.vocab.add_bos,
            self.vocab.special.bos,
            "bos",
        )?);
        // SentencePiece adds its leading space to text at the start or after a special token.
        let mut after_special = true;
        for fragment in self.special_matcher.split(text, options.parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(piece) => {
                    match &self.model {
                        Model::Bpe(bpe) => bpe.encode(&self.vocab, piece, &mut out),
                        Model::Spm(spm) => {
                            let prefix = self.vocab.add_space_prefix && after_special;
                            spm.encode(&self.vocab, piece, prefix, &mut out)?
                        }
                    }
                    after_special = false;
                }
            }
        }
        out.extend(added_special(
            options.add_special && self.vocab.add_eos,
            self.vocab.special.eos,
            "eos",
        )?);
        Ok(out)
    }

    /// Number of tokens in the vocabulary.
    pub fn n_tokens(&self) -> usize {
        self.vocab.len()
    }

    /// The special token ids.
    pub fn special_tokens(&self) -> SpecialTokens {
        self.vocab.special
    }

    /// Whether encoding with `add_special` starts with BOS.
    pub fn adds_bos(&self) -> bool {
        self.vocab.add_bos
    }

    /// Whether encoding with `add_special` ends with EOS.
    pub fn adds_eos(&self) -> bool {
        self.vocab.add_eos
    }

    /// True for tokens that end generation (EOS, EOT, `<|im_end|>`, ...).
    pub fn is_end_of_generation(&self, id: TokenId) -> bool {
        self.vocab.eog.binary_search(&id).is_ok()
    }

    /// The tokens that end generation, sorted.
    pub fn end_of_generation_tokens(&self) -> &[TokenId] {
        &self.vocab.eog
    }

    /// The text of token `id` as stored in the vocabulary (`Ġ`/`▁` and all).
    pub fn token_text(&self, id: TokenId) -> Result<&str, TokenizerError> {
        self.check(id)?;
        Ok(&self.vocab.texts[id as usize])
    }

    /// The id of the token whose stored text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<TokenId> {
        self.vocab.id(text)
    }

    fn check(&self, id: TokenId) -> Result<(), TokenizerError> {
        if (id as usize) < self.vocab.len() {
            Ok(())
        } else {
            Err(TokenizerError::TokenOutOfRange {
                id,
                n_tokens: self.vocab.len(),
            })
        }
    }
}
