//! A model split by layers over several GPUs: each device holds a contiguous run of
//! layers (the first also the embeddings, the last the final norm and the output
//! matrix), uploads only those from the one mapped file, all devices at once, and keeps
//! its layers' KV cache. A chunk's residual stream crosses from one device to the next
//! with a peer copy (over the devices' link where they have one, through the host
//! otherwise).
//!
//! Every stage is a [`GpuModel`] of its part of the model: the same kernels on the same
//! weights, so the logits are the one-device model's, bit for bit, for a prompt taken in
//! the same chunks. The stages are ordered by events, not by the host: while the second
//! device runs a prompt's chunk, the first already runs the next one, and a prompt is cut
//! into chunks enough for each device to have one ([`SplitOptions::chunk`]).

use std::ops::Range;

use hip_backend::{Device, Event};

mod sizes;

use sizes::{chunk_len, per_layer, pipeline_chunk, split_by_bytes};

use super::{gpu, GpuModel, GpuOptions, Part, Want, MAX_BATCH};
use crate::{Model, ModelError};

/// How a model is split by layers over several GPUs.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitOptions {
    /// The GPUs' ordinals in the order of the layers: the first makes the embeddings,
    /// the last the logits. An ordinal may repeat (two stages on one device run the
    /// same code, for tests).
    pub devices: Vec<usize>,
    /// Each device's share of the weights (its layers, and the output matrix on the
    /// last), in the order of `devices`; `None`: equal shares.
    pub ratios: Option<Vec<f64>>,
    /// Most tokens of a prompt's chunk as it flows through the devices; `None`: a prompt
    /// is cut into up to twice as many chunks as there are devices, so that each device
    /// computes one chunk while the others compute theirs, but only into as many as are
    /// long enough for their products to outweigh their fixed costs (at least
    /// [`PIPELINE_CHUNK`] tokens, more for smaller models), each at most the prompt
    /// batch.
    pub chunk: Option<usize>,
}

/// The fewest tokens of a prompt's chunk that [`SplitOptions::chunk`]'s default cuts: a
/// shorter chunk keeps the matrix units too little busy for the overlap to pay.
pub const PIPELINE_CHUNK: usize = 128;

/// The layers each of `n_parts` devices holds, contiguous and in order, so that each
/// device's share of the weights read a token (its layers' bytes, and on the last the
/// output matrix's) is as near its share of `ratios` as whole layers allow; every device
/// holds at least one layer.
pub fn split_layers(
    model: &Model,
    n_parts: usize,
    ratios: Option<&[f64]>,
) -> Result<Vec<Range<usize>>, ModelError> {
    let layer_bytes: Vec<u64> = per_layer(model, |h| h.size() as f64)
        .into_iter()
        .map(|b| b as u64)
        .collect();
    let head_bytes = model.plan().output.weight.size();
    split_by_bytes(&layer_bytes, head_bytes, n_parts, ratios)
}

/// What each device of a layer split over `ranges` ([`split_layers`]) uploads, in the
/// order its first pass uses it: its layers' tensors, with the embeddings on the first
/// and the final norm and the output matrix on the last.
pub fn stage_orders(
    model: &Model,
    ranges: &[Range<usize>],
) -> Vec<tensor_store::device::UploadOrder> {
    Part::stages(ranges)
        .into_iter()
        .map(|part| {
            let (config, plan) = part.narrow(model.config(), model.plan());
            super::use_order(&config, &plan, &part)
        })
        .collect()
}

/// A model split by layers over several GPUs ([`SplitOptions`]), with one sequence's KV
/// cache spread with its layers: the one-device [`GpuModel`]'s calls for one sequence,
/// and its logits, bit for bit.
pub struct LayerSplit {
    stages: Vec<GpuModel>,
    /// Per stage but the last: recorded once its residual stream is on the next stage.
    handed: Vec<Event>,
    /// Per stage: recorded once it has done with its residual stream (its layers have
    /// run and it has handed the stream on), which the stage before waits for before it
    /// copies the next chunk's stream in.
    freed: Vec<Event>,
    n_embd: usize,
    n_vocab: usize,
    /// [`SplitOptions::chunk`].
    chunk: Option<usize>,
    /// The fewest tokens of a chunk its default cuts (`pipeline_chunk`).
    min_chunk: usize,
}

