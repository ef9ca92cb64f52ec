//! The dense feed-forward block of a layer.

use dequant::gpu::matvec::q8_bytes;
use hip_backend::Stream;

use super::buffers::Buffers;
use super::products::{needs, products, residual, takes_q8_for, Residual};
use super::{view, view_mut};
use crate::config::{Activation, ModelConfig};
use crate::gpu::kernels;
use crate::gpu::weights::Matrix;
use crate::ModelError;

/// `x += down(act(gate(h)) · up(h))` with `h = rms_norm(x)`, through the post-norm when
/// the model has one.
pub(super) fn dense_ffn(
    c: &ModelConfig,
    [gate, up, down]: [&Matrix; 3],
    norm: &crate::gpu::weights::Norm,
    post_ffn: Option<kernels::NormWeight<'_>>,
    bufs: &mut Buffers,
    n: usize,
    stream: &Stream,
) -> Result<(), ModelError> {
    let (d, eps) = (c.n_embd, c.rms_norm_eps);
    let gate_up = [gate, up];
    let (want_f32, want_q8) = needs(&gate_up, n, &bufs.batch_in);
    kernels::rms_norm(
        view(&bufs.x, n * d)?,
        norm.weight(),
        n,
        d,
        eps,
        want_f32
            .then(|| view_mut::<f32>(&mut bufs.h, n * d))
            .transpose()?,
        false,
        want_q8
            .then(|| view_mut::<u8>(&mut bufs.q8, q8_bytes(n, d)))
            .transpose()?,
        stream,
    )?;
    products(
        &gate_up,
        want_f32.then(|| view(&bufs.h, n * d)).transpose()?,
        want_q8
            .then(|| view(&bufs.q8, q8_bytes(n, d)))
            .transpose()?,
        n,
        vec![
            view_mut::<f32>(&mut bufs.gate, n * c.n_ff)?,
            view_mut::<f32>(&mut bufs.up, n * c.n_ff)?,
        ],
        false,
        &mut bufs.batch_in,
        stream,
    )?;
    let down_q8 = takes_q8_for(down, n, &bufs.batch_in);
    kernels::gated(
        Some(view(&bufs.gate, n * c.n_ff)?),
        view(&bufs.up, n * c.n_ff)?,
        c.n_ff,
        gate_activation(c),
        None,
        (!down_q8)
            .then(|| view_mut::<f32>(&mut bufs.act, n * c.n_ff))
            .transpose()?,
        down_q8
            .then(|| view_mut::<u8>(&mut bufs.q8, q8_bytes(n, c.n_ff)))
            .transpose()?,
        stream,
    )?;
    let (x, proj, batch_in, team) = (
        &mut bufs.x,
        &mut bufs.proj,
        &mut bufs.batch_in,
        bufs.team.as_ref(),
    );
    let (f32_in, q8_in) = if down_q8 {
        (None, Some(view(&bufs.q8, q8_bytes(n, c.n_ff))?))
    } else {
        (Some(view(&bufs.act, n * c.n_ff)?), None)
    };
    let into = Residual {
        x,
        proj,
        batch_in,
        team,
    };
    residual(down, None, f32_in, q8_in, post_ffn, into, n, eps, stream)
}

/// The activation of the model's dense gated feed-forward blocks (and of a shared
/// expert's).
pub(super) fn gate_activation(c: &ModelConfig) -> kernels::GateActivation {
    if c.activation == Activation::GeluTanh {
        kernels::GateActivation::GeluTanh
    } else {
        kernels::GateActivation::Silu
    }
}
