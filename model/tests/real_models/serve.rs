//! The continuous-batching scheduler on the real models: a request alone gives what
//! `generate` gives, requests batched together give what they give alone (SmolLM2's
//! Q4_1 products and the attention are computed row by row, so batching changes no bit),
//! prompts reuse cached blocks, a pool too small for everyone preempts and recomputes
//! without changing the text, cancellation frees the blocks, and bad requests are refused.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use model::generate::{generate, GenerateOptions};
use model::sampling::{SamplingConfig, SamplingParams};
use model::serve::{
    Event, Finish, FinishReason, Request, Scheduler, SchedulerConfig, SchedulerMetrics, ServeError,
    StepPhase,
};
use model::tokenizer::{EncodeOptions, Tokenizer};
use model::{AttentionMethod, Model};
use tensor_store::TensorStore;

use crate::common::{model_path, GEMMA3, SMOLLM2};

/// Several schedulers of one model behind one queue.
#[path = "serve/replicas.rs"]
mod replicas;

fn load(file: &str) -> (Model, Arc<Tokenizer>) {
    let store = TensorStore::open(model_path(file)).expect("model opens");
    let tokenizer = Tokenizer::from_metadata(store.metadata()).expect("tokenizer builds");
    (
        Model::load(&store).expect("model loads"),
        Arc::new(tokenizer),
    )
}

fn config(context_size: usize, pool_positions: usize, step_tokens: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_sequences: 8,
        max_queue: 16,
        step_tokens,
        context_size,
        pool_positions,
        block_size: 16,
        attention: AttentionMethod::default(),
        kv_types: model::KvTypes::default(),
        context_shift: None,
    }
}

fn greedy() -> SamplingConfig {
    SamplingParams::greedy().validate().unwrap()
}

/// A request whose events arrive on the returned channel.
fn request(
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: SamplingConfig,
) -> (Request, mpsc::Receiver<Event>, Arc<AtomicBool>) {
    let (tx, rx) = mpsc::channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let request = Request {
        prompt,
        max_tokens,
        sampling,
        stop: Vec::new(),
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        logit_bias: Vec::new(),
        constraint: None,
        cancel: Arc::clone(&cancel),
        events: Box::new(move |event| tx.send(event).is_ok()),
    };
    (request, rx, cancel)
}

/// The text and the final event of a request.
fn collect(rx: &mpsc::Receiver<Event>) -> (String, Finish) {
    let mut text = String::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(120)).expect("an event") {
            Event::Text(piece) => {
                assert!(!piece.is_empty());
                text.push_str(&piece);
            }
            Event::Done(finish) => return (text, finish),
            Event::Error(e) => panic!("request failed: {e}"),
        }
    }
}

fn generate_text(model: &Model, tokenizer: &Tokenizer, prompt: &[u32], n: usize) -> String {
    let options = GenerateOptions {
        sampling: greedy(),
        max_tokens: n,
        context_size: 4096,
        attention: AttentionMethod::default(),
        kv_types: model::KvTypes::default(),
        context_shift: None,
    };
    let stop = AtomicBool::new(false);
    generate(model, tokenizer, prompt, &options, &stop, |_| {
        ControlFlow::Continue(())
    })
    .expect("generation runs")
    .text
}

const PROMPTS: [&str; 6] = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A list of the planets of the solar system, from the closest to the Sun: Mercury,",
];

fn encode(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
    tokenizer.encode(text, EncodeOptions::PROMPT).unwrap()
}

fn alone_matches_generate(file: &str) {
    let (model, tokenizer) = load(file);
    let long = PROMPTS.join(" ").repeat(3);
    let prompts: Vec<&str> = PROMPTS.iter().copied().chain([long.as_str()]).collect();
    alone_in_the_scheduler_matches_generate(file, model, tokenizer, &prompts);
}

