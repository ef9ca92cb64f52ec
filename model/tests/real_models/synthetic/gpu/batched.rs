use super::*;

/// Several sequences of different lengths in one paged cache, run together as a
/// server's steps run them, each against the same sequence run alone (the contiguous
/// cache, its decode step captured): prompts of 1 to 40 tokens (the split attention
/// and, past `MAX_BATCH`, the tiled one), a prompt that arrives while the others
/// decode, one that starts on a block another sequence computed (a shared prefix), and
/// blocks handed out out of order. Teacher-forced with the tokens each sequence chose
/// alone, every row of logits is held to the tolerance rule above. The decoding
/// steps' captured graphs give the bits of the same launches queued one by one. Both
/// caches hold `types`.
pub(super) fn batched(name: &str, types: model::KvTypes) {
    use model::constraint::TokenMask;
    use model::gpu::{BatchSegment, PageOptions};
    let test = match types.is_quantized() {
        false => format!("gpu_batched_{name}"),
        true => format!("gpu_batched_{}_{}_{name}", types.k, types.v),
    };
    let (_dir, _store, model) = open_spec(name);
    let n_vocab = model.config().n_vocab as u32;
    let (context, block, steps) = (96usize, 16usize, 12usize);
    let stream = |seed: u32, len: usize| -> Vec<u32> {
        (0..len as u32)
            .map(|i| (seed.wrapping_mul(7919) + i * 31 + i * i) % n_vocab)
            .collect()
    };
    // (prompt, the step it arrives at, positions already in the pool (shared)).
    let long = stream(5, 40);
    let mut shared = long[..block].to_vec();
    shared.extend(stream(6, 6));
    let seqs: Vec<(Vec<u32>, usize, usize)> = vec![
        (stream(1, 3), 0, 0),
        (stream(2, 9), 0, 0),
        (stream(3, 20), 0, 0),
        (stream(4, 1), 0, 0),
        (long, 2, 0),
        (shared, 4, block),
    ];
    let options = GpuOptions {
        kv_types: types,
        ..GpuOptions::new(UploadMode::Eager, context)
    };
    let Some(mut alone) = gpu_model_of(&test, &model, &options, PROMPT_BATCH) else {
        return;
    };
    // Alone: the logits after the prompt and after each greedy token.
    let mut expected: Vec<(Vec<u32>, Vec<Vec<f32>>)> = Vec::new();
    for (prompt, _, _) in &seqs {
        alone.clear().expect("clear");
        let mut rows = vec![alone.forward(prompt).expect("prompt alone")];
        let mut fed = Vec::new();
        for _ in 0..steps {
            let token = argmax(rows.last().expect("a row")) as u32;
            fed.push(token);
            rows.push(alone.forward(&[token]).expect("decode alone"));
        }
        expected.push((fed, rows));
    }
    drop(alone);
    let pages = PageOptions {
        block_size: block,
        n_blocks: 64,
        max_sequences: 8,
    };
    let mut gpu = GpuModel::with_pages(&model, &options, PROMPT_BATCH, pages)
        .unwrap_or_else(|e| panic!("{test}: {e}"));
    // Blocks out of order (7 is prime to 64); the shared sequence's first block is
    // the long one's.
    let mut tables: Vec<Vec<u32>> = (0..seqs.len())
        .map(|i| {
            (0..context / block)
                .map(|j| ((i * 6 + j) * 7 % 64) as u32)
                .collect()
        })
        .collect();
    tables[5][0] = tables[4][0];
    let (mut worst, mut rows_checked) = (0f32, 0);
    let mut reroutes = Reroutes::of(name);
    for step in 0..steps + 6 {
        // Each sequence's feed at this step: its prompt, then one token a step.
        let mut feeds = Vec::new();
        for (i, (prompt, arrives, skip)) in seqs.iter().enumerate() {
            let Some(k) = step.checked_sub(*arrives) else {
                continue;
            };
            if k > steps {
                continue;
            }
            let fed = &expected[i].0;
            let (first_pos, tokens) = if k == 0 {
                (*skip, &prompt[*skip..])
            } else {
                (prompt.len() + k - 1, &fed[k - 1..k])
            };
            feeds.push((i, k, first_pos, tokens));
        }
        if feeds.is_empty() {
            break;
        }
        let segments: Vec<BatchSegment<'_>> = feeds
            .iter()
            .map(|&(i, _, first_pos, tokens)| BatchSegment {
                tokens,
                first_pos,
                table: &tables[i],
                logits: true,
            })
            .collect();
        let logits = gpu
            .forward_batch(&segments)
            .unwrap_or_else(|e| panic!("{test}: step {step}: {e}"))
            .to_vec();
        assert_eq!(logits.len(), feeds.len() * n_vocab as usize, "{test}: rows");
        // A step of one token per sequence replays the graph captured for that many
        // sequences (at other positions, over other blocks, the first time it met
        // them); the same launches queued one by one give the same bits.
        gpu.set_batch_graphs(false);
        let direct = gpu
            .forward_batch(&segments)
            .unwrap_or_else(|e| panic!("{test}: step {step}, launched one by one: {e}"));
        assert!(
            direct
                .iter()
                .zip(&logits)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{test}: step {step}: the captured step's logits differ from its launches'"
        );
        gpu.set_batch_graphs(true);
        for (row, &(i, k, _, _)) in logits.chunks(n_vocab as usize).zip(&feeds) {
            let want = &expected[i].1[k];
            let sigma = spread(want).max(f32::MIN_POSITIVE);
            let tol = tolerance(want);
            let diff = want
                .iter()
                .zip(row)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let within = diff <= tol && (argmax(want) == argmax(row) || margin(want) <= tol);
            if reroutes.count(!within) {
                rows_checked += 1;
                continue;
            }
            assert!(
                diff <= tol && (argmax(want) == argmax(row) || margin(want) <= tol),
                "{test}: step {step}, sequence {i}, row {k}: logits differ by {:.3} of \
                 their spread from the sequence alone, argmax {} vs {}",
                diff / sigma,
                argmax(want),
                argmax(row)
            );
            worst = worst.max(diff / sigma);
            rows_checked += 1;
        }
        // The same step again (it writes the same keys and values), greedy on the
        // device: each row's first highest logit.
        let tokens = gpu.forward_batch_argmax(&segments).expect("argmax batch");
        let want: Vec<u32> = logits
            .chunks(n_vocab as usize)
            .map(|r| argmax(r) as u32)
            .collect();
        assert_eq!(tokens, want, "{test}: step {step}: device argmax");
        // And with biases added on the device (each row's best token banned, another
        // raised): the first highest of the rows with the biases added here.
        let nv = n_vocab as usize;
        let biases: Vec<(usize, u32, f32)> = want
            .iter()
            .enumerate()
            .flat_map(|(row, &top)| {
                let other = (top + 1 + 7 * row as u32) % n_vocab;
                [(row, top, f32::NEG_INFINITY), (row, other, 0.75)]
            })
            .collect();
        let biased = gpu
            .forward_batch_argmax_biased(&segments, &biases)
            .expect("biased argmax batch");
        // Each row's first highest here: its biases added (f32 adds), then its mask.
        let on_host = |masks: &[(usize, TokenMask)]| -> Vec<u32> {
            logits
                .chunks(nv)
                .enumerate()
                .map(|(row, r)| {
                    let mut r = r.to_vec();
                    for &(_, t, b) in biases.iter().filter(|e| e.0 == row) {
                        r[t as usize] += b;
                    }
                    if let Some((_, mask)) = masks.iter().find(|m| m.0 == row) {
                        mask.apply(&mut r);
                    }
                    argmax(&r) as u32
                })
                .collect()
        };
        assert_eq!(
            biased,
            on_host(&[]),
            "{test}: step {step}: device argmax of biased rows"
        );
        // Launched, its logits are the same bits; and its greedy tokens held to masks
        // (a grammar's) besides the biases: every other row's mask leaves out its best
        // token and a fifth of the others, the other rows are free.
        let launched = gpu.launch_batch(&segments).expect("launched batch");
        let again = launched.logits().expect("launched batch's logits");
        assert!(
            again
                .iter()
                .zip(&logits)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{test}: step {step}: a launched batch's logits differ"
        );
        let masks: Vec<(usize, TokenMask)> = logits
            .chunks(nv)
            .enumerate()
            .step_by(2)
            .map(|(row, r)| {
                let top = argmax(r) as u32;
                let free = |t: u32| t != top && !(7 * t + (row + step) as u32).is_multiple_of(5);
                (
                    row,
                    TokenMask::from_tokens(nv, (0..n_vocab).filter(|&t| free(t))),
                )
            })
            .collect();
        let refs: Vec<(usize, &TokenMask)> = masks.iter().map(|(r, m)| (*r, m)).collect();
        let launched = gpu.launch_batch(&segments).expect("launched batch");
        assert_eq!(launched.rows(), logits.len() / nv, "{test}: launched rows");
        let masked = launched
            .argmax(&biases, &refs)
            .expect("masked argmax batch");
        assert_eq!(
            masked,
            on_host(&masks),
            "{test}: step {step}: device argmax of biased, masked rows"
        );
    }
    assert_eq!(
        rows_checked,
        seqs.len() * (steps + 1),
        "{test}: rows checked"
    );
    reroutes.check(&test);
    eprintln!(
        "gpu batched {name:<13} {rows_checked} rows of {} sequences, largest |Δ| {worst:.3} \
         of the spread from each alone",
        seqs.len()
    );
}

