//! Metadata values and typed access to them.

use std::collections::HashMap;
use std::fmt;

use crate::{GgufError, StringArray};

/// The type tag of a metadata value, as written in the file (`gguf_metadata_value_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The type with file id `id`, if GGUF defines it.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The id written in the file.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The fewest bytes one value of this type takes in a file (a string's or an
    /// array's length prefix, for those), used to bound counts by the bytes left.
    pub(crate) fn min_encoded_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: one element type for all elements, stored as a typed vector; strings
/// in a [`StringArray`], so that a 262,144-entry vocabulary is one buffer of text, not an
/// enum or an allocation per element.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(StringArray),
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Value {
    /// The value's type tag.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// The value as a signed 128-bit integer, for any integer type.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as an `f64`, for any float type.
    pub fn as_float(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }
}

impl Array {
    /// The element type tag.
    pub fn element_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Conversion from a metadata value, used by [`Metadata::get`]-style typed access.
///
/// Integer targets accept any integer value that fits without loss (files disagree on
/// whether `*.context_length` is a u32 or a u64); float targets accept f32 and f64.
pub trait FromValue<'a>: Sized {
    /// The name used in errors (`"u32"`).
    const EXPECTED: &'static str;
    /// Converts, or says why not.
    fn from_value(key: &str, value: &'a Value) -> Result<Self, GgufError>;
}

fn wrong_type(key: &str, expected: &'static str, value: &Value) -> GgufError {
    GgufError::WrongType {
        key: key.to_owned(),
        expected,
        found: value.value_type(),
    }
}

macro_rules! integer_from_value {
    ($($t:ty => $name:literal),*) => {$(
        impl FromValue<'_> for $t {
            const EXPECTED: &'static str = $name;
            fn from_value(key: &str, value: &Value) -> Result<Self, GgufError> {
                let wide = value.as_integer().ok_or_else(|| wrong_type(key, $name, value))?;
                <$t>::try_from(wide).map_err(|_| GgufError::ValueOutOfRange {
                    key: key.to_owned(),
                    value: wide.to_string(),
                    expected: $name,
                })
            }
        }
    )*};
}
integer_from_value!(u8 => "u8", u16 => "u16", u32 => "u32", u64 => "u64", i32 => "i32", i64 => "i64", usize => "usize");

impl FromValue<'_> for f32 {
    const EXPECTED: &'static str = "f32";
    fn from_value(key: &str, value: &Value) -> Result<Self, GgufError> {
        value
            .as_float()
            .map(|v| v as f32)
            .ok_or_else(|| wrong_type(key, "f32", value))
    }
}

impl FromValue<'_> for f64 {
    const EXPECTED: &'static str = "f64";
    fn from_value(key: &str, value: &Value) -> Result<Self, GgufError> {
        value
            .as_float()
            .ok_or_else(|| wrong_type(key, "f64", value))
    }
}

impl FromValue<'_> for bool {
    const EXPECTED: &'static str = "bool";
    fn from_value(key: &str, value: &Value) -> Result<Self, GgufError> {
        match value {
            Value::Bool(b) => Ok(*b),
            other => Err(wrong_type(key, "bool", other)),
        }
    }
}

/// A borrow of the value one variant holds.
macro_rules! borrowed_variant {
    ($ty:ty, $variant:ident, $expected:literal) => {
        impl<'a> FromValue<'a> for $ty {
            const EXPECTED: &'static str = $expected;
            fn from_value(key: &str, value: &'a Value) -> Result<Self, GgufError> {
                match value {
                    Value::$variant(v) => Ok(v),
                    other => Err(wrong_type(key, $expected, other)),
                }
            }
        }
    };
}

