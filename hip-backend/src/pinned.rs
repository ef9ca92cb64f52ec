//! Page-locked host memory: the staging area for fast host↔device copies.

use crate::device::{Device, DeviceContext};
use crate::error::{HipError, Result};
use crate::memory::{byte_len, check_range, count};
use crate::result;
use crate::stream::{Event, Stream};
use bytemuck::Pod;
use std::ffi::c_void;
use std::ops::Range;
use std::ptr::NonNull;
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
    allocated: bool,
    /// Recorded after the copy last queued on this buffer; `in_flight` says whether that
    /// copy may still be running.
    last_copy: Option<Event>,
    in_flight: bool,
    /// Set when a queued copy could not be confirmed finished: the memory is withheld.
    poisoned: Option<String>,
}

// SAFETY: a PinnedBuffer owns its allocation alone, like a `Box<[T]>`; moving it to another
// thread moves that ownership. Its Event and context are themselves Send.
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
        let (ptr, allocated) = if bytes == 0 {
            (NonNull::dangling(), false)
        } else {
            context.bind()?;
            let raw = result::host_alloc(bytes)?;
            count(&context, |c| &c.pinned_allocations, 1);
            // SAFETY: `raw` is a fresh allocation of `bytes` bytes, writable by the host;
            // zeroing it makes every element a valid `T` (Pod: all-zero is valid).
            unsafe { std::ptr::write_bytes(raw.as_ptr().cast::<u8>(), 0, bytes) };
            (raw.cast::<T>(), true)
        };
        Ok(PinnedBuffer {
            context,
            ptr,
            len,
            allocated,
            last_copy: None,
            in_flight: false,
            poisoned: None,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn size_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

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
        // SAFETY: `ptr` is valid for `len` initialized elements (zeroed at allocation, or
        // dangling with len 0 bytes); no copy is running (just waited) and none can start
        // while `&self` is borrowed, since starting one takes `&mut self`.
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
        // allocation or one past its end.
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
        if !self.allocated {
            return;
        }
        if let Err(error) = self.wait_shared() {
            // The device may still be copying into or out of this memory: leak it.
            self.context.defer(error);
            return;
        }
        // SAFETY: our own allocation from `result::host_alloc`, freed only here, with no
        // copy running (just waited) and no slice outstanding (we hold `&mut self`).
        if let Err(error) = unsafe { result::host_free(self.ptr.cast::<c_void>()) } {
            self.context.defer(error);
        }
    }
}
