//! Uploads of a rectangular part of a tensor, for tensor-parallel runs: each device gets
//! some rows of a weight matrix (attention heads, feed-forward rows) or, in every row, a
//! range of its columns (the inputs of the output and down projections).
//!
//! A part is uploaded on its own, outside the [`super::DeviceCache`]: the caller owns the
//! returned [`DeviceTensor`], which no cache counts against its budget or evicts.
//!
//! The part's bytes are gathered from the file (from the mapping, or with positioned
//! reads when the store is not mapped; never through a host copy of the whole tensor)
//! into at most two page-locked staging buffers of at most [`PART_STAGING_BYTES`] each,
//! filled in turn so that the copy of one overlaps the gathering of the next. A part of
//! whole rows is one contiguous run of the file and fills each buffer completely; any
//! other part fills each buffer with as many whole rows of the part as fit, or, when a
//! row of the part is larger than a buffer, with pieces of one row.

use std::ops::Range;

use super::cache::DeviceTensor;
use super::target::DeviceTarget;
use crate::{StoreError, TensorHandle};

/// The largest staging buffer an upload of a part uses; it uses two at most.
pub const PART_STAGING_BYTES: usize = 16 << 20;

/// A rectangular part of a tensor seen as rows of its first dimension (ne0): the rows
/// `rows` (of ne1·ne2·…, the product of the other dimensions; a 1-D tensor is one row),
/// and in each of them the bytes `bytes` (which must cover whole blocks of the tensor's
/// type).
///
/// On the device the part is its rows one after another, each of them `bytes` of that
/// row: `rows.len() * bytes.len()` bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorPart {
    pub rows: Range<u64>,
    pub bytes: Range<u64>,
}

impl TensorPart {
    /// The part of `handle` that is its rows `rows` and, in each, the elements (columns)
    /// `cols`. Fails with [`StoreError::BadPart`], naming the tensor and the offending
    /// range, when a range is empty or not within the tensor, or when the columns do not
    /// start and end on block boundaries of the tensor's type.
    pub fn of(
        handle: &TensorHandle,
        rows: Range<u64>,
        cols: Range<u64>,
    ) -> Result<TensorPart, StoreError> {
        let shape = RowShape::of(handle)?;
        let bad = |reason: String| bad_part(handle, reason);
        shape.check_rows(handle, &rows)?;
        if cols.start >= cols.end || cols.end > shape.ne0 {
            return Err(bad(format!(
                "columns {}..{} are not a non-empty range within its {} columns",
                cols.start, cols.end, shape.ne0
            )));
        }
        let block = shape.block;
        if !cols.start.is_multiple_of(block) || !cols.end.is_multiple_of(block) {
            return Err(bad(format!(
                "columns {}..{} do not start and end on blocks of {block} elements ({})",
                cols.start,
                cols.end,
                handle.ggml_type().name()
            )));
        }
        // Within ne0 and on block boundaries: no overflow (the row's size fits in u64).
        let bytes = cols.start / block * shape.type_size..cols.end / block * shape.type_size;
        Ok(TensorPart { rows, bytes })
    }

    /// Bytes of the part (saturating, for a part too large to be any tensor's).
    pub fn len(&self) -> u64 {
        span(&self.rows).saturating_mul(span(&self.bytes))
    }

