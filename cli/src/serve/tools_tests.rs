//! Reading `tools` and `tool_choice`, the syntaxes' parsers (whole and streamed), the
//! grammars a required call compiles to, and the fixture template's rendering.

use std::sync::Arc;

use model::chat::{ChatMessage, ChatTemplate};
use model::constraint::{ConstraintSpec, Grammars};
use model::tokenizer::{token_type, TokenId, Tokenizer, VocabSpec};
use serde_json::{json, Value};

use super::*;

const FIXTURE: &str = include_str!("../../tests/templates/hermes-tools.jinja");

fn weather() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["c", "f"]}
            },
            "required": ["city", "unit"],
            "additionalProperties": false
        }
    }})
}

fn time() -> Value {
    json!({"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer"}},
        "required": ["zone"], "additionalProperties": false}}})
}

fn request(choice: Value, parallel: bool) -> ToolRequest {
    read(
        Some(&json!([weather(), time()])),
        Some(&choice),
        Some(&json!(parallel)),
    )
    .expect("valid")
    .expect("tools given")
}

fn names() -> Vec<String> {
    vec!["get_weather".into(), "get_time".into()]
}

/// Every piece of `text` through a parser fed `chunk` bytes (at char boundaries) at a
/// time: the text and the calls (name, arguments) it gives.
fn parse_in_chunks(
    syntax: ToolSyntax,
    text: &str,
    chunk: usize,
) -> (String, Vec<(usize, String, String)>) {
    let mut parser = CallParser::new(syntax, names());
    let mut pieces = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut n = chunk.min(rest.len());
        while !rest.is_char_boundary(n) {
            n += 1;
        }
        pieces.extend(parser.push(&rest[..n]));
        rest = &rest[n..];
    }
    pieces.extend(parser.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call { index, call } => {
                // Mistral's templates take back ids of 9 letters and digits only.
                let (id, length) = match syntax {
                    ToolSyntax::Mistral => (call.id.as_str(), 9),
                    _ => (call.id.strip_prefix("call_").expect("call_ first"), 24),
                };
                assert!(
                    id.len() == length && id.bytes().all(|b| b.is_ascii_alphanumeric()),
                    "{}",
                    call.id
                );
                calls.push((index, call.name, call.arguments));
            }
        }
    }
    (content, calls)
}

fn parse_all(syntax: ToolSyntax, text: &str) -> (String, Vec<(usize, String, String)>) {
    let whole = parse_in_chunks(syntax, text, usize::MAX);
    for chunk in [1, 2, 3, 7] {
        assert_eq!(
            parse_in_chunks(syntax, text, chunk),
            whole,
            "{text:?} by {chunk}"
        );
    }
    whole
}

fn call(index: usize, name: &str, arguments: &str) -> (usize, String, String) {
    (index, name.into(), arguments.into())
}

