//! Reference decoders of the 256-value super-block formats with linear quants: the
//! k-quants (`Q2_K` … `Q8_K`), `IQ4_XS`, `TQ1_0` and `TQ2_0`.
//!
//! As in `legacy.rs`, every value uses gguf-py's f32 operations in gguf-py's order: a
//! group's scale is `d * sc` (and its offset `dmin * m`) rounded to f32 first, then
//! `scale * q` (minus the offset) per value.

use crate::blocks::{
    BlockIQ4_XS, BlockQ2_K, BlockQ3_K, BlockQ4_K, BlockQ5_K, BlockQ6_K, BlockQ8_K, BlockTQ1_0,
    BlockTQ2_0, QK_K,
};
use crate::decode::grids::KVALUES_IQ4NL;

/// The two-bit field `s` (0..4) of byte `l` of a 32-byte chunk `c`: value
/// `128 c + 32 s + l` in `Q2_K`, `Q3_K` and `TQ2_0`.
#[inline(always)]
fn crumb(qs: &[u8], c: usize, s: usize, l: usize) -> u8 {
    (qs[32 * c + l] >> (2 * s)) & 3
}

pub(crate) fn q2_k(b: &BlockQ2_K, y: &mut [f32; QK_K]) {
    let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
    for c in 0..2 {
        for s in 0..4 {
            for half in 0..2 {
                let i = 128 * c + 32 * s + 16 * half;
                let sc = b.scales[i / 16];
                let dl = d * (sc & 0x0F) as f32;
                let ml = dmin * (sc >> 4) as f32;
                for l in 16 * half..16 * half + 16 {
                    let q = crumb(&b.qs, c, s, l) as f32;
                    y[128 * c + 32 * s + l] = dl * q - ml;
                }
            }
        }
    }
}

/// The sixteen 6-bit scales of a `Q3_K` block, already offset by -32.
pub(crate) fn q3_k_scales(packed: &[u8; 12]) -> [i8; 16] {
    let mut scales = [0i8; 16];
    for (k, scale) in scales.iter_mut().enumerate() {
        let low = (packed[k % 8] >> (4 * (k / 8))) & 0x0F;
        let high = (packed[8 + k % 4] >> (2 * (k / 4))) & 0x03;
        *scale = (low | (high << 4)) as i8 - 32;
    }
    scales
}

pub(crate) fn q3_k(b: &BlockQ3_K, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    let scales = q3_k_scales(&b.scales);
    for c in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                let i = 128 * c + 32 * s + l;
                let dl = d * scales[i / 16] as f32;
                let low = crumb(&b.qs, c, s, l) as i8;
                // The high bit is stored inverted: a clear bit subtracts 4.
                let high = ((b.hmask[l] >> (i / 32)) & 1) ^ 1;
                let q = low - ((high << 2) as i8);
                y[i] = dl * q as f32;
            }
        }
    }
}

/// The eight 6-bit scales and eight 6-bit mins of `Q4_K` and `Q5_K`.
pub(crate) fn k_scales_mins(packed: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for k in 0..4 {
        sc[k] = packed[k] & 0x3F;
        m[k] = packed[k + 4] & 0x3F;
        sc[k + 4] = (packed[k + 8] & 0x0F) | ((packed[k] >> 2) & 0x30);
        m[k + 4] = (packed[k + 8] >> 4) | ((packed[k + 4] >> 2) & 0x30);
    }
    (sc, m)
}

pub(crate) fn q4_k(b: &BlockQ4_K, y: &mut [f32; QK_K]) {
    let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
    let (sc, m) = k_scales_mins(&b.scales);
    for g in 0..8 {
        let (dl, ml) = (d * sc[g] as f32, dmin * m[g] as f32);
        let (c, shift) = (g / 2, 4 * (g % 2));
        for l in 0..32 {
            let q = (b.qs[32 * c + l] >> shift) & 0x0F;
            y[32 * g + l] = dl * q as f32 - ml;
        }
    }
}

pub(crate) fn q5_k(b: &BlockQ5_K, y: &mut [f32; QK_K]) {
    let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
    let (sc, m) = k_scales_mins(&b.scales);
    for g in 0..8 {
        let (dl, ml) = (d * sc[g] as f32, dmin * m[g] as f32);
        let (c, shift) = (g / 2, 4 * (g % 2));
        for l in 0..32 {
            let low = (b.qs[32 * c + l] >> shift) & 0x0F;
            let high = (b.qh[l] >> g) & 1;
            y[32 * g + l] = dl * (low | (high << 4)) as f32 - ml;
        }
    }
}

