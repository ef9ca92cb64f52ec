//! The runtime end to end: buffers, typed views, pinned memory (single buffers and rings
//! sharing one region), streams, events, copies and the arena, on device 0; and the
//! all-reduce of `hip_backend::collective` over every device.
//!
//! Tests that need a device print `SKIPPED <test>: <reason>` on stderr (outside the test
//! harness's capture, so it shows in every run) and pass when the build has no GPU
//! platform or the machine has no device. The first test runs everywhere: it checks that
//! the "no GPU" cases are the typed errors they should be.

use hip_backend::collective::{self, Collectives, Communicator};
use hip_backend::{
    device_or_skip, list_devices, runtime_versions, Device, DeviceBuffer, Graph, HipError,
    Platform, Stream, DEFAULT_ARENA_ALIGN, PLATFORM,
};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

/// Deterministic pseudo-random words (xorshift64).
fn random_words(len: usize, seed: u64) -> Vec<u32> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 16) as u32
        })
        .collect()
}

fn read_back<T: bytemuck::Pod + Default>(stream: &Stream, buffer: &DeviceBuffer<T>) -> Vec<T> {
    let mut host = vec![T::default(); buffer.len()];
    stream
        .read_to_host(buffer.view(), &mut host)
        .expect("read back");
    host
}

#[test]
fn without_a_gpu_every_entry_point_fails_with_a_typed_error() {
    match Device::count() {
        Err(HipError::BuiltWithoutGpu) => {
            assert_eq!(PLATFORM, Platform::None);
            assert!(matches!(Device::open(0), Err(HipError::BuiltWithoutGpu)));
            assert!(matches!(list_devices(), Err(HipError::BuiltWithoutGpu)));
            assert!(matches!(runtime_versions(), Err(HipError::BuiltWithoutGpu)));
        }
        Err(HipError::NoDevice { platform, name, .. }) => {
            assert_ne!(PLATFORM, Platform::None);
            assert_eq!(platform, PLATFORM.name());
            assert!(!name.is_empty());
            assert!(matches!(Device::open(0), Err(HipError::NoDevice { .. })));
            assert!(matches!(list_devices(), Err(HipError::NoDevice { .. })));
        }
        Ok(count) => {
            let line = format!(
                "note: {count} device(s) present, so the no-device path is checked on \
                 machines without one; checking an ordinal past the last device instead\n"
            );
            let _ = std::io::stderr().write_all(line.as_bytes());
            assert!(matches!(
                Device::open(count),
                Err(HipError::InvalidDevice { ordinal, count: c }) if ordinal == count && c == count
            ));
        }
        Err(other) => panic!("unexpected error counting devices: {other}"),
    }
}

#[test]
fn device_properties_are_plausible() {
    let Some(device) = device_or_skip("device_properties_are_plausible") else {
        return;
    };
    assert!(!device.name().is_empty());
    let arch_prefix = if PLATFORM == Platform::Nvidia {
        "sm_"
    } else {
        "gfx"
    };
    assert!(
        device.arch().starts_with(arch_prefix),
        "arch {}",
        device.arch()
    );
    assert!(device.total_memory() > 0);
    let memory = device.memory_info().expect("memory info");
    assert!(
        memory.free <= memory.total && memory.total > 0,
        "{memory:?}"
    );
    let listed = list_devices().expect("list devices");
    assert_eq!(listed[0].name, device.name());
    assert_eq!(listed[0].arch, device.arch());
    assert!(listed[0].free_memory.is_some());
    let versions = runtime_versions().expect("versions");
    assert!(versions.runtime > 0 && versions.driver > 0, "{versions:?}");
}

