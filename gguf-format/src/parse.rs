//! Parsing a GGUF file from bytes.
//!
//! Every number read from the file is treated as hostile: counts and lengths are bounded
//! by a named cap and by the bytes actually left before anything is allocated, all size
//! arithmetic is checked, and slices are taken with `get`.

use crate::string_array::StringArrayBuilder;
use crate::value::{Array, Metadata, Value, ValueType};
use crate::{GgmlType, GgufError};

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of each tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that sets the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// Most tensors a file may declare.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most metadata entries a file may declare.
pub const MAX_METADATA: u64 = 1 << 16;
/// Longest string value (chat templates are the longest seen, tens of KiB).
pub const MAX_STRING_LEN: u64 = 16 << 20;
/// Longest metadata key.
pub const MAX_KEY_LEN: u64 = 1 << 16;
/// Longest tensor name: ggml's `GGML_MAX_NAME` is 64 bytes including the terminator.
pub const MAX_TENSOR_NAME_LEN: u64 = 63;
/// Most elements in one metadata array.
pub const MAX_ARRAY_LEN: u64 = 1 << 28;
/// Deepest nesting of arrays of arrays.
pub const MAX_ARRAY_DEPTH: usize = 8;
/// Most dimensions of a tensor (`GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Largest alignment accepted.
pub const MAX_ALIGNMENT: u64 = 1 << 20;

/// One tensor's entry in the file: what it is and where its bytes lie.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Its element type.
    pub ggml_type: GgmlType,
    /// Dimensions in the file's order: `shape[0]` (ne0) is the contiguous one.
    pub shape: Vec<u64>,
    /// Offset of its first byte from the start of the data section.
    pub offset: u64,
    /// Its size in bytes.
    pub size: u64,
}

impl TensorInfo {
    /// Number of elements (the product of the shape; 1 for a scalar).
    pub fn n_elements(&self) -> u64 {
        // Checked at parse time: the product does not overflow.
        self.shape.iter().product()
    }
}

/// A parsed GGUF file: everything but the tensor data, which the caller reads or maps.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufFile {
    /// 2 or 3.
    pub version: u32,
    /// Alignment of the data section and of each tensor's offset.
    pub alignment: u64,
    /// Key-value metadata in file order.
    pub metadata: Metadata,
    /// Tensor entries in file order.
    pub tensors: Vec<TensorInfo>,
    /// Absolute offset of the data section in the file.
    pub data_offset: u64,
}

impl GgufFile {
    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The absolute byte range of `tensor` in the file.
    pub fn tensor_range(&self, tensor: &TensorInfo) -> std::ops::Range<u64> {
        // Checked at parse time: these sums lie inside the file.
        let start = self.data_offset + tensor.offset;
        start..start + tensor.size
    }

    /// `general.architecture`, when present and a string.
    pub fn architecture(&self) -> Option<&str> {
        self.metadata.get_str("general.architecture").ok()
    }
}

/// Parses a whole GGUF file held in memory.
pub fn parse(bytes: &[u8]) -> Result<GgufFile, GgufError> {
    parse_prefix(bytes, bytes.len() as u64)
}

