//! `rocmforge chat`: a conversation with a model, through its chat template, streamed.
//!
//! One KV cache lives as long as the conversation. Each turn renders the whole
//! conversation with the template and tokenizes it; when the tokens the cache holds are a
//! prefix of that (the usual case: the last answer's text tokenizes to the tokens that
//! were generated), only the rest is processed: the end of the last answer's turn and
//! the new message. Otherwise (the system message changed, a conversation was loaded, an
//! answer's text tokenizes differently) the cache is emptied and the whole conversation
//! is processed again: the cache only grows or empties.
//!
//! Messages come from stdin: a line each, or several lines as one (a line ending in `\`
//! goes on, or a block between two `"""` lines). Lines starting with `/` are commands
//! (`/help` lists them). On a terminal the prompt and notes go to stderr; stdout carries
//! only the answers, each ended by a newline, so piped use reads like `generate`'s.

use std::io::{BufRead, IsTerminal, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;

use crate::on_gpu;
use anyhow::{bail, Context, Result};
use model::chat::{ChatMessage, ChatTemplate};
use model::generate::{generate_with, GenerateOptions, Generation, Next, Session, StopReason};
use model::gpu::GpuEngine;
use model::tokenizer::{TokenId, Tokenizer};
use model::{AttentionMethod, KvCache, Model, ModelError};

use crate::device_choice::{Chosen, GpuStart};
use crate::generate::{chat_template, context_size, prompt_tokens, random_seed};
use crate::interrupt::{ChatInterrupt, PROMPT};
use crate::options;

#[derive(clap::Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: options::ModelArgs,
    /// A system message opening the conversation (`/system TEXT` changes it).
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,
    /// Most tokens of one answer; -1: until the model ends its turn or the context is full.
    #[arg(long, short = 'n', default_value = "-1", value_parser = options::parse_max_tokens,
          allow_negative_numbers = true)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: options::SamplingArgs,
    /// Most positions of the whole conversation; 0 means the model's training context.
    #[arg(long, short = 'c', default_value_t = crate::generate::DEFAULT_CTX_SIZE)]
    ctx_size: usize,
    #[command(flatten)]
    gpu: options::DeviceArgs,
    /// On the CPU, flash attention (on; auto is on) or two matrix products around a
    /// softmax (off), each as llama.cpp computes it.
    #[arg(long, visible_alias = "fa", value_enum, default_value = "auto")]
    flash_attn: options::FlashAttn,
    #[command(flatten)]
    cache_types: options::CacheTypeArgs,
    /// Show a long turn's progress (and the default model's download) on stderr even
    /// when it is not a terminal.
    #[arg(long)]
    pub progress: bool,
    #[command(flatten)]
    tuning: options::TuningArgs,
}

