//! The model file, mapped once, and lazy handles to its tensors.
//!
//! [`TensorStore::open`] maps a GGUF model read-only (every shard of a split model),
//! parses its header once with `gguf-format`, and hands out [`TensorHandle`]s: name, type,
//! shape and byte range, whose [`TensorHandle::bytes`] is a zero-copy slice of the
//! mapping. Nothing reads tensor data until it is asked for, so opening a 4 GiB model
//! costs milliseconds and almost no resident memory. When mapping fails, or when asked
//! ([`LoadMode::Read`], the CLI's `--no-mmap`), tensors are read with positioned reads on
//! first use instead.
//!
//! The mapping's safety contract (the file must not shrink or change while mapped) is
//! stated where the mapping is made, in `backing.rs`, with what this crate does about it;
//! the one other `unsafe` call there releases the parsed header's pages of the mapping.
//!
//! [`device`] puts tensors on a device: a single-flight cache with a memory budget and
//! LRU eviction ([`device::DeviceCache`]), fed by a background upload pipeline (reader
//! threads, a ring of staging buffers, asynchronous copies, per-layer readiness). It
//! works against any [`device::DeviceTarget`]: a GPU through `hip-backend`, or host
//! memory for tests and CPU runs. For tensor-parallel runs, [`device::upload_part`] puts
//! a rectangular part of a tensor ([`device::TensorPart`]: some of its rows, or a range
//! of columns in each) on a device outside the cache, gathered straight from the file
//! into staging buffers; the caller owns the result.
//!
//! This crate does not decode or compute: it hands out bytes. It knows nothing of model
//! architectures. It has no cargo features.

mod backing;
pub mod device;
mod error;
mod split;
mod store;

pub use backing::LoadMode;
pub use error::StoreError;
pub use store::{TensorHandle, TensorStore};
