//! Layer 1: raw declarations of the runtime shim (`csrc/rfhip_runtime.hip`), nothing else.
//!
//! The shim exports the same `rfhip_*` C functions whether it was built by hipcc (AMD) or
//! by nvcc (NVIDIA), so this file has one set of declarations. Each function returns the
//! platform's native status code, 0 on success; [`rfhip_status_kind`] sorts a code into the
//! portable `KIND_*` values below. Built for platform `none`, the same names are Rust
//! functions that do nothing and return [`STATUS_BUILT_WITHOUT_GPU`], so every layer above
//! compiles unchanged and reports [`crate::HipError::BuiltWithoutGpu`].
//!
//! The contracts (valid pointers, live handles) are those of the HIP runtime functions the
//! shim forwards to; `result.rs` states them where it calls these.

use std::ffi::{c_char, c_int, c_void};

/// Portable status kinds (success is 0); must match the `RFHIP_KIND_*` enum in the shim.
pub const KIND_NOT_READY: c_int = 1;
pub const KIND_NO_DEVICE: c_int = 2;
pub const KIND_NO_DRIVER: c_int = 3;
pub const KIND_OUT_OF_MEMORY: c_int = 4;

/// The status every stub returns when the crate is built without a GPU platform. No
/// runtime uses this value.
#[cfg_attr(not(hip_platform = "none"), allow(dead_code))]
pub const STATUS_BUILT_WITHOUT_GPU: c_int = c_int::MIN;

/// Device properties as the shim fills them; must match `rfhip_device_props_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RfhipDeviceProps {
    pub name: [c_char; 256],
    pub arch: [c_char; 64],
    pub total_memory: usize,
    pub multiprocessor_count: c_int,
    pub warp_size: c_int,
    pub major: c_int,
    pub minor: c_int,
    pub pci_domain: c_int,
    pub pci_bus: c_int,
    pub pci_device: c_int,
}

impl RfhipDeviceProps {
    pub const fn zeroed() -> Self {
        RfhipDeviceProps {
            name: [0; 256],
            arch: [0; 64],
            total_memory: 0,
            multiprocessor_count: 0,
            warp_size: 0,
            major: 0,
            minor: 0,
            pci_domain: 0,
            pci_bus: 0,
            pci_device: 0,
        }
    }
}

#[cfg(not(hip_platform = "none"))]
pub use linked::*;

#[cfg(not(hip_platform = "none"))]
mod linked {
    use super::RfhipDeviceProps;
    use std::ffi::{c_char, c_int, c_void};

    unsafe extern "C" {
        pub fn rfhip_platform_name() -> *const c_char;
        pub fn rfhip_status_kind(code: c_int) -> c_int;
        pub fn rfhip_error_name(code: c_int) -> *const c_char;
        pub fn rfhip_error_string(code: c_int) -> *const c_char;

        pub fn rfhip_runtime_version(version: *mut c_int) -> c_int;
        pub fn rfhip_driver_version(version: *mut c_int) -> c_int;
        pub fn rfhip_device_count(count: *mut c_int) -> c_int;
        pub fn rfhip_set_device(ordinal: c_int) -> c_int;
        pub fn rfhip_device_synchronize() -> c_int;
        pub fn rfhip_mem_get_info(free_bytes: *mut usize, total_bytes: *mut usize) -> c_int;
        pub fn rfhip_device_props(ordinal: c_int, out: *mut RfhipDeviceProps) -> c_int;

        pub fn rfhip_malloc(ptr: *mut *mut c_void, bytes: usize) -> c_int;
        pub fn rfhip_free(ptr: *mut c_void) -> c_int;
        pub fn rfhip_host_alloc(ptr: *mut *mut c_void, bytes: usize) -> c_int;
        pub fn rfhip_host_free(ptr: *mut c_void) -> c_int;
        pub fn rfhip_host_register(ptr: *mut c_void, bytes: usize) -> c_int;
        pub fn rfhip_host_register_read_only(ptr: *mut c_void, bytes: usize) -> c_int;
        pub fn rfhip_host_unregister(ptr: *mut c_void) -> c_int;
        pub fn rfhip_host_device_pointer(device: *mut *mut c_void, host: *mut c_void) -> c_int;

        pub fn rfhip_memcpy_h2d_async(
            dst: *mut c_void,
            src: *const c_void,
            bytes: usize,
            stream: *mut c_void,
        ) -> c_int;
        pub fn rfhip_memcpy_d2h_async(
            dst: *mut c_void,
            src: *const c_void,
            bytes: usize,
            stream: *mut c_void,
        ) -> c_int;
        pub fn rfhip_memcpy_d2d_async(
            dst: *mut c_void,
            src: *const c_void,
            bytes: usize,
            stream: *mut c_void,
        ) -> c_int;
        pub fn rfhip_memcpy_peer_async(
            dst: *mut c_void,
            dst_device: c_int,
            src: *const c_void,
            src_device: c_int,
            bytes: usize,
            stream: *mut c_void,
        ) -> c_int;
        pub fn rfhip_device_can_access_peer(can: *mut c_int, device: c_int, peer: c_int) -> c_int;
        pub fn rfhip_device_enable_peer_access(peer: c_int) -> c_int;
        pub fn rfhip_memset_async(
            dst: *mut c_void,
            byte_value: c_int,
            bytes: usize,
            stream: *mut c_void,
        ) -> c_int;

        pub fn rfhip_stream_create(stream: *mut *mut c_void) -> c_int;
        pub fn rfhip_stream_destroy(stream: *mut c_void) -> c_int;
        pub fn rfhip_stream_synchronize(stream: *mut c_void) -> c_int;
        pub fn rfhip_stream_query(stream: *mut c_void) -> c_int;
        pub fn rfhip_stream_wait_event(stream: *mut c_void, event: *mut c_void) -> c_int;

        pub fn rfhip_event_create(event: *mut *mut c_void, enable_timing: c_int) -> c_int;
        pub fn rfhip_event_destroy(event: *mut c_void) -> c_int;
        pub fn rfhip_event_record(event: *mut c_void, stream: *mut c_void) -> c_int;
        pub fn rfhip_event_synchronize(event: *mut c_void) -> c_int;
        pub fn rfhip_event_query(event: *mut c_void) -> c_int;
        pub fn rfhip_event_elapsed_ms(
            milliseconds: *mut f32,
            start: *mut c_void,
            end: *mut c_void,
        ) -> c_int;

        pub fn rfhip_stream_begin_capture(stream: *mut c_void) -> c_int;
        pub fn rfhip_stream_end_capture(stream: *mut c_void, exec: *mut *mut c_void) -> c_int;
        pub fn rfhip_graph_launch(exec: *mut c_void, stream: *mut c_void) -> c_int;
        pub fn rfhip_graph_destroy(exec: *mut c_void) -> c_int;

        pub fn rfhip_set_chained_launch(allowed: c_int);
        pub fn rfhip_chained_launch_allowed() -> c_int;
    }
}

