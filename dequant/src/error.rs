//! The errors of decoding.

use gguf_format::GgmlType;

use crate::DecodePath;

/// What can go wrong when decoding a tensor's bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    /// The input is not a whole number of blocks.
    #[error("{bytes} bytes are not a whole number of {ty} blocks of {block_bytes} bytes")]
    PartialBlock {
        ty: GgmlType,
        bytes: usize,
        block_bytes: usize,
    },
    /// The output slice does not hold exactly as many values as the input decodes to.
    #[error("{blocks} blocks of {ty} decode to {expected} values, the output holds {actual}")]
    OutputLength {
        ty: GgmlType,
        blocks: usize,
        expected: usize,
        actual: usize,
    },
    /// The requested decode path cannot run on this CPU.
    #[error("decode path {} is not available on this cpu", path.name())]
    PathUnavailable { path: DecodePath },
}
