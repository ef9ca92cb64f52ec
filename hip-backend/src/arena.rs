//! A device arena: one large device allocation carved into aligned sub-buffers, so a whole
//! model costs one `hipMalloc` instead of one per tensor.
//!
//! The bookkeeping ([`RangeAllocator`]) is plain arithmetic, tested without a device: a
//! first-fit allocator over address-ordered free blocks that merges neighbours on release.
//! A model loaded front to back therefore packs like a bump allocator, and released ranges
//! (evicted layers) are reused.
//!
//! Dropping an [`ArenaBuffer`] makes its range reusable at once. Work queued on it must
//! have finished first, or the next owner must queue its work on the same stream:
//! unlike `hipFree`, returning a range to the arena does not wait for the device.

use crate::device::Device;
use crate::error::{HipError, Result};
use crate::memory::{DeviceBuffer, DeviceView, DeviceViewMut};
use bytemuck::Pod;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// The alignment of [`DeviceArena::alloc_elements`] buffers: what `hipMalloc` itself
/// guarantees, and enough for every vector load a kernel makes.
pub const DEFAULT_ARENA_ALIGN: usize = 256;

/// Figures of an arena (or a [`RangeAllocator`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ArenaStats {
    pub capacity: usize,
    /// Bytes in live buffers (alignment padding not included).
    pub used: usize,
    pub peak_used: usize,
    pub live_buffers: usize,
    /// Sub-buffers handed out since creation (zero-length ones included).
    pub sub_allocations: u64,
    pub largest_free: usize,
    pub free_blocks: usize,
}

/// Offset bookkeeping of an arena of `capacity` bytes whose first byte sits at device
/// address `base` (alignment is computed on absolute addresses).
#[derive(Clone, Debug)]
pub struct RangeAllocator {
    base: usize,
    capacity: usize,
    /// Free blocks: offset → length, never adjacent (neighbours are merged).
    free: BTreeMap<usize, usize>,
    used: usize,
    peak_used: usize,
    live: usize,
    sub_allocations: u64,
}

impl RangeAllocator {
    pub fn new(base: usize, capacity: usize) -> RangeAllocator {
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        RangeAllocator {
            base,
            capacity,
            free,
            used: 0,
            peak_used: 0,
            live: 0,
            sub_allocations: 0,
        }
    }

    /// Reserves `size` bytes whose address is a multiple of `align` (a power of two) and
    /// returns their offset. Zero bytes reserve nothing and return offset 0.
    pub fn allocate(&mut self, size: usize, align: usize) -> Result<usize> {
        if !align.is_power_of_two() {
            return Err(HipError::InvalidAlignment { align });
        }
        self.sub_allocations += 1;
        if size == 0 {
            return Ok(0);
        }
        let found = self.free.iter().find_map(|(&offset, &len)| {
            let start = self
                .base
                .checked_add(offset)?
                .checked_next_multiple_of(align)?
                - self.base;
            let end = start.checked_add(size)?;
            (end <= offset + len).then_some((offset, len, start, end))
        });
        let Some((offset, len, start, end)) = found else {
            self.sub_allocations -= 1;
            return Err(HipError::ArenaFull {
                requested: size,
                align,
                used: self.used,
                capacity: self.capacity,
                largest_free: self.largest_free(),
            });
        };
        self.free.remove(&offset);
        if start > offset {
            self.free.insert(offset, start - offset);
        }
        if offset + len > end {
            self.free.insert(end, offset + len - end);
        }
        self.used += size;
        self.peak_used = self.peak_used.max(self.used);
        self.live += 1;
        Ok(start)
    }

    /// Returns `size` bytes at `offset`, as handed out by [`RangeAllocator::allocate`].
    pub fn release(&mut self, offset: usize, size: usize) {
        if size == 0 {
            return;
        }
        let (mut start, mut len) = (offset, size);
        if let Some((&before, &before_len)) = self.free.range(..offset).next_back() {
            if before + before_len == offset {
                self.free.remove(&before);
                start = before;
                len += before_len;
            }
        }
        if let Some(&after_len) = self.free.get(&(offset + size)) {
            self.free.remove(&(offset + size));
            len += after_len;
        }
        self.free.insert(start, len);
        self.used -= size;
        self.live -= 1;
    }

    pub fn largest_free(&self) -> usize {
        self.free.values().copied().max().unwrap_or(0)
    }

    pub fn stats(&self) -> ArenaStats {
        ArenaStats {
            capacity: self.capacity,
            used: self.used,
            peak_used: self.peak_used,
            live_buffers: self.live,
            sub_allocations: self.sub_allocations,
            largest_free: self.largest_free(),
            free_blocks: self.free.len(),
        }
    }
}

