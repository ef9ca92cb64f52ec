//! A layer's weights on the device, obtained from the cache through the plan's handles.
//! Holding these keeps the tensors pinned (the cache evicts only tensors nobody holds).

use std::ops::Range;

use gguf_format::GgmlType;
use hip_backend::DeviceView;
use tensor_store::device::{DeviceCache, DeviceTensor, HipTarget};
use tensor_store::TensorHandle;

use dequant::gpu::experts::GpuExperts;

use super::kernels::{self, norm_type_code, NormWeight};
use super::shard::{LayerParts, PartMatrix};
use super::{gpu, Part};
use crate::config::{ExpertActivation, Gating, ModelConfig};
use crate::plan::{ExecutionPlan, ExpertMatrices, FfnPlan, LayerPlan, Linear, Vector};
use crate::{Model, ModelError};

type Tensor = DeviceTensor<HipTarget>;

/// A matrix on the device with its shape: the rows of its tensor that the plan names,
/// a range of the tensor's bytes (a part of a fused tensor such as Phi-3's `attn_qkv`
/// is a view of the one device tensor, never a copy).
pub(super) struct Matrix {
    pub tensor: Tensor,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// The matrix's bytes within the tensor's.
    range: Range<usize>,
}

impl Matrix {
    /// The bytes of its blocks.
    pub fn byte_len(&self) -> usize {
        self.range.len()
    }

    fn fetch(cache: &DeviceCache<HipTarget>, lin: &Linear) -> Result<Matrix, ModelError> {
        let ty = lin.weight.ggml_type();
        let range = row_range(lin).ok_or_else(|| ModelError::TensorShape {
            name: lin.weight.name().to_owned(),
            expected: vec![
                lin.cols as u64,
                lin.first_row.saturating_add(lin.rows) as u64,
            ],
            found: lin.weight.shape().to_vec(),
        })?;
        Ok(Matrix {
            tensor: cache.get(&lin.weight)?,
            ty,
            rows: lin.rows,
            cols: lin.cols,
            range,
        })
    }

    /// The matrix's bytes: its rows of the device tensor. A part of a fused tensor starts
    /// at a whole row, so its blocks keep the alignment they have in the whole tensor.
    pub fn bytes(&self) -> Result<DeviceView<'_, u8>, ModelError> {
        self.tensor
            .buffer()
            .bytes()
            .slice(self.range.clone())
            .map_err(gpu("viewing a matrix's rows"))
    }

    pub fn name(&self) -> &str {
        self.tensor.name()
    }

    /// A device's part of a matrix split by tensors: its bytes are the part's.
    fn of_part(part: &PartMatrix) -> Matrix {
        Matrix {
            tensor: part.tensor.clone(),
            ty: part.tensor.handle().ggml_type(),
            rows: part.rows,
            cols: part.cols,
            range: 0..part.tensor.size() as usize,
        }
    }
}

/// The bytes of `lin`'s rows within its tensor's: rows `first_row..first_row + rows` of
/// whole blocks; `None` when they do not lie within the tensor.
fn row_range(lin: &Linear) -> Option<Range<usize>> {
    let row_bytes = usize::try_from(lin.weight.ggml_type().row_bytes(lin.cols as u64)?).ok()?;
    let start = lin.first_row.checked_mul(row_bytes)?;
    let end = lin.rows.checked_mul(row_bytes)?.checked_add(start)?;
    let total = usize::try_from(lin.weight.size()).ok()?;
    (end <= total).then_some(start..end)
}

/// A norm vector on the device.
pub(super) struct Norm {
    tensor: Tensor,
    type_code: i32,
    len: usize,
}

impl Norm {
    fn fetch(cache: &DeviceCache<HipTarget>, v: &Vector) -> Result<Norm, ModelError> {
        let ty = v.handle.ggml_type();
        let type_code = norm_type_code(ty).ok_or_else(|| ModelError::UnsupportedTensorType {
            name: v.handle.name().to_owned(),
            ggml_type: ty,
        })?;
        Ok(Norm {
            tensor: cache.get(&v.handle)?,
            type_code,
            len: v.len,
        })
    }

    pub fn weight(&self) -> NormWeight<'_> {
        NormWeight {
            bytes: self.tensor.buffer().bytes(),
            type_code: self.type_code,
            len: self.len,
        }
    }
}

