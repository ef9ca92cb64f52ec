//! The one error type of this crate.

use crate::value::ValueType;

/// Everything that can be wrong with a GGUF file, or with a request made of its metadata.
///
/// Each variant carries the offending values; offsets are byte offsets from the start of
/// the file.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    #[error("file ends early: {needed} bytes needed at offset {offset}, {available} available")]
    UnexpectedEof {
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error(
        "not a GGUF file: it starts with \"{}\", expected \"GGUF\"",
        magic_text(found)
    )]
    BadMagic { found: [u8; 4] },
    #[error("byte-swapped (big-endian) GGUF file (version {version}): only little-endian files are supported")]
    BigEndian { version: u32 },
    #[error(
        "GGUF version 1 is not supported (it used 32-bit counts); convert the file to version 3"
    )]
    VersionOne,
    #[error("unsupported GGUF version {version}: versions 2 and 3 are supported")]
    UnsupportedVersion { version: u32 },
    #[error("{what} count {count} exceeds the limit of {max}")]
    CountTooLarge {
        what: &'static str,
        count: u64,
        max: u64,
    },
    #[error("{what} count {count} at offset {offset} cannot fit in the {remaining} bytes left")]
    CountExceedsFile {
        what: &'static str,
        count: u64,
        offset: u64,
        remaining: u64,
    },
    #[error("string of {len} bytes at offset {offset} exceeds the limit of {max}")]
    StringTooLong { len: u64, max: u64, offset: u64 },
    #[error("string at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { offset: u64 },
    #[error("metadata key at offset {offset} is empty")]
    EmptyKey { offset: u64 },
    #[error("metadata key {key:?} has unknown value type {type_id} (offset {offset})")]
    UnknownValueType {
        key: String,
        type_id: u32,
        offset: u64,
    },
    #[error("metadata key {key:?}: bool value {value} at offset {offset} is neither 0 nor 1")]
    InvalidBool { key: String, value: u8, offset: u64 },
    #[error("metadata key {key:?}: arrays nested {depth} deep exceed the limit of {max}")]
    NestingTooDeep {
        key: String,
        depth: usize,
        max: usize,
    },
    #[error("metadata key {key:?} appears twice")]
    DuplicateKey { key: String },
    #[error("general.alignment must be a u32, found {found}")]
    AlignmentType { found: ValueType },
    #[error("general.alignment {value} is not a power of two between 1 and {max}")]
    InvalidAlignment { value: u64, max: u64 },
    #[error("tensor name of {len} bytes at offset {offset} exceeds ggml's limit of {max}")]
    TensorNameTooLong { len: u64, max: u64, offset: u64 },
    #[error("tensor {tensor:?} has {n_dims} dimensions, more than the {max} ggml supports")]
    TooManyDims {
        tensor: String,
        n_dims: u32,
        max: u32,
    },
    #[error("tensor {tensor:?} has unknown ggml type id {type_id}")]
    UnknownTensorType { tensor: String, type_id: u32 },
    #[error("tensor {tensor:?}: shape {shape:?} overflows ggml's 64-bit signed sizes")]
    ShapeOverflow { tensor: String, shape: Vec<u64> },
    #[error("tensor {tensor:?}: row length {ne0} is not a multiple of the {ggml_type} block size {block_size}")]
    PartialBlock {
        tensor: String,
        ggml_type: crate::GgmlType,
        ne0: u64,
        block_size: u64,
    },
    #[error("tensor {tensor:?} appears twice")]
    DuplicateTensor { tensor: String },
    #[error(
        "tensor {tensor:?}: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error("tensor {tensor:?}: bytes {start}..{end} lie outside the file of {file_len} bytes")]
    TensorOutOfBounds {
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },
    #[error("tensors {first:?} and {second:?} overlap in the data section")]
    TensorOverlap { first: String, second: String },

    // Metadata access.
    #[error("metadata key {key:?} is missing")]
    MissingKey { key: String },
    #[error("metadata key {key:?} has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: ValueType,
    },
    #[error("metadata key {key:?}: value {value} does not fit in {expected}")]
    ValueOutOfRange {
        key: String,
        value: String,
        expected: &'static str,
    },

    // Writing.
    #[error("tensor {tensor:?}: {found} data bytes given, its type and shape need {expected}")]
    DataLengthMismatch {
        tensor: String,
        expected: u64,
        found: u64,
    },
    #[error("{found} tensor data slices given for {expected} declared tensors")]
    DataCountMismatch { expected: usize, found: usize },
}

/// The first bytes of a file as text: printable ASCII as it is, other bytes escaped
/// (`\x89PNG`), so that a user sees what kind of file it is.
fn magic_text(bytes: &[u8]) -> String {
    bytes.escape_ascii().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_magic_reads_as_text() {
        let text = GgufError::BadMagic { found: *b"hell" }.to_string();
        assert_eq!(
            text,
            "not a GGUF file: it starts with \"hell\", expected \"GGUF\""
        );
        let png = GgufError::BadMagic {
            found: [0x89, b'P', b'N', b'G'],
        };
        assert!(png.to_string().contains("\"\\x89PNG\""), "{png}");
    }
}
