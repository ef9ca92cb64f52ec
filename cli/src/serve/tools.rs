//! OpenAI tool calls: the request's `tools`, `tool_choice` and `parallel_tool_calls`
//! read and checked, the call syntax of the model's chat template, the Lark grammar that
//! holds the output to calls when a call is required, and the parser that turns the
//! output back into OpenAI's `tool_calls`, piece by piece as it streams.
//!
//! Three syntaxes are read, picked from the template's text:
//! - Hermes (Qwen, Hermes, and templates that render `tools` with no syntax of their
//!   own): `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one block per call;
//! - Llama 3: the whole message is `{"name": …, "parameters": {…}}`, optionally after
//!   `<|python_tag|>`;
//! - Mistral: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`.
//!
//! Each also takes a whole message that is a bare call object (or a list of them), as a
//! model whose markers are control tokens (which the text leaves out) writes it.

use model::chat::ChatMessage;
use model::chat::ChatTemplate;
use model::constraint::{ConstraintSpec, Grammars};
use serde_json::{json, Value};

use super::api::ApiError;

/// Most tools a request may offer.
pub const MAX_TOOLS: usize = 128;
/// Largest `parameters` schema of one tool, as JSON text.
pub const MAX_SCHEMA_BYTES: usize = 64 << 10;
/// Most calls one answer (or one history message) may hold.
pub const MAX_CALLS: usize = 16;

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_MARK: &str = "[TOOL_CALLS]";

/// How a model writes its calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolSyntax {
    Hermes,
    Llama3,
    Mistral,
}

impl ToolSyntax {
    /// The syntax a chat template's text shows, if any.
    pub fn from_template_text(source: &str) -> Option<ToolSyntax> {
        if source.contains(HERMES_OPEN) {
            Some(ToolSyntax::Hermes)
        } else if source.contains(MISTRAL_MARK) {
            Some(ToolSyntax::Mistral)
        } else if source.contains(PYTHON_TAG)
            || (source.contains("<|start_header_id|>") && source.contains("\"parameters\""))
        {
            Some(ToolSyntax::Llama3)
        } else {
            None
        }
    }

    /// The syntax of `template`: the one its text shows, else Hermes when it renders
    /// `tools` at all; why not, when it does neither.
    pub fn of_template(template: &ChatTemplate) -> Result<ToolSyntax, String> {
        if let Some(syntax) = ToolSyntax::from_template_text(template.source()) {
            return Ok(syntax);
        }
        let probe = "rocmforge_probe_tool";
        let tool = json!({"type": "function", "function": {"name": probe,
            "description": "", "parameters": {"type": "object", "properties": {}}}});
        let rendered = template.render_with_tools(&[ChatMessage::user("hi")], Some(&[tool]), true);
        if rendered.is_ok_and(|text| text.contains(probe)) {
            return Ok(ToolSyntax::Hermes);
        }
        Err(
            "the model's chat template does not render `tools` and shows no tool-call syntax \
             this server reads (Hermes <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS]); \
             start the server with --chat-template-file giving a template that does"
                .to_owned(),
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolSyntax::Hermes => "Hermes",
            ToolSyntax::Llama3 => "Llama 3",
            ToolSyntax::Mistral => "Mistral",
        }
    }
}

/// What `tool_choice` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The model calls tools or answers, as it likes; the output is parsed after.
    Auto,
    /// No call: the tools are not shown to the template and nothing is parsed.
    None,
    /// At least one call, to any of the tools.
    Required,
    /// One call to this tool.
    Named(String),
}

/// The tools of a request, checked.
#[derive(Clone, Debug)]
pub struct ToolRequest {
    /// The tool objects as the template gets them (`parameters` filled in).
    pub tools: Vec<Value>,
    /// Each tool's name and parameters schema, in order.
    pub defs: Vec<(String, Value)>,
    pub choice: Choice,
    /// Whether several calls may come in one answer.
    pub parallel: bool,
}

fn bad(field: &'static str, message: String) -> ApiError {
    ApiError::bad(format!("{field}: {message}")).param(field)
}

