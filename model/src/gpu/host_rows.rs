//! The host layers' first rows on the device, fetched from the mapped file.
//!
//! Over budget, the layers a GPU model does not hold run on the host ([`super::host`]):
//! 16 cores multiply their weights at about 72 GB/s. The device sits idle meanwhile,
//! and its copy engine reads registered (page-locked) host memory at about 55 GB/s over
//! an H200's PCIe 5 link. So the mapped span of those layers' weights is registered
//! with the runtime once, read-only, and [`HostRows`] takes a fixed share of the rows
//! of each of their products ([`HostRows::share`]): per group of products (q/k/v,
//! the attention output, gate/up, down) it copies those rows into a staging buffer and
//! multiplies them with the decode products, while the CPU computes the other rows
//! ([`crate::cpu::RowOffload`]); the two finish at about the same time.
//!
//! (Reading the rows in place, with the decode products over mapped host memory, was
//! slower: their scattered reads got well under half the link's rate, and a 7B at a
//! quarter of its size on the device gained 8% at best.)
//!
//! The share is fixed for a run (the CPU's threads decide it, unless
//! `GpuTuning::host_rows_share` does), so the tokens do not depend on timing. Without
//! the registration (another platform, or memory the runtime refuses), the CPU computes
//! every row as before.

use dequant::gpu::matvec::{self, GpuActivations, GpuMatrix};
use gguf_format::GgmlType;
use hip_backend::{Device, DeviceBuffer, PinnedBuffer, Stream};
use tensor_store::TensorHandle;

use super::forward::product_error;
use super::mapped::{Pieces, Registered};
use super::{gpu, HOST_TOKENS};
use crate::cpu::RowOffload;
use crate::plan::{ExecutionPlan, LayerPlan, Linear};
use crate::ModelError;

/// The copy engine's rate from registered host memory and one CPU thread's rate of
/// multiplying quantized weights, in GB/s, as measured on an H200's host (16 cores:
/// about 72 GB/s of a 7B's Q4_K_M weights): the device takes
/// `LINK / (LINK + threads · PER_THREAD)` of the rows.
const LINK_GBPS: f64 = 55.0;
const PER_THREAD_GBPS: f64 = 4.5;

/// Rows come in multiples of this.
const ROW_STEP: usize = 32;

/// The registered span of the file and what a pass needs to multiply its rows on the
/// device.
pub(super) struct HostRows {
    registered: Registered,
    share: f64,
    /// One group of products' rows at a time.
    staging: DeviceBuffer<u8>,
    x: DeviceBuffer<f32>,
    q8: DeviceBuffer<u8>,
    y: DeviceBuffer<f32>,
    x_pinned: PinnedBuffer<f32>,
    y_pinned: PinnedBuffer<f32>,
}

impl HostRows {
    /// The device's share of the rows with `threads` CPU threads on the others (unless
    /// `GpuTuning::host_rows_share` gives one).
    pub fn share(threads: usize) -> f64 {
        LINK_GBPS / (LINK_GBPS + threads.max(1) as f64 * PER_THREAD_GBPS)
    }