/// Each of `prompts` sent alone to a scheduler over `model` gives the text `generate`
/// gives (the same operations on the same rows).
pub(crate) fn alone_in_the_scheduler_matches_generate(
    label: &str,
    model: Model,
    tokenizer: Arc<Tokenizer>,
    prompts: &[&str],
) {
    // A step budget shorter than the long prompt: read alone, it is still one batch.
    let scheduler = Scheduler::start(model.clone(), Arc::clone(&tokenizer), config(512, 512, 32))
        .expect("scheduler starts");
    for text in prompts {
        let prompt = encode(&tokenizer, text);
        let expected = generate_text(&model, &tokenizer, &prompt, 24);
        let (req, rx, _) = request(prompt.clone(), 24, greedy());
        scheduler.submit(req).unwrap();
        let (got, finish) = collect(&rx);
        assert_eq!(got, expected, "{label}: {text:?}");
        assert_eq!(finish.prompt_tokens, prompt.len());
        assert!(finish.completion_tokens <= 24);
    }
}

#[test]
fn smollm2_a_request_alone_gives_generates_text() {
    alone_matches_generate(SMOLLM2);
}

#[test]
fn gemma3_a_request_alone_gives_generates_text() {
    alone_matches_generate(GEMMA3);
}

/// Every prompt alone, then all at once with prompts read in chunks: the same text. With
/// a pool too small for all, sequences are preempted and recomputed: they all finish,
/// but the recomputation reads generated tokens as one batch, whose attention sums in
/// other lanes than one token at a time, so a near-tie may go the other way there.
#[test]
fn smollm2_batched_requests_give_their_text_alone() {
    let (model, tokenizer) = load(SMOLLM2);
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| encode(&tokenizer, p)).collect();
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| generate_text(&model, &tokenizer, p, 40))
        .collect();
    // A step budget of 12 tokens: prompts are read in chunks beside the decoding ones.
    for (pool, step) in [(1024, 12), (80, 64)] {
        let scheduler = Scheduler::start(
            model.clone(),
            Arc::clone(&tokenizer),
            config(80, pool, step),
        )
        .expect("scheduler starts");
        // The first one decodes before the others come, so that theirs are read in
        // chunks beside it.
        let m = Arc::clone(scheduler.metrics());
        let receivers: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (req, rx, _) = request(p.clone(), 40, greedy());
                scheduler.submit(req).unwrap();
                let start = Instant::now();
                while i == 0 && SchedulerMetrics::get(&m.generated_tokens) == 0 {
                    assert!(start.elapsed() < Duration::from_secs(60));
                    std::thread::sleep(Duration::from_millis(1));
                }
                rx
            })
            .collect();
        for ((rx, expected), text) in receivers.iter().zip(&alone).zip(PROMPTS) {
            let (got, finish) = collect(rx);
            assert!(finish.completion_tokens > 0 && !got.is_empty());
            if pool == 80 {
                continue;
            }
            // A context of 80 may end the longest ones early: compare what both have.
            assert!(
                expected.starts_with(&got),
                "pool {pool}, step {step}: {text:?}: {got:?} vs {expected:?}"
            );
        }
        // A step is timed once its text is handed out: stop the thread before reading.
        scheduler.shutdown(Duration::ZERO);
        let m = scheduler.metrics();
        assert!(SchedulerMetrics::get(&m.steps) > 0);
        // Every step is timed whole and in its forward pass, which is a part of it.
        let (step, forward) = (m.step_duration.snapshot(), m.forward_duration.snapshot());
        assert_eq!(step.count, SchedulerMetrics::get(&m.steps));
        assert_eq!(forward.count, step.count);
        assert!(forward.sum_seconds > 0.0 && forward.sum_seconds <= step.sum_seconds);
        if pool == 80 {
            assert!(
                SchedulerMetrics::get(&m.preemptions) > 0,
                "a pool of one context preempts"
            );
        }
    }
}

