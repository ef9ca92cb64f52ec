//! Log-probabilities as the responses give them: chat's `logprobs.content` entries, and
//! the legacy lists of text completions.
//!
//! A token's `token` is its bytes as text, a partial character replaced by U+FFFD, and
//! `bytes` its exact bytes. A log-probability that is `-inf` (a token the request made
//! impossible) goes out as -9999, as OpenAI writes it: JSON has no infinity.

use model::serve::{LogprobEntry, TokenLogprobs};
use serde_json::{json, Map, Value};

use super::completion::Kind;

/// What a log-probability is written as when it is `-inf`.
const IMPOSSIBLE: f32 = -9999.0;

fn logprob(entry: &LogprobEntry) -> f32 {
    if entry.logprob.is_finite() {
        entry.logprob
    } else {
        IMPOSSIBLE
    }
}

fn text(entry: &LogprobEntry) -> String {
    String::from_utf8_lossy(&entry.bytes).into_owned()
}

fn chat_entry(entry: &LogprobEntry) -> Value {
    json!({"token": text(entry), "logprob": logprob(entry), "bytes": entry.bytes})
}

/// The log-probabilities of `tokens` as a choice's `logprobs` for the endpoint `kind`;
/// text completions' `text_offset` count from `offset` (characters of the tokens'
/// texts since the start of the completion), which moves past them.
pub(super) fn format(kind: Kind, tokens: &[TokenLogprobs], offset: &mut usize) -> Value {
    match kind {
        Kind::Chat => {
            let content: Vec<Value> = tokens
                .iter()
                .map(|t| {
                    let mut entry = chat_entry(&t.chosen);
                    entry["top_logprobs"] = t.top.iter().map(chat_entry).collect();
                    entry
                })
                .collect();
            json!({"content": content, "refusal": Value::Null})
        }
        Kind::Text => {
            let mut texts = Vec::with_capacity(tokens.len());
            let mut offsets = Vec::with_capacity(tokens.len());
            for t in tokens {
                let token = text(&t.chosen);
                offsets.push(*offset);
                *offset += token.chars().count();
                texts.push(token);
            }
            let top: Vec<Value> = tokens
                .iter()
                .map(|t| {
                    // Tokens of the same text: the most likely one names it.
                    let mut map = Map::new();
                    for entry in &t.top {
                        map.entry(text(entry)).or_insert(json!(logprob(entry)));
                    }
                    Value::Object(map)
                })
                .collect();
            let logprobs: Vec<f32> = tokens.iter().map(|t| logprob(&t.chosen)).collect();
            json!({
                "tokens": texts,
                "token_logprobs": logprobs,
                "top_logprobs": top,
                "text_offset": offsets,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(token: u32, logprob: f32, bytes: &[u8]) -> LogprobEntry {
        LogprobEntry {
            token,
            logprob,
            bytes: bytes.to_vec(),
        }
    }

    fn tokens() -> Vec<TokenLogprobs> {
        vec![
            TokenLogprobs {
                chosen: entry(1, -0.5, b"Hi"),
                top: vec![entry(1, -0.5, b"Hi"), entry(2, -1.5, b"Hello")],
            },
            TokenLogprobs {
                // Half of a two-byte character.
                chosen: entry(3, f32::NEG_INFINITY, &[0xC3]),
                top: vec![],
            },
        ]
    }

    #[test]
    fn chat_entries_carry_text_bytes_and_top_ones() {
        let value = format(Kind::Chat, &tokens(), &mut 0);
        let content = value["content"].as_array().expect("a list");
        assert_eq!(content[0]["token"], "Hi");
        assert_eq!(content[0]["bytes"], json!([72, 105]));
        assert_eq!(content[0]["top_logprobs"][1]["token"], "Hello");
        assert_eq!(content[0]["top_logprobs"][1]["logprob"], json!(-1.5));
        assert_eq!(content[1]["token"], "\u{FFFD}");
        assert_eq!(content[1]["bytes"], json!([0xC3]));
        assert_eq!(content[1]["logprob"], json!(-9999.0));
        assert_eq!(content[1]["top_logprobs"], json!([]));
    }

    #[test]
    fn text_completions_get_the_legacy_lists_with_running_offsets() {
        let mut offset = 4;
        let value = format(Kind::Text, &tokens(), &mut offset);
        assert_eq!(value["tokens"], json!(["Hi", "\u{FFFD}"]));
        assert_eq!(value["token_logprobs"], json!([-0.5, -9999.0]));
        assert_eq!(value["top_logprobs"][0], json!({"Hi": -0.5, "Hello": -1.5}));
        assert_eq!(value["text_offset"], json!([4, 6]));
        assert_eq!(offset, 7);
    }
}
