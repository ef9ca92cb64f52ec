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

    /// The tensors the cache does not upload: those this device takes parts of, and
    /// `attn_output`'s bias, which the leading device takes whole as its part and the
    /// others do not use.
    pub fn cut_tensors(&self, config: &ModelConfig, plan: &ExecutionPlan) -> HashSet<usize> {
        let biases = plan.layers.iter().filter_map(|l| l.wo.bias.as_ref());
        self.cuts(config, plan)
            .flat_map(LayerParts::into_vec)
            .map(|(handle, _)| handle)
            .chain(biases.cloned())
            .map(|handle| handle.index())
            .collect()
    }

    /// What this device takes of every layer, each part with the rows and columns of
    /// the tensor it is (of a plan [`Shard::all`] accepted).
    fn cuts<'a>(
        &'a self,
        config: &'a ModelConfig,
        plan: &'a ExecutionPlan,
    ) -> impl Iterator<Item = LayerParts<(TensorHandle, Cut)>> + 'a {
        plan.layers
            .iter()
            .map(|layer| self.layer_cuts(config, layer))
    }

    fn layer_cuts(
        &self,
        config: &ModelConfig,
        layer: &LayerPlan,
    ) -> LayerParts<(TensorHandle, Cut)> {
        let (hd, hd_v) = (config.head_dim, config.head_dim_v);
        let (q, kv) = (&self.heads, &self.kv_heads);
        let rows = |lin: &Linear, rows: Range<usize>| {
            let bias = lin
                .bias
                .as_ref()
                .map(|b| (b.clone(), Cut::vector(rows.clone())));
            ((lin.weight.clone(), Cut::rows_of(lin, rows)), bias)
        };
        let (wq, bq) = rows(&layer.wq, q.start * hd..q.end * hd);
        let (wk, bk) = rows(&layer.wk, kv.start * hd..kv.end * hd);
        let (wv, bv) = rows(&layer.wv, kv.start * hd_v..kv.end * hd_v);
        let ffn = layer.ffn.dense().expect("Shard::all refuses experts");
        LayerParts {
            wq,
            bq,
            wk,
            bk,
            wv,
            bv,
            sinks: (layer.attn_sinks.as_ref()).map(|v| (v.handle.clone(), Cut::vector(q.clone()))),
            wo: (
                layer.wo.weight.clone(),
                Cut::cols_of(&layer.wo, q.start * hd_v..q.end * hd_v),
            ),
            // The devices' partial sums hold the bias once: the leading device's.
            bo: (layer.wo.bias.as_ref())
                .filter(|_| self.leads())
                .map(|b| (b.clone(), Cut::vector(0..layer.wo.rows))),
            gate: (
                ffn.gate.weight.clone(),
                Cut::rows_of(&ffn.gate, self.ff.clone()),
            ),
            up: (
                ffn.up.weight.clone(),
                Cut::rows_of(&ffn.up, self.ff.clone()),
            ),
            down: (
                ffn.down.weight.clone(),
                Cut::cols_of(&ffn.down, self.ff.clone()),
            ),
        }
    }

    /// The size of every part this device takes, in bytes.
    pub fn sizes(&self, config: &ModelConfig, plan: &ExecutionPlan) -> Vec<u64> {
        self.cuts(config, plan)
            .flat_map(LayerParts::into_vec)
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
    ) -> Result<Vec<LayerParts<PartMatrix>>, ModelError> {
        let cuts: Vec<LayerParts<(TensorHandle, Cut)>> = self.cuts(config, plan).collect();
        let parts: Vec<&(TensorHandle, Cut)> =
            cuts.iter().flat_map(|c| c.as_ref().into_vec()).collect();
        let mut tensors = upload_all(&parts, cache)?.into_iter();
        Ok(cuts
            .into_iter()
            .map(|layer| {
                layer.map(|(_, cut)| {
                    let tensor = tensors.next().expect("one tensor a part");
                    PartMatrix::from((tensor, cut))
                })
            })
            .collect())
    }
}

/// Uploads `parts` to `cache`'s device, in that order, gathered from the file by a few
/// threads at once, each with its page-locked staging; the first failure stops them.
fn upload_all(
    parts: &[&(TensorHandle, Cut)],
    cache: &DeviceCache<HipTarget>,
) -> Result<Vec<Tensor>, ModelError> {
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
                        let u64s = |r: &Range<usize>| r.start as u64..r.end as u64;
                        let tensor = TensorPart::of(handle, u64s(&cut.rows), u64s(&cut.cols))
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
    Ok(tensors
        .into_iter()
        .map(|t| t.expect("every part uploaded when none failed"))
        .collect())
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
    fn rows_of(lin: &Linear, rows: Range<usize>) -> Cut {
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
    fn vector(values: Range<usize>) -> Cut {
        Cut {
            rows: 0..1,
            cols: values,
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

/// What a split by tensors cuts of one layer, each a `T`: the parts' cuts, or a
/// device's parts uploaded ([`Shard::upload`]). The biases and sinks are those the
/// model has (and `bo` only on the leading device).
pub(super) struct LayerParts<T> {
    pub wq: T,
    pub bq: Option<T>,
    pub wk: T,
    pub bk: Option<T>,
    pub wv: T,
    pub bv: Option<T>,
    pub sinks: Option<T>,
    pub wo: T,
    pub bo: Option<T>,
    pub gate: T,
    pub up: T,
    pub down: T,
}

impl<T> LayerParts<T> {
    /// The parts, in the order [`LayerParts::map`] takes them in.
    fn into_vec(self) -> Vec<T> {
        let mut parts = Vec::with_capacity(12);
        self.map(|t| parts.push(t));
        parts
    }

    /// Each part through `f`, in [`LayerParts::into_vec`]'s order.
    fn map<U>(self, mut f: impl FnMut(T) -> U) -> LayerParts<U> {
        let wq = f(self.wq);
        let bq = self.bq.map(&mut f);
        let wk = f(self.wk);
        let bk = self.bk.map(&mut f);
        let wv = f(self.wv);
        let bv = self.bv.map(&mut f);
        let sinks = self.sinks.map(&mut f);
        let wo = f(self.wo);
        let bo = self.bo.map(&mut f);
        let (gate, up, down) = (f(self.gate), f(self.up), f(self.down));
        LayerParts {
            wq,
            bq,
            wk,
            bk,
            wv,
            bv,
            sinks,
            wo,
            bo,
            gate,
            up,
            down,
        }
    }

    fn as_ref(&self) -> LayerParts<&T> {
        LayerParts {
            wq: &self.wq,
            bq: self.bq.as_ref(),
            wk: &self.wk,
            bk: self.bk.as_ref(),
            wv: &self.wv,
            bv: self.bv.as_ref(),
            sinks: self.sinks.as_ref(),
            wo: &self.wo,
            bo: self.bo.as_ref(),
            gate: &self.gate,
            up: &self.up,
            down: &self.down,
        }
    }
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