#[test]
fn hermes_calls_are_read_one_or_several() {
    let one = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>";
    assert_eq!(
        parse_all(ToolSyntax::Hermes, one),
        (
            String::new(),
            vec![call(0, "get_weather", r#"{"city":"Paris","unit":"c"}"#)]
        )
    );
    let two = format!(
        "Let me look.\n{one}\n<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {{\"zone\": 2}}}}\n</tool_call>\n"
    );
    assert_eq!(
        parse_all(ToolSyntax::Hermes, &two),
        (
            "Let me look.".into(),
            vec![
                call(0, "get_weather", r#"{"city":"Paris","unit":"c"}"#),
                call(1, "get_time", r#"{"zone":2}"#),
            ]
        )
    );
    // A bare call object as the whole message (markers that are control tokens leave
    // no text), and arguments given as a JSON string.
    let bare = r#" {"name": "get_time", "arguments": "{\"zone\": 3}"}"#;
    assert_eq!(
        parse_all(ToolSyntax::Hermes, bare),
        (String::new(), vec![call(0, "get_time", r#"{"zone": 3}"#)])
    );
}

#[test]
fn what_is_no_call_stays_text() {
    for text in [
        "The weather is fine.",
        "Use <tool and <tool_cal to call.",
        "<tool_call>not json</tool_call> after",
        "<tool_call>{\"name\": \"unknown\", \"arguments\": {}}</tool_call>",
        "{\"name\": \"get_weather\", \"arguments\": 3}",
        "{\"a\": 1}",
        "<tool_call>{\"name\": \"get_time\"",
        "  ",
        "",
    ] {
        assert_eq!(
            parse_all(ToolSyntax::Hermes, text),
            (text.to_owned(), vec![]),
            "{text:?}"
        );
    }
}

#[test]
fn llama3_calls_are_the_whole_message() {
    let text = r#"{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}"#;
    let expected = (
        String::new(),
        vec![call(0, "get_weather", r#"{"city":"Oslo","unit":"f"}"#)],
    );
    assert_eq!(parse_all(ToolSyntax::Llama3, text), expected);
    assert_eq!(
        parse_all(ToolSyntax::Llama3, &format!("<|python_tag|>{text}")),
        expected
    );
    for text in [
        "The answer is {\"name\": \"get_time\"}",
        "<|python_tag|>print(1)",
        "<|pyth",
    ] {
        assert_eq!(parse_all(ToolSyntax::Llama3, text), (text.into(), vec![]));
    }
}

#[test]
fn mistral_calls_are_a_list_after_the_marker() {
    let text = r#"[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": 1}}, {"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}]"#;
    let expected = (
        String::new(),
        vec![
            call(0, "get_time", r#"{"zone":1}"#),
            call(1, "get_weather", r#"{"city":"Rome","unit":"c"}"#),
        ],
    );
    assert_eq!(parse_all(ToolSyntax::Mistral, text), expected);
    // The marker is a control token in Mistral's vocabularies: the text lacks it.
    let bare = text.trim_start_matches("[TOOL_CALLS]");
    assert_eq!(parse_all(ToolSyntax::Mistral, bare), expected);
    for text in [
        "[1, 2]",
        "Sure: [TOOL_CALLS]",
        "[TOOL_CALLS][{\"name\": \"nope\"}]",
    ] {
        assert_eq!(parse_all(ToolSyntax::Mistral, text), (text.into(), vec![]));
    }
}

#[test]
fn streamed_text_is_held_back_only_while_it_may_open_a_call() {
    let mut p = CallParser::new(ToolSyntax::Hermes, names());
    assert_eq!(p.push("Hello"), vec![Piece::Text("Hello".into())]);
    // "<tool" may open a call: nothing comes out.
    assert_eq!(p.push(" <tool"), vec![]);
    // It did not: out it comes, with what follows.
    assert_eq!(p.push("s> are"), vec![Piece::Text(" <tools> are".into())]);
    assert_eq!(p.push(" <tool_call>\n{\"name\": \"get_time\", "), vec![]);
    assert_eq!(p.push("\"arguments\": {\"zone\": 5}}\n</tool"), vec![]);
    let got = p.push("_call>");
    assert!(
        matches!(&got[..], [Piece::Call { index: 0, call }] if call.name == "get_time" && call.arguments == r#"{"zone":5}"#),
        "{got:?}"
    );
    assert_eq!(p.finish(), vec![]);
    assert_eq!(p.calls(), 1);
    // A message starting like JSON is held to its end.
    let mut p = CallParser::new(ToolSyntax::Hermes, names());
    assert_eq!(p.push("{\"a\""), vec![]);
    assert_eq!(p.push(": 1}"), vec![]);
    assert_eq!(p.finish(), vec![Piece::Text("{\"a\": 1}".into())]);
}

#[test]
fn tools_and_tool_choice_are_read() {
    let r = request(json!("required"), true);
    assert_eq!(r.choice, Choice::Required);
    assert!(r.parallel && r.enforced());
    assert_eq!(r.defs[0].0, "get_weather");
    let named = request(
        json!({"type": "function", "function": {"name": "get_time"}}),
        false,
    );
    assert_eq!(named.choice, Choice::Named("get_time".into()));
    assert_eq!(request(json!("auto"), true).choice, Choice::Auto);
    assert_eq!(request(json!("none"), true).choice, Choice::None);
    // Parameters default to an empty object schema.
    let bare = json!([{"type": "function", "function": {"name": "ping"}}]);
    let r = read(Some(&bare), None, None).unwrap().unwrap();
    assert_eq!(r.defs[0].1, json!({"type": "object", "properties": {}}));
    assert_eq!(r.tools[0]["function"]["parameters"], r.defs[0].1);
    assert!(r.parallel);
    // No tools and nothing asked.
    assert!(read(None, None, None).unwrap().is_none());
    assert!(read(Some(&json!([])), Some(&json!("none")), None)
        .unwrap()
        .is_none());
}

#[test]
fn malformed_tools_are_refused_naming_the_field() {
    let tools = json!([weather()]);
    let cases = [
        (json!({"tools": {"a": 1}}), "tools"),
        (json!({"tools": [{"type": "code"}]}), "tools"),
        (json!({"tools": [{"type": "function"}]}), "tools"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
            "tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}),
            "tools",
        ),
        (json!({"tools": [weather(), weather()]}), "tools"),
        (
            json!({"tools": tools, "tool_choice": "always"}),
            "tool_choice",
        ),
        (
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": tools, "tool_choice": {"type": "function"}}),
            "tool_choice",
        ),
        (json!({"tools": tools, "tool_choice": 1}), "tool_choice"),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": tools, "parallel_tool_calls": "yes"}),
            "parallel_tool_calls",
        ),
    ];
    for (body, field) in cases {
        let err = read(
            body.get("tools"),
            body.get("tool_choice"),
            body.get("parallel_tool_calls"),
        )
        .expect_err(&body.to_string());
        assert_eq!(err.param_name(), Some(field), "{body}");
    }
    let many: Vec<Value> = (0..=MAX_TOOLS)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
        .collect();
    assert!(read(Some(&Value::from(many)), None, None).is_err());
    let huge = json!([{"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "description": "x".repeat(MAX_SCHEMA_BYTES)}}}]);
    assert!(read(Some(&huge), None, None).is_err());
}

#[test]
fn the_template_text_picks_the_syntax() {
    let hermes = ChatTemplate::new(FIXTURE, "", "");
    assert_eq!(ToolSyntax::of_template(&hermes), Ok(ToolSyntax::Hermes));
    let mistral = ChatTemplate::new("{{ '[TOOL_CALLS]' }}", "", "");
    assert_eq!(ToolSyntax::of_template(&mistral), Ok(ToolSyntax::Mistral));
    let llama = ChatTemplate::new("{{ '<|python_tag|>' }}", "", "");
    assert_eq!(ToolSyntax::of_template(&llama), Ok(ToolSyntax::Llama3));
    // A template that renders tools in a way of its own is read as Hermes; one that
    // does not render them cannot take them, and says so.
    let renders = ChatTemplate::new(
        "{% for t in tools %}{{ t.function.name }}{% endfor %}",
        "",
        "",
    );
    assert_eq!(ToolSyntax::of_template(&renders), Ok(ToolSyntax::Hermes));
    let plain = ChatTemplate::new(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
        "",
        "",
    );
    let why = ToolSyntax::of_template(&plain).expect_err("no tools");
    assert!(why.contains("--chat-template-file"), "{why}");
}

#[test]
fn the_fixture_renders_tools_calls_and_results() {
    let template = ChatTemplate::new(FIXTURE, "", "");
    let mut asked = ChatMessage::new("assistant", "");
    asked.tool_calls = Some(
        history_calls(
            1,
            &json!([{"id": "call_1", "type": "function", "function":
                {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]),
        )
        .unwrap(),
    );
    let mut result = ChatMessage::new("tool", "{\"temperature\": 21}");
    result.tool_call_id = Some("call_1".into());
    let messages = [ChatMessage::user("Weather in Paris?"), asked, result];
    let text = template
        .render_with_tools(&messages, Some(&[weather()]), true)
        .unwrap();
    let expected_parts = [
        "<|im_start|>system\nYou can call functions.",
        "{\"function\": {\"description\": \"The weather in a city.\", \"name\": \"get_weather\"",
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n",
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call><|im_end|>\n",
        "<|im_start|>user\n<tool_response>\n{\"temperature\": 21}\n</tool_response><|im_end|>\n",
    ];
    for part in expected_parts {
        assert!(text.contains(part), "{part:?} missing from {text}");
    }
    assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
    // Without tools, plain ChatML.
    let plain = template.render(&[ChatMessage::user("hi")], true).unwrap();
    assert_eq!(
        plain,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    // The history's calls are checked.
    assert!(history_calls(0, &json!({"a": 1})).is_err());
    assert!(history_calls(0, &json!([{"function": {}}])).is_err());
}

/// A byte-fallback vocabulary: every text is its bytes' tokens; `[TOOL_CALLS]` is a
/// control token, after `<unk>`, `<s>`, `</s>` and the 256 bytes.
fn bytes_tokenizer() -> Tokenizer {
    let tokens: Vec<String> = ["<unk>", "<s>", "</s>"]
        .into_iter()
        .map(String::from)
        .chain((0..=255u8).map(|b| format!("<0x{b:02X}>")))
        .chain(["[TOOL_CALLS]".to_owned()])
        .collect();
    let types = (0..tokens.len())
        .map(|i| match i {
            0 => token_type::UNKNOWN,
            3..=258 => token_type::BYTE,
            _ => token_type::CONTROL,
        })
        .collect();
    Tokenizer::new(VocabSpec {
        model: "llama".into(),
        tokens: tokens.into(),
        token_types: Some(types),
        eos_id: Some(2),
        ..VocabSpec::default()
    })
    .unwrap()
}

const TOOL_CALLS_ID: TokenId = 3 + 256;

/// Whether the grammar takes `tokens` and then may end.
fn accepts(grammars: &Grammars, grammar: &str, tokens: &[TokenId]) -> bool {
    let mut c = grammars
        .compile(&ConstraintSpec::Lark(grammar.into()))
        .expect("compiles");
    for &t in tokens {
        if c.commit(t).is_err() {
            return false;
        }
    }
    c.is_accepting()
}

fn text_tokens(text: &str) -> Vec<TokenId> {
    text.bytes().map(|b| 3 + TokenId::from(b)).collect()
}

#[test]
fn required_calls_compile_to_grammars_of_the_syntax() {
    let t = Arc::new(bytes_tokenizer());
    let grammars = Grammars::new(Arc::clone(&t), t.n_tokens()).unwrap();
    let special = |text: &str| (text == "[TOOL_CALLS]").then_some(TOOL_CALLS_ID);
    let weather_call = r#"{"name": "get_weather", "arguments": {"city":"Paris","unit":"c"}}"#;
    let time_call = r#"{"name": "get_time", "arguments": {"zone":2}}"#;
    let block = |c: &str| format!("<tool_call>\n{c}\n</tool_call>");

    let required = request(json!("required"), false);
    required.check_schemas(&grammars).unwrap();
    let g = required.grammar(ToolSyntax::Hermes, &special).unwrap();
    assert!(accepts(&grammars, &g, &text_tokens(&block(weather_call))));
    assert!(accepts(&grammars, &g, &text_tokens(&block(time_call))));
    // Not two without parallel calls; no unknown name; no argument off the schema.
    let both = format!("{}\n{}", block(weather_call), block(time_call));
    assert!(!accepts(&grammars, &g, &text_tokens(&both)));
    let unknown = block(r#"{"name": "get_date", "arguments": {}}"#);
    assert!(!accepts(&grammars, &g, &text_tokens(&unknown)));
    let off_schema = block(r#"{"name": "get_weather", "arguments": {"city":"Paris","unit":"k"}}"#);
    assert!(!accepts(&grammars, &g, &text_tokens(&off_schema)));
    assert!(!accepts(&grammars, &g, &text_tokens("Sure!")));

    let parallel = request(json!("required"), true);
    let g = parallel.grammar(ToolSyntax::Hermes, &special).unwrap();
    assert!(accepts(&grammars, &g, &text_tokens(&both)));

    let named = request(
        json!({"type": "function", "function": {"name": "get_time"}}),
        true,
    );
    let g = named.grammar(ToolSyntax::Hermes, &special).unwrap();
    assert!(accepts(&grammars, &g, &text_tokens(&block(time_call))));
    assert!(!accepts(&grammars, &g, &text_tokens(&block(weather_call))));

    let g = required.grammar(ToolSyntax::Llama3, &special).unwrap();
    let llama = r#"{"name": "get_time", "parameters": {"zone":2}}"#;
    assert!(accepts(&grammars, &g, &text_tokens(llama)));
    assert!(!accepts(&grammars, &g, &text_tokens(time_call)));

    // Mistral's marker is its control token, then the list.
    let g = parallel.grammar(ToolSyntax::Mistral, &special).unwrap();
    let mut tokens = vec![TOOL_CALLS_ID];
    tokens.extend(text_tokens(&format!("[{weather_call}, {time_call}]")));
    assert!(accepts(&grammars, &g, &tokens));
    assert!(!accepts(
        &grammars,
        &g,
        &text_tokens(&format!("[TOOL_CALLS][{time_call}]"))
    ));

    // auto and none ask for no grammar.
    assert!(request(json!("auto"), true)
        .grammar(ToolSyntax::Hermes, &special)
        .is_none());
    // A schema that does not compile is refused naming tools.
    let bad = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]);
    let r = read(Some(&bad), None, None).unwrap().unwrap();
    let err = r.check_schemas(&grammars).expect_err("refused");
    assert_eq!(err.param_name(), Some("tools"));
}
