//! The typed wrappers of `kernels/experts.hip`'s launchers (a mixture of experts'
//! routing, grouping and weighted sum), which check every length first. The launchers
//! are declared with the others, in `gpu/kernels.rs`.

#[cfg(hip_platform = "none")]
use hip_backend::HipError;
use hip_backend::{DeviceView, DeviceViewMut, Stream};

use super::{
    expect, on_device, ptr_or_null, q8_bytes, small, KernelError, NormWeight, ShapeError, SlotBias,
};

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

/// What a routing launch writes, checked, as the launchers take it.
struct RouteOut {
    ids: *mut std::ffi::c_void,
    weights: *mut std::ffi::c_void,
    tiles: *mut std::ffi::c_void,
    order: *mut std::ffi::c_void,
    gating: i32,
    renorm: i32,
}

impl RouteOut {
    /// Checks the routing's shape and its outputs' lengths for `n_tokens`, adding their
    /// devices (and the bias's) to `devices`.
    #[allow(clippy::too_many_arguments)]
    fn check(
        kernel: &'static str,
        n_tokens: usize,
        n_experts: usize,
        used: usize,
        gating: Gating,
        bias: Option<DeviceView<'_, f32>>,
        mut ids: DeviceViewMut<'_, i32>,
        mut weights: DeviceViewMut<'_, f32>,
        one_slot_tiles: Option<(DeviceViewMut<'_, i32>, DeviceViewMut<'_, i32>)>,
        devices: &mut Vec<usize>,
    ) -> Result<RouteOut, KernelError> {
        experts_in_range(kernel, n_experts, used)?;
        if used > MAX_USED {
            return Err(ShapeError {
                kernel,
                what: "the experts used per token",
                expected: MAX_USED,
                actual: used,
            }
            .into());
        }
        let slots = n_tokens * used;
        expect(kernel, "the expert ids", ids.len(), slots)?;
        expect(kernel, "the expert weights", weights.len(), slots)?;
        devices.extend([ids.device_ordinal(), weights.device_ordinal()]);
        let (tiles, order) = match one_slot_tiles {
            Some((mut tiles, mut order)) => {
                expect(kernel, "the tiles", tiles.len(), 3 * slots)?;
                expect(kernel, "the slot order", order.len(), slots)?;
                devices.extend([tiles.device_ordinal(), order.device_ordinal()]);
                (tiles.as_mut_ptr(), order.as_mut_ptr())
            }
            None => (std::ptr::null_mut(), std::ptr::null_mut()),
        };
        if let Some(b) = &bias {
            expect(kernel, "the router's bias", b.len(), n_experts)?;
            devices.push(b.device_ordinal());
        }
        let (gating, renorm) = match gating {
            Gating::Softmax { renormalize } => (0, i32::from(renormalize)),
            Gating::SoftmaxOfChosen => (1, 0),
        };
        Ok(RouteOut {
            ids: ids.as_mut_ptr(),
            weights: weights.as_mut_ptr(),
            tiles,
            order,
            gating,
            renorm,
        })
    }
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
    ids: DeviceViewMut<'_, i32>,
    weights: DeviceViewMut<'_, f32>,
    one_slot_tiles: Option<(DeviceViewMut<'_, i32>, DeviceViewMut<'_, i32>)>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "moe_route";
    let mut devices = vec![logits.device_ordinal()];
    let out = RouteOut::check(
        K,
        n_tokens,
        n_experts,
        used,
        gating,
        bias,
        ids,
        weights,
        one_slot_tiles,
        &mut devices,
    )?;
    expect(K, "the logits", logits.len(), n_tokens * n_experts)?;
    let device = on_device(stream, &devices)?;
    launch!(
        rf_moe_route,
        "moe_route",
        logits.as_ptr(),
        ptr_or_null(bias),
        small(K, "tokens", n_tokens)?,
        n_experts as i32,
        used as i32,
        out.gating,
        out.renorm,
        out.ids,
        out.weights,
        out.tiles,
        out.order,
        device,
        stream.as_raw(),
    )
}