#[cfg(hip_platform = "none")]
pub use stub::*;

/// Stand-ins with the declarations' signatures: each touches nothing and returns
/// [`STATUS_BUILT_WITHOUT_GPU`]. They are `unsafe fn` only so that call sites are the same
/// as on a GPU build; calling them is always sound.
#[cfg(hip_platform = "none")]
#[allow(clippy::missing_safety_doc)]
mod stub {
    use super::{RfhipDeviceProps, STATUS_BUILT_WITHOUT_GPU as NO_GPU};
    use std::ffi::{c_char, c_int, c_void};

    const NAME: &std::ffi::CStr = c"builtWithoutGpu";

    pub unsafe fn rfhip_platform_name() -> *const c_char {
        c"none".as_ptr()
    }
    pub unsafe fn rfhip_status_kind(_: c_int) -> c_int {
        super::KIND_NO_DEVICE
    }
    pub unsafe fn rfhip_error_name(_: c_int) -> *const c_char {
        NAME.as_ptr()
    }
    pub unsafe fn rfhip_error_string(_: c_int) -> *const c_char {
        NAME.as_ptr()
    }
    pub unsafe fn rfhip_runtime_version(_: *mut c_int) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_driver_version(_: *mut c_int) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_device_count(_: *mut c_int) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_set_device(_: c_int) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_device_synchronize() -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_mem_get_info(_: *mut usize, _: *mut usize) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_device_props(_: c_int, _: *mut RfhipDeviceProps) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_malloc(_: *mut *mut c_void, _: usize) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_free(_: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_host_alloc(_: *mut *mut c_void, _: usize) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_host_free(_: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_host_register(_: *mut c_void, _: usize) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_host_register_read_only(_: *mut c_void, _: usize) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_host_unregister(_: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_host_device_pointer(_: *mut *mut c_void, _: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_memcpy_h2d_async(
        _: *mut c_void,
        _: *const c_void,
        _: usize,
        _: *mut c_void,
    ) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_memcpy_d2h_async(
        _: *mut c_void,
        _: *const c_void,
        _: usize,
        _: *mut c_void,
    ) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_memcpy_d2d_async(
        _: *mut c_void,
        _: *const c_void,
        _: usize,
        _: *mut c_void,
    ) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_memcpy_peer_async(
        _: *mut c_void,
        _: c_int,
        _: *const c_void,
        _: c_int,
        _: usize,
        _: *mut c_void,
    ) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_device_can_access_peer(_: *mut c_int, _: c_int, _: c_int) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_device_enable_peer_access(_: c_int) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_memset_async(_: *mut c_void, _: c_int, _: usize, _: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_stream_create(_: *mut *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_stream_destroy(_: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_stream_synchronize(_: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_stream_query(_: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_stream_wait_event(_: *mut c_void, _: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_event_create(_: *mut *mut c_void, _: c_int) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_event_destroy(_: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_event_record(_: *mut c_void, _: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_event_synchronize(_: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_event_query(_: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_event_elapsed_ms(_: *mut f32, _: *mut c_void, _: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_stream_begin_capture(_: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_stream_end_capture(_: *mut c_void, _: *mut *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_graph_launch(_: *mut c_void, _: *mut c_void) -> c_int {
        NO_GPU
    }
    pub unsafe fn rfhip_graph_destroy(_: *mut c_void) -> c_int {
        NO_GPU
    }

    /// Kept only so that the setting reads back as it was set, as with a shim.
    static CHAINED_LAUNCH_ALLOWED: std::sync::atomic::AtomicI32 =
        std::sync::atomic::AtomicI32::new(1);

    pub unsafe fn rfhip_set_chained_launch(allowed: c_int) {
        CHAINED_LAUNCH_ALLOWED.store(
            c_int::from(allowed != 0),
            std::sync::atomic::Ordering::Relaxed,
        );
    }
    pub unsafe fn rfhip_chained_launch_allowed() -> c_int {
        CHAINED_LAUNCH_ALLOWED.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Opaque stream and event handles as the shim passes them.
pub type RawStream = *mut c_void;
pub type RawEvent = *mut c_void;
/// Opaque executable-graph handle.
pub type RawGraph = *mut c_void;
