//! Server-sent events: a streamed request's chunks, as the scheduler hands its text back.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Bytes;
use model::serve::Event;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::completion::{usage, CancelOnDrop, Kind};
use super::{ApiError, SYSTEM_FINGERPRINT};

pub(super) struct Meta {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) kind: Kind,
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

pub(super) enum Phase {
    Start,
    Running,
    Done,
}

/// Server-sent events of one request. Dropping it (the client went away) cancels the
/// request.
pub(super) struct EventStream {
    pub(super) rx: mpsc::UnboundedReceiver<Event>,
    pub(super) meta: Meta,
    pub(super) include_usage: bool,
    pub(super) phase: Phase,
    pub(super) guard: CancelOnDrop,
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
