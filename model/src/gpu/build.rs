//! Building a [`GpuModel`]: the device, the arena of activations and KV cache, the
//! weights' budget (which layers stay resident, which run on the host or pass through)
//! and the device cache that uploads them.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use hip_backend::{Device, PinnedBuffer};
use tensor_store::device::{CacheConfig, DeviceCache, HipTarget, UploadOrder};
use tensor_store::{StoreError, TensorStore};

use super::expert_pool::{self, ExpertPools};
use super::forward::{Buffers, PageShape};
use super::host::HostLayers;
use super::weights::RopeContext;
use super::{
    check_stop, check_tuning, out_of_memory, use_order, GpuModel, GpuOptions, PageOptions, Part,
    MAX_BATCH, PROMPT_BATCH, RUNTIME_RESERVE,
};
use crate::config::{Experts, ModelConfig};
use crate::plan::ExecutionPlan;
use crate::{Model, ModelError};

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
        let whole = Part::whole(model.config().n_layers);
        GpuModel::build(model, options, prompt_batch, None, whole)
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
        let shape = GpuModel::page_shape(options, pages)?;
        let whole = Part::whole(model.config().n_layers);
        GpuModel::build(model, options, prompt_batch, Some(shape), whole)
    }

    /// The paged cache's shape `pages` asks for, checked.
    pub(super) fn page_shape(
        options: &GpuOptions,
        pages: PageOptions,
    ) -> Result<PageShape, ModelError> {
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
        Ok(PageShape {
            n_blocks: pages.n_blocks,
            block_shift: pages.block_size.trailing_zeros(),
            max_sequences: pages.max_sequences,
            table_len: options.context_size.max(1).div_ceil(pages.block_size),
        })
    }

    /// The models that compute each of `parts` of `model`, each on its `options.device`,
    /// built at once on a thread each (a device's runtime context, its buffers and its
    /// upload start together); the first failure once all have finished.
    pub(super) fn build_each(
        model: &Model,
        parts: Vec<(GpuOptions, Part)>,
        prompt_batch: usize,
        pages: Option<PageShape>,
    ) -> Result<Vec<GpuModel>, ModelError> {
        let built: Vec<Result<GpuModel, ModelError>> = std::thread::scope(|scope| {
            let threads: Vec<_> = parts
                .into_iter()
                .map(|(options, part)| {
                    scope.spawn(move || GpuModel::build(model, &options, prompt_batch, pages, part))
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        });
        built.into_iter().collect()
    }

    /// The model that computes `part` of `model` on `options.device`: the whole model, or
    /// one stage of a [`LayerSplit`](super::LayerSplit), which takes only its layers'
    /// weights (and the embeddings or the head where it has them) and its layers' cache.
    pub(super) fn build(
        model: &Model,
        options: &GpuOptions,
        prompt_batch: usize,
        pages: Option<PageShape>,
        part: Part,
    ) -> Result<GpuModel, ModelError> {
        if prompt_batch == 0 {
            return Err(ModelError::InvalidPromptBatch {
                tokens: prompt_batch,
            });
        }
        model.check_gpu_support()?;
        options
            .kv_types
            .check(model.config(), crate::AttentionMethod::Flash)?;
        check_tuning(&options.tuning)?;
        check_stop(options.stop.as_deref())?;
        let gpu = |op| move |source| ModelError::Gpu { op, source };
        let device = Device::open(options.device).map_err(gpu("device"))?;
        let (config, plan) = part.narrow(model.config(), model.plan());
        let store: &TensorStore = model.store();
        let order = use_order(&config, &plan, &part);
        // Split by tensors, the device's parts of the matrices it cuts come on top.
        let part_sizes = part
            .shard
            .as_ref()
            .map(|s| s.sizes(&config, &plan))
            .unwrap_or_default();
        let model_bytes =
            HipTarget::arena_bytes_for(order.tensors().iter().map(|t| t.size()).chain(part_sizes));

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
            options.tuning.warp_attention,
            options.tuning.int8_prompts,
            options.kv_types,
        )?;
        let residency = Residency::plan(
            &device,
            options,
            &config,
            &plan,
            order,
            model_bytes,
            pages.is_some(),
        )?;
        let Residency {
            arena_bytes,
            hold_all,
            embed_on_host,
            order,
            keep_layers,
            stream_keep,
            pool_slots,
        } = residency;
        let whole = part.is_whole(model.config().n_layers);
        if !whole && (!hold_all || pool_slots.is_some()) {
            let share = match &part.shard {
                Some(shard) => format!(
                    "share {} of {} of a split by tensors",
                    shard.rank + 1,
                    shard.ranks
                ),
                None => format!(
                    "layers {}..{} of a layer split",
                    part.layers.start, part.layers.end
                ),
            };
            return Err(ModelError::GpuUnsupported {
                what: format!(
                    "{share}, {} MiB of weights, over GPU {}'s budget of {} MiB",
                    model_bytes >> 20,
                    options.device,
                    arena_bytes >> 20
                ),
                supported: "a split whose every device holds its layers (more devices, other \
                            split ratios, or a larger budget)"
                    .into(),
            });
        }
        let mut bufs = bufs;
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
        let staged = Staged::alloc(&device, &config, &bufs, capacity, prompt_batch, batch_room)?;
        let budget = (!hold_all).then_some(arena_bytes);
        let (cache, uploaded) = start_cache(target, store, order, options, budget)?;
        let parts = match &part.shard {
            Some(shard) => shard.upload(&config, &plan, &cache)?,
            None => Vec::new(),
        };
        if let Some(slots) = pool_slots {
            let link_slots = expert_pool::link_slots(slots, options.tuning.expert_link_slots);
            tracing::info!(
                weights_mib = arena_bytes >> 20,
                model_mib = model_bytes >> 20,
                slots,
                link_slots,
                experts = config.experts.map_or(0, |e| e.count),
                "a mixture of experts over its budget: every weight but the routed experts \
                 on the device, and a pool of experts a layer resident by use (of its slots, \
                 the link slots take missed experts over the link)"
            );
            bufs.experts = Some(ExpertPools::new(
                &device,
                &plan,
                slots,
                link_slots,
                options.tuning.experts_in_place,
                batch_room,
                config.n_embd,
            )?);
        }
        // One sequence over budget: its decode steps compute the layers that are not held
        // on the host rather than upload them every token.
        if !hold_all {
            report_over_budget(
                arena_bytes,
                model_bytes,
                keep_layers,
                &config,
                pages.is_some(),
            );
        }
        let host = if keep_layers < config.n_layers && !hold_all && pages.is_none() {
            // The host layers' keys cross between the sides as f16.
            if options.kv_types.is_quantized() {
                return Err(ModelError::GpuUnsupported {
                    what: format!(
                        "a {}/{} KV cache with layers {}..{} over the weights' budget \
                         computed on the host",
                        options.kv_types.k, options.kv_types.v, keep_layers, config.n_layers
                    ),
                    supported: "an f16 cache over budget, or a quantized cache with every \
                                layer on the device"
                        .into(),
                });
            }
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
        let pages = page_meta(&device, pages, batch_room)?;
        let Staged {
            host_tokens,
            host_logits,
            host_positions,
            host_rows,
        } = staged;
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
            extras_room: None,
            host_tokens,
            host_logits,
            host_positions,
            host_rows,
            uploaded,
            first_weights: OnceLock::new(),
            pages,
            rope_context: RopeContext::for_cache(model.config(), capacity),
            stop: options.stop.clone(),
            part,
            parts,
            device,
        };
        // The position and the attention's counters start at zero.
        gpu_model.set_position(0)?;
        Ok(gpu_model)
    }
}

