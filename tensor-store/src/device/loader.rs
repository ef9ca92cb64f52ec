//! [`DeviceCache`]: the public face of the device cache and its upload pipeline.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use super::cache::{Cache, CacheStats, DeviceTensor, Lookup};
use super::files::{ShardFiles, DIRECT_SLACK};
use super::order::UploadOrder;
use super::pipeline::{Shared, SharedParts};
use super::progress::{Progress, ProgressCallback, ProgressTracker};
use super::slot::{Failure, Slot};
use super::target::DeviceTarget;
use crate::{StoreError, TensorHandle, TensorStore};

/// When tensors go to the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UploadMode {
    /// Upload the whole order before [`DeviceCache::new`] returns.
    Eager,
    /// Start uploading the order in the background and return at once.
    #[default]
    Background,
    /// Upload nothing until a tensor is asked for.
    Lazy,
}

/// Settings of a [`DeviceCache`].
#[derive(Clone, Debug)]
pub struct CacheConfig {
    pub mode: UploadMode,
    /// Device bytes the cache may hold; `None` for no limit but the device's.
    pub budget: Option<u64>,
    /// Reader threads copying from the file into staging buffers when the page cache
    /// holds most of the file (or reads are direct).
    pub readers: usize,
    /// Reader threads when the page cache holds less than half of the file (sampled at
    /// the cache's start): a disk serves one or two sequential streams faster than
    /// many interleaved ones.
    pub cold_readers: usize,
    /// Staging buffers in the ring: host memory in use is about
    /// `staging_buffers × chunk_bytes`, whatever the model's size. The first is allocated
    /// before [`DeviceCache::new`] returns, the others on a thread of their own, together
    /// ([`CacheConfig::staging_ring`] says how).
    pub staging_buffers: usize,
    /// How the staging buffers after the first are allocated.
    pub staging_ring: StagingRing,
    /// Bytes read (and copied) per job.
    pub chunk_bytes: usize,
    /// Read with O_DIRECT, past the page cache (faster from a cold disk; falls back to
    /// ordinary reads where the file system refuses it).
    pub direct_io: bool,
    /// A stop request (a Ctrl-C handler's flag, say). A cache is not built once it is
    /// set, and from then on the cache's waits give up within [`STOP_POLL`]: the eager load in [`DeviceCache::new`], a request
    /// waiting for an upload ([`DeviceCache::get`], [`DeviceCache::get_many`],
    /// [`DeviceCache::get_group`]) and [`DeviceCache::wait_idle`] cancel every upload, as
    /// [`DeviceCache::cancel`] does, and fail with [`StoreError::Interrupted`]. Only a
    /// wait looks at it (a relaxed load each [`STOP_POLL`]): a resident tensor is handed
    /// out without it.
    pub stop: Option<Arc<AtomicBool>>,
}

/// How a [`DeviceCache`] allocates the staging buffers after the first
/// ([`CacheConfig::staging_ring`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StagingRing {
    /// From two regions, each registered at once ([`DeviceTarget::alloc_staging_ring`]),
    /// falling back to one at a time if that fails.
    #[default]
    Region,
    /// One at a time, each page-locked on its own, as the readers start (to compare).
    Separate,
}

impl StagingRing {
    /// The setting a word names, `region` or `separate` (surrounding white space
    /// ignored); `None` for any other.
    pub fn parse(text: &str) -> Option<StagingRing> {
        match text.trim() {
            "region" => Some(StagingRing::Region),
            "separate" => Some(StagingRing::Separate),
            _ => None,
        }
    }

    /// The word [`StagingRing::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            StagingRing::Region => "region",
            StagingRing::Separate => "separate",
        }
    }
}

/// How often a wait looks at [`CacheConfig::stop`].
pub const STOP_POLL: Duration = Duration::from_millis(10);

impl Default for CacheConfig {
    fn default() -> CacheConfig {
        // Half the cores, 2 to 8: reading from the page cache is a memory copy that
        // scales with threads; compute keeps the other half.
        let readers = std::thread::available_parallelism().map_or(4, |n| (n.get() / 2).clamp(2, 8));
        CacheConfig {
            mode: UploadMode::Background,
            budget: None,
            readers,
            // Measured on the H100 machine's disk with the 4 GiB model, page cache
            // dropped (bench-load --cold): 2 readers of 4 MiB jobs made it resident in
            // 2.60 s, 8 readers in 3.32 s, one reader of 16 MiB jobs in 2.66 s.
            cold_readers: 2,
            // Measured on an H100 with a 4 GiB model from the page cache (bench-load's
            // sweep): 4 MiB jobs in a ring of 16 upload at 34 GB/s with 8 readers,
            // against 26 GB/s for 16 MiB jobs in a ring of 8, and hold less memory.
            staging_buffers: 16,
            staging_ring: StagingRing::Region,
            chunk_bytes: 4 << 20,
            direct_io: false,
            stop: None,
        }
    }
}