const HELP: &str = "\
commands:
  /clear          forget the conversation (the system message stays)
  /system TEXT    set the system message; /system alone removes it
  /save FILE      write the conversation to FILE (JSON: {\"messages\": [...]})
  /load FILE      continue a conversation saved with /save
  /exit           quit (also Ctrl-D)
a line ending in \\ goes on on the next line; a block between two \"\"\" lines is one
message; //text sends /text. Ctrl-C stops an answer.";

pub fn run(args: &ChatArgs) -> Result<ExitCode> {
    let interactive = std::io::stdin().is_terminal();
    let seed = args.sampling.seed.unwrap_or_else(random_seed);
    // Bad values are refused before the model loads.
    args.sampling.params(seed).validate()?;
    let tuning = args.tuning.apply();
    options::worker_threads(args.model.threads)?;
    let interrupt = ChatInterrupt::install(interactive)?;
    let placement = args.gpu.placement.placement()?;
    let gpu_start = GpuStart::begin(args.gpu.device, args.gpu.placement.first_device());

    let (path, store) = args.model.open(args.progress)?;
    let tokenizer = Tokenizer::from_metadata(store.metadata())
        .with_context(|| format!("{}: tokenizer", path.display()))?;
    let model = Model::load(&store).with_context(|| format!("{}", path.display()))?;
    let template = chat_template(&store, &path)?;
    let context_size = context_size(args.ctx_size, model.config().n_ctx_train);
    let (chosen, placement) = on_gpu::choose(
        gpu_start.finish()?,
        &model,
        args.gpu.device,
        &args.gpu.placement,
        placement,
        args.gpu.gpu_budget_mib,
        args.cache_types.types(),
    );
    let attention = args.flash_attn.method();
    let (backend, device) = match chosen {
        Chosen::Gpu { device, .. } => {
            tracing::info!(gpu = device.name(), "device: gpu");
            let gpu_options = args.gpu.gpu_options(
                &device,
                context_size,
                args.cache_types.types(),
                &interrupt.stop,
                tuning.gpu,
            );
            let gpu = on_gpu::engine(&model, &gpu_options, &placement, args.gpu.batch_size)
                .with_context(|| format!("{} ({})", path.display(), device.name()))?;
            (
                Backend::Gpu(Box::new(gpu)),
                format!("GPU {}", device.name()),
            )
        }
        Chosen::Cpu { reason } => {
            tracing::info!(reason = %reason, "device: cpu");
            hip_backend::release_prepared_rings();
            let cache = model
                .new_cache(context_size)
                .with_attention(attention)
                .with_context(context_size)
                .with_types(model.config(), args.cache_types.types())
                .with_context(|| format!("{}", path.display()))?;
            let cpu = CpuChat {
                model: &model,
                cache,
                logits: Vec::new(),
            };
            (Backend::Cpu(cpu), "CPU".to_owned())
        }
    };
    let mut chat = Chat {
        backend,
        tokenizer: &tokenizer,
        template,
        context_size,
        system: args.system.clone(),
        turns: Vec::new(),
        cached: Vec::new(),
        sampling: args.sampling.clone(),
        seed,
        turn: 0,
        max_tokens: args.max_tokens,
        attention,
        kv_types: args.cache_types.types(),
    };
    if interactive {
        eprintln!(
            "chatting with {} on the {device}, {context_size} tokens of context. /help lists \
             the commands; Ctrl-C stops an answer, Ctrl-D quits.",
            path.file_name().unwrap_or_default().to_string_lossy()
        );
    }

    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut failed = false;
    loop {
        interrupt.at_prompt();
        let Some(message) = read_message(&mut input, interactive)? else {
            break;
        };
        interrupt.input_read();
        let result = match parse_command(&message) {
            Some(Command::Exit) => break,
            Some(command) => chat.command(command),
            None => {
                interrupt.answering();
                let answered = chat.answer(message_text(&message), &interrupt.stop);
                interrupt.at_prompt();
                answered.map(|output| chat.report(&output))
            }
        };
        if let Err(error) = result {
            if is_broken_pipe(&error) {
                return Ok(ExitCode::SUCCESS);
            }
            eprintln!("error: {error:#}");
            failed = true;
        }
    }
    if interactive {
        eprintln!();
    }
    // Piped, a turn that failed fails the run; at a terminal the user saw it.
    Ok(if failed && !interactive {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// The CPU's side of the conversation: the model and its cache of every position so far.
struct CpuChat<'m> {
    model: &'m Model,
    cache: KvCache,
    logits: Vec<f32>,
}

impl Session for CpuChat<'_> {
    fn eval(&mut self, tokens: &[TokenId], _greedy: bool) -> Result<Next<'_>, ModelError> {
        self.logits = self.model.forward(tokens, &mut self.cache)?;
        Ok(Next::Logits(&self.logits))
    }

    fn shift(&mut self, keep: usize, discard: usize, _kept: &[TokenId]) -> Result<(), ModelError> {
        self.model.shift_cache(&mut self.cache, keep, discard)
    }
}

/// The KV cache of the conversation, on the device that computes.
enum Backend<'m> {
    Cpu(CpuChat<'m>),
    Gpu(Box<GpuEngine>),
}

impl Backend<'_> {
    fn session(&mut self) -> &mut dyn Session {
        match self {
            Backend::Cpu(cpu) => cpu,
            Backend::Gpu(gpu) => gpu.as_mut(),
        }
    }

    /// Positions in the cache.
    fn len(&self) -> usize {
        match self {
            Backend::Cpu(cpu) => cpu.cache.len(),
            Backend::Gpu(gpu) => gpu.len(),
        }
    }

    fn clear(&mut self) -> Result<()> {
        match self {
            Backend::Cpu(cpu) => cpu.cache.clear(),
            Backend::Gpu(gpu) => gpu.clear()?,
        }
        Ok(())
    }
}

struct Chat<'a> {
    backend: Backend<'a>,
    tokenizer: &'a Tokenizer,
    template: ChatTemplate,
    context_size: usize,
    system: Option<String>,
    /// The user's messages and the answers, in turn.
    turns: Vec<ChatMessage>,
    /// The tokens whose keys and values the cache holds, in order.
    cached: Vec<TokenId>,
    sampling: options::SamplingArgs,
    seed: u64,
    /// Answers given so far: each samples with its own seed (`seed + turn`), so the first
    /// answer is `generate --chat`'s with the same seed.
    turn: u64,
    max_tokens: usize,
    attention: AttentionMethod,
    kv_types: model::KvTypes,
}

