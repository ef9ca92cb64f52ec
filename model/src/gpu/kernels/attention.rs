//! The typed wrappers of `kernels/attention.hip`'s launchers: attention of a few queries
//! against the KV cache, split along the keys, and the shapes both attention kernels
//! take; the rotation that turns a quantized value cache's output back.

#[cfg(hip_platform = "none")]
use hip_backend::HipError;
use hip_backend::{DeviceView, DeviceViewMut, Stream};

#[cfg(not(hip_platform = "none"))]
use super::sys;
use crate::kv_type::KvTypes;

use super::{
    cache_code, check_caches, expect, expect_at_least, on_device, ptr_or_null, q8_bytes, small,
    soft_cap, CacheView, KernelError, Pages,
};

/// Most keys a chunk of [`attention`]'s split along the cache may hold.
pub const MAX_ATTENTION_CHUNK: usize = 256;

/// Keys per chunk of [`attention`] for a cache of `capacity` positions: the smallest of
/// 32, 64, 128 and 256 that splits it into at most 64 chunks. A query is computed by one
/// workgroup per chunk that holds its keys, so small chunks spread a short context over
/// many workgroups, while the merge of a long context's chunks stays short.
pub fn attention_chunk(capacity: usize) -> usize {
    [32, 64, 128]
        .into_iter()
        .find(|&chunk| capacity.div_ceil(chunk) <= 64)
        .unwrap_or(MAX_ATTENTION_CHUNK)
}

/// Shapes of [`attention`].
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    /// Keys more than `window - 1` positions back are masked; `None`: causal only.
    pub window: Option<usize>,
    pub scale: f32,
    /// Scores `s` become `cap · tanh(s · (1/cap))` before the scale (Gemma 2).
    pub softcap: Option<f32>,
    /// Chunks the cache can hold, of `chunk` keys each.
    pub n_chunks: usize,
    /// Keys per chunk (at most [`MAX_ATTENTION_CHUNK`]).
    pub chunk: usize,
    /// Whether f16 caches whose key and value heads are 32, 64 or 128 values wide take
    /// the kernel that gives each 32-lane group blocks of 32 keys, a key a lane, in
    /// chunks of at least 128 keys (`GpuTuning::warp_attention`); otherwise, or for other
    /// caches, the kernel that spreads each key over a few lanes.
    pub warps: bool,
}

impl AttentionShape {
    /// Scratch values of the per-chunk maxima and sums (`2` per chunk, head and token).
    pub fn ml_len(&self, n_tokens: usize) -> usize {
        2 * n_tokens * self.n_heads * self.n_chunks
    }

    /// Scratch values of the per-chunk weighted values.
    pub fn acc_len(&self, n_tokens: usize) -> usize {
        n_tokens * self.n_heads * self.n_chunks * self.head_dim_v
    }

    /// Counters of finished chunks, one per query (token and head).
    pub fn done_len(&self, n_tokens: usize) -> usize {
        n_tokens * self.n_heads
    }

    /// Positions the caches hold: whole chunks.
    pub fn positions(&self) -> usize {
        self.n_chunks * self.chunk
    }
}

