//! Layer 2: one thin function per runtime call, turning its status into a [`Result`].
//!
//! Functions that take raw pointers or handles are `unsafe` and say what the caller must
//! guarantee; the others are safe because the shim only writes through out-pointers this
//! module owns. Errors carry the runtime's own error name and message (`hipErrorNoDevice`
//! on AMD, `cudaErrorNoDevice` on NVIDIA) next to the HIP name of the call.

use crate::error::{HipError, Result};
use crate::sys::{self, RawEvent, RawGraph, RawStream, RfhipDeviceProps};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::{self, NonNull};

/// Copies a NUL-terminated string the runtime returned; `null` reads as "unknown".
///
/// # Safety
/// `text` is null or points to a NUL-terminated string that outlives the call.
unsafe fn runtime_string(text: *const c_char) -> String {
    if text.is_null() {
        return "unknown".to_owned();
    }
    // SAFETY: non-null and NUL-terminated by this function's contract.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}

/// The error for a failed call: `NoDevice` when the runtime says there is no device or
/// no driver, `Api` otherwise; `BuiltWithoutGpu` when no runtime is linked in.
pub(crate) fn status_error(call: &'static str, code: c_int) -> HipError {
    if cfg!(hip_platform = "none") || code == sys::STATUS_BUILT_WITHOUT_GPU {
        return HipError::BuiltWithoutGpu;
    }
    // SAFETY: these three accept any status value; the names and messages they return are
    // static NUL-terminated strings owned by the runtime (hipGetErrorName's contract).
    let (kind, name, message) = unsafe {
        (
            sys::rfhip_status_kind(code),
            runtime_string(sys::rfhip_error_name(code)),
            runtime_string(sys::rfhip_error_string(code)),
        )
    };
    match kind {
        sys::KIND_NO_DEVICE | sys::KIND_NO_DRIVER => HipError::NoDevice {
            platform: crate::PLATFORM.name(),
            call,
            code,
            name,
            message,
        },
        _ => HipError::Api {
            call,
            code,
            name,
            message,
        },
    }
}

/// The portable kind of a status (`sys::KIND_*`).
fn status_kind(code: c_int) -> c_int {
    // SAFETY: the shim's classifier accepts any value and touches no memory (the stub
    // returns a constant).
    unsafe { sys::rfhip_status_kind(code) }
}

/// Turns a native status (`hipError_t` / `cudaError_t`, 0 for success) into a `Result`.
pub(crate) fn check(call: &'static str, code: c_int) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(status_error(call, code))
    }
}

fn ordinal_to_c(ordinal: usize) -> Result<c_int> {
    c_int::try_from(ordinal).map_err(|_| HipError::InvalidDevice { ordinal, count: 0 })
}

/// The platform the linked shim was built for (`amd`, `nvidia`, or `none`).
pub(crate) fn shim_platform_name() -> String {
    // SAFETY: returns a pointer to a static NUL-terminated literal.
    unsafe { runtime_string(sys::rfhip_platform_name()) }
}

/// The integer the runtime query `call` writes through its argument (`query`, which
/// returns the call's status).
fn query_int(call: &'static str, query: impl FnOnce(&mut c_int) -> c_int) -> Result<c_int> {
    let mut value: c_int = 0;
    check(call, query(&mut value))?;
    Ok(value)
}

pub(crate) fn runtime_version() -> Result<i32> {
    // SAFETY: the argument is a live local the call writes once.
    query_int("hipRuntimeGetVersion", |v| unsafe {
        sys::rfhip_runtime_version(v)
    })
}

pub(crate) fn driver_version() -> Result<i32> {
    // SAFETY: the argument is a live local the call writes once.
    query_int("hipDriverGetVersion", |v| unsafe {
        sys::rfhip_driver_version(v)
    })
}

pub(crate) fn device_count() -> Result<usize> {
    // SAFETY: the argument is a live local the call writes once.
    let count = query_int("hipGetDeviceCount", |c| unsafe {
        sys::rfhip_device_count(c)
    })?;
    Ok(usize::try_from(count).unwrap_or(0))
}

pub(crate) fn set_device(ordinal: usize) -> Result<()> {
    let ordinal = ordinal_to_c(ordinal)?;
    // SAFETY: takes a plain integer; an invalid ordinal is reported as a status.
    check("hipSetDevice", unsafe { sys::rfhip_set_device(ordinal) })
}

pub(crate) fn device_synchronize() -> Result<()> {
    // SAFETY: no arguments; waits for the current device.
    check("hipDeviceSynchronize", unsafe {
        sys::rfhip_device_synchronize()
    })
}