/// An F32 vector (a bias, RoPE frequency factors).
pub(super) struct Floats {
    tensor: Tensor,
}

impl Floats {
    fn fetch(cache: &DeviceCache<HipTarget>, handle: &TensorHandle) -> Result<Floats, ModelError> {
        Ok(Floats {
            tensor: cache.get(handle)?,
        })
    }

    fn of_part(tensor: &Tensor) -> Floats {
        Floats {
            tensor: tensor.clone(),
        }
    }

    pub fn view(&self) -> Result<DeviceView<'_, f32>, ModelError> {
        self.tensor
            .buffer()
            .view::<f32>()
            .map_err(gpu("viewing an f32 vector"))
    }
}

/// The weights of one transformer block.
pub(super) struct LayerWeights {
    pub attn_norm: Norm,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub bq: Option<Floats>,
    pub bk: Option<Floats>,
    pub bv: Option<Floats>,
    pub q_norm: Option<Norm>,
    pub k_norm: Option<Norm>,
    /// Divisors of the rotary angles: Llama 3's `rope_freqs`, or Phi-3's long or short
    /// factors (see [`RopeContext`]).
    pub rope_freqs: Option<Floats>,
    /// One logit per query head that joins its softmax's denominator (gpt-oss).
    pub sinks: Option<Floats>,
    pub wo: Matrix,
    pub bo: Option<Floats>,
    pub post_attn_norm: Option<Norm>,
    pub ffn_norm: Norm,
    pub ffn: FfnWeights,
    pub post_ffn_norm: Option<Norm>,
}

/// A layer's feed-forward weights: one gated MLP, or a mixture of experts.
pub(super) enum FfnWeights {
    Dense {
        gate: Matrix,
        up: Matrix,
        down: Matrix,
    },
    Experts(Box<ExpertWeights>),
}

/// A mixture of experts on the device: the router, the 3-D expert tensors whole (an
/// expert is a range of their bytes) or, over budget, their shapes only (the experts
/// are in the layer's pool, `super::expert_pool`), and the shared expert with its gate.
pub(super) struct ExpertWeights {
    /// The layer's index, which names its pool.
    pub layer: usize,
    pub router: Matrix,
    pub router_bias: Option<Floats>,
    pub gate: Option<ExpertTensor>,
    pub up: ExpertTensor,
    pub down: ExpertTensor,
    pub shared: Option<SharedExpert>,
    pub count: usize,
    pub used: usize,
    pub gating: kernels::Gating,
    pub activation: kernels::GateActivation,
}

/// Qwen 2 MoE's shared expert: a gated MLP every token runs, scaled by the sigmoid of
/// one more product (`gate_inp`, one row).
pub(super) struct SharedExpert {
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
    pub gate_inp: Matrix,
}

/// `ffn_{gate,up,down}_exps` on the device: `count` matrices of `rows × cols` (or, in
/// a pool, none: see [`ExpertWeights`]), with their biases (gpt-oss: `count` rows of
/// `rows` values).
pub(super) struct ExpertTensor {
    tensor: Option<Tensor>,
    name: String,
    pub bias: Option<Floats>,
    pub ty: GgmlType,
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
}

