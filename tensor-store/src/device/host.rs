//! A [`DeviceTarget`] in host memory: the cache and pipeline run unchanged without a
//! GPU, for tests and for `bench-load --device cpu`.
//!
//! Copies are plain `memcpy`s done at once, so every fence is already passed. The target
//! can imitate a small device (a capacity beyond which allocations fail), a slow link
//! (a delay per copy) and an allocation that fails whatever the room left, which the
//! tests use to reach the out-of-memory, allocation-failure and cancellation paths.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::target::{DeviceTarget, STAGING_ALIGN};
use crate::StoreError;

#[derive(Default)]
struct Counters {
    allocations: AtomicU64,
    live_bytes: AtomicU64,
    copies: AtomicU64,
    copied_bytes: AtomicU64,
}

/// Host memory standing in for a device. Clones are views of the same imagined device:
/// they share its capacity's accounting and its counters (a test keeps one to read
/// [`HostTarget::stats`] after the cache that owned the other is gone).
#[derive(Clone)]
pub struct HostTarget {
    capacity: u64,
    copy_delay: Option<Duration>,
    counters: Arc<Counters>,
    /// 0: no failure planned; n > 0: the n-th allocation from now fails.
    fail_countdown: Arc<AtomicU64>,
}

/// What a [`HostTarget`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostTargetStats {
    /// Buffers allocated.
    pub allocations: u64,
    /// Bytes in buffers not yet dropped.
    pub live_bytes: u64,
    /// Copies made into buffers.
    pub copies: u64,
    pub copied_bytes: u64,
}

impl HostTarget {
    /// A target with no limit but the machine's memory.
    pub fn new() -> HostTarget {
        HostTarget {
            capacity: u64::MAX,
            copy_delay: None,
            counters: Arc::default(),
            fail_countdown: Arc::default(),
        }
    }

    /// Allocations fail once live buffers would exceed `capacity` bytes, as a device's
    /// memory would.
    pub fn with_capacity(mut self, capacity: u64) -> HostTarget {
        self.capacity = capacity;
        self
    }

    /// Every copy sleeps this long first, as a slow link would.
    pub fn with_copy_delay(mut self, delay: Duration) -> HostTarget {
        self.copy_delay = Some(delay);
        self
    }

    /// Makes the `nth` allocation from now (1: the next one) fail with
    /// [`StoreError::DeviceAlloc`] whatever the room left, as a device whose memory
    /// another user took would.
    pub fn fail_allocation(&self, nth: u64) {
        self.fail_countdown.store(nth, Ordering::Relaxed);
    }

    pub fn stats(&self) -> HostTargetStats {
        let c = &self.counters;
        HostTargetStats {
            allocations: c.allocations.load(Ordering::Relaxed),
            live_bytes: c.live_bytes.load(Ordering::Relaxed),
            copies: c.copies.load(Ordering::Relaxed),
            copied_bytes: c.copied_bytes.load(Ordering::Relaxed),
        }
    }
}

impl Default for HostTarget {
    fn default() -> HostTarget {
        HostTarget::new()
    }
}

/// A tensor's bytes in host memory.
pub struct HostBuffer {
    bytes: Box<[u8]>,
    counters: Arc<Counters>,
}

impl HostBuffer {
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        self.counters
            .live_bytes
            .fetch_sub(self.bytes.len() as u64, Ordering::Relaxed);
    }
}

/// A staging buffer: an ordinary allocation with an aligned window.
pub struct HostStaging {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl HostStaging {
    fn window(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

impl DeviceTarget for HostTarget {
    type Buffer = HostBuffer;
    type Staging = HostStaging;
    type Fence = ();

    fn describe(&self) -> String {
        "host memory".to_owned()
    }

    fn alloc(&self, bytes: u64) -> Result<HostBuffer, StoreError> {
        let planned = self
            .fail_countdown
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        if planned == Ok(1) {
            return Err(StoreError::DeviceAlloc {
                requested: bytes,
                reason: "an injected allocation failure".to_owned(),
            });
        }
        let live = &self.counters.live_bytes;
        let reserved = live.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
            now.checked_add(bytes)
                .filter(|&total| total <= self.capacity)
        });
        if let Err(now) = reserved {
            return Err(StoreError::DeviceAlloc {
                requested: bytes,
                reason: format!("{now} of {} bytes of host capacity in use", self.capacity),
            });
        }
        let Ok(len) = usize::try_from(bytes) else {
            live.fetch_sub(bytes, Ordering::Relaxed);
            return Err(StoreError::DeviceAlloc {
                requested: bytes,
                reason: "larger than the address space".to_owned(),
            });
        };
        self.counters.allocations.fetch_add(1, Ordering::Relaxed);
        Ok(HostBuffer {
            // Zeroed memory comes from the kernel untouched: pages count toward resident
            // memory only once a copy writes them.
            bytes: vec![0u8; len].into_boxed_slice(),
            counters: Arc::clone(&self.counters),
        })
    }

