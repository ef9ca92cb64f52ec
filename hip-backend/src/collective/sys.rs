//! Layer 1 of the collectives: the C types of NCCL's (and RCCL's) API that this crate
//! uses, the function pointer types of its entry points, and the table of those entry
//! points resolved from a loaded library. Nothing here is called directly; `result.rs`
//! wraps every call.
//!
//! Values and layouts are those of `nccl.h`: RCCL declares the same types and exports the
//! same `nccl*` symbols, so one set of declarations serves both.

use super::loader::Library;
use std::ffi::{c_char, c_int, c_void};

/// `ncclResult_t`: a status, [`NCCL_SUCCESS`] or an error code.
pub(crate) type NcclResult = c_int;

/// `ncclSuccess`.
pub(crate) const NCCL_SUCCESS: NcclResult = 0;

/// The opaque communicator `struct ncclComm`, only ever behind a pointer.
#[repr(C)]
pub(crate) struct NcclCommOpaque {
    _private: [u8; 0],
}

/// `ncclComm_t`: a communicator handle (one rank).
pub(crate) type NcclComm = *mut NcclCommOpaque;

/// `NCCL_UNIQUE_ID_BYTES`.
pub(crate) const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: what the ranks of a communicator spread over several processes share to
/// find each other (`ncclGetUniqueId`, `ncclCommInitRank`). The single-process
/// communicators built here ([`super::Communicator::for_devices`]) need none; the type
/// is declared for the multi-process initialisation.
#[repr(C)]
#[derive(Clone, Copy)]
#[allow(dead_code)]
pub(crate) struct NcclUniqueId {
    pub(crate) internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

const _: () = assert!(std::mem::size_of::<NcclUniqueId>() == NCCL_UNIQUE_ID_BYTES);

/// `ncclDataType_t`, an `int`-sized C enum.
pub(crate) type NcclDataType = c_int;

/// `ncclFloat32`.
pub(crate) const NCCL_FLOAT32: NcclDataType = 7;

/// `ncclRedOp_t`, an `int`-sized C enum.
pub(crate) type NcclRedOp = c_int;

/// `ncclSum`.
pub(crate) const NCCL_SUM: NcclRedOp = 0;

/// The name of each `ncclResult_t` value (`nccl.h`); `None` for values it does not define.
pub(crate) fn result_name(code: NcclResult) -> Option<&'static str> {
    Some(match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => return None,
    })
}

/// `ncclResult_t ncclGetVersion(int* version)`.
pub(crate) type GetVersionFn = unsafe extern "C" fn(version: *mut c_int) -> NcclResult;

/// `const char* ncclGetErrorString(ncclResult_t result)`.
pub(crate) type GetErrorStringFn = unsafe extern "C" fn(result: NcclResult) -> *const c_char;

/// `const char* ncclGetLastError(ncclComm_t comm)` (NCCL 2.13 and later; `comm` may be
/// null).
pub(crate) type GetLastErrorFn = unsafe extern "C" fn(comm: NcclComm) -> *const c_char;

/// `ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist)`.
pub(crate) type CommInitAllFn =
    unsafe extern "C" fn(comms: *mut NcclComm, ndev: c_int, devlist: *const c_int) -> NcclResult;

/// `ncclResult_t ncclCommDestroy(ncclComm_t comm)`.
pub(crate) type CommDestroyFn = unsafe extern "C" fn(comm: NcclComm) -> NcclResult;

/// `ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError)`.
pub(crate) type CommGetAsyncErrorFn =
    unsafe extern "C" fn(comm: NcclComm, async_error: *mut NcclResult) -> NcclResult;

/// `ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
/// ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)`; the
/// stream is the runtime's handle (`hipStream_t` for RCCL).
pub(crate) type AllReduceFn = unsafe extern "C" fn(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: NcclDataType,
    op: NcclRedOp,
    comm: NcclComm,
    stream: *mut c_void,
) -> NcclResult;

/// `ncclResult_t ncclGroupStart(void)` and `ncclGroupEnd(void)`.
pub(crate) type GroupFn = unsafe extern "C" fn() -> NcclResult;

/// The entry points of a loaded library. Each pointer stays valid while the [`Library`]
/// it was resolved from is open.
#[derive(Clone, Copy)]
pub(crate) struct Functions {
    pub(crate) get_version: GetVersionFn,
    pub(crate) get_error_string: GetErrorStringFn,
    pub(crate) get_last_error: Option<GetLastErrorFn>,
    pub(crate) comm_init_all: CommInitAllFn,
    pub(crate) comm_destroy: CommDestroyFn,
    pub(crate) comm_get_async_error: CommGetAsyncErrorFn,
    pub(crate) all_reduce: AllReduceFn,
    pub(crate) group_start: GroupFn,
    pub(crate) group_end: GroupFn,
}

/// Looks up one symbol and gives it the function pointer type `F`.
///
/// # Safety
/// `F` is an `unsafe extern "C" fn` type matching the C declaration of `name` in the
/// library.
unsafe fn symbol<F: Copy>(library: &Library, name: &'static str) -> Result<F, String> {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>()) };
    let address = library.symbol(name)?;
    // SAFETY: `address` is the non-null address of `name` in the library, and `F` is a
    // function pointer type (pointer-sized, checked above) of that function's C signature
    // by this function's contract.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
}

impl Functions {
    /// Resolves every entry point, or says which one the library lacks (with the loader's
    /// text). `ncclGetLastError` is optional: libraries older than NCCL 2.13 lack it.
    pub(crate) fn resolve(library: &Library) -> Result<Functions, String> {
        // SAFETY: each type below is the function pointer type declared above for that
        // symbol, from `nccl.h`'s prototype.
        unsafe {
            Ok(Functions {
                get_version: symbol::<GetVersionFn>(library, "ncclGetVersion")?,
                get_error_string: symbol::<GetErrorStringFn>(library, "ncclGetErrorString")?,
                get_last_error: symbol::<GetLastErrorFn>(library, "ncclGetLastError").ok(),
                comm_init_all: symbol::<CommInitAllFn>(library, "ncclCommInitAll")?,
                comm_destroy: symbol::<CommDestroyFn>(library, "ncclCommDestroy")?,
                comm_get_async_error: symbol::<CommGetAsyncErrorFn>(
                    library,
                    "ncclCommGetAsyncError",
                )?,
                all_reduce: symbol::<AllReduceFn>(library, "ncclAllReduce")?,
                group_start: symbol::<GroupFn>(library, "ncclGroupStart")?,
                group_end: symbol::<GroupFn>(library, "ncclGroupEnd")?,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_follow_the_header() {
        assert_eq!(result_name(NCCL_SUCCESS), Some("ncclSuccess"));
        assert_eq!(result_name(4), Some("ncclInvalidArgument"));
        assert_eq!(result_name(8), Some("ncclTimeout"));
        assert_eq!(result_name(9), None);
        assert_eq!(result_name(-1), None);
    }
}
