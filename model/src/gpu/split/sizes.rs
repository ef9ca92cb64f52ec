//! The sizes a layer split is made of: which layers each device holds (by their bytes
//! and the shares asked for), and how long a prompt's chunks are as they flow through
//! the devices.

use std::ops::Range;

use super::PIPELINE_CHUNK;
use crate::{Model, ModelError};

/// `of` summed over each layer's tensors.
pub(super) fn per_layer(
    model: &Model,
    of: impl Fn(&tensor_store::TensorHandle) -> f64,
) -> Vec<f64> {
    let order = tensor_store::device::UploadOrder::by_layer(model.plan().handles());
    (0..model.plan().layers.len())
        .map(|layer| {
            order
                .layer_group(layer)
                .map_or(0.0, |g| order.group_tensors(g).iter().map(&of).sum())
        })
        .collect()
}

/// The arithmetic a prompt's chunk gives each device at the least, in operations, where
/// [`SplitOptions::chunk`](super::SplitOptions::chunk)'s default cuts a prompt: about 20 ms of an H100's or H200's
/// products, so that a chunk's fixed costs (its launches, the copy between devices)
/// stay small beside it. Measured on two H200: a 70B's 512-token prompt in four chunks
/// of 128 ran 1.27x as fast as in one, a 7B's (a fifth of this work a chunk) 0.86x.
const PIPELINE_WORK: f64 = 3.2e12;

/// The fewest tokens of a chunk that gives the device with the most products `PIPELINE_WORK`
/// (two operations a weight and token; a mixture's experts their routed share).
pub(super) fn pipeline_chunk(model: &Model, ranges: &[Range<usize>]) -> usize {
    let routed = model
        .config()
        .experts
        .map_or(1.0, |e| e.used as f64 / e.count as f64);
    let values = per_layer(model, |h| {
        let matrix = h.shape().len() >= 2 && !h.name().contains("norm");
        let share = if h.name().contains("_exps.") {
            routed
        } else {
            1.0
        };
        if matrix {
            h.shape().iter().product::<u64>() as f64 * share
        } else {
            0.0
        }
    });
    let most = ranges
        .iter()
        .map(|r| values[r.clone()].iter().sum::<f64>())
        .fold(0.0, f64::max);
    ((PIPELINE_WORK / (2.0 * most.max(1.0))).ceil() as usize).max(PIPELINE_CHUNK)
}

pub(super) fn split_by_bytes(
    layer_bytes: &[u64],
    head_bytes: u64,
    n_parts: usize,
    ratios: Option<&[f64]>,
) -> Result<Vec<Range<usize>>, ModelError> {
    let bad = |ratios: &[f64], reason| ModelError::InvalidGpuOption {
        name: "tensor_split",
        value: format!("{ratios:?} for {n_parts} devices"),
        reason,
    };
    let n_layers = layer_bytes.len();
    if n_parts == 0 || n_parts > n_layers {
        return Err(ModelError::InvalidGpuOption {
            name: "devices",
            value: n_parts.to_string(),
            reason: "a layer split needs between one device and one device a layer",
        });
    }
    let equal = vec![1.0; n_parts];
    let ratios = ratios.unwrap_or(&equal);
    if ratios.len() != n_parts {
        return Err(bad(ratios, "one ratio a device"));
    }
    if ratios.iter().any(|r| !r.is_finite() || *r <= 0.0) {
        return Err(bad(ratios, "every ratio must be a positive number"));
    }
    let total_ratio: f64 = ratios.iter().sum();
    let total = (layer_bytes.iter().sum::<u64>() + head_bytes) as f64;
    // Part k ends at the layer boundary nearest to where its share of the bytes ends,
    // leaving at least one layer to it and to each part after it.
    let mut ends = Vec::with_capacity(n_parts);
    let mut start = 0;
    let mut share = 0.0;
    for (k, ratio) in ratios.iter().enumerate() {
        let parts_after = n_parts - 1 - k;
        if parts_after == 0 {
            ends.push(n_layers);
            break;
        }
        share += ratio / total_ratio;
        let target = share * total;
        let mut end = start + 1;
        let mut bytes: f64 = layer_bytes[..end].iter().sum::<u64>() as f64;
        while end < n_layers - parts_after {
            let next = bytes + layer_bytes[end] as f64;
            if (next - target).abs() > (bytes - target).abs() {
                break;
            }
            bytes = next;
            end += 1;
        }
        ends.push(end);
        start = end;
    }
    let mut start = 0;
    Ok(ends
        .into_iter()
        .map(|end| {
            let range = start..end;
            start = end;
            range
        })
        .collect())
}