impl CacheConfig {
    /// Starts making resident, on threads of their own, the host memory of the staging
    /// regions that a GPU upload with this configuration will register
    /// ([`hip_backend::prepare_pinned_ring`]): their page faults then happen before the
    /// upload starts (while the GPU runtime starts, say) rather than while the first
    /// weights wait for them. Nothing to do when the ring is allocated a buffer at a
    /// time ([`StagingRing::Separate`]). Memory an upload does not take stays mapped until
    /// [`hip_backend::release_prepared_rings`].
    pub fn prepare_gpu_staging(&self) {
        if self.staging_ring != StagingRing::Region {
            return;
        }
        let len = self.staging_len();
        for part in super::pipeline::staging_regions(self.staging_buffers.saturating_sub(1)) {
            if part > 0 {
                hip_backend::prepare_pinned_ring::<u8>(part, len);
            }
        }
    }

    /// Bytes of each staging buffer: a chunk, and the slack direct reads may need.
    fn staging_len(&self) -> usize {
        self.chunk_bytes + DIRECT_SLACK
    }
}

/// Largest chunk accepted: a staging buffer is this big.
const MAX_CHUNK_BYTES: usize = 1 << 30;

impl CacheConfig {
    fn validate(&self) -> Result<(), StoreError> {
        let invalid = |name, value: usize, reason| {
            Err(StoreError::InvalidCacheConfig {
                name,
                value: value as u64,
                reason,
            })
        };
        if self.readers == 0 || self.readers > 256 {
            return invalid("readers", self.readers, "must be between 1 and 256");
        }
        if self.cold_readers == 0 || self.cold_readers > 256 {
            return invalid(
                "cold_readers",
                self.cold_readers,
                "must be between 1 and 256",
            );
        }
        if self.staging_buffers == 0 || self.staging_buffers > 1024 {
            return invalid(
                "staging_buffers",
                self.staging_buffers,
                "must be between 1 and 1024",
            );
        }
        if !(4096..=MAX_CHUNK_BYTES).contains(&self.chunk_bytes) {
            return invalid(
                "chunk_bytes",
                self.chunk_bytes,
                "must be between 4 KiB and 1 GiB",
            );
        }
        Ok(())
    }
}

/// Tensors of one model on one device: uploaded once however many ask (single-flight),
/// in layer order in the background, or on first use; held within a memory budget,
/// least recently used evicted first.
///
/// Requests come from threads ([`DeviceCache::get`]) or async tasks
/// ([`DeviceCache::get_async`]); a request for a tensor not yet uploaded moves it to the
/// front of the queue. Dropping the cache cancels what is in flight and waits for it.
pub struct DeviceCache<T: DeviceTarget> {
    shared: Arc<Shared<T>>,
    order: UploadOrder,
    readers: Vec<JoinHandle<()>>,
    publisher: Option<JoinHandle<()>>,
    allocator: Option<JoinHandle<()>>,
}

impl<T: DeviceTarget> DeviceCache<T> {
    /// A cache of `store`'s tensors on `target`, uploading `order` as `config.mode` says.
    pub fn new(
        target: T,
        store: &TensorStore,
        order: UploadOrder,
        config: CacheConfig,
    ) -> Result<DeviceCache<T>, StoreError> {
        DeviceCache::build(target, store, order, config, None)
    }

    /// As [`DeviceCache::new`], telling `callback` about every completed upload.
    pub fn with_progress(
        target: T,
        store: &TensorStore,
        order: UploadOrder,
        config: CacheConfig,
        callback: impl Fn(&Progress) + Send + Sync + 'static,
    ) -> Result<DeviceCache<T>, StoreError> {
        DeviceCache::build(target, store, order, config, Some(Box::new(callback)))
    }

