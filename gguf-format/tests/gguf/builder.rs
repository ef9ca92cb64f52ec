//! A small builder of GGUF bytes by hand, so that tests can write exactly the malformed
//! file they need.

use gguf_format::ValueType;

/// Bytes under construction, in GGUF's little-endian encoding.
#[derive(Clone, Debug, Default)]
pub struct Bytes(pub Vec<u8>);

impl Bytes {
    /// `GGUF`, a version, and the two counts.
    pub fn header(version: u32, n_tensors: u64, n_metadata: u64) -> Bytes {
        Bytes::default()
            .raw(b"GGUF")
            .u32(version)
            .u64(n_tensors)
            .u64(n_metadata)
    }

    /// A version 3 header.
    pub fn v3(n_tensors: u64, n_metadata: u64) -> Bytes {
        Bytes::header(3, n_tensors, n_metadata)
    }

    pub fn raw(mut self, bytes: &[u8]) -> Bytes {
        self.0.extend_from_slice(bytes);
        self
    }

    pub fn u8(self, v: u8) -> Bytes {
        self.raw(&[v])
    }

    pub fn u32(self, v: u32) -> Bytes {
        self.raw(&v.to_le_bytes())
    }

    pub fn u64(self, v: u64) -> Bytes {
        self.raw(&v.to_le_bytes())
    }

    /// A GGUF string: its length as a u64, then its bytes (which need not be UTF-8).
    pub fn string(self, bytes: &[u8]) -> Bytes {
        self.u64(bytes.len() as u64).raw(bytes)
    }

    /// A metadata key and the type tag of the value that follows.
    pub fn key(self, key: &str, value_type: ValueType) -> Bytes {
        self.string(key.as_bytes()).u32(value_type.id())
    }

    pub fn kv_u32(self, key: &str, v: u32) -> Bytes {
        self.key(key, ValueType::U32).u32(v)
    }

    pub fn kv_str(self, key: &str, v: &str) -> Bytes {
        self.key(key, ValueType::String).string(v.as_bytes())
    }

    /// An array header: element type tag and element count.
    pub fn array_header(self, element_type: u32, len: u64) -> Bytes {
        self.u32(element_type).u64(len)
    }

    /// An array of GGUF strings: its header, then each element.
    pub fn strings(self, elements: &[&[u8]]) -> Bytes {
        let header = self.array_header(ValueType::String.id(), elements.len() as u64);
        elements.iter().fold(header, |b, e| b.string(e))
    }

    /// A tensor info: name, dimensions, ggml type id and data offset.
    pub fn tensor(self, name: &str, shape: &[u64], type_id: u32, offset: u64) -> Bytes {
        let mut b = self.string(name.as_bytes()).u32(shape.len() as u32);
        for &d in shape {
            b = b.u64(d);
        }
        b.u32(type_id).u64(offset)
    }

    /// Zero bytes up to the next multiple of `alignment`.
    pub fn pad_to(self, alignment: usize) -> Bytes {
        let n = self.0.len().next_multiple_of(alignment) - self.0.len();
        self.zeros(n)
    }

    pub fn zeros(self, n: usize) -> Bytes {
        self.raw(&vec![0; n])
    }

    pub fn len(&self) -> u64 {
        self.0.len() as u64
    }
}

/// The parse error for `bytes`, failing the test when they parse.
pub fn parse_err(bytes: &Bytes) -> gguf_format::GgufError {
    match gguf_format::parse(&bytes.0) {
        Ok(file) => panic!("expected an error, parsed {file:?}"),
        Err(e) => e,
    }
}

/// Asserts that `bytes` (a `&Bytes`) fail to parse with an error matching the pattern
/// (guard included); a different error is shown.
macro_rules! assert_parse_err {
    ($bytes:expr, $($pattern:tt)+) => {{
        let err = $crate::builder::parse_err($bytes);
        assert!(matches!(err, $($pattern)+), "{err:?}");
    }};
}
pub(crate) use assert_parse_err;

/// A file whose one metadata entry, `k`, is an array of `len` elements of type id
/// `element_type`: its header, the elements left to the caller.
pub fn one_array(element_type: u32, len: u64) -> Bytes {
    Bytes::v3(0, 1)
        .key("k", ValueType::Array)
        .array_header(element_type, len)
}

/// A file with no metadata whose tensors are the given infos `(name, shape, type id,
/// offset)`, followed by a data section of `data_len` bytes aligned to 32.
pub fn with_tensors(infos: &[(&str, &[u64], u32, u64)], data_len: usize) -> Bytes {
    let mut b = Bytes::v3(infos.len() as u64, 0);
    for &(name, shape, type_id, offset) in infos {
        b = b.tensor(name, shape, type_id, offset);
    }
    b.pad_to(32).zeros(data_len)
}

/// The id of F32 and of Q4_0, the plain and the block type most tests use.
pub const F32: u32 = 0;
pub const Q4_0: u32 = 2;
