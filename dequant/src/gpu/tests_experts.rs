//! The routed products against the dense ones: each slot's output is, bit for bit, the
//! product of its expert's matrix alone with its token's activations (the same
//! arithmetic per row and token, on rows of at most 16 tasks), for tiles of one slot and
//! of eight, gate and up in one launch, slots reading their own rows, and tiles left
//! empty; and the routed products on the matrix units against the f16-rounded product of
//! each slot's expert, within the dense batch products' bound.

use gguf_format::GgmlType;
use half::f16;
use hip_backend::DeviceBuffer;

use super::experts::{
    max_tiles, routed_products, GpuExperts, RoutedInput, SlotInput, MATMUL_TILE_TOKENS,
    SKINNY_TILE_TOKENS, WIDE_TILE_TOKENS,
};
use super::matvec::{self, q8_bytes, MAX_TOKENS};
use super::tests::gpu_or_skip;
use super::tests_matvec::{
    download, f16_input, gpu_products, random_matrix, reference_rounded, relative_error,
    rounded_bound, upload, Rng,
};

/// Tiles of at most `tile_tokens` slots of one expert, and the slots grouped by expert,
/// as the model's grouping kernel lays them out (here in slot order within an expert),
/// padded with empty tiles to [`max_tiles`].
pub(super) fn tiles_for(ids: &[usize], experts: usize, tile_tokens: usize) -> (Vec<i32>, Vec<i32>) {
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

/// Gate and up, two tensors of `count` random experts of `ty` (`rows` × `cols`), the
/// activations of `n` tokens, and each token's two distinct experts, the first as
/// `first` picks it from the token's index.
pub(super) struct Routed {
    pub ty: GgmlType,
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
    pub tensors: Vec<Vec<u8>>,
    pub x: Vec<f32>,
    pub ids: Vec<usize>,
}

/// Experts a token is routed to in [`Routed`].
pub(super) const USED: usize = 2;

impl Routed {
    pub(super) fn new(
        ty: GgmlType,
        (count, rows, cols): (usize, usize, usize),
        n: usize,
        rng: &mut Rng,
        mut first: impl FnMut(usize, &mut Rng) -> usize,
    ) -> Routed {
        let tensors: Vec<Vec<u8>> = (0..2)
            .map(|_| random_matrix(ty, count * rows, cols, rng))
            .collect();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
        let ids: Vec<usize> = (0..n)
            .flat_map(|t| {
                let first = first(t, rng);
                [first, (first + 1 + t % (count - 1)) % count]
            })
            .collect();
        Routed {
            ty,
            count,
            rows,
            cols,
            tensors,
            x,
            ids,
        }
    }

    pub(super) fn slots(&self) -> usize {
        self.ids.len()
    }

    /// The tensors on the device.
    pub(super) fn upload(
        &self,
        device: &hip_backend::Device,
        stream: &hip_backend::Stream,
    ) -> Vec<DeviceBuffer<u8>> {
        self.tensors
            .iter()
            .map(|t| upload(device, stream, t))
            .collect()
    }

    /// The experts of the tensors uploaded as `dev`.
    pub(super) fn experts<'a>(&self, dev: &'a [DeviceBuffer<u8>]) -> Vec<GpuExperts<'a>> {
        dev.iter()
            .map(|b| {
                GpuExperts::new(self.ty, self.count, self.rows, self.cols, b.view())
                    .expect("experts")
            })
            .collect()
    }

    /// Every slot's results from each of `experts` (one output a tensor given), the
    /// input `n_x` rows read as `slot_input` says, the slots in tiles of `tile_tokens`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        &self,
        device: &hip_backend::Device,
        stream: &hip_backend::Stream,
        experts: &[GpuExperts<'_>],
        input: RoutedInput<'_>,
        n_x: usize,
        slot_input: SlotInput,
        tile_tokens: usize,
    ) -> Vec<Vec<f32>> {
        let (tiles, order) = tiles_for(&self.ids, self.count, tile_tokens);
        let tiles_dev = upload(device, stream, &tiles);
        let order_dev = upload(device, stream, &order);
        let mut outs: Vec<_> = experts
            .iter()
            .map(|_| upload(device, stream, &vec![f32::NAN; self.slots() * self.rows]))
            .collect();
        let mut views: Vec<_> = outs.iter_mut().map(|o| o.view_mut()).collect();
        routed_products(
            experts,
            input,
            n_x,
            slot_input,
            tiles_dev.view(),
            order_dev.view(),
            tile_tokens,
            &mut views,
            stream,
        )
        .expect("routed products");
        outs.iter().map(|o| download(stream, o)).collect()
    }

    /// For each tensor, every slot's product with its expert's matrix alone and its
    /// token's row, as `product` computes it from the two.
    pub(super) fn per_slot<T>(
        &self,
        mut product: impl FnMut(&[u8], &[f32]) -> Vec<T>,
    ) -> Vec<Vec<T>> {
        let expert_bytes = self.tensors[0].len() / self.count;
        (0..2)
            .map(|m| {
                (0..self.slots())
                    .flat_map(|s| {
                        let e = self.ids[s];
                        let w = &self.tensors[m][e * expert_bytes..(e + 1) * expert_bytes];
                        product(w, self.token_row(s))
                    })
                    .collect()
            })
            .collect()
    }

    /// The activations of slot `s`'s token.
    pub(super) fn token_row(&self, s: usize) -> &[f32] {
        let t = s / USED;
        &self.x[t * self.cols..(t + 1) * self.cols]
    }

    /// Rows of their own for the slots: row s holds token s / USED's values.
    pub(super) fn own_rows(&self) -> Vec<f32> {
        (0..self.slots())
            .flat_map(|s| self.token_row(s).to_vec())
            .collect()
    }
}

