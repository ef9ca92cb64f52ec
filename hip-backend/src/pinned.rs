//! Page-locked host memory: the staging area for fast host↔device copies.
//!
//! A [`PinnedBuffer`] is either an allocation of its own (`hipHostMalloc`) or one slice of
//! a region that a ring of buffers shares ([`Device::alloc_pinned_ring`]): one anonymous
//! mapping registered with the runtime in a single call, which costs far less than as
//! many page-locked allocations.

use crate::device::{Device, DeviceContext};
use crate::error::{HipError, Result};
use crate::memory::{byte_len, check_range, count};
use crate::result;
use crate::stream::{Event, Stream};
use bytemuck::Pod;
use std::ffi::c_void;
use std::ops::Range;
use std::ptr::{self, NonNull};
use std::sync::Arc;

/// Page-locked host memory of `len` elements of `T`, the fast path for copies: the device
/// reads and writes it directly while the host goes on.
///
/// While a copy queued with [`Stream::copy_h2d_async`] or [`Stream::copy_d2h_async`] may
/// still be running, the host cannot see the memory: [`PinnedBuffer::as_slice`] and
/// [`PinnedBuffer::as_mut_slice`] first wait for it, and `Drop` waits before freeing.
pub struct PinnedBuffer<T: Pod> {
    context: Arc<DeviceContext>,
    /// Dangling (and unallocated) when the buffer holds no bytes.
    ptr: NonNull<T>,
    len: usize,
    backing: Backing,
    /// Recorded after the copy last queued on this buffer; `in_flight` says whether that
    /// copy may still be running.
    last_copy: Option<Event>,
    in_flight: bool,
    /// Set when a queued copy could not be confirmed finished: the memory is withheld.
    poisoned: Option<String>,
}

/// Where a buffer's memory comes from.
enum Backing {
    /// Nothing: the buffer holds no bytes and its pointer dangles.
    Empty,
    /// Its own page-locked allocation (`hipHostMalloc`), freed when the buffer drops.
    Own,
    /// A slice of a registered region that other buffers share; the region is released
    /// when the last of them drops.
    Region(Arc<PinnedRegion>),
}

// SAFETY: a PinnedBuffer owns its memory alone, like a `Box<[T]>`: its own allocation, or a
// slice of a shared region that no other buffer's slice overlaps (the region itself is
// Send and Sync). Moving it to another thread moves that ownership. Its Event and context
// are themselves Send.
unsafe impl<T: Pod + Send> Send for PinnedBuffer<T> {}
// SAFETY: `&PinnedBuffer` only gives `&[T]` (after waiting for copies) and never starts a
// copy (that needs `&mut`), so shared references across threads only read.
unsafe impl<T: Pod + Sync> Sync for PinnedBuffer<T> {}

impl<T: Pod> std::fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .field("in_flight", &self.in_flight)
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

impl<T: Pod> PinnedBuffer<T> {
    pub(crate) fn new(device: &Device, len: usize) -> Result<PinnedBuffer<T>> {
        let bytes = byte_len::<T>(len)?;
        let context = Arc::clone(device.context());
        let (ptr, backing) = if bytes == 0 {
            (NonNull::dangling(), Backing::Empty)
        } else {
            context.bind()?;
            let raw = result::host_alloc(bytes)?;
            count(&context, |c| &c.pinned_allocations, 1);
            // SAFETY: `raw` is a fresh allocation of `bytes` bytes, writable by the host;
            // zeroing it makes every element a valid `T` (Pod: all-zero is valid).
            unsafe { std::ptr::write_bytes(raw.as_ptr().cast::<u8>(), 0, bytes) };
            (raw.cast::<T>(), Backing::Own)
        };
        Ok(PinnedBuffer::from_parts(context, ptr, len, backing))
    }