/// Sampled requests (seeded draws with and without top-k, a repetition penalty, the
/// OpenAI penalties, biases, a banned end of text) each give their text alone and batched
/// with the others, where their tokens are chosen on several threads; and a seeded draw
/// alone gives `generate`'s text for the same settings.
#[test]
fn smollm2_sampled_requests_give_their_text_alone_and_batched() {
    let (model, tokenizer) = load(SMOLLM2);
    let params = |temperature, top_k, top_p, repeat_penalty, seed| {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            repeat_penalty,
            seed,
            ..SamplingParams::default()
        }
        .validate()
        .unwrap()
    };
    let eos = tokenizer.end_of_generation_tokens().to_vec();
    /// Sampling, presence and frequency penalties, biases.
    type Setting = (SamplingConfig, f32, f32, Vec<(u32, f32)>);
    let settings: Vec<Setting> = vec![
        (params(0.8, 40, 0.95, 1.0, 1), 0.0, 0.0, Vec::new()),
        (params(1.2, 0, 0.9, 1.0, 2), 0.0, 0.0, Vec::new()),
        (params(0.7, 0, 1.0, 1.1, 3), 0.5, 0.3, Vec::new()),
        (
            greedy(),
            0.0,
            0.0,
            eos.iter().map(|&t| (t, f32::NEG_INFINITY)).collect(),
        ),
        (params(0.0, 40, 0.95, 1.3, 0), 0.0, 0.0, vec![(13, 2.5)]),
        (params(0.9, 5, 1.0, 1.0, 4), -0.5, 0.8, vec![(28, -4.0)]),
    ];
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| encode(&tokenizer, p)).collect();
    let scheduler = Scheduler::start(
        model.clone(),
        Arc::clone(&tokenizer),
        config(512, 4096, 256),
    )
    .expect("scheduler starts");
    let submit = |i: usize| {
        let (sampling, presence, frequency, bias) = settings[i].clone();
        let (mut req, rx, _) = request(prompts[i].clone(), 24, sampling);
        req.presence_penalty = presence;
        req.frequency_penalty = frequency;
        req.logit_bias = bias;
        scheduler.submit(req).unwrap();
        rx
    };
    let alone: Vec<String> = (0..settings.len()).map(|i| collect(&submit(i)).0).collect();
    let batched: Vec<_> = (0..settings.len()).map(submit).collect();
    for (i, rx) in batched.iter().enumerate() {
        assert_eq!(collect(rx).0, alone[i], "{:?}", settings[i]);
    }
    let options = GenerateOptions {
        sampling: settings[0].0,
        max_tokens: 24,
        context_size: 4096,
        attention: AttentionMethod::default(),
        kv_types: model::KvTypes::default(),
        context_shift: None,
    };
    let stop = AtomicBool::new(false);
    let generated = generate(&model, &tokenizer, &prompts[0], &options, &stop, |_| {
        ControlFlow::Continue(())
    })
    .expect("generation runs");
    assert_eq!(alone[0], generated.text);
    // The parts of the steps outside their forward passes add up to the rest of them
    // (the histograms' sums count whole microseconds).
    scheduler.shutdown(Duration::ZERO);
    let m = scheduler.metrics();
    let (step, forward) = (m.step_duration.snapshot(), m.forward_duration.snapshot());
    let parts: f64 = StepPhase::ALL
        .iter()
        .map(|&p| m.step_phase_seconds(p))
        .sum();
    let rest = step.sum_seconds - forward.sum_seconds;
    assert!(
        (parts - rest).abs() <= 2e-6 * step.count as f64 + 1e-6,
        "parts {parts} s, steps less forward passes {rest} s"
    );
    assert!(m.step_phase_seconds(StepPhase::Sample) > 0.0);
}

#[test]
fn smollm2_prompts_reuse_cached_blocks() {
    let (model, tokenizer) = load(SMOLLM2);
    let scheduler = Scheduler::start(model.clone(), Arc::clone(&tokenizer), config(512, 512, 256))
        .expect("scheduler starts");
    let system = "You are a helpful assistant who answers questions about geography \
                  briefly and precisely, in one sentence, without any preamble. ";
    let mut results = Vec::new();
    for question in [
        "What is the capital of Italy?",
        "What is the longest river?",
    ] {
        let prompt = encode(&tokenizer, &format!("{system}{question}"));
        let expected = generate_text(&model, &tokenizer, &prompt, 12);
        let (req, rx, _) = request(prompt, 12, greedy());
        scheduler.submit(req).unwrap();
        let (got, finish) = collect(&rx);
        results.push((got, expected, finish));
    }
    assert_eq!(results[0].2.cached_tokens, 0);
    assert!(
        results[1].2.cached_tokens >= 16,
        "the shared system prompt is reused: {:?}",
        results[1].2
    );
    for (got, expected, _) in &results {
        assert_eq!(got, expected);
    }
    let m = scheduler.metrics();
    assert_eq!(
        SchedulerMetrics::get(&m.prompt_tokens_cached),
        results[1].2.cached_tokens as u64
    );
}

