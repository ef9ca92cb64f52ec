use super::base::{self, BaseFileError, BaseReader};
use super::*;

/// A made-up model: the logits of a position depend on its token and position only, and
/// every call's tokens are recorded.
struct Fake {
    n_vocab: usize,
    pos: usize,
    calls: Vec<Vec<u32>>,
}

impl Fake {
    fn new(n_vocab: usize) -> Fake {
        Fake {
            n_vocab,
            pos: 0,
            calls: Vec::new(),
        }
    }

    fn row(&self, token: u32, pos: usize) -> Vec<f32> {
        (0..self.n_vocab)
            .map(|i| ((i as f32 * 0.37 + token as f32 * 1.3 + pos as f32 * 0.11).sin()) * 4.0)
            .collect()
    }
}

impl WindowLogits for Fake {
    fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    fn start_window(&mut self) -> Result<(), ModelError> {
        self.pos = 0;
        Ok(())
    }

    fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.calls.push(tokens.to_vec());
        let mut out = Vec::new();
        for &t in tokens {
            out.extend(self.row(t, self.pos));
            self.pos += 1;
        }
        Ok(out)
    }
}

fn text_tokens(n: usize, n_vocab: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + 3) % n_vocab).collect()
}

#[test]
fn log_softmax_is_llama_cpp_s_arithmetic() {
    let logits = [1.0f32, 2.0, 3.0, -1.0];
    // By hand: log Σ exp(l - 3) = ln(e^-2 + e^-1 + 1 + e^-4).
    let sum: f64 = [-2.0f32, -1.0, 0.0, -4.0]
        .iter()
        .map(|&x| f64::from(x.exp()))
        .sum();
    let expected = -(f64::from(1.0f32 - 3.0) - sum.ln());
    assert_eq!(nll(&logits, 0).to_bits(), expected.to_bits());
    // Shifting every logit by a constant changes nothing but rounding.
    let shifted: Vec<f32> = logits.iter().map(|l| l + 100.0).collect();
    assert!((nll(&shifted, 2) - nll(&logits, 2)).abs() < 1e-6);
    // A token that takes every probability costs nothing.
    assert_eq!(nll(&[0.0, -1e30], 0), 0.0);
    // The saved-file variant agrees to f32 rounding.
    let mut row = vec![0u16; base::row_len(4)];
    let saved = base::encode_row(&logits, 0, &mut row);
    assert!((f64::from(saved) - nll(&logits, 0)).abs() < 1e-6);
}

#[test]
fn the_estimate_and_its_error_follow_llama_cpp() {
    let values = [1.0, 2.0, 4.0, 3.0];
    let mut sums = NllSums::default();
    values.iter().for_each(|&v| sums.add(v));
    let mean: f64 = 2.5;
    let var: f64 = (1.0 + 4.0 + 16.0 + 9.0) / 4.0 - mean * mean;
    let e = sums.estimate().expect("a spread");
    assert_eq!(e.ppl, mean.exp());
    assert_eq!(e.error, (var / 3.0).sqrt() * mean.exp());
    assert_eq!(sums.ppl(), mean.exp());
    // No spread, no error.
    let mut flat = NllSums::default();
    flat.add(2.0);
    flat.add(2.0);
    assert_eq!(flat.estimate(), None);
}

#[test]
fn windows_are_whole_and_at_least_two() {
    let w = Windows::plan(1000, 128, None).unwrap();
    assert_eq!((w.n_chunk, w.first(), w.scored()), (7, 64, 63));
    assert_eq!(Windows::plan(1000, 128, Some(3)).unwrap().n_chunk, 3);
    assert_eq!(Windows::plan(1000, 128, Some(99)).unwrap().n_chunk, 7);
    let short = Windows::plan(255, 128, None).unwrap_err().to_string();
    assert!(
        short.contains("255 tokens") && short.contains("at least 256"),
        "{short}"
    );
    assert!(matches!(
        Windows::plan(100, 2, None),
        Err(PerplexityError::ContextTooSmall { n_ctx: 2 })
    ));
}