    /// `count` buffers of `len` elements each, slices of one region registered with the
    /// runtime. Each slice starts on a page boundary; the memory is zeroed.
    pub(crate) fn ring(device: &Device, count: usize, len: usize) -> Result<Vec<PinnedBuffer<T>>> {
        let bytes = byte_len::<T>(len)?;
        let context = Arc::clone(device.context());
        if count == 0 {
            return Ok(Vec::new());
        }
        if bytes == 0 {
            return Ok((0..count)
                .map(|_| {
                    PinnedBuffer::from_parts(
                        Arc::clone(&context),
                        NonNull::dangling(),
                        len,
                        Backing::Empty,
                    )
                })
                .collect());
        }
        let (stride, Some(total)) = ring_bytes::<T>(count, len)? else {
            unreachable!("a ring of {count} buffers of {bytes} bytes has a size")
        };
        // A page is aligned for any element type; the region starts on one.
        debug_assert!(std::mem::align_of::<T>() <= page_size());
        let region = Arc::new(PinnedRegion::new(Arc::clone(&context), total)?);
        Ok((0..count)
            .map(|index| {
                // SAFETY: `index * stride + bytes <= count * stride = total`: the slice lies
                // inside the region's mapping, and no two indices' slices overlap.
                let ptr = unsafe { region.base.add(index * stride) };
                PinnedBuffer::from_parts(
                    Arc::clone(&context),
                    ptr.cast::<T>(),
                    len,
                    Backing::Region(Arc::clone(&region)),
                )
            })
            .collect())
    }

    fn from_parts(
        context: Arc<DeviceContext>,
        ptr: NonNull<T>,
        len: usize,
        backing: Backing,
    ) -> PinnedBuffer<T> {
        PinnedBuffer {
            context,
            ptr,
            len,
            backing,
            last_copy: None,
            in_flight: false,
            poisoned: None,
        }
    }

    crate::memory::element_count!();

    /// Waits for the copy last queued on this buffer, if any may still be running.
    pub fn wait(&mut self) -> Result<()> {
        self.wait_shared()?;
        self.in_flight = false;
        Ok(())
    }

    fn wait_shared(&self) -> Result<()> {
        if let Some(reason) = &self.poisoned {
            return Err(HipError::PinnedBufferPoisoned {
                reason: reason.clone(),
            });
        }
        match (&self.last_copy, self.in_flight) {
            (Some(event), true) => event.synchronize(),
            _ => Ok(()),
        }
    }

    /// The contents, once any copy queued on the buffer has finished.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.wait_shared()?;
        // SAFETY: `ptr` is valid for `len` initialized elements (zeroed at allocation, or a
        // slice of a fresh anonymous mapping, whose pages start zeroed, or dangling with 0
        // bytes); no copy is running (just waited) and none can start while `&self` is
        // borrowed, since starting one takes `&mut self`.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }

    /// The contents, writable, once any copy queued on the buffer has finished.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.wait()?;
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) })
    }

    /// Prepares a copy on `stream` touching elements `range`: orders it after the copy
    /// last queued on this buffer and returns the host address of `range.start`.
    pub(crate) fn begin_copy(&mut self, stream: &Stream, range: &Range<usize>) -> Result<*mut T> {
        if let Some(reason) = &self.poisoned {
            return Err(HipError::PinnedBufferPoisoned {
                reason: reason.clone(),
            });
        }
        check_range(range, self.len)?;
        match &self.last_copy {
            Some(previous) if previous.device_ordinal() == stream.device_ordinal() => {
                if self.in_flight {
                    stream.wait_event(previous)?;
                }
            }
            _ => {
                // First copy, or the last one ran on another device (whose event cannot be
                // recorded on this stream): wait for it on the host, then use a new event.
                self.wait()?;
                self.last_copy = Some(Event::on_context(stream.context(), false)?);
            }
        }
        // SAFETY: `range.start <= len` (checked above), so the offset stays within the
        // buffer's memory or one past its end.
        Ok(unsafe { self.ptr.as_ptr().add(range.start) })
    }

    /// Marks the copy just queued on `stream` as the one to wait for. If that cannot be
    /// recorded, waits for the stream instead; if even that fails, the buffer is
    /// poisoned: the device may still be using the memory, so it is never handed out or
    /// freed again.
    pub(crate) fn end_copy(&mut self, stream: &Stream) -> Result<()> {
        let recorded = match &self.last_copy {
            Some(event) => event.record(stream),
            None => Err(HipError::PinnedBufferPoisoned {
                reason: "no completion event".into(),
            }),
        };
        match recorded {
            Ok(()) => {
                self.in_flight = true;
                Ok(())
            }
            Err(record_error) => {
                if let Err(sync_error) = stream.synchronize_queue() {
                    self.poisoned = Some(format!("{record_error}; then {sync_error}"));
                } else {
                    self.in_flight = false;
                }
                Err(record_error)
            }
        }
    }
}

