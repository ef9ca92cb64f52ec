//! One GPU's share of a model split by tensors ([`super::TensorSplit`]): a run of its
//! attention heads (with their keys and values) and of its feed-forward rows, in every
//! layer. The matrices that produce those heads and rows (`attn_q/k/v`, `ffn_gate/up`,
//! their biases, the heads' sinks) are cut by rows; the two that read them
//! (`attn_output`, `ffn_down`) by columns, so each device's product is a partial sum of
//! the whole, and one all-reduce after each of the two adds them up. Every other weight
//! (norms, RoPE factors, the embeddings, the output matrix) is whole on the devices that
//! use it.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use gguf_format::GgmlType;
use tensor_store::device::{
    upload_part_in, DeviceCache, DeviceTensor, HipTarget, PartStaging, TensorPart,
};
use tensor_store::TensorHandle;

use crate::config::ModelConfig;
use crate::plan::{ExecutionPlan, LayerPlan, Linear};
use crate::ModelError;

type Tensor = DeviceTensor<HipTarget>;

/// Most threads a device gathers its parts from the file with.
const UPLOAD_THREADS: usize = 8;

/// Elements of a run of feed-forward rows: whole Q8 blocks of the activations the down
/// projection takes, whatever the down matrix's own blocks.
const Q8_BLOCK: usize = 32;

/// One device's share of every layer: query heads `heads`, key/value heads `kv_heads`,
/// feed-forward rows `ff`; rank `rank` of `ranks`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Shard {
    pub rank: usize,
    pub ranks: usize,
    pub heads: Range<usize>,
    pub kv_heads: Range<usize>,
    pub ff: Range<usize>,
}

impl Shard {
    /// The shares of `ranks` devices: the heads in equal runs of whole key/value groups,
    /// the feed-forward rows in runs as equal as the down matrices' blocks allow. Refuses
    /// what a split by tensors cannot cut (named in the error): a mixture of experts,
    /// heads or key/value heads the devices do not divide, per-layer norms over every
    /// head, a run of heads or rows that is not whole blocks of the matrix that reads it.
    pub fn all(
        config: &ModelConfig,
        plan: &ExecutionPlan,
        ranks: usize,
    ) -> Result<Vec<Shard>, ModelError> {
        let refuse = |what: String| ModelError::GpuUnsupported {
            what,
            supported: "a dense model whose heads, key/value heads and feed-forward rows \
                        the devices divide in whole blocks (or a split by layers)"
                .into(),
        };
        if ranks < 2 {
            return Err(refuse(format!("a split by tensors over {ranks} device(s)")));
        }
        if config.experts.is_some() {
            return Err(refuse("a mixture of experts split by tensors".into()));
        }
        if !config.n_heads.is_multiple_of(ranks) || !config.n_kv_heads.is_multiple_of(ranks) {
            return Err(refuse(format!(
                "{} query heads and {} key/value heads over {ranks} devices",
                config.n_heads, config.n_kv_heads
            )));
        }
        let (heads, kv_heads) = (config.n_heads / ranks, config.n_kv_heads / ranks);
        // Rows of the feed-forward block move in units of the down matrices' blocks.
        let mut unit = Q8_BLOCK;
        for layer in &plan.layers {
            let per_head = |v: &Option<crate::plan::Vector>| {
                v.as_ref().is_some_and(|v| v.len != config.head_dim)
            };
            if per_head(&layer.q_norm) || per_head(&layer.k_norm) {
                return Err(refuse(format!(
                    "{}: a norm over every head's queries or keys",
                    layer.wq.weight.name()
                )));
            }
            let wo_block = layer.wo.weight.ggml_type().block_size() as usize;
            if !(heads * config.head_dim_v).is_multiple_of(wo_block) {
                return Err(refuse(format!(
                    "{} ({}): {heads} heads of {} values a device, not whole blocks of {wo_block}",
                    layer.wo.weight.name(),
                    layer.wo.weight.ggml_type(),
                    config.head_dim_v
                )));
            }
            let Some(ffn) = layer.ffn.dense() else {
                return Err(refuse("a mixture of experts split by tensors".into()));
            };
            unit = lcm(unit, ffn.down.weight.ggml_type().block_size() as usize);
        }
        let units = config.n_ff / unit;
        if units < ranks || !config.n_ff.is_multiple_of(unit) {
            return Err(refuse(format!(
                "{} feed-forward rows over {ranks} devices in blocks of {unit}",
                config.n_ff
            )));
        }
        Ok((0..ranks)
            .map(|rank| {
                let at = |r: usize| r * units / ranks * unit;
                Shard {
                    rank,
                    ranks,
                    heads: rank * heads..(rank + 1) * heads,
                    kv_heads: rank * kv_heads..(rank + 1) * kv_heads,
                    ff: at(rank)..at(rank + 1),
                }
            })
            .collect())
    }

