// transformer_common.h: what the transformer kernels (norm_rope.hip, attention.hip,
// flash_attention.hip, rows.hip) share: the Q8 activation layout and its
// quantization, norm weights, warp and workgroup reductions, the KV cache's paged
// layout, and the attention scores' soft cap. These files are the operations of a
// transformer layer on the GPU, around the matrix products (which live in dequant's
// kernels/matvec.hip).
//
// Positions live in device memory (`pos`, one int: the position of the batch's first
// token). Kernels read it instead of taking it as an argument, so one captured decode
// step replays for every position; the step ends with rf_advance adding its tokens.
// Several sequences at once (a server's step) use the paged layout instead (`Pages`):
// each token carries its own position and its sequence's table of cache blocks.
//
// Warp-size agnostic: reductions are done in groups of 32 lanes with xor shuffles (which
// stay inside a 32-lane group of a 64-lane wavefront too) and across groups in shared
// memory. Every kernel is launched chained (rocmforge_hip.h) and calls rf_chain_wait()
// first, before touching memory that other kernels write. Every launcher returns the
// platform's native status (0 on success); the Rust wrappers in src/gpu/kernels.rs and
// src/gpu/kernels/ are their only callers and check every length.
#pragma once

#include "rocmforge_hip.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

namespace rf {

// Q8 activation blocks (dequant's kernels/matvec.hip reads them): for n tokens of `dim`
// values, the n·dim int8 values first, then one f32 scale per block of 32, then per block
// its two half sums in one int (rf_q8_half_sums).
struct Q8Out {
    int8_t* qs;
    float* ds;
    int* sums;
};

__device__ __forceinline__ Q8Out q8_layout(void* out, size_t n_values) {
    int8_t* qs = reinterpret_cast<int8_t*>(out);
    float* ds = reinterpret_cast<float*>(qs + n_values);
    return Q8Out{qs, ds, reinterpret_cast<int*>(ds + n_values / 32)};
}

// Weight element types of norm vectors, as ggml numbers them.
enum { kF32 = 0, kF16 = 1, kBF16 = 30 };

__device__ __forceinline__ float weight_at(const void* w, int type, int i) {
    if (type == kF16) return __half2float(reinterpret_cast<const __half*>(w)[i]);
    if (type == kBF16) {
        return __uint_as_float((uint32_t)reinterpret_cast<const uint16_t*>(w)[i] << 16);
    }
    return reinterpret_cast<const float*>(w)[i];
}

__device__ __forceinline__ float sum32(float v) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) v += rf_shfl_xor(v, mask);
    return v;
}

__device__ __forceinline__ float max32(float v) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) v = fmaxf(v, rf_shfl_xor(v, mask));
    return v;
}

// Sum over the whole workgroup (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result.
static inline __device__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    v = sum32(v);
    const int group = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) partial[group] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int g = 0; g < (int)(blockDim.x / 32); ++g) s += partial[g];
        total = s;
    }
    __syncthreads();
    const float result = total;
    __syncthreads();
    return result;
}

// block_sum with one barrier, for a kernel that sums this way once (its shared partials
// are not guarded for a second call): every thread adds the groups' partial sums itself,
// in block_sum's order, so it gets block_sum's bits.
static inline __device__ float block_sum_once(float v) {
    __shared__ float partial_once[32];
    v = sum32(v);
    if ((threadIdx.x & 31) == 0) partial_once[threadIdx.x / 32] = v;
    __syncthreads();
    float s = 0.0f;
    for (int g = 0; g < (int)(blockDim.x / 32); ++g) s += partial_once[g];
    return s;
}

// Quantizes one value per lane of a 32-lane group, value `i` of the whole activation
// (i a multiple of 32 at lane 0), into its Q8 block.
__device__ __forceinline__ void quantize32(float v, Q8Out out, size_t i) {
    const float amax = max32(fabsf(v));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = __float2int_rn(v * id);
    out.qs[i] = (int8_t)q;
    const int sums = rf_q8_half_sums(q);
    if ((threadIdx.x & 31) == 0) {
        out.ds[i / 32] = d;
        out.sums[i / 32] = sums;
    }
}

// Where a token's keys and values live. Contiguous (`positions` null): token t is at
// position pos[0] + t of the one sequence, whose key j is row j of the cache. Paged:
// token t is at positions[t] of the sequence whose block table starts at
// tables + table_start[t], and that sequence's key j is row
// tables[j >> shift] << shift | (j & (2^shift - 1)) of the cache (blocks of 2^shift rows).
struct Pages {
    const int* positions;
    const int* table_start;
    const int* tables;
    int shift;
};

__device__ __forceinline__ int token_position(const Pages& pg, const int* pos, int token) {
    return pg.positions ? pg.positions[token] : pos[0] + token;
}