impl<T: Pod> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if matches!(self.backing, Backing::Empty) {
            return;
        }
        if let Err(error) = self.wait_shared() {
            // The device may still be copying into or out of this memory: leak it (a
            // slice's whole region stays registered and mapped).
            self.context.defer(error);
            if let Backing::Region(region) = std::mem::replace(&mut self.backing, Backing::Empty) {
                std::mem::forget(region);
            }
            return;
        }
        if let Backing::Own = self.backing {
            // SAFETY: our own allocation from `result::host_alloc`, freed only here, with
            // no copy running (just waited) and no slice outstanding (we hold `&mut self`).
            match unsafe { result::host_free(self.ptr.cast::<c_void>()) } {
                Ok(()) => count(&self.context, |c| &c.pinned_frees, 1),
                Err(error) => self.context.defer(error),
            }
        }
        // A slice's share of its region goes with `backing`: the last one releases it.
    }
}

/// One anonymous private mapping of host memory registered with the runtime (page-locked
/// for every device): the memory a ring of buffers shares. It counts as one page-locked
/// allocation. Dropped when the last buffer holding it drops, each after its last copy
/// has finished: it is then unregistered and unmapped.
struct PinnedRegion {
    context: Arc<DeviceContext>,
    base: NonNull<u8>,
    bytes: usize,
}

// SAFETY: the region is only an address range that its buffers slice disjointly; it is
// never read or written through `&PinnedRegion`, and unregistering and unmapping it (in
// Drop, once) are allowed from any thread.
unsafe impl Send for PinnedRegion {}
// SAFETY: as above: `&PinnedRegion` gives only the base address to compute slices.
unsafe impl Sync for PinnedRegion {}

impl PinnedRegion {
    /// Takes `bytes` (> 0, a multiple of the page size) of resident memory, prepared by
    /// [`prepare_pinned_ring`] or mapped now, and registers them.
    fn new(context: Arc<DeviceContext>, bytes: usize) -> Result<PinnedRegion> {
        context.bind()?;
        let pages = match take_prepared(bytes) {
            Some(pages) => pages,
            None => ResidentPages::map(bytes)?,
        };
        let base = pages.base;
        // SAFETY: `base` starts the mapping of `bytes` that `pages` owns, readable and
        // writable; it stays mapped until after it is unregistered (in Drop), or, if
        // registering fails, until `pages` drops just below.
        unsafe { result::host_register(base.cast::<c_void>(), bytes) }?;
        // The region owns the mapping from here: it unmaps it in Drop.
        std::mem::forget(pages);
        count(&context, |c| &c.pinned_allocations, 1);
        Ok(PinnedRegion {
            context,
            base,
            bytes,
        })
    }
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        let unregistered = self.context.bind().and_then(|()| {
            // SAFETY: registered once, in `new`; every buffer slicing it has dropped, each
            // after waiting for its last copy, so no copy uses it.
            unsafe { result::host_unregister(self.base.cast::<c_void>()) }
        });
        if let Err(error) = unregistered {
            // The runtime may still hold the pages: leave them mapped.
            self.context.defer(error);
            return;
        }
        // SAFETY: our own mapping of `bytes`, unregistered just above, unmapped only here;
        // no buffer points into it any more.
        match unsafe { unmap(self.base, self.bytes) } {
            Ok(()) => count(&self.context, |c| &c.pinned_frees, 1),
            Err(error) => self.context.defer(error),
        }
    }
}

/// Resident host memory of our own, not registered: unmapped when dropped.
struct ResidentPages {
    base: NonNull<u8>,
    bytes: usize,
}

// SAFETY: the pages are a private mapping that only its owner uses; unmapping it from
// another thread is allowed.
unsafe impl Send for ResidentPages {}

impl ResidentPages {
    fn map(bytes: usize) -> Result<ResidentPages> {
        Ok(ResidentPages {
            base: map_resident(bytes)?,
            bytes,
        })
    }
}

impl Drop for ResidentPages {
    fn drop(&mut self) {
        // SAFETY: our own mapping of `bytes`, never registered, used by nothing else.
        // A failure leaves the pages mapped: nothing else can be done with them.
        let _ = unsafe { unmap(self.base, self.bytes) };
    }
}

/// Host memory being made resident for rings to come, by size.
type Prepared = (usize, std::thread::JoinHandle<Result<ResidentPages>>);
static PREPARED: std::sync::Mutex<Vec<Prepared>> = std::sync::Mutex::new(Vec::new());

