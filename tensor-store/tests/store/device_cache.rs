//! The device cache and upload pipeline on host memory: the same code paths a GPU
//! takes, with the device side in [`HostTarget`].

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gguf_format::{GgmlType, GgufWriter};
use tensor_store::device::{
    CacheConfig, DeviceCache, DeviceTarget, HostBuffer, HostStaging, HostTarget, Progress,
    StagingRing, UploadMode, UploadOrder,
};
use tensor_store::{LoadMode, StoreError, TensorHandle, TensorStore};

#[path = "device_cache/staging_ring.rs"]
mod staging_ring;
#[path = "device_cache/stop.rs"]
mod stop;

/// A model of `layers` blocks of two tensors each, between an embedding and an output
/// tensor, each `size` bytes of I8 with bytes of its own.
pub(super) struct Model {
    _dir: tempfile::TempDir,
    pub(super) path: PathBuf,
    pub(super) store: TensorStore,
}

fn tensor_bytes(i: usize, size: u64) -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64 ^ (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d);
    (0..size)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

pub(super) fn model(layers: usize, size: u64) -> Model {
    model_with(layers, size, LoadMode::Mmap)
}

fn model_with(layers: usize, size: u64, mode: LoadMode) -> Model {
    let mut names = vec!["token_embd.weight".to_owned()];
    for l in 0..layers {
        names.push(format!("blk.{l}.attn.weight"));
        names.push(format!("blk.{l}.ffn.weight"));
    }
    names.push("output.weight".to_owned());
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    for name in &names {
        w.add_tensor(name, GgmlType::I8, &[size]).unwrap();
    }
    let data: Vec<Vec<u8>> = (0..names.len()).map(|i| tensor_bytes(i, size)).collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, w.to_bytes(&refs).unwrap()).unwrap();
    let store = TensorStore::open_with(&path, mode).unwrap();
    Model {
        _dir: dir,
        path,
        store,
    }
}

fn config(mode: UploadMode) -> CacheConfig {
    CacheConfig {
        mode,
        readers: 2,
        staging_buffers: 4,
        chunk_bytes: 8192,
        ..CacheConfig::default()
    }
}

/// A lazy cache of `m` on `target`, with [`config`]'s settings and no upload order.
fn lazy_cache<T: DeviceTarget>(target: T, m: &Model) -> DeviceCache<T> {
    DeviceCache::new(
        target,
        &m.store,
        UploadOrder::empty(),
        config(UploadMode::Lazy),
    )
    .unwrap()
}

/// [`lazy_cache`] on the host, holding at most `budget` bytes.
fn budgeted_cache(m: &Model, budget: u64) -> DeviceCache<HostTarget> {
    let cfg = CacheConfig {
        budget: Some(budget),
        ..config(UploadMode::Lazy)
    };
    DeviceCache::new(HostTarget::new(), &m.store, UploadOrder::empty(), cfg).unwrap()
}

/// A cache of `m` on `target` in `mode`, with [`config`]'s settings, uploading in the
/// file's order.
fn cache_in_file_order<T: DeviceTarget>(target: T, m: &Model, mode: UploadMode) -> DeviceCache<T> {
    ordered_cache(target, m, config(mode))
}

/// A cache of `m` on `target` with `cfg`, uploading in the file's order.
fn ordered_cache<T: DeviceTarget>(target: T, m: &Model, cfg: CacheConfig) -> DeviceCache<T> {
    DeviceCache::new(target, &m.store, UploadOrder::file_order(&m.store), cfg).unwrap()
}

fn handles(m: &Model) -> Vec<TensorHandle> {
    m.store.tensors().collect()
}

