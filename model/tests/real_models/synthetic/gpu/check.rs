use super::*;

/// The tokens of the prompt of `name`'s spec, its special tokens added and parsed.
pub(super) fn spec_prompt(name: &str, store: &TensorStore) -> Vec<u32> {
    let tokenizer = Tokenizer::from_metadata(store.metadata()).expect("tokenizer");
    let options = EncodeOptions {
        add_special: true,
        parse_special: true,
    };
    tokenizer
        .encode(spec(name).expect("a spec").prompt, options)
        .expect("prompt encodes")
}

pub(super) fn check(name: &str) {
    check_within(
        name,
        &format!("gpu_{name}"),
        |_| None,
        false,
        GpuTuning::default(),
    );
}

/// [`check`] with the weights' budget `budget` gives for the model (`None`: the whole
/// model), the pools of experts filled first when `wait_for_pools` (and the link in
/// place), tuned as `tuning` says; returns what the pools did, if the model ran with
/// them.
pub(super) fn check_within(
    name: &str,
    test: &str,
    budget: impl Fn(&Model) -> Option<u64>,
    wait_for_pools: bool,
    tuning: GpuTuning,
) -> Option<model::gpu::ExpertStats> {
    let test = test.to_owned();
    let (_dir, store, model) = open_spec(name);
    let tokens = spec_prompt(name, &store);
    let n_vocab = model.config().n_vocab;
    let greedy_len = 32;
    // The prompts of PREFILL_LENGTHS are the first tokens of the prompt repeated.
    let longest = PREFILL_LENGTHS.into_iter().max().expect("lengths");
    let sequence: Vec<u32> = tokens.iter().copied().cycle().take(longest).collect();
    let context = (tokens.len() + greedy_len).max(longest + 1);
    let budget = budget(&model);
    let open = |mode, batch| gpu_model_within(&test, &model, mode, context, batch, budget, tuning);
    let mut gpu = open(UploadMode::Background, PROMPT_BATCH)?;
    if wait_for_pools {
        gpu.wait_experts_resident().expect("the pools fill");
    }
    let exact = Exact::of(name);
    let mut reroutes = Reroutes::of(name);
    let may_reroute = reroutes.allowed();
    // The CPU's largest stray from the exact rows, and the GPU's.
    let (mut cpu_stray, mut gpu_stray) = (0f32, 0f32);
    // Each row's bounds; the GPU held to them against the exact row too (a row of a
    // model that routes may be rerouted instead: `Reroutes`). Also whether it is.
    let mut measure_stray = |c: &[f32], g: &[f32], e: Option<&[f32]>| {
        let c_stray = stray(c, e);
        let (g_max, g_rms) = stray(g, e);
        let (max, rms) = bounds(c_stray);
        cpu_stray = cpu_stray.max(c_stray.0);
        gpu_stray = gpu_stray.max(g_max);
        let within = g_max <= max && g_rms <= rms;
        assert!(
            within || may_reroute,
            "{name}: the GPU strays {g_max:.3} (largest) and {g_rms:.3} (rms) of the \
             spread from the exact logits, bounds {max:.3} and {rms:.3}"
        );
        (max, rms, !within)
    };

    // Teacher-forced logits, every position.
    // The GPU's tolerance was derived against this computation.
    let mut cache = model
        .new_cache(context)
        .with_attention(AttentionMethod::Matmul);
    let cpu = model
        .forward_all_logits(&tokens, &mut cache)
        .expect("cpu forward");
    let got = gpu.forward_all_logits(&tokens).expect("gpu forward");
    assert_eq!(got.len(), cpu.len(), "{name}: logits of every position");
    let exact_rows = exact.as_ref().map(|e| {
        e.model
            .forward_all_logits(&tokens, &mut e.cache(context))
            .expect("exact forward")
    });
    let (mut agree, mut near, mut worst, mut worst_rms) = (0, 0, 0f32, 0f32);
    for (pos, (c, g)) in cpu.chunks(n_vocab).zip(got.chunks(n_vocab)).enumerate() {
        let e = exact_rows
            .as_ref()
            .map(|rows| &rows[pos * n_vocab..(pos + 1) * n_vocab]);
        let (max_bound, rms_bound, strays) = measure_stray(c, g, e);
        let sigma = spread(c).max(f32::MIN_POSITIVE);
        let tol = max_bound * sigma;
        let (diff, rms) = differences(c, g);
        if reroutes.count(strays || diff > tol || rms > rms_bound * sigma) {
            continue;
        }
        assert!(
            diff <= tol && rms <= rms_bound * sigma,
            "{name}: position {pos}: logits differ by {:.3} (largest) and {:.3} (rms) of \
             their spread, bounds {max_bound:.3} and {rms_bound:.3}",
            diff / sigma,
            rms / sigma
        );
        worst = worst.max(diff / sigma);
        worst_rms = worst_rms.max(rms / sigma);
        if argmax(c) == argmax(g) {
            agree += 1;
        } else if margin(c) <= tol {
            near += 1;
        }
    }
    let positions = tokens.len() - reroutes.rows;
    assert_eq!(
        agree + near,
        positions,
        "{name}: argmax differs past a near tie"
    );
    assert!(
        agree * 100 >= positions * 99 || positions - agree <= near,
        "{name}: argmax agrees at {agree}/{positions}"
    );

    // Prompts of each length in one call: their last logits.
    let mut cpu_last = Vec::new();
    let mut worst_prefill = 0f32;
    for len in PREFILL_LENGTHS {
        let prompt = &sequence[..len];
        // The GPU's tolerance was derived against this computation.
        let mut cache = model
            .new_cache(context)
            .with_attention(AttentionMethod::Matmul);
        let c = model.forward(prompt, &mut cache).expect("cpu prompt");
        gpu.clear().expect("clear");
        let g = gpu.forward(prompt).expect("gpu prompt");
        let e = exact.as_ref().map(|e| e.last(prompt, context));
        let (bound, _, strays) = measure_stray(&c, &g, e.as_deref());
        if !reroutes.count(strays || !prefill_within(&c, &g, bound)) {
            let d = check_prefill_within(name, len, PROMPT_BATCH, &c, &g, bound);
            worst_prefill = worst_prefill.max(d);
        }
        cpu_last.push((len, c, e));
    }
    // The same prompts in chunks smaller than themselves.
    for (batch, len) in SMALL_BATCHES {
        let mut chunked = open(UploadMode::Eager, batch)?;
        assert_eq!(chunked.prompt_batch(), batch, "{name}: chunk size");
        let (_, c, e) = cpu_last
            .iter()
            .find(|(l, _, _)| *l == len)
            .expect("a length of PREFILL_LENGTHS");
        let g = chunked
            .forward(&sequence[..len])
            .expect("gpu chunked prompt");
        let (bound, _, strays) = measure_stray(c, &g, e.as_deref());
        if !reroutes.count(strays || !prefill_within(c, &g, bound)) {
            let d = check_prefill_within(name, len, batch, c, &g, bound);
            worst_prefill = worst_prefill.max(d);
        }
    }

    // Greedy text: the GPU (device argmax, the captured decode step) against the CPU,
    // identical until the CPU's top two come within the tolerance.
    gpu.clear().expect("clear");
    // The GPU's tolerance was derived against this computation.
    let mut cache = model
        .new_cache(context)
        .with_attention(AttentionMethod::Matmul);
    let mut cpu_logits = model.forward(&tokens, &mut cache).expect("cpu prompt");
    let mut gpu_token = gpu.forward_argmax(&tokens).expect("gpu prompt");
    let mut exact_cache = exact.as_ref().map(|e| (e, e.cache(context)));
    let mut exact_logits = exact_cache
        .as_mut()
        .map(|(e, cache)| e.model.forward(&tokens, cache).expect("exact prompt"));
    let mut same = 0;
    for _ in 0..greedy_len - 1 {
        let cpu_token = argmax(&cpu_logits) as u32;
        if cpu_token != gpu_token {
            let (bound, _) = bounds(stray(&cpu_logits, exact_logits.as_deref()));
            let near_tie = margin(&cpu_logits) <= bound * spread(&cpu_logits);
            // A rerouted step of a model that routes ends the comparison too.
            reroutes.count(!near_tie);
            assert!(
                near_tie || reroutes.allowed(),
                "{name}: greedy token {same} differs ({cpu_token} vs {gpu_token}) \
                 with a clear CPU margin"
            );
            break;
        }
        same += 1;
        cpu_logits = model.forward(&[cpu_token], &mut cache).expect("cpu decode");
        gpu_token = gpu.forward_argmax(&[cpu_token]).expect("gpu decode");
        exact_logits = exact_cache
            .as_mut()
            .map(|(e, cache)| e.model.forward(&[cpu_token], cache).expect("exact decode"));
    }
    reroutes.check(name);
    eprintln!(
        "gpu {name:<15} argmax {agree}/{positions} ({near} near ties), largest |Δ| {worst:.3} \
         and rms {worst_rms:.3} of the spread, prompts of 1 to {longest} tokens {:.3}, \
         greedy {same}/{} tokens identical{}",
        worst_prefill,
        greedy_len - 1,
        if exact.is_some() {
            format!(
                "; from the exact logits the CPU strays {cpu_stray:.3}, the GPU \
                 {gpu_stray:.3}"
            )
        } else {
            String::new()
        }
    );
    gpu.expert_stats()
}