/// (free, total) bytes of the current device.
pub(crate) fn mem_get_info() -> Result<(usize, usize)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both out-pointers are live locals.
    check("hipMemGetInfo", unsafe {
        sys::rfhip_mem_get_info(&mut free, &mut total)
    })?;
    Ok((free, total))
}

pub(crate) fn device_props(ordinal: usize) -> Result<RfhipDeviceProps> {
    let ordinal = ordinal_to_c(ordinal)?;
    let mut props = RfhipDeviceProps::zeroed();
    // SAFETY: `props` is a live, correctly laid out (#[repr(C)], same fields as the shim's
    // struct) local; the shim NUL-terminates both strings with snprintf.
    check("hipGetDeviceProperties", unsafe {
        sys::rfhip_device_props(ordinal, &mut props)
    })?;
    Ok(props)
}

fn allocation_error(call: &'static str, bytes: usize, code: c_int) -> HipError {
    if status_kind(code) == sys::KIND_OUT_OF_MEMORY {
        if let HipError::Api { name, message, .. } = status_error(call, code) {
            return HipError::OutOfMemory {
                call,
                bytes,
                name,
                message,
            };
        }
    }
    status_error(call, code)
}

/// Allocates `bytes` with `alloc`, which writes the new pointer into its argument and
/// returns the runtime's status; `call` names it in errors and, with `kind`, to
/// [`crate::fault`].
fn allocate(
    kind: crate::fault::Kind,
    call: &'static str,
    bytes: usize,
    alloc: impl FnOnce(&mut *mut c_void) -> c_int,
) -> Result<NonNull<c_void>> {
    crate::fault::check(kind, call, bytes)?;
    let mut raw: *mut c_void = ptr::null_mut();
    let code = alloc(&mut raw);
    if code != 0 {
        return Err(allocation_error(call, bytes, code));
    }
    NonNull::new(raw).ok_or_else(|| HipError::Api {
        call,
        code: 0,
        name: "nullPointer".into(),
        message: format!("the runtime returned a null pointer for {bytes} bytes"),
    })
}

/// Allocates `bytes` (> 0) of device memory on the current device.
pub(crate) fn malloc(bytes: usize) -> Result<NonNull<c_void>> {
    allocate(crate::fault::Kind::Device, "hipMalloc", bytes, |raw| {
        // SAFETY: `raw` is a live local the call writes once.
        unsafe { sys::rfhip_malloc(raw, bytes) }
    })
}

/// # Safety
/// `raw` came from [`malloc`] and is freed once; no queued work still uses it (the
/// runtime's free waits for the device, so work queued earlier is safe).
pub(crate) unsafe fn free(raw: NonNull<c_void>) -> Result<()> {
    // SAFETY: the caller passes a live allocation of ours, once.
    check("hipFree", unsafe { sys::rfhip_free(raw.as_ptr()) })
}

/// Allocates `bytes` (> 0) of page-locked host memory, pinned for every device.
pub(crate) fn host_alloc(bytes: usize) -> Result<NonNull<c_void>> {
    allocate(crate::fault::Kind::Pinned, "hipHostMalloc", bytes, |raw| {
        // SAFETY: `raw` is a live local the call writes once.
        unsafe { sys::rfhip_host_alloc(raw, bytes) }
    })
}

/// # Safety
/// `raw` came from [`host_alloc`], is freed once, and no copy in flight uses it.
pub(crate) unsafe fn host_free(raw: NonNull<c_void>) -> Result<()> {
    // SAFETY: the caller passes a live pinned allocation of ours, once, with no copy left.
    check("hipHostFree", unsafe { sys::rfhip_host_free(raw.as_ptr()) })
}

/// Registers `bytes` (> 0) of host memory at `ptr` with the runtime: page-locked for every
/// device, as [`host_alloc`]'s memory is. Counts as a page-locked allocation for
/// [`crate::fault`].
///
/// # Safety
/// `ptr` starts `bytes` of host memory mapped readable and writable, which stays mapped
/// until [`host_unregister`] has been called on `ptr`.
pub(crate) unsafe fn host_register(ptr: NonNull<c_void>, bytes: usize) -> Result<()> {
    crate::fault::check(crate::fault::Kind::Pinned, "hipHostRegister", bytes)?;
    // SAFETY: live mapped memory of `bytes`, by this function's contract.
    let code = unsafe { sys::rfhip_host_register(ptr.as_ptr(), bytes) };
    if code != 0 {
        return Err(allocation_error("hipHostRegister", bytes, code));
    }
    Ok(())
}