/// The continuous-batching scheduler on a GPU (the steps through
/// `GpuModel::forward_batch`, the pool's blocks its paged cache): eight concurrent
/// greedy requests of different lengths, sharing a prefix, each give the text of the
/// same prompt run alone on the GPU's contiguous cache, or part ways at a near tie of
/// the alone run (its top two within the tolerance rule); the device cache's counters
/// reach the scheduler's metrics.
pub(super) fn scheduler_on_gpu(name: &str) {
    scheduler_on(name, 1);
}

/// [`scheduler_on_gpu`] with the model split by layers over `stages` devices (more than
/// one; several stages share a device where the machine has fewer).
pub(super) fn scheduler_on(name: &str, stages: usize) {
    use std::sync::atomic::AtomicBool;
    use std::sync::{mpsc, Arc};
    use std::time::Duration;

    use model::sampling::SamplingParams;
    use model::serve::{Event, Request, Scheduler, SchedulerConfig};

    let test = format!("gpu_scheduler_{name}_over_{stages}");
    let (_dir, store, model) = open_spec(name);
    let tokenizer = Arc::new(Tokenizer::from_metadata(store.metadata()).expect("tokenizer"));
    let n_vocab = model.config().n_vocab as u32;
    let (context, max_tokens) = (160usize, 24usize);
    let stream = |seed: u32, len: usize| -> Vec<u32> {
        (0..len as u32)
            .map(|i| 1 + (seed.wrapping_mul(7919) + i * 31 + i * i) % (n_vocab - 1))
            .collect()
    };
    let shared = stream(9, 40);
    let mut prompts: Vec<Vec<u32>> = [1, 5, 9, 17, 33, 70]
        .iter()
        .enumerate()
        .map(|(i, &len)| stream(i as u32 + 1, len))
        .collect();
    for tail in [3, 11] {
        let mut p = shared.clone();
        p.extend(stream(20 + tail, tail as usize));
        prompts.push(p);
    }
    // Alone: greedy tokens (to the first end-of-generation token) and the logits
    // each was chosen from.
    let Some(mut alone) = gpu_model(&test, &model, UploadMode::Eager, context) else {
        return;
    };
    let mut expected = Vec::new();
    for prompt in &prompts {
        alone.clear().expect("clear");
        let mut logits = alone.forward(prompt).expect("prompt alone");
        let (mut tokens, mut rows) = (Vec::new(), Vec::new());
        while tokens.len() < max_tokens {
            let token = argmax(&logits) as u32;
            rows.push(logits.clone());
            tokens.push(token);
            if tokenizer.is_end_of_generation(token) {
                break;
            }
            logits = alone.forward(&[token]).expect("decode alone");
        }
        expected.push((tokens, rows));
    }
    drop(alone);
    let config = SchedulerConfig {
        max_sequences: 8,
        max_queue: 16,
        step_tokens: 64,
        context_size: context,
        pool_positions: 4 * context,
        block_size: 16,
        attention: model::AttentionMethod::default(),
        kv_types: model::KvTypes::default(),
        context_shift: None,
    };
    let options = GpuOptions::new(UploadMode::Background, context);
    let tokens = Arc::clone(&tokenizer);
    let scheduler = if stages > 1 {
        let count = hip_backend::Device::count().unwrap_or(1).max(1);
        let split = model::gpu::SplitOptions {
            devices: (0..stages).map(|k| k % count).collect(),
            ratios: None,
            chunk: None,
        };
        Scheduler::start_on_gpus(model.clone(), tokens, config, options, split)
    } else {
        Scheduler::start_on_gpu(model.clone(), tokens, config, options)
    }
    .unwrap_or_else(|e| panic!("{test}: {e}"));
    let receivers: Vec<_> = prompts
        .iter()
        .map(|prompt| {
            let (tx, rx) = mpsc::channel();
            let request = Request {
                prompt: prompt.clone(),
                max_tokens,
                sampling: SamplingParams::greedy().validate().expect("greedy"),
                stop: Vec::new(),
                presence_penalty: 0.0,
                frequency_penalty: 0.0,
                logit_bias: Vec::new(),
                constraint: None,
                cancel: Arc::new(AtomicBool::new(false)),
                events: Box::new(move |event| tx.send(event).is_ok()),
            };
            scheduler.submit(request).expect("submitted");
            rx
        })
        .collect();
    // The text the scheduler hands out as each alone token arrives: its stream
    // decoder's output so far (whole characters only), then the rest at the end.
    let emitted = |tokens: &[u32]| -> (Vec<String>, String) {
        let mut decoder = tokenizer.stream_decoder(false);
        let (mut text, mut after) = (String::new(), vec![String::new()]);
        for &t in tokens {
            if tokenizer.is_end_of_generation(t) {
                break;
            }
            text.push_str(&decoder.push(t).expect("decodes"));
            after.push(text.clone());
        }
        text.push_str(&decoder.finish());
        (after, text)
    };
    let mut identical = 0;
    for (i, (rx, (tokens, rows))) in receivers.iter().zip(&expected).enumerate() {
        let mut got = String::new();
        loop {
            match rx.recv_timeout(Duration::from_secs(120)).expect("an event") {
                Event::Text(piece) => got.push_str(&piece),
                Event::Done(_) => break,
                Event::Error(e) => panic!("{test}: request {i} failed: {e}"),
            }
        }
        let (after, want) = emitted(tokens);
        if got == want {
            identical += 1;
            continue;
        }
        // The first alone token whose text the batched run did not hand out; a
        // character's bytes wait in the decoder over at most three tokens, so the
        // runs parted ways at one of the four tokens up to it, which must be a near
        // tie of the alone run.
        let k = (1..after.len())
            .find(|&k| !got.starts_with(&after[k]))
            .map_or(after.len() - 1, |k| k - 1);
        let window = k.saturating_sub(3)..=k.min(rows.len() - 1);
        assert!(
            window
                .clone()
                .any(|j| margin(&rows[j]) <= tolerance(&rows[j])),
            "{test}: request {i}: batched {got:?} vs alone {want:?}: no near tie at \
             tokens {window:?}"
        );
    }
    let metrics = scheduler.metrics();
    let cache = metrics.device_cache().expect("the device cache's counters");
    assert!(
        cache.hits > 0 && cache.uploaded_bytes > 0,
        "{test}: device cache counters {cache:?}"
    );
    eprintln!(
        "gpu scheduler {name:<12} {identical} of {} texts identical to alone",
        prompts.len()
    );
}

