//! `cargo xtask bench-ttft`: time to the first token as a user sees it, from spawning
//! the process to the first token on its standard output, ROCmForge beside llama.cpp's
//! `llama-completion`, on prompts of exact token counts; and to the process's exit.
//!
//! ```text
//! cargo xtask bench-ttft --gguf FILE [--rocmforge PATH] [--llama-completion PATH]
//!     [--prompt-tokens 8,2048] [--runs N] [--cold] [--load-modes background,eager]
//!     [--device gpu|cpu] [--json FILE]
//! ```
//!
//! Both engines read the same prompt file, made of one word repeated until the model's
//! tokenizer gives exactly N tokens (BOS included where the model adds it), and choose
//! one token greedily. The first token is seen when the first byte of standard output
//! arrives: ours prints its JSON, token included, once the token is chosen, and
//! llama.cpp prints the token alone where it offers `--no-display-prompt` (else its
//! first output is the prompt's echo, and only its exit is measured). The exit comes
//! later, after each engine has given its memory and the GPU runtime back. Ours runs
//! `rocmforge generate --json` once per upload mode and reports, besides those times,
//! the moments its JSON gives from the process's start (runtime ready, header parsed,
//! plan built, prompt started, its weights in hand, weights uploaded, first token);
//! llama.cpp's rows add the load and prompt times it prints about itself.
//!
//! Warm rows run with the file in the page cache (read once first, and each engine run
//! once untimed). `--cold` adds rows with the page cache dropped (`sync`, then 3 into
//! `/proc/sys/vm/drop_caches`, which needs root) before every run, and the time to read
//! the whole file sequentially in 16 MiB pieces from a cold cache: the floor a cold
//! start cannot beat. Where the cache cannot be dropped, it says so and leaves the cold
//! rows out. The targets, on the times to the first token: warm, ours within 0.5x
//! llama.cpp's; cold, within 1.05x the file's read time. And the overlap of the upload
//! with the prompt: in the background mode, the first token no later than
//! max(upload, prefill) + min(upload, prefill) / 4 after the runtime is ready, the two
//! phases taken from the eager mode's run on the same prompt and cache. The upload's
//! pace varies from run to run by more than a short prompt's prefill, so the same bound
//! is also taken within each background run, with that run's own upload (until its
//! first pass had the weights it waits for) and the eager prefill: the median of the
//! runs' first tokens less their bounds.
//!
//! Without a usable device, `rocmforge generate --device gpu` fails: that is one line
//! and a non-zero exit.

mod llama;
mod prompt;
mod report;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use crate::bench_load::measure;
use report::{Row, Run};

const USAGE: &str = "usage: cargo xtask bench-ttft --gguf FILE [--rocmforge PATH] \
    [--llama-completion PATH] [--prompt-tokens 8,2048] [--runs N] [--cold] \
    [--load-modes background,eager] [--device gpu|cpu] [--json FILE]";

/// Ours: the moments of `generate --json`'s timings shown, with their labels, in the
/// order they happen.
const OUR_PARTS: [(&str, &str); 7] = [
    ("context_ms", "runtime"),
    ("parsed_ms", "parse"),
    ("planned_ms", "plan"),
    ("prompt_start_ms", "prefill"),
    ("weights_ms", "weights"),
    ("upload_ms", "upload"),
    ("first_token_ms", "first token"),
];

/// The file is read in pieces of this size for its read time.
const READ_CHUNK: usize = 16 << 20;

