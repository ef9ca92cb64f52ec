//! The reference quantizers of the grid formats (`IQ3_S`, `IQ3_XXS`, `IQ2_XXS`, `IQ2_XS`,
//! `IQ2_S`, `IQ1_S`, `IQ1_M`): per run of values the nearest grid entry, found by trying
//! every entry, with its signs and the group's scale.

use super::*;

/// The index of the entry of `grid` (entries of `run.len()` magnitudes, byte `j` of an
/// entry the magnitude of value `j`) nearest to `|run| / scale` (the lower index on a
/// tie).
fn nearest_entry(run: &[f32], scale: f32, grid: impl Iterator<Item = u64>) -> usize {
    let inv = inverse(scale);
    let mut best = (f32::MAX, 0);
    for (index, entry) in grid.enumerate() {
        let err: f32 = run
            .iter()
            .enumerate()
            .map(|(j, &v)| {
                let e = v.abs() * inv - ((entry >> (8 * j)) & 0xFF) as f32;
                e * e
            })
            .sum();
        if err < best.0 {
            best = (err, index);
        }
    }
    best.1
}

/// The sign bits of `run`: bit `j` set where value `j` is negative.
fn sign_bits(run: &[f32]) -> u8 {
    run.iter()
        .enumerate()
        .fold(0, |bits, (j, &v)| bits | (u8::from(v < 0.0) << j))
}

/// Odd 4-bit scales `2 ls + 1` for groups whose largest magnitudes are `groups`: writes
/// and returns the f16 `d`, and the `ls`, such that `d (2 ls + 1) max_grid` is about each
/// group's largest magnitude (`max_grid`: the grid's largest value times any constant
/// factor of the format).
fn odd_scales(groups: &[f32], max_grid: f32, out: &mut Vec<u8>) -> (f32, Vec<u8>) {
    let wanted: Vec<f32> = groups.iter().map(|&m| m / max_grid).collect();
    let d = push_f16(out, wanted.iter().fold(0f32, |m, &v| m.max(v)) / 31.0);
    let inv_d = inverse(d);
    let ls = wanted
        .iter()
        .map(|&w| ((w * inv_d - 1.0) / 2.0).round().clamp(0.0, 15.0) as u8)
        .collect();
    (d, ls)
}

/// `IQ3_S`: per 32 values a scale `d (2 ls + 1)`, each 4 values the `IQ3S_GRID` entry
/// nearest to their magnitudes (9-bit indices), one sign bit per value.
pub(super) fn iq3_s(block: &[f32], out: &mut Vec<u8>) {
    use dequant::grids::IQ3S_GRID;
    let amax: Vec<f32> = block
        .chunks_exact(32)
        .map(|g| g.iter().fold(0f32, |m, v| m.max(v.abs())))
        .collect();
    let mut header = Vec::new();
    let (d, ls) = odd_scales(&amax, 15.0, &mut header);
    let mut indices = [0usize; 64];
    for (i, run) in block.chunks_exact(4).enumerate() {
        let scale = d * f32::from(2 * ls[i / 8] + 1);
        indices[i] = nearest_entry(run, scale, IQ3S_GRID.iter().map(|&e| u64::from(e)));
    }
    out.extend_from_slice(&header);
    out.extend(indices.iter().map(|&i| i as u8));
    out.extend(
        (0..8).map(|k| (0..8).fold(0u8, |h, j| h | (((indices[8 * k + j] >> 8) as u8) << j))),
    );
    out.extend(block.chunks_exact(8).map(sign_bits));
    out.extend((0..4).map(|k| ls[2 * k] | (ls[2 * k + 1] << 4)));
}

/// The sign bits of a run of 8 with an even number of them set, as `KSIGNS_IQ2XS` can
/// hold them (seven stored, the eighth their parity): with an odd count, the value of
/// smallest magnitude takes the other sign. Returns the 7-bit index.
fn even_signs(run: &[f32]) -> u32 {
    let mut bits = sign_bits(run);
    if bits.count_ones() % 2 == 1 {
        let smallest = (0..8)
            .min_by(|&a, &b| run[a].abs().total_cmp(&run[b].abs()))
            .unwrap_or(0);
        bits ^= 1 << smallest;
    }
    u32::from(bits & 0x7F)
}

/// Each sub-block's largest magnitude.
fn group_amax(block: &[f32], group: usize) -> Vec<f32> {
    block
        .chunks_exact(group)
        .map(|g| g.iter().fold(0f32, |m, v| m.max(v.abs())))
        .collect()
}

