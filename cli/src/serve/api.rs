//! The routes: OpenAI's chat and text completions (streamed as server-sent events or
//! not), the model list, health, tokenize/detokenize and metrics, with OpenAI-shaped
//! errors for every refusal.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use model::chat::ChatMessage;
use model::constraint::Constraint;
use model::sampling::{defaults, SamplingParams};
use model::serve::{Event, Finish, Request, ServeError};
use model::tokenizer::{DecodeOptions, EncodeOptions};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::format::{constraint_spec, FormatFields};
use super::{AppState, Loaded};

type Shared = Arc<AppState>;

/// What responses give as `system_fingerprint`: the engine and its version.
const SYSTEM_FINGERPRINT: &str = concat!("rocmforge-", env!("CARGO_PKG_VERSION"));

pub fn router(state: Shared) -> Router {
    let limit = state.max_body_bytes;
    // The OpenAI routes also without `/v1`, as llama-server has them.
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            cors,
        ))
        .with_state(state)
}

/// The `Access-Control-Allow-Origin` a request from `origin` gets: `*` or the origin
/// itself when `allowed` lets it in, else nothing.
fn cors_allow<'a>(allowed: &[String], origin: &'a str) -> Option<&'a str> {
    if allowed.iter().any(|a| a == "*") {
        Some("*")
    } else if allowed.iter().any(|a| a.trim_end_matches('/') == origin) {
        Some(origin)
    } else {
        None
    }
}

/// CORS for the origins of `--cors-origin`: a preflight (`OPTIONS` with
/// `Access-Control-Request-Method`) from one of them is answered 204 before any key is
/// asked for, and every response to one of them carries `Access-Control-Allow-Origin`.
/// Requests from other origins, and every request without `--cors-origin`, pass
/// untouched.
async fn cors(
    State(state): State<Shared>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let origin = request
        .headers()
        .get(header::ORIGIN)
        .and_then(|o| o.to_str().ok())
        .and_then(|o| cors_allow(&state.cors_origins, o))
        .and_then(|o| HeaderValue::from_str(o).ok());
    let Some(origin) = origin else {
        return next.run(request).await;
    };
    let preflight = request.method() == axum::http::Method::OPTIONS
        && request
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = if preflight {
        let asked = request
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned()
            .unwrap_or(HeaderValue::from_static("authorization, content-type"));
        let mut response = StatusCode::NO_CONTENT.into_response();
        let h = response.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        response
    } else {
        next.run(request).await
    };
    let h = response.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.append(header::VARY, HeaderValue::from_static("Origin"));
    response
}

/// An error as OpenAI's API shapes it.
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
    retry_after: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            retry_after: None,
        }
    }

    pub(super) fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub(super) fn param(mut self, param: &'static str) -> ApiError {
        self.param = Some(param);
        self
    }

    #[cfg(test)]
    pub(super) fn param_name(&self) -> Option<&'static str> {
        self.param
    }

    fn unavailable(message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message);
        e.retry_after = Some(1);
        e
    }

    fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": Value::Null,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

impl From<ServeError> for ApiError {
    fn from(e: ServeError) -> ApiError {
        match e {
            ServeError::QueueFull { .. } | ServeError::ShuttingDown => {
                ApiError::unavailable(e.to_string())
            }
            ServeError::PromptTooLong { .. } | ServeError::EmptyPrompt => {
                ApiError::bad(e.to_string()).param("prompt")
            }
            _ => ApiError::bad(e.to_string()),
        }
    }
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found_error", "no such route")
}

/// The model, or 503 while it loads (or 500 when loading failed).
fn loaded(state: &AppState) -> Result<&Loaded, ApiError> {
    if state.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    if let Some(loaded) = state.loaded.get() {
        return Ok(loaded);
    }
    if let Some(e) = state.load_error.get() {
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("the model failed to load: {e}"),
        ));
    }
    Err(ApiError::unavailable(format!(
        "the model is loading ({:.0}%)",
        state.progress() * 100.0
    )))
}

