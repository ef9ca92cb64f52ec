//! Prompts of an exact number of tokens for a model's tokenizer, so that both engines
//! evaluate the same prompt.

use anyhow::{bail, Result};
use model::tokenizer::{EncodeOptions, Tokenizer};

/// Words repeated to make a prompt, tried in order: common enough to be one token each
/// (with or without the space before them) in the vocabularies we run.
const WORDS: [&str; 4] = ["the", "a", "and", "hello"];

/// A text that `tokenizer` turns into exactly `tokens` prompt tokens, counted as both
/// engines count the tokens they evaluate: with BOS (and EOS) where the model's metadata
/// asks for them, as llama.cpp's `common_tokenize(ctx, prompt, true, true)` and our
/// `EncodeOptions::PROMPT` make them. It is one word repeated with single spaces and no
/// trailing newline (llama.cpp drops a prompt file's last newline; we keep it).
pub fn exact_prompt(tokenizer: &Tokenizer, tokens: usize) -> Result<String> {
    for word in WORDS {
        let count = |repeats: usize| -> Result<usize> {
            Ok(tokenizer
                .encode(&repeated(word, repeats), EncodeOptions::PROMPT)?
                .len())
        };
        // Each repeat adds at least one token, so `tokens` repeats reach `tokens`; the
        // count grows with the repeats, so the fewest repeats reaching it are found by
        // bisection, and they either give exactly `tokens` or this word cannot.
        let (mut low, mut high) = (1, tokens.max(1));
        while low < high {
            let mid = low + (high - low) / 2;
            if count(mid)? >= tokens {
                high = mid;
            } else {
                low = mid + 1;
            }
        }
        if count(low)? == tokens {
            return Ok(repeated(word, low));
        }
    }
    let bos = if tokenizer.adds_bos() {
        " (BOS takes one of them)"
    } else {
        ""
    };
    bail!("cannot make a prompt of exactly {tokens} tokens for this tokenizer{bos}")
}

/// `word` `repeats` times, separated by single spaces.
fn repeated(word: &str, repeats: usize) -> String {
    vec![word; repeats].join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fetch::{models_dir, GEMMA3, SMOLLM2};
    use rocmforge::pull::KnownModel;

    /// The tokenizer of a real model from the models cache, or `None` (with a `SKIPPED`
    /// line) when it has not been fetched.
    fn real_tokenizer(test: &str, model: &KnownModel) -> Option<Tokenizer> {
        let path = models_dir().join(model.file_name);
        let Ok(store) = tensor_store::TensorStore::open(&path) else {
            eprintln!(
                "SKIPPED {test}: no {} (cargo xtask fetch-models)",
                path.display()
            );
            return None;
        };
        Some(Tokenizer::from_metadata(store.metadata()).expect("the model's tokenizer"))
    }

    #[test]
    fn prompts_have_exactly_the_tokens_asked_for() {
        // SmolLM2's BPE vocabulary without BOS; Gemma 3's SentencePiece one, with BOS.
        for model in [&SMOLLM2, &GEMMA3] {
            let Some(tokenizer) =
                real_tokenizer("prompts_have_exactly_the_tokens_asked_for", model)
            else {
                continue;
            };
            let smallest = 1 + usize::from(tokenizer.adds_bos());
            for tokens in [smallest, 8, 100, 2048] {
                let text = exact_prompt(&tokenizer, tokens).unwrap();
                let ids = tokenizer.encode(&text, EncodeOptions::PROMPT).unwrap();
                assert_eq!(ids.len(), tokens, "{} {tokens}", model.file_name);
                assert!(!text.ends_with('\n'));
                let starts_with_bos = Some(ids[0]) == tokenizer.special_tokens().bos;
                assert_eq!(starts_with_bos, tokenizer.adds_bos());
            }
            if tokenizer.adds_bos() {
                // BOS alone is one token; any text adds one more.
                let error = exact_prompt(&tokenizer, 1).unwrap_err().to_string();
                assert!(error.contains("exactly 1 tokens"), "{error}");
            }
        }
    }

    #[test]
    fn repeats_are_separated_by_single_spaces() {
        assert_eq!(repeated("the", 1), "the");
        assert_eq!(repeated("the", 3), "the the the");
    }
}
