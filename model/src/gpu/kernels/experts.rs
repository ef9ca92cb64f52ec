//! The typed wrappers of `kernels/experts.hip`'s launchers (a mixture of experts'
//! routing, grouping and weighted sum), which check every length first. The launchers
//! are declared with the others, in `gpu/kernels.rs`.

#[cfg(hip_platform = "none")]
use hip_backend::HipError;
use hip_backend::{DeviceView, DeviceViewMut, Stream};

use super::{expect, on_device, ptr_or_null, small, KernelError, ShapeError, SlotBias};

/// Most experts the routing kernel ranks (`crate::config::MAX_EXPERTS`).
const MAX_EXPERTS: usize = 1024;
/// Most experts a token uses that the routing kernel takes (it keeps each rank's choice
/// in a lane of 32).
pub const MAX_USED: usize = 32;

/// How a router's logits become the weights of the chosen experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over every expert, the `used` largest probabilities chosen, divided by
    /// their sum when `renormalize` (Qwen 3 MoE, Mixtral) or kept (Qwen 2 MoE).
    Softmax { renormalize: bool },
    /// The `used` largest logits chosen, weighted by the softmax of their own logits
    /// (gpt-oss).
    SoftmaxOfChosen,
}

#[cfg(not(hip_platform = "none"))]
use super::sys;

fn experts_in_range(kernel: &'static str, n_experts: usize, used: usize) -> Result<(), ShapeError> {
    if n_experts == 0 || n_experts > MAX_EXPERTS {
        return Err(ShapeError {
            kernel,
            what: "the experts",
            expected: MAX_EXPERTS,
            actual: n_experts,
        });
    }
    if used == 0 || used > n_experts {
        return Err(ShapeError {
            kernel,
            what: "the experts used per token",
            expected: n_experts,
            actual: used,
        });
    }
    Ok(())
}

/// For each of `n_tokens` rows of router `logits` (`n_experts` each), the `used` chosen
/// experts in rank order (`ids`, `n_tokens × used`) and their weights (`weights`), as
/// `gating` says. With `one_slot_tiles` (`tiles`: 3 per slot, `order`: 1 per slot), each
/// slot is also written as its own tile, for the routed products' tiles of one slot.
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    logits: DeviceView<'_, f32>,
    bias: Option<DeviceView<'_, f32>>,
    n_tokens: usize,
    n_experts: usize,
    used: usize,
    gating: Gating,
    mut ids: DeviceViewMut<'_, i32>,
    mut weights: DeviceViewMut<'_, f32>,
    one_slot_tiles: Option<(DeviceViewMut<'_, i32>, DeviceViewMut<'_, i32>)>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "moe_route";
    experts_in_range(K, n_experts, used)?;
    if used > MAX_USED {
        return Err(ShapeError {
            kernel: K,
            what: "the experts used per token",
            expected: MAX_USED,
            actual: used,
        }
        .into());
    }
    expect(K, "the logits", logits.len(), n_tokens * n_experts)?;
    let slots = n_tokens * used;
    expect(K, "the expert ids", ids.len(), slots)?;
    expect(K, "the expert weights", weights.len(), slots)?;
    let mut devices = vec![
        logits.device_ordinal(),
        ids.device_ordinal(),
        weights.device_ordinal(),
    ];
    let (tiles_ptr, order_ptr) = match one_slot_tiles {
        Some((mut tiles, mut order)) => {
            expect(K, "the tiles", tiles.len(), 3 * slots)?;
            expect(K, "the slot order", order.len(), slots)?;
            devices.extend([tiles.device_ordinal(), order.device_ordinal()]);
            (tiles.as_mut_ptr(), order.as_mut_ptr())
        }
        None => (std::ptr::null_mut(), std::ptr::null_mut()),
    };
    let device = on_device(stream, &devices)?;
    if let Some(b) = &bias {
        expect(K, "the router's bias", b.len(), n_experts)?;
        devices.push(b.device_ordinal());
    }
    let (code, renorm) = match gating {
        Gating::Softmax { renormalize } => (0, i32::from(renormalize)),
        Gating::SoftmaxOfChosen => (1, 0),
    };
    launch!(
        rf_moe_route,
        "moe_route",
        logits.as_ptr(),
        ptr_or_null(bias),
        small(K, "tokens", n_tokens)?,
        n_experts as i32,
        used as i32,
        code,
        renorm,
        ids.as_mut_ptr(),
        weights.as_mut_ptr(),
        tiles_ptr,
        order_ptr,
        device,
        stream.as_raw(),
    )
}

