//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): pre-tokenize, map bytes to GPT-2's
//! printable alphabet, then merge adjacent symbols by merge rank.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use gguf_format::StringArray;

use super::index::FastMap;
use super::pretokenize::PreTokenizer;
use super::unicode::ByteAlphabet;
use super::vocab::Vocab;
use super::TokenId;

/// No token: a symbol whose text is not in the vocabulary.
const NO_TOKEN: TokenId = TokenId::MAX;

pub(super) struct BpeModel {
    pub pre: PreTokenizer,
    /// (left token, right token) → rank (lower merges first).
    ranks: FastMap<(TokenId, TokenId), u32>,
    /// `"left right"` → rank, for merges a side of which is no token. Real vocabularies
    /// have none; llama.cpp keys every merge by text and still applies these. Symbols
    /// never contain a raw space (the alphabet maps it to `Ġ`), so the key is unambiguous.
    text_ranks: FastMap<String, u32>,
    /// The token of each byte's alphabet character, or [`NO_TOKEN`] (boxed, so that
    /// the model stays about the size of SentencePiece's).
    byte_tokens: Box<[TokenId; 256]>,
    pub alphabet: ByteAlphabet,
}

/// A run of the word's bytes, linked to its neighbours, and the token whose text it is;
/// `len == 0` once merged away.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
    token: TokenId,
}

