//! A mixture of experts' routing on the GPU: the layer's input normed, the router's
//! logits, and each token's experts chosen and grouped into tiles, in as few launches as
//! the device and the shapes allow (`kernels::moe_router_route`, `kernels::rms_norm_router`,
//! else the norm, the router's product and `kernels::moe_route`).

use dequant::gpu::experts;
use dequant::gpu::matvec::q8_bytes;
use gguf_format::GgmlType;
use hip_backend::Stream;

use super::products::products;
use super::{view, view_mut, Buffers};
use crate::config::ModelConfig;
use crate::gpu::kernels;
use crate::gpu::weights::{ExpertWeights, Norm};
use crate::ModelError;

/// How a layer's routed products run: tiles of up to `tokens` slots
/// ([`experts::tile_tokens_for`]), and the skinny products they may take.
#[derive(Clone, Copy, Debug)]
pub(super) struct Tiling {
    pub tokens: usize,
    pub skinny: experts::SkinnyTiles,
}

impl Tiling {
    /// Whether the products take f16 input ([`experts::takes_f16`]), else Q8 blocks.
    pub fn f16(&self) -> bool {
        experts::takes_f16(self.tokens, self.skinny)
    }

    /// Whether the products are the decode products in tiles of one slot, which also
    /// read experts placed by a table.
    pub fn one_slot(&self) -> bool {
        self.tokens == 1
    }
}

/// The layer's input normed into `h` (f32) and the experts' Q8 input, the router's
/// logits, the choice of each token's experts and their weights, and the slots grouped
/// into tiles; returns how the routed products run.
pub(super) fn norm_and_route(
    config: &ModelConfig,
    e: &ExpertWeights,
    norm: &Norm,
    bufs: &mut Buffers,
    n: usize,
    stream: &Stream,
) -> Result<Tiling, ModelError> {
    let d = config.n_embd;
    let (k, count) = (e.used, e.count);
    let slots = n * k;
    let Some(moe) = bufs.moe.as_mut() else {
        unreachable!("the buffers of a model with experts hold the experts' room")
    };
    // (Without a gate tensor, up's type stands in for it.)
    let types = [
        e.gate.as_ref().map_or(e.up.ty, |g| g.ty),
        e.up.ty,
        e.down.ty,
    ];
    let skinny = experts::skinny_tiles(bufs.batch_in.skinny, &types, &[d, e.up.rows]);
    let tile_tokens = experts::tile_tokens_for(slots, count, e.up.rows, skinny);
    let n_tiles = experts::max_tiles(slots, count, tile_tokens);
    // The layer's input, normed (f32 for float products, Q8 blocks for the experts), the
    // router's logits, and the choice of experts. One token with an F32 router takes
    // fewer launches (each is a wait on the step's path): norm, router and routing in
    // one where the device has thread block clusters and the shapes fit, else the norm
    // and the router in one (each router row's workgroup norming the row again).
    let one_token_f32 =
        n == 1 && e.router.ty == GgmlType::F32 && e.router.rows == count && e.router.cols == d;
    let x = view(&bufs.x, n * d)?;
    let h = view_mut::<f32>(&mut bufs.h, n * d)?;
    let q8_in = view_mut::<u8>(&mut moe.q8_in, q8_bytes(n, d))?;
    let logits = view_mut::<f32>(&mut moe.logits, n * count)?;
    let bias = e.router_bias.as_ref().map(|b| b.view()).transpose()?;
    let ids = view_mut::<i32>(&mut moe.ids, slots)?;
    let weights = view_mut::<f32>(&mut moe.weights, slots)?;
    let one_slot_tiles = if tile_tokens == 1 {
        Some((
            view_mut::<i32>(&mut moe.tiles, 3 * n_tiles)?,
            view_mut::<i32>(&mut moe.order, slots)?,
        ))
    } else {
        None
    };
    let eps = config.rms_norm_eps;
    if one_token_f32 && kernels::moe_router_route_fits(stream.device_ordinal(), d, count) {
        kernels::moe_router_route(
            x,
            norm.weight(),
            eps,
            e.router.bytes()?,
            bias,
            count,
            k,
            e.gating,
            logits,
            h,
            q8_in,
            ids,
            weights,
            one_slot_tiles,
            stream,
        )?;
    } else {
        if one_token_f32 {
            let router = e.router.bytes()?;
            let (h, q8) = (Some(h), Some(q8_in));
            kernels::rms_norm_router(
                x,
                norm.weight(),
                n,
                d,
                eps,
                router,
                count,
                logits,
                h,
                q8,
                stream,
            )?;
        } else {
            kernels::rms_norm(
                x,
                norm.weight(),
                n,
                d,
                eps,
                Some(h),
                false,
                Some(q8_in),
                stream,
            )?;
            products(
                &[&e.router],
                Some(view(&bufs.h, n * d)?),
                Some(view(&moe.q8_in, q8_bytes(n, d))?),
                n,
                vec![logits],
                false,
                &mut bufs.batch_in,
                stream,
            )?;
        }
        let logits = view(&moe.logits, n * count)?;
        kernels::moe_route(
            logits,
            bias,
            n,
            count,
            k,
            e.gating,
            ids,
            weights,
            one_slot_tiles,
            stream,
        )?;
    }
    if tile_tokens > 1 {
        kernels::moe_tiles(
            view(&moe.ids, slots)?,
            count,
            tile_tokens,
            view_mut::<i32>(&mut moe.tiles, 3 * n_tiles)?,
            view_mut::<i32>(&mut moe.order, slots)?,
            stream,
        )?;
    }
    Ok(Tiling {
        tokens: tile_tokens,
        skinny,
    })
}
