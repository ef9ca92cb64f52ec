//! Experts placed by a table of addresses (`GpuExperts::from_table`) against the same
//! experts packed in one tensor: the decode products and the fused weighted sum give the
//! same bits wherever the matrices lie, in device memory in another order or in host
//! memory mapped for the device; the products that read experts packed refuse a table.

use gguf_format::GgmlType;
use half::f16;
use hip_backend::{DeviceBuffer, DeviceView};

use super::experts::{
    routed_products, routed_sum, GpuExperts, RoutedInput, SlotInput, MATMUL_TILE_TOKENS,
    WIDE_TILE_TOKENS,
};
use super::matvec::{self, q8_bytes, MAX_TOKENS};
use super::tests::gpu_or_skip;
use super::tests_experts::{tiles_for, Routed, USED};
use super::tests_matvec::{download, upload, Rng};
use crate::DequantError;

const PAGE: usize = 4096;

/// Whole pages of host memory holding `bytes` from their first byte on.
struct HostPages {
    memory: Vec<u8>,
    at: usize,
    len: usize,
}

impl HostPages {
    fn new(bytes: &[u8]) -> HostPages {
        let len = bytes.len().next_multiple_of(PAGE);
        let mut memory = vec![0u8; len + PAGE];
        let at = memory.as_ptr().align_offset(PAGE);
        memory[at..at + bytes.len()].copy_from_slice(bytes);
        HostPages { memory, at, len }
    }

    fn pages(&self) -> &[u8] {
        &self.memory[self.at..self.at + self.len]
    }
}

/// A table placing each of `count` experts of `expert_bytes`: the even ones in `moved`
/// (a device copy of the tensor with its experts in reverse order), the odd ones at
/// `host` (the device's address of a host copy of the tensor in its own order).
fn table(count: usize, expert_bytes: usize, moved: DeviceView<'_, u8>, host: u64) -> Vec<u64> {
    let moved = moved.as_ptr() as u64;
    (0..count)
        .map(|e| match e % 2 {
            0 => moved + ((count - 1 - e) * expert_bytes) as u64,
            _ => host + (e * expert_bytes) as u64,
        })
        .collect()
}

/// `tensor`'s experts in reverse order.
fn reversed(tensor: &[u8], count: usize) -> Vec<u8> {
    let expert_bytes = tensor.len() / count;
    tensor
        .chunks(expert_bytes)
        .rev()
        .flatten()
        .copied()
        .collect()
}

