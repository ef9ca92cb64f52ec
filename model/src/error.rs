//! The error type of building and running a model. The tokenizer, chat templates,
//! sampling, generation, the scheduler and the GPU kernels each have an error type of
//! their own beside it.

use gguf_format::{GgmlType, GgufError};

/// What can go wrong building or running a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    #[error(transparent)]
    Metadata(#[from] GgufError),
    #[error(transparent)]
    Store(tensor_store::StoreError),
    /// The stop flag ([`crate::gpu::GpuOptions::stop`]) was set: the load or the forward
    /// pass stopped between two layers, and what it had done is undone (the KV cache is
    /// as it was before the call).
    #[error("stopped on request")]
    Interrupted,
    #[error("architecture {name:?} is not supported (supported: {supported})")]
    UnsupportedArchitecture { name: String, supported: String },
    /// A mixture-of-experts model of a kind this engine does not run.
    #[error(
        "{what}: a mixture of experts this engine does not run yet (it runs qwen3moe, \
         qwen2moe, gpt-oss and llama files with experts, such as Mixtral)"
    )]
    UnsupportedExperts { what: String },
    /// The model runs on the CPU but not on the GPU.
    #[error("{what} runs on the CPU only (the GPU runs {supported}); use --device cpu")]
    GpuUnsupported { what: String, supported: String },
    #[error("metadata {key}: {reason}")]
    InvalidConfig { key: String, reason: String },
    #[error("tensor {name:?} is missing from the model")]
    MissingTensor { name: String },
    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    #[error("tensor {name:?} has type {ggml_type}, which this engine cannot compute with")]
    UnsupportedTensorType { name: String, ggml_type: GgmlType },
    #[error("tensor {name:?}: {source}")]
    Matmul {
        name: String,
        #[source]
        source: dequant::DequantError,
    },
    #[error("tensor {name:?}: {source}")]
    Decode {
        name: String,
        #[source]
        source: dequant::DequantError,
    },
    #[error("token id {token} is outside the vocabulary of {n_vocab}")]
    TokenOutOfRange { token: u32, n_vocab: usize },
    #[error("{needed} positions needed but the context holds {capacity}")]
    ContextFull { needed: usize, capacity: usize },
    /// A KV cache type the model or the settings cannot take.
    #[error("KV cache type: {reason}")]
    CacheType { reason: String },
    #[error("no tokens to process")]
    EmptyInput,
    /// A prompt chunk size that holds no token.
    #[error("a prompt's chunks must hold at least 1 token, not {tokens}")]
    InvalidPromptBatch { tokens: usize },
    /// A setting of [`crate::gpu::GpuOptions`] out of its range.
    #[error("{name} {value}: {reason}")]
    InvalidGpuOption {
        name: &'static str,
        value: String,
        reason: &'static str,
    },
    /// A batch of several sequences that the paged cache cannot take as given.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// A GPU operation failed: a kernel's launch, a copy, a graph.
    #[error("gpu {op}: {source}")]
    Gpu {
        op: &'static str,
        #[source]
        source: hip_backend::HipError,
    },
    /// The thread that drives one device of a split by tensors is gone (it panicked):
    /// the split cannot go on.
    #[error("the thread driving GPU {device} of a split by tensors {what}")]
    DeviceThread { device: usize, what: &'static str },
    /// A GPU kernel refused its arguments (a bug, or a model shape it cannot take).
    #[error("gpu kernel: {0}")]
    GpuKernel(#[from] KernelError),
    /// Device memory for activations and the KV cache could not be had.
    #[error(
        "the GPU has no room for {what}: {requested} bytes needed, {free} of {total} bytes free \
         (lower --ctx-size, or use --device cpu)"
    )]
    GpuOutOfMemory {
        what: &'static str,
        requested: u64,
        free: u64,
        total: u64,
    },
    /// The logits of a GPU step held a NaN or +inf.
    #[error("the logits hold a NaN or infinite value")]
    BadLogits,
}

impl From<tensor_store::StoreError> for ModelError {
    /// A load the stop flag ended is an interruption, not a failure of the store.
    fn from(error: tensor_store::StoreError) -> ModelError {
        if error.is_interrupted() {
            ModelError::Interrupted
        } else {
            ModelError::Store(error)
        }
    }
}

impl From<hip_backend::HipError> for ModelError {
    /// A runtime failure outside any named step (graph capture and instantiation).
    fn from(source: hip_backend::HipError) -> ModelError {
        ModelError::Gpu {
            op: "graph capture",
            source,
        }
    }
}

/// A GPU kernel wrapper (`gpu::kernels`) was given buffers that do not fit the shapes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kernel}: {what} holds {actual} elements, expected {expected}")]
pub struct ShapeError {
    pub kernel: &'static str,
    pub what: &'static str,
    pub expected: usize,
    pub actual: usize,
}

/// What a GPU kernel wrapper can fail with.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(transparent)]
    Shape(#[from] ShapeError),
    #[error(transparent)]
    Hip(#[from] hip_backend::HipError),
    #[error("{kernel}: {what} is {value}, not a positive number")]
    NotPositive {
        kernel: &'static str,
        what: &'static str,
        value: f32,
    },
}
