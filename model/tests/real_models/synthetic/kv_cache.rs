//! The KV cache's types against llama.cpp: the synthetic models with keys and values
//! stored as `q8_0` and `q4_0` (`oracle-kv/`, flash attention on), what a quantized
//! cache refuses, and the context shift's moved keys.

use std::path::PathBuf;

use model::{AttentionMethod, KvType, KvTypes};

use super::{assert_measured, compare_to, open_spec, reference_at, EXACT, REFERENCE_THREADS};

/// llama.cpp's references with a quantized KV cache (flash attention on):
/// `oracle-kv/NAME.K-V.json`.
fn kv_reference_path(name: &str, types: KvTypes) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/oracle-kv")
        .join(format!("{name}.{}-{}.json", types.k, types.v))
}

/// `name` with keys and values stored at `types` against llama.cpp's references for
/// that cache (`oracle-kv/`), to the same bound: the quantized rows, their rotation
/// and their kernels are llama.cpp's.
fn check_kv(name: &str, types: KvTypes) {
    let reference = reference_at(kv_reference_path(name, types));
    let m = rayon::ThreadPoolBuilder::new()
        .num_threads(REFERENCE_THREADS)
        .build()
        .expect("a thread pool")
        .install(|| compare_to(name, EXACT, AttentionMethod::Flash, types, reference));
    assert_measured(name, &format!("ctk {} ctv {}", types.k, types.v), &m);
}

/// A test `$test` for each synthetic model `$name` with its keys and values stored at
/// the types `$k` and `$v`, against llama.cpp's references for that cache.
macro_rules! kv_checks {
    ($($test:ident => $name:literal, $k:ident, $v:ident);* $(;)?) => {$(
        #[test]
        fn $test() {
            check_kv($name, KvTypes { k: KvType::$k, v: KvType::$v });
        }
    )*};
}

kv_checks! {
    llama_q4_k_q8_0_cache_matches_llama_cpp => "llama-q4_k", Q8_0, Q8_0;
    llama_q4_k_q4_0_cache_matches_llama_cpp => "llama-q4_k", Q4_0, Q4_0;
    llama_q4_k_q8_0_keys_matches_llama_cpp => "llama-q4_k", Q8_0, F16;
    llama_q4_k_q4_0_values_matches_llama_cpp => "llama-q4_k", F16, Q4_0;
    qwen3_q8_0_cache_matches_llama_cpp => "qwen3", Q8_0, Q8_0;
    qwen3_q4_0_cache_matches_llama_cpp => "qwen3", Q4_0, Q4_0;
    gemma2_q8_0_cache_matches_llama_cpp => "gemma2", Q8_0, Q8_0;
    gemma2_q4_0_cache_matches_llama_cpp => "gemma2", Q4_0, Q4_0;
    gemma2_q8_0_keys_matches_llama_cpp => "gemma2", Q8_0, F16;
    gemma2_q4_0_values_matches_llama_cpp => "gemma2", F16, Q4_0;
    gemma3_q8_0_cache_matches_llama_cpp => "gemma3", Q8_0, Q8_0;
    gemma3_q4_0_cache_matches_llama_cpp => "gemma3", Q4_0, Q4_0;
    gpt_oss_q8_0_cache_matches_llama_cpp => "gpt-oss", Q8_0, Q8_0;
    gpt_oss_q4_0_cache_matches_llama_cpp => "gpt-oss", Q4_0, Q4_0;
    llama3_q8_0_cache_matches_llama_cpp => "llama3", Q8_0, Q8_0;
    llama3_q4_0_cache_matches_llama_cpp => "llama3", Q4_0, Q4_0;
    phi3_q8_0_cache_matches_llama_cpp => "phi3", Q8_0, Q8_0;
    phi3_q4_0_cache_matches_llama_cpp => "phi3", Q4_0, Q4_0;
    llama_q4_k_long_q8_0_cache_matches_llama_cpp => "llama-q4_k-long", Q8_0, Q8_0;
    llama_q4_k_long_q4_0_cache_matches_llama_cpp => "llama-q4_k-long", Q4_0, Q4_0;
    gemma2_long_q8_0_cache_matches_llama_cpp => "gemma2-long", Q8_0, Q8_0;
    gemma2_long_q4_0_cache_matches_llama_cpp => "gemma2-long", Q4_0, Q4_0;
}