/// Checks the bearer key when one is set.
fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Compare every byte whatever the first difference, not to leak the key's prefix.
    let matches = given.is_some_and(|g| {
        g.len() == key.len()
            && g.bytes()
                .zip(key.bytes())
                .fold(0, |acc, (a, b)| acc | (a ^ b))
                == 0
    });
    if matches {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "a valid API key is required (Authorization: Bearer KEY)",
        ))
    }
}

/// A JSON body of type `T`, with 400 for malformed JSON and wrong types and 413 for a
/// body over the limit.
fn parse<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|rejection| {
        let status = rejection.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                status,
                "invalid_request_error",
                "the request body is too large",
            )
        } else {
            ApiError::new(status, "invalid_request_error", rejection.body_text())
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::bad(format!("invalid JSON body: {e}")))
}

async fn health(State(state): State<Shared>) -> Response {
    if let Some(e) = state.load_error.get() {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(json!({"status": "error", "error": e})),
        )
            .into_response();
    }
    if state.shutting_down.load(Ordering::SeqCst) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "shutting_down"})),
        )
            .into_response();
    }
    match state.loaded.get() {
        Some(_) => axum::Json(json!({"status": "ok"})).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "loading", "progress": state.progress()})),
        )
            .into_response(),
    }
}

async fn metrics(State(state): State<Shared>, headers: HeaderMap) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let text = super::metrics::render(&state);
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

async fn models(State(state): State<Shared>, headers: HeaderMap) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let loaded = loaded(&state)?;
    let created = unix_time();
    let data: Vec<Value> = std::iter::once(&loaded.model_id)
        .chain(&state.aliases)
        .map(|id| {
            json!({
                "id": id,
                "object": "model",
                "created": created,
                "owned_by": "rocmforge",
                "meta": {"n_ctx": loaded.context_size, "n_vocab": loaded.n_vocab},
            })
        })
        .collect();
    Ok(axum::Json(json!({"object": "list", "data": data})).into_response())
}

#[derive(Deserialize)]
struct TokenizeBody {
    content: String,
    #[serde(default)]
    add_special: Option<bool>,
}

async fn tokenize(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let request: TokenizeBody = parse(body)?;
    let loaded = loaded(&state)?;
    let options = if request.add_special.unwrap_or(false) {
        EncodeOptions::PROMPT
    } else {
        EncodeOptions {
            add_special: false,
            ..EncodeOptions::PROMPT
        }
    };
    let tokens = loaded
        .tokenizer
        .encode(&request.content, options)
        .map_err(|e| ApiError::bad(e.to_string()))?;
    Ok(axum::Json(json!({"tokens": tokens})).into_response())
}

#[derive(Deserialize)]
struct DetokenizeBody {
    tokens: Vec<u32>,
}

async fn detokenize(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let request: DetokenizeBody = parse(body)?;
    let loaded = loaded(&state)?;
    let content = loaded
        .tokenizer
        .decode(&request.tokens, DecodeOptions::TEXT)
        .map_err(|e| ApiError::bad(e.to_string()).param("tokens"))?;
    Ok(axum::Json(json!({"content": content})).into_response())
}

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
struct Common {
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
    /// OpenAI fields this server does not honour yet. They are read so that a request
    /// that sets them is refused naming them ([`refuse_unsupported`]): an agent that asks
    /// for a tool call must not get prose it takes for the one it asked for.
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<Value>,
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
    functions: Option<Value>,
    function_call: Option<Value>,
    audio: Option<Value>,
    modalities: Option<Value>,
}

