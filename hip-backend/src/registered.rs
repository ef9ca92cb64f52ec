//! Host memory registered with the runtime where it lies: its pages locked, so that the
//! copy engine copies from them directly ([`crate::Stream::copy_registered_h2d_async`],
//! about 55 GB/s on an H200's PCIe 5 link) rather than through a staging copy.

use crate::device::{Device, DeviceContext};
use crate::error::Result;
use crate::{result, sys};
use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

/// `len` bytes of host memory registered with the device's runtime until this is dropped.
///
/// It borrows the bytes for `'a`: they stay where they are, unchanged, while the device
/// may read them. Dropping it unregisters them; a failure there is recorded and returned
/// by [`Device::check_err`]. Kernels still queued that read them must have finished.
pub struct HostRegistration<'a> {
    context: Arc<DeviceContext>,
    host: *mut c_void,
    len: usize,
    _borrow: PhantomData<&'a [u8]>,
}

// SAFETY: the registration only holds addresses of bytes borrowed shared for 'a (`&[u8]`
// is Send and Sync); unregistering from another thread is allowed by the runtime.
unsafe impl Send for HostRegistration<'_> {}
// SAFETY: `&HostRegistration` only gives its address and length, for copies to read.
unsafe impl Sync for HostRegistration<'_> {}

impl std::fmt::Debug for HostRegistration<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistration")
            .field("device", &self.context.ordinal())
            .field("len", &self.len)
            .finish()
    }
}

impl Device {
    /// Registers `bytes` (host memory the process only reads, such as a read-only file
    /// mapping) for this device's copies. The runtime pins their pages (faulting them in
    /// first): on a cold file that reads them from the disk.
    pub fn register_host_read_only<'a>(&self, bytes: &'a [u8]) -> Result<HostRegistration<'a>> {
        let context = Arc::clone(self.context());
        context.bind()?;
        let host = bytes.as_ptr() as *mut c_void;
        if !bytes.is_empty() {
            // SAFETY: `host` and `bytes.len()` describe live memory borrowed for 'a; the
            // runtime only pins and maps it (the read-only flag on NVIDIA promises the
            // device will not write it, and nothing here writes it).
            result::check("hipHostRegister", unsafe {
                sys::rfhip_host_register_read_only(host, bytes.len())
            })?;
        }
        Ok(HostRegistration {
            context,
            host,
            len: bytes.len(),
            _borrow: PhantomData,
        })
    }
}

impl HostRegistration<'_> {
    /// The host address of the first registered byte.
    pub(crate) fn host_ptr(&self) -> *const u8 {
        self.host as *const u8
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The address at which kernels on the device read the first registered byte (the
    /// registration maps the pages for the device): loads from it cross the link, at
    /// about the copy engine's rate for reads of whole lines. On NVIDIA devices with
    /// unified addressing it is the host address itself.
    pub fn device_ptr(&self) -> Result<u64> {
        if self.len == 0 {
            return Ok(0);
        }
        self.context.bind()?;
        let mut device: *mut c_void = std::ptr::null_mut();
        // SAFETY: `host` is registered (mapped) for as long as `self`; the call only
        // writes the address into `device`.
        result::check("hipHostGetDevicePointer", unsafe {
            sys::rfhip_host_device_pointer(&mut device, self.host)
        })?;
        Ok(device as u64)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        let done = self.context.bind().and_then(|()| {
            // SAFETY: `host` was registered by `register_host_read_only` and is
            // unregistered once, here.
            result::check("hipHostUnregister", unsafe {
                sys::rfhip_host_unregister(self.host)
            })
        });
        if let Err(error) = done {
            self.context.defer(error);
        }
    }
}
