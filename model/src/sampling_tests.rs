//! Each stage against hand-computed results, the validation errors, seed reproducibility
//! and the distribution of many draws.

use super::*;

fn candidates(logits: &[f32]) -> Vec<Candidate> {
    logits
        .iter()
        .enumerate()
        .map(|(id, &logit)| Candidate {
            id: id as u32,
            logit,
        })
        .collect()
}

fn ids(candidates: &[Candidate]) -> Vec<u32> {
    candidates.iter().map(|c| c.id).collect()
}

/// Logits whose softmax is exactly `probs` (up to rounding).
fn logits_of(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

fn random(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> Sampler {
    let params = SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        repeat_penalty: 1.0,
        repeat_last_n: 64,
        seed,
    };
    Sampler::new(params.validate().unwrap())
}

/// Counts how often each id is drawn in `n` draws.
fn histogram(sampler: &mut Sampler, logits: &[f32], n: usize) -> Vec<usize> {
    let mut counts = vec![0; logits.len()];
    for _ in 0..n {
        counts[sampler.sample(logits).unwrap() as usize] += 1;
    }
    counts
}

/// Pearson's chi-square statistic of `counts` against `expected` probabilities.
fn chi_square(counts: &[usize], expected: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(expected)
        .map(|(&c, &p)| {
            let e = p * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

/// 100,000 draws of `sampler` from `logits` pass a chi-square test against the four
/// probabilities `expected`: 3 degrees of freedom, whose 16.27 a correct sampler exceeds
/// with probability 0.001.
fn assert_draws_follow(mut sampler: Sampler, logits: &[f32], expected: &[f64]) {
    let counts = histogram(&mut sampler, logits, 100_000);
    let chi2 = chi_square(&counts, expected);
    assert!(chi2 < 16.27, "chi-square {chi2} for {counts:?}");
}

#[test]
fn defaults_are_llama_cpp_cli_defaults() {
    let p = SamplingParams::default();
    assert_eq!(
        (p.temperature, p.top_k, p.top_p, p.min_p),
        (0.8, 40, 0.95, 0.05)
    );
    assert_eq!((p.repeat_penalty, p.repeat_last_n), (1.0, 64));
}

#[test]
fn validation_names_each_bad_value() {
    let ok = SamplingParams::default();
    let bad = |p: SamplingParams| p.validate().unwrap_err();
    let e = bad(SamplingParams {
        temperature: -0.5,
        ..ok
    });
    assert_eq!(e, SamplingError::InvalidTemperature { value: -0.5 });
    assert!(matches!(
        bad(SamplingParams {
            temperature: f32::NAN,
            ..ok
        }),
        SamplingError::InvalidTemperature { .. }
    ));
    assert!(matches!(
        bad(SamplingParams {
            temperature: f32::INFINITY,
            ..ok
        }),
        SamplingError::InvalidTemperature { .. }
    ));
    for top_p in [0.0, -0.1, 1.5, f32::NAN] {
        assert!(
            matches!(
                bad(SamplingParams { top_p, ..ok }),
                SamplingError::InvalidTopP { .. }
            ),
            "{top_p}"
        );
    }
    for min_p in [-0.01, 1.01, f32::NAN] {
        assert!(
            matches!(
                bad(SamplingParams { min_p, ..ok }),
                SamplingError::InvalidMinP { .. }
            ),
            "{min_p}"
        );
    }
    for repeat_penalty in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let e = bad(SamplingParams {
            repeat_penalty,
            ..ok
        });
        assert!(
            matches!(e, SamplingError::InvalidRepeatPenalty { .. }),
            "{repeat_penalty}"
        );
    }
    assert_eq!(
        e.to_string(),
        "temperature must be a finite number >= 0, got -0.5"
    );
}

#[test]
fn validation_switches_off_neutral_filters() {
    let config = SamplingParams {
        temperature: 0.7,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: 64,
        seed: 9,
    }
    .validate()
    .unwrap();
    let expected = SamplingMode::Random {
        temperature: 0.7,
        top_k: None,
        top_p: None,
        min_p: None,
        seed: 9,
    };
    assert_eq!(config.mode, expected);
    assert_eq!(config.penalty, None);
    let greedy = SamplingParams::greedy().validate().unwrap();
    assert_eq!(greedy.mode, SamplingMode::Greedy);
    let edges = SamplingParams {
        top_p: 1.0,
        min_p: 1.0,
        ..SamplingParams::default()
    };
    assert!(edges.validate().is_ok());
}

#[test]
fn repeat_penalty_divides_positive_and_multiplies_negative_logits() {
    let mut logits = vec![2.0, -1.0, 0.0, 3.0];
    let recent: VecDeque<u32> = [0, 1, 2, 0, 99].into_iter().collect();
    apply_repeat_penalty(&mut logits, &recent, 2.0);
    // Token 0 appears twice but is penalized once; 99 is outside the vocabulary.
    assert_eq!(logits, vec![1.0, -2.0, 0.0, 3.0]);
}

#[test]
fn repeat_penalty_window_holds_the_last_n_tokens() {
    let params = SamplingParams {
        repeat_penalty: 10.0,
        repeat_last_n: 2,
        ..SamplingParams::greedy()
    };
    let mut sampler = Sampler::new(params.validate().unwrap());
    for token in [0, 1, 2] {
        sampler.accept(token);
    }
    // 1 and 2 are penalized to 0.5 and 0.6; 0 left the window and keeps 4.0.
    assert_eq!(sampler.sample(&[4.0, 5.0, 6.0, 3.0]).unwrap(), 0);
    assert_eq!(sampler.recent, VecDeque::from([1, 2]));
}

#[test]
fn greedy_takes_the_first_highest_logit() {
    let mut sampler = Sampler::new(SamplingParams::greedy().validate().unwrap());
    assert_eq!(sampler.sample(&[0.5, 2.0, -1.0, 2.0]).unwrap(), 1);
    assert_eq!(sampler.sample(&[f32::NEG_INFINITY, -3.0]).unwrap(), 1);
}

#[test]
fn top_k_keeps_the_k_highest_sorted() {
    let mut c = Vec::new();
    top_k_of(&[1.0, 5.0, 3.0, 4.0, 2.0], 2, &mut c);
    assert_eq!(ids(&c), vec![1, 3]);
    let mut c = candidates(&[1.0, 5.0, 3.0]);
    sort_descending(&mut c, &mut Vec::new());
    assert_eq!(ids(&c), vec![1, 2, 0]);
    // Ties are broken by id, whatever the partial sort did.
    top_k_of(&[1.0, 1.0, 1.0, 1.0], 3, &mut c);
    assert_eq!(ids(&c), vec![0, 1, 2]);
    // Past the buffer's first fill, with the floor in use.
    let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1000) as f32).collect();
    top_k_of(&logits, 5, &mut c);
    let tops: Vec<f32> = c.iter().map(|c| c.logit).collect();
    assert_eq!(tops, [999.0, 998.0, 997.0, 996.0, 995.0]);
}

#[test]
fn the_radix_sort_orders_as_the_comparison_sort() {
    let mut rng = Xoshiro256::seed_from_u64(11);
    for n in [RADIX_MIN, 3000] {
        let logits: Vec<f32> = (0..n)
            .map(|_| match rng.next_u64() % 8 {
                0 => 0.0,
                1 => -0.0,
                2 => f32::NEG_INFINITY,
                3 => (rng.next_u64() % 5) as f32 - 2.0,
                _ => (rng.next_f64() * 40.0 - 20.0) as f32,
            })
            .collect();
        let mut fast = candidates(&logits);
        sort_descending(&mut fast, &mut Vec::new());
        let mut plain = candidates(&logits);
        plain.sort_by(by_logit_descending);
        assert_eq!(fast, plain, "n = {n}");
    }
}

#[test]
fn top_p_keeps_the_smallest_prefix_reaching_p() {
    let logits = logits_of(&[0.5, 0.3, 0.15, 0.05]);
    let mut probs = Vec::new();
    for (p, kept) in [(0.4, 1), (0.75, 2), (0.85, 3), (0.99, 4), (1.0, 4)] {
        let mut c = candidates(&logits);
        top_p_filter(&mut c, p, &mut probs);
        assert_eq!(ids(&c), (0..kept).collect::<Vec<u32>>(), "p = {p}");
    }
}

#[test]
fn min_p_keeps_tokens_at_least_p_times_as_likely_as_the_top() {
    let logits = logits_of(&[0.5, 0.3, 0.15, 0.05]);
    for (p, kept) in [(0.05, 4), (0.25, 3), (0.5, 2), (0.9, 1), (1.0, 1)] {
        let mut c = candidates(&logits);
        min_p_filter(&mut c, p);
        assert_eq!(ids(&c), (0..kept).collect::<Vec<u32>>(), "p = {p}");
    }
}

#[test]
fn temperature_scales_logits_before_the_softmax() {
    let c = candidates(&[3f32.ln(), 0.0]);
    let mut probs = Vec::new();
    softmax_sorted(&c, 1.0, &mut probs);
    assert!((probs[0] - 0.75).abs() < 1e-7 && (probs[1] - 0.25).abs() < 1e-7);
    // At temperature 2 the odds 3:1 become sqrt(3):1.
    softmax_sorted(&c, 0.5, &mut probs);
    let expected = 3f64.sqrt() / (1.0 + 3f64.sqrt());
    assert!((probs[0] - expected).abs() < 1e-7, "{}", probs[0]);
}

#[test]
fn xoshiro_matches_an_independent_implementation() {
    // Values from a separate implementation written from the published algorithm.
    let mut rng = Xoshiro256::seed_from_u64(0);
    let first: Vec<u64> = (0..4).map(|_| rng.next_u64()).collect();
    assert_eq!(
        first,
        [
            0x99ec5f36cb75f2b4,
            0xbf6e1f784956452a,
            0x1a5f849d4933e6e0,
            0x6aa594f1262d2d2c
        ]
    );
    let mut rng = Xoshiro256::seed_from_u64(42);
    assert_eq!(rng.next_u64(), 0x15780b2e0c2ec716);
    let u = rng.next_f64();
    assert!((0.0..1.0).contains(&u));
}

#[test]
fn a_seed_reproduces_its_draws() {
    let logits: Vec<f32> = (0..200).map(|i| ((i * 37) % 101) as f32 / 25.0).collect();
    let run = |seed| {
        let mut s = random(1.0, 0, 1.0, 0.0, seed);
        (0..50)
            .map(|_| s.sample(&logits).unwrap())
            .collect::<Vec<u32>>()
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}

#[test]
fn draws_follow_the_softmax() {
    let expected = [0.1, 0.2, 0.3, 0.4];
    assert_draws_follow(
        random(1.0, 0, 1.0, 0.0, 1),
        &logits_of(&expected),
        &expected,
    );
}

#[test]
fn draws_at_temperature_two_follow_the_flattened_softmax() {
    let logits = logits_of(&[0.1, 0.2, 0.3, 0.4]);
    let weights: Vec<f64> = [0.1f64, 0.2, 0.3, 0.4].iter().map(|p| p.sqrt()).collect();
    let total: f64 = weights.iter().sum();
    let expected: Vec<f64> = weights.iter().map(|w| w / total).collect();
    assert_draws_follow(random(2.0, 0, 1.0, 0.0, 2), &logits, &expected);
}

#[test]
fn top_k_draws_only_among_the_k_best_in_proportion() {
    let logits = logits_of(&[0.1, 0.2, 0.3, 0.4]);
    let mut sampler = random(1.0, 2, 1.0, 0.0, 3);
    let counts = histogram(&mut sampler, &logits, 70_000);
    assert_eq!(&counts[..2], &[0, 0]);
    // Renormalized: 3/7 and 4/7; one degree of freedom, 10.83 at p = 0.001.
    let chi2 = chi_square(&counts[2..], &[3.0 / 7.0, 4.0 / 7.0]);
    assert!(chi2 < 10.83, "chi-square {chi2} for {counts:?}");
}

#[test]
fn top_p_and_min_p_see_the_distribution_before_temperature() {
    let logits = logits_of(&[0.5, 0.3, 0.15, 0.05]);
    // A huge temperature flattens what is left, but top-p already cut it to two tokens.
    let mut sampler = random(1000.0, 0, 0.75, 0.0, 4);
    let counts = histogram(&mut sampler, &logits, 20_000);
    assert_eq!(&counts[2..], &[0, 0], "{counts:?}");
    assert!(counts[0].abs_diff(counts[1]) < 1_000, "{counts:?}");
    let mut sampler = random(1000.0, 0, 1.0, 0.5, 5);
    let counts = histogram(&mut sampler, &logits, 20_000);
    assert_eq!(&counts[2..], &[0, 0], "{counts:?}");
}

#[test]
fn a_tiny_temperature_is_greedy_without_overflow() {
    let mut sampler = random(1e-30, 0, 1.0, 0.0, 6);
    let logits = [1.0, 3.0e30, 2.0e30, f32::NEG_INFINITY];
    for _ in 0..100 {
        assert_eq!(sampler.sample(&logits).unwrap(), 1);
    }
}

#[test]
fn masked_tokens_are_never_drawn() {
    let logits = [0.0, f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY];
    let mut sampler = random(1.0, 0, 1.0, 0.0, 7);
    let counts = histogram(&mut sampler, &logits, 1_000);
    assert_eq!((counts[1], counts[3]), (0, 0));
}

#[test]
fn bad_logits_are_errors() {
    let mut greedy = Sampler::new(SamplingParams::greedy().validate().unwrap());
    let mut sampler = random(0.8, 40, 0.95, 0.05, 8);
    for s in [&mut greedy, &mut sampler] {
        assert_eq!(s.sample(&[]), Err(SamplingError::EmptyLogits));
        let e = s.sample(&[1.0, f32::NAN]).unwrap_err();
        assert!(matches!(e, SamplingError::BadLogit { token: 1, .. }), "{e}");
        let e = s.sample(&[f32::INFINITY]).unwrap_err();
        assert!(matches!(e, SamplingError::BadLogit { token: 0, .. }), "{e}");
        assert_eq!(
            s.sample(&[f32::NEG_INFINITY; 3]),
            Err(SamplingError::AllMasked)
        );
    }
}

/// The sampler as it was before its fast paths: a copy of the row, every candidate
/// built and sorted (or partly selected for top-k), plain scans. Every fast path must
/// draw exactly its tokens.
mod plain {
    use super::super::*;

    pub struct PlainSampler {
        pub config: SamplingConfig,
        pub rng: Xoshiro256,
        pub recent: VecDeque<u32>,
    }

    impl PlainSampler {
        pub fn new(config: SamplingConfig) -> PlainSampler {
            PlainSampler {
                rng: config.mode.rng(),
                config,
                recent: VecDeque::new(),
            }
        }

        pub fn accept(&mut self, token: u32) {
            remember(&mut self.recent, &self.config, token);
        }

        pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
            check_logits(logits)?;
            let mut scratch = logits.to_vec();
            if let Some(penalty) = self.config.penalty {
                apply_repeat_penalty(&mut scratch, &self.recent, penalty.penalty);
            }
            match self.config.mode {
                SamplingMode::Greedy => Ok(argmax(&scratch)),
                SamplingMode::Random {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    ..
                } => {
                    let mut candidates: Vec<Candidate> = scratch
                        .iter()
                        .enumerate()
                        .map(|(id, &logit)| Candidate {
                            id: id as u32,
                            logit,
                        })
                        .collect();
                    if let Some(k) = top_k {
                        if k < candidates.len() {
                            candidates.select_nth_unstable_by(k - 1, by_logit_descending);
                            candidates.truncate(k);
                        }
                    }
                    candidates.sort_unstable_by(by_logit_descending);
                    let mut probs = Vec::new();
                    if let Some(p) = top_p {
                        top_p_filter(&mut candidates, p, &mut probs);
                    }
                    if let Some(p) = min_p {
                        min_p_filter(&mut candidates, p);
                    }
                    Ok(draw(&candidates, temperature, &mut probs, &mut self.rng))
                }
            }
        }
    }

    pub fn argmax(values: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &v) in values.iter().enumerate().skip(1) {
            if v > values[best] {
                best = i;
            }
        }
        best as u32
    }
}

