//! `/v1/embeddings`: each input's vector, the mean of the model's last hidden states over
//! its tokens after the final norm, scaled to unit length (`model::pooling`), computed by
//! the scheduler between the steps of the completions.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use model::serve::{EmbedRequest, ServeError};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::oneshot;

use super::completion::encode;
use super::request::{model_name, read_inputs, Unknown};
use super::{authorize, loaded, parse, ApiError, Shared};

/// Most inputs one request may list (OpenAI's limit).
pub(super) const MAX_INPUTS: usize = 2048;

#[derive(Deserialize)]
pub(super) struct EmbeddingsBody {
    /// Read by [`read_inputs`].
    pub(super) input: Value,
    pub(super) model: Option<String>,
    pub(super) encoding_format: Option<Value>,
    pub(super) dimensions: Option<Value>,
    /// Taken and ignored: it names the end user, for OpenAI's monitoring.
    #[allow(dead_code)]
    pub(super) user: Option<Value>,
    #[serde(flatten)]
    pub(super) unknown: Unknown,
}

/// How the vectors are written: JSON numbers, or the little-endian bytes of their f32
/// values in base64 (what OpenAI's client asks for by default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Encoding {
    Float,
    Base64,
}

/// The settings of a body, checked: its encoding, or a 400 naming `encoding_format` or
/// `dimensions` (the vectors have the model's width; shortening them is not supported).
pub(super) fn settings(body: &EmbeddingsBody) -> Result<Encoding, ApiError> {
    if let Some(asked) = body.dimensions.as_ref().filter(|v| !v.is_null()) {
        return Err(ApiError::bad(format!(
            "dimensions: not supported by this server (got {asked}): the vectors have the \
             model's embedding width"
        ))
        .param("dimensions"));
    }
    match body.encoding_format.as_ref() {
        None | Some(Value::Null) => Ok(Encoding::Float),
        Some(Value::String(s)) if s == "float" => Ok(Encoding::Float),
        Some(Value::String(s)) if s == "base64" => Ok(Encoding::Base64),
        Some(other) => Err(ApiError::bad(format!(
            "encoding_format must be \"float\" or \"base64\", got {other}"
        ))
        .param("encoding_format")),
    }
}

/// A 400 naming `input` when an input has no tokens or more than the context holds.
pub(super) fn check_lengths(inputs: &[Vec<u32>], context_size: usize) -> Result<(), ApiError> {
    let bad = |why: String| Err(ApiError::bad(format!("input: {why}")).param("input"));
    for (i, input) in inputs.iter().enumerate() {
        if input.is_empty() {
            return bad(format!("item {i} is empty: there is nothing to embed"));
        }
        if input.len() > context_size {
            return bad(format!(
                "item {i} has {} tokens but the context holds {context_size}",
                input.len()
            ));
        }
    }
    Ok(())
}

/// `vector` as the response gives it: as numbers, each written with the fewest digits
/// that read back as the same f32 (not those of the f64 it widens to, twice as many).
pub(super) fn encode_vector(vector: &[f32], encoding: Encoding) -> Value {
    match encoding {
        Encoding::Float => vector
            .iter()
            .map(|&v| Value::from(v.to_string().parse::<f64>().unwrap_or(f64::from(v))))
            .collect(),
        Encoding::Base64 => {
            let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
            Value::String(base64(&bytes))
        }
    }
}

/// Standard base64 with padding.
pub(super) fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> shift & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

pub(super) async fn embeddings(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let body: EmbeddingsBody = parse(body)?;
    state.note_unknown_fields(body.unknown.keys());
    let loaded = loaded(&state)?;
    let encoding = settings(&body)?;
    let model = model_name(
        body.model.as_deref(),
        &loaded.model_id,
        &state.aliases,
        state.strict_model_names,
    )?;
    let inputs = read_inputs(&body.input, "input", MAX_INPUTS)?;
    let inputs = encode(&state, inputs, "input").await?;
    check_lengths(&inputs, loaded.context_size)?;
    let tokens: usize = inputs.iter().map(Vec::len).sum();
    let (tx, rx) = oneshot::channel();
    let request = EmbedRequest {
        inputs,
        reply: Box::new(move |result| {
            let _ = tx.send(result);
        }),
    };
    loaded.scheduler.embed(request).map_err(|e| match e {
        ServeError::TokenOutOfRange { .. } => ApiError::bad(format!("input: {e}")).param("input"),
        other => other.into(),
    })?;
    let vectors = match rx.await {
        Ok(Ok(vectors)) => vectors,
        Ok(Err(message)) => return Err(ApiError::unavailable(message)),
        Err(_) => {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "the request ended without a result",
            ))
        }
    };
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(index, v)| {
            json!({"object": "embedding", "index": index, "embedding": encode_vector(v, encoding)})
        })
        .collect();
    Ok(axum::Json(json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response())
}
