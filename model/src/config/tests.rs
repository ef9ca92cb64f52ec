use gguf_format::{Array, Value};

use super::*;

/// The metadata of a small model of `arch`, with `extra` keys (`ARCH.` is prefixed
/// to keys that start with a dot).
fn metadata(arch: &str, extra: &[(&str, Value)]) -> Metadata {
    let mut m = Metadata::new();
    m.set("general.architecture", Value::String(arch.into()));
    let key = |k: &str| format!("{arch}.{k}");
    m.set(&key("block_count"), Value::U32(4));
    m.set(&key("embedding_length"), Value::U32(256));
    m.set(&key("feed_forward_length"), Value::U32(512));
    m.set(&key("attention.head_count"), Value::U32(4));
    m.set(&key("attention.head_count_kv"), Value::U32(2));
    m.set(
        "tokenizer.ggml.tokens",
        Value::Array(Array::String(["a", "b"].iter().collect())),
    );
    for (k, v) in extra {
        let k = match k.strip_prefix('.') {
            Some(rest) => key(rest),
            None => (*k).to_owned(),
        };
        m.set(&k, v.clone());
    }
    m
}

#[test]
fn mixtures_of_experts_read_their_experts_as_llama_cpp_does() {
    let experts = |arch: &str, extra: &[(&str, Value)]| {
        ModelConfig::from_metadata(&metadata(arch, extra)).map(|c| c.experts)
    };
    let counts = [
        (".expert_count", Value::U32(128)),
        (".expert_used_count", Value::U32(8)),
    ];
    let with = |more: (&'static str, Value)| {
        let mut v = counts.to_vec();
        v.push(more);
        v
    };
    let e = experts(
        "qwen3moe",
        &with((".expert_feed_forward_length", Value::U32(768))),
    );
    assert_eq!(
        e.unwrap(),
        Some(Experts {
            count: 128,
            used: 8,
            n_ff: 768,
            normalize: true,
            shared_n_ff: None,
            gating: Gating::Softmax,
            activation: ExpertActivation::Silu,
        })
    );
    // Without the experts' width, llama.cpp divides the feed-forward length.
    let e = experts("qwen3moe", &counts).unwrap().unwrap();
    assert_eq!(e.n_ff, 512 / 8);
    let e = experts(
        "qwen2moe",
        &with((".expert_shared_feed_forward_length", Value::U32(96))),
    );
    let e = e.unwrap().unwrap();
    assert!(!e.normalize);
    assert_eq!(e.shared_n_ff, Some(96));
    // Mixtral: a llama file with experts as wide as the feed-forward length.
    let e = experts("llama", &counts).unwrap().unwrap();
    assert_eq!((e.n_ff, e.normalize), (512, true));
    assert_eq!(experts("llama", &[]).unwrap(), None);
    // The GPU runs these mixtures of experts too.
    let c = ModelConfig::from_metadata(&metadata("qwen3moe", &counts)).unwrap();
    c.check_gpu_support().unwrap();
}

#[test]
fn malformed_or_unsupported_experts_are_refused_naming_the_reason() {
    let refusal = |arch: &str, extra: &[(&str, Value)]| {
        ModelConfig::from_metadata(&metadata(arch, extra))
            .unwrap_err()
            .to_string()
    };
    let used = |n: u32| (".expert_used_count", Value::U32(n));
    let count = |n: u32| (".expert_count", Value::U32(n));
    let err = refusal("qwen3moe", &[used(2)]);
    assert!(
        err.contains("qwen3moe.expert_count") && err.contains("none"),
        "{err}"
    );
    let err = refusal("qwen3moe", &[count(0), used(2)]);
    assert!(err.contains("qwen3moe.expert_count"), "{err}");
    let err = refusal("qwen3moe", &[count(8), used(9)]);
    assert!(
        err.contains("qwen3moe.expert_used_count: 9 is outside 1..=8"),
        "{err}"
    );
    let err = refusal("qwen3moe", &[count(8), used(0)]);
    assert!(err.contains("qwen3moe.expert_used_count"), "{err}");
    let err = refusal("qwen3moe", &[count(8)]);
    assert!(err.contains("qwen3moe.expert_used_count"), "{err}");
    let err = refusal("llama", &[count(2000), used(2)]);
    assert!(
        err.contains("llama.expert_count: 2000 is outside 1..=1024"),
        "{err}"
    );
    // A dense architecture whose file declares experts: refused for the experts.
    let err = refusal("qwen2", &[count(8), used(2)]);
    assert!(
        err.contains("qwen2 model with 8 experts") && err.contains("mixture of experts"),
        "{err}"
    );
    // Mixture-of-experts architectures not run yet: named as such.
    for arch in ["deepseek2", "glm4moe", "llama4", "qwen3next", "qwen35moe"] {
        let err = refusal(arch, &[]);
        assert!(
            err.contains(arch) && err.contains("mixture of experts"),
            "{err}"
        );
    }
}

