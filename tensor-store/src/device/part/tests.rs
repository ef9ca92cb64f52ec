//! Parts of tensors uploaded to host memory, checked against the bytes written to the
//! file.

use std::path::PathBuf;

use gguf_format::{GgmlType, GgufWriter};

use super::*;
use crate::device::{HostTarget, HostTargetStats};
use crate::{LoadMode, TensorStore};

/// A Q8_0 matrix of 96 columns (three blocks of 34 bytes: rows of 102 bytes) × 10 rows.
const Q: &str = "blk.0.ffn_down.weight";
/// An F32 vector of 40 elements: one row of 160 bytes.
const F: &str = "blk.0.attn_norm.weight";
/// An F16 tensor of 64 × 3 × 2: six rows of 128 bytes.
const H: &str = "blk.0.attn_k.weight";

struct Model {
    _dir: tempfile::TempDir,
    path: PathBuf,
    /// Each tensor's name, bytes and bytes per row, as written.
    tensors: Vec<(&'static str, Vec<u8>, u64)>,
}

impl Model {
    fn new() -> Model {
        let decls: [(&str, GgmlType, &[u64], u64); 3] = [
            (Q, GgmlType::Q8_0, &[96, 10], 102),
            (F, GgmlType::F32, &[40], 160),
            (H, GgmlType::F16, &[64, 3, 2], 128),
        ];
        let mut writer = GgufWriter::new();
        writer
            .add_metadata("general.architecture", "llama")
            .unwrap();
        for (name, ty, shape, _) in &decls {
            writer.add_tensor(name, *ty, shape).unwrap();
        }
        let tensors: Vec<(&str, Vec<u8>, u64)> = decls
            .iter()
            .zip(writer.tensors())
            .enumerate()
            .map(|(i, ((name, _, _, row_bytes), decl))| {
                let bytes = (0..decl.size)
                    .map(|b| (b as u8).wrapping_mul(31).wrapping_add(b as u8 >> 3) ^ (i as u8))
                    .collect();
                (*name, bytes, *row_bytes)
            })
            .collect();
        let data: Vec<&[u8]> = tensors.iter().map(|(_, b, _)| b.as_slice()).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, writer.to_bytes(&data).unwrap()).unwrap();
        Model {
            _dir: dir,
            path,
            tensors,
        }
    }

    fn open(&self, mode: LoadMode) -> TensorStore {
        TensorStore::open_with(&self.path, mode).unwrap()
    }

    /// The part's bytes gathered from the bytes written: its rows in order, each its
    /// byte range of that row.
    fn expected(&self, name: &str, part: &TensorPart) -> Vec<u8> {
        let (_, bytes, row_bytes) = self.tensors.iter().find(|t| t.0 == name).unwrap();
        part.rows
            .clone()
            .flat_map(|row| {
                let start = (row * row_bytes + part.bytes.start) as usize;
                let end = (row * row_bytes + part.bytes.end) as usize;
                bytes[start..end].iter().copied()
            })
            .collect()
    }
}

/// Uploads `part` of `name` with staging buffers of at most `limit` bytes: the bytes on
/// the device and what the target did.
fn upload(
    store: &TensorStore,
    name: &str,
    part: &TensorPart,
    limit: usize,
) -> (Vec<u8>, HostTargetStats) {
    let target = HostTarget::new();
    let handle = store.tensor(name).unwrap();
    let tensor = upload_part_with(&target, &handle, part, limit).unwrap();
    assert_eq!(tensor.name(), name);
    assert_eq!(tensor.size(), part.len());
    assert_eq!(tensor.part(), Some(part));
    assert_eq!(tensor.buffer().as_slice().len() as u64, part.len());
    (tensor.buffer().as_slice().to_vec(), target.stats())
}

