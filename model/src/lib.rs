//! Running a GGUF language model: configuration from metadata, tokenizer, execution plan
//! of lazy weights, CPU forward pass, KV cache and sampling.
//!
//! - [`ModelConfig::from_metadata`] reads hyper-parameters (pure; no weights needed) for
//!   the `llama`, `qwen2`, `qwen3`, `phi3`, `gemma2` and `gemma3` architectures.
//! - [`ExecutionPlan`] holds, per layer, [`tensor_store::TensorHandle`]s of the weights:
//!   building it checks names, shapes and types and reads no weight bytes.
//! - [`Model::forward`] runs a batch of tokens through the plan on the CPU, multiplying
//!   straight on the quantized blocks (`dequant::matmul`), and fills the [`KvCache`].
//!
//! - [`serve::Scheduler`] serves many requests at once: one thread, one model, every
//!   running sequence advanced by one batched step at a time over a shared KV pool.
//! - [`perplexity`] scores a text as llama.cpp's `llama-perplexity` does: the perplexity
//!   over windows of the text, and the KL divergence from a base model's saved
//!   log-probabilities.
//! - [`constraint::Grammars`] holds output to a JSON schema, a Lark grammar or a regular
//!   expression (`llguidance`), masking each step's logits of a constrained sequence.
//!
//! This crate never calls HIP FFI directly and starts no async runtime; compute runs on
//! rayon's pool. It has no cargo features.

pub mod chat;
mod config;
pub mod constraint;
mod cpu;
mod error;
pub mod generate;
pub mod gpu;
mod kv_cache;
pub(crate) mod kv_pool;
mod kv_type;
pub mod logprobs;
mod model;
mod ops;
pub mod perplexity;
mod plan;
pub mod pooling;
pub mod sampling;
pub mod serve;
pub mod tokenizer;

pub use config::{Activation, Architecture, LayerAttention, ModelConfig, RopeStyle};
pub use cpu::{Logits, PROGRESS_TARGET};
pub use error::ModelError;
pub use kv_cache::KvCache;
pub use kv_type::{KvType, KvTypes};
pub use model::Model;
pub use ops::{AttentionMethod, CacheRows};
pub use plan::{ExecutionPlan, LayerPlan, Linear, Vector};
