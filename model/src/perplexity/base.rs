//! The base file of a KL-divergence run, in llama.cpp's format (`--kl-divergence-base`),
//! all numbers little-endian:
//!
//! - the 8 bytes `_logits_`;
//! - `n_ctx`, `n_vocab` and `n_chunk`, 32-bit integers;
//! - the text's first `n_chunk · n_ctx` tokens, 32-bit integers (before any BOS
//!   replaces a window's first token);
//! - per window, per scored position (`n_ctx - 1 - n_ctx / 2` of them), a row of
//!   [`row_len`] 16-bit words: the `f32` scale and the `f32` smallest log-probability,
//!   then each token's log-probability as `min + scale · q`, `q` a 16-bit integer
//!   (log-probabilities more than 16 below the largest are stored as the smallest), and
//!   a zero word when the vocabulary is odd.

use std::io::{Read, Write};

/// The file's first bytes.
pub const MAGIC: &[u8; 8] = b"_logits_";

/// Bytes before the tokens.
const HEADER_BYTES: u64 = 8 + 3 * 4;

/// What a base file can be wrong in.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BaseFileError {
    #[error("not a base file of log-probabilities (it does not start with `_logits_`)")]
    NotABaseFile,
    #[error("its header is cut short ({found} of {HEADER_BYTES} bytes)")]
    ShortHeader { found: u64 },
    #[error("its {field} is {value}: {reason}")]
    BadField {
        field: &'static str,
        value: i64,
        reason: &'static str,
    },
    #[error(
        "it has {found} bytes, but its header (n_ctx {n_ctx}, n_vocab {n_vocab}, \
         n_chunk {n_chunk}) makes it {expected} bytes"
    )]
    WrongSize {
        found: u64,
        expected: u64,
        n_ctx: usize,
        n_vocab: usize,
        n_chunk: usize,
    },
    #[error("its token {index} is {value}, not a token id")]
    BadToken { index: usize, value: i32 },
    #[error("all {n_chunk} windows were read already")]
    NoMoreChunks { n_chunk: usize },
    #[error("reading it: {0}")]
    Io(#[from] std::io::Error),
}

/// Words in one scored position's row: the two `f32` and the vocabulary, rounded up to
/// an even count.
pub fn row_len(n_vocab: usize) -> usize {
    2 * n_vocab.div_ceil(2) + 4
}

/// The file's size for its header's values, `None` past `u64`.
pub fn file_size(n_ctx: usize, n_vocab: usize, n_chunk: usize) -> Option<u64> {
    let n_ctx = n_ctx as u64;
    let scored = n_ctx.checked_sub(1 + n_ctx / 2)?;
    let tokens = n_ctx.checked_mul(n_chunk as u64)?.checked_mul(4)?;
    let rows = scored
        .checked_mul(n_chunk as u64)?
        .checked_mul(row_len(n_vocab) as u64)?
        .checked_mul(2)?;
    HEADER_BYTES.checked_add(tokens)?.checked_add(rows)
}

/// Writes the header and the tokens.
pub fn write_header(
    out: &mut dyn Write,
    n_ctx: usize,
    n_vocab: usize,
    tokens: &[u32],
) -> std::io::Result<()> {
    let n_chunk = tokens.len() / n_ctx;
    let int = |value: usize| {
        i32::try_from(value)
            .map(i32::to_le_bytes)
            .map_err(|_| std::io::Error::other(format!("{value} does not fit 32 bits")))
    };
    let mut bytes = Vec::with_capacity(HEADER_BYTES as usize + 4 * tokens.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&int(n_ctx)?);
    bytes.extend_from_slice(&int(n_vocab)?);
    bytes.extend_from_slice(&int(n_chunk)?);
    for &token in tokens {
        bytes.extend_from_slice(&token.to_le_bytes());
    }
    out.write_all(&bytes)
}

/// Writes rows of words.
pub fn write_rows(out: &mut dyn Write, rows: &[u16]) -> std::io::Result<()> {
    let bytes: Vec<u8> = rows.iter().flat_map(|w| w.to_le_bytes()).collect();
    out.write_all(&bytes)
}

