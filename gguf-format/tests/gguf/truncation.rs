//! A file cut at any byte: `parse` refuses it without panicking, and `parse_prefix` asks
//! for exactly the bytes beyond the prefix that it needs.

use gguf_format::{parse, parse_prefix, Array, GgmlType, GgufError, GgufWriter};

/// A small file with metadata of every type, nested arrays, and tensors of several types;
/// the last tensor ends the file, so no cut leaves every tensor whole.
pub fn rich_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("u8", 1u8).unwrap();
    w.add_metadata("i8", -1i8).unwrap();
    w.add_metadata("u16", 2u16).unwrap();
    w.add_metadata("i16", -2i16).unwrap();
    w.add_metadata("u32", 3u32).unwrap();
    w.add_metadata("i32", -3i32).unwrap();
    w.add_metadata("f32", 0.5f32).unwrap();
    w.add_metadata("bool", true).unwrap();
    w.add_metadata("u64", 4u64).unwrap();
    w.add_metadata("i64", -4i64).unwrap();
    w.add_metadata("f64", 0.25f64).unwrap();
    w.add_metadata(
        "strings",
        vec!["<s>".to_string(), "ü".into(), String::new()],
    )
    .unwrap();
    w.add_metadata("bools", vec![true, false]).unwrap();
    w.add_metadata("floats", vec![1.0f32, -1.0]).unwrap();
    w.add_metadata(
        "nested",
        Array::Array(vec![
            Array::Array(vec![Array::U16(vec![1, 2])]),
            Array::String(["x"].iter().collect()),
        ]),
    )
    .unwrap();
    w.add_tensor("token_embd.weight", GgmlType::Q8_0, &[32, 2])
        .unwrap();
    w.add_tensor("blk.0.ffn_up.weight", GgmlType::Q4_K, &[256])
        .unwrap();
    w.add_tensor("output_norm.weight", GgmlType::F32, &[8])
        .unwrap();
    let data: Vec<Vec<u8>> = w
        .tensors()
        .iter()
        .map(|t| (0..t.size).map(|i| i as u8).collect())
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let bytes = w.to_bytes(&refs).unwrap();
    let last = parse(&bytes).unwrap();
    let end = last.tensor_range(last.tensors.last().unwrap()).end;
    assert_eq!(end, bytes.len() as u64, "the last tensor must end the file");
    bytes
}

#[test]
fn every_truncation_is_an_error_never_a_panic() {
    let bytes = rich_file();
    for len in 0..bytes.len() {
        match parse(&bytes[..len]) {
            Err(
                GgufError::UnexpectedEof { .. }
                | GgufError::CountExceedsFile { .. }
                | GgufError::TensorOutOfBounds { .. },
            ) => {}
            other => panic!("cut at {len} of {}: {other:?}", bytes.len()),
        }
    }
    assert!(parse(&bytes).is_ok());
}

#[test]
fn every_prefix_asks_for_bytes_beyond_itself() {
    let bytes = rich_file();
    let whole = parse(&bytes).unwrap();
    let file_len = bytes.len() as u64;
    let mut first_success = None;
    for len in 0..=bytes.len() {
        match parse_prefix(&bytes[..len], file_len) {
            Ok(file) => {
                assert_eq!(file, whole, "prefix of {len}");
                first_success.get_or_insert(len);
            }
            Err(GgufError::UnexpectedEof {
                offset,
                needed,
                available,
            }) => {
                assert!(first_success.is_none(), "a longer prefix failed at {len}");
                assert_eq!(offset + available, len as u64);
                assert!(offset + needed > len as u64 && offset + needed <= file_len);
            }
            Err(other) => panic!("prefix of {len}: {other}"),
        }
    }
    // The header is enough: tensor data is never read.
    assert!(first_success.unwrap() as u64 <= whole.data_offset);
}

#[test]
fn a_reader_fetching_what_parse_prefix_asks_for_gets_the_file() {
    let bytes = rich_file();
    let mut fetched = 0usize;
    let mut rounds = 0;
    let file = loop {
        rounds += 1;
        match parse_prefix(&bytes[..fetched], bytes.len() as u64) {
            Ok(file) => break file,
            Err(GgufError::UnexpectedEof { offset, needed, .. }) => {
                let want = (offset + needed) as usize;
                assert!(want > fetched);
                fetched = want;
            }
            Err(other) => panic!("after {fetched} bytes: {other}"),
        }
    };
    assert_eq!(file, parse(&bytes).unwrap());
    assert!(fetched as u64 <= file.data_offset);
    assert!(rounds > 10, "each field asks for itself: {rounds} rounds");
}