#[test]
fn unknown_architectures_are_refused_naming_the_supported_ones() {
    let err = ModelConfig::from_metadata(&metadata("mamba", &[])).unwrap_err();
    let ModelError::UnsupportedArchitecture { name, supported } = &err else {
        panic!("{err}");
    };
    assert_eq!(name, "mamba");
    for arch in Architecture::SUPPORTED {
        assert!(supported.contains(arch), "{supported}");
    }
}

#[test]
fn qwen3_has_neox_rope_and_its_own_head_size() {
    let m = metadata("qwen3", &[(".attention.key_length", Value::U32(128))]);
    let c = ModelConfig::from_metadata(&m).unwrap();
    assert_eq!(c.architecture, Architecture::Qwen3);
    assert_eq!(c.rope_style, RopeStyle::Halves);
    assert_eq!((c.head_dim, c.head_dim_v, c.rope_dims), (128, 128, 128));
    assert!(!c.scale_queries);
    c.check_gpu_support().unwrap();
}

#[test]
fn gemma2_alternates_windows_and_caps_scores_and_logits_by_default() {
    let m = metadata("gemma2", &[(".rope.scaling.factor", Value::F32(2.0))]);
    let c = ModelConfig::from_metadata(&m).unwrap();
    assert_eq!(c.attn_logit_softcap, Some(50.0));
    assert_eq!(c.final_logit_softcap, Some(30.0));
    let windows: Vec<_> = c.layers.iter().map(|l| l.sliding_window).collect();
    assert_eq!(windows, [Some(4096), None, Some(4096), None]);
    // Gemma 2's local layers keep the file's RoPE base and scale.
    assert!(c.layers.iter().all(|l| l.rope_freq_base == 10_000.0));
    assert!(c.layers.iter().all(|l| l.rope_scale == 2.0));
    assert!(c.scale_queries);
    c.check_gpu_support().unwrap();
}

#[test]
fn gemma3_reads_its_window_pattern_local_base_and_logit_cap() {
    let m = metadata(
        "gemma3",
        &[
            (".attention.sliding_window", Value::U32(512)),
            (".attention.sliding_window_pattern", Value::U32(2)),
            (".rope.freq_base", Value::F32(1e6)),
            (".rope.freq_base_swa", Value::F32(2e4)),
            (".rope.scaling.type", Value::String("linear".into())),
            (".rope.scaling.factor", Value::F32(8.0)),
            (".final_logit_softcapping", Value::F32(30.0)),
        ],
    );
    let c = ModelConfig::from_metadata(&m).unwrap();
    let layers: Vec<_> = c
        .layers
        .iter()
        .map(|l| (l.sliding_window, l.rope_freq_base, l.rope_scale))
        .collect();
    let local = (Some(512), 2e4, 1.0);
    let global = (None, 1e6, 8.0);
    assert_eq!(layers, [local, global, local, global]);
    assert_eq!(c.final_logit_softcap, Some(30.0));
    assert_eq!(c.attn_logit_softcap, None);
    c.check_gpu_support().unwrap();

    // The defaults: five local layers of six at base 10,000, no cap; a per-layer
    // list replaces the period; without a window every layer is global.
    let m = metadata("gemma3", &[(".attention.sliding_window", Value::U32(512))]);
    let c = ModelConfig::from_metadata(&m).unwrap();
    assert!(c.layers.iter().all(|l| l.sliding_window == Some(512)));
    assert!(c.layers.iter().all(|l| l.rope_freq_base == 10_000.0));
    assert_eq!(c.final_logit_softcap, None);
    c.check_gpu_support().unwrap();
    let flags = Value::Array(Array::Bool(vec![false, true, true, false]));
    let m = metadata(
        "gemma3",
        &[
            (".attention.sliding_window", Value::U32(512)),
            (".attention.sliding_window_pattern", flags),
        ],
    );
    let c = ModelConfig::from_metadata(&m).unwrap();
    let windows: Vec<_> = c.layers.iter().map(|l| l.sliding_window).collect();
    assert_eq!(windows, [None, Some(512), Some(512), None]);
    let c = ModelConfig::from_metadata(&metadata("gemma3", &[])).unwrap();
    assert!(c.layers.iter().all(|l| l.sliding_window.is_none()));
}

