//! The cache's bookkeeping: one state per tensor, the memory budget and LRU eviction.
//!
//! Every tensor of the model is in exactly one state: `Absent`, `Loading` (an upload is
//! queued or running; waiters hold its [`Slot`]) or `Ready` (on the device). Each change
//! happens in one short critical section under one mutex, so "is it there? no: then I
//! load it" is a single step: the first request turns `Absent` into `Loading` and every
//! later one finds that slot and waits on it. The lock is never held while reading a
//! file, waiting for a device, or running user code.
//!
//! Budget: `reserved` counts the bytes of every buffer allocated and not yet dropped
//! (loading, ready, and abandoned buffers whose copies are still draining). A tensor in
//! use (a [`DeviceTensor`] alive outside the cache) is pinned: only tensors whose sole
//! owner is the cache are evicted, least recently used first.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::part::TensorPart;
use super::slot::{Failure, Slot};
use super::target::DeviceTarget;
use crate::{StoreError, TensorHandle};

/// A tensor resident on the device. While any clone is alive the cache will not evict
/// it, so hold one for as long as device work that reads it may run.
///
/// It may also hold only a part of a tensor ([`DeviceTensor::part`]), uploaded by
/// [`super::upload_part`] outside any cache: then its buffer holds the part's bytes and
/// its size is the part's.
pub struct DeviceTensor<T: DeviceTarget> {
    inner: Arc<Resident<T>>,
}

struct Resident<T: DeviceTarget> {
    handle: TensorHandle,
    buffer: T::Buffer,
    /// The part of `handle` the buffer holds; `None` for the whole tensor.
    part: Option<TensorPart>,
    /// Bytes in the buffer: the tensor's size, or the part's.
    size: u64,
}

impl<T: DeviceTarget> Clone for DeviceTensor<T> {
    fn clone(&self) -> Self {
        DeviceTensor {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T: DeviceTarget> DeviceTensor<T> {
    /// The whole tensor `handle`, in `buffer`.
    pub(crate) fn new(handle: TensorHandle, buffer: T::Buffer) -> DeviceTensor<T> {
        let size = handle.size();
        DeviceTensor {
            inner: Arc::new(Resident {
                handle,
                buffer,
                part: None,
                size,
            }),
        }
    }

    /// `part` of the tensor `handle`, in `buffer` (of `part.len()` bytes).
    pub(crate) fn new_part(
        handle: TensorHandle,
        buffer: T::Buffer,
        part: TensorPart,
    ) -> DeviceTensor<T> {
        let size = part.len();
        DeviceTensor {
            inner: Arc::new(Resident {
                handle,
                buffer,
                part: Some(part),
                size,
            }),
        }
    }

    /// The device memory holding the tensor's raw GGUF bytes (for a part, the part's
    /// rows one after another, each of them the part's bytes of that row).
    pub fn buffer(&self) -> &T::Buffer {
        &self.inner.buffer
    }

    /// The tensor this is a device copy of (or of a part of).
    pub fn handle(&self) -> &TensorHandle {
        &self.inner.handle
    }

    /// The tensor's name (a part's is its tensor's).
    pub fn name(&self) -> &str {
        self.inner.handle.name()
    }

    /// Size in bytes: the tensor's, or for a part the part's.
    pub fn size(&self) -> u64 {
        self.inner.size
    }

    /// The part of the tensor this holds; `None` when it holds the whole tensor.
    pub fn part(&self) -> Option<&TensorPart> {
        self.inner.part.as_ref()
    }

    /// True when both are the same upload (the same device buffer).
    pub fn same_upload(&self, other: &DeviceTensor<T>) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// True when the cache holds the only reference: not in use, evictable.
    fn is_unused(&self) -> bool {
        Arc::strong_count(&self.inner) == 1
    }
}

impl<T: DeviceTarget> std::fmt::Debug for DeviceTensor<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceTensor")
            .field("name", &self.name())
            .field("size", &self.size())
            .field("part", &self.part())
            .finish()
    }
}

/// The cache's counters: a snapshot taken under the cache's lock (one short critical
/// section), cheap enough for every scrape of a metrics endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Uploads completed (a tensor evicted and loaded again counts twice).
    pub uploads: u64,
    /// Bytes of the completed uploads (an evicted tensor loaded again counts twice).
    pub uploaded_bytes: u64,
    pub evictions: u64,
    /// Requests answered by a resident tensor.
    pub hits: u64,
    /// Requests that started an upload or waited for one.
    pub misses: u64,
    pub resident_tensors: usize,
    pub resident_bytes: u64,
    /// Bytes of buffers allocated: resident, loading, and released but still draining.
    pub reserved_bytes: u64,
    pub loading_bytes: u64,
    /// `u64::MAX` when unlimited.
    pub budget: u64,
}