#[test]
fn experts_placed_by_a_table_give_the_packed_products() {
    let Some((device, stream)) = gpu_or_skip("experts_placed_by_a_table_give_the_packed_products")
    else {
        return;
    };
    let mut rng = Rng(5150);
    let (count, rows, cols) = (6, 48, 512);
    let n = 5;
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::MXFP4,
    ] {
        let routed = Routed::new(ty, (count, rows, cols), n, &mut rng, |_, rng| {
            (rng.next() % count as u64) as usize
        });
        let packed_dev = routed.upload(&device, &stream);
        let packed = routed.experts(&packed_dev);
        let expert_bytes = packed[0].expert_bytes();
        let moved: Vec<DeviceBuffer<u8>> = routed
            .tensors
            .iter()
            .map(|t| upload(&device, &stream, &reversed(t, count)))
            .collect();
        let host: Vec<HostPages> = routed.tensors.iter().map(|t| HostPages::new(t)).collect();
        let registered: Vec<_> = host
            .iter()
            .map(|h| {
                device
                    .register_host_read_only(h.pages())
                    .expect("registering host memory")
            })
            .collect();
        let tables: Vec<DeviceBuffer<u64>> = moved
            .iter()
            .zip(&registered)
            .map(|(m, r)| {
                let host = r.device_ptr().expect("the host memory's device address");
                upload(
                    &device,
                    &stream,
                    &table(count, expert_bytes, m.view(), host),
                )
            })
            .collect();
        // SAFETY: every entry is the address of a whole expert matrix, in device memory
        // or in registered host memory, both alive and unchanged until the end of the
        // test, whose reads back wait for the launches.
        let placed: Vec<GpuExperts<'_>> = tables
            .iter()
            .map(|t| unsafe { GpuExperts::from_table(ty, rows, cols, t.view()) }.expect("table"))
            .collect();
        assert!(placed[0].is_table() && !packed[0].is_table());
        assert_eq!(placed[0].expert_bytes(), expert_bytes);

        let x_dev = upload(&device, &stream, &routed.x);
        let mut q8 = device.alloc::<u8>(q8_bytes(n, cols)).expect("q8");
        matvec::quantize_q8(x_dev.view(), n, cols, q8.view_mut(), &stream).expect("quantize");
        let per_token = SlotInput::Token { per_token: USED };
        let q8_in = RoutedInput::Q8(q8.view());
        let run = |experts: &[GpuExperts<'_>]| {
            routed.run(&device, &stream, experts, q8_in, n, per_token, 1)
        };
        assert_eq!(run(&placed), run(&packed), "{ty}: tiles of one slot");

        // The fused weighted sum, each slot reading a row of its own.
        let slots = routed.slots();
        let own_dev = upload(&device, &stream, &routed.own_rows());
        let mut own_q8 = device.alloc::<u8>(q8_bytes(slots, cols)).expect("q8");
        matvec::quantize_q8(own_dev.view(), slots, cols, own_q8.view_mut(), &stream)
            .expect("quantize");
        let ids: Vec<i32> = routed.ids.iter().map(|&e| e as i32).collect();
        let ids_dev = upload(&device, &stream, &ids);
        let weights: Vec<f32> = (0..slots).map(|_| rng.unit()).collect();
        let weights_dev = upload(&device, &stream, &weights);
        let initial: Vec<f32> = (0..n * rows).map(|_| rng.unit()).collect();
        let sum = |experts: &GpuExperts<'_>| {
            let mut out = upload(&device, &stream, &initial);
            routed_sum(
                experts,
                own_q8.view(),
                ids_dev.view(),
                weights_dev.view(),
                n,
                USED,
                &mut out.view_mut(),
                &stream,
            )
            .expect("fused sum");
            download(&stream, &out)
        };
        assert_eq!(sum(&placed[0]), sum(&packed[0]), "{ty}: the fused sum");

        // The products that read experts packed refuse a table, as does a launch of
        // experts placed both ways.
        let x16 = upload(&device, &stream, &vec![f16::ZERO; n * cols]);
        let scales = upload(&device, &stream, &vec![1f32; n]);
        let f16_in = RoutedInput::F16 {
            x16: x16.view(),
            scales: scales.view(),
        };
        for (input, tile_tokens) in [
            (RoutedInput::Q8(q8.view()), WIDE_TILE_TOKENS),
            (RoutedInput::Q8(q8.view()), MAX_TOKENS),
            (f16_in, MATMUL_TILE_TOKENS),
        ] {
            let (tiles, order) = tiles_for(&routed.ids, count, tile_tokens);
            let tiles_dev = upload(&device, &stream, &tiles);
            let order_dev = upload(&device, &stream, &order);
            let mut out = device.alloc::<f32>(slots * rows).expect("output");
            let refused = routed_products(
                &placed[..1],
                input,
                n,
                per_token,
                tiles_dev.view(),
                order_dev.view(),
                tile_tokens,
                &mut [out.view_mut()],
                &stream,
            );
            assert!(
                matches!(
                    refused,
                    Err(super::GpuDequantError::Layout(
                        DequantError::TableExperts { .. }
                    ))
                ),
                "{ty}: tiles of {tile_tokens} took a table: {refused:?}"
            );
        }
        let (tiles, order) = tiles_for(&routed.ids, count, 1);
        let tiles_dev = upload(&device, &stream, &tiles);
        let order_dev = upload(&device, &stream, &order);
        let mut outs = [
            device.alloc::<f32>(slots * rows).expect("output"),
            device.alloc::<f32>(slots * rows).expect("output"),
        ];
        let [a, b] = &mut outs;
        let mixed = routed_products(
            &[placed[0], packed[1]],
            RoutedInput::Q8(q8.view()),
            n,
            per_token,
            tiles_dev.view(),
            order_dev.view(),
            1,
            &mut [a.view_mut(), b.view_mut()],
            &stream,
        );
        assert!(
            mixed.is_err(),
            "{ty}: experts placed both ways in one launch"
        );
        stream.synchronize().expect("the launches");
    }
}
