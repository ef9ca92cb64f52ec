use super::*;
use model::gpu::{GpuEngine, TensorOptions, TensorSplit};

/// A split by tensors over the first two GPUs, or `None` after saying why the test is
/// skipped: fewer than two GPUs, or no collectives library (NCCL or RCCL; the
/// environment's `ROCMFORGE_COLLECTIVES` may name it).
fn tensor_split(test: &str, model: &Model, options: &GpuOptions) -> Option<TensorSplit> {
    let count = hip_backend::Device::count().unwrap_or(0);
    if count < 2 {
        skip(
            test,
            &format!("{count} GPU(s): a split by tensors takes two"),
        );
        return None;
    }
    let split = TensorOptions {
        devices: vec![0, 1],
        library: std::env::var_os("ROCMFORGE_COLLECTIVES").map(Into::into),
    };
    // Prompts in one chunk of up to 128 tokens.
    match TensorSplit::new(model, options, &split, 128) {
        Ok(split) => Some(split),
        Err(model::ModelError::Gpu { source, .. })
            if source.is_unavailable()
                || matches!(source, hip_backend::HipError::CollectivesUnavailable { .. }) =>
        {
            skip(test, &source.to_string());
            None
        }
        Err(error) => panic!("{test}: {error}"),
    }
}

/// Two rows alike within the GPU's tolerance of `a`'s spread, with the same greedy
/// token unless `a`'s top two are within it.
fn alike(test: &str, what: &str, a: &[f32], b: &[f32]) {
    let tol = tolerance(a);
    let (max, rms) = differences(a, b);
    assert!(
        max <= tol && rms <= RMS_OF_SPREAD * spread(a),
        "{test}: {what}: largest difference {max} (bound {tol}), rms {rms}"
    );
    assert!(
        argmax(a) == argmax(b) || margin(a) <= tol,
        "{test}: {what}: greedy tokens {} and {}",
        argmax(a),
        argmax(b)
    );
}

/// A model split by tensors over two GPUs against the model on one: a prompt's logits,
/// decode steps (captured graphs with the all-reduces inside) fed the one device's
/// tokens, the greedy token, every token's logits, the cache cleared and filled again,
/// all within the GPU's tolerance (the devices' partial sums are added in another order
/// than one device's).
fn tensor_matches_one_device(name: &str, test: &str) {
    let (_dir, _store, model) = open_spec(name);
    let (context, batch) = (160, 16);
    let options = GpuOptions::new(UploadMode::Eager, context);
    let Some(mut one) = gpu_model_of(test, &model, &options, batch) else {
        return;
    };
    let Some(mut many) = tensor_split(test, &model, &options) else {
        return;
    };
    assert_eq!(many.devices(), vec![0, 1]);
    let n_vocab = model.config().n_vocab as u32;
    // Longer than the one device's prompt batch; one chunk on the split.
    let prompt: Vec<u32> = (0..90u32).map(|i| (i * 7 + 3) % n_vocab).collect();
    for round in 0..2 {
        let a = one.forward(&prompt).expect("one device");
        let b = many.forward_logits(&prompt).expect("split").to_vec();
        alike(test, &format!("round {round}: the prompt"), &a, &b);
        let mut token = argmax(&a) as u32;
        for step in 0..12 {
            let a = one.forward(&[token]).expect("one device");
            if step % 4 == 3 {
                let greedy = many.forward_argmax(&[token]).expect("split");
                let near_tie = margin(&a) <= tolerance(&a);
                assert!(
                    greedy == argmax(&a) as u32 || near_tie,
                    "{test}: round {round}: step {step}'s greedy token"
                );
            } else {
                let b = many.forward_logits(&[token]).expect("split").to_vec();
                alike(test, &format!("round {round}: step {step}"), &a, &b);
            }
            token = argmax(&a) as u32;
        }
        let tail = [token, 5 % n_vocab, 11 % n_vocab, 2];
        let a = one.forward_all_logits(&tail).expect("one device");
        let b = many.forward_all_logits(&tail).expect("split");
        for (row, (a, b)) in a
            .chunks(n_vocab as usize)
            .zip(b.chunks(n_vocab as usize))
            .enumerate()
        {
            alike(
                test,
                &format!("round {round}: every token's row {row}"),
                a,
                b,
            );
        }
        assert_eq!(many.len(), one.len());
        one.clear().expect("clear");
        many.clear().expect("clear");
    }
    // A call past the context fails on every device before any starts, and leaves the
    // cache as it was.
    many.forward_logits(&prompt).expect("split");
    let long = vec![1u32; context];
    assert!(matches!(
        many.forward_logits(&long),
        Err(model::ModelError::ContextFull { .. })
    ));
    assert_eq!(many.len(), prompt.len());
    one.forward(&prompt).expect("one device");
    let a = one.forward(&[1]).expect("one device");
    let b = many.forward_logits(&[1]).expect("split").to_vec();
    alike(test, "after a refused call", &a, &b);
}

macro_rules! gpu_tensor {
    ($($test:ident => $name:literal),* $(,)?) => {$(
        #[test]
        fn $test() {
            tensor_matches_one_device($name, stringify!($test));
        }
    )*};
}

gpu_tensor! {
    // Biases on the queries, keys and values (cut with their rows), grouped queries.
    gpu_tensor_qwen2_tied => "qwen2-tied",
    // Fused `attn_qkv` and gate/up tensors, cut within their parts.
    gpu_tensor_phi3_long => "phi3-long",
    // Queries and keys normed per head.
    gpu_tensor_qwen3 => "qwen3",
}

/// What a split by tensors cannot cut is refused before anything is uploaded, naming
/// the reason: one key/value head for two devices, an output projection whose share of
/// heads is not whole blocks of its type, a mixture of experts.
#[test]
fn gpu_tensor_refuses_what_it_cannot_cut() {
    let test = "gpu_tensor_refuses_what_it_cannot_cut";
    for (name, reason) in [
        ("llama-mqa", "key/value heads over 2 devices"),
        ("llama-mha-tied", "not whole blocks of 256"),
        ("qwen3moe-random", "a mixture of experts"),
    ] {
        let (_dir, _store, model) = open_spec(name);
        let options = GpuOptions::new(UploadMode::Eager, 32);
        let split = TensorOptions {
            devices: vec![0, 1],
            library: None,
        };
        match TensorSplit::new(&model, &options, &split, 16) {
            Err(model::ModelError::GpuUnsupported { what, .. }) => {
                assert!(what.contains(reason), "{test}: {name}: {what}")
            }
            Err(other) => panic!("{test}: {name}: refused for another reason: {other}"),
            Ok(_) => panic!("{test}: {name}: accepted"),
        }
    }
    // Paged batches (the server's) are refused by the engine, not run wrongly.
    let (_dir, _store, model) = open_spec("qwen2-tied");
    let options = GpuOptions::new(UploadMode::Eager, 32);
    let Some(split) = tensor_split(test, &model, &options) else {
        return;
    };
    let mut engine = GpuEngine::Tensor(Box::new(split));
    let segments = [model::gpu::BatchSegment {
        tokens: &[1, 2],
        first_pos: 0,
        table: &[0],
        logits: true,
    }];
    assert!(matches!(
        engine.launch_batch(&segments),
        Err(model::ModelError::GpuUnsupported { .. })
    ));
}