/// A row of `n` logits of one of several shapes: spread out, a few levels (many ties),
/// signed zeros, masked tokens, a peak far above the rest.
fn test_row(rng: &mut Xoshiro256, n: usize, shape: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let u = rng.next_f64();
            match shape % 5 {
                0 => (u * 30.0 - 15.0) as f32,
                1 => (rng.next_u64() % 6) as f32 * 0.5,
                2 => [0.0, -0.0, 1.0, -1.0][(rng.next_u64() % 4) as usize],
                3 if rng.next_u64().is_multiple_of(3) => f32::NEG_INFINITY,
                3 => (u * 8.0) as f32,
                _ if i == n / 3 => 40.0,
                _ => (u * 60.0 - 50.0) as f32,
            }
        })
        .collect()
}

#[test]
fn greedy_finds_the_first_highest_as_a_plain_scan() {
    let mut rng = Xoshiro256::seed_from_u64(3);
    for n in (1..70).chain([1000, 49_152, 49_153]) {
        for shape in 0..5 {
            let mut row = test_row(&mut rng, n, shape);
            let mut greedy = Sampler::new(SamplingParams::greedy().validate().unwrap());
            let mut plain = plain::PlainSampler::new(SamplingParams::greedy().validate().unwrap());
            assert_eq!(
                greedy.sample(&row),
                plain.sample(&row),
                "n {n}, shape {shape}"
            );
            // A bad logit anywhere (the first one is named).
            let at = (rng.next_u64() % n as u64) as usize;
            row[at] = if shape % 2 == 0 {
                f32::NAN
            } else {
                f32::INFINITY
            };
            if n > 3 {
                row[n - 1] = f32::NAN;
            }
            assert_eq!(
                format!("{:?}", greedy.sample(&row)),
                format!("{:?}", plain.sample(&row)),
                "n {n}, shape {shape}"
            );
        }
    }
}

