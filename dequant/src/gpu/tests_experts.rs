//! The routed products against the dense ones: each slot's output is, bit for bit, the
//! product of its expert's matrix alone with its token's activations (the same
//! arithmetic per row and token), for tiles of one slot and of eight, gate and up in one
//! launch, slots reading their own rows, and tiles left empty; and the routed products
//! on the matrix units against the f16-rounded product of each slot's expert, within the
//! dense batch products' bound.

use gguf_format::GgmlType;
use half::f16;

use super::experts::{
    max_tiles, routed_products, GpuExperts, RoutedInput, SlotInput, MATMUL_TILE_TOKENS,
};
use super::matmul;
use super::matvec::{self, q8_bytes, MAX_TOKENS};
use super::tests::gpu_or_skip;
use super::tests_matvec::{
    gpu_products, random_matrix, reference_rounded, relative_error, rounded_bound, upload, Rng,
};

/// Tiles of at most `tile_tokens` slots of one expert, and the slots grouped by expert,
/// as the model's grouping kernel lays them out (here in slot order within an expert),
/// padded with empty tiles to [`max_tiles`].
fn tiles_for(ids: &[usize], experts: usize, tile_tokens: usize) -> (Vec<i32>, Vec<i32>) {
    let mut order = Vec::new();
    let mut tiles = Vec::new();
    for e in 0..experts {
        let slots: Vec<i32> = (0..ids.len())
            .filter(|&s| ids[s] == e)
            .map(|s| s as i32)
            .collect();
        for chunk in slots.chunks(tile_tokens) {
            tiles.extend([e as i32, order.len() as i32, chunk.len() as i32]);
            order.extend_from_slice(chunk);
        }
    }
    tiles.resize(3 * max_tiles(ids.len(), experts, tile_tokens), 0);
    (tiles, order)
}

#[test]
fn routed_products_are_each_experts_own_product() {
    let Some((device, stream)) = gpu_or_skip("routed_products_are_each_experts_own_product") else {
        return;
    };
    let mut rng = Rng(4242);
    let (count, rows, cols) = (6, 48, 256);
    let (n, used) = (5, 2);
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q8_0,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
        GgmlType::MXFP4,
        GgmlType::IQ2_XS,
    ] {
        // Two tensors (gate and up) of `count` experts each.
        let tensors: Vec<Vec<u8>> = (0..2)
            .map(|_| random_matrix(ty, count * rows, cols, &mut rng))
            .collect();
        let expert_bytes = tensors[0].len() / count;
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
        // Each token's distinct experts.
        let ids: Vec<usize> = (0..n)
            .flat_map(|t| {
                let first = (rng.next() % count as u64) as usize;
                [first, (first + 1 + t % (count - 1)) % count]
            })
            .collect();
        let slots = ids.len();
        let dev_tensors: Vec<_> = tensors
            .iter()
            .map(|t| upload(&device, &stream, t))
            .collect();
        let experts: Vec<GpuExperts<'_>> = dev_tensors
            .iter()
            .map(|b| GpuExperts::new(ty, count, rows, cols, b.view()).expect("experts"))
            .collect();
        let x_dev = upload(&device, &stream, &x);
        let mut q8 = device.alloc::<u8>(q8_bytes(n, cols)).expect("q8");
        matvec::quantize_q8(x_dev.view(), n, cols, q8.view_mut(), &stream).expect("quantize");
        // Each slot's expected output: its expert's matrix alone, its token's row.
        let expected: Vec<Vec<f32>> = (0..2)
            .map(|m| {
                (0..slots)
                    .flat_map(|s| {
                        let e = ids[s];
                        let w = tensors[m][e * expert_bytes..(e + 1) * expert_bytes].to_vec();
                        let t = s / used;
                        let xt = &x[t * cols..(t + 1) * cols];
                        gpu_products(&device, &stream, ty, &[(w, rows)], cols, xt, 1, None)
                            .remove(0)
                    })
                    .collect()
            })
            .collect();
        for tile_tokens in [1, MAX_TOKENS] {
            let (tiles, order) = tiles_for(&ids, count, tile_tokens);
            let tiles_dev = upload(&device, &stream, &tiles);
            let order_dev = upload(&device, &stream, &order);
            let mut outs: Vec<_> = (0..2)
                .map(|_| upload(&device, &stream, &vec![f32::NAN; slots * rows]))
                .collect();
            let mut views: Vec<_> = outs.iter_mut().map(|o| o.view_mut()).collect();
            routed_products(
                &experts,
                RoutedInput::Q8(q8.view()),
                n,
                SlotInput::Token { per_token: used },
                tiles_dev.view(),
                order_dev.view(),
                tile_tokens,
                &mut views,
                &stream,
            )
            .expect("routed products");
            for (m, out) in outs.iter().enumerate() {
                let mut host = vec![0f32; slots * rows];
                stream.read_to_host(out.view(), &mut host).expect("read");
                assert_eq!(
                    host, expected[m],
                    "{ty}: tensor {m}, tiles of {tile_tokens}"
                );
            }
            // Slots reading rows of their own: row s is token s / used's, so the
            // products are the same.
            let own: Vec<f32> = (0..slots)
                .flat_map(|s| x[(s / used) * cols..(s / used + 1) * cols].to_vec())
                .collect();
            let own_dev = upload(&device, &stream, &own);
            let mut own_q8 = device.alloc::<u8>(q8_bytes(slots, cols)).expect("q8");
            matvec::quantize_q8(own_dev.view(), slots, cols, own_q8.view_mut(), &stream)
                .expect("quantize");
            let mut out = upload(&device, &stream, &vec![f32::NAN; slots * rows]);
            routed_products(
                &experts[..1],
                RoutedInput::Q8(own_q8.view()),
                slots,
                SlotInput::Own,
                tiles_dev.view(),
                order_dev.view(),
                tile_tokens,
                &mut [out.view_mut()],
                &stream,
            )
            .expect("routed products of own rows");
            let mut host = vec![0f32; slots * rows];
            stream.read_to_host(out.view(), &mut host).expect("read");
            assert_eq!(host, expected[0], "{ty}: own rows, tiles of {tile_tokens}");
        }
    }
}

