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
/// run on the CPU. Its logits stay within the GPU's tolerance of the CPU's however the
/// routes split (they split differently at every pass as experts are promoted), with
/// every expert resident by use, none (a budget without room for a slot) and a part.
fn pooled(name: &str, test: &str, share: f64) {
    let Some(stats) = check_within(name, test, |m| Some(experts_budget(m, share))) else {
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
}

macro_rules! gpu_pooled {
    ($($test:ident => $name:literal at $share:literal),* $(,)?) => {$(
        #[test]
        fn $test() {
            pooled($name, stringify!($test), $share);
        }
    )*};
}

gpu_pooled! {
    gpu_pooled_qwen3moe_half => "qwen3moe-random" at 0.5,
    gpu_pooled_qwen3moe_none => "qwen3moe-random" at 0.0,
    gpu_pooled_qwen2moe_quarter => "qwen2moe-random" at 0.25,
    gpu_pooled_llama_moe_half => "llama-moe-random" at 0.5,
    gpu_pooled_gpt_oss_half => "gpt-oss" at 0.5,
    gpu_pooled_gpt_oss_long_quarter => "gpt-oss-long" at 0.25,
}
