//! Chat templates of the real models: SmolLM2's own ChatML template from its metadata, and
//! the built-in Gemma turn format for Gemma 3, whose file carries no template. Expected
//! strings were checked with Python's Jinja2 (`trim_blocks`, `lstrip_blocks`).

use model::chat::{ChatMessage, ChatTemplate, CHAT_TEMPLATE_KEY};
use model::tokenizer::{EncodeOptions, Tokenizer};

use crate::common::{model_path, read_metadata, GEMMA3, SMOLLM2};

const PROMPT: &str = "The capital of France is";

#[test]
fn smollm2_renders_its_own_chatml_template() {
    let metadata = read_metadata(&model_path(SMOLLM2));
    let template = ChatTemplate::from_metadata(&metadata).expect("template");
    assert!(!template.is_built_in());
    assert_eq!(
        template.source(),
        metadata.get_str(CHAT_TEMPLATE_KEY).unwrap()
    );
    let expected = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
                    <|im_start|>user\nThe capital of France is<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(
        template.render(&[ChatMessage::user(PROMPT)], true).unwrap(),
        expected
    );
    let tokenizer = Tokenizer::from_metadata(&metadata).expect("tokenizer");
    assert!(!tokenizer.adds_bos());
    let text = template.user_prompt(PROMPT, tokenizer.adds_bos()).unwrap();
    assert_eq!(text, expected);

    // A system message replaces the default one; without the generation prompt the
    // text ends after the last message.
    let messages = [
        ChatMessage::new("system", "Answer in French."),
        ChatMessage::user("Hi"),
    ];
    let expected =
        "<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n";
    assert_eq!(template.render(&messages, false).unwrap(), expected);

    // Its control tokens become single ids.
    let ids = tokenizer.encode(&text, EncodeOptions::PROMPT).unwrap();
    let im_start = tokenizer.token_id("<|im_start|>").unwrap();
    let im_end = tokenizer.token_id("<|im_end|>").unwrap();
    assert_eq!(ids[0], im_start);
    assert_eq!(ids.iter().filter(|&&id| id == im_start).count(), 3);
    assert_eq!(ids.iter().filter(|&&id| id == im_end).count(), 2);
}

#[test]
fn gemma3_without_a_template_gets_the_gemma_turn_format() {
    let metadata = read_metadata(&model_path(GEMMA3));
    assert!(!metadata.contains(CHAT_TEMPLATE_KEY));
    let template = ChatTemplate::from_metadata(&metadata).expect("template");
    assert!(template.is_built_in());
    let full = template.render(&[ChatMessage::user(PROMPT)], true).unwrap();
    let expected =
        "<start_of_turn>user\nThe capital of France is<end_of_turn>\n<start_of_turn>model\n";
    assert_eq!(full, format!("<bos>{expected}"));
    let tokenizer = Tokenizer::from_metadata(&metadata).expect("tokenizer");
    assert!(tokenizer.adds_bos());
    let text = template.user_prompt(PROMPT, tokenizer.adds_bos()).unwrap();
    assert_eq!(text, expected);

    // Exactly one BOS, then the turn markers as single ids.
    let ids = tokenizer.encode(&text, EncodeOptions::PROMPT).unwrap();
    let bos = tokenizer.special_tokens().bos.unwrap();
    let start = tokenizer.token_id("<start_of_turn>").unwrap();
    let end = tokenizer.token_id("<end_of_turn>").unwrap();
    assert_eq!(&ids[..2], &[bos, start]);
    assert_eq!(ids.iter().filter(|&&id| id == bos).count(), 1);
    assert_eq!(ids.iter().filter(|&&id| id == start).count(), 2);
    assert_eq!(ids.iter().filter(|&&id| id == end).count(), 1);
}
