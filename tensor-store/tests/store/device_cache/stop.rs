//! A stop flag and failed allocations: the cache cancels, reports and frees what it
//! took, and stays usable.

use super::*;

/// A stop flag for [`CacheConfig::stop`], and how to set it from another thread after
/// `delay`.
fn stop_after(delay: Duration) -> (Arc<AtomicBool>, std::thread::JoinHandle<Instant>) {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let setter = std::thread::spawn(move || {
        std::thread::sleep(delay);
        flag.store(true, Ordering::Relaxed);
        Instant::now()
    });
    (stop, setter)
}

/// How long a stop may take to be honoured here: a poll of the flag, the copy a reader
/// has in hand (1 ms), and slack for a loaded test machine.
const PROMPT: Duration = Duration::from_millis(500);

#[test]
fn dropping_the_cache_mid_upload_waits_for_the_copies_and_frees_every_buffer() {
    let m = model(8, 65_536);
    let target = HostTarget::new().with_copy_delay(Duration::from_millis(1));
    let device = target.clone();
    let cfg = CacheConfig {
        chunk_bytes: 4096,
        ..config(UploadMode::Background)
    };
    let cache = DeviceCache::new(target, &m.store, UploadOrder::file_order(&m.store), cfg).unwrap();
    wait_until("a first tensor", || cache.progress().tensors_done >= 1);
    assert!(
        !cache.progress().is_complete(),
        "the upload is still running"
    );
    let held = cache.get(&handles(&m)[0]).unwrap();
    let start = Instant::now();
    drop(cache);
    assert!(start.elapsed() < PROMPT, "drop took {:?}", start.elapsed());
    // A tensor still held outlives the cache; nothing else does.
    assert_eq!(device.stats().live_bytes, held.size());
    drop(held);
    assert_eq!(device.stats().live_bytes, 0);
}

#[test]
fn a_stop_flag_interrupts_an_eager_load_promptly_and_leaks_nothing() {
    // 10 × 64 KiB in 4 KiB chunks at 1 ms each: about 160 ms of copies per reader.
    let m = model(8, 65_536);
    let target = HostTarget::new().with_copy_delay(Duration::from_millis(1));
    let device = target.clone();
    let (stop, setter) = stop_after(Duration::from_millis(20));
    let cfg = CacheConfig {
        chunk_bytes: 4096,
        stop: Some(stop),
        ..config(UploadMode::Eager)
    };
    let result = DeviceCache::new(target, &m.store, UploadOrder::file_order(&m.store), cfg);
    let returned = Instant::now();
    let stopped_at = setter.join().unwrap();
    match result {
        Err(StoreError::Interrupted) => {}
        Err(other) => panic!("expected an interruption, got {other}"),
        Ok(_) => panic!("the eager load ignored the stop flag"),
    }
    let late = returned.saturating_duration_since(stopped_at);
    assert!(late < PROMPT, "stopped {late:?} after the flag");
    assert!(device.stats().copies > 0, "the flag came during the load");
    assert_eq!(device.stats().live_bytes, 0);

    // Set before the load: it does not start.
    let target = HostTarget::new();
    let device = target.clone();
    let cfg = CacheConfig {
        stop: Some(Arc::new(AtomicBool::new(true))),
        ..config(UploadMode::Eager)
    };
    let result = DeviceCache::new(target, &m.store, UploadOrder::file_order(&m.store), cfg);
    assert!(result.is_err_and(|e| e.is_interrupted()));
    assert_eq!(device.stats().live_bytes, 0);
}

