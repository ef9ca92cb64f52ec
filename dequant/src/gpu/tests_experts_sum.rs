//! The routed products with their weighted sum fused against each slot's own product
//! and a weighted sum of them: the products are the same bits, the sums agree to the
//! rounding of one fused multiply-add a rank.

use gguf_format::GgmlType;

use super::experts::{routed_sum, GpuExperts};
use super::matvec::{self, q8_bytes};
use super::tests::gpu_or_skip;
use super::tests_matvec::{gpu_products, random_matrix, upload, Rng};

#[test]
fn the_fused_sum_adds_each_tokens_weighted_slot_products() {
    let Some((device, stream)) =
        gpu_or_skip("the_fused_sum_adds_each_tokens_weighted_slot_products")
    else {
        return;
    };
    let mut rng = Rng(9191);
    let (count, rows, cols) = (6, 72, 512);
    let (n, k) = (3, 4);
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::IQ4_XS,
    ] {
        let tensor = random_matrix(ty, count * rows, cols, &mut rng);
        let expert_bytes = tensor.len() / count;
        // Token t's slots go to k distinct experts, in rank order.
        let ids: Vec<i32> = (0..n)
            .flat_map(|t| (0..k).map(move |r| ((t + 2 * r) % count) as i32))
            .collect();
        let weights: Vec<f32> = (0..n * k).map(|_| rng.unit()).collect();
        let x: Vec<f32> = (0..n * k * cols).map(|_| rng.unit()).collect();
        let initial: Vec<f32> = (0..n * rows).map(|_| rng.unit()).collect();
        // Each slot's product through its expert alone, then the weighted sum.
        let mut want = initial.clone();
        for t in 0..n {
            let mut sum = vec![0f32; rows];
            for r in 0..k {
                let s = t * k + r;
                let e = ids[s] as usize;
                let w = tensor[e * expert_bytes..(e + 1) * expert_bytes].to_vec();
                let y = gpu_products(
                    &device,
                    &stream,
                    ty,
                    &[(w, rows)],
                    cols,
                    &x[s * cols..(s + 1) * cols],
                    1,
                    None,
                );
                for (acc, v) in sum.iter_mut().zip(&y[0]) {
                    *acc = v.mul_add(weights[s], *acc);
                }
            }
            for (o, v) in want[t * rows..(t + 1) * rows].iter_mut().zip(&sum) {
                *o += v;
            }
        }
        let tensor_dev = upload(&device, &stream, &tensor);
        let experts = GpuExperts::new(ty, count, rows, cols, tensor_dev.view()).expect("experts");
        let x_dev = upload(&device, &stream, &x);
        let mut xq = device.alloc::<u8>(q8_bytes(n * k, cols)).expect("q8");
        matvec::quantize_q8(x_dev.view(), n * k, cols, xq.view_mut(), &stream).expect("quantize");
        let ids_dev = upload(&device, &stream, &ids);
        let weights_dev = upload(&device, &stream, &weights);
        let mut out = upload(&device, &stream, &initial);
        routed_sum(
            &experts,
            xq.view(),
            ids_dev.view(),
            weights_dev.view(),
            n,
            k,
            &mut out.view_mut(),
            &stream,
        )
        .expect("fused products");
        let mut got = vec![0f32; n * rows];
        stream
            .read_to_host(out.view(), &mut got)
            .expect("read back");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                "{ty}: token {} row {}: fused {g} against {w}",
                i / rows,
                i % rows
            );
        }
        // A count of slots the input does not hold is refused before any launch.
        let refused = routed_sum(
            &experts,
            xq.view(),
            ids_dev.view(),
            weights_dev.view(),
            n,
            k + 1,
            &mut out.view_mut(),
            &stream,
        );
        assert!(refused.is_err(), "{ty}: k + 1 slots a token were taken");
    }
}