#[test]
fn every_setting_draws_the_tokens_of_a_full_sort() {
    let mut rng = Xoshiro256::seed_from_u64(5);
    let n = 3000;
    let mut settings = Vec::new();
    for temperature in [0.0, 0.8, 1.5] {
        for top_k in [0, 1, 7, 40, 1000, n - 1, n, n + 5] {
            for (top_p, min_p) in [
                (1.0, 0.0),
                (0.95, 0.05),
                (0.5, 0.0),
                (1.0, 0.2),
                (0.999_999, 0.0),
            ] {
                for repeat_penalty in [1.0, 1.3] {
                    settings.push(SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                        repeat_penalty,
                        repeat_last_n: 16,
                        seed: rng.next_u64(),
                    });
                }
            }
        }
    }
    for (s, params) in settings.iter().enumerate() {
        let config = params.validate().unwrap();
        let mut fast = Sampler::new(config);
        let mut in_place = Sampler::new(config);
        let mut plain = plain::PlainSampler::new(config);
        for step in 0..6u64 {
            let row = test_row(&mut rng, n, s as u64 + step);
            let expected = plain.sample(&row);
            assert_eq!(fast.sample(&row), expected, "{params:?}, step {step}");
            let mut owned = row.clone();
            assert_eq!(
                in_place.sample_in_place(&mut owned),
                expected,
                "{params:?}, step {step}"
            );
            if let Ok(token) = expected {
                fast.accept(token);
                in_place.accept(token);
                plain.accept(token);
            }
        }
    }
}