#[derive(Debug, PartialEq)]
struct Options {
    gguf: PathBuf,
    rocmforge: Option<PathBuf>,
    llama_completion: Option<PathBuf>,
    prompt_tokens: Vec<usize>,
    runs: usize,
    cold: bool,
    load_modes: Vec<String>,
    gpu: bool,
    json: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        gguf: PathBuf::new(),
        rocmforge: None,
        llama_completion: None,
        prompt_tokens: vec![8, 2048],
        runs: 3,
        cold: false,
        load_modes: vec!["background".into(), "eager".into()],
        gpu: true,
        json: None,
    };
    let mut gguf = None;
    crate::each_flag(args, USAGE, |arg, value| {
        match arg {
            "--gguf" => gguf = Some(PathBuf::from(value()?)),
            "--rocmforge" => o.rocmforge = Some(value()?.into()),
            "--llama-completion" => o.llama_completion = Some(value()?.into()),
            "--prompt-tokens" => {
                o.prompt_tokens = value()?
                    .split(',')
                    .map(|n| n.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .context("--prompt-tokens takes a list of counts, as 8,2048")?;
            }
            "--runs" => o.runs = value()?.parse().context("--runs takes a number")?,
            "--cold" => o.cold = true,
            "--load-modes" => {
                o.load_modes = value()?.split(',').map(|m| m.trim().to_owned()).collect();
            }
            "--device" => {
                o.gpu = match value()?.as_str() {
                    "gpu" => true,
                    "cpu" => false,
                    other => bail!("--device {other:?}: expected gpu or cpu"),
                };
            }
            "--json" => o.json = Some(value()?.into()),
            other => bail!("bench-ttft: unknown option {other:?}\n{USAGE}"),
        }
        Ok(())
    })?;
    o.gguf = gguf.with_context(|| format!("--gguf is required\n{USAGE}"))?;
    ensure!(o.runs > 0, "--runs must be positive");
    ensure!(
        !o.prompt_tokens.is_empty() && !o.prompt_tokens.contains(&0),
        "--prompt-tokens must be positive counts"
    );
    for mode in &o.load_modes {
        ensure!(
            ["eager", "background", "lazy"].contains(&mode.as_str()),
            "--load-modes: {mode:?} is not eager, background or lazy"
        );
    }
    Ok(o)
}

/// What one row measures.
#[derive(Clone, Debug, PartialEq)]
enum Engine {
    /// `rocmforge generate`, with an upload mode on a GPU.
    Ours {
        load_mode: Option<String>,
    },
    Llama,
    /// Reading the whole file (cold rows only).
    FileRead,
}

impl Engine {
    fn label(&self) -> String {
        match self {
            Engine::Ours { load_mode: Some(m) } => format!("rocmforge {m}"),
            Engine::Ours { load_mode: None } => "rocmforge cpu".into(),
            Engine::Llama => "llama.cpp".into(),
            Engine::FileRead => "file read".into(),
        }
    }
}

/// What every run needs.
struct Setup<'a> {
    o: &'a Options,
    rocmforge: PathBuf,
    /// llama-completion and the options it offers.
    llama: Option<(PathBuf, llama::Offers)>,
    /// The prompt file of each count in `--prompt-tokens`.
    prompts: Vec<(usize, PathBuf)>,
}