#[test]
fn windows_start_with_bos_and_score_their_second_half() {
    let tokens = text_tokens(40, 50);
    let options = options_for(16, 2048, Some(1));
    let mut fake = Fake::new(50);
    let mut seen = Vec::new();
    let outcome = perplexity(&mut fake, &tokens, &options, None, &mut |i, ppl| {
        seen.push((i, ppl))
    })
    .unwrap();
    assert_eq!(outcome.windows.n_chunk, 2);
    assert_eq!(outcome.sums.count, 2 * 7);
    assert_eq!(seen.len(), 2);
    assert_eq!(fake.calls.len(), 2);
    for (w, call) in fake.calls.iter().enumerate() {
        assert_eq!(call[0], 1);
        assert_eq!(call[1..], tokens[w * 16 + 1..(w + 1) * 16]);
    }
    // The same sums by hand: positions 8..=14 against the tokens after them.
    let mut expected = NllSums::default();
    for w in 0..2 {
        let mut local = NllSums::default();
        for pos in 8..15 {
            let row = fake.row(tokens[w * 16 + pos], pos);
            local.add(nll(&row, tokens[w * 16 + pos + 1] as usize));
        }
        expected.merge(&local);
    }
    assert_eq!(outcome.sums, expected);
    assert_eq!(seen[1].1, expected.ppl());
}

#[test]
fn the_batch_size_cuts_calls_but_not_the_figures() {
    let tokens = text_tokens(70, 30);
    let run = |batch| {
        let mut fake = Fake::new(30);
        let options = options_for(32, batch, None);
        let outcome = perplexity(&mut fake, &tokens, &options, None, &mut |_, _| {}).unwrap();
        (outcome.sums, fake.calls.len())
    };
    let (whole, calls) = run(512);
    assert_eq!(calls, 2);
    for batch in [1, 5, 16, 31] {
        let (sums, calls) = run(batch);
        assert_eq!(sums, whole, "batch {batch}");
        assert_eq!(calls, 2 * 32usize.div_ceil(batch));
    }
}

#[test]
fn nearest_int_rows_round_trip() {
    let logits: Vec<f32> = (0..7).map(|i| i as f32 * 1.5 - 3.0).collect();
    let mut row = vec![0xffffu16; base::row_len(7)];
    assert_eq!(row.len(), 12);
    base::encode_row(&logits, 3, &mut row);
    assert_eq!(row[11], 0, "the odd vocabulary's padding word");
    let (scale, min, q) = base::decode_row(&row);
    let max = 6.0 - 3.0;
    let lse = (logits
        .iter()
        .map(|&l| f64::from((l - max).exp()))
        .sum::<f64>())
    .ln() as f32;
    for (i, &l) in logits.iter().enumerate() {
        let decoded = scale * f32::from(q[i]) + min;
        assert!((decoded - (l - max - lse)).abs() < 1e-3, "{i}");
    }
    assert_eq!(q[6], 65535);
    assert_eq!(q[0], 0);
}

/// Options for windows of `n_ctx` tokens, calls of `batch`, all the text.
fn options_for(n_ctx: usize, batch: usize, bos: Option<u32>) -> Options {
    Options {
        n_ctx,
        batch,
        chunks: None,
        bos,
    }
}

/// KL-divergence options for calls of `batch`, all the base file.
fn kld_options_for(batch: usize, bos: Option<u32>) -> KldOptions {
    KldOptions {
        batch,
        chunks: None,
        bos,
    }
}

fn saved_base(tokens: &[u32], n_vocab: usize, options: &Options) -> (Vec<u8>, NllSums) {
    let mut fake = Fake::new(n_vocab);
    let mut bytes = Vec::new();
    let outcome = perplexity(&mut fake, tokens, options, Some(&mut bytes), &mut |_, _| {}).unwrap();
    (bytes, outcome.sums)
}

#[test]
fn a_base_file_round_trips_and_a_model_matches_itself() {
    let tokens = text_tokens(100, 40);
    let options = options_for(32, 7, Some(2));
    let (bytes, sums) = saved_base(&tokens, 40, &options);
    let expected_len = base::file_size(32, 40, 3).unwrap();
    assert_eq!(bytes.len() as u64, expected_len);
    assert_eq!(&bytes[..8], base::MAGIC);

    let mut reader = BaseReader::open(&bytes[..], bytes.len() as u64).unwrap();
    assert_eq!(reader.header().n_ctx, 32);
    assert_eq!(reader.header().n_vocab, 40);
    assert_eq!(reader.header().n_chunk, 3);
    assert_eq!(reader.header().tokens, tokens[..96]);

    let kld_options = kld_options_for(32, Some(2));
    let mut fake = Fake::new(40);
    let mut chunks = 0;
    let outcome = kl_divergence(&mut fake, &mut reader, &kld_options, &mut |_, _| {
        chunks += 1
    })
    .unwrap();
    assert_eq!(chunks, 3);
    let stats = outcome.stats;
    assert_eq!(stats.count, 3 * 15);
    assert_eq!(stats.n_same_top, stats.count);
    // The model's own nll is the saved run's, computed the same way.
    assert_eq!(stats.sum_nll, sums.nll);
    // Against itself the divergence is the 16-bit rounding's only: tiny.
    assert!(
        stats.sum_kld.abs() / (stats.count as f64) < 1e-4,
        "{stats:?}"
    );
    assert!(outcome.kld_values.iter().all(|k| k.abs() < 1e-3));
    let summary = stats.summary();
    assert!((summary.ppl_ratio.value - 1.0).abs() < 1e-4, "{summary:?}");
    assert_eq!(summary.same_top.value, 1.0);
}

