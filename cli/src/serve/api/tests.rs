use super::completion::Kind;
use super::request::{logprobs_setting, model_name, refuse_unsupported, Common};
use super::*;

/// What the text completions endpoint (which takes no tools) refuses in `body`.
fn refused(body: Value) -> Option<(&'static str, String)> {
    refused_by(body, false)
}

fn refused_by(body: Value, tools_taken: bool) -> Option<(&'static str, String)> {
    let common: Common = serde_json::from_value(body).expect("a request body");
    refuse_unsupported(&common, tools_taken)
        .err()
        .map(|e| (e.param.expect("the field is named"), e.message))
}

#[test]
fn fields_asking_for_what_the_server_cannot_do_are_refused_by_name() {
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    for (body, field) in [
        (json!({"tools": tool}), "tools"),
        (json!({"tools": tool, "tool_choice": "required"}), "tools"),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}),
            "tool_choice",
        ),
        (json!({"functions": [{"name": "f"}]}), "functions"),
        (json!({"function_call": "auto"}), "function_call"),
        (json!({"audio": {"voice": "x"}}), "audio"),
        (json!({"modalities": ["text", "audio"]}), "modalities"),
    ] {
        let (param, message) = refused(body.clone()).unwrap_or_else(|| panic!("{body} passed"));
        assert_eq!(param, field, "{body}");
        assert!(message.contains(field), "{message}");
    }
}

#[test]
fn the_chat_endpoint_reads_tool_fields_itself_but_refuses_legacy_functions() {
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    let body = json!({"tools": tool, "tool_choice": "required", "parallel_tool_calls": true});
    assert_eq!(refused_by(body, true), None);
    for (body, field) in [
        (
            json!({"tools": tool, "functions": [{"name": "f"}]}),
            "functions",
        ),
        (json!({"function_call": {"name": "f"}}), "function_call"),
    ] {
        let (param, _) = refused_by(body.clone(), true).unwrap_or_else(|| panic!("{body} passed"));
        assert_eq!(param, field, "{body}");
    }
}

#[test]
fn model_names_resolve_to_the_one_a_response_gives() {
    let aliases = ["chat".to_owned(), "gpt-4o-mini".to_owned()];
    let name = |requested, strict| model_name(requested, "smol", &aliases, strict);
    for strict in [false, true] {
        assert_eq!(name(None, strict).ok().as_deref(), Some("smol"));
        assert_eq!(name(Some(""), strict).ok().as_deref(), Some("smol"));
        assert_eq!(name(Some("smol"), strict).ok().as_deref(), Some("smol"));
        assert_eq!(name(Some("chat"), strict).ok().as_deref(), Some("chat"));
    }
    // Another model's name is served by this one, unless names are strict.
    assert_eq!(name(Some("gpt-4o"), false).ok().as_deref(), Some("smol"));
    let error = name(Some("gpt-4o"), true).expect_err("refused");
    assert_eq!(error.param, Some("model"));
    for part in ["gpt-4o", "smol", "chat", "gpt-4o-mini"] {
        assert!(error.message.contains(part), "{}", error.message);
    }
}

#[test]
fn cors_lets_in_the_listed_origins_only() {
    let listed = ["https://app.example".to_owned()];
    assert_eq!(
        cors_allow(&listed, "https://app.example"),
        Some("https://app.example")
    );
    assert_eq!(cors_allow(&listed, "https://evil.example"), None);
    assert_eq!(cors_allow(&[], "https://app.example"), None);
    let trailing = ["https://app.example/".to_owned()];
    assert_eq!(
        cors_allow(&trailing, "https://app.example"),
        Some("https://app.example")
    );
    let any = ["*".to_owned()];
    assert_eq!(cors_allow(&any, "https://evil.example"), Some("*"));
}

