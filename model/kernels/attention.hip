// attention.hip: attention of a few queries against the f16 KV cache, split along the
// keys, each query's chunks merged by the last of them to finish; Gemma 2's optional
// soft cap on the scores. Shared helpers and conventions: transformer_common.h.
#include "transformer_common.h"

namespace rf {

constexpr int kAttnThreads = 128;
// Keys whose loads a lane issues together before using any (attention_kernel).
constexpr int kAttnUnroll = 4;
// Workgroups an attention launch aims at, at most: a launch of many queries (a paged
// batch of many sequences) takes longer chunks of keys than its cache's, so that each
// workgroup has loads enough to keep in flight rather than many workgroups of few.
constexpr long long kAttnTargetWorkgroups = 4096;
// Most keys a chunk may hold (the chunk size is an argument, chosen by the caller from
// the cache's capacity: small chunks give short contexts more workgroups).
constexpr int kAttnMaxChunk = 256;

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
};


// Sum over groups of `width` lanes (a power of two up to 32) of a 32-lane group.
__device__ __forceinline__ float sum_lanes(float v, int width) {
    for (int mask = width / 2; mask > 0; mask >>= 1) v += rf_shfl_xor(v, mask);
    return v;
}

// Attention of one query (token, head) over one chunk of keys (a workgroup per chunk, so
// that even a short context spreads over many workgroups; kPaged: the tokens' caches as
// `Pages` says, else contiguous)
// A chunk that sees no key of
// the query leaves at once. When one chunk holds every key the query sees, it writes the
// output (and its Q8 blocks) itself. Otherwise each chunk writes its largest score m, the
// sum l of exp(score - m) and Σ exp(score - m)·v, and the last of the query's chunks to
// finish (counted in `done`, which it sets back to zero for the next launch) merges them
// into the output: no second kernel.
//
// Scores: each key's dot product is taken by a few lanes (8 halves, 16 bytes, a lane at a
// time), so a 128-thread workgroup scores many keys at once; where a lane takes one piece
// of each key (heads of 64, 128 or 256), it loads the pieces of kAttnUnroll keys before
// it multiplies any, so that their loads are in flight together. Values: each thread
// takes eight dimensions (16 bytes) of every G-th key, G = 128 / (head_dim_v / 8), again
// kAttnUnroll keys' loads ahead (heads of other widths: two dimensions, one key at a
// time), and the G partial sums meet in shared memory.
template <bool kPaged>
__global__ void __launch_bounds__(kAttnThreads)
    attention_kernel(const float* __restrict__ q, const __half* __restrict__ k_cache,
                     const __half* __restrict__ v_cache, AttnArgs a, const int* __restrict__ pos,
                     Pages pg, float* part_ml, float* part_acc, unsigned* done, float* __restrict__ out,
                     void* __restrict__ out_q8) {
    rf_chain_wait();
    __shared__ float qs[kAttnMaxHead];
    __shared__ float scores[kAttnMaxChunk];
    __shared__ int merges;
    __shared__ float red[kAttnThreads / 32];
    __shared__ float pv[kAttnThreads * 8];
    const int chunk = blockIdx.x, h = blockIdx.y, token = blockIdx.z;
    const int kvh = h / (a.n_heads / a.n_kv_heads);
    const int kv_dim = a.n_kv_heads * a.head_dim, v_dim = a.n_kv_heads * a.head_dim_v;
    const int p = kPaged ? pg.positions[token] : pos[0] + token;
    const int* table = kPaged ? pg.tables + pg.table_start[token] : nullptr;
    const int lo_visible = a.window > 0 ? max(0, p - a.window + 1) : 0;
    const int first_chunk = lo_visible / a.chunk, last_chunk = p / a.chunk;
    if (chunk < first_chunk || chunk > last_chunk) return;  // sees none of the keys
    const int lo = max(chunk * a.chunk, lo_visible);
    const int hi = min((chunk + 1) * a.chunk, p + 1);  // exclusive, > lo
    const size_t query = (size_t)token * a.n_heads + h;
    const size_t slot = query * a.n_chunks + chunk;
    const float* qh = q + ((size_t)token * a.n_heads + h) * a.head_dim;
    for (int i = threadIdx.x; i < a.head_dim; i += blockDim.x) qs[i] = qh[i];
    __syncthreads();
    const int n = hi - lo;
    // Lanes per key: pieces of 8 halves per head, rounded down to a power of two, ≤ 32.
    const int pieces = a.head_dim / 8;
    int lanes = 1;
    while (lanes * 2 <= pieces && lanes < 32) lanes *= 2;
    const int per_pass = blockDim.x / lanes;
    const int sub = threadIdx.x % lanes, slot_in_pass = threadIdx.x / lanes;
    // The dot product of this lane's piece(s) of key row `row` with the query.
    auto piece_dot = [&](uint4 raw, int c) {
        const __half2* k2 = reinterpret_cast<const __half2*>(&raw);
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 kf = __half22float2(k2[e]);
            s += qs[8 * c + 2 * e] * kf.x + qs[8 * c + 2 * e + 1] * kf.y;
        }
        return s;
    };
    auto key_at = [&](int i) {
        const size_t row = kPaged ? cache_row(table, pg.shift, lo + i) : (size_t)(lo + i);
        return k_cache + row * kv_dim + kvh * a.head_dim;
    };
    if (pieces == lanes) {
        for (int base = 0; base < n; base += per_pass * kAttnUnroll) {
            uint4 raw[kAttnUnroll];
#pragma unroll
            for (int u = 0; u < kAttnUnroll; ++u) {
                const int i = base + u * per_pass + slot_in_pass;
                raw[u] = i < n ? *reinterpret_cast<const uint4*>(key_at(i) + 8 * sub)
                               : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < kAttnUnroll; ++u) {
                const int i = base + u * per_pass + slot_in_pass;
                // Every lane of a 32-lane group takes part in the shuffles.
                const float s = sum_lanes(piece_dot(raw[u], sub), lanes);
                if (i < n && sub == 0) scores[i] = scaled_score(s, a.softcap, a.scale);
            }
        }
    } else {
        for (int base = 0; base < n; base += per_pass) {
            const int i = base + slot_in_pass;
            float s = 0.0f;
            if (i < n) {
                const __half* kr = key_at(i);
                for (int c = sub; c < pieces; c += lanes) {
                    s += piece_dot(*reinterpret_cast<const uint4*>(kr + 8 * c), c);
                }
            }
            s = sum_lanes(s, lanes);
            if (i < n && sub == 0) scores[i] = scaled_score(s, a.softcap, a.scale);
        }
    }
    __syncthreads();
    const int group = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int n_groups = blockDim.x / 32;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, scores[i]);
    m = max32(m);
    if (lane == 0) red[group] = m;
    __syncthreads();
    m = red[0];
    for (int g = 1; g < n_groups; ++g) m = fmaxf(m, red[g]);
    __syncthreads();
    float l = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float e = expf(scores[i] - m);
        scores[i] = e;
        l += e;
    }
    l = block_sum(l);  // also orders the writes to scores before the reads below
    // Values: thread (run of `width` dimensions d, key group g): eight dimensions of
    // 16-byte rows, else two.
    const int width = a.head_dim_v % 8 == 0 ? 8 : 2;
    const int runs = a.head_dim_v / width;
    const int groups = blockDim.x / runs;
    const int d0 = (threadIdx.x % runs) * width, g = threadIdx.x / runs;
    auto value_at = [&](int i) {
        const size_t row = kPaged ? cache_row(table, pg.shift, lo + i) : (size_t)(lo + i);
        return v_cache + row * v_dim + kvh * a.head_dim_v + d0;
    };
    if (g < groups && width == 8) {
        float acc[8] = {};
        for (int base = g; base < n; base += groups * kAttnUnroll) {
            uint4 raw[kAttnUnroll];
#pragma unroll
            for (int u = 0; u < kAttnUnroll; ++u) {
                const int i = base + u * groups;
                raw[u] = i < n ? *reinterpret_cast<const uint4*>(value_at(i))
                               : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < kAttnUnroll; ++u) {
                const int i = base + u * groups;
                const float p_i = i < n ? scores[i] : 0.0f;
                const __half2* v2 = reinterpret_cast<const __half2*>(&raw[u]);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 vf = __half22float2(v2[e]);
                    acc[2 * e] += p_i * vf.x;
                    acc[2 * e + 1] += p_i * vf.y;
                }
            }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) pv[8 * threadIdx.x + e] = acc[e];
    } else if (g < groups) {
        float2 acc = make_float2(0.0f, 0.0f);
        for (int i = g; i < n; i += groups) {
            const float2 vf = __half22float2(*reinterpret_cast<const __half2*>(value_at(i)));
            acc.x += scores[i] * vf.x;
            acc.y += scores[i] * vf.y;
        }
        pv[8 * threadIdx.x] = acc.x;
        pv[8 * threadIdx.x + 1] = acc.y;
    }
    __syncthreads();
    // One chunk covers every key: this is the output, and no merge follows.
    const bool alone = first_chunk == last_chunk;
    const size_t first = ((size_t)token * a.n_heads + h) * a.head_dim_v;
    const Q8Out q8 = q8_layout(out_q8, (size_t)gridDim.z * a.n_heads * a.head_dim_v);
    for (int d = threadIdx.x; d < a.head_dim_v; d += blockDim.x) {
        float total = 0.0f;
        for (int gg = 0; gg < groups; ++gg) total += pv[8 * (gg * runs + d / width) + d % width];
        if (alone) {
            const float y = total / (a.sinks ? l + expf(a.sinks[h] - m) : l);
            out[first + d] = y;
            if (out_q8) quantize32(y, q8, first + d);
        } else {
            part_acc[slot * a.head_dim_v + d] = total;
        }
    }
    if (alone) return;
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
    if (!merges) return;
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
        out[first + d] = acc * inv;
        if (out_q8) quantize32(acc * inv, q8, first + d);
    }
}

}  // namespace rf

