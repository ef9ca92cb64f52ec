//! SentencePiece (`tokenizer.ggml.model = "llama"`): spaces become `▁`, then adjacent
//! pieces merge while their union is a token, highest score first; characters that end up
//! in no token fall back to `<0xXX>` byte tokens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::vocab::Vocab;
use super::{TokenId, TokenizerError};

/// SentencePiece's visible space, U+2581.
pub(super) const SPACE_MARK: char = '\u{2581}';

pub(super) struct SpmModel {
    /// `<0xXX>` (or the single byte's own text) for every byte, where the vocabulary has it.
    byte_tokens: [Option<TokenId>; 256],
}

/// No neighbour.
const NONE: u32 = u32::MAX;

/// A run of the text's bytes, linked to its neighbours; `len == 0` once merged away.
/// Fields are `u32` to keep the working set of long prompts small.
#[derive(Clone, Copy)]
struct Symbol {
    start: u32,
    len: u32,
    prev: u32,
    next: u32,
}

/// A candidate merge of `left` with its neighbour into a token of `score`.
struct Candidate {
    score: f32,
    left: u32,
    size: u32,
}

impl Ord for Candidate {
    // The heap pops the highest score first, and the leftmost among equal scores.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

impl SpmModel {
    pub fn new(vocab: &Vocab) -> SpmModel {
        let mut byte_tokens = [None; 256];
        for (byte, slot) in byte_tokens.iter_mut().enumerate() {
            let byte = byte as u8;
            *slot = vocab.id(&format!("<0x{byte:02X}>")).or_else(|| {
                byte.is_ascii()
                    .then(|| vocab.id(char::from(byte).encode_utf8(&mut [0; 4])))
                    .flatten()
            });
        }
        SpmModel { byte_tokens }
    }

    /// Tokenizes text that holds no special token; `prefix_space` adds the leading space
    /// SentencePiece models expect at the start of a text.
    pub fn encode(
        &self,
        vocab: &Vocab,
        text: &str,
        prefix_space: bool,
        out: &mut Vec<TokenId>,
    ) -> Result<(), TokenizerError> {
        let mut escaped = String::with_capacity(text.len() + 3);
        if prefix_space {
            escaped.push(SPACE_MARK);
        }
        for c in text.chars() {
            match c {
                ' ' => escaped.push(SPACE_MARK),
                c => escaped.push(c),
            }
        }
        self.encode_escaped(vocab, &escaped, out)
    }

