//! The tokenizer's errors.

use gguf_format::GgufError;

/// Why a tokenizer could not be built, or could not encode or decode.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tokenizer key is missing from the metadata or has the wrong type.
    #[error("tokenizer metadata: {0}")]
    Metadata(#[from] GgufError),
    /// `tokenizer.ggml.model` names a tokenizer we do not implement.
    #[error("unsupported tokenizer model {model:?} (supported: \"gpt2\", \"llama\")")]
    UnsupportedModel { model: String },
    /// `tokenizer.ggml.pre` names a pre-tokenizer we do not implement.
    #[error("unsupported pre-tokenizer {pre:?} (supported: {supported})")]
    UnsupportedPreTokenizer {
        pre: String,
        supported: &'static str,
    },
    /// The vocabulary has no tokens.
    #[error("the vocabulary is empty")]
    EmptyVocabulary,
    /// More tokens than a `u32` id can number.
    #[error("the vocabulary has {n_tokens} tokens, more than token ids can address")]
    TooManyTokens { n_tokens: usize },
    /// Token texts too long in all for the 32-bit offsets the tokenizer keeps.
    #[error("the vocabulary's texts take {bytes} bytes, more than 4 GiB")]
    VocabularyTooLarge { bytes: usize },
    /// A per-token array is shorter than the vocabulary.
    #[error("{key} has {len} entries but the vocabulary has {n_tokens} tokens")]
    ArrayTooShort {
        key: &'static str,
        len: usize,
        n_tokens: usize,
    },
    /// Two tokens share one text, so text cannot map back to one id.
    #[error("tokens {first} and {second} have the same text {text:?}")]
    DuplicateToken {
        text: String,
        first: u32,
        second: u32,
    },
    /// The model asks for a BOS or EOS token that it does not define.
    #[error("the model adds a {which} token but defines none")]
    MissingSpecialToken { which: &'static str },
    /// SentencePiece byte fallback needs `<0xXX>` for a byte the vocabulary lacks.
    #[error("no token for byte {byte:#04x}: the vocabulary has no byte fallback for it")]
    MissingByteToken { byte: u8 },
    /// A piece of text too long to tokenize in one go.
    #[error("text of {len} bytes is too long to tokenize (at most {max})")]
    TextTooLong { len: usize, max: usize },
    /// A token id at or past the vocabulary size.
    #[error("token id {id} is out of range: the vocabulary has {n_tokens} tokens")]
    TokenOutOfRange { id: u32, n_tokens: usize },
}
