//! The device cache on a real GPU ([`HipTarget`]): uploads read back byte for byte, one
//! arena allocation for the whole model, and a full arena reported as out of memory.
//!
//! Each test prints `SKIPPED <test>: <reason>` on stderr and passes when the build has no
//! GPU platform or the machine has no device; without a GPU the same cache code is
//! covered by the host-memory tests beside these.

use hip_backend::device_or_skip;
use tensor_store::device::{CacheConfig, DeviceCache, HipTarget, UploadMode, UploadOrder};
use tensor_store::{StoreError, TensorHandle};

use super::device_cache::{model, Model};

fn read_back(cache: &DeviceCache<HipTarget>, h: &TensorHandle) -> Vec<u8> {
    let tensor = cache.get(h).unwrap();
    let stream = cache.target().device().new_stream().unwrap();
    let mut host = vec![0u8; tensor.size() as usize];
    stream
        .read_to_host(tensor.buffer().bytes(), &mut host)
        .unwrap();
    host
}

fn arena_for(m: &Model) -> u64 {
    HipTarget::arena_bytes_for(m.store.tensors().map(|t| t.size()))
}

#[test]
fn gpu_uploads_read_back_byte_for_byte_from_one_arena() {
    let Some(device) = device_or_skip("gpu_uploads_read_back_byte_for_byte_from_one_arena") else {
        return;
    };
    let m = model(6, 300_000);
    let target = HipTarget::new(&device, arena_for(&m)).unwrap();
    let config = CacheConfig {
        mode: UploadMode::Eager,
        readers: 3,
        staging_buffers: 4,
        chunk_bytes: 128 << 10,
        ..CacheConfig::default()
    };
    let cache =
        DeviceCache::new(target, &m.store, UploadOrder::file_order(&m.store), config).unwrap();
    for h in m.store.tensors() {
        assert_eq!(read_back(&cache, &h), h.bytes().unwrap(), "{}", h.name());
    }
    assert_eq!(
        cache.target().allocation_counters().device_allocations,
        1,
        "one arena for the model"
    );
    assert_eq!(cache.stats().uploads, 14);
}

#[test]
fn a_full_gpu_arena_is_out_of_memory_and_the_cache_recovers() {
    let Some(device) = device_or_skip("a_full_gpu_arena_is_out_of_memory_and_the_cache_recovers")
    else {
        return;
    };
    let m = model(2, 100_000);
    let all: Vec<TensorHandle> = m.store.tensors().collect();
    // Room for two tensors (each padded to the arena's alignment).
    let target = HipTarget::new(&device, HipTarget::arena_bytes_for([100_000, 100_000])).unwrap();
    let cache = DeviceCache::new(
        target,
        &m.store,
        UploadOrder::empty(),
        CacheConfig {
            mode: UploadMode::Lazy,
            ..CacheConfig::default()
        },
    )
    .unwrap();
    let held = [cache.get(&all[0]).unwrap(), cache.get(&all[1]).unwrap()];
    let error = cache.get(&all[2]).unwrap_err();
    assert!(
        matches!(error, StoreError::DeviceOutOfMemory { .. }),
        "expected out of memory, got {error}"
    );
    drop(held);
    assert_eq!(read_back(&cache, &all[2]), all[2].bytes().unwrap());
    assert_eq!(read_back(&cache, &all[0]), all[0].bytes().unwrap());
}
