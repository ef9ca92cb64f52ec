//! Bytes of the mapped model file registered with the runtime (page-locked), so that
//! the copy engine reads them at the link's full rate: the host layers' rows
//! ([`super::host_rows`]) and the experts a pool misses ([`super::expert_pool`]).

use std::sync::atomic::{AtomicBool, Ordering};

use hip_backend::{Device, DeviceViewMut, HipError, HostRegistration, Stream};
use tensor_store::TensorHandle;

use crate::ModelError;

/// The mapped pages around some tensors, registered with a device's runtime in pieces
/// of `piece` bytes (the last one shorter).
pub(super) struct Registered {
    // Dropped first: unregistered before the handles below let the mapping go.
    pieces: Vec<HostRegistration<'static>>,
    piece: usize,
    /// The file offset of the first piece's first byte.
    base: u64,
    /// The device's address of the first piece's first byte, where the device reads the
    /// pieces as one run (each piece's address the first's plus its offset).
    device: Option<u64>,
    /// The tensors in the span, which keep the file mapped.
    _tensors: Vec<TensorHandle>,
}

/// How a span is registered: in pieces of `bytes` (a multiple of the page), with
/// `pause` between two pieces. The runtime holds its lock while it pins a piece, and
/// the other threads' calls (an upload's copies, a pass's launches) wait for it:
/// pinning 18 GB at once stalled a model's upload and first token by half a second.
#[derive(Clone, Copy, Debug)]
pub(super) struct Pieces {
    pub bytes: usize,
    pub pause: std::time::Duration,
}

impl Pieces {
    /// The whole span in one registration.
    pub const WHOLE: Pieces = Pieces {
        bytes: usize::MAX,
        pause: std::time::Duration::ZERO,
    };
}

impl Registered {
    /// Registers the pages of the mapping that hold `tensors` with `device`, in
    /// `pieces`; `Ok(None)` when they are not all mapped from one file in one mapping,
    /// or when the runtime refuses a piece (both logged as `what` staying on the CPU),
    /// or once `stop` is set before a piece (the pieces registered so far undone).
    pub fn new(
        device: &Device,
        tensors: Vec<TensorHandle>,
        what: &str,
        pieces: Pieces,
        stop: Option<&AtomicBool>,
    ) -> Result<Option<Registered>, ModelError> {
        const PAGE: usize = 4096;
        let Some(span) = mapped_span(&tensors)? else {
            tracing::info!("{what} on the CPU: the weights are not mapped from one file");
            return Ok(None);
        };
        if span.len == 0 {
            return Ok(None);
        }
        let piece = pieces.bytes.max(PAGE) / PAGE * PAGE;
        let mut registered = Vec::with_capacity(span.len.div_ceil(piece));
        let mut at = 0;
        while at < span.len {
            if at > 0 && !pieces.pause.is_zero() {
                std::thread::sleep(pieces.pause);
            }
            if stop.is_some_and(|stop| stop.load(Ordering::Relaxed)) {
                return Ok(None);
            }
            let len = piece.min(span.len - at);
            // SAFETY: `span` lies within the file's mapping, which the handles kept in
            // `_tensors` hold open (read-only, never moved) for as long as the
            // registrations, a field dropped before them.
            let bytes: &'static [u8] = unsafe { std::slice::from_raw_parts(span.ptr.add(at), len) };
            match device.register_host_read_only(bytes) {
                Ok(registration) => registered.push(registration),
                Err(error) => {
                    tracing::info!(%error, "{what} on the CPU: the mapping cannot be registered");
                    return Ok(None);
                }
            }
            at += len;
        }
        let device = device_run(&registered, piece);
        if device.is_none() {
            tracing::info!("{what}: the device does not read the registered pieces as one run");
        }
        Ok(Some(Registered {
            pieces: registered,
            piece,
            base: span.file_offset,
            device,
            _tensors: tensors,
        }))
    }

    /// The device's addresses of the registered bytes, where it reads them as one run.
    pub fn device_range(&self) -> Option<std::ops::Range<u64>> {
        self.device.map(|at| at..at + self.len() as u64)
    }

    /// The address at which the device reads byte `from` of `tensor`'s data (one of the
    /// tensors registered), for as long as `self` lives; `None` where the device does
    /// not read the registered pieces as one run, or the byte is outside them.
    pub fn device_address(&self, tensor: &TensorHandle, from: u64) -> Option<u64> {
        let offset = tensor.file_range().start.checked_sub(self.base)? + from;
        (offset < self.len() as u64).then_some(self.device? + offset)
    }

    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(|p| p.len()).sum()
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
        // A tensor outside the span gives a range the last piece's copy refuses.
        let mut at = (tensor.file_range().start.checked_sub(self.base))
            .map_or(usize::MAX, |offset| offset as usize)
            .saturating_add(from);
        let mut dst = dst;
        // A copy across pieces is one copy a piece.
        loop {
            let index = (at / self.piece).min(self.pieces.len() - 1);
            let within = at - index * self.piece;
            let n = dst
                .len()
                .min(self.pieces[index].len().saturating_sub(within));
            let (head, tail) = if n == 0 || n == dst.len() {
                (dst, None)
            } else {
                let (head, tail) = dst.split_at_mut(n)?;
                (head, Some(tail))
            };
            let len = head.len();
            // SAFETY: the caller keeps the registrations alive until the copy has run;
            // the range is checked against the piece by the copy itself.
            unsafe {
                stream.copy_registered_h2d_async(
                    &self.pieces[index],
                    within..within.saturating_add(len),
                    head,
                )
            }?;
            match tail {
                Some(tail) => {
                    at += len;
                    dst = tail;
                }
                None => return Ok(()),
            }
        }
    }
}

/// The device's address of the first of `pieces` (each `piece` bytes but the last),
/// where each piece's is the first's plus its offset: the device then reads the span as
/// one run, and a matrix across two pieces as one.
fn device_run(pieces: &[HostRegistration<'static>], piece: usize) -> Option<u64> {
    let first = pieces.first()?.device_ptr().ok()?;
    let mut at = first;
    for p in pieces {
        if p.device_ptr().ok()? != at {
            return None;
        }
        at += piece as u64;
    }
    Some(first)
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
