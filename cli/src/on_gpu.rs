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

/// The placement to use: the one the flags asked for (`asked`), or, when they named no
/// GPU and no split and no weights' budget was given, every usable GPU split by layers
/// should the model's weights not fit the chosen GPU's free memory (one GPU holds the
/// model otherwise, as the flags' default says).
pub fn placement_for(
    flags: &crate::options::PlacementArgs,
    asked: Placement,
    chosen: &crate::device_choice::Chosen,
    model: &Model,
    budget_mib: Option<u64>,
) -> Placement {
    let crate::device_choice::Chosen::Gpu { device, .. } = chosen else {
        return asked;
    };
    if !flags.devices.is_empty() || flags.split_mode.is_some() || budget_mib.is_some() {
        return asked;
    }
    let weights: u64 = model.plan().handles().iter().map(|h| h.size()).sum();
    let free = device.memory_info().map_or(u64::MAX, |m| m.free as u64);
    let count = hip_backend::Device::count().unwrap_or(1);
    if count < 2 || weights.saturating_add(model::gpu::RUNTIME_RESERVE) <= free {
        return asked;
    }
    tracing::info!(
        weights_mib = weights >> 20,
        free_mib = free >> 20,
        gpus = count,
        "the model does not fit one GPU: split by layers over every GPU"
    );
    Placement::Layers(model::gpu::SplitOptions {
        devices: (0..count).collect(),
        ratios: None,
        chunk: None,
    })
}