#[test]
fn fields_that_ask_for_nothing_pass() {
    for body in [
        json!({}),
        json!({"response_format": {"type": "json_object"}}),
        json!({"tools": [], "tool_choice": "none"}),
        json!({"tool_choice": "none", "parallel_tool_calls": true}),
        json!({"function_call": "none"}),
        json!({"logprobs": false, "top_logprobs": 0}),
        json!({"logprobs": null, "audio": null}),
        json!({"modalities": ["text"]}),
    ] {
        assert_eq!(refused(body.clone()), None, "{body}");
    }
}

#[test]
fn a_streamed_call_is_a_delta_with_its_name_then_one_with_its_arguments() {
    use super::stream::Meta;
    use crate::serve::tools::{Piece, ToolCall};
    let meta = Meta {
        id: "chatcmpl-1".into(),
        created: 0,
        model: "m".into(),
        kind: Kind::Chat,
    };
    let call = ToolCall {
        id: "call_x".into(),
        name: "f".into(),
        arguments: "{\"a\":1}".into(),
    };
    let events = meta.pieces(vec![
        Piece::Text("Hi".into()),
        Piece::Call { index: 1, call },
    ]);
    assert_eq!(events.len(), 3, "{events:?}");
    let delta = |i: usize| &events[i]["choices"][0]["delta"];
    assert_eq!(*delta(0), json!({"content": "Hi"}));
    assert_eq!(
        delta(1)["tool_calls"],
        json!([{"index": 1, "id": "call_x", "type": "function",
            "function": {"name": "f", "arguments": ""}}])
    );
    assert_eq!(
        delta(2)["tool_calls"],
        json!([{"index": 1, "function": {"arguments": "{\"a\":1}"}}])
    );
    assert!(events
        .iter()
        .all(|e| e["choices"][0]["finish_reason"].is_null()));
}

#[test]
fn an_answer_of_calls_has_null_content_and_text_before_calls_stays() {
    use super::completion::split_calls;
    use crate::serve::tools::{CallParser, ToolSyntax};
    let parser = || CallParser::new(ToolSyntax::Hermes, vec!["f".into()]);
    let call = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1]}}\n</tool_call>";
    let (content, calls) = split_calls(&mut parser(), &format!("\n{call}\n"));
    assert_eq!(content, None);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(
        calls[0]["function"],
        json!({"name": "f", "arguments": "{\"a\":[1]}"})
    );
    let (content, calls) = split_calls(&mut parser(), &format!("Calling f.\n{call}"));
    assert_eq!(content.as_deref(), Some("Calling f."));
    assert_eq!(calls.len(), 1);
    let (content, calls) = split_calls(&mut parser(), "No call here. ");
    assert_eq!(content.as_deref(), Some("No call here. "));
    assert!(calls.is_empty());
}

fn logprobs_of(body: Value, kind: Kind) -> Result<Option<usize>, (&'static str, String)> {
    let common: Common = serde_json::from_value(body).expect("a request body");
    logprobs_setting(&common, kind).map_err(|e| (e.param.expect("the field is named"), e.message))
}

#[test]
fn chat_log_probabilities_take_a_flag_and_a_count() {
    let chat = |body| logprobs_of(body, Kind::Chat);
    assert_eq!(chat(json!({})), Ok(None));
    assert_eq!(chat(json!({"logprobs": false})), Ok(None));
    assert_eq!(
        chat(json!({"logprobs": null, "top_logprobs": null})),
        Ok(None)
    );
    assert_eq!(chat(json!({"logprobs": true})), Ok(Some(0)));
    assert_eq!(
        chat(json!({"logprobs": true, "top_logprobs": 5})),
        Ok(Some(5))
    );
    assert_eq!(
        chat(json!({"logprobs": true, "top_logprobs": 20})),
        Ok(Some(20))
    );
    for (body, field) in [
        (json!({"top_logprobs": 3}), "top_logprobs"),
        (
            json!({"logprobs": false, "top_logprobs": 3}),
            "top_logprobs",
        ),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            json!({"logprobs": true, "top_logprobs": -1}),
            "top_logprobs",
        ),
        (
            json!({"logprobs": true, "top_logprobs": 2.5}),
            "top_logprobs",
        ),
        (
            json!({"logprobs": true, "top_logprobs": "5"}),
            "top_logprobs",
        ),
        (json!({"logprobs": 5}), "logprobs"),
    ] {
        let (param, message) = chat(body.clone()).expect_err(&body.to_string());
        assert_eq!(param, field, "{body}");
        assert!(message.contains(field), "{message}");
    }
}

