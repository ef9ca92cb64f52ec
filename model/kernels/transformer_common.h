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
static __device__ float block_sum(float v) {
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

// Widest head the attention kernels take (values of q and of v per head).
constexpr int kAttnMaxHead = 256;

// A score as the softmax takes it: `cap · tanh(s · (1/cap))` with a soft cap (Gemma 2),
// then times the scale, in the CPU path's order.
__device__ __forceinline__ float scaled_score(float s, float cap, float scale) {
    if (cap > 0.0f) s = tanhf(s * (1.0f / cap)) * cap;
    return s * scale;
}

}  // namespace rf
