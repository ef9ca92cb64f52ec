use super::*;

/// Greedy requests held to a grammar on the GPU scheduler: their masks computed while the
/// device runs each step and applied there before the argmax (the requests without
/// log-probabilities), or applied on the host to the logits the step copies back (the
/// requests that ask for log-probabilities). Either way every text is a whole sentence
/// of the grammar, ended by it (`stop`), and every token's mask is counted.
pub(super) fn constrained_on_gpu(name: &str) {
    constrained(name, true);
}

/// As [`constrained_on_gpu`], on the CPU scheduler (each mask after the step's pass).
pub(super) fn constrained_on_cpu(name: &str) {
    constrained(name, false);
}

fn constrained(name: &str, gpu: bool) {
    use std::sync::atomic::AtomicBool;
    use std::sync::{mpsc, Arc};
    use std::time::Duration;

    use model::constraint::{ConstraintSpec, Grammars};
    use model::sampling::SamplingParams;
    use model::serve::{Event, FinishReason, LogprobsRequest, Request, Scheduler, SchedulerConfig};

    let test = format!("{}_constrained_{name}", if gpu { "gpu" } else { "cpu" });
    let (_dir, store, model) = open_spec(name);
    let tokenizer = Arc::new(Tokenizer::from_metadata(store.metadata()).expect("tokenizer"));
    let n_vocab = model.config().n_vocab;
    let context = 128usize;
    if gpu {
        let Some(probe) = gpu_model(&test, &model, UploadMode::Eager, context) else {
            return;
        };
        drop(probe);
    }
    let grammars = Grammars::new(Arc::clone(&tokenizer), n_vocab).expect("grammars");
    // Words of letters, a few of them, and a full stop: at most 28 bytes, so at most
    // 28 tokens before the grammar ends the text.
    let words = "[a-z]{2,6}( [a-z]{2,6}){1,3}\\.";
    let sentence = |text: &str| {
        let Some(body) = text.strip_suffix('.') else {
            return false;
        };
        let parts: Vec<&str> = body.split(' ').collect();
        (2..=4).contains(&parts.len())
            && parts
                .iter()
                .all(|w| (2..=6).contains(&w.len()) && w.bytes().all(|b| b.is_ascii_lowercase()))
    };
    let step_tokens = 64;
    let config = SchedulerConfig {
        max_sequences: 8,
        max_queue: 16,
        step_tokens,
        context_size: context,
        pool_positions: 4 * context,
        block_size: 16,
        attention: model::AttentionMethod::default(),
        kv_types: model::KvTypes::default(),
        context_shift: None,
    };
    let scheduler = if gpu {
        let options = GpuOptions::new(UploadMode::Background, context);
        Scheduler::start_on_gpu(model.clone(), Arc::clone(&tokenizer), config, options)
    } else {
        Scheduler::start(model.clone(), Arc::clone(&tokenizer), config)
    }
    .unwrap_or_else(|e| panic!("{test}: {e}"));
    let prompt = |seed: u32, len: u32| -> Vec<u32> {
        (0..len)
            .map(|i| 1 + (seed * 7919 + i * 31 + i * i) % (n_vocab as u32 - 1))
            .collect()
    };
    // The last prompt is longer than a step's tokens: it is read over two steps, while
    // the others already take tokens.
    let prompt_lens = [3, 8, 13, 18, 23, 90];
    assert!(prompt_lens[5] > step_tokens && prompt_lens[5] + 28 <= context);
    let mut generated = 0;
    // First every request's tokens on the device, then every request's on the host.
    for with_logprobs in [false, true] {
        let receivers: Vec<_> = (0..6u32)
            .map(|i| {
                let (tx, rx) = mpsc::channel();
                let request = Request {
                    prompt: prompt(i + 1, prompt_lens[i as usize] as u32),
                    max_tokens: 40,
                    sampling: SamplingParams::greedy().validate().expect("greedy"),
                    stop: Vec::new(),
                    presence_penalty: 0.0,
                    frequency_penalty: 0.0,
                    logit_bias: Vec::new(),
                    constraint: Some(
                        grammars
                            .compile(&ConstraintSpec::Regex(words.into()))
                            .expect("the grammar compiles"),
                    ),
                    cancel: Arc::new(AtomicBool::new(false)),
                    events: Box::new(move |event| tx.send(event).is_ok()),
                };
                let logprobs = with_logprobs.then(|| LogprobsRequest {
                    top: 2,
                    sink: Box::new(|_| {}),
                });
                scheduler.submit_with(request, logprobs).expect("submitted");
                rx
            })
            .collect();
        for (i, rx) in receivers.iter().enumerate() {
            let mut text = String::new();
            let finish = loop {
                match rx.recv_timeout(Duration::from_secs(120)).expect("an event") {
                    Event::Text(piece) => text.push_str(&piece),
                    Event::Done(finish) => break finish,
                    Event::Error(e) => panic!("{test}: request {i} failed: {e}"),
                }
            };
            assert!(
                sentence(&text),
                "{test}: request {i} (log-probabilities {with_logprobs}): {text:?} is not a \
                 sentence of {words}"
            );
            assert_eq!(
                finish.reason,
                FinishReason::Stop,
                "{test}: request {i}: {text:?}"
            );
            generated += finish.completion_tokens as u64;
        }
    }
    // A mask for every token taken, the grammar's end included when it was sampled.
    let masks = scheduler.metrics().constraint_mask.snapshot().count;
    assert!(
        masks >= generated,
        "{test}: {masks} masks for {generated} generated tokens"
    );
    eprintln!("{test}: 12 requests, {generated} tokens, {masks} masks");
}
