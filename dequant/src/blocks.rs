//! The block layouts of every quantized ggml type, as `#[repr(C)]` plain-old-data structs.
//!
//! Each struct is the byte layout of one block as GGUF stores it (`ggml-common.h`), with a
//! compile-time assertion of its size beside it.
//!
//! **Every block has alignment 1.** Multi-byte fields are stored as little-endian byte
//! arrays ([`F16Le`], [`U16Le`], [`I16Le`], [`F32Le`]) rather than as `f16`/`u16`/`f32`.
//! Two reasons: tensor bytes come from a mapped file whose tensors are aligned only to
//! the file's `general.alignment`, and a block inside a row of 18- or 34-byte blocks has
//! any address at all; with alignment 1, [`cast_blocks`] views any byte slice as blocks
//! without copying and can fail only on a length that is not a whole number of blocks.
//! Decoding each field from explicit little-endian bytes also keeps the crate correct on
//! big-endian hosts. Reading a field costs the same as an unaligned load, which x86-64
//! does at full speed.

use bytemuck::{Pod, Zeroable};
use gguf_format::GgmlType;
use half::f16;

/// Elements per block of the legacy formats and of IQ4_NL and MXFP4.
pub const QK: usize = 32;
/// Elements per super-block of the k-quants and of the IQ and TQ formats.
pub const QK_K: usize = 256;

/// An IEEE binary16 value stored as two little-endian bytes.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug, Pod, Zeroable)]
#[repr(transparent)]
pub struct F16Le(pub [u8; 2]);

impl F16Le {
    /// The stored bits.
    #[inline(always)]
    pub fn to_bits(self) -> u16 {
        u16::from_le_bytes(self.0)
    }

    /// The value as `half::f16`.
    #[inline(always)]
    pub fn to_f16(self) -> f16 {
        f16::from_bits(self.to_bits())
    }

    /// The value widened to f32 (exact).
    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        self.to_f16().to_f32()
    }

    /// Stores `value`.
    pub fn from_f16(value: f16) -> F16Le {
        F16Le(value.to_bits().to_le_bytes())
    }
}

/// A `u16` stored as two little-endian bytes.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug, Pod, Zeroable)]
#[repr(transparent)]
pub struct U16Le(pub [u8; 2]);

impl U16Le {
    /// The value.
    #[inline(always)]
    pub fn get(self) -> u16 {
        u16::from_le_bytes(self.0)
    }
}

/// An `i16` stored as two little-endian bytes.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug, Pod, Zeroable)]
#[repr(transparent)]
pub struct I16Le(pub [u8; 2]);

impl I16Le {
    /// The value.
    #[inline(always)]
    pub fn get(self) -> i16 {
        i16::from_le_bytes(self.0)
    }
}

/// An IEEE binary32 value stored as four little-endian bytes.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug, Pod, Zeroable)]
#[repr(transparent)]
pub struct F32Le(pub [u8; 4]);

impl F32Le {
    /// The value.
    #[inline(always)]
    pub fn get(self) -> f32 {
        f32::from_le_bytes(self.0)
    }
}

/// A block type: its ggml type and how many values one block holds.
pub trait Block: Pod {
    /// The ggml type whose blocks these are.
    const TYPE: GgmlType;
    /// Values per block.
    const ELEMS: usize;
}

/// Views `bytes` as a slice of blocks without copying, or `None` when the length is not
/// a whole number of blocks. Never fails on alignment: every block has alignment 1.
pub fn cast_blocks<B: Block>(bytes: &[u8]) -> Option<&[B]> {
    bytemuck::try_cast_slice(bytes).ok()
}

