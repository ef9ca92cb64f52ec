//! The benches' timed loops: decode steps and prompts, from an empty cache each run.

use std::time::Instant;

use anyhow::Result;

/// The benches' prompt of `len` tokens, spread over a vocabulary of `n_vocab`.
pub(super) fn prompt_ids(n_vocab: u64, len: usize) -> Vec<u32> {
    (0..len as u64)
        .map(|i| (1 + (i * 7919) % (n_vocab - 1)) as u32)
        .collect()
}

/// Prompt tokens a second of `repeat` timed passes of `ids` (`pass`), each from an
/// empty cache (`clear`, untimed), after one untimed pass.
pub(super) fn prompt_rates<G>(
    repeat: usize,
    ids: &[u32],
    gpu: &mut G,
    clear: impl Fn(&mut G) -> Result<(), model::ModelError>,
    pass: impl Fn(&mut G, &[u32]) -> Result<(), model::ModelError>,
) -> Result<Vec<f64>> {
    clear(gpu)?;
    pass(gpu, ids)?;
    let mut runs = Vec::new();
    for _ in 0..repeat {
        clear(gpu)?;
        let start = Instant::now();
        pass(gpu, ids)?;
        runs.push(ids.len() as f64 / start.elapsed().as_secs_f64());
    }
    Ok(runs)
}

/// Tokens a second of `repeat` runs of `tokens` greedy steps (`step`: the next token
/// after one), each from an empty cache (`clear`).
pub(super) fn decode_rates<G>(
    repeat: usize,
    tokens: usize,
    gpu: &mut G,
    clear: impl Fn(&mut G) -> Result<(), model::ModelError>,
    step: impl Fn(&mut G, u32) -> Result<u32, model::ModelError>,
) -> Result<Vec<f64>> {
    let mut runs = Vec::new();
    for _ in 0..repeat {
        clear(gpu)?;
        let start = Instant::now();
        let mut token = 1;
        for _ in 0..tokens {
            token = step(gpu, token)?;
        }
        runs.push(tokens as f64 / start.elapsed().as_secs_f64());
    }
    Ok(runs)
}