#[test]
fn pageable_copies_round_trip_whole_and_in_slices() {
    let Some(device) = device_or_skip("pageable_copies_round_trip_whole_and_in_slices") else {
        return;
    };
    let stream = device.new_stream().expect("stream");
    let mut expected = random_words(1 << 20, 7);
    let mut buffer = device.alloc::<u32>(expected.len()).expect("alloc");
    stream
        .write_from_host(&expected, buffer.view_mut())
        .expect("write");
    assert_eq!(read_back(&stream, &buffer), expected);

    let patch = random_words(1000, 11);
    stream
        .write_from_host(&patch, buffer.slice_mut(5000..6000).expect("slice"))
        .expect("write slice");
    expected[5000..6000].copy_from_slice(&patch);
    assert_eq!(read_back(&stream, &buffer), expected);

    // The same bytes through a typed view of another type.
    let mut bytes = vec![0u8; 16];
    let as_bytes = buffer
        .slice(5000..5004)
        .expect("slice")
        .cast::<u8>()
        .expect("cast");
    stream
        .read_to_host(as_bytes, &mut bytes)
        .expect("read bytes");
    assert_eq!(bytes, bytemuck::cast_slice::<u32, u8>(&patch[..4]));
    stream.synchronize().expect("no deferred failures");
}

#[test]
fn staged_writes_reach_the_device_and_refuse_a_short_staging_buffer() {
    let Some(device) =
        device_or_skip("staged_writes_reach_the_device_and_refuse_a_short_staging_buffer")
    else {
        return;
    };
    let stream = device.new_stream().expect("stream");
    let mut staging = device.alloc_pinned::<u32>(8).expect("pinned");
    let mut dst = device.alloc::<u32>(8).expect("alloc");
    // Two writes through one staging buffer: the second waits for the first's copy.
    stream
        .write_staged(
            &mut staging,
            &[1, 2, 3],
            dst.slice_mut(0..3).expect("slice"),
        )
        .expect("first write");
    stream
        .write_staged(&mut staging, &[4, 5], dst.slice_mut(3..5).expect("slice"))
        .expect("second write");
    let mut back = [0u32; 5];
    stream
        .read_to_host(dst.slice(0..5).expect("slice"), &mut back)
        .expect("read back");
    assert_eq!(back, [1, 2, 3, 4, 5]);
    let error = stream
        .write_staged(&mut staging, &[0; 9], dst.view_mut())
        .expect_err("nine values through eight");
    assert!(
        matches!(error, HipError::LengthMismatch { src: 9, dst: 8, .. }),
        "{error}"
    );
    stream.synchronize().expect("no deferred failures");
}

#[test]
fn pinned_async_copies_round_trip_through_device_buffers() {
    let Some(device) = device_or_skip("pinned_async_copies_round_trip_through_device_buffers")
    else {
        return;
    };
    let stream = device.new_stream().expect("stream");
    let len = 3 << 20;
    let data = random_words(len, 13);
    let mut upload = device.alloc_pinned::<u32>(len).expect("pinned");
    upload
        .as_mut_slice()
        .expect("host access")
        .copy_from_slice(&data);
    let mut first = device.alloc::<u32>(len).expect("alloc");
    let mut second = device.alloc::<u32>(len).expect("alloc");
    let mut download = device.alloc_pinned::<u32>(len).expect("pinned");

    stream
        .copy_h2d_async(&mut upload, 0..len, first.view_mut())
        .expect("h2d");
    stream
        .copy_d2d_async(first.view(), second.view_mut())
        .expect("d2d");
    stream
        .copy_d2h_async(second.view(), &mut download, 0..len)
        .expect("d2h");
    // as_slice waits for the copy queued on the buffer; no stream synchronize needed.
    assert_eq!(download.as_slice().expect("host access"), &data[..]);

    // A partial copy into the middle of a pinned buffer leaves the rest untouched.
    download.as_mut_slice().expect("host access").fill(0);
    stream
        .copy_d2h_async(
            first.slice(100..200).expect("slice"),
            &mut download,
            1000..1100,
        )
        .expect("partial d2h");
    let host = download.as_slice().expect("host access");
    assert_eq!(&host[1000..1100], &data[100..200]);
    assert!(host[..1000]
        .iter()
        .chain(&host[1100..])
        .all(|&word| word == 0));
    stream.synchronize().expect("no deferred failures");
    drop((upload, download, first, second));
    device.check_err().expect("releases succeeded");
}

#[test]
fn a_pinned_ring_is_one_region_of_disjoint_page_aligned_buffers() {
    let Some(device) =
        device_or_skip("a_pinned_ring_is_one_region_of_disjoint_page_aligned_buffers")
    else {
        return;
    };
    // Its memory mapped when the ring is asked for, then made resident ahead of time.
    pinned_ring(&device, false);
    pinned_ring(&device, true);
}