#[test]
fn routed_products_are_each_experts_own_product() {
    let Some((device, stream)) = gpu_or_skip("routed_products_are_each_experts_own_product") else {
        return;
    };
    let mut rng = Rng(4242);
    let (count, rows, cols) = (6, 48, 256);
    let n = 5;
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q8_0,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
        GgmlType::MXFP4,
        GgmlType::IQ2_XS,
    ] {
        let routed = Routed::new(ty, (count, rows, cols), n, &mut rng, |_, rng| {
            (rng.next() % count as u64) as usize
        });
        let slots = routed.slots();
        let dev_tensors = routed.upload(&device, &stream);
        let experts = routed.experts(&dev_tensors);
        let x_dev = upload(&device, &stream, &routed.x);
        let mut q8 = device.alloc::<u8>(q8_bytes(n, cols)).expect("q8");
        matvec::quantize_q8(x_dev.view(), n, cols, q8.view_mut(), &stream).expect("quantize");
        // Each slot's expected output: its expert's matrix alone, its token's row.
        let expected = routed.per_slot(|w, xt| {
            gpu_products(
                &device,
                &stream,
                ty,
                &[(w.to_vec(), rows)],
                cols,
                xt,
                1,
                None,
            )
            .remove(0)
        });
        for tile_tokens in [1, WIDE_TILE_TOKENS, MAX_TOKENS] {
            let per_token = SlotInput::Token { per_token: USED };
            let q8_in = RoutedInput::Q8(q8.view());
            let outs = routed.run(&device, &stream, &experts, q8_in, n, per_token, tile_tokens);
            for (m, out) in outs.iter().enumerate() {
                assert_eq!(
                    out, &expected[m],
                    "{ty}: tensor {m}, tiles of {tile_tokens}"
                );
            }
            // Slots reading rows of their own: row s is token s / USED's, so the
            // products are the same.
            let own_dev = upload(&device, &stream, &routed.own_rows());
            let mut own_q8 = device.alloc::<u8>(q8_bytes(slots, cols)).expect("q8");
            matvec::quantize_q8(own_dev.view(), slots, cols, own_q8.view_mut(), &stream)
                .expect("quantize");
            let own_in = RoutedInput::Q8(own_q8.view());
            let own = routed.run(
                &device,
                &stream,
                &experts[..1],
                own_in,
                slots,
                SlotInput::Own,
                tile_tokens,
            );
            assert_eq!(
                own[0], expected[0],
                "{ty}: own rows, tiles of {tile_tokens}"
            );
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
    let n = 200;
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::MXFP4,
        GgmlType::IQ2_XS,
    ] {
        // MXFP4's rows of 25 blocks (425 bytes) start at every offset modulo 16, and end
        // in a part of a chunk of the skinny products.
        let (count, rows) = (5, 200);
        let cols = if ty == GgmlType::MXFP4 { 800 } else { 512 };
        // Two thirds of the tokens choose expert 0 first: it takes more than a tile.
        let routed = Routed::new(ty, (count, rows, cols), n, &mut rng, |t, rng| {
            if t % 3 == 0 {
                (rng.next() % count as u64) as usize
            } else {
                0
            }
        });
        let (ids, slots) = (&routed.ids, routed.slots());
        assert!(ids.iter().filter(|&&e| e == 0).count() > MATMUL_TILE_TOKENS);
        let dev_tensors = routed.upload(&device, &stream);
        let experts = routed.experts(&dev_tensors);
        // Each slot's product with its expert alone, from f16-rounded operands.
        let f16_round = |v: f32| f16::from_f32(v).to_f32();
        let expected =
            routed.per_slot(|w, xt| reference_rounded(ty, w, rows, cols, xt, 1, f16_round));
        let (x16, scales) = f16_input(&device, &stream, &routed.x, n, cols);
        let (own16, own_scales) = f16_input(&device, &stream, &routed.own_rows(), slots, cols);
        for tile_tokens in SKINNY_TILE_TOKENS.into_iter().chain([MATMUL_TILE_TOKENS]) {
            let input = RoutedInput::F16 {
                x16: x16.view(),
                scales: scales.view(),
            };
            let per_token = SlotInput::Token { per_token: USED };
            let outs = routed.run(&device, &stream, &experts, input, n, per_token, tile_tokens);
            for (m, out) in outs.iter().enumerate() {
                let err = relative_error(out, &expected[m]);
                assert!(
                    err <= rounded_bound(ty),
                    "{ty}: tensor {m}, tiles of {tile_tokens}, relative error {err:.2e}"
                );
            }
            // Slots reading rows of their own.
            let own_in = RoutedInput::F16 {
                x16: own16.view(),
                scales: own_scales.view(),
            };
            let own = routed.run(
                &device,
                &stream,
                &experts[..1],
                own_in,
                slots,
                SlotInput::Own,
                tile_tokens,
            );
            let err = relative_error(&own[0], &expected[0]);
            assert!(
                err <= rounded_bound(ty),
                "{ty}: own rows, tiles of {tile_tokens}, relative error {err:.2e}"
            );
        }
        let (tiles, order) = tiles_for(ids, count, MATMUL_TILE_TOKENS);
        let tiles_dev = upload(&device, &stream, &tiles);
        let order_dev = upload(&device, &stream, &order);
        let mut out = upload(&device, &stream, &vec![f32::NAN; slots * rows]);
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

/// MXFP4's routed products on the int8 matrix units (tiles of up to 16, 32 and 64 slots
/// from Q8 input, where the device runs them) against the decode products' tiles of one
/// slot from the same input: the same integer sums of each block, scaled and added in
/// another order, so within a few f32 roundings.
#[test]
fn mxfp4_routed_products_on_the_int8_matrix_units_match_the_decode_products() {
    let Some((device, stream)) =
        gpu_or_skip("mxfp4_routed_products_on_the_int8_matrix_units_match_the_decode_products")
    else {
        return;
    };
    if !super::matmul::skinny_available(&device) {
        eprintln!(
            "SKIPPED mxfp4_routed_products_on_the_int8_matrix_units_match_the_decode_products: \
             the int8 products need an NVIDIA GPU of compute capability 8.0 or later"
        );
        return;
    }
    let mut rng = Rng(4711);
    let ty = GgmlType::MXFP4;
    // 34 blocks a row (578 bytes: rows start at every even offset modulo 16), a last
    // chunk of two blocks, and two row tiles of 128, the second part-filled.
    let (count, rows, cols) = (5, 200, 1088);
    let n = 200;
    let routed = Routed::new(ty, (count, rows, cols), n, &mut rng, |t, rng| {
        if t % 3 == 0 {
            (rng.next() % count as u64) as usize
        } else {
            0
        }
    });
    let slots = routed.slots();
    let dev_tensors = routed.upload(&device, &stream);
    let experts = routed.experts(&dev_tensors);
    let run = |x: &DeviceBuffer<u8>, n_x, input, tile_tokens, n_mats: usize| {
        let q8_in = RoutedInput::Q8(x.view());
        routed.run(
            &device,
            &stream,
            &experts[..n_mats],
            q8_in,
            n_x,
            input,
            tile_tokens,
        )
    };
    let x_dev = upload(&device, &stream, &routed.x);
    let mut q8 = device.alloc::<u8>(q8_bytes(n, cols)).expect("q8");
    matvec::quantize_q8(x_dev.view(), n, cols, q8.view_mut(), &stream).expect("quantize");
    let own_dev = upload(&device, &stream, &routed.own_rows());
    let mut own_q8 = device.alloc::<u8>(q8_bytes(slots, cols)).expect("q8");
    matvec::quantize_q8(own_dev.view(), slots, cols, own_q8.view_mut(), &stream).expect("quantize");
    let per_token = SlotInput::Token { per_token: USED };
    let expected = run(&q8, n, per_token, 1, 2);
    let as_f64 = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    for tile_tokens in SKINNY_TILE_TOKENS {
        for (m, got) in run(&q8, n, per_token, tile_tokens, 2).iter().enumerate() {
            let err = relative_error(got, &as_f64(&expected[m]));
            assert!(
                err <= 1e-5,
                "tensor {m}, tiles of {tile_tokens}: relative error {err:.2e}"
            );
        }
        let own = run(&own_q8, slots, SlotInput::Own, tile_tokens, 1);
        let err = relative_error(&own[0], &as_f64(&expected[0]));
        assert!(
            err <= 1e-5,
            "own rows, tiles of {tile_tokens}: relative error {err:.2e}"
        );
    }
}