impl BpeModel {
    pub fn new(pre: PreTokenizer, merges: &StringArray, vocab: &Vocab) -> BpeModel {
        let mut ranks = FastMap::with_capacity_and_hasher(merges.len(), Default::default());
        let mut text_ranks = FastMap::default();
        for (rank, merge) in merges.iter().enumerate() {
            // Split at the first space after the first byte, as llama.cpp does; a merge
            // without one can never apply.
            let Some(pos) = merge.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                continue;
            };
            let (left, right) = (&merge[..pos], &merge[pos + 1..]);
            // The first of duplicate merges keeps its rank.
            match (vocab.id(left), vocab.id(right)) {
                (Some(left), Some(right)) => ranks.entry((left, right)).or_insert(rank as u32),
                _ => text_ranks.entry(merge.to_owned()).or_insert(rank as u32),
            };
        }
        let alphabet = ByteAlphabet::new();
        let mut byte_tokens = Box::new([NO_TOKEN; 256]);
        for (byte, token) in byte_tokens.iter_mut().enumerate() {
            let c = alphabet.char_of(byte as u8);
            *token = vocab.id(c.encode_utf8(&mut [0; 4])).unwrap_or(NO_TOKEN);
        }
        BpeModel {
            pre,
            ranks,
            text_ranks,
            byte_tokens,
            alphabet,
        }
    }

    /// Tokenizes text that holds no special token.
    pub fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<TokenId>) {
        let mut word = String::new();
        let mut key = String::new();
        for range in self.pre.split(text) {
            let bytes = text[range].as_bytes();
            word.clear();
            word.extend(bytes.iter().map(|&b| self.alphabet.char_of(b)));
            if self.pre.ignores_merges() {
                if let Some(id) = vocab.id(&word) {
                    out.push(id);
                    continue;
                }
            }
            self.encode_word(vocab, bytes, &word, &mut key, out);
        }
    }

    fn rank(&self, key: &mut String, word: &str, left: &Symbol, right: &Symbol) -> Option<u32> {
        if left.token != NO_TOKEN && right.token != NO_TOKEN {
            return self.ranks.get(&(left.token, right.token)).copied();
        }
        if self.text_ranks.is_empty() {
            return None;
        }
        key.clear();
        key.push_str(&word[left.start..left.start + left.len]);
        key.push(' ');
        key.push_str(&word[right.start..right.start + right.len]);
        self.text_ranks.get(key.as_str()).copied()
    }

    /// Merges the symbols of one pre-tokenized piece: `bytes`, whose alphabet characters
    /// make `word`, one character a byte.
    fn encode_word(
        &self,
        vocab: &Vocab,
        bytes: &[u8],
        word: &str,
        key: &mut String,
        out: &mut Vec<TokenId>,
    ) {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
        for ((start, c), &byte) in word.char_indices().zip(bytes) {
            let idx = symbols.len();
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: idx.checked_sub(1),
                next: Some(idx + 1),
                token: self.byte_tokens[usize::from(byte)],
            });
        }
        if let Some(last) = symbols.last_mut() {
            last.next = None;
        }

        // Candidate merges: (rank, left index, byte size); lowest rank, then leftmost, first.
        let mut queue = BinaryHeap::new();
        let mut push = |queue: &mut BinaryHeap<_>, symbols: &[Symbol], left: usize| {
            if let Some(right) = symbols[left].next {
                if let Some(rank) = self.rank(key, word, &symbols[left], &symbols[right]) {
                    let size = symbols[left].len + symbols[right].len;
                    queue.push(Reverse((rank, left, size)));
                }
            }
        };
        for left in 0..symbols.len() {
            push(&mut queue, &symbols, left);
        }
        while let Some(Reverse((_, left, size))) = queue.pop() {
            let Some(right) = symbols[left].next else {
                continue;
            };
            // Stale when either side has changed since the candidate was queued.
            if symbols[left].len == 0 || symbols[left].len + symbols[right].len != size {
                continue;
            }
            let start = symbols[left].start;
            symbols[left].token = vocab.id(&word[start..start + size]).unwrap_or(NO_TOKEN);
            symbols[left].len = size;
            symbols[right].len = 0;
            symbols[left].next = symbols[right].next;
            if let Some(next) = symbols[right].next {
                symbols[next].prev = Some(left);
            }
            if let Some(prev) = symbols[left].prev {
                push(&mut queue, &symbols, prev);
            }
            push(&mut queue, &symbols, left);
        }

        for symbol in symbols.iter().filter(|s| s.len > 0) {
            let text = &word[symbol.start..symbol.start + symbol.len];
            match symbol.token {
                // Only reachable when the vocabulary lacks part of the byte alphabet:
                // llama.cpp then keeps the ASCII bytes it finds and drops the rest.
                NO_TOKEN => out.extend(
                    text.bytes()
                        .filter(u8::is_ascii)
                        .filter_map(|b| vocab.id(char::from(b).encode_utf8(&mut [0; 4]))),
                ),
                id => out.push(id),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Tokenizer, VocabSpec};
    use super::*;

    /// A vocabulary of the full byte alphabet plus a few merged tokens.
    fn tiny(pre: &str, merges: &[&str], extra: &[&str]) -> Tokenizer {
        let alphabet = ByteAlphabet::new();
        let mut tokens: Vec<String> = (0..=255u8)
            .map(|b| alphabet.char_of(b).to_string())
            .collect();
        tokens.extend(extra.iter().map(|s| s.to_string()));
        Tokenizer::new(VocabSpec {
            model: "gpt2".into(),
            pre: Some(pre.into()),
            tokens: tokens.into(),
            merges: merges.iter().collect(),
            ..VocabSpec::default()
        })
        .unwrap()
    }

    fn pieces(t: &Tokenizer, text: &str) -> Vec<String> {
        t.encode(text, super::super::EncodeOptions::TEXT)
            .unwrap()
            .into_iter()
            .map(|id| t.token_text(id).unwrap().to_owned())
            .collect()
    }

    #[test]
    fn merges_apply_by_rank_not_position() {
        // "b c" outranks "a b": "abc" becomes a + bc, not ab + c.
        let t = tiny("gpt2", &["b c", "a b", "Ġ a"], &["bc", "ab", "Ġa"]);
        assert_eq!(pieces(&t, "abc"), ["a", "bc"]);
        assert_eq!(pieces(&t, "ab a"), ["ab", "Ġa"]);
    }

    #[test]
    fn equal_ranks_merge_leftmost_first() {
        let t = tiny("gpt2", &["a a", "aa aa"], &["aa", "aaaa"]);
        assert_eq!(pieces(&t, "aaaaa"), ["aaaa", "a"]);
    }

    #[test]
    fn bytes_outside_ascii_use_the_alphabet() {
        let t = tiny("gpt2", &["Ã ©"], &["Ã©"]);
        assert_eq!(pieces(&t, "é"), ["Ã©"]);
        assert_eq!(pieces(&t, "\n"), ["Ċ"]);
    }

    #[test]
    fn llama3_takes_whole_words_from_the_vocabulary() {
        // No merge leads to "xyz", but the word is in the vocabulary.
        let t = tiny("llama3", &[], &["xyz"]);
        assert_eq!(pieces(&t, "xyz"), ["xyz"]);
        let t = tiny("gpt2", &[], &["xyz"]);
        assert_eq!(pieces(&t, "xyz"), ["x", "y", "z"]);
    }
}
