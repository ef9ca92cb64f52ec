use super::*;
use model::gpu::{BatchSegment, LayerSplit, PageOptions, SplitOptions};

/// The stages a split takes on this machine: `stages` of them, over every GPU in turn
/// (several stages on one device where there are fewer devices: the same code, with
/// copies within a device instead of between two).
fn devices(stages: usize) -> Vec<usize> {
    let count = hip_backend::Device::count().unwrap_or(1).max(1);
    (0..stages).map(|k| k % count).collect()
}

/// A model split by layers gives the one-device model's results bit for bit: a prompt
/// in several chunks (the stages then run different chunks at once), decode steps
/// through the captured graphs, every token's logits, the greedy token, and the cache
/// cleared and filled again. `ratios` moves the layer boundaries.
fn split_matches_one_device(name: &str, test: &str, stages: usize, ratios: Option<Vec<f64>>) {
    let (_dir, _store, model) = open_spec(name);
    let (context, batch) = (96, 16);
    let options = GpuOptions::new(UploadMode::Background, context);
    let Some(mut one) = gpu_model_of(test, &model, &options, batch) else {
        return;
    };
    let split = SplitOptions {
        devices: devices(stages),
        ratios,
        chunk: None,
    };
    let mut many =
        LayerSplit::new(&model, &options, &split, batch).unwrap_or_else(|e| panic!("{test}: {e}"));
    let layout = many.stages();
    eprintln!("{test}: stages {layout:?}");
    assert_eq!(layout.len(), stages, "{test}");
    assert_eq!(
        layout.last().map(|s| s.1.end),
        Some(model.config().n_layers)
    );
    let n_vocab = model.config().n_vocab as u32;
    let prompt: Vec<u32> = (0..53u32).map(|i| (i * 7 + 3) % n_vocab).collect();
    for round in 0..2 {
        let a = one.forward(&prompt).expect("one device");
        let b = many.forward_logits(&prompt).expect("split").to_vec();
        assert_eq!(
            bits(&a),
            bits(&b),
            "{test}: round {round}: the prompt's logits"
        );
        let mut token = argmax(&a) as u32;
        for step in 0..12 {
            let (a, b) = if step % 3 == 2 {
                let a = one.forward_argmax(&[token]).expect("one device");
                (a, many.forward_argmax(&[token]).expect("split"))
            } else {
                let a = one.forward(&[token]).expect("one device");
                let b = many.forward_logits(&[token]).expect("split").to_vec();
                assert_eq!(bits(&a), bits(&b), "{test}: round {round}: step {step}");
                (argmax(&a) as u32, argmax(&b) as u32)
            };
            assert_eq!(a, b, "{test}: round {round}: step {step}'s token");
            token = a;
        }
        let tail = [token, 5 % n_vocab, 11 % n_vocab, 2];
        let a = one.forward_all_logits(&tail).expect("one device");
        let b = many.forward_all_logits(&tail).expect("split");
        assert_eq!(
            bits(&a),
            bits(&b),
            "{test}: round {round}: every token's logits"
        );
        assert_eq!(many.len(), one.len());
        one.clear().expect("clear");
        many.clear().expect("clear");
    }
    // A call past the context fails and leaves the cache as it was.
    many.forward_logits(&prompt).expect("split");
    let long = vec![1u32; context];
    assert!(matches!(
        many.forward_logits(&long),
        Err(model::ModelError::ContextFull { .. })
    ));
    assert_eq!(many.len(), prompt.len());
}

fn bits(row: &[f32]) -> Vec<u32> {
    row.iter().map(|v| v.to_bits()).collect()
}

macro_rules! gpu_split {
    ($($test:ident => $name:literal over $stages:literal $(at $ratios:expr)?),* $(,)?) => {$(
        #[test]
        fn $test() {
            #[allow(unused_mut, unused_assignments)]
            let mut ratios: Option<Vec<f64>> = None;
            $(ratios = Some($ratios.to_vec());)?
            split_matches_one_device($name, stringify!($test), $stages, ratios);
        }
    )*};
}

gpu_split! {
    gpu_split_llama_q4_k => "llama-q4_k" over 2,
    gpu_split_llama_mha_tied => "llama-mha-tied" over 2,
    gpu_split_qwen2_tied => "qwen2-tied" over 2,
    gpu_split_gemma3 => "gemma3" over 3 at [1.0, 2.0, 3.0],
    gpu_split_phi3_long => "phi3-long" over 2,
    gpu_split_qwen3moe => "qwen3moe-random" over 2,
    gpu_split_gpt_oss => "gpt-oss" over 2 at [3.0, 1.0],
}