/// The bytes the file holds for a tensor, read independently of the cache.
fn file_bytes(m: &Model, h: &TensorHandle) -> Vec<u8> {
    let all = std::fs::read(&m.path).unwrap();
    let r = h.file_range();
    all[r.start as usize..r.end as usize].to_vec()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn eager_upload_puts_every_tensor_on_the_device_byte_for_byte() {
    // Tensors of 20000 bytes in chunks of 8192: split tensors and joined neighbours.
    let m = model(4, 20_000);
    let cache = cache_in_file_order(HostTarget::new(), &m, UploadMode::Eager);
    let progress = cache.progress();
    assert!(progress.is_complete());
    assert_eq!(progress.bytes_done, 10 * 20_000);
    for h in handles(&m) {
        assert!(cache.is_resident(&h), "{}", h.name());
        let tensor = cache.get(&h).unwrap();
        assert_eq!(
            tensor.buffer().as_slice(),
            &file_bytes(&m, &h)[..],
            "{}",
            h.name()
        );
    }
    let stats = cache.stats();
    assert_eq!(
        (stats.uploads, stats.evictions, stats.loading_bytes),
        (10, 0, 0)
    );
    assert_eq!(stats.uploaded_bytes, 10 * 20_000);
    assert_eq!(cache.target().stats().allocations, 10);
}

#[test]
fn single_flight_under_a_many_thread_hammer() {
    let m = model(8, 3000);
    let target = HostTarget::new().with_copy_delay(Duration::from_micros(200));
    let cache = lazy_cache(target, &m);
    let all = handles(&m);
    let seen: Vec<Vec<_>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..16)
            .map(|t| {
                let (cache, all) = (&cache, &all);
                s.spawn(move || {
                    let mut got = Vec::new();
                    for round in 0..3 {
                        // A different order per thread and round.
                        for k in 0..all.len() {
                            let h = &all[(k * 7 + t * 5 + round) % all.len()];
                            got.push(cache.get(h).unwrap());
                        }
                    }
                    got
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    // One upload per tensor, however many asked; everyone holds the same buffer.
    assert_eq!(cache.target().stats().allocations, all.len() as u64);
    assert_eq!(cache.stats().uploads, all.len() as u64);
    let first: Vec<_> = all.iter().map(|h| cache.get(h).unwrap()).collect();
    for got in seen.iter().flatten() {
        let same = &first[got.handle().index()];
        assert!(got.same_upload(same), "{} uploaded twice", got.name());
    }
    for (h, t) in all.iter().zip(&first) {
        assert_eq!(t.buffer().as_slice(), &file_bytes(&m, h)[..]);
    }
}

#[test]
fn async_requests_share_one_upload_and_never_block_the_runtime() {
    let m = model(6, 5000);
    let target = HostTarget::new().with_copy_delay(Duration::from_micros(300));
    let cache = Arc::new(cache_in_file_order(target, &m, UploadMode::Lazy));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let all = handles(&m);
    let results = runtime.block_on(async {
        let mut tasks = Vec::new();
        for t in 0..64 {
            let cache = Arc::clone(&cache);
            let h = all[t % all.len()].clone();
            tasks.push(tokio::spawn(async move {
                // Interleave with other work on the same two workers.
                tokio::task::yield_now().await;
                cache.get_async(&h).await
            }));
        }
        let group = cache
            .get_group_async(cache.order().layer_group(3).unwrap())
            .await;
        let mut out = Vec::new();
        for task in tasks {
            out.push(task.await.unwrap().unwrap());
        }
        (out, group.unwrap())
    });
    let (tensors, group) = results;
    assert_eq!(group.len(), 2);
    assert_eq!(group[0].name(), "blk.3.attn.weight");
    assert_eq!(cache.target().stats().allocations, all.len() as u64);
    for t in &tensors {
        assert_eq!(t.buffer().as_slice(), &file_bytes(&m, t.handle())[..]);
        let again = cache.get(t.handle()).unwrap();
        assert!(again.same_upload(t));
    }
}

#[test]
fn the_budget_evicts_the_least_recently_used_and_evicted_tensors_upload_again() {
    let m = model(3, 4096);
    let all = handles(&m);
    let cache = budgeted_cache(&m, 3 * 4096);
    let (a, b, c, d) = (&all[0], &all[1], &all[2], &all[3]);
    for h in [a, b, c] {
        cache.get(h).unwrap();
    }
    cache.get(a).unwrap(); // a is now more recent than b
    let got_d = cache.get(d).unwrap();
    assert_eq!(got_d.buffer().as_slice(), &file_bytes(&m, d)[..]);
    assert!(!cache.is_resident(b), "b was the least recently used");
    assert!(cache.is_resident(a) && cache.is_resident(c));
    assert_eq!(cache.stats().evictions, 1);
    // b comes back, pushing out c (a and d are more recent).
    let got_b = cache.get(b).unwrap();
    assert_eq!(got_b.buffer().as_slice(), &file_bytes(&m, b)[..]);
    assert!(!cache.is_resident(c));
    let stats = cache.stats();
    assert_eq!((stats.uploads, stats.evictions), (5, 2));
    assert_eq!(stats.reserved_bytes, 3 * 4096);
    assert_eq!(cache.target().stats().live_bytes, 3 * 4096);
}

#[test]
fn the_counters_move_with_hits_misses_evictions_and_uploaded_bytes() {
    let m = model(2, 4096);
    let all = handles(&m);
    let cache = budgeted_cache(&m, 2 * 4096);
    let stats = cache.stats();
    assert_eq!(
        (
            stats.hits,
            stats.misses,
            stats.evictions,
            stats.uploaded_bytes
        ),
        (0, 0, 0, 0)
    );
    let (a, b, c) = (&all[0], &all[1], &all[2]);
    cache.get(a).unwrap(); // miss: uploads a
    cache.get(a).unwrap(); // hit
    cache.get(b).unwrap(); // miss: uploads b, the budget is now full
    cache.get(c).unwrap(); // miss: evicts a, uploads c
    cache.get(a).unwrap(); // miss: evicts b, uploads a again
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses), (1, 4), "{stats:?}");
    assert_eq!((stats.uploads, stats.evictions), (4, 2), "{stats:?}");
    assert_eq!(stats.uploaded_bytes, 4 * 4096, "{stats:?}");
    assert_eq!(stats.resident_bytes, 2 * 4096, "{stats:?}");
}

#[test]
fn tensors_in_use_are_not_evicted_and_out_of_memory_leaves_the_cache_usable() {
    let m = model(2, 4096);
    let all = handles(&m);
    let cache = budgeted_cache(&m, 2 * 4096 + 100);
    let held_a = cache.get(&all[0]).unwrap();
    let held_b = cache.get(&all[1]).unwrap();
    let error = cache.get(&all[2]).unwrap_err();
    match &error {
        StoreError::DeviceOutOfMemory {
            tensor,
            requested: 4096,
            in_use: 8192,
            loading: 0,
            ..
        } => assert_eq!(tensor, all[2].name()),
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert!(error.is_out_of_memory());
    assert!(cache.is_resident(&all[0]) && cache.is_resident(&all[1]));
    let stats = cache.stats();
    assert_eq!((stats.reserved_bytes, stats.loading_bytes), (8192, 0));
    // Once a tensor is let go, the same request succeeds.
    drop(held_a);
    let c = cache.get(&all[2]).unwrap();
    assert_eq!(c.buffer().as_slice(), &file_bytes(&m, &all[2])[..]);
    assert!(!cache.is_resident(&all[0]));
    assert!(cache.get(&all[1]).unwrap().same_upload(&held_b));
}

#[test]
fn device_allocation_failures_evict_first_and_then_report_out_of_memory() {
    let m = model(2, 4096);
    let all = handles(&m);
    // No budget, but a device with room for two tensors.
    let target = HostTarget::new().with_capacity(2 * 4096);
    let cache = lazy_cache(target, &m);
    cache.get(&all[0]).unwrap();
    let held = cache.get(&all[1]).unwrap();
    let c = cache.get(&all[2]).unwrap();
    assert!(!cache.is_resident(&all[0]), "the unused tensor made room");
    let err = cache.get(&all[3]).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    drop((held, c));
    assert!(cache.get(&all[3]).is_ok());
    assert_eq!(cache.target().stats().live_bytes, 2 * 4096);
}

#[test]
fn a_tensor_larger_than_the_budget_fails_without_evicting_anything() {
    let m = model(1, 4096);
    let all = handles(&m);
    let cache = budgeted_cache(&m, 4096 + 4095);
    cache.get(&all[0]).unwrap();
    // Two tensors requested together do not fit, but each alone does.
    let error = cache.get_many([&all[1], &all[2]]).unwrap_err();
    assert!(error.is_out_of_memory(), "{error}");
    let small = budgeted_cache(&m, 100);
    assert!(small.get(&all[0]).unwrap_err().is_out_of_memory());
    assert_eq!(small.stats().evictions, 0);
    assert_eq!(small.target().stats().allocations, 0);
}

#[test]
fn cancellation_publishes_nothing_half_uploaded() {
    // 64 KiB tensors in 4 KiB chunks, each copy slowed: a load takes a while.
    let m = model(8, 65_536);
    let target = HostTarget::new().with_copy_delay(Duration::from_millis(1));
    let cfg = CacheConfig {
        chunk_bytes: 4096,
        ..config(UploadMode::Background)
    };
    let cache = ordered_cache(target, &m, cfg);
    wait_until("a first tensor", || cache.progress().tensors_done >= 1);
    let all = handles(&m);
    let last = all.last().unwrap().clone();
    let waiter = std::thread::scope(|s| {
        let waiting = s.spawn(|| cache.get(&last));
        std::thread::sleep(Duration::from_millis(5));
        cache.cancel();
        waiting.join().unwrap()
    });
    match waiter {
        Ok(tensor) => assert_eq!(tensor.buffer().as_slice(), &file_bytes(&m, &last)[..]),
        Err(StoreError::LoadCancelled { tensor }) => assert_eq!(tensor, last.name()),
        Err(other) => panic!("unexpected {other}"),
    }
    // Everything resident is whole; nothing is left loading; every abandoned buffer is
    // gone.
    let stats = cache.stats();
    assert_eq!(stats.loading_bytes, 0);
    assert_eq!(stats.reserved_bytes, stats.resident_bytes);
    assert_eq!(cache.target().stats().live_bytes, stats.resident_bytes);
    let resident: Vec<_> = all.iter().filter(|h| cache.is_resident(h)).collect();
    assert!(
        !resident.is_empty() && resident.len() < all.len(),
        "{} resident",
        resident.len()
    );
    for h in &resident {
        assert_eq!(
            cache.get(h).unwrap().buffer().as_slice(),
            &file_bytes(&m, h)[..]
        );
    }
    assert_eq!(cache.progress().tensors_done, resident.len());
    // The cache still works: what was cancelled uploads on request.
    let missing = all.iter().find(|h| !cache.is_resident(h)).unwrap();
    let got = cache.get(missing).unwrap();
    assert_eq!(got.buffer().as_slice(), &file_bytes(&m, missing)[..]);
}

#[test]
fn progress_counts_tensors_bytes_and_groups() {
    let m = model(5, 10_000);
    let seen: Arc<Mutex<Vec<Progress>>> = Arc::default();
    let log = Arc::clone(&seen);
    let cache = DeviceCache::with_progress(
        HostTarget::new(),
        &m.store,
        UploadOrder::file_order(&m.store),
        config(UploadMode::Eager),
        move |p| log.lock().unwrap().push(*p),
    )
    .unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 12);
    for (n, p) in seen.iter().enumerate() {
        assert_eq!(p.tensors_done, n + 1);
        assert_eq!(p.bytes_done, (n as u64 + 1) * 10_000);
        assert_eq!(
            (p.tensors_total, p.bytes_total, p.groups_total),
            (12, 120_000, 7)
        );
    }
    let groups: Vec<usize> = seen.iter().filter_map(|p| p.completed_group).collect();
    let mut sorted = groups.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        (0..7).collect::<Vec<_>>(),
        "each group completes once"
    );
    assert_eq!(cache.progress().groups_done, 7);
    assert_eq!(cache.order().groups()[0].name, "input");
    assert_eq!(cache.order().groups()[6].name, "output");
}

#[test]
fn a_request_moves_a_tensor_to_the_front() {
    let m = model(12, 16_384);
    let target = HostTarget::new().with_copy_delay(Duration::from_millis(5));
    let cfg = CacheConfig {
        readers: 1,
        staging_buffers: 4,
        chunk_bytes: 4096,
        ..config(UploadMode::Background)
    };
    let cache = ordered_cache(target, &m, cfg);
    let last = handles(&m).pop().unwrap();
    let before = cache.progress().tensors_done;
    let got = cache.get(&last).unwrap();
    // The one reader finishes at most the tensor it had started (20 ms of copies), then
    // takes this one; the background order would have reached it after 25 others.
    let done = cache.progress().tensors_done - before;
    assert!(
        done <= 3,
        "{done} tensors were uploaded between the request and the requested one"
    );
    assert_eq!(got.buffer().as_slice(), &file_bytes(&m, &last)[..]);
    cache.wait_idle().unwrap();
    assert!(cache.progress().is_complete());
}

#[test]
fn lazy_mode_uploads_only_what_is_asked_for() {
    let m = model(4, 4096);
    let cache = cache_in_file_order(HostTarget::new(), &m, UploadMode::Lazy);
    cache.wait_idle().unwrap();
    assert_eq!(cache.stats().uploads, 0);
    let group = cache.order().layer_group(2).unwrap();
    let tensors = cache.get_group(group).unwrap();
    let names: HashSet<&str> = tensors.iter().map(|t| t.name()).collect();
    assert_eq!(
        names,
        HashSet::from(["blk.2.attn.weight", "blk.2.ffn.weight"])
    );
    let resident: Vec<_> = handles(&m)
        .into_iter()
        .filter(|h| cache.is_resident(h))
        .collect();
    assert_eq!(resident.len(), 2);
    assert_eq!(cache.progress().groups_done, 1);
}

#[test]
fn a_model_larger_than_the_budget_still_runs_layer_by_layer() {
    let m = model(6, 8192);
    let all = handles(&m);
    let cfg = CacheConfig {
        budget: Some(5 * 8192),
        ..config(UploadMode::Background)
    };
    let cache = ordered_cache(HostTarget::new(), &m, cfg);
    cache.wait_idle().unwrap();
    // The background upload stops at the budget; it never evicts.
    assert_eq!(cache.stats().evictions, 0);
    assert_eq!(cache.progress().tensors_done, 5);
    // A forward pass over every group still gets every tensor, evicting as it goes.
    for pass in 0..2 {
        for group in 0..cache.order().groups().len() {
            for t in cache.get_group(group).unwrap() {
                assert_eq!(
                    t.buffer().as_slice(),
                    &file_bytes(&m, t.handle())[..],
                    "pass {pass}"
                );
            }
        }
    }
    let stats = cache.stats();
    assert!(stats.evictions >= all.len() as u64, "{stats:?}");
    assert!(stats.reserved_bytes <= 5 * 8192);
}

#[test]
fn a_failed_read_fails_its_requests_and_not_the_cache() {
    let m = model_with(3, 8192, LoadMode::Read);
    let all = handles(&m);
    // Cut the file inside the last tensor.
    let cut = all.last().unwrap().file_range().start + 100;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&m.path)
        .unwrap();
    file.set_len(cut).unwrap();
    let cache = lazy_cache(HostTarget::new(), &m);
    let error = cache.get(all.last().unwrap()).unwrap_err();
    assert!(matches!(error.root(), StoreError::Io { .. }), "{error}");
    cache.wait_idle().unwrap();
    let stats = cache.stats();
    assert_eq!((stats.loading_bytes, stats.resident_bytes), (0, 0));
    assert_eq!(
        cache.target().stats().live_bytes,
        0,
        "the failed buffer was dropped"
    );
    let first = cache.get(&all[0]).unwrap();
    assert_eq!(first.buffer().as_slice(), &tensor_bytes(0, 8192)[..]);
}

