//! The forward pass on a GPU: the same plan of lazy handles as the CPU path, its weights
//! obtained through [`tensor_store::device::DeviceCache`] (single-flight, raw GGUF
//! blocks, never expanded), multiplied on their blocks by `dequant::gpu::matvec` (a few
//! tokens) or `dequant::gpu::matmul` (a prompt's chunk, on the matrix units), with
//! the layer's other operations in this crate's kernels (`kernels/transformer.hip`).
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

mod forward;
mod host;
mod host_rows;
mod kernels;
mod weights;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use hip_backend::{Device, DeviceArena, DeviceBuffer, Graph, HipError, PinnedBuffer, Stream};
use tensor_store::device::{
    CacheConfig, DeviceCache, HipTarget, StagingRing, UploadMode, UploadOrder,
};
use tensor_store::{StoreError, TensorHandle, TensorStore};

pub use host::HOST_TOKENS;
pub use kernels::{KernelError, ShapeError};

use crate::config::{Experts, ModelConfig};
use crate::plan::ExecutionPlan;
use crate::{Model, ModelError};
use forward::{Buffers, Layout, PageShape, PagedBatch, PagedSegment};
use host::HostLayers;
pub(crate) use weights::check_plan;
use weights::{Held, LayerWeights, RopeContext};

/// Most tokens the decode products and one attention launch take, and the chunk of
/// [`GpuModel::forward_all_logits`]; longer prompts take the batch products.
pub const MAX_BATCH: usize = dequant::gpu::matvec::MAX_TOKENS;
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
    /// A stop request (a Ctrl-C handler's flag, say). Once it is set, the eager upload
    /// and waits for a background upload cancel the uploads, and a forward pass stops at
    /// its next layer (or prompt chunk), all within about 10 ms of the work in hand;
    /// each fails with [`ModelError::Interrupted`]. Looked at with one relaxed load per
    /// layer: nothing measurable per token.
    pub stop: Option<Arc<AtomicBool>>,
    /// Which kernels and allocations the model takes where there is a choice.
    pub tuning: GpuTuning,
}

/// The choices a [`GpuModel`] makes between ways of doing the same work. The defaults
/// are what the engine runs; the others are there to measure or test against them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuTuning {
    /// Whether a prompt's attention may take the matrix units where the device has them
    /// (NVIDIA, compute capability 8.0 and later); `false` takes the f32 kernel AMD runs.
    /// Default `true`.
    pub flash_mma: bool,
    /// Over budget, the device's share of the rows of the host layers' products
    /// (between 0 and 1; 0 leaves every row to the CPU); `None`, the default: the share
    /// the CPU's threads give, so that both finish at about the same time.
    pub host_rows_share: Option<f64>,
    /// How the upload's staging buffers are allocated ([`CacheConfig::staging_ring`]).
    pub staging_ring: StagingRing,
}