fn pinned_ring(device: &Device, prepared: bool) {
    let stream = device.new_stream().expect("stream");
    let before = device.allocation_counters();
    // Not a multiple of the page size: each buffer still starts on a page of its own.
    let len = 3 * 4096 + 123;
    if prepared {
        hip_backend::prepare_pinned_ring::<u8>(3, len);
    }
    let mut ring = device.alloc_pinned_ring::<u8>(3, len).expect("ring");
    assert_eq!(ring.len(), 3);
    let counted = device.allocation_counters().since(&before);
    assert_eq!(
        (counted.pinned_allocations, counted.pinned_frees),
        (1, 0),
        "the ring is one page-locked allocation"
    );
    let mut starts = Vec::new();
    for (index, buffer) in ring.iter_mut().enumerate() {
        assert_eq!((buffer.len(), buffer.size_bytes()), (len, len));
        let bytes = buffer.as_mut_slice().expect("host access");
        assert!(bytes.iter().all(|&byte| byte == 0), "buffer {index} zeroed");
        assert_eq!(
            bytes.as_ptr() as usize % 4096,
            0,
            "buffer {index} page aligned"
        );
        starts.push(bytes.as_ptr() as usize);
        for (at, byte) in bytes.iter_mut().enumerate() {
            *byte = (at * 7 + index * 85 + 1) as u8;
        }
    }
    starts.sort_unstable();
    assert!(starts.windows(2).all(|pair| pair[1] - pair[0] >= len));
    let expected: Vec<Vec<u8>> = ring
        .iter()
        .map(|buffer| buffer.as_slice().expect("host access").to_vec())
        .collect();
    assert!(expected[0] != expected[1] && expected[1] != expected[2]);

    // Each buffer to its own device buffer, the ring cleared, and back again.
    let mut device_copies = Vec::new();
    for buffer in &mut ring {
        let mut copy = device.alloc::<u8>(len).expect("alloc");
        stream
            .copy_h2d_async(buffer, 0..len, copy.view_mut())
            .expect("h2d");
        device_copies.push(copy);
    }
    for buffer in &mut ring {
        buffer.as_mut_slice().expect("host access").fill(0);
    }
    for (buffer, copy) in ring.iter_mut().zip(&device_copies) {
        stream
            .copy_d2h_async(copy.view(), buffer, 0..len)
            .expect("d2h");
    }
    for (index, (buffer, copy)) in ring.iter().zip(&device_copies).enumerate() {
        assert_eq!(
            buffer.as_slice().expect("host access"),
            &expected[index][..],
            "buffer {index} after the round trip"
        );
        assert_eq!(
            read_back(&stream, copy),
            expected[index],
            "device copy {index}"
        );
    }

    // The region goes with its last buffer; a queued copy is waited for first.
    let mut last = ring.pop().expect("three buffers");
    drop(ring);
    assert_eq!(device.allocation_counters().since(&before).pinned_frees, 0);
    stream
        .copy_d2h_async(device_copies[0].view(), &mut last, 0..len)
        .expect("d2h into the last buffer");
    drop(last);
    let counted = device.allocation_counters().since(&before);
    assert_eq!(
        (counted.pinned_allocations, counted.pinned_frees),
        (1, 1),
        "the region was released once"
    );

    // Rings of nothing allocate nothing.
    assert!(device
        .alloc_pinned_ring::<u8>(0, len)
        .expect("no buffers")
        .is_empty());
    let empty = device
        .alloc_pinned_ring::<u32>(2, 0)
        .expect("empty buffers");
    assert!(empty.iter().all(|buffer| buffer.is_empty()));
    drop(empty);
    let counted = device.allocation_counters().since(&before);
    assert_eq!((counted.pinned_allocations, counted.pinned_frees), (1, 1));
    drop(device_copies);
    device.check_err().expect("releases succeeded");
}

