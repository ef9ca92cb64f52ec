//! The GPU [`DeviceTarget`]: tensors in one device arena, copies on a dedicated stream
//! from page-locked staging buffers, fences as events.

use std::ops::Range;

use hip_backend::{
    AllocationCounters, ArenaBuffer, Device, DeviceArena, Event, HipError, PinnedBuffer, Stream,
};

use super::target::{DeviceTarget, STAGING_ALIGN};
use crate::StoreError;

/// Alignment of each tensor in the arena: what a device allocation itself guarantees,
/// enough for every vector load a kernel makes.
pub const TENSOR_ALIGN: u64 = hip_backend::DEFAULT_ARENA_ALIGN as u64;

/// A GPU holding tensors in one arena (one device allocation for the whole model).
pub struct HipTarget {
    device: Device,
    stream: Stream,
    arena: DeviceArena,
    counters_at_start: AllocationCounters,
}

fn device_error(op: &'static str) -> impl Fn(HipError) -> StoreError {
    move |source| StoreError::Device { op, source }
}

/// `requested` bytes as a length, refused when the address space cannot hold them.
fn addressable(requested: u64) -> Result<usize, StoreError> {
    usize::try_from(requested).map_err(|_| StoreError::DeviceAlloc {
        requested,
        reason: "larger than the address space".to_owned(),
    })
}

/// A failure to allocate `requested` bytes for the arena or in it: a refusal for want of
/// room (the device's or the arena's), or another failure.
fn arena_error(requested: u64) -> impl Fn(HipError) -> StoreError {
    move |source| match source {
        HipError::OutOfMemory { .. } | HipError::ArenaFull { .. } => StoreError::DeviceAlloc {
            requested,
            reason: source.to_string(),
        },
        other => StoreError::Device {
            op: "arena allocation",
            source: other,
        },
    }
}

impl HipTarget {
    /// Opens an arena of `arena_bytes` on `device` and a stream for the uploads.
    pub fn new(device: &Device, arena_bytes: u64) -> Result<HipTarget, StoreError> {
        let counters_at_start = device.allocation_counters();
        let arena = device
            .new_arena(addressable(arena_bytes)?)
            .map_err(arena_error(arena_bytes))?;
        let stream = device
            .new_stream()
            .map_err(device_error("stream creation"))?;
        Ok(HipTarget {
            device: device.clone(),
            stream,
            arena,
            counters_at_start,
        })
    }

    /// The arena size that holds tensors of these sizes, each aligned to
    /// [`TENSOR_ALIGN`].
    pub fn arena_bytes_for(sizes: impl IntoIterator<Item = u64>) -> u64 {
        sizes
            .into_iter()
            .map(|size| size.div_ceil(TENSOR_ALIGN) * TENSOR_ALIGN)
            .sum()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The stream the uploads run on. Compute on another stream that reads a tensor the
    /// cache returned needs no wait: the cache hands out tensors only after their copies
    /// have finished.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    pub fn arena(&self) -> &DeviceArena {
        &self.arena
    }

    /// Allocations made on the device since this target was created, its arena included.
    pub fn allocation_counters(&self) -> AllocationCounters {
        self.device
            .allocation_counters()
            .since(&self.counters_at_start)
    }
}

impl DeviceTarget for HipTarget {
    type Buffer = ArenaBuffer;
    type Staging = PinnedBuffer<u8>;
    type Fence = Event;

    fn describe(&self) -> String {
        format!(
            "{} ({}, {}, arena {} bytes)",
            self.device.name(),
            self.device.arch(),
            hip_backend::PLATFORM,
            self.arena.capacity()
        )
    }

    fn alloc(&self, bytes: u64) -> Result<ArenaBuffer, StoreError> {
        self.arena
            .alloc(addressable(bytes)?, TENSOR_ALIGN as usize)
            .map_err(arena_error(bytes))
    }

    fn alloc_staging(&self, bytes: usize) -> Result<PinnedBuffer<u8>, StoreError> {
        // Page-locked allocations are page aligned, which covers STAGING_ALIGN.
        const _: () = assert!(STAGING_ALIGN <= 4096);
        self.device
            .alloc_pinned::<u8>(bytes)
            .map_err(device_error("page-locked allocation"))
    }

    fn alloc_staging_ring(
        &self,
        count: usize,
        bytes: usize,
    ) -> Result<Vec<PinnedBuffer<u8>>, StoreError> {
        // One mapping registered once; each buffer starts on a page boundary of its own,
        // which covers STAGING_ALIGN as above.
        self.device
            .alloc_pinned_ring::<u8>(count, bytes)
            .map_err(device_error("page-locked region"))
    }

    fn staging_bytes<'a>(
        &self,
        staging: &'a mut PinnedBuffer<u8>,
    ) -> Result<&'a mut [u8], StoreError> {
        staging
            .as_mut_slice()
            .map_err(device_error("wait for a staging copy"))
    }

    fn copy_to_device(
        &self,
        staging: &mut PinnedBuffer<u8>,
        src: Range<usize>,
        dst: &mut ArenaBuffer,
        dst_offset: u64,
    ) -> Result<(), StoreError> {
        let start = usize::try_from(dst_offset).unwrap_or(usize::MAX);
        let end = start.saturating_add(src.len());
        let view = dst
            .bytes_mut()
            .slice_mut(start..end)
            .map_err(device_error("copy to device"))?;
        self.stream
            .copy_h2d_async(staging, src, view)
            .map_err(device_error("copy to device"))
    }

    fn record_fence(&self) -> Result<Event, StoreError> {
        let event = self
            .device
            .new_sync_event()
            .map_err(device_error("event creation"))?;
        event
            .record(&self.stream)
            .map_err(device_error("event record"))?;
        Ok(event)
    }

    fn wait_fence(&self, fence: &Event) -> Result<(), StoreError> {
        fence
            .synchronize()
            .map_err(device_error("event synchronize"))
    }

    fn synchronize(&self) -> Result<(), StoreError> {
        self.stream
            .synchronize()
            .map_err(device_error("stream synchronize"))
    }

    fn device_allocations(&self) -> u64 {
        self.allocation_counters().device_allocations
    }
}