struct ArenaShared {
    storage: DeviceBuffer<u8>,
    layout: Mutex<RangeAllocator>,
}

impl ArenaShared {
    fn layout(&self) -> MutexGuard<'_, RangeAllocator> {
        // RangeAllocator's methods do not panic midway, so a poisoned lock still guards
        // consistent data.
        self.layout
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// One device allocation handed out in pieces. Cheap to clone (clones share the memory);
/// the memory is freed when the arena and all its buffers are gone.
#[derive(Clone)]
pub struct DeviceArena {
    shared: Arc<ArenaShared>,
}

impl std::fmt::Debug for DeviceArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceArena")
            .field("stats", &self.stats())
            .finish()
    }
}

impl DeviceArena {
    pub(crate) fn new(device: &Device, capacity: usize) -> Result<DeviceArena> {
        let storage = DeviceBuffer::<u8>::new(device, capacity)?;
        let layout = Mutex::new(RangeAllocator::new(storage.view().address(), capacity));
        Ok(DeviceArena {
            shared: Arc::new(ArenaShared { storage, layout }),
        })
    }

    pub fn capacity(&self) -> usize {
        self.shared.storage.len()
    }

    pub fn device_ordinal(&self) -> usize {
        self.shared.storage.device_ordinal()
    }

    pub fn stats(&self) -> ArenaStats {
        self.shared.layout().stats()
    }

    /// A buffer of `bytes` bytes at an address that is a multiple of `align`.
    pub fn alloc(&self, bytes: usize, align: usize) -> Result<ArenaBuffer> {
        let offset = self.shared.layout().allocate(bytes, align)?;
        Ok(ArenaBuffer {
            shared: Arc::clone(&self.shared),
            offset,
            len: bytes,
        })
    }

    /// A buffer for `len` elements of `T`, aligned to [`DEFAULT_ARENA_ALIGN`].
    pub fn alloc_elements<T: Pod>(&self, len: usize) -> Result<ArenaBuffer> {
        let bytes = crate::memory::byte_len::<T>(len)?;
        self.alloc(bytes, DEFAULT_ARENA_ALIGN.max(std::mem::align_of::<T>()))
    }
}

/// A piece of a [`DeviceArena`]: raw bytes, viewed as any `Pod` type that fits.
pub struct ArenaBuffer {
    shared: Arc<ArenaShared>,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for ArenaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaBuffer")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl ArenaBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Offset of the first byte within the arena.
    pub fn offset(&self) -> usize {
        self.offset
    }

    pub fn device_ordinal(&self) -> usize {
        self.shared.storage.device_ordinal()
    }

    /// The bytes, read-only.
    pub fn bytes(&self) -> DeviceView<'_, u8> {
        let whole = self.shared.storage.view();
        DeviceView::new(
            whole.address() + self.offset,
            self.len,
            whole.device_ordinal(),
        )
    }

    /// The bytes, writable. Sub-buffers never overlap, so `&mut self` makes this the only
    /// writable view of them.
    pub fn bytes_mut(&mut self) -> DeviceViewMut<'_, u8> {
        let whole = self.shared.storage.view();
        DeviceViewMut::new(
            whole.address() + self.offset,
            self.len,
            whole.device_ordinal(),
        )
    }

    /// The bytes as elements of `T`; fails unless the length divides and the address is
    /// aligned for `T`.
    pub fn view<T: Pod>(&self) -> Result<DeviceView<'_, T>> {
        self.bytes().cast::<T>()
    }

    /// The bytes as writable elements of `T`.
    pub fn view_mut<T: Pod>(&mut self) -> Result<DeviceViewMut<'_, T>> {
        self.bytes_mut().cast_mut::<T>()
    }
}