/// A function name as OpenAI allows it: letters, digits, `_` and `-`, 1 to 64 of them.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`: `None` when no tools are
/// given (and `tool_choice` asks for none), else the checked request. Anything
/// malformed is a 400 naming its field.
pub fn read(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel: Option<&Value>,
) -> Result<Option<ToolRequest>, ApiError> {
    let parallel = match parallel {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(bad(
                "parallel_tool_calls",
                format!("must be a boolean, got {other}"),
            ))
        }
    };
    let list = match tools {
        None | Some(Value::Null) => &[][..],
        Some(Value::Array(list)) => list.as_slice(),
        Some(other) => return Err(bad("tools", format!("must be a list, got {other}"))),
    };
    if list.len() > MAX_TOOLS {
        return Err(bad(
            "tools",
            format!("at most {MAX_TOOLS} tools, got {}", list.len()),
        ));
    }
    let mut defs: Vec<(String, Value)> = Vec::with_capacity(list.len());
    let mut offered = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let (name, parameters, object) = read_tool(i, tool)?;
        if defs.iter().any(|(n, _)| *n == name) {
            return Err(bad("tools", format!("tool {name:?} is given twice")));
        }
        offered.push(object);
        defs.push((name, parameters));
    }
    let choice = match tool_choice {
        None | Some(Value::Null) => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Choice::Auto,
            "none" => Choice::None,
            "required" => Choice::Required,
            other => {
                return Err(bad(
                    "tool_choice",
                    format!(
                        "must be \"auto\", \"none\", \"required\" or a function, got {other:?}"
                    ),
                ))
            }
        },
        Some(object @ Value::Object(_)) => {
            let name = match (
                object.get("type").and_then(Value::as_str),
                object.pointer("/function/name").and_then(Value::as_str),
            ) {
                (Some("function"), Some(name)) => name,
                _ => {
                    return Err(bad(
                        "tool_choice",
                        format!(
                            "an object must be {{\"type\": \"function\", \"function\": \
                             {{\"name\": …}}}}, got {object}"
                        ),
                    ))
                }
            };
            if !defs.iter().any(|(n, _)| n == name) {
                let known: Vec<&str> = defs.iter().map(|(n, _)| n.as_str()).collect();
                return Err(bad(
                    "tool_choice",
                    format!("names the function {name:?}, which is not in tools {known:?}"),
                ));
            }
            Choice::Named(name.to_owned())
        }
        Some(other) => {
            return Err(bad(
                "tool_choice",
                format!("must be a string or an object, got {other}"),
            ))
        }
    };
    if defs.is_empty() {
        return match choice {
            Choice::Auto | Choice::None => Ok(None),
            _ => Err(bad(
                "tool_choice",
                "asks for a call but no tools are given".into(),
            )),
        };
    }
    Ok(Some(ToolRequest {
        tools: offered,
        defs,
        choice,
        parallel,
    }))
}

/// One entry of `tools`: its name, parameters schema, and the object the template gets.
fn read_tool(i: usize, tool: &Value) -> Result<(String, Value, Value), ApiError> {
    let fail = |what: String| Err(bad("tools", format!("tools[{i}]: {what}")));
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return fail(format!("type must be \"function\", got {tool}"));
    }
    let Some(function) = tool.get("function").and_then(Value::as_object) else {
        return fail("needs a function object".into());
    };
    let name = match function.get("name") {
        Some(Value::String(name)) if valid_name(name) => name.clone(),
        Some(other) => {
            return fail(format!(
                "function.name must be 1 to 64 letters, digits, _ or -, got {other}"
            ))
        }
        None => return fail("function.name is required".into()),
    };
    if !matches!(
        function.get("description"),
        None | Some(Value::Null | Value::String(_))
    ) {
        return fail(format!("function {name:?}: description must be a string"));
    }
    if !matches!(
        function.get("strict"),
        None | Some(Value::Null | Value::Bool(_))
    ) {
        return fail(format!("function {name:?}: strict must be a boolean"));
    }
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(other) => {
            return fail(format!(
                "function {name:?}: parameters must be a JSON schema object, got {other}"
            ))
        }
    };
    if parameters.to_string().len() > MAX_SCHEMA_BYTES {
        return fail(format!(
            "function {name:?}: parameters is larger than {MAX_SCHEMA_BYTES} bytes"
        ));
    }
    let mut object = tool.clone();
    object["function"]["parameters"] = parameters.clone();
    Ok((name, parameters, object))
}