    /// The configuration one device runs: its heads and rows alone.
    pub fn narrow(&self, config: &mut ModelConfig) {
        config.n_heads = self.heads.len();
        config.n_kv_heads = self.kv_heads.len();
        config.n_ff = self.ff.len();
    }

    /// Whether this device adds the biases of the matrices cut by columns (their sum
    /// over the devices must hold each once), and the output matrix's logits.
    pub fn leads(&self) -> bool {
        self.rank == 0
    }

    /// The tensors each device takes a part of, not the whole: not uploaded whole.
    pub fn cut_tensors(plan: &ExecutionPlan) -> HashSet<usize> {
        let mut cut = HashSet::new();
        for layer in &plan.layers {
            for lin in [&layer.wq, &layer.wk, &layer.wv] {
                cut.insert(lin.weight.index());
                cut.extend(lin.bias.iter().map(TensorHandle::index));
            }
            cut.insert(layer.wo.weight.index());
            cut.extend(layer.attn_sinks.iter().map(|v| v.handle.index()));
            if let Some(ffn) = layer.ffn.dense() {
                for lin in [&ffn.gate, &ffn.up, &ffn.down] {
                    cut.insert(lin.weight.index());
                }
            }
        }
        cut
    }

    /// The parts of `layer` this device takes, each with the rows and columns of the
    /// tensor it is (`layer` of a plan [`Shard::all`] accepted).
    fn layer_parts(&self, config: &ModelConfig, layer: &LayerPlan) -> Vec<(TensorHandle, Cut)> {
        let (hd, hd_v) = (config.head_dim, config.head_dim_v);
        let (q, kv) = (&self.heads, &self.kv_heads);
        let q_rows = q.start * hd..q.end * hd;
        let k_rows = kv.start * hd..kv.end * hd;
        let v_rows = kv.start * hd_v..kv.end * hd_v;
        let mut parts = Vec::new();
        for (lin, rows) in [
            (&layer.wq, &q_rows),
            (&layer.wk, &k_rows),
            (&layer.wv, &v_rows),
        ] {
            parts.push((lin.weight.clone(), Cut::rows_of(lin, rows)));
            if let Some(bias) = &lin.bias {
                parts.push((bias.clone(), Cut::vector(rows)));
            }
        }
        if let Some(sinks) = &layer.attn_sinks {
            parts.push((sinks.handle.clone(), Cut::vector(q)));
        }
        parts.push((
            layer.wo.weight.clone(),
            Cut::cols_of(&layer.wo, q.start * hd_v..q.end * hd_v),
        ));
        let ffn = layer.ffn.dense().expect("Shard::all refuses experts");
        parts.push((ffn.gate.weight.clone(), Cut::rows_of(&ffn.gate, &self.ff)));
        parts.push((ffn.up.weight.clone(), Cut::rows_of(&ffn.up, &self.ff)));
        parts.push((
            ffn.down.weight.clone(),
            Cut::cols_of(&ffn.down, self.ff.clone()),
        ));
        parts
    }

    /// The size of every part this device takes, in bytes.
    pub fn sizes(&self, config: &ModelConfig, plan: &ExecutionPlan) -> Vec<u64> {
        plan.layers
            .iter()
            .flat_map(|l| self.layer_parts(config, l))
            .map(|(h, cut)| cut.bytes(h.ggml_type()))
            .collect()
    }

