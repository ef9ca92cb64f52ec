//! `rocmforge inspect`: what a GGUF file holds.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use gguf_format::{Array, Metadata, Value};
use serde_json::json;
use tensor_store::{LoadMode, TensorStore};

/// Arrays longer than this are summarized in the text output.
const ARRAY_PREVIEW: usize = 8;
/// Strings longer than this are cut in the text output.
const STRING_PREVIEW: usize = 120;

#[derive(clap::Args)]
pub struct InspectArgs {
    /// The GGUF file (any shard of a split model).
    #[arg(required_unless_present = "gguf", conflicts_with = "gguf")]
    file: Option<PathBuf>,
    /// The GGUF file, given as to the other commands.
    #[arg(long, short = 'm', visible_alias = "model", value_name = "FILE")]
    gguf: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// With --dump-f32: the tensor to dump.
    #[arg(long, requires = "dump_f32")]
    tensor: Option<String>,
    /// Write the tensor's values, dequantized, as little-endian f32 to this file.
    #[arg(long, requires = "tensor")]
    dump_f32: Option<PathBuf>,
    /// Read the file instead of mapping it.
    #[arg(long)]
    no_mmap: bool,
}

pub fn run(args: &InspectArgs) -> Result<()> {
    let mode = if args.no_mmap {
        LoadMode::Read
    } else {
        LoadMode::Mmap
    };
    let file = args
        .file
        .as_deref()
        .or(args.gguf.as_deref())
        .context("no model given: pass FILE or --gguf FILE")?;
    tracing::info!(path = %file.display(), "model file");
    let store = TensorStore::open_with(file, mode)?;
    tracing::info!(tensors = store.len(), "opened");
    if let (Some(name), Some(out)) = (&args.tensor, &args.dump_f32) {
        return dump_f32(&store, name, out);
    }
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    if args.json {
        serde_json::to_writer(&mut out, &to_json(&store))?;
        writeln!(out)?;
    } else {
        print_text(&store, &mut out)?;
    }
    out.flush()?;
    Ok(())
}

fn dump_f32(store: &TensorStore, name: &str, out: &PathBuf) -> Result<()> {
    let tensor = store.tensor(name)?;
    let n = usize::try_from(tensor.info().n_elements())?;
    let bytes = tensor.bytes()?;
    let mut values = vec![0f32; n];
    dequant::decode_f32(tensor.ggml_type(), bytes, &mut values)
        .with_context(|| format!("{}: tensor {name:?}", store.path().display()))?;
    let mut raw = Vec::with_capacity(n * 4);
    for v in &values {
        raw.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(out, raw).with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "wrote {n} f32 values of {name} ({}) to {}",
        tensor.ggml_type(),
        out.display()
    );
    Ok(())
}

/// The hyper-parameters people look for first, from `<arch>.*` keys, as JSON values.
fn hyper_parameters_json(
    metadata: &Metadata,
    arch: &str,
) -> serde_json::Map<String, serde_json::Value> {
    hyper_parameters_as(metadata, arch, value_json, |n| json!(n))
        .into_iter()
        .collect()
}

/// The `<arch>.*` keys shown as hyper-parameters.
const HYPER_PARAMETERS: [&str; 11] = [
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
    "rope.freq_base",
    "rope.dimension_count",
];

/// The hyper-parameters people look for first, from `<arch>.*` keys.
fn hyper_parameters(metadata: &Metadata, arch: &str) -> Vec<(String, String)> {
    hyper_parameters_as(metadata, arch, value_text, |n| n.to_string())
}

/// The hyper-parameters' values that the file has, by `value`, then the vocabulary's
/// size, by `count`.
fn hyper_parameters_as<T>(
    metadata: &Metadata,
    arch: &str,
    value: impl Fn(&Value) -> T,
    count: impl Fn(usize) -> T,
) -> Vec<(String, T)> {
    let mut found: Vec<(String, T)> = HYPER_PARAMETERS
        .iter()
        .filter_map(|k| {
            let full = format!("{arch}.{k}");
            metadata.get(&full).map(|v| (k.to_string(), value(v)))
        })
        .collect();
    if let Ok(tokens) = metadata.get_string_array("tokenizer.ggml.tokens") {
        found.push(("vocab_size".into(), count(tokens.len())));
    }
    found
}

fn print_text(store: &TensorStore, out: &mut impl Write) -> Result<()> {
    let gguf = store.gguf();
    let metadata = store.metadata();
    let arch = metadata.get_str("general.architecture").unwrap_or("(none)");
    writeln!(out, "file:         {}", store.path().display())?;
    writeln!(out, "GGUF version: {}", gguf.version)?;
    writeln!(out, "architecture: {arch}")?;
    if let Ok(name) = metadata.get_str("general.name") {
        writeln!(out, "name:         {name}")?;
    }
    writeln!(
        out,
        "tensors:      {} ({:.1} MiB of data)",
        store.len(),
        store.tensor_bytes() as f64 / (1 << 20) as f64
    )?;
    let params = hyper_parameters(metadata, arch);
    if !params.is_empty() {
        writeln!(out, "\nhyper-parameters:")?;
        for (k, v) in params {
            writeln!(out, "  {k:<34} {v}")?;
        }
    }
    writeln!(out, "\nmetadata ({} keys):", metadata.len())?;
    for (key, value) in metadata.iter() {
        writeln!(out, "  {key:<40} {}", value_text(value))?;
    }
    writeln!(out, "\ntensors:")?;
    writeln!(
        out,
        "  {:<36} {:<8} {:<22} {:>12} {:>12}",
        "name", "type", "shape", "bytes", "offset"
    )?;
    for t in store.tensors() {
        let shape = format!("{:?}", t.shape());
        writeln!(
            out,
            "  {:<36} {:<8} {:<22} {:>12} {:>12}",
            t.name(),
            t.ggml_type().name(),
            shape,
            t.size(),
            t.info().offset
        )?;
    }
    Ok(())
}