impl LayerSplit {
    /// Splits `model` over `split.devices` as [`split_layers`] says, each stage set up as
    /// `options` says (its `device` is replaced by the stage's), with prompts in chunks
    /// of `prompt_batch` tokens. Every device uploads its weights at once, from the one
    /// mapped file; in [`UploadMode::Eager`](tensor_store::device::UploadMode::Eager)
    /// this returns once all have.
    pub fn new(
        model: &Model,
        options: &GpuOptions,
        split: &SplitOptions,
        prompt_batch: usize,
    ) -> Result<LayerSplit, ModelError> {
        LayerSplit::build(model, options, split, prompt_batch, None)
    }

    /// As [`LayerSplit::new`], each device's KV cache also a pool of `pages`' blocks (of
    /// its layers), for [`LayerSplit::launch_batch`] as [`GpuModel::with_pages`] is for
    /// [`GpuModel::launch_batch`]: the same block tables serve every device.
    pub fn with_pages(
        model: &Model,
        options: &GpuOptions,
        split: &SplitOptions,
        prompt_batch: usize,
        pages: super::PageOptions,
    ) -> Result<LayerSplit, ModelError> {
        let shape = GpuModel::page_shape(options, pages)?;
        LayerSplit::build(model, options, split, prompt_batch, Some(shape))
    }