// The token's sequence's block table (null in the contiguous layout).
__device__ __forceinline__ const int* token_table(const Pages& pg, int token) {
    return pg.positions ? pg.tables + pg.table_start[token] : nullptr;
}

// The cache row of key j of a sequence with block table `table` (null: row j).
__device__ __forceinline__ size_t cache_row(const int* table, int shift, int j) {
    if (!table) return (size_t)j;
    return ((size_t)table[j >> shift] << shift) | (size_t)(j & ((1 << shift) - 1));
}

// Element types of the KV cache, as the host's KvType numbers them: f16 values, or
// blocks of 32 values with one f16 scale each (Q8_0: int8 quants; Q4_0: 4-bit quants
// q, the value (q - 8)·d, values 2i and 2i + 1 the low and high nibble of byte i).
// A quantized cache of `positions` rows of `dim` values holds every row's quants
// first, row after row, then every row's scales (dim / 32 a row), so that the quants
// of a head are one aligned run. llama.cpp's blocks hold the same numbers.
enum { kCacheF16 = 0, kCacheQ8 = 1, kCacheQ4 = 2 };

// One layer's cached keys or values.
struct CacheView {
    const void* data;
    const __half* scales;  // null for f16
    int dim;               // values a row
};

// The view of a cache of `positions` rows of `dim` values of `type` at `data`.
inline CacheView cache_view(const void* data, int type, int positions, int dim) {
    const size_t values = (size_t)positions * dim;
    const size_t quant_bytes = type == kCacheQ8 ? values : values / 2;
    const __half* scales =
        type == kCacheF16 ? nullptr
                          : reinterpret_cast<const __half*>((const char*)data + quant_bytes);
    return CacheView{data, scales, dim};
}

// A run of consecutive values of a cache row as loaded (converted by `expand`): 8
// halves, or 16 quants (half a block) with their block's scale, so that a kernel can
// issue several rows' loads before it uses any. (A whole Q4_0 block a piece held 32
// sums a thread in the split attention's values: 96 registers a thread.)
template <int T>
struct Piece;
template <>
struct Piece<kCacheF16> {
    static constexpr int kValues = 8;
    uint4 w;
};
template <>
struct Piece<kCacheQ8> {
    static constexpr int kValues = 16;
    uint4 w;
    __half d;
};
template <>
struct Piece<kCacheQ4> {
    static constexpr int kValues = 16;
    uint2 w;
    __half d;
};

// Values e..e + kValues - 1 (e a multiple of kValues) of row `row`.
template <int T>
__device__ __forceinline__ Piece<T> load_piece(const CacheView& c, size_t row, int e) {
    const size_t i = row * c.dim + e;
    Piece<T> p;
    if constexpr (T == kCacheF16) {
        p.w = *reinterpret_cast<const uint4*>(reinterpret_cast<const __half*>(c.data) + i);
    } else if constexpr (T == kCacheQ8) {
        p.w = *reinterpret_cast<const uint4*>(reinterpret_cast<const int8_t*>(c.data) + i);
        p.d = c.scales[i / 32];
    } else {
        p.w = *reinterpret_cast<const uint2*>(reinterpret_cast<const uint8_t*>(c.data) + i / 2);
        p.d = c.scales[i / 32];
    }
    return p;
}

// A piece that stands for no row: zeros.
template <int T>
__device__ __forceinline__ Piece<T> zero_piece() {
    Piece<T> p;
    if constexpr (T == kCacheQ4) {
        p.w = make_uint2(0u, 0u);
    } else {
        p.w = make_uint4(0u, 0u, 0u, 0u);
    }
    if constexpr (T != kCacheF16) p.d = __float2half(0.0f);
    return p;
}

// A piece's values before its scale (f16 values as they are, quants as integers), so
// that a sum over the piece can take the scale once: value e is v[e] · piece_scale(p).
template <int T>
__device__ __forceinline__ void expand_unscaled(const Piece<T>& p, float v[Piece<T>::kValues]) {
    if constexpr (T == kCacheF16) {
        const uint32_t words[4] = {p.w.x, p.w.y, p.w.z, p.w.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&words[e]));
            v[2 * e] = f.x;
            v[2 * e + 1] = f.y;
        }
    } else if constexpr (T == kCacheQ8) {
        // Integer-to-float conversions run at a quarter of the rate of other arithmetic
        // (and made the quantized attention slower than f16's); instead each quant,
        // offset to unsigned, becomes the low byte of the float 2^23 + q + 128, from
        // which an exact subtraction leaves q.
        const uint32_t words[4] = {p.w.x, p.w.y, p.w.z, p.w.w};
#pragma unroll
        for (int e = 0; e < 16; ++e) {
            const uint32_t biased = words[e / 4] ^ 0x80808080u;
            const uint32_t bits = __byte_perm(biased, 0x4B000000u, 0x7540u | (e % 4));
            v[e] = __uint_as_float(bits) - 8388736.0f;
        }
    } else {
        // As Q8_0: the nibble n becomes the float 2^23 + n, and q = n - 8.
        const uint32_t words[2] = {p.w.x, p.w.y};
#pragma unroll
        for (int e = 0; e < 16; ++e) {
            const uint32_t bits = ((words[e / 8] >> (4 * (e % 8))) & 15u) | 0x4B000000u;
            v[e] = __uint_as_float(bits) - 8388616.0f;
        }
    }
}

