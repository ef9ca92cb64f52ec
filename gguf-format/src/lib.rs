//! A pure, hardened parser and writer for GGUF, the file format of ggml-based
//! language models: bytes in, metadata out.
//!
//! - [`parse`] reads a whole file held in memory (a mapping or a buffer); [`parse_prefix`]
//!   reads the header from the first bytes of a larger file. Both return a [`GgufFile`]:
//!   the [`Metadata`], and a [`TensorInfo`] per tensor holding its [`GgmlType`], shape,
//!   and byte range relative to the data section. Tensor data is never copied.
//! - String arrays (vocabularies, merges) are held as a [`StringArray`]: one buffer of
//!   text and an offset per string, shared by its clones.
//! - [`GgufWriter`] lays out and writes version 3 files with any metadata and any tensor
//!   type, in memory or streamed by the caller.
//! - [`GgufError`] names what is wrong and where, for every malformation.
//!
//! Every number in a file is treated as hostile: counts and lengths are bounded by the
//! named caps in [`limits`] and by the bytes actually left before anything is
//! allocated, arithmetic is checked, and every tensor must lie inside the file, aligned,
//! sharing no byte with another.
//!
//! This crate deliberately does no I/O (the caller decides between mmap and reads), knows
//! no device types, and contains no `unsafe`. It has no cargo features.
#![forbid(unsafe_code)]

mod error;
mod parse;
mod string_array;
mod types;
mod value;
mod write;

pub use error::GgufError;
pub use parse::{
    parse, parse_prefix, GgufFile, TensorInfo, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC,
};
pub use string_array::{Iter as StringArrayIter, StringArray};
pub use types::GgmlType;
pub use value::{Array, FromValue, Metadata, Value, ValueType};
pub use write::{GgufWriter, Layout, TensorDecl};

/// The caps that bound what a file may declare.
pub mod limits {
    pub use crate::parse::{
        MAX_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_ARRAY_LEN, MAX_DIMS, MAX_KEY_LEN, MAX_METADATA,
        MAX_STRING_LEN, MAX_TENSORS, MAX_TENSOR_NAME_LEN,
    };
}
