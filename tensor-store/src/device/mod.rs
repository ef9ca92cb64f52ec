//! The device cache and upload pipeline: tensors go to a device as their raw GGUF
//! blocks (never expanded on the host), once however many ask for them.
//!
//! - [`DeviceCache`] maps each tensor of a [`crate::TensorStore`] to a device buffer. Any
//!   number of concurrent requests ([`DeviceCache::get`] from threads,
//!   [`DeviceCache::get_async`] from async tasks) cause one upload and share its buffer.
//!   A memory budget bounds what it holds; tensors nobody uses are evicted least
//!   recently used first and uploaded again when asked for. A tensor that cannot fit
//!   fails with [`crate::StoreError::DeviceOutOfMemory`] and leaves the cache usable.
//! - Its pipeline reads the file with several threads (`pread`, optionally O_DIRECT) into
//!   a ring of staging buffers and copies them to the device asynchronously, in the
//!   order of an [`UploadOrder`] (layer by layer). A tensor is published only once its
//!   copies have finished; [`DeviceCache::get_group`] waits for one layer while later
//!   ones are still in flight; a request moves a tensor to the front.
//! - A stop flag ([`CacheConfig::stop`]) makes every blocking wait (the eager load, a
//!   request for a tensor still uploading, [`DeviceCache::wait_idle`]) cancel the
//!   uploads and fail with [`crate::StoreError::Interrupted`] within [`STOP_POLL`].
//!   Dropping the cache, interrupted or not, waits for the copies in flight and frees
//!   every buffer it allocated.
//! - [`ReadAhead`] reads a cold file into the page cache in upload order from a thread
//!   of its own, from before the device is ready, so that the readers find most pages
//!   there.
//! - [`upload_part`] puts a rectangular [`TensorPart`] of a tensor (some of its rows, or
//!   a range of columns in each row: one device's share of a tensor-parallel weight) on
//!   a device, outside any cache: the caller owns the result. It gathers the part
//!   through two page-locked staging buffers, the copy of one overlapping the gathering
//!   of the next.
//! - [`DeviceTarget`] is all it needs from a device: [`HipTarget`] is a GPU (one arena,
//!   one copy stream, page-locked staging), [`HostTarget`] is host memory, for tests and
//!   CPU benchmarks, through exactly the same cache code.
//!
//! This module starts threads (the readers and one publisher) but no async runtime; its
//! futures work on any executor.

mod cache;
mod files;
mod hip;
mod host;
mod loader;
mod order;
mod part;
mod pipeline;
mod progress;
pub mod read_ahead;
mod slot;
mod target;
mod worker;

pub use cache::{CacheStats, DeviceTensor};
pub use hip::{HipTarget, TENSOR_ALIGN};
pub use host::{HostBuffer, HostStaging, HostTarget, HostTargetStats};
pub use loader::{
    CacheConfig, DeviceCache, GroupFuture, StagingRing, TensorFuture, UploadMode, STOP_POLL,
};
pub use order::{UploadGroup, UploadOrder};
pub use part::{upload_part, upload_part_in, PartStaging, TensorPart, PART_STAGING_BYTES};
pub use progress::{Progress, ProgressCallback};
pub use read_ahead::ReadAhead;
pub use target::{DeviceTarget, STAGING_ALIGN};
