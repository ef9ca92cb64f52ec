//! The forward pass on a GPU: the same plan of lazy handles as the CPU path, its weights
//! obtained through [`tensor_store::device::DeviceCache`] (single-flight, raw GGUF
//! blocks, never expanded), multiplied on their blocks by `dequant::gpu::matvec` (a few
//! tokens) or `dequant::gpu::matmul` (a prompt's chunk, on the matrix units), with
//! the layer's other operations in this crate's kernels (`kernels/*.hip`).
//!
//! - [`GpuModel::new`] opens the device cache in the chosen [`UploadMode`] (eager,
//!   background or lazy; the forward pass is one code path for the three: it asks the
//!   cache for each layer's tensors, which waits for that layer only) and takes one arena
//!   for the activations and the f16 KV cache, sized from the context, once.
//! - When the whole model fits in the budget, every weight stays pinned in the cache
//!   after its first use, and a decode step (one token) is captured once as a graph and
//!   replayed for every later token: positions and the token live in device memory, so
//!   the captured step needs no change as the position advances. Greedy decoding takes
//!   its argmax on the device and copies back one token id.
//! - When it does not fit, each layer's tensors are held only while that layer runs
//!   (the cache evicts and uploads again as needed), without a graph.
//! - Set up with [`GpuModel::with_pages`], the KV cache is also a pool of fixed-size
//!   blocks that several sequences share, each through its own table of blocks, and
//!   [`GpuModel::forward_batch`] runs the new tokens of many sequences in one pass (a
//!   server's step): one token of each decoding sequence and chunks of new prompts
//!   through the same products, each sequence's attention on its own blocks. A step of
//!   one token per sequence (decoding only) is captured as a graph too, once per number
//!   of sequences: the positions, tables and rows it reads live in device memory.
//!
//! This module calls no HIP runtime function directly: it goes through `hip-backend`'s
//! safe types and the typed wrappers of [`kernels`].

mod batch;
pub use batch::LaunchedBatch;
mod build;
mod engine;
pub use engine::GpuEngine;
mod expert_pool;
pub use expert_pool::ExpertStats;
mod fits;
mod forward;
mod host;
mod host_rows;
mod kernels;
mod mapped;
mod pass;
mod prompt;
mod sequence;
mod shard;
mod split;
mod tensor_split;
mod weights;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use hip_backend::{Device, DeviceArena, DeviceBuffer, Graph, HipError, PinnedBuffer, Stream};
use tensor_store::device::{DeviceCache, HipTarget, StagingRing, UploadMode, UploadOrder};
use tensor_store::TensorHandle;

pub use fits::{check_cache_fits, check_experts_fit};
pub use kernels::{KernelError, ShapeError};
pub use split::{split_layers, stage_orders, LayerSplit, SplitOptions, PIPELINE_CHUNK};
pub use tensor_split::{TensorOptions, TensorSplit};

use crate::config::ModelConfig;
use crate::plan::ExecutionPlan;
use crate::{Model, ModelError};
use forward::{Buffers, PageShape};
use host::HostLayers;
use weights::{Held, LayerWeights, RopeContext};

/// Most tokens the decode products and one attention launch take, and the chunk of
/// [`GpuModel::forward_all_logits`]; longer prompts take the batch products.
pub const MAX_BATCH: usize = dequant::gpu::matvec::MAX_TOKENS;
/// Most tokens of a pass whose layers beyond the budget run on the host; longer chunks
/// stream those layers' weights through the device. The host's work grows with the
/// tokens, the upload's does not: at a few tokens the host wins by far (a layer of a
/// 7B model is about 1 ms of a 16-core CPU per token against about 5 ms of copying).
pub const HOST_TOKENS: usize = MAX_BATCH;
/// Most tokens of a prompt one forward pass takes unless [`GpuModel::with_prompt_batch`]
/// says otherwise: longer prompts run in chunks of this many. Past [`MAX_BATCH`] tokens
/// the products run on the matrix units (`dequant::gpu::matmul`) and attention in one
/// launch over the chunk's queries.
pub const PROMPT_BATCH: usize = 512;

