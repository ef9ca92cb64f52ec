//! Rendering, the built-in templates, the sandbox's limits and the date helper. The
//! expected strings were checked against Python's Jinja2 with `trim_blocks` and
//! `lstrip_blocks`, the environment chat templates are written for. The real models'
//! templates are tested in `tests/real_models/chat.rs`.

use gguf_format::{Metadata, Value as GgufValue};

use super::*;

const TOKENS: &[&str] = &["<unk>", "<bos>", "<eos>", "hello"];

fn metadata(architecture: &str, tokens: &[&str], template: Option<&str>) -> Metadata {
    let mut m = Metadata::new();
    m.set("general.architecture", GgufValue::from(architecture));
    let tokens: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
    m.set("tokenizer.ggml.tokens", GgufValue::from(tokens));
    m.set("tokenizer.ggml.bos_token_id", GgufValue::U32(1));
    m.set("tokenizer.ggml.eos_token_id", GgufValue::U32(2));
    if let Some(t) = template {
        m.set(CHAT_TEMPLATE_KEY, GgufValue::from(t));
    }
    m
}

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", " Be brief. "),
        ChatMessage::user(" Hi\n"),
        ChatMessage::new("assistant", "Hello!"),
        ChatMessage::user("Why?"),
    ]
}

fn render(source: &str) -> Result<String, ChatTemplateError> {
    ChatTemplate::new(source, "<s>", "</s>").render(&[ChatMessage::user("hi")], true)
}

#[test]
fn metadata_template_is_used_with_token_texts() {
    let source =
        "{{ bos_token }}|{{ eos_token }}|{{ messages[0]['content'] }}|{{ add_generation_prompt }}";
    let t = ChatTemplate::from_metadata(&metadata("llama", TOKENS, Some(source))).unwrap();
    assert!(!t.is_built_in());
    assert_eq!(t.built_in_name(), None);
    assert_eq!(
        t.render(&[ChatMessage::user("x")], true).unwrap(),
        "<bos>|<eos>|x|True"
    );
    assert_eq!(
        t.render(&[ChatMessage::user("x")], false).unwrap(),
        "<bos>|<eos>|x|False"
    );
}

#[test]
fn gemma_without_template_gets_the_turn_format() {
    let t = ChatTemplate::from_metadata(&metadata("gemma3", TOKENS, None)).unwrap();
    assert!(t.is_built_in());
    assert_eq!(t.built_in_name(), Some("Gemma"));
    let one = t
        .render(&[ChatMessage::user("The capital of France is")], true)
        .unwrap();
    assert_eq!(
        one,
        "<bos><start_of_turn>user\nThe capital of France is<end_of_turn>\n<start_of_turn>model\n"
    );
    let many = t.render(&conversation(), true).unwrap();
    let expected = "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n\
                    <start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n";
    assert_eq!(many, expected);
    // The tokenizer adds BOS itself: the text must not carry it too.
    let prompt = t.user_prompt("Hi", true).unwrap();
    assert_eq!(
        prompt,
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    );
    assert!(t.user_prompt("Hi", false).unwrap().starts_with("<bos>"));
}

#[test]
fn chatml_vocabulary_without_template_gets_chatml() {
    let tokens = ["<unk>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"];
    let t = ChatTemplate::from_metadata(&metadata("qwen2", &tokens, None)).unwrap();
    assert_eq!(t.built_in_name(), Some("ChatML"));
    let expected = "<|im_start|>system\n Be brief. <|im_end|>\n<|im_start|>user\n Hi\n<|im_end|>\n\
                    <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(t.render(&conversation(), true).unwrap(), expected);
}

#[test]
fn no_template_and_no_known_format_is_an_error() {
    let e = ChatTemplate::from_metadata(&metadata("llama", TOKENS, None)).unwrap_err();
    assert!(
        matches!(&e, ChatTemplateError::Missing { architecture } if architecture == "llama"),
        "{e}"
    );
    assert!(e.to_string().contains("tokenizer.chat_template"), "{e}");
}

#[test]
fn wrongly_typed_template_metadata_is_an_error() {
    let mut m = metadata("llama", TOKENS, None);
    m.set(CHAT_TEMPLATE_KEY, GgufValue::U32(7));
    let e = ChatTemplate::from_metadata(&m).unwrap_err();
    assert!(matches!(e, ChatTemplateError::Metadata(_)), "{e}");
}

