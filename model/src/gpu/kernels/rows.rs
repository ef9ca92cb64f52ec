//! The typed wrappers of `kernels/rows.hip`'s launchers: the gated activations, the
//! embedding row gather, scaling, the logits' soft cap, argmax, sparse additions, masks, row
//! selection and the position counter.

#[cfg(hip_platform = "none")]
use hip_backend::HipError;
use hip_backend::{DeviceView, DeviceViewMut, Stream};

#[cfg(not(hip_platform = "none"))]
use super::sys;
use super::{
    expect, expect_at_least, on_device, ptr_or_null, q8_bytes, small, soft_cap, KernelError,
    ShapeError,
};

/// The activation of a gated feed-forward's gate projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateActivation {
    /// `silu(gate) · up`.
    Silu,
    /// `gelu_tanh(gate) · up` (GELU's tanh form).
    GeluTanh,
    /// gpt-oss's clamped SwiGLU (`crate::ops::swiglu_oai`): it needs a gate.
    SwigluOai,
}

impl GateActivation {
    fn code(self) -> i32 {
        match self {
            GateActivation::Silu => 0,
            GateActivation::GeluTanh => 1,
            GateActivation::SwigluOai => 2,
        }
    }
}

/// Each slot's expert's bias rows, for a mixture of experts' products whose experts
/// carry biases (gpt-oss): `bias` holds one row of the outputs' width per expert,
/// `ids` each slot's expert (as the routing kernel writes them).
#[derive(Clone, Copy)]
pub struct SlotBias<'a> {
    pub bias: DeviceView<'a, f32>,
    pub ids: DeviceView<'a, i32>,
}

impl SlotBias<'_> {
    /// Checks it against outputs of `rows` rows of `width`; returns its count of rows.
    pub(super) fn check(
        &self,
        kernel: &'static str,
        rows: usize,
        width: usize,
        devices: &mut Vec<usize>,
    ) -> Result<i32, KernelError> {
        let w = width.max(1);
        expect(kernel, "the bias modulo the width", self.bias.len() % w, 0)?;
        expect(kernel, "the slots' expert ids", self.ids.len(), rows)?;
        expect_at_least(kernel, "rows of the bias", self.bias.len() / w, 1)?;
        devices.extend([self.bias.device_ordinal(), self.ids.device_ordinal()]);
        Ok(small(kernel, "rows of the bias", self.bias.len() / w)?)
    }
}

/// The gate's and up projection's bias rows of each slot's expert (either may be
/// absent), for [`gated`].
#[derive(Clone, Copy)]
pub struct GatedBias<'a> {
    pub gate: Option<DeviceView<'a, f32>>,
    pub up: Option<DeviceView<'a, f32>>,
    pub ids: DeviceView<'a, i32>,
}

/// `act(gate) · up` element-wise, or `act(up)` without a gate (SiLU or GELU only), into
/// `out` (f32) and/or `out_q8` (Q8 blocks of `width`-value rows, `width` a multiple of
/// 32). With `biases` (a mixture of experts' slots, one row each), each slot's expert's
/// gate and up bias rows are added first.
#[allow(clippy::too_many_arguments)]
pub fn gated(
    gate: Option<DeviceView<'_, f32>>,
    up: DeviceView<'_, f32>,
    width: usize,
    act: GateActivation,
    biases: Option<GatedBias<'_>>,
    mut out: Option<DeviceViewMut<'_, f32>>,
    mut out_q8: Option<DeviceViewMut<'_, u8>>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "gated";
    let n = up.len();
    let mut devices = vec![up.device_ordinal()];
    if gate.is_none() && act == GateActivation::SwigluOai {
        return Err(ShapeError {
            kernel: K,
            what: "the gate projections of a clamped SwiGLU",
            expected: n,
            actual: 0,
        }
        .into());
    }
    if let Some(g) = &gate {
        expect(K, "the gate projection", g.len(), n)?;
        devices.push(g.device_ordinal());
    }
    if let Some(o) = &out {
        expect(K, "the output", o.len(), n)?;
        devices.push(o.device_ordinal());
    }
    if let Some(q) = &out_q8 {
        expect(K, "the width modulo 32", width % 32, 0)?;
        expect(K, "the values modulo the width", n % width.max(1), 0)?;
        expect(
            K,
            "the Q8 output",
            q.len(),
            q8_bytes(n / width.max(1), width),
        )?;
        devices.push(q.device_ordinal());
    }
    // Each bias present is whole rows of `width` for every slot's expert, both the
    // same count of experts.
    let mut bias_rows = Vec::new();
    if let Some(b) = &biases {
        if gate.is_none() && b.gate.is_some() {
            expect(K, "the gate projection for its bias", 0, n)?;
        }
        expect(K, "the values modulo the width", n % width.max(1), 0)?;
        for bias in [b.gate, b.up].into_iter().flatten() {
            let slot = SlotBias { bias, ids: b.ids };
            bias_rows.push(slot.check(K, n / width.max(1), width, &mut devices)?);
        }
        if let [g, u] = bias_rows[..] {
            expect(K, "the up bias's rows", u as usize, g as usize)?;
        }
    }
    let device = on_device(stream, &devices)?;
    let out_ptr = out
        .as_mut()
        .map_or(std::ptr::null_mut(), |o| o.as_mut_ptr());
    let q8_ptr = out_q8
        .as_mut()
        .map_or(std::ptr::null_mut(), |o| o.as_mut_ptr());
    launch!(
        rf_gated,
        "gated",
        ptr_or_null(gate),
        up.as_ptr(),
        n,
        act.code(),
        out_ptr,
        q8_ptr,
        ptr_or_null(biases.and_then(|b| b.gate)),
        ptr_or_null(biases.and_then(|b| b.up)),
        ptr_or_null(biases.filter(|_| !bias_rows.is_empty()).map(|b| b.ids)),
        small(K, "the width", width)?,
        bias_rows.first().copied().unwrap_or(0),
        device,
        stream.as_raw(),
    )
}