#[test]
fn a_base_file_for_another_vocabulary_is_refused() {
    let tokens = text_tokens(64, 40);
    let options = options_for(32, 32, None);
    let (bytes, _) = saved_base(&tokens, 40, &options);
    let mut reader = BaseReader::open(&bytes[..], bytes.len() as u64).unwrap();
    let kld_options = kld_options_for(32, None);
    let error = kl_divergence(
        &mut Fake::new(41),
        &mut reader,
        &kld_options,
        &mut |_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("n_vocab is 40") && error.contains("41"),
        "{error}"
    );
}

#[test]
fn malformed_base_files_are_refused_naming_what_is_wrong() {
    let tokens = text_tokens(64, 40);
    let options = options_for(32, 32, None);
    let (good, _) = saved_base(&tokens, 40, &options);
    let open = |bytes: &[u8]| BaseReader::open(bytes, bytes.len() as u64).err();

    assert!(matches!(
        open(b"_logits"),
        Some(BaseFileError::ShortHeader { found: 7 })
    ));
    let mut magic = good.clone();
    magic[0] = b'X';
    assert!(matches!(open(&magic), Some(BaseFileError::NotABaseFile)));

    // Cut short, or with bytes after its end.
    let short = open(&good[..good.len() - 1]).unwrap().to_string();
    assert!(short.contains("n_ctx 32, n_vocab 40, n_chunk 2"), "{short}");
    let mut long = good.clone();
    long.push(0);
    assert!(matches!(open(&long), Some(BaseFileError::WrongSize { .. })));

    // Fields out of range, each named.
    let with = |at: usize, value: i32| {
        let mut bytes = good.clone();
        bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
        open(&bytes).unwrap().to_string()
    };
    assert!(with(8, 2).contains("n_ctx is 2"));
    assert!(with(12, 0).contains("n_vocab is 0"));
    assert!(with(16, -1).contains("n_chunk is -1"));
    // A huge count is a size mismatch, not an allocation.
    assert!(with(16, i32::MAX).contains("bytes"));
    assert!(with(8, -1).contains("bytes"));
    // A negative token.
    let bad_token = with(20 + 4 * 5, -7);
    assert!(bad_token.contains("token 5 is -7"), "{bad_token}");

    // Reading past the last window.
    let mut reader = BaseReader::open(&good[..], good.len() as u64).unwrap();
    let mut rows = Vec::new();
    reader.read_chunk(&mut rows).unwrap();
    reader.read_chunk(&mut rows).unwrap();
    assert!(matches!(
        reader.read_chunk(&mut rows),
        Err(BaseFileError::NoMoreChunks { n_chunk: 2 })
    ));
}

#[test]
fn percentiles_interpolate_in_f32() {
    let values: Vec<f32> = (0..11).map(|i| i as f32).collect();
    assert_eq!(percentile(&values, 0.0), 0.0);
    assert_eq!(percentile(&values, 1.0), 10.0);
    assert_eq!(percentile(&values, 0.5), 5.0);
    assert_eq!(percentile(&values, 0.95), 9.5);
    assert!((percentile(&values, 0.999) - 9.99).abs() < 1e-5);
    assert_eq!(median(&values), 5.0);
    assert_eq!(median(&values[..10]), 4.5);
    assert_eq!(percentile(&[3.0], 0.3), 3.0);
}

#[test]
fn the_uncertainty_needs_more_than_ten_values() {
    let few = mean_and_uncertainty(10.0, 30.0, 5);
    assert_eq!((few.value, few.error), (2.0, 0.0));
    let many = mean_and_uncertainty(20.0, 60.0, 11);
    let mean = 20.0 / 11.0;
    assert_eq!(many.value, mean);
    assert_eq!(many.error, ((60.0 / 11.0 - mean * mean) / 10.0f64).sqrt());
    assert_eq!(mean_and_uncertainty(0.0, 0.0, 0).value, 0.0);
}
