//! Writing GGUF files.
//!
//! The writer lays out a file without doing I/O: [`GgufWriter::layout`] returns the
//! header bytes (padded up to the data section) and where each tensor's bytes go, so a
//! caller can stream multi-GiB tensor data to any sink; [`GgufWriter::to_bytes`] builds a
//! whole small file in memory.
//!
//! What the writer lays out, the parser reads back: it refuses, with the same errors and
//! the offsets the bytes would have had, whatever the parser would refuse (an empty or
//! over-long key, an over-long string or tensor name, arrays nested too deep, more
//! entries than the caps allow, a `general.alignment` that is not a valid u32).

use crate::parse::{
    align_up, tensor_size, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAX_ALIGNMENT, MAX_ARRAY_DEPTH,
    MAX_ARRAY_LEN, MAX_DIMS, MAX_KEY_LEN, MAX_METADATA, MAX_STRING_LEN, MAX_TENSORS,
    MAX_TENSOR_NAME_LEN,
};
use crate::value::{Array, Metadata, Value};
use crate::{GgmlType, GgufError};

/// A tensor declared to the writer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDecl {
    pub name: String,
    pub ggml_type: GgmlType,
    pub shape: Vec<u64>,
    /// Bytes its data takes, from its type and shape.
    pub size: u64,
}

/// Where everything goes in the written file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Header, metadata and tensor infos, zero-padded up to the data section.
    pub header: Vec<u8>,
    /// Offset of each tensor's data from the start of the data section, in declaration order.
    pub tensor_offsets: Vec<u64>,
    /// Total file length: the data section ends with the last tensor, padded to alignment.
    pub file_len: u64,
}

/// Builds a GGUF version 3 file.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Metadata,
    tensors: Vec<TensorDecl>,
    alignment: Option<u64>,
}

impl GgufWriter {
    /// An empty file: no metadata, no tensors, default alignment.
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Sets the alignment (a power of two), recorded as `general.alignment`.
    pub fn set_alignment(&mut self, alignment: u32) -> Result<(), GgufError> {
        let a = u64::from(alignment);
        if !a.is_power_of_two() || a > MAX_ALIGNMENT {
            return Err(GgufError::InvalidAlignment {
                value: a,
                max: MAX_ALIGNMENT,
            });
        }
        self.alignment = Some(a);
        self.metadata.set(ALIGNMENT_KEY, Value::U32(alignment));
        Ok(())
    }

    /// Adds a metadata entry; a key already present is refused, and so is a
    /// `general.alignment` that is not a u32 power of two.
    pub fn add_metadata(&mut self, key: &str, value: impl Into<Value>) -> Result<(), GgufError> {
        let value = value.into();
        if key == ALIGNMENT_KEY {
            if self.metadata.contains(key) {
                return Err(GgufError::DuplicateKey {
                    key: key.to_owned(),
                });
            }
            return match value {
                Value::U32(a) => self.set_alignment(a),
                other => Err(GgufError::AlignmentType {
                    found: other.value_type(),
                }),
            };
        }
        self.metadata.insert(key.to_owned(), value)
    }

