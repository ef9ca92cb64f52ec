//! The ggml tensor types a GGUF file can name, with their block geometry.

use std::fmt;

/// A ggml tensor element type, as stored in a GGUF tensor info (`ggml_type`).
///
/// The discriminant is the id written in the file. Ids that ggml retired
/// (4 and 5 were `Q4_2`/`Q4_3`, 31–33 and 36–38 were short-lived repacked
/// layouts) are not representable: a file naming them is refused.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
}

impl GgmlType {
    /// Every type this crate knows, in id order.
    pub const ALL: [GgmlType; 32] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
    ];

    /// The type with file id `id`, or `None` for an id ggml does not define today.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.iter().copied().find(|t| t.id() == id)
    }

    /// The id written in GGUF files.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// ggml's name for the type (`"Q4_K"`, `"F32"`), as llama.cpp prints it.
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1_M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
        }
    }

    /// The type whose ggml name is `name` (case-sensitive, as [`GgmlType::name`] prints it).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        GgmlType::ALL.iter().copied().find(|t| t.name() == name)
    }

    /// Elements per block: 1 for plain types, 32 for the legacy quants, 256 for k-quants.
    pub fn block_size(self) -> u64 {
        self.geometry().0
    }

    /// Bytes per block.
    pub fn type_size(self) -> u64 {
        self.geometry().1
    }

    /// True for the block-quantized types (everything but plain floats and integers).
    pub fn is_quantized(self) -> bool {
        use GgmlType::*;
        !matches!(self, F32 | F16 | BF16 | F64 | I8 | I16 | I32 | I64)
    }

    /// Bytes taken by a row of `n_elements`, or `None` when `n_elements` is not a whole
    /// number of blocks or the size overflows `u64`.
    pub fn row_bytes(self, n_elements: u64) -> Option<u64> {
        if !n_elements.is_multiple_of(self.block_size()) {
            return None;
        }
        (n_elements / self.block_size()).checked_mul(self.type_size())
    }

    /// `(elements per block, bytes per block)`, from the block layouts in ggml-common.h.
    fn geometry(self) -> (u64, u64) {
        use GgmlType::*;
        const QK_K: u64 = 256;
        match self {
            F32 => (1, 4),
            F16 => (1, 2),
            BF16 => (1, 2),
            F64 => (1, 8),
            I8 => (1, 1),
            I16 => (1, 2),
            I32 => (1, 4),
            I64 => (1, 8),
            // d (f16) + 16 bytes of nibbles
            Q4_0 => (32, 18),
            // d, m (f16) + 16 bytes of nibbles
            Q4_1 => (32, 20),
            // d (f16) + 4 bytes of high bits + 16 bytes of nibbles
            Q5_0 => (32, 22),
            // d, m (f16) + 4 bytes of high bits + 16 bytes of nibbles
            Q5_1 => (32, 24),
            // d (f16) + 32 bytes
            Q8_0 => (32, 34),
            // d, s (f16) + 32 bytes
            Q8_1 => (32, 36),
            // scales[16] + qs[64] + d, dmin
            Q2_K => (QK_K, 84),
            // hmask[32] + qs[64] + scales[12] + d
            Q3_K => (QK_K, 110),
            // d, dmin + scales[12] + qs[128]
            Q4_K => (QK_K, 144),
            // d, dmin + scales[12] + qh[32] + qs[128]
            Q5_K => (QK_K, 176),
            // ql[128] + qh[64] + scales[16] + d
            Q6_K => (QK_K, 210),
            // d (f32) + qs[256] + bsums[16] (i16)
            Q8_K => (QK_K, 292),
            // d + qs[32] (u16)
            IQ2_XXS => (QK_K, 66),
            // d + qs[32] (u16) + scales[8]
            IQ2_XS => (QK_K, 74),
            // d + qs[64] + qh[8] + scales[8]
            IQ2_S => (QK_K, 82),
            // d + qs[96]
            IQ3_XXS => (QK_K, 98),
            // d + qs[64] + qh[8] + signs[32] + scales[4]
            IQ3_S => (QK_K, 110),
            // d + qs[32] + qh[8] (u16)
            IQ1_S => (QK_K, 50),
            // qs[32] + qh[16] + scales[8]
            IQ1_M => (QK_K, 56),
            // d + qs[16]
            IQ4_NL => (32, 18),
            // d + scales_h (u16) + scales_l[4] + qs[128]
            IQ4_XS => (QK_K, 136),
            // qs[48] + qh[4] + d
            TQ1_0 => (QK_K, 54),
            // qs[64] + d
            TQ2_0 => (QK_K, 66),
            // e (u8) + qs[16]
            MXFP4 => (32, 17),
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names_round_trip() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        for retired in [4, 5, 31, 32, 33, 36, 37, 38, 40, 1000] {
            assert_eq!(GgmlType::from_id(retired), None);
        }
    }

    #[test]
    fn row_bytes_refuses_partial_blocks() {
        assert_eq!(GgmlType::Q4_K.row_bytes(4096), Some(16 * 144));
        assert_eq!(GgmlType::Q4_K.row_bytes(100), None);
        assert_eq!(GgmlType::F32.row_bytes(3), Some(12));
        assert_eq!(GgmlType::Q8_0.row_bytes(u64::MAX - 31), None);
    }
}
