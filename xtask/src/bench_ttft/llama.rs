//! llama.cpp's `llama-completion`: how bench-ttft runs it and reads the timings it
//! prints about itself.

use std::ffi::OsString;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result};

/// llama.cpp's own timings of one run, from the perf lines it prints on stderr at exit
/// (`common_perf_print:        load time =  612.34 ms`, …).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Perf {
    /// "load time": from the start of loading to the first evaluation.
    pub load_ms: Option<f64>,
    /// "prompt eval time": the prompt's batches.
    pub prompt_eval_ms: Option<f64>,
    /// The prompt tokens it evaluated.
    pub prompt_eval_tokens: Option<usize>,
    /// "total time": from the context's start to the print.
    pub total_ms: Option<f64>,
}

/// The last perf figures in `stderr`; fields it does not print stay `None`.
pub fn parse_perf(stderr: &str) -> Perf {
    let mut perf = Perf::default();
    for line in stderr.lines() {
        // `<function>: <label> = <value> ms [/ <count> tokens (…)]`
        let Some((left, right)) = line.split_once('=') else {
            continue;
        };
        let label = left.rsplit(':').next().unwrap_or("").trim();
        let value = right
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok());
        let count = right
            .split_once('/')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .and_then(|n| n.parse::<usize>().ok());
        match label {
            "load time" => perf.load_ms = value,
            "prompt eval time" => {
                perf.prompt_eval_ms = value;
                perf.prompt_eval_tokens = count;
            }
            "total time" => perf.total_ms = value,
            _ => {}
        }
    }
    perf
}

/// The options of `llama-completion` that only some builds offer.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Offers {
    /// `--no-warmup`: without it, an empty batch runs through the model before the
    /// prompt, which is not part of a user's request.
    pub no_warmup: bool,
    /// `--no-display-prompt`: without it, the prompt is echoed on stdout before the
    /// generated text, and the first output is not the first token.
    pub no_display_prompt: bool,
}

/// Which of [`Offers`]' options this build's `--help` lists.
pub fn offers(binary: &Path) -> Result<Offers> {
    let output = Command::new(binary)
        .arg("--help")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} --help", binary.display()))?;
    let mut help = String::from_utf8_lossy(&output.stdout).into_owned();
    help.push_str(&String::from_utf8_lossy(&output.stderr));
    Ok(offers_in(&help))
}

fn offers_in(help: &str) -> Offers {
    Offers {
        no_warmup: help.contains("--no-warmup"),
        no_display_prompt: help.contains("--no-display-prompt"),
    }
}

/// The arguments of one run: the prompt from `prompt_file`, one token generated
/// greedily, not in conversation mode, every layer on the GPU (`gpu`) or none, a
/// context of `ctx_size`, without the warmup and the prompt's echo where offered.
pub fn arguments(
    model: &Path,
    prompt_file: &Path,
    gpu: bool,
    ctx_size: usize,
    offers: Offers,
) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec!["-m".into(), model.into(), "-f".into(), prompt_file.into()];
    let layers = if gpu { "99" } else { "0" };
    for arg in ["-n", "1", "-ngl", layers, "-no-cnv", "--temp", "0", "-c"] {
        args.push(arg.into());
    }
    args.push(ctx_size.to_string().into());
    if offers.no_warmup {
        args.push("--no-warmup".into());
    }
    if offers.no_display_prompt {
        args.push("--no-display-prompt".into());
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What llama-completion prints at exit after `-n 1` (llama.cpp's
    /// `common_perf_print`, with the eval line of a run that decoded nothing after the
    /// prompt), among other log lines.
    const SAMPLE: &str = "\
main: llama threadpool init, n_threads = 2
llama_context: n_ctx_seq (2064) < n_ctx_train (8192) -- the full capacity of the model will not be utilized
the the the the the the the the

common_perf_print:    sampling time =       0.31 ms
common_perf_print:    samplers time =       0.12 ms /     9 tokens
common_perf_print:        load time =     612.34 ms
common_perf_print: prompt eval time =      50.12 ms /     8 tokens (    6.27 ms per token,   159.62 tokens per second)
common_perf_print:        eval time =       0.00 ms /     0 runs   (     nan ms per token,      nan tokens per second)
common_perf_print:       total time =     662.95 ms /     8 tokens
common_perf_print: unaccounted time =     612.52 ms /  92.4 %      (total - sampling - prompt eval - eval) / (total)
common_perf_print:    graphs reused =          0
llama_memory_breakdown_print: | memory breakdown [MiB] | total   free    self   model   context   compute    unaccounted |
";

    #[test]
    fn perf_lines_give_load_and_prompt_times() {
        let perf = parse_perf(SAMPLE);
        assert_eq!(
            perf,
            Perf {
                load_ms: Some(612.34),
                prompt_eval_ms: Some(50.12),
                prompt_eval_tokens: Some(8),
                total_ms: Some(662.95),
            }
        );
    }

    #[test]
    fn older_perf_prefixes_and_missing_lines_are_read_too() {
        // Older builds print `llama_perf_context_print:`; the last figures win.
        let old = "llama_perf_context_print:        load time =   1000.00 ms\n\
                   llama_perf_context_print:        load time =   1234.50 ms\n";
        let perf = parse_perf(old);
        assert_eq!(perf.load_ms, Some(1234.5));
        assert_eq!(perf.prompt_eval_ms, None);
        assert_eq!(parse_perf("no timings here\nx = y\n"), Perf::default());
    }

    #[test]
    fn the_help_says_which_options_are_offered() {
        let offers = offers_in(
            "--warmup, --no-warmup    whether to perform warmup with an empty run\n\
             --no-display-prompt      don't print prompt at generation",
        );
        assert_eq!(
            offers,
            Offers {
                no_warmup: true,
                no_display_prompt: true
            }
        );
        assert_eq!(offers_in("-n, --n-predict N"), Offers::default());
    }

    #[test]
    fn arguments_ask_for_one_greedy_token_on_the_chosen_device() {
        let all = Offers {
            no_warmup: true,
            no_display_prompt: true,
        };
        let args = arguments(Path::new("m.gguf"), Path::new("p.txt"), true, 2064, all);
        let args: Vec<_> = args.iter().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(
            args,
            [
                "-m",
                "m.gguf",
                "-f",
                "p.txt",
                "-n",
                "1",
                "-ngl",
                "99",
                "-no-cnv",
                "--temp",
                "0",
                "-c",
                "2064",
                "--no-warmup",
                "--no-display-prompt"
            ]
        );
        let cpu = arguments(
            Path::new("m.gguf"),
            Path::new("p.txt"),
            false,
            24,
            Offers::default(),
        );
        assert_eq!(cpu[7], "0");
        assert_eq!(cpu.last().unwrap(), "24");
    }
}