/// With a context shift, a request that fills its context goes on to `max_tokens`: its
/// first tokens stay, half of the rest leaves, and it computes what it keeps again.
/// Until the first shift its text is the text of a request that stops there.
#[test]
fn smollm2_context_shift_goes_on_past_a_full_context() {
    let (model, tokenizer) = load("SmolLM2-135M-Instruct.Q4_1.gguf");
    let prompt = encode(&tokenizer, "The history of the printing press");
    let mut shifting = config(48, 96, 32);
    shifting.context_shift = Some(4);
    let plain = Scheduler::start(model.clone(), Arc::clone(&tokenizer), config(48, 96, 32))
        .expect("scheduler starts");
    let (req, rx, _) = request(prompt.clone(), 100, greedy());
    plain.submit(req).unwrap();
    let (stopped, finish) = collect(&rx);
    assert_eq!(finish.reason, FinishReason::Length);
    assert!(finish.completion_tokens < 100, "{finish:?}");
    let scheduler =
        Scheduler::start(model, Arc::clone(&tokenizer), shifting).expect("scheduler starts");
    let (req, rx, _) = request(prompt.clone(), 100, greedy());
    scheduler.submit(req).unwrap();
    let (text, finish) = collect(&rx);
    assert_eq!(finish.reason, FinishReason::Length);
    assert_eq!(finish.completion_tokens, 100, "{finish:?}");
    assert_eq!(finish.prompt_tokens, prompt.len());
    assert!(text.starts_with(&stopped), "{stopped:?} / {text:?}");
    assert!(text.len() > stopped.len());
    let shifts = scheduler
        .metrics()
        .context_shifts
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(shifts >= 2, "{shifts} shifts");
}

#[test]
fn smollm2_cancelled_requests_stop_and_free_their_blocks() {
    let (model, tokenizer) = load(SMOLLM2);
    let scheduler = Scheduler::start(model, Arc::clone(&tokenizer), config(512, 512, 256))
        .expect("scheduler starts");
    let prompt = encode(&tokenizer, PROMPTS[1]);
    let (req, rx, cancel) = request(prompt, 400, greedy());
    scheduler.submit(req).unwrap();
    assert!(matches!(
        rx.recv_timeout(Duration::from_secs(60)),
        Ok(Event::Text(_))
    ));
    cancel.store(true, Ordering::Relaxed);
    let m = scheduler.metrics();
    let start = Instant::now();
    while SchedulerMetrics::get(&m.cancelled) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "cancelled in time"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let generated = SchedulerMetrics::get(&m.generated_tokens);
    assert!(generated < 400, "work stopped after {generated} tokens");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(SchedulerMetrics::get(&m.running), 0);
    assert_eq!(SchedulerMetrics::get(&m.kv_blocks_used), 0);
    assert_eq!(SchedulerMetrics::get(&m.generated_tokens), generated);
}

#[test]
fn smollm2_stop_strings_limits_and_refusals() {
    let (model, tokenizer) = load(SMOLLM2);
    let scheduler = Scheduler::start(model.clone(), Arc::clone(&tokenizer), config(64, 64, 256))
        .expect("scheduler starts");
    let prompt = encode(&tokenizer, PROMPTS[5]);
    let full = generate_text(&model, &tokenizer, &prompt, 16);
    // Stop at the second comma: the text before it, finish "stop".
    let second = full.match_indices(',').nth(1).expect("two commas").0;
    let (mut req, rx, _) = request(prompt.clone(), 16, greedy());
    req.stop = vec![full[second..second + 3].to_owned()];
    scheduler.submit(req).unwrap();
    let (got, finish) = collect(&rx);
    assert_eq!(got, full[..second]);
    assert_eq!(finish.reason, FinishReason::Stop);
    // max_tokens ends with "length".
    let (req, rx, _) = request(prompt.clone(), 3, greedy());
    scheduler.submit(req).unwrap();
    let (_, finish) = collect(&rx);
    assert_eq!(
        (finish.reason, finish.completion_tokens),
        (FinishReason::Length, 3)
    );
    // Too long, empty, or out of the vocabulary: refused at once.
    let (req, _, _) = request(vec![1; 65], 3, greedy());
    assert_eq!(
        scheduler.submit(req).unwrap_err(),
        ServeError::PromptTooLong {
            prompt_tokens: 65,
            context_size: 64
        }
    );
    let (req, _, _) = request(Vec::new(), 3, greedy());
    assert_eq!(scheduler.submit(req).unwrap_err(), ServeError::EmptyPrompt);
    let (req, _, _) = request(vec![u32::MAX], 3, greedy());
    assert!(matches!(
        scheduler.submit(req).unwrap_err(),
        ServeError::TokenOutOfRange { .. }
    ));
    // A shut-down scheduler refuses new work.
    scheduler.shutdown(Duration::ZERO);
    let (req, _, _) = request(prompt, 3, greedy());
    assert_eq!(scheduler.submit(req).unwrap_err(), ServeError::ShuttingDown);
}