    /// True when the part holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Gathers `part` of `handle` (from the mapping, or with positioned reads when the store
/// is not mapped: never keeping a copy of the whole tensor on the host) into page-locked
/// staging and copies it to `target`, returning the device copy once the copies have
/// finished. A part that is the whole tensor is allowed.
///
/// The result is the caller's: no [`super::DeviceCache`] counts it or evicts it. A part
/// that is not one of `handle` fails with [`StoreError::BadPart`]; a failed allocation
/// on `target` is returned as `target` reported it.
pub fn upload_part<T: DeviceTarget>(
    target: &T,
    handle: &TensorHandle,
    part: &TensorPart,
) -> Result<DeviceTensor<T>, StoreError> {
    upload_part_with(target, handle, part, PART_STAGING_BYTES)
}

/// Page-locked staging kept from one [`upload_part_in`] to the next: two buffers of
/// [`PART_STAGING_BYTES`], allocated on the first upload. Page-locked memory is slow to
/// allocate, so a caller uploading many parts (every layer's, on every device of a split
/// by tensors) keeps one of these a thread.
pub struct PartStaging<T: DeviceTarget> {
    ring: Vec<T::Staging>,
}

impl<T: DeviceTarget> Default for PartStaging<T> {
    fn default() -> Self {
        PartStaging { ring: Vec::new() }
    }
}

/// [`upload_part`] through `staging`, allocated on its first use and kept.
pub fn upload_part_in<T: DeviceTarget>(
    target: &T,
    handle: &TensorHandle,
    part: &TensorPart,
    staging: &mut PartStaging<T>,
) -> Result<DeviceTensor<T>, StoreError> {
    let shape = RowShape::of(handle)?;
    shape.check_part(handle, part)?;
    let plan = Plan::new(&shape, part, PART_STAGING_BYTES);
    if staging.ring.is_empty() {
        staging.ring = target.alloc_staging_ring(2, PART_STAGING_BYTES)?;
    }
    let ring = &mut staging.ring[..plan.buffers];
    upload_planned(target, handle, part, &plan, ring)
}

/// [`upload_part`] with staging buffers of at most `staging_limit` bytes (at least 1).
pub(crate) fn upload_part_with<T: DeviceTarget>(
    target: &T,
    handle: &TensorHandle,
    part: &TensorPart,
    staging_limit: usize,
) -> Result<DeviceTensor<T>, StoreError> {
    let shape = RowShape::of(handle)?;
    shape.check_part(handle, part)?;
    let plan = Plan::new(&shape, part, staging_limit.max(1));
    let mut staging = target.alloc_staging_ring(plan.buffers, plan.buffer_bytes)?;
    upload_planned(target, handle, part, &plan, &mut staging)
}

/// Uploads `part` of `handle` as `plan` says, through `staging` (buffers of at least
/// `plan.buffer_bytes`).
fn upload_planned<T: DeviceTarget>(
    target: &T,
    handle: &TensorHandle,
    part: &TensorPart,
    plan: &Plan,
    staging: &mut [T::Staging],
) -> Result<DeviceTensor<T>, StoreError> {
    let _span = tracing::debug_span!(
        "upload_part",
        tensor = handle.name(),
        rows = ?part.rows,
        bytes = ?part.bytes,
    )
    .entered();
    let mut buffer = target.alloc(plan.total)?;
    let mut queued = false;
    let copied = copy_part(target, handle, plan, staging, &mut buffer, &mut queued)
        .and_then(|()| wait_for_copies(target));
    if let Err(error) = copied {
        if queued {
            // No copy into `buffer` or out of `staging` may still run once they are
            // dropped: wait for the whole copy stream.
            tracing::warn!(%error, "uploading a part failed; waiting for the copy stream");
            if let Err(error) = target.synchronize() {
                tracing::error!(%error, "copy stream failed too");
            }
        }
        return Err(error);
    }
    Ok(DeviceTensor::new_part(handle.clone(), buffer, part.clone()))
}

/// Bytes in `range`, 0 when it is reversed.
fn span(range: &Range<u64>) -> u64 {
    range.end.saturating_sub(range.start)
}

fn bad_part(handle: &TensorHandle, reason: String) -> StoreError {
    StoreError::BadPart {
        tensor: handle.name().to_owned(),
        reason,
    }
}

/// A tensor seen as rows of its first dimension.
struct RowShape {
    /// Elements in a row.
    ne0: u64,
    /// Bytes of a row.
    row_bytes: u64,
    /// Number of rows: the product of the other dimensions.
    rows: u64,
    /// Elements and bytes per block of the tensor's type.
    block: u64,
    type_size: u64,
}

impl RowShape {
    fn of(handle: &TensorHandle) -> Result<RowShape, StoreError> {
        let ty = handle.ggml_type();
        let shape = handle.shape();
        let ne0 = shape.first().copied().unwrap_or(1);
        let rows = shape
            .iter()
            .skip(1)
            .try_fold(1u64, |rows, &dim| rows.checked_mul(dim));
        let row_bytes = ty.row_bytes(ne0);
        match (rows, row_bytes) {
            (Some(rows), Some(row_bytes)) if rows.checked_mul(row_bytes) == Some(handle.size()) => {
                Ok(RowShape {
                    ne0,
                    row_bytes,
                    rows,
                    block: ty.block_size(),
                    type_size: ty.type_size(),
                })
            }
            _ => Err(bad_part(
                handle,
                format!(
                    "its shape {shape:?} of {} is not rows of whole blocks making its {} bytes",
                    ty.name(),
                    handle.size()
                ),
            )),
        }
    }

    fn check_rows(&self, handle: &TensorHandle, rows: &Range<u64>) -> Result<(), StoreError> {
        if rows.start >= rows.end || rows.end > self.rows {
            return Err(bad_part(
                handle,
                format!(
                    "rows {}..{} are not a non-empty range within its {} rows",
                    rows.start, rows.end, self.rows
                ),
            ));
        }
        Ok(())
    }

