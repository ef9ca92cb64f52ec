//! Server-sent events: a streamed request's chunks, as the scheduler hands its text back.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Bytes;
use model::serve::{Event, Finish, TokenLogprobs};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::serve::tools::{CallParser, Piece};

use super::completion::{usage, CancelOnDrop, Kind, Out};
use super::logprobs;
use super::{ApiError, SYSTEM_FINGERPRINT};

pub(super) struct Meta {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) kind: Kind,
}

impl Meta {
    /// A chunk of choice `index`.
    fn chunk(&self, index: usize, delta_or_text: Value, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": index, "delta": delta_or_text, "finish_reason": finish,
                "logprobs": Value::Null,
            }),
            Kind::Text => json!({
                "index": index, "text": delta_or_text, "finish_reason": finish,
                "logprobs": Value::Null,
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

pub(super) enum Phase {
    Start,
    Running,
    Done,
}

/// Server-sent events of one request: of each of its choices (one per prompt), as their
/// events come, ending once every choice has finished. Dropping it (the client went
/// away) cancels the request.
pub(super) struct EventStream {
    /// Each choice's events, by its index.
    pub(super) rx: mpsc::UnboundedReceiver<(usize, Out)>,
    pub(super) meta: Meta,
    pub(super) include_usage: bool,
    pub(super) phase: Phase,
    pub(super) guard: CancelOnDrop,
    /// Reads the text into tool calls when the request offers tools (chat: one choice).
    pub(super) parser: Option<CallParser>,
    pub(super) choices: Vec<ChoiceStream>,
    /// The ends of the choices finished so far.
    pub(super) finishes: Vec<Finish>,
}

/// Where one choice of a streamed request stands.
pub(super) struct ChoiceStream {
    /// When the request asks for log-probabilities: those of the tokens whose text has
    /// not gone out yet. They go with the next chunk.
    pub(super) logprobs: Option<Vec<TokenLogprobs>>,
    /// Characters of the tokens' texts gone out so far (text completions' offsets).
    pub(super) offset: usize,
}

impl EventStream {
    /// `chunks` of choice `index` as server-sent events, the first carrying the
    /// log-probabilities of its tokens not yet sent (when the request asks for them).
    fn send(&mut self, index: usize, mut chunks: Vec<Value>) -> Vec<u8> {
        let choice = &mut self.choices[index];
        let pending = choice.logprobs.as_mut().filter(|p| !p.is_empty());
        if let (Some(pending), Some(first)) = (pending, chunks.first_mut()) {
            let tokens = std::mem::take(pending);
            first["choices"][0]["logprobs"] =
                logprobs::format(self.meta.kind, &tokens, &mut choice.offset);
        }
        let mut out = Vec::new();
        for chunk in &chunks {
            out.extend_from_slice(&sse(chunk));
        }
        out
    }

    /// A last event carrying the error, then the end of the stream.
    /// The guard stays armed: the request's other choices are cancelled as the stream
    /// drops.
    fn end_with_error(&mut self, message: &str) -> Bytes {
        self.phase = Phase::Done;
        let mut out = sse(&ApiError::unavailable(message).body()).to_vec();
        out.extend_from_slice(b"data: [DONE]\n\n");
        Bytes::from(out)
    }
}

impl Meta {
    /// The chunks of pieces read by the tool-call parser: text as `content`, a call as
    /// a first `tool_calls` delta with its index, id, type and name, then one with its
    /// arguments.
    pub(super) fn pieces(&self, pieces: Vec<Piece>) -> Vec<Value> {
        let mut out = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(text) => out.push(self.chunk(0, json!({"content": text}), None)),
                Piece::Call { index, call } => {
                    let head = json!({"tool_calls": [{
                        "index": index, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }]});
                    let arguments = json!({"tool_calls": [{
                        "index": index, "function": {"arguments": call.arguments},
                    }]});
                    out.push(self.chunk(0, head, None));
                    out.push(self.chunk(0, arguments, None));
                }
            }
        }
        out
    }
}

pub(super) fn sse(value: &Value) -> Bytes {
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
                    let first =
                        this.meta
                            .chunk(0, json!({"role": "assistant", "content": ""}), None);
                    return Poll::Ready(Some(Ok(sse(&first))));
                }
            }
            Phase::Running => {}
        }
        loop {
            let event = match this.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(event) => event,
            };
            let bytes = match event {
                Some((i, Out::Logprobs(token))) => {
                    if let Some(pending) = &mut this.choices[i].logprobs {
                        pending.push(token);
                    }
                    continue;
                }
                Some((i, Out::Event(Event::Text(piece)))) => {
                    let chunks = match &mut this.parser {
                        Some(parser) => {
                            let chunks = this.meta.pieces(parser.push(&piece));
                            if chunks.is_empty() {
                                // Held back: it may be the start of a call.
                                continue;
                            }
                            chunks
                        }
                        None => {
                            let delta = match this.meta.kind {
                                Kind::Chat => json!({"content": piece}),
                                Kind::Text => json!(piece),
                            };
                            vec![this.meta.chunk(i, delta, None)]
                        }
                    };
                    Bytes::from(this.send(i, chunks))
                }
                Some((i, Out::Event(Event::Done(finish)))) => {
                    this.finishes.push(finish);
                    let empty = match this.meta.kind {
                        Kind::Chat => json!({}),
                        Kind::Text => json!(""),
                    };
                    let mut reason = finish.reason.as_str();
                    let mut chunks = Vec::new();
                    if let Some(parser) = &mut this.parser {
                        chunks = this.meta.pieces(parser.finish());
                        if parser.calls() > 0 {
                            reason = "tool_calls";
                        }
                    }
                    chunks.push(this.meta.chunk(i, empty, Some(reason)));
                    let mut out = this.send(i, chunks);
                    if this.finishes.len() == this.choices.len() {
                        this.phase = Phase::Done;
                        this.guard.0 = None;
                        if this.include_usage {
                            let mut last = this.meta.chunk(0, Value::Null, None);
                            last["choices"] = json!([]);
                            last["usage"] = usage(&this.finishes);
                            out.extend_from_slice(&sse(&last));
                        }
                        out.extend_from_slice(b"data: [DONE]\n\n");
                    }
                    Bytes::from(out)
                }
                Some((_, Out::Event(Event::Error(message)))) => this.end_with_error(&message),
                None => this.end_with_error("the request ended without a result"),
            };
            return Poll::Ready(Some(Ok(bytes)));
        }
    }
}