fn value_text(value: &Value) -> String {
    match value {
        Value::String(s) => string_preview(s),
        Value::Array(a) => array_text(a),
        Value::Bool(b) => b.to_string(),
        Value::F32(v) => v.to_string(),
        Value::F64(v) => v.to_string(),
        other => other
            .as_integer()
            .map(|i| i.to_string())
            .unwrap_or_default(),
    }
}

fn string_preview(s: &str) -> String {
    let escaped: String = s.escape_debug().collect();
    if escaped.chars().count() <= STRING_PREVIEW {
        return format!("\"{escaped}\"");
    }
    let cut: String = escaped.chars().take(STRING_PREVIEW).collect();
    format!("\"{cut}…\" ({} bytes)", s.len())
}

fn array_text(array: &Array) -> String {
    fn preview<T>(items: &[T], show: impl Fn(&T) -> String) -> String {
        let shown: Vec<String> = items.iter().take(ARRAY_PREVIEW).map(show).collect();
        let more = if items.len() > ARRAY_PREVIEW {
            ", …"
        } else {
            ""
        };
        format!("[{}{more}]", shown.join(", "))
    }
    let body = match array {
        Array::U8(v) => preview(v, |x| x.to_string()),
        Array::I8(v) => preview(v, |x| x.to_string()),
        Array::U16(v) => preview(v, |x| x.to_string()),
        Array::I16(v) => preview(v, |x| x.to_string()),
        Array::U32(v) => preview(v, |x| x.to_string()),
        Array::I32(v) => preview(v, |x| x.to_string()),
        Array::F32(v) => preview(v, |x| x.to_string()),
        Array::Bool(v) => preview(v, |x| x.to_string()),
        Array::String(v) => preview(&v.iter().take(ARRAY_PREVIEW + 1).collect::<Vec<_>>(), |x| {
            string_preview(x)
        }),
        Array::Array(v) => preview(v, array_text),
        Array::U64(v) => preview(v, |x| x.to_string()),
        Array::I64(v) => preview(v, |x| x.to_string()),
        Array::F64(v) => preview(v, |x| x.to_string()),
    };
    format!("{} × {}: {body}", array.len(), array.element_type())
}

fn to_json(store: &TensorStore) -> serde_json::Value {
    let metadata = store.metadata();
    let meta: serde_json::Map<String, serde_json::Value> = metadata
        .iter()
        .map(|(k, v)| (k.to_owned(), value_json(v)))
        .collect();
    let tensors: Vec<serde_json::Value> = store
        .tensors()
        .map(|t| {
            json!({
                "name": t.name(),
                "type": t.ggml_type().name(),
                "shape": t.shape(),
                "offset": t.info().offset,
                "size": t.size(),
            })
        })
        .collect();
    let arch = metadata.get_str("general.architecture").ok();
    json!({
        "file": store.path(),
        "version": store.gguf().version,
        "architecture": arch,
        "name": metadata.get_str("general.name").ok(),
        "hyper_parameters": hyper_parameters_json(metadata, arch.unwrap_or("(none)")),
        "alignment": store.gguf().alignment,
        "data_offset": store.gguf().data_offset,
        "metadata": meta,
        "tensors": tensors,
    })
}

fn value_json(value: &Value) -> serde_json::Value {
    match value {
        Value::String(s) => json!(s),
        Value::Array(a) => array_json(a),
        Value::Bool(b) => json!(b),
        Value::F32(v) => json!(v),
        Value::F64(v) => json!(v),
        other => match other.as_integer() {
            Some(i) if i >= 0 => json!(i as u64),
            Some(i) => json!(i as i64),
            None => serde_json::Value::Null,
        },
    }
}

fn array_json(array: &Array) -> serde_json::Value {
    match array {
        Array::U8(v) => json!(v),
        Array::I8(v) => json!(v),
        Array::U16(v) => json!(v),
        Array::I16(v) => json!(v),
        Array::U32(v) => json!(v),
        Array::I32(v) => json!(v),
        Array::F32(v) => json!(v),
        Array::Bool(v) => json!(v),
        Array::String(v) => json!(v.iter().collect::<Vec<_>>()),
        Array::Array(v) => serde_json::Value::Array(v.iter().map(array_json).collect()),
        Array::U64(v) => json!(v),
        Array::I64(v) => json!(v),
        Array::F64(v) => json!(v),
    }
}
