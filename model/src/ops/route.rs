//! A mixture-of-experts router's arithmetic as ggml's CPU backend performs it: the
//! softmax of the router's logits, the experts ranked by probability (the order
//! `std::sort` of GCC's C++ library leaves them in, ties included), and the selected
//! probabilities' renormalization.

use super::attention::reduce8;
use super::expf;

/// `softmax(x)` into `out`, as ggml's `soft_max` computes a row: the maximum, then
/// `e^(x - max)` by ggml's vectorised exponential in groups of eight (each group summed
/// in a fixed order, the groups' sums added in f64) and the C library's for the rest,
/// then every value multiplied by `1 / sum` rounded to f32.
pub fn soft_max(x: &[f32], out: &mut [f32]) {
    let max = x
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| if m > v { m } else { v });
    let mut sum = 0.0f64;
    let whole = x.len() / 8 * 8;
    for (xs, os) in x[..whole].chunks_exact(8).zip(out.chunks_exact_mut(8)) {
        let mut lanes = [0.0f32; 8];
        for ((l, o), &v) in lanes.iter_mut().zip(os.iter_mut()).zip(xs) {
            *l = expf(v - max);
            *o = *l;
        }
        sum += f64::from(reduce8(&lanes));
    }
    for (o, &v) in out[whole..].iter_mut().zip(&x[whole..]) {
        *o = (v - max).exp();
        sum += f64::from(*o);
    }
    let inv = (1.0 / sum) as f32;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// The indices of `values` from the largest value to the smallest, in the order ggml's
/// `argsort` (descending) leaves them: `std::sort` of GCC's C++ library, an introsort
/// that is not stable, so equal values come out in the order its partitions leave them.
pub fn argsort_desc(values: &[f32]) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    let before = |a: u32, b: u32| values[a as usize] > values[b as usize];
    if idx.len() > 1 {
        let depth = 2 * (usize::BITS - 1 - idx.len().leading_zeros()) as usize;
        introsort_loop(&mut idx, depth, &before);
        final_insertion_sort(&mut idx, &before);
    }
    idx
}

/// Below this many elements a partition is left to the final insertion sort.
const THRESHOLD: usize = 16;

fn introsort_loop(v: &mut [u32], mut depth: usize, before: &impl Fn(u32, u32) -> bool) {
    let mut len = v.len();
    while len > THRESHOLD {
        if depth == 0 {
            heap_sort(&mut v[..len], before);
            return;
        }
        depth -= 1;
        let cut = partition_pivot(&mut v[..len], before);
        introsort_loop(&mut v[cut..len], depth, before);
        len = cut;
    }
}