#[test]
fn direct_reads_give_the_same_bytes() {
    let m = model(3, 12_345);
    let cfg = CacheConfig {
        direct_io: true,
        ..config(UploadMode::Eager)
    };
    let cache = ordered_cache(HostTarget::new(), &m, cfg);
    for h in handles(&m) {
        assert_eq!(
            cache.get(&h).unwrap().buffer().as_slice(),
            &file_bytes(&m, &h)[..]
        );
    }
}

#[test]
fn foreign_handles_and_bad_settings_are_refused() {
    let m = model(1, 4096);
    let other = model(2, 4096);
    let cache = lazy_cache(HostTarget::new(), &m);
    let foreign = other.store.tensor("blk.1.attn.weight").unwrap();
    assert!(matches!(
        cache.get(&foreign),
        Err(StoreError::ForeignTensor { .. })
    ));
    assert!(matches!(
        DeviceCache::new(
            HostTarget::new(),
            &m.store,
            UploadOrder::file_order(&other.store),
            config(UploadMode::Lazy)
        ),
        Err(StoreError::ForeignTensor { .. })
    ));
    let with = |change: fn(&mut CacheConfig)| {
        let mut cfg = CacheConfig::default();
        change(&mut cfg);
        cfg
    };
    for (cfg, name) in [
        (with(|c| c.readers = 0), "readers"),
        (with(|c| c.cold_readers = 300), "cold_readers"),
        (with(|c| c.staging_buffers = 0), "staging_buffers"),
        (with(|c| c.chunk_bytes = 100), "chunk_bytes"),
    ] {
        match DeviceCache::new(HostTarget::new(), &m.store, UploadOrder::empty(), cfg) {
            Err(StoreError::InvalidCacheConfig { name: found, .. }) => assert_eq!(found, name),
            other => panic!("expected a refused {name}, got {:?}", other.err()),
        }
    }
}