/// `IQ3_XXS`: per 32 values a scale `d (2 ls + 1) / 4`, each 4 values the `IQ3XXS_GRID`
/// entry nearest to their magnitudes, signs with even parity per 8 values.
pub(super) fn iq3_xxs(block: &[f32], out: &mut Vec<u8>) {
    use dequant::grids::IQ3XXS_GRID;
    let mut header = Vec::new();
    let (d, ls) = odd_scales(&group_amax(block, 32), 62.0 * 0.25, &mut header);
    out.extend_from_slice(&header);
    let mut signed = block.to_vec();
    let mut aux = [0u32; 8];
    for (r, run) in block.chunks_exact(8).enumerate() {
        let signs = even_signs(run);
        aux[r / 4] |= signs << (7 * (r % 4));
        // The sign a value gets, for its magnitude's sake: flipped ones count as 0.
        for j in 0..8 {
            let negative = (u32::from(dequant::grids::KSIGNS_IQ2XS[signs as usize]) >> j) & 1 == 1;
            if negative != (run[j] < 0.0) {
                signed[8 * r + j] = 0.0;
            }
        }
    }
    for (i, run) in signed.chunks_exact(4).enumerate() {
        let scale = d * f32::from(2 * ls[i / 8] + 1) * 0.25;
        out.push(nearest_entry(run, scale, IQ3XXS_GRID.iter().map(|&e| u64::from(e))) as u8);
    }
    for (s, &a) in aux.iter().enumerate() {
        out.extend_from_slice(&(a | (u32::from(ls[s]) << 28)).to_le_bytes());
    }
}

/// `run` with the values whose sign `signs` (a 7-bit `KSIGNS_IQ2XS` index) does not
/// give them set to 0: the magnitude that serves them best.
fn with_signs(run: &[f32], signs: u32) -> Vec<f32> {
    let bits = u32::from(dequant::grids::KSIGNS_IQ2XS[signs as usize]);
    run.iter()
        .enumerate()
        .map(|(j, &v)| {
            if ((bits >> j) & 1 == 1) == (v < 0.0) {
                v
            } else {
                0.0
            }
        })
        .collect()
}

/// `IQ2_XXS`: per 32 values a scale `d (2 ls + 1) / 8`, each 8 values the
/// `IQ2XXS_GRID` entry nearest to their magnitudes, signs with even parity.
pub(super) fn iq2_xxs(block: &[f32], out: &mut Vec<u8>) {
    use dequant::grids::IQ2XXS_GRID;
    let (d, ls) = odd_scales(&group_amax(block, 32), 43.0 * 0.125, out);
    for (s, sub) in block.chunks_exact(32).enumerate() {
        let scale = d * f32::from(2 * ls[s] + 1) * 0.125;
        let mut aux = u32::from(ls[s]) << 28;
        let mut indices = [0u8; 4];
        for (k, run) in sub.chunks_exact(8).enumerate() {
            let signs = even_signs(run);
            aux |= signs << (7 * k);
            indices[k] =
                nearest_entry(&with_signs(run, signs), scale, IQ2XXS_GRID.iter().copied()) as u8;
        }
        out.extend_from_slice(&indices);
        out.extend_from_slice(&aux.to_le_bytes());
    }
}

/// `IQ2_XS`: per 16 values a scale `d (2 ls + 1) / 8`, each 8 values a u16 of the
/// nearest `IQ2XS_GRID` entry (9 bits) and a 7-bit sign index (even parity).
pub(super) fn iq2_xs(block: &[f32], out: &mut Vec<u8>) {
    use dequant::grids::IQ2XS_GRID;
    let (d, ls) = odd_scales(&group_amax(block, 16), 43.0 * 0.125, out);
    for (r, run) in block.chunks_exact(8).enumerate() {
        let scale = d * f32::from(2 * ls[r / 2] + 1) * 0.125;
        let signs = even_signs(run);
        let index = nearest_entry(&with_signs(run, signs), scale, IQ2XS_GRID.iter().copied());
        out.extend_from_slice(&(index as u16 | ((signs as u16) << 9)).to_le_bytes());
    }
    out.extend((0..8).map(|s| ls[2 * s] | (ls[2 * s + 1] << 4)));
}

/// `IQ2_S`: per 16 values a scale `d (2 ls + 1) / 8`, each 8 values the nearest of the
/// 1024 `IQ2S_GRID` entries (10-bit indices), one sign bit per value.
pub(super) fn iq2_s(block: &[f32], out: &mut Vec<u8>) {
    use dequant::grids::IQ2S_GRID;
    let (d, ls) = odd_scales(&group_amax(block, 16), 43.0 * 0.125, out);
    let indices: Vec<usize> = block
        .chunks_exact(8)
        .enumerate()
        .map(|(r, run)| {
            let scale = d * f32::from(2 * ls[r / 2] + 1) * 0.125;
            nearest_entry(run, scale, IQ2S_GRID.iter().copied())
        })
        .collect();
    out.extend(indices.iter().map(|&i| i as u8));
    out.extend(block.chunks_exact(8).map(sign_bits));
    out.extend((0..8).map(|s| {
        (0..4).fold(0u8, |h, k| {
            h | (((indices[4 * s + k] >> 8) as u8) << (2 * k))
        })
    }));
    out.extend((0..8).map(|s| ls[2 * s] | (ls[2 * s + 1] << 4)));
}

