//! Bytes of the mapped model file registered with the runtime (page-locked), so that
//! the copy engine reads them at the link's full rate: the host layers' rows
//! ([`super::host_rows`]) and the experts a pool misses ([`super::expert_pool`]).

use hip_backend::{Device, DeviceViewMut, HipError, HostRegistration, Stream};
use tensor_store::TensorHandle;

use crate::ModelError;

/// The mapped pages around some tensors, registered with a device's runtime.
pub(super) struct Registered {
    // Dropped first: unregistered before the handles below let the mapping go.
    registration: HostRegistration<'static>,
    /// The file offset of the registration's first byte.
    base: u64,
    /// The tensors in the span, which keep the file mapped.
    _tensors: Vec<TensorHandle>,
}

impl Registered {
    /// Registers the pages of the mapping that hold `tensors` with `device`; `Ok(None)`
    /// when they are not all mapped from one file in one mapping, or when the runtime
    /// refuses the registration (both logged as `what` staying on the CPU).
    pub fn new(
        device: &Device,
        tensors: Vec<TensorHandle>,
        what: &str,
    ) -> Result<Option<Registered>, ModelError> {
        let Some(span) = mapped_span(&tensors)? else {
            tracing::info!("{what} on the CPU: the weights are not mapped from one file");
            return Ok(None);
        };
        // SAFETY: `span` lies within the file's mapping, which the handles kept in
        // `_tensors` hold open (read-only, never moved) for as long as the registration,
        // a field dropped before them.
        let bytes: &'static [u8] = unsafe { std::slice::from_raw_parts(span.ptr, span.len) };
        match device.register_host_read_only(bytes) {
            Ok(registration) => Ok(Some(Registered {
                registration,
                base: span.file_offset,
                _tensors: tensors,
            })),
            Err(error) => {
                tracing::info!(%error, "{what} on the CPU: the mapping cannot be registered");
                Ok(None)
            }
        }
    }

    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.registration.len()
    }

    /// Queues on `stream` a copy of `dst.len()` bytes of `tensor` (one of the tensors
    /// registered) from byte `from` of its data into `dst`.
    ///
    /// # Safety
    /// The registration must outlive the copy: synchronize `stream`, or wait for work
    /// queued after the copy, before dropping `self`.
    pub unsafe fn copy(
        &self,
        stream: &Stream,
        tensor: &TensorHandle,
        from: usize,
        dst: DeviceViewMut<'_, u8>,
    ) -> Result<(), HipError> {
        // A tensor outside the span gives a range the copy refuses.
        let start = (tensor.file_range().start.checked_sub(self.base))
            .map_or(usize::MAX, |offset| offset as usize)
            .saturating_add(from);
        let range = start..start.saturating_add(dst.len());
        // SAFETY: the caller keeps the registration alive until the copy has run; the
        // range is checked against the registration by the copy itself.
        unsafe { stream.copy_registered_h2d_async(&self.registration, range, dst) }
    }
}

/// A run of a file's mapped bytes: the pages around some tensors.
struct Span {
    ptr: *const u8,
    len: usize,
    file_offset: u64,
}

/// The whole pages of the mapping that hold `tensors`, if they are all mapped from one
/// file, in one mapping.
fn mapped_span(tensors: &[TensorHandle]) -> Result<Option<Span>, ModelError> {
    const PAGE: usize = 4096;
    let Some(first) = tensors.iter().min_by_key(|t| t.file_range().start) else {
        return Ok(None);
    };
    if tensors
        .iter()
        .any(|t| !t.is_mapped() || t.path() != first.path())
    {
        return Ok(None);
    }
    let first_ptr = first.bytes()?.as_ptr() as usize;
    let start = first_ptr - first_ptr % PAGE;
    let file_offset = first.file_range().start - (first_ptr - start) as u64;
    let mut end = start;
    for t in tensors {
        let bytes = t.bytes()?;
        // One mapping: each tensor where its file offset puts it.
        if bytes.as_ptr() as usize != start + (t.file_range().start - file_offset) as usize {
            return Ok(None);
        }
        end = end.max(bytes.as_ptr() as usize + bytes.len());
    }
    Ok(Some(Span {
        ptr: start as *const u8,
        len: end.next_multiple_of(PAGE) - start,
        file_offset,
    }))
}
