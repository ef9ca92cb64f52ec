//! Where uploaded tensors live: the small interface the device cache and the upload
//! pipeline need from a device, so that the same cache code runs on a GPU
//! ([`super::HipTarget`]) and, in tests and CPU benchmarks, on host memory
//! ([`super::HostTarget`]).

use std::ops::Range;

use crate::StoreError;

/// A device the cache uploads tensors to.
///
/// The cache calls these methods from several threads at once (the pipeline's readers
/// copy while its publisher waits on fences), so implementations are `Sync`. Copies into
/// a device buffer are asynchronous: they may still run when
/// [`DeviceTarget::copy_to_device`] returns, and only a fence recorded after them says
/// when they are done.
pub trait DeviceTarget: Send + Sync + 'static {
    /// Device memory holding one tensor. Dropping it gives the memory back at once: the
    /// cache drops a buffer only when no queued copy into it can still run.
    type Buffer: Send + Sync + 'static;
    /// Host memory that copies to the device start from (page-locked on a GPU).
    type Staging: Send + 'static;
    /// A marker after the copies queued so far; waiting on it waits for them.
    type Fence: Send + 'static;

    /// A short description for messages and benchmarks (`host memory`, `NVIDIA H100 …`).
    fn describe(&self) -> String;

    /// Device memory for `bytes` bytes. When there is no room, fails with
    /// [`StoreError::DeviceAlloc`] (the cache then evicts and tries again); any other
    /// error is a device failure.
    fn alloc(&self, bytes: u64) -> Result<Self::Buffer, StoreError>;

    /// A staging buffer of at least `bytes` bytes whose first byte is aligned to
    /// [`STAGING_ALIGN`], as direct (O_DIRECT) reads need.
    fn alloc_staging(&self, bytes: usize) -> Result<Self::Staging, StoreError>;

    /// `count` staging buffers as [`DeviceTarget::alloc_staging`] makes them, at once. A
    /// device may make them cheaper together (on a GPU: one page-locked region for all);
    /// by default they are allocated one at a time. On failure none is kept.
    fn alloc_staging_ring(
        &self,
        count: usize,
        bytes: usize,
    ) -> Result<Vec<Self::Staging>, StoreError> {
        (0..count).map(|_| self.alloc_staging(bytes)).collect()
    }

    /// The staging buffer's bytes, writable, once every copy queued from it has finished.
    fn staging_bytes<'a>(&self, staging: &'a mut Self::Staging)
        -> Result<&'a mut [u8], StoreError>;

    /// Queues a copy of `staging[src]` into `dst` starting `dst_offset` bytes in. The
    /// staging buffer may not be written again until the copy has finished
    /// ([`DeviceTarget::staging_bytes`] waits for it).
    fn copy_to_device(
        &self,
        staging: &mut Self::Staging,
        src: Range<usize>,
        dst: &mut Self::Buffer,
        dst_offset: u64,
    ) -> Result<(), StoreError>;

    /// A fence after every copy queued so far (from any thread).
    fn record_fence(&self) -> Result<Self::Fence, StoreError>;

    /// Blocks until the copies before `fence` have finished.
    fn wait_fence(&self, fence: &Self::Fence) -> Result<(), StoreError>;

    /// Blocks until every copy queued so far has finished.
    fn synchronize(&self) -> Result<(), StoreError>;

    /// Device allocations this target has made (an arena counts once).
    fn device_allocations(&self) -> u64;
}

/// Alignment of staging buffers: the block size direct reads need on every common
/// file system.
pub const STAGING_ALIGN: usize = 4096;
