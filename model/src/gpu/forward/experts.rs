//! A mixture of experts' feed-forward block on the GPU: the router's products, the
//! routing on the device (`kernels::moe_route`, `kernels::moe_tiles`), the routed products
//! of the chosen experts (`dequant::gpu::experts`), the shared expert, and the weighted
//! sum into the residual stream. Nothing is read back to the host, so a decode step stays
//! one captured graph; the same sequence runs a prompt's chunk and a paged batch.

use dequant::gpu::experts::{self, routed_products, GpuExperts, RoutedInput, SlotInput};
use dequant::gpu::matmul::row_scales;
use dequant::gpu::matvec::q8_bytes;
use half::f16;
use hip_backend::{ArenaBuffer, DeviceView, DeviceViewMut, Stream};

use super::buffers::MoeBuffers;
use super::routing::Tiling;
use super::{product_error, products, takes_q8_for, view, view_mut, Buffers};
use crate::config::ModelConfig;
use crate::gpu::expert_pool::tables_of;
use crate::gpu::kernels;
use crate::gpu::weights::{ExpertTensor, ExpertWeights, Norm, SharedExpert};
use crate::ModelError;

fn routed_error<'a>(
    t: &'a ExpertTensor,
) -> impl Fn(dequant::gpu::GpuDequantError) -> ModelError + 'a {
    product_error("routed expert products", move || t.name().to_owned())
}

/// The routing as the products read it: the tiles, the slots by expert, and the most
/// slots a tile holds (which also picks the products).
#[derive(Clone, Copy)]
struct Route<'a> {
    tiles: DeviceView<'a, i32>,
    order: DeviceView<'a, i32>,
    tile_tokens: usize,
}

impl<'a> Route<'a> {
    /// The routing in `tiles` and `order` of `slots` slots among `count` experts, in
    /// tiles of up to `tile_tokens` slots.
    fn new(
        tiles: &'a ArenaBuffer,
        order: &'a ArenaBuffer,
        slots: usize,
        count: usize,
        tile_tokens: usize,
    ) -> Result<Route<'a>, ModelError> {
        let n_tiles = experts::max_tiles(slots, count, tile_tokens);
        Ok(Route {
            tiles: view::<i32>(tiles, 3 * n_tiles)?,
            order: view::<i32>(order, slots)?,
            tile_tokens,
        })
    }
}

/// The routed experts' matrices as the products take them: the layer's 3-D tensors
/// whole (`count` experts), or a pool's slots of them (`count` slots).
#[derive(Clone, Copy)]
pub(super) struct Mats<'a> {
    pub gate: Option<GpuExperts<'a>>,
    pub up: GpuExperts<'a>,
    pub down: GpuExperts<'a>,
    pub count: usize,
}