/// Device bytes left to the runtime (its kernels' code, captured graphs) when the
/// weights' budget is taken from the device's free memory.
pub const RUNTIME_RESERVE: u64 = 512 << 20;

/// How a [`GpuModel`] is set up.
#[derive(Clone, Debug)]
pub struct GpuOptions {
    /// The GPU's ordinal.
    pub device: usize,
    /// When the weights go to the device.
    pub mode: UploadMode,
    /// Device bytes the weights may take; `None`: the whole model, or, should the
    /// device not hold it, what the device has free beside the rest, less
    /// [`RUNTIME_RESERVE`].
    pub budget: Option<u64>,
    /// Most positions the KV cache holds.
    pub context_size: usize,
    /// The KV cache's element types (default f16). A quantized cache holds what
    /// llama.cpp's does (the same blocks, of rotated keys and values), computed within
    /// the GPU's tolerance of the CPU; it needs every layer on the device.
    pub kv_types: crate::KvTypes,
    /// A stop request (a Ctrl-C handler's flag, say). Once it is set, the eager upload
    /// and waits for a background upload cancel the uploads, and a forward pass stops at
    /// its next layer (or prompt chunk), all within about 10 ms of the work in hand;
    /// each fails with [`ModelError::Interrupted`]. Looked at with one relaxed load per
    /// layer: nothing measurable per token.
    pub stop: Option<Arc<AtomicBool>>,
    /// Which kernels and allocations the model takes where there is a choice.
    pub tuning: GpuTuning,
}

impl GpuOptions {
    /// GPU 0 taking the whole model as `mode` says, a KV cache of `context_size`
    /// positions, no stop request and the default tuning: the setups of tests and
    /// measurements, which change the rest with `..`.
    pub fn new(mode: UploadMode, context_size: usize) -> GpuOptions {
        GpuOptions {
            device: 0,
            mode,
            budget: None,
            context_size,
            kv_types: crate::KvTypes::default(),
            stop: None,
            tuning: GpuTuning::default(),
        }
    }
}

/// The choices a [`GpuModel`] makes between ways of doing the same work. The defaults
/// are what the engine runs; the others are there to measure or test against them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuTuning {
    /// Whether a prompt's attention may take the matrix units where the device has them
    /// (NVIDIA, compute capability 8.0 and later); `false` takes the f32 kernel AMD runs.
    /// Default `true`.
    pub flash_mma: bool,
    /// Whether a decode step's attention over f16 caches whose heads are 32, 64 or 128
    /// values wide gives each 32-lane group blocks of 32 keys, a key a lane
    /// (`AttentionShape::warps`); `false` takes the kernel every cache type runs.
    /// Default `true`.
    pub warp_attention: bool,
    /// Whether the products of `Q4_K` matrices on more than [`MAX_BATCH`] tokens (a
    /// prompt's chunk, a batch of decoding sequences) take the int8 matrix units, from
    /// activations quantized to 8 bits in blocks of 256 (`dequant::gpu::matmul_q8k`), where
    /// the device has them (NVIDIA, compute capability 8.0 and later); `false` takes the
    /// f16 tiles every type runs. Default `true`.
    pub int8_prompts: bool,
    /// Over budget, the device's share of the rows of the host layers' products
    /// (between 0 and 1; 0 leaves every row to the CPU); `None`, the default: the share
    /// the CPU's threads give, so that both finish at about the same time.
    pub host_rows_share: Option<f64>,
    /// Over budget, a mixture of experts' link slots a layer: of the slots the budget
    /// holds, those that take the experts a pass misses over the link rather than
    /// holding experts resident (`Some(0)`: none, the CPU computes every missed route);
    /// `None`, the default: up to four, at most a quarter of the slots. A budget without
    /// a slot gets them as scratch outside it, shared by the layers.
    pub expert_link_slots: Option<usize>,
    /// Over budget, whether a mixture of experts' passes of a few tokens read the experts
    /// their pools miss in place, from the registered mapping over the link, once it is
    /// registered (the device reading it as one run), rather than splitting their
    /// routes between the device, the link slots and the CPU. Default `true`.
    pub experts_in_place: bool,
    /// How the upload's staging buffers are allocated
    /// ([`CacheConfig::staging_ring`](tensor_store::device::CacheConfig::staging_ring)).
    pub staging_ring: StagingRing,
}