impl ToolRequest {
    /// Whether the output is held to calls.
    pub fn enforced(&self) -> bool {
        matches!(self.choice, Choice::Required | Choice::Named(_))
    }

    /// The tools a call may name.
    fn allowed(&self) -> impl Iterator<Item = &(String, Value)> {
        self.defs
            .iter()
            .filter(move |(name, _)| match &self.choice {
                Choice::Named(only) => name == only,
                _ => true,
            })
    }

    /// A 400 naming `tools` for the first tool whose parameters schema does not compile.
    pub fn check_schemas(&self, grammars: &Grammars) -> Result<(), ApiError> {
        for (name, schema) in &self.defs {
            if let Err(e) = grammars.compile(&ConstraintSpec::JsonSchema(schema.clone())) {
                return Err(bad(
                    "tools",
                    format!("function {name:?}: parameters is not a usable JSON schema: {e}"),
                ));
            }
        }
        Ok(())
    }

    /// The Lark grammar of the calls this request requires in `syntax` (`None` unless
    /// the choice is `required` or a named function): one call, or with
    /// `parallel_tool_calls` up to [`MAX_CALLS`], each naming an allowed tool with
    /// arguments of its schema. `special` gives the id of a marker that is a control
    /// token of the vocabulary (the grammar then asks for that token).
    pub fn grammar(
        &self,
        syntax: ToolSyntax,
        special: &dyn Fn(&str) -> Option<u32>,
    ) -> Option<String> {
        if !self.enforced() {
            return None;
        }
        let marker = |text: &str| match special(text) {
            Some(id) => format!("<[{id}]>"),
            None => lark_string(text),
        };
        let args_key = if syntax == ToolSyntax::Llama3 {
            "parameters"
        } else {
            "arguments"
        };
        let mut rules = String::new();
        let mut bodies = Vec::new();
        for (i, (name, schema)) in self.allowed().enumerate() {
            let head = format!("{{\"name\": \"{name}\", \"{args_key}\": ");
            rules.push_str(&format!(
                "c{i}: {} a{i} \"}}\"\na{i}: %json {}\n",
                lark_string(&head),
                compact_schema(schema)
            ));
            bodies.push(format!("c{i}"));
        }
        rules.push_str(&format!("body: {}\n", bodies.join(" | ")));
        // With parallel calls, up to MAX_CALLS - 1 more after the first.
        let more = if self.parallel {
            format!(" more{{0,{}}}", MAX_CALLS - 1)
        } else {
            String::new()
        };
        let start = match syntax {
            ToolSyntax::Hermes => format!(
                "start: call{more}\nmore: \"\\n\" call\ncall: {} \"\\n\" body \"\\n\" {}\n",
                marker(HERMES_OPEN),
                marker(HERMES_CLOSE)
            ),
            // Llama 3's templates ask for one JSON call per message.
            ToolSyntax::Llama3 => "start: body\n".to_owned(),
            ToolSyntax::Mistral => format!(
                "start: {} \"[\" body{more} \"]\"\nmore: \", \" body\n",
                marker(MISTRAL_MARK)
            ),
        };
        Some(start + &rules)
    }
}

/// `text` as a Lark string literal (JSON's escapes, which Lark reads).
fn lark_string(text: &str) -> String {
    Value::from(text).to_string()
}

/// A schema whose JSON is written without optional whitespace, unless it says how.
fn compact_schema(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Some(map) = schema.as_object_mut() {
        map.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false}));
    }
    schema
}

/// An assistant message's `tool_calls` from the history, as the template gets them:
/// each `function.arguments` JSON string parsed into its object (as transformers'
/// templates expect), anything else kept as sent.
pub fn history_calls(index: usize, calls: &Value) -> Result<Value, ApiError> {
    let fail = |what: &str| {
        Err(bad(
            "messages",
            format!("messages[{index}].tool_calls: {what}"),
        ))
    };
    let Value::Array(list) = calls else {
        return fail("must be a list");
    };
    if list.len() > MAX_CALLS {
        return fail(&format!("at most {MAX_CALLS} calls"));
    }
    let mut out = Vec::with_capacity(list.len());
    for call in list {
        let mut call = call.clone();
        if call
            .pointer("/function/name")
            .and_then(Value::as_str)
            .is_none()
        {
            return fail("each call needs function.name");
        }
        let parsed = match call.pointer("/function/arguments") {
            Some(Value::String(text)) => serde_json::from_str::<Value>(text).ok(),
            _ => None,
        };
        if let Some(arguments) = parsed {
            call["function"]["arguments"] = arguments;
        }
        out.push(call);
    }
    Ok(Value::Array(out))
}