#[test]
fn a_stop_flag_ends_a_wait_for_a_layer_and_the_cache_stays_consistent() {
    // 256 KiB tensors in 4 KiB chunks at 1 ms each, one reader: 64 ms per tensor.
    let m = model(8, 262_144);
    let all = handles(&m);
    let target = HostTarget::new().with_copy_delay(Duration::from_millis(1));
    let device = target.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let cfg = CacheConfig {
        chunk_bytes: 4096,
        readers: 1,
        stop: Some(Arc::clone(&stop)),
        ..config(UploadMode::Background)
    };
    let cache = DeviceCache::new(target, &m.store, UploadOrder::file_order(&m.store), cfg).unwrap();
    let first = cache.get(&all[0]).unwrap();
    // The last layer is far behind: its wait is cut short by the flag.
    let group = cache.order().layer_group(7).unwrap();
    let (waited, stopped_at) = std::thread::scope(|s| {
        let waiting = s.spawn(|| {
            let result = cache.get_group(group);
            (result, Instant::now())
        });
        std::thread::sleep(Duration::from_millis(10));
        stop.store(true, Ordering::Relaxed);
        let stopped_at = Instant::now();
        (waiting.join().unwrap(), stopped_at)
    });
    let (result, returned) = waited;
    assert!(
        matches!(result, Err(StoreError::Interrupted)),
        "{:?}",
        result.map(|t| t.len())
    );
    let late = returned.saturating_duration_since(stopped_at);
    assert!(late < PROMPT, "stopped {late:?} after the flag");
    // Every upload was cancelled: nothing loading, only whole tensors resident.
    assert!(matches!(
        cache.wait_idle(),
        Ok(()) | Err(StoreError::Interrupted)
    ));
    let stats = cache.stats();
    assert_eq!(stats.loading_bytes, 0, "{stats:?}");
    assert_eq!(stats.reserved_bytes, stats.resident_bytes, "{stats:?}");
    assert_eq!(device.stats().live_bytes, stats.resident_bytes);
    assert!(!cache.progress().is_complete());
    // A resident tensor is still handed out with the flag set; a missing one is not
    // waited for.
    assert!(cache.get(&all[0]).unwrap().same_upload(&first));
    let missing = all.iter().find(|h| !cache.is_resident(h)).unwrap();
    assert!(cache.get(missing).unwrap_err().is_interrupted());
    drop((cache, first));
    assert_eq!(device.stats().live_bytes, 0);
}

#[test]
fn a_failed_allocation_leaves_the_cache_consistent_and_leaks_nothing() {
    let m = model(3, 4096);
    let all = handles(&m);
    let target = HostTarget::new();
    let device = target.clone();
    let cache = lazy_cache(target, &m);
    // With a tensor nobody uses, the cache makes room by evicting it and tries again.
    // (A request returns once its tensor is published, while the pipeline may still be
    // retiring the upload; a refusal meanwhile is taken as passing, and retried. Each
    // injected failure waits for the pipeline to be idle, so that it is final.)
    cache.get(&all[0]).unwrap();
    cache.wait_idle().unwrap();
    device.fail_allocation(1);
    let b = cache.get(&all[1]).unwrap();
    assert_eq!(b.buffer().as_slice(), &file_bytes(&m, &all[1])[..]);
    assert!(!cache.is_resident(&all[0]));
    // With every tensor in use there is nothing to evict: a clear out-of-memory error,
    // and the same request works once the device has room again.
    cache.wait_idle().unwrap();
    device.fail_allocation(1);
    let error = cache.get(&all[2]).unwrap_err();
    assert!(error.is_out_of_memory(), "{error}");
    let stats = cache.stats();
    assert_eq!((stats.loading_bytes, stats.reserved_bytes), (0, 4096));
    assert_eq!(device.stats().live_bytes, 4096);
    let c = cache.get(&all[2]).unwrap();
    assert_eq!(c.buffer().as_slice(), &file_bytes(&m, &all[2])[..]);
    drop((cache, b, c));
    assert_eq!(device.stats().live_bytes, 0);
}

#[test]
fn a_failed_allocation_during_an_eager_load_stops_it_and_requests_still_load() {
    let m = model(4, 8192);
    let all = handles(&m);
    let target = HostTarget::new();
    let device = target.clone();
    device.fail_allocation(4);
    let cache = cache_in_file_order(target, &m, UploadMode::Eager);
    // The background upload never evicts: it stops where the device refused, like at a
    // full budget, and what it did not reach loads on first use.
    let done = cache.progress().tensors_done;
    assert!(done < all.len(), "{done} of {} uploaded", all.len());
    assert_eq!(cache.stats().loading_bytes, 0);
    for h in &all {
        assert_eq!(
            cache.get(h).unwrap().buffer().as_slice(),
            &file_bytes(&m, h)[..]
        );
    }
    assert!(cache.progress().is_complete());
    drop(cache);
    assert_eq!(device.stats().live_bytes, 0);
}
