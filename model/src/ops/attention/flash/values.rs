//! The values' half of a tile of the tiled kernel ([`super::tiled`] and its blocks):
//! each visible position's value row, weighted, added to the accumulators of one query
//! or of a group of queries that share the key head.

use super::{Rows, KV_TILE};

/// The value rows of the `visible` positions of the tile at `tile`, weighted, added to
/// each query's accumulator: `probs` holds `accs.len() / hdv` queries' weights
/// ([`KV_TILE`] apiece, [`tile_softmax`](super::tile_softmax)'s), `accs` their accumulators side by side. Each
/// value is one chain of fused multiply-adds over the positions in order. The queries
/// of a group ([`tile_values_grouped`]) share each value row's loads, their
/// accumulators held in registers a few dimensions at a time.
#[inline(always)]
pub(super) fn tile_values(
    rows: Rows<'_>,
    hdv: usize,
    tile: usize,
    visible: std::ops::Range<usize>,
    probs: &[f32],
    accs: &mut [f32],
) {
    let done = match accs.len() / hdv {
        1 => tile_values_grouped::<1>(rows, hdv, tile, visible.clone(), probs, accs),
        2 => tile_values_grouped::<2>(rows, hdv, tile, visible.clone(), probs, accs),
        4 => tile_values_grouped::<4>(rows, hdv, tile, visible.clone(), probs, accs),
        8 => tile_values_grouped::<8>(rows, hdv, tile, visible.clone(), probs, accs),
        _ => 0,
    };
    // The dimensions past the groups' (all of them for other group sizes), query by query.
    for (p, acc) in probs.chunks_exact(KV_TILE).zip(accs.chunks_exact_mut(hdv)) {
        for j in visible.clone() {
            let p = p[j - tile];
            let v = &rows.value(j, hdv)[done..];
            for (a, &vv) in acc[done..].iter_mut().zip(v) {
                *a = vv.mul_add(p, *a);
            }
        }
    }
}

/// Dimensions [`tile_values_grouped`] takes at once.
const VALUE_CHUNK: usize = 16;

/// [`tile_values`] for `G` queries, [`VALUE_CHUNK`] dimensions at a time: returns the
/// dimensions done (the whole chunks).
#[inline(always)]
fn tile_values_grouped<const G: usize>(
    rows: Rows<'_>,
    hdv: usize,
    tile: usize,
    visible: std::ops::Range<usize>,
    probs: &[f32],
    accs: &mut [f32],
) -> usize {
    let chunks = hdv / VALUE_CHUNK;
    for c in 0..chunks {
        let dims = c * VALUE_CHUNK..(c + 1) * VALUE_CHUNK;
        let mut a = [[0.0f32; VALUE_CHUNK]; G];
        for (g, a) in a.iter_mut().enumerate() {
            a.copy_from_slice(&accs[g * hdv..][dims.clone()]);
        }
        for j in visible.clone() {
            let v: &[f32; VALUE_CHUNK] = rows.value(j, hdv)[dims.clone()]
                .try_into()
                .expect("a chunk of dimensions");
            for (g, a) in a.iter_mut().enumerate() {
                let p = probs[g * KV_TILE + j - tile];
                for (a, &vv) in a.iter_mut().zip(v) {
                    *a = vv.mul_add(p, *a);
                }
            }
        }
        for (g, a) in a.iter().enumerate() {
            accs[g * hdv..][dims.clone()].copy_from_slice(a);
        }
    }
    chunks * VALUE_CHUNK
}