impl Default for GpuTuning {
    fn default() -> GpuTuning {
        GpuTuning {
            flash_mma: true,
            warp_attention: true,
            int8_prompts: true,
            host_rows_share: None,
            expert_link_slots: None,
            experts_in_place: true,
            staging_ring: StagingRing::Region,
        }
    }
}

/// A KV cache shared in blocks by several sequences, for [`GpuModel::forward_batch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageOptions {
    /// Positions per block: a power of two.
    pub block_size: usize,
    /// Blocks of the cache.
    pub n_blocks: usize,
    /// Most sequences in one batch (and rows of logits it returns).
    pub max_sequences: usize,
}

/// One sequence's part of a [`GpuModel::forward_batch`] call.
#[derive(Clone, Copy, Debug)]
pub struct BatchSegment<'a> {
    /// Tokens at positions `first_pos..first_pos + tokens.len()` of the sequence.
    pub tokens: &'a [u32],
    pub first_pos: usize,
    /// The sequence's blocks (ids below [`PageOptions::n_blocks`]), position `p` in
    /// block `table[p / block_size]`, covering every position up to its last token.
    /// The keys and values of the positions before `first_pos` must already be there.
    pub table: &'a [u32],
    /// Whether its last token gets logits.
    pub logits: bool,
}

/// What one forward call hands back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// The logits of the last token, copied to the host.
    Logits,
    /// Only the argmax of the last token's logits, taken on the device.
    Argmax,
    /// The logits of every token, copied to the host.
    AllLogits,
}

/// The order in which a [`GpuModel`] uploads `model`'s tensors, and what to read ahead
/// of the upload from a cold file ([`tensor_store::device::ReadAhead`]): the order its
/// first pass takes them in. Layer by layer, then the final norm and the output matrix
/// (a pass that starts while the weights arrive asks for them after its last layer),
/// and the token embeddings last: a prompt whose pass starts while they are still on
/// their way gathers its rows on the host from the file, so that its first token waits
/// for every weight but them. Where the embeddings are the output matrix too, every pass
/// needs them first: they come first, with the final norm.
pub fn first_use_order(model: &Model) -> UploadOrder {
    let plan = model.plan();
    use_order(model.config(), plan, &Part::whole(plan.layers.len()))
}

/// [`first_use_order`] of the tensors `part` of `plan` uses (`config` and `plan` already
/// narrowed to its part): the embeddings only where it makes them, the final norm and the
/// output matrix only where it ends with the logits, and split by tensors none of those
/// it takes parts of.
fn use_order(config: &ModelConfig, plan: &ExecutionPlan, part: &Part) -> UploadOrder {
    let embd = &plan.token_embd.weight;
    let tied = embd.index() == plan.output.weight.index();
    let head = [&plan.output_norm.handle, &plan.output.weight]
        .into_iter()
        .filter(|_| part.head);
    let is_head = |h: &TensorHandle| {
        h.index() == plan.output_norm.handle.index() || h.index() == plan.output.weight.index()
    };
    // A split by tensors uploads its parts of the matrices it cuts itself.
    let cut = part
        .shard
        .as_ref()
        .map(|s| s.cut_tensors(config, plan))
        .unwrap_or_default();
    let layers = plan
        .handles()
        .into_iter()
        .filter(|h| h.index() != embd.index() && !is_head(h) && !cut.contains(&h.index()));
    if tied {
        // The table is the output matrix too: wherever either is used, it comes first.
        let table = (part.embed && !part.head).then_some(embd);
        UploadOrder::by_layer(head.chain(table).chain(layers))
    } else {
        let table = part.embed.then_some(embd);
        UploadOrder::by_layer(layers.chain(head).chain(table))
    }
}