/// Moves the median of elements 1, the middle and the last to the front, then
/// partitions the rest around it; returns where the second part starts.
fn partition_pivot(v: &mut [u32], before: &impl Fn(u32, u32) -> bool) -> usize {
    let (a, b, c) = (1, v.len() / 2, v.len() - 1);
    let (va, vb, vc) = (v[a], v[b], v[c]);
    let median = if before(va, vb) {
        if before(vb, vc) {
            b
        } else if before(va, vc) {
            c
        } else {
            a
        }
    } else if before(va, vc) {
        a
    } else if before(vb, vc) {
        c
    } else {
        b
    };
    v.swap(0, median);
    let pivot = v[0];
    let (mut first, mut last) = (1, v.len());
    loop {
        while before(v[first], pivot) {
            first += 1;
        }
        last -= 1;
        while before(pivot, v[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        v.swap(first, last);
        first += 1;
    }
}

fn final_insertion_sort(v: &mut [u32], before: &impl Fn(u32, u32) -> bool) {
    if v.len() > THRESHOLD {
        insertion_sort(&mut v[..THRESHOLD], before);
        for i in THRESHOLD..v.len() {
            linear_insert(v, i, before);
        }
    } else {
        insertion_sort(v, before);
    }
}

fn insertion_sort(v: &mut [u32], before: &impl Fn(u32, u32) -> bool) {
    for i in 1..v.len() {
        if before(v[i], v[0]) {
            v[..=i].rotate_right(1);
        } else {
            linear_insert(v, i, before);
        }
    }
}

/// Moves `v[i]` back past the elements it goes before (something before it is known
/// not to be after it).
fn linear_insert(v: &mut [u32], mut i: usize, before: &impl Fn(u32, u32) -> bool) {
    let value = v[i];
    while before(value, v[i - 1]) {
        v[i] = v[i - 1];
        i -= 1;
    }
    v[i] = value;
}

/// The heap sort introsort falls back to past its depth limit (`std::partial_sort` of
/// the whole range: a heap made, then popped from the back).
fn heap_sort(v: &mut [u32], before: &impl Fn(u32, u32) -> bool) {
    let len = v.len();
    if len < 2 {
        return;
    }
    let mut parent = (len - 2) / 2;
    loop {
        let value = v[parent];
        adjust_heap(v, parent, len, value, before);
        if parent == 0 {
            break;
        }
        parent -= 1;
    }
    let mut end = len;
    while end > 1 {
        end -= 1;
        let value = v[end];
        v[end] = v[0];
        adjust_heap(v, 0, end, value, before);
    }
}

/// Sifts the hole at `hole` down to a leaf, then `value` up from there, in
/// `v[..len]`.
fn adjust_heap(
    v: &mut [u32],
    mut hole: usize,
    len: usize,
    value: u32,
    before: &impl Fn(u32, u32) -> bool,
) {
    let top = hole;
    let mut child = hole;
    while child < (len - 1) / 2 {
        child = 2 * (child + 1);
        if before(v[child], v[child - 1]) {
            child -= 1;
        }
        v[hole] = v[child];
        hole = child;
    }
    if len.is_multiple_of(2) && child == (len - 2) / 2 {
        child = 2 * (child + 1);
        v[hole] = v[child - 1];
        hole = child - 1;
    }
    let mut parent = hole.wrapping_sub(1) / 2;
    while hole > top && before(v[parent], value) {
        v[hole] = v[parent];
        hole = parent;
        parent = hole.wrapping_sub(1) / 2;
    }
    v[hole] = value;
}

/// The selected experts' weights renormalized as llama.cpp does: divided by their sum
/// (added in f64, rounded to f32) clamped from below at the smallest normal f16.
pub fn renormalize(weights: &mut [f32]) {
    let sum = weights.iter().map(|&w| f64::from(w)).sum::<f64>() as f32;
    let sum = sum.clamp(6.103_515_6e-5, f32::INFINITY);
    for w in weights.iter_mut() {
        *w /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A comparison sort's result for distinct values is the one order there is.
    #[test]
    fn distinct_values_come_out_largest_first() {
        let mut state = 12345u32;
        for n in [1, 2, 5, 16, 17, 33, 128, 300] {
            let values: Vec<f32> = (0..n)
                .map(|_| {
                    state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (state >> 8) as f32
                })
                .collect();
            let order = argsort_desc(&values);
            let mut expected: Vec<u32> = (0..n as u32).collect();
            expected.sort_by(|&a, &b| values[b as usize].total_cmp(&values[a as usize]));
            assert_eq!(order, expected, "{n} values");
        }
    }

    /// Up to 16 values the sort is an insertion sort, which keeps ties in index order;
    /// past that the partitions move them: the orders GCC's `std::sort` (libstdc++, with
    /// `a > b` as the comparison) gives these inputs, printed by a C++ program.
    #[test]
    fn ties_come_out_as_gccs_sort_leaves_them() {
        assert_eq!(argsort_desc(&[1.0, 2.0, 2.0, 1.0, 2.0]), [1, 2, 4, 0, 3]);
        let cases: [(usize, usize, usize, &[u32]); 3] = [
            (
                40,
                7,
                5,
                &[
                    17, 2, 37, 22, 7, 32, 27, 12, 9, 24, 14, 29, 19, 34, 4, 39, 21, 1, 26, 31, 36,
                    16, 11, 6, 18, 23, 38, 13, 28, 3, 8, 33, 0, 20, 5, 35, 10, 30, 15, 25,
                ],
            ),
            (
                24,
                3,
                4,
                &[
                    1, 21, 5, 9, 17, 13, 2, 22, 6, 18, 10, 14, 23, 19, 15, 11, 7, 3, 12, 16, 8, 20,
                    4, 0,
                ],
            ),
            (
                128,
                11,
                6,
                &[
                    79, 25, 31, 37, 43, 49, 55, 61, 67, 73, 1, 85, 91, 97, 103, 109, 115, 121, 127,
                    19, 7, 13, 56, 38, 104, 44, 98, 14, 50, 92, 20, 86, 62, 8, 80, 68, 74, 110,
                    122, 2, 26, 32, 116, 123, 81, 63, 87, 69, 27, 57, 9, 117, 93, 51, 3, 33, 99,
                    75, 45, 21, 15, 111, 105, 39, 76, 4, 124, 10, 82, 88, 118, 94, 100, 112, 106,
                    22, 46, 70, 28, 52, 64, 34, 58, 16, 40, 47, 71, 101, 5, 41, 107, 35, 113, 17,
                    29, 119, 23, 125, 89, 83, 65, 11, 59, 77, 53, 95, 78, 24, 84, 18, 72, 120, 66,
                    126, 30, 0, 114, 48, 12, 60, 36, 108, 90, 54, 42, 102, 96, 6,
                ],
            ),
        ];
        for (n, mul, modulus, expected) in cases {
            let values: Vec<f32> = (0..n).map(|i| ((i * mul) % modulus) as f32).collect();
            assert_eq!(argsort_desc(&values), expected, "{n} values");
        }
    }

    #[test]
    fn the_heap_sort_fallback_sorts() {
        let values: Vec<f32> = (0..40).map(|i| ((i * 7) % 40) as f32).collect();
        let mut idx: Vec<u32> = (0..40).collect();
        heap_sort(&mut idx, &|a, b| values[a as usize] > values[b as usize]);
        let sorted: Vec<f32> = idx.iter().map(|&i| values[i as usize]).collect();
        assert!(sorted.windows(2).all(|w| w[0] >= w[1]), "{sorted:?}");
    }

    #[test]
    fn softmax_sums_to_one_and_keeps_the_order() {
        let x: Vec<f32> = (0..13).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut p = vec![0.0; x.len()];
        soft_max(&x, &mut p);
        let sum: f32 = p.iter().sum();
        assert!((sum - 1.0).abs() < 1e-5, "{sum}");
        assert_eq!(argsort_desc(&p), argsort_desc(&x));
    }

    #[test]
    fn renormalized_weights_sum_to_one_and_zero_weights_stay_finite() {
        let mut w = [0.2, 0.1, 0.1];
        renormalize(&mut w);
        assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let mut z = [0.0, 0.0];
        renormalize(&mut z);
        assert_eq!(z, [0.0, 0.0]);
    }
}
