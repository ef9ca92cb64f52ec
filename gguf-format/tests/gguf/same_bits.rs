//! Equality of metadata values that compares floats by their bits, so NaNs compare equal
//! to themselves. The round-trip tests and the `parse_prefix` fuzz target (through
//! `#[path]`) both use it.

use gguf_format::{Array, Value};

/// `a == b`, with every float compared by its bits.
pub fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
        (Value::F64(x), Value::F64(y)) => x.to_bits() == y.to_bits(),
        (Value::Array(x), Value::Array(y)) => same_array(x, y),
        _ => a == b,
    }
}

fn same_array(a: &Array, b: &Array) -> bool {
    match (a, b) {
        (Array::F32(x), Array::F32(y)) => x
            .iter()
            .map(|v| v.to_bits())
            .eq(y.iter().map(|v| v.to_bits())),
        (Array::F64(x), Array::F64(y)) => x
            .iter()
            .map(|v| v.to_bits())
            .eq(y.iter().map(|v| v.to_bits())),
        (Array::Array(x), Array::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_array(x, y))
        }
        _ => a == b,
    }
}
