//! Writing GGUF files.
//!
//! The writer lays out a file without doing I/O: [`GgufWriter::layout`] returns the
//! header bytes (padded up to the data section) and where each tensor's bytes go, so a
//! caller can stream multi-GiB tensor data to any sink; [`GgufWriter::to_bytes`] builds a
//! whole small file in memory.

use crate::parse::{
    align_up, tensor_size, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAX_ALIGNMENT, MAX_DIMS,
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

    /// Adds a metadata entry; a key already present is refused.
    pub fn add_metadata(&mut self, key: &str, value: impl Into<Value>) -> Result<(), GgufError> {
        let value = value.into();
        if key == ALIGNMENT_KEY {
            if let Value::U32(a) = value {
                return self.set_alignment(a);
            }
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
        let mut header = Vec::new();
        header.extend_from_slice(b"GGUF");
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in self.metadata.iter() {
            put_string(&mut header, key);
            header.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut header, value);
        }
        let mut tensor_offsets = Vec::with_capacity(self.tensors.len());
        let mut next = 0u64;
        for t in &self.tensors {
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
        Ok(Layout {
            file_len: data_start + next,
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

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_string(out, s),
        Value::Array(a) => put_array(out, a),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}

fn put_array(out: &mut Vec<u8>, array: &Array) {
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
        Array::String(v) => v.iter().for_each(|s| put_string(out, s)),
        Array::Array(v) => v.iter().for_each(|a| put_array(out, a)),
        Array::U64(v) => each_le!(v),
        Array::I64(v) => each_le!(v),
        Array::F64(v) => each_le!(v),
    }
}
