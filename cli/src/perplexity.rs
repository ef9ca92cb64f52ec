//! `rocmforge perplexity`: a model's perplexity over a text file, and the KL divergence
//! of its distributions from a base model's, printed as llama.cpp's `llama-perplexity`
//! prints them.

use std::fs::File;
use std::io::{BufReader, BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use model::gpu::GpuOptions;
use model::perplexity::base::BaseReader;
use model::perplexity::{
    self, median, percentile, CpuWindows, KldOptions, KldStats, Options, WindowLogits,
};
use model::tokenizer::{EncodeOptions, Tokenizer};
use model::{Model, ModelError};

use crate::device_choice::{Chosen, DeviceArg, GpuStart};
use crate::interrupt::install_ctrl_c;
use crate::load::LoadModeArg;
use crate::on_gpu;
use crate::options;

/// llama-perplexity's default window.
pub const DEFAULT_CTX: usize = 512;
/// llama-perplexity's default batch.
pub const DEFAULT_BATCH: usize = 2048;

#[derive(clap::Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    model: options::ModelArgs,
    /// The text to score (not read with --kl-divergence: the base file holds the tokens).
    #[arg(
        long,
        short = 'f',
        value_name = "PATH",
        required_unless_present = "kl_divergence"
    )]
    file: Option<PathBuf>,
    /// Tokens a window [default: 512; with --kl-divergence, the base file's].
    #[arg(long, short = 'c', value_name = "N")]
    ctx_size: Option<usize>,
    /// Most tokens one forward pass takes; a pass never spans two windows.
    #[arg(long, short = 'b', default_value_t = DEFAULT_BATCH,
          value_parser = crate::generate::parse_batch_size)]
    batch_size: usize,
    /// Score at most this many windows.
    #[arg(long, value_name = "N", value_parser = parse_chunks)]
    chunks: Option<usize>,
    /// Without --kl-divergence: write the scored positions' log-probabilities to FILE
    /// (llama.cpp's format). With it: the file to compare against.
    #[arg(long, value_name = "FILE")]
    kl_divergence_base: Option<PathBuf>,
    /// Compare the model with the base file's log-probabilities.
    #[arg(long, requires = "kl_divergence_base")]
    kl_divergence: bool,
    /// Where to compute: the GPU when one is usable (auto), the GPU or an error (gpu),
    /// or the CPU (llama.cpp's figures to the printed digit).
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
    /// On a GPU, when the weights go to the device.
    #[arg(long, value_enum, default_value = "background")]
    load_mode: LoadModeArg,
    /// On a GPU, the device memory the weights may take, in MiB.
    #[arg(long, value_name = "MIB")]
    gpu_budget_mib: Option<u64>,
    #[command(flatten)]
    placement: options::PlacementArgs,
    /// On the CPU, flash attention (on; auto is on) or two matrix products around a
    /// softmax (off), each as llama.cpp computes it.
    #[arg(long, visible_alias = "fa", value_enum, default_value = "auto")]
    flash_attn: options::FlashAttn,
    #[command(flatten)]
    cache_types: options::CacheTypeArgs,
    #[command(flatten)]
    tuning: options::TuningArgs,
}

/// `--chunks`: at least 1.
fn parse_chunks(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("at least 1 window must be scored".to_owned()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{text:?} is not a number of windows")),
    }
}

