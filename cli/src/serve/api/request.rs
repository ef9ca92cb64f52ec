//! A completion request's body: its fields as OpenAI sends them, the checks that refuse
//! what the server cannot do, and the scheduler's settings they become.

use std::collections::BTreeMap;

use model::constraint::{Constraint, ConstraintSpec};
use model::logprobs::MAX_TOP_LOGPROBS;
use model::sampling::{defaults, SamplingParams};
use serde::Deserialize;
use serde_json::Value;

use crate::serve::format::{constraint_spec, FormatFields};
use crate::serve::tools::{self, Choice, ToolRequest, ToolSyntax};
use crate::serve::{AppState, Loaded};

use super::completion::Kind;
use super::{random_seed, ApiError};

/// `stop` as OpenAI accepts it: one string or several.
#[derive(Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The sampling and limit fields both endpoints take.
#[derive(Deserialize)]
pub(super) struct Common {
    model: Option<String>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<StopField>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repeat_penalty: Option<f32>,
    repeat_last_n: Option<usize>,
    logit_bias: Option<BTreeMap<String, f32>>,
    /// Never end at an end-of-generation token (benchmarks: a fixed number of tokens).
    #[serde(default)]
    ignore_eos: bool,
    n: Option<u32>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    /// What the output must be: text, a JSON object, JSON of a schema
    /// ([`super::format`]).
    response_format: Option<Value>,
    /// llama.cpp's extensions: a Lark grammar, or a regular expression, the output must
    /// match as a whole.
    grammar: Option<Value>,
    regex: Option<Value>,
    /// Tool calls ([`crate::serve::tools`]), taken by the chat endpoint only.
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<Value>,
    /// Log-probabilities ([`logprobs_setting`]): `true` and `top_logprobs` for chat, a
    /// count for text completions.
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
    echo: Option<Value>,
    /// OpenAI fields this server does not honour. They are read so that a request that
    /// sets them is refused naming them ([`refuse_unsupported`]): an agent that asks for
    /// a function call must not get prose it takes for the one it asked for.
    functions: Option<Value>,
    function_call: Option<Value>,
    audio: Option<Value>,
    modalities: Option<Value>,
}

/// A 400 naming each field of `common` set to what this endpoint cannot do: tool calls
/// unless `tools_taken` (the chat endpoint reads them itself), legacy function calls,
/// audio. Values that ask for nothing (`tool_choice` `"none"`,
/// empty lists, `null`) pass.
pub(super) fn refuse_unsupported(common: &Common, tools_taken: bool) -> Result<(), ApiError> {
    let asks = |value: &Option<Value>| match value {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Array(items)) => !items.is_empty(),
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(_) => true,
    };
    let tool_choice_none = common.tool_choice.as_ref().and_then(Value::as_str) == Some("none");
    let no_tools = "tool calls are taken by /v1/chat/completions only";
    let refusals: [(&'static str, bool, &str); 7] = [
        ("tools", !tools_taken && asks(&common.tools), no_tools),
        (
            "tool_choice",
            !tools_taken && asks(&common.tool_choice) && !tool_choice_none,
            no_tools,
        ),
        (
            "parallel_tool_calls",
            !tools_taken
                && matches!(common.parallel_tool_calls, Some(Value::Bool(true)))
                && asks(&common.tools),
            no_tools,
        ),
        (
            "functions",
            asks(&common.functions),
            "legacy function calls are not supported by this server: use tools",
        ),
        (
            "function_call",
            asks(&common.function_call)
                && common.function_call.as_ref().and_then(Value::as_str) != Some("none"),
            "legacy function calls are not supported by this server: use tool_choice",
        ),
        (
            "audio",
            asks(&common.audio),
            "audio output is not supported by this server",
        ),
        (
            "modalities",
            common
                .modalities
                .as_ref()
                .and_then(Value::as_array)
                .is_some_and(|m| m.iter().any(|x| x.as_str() != Some("text"))),
            "only text output is supported by this server",
        ),
    ];
    match refusals.into_iter().find(|&(_, refused, _)| refused) {
        Some((field, _, why)) => Err(ApiError::bad(format!("{field}: {why}")).param(field)),
        None => Ok(()),
    }
}

