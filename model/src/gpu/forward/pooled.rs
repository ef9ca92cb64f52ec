//! A mixture of experts' block over its GPU budget (`gpu::expert_pool`): the router on
//! the device, its routes read back and split between the pool's resident experts (the
//! device's routed products on their slots) and the host (the CPU's products from the
//! mapped file, computed while the device runs its part), the host's weighted sum added
//! on the device last.

use dequant::gpu::experts::{self, GpuExperts};
use hip_backend::{DeviceView, Stream};

use super::experts::{routed_ffn, shared_and_combine, Mats};
use super::routing::Tiling;
use super::{view, view_mut, Buffers};
use crate::config::ModelConfig;
use crate::gpu::gpu;
use crate::gpu::kernels;
use crate::gpu::weights::{ExpertTensor, ExpertWeights};
use crate::ModelError;

/// `x += moe(h)` for the `n` tokens of `h` once [`super::experts`] has normed and routed
/// them (as `tiling` says), the experts from the layer's pool.
pub(super) fn routed(
    config: &ModelConfig,
    e: &ExpertWeights,
    bufs: &mut Buffers,
    n: usize,
    tiling: Tiling,
    stream: &Stream,
) -> Result<(), ModelError> {
    let d = config.n_embd;
    let (k, slots) = (e.used, n * e.used);
    let (Some(moe), Some(pools)) = (bufs.moe.as_mut(), bufs.experts.as_mut()) else {
        unreachable!("a pooled layer's buffers hold the experts' room")
    };
    pools.read_routes(
        stream,
        view(&moe.ids, slots)?,
        view(&moe.weights, slots)?,
        view(&bufs.h, n * d)?,
    )?;
    let began = std::time::Instant::now();
    let split = pools.split(e.layer, n, k)?;
    pools.send_routes(stream, slots, view_mut::<f32>(&mut moe.weights, slots)?)?;
    pools.queued(began.elapsed());
    // The device's routes: the resident experts' and the link's first slots' in the
    // first round, each later round the link slots filled again. (Without any, the
    // combination skips every slot: each is weighted 0.)
    let count = pools.device_slots();
    let n_tiles = experts::max_tiles(slots, count, tiling.tokens);
    for round in 0..split.rounds {
        let began = std::time::Instant::now();
        if round > 0 {
            pools.send_round(stream, slots, round)?;
        }
        pools.fetch_linked(stream, e.layer, round)?;
        pools.queued(began.elapsed());
        let slot_ids = pools
            .slot_ids
            .slice(0..slots)
            .map_err(gpu("the device routes' slots"))?;
        kernels::moe_tiles(
            slot_ids,
            count,
            tiling.tokens,
            view_mut::<i32>(&mut moe.tiles, 3 * n_tiles)?,
            view_mut::<i32>(&mut moe.order, slots)?,
            stream,
        )?;
        let mut bytes = pools.matrices(e.layer)?.into_iter();
        let mut next = |t: &ExpertTensor| match bytes.next() {
            Some(b) => slot_matrices(t, count, b),
            None => unreachable!("a pool holds each of the layer's expert tensors"),
        };
        let mats = Mats {
            gate: e.gate.as_ref().map(&mut next).transpose()?,
            up: next(&e.up)?,
            down: next(&e.down)?,
            count,
        };
        routed_ffn(
            config,
            e,
            mats,
            view(&bufs.h, n * d)?,
            moe,
            n,
            tiling,
            None,
            stream,
        )?;
    }
    shared_and_combine(config, e, bufs, n, stream)?;
    if split.on_host == 0 {
        return Ok(());
    }
    let Some(pools) = bufs.experts.as_mut() else {
        unreachable!("checked above")
    };
    // The host's routes, while the device runs its own; then their sum, as one more
    // expert of weight 1.
    pools.host_part(stream, e.layer, n, d)?;
    let partial = pools
        .partial
        .slice(0..n * d)
        .map_err(gpu("the host's experts' sum"))?;
    let ones = pools
        .ones
        .slice(0..n)
        .map_err(gpu("the host's experts' sum"))?;
    kernels::moe_combine(
        partial,
        ones,
        n,
        1,
        d,
        None,
        None,
        view_mut::<f32>(&mut bufs.x, n * d)?,
        stream,
    )?;
    Ok(())
}

/// `count` slots of the expert tensor `t`'s matrices in `bytes`, as the routed products
/// take them.
fn slot_matrices<'a>(
    t: &ExpertTensor,
    count: usize,
    bytes: DeviceView<'a, u8>,
) -> Result<GpuExperts<'a>, ModelError> {
    GpuExperts::new(t.ty, count, t.rows, t.cols, bytes).map_err(|source| ModelError::Matmul {
        name: t.name().to_owned(),
        source,
    })
}