#[test]
fn mismatched_routed_products_are_refused() {
    let Some((device, stream)) = gpu_or_skip("mismatched_routed_products_are_refused") else {
        return;
    };
    let mut rng = Rng(9);
    let (count, rows, cols) = (4, 32, 256);
    let w = upload(
        &device,
        &stream,
        &random_matrix(GgmlType::Q4_K, count * rows, cols, &mut rng),
    );
    // Float experts have no routed products; a tensor of the wrong size is refused.
    assert!(GpuExperts::new(GgmlType::F16, count, rows, cols, w.view()).is_err());
    assert!(GpuExperts::new(GgmlType::Q4_K, count + 1, rows, cols, w.view()).is_err());
    let experts = GpuExperts::new(GgmlType::Q4_K, count, rows, cols, w.view()).expect("experts");
    let q8 = device.alloc::<u8>(q8_bytes(2, cols)).expect("q8");
    let tiles = upload(&device, &stream, &[0i32; 3 * 4]);
    let order = upload(&device, &stream, &[0i32, 1, 2, 3]);
    let mut out = device.alloc::<f32>(4 * rows).expect("out");
    let run = |input, tile_tokens, out: &mut hip_backend::DeviceBuffer<f32>| {
        routed_products(
            &[experts],
            RoutedInput::Q8(q8.view()),
            2,
            input,
            tiles.view(),
            order.view(),
            tile_tokens,
            &mut [out.view_mut()],
            &stream,
        )
    };
    // Two tokens of two slots each, in tiles of one: accepted.
    run(SlotInput::Token { per_token: 2 }, 1, &mut out).expect("a consistent launch");
    // Three slots a token is six slots, not the four listed; tiles of three are not taken.
    assert!(run(SlotInput::Token { per_token: 3 }, 1, &mut out).is_err());
    assert!(run(SlotInput::Token { per_token: 2 }, 3, &mut out).is_err());
    // Tiles of eight need room for more tiles than given.
    assert!(run(SlotInput::Token { per_token: 2 }, MAX_TOKENS, &mut out).is_err());
    // Q8 input runs the decode products, which do not take the matrix units' tiles.
    assert!(run(
        SlotInput::Token { per_token: 2 },
        MATMUL_TILE_TOKENS,
        &mut out
    )
    .is_err());
}

/// The f16 input of the matrix units' products for `n` rows of `x`.
fn f16_input(
    device: &hip_backend::Device,
    stream: &hip_backend::Stream,
    x: &[f32],
    n: usize,
    cols: usize,
) -> (
    hip_backend::DeviceBuffer<f16>,
    hip_backend::DeviceBuffer<f32>,
) {
    let x_dev = upload(device, stream, x);
    let mut scales = upload(device, stream, &vec![f32::NAN; n]);
    let mut x16 = upload(device, stream, &vec![f16::NAN; n * cols]);
    matmul::row_scales(
        x_dev.view(),
        n,
        cols,
        scales.view_mut(),
        x16.view_mut(),
        stream,
    )
    .expect("scales");
    (x16, scales)
}

