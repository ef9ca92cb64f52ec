//! The real model files and the dequantization vectors of `testdata/vectors`: they parse, hold the
//! tensor types the model notes list, and rewrite byte for byte through the writer.

use std::collections::BTreeMap;

use gguf_format::{parse, parse_prefix, GgmlType, GgufError, GgufFile, GgufWriter};

#[path = "../../../testdata/models.rs"]
mod models;

fn read_model(file: &str) -> Vec<u8> {
    let path = models::model_path(file);
    std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn type_counts(file: &GgufFile) -> BTreeMap<GgmlType, usize> {
    let mut counts = BTreeMap::new();
    for t in &file.tensors {
        *counts.entry(t.ggml_type).or_default() += 1;
    }
    counts
}

/// The file rebuilt from what the parser read: metadata in order, tensors in order, the
/// data copied from the original.
fn rewrite(file: &GgufFile, bytes: &[u8]) -> Vec<u8> {
    let mut w = GgufWriter::new();
    for (key, value) in file.metadata.iter() {
        w.add_metadata(key, value.clone()).unwrap();
    }
    for t in &file.tensors {
        w.add_tensor(&t.name, t.ggml_type, &t.shape).unwrap();
    }
    let data: Vec<&[u8]> = file
        .tensors
        .iter()
        .map(|t| {
            let range = file.tensor_range(t);
            &bytes[range.start as usize..range.end as usize]
        })
        .collect();
    w.to_bytes(&data).unwrap()
}

/// Parses, checks the types, rewrites, and compares byte for byte.
fn check_file(bytes: &[u8], architecture: &str, expected: &[(GgmlType, usize)]) -> GgufFile {
    let file = parse(bytes).unwrap();
    assert_eq!(file.version, 3);
    assert_eq!(file.architecture(), Some(architecture));
    let expected: BTreeMap<GgmlType, usize> = expected.iter().copied().collect();
    assert_eq!(type_counts(&file), expected);
    let rewritten = rewrite(&file, bytes);
    assert_eq!(rewritten.len(), bytes.len());
    if let Some(at) = rewritten.iter().zip(bytes).position(|(a, b)| a != b) {
        panic!("the rewritten file first differs at byte {at}");
    }
    file
}

/// [`check_file`] on the model `file`, with its layer count and vocabulary size.
fn check_model(
    file: &str,
    architecture: &str,
    (block_count, n_vocab): (u32, usize),
    expected: &[(GgmlType, usize)],
) -> GgufFile {
    let bytes = read_model(file);
    let file = check_file(&bytes, architecture, expected);
    let key = format!("{architecture}.block_count");
    assert_eq!(file.metadata.get_u32(&key), Ok(block_count));
    let tokens = file.metadata.get_string_array("tokenizer.ggml.tokens");
    assert_eq!(tokens.unwrap().len(), n_vocab);
    file
}

#[test]
fn smollm2_parses_and_rewrites_byte_identically() {
    use GgmlType::{F32, Q4_1, Q8_0};
    let file = check_model(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "llama",
        (30, 49152),
        &[(F32, 61), (Q4_1, 210), (Q8_0, 1)],
    );
    assert_eq!(file.tensor("token_embd.weight").unwrap().ggml_type, Q8_0);
}

#[test]
fn gemma3_parses_and_rewrites_byte_identically() {
    use GgmlType::{F32, Q4_K, Q5_0, Q6_K, Q8_0};
    check_model(
        "gemma-3-270m-q4_k_m.gguf",
        "gemma3",
        (18, 262144),
        &[(F32, 109), (Q5_0, 81), (Q4_K, 27), (Q8_0, 10), (Q6_K, 9)],
    );
}

#[test]
fn real_model_header_parses_from_a_growing_prefix() {
    // As a reader without a mapping does: start small, fetch what the error asks for.
    let bytes = read_model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut fetched = 4096usize;
    let file = loop {
        match parse_prefix(&bytes[..fetched], bytes.len() as u64) {
            Ok(file) => break file,
            Err(GgufError::UnexpectedEof { offset, needed, .. }) => {
                let want = (offset + needed) as usize;
                assert!(want > fetched);
                fetched = want.max(fetched * 2).min(bytes.len());
            }
            Err(other) => panic!("after {fetched} bytes: {other}"),
        }
    };
    assert_eq!(file, parse(&bytes).unwrap());
    assert!(
        fetched < bytes.len() / 8,
        "read {fetched} bytes for the header"
    );
}

#[test]
fn dequant_vectors_parse_and_rewrite_byte_identically() {
    // The repository's `testdata/vectors`, compiled into the test binary.
    let bytes = include_bytes!("../../../testdata/vectors/dequant_vectors.gguf").to_vec();
    let names = [
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS",
        "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
        "MXFP4", "IQ1_M", "BF16", "F16",
    ];
    // 24 `<TYPE>.q` tensors of their own type and 24 `<TYPE>.f32` tensors.
    let mut expected: Vec<(GgmlType, usize)> = names
        .iter()
        .map(|n| (GgmlType::from_name(n).unwrap(), 1))
        .collect();
    expected.push((GgmlType::F32, 24));
    let file = check_file(&bytes, "test", &expected);
    assert_eq!(file.tensors.len(), 48);
    assert_eq!(file.alignment, 32);
    for name in names {
        let q = file.tensor(&format!("{name}.q")).unwrap();
        assert_eq!(q.ggml_type.name(), name);
        assert_eq!(q.n_elements(), 4096);
        let f = file.tensor(&format!("{name}.f32")).unwrap();
        assert_eq!((f.ggml_type, f.size), (GgmlType::F32, 4096 * 4));
    }
    // Every cut inside the header, and a stride through the data, is refused.
    for len in
        (0..file.data_offset as usize).chain((file.data_offset as usize..bytes.len()).step_by(997))
    {
        assert!(parse(&bytes[..len]).is_err(), "cut at {len}");
    }
}