#[test]
fn gemma_configs_that_contradict_themselves_are_refused_naming_the_key() {
    let flags = Value::Array(Array::Bool(vec![true, false]));
    let m = metadata("gemma2", &[(".attention.sliding_window_pattern", flags)]);
    let err = ModelConfig::from_metadata(&m).unwrap_err();
    assert!(
        matches!(&err, ModelError::InvalidConfig { key, reason }
            if key == "gemma2.attention.sliding_window_pattern" && reason.contains("2 flags for 4 layers")),
        "{err}"
    );
    let m = metadata("gemma2", &[(".attn_logit_softcapping", Value::F32(-1.0))]);
    let err = ModelConfig::from_metadata(&m).unwrap_err();
    assert!(
        matches!(&err, ModelError::InvalidConfig { key, .. } if key == "gemma2.attn_logit_softcapping"),
        "{err}"
    );
}

#[test]
fn the_27b_gemmas_scale_queries_by_the_width_per_head() {
    // llama.cpp knows them by their layer count: 46 (Gemma 2) and 62 (Gemma 3).
    for (arch, layers) in [("gemma2", 46u32), ("gemma3", 62)] {
        let m = metadata(
            arch,
            &[
                (".block_count", Value::U32(layers)),
                (".attention.key_length", Value::U32(128)),
            ],
        );
        let c = ModelConfig::from_metadata(&m).unwrap();
        assert_eq!(c.attention_scale, 1.0 / 64f32.sqrt(), "{arch}");
    }
}

/// gpt-oss's keys, as llama.cpp reads them.
fn gpt_oss(extra: &[(&str, Value)]) -> Metadata {
    gpt_oss_without("", extra)
}

/// [`gpt_oss`] without the key `skip` (`.`-prefixed).
fn gpt_oss_without(skip: &str, extra: &[(&str, Value)]) -> Metadata {
    let mut keys = vec![
        (".expert_count", Value::U32(32)),
        (".expert_used_count", Value::U32(4)),
        (".expert_feed_forward_length", Value::U32(2880)),
        (".attention.key_length", Value::U32(64)),
        (".attention.value_length", Value::U32(64)),
        (".attention.sliding_window", Value::U32(128)),
        (".rope.freq_base", Value::F32(150_000.0)),
        (".rope.scaling.type", Value::String("yarn".into())),
        (".rope.scaling.factor", Value::F32(32.0)),
        (".rope.scaling.original_context_length", Value::U32(4096)),
        (".context_length", Value::U32(131_072)),
    ];
    keys.retain(|(k, _)| *k != skip);
    keys.extend(extra.iter().cloned());
    metadata("gpt-oss", &keys)
}

