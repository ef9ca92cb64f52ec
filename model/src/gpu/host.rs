//! The transformer blocks a GPU model over its budget computes on the host.
//!
//! A budget smaller than the weights holds the first layers on the device; the others
//! would have to be uploaded again for every pass. For a prompt's chunk that upload is
//! shared by hundreds of tokens, but a decode step would wait for it every token, and the
//! copy runs at a small fraction of the device's memory speed. So a pass of a few tokens
//! ([`HOST_TOKENS`] or fewer) runs the held layers on the device, brings the residual
//! stream back, runs the other layers with the CPU kernels on the mapped file (as
//! llama.cpp's partial offload does), and hands the stream back for the output.
//!
//! Those layers' keys and values then live on both sides: the device writes them in a
//! streamed pass, the host in its own. Each side knows how many positions it has, and
//! the missing ones are copied over (f16 both ways, so nothing is lost) only before a
//! pass that needs them: a prompt's keys go to the host before its first decode step,
//! decoded keys go to the device before the next long chunk.

use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use half::f16;
use hip_backend::{Device, PinnedBuffer, Stream};

use super::forward::Buffers;
use super::host_rows::HostRows;
use super::{gpu, GpuOptions, HOST_TOKENS};
use crate::config::ModelConfig;
use crate::cpu::layers_on_host;
use crate::cpu::RowOffload;
use crate::kv_cache::KvCache;
use crate::ops::AttentionMethod;
use crate::plan::ExecutionPlan;
use crate::ModelError;

/// The host's half of a model over budget: its layers' KV cache and the page-locked
/// buffers the residual stream and the keys and values cross in.
pub(super) struct HostLayers {
    /// The layers computed here, the last ones of the model.
    layers: Range<usize>,
    /// Their keys and values of positions `0..kv.len()` (the other layers' stay empty).
    kv: KvCache,
    /// Positions whose keys and values of these layers are also on the device.
    device_len: usize,
    /// The residual stream of a pass, on its way.
    x_pinned: PinnedBuffer<f32>,
    x: Vec<f32>,
    /// Keys then values of `staging_rows` positions of one layer, on their way.
    staging: PinnedBuffer<f16>,
    staging_rows: usize,
    /// `GpuOptions::stop`, looked at before each layer.
    stop: Option<Arc<AtomicBool>>,
    /// The first rows of these layers' products, copied to the device from the mapped
    /// file and computed there while the CPU computes the others; none where the mapping
    /// cannot be registered.
    device_rows: Option<HostRows>,
}

impl HostLayers {
    /// Host layers `layers` of `config`'s model, with a cache of `capacity` positions;
    /// keys and values cross `rows` positions at a time; a pass stops before a layer once
    /// `options.stop` is set, and the device takes `options.tuning.host_rows_share` of
    /// their rows (by default the share the CPU's threads give).
    pub fn new(
        device: &Device,
        config: &ModelConfig,
        plan: &ExecutionPlan,
        layers: Range<usize>,
        capacity: usize,
        rows: usize,
        options: &GpuOptions,
    ) -> Result<HostLayers, ModelError> {
        let kv_dim = config.n_kv_heads * config.head_dim;
        let v_dim = config.n_kv_heads * config.head_dim_v;
        let rows = rows.max(1);
        let share = options
            .tuning
            .host_rows_share
            .unwrap_or_else(|| HostRows::share(rayon::current_num_threads()));
        let device_rows = HostRows::new(device, plan, layers.clone(), share)?;
        if device_rows.is_some() {
            tracing::info!(
                share,
                "host layers: the first rows of their products on the device"
            );
        }
        Ok(HostLayers {
            layers,
            kv: KvCache::new(config, capacity).with_attention(AttentionMethod::Matmul),
            device_len: 0,
            x_pinned: device
                .alloc_pinned::<f32>(HOST_TOKENS * config.n_embd)
                .map_err(gpu("pinned"))?,
            x: Vec::with_capacity(HOST_TOKENS * config.n_embd),
            staging: device
                .alloc_pinned::<f16>(rows * (kv_dim + v_dim))
                .map_err(gpu("pinned"))?,
            staging_rows: rows,
            stop: options.stop.clone(),
            device_rows,
        })
    }

    /// The first layer computed here.
    pub fn first(&self) -> usize {
        self.layers.start
    }

    /// Forgets positions from `len` on, on both sides.
    pub fn truncate(&mut self, len: usize) {
        self.kv.truncate(len);
        self.device_len = self.device_len.min(len);
    }