/// Parts of rows only, of columns only, of both, and whole tensors, of each tensor.
fn parts(store: &TensorStore) -> Vec<(&'static str, TensorPart)> {
    let part = |name: &str, rows, cols| TensorPart::of(&store.tensor(name).unwrap(), rows, cols);
    vec![
        (Q, part(Q, 3..7, 0..96).unwrap()),
        (Q, part(Q, 0..10, 32..64).unwrap()),
        (Q, part(Q, 2..9, 64..96).unwrap()),
        (Q, part(Q, 4..5, 0..64).unwrap()),
        (Q, part(Q, 0..10, 0..96).unwrap()),
        (F, part(F, 0..1, 8..24).unwrap()),
        (F, part(F, 0..1, 0..40).unwrap()),
        (H, part(H, 1..5, 0..64).unwrap()),
        (H, part(H, 0..6, 16..48).unwrap()),
        (H, part(H, 0..6, 0..64).unwrap()),
    ]
}

#[test]
fn of_turns_columns_into_the_bytes_of_their_blocks() {
    let model = Model::new();
    let store = model.open(LoadMode::Mmap);
    let q = store.tensor(Q).unwrap();
    let part = TensorPart::of(&q, 2..5, 32..64).unwrap();
    assert_eq!(
        part,
        TensorPart {
            rows: 2..5,
            bytes: 34..68
        }
    );
    assert_eq!(part.len(), 3 * 34);
    let whole = TensorPart::of(&q, 0..10, 0..96).unwrap();
    assert_eq!(whole.len(), q.size());
    let f = store.tensor(F).unwrap();
    assert_eq!(TensorPart::of(&f, 0..1, 8..24).unwrap().bytes, 32..96);
    let h = store.tensor(H).unwrap();
    assert_eq!(TensorPart::of(&h, 5..6, 0..64).unwrap().bytes, 0..128);
}

#[test]
fn parts_of_rows_columns_both_and_whole_tensors_hold_the_file_bytes() {
    let model = Model::new();
    let store = model.open(LoadMode::Mmap);
    assert!(store.is_mapped());
    for (name, part) in parts(&store) {
        let (bytes, stats) = upload(&store, name, &part, PART_STAGING_BYTES);
        assert_eq!(bytes, model.expected(name, &part), "{name} {part:?}");
        // Small parts fit in one staging buffer: one copy.
        assert_eq!(stats.copies, 1, "{name} {part:?}");
        assert_eq!(stats.copied_bytes, part.len());
        assert_eq!(stats.allocations, 1);
    }
}

#[test]
fn an_unmapped_store_gives_the_same_bytes() {
    let model = Model::new();
    let store = model.open(LoadMode::Read);
    assert!(!store.is_mapped());
    for (name, part) in parts(&store) {
        for limit in [PART_STAGING_BYTES, 100] {
            let (bytes, _) = upload(&store, name, &part, limit);
            assert_eq!(
                bytes,
                model.expected(name, &part),
                "{name} {part:?} {limit}"
            );
        }
    }
}

#[test]
fn parts_larger_than_a_staging_buffer_give_the_same_bytes() {
    let model = Model::new();
    let store = model.open(LoadMode::Mmap);
    for (name, part) in parts(&store) {
        for limit in [1, 7, 33, 34, 100, 250, 1019] {
            let (bytes, stats) = upload(&store, name, &part, limit);
            assert_eq!(
                bytes,
                model.expected(name, &part),
                "{name} {part:?} {limit}"
            );
            assert_eq!(stats.copied_bytes, part.len());
        }
    }
}

#[test]
fn staging_buffers_hold_whole_rows_of_the_part_when_one_fits() {
    let model = Model::new();
    let store = model.open(LoadMode::Mmap);
    let q = store.tensor(Q).unwrap();
    let copies = |rows, cols, limit| {
        let part = TensorPart::of(&q, rows, cols).unwrap();
        let (bytes, stats) = upload(&store, Q, &part, limit);
        assert_eq!(bytes, model.expected(Q, &part));
        stats.copies
    };
    // Rows of 34 bytes: two to a buffer of 100 bytes.
    assert_eq!(copies(0..10, 32..64, 100), 5);
    // Rows of 68 bytes: one to a buffer of 100 bytes.
    assert_eq!(copies(0..10, 0..64, 100), 10);
    // Rows of 34 bytes larger than a buffer of 30: two pieces each.
    assert_eq!(copies(0..10, 32..64, 30), 20);
    // Whole rows are one run of 1020 bytes: buffers filled completely.
    assert_eq!(copies(0..10, 0..96, 100), 11);
    assert_eq!(copies(0..10, 0..96, 1020), 1);
}