pub(crate) fn q6_k(b: &BlockQ6_K, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    for h in 0..2 {
        let (ql, qh) = (&b.ql[64 * h..64 * h + 64], &b.qh[32 * h..32 * h + 32]);
        // Four runs of 32 values: low nibbles of ql[0..32], of ql[32..64], then the
        // high nibbles of each; their top two bits are the successive crumbs of qh.
        for k in 0..4 {
            for l in 0..32 {
                let i = 128 * h + 32 * k + l;
                let low = (ql[32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
                let high = (qh[l] >> (2 * k)) & 0x03;
                let q = (low | (high << 4)) as i8 - 32;
                let dl = d * b.scales[i / 16] as f32;
                y[i] = dl * q as f32;
            }
        }
    }
}

pub(crate) fn q8_k(b: &BlockQ8_K, y: &mut [f32; QK_K]) {
    let d = b.d.get();
    for (y, &q) in y.iter_mut().zip(&b.qs) {
        *y = d * q as f32;
    }
}

pub(crate) fn iq4_xs(b: &BlockIQ4_XS, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    let scales_h = b.scales_h.get();
    for g in 0..8 {
        let low = (b.scales_l[g / 2] >> (4 * (g % 2))) & 0x0F;
        let high = ((scales_h >> (2 * g)) & 0x03) as u8;
        let dl = d * ((low | (high << 4)) as i8 - 32) as f32;
        let qs = &b.qs[16 * g..16 * g + 16];
        for (j, &q) in qs.iter().enumerate() {
            y[32 * g + j] = dl * KVALUES_IQ4NL[(q & 0x0F) as usize] as f32;
            y[32 * g + j + 16] = dl * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
        }
    }
}

/// Powers of three: digit `p` of a base-3 packed byte is `(byte * 3^p) as u8 * 3 >> 8`.
const POW3: [u8; 5] = [1, 3, 9, 27, 81];

/// The ternary digit (0, 1 or 2) at position `p` of a `TQ1_0` byte. The byte stores
/// `ceil(n * 256 / 243)` for a 5-digit base-3 number `n`; multiplying by `3^p` modulo
/// 256 brings digit `p` to the top, and `* 3 >> 8` reads it.
#[inline(always)]
pub(crate) fn trit(byte: u8, p: usize) -> i8 {
    ((byte.wrapping_mul(POW3[p]) as u16 * 3) >> 8) as i8
}

pub(crate) fn tq1_0(b: &BlockTQ1_0, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    let mut i = 0;
    // 32 bytes of five digits, then 16 bytes of five, then 4 bytes of four; digits
    // of the same power are consecutive values.
    for (bytes, digits) in [(&b.qs[..32], 5), (&b.qs[32..], 5), (&b.qh[..], 4)] {
        for p in 0..digits {
            for &byte in bytes {
                y[i] = d * (trit(byte, p) - 1) as f32;
                i += 1;
            }
        }
    }
}

pub(crate) fn tq2_0(b: &BlockTQ2_0, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    for c in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                let q = crumb(&b.qs, c, s, l) as i8 - 1;
                y[128 * c + 32 * s + l] = d * q as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k_scales_unpack_low_and_high_halves() {
        // scale 0 = 0x3F, min 0 = 0x01, scale 4 = 0x0A | (2 << 4), min 4 = 0x05 | (1 << 4)
        let mut packed = [0u8; 12];
        packed[0] = 0x3F | (2 << 6);
        packed[4] = 0x01 | (1 << 6);
        packed[8] = 0x0A | (0x05 << 4);
        let (sc, m) = k_scales_mins(&packed);
        assert_eq!((sc[0], m[0], sc[4], m[4]), (0x3F, 0x01, 0x2A, 0x15));
    }

    #[test]
    fn q3_k_scales_are_six_bit_signed() {
        let mut packed = [0u8; 12];
        packed[0] = 0x0F; // scale 0: low nibble 15
        packed[8] = 0x03; // scale 0: high bits 3 -> 63 - 32 = 31
        packed[1] = 0x50; // scale 9: low nibble 5, high bits 0 -> 5 - 32
        let scales = q3_k_scales(&packed);
        assert_eq!((scales[0], scales[9], scales[2]), (31, -27, -32));
    }

    #[test]
    fn trits_read_back_every_base3_number() {
        for n in 0u16..243 {
            let byte = ((n * 256).div_ceil(243)) as u8;
            let digits: Vec<i8> = (0..5).map(|p| trit(byte, p)).collect();
            let back = digits.iter().fold(0u16, |acc, &t| acc * 3 + t as u16);
            assert_eq!(back, n, "byte {byte:#04x}");
        }
    }
}