/// A prompt flows through the devices in chunks: its logits are those of one device
/// taking chunks of the same size. Cut as asked (`chunk`), and by default, where a
/// model this small keeps its prompt whole (its chunks' products would not outweigh
/// their fixed costs).
#[test]
fn gpu_split_takes_a_prompt_in_the_chunks_of_one_device() {
    let test = "gpu_split_takes_a_prompt_in_the_chunks_of_one_device";
    let (_dir, _store, model) = open_spec("llama-q4_k");
    let options = GpuOptions::new(UploadMode::Eager, 512);
    let chunk = model::gpu::PIPELINE_CHUNK;
    let n_vocab = model.config().n_vocab as u32;
    // Three chunks of the pipeline's size, the last a short one.
    let prompt: Vec<u32> = (0..(2 * chunk + 44) as u32)
        .map(|i| (i * 13 + 1) % n_vocab)
        .collect();
    for (asked, one_batch) in [(Some(chunk), chunk), (None, PROMPT_BATCH)] {
        let Some(mut one) = gpu_model_of(test, &model, &options, one_batch) else {
            return;
        };
        let split = SplitOptions {
            devices: devices(2),
            ratios: None,
            chunk: asked,
        };
        let mut many = LayerSplit::new(&model, &options, &split, PROMPT_BATCH).expect("split");
        let a = one.forward(&prompt).expect("one device");
        let b = many.forward_logits(&prompt).expect("split").to_vec();
        assert_eq!(bits(&a), bits(&b), "{test}: chunks of {asked:?}");
    }
}

