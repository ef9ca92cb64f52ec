//! Streams (ordered queues of device work), events (markers in a stream: wait on them,
//! query them, time between two), and the copies queued on a stream.

use crate::device::{Device, DeviceContext};
use crate::error::{HipError, Result};
use crate::memory::{byte_len, check_range, DeviceView, DeviceViewMut};
use crate::pinned::PinnedBuffer;
use crate::registered::HostRegistration;
use crate::result::{self, CopyKind};
use crate::sys::{RawEvent, RawStream};
use bytemuck::Pod;
use std::ffi::c_void;
use std::ops::Range;
use std::sync::Arc;

/// A non-blocking stream on one device. Work queued on it runs in order; work on
/// different streams may overlap. Dropping it releases the stream once its work is done.
pub struct Stream {
    context: Arc<DeviceContext>,
    raw: RawStream,
}

// SAFETY: a stream handle may be used from any host thread; the runtime serializes what it
// must. The handle is only ever passed to runtime calls, never dereferenced.
unsafe impl Send for Stream {}
// SAFETY: as above; every method takes `&self` and is a thread-safe runtime call.
unsafe impl Sync for Stream {}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("device", &self.context.ordinal())
            .field("raw", &self.raw)
            .finish()
    }
}

fn same_device(what: &'static str, stream: &Stream, found: usize) -> Result<()> {
    let expected = stream.device_ordinal();
    if expected == found {
        Ok(())
    } else {
        Err(HipError::DeviceMismatch {
            what,
            expected,
            found,
        })
    }
}

fn same_length(op: &'static str, src: usize, dst: usize) -> Result<()> {
    if src == dst {
        Ok(())
    } else {
        Err(HipError::LengthMismatch { op, src, dst })
    }
}

impl Stream {
    pub(crate) fn new(device: &Device) -> Result<Stream> {
        let context = Arc::clone(device.context());
        context.bind()?;
        let raw = result::stream_create()?;
        Ok(Stream { context, raw })
    }

    pub(crate) fn context(&self) -> &Arc<DeviceContext> {
        &self.context
    }

    pub fn device_ordinal(&self) -> usize {
        self.context.ordinal()
    }

    /// The runtime's handle (`hipStream_t` / `cudaStream_t`), for kernel launchers in
    /// other crates. It stays valid while this `Stream` lives.
    pub fn as_raw(&self) -> *mut c_void {
        self.raw
    }

    /// Waits for the work queued so far, without reporting deferred failures.
    pub(crate) fn synchronize_queue(&self) -> Result<()> {
        // SAFETY: `self.raw` is live until `Drop`.
        unsafe { result::stream_synchronize(self.raw) }
    }

    /// Waits for all work queued so far, then reports any failure recorded in `Drop`
    /// on this device (see [`Device::check_err`]).
    pub fn synchronize(&self) -> Result<()> {
        self.synchronize_queue()?;
        self.context.check_err()
    }

    /// True when all work queued so far has finished.
    pub fn is_idle(&self) -> Result<bool> {
        // SAFETY: `self.raw` is live until `Drop`.
        unsafe { result::stream_query(self.raw) }
    }