impl Chat<'_> {
    fn messages(&self) -> Vec<ChatMessage> {
        self.system
            .iter()
            .map(|s| ChatMessage::new("system", s.as_str()))
            .chain(self.turns.iter().cloned())
            .collect()
    }

    /// Answers `text`, streaming the answer to stdout. A turn that cannot be answered
    /// leaves the conversation as it was.
    fn answer(&mut self, text: &str, stop: &AtomicBool) -> Result<Generation> {
        self.turns.push(ChatMessage::user(text));
        let answered = self.answer_last(stop);
        if answered.is_err() {
            self.turns.pop();
        }
        answered
    }

    fn answer_last(&mut self, stop: &AtomicBool) -> Result<Generation> {
        let rendered = self
            .template
            .prompt(&self.messages(), self.tokenizer.adds_bos())?;
        let tokens = prompt_tokens(self.tokenizer, &rendered)?;
        if tokens.len() >= self.context_size {
            bail!(
                "the conversation takes {} tokens and the context holds {}: /clear starts \
                 afresh (or start with a larger --ctx-size)",
                tokens.len(),
                self.context_size
            );
        }
        let common = self
            .cached
            .iter()
            .zip(&tokens)
            .take_while(|(a, b)| a == b)
            .count();
        let reused = if common == self.cached.len() && common < tokens.len() {
            common
        } else {
            // What the cache holds is not a prefix of this rendering: it cannot be cut
            // back to the common part, so it is emptied and everything is processed again.
            tracing::info!(
                cached = self.cached.len(),
                common,
                "the conversation is processed again"
            );
            self.backend.clear()?;
            self.cached.clear();
            0
        };
        let new = &tokens[reused..];
        tracing::info!(reused, new = new.len(), context = self.context_size, "turn");
        let seed = self.seed.wrapping_add(self.turn);
        self.turn += 1;
        let options = GenerateOptions {
            sampling: self.sampling.params(seed).validate()?,
            max_tokens: self.max_tokens,
            // What is left of the context after the positions kept from earlier turns.
            context_size: self.context_size - reused,
            attention: self.attention,
            kv_types: self.kv_types,
            context_shift: None,
        };
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        let mut write_error = None;
        let on_text = |piece: &str| match out.write_all(piece.as_bytes()).and_then(|()| out.flush())
        {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                write_error = Some(e);
                ControlFlow::Break(())
            }
        };
        // The repetition penalty sees this turn's new tokens and the answer (the prompt,
        // for the first turn, as in `generate`).
        let output = generate_with(
            self.backend.session(),
            self.tokenizer,
            new,
            &options,
            stop,
            on_text,
        )?;
        // The cache now holds the new tokens and the answer's tokens fed back: all but
        // the last one sampled (never the end-of-generation token), fewer if a pass was
        // stopped. What it holds is a prefix of these.
        self.cached.extend_from_slice(new);
        self.cached.extend_from_slice(&output.tokens);
        let held = self.backend.len();
        if held <= self.cached.len() {
            self.cached.truncate(held);
        } else {
            self.backend.clear()?;
            self.cached.clear();
        }
        self.turns
            .push(ChatMessage::new("assistant", output.text.as_str()));
        if let Some(e) = write_error {
            return Err(e).context("writing to stdout");
        }
        writeln!(out).context("writing to stdout")?;
        out.flush().context("writing to stdout")?;
        Ok(output)
    }

    /// Notes on stderr after an answer: why it stopped early, and the context's use when
    /// it nears full.
    fn report(&self, output: &Generation) {
        let used = self.backend.len() + 1;
        match output.stop_reason {
            StopReason::Interrupted => eprintln!("[answer stopped]"),
            StopReason::MaxTokens => eprintln!(
                "[answer cut at {} tokens (--max-tokens)]",
                output.tokens.len()
            ),
            StopReason::ContextFull => eprintln!(
                "[the context is full ({} tokens): /clear starts afresh]",
                self.context_size
            ),
            _ if used * 5 >= self.context_size * 4 => eprintln!(
                "[context: {used} of {} tokens used ({:.0}%)]",
                self.context_size,
                100.0 * used as f64 / self.context_size as f64
            ),
            _ => {}
        }
    }

    fn command(&mut self, command: Command) -> Result<()> {
        match command {
            Command::Exit => {}
            Command::Help => eprintln!("{HELP}"),
            Command::Unknown(name) => bail!("unknown command {name}: /help lists them"),
            Command::Clear => {
                self.turns.clear();
                self.cached.clear();
                self.backend.clear()?;
                eprintln!("(conversation cleared)");
            }
            Command::System(text) => {
                eprintln!(
                    "{}",
                    if text.is_some() {
                        "(system message set)"
                    } else {
                        "(system message removed)"
                    }
                );
                self.system = text;
            }
            Command::Save(path) => {
                let messages: Vec<serde_json::Value> = self
                    .messages()
                    .iter()
                    .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
                    .collect();
                let text = serde_json::to_string_pretty(&serde_json::json!({
                    "messages": messages
                }))?;
                std::fs::write(&path, text + "\n")
                    .with_context(|| format!("writing the conversation to {}", path.display()))?;
                eprintln!("(saved {} messages to {})", messages.len(), path.display());
            }
            Command::Load(path) => {
                let messages = load_conversation(&path)?;
                let count = messages.len();
                let mut messages = messages.into_iter().peekable();
                self.system = messages.next_if(|m| m.role == "system").map(|m| m.content);
                self.turns = messages.collect();
                eprintln!("(loaded {count} messages from {})", path.display());
            }
        }
        Ok(())
    }
}