/// Every reference in `oracle-kv/` has its test above.
#[test]
fn every_cache_type_reference_has_a_test() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/oracle-kv");
    let source = include_str!("kv_cache.rs");
    for entry in std::fs::read_dir(&dir).expect("tests/data/oracle-kv") {
        let file = entry
            .expect("an entry")
            .file_name()
            .to_string_lossy()
            .into_owned();
        let Some(stem) = file.strip_suffix(".json") else {
            continue;
        };
        let (name, types) = stem.rsplit_once('.').expect("NAME.K-V.json");
        let (k, v) = types.split_once('-').expect("K-V");
        let k = KvType::parse(k).expect("a cache type").name();
        let v = KvType::parse(v).expect("a cache type").name();
        let line = format!("=> \"{name}\", {}, {};", k.to_uppercase(), v.to_uppercase());
        assert!(
            source.contains(&line),
            "{file} has no test in kv_cache.rs ({line})"
        );
    }
}

/// A context shift turns the moved keys back by the positions dropped: the first
/// layer's keys (which depend on the token and its position alone) are then those a
/// pass over the shorter text computes, up to the rounding of the cache's type.
#[test]
fn shifted_keys_are_the_keys_of_the_shorter_text() {
    for (name, types, bound) in [
        ("llama-q4_k", KvTypes::default(), 4e-3),
        ("qwen3", KvTypes::default(), 4e-3),
        ("phi3-long", KvTypes::default(), 4e-3),
        ("gemma2", KvTypes::default(), 4e-3),
        (
            "llama-q4_k",
            KvTypes {
                k: KvType::Q8_0,
                v: KvType::Q8_0,
            },
            3e-2,
        ),
        (
            "gemma3",
            KvTypes {
                k: KvType::Q8_0,
                v: KvType::F16,
            },
            3e-2,
        ),
    ] {
        let (_dir, _store, model) = open_spec(name);
        let n_vocab = model.config().n_vocab as u32;
        let tokens: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 13) % n_vocab).collect();
        let (keep, discard) = (4, 10);
        let cache = |n| {
            model
                .new_cache(n)
                .with_types(model.config(), types)
                .expect("cache types")
        };
        let mut shifted = cache(40);
        model.forward(&tokens, &mut shifted).expect("forward");
        model
            .shift_cache(&mut shifted, keep, discard)
            .expect("shift");
        assert_eq!(shifted.len(), 40 - discard);
        let shorter: Vec<u32> = tokens[..keep]
            .iter()
            .chain(&tokens[keep + discard..])
            .copied()
            .collect();
        let mut fresh = cache(40);
        model.forward(&shorter, &mut fresh).expect("forward");
        let mut worst = 0.0f32;
        for pos in 0..shorter.len() {
            let (a, b) = (shifted.key(0, pos).unwrap(), fresh.key(0, pos).unwrap());
            let scale = b.iter().fold(1.0f32, |m, v| m.max(v.abs()));
            for (x, y) in a.iter().zip(&b) {
                worst = worst.max((x - y).abs() / scale);
            }
        }
        eprintln!("{name} {types:?}: largest relative difference {worst:.2e}");
        assert!(worst <= bound, "{name} {types:?}: {worst} > {bound}");
        // Without the turn back, the moved keys would be far off.
        let mut unturned = cache(40);
        model.forward(&tokens, &mut unturned).expect("forward");
        let (a, b) = (
            unturned.key(0, keep + discard + 5).unwrap(),
            fresh.key(0, keep + 5).unwrap(),
        );
        let scale = b.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let off = a
            .iter()
            .zip(&b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs() / scale));
        assert!(
            off > 10.0 * bound,
            "{name}: the test would not see a missing shift"
        );
    }
}

/// What llama.cpp refuses for a quantized cache is refused here, with the reason: a
/// head size that is not whole blocks, and (here only) the matrix-product attention.
#[test]
fn cache_types_a_model_cannot_take_are_refused() {
    let (_dir, _store, model) = open_spec("llama-q4_k");
    let q8 = KvTypes {
        k: KvType::Q8_0,
        v: KvType::Q8_0,
    };
    let err = model
        .new_cache(8)
        .with_attention(AttentionMethod::Matmul)
        .with_types(model.config(), q8)
        .expect_err("the matrix-product attention takes an f16 cache");
    assert!(err.to_string().contains("flash attention"), "{err}");
    let mut config = model.config().clone();
    config.head_dim = 72;
    let err = q8
        .check(&config, AttentionMethod::Flash)
        .expect_err("72 is not whole blocks of 32");
    assert!(err.to_string().contains("72"), "{err}");
}
