//! Pre-tokenizers of byte-level BPE: split text into words before merging.
//!
//! Each is a fixed sequence of splitting rules. A rule cuts every piece left by the rule
//! before it: the text it matches and the text between matches both become pieces. The
//! rules are written by hand, as llama.cpp writes them, instead of with a regex engine:
//! the Hugging Face patterns use look-ahead (`\s+(?!\S)`), which Rust's `regex` lacks, and
//! llama.cpp's hand-written rules differ from a regex in corner cases its ids reflect.

use std::ops::Range;

use super::unicode::{class_of, is_whitespace, CodepointClass, Flags};
use super::TokenizerError;

/// The pre-tokenizers named by `tokenizer.ggml.pre` that we implement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PreTokenizer {
    /// `gpt-2`/`gpt2`: GPT-2's pattern.
    Gpt2,
    /// `default` (or no name): punctuation runs, then GPT-2's pattern, then digit runs
    /// cut into threes.
    Default,
    /// `smollm`: every digit alone, then GPT-2's pattern.
    SmolLm,
    /// `llama3`/`llama-bpe`/`llama-v3`: Llama 3's pattern, numbers in groups of up to three.
    Llama3,
    /// `qwen2`: Llama 3's pattern with every digit alone.
    Qwen2,
}

pub(super) const SUPPORTED: &str =
    "\"default\", \"gpt2\", \"gpt-2\", \"smollm\", \"llama3\", \"llama-bpe\", \"llama-v3\", \"qwen2\"";

/// One splitting rule.
#[derive(Clone, Copy)]
enum Rule {
    Gpt2,
    Llama3 {
        max_digits: usize,
    },
    /// `[\p{P}$+<=>^~|]+`
    PunctuationRuns,
    /// `\p{N}`
    SingleDigits,
    /// `\p{N}+`
    DigitRuns,
    /// `[0-9][0-9][0-9]`
    AsciiDigitTriples,
}

impl PreTokenizer {
    pub fn from_name(name: Option<&str>) -> Result<PreTokenizer, TokenizerError> {
        Ok(match name.unwrap_or("default") {
            "default" => PreTokenizer::Default,
            "gpt2" | "gpt-2" => PreTokenizer::Gpt2,
            "smollm" => PreTokenizer::SmolLm,
            "llama3" | "llama-bpe" | "llama-v3" => PreTokenizer::Llama3,
            "qwen2" => PreTokenizer::Qwen2,
            other => {
                return Err(TokenizerError::UnsupportedPreTokenizer {
                    pre: other.to_owned(),
                    supported: SUPPORTED,
                })
            }
        })
    }

    /// Llama 3 vocabularies add BOS unless the metadata says otherwise.
    pub fn adds_bos_by_default(self) -> bool {
        self == PreTokenizer::Llama3
    }

    /// Llama 3 vocabularies emit a whole word as one token when it is in the vocabulary,
    /// without merging.
    pub fn ignores_merges(self) -> bool {
        self == PreTokenizer::Llama3
    }

    /// Undoes the spaces tokenizers add before punctuation when decoding
    /// (llama.cpp's `clean_spaces`).
    pub fn cleans_spaces(self) -> bool {
        !matches!(self, PreTokenizer::SmolLm | PreTokenizer::Qwen2)
    }

    fn rules(self) -> &'static [Rule] {
        match self {
            PreTokenizer::Gpt2 => &[Rule::Gpt2],
            PreTokenizer::Default => &[
                Rule::PunctuationRuns,
                Rule::Gpt2,
                Rule::DigitRuns,
                Rule::AsciiDigitTriples,
            ],
            PreTokenizer::SmolLm => &[Rule::SingleDigits, Rule::Gpt2],
            PreTokenizer::Llama3 => &[Rule::Llama3 { max_digits: 3 }],
            PreTokenizer::Qwen2 => &[Rule::Llama3 { max_digits: 1 }],
        }
    }

    /// Splits `text` into words, as byte ranges.
    pub fn split(self, text: &str) -> Vec<Range<usize>> {
        let cps: Vec<u32> = text.chars().map(|c| c as u32).collect();
        // One piece, the whole text.
        let mut pieces: Vec<Range<usize>> = std::iter::once(0..cps.len()).collect();
        for &rule in self.rules() {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for piece in pieces {
                let mut out = Splitter::new(&cps, piece.clone(), &mut next);
                match rule {
                    Rule::Gpt2 => out.gpt2(),
                    Rule::Llama3 { max_digits } => out.llama3(max_digits),
                    Rule::PunctuationRuns => out.class_runs(is_punctuation_like, usize::MAX),
                    Rule::SingleDigits => out.class_runs(is_number_like, 1),
                    Rule::DigitRuns => out.class_runs(is_number_like, usize::MAX),
                    Rule::AsciiDigitTriples => out.ascii_digit_triples(),
                }
            }
            pieces = next;
        }
        // Code point ranges to byte ranges.
        let mut byte_at = Vec::with_capacity(cps.len() + 1);
        byte_at.extend(text.char_indices().map(|(i, _)| i));
        byte_at.push(text.len());
        pieces
            .into_iter()
            .map(|r| byte_at[r.start]..byte_at[r.end])
            .collect()
    }
}