#[test]
fn events_order_streams_and_time_work() {
    let Some(device) = device_or_skip("events_order_streams_and_time_work") else {
        return;
    };
    let (producer, consumer) = (
        device.new_stream().expect("stream"),
        device.new_stream().expect("stream"),
    );
    let (start, end) = (
        device.new_event().expect("event"),
        device.new_event().expect("event"),
    );
    assert!(start.has_timing() && !device.new_sync_event().expect("event").has_timing());
    let len = 16 << 20; // 64 MiB: long enough to time
    let data = random_words(len, 17);
    let mut pinned = device.alloc_pinned::<u32>(len).expect("pinned");
    pinned
        .as_mut_slice()
        .expect("host access")
        .copy_from_slice(&data);
    let mut source = device.alloc::<u32>(len).expect("alloc");
    let mut copy = device.alloc::<u32>(len).expect("alloc");

    start.record(&producer).expect("record");
    producer
        .copy_h2d_async(&mut pinned, 0..len, source.view_mut())
        .expect("h2d");
    end.record(&producer).expect("record");
    consumer.wait_event(&end).expect("wait");
    consumer
        .copy_d2d_async(source.view(), copy.view_mut())
        .expect("d2d");
    assert_eq!(
        read_back(&consumer, &copy),
        data,
        "the consumer ran before the producer"
    );

    end.synchronize().expect("event sync");
    assert!(end.is_complete().expect("query"));
    let milliseconds = end.elapsed_ms_since(&start).expect("elapsed");
    assert!(
        milliseconds > 0.0 && milliseconds < 10_000.0,
        "{milliseconds} ms for 64 MiB"
    );
    producer.synchronize().expect("sync");
    assert!(producer.is_idle().expect("query"));
}

#[test]
fn memset_and_empty_buffers() {
    let Some(device) = device_or_skip("memset_and_empty_buffers") else {
        return;
    };
    let stream = device.new_stream().expect("stream");
    let mut buffer = device.alloc::<u32>(4096).expect("alloc");
    stream
        .memset_async(buffer.view_mut(), 0xab)
        .expect("memset");
    stream
        .memset_async(buffer.slice_mut(10..20).expect("slice"), 0)
        .expect("memset slice");
    let host = read_back(&stream, &buffer);
    for (index, &word) in host.iter().enumerate() {
        let expected = if (10..20).contains(&index) {
            0
        } else {
            0xabab_abab
        };
        assert_eq!(word, expected, "element {index}");
    }

    let before = device.allocation_counters();
    let mut empty = device.alloc::<f32>(0).expect("empty alloc");
    stream
        .write_from_host(&[], empty.view_mut())
        .expect("empty write");
    stream
        .read_to_host(empty.view(), &mut [])
        .expect("empty read");
    let mut empty_pinned = device.alloc_pinned::<f32>(0).expect("empty pinned");
    stream
        .copy_h2d_async(&mut empty_pinned, 0..0, empty.view_mut())
        .expect("empty h2d");
    assert_eq!(
        device
            .allocation_counters()
            .since(&before)
            .device_allocations,
        0
    );
}

#[test]
fn bad_copies_and_views_are_refused() {
    let Some(device) = device_or_skip("bad_copies_and_views_are_refused") else {
        return;
    };
    let stream = device.new_stream().expect("stream");
    let mut buffer = device.alloc::<u32>(100).expect("alloc");
    let mut pinned = device.alloc_pinned::<u32>(50).expect("pinned");
    assert!(matches!(
        stream.write_from_host(&[1u32; 99], buffer.view_mut()),
        Err(HipError::LengthMismatch {
            src: 99,
            dst: 100,
            ..
        })
    ));
    assert!(matches!(
        buffer.slice(90..101),
        Err(HipError::OutOfBounds {
            end: 101,
            len: 100,
            ..
        })
    ));
    assert!(matches!(
        stream.copy_h2d_async(&mut pinned, 40..60, buffer.slice_mut(0..20).expect("slice")),
        Err(HipError::OutOfBounds {
            end: 60,
            len: 50,
            ..
        })
    ));
    assert!(matches!(
        buffer.slice(0..3).expect("slice").cast::<u64>(),
        Err(HipError::BadCast { .. })
    ));
    // A refused copy leaves the pinned buffer usable.
    assert_eq!(pinned.as_slice().expect("host access").len(), 50);
}