/// How many of the most likely tokens each generated token lists, when the request asks
/// for log-probabilities (`None` when it does not): chat takes `logprobs` `true` and
/// `top_logprobs` 0 to [`MAX_TOP_LOGPROBS`] (which needs `logprobs` `true`); text
/// completions take `logprobs` as that count (OpenAI allows 5, this server
/// [`MAX_TOP_LOGPROBS`]), and not with `echo` (no log-probabilities of the prompt).
/// Anything else is a 400 naming the field.
pub(super) fn logprobs_setting(common: &Common, kind: Kind) -> Result<Option<usize>, ApiError> {
    let bad = |field: &'static str, why: String| {
        Err(ApiError::bad(format!("{field}: {why}")).param(field))
    };
    let count = |field: &'static str, value: &Value| -> Result<usize, ApiError> {
        match value.as_u64() {
            Some(n) if n <= MAX_TOP_LOGPROBS as u64 => Ok(n as usize),
            _ => Err(ApiError::bad(format!(
                "{field} must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {value}"
            ))
            .param(field)),
        }
    };
    let logprobs = common.logprobs.as_ref().filter(|v| !v.is_null());
    let top = common.top_logprobs.as_ref().filter(|v| !v.is_null());
    match kind {
        Kind::Chat => {
            let wanted = match logprobs {
                None | Some(Value::Bool(false)) => false,
                Some(Value::Bool(true)) => true,
                Some(other) => {
                    return bad("logprobs", format!("must be true or false, got {other}"))
                }
            };
            match (wanted, top) {
                (false, None) => Ok(None),
                (false, Some(_)) => bad("top_logprobs", "needs logprobs set to true".to_owned()),
                (true, None) => Ok(Some(0)),
                (true, Some(top)) => count("top_logprobs", top).map(Some),
            }
        }
        Kind::Text => {
            if top.is_some() {
                return bad(
                    "top_logprobs",
                    "is a chat field: /v1/completions takes logprobs as the count".to_owned(),
                );
            }
            let Some(value) = logprobs else {
                return Ok(None);
            };
            let n = count("logprobs", value)?;
            if matches!(common.echo, Some(Value::Bool(true))) {
                return bad(
                    "echo",
                    "log-probabilities of the prompt are not supported by this server".to_owned(),
                );
            }
            Ok(Some(n))
        }
    }
}

/// Message content: a string or a list of text parts.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
pub(super) struct ContentPart {
    #[serde(rename = "type")]
    pub(super) kind: String,
    pub(super) text: Option<String>,
}

#[derive(Deserialize)]
pub(super) struct Message {
    pub(super) role: String,
    pub(super) content: Option<Content>,
    /// An assistant's calls, in the history.
    pub(super) tool_calls: Option<Value>,
    /// The call a `tool` message answers.
    pub(super) tool_call_id: Option<String>,
    pub(super) name: Option<String>,
}

/// The fields of a body that no field of ours takes, by name: ignored, as OpenAI's
/// clients expect of a compatible server, but counted ([`AppState::note_unknown_fields`]).
pub(super) type Unknown = BTreeMap<String, serde::de::IgnoredAny>;

#[derive(Deserialize)]
pub(super) struct ChatBody {
    pub(super) messages: Vec<Message>,
    #[serde(flatten)]
    pub(super) common: Common,
    /// After `common`, which takes its own fields first.
    #[serde(flatten)]
    pub(super) unknown: Unknown,
}

/// What a completion's `prompt` or an embeddings request's `input` holds, read by
/// [`read_inputs`]: texts to tokenize, or token ids, one list per input.
#[derive(Debug, PartialEq)]
pub(super) enum Inputs {
    Texts(Vec<String>),
    Tokens(Vec<Vec<u32>>),
}

impl Inputs {
    pub(super) fn len(&self) -> usize {
        match self {
            Inputs::Texts(texts) => texts.len(),
            Inputs::Tokens(lists) => lists.len(),
        }
    }
}