/// One call parsed from the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as a JSON text.
    pub arguments: String,
}

impl ToolCall {
    /// The call as a response's `message.tool_calls` lists it.
    pub fn to_json(&self) -> Value {
        json!({"id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// What the parser hands out: text that is no call, or a whole call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Call { index: usize, call: ToolCall },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: the message may still be a bare call.
    Start,
    /// Text, watched for a call's opening marker.
    Text,
    /// Inside a Hermes `<tool_call>` block.
    InCall,
    /// The message looks like calls as a whole: held to the end.
    Whole,
}

/// Turns output text into text and calls as it arrives. Text that may be the start of
/// a call is held back until it is known not to be one; whitespace between calls is
/// dropped.
pub struct CallParser {
    syntax: ToolSyntax,
    names: Vec<String>,
    state: State,
    held: String,
    pending_space: String,
    calls: usize,
    out: Vec<Piece>,
}

impl CallParser {
    pub fn new(syntax: ToolSyntax, names: Vec<String>) -> CallParser {
        CallParser {
            syntax,
            names,
            state: State::Start,
            held: String::new(),
            pending_space: String::new(),
            calls: 0,
            out: Vec::new(),
        }
    }

    /// The parser for `request`'s tools.
    pub fn for_request(syntax: ToolSyntax, request: &ToolRequest) -> CallParser {
        CallParser::new(
            syntax,
            request.defs.iter().map(|(n, _)| n.clone()).collect(),
        )
    }

    /// How many calls have been handed out.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Takes the next piece of output; returns what is known to be text or calls.
    pub fn push(&mut self, piece: &str) -> Vec<Piece> {
        self.held.push_str(piece);
        self.advance(false);
        std::mem::take(&mut self.out)
    }

    /// The output has ended: everything still held, as text or calls.
    pub fn finish(&mut self) -> Vec<Piece> {
        self.advance(true);
        if self.calls == 0 && !self.pending_space.is_empty() {
            let space = std::mem::take(&mut self.pending_space);
            self.out.push(Piece::Text(space));
        }
        std::mem::take(&mut self.out)
    }

    /// Hands out text, holding its trailing whitespace until more text follows (it is
    /// dropped when a call follows, or ends an answer that has calls).
    fn text(&mut self, text: &str) {
        let body = text.trim_end().len();
        if body > 0 {
            let mut all = std::mem::take(&mut self.pending_space);
            all.push_str(&text[..body]);
            match self.out.last_mut() {
                Some(Piece::Text(last)) => last.push_str(&all),
                _ => self.out.push(Piece::Text(all)),
            }
        }
        self.pending_space.push_str(&text[body..]);
    }

    fn call(&mut self, name: String, arguments: String) {
        self.pending_space.clear();
        let call = ToolCall {
            id: new_call_id(self.syntax),
            name,
            arguments,
        };
        self.out.push(Piece::Call {
            index: self.calls,
            call,
        });
        self.calls += 1;
    }

    /// Whether a message starting with `t` (no leading whitespace) is a bare call.
    fn starts_whole(&self, t: &str) -> bool {
        match self.syntax {
            ToolSyntax::Hermes => t.starts_with('{'),
            ToolSyntax::Llama3 => t.starts_with('{') || t.starts_with(PYTHON_TAG),
            ToolSyntax::Mistral => t.starts_with('[') || t.starts_with('{'),
        }
    }

    fn advance(&mut self, end: bool) {
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if t.is_empty() {
                        if end {
                            let held = std::mem::take(&mut self.held);
                            self.text(&held);
                        }
                        return;
                    }
                    if self.starts_whole(t) {
                        self.state = State::Whole;
                        continue;
                    }
                    if !end && self.syntax == ToolSyntax::Llama3 && PYTHON_TAG.starts_with(t) {
                        return;
                    }
                    self.state = State::Text;
                }
                State::Text => {
                    if self.syntax == ToolSyntax::Hermes && self.calls < MAX_CALLS {
                        if let Some(at) = self.held.find(HERMES_OPEN) {
                            let rest = self.held.split_off(at);
                            let before = std::mem::replace(&mut self.held, rest);
                            self.text(&before);
                            self.held.drain(..HERMES_OPEN.len());
                            self.state = State::InCall;
                            continue;
                        }
                        if !end {
                            let keep = partial_marker_len(&self.held, HERMES_OPEN);
                            let rest = self.held.split_off(self.held.len() - keep);
                            let before = std::mem::replace(&mut self.held, rest);
                            self.text(&before);
                            return;
                        }
                    }
                    let held = std::mem::take(&mut self.held);
                    self.text(&held);
                    return;
                }
                State::InCall => {
                    let (body, rest, closed) = match self.held.find(HERMES_CLOSE) {
                        Some(at) => (
                            self.held[..at].to_owned(),
                            self.held[at + HERMES_CLOSE.len()..].to_owned(),
                            true,
                        ),
                        None if end => (std::mem::take(&mut self.held), String::new(), false),
                        None => return,
                    };
                    self.held = rest;
                    match serde_json::from_str::<Value>(body.trim())
                        .ok()
                        .and_then(|v| self.read_call(&v))
                    {
                        Some((name, arguments)) => self.call(name, arguments),
                        None => {
                            let close = if closed { HERMES_CLOSE } else { "" };
                            self.text(&format!("{HERMES_OPEN}{body}{close}"));
                        }
                    }
                    self.state = State::Text;
                }
                State::Whole => {
                    if !end {
                        return;
                    }
                    let held = std::mem::take(&mut self.held);
                    match self.read_whole(&held) {
                        Some(calls) => {
                            for (name, arguments) in calls {
                                self.call(name, arguments);
                            }
                        }
                        None => self.text(&held),
                    }
                    return;
                }
            }
        }
    }

