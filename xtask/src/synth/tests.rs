use super::*;

fn preset(name: &str) -> &'static Preset {
    PRESETS.iter().find(|p| p.name == name).unwrap()
}

/// A tokenizer of SmolLM2's vocabulary size, all [`declare`] reads of one.
fn tokenizer() -> gguf_format::Metadata {
    let mut tokenizer = gguf_format::Metadata::new();
    let tokens: Vec<String> = (0..49_152).map(|i| format!("t{i}")).collect();
    tokenizer
        .insert("tokenizer.ggml.tokens".into(), tokens.into())
        .unwrap();
    tokenizer
}

/// The type and shape `w` declares tensor `name` with.
fn type_and_shape(w: &GgufWriter, name: &str) -> (GgmlType, Vec<u64>) {
    let t = w.tensors().iter().find(|t| t.name == name).unwrap();
    (t.ggml_type, t.shape.clone())
}

#[test]
fn both_usages_name_every_preset() {
    for p in PRESETS {
        assert!(
            USAGE.contains(p.name),
            "{} missing from synth.rs's usage",
            p.name
        );
        assert!(
            crate::USAGE.contains(p.name),
            "{} missing from main.rs's usage",
            p.name
        );
    }
}

#[test]
fn scales_are_small_finite_halves() {
    for bits in [0u64, 1, 4, 0x3ff00, u64::MAX, 0x1234_5678_9abc_def0] {
        let h = small_f16(bits);
        let exponent = (h >> 10) & 0x1f;
        assert!((1..=5).contains(&exponent), "{h:#x}");
    }
}

#[test]
fn every_quantized_block_gets_its_scales_set() {
    let mut rng = Rng::new(7);
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::IQ4_XS,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
    ] {
        let block = ty.type_size() as usize;
        let mut data = vec![0xffu8; block * 3];
        fill_blocks(ty, &mut data, &mut rng);
        for b in data.chunks_exact(block) {
            for &(at, negative) in f16_fields(ty) {
                let h = u16::from_le_bytes([b[at], b[at + 1]]);
                assert_eq!(h & 0x8000 != 0, negative, "{ty:?}");
                assert!(((h >> 10) & 0x1f) <= 5, "{ty:?} scale {h:#x} is not small");
            }
        }
    }
}

