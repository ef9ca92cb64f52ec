//! Every block type against the values gguf-py (the reference implementation that ships
//! with llama.cpp) decodes, from the test vectors in `testdata/vectors`.
//!
//! `dequant_vectors.gguf` holds, per type, `<TYPE>.q` (random valid blocks stored as
//! that type) and `<TYPE>.f32` (gguf-py's decoding of them). The file is read with our
//! own parser. Every path must reproduce every value bit for bit: the decoders perform
//! gguf-py's f32 operations in gguf-py's order, so no ulp tolerance is needed anywhere.

use dequant::{DecodePath, Decoder};
use gguf_format::{GgmlType, GgufFile};
use half::f16;

/// The types the vector file covers (Q8_1 and Q8_K, which only activations use, are
/// absent from it).
const EXPECTED_TYPES: [&str; 24] = [
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS",
    "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4",
    "IQ1_M", "BF16", "F16",
];

/// The repository's `testdata/vectors/dequant_vectors.gguf`, compiled into the test
/// binary so that it runs from anywhere.
const VECTOR_FILE: &[u8] = include_bytes!("../../testdata/vectors/dequant_vectors.gguf");

struct Vectors {
    file: GgufFile,
    bytes: Vec<u8>,
}

impl Vectors {
    fn load() -> Vectors {
        let bytes = VECTOR_FILE.to_vec();
        let file = gguf_format::parse(&bytes).expect("the vector file parses");
        Vectors { file, bytes }
    }

    fn data(&self, name: &str) -> (GgmlType, &[u8]) {
        let info = self
            .file
            .tensor(name)
            .unwrap_or_else(|| panic!("no tensor {name}"));
        let range = self.file.tensor_range(info);
        (
            info.ggml_type,
            &self.bytes[range.start as usize..range.end as usize],
        )
    }

    /// `(type, quantized bytes, expected values)` for every `<TYPE>.q` tensor.
    fn cases(&self) -> Vec<(GgmlType, &[u8], Vec<f32>)> {
        let mut cases = Vec::new();
        for info in &self.file.tensors {
            let Some(type_name) = info.name.strip_suffix(".q") else {
                continue;
            };
            let (ty, q) = self.data(&info.name);
            assert_eq!(ty.name(), type_name, "{} is stored as {ty}", info.name);
            let (f32_ty, raw) = self.data(&format!("{type_name}.f32"));
            assert_eq!(f32_ty, GgmlType::F32);
            let expected: Vec<f32> = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(expected.len() as u64, info.n_elements(), "{}", info.name);
            cases.push((ty, q, expected));
        }
        cases
    }
}

/// The first index where `got` and `want` differ in bits, with both values.
fn first_difference(got: &[f32], want: &[f32]) -> Option<(usize, f32, f32)> {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .position(|(g, w)| g.to_bits() != w.to_bits())
        .map(|i| (i, got[i], want[i]))
}

fn decoders() -> Vec<(String, Decoder)> {
    let mut all = vec![
        ("scalar".to_string(), Decoder::scalar()),
        (
            "scalar serial".to_string(),
            Decoder::scalar().parallel(false),
        ),
    ];
    if DecodePath::Avx2.is_available() {
        let avx2 = Decoder::with_path(DecodePath::Avx2).expect("avx2 is available");
        all.push(("avx2".to_string(), avx2));
        all.push(("avx2 serial".to_string(), avx2.parallel(false)));
    } else {
        eprintln!("this cpu has no avx2+f16c: the avx2 path is not exercised here");
    }
    all
}

#[test]
fn the_vector_file_covers_every_expected_type() {
    let vectors = Vectors::load();
    let found: Vec<&str> = vectors.cases().iter().map(|(ty, _, _)| ty.name()).collect();
    for name in EXPECTED_TYPES {
        assert!(found.contains(&name), "{name} missing from the vector file");
    }
    assert_eq!(found.len(), EXPECTED_TYPES.len());
}

/// A decoder's method decoding into one element type.
type Decode<T> = fn(&Decoder, GgmlType, &[u8], &mut [T]) -> Result<(), dequant::DequantError>;

/// Every vector decoded by every decoder with `decode` into values first set to `nan`,
/// handed to `check` with the type, the decoder's name and the reference values.
fn each_decoding<T: Copy>(
    nan: T,
    decode: Decode<T>,
    mut check: impl FnMut(GgmlType, &str, &[T], &[f32]),
) {
    let vectors = Vectors::load();
    for (ty, q, expected) in vectors.cases() {
        for (name, decoder) in decoders() {
            let mut got = vec![nan; expected.len()];
            decode(&decoder, ty, q, &mut got).unwrap_or_else(|e| panic!("{ty} {name}: {e}"));
            check(ty, &name, &got, &expected);
        }
    }
}

#[test]
fn every_type_decodes_to_gguf_py_values_bit_for_bit() {
    let mut failures = Vec::new();
    each_decoding(f32::NAN, Decoder::decode_f32, |ty, name, got, expected| {
        if let Some((i, g, w)) = first_difference(got, expected) {
            failures.push(format!("{ty} {name}: value {i} is {g:e}, expected {w:e}"));
        }
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_type_decodes_to_f16_as_the_rounded_reference() {
    each_decoding(f16::NAN, Decoder::decode_f16, |ty, name, got, expected| {
        for (i, (g, w)) in got.iter().zip(expected).enumerate() {
            let w = f16::from_f32(*w);
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{ty} {name}: value {i}: {g} vs {w}"
            );
        }
    });
}

#[test]
fn the_public_entry_points_agree_with_the_reference() {
    let vectors = Vectors::load();
    for (ty, q, expected) in vectors.cases() {
        assert_eq!(dequant::decoded_len(ty, q.len()), Ok(expected.len()));
        let mut got = vec![0f32; expected.len()];
        dequant::decode_f32(ty, q, &mut got).unwrap_or_else(|e| panic!("{ty}: {e}"));
        assert_eq!(first_difference(&got, &expected), None, "{ty}");
    }
}
