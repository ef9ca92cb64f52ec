//! Typed access to metadata: errors name the key, the expected and the found type.

use gguf_format::{parse, GgufError, GgufWriter, Metadata, ValueType};

/// Metadata as a model file carries it, read back through the parser.
fn model_metadata() -> Metadata {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("llama.block_count", 30u32).unwrap();
    w.add_metadata("llama.context_length", 8192u64).unwrap();
    w.add_metadata("huge", u64::MAX).unwrap();
    w.add_metadata("negative", -1i32).unwrap();
    w.add_metadata("llama.rope.freq_base", 10000f32).unwrap();
    w.add_metadata("eps", 1e-5f64).unwrap();
    w.add_metadata("tokenizer.ggml.tokens", vec!["a".to_string(), "b".into()])
        .unwrap();
    w.add_metadata("tokenizer.ggml.token_type", vec![1i32, 3])
        .unwrap();
    w.add_metadata("add_bos", true).unwrap();
    parse(&w.to_bytes(&[]).unwrap()).unwrap().metadata
}

/// `result` is a [`GgufError::WrongType`] expecting `expected` and finding `found`.
fn assert_wrong_type<T: std::fmt::Debug>(
    result: Result<T, GgufError>,
    expected: &str,
    found: ValueType,
) {
    assert!(
        matches!(
            &result,
            Err(GgufError::WrongType { expected: e, found: f, .. }) if *e == expected && *f == found
        ),
        "{result:?}"
    );
}

/// As [`assert_wrong_type`], for `key`.
fn assert_wrong_type_of<T: std::fmt::Debug>(
    result: Result<T, GgufError>,
    key: &str,
    expected: &str,
    found: ValueType,
) {
    assert!(
        matches!(
            &result,
            Err(GgufError::WrongType { key: k, expected: e, found: f })
                if k == key && *e == expected && *f == found
        ),
        "{result:?}"
    );
}

/// `result` is a [`GgufError::ValueOutOfRange`] expecting `expected`.
fn assert_out_of_range<T: std::fmt::Debug>(result: Result<T, GgufError>, expected: &str) {
    assert!(
        matches!(&result, Err(GgufError::ValueOutOfRange { expected: e, .. }) if *e == expected),
        "{result:?}"
    );
}

#[test]
fn present_values_of_compatible_types_are_returned() {
    let m = model_metadata();
    assert_eq!(m.get_str("general.architecture"), Ok("llama"));
    assert_eq!(m.get_u32("llama.block_count"), Ok(30));
    assert_eq!(m.get_u32("llama.context_length"), Ok(8192));
    assert_eq!(m.get_u64("llama.block_count"), Ok(30));
    assert_eq!(m.get_as::<i64>("negative"), Ok(-1));
    assert_eq!(m.get_f32("llama.rope.freq_base"), Ok(10000.0));
    assert_eq!(m.get_f32("eps"), Ok(1e-5));
    assert_eq!(m.get_bool("add_bos"), Ok(true));
    assert_eq!(
        *m.get_string_array("tokenizer.ggml.tokens").unwrap(),
        ["a", "b"]
    );
    assert_eq!(
        m.get_i32_array("tokenizer.ggml.token_type"),
        Ok(&[1, 3][..])
    );
}

#[test]
fn missing_key() {
    let m = model_metadata();
    assert!(matches!(
        m.get_u32("llama.embedding_length"),
        Err(GgufError::MissingKey { ref key }) if key == "llama.embedding_length"
    ));
    assert!(matches!(
        m.get_string_array("tokenizer.ggml.merges"),
        Err(GgufError::MissingKey { .. })
    ));
    assert_eq!(m.get_opt::<u32>("llama.embedding_length"), Ok(None));
}

#[test]
fn wrong_type_names_key_expected_and_found() {
    let m = model_metadata();
    assert_wrong_type_of(
        m.get_u32("general.architecture"),
        "general.architecture",
        "u32",
        ValueType::String,
    );
    assert_wrong_type(m.get_str("llama.block_count"), "string", ValueType::U32);
    assert_wrong_type(m.get_f32("llama.block_count"), "f32", ValueType::U32);
    assert!(matches!(
        m.get_bool("llama.block_count"),
        Err(GgufError::WrongType {
            expected: "bool",
            ..
        })
    ));
    assert_wrong_type(m.get_array("add_bos"), "array", ValueType::Bool);
    assert!(matches!(
        m.get_opt::<&str>("llama.block_count"),
        Err(GgufError::WrongType { .. })
    ));
}

#[test]
fn wrong_array_element_type_names_the_element_type_found() {
    let m = model_metadata();
    assert_wrong_type_of(
        m.get_f32_array("tokenizer.ggml.token_type"),
        "tokenizer.ggml.token_type",
        "array of f32",
        ValueType::I32,
    );
    assert_wrong_type(
        m.get_string_array("tokenizer.ggml.token_type"),
        "array of string",
        ValueType::I32,
    );
    assert_wrong_type(
        m.get_i32_array("tokenizer.ggml.tokens"),
        "array of i32",
        ValueType::String,
    );
}

#[test]
fn integer_out_of_range_names_the_value() {
    let m = model_metadata();
    assert!(matches!(
        m.get_u32("huge"),
        Err(GgufError::ValueOutOfRange { ref key, ref value, expected: "u32" })
            if key == "huge" && value == &u64::MAX.to_string()
    ));
    assert!(matches!(
        m.get_u64("negative"),
        Err(GgufError::ValueOutOfRange { ref value, expected: "u64", .. }) if value == "-1"
    ));
    assert_out_of_range(m.get_as::<usize>("negative"), "usize");
    assert!(matches!(
        m.get_as::<u8>("llama.context_length"),
        Err(GgufError::ValueOutOfRange { ref value, expected: "u8", .. }) if value == "8192"
    ));
    assert_out_of_range(m.get_as::<i32>("huge"), "i32");
}