#[test]
fn out_of_memory_is_a_typed_error_and_the_device_stays_usable() {
    let Some(device) = device_or_skip("out_of_memory_is_a_typed_error_and_the_device_stays_usable")
    else {
        return;
    };
    let too_much = device.total_memory().saturating_mul(4);
    match device.alloc::<u8>(too_much) {
        Err(HipError::OutOfMemory { bytes, .. }) => assert_eq!(bytes, too_much),
        other => panic!("expected OutOfMemory for {too_much} bytes, got {other:?}"),
    }
    let arena_error = device
        .new_arena(too_much)
        .expect_err("arena larger than the device");
    assert!(
        matches!(arena_error, HipError::OutOfMemory { .. }),
        "{arena_error}"
    );
    let stream = device.new_stream().expect("stream");
    let mut small = device
        .alloc::<u32>(16)
        .expect("small alloc after a failed one");
    stream
        .write_from_host(&[7u32; 16], small.view_mut())
        .expect("write");
    assert_eq!(read_back(&stream, &small), vec![7u32; 16]);
}

#[test]
fn the_arena_is_one_allocation_carved_into_aligned_disjoint_buffers() {
    let Some(device) =
        device_or_skip("the_arena_is_one_allocation_carved_into_aligned_disjoint_buffers")
    else {
        return;
    };
    let stream = device.new_stream().expect("stream");
    let before = device.allocation_counters();
    let capacity = 32 << 20;
    let arena = device.new_arena(capacity).expect("arena");
    let sizes = random_words(200, 23);
    let mut buffers = Vec::new();
    for (index, size) in sizes.iter().enumerate() {
        let words = 1 + (*size as usize % 20_000);
        let mut buffer = arena.alloc_elements::<u32>(words).expect("sub-allocation");
        assert_eq!(buffer.bytes().address() % DEFAULT_ARENA_ALIGN, 0);
        let content = vec![index as u32; words];
        stream
            .write_from_host(&content, buffer.view_mut::<u32>().expect("view"))
            .expect("fill");
        buffers.push(buffer);
    }
    // Each buffer still holds its own pattern: no two overlap.
    for (index, buffer) in buffers.iter().enumerate() {
        let view = buffer.view::<u32>().expect("view");
        let mut host = vec![0u32; view.len()];
        stream.read_to_host(view, &mut host).expect("read");
        assert!(
            host.iter().all(|&word| word == index as u32),
            "buffer {index} was overwritten"
        );
    }
    let counted = device.allocation_counters().since(&before);
    assert_eq!(
        counted.device_allocations, 1,
        "200 sub-buffers must cost one device allocation"
    );
    assert_eq!(counted.device_bytes, capacity as u64);
    let stats = arena.stats();
    assert_eq!((stats.live_buffers, stats.sub_allocations), (200, 200));

    assert!(
        matches!(arena.alloc(capacity, 256), Err(HipError::ArenaFull { requested, .. }) if requested == capacity)
    );
    stream.synchronize().expect("sync");
    buffers.clear();
    let stats = arena.stats();
    assert_eq!(
        (stats.used, stats.live_buffers, stats.largest_free),
        (0, 0, capacity)
    );
    let whole = arena.alloc(capacity, 256).expect("the whole arena again");
    drop((whole, arena));
    assert_eq!(device.allocation_counters().since(&before).device_frees, 1);
    device.check_err().expect("releases succeeded");
}

