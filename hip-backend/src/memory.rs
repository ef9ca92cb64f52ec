//! Device memory ([`DeviceBuffer`] and its typed views), with allocation counters for
//! the benchmarks.
//!
//! Device addresses are plain `usize` values: the host never dereferences them, it only
//! hands them to the runtime and to kernels. A view ([`DeviceView`], [`DeviceViewMut`])
//! borrows its owner the way `&[T]` and `&mut [T]` borrow a `Vec`, so Rust's borrow rules
//! keep two mutable views of one range apart.

use crate::device::{Device, DeviceContext};
use crate::error::{HipError, Result};
use crate::result;
use bytemuck::Pod;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Allocation counts: of the whole process ([`allocation_counters`]) or of one device
/// handle ([`Device::allocation_counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocationCounters {
    /// Device allocations made (`hipMalloc` calls that succeeded). An arena counts once.
    pub device_allocations: u64,
    /// Device allocations released.
    pub device_frees: u64,
    /// Bytes of all device allocations made.
    pub device_bytes: u64,
    /// Page-locked host allocations made (a ring of buffers sharing one registered
    /// region counts once).
    pub pinned_allocations: u64,
    /// Page-locked host allocations released.
    pub pinned_frees: u64,
}

impl AllocationCounters {
    /// Counts since an earlier snapshot.
    pub fn since(&self, earlier: &AllocationCounters) -> AllocationCounters {
        AllocationCounters {
            device_allocations: self
                .device_allocations
                .saturating_sub(earlier.device_allocations),
            device_frees: self.device_frees.saturating_sub(earlier.device_frees),
            device_bytes: self.device_bytes.saturating_sub(earlier.device_bytes),
            pinned_allocations: self
                .pinned_allocations
                .saturating_sub(earlier.pinned_allocations),
            pinned_frees: self.pinned_frees.saturating_sub(earlier.pinned_frees),
        }
    }
}

pub(crate) struct Counters {
    pub(crate) device_allocations: AtomicU64,
    pub(crate) device_frees: AtomicU64,
    pub(crate) device_bytes: AtomicU64,
    pub(crate) pinned_allocations: AtomicU64,
    pub(crate) pinned_frees: AtomicU64,
}

impl Counters {
    pub(crate) const fn new() -> Counters {
        Counters {
            device_allocations: AtomicU64::new(0),
            device_frees: AtomicU64::new(0),
            device_bytes: AtomicU64::new(0),
            pinned_allocations: AtomicU64::new(0),
            pinned_frees: AtomicU64::new(0),
        }
    }

    pub(crate) fn snapshot(&self) -> AllocationCounters {
        AllocationCounters {
            device_allocations: self.device_allocations.load(Ordering::Relaxed),
            device_frees: self.device_frees.load(Ordering::Relaxed),
            device_bytes: self.device_bytes.load(Ordering::Relaxed),
            pinned_allocations: self.pinned_allocations.load(Ordering::Relaxed),
            pinned_frees: self.pinned_frees.load(Ordering::Relaxed),
        }
    }
}

static PROCESS_COUNTERS: Counters = Counters::new();

/// Allocation counts of the whole process.
pub fn allocation_counters() -> AllocationCounters {
    PROCESS_COUNTERS.snapshot()
}

pub(crate) fn count(context: &DeviceContext, pick: impl Fn(&Counters) -> &AtomicU64, amount: u64) {
    pick(&PROCESS_COUNTERS).fetch_add(amount, Ordering::Relaxed);
    pick(context.counters()).fetch_add(amount, Ordering::Relaxed);
}

/// `len` elements of `T` in bytes, checked.
pub(crate) fn byte_len<T>(len: usize) -> Result<usize> {
    let elem_size = std::mem::size_of::<T>();
    len.checked_mul(elem_size).ok_or(HipError::SizeOverflow {
        count: len,
        elem_size,
    })
}

pub(crate) fn check_range(range: &Range<usize>, len: usize) -> Result<()> {
    if range.start <= range.end && range.end <= len {
        Ok(())
    } else {
        Err(HipError::OutOfBounds {
            start: range.start,
            end: range.end,
            len,
        })
    }
}

/// Reinterprets `len` elements of `T` at `addr` as elements of `U`, checking size and
/// alignment. Returns the new length.
fn cast_len<T, U>(addr: usize, len: usize) -> Result<usize> {
    let bytes = len * std::mem::size_of::<T>();
    let (elem_size, elem_align) = (std::mem::size_of::<U>(), std::mem::align_of::<U>());
    if elem_size == 0 || !bytes.is_multiple_of(elem_size) || !addr.is_multiple_of(elem_align) {
        return Err(HipError::BadCast {
            bytes,
            addr,
            type_name: std::any::type_name::<U>(),
            elem_size,
            elem_align,
        });
    }
    Ok(bytes / elem_size)
}