#[test]
fn gpt_oss_reads_its_experts_windows_and_yarn_as_llama_cpp_does() {
    let c = ModelConfig::from_metadata(&gpt_oss(&[])).unwrap();
    assert_eq!(c.architecture, Architecture::GptOss);
    assert_eq!(c.rope_style, RopeStyle::Halves);
    assert!(c.full_last_layer);
    assert_eq!(c.attention_scale, 1.0 / 8.0);
    let e = c.experts.unwrap();
    assert_eq!((e.count, e.used, e.n_ff, e.normalize), (32, 4, 2880, false));
    assert_eq!(e.gating, Gating::SoftmaxOfChosen);
    assert_eq!(e.activation, ExpertActivation::SwigluOai);
    let windows: Vec<_> = c.layers.iter().map(|l| l.sliding_window).collect();
    assert_eq!(windows, [Some(128), None, Some(128), None]);
    assert!(c.layers.iter().all(|l| l.rope_freq_base == 150_000.0));
    assert!(c.layers.iter().all(|l| l.rope_scale == 32.0));
    let yarn = c.rope_yarn.unwrap();
    assert_eq!(yarn.original_context, 4096);
    assert_eq!(
        (yarn.ext_factor, yarn.beta_fast, yarn.beta_slow),
        (1.0, 32.0, 1.0)
    );
    // llama.cpp's context cancels YaRN's magnitude, each step rounded: 1 or one
    // ulp below it.
    assert!(
        (yarn.attn_factor - 1.0).abs() <= f32::EPSILON,
        "{}",
        yarn.attn_factor
    );
    c.check_gpu_support().unwrap();
    // The correction dimensions of gpt-oss's 64-dimension heads: pairs 8 to 18.
    assert_eq!(
        crate::ops::yarn_corr_dims(64, &yarn, 150_000.0),
        [8.0, 18.0]
    );
    // Its own local base, and a per-layer window list.
    let flags = Value::Array(Array::Bool(vec![false, false, true, true]));
    let c = ModelConfig::from_metadata(&gpt_oss(&[
        (".rope.freq_base_swa", Value::F32(10_000.0)),
        (".attention.sliding_window_pattern", flags),
    ]))
    .unwrap();
    let layers: Vec<_> = c
        .layers
        .iter()
        .map(|l| (l.sliding_window, l.rope_freq_base))
        .collect();
    assert_eq!(
        layers,
        [
            (None, 150_000.0),
            (None, 150_000.0),
            (Some(128), 10_000.0),
            (Some(128), 10_000.0)
        ]
    );
}

#[test]
fn yarn_is_read_for_any_architecture() {
    let m = metadata(
        "qwen2",
        &[
            (".rope.scaling.type", Value::String("yarn".into())),
            (".rope.scaling.factor", Value::F32(4.0)),
            (".rope.scaling.original_context_length", Value::U32(32_768)),
            (".rope.scaling.attn_factor", Value::F32(2.0)),
        ],
    );
    let c = ModelConfig::from_metadata(&m).unwrap();
    let yarn = c.rope_yarn.unwrap();
    assert_eq!(yarn.original_context, 32_768);
    assert_eq!(c.rope_scale, 4.0);
    // The file's attention factor multiplies llama.cpp's YaRN one.
    assert!((yarn.attn_factor - 2.0).abs() <= 2.0 * f32::EPSILON);
    c.check_gpu_support().unwrap();
    // Without YaRN no field is set, and linear scaling still works.
    let m = metadata("qwen2", &[(".rope.scaling.factor", Value::F32(4.0))]);
    let c = ModelConfig::from_metadata(&m).unwrap();
    assert_eq!((c.rope_yarn, c.rope_scale), (None, 4.0));
    let m = metadata(
        "qwen2",
        &[(".rope.scaling.type", Value::String("longrope".into()))],
    );
    let err = ModelConfig::from_metadata(&m).unwrap_err();
    assert!(
        matches!(&err, ModelError::InvalidConfig { key, reason }
            if key == "qwen2.rope.scaling.type" && reason.contains("yarn")),
        "{err}"
    );
}

