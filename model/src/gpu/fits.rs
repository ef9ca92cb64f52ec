//! Checks a caller makes before anything is allocated, so that it can choose the CPU
//! instead: whether a model's weights fit a device for what its mixture of experts and
//! its KV cache's types need. [`GpuModel::new`](super::GpuModel::new) decides the same
//! once it has placed the activations.

use hip_backend::Device;
use tensor_store::device::{HipTarget, UploadOrder};

use super::build::PoolFit;
use super::{first_use_order, gpu, kernels, RUNTIME_RESERVE};
use crate::{Model, ModelError};

/// Refuses a mixture of experts that routes a token to more experts than the routing
/// kernel takes ([`kernels::MAX_USED`]), or whose weights other than the routed experts
/// do not fit on `device` (its free memory less [`RUNTIME_RESERVE`], or `budget` bytes):
/// the routed experts that do not fit run from a pool resident by use, the others on the
/// host. [`GpuModel::new`] decides the same once the activations are placed; this check,
/// before anything is allocated, lets a caller choose the CPU instead.
pub fn check_experts_fit(
    model: &Model,
    device: &Device,
    budget: Option<u64>,
) -> Result<(), ModelError> {
    let Some(experts) = model.config().experts else {
        return Ok(());
    };
    if experts.used > kernels::MAX_USED {
        return Err(ModelError::GpuUnsupported {
            what: format!(
                "a mixture of experts that routes each token to {} experts",
                experts.used
            ),
            supported: format!("up to {} experts a token", kernels::MAX_USED),
        });
    }
    let order = first_use_order(model);
    let (model_bytes, room) = weights_and_room(&order, device, budget)?;
    if model_bytes > room {
        PoolFit::of(model.plan(), &order, experts, room)?;
    }
    Ok(())
}

/// Refuses a quantized KV cache (`types`) for a dense model whose weights do not all fit
/// on `device` (its free memory less [`RUNTIME_RESERVE`], or `budget` bytes): the layers
/// over the budget would be computed on the host, whose keys cross as f16.
/// [`GpuModel::new`] refuses the same once it has placed the activations and the cache;
/// this check, before anything is allocated, lets a caller choose the CPU instead.
pub fn check_cache_fits(
    model: &Model,
    device: &Device,
    budget: Option<u64>,
    types: crate::KvTypes,
) -> Result<(), ModelError> {
    if !types.is_quantized() || model.config().experts.is_some() {
        return Ok(());
    }
    let order = first_use_order(model);
    let (model_bytes, room) = weights_and_room(&order, device, budget)?;
    if model_bytes > room {
        return Err(ModelError::GpuUnsupported {
            what: format!(
                "a {}/{} KV cache with {} MiB of weights over the device's {} MiB",
                types.k,
                types.v,
                model_bytes >> 20,
                room >> 20
            ),
            supported: "a quantized cache with every layer on the device, or an f16 cache".into(),
        });
    }
    Ok(())
}

/// The device bytes `order`'s weights take, and the room for them: `budget`, or what
/// `device` has free less [`RUNTIME_RESERVE`].
fn weights_and_room(
    order: &UploadOrder,
    device: &Device,
    budget: Option<u64>,
) -> Result<(u64, u64), ModelError> {
    let model_bytes = HipTarget::arena_bytes_for(order.tensors().iter().map(|t| t.size()));
    let room = match budget {
        Some(budget) => budget,
        None => {
            let info = device.memory_info().map_err(gpu("memory info"))?;
            (info.free as u64).saturating_sub(RUNTIME_RESERVE)
        }
    };
    Ok((model_bytes, room))
}