/// The counters of several caches (one a device of a model split over several) added
/// up; their budgets too (unlimited stays `u64::MAX`).
impl std::ops::Add for CacheStats {
    type Output = CacheStats;

    fn add(self, other: CacheStats) -> CacheStats {
        CacheStats {
            uploads: self.uploads + other.uploads,
            uploaded_bytes: self.uploaded_bytes + other.uploaded_bytes,
            evictions: self.evictions + other.evictions,
            hits: self.hits + other.hits,
            misses: self.misses + other.misses,
            resident_tensors: self.resident_tensors + other.resident_tensors,
            resident_bytes: self.resident_bytes + other.resident_bytes,
            reserved_bytes: self.reserved_bytes + other.reserved_bytes,
            loading_bytes: self.loading_bytes + other.loading_bytes,
            budget: self.budget.saturating_add(other.budget),
        }
    }
}

enum State<T: DeviceTarget> {
    Absent,
    Loading(Arc<Slot<T>>),
    Ready {
        tensor: DeviceTensor<T>,
        last_use: u64,
    },
}

struct Inner<T: DeviceTarget> {
    entries: Vec<State<T>>,
    clock: u64,
    reserved: u64,
    loading: u64,
    stats: CacheStats,
}

/// What a request finds.
pub(crate) enum Lookup<T: DeviceTarget> {
    Ready(DeviceTensor<T>),
    /// An upload is queued or running: wait on its slot.
    Wait(Arc<Slot<T>>),
    /// The tensor was absent and is now `Loading` on behalf of this caller, who must
    /// queue its upload.
    Claimed(Arc<Slot<T>>),
}

/// Why an allocation was refused.
pub(crate) enum NoRoom {
    /// Not enough budget or device memory, even after evicting what could be: the
    /// figures for the error.
    Full {
        budget: u64,
        resident: u64,
        in_use: u64,
        loading: u64,
    },
    Error(StoreError),
}

impl NoRoom {
    pub(crate) fn into_failure(self, requested: u64) -> Failure {
        match self {
            NoRoom::Full {
                budget,
                resident,
                in_use,
                loading,
            } => Failure::OutOfMemory {
                requested,
                budget,
                resident,
                in_use,
                loading,
            },
            NoRoom::Error(error) => Failure::Error(Arc::new(error)),
        }
    }
}

pub(crate) struct Cache<T: DeviceTarget> {
    pub(crate) target: Arc<T>,
    budget: u64,
    inner: Mutex<Inner<T>>,
}