/// How a model's weights sit in their budget: the bytes of the weights' arena, whether
/// it holds them all, whether the embeddings stay in the file, the order of the upload,
/// and how many of the first layers stay resident (for one pass and for a pass that
/// streams the others).
struct Residency {
    arena_bytes: u64,
    hold_all: bool,
    embed_on_host: bool,
    order: UploadOrder,
    keep_layers: usize,
    stream_keep: usize,
    /// A mixture of experts over its budget: the slots of each layer's pool of experts
    /// (the cache then holds every other weight).
    pool_slots: Option<usize>,
}

impl Residency {
    /// The weights' budget on `device` (`options.budget`, or what the device has free
    /// once the activations and the cache are in) and what it holds of a model of
    /// `model_bytes` uploaded in `order`; `paged`: the model runs paged batches.
    fn plan(
        device: &Device,
        options: &GpuOptions,
        config: &ModelConfig,
        plan: &ExecutionPlan,
        order: UploadOrder,
        model_bytes: u64,
        paged: bool,
    ) -> Result<Residency, ModelError> {
        let gpu = |op| move |source| ModelError::Gpu { op, source };
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
            let fit = PoolFit::of(plan, &order, e, budget)?;
            return Ok(Residency {
                arena_bytes: fit.other_bytes,
                hold_all: true,
                embed_on_host: false,
                order: fit.order,
                keep_layers: 0,
                stream_keep: 0,
                pool_slots: Some(fit.slots),
            });
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
        let (keep_layers, stream_keep) = match (hold_all, paged) {
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
        Ok(Residency {
            arena_bytes,
            hold_all,
            embed_on_host,
            order,
            keep_layers,
            stream_keep,
            pool_slots: None,
        })
    }
}

/// How a mixture of experts over its budget sits in it: every weight but the routed
/// experts' matrices (`order`, `other_bytes` of the device cache) and the slots of each
/// layer's pool of experts in the rest.
pub(super) struct PoolFit {
    order: UploadOrder,
    other_bytes: u64,
    slots: usize,
}

impl PoolFit {
    pub(super) fn of(
        plan: &ExecutionPlan,
        order: &UploadOrder,
        experts: Experts,
        budget: u64,
    ) -> Result<PoolFit, ModelError> {
        let pooled: std::collections::HashSet<usize> = expert_pool::pooled_tensors(plan)
            .iter()
            .map(|t| t.index())
            .collect();
        let order = UploadOrder::by_layer(
            order
                .tensors()
                .iter()
                .filter(|t| !pooled.contains(&t.index())),
        );
        let other_bytes = HipTarget::arena_bytes_for(order.tensors().iter().map(|t| t.size()));
        // A margin for the pools' alignment (each matrix's slots start on 256 bytes).
        let room = (budget - budget / 256).saturating_sub(other_bytes);
        if other_bytes > budget {
            return Err(ModelError::GpuUnsupported {
                what: format!(
                    "a mixture of experts ({} experts) whose weights other than the routed \
                     experts take {} MiB, over a GPU budget of {} MiB",
                    experts.count,
                    other_bytes >> 20,
                    budget >> 20
                ),
                supported: "a budget that holds every weight but the routed experts".to_owned(),
            });
        }
        let per_slot: u64 = expert_pool::slot_bytes(plan).iter().sum();
        let slots = (room / per_slot.max(1)).min(experts.count as u64) as usize;
        Ok(PoolFit {
            order,
            other_bytes,
            slots,
        })
    }
}

/// Says that the weights do not fit the budget of `arena_bytes`, how many layers stay
/// held, and what becomes of the others: run on the host or streamed (`paged`).
fn report_over_budget(
    arena_bytes: u64,
    model_bytes: u64,
    keep_layers: usize,
    config: &ModelConfig,
    paged: bool,
) {
    tracing::info!(
        budget_mib = arena_bytes >> 20,
        model_mib = model_bytes >> 20,
        held_layers = keep_layers,
        layers = config.n_layers,
        "the weights do not fit the budget: {}",
        if !paged {
            "the layers not held run on the host for a few tokens, streamed for more"
        } else {
            "the layers not held are streamed through the budget every pass"
        }
    );
}

/// The page-locked host side of a pass: its tokens, logits, first positions and the
/// embedding rows it gathers from the file.
struct Staged {
    host_tokens: PinnedBuffer<u32>,
    host_logits: PinnedBuffer<f32>,
    host_positions: PinnedBuffer<i32>,
    host_rows: PinnedBuffer<u8>,
}

impl Staged {
    /// Room for `batch_room` tokens and rows of logits as many as `bufs` computes, and
    /// for the first positions of a context of `capacity` in chunks of `prompt_batch`.
    fn alloc(
        device: &Device,
        config: &ModelConfig,
        bufs: &Buffers,
        capacity: usize,
        prompt_batch: usize,
        batch_room: usize,
    ) -> Result<Staged, ModelError> {
        let gpu = |op| move |source| ModelError::Gpu { op, source };
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
        Ok(Staged {
            host_tokens,
            host_logits,
            host_positions,
            host_rows,
        })
    }
}

/// The paged cache's shape with the host side of a batch's layout, room for a batch of
/// `batch_room` tokens; `None` without pages.
fn page_meta(
    device: &Device,
    pages: Option<PageShape>,
    batch_room: usize,
) -> Result<Option<(PageShape, PinnedBuffer<i32>)>, ModelError> {
    let gpu = |op| move |source| ModelError::Gpu { op, source };
    let pages = match pages {
        Some(shape) => {
            let meta = device
                .alloc_pinned::<i32>(shape.meta_len(batch_room).max(1))
                .map_err(gpu("pinned"))?;
            Some((shape, meta))
        }
        None => None,
    };
    Ok(pages)
}

/// Starts the device cache that uploads `order` from `store` into `target` (within
/// `budget` bytes when it does not hold every weight), and the moment the upload
/// completes, set once it does.
fn start_cache(
    target: HipTarget,
    store: &TensorStore,
    order: UploadOrder,
    options: &GpuOptions,
    budget: Option<u64>,
) -> Result<(DeviceCache<HipTarget>, Arc<OnceLock<Instant>>), ModelError> {
    let cache_config = CacheConfig {
        mode: options.mode,
        budget,
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
    Ok((cache, uploaded))
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