    /// Uploads this device's parts of every layer to `cache`'s device (outside the
    /// cache's budget: they stay as long as the model), gathered from the file by a few
    /// threads at once, each with its page-locked staging.
    pub(super) fn upload(
        &self,
        config: &ModelConfig,
        plan: &ExecutionPlan,
        cache: &DeviceCache<HipTarget>,
    ) -> Result<Vec<LayerParts>, ModelError> {
        let parts: Vec<(TensorHandle, Cut)> = plan
            .layers
            .iter()
            .flat_map(|layer| self.layer_parts(config, layer))
            .collect();
        let next = AtomicUsize::new(0);
        // Half the cores, as the cache's readers take, at most `UPLOAD_THREADS`.
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get() / 2)
            .clamp(1, UPLOAD_THREADS);
        let uploaded: Vec<Vec<(usize, Result<Tensor, ModelError>)>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut staging = PartStaging::default();
                        let mut done = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some((handle, cut)) = parts.get(i) else {
                                break;
                            };
                            let tensor = TensorPart::of(
                                handle,
                                cut.rows.start as u64..cut.rows.end as u64,
                                cut.cols.start as u64..cut.cols.end as u64,
                            )
                            .and_then(|part| {
                                upload_part_in(cache.target(), handle, &part, &mut staging)
                            })
                            .map_err(ModelError::from);
                            let failed = tensor.is_err();
                            done.push((i, tensor));
                            if failed {
                                // The others stop at their next part.
                                next.store(parts.len(), Ordering::Relaxed);
                                break;
                            }
                        }
                        done
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        });
        let mut tensors: Vec<Option<Tensor>> = (0..parts.len()).map(|_| None).collect();
        for (i, tensor) in uploaded.into_iter().flatten() {
            tensors[i] = Some(tensor?);
        }
        let mut tensors = tensors
            .into_iter()
            .zip(parts)
            .map(|(t, (_, cut))| t.map(|t| (t, cut)));
        plan.layers
            .iter()
            .map(|layer| {
                let mut next = || {
                    tensors.next().flatten().ok_or(ModelError::GpuUnsupported {
                        what: "a split by tensors whose upload stopped".into(),
                        supported: "an upload of every part".into(),
                    })
                };
                let mut with_bias = |lin: &Linear| -> Result<_, ModelError> {
                    let matrix = next()?;
                    let bias = lin.bias.as_ref().map(|_| next().map(|b| b.0)).transpose()?;
                    Ok((matrix, bias))
                };
                let (wq, bq) = with_bias(&layer.wq)?;
                let (wk, bk) = with_bias(&layer.wk)?;
                let (wv, bv) = with_bias(&layer.wv)?;
                let sinks = layer
                    .attn_sinks
                    .as_ref()
                    .map(|_| next().map(|s| s.0))
                    .transpose()?;
                Ok(LayerParts {
                    wq: PartMatrix::from(wq),
                    bq,
                    wk: PartMatrix::from(wk),
                    bk,
                    wv: PartMatrix::from(wv),
                    bv,
                    sinks,
                    wo: PartMatrix::from(next()?),
                    gate: PartMatrix::from(next()?),
                    up: PartMatrix::from(next()?),
                    down: PartMatrix::from(next()?),
                    leads: self.leads(),
                })
            })
            .collect()
    }
}

/// Rows and columns (elements) of a tensor seen as rows of its first dimension.
#[derive(Clone, Debug)]
struct Cut {
    rows: Range<usize>,
    cols: Range<usize>,
}

impl Cut {
    /// Rows `rows` of `lin` (of its own rows, which start `lin.first_row` into a fused
    /// tensor), every column.
    fn rows_of(lin: &Linear, rows: &Range<usize>) -> Cut {
        Cut {
            rows: lin.first_row + rows.start..lin.first_row + rows.end,
            cols: 0..lin.cols,
        }
    }

    /// Every row of `lin`, columns `cols`.
    fn cols_of(lin: &Linear, cols: Range<usize>) -> Cut {
        Cut {
            rows: lin.first_row..lin.first_row + lin.rows,
            cols,
        }
    }

    /// Elements `values` of a vector (one row).
    fn vector(values: &Range<usize>) -> Cut {
        Cut {
            rows: 0..1,
            cols: values.clone(),
        }
    }

    fn bytes(&self, ty: GgmlType) -> u64 {
        let row = ty.row_bytes(self.cols.len() as u64).unwrap_or(0);
        row * self.rows.len() as u64
    }
}

/// A part of a matrix on the device, with its shape.
pub(super) struct PartMatrix {
    pub tensor: Tensor,
    pub rows: usize,
    pub cols: usize,
}

impl From<(Tensor, Cut)> for PartMatrix {
    fn from((tensor, cut): (Tensor, Cut)) -> PartMatrix {
        PartMatrix {
            tensor,
            rows: cut.rows.len(),
            cols: cut.cols.len(),
        }
    }
}

/// One layer's parts on one device ([`Shard::upload`]).
pub(super) struct LayerParts {
    pub wq: PartMatrix,
    pub bq: Option<Tensor>,
    pub wk: PartMatrix,
    pub bk: Option<Tensor>,
    pub wv: PartMatrix,
    pub bv: Option<Tensor>,
    pub sinks: Option<Tensor>,
    pub wo: PartMatrix,
    pub gate: PartMatrix,
    pub up: PartMatrix,
    pub down: PartMatrix,
    /// Whether this device adds the output projection's bias ([`Shard::leads`]).
    pub leads: bool,
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

#[cfg(test)]
mod tests {
    use super::lcm;

    #[test]
    fn lcm_of_block_sizes() {
        assert_eq!(lcm(32, 256), 256);
        assert_eq!(lcm(32, 32), 32);
        assert_eq!(lcm(32, 1), 32);
        assert_eq!(lcm(32, 48), 96);
    }
}
