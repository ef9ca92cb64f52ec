//! [`Replicas`]: requests spread over several schedulers of one model, and prompts
//! following the blocks a replica holds.

use model::serve::Replicas;

use super::*;

/// Two schedulers of one model as replicas: requests that arrive together spread over
/// both and each gives its text alone; a prompt that shares a system prompt with an
/// earlier one goes to the replica that read it and reuses its blocks there; the
/// replicas' counters add up.
#[test]
fn smollm2_replicas_spread_requests_and_follow_their_prefixes() {
    let (model, tokenizer) = load(SMOLLM2);
    let start = || {
        Scheduler::start(model.clone(), Arc::clone(&tokenizer), config(512, 512, 256))
            .expect("scheduler starts")
    };
    let replicas = Replicas::new(vec![start(), start()]);
    assert_eq!(replicas.len(), 2);
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| encode(&tokenizer, p)).collect();
    let receivers: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (req, rx, _) = request(p.clone(), 16, greedy());
            replicas.submit(req).unwrap();
            rx
        })
        .collect();
    for ((rx, prompt), text) in receivers.iter().zip(&prompts).zip(PROMPTS) {
        let (got, _) = collect(rx);
        assert_eq!(
            got,
            generate_text(&model, &tokenizer, prompt, 16),
            "{text:?}"
        );
    }
    let received =
        |i: usize| SchedulerMetrics::get(&replicas.schedulers()[i].metrics().requests_received);
    assert_eq!(
        (received(0), received(1)),
        (3, 3),
        "six requests at once spread evenly"
    );

    let system = "You are a helpful assistant who answers questions about geography \
                  briefly and precisely, in one sentence, without any preamble. ";
    let mut cached = Vec::new();
    for question in [
        "What is the capital of Italy?",
        "What is the longest river?",
        "Which is the highest mountain?",
    ] {
        let prompt = encode(&tokenizer, &format!("{system}{question}"));
        let (req, rx, _) = request(prompt, 8, greedy());
        replicas.submit(req).unwrap();
        cached.push(collect(&rx).1.cached_tokens);
    }
    assert_eq!(cached[0], 0);
    assert!(
        cached[1] >= 16 && cached[2] >= 16,
        "the shared system prompt is reused on its replica: {cached:?}"
    );
    // The three went to one replica.
    assert_eq!(
        [received(0), received(1)]
            .iter()
            .filter(|&&n| n == 6)
            .count(),
        1,
        "{} and {}",
        received(0),
        received(1)
    );
    // A replica that has stopped takes nothing: the other serves every request.
    let stopped = usize::from(received(0) == 6);
    replicas.schedulers()[stopped].shutdown(Duration::ZERO);
    assert!(!replicas.schedulers()[stopped].is_running());
    for prompt in &prompts[..2] {
        let (req, rx, _) = request(prompt.clone(), 4, greedy());
        replicas.submit(req).unwrap();
        let (got, finish) = collect(&rx);
        assert!(!got.is_empty() && finish.completion_tokens == 4);
    }
    replicas.shutdown(Duration::ZERO);
    let total = replicas.metrics();
    assert_eq!(SchedulerMetrics::get(&total.requests_received), 11);
    let steps: u64 = replicas
        .schedulers()
        .iter()
        .map(|s| SchedulerMetrics::get(&s.metrics().steps))
        .sum();
    assert_eq!(SchedulerMetrics::get(&total.steps), steps);
    assert_eq!(total.step_duration.snapshot().count, steps);
    assert_eq!(
        SchedulerMetrics::get(&total.prompt_tokens_cached),
        (cached[1] + cached[2]) as u64
    );
}
