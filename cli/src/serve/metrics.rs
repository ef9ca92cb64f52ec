//! `/metrics` in Prometheus' text format.

use std::fmt::Write;

use model::serve::{HistogramSnapshot, SchedulerMetrics, StepPhase};

use super::AppState;

pub fn render(state: &AppState) -> String {
    let mut out = String::new();
    server_gauges(&mut out, state);
    unknown_fields(&mut out, state);
    let Some(loaded) = state.loaded.get() else {
        return out;
    };
    // Every copy's counters added up, when the model is served by several.
    let m = &*loaded.scheduler.metrics();
    scheduler_counters(&mut out, m);
    scheduler_gauges(&mut out, state, m);
    timings(&mut out, m);
    out
}

/// The server's own gauges and the device cache's counters, present before a model has
/// loaded.
fn server_gauges(out: &mut String, state: &AppState) {
    let mut gauge = |name: &str, help: &str, kind: &str, value: f64| {
        let _ = writeln!(out, "# HELP rocmforge_{name} {help}");
        let _ = writeln!(out, "# TYPE rocmforge_{name} {kind}");
        let _ = writeln!(out, "rocmforge_{name} {value}");
    };
    gauge(
        "load_progress",
        "Fraction of the model loaded.",
        "gauge",
        f64::from(state.progress()),
    );
    gauge(
        "uptime_seconds",
        "Seconds since the server started.",
        "gauge",
        state.started.elapsed().as_secs_f64(),
    );
    // Stable names whether or not a device cache exists: without one (the CPU computes)
    // every value is 0 and `device_cache_enabled` says why.
    let cache = state
        .loaded
        .get()
        .and_then(|loaded| loaded.device_cache.as_ref())
        .map(|stats| stats());
    gauge(
        "device_cache_enabled",
        "1 when the weights are served from a device cache, 0 on the CPU.",
        "gauge",
        if cache.is_some() { 1.0 } else { 0.0 },
    );
    let cache = cache.unwrap_or_default();
    let device_counters = [
        (
            "device_cache_hits_total",
            "Weight requests answered by a tensor already on the device.",
            cache.hits,
        ),
        (
            "device_cache_misses_total",
            "Weight requests that started or waited for an upload.",
            cache.misses,
        ),
        (
            "device_cache_evictions_total",
            "Tensors evicted from the device to make room.",
            cache.evictions,
        ),
        (
            "device_cache_uploaded_bytes_total",
            "Bytes of weights uploaded to the device.",
            cache.uploaded_bytes,
        ),
    ];
    for (name, help, value) in device_counters {
        gauge(name, help, "counter", value as f64);
    }
}