impl Drop for ArenaBuffer {
    fn drop(&mut self) {
        self.shared.layout().release(self.offset, self.len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_aligned_on_absolute_addresses() {
        let mut arena = RangeAllocator::new(0x1000 + 64, 4096);
        let a = arena.allocate(10, 1).unwrap();
        assert_eq!(a, 0);
        let b = arena.allocate(100, 256).unwrap();
        assert_eq!((0x1000 + 64 + b) % 256, 0);
        assert_eq!(b, 192);
        // The padding before `b` stays free and is used by a small request.
        let c = arena.allocate(50, 2).unwrap();
        assert_eq!(c, 10);
        assert_eq!(arena.stats().used, 160);
    }

    #[test]
    fn released_neighbours_merge_back_into_one_block() {
        let mut arena = RangeAllocator::new(0, 1000);
        let offsets: Vec<usize> = (0..4).map(|_| arena.allocate(250, 1).unwrap()).collect();
        assert_eq!(offsets, [0, 250, 500, 750]);
        assert_eq!(arena.stats().largest_free, 0);
        arena.release(250, 250);
        arena.release(750, 250);
        assert_eq!(arena.stats().free_blocks, 2);
        arena.release(500, 250);
        assert_eq!((arena.stats().free_blocks, arena.largest_free()), (1, 750));
        arena.release(0, 250);
        let stats = arena.stats();
        assert_eq!(
            (
                stats.used,
                stats.live_buffers,
                stats.largest_free,
                stats.peak_used
            ),
            (0, 0, 1000, 1000)
        );
    }

    #[test]
    fn a_full_arena_reports_the_request_and_what_is_left() {
        let mut arena = RangeAllocator::new(0, 1024);
        arena.allocate(1000, 8).unwrap();
        match arena.allocate(100, 8) {
            Err(HipError::ArenaFull {
                requested: 100,
                align: 8,
                used: 1000,
                capacity: 1024,
                largest_free: 24,
            }) => {}
            other => panic!("expected ArenaFull, got {other:?}"),
        }
        // A failed request changes nothing.
        assert_eq!(arena.stats().sub_allocations, 1);
        assert_eq!(arena.allocate(24, 8).unwrap(), 1000);
    }

    #[test]
    fn alignment_padding_can_make_a_request_fail() {
        let mut arena = RangeAllocator::new(8, 256);
        // 248 bytes fit, but not at an address aligned to 256 inside [8, 264).
        assert!(matches!(
            arena.allocate(248, 256),
            Err(HipError::ArenaFull { .. })
        ));
        assert_eq!(arena.allocate(8, 256).unwrap(), 248);
    }

    #[test]
    fn bad_alignments_and_empty_requests() {
        let mut arena = RangeAllocator::new(0, 64);
        assert!(matches!(
            arena.allocate(8, 0),
            Err(HipError::InvalidAlignment { align: 0 })
        ));
        assert!(matches!(
            arena.allocate(8, 12),
            Err(HipError::InvalidAlignment { align: 12 })
        ));
        assert_eq!(arena.allocate(0, 4).unwrap(), 0);
        arena.release(0, 0);
        assert_eq!(arena.stats().used, 0);
        let mut empty = RangeAllocator::new(0, 0);
        assert!(matches!(
            empty.allocate(1, 1),
            Err(HipError::ArenaFull { capacity: 0, .. })
        ));
    }

    /// Random allocate/release sequences against a byte map: no two live ranges overlap,
    /// every range is aligned and inside the arena, the figures add up, and a request
    /// fails only when no aligned gap of that size exists.
    #[test]
    fn random_sequences_match_a_byte_map() {
        const CAPACITY: usize = 4096;
        const BASE: usize = 0x7000 + 48;
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |bound: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % bound as u64) as usize
        };
        let mut arena = RangeAllocator::new(BASE, CAPACITY);
        let mut owner = vec![false; CAPACITY];
        let mut live: Vec<(usize, usize)> = Vec::new();
        for _ in 0..8_000 {
            if live.is_empty() || next(3) > 0 {
                let size = 1 + next(300);
                let align = 1 << next(9);
                match arena.allocate(size, align) {
                    Ok(offset) => {
                        assert_eq!((BASE + offset) % align, 0);
                        assert!(offset + size <= CAPACITY);
                        assert!(
                            owner[offset..offset + size].iter().all(|&taken| !taken),
                            "overlap at {offset}"
                        );
                        owner[offset..offset + size].fill(true);
                        live.push((offset, size));
                    }
                    Err(HipError::ArenaFull { .. }) => {
                        // free_run[i]: free bytes starting at i.
                        let mut free_run = vec![0usize; CAPACITY + 1];
                        for i in (0..CAPACITY).rev() {
                            free_run[i] = if owner[i] { 0 } else { free_run[i + 1] + 1 };
                        }
                        let fits = (0..CAPACITY).any(|start| {
                            (BASE + start).is_multiple_of(align) && free_run[start] >= size
                        });
                        assert!(
                            !fits,
                            "refused {size} bytes aligned to {align} that would fit"
                        );
                    }
                    Err(other) => panic!("unexpected error {other}"),
                }
            } else {
                let (offset, size) = live.swap_remove(next(live.len()));
                owner[offset..offset + size].fill(false);
                arena.release(offset, size);
            }
            let stats = arena.stats();
            assert_eq!(stats.used, owner.iter().filter(|&&taken| taken).count());
            assert_eq!(stats.live_buffers, live.len());
        }
    }
}
