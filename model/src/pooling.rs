//! Sentence embeddings from a model's hidden states: the mean of a text's token rows,
//! scaled to unit length, as both back ends and the server compute them.
//!
//! The rows are the last hidden states after the final norm ([`crate::Model::hidden_states`]),
//! what the output projection would read; llama.cpp's mean pooling with its default
//! Euclidean normalisation gives the same vector.

/// The mean of the rows of `rows` (`n_embd` values each), scaled to unit Euclidean
/// length. Sums are taken in f64, so the vector does not depend on the order of rows
/// beyond the last bits. A zero mean stays zero; no rows give an empty vector.
pub fn mean_pool_normalized(rows: &[f32], n_embd: usize) -> Vec<f32> {
    let mut mean = mean_pool(rows, n_embd);
    normalize(&mut mean);
    mean
}

/// The mean of the rows of `rows` (`n_embd` values each); empty when there are none.
pub fn mean_pool(rows: &[f32], n_embd: usize) -> Vec<f32> {
    if n_embd == 0 || rows.len() < n_embd {
        return Vec::new();
    }
    let n = rows.len() / n_embd;
    let mut sum = vec![0f64; n_embd];
    for row in rows.chunks_exact(n_embd) {
        for (s, &v) in sum.iter_mut().zip(row) {
            *s += f64::from(v);
        }
    }
    sum.iter().map(|&s| (s / n as f64) as f32).collect()
}

/// Scales `v` to unit Euclidean length, in place; a zero vector is left as it is.
pub fn normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        let scale = 1.0 / norm;
        for x in v.iter_mut() {
            *x = (f64::from(*x) * scale) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mean_of_rows_then_unit_length() {
        // Two rows of three: mean (2, 0, 1), length sqrt(5).
        let rows = [1.0, -1.0, 0.0, 3.0, 1.0, 2.0];
        let v = mean_pool_normalized(&rows, 3);
        let l = 5f32.sqrt();
        let want = [2.0 / l, 0.0, 1.0 / l];
        for (a, b) in v.iter().zip(want) {
            assert!((a - b).abs() < 1e-7, "{v:?}");
        }
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-6);
    }

    #[test]
    fn one_row_is_itself_scaled() {
        let v = mean_pool_normalized(&[0.0, 3.0, 4.0], 3);
        assert_eq!(v, [0.0, 0.6, 0.8]);
    }

    #[test]
    fn zero_and_empty_inputs_stay_as_they_are() {
        assert_eq!(mean_pool_normalized(&[0.0; 6], 3), [0.0; 3]);
        assert!(mean_pool_normalized(&[], 3).is_empty());
        assert!(mean_pool_normalized(&[1.0], 0).is_empty());
    }

    #[test]
    fn a_trailing_partial_row_is_ignored() {
        assert_eq!(mean_pool(&[2.0, 4.0, 9.0], 2), [2.0, 4.0]);
    }
}