    fn encode_escaped(
        &self,
        vocab: &Vocab,
        text: &str,
        out: &mut Vec<TokenId>,
    ) -> Result<(), TokenizerError> {
        if u32::try_from(text.len()).map_or(true, |len| len == NONE) {
            return Err(TokenizerError::TextTooLong {
                len: text.len(),
                max: NONE as usize - 1,
            });
        }
        // Offsets and counts below fit in u32: the text is shorter than u32::MAX bytes.
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (start, c) in text.char_indices() {
            let idx = symbols.len() as u32;
            symbols.push(Symbol {
                start: start as u32,
                len: c.len_utf8() as u32,
                prev: idx.wrapping_sub(1),
                next: idx + 1,
            });
        }
        if let Some(last) = symbols.last_mut() {
            last.next = NONE;
        }
        if let Some(first) = symbols.first_mut() {
            first.prev = NONE;
        }

        let mut queue = BinaryHeap::new();
        let push = |queue: &mut BinaryHeap<Candidate>, symbols: &[Symbol], left: u32| {
            let right = symbols[left as usize].next;
            if right == NONE {
                return;
            }
            let start = symbols[left as usize].start as usize;
            let size = symbols[left as usize].len + symbols[right as usize].len;
            if let Some(id) = vocab.id(&text[start..start + size as usize]) {
                queue.push(Candidate {
                    score: vocab.scores[id as usize],
                    left,
                    size,
                });
            }
        };
        for left in 0..symbols.len() as u32 {
            push(&mut queue, &symbols, left);
        }
        while let Some(Candidate { left, size, .. }) = queue.pop() {
            let l = left as usize;
            let right = symbols[l].next;
            if right == NONE {
                continue;
            }
            let r = right as usize;
            // Stale when either side has changed since the candidate was queued.
            if symbols[l].len == 0 || symbols[l].len + symbols[r].len != size {
                continue;
            }
            symbols[l].len = size;
            symbols[r].len = 0;
            symbols[l].next = symbols[r].next;
            let next = symbols[r].next;
            if next != NONE {
                symbols[next as usize].prev = left;
            }
            let prev = symbols[l].prev;
            if prev != NONE {
                push(&mut queue, &symbols, prev);
            }
            push(&mut queue, &symbols, left);
        }

        // Every merged symbol is a token; a single character may not be, and then goes
        // out as its UTF-8 bytes.
        for symbol in symbols.iter().filter(|s| s.len > 0) {
            let start = symbol.start as usize;
            let piece = &text[start..start + symbol.len as usize];
            match vocab.id(piece) {
                Some(id) => out.push(id),
                None => {
                    for byte in piece.bytes() {
                        let id = self.byte_tokens[usize::from(byte)]
                            .ok_or(TokenizerError::MissingByteToken { byte })?;
                        out.push(id);
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{EncodeOptions, Tokenizer, VocabSpec};

    /// Bytes, then `extra` pieces with their scores.
    fn tiny(extra: &[(&str, f32)], add_space_prefix: bool) -> Tokenizer {
        let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
        let mut scores = vec![0.0; 3];
        let mut types = vec![2, 3, 3];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            scores.push(0.0);
            types.push(6);
        }
        for &(text, score) in extra {
            tokens.push(text.to_string());
            scores.push(score);
            types.push(1);
        }
        Tokenizer::new(VocabSpec {
            model: "llama".into(),
            tokens: tokens.into(),
            scores: Some(scores),
            token_types: Some(types),
            add_space_prefix: Some(add_space_prefix),
            ..VocabSpec::default()
        })
        .unwrap()
    }

    fn pieces(t: &Tokenizer, text: &str) -> Vec<String> {
        t.encode(text, EncodeOptions::TEXT)
            .unwrap()
            .into_iter()
            .map(|id| t.token_text(id).unwrap().to_owned())
            .collect()
    }

    #[test]
    fn highest_score_merges_first() {
        let vocab = [
            ("a", -1.0),
            ("b", -1.0),
            ("c", -1.0),
            ("ab", -5.0),
            ("bc", -2.0),
            ("abc", -9.0),
        ];
        let t = tiny(&vocab, false);
        // "bc" (-2) beats "ab" (-5); then "a"+"bc" = "abc" is a token.
        assert_eq!(pieces(&t, "abc"), ["abc"]);
        let t = tiny(&vocab[..5], false);
        assert_eq!(pieces(&t, "abc"), ["a", "bc"]);
    }

    #[test]
    fn spaces_become_marks_and_the_prefix_is_optional() {
        let vocab = [
            ("▁", -1.0),
            ("h", -1.0),
            ("i", -1.0),
            ("▁h", -2.0),
            ("▁hi", -3.0),
        ];
        let with_prefix = tiny(&vocab, true);
        assert_eq!(pieces(&with_prefix, "hi hi"), ["▁hi", "▁hi"]);
        let without = tiny(&vocab, false);
        assert_eq!(pieces(&without, "hi hi"), ["h", "i", "▁hi"]);
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes() {
        let t = tiny(&[("a", -1.0)], false);
        assert_eq!(pieces(&t, "aé"), ["a", "<0xC3>", "<0xA9>"]);
    }

    #[test]
    fn missing_byte_tokens_are_an_error() {
        let t = Tokenizer::new(VocabSpec {
            model: "llama".into(),
            tokens: ["<unk>", "<s>", "</s>", "a"].iter().collect(),
            add_space_prefix: Some(false),
            ..VocabSpec::default()
        })
        .unwrap();
        let err = t.encode("ab", EncodeOptions::TEXT).unwrap_err();
        assert!(
            matches!(err, super::TokenizerError::MissingByteToken { byte: b'b' }),
            "{err}"
        );
    }
}