    /// A whole message as calls: after an optional marker, one or more JSON values in
    /// a row, each a call object or a list of them; `None` unless every one is a call
    /// to a known tool.
    fn read_whole(&self, text: &str) -> Option<Vec<(String, String)>> {
        let t = text.trim_start();
        let t = t
            .strip_prefix(PYTHON_TAG)
            .or_else(|| t.strip_prefix(MISTRAL_MARK))
            .unwrap_or(t)
            .trim();
        let mut calls = Vec::new();
        for value in serde_json::Deserializer::from_str(t).into_iter::<Value>() {
            let value = value.ok()?;
            let items = match &value {
                Value::Array(items) => items.iter().collect(),
                other => vec![other],
            };
            for item in items {
                if calls.len() == MAX_CALLS {
                    return None;
                }
                calls.push(self.read_call(item)?);
            }
        }
        (!calls.is_empty()).then_some(calls)
    }

    /// A call object's tool name (one of the tools) and arguments as JSON text: the
    /// object of `arguments` (or Llama's `parameters`), or a string holding one.
    fn read_call(&self, value: &Value) -> Option<(String, String)> {
        let name = value.get("name")?.as_str()?;
        if !self.names.iter().any(|n| n == name) {
            return None;
        }
        let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
            None | Some(Value::Null) => "{}".to_owned(),
            Some(object @ Value::Object(_)) => object.to_string(),
            Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
                Ok(Value::Object(_)) => text.clone(),
                _ => return None,
            },
            Some(_) => return None,
        };
        Some((name.to_owned(), arguments))
    }
}

/// The length of the longest end of `text` that begins `marker` (and is shorter).
fn partial_marker_len(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&n| {
            text.len() >= n
                && text.is_char_boundary(text.len() - n)
                && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// A fresh call id: `call_` and 24 letters and digits; for Mistral, 9 letters and
/// digits, the only ids its templates accept back in the history.
fn new_call_id(syntax: ToolSyntax) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = model::sampling::Xoshiro256::seed_from_u64(super::api::random_seed());
    let (prefix, n) = match syntax {
        ToolSyntax::Mistral => ("", 9),
        _ => ("call_", 24),
    };
    let id: String = (0..n)
        .map(|_| char::from(ALPHABET[(rng.next_u64() % ALPHABET.len() as u64) as usize]))
        .collect();
    format!("{prefix}{id}")
}

#[cfg(test)]
#[path = "tools_tests.rs"]
mod tests;