    /// The metadata written so far.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Declares a tensor; its data is given later, in declaration order.
    pub fn add_tensor(
        &mut self,
        name: &str,
        ggml_type: GgmlType,
        shape: &[u64],
    ) -> Result<&TensorDecl, GgufError> {
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufError::DuplicateTensor {
                tensor: name.to_owned(),
            });
        }
        if shape.len() > MAX_DIMS as usize {
            return Err(GgufError::TooManyDims {
                tensor: name.to_owned(),
                n_dims: shape.len() as u32,
                max: MAX_DIMS,
            });
        }
        let size = tensor_size(name, ggml_type, shape)?;
        self.tensors.push(TensorDecl {
            name: name.to_owned(),
            ggml_type,
            shape: shape.to_vec(),
            size,
        });
        Ok(self.tensors.last().expect("just pushed"))
    }

    /// The tensors declared so far.
    pub fn tensors(&self) -> &[TensorDecl] {
        &self.tensors
    }

    fn alignment(&self) -> u64 {
        self.alignment.unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// Lays the file out: the header bytes and each tensor's offset in the data section.
    pub fn layout(&self) -> Result<Layout, GgufError> {
        let alignment = self.alignment();
        check_count("tensor", self.tensors.len(), MAX_TENSORS)?;
        check_count("metadata", self.metadata.len(), MAX_METADATA)?;
        let mut header = Vec::new();
        header.extend_from_slice(b"GGUF");
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in self.metadata.iter() {
            if key.is_empty() {
                return Err(GgufError::EmptyKey {
                    offset: header.len() as u64,
                });
            }
            put_bounded_string(&mut header, key, MAX_KEY_LEN)?;
            header.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut header, key, value)?;
        }
        let mut tensor_offsets = Vec::with_capacity(self.tensors.len());
        let mut next = 0u64;
        for t in &self.tensors {
            let len = t.name.len() as u64;
            if len > MAX_TENSOR_NAME_LEN {
                return Err(GgufError::TensorNameTooLong {
                    len,
                    max: MAX_TENSOR_NAME_LEN,
                    offset: header.len() as u64,
                });
            }
            put_string(&mut header, &t.name);
            header.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for d in &t.shape {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            header.extend_from_slice(&next.to_le_bytes());
            tensor_offsets.push(next);
            next = next
                .checked_add(t.size)
                .and_then(|end| align_up(end, alignment))
                .ok_or_else(|| GgufError::ShapeOverflow {
                    tensor: t.name.clone(),
                    shape: t.shape.clone(),
                })?;
        }
        let data_start = align_up(header.len() as u64, alignment).expect("header length is small");
        header.resize(data_start as usize, 0);
        // The data section fits in u64 on its own, but not always after the header.
        let file_len = data_start.checked_add(next).ok_or_else(|| {
            let last = self
                .tensors
                .last()
                .expect("a non-empty data section has a tensor");
            GgufError::ShapeOverflow {
                tensor: last.name.clone(),
                shape: last.shape.clone(),
            }
        })?;
        Ok(Layout {
            file_len,
            header,
            tensor_offsets,
        })
    }

    /// The whole file in memory, with `data[i]` holding the bytes of the i-th tensor.
    pub fn to_bytes(&self, data: &[&[u8]]) -> Result<Vec<u8>, GgufError> {
        if data.len() != self.tensors.len() {
            return Err(GgufError::DataCountMismatch {
                expected: self.tensors.len(),
                found: data.len(),
            });
        }
        for (t, d) in self.tensors.iter().zip(data) {
            if d.len() as u64 != t.size {
                return Err(GgufError::DataLengthMismatch {
                    tensor: t.name.clone(),
                    expected: t.size,
                    found: d.len() as u64,
                });
            }
        }
        let layout = self.layout()?;
        let mut out = layout.header;
        let data_start = out.len() as u64;
        for (offset, d) in layout.tensor_offsets.iter().zip(data) {
            out.resize((data_start + offset) as usize, 0);
            out.extend_from_slice(d);
        }
        out.resize(layout.file_len as usize, 0);
        Ok(out)
    }
}

fn check_count(what: &'static str, count: usize, max: u64) -> Result<(), GgufError> {
    let count = count as u64;
    if count > max {
        return Err(GgufError::CountTooLarge { what, count, max });
    }
    Ok(())
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Writes `s`, refusing one longer than the parser accepts.
fn put_bounded_string(out: &mut Vec<u8>, s: &str, max: u64) -> Result<(), GgufError> {
    let len = s.len() as u64;
    if len > max {
        return Err(GgufError::StringTooLong {
            len,
            max,
            offset: out.len() as u64,
        });
    }
    put_string(out, s);
    Ok(())
}

fn put_value(out: &mut Vec<u8>, key: &str, value: &Value) -> Result<(), GgufError> {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => return put_bounded_string(out, s, MAX_STRING_LEN),
        Value::Array(a) => return put_array(out, key, a, 1),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
    Ok(())
}

/// Writes an array nested `depth` deep (1 for a top-level value).
fn put_array(out: &mut Vec<u8>, key: &str, array: &Array, depth: usize) -> Result<(), GgufError> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep {
            key: key.to_owned(),
            depth,
            max: MAX_ARRAY_DEPTH,
        });
    }
    check_count("array element", array.len(), MAX_ARRAY_LEN)?;
    out.extend_from_slice(&array.element_type().id().to_le_bytes());
    out.extend_from_slice(&(array.len() as u64).to_le_bytes());
    macro_rules! each_le {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match array {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => each_le!(v),
        Array::U16(v) => each_le!(v),
        Array::I16(v) => each_le!(v),
        Array::U32(v) => each_le!(v),
        Array::I32(v) => each_le!(v),
        Array::F32(v) => each_le!(v),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => {
            for s in v.iter() {
                put_bounded_string(out, s, MAX_STRING_LEN)?;
            }
        }
        Array::Array(v) => {
            for a in v {
                put_array(out, key, a, depth + 1)?;
            }
        }
        Array::U64(v) => each_le!(v),
        Array::I64(v) => each_le!(v),
        Array::F64(v) => each_le!(v),
    }
    Ok(())
}