/// Greedy text of eight prompts decoded together against each alone. Where a batch
/// takes other product kernels than a single token (Gemma's Q4_K matrices: llama.cpp's
/// GEMM for groups of four tokens), sums run in another order and a token may differ;
/// this checks that each such token was a near-tie for the text computed alone: at the
/// first difference, the batched text continues with a token whose logit (alone) is
/// within `NEAR_TIE` of the best. Returns how many texts were identical.
fn batched_text_is_alone_or_a_near_tie(file: &str) -> usize {
    const NEAR_TIE: f32 = 0.25;
    let (model, tokenizer) = load(file);
    let mut prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| encode(&tokenizer, p)).collect();
    prompts.push(encode(&tokenizer, "The best way to learn a language is"));
    prompts.push(encode(&tokenizer, "Photosynthesis is the process by which"));
    let options = GenerateOptions {
        sampling: greedy(),
        max_tokens: 32,
        context_size: 4096,
        attention: AttentionMethod::default(),
        kv_types: model::KvTypes::default(),
        context_shift: None,
    };
    let stop = AtomicBool::new(false);
    let alone: Vec<_> = prompts
        .iter()
        .map(|p| {
            generate(&model, &tokenizer, p, &options, &stop, |_| {
                ControlFlow::Continue(())
            })
            .expect("generation runs")
        })
        .collect();
    let scheduler = Scheduler::start(model.clone(), Arc::clone(&tokenizer), config(512, 4096, 16))
        .expect("scheduler starts");
    let receivers: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (req, rx, _) = request(p.clone(), 32, greedy());
            scheduler.submit(req).unwrap();
            rx
        })
        .collect();
    let mut identical = 0;
    for ((rx, expected), prompt) in receivers.iter().zip(&alone).zip(&prompts) {
        let (got, _) = collect(rx);
        if got == expected.text {
            identical += 1;
            continue;
        }
        let same = got
            .bytes()
            .zip(expected.text.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        // The first token of the alone text that reaches past the common part.
        let decode = |ids: &[u32]| {
            tokenizer
                .decode(ids, model::tokenizer::DecodeOptions::TEXT)
                .unwrap()
        };
        let k = (0..expected.tokens.len())
            .find(|&k| decode(&expected.tokens[..=k]).len() > same)
            .expect("the texts differ within the alone tokens");
        let mut context = prompt.clone();
        context.extend_from_slice(&expected.tokens[..k]);
        let mut cache = model.new_cache(context.len());
        let logits = model.forward(&context, &mut cache).unwrap();
        let best = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let near: Vec<u32> = (0..logits.len() as u32)
            .filter(|&t| t != expected.tokens[k] && logits[t as usize] >= best - NEAR_TIE)
            .filter(|&t| {
                let mut ids = expected.tokens[..k].to_vec();
                ids.push(t);
                let text = decode(&ids);
                text.len() > decode(&expected.tokens[..k]).len() && got.starts_with(&text)
            })
            .collect();
        assert!(
            !near.is_empty(),
            "{file}: batched {got:?} vs alone {:?}: token {k} was no near-tie",
            expected.text
        );
    }
    eprintln!(
        "{file}: {identical} of {} texts identical when batched",
        prompts.len()
    );
    identical
}