/// The scheduler's counters, and its finished requests by reason.
fn scheduler_counters(out: &mut String, m: &SchedulerMetrics) {
    let mut gauge = |name: &str, help: &str, kind: &str, value: f64| {
        let _ = writeln!(out, "# HELP rocmforge_{name} {help}");
        let _ = writeln!(out, "# TYPE rocmforge_{name} {kind}");
        let _ = writeln!(out, "rocmforge_{name} {value}");
    };
    let get = |c| SchedulerMetrics::get(c) as f64;
    let counters = [
        (
            "requests_received_total",
            "Requests accepted into the queue.",
            &m.requests_received,
        ),
        (
            "requests_rejected_total",
            "Requests refused because the queue was full.",
            &m.rejected_queue_full,
        ),
        (
            "requests_cancelled_total",
            "Requests cancelled: client gone or server stopping.",
            &m.cancelled,
        ),
        (
            "requests_failed_total",
            "Requests that failed in the model.",
            &m.failed,
        ),
        (
            "prompt_tokens_total",
            "Prompt tokens of admitted requests.",
            &m.prompt_tokens,
        ),
        (
            "prompt_tokens_cached_total",
            "Prompt tokens reused from the KV pool.",
            &m.prompt_tokens_cached,
        ),
        (
            "generation_tokens_total",
            "Tokens generated.",
            &m.generated_tokens,
        ),
        (
            "computed_tokens_total",
            "Tokens run through the model.",
            &m.computed_tokens,
        ),
        (
            "steps_total",
            "Scheduler steps (batched forward passes).",
            &m.steps,
        ),
        (
            "preemptions_total",
            "Sequences pushed back to the queue to free KV blocks.",
            &m.preemptions,
        ),
        (
            "context_shifts_total",
            "Sequences whose full context was shifted to go on (--context-shift).",
            &m.context_shifts,
        ),
        (
            "embedding_requests_total",
            "Embeddings requests accepted into the queue.",
            &m.embedding_requests,
        ),
        (
            "embedding_tokens_total",
            "Tokens of embeddings inputs run through the model.",
            &m.embedding_tokens,
        ),
    ];
    for (name, help, counter) in counters {
        gauge(name, help, "counter", get(counter));
    }
    // A mixture of experts over its GPU budget: its pools of experts resident by use
    // (every value 0 without them).
    let pools = m.expert_pools();
    gauge(
        "expert_pools_enabled",
        "1 when routed experts run from pools resident by use (a mixture of experts over its GPU budget).",
        "gauge",
        if pools.is_some() { 1.0 } else { 0.0 },
    );
    let pools = pools.unwrap_or_default();
    for (name, help, kind, value) in [
        (
            "expert_hits_total",
            "Routes of a token to an expert resident on the device.",
            "counter",
            pools.hits,
        ),
        (
            "expert_misses_total",
            "Routes of a token to an expert not resident: over the link, read in place, or on the host.",
            "counter",
            pools.misses,
        ),
        (
            "expert_linked_total",
            "Missed routes whose expert was copied into a link slot and multiplied on the device.",
            "counter",
            pools.linked,
        ),
        (
            "expert_in_place_total",
            "Missed routes whose expert the device read from the mapped file in place.",
            "counter",
            pools.in_place,
        ),
        (
            "expert_promotions_total",
            "Experts copied into a slot of their layer's pool.",
            "counter",
            pools.promotions,
        ),
        (
            "expert_evictions_total",
            "Experts whose slot was given to another.",
            "counter",
            pools.evictions,
        ),
        (
            "expert_pool_slots",
            "Slots of each layer's pool of experts.",
            "gauge",
            pools.slots_per_layer as u64,
        ),
        (
            "experts_resident",
            "Experts resident in the pools, over every layer.",
            "gauge",
            pools.resident as u64,
        ),
    ] {
        gauge(name, help, kind, value as f64);
    }
    let _ = writeln!(
        out,
        "# HELP rocmforge_requests_finished_total Finished requests by reason.\n\
         # TYPE rocmforge_requests_finished_total counter\n\
         rocmforge_requests_finished_total{{reason=\"stop\"}} {}\n\
         rocmforge_requests_finished_total{{reason=\"length\"}} {}",
        get(&m.finished_stop),
        get(&m.finished_length)
    );
}

/// The scheduler's queue and KV pool, also under vLLM's names.
fn scheduler_gauges(out: &mut String, state: &AppState, m: &SchedulerMetrics) {
    let get = |c| SchedulerMetrics::get(c) as f64;
    let gauges = [
        ("queue_depth", "Requests waiting to start.", &m.waiting),
        ("running_sequences", "Sequences being computed.", &m.running),
        (
            "kv_blocks_total",
            "Blocks of the shared KV pool.",
            &m.kv_blocks_total,
        ),
        (
            "kv_blocks_used",
            "KV blocks held by sequences.",
            &m.kv_blocks_used,
        ),
        (
            "kv_blocks_cached",
            "KV blocks kept only for prefix reuse.",
            &m.kv_blocks_cached,
        ),
        ("kv_block_size", "Positions per KV block.", &m.kv_block_size),
    ];
    let mut out2 = String::new();
    for (name, help, value) in gauges {
        let _ = writeln!(out2, "# HELP rocmforge_{name} {help}");
        let _ = writeln!(out2, "# TYPE rocmforge_{name} gauge");
        let _ = writeln!(out2, "rocmforge_{name} {}", get(value));
    }
    let total = get(&m.kv_blocks_total).max(1.0);
    let _ = writeln!(
        out2,
        "# HELP rocmforge_kv_cache_usage_ratio Fraction of the KV pool held by sequences.\n\
         # TYPE rocmforge_kv_cache_usage_ratio gauge\n\
         rocmforge_kv_cache_usage_ratio {}",
        get(&m.kv_blocks_used) / total
    );
    // The same three under the names vLLM gives them, which request routers and
    // autoscalers read (labelled with the model's name, as vLLM labels them).
    let model_name = state
        .loaded
        .get()
        .map_or("", |loaded| loaded.model_id.as_str())
        .replace(['\\', '"'], "_");
    for (name, help, value) in [
        (
            "num_requests_running",
            "Sequences being computed (rocmforge_running_sequences).",
            get(&m.running),
        ),
        (
            "num_requests_waiting",
            "Requests waiting to start (rocmforge_queue_depth).",
            get(&m.waiting),
        ),
        (
            "kv_cache_usage_perc",
            "Fraction of the KV pool held by sequences, 0 to 1 \
             (rocmforge_kv_cache_usage_ratio).",
            get(&m.kv_blocks_used) / total,
        ),
    ] {
        let _ = writeln!(
            out2,
            "# HELP vllm:{name} {help}\n# TYPE vllm:{name} gauge\n\
             vllm:{name}{{model_name=\"{model_name}\"}} {value}"
        );
    }
    out.push_str(&out2);
}