/// `\p{N}` as llama.cpp's regex fallback sees it: ASCII digits, and non-ASCII numbers
/// that are not white space.
fn is_number_like(cp: u32) -> bool {
    if cp < 0x80 {
        return (cp as u8).is_ascii_digit();
    }
    !is_whitespace(cp) && class_of(cp) == CodepointClass::Number
}

/// `[\p{P}$+<=>^~|]`: ASCII punctuation (and those eight ASCII symbols), and non-ASCII
/// punctuation that is not white space.
fn is_punctuation_like(cp: u32) -> bool {
    if cp < 0x80 {
        return b"!\"#%&'()*,-./:;?@[\\]_{}$+<=>^~|".contains(&(cp as u8));
    }
    !is_whitespace(cp) && class_of(cp) == CodepointClass::Punctuation
}

/// Cuts one piece `[start, end)` of `cps` into words appended to `out`.
struct Splitter<'a> {
    cps: &'a [u32],
    start: usize,
    end: usize,
    prev_end: usize,
    out: &'a mut Vec<Range<usize>>,
}

const OUTSIDE: u32 = u32::MAX;

impl<'a> Splitter<'a> {
    fn new(cps: &'a [u32], piece: Range<usize>, out: &'a mut Vec<Range<usize>>) -> Self {
        Splitter {
            cps,
            start: piece.start,
            end: piece.end,
            prev_end: piece.start,
            out,
        }
    }

    fn cp(&self, pos: usize) -> u32 {
        if (self.start..self.end).contains(&pos) {
            self.cps[pos]
        } else {
            OUTSIDE
        }
    }

    fn flags(&self, pos: usize) -> Flags {
        if (self.start..self.end).contains(&pos) {
            Flags::of(self.cps[pos])
        } else {
            Flags::OUTSIDE
        }
    }