/// The integer nearest to `x` (ties to even), by the addition of 1.5 · 2²³ that llama.cpp
/// uses; exact for |x| below 2²².
fn nearest_int(x: f32) -> i32 {
    let shifted = x + 12_582_912.0;
    (shifted.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// Stores `logits`' log-probabilities in `row` ([`row_len`] words) and returns
/// `-log p(token)`, both in `f32` as llama.cpp computes them when it writes a base file.
pub fn encode_row(logits: &[f32], token: usize, row: &mut [u16]) -> f32 {
    let mut max = logits[0];
    let mut min = logits[0];
    for &v in &logits[1..] {
        if max < v {
            max = v;
        }
        if v < min {
            min = v;
        }
    }
    if min < max - 16.0 {
        min = max - 16.0;
    }
    let sum = super::sum_exp(logits, max);
    let log_sum_exp = sum.ln() as f32;
    let min_log_prob = min - max - log_sum_exp;
    let scale = (max - min) / 65535.0;
    set_f32(row, 0, scale);
    set_f32(row, 1, min_log_prob);
    let words = &mut row[4..];
    if scale != 0.0 {
        let inv_scale = 1.0 / scale;
        for (q, &v) in words.iter_mut().zip(logits) {
            *q = if v > min {
                nearest_int(inv_scale * (v - min)) as u16
            } else {
                0
            };
        }
    } else {
        words[..logits.len()].fill(0);
    }
    words[logits.len()..].fill(0);
    max + log_sum_exp - logits[token]
}

fn set_f32(row: &mut [u16], at: usize, value: f32) {
    let bits = value.to_bits();
    row[2 * at] = bits as u16;
    row[2 * at + 1] = (bits >> 16) as u16;
}

/// A row's scale, smallest log-probability and quantized log-probabilities.
pub fn decode_row(row: &[u16]) -> (f32, f32, &[u16]) {
    let f = |at: usize| f32::from_bits(u32::from(row[2 * at]) | u32::from(row[2 * at + 1]) << 16);
    (f(0), f(1), &row[4..])
}

/// A base file's header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaseHeader {
    pub n_ctx: usize,
    pub n_vocab: usize,
    pub n_chunk: usize,
    /// `n_chunk · n_ctx` tokens.
    pub tokens: Vec<u32>,
}

/// Reads a base file: the header at once, then the windows' rows one by one.
pub struct BaseReader<R> {
    header: BaseHeader,
    reader: R,
    chunks_read: usize,
}

impl<R: Read> BaseReader<R> {
    /// Reads and checks the header of a file of `file_len` bytes; its size must be the
    /// one the header implies, which is checked before anything is allocated.
    pub fn open(mut reader: R, file_len: u64) -> Result<BaseReader<R>, BaseFileError> {
        let mut head = [0u8; HEADER_BYTES as usize];
        if file_len < HEADER_BYTES {
            if file_len >= 8 {
                reader.read_exact(&mut head[..8])?;
                if &head[..8] != MAGIC {
                    return Err(BaseFileError::NotABaseFile);
                }
            }
            return Err(BaseFileError::ShortHeader { found: file_len });
        }
        reader.read_exact(&mut head)?;
        if &head[..8] != MAGIC {
            return Err(BaseFileError::NotABaseFile);
        }
        let int = |at: usize| i32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
        // llama.cpp reads n_ctx as unsigned.
        let n_ctx = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
        let (n_vocab, n_chunk) = (int(12), int(16));
        if n_ctx < 3 {
            return Err(BaseFileError::BadField {
                field: "n_ctx",
                value: n_ctx as i64,
                reason: "a window must hold at least 3 tokens",
            });
        }
        if n_vocab < 1 {
            return Err(BaseFileError::BadField {
                field: "n_vocab",
                value: n_vocab.into(),
                reason: "a vocabulary has at least 1 token",
            });
        }
        if n_chunk < 1 {
            return Err(BaseFileError::BadField {
                field: "n_chunk",
                value: n_chunk.into(),
                reason: "there must be at least 1 window",
            });
        }
        let (n_vocab, n_chunk) = (n_vocab as usize, n_chunk as usize);
        let expected = file_size(n_ctx, n_vocab, n_chunk).unwrap_or(u64::MAX);
        if expected != file_len {
            return Err(BaseFileError::WrongSize {
                found: file_len,
                expected,
                n_ctx,
                n_vocab,
                n_chunk,
            });
        }
        let mut bytes = vec![0u8; n_ctx * n_chunk * 4];
        reader.read_exact(&mut bytes)?;
        let tokens = bytes
            .chunks_exact(4)
            .enumerate()
            .map(|(index, b)| {
                let value = i32::from_le_bytes(b.try_into().expect("4 bytes"));
                u32::try_from(value).map_err(|_| BaseFileError::BadToken { index, value })
            })
            .collect::<Result<Vec<u32>, _>>()?;
        Ok(BaseReader {
            header: BaseHeader {
                n_ctx,
                n_vocab,
                n_chunk,
                tokens,
            },
            reader,
            chunks_read: 0,
        })
    }

    pub fn header(&self) -> &BaseHeader {
        &self.header
    }

    /// The next window's rows, `scored · row_len` words, into `rows`.
    pub fn read_chunk(&mut self, rows: &mut Vec<u16>) -> Result<(), BaseFileError> {
        let h = &self.header;
        if self.chunks_read == h.n_chunk {
            return Err(BaseFileError::NoMoreChunks { n_chunk: h.n_chunk });
        }
        let words = (h.n_ctx - 1 - h.n_ctx / 2) * row_len(h.n_vocab);
        let mut bytes = vec![0u8; 2 * words];
        self.reader.read_exact(&mut bytes)?;
        rows.clear();
        rows.extend(
            bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]])),
        );
        self.chunks_read += 1;
        Ok(())
    }
}
