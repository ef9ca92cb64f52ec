//! Graphs: a stream's work recorded once and replayed with a single launch.
//!
//! A decode step is a few hundred small kernels; launched one by one, the host's launch
//! cost and the gaps between kernels take as long as the kernels themselves. Captured
//! into a [`Graph`], the whole step is one launch. What a captured kernel reads and
//! writes (its pointers and scalar arguments) is fixed at capture: work that changes
//! from one replay to the next must read its inputs from device memory.

use std::sync::Arc;

use crate::device::DeviceContext;
use crate::error::{HipError, Result};
use crate::result;
use crate::stream::Stream;
use crate::sys::RawGraph;

/// An executable graph, captured from a [`Stream`] with [`Stream::capture`].
pub struct Graph {
    context: Arc<DeviceContext>,
    raw: RawGraph,
}

// SAFETY: an executable graph handle may be launched from any host thread; the handle is
// only ever passed to runtime calls, never dereferenced.
unsafe impl Send for Graph {}
// SAFETY: as above; `launch` takes `&self` and is a thread-safe runtime call.
unsafe impl Sync for Graph {}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("device", &self.context.ordinal())
            .finish()
    }
}

impl Graph {
    pub fn device_ordinal(&self) -> usize {
        self.context.ordinal()
    }

    /// Queues one replay of the graph on `stream` (same device).
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        if stream.device_ordinal() != self.device_ordinal() {
            return Err(HipError::DeviceMismatch {
                what: "the graph",
                expected: stream.device_ordinal(),
                found: self.device_ordinal(),
            });
        }
        // SAFETY: both handles are live while `self` and `stream` are borrowed.
        unsafe { result::graph_launch(self.raw, stream.as_raw()) }
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: our own handle, destroyed only here; the runtime keeps what a queued
        // replay needs until it completes.
        if let Err(error) = unsafe { result::graph_destroy(self.raw) } {
            self.context.defer(error);
        }
    }
}

impl Stream {
    /// Records the work that `record` queues on this stream into a [`Graph`] instead of
    /// running it. Nothing runs until the graph is launched. If `record` fails, the
    /// capture is ended and its graph discarded, and the error is returned.
    pub fn capture<F, E>(&self, record: F) -> std::result::Result<Graph, E>
    where
        F: FnOnce(&Stream) -> std::result::Result<(), E>,
        E: From<HipError>,
    {
        self.context().bind()?;
        // SAFETY: `self.as_raw()` is live while `self` is borrowed.
        unsafe { result::stream_begin_capture(self.as_raw()) }?;
        let recorded = record(self);
        // SAFETY: the stream is live and capturing (begun just above).
        let ended = unsafe { result::stream_end_capture(self.as_raw()) };
        match (recorded, ended) {
            (Ok(()), Ok(raw)) => Ok(Graph {
                context: Arc::clone(self.context()),
                raw,
            }),
            (Err(error), Ok(raw)) => {
                if !raw.is_null() {
                    // SAFETY: a graph just instantiated, owned here and destroyed once.
                    let _ = unsafe { result::graph_destroy(raw) };
                }
                Err(error)
            }
            (Err(error), Err(_)) => Err(error),
            (Ok(()), Err(error)) => Err(error.into()),
        }
    }
}