#[test]
fn smollm2_batched_greedy_text_is_the_same_as_alone() {
    // Q4_1 products and the attention are computed row by row: no bit changes.
    assert_eq!(batched_text_is_alone_or_a_near_tie(SMOLLM2), 8);
}

#[test]
fn gemma3_batched_greedy_text_is_alone_or_a_near_tie() {
    batched_text_is_alone_or_a_near_tie(GEMMA3);
}

/// A long prompt arriving while a stream decodes is read in chunks beside it: the
/// stream keeps getting a token every step while the prompt is read.
#[test]
fn smollm2_a_long_prompt_does_not_stall_a_running_stream() {
    let (model, tokenizer) = load(SMOLLM2);
    let scheduler = Scheduler::start(model, Arc::clone(&tokenizer), config(1024, 2048, 32))
        .expect("scheduler starts");
    let timed = |prompt: Vec<u32>| {
        let (mut req, _, _) = request(prompt, 120, greedy());
        let (tx, rx) = mpsc::channel();
        req.events = Box::new(move |event| tx.send((Instant::now(), event)).is_ok());
        // Never an end-of-generation token: the stream runs its whole length.
        req.logit_bias = tokenizer
            .end_of_generation_tokens()
            .iter()
            .map(|&t| (t, f32::NEG_INFINITY))
            .collect();
        (req, rx)
    };
    let (stream, stream_rx) = timed(encode(&tokenizer, PROMPTS[0]));
    scheduler.submit(stream).unwrap();
    let mut stream_times = vec![stream_rx.recv_timeout(Duration::from_secs(60)).unwrap().0];
    let long = encode(&tokenizer, &PROMPTS.join(" ").repeat(6));
    assert!(long.len() > 300, "{} tokens", long.len());
    let (req, long_rx) = timed(long.clone());
    let submitted = Instant::now();
    scheduler.submit(req).unwrap();
    let (first_long, _) = long_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    while let Ok((at, event)) = stream_rx.recv_timeout(Duration::from_secs(60)) {
        if matches!(event, Event::Done(_)) {
            break;
        }
        stream_times.push(at);
    }
    // The prompt takes at least len / 31 steps; the stream gets a token in each (a
    // piece may hold back an incomplete character, so allow a few fewer pieces).
    let during = stream_times
        .iter()
        .filter(|&&t| t > submitted && t < first_long)
        .count();
    let steps = long.len() / 31;
    assert!(
        during + 3 >= steps,
        "{during} stream pieces while a {}-token prompt was read in {steps}+ steps",
        long.len()
    );
}

/// Constrained requests batched with an unconstrained one: each constrained output is
/// what its grammar allows, ended by the grammar with "stop" (greedy and random
/// sampling alike), and the unconstrained request's text is the one it gets alone.
#[test]
fn constrained_requests_follow_their_grammars_in_a_batch() {
    use model::constraint::{ConstraintSpec, Grammars};
    let (model, tokenizer) = load(SMOLLM2);
    let n_vocab = model.config().n_vocab;
    let grammars = Grammars::new(Arc::clone(&tokenizer), n_vocab).unwrap();
    let prompt = encode(&tokenizer, PROMPTS[1]);
    let alone = generate_text(&model, &tokenizer, &prompt, 12);
    let scheduler = Scheduler::start(model, Arc::clone(&tokenizer), config(512, 2048, 64))
        .expect("scheduler starts");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 999, "minimum": 0}},
        "required": ["ok", "n"],
        "additionalProperties": false
    });
    let random = SamplingParams {
        temperature: 1.0,
        seed: 7,
        ..SamplingParams::default()
    }
    .validate()
    .unwrap();
    let specs = [
        (ConstraintSpec::JsonSchema(schema.clone()), greedy()),
        (ConstraintSpec::JsonSchema(schema), random),
        (ConstraintSpec::Regex("(cat|dog)s? [0-9]{2}".into()), random),
    ];
    let mut receivers = Vec::new();
    for (spec, sampling) in &specs {
        let (mut r, rx, _) = request(prompt.clone(), 64, *sampling);
        r.constraint = Some(grammars.compile(spec).unwrap());
        scheduler.submit(r).unwrap();
        receivers.push(rx);
    }
    let (plain, plain_rx, _) = request(prompt.clone(), 12, greedy());
    scheduler.submit(plain).unwrap();
    for (rx, (spec, _)) in receivers.iter().zip(&specs) {
        let (text, finish) = collect(rx);
        assert_eq!(finish.reason, FinishReason::Stop, "{spec:?}: {text:?}");
        match spec {
            ConstraintSpec::JsonSchema(_) => {
                let value: serde_json::Value =
                    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
                assert!(value["ok"].is_boolean() && value["n"].is_u64(), "{text}");
                assert_eq!(value.as_object().unwrap().len(), 2, "{text}");
            }
            _ => {
                let (word, digits) = text.split_once(' ').expect("a space");
                assert!(matches!(word, "cat" | "cats" | "dog" | "dogs"), "{text:?}");
                assert!(
                    digits.len() == 2 && digits.bytes().all(|b| b.is_ascii_digit()),
                    "{text:?}"
                );
            }
        }
    }
    assert_eq!(collect(&plain_rx).0, alone);
}