    /// Ends a word at `end`; returns its length (0 adds nothing).
    fn cut(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push(self.prev_end..end);
        }
        self.prev_end = end;
        len
    }

    /// `'s|'t|'re|'ve|'m|'ll|'d`, ASCII case folded when `fold_case`: the length matched.
    fn contraction(&self, pos: usize, fold_case: bool) -> usize {
        if self.cp(pos) != u32::from(b'\'') || pos + 1 >= self.end {
            return 0;
        }
        let lower = |cp: u32| match char::from_u32(cp) {
            Some(c) if fold_case => c.to_ascii_lowercase(),
            Some(c) => c,
            None => '\0',
        };
        let next = lower(self.cp(pos + 1));
        if matches!(next, 's' | 't' | 'm' | 'd') {
            return 2;
        }
        if pos + 2 < self.end {
            let next2 = lower(self.cp(pos + 2));
            if matches!((next, next2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                return 3;
            }
        }
        0
    }

    /// Counts white space from `pos`; also returns one past the last `\r`/`\n` among it.
    fn whitespace_run(&self, pos: usize) -> (usize, Option<usize>) {
        let mut n = 0;
        let mut last_newline_end = None;
        while self.flags(pos + n).whitespace {
            if matches!(self.cp(pos + n), 0x0D | 0x0A) {
                last_newline_end = Some(pos + n + 1);
            }
            n += 1;
        }
        (n, last_newline_end)
    }

    /// The last alternatives of the patterns, `\s+(?!\S)|\s+|.`, at `pos` with `n`
    /// white-space code points: ends the word there and returns its end.
    fn whitespace_or_one(&mut self, pos: usize, n: usize) -> usize {
        let end = if n > 0 {
            self.trailing_whitespace(pos, n)
        } else {
            pos + 1
        };
        self.cut(end);
        end
    }

    /// `\s+(?!\S)|\s+` at `pos` with `n` white-space code points: the end of the match.
    fn trailing_whitespace(&self, pos: usize, n: usize) -> usize {
        if n > 1 && self.cp(pos + n) != OUTSIDE {
            // Leave the last space to start the next word.
            pos + n - 1
        } else {
            pos + n
        }
    }

    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    fn gpt2(&mut self) {
        let mut pos = self.start;
        while pos < self.end {
            let cp = self.cp(pos);
            let len = self.contraction(pos, false);
            if len > 0 {
                pos += self.cut(pos + len);
                continue;
            }
            let space = usize::from(cp == u32::from(b' '));
            let first = self.flags(pos + space);
            let same_kind: Option<fn(Flags) -> bool> = if first.letter {
                Some(|f| f.letter)
            } else if first.number {
                Some(|f| f.number)
            } else if first.is_other() {
                Some(Flags::is_other)
            } else {
                None
            };
            if let Some(same_kind) = same_kind {
                pos += space;
                while same_kind(self.flags(pos)) {
                    pos += 1;
                }
                self.cut(pos);
                continue;
            }
            let (n, _) = self.whitespace_run(pos);
            pos = self.whitespace_or_one(pos, n);
        }
    }

    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max}|
    ///  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    fn llama3(&mut self, max_digits: usize) {
        let mut pos = self.start;
        while pos < self.end {
            let cp = self.cp(pos);
            let flags = self.flags(pos);
            let len = self.contraction(pos, true);
            if len > 0 {
                pos += self.cut(pos + len);
                continue;
            }
            let is_newline = matches!(cp, 0x0D | 0x0A);
            if !(is_newline || flags.number) && (flags.letter || self.flags(pos + 1).letter) {
                pos += 1;
                while self.flags(pos).letter {
                    pos += 1;
                }
                self.cut(pos);
                continue;
            }
            if flags.number {
                let mut group_start = pos;
                while self.flags(pos).number {
                    pos += 1;
                    if pos - group_start >= max_digits {
                        self.cut(pos);
                        group_start = pos;
                    }
                }
                self.cut(pos);
                continue;
            }
            let space = usize::from(cp == u32::from(b' '));
            let first = if space == 1 {
                self.flags(pos + 1)
            } else {
                flags
            };
            // The first test is on `flags`, not `first`: a lone trailing space matches here.
            if !(first.whitespace || first.letter || first.number) && flags.inside {
                pos += space;
                while self.flags(pos).is_other() {
                    pos += 1;
                }
                while matches!(self.cp(pos), 0x0D | 0x0A) {
                    pos += 1;
                }
                self.cut(pos);
                continue;
            }
            let (n, last_newline_end) = self.whitespace_run(pos);
            if let Some(end) = last_newline_end {
                pos = end;
                self.cut(pos);
                continue;
            }
            pos = self.whitespace_or_one(pos, n);
        }
    }

    /// Leftmost runs of code points in the class, each at most `max_len` long: the runs
    /// and the text between them become words.
    fn class_runs(&mut self, in_class: fn(u32) -> bool, max_len: usize) {
        let mut pos = self.start;
        while pos < self.end {
            if !in_class(self.cps[pos]) {
                pos += 1;
                continue;
            }
            self.cut(pos);
            let run_start = pos;
            while pos < self.end && pos - run_start < max_len && in_class(self.cps[pos]) {
                pos += 1;
            }
            self.cut(pos);
        }
        self.cut(self.end);
    }

    /// Leftmost, non-overlapping runs of exactly three ASCII digits.
    fn ascii_digit_triples(&mut self) {
        let is_digit = |cp: u32| (0x30..=0x39).contains(&cp);
        let mut pos = self.start;
        while pos + 3 <= self.end {
            if self.cps[pos..pos + 3].iter().all(|&cp| is_digit(cp)) {
                self.cut(pos);
                pos += 3;
                self.cut(pos);
            } else {
                pos += 1;
            }
        }
        self.cut(self.end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: PreTokenizer, text: &str) -> Vec<&str> {
        pre.split(text).into_iter().map(|r| &text[r]).collect()
    }

    #[test]
    fn gpt2_pattern() {
        let w = words(PreTokenizer::Gpt2, "Hello, world!  It's 2024\n\n  ok ");
        assert_eq!(
            w,
            ["Hello", ",", " world", "!", " ", " It", "'s", " 2024", "\n\n ", " ok", " "]
        );
        assert_eq!(words(PreTokenizer::Gpt2, "a   b"), ["a", "  ", " b"]);
        assert_eq!(words(PreTokenizer::Gpt2, "x'S"), ["x", "'", "S"]);
        assert!(words(PreTokenizer::Gpt2, "").is_empty());
    }

    #[test]
    fn smollm_splits_every_digit() {
        assert_eq!(
            words(PreTokenizer::SmolLm, "a 123 ½"),
            ["a", " ", "1", "2", "3", " ", "½"]
        );
    }

    #[test]
    fn llama3_pattern() {
        assert_eq!(
            words(PreTokenizer::Llama3, "I'M 1234567 (ok)\n\n\tx  y"),
            ["I", "'M", " ", "123", "456", "7", " (", "ok", ")\n\n", "\tx", " ", " y"]
        );
        assert_eq!(words(PreTokenizer::Llama3, "a \n b"), ["a", " \n", " b"]);
        assert_eq!(words(PreTokenizer::Qwen2, "x12"), ["x", "1", "2"]);
    }

    #[test]
    fn default_pattern_cuts_punctuation_and_digit_triples() {
        assert_eq!(
            words(PreTokenizer::Default, "a+=12345..."),
            ["a", "+=", "123", "45", "..."]
        );
    }

    #[test]
    fn unknown_names_are_refused() {
        let err = PreTokenizer::from_name(Some("tekken")).unwrap_err();
        assert!(
            matches!(err, TokenizerError::UnsupportedPreTokenizer { ref pre, .. } if pre == "tekken")
        );
        assert_eq!(
            PreTokenizer::from_name(None).unwrap(),
            PreTokenizer::Default
        );
    }
}