pub fn run(args: &PerplexityArgs) -> Result<ExitCode> {
    let tuning = args.tuning.apply();
    let threads = options::worker_threads(args.model.threads)?;
    if args.ctx_size == Some(0) {
        bail!("--ctx-size must be at least 3 tokens");
    }
    // Read the inputs before the model: a missing file is said at once.
    let text = read_text(args)?;
    let base_in = open_base(args)?;
    let stop = install_ctrl_c()?;
    let placement = args.placement.placement()?;
    let gpu_start = GpuStart::begin(args.device, args.placement.first_device());

    let (path, store) = args.model.open(false)?;
    let tokenizer = Tokenizer::from_metadata(store.metadata())
        .with_context(|| format!("{}: tokenizer", path.display()))?;
    let model = Model::load(&store).with_context(|| format!("{}", path.display()))?;
    let bos = match tokenizer.adds_bos() {
        true => tokenizer.special_tokens().bos,
        false => None,
    };
    let n_ctx = match &base_in {
        Some((_, reader)) => reader.header().n_ctx,
        None => args.ctx_size.unwrap_or(DEFAULT_CTX),
    };
    let (chosen, placement) = on_gpu::choose(
        gpu_start.finish()?,
        &model,
        args.device,
        &args.placement,
        placement,
        args.gpu_budget_mib,
        args.cache_types.types(),
    );
    let mut gpu_model;
    let mut cpu_model;
    let source: &mut dyn WindowLogits = match chosen {
        Chosen::Gpu { device, .. } => {
            eprintln!("perplexity: computing on GPU {}", device.name());
            let gpu_options = GpuOptions {
                device: device.ordinal(),
                mode: args.load_mode.into(),
                budget: args.gpu_budget_mib.map(|mib| mib.saturating_mul(1 << 20)),
                context_size: n_ctx,
                kv_types: args.cache_types.types(),
                stop: Some(Arc::clone(&stop)),
                tuning: tuning.gpu,
            };
            let batch = args.batch_size.min(n_ctx).max(1);
            gpu_model = on_gpu::engine(&model, &gpu_options, &placement, batch)
                .with_context(|| format!("{} ({})", path.display(), device.name()))?;
            &mut gpu_model
        }
        Chosen::Cpu { reason } => {
            eprintln!("perplexity: computing on the CPU, {threads} threads ({reason})");
            cpu_model = CpuWindows::new(&model, n_ctx, args.flash_attn.method())
                .with_types(args.cache_types.types())
                .with_context(|| format!("{}", path.display()))?;
            &mut cpu_model
        }
    };
    let mut source = Stoppable {
        inner: source,
        stop: &stop,
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match base_in {
        Some((base_path, mut reader)) => {
            let options = KldOptions {
                batch: args.batch_size,
                chunks: args.chunks,
                bos,
            };
            kl_divergence(&mut source, &mut reader, &options, &mut out)
                .with_context(|| format!("KL divergence against {}", base_path.display()))?;
        }
        None => {
            let text = text.expect("clap requires --file");
            score_text(&mut source, &tokenizer, &text, bos, n_ctx, args, &mut out)?;
        }
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// The text of --file, unless the run compares with a base file (which holds the tokens).
fn read_text(args: &PerplexityArgs) -> Result<Option<String>> {
    Ok(match (&args.file, args.kl_divergence) {
        (Some(path), false) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the text {}", path.display()))?,
        ),
        (Some(path), true) => {
            eprintln!(
                "note: --kl-divergence scores the base file's tokens; {} is not read",
                path.display()
            );
            None
        }
        (None, _) => None,
    })
}

/// With --kl-divergence, the base file opened and its header checked against --ctx-size.
fn open_base(args: &PerplexityArgs) -> Result<Option<(PathBuf, BaseReader<BufReader<File>>)>> {
    if !args.kl_divergence {
        return Ok(None);
    }
    let path = args.kl_divergence_base.as_ref().expect("clap requires it");
    let file =
        File::open(path).with_context(|| format!("opening the base file {}", path.display()))?;
    let len = file.metadata()?.len();
    let reader = BaseReader::open(BufReader::new(file), len)
        .with_context(|| format!("base file {}", path.display()))?;
    let n_ctx = reader.header().n_ctx;
    if let Some(c) = args.ctx_size.filter(|&c| c != n_ctx) {
        bail!(
            "base file {}: its n_ctx is {n_ctx}, but --ctx-size is {c}",
            path.display()
        );
    }
    Ok(Some((path.clone(), reader)))
}

/// The perplexity of `text` over windows of n_ctx tokens, each window's figure printed as
/// it is scored and the final estimate after them; with --kl-divergence-base, the scored
/// positions' log-probabilities written to that file too.
fn score_text(
    source: &mut Stoppable<'_>,
    tokenizer: &Tokenizer,
    text: &str,
    bos: Option<u32>,
    n_ctx: usize,
    args: &PerplexityArgs,
    out: &mut dyn Write,
) -> Result<()> {
    let tokens = tokenizer.encode(
        text,
        EncodeOptions {
            add_special: true,
            parse_special: false,
        },
    )?;
    let options = Options {
        n_ctx,
        batch: args.batch_size,
        chunks: args.chunks,
        bos,
    };
    let mut base_out = match &args.kl_divergence_base {
        Some(path) => Some((
            path,
            BufWriter::new(
                File::create(path)
                    .with_context(|| format!("creating the base file {}", path.display()))?,
            ),
        )),
        None => None,
    };
    let windows = perplexity::Windows::plan(tokens.len(), n_ctx, args.chunks)
        .with_context(|| format!("{}", args.file.as_ref().expect("a text").display()))?;
    eprintln!(
        "perplexity: {} tokens, {} windows of {n_ctx}, {} scored each, batch {}",
        tokens.len(),
        windows.n_chunk,
        windows.scored(),
        args.batch_size.min(n_ctx)
    );
    let mut write_error = None;
    let mut on_chunk = |i: usize, ppl: f64| {
        if write_error.is_none() {
            if let Err(e) = write!(out, "[{i}]{},", fixed(ppl, 0, 4)).and_then(|()| out.flush()) {
                write_error = Some(e);
            }
        }
    };
    let outcome = perplexity::perplexity(
        source,
        &tokens,
        &options,
        base_out.as_mut().map(|(_, w)| w as &mut dyn Write),
        &mut on_chunk,
    )
    .with_context(|| match &base_out {
        Some((path, _)) => format!("writing the base file {}", path.display()),
        None => "perplexity".to_owned(),
    })?;
    if let Some(e) = write_error {
        return Err(e).context("writing to stdout");
    }
    writeln!(out)?;
    match outcome.sums.estimate() {
        Some(e) => writeln!(
            out,
            "Final estimate: PPL = {} +/- {}",
            fixed(e.ppl, 0, 4),
            fixed(e.error, 0, 5)
        )?,
        None => eprintln!(
            "warning: PPL = {}, but the spread of log(prob) is not positive: no \
             uncertainty",
            fixed(outcome.sums.ppl(), 0, 4)
        ),
    }
    Ok(())
}

/// A source that stops between windows once Ctrl-C was pressed.
struct Stoppable<'a> {
    inner: &'a mut dyn WindowLogits,
    stop: &'a AtomicBool,
}

impl WindowLogits for Stoppable<'_> {
    fn n_vocab(&self) -> usize {
        self.inner.n_vocab()
    }

    fn start_window(&mut self) -> Result<(), ModelError> {
        if self.stop.load(Ordering::SeqCst) {
            return Err(ModelError::Interrupted);
        }
        self.inner.start_window()
    }

    fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.inner.forward(tokens)
    }
}

