//! Reference decoders of the 32-value formats (`Q4_0` … `Q8_1`, `IQ4_NL`, `MXFP4`) and of
//! the plain element types.
//!
//! Each value is computed with exactly the f32 operations, in the same order, as the
//! reference implementation that ships with llama.cpp (gguf-py), so results are
//! bit-identical to it: `d * q` for the symmetric formats and `(d * q) + m` for the
//! ones with an offset, each product rounded before the sum (no fused multiply-add).

use half::f16;

use crate::blocks::{
    BlockIQ4_NL, BlockMXFP4, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1, QK,
};
use crate::decode::grids::{KVALUES_IQ4NL, KVALUES_MXFP4};

/// Half of a 32-value block: the low nibbles hold values 0..16, the high ones 16..32.
const HALF: usize = QK / 2;

pub(crate) fn q4_0(b: &BlockQ4_0, y: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for (j, &q) in b.qs.iter().enumerate() {
        y[j] = d * ((q & 0x0F) as i32 - 8) as f32;
        y[j + HALF] = d * ((q >> 4) as i32 - 8) as f32;
    }
}

pub(crate) fn q4_1(b: &BlockQ4_1, y: &mut [f32; QK]) {
    let (d, m) = (b.d.to_f32(), b.m.to_f32());
    for (j, &q) in b.qs.iter().enumerate() {
        y[j] = d * (q & 0x0F) as f32 + m;
        y[j + HALF] = d * (q >> 4) as f32 + m;
    }
}

/// The 5-bit quants of a `Q5_0`/`Q5_1` block, 0..32.
fn five_bit(qh: [u8; 4], qs: &[u8; HALF]) -> [u8; QK] {
    let qh = u32::from_le_bytes(qh);
    let mut q = [0u8; QK];
    for (j, &byte) in qs.iter().enumerate() {
        q[j] = (byte & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
        q[j + HALF] = (byte >> 4) | ((((qh >> (j + HALF)) & 1) as u8) << 4);
    }
    q
}

pub(crate) fn q5_0(b: &BlockQ5_0, y: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for (y, q) in y.iter_mut().zip(five_bit(b.qh, &b.qs)) {
        *y = d * (q as i32 - 16) as f32;
    }
}

pub(crate) fn q5_1(b: &BlockQ5_1, y: &mut [f32; QK]) {
    let (d, m) = (b.d.to_f32(), b.m.to_f32());
    for (y, q) in y.iter_mut().zip(five_bit(b.qh, &b.qs)) {
        *y = d * q as f32 + m;
    }
}

pub(crate) fn q8_0(b: &BlockQ8_0, y: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for (y, &q) in y.iter_mut().zip(&b.qs) {
        *y = q as f32 * d;
    }
}

pub(crate) fn q8_1(b: &BlockQ8_1, y: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for (y, &q) in y.iter_mut().zip(&b.qs) {
        *y = q as f32 * d;
    }
}

pub(crate) fn iq4_nl(b: &BlockIQ4_NL, y: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for (j, &q) in b.qs.iter().enumerate() {
        y[j] = d * KVALUES_IQ4NL[(q & 0x0F) as usize] as f32;
        y[j + HALF] = d * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
    }
}

/// Half of the E8M0 scale `2^(e - 127)`, as an f32 built from its bits (the table of
/// E2M1 values is doubled, so this halving makes the product exact). Exponents 0 and 1
/// give subnormals.
pub(crate) fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

pub(crate) fn mxfp4(b: &BlockMXFP4, y: &mut [f32; QK]) {
    let d = e8m0_to_f32_half(b.e);
    for (j, &q) in b.qs.iter().enumerate() {
        y[j] = d * KVALUES_MXFP4[(q & 0x0F) as usize] as f32;
        y[j + HALF] = d * KVALUES_MXFP4[(q >> 4) as usize] as f32;
    }
}

/// Plain element types: one value per "block" of raw little-endian bytes.
pub(crate) fn f32_(x: &[u8; 4], y: &mut [f32; 1]) {
    y[0] = f32::from_le_bytes(*x);
}

pub(crate) fn f16_(x: &[u8; 2], y: &mut [f32; 1]) {
    y[0] = f16::from_le_bytes(*x).to_f32();
}

/// BF16 is the top half of an f32: the bits are moved, NaN payloads included.
pub(crate) fn bf16_(x: &[u8; 2], y: &mut [f32; 1]) {
    y[0] = f32::from_bits((u16::from_le_bytes(*x) as u32) << 16);
}

/// F64 values rounded to the nearest f32.
pub(crate) fn f64_(x: &[u8; 8], y: &mut [f32; 1]) {
    y[0] = f64::from_le_bytes(*x) as f32;
}

pub(crate) fn i8_(x: &[u8; 1], y: &mut [f32; 1]) {
    y[0] = x[0] as i8 as f32;
}

pub(crate) fn i16_(x: &[u8; 2], y: &mut [f32; 1]) {
    y[0] = i16::from_le_bytes(*x) as f32;
}

/// I32 values rounded to the nearest f32.
pub(crate) fn i32_(x: &[u8; 4], y: &mut [f32; 1]) {
    y[0] = i32::from_le_bytes(*x) as f32;
}

/// I64 values rounded to the nearest f32.
pub(crate) fn i64_(x: &[u8; 8], y: &mut [f32; 1]) {
    y[0] = i64::from_le_bytes(*x) as f32;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::F16Le;

    #[test]
    fn q4_0_layout_low_nibbles_first() {
        let mut qs = [0u8; HALF];
        qs[0] = 0xF0; // value 0 is 0 - 8, value 16 is 15 - 8
        qs[3] = 0x9A; // value 3 is 10 - 8, value 19 is 9 - 8
        let b = BlockQ4_0 {
            d: F16Le::from_f16(f16::from_f32(0.5)),
            qs,
        };
        let mut y = [0.0; QK];
        q4_0(&b, &mut y);
        assert_eq!((y[0], y[16], y[3], y[19]), (-4.0, 3.5, 1.0, 0.5));
        assert_eq!(y[1], -4.0);
    }

    #[test]
    fn q5_high_bits_come_from_qh_in_value_order() {
        let b = BlockQ5_1 {
            d: F16Le::from_f16(f16::ONE),
            m: F16Le::from_f16(f16::from_f32(-1.0)),
            qh: (1u32 << 2 | 1u32 << 18).to_le_bytes(),
            qs: [0x21; HALF],
        };
        let mut y = [0.0; QK];
        q5_1(&b, &mut y);
        assert_eq!((y[2], y[18], y[0], y[16]), (16.0, 17.0, 0.0, 1.0));
    }

    #[test]
    fn e8m0_scale_covers_subnormal_and_normal_exponents() {
        assert_eq!(e8m0_to_f32_half(127), 0.5);
        assert_eq!(e8m0_to_f32_half(128), 1.0);
        assert_eq!(e8m0_to_f32_half(1), 2f32.powi(-127));
        assert_eq!(e8m0_to_f32_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_to_f32_half(254), 2f32.powi(126));
    }

    #[test]
    fn plain_types_widen_exactly() {
        let mut y = [0.0; 1];
        bf16_(&[0x80, 0x3f], &mut y);
        assert_eq!(y[0], 1.0);
        i8_(&[0xff], &mut y);
        assert_eq!(y[0], -1.0);
        i64_(&(-(1i64 << 40)).to_le_bytes(), &mut y);
        assert_eq!(y[0], -(2f32.powi(40)));
    }
}
