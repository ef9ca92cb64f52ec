//! Opening models, mapped and read, single and split, and the errors of each.

use std::path::{Path, PathBuf};

#[path = "store/device_cache.rs"]
mod device_cache;
#[path = "store/device_gpu.rs"]
mod device_gpu;
#[path = "store/device_part.rs"]
mod device_part;

use gguf_format::{GgmlType, GgufWriter};
use tensor_store::{LoadMode, StoreError, TensorStore};

/// A small model with three tensors of distinct types and recognisable bytes.
fn small_model(extra_metadata: &[(&str, u64)], tensors: &[(&str, GgmlType, Vec<u64>)]) -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    for (k, v) in extra_metadata {
        w.add_metadata(k, *v).unwrap();
    }
    for (name, ty, shape) in tensors {
        w.add_tensor(name, *ty, shape).unwrap();
    }
    let data: Vec<Vec<u8>> = w
        .tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (0..t.size)
                .map(|b| (b as u8).wrapping_mul(7).wrapping_add(i as u8))
                .collect()
        })
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    w.to_bytes(&refs).unwrap()
}

fn default_tensors() -> Vec<(&'static str, GgmlType, Vec<u64>)> {
    vec![
        ("a.weight", GgmlType::F32, vec![16, 4]),
        ("b.weight", GgmlType::Q4_K, vec![256, 3]),
        ("c.weight", GgmlType::Q8_0, vec![64]),
    ]
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// The error opening the first of `shards` (names and contents), written side by side.
fn shard_error(shards: &[(impl AsRef<str>, Vec<u8>)]) -> StoreError {
    let dir = tempfile::tempdir().unwrap();
    let paths: Vec<PathBuf> = shards
        .iter()
        .map(|(name, bytes)| write(dir.path(), name.as_ref(), bytes))
        .collect();
    TensorStore::open(&paths[0]).err().unwrap()
}

/// [`shard_error`] for shards `m-0000i-of-0000{count}.gguf` that hold the given ranges
/// of [`default_tensors`] and no split keys.
fn plain_shards_error(count: usize, ranges: &[std::ops::Range<usize>]) -> StoreError {
    let t = default_tensors();
    let shards: Vec<(String, Vec<u8>)> = ranges
        .iter()
        .enumerate()
        .map(|(i, range)| {
            let name = format!("m-{:05}-of-{count:05}.gguf", i + 1);
            (name, small_model(&[], &t[range.clone()]))
        })
        .collect();
    shard_error(&shards)
}

#[test]
fn mapped_and_read_modes_give_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = small_model(&[], &default_tensors());
    let path = write(dir.path(), "m.gguf", &bytes);
    let parsed = gguf_format::parse(&bytes).unwrap();

    let mapped = TensorStore::open(&path).unwrap();
    let read = TensorStore::open_with(&path, LoadMode::Read).unwrap();
    assert!(mapped.is_mapped());
    assert!(!read.is_mapped());
    assert_eq!(mapped.len(), 3);
    assert_eq!(
        mapped.metadata().get_str("general.architecture").unwrap(),
        "llama"
    );
    for info in &parsed.tensors {
        let range = parsed.tensor_range(info);
        let expected = &bytes[range.start as usize..range.end as usize];
        let m = mapped.tensor(&info.name).unwrap();
        let r = read.tensor(&info.name).unwrap();
        assert_eq!(m.bytes().unwrap(), expected, "{}", info.name);
        assert_eq!(r.bytes().unwrap(), expected, "{}", info.name);
        assert_eq!(m.shape(), info.shape.as_slice());
        assert_eq!(m.ggml_type(), info.ggml_type);
        // A partial read from the middle matches too.
        let mut part = vec![0u8; 5];
        r.read_into(3, &mut part).unwrap();
        assert_eq!(part, expected[3..8]);
    }
}

/// A model whose 400,000 vocabulary entries make a header of 7.9 MB, then one tensor `x`
/// of 8 f32 values, every byte 1.
fn big_header_model() -> Vec<u8> {
    let mut w = GgufWriter::new();
    let vocab: Vec<String> = (0..400_000).map(|i| format!("token-{i}")).collect();
    w.add_metadata("tokenizer.ggml.tokens", vocab).unwrap();
    w.add_tensor("x", GgmlType::F32, &[8]).unwrap();
    w.to_bytes(&[&[1u8; 32]]).unwrap()
}

#[test]
fn read_mode_header_larger_than_first_read_is_parsed() {
    // Over 4 MiB of metadata forces the header reader to grow its first read.
    let bytes = big_header_model();
    assert!(bytes.len() > 4 << 20);
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "big-header.gguf", &bytes);
    for mode in [LoadMode::Read, LoadMode::Mmap] {
        let store = TensorStore::open_with(&path, mode).unwrap();
        assert_eq!(store.tensor("x").unwrap().bytes().unwrap(), &[1u8; 32]);
    }
}