/// Which part of a model a [`GpuModel`] computes: all of it, one stage of a
/// [`LayerSplit`], or one device's share of a [`TensorSplit`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Part {
    /// The model's layers it runs.
    pub layers: std::ops::Range<usize>,
    /// Whether it makes the tokens' embeddings; otherwise the stage before it copies its
    /// residual stream in.
    pub embed: bool,
    /// Whether it ends with the final norm and the logits; otherwise its residual stream
    /// goes on to the next stage (or, split by tensors, the leading device makes them).
    pub head: bool,
    /// Split by tensors: the heads and feed-forward rows of every layer it computes.
    pub shard: Option<shard::Shard>,
}

impl Part {
    pub fn whole(n_layers: usize) -> Part {
        Part {
            layers: 0..n_layers,
            embed: true,
            head: true,
            shard: None,
        }
    }

    /// The parts of a layer split over `ranges`: the first embeds, the last has the head.
    fn stages(ranges: &[std::ops::Range<usize>]) -> Vec<Part> {
        let last = ranges.len().saturating_sub(1);
        ranges
            .iter()
            .enumerate()
            .map(|(k, layers)| Part {
                layers: layers.clone(),
                embed: k == 0,
                head: k == last,
                shard: None,
            })
            .collect()
    }

    fn is_whole(&self, n_layers: usize) -> bool {
        *self == Part::whole(n_layers)
    }

    /// The configuration and plan of this part's layers alone: layer `i` of theirs is
    /// the model's layer `layers.start + i` (every per-layer setting is in
    /// `config.layers` and the plan's layers, so narrowing both keeps each layer's own).
    fn narrow(&self, config: &ModelConfig, plan: &ExecutionPlan) -> (ModelConfig, ExecutionPlan) {
        let mut config = config.clone();
        let mut plan = plan.clone();
        config.layers = config.layers[self.layers.clone()].to_vec();
        config.n_layers = self.layers.len();
        if let Some(shard) = &self.shard {
            shard.narrow(&mut config);
        }
        plan.layers = plan.layers[self.layers.clone()].to_vec();
        (config, plan)
    }
}

