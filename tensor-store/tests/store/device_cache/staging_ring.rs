//! How the staging buffers are allocated: in regions, or one at a time when asked.

use super::*;

/// A [`HostTarget`] that counts the staging buffers asked for one at a time and in rings.
struct RingCounter {
    host: HostTarget,
    single_buffers: Arc<AtomicUsize>,
    ring_buffers: Arc<AtomicUsize>,
}

impl DeviceTarget for RingCounter {
    type Buffer = HostBuffer;
    type Staging = HostStaging;
    type Fence = <HostTarget as DeviceTarget>::Fence;

    fn describe(&self) -> String {
        self.host.describe()
    }
    fn alloc(&self, bytes: u64) -> Result<HostBuffer, StoreError> {
        self.host.alloc(bytes)
    }
    fn alloc_staging(&self, bytes: usize) -> Result<HostStaging, StoreError> {
        self.single_buffers.fetch_add(1, Ordering::Relaxed);
        self.host.alloc_staging(bytes)
    }
    fn alloc_staging_ring(
        &self,
        count: usize,
        bytes: usize,
    ) -> Result<Vec<HostStaging>, StoreError> {
        self.ring_buffers.fetch_add(count, Ordering::Relaxed);
        self.host.alloc_staging_ring(count, bytes)
    }
    fn staging_bytes<'a>(&self, staging: &'a mut HostStaging) -> Result<&'a mut [u8], StoreError> {
        self.host.staging_bytes(staging)
    }
    fn copy_to_device(
        &self,
        staging: &mut HostStaging,
        src: std::ops::Range<usize>,
        dst: &mut HostBuffer,
        dst_offset: u64,
    ) -> Result<(), StoreError> {
        self.host.copy_to_device(staging, src, dst, dst_offset)
    }
    fn record_fence(&self) -> Result<Self::Fence, StoreError> {
        self.host.record_fence()
    }
    fn wait_fence(&self, fence: &Self::Fence) -> Result<(), StoreError> {
        self.host.wait_fence(fence)
    }
    fn synchronize(&self) -> Result<(), StoreError> {
        self.host.synchronize()
    }
    fn device_allocations(&self) -> u64 {
        self.host.device_allocations()
    }
}

#[test]
fn the_staging_ring_comes_in_regions_unless_separate_buffers_are_asked_for() {
    let m = model(4, 8192);
    // The first buffer alone, then the other three in one region or one at a time.
    for (ring, expected) in [
        (StagingRing::Region, (1, 3)),
        (StagingRing::Separate, (4, 0)),
    ] {
        let single_buffers = Arc::new(AtomicUsize::new(0));
        let ring_buffers = Arc::new(AtomicUsize::new(0));
        let target = RingCounter {
            host: HostTarget::new(),
            single_buffers: Arc::clone(&single_buffers),
            ring_buffers: Arc::clone(&ring_buffers),
        };
        let cfg = CacheConfig {
            staging_ring: ring,
            ..config(UploadMode::Lazy)
        };
        let cache = ordered_cache(target, &m, cfg);
        // The buffers after the first come from a thread of their own.
        let counts = || {
            (
                single_buffers.load(Ordering::Relaxed),
                ring_buffers.load(Ordering::Relaxed),
            )
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while counts().0 + counts().1 < 4 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(counts(), expected, "{ring:?}");
        for h in handles(&m) {
            assert_eq!(
                cache.get(&h).unwrap().buffer().as_slice(),
                &file_bytes(&m, &h)[..]
            );
        }
    }
}