    fn build(
        target: T,
        store: &TensorStore,
        order: UploadOrder,
        config: CacheConfig,
        callback: Option<ProgressCallback>,
    ) -> Result<DeviceCache<T>, StoreError> {
        config.validate()?;
        if config.stop.as_deref().is_some_and(stop_requested) {
            return Err(StoreError::Interrupted);
        }
        let handles: Vec<TensorHandle> = store.tensors().collect();
        for handle in order.tensors() {
            check_member(&handles, handle)?;
        }
        let paths: Vec<PathBuf> = store.paths().map(|p| p.to_owned()).collect();
        let shard_of = handles
            .iter()
            .map(|h| paths.iter().position(|p| p == h.path()).unwrap_or(0))
            .collect();
        let files = ShardFiles::open(&paths, config.direct_io)?;
        let readers = readers_for(&config, &files);
        // One staging buffer now (so a failure shows here); the others are allocated
        // while the readers already work (page-locked memory is slow to allocate, even
        // in regions: see `Shared::grow_staging`).
        let staging_len = config.staging_len();
        let staging = vec![target.alloc_staging(staging_len)?];
        let prefetch = match config.mode {
            UploadMode::Lazy => Vec::new(),
            UploadMode::Eager | UploadMode::Background => {
                order.tensors().iter().map(TensorHandle::index).collect()
            }
        };
        let n_tensors = handles.len();
        let parts = SharedParts {
            cache: Cache::new(
                Arc::new(target),
                n_tensors,
                config.budget.unwrap_or(u64::MAX),
            ),
            handles,
            shard_of,
            files,
            chunk_bytes: config.chunk_bytes as u64,
            staging,
            prefetch,
            progress: ProgressTracker::new(&order, n_tensors, callback),
            stop: config.stop,
        };
        let (sender, receiver) = mpsc::channel();
        let shared = Arc::new(Shared::new(parts, sender));
        let mut cache = DeviceCache {
            shared: Arc::clone(&shared),
            order,
            readers: Vec::new(),
            publisher: None,
            allocator: None,
        };
        let spawn_error = |source| StoreError::Io {
            path: store.path().to_owned(),
            source,
        };
        let publisher = Arc::clone(&shared);
        cache.publisher = Some(
            std::thread::Builder::new()
                .name("upload-publisher".into())
                .spawn(move || publisher.run_publisher(receiver))
                .map_err(spawn_error)?,
        );
        for n in 0..readers {
            let reader = Arc::clone(&shared);
            cache.readers.push(
                std::thread::Builder::new()
                    .name(format!("upload-reader-{n}"))
                    .spawn(move || reader.run_reader())
                    .map_err(spawn_error)?,
            );
        }
        if config.staging_buffers > 1 {
            let allocator = Arc::clone(&shared);
            let more = config.staging_buffers - 1;
            let ring = config.staging_ring;
            cache.allocator = Some(
                std::thread::Builder::new()
                    .name("upload-staging".into())
                    .spawn(move || allocator.grow_staging(more, staging_len, ring))
                    .map_err(spawn_error)?,
            );
        }
        if config.mode == UploadMode::Eager {
            cache.wait_idle()?;
        }
        Ok(cache)
    }

    /// The device.
    pub fn target(&self) -> &T {
        &self.shared.cache.target
    }

    /// The upload order and its groups.
    pub fn order(&self) -> &UploadOrder {
        &self.order
    }

    fn index_of(&self, handle: &TensorHandle) -> Result<usize, StoreError> {
        check_member(&self.shared.handles, handle)
    }

    /// The tensor on the device: at once when resident, else after its upload (started
    /// now, or moved to the front of the queue). Blocks the calling thread.
    pub fn get(&self, handle: &TensorHandle) -> Result<DeviceTensor<T>, StoreError> {
        let idx = self.index_of(handle)?;
        loop {
            let slot = match self.shared.request(idx) {
                Ok(tensor) => return Ok(tensor),
                Err(slot) => slot,
            };
            match self.shared.wait_slot(&slot)? {
                Ok(tensor) => return Ok(tensor),
                Err(Failure::Retry) => continue,
                Err(failure) => return Err(failure.into_error(handle.name())),
            }
        }
    }