/// A 400 naming each field of `common` set to what this server cannot do: tool and
/// function calls, log-probabilities, audio. Values that ask for nothing (`tool_choice`
/// `"none"`, `logprobs` `false` or `0`, empty lists, `null`) pass.
fn refuse_unsupported(common: &Common) -> Result<(), ApiError> {
    let asks = |value: &Option<Value>| match value {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Array(items)) => !items.is_empty(),
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(_) => true,
    };
    let tool_choice_none = common.tool_choice.as_ref().and_then(Value::as_str) == Some("none");
    let refusals: [(&'static str, bool, &str); 9] = [
        (
            "tools",
            asks(&common.tools),
            "tool calls are not supported by this server",
        ),
        (
            "tool_choice",
            asks(&common.tool_choice) && !tool_choice_none,
            "tool calls are not supported by this server",
        ),
        (
            "parallel_tool_calls",
            matches!(common.parallel_tool_calls, Some(Value::Bool(true))) && asks(&common.tools),
            "tool calls are not supported by this server",
        ),
        (
            "functions",
            asks(&common.functions),
            "function calls are not supported by this server",
        ),
        (
            "function_call",
            asks(&common.function_call)
                && common.function_call.as_ref().and_then(Value::as_str) != Some("none"),
            "function calls are not supported by this server",
        ),
        (
            "logprobs",
            asks(&common.logprobs),
            "log-probabilities are not supported by this server",
        ),
        (
            "top_logprobs",
            asks(&common.top_logprobs),
            "log-probabilities are not supported by this server",
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

/// Message content: a string or a list of text parts.
#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Option<Content>,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<Message>,
    #[serde(flatten)]
    common: Common,
}

/// A prompt: text, a list of one text, or token ids.
#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: PromptField,
    #[serde(flatten)]
    common: Common,
}

/// Most stop strings, and their length, a request may give.
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 256;

/// Checks the common fields and builds the scheduler's request (without prompt and
/// events yet).
/// The name a response gives for a request's `model`: the request's own when it is the
/// file's stem or an alias; the file's stem when it names nothing (or another model,
/// which the loaded model serves unless `strict`, when that is a 400 listing the names).
fn model_name(
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

fn prepare(common: &Common, state: &AppState, loaded: &Loaded) -> Result<Prepared, ApiError> {
    refuse_unsupported(common)?;
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
    let constraint = constraint(common, loaded)?;
    Ok(Prepared {
        model,
        max_tokens,
        sampling,
        stop,
        presence_penalty,
        frequency_penalty,
        logit_bias,
        constraint,
        stream: common.stream,
        include_usage: common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
    })
}

struct Prepared {
    /// The model's name in the responses.
    model: String,
    max_tokens: Option<usize>,
    sampling: model::sampling::SamplingConfig,
    stop: Vec<String>,
    presence_penalty: f32,
    frequency_penalty: f32,
    logit_bias: Vec<(u32, f32)>,
    constraint: Option<Constraint>,
    stream: bool,
    include_usage: bool,
}

/// The compiled constraint a request asks for, or a 400 naming the field whose
/// schema, grammar or expression does not compile.
fn constraint(common: &Common, loaded: &Loaded) -> Result<Option<Constraint>, ApiError> {
    let fields = FormatFields {
        response_format: common.response_format.as_ref(),
        grammar: common.grammar.as_ref(),
        regex: common.regex.as_ref(),
    };
    let Some((spec, field)) = constraint_spec(&fields)? else {
        return Ok(None);
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

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Text,
}

async fn chat_completions(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let body: ChatBody = parse(body)?;
    let loaded = loaded(&state)?;
    let prepared = prepare(&body.common, &state, loaded)?;
    if loaded.template.is_none() {
        return Err(ApiError::bad(
            "this model has no chat template: use /v1/completions",
        ));
    }
    if body.messages.is_empty() {
        return Err(ApiError::bad("messages must not be empty").param("messages"));
    }
    let mut messages = Vec::with_capacity(body.messages.len());
    for m in &body.messages {
        let content = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::bad(format!(
                                "content parts of type {kind:?} are not supported"
                            ))
                            .param("messages"))
                        }
                    }
                }
                text
            }
        };
        messages.push(ChatMessage::new(m.role.clone(), content));
    }
    let state2 = Arc::clone(&state);
    let prompt = tokio::task::spawn_blocking(move || {
        let loaded = state2.loaded.get().expect("loaded above");
        let template = loaded.template.as_ref().expect("checked above");
        let text = template
            .prompt(&messages, loaded.tokenizer.adds_bos())
            .map_err(|e| ApiError::bad(format!("chat template: {e}")).param("messages"))?;
        loaded
            .tokenizer
            .encode(&text, EncodeOptions::PROMPT)
            .map_err(|e| ApiError::bad(e.to_string()).param("messages"))
    })
    .await
    .map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            e.to_string(),
        )
    })??;
    run_request(loaded, prompt, prepared, Kind::Chat).await
}