/// # Safety
/// `ptr` was registered by [`host_register`], is unregistered once, and no copy in flight
/// uses it.
pub(crate) unsafe fn host_unregister(ptr: NonNull<c_void>) -> Result<()> {
    // SAFETY: the caller passes memory of ours registered once, with no copy left.
    check("hipHostUnregister", unsafe {
        sys::rfhip_host_unregister(ptr.as_ptr())
    })
}

/// The direction of an asynchronous copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyKind {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

/// Queues a copy of `bytes` on `stream`.
///
/// # Safety
/// `dst` and `src` are valid for `bytes` in the memory spaces `kind` names, and stay valid
/// and untouched by the host until the copy completes (for pageable host memory: until the
/// stream has been synchronized). `stream` is a live stream.
pub(crate) unsafe fn memcpy_async(
    kind: CopyKind,
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    stream: RawStream,
) -> Result<()> {
    // SAFETY: pointer validity and lifetime are this function's contract.
    let code = unsafe {
        match kind {
            CopyKind::HostToDevice => sys::rfhip_memcpy_h2d_async(dst, src, bytes, stream),
            CopyKind::DeviceToHost => sys::rfhip_memcpy_d2h_async(dst, src, bytes, stream),
            CopyKind::DeviceToDevice => sys::rfhip_memcpy_d2d_async(dst, src, bytes, stream),
        }
    };
    check("hipMemcpyAsync", code)
}

/// Queues a copy of `bytes` from `src` on device `src_device` to `dst` on `dst_device`.
///
/// # Safety
/// `dst` and `src` are device memory of their devices, valid for `bytes` until the copy
/// completes; `stream` is live.
pub(crate) unsafe fn memcpy_peer_async(
    dst: *mut c_void,
    dst_device: usize,
    src: *const c_void,
    src_device: usize,
    bytes: usize,
    stream: RawStream,
) -> Result<()> {
    let (dst_device, src_device) = (ordinal_to_c(dst_device)?, ordinal_to_c(src_device)?);
    // SAFETY: pointer validity and lifetime are this function's contract.
    check("hipMemcpyPeerAsync", unsafe {
        sys::rfhip_memcpy_peer_async(dst, dst_device, src, src_device, bytes, stream)
    })
}

/// Whether `device` can read and write `peer`'s memory directly.
pub(crate) fn device_can_access_peer(device: usize, peer: usize) -> Result<bool> {
    let (device, peer) = (ordinal_to_c(device)?, ordinal_to_c(peer)?);
    // SAFETY: the out-pointer is a live local the call writes once.
    let can = query_int("hipDeviceCanAccessPeer", |c| unsafe {
        sys::rfhip_device_can_access_peer(c, device, peer)
    })?;
    Ok(can != 0)
}

/// Lets the current device reach `peer`'s memory (already allowed: success).
pub(crate) fn device_enable_peer_access(peer: usize) -> Result<()> {
    let peer = ordinal_to_c(peer)?;
    // SAFETY: takes a plain integer; a bad ordinal is reported as a status.
    check("hipDeviceEnablePeerAccess", unsafe {
        sys::rfhip_device_enable_peer_access(peer)
    })
}

/// Queues setting `bytes` of device memory at `dst` to `byte_value`.
///
/// # Safety
/// `dst` is device memory valid for `bytes` until the operation completes; `stream` is live.
pub(crate) unsafe fn memset_async(
    dst: *mut c_void,
    byte_value: u8,
    bytes: usize,
    stream: RawStream,
) -> Result<()> {
    // SAFETY: this function's contract.
    check("hipMemsetAsync", unsafe {
        sys::rfhip_memset_async(dst, c_int::from(byte_value), bytes, stream)
    })
}

/// Creates a non-blocking stream on the current device.
pub(crate) fn stream_create() -> Result<RawStream> {
    let mut raw: RawStream = ptr::null_mut();
    // SAFETY: `raw` is a live local the call writes once.
    check("hipStreamCreateWithFlags", unsafe {
        sys::rfhip_stream_create(&mut raw)
    })?;
    Ok(raw)
}

/// # Safety
/// `stream` came from [`stream_create`] and is destroyed once.
pub(crate) unsafe fn stream_destroy(stream: RawStream) -> Result<()> {
    // SAFETY: this function's contract.
    check("hipStreamDestroy", unsafe {
        sys::rfhip_stream_destroy(stream)
    })
}

/// # Safety
/// `stream` is live.
pub(crate) unsafe fn stream_synchronize(stream: RawStream) -> Result<()> {
    // SAFETY: this function's contract.
    check("hipStreamSynchronize", unsafe {
        sys::rfhip_stream_synchronize(stream)
    })
}

