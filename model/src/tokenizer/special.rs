//! Finding special tokens written out in input text (`<|im_start|>`, `<start_of_turn>`,
//! Gemma's runs of spaces) before the rest of the text is tokenized.
//!
//! llama.cpp takes the special tokens longest first and, for each, cuts every remaining
//! stretch of plain text at its leftmost non-overlapping occurrences. We find all
//! occurrences of all special tokens in one Aho-Corasick pass, then claim them in the same
//! order: by token (longest first, lower id first among equal lengths), then left to
//! right, skipping any that overlaps text already claimed. That gives the same cuts.

use aho_corasick::AhoCorasick;

use super::vocab::{attr, Vocab};
use super::TokenId;

/// A piece of input: plain text to tokenize, or a special token found in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fragment<'a> {
    Text(&'a str),
    Token(TokenId),
}

pub(super) struct SpecialMatcher {
    /// Pattern `i` of the automaton is token `order[i]`; patterns are in claiming order.
    order: Vec<TokenId>,
    /// Whether pattern `i` is also matched when special tokens are not parsed
    /// (user-defined tokens that are not control or unknown).
    always: Vec<bool>,
    /// Per pattern: the white space after a match is dropped ([`attr::RSTRIP`]).
    rstrip: Vec<bool>,
    automaton: Option<AhoCorasick>,
}

impl SpecialMatcher {
    pub fn new(vocab: &Vocab) -> SpecialMatcher {
        let mut order: Vec<TokenId> = (0..vocab.len() as TokenId)
            .filter(|&id| vocab.is_special_text(id))
            .collect();
        // Stable: among equal lengths the lower id is claimed first.
        order.sort_by_key(|&id| std::cmp::Reverse(vocab.texts[id as usize].len()));
        let always = order
            .iter()
            .map(|&id| vocab.attr(id) & (attr::CONTROL | attr::UNKNOWN) == 0)
            .collect();
        let rstrip = order
            .iter()
            .map(|&id| vocab.attr(id) & attr::RSTRIP != 0)
            .collect();
        let automaton = if order.is_empty() {
            None
        } else {
            // Building can only fail past aho-corasick's size limits; without the
            // automaton, special tokens in text are then tokenized as plain text.
            AhoCorasick::new(order.iter().map(|&id| &vocab.texts[id as usize])).ok()
        };
        SpecialMatcher {
            order,
            always,
            rstrip,
            automaton,
        }
    }

    /// Cuts `text` into plain text and special tokens. Control and unknown tokens are
    /// recognised only when `parse_special`; user-defined ones always are.
    pub fn split<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        if text.is_empty() {
            return Vec::new();
        }
        let Some(automaton) = &self.automaton else {
            return vec![Fragment::Text(text)];
        };
        let mut hits: Vec<(usize, usize, usize)> = automaton
            .find_overlapping_iter(text)
            .filter(|m| parse_special || self.always[m.pattern().as_usize()])
            .map(|m| (m.pattern().as_usize(), m.start(), m.end()))
            .collect();
        if hits.is_empty() {
            return vec![Fragment::Text(text)];
        }
        hits.sort_unstable();

        let mut claimed = vec![false; text.len()];
        let mut found: Vec<(usize, usize, usize)> = Vec::new();
        for (pattern, start, end) in hits {
            if claimed[start..end].iter().any(|&c| c) {
                continue;
            }
            claimed[start..end].fill(true);
            found.push((start, end, pattern));
        }
        found.sort_unstable();

        let mut fragments = Vec::with_capacity(found.len() * 2 + 1);
        let mut pos = 0;
        for (i, &(start, end, pattern)) in found.iter().enumerate() {
            if start > pos {
                fragments.push(Fragment::Text(&text[pos..start]));
            }
            fragments.push(Fragment::Token(self.order[pattern]));
            pos = end;
            if self.rstrip[pattern] {
                // C's `isspace`, up to the next match, as llama.cpp strips.
                let next = found.get(i + 1).map_or(text.len(), |f| f.0);
                let spaces = text.as_bytes()[end..next]
                    .iter()
                    .take_while(|&&b| matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r'))
                    .count();
                pos = end + spaces;
            }
        }
        if pos < text.len() {
            fragments.push(Fragment::Text(&text[pos..]));
        }
        fragments
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Tokenizer, VocabSpec};
    use super::*;

    fn matcher(tokens: &[(&str, i32)]) -> (Tokenizer, SpecialMatcher) {
        let t = Tokenizer::new(VocabSpec {
            model: "llama".into(),
            tokens: tokens.iter().map(|(s, _)| s.to_string()).collect(),
            token_types: Some(tokens.iter().map(|&(_, t)| t).collect()),
            ..VocabSpec::default()
        })
        .unwrap();
        let m = SpecialMatcher::new(&t.vocab);
        (t, m)
    }

    #[test]
    fn control_tokens_only_when_parsing_special() {
        let (_, m) = matcher(&[("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<x>", 4), ("a", 1)]);
        assert_eq!(
            m.split("a<s>b<x>", true),
            [
                Fragment::Text("a"),
                Fragment::Token(1),
                Fragment::Text("b"),
                Fragment::Token(3)
            ]
        );
        assert_eq!(
            m.split("a<s>b<x>", false),
            [Fragment::Text("a<s>b"), Fragment::Token(3)]
        );
        assert!(m.split("", true).is_empty());
    }

    #[test]
    fn longer_tokens_claim_first_then_leftmost() {
        let (_, m) = matcher(&[("<unk>", 2), ("<s>", 3), ("</s>", 3), ("  ", 4), ("   ", 4)]);
        // Five spaces: "   " takes the first three, "  " the rest.
        assert_eq!(
            m.split("     ", false),
            [Fragment::Token(4), Fragment::Token(3)]
        );
        // Four: "   " then a lone space left as text.
        assert_eq!(
            m.split("x    ", false),
            [Fragment::Text("x"), Fragment::Token(4), Fragment::Text(" ")]
        );
    }

    #[test]
    fn phi3_special_tokens_swallow_the_white_space_after_them() {
        // llama.cpp gives a Phi-3 file's special tokens (by its `general.name`) the
        // right-strip attribute, but not `<unk>`, `<s>` and `<|endoftext|>`.
        let tokens = [
            ("<unk>", 2),
            ("<s>", 3),
            ("</s>", 3),
            ("<|endoftext|>", 3),
            ("<|user|>", 4),
            ("<|end|>", 4),
            ("a", 1),
        ];
        let vocab = |name: &str| {
            Tokenizer::new(VocabSpec {
                model: "llama".into(),
                tokens: tokens.iter().map(|(s, _)| s.to_string()).collect(),
                token_types: Some(tokens.iter().map(|&(_, t)| t).collect()),
                model_name: Some(name.into()),
                ..VocabSpec::default()
            })
            .unwrap()
        };
        let text = "<|user|>\n \ta<|end|>\n<s> a</s>\r\n<|endoftext|> ";
        let phi3 = vocab("Phi3 Mini 4k Instruct");
        assert_eq!(
            SpecialMatcher::new(&phi3.vocab).split(text, true),
            [
                Fragment::Token(4),
                Fragment::Text("a"),
                Fragment::Token(5),
                Fragment::Token(1),
                Fragment::Text(" a"),
                Fragment::Token(2),
                Fragment::Token(3),
                Fragment::Text(" "),
            ]
        );
        let other = vocab("Llama");
        let fragments = SpecialMatcher::new(&other.vocab).split(text, true);
        assert_eq!(fragments[1], Fragment::Text("\n \ta"));
    }
}