/// `x[r] += bias` for each row `r` of `width` values (a projection's bias).
pub fn add_bias(
    mut x: DeviceViewMut<'_, f32>,
    width: usize,
    bias: DeviceView<'_, f32>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "add_bias";
    expect(K, "the values modulo the width", x.len() % width.max(1), 0)?;
    expect(K, "the bias", bias.len(), width)?;
    expect_at_least(K, "the width", width, 1)?;
    let device = on_device(stream, &[x.device_ordinal(), bias.device_ordinal()])?;
    launch!(
        rf_add_bias,
        "add_bias",
        x.as_mut_ptr(),
        x.len(),
        small(K, "the width", width)?,
        bias.as_ptr(),
        device,
        stream.as_raw(),
    )
}

/// Copies rows `tokens[t]` of `table` (`n_rows` rows of `row_bytes`) to `out`, row by
/// row. A token past the table copies nothing and sets `bad[0]` to 1.
pub fn gather_rows(
    table: DeviceView<'_, u8>,
    row_bytes: usize,
    tokens: DeviceView<'_, u32>,
    mut out: DeviceViewMut<'_, u8>,
    mut bad: DeviceViewMut<'_, i32>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "gather_rows";
    let n_rows = table.len() / row_bytes.max(1);
    expect(K, "the table", table.len(), n_rows * row_bytes)?;
    expect(K, "the output", out.len(), tokens.len() * row_bytes)?;
    expect(K, "the flag", bad.len(), 1)?;
    let device = on_device(
        stream,
        &[
            table.device_ordinal(),
            tokens.device_ordinal(),
            out.device_ordinal(),
            bad.device_ordinal(),
        ],
    )?;
    launch!(
        rf_gather_rows,
        "gather_rows",
        table.as_ptr(),
        row_bytes,
        n_rows,
        tokens.as_ptr(),
        small(K, "tokens", tokens.len())?,
        out.as_mut_ptr(),
        bad.as_mut_ptr(),
        device,
        stream.as_raw(),
    )
}

/// `x *= s`.
pub fn scale(mut x: DeviceViewMut<'_, f32>, s: f32, stream: &Stream) -> Result<(), KernelError> {
    let device = on_device(stream, &[x.device_ordinal()])?;
    let n = x.len();
    launch!(
        rf_scale,
        "scale",
        x.as_mut_ptr(),
        n,
        s,
        device,
        stream.as_raw()
    )
}

/// `x = cap · tanh(x · (1/cap))`: the final logits' soft cap (`cap` a positive number).
pub fn softcap(
    mut x: DeviceViewMut<'_, f32>,
    cap: f32,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "softcap";
    let cap = soft_cap(K, Some(cap))?;
    let device = on_device(stream, &[x.device_ordinal()])?;
    let n = x.len();
    launch!(
        rf_softcap,
        "softcap",
        x.as_mut_ptr(),
        n,
        cap,
        device,
        stream.as_raw()
    )
}