    /// Makes later work on this stream wait until `event`'s last record has been reached
    /// (on any stream, of any device). The host does not wait.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        // SAFETY: both handles are live while `self` and `event` are borrowed.
        unsafe { result::stream_wait_event(self.raw, event.raw) }
    }

    /// Queues a copy of `src[src_range]` (page-locked host memory) into `dst`, returning at
    /// once. `src` cannot be read or written on the host until the copy finishes (its
    /// accessors wait for it).
    pub fn copy_h2d_async<T: Pod>(
        &self,
        src: &mut PinnedBuffer<T>,
        src_range: Range<usize>,
        mut dst: DeviceViewMut<'_, T>,
    ) -> Result<()> {
        same_device("the destination", self, dst.device_ordinal())?;
        same_length(
            "copy_h2d_async",
            src_range.end.saturating_sub(src_range.start),
            dst.len(),
        )?;
        let host = src.begin_copy(self, &src_range)?;
        let bytes = dst.size_bytes();
        if bytes > 0 {
            // SAFETY: `host` points at `dst.len()` elements inside `src` (range checked in
            // begin_copy); `src` is page-locked and withheld from the host until the event
            // end_copy records has passed; `dst` is device memory of the same size on this
            // stream's device, kept allocated by its borrow (and the runtime's free waits).
            unsafe {
                result::memcpy_async(
                    CopyKind::HostToDevice,
                    dst.as_mut_ptr(),
                    host as *const c_void,
                    bytes,
                    self.raw,
                )?
            };
        }
        src.end_copy(self)
    }

    /// Queues a copy of bytes `range` of `src` (registered host memory: page-locked, the
    /// fast path) into `dst`, returning at once.
    ///
    /// # Safety
    /// `src` must stay alive (registered, its bytes unchanged) until the copy has
    /// finished: synchronize this stream, or wait for work queued after the copy, before
    /// dropping it.
    pub unsafe fn copy_registered_h2d_async(
        &self,
        src: &HostRegistration<'_>,
        range: Range<usize>,
        mut dst: DeviceViewMut<'_, u8>,
    ) -> Result<()> {
        same_device("the destination", self, dst.device_ordinal())?;
        check_range(&range, src.len())?;
        same_length("copy_registered_h2d_async", range.len(), dst.len())?;
        if range.is_empty() {
            return Ok(());
        }
        // SAFETY: the source lies inside the registered bytes (range checked), alive by
        // the caller's contract until the copy ends; `dst` is device memory of that
        // length on this stream's device, kept allocated by its borrow (and the runtime's
        // free waits for queued work).
        unsafe {
            result::memcpy_async(
                CopyKind::HostToDevice,
                dst.as_mut_ptr(),
                src.host_ptr().add(range.start) as *const c_void,
                range.len(),
                self.raw,
            )
        }
    }

    /// Queues a copy of `src` into `dst[dst_range]` (page-locked host memory), returning at
    /// once. `dst` cannot be read on the host until the copy finishes (its accessors wait).
    pub fn copy_d2h_async<T: Pod>(
        &self,
        src: DeviceView<'_, T>,
        dst: &mut PinnedBuffer<T>,
        dst_range: Range<usize>,
    ) -> Result<()> {
        same_device("the source", self, src.device_ordinal())?;
        same_length(
            "copy_d2h_async",
            src.len(),
            dst_range.end.saturating_sub(dst_range.start),
        )?;
        let host = dst.begin_copy(self, &dst_range)?;
        let bytes = src.size_bytes();
        if bytes > 0 {
            // SAFETY: `host` points at `src.len()` writable elements inside `dst`, which is
            // page-locked and withheld from the host until the copy's event has passed;
            // every byte pattern is a valid `T` (Pod). `src` is live device memory.
            unsafe {
                result::memcpy_async(
                    CopyKind::DeviceToHost,
                    host.cast::<c_void>(),
                    src.as_ptr(),
                    bytes,
                    self.raw,
                )?
            };
        }
        dst.end_copy(self)
    }

    /// Queues a device-to-device copy.
    pub fn copy_d2d_async<T: Pod>(
        &self,
        src: DeviceView<'_, T>,
        mut dst: DeviceViewMut<'_, T>,
    ) -> Result<()> {
        same_device("the source", self, src.device_ordinal())?;
        same_device("the destination", self, dst.device_ordinal())?;
        same_length("copy_d2d_async", src.len(), dst.len())?;
        let bytes = src.size_bytes();
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both are live device allocations of `bytes` on this stream's device; the
        // host never touches device memory, and frees wait for queued work.
        unsafe {
            result::memcpy_async(
                CopyKind::DeviceToDevice,
                dst.as_mut_ptr(),
                src.as_ptr(),
                bytes,
                self.raw,
            )
        }
    }

    /// Queues a copy from one device's memory to another's (or the same one's), ordered on
    /// this stream, which may be of either device. Over the devices' link once
    /// [`Device::enable_peer_access`](crate::Device::enable_peer_access) has been called
    /// for them, through the host otherwise.
    pub fn copy_peer_async<T: Pod>(
        &self,
        src: DeviceView<'_, T>,
        mut dst: DeviceViewMut<'_, T>,
    ) -> Result<()> {
        same_length("copy_peer_async", src.len(), dst.len())?;
        let bytes = src.size_bytes();
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both are live device allocations of `bytes` on the devices they name;
        // the host never touches device memory, and frees wait for queued work.
        unsafe {
            result::memcpy_peer_async(
                dst.as_mut_ptr(),
                dst.device_ordinal(),
                src.as_ptr(),
                src.device_ordinal(),
                bytes,
                self.raw,
            )
        }
    }

    /// Copies `src` into `dst` through `staging` (page-locked, at least `src.len()` long)
    /// and returns at once: one asynchronous copy, ordered on this stream like its
    /// kernels. From ordinary memory ([`Stream::write_from_host`]) the runtime stages the
    /// copy in pieces and the host waits, each piece possibly behind copies queued on
    /// other streams. `staging` is first waited for if a copy still uses it; its accessors
    /// wait for this one.
    pub fn write_staged<T: Pod>(
        &self,
        staging: &mut PinnedBuffer<T>,
        src: &[T],
        dst: DeviceViewMut<'_, T>,
    ) -> Result<()> {
        let capacity = staging.len();
        staging
            .as_mut_slice()?
            .get_mut(..src.len())
            .ok_or(HipError::LengthMismatch {
                op: "write_staged",
                src: src.len(),
                dst: capacity,
            })?
            .copy_from_slice(src);
        self.copy_h2d_async(staging, 0..src.len(), dst)
    }

    /// Copies ordinary (pageable) host memory into `dst` and waits until it is done, so
    /// `src` is free again on return. Slower than from a [`PinnedBuffer`].
    pub fn write_from_host<T: Pod>(&self, src: &[T], mut dst: DeviceViewMut<'_, T>) -> Result<()> {
        same_device("the destination", self, dst.device_ordinal())?;
        same_length("write_from_host", src.len(), dst.len())?;
        let bytes = byte_len::<T>(src.len())?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `src` is borrowed for this whole call and we wait for the stream before
        // returning, so it outlives the copy; `dst` is live device memory of `bytes`.
        unsafe {
            result::memcpy_async(
                CopyKind::HostToDevice,
                dst.as_mut_ptr(),
                src.as_ptr().cast::<c_void>(),
                bytes,
                self.raw,
            )?
        };
        self.synchronize_queue()
    }

    /// Copies `src` into ordinary host memory and waits until it is done. Work queued
    /// earlier on this stream finishes first.
    pub fn read_to_host<T: Pod>(&self, src: DeviceView<'_, T>, dst: &mut [T]) -> Result<()> {
        same_device("the source", self, src.device_ordinal())?;
        same_length("read_to_host", src.len(), dst.len())?;
        let bytes = src.size_bytes();
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `dst` is exclusively borrowed for this whole call and we wait for the
        // stream before returning; any byte pattern is a valid `T` (Pod).
        unsafe {
            result::memcpy_async(
                CopyKind::DeviceToHost,
                dst.as_mut_ptr().cast::<c_void>(),
                src.as_ptr(),
                bytes,
                self.raw,
            )?
        };
        self.synchronize_queue()
    }

    /// Queues setting every byte of `dst` to `byte`.
    pub fn memset_async<T: Pod>(&self, mut dst: DeviceViewMut<'_, T>, byte: u8) -> Result<()> {
        same_device("the destination", self, dst.device_ordinal())?;
        let bytes = dst.size_bytes();
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `dst` is live device memory of `bytes` on this stream's device.
        unsafe { result::memset_async(dst.as_mut_ptr(), byte, bytes, self.raw) }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: our own handle, destroyed only here; the runtime releases it after the
        // work already queued has finished.
        if let Err(error) = unsafe { result::stream_destroy(self.raw) } {
            self.context.defer(error);
        }
    }
}

