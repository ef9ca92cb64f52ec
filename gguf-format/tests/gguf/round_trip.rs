//! parse(write(x)) == x: random metadata of every value type (nested arrays included),
//! random tensors of every ggml type and shape, random alignment.

use gguf_format::limits::{MAX_ALIGNMENT, MAX_ARRAY_DEPTH};
use gguf_format::{parse, Array, GgmlType, GgufWriter, Value};

use crate::same_bits::same_value;
use proptest::collection::vec;
use proptest::prelude::*;

/// Floats from any bit pattern, NaN payloads included: the file must keep every bit.
fn f32_bits() -> impl Strategy<Value = f32> {
    any::<u32>().prop_map(f32::from_bits)
}

fn f64_bits() -> impl Strategy<Value = f64> {
    any::<u64>().prop_map(f64::from_bits)
}

fn text() -> impl Strategy<Value = String> {
    // Any printable Unicode, multi-byte characters included.
    "\\PC{0,12}"
}

fn leaf_array() -> impl Strategy<Value = Array> {
    const N: std::ops::Range<usize> = 0..6;
    prop_oneof![
        vec(any::<u8>(), N).prop_map(Array::U8),
        vec(any::<i8>(), N).prop_map(Array::I8),
        vec(any::<u16>(), N).prop_map(Array::U16),
        vec(any::<i16>(), N).prop_map(Array::I16),
        vec(any::<u32>(), N).prop_map(Array::U32),
        vec(any::<i32>(), N).prop_map(Array::I32),
        vec(f32_bits(), N).prop_map(Array::F32),
        vec(any::<bool>(), N).prop_map(Array::Bool),
        vec(text(), N).prop_map(|v| Array::String(v.into())),
        vec(any::<u64>(), N).prop_map(Array::U64),
        vec(any::<i64>(), N).prop_map(Array::I64),
        vec(f64_bits(), N).prop_map(Array::F64),
    ]
}

/// Arrays nested up to the parser's limit.
fn array() -> impl Strategy<Value = Array> {
    leaf_array().prop_recursive(MAX_ARRAY_DEPTH as u32 - 1, 48, 4, |inner| {
        vec(inner, 0..4).prop_map(Array::Array)
    })
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u8>().prop_map(Value::U8),
        any::<i8>().prop_map(Value::I8),
        any::<u16>().prop_map(Value::U16),
        any::<i16>().prop_map(Value::I16),
        any::<u32>().prop_map(Value::U32),
        any::<i32>().prop_map(Value::I32),
        f32_bits().prop_map(Value::F32),
        any::<bool>().prop_map(Value::Bool),
        text().prop_map(Value::String),
        array().prop_map(Value::Array),
        any::<u64>().prop_map(Value::U64),
        any::<i64>().prop_map(Value::I64),
        f64_bits().prop_map(Value::F64),
    ]
}

/// A tensor: name suffix, type, shape (ne0 a whole number of blocks), and a data seed.
fn tensor() -> impl Strategy<Value = (String, GgmlType, Vec<u64>, u64)> {
    let ggml_type = proptest::sample::select(GgmlType::ALL.to_vec());
    (text(), ggml_type, 0..=4usize, vec(0..4u64, 4), any::<u64>()).prop_map(
        |(name, ggml_type, n_dims, dims, seed)| {
            let n_dims = if ggml_type.is_quantized() {
                n_dims.max(1)
            } else {
                n_dims
            };
            let mut shape = dims[..n_dims].to_vec();
            if let Some(ne0) = shape.first_mut() {
                *ne0 *= ggml_type.block_size();
            }
            (name, ggml_type, shape, seed)
        },
    )
}

/// Deterministic bytes from a seed (a 64-bit linear congruential generator).
fn bytes_from(seed: u64, len: u64) -> Vec<u8> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 56) as u8
        })
        .collect()
}

/// Writes, parses, and checks that everything written comes back where the layout put it.
fn check_round_trip(w: &GgufWriter, data: &[Vec<u8>]) -> Result<(), TestCaseError> {
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let bytes = w.to_bytes(&refs).unwrap();
    let layout = w.layout().unwrap();
    let file = parse(&bytes).unwrap();
    prop_assert_eq!(bytes.len() as u64, layout.file_len);
    prop_assert_eq!(file.version, 3);
    prop_assert_eq!(file.data_offset, layout.header.len() as u64);
    let alignment = w
        .metadata()
        .get_u32("general.alignment")
        .map_or(32, u64::from);
    prop_assert_eq!(file.alignment, alignment);

    prop_assert_eq!(file.metadata.len(), w.metadata().len());
    for ((k1, v1), (k2, v2)) in file.metadata.iter().zip(w.metadata().iter()) {
        prop_assert_eq!(k1, k2);
        prop_assert!(same_value(v1, v2), "{}: {:?} != {:?}", k1, v1, v2);
    }

    prop_assert_eq!(file.tensors.len(), w.tensors().len());
    for (i, (parsed, declared)) in file.tensors.iter().zip(w.tensors()).enumerate() {
        prop_assert_eq!(&parsed.name, &declared.name);
        prop_assert_eq!(parsed.ggml_type, declared.ggml_type);
        prop_assert_eq!(&parsed.shape, &declared.shape);
        prop_assert_eq!(parsed.size, declared.size);
        prop_assert_eq!(parsed.offset, layout.tensor_offsets[i]);
        prop_assert_eq!(parsed.offset % alignment, 0);
        let range = file.tensor_range(parsed);
        prop_assert_eq!(
            &bytes[range.start as usize..range.end as usize],
            &data[i][..]
        );
    }
    Ok(())
}

proptest! {
    #[test]
    fn write_then_parse_gives_back_everything(
        metadata in vec((text(), value()), 0..10),
        tensors in vec(tensor(), 0..6),
        alignment_log2 in proptest::option::of(0..=12u32),
    ) {
        let mut w = GgufWriter::new();
        if let Some(log2) = alignment_log2 {
            w.set_alignment(1 << log2).unwrap();
        }
        for (i, (key, value)) in metadata.into_iter().enumerate() {
            w.add_metadata(&format!("k{i}.{key}"), value).unwrap();
        }
        let mut data = Vec::new();
        for (i, (name, ggml_type, shape, seed)) in tensors.into_iter().enumerate() {
            let size = w.add_tensor(&format!("t{i}.{name}"), ggml_type, &shape).unwrap().size;
            data.push(bytes_from(seed, size));
        }
        check_round_trip(&w, &data)?;
    }
}

#[test]
fn every_ggml_type_round_trips_at_the_largest_alignment() {
    let mut w = GgufWriter::new();
    w.set_alignment(MAX_ALIGNMENT as u32).unwrap();
    let mut data = Vec::new();
    for (i, t) in GgmlType::ALL.into_iter().enumerate().take(3) {
        let size = w
            .add_tensor(t.name(), t, &[t.block_size() * 2, 3])
            .unwrap()
            .size;
        assert_eq!(size, t.type_size() * 6);
        data.push(bytes_from(i as u64, size));
    }
    check_round_trip(&w, &data).unwrap();
}

#[test]
fn every_ggml_type_round_trips_with_its_block_size() {
    let mut w = GgufWriter::new();
    let mut data = Vec::new();
    for (i, t) in GgmlType::ALL.into_iter().enumerate() {
        let size = w
            .add_tensor(t.name(), t, &[t.block_size(), 2, 1])
            .unwrap()
            .size;
        assert_eq!(size, t.type_size() * 2);
        data.push(bytes_from(i as u64, size));
    }
    check_round_trip(&w, &data).unwrap();
}
