//! The one error type of this crate.

use std::path::PathBuf;

/// What can go wrong opening a model or reading its tensors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Format {
        path: PathBuf,
        #[source]
        source: gguf_format::GgufError,
    },
    #[error("{path}: split model shard {index} of {count} is missing ({missing})")]
    MissingShard {
        path: PathBuf,
        index: u32,
        count: u32,
        missing: PathBuf,
    },
    #[error("{path}: shard says split.{key} = {found}, expected {expected}")]
    ShardMismatch {
        path: PathBuf,
        key: &'static str,
        found: u64,
        expected: u64,
    },
    #[error("{path}: tensor {tensor:?} also appears in {other}")]
    DuplicateTensor {
        path: PathBuf,
        tensor: String,
        other: PathBuf,
    },
    #[error("{path}: file changed size while open (was {expected} bytes, now {found})")]
    FileChanged {
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    #[error("no tensor named {name:?} in {path}")]
    NoSuchTensor { path: PathBuf, name: String },
    #[error("tensor {tensor:?}: read of {len} bytes at {offset} exceeds its {size} bytes")]
    ReadOutOfRange {
        tensor: String,
        offset: u64,
        len: u64,
        size: u64,
    },
}