    /// Checks a part built by hand as [`TensorPart::of`] checks the one it builds.
    fn check_part(&self, handle: &TensorHandle, part: &TensorPart) -> Result<(), StoreError> {
        self.check_rows(handle, &part.rows)?;
        let bytes = &part.bytes;
        if bytes.start >= bytes.end || bytes.end > self.row_bytes {
            return Err(bad_part(
                handle,
                format!(
                    "bytes {}..{} are not a non-empty range within its rows of {} bytes",
                    bytes.start, bytes.end, self.row_bytes
                ),
            ));
        }
        let size = self.type_size;
        if !bytes.start.is_multiple_of(size) || !bytes.end.is_multiple_of(size) {
            return Err(bad_part(
                handle,
                format!(
                    "bytes {}..{} of each row are not whole blocks of {size} bytes ({})",
                    bytes.start,
                    bytes.end,
                    handle.ggml_type().name()
                ),
            ));
        }
        Ok(())
    }
}

/// How a checked part is gathered: `runs` runs of `run` bytes, the i-th `first + i *
/// stride` bytes into the tensor, into staging buffers in turn.
struct Plan {
    first: u64,
    stride: u64,
    run: u64,
    runs: u64,
    /// Bytes of the part: of every run.
    total: u64,
    /// Whole runs per staging buffer; 0 when a run is larger than one buffer, which then
    /// holds pieces of a run.
    runs_per_buffer: u64,
    buffer_bytes: usize,
    /// Staging buffers: 1 when one fill holds the whole part, else 2.
    buffers: usize,
}

impl Plan {
    /// The plan for `part`, checked against `shape` (every offset and size below then
    /// lies within the tensor's size), with buffers of at most `limit` (≥ 1) bytes.
    fn new(shape: &RowShape, part: &TensorPart, limit: usize) -> Plan {
        let rows = span(&part.rows);
        let row_part = span(&part.bytes);
        let total = rows * row_part;
        let first = part.rows.start * shape.row_bytes + part.bytes.start;
        // Whole rows, or a part of one row, are one contiguous run.
        let (run, runs) = if row_part == shape.row_bytes || rows == 1 {
            (total, 1)
        } else {
            (row_part, rows)
        };
        let limit = limit as u64;
        let (runs_per_buffer, buffer_bytes, fills) = if run <= limit {
            let per_buffer = (limit / run).min(runs);
            (per_buffer, per_buffer * run, runs.div_ceil(per_buffer))
        } else {
            (0, limit, runs.saturating_mul(run.div_ceil(limit)))
        };
        Plan {
            first,
            stride: shape.row_bytes,
            run,
            runs,
            total,
            runs_per_buffer,
            // At most `limit`, itself a usize.
            buffer_bytes: buffer_bytes as usize,
            buffers: if fills > 1 { 2 } else { 1 },
        }
    }
}

/// Gathers the part into the staging buffers in turn and queues their copies into
/// `buffer`; sets `queued` once a copy is queued.
fn copy_part<T: DeviceTarget>(
    target: &T,
    handle: &TensorHandle,
    plan: &Plan,
    staging: &mut [T::Staging],
    buffer: &mut T::Buffer,
    queued: &mut bool,
) -> Result<(), StoreError> {
    let (mut run, mut within, mut dst_offset) = (0u64, 0u64, 0u64);
    let mut fill = 0usize;
    while run < plan.runs {
        let count = staging.len();
        let Some(staging) = staging.get_mut(fill % count.max(1)) else {
            return Err(StoreError::DeviceAlloc {
                requested: plan.buffer_bytes as u64,
                reason: "the device returned no staging buffer".to_owned(),
            });
        };
        fill += 1;
        // Waits for the copies queued from this buffer before.
        let bytes = target.staging_bytes(staging)?;
        let used = if plan.runs_per_buffer > 0 {
            let count = plan.runs_per_buffer.min(plan.runs - run);
            let run_len = plan.run as usize;
            let dst = staging_window(bytes, count as usize * run_len)?;
            for (i, chunk) in (run..).zip(dst.chunks_exact_mut(run_len)) {
                handle.read_into(plan.first + i * plan.stride, chunk)?;
            }
            run += count;
            dst.len()
        } else {
            let len = (plan.run - within).min(plan.buffer_bytes as u64);
            let dst = staging_window(bytes, len as usize)?;
            handle.read_into(plan.first + run * plan.stride + within, dst)?;
            within += len;
            if within == plan.run {
                (run, within) = (run + 1, 0);
            }
            dst.len()
        };
        target.copy_to_device(staging, 0..used, buffer, dst_offset)?;
        *queued = true;
        dst_offset += used as u64;
    }
    Ok(())
}

/// The first `len` bytes of a staging buffer, which holds at least the bytes it was
/// allocated with.
fn staging_window(bytes: &mut [u8], len: usize) -> Result<&mut [u8], StoreError> {
    let size = bytes.len() as u64;
    bytes
        .get_mut(..len)
        .ok_or_else(|| StoreError::ReadOutOfRange {
            tensor: "<staging buffer>".to_owned(),
            offset: 0,
            len: len as u64,
            size,
        })
}

/// Waits on a fence after every copy queued so far on `target` (not on copies others
/// queue later, as waiting for the whole copy stream would). When it fails, the caller
/// waits for the whole stream before dropping the buffers.
fn wait_for_copies<T: DeviceTarget>(target: &T) -> Result<(), StoreError> {
    target
        .record_fence()
        .and_then(|fence| target.wait_fence(&fence))
}

#[cfg(test)]
mod tests;
