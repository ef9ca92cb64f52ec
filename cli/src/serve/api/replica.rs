//! What a router in front of several `serve` replicas asks each of them, in the shapes
//! SGLang's router (`sglang-router`) reads: the model a replica serves, when it
//! registers the replica (`/model_info`, `/server_info`), and the replica's load, which
//! its load-balancing policies poll (`/get_load`). The routes answer 503 while the model
//! loads, as the completions do, so a router registers a replica once it can serve.

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::{authorize, loaded, ApiError, Shared};
use crate::serve::Loaded;

/// The model: its name (the file's stem, which `/v1/models` lists first), its
/// architecture, context and vocabulary. No tokenizer path is given: the replica
/// tokenizes, so the router routes text and needs none of its own.
pub(super) async fn model_info(
    State(state): State<Shared>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    Ok(axum::Json(model_fields(loaded(&state)?)).into_response())
}

/// The model's fields, and how the replica computes: one process, no tensor parallel
/// ranks (`tp_size` 1), a data parallel rank for each copy of the model it serves on
/// its GPUs (`dp_size`, 1 unless `--split-mode replicate`), and the most requests each
/// runs at once.
pub(super) async fn server_info(
    State(state): State<Shared>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let loaded = loaded(&state)?;
    let config = loaded.scheduler.config();
    let mut info = model_fields(loaded);
    let extra = json!({
        "tp_size": 1,
        "dp_size": loaded.scheduler.len(),
        "max_running_requests": config.max_sequences,
        "max_queued_requests": config.max_queue,
        "max_total_num_tokens": config.pool_positions,
        "version": env!("CARGO_PKG_VERSION"),
    });
    if let (Value::Object(info), Value::Object(extra)) = (&mut info, extra) {
        info.extend(extra);
    }
    Ok(axum::Json(info).into_response())
}

/// The replica's load, an entry for each copy of the model it serves (a data parallel
/// rank): the requests being computed, those waiting to start, and the KV positions the
/// running ones hold (`num_tokens`, what the router compares between replicas).
pub(super) async fn load(
    State(state): State<Shared>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let ranks: Vec<Value> = loaded(&state)?
        .scheduler
        .schedulers()
        .iter()
        .enumerate()
        .map(|(rank, scheduler)| {
            let m = scheduler.metrics();
            let get = |counter: &std::sync::atomic::AtomicU64| counter.load(Ordering::Relaxed);
            json!({
                "dp_rank": rank,
                "num_reqs": get(&m.running),
                "num_waiting_reqs": get(&m.waiting),
                "num_tokens": get(&m.kv_blocks_used) * get(&m.kv_block_size),
            })
        })
        .collect();
    Ok(axum::Json(ranks).into_response())
}

fn model_fields(loaded: &Loaded) -> Value {
    json!({
        "model_path": loaded.model_id,
        "served_model_name": loaded.model_id,
        "tokenizer_path": null,
        "is_generation": true,
        "model_type": loaded.architecture,
        "architectures": [loaded.architecture],
        "max_context_length": loaded.context_size,
        "vocab_size": loaded.n_vocab,
        "supports_vision": false,
    })
}