borrowed_variant!(&'a str, String, "string");
borrowed_variant!(&'a Array, Array, "array");

/// The key-value metadata of a GGUF file, in file order, with lookup by key.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    /// An empty set.
    pub fn new() -> Metadata {
        Metadata::default()
    }

    /// Adds a key, refusing one already present.
    pub fn insert(&mut self, key: String, value: Value) -> Result<(), GgufError> {
        if self.index.contains_key(&key) {
            return Err(GgufError::DuplicateKey { key });
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        Ok(())
    }

    /// Replaces the value of `key`, or adds it.
    pub fn set(&mut self, key: &str, value: Value) {
        match self.index.get(key) {
            Some(&i) => self.entries[i].1 = value,
            None => {
                self.index.insert(key.to_owned(), self.entries.len());
                self.entries.push((key.to_owned(), value));
            }
        }
    }

    /// The raw value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// True when `key` is present.
    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// `key` converted to `T`; an error names the key when it is missing or of another type.
    pub fn get_as<'a, T: FromValue<'a>>(&'a self, key: &str) -> Result<T, GgufError> {
        let value = self.get(key).ok_or_else(|| GgufError::MissingKey {
            key: key.to_owned(),
        })?;
        T::from_value(key, value)
    }

    /// Like [`Metadata::get_as`], but a missing key is `Ok(None)`.
    pub fn get_opt<'a, T: FromValue<'a>>(&'a self, key: &str) -> Result<Option<T>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => T::from_value(key, value).map(Some),
        }
    }

    /// `key` as a u32 (any integer type that fits).
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.get_as(key)
    }

    /// `key` as a u64 (any integer type that fits).
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.get_as(key)
    }

    /// `key` as an f32 (f32 or f64).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.get_as(key)
    }

    /// `key` as a bool.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        self.get_as(key)
    }

    /// `key` as a string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.get_as(key)
    }

    /// `key` as an array of any element type.
    pub fn get_array(&self, key: &str) -> Result<&Array, GgufError> {
        self.get_as(key)
    }

    /// `key` as an array of strings.
    pub fn get_string_array(&self, key: &str) -> Result<&StringArray, GgufError> {
        match self.get_array(key)? {
            Array::String(v) => Ok(v),
            other => Err(array_type(key, "array of string", other)),
        }
    }

    /// `key` as an array of f32.
    pub fn get_f32_array(&self, key: &str) -> Result<&[f32], GgufError> {
        match self.get_array(key)? {
            Array::F32(v) => Ok(v),
            other => Err(array_type(key, "array of f32", other)),
        }
    }

    /// `key` as an array of i32.
    pub fn get_i32_array(&self, key: &str) -> Result<&[i32], GgufError> {
        match self.get_array(key)? {
            Array::I32(v) => Ok(v),
            other => Err(array_type(key, "array of i32", other)),
        }
    }

    /// The entries in file order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn array_type(key: &str, expected: &'static str, found: &Array) -> GgufError {
    // Arrays of the wrong element type are reported with the element type found.
    GgufError::WrongType {
        key: key.to_owned(),
        expected,
        found: found.element_type(),
    }
}

macro_rules! value_from {
    ($($t:ty => $variant:ident),*) => {$(
        impl From<$t> for Value {
            fn from(v: $t) -> Value {
                Value::$variant(v)
            }
        }
    )*};
}
value_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => String, Array => Array, u64 => U64, i64 => I64, f64 => F64);

impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::String(v.to_owned())
    }
}

macro_rules! array_from {
    ($($t:ty => $variant:ident),*) => {$(
        impl From<Vec<$t>> for Value {
            fn from(v: Vec<$t>) -> Value {
                Value::Array(Array::$variant(v))
            }
        }
    )*};
}
array_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, Array => Array, u64 => U64, i64 => I64, f64 => F64);

impl From<Vec<String>> for Value {
    fn from(v: Vec<String>) -> Value {
        Value::Array(Array::String(v.into()))
    }
}

impl From<StringArray> for Value {
    fn from(v: StringArray) -> Value {
        Value::Array(Array::String(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_access_accepts_any_width_that_fits() {
        let mut m = Metadata::new();
        m.insert("a".into(), Value::U64(7)).unwrap();
        m.insert("b".into(), Value::I32(-1)).unwrap();
        m.insert("c".into(), Value::String("x".into())).unwrap();
        assert_eq!(m.get_u32("a"), Ok(7));
        assert!(matches!(
            m.get_u32("b"),
            Err(GgufError::ValueOutOfRange { ref key, .. }) if key == "b"
        ));
        assert!(matches!(
            m.get_u32("c"),
            Err(GgufError::WrongType {
                expected: "u32",
                found: ValueType::String,
                ..
            })
        ));
        assert!(matches!(m.get_u32("d"), Err(GgufError::MissingKey { .. })));
        assert_eq!(m.get_opt::<u32>("d"), Ok(None));
    }

    #[test]
    fn duplicate_insert_is_refused() {
        let mut m = Metadata::new();
        m.insert("k".into(), Value::Bool(true)).unwrap();
        assert!(matches!(
            m.insert("k".into(), Value::Bool(false)),
            Err(GgufError::DuplicateKey { .. })
        ));
    }
}