/// Reads `value`, the request's `field`, as OpenAI gives prompts and embeddings inputs:
/// a string, a list of strings, a list of token ids (one input) or a list of lists of
/// token ids, at most `limit` inputs. Anything else, an empty list or one of more than
/// `limit` is a 400 naming the field; so is a token id that is not a `u32`. An empty
/// input (`""`, `[[]]`) passes: whether it is empty once tokenized is the caller's.
pub(super) fn read_inputs(
    value: &Value,
    field: &'static str,
    limit: usize,
) -> Result<Inputs, ApiError> {
    let bad = |why: String| Err(ApiError::bad(format!("{field}: {why}")).param(field));
    let shape = "must be a string, a list of strings, a list of token ids or a list of lists \
                 of token ids";
    let ids = |items: &[Value]| -> Option<Vec<u32>> {
        items
            .iter()
            .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect()
    };
    let items = match value {
        Value::String(text) => return Ok(Inputs::Texts(vec![text.clone()])),
        Value::Array(items) => items,
        other => return bad(format!("{shape}, got {}", kind_of(other))),
    };
    if items.is_empty() {
        return bad("must not be an empty list".to_owned());
    }
    if items.iter().all(Value::is_number) {
        return match ids(items) {
            Some(ids) => Ok(Inputs::Tokens(vec![ids])),
            None => bad("token ids must be integers from 0 to 4294967295".to_owned()),
        };
    }
    if items.len() > limit {
        return bad(format!("at most {limit} inputs, got {}", items.len()));
    }
    if items.iter().all(Value::is_string) {
        let texts = items.iter().filter_map(Value::as_str).map(str::to_owned);
        return Ok(Inputs::Texts(texts.collect()));
    }
    if items.iter().all(Value::is_array) {
        let mut lists = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let list = item.as_array().map_or(&[][..], Vec::as_slice);
            match ids(list) {
                Some(ids) => lists.push(ids),
                None => {
                    return bad(format!(
                        "item {i}: token ids must be integers from 0 to 4294967295"
                    ))
                }
            }
        }
        return Ok(Inputs::Tokens(lists));
    }
    bad(format!("{shape}, got a list of mixed or other values"))
}

/// The JSON type of `value`, for messages.
fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[derive(Deserialize)]
pub(super) struct CompletionBody {
    /// Read by [`read_inputs`].
    pub(super) prompt: Value,
    #[serde(flatten)]
    pub(super) common: Common,
    /// After `common`, which takes its own fields first.
    #[serde(flatten)]
    pub(super) unknown: Unknown,
}

/// Most stop strings, and their length, a request may give.
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 256;

/// Checks the common fields and builds the scheduler's request (without prompt and
/// events yet).
/// The name a response gives for a request's `model`: the request's own when it is the
/// file's stem or an alias; the file's stem when it names nothing (or another model,
/// which the loaded model serves unless `strict`, when that is a 400 listing the names).
pub(super) fn model_name(
    requested: Option<&str>,
    model_id: &str,
    aliases: &[String],
    strict: bool,
) -> Result<String, ApiError> {
    match requested {
        None | Some("") => Ok(model_id.to_owned()),
        Some(name) if name == model_id || aliases.iter().any(|a| a == name) => Ok(name.to_owned()),
        Some(name) if strict => {
            let known: Vec<&str> = std::iter::once(model_id)
                .chain(aliases.iter().map(String::as_str))
                .collect();
            Err(
                ApiError::bad(format!("unknown model {name:?}: this server has {known:?}"))
                    .param("model"),
            )
        }
        Some(_) => Ok(model_id.to_owned()),
    }
}