/// The latency histograms and the time the steps spend outside their forward passes.
fn timings(out: &mut String, m: &SchedulerMetrics) {
    histogram(
        out,
        "time_to_first_token_seconds",
        "From a request's arrival to its first token.",
        &m.time_to_first_token.snapshot(),
    );
    histogram(
        out,
        "inter_token_seconds",
        "Between two tokens of one sequence.",
        &m.inter_token.snapshot(),
    );
    histogram(
        out,
        "request_duration_seconds",
        "From a request's arrival to its end.",
        &m.request_duration.snapshot(),
    );
    histogram(
        out,
        "step_seconds",
        "Scheduler steps that ran a forward pass, whole: admitting, the forward pass, \
         sampling and handing the text out.",
        &m.step_duration.snapshot(),
    );
    histogram(
        out,
        "forward_seconds",
        "The forward passes alone, a part of each step.",
        &m.forward_duration.snapshot(),
    );
    histogram(
        out,
        "constraint_mask_seconds",
        "The grammar's token mask of a constrained sequence, once per sampled token: \
         computed inline after the forward pass, before the sampler (part of the sample \
         phase).",
        &m.constraint_mask.snapshot(),
    );
    let _ = writeln!(
        out,
        "# HELP rocmforge_step_phase_seconds_total The steps' time outside their forward \
         passes, by part: admit (new requests, cancellations, the queue), schedule (the \
         batch's layout and KV blocks), sample (choosing tokens from the logits), deliver \
         (detokenizing, stop strings, the requests' events).\n\
         # TYPE rocmforge_step_phase_seconds_total counter"
    );
    for phase in StepPhase::ALL {
        let _ = writeln!(
            out,
            "rocmforge_step_phase_seconds_total{{phase=\"{}\"}} {}",
            phase.as_str(),
            m.step_phase_seconds(phase)
        );
    }
}

fn histogram(out: &mut String, name: &str, help: &str, h: &HistogramSnapshot) {
    let _ = writeln!(out, "# HELP rocmforge_{name} {help}");
    let _ = writeln!(out, "# TYPE rocmforge_{name} histogram");
    for (bound, count) in &h.buckets {
        let _ = writeln!(out, "rocmforge_{name}_bucket{{le=\"{bound}\"}} {count}");
    }
    let _ = writeln!(out, "rocmforge_{name}_bucket{{le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "rocmforge_{name}_sum {}", h.sum_seconds);
    let _ = writeln!(out, "rocmforge_{name}_count {}", h.count);
}

/// The requests that carried each unknown field, by name (a label value escaped as the
/// text format wants).
fn unknown_fields(out: &mut String, state: &AppState) {
    let counts = state.unknown_field_counts();
    if counts.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "# HELP rocmforge_unknown_request_fields_total Requests that carried a field this \
         server does not know (ignored), by field name."
    );
    let _ = writeln!(out, "# TYPE rocmforge_unknown_request_fields_total counter");
    for (name, count) in counts {
        let label = name
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n");
        let _ = writeln!(
            out,
            "rocmforge_unknown_request_fields_total{{field=\"{label}\"}} {count}"
        );
    }
}