template <int T>
__device__ __forceinline__ float piece_scale(const Piece<T>& p) {
    if constexpr (T == kCacheF16) {
        return 1.0f;
    } else {
        return __half2float(p.d);
    }
}

// A piece's values.
template <int T>
__device__ __forceinline__ void expand(const Piece<T>& p, float v[Piece<T>::kValues]) {
    expand_unscaled(p, v);
    if constexpr (T != kCacheF16) {
        const float d = piece_scale(p);
#pragma unroll
        for (int e = 0; e < Piece<T>::kValues; ++e) v[e] *= d;
    }
}

// Stores one value per lane of a 32-lane group, value `i` of the cache (i a multiple of
// 32 at lane 0), quantized with its block as llama.cpp's CPU backend quantizes a cache
// row: Q8_0 d = max|x| / 127, q = round(x / d); Q4_0 d = -m / 8 for the value m of
// largest magnitude (the first of equals), q = min(15, trunc(x / d + 8.5)).
__device__ __forceinline__ void store_cached(void* data, __half* scales, int type, size_t i,
                                             float x) {
    if (type == kCacheF16) {
        reinterpret_cast<__half*>(data)[i] = __float2half(x);
        return;
    }
    const int lane = threadIdx.x & 31;
    const float amax = max32(fabsf(x));
    float d;
    int q;
    if (type == kCacheQ8) {
        d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        q = __float2int_rn(x * id);
        reinterpret_cast<int8_t*>(data)[i] = (int8_t)q;
    } else {
        int first = fabsf(x) == amax ? lane : 32;
#pragma unroll
        for (int mask = 16; mask > 0; mask >>= 1) first = min(first, rf_shfl_xor(first, mask));
        const float m = rf_shfl32(x, first);
        d = m / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        q = min(15, (int)(int8_t)(x * id + 8.5f));
        const int high = rf_shfl_xor(q, 1);
        if ((lane & 1) == 0) reinterpret_cast<uint8_t*>(data)[i / 2] = (uint8_t)(q | (high << 4));
    }
    if (lane == 0) scales[i / 32] = __float2half(d);
}

// x[0..len) (shared memory, len a multiple of n and of 32, at most 4·blockDim.x; n a
// power of two) multiplied in runs of n by the normalised n × n Walsh-Hadamard matrix,
// as the host's kv_type::fwht computes it: the values scaled by 1/√n, then log2 n passes
// of sums and differences, pairs (i, i + h) for h = 1, 2, 4, … (the same operations in
// the same order, so the same bits for the same input). Passes within 32 values run in
// registers across the lanes, the wider ones in shared memory. Every thread of the
// workgroup takes part, after a barrier that orders the writes of x; the last barrier
// orders the result before any read.
__device__ __forceinline__ void fwht_shared(float* x, int len, int n) {
    const float scale = 1.0f / sqrtf((float)n);
    const int lane = threadIdx.x & 31;
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        v[k] = i < len ? x[i] * scale : 0.0f;
    }
    const int in_lanes = min(n, 32);
    for (int h = 1; h < in_lanes; h <<= 1) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float p = rf_shfl_xor(v[k], h);
            v[k] = (lane & h) ? p - v[k] : v[k] + p;
        }
    }
    __syncthreads();  // every thread has read x
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < len) x[i] = v[k];
    }
    __syncthreads();
    for (int h = 32; h < n; h <<= 1) {
        for (int t = threadIdx.x; t < len / 2; t += blockDim.x) {
            const int i = (t / h) * 2 * h + t % h;
            const float a = x[i], b = x[i + h];
            x[i] = a + b;
            x[i + h] = a - b;
        }
        __syncthreads();
    }
}

// Widest head the attention kernels take (values of q and of v per head).
constexpr int kAttnMaxHead = 256;

// A score as the softmax takes it: `cap · tanh(s · (1/cap))` with a soft cap (Gemma 2),
// then times the scale, in the CPU path's order.
__device__ __forceinline__ float scaled_score(float s, float cap, float scale) {
    if (cap > 0.0f) s = tanhf(s * (1.0f / cap)) * cap;
    return s * scale;
}

}  // namespace rf