impl Default for GpuTuning {
    fn default() -> GpuTuning {
        GpuTuning {
            flash_mma: true,
            host_rows_share: None,
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
    let embd = &plan.token_embd.weight;
    let head = [&plan.output_norm.handle, &plan.output.weight];
    let is_head = |h: &TensorHandle| head.iter().any(|g| g.index() == h.index());
    let layers = plan
        .handles()
        .into_iter()
        .filter(|h| h.index() != embd.index() && !is_head(h));
    if embd.index() == plan.output.weight.index() {
        UploadOrder::by_layer(head.into_iter().chain(layers))
    } else {
        UploadOrder::by_layer(layers.chain(head).chain([embd]))
    }
}

/// A model whose forward pass runs on a GPU, with its KV cache there.
pub struct GpuModel {
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
    /// The decode step, captured once every weight is held.
    step: Option<Graph>,
    /// Paged decode steps (one token of each of `n` sequences, every row's logits, with
    /// the greedy tokens or not), captured once per shape once every weight is held.
    batch_steps: HashMap<(usize, bool), Graph>,
    /// Whether paged decode steps replay captured graphs ([`GpuModel::set_batch_graphs`]).
    batch_graphs: bool,
    /// [`GpuModel::forward_batch_argmax_biased`]'s entries (indices, then the values'
    /// bits), staged and on the device; grown as needed.
    bias_room: Option<(PinnedBuffer<i32>, DeviceBuffer<i32>)>,
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
    device: Device,
}

impl GpuModel {
    /// Opens `options.device`, starts the device cache of `model`'s weights and takes the
    /// arena for activations and the KV cache; prompts run in chunks of [`PROMPT_BATCH`].
    pub fn new(model: &Model, options: &GpuOptions) -> Result<GpuModel, ModelError> {
        GpuModel::with_prompt_batch(model, options, PROMPT_BATCH)
    }

    /// As [`GpuModel::new`], with prompts run in chunks of `prompt_batch` tokens (at
    /// least 1; the arena holds the activations of one chunk, so smaller chunks take less
    /// device memory). A chunk is never longer than the context.
    pub fn with_prompt_batch(
        model: &Model,
        options: &GpuOptions,
        prompt_batch: usize,
    ) -> Result<GpuModel, ModelError> {
        GpuModel::build(model, options, prompt_batch, None)
    }

    /// As [`GpuModel::with_prompt_batch`], with the KV cache also a pool of `pages`'
    /// blocks for [`GpuModel::forward_batch`] (`options.context_size`: the most positions
    /// of one sequence). A batch holds at most `prompt_batch` tokens (at least
    /// [`MAX_BATCH`]), however short the context.
    pub fn with_pages(
        model: &Model,
        options: &GpuOptions,
        prompt_batch: usize,
        pages: PageOptions,
    ) -> Result<GpuModel, ModelError> {
        let bad = |what: String| Err(ModelError::InvalidBatch(what));
        if !pages.block_size.is_power_of_two() {
            return bad(format!(
                "the cache's blocks hold {} positions, not a power of two",
                pages.block_size
            ));
        }
        if pages.n_blocks == 0 || pages.max_sequences == 0 {
            return bad(format!(
                "a paged cache of {} blocks for {} sequences holds nothing",
                pages.n_blocks, pages.max_sequences
            ));
        }
        if pages
            .n_blocks
            .checked_mul(pages.block_size)
            .is_none_or(|p| p > i32::MAX as usize)
        {
            return bad(format!(
                "{} blocks of {} positions are more than a cache row index holds",
                pages.n_blocks, pages.block_size
            ));
        }
        let shape = PageShape {
            n_blocks: pages.n_blocks,
            block_shift: pages.block_size.trailing_zeros(),
            max_sequences: pages.max_sequences,
            table_len: options.context_size.max(1).div_ceil(pages.block_size),
        };
        GpuModel::build(model, options, prompt_batch, Some(shape))
    }

    fn build(
        model: &Model,
        options: &GpuOptions,
        prompt_batch: usize,
        pages: Option<PageShape>,
    ) -> Result<GpuModel, ModelError> {
        if prompt_batch == 0 {
            return Err(ModelError::InvalidPromptBatch {
                tokens: prompt_batch,
            });
        }
        model.check_gpu_support()?;
        check_tuning(&options.tuning)?;
        check_stop(options.stop.as_deref())?;
        let gpu = |op| move |source| ModelError::Gpu { op, source };
        let device = Device::open(options.device).map_err(gpu("device"))?;
        let config = model.config().clone();
        let plan = model.plan().clone();
        let store: &TensorStore = model.store();
        let order = first_use_order(model);
        let model_bytes = HipTarget::arena_bytes_for(order.tensors().iter().map(|t| t.size()));

        // Activations and the KV cache first: their size is known, and failing here
        // costs no upload.
        let capacity = options.context_size.max(1);
        // One sequence's chunk never outgrows its context; a paged batch holds the
        // tokens of many sequences.
        let prompt_batch = if pages.is_some() {
            prompt_batch
        } else {
            prompt_batch.min(capacity)
        };
        // Room for a chunk, and for the few tokens of `forward_all_logits` in one pass.
        let batch_room = prompt_batch.max(MAX_BATCH);
        let bufs = Buffers::new(
            &device,
            &config,
            &plan,
            capacity,
            batch_room,
            pages.as_ref(),
            options.tuning.flash_mma,
        )?;
        // Without a budget, the weights take what the device has left once the
        // activations and the cache are in, less a reserve for the runtime: a model larger
        // than that runs with its first layers held and the rest passing through.
        let budget = match options.budget {
            Some(budget) => budget,
            None => {
                let free = device.memory_info().map_err(gpu("memory info"))?.free as u64;
                free.saturating_sub(RUNTIME_RESERVE).max(1)
            }
        };
        let arena_bytes = budget.min(model_bytes);
        let hold_all = arena_bytes >= model_bytes;
        if let (false, Some(e)) = (hold_all, config.experts) {
            return Err(experts_over_budget(e, model_bytes, arena_bytes));
        }
        // Over budget, the embeddings stay in the file: a pass gathers its few rows on the
        // host, and their room holds more layers (unless they are the output matrix too).
        let embed_on_host =
            !hold_all && plan.token_embd.weight.index() != plan.output.weight.index();
        let order = if embed_on_host {
            let embd = plan.token_embd.weight.index();
            UploadOrder::by_layer(plan.handles().into_iter().filter(|h| h.index() != embd))
        } else {
            order
        };
        // A paged batch streams every layer it does not hold, with room for two so that
        // the next arrives while one runs. One sequence streams only its long chunks, and
        // its decode steps run those layers on the host: every layer held is one the host
        // no longer computes for every token, so it keeps no room for passing layers
        // and lends its last kept layers' to a long chunk.
        let (keep_layers, stream_keep) = match (hold_all, pages.is_some()) {
            (true, _) => (0, 0),
            (false, true) => {
                let keep = layers_to_keep(&order, arena_bytes, 2);
                (keep, keep)
            }
            (false, false) => (
                layers_to_keep(&order, arena_bytes, 0),
                layers_to_keep(&order, arena_bytes, 1),
            ),
        };
        let target = HipTarget::new(&device, arena_bytes.max(1)).map_err(|error| match error {
            StoreError::DeviceAlloc { requested, .. } => {
                out_of_memory(&device, "the weights", requested)
            }
            other => other.into(),
        })?;
        // The pass's stream and page-locked buffers before the upload starts: made while
        // it runs, they would take the runtime's locks from its readers and delay it in
        // the background mode alone.
        let stream = device.new_stream().map_err(gpu("stream"))?;
        let host_tokens = device
            .alloc_pinned::<u32>(batch_room)
            .map_err(gpu("pinned"))?;
        let host_logits = device
            .alloc_pinned::<f32>(bufs.logit_rows() * config.n_vocab)
            .map_err(gpu("pinned"))?;
        let host_positions = device
            .alloc_pinned::<i32>(capacity.div_ceil(prompt_batch).max(1))
            .map_err(gpu("pinned"))?;
        let host_rows = device
            .alloc_pinned::<u8>(batch_room * bufs.row_bytes())
            .map_err(gpu("pinned"))?;
        let cache_config = CacheConfig {
            mode: options.mode,
            budget: (!hold_all).then_some(arena_bytes),
            staging_ring: options.tuning.staging_ring,
            stop: options.stop.clone(),
            ..CacheConfig::default()
        };
        let uploaded = Arc::new(OnceLock::new());
        let mark = Arc::clone(&uploaded);
        let group_names: Vec<String> = order.groups().iter().map(|g| g.name.clone()).collect();
        let cache = DeviceCache::with_progress(target, store, order, cache_config, move |p| {
            if let Some(group) = p.completed_group.and_then(|g| group_names.get(g)) {
                tracing::trace!(group = group.as_str(), "weights resident");
            }
            if p.is_complete() {
                let _ = mark.set(Instant::now());
            }
        })?;
        // One sequence over budget: its decode steps compute the layers that are not held
        // on the host rather than upload them every token.
        if !hold_all {
            tracing::info!(
                budget_mib = arena_bytes >> 20,
                model_mib = model_bytes >> 20,
                held_layers = keep_layers,
                layers = config.n_layers,
                "the weights do not fit the budget: {}",
                if pages.is_none() {
                    "the layers not held run on the host for a few tokens, streamed for more"
                } else {
                    "the layers not held are streamed through the budget every pass"
                }
            );
        }
        let host = if keep_layers < config.n_layers && !hold_all && pages.is_none() {
            Some(HostLayers::new(
                &device,
                &config,
                &plan,
                keep_layers..config.n_layers,
                capacity,
                prompt_batch,
                options,
            )?)
        } else {
            None
        };
        let pages = match pages {
            Some(shape) => {
                let meta = device
                    .alloc_pinned::<i32>(shape.meta_len(batch_room).max(1))
                    .map_err(gpu("pinned"))?;
                Some((shape, meta))
            }
            None => None,
        };
        let mut gpu_model = GpuModel {
            config,
            plan,
            stream,
            cache,
            held: None,
            hold_all,
            embed_on_host,
            keep_layers,
            stream_keep,
            kept: Vec::new(),
            host,
            bufs,
            capacity,
            prompt_batch,
            len: 0,
            step: None,
            batch_steps: HashMap::new(),
            batch_graphs: true,
            bias_room: None,
            host_tokens,
            host_logits,
            host_positions,
            host_rows,
            uploaded,
            first_weights: OnceLock::new(),
            pages,
            rope_context: RopeContext::for_cache(model.config(), capacity),
            stop: options.stop.clone(),
            device,
        };
        // The position and the attention's counters start at zero.
        gpu_model.set_position(0)?;
        Ok(gpu_model)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn device(&self) -> &Device {
        &self.device
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

    /// Appends `tokens` to the KV cache and returns the logits of the last one.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.forward_logits(tokens).map(<[f32]>::to_vec)
    }

    /// As [`GpuModel::forward`], lending the logits from the pinned host buffer.
    pub fn forward_logits(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        self.eval(tokens, Want::Logits)?;
        self.logits(1)
    }

    /// Appends `tokens` and returns the logits of every one of them, `n_vocab` each.
    pub fn forward_all_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let n_vocab = self.config.n_vocab;
        let mut out = Vec::with_capacity(tokens.len() * n_vocab);
        for chunk in tokens.chunks(MAX_BATCH) {
            self.eval(chunk, Want::AllLogits)?;
            out.extend_from_slice(self.logits(chunk.len())?);
        }
        Ok(out)
    }

    /// Appends `tokens` and returns the greedy choice after the last one, taken on the
    /// device (the first highest logit).
    pub fn forward_argmax(&mut self, tokens: &[u32]) -> Result<u32, ModelError> {
        self.eval(tokens, Want::Argmax)?;
        Ok(self.greedy_tokens(1)?[0])
    }

    /// The first `n` greedy tokens copied back by the last call; an error when a row's
    /// logits held a NaN or +inf (the argmax kernel's `u32::MAX`).
    fn greedy_tokens(&self, n: usize) -> Result<&[u32], ModelError> {
        let tokens = &self
            .host_tokens
            .as_slice()
            .map_err(|source| ModelError::Gpu {
                op: "reading the tokens",
                source,
            })?[..n];
        if tokens.contains(&u32::MAX) {
            return Err(ModelError::BadLogits);
        }
        Ok(tokens)
    }

    /// Every token id within the vocabulary.
    fn check_tokens(&self, tokens: &[u32]) -> Result<(), ModelError> {
        match tokens.iter().find(|&&t| t as usize >= self.config.n_vocab) {
            Some(&token) => Err(ModelError::TokenOutOfRange {
                token,
                n_vocab: self.config.n_vocab,
            }),
            None => Ok(()),
        }
    }

    /// Runs the new tokens of several sequences in one pass over the paged cache (see
    /// [`GpuModel::with_pages`]), writing their keys and values into their blocks, and
    /// returns the logits of each segment that asks for them (`n_vocab` each, in the
    /// segments' order). At most `prompt_batch` tokens and `max_sequences` segments;
    /// every table must cover its segment's positions with blocks of the cache.
    pub fn forward_batch(&mut self, segments: &[BatchSegment<'_>]) -> Result<&[f32], ModelError> {
        let m = self.eval_batch(segments, BatchOut::Logits)?;
        self.logits(m)
    }

    /// As [`GpuModel::forward_batch`], returning the greedy token (the first highest
    /// logit, taken on the device) of each segment that asks for logits.
    pub fn forward_batch_argmax(
        &mut self,
        segments: &[BatchSegment<'_>],
    ) -> Result<Vec<u32>, ModelError> {
        let m = self.eval_batch(segments, BatchOut::Tokens)?;
        Ok(self.greedy_tokens(m)?.to_vec())
    }

    /// As [`GpuModel::forward_batch_argmax`], each row's logits first added `biases`
    /// on the device: `(row, token, bias)`, `row` counting the segments that ask for
    /// logits, at most one entry per row and token. The greedy token of each biased row,
    /// the same as adding the biases to [`GpuModel::forward_batch`]'s rows (f32 adds) and
    /// taking their first highest logit; only the tokens come back.
    pub fn forward_batch_argmax_biased(
        &mut self,
        segments: &[BatchSegment<'_>],
        biases: &[(usize, u32, f32)],
    ) -> Result<Vec<u32>, ModelError> {
        if biases.is_empty() {
            return self.forward_batch_argmax(segments);
        }
        let n_vocab = self.config.n_vocab;
        let rows = segments.iter().filter(|s| s.logits).count();
        let mut at: Vec<i32> = Vec::with_capacity(biases.len());
        for &(row, token, _) in biases {
            let index = row * n_vocab + token as usize;
            if row >= rows || token as usize >= n_vocab || index > i32::MAX as usize {
                return Err(ModelError::InvalidBatch(format!(
                    "a bias of token {token} in row {row}, but the batch has {rows} rows of \
                     {n_vocab} logits"
                )));
            }
            at.push(index as i32);
        }
        let mut distinct = at.clone();
        distinct.sort_unstable();
        if distinct.windows(2).any(|w| w[0] == w[1]) {
            return Err(ModelError::InvalidBatch(
                "two biases of one token in one row".into(),
            ));
        }
        let m = self.eval_batch(segments, BatchOut::OnDevice)?;
        let gpu = |op| move |source| ModelError::Gpu { op, source };
        let count = at.len();
        let room = match self.bias_room.take() {
            Some(room) if room.0.len() >= 2 * count => room,
            _ => (
                self.device
                    .alloc_pinned::<i32>(2 * count)
                    .map_err(gpu("pinned"))?,
                self.device.alloc::<i32>(2 * count).map_err(gpu("biases"))?,
            ),
        };
        let (host, device) = self.bias_room.insert(room);
        {
            let staged = host.as_mut_slice().map_err(gpu("writing the biases"))?;
            staged[..count].copy_from_slice(&at);
            for (dst, &(_, _, bias)) in staged[count..2 * count].iter_mut().zip(biases) {
                *dst = bias.to_bits() as i32;
            }
        }
        let view = device.view_mut();
        let view = view.slice_mut(0..2 * count).map_err(gpu("biases"))?;
        self.stream
            .copy_h2d_async(host, 0..2 * count, view)
            .map_err(gpu("copying the biases"))?;
        let entries = device.view();
        let at = entries.slice(0..count).map_err(gpu("biases"))?;
        let values = entries
            .slice(count..2 * count)
            .and_then(|v| v.cast::<f32>())
            .map_err(gpu("biases"))?;
        kernels::add_at(self.bufs.logits_mut(m * n_vocab)?, at, values, &self.stream)?;
        forward::argmax_rows(&self.config, &mut self.bufs, m, &self.stream)?;
        self.copy_rows_back(m, true)?;
        Ok(self.greedy_tokens(m)?.to_vec())
    }

    /// Checks a batch against the cache, lays it out in device memory, runs it and
    /// copies back its logits or greedy tokens, as `out` says: returns how many rows.
    fn eval_batch(
        &mut self,
        segments: &[BatchSegment<'_>],
        out: BatchOut,
    ) -> Result<usize, ModelError> {
        let argmax = out == BatchOut::Tokens;
        let bad = |what: String| Err(ModelError::InvalidBatch(what));
        let Some((shape, _)) = &self.pages else {
            return bad("the model was set up without a paged cache (GpuModel::with_pages)".into());
        };
        let shape = *shape;
        let bs = 1usize << shape.block_shift;
        let n: usize = segments.iter().map(|s| s.tokens.len()).sum();
        let room = self.prompt_batch.max(MAX_BATCH);
        if n == 0 {
            return Err(ModelError::EmptyInput);
        }
        if n > room {
            return bad(format!("{n} tokens, but a batch holds at most {room}"));
        }
        let live = segments.iter().filter(|s| !s.tokens.is_empty()).count();
        if live > shape.max_sequences {
            return bad(format!(
                "{live} sequences, but a batch holds at most {}",
                shape.max_sequences
            ));
        }
        let mut batch = PagedBatch {
            segments: Vec::with_capacity(live),
            n_tokens: n,
            n_logits: 0,
            block_shift: shape.block_shift,
        };
        let (mut positions, mut starts, mut rows, mut tables) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::new(),
            Vec::new(),
        );
        for (i, seg) in segments.iter().enumerate() {
            if seg.tokens.is_empty() {
                continue;
            }
            let end = seg.first_pos + seg.tokens.len();
            if end > self.capacity {
                return Err(ModelError::ContextFull {
                    needed: end,
                    capacity: self.capacity,
                });
            }
            let blocks = end.div_ceil(bs);
            if seg.table.len() < blocks {
                return bad(format!(
                    "sequence {i} reaches position {} but its table holds {} blocks of {bs}",
                    end - 1,
                    seg.table.len()
                ));
            }
            if let Some(&id) = seg.table[..blocks]
                .iter()
                .find(|&&id| id as usize >= shape.n_blocks)
            {
                return bad(format!(
                    "sequence {i}'s table names block {id}, but the cache has {}",
                    shape.n_blocks
                ));
            }
            self.check_tokens(seg.tokens)?;
            let first_row = positions.len();
            batch.segments.push(PagedSegment {
                first_row,
                len: seg.tokens.len(),
                table_at: tables.len(),
                table_len: blocks,
            });
            for p in seg.first_pos..end {
                positions.push(p as i32);
                starts.push(tables.len() as i32);
            }
            if seg.logits {
                rows.push((first_row + seg.tokens.len() - 1) as i32);
            }
            tables.extend(seg.table[..blocks].iter().map(|&id| id as i32));
        }
        batch.n_logits = rows.len();
        // Host-side layout: [positions | table starts | logit rows | tables].
        let meta_len = 2 * n + rows.len() + tables.len();
        let gpu = |op| move |source| ModelError::Gpu { op, source };
        {
            let (_, host_meta) = self.pages.as_mut().expect("checked above");
            let host = host_meta.as_mut_slice().map_err(gpu("writing the batch"))?;
            let parts = [&positions[..], &starts[..], &rows[..], &tables[..]];
            let mut at = 0;
            for part in parts {
                host[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
        }
        let tokens: Vec<u32> = segments
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        self.write_tokens(&tokens)?;
        {
            let (_, host_meta) = self.pages.as_mut().expect("checked above");
            let dst = self.bufs.meta_mut(meta_len)?;
            self.stream
                .copy_h2d_async(host_meta, 0..meta_len, dst)
                .map_err(gpu("copying the batch"))?;
        }
        // A decode step's layout depends on its number of sequences only: the positions,
        // tables and rows are read from device memory, so one graph serves every step of
        // that many sequences.
        let decode_step = self.batch_graphs
            && batch.n_logits == n
            && batch.segments.iter().all(|s| s.len == 1)
            && self.can_hold()?;
        if decode_step {
            self.replay_batch_step(&batch, argmax)?;
        } else {
            self.run_layers(n, Layout::Paged(&batch), End::Rows { argmax })?;
        }
        let m = batch.n_logits;
        if m == 0 {
            return self.sync().map(|()| 0);
        }
        if out != BatchOut::OnDevice {
            self.copy_rows_back(m, argmax)?;
        }
        Ok(m)
    }

    /// The logits copied back by the last call, `n` rows.
    fn logits(&self, n: usize) -> Result<&[f32], ModelError> {
        let all = self
            .host_logits
            .as_slice()
            .map_err(|source| ModelError::Gpu {
                op: "reading the logits",
                source,
            })?;
        Ok(&all[..n * self.config.n_vocab])
    }

    /// Runs `tokens` (in chunks of the prompt batch) after the positions already cached and
    /// leaves what `want` asks for in the pinned host buffers, the copy finished.
    fn eval(&mut self, tokens: &[u32], want: Want) -> Result<(), ModelError> {
        if tokens.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        let needed = self.len + tokens.len();
        if needed > self.capacity {
            return Err(ModelError::ContextFull {
                needed,
                capacity: self.capacity,
            });
        }
        if want == Want::AllLogits && tokens.len() > MAX_BATCH {
            return Err(ModelError::EmptyInput);
        }
        self.check_tokens(tokens)?;
        let start = self.len;
        let result = self.run_chunks(tokens, want);
        tracing::trace!(tokens = tokens.len(), "a pass's results in hand");
        if result.is_err() {
            // Leave the cache as it was before the failed call.
            self.set_position(start)?;
        }
        result
    }

    fn run_chunks(&mut self, tokens: &[u32], want: Want) -> Result<(), ModelError> {
        // Every token's logits come from one pass (`eval` keeps those calls to
        // MAX_BATCH tokens, which the buffers always hold).
        let chunk_len = if want == Want::AllLogits {
            tokens.len()
        } else {
            self.prompt_batch
        };
        if tokens.len() > chunk_len
            && want != Want::AllLogits
            && self.still_arriving()
            && self.run_by_layer(tokens, chunk_len, want)?
        {
            return Ok(());
        }
        let chunks: Vec<&[u32]> = tokens.chunks(chunk_len).collect();
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            check_stop(self.stop.as_deref())?;
            self.write_tokens(chunk)?;
            let output = if i == last { want } else { Want::Logits };
            let wants_output = i == last;
            if chunk.len() == 1 && wants_output && self.ensure_held()? {
                self.replay_step()?;
            } else {
                self.run_direct(chunk.len(), output)?;
            }
            self.len += chunk.len();
            if wants_output {
                self.copy_back(chunk.len(), want)?;
            }
        }
        Ok(())
    }

    /// Whether the weights are still being uploaded into a budget that holds them all,
    /// with every layer on the device.
    fn still_arriving(&self) -> bool {
        self.hold_all && self.held.is_none() && self.host.is_none() && !self.all_resident()
    }

    /// A prompt of several chunks while its weights still arrive: each layer, once
    /// resident, runs every chunk before the next layer is waited for (a chunk's
    /// attention needs only the keys and values of the chunks before it, which that layer
    /// has just written). Run chunk by chunk instead, every chunk after the first would
    /// wait for the whole upload and then run all the layers: the prompt's work would
    /// not hide under the upload. The residual streams of the chunks wait in a device
    /// buffer of the whole prompt, taken for this pass only; without room for it, this
    /// returns false having run nothing.
    fn run_by_layer(
        &mut self,
        tokens: &[u32],
        chunk_len: usize,
        want: Want,
    ) -> Result<bool, ModelError> {
        let d = self.config.n_embd;
        let n_chunks = tokens.len().div_ceil(chunk_len);
        // Without room for them, the prompt runs chunk by chunk.
        let (Ok(mut streams), Ok(mut firsts)) = (
            self.device.alloc::<f32>(tokens.len() * d),
            self.device.alloc::<i32>(n_chunks),
        ) else {
            tracing::debug!(
                tokens = tokens.len(),
                "no room for the prompt's residual streams"
            );
            return Ok(false);
        };
        let result = self.layers_over_chunks(tokens, chunk_len, &mut streams, &mut firsts);
        // Whatever happened, nothing may still use the buffers when they are freed.
        let done = self.sync();
        result?;
        done?;
        let n_last = tokens.len() - (n_chunks - 1) * chunk_len;
        self.copy_back(n_last, want)?;
        Ok(true)
    }

    fn layers_over_chunks(
        &mut self,
        tokens: &[u32],
        chunk_len: usize,
        streams: &mut DeviceBuffer<f32>,
        firsts: &mut DeviceBuffer<i32>,
    ) -> Result<(), ModelError> {
        let gpu = |op| move |source| ModelError::Gpu { op, source };
        let d = self.config.n_embd;
        let chunks: Vec<&[u32]> = tokens.chunks(chunk_len).collect();
        let start = self.len;
        let positions: Vec<i32> = (0..chunks.len())
            .map(|c| i32::try_from(start + c * chunk_len).unwrap_or(i32::MAX))
            .collect();
        if self.host_positions.len() < positions.len() {
            self.host_positions = self
                .device
                .alloc_pinned::<i32>(positions.len())
                .map_err(gpu("pinned"))?;
        }
        self.stream
            .write_staged(&mut self.host_positions, &positions, firsts.view_mut())
            .map_err(gpu("positions"))?;
        let at = |c: usize, n: usize| c * chunk_len * d..(c * chunk_len + n) * d;
        let on_host_embed = self.embeds_on_host(true);
        // Embeddings made on the host need nothing on the device: they are made while the
        // shared weights arrive, which are asked for after them.
        let on_device = if on_host_embed {
            None
        } else {
            Some(weights::Globals::fetch(&self.cache, &self.plan, true)?)
        };
        for (c, chunk) in chunks.iter().enumerate() {
            self.write_tokens(chunk)?;
            let (config, bufs, stream) = (&self.config, &mut self.bufs, &self.stream);
            match &on_device {
                Some(globals) => forward::embed(config, globals, bufs, chunk.len(), stream)?,
                None => {
                    embed_from_file(config, &self.plan, chunk, bufs, &mut self.host_rows, stream)?
                }
            }
            let dst = streams
                .view_mut()
                .slice_mut(at(c, chunk.len()))
                .map_err(gpu("residual"))?;
            stream
                .copy_d2d_async(bufs.x_view(chunk.len() * d)?, dst)
                .map_err(gpu("residual"))?;
        }
        let globals = match on_device {
            Some(globals) => Some(globals),
            None if self.head_after_layers(on_host_embed) => None,
            None => Some(weights::Globals::fetch(&self.cache, &self.plan, false)?),
        };
        tracing::trace!(
            chunks = chunks.len(),
            on_host_embed,
            "a prompt's embeddings queued"
        );
        for layer_idx in 0..self.plan.layers.len() {
            check_stop(self.stop.as_deref())?;
            let layer = &self.plan.layers[layer_idx];
            let weights = LayerWeights::fetch(&self.cache, layer, self.rope_context)?;
            tracing::trace!(layer = layer_idx, "a prompt's layer queued over its chunks");
            let (config, bufs, stream) = (&self.config, &mut self.bufs, &self.stream);
            for (c, chunk) in chunks.iter().enumerate() {
                let n = chunk.len();
                let first = firsts.view().slice(c..c + 1).map_err(gpu("positions"))?;
                stream
                    .copy_d2d_async(first, bufs.pos_mut()?)
                    .map_err(gpu("positions"))?;
                let x = streams.view().slice(at(c, n)).map_err(gpu("residual"))?;
                stream
                    .copy_d2d_async(x, bufs.x_mut(n * d)?)
                    .map_err(gpu("residual"))?;
                forward::layer(
                    config,
                    layer_idx,
                    &weights,
                    bufs,
                    n,
                    Layout::Contiguous,
                    stream,
                )?;
                let x = streams
                    .view_mut()
                    .slice_mut(at(c, n))
                    .map_err(gpu("residual"))?;
                stream
                    .copy_d2d_async(bufs.x_view(n * d)?, x)
                    .map_err(gpu("residual"))?;
            }
            self.load_head_while_waiting(layer_idx, globals.is_none(), true)?;
        }
        let globals = self.globals_after_layers(globals)?;
        self.first_weights.get_or_init(Instant::now);
        // The last chunk's stream is still in `x`: its logits, and the position past it.
        let last = chunks.len() - 1;
        let n = chunks[last].len();
        let (config, bufs, stream) = (&self.config, &mut self.bufs, &self.stream);
        let first = firsts
            .view()
            .slice(last..last + 1)
            .map_err(gpu("positions"))?;
        stream
            .copy_d2d_async(first, bufs.pos_mut()?)
            .map_err(gpu("positions"))?;
        forward::finish(config, &globals, bufs, n, true, stream)?;
        forward::tail(config, bufs, n, true, stream)?;
        self.len += tokens.len();
        Ok(())
    }

    fn write_tokens(&mut self, chunk: &[u32]) -> Result<(), ModelError> {
        let gpu = |source| ModelError::Gpu {
            op: "copying tokens",
            source,
        };
        self.host_tokens.as_mut_slice().map_err(gpu)?[..chunk.len()].copy_from_slice(chunk);
        let dst = self.bufs.tokens_mut(chunk.len())?;
        self.stream
            .copy_h2d_async(&mut self.host_tokens, 0..chunk.len(), dst)
            .map_err(gpu)
    }

    fn copy_back(&mut self, n: usize, want: Want) -> Result<(), ModelError> {
        match want {
            Want::Argmax => self.copy_rows_back(1, true),
            Want::Logits => self.copy_rows_back(1, false),
            Want::AllLogits => self.copy_rows_back(n, false),
        }
    }

    /// Copies the first `rows` greedy tokens (`tokens`) or rows of logits to the pinned
    /// host buffers, and waits for them.
    fn copy_rows_back(&mut self, rows: usize, tokens: bool) -> Result<(), ModelError> {
        let gpu = |source| ModelError::Gpu {
            op: "copying results",
            source,
        };
        if tokens {
            let src = self.bufs.tokens_view(rows)?;
            self.stream
                .copy_d2h_async(src, &mut self.host_tokens, 0..rows)
                .map_err(gpu)?;
            self.host_tokens.wait().map_err(gpu)
        } else {
            let len = rows * self.config.n_vocab;
            let src = self.bufs.logits_view(len)?;
            self.stream
                .copy_d2h_async(src, &mut self.host_logits, 0..len)
                .map_err(gpu)?;
            self.host_logits.wait().map_err(gpu)
        }
    }

    /// Pins every weight once the budget allows it; true when all are held.
    fn ensure_held(&mut self) -> Result<bool, ModelError> {
        if self.held.is_none() && self.hold_all {
            self.held = Some(Held::fetch(&self.cache, &self.plan, self.rope_context)?);
        }
        if self.held.is_some() {
            self.first_weights.get_or_init(Instant::now);
        }
        Ok(self.held.is_some())
    }

    /// One token through the captured step (capturing it the first time).
    fn replay_step(&mut self) -> Result<(), ModelError> {
        if self.step.is_none() {
            let held = self.held.as_ref().expect("ensure_held returned true");
            let (config, bufs) = (&self.config, &mut self.bufs);
            let graph = self.stream.capture(|stream| {
                forward::step(config, held.layers(), held.globals(), bufs, 1, true, stream)
            })?;
            self.step = Some(graph);
        }
        let graph = self.step.as_ref().expect("captured just above");
        graph
            .launch(&self.stream)
            .map_err(|source| ModelError::Gpu {
                op: "replaying the decode step",
                source,
            })
    }

    /// Whether every weight is held, or can be now: all resident in a budget that holds
    /// them (pins them if so).
    fn can_hold(&mut self) -> Result<bool, ModelError> {
        if self.held.is_some() || (self.hold_all && self.all_resident()) {
            return self.ensure_held();
        }
        Ok(false)
    }

    /// A paged decode step (`batch`: one token of each sequence, every row's logits)
    /// through the graph captured for its number of sequences (capturing it the first
    /// time).
    fn replay_batch_step(&mut self, batch: &PagedBatch, argmax: bool) -> Result<(), ModelError> {
        let key = (batch.n_tokens, argmax);
        if !self.batch_steps.contains_key(&key) {
            let held = self.held.as_ref().expect("can_hold returned true");
            let (config, bufs) = (&self.config, &mut self.bufs);
            let graph = self.stream.capture(|stream| {
                let n = batch.n_tokens;
                let layout = Layout::Paged(batch);
                let globals = held.globals();
                forward::body(
                    config,
                    held.layers(),
                    globals,
                    bufs,
                    n,
                    layout,
                    stream,
                    None,
                )?;
                forward::finish_rows(config, globals, bufs, batch, argmax, stream)
            })?;
            self.batch_steps.insert(key, graph);
        }
        self.batch_steps[&key]
            .launch(&self.stream)
            .map_err(|source| ModelError::Gpu {
                op: "replaying a batch's decode step",
                source,
            })
    }

    /// `n` tokens through launches queued one by one; `last_only` computes the logits of
    /// the last token only.
    fn run_direct(&mut self, n: usize, want: Want) -> Result<(), ModelError> {
        let last_only = want != Want::AllLogits;
        self.run_layers(n, Layout::Contiguous, End::Last { last_only })
    }

    /// `n` tokens laid out as `layout` through launches queued one by one, ending as
    /// `end` says.
    fn run_layers(&mut self, n: usize, layout: Layout<'_>, end: End) -> Result<(), ModelError> {
        let finish = |config: &ModelConfig,
                      globals: &weights::Globals,
                      bufs: &mut Buffers,
                      stream: &Stream| match end {
            End::Last { last_only } => {
                forward::finish(config, globals, bufs, n, last_only, stream)?;
                forward::tail(config, bufs, n, last_only, stream)
            }
            End::Rows { argmax } => {
                let Layout::Paged(batch) = layout else {
                    unreachable!("rows of logits are a paged batch's")
                };
                forward::finish_rows(config, globals, bufs, batch, argmax, stream)
            }
        };
        if self.can_hold()? {
            self.first_weights.get_or_init(Instant::now);
            let held = self.held.as_ref().expect("can_hold returned true");
            let (config, bufs, stream) = (&self.config, &mut self.bufs, &self.stream);
            forward::body(
                config,
                held.layers(),
                held.globals(),
                bufs,
                n,
                layout,
                stream,
                self.stop.as_deref(),
            )?;
            return finish(config, held.globals(), bufs, stream);
        }
        // Layer by layer: each layer's tensors are asked for (waiting for that layer
        // only) and released once its work has run, except the first `keep_layers` of a
        // model larger than its budget, held from their first use on so that only the
        // others pass through the cache again every pass.
        //
        // Over budget, a pass of a few tokens of one sequence runs the layers that are
        // not held on the host instead (`host.rs`); a longer one streams them, once the
        // device has the keys and values the host computed.
        let first_pos = self.len;
        let on_host = match (&mut self.host, layout) {
            (Some(host), Layout::Contiguous) if n <= HOST_TOKENS => Some(host.first()),
            (Some(host), _) => {
                host.before_device_pass(&mut self.bufs, &self.stream, first_pos)?;
                None
            }
            (None, _) => None,
        };
        let device_layers = on_host.unwrap_or(self.plan.layers.len());
        let keep = if on_host.is_some() {
            self.keep_layers
        } else {
            // The layers let go of are no longer in use: every pass ends synchronized.
            self.kept.truncate(self.stream_keep);
            self.stream_keep
        };
        let on_host_embed = self.embeds_on_host(matches!(layout, Layout::Contiguous));
        if on_host_embed {
            // Before the shared weights are asked for: the host's embeddings need nothing
            // on the device, and are made while those arrive.
            // The tokens of this pass are the first `n` the host staged.
            let tokens = self
                .host_tokens
                .as_slice()
                .map_err(|source| ModelError::Gpu {
                    op: "reading the tokens",
                    source,
                })?;
            let (config, plan, bufs) = (&self.config, &self.plan, &mut self.bufs);
            let host_rows = &mut self.host_rows;
            embed_from_file(config, plan, &tokens[..n], bufs, host_rows, &self.stream)?;
        }
        let globals = if self.head_after_layers(on_host_embed) {
            None
        } else {
            let globals = weights::Globals::fetch(&self.cache, &self.plan, !on_host_embed)?;
            if !on_host_embed {
                forward::embed(&self.config, &globals, &mut self.bufs, n, &self.stream)?;
            }
            Some(globals)
        };
        tracing::trace!(n, on_host_embed, "a pass's embeddings queued");
        for layer_idx in 0..device_layers {
            if let Err(stopped) = check_stop(self.stop.as_deref()) {
                // `globals` is released on return: its readers must have finished.
                self.sync().ok();
                return Err(stopped);
            }
            let kept = layer_idx < keep;
            if kept && layer_idx == self.kept.len() {
                let layer = &self.plan.layers[layer_idx];
                self.kept
                    .push(LayerWeights::fetch(&self.cache, layer, self.rope_context)?);
            }
            let fetched;
            let layer = if kept {
                &self.kept[layer_idx]
            } else {
                let layer = &self.plan.layers[layer_idx];
                fetched = LayerWeights::fetch(&self.cache, layer, self.rope_context)?;
                &fetched
            };
            tracing::trace!(layer = layer_idx, "a pass's layer queued");
            forward::layer(
                &self.config,
                layer_idx,
                layer,
                &mut self.bufs,
                n,
                layout,
                &self.stream,
            )?;
            let last_only = matches!(end, End::Last { last_only: true });
            self.load_head_while_waiting(layer_idx, globals.is_none(), last_only)?;
            if !self.hold_all && !kept {
                // The cache may evict these tensors once dropped: their readers must
                // have finished.
                self.sync()?;
            }
        }
        if let Some(host) = &mut self.host {
            if on_host.is_some() {
                let (config, plan) = (&self.config, &self.plan);
                host.run(config, plan, &mut self.bufs, &self.stream, first_pos, n)?;
            } else {
                host.after_device_pass(first_pos + n);
            }
        }
        let globals = self.globals_after_layers(globals)?;
        self.first_weights.get_or_init(Instant::now);
        finish(&self.config, &globals, &mut self.bufs, &self.stream)?;
        if !self.hold_all {
            // `globals` is released on return: its readers must have finished.
            self.sync()?;
        }
        Ok(())
    }

    /// Whether a pass gathers its embeddings on the host: always over budget, where they
    /// stay in the file; and for a pass of one sequence (`single`) while they are still
    /// on their way, the last tensors uploaded ([`first_use_order`]), unless they are the
    /// output matrix too, which every pass waits for.
    fn embeds_on_host(&self, single: bool) -> bool {
        let embd = &self.plan.token_embd.weight;
        self.embed_on_host
            || (single
                && self.hold_all
                && embd.index() != self.plan.output.weight.index()
                && !self.cache.is_resident(embd))
    }

    /// Whether a pass asks for the final norm and the output matrix only after queuing
    /// its layers: with every weight held and its embeddings made from the file, since
    /// those tensors arrive after the layers ([`first_use_order`]). Otherwise it asks for
    /// them first: its embeddings on the device are in hand (and so is every weight), or
    /// over budget, as the cache's room was planned.
    fn head_after_layers(&self, on_host_embed: bool) -> bool {
        on_host_embed && self.hold_all
    }

    /// The shared weights a pass asked for before its layers, or, when it did not
    /// ([`GpuModel::head_after_layers`]), the final norm and the output matrix now.
    fn globals_after_layers(
        &self,
        early: Option<weights::Globals>,
    ) -> Result<weights::Globals, ModelError> {
        match early {
            Some(globals) => Ok(globals),
            None => weights::Globals::fetch(&self.cache, &self.plan, false),
        }
    }

    /// For a pass that asks for the output matrix after its layers and takes the logits
    /// of its last token only: once its first layer is queued, the code of that product
    /// is loaded, while the pass waits for its other layers. Otherwise the runtime loads
    /// it at the product's first launch, after the matrix lands, on the way to the first
    /// token (about a millisecond on an H100: a weight type's decode products are a
    /// module of their own, which no layer of a prompt may have used).
    fn load_head_while_waiting(
        &self,
        layer_idx: usize,
        head_after_layers: bool,
        last_only: bool,
    ) -> Result<(), ModelError> {
        if head_after_layers && last_only && layer_idx == 0 {
            forward::load_last_token_head(&self.plan, &self.stream)?;
            tracing::trace!("the output product's code loaded");
        }
        Ok(())
    }

    fn all_resident(&self) -> bool {
        self.plan
            .handles()
            .iter()
            .all(|h| self.cache.is_resident(h))
    }

    fn sync(&self) -> Result<(), ModelError> {
        self.stream.synchronize().map_err(|source| ModelError::Gpu {
            op: "synchronizing",
            source,
        })
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

/// What a paged batch leaves: its rows of logits copied back, its greedy tokens copied
/// back, or its logits on the device (for more work there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BatchOut {
    Logits,
    Tokens,
    OnDevice,
}

/// How a forward pass ends: the logits (and greedy token) of one sequence's last token or
/// of all its tokens, or the logit rows of a paged batch.
#[derive(Clone, Copy)]
enum End {
    Last { last_only: bool },
    Rows { argmax: bool },
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

/// The embeddings of `tokens` from the mapped file (the embeddings not on the device):
/// their rows' blocks gathered on the host, copied to the device, and decoded there into
/// `x` by the same decoders as [`forward::embed`]'s (whose results are the CPU's, bit for
/// bit). The blocks are a fraction of the decoded rows' bytes (a ninth for Q4_K), and the
/// host does no decoding while it feeds the upload.
fn embed_from_file(
    config: &ModelConfig,
    plan: &ExecutionPlan,
    tokens: &[u32],
    bufs: &mut Buffers,
    host_rows: &mut PinnedBuffer<u8>,
    stream: &Stream,
) -> Result<(), ModelError> {
    let gpu = |source| ModelError::Gpu {
        op: "copying the embeddings",
        source,
    };
    let table = &plan.token_embd.weight;
    let row_bytes = bufs.row_bytes();
    let bytes = table.bytes()?;
    let len = tokens.len() * row_bytes;
    // Waits for the copy of the rows gathered before, if it may still run.
    let capacity = host_rows.len();
    let staged = host_rows.as_mut_slice().map_err(gpu)?;
    let staged = staged.get_mut(..len).ok_or(ModelError::Gpu {
        op: "copying the embeddings",
        source: hip_backend::HipError::LengthMismatch {
            op: "staging embedding rows",
            src: len,
            dst: capacity,
        },
    })?;
    for (&token, dst) in tokens.iter().zip(staged.chunks_exact_mut(row_bytes)) {
        let id = token as usize;
        let row = bytes
            .get(id * row_bytes..(id + 1) * row_bytes)
            .filter(|_| id < config.n_vocab)
            .ok_or(ModelError::TokenOutOfRange {
                token,
                n_vocab: config.n_vocab,
            })?;
        dst.copy_from_slice(row);
    }
    let dst = bufs.raw_rows_mut(tokens.len())?;
    stream.copy_h2d_async(host_rows, 0..len, dst).map_err(gpu)?;
    forward::decode_embeddings(
        config,
        table.ggml_type(),
        table.name(),
        bufs,
        tokens.len(),
        stream,
    )
}

/// Refuses a mixture of experts whose weights do not all fit on `device` (its free
/// memory less [`RUNTIME_RESERVE`], or `budget` bytes): the GPU runs experts only when
/// every one is resident, where a dense model over its budget runs its other layers on
/// the host or streams them. [`GpuModel::new`] decides the same once the activations are
/// placed; this check, before anything is allocated, lets a caller choose the CPU instead.
pub fn check_experts_fit(
    model: &Model,
    device: &Device,
    budget: Option<u64>,
) -> Result<(), ModelError> {
    let Some(experts) = model.config().experts else {
        return Ok(());
    };
    let order = first_use_order(model);
    let model_bytes = HipTarget::arena_bytes_for(order.tensors().iter().map(|t| t.size()));
    let room = match budget {
        Some(budget) => budget,
        None => {
            let info = device.memory_info().map_err(|source| ModelError::Gpu {
                op: "memory info",
                source,
            })?;
            (info.free as u64).saturating_sub(RUNTIME_RESERVE)
        }
    };
    if model_bytes > room {
        return Err(experts_over_budget(experts, model_bytes, room));
    }
    Ok(())
}

fn experts_over_budget(experts: Experts, model_bytes: u64, room: u64) -> ModelError {
    ModelError::GpuUnsupported {
        what: format!(
            "a mixture of experts ({} experts, {} MiB) over a GPU budget of {} MiB",
            experts.count,
            model_bytes >> 20,
            room >> 20
        ),
        supported: "mixtures of experts whose weights all fit the GPU budget".to_owned(),
    }
}

/// How many of the first layers of `order` (its `blk.N` groups, in layer order) stay
/// resident within `budget` device bytes, leaving room for the tensors outside the
/// layers and for `passing` more layers to pass through (two: the one running and the
/// next arriving; none: the pass frees room first), with a margin for the arena's
/// alignment.
fn layers_to_keep(order: &UploadOrder, budget: u64, passing: u64) -> usize {
    let bytes = |group: &tensor_store::device::UploadGroup| -> u64 {
        order.tensors()[group.tensors.clone()]
            .iter()
            .map(|t| t.size())
            .sum()
    };
    let (layers, shared): (Vec<_>, Vec<_>) = order
        .groups()
        .iter()
        .partition(|g| g.name.starts_with("blk."));
    let per_layer: Vec<u64> = layers.into_iter().map(bytes).collect();
    let shared: u64 = shared.into_iter().map(bytes).sum();
    let largest = per_layer.iter().copied().max().unwrap_or(0);
    let mut room = (budget - budget / 32).saturating_sub(shared + passing * largest);
    per_layer
        .iter()
        .take_while(|&&bytes| {
            let fits = bytes <= room;
            room = room.saturating_sub(bytes);
            fits
        })
        .count()
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
