//! Rows of a layer's products computed elsewhere while the CPU computes the rest.
//!
//! A GPU model over its budget computes the layers it does not hold on the CPU, from the
//! mapped file. The device sits idle meanwhile, and it can read host memory in place
//! (over PCIe 5, about 51 GB/s: most of what 16 cores multiply through). So a
//! [`RowOffload`] takes the first rows of each product of those layers and the CPU the
//! others, at once: each row's sum is the same function of its row and the activations
//! wherever it is computed, and the CPU's rows are the very bits the whole product gives
//! them.

use dequant::matmul::QuantizedMatrix;

use super::products::{add_bias, linear, linears, matrix_rows, resize};
use crate::plan::Linear;
use crate::ModelError;

/// Computes the first rows of products on another device.
pub(crate) trait RowOffload {
    /// How many of `lin`'s first rows the other side computes: 0 (none) to fewer than
    /// `lin.rows`.
    fn rows(&self, lin: &Linear) -> usize;

    /// Starts `x · W[..parts[i]]ᵀ` for `n` tokens of each of `lins` whose part is not 0
    /// (all of one width, `x` holding `n` rows of it).
    fn start(
        &mut self,
        lins: &[&Linear],
        parts: &[usize],
        x: &[f32],
        n: usize,
    ) -> Result<(), ModelError>;

