// attention_chunks.h: what the two kernels of a few queries' attention split along the
// keys share (attention.hip's, for every cache type, and attention_warps.hip's, for f16
// caches): their arguments, where a workgroup's chunk of keys sits, and the merge of a
// query's chunks by the last of them to finish. Shared helpers and conventions:
// transformer_common.h.
#pragma once

#include "transformer_common.h"

namespace rf {

constexpr int kAttnThreads = 128;

struct AttnArgs {
    int n_heads, n_kv_heads, head_dim, head_dim_v;
    int window;  // 0: none
    float scale;
    float softcap;  // 0: none
    int n_chunks;  // chunks of `chunk` keys the cache holds
    int chunk;
    // One logit per query head that joins the softmax's denominator and nothing else
    // (gpt-oss's sinks); null: none. A sink far above the scores makes the sum infinite
    // and the output 0, its limit.
    const float* sinks;
    // The run of the Walsh-Hadamard rotation the value cache's rows hold (a quantized
    // cache's), which the output is turned back by; 0: none.
    int v_rot;
};

// Where workgroup (chunk, head h, token) of an attention launch sits: the query, its
// position's visible keys [lo, hi) within the chunk (none: `sees` false), the chunks that
// see any of its keys, and its token's block table (null in the contiguous layout).
struct ChunkOf {
    bool sees;
    int h, kvh, lo, hi, first_chunk, last_chunk;
    const int* table;
    size_t query, slot;
};

template <bool kPaged>
__device__ __forceinline__ ChunkOf chunk_of(const AttnArgs& a, const int* pos, const Pages& pg) {
    ChunkOf c;
    const int chunk = blockIdx.x, token = blockIdx.z;
    c.h = blockIdx.y;
    c.kvh = c.h / (a.n_heads / a.n_kv_heads);
    const int p = kPaged ? pg.positions[token] : pos[0] + token;
    c.table = kPaged ? pg.tables + pg.table_start[token] : nullptr;
    const int lo_visible = a.window > 0 ? max(0, p - a.window + 1) : 0;
    c.first_chunk = lo_visible / a.chunk;
    c.last_chunk = p / a.chunk;
    c.sees = chunk >= c.first_chunk && chunk <= c.last_chunk;
    c.lo = max(chunk * a.chunk, lo_visible);
    c.hi = min((chunk + 1) * a.chunk, p + 1);  // exclusive, > lo where it sees any
    c.query = (size_t)token * a.n_heads + c.h;
    c.slot = c.query * a.n_chunks + chunk;
    return c;
}

// After a chunk of a query's keys wrote its Σ exp(score - m)·v to part_acc (row `slot`,
// head_dim_v values) and before it returns: its m and l go to part_ml, the chunk is
// counted in done[query], and the last of the query's chunks to finish (which sets the
// counter back to zero for the next launch) merges every chunk's results, handing value
// d of the output to put(d, y) from thread d (whole 32-lane groups, for the Q8 blocks).
// Returns whether this workgroup merged. Every thread of the workgroup calls it.
template <typename Put>
__device__ __forceinline__ bool merge_chunks(const AttnArgs& a, int h, size_t query, size_t slot,
                                             int first_chunk, int last_chunk, float m, float l,
                                             float* part_ml, const float* part_acc,
                                             unsigned* done, Put put) {
    __shared__ int merges;
    if (threadIdx.x == 0) {
        part_ml[2 * slot] = m;
        part_ml[2 * slot + 1] = l;
    }
    // Publish this chunk's results, then count it; the last chunk merges.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned seen = (unsigned)(last_chunk - first_chunk + 1);
        const unsigned before = atomicAdd(&done[query], 1u);
        merges = before == seen - 1;
        if (merges) done[query] = 0u;
    }
    __syncthreads();
    if (!merges) return false;
    __threadfence();
    // The other chunks' results, read past this workgroup's cache (they were written by
    // other workgroups during this launch).
    const volatile float* ml = part_ml + 2 * query * a.n_chunks;
    const volatile float* accs = part_acc + query * a.n_chunks * a.head_dim_v;
    float mm = -INFINITY;
    for (int c = first_chunk; c <= last_chunk; ++c) mm = fmaxf(mm, ml[2 * c]);
    float ll = 0.0f;
    for (int c = first_chunk; c <= last_chunk; ++c) ll += expf(ml[2 * c] - mm) * ml[2 * c + 1];
    if (a.sinks) ll += expf(a.sinks[h] - mm);
    const float inv = 1.0f / ll;
    for (int d = threadIdx.x; d < a.head_dim_v; d += blockDim.x) {
        float acc = 0.0f;
        for (int c = first_chunk; c <= last_chunk; ++c) {
            acc += expf(ml[2 * c] - mm) * accs[(size_t)c * a.head_dim_v + d];
        }
        put(d, acc * inv);
    }
    return true;
}

// Keys a chunk of attention_warps_kernel holds at least: a 32-key block for each of its
// four 32-lane groups.
constexpr int kWarpsChunk = 128;

// Launches attention_warps_kernel (attention_warps.hip) for heads of `head` values (32,
// 64 or 128) over f16 caches, the grid and arguments as attention.hip's launcher gives
// them to attention_kernel.
void launch_attention_warps(int head, dim3 grid, hipStream_t stream, bool paged,
                            const float* q, CacheView kc, CacheView vc, AttnArgs a,
                            const int* pos, Pages pg, float* part_ml, float* part_acc,
                            unsigned* done, float* out, void* out_q8);

}  // namespace rf