/// True when all work queued on `stream` has finished.
///
/// # Safety
/// `stream` is live.
pub(crate) unsafe fn stream_query(stream: RawStream) -> Result<bool> {
    // SAFETY: this function's contract.
    let code = unsafe { sys::rfhip_stream_query(stream) };
    ready_or_error("hipStreamQuery", code)
}

/// # Safety
/// `stream` and `event` are live.
pub(crate) unsafe fn stream_wait_event(stream: RawStream, event: RawEvent) -> Result<()> {
    // SAFETY: this function's contract.
    check("hipStreamWaitEvent", unsafe {
        sys::rfhip_stream_wait_event(stream, event)
    })
}

/// Creates an event on the current device, with timing or without (cheaper to record).
pub(crate) fn event_create(enable_timing: bool) -> Result<RawEvent> {
    let mut raw: RawEvent = ptr::null_mut();
    // SAFETY: `raw` is a live local the call writes once.
    check("hipEventCreateWithFlags", unsafe {
        sys::rfhip_event_create(&mut raw, c_int::from(enable_timing))
    })?;
    Ok(raw)
}

/// # Safety
/// `event` came from [`event_create`] and is destroyed once.
pub(crate) unsafe fn event_destroy(event: RawEvent) -> Result<()> {
    // SAFETY: this function's contract.
    check("hipEventDestroy", unsafe {
        sys::rfhip_event_destroy(event)
    })
}

/// # Safety
/// `event` and `stream` are live.
pub(crate) unsafe fn event_record(event: RawEvent, stream: RawStream) -> Result<()> {
    // SAFETY: this function's contract.
    check("hipEventRecord", unsafe {
        sys::rfhip_event_record(event, stream)
    })
}

/// # Safety
/// `event` is live.
pub(crate) unsafe fn event_synchronize(event: RawEvent) -> Result<()> {
    // SAFETY: this function's contract.
    check("hipEventSynchronize", unsafe {
        sys::rfhip_event_synchronize(event)
    })
}

/// True when the work before the event's last record has finished.
///
/// # Safety
/// `event` is live.
pub(crate) unsafe fn event_query(event: RawEvent) -> Result<bool> {
    // SAFETY: this function's contract.
    let code = unsafe { sys::rfhip_event_query(event) };
    ready_or_error("hipEventQuery", code)
}

/// Milliseconds between two recorded timing events.
///
/// # Safety
/// `start` and `end` are live.
pub(crate) unsafe fn event_elapsed_ms(start: RawEvent, end: RawEvent) -> Result<f32> {
    let mut milliseconds = 0.0f32;
    // SAFETY: both handles live by this function's contract; `milliseconds` is a live local.
    check("hipEventElapsedTime", unsafe {
        sys::rfhip_event_elapsed_ms(&mut milliseconds, start, end)
    })?;
    Ok(milliseconds)
}

fn ready_or_error(call: &'static str, code: c_int) -> Result<bool> {
    if code == 0 {
        return Ok(true);
    }
    if status_kind(code) == sys::KIND_NOT_READY {
        return Ok(false);
    }
    Err(status_error(call, code))
}

/// Starts capturing the work queued on `stream` into a graph.
///
/// # Safety
/// `stream` is live.
pub(crate) unsafe fn stream_begin_capture(stream: RawStream) -> Result<()> {
    // SAFETY: this function's contract.
    check("hipStreamBeginCapture", unsafe {
        sys::rfhip_stream_begin_capture(stream)
    })
}

/// Ends the capture on `stream` and instantiates the captured graph.
///
/// # Safety
/// `stream` is live and capturing.
pub(crate) unsafe fn stream_end_capture(stream: RawStream) -> Result<RawGraph> {
    let mut exec: RawGraph = ptr::null_mut();
    // SAFETY: `stream` is live by this function's contract; `exec` is a live local.
    check("hipStreamEndCapture", unsafe {
        sys::rfhip_stream_end_capture(stream, &mut exec)
    })?;
    Ok(exec)
}

/// # Safety
/// `exec` came from [`stream_end_capture`] and is live; `stream` is live.
pub(crate) unsafe fn graph_launch(exec: RawGraph, stream: RawStream) -> Result<()> {
    // SAFETY: this function's contract.
    check("hipGraphLaunch", unsafe {
        sys::rfhip_graph_launch(exec, stream)
    })
}

/// # Safety
/// `exec` came from [`stream_end_capture`] and is destroyed once.
pub(crate) unsafe fn graph_destroy(exec: RawGraph) -> Result<()> {
    // SAFETY: this function's contract.
    check("hipGraphExecDestroy", unsafe {
        sys::rfhip_graph_destroy(exec)
    })
}
