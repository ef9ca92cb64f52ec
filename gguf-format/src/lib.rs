//! gguf-format
pub mod types;
pub use types::GgmlType;