/// Embeddings through the scheduler are `Model::hidden_states` pooled, whether the
/// inputs run alone or beside a running stream, in batches of the step's budget; they
/// leave no block held; bad ones are refused at once.
#[test]
fn smollm2_embeddings_run_between_steps_and_leave_no_blocks() {
    use model::pooling::mean_pool_normalized;
    use model::serve::EmbedRequest;
    let (model, tokenizer) = load(SMOLLM2);
    let texts = [
        "The quick brown fox jumps over the lazy dog.",
        "Water boils at a temperature of",
        "The quick brown fox jumps over the lazy dog.",
    ];
    let inputs: Vec<Vec<u32>> = texts.iter().map(|t| encode(&tokenizer, t)).collect();
    let alone: Vec<Vec<f32>> = inputs
        .iter()
        .map(|tokens| {
            let mut cache = model.new_cache(tokens.len());
            let rows = model
                .hidden_states(tokens, &mut cache)
                .expect("hidden states");
            mean_pool_normalized(&rows, model.config().n_embd)
        })
        .collect();
    // A budget of 12 tokens a step: the 10-token inputs go one per step.
    let scheduler = Scheduler::start(model.clone(), Arc::clone(&tokenizer), config(256, 512, 12))
        .expect("starts");
    let embed = |inputs: Vec<Vec<u32>>| {
        let (tx, rx) = mpsc::channel();
        scheduler
            .embed(EmbedRequest {
                inputs,
                reply: Box::new(move |result| {
                    let _ = tx.send(result);
                }),
            })
            .map(|()| rx)
    };
    let prompt = encode(
        &tokenizer,
        "Once upon a time, in a small village by the sea,",
    );
    let (req, events, _) = request(prompt, 40, greedy());
    scheduler.submit(req).expect("submitted");
    let vectors = embed(inputs.clone())
        .expect("queued")
        .recv_timeout(Duration::from_secs(120))
        .expect("a reply")
        .expect("vectors");
    let (text, _) = collect(&events);
    assert!(!text.is_empty());
    // Row by row, batching changes no bit.
    assert_eq!(vectors, alone);
    assert_eq!(vectors[0], vectors[2]);
    assert_ne!(vectors[0], vectors[1]);
    let m = scheduler.metrics();
    assert_eq!(SchedulerMetrics::get(&m.embedding_requests), 1);
    let tokens: usize = inputs.iter().map(Vec::len).sum();
    assert_eq!(SchedulerMetrics::get(&m.embedding_tokens), tokens as u64);
    // The gauges follow the stream's last event.
    let start = Instant::now();
    while SchedulerMetrics::get(&m.kv_blocks_used) != 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "blocks freed");
        std::thread::sleep(Duration::from_millis(5));
    }
    for (bad, why) in [
        (vec![], ServeError::EmptyPrompt),
        (vec![vec![1], vec![]], ServeError::EmptyPrompt),
        (
            vec![vec![1; 257]],
            ServeError::PromptTooLong {
                prompt_tokens: 257,
                context_size: 256,
            },
        ),
    ] {
        assert_eq!(embed(bad).err(), Some(why));
    }
    assert!(matches!(
        embed(vec![vec![u32::MAX]]).err(),
        Some(ServeError::TokenOutOfRange { .. })
    ));
}