pub(super) fn prepare(
    common: &Common,
    state: &AppState,
    loaded: &Loaded,
    kind: Kind,
) -> Result<Prepared, ApiError> {
    refuse_unsupported(common, kind == Kind::Chat)?;
    let logprobs = logprobs_setting(common, kind)?;
    let model = model_name(
        common.model.as_deref(),
        &loaded.model_id,
        &state.aliases,
        state.strict_model_names,
    )?;
    if let Some(n) = common.n {
        if n != 1 {
            return Err(ApiError::bad(format!("n must be 1, got {n}")).param("n"));
        }
    }
    let seed = common.seed.unwrap_or_else(random_seed);
    let params = SamplingParams {
        temperature: common.temperature.unwrap_or(defaults::TEMPERATURE),
        top_k: common.top_k.unwrap_or(defaults::TOP_K),
        top_p: common.top_p.unwrap_or(defaults::TOP_P),
        min_p: common.min_p.unwrap_or(defaults::MIN_P),
        repeat_penalty: common.repeat_penalty.unwrap_or(defaults::REPEAT_PENALTY),
        repeat_last_n: common.repeat_last_n.unwrap_or(defaults::REPEAT_LAST_N),
        seed,
    };
    let sampling = params
        .validate()
        .map_err(|e| ApiError::bad(e.to_string()))?;
    let penalty = |value: Option<f32>, name: &'static str| -> Result<f32, ApiError> {
        let v = value.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&v) {
            return Err(ApiError::bad(format!("{name} must be in [-2, 2], got {v}")).param(name));
        }
        Ok(v)
    };
    let presence_penalty = penalty(common.presence_penalty, "presence_penalty")?;
    let frequency_penalty = penalty(common.frequency_penalty, "frequency_penalty")?;
    let mut logit_bias = Vec::new();
    for (key, &bias) in common.logit_bias.iter().flatten() {
        let token: u32 = key
            .parse()
            .ok()
            .filter(|&t: &u32| (t as usize) < loaded.n_vocab)
            .ok_or_else(|| {
                ApiError::bad(format!(
                    "logit_bias: {key:?} is not a token id of this model"
                ))
                .param("logit_bias")
            })?;
        if !(-100.0..=100.0).contains(&bias) {
            return Err(
                ApiError::bad(format!("logit_bias must be in [-100, 100], got {bias}"))
                    .param("logit_bias"),
            );
        }
        logit_bias.push((token, bias));
    }
    if common.ignore_eos {
        for &token in loaded.tokenizer.end_of_generation_tokens() {
            logit_bias.push((token, f32::NEG_INFINITY));
        }
    }
    let stop = match &common.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(v)) => v.clone(),
    };
    if stop.len() > MAX_STOPS || stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad(format!(
            "at most {MAX_STOPS} stop strings of at most {MAX_STOP_BYTES} bytes"
        ))
        .param("stop"));
    }
    let max_tokens = common.max_completion_tokens.or(common.max_tokens);
    let tools = match kind {
        Kind::Chat => tool_plan(common, loaded)?,
        Kind::Text => None,
    };
    let constraint = constraint(common, loaded, tools.as_ref())?;
    Ok(Prepared {
        tools,
        model,
        max_tokens,
        sampling,
        stop,
        presence_penalty,
        frequency_penalty,
        logit_bias,
        constraint,
        logprobs,
        stream: common.stream,
        include_usage: common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
    })
}

/// The tools a chat request offers, and how the model writes its calls.
pub(super) struct ToolPlan {
    pub(super) request: ToolRequest,
    pub(super) syntax: ToolSyntax,
}

pub(super) struct Prepared {
    /// The tools offered (none for `tool_choice` `"none"`).
    pub(super) tools: Option<ToolPlan>,
    /// The model's name in the responses.
    pub(super) model: String,
    pub(super) max_tokens: Option<usize>,
    pub(super) sampling: model::sampling::SamplingConfig,
    pub(super) stop: Vec<String>,
    pub(super) presence_penalty: f32,
    pub(super) frequency_penalty: f32,
    pub(super) logit_bias: Vec<(u32, f32)>,
    pub(super) constraint: Option<Constraint>,
    /// The count of top log-probabilities per token, when the request asks for them.
    pub(super) logprobs: Option<usize>,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
}