    /// Registers the mapped bytes of `layers`' weights with `device`; `Ok(None)` when
    /// the share is 0, the weights are not mapped from one file, or the runtime refuses
    /// the registration (logged).
    pub fn new(
        device: &Device,
        plan: &ExecutionPlan,
        layers: std::ops::Range<usize>,
        share: f64,
    ) -> Result<Option<HostRows>, ModelError> {
        if share <= 0.0 || layers.is_empty() {
            return Ok(None);
        }
        let groups: Vec<Vec<&Linear>> = plan.layers[layers]
            .iter()
            .flat_map(product_groups)
            .collect();
        let lins: Vec<&Linear> = groups.iter().flatten().copied().collect();
        let tensors: Vec<TensorHandle> = lins.iter().map(|l| l.weight.clone()).collect();
        let Some(registered) = Registered::new(
            device,
            tensors,
            "host layers' rows all",
            Pieces::WHOLE,
            None,
        )?
        else {
            return Ok(None);
        };
        // The most any group of products needs at once.
        let largest = |size: &dyn Fn(&Linear) -> usize| {
            let group = |g: &Vec<&Linear>| g.iter().map(|&l| size(l)).sum::<usize>();
            groups.iter().map(group).max().unwrap_or(0)
        };
        let staging = largest(&|l| device_rows(l, share) * row_bytes(l));
        let rows = largest(&|l| l.rows);
        let cols = lins.iter().map(|l| l.cols).max().unwrap_or(0);
        let alloc = gpu("buffers of the host layers' rows");
        Ok(Some(HostRows {
            registered,
            share,
            staging: device.alloc::<u8>(staging).map_err(&alloc)?,
            x: device.alloc::<f32>(HOST_TOKENS * cols).map_err(&alloc)?,
            q8: device
                .alloc::<u8>(matvec::q8_bytes(HOST_TOKENS, cols))
                .map_err(&alloc)?,
            y: device.alloc::<f32>(HOST_TOKENS * rows).map_err(&alloc)?,
            x_pinned: device
                .alloc_pinned::<f32>(HOST_TOKENS * cols)
                .map_err(&alloc)?,
            y_pinned: device
                .alloc_pinned::<f32>(HOST_TOKENS * rows)
                .map_err(&alloc)?,
        }))
    }

    /// For the passes of `stream`.
    pub fn on<'a>(&'a mut self, stream: &'a Stream) -> OnStream<'a> {
        OnStream { rows: self, stream }
    }
}

/// A layer's products in the groups a pass multiplies together (one input each): q/k/v,
/// the attention output, gate/up, down.
/// (The GPU refuses a mixture of experts before it gets here: its layers have no dense
/// feed-forward products.)
fn product_groups(l: &LayerPlan) -> [Vec<&Linear>; 4] {
    let (gate_up, down) = match l.ffn.dense() {
        Some(f) => (vec![&f.gate, &f.up], vec![&f.down]),
        None => (Vec::new(), Vec::new()),
    };
    [vec![&l.wq, &l.wk, &l.wv], vec![&l.wo], gate_up, down]
}

/// Bytes of one row of `lin`'s weight.
fn row_bytes(lin: &Linear) -> usize {
    lin.weight
        .ggml_type()
        .row_bytes(lin.cols as u64)
        .unwrap_or(0) as usize
}

/// [`HostRows`] queuing on one stream.
pub(super) struct OnStream<'a> {
    rows: &'a mut HostRows,
    stream: &'a Stream,
}

/// Whether the decode products take `ty` from Q8 activations (the types worth it).
fn takes(ty: GgmlType) -> bool {
    matvec::is_supported_on_gpu(ty) && matvec::takes_q8(ty)
}

/// How many of `lin`'s first rows the device takes at `share`: whole steps of
/// [`ROW_STEP`], leaving the CPU at least one.
fn device_rows(lin: &Linear, share: f64) -> usize {
    if !takes(lin.weight.ggml_type()) || lin.rows < 2 * ROW_STEP {
        return 0;
    }
    let rows = (lin.rows as f64 * share) as usize / ROW_STEP * ROW_STEP;
    rows.min(lin.rows - ROW_STEP)
}