#[test]
fn yarn_tables_keep_fast_pairs_and_interpolate_slow_ones() {
    let yarn = Yarn {
        ext_factor: 1.0,
        attn_factor: 1.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        original_context: 4096,
    };
    let (dims, base, scale, pos) = (64, 150_000.0f32, 32.0f32, 1000usize);
    let table =
        crate::ops::rope_table([pos].into_iter(), dims, base, scale, None, 1.0, Some(&yarn));
    let mscale = 0.1f32.mul_add(scale.ln(), 1.0);
    for (i, &(cos, sin)) in table.iter().enumerate() {
        let theta = pos as f64 * f64::from(base).powf(-2.0 * i as f64 / dims as f64);
        // Below the ramp (pair 8) the original angle, past it (pair 18) the
        // interpolated one, every value scaled by YaRN's magnitude.
        let expected = if i < 8 {
            Some(theta)
        } else if i >= 18 {
            Some(theta / f64::from(scale))
        } else {
            None
        };
        let norm = f64::from(cos).hypot(f64::from(sin));
        assert!((norm - f64::from(mscale)).abs() < 1e-5, "pair {i}: {norm}");
        if let Some(angle) = expected {
            let got = f64::from(sin).atan2(f64::from(cos));
            let want = angle.sin().atan2(angle.cos());
            assert!((got - want).abs() < 1e-3, "pair {i}: {got} vs {want}");
        }
    }
}

#[test]
fn malformed_gpt_oss_configs_are_refused_naming_the_key() {
    let refusal = |extra: &[(&str, Value)]| {
        ModelConfig::from_metadata(&gpt_oss(extra))
            .unwrap_err()
            .to_string()
    };
    let err = refusal(&[(".attention.sliding_window", Value::U32(0))]);
    assert!(err.contains("gpt-oss.attention.sliding_window"), "{err}");
    let err = refusal(&[(".rope.dimension_count", Value::U32(32))]);
    assert!(err.contains("gpt-oss.rope.dimension_count"), "{err}");
    let err = refusal(&[(".rope.freq_base_swa", Value::F32(-1.0))]);
    assert!(err.contains("gpt-oss.rope.freq_base_swa"), "{err}");
    let err = refusal(&[(".rope.scaling.factor", Value::F32(f32::INFINITY))]);
    assert!(err.contains("gpt-oss.rope.scaling.factor"), "{err}");
    let err = refusal(&[(".expert_used_count", Value::U32(33))]);
    assert!(err.contains("gpt-oss.expert_used_count"), "{err}");
    // Required keys: the window and the experts' count and width.
    for key in [
        ".attention.sliding_window",
        ".expert_feed_forward_length",
        ".expert_count",
    ] {
        let err = ModelConfig::from_metadata(&gpt_oss_without(key, &[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("gpt-oss{key}")), "{err}");
    }
}

#[test]
fn phi3_reads_its_long_context_rope_keys_and_ignores_its_window() {
    let m = metadata(
        "phi3",
        &[
            (".context_length", Value::U32(131_072)),
            (".rope.scaling.original_context_length", Value::U32(4096)),
            (".rope.scaling.attn_factor", Value::F32(1.19)),
            (".attention.sliding_window", Value::U32(262_144)),
        ],
    );
    let c = ModelConfig::from_metadata(&m).unwrap();
    assert_eq!(c.architecture, Architecture::Phi3);
    assert_eq!((c.rope_original_context, c.n_ctx_train), (4096, 131_072));
    assert_eq!(c.rope_attn_factor, 1.19);
    assert_eq!(c.rope_style, RopeStyle::Halves);
    assert!(c.scale_queries);
    assert!(c.layers.iter().all(|l| l.sliding_window.is_none()));
    c.check_gpu_support().unwrap();
    let m = metadata("phi3", &[(".rope.scaling.attn_factor", Value::F32(0.0))]);
    let err = ModelConfig::from_metadata(&m).unwrap_err();
    assert!(
        matches!(&err, ModelError::InvalidConfig { key, .. } if key == "phi3.rope.scaling.attn_factor"),
        "{err}"
    );
}