/// Workgroups of [`moe_router_route`]'s cluster (`kRouterCluster` in experts.hip), and
/// the most threads each takes (`kRouterThreads`).
const ROUTER_CLUSTER: usize = 8;
const ROUTER_THREADS: usize = 512;

/// Whether [`moe_router_route`] runs on `device` for rows of `dim` and `n_experts`
/// experts: a build for NVIDIA's thread block clusters (every target sm_90 or later) on
/// a device that has them, a router of whole rows a cluster's workgroup (at most one a
/// 32-lane group), and a norm of at most 512 threads (rows of at most 2,048).
pub fn moe_router_route_fits(device: usize, dim: usize, n_experts: usize) -> bool {
    // As norm.h's norm_threads: about four values a thread, in whole 32-lane groups.
    let threads = dim.div_ceil(4).div_ceil(32).clamp(1, 32) * 32;
    let shape = n_experts.is_multiple_of(ROUTER_CLUSTER)
        && n_experts <= MAX_EXPERTS
        && threads <= ROUTER_THREADS
        && n_experts / ROUTER_CLUSTER <= threads / 32;
    #[cfg(not(hip_platform = "none"))]
    {
        let Ok(ordinal) = i32::try_from(device) else {
            return false;
        };
        // SAFETY: a query of the device's attributes, with no memory passed.
        shape && unsafe { sys::rf_moe_router_route_available(ordinal) } == 1
    }
    #[cfg(hip_platform = "none")]
    {
        let _ = (device, shape);
        false
    }
}