/// A model whose forward pass runs on a GPU, with its KV cache there.
pub struct GpuModel {
    // The captured graphs come first, so that they are dropped first: before the weights
    // and buffers they read, and before a split by tensors' communicator (in `bufs`),
    // whose release waits for the graphs that hold its all-reduces.
    /// The decode step, captured once every weight is held.
    step: Option<Graph>,
    /// Paged decode steps (one token of each of `n` sequences, every row's logits, with
    /// the greedy tokens or not), captured once per shape once every weight is held.
    batch_steps: HashMap<(usize, bool), Graph>,
    config: ModelConfig,
    plan: ExecutionPlan,
    stream: Stream,
    cache: DeviceCache<HipTarget>,
    /// Every weight pinned, once all have been used and the budget holds them all.
    held: Option<Held>,
    hold_all: bool,
    /// Over budget: the embeddings are gathered from the file on the host, not uploaded.
    embed_on_host: bool,
    /// When the budget is smaller than the model: how many of the first layers stay
    /// resident (held once fetched), and those layers; the others pass through the
    /// cache's remaining room, layer by layer.
    keep_layers: usize,
    /// How many of those a pass that streams the others holds: one sequence keeps no room
    /// for a passing layer beside its kept ones, so its long chunks first let go of the
    /// last kept layers until a layer can pass (its decode steps fetch them again).
    stream_keep: usize,
    kept: Vec<LayerWeights>,
    /// Over budget, for one sequence: the layers past `keep_layers`, computed on the host
    /// in passes of a few tokens.
    host: Option<HostLayers>,
    bufs: Buffers,
    capacity: usize,
    /// Most tokens of a prompt's chunk.
    prompt_batch: usize,
    len: usize,
    /// Whether paged decode steps replay captured graphs ([`GpuModel::set_batch_graphs`]).
    batch_graphs: bool,
    /// [`LaunchedBatch::argmax`]'s biases and masks (see `batch::Extras`), staged and on
    /// the device; grown as needed.
    extras_room: Option<(PinnedBuffer<i32>, DeviceBuffer<i32>)>,
    host_tokens: PinnedBuffer<u32>,
    host_logits: PinnedBuffer<f32>,
    /// The host side of the first positions a pass writes: its own, or each chunk's of a
    /// prompt run layer by layer; grown as needed.
    host_positions: PinnedBuffer<i32>,
    /// The raw embedding rows a pass gathers from the file.
    ///
    /// The pass's writes while the upload runs go through page-locked memory, so that
    /// each is one asynchronous copy: from ordinary memory the runtime stages a copy in
    /// pieces and returns once they are done, each of which may wait behind the upload's
    /// queued copies (a 2,048-token prompt's rows are 4.7 MB for a 7B's Q4_K table).
    host_rows: PinnedBuffer<u8>,
    /// When the last tensor of the upload order first became resident.
    uploaded: Arc<OnceLock<Instant>>,
    /// When the first pass had every weight it waits for in hand.
    first_weights: OnceLock<Instant>,
    /// The paged cache's shape, and the host side of a batch's layout.
    pages: Option<(PageShape, PinnedBuffer<i32>)>,
    /// Which RoPE factors the cache's size takes (Phi-3).
    rope_context: RopeContext,
    /// [`GpuOptions::stop`].
    stop: Option<Arc<AtomicBool>>,
    /// The layers this model computes (the whole model's, unless it is a stage of a
    /// [`LayerSplit`]), and whether it embeds and ends with the logits.
    part: Part,
    /// Split by tensors: this device's parts of each layer's matrices (empty otherwise).
    parts: Vec<shard::LayerParts<shard::PartMatrix>>,
    device: Device,
}

impl GpuModel {
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Logits a position.
    pub fn n_vocab(&self) -> usize {
        self.config.n_vocab
    }

    /// The device cache of the weights (progress, statistics).
    pub fn cache(&self) -> &DeviceCache<HipTarget> {
        &self.cache
    }

    /// When every weight had been uploaded once (not yet: `None`).
    pub fn uploaded_at(&self) -> Option<Instant> {
        self.uploaded.get().copied()
    }

    /// When the first forward pass had in hand the last of the weights it waits for
    /// (no pass yet: `None`). In the background mode a prompt's first token waits for
    /// these weights only, not for the whole upload: the time from this moment to the
    /// first token is the part of the prompt's work the upload did not hide.
    pub fn first_pass_weights_at(&self) -> Option<Instant> {
        self.first_weights.get().copied()
    }

    /// Whether `tensor`, one of the model's, is on the device now.
    pub fn is_resident(&self, tensor: &TensorHandle) -> bool {
        self.cache.is_resident(tensor)
    }

    /// Over budget, a mixture of experts' pools of experts resident by use: what they
    /// have done since the model was built (`None`: every expert is on the device, or
    /// the model has none).
    pub fn expert_stats(&self) -> Option<ExpertStats> {
        self.bufs.experts.as_ref().map(|p| p.stats())
    }

    /// Whether the routed experts run from pools resident by use.
    fn experts_pooled(&self) -> bool {
        self.bufs.experts.is_some()
    }

    /// Positions in the KV cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Most positions the KV cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// How many of the last layers a pass of at most [`HOST_TOKENS`] tokens computes on
    /// the host: those the budget does not hold (zero when it holds every layer, and for
    /// a paged batch, which streams them).
    pub fn host_layers(&self) -> usize {
        self.host
            .as_ref()
            .map_or(0, |h| self.config.n_layers - h.first())
    }

    /// Most tokens of a prompt's chunk.
    pub fn prompt_batch(&self) -> usize {
        self.prompt_batch
    }

