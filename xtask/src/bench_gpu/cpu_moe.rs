//! `bench-gpu --cpu-moe`: a mixture of experts with its weights' budget at what
//! llama.cpp's `-ncmoe N` keeps on the GPU, beside it.

use std::path::Path;

use anyhow::{Context, Result};
use model::Model;
use serde_json::{json, Value};
use tensor_store::{TensorHandle, TensorStore};

use super::{llama_bench_with, ours_with_stats, tg_pp_rows, token_share, Options};

/// tg and pp with the weights' budget at what llama.cpp holds on the GPU with `-ncmoe
/// layers`, beside it: printed, and returned as JSON rows.
pub(super) fn cpu_moe_rows(
    o: &Options,
    path: &Path,
    name: &str,
    layers: usize,
) -> Result<Vec<Value>> {
    let store = TensorStore::open(path).with_context(|| format!("opening {}", path.display()))?;
    let model = Model::load(&store)?;
    let handles = model.plan().handles();
    let on_cpu = |h: &TensorHandle| {
        h.name().ends_with("_exps.weight")
            && h.name()
                .strip_prefix("blk.")
                .and_then(|r| r.split('.').next())
                .and_then(|n| n.parse::<usize>().ok())
                .is_some_and(|l| l < layers)
    };
    let on_gpu: u64 = handles
        .iter()
        .filter(|h| !on_cpu(h))
        .map(|h| h.size())
        .sum();
    // The same bytes, each tensor aligned as our arena places it, and the pools' margin
    // (a 256th: each matrix's slots start on 256 bytes).
    let aligned = handles.len() as u64 * 256;
    let budget = (on_gpu + aligned) * 256 / 255 + 1;
    let routed: u64 = handles
        .iter()
        .filter(|h| h.name().ends_with("_exps.weight"))
        .map(|h| h.size())
        .sum();
    let share = token_share(&model);
    let routed_per_token = handles
        .iter()
        .filter(|h| h.name().ends_with("_exps.weight"))
        .map(|h| h.size() as f64 * share(h))
        .sum::<f64>();
    let off_gpu: u64 = handles
        .iter()
        .filter(|h| h.name().ends_with("_exps.weight") && on_cpu(h))
        .map(|h| h.size())
        .sum();
    drop(handles);
    drop(model);
    drop(store);
    let (ours, stats) = ours_with_stats(path, o.tokens, o.prompt, o.repeat, Some(budget), true)?;
    let theirs = match &o.llama_bench {
        Some(bench) => Some(llama_bench_with(
            bench,
            path,
            o.tokens,
            o.prompt,
            o.repeat,
            &["-ngl", "99", "-ncmoe", &layers.to_string()],
        )?),
        None => None,
    };
    let s = stats.unwrap_or_default();
    let routes = (s.hits + s.misses).max(1) as f64;
    let hit_rate = stats.map_or(1.0, |s| s.hits as f64 / routes);
    let link_rate = s.linked as f64 / routes;
    let in_place_rate = s.in_place as f64 / routes;
    let per_token = |v: u64| v as f64 / (o.tokens * o.repeat) as f64;
    let per_pass = |ns: u64| ns as f64 / 1e3 / s.host_passes.max(1) as f64;
    let note = format!(
        "budget {} MiB (llama.cpp -ncmoe {layers}: {} MiB of weights on the GPU, {} of {} MiB \
         of routed experts off it); ours: {} slots a layer and {} link slots, {:.0}% of routes \
         resident, {:.0}% over the link, {:.0}% read in place, {} promotions, {} evictions; routed experts {:.0} MB a token; a decoded token waited {:.2} ms for \
         its routes, spent {:.2} ms on the host's, in {:.1} layers of {:.0} µs ({:.0} in \
         the products), and {:.2} ms splitting routes and queueing copies",
        budget >> 20,
        on_gpu >> 20,
        off_gpu >> 20,
        routed >> 20,
        stats.map_or(0, |s| s.slots_per_layer),
        s.link_slots,
        100.0 * hit_rate,
        100.0 * link_rate,
        100.0 * in_place_rate,
        stats.map_or(0, |s| s.promotions),
        stats.map_or(0, |s| s.evictions),
        routed_per_token / 1e6,
        per_token(s.wait_ns) / 1e6,
        per_token(s.host_ns) / 1e6,
        per_token(s.host_passes),
        per_pass(s.host_ns),
        per_pass(s.host_product_ns),
        per_token(s.queue_ns) / 1e6,
    );
    let fields = json!({
        "budget_bytes": budget,
        "llama_cpp_ncmoe": layers,
        "slots_per_layer": stats.map(|s| s.slots_per_layer),
        "hits": stats.map(|s| s.hits),
        "misses": stats.map(|s| s.misses),
        "linked": stats.map(|s| s.linked),
        "in_place": stats.map(|s| s.in_place),
        "link_slots": stats.map(|s| s.link_slots),
        "promotions": stats.map(|s| s.promotions),
        "evictions": stats.map(|s| s.evictions),
    });
    let label = format!("ncmoe{layers}");
    Ok(tg_pp_rows(
        o, path, name, &label, &ours, theirs, &note, fields,
    ))
}