impl ExpertTensor {
    /// The tensor from the cache, or only its shape and biases when `pooled`.
    fn fetch(
        cache: &DeviceCache<HipTarget>,
        m: &ExpertMatrices,
        pooled: bool,
    ) -> Result<ExpertTensor, ModelError> {
        Ok(ExpertTensor {
            tensor: (!pooled).then(|| cache.get(&m.weight)).transpose()?,
            name: m.weight.name().to_owned(),
            bias: m
                .bias
                .as_ref()
                .map(|h| Floats::fetch(cache, h))
                .transpose()?,
            ty: m.weight.ggml_type(),
            count: m.count,
            rows: m.rows,
            cols: m.cols,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tensor as the routed products take it.
    pub fn gpu(&self) -> Result<GpuExperts<'_>, ModelError> {
        let Some(tensor) = &self.tensor else {
            unreachable!("a pooled layer's products take the pool's slots")
        };
        GpuExperts::new(
            self.ty,
            self.count,
            self.rows,
            self.cols,
            tensor.buffer().bytes(),
        )
        .map_err(|source| ModelError::Matmul {
            name: self.name().to_owned(),
            source,
        })
    }
}

impl FfnWeights {
    /// Layer `layer`'s feed-forward weights; `pooled`: its experts are in a pool.
    fn fetch(
        cache: &DeviceCache<HipTarget>,
        ffn: &FfnPlan,
        layer: usize,
        pooled: bool,
    ) -> Result<FfnWeights, ModelError> {
        let e = match ffn {
            FfnPlan::Dense(f) => {
                return Ok(FfnWeights::Dense {
                    gate: Matrix::fetch(cache, &f.gate)?,
                    up: Matrix::fetch(cache, &f.up)?,
                    down: Matrix::fetch(cache, &f.down)?,
                })
            }
            FfnPlan::Experts(e) => e,
        };
        let shared = e
            .shared
            .as_ref()
            .map(|(f, gate_inp)| -> Result<SharedExpert, ModelError> {
                Ok(SharedExpert {
                    gate: Matrix::fetch(cache, &f.gate)?,
                    up: Matrix::fetch(cache, &f.up)?,
                    down: Matrix::fetch(cache, &f.down)?,
                    gate_inp: Matrix::fetch(cache, gate_inp)?,
                })
            })
            .transpose()?;
        Ok(FfnWeights::Experts(Box::new(ExpertWeights {
            layer,
            router: Matrix::fetch(cache, &e.router)?,
            gate: e
                .gate
                .as_ref()
                .map(|g| ExpertTensor::fetch(cache, g, pooled))
                .transpose()?,
            up: ExpertTensor::fetch(cache, &e.up, pooled)?,
            down: ExpertTensor::fetch(cache, &e.down, pooled)?,
            shared,
            count: e.experts.count,
            used: e.experts.used,
            router_bias: e
                .router
                .bias
                .as_ref()
                .map(|h| Floats::fetch(cache, h))
                .transpose()?,
            gating: match e.experts.gating {
                Gating::Softmax => kernels::Gating::Softmax {
                    renormalize: e.experts.normalize,
                },
                Gating::SoftmaxOfChosen => kernels::Gating::SoftmaxOfChosen,
            },
            activation: match e.experts.activation {
                ExpertActivation::Silu => kernels::GateActivation::Silu,
                ExpertActivation::SwigluOai => kernels::GateActivation::SwigluOai,
            },
        })))
    }
}

/// Which of Phi-3's RoPE factors a KV cache takes: the long ones when it holds more
/// positions than the model's original context, as the CPU path (and llama.cpp's context)
/// chooses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RopeContext {
    Short,
    Long,
}

impl RopeContext {
    pub fn for_cache(config: &ModelConfig, capacity: usize) -> RopeContext {
        if capacity > config.rope_original_context {
            RopeContext::Long
        } else {
            RopeContext::Short
        }
    }
}

/// The divisors of `layer`'s rotary angles for a cache of `context`, as the CPU path's
/// `rope_table` picks them.
fn rope_factors(layer: &LayerPlan, context: RopeContext) -> Option<&Vector> {
    layer.rope_freqs.as_ref().or(match context {
        RopeContext::Long => layer.rope_factors_long.as_ref(),
        RopeContext::Short => layer.rope_factors_short.as_ref(),
    })
}

impl LayerWeights {
    /// Asks the cache for every tensor of layer `index`, `layer`, in the order the layer
    /// reads them, with the RoPE factors of a cache of `context`; but for its experts'
    /// matrices when they are `pooled`, and for the parts this device holds of a model
    /// split by tensors (`parts`).
    pub fn fetch(
        cache: &DeviceCache<HipTarget>,
        index: usize,
        layer: &LayerPlan,
        context: RopeContext,
        pooled: bool,
        parts: Option<&LayerParts<PartMatrix>>,
    ) -> Result<LayerWeights, ModelError> {
        let norm = |v: &Option<Vector>| v.as_ref().map(|v| Norm::fetch(cache, v)).transpose();
        // This device's part where it holds parts, else the whole from the cache.
        let matrix = |part: fn(&LayerParts<PartMatrix>) -> &PartMatrix, lin: &Linear| {
            parts.map_or_else(
                || Matrix::fetch(cache, lin),
                |p| Ok(Matrix::of_part(part(p))),
            )
        };
        let vector = |part: fn(&LayerParts<PartMatrix>) -> Option<&PartMatrix>,
                      whole: Option<&TensorHandle>| match parts {
            Some(p) => Ok(part(p).map(|m| Floats::of_part(&m.tensor))),
            None => whole.map(|h| Floats::fetch(cache, h)).transpose(),
        };
        let ffn = match parts {
            Some(p) => FfnWeights::Dense {
                gate: Matrix::of_part(&p.gate),
                up: Matrix::of_part(&p.up),
                down: Matrix::of_part(&p.down),
            },
            None => FfnWeights::fetch(cache, &layer.ffn, index, pooled)?,
        };
        Ok(LayerWeights {
            attn_norm: Norm::fetch(cache, &layer.attn_norm)?,
            wq: matrix(|p| &p.wq, &layer.wq)?,
            wk: matrix(|p| &p.wk, &layer.wk)?,
            wv: matrix(|p| &p.wv, &layer.wv)?,
            bq: vector(|p| p.bq.as_ref(), layer.wq.bias.as_ref())?,
            bk: vector(|p| p.bk.as_ref(), layer.wk.bias.as_ref())?,
            bv: vector(|p| p.bv.as_ref(), layer.wv.bias.as_ref())?,
            q_norm: norm(&layer.q_norm)?,
            k_norm: norm(&layer.k_norm)?,
            rope_freqs: rope_factors(layer, context)
                .map(|v| Floats::fetch(cache, &v.handle))
                .transpose()?,
            sinks: vector(
                |p| p.sinks.as_ref(),
                layer.attn_sinks.as_ref().map(|v| &v.handle),
            )?,
            wo: matrix(|p| &p.wo, &layer.wo)?,
            bo: vector(|p| p.bo.as_ref(), layer.wo.bias.as_ref())?,
            post_attn_norm: norm(&layer.post_attn_norm)?,
            ffn_norm: Norm::fetch(cache, &layer.ffn_norm)?,
            ffn,
            post_ffn_norm: norm(&layer.post_ffn_norm)?,
        })
    }
}

/// The weights outside the blocks.
pub(super) struct Globals {
    /// `None` when the embeddings are gathered on the host (a model over its budget), or
    /// made by another stage of a layer split.
    pub token_embd: Option<Matrix>,
    /// `None` for a stage of a layer split that hands its residual stream on.
    pub head: Option<Head>,
}

/// The final norm and the output matrix.
pub(super) struct Head {
    pub output_norm: Norm,
    pub output: Matrix,
}

impl Globals {
    /// The shared tensors `part` uses; the embeddings only when `embed_on_device`.
    pub fn fetch(
        cache: &DeviceCache<HipTarget>,
        plan: &ExecutionPlan,
        part: &Part,
        embed_on_device: bool,
    ) -> Result<Globals, ModelError> {
        let head = || -> Result<Head, ModelError> {
            Ok(Head {
                output_norm: Norm::fetch(cache, &plan.output_norm)?,
                output: Matrix::fetch(cache, &plan.output)?,
            })
        };
        Ok(Globals {
            token_embd: (embed_on_device && part.embed)
                .then(|| Matrix::fetch(cache, &plan.token_embd))
                .transpose()?,
            head: part.head.then(head).transpose()?,
        })
    }
}

/// Every weight of the model, pinned.
pub(super) struct Held {
    layers: Vec<LayerWeights>,
    globals: Globals,
}

impl Held {
    pub fn fetch(
        cache: &DeviceCache<HipTarget>,
        plan: &ExecutionPlan,
        part: &Part,
        context: RopeContext,
        pooled: bool,
        parts: &[LayerParts<PartMatrix>],
    ) -> Result<Held, ModelError> {
        let globals = Globals::fetch(cache, plan, part, true)?;
        let layers = plan
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| LayerWeights::fetch(cache, i, l, context, pooled, parts.get(i)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Held { layers, globals })
    }