/// For each of the `token.len()` rows that `x` holds, the index of its largest value (the
/// first among equals) into `token[row]`; `u32::MAX` for a row holding a NaN or +inf, or
/// nothing above -inf.
pub fn argmax(
    x: DeviceView<'_, f32>,
    mut token: DeviceViewMut<'_, u32>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "argmax";
    let rows = token.len();
    expect_at_least(K, "rows", rows, 1)?;
    expect(K, "the values modulo the rows", x.len() % rows, 0)?;
    let device = on_device(stream, &[x.device_ordinal(), token.device_ordinal()])?;
    launch!(
        rf_argmax,
        "argmax",
        x.as_ptr(),
        small(K, "values", x.len() / rows)?,
        small(K, "rows", rows)?,
        token.as_mut_ptr(),
        device,
        stream.as_raw(),
    )
}

/// `x[at[i]] += values[i]` for every entry: a sparse addition (logit biases). The
/// indices are the caller's to keep within `x` and distinct (the forward pass checks
/// them on the host before it copies them over).
pub fn add_at(
    mut x: DeviceViewMut<'_, f32>,
    at: DeviceView<'_, i32>,
    values: DeviceView<'_, f32>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "add_at";
    expect(K, "the values", values.len(), at.len())?;
    expect_at_least(K, "entries", at.len(), 1)?;
    let device = on_device(
        stream,
        &[
            x.device_ordinal(),
            at.device_ordinal(),
            values.device_ordinal(),
        ],
    )?;
    launch!(
        rf_add_at,
        "add_at",
        x.as_mut_ptr(),
        at.as_ptr(),
        values.as_ptr(),
        small(K, "entries", at.len())?,
        device,
        stream.as_raw(),
    )
}

/// For each mask `k`: row `rows[k]` of `x` (rows of `n` values) keeps the values whose
/// bit is set in `words`' `k`-th run of `n.div_ceil(32)` words (bit `i % 32` of word
/// `i / 32`) and the others become -inf. The rows are the caller's to keep within `x`.
pub fn mask_rows(
    mut x: DeviceViewMut<'_, f32>,
    n: usize,
    rows: DeviceView<'_, i32>,
    words: DeviceView<'_, u32>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "mask_rows";
    let n_words = n.div_ceil(32);
    expect_at_least(K, "masks", rows.len(), 1)?;
    expect_at_least(K, "values a row", n, 1)?;
    expect(K, "the masks' words", words.len(), rows.len() * n_words)?;
    expect(K, "the values modulo a row", x.len() % n, 0)?;
    let device = on_device(
        stream,
        &[
            x.device_ordinal(),
            rows.device_ordinal(),
            words.device_ordinal(),
        ],
    )?;
    launch!(
        rf_mask_rows,
        "mask_rows",
        x.as_mut_ptr(),
        small(K, "values a row", n)?,
        rows.as_ptr(),
        words.as_ptr(),
        small(K, "words a mask", n_words)?,
        small(K, "masks", rows.len())?,
        device,
        stream.as_raw(),
    )
}

/// `dst` row `r` = `src` row `rows[r]`, rows of `dim` values. The row indices are the
/// caller's to keep within `src` (the forward pass checks them on the host before it
/// copies them over).
pub fn select_rows(
    src: DeviceView<'_, f32>,
    dim: usize,
    rows: DeviceView<'_, i32>,
    mut dst: DeviceViewMut<'_, f32>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "select_rows";
    expect(K, "the output", dst.len(), rows.len() * dim)?;
    expect(K, "the input modulo the width", src.len() % dim.max(1), 0)?;
    expect_at_least(K, "rows", rows.len(), 1)?;
    let device = on_device(
        stream,
        &[
            src.device_ordinal(),
            rows.device_ordinal(),
            dst.device_ordinal(),
        ],
    )?;
    launch!(
        rf_select_rows,
        "select_rows",
        src.as_ptr(),
        small(K, "width", dim)?,
        rows.as_ptr(),
        small(K, "rows", rows.len())?,
        dst.as_mut_ptr(),
        device,
        stream.as_raw(),
    )
}

/// `pos[0] += n`, on the stream (so a captured step advances itself).
pub fn advance(
    mut pos: DeviceViewMut<'_, i32>,
    n: usize,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "advance";
    expect(K, "the position", pos.len(), 1)?;
    let device = on_device(stream, &[pos.device_ordinal()])?;
    launch!(
        rf_advance,
        "advance",
        pos.as_mut_ptr(),
        small(K, "tokens", n)?,
        device,
        stream.as_raw(),
    )
}