impl<T: DeviceTarget> Cache<T> {
    pub(crate) fn new(target: Arc<T>, n_tensors: usize, budget: u64) -> Cache<T> {
        let entries = (0..n_tensors).map(|_| State::Absent).collect();
        Cache {
            target,
            budget,
            inner: Mutex::new(Inner {
                entries,
                clock: 0,
                reserved: 0,
                loading: 0,
                stats: CacheStats {
                    budget,
                    ..CacheStats::default()
                },
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        // Every critical section below leaves the state consistent before it can
        // panic (nothing in them panics on valid indices), so poisoning is ignored.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The one step that finds a tensor, or claims its upload.
    pub(crate) fn lookup_or_claim(&self, idx: usize) -> Lookup<T> {
        let mut inner = self.lock();
        inner.clock += 1;
        let now = inner.clock;
        let found = match &mut inner.entries[idx] {
            State::Ready { tensor, last_use } => {
                *last_use = now;
                Lookup::Ready(tensor.clone())
            }
            State::Loading(slot) => Lookup::Wait(Arc::clone(slot)),
            state @ State::Absent => {
                let slot = Slot::new();
                *state = State::Loading(Arc::clone(&slot));
                Lookup::Claimed(slot)
            }
        };
        match found {
            Lookup::Ready(_) => inner.stats.hits += 1,
            _ => inner.stats.misses += 1,
        }
        found
    }

    /// Claims an absent tensor for the background upload; false when it is not absent.
    pub(crate) fn claim(&self, idx: usize) -> bool {
        let mut inner = self.lock();
        match &inner.entries[idx] {
            State::Absent => {
                inner.entries[idx] = State::Loading(Slot::new());
                true
            }
            _ => false,
        }
    }

    pub(crate) fn is_ready(&self, idx: usize) -> bool {
        matches!(self.lock().entries[idx], State::Ready { .. })
    }

    /// Allocates the device buffer of a loading tensor, evicting unused tensors (least
    /// recently used first) when `may_evict` and the budget or the device is full.
    pub(crate) fn allocate(&self, size: u64, may_evict: bool) -> Result<T::Buffer, NoRoom> {
        let mut inner = self.lock();
        loop {
            let fits_budget = inner
                .reserved
                .checked_add(size)
                .is_some_and(|total| total <= self.budget);
            if fits_budget {
                match self.target.alloc(size) {
                    Ok(buffer) => {
                        inner.reserved += size;
                        inner.loading += size;
                        return Ok(buffer);
                    }
                    Err(StoreError::DeviceAlloc { .. }) => {}
                    Err(other) => return Err(NoRoom::Error(other)),
                }
            }
            // No room: evict, unless that cannot help.
            let (evictable, in_use) = inner.unused_and_in_use_bytes();
            let could_fit = size <= self.budget && inner.reserved - evictable <= self.budget - size;
            if !(may_evict && could_fit && inner.evict_one()) {
                return Err(NoRoom::Full {
                    budget: self.budget,
                    resident: inner.stats.resident_bytes,
                    in_use,
                    loading: inner.loading,
                });
            }
        }
    }

    /// `Loading` → `Ready`: returns the slot to resolve (outside this lock).
    pub(crate) fn publish(&self, idx: usize, tensor: &DeviceTensor<T>) -> Option<Arc<Slot<T>>> {
        let mut inner = self.lock();
        inner.clock += 1;
        let last_use = inner.clock;
        let size = tensor.size();
        let previous = std::mem::replace(
            &mut inner.entries[idx],
            State::Ready {
                tensor: tensor.clone(),
                last_use,
            },
        );
        inner.loading -= size;
        inner.stats.uploads += 1;
        inner.stats.uploaded_bytes += size;
        inner.stats.resident_tensors += 1;
        inner.stats.resident_bytes += size;
        match previous {
            State::Loading(slot) => Some(slot),
            _ => None,
        }
    }

    /// `Loading` → `Absent` after a failed or cancelled upload; `allocated` is the size
    /// of its buffer, if it had one (released later, by [`Cache::release`], once no
    /// copy into it can still run). Returns the slot to resolve.
    pub(crate) fn abandon(&self, idx: usize, allocated: Option<u64>) -> Option<Arc<Slot<T>>> {
        let mut inner = self.lock();
        if let Some(size) = allocated {
            inner.loading -= size;
        }
        match std::mem::replace(&mut inner.entries[idx], State::Absent) {
            State::Loading(slot) => Some(slot),
            other => {
                // Not loading: leave it as it was.
                inner.entries[idx] = other;
                None
            }
        }
    }

    /// Gives back the budget of a dropped, never published buffer.
    pub(crate) fn release(&self, size: u64) {
        self.lock().reserved -= size;
    }

    pub(crate) fn stats(&self) -> CacheStats {
        let inner = self.lock();
        CacheStats {
            reserved_bytes: inner.reserved,
            loading_bytes: inner.loading,
            ..inner.stats
        }
    }
}

impl<T: DeviceTarget> Inner<T> {
    /// Bytes of resident tensors nobody uses (evictable), and of those in use.
    fn unused_and_in_use_bytes(&self) -> (u64, u64) {
        let (mut unused, mut in_use) = (0, 0);
        for entry in &self.entries {
            if let State::Ready { tensor, .. } = entry {
                if tensor.is_unused() {
                    unused += tensor.size();
                } else {
                    in_use += tensor.size();
                }
            }
        }
        (unused, in_use)
    }

    /// Evicts the least recently used tensor nobody uses; false when there is none.
    fn evict_one(&mut self) -> bool {
        let victim = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(idx, entry)| match entry {
                State::Ready { tensor, last_use } if tensor.is_unused() => Some((*last_use, idx)),
                _ => None,
            })
            .min();
        let Some((_, idx)) = victim else {
            return false;
        };
        if let State::Ready { tensor, .. } =
            std::mem::replace(&mut self.entries[idx], State::Absent)
        {
            let size = tensor.size();
            tracing::debug!(tensor = tensor.name(), size, "evicting");
            self.reserved -= size;
            self.stats.resident_bytes -= size;
            self.stats.resident_tensors -= 1;
            self.stats.evictions += 1;
            // Dropping the last reference frees the buffer: its copies finished before
            // it was published, and no user holds it.
            drop(tensor);
        }
        true
    }
}
