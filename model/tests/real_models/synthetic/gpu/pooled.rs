use super::check::check_within;
use super::*;

/// A budget that holds every weight of `model` but its routed experts, and `share` of
/// those (each layer's pool then has about `share` of its experts' slots).
fn experts_budget(model: &Model, share: f64) -> u64 {
    let aligned = |size: u64| size.div_ceil(256) * 256;
    let handles = model.plan().handles();
    let routed = |h: &&&tensor_store::TensorHandle| h.name().ends_with("_exps.weight");
    let other: u64 = handles
        .iter()
        .filter(|h| !routed(h))
        .map(|h| aligned(h.size()))
        .sum();
    let experts: u64 = handles.iter().filter(routed).map(|h| h.size()).sum();
    // The pools' margin: a 256th of the budget.
    ((other as f64 + share * experts as f64) * 256.0 / 255.0) as u64 + 4096
}

/// Over budget, a mixture of experts runs every weight but its routed experts on the
/// device, and a pool of each layer's experts resident by use: the routes to the others
/// run on the CPU, or come over the link. Its logits stay within the GPU's tolerance of
/// the CPU's however the routes split (they split differently at every pass as experts
/// are promoted), with every expert resident by use, none (a budget without room for a
/// slot) and a part. With `Fill::First` and `Fill::InPlace`, the pools fill and the
/// link's registration ends before the first pass: missed experts then come over the
/// link from the first pass on (and must, on a device that registers the mapping),
/// copied into link slots (`First`, reading in place switched off) or read in place.
fn pooled(name: &str, test: &str, share: f64, fill: Fill) {
    let wait = fill != Fill::ByUse;
    let tuning = GpuTuning {
        experts_in_place: fill != Fill::First,
        ..GpuTuning::default()
    };
    let budget = |m: &Model| Some(experts_budget(m, share));
    let Some(stats) = check_within(name, test, budget, wait, tuning) else {
        return;
    };
    eprintln!("{test}: {stats:?}");
    assert!(
        stats.misses > 0,
        "{test}: no route ran on the host: {stats:?}"
    );
    if share == 0.0 {
        assert_eq!(stats.slots_per_layer, 0, "{test}: {stats:?}");
        assert_eq!(stats.hits + stats.promotions, 0, "{test}: {stats:?}");
    } else {
        assert!(
            stats.slots_per_layer > 0 && stats.hits > 0 && stats.promotions > 0,
            "{test}: nothing ran from the pools: {stats:?}"
        );
    }
    match fill {
        Fill::First => assert!(
            stats.link_slots > 0
                && stats.linked > 0
                && stats.linked < stats.misses
                && stats.in_place == 0,
            "{test}: missed routes did not split between the link and the host: {stats:?}"
        ),
        // The passes of a few tokens read their missed experts in place (longer ones
        // split their routes).
        Fill::InPlace => assert!(
            stats.in_place > 0 && stats.in_place <= stats.misses,
            "{test}: no missed route was read in place: {stats:?}"
        ),
        Fill::ByUse => {}
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Fill {
    /// The passes fill the pools as they go, and take the link once it is in place.
    ByUse,
    /// The pools filled and the link in place first, missed experts copied into link
    /// slots or left to the host.
    First,
    /// The same, missed experts read in place.
    InPlace,
}

macro_rules! gpu_pooled {
    ($($test:ident => $name:literal at $share:literal, $fill:ident),* $(,)?) => {$(
        #[test]
        fn $test() {
            pooled($name, stringify!($test), $share, Fill::$fill);
        }
    )*};
}

gpu_pooled! {
    gpu_pooled_qwen3moe_half => "qwen3moe-random" at 0.5, ByUse,
    gpu_pooled_qwen3moe_half_linked => "qwen3moe-random" at 0.5, First,
    gpu_pooled_qwen3moe_none => "qwen3moe-random" at 0.0, ByUse,
    gpu_pooled_qwen3moe_none_linked => "qwen3moe-random" at 0.0, First,
    gpu_pooled_qwen3moe_half_in_place => "qwen3moe-random" at 0.5, InPlace,
    gpu_pooled_qwen3moe_none_in_place => "qwen3moe-random" at 0.0, InPlace,
    gpu_pooled_qwen3moe_mxfp4_quarter_in_place => "qwen3moe-mxfp4-random" at 0.25, InPlace,
    gpu_pooled_gpt_oss_half_in_place => "gpt-oss" at 0.5, InPlace,
    gpu_pooled_qwen2moe_quarter => "qwen2moe-random" at 0.25, ByUse,
    gpu_pooled_llama_moe_half => "llama-moe-random" at 0.5, ByUse,
    gpu_pooled_gpt_oss_half => "gpt-oss" at 0.5, ByUse,
    gpu_pooled_gpt_oss_half_linked => "gpt-oss" at 0.5, First,
    gpu_pooled_gpt_oss_long_quarter => "gpt-oss-long" at 0.25, ByUse,
}

/// Tokens fed one at a time through pools whose missed experts are read in place give
/// the same logits, bit for bit, wherever the experts lie: the products are the same
/// kernels on the same bytes. Against pools of another `share` (`against`), or against
/// the same model with every expert resident (`None`, the decode step then a captured
/// graph: a mixture whose layers end in the next layer's norm, Qwen3-MoE's).
fn in_place_matches(name: &str, test: &str, share: f64, against: Option<f64>) {
    let (_dir, store, model) = open_spec(name);
    let tokens = super::check::spec_prompt(name, &store);
    let context = tokens.len() + 1;
    let open = |share: Option<f64>| {
        let budget = share.map(|share| experts_budget(&model, share));
        let tuning = GpuTuning::default();
        let mut gpu =
            gpu_model_within(test, &model, UploadMode::Eager, context, 1, budget, tuning)?;
        gpu.wait_experts_resident().expect("the pools fill");
        Some(gpu)
    };
    // The reference's logits first, its model dropped before the pools' opens: a
    // process registers a mapping's pages for one model at a time.
    let Some(mut reference) = open(against) else {
        return;
    };
    let wanted: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&token| {
            reference
                .forward_logits(&[token])
                .expect("reference")
                .to_vec()
        })
        .collect();
    let reference_stats = reference.expert_stats();
    drop(reference);
    let Some(mut pooled) = open(Some(share)) else {
        return;
    };
    for (pos, (&token, want)) in tokens.iter().zip(&wanted).enumerate() {
        let got = pooled.forward_logits(&[token]).expect("pooled");
        let differ = got
            .iter()
            .zip(want)
            .filter(|(g, w)| g.to_bits() != w.to_bits());
        let largest = differ
            .map(|(g, w)| (g - w).abs())
            .fold(None, |m: Option<f32>, d| Some(m.map_or(d, |m| m.max(d))));
        assert!(
            largest.is_none(),
            "{test}: position {pos}: the logits differ from the reference's by up to {largest:?} \
             (pools {:?}; reference {:?})",
            pooled.expert_stats(),
            reference_stats
        );
    }
    let stats = pooled.expert_stats().expect("pools");
    eprintln!("{test}: {stats:?}");
    assert!(
        stats.in_place > 0 && stats.host_passes == 0 && stats.linked == 0,
        "{test}: missed routes were not all read in place: {stats:?}"
    );
}

#[test]
fn gpu_in_place_matches_resident_qwen3moe_half() {
    let test = "gpu_in_place_matches_resident_qwen3moe_half";
    in_place_matches("qwen3moe-random", test, 0.5, None);
}

#[test]
fn gpu_in_place_matches_resident_qwen3moe_none() {
    let test = "gpu_in_place_matches_resident_qwen3moe_none";
    in_place_matches("qwen3moe-random", test, 0.0, None);
}

#[test]
fn gpu_in_place_matches_pools_gpt_oss_none_half() {
    let test = "gpu_in_place_matches_pools_gpt_oss_none_half";
    in_place_matches("gpt-oss", test, 0.0, Some(0.5));
}

/// Waiting for the pools fills every slot; the decode steps after it find most of their
/// routes resident. Every device and page-locked allocation of such a model failed in
/// turn is a clear error that leaves the device's memory as it was.
#[test]
fn gpu_pools_fill_and_their_allocation_failures_are_clear_errors() {
    let test = "gpu_pools_fill_and_their_allocation_failures_are_clear_errors";
    let (_dir, _store, model) = open_spec("qwen3moe-random");
    let budget = experts_budget(&model, 0.5);
    let open = || {
        let options = GpuOptions {
            budget: Some(budget),
            ..GpuOptions::new(UploadMode::Eager, 64)
        };
        GpuModel::new(&model, &options)
    };
    let mut gpu = match open() {
        Ok(gpu) => gpu,
        Err(model::ModelError::Gpu { source, .. }) if source.is_unavailable() => {
            skip(test, &source.to_string());
            return;
        }
        Err(error) => panic!("{test}: {error}"),
    };
    gpu.wait_experts_resident().expect("the pools fill");
    let filled = gpu.expert_stats().expect("pools");
    let layers = model.config().n_layers;
    assert_eq!(
        filled.resident,
        filled.slots_per_layer * layers,
        "{test}: {filled:?}"
    );
    let mut token = 1;
    for _ in 0..8 {
        token = gpu.forward_argmax(&[token]).expect("decode");
    }
    let after = gpu.expert_stats().expect("pools");
    assert!(
        after.hits > filled.hits,
        "{test}: no route found its expert: {after:?}"
    );
    drop(gpu);

    let device = hip_backend::Device::open(0).expect("a device");
    let free = || {
        device.synchronize().expect("idle");
        device.memory_info().expect("memory info").free
    };
    let before = free();
    for (kind, arm) in [
        (
            "device",
            hip_backend::fault::fail_device_allocation as fn(u64) -> hip_backend::fault::Armed,
        ),
        ("page-locked", hip_backend::fault::fail_pinned_allocation),
    ] {
        let mut failures = 0;
        for nth in 1..=96 {
            let armed = arm(nth);
            let outcome = open().and_then(|mut gpu| {
                gpu.wait_experts_resident()?;
                gpu.forward(&[1, 2, 3])
            });
            let fired = armed.fired();
            drop(armed);
            match outcome {
                Err(error) => {
                    assert!(fired, "{test}: {kind} allocation {nth}: {error}");
                    let text = error.to_string();
                    assert!(
                        text.contains("no room for") || text.contains("out of memory"),
                        "{test}: {kind} allocation {nth}: unclear error: {text}"
                    );
                    failures += 1;
                }
                Ok(_) if !fired => break,
                Ok(_) => {}
            }
            assert!(
                free() >= before,
                "{test}: {kind} allocation {nth} failed and leaked"
            );
            assert!(nth < 96, "{test}: {kind}: more allocations than expected");
        }
        assert!(failures > 0, "{test}: no {kind} allocation failed");
    }
}
