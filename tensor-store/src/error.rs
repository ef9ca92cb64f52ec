//! The one error type of this crate.

use std::path::PathBuf;
use std::sync::Arc;

/// What can go wrong opening a model or reading its tensors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("{path}: is a directory, not a GGUF file")]
    IsDirectory { path: PathBuf },
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
    /// The device could not hand out `requested` bytes (its memory, or the arena carved
    /// from it, is full). The device cache answers this by evicting, then by
    /// [`StoreError::DeviceOutOfMemory`].
    #[error("device allocation of {requested} bytes failed: {reason}")]
    DeviceAlloc { requested: u64, reason: String },
    /// A tensor does not fit on the device even after evicting every tensor not in use.
    #[error(
        "device out of memory for tensor {tensor:?}: {requested} bytes do not fit \
         (budget {budget} bytes, {resident} resident of which {in_use} in use, {loading} loading)"
    )]
    DeviceOutOfMemory {
        tensor: String,
        requested: u64,
        budget: u64,
        resident: u64,
        in_use: u64,
        loading: u64,
    },
    /// A device runtime call failed.
    #[error("device {op} failed: {source}")]
    Device {
        op: &'static str,
        #[source]
        source: hip_backend::HipError,
    },
    /// The upload of `tensor` was cancelled before it completed.
    #[error("loading tensor {tensor:?} was cancelled")]
    LoadCancelled { tensor: String },
    /// The cache's stop flag ([`crate::device::CacheConfig::stop`]) was set while a load
    /// was waited for: every upload was cancelled.
    #[error("loading was stopped on request")]
    Interrupted,
    /// The upload another request started for `tensor` failed; `source` is its error.
    #[error("loading tensor {tensor:?} failed: {source}")]
    LoadFailed {
        tensor: String,
        #[source]
        source: Arc<StoreError>,
    },
    /// A handle that does not belong to the store the device cache was built on.
    #[error("tensor {tensor:?} of {path} is not a tensor of this device cache's model")]
    ForeignTensor { tensor: String, path: PathBuf },
    /// A part of a tensor ([`crate::device::TensorPart`]) that is not one: outside its
    /// rows or columns, not made of whole blocks of its type, or empty. `reason` names
    /// the offending range.
    #[error("tensor {tensor:?}: invalid part: {reason}")]
    BadPart { tensor: String, reason: String },
    /// A device cache setting out of its range.
    #[error("invalid device cache setting {name} = {value}: {reason}")]
    InvalidCacheConfig {
        name: &'static str,
        value: u64,
        reason: &'static str,
    },
}

impl StoreError {
    /// The error behind any [`StoreError::LoadFailed`] wrappers.
    pub fn root(&self) -> &StoreError {
        match self {
            StoreError::LoadFailed { source, .. } => source.root(),
            other => other,
        }
    }

    /// True when a stop request, not a failure, ended the load.
    pub fn is_interrupted(&self) -> bool {
        matches!(self.root(), StoreError::Interrupted)
    }

    /// True when the root cause is a tensor that did not fit on the device.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self.root(), StoreError::DeviceOutOfMemory { .. })
    }
}