/// Parses the header, metadata and tensor infos from the first bytes of a file of
/// `file_len` bytes. Tensor ranges are checked against `file_len`.
///
/// When `prefix` is too short, the error is [`GgufError::UnexpectedEof`] with the offset
/// and size that were needed: a reader can fetch more and try again.
pub fn parse_prefix(prefix: &[u8], file_len: u64) -> Result<GgufFile, GgufError> {
    let mut r = Reader::new(prefix, file_len);
    let magic = r.array::<4>()?;
    // The magic alone tells a file of another format: say so without asking for more.
    if magic != MAGIC && magic != *b"FUGG" {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version_bytes = r.array::<4>()?;
    let version = u32::from_le_bytes(version_bytes);
    if magic != MAGIC {
        return Err(GgufError::BigEndian {
            version: u32::from_be_bytes(version_bytes),
        });
    }
    match version {
        2 | 3 => {}
        1 => return Err(GgufError::VersionOne),
        // A big-endian writer puts a small version's zero bytes first; zero itself is
        // just an unknown version.
        v if v != 0 && v & 0xffff == 0 => {
            return Err(GgufError::BigEndian {
                version: v.swap_bytes(),
            })
        }
        v => return Err(GgufError::UnsupportedVersion { version: v }),
    }

    let n_tensors = r.u64()?;
    let n_metadata = r.u64()?;
    // A tensor info takes at least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset)
    // bytes; a metadata entry at least 8 (key length) + 1 (a key byte) + 4 (type) + 1.
    r.check_count("tensor", n_tensors, MAX_TENSORS, 24)?;
    r.check_count("metadata", n_metadata, MAX_METADATA, 14)?;

    let mut metadata = Metadata::new();
    for _ in 0..n_metadata {
        let key_offset = r.offset();
        let key = r.string(MAX_KEY_LEN)?;
        if key.is_empty() {
            return Err(GgufError::EmptyKey { offset: key_offset });
        }
        let value_type = r.value_type(&key)?;
        let value = r.value(&key, value_type)?;
        metadata.insert(key, value)?;
    }
    let alignment = alignment_of(&metadata)?;

    // The count is bounded by the whole file's length, but only the prefix in hand has
    // been seen: reserve no more than it could describe, and grow as entries arrive.
    let mut tensors = Vec::with_capacity(n_tensors.min(r.remaining() / 24) as usize);
    for _ in 0..n_tensors {
        tensors.push(r.tensor_info()?);
    }
    let data_offset = align_up(r.offset(), alignment).ok_or(GgufError::UnexpectedEof {
        offset: r.offset(),
        needed: alignment,
        available: 0,
    })?;
    check_tensor_layout(&tensors, alignment, data_offset, file_len)?;

    Ok(GgufFile {
        version,
        alignment,
        metadata,
        tensors,
        data_offset,
    })
}

fn alignment_of(metadata: &Metadata) -> Result<u64, GgufError> {
    let alignment = match metadata.get(ALIGNMENT_KEY) {
        None => return Ok(DEFAULT_ALIGNMENT),
        Some(Value::U32(a)) => u64::from(*a),
        Some(other) => {
            return Err(GgufError::AlignmentType {
                found: other.value_type(),
            })
        }
    };
    if !alignment.is_power_of_two() || alignment > MAX_ALIGNMENT {
        return Err(GgufError::InvalidAlignment {
            value: alignment,
            max: MAX_ALIGNMENT,
        });
    }
    Ok(alignment)
}

/// Rounds `offset` up to a multiple of `alignment` (a power of two).
pub(crate) fn align_up(offset: u64, alignment: u64) -> Option<u64> {
    Some(offset.checked_add(alignment - 1)? & !(alignment - 1))
}

/// Every tensor aligned, inside the file, and no two sharing a byte; no duplicate names.
fn check_tensor_layout(
    tensors: &[TensorInfo],
    alignment: u64,
    data_offset: u64,
    file_len: u64,
) -> Result<(), GgufError> {
    let mut names = std::collections::HashSet::with_capacity(tensors.len());
    for t in tensors {
        if !names.insert(t.name.as_str()) {
            return Err(GgufError::DuplicateTensor {
                tensor: t.name.clone(),
            });
        }
        if t.offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                tensor: t.name.clone(),
                offset: t.offset,
                alignment,
            });
        }
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.size));
        match (start, end) {
            (Some(_), Some(end)) if end <= file_len => {}
            _ => {
                return Err(GgufError::TensorOutOfBounds {
                    tensor: t.name.clone(),
                    start: data_offset.saturating_add(t.offset),
                    end: data_offset.saturating_add(t.offset).saturating_add(t.size),
                    file_len,
                })
            }
        }
    }
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().filter(|t| t.size > 0).collect();
    by_offset.sort_by_key(|t| t.offset);
    for pair in by_offset.windows(2) {
        // In bounds, so the sum cannot overflow.
        if pair[0].offset + pair[0].size > pair[1].offset {
            return Err(GgufError::TensorOverlap {
                first: pair[0].name.clone(),
                second: pair[1].name.clone(),
            });
        }
    }
    Ok(())
}

