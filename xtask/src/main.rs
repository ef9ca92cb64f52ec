//! Developer tasks for ROCmForge, run as `cargo xtask <task>`.
//!
//! - `fetch-models`: obtain the real GGUF models the tests and benchmarks use.
//! - `test`: fetch the models, then run the whole test suite and summarize it.
//! - `testdata`: remake the reference data in `testdata/`.
//!
//! Arguments are parsed by hand to keep this binary's dependencies few.

mod bench_cpu;
mod bench_gpu;
mod bench_kv;
mod bench_load;
mod bench_serve;
mod bench_ttft;
mod fetch;
mod openai_client;
mod synth;
mod test_run;
mod testdata;
#[cfg(test)]
mod tidy;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};

const USAGE: &str = "\
usage: cargo xtask <task> [options]

tasks:
  fetch-models        download the real test models into the models cache
                      ($ROCMFORGE_MODELS, else ~/.cache/rocmforge/models)
  bench-cpu [--llama-bench PATH] [--rocmforge PATH] [--threads N] [--gguf FILE]… [--json]
                      CPU prefill/decode tokens/s and first-token process time,
                      next to llama.cpp's when its llama-bench path is given
  synth-model --preset PRESET --out FILE [--seed N]
                      a synthetic llama GGUF with real shapes and random weights;
                      PRESET: 7b-q4k, 70b-q4k (Llama-2-70B's shapes), 1b-q4k,
                      135m-q4_1, tiny-q4_1, or Llama-2-7B's
                      shapes in a llama-quantize mix: 7b-q2_k, 7b-q3_k_s, 7b-q3_k_m,
                      7b-q3_k_l, 7b-q4_k_s, 7b-iq4_xs, 7b-iq3_m, 7b-iq2_m; or a Qwen 3
                      MoE: qwen3moe-30b-a3b-q4k (Qwen3-30B-A3B's shapes),
                      qwen3moe-30b-a3b-skewed-q4k (the same, its routers favouring
                      some experts as Qwen3-30B-A3B's do), qwen3moe-30b-a3b-mxfp4
                      (the same in llama-quantize's MXFP4_MOE: MXFP4 experts, Q8_0
                      elsewhere), qwen3moe-small-q4k; or gpt-oss-20b-mxfp4
                      (gpt-oss-20b's shapes)
  bench-load --gguf FILE [--device gpu|cpu] [--mode eager|background|lazy|all] [--cold]
             [--json [FILE]]  time to make a model resident on the device, per mode
  bench-gpu --gguf FILE… [--llama-bench PATH] [--tokens N] [--prompt N] [--repeat N] [--json FILE]
            [--parallel 8,32,64 [--npp N] [--ntg N] [--llama-batched-bench PATH]
            [--no-batch-graphs]] [--budgets 25,50,75]
                      GPU decode tokens/s (tg N) and achieved bandwidth, prompt tokens/s,
                      batched decoding, and decoding with the weights' budget at those
                      percentages of the model (llama-bench -ngl at the same share),
                      next to llama.cpp's when its paths are given
  bench-kv --gguf FILE [--llama-bench PATH] [--types f16,q8_0,q4_0] [--depths 0,4096]
           [--tokens N] [--prompt N] [--repeat N] [--json FILE]
                      GPU tg and pp after a context of each depth, for each KV cache
                      type, next to llama-bench -d D -ctk T -ctv T -fa 1
  bench-serve [--clients 1,8,32] [--requests N] [--prompt-tokens 128] [--gen-tokens 128]
              [--threads N] [--gguf FILE] [--rocmforge PATH] [--llama-batched-bench PATH] [--json]
              [--device cpu|gpu] [--devices LIST] [--split-mode MODE] [--python PATH]
              [--constrained json_schema|grammar]
                      rocmforge serve on loopback under a bounded concurrency sweep:
                      time to first token, time per output token, aggregate tokens/s;
                      --constrained: also held to a format, with the mask's cost per token
  bench-ttft --gguf FILE [--llama-completion PATH] [--rocmforge PATH] [--prompt-tokens 8,2048]
             [--runs N] [--cold] [--load-modes background,eager] [--device gpu|cpu] [--json FILE]
                      time to first token as a user sees it: whole `generate -n 1`
                      processes next to llama-completion's, warm and with the page
                      cache dropped (--cold, as root), against the file's read time
  test [ARGS…]        fetch-models, then `cargo test --workspace --release --no-fail-fast
                      [ARGS…]` (the pinned `openai` client installed for the server's
                      tests), and a summary counting failed and skipped tests
  testdata [--vectors] [--golden]
                      remake testdata/ with pinned pip packages (both when neither is
                      given; --golden builds llama.cpp from source, about ten minutes)
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<()> {
    let Some((task, rest)) = args.split_first() else {
        eprint!("{USAGE}");
        bail!("no task given");
    };
    // The benchmarks that compute in this process take the same settings as `rocmforge`.
    tuning().apply_process_wide();
    match task.as_str() {
        "fetch-models" => fetch::fetch_models(&fetch::models_dir()).map(|_| ()),
        "test" => test(rest),
        "testdata" => testdata::run(rest),
        "bench-cpu" => bench_cpu::run(rest),
        "synth-model" => synth::run(rest),
        "bench-load" => bench_load::run(rest),
        "bench-gpu" => bench_gpu::run(rest),
        "bench-kv" => bench_kv::run(rest),
        "bench-serve" => bench_serve::run(rest),
        "bench-ttft" => bench_ttft::run(rest),
        "-h" | "--help" | "help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => {
            eprint!("{USAGE}");
            bail!("unknown task {other:?}")
        }
    }
}

/// The settings the `ROCMFORGE_*` variables of `rocmforge::tuning` give, as `rocmforge`
/// takes them (tasks that run `rocmforge` pass the variables on to it).
pub(crate) fn tuning() -> rocmforge::tuning::Tuning {
    rocmforge::tuning::Tuning::from_vars(|name| std::env::var(name).ok())
}

/// The whole test suite, real models included.
fn test(extra: &[String]) -> Result<()> {
    fetch::fetch_models(&fetch::models_dir())?;
    // The server's tests drive it with the official client.
    let python = openai_client::python()?;
    std::env::set_var("ROCMFORGE_PYTHON", python);
    test_run::run(extra)
}

/// The workspace this xtask was built in; or, for a binary carried to another machine
/// (where that path is absent), the current directory, which must then be a checkout's
/// root.
pub(crate) fn workspace_root() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_owned)
        .unwrap_or_default();
    if built.join("xtask").is_dir() {
        return built;
    }
    std::env::current_dir().unwrap_or(built)
}

/// Hands each flag of `args` in turn to `on_flag`, with a way to take its value: the next
/// argument, or an error naming the flag, then `usage`, when there is none.
fn each_flag<'a>(
    args: &'a [String],
    usage: &str,
    mut on_flag: impl FnMut(&str, &mut dyn FnMut() -> Result<&'a String>) -> Result<()>,
) -> Result<()> {
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .with_context(|| format!("{flag} needs a value\n{usage}"))
        };
        on_flag(flag, &mut value)?;
    }
    Ok(())
}

/// Command-line arguments from string literals, for the tests of the parsers.
#[cfg(test)]
fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}