/// The shift of an IQ1 group: the sign of its mean, as -1/8 or +1/8 of a unit.
fn iq1_shift(group: &[f32]) -> f32 {
    if group.iter().sum::<f32>() < 0.0 {
        -1.0
    } else {
        1.0
    }
}

/// The index of the `IQ1S_GRID` entry (values -1, 0, 1) nearest to `run / unit − δ/8`.
fn nearest_iq1(run: &[f32], unit: f32, delta: f32) -> usize {
    let inv = inverse(unit);
    let mut best = (f32::MAX, 0);
    for (index, &entry) in dequant::grids::IQ1S_GRID.iter().enumerate() {
        let err: f32 = run
            .iter()
            .enumerate()
            .map(|(j, &v)| {
                let g = ((entry >> (8 * j)) & 0xFF) as u8 as i8;
                let e = v * inv - delta * 0.125 - f32::from(g);
                e * e
            })
            .sum();
        if err < best.0 {
            best = (err, index);
        }
    }
    best.1
}

/// The unit an IQ1 group's ternary values scale: 1.3 times its mean magnitude (the
/// largest values would leave most of a normal group at 0).
fn iq1_units(block: &[f32], group: usize) -> Vec<f32> {
    block
        .chunks_exact(group)
        .map(|g| 1.3 * g.iter().map(|v| v.abs()).sum::<f32>() / group as f32)
        .collect()
}

/// 3-bit odd scales `2 ls + 1` against `d` for groups of units `units`.
fn iq1_scales(units: &[f32], d: f32) -> Vec<u16> {
    let inv_d = inverse(d);
    units
        .iter()
        .map(|&u| ((u * inv_d - 1.0) / 2.0).round().clamp(0.0, 7.0) as u16)
        .collect()
}

/// `IQ1_S`: per 32 values a unit `d (2 ls + 1)` and a shift `δ = ±1/8` of it, each 8
/// values the nearest entry of the 2048 ternary `IQ1S_GRID` entries (11-bit indices).
pub(super) fn iq1_s(block: &[f32], out: &mut Vec<u8>) {
    let units = iq1_units(block, 32);
    let d = push_f16(out, units.iter().fold(0f32, |m, &v| m.max(v)) / 15.0);
    let ls = iq1_scales(&units, d);
    let mut qh = [0u16; 8];
    for (s, sub) in block.chunks_exact(32).enumerate() {
        let unit = d * f32::from(2 * ls[s] + 1);
        let delta = iq1_shift(sub);
        qh[s] = (ls[s] << 12) | if delta < 0.0 { 0x8000 } else { 0 };
        for (k, run) in sub.chunks_exact(8).enumerate() {
            let index = nearest_iq1(run, unit, delta);
            out.push(index as u8);
            qh[s] |= ((index >> 8) as u16) << (3 * k);
        }
    }
    qh.iter()
        .for_each(|h| out.extend_from_slice(&h.to_le_bytes()));
}

/// `IQ1_M`: per 16 values a unit `d (2 ls + 1)`, per 8 values a shift `δ = ±1/8` and the
/// nearest ternary grid entry; the f16 `d` spread over the top nibbles of the scales.
pub(super) fn iq1_m(block: &[f32], out: &mut Vec<u8>) {
    let units = iq1_units(block, 16);
    let d = f16::from_f32(units.iter().fold(0f32, |m, &v| m.max(v)) / 15.0);
    let ls = iq1_scales(&units, d.to_f32());
    let mut qh = [0u8; 16];
    let mut qs = [0u8; 32];
    for (r, run) in block.chunks_exact(8).enumerate() {
        let unit = d.to_f32() * f32::from(2 * ls[r / 2] + 1);
        let delta = iq1_shift(run);
        let index = nearest_iq1(run, unit, delta);
        qs[r] = index as u8;
        let nibble = ((index >> 8) as u8) | if delta < 0.0 { 0x08 } else { 0 };
        qh[r / 2] |= nibble << (4 * (r % 2));
    }
    out.extend_from_slice(&qs);
    out.extend_from_slice(&qh);
    let bits = d.to_bits();
    for w in 0..4 {
        let scales = (0..4).fold(0u16, |acc, k| acc | (ls[4 * w + k] << (3 * k)));
        let word = scales | (((bits >> (4 * w)) & 0xF) << 12);
        out.extend_from_slice(&word.to_le_bytes());
    }
}