async fn completions(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let body: CompletionBody = parse(body)?;
    let loaded = loaded(&state)?;
    let prepared = prepare(&body.common, &state, loaded)?;
    let prompt = match body.prompt {
        PromptField::Tokens(tokens) => tokens,
        PromptField::Text(text) => encode(&state, text).await?,
        PromptField::Texts(mut texts) => {
            if texts.len() != 1 {
                return Err(
                    ApiError::bad(format!("one prompt per request, got {}", texts.len()))
                        .param("prompt"),
                );
            }
            encode(&state, texts.remove(0)).await?
        }
    };
    run_request(loaded, prompt, prepared, Kind::Text).await
}

async fn encode(state: &Shared, text: String) -> Result<Vec<u32>, ApiError> {
    let state = Arc::clone(state);
    tokio::task::spawn_blocking(move || {
        let loaded = state.loaded.get().expect("loaded before encoding");
        loaded
            .tokenizer
            .encode(&text, EncodeOptions::PROMPT)
            .map_err(|e| ApiError::bad(e.to_string()).param("prompt"))
    })
    .await
    .map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            e.to_string(),
        )
    })?
}

/// Sets the flag when dropped unless disarmed: a request whose handler or stream is
/// dropped (the client went away) is cancelled.
struct CancelOnDrop(Option<Arc<AtomicBool>>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(flag) = self.0.take() {
            flag.store(true, Ordering::Relaxed);
        }
    }
}

async fn run_request(
    loaded: &Loaded,
    prompt: Vec<u32>,
    p: Prepared,
    kind: Kind,
) -> Result<Response, ApiError> {
    let n = prompt.len();
    if n > loaded.context_size {
        return Err(ServeError::PromptTooLong {
            prompt_tokens: n,
            context_size: loaded.context_size,
        }
        .into());
    }
    let room = loaded.context_size.saturating_sub(n).max(1);
    let max_tokens = p.max_tokens.unwrap_or(room);
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let request = Request {
        prompt,
        max_tokens,
        sampling: p.sampling,
        stop: p.stop,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        logit_bias: p.logit_bias,
        constraint: p.constraint,
        cancel: Arc::clone(&cancel),
        events: Box::new(move |event| tx.send(event).is_ok()),
    };
    let guard = CancelOnDrop(Some(cancel));
    loaded.scheduler.submit(request)?;
    let meta = Meta {
        id: format!(
            "{}-{:x}",
            if kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            random_seed()
        ),
        created: unix_time(),
        model: p.model.clone(),
        kind,
    };
    if p.stream {
        let stream = EventStream {
            rx,
            meta,
            include_usage: p.include_usage,
            phase: Phase::Start,
            guard,
        };
        let mut response = Response::new(Body::from_stream(stream));
        let h = response.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return Ok(response);
    }
    let mut rx = rx;
    let mut guard = guard;
    let mut text = String::new();
    let finish = loop {
        match rx.recv().await {
            Some(Event::Text(piece)) => text.push_str(&piece),
            Some(Event::Done(finish)) => break finish,
            Some(Event::Error(message)) => {
                guard.0 = None;
                return Err(ApiError::unavailable(message));
            }
            None => {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "the request ended without a result",
                ))
            }
        }
    };
    guard.0 = None;
    let choice = match kind {
        Kind::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish.reason.as_str(),
            "logprobs": Value::Null,
        }),
        Kind::Text => json!({
            "index": 0,
            "text": text,
            "finish_reason": finish.reason.as_str(),
            "logprobs": Value::Null,
        }),
    };
    Ok(axum::Json(json!({
        "id": meta.id,
        "object": if kind == Kind::Chat { "chat.completion" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [choice],
        "usage": usage(&finish),
    }))
    .into_response())
}