/// The KL-divergence run and its report, as llama-perplexity prints them.
fn kl_divergence(
    source: &mut dyn WindowLogits,
    reader: &mut BaseReader<BufReader<File>>,
    options: &KldOptions,
    out: &mut dyn Write,
) -> Result<()> {
    let mut write_error = None;
    let mut on_chunk = |i: usize, stats: &KldStats| {
        let mut text = String::new();
        if i == 1 {
            text.push_str(
                "\nchunk             PPL               ln(PPL(Q)/PPL(base))          \
                 KL Divergence              Δp RMS            Same top p\n",
            );
        }
        text.push_str(&chunk_line(i, stats));
        if write_error.is_none() {
            if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
                write_error = Some(e);
            }
        }
    };
    let mut outcome = perplexity::kl_divergence(source, reader, options, &mut on_chunk)?;
    if let Some(e) = write_error {
        return Err(e).context("writing to stdout");
    }
    writeln!(out)?;
    if outcome.stats.count < 100 {
        eprintln!(
            "note: {} tokens scored: too few for the statistics (100 or more)",
            outcome.stats.count
        );
        return Ok(());
    }
    outcome.kld_values.sort_by(f32::total_cmp);
    outcome.p_diff_values.sort_by(f32::total_cmp);
    out.write_all(
        statistics(&outcome.stats, &outcome.kld_values, &outcome.p_diff_values).as_bytes(),
    )?;
    Ok(())
}

/// One window's line of the running figures.
fn chunk_line(i: usize, stats: &KldStats) -> String {
    let s = stats.summary();
    format!(
        "{i:4}    {} ± {}    {} ± {}    {} ± {}    {} ± {} %    {} ± {} %\n",
        fixed(s.ppl.value, 9, 4),
        fixed(s.ppl.error, 9, 4),
        fixed(s.log_ppl_ratio.value, 10, 5),
        fixed(s.log_ppl_ratio.error, 10, 5),
        fixed(s.kld.value, 10, 5),
        fixed(s.kld.error, 10, 5),
        fixed(100.0 * s.p_diff_rms.value, 6, 3),
        fixed(100.0 * s.p_diff_rms.error, 6, 3),
        fixed(100.0 * s.same_top.value, 6, 3),
        fixed(100.0 * s.same_top.error, 6, 3),
    )
}