/// A marker recorded in a stream. Other streams can wait for it, the host can wait for
/// or poll it, and two timing events give the device time between them.
pub struct Event {
    context: Arc<DeviceContext>,
    raw: RawEvent,
    timing: bool,
}

// SAFETY: event handles may be used from any host thread; the handle is only ever passed
// to runtime calls, never dereferenced.
unsafe impl Send for Event {}
// SAFETY: as above; every method takes `&self` and is a thread-safe runtime call.
unsafe impl Sync for Event {}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("device", &self.context.ordinal())
            .field("timing", &self.timing)
            .finish()
    }
}

impl Event {
    pub(crate) fn new(device: &Device, timing: bool) -> Result<Event> {
        Event::on_context(device.context(), timing)
    }

    pub(crate) fn on_context(context: &Arc<DeviceContext>, timing: bool) -> Result<Event> {
        context.bind()?;
        let raw = result::event_create(timing)?;
        Ok(Event {
            context: Arc::clone(context),
            raw,
            timing,
        })
    }

    pub fn device_ordinal(&self) -> usize {
        self.context.ordinal()
    }

    /// Whether this event can time ([`Event::elapsed_ms_since`]).
    pub fn has_timing(&self) -> bool {
        self.timing
    }

    /// Records the event at the current end of `stream` (same device). Recording again
    /// moves the marker.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        same_device("the event", stream, self.device_ordinal())?;
        // SAFETY: both handles are live while `self` and `stream` are borrowed.
        unsafe { result::event_record(self.raw, stream.raw) }
    }

    /// Blocks the host until the work before the last record has finished.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: `self.raw` is live until `Drop`.
        unsafe { result::event_synchronize(self.raw) }
    }

    /// True when the work before the last record has finished (or it was never recorded).
    pub fn is_complete(&self) -> Result<bool> {
        // SAFETY: `self.raw` is live until `Drop`.
        unsafe { result::event_query(self.raw) }
    }

    /// Device time in milliseconds from `start`'s last record to this event's. Both must
    /// have timing and be complete.
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32> {
        // SAFETY: both handles are live while borrowed.
        unsafe { result::event_elapsed_ms(start.raw, self.raw) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: our own handle, destroyed only here; the runtime keeps what a pending
        // record needs until it completes.
        if let Err(error) = unsafe { result::event_destroy(self.raw) } {
            self.context.defer(error);
        }
    }
}