/// K-quant blocks decode to weights that average about 0 (a router's rows too), so
/// that a random mixture of experts' tokens spread over its experts.
#[test]
fn k_quant_weights_and_routers_are_centred() {
    let mut rng = Rng::new(11);
    // Each group's scale and minimum as llama.cpp unpacks them (`get_scale_min_k4`).
    let scale_min = |q: &[u8], j: usize| {
        if j < 4 {
            (q[j] & 63, q[j + 4] & 63)
        } else {
            (
                (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
                (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
            )
        }
    };
    for (ty, levels) in [(GgmlType::Q4_K, 16.0), (GgmlType::Q5_K, 32.0)] {
        let block = ty.type_size() as usize;
        let mut data = vec![0u8; block * 8];
        fill_blocks(ty, &mut data, &mut rng);
        for b in data.chunks_exact(block) {
            assert_eq!(b[0..2], b[2..4], "{ty:?}: dmin is d");
            for j in 0..8 {
                let (sc, m) = scale_min(&b[4..16], j);
                // The mean of sc · q − m over uniform quants 0..levels-1.
                let mean = f32::from(sc) * (levels - 1.0) / 2.0 - f32::from(m);
                assert!(sc > 0 && mean.abs() < 0.6, "{ty:?} group {j}: {sc} {m}");
            }
        }
    }
    let mut router = vec![0u8; 4 * 4096];
    fill_router(&mut router, &mut rng);
    let values: Vec<f32> = router
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let mean = values.iter().sum::<f32>() / values.len() as f32;
    assert!(
        mean.abs() < 0.005 && values.iter().all(|v| v.abs() <= 0.1),
        "{mean}"
    );
}

/// A skewed router's scales give the published spread: top 8 of 128 logits drawn
/// at those scales put 90% of the routes on about 65 experts and about 4.3% on the
/// first; each layer favours other experts; the rows are scaled whole.
#[test]
fn skewed_routers_favour_experts_as_qwen3_moe_s_do() {
    let (count, used, tokens) = (128, 8, 20_000);
    let scales = router_scales(count, 0);
    let mut rng = Rng::new(5);
    let mut uniform = || ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let mut routes = vec![0u64; count];
    for _ in 0..tokens {
        let mut logits: Vec<(f64, usize)> = (0..count)
            .map(|e| {
                let gauss =
                    (-2.0 * uniform().ln()).sqrt() * (2.0 * std::f64::consts::PI * uniform()).cos();
                (gauss * f64::from(scales[e]), e)
            })
            .collect();
        logits.sort_by(|a, b| b.0.total_cmp(&a.0));
        for &(_, e) in &logits[..used] {
            routes[e] += 1;
        }
    }
    routes.sort_unstable_by(|a, b| b.cmp(a));
    let total = (tokens * used) as f64;
    let mut covered = 0.0;
    let ninety = routes
        .iter()
        .position(|&n| {
            covered += n as f64 / total;
            covered >= 0.9
        })
        .unwrap()
        + 1;
    let top = routes[0] as f64 / total;
    assert!(
        (60..=70).contains(&ninety),
        "90% of routes on {ninety} experts"
    );
    assert!((0.038..0.048).contains(&top), "busiest expert {top}");
    assert_ne!(router_scales(count, 1), scales, "each layer its own order");
    let mut sorted = scales.clone();
    sorted.sort_by(f32::total_cmp);
    let mut again = router_scales(count, 3);
    again.sort_by(f32::total_cmp);
    assert_eq!(sorted, again, "the same spread in every layer");
    // Rows of width 3 from value 6 on (experts 2 and 3), all ones before.
    let mut rows = [1.0f32; 6]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect::<Vec<_>>();
    skew_router(&mut rows, 6, 3, count, 0);
    let got: Vec<f32> = rows
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(
        got,
        [scales[2]; 3]
            .iter()
            .chain(&[scales[3]; 3])
            .copied()
            .collect::<Vec<_>>()
    );
}

/// The 135m preset declares exactly SmolLM2's tensors: names, types and shapes.
#[test]
fn the_135m_preset_matches_the_real_smollm2() {
    let real = crate::fetch::models_dir().join(crate::fetch::SMOLLM2.file_name);
    let Ok(store) = tensor_store::TensorStore::open(&real) else {
        eprintln!(
            "SKIPPED the_135m_preset_matches_the_real_smollm2: no {}",
            real.display()
        );
        return;
    };
    let w = declare(preset("135m-q4_1"), store.metadata()).unwrap();
    let mut ours: Vec<_> = w
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.ggml_type, t.shape.clone()))
        .collect();
    let mut theirs: Vec<_> = store
        .tensors()
        .map(|t| (t.name().to_owned(), t.ggml_type(), t.shape().to_vec()))
        .collect();
    ours.sort_by(|a, b| a.0.cmp(&b.0));
    theirs.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(ours, theirs);
    for key in [
        "llama.block_count",
        "llama.embedding_length",
        "llama.attention.head_count_kv",
    ] {
        assert_eq!(
            w.metadata().get_u32(key).unwrap(),
            store.metadata().get_u32(key).unwrap(),
            "{key}"
        );
    }
}

/// Every mixed preset's types at the layers where llama-quantize's rules change (the
/// first 2 and 4, the first sixteenth and eighth of 32 layers), with its embeddings and
/// output, as `llama_tensor_get_type` assigns them to Llama-2-7B's tensors.
#[test]
fn the_mixed_presets_follow_llama_quantize_per_tensor() {
    use GgmlType::*;
    // Per preset: embeddings and output.
    let ends = [
        ("7b-q2_k", Q2_K, Q6_K),
        ("7b-q3_k_s", Q3_K, Q6_K),
        ("7b-q3_k_m", Q3_K, Q6_K),
        ("7b-q3_k_l", Q3_K, Q6_K),
        ("7b-q4_k_s", Q4_K, Q6_K),
        ("7b-iq4_xs", IQ4_XS, Q6_K),
        ("7b-iq3_m", IQ3_S, Q6_K),
        ("7b-iq2_m", IQ3_S, Q5_K),
    ];
    // Per preset: the type of attn_q, attn_k, ffn_gate and ffn_up, then those of
    // attn_v, attn_output and ffn_down in the first `k` of layers 0, 1, 2, 3, 4, 31
    // and in the others.
    let layers = [
        (Q2_K, 0, [Q3_K; 3], [Q3_K; 3]),
        (Q3_K, 0, [Q3_K; 3], [Q3_K; 3]),
        (Q3_K, 2, [Q5_K, Q4_K, Q5_K], [Q4_K; 3]),
        (Q3_K, 0, [Q5_K; 3], [Q5_K; 3]),
        (Q4_K, 4, [Q5_K, Q4_K, Q5_K], [Q4_K; 3]),
        (IQ4_XS, 4, [IQ4_XS, IQ4_XS, Q5_K], [IQ4_XS; 3]),
        (IQ3_S, 4, [Q4_K; 3], [Q4_K, Q4_K, IQ3_S]),
        (IQ2_S, 4, [IQ3_S; 3], [IQ3_S, IQ3_S, IQ2_S]),
    ];
    let roles = [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ];
    for ((name, embd, output), (rest, k, first, after)) in ends.into_iter().zip(layers) {
        let p = preset(name);
        assert_eq!(p.embd_tensor_type(), embd, "{name} token_embd");
        assert_eq!(p.output_tensor_type(), Some(output), "{name} output");
        for (i, layer) in [0, 1, 2, 3, 4, 31].into_iter().enumerate() {
            let [v, o, down] = if i < k { first } else { after };
            let types = [rest, rest, v, o, rest, rest, down];
            for (role, ty) in roles.into_iter().zip(types) {
                assert_eq!(p.layer_type(role, layer), ty, "{name} {role} {layer}");
            }
        }
    }
}