/// Copies between two devices' memory (device 0 and the last: the same device on a
/// machine of one), with peer access where the devices have it, ordered by an event of
/// the first device that the second's stream waits for.
#[test]
fn peer_copies_cross_devices_in_event_order() {
    let Some(first) = device_or_skip("peer_copies_cross_devices_in_event_order") else {
        return;
    };
    let count = Device::count().expect("count");
    let second = Device::open(count - 1).expect("the last device");
    assert!(first.can_access_peer(&first).expect("peer query"));
    if first.can_access_peer(&second).expect("peer query") {
        first.enable_peer_access(&second).expect("peer access");
        // Twice is no error.
        first
            .enable_peer_access(&second)
            .expect("peer access again");
        second.enable_peer_access(&first).expect("peer access back");
    }
    let len = 4 << 20;
    let data = random_words(len, 29);
    let (s1, s2) = (
        first.new_stream().expect("stream"),
        second.new_stream().expect("stream"),
    );
    let mut pinned = first.alloc_pinned::<u32>(len).expect("pinned");
    pinned
        .as_mut_slice()
        .expect("host access")
        .copy_from_slice(&data);
    let mut a = first.alloc::<u32>(len).expect("alloc");
    let mut b = second.alloc::<u32>(len).expect("alloc");
    let mut back = first.alloc::<u32>(len).expect("alloc");
    let handed = first.new_sync_event().expect("event");
    s1.copy_h2d_async(&mut pinned, 0..len, a.view_mut())
        .expect("h2d");
    s1.copy_peer_async(a.view(), b.view_mut())
        .expect("peer copy");
    handed.record(&s1).expect("record");
    // The second device's stream copies it back once the first has handed it over.
    s2.wait_event(&handed).expect("wait");
    s2.copy_peer_async(b.view(), back.view_mut())
        .expect("peer copy back");
    s2.synchronize().expect("sync");
    assert_eq!(read_back(&s1, &back), data);
    let short = second.alloc::<u32>(len - 1).expect("alloc");
    assert!(matches!(
        s1.copy_peer_async(short.view(), back.view_mut()),
        Err(HipError::LengthMismatch { .. })
    ));
}

#[test]
fn loading_collectives_from_a_missing_path_fails_naming_it() {
    let missing = "/nonexistent/libnccl.so.2";
    match (PLATFORM, Collectives::load(Some(Path::new(missing)))) {
        (Platform::None, Err(HipError::BuiltWithoutGpu)) => {}
        (_, Err(error @ HipError::CollectivesUnavailable { .. })) => {
            let text = error.to_string();
            assert!(text.contains(missing), "{text}");
            assert!(text.contains("NCCL"), "{text}");
        }
        (platform, Err(other)) => panic!("{platform}: unexpected error {other}"),
        (platform, Ok(lib)) => panic!("{platform}: {missing} loaded as {}", lib.path()),
    }
}

/// The collectives library for the GPU test `test`: the file `ROCMFORGE_COLLECTIVES` names when
/// it is set (a file that does not load fails the test), else the platform's default
/// names through the dynamic loader's search path. `None` after writing
/// `SKIPPED <test>: <reason>` to stderr when the default names do not load.
fn collectives_or_skip(test: &str) -> Option<Arc<Collectives>> {
    let named = std::env::var_os("ROCMFORGE_COLLECTIVES").filter(|path| !path.is_empty());
    let loaded = Collectives::load(named.as_deref().map(Path::new));
    match (named, loaded) {
        (_, Ok(lib)) => Some(lib),
        (Some(path), Err(error)) => {
            panic!(
                "{test}: ROCMFORGE_COLLECTIVES={} does not load: {error}",
                path.display()
            )
        }
        (None, Err(error)) => {
            let line =
                format!("SKIPPED {test}: {error} (ROCMFORGE_COLLECTIVES may name the library)\n");
            let _ = std::io::stderr().write_all(line.as_bytes());
            None
        }
    }
}

/// Captures the work `record` queues into one graph per stream, every stream capturing at
/// once: collectives of several ranks, driven from one thread inside one group, are
/// launched together when the group ends, onto all the ranks' streams.
fn capture_together(
    streams: &[Stream],
    record: &mut dyn FnMut() -> Result<(), HipError>,
) -> Result<Vec<Graph>, HipError> {
    let Some((first, rest)) = streams.split_first() else {
        record()?;
        return Ok(Vec::new());
    };
    let mut inner = Vec::new();
    let graph = first.capture(|_| {
        inner = capture_together(rest, record)?;
        Ok::<(), HipError>(())
    })?;
    inner.insert(0, graph);
    Ok(inner)
}