/// `len`, `is_empty` and `size_bytes` of a type holding `len` elements of `T` (its
/// field `len`).
macro_rules! element_count {
    () => {
        pub fn len(&self) -> usize {
            self.len
        }

        pub fn is_empty(&self) -> bool {
            self.len == 0
        }

        pub fn size_bytes(&self) -> usize {
            self.len * std::mem::size_of::<T>()
        }
    };
}
pub(crate) use element_count;

/// What [`DeviceView`] and [`DeviceViewMut`] share: `new` from an address, a length and
/// a device ordinal, [`element_count!`], the device and the address.
macro_rules! view_basics {
    ($view:ident) => {
        pub(crate) fn new(addr: usize, len: usize, ordinal: usize) -> $view<'a, T> {
            $view {
                addr,
                len,
                ordinal,
                _borrow: PhantomData,
            }
        }

        element_count!();

        pub fn device_ordinal(&self) -> usize {
            self.ordinal
        }

        /// The device address of the first element (0 for an empty buffer).
        pub fn address(&self) -> usize {
            self.addr
        }
    };
}

/// An owned device allocation of `len` elements of `T`. Dropping it frees the memory
/// (the runtime's free waits for work already queued on it); a failure there is recorded
/// and returned by [`Device::check_err`].
pub struct DeviceBuffer<T: Pod> {
    context: Arc<DeviceContext>,
    /// Device address; 0 for an empty buffer, which owns no allocation.
    addr: usize,
    len: usize,
    _element: PhantomData<T>,
}

impl<T: Pod> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.context.ordinal())
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

impl<T: Pod> DeviceBuffer<T> {
    pub(crate) fn new(device: &Device, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = byte_len::<T>(len)?;
        let context = Arc::clone(device.context());
        let addr = if bytes == 0 {
            0
        } else {
            context.bind()?;
            let ptr = result::malloc(bytes)?;
            count(&context, |c| &c.device_allocations, 1);
            count(&context, |c| &c.device_bytes, bytes as u64);
            ptr.as_ptr() as usize
        };
        Ok(DeviceBuffer {
            context,
            addr,
            len,
            _element: PhantomData,
        })
    }

    element_count!();

    pub fn device_ordinal(&self) -> usize {
        self.context.ordinal()
    }

    /// The whole buffer, read-only.
    pub fn view(&self) -> DeviceView<'_, T> {
        DeviceView::new(self.addr, self.len, self.context.ordinal())
    }

    /// The whole buffer, writable.
    pub fn view_mut(&mut self) -> DeviceViewMut<'_, T> {
        DeviceViewMut::new(self.addr, self.len, self.context.ordinal())
    }

    /// Elements `range` of the buffer, read-only.
    pub fn slice(&self, range: Range<usize>) -> Result<DeviceView<'_, T>> {
        self.view().slice(range)
    }

    /// Elements `range` of the buffer, writable.
    pub fn slice_mut(&mut self, range: Range<usize>) -> Result<DeviceViewMut<'_, T>> {
        self.view_mut().slice_mut(range)
    }
}

impl<T: Pod> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        let Some(ptr) = NonNull::new(self.addr as *mut c_void) else {
            return;
        };
        // SAFETY: `ptr` is this buffer's own allocation from `result::malloc`, freed only
        // here; the runtime's free waits for queued work that still uses it.
        let freed = self
            .context
            .bind()
            .and_then(|()| unsafe { result::free(ptr) });
        match freed {
            Ok(()) => count(&self.context, |c| &c.device_frees, 1),
            Err(error) => self.context.defer(error),
        }
    }
}

/// A read-only view of device memory: `len` elements of `T` at a device address.
#[derive(Clone, Copy, Debug)]
pub struct DeviceView<'a, T> {
    addr: usize,
    len: usize,
    ordinal: usize,
    _borrow: PhantomData<&'a [T]>,
}

impl<'a, T: Pod> DeviceView<'a, T> {
    view_basics!(DeviceView);

    /// The device address as a pointer, for kernel launchers. Never dereference it on
    /// the host.
    pub fn as_ptr(&self) -> *const c_void {
        self.addr as *const c_void
    }

    /// Elements `range` of this view.
    pub fn slice(self, range: Range<usize>) -> Result<DeviceView<'a, T>> {
        check_range(&range, self.len)?;
        let addr = if range.start == range.end {
            self.addr
        } else {
            self.addr + range.start * std::mem::size_of::<T>()
        };
        Ok(DeviceView::new(addr, range.end - range.start, self.ordinal))
    }

    /// The same bytes as elements of `U`; fails unless they divide evenly and the
    /// address is aligned for `U`.
    pub fn cast<U: Pod>(self) -> Result<DeviceView<'a, U>> {
        let len = cast_len::<T, U>(self.addr, self.len)?;
        Ok(DeviceView::new(self.addr, len, self.ordinal))
    }
}

