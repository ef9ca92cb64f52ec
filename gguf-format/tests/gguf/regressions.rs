//! Regression tests, each named after the defect it caught.

use gguf_format::limits::MAX_TENSOR_NAME_LEN;
use gguf_format::{parse, Array, GgmlType, GgufError, GgufWriter, ValueType};

use crate::builder::{assert_parse_err, with_tensors, Bytes, F32};

#[test]
fn version_zero_was_reported_as_a_big_endian_file() {
    assert_parse_err!(
        &Bytes::header(0, 0, 0),
        GgufError::UnsupportedVersion { version: 0 }
    );
    // A genuinely byte-swapped version is still named as such.
    assert_parse_err!(
        &Bytes::header(3u32.swap_bytes(), 0, 0),
        GgufError::BigEndian { version: 3 }
    );
}

#[test]
fn short_file_of_another_format_was_reported_as_cut_short() {
    // Four bytes are enough to tell that a file is not GGUF.
    for bytes in [&b"GGML"[..], b"{\"a\"", b"\x7fELF\x02"] {
        assert!(matches!(
            parse(bytes),
            Err(GgufError::BadMagic { found }) if found == bytes[..4]
        ));
    }
    assert!(matches!(
        parse(b"GGU"),
        Err(GgufError::UnexpectedEof {
            offset: 0,
            needed: 4,
            available: 3
        })
    ));
}

/// Writes `w` with zero-filled tensor data.
fn write(w: &GgufWriter) -> Result<Vec<u8>, GgufError> {
    let data: Vec<Vec<u8>> = w
        .tensors()
        .iter()
        .map(|t| vec![0; t.size as usize])
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    w.to_bytes(&refs)
}

#[test]
fn writer_wrote_files_that_the_parser_refuses() {
    // Each of these was written without complaint and then refused by `parse`.
    let mut long_name = GgufWriter::new();
    let name = "blk.0.".repeat(11);
    assert!(name.len() as u64 > MAX_TENSOR_NAME_LEN);
    long_name.add_tensor(&name, GgmlType::F32, &[4]).unwrap();
    assert!(matches!(
        write(&long_name),
        Err(GgufError::TensorNameTooLong { .. })
    ));

    let mut empty_key = GgufWriter::new();
    empty_key.add_metadata("", "value").unwrap();
    assert!(matches!(write(&empty_key), Err(GgufError::EmptyKey { .. })));

    let mut deep = Array::Bool(vec![true]);
    for _ in 0..10 {
        deep = Array::Array(vec![deep]);
    }
    let mut too_deep = GgufWriter::new();
    too_deep.add_metadata("deep", deep).unwrap();
    assert!(matches!(
        write(&too_deep),
        Err(GgufError::NestingTooDeep { .. })
    ));

    let mut alignment_u64 = GgufWriter::new();
    assert!(matches!(
        alignment_u64.add_metadata("general.alignment", 32u64),
        Err(GgufError::AlignmentType {
            found: ValueType::U64
        })
    ));
    assert!(parse(&write(&alignment_u64).unwrap()).is_ok());
}

#[test]
fn writer_layout_overflowed_the_file_length_near_u64_max() {
    // The data section alone fits in u64, ending at 2^64 - 96; the header in front of it
    // takes 96 bytes (24, two infos of 33, padding).
    let mut w = GgufWriter::new();
    w.add_tensor("a", GgmlType::I8, &[(1 << 63) - 64]).unwrap();
    w.add_tensor("b", GgmlType::I8, &[(1 << 63) - 32]).unwrap();
    assert!(matches!(
        w.layout(),
        Err(GgufError::ShapeOverflow { ref tensor, .. }) if tensor == "b"
    ));
}

#[test]
fn empty_tensor_with_a_dimension_beyond_i64_was_accepted() {
    // Zero elements, but ggml (and llama.cpp's reader) hold dimensions as i64.
    let b = with_tensors(&[("t", &[0, 1 << 63], F32, 0)], 32);
    assert_parse_err!(&b, GgufError::ShapeOverflow { ref shape, .. } if shape == &[0, 1 << 63]);
    // The largest count ggml holds is still fine when it is empty.
    let b = with_tensors(&[("t", &[0, i64::MAX as u64], F32, 0)], 32);
    assert_eq!(parse(&b.0).unwrap().tensors[0].size, 0);
    let mut w = GgufWriter::new();
    assert!(matches!(
        w.add_tensor("t", GgmlType::F32, &[2, 1 << 62]),
        Err(GgufError::ShapeOverflow { .. })
    ));
}
