//! A model on the GPUs `--devices` and `--split-mode` name: one device's [`GpuModel`],
//! or a [`LayerSplit`] over several, behind the generation loop's and perplexity's views
//! of a back end.

use std::time::Instant;

use anyhow::{Context, Result};
use model::generate::Session;
use model::gpu::{GpuModel, GpuOptions, LayerSplit};
use model::perplexity::WindowLogits;
use model::Model;

use crate::options::Placement;

/// A model on one GPU or split by layers over several.
pub enum OnGpu {
    One(Box<GpuModel>),
    Split(LayerSplit),
}

impl OnGpu {
    /// `model` placed as `placement` says, each device set up as `options` says (its
    /// `device` is the placement's), prompts in chunks of `prompt_batch`.
    pub fn new(
        model: &Model,
        options: &GpuOptions,
        placement: &Placement,
        prompt_batch: usize,
    ) -> Result<OnGpu> {
        match placement {
            Placement::One(device) => {
                let options = GpuOptions {
                    device: *device,
                    ..options.clone()
                };
                let gpu = GpuModel::with_prompt_batch(model, &options, prompt_batch)
                    .with_context(|| format!("on GPU {device}"))?;
                Ok(OnGpu::One(Box::new(gpu)))
            }
            Placement::Layers(split) => {
                let gpu = LayerSplit::new(model, options, split, prompt_batch)
                    .with_context(|| format!("split by layers over GPUs {:?}", split.devices))?;
                for (device, layers) in gpu.stages() {
                    tracing::info!(device, ?layers, "layers on a GPU");
                }
                Ok(OnGpu::Split(gpu))
            }
        }
    }

    pub fn session(&mut self) -> &mut dyn Session {
        match self {
            OnGpu::One(gpu) => gpu.as_mut(),
            OnGpu::Split(gpu) => gpu,
        }
    }

    pub fn windows(&mut self) -> &mut dyn WindowLogits {
        match self {
            OnGpu::One(gpu) => gpu.as_mut(),
            OnGpu::Split(gpu) => gpu,
        }
    }

    /// Positions in the KV cache.
    pub fn len(&self) -> usize {
        match self {
            OnGpu::One(gpu) => gpu.len(),
            OnGpu::Split(gpu) => gpu.len(),
        }
    }

    /// Forgets every position.
    pub fn clear(&mut self) -> Result<(), model::ModelError> {
        match self {
            OnGpu::One(gpu) => gpu.clear(),
            OnGpu::Split(gpu) => gpu.clear(),
        }
    }

    /// When every weight had been uploaded once.
    pub fn uploaded_at(&self) -> Option<Instant> {
        match self {
            OnGpu::One(gpu) => gpu.uploaded_at(),
            OnGpu::Split(gpu) => gpu.uploaded_at(),
        }
    }

    /// When the first pass had the last of the weights it waits for.
    pub fn first_pass_weights_at(&self) -> Option<Instant> {
        match self {
            OnGpu::One(gpu) => gpu.first_pass_weights_at(),
            OnGpu::Split(gpu) => gpu.first_pass_weights_at(),
        }
    }
}
