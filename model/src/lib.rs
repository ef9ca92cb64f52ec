//! model (work in progress).

pub mod tokenizer;