/// The closing statistics; `kld` and `p_diff` sorted.
fn statistics(stats: &KldStats, kld: &[f32], p_diff: &[f32]) -> String {
    let s = stats.summary();
    let f = |x: f64| fixed(x, 10, 6);
    let pm = |u: perplexity::Uncertain| format!("{} ± {}", f(u.value), f(u.error));
    let pct = |x: f64, width: usize| fixed(100.0 * x, width, 3);
    let mut t = String::new();
    t.push_str("====== Perplexity statistics ======\n");
    t.push_str(&format!("Mean PPL(Q)                   : {}\n", pm(s.ppl)));
    t.push_str(&format!(
        "Mean PPL(base)                : {}\n",
        pm(s.ppl_base)
    ));
    t.push_str(&format!(
        "Cor(ln(PPL(Q)), ln(PPL(base))): {}%\n",
        fixed(100.0 * s.log_ppl_correlation, 6, 2)
    ));
    t.push_str(&format!(
        "Mean ln(PPL(Q)/PPL(base))     : {}\n",
        pm(s.log_ppl_ratio)
    ));
    t.push_str(&format!(
        "Mean PPL(Q)/PPL(base)         : {}\n",
        pm(s.ppl_ratio)
    ));
    t.push_str(&format!(
        "Mean PPL(Q)-PPL(base)         : {}\n",
        pm(s.ppl_diff)
    ));
    t.push('\n');
    t.push_str("====== KL divergence statistics ======\n");
    t.push_str(&format!("Mean    KLD: {}\n", pm(s.kld)));
    let k = |x: f32| f(f64::from(x));
    t.push_str(&format!("Maximum KLD: {}\n", k(kld[kld.len() - 1])));
    for (label, fraction) in [
        ("99.9%", 0.999f32),
        ("99.0%", 0.990),
        ("95.0%", 0.950),
        ("90.0%", 0.900),
    ] {
        t.push_str(&format!(
            "{label}   KLD: {}\n",
            k(percentile(kld, fraction))
        ));
    }
    t.push_str(&format!("Median  KLD: {}\n", k(median(kld))));
    for (label, fraction) in [
        ("10.0%", 0.100f32),
        (" 5.0%", 0.050),
        (" 1.0%", 0.010),
        (" 0.1%", 0.001),
    ] {
        t.push_str(&format!(
            "{label}   KLD: {}\n",
            k(percentile(kld, fraction))
        ));
    }
    t.push_str(&format!("Minimum KLD: {}\n", k(kld[0])));
    t.push('\n');
    t.push_str("====== Token probability statistics ======\n");
    t.push_str(&format!(
        "Mean    Δp: {} ± {} %\n",
        pct(s.p_diff.value, 6),
        pct(s.p_diff.error, 5)
    ));
    let p = |x: f32| pct(f64::from(x), 6);
    t.push_str(&format!("Maximum Δp: {}%\n", p(p_diff[p_diff.len() - 1])));
    for (label, fraction) in [
        ("99.9%", 0.999f32),
        ("99.0%", 0.990),
        ("95.0%", 0.950),
        ("90.0%", 0.900),
        ("75.0%", 0.750),
    ] {
        t.push_str(&format!(
            "{label}   Δp: {}%\n",
            p(percentile(p_diff, fraction))
        ));
    }
    t.push_str(&format!("Median  Δp: {}%\n", p(median(p_diff))));
    for (label, fraction) in [
        ("25.0%", 0.250f32),
        ("10.0%", 0.100),
        (" 5.0%", 0.050),
        (" 1.0%", 0.010),
        (" 0.1%", 0.001),
    ] {
        t.push_str(&format!(
            "{label}   Δp: {}%\n",
            p(percentile(p_diff, fraction))
        ));
    }
    t.push_str(&format!("Minimum Δp: {}%\n", p(p_diff[0])));
    t.push_str(&format!(
        "RMS Δp    : {} ± {} %\n",
        pct(s.p_diff_rms.value, 6),
        pct(s.p_diff_rms.error, 5)
    ));
    t.push_str(&format!(
        "Same top p: {} ± {} %\n",
        pct(s.same_top.value, 6),
        pct(s.same_top.error, 5)
    ));
    t
}

/// `x` with `precision` decimals, right-aligned in `width`, as C's `%*.*f` writes it
/// (`nan`, `-nan`, `inf` for the values that are not finite).
fn fixed(x: f64, width: usize, precision: usize) -> String {
    let text = if x.is_nan() {
        if x.is_sign_negative() { "-nan" } else { "nan" }.to_owned()
    } else if x.is_infinite() {
        if x < 0.0 { "-inf" } else { "inf" }.to_owned()
    } else {
        format!("{x:.precision$}")
    };
    format!("{text:>width$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_as_printf_writes_them() {
        assert_eq!(fixed(23.86641, 0, 4), "23.8664");
        assert_eq!(fixed(1.5, 9, 4), "   1.5000");
        assert_eq!(fixed(-0.0, 10, 5), "  -0.00000");
        assert_eq!(fixed(-1e-9, 0, 3), "-0.000");
        assert_eq!(fixed(f64::NAN, 6, 3), "   nan");
        assert_eq!(fixed(-f64::NAN, 6, 3), "  -nan");
        assert_eq!(fixed(f64::INFINITY, 0, 3), "inf");
    }

    #[test]
    fn chunks_are_counted_from_one() {
        assert_eq!(parse_chunks("3"), Ok(3));
        assert!(parse_chunks("0").unwrap_err().contains("at least 1"));
        assert!(parse_chunks("x").is_err());
    }
}
