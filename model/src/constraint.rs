//! Output held to a format: a JSON schema, a Lark grammar or a regular expression,
//! enforced token by token with `llguidance`.
//!
//! [`Grammars`] is built once per loaded model: it turns the tokenizer's vocabulary into
//! the byte trie `llguidance` walks (each token as the bytes a user sees it decode to;
//! control tokens as special tokens, never text) and keeps the parser factory. Each
//! constrained request then compiles its [`ConstraintSpec`] into a [`Constraint`], which
//! at every step masks the logits (the tokens the grammar cannot take next are set to
//! -inf before sampling) and takes the sampled token. A spec that does not compile is an
//! error before anything runs, so a constrained request never gets unconstrained text.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::tokenizer::{EncodeOptions, TokenId, Tokenizer};

/// What a request asks its output to be.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstraintSpec {
    /// Any JSON object.
    JsonObject,
    /// JSON valid under this schema.
    JsonSchema(serde_json::Value),
    /// Text of this grammar, in the Lark syntax `llguidance` reads.
    Lark(String),
    /// Text matching this regular expression as a whole.
    Regex(String),
}

/// Why a constraint could not be built or followed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConstraintError {
    #[error("the vocabulary cannot be used for constraints: {0}")]
    Vocabulary(String),
    #[error("{0}")]
    Compile(String),
}

/// The vocabulary as `llguidance` sees it, and its parser factory: one per loaded model.
pub struct Grammars {
    factory: ParserFactory,
    /// The tokens that end generation, which the grammar's end stands for.
    eog: Vec<TokenId>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("n_vocab", &self.factory.tok_env().tok_trie().vocab_size())
            .field("eog", &self.eog)
            .finish_non_exhaustive()
    }
}

/// The bytes each token id stands for in the trie, for a vocabulary of `n_vocab` ids
/// (the model's logits; ids the tokenizer lacks have none). Text tokens give the bytes
/// the stream decoder hands out for them (byte-fallback `<0xNN>` its byte, byte-level
/// BPE's alphabet mapped back to bytes, SentencePiece's `▁` as a space); control and
/// unknown tokens give the special-token marker and their text, which no grammar's text
/// can match; unused tokens give nothing and are never allowed. (A token whose bytes
/// start with 0xFF, the byte-fallback token of that byte, reads as special too: that
/// byte is never part of UTF-8 text, so no grammar loses a token it could want.)
pub fn token_words(tokenizer: &Tokenizer, n_vocab: usize) -> Vec<Vec<u8>> {
    (0..n_vocab)
        .map(|id| {
            let id = id as TokenId;
            let text = tokenizer.token_bytes(id, false).unwrap_or_default();
            if !text.is_empty() {
                return text.to_vec();
            }
            let rendered = tokenizer.token_bytes(id, true).unwrap_or_default();
            if rendered.is_empty() {
                return Vec::new();
            }
            let mut word = Vec::with_capacity(rendered.len() + 1);
            word.push(TokTrie::SPECIAL_TOKEN_MARKER);
            word.extend_from_slice(rendered);
            word
        })
        .collect()
}

/// The tokenizer as `llguidance` asks for it: the trie, and text to tokens.
struct VocabEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Our tokenizer's tokens when they spell `s` exactly (SentencePiece adds a leading
    /// space, so it often does not), else the trie's greedy tokens.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        if let Ok(text) = std::str::from_utf8(s) {
            if let Ok(tokens) = self.tokenizer.encode(text, EncodeOptions::TEXT) {
                if self.trie.decode_raw(&tokens) == s {
                    return tokens;
                }
            }
        }
        self.trie.greedy_tokenize(s)
    }

    /// The fallback above is not the tokenizer's own tokenization.
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

impl Grammars {
    /// Builds the trie of `tokenizer`'s vocabulary for a model of `n_vocab` logits.
    pub fn new(tokenizer: Arc<Tokenizer>, n_vocab: usize) -> Result<Grammars, ConstraintError> {
        let n_vocab = n_vocab.max(tokenizer.n_tokens());
        let words = token_words(&tokenizer, n_vocab);
        let eog = tokenizer.end_of_generation_tokens().to_vec();
        let eos = eog
            .first()
            .copied()
            .or(tokenizer.special_tokens().eos)
            .unwrap_or(0);
        let size = u32::try_from(n_vocab)
            .map_err(|_| ConstraintError::Vocabulary(format!("{n_vocab} tokens")))?;
        let mut trie = TokTrie::from(&TokRxInfo::new(size, eos), &words);
        if !eog.is_empty() {
            trie = trie.with_eos_tokens(&eog);
        }
        let env: TokEnv = Arc::new(VocabEnv { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| ConstraintError::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory, eog })
    }