/// The tools of a chat request, checked: `None` without tools or with `tool_choice`
/// `"none"`; a 400 naming the field when they are malformed, a schema does not compile,
/// or the model's template has no way to offer them.
fn tool_plan(common: &Common, loaded: &Loaded) -> Result<Option<ToolPlan>, ApiError> {
    let Some(request) = tools::read(
        common.tools.as_ref(),
        common.tool_choice.as_ref(),
        common.parallel_tool_calls.as_ref(),
    )?
    else {
        return Ok(None);
    };
    if request.choice == Choice::None {
        return Ok(None);
    }
    let syntax = *loaded
        .tool_syntax
        .as_ref()
        .map_err(|why| ApiError::bad(format!("tools: {why}")).param("tools"))?;
    match &loaded.grammars {
        Ok(grammars) => request.check_schemas(grammars)?,
        Err(e) if request.enforced() => {
            return Err(ApiError::bad(format!(
                "tool_choice: this model cannot hold output to tool calls: {e}"
            ))
            .param("tool_choice"))
        }
        Err(_) => {}
    }
    Ok(Some(ToolPlan { request, syntax }))
}

/// The compiled constraint a request asks for (a format, or the calls a `tool_choice`
/// requires), or a 400 naming the field whose schema, grammar or expression does not
/// compile, or that asks for a second constraint.
fn constraint(
    common: &Common,
    loaded: &Loaded,
    tools: Option<&ToolPlan>,
) -> Result<Option<Constraint>, ApiError> {
    let fields = FormatFields {
        response_format: common.response_format.as_ref(),
        grammar: common.grammar.as_ref(),
        regex: common.regex.as_ref(),
    };
    let asked = constraint_spec(&fields)?;
    let enforced = tools.filter(|plan| plan.request.enforced());
    let (spec, field) = match (asked, enforced) {
        (Some((_, field)), Some(_)) => {
            return Err(ApiError::bad(format!(
                "{field} cannot be combined with a tool_choice that requires a call: the \
                 output is held to tool calls"
            ))
            .param(field))
        }
        (Some(asked), None) => asked,
        (None, Some(plan)) => {
            // A control token's bytes in the trie start with its special-token marker.
            let special = |text: &str| {
                let grammars = loaded.grammars.as_ref().ok()?;
                loaded
                    .tokenizer
                    .token_id(text)
                    .filter(|&id| grammars.token_bytes(id).first() == Some(&0xFF))
            };
            let grammar = plan.request.grammar(plan.syntax, &special);
            match grammar {
                Some(grammar) => (ConstraintSpec::Lark(grammar), "tools"),
                None => return Ok(None),
            }
        }
        (None, None) => return Ok(None),
    };
    let grammars = loaded.grammars.as_ref().map_err(|e| {
        ApiError::bad(format!(
            "{field}: this model cannot hold output to a format: {e}"
        ))
        .param(field)
    })?;
    match grammars.compile(&spec) {
        Ok(constraint) => Ok(Some(constraint)),
        Err(e) => Err(ApiError::bad(format!("{field}: {e}")).param(field)),
    }
}

/// A request body's checks as the completion handlers run them, up to the scheduler's
/// request: the JSON read as a chat (`chat`) or a text completion body, the unknown
/// fields counted, an assistant's tool calls in the history read, and [`prepare`], which
/// compiles the constraint the body asks for (a format, or the calls a `tool_choice`
/// requires). What a handler would answer 400 to is the error. Built for the fuzz
/// targets of `cli/fuzz` only (`cfg(fuzzing)`).
#[cfg(fuzzing)]
pub(in crate::serve) fn check_body(
    state: &AppState,
    loaded: &Loaded,
    chat: bool,
    body: &[u8],
) -> Result<Prepared, ApiError> {
    let body = Ok(axum::body::Bytes::copy_from_slice(body));
    if chat {
        let body: ChatBody = super::parse(body)?;
        state.note_unknown_fields(body.unknown.keys());
        let prepared = prepare(&body.common, state, loaded, Kind::Chat)?;
        for (i, m) in body.messages.iter().enumerate() {
            if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_null()) {
                tools::history_calls(i, calls)?;
            }
        }
        Ok(prepared)
    } else {
        let body: CompletionBody = super::parse(body)?;
        state.note_unknown_fields(body.unknown.keys());
        prepare(&body.common, state, loaded, Kind::Text)
    }
}
