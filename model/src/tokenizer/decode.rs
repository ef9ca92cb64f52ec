//! Token ids back to bytes and text, as llama.cpp's `llama_token_to_piece` and
//! `llama_detokenize` give them.

use super::spm::SPACE_MARK;
use super::unicode::ByteAlphabet;
use super::vocab::{attr, Vocab, VocabKind};
use super::{TokenId, Tokenizer, TokenizerError};

/// How [`Tokenizer::decode`] treats special tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Drop a leading BOS and a trailing EOS where the model adds them.
    pub remove_special: bool,
    /// Render control tokens as their text (`<|im_end|>`); otherwise they give nothing.
    pub render_special: bool,
}

impl DecodeOptions {
    /// Generated text as a user sees it: control tokens give nothing.
    pub const TEXT: DecodeOptions = DecodeOptions {
        remove_special: false,
        render_special: false,
    };
    /// Every token rendered, nothing dropped.
    pub const VERBATIM: DecodeOptions = DecodeOptions {
        remove_special: false,
        render_special: true,
    };
}

/// The bytes of every token (control tokens rendered), in one buffer.
pub(super) struct Pieces {
    bytes: Vec<u8>,
    /// Token `i` is `bytes[offsets[i]..offsets[i + 1]]`. No token's bytes are longer than
    /// its text, and the vocabulary checked that its texts fit in `u32` offsets.
    offsets: Vec<u32>,
}

impl Pieces {
    /// `alphabet` is the byte alphabet of byte-level BPE; `None` for SentencePiece.
    pub fn new(vocab: &Vocab, alphabet: Option<&ByteAlphabet>) -> Pieces {
        let mut bytes = Vec::with_capacity(vocab.texts.text_len());
        let mut offsets = Vec::with_capacity(vocab.len() + 1);
        offsets.push(0);
        for (id, text) in vocab.texts.iter().enumerate() {
            let a = vocab.attrs[id];
            if a & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
                bytes.extend_from_slice(text.as_bytes());
            } else if a & attr::NORMAL != 0 {
                match (vocab.kind, alphabet) {
                    (VocabKind::BytePairEncoding, Some(alphabet)) => {
                        for c in text.chars() {
                            match alphabet.byte_of(c) {
                                Some(b) => bytes.push(b),
                                // Not in the alphabet: a malformed vocabulary. Keep the text.
                                None => {
                                    bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes())
                                }
                            }
                        }
                    }
                    _ => push_unescaped(&mut bytes, text.as_bytes()),
                }
            } else if a & attr::BYTE != 0 {
                bytes.push(byte_of_byte_token(text));
            }
            // Unused and undefined tokens give nothing.
            offsets.push(bytes.len() as u32);
        }
        bytes.shrink_to_fit();
        Pieces { bytes, offsets }
    }

    fn get(&self, id: TokenId) -> &[u8] {
        let i = id as usize;
        &self.bytes[self.offsets[i] as usize..self.offsets[i + 1] as usize]
    }
}

/// Appends SentencePiece text with each visible space (U+2581) turned back into a space.
fn push_unescaped(out: &mut Vec<u8>, text: &[u8]) {
    let mut mark = [0; 3];
    SPACE_MARK.encode_utf8(&mut mark);
    let mut copied = 0;
    let mut i = 0;
    while i + mark.len() <= text.len() {
        if text[i..i + mark.len()] == mark {
            out.extend_from_slice(&text[copied..i]);
            out.push(b' ');
            i += mark.len();
            copied = i;
        } else {
            i += 1;
        }
    }
    out.extend_from_slice(&text[copied..]);
}

/// `<0xXX>` → the byte; llama.cpp reads the two hex digits at offset 3 and takes 0 when
/// they do not parse.
fn byte_of_byte_token(text: &str) -> u8 {
    text.get(3..5)
        .and_then(|hex| u8::from_str_radix(hex, 16).ok())
        .unwrap_or(0)
}

impl Tokenizer {
    /// The bytes token `id` stands for. Control and unknown tokens give their text when
    /// `render_special`, nothing otherwise. A token may hold part of a UTF-8 character.
    pub fn token_bytes(&self, id: TokenId, render_special: bool) -> Result<&[u8], TokenizerError> {
        self.check(id)?;
        if !render_special && self.vocab.attr(id) & (attr::UNKNOWN | attr::CONTROL) != 0 {
            return Ok(&[]);
        }
        Ok(self.pieces.get(id))
    }