impl OnStream<'_> {
    /// [`RowOffload::start`]'s launches and copies.
    fn queue(
        &mut self,
        lins: &[&Linear],
        parts: &[usize],
        x: &[f32],
        n: usize,
    ) -> Result<(), ModelError> {
        let rows = &mut *self.rows;
        let stream = self.stream;
        let cols = lins[0].cols;
        let copy = gpu("copying activations to the device");
        rows.x_pinned.as_mut_slice().map_err(&copy)?[..n * cols].copy_from_slice(x);
        stream
            .copy_h2d_async(
                &mut rows.x_pinned,
                0..n * cols,
                rows.x.slice_mut(0..n * cols).map_err(&copy)?,
            )
            .map_err(&copy)?;
        let q8_len = matvec::q8_bytes(n, cols);
        let names = || {
            lins.iter()
                .map(|l| l.weight.name())
                .collect::<Vec<_>>()
                .join(" + ")
        };
        let product = product_error("host layers' rows", &names);
        matvec::quantize_q8(
            rows.x.slice(0..n * cols).map_err(&copy)?,
            n,
            cols,
            rows.q8.slice_mut(0..q8_len).map_err(&copy)?,
            stream,
        )
        .map_err(&product)?;
        // The group's rows into the staging buffer, product after product.
        let mut staged = Vec::with_capacity(lins.len());
        let mut filled = 0;
        for (lin, &part) in lins.iter().zip(parts) {
            let row_bytes = row_bytes(lin);
            let len = part * row_bytes;
            let fetch = gpu("copying the host layers' rows to the device");
            let dst = rows
                .staging
                .slice_mut(filled..filled + len)
                .map_err(&fetch)?;
            // SAFETY: the registration outlives the copy: `finish` (or `start` on an
            // error) waits for this stream before the pass goes on, and the registration
            // lives as long as the host layers.
            unsafe {
                rows.registered
                    .copy(stream, &lin.weight, lin.first_row * row_bytes, dst)
            }
            .map_err(&fetch)?;
            staged.push(filled..filled + len);
            filled += len;
        }
        // Each product of the group with rows here, one launch per run of one type.
        let mut at = 0;
        let mut i = 0;
        let mut y = rows.y.view_mut();
        while i < lins.len() {
            let ty = lins[i].weight.ggml_type();
            let mut mats = Vec::new();
            let mut outs = Vec::new();
            let mut j = i;
            while j < lins.len()
                && lins[j].weight.ggml_type() == ty
                && mats.len() < matvec::MAX_MATRICES
            {
                if parts[j] > 0 {
                    let lin = lins[j];
                    let bytes = rows
                        .staging
                        .slice(staged[j].clone())
                        .map_err(gpu("host layers' rows"))?;
                    mats.push(
                        GpuMatrix::new(ty, parts[j], lin.cols, bytes).map_err(|source| {
                            ModelError::Matmul {
                                name: names(),
                                source,
                            }
                        })?,
                    );
                    let (out, rest) = y
                        .split_at_mut(n * parts[j])
                        .map_err(gpu("host layers' rows"))?;
                    outs.push(out);
                    y = rest;
                    at += n * parts[j];
                }
                j += 1;
            }
            if !mats.is_empty() {
                let q8 = rows.q8.slice(0..q8_len).map_err(&copy)?;
                matvec::matvec(&mats, GpuActivations::Q8(q8), n, &mut outs, false, stream)
                    .map_err(&product)?;
            }
            i = j;
        }
        stream
            .copy_d2h_async(
                rows.y.slice(0..at).map_err(&copy)?,
                &mut rows.y_pinned,
                0..at,
            )
            .map_err(gpu("copying the host layers' rows back"))
    }
}

impl RowOffload for OnStream<'_> {
    fn rows(&self, lin: &Linear) -> usize {
        device_rows(lin, self.rows.share)
    }

    fn start(
        &mut self,
        lins: &[&Linear],
        parts: &[usize],
        x: &[f32],
        n: usize,
    ) -> Result<(), ModelError> {
        let queued = self.queue(lins, parts, x, n);
        if queued.is_err() {
            // Nothing may still read the registered memory once this returns.
            let _ = self.stream.synchronize();
        }
        queued
    }

    fn finish(
        &mut self,
        lins: &[&Linear],
        parts: &[usize],
        n: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<(), ModelError> {
        let y = self
            .rows
            .y_pinned
            .as_slice()
            .map_err(gpu("copying the host layers' rows back"))?;
        let mut at = 0;
        for ((lin, &part), out) in lins.iter().zip(parts).zip(outs.iter_mut()) {
            for t in 0..n {
                out[t * lin.rows..t * lin.rows + part]
                    .copy_from_slice(&y[at + t * part..at + (t + 1) * part]);
            }
            at += n * part;
        }
        Ok(())
    }
}
