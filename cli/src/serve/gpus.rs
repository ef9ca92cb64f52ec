//! The GPUs a server computes on: one model placed as the flags say (one GPU, or split
//! over several), or a copy on each of several GPUs with a scheduler each; the checks
//! of each and the copies' start.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use model::gpu::GpuOptions;
use model::serve::{Scheduler, SchedulerConfig};
use model::tokenizer::Tokenizer;
use model::Model;

/// Where the server computes on GPUs: one model placed as the flags say (one GPU, or
/// split over several), a copy on each of several GPUs, or several GPUs and no split
/// mode named (a copy on each when the model fits each, else split by layers).
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Gpus {
    Placement(crate::options::Placement),
    Replicas(Vec<usize>),
    Choose(Vec<usize>),
}

impl Gpus {
    pub(super) fn of(flags: &crate::options::PlacementArgs) -> Result<Gpus> {
        use crate::options::SplitMode;
        let several = flags.devices.len() > 1;
        match flags.split_mode {
            Some(SplitMode::Replicate) => {
                if !flags.tensor_split.is_empty() {
                    bail!("--tensor-split applies to --split-mode layer: each copy is whole");
                }
                let mut devices = flags.devices.clone();
                if devices.is_empty() {
                    devices.push(0);
                }
                Ok(Gpus::Replicas(distinct(devices)?))
            }
            None if several && flags.tensor_split.is_empty() => {
                // Checks the devices as a split by layers would (refused lists say so now).
                flags.placement()?;
                Ok(Gpus::Choose(distinct(flags.devices.clone())?))
            }
            _ => Ok(Gpus::Placement(flags.placement()?)),
        }
    }

    pub(super) fn first_device(&self) -> usize {
        match self {
            Gpus::Placement(p) => p.first_device(),
            Gpus::Replicas(d) | Gpus::Choose(d) => d[0],
        }
    }

    /// [`Gpus::Choose`] decided for `model`: a copy on each GPU when its weights and a KV
    /// pool of `pool_bytes` fit each one's free memory (with the runtime's reserve), else
    /// split by layers.
    pub(super) fn resolve(self, model: &Model, pool_bytes: u64) -> Result<Gpus> {
        let Gpus::Choose(devices) = self else {
            return Ok(self);
        };
        let weights = crate::on_gpu::weight_bytes(model);
        let mut fits = true;
        for &d in &devices {
            let device = hip_backend::Device::open(d).with_context(|| format!("GPU {d}"))?;
            fits &= crate::on_gpu::fits_free_memory(&device, weights.saturating_add(pool_bytes));
        }
        if fits {
            tracing::info!(
                ?devices,
                weights_mib = weights >> 20,
                "a copy of the model on each GPU"
            );
            Ok(Gpus::Replicas(devices))
        } else {
            tracing::info!(
                ?devices,
                weights_mib = weights >> 20,
                "the model does not fit each GPU: split by layers"
            );
            Ok(Gpus::Placement(crate::options::Placement::Layers(
                model::gpu::SplitOptions {
                    devices,
                    ratios: None,
                    chunk: None,
                },
            )))
        }
    }
}

/// `devices`, refused when it names a GPU twice (a copy or a share of the layers a GPU).
fn distinct(devices: Vec<usize>) -> Result<Vec<usize>> {
    let mut seen = devices.clone();
    seen.sort_unstable();
    seen.dedup();
    if seen.len() != devices.len() {
        bail!("--devices {devices:?} names a GPU twice: a GPU takes one copy or one share");
    }
    Ok(devices)
}

/// Whether `model` can run where `gpus` puts it: the reason when not.
pub(super) fn gpu_usable(model: &Model, gpus: &Gpus) -> std::result::Result<(), String> {
    use crate::options::Placement;
    model.check_gpu_support().map_err(|e| e.to_string())?;
    let fits = |d: usize| {
        let device = hip_backend::Device::open(d).map_err(|e| format!("GPU {d}: {e}"))?;
        model::gpu::check_experts_fit(model, &device, None).map_err(|e| format!("GPU {d}: {e}"))
    };
    match gpus {
        Gpus::Placement(Placement::One(d)) => fits(*d),
        Gpus::Replicas(devices) | Gpus::Choose(devices) => {
            devices.iter().try_for_each(|&d| fits(d))
        }
        // Each device of a split checks its own share as it is built.
        Gpus::Placement(Placement::Layers(_) | Placement::Tensors(_)) => {
            hip_backend::Device::open(gpus.first_device())
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    }
}

/// A scheduler on each of `devices`, each with its own copy of `model`, all started at
/// once (each uploads its copy from the one mapped file); the first failure, naming
/// its GPU, if any fails.
pub(super) fn start_replicas(
    model: &Model,
    tokens: &Arc<Tokenizer>,
    config: SchedulerConfig,
    devices: &[usize],
    options: impl Fn(usize) -> GpuOptions + Sync,
) -> Result<Vec<Scheduler>> {
    tracing::info!(?devices, "a copy of the model on each GPU");
    std::thread::scope(|scope| {
        let started: Vec<_> = devices
            .iter()
            .map(|&device| {
                let (model, tokens, options) = (model.clone(), Arc::clone(tokens), &options);
                scope.spawn(move || {
                    Scheduler::start_on_gpu(model, tokens, config, options(device))
                        .with_context(|| format!("the copy on GPU {device}"))
                })
            })
            .collect();
        started
            .into_iter()
            .map(|s| {
                s.join()
                    .unwrap_or_else(|_| bail!("a replica's start panicked"))
            })
            .collect()
    })
}
