//! [`GpuEngine`]: a model on one GPU ([`GpuModel`]), split by layers over several
//! ([`LayerSplit`]) or by tensors ([`TensorSplit`]), behind the calls its users make of either: one sequence's (the
//! generation loop's `Session` and perplexity's `WindowLogits` are implemented beside
//! those traits) and paged batches' (the server's scheduler).

use std::time::Instant;

use tensor_store::device::CacheStats;

use super::{
    BatchSegment, ExpertStats, GpuModel, GpuOptions, LaunchedBatch, LayerSplit, PageOptions,
    SplitOptions, TensorOptions, TensorSplit,
};
use crate::{Model, ModelError};

/// A model on one GPU, or split by layers or by tensors over several.
pub enum GpuEngine {
    One(Box<GpuModel>),
    Split(LayerSplit),
    Tensor(Box<TensorSplit>),
}

impl GpuEngine {
    /// `model` on `options.device` alone (`split`: `None`), or split as `split` says;
    /// prompts in chunks of `prompt_batch`.
    pub fn new(
        model: &Model,
        options: &GpuOptions,
        split: Option<&SplitOptions>,
        prompt_batch: usize,
    ) -> Result<GpuEngine, ModelError> {
        GpuEngine::build(model, options, split, prompt_batch, None)
    }

    /// `model` split by tensors as `split` says ([`TensorSplit::new`]). It runs one
    /// sequence: paged batches are refused.
    pub fn tensor(
        model: &Model,
        options: &GpuOptions,
        split: &TensorOptions,
        prompt_batch: usize,
    ) -> Result<GpuEngine, ModelError> {
        let split = TensorSplit::new(model, options, split, prompt_batch)?;
        Ok(GpuEngine::Tensor(Box::new(split)))
    }

    /// As [`GpuEngine::new`], with a paged KV cache of `pages` for paged batches.
    pub fn with_pages(
        model: &Model,
        options: &GpuOptions,
        split: Option<&SplitOptions>,
        prompt_batch: usize,
        pages: PageOptions,
    ) -> Result<GpuEngine, ModelError> {
        GpuEngine::build(model, options, split, prompt_batch, Some(pages))
    }

    fn build(
        model: &Model,
        options: &GpuOptions,
        split: Option<&SplitOptions>,
        prompt_batch: usize,
        pages: Option<PageOptions>,
    ) -> Result<GpuEngine, ModelError> {
        let shape = pages
            .map(|pages| GpuModel::page_shape(options, pages))
            .transpose()?;
        Ok(match split {
            None => {
                let part = super::Part::whole(model.config().n_layers);
                let gpu = GpuModel::build(model, options, prompt_batch, shape, part)?;
                GpuEngine::One(Box::new(gpu))
            }
            Some(split) => GpuEngine::Split(LayerSplit::build(
                model,
                options,
                split,
                prompt_batch,
                shape,
            )?),
        })
    }

    /// Positions in the KV cache of one sequence.
    pub fn len(&self) -> usize {
        match self {
            GpuEngine::One(gpu) => gpu.len(),
            GpuEngine::Split(gpu) => gpu.len(),
            GpuEngine::Tensor(gpu) => gpu.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every position of one sequence.
    pub fn clear(&mut self) -> Result<(), ModelError> {
        match self {
            GpuEngine::One(gpu) => gpu.clear(),
            GpuEngine::Split(gpu) => gpu.clear(),
            GpuEngine::Tensor(gpu) => gpu.clear(),
        }
    }

    /// When every weight had been uploaded once.
    pub fn uploaded_at(&self) -> Option<Instant> {
        match self {
            GpuEngine::One(gpu) => gpu.uploaded_at(),
            GpuEngine::Split(gpu) => gpu.uploaded_at(),
            GpuEngine::Tensor(gpu) => gpu.uploaded_at(),
        }
    }

    /// When the first pass had the last of the weights it waits for.
    pub fn first_pass_weights_at(&self) -> Option<Instant> {
        match self {
            GpuEngine::One(gpu) => gpu.first_pass_weights_at(),
            GpuEngine::Split(gpu) => gpu.first_pass_weights_at(),
            GpuEngine::Tensor(gpu) => gpu.first_pass_weights_at(),
        }
    }

    /// Waits until every weight is on its device.
    pub fn wait_loaded(&self) -> Result<(), ModelError> {
        match self {
            GpuEngine::One(gpu) => gpu.wait_loaded(),
            GpuEngine::Split(gpu) => gpu.wait_loaded(),
            // Its weights were uploaded before it was returned.
            GpuEngine::Tensor(_) => Ok(()),
        }
    }

    /// [`GpuModel::wait_experts_resident`] (a split holds every expert: nothing to wait for).
    pub fn wait_experts_resident(&mut self) -> Result<(), ModelError> {
        match self {
            GpuEngine::One(gpu) => gpu.wait_experts_resident(),
            GpuEngine::Split(_) | GpuEngine::Tensor(_) => Ok(()),
        }
    }

    /// Most tokens of a prompt's chunk, and of a paged batch.
    pub fn prompt_batch(&self) -> usize {
        match self {
            GpuEngine::One(gpu) => gpu.prompt_batch(),
            GpuEngine::Split(gpu) => gpu.prompt_batch(),
            GpuEngine::Tensor(gpu) => gpu.prompt_batch(),
        }
    }

    /// The weights' device caches' counters (a split's added up).
    pub fn cache_stats(&self) -> CacheStats {
        match self {
            GpuEngine::One(gpu) => gpu.cache().stats(),
            GpuEngine::Split(gpu) => gpu.cache_stats(),
            GpuEngine::Tensor(gpu) => gpu.cache_stats(),
        }
    }

    /// [`GpuModel::expert_stats`] (a split holds every expert: `None`).
    pub fn expert_stats(&self) -> Option<ExpertStats> {
        match self {
            GpuEngine::One(gpu) => gpu.expert_stats(),
            GpuEngine::Split(_) | GpuEngine::Tensor(_) => None,
        }
    }

    /// [`GpuModel::launch_batch`].
    pub fn launch_batch(
        &mut self,
        segments: &[BatchSegment<'_>],
    ) -> Result<LaunchedBatch<'_>, ModelError> {
        match self {
            GpuEngine::One(gpu) => gpu.launch_batch(segments),
            GpuEngine::Split(gpu) => gpu.launch_batch(segments),
            GpuEngine::Tensor(_) => Err(paged_refused()),
        }
    }

    /// [`GpuModel::forward_batch_hidden`].
    pub fn forward_batch_hidden(
        &mut self,
        segments: &[BatchSegment<'_>],
    ) -> Result<Vec<f32>, ModelError> {
        match self {
            GpuEngine::One(gpu) => gpu.forward_batch_hidden(segments),
            GpuEngine::Split(gpu) => gpu.forward_batch_hidden(segments),
            GpuEngine::Tensor(_) => Err(paged_refused()),
        }
    }
}

/// A split by tensors runs one sequence: paged batches (the server's) are refused.
fn paged_refused() -> ModelError {
    ModelError::GpuUnsupported {
        what: "paged batches on a model split by tensors".into(),
        supported: "one sequence (generate, chat, perplexity), or a split by layers".into(),
    }
}
