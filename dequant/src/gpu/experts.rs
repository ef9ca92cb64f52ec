//! Products of routed experts (a mixture of experts' feed-forward block) on the GPU: the
//! twin of [`crate::matmul::QuantizedMatrix::matmul_routed`], with the routing read from
//! device memory so that a decode step needs nothing from the host.
//!
//! A *slot* is one token's choice of one expert (`n_tokens × used` of them). The slots are
//! grouped by expert into *tiles* of at most [`tile_tokens_for`] slots of one expert, and
//! a tile's expert rows are read once for all its slots ([`routed_products`]): in the
//! decode products (Q8 activations, tiles of one slot, of [`WIDE_TILE_TOKENS`] or of
//! [`MAX_TOKENS`]) while the experts get a few slots each
//! at most, on the matrix units for prompts and larger batches (f16 activations in tiles
//! of [`SKINNY_TILE_TOKENS`] or [`MATMUL_TILE_TOKENS`]; MXFP4's Q8 activations on the
//! int8 matrix units in tiles of [`SKINNY_TILE_TOKENS`]: [`SkinnyTiles`]); the tile sizes
//! and their measurements are in `experts/tiles.rs`. The caller (a kernel of its own, on
//! the device) writes the tiles as `(expert, first, count)` triples of `i32` and `order`,
//! the slots listed expert by expert; the grid is sized for [`max_tiles`], and tiles past
//! the routing's own have a count of 0.

use gguf_format::GgmlType;
use half::f16;
#[cfg(hip_platform = "none")]
use hip_backend::HipError;
use hip_backend::{DeviceView, DeviceViewMut, Stream};

use super::matvec::{matrix_bytes, q8_bytes, takes_q8, GpuMatrix, MAX_TOKENS};
use super::{check_device, GpuDequantError};
use crate::DequantError;

/// The experts of one 3-D tensor (`ffn_{gate,up,down}_exps`) on the device: `count`
/// matrices of `rows × cols` of a quantized type, one after the other in device memory
/// ([`GpuExperts::new`]), or each where a table of addresses says
/// ([`GpuExperts::from_table`]).
#[derive(Clone, Copy, Debug)]
pub struct GpuExperts<'a> {
    ty: GgmlType,
    count: usize,
    rows: usize,
    cols: usize,
    expert_bytes: usize,
    at: Placement<'a>,
}

#[derive(Clone, Copy, Debug)]
enum Placement<'a> {
    /// The `count` matrices one after the other.
    Packed(DeviceView<'a, u8>),
    /// The address of each expert's matrix, as the device reads it.
    Table(DeviceView<'a, u64>),
}

impl<'a> GpuExperts<'a> {
    /// Checks that `ty` is quantized and multiplied on the GPU, that rows are whole
    /// blocks, and that `bytes` holds exactly the `count` matrices.
    pub fn new(
        ty: GgmlType,
        count: usize,
        rows: usize,
        cols: usize,
        bytes: DeviceView<'a, u8>,
    ) -> Result<GpuExperts<'a>, DequantError> {
        let all = GpuMatrix::new(ty, total_rows(ty, count, rows, cols)?, cols, bytes)?;
        Ok(GpuExperts {
            ty,
            count,
            rows,
            cols: all.cols(),
            expert_bytes: bytes.len() / count.max(1),
            at: Placement::Packed(bytes),
        })
    }

    /// The experts of a tensor whose matrices lie apart: `table[e]` is the address at
    /// which the device reads expert `e`'s `rows × cols` matrix of type `ty`, in device
    /// memory or in host memory mapped for the device. Only the decode products take
    /// them ([`routed_products`] with Q8 input in tiles of one slot, and
    /// [`routed_sum`]): a slot's product is then the same as if its expert's matrix lay
    /// in a packed tensor.
    ///
    /// # Safety
    /// Until the products launched with these experts have run, each of the table's
    /// `count` entries must hold the device address of a whole matrix of `rows × cols`
    /// of type `ty` (its GGUF blocks), readable by the stream's device and unchanged.
    pub unsafe fn from_table(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        table: DeviceView<'a, u64>,
    ) -> Result<GpuExperts<'a>, DequantError> {
        let count = table.len();
        if count == 0 {
            return Err(DequantError::MatrixTooLarge { ty, rows, cols });
        }
        // The packed tensor's limits, though its matrices lie apart.
        matrix_bytes(ty, total_rows(ty, count, rows, cols)?, cols)?;
        let expert_bytes = matrix_bytes(ty, rows, cols)?;
        Ok(GpuExperts {
            ty,
            count,
            rows,
            cols,
            expert_bytes,
            at: Placement::Table(table),
        })
    }

    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Experts in the tensor.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Rows of one expert's matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of one expert's matrix.
    pub fn expert_bytes(&self) -> usize {
        self.expert_bytes
    }

    /// Whether the matrices lie where a table says ([`GpuExperts::from_table`]).
    pub fn is_table(&self) -> bool {
        matches!(self.at, Placement::Table(_))
    }

    fn device_ordinal(&self) -> usize {
        match self.at {
            Placement::Packed(bytes) => bytes.device_ordinal(),
            Placement::Table(table) => table.device_ordinal(),
        }
    }

    /// The kernels' weights argument and stride between experts: the packed matrices
    /// and their size, or the table and 0.
    #[cfg(not(hip_platform = "none"))]
    fn kernel_weights(&self) -> (*const std::ffi::c_void, usize) {
        match self.at {
            Placement::Packed(bytes) => (bytes.as_ptr(), self.expert_bytes),
            Placement::Table(table) => (table.as_ptr(), 0),
        }
    }
}