    pub fn layers(&self) -> &[LayerWeights] {
        &self.layers
    }

    pub fn globals(&self) -> &Globals {
        &self.globals
    }
}

impl Model {
    /// Whether the GPU forward pass runs this model: its architecture and features
    /// ([`ModelConfig::check_gpu_support`]) and every weight's type; the error names what
    /// it does not run.
    pub fn check_gpu_support(&self) -> Result<(), ModelError> {
        self.config().check_gpu_support()?;
        check_plan(self.plan())
    }
}

/// Refuses, before anything is uploaded, a plan the GPU kernels cannot run: matrices of
/// a type the GPU does not multiply, biases and RoPE factors other than F32, norms other
/// than F32/F16/BF16.
fn check_plan(plan: &ExecutionPlan) -> Result<(), ModelError> {
    let refuse = |h: &TensorHandle| ModelError::UnsupportedTensorType {
        name: h.name().to_owned(),
        ggml_type: h.ggml_type(),
    };
    // Products: the types the GPU multiplies (the token embeddings are only gathered,
    // unless the output is tied to them: `plan.output` is then the same tensor).
    let matrices = plan.layers.iter().flat_map(|l| {
        let dense = match &l.ffn {
            FfnPlan::Dense(f) => vec![&f.gate, &f.up, &f.down],
            FfnPlan::Experts(e) => {
                let shared = e.shared.iter();
                let shared = shared.flat_map(|(f, g)| [&f.gate, &f.up, &f.down, g]);
                std::iter::once(&e.router).chain(shared).collect()
            }
        };
        [&l.wq, &l.wk, &l.wv, &l.wo].into_iter().chain(dense)
    });
    for lin in matrices.chain([&plan.output]) {
        let ty = lin.weight.ggml_type();
        if !dequant::gpu::matvec::is_supported_on_gpu(ty) {
            let supported: Vec<&str> = GgmlType::ALL
                .into_iter()
                .filter(|&t| dequant::gpu::matvec::is_supported_on_gpu(t))
                .map(GgmlType::name)
                .collect();
            return Err(ModelError::GpuUnsupported {
                what: format!("tensor {:?} of type {ty}", lin.weight.name()),
                supported: format!("products of {}", supported.join(", ")),
            });
        }
    }
    // Routed experts: the quantized types the routed products take.
    let experts = plan.layers.iter().filter_map(|l| match &l.ffn {
        FfnPlan::Experts(e) => Some(e),
        FfnPlan::Dense(_) => None,
    });
    for e in experts {
        let x = &e.experts;
        let expected = match x.gating {
            Gating::Softmax => ExpertActivation::Silu,
            Gating::SoftmaxOfChosen => ExpertActivation::SwigluOai,
        };
        if x.activation != expected {
            return Err(ModelError::GpuUnsupported {
                what: format!(
                    "experts routed by {:?} with {:?} ({:?})",
                    x.gating,
                    x.activation,
                    e.router.weight.name()
                ),
                supported: "softmax routing of SiLU experts, and gpt-oss's".to_owned(),
            });
        }
        let biases = e.router.bias.iter();
        let biases = biases.chain(e.gate.iter().chain([&e.up, &e.down]).flat_map(|m| &m.bias));
        for bias in biases {
            if bias.ggml_type() != GgmlType::F32 {
                return Err(refuse(bias));
            }
        }
        for m in e.gate.iter().chain([&e.up, &e.down]) {
            let ty = m.weight.ggml_type();
            if !dequant::gpu::matvec::is_supported_on_gpu(ty) || !dequant::gpu::matvec::takes_q8(ty)
            {
                return Err(ModelError::GpuUnsupported {
                    what: format!("expert tensor {:?} of type {ty}", m.weight.name()),
                    supported: "experts of the quantized types the GPU multiplies".to_owned(),
                });
            }
        }
    }
    for layer in &plan.layers {
        let sinks = layer.attn_sinks.iter().map(|v| &v.handle);
        for vector in [&layer.wq, &layer.wk, &layer.wv, &layer.wo]
            .into_iter()
            .flat_map(|lin| &lin.bias)
            .chain(sinks)
        {
            if vector.ggml_type() != GgmlType::F32 {
                return Err(refuse(vector));
            }
        }
        let factors = [
            &layer.rope_freqs,
            &layer.rope_factors_long,
            &layer.rope_factors_short,
        ];
        for f in factors.into_iter().flatten() {
            if f.handle.ggml_type() != GgmlType::F32 {
                return Err(refuse(&f.handle));
            }
        }
        let norms = [
            Some(&layer.attn_norm),
            Some(&layer.ffn_norm),
            layer.q_norm.as_ref(),
            layer.k_norm.as_ref(),
            layer.post_attn_norm.as_ref(),
            layer.post_ffn_norm.as_ref(),
        ];
        for v in norms.into_iter().flatten() {
            if norm_type_code(v.handle.ggml_type()).is_none() {
                return Err(refuse(&v.handle));
            }
        }
    }
    Ok(())
}