    /// Waits for the products [`RowOffload::start`] began and writes row `r` of token
    /// `t` of each into `outs[i][t * lins[i].rows + r]`.
    fn finish(
        &mut self,
        lins: &[&Linear],
        parts: &[usize],
        n: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<(), ModelError>;
}

/// [`super::products::linears`] with the first rows of each product on `offload`'s side,
/// computed while the CPU computes the others.
pub(crate) fn split_linears<const K: usize>(
    offload: Option<&mut (dyn RowOffload + Send)>,
    lins: [&Linear; K],
    x: &[f32],
    n: usize,
    mut outs: [&mut Vec<f32>; K],
) -> Result<(), ModelError> {
    let Some(offload) = offload else {
        return all_on_cpu(lins, x, n, outs);
    };
    let parts: [usize; K] = std::array::from_fn(|i| offload.rows(lins[i]).min(lins[i].rows));
    if parts.iter().all(|&p| p == 0) {
        return all_on_cpu(lins, x, n, outs);
    }
    offload.start(&lins, &parts, x, n)?;
    let cpu = cpu_rows(&lins, &parts, x, n, &mut outs);
    // Wait for the other side even when the CPU failed: its copies write our buffers.
    let other = {
        let mut slices = outs.each_mut().map(|o| o.as_mut_slice());
        offload.finish(&lins, &parts, n, &mut slices)
    };
    cpu?;
    other?;
    for (lin, out) in lins.iter().zip(outs.iter_mut()) {
        add_bias(lin, out)?;
    }
    Ok(())
}

/// Every row on the CPU, as the CPU forward pass computes a layer's products.
fn all_on_cpu<const K: usize>(
    lins: [&Linear; K],
    x: &[f32],
    n: usize,
    outs: [&mut Vec<f32>; K],
) -> Result<(), ModelError> {
    if K == 1 {
        let out = outs.into_iter().next().expect("one output");
        return linear(lins[0], x, n, out);
    }
    linears(lins, x, n, outs)
}

/// Rows `parts[i]..` of each product on the CPU, into their places of `outs` (resized to
/// `n` tokens of each matrix's rows).
fn cpu_rows<const K: usize>(
    lins: &[&Linear; K],
    parts: &[usize; K],
    x: &[f32],
    n: usize,
    outs: &mut [&mut Vec<f32>; K],
) -> Result<(), ModelError> {
    for (lin, out) in lins.iter().zip(outs.iter_mut()) {
        resize(out, n * lin.rows);
    }
    let matrices = lins
        .iter()
        .zip(parts)
        .filter(|(lin, &part)| part < lin.rows)
        .map(|(lin, &part)| matrix_rows(lin, part..lin.rows))
        .collect::<Result<Vec<_>, _>>()?;
    let name = || {
        lins.iter()
            .map(|l| l.weight.name())
            .collect::<Vec<_>>()
            .join(" + ")
    };
    let fusable = n == 1
        && lins
            .iter()
            .all(|l| l.weight.ggml_type() == lins[0].weight.ggml_type() && l.cols == lins[0].cols);
    if fusable {
        // One parallel loop over every matrix's rows, straight into their places.
        let mut ys: Vec<&mut [f32]> = outs
            .iter_mut()
            .zip(parts)
            .filter(|(out, &part)| part < out.len())
            .map(|(out, &part)| &mut out[part..])
            .collect();
        return QuantizedMatrix::matvec_many(&matrices, x, &mut ys).map_err(|source| {
            ModelError::Matmul {
                name: name(),
                source,
            }
        });
    }
    let mut matrices = matrices.into_iter();
    let mut rows = Vec::new();
    for ((lin, &part), out) in lins.iter().zip(parts).zip(outs.iter_mut()) {
        if part == lin.rows {
            continue;
        }
        let matrix = matrices
            .next()
            .expect("one matrix per product with CPU rows");
        let width = lin.rows - part;
        resize(&mut rows, n * width);
        matrix
            .matmul(x, n, &mut rows)
            .map_err(|source| ModelError::Matmul {
                name: name(),
                source,
            })?;
        for (t, token) in rows.chunks_exact(width).enumerate() {
            out[t * lin.rows + part..(t + 1) * lin.rows].copy_from_slice(token);
        }
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use gguf_format::{GgmlType, GgufWriter};
    use tensor_store::TensorStore;

    /// The other side played by the CPU: its rows from the same kernels on the first
    /// rows alone.
    struct CpuRows {
        share: f64,
        pending: Vec<Vec<f32>>,
    }

    impl RowOffload for CpuRows {
        fn rows(&self, lin: &Linear) -> usize {
            ((lin.rows as f64 * self.share) as usize / 32 * 32).min(lin.rows - 1)
        }
        fn start(
            &mut self,
            lins: &[&Linear],
            parts: &[usize],
            x: &[f32],
            n: usize,
        ) -> Result<(), ModelError> {
            self.pending.clear();
            for (lin, &part) in lins.iter().zip(parts) {
                let mut y = vec![0f32; n * part];
                if part > 0 {
                    matrix_rows(lin, 0..part)?.matmul(x, n, &mut y).unwrap();
                }
                self.pending.push(y);
            }
            Ok(())
        }
        fn finish(
            &mut self,
            lins: &[&Linear],
            parts: &[usize],
            n: usize,
            outs: &mut [&mut [f32]],
        ) -> Result<(), ModelError> {
            for i in 0..lins.len() {
                for t in 0..n {
                    let part = parts[i];
                    outs[i][t * lins[i].rows..t * lins[i].rows + part]
                        .copy_from_slice(&self.pending[i][t * part..(t + 1) * part]);
                }
            }
            Ok(())
        }
    }

    /// Q4_K blocks with small finite scales and random quants.
    pub(in crate::cpu) fn q4_k_rows(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut state = seed | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let blocks = rows * cols / 256;
        let mut bytes = Vec::with_capacity(blocks * 144);
        for _ in 0..blocks {
            let d = half::f16::from_f32(0.01 + (next() % 100) as f32 * 1e-4);
            let dmin = half::f16::from_f32((next() % 100) as f32 * 1e-4);
            bytes.extend_from_slice(&d.to_le_bytes());
            bytes.extend_from_slice(&dmin.to_le_bytes());
            bytes.extend((0..140).map(|_| next() as u8));
        }
        bytes
    }

    #[test]
    fn split_products_give_the_whole_products_bits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let cols = 512;
        let shapes = [("a", 200usize), ("b", 96), ("c", 40)];
        let mut writer = GgufWriter::new();
        writer
            .add_metadata("general.architecture", "llama")
            .unwrap();
        let data: Vec<Vec<u8>> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(name, rows))| {
                writer
                    .add_tensor(name, GgmlType::Q4_K, &[cols as u64, rows as u64])
                    .unwrap();
                q4_k_rows(rows, cols, 77 + i as u64)
            })
            .collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        std::fs::write(&path, writer.to_bytes(&refs).unwrap()).unwrap();
        let store = TensorStore::open(&path).unwrap();
        let lins: Vec<Linear> = shapes
            .iter()
            .map(|&(name, rows)| Linear {
                weight: store.tensor(name).unwrap(),
                bias: None,
                rows,
                cols,
                first_row: 0,
            })
            .collect();
        for n in [1, 3] {
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect();
            let mut whole = [Vec::new(), Vec::new(), Vec::new()];
            let [w0, w1, w2] = &mut whole;
            linears([&lins[0], &lins[1], &lins[2]], &x, n, [w0, w1, w2]).unwrap();
            for share in [0.0, 0.4, 0.99] {
                let mut other = CpuRows {
                    share,
                    pending: Vec::new(),
                };
                let mut split = [vec![f32::NAN; 3], Vec::new(), Vec::new()];
                let [s0, s1, s2] = &mut split;
                split_linears(
                    Some(&mut other),
                    [&lins[0], &lins[1], &lins[2]],
                    &x,
                    n,
                    [s0, s1, s2],
                )
                .unwrap();
                for (got, want) in split.iter().zip(&whole) {
                    let bits = |v: &Vec<f32>| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(got), bits(want), "{n} tokens, share {share}");
                }
            }
        }
    }
}
