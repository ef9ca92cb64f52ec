//! `rocmforge`: the command-line front of ROCmForge.
//!
//! A thin layer: it parses arguments, installs the tracing subscriber, and calls the
//! library crates. Every failure ends as one line on stderr and a non-zero exit code.

mod chat;
mod device_choice;
mod devices;
mod generate;
mod inspect;
mod interrupt;
mod load;
mod models;
mod on_gpu;
mod options;
mod perplexity;
mod progress;
mod serve;
mod tokenize;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Instant;

use clap::{Parser, Subcommand};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

#[derive(Parser)]
#[command(
    name = "rocmforge",
    version,
    about = "Run GGUF language models on GPUs and CPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a GGUF file's architecture, hyper-parameters, metadata and tensors.
    Inspect(inspect::InspectArgs),
    /// List the GPUs this build can use, or say why there are none.
    Devices(devices::DevicesArgs),
    /// Continue a prompt with a model, streaming the text as it is produced.
    Generate(generate::GenerateArgs),
    /// Talk with a model through its chat template: one message a line, the answers
    /// streamed, the conversation kept between turns.
    Chat(chat::ChatArgs),
    /// Fetch a model into the models cache (a URL, hf://ORG/REPO/FILE.gguf, or a known
    /// model), resuming an interrupted download and checking it.
    Pull(models::PullArgs),
    /// List the models cache: name, size, architecture and quantization.
    List(models::ListArgs),
    /// Print the token ids of a text.
    Tokenize(tokenize::TokenizeArgs),
    /// Put a model's weights on a GPU and report how long each stage took.
    Load(load::LoadArgs),
    /// Serve a model over an OpenAI-compatible HTTP API, batching concurrent requests.
    Serve(serve::ServeArgs),
    /// A model's perplexity over a text, or its KL divergence from a base model's saved
    /// log-probabilities, as llama.cpp's llama-perplexity computes them.
    Perplexity(perplexity::PerplexityArgs),
}

/// When the process started (as near as `main` can tell): the origin of the times that
/// `generate --json` reports "from process start".
pub fn process_start() -> Instant {
    *PROCESS_START.get_or_init(Instant::now)
}

static PROCESS_START: OnceLock<Instant> = OnceLock::new();

fn main() -> ExitCode {
    process_start();
    let cli = Cli::parse();
    let progress = match &cli.command {
        Command::Generate(args) => progress::Mode::choose(args.progress),
        Command::Chat(args) => progress::Mode::choose(args.progress),
        _ => progress::Mode::Off,
    };
    install_subscriber(progress);
    let result = match cli.command {
        Command::Inspect(args) => inspect::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Devices(args) => devices::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Generate(args) => generate::run(&args),
        Command::Chat(args) => chat::run(&args),
        Command::Pull(args) => models::run_pull(&args).map(|()| ExitCode::SUCCESS),
        Command::List(args) => models::run_list(&args).map(|()| ExitCode::SUCCESS),
        Command::Tokenize(args) => tokenize::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Load(args) => load::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Serve(args) => serve::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Perplexity(args) => perplexity::run(&args),
    };
    match result {
        Ok(code) => code,
        Err(error) if is_broken_pipe(&error) => ExitCode::SUCCESS,
        Err(error) if interrupt::is_interrupted(&error) => {
            eprintln!("interrupted: {}", one_line(&error));
            ExitCode::from(interrupt::EXIT_INTERRUPTED)
        }
        Err(error) => {
            eprintln!("error: {}", one_line(&error));
            ExitCode::FAILURE
        }
    }
}

/// Log lines on stderr as `ROCMFORGE_LOG` asks (default: warnings), coloured only on a
/// terminal; and the prompt's progress.
fn install_subscriber(progress: progress::Mode) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ROCMFORGE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let log = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_filter(filter);
    tracing_subscriber::registry()
        .with(log)
        .with(progress::layer(progress))
        .init();
}

/// The error and its causes on one line, leaving out a cause whose text the message
/// before it already includes (library errors often show their source in their message).
fn one_line(error: &anyhow::Error) -> String {
    let mut line = error.to_string();
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}

/// Output cut short by the reader (`rocmforge inspect … | head`) is not an error.
fn is_broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