fn prepared() -> std::sync::MutexGuard<'static, Vec<Prepared>> {
    // A panic while the list was held leaves it valid: entries are pushed or removed whole.
    PREPARED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Starts making resident, on a thread of its own, the host memory that a later
/// [`Device::alloc_pinned_ring`]`::<T>(count, len)` (on any device) takes: the page
/// faults, about 0.2 ms a MiB, then happen before the ring is needed (while the GPU
/// runtime starts, say), and the ring only registers the pages. Needs no device and no
/// runtime. A ring of another size ignores the prepared memory; memory no ring takes
/// stays mapped until [`release_prepared_rings`]. A thread that cannot be started
/// prepares nothing (the ring maps its memory itself).
pub fn prepare_pinned_ring<T: Pod>(count: usize, len: usize) {
    let Ok(Some(bytes)) = ring_bytes::<T>(count, len).map(|(_, total)| total) else {
        return;
    };
    let thread = std::thread::Builder::new()
        .name("pinned-prepare".into())
        .spawn(move || ResidentPages::map(bytes));
    if let Ok(thread) = thread {
        prepared().push((bytes, thread));
    }
}

/// Unmaps the memory [`prepare_pinned_ring`] prepared that no ring took (once it is
/// ready).
pub fn release_prepared_rings() {
    let all = std::mem::take(&mut *prepared());
    for (_, thread) in all {
        // The pages, or the error that made none, are dropped here.
        let _ = thread.join();
    }
}

/// Prepared memory of exactly `bytes`, once ready; None when none was prepared or its
/// preparation failed.
fn take_prepared(bytes: usize) -> Option<ResidentPages> {
    let thread = {
        let mut list = prepared();
        let at = list.iter().position(|(size, _)| *size == bytes)?;
        list.swap_remove(at).1
    };
    thread.join().ok()?.ok()
}

/// A ring's layout: each buffer's stride (its bytes rounded up to whole pages) and the
/// region's size; no size for an empty ring or buffers of no bytes.
fn ring_bytes<T: Pod>(count: usize, len: usize) -> Result<(usize, Option<usize>)> {
    let bytes = byte_len::<T>(len)?;
    let overflow = |count, elem_size| HipError::SizeOverflow { count, elem_size };
    let stride = bytes
        .checked_next_multiple_of(page_size())
        .ok_or_else(|| overflow(bytes, 1))?;
    let total = stride
        .checked_mul(count)
        .ok_or_else(|| overflow(count, stride))?;
    Ok((stride, (total > 0).then_some(total)))
}

/// The host's page size (4096 where the system does not say).
fn page_size() -> usize {
    // SAFETY: sysconf only reads a system setting.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page)
        .ok()
        .filter(|page| page.is_power_of_two())
        .unwrap_or(4096)
}

fn os_error(call: &'static str, bytes: usize) -> HipError {
    HipError::HostMemory {
        call,
        bytes,
        source: std::io::Error::last_os_error(),
    }
}

