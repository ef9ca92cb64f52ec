//! The chat and text completion handlers, and one request's run through the scheduler
//! to a response.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use model::chat::ChatMessage;
use model::serve::{Event, Finish, LogprobsRequest, Request, ServeError, TokenLogprobs};
use model::tokenizer::EncodeOptions;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::serve::tools::{history_calls, CallParser, Piece};
use crate::serve::Loaded;

use super::logprobs;
use super::request::{prepare, ChatBody, CompletionBody, Content, Prepared, PromptField};
use super::stream::{EventStream, Meta, Phase};
use super::{
    authorize, loaded, parse, random_seed, unix_time, ApiError, Shared, SYSTEM_FINGERPRINT,
};

/// What a request's channel carries: the scheduler's events, and (when the request asks
/// for them) each token's log-probabilities, before the text that holds it.
pub(super) enum Out {
    Event(Event),
    Logprobs(TokenLogprobs),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Kind {
    Chat,
    Text,
}

pub(super) async fn chat_completions(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let body: ChatBody = parse(body)?;
    state.note_unknown_fields(body.unknown.keys());
    let loaded = loaded(&state)?;
    let prepared = prepare(&body.common, &state, loaded, Kind::Chat)?;
    if loaded.template.is_none() {
        return Err(ApiError::bad(
            "this model has no chat template: use /v1/completions",
        ));
    }
    if body.messages.is_empty() {
        return Err(ApiError::bad("messages must not be empty").param("messages"));
    }
    let mut messages = Vec::with_capacity(body.messages.len());
    for (i, m) in body.messages.iter().enumerate() {
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
        let mut message = ChatMessage::new(m.role.clone(), content);
        message.tool_calls = match &m.tool_calls {
            None | Some(Value::Null) => None,
            Some(calls) => Some(history_calls(i, calls)?),
        };
        message.tool_call_id = m.tool_call_id.clone();
        message.name = m.name.clone();
        messages.push(message);
    }
    let offered = prepared
        .tools
        .as_ref()
        .map(|plan| plan.request.tools.clone());
    let state2 = Arc::clone(&state);
    let prompt = tokio::task::spawn_blocking(move || {
        let loaded = state2.loaded.get().expect("loaded above");
        let template = loaded.template.as_ref().expect("checked above");
        let text = template
            .prompt_with_tools(&messages, offered.as_deref(), loaded.tokenizer.adds_bos())
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

pub(super) async fn completions(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let body: CompletionBody = parse(body)?;
    state.note_unknown_fields(body.unknown.keys());
    let loaded = loaded(&state)?;
    let prepared = prepare(&body.common, &state, loaded, Kind::Text)?;
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
pub(super) struct CancelOnDrop(pub(super) Option<Arc<AtomicBool>>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(flag) = self.0.take() {
            flag.store(true, Ordering::Relaxed);
        }
    }
}

pub(super) async fn run_request(
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
    let mut parser = p
        .tools
        .as_ref()
        .map(|plan| CallParser::for_request(plan.syntax, &plan.request));
    let room = loaded.context_size.saturating_sub(n).max(1);
    let max_tokens = p.max_tokens.unwrap_or(room);
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let logprobs = p.logprobs.map(|top| {
        let tx = tx.clone();
        LogprobsRequest {
            top,
            sink: Box::new(move |token| {
                // A client gone is seen by the events' sender.
                let _ = tx.send(Out::Logprobs(token));
            }),
        }
    });
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
        events: Box::new(move |event| tx.send(Out::Event(event)).is_ok()),
    };
    let guard = CancelOnDrop(Some(cancel));
    loaded.scheduler.submit_with(request, logprobs)?;
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
            parser,
            logprobs: p.logprobs.map(|_| Vec::new()),
            offset: 0,
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
    let mut tokens = Vec::new();
    let finish = loop {
        match rx.recv().await {
            Some(Out::Logprobs(token)) => tokens.push(token),
            Some(Out::Event(Event::Text(piece))) => text.push_str(&piece),
            Some(Out::Event(Event::Done(finish))) => break finish,
            Some(Out::Event(Event::Error(message))) => {
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
    let logprobs = match p.logprobs {
        Some(_) => logprobs::format(kind, &tokens, &mut 0),
        None => Value::Null,
    };
    let choice = match kind {
        Kind::Chat => {
            let mut message = json!({"role": "assistant", "content": text});
            let mut reason = finish.reason.as_str();
            if let Some(parser) = &mut parser {
                let (content, calls) = split_calls(parser, &text);
                if !calls.is_empty() {
                    message["tool_calls"] = Value::Array(calls);
                    reason = "tool_calls";
                }
                message["content"] = content.map_or(Value::Null, Value::String);
            }
            json!({
                "index": 0,
                "message": message,
                "finish_reason": reason,
                "logprobs": logprobs,
            })
        }
        Kind::Text => json!({
            "index": 0,
            "text": text,
            "finish_reason": finish.reason.as_str(),
            "logprobs": logprobs,
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

/// The whole output read by `parser`: the text that is no call (`None` when calls
/// leave none but whitespace), and the calls as `message.tool_calls` lists them.
pub(super) fn split_calls(parser: &mut CallParser, text: &str) -> (Option<String>, Vec<Value>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    let pieces = parser.push(text).into_iter().chain(parser.finish());
    for piece in pieces {
        match piece {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call { call, .. } => calls.push(call.to_json()),
        }
    }
    if !calls.is_empty() && content.trim().is_empty() {
        return (None, calls);
    }
    (Some(content), calls)
}

pub(super) fn usage(finish: &Finish) -> Value {
    json!({
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finish.cached_tokens},
    })
}