pub fn run(args: &[String]) -> Result<()> {
    let o = parse(args)?;
    let file_bytes = std::fs::metadata(&o.gguf)
        .with_context(|| format!("reading {}", o.gguf.display()))?
        .len();
    let rocmforge = rocmforge_binary(o.rocmforge.as_deref())?;
    let llama = match &o.llama_completion {
        Some(path) => Some((path.clone(), llama::offers(path)?)),
        None => None,
    };
    let dir = PromptDir::new()?;
    let prompts = write_prompts(&o.gguf, &o.prompt_tokens, &dir.0)?;
    let setup = Setup {
        o: &o,
        rocmforge,
        llama,
        prompts,
    };
    let cold_skipped = if o.cold {
        drop_page_cache().err().map(|e| {
            let reason = format!("{e:#}");
            println!("cold rows skipped: cannot drop the page cache ({reason})");
            reason
        })
    } else {
        None
    };
    let mut engines: Vec<Engine> = if o.gpu {
        o.load_modes
            .iter()
            .map(|m| Engine::Ours {
                load_mode: Some(m.clone()),
            })
            .collect()
    } else {
        vec![Engine::Ours { load_mode: None }]
    };
    if setup.llama.is_some() {
        engines.push(Engine::Llama);
    }

    // Warm: the file in the page cache, each engine run once untimed (for ours, the
    // check that the device works).
    measure::file_read_bandwidth(&o.gguf, 1, READ_CHUNK, false, u64::MAX)?;
    for engine in &engines {
        measure_engine(&setup, engine, &setup.prompts[0])?;
    }
    let mut rows = measure_rows(&setup, &engines, "warm")?;
    if o.cold && cold_skipped.is_none() {
        engines.insert(0, Engine::FileRead);
        rows.extend(measure_rows(&setup, &engines, "cold")?);
    }
    let header = report::Header {
        file: &o.gguf,
        file_bytes,
        device: if o.gpu { "gpu" } else { "cpu" },
        runs: o.runs,
        commands: engines
            .iter()
            .filter_map(|e| engine_command(&setup, e, &setup.prompts[0]))
            .map(|c| command_line(&c))
            .collect(),
        cold_skipped: cold_skipped.as_deref(),
    };
    report::print(&header, &rows);
    if let Some(path) = &o.json {
        let doc = report::to_json(&header, &rows);
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Every engine's runs on every prompt, the engines taking turns so that a drift of the
/// machine spreads over all of them, and each round starting with the next engine (a
/// run can leave the machine faster or slower for the one after it: a virtual disk's
/// host caches, say); "cold" drops the page cache before each run.
fn measure_rows(setup: &Setup, engines: &[Engine], cache: &'static str) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for prompt in &setup.prompts {
        let mut these: Vec<Row> = engines
            .iter()
            .map(|e| Row::new(cache, prompt.0, e))
            .collect();
        let count = these.len();
        for round in 0..setup.o.runs {
            for turn in 0..count {
                let row = &mut these[(round + turn) % count];
                if cache == "cold" {
                    drop_page_cache()?;
                }
                let run = measure_engine(setup, &row.engine, prompt)?;
                let token = run.token_s.map_or("-".into(), |s| format!("{s:.3} s"));
                eprintln!(
                    "{cache} {:>5} tokens  {:<22} token {token}, exit {:.3} s",
                    prompt.0,
                    row.engine.label(),
                    run.wall_s
                );
                row.runs.push(run);
            }
        }
        rows.extend(these);
    }
    Ok(rows)
}

/// `--rocmforge`, else the binary beside this one, else the release build's.
fn rocmforge_binary(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = given {
        return Ok(path.to_owned());
    }
    let beside = std::env::current_exe()
        .ok()
        .map(|exe| exe.with_file_name("rocmforge"));
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
        PathBuf::from,
    );
    beside
        .into_iter()
        .chain([target.join("release/rocmforge")])
        .find(|path| path.is_file())
        .context(
            "no rocmforge binary beside xtask or in target/release: build it \
             (cargo build --release -p rocmforge) or pass --rocmforge PATH",
        )
}

/// A temporary folder for the prompt files, removed when dropped.
struct PromptDir(PathBuf);