/// `bytes` (> 0) of zeroed, private, anonymous host memory, page aligned and resident.
///
/// Before any page is touched, the mapping is advised onto transparent huge pages (fewer
/// pages to fault in and to lock, where the kernel has them) and kept out of child
/// processes (were its pages shared copy-on-write with a child, the process's own writes
/// after a fork could land on copies while the device keeps using the originals). Both
/// are advice: a kernel that refuses them leaves an ordinary mapping. Then every page is
/// faulted in, so that registering it finds the memory resident.
fn map_resident(bytes: usize) -> Result<NonNull<u8>> {
    // SAFETY: asks for a new mapping at an address the kernel picks: no existing memory
    // is affected.
    let raw = unsafe {
        libc::mmap(
            ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(os_error("mmap", bytes));
    }
    let Some(base) = NonNull::new(raw.cast::<u8>()) else {
        // Not returned without MAP_FIXED; a mapping at address 0 is left alone.
        return Err(HipError::HostMemory {
            call: "mmap",
            bytes,
            source: std::io::Error::other("the kernel mapped the region at address 0"),
        });
    };
    // SAFETY: advice on our own fresh mapping of `bytes`; neither changes its contents.
    // Their results are ignored on purpose: each only helps where the kernel takes it.
    unsafe {
        libc::madvise(raw, bytes, libc::MADV_HUGEPAGE);
        libc::madvise(raw, bytes, libc::MADV_DONTFORK);
    }
    // SAFETY: our own mapping of `bytes`, readable and writable, not yet shared.
    if let Err(error) = unsafe { populate(base, bytes) } {
        // SAFETY: our own mapping, used by nothing else.
        let _ = unsafe { unmap(base, bytes) };
        return Err(error);
    }
    Ok(base)
}

/// Faults in every page of a fresh anonymous mapping for writing, in one call where the
/// kernel has MADV_POPULATE_WRITE (Linux 5.14), else by writing a zero into each page
/// (which leaves the contents as they were: all zero).
///
/// # Safety
/// `base` starts `bytes` of memory mapped readable and writable that nothing else uses.
unsafe fn populate(base: NonNull<u8>, bytes: usize) -> Result<()> {
    // SAFETY: advice on the caller's mapping of `bytes`; it only allocates the pages.
    if unsafe {
        libc::madvise(
            base.as_ptr().cast::<c_void>(),
            bytes,
            libc::MADV_POPULATE_WRITE,
        )
    } == 0
    {
        return Ok(());
    }
    let error = std::io::Error::last_os_error();
    if error.raw_os_error() != Some(libc::EINVAL) {
        // The kernel knows the advice but could not allocate the pages.
        return Err(HipError::HostMemory {
            call: "madvise(MADV_POPULATE_WRITE)",
            bytes,
            source: error,
        });
    }
    for offset in (0..bytes).step_by(page_size()) {
        // SAFETY: `offset < bytes`, inside the caller's writable mapping; the page is
        // still zero, so writing zero changes nothing but makes it resident.
        unsafe { base.as_ptr().add(offset).write_volatile(0) };
    }
    Ok(())
}

/// # Safety
/// `base` and `bytes` describe exactly a mapping from [`map_resident`], unmapped once,
/// which nothing (host slice or device copy) uses any more.
unsafe fn unmap(base: NonNull<u8>, bytes: usize) -> Result<()> {
    // SAFETY: the caller's contract.
    if unsafe { libc::munmap(base.as_ptr().cast::<c_void>(), bytes) } == 0 {
        Ok(())
    } else {
        Err(os_error("munmap", bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring takes prepared memory of exactly its size, resident and zeroed, once.
    #[test]
    fn prepared_memory_goes_to_a_ring_of_its_size_only() {
        // A size no other test prepares: the list is the process's.
        let (count, len) = (3, 7 * 4096 + 123);
        prepare_pinned_ring::<u8>(count, len);
        let (_, total) = ring_bytes::<u8>(count, len).unwrap();
        let total = total.unwrap();
        assert!(take_prepared(total + page_size()).is_none());
        let pages = take_prepared(total).expect("prepared memory");
        assert_eq!(pages.bytes, total);
        // SAFETY: the mapping of `total` bytes `pages` owns, resident and not shared.
        let bytes = unsafe { std::slice::from_raw_parts(pages.base.as_ptr(), total) };
        assert!(bytes.iter().all(|&b| b == 0));
        assert!(take_prepared(total).is_none(), "taken once");
    }

    #[test]
    fn the_page_size_is_a_power_of_two_of_at_least_4_kib() {
        let page = page_size();
        assert!(page.is_power_of_two() && page >= 4096, "{page}");
    }

    #[test]
    fn a_resident_mapping_is_page_aligned_zeroed_writable_and_unmaps() {
        let page = page_size();
        let bytes = 3 * page;
        let base = map_resident(bytes).expect("mapping");
        assert_eq!(base.as_ptr() as usize % page, 0);
        // SAFETY: the fresh mapping of `bytes`, used only here until unmapped below.
        let memory = unsafe { std::slice::from_raw_parts_mut(base.as_ptr(), bytes) };
        assert!(memory.iter().all(|&byte| byte == 0));
        memory.fill(0x5a);
        assert!(memory.iter().all(|&byte| byte == 0x5a));
        // SAFETY: the mapping from above, no longer borrowed.
        unsafe { unmap(base, bytes) }.expect("unmap");
    }

    #[test]
    fn a_failed_mapping_is_a_host_memory_error() {
        // More than any address space holds.
        match map_resident(usize::MAX - 4095) {
            Err(HipError::HostMemory {
                call: "mmap",
                bytes,
                source,
            }) => {
                assert_eq!(bytes, usize::MAX - 4095);
                assert!(source.raw_os_error().is_some(), "{source}");
            }
            other => panic!("expected a mapping failure, got {other:?}"),
        }
    }
}