    /// Before a pass on the device from position `first_pos`: the positions before it
    /// that only the host has go to the device.
    pub fn before_device_pass(
        &mut self,
        bufs: &mut Buffers,
        stream: &Stream,
        first_pos: usize,
    ) -> Result<(), ModelError> {
        let (kd, vd) = bufs.kv_dims();
        let mut at = self.device_len;
        debug_assert!(at >= first_pos || self.kv.len() >= first_pos);
        while at < first_pos {
            let end = first_pos.min(at + self.staging_rows);
            let rows = end - at;
            for layer in self.layers.clone() {
                let staging = self.staging.as_mut_slice().map_err(gpu("staging"))?;
                let (keys, values) =
                    self.kv
                        .layer_f16(layer)
                        .ok_or_else(|| ModelError::CacheType {
                            reason: "the host layers of a GPU model keep an f16 cache".into(),
                        })?;
                let (k_out, v_out) = staging.split_at_mut(rows * kd);
                to_f16(&keys[at * kd..end * kd], k_out);
                to_f16(&values[at * vd..end * vd], &mut v_out[..rows * vd]);
                let (k, v) = bufs.kv_mut(layer, at..end)?;
                let copy = gpu("copying keys to the device");
                stream
                    .copy_h2d_async(&mut self.staging, 0..rows * kd, k)
                    .map_err(&copy)?;
                stream
                    .copy_h2d_async(&mut self.staging, rows * kd..rows * (kd + vd), v)
                    .map_err(&copy)?;
            }
            at = end;
        }
        self.staging
            .wait()
            .map_err(gpu("copying keys to the device"))?;
        self.device_len = self.device_len.max(first_pos);
        Ok(())
    }

    /// After a pass on the device over positions up to `end`: the device has them all.
    pub fn after_device_pass(&mut self, end: usize) {
        self.device_len = end;
    }

    /// The host's layers over the `n` tokens whose residual stream the device holds (the
    /// held layers done), from position `first_pos`; their stream goes back to the
    /// device for the output. The positions before `first_pos` that only the device has
    /// come over first. Stops before a layer once `stop` is set.
    pub fn run(
        &mut self,
        config: &ModelConfig,
        plan: &ExecutionPlan,
        bufs: &mut Buffers,
        stream: &Stream,
        first_pos: usize,
        n: usize,
    ) -> Result<(), ModelError> {
        debug_assert!(n <= HOST_TOKENS);
        self.fetch_from_device(bufs, stream, first_pos)?;
        let len = n * config.n_embd;
        stream
            .copy_d2h_async(bufs.x_view(len)?, &mut self.x_pinned, 0..len)
            .map_err(gpu("copying the residual stream"))?;
        let pinned = self
            .x_pinned
            .as_mut_slice()
            .map_err(gpu("copying the residual stream"))?;
        self.x.clear();
        self.x.extend_from_slice(&pinned[..len]);
        let mut device_rows = self.device_rows.as_mut().map(|rows| rows.on(stream));
        if let Err(error) = layers_on_host(
            config,
            plan,
            self.layers.clone(),
            &mut self.x,
            &mut self.kv,
            self.stop.as_deref(),
            device_rows
                .as_mut()
                .map(|rows| rows as &mut (dyn RowOffload + Send)),
        ) {
            self.kv.truncate(first_pos);
            return Err(error);
        }
        self.kv.commit(n);
        let pinned = self
            .x_pinned
            .as_mut_slice()
            .map_err(gpu("copying the residual stream"))?;
        pinned[..len].copy_from_slice(&self.x);
        stream
            .copy_h2d_async(&mut self.x_pinned, 0..len, bufs.x_mut(len)?)
            .map_err(gpu("copying the residual stream"))
    }

    /// Brings the keys and values of positions `kv.len()..end` of the host's layers over
    /// from the device, which has them.
    fn fetch_from_device(
        &mut self,
        bufs: &Buffers,
        stream: &Stream,
        end: usize,
    ) -> Result<(), ModelError> {
        let (kd, vd) = bufs.kv_dims();
        debug_assert!(self.kv.len() >= end || self.device_len >= end);
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        while self.kv.len() < end {
            let at = self.kv.len();
            let stop = end.min(at + self.staging_rows);
            let rows = stop - at;
            for layer in self.layers.clone() {
                let (k, v) = bufs.kv_view(layer, at..stop)?;
                let copy = gpu("copying keys to the host");
                stream
                    .copy_d2h_async(k, &mut self.staging, 0..rows * kd)
                    .map_err(&copy)?;
                stream
                    .copy_d2h_async(v, &mut self.staging, rows * kd..rows * (kd + vd))
                    .map_err(&copy)?;
                let staging = self.staging.as_slice().map_err(&copy)?;
                keys.clear();
                keys.extend(staging[..rows * kd].iter().map(|h| h.to_f32()));
                values.clear();
                values.extend(
                    staging[rows * kd..rows * (kd + vd)]
                        .iter()
                        .map(|h| h.to_f32()),
                );
                self.kv.append(layer, &keys, &values);
            }
            self.kv.commit(rows);
        }
        Ok(())
    }
}

fn to_f16(from: &[f32], to: &mut [f16]) {
    for (t, &f) in to.iter_mut().zip(from) {
        *t = f16::from_f32(f);
    }
}
