//! The upload pipeline: reader threads fill staging buffers from the file and queue
//! copies to the device; a publisher thread waits for each tensor's copies and makes it
//! `Ready`.
//!
//! ```text
//!  queue (demand first, then background order)
//!    │ next job: up to `chunk_bytes` of the file, pieces of one or more adjacent tensors
//!    ▼
//!  readers ×N: pread (or O_DIRECT) into a free staging buffer of the ring
//!    │ copy each piece into its tensor's device buffer (async, one copy stream)
//!    ▼ last piece of a tensor queued → record a fence
//!  publisher: wait fence → tensor Ready, slot resolved, progress reported
//! ```
//!
//! Everything the readers share sits in one [`Queue`] under one mutex, held only to pick
//! work and to account for it, never during a read or a wait. A tensor is published only
//! after a fence recorded after its last copy has passed, so no one ever sees a
//! half-uploaded tensor; a tensor whose upload fails or is cancelled midway goes back to
//! `Absent`, and its buffer is dropped only after a fence proves no copy into it runs.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use super::cache::{Cache, NoRoom};
use super::files::ShardFiles;
use super::loader::StagingRing;
use super::progress::ProgressTracker;
use super::slot::Failure;
use super::target::DeviceTarget;
use crate::{StoreError, TensorHandle};

/// Files closer than this are read as one chunk, gap included (GGUF pads tensors to its
/// alignment, 32 bytes by default).
const MAX_GAP: u64 = 4096;
/// A tensor joins a chunk another tensor started only if at least this much of it fits.
const MIN_JOINED_PIECE: u64 = 256 << 10;

/// Staging buffers in [`Shared::grow_staging`]'s first region: enough for the readers to
/// go faster than on the one buffer they start with, few enough to be ready soon (its
/// pages are faulted in and locked before any buffer of it is used).
const FIRST_REGION: usize = 3;

/// The buffers of [`Shared::grow_staging`]'s two regions for `count` buffers.
pub(crate) fn staging_regions(count: usize) -> [usize; 2] {
    [count.min(FIRST_REGION), count.saturating_sub(FIRST_REGION)]
}

/// Where a tensor stands in the pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Queued {
    /// Not queued: absent, ready, or with the publisher.
    No,
    Prefetch,
    Demand,
    /// Its buffer is allocated and its pieces are being read and copied.
    Active,
}

/// A tensor whose upload has started.
pub(super) struct Active<T: DeviceTarget> {
    pub(super) idx: usize,
    pub(super) size: u64,
    /// Requested by a caller, rather than part of the background upload.
    pub(super) demand: bool,
    /// Bytes handed to readers.
    pub(super) dispatched: u64,
    /// Bytes whose copies are queued.
    pub(super) copied: u64,
    /// `None` once abandoned: readers skip pieces of it.
    pub(super) buffer: Arc<Mutex<Option<T::Buffer>>>,
}