    /// The bytes of a whole sequence, with llama.cpp's clean-ups: the leading space
    /// SentencePiece adds is removed, and for BPE vocabularies that ask for it, spaces
    /// before `? ! . ,` and in contractions are undone.
    pub fn decode_bytes(
        &self,
        ids: &[TokenId],
        options: DecodeOptions,
    ) -> Result<Vec<u8>, TokenizerError> {
        let mut ids = ids;
        let mut remove_space = self.vocab.add_space_prefix;
        if options.remove_special && self.vocab.add_bos {
            if let (Some(&first), Some(bos)) = (ids.first(), self.vocab.special.bos) {
                if first == bos {
                    // llama.cpp keeps the leading space once a BOS has been dropped.
                    remove_space = false;
                    ids = &ids[1..];
                }
            }
        }
        if options.remove_special && self.vocab.add_eos {
            if let (Some(&last), Some(eos)) = (ids.last(), self.vocab.special.eos) {
                if last == eos {
                    ids = &ids[..ids.len() - 1];
                }
            }
        }
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let mut piece = self.token_bytes(id, options.render_special)?;
            if remove_space {
                piece = piece.strip_prefix(b" ").unwrap_or(piece);
            }
            remove_space = false;
            out.extend_from_slice(piece);
        }
        if self.clean_spaces {
            clean_spaces(&mut out);
        }
        Ok(out)
    }

    /// [`Tokenizer::decode_bytes`] as text; bytes that are not valid UTF-8 become U+FFFD.
    pub fn decode(
        &self,
        ids: &[TokenId],
        options: DecodeOptions,
    ) -> Result<String, TokenizerError> {
        let bytes = self.decode_bytes(ids, options)?;
        Ok(match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }
}

/// llama.cpp's `clean_spaces`, in its three passes.
fn clean_spaces(text: &mut Vec<u8>) {
    // " ?", " !", " .", " ," lose the space.
    remove_spaces_before(text, |rest| {
        matches!(rest.first(), Some(b'?' | b'!' | b'.' | b','))
    });
    // " ' " loses both spaces. The second space no longer counts as the space before
    // what follows (llama.cpp overwrites it in place).
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    let mut prev_erased = false;
    while i < text.len() {
        let x = text[i];
        let prev_is_space = i > 0 && text[i - 1] == b' ' && !prev_erased;
        prev_erased = false;
        if x == b'\'' && prev_is_space && i + 1 < text.len() && text[i + 1] == b' ' {
            out.pop();
            out.push(x);
            i += 2;
            prev_erased = true;
            continue;
        }
        out.push(x);
        i += 1;
    }
    *text = out;
    // " 's", " 'm", " 're", " 've" lose the space.
    remove_spaces_before(text, |rest| {
        rest.len() >= 2
            && rest[0] == b'\''
            && (matches!(rest[1], b's' | b'm')
                || (rest.len() >= 3 && matches!((rest[1], rest[2]), (b'r', b'e') | (b'v', b'e'))))
    });
}

/// Drops each space (not the first byte) whose following bytes satisfy `drop_before`.
fn remove_spaces_before(text: &mut Vec<u8>, drop_before: impl Fn(&[u8]) -> bool) {
    let mut out = Vec::with_capacity(text.len());
    for i in 0..text.len() {
        if i > 0 && text[i - 1] == b' ' && drop_before(&text[i..]) {
            out.pop();
        }
        out.push(text[i]);
    }
    *text = out;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cleaned(s: &str) -> String {
        let mut v = s.as_bytes().to_vec();
        clean_spaces(&mut v);
        String::from_utf8(v).unwrap()
    }

    #[test]
    fn clean_spaces_matches_llama_cpp() {
        assert_eq!(cleaned("Hello , world !"), "Hello, world!");
        assert_eq!(cleaned("a ' b"), "a'b");
        assert_eq!(cleaned("a ' ' b"), "a'' b");
        assert_eq!(
            cleaned("it 's we 're I 'm they 've"),
            "it's we're I'm they've"
        );
        // " 't", " 'd" and " 'll" keep their space.
        assert_eq!(cleaned("don 't I 'd we 'll"), "don 't I 'd we 'll");
        assert_eq!(cleaned(" ."), ".");
        assert_eq!(cleaned(""), "");
    }

    #[test]
    fn visible_spaces_become_spaces() {
        let unescaped = |s: &str| {
            let mut out = Vec::new();
            push_unescaped(&mut out, s.as_bytes());
            String::from_utf8(out).unwrap()
        };
        assert_eq!(unescaped("▁the"), " the");
        assert_eq!(unescaped("a▁▁b▁"), "a  b ");
        assert_eq!(unescaped("▁"), " ");
        assert_eq!(unescaped("é─▂x"), "é─▂x");
        assert_eq!(unescaped(""), "");
    }

    #[test]
    fn byte_tokens_parse_like_llama_cpp() {
        assert_eq!(byte_of_byte_token("<0x0A>"), b'\n');
        assert_eq!(byte_of_byte_token("<0xff>"), 0xFF);
        assert_eq!(byte_of_byte_token("<0xZZ>"), 0);
        assert_eq!(byte_of_byte_token("x"), 0);
    }
}
