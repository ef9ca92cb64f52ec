//! `rocmforge tokenize`: the token ids of a text, as llama.cpp gives them.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use model::tokenizer::Tokenizer;
use serde_json::json;
use tensor_store::TensorStore;

use crate::generate::prompt_tokens;
use crate::models::model_path;
use crate::options::prompt_text;

#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// The GGUF model. Default: SmolLM2-135M-Instruct from the models cache.
    #[arg(long, short = 'm', visible_alias = "model", value_name = "FILE")]
    gguf: Option<PathBuf>,
    /// The text. BOS is added where the model's metadata asks for it, and control tokens
    /// written in the text (`<|im_start|>`) are recognised, as for a prompt.
    #[arg(required_unless_present = "file", conflicts_with = "file")]
    text: Option<String>,
    /// Read the text from a file; `-` reads stdin.
    #[arg(long, short = 'f', value_name = "PATH")]
    file: Option<PathBuf>,
    /// Print `{"tokens": [...]}` instead of ids separated by spaces.
    #[arg(long)]
    json: bool,
}

pub fn run(args: &TokenizeArgs) -> Result<()> {
    let text = prompt_text(args.text.as_deref(), args.file.as_deref())?;
    let path = model_path(args.gguf.as_deref(), None)?;
    let store = TensorStore::open(&path)?;
    let tokenizer = Tokenizer::from_metadata(store.metadata())
        .with_context(|| format!("{}: tokenizer", path.display()))?;
    let tokens = prompt_tokens(&tokenizer, &text)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if args.json {
        serde_json::to_writer(&mut out, &json!({ "tokens": tokens }))?;
        writeln!(out)?;
    } else {
        let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
        writeln!(out, "{}", ids.join(" "))?;
    }
    out.flush()?;
    Ok(())
}