    fn alloc_staging(&self, bytes: usize) -> Result<HostStaging, StoreError> {
        let mut storage = vec![0u8; bytes + STAGING_ALIGN];
        let start = storage.as_mut_ptr().align_offset(STAGING_ALIGN);
        Ok(HostStaging {
            storage,
            start,
            len: bytes,
        })
    }

    fn staging_bytes<'a>(&self, staging: &'a mut HostStaging) -> Result<&'a mut [u8], StoreError> {
        Ok(staging.window())
    }

    fn copy_to_device(
        &self,
        staging: &mut HostStaging,
        src: Range<usize>,
        dst: &mut HostBuffer,
        dst_offset: u64,
    ) -> Result<(), StoreError> {
        if let Some(delay) = self.copy_delay {
            std::thread::sleep(delay);
        }
        let len = src.len();
        let window = staging.window();
        let size = dst.bytes.len() as u64;
        let out_of_range = || StoreError::ReadOutOfRange {
            tensor: "<device buffer>".to_owned(),
            offset: dst_offset,
            len: len as u64,
            size,
        };
        let start = usize::try_from(dst_offset).map_err(|_| out_of_range())?;
        let source = window.get(src).ok_or_else(out_of_range)?;
        let target = start
            .checked_add(len)
            .and_then(|end| dst.bytes.get_mut(start..end))
            .ok_or_else(out_of_range)?;
        target.copy_from_slice(source);
        self.counters.copies.fetch_add(1, Ordering::Relaxed);
        self.counters
            .copied_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    fn record_fence(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn wait_fence(&self, _fence: &()) -> Result<(), StoreError> {
        Ok(())
    }

    fn synchronize(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn device_allocations(&self) -> u64 {
        self.counters.allocations.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_refuses_what_does_not_fit_and_frees_on_drop() {
        let target = HostTarget::new().with_capacity(100);
        let a = target.alloc(60).unwrap();
        assert!(matches!(
            target.alloc(50),
            Err(StoreError::DeviceAlloc { requested: 50, .. })
        ));
        drop(a);
        let b = target.alloc(100).unwrap();
        assert_eq!(b.as_slice().len(), 100);
        assert_eq!(target.stats().live_bytes, 100);
        assert_eq!(target.device_allocations(), 2);
    }

    #[test]
    fn a_planned_failure_fails_that_allocation_only() {
        let target = HostTarget::new();
        let view = target.clone();
        view.fail_allocation(2);
        let a = target.alloc(10).unwrap();
        assert!(matches!(
            target.alloc(20),
            Err(StoreError::DeviceAlloc { requested: 20, .. })
        ));
        let b = target.alloc(30).unwrap();
        assert_eq!(view.stats().live_bytes, 40);
        assert_eq!(view.stats().allocations, 2);
        drop((a, b));
        assert_eq!(view.stats().live_bytes, 0);
    }

    #[test]
    fn a_staging_ring_is_count_aligned_buffers_of_their_own() {
        let target = HostTarget::new();
        let mut ring = target.alloc_staging_ring(3, 5000).unwrap();
        assert_eq!(ring.len(), 3);
        for (index, staging) in ring.iter_mut().enumerate() {
            let bytes = target.staging_bytes(staging).unwrap();
            assert!(bytes.len() >= 5000, "buffer {index}: {} bytes", bytes.len());
            assert_eq!(bytes.as_ptr() as usize % STAGING_ALIGN, 0, "buffer {index}");
            bytes.fill(index as u8 + 1);
        }
        for (index, staging) in ring.iter_mut().enumerate() {
            let bytes = target.staging_bytes(staging).unwrap();
            assert!(
                bytes.iter().all(|&b| b == index as u8 + 1),
                "buffer {index}"
            );
        }
        assert!(target.alloc_staging_ring(0, 5000).unwrap().is_empty());
        // Staging buffers are host memory of their own, not device allocations.
        assert_eq!(target.device_allocations(), 0);
    }

    #[test]
    fn staging_is_aligned_and_copies_land_at_the_offset() {
        let target = HostTarget::new();
        let mut staging = target.alloc_staging(64).unwrap();
        let bytes = target.staging_bytes(&mut staging).unwrap();
        assert_eq!(bytes.as_ptr() as usize % STAGING_ALIGN, 0);
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = i as u8;
        }
        let mut dst = target.alloc(16).unwrap();
        target
            .copy_to_device(&mut staging, 10..18, &mut dst, 4)
            .unwrap();
        assert_eq!(&dst.as_slice()[4..12], &[10, 11, 12, 13, 14, 15, 16, 17]);
        assert!(target
            .copy_to_device(&mut staging, 0..8, &mut dst, 12)
            .is_err());
    }
}
