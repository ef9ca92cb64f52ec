//! Decoding tokens one at a time into text that is always valid UTF-8, even when a
//! character's bytes arrive in several tokens.

use super::{TokenId, Tokenizer, TokenizerError};

/// Turns tokens into text as they are generated.
///
/// Each [`StreamDecoder::push`] returns the text that became complete: bytes of a
/// character still missing its last bytes wait for the next token. Bytes that can never
/// become valid UTF-8 come out as U+FFFD, one per invalid sequence, exactly as
/// [`String::from_utf8_lossy`] would render the whole output; so the concatenation of
/// everything pushed and [`StreamDecoder::finish`]ed equals [`Tokenizer::decode`] of the
/// same ids (for vocabularies that need no clean-up of spaces).
#[derive(Debug)]
pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    render_special: bool,
    pending: Vec<u8>,
}

impl<'t> StreamDecoder<'t> {
    /// A decoder that renders control tokens as their text when `render_special`.
    pub fn new(tokenizer: &'t Tokenizer, render_special: bool) -> StreamDecoder<'t> {
        StreamDecoder {
            tokenizer,
            render_special,
            pending: Vec::new(),
        }
    }

    /// Adds one token; returns the text completed by it (often empty mid-character).
    pub fn push(&mut self, id: TokenId) -> Result<String, TokenizerError> {
        let bytes = self.tokenizer.token_bytes(id, self.render_special)?;
        self.pending.extend_from_slice(bytes);
        Ok(self.take_complete())
    }

    /// Ends the stream: bytes of an unfinished character become U+FFFD.
    pub fn finish(mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&rest).into_owned()
    }

    /// True when bytes of an unfinished character are waiting.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        while start < self.pending.len() {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(text) => {
                    out.push_str(text);
                    start = self.pending.len();
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix was just checked.
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..start + valid])
                            .unwrap_or_default(),
                    );
                    start += valid;
                    match e.error_len() {
                        Some(invalid) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start += invalid;
                        }
                        // A character cut short at the end: wait for more bytes.
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}

impl Tokenizer {
    /// A [`StreamDecoder`] for this tokenizer.
    pub fn stream_decoder(&self, render_special: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, render_special)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{DecodeOptions, Tokenizer, VocabSpec};

    /// SentencePiece byte tokens only, so every byte sequence is encodable by id.
    fn bytes_only() -> Tokenizer {
        let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
        let mut types = vec![2, 3, 3];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
        }
        tokens.push("é".into());
        types.push(1);
        Tokenizer::new(VocabSpec {
            model: "llama".into(),
            tokens: tokens.into(),
            token_types: Some(types),
            add_space_prefix: Some(false),
            ..VocabSpec::default()
        })
        .unwrap()
    }

    fn byte(b: u8) -> u32 {
        3 + u32::from(b)
    }

    #[test]
    fn characters_split_across_tokens_wait_for_their_last_byte() {
        let t = bytes_only();
        let mut d = t.stream_decoder(false);
        // "€" is E2 82 AC.
        assert_eq!(d.push(byte(b'a')).unwrap(), "a");
        assert_eq!(d.push(byte(0xE2)).unwrap(), "");
        assert_eq!(d.push(byte(0x82)).unwrap(), "");
        assert!(d.has_pending());
        assert_eq!(d.push(byte(0xAC)).unwrap(), "€");
        assert_eq!(d.push(259).unwrap(), "é");
        assert!(!d.has_pending());
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters_like_lossy_decoding() {
        let t = bytes_only();
        let sequences: [&[u8]; 4] = [
            &[0xFF, b'a', 0xE2, 0x82, b'b'],
            &[0xE2, 0x82],
            &[0xF0, 0x9F, 0x98, 0x80, 0xC3],
            &[0xED, 0xA0, 0x80, b'x'],
        ];
        for seq in sequences {
            let ids: Vec<u32> = seq.iter().map(|&b| byte(b)).collect();
            let mut d = t.stream_decoder(false);
            let mut streamed = String::new();
            for &id in &ids {
                streamed.push_str(&d.push(id).unwrap());
            }
            streamed.push_str(&d.finish());
            assert_eq!(streamed, String::from_utf8_lossy(seq), "{seq:x?}");
            assert_eq!(streamed, t.decode(&ids, DecodeOptions::TEXT).unwrap());
        }
    }

    #[test]
    fn control_tokens_render_only_on_request() {
        let t = bytes_only();
        assert_eq!(t.stream_decoder(false).push(2).unwrap(), "");
        assert_eq!(t.stream_decoder(true).push(2).unwrap(), "</s>");
        assert!(t.stream_decoder(false).push(100_000).is_err());
    }
}