/// A mapped model's header is parsed from the mapping; its pages must not stay resident.
#[cfg(target_os = "linux")]
#[test]
fn a_mapped_header_does_not_stay_resident() {
    // A header of 7.9 MB, a little larger than Gemma 3's.
    let bytes = big_header_model();
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "big-header.gguf", &bytes);
    let store = TensorStore::open(&path).unwrap();
    assert!(store.is_mapped());
    let resident = mapped_resident_bytes(&path);
    assert!(
        resident < 1 << 20,
        "{resident} bytes of the {}-byte file resident after open",
        bytes.len()
    );
    // The tensor shares the header's last page, released too: its bytes fault back in.
    let tokens = store
        .metadata()
        .get_string_array("tokenizer.ggml.tokens")
        .unwrap();
    assert_eq!((tokens.len(), &tokens[399_999]), (400_000, "token-399999"));
    assert_eq!(store.tensor("x").unwrap().bytes().unwrap(), &[1u8; 32]);
}

/// Resident bytes of this process's mappings of `path`, from `/proc/self/smaps`.
#[cfg(target_os = "linux")]
fn mapped_resident_bytes(path: &Path) -> u64 {
    let path = path.canonicalize().unwrap();
    let path = path.to_str().unwrap();
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut in_file = false;
    let mut kib = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or_default();
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            // The line that opens a mapping: address range, ..., path.
            in_file = line.ends_with(path);
        } else if let (true, Some(rss)) = (in_file, line.strip_prefix("Rss:")) {
            kib += rss
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .unwrap();
        }
    }
    kib * 1024
}

#[test]
fn split_model_opens_as_one_from_any_shard() {
    let dir = tempfile::tempdir().unwrap();
    let t = default_tensors();
    let first = small_model(&[("split.no", 0), ("split.count", 2)], &t[..2]);
    let second = small_model(&[("split.no", 1), ("split.count", 2)], &t[2..]);
    write(dir.path(), "m-00001-of-00002.gguf", &first);
    let p2 = write(dir.path(), "m-00002-of-00002.gguf", &second);
    let store = TensorStore::open(&p2).unwrap();
    assert_eq!(store.len(), 3);
    assert_eq!(store.paths().count(), 2);
    let c = store.tensor("c.weight").unwrap();
    assert!(c.path().ends_with("m-00002-of-00002.gguf"));
    assert_eq!(c.bytes().unwrap().len(), 68);
}

#[test]
fn missing_shard_is_named() {
    let err = plain_shards_error(3, &[0..1, 1..2]);
    assert!(
        matches!(&err, StoreError::MissingShard { index: 3, count: 3, missing, .. }
            if missing.ends_with("m-00003-of-00003.gguf")),
        "{err}"
    );
}

#[test]
fn tensor_in_two_shards_is_refused() {
    let err = plain_shards_error(2, &[0..2, 1..3]);
    assert!(
        matches!(&err, StoreError::DuplicateTensor { tensor, .. } if tensor == "b.weight"),
        "{err}"
    );
}

#[test]
fn shard_with_wrong_split_index_is_refused() {
    let t = default_tensors();
    let err = shard_error(&[
        (
            "m-00001-of-00002.gguf",
            small_model(&[("split.no", 1)], &t[..1]),
        ),
        ("m-00002-of-00002.gguf", small_model(&[], &t[1..])),
    ]);
    assert!(matches!(
        err,
        StoreError::ShardMismatch {
            key: "no",
            found: 1,
            expected: 0,
            ..
        }
    ));
}

#[test]
fn bad_file_error_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "junk.gguf", b"GGUF\x03\x00\x00\x00short");
    for mode in [LoadMode::Mmap, LoadMode::Read] {
        let err = TensorStore::open_with(&path, mode).err().unwrap();
        assert!(matches!(err, StoreError::Format { .. }), "{err}");
        assert!(err.to_string().contains("junk.gguf"), "{err}");
    }
    let missing = dir.path().join("absent.gguf");
    let err = TensorStore::open(&missing).err().unwrap();
    assert!(matches!(err, StoreError::Io { .. }) && err.to_string().contains("absent.gguf"));
}

#[test]
fn reads_past_a_tensor_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "m.gguf", &small_model(&[], &default_tensors()));
    let store = TensorStore::open(&path).unwrap();
    let c = store.tensor("c.weight").unwrap();
    let mut buf = [0u8; 8];
    assert!(matches!(
        c.read_into(64, &mut buf),
        Err(StoreError::ReadOutOfRange { size: 68, .. })
    ));
    assert!(matches!(
        c.read_into(u64::MAX, &mut buf),
        Err(StoreError::ReadOutOfRange { .. })
    ));
    assert!(matches!(
        store.tensor("nope"),
        Err(StoreError::NoSuchTensor { .. })
    ));
}

#[test]
fn a_file_that_grew_or_shrank_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "m.gguf", &small_model(&[], &default_tensors()));
    let store = TensorStore::open_with(&path, LoadMode::Read).unwrap();
    store.check_unchanged().unwrap();
    let f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.set_len(f.metadata().unwrap().len() + 1).unwrap();
    assert!(matches!(
        store.check_unchanged(),
        Err(StoreError::FileChanged { .. })
    ));
}

#[test]
fn handles_outlive_the_store_value() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "m.gguf", &small_model(&[], &default_tensors()));
    let handle = TensorStore::open(&path)
        .unwrap()
        .tensor("a.weight")
        .unwrap();
    assert_eq!(handle.bytes().unwrap().len(), 256);
}
