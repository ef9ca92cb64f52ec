//! A model on the GPUs `--devices` and `--split-mode` name: a [`GpuEngine`] on one
//! device or split by layers or by tensors over several, and the placement to use when the flags name
//! none.

use anyhow::{Context, Result};
use model::gpu::{GpuEngine, GpuOptions};
use model::Model;

use crate::options::Placement;

/// `model` placed as `placement` says, each device set up as `options` says (its
/// `device` is the placement's), prompts in chunks of `prompt_batch`.
pub fn engine(
    model: &Model,
    options: &GpuOptions,
    placement: &Placement,
    prompt_batch: usize,
) -> Result<GpuEngine> {
    match placement {
        Placement::One(device) => {
            let options = GpuOptions {
                device: *device,
                ..options.clone()
            };
            GpuEngine::new(model, &options, None, prompt_batch)
                .with_context(|| format!("on GPU {device}"))
        }
        Placement::Layers(split) => {
            let gpu = GpuEngine::new(model, options, Some(split), prompt_batch)
                .with_context(|| format!("split by layers over GPUs {:?}", split.devices))?;
            if let GpuEngine::Split(split) = &gpu {
                for (device, layers) in split.stages() {
                    tracing::info!(device, ?layers, "layers on a GPU");
                }
            }
            Ok(gpu)
        }
        Placement::Tensors(split) => {
            let gpu = GpuEngine::tensor(model, options, split, prompt_batch)
                .with_context(|| format!("split by tensors over GPUs {:?}", split.devices))?;
            if let GpuEngine::Tensor(split) = &gpu {
                let (library, version) = split.library();
                tracing::info!(devices = ?split.devices(), library, ?version, "split by tensors");
            }
            Ok(gpu)
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
    let weights = weight_bytes(model);
    let count = hip_backend::Device::count().unwrap_or(1);
    if count < 2 || fits_free_memory(device, weights) {
        return asked;
    }
    tracing::info!(
        weights_mib = weights >> 20,
        free_mib = free_bytes(device) >> 20,
        gpus = count,
        "the model does not fit one GPU: split by layers over every GPU"
    );
    Placement::Layers(model::gpu::SplitOptions {
        devices: (0..count).collect(),
        ratios: None,
        chunk: None,
    })
}

/// Bytes of the model's weights as the file holds them (what a GPU uploads).
pub fn weight_bytes(model: &Model) -> u64 {
    model.plan().handles().iter().map(|h| h.size()).sum()
}

/// Free memory of `device` (unlimited when the runtime cannot say).
fn free_bytes(device: &hip_backend::Device) -> u64 {
    device.memory_info().map_or(u64::MAX, |m| m.free as u64)
}

/// Whether `bytes` and the runtime's reserve fit `device`'s free memory.
pub fn fits_free_memory(device: &hip_backend::Device, bytes: u64) -> bool {
    bytes.saturating_add(model::gpu::RUNTIME_RESERVE) <= free_bytes(device)
}

/// The device that computes and where the model goes on it: the placement
/// ([`placement_for`]) and then the choice of device for that placement
/// ([`Chosen::for_model`](crate::device_choice::Chosen::for_model)).
pub fn choose(
    chosen: crate::device_choice::Chosen,
    model: &Model,
    arg: crate::device_choice::DeviceArg,
    flags: &crate::options::PlacementArgs,
    asked: Placement,
    budget_mib: Option<u64>,
    kv_types: model::KvTypes,
) -> (crate::device_choice::Chosen, Placement) {
    let placement = placement_for(flags, asked, &chosen, model, budget_mib);
    let chosen = chosen.for_model(model, arg, budget_mib, kv_types, &placement);
    (chosen, placement)
}