/// The rows of `count` experts of `rows × cols` of type `ty` one after the other, once
/// `ty` is known to be quantized and multiplied on the GPU.
fn total_rows(ty: GgmlType, count: usize, rows: usize, cols: usize) -> Result<usize, DequantError> {
    if !takes_q8(ty) {
        return Err(DequantError::NoProductKernel { ty });
    }
    count
        .checked_mul(rows)
        .ok_or(DequantError::MatrixTooLarge { ty, rows, cols })
}

/// Where a slot's activations are: its token's row (`per_token` slots a token: the
/// layer's input, shared by the token's experts), or a row of its own (the experts'
/// activations, one row per slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotInput {
    Token { per_token: usize },
    Own,
}

mod tiles;
pub use tiles::*;

/// What both kinds of routed products check of their arguments, and what their
/// launchers then take.
#[derive(Clone, Copy)]
#[cfg_attr(hip_platform = "none", allow(dead_code))]
struct Shape {
    n_tiles: usize,
    tile_tokens: usize,
    slot_div: usize,
    n_x: usize,
    device: i32,
}

/// Checks the experts (one type and shape), the slots against the input's rows, the
/// tiles (the most `tile_tokens` take), the outputs (a row per slot) and the devices.
#[allow(clippy::too_many_arguments)]
fn check_routed(
    experts: &[GpuExperts<'_>],
    n_x: usize,
    input: SlotInput,
    tiles: &DeviceView<'_, i32>,
    order: &DeviceView<'_, i32>,
    tile_tokens: usize,
    x_device: usize,
    outs: &[DeviceViewMut<'_, f32>],
    stream: &Stream,
) -> Result<Shape, GpuDequantError> {
    let first = experts.first().ok_or(DequantError::ProductCount {
        matrices: 0,
        outputs: outs.len(),
    })?;
    if experts.len() > 2 || experts.len() != outs.len() {
        return Err(DequantError::ProductCount {
            matrices: experts.len(),
            outputs: outs.len(),
        }
        .into());
    }
    for e in experts {
        if e.ty() != first.ty() || e.cols() != first.cols() {
            return Err(DequantError::MixedProducts {
                first: (first.ty(), first.cols()),
                other: (e.ty(), e.cols()),
            }
            .into());
        }
        if e.rows() != first.rows() || e.count() != first.count() {
            return Err(DequantError::MixedProducts {
                first: (first.ty(), first.rows()),
                other: (e.ty(), e.rows()),
            }
            .into());
        }
    }
    let n_slots = order.len();
    let (slot_div, expected_slots) = match input {
        SlotInput::Token { per_token } => (per_token, n_x.saturating_mul(per_token)),
        SlotInput::Own => (1, n_x),
    };
    if slot_div == 0 || n_slots != expected_slots || n_slots == 0 {
        return Err(DequantError::InputLength {
            n_tokens: n_x,
            cols: slot_div,
            expected: expected_slots,
            actual: n_slots,
        }
        .into());
    }
    let n_tiles = max_tiles(n_slots, first.count(), tile_tokens);
    if tiles.len() != 3 * n_tiles || n_tiles > 65_535 || n_x > i32::MAX as usize {
        return Err(DequantError::InputLength {
            n_tokens: n_slots,
            cols: 3,
            expected: 3 * n_tiles,
            actual: tiles.len(),
        }
        .into());
    }
    let device = check_device(stream, x_device, tiles.device_ordinal())?;
    check_device(stream, order.device_ordinal(), first.device_ordinal())?;
    for (e, out) in experts.iter().zip(outs.iter()) {
        check_device(stream, e.device_ordinal(), out.device_ordinal())?;
        DequantError::check_output(out.len(), n_slots, e.rows())?;
    }
    Ok(Shape {
        n_tiles,
        tile_tokens,
        slot_div,
        n_x,
        device,
    })
}

/// The routed products' input: Q8 blocks for the decode products, or f16 rows and a
/// scale each, as [`row_scales`](super::matmul::row_scales) makes them, for the matrix
/// units'.
#[derive(Clone, Copy, Debug)]
pub enum RoutedInput<'a> {
    Q8(DeviceView<'a, u8>),
    F16 {
        x16: DeviceView<'a, f16>,
        scales: DeviceView<'a, f32>,
    },
}

/// The routed products: for each slot `s` of the tiles, `outs[m][s] = x_s · experts[m]_eᵀ`
/// with `e` the tile's expert and `x_s` the slot's activations (`n_x` rows of `input`,
/// `slots` says which row). One or two tensors of one type and shape (gate and up), one
/// output each of `n_slots × rows`. `tiles` holds [`max_tiles`] triples of at most
/// `tile_tokens` slots, `order` the `n_slots` slots; both are read on the device, and an
/// expert index or slot out of range there is the writer's error (the kernels do not
/// check them).
///
/// Q8 input runs the decode products, for tiles of 1, [`WIDE_TILE_TOKENS`] or
/// [`MAX_TOKENS`] slots, or for MXFP4 experts in tiles of [`SKINNY_TILE_TOKENS`] the int8
/// matrix units (where the device runs the skinny products and the width is a multiple
/// of 64: else the launch is refused), which give each block's integer sums as the
/// decode products do and add them in another order. In the decode products each
/// slot's product is its expert's [`matvec`](super::matvec::matvec), bit for bit where a
/// row takes at most 16 tasks (a block of 32 values, or a quarter of a K-quant's 256);
/// in tiles of one slot a narrower row may run on 16 threads where the dense product
/// runs it on 32, and a thread then adds two tasks in one fused multiply-add where the
/// dense product adds them by a shuffle (the same sums, rounded once less). f16
/// input runs the matrix units, for tiles of [`SKINNY_TILE_TOKENS`] (the skinny kernel,
/// where it runs and takes the type; else the tiled one) or [`MATMUL_TILE_TOKENS`] (the
/// tiled kernel): each slot's product agrees with its expert's to rounding, as
/// [`matmul`](super::matmul::matmul) agrees with `matvec`.
#[allow(clippy::too_many_arguments)]
pub fn routed_products(
    experts: &[GpuExperts<'_>],
    input: RoutedInput<'_>,
    n_x: usize,
    slots: SlotInput,
    tiles: DeviceView<'_, i32>,
    order: DeviceView<'_, i32>,
    tile_tokens: usize,
    outs: &mut [DeviceViewMut<'_, f32>],
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    let int8_tiles = experts.first().map(|e| e.ty()) == Some(GgmlType::MXFP4)
        && SKINNY_TILE_TOKENS.contains(&tile_tokens);
    let (takes, x_device) = match input {
        RoutedInput::Q8(x) => (
            matches!(tile_tokens, 1 | WIDE_TILE_TOKENS | MAX_TOKENS) || int8_tiles,
            x.device_ordinal(),
        ),
        RoutedInput::F16 { x16, .. } => (
            tile_tokens == MATMUL_TILE_TOKENS || SKINNY_TILE_TOKENS.contains(&tile_tokens),
            x16.device_ordinal(),
        ),
    };
    if !takes {
        return Err(DequantError::ProductTokens {
            n_tokens: tile_tokens,
            max: MAX_TOKENS,
        }
        .into());
    }
    // Experts placed by a table run the decode products in tiles of one slot alone, all
    // placed alike.
    let tables = experts.iter().filter(|e| e.is_table()).count();
    let decode = matches!(input, RoutedInput::Q8(_)) && tile_tokens == 1;
    if tables > 0 && (tables != experts.len() || !decode) {
        return Err(DequantError::TableExperts { tile_tokens }.into());
    }
    let shape = check_routed(
        experts,
        n_x,
        slots,
        &tiles,
        &order,
        tile_tokens,
        x_device,
        outs,
        stream,
    )?;
    let cols = experts[0].cols();
    let (expected, actual) = match input {
        RoutedInput::Q8(x) => (q8_bytes(n_x, cols), x.len()),
        RoutedInput::F16 { x16, scales } => {
            check_device(stream, scales.device_ordinal(), x16.device_ordinal())?;
            DequantError::check_input(scales.len(), n_x, 1)?;
            (n_x.saturating_mul(cols), x16.len())
        }
    };
    DequantError::check_input_of(actual, n_x, cols, expected)?;
    launch(experts, input, tiles, order, shape, outs, stream)
}

/// The routed products of a few tokens' slots with their weighted sum fused (a mixture's
/// down projection while decoding): for each of `n_tokens` tokens `t` of `k` slots,
/// `out[t] += Σ_r weights[s] · (x_s · experts_{ids[s]}ᵀ)` with `s = t·k + r`, the ranks
/// in order, `x_s` row `s` of the Q8 input `xq` (one row a slot). Each slot's product is
/// bit for bit what [`routed_products`] gives it in a tile of one slot, and the sum runs
/// as a weighted sum of those outputs would. `ids` is read on the device: an expert index
/// out of range there is the writer's error.
#[allow(clippy::too_many_arguments)]
pub fn routed_sum(
    experts: &GpuExperts<'_>,
    xq: DeviceView<'_, u8>,
    ids: DeviceView<'_, i32>,
    weights: DeviceView<'_, f32>,
    n_tokens: usize,
    k: usize,
    out: &mut DeviceViewMut<'_, f32>,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    let n_slots = n_tokens.saturating_mul(k);
    if n_tokens == 0 || n_tokens > 65_535 || k == 0 || n_slots > i32::MAX as usize {
        return Err(DequantError::ProductTokens {
            n_tokens,
            max: 65_535,
        }
        .into());
    }
    if let Some(len) = [ids.len(), weights.len()]
        .into_iter()
        .find(|&l| l != n_slots)
    {
        return Err(DequantError::InputLength {
            n_tokens: n_slots,
            cols: 1,
            expected: n_slots,
            actual: len,
        }
        .into());
    }
    let cols = experts.cols();
    DequantError::check_input_of(xq.len(), n_slots, cols, q8_bytes(n_slots, cols))?;
    DequantError::check_output(out.len(), n_tokens, experts.rows())?;
    let device = check_device(stream, xq.device_ordinal(), ids.device_ordinal())?;
    check_device(stream, weights.device_ordinal(), out.device_ordinal())?;
    check_device(stream, experts.device_ordinal(), out.device_ordinal())?;
    launch_sum(experts, xq, ids, weights, n_tokens, k, out, device, stream)
}

#[cfg(not(hip_platform = "none"))]
#[allow(clippy::too_many_arguments)]
fn launch_sum(
    experts: &GpuExperts<'_>,
    xq: DeviceView<'_, u8>,
    ids: DeviceView<'_, i32>,
    weights: DeviceView<'_, f32>,
    n_tokens: usize,
    k: usize,
    out: &mut DeviceViewMut<'_, f32>,
    device: i32,
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    use std::ffi::c_int;
    let launchers = super::launchers(experts.ty())?;
    let (matrices, stride) = experts.kernel_weights();
    // SAFETY: `routed_sum` checked every length: the weights hold exactly `count`
    // matrices (or a table of their addresses, which `GpuExperts::from_table`'s caller
    // vouches for), ids and weights one entry a slot, the input one row of Q8 blocks a slot,
    // the output one row a token; all are on the stream's device and stay borrowed while
    // the kernel is queued. Rows, columns and counts fit in `c_int` (`GpuMatrix::new`,
    // the checks above).
    let status = unsafe {
        (launchers.matvec_experts_sum)(
            matrices,
            stride,
            experts.rows() as c_int,
            experts.cols() as c_int,
            ids.as_ptr(),
            weights.as_ptr(),
            k as c_int,
            n_tokens as c_int,
            xq.as_ptr(),
            (n_tokens * k) as c_int,
            out.as_mut_ptr(),
            device,
            stream.as_raw(),
        )
    };
    hip_backend::check_status("rf_matvec_experts_sum", status).map_err(GpuDequantError::from)
}

#[cfg(hip_platform = "none")]
#[allow(clippy::too_many_arguments)]
fn launch_sum(
    _: &GpuExperts<'_>,
    _: DeviceView<'_, u8>,
    _: DeviceView<'_, i32>,
    _: DeviceView<'_, f32>,
    _: usize,
    _: usize,
    _: &mut DeviceViewMut<'_, f32>,
    _: i32,
    _: &Stream,
) -> Result<(), GpuDequantError> {
    Err(HipError::BuiltWithoutGpu.into())
}

#[cfg(not(hip_platform = "none"))]
fn launch(
    experts: &[GpuExperts<'_>],
    input: RoutedInput<'_>,
    tiles: DeviceView<'_, i32>,
    order: DeviceView<'_, i32>,
    shape: Shape,
    outs: &mut [DeviceViewMut<'_, f32>],
    stream: &Stream,
) -> Result<(), GpuDequantError> {
    use std::ffi::{c_int, c_void};
    let first = &experts[0];
    let weights: Vec<*const c_void> = experts.iter().map(|e| e.kernel_weights().0).collect();
    let stride = first.kernel_weights().1;
    let out_ptrs: Vec<*mut c_void> = outs.iter_mut().map(|o| o.as_mut_ptr()).collect();
    let launchers = super::launchers(first.ty())?;
    let (n_mats, rows, cols) = (
        experts.len() as c_int,
        first.rows() as c_int,
        first.cols() as c_int,
    );
    // SAFETY: `routed_products` checked every length: each weight view holds exactly its
    // `count` matrices (or a table of their addresses, vouched for by
    // `GpuExperts::from_table`'s caller, and then only the decode products run), each
    // output one row per slot, the input `n_x` rows (of Q8 blocks, or of f16 values with
    // a scale each), `tiles` the most triples the grid reads and
    // `order` one entry per slot; all are on the stream's device and stay borrowed
    // (alive) while the kernel is queued. The pointer arrays live through the call,
    // which copies them into the kernel's arguments; rows, columns and counts fit in
    // `c_int` (`GpuMatrix::new`, the checks above).
    let (status, what) = unsafe {
        match input {
            RoutedInput::Q8(x) => {
                // MXFP4's int8 tiles (kernels/skinny_q8.h) or the decode products, the
                // same arguments either way.
                let (launch, what): (super::launchers::MatvecExpertsFn, _) =
                    if shape.tile_tokens >= SKINNY_TILE_TOKENS[0] {
                        (launchers.matmul_experts_q8, "rf_matmul_experts_q8")
                    } else {
                        (launchers.matvec_experts, "rf_matvec_experts")
                    };
                let status = launch(
                    weights.as_ptr(),
                    out_ptrs.as_ptr(),
                    n_mats,
                    rows,
                    cols,
                    stride,
                    tiles.as_ptr(),
                    shape.n_tiles as c_int,
                    shape.tile_tokens as c_int,
                    order.as_ptr(),
                    shape.slot_div as c_int,
                    x.as_ptr(),
                    shape.n_x as c_int,
                    shape.device,
                    stream.as_raw(),
                );
                (status, what)
            }
            RoutedInput::F16 { x16, scales } => (
                (launchers.matmul_experts)(
                    weights.as_ptr(),
                    out_ptrs.as_ptr(),
                    n_mats,
                    rows,
                    cols,
                    first.expert_bytes(),
                    first.count() as c_int,
                    tiles.as_ptr(),
                    shape.n_tiles as c_int,
                    shape.tile_tokens as c_int,
                    order.as_ptr(),
                    shape.slot_div as c_int,
                    x16.as_ptr(),
                    scales.as_ptr(),
                    shape.device,
                    stream.as_raw(),
                ),
                "rf_matmul_experts",
            ),
        }
    };
    hip_backend::check_status(what, status).map_err(GpuDequantError::from)
}

#[cfg(hip_platform = "none")]
fn launch(
    _: &[GpuExperts<'_>],
    _: RoutedInput<'_>,
    _: DeviceView<'_, i32>,
    _: DeviceView<'_, i32>,
    _: Shape,
    _: &mut [DeviceViewMut<'_, f32>],
    _: &Stream,
) -> Result<(), GpuDequantError> {
    Err(HipError::BuiltWithoutGpu.into())
}