/// Four query heads per KV head move attn_v up in Q2_K, IQ4_XS and IQ2_M; rows that
/// are not whole 256-value blocks take llama-quantize's fallback types, and the
/// output then Q8_0.
#[test]
fn the_mixes_follow_grouped_heads_and_fall_back_on_partial_blocks() {
    use GgmlType::*;
    for (name, v) in [("7b-q2_k", Q4_K), ("7b-iq4_xs", Q5_K), ("7b-iq2_m", Q4_K)] {
        let grouped = Preset {
            n_kv_heads: 8,
            ..*preset(name)
        };
        assert_eq!(grouped.layer_type("attn_v", 10), v, "{name}");
        let fewer = Preset {
            n_kv_heads: 16,
            ..*preset(name)
        };
        assert_eq!(
            fewer.layer_type("attn_v", 10),
            preset(name).layer_type("attn_v", 10)
        );
    }
    // SmolLM2-135M's widths: 576 (2.25 blocks of 256) and 1536 (6 blocks).
    let narrow = |name: &str| Preset {
        n_embd: 576,
        n_ff: 1536,
        n_heads: 9,
        n_kv_heads: 3,
        ..*preset(name)
    };
    let q3l = narrow("7b-q3_k_l");
    assert_eq!(q3l.layer_type("attn_q", 5), Q4_0);
    assert_eq!(q3l.layer_type("attn_v", 5), Q5_1);
    assert_eq!(q3l.layer_type("ffn_down", 5), Q5_K);
    assert_eq!(q3l.embd_tensor_type(), Q4_0);
    assert_eq!(q3l.output_tensor_type(), Some(Q8_0));
    let q4s = narrow("7b-q4_k_s");
    assert_eq!(q4s.layer_type("ffn_up", 5), Q5_0);
    assert_eq!(q4s.layer_type("ffn_down", 5), Q4_K);
    let iq2 = narrow("7b-iq2_m");
    assert_eq!(iq2.layer_type("attn_q", 5), IQ4_NL);
    assert_eq!(iq2.layer_type("ffn_down", 5), IQ2_S);
    assert_eq!(iq2.embd_tensor_type(), IQ4_NL);
    assert_eq!(iq2.output_tensor_type(), Some(Q8_0));
    assert_eq!(fallback(Q6_K, 576), Q8_0);
    assert_eq!(fallback(Q4_K, 100), F16);
    assert_eq!(fallback(Q4_K, 512), Q4_K);
}

#[test]
fn the_7b_preset_has_llama_2_shapes_and_about_4_gib() {
    let w = declare(preset("7b-q4k"), &tokenizer()).unwrap();
    assert_eq!(w.tensors().len(), 3 + 9 * 32);
    let params: u64 = w
        .tensors()
        .iter()
        .map(|t| t.shape.iter().product::<u64>())
        .sum();
    assert_eq!(params, 6_878_924_800);
    let bytes = w.layout().unwrap().file_len;
    assert!((4_200_000_000..4_400_000_000).contains(&bytes), "{bytes}");
    assert_eq!(
        type_and_shape(&w, "blk.3.ffn_down.weight"),
        (GgmlType::Q6_K, vec![11008, 4096])
    );
}

