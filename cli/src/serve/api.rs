//! The routes: OpenAI's chat and text completions (streamed as server-sent events or
//! not), embeddings, the model list, health, tokenize/detokenize and metrics, with
//! OpenAI-shaped errors for every refusal.

mod completion;
mod embeddings;
mod logprobs;
mod replica;
mod request;
mod stream;
#[cfg(test)]
mod tests;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use model::serve::ServeError;
use model::tokenizer::{DecodeOptions, EncodeOptions};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{AppState, Loaded};
use completion::{chat_completions, completions};

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
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/embeddings", post(embeddings::embeddings))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        // What a router in front of several replicas asks a worker (SGLang's router:
        // the model it serves, and its load, for the policies that balance by it).
        .route("/model_info", get(replica::model_info))
        .route("/server_info", get(replica::server_info))
        .route("/get_load", get(replica::load))
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
#[derive(Debug)]
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

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// [`request::check_body`]: a body's checks as the completion handlers run them, the
/// refusal as its HTTP status and message.
#[cfg(fuzzing)]
pub(super) fn check_body(
    state: &AppState,
    loaded: &Loaded,
    chat: bool,
    body: &[u8],
) -> Result<(), (u16, String)> {
    request::check_body(state, loaded, chat, body)
        .map(|_| ())
        .map_err(|e| (e.status.as_u16(), e.message))
}

pub(super) fn random_seed() -> u64 {
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