impl<T: DeviceTarget> Active<T> {
    /// Takes the buffer, unless it was taken already (readers then skip its pieces).
    pub(super) fn take_buffer(&self) -> Option<T::Buffer> {
        self.buffer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// A piece of one tensor within a chunk.
pub(super) struct Piece<T: DeviceTarget> {
    pub(super) idx: usize,
    pub(super) tensor_offset: u64,
    pub(super) len: u64,
    pub(super) chunk_offset: u64,
    pub(super) buffer: Arc<Mutex<Option<T::Buffer>>>,
}

/// One read: a file range and the tensor pieces in it.
pub(super) struct Job<T: DeviceTarget> {
    pub(super) shard: usize,
    pub(super) file_start: u64,
    pub(super) file_end: u64,
    pub(super) epoch: u64,
    pub(super) staging: T::Staging,
    pub(super) pieces: Vec<Piece<T>>,
}

pub(crate) enum Message<T: DeviceTarget> {
    Publish {
        idx: usize,
        fence: Result<T::Fence, StoreError>,
        buffer: T::Buffer,
    },
    /// Buffers of abandoned uploads, to drop once `fence` has passed.
    Bury {
        fence: Result<T::Fence, StoreError>,
        buffers: Vec<T::Buffer>,
        bytes: u64,
    },
}

/// What the pipeline's threads share, under one mutex.
pub(crate) struct Queue<T: DeviceTarget> {
    pub(crate) status: Vec<Queued>,
    pub(super) demand: VecDeque<usize>,
    pub(super) prefetch: VecDeque<usize>,
    pub(super) prefetch_stopped: bool,
    pub(super) active: Vec<Active<T>>,
    pub(super) staging: VecDeque<T::Staging>,
    /// Readers between picking a job and accounting for it.
    pub(super) busy: usize,
    /// Messages sent to the publisher and not yet handled.
    pub(super) pending: usize,
    /// Raised by every cancellation: jobs of an earlier epoch are not copied.
    pub(super) epoch: u64,
    pub(super) shutdown: bool,
    /// The first error of the background upload, for `wait_idle`.
    pub(super) prefetch_error: Option<Arc<StoreError>>,
}

/// Tensors to fail once the queue lock is released: (index, bytes allocated, why).
pub(super) type Abandoned = Vec<(usize, Option<u64>, Failure)>;

pub(crate) struct Shared<T: DeviceTarget> {
    pub(crate) cache: Cache<T>,
    /// Every tensor of the store, by index.
    pub(crate) handles: Vec<TensorHandle>,
    pub(super) shard_of: Vec<usize>,
    pub(super) files: ShardFiles,
    pub(super) chunk_bytes: u64,
    pub(super) queue: Mutex<Queue<T>>,
    /// Signalled on every change of the queue: work, staging, publishes, shutdown.
    pub(super) signal: Condvar,
    publisher: Mutex<Option<Sender<Message<T>>>>,
    pub(crate) progress: ProgressTracker,
    /// The stop request waits look at (`CacheConfig::stop`).
    pub(crate) stop: Option<Arc<AtomicBool>>,
}

pub(crate) struct SharedParts<T: DeviceTarget> {
    pub(crate) cache: Cache<T>,
    pub(crate) handles: Vec<TensorHandle>,
    pub(crate) shard_of: Vec<usize>,
    pub(crate) files: ShardFiles,
    pub(crate) chunk_bytes: u64,
    pub(crate) staging: Vec<T::Staging>,
    pub(crate) prefetch: Vec<usize>,
    pub(crate) progress: ProgressTracker,
    pub(crate) stop: Option<Arc<AtomicBool>>,
}

impl<T: DeviceTarget> Shared<T> {
    pub(crate) fn new(parts: SharedParts<T>, publisher: Sender<Message<T>>) -> Shared<T> {
        let mut status = vec![Queued::No; parts.handles.len()];
        let mut prefetch = VecDeque::with_capacity(parts.prefetch.len());
        for idx in parts.prefetch {
            if parts.cache.claim(idx) {
                status[idx] = Queued::Prefetch;
                prefetch.push_back(idx);
            }
        }
        Shared {
            cache: parts.cache,
            handles: parts.handles,
            shard_of: parts.shard_of,
            files: parts.files,
            chunk_bytes: parts.chunk_bytes,
            queue: Mutex::new(Queue {
                status,
                demand: VecDeque::new(),
                prefetch,
                prefetch_stopped: false,
                active: Vec::new(),
                staging: parts.staging.into(),
                busy: 0,
                pending: 0,
                epoch: 0,
                shutdown: false,
                prefetch_error: None,
            }),
            signal: Condvar::new(),
            publisher: Mutex::new(Some(publisher)),
            progress: parts.progress,
            stop: parts.stop,
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Queue<T>> {
        // The queue's invariants are restored before any call that can panic.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn wait<'a>(&self, guard: MutexGuard<'a, Queue<T>>) -> MutexGuard<'a, Queue<T>> {
        self.signal
            .wait(guard)
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn send(&self, message: Message<T>) {
        let sender = self
            .publisher
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(sender) = sender.as_ref() {
            // The publisher outlives every sender call: it is joined after shutdown.
            let _ = sender.send(message);
        }
    }

    /// Drops the sender so the publisher's loop ends once it has drained its queue.
    pub(crate) fn close_publisher(&self) {
        self.publisher
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }

    /// Queues a tensor its caller just claimed, ahead of everything waiting. False when
    /// the pipeline is shut down (the caller fails the claim).
    pub(crate) fn enqueue_demand(&self, idx: usize) -> bool {
        let mut q = self.lock();
        if q.shutdown {
            return false;
        }
        if q.status[idx] == Queued::No {
            q.status[idx] = Queued::Demand;
            q.demand.push_front(idx);
        }
        drop(q);
        self.signal.notify_all();
        true
    }

    /// Moves a queued tensor to the front of the queue.
    pub(crate) fn bump(&self, idx: usize) {
        let mut q = self.lock();
        match q.status[idx] {
            Queued::Prefetch => {
                // Its stale place in the background order is skipped when reached.
                q.status[idx] = Queued::Demand;
                q.demand.push_front(idx);
            }
            Queued::Demand => {
                if let Some(at) = q.demand.iter().position(|&i| i == idx) {
                    q.demand.remove(at);
                }
                q.demand.push_front(idx);
            }
            Queued::Active | Queued::No => return,
        }
        drop(q);
        self.signal.notify_all();
    }

    /// Adds `count` staging buffers of `len` bytes to the ring: from two regions where
    /// the target has them ([`DeviceTarget::alloc_staging_ring`]), [`FIRST_REGION`]
    /// buffers and then the rest, else (with [`StagingRing::Separate`], or when a region
    /// is refused) one at a time, so the readers use each as soon as it exists. Stops at
    /// shutdown or at the first failure (the ring works with what it has).
    pub(crate) fn grow_staging(&self, count: usize, len: usize, ring: StagingRing) {
        let started = std::time::Instant::now();
        let mut added = 0;
        let mut region = false;
        if ring == StagingRing::Region {
            // A few buffers first, so that the readers go faster soon; the rest after.
            for part in staging_regions(count) {
                if part == 0 || self.lock().shutdown {
                    continue;
                }
                match self.cache.target.alloc_staging_ring(part, len) {
                    Ok(ring) => {
                        added += ring.len();
                        region = true;
                        self.lock().staging.extend(ring);
                        self.signal.notify_all();
                        tracing::trace!(
                            added,
                            ms = started.elapsed().as_secs_f64() * 1e3,
                            "staging region ready"
                        );
                    }
                    Err(error) => {
                        tracing::warn!(
                            %error,
                            "staging ring: no shared region, allocating its buffers one at a time"
                        );
                        break;
                    }
                }
            }
        }
        while added < count && !self.lock().shutdown {
            match self.cache.target.alloc_staging(len) {
                Ok(staging) => self.lock().staging.push_back(staging),
                Err(error) => {
                    tracing::warn!(%error, "staging ring stays smaller than asked");
                    break;
                }
            }
            added += 1;
            self.signal.notify_all();
        }
        tracing::debug!(
            added,
            region,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "staging buffers allocated"
        );
    }

    /// True when the readers bypass the page cache (O_DIRECT) for every file.
    pub(crate) fn reads_direct(&self) -> bool {
        self.files.all_direct()
    }

    pub(crate) fn shut_down(&self) {
        self.lock().shutdown = true;
        self.signal.notify_all();
    }

    /// Blocks until nothing is queued, running or waiting for the publisher; returns the
    /// background upload's first error.
    pub(crate) fn wait_idle(&self) -> Result<(), StoreError> {
        let mut q = self.lock();
        while !q.is_idle() {
            q = match self.stop.as_deref() {
                None => self.wait(q),
                Some(stop) if stop.load(Ordering::Relaxed) => {
                    drop(q);
                    self.cancel();
                    return Err(StoreError::Interrupted);
                }
                Some(_) => {
                    self.signal
                        .wait_timeout(q, super::loader::STOP_POLL)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
        match &q.prefetch_error {
            Some(error) => Err(StoreError::LoadFailed {
                tensor: "(background upload)".to_owned(),
                source: Arc::clone(error),
            }),
            None => Ok(()),
        }
    }

    /// Cancels every queued and running upload: readers stop taking work, copies in
    /// flight are waited for, and no partly copied tensor is published. Tensors whose
    /// copies were all queued are published. Requests after this start new uploads.
    pub(crate) fn cancel(&self) {
        let mut q = self.lock();
        q.epoch += 1;
        q.prefetch_stopped = true;
        let mut abandoned: Abandoned = Vec::new();
        for idx in std::mem::take(&mut q.demand)
            .into_iter()
            .chain(std::mem::take(&mut q.prefetch))
        {
            if matches!(q.status[idx], Queued::Demand | Queued::Prefetch) {
                q.status[idx] = Queued::No;
                abandoned.push((idx, None, Failure::Cancelled));
            }
        }
        let mut buffers = Vec::new();
        for active in std::mem::take(&mut q.active) {
            q.status[active.idx] = Queued::No;
            buffers.extend(active.take_buffer());
            abandoned.push((active.idx, Some(active.size), Failure::Cancelled));
        }
        // Readers still busy finish their read and skip their copies.
        while q.busy > 0 {
            q = self.wait(q);
        }
        self.fail_and_bury(q, abandoned, buffers);
        let mut q = self.lock();
        while q.pending > 0 {
            q = self.wait(q);
        }
    }

    /// Releases the lock, fails the abandoned tensors, and hands their buffers to the
    /// publisher to drop after a fence.
    pub(super) fn fail_and_bury(
        &self,
        mut q: MutexGuard<'_, Queue<T>>,
        abandoned: Abandoned,
        buffers: Vec<T::Buffer>,
    ) {
        let bytes: u64 = abandoned.iter().filter_map(|(_, size, _)| *size).sum();
        let bury = !buffers.is_empty() || bytes > 0;
        if bury {
            q.pending += 1;
        }
        drop(q);
        if bury {
            // Recorded after the buffers left the pieces' reach: every copy into them
            // was queued before it.
            let fence = self.cache.target.record_fence();
            self.send(Message::Bury {
                fence,
                buffers,
                bytes,
            });
        }
        for (idx, allocated, failure) in abandoned {
            if let Some(slot) = self.cache.abandon(idx, allocated) {
                slot.resolve(Err(failure));
            }
        }
        self.signal.notify_all();
    }

    /// The reader thread's loop.
    pub(crate) fn run_reader(&self) {
        while let Some(job) = self.next_job() {
            self.run_job(job);
        }
    }

    /// Blocks until there is a job and a free staging buffer; `None` at shutdown.
    fn next_job(&self) -> Option<Job<T>> {
        let mut q = self.lock();
        loop {
            if q.shutdown {
                return None;
            }
            if !q.staging.is_empty() {
                let (job, abandoned) = self.build_job(&mut q);
                if !abandoned.is_empty() {
                    self.fail_and_bury(q, abandoned, Vec::new());
                    q = self.lock();
                    continue;
                }
                if let Some(job) = job {
                    return Some(job);
                }
            }
            q = self.wait(q);
        }
    }
}

impl<T: DeviceTarget> Queue<T> {
    fn is_idle(&self) -> bool {
        // Stale entries (tensors moved to the demand queue, or given up) do not count.
        let queued = |deque: &VecDeque<usize>, kind| deque.iter().any(|&i| self.status[i] == kind);
        !queued(&self.demand, Queued::Demand)
            && (self.prefetch_stopped || !queued(&self.prefetch, Queued::Prefetch))
            && self.active.is_empty()
            && self.busy == 0
            && self.pending == 0
    }

    /// The next tensor to start, demand first; stale entries are dropped on the way.
    fn peek_fresh(&mut self) -> Option<(usize, bool)> {
        while let Some(&idx) = self.demand.front() {
            if self.status[idx] == Queued::Demand {
                return Some((idx, true));
            }
            self.demand.pop_front();
        }
        if self.prefetch_stopped {
            return None;
        }
        while let Some(&idx) = self.prefetch.front() {
            if self.status[idx] == Queued::Prefetch {
                return Some((idx, false));
            }
            self.prefetch.pop_front();
        }
        None
    }

    fn pop_fresh(&mut self, demand: bool) {
        if demand {
            self.demand.pop_front();
        } else {
            self.prefetch.pop_front();
        }
    }
}

impl<T: DeviceTarget> Shared<T> {
    /// Picks the next job: more of a tensor already started, else a new tensor (demand
    /// first), extended with the tensors adjacent to it in the file. Also returns the
    /// tensors that had to be given up on the way (no room, device errors).
    fn build_job(&self, q: &mut Queue<T>) -> (Option<Job<T>>, Abandoned) {
        let mut abandoned = Vec::new();
        let first = match q.active.iter().position(|a| a.dispatched < a.size) {
            Some(at) => Some(at),
            None => self.start_next(q, &mut abandoned),
        };
        let Some(at) = first else {
            return (None, abandoned);
        };
        let idx = q.active[at].idx;
        let file_start = self.handles[idx].file_range().start + q.active[at].dispatched;
        let staging = q.staging.pop_front().expect("checked by the caller");
        let mut job = Job {
            shard: self.shard_of[idx],
            file_start,
            file_end: file_start,
            epoch: q.epoch,
            staging,
            pieces: Vec::new(),
        };
        self.add_piece(&mut job, &mut q.active[at], self.chunk_bytes);
        // Join the tensors that follow in the file while the chunk has room.
        while job.file_end - job.file_start < self.chunk_bytes {
            let Some((next, demand)) = q.peek_fresh() else {
                break;
            };
            let range = self.handles[next].file_range();
            let size = range.end - range.start;
            let adjacent = self.shard_of[next] == job.shard
                && range.start >= job.file_end
                && range.start - job.file_end <= MAX_GAP;
            if !adjacent || range.start - job.file_start >= self.chunk_bytes {
                break;
            }
            let room = self.chunk_bytes - (range.start - job.file_start);
            if room < size.min(MIN_JOINED_PIECE) {
                break;
            }
            // Joining never evicts: a tensor that needs room starts a job of its own.
            let Ok(buffer) = self.cache.allocate(size, false) else {
                break;
            };
            q.pop_fresh(demand);
            let at = q.push_active(next, size, demand, buffer);
            self.add_piece(&mut job, &mut q.active[at], room);
        }
        q.busy += 1;
        (Some(job), abandoned)
    }

    /// Allocates the next fresh tensor's buffer and makes it active; returns its place
    /// in `active`. Gives up tensors that cannot be started.
    fn start_next(&self, q: &mut Queue<T>, abandoned: &mut Abandoned) -> Option<usize> {
        loop {
            let (idx, demand) = q.peek_fresh()?;
            let size = self.handles[idx].size();
            match self.cache.allocate(size, demand) {
                Ok(buffer) => {
                    q.pop_fresh(demand);
                    return Some(q.push_active(idx, size, demand, buffer));
                }
                Err(NoRoom::Full { .. }) if !demand => {
                    // The background upload stops at the budget: it never evicts. What
                    // it has not started loads on first use.
                    tracing::info!(
                        tensor = self.handles[idx].name(),
                        "background upload stops: budget full"
                    );
                    q.prefetch_stopped = true;
                    for idx in std::mem::take(&mut q.prefetch) {
                        if q.status[idx] == Queued::Prefetch {
                            q.status[idx] = Queued::No;
                            abandoned.push((idx, None, Failure::Retry));
                        }
                    }
                    return None;
                }
                Err(NoRoom::Full { loading, .. })
                    if demand && (loading > 0 || q.pending > 0 || !q.active.is_empty()) =>
                {
                    // Uploads in flight will free room (or become evictable) when they
                    // finish: wait for the publisher, then try again.
                    return None;
                }
                Err(no_room) => {
                    q.pop_fresh(demand);
                    q.status[idx] = Queued::No;
                    let failure = no_room.into_failure(size);
                    if let (false, Failure::Error(error)) = (demand, &failure) {
                        q.prefetch_error.get_or_insert_with(|| Arc::clone(error));
                    }
                    abandoned.push((idx, None, failure));
                }
            }
        }
    }

    /// Adds the next piece of `active` (at most `limit` bytes) to `job`.
    fn add_piece(&self, job: &mut Job<T>, active: &mut Active<T>, limit: u64) {
        let len = (active.size - active.dispatched).min(limit);
        let file_offset = self.handles[active.idx].file_range().start + active.dispatched;
        job.pieces.push(Piece {
            idx: active.idx,
            tensor_offset: active.dispatched,
            len,
            chunk_offset: file_offset - job.file_start,
            buffer: Arc::clone(&active.buffer),
        });
        active.dispatched += len;
        job.file_end = job.file_end.max(file_offset + len);
    }
}

impl<T: DeviceTarget> Queue<T> {
    fn push_active(&mut self, idx: usize, size: u64, demand: bool, buffer: T::Buffer) -> usize {
        self.status[idx] = Queued::Active;
        self.active.push(Active {
            idx,
            size,
            demand,
            dispatched: 0,
            copied: 0,
            buffer: Arc::new(Mutex::new(Some(buffer))),
        });
        self.active.len() - 1
    }
}