/// The slots of `ids` (expert indices below `n_experts`, as [`moe_route`] writes them;
/// a slot of another id, such as -1, is left out) grouped by expert into `order`, and
/// cut into `tiles` of at most `tile_tokens` slots
/// (`(expert, first, count)` triples, `tiles.len() / 3` of them, the unused with a count
/// of 0): the layout `dequant::gpu::experts::routed_products` reads.
pub fn moe_tiles(
    ids: DeviceView<'_, i32>,
    n_experts: usize,
    tile_tokens: usize,
    mut tiles: DeviceViewMut<'_, i32>,
    mut order: DeviceViewMut<'_, i32>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "moe_tiles";
    experts_in_range(K, n_experts, 1)?;
    let slots = ids.len();
    expect(K, "the slot order", order.len(), slots)?;
    let max_tiles = dequant::gpu::experts::max_tiles(slots, n_experts, tile_tokens);
    expect(K, "the tiles", tiles.len(), 3 * max_tiles)?;
    let device = on_device(
        stream,
        &[
            ids.device_ordinal(),
            tiles.device_ordinal(),
            order.device_ordinal(),
        ],
    )?;
    launch!(
        rf_moe_tiles,
        "moe_tiles",
        ids.as_ptr(),
        small(K, "slots", slots)?,
        n_experts as i32,
        small(K, "tile tokens", tile_tokens.max(1))?,
        small(K, "tiles", max_tiles)?,
        tiles.as_mut_ptr(),
        order.as_mut_ptr(),
        device,
        stream.as_raw(),
    )
}

/// `x[t] += Σ_r weights[t, r] · y[t·used + r]` over `n_tokens` rows of `d` (with `bias`,
/// each slot's expert's bias row added to its `y` first), plus `sigmoid(gate[t]) · s[t]`
/// for a shared expert's output `s` and its gate's logits. Slots weighted 0 are skipped,
/// their rows of `y` never read.
#[allow(clippy::too_many_arguments)]
pub fn moe_combine(
    y: DeviceView<'_, f32>,
    weights: DeviceView<'_, f32>,
    n_tokens: usize,
    used: usize,
    d: usize,
    shared: Option<(DeviceView<'_, f32>, DeviceView<'_, f32>)>,
    bias: Option<SlotBias<'_>>,
    mut x: DeviceViewMut<'_, f32>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "moe_combine";
    expect(K, "the experts' outputs", y.len(), n_tokens * used * d)?;
    expect(K, "the expert weights", weights.len(), n_tokens * used)?;
    expect(K, "the residual stream", x.len(), n_tokens * d)?;
    let mut devices = vec![
        y.device_ordinal(),
        weights.device_ordinal(),
        x.device_ordinal(),
    ];
    let (s, g) = match shared {
        Some((s, g)) => {
            expect(K, "the shared expert's output", s.len(), n_tokens * d)?;
            expect(K, "the shared expert's gate", g.len(), n_tokens)?;
            devices.extend([s.device_ordinal(), g.device_ordinal()]);
            (Some(s), Some(g))
        }
        None => (None, None),
    };
    let bias_rows = match &bias {
        Some(b) => b.check(K, n_tokens * used, d, &mut devices)?,
        None => 0,
    };
    let device = on_device(stream, &devices)?;
    launch!(
        rf_moe_combine,
        "moe_combine",
        y.as_ptr(),
        weights.as_ptr(),
        small(K, "tokens", n_tokens)?,
        small(K, "experts used", used)?,
        small(K, "the width", d)?,
        ptr_or_null(s),
        ptr_or_null(g),
        ptr_or_null(bias.map(|b| b.bias)),
        ptr_or_null(bias.map(|b| b.ids)),
        bias_rows,
        x.as_mut_ptr(),
        device,
        stream.as_raw(),
    )
}
