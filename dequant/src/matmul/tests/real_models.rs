//! The products on the real models' weights (`cargo xtask fetch-models`).

use super::{dequantize_row, dot_and_magnitude, paths, quantized_view, random_x, sum_rounding};
use crate::matmul::QuantizedMatrix;

/// `$ROCMFORGE_MODELS`, else `~/.cache/rocmforge/models` (`cargo xtask fetch-models`).
fn models_dir() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("ROCMFORGE_MODELS") {
        return dir.into();
    }
    let home = std::env::var_os("HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_default();
    home.join(".cache/rocmforge/models")
}

#[test]
fn real_model_weights_match_the_reference() {
    // The first rows of one tensor per distinct (type, shape) of each model: real scale
    // distributions, real outliers.
    const ROWS: usize = 48;
    for file in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gemma-3-270m-q4_k_m.gguf",
    ] {
        let path = models_dir().join(file);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run `cargo xtask fetch-models` first",
                path.display()
            )
        });
        let gguf = gguf_format::parse(&bytes).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for tensor in gguf.tensors.iter().filter(|t| t.shape.len() == 2) {
            let (ty, cols, rows) = (
                tensor.ggml_type,
                tensor.shape[0] as usize,
                tensor.shape[1] as usize,
            );
            if !seen.insert((ty, cols, rows)) {
                continue;
            }
            let range = gguf.tensor_range(tensor);
            let data = &bytes[range.start as usize..range.end as usize];
            let row_bytes = data.len() / rows;
            let rows = rows.min(ROWS);
            let weights = &data[..rows * row_bytes];
            let m = QuantizedMatrix::new(ty, rows, cols, weights).unwrap();
            let w: Vec<Vec<f32>> = weights
                .chunks_exact(row_bytes)
                .map(|r| dequantize_row(ty, r))
                .collect();
            let n_tokens = 3;
            let x = random_x(n_tokens * cols, rows as u64);
            let (xq, _) = quantized_view(ty, &x, n_tokens, cols);
            for path in paths() {
                let mut y = vec![0.0f32; n_tokens * rows];
                m.matmul_with(path, &x, n_tokens, &mut y).unwrap();
                for t in 0..n_tokens {
                    for (r, w_r) in w.iter().enumerate() {
                        let xq_t = &xq[t * cols..(t + 1) * cols];
                        let row = &weights[r * row_bytes..][..row_bytes];
                        let x_t = &x[t * cols..(t + 1) * cols];
                        let (dot, magnitude) = dot_and_magnitude(w_r, xq_t);
                        let reference = sum_rounding(ty, row, x_t) + dot;
                        let got = f64::from(y[t * rows + r]);
                        assert!(
                            (got - reference).abs() <= 1e-5 * magnitude + 1e-30,
                            "{file} {} ({ty}) row {r} token {t} on {path:?}: {got} vs {reference}",
                            tensor.name
                        );
                    }
                }
            }
        }
        assert!(
            seen.len() >= 5,
            "{file}: only {} distinct matrices",
            seen.len()
        );
    }
}