impl PromptDir {
    fn new() -> Result<PromptDir> {
        let dir = std::env::temp_dir().join(format!("rocmforge-bench-ttft-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(PromptDir(dir))
    }
}

impl Drop for PromptDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One prompt file per token count, made with the model's own tokenizer. The model is
/// closed again before anything is timed, so that no mapping of it stays open.
fn write_prompts(gguf: &Path, counts: &[usize], dir: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let store = tensor_store::TensorStore::open(gguf)
        .with_context(|| format!("opening {}", gguf.display()))?;
    let tokenizer = model::tokenizer::Tokenizer::from_metadata(store.metadata())
        .with_context(|| format!("{}: tokenizer", gguf.display()))?;
    counts
        .iter()
        .map(|&tokens| {
            let text = prompt::exact_prompt(&tokenizer, tokens)?;
            let path = dir.join(format!("prompt-{tokens}.txt"));
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            Ok((tokens, path))
        })
        .collect()
}

/// `sync`, then every clean page of the machine out of the page cache.
fn drop_page_cache() -> Result<()> {
    // SAFETY: `sync` takes no arguments and only flushes dirty pages; it cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .context("writing 3 to /proc/sys/vm/drop_caches, which needs root")
}

/// The process that runs `engine` on the prompt of `tokens` tokens in `file` (none for
/// the file read).
fn engine_command(
    setup: &Setup,
    engine: &Engine,
    (tokens, file): &(usize, PathBuf),
) -> Option<Command> {
    let o = setup.o;
    // Room for the prompt and the token chosen (llama.cpp wants a few positions spare).
    let ctx_size = tokens + 16;
    match engine {
        Engine::FileRead => None,
        Engine::Ours { load_mode } => {
            let mut command = Command::new(&setup.rocmforge);
            command
                .arg("generate")
                .arg("--gguf")
                .arg(&o.gguf)
                .arg("--file")
                .arg(file);
            command.args(["--max-tokens", "1", "--temperature", "0", "--json"]);
            command.args(["--ctx-size", &ctx_size.to_string()]);
            command.args(["--device", device_name(o.gpu)]);
            if let Some(mode) = load_mode {
                command.args(["--load-mode", mode]);
            }
            Some(command)
        }
        Engine::Llama => {
            let (binary, offers) = setup.llama.as_ref()?;
            let mut command = Command::new(binary);
            command.args(llama::arguments(&o.gguf, file, o.gpu, ctx_size, *offers));
            Some(command)
        }
    }
}

fn device_name(gpu: bool) -> &'static str {
    if gpu {
        "gpu"
    } else {
        "cpu"
    }
}

/// A command as one line, for the report.
fn command_line(command: &Command) -> String {
    std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

/// One run of `engine` on the prompt of `tokens` tokens.
fn measure_engine(setup: &Setup, engine: &Engine, prompt: &(usize, PathBuf)) -> Result<Run> {
    let tokens = prompt.0;
    let command = engine_command(setup, engine, prompt);
    match (engine, command) {
        (Engine::FileRead, _) => {
            let started = Instant::now();
            measure::file_read_bandwidth(&setup.o.gguf, 1, READ_CHUNK, false, u64::MAX)?;
            let seconds = started.elapsed().as_secs_f64();
            Ok(Run::new(seconds, Some(seconds)))
        }
        (Engine::Ours { .. }, Some(mut command)) => {
            let device = device_name(setup.o.gpu);
            let timed = spawn_timed(&mut command)
                .with_context(|| format!("`rocmforge generate --device {device}` failed"))?;
            let doc: Value =
                serde_json::from_slice(&timed.stdout).context("rocmforge generate's JSON")?;
            let evaluated = doc["prompt_tokens"].as_array().map_or(0, Vec::len);
            ensure!(
                evaluated == tokens,
                "rocmforge evaluated {evaluated} prompt tokens, not {tokens}"
            );
            let mut run = Run::new(timed.exit_s, timed.output_s);
            for (key, label) in OUR_PARTS {
                if let Some(ms) = doc["timings"][key].as_f64() {
                    run.parts.push((label, ms / 1e3));
                }
            }
            Ok(run)
        }
        (Engine::Llama, Some(mut command)) => {
            let line = command_line(&command);
            let timed = spawn_timed(&mut command).with_context(|| format!("`{line}` failed"))?;
            let perf = llama::parse_perf(&String::from_utf8_lossy(&timed.stderr));
            // Its first output is the token only when the prompt is not echoed.
            let echoes = !setup.llama.as_ref().is_some_and(|l| l.1.no_display_prompt);
            let mut run = Run::new(timed.exit_s, timed.output_s.filter(|_| !echoes));
            if let Some(n) = perf.prompt_eval_tokens.filter(|&n| n != tokens) {
                run.note = Some(format!(
                    "llama.cpp evaluated {n} prompt tokens, not {tokens}"
                ));
            }
            run.parts.extend(perf.load_ms.map(|ms| ("load", ms / 1e3)));
            run.parts
                .extend(perf.prompt_eval_ms.map(|ms| ("prompt eval", ms / 1e3)));
            Ok(run)
        }
        (_, None) => bail!("no command for {}", engine.label()),
    }
}

/// A process run to its exit.
#[derive(Debug)]
struct Timed {
    /// Seconds from spawn to exit.
    exit_s: f64,
    /// Seconds from spawn to the first byte on its standard output, if any.
    output_s: Option<f64>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

/// Runs `command` to its exit, stdin closed, noting when its first output arrives; an
/// error naming the last line of stderr when it fails.
fn spawn_timed(command: &mut Command) -> Result<Timed> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = command.spawn().context("starting it")?;
    let (Some(mut out), Some(mut err)) = (child.stdout.take(), child.stderr.take()) else {
        bail!("its output is not piped");
    };
    // Stderr drains beside, so that a process writing much of it never blocks.
    let stderr_thread = std::thread::spawn(move || {
        let mut stderr = Vec::new();
        err.read_to_end(&mut stderr).map(|_| stderr)
    });
    let mut stdout = Vec::new();
    let mut output_s = None;
    let mut chunk = [0u8; 8192];
    loop {
        match out.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                output_s.get_or_insert_with(|| started.elapsed().as_secs_f64());
                stdout.extend_from_slice(&chunk[..n]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e).context("reading its standard output");
            }
        }
    }
    let status = child.wait().context("waiting for it")?;
    let exit_s = started.elapsed().as_secs_f64();
    let stderr = stderr_thread
        .join()
        .map_err(|_| anyhow::anyhow!("the thread reading its stderr panicked"))?
        .context("reading its standard error")?;
    if !status.success() {
        let stderr = String::from_utf8_lossy(&stderr);
        let last = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        bail!("{status}: {last}");
    }
    Ok(Timed {
        exit_s,
        output_s,
        stdout,
        stderr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args;

    #[test]
    fn defaults_are_the_issues_benchmark() {
        let o = parse(&args(&["--gguf", "/tmp/7b.gguf"])).unwrap();
        assert_eq!(
            o,
            Options {
                gguf: "/tmp/7b.gguf".into(),
                rocmforge: None,
                llama_completion: None,
                prompt_tokens: vec![8, 2048],
                runs: 3,
                cold: false,
                load_modes: vec!["background".into(), "eager".into()],
                gpu: true,
                json: None,
            }
        );
    }

    #[test]
    fn every_option_is_read() {
        let o = parse(&args(&[
            "--gguf",
            "m.gguf",
            "--rocmforge",
            "bin/rocmforge",
            "--llama-completion",
            "/tmp/llama/llama-completion",
            "--prompt-tokens",
            "16, 512,4096",
            "--runs",
            "5",
            "--cold",
            "--load-modes",
            "lazy",
            "--device",
            "cpu",
            "--json",
            "out.json",
        ]))
        .unwrap();
        assert_eq!(o.rocmforge, Some("bin/rocmforge".into()));
        assert_eq!(
            o.llama_completion,
            Some("/tmp/llama/llama-completion".into())
        );
        assert_eq!(o.prompt_tokens, [16, 512, 4096]);
        assert_eq!((o.runs, o.cold, o.gpu), (5, true, false));
        assert_eq!(o.load_modes, ["lazy"]);
        assert_eq!(o.json, Some("out.json".into()));
    }

    #[test]
    fn bad_arguments_are_refused_naming_them() {
        let error = |list: &[&str]| parse(&args(list)).unwrap_err().to_string();
        assert!(error(&["--runs", "3"]).contains("--gguf is required"));
        assert!(error(&["--gguf", "m", "--prompt-tokens", "8,x"]).contains("--prompt-tokens"));
        assert!(error(&["--gguf", "m", "--prompt-tokens", "0"]).contains("positive"));
        assert!(error(&["--gguf", "m", "--runs", "0"]).contains("--runs"));
        assert!(error(&["--gguf", "m", "--load-modes", "eager,fast"]).contains("\"fast\""));
        assert!(error(&["--gguf", "m", "--device", "tpu"]).contains("gpu or cpu"));
        assert!(error(&["--gguf", "m", "--cold", "--fast"]).contains("unknown option"));
        assert!(error(&["--gguf"]).contains("needs a value"));
    }

    #[test]
    fn a_process_is_timed_to_its_first_output_and_to_its_exit() {
        let timed = spawn_timed(Command::new("sh").args(["-c", "printf token; sleep 1"])).unwrap();
        assert_eq!(timed.stdout, b"token");
        let output_s = timed.output_s.unwrap();
        // The exit comes after the sleep; the output was seen before it (half a second
        // of margin for a busy machine to wake the reader).
        assert!(timed.exit_s >= 1.0, "{}", timed.exit_s);
        assert!(output_s < 0.5, "{output_s} {}", timed.exit_s);

        let silent = spawn_timed(Command::new("sh").args(["-c", "echo oops >&2"])).unwrap();
        assert_eq!(
            (silent.output_s, silent.stderr.as_slice()),
            (None, &b"oops\n"[..])
        );

        let error =
            spawn_timed(Command::new("sh").args(["-c", "echo first >&2; echo why >&2; exit 3"]))
                .unwrap_err()
                .to_string();
        assert!(error.contains("why") && error.contains('3'), "{error}");
    }

    #[test]
    fn rows_are_named_by_engine_and_mode() {
        let ours = Engine::Ours {
            load_mode: Some("background".into()),
        };
        assert_eq!(ours.label(), "rocmforge background");
        assert_eq!(Engine::Ours { load_mode: None }.label(), "rocmforge cpu");
        assert_eq!(Engine::Llama.label(), "llama.cpp");
    }
}
