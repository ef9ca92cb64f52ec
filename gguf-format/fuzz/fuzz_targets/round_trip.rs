#![no_main]
//! Whatever the parser accepts, the writer writes back, and the written file parses to
//! the same metadata, tensors and data: writing is a fixpoint after one round.

use gguf_format::{parse, GgufFile, GgufWriter};

libfuzzer_sys::fuzz_target!(|bytes: &[u8]| {
    let Ok(file) = parse(bytes) else {
        return;
    };
    let first = rewrite(&file, bytes);
    let reparsed = parse(&first).expect("the writer's output parses");
    assert_eq!(reparsed.alignment, file.alignment);
    assert_eq!(reparsed.metadata.len(), file.metadata.len());
    for (a, b) in file.tensors.iter().zip(&reparsed.tensors) {
        assert_eq!(
            (&a.name, a.ggml_type, &a.shape, a.size),
            (&b.name, b.ggml_type, &b.shape, b.size)
        );
        assert_eq!(
            tensor_bytes(&file, a, bytes),
            tensor_bytes(&reparsed, b, &first)
        );
    }
    assert_eq!(reparsed.tensors.len(), file.tensors.len());
    assert!(
        rewrite(&reparsed, &first) == first,
        "a second rewrite differs from the first"
    );
});

fn tensor_bytes<'a>(
    file: &GgufFile,
    tensor: &gguf_format::TensorInfo,
    bytes: &'a [u8],
) -> &'a [u8] {
    let range = file.tensor_range(tensor);
    &bytes[range.start as usize..range.end as usize]
}

fn rewrite(file: &GgufFile, bytes: &[u8]) -> Vec<u8> {
    let mut writer = GgufWriter::new();
    for (key, value) in file.metadata.iter() {
        writer
            .add_metadata(key, value.clone())
            .expect("parsed metadata is writable");
    }
    for t in &file.tensors {
        writer
            .add_tensor(&t.name, t.ggml_type, &t.shape)
            .expect("parsed tensor is writable");
    }
    let data: Vec<&[u8]> = file
        .tensors
        .iter()
        .map(|t| tensor_bytes(file, t, bytes))
        .collect();
    writer.to_bytes(&data).expect("parsed data is writable")
}