/// The tokens of each chunk of a prompt of `n` over `stages` devices: `asked`, or up to
/// twice as many chunks as devices, as many as hold `min_chunk` tokens; at most `batch`.
pub(super) fn chunk_len(
    n: usize,
    batch: usize,
    stages: usize,
    asked: Option<usize>,
    min_chunk: usize,
) -> usize {
    let len = match asked {
        Some(chunk) => chunk,
        None if stages == 1 => batch,
        None => n.div_ceil((n / min_chunk.max(1)).clamp(1, 2 * stages)),
    };
    len.clamp(1, batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_split_by_their_bytes_and_the_ratios() {
        let even = [10u64; 8];
        let split = |bytes: &[u64], head, n, ratios: Option<&[f64]>| {
            split_by_bytes(bytes, head, n, ratios).unwrap()
        };
        assert_eq!(split(&even, 0, 1, None), vec![0..8]);
        assert_eq!(split(&even, 0, 2, None), vec![0..4, 4..8]);
        assert_eq!(split(&even, 0, 4, None), vec![0..2, 2..4, 4..6, 6..8]);
        // The output matrix counts on the last device: it takes fewer layers.
        assert_eq!(split(&even, 20, 2, None), vec![0..5, 5..8]);
        assert_eq!(split(&even, 0, 2, Some(&[3.0, 1.0])), vec![0..6, 6..8]);
        // Every device keeps a layer, however small its share.
        assert_eq!(
            split(&even, 0, 3, Some(&[100.0, 1.0, 1.0])),
            vec![0..6, 6..7, 7..8]
        );
        assert_eq!(
            split(&even, 0, 3, Some(&[1.0, 1.0, 100.0])),
            vec![0..1, 1..2, 2..8]
        );
        assert_eq!(split(&even, 0, 8, None).len(), 8);
        // Uneven layers: the boundary nearest the share.
        assert_eq!(split(&[1, 1, 1, 9], 0, 2, None), vec![0..3, 3..4]);
    }

    #[test]
    fn prompts_are_cut_into_chunks_long_enough_for_the_pipeline() {
        // A 70B over two devices: four chunks of 128; a 7B (464 at the least): whole.
        assert_eq!(chunk_len(512, 512, 2, None, 128), 128);
        assert_eq!(chunk_len(512, 512, 2, None, 464), 512);
        assert_eq!(chunk_len(2048, 512, 2, None, 464), 512);
        assert_eq!(chunk_len(1000, 512, 2, None, 464), 500);
        assert_eq!(chunk_len(100, 512, 2, None, 128), 100);
        assert_eq!(chunk_len(4096, 512, 3, None, 128), 512);
        // One device, or a size asked for: the prompt batch bounds it.
        assert_eq!(chunk_len(512, 256, 1, None, 128), 256);
        assert_eq!(chunk_len(512, 256, 2, Some(64), 128), 64);
        assert_eq!(chunk_len(512, 256, 2, Some(1000), 128), 256);
        assert_eq!(chunk_len(512, 256, 2, Some(0), 128), 1);
    }

    #[test]
    fn a_split_it_cannot_make_is_refused() {
        let even = [10u64; 4];
        for (n, ratios) in [
            (0, None),
            (5, None),
            (2, Some(&[1.0][..])),
            (2, Some(&[1.0, 0.0][..])),
            (2, Some(&[1.0, f64::NAN][..])),
            (2, Some(&[-1.0, 2.0][..])),
        ] {
            assert!(
                matches!(
                    split_by_bytes(&even, 0, n, ratios),
                    Err(ModelError::InvalidGpuOption { .. })
                ),
                "{n} {ratios:?}"
            );
        }
    }
}