/// The messages of a conversation written by `/save` (or a bare array of them).
fn load_conversation(path: &Path) -> Result<Vec<ChatMessage>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading a conversation from {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let list = value
        .get("messages")
        .unwrap_or(&value)
        .as_array()
        .with_context(|| format!("{}: no \"messages\" array", path.display()))?;
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let field = |name: &str| {
                m.get(name).and_then(|v| v.as_str()).with_context(|| {
                    format!("{}: message {i} has no {name:?} string", path.display())
                })
            };
            Ok(ChatMessage::new(field("role")?, field("content")?))
        })
        .collect()
}

#[derive(Debug, PartialEq, Eq)]
enum Command {
    Exit,
    Help,
    Clear,
    System(Option<String>),
    Save(PathBuf),
    Load(PathBuf),
    Unknown(String),
}

/// The command a message is, or `None` for a message to answer.
fn parse_command(message: &str) -> Option<Command> {
    let text = message.trim();
    if !text.starts_with('/') || text.starts_with("//") {
        return None;
    }
    let (name, rest) = text
        .split_once(char::is_whitespace)
        .map_or((text, ""), |(name, rest)| (name, rest.trim()));
    Some(match name {
        "/exit" | "/quit" | "/bye" => Command::Exit,
        "/help" | "/?" => Command::Help,
        "/clear" => Command::Clear,
        "/system" => Command::System((!rest.is_empty()).then(|| rest.to_owned())),
        "/save" if !rest.is_empty() => Command::Save(PathBuf::from(rest)),
        "/load" if !rest.is_empty() => Command::Load(PathBuf::from(rest)),
        other => Command::Unknown(other.to_owned()),
    })
}