#[test]
fn blocks_trim_their_newlines_and_leading_space() {
    let source = "{% for m in messages %}\n    {% if true %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}";
    assert_eq!(render(source).unwrap(), "[hi]\n");
}

#[test]
fn python_methods_and_loop_controls_work() {
    let source =
        "{{ '  a b  '.strip() }}|{{ 'Hi'.upper() }}|{{ messages[0].content.startswith('h') }}|\
                  {% for k, v in {'x': 1}.items() %}{{ k }}={{ v }}{% endfor %}|\
                  {% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}";
    assert_eq!(render(source).unwrap(), "a b|HI|True|x=1|01");
}

#[test]
fn raise_exception_is_reported_with_its_message() {
    let source = "{% if messages[0].role != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}";
    let e = render(source).unwrap_err();
    assert!(
        matches!(&e, ChatTemplateError::Raised { message } if message == "a system message comes first"),
        "{e}"
    );
}

#[test]
fn an_endless_loop_runs_out_of_fuel() {
    let source =
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}";
    let start = std::time::Instant::now();
    let e = render(source).unwrap_err();
    assert!(
        matches!(e, ChatTemplateError::OutOfFuel { fuel: 2_000_000 }),
        "{e}"
    );
    assert!(start.elapsed() < std::time::Duration::from_secs(10));
}

#[test]
fn unbounded_recursion_stops_at_the_limit() {
    let source = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
    let e = render(source).unwrap_err();
    assert!(
        matches!(&e, ChatTemplateError::Render { message } if message.contains("recursion")),
        "{e}"
    );
}

#[test]
fn huge_output_is_cut_off() {
    let source = "{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}";
    let e = render(source).unwrap_err();
    assert!(
        matches!(e, ChatTemplateError::OutputTooLarge { limit } if limit == 8 << 20),
        "{e}"
    );
    let small = ChatLimits {
        max_output_bytes: 4,
        ..ChatLimits::default()
    };
    let t = ChatTemplate::new("{{ 'abcde' }}", "", "").with_limits(small);
    assert!(matches!(
        t.render(&[], true),
        Err(ChatTemplateError::OutputTooLarge { limit: 4 })
    ));
    let t = ChatTemplate::new("{{ 'abcd' }}", "", "").with_limits(small);
    assert_eq!(t.render(&[], true).unwrap(), "abcd");
}

#[test]
fn syntax_errors_and_undefined_calls_are_errors() {
    assert!(matches!(
        render("{% for %}"),
        Err(ChatTemplateError::Syntax { .. })
    ));
    assert!(matches!(
        render("{{ open('/etc/passwd') }}"),
        Err(ChatTemplateError::Render { .. })
    ));
}

#[test]
fn strftime_now_renders_todays_date() {
    let out = render("{{ strftime_now('%Y-%m-%d') }}").unwrap();
    let parts: Vec<&str> = out.split('-').collect();
    assert_eq!(parts.len(), 3, "{out}");
    assert!(parts[0].parse::<i32>().unwrap() >= 2024, "{out}");
    assert!(matches!(
        render("{{ strftime_now('%Q') }}"),
        Err(ChatTemplateError::Render { .. })
    ));
}

#[test]
fn format_utc_matches_python_strftime() {
    let format = "%Y-%m-%d %H:%M:%S %a %A %b %B %j %y %I %p %e %%";
    // Expected strings from Python's datetime.strftime in UTC.
    let cases = [
        (
            0,
            "1970-01-01 00:00:00 Thu Thursday Jan January 001 70 12 AM  1 %",
        ),
        (
            951_829_261,
            "2000-02-29 13:01:01 Tue Tuesday Feb February 060 00 01 PM 29 %",
        ),
        (
            -3_153_600_001,
            "1870-01-24 23:59:59 Mon Monday Jan January 024 70 11 PM 24 %",
        ),
        (
            1_767_225_599,
            "2025-12-31 23:59:59 Wed Wednesday Dec December 365 25 11 PM 31 %",
        ),
        (
            4_102_444_800,
            "2100-01-01 00:00:00 Fri Friday Jan January 001 00 12 AM  1 %",
        ),
    ];
    for (seconds, expected) in cases {
        assert_eq!(format_utc(seconds, format).unwrap(), expected);
    }
    assert!(format_utc(0, "100%").is_err());
}

