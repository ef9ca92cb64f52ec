//! The typed wrapper of `kernels/flash_attention.hip`'s launcher: attention of a
//! prompt's chunk, tiled over queries and keys.

#[cfg(hip_platform = "none")]
use hip_backend::HipError;
use hip_backend::{DeviceView, DeviceViewMut, Stream};

#[cfg(not(hip_platform = "none"))]
use super::sys;
use super::{
    cache_code, check_caches, expect, expect_at_least, on_device, ptr_or_null, small, soft_cap,
    AttentionShape, CacheView, KernelError,
};

/// Attention of a prompt's `n_tokens` queries at positions `pos[0]..` (each seeing the
/// keys up to its own position, within `shape.window`) against the caches (f16 or
/// quantized: a tile of a quantized cache is expanded to f16 as it is staged), in one
/// launch tiled over queries and keys (an online softmax: no scratch, whatever the
/// number of queries). `out` gets `n_tokens × n_heads × head_dim_v` values, as
/// [`attention`](fn@super::attention) writes them; the caches must hold the keys and
/// values of every position up to the last query's. With `table` (one sequence's block
/// table and its block shift, as in [`Pages`](super::Pages)), key `j` is read from the
/// cache row the table gives. With `allow_mma`, heads of 32, 64 or 128 values (keys and
/// values alike) take the matrix units where the device has them (NVIDIA, compute
/// capability 8.0 and later). `sinks` (one logit per query head) join each softmax's
/// denominator.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention(
    q: DeviceView<'_, f32>,
    k_cache: CacheView<'_>,
    v_cache: CacheView<'_>,
    shape: &AttentionShape,
    sinks: Option<DeviceView<'_, f32>>,
    n_tokens: usize,
    pos: DeviceView<'_, i32>,
    table: Option<(DeviceView<'_, i32>, u32)>,
    mut out: DeviceViewMut<'_, f32>,
    allow_mma: bool,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "flash_attention";
    let s = shape;
    expect_at_least(K, "256 values per query head", 256, s.head_dim)?;
    expect_at_least(K, "256 values per value head", 256, s.head_dim_v)?;
    expect_at_least(K, "values per query head", s.head_dim, 8)?;
    expect_at_least(K, "values per value head", s.head_dim_v, 2)?;
    expect(K, "the query head's width modulo 8", s.head_dim % 8, 0)?;
    expect(K, "the value head's width modulo 2", s.head_dim_v % 2, 0)?;
    expect_at_least(K, "key heads", s.n_kv_heads, 1)?;
    expect(K, "heads per key head", s.n_heads % s.n_kv_heads, 0)?;
    expect_at_least(K, "tokens", n_tokens, 1)?;
    expect(K, "the queries", q.len(), n_tokens * s.n_heads * s.head_dim)?;
    let positions = s.positions();
    expect_at_least(K, "positions in the cache", positions, n_tokens)?;
    check_caches(K, s, &k_cache, &v_cache, pos.len())?;
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
        out.device_ordinal(),
    ];
    if let Some((t, shift)) = &table {
        expect_at_least(K, "31 bits of block shift", 31, *shift as usize)?;
        devices.push(t.device_ordinal());
    }
    if let Some(sinks) = &sinks {
        expect(K, "the sinks (one per head)", sinks.len(), s.n_heads)?;
        devices.push(sinks.device_ordinal());
    }
    let device = on_device(stream, &devices)?;
    let softcap = soft_cap(K, s.softcap)?;
    let c = |what, value| small(K, what, value);
    // Rows of the kernel's grid: queries times heads per key head.
    c("query rows", n_tokens * (s.n_heads / s.n_kv_heads))?;
    launch!(
        rf_flash_attention,
        "flash_attention",
        q.as_ptr(),
        k_cache.bytes.as_ptr(),
        v_cache.bytes.as_ptr(),
        cache_code(k_cache.ty),
        cache_code(v_cache.ty),
        c("cache positions", k_cache.positions)?,
        c("tokens", n_tokens)?,
        c("heads", s.n_heads)?,
        c("key heads", s.n_kv_heads)?,
        c("head width", s.head_dim)?,
        c("value head width", s.head_dim_v)?,
        c("window", s.window.unwrap_or(0))?,
        s.scale,
        softcap,
        ptr_or_null(sinks),
        pos.as_ptr(),
        ptr_or_null(table.map(|t| t.0)),
        table.map_or(0, |t| t.1 as i32),
        out.as_mut_ptr(),
        i32::from(allow_mma),
        device,
        stream.as_raw(),
    )
}
