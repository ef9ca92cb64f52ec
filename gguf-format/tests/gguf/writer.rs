//! The writer's errors: it refuses what it cannot write, and what the parser would refuse.

use gguf_format::limits::{
    MAX_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS, MAX_KEY_LEN, MAX_STRING_LEN, MAX_TENSOR_NAME_LEN,
};
use gguf_format::{parse, Array, GgmlType, GgufError, GgufWriter, ValueType};

fn two_tensors() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_tensor("a", GgmlType::F32, &[4]).unwrap();
    w.add_tensor("b", GgmlType::Q8_0, &[32]).unwrap();
    w
}

#[test]
fn data_count_mismatch() {
    let w = two_tensors();
    assert!(matches!(
        w.to_bytes(&[&[0; 16]]),
        Err(GgufError::DataCountMismatch {
            expected: 2,
            found: 1
        })
    ));
    assert!(matches!(
        w.to_bytes(&[&[0; 16], &[0; 34], &[]]),
        Err(GgufError::DataCountMismatch {
            expected: 2,
            found: 3
        })
    ));
}

#[test]
fn data_length_mismatch() {
    let w = two_tensors();
    assert!(matches!(
        w.to_bytes(&[&[0; 16], &[0; 33]]),
        Err(GgufError::DataLengthMismatch { ref tensor, expected: 34, found: 33 }) if tensor == "b"
    ));
}

#[test]
fn duplicate_tensor() {
    let mut w = two_tensors();
    assert!(matches!(
        w.add_tensor("a", GgmlType::F16, &[2]),
        Err(GgufError::DuplicateTensor { ref tensor }) if tensor == "a"
    ));
    assert_eq!(w.tensors().len(), 2);
}

#[test]
fn alignment_not_a_power_of_two_or_too_large() {
    let mut w = GgufWriter::new();
    for bad in [0, 3, 48, (MAX_ALIGNMENT * 2) as u32] {
        assert!(matches!(
            w.set_alignment(bad),
            Err(GgufError::InvalidAlignment { value, max: MAX_ALIGNMENT }) if value == u64::from(bad)
        ));
        assert!(matches!(
            w.add_metadata("general.alignment", bad),
            Err(GgufError::InvalidAlignment { .. })
        ));
    }
    assert!(!w.metadata().contains("general.alignment"));
}

#[test]
fn alignment_of_the_wrong_type() {
    let mut w = GgufWriter::new();
    assert!(matches!(
        w.add_metadata("general.alignment", 64u64),
        Err(GgufError::AlignmentType {
            found: ValueType::U64
        })
    ));
    assert!(!w.metadata().contains("general.alignment"));
}

#[test]
fn too_many_dimensions() {
    let mut w = GgufWriter::new();
    assert!(matches!(
        w.add_tensor("t", GgmlType::F32, &[1; 5]),
        Err(GgufError::TooManyDims {
            n_dims: 5,
            max: MAX_DIMS,
            ..
        })
    ));
}

#[test]
fn partial_block_and_overflowing_shape() {
    let mut w = GgufWriter::new();
    assert!(matches!(
        w.add_tensor("q", GgmlType::Q4_K, &[100]),
        Err(GgufError::PartialBlock {
            ne0: 100,
            block_size: 256,
            ..
        })
    ));
    assert!(matches!(
        w.add_tensor("big", GgmlType::F32, &[u64::MAX, 2]),
        Err(GgufError::ShapeOverflow { .. })
    ));
    assert!(w.tensors().is_empty());
}

#[test]
fn duplicate_key() {
    let mut w = GgufWriter::new();
    w.add_metadata("general.name", "x").unwrap();
    assert!(matches!(
        w.add_metadata("general.name", "y"),
        Err(GgufError::DuplicateKey { ref key }) if key == "general.name"
    ));
    w.set_alignment(64).unwrap();
    assert!(matches!(
        w.add_metadata("general.alignment", 64u32),
        Err(GgufError::DuplicateKey { .. })
    ));
}

#[test]
fn empty_key() {
    let mut w = GgufWriter::new();
    w.add_metadata("", 1u8).unwrap();
    assert!(matches!(
        w.layout(),
        Err(GgufError::EmptyKey { offset: 24 })
    ));
}

#[test]
fn key_and_string_longer_than_the_parser_accepts() {
    let mut w = GgufWriter::new();
    w.add_metadata(&"k".repeat(MAX_KEY_LEN as usize + 1), 1u8)
        .unwrap();
    assert!(matches!(
        w.layout(),
        Err(GgufError::StringTooLong {
            max: MAX_KEY_LEN,
            offset: 24,
            ..
        })
    ));

    let long = "s".repeat(MAX_STRING_LEN as usize + 1);
    let mut w = GgufWriter::new();
    w.add_metadata("template", long.as_str()).unwrap();
    assert!(matches!(
        w.layout(),
        Err(GgufError::StringTooLong { len, max: MAX_STRING_LEN, offset: 44 }) if len == MAX_STRING_LEN + 1
    ));
    let mut w = GgufWriter::new();
    w.add_metadata("tokens", vec![String::new(), long]).unwrap();
    // Key at 24 (8 + 6), type, array header (12), the empty string (8).
    assert!(matches!(
        w.layout(),
        Err(GgufError::StringTooLong {
            max: MAX_STRING_LEN,
            offset: 62,
            ..
        })
    ));
}

#[test]
fn arrays_nested_deeper_than_the_parser_accepts() {
    let mut array = Array::U8(vec![1]);
    for _ in 1..MAX_ARRAY_DEPTH {
        array = Array::Array(vec![array]);
    }
    let mut w = GgufWriter::new();
    w.add_metadata("ok", array.clone()).unwrap();
    w.add_metadata("deep", Array::Array(vec![array])).unwrap();
    assert!(matches!(
        w.layout(),
        Err(GgufError::NestingTooDeep { ref key, depth, max: MAX_ARRAY_DEPTH })
            if key == "deep" && depth == MAX_ARRAY_DEPTH + 1
    ));
}

#[test]
fn tensor_name_longer_than_the_parser_accepts() {
    let mut w = GgufWriter::new();
    w.add_tensor(
        &"n".repeat(MAX_TENSOR_NAME_LEN as usize + 1),
        GgmlType::F32,
        &[1],
    )
    .unwrap();
    assert!(matches!(
        w.layout(),
        Err(GgufError::TensorNameTooLong {
            len: 64,
            max: MAX_TENSOR_NAME_LEN,
            offset: 24
        })
    ));
}

#[test]
fn layout_streams_the_same_file_as_to_bytes() {
    let mut w = two_tensors();
    w.set_alignment(64).unwrap();
    let data: [&[u8]; 2] = [&[1; 16], &[2; 34]];
    let bytes = w.to_bytes(&data).unwrap();
    let layout = w.layout().unwrap();
    assert_eq!(layout.tensor_offsets, [0, 64]);
    assert_eq!(layout.file_len, bytes.len() as u64);
    let mut streamed = layout.header.clone();
    for (offset, d) in layout.tensor_offsets.iter().zip(data) {
        streamed.resize(layout.header.len() + *offset as usize, 0);
        streamed.extend_from_slice(d);
    }
    streamed.resize(layout.file_len as usize, 0);
    assert_eq!(streamed, bytes);
    let file = parse(&bytes).unwrap();
    assert_eq!(file.data_offset, layout.header.len() as u64);
    assert_eq!(file.alignment, 64);
}