using namespace rf;

extern "C" {

int rf_attention(const void* q, const void* k_cache, const void* v_cache, int n_tokens,
                 int n_heads, int n_kv_heads, int head_dim, int head_dim_v, int window,
                 float scale, float softcap, const void* sinks, int n_chunks, int chunk,
                 const void* pos, const void* positions,
                 const void* table_start, const void* tables, int shift, void* part_ml,
                 void* part_acc, void* done, void* out, void* out_q8, int device,
                 void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (chunk < 1 || chunk > kAttnMaxChunk) return (int)hipErrorInvalidValue;
    // Chunks twice as long (each query's scratch then holds fewer) while the launch
    // would have more workgroups than it aims at.
    const long long keys = (long long)n_chunks * chunk;
    while (2 * chunk <= kAttnMaxChunk &&
           (long long)n_tokens * n_heads * n_chunks > kAttnTargetWorkgroups) {
        chunk *= 2;
        n_chunks = (int)((keys + chunk - 1) / chunk);
    }
    AttnArgs a = {n_heads, n_kv_heads, head_dim, head_dim_v, window,
                  scale,   softcap,    n_chunks, chunk,      (const float*)sinks};
    const Pages pg = {(const int*)positions, (const int*)table_start, (const int*)tables, shift};
    const dim3 grid(n_chunks, n_heads, n_tokens);
    if (positions) {
        rfLaunchChained(attention_kernel<true>, grid, dim3(kAttnThreads), 0, (hipStream_t)stream,
                        (const float*)q, (const __half*)k_cache, (const __half*)v_cache, a,
                        (const int*)pos, pg, (float*)part_ml, (float*)part_acc,
                        (unsigned*)done, (float*)out, out_q8);
    } else {
        rfLaunchChained(attention_kernel<false>, grid, dim3(kAttnThreads), 0, (hipStream_t)stream,
                        (const float*)q, (const __half*)k_cache, (const __half*)v_cache, a,
                        (const int*)pos, pg, (float*)part_ml, (float*)part_acc,
                        (unsigned*)done, (float*)out, out_q8);
    }
    return (int)hipGetLastError();
}

}  // extern "C"
