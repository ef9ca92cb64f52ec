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
use super::request::{prepare, read_inputs, ChatBody, CompletionBody, Content, Inputs, Prepared};
use super::stream::{ChoiceStream, EventStream, Meta, Phase};
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
    run_request(loaded, vec![(prompt, prepared)], Kind::Chat).await
}

/// Most prompts one text completion request may list.
pub(super) const MAX_PROMPTS: usize = 64;

pub(super) async fn completions(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let body: CompletionBody = parse(body)?;
    state.note_unknown_fields(body.unknown.keys());
    let loaded = loaded(&state)?;
    let inputs = read_inputs(&body.prompt, "prompt", MAX_PROMPTS)?;
    // Each prompt its own settings: a constraint follows one output.
    let mut jobs = Vec::with_capacity(inputs.len());
    for prompt in encode(&state, inputs, "prompt").await? {
        jobs.push((prompt, prepare(&body.common, &state, loaded, Kind::Text)?));
    }
    run_request(loaded, jobs, Kind::Text).await
}

/// The token ids of `inputs` (texts tokenized as prompts are: BOS and EOS where the
/// vocabulary asks for them, control tokens recognised), off the async threads; a 400
/// naming `field` when a text does not tokenize.
pub(super) async fn encode(
    state: &Shared,
    inputs: Inputs,
    field: &'static str,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let texts = match inputs {
        Inputs::Tokens(lists) => return Ok(lists),
        Inputs::Texts(texts) => texts,
    };
    let state = Arc::clone(state);
    tokio::task::spawn_blocking(move || {
        let loaded = state.loaded.get().expect("loaded before encoding");
        texts
            .iter()
            .map(|text| {
                loaded
                    .tokenizer
                    .encode(text, EncodeOptions::PROMPT)
                    .map_err(|e| ApiError::bad(e.to_string()).param(field))
            })
            .collect()
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

/// Runs each prompt with its settings as a sequence of its own (they batch together in
/// the scheduler) and answers with one choice per prompt, in order: a response, or
/// server-sent events whose chunks carry their choice's index. The response's settings
/// (model name, streaming, usage, tools) are the first prompt's; `jobs` is not empty.
pub(super) async fn run_request(
    loaded: &Loaded,
    jobs: Vec<(Vec<u32>, Prepared)>,
    kind: Kind,
) -> Result<Response, ApiError> {
    for (prompt, _) in &jobs {
        if prompt.len() > loaded.context_size {
            return Err(ServeError::PromptTooLong {
                prompt_tokens: prompt.len(),
                context_size: loaded.context_size,
            }
            .into());
        }
    }
    let first = &jobs.first().expect("at least one prompt").1;
    let (model_name, stream, include_usage) =
        (first.model.clone(), first.stream, first.include_usage);
    let wants_logprobs = first.logprobs.is_some();
    let mut parser = first
        .tools
        .as_ref()
        .map(|plan| CallParser::for_request(plan.syntax, &plan.request));
    let choices = jobs.len();
    let (tx, rx) = mpsc::unbounded_channel();
    // One flag for all the prompts: a client gone, or one prompt failed, ends them all.
    let cancel = Arc::new(AtomicBool::new(false));
    let guard = CancelOnDrop(Some(Arc::clone(&cancel)));
    submit(loaded, jobs, tx, &cancel)?;
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
        model: model_name,
        kind,
    };
    if stream {
        let stream = EventStream {
            rx,
            meta,
            include_usage,
            phase: Phase::Start,
            guard,
            parser,
            choices: (0..choices)
                .map(|_| ChoiceStream {
                    logprobs: wants_logprobs.then(Vec::new),
                    offset: 0,
                })
                .collect(),
            finishes: Vec::with_capacity(choices),
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
    let mut guard = guard;
    // On an error the other prompts are cancelled as the guard drops.
    let outputs = collect(rx, choices).await?;
    guard.0 = None;
    let answers = answers(kind, &outputs, wants_logprobs, parser.as_mut());
    Ok(axum::Json(json!({
        "id": meta.id,
        "object": if kind == Kind::Chat { "chat.completion" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": answers,
        "usage": usage(&outputs.finishes),
    }))
    .into_response())
}

/// Submits each prompt with its settings to the scheduler, as a sequence of its own whose
/// events (and log-probabilities, when asked for) `tx` carries under the prompt's index.
fn submit(
    loaded: &Loaded,
    jobs: Vec<(Vec<u32>, Prepared)>,
    tx: mpsc::UnboundedSender<(usize, Out)>,
    cancel: &Arc<AtomicBool>,
) -> Result<(), ApiError> {
    for (index, (prompt, p)) in jobs.into_iter().enumerate() {
        let room = loaded.context_size.saturating_sub(prompt.len()).max(1);
        let max_tokens = p.max_tokens.unwrap_or(room);
        let logprobs = p.logprobs.map(|top| {
            let tx = tx.clone();
            LogprobsRequest {
                top,
                sink: Box::new(move |token| {
                    // A client gone is seen by the events' sender.
                    let _ = tx.send((index, Out::Logprobs(token)));
                }),
            }
        });
        let events = tx.clone();
        let request = Request {
            prompt,
            max_tokens,
            sampling: p.sampling,
            stop: p.stop,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            logit_bias: p.logit_bias,
            constraint: p.constraint,
            cancel: Arc::clone(cancel),
            events: Box::new(move |event| events.send((index, Out::Event(event))).is_ok()),
        };
        loaded.scheduler.submit_with(request, logprobs)?;
    }
    Ok(())
}

/// What each choice of a request answered without streaming, by its index.
struct Outputs {
    texts: Vec<String>,
    /// Each token's log-probabilities, when the request asks for them.
    tokens: Vec<Vec<TokenLogprobs>>,
    finishes: Vec<Finish>,
}

/// Reads the channel until every one of the `choices` choices is done; the first error
/// ends the request.
async fn collect(
    mut rx: mpsc::UnboundedReceiver<(usize, Out)>,
    choices: usize,
) -> Result<Outputs, ApiError> {
    let mut texts = vec![String::new(); choices];
    let mut tokens: Vec<Vec<TokenLogprobs>> = (0..choices).map(|_| Vec::new()).collect();
    let mut finishes: Vec<Option<Finish>> = vec![None; choices];
    let mut left = choices;
    while left > 0 {
        match rx.recv().await {
            Some((i, Out::Logprobs(token))) => tokens[i].push(token),
            Some((i, Out::Event(Event::Text(piece)))) => texts[i].push_str(&piece),
            Some((i, Out::Event(Event::Done(finish)))) => {
                finishes[i] = Some(finish);
                left -= 1;
            }
            Some((_, Out::Event(Event::Error(message)))) => {
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
    }
    let finishes = finishes.into_iter().flatten().collect();
    Ok(Outputs {
        texts,
        tokens,
        finishes,
    })
}

/// The response's `choices`: each choice's text (a chat's message, its tool calls read
/// out of the text when the request offers tools), how it finished and its
/// log-probabilities.
fn answers(
    kind: Kind,
    outputs: &Outputs,
    wants_logprobs: bool,
    mut parser: Option<&mut CallParser>,
) -> Vec<Value> {
    let mut answers = Vec::with_capacity(outputs.texts.len());
    for (index, ((text, tokens), finish)) in outputs
        .texts
        .iter()
        .zip(&outputs.tokens)
        .zip(&outputs.finishes)
        .enumerate()
    {
        let logprobs = match wants_logprobs {
            true => logprobs::format(kind, tokens, &mut 0),
            false => Value::Null,
        };
        answers.push(match kind {
            Kind::Chat => {
                let mut message = json!({"role": "assistant", "content": text});
                let mut reason = finish.reason.as_str();
                if let Some(parser) = &mut parser {
                    let (content, calls) = split_calls(parser, text);
                    if !calls.is_empty() {
                        message["tool_calls"] = Value::Array(calls);
                        reason = "tool_calls";
                    }
                    message["content"] = content.map_or(Value::Null, Value::String);
                }
                json!({
                    "index": index,
                    "message": message,
                    "finish_reason": reason,
                    "logprobs": logprobs,
                })
            }
            Kind::Text => json!({
                "index": index,
                "text": text,
                "finish_reason": finish.reason.as_str(),
                "logprobs": logprobs,
            }),
        });
    }
    answers
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

/// The usage of a request's choices, summed.
pub(super) fn usage(finishes: &[Finish]) -> Value {
    let sum = |field: fn(&Finish) -> usize| finishes.iter().map(field).sum::<usize>();
    let prompt = sum(|f| f.prompt_tokens);
    let completion = sum(|f| f.completion_tokens);
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(|f| f.cached_tokens)},
    })
}