#[test]
fn civil_dates_round_trip() {
    for days in (-800_000..800_000).step_by(97) {
        let (y, m, d) = civil_from_days(days);
        assert!((1..=12).contains(&m) && (1..=31).contains(&d));
        assert_eq!(days_from_civil(y, m, d), days);
    }
}

/// A conversation whose assistant turn carries its reasoning, as Qwen 3 writes it.
fn reasoning_conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "Be brief."),
        ChatMessage::user("Hi"),
        ChatMessage::new("assistant", "<think>\nhm\n</think>\n\nHello!"),
        ChatMessage::user("Why?"),
    ]
}

#[test]
fn qwen3_template_renders_with_its_reasoning_rules() {
    // Qwen3-0.6B's own template: reversed slices, namespaces, `split`, `lstrip`; the
    // reasoning of turns before the last question is dropped, that of the last answer
    // kept.
    let source = include_str!("../tests/data/chat_templates/qwen3.jinja");
    let t = ChatTemplate::new(source, "", "<|im_end|>");
    let messages = reasoning_conversation();
    assert_eq!(
        t.render(&messages, true).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    assert_eq!(
        t.render(&messages[..3], false).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\n<think>\nhm\n</think>\n\nHello!<|im_end|>\n"
    );
}

#[test]
fn gemma2_template_renders_and_refuses_a_system_turn() {
    // Gemma 2 2B's own template: `raise_exception` for a system message, `trim` filters,
    // `loop.index0` for the alternation check.
    let source = include_str!("../tests/data/chat_templates/gemma2.jinja");
    let t = ChatTemplate::new(source, "<bos>", "<eos>");
    let messages = reasoning_conversation();
    assert_eq!(
        t.render(&messages[1..], true).unwrap(),
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n<think>\nhm\n</think>\n\n\
         Hello!<end_of_turn>\n<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n"
    );
    assert!(matches!(
        t.render(&messages, true),
        Err(ChatTemplateError::Raised { message }) if message == "System role not supported"
    ));
}

#[test]
fn phi3_template_and_the_built_in_phi3_turns_agree() {
    // Phi-3.5-mini's own template, and the built-in turns for `phi3` files without one.
    let source = include_str!("../tests/data/chat_templates/phi3.jinja");
    let own = ChatTemplate::new(source, "<s>", "<|endoftext|>");
    let tokens = [
        "<unk>",
        "<s>",
        "</s>",
        "<|user|>",
        "<|assistant|>",
        "<|end|>",
    ];
    let built_in = ChatTemplate::from_metadata(&metadata("phi3", &tokens, None)).unwrap();
    assert_eq!(built_in.built_in_name(), Some("Phi-3"));
    let messages = reasoning_conversation();
    let expected = "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n\
                    <think>\nhm\n</think>\n\nHello!<|end|>\n<|user|>\nWhy?<|end|>\n<|assistant|>\n";
    assert_eq!(own.render(&messages, true).unwrap(), expected);
    assert_eq!(built_in.render(&messages, true).unwrap(), expected);
}

#[test]
fn tools_and_tool_fields_reach_the_template_only_when_given() {
    let source = "{{ tools is defined }}|{% for t in tools or [] %}{{ t.function.name }} {{ t.function.parameters | tojson }};{% endfor %}|\
                  {% for m in messages %}{{ m.role }}:{{ m.content }}:{{ m.tool_call_id is defined }}:{{ m.name is defined }}\
                  {% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %};{% endfor %}";
    let t = ChatTemplate::new(source, "", "");
    // Plain messages and no tools: no tools variable, no tool fields.
    let plain = t.render(&[ChatMessage::user("hi")], false).unwrap();
    assert_eq!(plain, "False||user:hi:False:False;");
    let tools = [
        serde_json::json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}),
    ];
    let mut call = ChatMessage::new("assistant", "");
    call.tool_calls = Some(serde_json::json!([{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]));
    let mut result = ChatMessage::new("tool", "12 degrees");
    result.tool_call_id = Some("call_1".into());
    result.name = Some("get_weather".into());
    let text = t
        .render_with_tools(
            &[ChatMessage::user("hi"), call, result],
            Some(&tools),
            false,
        )
        .unwrap();
    assert_eq!(
        text,
        "True|get_weather {\"properties\": {\"city\": {\"type\": \"string\"}}, \"type\": \"object\"};|\
         user:hi:False:False;assistant::False:False[call_1 get_weather Oslo];tool:12 degrees:True:True;"
    );
}
