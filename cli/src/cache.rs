//! Where the models cache is, and what it holds: each GGUF file's size, architecture and
//! quantization, read from its header, and the downloads not finished yet.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gguf_format::GgufFile;

use crate::pull::gguf_header;

/// The models cache: `$ROCMFORGE_MODELS`, else `~/.cache/rocmforge/models`.
pub fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ROCMFORGE_MODELS") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache/rocmforge/models")
}

/// One file of the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedModel {
    pub path: PathBuf,
    /// Its name in the cache.
    pub name: String,
    /// Bytes on disk.
    pub size: u64,
    /// A download not finished yet (`NAME.part`; `name` is without `.part`).
    pub partial: bool,
    /// `general.architecture`.
    pub architecture: Option<String>,
    /// The quantization: llama.cpp's name for `general.file_type` (`Q4_K_M`), else the
    /// type most of the weights' bytes have.
    pub quant: Option<String>,
    /// Why the header could not be read (a file that is not GGUF, a truncated one).
    pub error: Option<String>,
}

/// The `.gguf` files of `dir` and their partial downloads, by name. A missing `dir` is
/// an empty cache.
pub fn list(dir: &Path) -> std::io::Result<Vec<CachedModel>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut models = Vec::new();
    for entry in entries {
        let entry = entry?;
        let path = entry.path();
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let (name, partial) = match file_name.strip_suffix(".part") {
            Some(name) => (name.to_owned(), true),
            None => (file_name.clone(), false),
        };
        if !name.ends_with(".gguf") || !entry.file_type()?.is_file() {
            continue;
        }
        let size = entry.metadata()?.len();
        let mut model = CachedModel {
            path: path.clone(),
            name,
            size,
            partial,
            architecture: None,
            quant: None,
            error: None,
        };
        if !partial {
            match gguf_header(&path) {
                Ok(header) => {
                    model.architecture = header.architecture().map(str::to_owned);
                    model.quant = quant_name(&header);
                }
                Err(error) => model.error = Some(error.to_string()),
            }
        }
        models.push(model);
    }
    models.sort_by(|a, b| (&a.name, a.partial).cmp(&(&b.name, b.partial)));
    Ok(models)
}

/// llama.cpp's name for the file's `general.file_type` (`LLAMA_FTYPE_MOSTLY_*`), else
/// the type of the most bytes among its tensors.
pub fn quant_name(header: &GgufFile) -> Option<String> {
    let file_type = header
        .metadata
        .get_opt::<u32>("general.file_type")
        .ok()
        .flatten();
    if let Some(name) = file_type.and_then(file_type_name) {
        return Some(name.to_owned());
    }
    let mut bytes: BTreeMap<&'static str, u64> = BTreeMap::new();
    for tensor in &header.tensors {
        *bytes.entry(tensor.ggml_type.name()).or_default() += tensor.size;
    }
    bytes
        .into_iter()
        .max_by_key(|&(_, b)| b)
        .map(|(name, _)| name.to_owned())
}

/// llama.cpp's `llama_ftype` values.
fn file_type_name(file_type: u32) -> Option<&'static str> {
    Some(match file_type {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        38 => "MXFP4_MOE",
        _ => return None,
    })
}