/// The text of a message that is not a command: `//text` is `/text`.
fn message_text(message: &str) -> &str {
    match message.trim_start().strip_prefix('/') {
        Some(rest) if rest.starts_with('/') => rest,
        _ => message,
    }
}

/// The next message: a line, lines joined by a trailing `\`, or a `"""` block. `None` at
/// the end of the input (Ctrl-D) with nothing typed.
fn read_message(input: &mut impl BufRead, interactive: bool) -> std::io::Result<Option<String>> {
    let mut message = String::new();
    let mut block = false;
    let mut continued = false;
    loop {
        if interactive {
            eprint!("{}", if block || continued { "… " } else { PROMPT });
            std::io::stderr().flush()?;
        }
        let mut line = String::new();
        if input.read_line(&mut line)? == 0 {
            // An unfinished message is still sent; nothing at all ends the chat.
            if interactive && message.is_empty() {
                eprintln!();
            }
            let message = message.trim_end_matches('\n').to_owned();
            return Ok((!message.trim().is_empty()).then_some(message));
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if block {
            if line.trim() == "\"\"\"" {
                return Ok(Some(message.trim_end_matches('\n').to_owned()));
            }
            message.push_str(line);
            message.push('\n');
            continue;
        }
        if message.is_empty() && line.trim() == "\"\"\"" {
            block = true;
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            message.push_str(head);
            message.push('\n');
            continued = true;
            continue;
        }
        message.push_str(line);
        if message.trim().is_empty() {
            message.clear();
            continued = false;
            continue;
        }
        return Ok(Some(message));
    }
}

/// Output cut short by the reader is not an error.
fn is_broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(input: &str) -> Vec<String> {
        let mut input = input.as_bytes();
        std::iter::from_fn(|| read_message(&mut input, false).unwrap()).collect()
    }

    #[test]
    fn messages_are_lines_continued_lines_or_blocks() {
        assert_eq!(messages("hello\n\nworld\n"), ["hello", "world"]);
        assert_eq!(messages("one \\\ntwo\nthree"), ["one \ntwo", "three"]);
        assert_eq!(
            messages("\"\"\"\nfirst\n\nsecond\n\"\"\"\nafter\n"),
            ["first\n\nsecond", "after"]
        );
        assert!(messages("\n \n").is_empty());
    }

    #[test]
    fn commands_are_read() {
        assert_eq!(parse_command("/exit"), Some(Command::Exit));
        assert_eq!(parse_command(" /clear "), Some(Command::Clear));
        assert_eq!(
            parse_command("/system Be brief."),
            Some(Command::System(Some("Be brief.".to_owned())))
        );
        assert_eq!(parse_command("/system"), Some(Command::System(None)));
        assert_eq!(
            parse_command("/save a b.json"),
            Some(Command::Save(PathBuf::from("a b.json")))
        );
        assert_eq!(
            parse_command("/save"),
            Some(Command::Unknown("/save".to_owned()))
        );
        assert_eq!(parse_command("hello /exit"), None);
        assert_eq!(parse_command("//x"), None);
        assert_eq!(message_text(" //etc/hosts"), "/etc/hosts");
        assert_eq!(message_text("a /b"), "a /b");
    }
}