#[test]
fn text_log_probabilities_are_a_count_without_echo() {
    let text = |body| logprobs_of(body, Kind::Text);
    assert_eq!(text(json!({})), Ok(None));
    assert_eq!(text(json!({"logprobs": 0})), Ok(Some(0)));
    assert_eq!(text(json!({"logprobs": 3, "echo": false})), Ok(Some(3)));
    assert_eq!(text(json!({"echo": true})), Ok(None));
    for (body, field) in [
        (json!({"logprobs": 21}), "logprobs"),
        (json!({"logprobs": true}), "logprobs"),
        (json!({"logprobs": 3, "echo": true}), "echo"),
        (json!({"top_logprobs": 3}), "top_logprobs"),
    ] {
        let (param, message) = text(body.clone()).expect_err(&body.to_string());
        assert_eq!(param, field, "{body}");
        assert!(message.contains(field), "{message}");
    }
}

#[test]
fn fields_no_part_of_a_body_takes_are_collected_by_name() {
    let chat: super::request::ChatBody = serde_json::from_value(json!({
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "response_format": {"type": "text"},
        "stream_options": {"include_usage": true},
        "user": "someone",
        "made_up_option": {"nested": [1, 2]},
    }))
    .expect("a chat body");
    let names: Vec<&str> = chat.unknown.keys().map(String::as_str).collect();
    assert_eq!(names, ["made_up_option", "user"]);
    let text: super::request::CompletionBody =
        serde_json::from_value(json!({"prompt": "hi", "seed": 1, "echo": false}))
            .expect("a completion body");
    assert!(text.unknown.is_empty(), "{:?}", text.unknown.keys());
}

#[test]
fn prompts_and_inputs_read_as_openai_gives_them() {
    use super::request::{read_inputs, Inputs};
    let read = |value: Value| read_inputs(&value, "input", 3);
    let texts = |t: &[&str]| Inputs::Texts(t.iter().map(|s| s.to_string()).collect());
    assert_eq!(read(json!("hi")).ok(), Some(texts(&["hi"])));
    assert_eq!(read(json!(["a", "b"])).ok(), Some(texts(&["a", "b"])));
    assert_eq!(read(json!([""])).ok(), Some(texts(&[""])));
    assert_eq!(
        read(json!([1, 2, 3, 4])).ok(),
        Some(Inputs::Tokens(vec![vec![1, 2, 3, 4]]))
    );
    assert_eq!(
        read(json!([[1, 2], [3], []])).ok(),
        Some(Inputs::Tokens(vec![vec![1, 2], vec![3], vec![]]))
    );
    assert_eq!(read(json!([4294967295u32])).ok().map(|i| i.len()), Some(1));
    for (bad, part) in [
        (json!([]), "empty"),
        (json!(["a", "b", "c", "d"]), "at most 3"),
        (json!([[1], [2], [3], [4]]), "at most 3"),
        (json!(["a", 1]), "mixed"),
        (json!([[1], "a"]), "mixed"),
        (json!([-1]), "integers"),
        (json!([1.5]), "integers"),
        (json!([4294967296u64]), "integers"),
        (json!([[1], [-2]]), "item 1"),
        (json!({"text": "a"}), "an object"),
        (json!(null), "null"),
        (json!(7), "a number"),
    ] {
        let error = read(bad.clone()).expect_err(&bad.to_string());
        assert_eq!(error.param, Some("input"), "{bad}");
        assert!(error.message.starts_with("input: "), "{}", error.message);
        assert!(error.message.contains(part), "{bad}: {}", error.message);
    }
}

