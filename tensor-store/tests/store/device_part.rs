//! Parts of tensors uploaded through the public API ([`upload_part`]): to host memory,
//! and to a GPU when the build has a GPU platform and the machine a device (otherwise
//! the GPU test prints `SKIPPED <test>: <reason>` on stderr and passes).

use gguf_format::{GgmlType, GgufWriter};
use hip_backend::device_or_skip;
use tensor_store::device::{upload_part, HipTarget, HostTarget, TensorPart, PART_STAGING_BYTES};
use tensor_store::{StoreError, TensorHandle, TensorStore};

/// A Q8_0 matrix of 4096 columns (rows of 4352 bytes) × `rows` rows, with bytes of its
/// own, in a temporary file.
fn matrix(rows: u64) -> (tempfile::TempDir, TensorStore) {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_tensor("blk.0.ffn_down.weight", GgmlType::Q8_0, &[4096, rows])
        .unwrap();
    let size = w.tensors()[0].size;
    let data: Vec<u8> = (0..size)
        .map(|b| (b ^ (b >> 9) ^ (b >> 17)) as u8)
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, w.to_bytes(&[&data]).unwrap()).unwrap();
    let store = TensorStore::open(&path).unwrap();
    (dir, store)
}

/// `part` of `handle` gathered from its bytes on the host.
fn gather(handle: &TensorHandle, part: &TensorPart) -> Vec<u8> {
    let all = handle.bytes().unwrap();
    let row_bytes = handle.size() / handle.shape()[1];
    part.rows
        .clone()
        .flat_map(|row| {
            let start = (row * row_bytes) as usize;
            all[start + part.bytes.start as usize..start + part.bytes.end as usize].to_vec()
        })
        .collect()
}

/// Parts of one device of four: a quarter of the rows, a quarter of the columns.
fn quarters(handle: &TensorHandle, rank: u64) -> [TensorPart; 2] {
    let rows = handle.shape()[1];
    let (r, c) = (rows / 4, 4096 / 4);
    [
        TensorPart::of(handle, rank * r..(rank + 1) * r, 0..4096).unwrap(),
        TensorPart::of(handle, 0..rows, rank * c..(rank + 1) * c).unwrap(),
    ]
}

#[test]
fn host_parts_of_a_tensor_parallel_split_hold_its_bytes() {
    let (_dir, store) = matrix(64);
    let handle = store.tensor("blk.0.ffn_down.weight").unwrap();
    let target = HostTarget::new();
    for rank in 0..4 {
        for part in quarters(&handle, rank) {
            let tensor = upload_part(&target, &handle, &part).unwrap();
            assert_eq!(tensor.name(), handle.name());
            assert_eq!(tensor.size(), part.len());
            assert_eq!(tensor.part(), Some(&part));
            assert_eq!(tensor.buffer().as_slice(), gather(&handle, &part));
        }
    }
    let error = TensorPart::of(&handle, 0..64, 100..200).unwrap_err();
    assert!(matches!(error, StoreError::BadPart { .. }), "{error}");
    assert!(
        error.to_string().contains("blk.0.ffn_down.weight"),
        "{error}"
    );
}

#[test]
fn gpu_parts_read_back_byte_for_byte() {
    let Some(device) = device_or_skip("gpu_parts_read_back_byte_for_byte") else {
        return;
    };
    // 8192 rows of 4352 bytes: 34 MiB, more than two staging buffers.
    let (_dir, store) = matrix(8192);
    let handle = store.tensor("blk.0.ffn_down.weight").unwrap();
    assert!(handle.size() > 2 * PART_STAGING_BYTES as u64);
    let target = HipTarget::new(&device, HipTarget::arena_bytes_for([handle.size(); 2])).unwrap();
    let stream = device.new_stream().unwrap();
    let whole = TensorPart::of(&handle, 0..8192, 0..4096).unwrap();
    let [rows, cols] = quarters(&handle, 1);
    for part in [whole, rows, cols] {
        let tensor = upload_part(&target, &handle, &part).unwrap();
        let mut host = vec![0u8; tensor.size() as usize];
        stream
            .read_to_host(tensor.buffer().bytes(), &mut host)
            .unwrap();
        assert!(host == gather(&handle, &part), "{part:?}");
    }
}