    /// Whether a paged batch of one token per sequence, every one asking for logits (a
    /// server's decode step), replays a graph captured for its number of sequences once
    /// every weight is held (the default), or queues its launches one by one. Both run the
    /// same kernels on the same buffers: the results are the same bits.
    pub fn set_batch_graphs(&mut self, on: bool) {
        self.batch_graphs = on;
    }

    /// Forgets every position.
    pub fn clear(&mut self) -> Result<(), ModelError> {
        self.set_position(0)
    }

    /// Waits until every weight is on the device (the eager and background modes' end).
    pub fn wait_loaded(&self) -> Result<(), ModelError> {
        self.cache.wait_idle()?;
        Ok(())
    }

    /// Over budget, a mixture of experts: waits until every slot of its pools of experts
    /// holds one (the passes fill them by use too, without waiting), or the stop request.
    /// Nothing to wait for otherwise.
    pub fn wait_experts_resident(&mut self) -> Result<(), ModelError> {
        while let Some(pools) = self.bufs.experts.as_mut() {
            check_stop(self.stop.as_deref())?;
            if pools.fill()? {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(())
    }

    fn sync(&self) -> Result<(), ModelError> {
        self.stream.synchronize().map_err(gpu("synchronizing"))
    }

    fn set_position(&mut self, len: usize) -> Result<(), ModelError> {
        self.sync().ok();
        self.bufs
            .set_position(&self.stream, &mut self.host_positions, len)?;
        if let Some(host) = &mut self.host {
            host.truncate(len);
        }
        self.len = len;
        Ok(())
    }
}

/// [`ModelError::InvalidGpuOption`] for a setting out of its range.
fn check_tuning(tuning: &GpuTuning) -> Result<(), ModelError> {
    match tuning.host_rows_share {
        Some(share) if !(0.0..=1.0).contains(&share) => Err(ModelError::InvalidGpuOption {
            name: "host_rows_share",
            value: share.to_string(),
            reason: "not a share between 0 and 1",
        }),
        _ => Ok(()),
    }
}

/// [`ModelError::Interrupted`] once `stop` is set: one relaxed load, between layers.
#[inline]
pub(super) fn check_stop(stop: Option<&AtomicBool>) -> Result<(), ModelError> {
    match stop {
        Some(stop) if stop.load(Ordering::Relaxed) => Err(ModelError::Interrupted),
        _ => Ok(()),
    }
}

/// A runtime error of the GPU while doing `op`, as [`ModelError::Gpu`].
fn gpu(op: &'static str) -> impl Fn(HipError) -> ModelError {
    move |source| ModelError::Gpu { op, source }
}

/// The arena of activations and KV cache could not be made: say what and how much.
pub(crate) fn out_of_memory(device: &Device, what: &'static str, requested: u64) -> ModelError {
    let (free, total) = device
        .memory_info()
        .map_or((0, device.total_memory() as u64), |m| {
            (m.free as u64, m.total as u64)
        });
    ModelError::GpuOutOfMemory {
        what,
        requested,
        free,
        total,
    }
}

/// One arena, allocated once.
pub(crate) fn arena(device: &Device, bytes: usize) -> Result<DeviceArena, ModelError> {
    device.new_arena(bytes).map_err(|source| match source {
        HipError::OutOfMemory { .. } => {
            out_of_memory(device, "the activations and the KV cache", bytes as u64)
        }
        other => ModelError::Gpu {
            op: "arena allocation",
            source: other,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_rows_share_outside_0_to_1_is_refused() {
        let with = |share| GpuTuning {
            host_rows_share: share,
            ..GpuTuning::default()
        };
        for share in [None, Some(0.0), Some(0.3), Some(1.0)] {
            assert!(check_tuning(&with(share)).is_ok(), "{share:?}");
        }
        for share in [-0.5, 1.5, f64::NAN] {
            match check_tuning(&with(Some(share))) {
                Err(ModelError::InvalidGpuOption {
                    name: "host_rows_share",
                    ..
                }) => {}
                other => panic!("{share}: {other:?}"),
            }
        }
    }
}