    /// The trie's bytes of token `id` (the special-token marker first for control
    /// tokens).
    pub fn token_bytes(&self, id: TokenId) -> &[u8] {
        self.factory.tok_env().tok_trie().token(id)
    }

    /// Compiles `spec`, or says why it does not compile.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Constraint, ConstraintError> {
        let grammar = match spec {
            ConstraintSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            ConstraintSpec::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(ConstraintError::Compile(format!(
                        "a JSON schema is an object, got {schema}"
                    )));
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            ConstraintSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
            ConstraintSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| ConstraintError::Compile(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::Compile(e));
        }
        Ok(Constraint {
            matcher,
            eog: self.eog.clone(),
        })
    }
}

/// `schema` producing JSON without optional whitespace (`{"a":1}`), as the API's JSON
/// modes give it, unless the schema itself says how (`x-guidance`).
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(map) = schema.as_object_mut() {
        map.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// One request's grammar and where its output stands in it.
pub struct Constraint {
    matcher: Matcher,
    eog: Vec<TokenId>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// The tokens of a vocabulary of `n_vocab` ids the grammar can take next. Where the
    /// grammar may end, every end-of-generation token is allowed; where it may not, none
    /// is. An error when the grammar is in a state it cannot continue from.
    pub fn next_mask(&mut self, n_vocab: usize) -> Result<TokenMask, String> {
        let mask = self.matcher.compute_mask().map_err(|e| e.to_string())?;
        let ends = self.eog.iter().any(|&t| mask.is_allowed(t));
        let mut words = vec![0u32; n_vocab.div_ceil(32)];
        let known = mask.as_slice();
        let whole = (mask.len() / 32).min(n_vocab / 32);
        words[..whole].copy_from_slice(&known[..whole]);
        for id in whole * 32..n_vocab.min(mask.len()) {
            if mask.is_allowed(id as TokenId) {
                words[id / 32] |= 1 << (id % 32);
            }
        }
        let mut mask = TokenMask { words, n_vocab };
        for &t in &self.eog {
            mask.set(t, ends);
        }
        Ok(mask)
    }

    /// Sets to -inf the logit of every token the grammar cannot take next (see
    /// [`Constraint::next_mask`]).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        self.next_mask(logits.len())?.apply(logits);
        Ok(())
    }

    /// Takes `token` as the output's next. Returns true when the grammar is complete:
    /// it accepts the output and allows nothing more.
    pub fn commit(&mut self, token: TokenId) -> Result<bool, String> {
        self.matcher
            .consume_token(token)
            .map_err(|e| format!("the constraint refused token {token}: {e}"))?;
        Ok(self.matcher.is_stopped())
    }

    /// Whether the output so far is a whole text of the grammar.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

/// The tokens a grammar allows next, a bit per token id (bit `id % 32` of word
/// `id / 32`), over the model's vocabulary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    n_vocab: usize,
}

impl TokenMask {
    /// The mask over `n_vocab` ids that allows every id in `allowed` within it.
    pub fn from_tokens(n_vocab: usize, allowed: impl IntoIterator<Item = TokenId>) -> TokenMask {
        let mut mask = TokenMask {
            words: vec![0; n_vocab.div_ceil(32)],
            n_vocab,
        };
        for t in allowed {
            mask.set(t, true);
        }
        mask
    }

    fn set(&mut self, token: TokenId, allowed: bool) {
        let id = token as usize;
        if id < self.n_vocab {
            let bit = 1u32 << (id % 32);
            if allowed {
                self.words[id / 32] |= bit;
            } else {
                self.words[id / 32] &= !bit;
            }
        }
    }

    /// The ids it is over.
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// Its bits, `n_vocab.div_ceil(32)` words; the bits past `n_vocab` are clear.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// Whether it allows `token`.
    pub fn allows(&self, token: TokenId) -> bool {
        let id = token as usize;
        id < self.n_vocab && self.words[id / 32] >> (id % 32) & 1 == 1
    }

    /// Sets to -inf each logit whose token it does not allow (every one past its ids).
    pub fn apply(&self, logits: &mut [f32]) {
        for (chunk, &word) in logits.chunks_mut(32).zip(&self.words) {
            if word == u32::MAX {
                continue;
            }
            for (bit, logit) in chunk.iter_mut().enumerate() {
                if word >> bit & 1 == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        let covered = (self.words.len() * 32).min(logits.len());
        logits[covered..].fill(f32::NEG_INFINITY);
    }
}

#[cfg(test)]
#[path = "constraint_tests.rs"]
mod tests;