/// Slots of one expert past a whole tile (two tiles for it), row tiles left partly
/// empty, gate and up in one launch, and slots reading their own rows.
#[test]
fn routed_products_on_the_matrix_units_match_each_experts_product() {
    let Some((device, stream)) =
        gpu_or_skip("routed_products_on_the_matrix_units_match_each_experts_product")
    else {
        return;
    };
    let mut rng = Rng(777);
    let (count, rows, cols) = (5, 200, 512);
    let (n, used) = (200, 2);
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::MXFP4,
        GgmlType::IQ2_XS,
    ] {
        let tensors: Vec<Vec<u8>> = (0..2)
            .map(|_| random_matrix(ty, count * rows, cols, &mut rng))
            .collect();
        let expert_bytes = tensors[0].len() / count;
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
        // Two thirds of the tokens choose expert 0 first: it takes more than a tile.
        let ids: Vec<usize> = (0..n)
            .flat_map(|t| {
                let first = if t % 3 == 0 {
                    (rng.next() % count as u64) as usize
                } else {
                    0
                };
                [first, (first + 1 + t % (count - 1)) % count]
            })
            .collect();
        let slots = ids.len();
        assert!(ids.iter().filter(|&&e| e == 0).count() > MATMUL_TILE_TOKENS);
        let dev_tensors: Vec<_> = tensors
            .iter()
            .map(|t| upload(&device, &stream, t))
            .collect();
        let experts: Vec<GpuExperts<'_>> = dev_tensors
            .iter()
            .map(|b| GpuExperts::new(ty, count, rows, cols, b.view()).expect("experts"))
            .collect();
        // Each slot's product with its expert alone, from f16-rounded operands.
        let f16_round = |v: f32| f16::from_f32(v).to_f32();
        let expected: Vec<Vec<f64>> = (0..2)
            .map(|m| {
                (0..slots)
                    .flat_map(|s| {
                        let e = ids[s];
                        let w = &tensors[m][e * expert_bytes..(e + 1) * expert_bytes];
                        let t = s / used;
                        let xt = &x[t * cols..(t + 1) * cols];
                        reference_rounded(ty, w, rows, cols, xt, 1, f16_round)
                    })
                    .collect()
            })
            .collect();
        let (tiles, order) = tiles_for(&ids, count, MATMUL_TILE_TOKENS);
        let tiles_dev = upload(&device, &stream, &tiles);
        let order_dev = upload(&device, &stream, &order);
        let read = |out: &hip_backend::DeviceBuffer<f32>| {
            let mut host = vec![0f32; slots * rows];
            stream.read_to_host(out.view(), &mut host).expect("read");
            host
        };
        let (x16, scales) = f16_input(&device, &stream, &x, n, cols);
        let mut outs: Vec<_> = (0..2)
            .map(|_| upload(&device, &stream, &vec![f32::NAN; slots * rows]))
            .collect();
        let mut views: Vec<_> = outs.iter_mut().map(|o| o.view_mut()).collect();
        routed_products(
            &experts,
            RoutedInput::F16 {
                x16: x16.view(),
                scales: scales.view(),
            },
            n,
            SlotInput::Token { per_token: used },
            tiles_dev.view(),
            order_dev.view(),
            MATMUL_TILE_TOKENS,
            &mut views,
            &stream,
        )
        .expect("routed products");
        for (m, out) in outs.iter().enumerate() {
            let err = relative_error(&read(out), &expected[m]);
            assert!(
                err <= rounded_bound(ty),
                "{ty}: tensor {m}, relative error {err:.2e}"
            );
        }
        // Slots reading rows of their own (row s holds token s / used's values).
        let own: Vec<f32> = (0..slots)
            .flat_map(|s| x[(s / used) * cols..(s / used + 1) * cols].to_vec())
            .collect();
        let (own16, own_scales) = f16_input(&device, &stream, &own, slots, cols);
        let mut out = upload(&device, &stream, &vec![f32::NAN; slots * rows]);
        routed_products(
            &experts[..1],
            RoutedInput::F16 {
                x16: own16.view(),
                scales: own_scales.view(),
            },
            slots,
            SlotInput::Own,
            tiles_dev.view(),
            order_dev.view(),
            MATMUL_TILE_TOKENS,
            &mut [out.view_mut()],
            &stream,
        )
        .expect("routed products of own rows");
        let err = relative_error(&read(&out), &expected[0]);
        assert!(
            err <= rounded_bound(ty),
            "{ty}: own rows, relative error {err:.2e}"
        );
        // An input of the wrong length is refused before any launch.
        assert!(routed_products(
            &experts[..1],
            RoutedInput::F16 {
                x16: own16.view(),
                scales: own_scales.view(),
            },
            n,
            SlotInput::Own,
            tiles_dev.view(),
            order_dev.view(),
            MATMUL_TILE_TOKENS,
            &mut [out.view_mut()],
            &stream,
        )
        .is_err());
    }
}