#[test]
fn parts_off_blocks_or_out_of_range_are_refused_naming_the_tensor() {
    let model = Model::new();
    let store = model.open(LoadMode::Mmap);
    let q = store.tensor(Q).unwrap();
    let f = store.tensor(F).unwrap();
    let refused = |handle: &TensorHandle, rows, cols, needle: &str| {
        let error = TensorPart::of(handle, rows, cols).unwrap_err();
        let StoreError::BadPart { tensor, reason } = &error else {
            panic!("not BadPart: {error}");
        };
        assert_eq!(tensor, handle.name());
        assert!(reason.contains(needle), "{reason:?} lacks {needle:?}");
        assert!(error.to_string().contains(handle.name()), "{error}");
    };
    refused(&q, 0..10, 16..48, "columns 16..48");
    refused(&q, 0..10, 0..40, "columns 0..40");
    refused(&q, 0..10, 64..128, "columns 64..128");
    refused(&q, 8..12, 0..96, "rows 8..12");
    refused(&q, 3..3, 0..96, "rows 3..3");
    refused(&q, 0..1, 32..32, "columns 32..32");
    refused(&f, 0..1, 30..50, "columns 30..50");
    refused(&f, 0..2, 0..40, "rows 0..2");

    // A part built by hand is checked as well, before anything is allocated.
    let target = HostTarget::new();
    for (rows, bytes, needle) in [
        (0..10, 10..44, "bytes 10..44"),
        (0..10, 0..204, "bytes 0..204"),
        (0..11, 0..34, "rows 0..11"),
        (0..10, 0..0, "bytes 0..0"),
    ] {
        let part = TensorPart { rows, bytes };
        let error = upload_part(&target, &q, &part).unwrap_err();
        assert!(
            matches!(&error, StoreError::BadPart { tensor, reason }
                if tensor == Q && reason.contains(needle)),
            "{error}"
        );
    }
    let (start, end) = (5, 2);
    let reversed = TensorPart {
        rows: start..end,
        bytes: 0..34,
    };
    assert_eq!(reversed.len(), 0);
    let error = upload_part(&target, &q, &reversed).unwrap_err();
    assert!(error.to_string().contains("rows 5..2"), "{error}");
    assert_eq!(target.stats().allocations, 0);
}

#[test]
fn an_allocation_failure_is_returned_as_is() {
    let model = Model::new();
    let store = model.open(LoadMode::Mmap);
    let q = store.tensor(Q).unwrap();
    let part = TensorPart::of(&q, 0..10, 32..64).unwrap();
    let target = HostTarget::new().with_capacity(100);
    let error = upload_part(&target, &q, &part).unwrap_err();
    assert!(
        matches!(error, StoreError::DeviceAlloc { requested: 340, .. }),
        "{error}"
    );
    target.fail_allocation(1);
    let small = TensorPart::of(&q, 0..1, 32..64).unwrap();
    let error = upload_part(&target, &q, &small).unwrap_err();
    assert!(
        matches!(error, StoreError::DeviceAlloc { requested: 34, .. }),
        "{error}"
    );
    assert_eq!(target.stats().live_bytes, 0);
    // The target is still usable.
    let tensor = upload_part(&target, &q, &small).unwrap();
    assert_eq!(tensor.buffer().as_slice(), model.expected(Q, &small));
}

#[test]
fn a_whole_tensor_is_a_part_and_the_cache_kind_is_not() {
    let model = Model::new();
    let store = model.open(LoadMode::Mmap);
    let target = HostTarget::new();
    let h = store.tensor(H).unwrap();
    let whole = TensorPart::of(&h, 0..6, 0..64).unwrap();
    let part = upload_part(&target, &h, &whole).unwrap();
    assert_eq!(part.size(), h.size());
    assert_eq!(part.part(), Some(&whole));
    assert_eq!(part.buffer().as_slice(), h.bytes().unwrap());

    let buffer = target.alloc(h.size()).unwrap();
    let cached = DeviceTensor::<HostTarget>::new(h.clone(), buffer);
    assert_eq!(cached.part(), None);
    assert_eq!(cached.size(), h.size());
    assert_eq!(cached.name(), H);
}