/// Every device a rank: rank r's buffer holds (r + 1) · i at element i. One all-reduce,
/// called for all ranks inside one group, leaves the sum on every rank; then the same
/// all-reduce captured into one graph per rank and replayed twice sums twice.
#[test]
fn all_reduce_sums_every_ranks_buffer_directly_and_from_graphs() {
    const TEST: &str = "all_reduce_sums_every_ranks_buffer_directly_and_from_graphs";
    const LEN: usize = 1000;
    if device_or_skip(TEST).is_none() {
        return;
    }
    let Some(lib) = collectives_or_skip(TEST) else {
        return;
    };
    let version = lib.version().expect("library version");
    assert!(version > 0, "version {version}");
    let count = Device::count().expect("count");
    let line = format!("note: {} version {version}, {count} rank(s)\n", lib.path());
    let _ = std::io::stderr().write_all(line.as_bytes());

    let devices: Vec<Device> = (0..count)
        .map(|ordinal| Device::open(ordinal).expect("open"))
        .collect();
    let comms = Communicator::for_devices(&lib, &devices).expect("communicator");
    assert_eq!(comms.len(), count);
    for (rank, comm) in comms.iter().enumerate() {
        assert_eq!(
            (comm.rank(), comm.size(), comm.device()),
            (rank, count, rank)
        );
        comm.async_error().expect("no background error");
    }
    let streams: Vec<Stream> = devices
        .iter()
        .map(|device| device.new_stream().expect("stream"))
        .collect();
    let mut buffers: Vec<DeviceBuffer<f32>> = devices
        .iter()
        .map(|device| device.alloc::<f32>(LEN).expect("alloc"))
        .collect();
    let fill = |buffers: &mut [DeviceBuffer<f32>]| {
        for (rank, (buffer, stream)) in buffers.iter_mut().zip(&streams).enumerate() {
            let values: Vec<f32> = (0..LEN).map(|i| ((rank + 1) * i) as f32).collect();
            stream
                .write_from_host(&values, buffer.view_mut())
                .expect("fill");
        }
    };
    // Every rank holds `factor` times the sum over ranks, 1 + 2 + ... + count, of i.
    let check = |buffers: &[DeviceBuffer<f32>], factor: usize, what: &str| {
        let rank_sum = count * (count + 1) / 2;
        let expected: Vec<f32> = (0..LEN).map(|i| (factor * rank_sum * i) as f32).collect();
        for (rank, (buffer, stream)) in buffers.iter().zip(&streams).enumerate() {
            stream.synchronize().expect("synchronize");
            assert_eq!(read_back(stream, buffer), expected, "{what}: rank {rank}");
        }
    };

    fill(&mut buffers);
    collective::group(&lib, || {
        comms
            .iter()
            .zip(&streams)
            .zip(buffers.iter_mut())
            .try_for_each(|((comm, stream), buffer)| comm.all_reduce_sum(buffer.view_mut(), stream))
    })
    .expect("group")
    .expect("all-reduce");
    check(&buffers, 1, "direct");

    // A stream of another device, or an empty buffer, is refused or a no-op.
    let other = &streams[count - 1];
    if count > 1 {
        assert!(matches!(
            comms[0].all_reduce_sum(buffers[0].view_mut(), other),
            Err(HipError::DeviceMismatch { .. })
        ));
    }
    collective::group(&lib, || {
        comms
            .iter()
            .zip(&streams)
            .zip(buffers.iter_mut())
            .try_for_each(|((comm, stream), buffer)| {
                comm.all_reduce_sum(buffer.slice_mut(0..0)?, stream)
            })
    })
    .expect("group")
    .expect("an empty all-reduce queues nothing");

    let graphs = {
        let buffers = &mut buffers;
        let comms = &comms;
        let streams = &streams;
        capture_together(streams, &mut || {
            collective::group(&lib, || {
                comms
                    .iter()
                    .zip(streams)
                    .zip(buffers.iter_mut())
                    .try_for_each(|((comm, stream), buffer)| {
                        comm.all_reduce_sum(buffer.view_mut(), stream)
                    })
            })?
        })
        .expect("capture")
    };
    assert_eq!(graphs.len(), count);
    fill(&mut buffers);
    for (graph, stream) in graphs.iter().zip(&streams) {
        graph.launch(stream).expect("replay");
    }
    check(&buffers, 1, "first replay");
    for (graph, stream) in graphs.iter().zip(&streams) {
        graph.launch(stream).expect("replay");
    }
    check(&buffers, count, "second replay");
    for comm in &comms {
        comm.async_error().expect("no background error");
    }
    // The library destroys a communicator only once the graphs that captured it are gone.
    drop(graphs);
    drop(comms);
    for device in &devices {
        device.check_err().expect("releases succeeded");
    }
}