    /// Several tensors: all are queued (in the order given, ahead of everything else)
    /// before waiting for any, so their uploads overlap.
    pub fn get_many<'a>(
        &self,
        handles: impl IntoIterator<Item = &'a TensorHandle>,
    ) -> Result<Vec<DeviceTensor<T>>, StoreError> {
        let handles: Vec<&TensorHandle> = handles.into_iter().collect();
        let indices = handles
            .iter()
            .map(|h| self.index_of(h))
            .collect::<Result<Vec<_>, _>>()?;
        // Each request goes to the front: ask in reverse to keep the order given.
        let mut pending: Vec<_> = indices
            .iter()
            .rev()
            .map(|&idx| self.shared.request(idx))
            .collect();
        pending.reverse();
        let mut out = Vec::with_capacity(handles.len());
        for (handle, request) in handles.iter().zip(pending) {
            match request {
                Ok(tensor) => out.push(tensor),
                Err(slot) => match self.shared.wait_slot(&slot)? {
                    Ok(tensor) => out.push(tensor),
                    Err(Failure::Retry) => out.push(self.get(handle)?),
                    Err(failure) => return Err(failure.into_error(handle.name())),
                },
            }
        }
        Ok(out)
    }

    /// The tensors of group `group` of the upload order (see [`UploadOrder::groups`]).
    pub fn get_group(&self, group: usize) -> Result<Vec<DeviceTensor<T>>, StoreError> {
        self.get_many(self.order.group_tensors(group))
    }

    /// The tensor on the device, for async code: the request is made now (so the tensor
    /// moves to the front of the queue at once); the future resolves when it is resident.
    pub fn get_async(&self, handle: &TensorHandle) -> TensorFuture<T> {
        match self.index_of(handle) {
            Ok(idx) => TensorFuture::start(Arc::clone(&self.shared), idx),
            Err(error) => TensorFuture {
                shared: Arc::clone(&self.shared),
                idx: 0,
                state: FutureState::Failed(Some(error)),
            },
        }
    }

    /// The tensors of group `group`, for async code.
    pub fn get_group_async(&self, group: usize) -> GroupFuture<T> {
        let tensors = self.order.group_tensors(group);
        let mut futures: Vec<_> = tensors.iter().rev().map(|h| self.get_async(h)).collect();
        futures.reverse();
        GroupFuture {
            results: futures.iter().map(|_| None).collect(),
            futures,
        }
    }

    /// True when the tensor is resident now.
    pub fn is_resident(&self, handle: &TensorHandle) -> bool {
        self.index_of(handle)
            .is_ok_and(|idx| self.shared.cache.is_ready(idx))
    }

    /// Blocks until no upload is queued or running. Fails with the background upload's
    /// first error, if it had one, or with [`StoreError::Interrupted`] when the stop flag
    /// ([`CacheConfig::stop`]) is set meanwhile.
    pub fn wait_idle(&self) -> Result<(), StoreError> {
        self.shared.wait_idle()
    }

    /// Cancels every queued and running upload and waits for the copies in flight.
    /// Waiting requests fail with [`StoreError::LoadCancelled`]; no partly uploaded
    /// tensor is ever published. The cache stays usable: later requests upload again.
    pub fn cancel(&self) {
        self.shared.cancel();
    }

    /// True when the readers bypass the page cache for every file: direct reads were
    /// asked for and the file system allows them (so far).
    pub fn reads_direct(&self) -> bool {
        self.shared.reads_direct()
    }

    pub fn progress(&self) -> Progress {
        self.shared.progress.snapshot()
    }

    pub fn stats(&self) -> CacheStats {
        self.shared.cache.stats()
    }
}

impl<T: DeviceTarget> Drop for DeviceCache<T> {
    fn drop(&mut self) {
        // Readers first (they finish the job in hand), then fail what is left and wait
        // for the publisher to drain, then the publisher.
        self.shared.shut_down();
        let join = |thread: JoinHandle<()>| {
            if thread.join().is_err() {
                tracing::error!("an upload thread panicked");
            }
        };
        self.allocator.take().into_iter().for_each(join);
        self.readers.drain(..).for_each(join);
        self.shared.cancel();
        self.shared.close_publisher();
        self.publisher.take().into_iter().for_each(join);
    }
}

/// The readers a cache starts: `cold_readers` when reads go through the page cache and
/// it holds less than half of the files, `readers` otherwise (or when the kernel does not
/// say).
fn readers_for(config: &CacheConfig, files: &ShardFiles) -> usize {
    if config.mode == UploadMode::Lazy || files.all_direct() {
        return config.readers;
    }
    let share = files.page_cache_share();
    let readers = match share {
        Some(share) if share < 0.5 => config.cold_readers,
        _ => config.readers,
    };
    tracing::debug!(
        page_cache_share = share.unwrap_or(f64::NAN),
        readers,
        "upload readers"
    );
    readers
}

fn stop_requested(stop: &AtomicBool) -> bool {
    stop.load(std::sync::atomic::Ordering::Relaxed)
}

/// The index of `handle` in `handles` (the store's tensors), or an error if it belongs
/// to another store.
fn check_member(handles: &[TensorHandle], handle: &TensorHandle) -> Result<usize, StoreError> {
    let idx = handle.index();
    match handles.get(idx) {
        Some(mine)
            if mine.path() == handle.path()
                && mine.name() == handle.name()
                && mine.file_range() == handle.file_range() =>
        {
            Ok(idx)
        }
        _ => Err(StoreError::ForeignTensor {
            tensor: handle.name().to_owned(),
            path: handle.path().to_owned(),
        }),
    }
}