fn usage(finish: &Finish) -> Value {
    json!({
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finish.cached_tokens},
    })
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

impl Meta {
    fn chunk(&self, delta_or_text: Value, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0, "delta": delta_or_text, "finish_reason": finish, "logprobs": Value::Null,
            }),
            Kind::Text => json!({
                "index": 0, "text": delta_or_text, "finish_reason": finish, "logprobs": Value::Null,
            }),
        };
        json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [choice],
        })
    }
}

enum Phase {
    Start,
    Running,
    Done,
}

/// Server-sent events of one request. Dropping it (the client went away) cancels the
/// request.
struct EventStream {
    rx: mpsc::UnboundedReceiver<Event>,
    meta: Meta,
    include_usage: bool,
    phase: Phase,
    guard: CancelOnDrop,
}

impl EventStream {
    /// A last event carrying the error, then the end of the stream.
    fn end_with_error(&mut self, message: &str) -> Bytes {
        self.phase = Phase::Done;
        self.guard.0 = None;
        let mut out = sse(&ApiError::unavailable(message).body()).to_vec();
        out.extend_from_slice(b"data: [DONE]\n\n");
        Bytes::from(out)
    }
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

impl futures_core::Stream for EventStream {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        match this.phase {
            Phase::Done => return Poll::Ready(None),
            Phase::Start => {
                this.phase = Phase::Running;
                if this.meta.kind == Kind::Chat {
                    let first = this
                        .meta
                        .chunk(json!({"role": "assistant", "content": ""}), None);
                    return Poll::Ready(Some(Ok(sse(&first))));
                }
            }
            Phase::Running => {}
        }
        let event = match this.rx.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(event) => event,
        };
        let bytes = match event {
            Some(Event::Text(piece)) => {
                let delta = match this.meta.kind {
                    Kind::Chat => json!({"content": piece}),
                    Kind::Text => json!(piece),
                };
                sse(&this.meta.chunk(delta, None))
            }
            Some(Event::Done(finish)) => {
                this.phase = Phase::Done;
                this.guard.0 = None;
                let empty = match this.meta.kind {
                    Kind::Chat => json!({}),
                    Kind::Text => json!(""),
                };
                let mut out = sse(&this.meta.chunk(empty, Some(finish.reason.as_str()))).to_vec();
                if this.include_usage {
                    let mut last = this.meta.chunk(Value::Null, None);
                    last["choices"] = json!([]);
                    last["usage"] = usage(&finish);
                    out.extend_from_slice(&sse(&last));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                Bytes::from(out)
            }
            Some(Event::Error(message)) => this.end_with_error(&message),
            None => this.end_with_error("the request ended without a result"),
        };
        Poll::Ready(Some(Ok(bytes)))
    }
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn random_seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    model::sampling::Xoshiro256::seed_from_u64(
        nanos ^ (count << 40) ^ u64::from(std::process::id()),
    )
    .next_u64()
}

static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(body: Value) -> Option<(&'static str, String)> {
        let common: Common = serde_json::from_value(body).expect("a request body");
        refuse_unsupported(&common)
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
            (json!({"logprobs": true}), "logprobs"),
            (json!({"logprobs": 5}), "logprobs"),
            (json!({"top_logprobs": 3}), "top_logprobs"),
            (json!({"audio": {"voice": "x"}}), "audio"),
            (json!({"modalities": ["text", "audio"]}), "modalities"),
        ] {
            let (param, message) = refused(body.clone()).unwrap_or_else(|| panic!("{body} passed"));
            assert_eq!(param, field, "{body}");
            assert!(message.contains(field), "{message}");
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
}