/// The 70B: Llama-2-70B's shapes, llama-quantize's Q4_K_M types for a 70B layer by
/// layer (80 layers: the first and last 10, and every third from layer 12, get Q6_K
/// attn_v and ffn_down), about 39 GiB.
#[test]
fn the_70b_preset_has_llama_2_70b_shapes_and_its_q4_k_m_types() {
    use GgmlType::*;
    let p = preset("70b-q4k");
    let w = declare(p, &tokenizer()).unwrap();
    assert_eq!(w.tensors().len(), 3 + 9 * 80);
    let bytes = w.layout().unwrap().file_len;
    assert!((40_000_000_000..43_000_000_000).contains(&bytes), "{bytes}");
    assert_eq!(
        type_and_shape(&w, "blk.79.attn_k.weight"),
        (Q4_K, vec![8192, 1024])
    );
    assert_eq!(
        type_and_shape(&w, "blk.0.ffn_down.weight"),
        (Q6_K, vec![28_672, 8192])
    );
    let more_bits: Vec<u32> = (0..80)
        .filter(|&l| p.layer_type("ffn_down", l) == Q6_K)
        .collect();
    let expected: Vec<u32> = (0..10).chain((12..70).step_by(3)).chain(70..80).collect();
    assert_eq!(more_bits, expected);
    for l in 0..80 {
        let v = if expected.contains(&l) { Q6_K } else { Q5_K };
        let down = if expected.contains(&l) { Q6_K } else { Q4_K };
        assert_eq!(p.layer_type("attn_v", l), v, "attn_v {l}");
        assert_eq!(p.layer_type("ffn_down", l), down, "ffn_down {l}");
        for role in ["attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"] {
            assert_eq!(p.layer_type(role, l), Q4_K, "{role} {l}");
        }
    }
    assert_eq!(p.output_tensor_type(), Some(Q6_K));
}

#[test]
fn the_gpt_oss_preset_reads_as_gpt_oss_20b() {
    let w = declare(preset("gpt-oss-20b-mxfp4"), &tokenizer()).unwrap();
    let layout = w.layout().unwrap();
    let file = gguf_format::parse_prefix(&layout.header, layout.file_len).unwrap();
    let config = model::ModelConfig::from_metadata(&file.metadata).unwrap();
    assert_eq!(config.architecture, model::Architecture::GptOss);
    assert_eq!(
        (
            config.n_layers,
            config.n_embd,
            config.n_heads,
            config.n_kv_heads
        ),
        (24, 2880, 64, 8)
    );
    assert_eq!(config.head_dim, 64);
    let e = config.experts.unwrap();
    assert_eq!((e.count, e.used, e.n_ff), (32, 4, 2880));
    assert!(config.rope_yarn.is_some());
    let windows = config
        .layers
        .iter()
        .filter(|l| l.sliding_window == Some(128));
    assert_eq!(windows.count(), 12);
    config.check_gpu_support().unwrap();
    // The experts in MXFP4 with their biases; about 11 GiB.
    assert_eq!(
        type_and_shape(&w, "blk.5.ffn_gate_exps.weight"),
        (GgmlType::MXFP4, vec![2880, 2880, 32])
    );
    assert!(w
        .tensors()
        .iter()
        .any(|t| t.name == "blk.5.ffn_down_exps.bias"));
    assert!((11_000_000_000..12_500_000_000).contains(&layout.file_len));
}

#[test]
fn the_mxfp4_moe_preset_takes_llama_quantizes_types() {
    let w = declare(preset("qwen3moe-30b-a3b-mxfp4"), &tokenizer()).unwrap();
    // Every expert tensor MXFP4; every other matrix Q8_0; the router and norms F32.
    for (name, ty) in [
        ("blk.7.ffn_gate_exps.weight", GgmlType::MXFP4),
        ("blk.7.ffn_up_exps.weight", GgmlType::MXFP4),
        ("blk.7.ffn_down_exps.weight", GgmlType::MXFP4),
        ("blk.7.attn_q.weight", GgmlType::Q8_0),
        ("blk.7.attn_k.weight", GgmlType::Q8_0),
        ("blk.7.attn_v.weight", GgmlType::Q8_0),
        ("blk.7.attn_output.weight", GgmlType::Q8_0),
        ("blk.7.ffn_gate_inp.weight", GgmlType::F32),
        ("token_embd.weight", GgmlType::Q8_0),
        ("output.weight", GgmlType::Q8_0),
    ] {
        assert_eq!(type_and_shape(&w, name).0, ty, "{name}");
    }
    assert_eq!(
        type_and_shape(&w, "blk.7.ffn_down_exps.weight").1,
        vec![768, 2048, 128]
    );
    let layout = w.layout().unwrap();
    let file = gguf_format::parse_prefix(&layout.header, layout.file_len).unwrap();
    assert_eq!(
        file.metadata
            .get("general.file_type")
            .and_then(|v| v.as_integer()),
        Some(38)
    );
    let config = model::ModelConfig::from_metadata(&file.metadata).unwrap();
    config.check_gpu_support().unwrap();
}