/// Attention of `n_tokens` queries at positions `pos[0]..` (or, with `pages`, at the
/// positions and against the blocks it gives; each query sees the keys up to its own
/// position) against the caches (f16 or quantized, of any types: the key type's
/// values meet the queries, the value type's are summed, and the output of a value
/// cache that holds rotated values is turned back); `out` gets `n_tokens × n_heads ×
/// head_dim_v` values, and `out_q8` (when given; `head_dim_v` a multiple of 32) the same
/// as Q8 activation blocks. `done` must hold zeros, and is left so. `sinks` (one logit
/// per query head) join each softmax's denominator.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: DeviceView<'_, f32>,
    k_cache: CacheView<'_>,
    v_cache: CacheView<'_>,
    shape: &AttentionShape,
    sinks: Option<DeviceView<'_, f32>>,
    n_tokens: usize,
    pos: DeviceView<'_, i32>,
    pages: Option<Pages<'_>>,
    mut part_ml: DeviceViewMut<'_, f32>,
    mut part_acc: DeviceViewMut<'_, f32>,
    mut done: DeviceViewMut<'_, u32>,
    mut out: DeviceViewMut<'_, f32>,
    mut out_q8: Option<DeviceViewMut<'_, u8>>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "attention";
    let s = shape;
    expect_at_least(K, "256 values per query head", 256, s.head_dim)?;
    expect_at_least(K, "256 values per value head", 256, s.head_dim_v)?;
    expect(K, "the query head's width modulo 8", s.head_dim % 8, 0)?;
    expect(K, "the value head's width modulo 2", s.head_dim_v % 2, 0)?;
    expect(K, "heads per key head", s.n_heads % s.n_kv_heads.max(1), 0)?;
    expect(K, "the queries", q.len(), n_tokens * s.n_heads * s.head_dim)?;
    expect_at_least(K, "256 keys per chunk", MAX_ATTENTION_CHUNK, s.chunk)?;
    expect_at_least(K, "keys per chunk", s.chunk, 1)?;
    check_caches(K, s, &k_cache, &v_cache, pos.len())?;
    expect(K, "the chunk maxima", part_ml.len(), s.ml_len(n_tokens))?;
    expect(K, "the chunk sums", part_acc.len(), s.acc_len(n_tokens))?;
    expect(K, "the chunk counters", done.len(), s.done_len(n_tokens))?;
    expect(
        K,
        "the output",
        out.len(),
        n_tokens * s.n_heads * s.head_dim_v,
    )?;
    let mut devices = vec![
        q.device_ordinal(),
        k_cache.bytes.device_ordinal(),
        v_cache.bytes.device_ordinal(),
        pos.device_ordinal(),
        part_ml.device_ordinal(),
        part_acc.device_ordinal(),
        done.device_ordinal(),
        out.device_ordinal(),
    ];
    if let Some(p) = &pages {
        devices.extend(p.check(K, n_tokens)?);
    }
    if let Some(q8) = &out_q8 {
        expect(K, "the value head's width modulo 32", s.head_dim_v % 32, 0)?;
        expect(
            K,
            "the Q8 output",
            q8.len(),
            q8_bytes(n_tokens, s.n_heads * s.head_dim_v),
        )?;
        devices.push(q8.device_ordinal());
    }
    if let Some(sinks) = &sinks {
        expect(K, "the sinks (one per head)", sinks.len(), s.n_heads)?;
        devices.push(sinks.device_ordinal());
    }
    let device = on_device(stream, &devices)?;
    let softcap = soft_cap(K, s.softcap)?;
    let q8_ptr = out_q8
        .as_mut()
        .map_or(std::ptr::null_mut(), |o| o.as_mut_ptr());
    let c = |what, value| small(K, what, value);
    launch!(
        rf_attention,
        "attention",
        q.as_ptr(),
        k_cache.bytes.as_ptr(),
        v_cache.bytes.as_ptr(),
        cache_code(k_cache.ty),
        cache_code(v_cache.ty),
        c("cache positions", k_cache.positions)?,
        v_rotation(&k_cache, &v_cache, s.head_dim_v),
        c("tokens", n_tokens)?,
        c("heads", s.n_heads)?,
        c("key heads", s.n_kv_heads)?,
        c("head width", s.head_dim)?,
        c("value head width", s.head_dim_v)?,
        c("window", s.window.unwrap_or(0))?,
        s.scale,
        softcap,
        ptr_or_null(sinks),
        c("chunks", s.n_chunks)?,
        c("keys per chunk", s.chunk)?,
        pos.as_ptr(),
        Pages::raw(pages)[0],
        Pages::raw(pages)[1],
        Pages::raw(pages)[2],
        pages.map_or(0, |p| p.block_shift as i32),
        part_ml.as_mut_ptr(),
        part_acc.as_mut_ptr(),
        done.as_mut_ptr(),
        out.as_mut_ptr(),
        q8_ptr,
        i32::from(s.warps),
        device,
        stream.as_raw(),
    )
}

/// `x` (a multiple of 64 values) multiplied in runs of 64 by the normalised 64 × 64
/// Walsh-Hadamard matrix, in place: the attention's output over a quantized value cache
/// (which holds values so rotated) turned back, as the CPU's `kv_type::fwht` does.
pub fn hadamard64(mut x: DeviceViewMut<'_, f32>, stream: &Stream) -> Result<(), KernelError> {
    const K: &str = "hadamard64";
    expect(K, "the values modulo 64", x.len() % 64, 0)?;
    let device = on_device(stream, &[x.device_ordinal()])?;
    let n = x.len();
    launch!(
        rf_hadamard64,
        "hadamard64",
        x.as_mut_ptr(),
        n,
        device,
        stream.as_raw()
    )
}

/// The run of the rotation a value cache of `v`'s type holds, as the kernels take it
/// (0: none).
fn v_rotation(k: &CacheView<'_>, v: &CacheView<'_>, head_dim_v: usize) -> i32 {
    let types = KvTypes { k: k.ty, v: v.ty };
    types.v_rotation(head_dim_v).map_or(0, |n| n as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_chunks_grow_with_the_context_up_to_the_kernel_limit() {
        assert_eq!(attention_chunk(1), 32);
        assert_eq!(attention_chunk(129), 32);
        assert_eq!(attention_chunk(2048), 32);
        assert_eq!(attention_chunk(2049), 64);
        assert_eq!(attention_chunk(4096), 64);
        assert_eq!(attention_chunk(8192), 128);
        assert_eq!(attention_chunk(16384), 256);
        assert_eq!(attention_chunk(1 << 20), MAX_ATTENTION_CHUNK);
        for capacity in [1, 100, 5000, 40000] {
            let chunk = attention_chunk(capacity);
            assert!(capacity.div_ceil(chunk) <= 64 || chunk == MAX_ATTENTION_CHUNK);
        }
    }
}