/// Embeddings through the scheduler on a GPU (`GpuModel::forward_batch_hidden`, the
/// inputs in blocks of the pool, several per batch and over several turns of the loop)
/// against the CPU's `Model::hidden_states` pooled the same way: each vector of unit
/// length, pointing where the CPU's does (cosine at least 0.999: the device's products
/// and f16 keys round otherwise), the same input twice the same bits, no block left
/// held.
pub(super) fn embeddings_on_gpu(name: &str) {
    use std::sync::{mpsc, Arc};
    use std::time::Duration;

    use model::pooling::mean_pool_normalized;
    use model::serve::{EmbedRequest, Scheduler, SchedulerConfig, SchedulerMetrics};

    let test = format!("gpu_embeddings_{name}");
    let (_dir, store, model) = open_spec(name);
    let tokenizer = Arc::new(Tokenizer::from_metadata(store.metadata()).expect("tokenizer"));
    let n_vocab = model.config().n_vocab as u32;
    let context = 160usize;
    let stream = |seed: u32, len: usize| -> Vec<u32> {
        (0..len as u32)
            .map(|i| 1 + (seed.wrapping_mul(7919) + i * 31 + i * i) % (n_vocab - 1))
            .collect()
    };
    let mut inputs: Vec<Vec<u32>> = [1, 7, 40, 100, 150]
        .iter()
        .enumerate()
        .map(|(i, &len)| stream(i as u32 + 1, len))
        .collect();
    inputs.push(inputs[2].clone());
    let Some(probe) = gpu_model(&test, &model, UploadMode::Eager, context) else {
        return;
    };
    drop(probe);
    let d = model.config().n_embd;
    let cpu: Vec<Vec<f32>> = inputs
        .iter()
        .map(|tokens| {
            let mut cache = model.new_cache(tokens.len());
            let rows = model.hidden_states(tokens, &mut cache).expect("cpu");
            mean_pool_normalized(&rows, d)
        })
        .collect();
    let config = SchedulerConfig {
        max_sequences: 4,
        max_queue: 16,
        step_tokens: 64,
        context_size: context,
        pool_positions: 2 * context,
        block_size: 16,
        attention: model::AttentionMethod::default(),
        kv_types: model::KvTypes::default(),
        context_shift: None,
    };
    let options = GpuOptions::new(UploadMode::Eager, context);
    let scheduler = Scheduler::start_on_gpu(model.clone(), Arc::clone(&tokenizer), config, options)
        .unwrap_or_else(|e| panic!("{test}: {e}"));
    let (tx, rx) = mpsc::channel();
    scheduler
        .embed(EmbedRequest {
            inputs: inputs.clone(),
            reply: Box::new(move |result| {
                let _ = tx.send(result);
            }),
        })
        .expect("queued");
    let gpu = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("a reply")
        .unwrap_or_else(|e| panic!("{test}: {e}"));
    assert_eq!(gpu.len(), inputs.len(), "{test}");
    for (i, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        assert_eq!(g.len(), d, "{test}: input {i}");
        let norm = g.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!(
            (norm - 1.0).abs() < 1e-4,
            "{test}: input {i}: length {norm}"
        );
        let cosine: f32 = g.iter().zip(c).map(|(a, b)| a * b).sum();
        assert!(cosine >= 0.999, "{test}: input {i}: cosine {cosine}");
    }
    assert_eq!(gpu[2], gpu[5], "{test}: the same input twice");
    let m = scheduler.metrics();
    assert_eq!(SchedulerMetrics::get(&m.kv_blocks_used), 0, "{test}");
}