/// A bounds-checked little-endian cursor over the file's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Length of the whole file, of which `bytes` may be only a prefix.
    file_len: u64,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], file_len: u64) -> Reader<'a> {
        Reader {
            bytes,
            pos: 0,
            file_len,
        }
    }

    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], GgufError> {
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| self.pos.checked_add(n));
        let Some(slice) = end.and_then(|end| self.bytes.get(self.pos..end)) else {
            return Err(GgufError::UnexpectedEof {
                offset: self.offset(),
                needed: n,
                available: self.remaining(),
            });
        };
        self.pos += slice.len();
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let slice = self.take(N as u64)?;
        let mut out = [0u8; N];
        out.copy_from_slice(slice);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, GgufError> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        self.array().map(u64::from_le_bytes)
    }

    /// The type id of `key`'s value (or of its array's elements), refused when unknown.
    fn value_type(&mut self, key: &str) -> Result<ValueType, GgufError> {
        let offset = self.offset();
        let type_id = self.u32()?;
        ValueType::from_id(type_id).ok_or(GgufError::UnknownValueType {
            key: key.to_owned(),
            type_id,
            offset,
        })
    }

    /// Bytes left in the whole file after the cursor (the prefix may hold fewer).
    fn remaining_in_file(&self) -> u64 {
        self.file_len.max(self.bytes.len() as u64) - self.offset()
    }

    /// Refuses `count` items of at least `min_size` bytes each when they cannot fit in
    /// what is left of the file, or exceed `max`.
    fn check_count(
        &self,
        what: &'static str,
        count: u64,
        max: u64,
        min_size: u64,
    ) -> Result<(), GgufError> {
        if count > max {
            return Err(GgufError::CountTooLarge { what, count, max });
        }
        if count.saturating_mul(min_size) > self.remaining_in_file() {
            return Err(GgufError::CountExceedsFile {
                what,
                count,
                offset: self.offset(),
                remaining: self.remaining_in_file(),
            });
        }
        Ok(())
    }

    fn string(&mut self, max: u64) -> Result<String, GgufError> {
        let offset = self.offset();
        let bytes = self.bounded_bytes(max)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 { offset })
    }

    /// The `len` bytes of a string whose length prefix stood at `offset`.
    fn string_body(&mut self, len: u64, offset: u64) -> Result<String, GgufError> {
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 { offset })
    }

    fn value(&mut self, key: &str, value_type: ValueType) -> Result<Value, GgufError> {
        Ok(match value_type {
            ValueType::U8 => Value::U8(self.u8()?),
            ValueType::I8 => Value::I8(self.u8()? as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array()?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array()?)),
            ValueType::U32 => Value::U32(self.u32()?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array()?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array()?)),
            ValueType::Bool => Value::Bool(self.bool(key)?),
            ValueType::String => Value::String(self.string(MAX_STRING_LEN)?),
            ValueType::Array => Value::Array(self.array_value(key, 1)?),
            ValueType::U64 => Value::U64(self.u64()?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array()?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array()?)),
        })
    }

    fn bool(&mut self, key: &str) -> Result<bool, GgufError> {
        let offset = self.offset();
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(GgufError::InvalidBool {
                key: key.to_owned(),
                value,
                offset,
            }),
        }
    }

    fn array_value(&mut self, key: &str, depth: usize) -> Result<Array, GgufError> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep {
                key: key.to_owned(),
                depth,
                max: MAX_ARRAY_DEPTH,
            });
        }
        let element_type = self.value_type(key)?;
        let len = self.u64()?;
        self.check_count(
            "array element",
            len,
            MAX_ARRAY_LEN,
            element_type.min_encoded_size(),
        )?;
        // Bounded above by the bytes left, so this allocation is proportional to the input.
        let n = len as usize;
        Ok(match element_type {
            ValueType::U8 => Array::U8(self.take(len)?.to_vec()),
            ValueType::I8 => Array::I8(self.take(len)?.iter().map(|&b| b as i8).collect()),
            ValueType::U16 => Array::U16(self.fixed(n, u16::from_le_bytes)?),
            ValueType::I16 => Array::I16(self.fixed(n, i16::from_le_bytes)?),
            ValueType::U32 => Array::U32(self.fixed(n, u32::from_le_bytes)?),
            ValueType::I32 => Array::I32(self.fixed(n, i32::from_le_bytes)?),
            ValueType::F32 => Array::F32(self.fixed(n, f32::from_le_bytes)?),
            ValueType::U64 => Array::U64(self.fixed(n, u64::from_le_bytes)?),
            ValueType::I64 => Array::I64(self.fixed(n, i64::from_le_bytes)?),
            ValueType::F64 => Array::F64(self.fixed(n, f64::from_le_bytes)?),
            ValueType::Bool => {
                Array::Bool((0..n).map(|_| self.bool(key)).collect::<Result<_, _>>()?)
            }
            ValueType::String => Array::String(self.string_array(n)?),
            ValueType::Array => Array::Array(
                (0..n)
                    .map(|_| self.array_value(key, depth + 1))
                    .collect::<Result<_, _>>()?,
            ),
        })
    }

    /// `n` strings, one after another, into one buffer; UTF-8 is checked once for all
    /// of them.
    fn string_array(&mut self, n: usize) -> Result<crate::StringArray, GgufError> {
        let first = self.pos;
        // A first pass over the lengths: every string is within the cap and within the
        // bytes in hand before anything is allocated or copied, and the buffer gets its
        // exact size. A prefix that ends inside the array costs no more than this pass.
        let mut n_bytes = 0;
        for _ in 0..n {
            n_bytes += self.bounded_bytes(MAX_STRING_LEN)?.len();
        }
        self.pos = first;
        let mut builder = StringArrayBuilder::with_capacity(n, n_bytes);
        for _ in 0..n {
            let start = self.pos + 8;
            let bytes = self.bounded_bytes(MAX_STRING_LEN)?;
            // What follows a string in the file (the next one's length, at least) lets
            // the builder copy short strings as fixed-size blocks.
            let followed = self.bytes.get(start..).unwrap_or(bytes);
            builder.push_bytes(bytes, followed);
        }
        builder.finish().map_err(|invalid| GgufError::InvalidUtf8 {
            // Each string before it took its 8-byte length and its bytes: no overflow,
            // they lie inside the bytes in hand.
            offset: first as u64 + 8 * invalid.index as u64 + invalid.start as u64,
        })
    }

    /// A string's bytes, unchecked as UTF-8, after its length, which must not exceed `max`.
    fn bounded_bytes(&mut self, max: u64) -> Result<&'a [u8], GgufError> {
        let offset = self.offset();
        let len = self.u64()?;
        if len > max {
            return Err(GgufError::StringTooLong { len, max, offset });
        }
        self.take(len)
    }

    fn fixed<T, const N: usize>(
        &mut self,
        n: usize,
        convert: fn([u8; N]) -> T,
    ) -> Result<Vec<T>, GgufError> {
        let bytes = self.take((n as u64).saturating_mul(N as u64))?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                convert(a)
            })
            .collect())
    }

    fn tensor_info(&mut self) -> Result<TensorInfo, GgufError> {
        let name_offset = self.offset();
        let len = self.u64()?;
        if len > MAX_TENSOR_NAME_LEN {
            return Err(GgufError::TensorNameTooLong {
                len,
                max: MAX_TENSOR_NAME_LEN,
                offset: name_offset,
            });
        }
        let name = self.string_body(len, name_offset)?;
        let n_dims = self.u32()?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                tensor: name,
                n_dims,
                max: MAX_DIMS,
            });
        }
        let shape = (0..n_dims)
            .map(|_| self.u64())
            .collect::<Result<Vec<_>, _>>()?;
        let type_id = self.u32()?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
            tensor: name.clone(),
            type_id,
        })?;
        let offset = self.u64()?;
        let size = tensor_size(&name, ggml_type, &shape)?;
        Ok(TensorInfo {
            name,
            ggml_type,
            shape,
            offset,
            size,
        })
    }
}

/// Bytes taken by a tensor of this type and shape, refusing partial blocks and overflow.
///
/// ggml holds dimensions and element counts as `i64`: each dimension and their product
/// must fit there, even when another dimension is zero.
pub(crate) fn tensor_size(
    name: &str,
    ggml_type: GgmlType,
    shape: &[u64],
) -> Result<u64, GgufError> {
    const MAX_ELEMENTS: u64 = i64::MAX as u64;
    let overflow = || GgufError::ShapeOverflow {
        tensor: name.to_owned(),
        shape: shape.to_vec(),
    };
    if shape.iter().any(|&d| d > MAX_ELEMENTS) {
        return Err(overflow());
    }
    let n_elements = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= MAX_ELEMENTS)
        .ok_or_else(overflow)?;
    let ne0 = shape.first().copied().unwrap_or(1);
    if ne0 % ggml_type.block_size() != 0 {
        return Err(GgufError::PartialBlock {
            tensor: name.to_owned(),
            ggml_type,
            ne0,
            block_size: ggml_type.block_size(),
        });
    }
    ggml_type.row_bytes(n_elements).ok_or_else(overflow)
}
