//! Layer 2 of the collectives: one thin function per library call, turning its
//! `ncclResult_t` into a [`Result`] whose error names the call and carries the library's
//! name for the status and its message (`ncclGetErrorString`, and the text of
//! `ncclGetLastError` where the library has it).
//!
//! Functions that take communicator handles or device pointers are `unsafe` and say what
//! the caller must guarantee.

use super::sys::{self, Functions, NcclComm, NcclResult};
use crate::error::{HipError, Result};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;

/// Copies a NUL-terminated string the library returned; `None` for null or empty.
///
/// # Safety
/// `text` is null or points to a NUL-terminated string that outlives the call.
unsafe fn library_string(text: *const c_char) -> Option<String> {
    if text.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated by this function's contract.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

/// The error for status `code` of `call`: [`HipError::Api`] with the status's name
/// (`ncclInvalidArgument`) and the library's message for it, followed by the last error
/// the library reported when it says more.
pub(crate) fn status_error(
    functions: &Functions,
    call: &'static str,
    code: NcclResult,
) -> HipError {
    let name = sys::result_name(code)
        .map(str::to_owned)
        .unwrap_or_else(|| format!("ncclResult{code}"));
    // SAFETY: ncclGetErrorString accepts any value and returns a static string.
    let mut message = unsafe { library_string((functions.get_error_string)(code)) }
        .unwrap_or_else(|| "unknown result code".to_owned());
    if let Some(get_last_error) = functions.get_last_error {
        // SAFETY: ncclGetLastError ignores its argument (null is allowed) and returns the
        // library's last error text, a buffer of its own that lives as long as it does.
        if let Some(last) = unsafe { library_string(get_last_error(ptr::null_mut())) } {
            if last != message {
                message = format!("{message}; last error reported: {last}");
            }
        }
    }
    HipError::Api {
        call,
        code,
        name,
        message,
    }
}

/// Turns a status into a `Result`.
pub(crate) fn check(functions: &Functions, call: &'static str, code: NcclResult) -> Result<()> {
    if code == sys::NCCL_SUCCESS {
        Ok(())
    } else {
        Err(status_error(functions, call, code))
    }
}

/// The library's version code (`NCCL_VERSION_CODE`: 10000 × major + 100 × minor + patch
/// since NCCL 2.9).
pub(crate) fn get_version(functions: &Functions) -> Result<i32> {
    let mut version: c_int = 0;
    // SAFETY: the out-pointer is a live local the call writes once.
    check(functions, "ncclGetVersion", unsafe {
        (functions.get_version)(&mut version)
    })?;
    Ok(version)
}

/// One communicator per entry of `ordinals` (rank i on device `ordinals[i]`), created
/// together. On failure nothing is returned: the library does not say which of the
/// handles it wrote are usable, so none is released.
pub(crate) fn comm_init_all(functions: &Functions, ordinals: &[c_int]) -> Result<Vec<NcclComm>> {
    let count = c_int::try_from(ordinals.len()).map_err(|_| HipError::InvalidCommunicator {
        reason: format!(
            "{} devices are more than the library accepts",
            ordinals.len()
        ),
    })?;
    let mut comms: Vec<NcclComm> = vec![ptr::null_mut(); ordinals.len()];
    // SAFETY: `comms` has room for `count` handles and `ordinals` holds `count` ints; both
    // are live for the call, which only writes the handles.
    check(functions, "ncclCommInitAll", unsafe {
        (functions.comm_init_all)(comms.as_mut_ptr(), count, ordinals.as_ptr())
    })?;
    if comms.iter().any(|comm| comm.is_null()) {
        return Err(HipError::Api {
            call: "ncclCommInitAll",
            code: 0,
            name: "nullCommunicator".into(),
            message: "the library reported success but returned a null communicator".into(),
        });
    }
    Ok(comms)
}

/// # Safety
/// `comm` came from [`comm_init_all`] and is destroyed once; no graph that captured work
/// of it is alive (the library waits for such graphs to be destroyed first).
pub(crate) unsafe fn comm_destroy(functions: &Functions, comm: NcclComm) -> Result<()> {
    // SAFETY: this function's contract.
    check(functions, "ncclCommDestroy", unsafe {
        (functions.comm_destroy)(comm)
    })
}

/// The error a communicator met in the background (a failed transfer, a peer that went
/// away), if any.
///
/// # Safety
/// `comm` is live.
pub(crate) unsafe fn comm_async_error(functions: &Functions, comm: NcclComm) -> Result<()> {
    let mut state: NcclResult = sys::NCCL_SUCCESS;
    // SAFETY: `comm` is live by this function's contract; `state` is a live local.
    check(functions, "ncclCommGetAsyncError", unsafe {
        (functions.comm_get_async_error)(comm, &mut state)
    })?;
    check(functions, "ncclCommGetAsyncError", state)
}

/// Queues the in-place sum of `count` f32 at `buf` over every rank of `comm` on `stream`.
///
/// # Safety
/// `comm` and `stream` are live and belong to the same device; `buf` is device memory of
/// that device valid for `count` f32 until the operation completes.
pub(crate) unsafe fn all_reduce_sum_f32(
    functions: &Functions,
    buf: *mut c_void,
    count: usize,
    comm: NcclComm,
    stream: *mut c_void,
) -> Result<()> {
    // SAFETY: this function's contract; in place, so the send buffer is the receive one.
    check(functions, "ncclAllReduce", unsafe {
        (functions.all_reduce)(
            buf.cast_const(),
            buf,
            count,
            sys::NCCL_FLOAT32,
            sys::NCCL_SUM,
            comm,
            stream,
        )
    })
}

/// Opens a group: the library queues the collectives called until [`group_end`] and
/// launches them together.
pub(crate) fn group_start(functions: &Functions) -> Result<()> {
    // SAFETY: takes no arguments; it increments the calling thread's group depth.
    check(functions, "ncclGroupStart", unsafe {
        (functions.group_start)()
    })
}

/// Closes the group [`group_start`] opened, launching what was queued in it.
pub(crate) fn group_end(functions: &Functions) -> Result<()> {
    // SAFETY: takes no arguments; a call without an open group is reported as a status.
    check(functions, "ncclGroupEnd", unsafe {
        (functions.group_end)()
    })
}