/// One token's router behind its norm, and its routing, in one launch (where
/// [`moe_router_route_fits`]): `h` and `q8` get `x` normed as
/// [`super::rms_norm`] gives it (the same bits), `logits` the router's F32 rows
/// (`router`, their bytes) times it, and the rest the routing as [`moe_route`] writes it.
#[allow(clippy::too_many_arguments)]
pub fn moe_router_route(
    x: DeviceView<'_, f32>,
    norm: NormWeight<'_>,
    eps: f32,
    router: DeviceView<'_, u8>,
    bias: Option<DeviceView<'_, f32>>,
    n_experts: usize,
    used: usize,
    gating: Gating,
    mut logits: DeviceViewMut<'_, f32>,
    mut h: DeviceViewMut<'_, f32>,
    mut q8: DeviceViewMut<'_, u8>,
    ids: DeviceViewMut<'_, i32>,
    weights: DeviceViewMut<'_, f32>,
    one_slot_tiles: Option<(DeviceViewMut<'_, i32>, DeviceViewMut<'_, i32>)>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "moe_router_route";
    let dim = x.len();
    norm.check(K, dim)?;
    expect(K, "the router's bytes", router.len(), n_experts * dim * 4)?;
    expect(K, "the logits", logits.len(), n_experts)?;
    expect(K, "the normed row", h.len(), dim)?;
    expect(K, "the Q8 row", q8.len(), q8_bytes(1, dim))?;
    expect(K, "the width modulo 32", dim % 32, 0)?;
    let mut devices = vec![
        x.device_ordinal(),
        norm.bytes.device_ordinal(),
        router.device_ordinal(),
        logits.device_ordinal(),
        h.device_ordinal(),
        q8.device_ordinal(),
    ];
    let out = RouteOut::check(
        K,
        1,
        n_experts,
        used,
        gating,
        bias,
        ids,
        weights,
        one_slot_tiles,
        &mut devices,
    )?;
    let device = on_device(stream, &devices)?;
    launch!(
        rf_moe_router_route,
        "moe_router_route",
        x.as_ptr(),
        norm.bytes.as_ptr(),
        norm.type_code,
        small(K, "the width", dim)?,
        eps,
        router.as_ptr(),
        ptr_or_null(bias),
        n_experts as i32,
        used as i32,
        out.gating,
        out.renorm,
        logits.as_mut_ptr(),
        h.as_mut_ptr(),
        q8.as_mut_ptr(),
        out.ids,
        out.weights,
        out.tiles,
        out.order,
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

/// The device's choice of experts on ties, signed zeros and NaN scores, against the
/// ranking the host's routing follows (larger first, the smaller index among equals, a
/// NaN last); on a machine without a GPU it says SKIPPED.
#[cfg(all(test, not(hip_platform = "none")))]
mod tests {
    use hip_backend::Device;

    use super::*;

    /// Token rows of logits; the ids and weights the device gives for them.
    fn route(
        device: &Device,
        logits: &[f32],
        n_experts: usize,
        used: usize,
        gating: Gating,
    ) -> (Vec<i32>, Vec<f32>) {
        let stream = device.new_stream().expect("a stream");
        let arena = device.new_arena(1 << 20).expect("an arena");
        let n_tokens = logits.len() / n_experts;
        let mut l = arena.alloc_elements::<f32>(logits.len()).expect("logits");
        let mut ids = arena.alloc_elements::<i32>(n_tokens * used).expect("ids");
        let mut weights = arena
            .alloc_elements::<f32>(n_tokens * used)
            .expect("weights");
        stream
            .write_from_host(logits, l.view_mut().expect("view"))
            .expect("logits to the device");
        moe_route(
            l.view().expect("view"),
            None,
            n_tokens,
            n_experts,
            used,
            gating,
            ids.view_mut().expect("view"),
            weights.view_mut().expect("view"),
            None,
            &stream,
        )
        .expect("routing");
        let mut out = (vec![0; n_tokens * used], vec![0.0; n_tokens * used]);
        stream
            .read_to_host(ids.view().expect("view"), &mut out.0)
            .expect("ids back");
        stream
            .read_to_host(weights.view().expect("view"), &mut out.1)
            .expect("weights back");
        out
    }

    /// The `used` best of a row: larger first, equal values (-0 and +0 among them) by
    /// index, NaN last.
    fn ranked(row: &[f32], used: usize) -> Vec<i32> {
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| match (row[a].is_nan(), row[b].is_nan()) {
            (true, true) => a.cmp(&b),
            (true, false) => std::cmp::Ordering::Greater,
            (false, true) => std::cmp::Ordering::Less,
            (false, false) => row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)),
        });
        order[..used].iter().map(|&e| e as i32).collect()
    }

    #[test]
    fn the_device_ranks_ties_zeros_and_nan_as_the_host_does() {
        let test = "the_device_ranks_ties_zeros_and_nan_as_the_host_does";
        let Some(device) = hip_backend::device_or_skip(test) else {
            return;
        };
        for (n_experts, used) in [(32, 4), (128, 8), (256, 8), (1024, 32)] {
            // Equal logits; values repeated by a stride (ties among the chosen and at the
            // cut); one clear order.
            let rows: Vec<Vec<f32>> = vec![
                vec![0.5; n_experts],
                (0..n_experts)
                    .map(|e| ((e * 37) % 16) as f32 * 0.25)
                    .collect(),
                (0..n_experts)
                    .map(|e| ((e * 7919) % n_experts) as f32 * 0.01)
                    .collect(),
            ];
            let logits: Vec<f32> = rows.concat();
            let gating = Gating::Softmax { renormalize: true };
            let (ids, weights) = route(&device, &logits, n_experts, used, gating);
            for (t, row) in rows.iter().enumerate() {
                let got = &ids[t * used..(t + 1) * used];
                assert_eq!(got, ranked(row, used), "{n_experts} experts, row {t}");
                let sum: f32 = weights[t * used..(t + 1) * used].iter().sum();
                assert!((sum - 1.0).abs() < 1e-5, "row {t}: weights sum to {sum}");
            }
            // Raw logits ranked (gpt-oss): signed zeros tie, NaN ranks after -inf.
            let mut row = vec![-1.0f32; n_experts];
            for (i, e) in [(0, 5), (1, 2), (2, n_experts - 1), (3, 9)] {
                row[e] = if i % 2 == 0 { -0.0 } else { 0.0 };
            }
            row[1] = f32::NAN;
            row[3] = f32::NEG_INFINITY;
            row[n_experts / 2] = f32::NAN;
            let k = used.min(n_experts - 3);
            let (ids, weights) = route(&device, &row, n_experts, k, Gating::SoftmaxOfChosen);
            assert_eq!(ids, ranked(&row, k), "{n_experts} experts, raw logits");
            assert!(weights.iter().all(|w| w.is_finite()), "{weights:?}");
            // Every expert chosen: the NaN and -inf ones last.
            if n_experts <= MAX_USED {
                let (ids, _) = route(&device, &row, n_experts, n_experts, Gating::SoftmaxOfChosen);
                assert_eq!(
                    ids,
                    ranked(&row, n_experts),
                    "{n_experts} experts, all chosen"
                );
            }
        }
    }
}