    pub(super) fn build(
        model: &Model,
        options: &GpuOptions,
        split: &SplitOptions,
        prompt_batch: usize,
        pages: Option<super::forward::PageShape>,
    ) -> Result<LayerSplit, ModelError> {
        let ranges = split_layers(model, split.devices.len(), split.ratios.as_deref())?;
        let min_chunk = pipeline_chunk(model, &ranges);
        let devices = split
            .devices
            .iter()
            .map(|&d| Device::open(d).map_err(gpu("device")))
            .collect::<Result<Vec<_>, _>>()?;
        // Peer access where the devices have it; copies go through the host otherwise.
        for pair in devices.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if a.can_access_peer(b).map_err(gpu("peer access"))? {
                a.enable_peer_access(b).map_err(gpu("peer access"))?;
                b.enable_peer_access(a).map_err(gpu("peer access"))?;
            } else {
                tracing::info!(
                    from = a.ordinal(),
                    to = b.ordinal(),
                    "no peer access between the devices: their copies go through the host"
                );
            }
        }
        // The stages are built at once, each on a thread of its own (a device's runtime
        // context, its buffers and its upload start together); an eager caller then
        // waits for every upload.
        let eager = options.mode == tensor_store::device::UploadMode::Eager;
        let parts: Vec<(GpuOptions, Part)> = Part::stages(&ranges)
            .into_iter()
            .zip(&split.devices)
            .map(|(part, &device)| {
                let stage_options = GpuOptions {
                    device,
                    mode: if eager {
                        tensor_store::device::UploadMode::Background
                    } else {
                        options.mode
                    },
                    ..options.clone()
                };
                (stage_options, part)
            })
            .collect();
        for (stage_options, part) in &parts {
            tracing::info!(
                device = stage_options.device,
                layers = ?part.layers,
                "a stage of the layer split"
            );
        }
        let stages = GpuModel::build_each(model, parts, prompt_batch, pages)?;
        let events = |stages: &[GpuModel]| {
            stages
                .iter()
                .map(|s| s.device.new_sync_event().map_err(gpu("event")))
                .collect::<Result<Vec<_>, _>>()
        };
        let handed = events(&stages[..stages.len() - 1])?;
        let freed = events(&stages)?;
        let config = model.config();
        let split = LayerSplit {
            stages,
            handed,
            freed,
            n_embd: config.n_embd,
            n_vocab: config.n_vocab,
            chunk: split.chunk,
            min_chunk,
        };
        if eager {
            split.wait_loaded()?;
        }
        Ok(split)
    }

    /// Logits a position.
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// Each stage's device and layers, in order.
    pub fn stages(&self) -> Vec<(usize, Range<usize>)> {
        self.stages
            .iter()
            .map(|s| (s.device.ordinal(), s.part.layers.clone()))
            .collect()
    }

    /// Sets [`SplitOptions::chunk`].
    pub fn set_chunk(&mut self, chunk: Option<usize>) {
        self.chunk = chunk;
    }

    /// When every device had all of its weights once (not yet: `None`).
    pub fn uploaded_at(&self) -> Option<std::time::Instant> {
        let all: Option<Vec<_>> = self.stages.iter().map(GpuModel::uploaded_at).collect();
        all?.into_iter().max()
    }

    /// When the last stage's first pass had in hand the last of the weights it waits for
    /// (the stages before it waited for theirs earlier).
    pub fn first_pass_weights_at(&self) -> Option<std::time::Instant> {
        self.last().first_pass_weights_at()
    }

    /// Waits until every device has all of its weights.
    pub fn wait_loaded(&self) -> Result<(), ModelError> {
        self.stages.iter().try_for_each(GpuModel::wait_loaded)
    }

    /// Positions in the KV cache.
    pub fn len(&self) -> usize {
        self.stages[0].len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Most positions the KV cache holds.
    pub fn capacity(&self) -> usize {
        self.stages[0].capacity
    }

    /// Forgets every position.
    pub fn clear(&mut self) -> Result<(), ModelError> {
        self.set_position(0)
    }

    fn set_position(&mut self, len: usize) -> Result<(), ModelError> {
        for stage in &mut self.stages {
            stage.device.make_current().map_err(gpu("device"))?;
            stage.set_position(len)?;
        }
        Ok(())
    }

    /// Appends `tokens` to the KV cache and returns the logits of the last one.
    pub fn forward_logits(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        self.eval(tokens, Want::Logits)?;
        self.last().logits(1)
    }

    /// Appends `tokens` and returns the greedy choice after the last one, taken on the
    /// last device.
    pub fn forward_argmax(&mut self, tokens: &[u32]) -> Result<u32, ModelError> {
        self.eval(tokens, Want::Argmax)?;
        Ok(self.last().greedy_tokens(1)?[0])
    }

    /// Appends `tokens` and returns the logits of every one of them, `n_vocab` each.
    pub fn forward_all_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::with_capacity(tokens.len() * self.n_vocab);
        for chunk in tokens.chunks(MAX_BATCH) {
            self.eval(chunk, Want::AllLogits)?;
            out.extend_from_slice(self.last().logits(chunk.len())?);
        }
        Ok(out)
    }

    fn last(&self) -> &GpuModel {
        self.stages.last().expect("a split has a stage")
    }

    /// Most tokens of a prompt's chunk, and of a paged batch.
    pub fn prompt_batch(&self) -> usize {
        self.stages[0].prompt_batch
    }

    /// The devices' weight caches' counters, added up (the budget too).
    pub fn cache_stats(&self) -> tensor_store::device::CacheStats {
        self.stages
            .iter()
            .map(|s| s.cache.stats())
            .fold(Default::default(), std::ops::Add::add)
    }

    /// Runs a paged batch through every device ([`GpuModel::launch_batch`]'s work, each
    /// device its layers) and leaves its logits on the last device.
    pub fn launch_batch(
        &mut self,
        segments: &[super::BatchSegment<'_>],
    ) -> Result<super::LaunchedBatch<'_>, ModelError> {
        let rows = self.eval_batch(segments, super::batch::BatchOut::OnDevice)?;
        let last = self.stages.last_mut().expect("a split has a stage");
        Ok(super::LaunchedBatch::of(last, rows))
    }

    /// [`GpuModel::forward_batch_hidden`] over the devices: every token's hidden state
    /// after the final norm.
    pub fn forward_batch_hidden(
        &mut self,
        segments: &[super::BatchSegment<'_>],
    ) -> Result<Vec<f32>, ModelError> {
        let segments = super::batch::without_logits(segments);
        self.eval_batch(&segments, super::batch::BatchOut::Logits)?;
        let last = self.stages.last().expect("a split has a stage");
        last.hidden_rows(segments.iter().map(|s| s.tokens.len()).sum())
    }

    /// A paged batch through every stage ([`LayerSplit::through_stages`]), the last
    /// stage's rows copied back as `out` says.
    fn eval_batch(
        &mut self,
        segments: &[super::BatchSegment<'_>],
        out: super::batch::BatchOut,
    ) -> Result<usize, ModelError> {
        let argmax = out == super::batch::BatchOut::Tokens;
        let n = segments.iter().map(|s| s.tokens.len()).sum::<usize>();
        let mut laid_out = None;
        self.through_stages(n, |_, stage| {
            let batch = stage.lay_out_batch(segments)?;
            stage.run_batch(&batch, argmax)?;
            laid_out = Some(batch);
            Ok(())
        })?;
        let batch = laid_out.expect("a split has a stage");
        let last = self.stages.last_mut().expect("a split has a stage");
        last.finish_batch(&batch, out)
    }

    /// Runs `tokens` through every stage, in chunks of the prompt batch, and leaves what
    /// `want` asks for in the last stage's pinned buffers; on failure the cache is left
    /// as it was.
    fn eval(&mut self, tokens: &[u32], want: Want) -> Result<(), ModelError> {
        // Every stage holds as many positions as the first.
        self.stages[0].check_call(tokens, want)?;
        let start = self.len();
        let result = self.run_chunks(tokens, want);
        if result.is_err() {
            for stage in &self.stages {
                stage.sync().ok();
            }
            self.set_position(start)?;
        }
        result
    }

    /// The tokens of each chunk of a prompt of `n` (the last may be shorter).
    fn chunk_len(&self, n: usize) -> usize {
        let batch = self.stages[0].prompt_batch;
        chunk_len(n, batch, self.stages.len(), self.chunk, self.min_chunk)
    }

    fn run_chunks(&mut self, tokens: &[u32], want: Want) -> Result<(), ModelError> {
        let chunk_len = if want == Want::AllLogits {
            tokens.len()
        } else {
            self.chunk_len(tokens.len())
        };
        let chunks: Vec<&[u32]> = tokens.chunks(chunk_len).collect();
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            let output = if i == last { want } else { Want::Logits };
            self.run_chunk(chunk, output, i == last)?;
        }
        let n = tokens.len() - last * chunk_len;
        let head = self.stages.last_mut().expect("a split has a stage");
        head.copy_back(n, want)
    }

    /// One chunk through every stage.
    fn run_chunk(&mut self, chunk: &[u32], want: Want, last: bool) -> Result<(), ModelError> {
        let n = chunk.len();
        self.through_stages(n, |k, stage| {
            if k == 0 {
                stage.write_tokens(chunk)?;
            }
            stage.run_chunk(n, want, last)
        })
    }

    /// `work` of `n` tokens queued on every stage in turn (`work(k, stage)`), each
    /// stage's after the residual stream it takes is on its device (the stage before
    /// copies it over, then records `handed`), and the stream handed on before the next
    /// work overwrites it (a stage waits for its successor's `freed` before copying).
    fn through_stages(
        &mut self,
        n: usize,
        mut work: impl FnMut(usize, &mut GpuModel) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let rows = n * self.n_embd;
        let LayerSplit {
            stages,
            handed,
            freed,
            ..
        } = self;
        for k in 0..stages.len() {
            let (done, rest) = stages.split_at_mut(k + 1);
            let stage = &mut done[k];
            super::check_stop(stage.stop.as_deref())?;
            stage.device.make_current().map_err(gpu("device"))?;
            if k > 0 {
                stage
                    .stream
                    .wait_event(&handed[k - 1])
                    .map_err(gpu("waiting for the residual stream"))?;
            }
            work(k, stage)?;
            if let Some(next) = rest.first_mut() {
                // The next stage's stream is free once it has done with the work before.
                stage
                    .stream
                    .wait_event(&freed[k + 1])
                    .map_err(gpu("waiting for the next stage"))?;
                stage
                    .stream
                    .copy_peer_async(stage.bufs.x_view(rows)?, next.bufs.x_mut(rows)?)
                    .map_err(gpu("handing the residual stream on"))?;
                handed[k]
                    .record(&stage.stream)
                    .map_err(gpu("handing the residual stream on"))?;
            }
            freed[k]
                .record(&stage.stream)
                .map_err(gpu("handing the residual stream on"))?;
        }
        Ok(())
    }
}