impl<T: DeviceTarget> Shared<T> {
    /// Waits for an upload's outcome; when the stop flag is set meanwhile, cancels every
    /// upload and fails.
    fn wait_slot(&self, slot: &Slot<T>) -> Result<super::slot::Outcome<T>, StoreError> {
        match slot.wait_or_stop(self.stop.as_deref(), STOP_POLL) {
            Some(outcome) => Ok(outcome),
            None => {
                self.cancel();
                Err(StoreError::Interrupted)
            }
        }
    }

    /// Finds a tensor, or makes sure its upload is queued at the front, returning the
    /// slot to wait on. Never blocks on an upload.
    pub(crate) fn request(&self, idx: usize) -> Result<DeviceTensor<T>, Arc<Slot<T>>> {
        match self.cache.lookup_or_claim(idx) {
            Lookup::Ready(tensor) => Ok(tensor),
            Lookup::Wait(slot) => {
                self.bump(idx);
                Err(slot)
            }
            Lookup::Claimed(slot) => {
                if !self.enqueue_demand(idx) {
                    if let Some(slot) = self.cache.abandon(idx, None) {
                        slot.resolve(Err(Failure::Cancelled));
                    }
                }
                Err(slot)
            }
        }
    }
}

enum FutureState<T: DeviceTarget> {
    Ready(Option<DeviceTensor<T>>),
    Waiting(Arc<Slot<T>>),
    Failed(Option<StoreError>),
}

/// A tensor being made resident, for async code ([`DeviceCache::get_async`]). Polling
/// takes a lock only for the moment it looks at the outcome.
pub struct TensorFuture<T: DeviceTarget> {
    shared: Arc<Shared<T>>,
    idx: usize,
    state: FutureState<T>,
}

impl<T: DeviceTarget> TensorFuture<T> {
    fn start(shared: Arc<Shared<T>>, idx: usize) -> TensorFuture<T> {
        let state = match shared.request(idx) {
            Ok(tensor) => FutureState::Ready(Some(tensor)),
            Err(slot) => FutureState::Waiting(slot),
        };
        TensorFuture { shared, idx, state }
    }
}

impl<T: DeviceTarget> Future for TensorFuture<T> {
    type Output = Result<DeviceTensor<T>, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            let outcome = match &mut this.state {
                FutureState::Ready(tensor) => match tensor.take() {
                    Some(tensor) => return Poll::Ready(Ok(tensor)),
                    None => panic!("TensorFuture polled after completion"),
                },
                FutureState::Failed(error) => match error.take() {
                    Some(error) => return Poll::Ready(Err(error)),
                    None => panic!("TensorFuture polled after completion"),
                },
                FutureState::Waiting(slot) => match slot.poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(outcome) => outcome,
                },
            };
            this.state = match outcome {
                Ok(tensor) => FutureState::Ready(Some(tensor)),
                Err(Failure::Retry) => match this.shared.request(this.idx) {
                    Ok(tensor) => FutureState::Ready(Some(tensor)),
                    Err(slot) => FutureState::Waiting(slot),
                },
                Err(failure) => {
                    let name = this.shared.handles[this.idx].name();
                    FutureState::Failed(Some(failure.into_error(name)))
                }
            };
        }
    }
}

/// The tensors of a group being made resident ([`DeviceCache::get_group_async`]).
pub struct GroupFuture<T: DeviceTarget> {
    futures: Vec<TensorFuture<T>>,
    results: Vec<Option<DeviceTensor<T>>>,
}

impl<T: DeviceTarget> Future for GroupFuture<T> {
    type Output = Result<Vec<DeviceTensor<T>>, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut pending = false;
        for (future, result) in this.futures.iter_mut().zip(&mut this.results) {
            if result.is_some() {
                continue;
            }
            match Pin::new(future).poll(cx) {
                Poll::Ready(Ok(tensor)) => *result = Some(tensor),
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => pending = true,
            }
        }
        if pending {
            return Poll::Pending;
        }
        Poll::Ready(Ok(this
            .results
            .iter_mut()
            .filter_map(Option::take)
            .collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_staging_ring_settings_read_their_own_names() {
        for ring in [StagingRing::Region, StagingRing::Separate] {
            assert_eq!(StagingRing::parse(ring.name()), Some(ring));
        }
        assert_eq!(
            StagingRing::parse(" separate\n"),
            Some(StagingRing::Separate)
        );
        assert_eq!(StagingRing::parse(""), None);
        assert_eq!(StagingRing::parse("other"), None);
        assert_eq!(CacheConfig::default().staging_ring, StagingRing::Region);
    }
}