impl<'a> Mats<'a> {
    /// The layer's own tensors.
    fn of(e: &'a ExpertWeights) -> Result<Mats<'a>, ModelError> {
        Ok(Mats {
            gate: e.gate.as_ref().map(ExpertTensor::gpu).transpose()?,
            up: e.up.gpu()?,
            down: e.down.gpu()?,
            count: e.count,
        })
    }

    /// The layer's experts where a pool's `tables` place them (one a matrix: `gate` if
    /// any, `up`, `down`), read in place.
    fn placed(e: &ExpertWeights, tables: &[DeviceView<'a, u64>]) -> Result<Mats<'a>, ModelError> {
        let first = usize::from(e.gate.is_some());
        Ok(Mats {
            gate: e
                .gate
                .as_ref()
                .map(|g| tables_of(tables, g, 0))
                .transpose()?,
            up: tables_of(tables, &e.up, first)?,
            down: tables_of(tables, &e.down, first + 1)?,
            count: e.count,
        })
    }
}

/// The routed products of `mats` on `input` (`n_x` rows).
fn routed(
    mats: &[GpuExperts<'_>],
    input: RoutedInput<'_>,
    n_x: usize,
    slots: SlotInput,
    route: Route<'_>,
    outs: &mut [DeviceViewMut<'_, f32>],
    stream: &Stream,
) -> Result<(), dequant::gpu::GpuDequantError> {
    routed_products(
        mats,
        input,
        n_x,
        slots,
        route.tiles,
        route.order,
        route.tile_tokens,
        outs,
        stream,
    )
}

/// The fewest tokens whose routed down products in tiles of one slot add their weighted
/// sum to the residual stream themselves ([`experts::routed_sum`]). One token's sum runs
/// in one workgroup a row group, which at one token leaves the device short of
/// workgroups. Measured on an H200 with Qwen3-30B-A3B's shape (`cargo xtask bench-gpu
/// --parallel 2,4,8`, tokens/s, separate sum / fused): one sequence 388 / 371, two
/// 549 / 573, four 724 / 745, eight 974 / 1,006.
const FUSED_SUM_FROM: usize = 2;

/// `x += moe(rms_norm(x))` for the `n` tokens in `x`. With `defer_sum` (the caller runs
/// the next layer's attention next, on this stream), a weighted sum that would take a
/// launch of its own is left in `bufs.pending_sum` for that layer's norm to add.
pub(super) fn block(
    config: &ModelConfig,
    e: &ExpertWeights,
    norm: &Norm,
    bufs: &mut Buffers,
    n: usize,
    defer_sum: bool,
    stream: &Stream,
) -> Result<(), ModelError> {
    let d = config.n_embd;
    let tiling = super::routing::norm_and_route(config, e, norm, bufs, n, stream)?;
    // Over budget, the pools' experts read in place where the pass allows it (the
    // products then run as with every expert resident), else the routes split.
    let mats = match (bufs.experts.as_mut(), bufs.moe.as_ref()) {
        (None, _) => Mats::of(e)?,
        (Some(pools), Some(moe)) if tiling.one_slot() => {
            let ids = view(&moe.ids, n * e.used)?;
            match pools.in_place(e.layer, ids, stream)? {
                Some(tables) => Mats::placed(e, &tables)?,
                None => return super::pooled::routed(config, e, bufs, n, tiling, stream),
            }
        }
        (Some(_), _) => return super::pooled::routed(config, e, bufs, n, tiling, stream),
    };
    let Some(moe) = bufs.moe.as_mut() else {
        unreachable!("the buffers of a model with experts hold the experts' room")
    };
    // Without a shared expert or biases of down, from FUSED_SUM_FROM tokens, down adds its
    // weighted sum to the residual stream itself where its slots run in tiles of one (the
    // fused products' own); tiles of more slots read each expert's rows once for them.
    let fuse_sum =
        e.shared.is_none() && e.down.bias.is_none() && n >= FUSED_SUM_FROM && tiling.tokens == 1;
    let summed = routed_ffn(
        config,
        e,
        mats,
        view(&bufs.h, n * d)?,
        moe,
        n,
        tiling,
        fuse_sum
            .then(|| view_mut::<f32>(&mut bufs.x, n * d))
            .transpose()?,
        stream,
    )?;
    // A pool's pass comes here only read in place: its routes are counted later.
    if let Some(pools) = bufs.experts.as_mut() {
        let Some(moe) = bufs.moe.as_ref() else {
            unreachable!("checked above")
        };
        pools.log_routes(e.layer, view(&moe.ids, n * e.used)?, stream)?;
    }
    if summed {
        return Ok(());
    }
    if defer_sum && e.shared.is_none() && e.down.bias.is_none() {
        bufs.pending_sum = Some(e.used);
        return Ok(());
    }
    shared_and_combine(config, e, bufs, n, stream)
}

/// The shared expert (Qwen 2 MoE), then the routed slots' outputs in the experts' room,
/// weighted (with down's biases, gpt-oss), and the shared expert's added to `x`.
pub(super) fn shared_and_combine(
    config: &ModelConfig,
    e: &ExpertWeights,
    bufs: &mut Buffers,
    n: usize,
    stream: &Stream,
) -> Result<(), ModelError> {
    let d = config.n_embd;
    let (k, slots) = (e.used, n * e.used);
    if let Some(sh) = &e.shared {
        shared_expert(config, sh, bufs, n, stream)?;
    }
    let Some(moe) = bufs.moe.as_ref() else {
        unreachable!("the buffers of a model with experts hold the experts' room")
    };
    let shared = e
        .shared
        .as_ref()
        .map(|_| -> Result<_, ModelError> {
            Ok((view(&bufs.proj, n * d)?, view(&moe.shared_gate, n)?))
        })
        .transpose()?;
    kernels::moe_combine(
        view(&moe.out, slots * d)?,
        view(&moe.weights, slots)?,
        n,
        k,
        d,
        shared,
        e.down
            .bias
            .as_ref()
            .map(|b| -> Result<_, ModelError> {
                Ok(kernels::SlotBias {
                    bias: b.view()?,
                    ids: view(&moe.ids, slots)?,
                })
            })
            .transpose()?,
        view_mut::<f32>(&mut bufs.x, n * d)?,
        stream,
    )?;
    Ok(())
}

/// The routed experts' products for the `n` tokens of `h` (normed), by the routing in
/// `moe`: gate and up, the gated activation, down, each slot's output into `moe.out`.
/// Given `sum_into` (only where `tiling` runs tiles of one slot), down's outputs are
/// weighted and added to it instead ([`experts::routed_sum`]); returns whether they were.
#[allow(clippy::too_many_arguments)]
pub(super) fn routed_ffn(
    config: &ModelConfig,
    e: &ExpertWeights,
    mats: Mats<'_>,
    h: DeviceView<'_, f32>,
    moe: &mut MoeBuffers,
    n: usize,
    tiling: Tiling,
    sum_into: Option<DeviceViewMut<'_, f32>>,
    stream: &Stream,
) -> Result<bool, ModelError> {
    gate_up(config, e, mats, h, moe, n, tiling, stream)?;
    // The activations (after each slot's expert's biases, gpt-oss), then down, each slot
    // from its own.
    activation(e, moe, n, tiling, stream)?;
    down(config, e, mats, moe, n, tiling, sum_into, stream)
}

/// Gate and up of every slot's expert (one launch when they share a type), from the
/// layer's input in the form its products take, into `moe.gate` and `moe.up`.
#[allow(clippy::too_many_arguments)]
fn gate_up(
    config: &ModelConfig,
    e: &ExpertWeights,
    mats: Mats<'_>,
    h: DeviceView<'_, f32>,
    moe: &mut MoeBuffers,
    n: usize,
    tiling: Tiling,
    stream: &Stream,
) -> Result<(), ModelError> {
    let d = config.n_embd;
    let (k, count) = (e.used, mats.count);
    let slots = n * k;
    let ff = e.up.rows;
    let mm = tiling.f16();
    if mm {
        row_scales(
            h,
            n,
            d,
            view_mut::<f32>(&mut moe.scales, n)?,
            view_mut::<f16>(&mut moe.x16, n * d)?,
            stream,
        )
        .map_err(routed_error(&e.up))?;
    }
    let route = Route::new(&moe.tiles, &moe.order, slots, count, tiling.tokens)?;
    let (up, gate) = (mats.up, mats.gate);
    let input = if mm {
        RoutedInput::F16 {
            x16: view(&moe.x16, n * d)?,
            scales: view(&moe.scales, n)?,
        }
    } else {
        RoutedInput::Q8(view(&moe.q8_in, q8_bytes(n, d))?)
    };
    let per_token = SlotInput::Token { per_token: k };
    match (&gate, &e.gate) {
        (Some(g), Some(gt)) if g.ty() == up.ty() => routed(
            &[*g, up],
            input,
            n,
            per_token,
            route,
            &mut [
                view_mut::<f32>(&mut moe.gate, slots * ff)?,
                view_mut::<f32>(&mut moe.up, slots * ff)?,
            ],
            stream,
        )
        .map_err(routed_error(gt))?,
        (Some(g), Some(gt)) => {
            routed(
                &[*g],
                input,
                n,
                per_token,
                route,
                &mut [view_mut::<f32>(&mut moe.gate, slots * ff)?],
                stream,
            )
            .map_err(routed_error(gt))?;
            routed(
                &[up],
                input,
                n,
                per_token,
                route,
                &mut [view_mut::<f32>(&mut moe.up, slots * ff)?],
                stream,
            )
            .map_err(routed_error(&e.up))?;
        }
        _ => routed(
            &[up],
            input,
            n,
            per_token,
            route,
            &mut [view_mut::<f32>(&mut moe.up, slots * ff)?],
            stream,
        )
        .map_err(routed_error(&e.up))?,
    }
    Ok(())
}

/// The gated activation of gate and up (after each slot's expert's biases, gpt-oss), in
/// the form down's products take: f32 for the matrix units, Q8 blocks otherwise.
fn activation(
    e: &ExpertWeights,
    moe: &mut MoeBuffers,
    n: usize,
    tiling: Tiling,
    stream: &Stream,
) -> Result<(), ModelError> {
    let slots = n * e.used;
    let ff = e.up.rows;
    let mm = tiling.f16();
    let gate_bias = e
        .gate
        .as_ref()
        .and_then(|t| t.bias.as_ref())
        .map(|b| b.view());
    let up_bias = e.up.bias.as_ref().map(|b| b.view());
    let biases = if gate_bias.is_some() || up_bias.is_some() {
        Some(kernels::GatedBias {
            gate: gate_bias.transpose()?,
            up: up_bias.transpose()?,
            ids: view(&moe.ids, slots)?,
        })
    } else {
        None
    };
    kernels::gated(
        e.gate
            .is_some()
            .then(|| view(&moe.gate, slots * ff))
            .transpose()?,
        view(&moe.up, slots * ff)?,
        ff,
        e.activation,
        biases,
        mm.then(|| view_mut::<f32>(&mut moe.act, slots * ff))
            .transpose()?,
        (!mm)
            .then(|| view_mut::<u8>(&mut moe.q8_act, q8_bytes(slots, ff)))
            .transpose()?,
        stream,
    )?;
    Ok(())
}

/// Down of every slot's expert on its own activations, each slot's output into
/// `moe.out`, or weighted and added to `sum_into` (see [`routed_ffn`]); returns whether
/// they were added.
#[allow(clippy::too_many_arguments)]
fn down(
    config: &ModelConfig,
    e: &ExpertWeights,
    mats: Mats<'_>,
    moe: &mut MoeBuffers,
    n: usize,
    tiling: Tiling,
    sum_into: Option<DeviceViewMut<'_, f32>>,
    stream: &Stream,
) -> Result<bool, ModelError> {
    let d = config.n_embd;
    let k = e.used;
    let slots = n * k;
    let ff = e.up.rows;
    let mm = tiling.f16();
    let input = if mm {
        row_scales(
            view(&moe.act, slots * ff)?,
            slots,
            ff,
            view_mut::<f32>(&mut moe.scales, slots)?,
            view_mut::<f16>(&mut moe.x16, slots * ff)?,
            stream,
        )
        .map_err(routed_error(&e.down))?;
        RoutedInput::F16 {
            x16: view(&moe.x16, slots * ff)?,
            scales: view(&moe.scales, slots)?,
        }
    } else {
        RoutedInput::Q8(view(&moe.q8_act, q8_bytes(slots, ff))?)
    };
    debug_assert!(
        sum_into.is_none() || tiling.tokens == 1,
        "the fused sum's tiles are of one"
    );
    if let (Some(mut x), RoutedInput::Q8(xq)) = (sum_into, input) {
        experts::routed_sum(
            &mats.down,
            xq,
            view(&moe.ids, slots)?,
            view(&moe.weights, slots)?,
            n,
            k,
            &mut x,
            stream,
        )
        .map_err(routed_error(&e.down))?;
        return Ok(true);
    }
    let route = Route::new(&moe.tiles, &moe.order, slots, mats.count, tiling.tokens)?;
    routed(
        &[mats.down],
        input,
        slots,
        SlotInput::Own,
        route,
        &mut [view_mut::<f32>(&mut moe.out, slots * d)?],
        stream,
    )
    .map_err(routed_error(&e.down))?;
    Ok(false)
}

/// Qwen 2 MoE's shared expert on the `n` tokens of `h`: its output into `proj`, its
/// gate's logits into the experts' room.
fn shared_expert(
    config: &ModelConfig,
    sh: &SharedExpert,
    bufs: &mut Buffers,
    n: usize,
    stream: &Stream,
) -> Result<(), ModelError> {
    let d = config.n_embd;
    let Some(moe) = bufs.moe.as_mut() else {
        unreachable!("the buffers of a model with experts hold the experts' room")
    };
    let sff = sh.up.rows;
    products(
        &[&sh.gate, &sh.up],
        Some(view(&bufs.h, n * d)?),
        Some(view(&moe.q8_in, q8_bytes(n, d))?),
        n,
        vec![
            view_mut::<f32>(&mut bufs.gate, n * sff)?,
            view_mut::<f32>(&mut bufs.up, n * sff)?,
        ],
        false,
        &mut bufs.batch_in,
        stream,
    )?;
    products(
        &[&sh.gate_inp],
        Some(view(&bufs.h, n * d)?),
        Some(view(&moe.q8_in, q8_bytes(n, d))?),
        n,
        vec![view_mut::<f32>(&mut moe.shared_gate, n)?],
        false,
        &mut bufs.batch_in,
        stream,
    )?;
    let down_q8 = takes_q8_for(&sh.down, n, &bufs.batch_in);
    kernels::gated(
        Some(view(&bufs.gate, n * sff)?),
        view(&bufs.up, n * sff)?,
        sff,
        super::ffn::gate_activation(config),
        None,
        (!down_q8)
            .then(|| view_mut::<f32>(&mut bufs.act, n * sff))
            .transpose()?,
        down_q8
            .then(|| view_mut::<u8>(&mut bufs.q8, q8_bytes(n, sff)))
            .transpose()?,
        stream,
    )?;
    let (f32_in, q8_in) = if down_q8 {
        (None, Some(view(&bufs.q8, q8_bytes(n, sff))?))
    } else {
        (Some(view(&bufs.act, n * sff)?), None)
    };
    products(
        &[&sh.down],
        f32_in,
        q8_in,
        n,
        vec![view_mut::<f32>(&mut bufs.proj, n * d)?],
        false,
        &mut bufs.batch_in,
        stream,
    )?;
    Ok(())
}