/// Where a pass read in place finds its experts, and where it stages the missed ones
/// ([`moe_stage`]).
pub struct Staging<'a> {
    /// The layer's tables: one a matrix (at most three), `count` addresses each, one
    /// after the other.
    pub tables: DeviceView<'a, u64>,
    pub count: usize,
    /// Bytes of one expert of each matrix.
    pub mat_bytes: &'a [usize],
    /// The device's addresses of the mapped range `[lo, hi)`: an expert there is staged.
    pub mapped: std::ops::Range<u64>,
}

/// The room a slot takes in [`moe_stage`]'s `staged` for experts of `mat_bytes` (each
/// matrix on a 256-byte boundary), and each matrix's place in it.
pub fn stage_room(mat_bytes: &[usize]) -> (usize, Vec<usize>) {
    let mut at = Vec::with_capacity(mat_bytes.len());
    let mut room = 0;
    for &bytes in mat_bytes {
        at.push(room);
        room += bytes.next_multiple_of(256);
    }
    (room, at)
}

/// Stages the missed experts of a pass read in place: each slot of `ids` whose expert
/// lies in the mapped range (`staging.tables`, read on the device) has it copied into
/// its room of `staged` ([`stage_room`] bytes a slot; the first slot routed to an
/// expert copies it), over the link in whole lines; `pass` gets the tables the products
/// read: the staged experts' rooms, the others' addresses as in `staging.tables`.
pub fn moe_stage(
    ids: DeviceView<'_, i32>,
    staging: &Staging<'_>,
    mut staged: DeviceViewMut<'_, u8>,
    mut pass: DeviceViewMut<'_, u64>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "moe_stage";
    let n_mats = staging.mat_bytes.len();
    if !(1..=3).contains(&n_mats) {
        return Err(ShapeError {
            kernel: K,
            what: "the matrices",
            expected: 3,
            actual: n_mats,
        }
        .into());
    }
    let entries = n_mats * staging.count;
    expect(K, "the tables", staging.tables.len(), entries)?;
    expect(K, "the pass's tables", pass.len(), entries)?;
    let (room, at) = stage_room(staging.mat_bytes);
    let slots = ids.len();
    expect(K, "the staged room", staged.len(), slots * room)?;
    let device = on_device(
        stream,
        &[
            ids.device_ordinal(),
            staging.tables.device_ordinal(),
            staged.device_ordinal(),
            pass.device_ordinal(),
        ],
    )?;
    launch!(
        rf_moe_stage,
        "moe_stage",
        ids.as_ptr(),
        small(K, "slots", slots)?,
        staging.tables.as_ptr(),
        n_mats as i32,
        small(K, "experts", staging.count)?,
        staging.mat_bytes.as_ptr(),
        at.as_ptr(),
        room,
        staging.mapped.start,
        staging.mapped.end,
        staged.as_mut_ptr(),
        pass.as_mut_ptr(),
        device,
        stream.as_raw(),
    )
}