/// A split that a device cannot hold is refused, naming the layers and the budget.
#[test]
fn gpu_split_over_a_budget_is_refused() {
    let (_dir, _store, model) = open_spec("llama-q4_k");
    let options = GpuOptions {
        budget: Some(4096),
        ..GpuOptions::new(UploadMode::Background, 32)
    };
    let split = SplitOptions {
        devices: devices(2),
        ratios: None,
        chunk: None,
    };
    match LayerSplit::new(&model, &options, &split, 16) {
        Err(model::ModelError::Gpu { source, .. }) if source.is_unavailable() => {
            skip("gpu_split_over_a_budget_is_refused", &source.to_string())
        }
        Err(model::ModelError::GpuUnsupported { what, .. }) => {
            assert!(
                what.contains("layers 0..") && what.contains("budget"),
                "{what}"
            )
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a split over its budget was accepted"),
    }
}

/// Paged batches over a split: a batch of prompts, then decode steps (captured as
/// graphs), their logits and greedy tokens and the hidden states, the one-device model's
/// bit for bit.
fn paged_batches_match_one_device(name: &str, test: &str) {
    let (_dir, _store, model) = open_spec(name);
    let options = GpuOptions::new(UploadMode::Eager, 128);
    let pages = PageOptions {
        block_size: 16,
        n_blocks: 32,
        max_sequences: 4,
    };
    let one = match GpuModel::with_pages(&model, &options, PROMPT_BATCH, pages) {
        Ok(gpu) => gpu,
        Err(model::ModelError::Gpu { source, .. }) if source.is_unavailable() => {
            return skip(test, &source.to_string())
        }
        Err(e) => panic!("{test}: {e}"),
    };
    let split = SplitOptions {
        devices: devices(2),
        ratios: None,
        chunk: None,
    };
    let many = LayerSplit::with_pages(&model, &options, &split, PROMPT_BATCH, pages)
        .unwrap_or_else(|e| panic!("{test}: {e}"));
    let mut engines = [
        model::gpu::GpuEngine::One(Box::new(one)),
        model::gpu::GpuEngine::Split(many),
    ];
    let n_vocab = model.config().n_vocab as u32;
    let tables: Vec<Vec<u32>> = (0..3u32).map(|s| (s * 8..s * 8 + 8).collect()).collect();
    let prompts: Vec<Vec<u32>> = [5u32, 17, 40]
        .iter()
        .map(|&len| (0..len).map(|i| (i * 11 + len) % n_vocab).collect())
        .collect();
    let mut results: Vec<Vec<Vec<u32>>> = Vec::new();
    for engine in &mut engines {
        let mut seen = Vec::new();
        let segments: Vec<BatchSegment<'_>> = prompts
            .iter()
            .zip(&tables)
            .map(|(p, t)| BatchSegment {
                tokens: p,
                first_pos: 0,
                table: t,
                logits: true,
            })
            .collect();
        let logits = engine.launch_batch(&segments).expect("prompts").logits();
        seen.push(bits(logits.expect("logits")));
        let mut next: Vec<u32> = (0..3).map(|s| 7 + s).collect();
        let mut lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
        for step in 0..6 {
            let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let segments: Vec<BatchSegment<'_>> = (0..3)
                .map(|s| BatchSegment {
                    tokens: &tokens[s],
                    first_pos: lens[s],
                    table: &tables[s],
                    logits: true,
                })
                .collect();
            let launched = engine.launch_batch(&segments).expect("a decode step");
            if step % 2 == 0 {
                next = launched.argmax(&[], &[]).expect("greedy");
                seen.push(next.clone());
            } else {
                let rows = launched.logits().expect("logits");
                seen.push(bits(rows));
                next = (0..3)
                    .map(|s| argmax(&rows[s * n_vocab as usize..][..n_vocab as usize]) as u32)
                    .collect();
            }
            for len in &mut lens {
                *len += 1;
            }
        }
        let last = [next[0], 3 % n_vocab];
        let hidden = engine
            .forward_batch_hidden(&[BatchSegment {
                tokens: &last,
                first_pos: lens[0],
                table: &tables[0],
                logits: false,
            }])
            .expect("hidden states");
        seen.push(bits(&hidden));
        results.push(seen);
    }
    assert_eq!(results[0].len(), results[1].len());
    for (i, (a, b)) in results[0].iter().zip(&results[1]).enumerate() {
        assert_eq!(a, b, "{test}: result {i}");
    }
}

#[test]
fn gpu_split_paged_batches_llama_q4_k() {
    paged_batches_match_one_device("llama-q4_k", "gpu_split_paged_batches_llama_q4_k");
}

#[test]
fn gpu_split_paged_batches_gpt_oss() {
    paged_batches_match_one_device("gpt-oss", "gpu_split_paged_batches_gpt_oss");
}

#[test]
fn gpu_split_scheduler_gemma3() {
    scheduler_on("gemma3", 3);
}

#[test]
fn gpu_split_scheduler_qwen3moe() {
    scheduler_on("qwen3moe-random", 2);
}

/// Which layers each device holds, and what each uploads, need no device: contiguous
/// runs that cover the model, every tensor of the plan uploaded by the device whose
/// layers (or embeddings, or head) use it, and no tensor of a layer elsewhere.
#[test]
fn split_layers_cover_the_model_and_each_device_uploads_its_own() {
    for (name, parts) in [("gemma3", 3), ("llama-q4_k", 2), ("qwen2-tied", 2)] {
        let (_dir, _store, model) = open_spec(name);
        let ranges = model::gpu::split_layers(&model, parts, None).expect("a split");
        assert_eq!(ranges.len(), parts, "{name}");
        assert_eq!(ranges[0].start, 0, "{name}");
        assert_eq!(ranges[parts - 1].end, model.config().n_layers, "{name}");
        assert!(
            ranges.windows(2).all(|w| w[0].end == w[1].start),
            "{name}: {ranges:?}"
        );
        assert!(ranges.iter().all(|r| !r.is_empty()), "{name}: {ranges:?}");
        let orders = model::gpu::stage_orders(&model, &ranges);
        let plan = model.plan();
        for handle in plan.handles() {
            let holders: Vec<usize> = orders
                .iter()
                .enumerate()
                .filter(|(_, o)| o.tensors().iter().any(|t| t.index() == handle.index()))
                .map(|(k, _)| k)
                .collect();
            let layer = handle
                .name()
                .strip_prefix("blk.")
                .and_then(|r| r.split('.').next())
                .and_then(|n| n.parse::<usize>().ok());
            let expected: Vec<usize> = match layer {
                Some(l) => vec![ranges.iter().position(|r| r.contains(&l)).expect("a part")],
                None if handle.index() == plan.output.weight.index()
                    && handle.index() == plan.token_embd.weight.index() =>
                {
                    vec![0, parts - 1]
                }
                None if handle.index() == plan.token_embd.weight.index() => vec![0],
                None if handle.index() == plan.output.weight.index()
                    || handle.index() == plan.output_norm.handle.index() =>
                {
                    vec![parts - 1]
                }
                // Shared by every layer (RoPE factors): each device's first layer's.
                None => holders.clone(),
            };
            assert_eq!(holders, expected, "{name}: {}", handle.name());
            assert!(
                !holders.is_empty(),
                "{name}: {} uploaded nowhere",
                handle.name()
            );
        }
    }
}
