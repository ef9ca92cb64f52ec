//! Where the real models and llama.cpp's reference outputs are.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use gguf_format::Metadata;

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

#[path = "../../../testdata/models.rs"]
mod models;
pub use models::model_path;

/// Reads just the metadata of a GGUF file: its first bytes, more if they fall short.
pub fn read_metadata(path: &Path) -> Metadata {
    let mut file = File::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let file_len = file.metadata().expect("file size").len();
    let mut prefix = Vec::new();
    let mut want: u64 = 16 << 20;
    loop {
        let more = want.min(file_len) - prefix.len() as u64;
        (&mut file)
            .take(more)
            .read_to_end(&mut prefix)
            .expect("reading the model");
        match gguf_format::parse_prefix(&prefix, file_len) {
            Ok(gguf) => return gguf.metadata,
            Err(gguf_format::GgufError::UnexpectedEof { .. }) if want < file_len => want *= 2,
            Err(e) => panic!("{}: {e}", path.display()),
        }
    }
}

/// llama.cpp's reference outputs for a model, from the repository's `testdata/golden`
/// (compiled into the test binary, so it runs from anywhere).
pub fn golden(file: &str) -> serde_json::Value {
    reference_of(
        file,
        "reference outputs",
        [
            include_str!("../../../testdata/golden/SmolLM2-135M-Instruct.Q4_1.json"),
            include_str!("../../../testdata/golden/gemma-3-270m-q4_k_m.json"),
        ],
    )
}

/// llama.cpp's outputs with flash attention on (its default on a CPU), from the
/// repository's `testdata/golden-fa`: per golden prompt, the tokens, the top-10 logits and
/// log-sum-exp of every prompt position, and 32 greedy tokens with the rows they were
/// taken from.
pub fn golden_flash(file: &str) -> serde_json::Value {
    reference_of(
        file,
        "flash-attention reference outputs",
        [
            include_str!("../../../testdata/golden-fa/SmolLM2-135M-Instruct.Q4_1.json"),
            include_str!("../../../testdata/golden-fa/gemma-3-270m-q4_k_m.json"),
        ],
    )
}

/// The JSON of `file`'s `what`, among those of [`SMOLLM2`] and [`GEMMA3`] in that order.
fn reference_of(file: &str, what: &str, [smollm2, gemma3]: [&str; 2]) -> serde_json::Value {
    let text = match file {
        SMOLLM2 => smollm2,
        GEMMA3 => gemma3,
        other => panic!("no {what} for {other}"),
    };
    serde_json::from_str(text).expect("golden file is JSON")
}

/// A JSON array of integers as token ids.
pub fn ids(value: &serde_json::Value) -> Vec<u32> {
    value
        .as_array()
        .expect("an array of ids")
        .iter()
        .map(|v| v.as_u64().expect("an id") as u32)
        .collect()
}