#[test]
fn embeddings_settings_take_float_or_base64_and_refuse_dimensions() {
    use super::embeddings::{settings, EmbeddingsBody, Encoding};
    let of = |body: Value| {
        let body: EmbeddingsBody = serde_json::from_value(body).expect("a body");
        settings(&body).map_err(|e| (e.param, e.message))
    };
    assert_eq!(of(json!({"input": "a"})), Ok(Encoding::Float));
    assert_eq!(
        of(json!({"input": "a", "encoding_format": "float", "dimensions": null})),
        Ok(Encoding::Float)
    );
    assert_eq!(
        of(json!({"input": "a", "encoding_format": "base64", "user": "u"})),
        Ok(Encoding::Base64)
    );
    let (param, message) = of(json!({"input": "a", "dimensions": 64})).expect_err("refused");
    assert_eq!(param, Some("dimensions"));
    assert!(message.contains("64"), "{message}");
    let (param, message) =
        of(json!({"input": "a", "encoding_format": "hex"})).expect_err("refused");
    assert_eq!(param, Some("encoding_format"));
    assert!(message.contains("hex"), "{message}");
    let body: EmbeddingsBody =
        serde_json::from_value(json!({"input": "a", "user": "u", "extra": 1})).expect("a body");
    assert_eq!(body.unknown.keys().collect::<Vec<_>>(), ["extra"]);
}

#[test]
fn embeddings_inputs_must_have_tokens_within_the_context() {
    use super::embeddings::check_lengths;
    assert!(check_lengths(&[vec![1, 2], vec![3]], 2).is_ok());
    let error = check_lengths(&[vec![1], vec![]], 2).expect_err("empty");
    assert_eq!(error.param, Some("input"));
    assert!(error.message.contains("item 1"), "{}", error.message);
    let error = check_lengths(&[vec![1, 2, 3]], 2).expect_err("too long");
    assert!(
        error.message.contains("3 tokens") && error.message.contains("holds 2"),
        "{}",
        error.message
    );
}

#[test]
fn vectors_in_base64_are_their_little_endian_f32_bytes() {
    use super::embeddings::{base64, encode_vector, Encoding};
    // RFC 4648's test vectors.
    for (plain, encoded) in [
        ("", ""),
        ("f", "Zg=="),
        ("fo", "Zm8="),
        ("foo", "Zm9v"),
        ("foob", "Zm9vYg=="),
        ("fooba", "Zm9vYmE="),
        ("foobar", "Zm9vYmFy"),
    ] {
        assert_eq!(base64(plain.as_bytes()), encoded);
    }
    // 1.0 is 00 00 80 3f; -2.5 is 00 00 20 c0.
    assert_eq!(
        encode_vector(&[1.0, -2.5], Encoding::Base64),
        json!("AACAPwAAIMA=")
    );
    assert_eq!(
        encode_vector(&[1.0, -2.5], Encoding::Float),
        json!([1.0, -2.5])
    );
    // The shortest digits of the f32, which read back as it.
    let v = -0.032_539_073_f32;
    let written = encode_vector(&[v], Encoding::Float).to_string();
    assert_eq!(written, "[-0.032539073]");
    let read: Vec<f64> = serde_json::from_str(&written).expect("numbers");
    assert_eq!(read[0] as f32, v);
}

#[test]
fn usage_sums_the_choices() {
    use super::completion::usage;
    use model::serve::{Finish, FinishReason};
    let finish = |prompt, completion, cached| Finish {
        reason: FinishReason::Length,
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: cached,
    };
    let u = usage(&[finish(5, 8, 0), finish(7, 2, 4)]);
    assert_eq!(
        u,
        json!({"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22,
            "prompt_tokens_details": {"cached_tokens": 4}})
    );
}
