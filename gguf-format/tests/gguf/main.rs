//! The gguf-format test suite, one binary: a malformed file for every error the parser
//! can return (from hand-built bytes), truncation at every offset, the errors of metadata
//! access and of the writer, a property-based write→parse round trip, the real model
//! files, and regression tests named after what they caught.

mod access;
mod builder;
mod malformed_header;
mod malformed_metadata;
mod malformed_tensors;
mod real_files;
mod regressions;
mod round_trip;
mod same_bits;
mod truncation;
mod writer;