/// A writable view of device memory; not `Copy`, like `&mut [T]`.
#[derive(Debug)]
pub struct DeviceViewMut<'a, T> {
    addr: usize,
    len: usize,
    ordinal: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T: Pod> DeviceViewMut<'a, T> {
    view_basics!(DeviceViewMut);

    /// The device address as a pointer, for kernel launchers. Never dereference it on
    /// the host.
    pub fn as_mut_ptr(&mut self) -> *mut c_void {
        self.addr as *mut c_void
    }

    /// A read-only view of the same memory, for as long as this one is not used.
    pub fn as_view(&self) -> DeviceView<'_, T> {
        DeviceView::new(self.addr, self.len, self.ordinal)
    }

    /// A shorter-lived writable view of the same memory, so this one can be used again.
    pub fn reborrow(&mut self) -> DeviceViewMut<'_, T> {
        DeviceViewMut::new(self.addr, self.len, self.ordinal)
    }

    /// Elements `range` of this view.
    pub fn slice_mut(self, range: Range<usize>) -> Result<DeviceViewMut<'a, T>> {
        let view = self.as_view().slice(range)?;
        Ok(DeviceViewMut::new(view.addr, view.len, view.ordinal))
    }

    /// Two disjoint writable views: elements `..mid` and `mid..`.
    pub fn split_at_mut(self, mid: usize) -> Result<(DeviceViewMut<'a, T>, DeviceViewMut<'a, T>)> {
        check_range(&(0..mid), self.len)?;
        let tail = self.as_view().slice(mid..self.len)?;
        Ok((
            DeviceViewMut::new(self.addr, mid, self.ordinal),
            DeviceViewMut::new(tail.addr, tail.len, self.ordinal),
        ))
    }

    /// The same bytes as elements of `U`, writable.
    pub fn cast_mut<U: Pod>(self) -> Result<DeviceViewMut<'a, U>> {
        let len = cast_len::<T, U>(self.addr, self.len)?;
        Ok(DeviceViewMut::new(self.addr, len, self.ordinal))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_lengths_are_checked_for_overflow() {
        assert_eq!(byte_len::<u32>(10).unwrap(), 40);
        assert!(matches!(
            byte_len::<u64>(usize::MAX / 4),
            Err(HipError::SizeOverflow { elem_size: 8, .. })
        ));
    }

    #[test]
    fn view_slices_move_the_address_and_check_bounds() {
        let view = DeviceView::<f32>::new(0x1000, 100, 0);
        let part = view.slice(10..30).unwrap();
        assert_eq!(
            (part.address(), part.len(), part.size_bytes()),
            (0x1000 + 40, 20, 80)
        );
        assert!(matches!(
            view.slice(90..101),
            Err(HipError::OutOfBounds {
                start: 90,
                end: 101,
                len: 100
            })
        ));
        assert!(matches!(
            view.slice(Range { start: 20, end: 10 }),
            Err(HipError::OutOfBounds { .. })
        ));
        let empty = view.slice(100..100).unwrap();
        assert!(empty.is_empty());
    }

    #[test]
    fn casts_check_size_and_alignment() {
        let bytes = DeviceView::<u8>::new(0x2000, 64, 0);
        let floats = bytes.cast::<f32>().unwrap();
        assert_eq!((floats.address(), floats.len()), (0x2000, 16));
        assert!(matches!(
            bytes.slice(0..6).unwrap().cast::<f32>(),
            Err(HipError::BadCast { bytes: 6, .. })
        ));
        assert!(matches!(
            bytes.slice(2..10).unwrap().cast::<f32>(),
            Err(HipError::BadCast {
                addr: 0x2002,
                elem_align: 4,
                ..
            })
        ));
        assert!(matches!(
            floats.cast::<()>(),
            Err(HipError::BadCast { elem_size: 0, .. })
        ));
    }

    #[test]
    fn mutable_views_split_into_disjoint_parts() {
        let whole = DeviceViewMut::<u16>::new(0x4000, 10, 1);
        let (head, tail) = whole.split_at_mut(4).unwrap();
        assert_eq!((head.address(), head.len()), (0x4000, 4));
        assert_eq!(
            (tail.address(), tail.len(), tail.device_ordinal()),
            (0x4008, 6, 1)
        );
        let again = DeviceViewMut::<u16>::new(0x4000, 10, 1);
        assert!(matches!(
            again.split_at_mut(11),
            Err(HipError::OutOfBounds {
                end: 11,
                len: 10,
                ..
            })
        ));
    }

    #[test]
    fn counter_snapshots_subtract() {
        let later = AllocationCounters {
            device_allocations: 5,
            device_frees: 2,
            device_bytes: 100,
            pinned_allocations: 1,
            pinned_frees: 3,
        };
        let earlier = AllocationCounters {
            device_allocations: 3,
            device_frees: 2,
            device_bytes: 40,
            pinned_allocations: 0,
            pinned_frees: 1,
        };
        assert_eq!(
            later.since(&earlier),
            AllocationCounters {
                device_allocations: 2,
                device_frees: 0,
                device_bytes: 60,
                pinned_allocations: 1,
                pinned_frees: 2
            }
        );
    }
}