macro_rules! block {
    (
        $(#[$doc:meta])*
        $name:ident, $ty:ident, $elems:expr, $size:expr,
        { $($(#[$fdoc:meta])* $field:ident: $fty:ty,)* }
    ) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
        #[repr(C)]
        pub struct $name {
            $($(#[$fdoc])* pub $field: $fty,)*
        }

        const _: () = assert!(std::mem::size_of::<$name>() == $size);
        const _: () = assert!(std::mem::align_of::<$name>() == 1);

        impl Block for $name {
            const TYPE: GgmlType = GgmlType::$ty;
            const ELEMS: usize = $elems;
        }
    };
}

block!(
    /// `Q4_0`: 32 values `d * (q - 8)` with 4-bit `q`.
    BlockQ4_0, Q4_0, QK, 18, {
        /// Scale.
        d: F16Le,
        /// Low nibbles hold values 0..16, high nibbles values 16..32.
        qs: [u8; QK / 2],
    }
);

block!(
    /// `Q4_1`: 32 values `d * q + m` with 4-bit `q`.
    BlockQ4_1, Q4_1, QK, 20, {
        /// Scale.
        d: F16Le,
        /// Offset.
        m: F16Le,
        /// Low nibbles hold values 0..16, high nibbles values 16..32.
        qs: [u8; QK / 2],
    }
);

block!(
    /// `Q5_0`: 32 values `d * (q - 16)` with 5-bit `q`.
    BlockQ5_0, Q5_0, QK, 22, {
        /// Scale.
        d: F16Le,
        /// The fifth bit of value `j` is bit `j` of this little-endian u32.
        qh: [u8; 4],
        /// The low four bits, laid out as in `Q4_0`.
        qs: [u8; QK / 2],
    }
);

block!(
    /// `Q5_1`: 32 values `d * q + m` with 5-bit `q`.
    BlockQ5_1, Q5_1, QK, 24, {
        /// Scale.
        d: F16Le,
        /// Offset.
        m: F16Le,
        /// The fifth bit of value `j` is bit `j` of this little-endian u32.
        qh: [u8; 4],
        /// The low four bits, laid out as in `Q4_0`.
        qs: [u8; QK / 2],
    }
);

block!(
    /// `Q8_0`: 32 values `d * q` with signed 8-bit `q`.
    BlockQ8_0, Q8_0, QK, 34, {
        /// Scale.
        d: F16Le,
        /// Quants (two's complement).
        qs: [i8; QK],
    }
);

block!(
    /// `Q8_1`: 32 values `d * q`, with `s = d * Σq` kept for dot products.
    BlockQ8_1, Q8_1, QK, 36, {
        /// Scale.
        d: F16Le,
        /// `d` times the sum of the quants.
        s: F16Le,
        /// Quants (two's complement).
        qs: [i8; QK],
    }
);

block!(
    /// `Q2_K`: 16 groups of 16 two-bit values, `d * sc * q - dmin * m` per group.
    BlockQ2_K, Q2_K, QK_K, 84, {
        /// Per group: scale in the low nibble, min in the high nibble.
        scales: [u8; QK_K / 16],
        /// Two-bit quants, four per byte.
        qs: [u8; QK_K / 4],
        /// Super-block scale for the scales.
        d: F16Le,
        /// Super-block scale for the mins.
        dmin: F16Le,
    }
);

block!(
    /// `Q3_K`: 16 groups of 16 three-bit values with 6-bit signed scales.
    BlockQ3_K, Q3_K, QK_K, 110, {
        /// The high (third) bit of each quant.
        hmask: [u8; QK_K / 8],
        /// The low two bits of each quant, four per byte.
        qs: [u8; QK_K / 4],
        /// Sixteen 6-bit scales packed into 12 bytes.
        scales: [u8; 12],
        /// Super-block scale.
        d: F16Le,
    }
);

block!(
    /// `Q4_K`: 8 groups of 32 four-bit values, `d * sc * q - dmin * m` per group.
    BlockQ4_K, Q4_K, QK_K, 144, {
        /// Super-block scale for the scales.
        d: F16Le,
        /// Super-block scale for the mins.
        dmin: F16Le,
        /// Eight 6-bit scales and eight 6-bit mins packed into 12 bytes.
        scales: [u8; 12],
        /// Four-bit quants: each 32 bytes hold two groups (low then high nibbles).
        qs: [u8; QK_K / 2],
    }
);

block!(
    /// `Q5_K`: 8 groups of 32 five-bit values, `d * sc * q - dmin * m` per group.
    BlockQ5_K, Q5_K, QK_K, 176, {
        /// Super-block scale for the scales.
        d: F16Le,
        /// Super-block scale for the mins.
        dmin: F16Le,
        /// Eight 6-bit scales and eight 6-bit mins packed into 12 bytes.
        scales: [u8; 12],
        /// The fifth bit: bit `g` of byte `l` belongs to value `l` of group `g`.
        qh: [u8; QK_K / 8],
        /// The low four bits, laid out as in `Q4_K`.
        qs: [u8; QK_K / 2],
    }
);

block!(
    /// `Q6_K`: 16 groups of 16 six-bit values `d * sc * (q - 32)`.
    BlockQ6_K, Q6_K, QK_K, 210, {
        /// The low four bits of each quant.
        ql: [u8; QK_K / 2],
        /// The high two bits of each quant.
        qh: [u8; QK_K / 4],
        /// Signed 8-bit group scales.
        scales: [i8; QK_K / 16],
        /// Super-block scale.
        d: F16Le,
    }
);

block!(
    /// `Q8_K`: 256 values `d * q`, with sums per 16 kept for dot products.
    BlockQ8_K, Q8_K, QK_K, 292, {
        /// Scale (f32, unlike the other blocks).
        d: F32Le,
        /// Quants (two's complement).
        qs: [i8; QK_K],
        /// Sum of each group of 16 quants.
        bsums: [I16Le; QK_K / 16],
    }
);

block!(
    /// `IQ2_XXS`: 2.06 bits per value from the 256-entry `iq2xxs` grid.
    BlockIQ2_XXS, IQ2_XXS, QK_K, 66, {
        /// Super-block scale.
        d: F16Le,
        /// Per 32 values, four u16: grid indices and packed signs and scale.
        qs: [U16Le; QK_K / 8],
    }
);

block!(
    /// `IQ2_XS`: 2.31 bits per value from the 512-entry `iq2xs` grid.
    BlockIQ2_XS, IQ2_XS, QK_K, 74, {
        /// Super-block scale.
        d: F16Le,
        /// Per 8 values: a 9-bit grid index and a 7-bit sign index.
        qs: [U16Le; QK_K / 8],
        /// Two 4-bit scales per 32 values.
        scales: [u8; QK_K / 32],
    }
);

block!(
    /// `IQ2_S`: 2.5 bits per value from the 1024-entry `iq2s` grid.
    BlockIQ2_S, IQ2_S, QK_K, 82, {
        /// Super-block scale.
        d: F16Le,
        /// Low 8 bits of the grid indices, then the sign bytes.
        qs: [u8; QK_K / 4],
        /// High 2 bits of the grid indices.
        qh: [u8; QK_K / 32],
        /// Two 4-bit scales per 32 values.
        scales: [u8; QK_K / 32],
    }
);

block!(
    /// `IQ3_XXS`: 3.06 bits per value from the 256-entry `iq3xxs` grid.
    BlockIQ3_XXS, IQ3_XXS, QK_K, 98, {
        /// Super-block scale.
        d: F16Le,
        /// 64 grid indices, then per 32 values a u32 of signs and scale.
        qs: [u8; 3 * QK_K / 8],
    }
);

block!(
    /// `IQ3_S`: 3.44 bits per value from the 512-entry `iq3s` grid.
    BlockIQ3_S, IQ3_S, QK_K, 110, {
        /// Super-block scale.
        d: F16Le,
        /// Low 8 bits of the grid indices.
        qs: [u8; QK_K / 4],
        /// Ninth bit of the grid indices.
        qh: [u8; QK_K / 32],
        /// One sign bit per value.
        signs: [u8; QK_K / 8],
        /// Two 4-bit scales per 64 values.
        scales: [u8; QK_K / 64],
    }
);

block!(
    /// `IQ1_S`: 1.56 bits per value from the 2048-entry `iq1s` grid.
    BlockIQ1_S, IQ1_S, QK_K, 50, {
        /// Super-block scale.
        d: F16Le,
        /// Low 8 bits of the grid indices.
        qs: [u8; QK_K / 8],
        /// Per 32 values: high index bits, a 3-bit scale and the sign of the shift.
        qh: [U16Le; QK_K / 32],
    }
);

block!(
    /// `IQ1_M`: 1.75 bits per value from the `iq1s` grid; the f16 super-block scale is
    /// spread over the top nibbles of the four u16 of `scales`.
    BlockIQ1_M, IQ1_M, QK_K, 56, {
        /// Low 8 bits of the grid indices.
        qs: [u8; QK_K / 8],
        /// Per 16 values: high index bits and the sign of the shift, one nibble each.
        qh: [u8; QK_K / 16],
        /// 3-bit scales per 16 values, and the super-block scale in the top nibbles.
        scales: [u8; QK_K / 32],
    }
);

block!(
    /// `IQ4_NL`: 32 values `d * kvalues_iq4nl[q]` with 4-bit `q`.
    BlockIQ4_NL, IQ4_NL, QK, 18, {
        /// Scale.
        d: F16Le,
        /// Indices into the non-linear table, laid out as in `Q4_0`.
        qs: [u8; QK / 2],
    }
);

block!(
    /// `IQ4_XS`: 8 groups of 32 values `d * (ls - 32) * kvalues_iq4nl[q]`.
    BlockIQ4_XS, IQ4_XS, QK_K, 136, {
        /// Super-block scale.
        d: F16Le,
        /// The high two bits of the eight 6-bit group scales.
        scales_h: U16Le,
        /// The low four bits of the group scales, two per byte.
        scales_l: [u8; QK_K / 64],
        /// Indices into the non-linear table: per group, 16 bytes laid out as in `Q4_0`.
        qs: [u8; QK_K / 2],
    }
);

block!(
    /// `TQ1_0`: ternary values packed five per byte (base 3), `d * (t - 1)`.
    BlockTQ1_0, TQ1_0, QK_K, 54, {
        /// 240 values, five per byte.
        qs: [u8; (QK_K - 4 * QK_K / 64) / 5],
        /// The last 16 values, four per byte.
        qh: [u8; QK_K / 64],
        /// Scale.
        d: F16Le,
    }
);

block!(
    /// `TQ2_0`: ternary values in two bits each, `d * (q - 1)`.
    BlockTQ2_0, TQ2_0, QK_K, 66, {
        /// Two-bit quants, four per byte.
        qs: [u8; QK_K / 4],
        /// Scale.
        d: F16Le,
    }
);

block!(
    /// `MXFP4`: 32 FP4 (E2M1) values sharing a power-of-two scale `2^(e - 127)`.
    BlockMXFP4, MXFP4, QK, 17, {
        /// The shared exponent (E8M0).
        e: u8,
        /// FP4 codes, laid out as in `Q4_0`.
        qs: [u8; QK / 2],
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    fn check<B: Block>() {
        assert_eq!(
            std::mem::size_of::<B>() as u64,
            B::TYPE.type_size(),
            "{}",
            B::TYPE
        );
        assert_eq!(B::ELEMS as u64, B::TYPE.block_size(), "{}", B::TYPE);
    }

    #[test]
    fn block_geometry_matches_gguf_format() {
        check::<BlockQ4_0>();
        check::<BlockQ4_1>();
        check::<BlockQ5_0>();
        check::<BlockQ5_1>();
        check::<BlockQ8_0>();
        check::<BlockQ8_1>();
        check::<BlockQ2_K>();
        check::<BlockQ3_K>();
        check::<BlockQ4_K>();
        check::<BlockQ5_K>();
        check::<BlockQ6_K>();
        check::<BlockQ8_K>();
        check::<BlockIQ2_XXS>();
        check::<BlockIQ2_XS>();
        check::<BlockIQ2_S>();
        check::<BlockIQ3_XXS>();
        check::<BlockIQ3_S>();
        check::<BlockIQ1_S>();
        check::<BlockIQ1_M>();
        check::<BlockIQ4_NL>();
        check::<BlockIQ4_XS>();
        check::<BlockTQ1_0>();
        check::<BlockTQ2_0>();
        check::<BlockMXFP4>();
    }

    #[test]
    fn cast_accepts_any_alignment_and_refuses_partial_blocks() {
        let bytes = vec![0u8; 3 * 18 + 1];
        // Offset 1 makes the slice odd-aligned: still castable.
        let blocks = cast_blocks::<BlockQ4_0>(&bytes[1..]).map(<[_]>::len);
        assert_eq!(blocks, Some(3));
        assert!(cast_blocks::<BlockQ4_0>(&bytes).is_none());
    }

    #[test]
    fn fields_decode_little_endian() {
        let mut bytes = [0u8; 18];
        bytes[..2].copy_from_slice(&f16::from_f32(-1.5).to_bits().to_le_bytes());
        let block = cast_blocks::<BlockQ4_0>(&bytes).map(|b| b[0]);
        assert_eq!(block.map(|b| b.d.to_f32()), Some(-1.5));
        assert_eq!(U16Le([0x34, 0x12]).get(), 0x1234);
        assert_eq!(I16Le([0xfe, 0xff]).get(), -2);
        assert_eq!(F32Le(2.5f32.to_le_bytes()).get(), 2.5);
    }
}
