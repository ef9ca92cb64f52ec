// transformer.hip: the operations of a transformer layer on the GPU, around the matrix
// products (which live in dequant's kernels/matvec.hip): RMSNorm fused with the
// quantization of its output, per-head Q/K norms, biases, RoPE and the KV-cache write in
// one kernel, attention of a few queries against the f16 KV cache split along the keys,
// attention of a prompt's chunk tiled over queries and keys (online softmax), both with
// Gemma 2's optional soft cap on the scores, the final logits' soft cap,
// the gated activations fused with quantization, the embedding row gather, greedy argmax
// on the device, and the position counter.
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
// first, before touching memory that other kernels write. Every launcher returns the platform's native status (0 on success); the Rust
// wrappers in src/gpu/kernels.rs are their only callers and check every length.
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
__device__ float block_sum(float v) {
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

constexpr int kNormMaxThreads = 1024;
// Values each thread keeps in registers; wider rows read the rest twice.
constexpr int kNormPer = 4;

// One workgroup per token: y = x / sqrt(mean(x²) + eps) · w. `out` (f32) gets y, or y added
// to it; `out_q8` (optional) gets y quantized. The row is read once into registers.
__global__ void __launch_bounds__(kNormMaxThreads)
    rms_norm_kernel(const float* __restrict__ x, const void* __restrict__ w, int w_type,
                    int dim, float eps, float* out, int add, void* __restrict__ out_q8) {
    const float* row = x + (size_t)blockIdx.x * dim;
    // The row and the weights are loaded before the reduction, so that no global read
    // waits behind it; the weights (which no kernel writes) before the chained wait.
    float v[kNormPer], wv[kNormPer];
#pragma unroll
    for (int k = 0; k < kNormPer; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        wv[k] = i < dim ? weight_at(w, w_type, i) : 0.0f;
    }
    rf_chain_wait();
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < kNormPer; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        v[k] = i < dim ? row[i] : 0.0f;
        ss += v[k] * v[k];
    }
    for (int i = threadIdx.x + kNormPer * blockDim.x; i < dim; i += blockDim.x) {
        ss += row[i] * row[i];
    }
    ss = block_sum(ss);
    const float scale = rsqrtf(ss / (float)dim + eps);
    float* o = out ? out + (size_t)blockIdx.x * dim : nullptr;
    const Q8Out q = q8_layout(out_q8, (size_t)gridDim.x * dim);
    const size_t first = (size_t)blockIdx.x * dim;
    // Whole 32-lane groups step together (the bound is rounded up to 32), so each group
    // covers one Q8 block per step.
    const int padded = (dim + 31) / 32 * 32;
    auto emit = [&](int i, float xi, float wi) {
        float y = 0.0f;
        if (i < dim) {
            y = xi * scale * wi;
            if (o) o[i] = add ? o[i] + y : y;
        }
        if (out_q8) quantize32(y, q, first + i);
    };
#pragma unroll
    for (int k = 0; k < kNormPer; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < padded) emit(i, v[k], wv[k]);
    }
    for (int i = threadIdx.x + kNormPer * blockDim.x; i < padded; i += blockDim.x) {
        const bool in = i < dim;
        emit(i, in ? row[i] : 0.0f, in ? weight_at(w, w_type, i) : 0.0f);
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

constexpr int kHeadThreads = 128;

// One workgroup per token and run of `heads_per_group` heads of the queries and of the
// keys (heads n_heads..n_heads + n_kv_heads-1 are the keys): bias, per-head RMSNorm,
// RoPE, the query scale; keys and values then go to the f16 cache at their positions. The
// token's RoPE turns are computed once for its heads in the workgroup.
struct RopeArgs {
    int head_dim, head_dim_v, n_heads, n_kv_heads;
    int rope_dims, neox;
    float theta_scale, freq_scale;
    float attn_factor;  // multiplies the cosines and sines (Phi-3's long-context models)
    const float* freq_factors;
    float q_scale, eps;
};

__global__ void __launch_bounds__(kHeadThreads)
    qk_rope_kv_kernel(float* __restrict__ q, const float* __restrict__ k,
                      const float* __restrict__ v, const float* __restrict__ bq,
                      const float* __restrict__ bk, const float* __restrict__ bv,
                      const void* __restrict__ q_norm, const void* __restrict__ k_norm,
                      int norm_type, RopeArgs a, const int* __restrict__ pos, Pages pg,
                      __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                      int heads_per_group) {
    rf_chain_wait();
    __shared__ float head[512];
    // (cos, sin) · attn_factor of each pair: rope_dims / 2 <= head_dim / 2 <= 256.
    __shared__ float2 turn[256];
    const int token = blockIdx.y;
    const int q_dim = a.n_heads * a.head_dim, kv_dim = a.n_kv_heads * a.head_dim;
    const int v_dim = a.n_kv_heads * a.head_dim_v;
    const int p = token_position(pg, pos, token);
    // RoPE: pair i (of rope_dims/2) turns by p·theta_scale^i / factor_i · freq_scale,
    // the angle accumulated by multiplication as the CPU path (and ggml) does; the
    // cosine and sine are multiplied by attn_factor, as the CPU path's table holds them.
    const int pairs = a.rope_dims / 2;
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        float theta = (float)p;
        for (int j = 0; j < i; ++j) theta *= a.theta_scale;
        const float factor = a.freq_factors ? a.freq_factors[i] : 1.0f;
        const float angle = a.freq_scale * (theta / factor);
        turn[i] = make_float2(cosf(angle) * a.attn_factor, sinf(angle) * a.attn_factor);
    }
    // (The first head's barrier below orders these writes before any read.)
    const int first = blockIdx.x * heads_per_group;
    const int last = min(first + heads_per_group, a.n_heads + a.n_kv_heads);
    for (int h = first; h < last; ++h) {
        const bool is_key = h >= a.n_heads;
        const int hh = is_key ? h - a.n_heads : h;
        const float* src = is_key ? k + (size_t)token * kv_dim + hh * a.head_dim
                                  : q + (size_t)token * q_dim + hh * a.head_dim;
        const float* bias = is_key ? bk : bq;
        for (int i = threadIdx.x; i < a.head_dim; i += blockDim.x) {
            head[i] = src[i] + (bias ? bias[hh * a.head_dim + i] : 0.0f);
        }
        __syncthreads();
        const void* norm = is_key ? k_norm : q_norm;
        if (norm) {
            float ss = 0.0f;
            for (int i = threadIdx.x; i < a.head_dim; i += blockDim.x) ss += head[i] * head[i];
            ss = block_sum(ss);
            const float scale = rsqrtf(ss / (float)a.head_dim + a.eps);
            for (int i = threadIdx.x; i < a.head_dim; i += blockDim.x) {
                head[i] = head[i] * scale * weight_at(norm, norm_type, i);
            }
            __syncthreads();
        }
        // Pairs are disjoint: each thread reads and writes only its own.
        for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
            const float c = turn[i].x, s = turn[i].y;
            const int i0 = a.neox ? i : 2 * i;
            const int i1 = a.neox ? i + pairs : 2 * i + 1;
            const float x0 = head[i0], x1 = head[i1];
            head[i0] = x0 * c - x1 * s;
            head[i1] = x0 * s + x1 * c;
        }
        __syncthreads();
        if (is_key) {
            const size_t row = cache_row(token_table(pg, token), pg.shift, p);
            __half* kc = k_cache + row * kv_dim + hh * a.head_dim;
            for (int i = threadIdx.x; i < a.head_dim; i += blockDim.x) {
                kc[i] = __float2half(head[i]);
            }
            const float* vs = v + (size_t)token * v_dim + hh * a.head_dim_v;
            __half* vc = v_cache + row * v_dim + hh * a.head_dim_v;
            for (int i = threadIdx.x; i < a.head_dim_v; i += blockDim.x) {
                vc[i] = __float2half(vs[i] + (bv ? bv[hh * a.head_dim_v + i] : 0.0f));
            }
        } else {
            float* dst = q + (size_t)token * q_dim + hh * a.head_dim;
            for (int i = threadIdx.x; i < a.head_dim; i += blockDim.x) {
                dst[i] = head[i] * a.q_scale;
            }
        }
        __syncthreads();  // every thread is done with `head` before the next head
    }
}

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
// Widest head the attention kernels take (values of q and of v per head).
constexpr int kAttnMaxHead = 256;

struct AttnArgs {
    int n_heads, n_kv_heads, head_dim, head_dim_v;
    int window;  // 0: none
    float scale;
    float softcap;  // 0: none
    int n_chunks;  // chunks of `chunk` keys the cache holds
    int chunk;
};

// A score as the softmax takes it: `cap · tanh(s · (1/cap))` with a soft cap (Gemma 2),
// then times the scale, in the CPU path's order.
__device__ __forceinline__ float scaled_score(float s, float cap, float scale) {
    if (cap > 0.0f) s = tanhf(s * (1.0f / cap)) * cap;
    return s * scale;
}

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
            const float y = total / l;
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

// Prompt attention, flash style: every query of a chunk in one launch, tiled over queries
// and keys with an online softmax, so that no score matrix is kept and the keys and
// values are read once per tile of queries rather than once per query.
//
// Layout. The queries of the heads that share a key head are the rows of one matrix,
// row r = token (r / group) and head kvh·group + r % group, so that they share the key
// and value tiles (GQA). A workgroup takes kTileRows consecutive rows of one key head
// (grid: row tiles × key heads) and walks the keys its rows see, from the first row's
// window start to the last row's position, in tiles of 32. Each 32-lane group owns kRows
// rows: for the scores lane j takes key j of the tile against its kRows rows; for the
// values lane j takes value pairs j, j + 32, … of the same rows. Keys and values are
// staged in shared memory as f16 (one buffer: the keys, then the values), the queries as
// f32; scores, running maxima and sums stay in registers, the probabilities pass through
// shared memory from the key lanes to the value lanes.
//
// Masks. Row r at position p = pos[0] + token sees keys lo..p, lo = p - window + 1 with a
// window, else 0, as attention_kernel. Keys past the tile's last position are loaded as
// zeros and masked, so a partial tile needs no other care.
//
// Paging. Every token of a launch belongs to one sequence: with `table` (its block
// table, blocks of 2^shift rows) key j is read from cache_row(table, shift, j).
constexpr int kFlashThreads = 128;
constexpr int kFlashGroups = kFlashThreads / 32;
constexpr int kFlashKeys = 32;  // keys per tile: one per lane of a group

struct FlashArgs {
    int n_tokens, n_heads, n_kv_heads, head_dim, head_dim_v;
    int window;  // 0: none
    float scale;
    float softcap;  // 0: none
};

// Copies keys k0.. (kFlashKeys of them) of `width` halves (a multiple of 2) from a cache
// whose rows are `stride` halves apart (row of key j: cache_row(table, shift, j)) into
// shared words `pitch` apart; keys at or past k0 + `valid` become zeros.
__device__ __forceinline__ void flash_stage(const __half* __restrict__ src, const int* table,
                                            int shift, int k0, int stride, int width,
                                            int valid, uint32_t* dst, int pitch) {
    if (width % 8 == 0) {
        const int pieces = width / 8;
        for (int idx = threadIdx.x; idx < kFlashKeys * pieces; idx += blockDim.x) {
            const int j = idx / pieces, c = idx % pieces;
            uint4 raw = make_uint4(0u, 0u, 0u, 0u);
            if (j < valid) {
                const size_t row = cache_row(table, shift, k0 + j);
                raw = *reinterpret_cast<const uint4*>(src + row * stride + 8 * c);
            }
            uint32_t* d = dst + j * pitch + 4 * c;
            d[0] = raw.x;
            d[1] = raw.y;
            d[2] = raw.z;
            d[3] = raw.w;
        }
    } else {
        const int words = width / 2;
        for (int idx = threadIdx.x; idx < kFlashKeys * words; idx += blockDim.x) {
            const int j = idx / words, c = idx % words;
            uint32_t w = 0u;
            if (j < valid) {
                const size_t row = cache_row(table, shift, k0 + j);
                w = *reinterpret_cast<const uint32_t*>(src + row * stride + 2 * c);
            }
            dst[j * pitch + c] = w;
        }
    }
}

__device__ __forceinline__ float2 half2_word(const uint32_t& w) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
}

// kRows: rows per 32-lane group; kPairs: value pairs per lane and row (heads up to 64·kPairs
// wide). kRows·kPairs = 16 in every instance: the same registers and shared memory.
template <int kRows, int kPairs>
__global__ void __launch_bounds__(kFlashThreads)
    flash_attention_kernel(const float* __restrict__ q, const __half* __restrict__ k_cache,
                           const __half* __restrict__ v_cache, FlashArgs a,
                           const int* __restrict__ pos, const int* __restrict__ table,
                           int shift, float* __restrict__ out) {
    constexpr int kTileRows = kRows * kFlashGroups;
    constexpr int kMaxHead = 64 * kPairs;
    // Odd pitch (in words): lane j reading key j's word c hits bank (j·pitch + c) % 32,
    // 32 different banks.
    constexpr int kPitch = kMaxHead / 2 + 1;
    __shared__ __align__(16) float qs[kTileRows * kMaxHead];
    __shared__ __align__(16) uint32_t kv[kFlashKeys * kPitch];
    __shared__ __align__(16) float ps[kTileRows * kFlashKeys];
    rf_chain_wait();
    const int group = a.n_heads / a.n_kv_heads;
    const int kvh = blockIdx.y;
    const int row0 = blockIdx.x * kTileRows;
    const int rows_here = min(kTileRows, a.n_tokens * group - row0);
    const int kv_dim = a.n_kv_heads * a.head_dim, v_dim = a.n_kv_heads * a.head_dim_v;
    const int base = pos[0];
    // Keys any row of the tile sees: from the first row's window start to the last row.
    const int first_pos = base + row0 / group;
    const int last_pos = base + (row0 + rows_here - 1) / group;
    const int lo_tile = a.window > 0 ? max(0, first_pos - a.window + 1) : 0;

    for (int idx = threadIdx.x; idx < kTileRows * a.head_dim; idx += blockDim.x) {
        const int r = idx / a.head_dim, d = idx % a.head_dim;
        float value = 0.0f;
        if (r < rows_here) {
            const int row = row0 + r;
            const int token = row / group, h = kvh * group + row % group;
            value = q[((size_t)token * a.n_heads + h) * a.head_dim + d];
        }
        qs[r * kMaxHead + d] = value;
    }

    const int g = threadIdx.x / 32, lane = threadIdx.x & 31;
    // This lane's rows: visible keys lo[i]..hi[i] (none for rows past the chunk).
    int lo[kRows], hi[kRows];
    float m[kRows], l[kRows];
    float2 acc[kRows][kPairs];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const int r = g * kRows + i;
        const int p = r < rows_here ? base + (row0 + r) / group : -1;
        hi[i] = p;
        lo[i] = a.window > 0 ? max(0, p - a.window + 1) : 0;
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < kPairs; ++c) acc[i][c] = make_float2(0.0f, 0.0f);
    }
    const int q_pairs = a.head_dim / 2, v_pairs = a.head_dim_v / 2;

    for (int k0 = lo_tile; k0 <= last_pos; k0 += kFlashKeys) {
        const int valid = min(kFlashKeys, last_pos - k0 + 1);
        __syncthreads();  // the last tile's values (and, first, the queries) are done with
        flash_stage(k_cache + kvh * a.head_dim, table, shift, k0, kv_dim, a.head_dim, valid, kv,
                    kPitch);
        __syncthreads();
        // Scores of key k0 + lane against this group's rows, 4 pairs of dimensions a step
        // (head_dim is a multiple of 8).
        float s[kRows];
#pragma unroll
        for (int i = 0; i < kRows; ++i) s[i] = 0.0f;
        const uint32_t* kr = kv + lane * kPitch;
        for (int c = 0; c < q_pairs; c += 4) {
            float2 kf[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) kf[e] = half2_word(kr[c + e]);
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
                const float* qr = qs + (g * kRows + i) * kMaxHead + 2 * c;
                const float4 q0 = *reinterpret_cast<const float4*>(qr);
                const float4 q1 = *reinterpret_cast<const float4*>(qr + 4);
                s[i] += q0.x * kf[0].x + q0.y * kf[0].y + q0.z * kf[1].x + q0.w * kf[1].y +
                        q1.x * kf[2].x + q1.y * kf[2].y + q1.z * kf[3].x + q1.w * kf[3].y;
            }
        }
        // Online softmax, row by row: the tile's maximum over the 32 lanes, the running
        // sums and accumulators rescaled to it.
        const int key = k0 + lane;
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            const bool seen = key >= lo[i] && key <= hi[i];
            const float sv = seen ? scaled_score(s[i], a.softcap, a.scale) : -INFINITY;
            const float m_new = fmaxf(m[i], max32(sv));
            // No key of this row yet (m_new = -inf): nothing to rescale.
            const float corr = m_new == -INFINITY ? 1.0f : expf(m[i] - m_new);
            const float p = seen ? expf(sv - m_new) : 0.0f;
            l[i] = l[i] * corr + p;
            m[i] = m_new;
#pragma unroll
            for (int c = 0; c < kPairs; ++c) {
                acc[i][c].x *= corr;
                acc[i][c].y *= corr;
            }
            ps[(g * kRows + i) * kFlashKeys + lane] = p;
        }
        __syncthreads();  // every group is done with the keys; the probabilities are out
        flash_stage(v_cache + kvh * a.head_dim_v, table, shift, k0, v_dim, a.head_dim_v, valid,
                    kv, kPitch);
        __syncthreads();
        // Values: Σ_j p[i][j] · v[j], keys 4 at a time (the probabilities and values past
        // `valid` are zeros).
        for (int j = 0; j < valid; j += 4) {
            float4 pr[kRows];
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
                pr[i] = *reinterpret_cast<const float4*>(ps + (g * kRows + i) * kFlashKeys + j);
            }
#pragma unroll
            for (int c = 0; c < kPairs; ++c) {
                const int pair = lane + 32 * c;
                if (pair >= v_pairs) continue;
                const float2 v0 = half2_word(kv[(j + 0) * kPitch + pair]);
                const float2 v1 = half2_word(kv[(j + 1) * kPitch + pair]);
                const float2 v2 = half2_word(kv[(j + 2) * kPitch + pair]);
                const float2 v3 = half2_word(kv[(j + 3) * kPitch + pair]);
#pragma unroll
                for (int i = 0; i < kRows; ++i) {
                    acc[i][c].x += pr[i].x * v0.x + pr[i].y * v1.x + pr[i].z * v2.x + pr[i].w * v3.x;
                    acc[i][c].y += pr[i].x * v0.y + pr[i].y * v1.y + pr[i].z * v2.y + pr[i].w * v3.y;
                }
            }
        }
    }

    // Each lane's share of a row's sum, added over the group; every row that exists saw
    // at least its own key, so the sum is positive.
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const float total = sum32(l[i]);
        const int r = g * kRows + i;
        if (r >= rows_here) continue;
        const int row = row0 + r;
        const int token = row / group, h = kvh * group + row % group;
        float* o = out + ((size_t)token * a.n_heads + h) * a.head_dim_v;
        const float inv = 1.0f / total;
#pragma unroll
        for (int c = 0; c < kPairs; ++c) {
            const int pair = lane + 32 * c;
            if (pair < v_pairs) {
                o[2 * pair] = acc[i][c].x * inv;
                o[2 * pair + 1] = acc[i][c].y * inv;
            }
        }
    }
}

// The same attention on the matrix units (sm_80 and later), for heads of D values (keys
// and values alike, D a multiple of 16 up to 128). A workgroup takes kFmRows rows of one
// key head (the layout above), a warp 16 of them, and walks the keys in tiles of 32 staged
// in shared memory as f16, the queries staged once as f16. Per tile a warp computes its
// 16 × 32 scores with mma m16n8k16 (queries the row-major operand, keys the column-major
// one), applies the masks and the online softmax to them in registers (the four lanes
// that hold one row meet through shuffles), and multiplies the probabilities, turned to
// f16 in place (a score tile's registers are the next product's row-major operand), with
// the value tile (loaded transposed) into its 16 × D accumulators.
constexpr int kFmWarps = 4;
constexpr int kFmRows = 16 * kFmWarps;

__device__ __forceinline__ uint32_t pack_half2(float x, float y) {
    const __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&h);
}

template <int D>
__global__ void __launch_bounds__(kFmWarps * 32)
    flash_mma_kernel(const float* __restrict__ q, const __half* __restrict__ k_cache,
                     const __half* __restrict__ v_cache, FlashArgs a,
                     const int* __restrict__ pos, const int* __restrict__ table, int shift,
                     float* __restrict__ out) {
#if defined(ROCMFORGE_HIP_MMA)
    static_assert(D % 16 == 0 && D <= 128, "heads of whole k-steps");
    // Rows 16-byte aligned for the matrix loads, eight rows in distinct banks.
    constexpr int kPitch = D + 8;
    __shared__ __align__(16) __half qs[kFmRows * kPitch];
    __shared__ __align__(16) __half ks[kFlashKeys * kPitch];
    __shared__ __align__(16) __half vs[kFlashKeys * kPitch];
    rf_chain_wait();
    const int group = a.n_heads / a.n_kv_heads;
    const int kvh = blockIdx.y;
    const int row0 = blockIdx.x * kFmRows;
    const int rows_here = min(kFmRows, a.n_tokens * group - row0);
    const int kv_dim = a.n_kv_heads * D;
    const int base = pos[0];
    const int first_pos = base + row0 / group;
    const int last_pos = base + (row0 + rows_here - 1) / group;
    const int lo_tile = a.window > 0 ? max(0, first_pos - a.window + 1) : 0;

    for (int idx = threadIdx.x; idx < kFmRows * (D / 2); idx += blockDim.x) {
        const int r = idx / (D / 2), c = idx % (D / 2);
        float2 v = make_float2(0.0f, 0.0f);
        if (r < rows_here) {
            const int row = row0 + r;
            const int token = row / group, h = kvh * group + row % group;
            v = *reinterpret_cast<const float2*>(q + ((size_t)token * a.n_heads + h) * D + 2 * c);
        }
        *reinterpret_cast<__half2*>(&qs[r * kPitch + 2 * c]) = __floats2half2_rn(v.x, v.y);
    }
    __syncthreads();
    const int w = threadIdx.x / 32, lane = threadIdx.x & 31;
    uint32_t qa[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        rf_ldmatrix_x4(qa[kk], &qs[(16 * w + (lane & 15)) * kPitch + 16 * kk + (lane >> 4) * 8]);
    }
    // This lane's two rows (16w + lane/4, and 8 below): their visible keys, running maxima
    // and this lane's share of their sums.
    int lo[2], hi[2];
    float m[2], l[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int r = 16 * w + lane / 4 + 8 * e;
        const int p = r < rows_here ? base + (row0 + r) / group : -1;
        hi[e] = p;
        lo[e] = a.window > 0 ? max(0, p - a.window + 1) : 0;
        m[e] = -INFINITY;
        l[e] = 0.0f;
    }
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
    }

    for (int k0 = lo_tile; k0 <= last_pos; k0 += kFlashKeys) {
        const int valid = min(kFlashKeys, last_pos - k0 + 1);
        __syncthreads();  // every warp is done with the last tile
        flash_stage(k_cache + kvh * D, table, shift, k0, kv_dim, D, valid,
                    reinterpret_cast<uint32_t*>(ks), kPitch / 2);
        flash_stage(v_cache + kvh * D, table, shift, k0, kv_dim, D, valid,
                    reinterpret_cast<uint32_t*>(vs), kPitch / 2);
        __syncthreads();
        // Scores: keys 8n .. 8n + 7 of the tile in s[n].
        float s[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) s[n][i] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int n = 0; n < 4; n += 2) {
                uint32_t b[4];
                const int key = 8 * n + (lane & 7) + ((lane >> 4) << 3);
                rf_ldmatrix_x4(b, &ks[key * kPitch + 16 * kk + ((lane >> 3) & 1) * 8]);
                rf_mma_16816(s[n], qa[kk], b[0], b[1]);
                rf_mma_16816(s[n + 1], qa[kk], b[2], b[3]);
            }
        }
        // Online softmax of each of the two rows over the tile.
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int n = 0; n < 4; ++n) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int key = k0 + 8 * n + 2 * (lane & 3) + c;
                    const bool seen = key >= lo[e] && key <= hi[e];
                    const float v = seen ? scaled_score(s[n][2 * e + c], a.softcap, a.scale)
                                         : -INFINITY;
                    s[n][2 * e + c] = v;
                    tile_max = fmaxf(tile_max, v);
                }
            }
            tile_max = fmaxf(tile_max, rf_shfl_xor(tile_max, 1));
            tile_max = fmaxf(tile_max, rf_shfl_xor(tile_max, 2));
            const float m_new = fmaxf(m[e], tile_max);
            // No key of this row yet (m_new = -inf): nothing to rescale, nothing to add.
            const float corr = m_new == -INFINITY ? 1.0f : expf(m[e] - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < 4; ++n) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float v = s[n][2 * e + c];
                    const float p = v == -INFINITY ? 0.0f : expf(v - m_new);
                    s[n][2 * e + c] = p;
                    sum += p;
                }
            }
            l[e] = l[e] * corr + sum;
            m[e] = m_new;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                o[n][2 * e] *= corr;
                o[n][2 * e + 1] *= corr;
            }
        }
        // Values: keys 16j .. 16j + 15 a step, the probabilities of score tiles 2j and
        // 2j + 1 as the row-major operand.
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            uint32_t pa[4];
            pa[0] = pack_half2(s[2 * j][0], s[2 * j][1]);
            pa[1] = pack_half2(s[2 * j][2], s[2 * j][3]);
            pa[2] = pack_half2(s[2 * j + 1][0], s[2 * j + 1][1]);
            pa[3] = pack_half2(s[2 * j + 1][2], s[2 * j + 1][3]);
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                uint32_t b[4];
                const int key = 16 * j + (lane & 7) + ((lane >> 3) & 1) * 8;
                rf_ldmatrix_x4_trans(b, &vs[key * kPitch + 8 * n + (lane >> 4) * 8]);
                rf_mma_16816(o[n], pa, b[0], b[1]);
                rf_mma_16816(o[n + 1], pa, b[2], b[3]);
            }
        }
    }

    // The row sums over their four lanes; every row that exists saw its own key.
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        float total = l[e];
        total += rf_shfl_xor(total, 1);
        total += rf_shfl_xor(total, 2);
        const int r = 16 * w + lane / 4 + 8 * e;
        if (r >= rows_here) continue;
        const int row = row0 + r;
        const int token = row / group, h = kvh * group + row % group;
        float* dst = out + ((size_t)token * a.n_heads + h) * D;
        const float inv = 1.0f / total;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            const float2 v = make_float2(o[n][2 * e] * inv, o[n][2 * e + 1] * inv);
            *reinterpret_cast<float2*>(dst + 8 * n + 2 * (lane & 3)) = v;
        }
    }
#else
    // Launched only where rf_mma_available() says the device has the instructions; code
    // built for an older target that still lands here stops rather than return nothing.
#if defined(ROCMFORGE_HIP_NVIDIA)
    __trap();
#else
    __builtin_trap();
#endif
#endif
}

// silu(g)·u or gelu_tanh(g)·u, element-wise; f32 out and/or Q8 blocks (32 lanes a block).
// Without a gate (experts that have none), silu(u) or gelu_tanh(u) alone.
__global__ void gated_kernel(const float* __restrict__ gate, const float* __restrict__ up,
                             size_t n, int gelu, float* __restrict__ out,
                             void* __restrict__ out_q8) {
    rf_chain_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;  // n is a multiple of 32: whole groups leave together
    const float g = gate ? gate[i] : up[i];
    float act;
    if (gelu) {
        const float c = 0.7978845608028654f;  // sqrt(2/pi)
        act = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
    } else {
        act = g / (1.0f + expf(-g));
    }
    const float y = gate ? act * up[i] : act;
    if (out) out[i] = y;
    if (out_q8) quantize32(y, q8_layout(out_q8, n), i);
}

// Copies rows tokens[t] (row_bytes each) of `table` to out[t]; a token past n_rows
// copies nothing and sets *bad.
__global__ void gather_rows_kernel(const uint8_t* __restrict__ table, size_t row_bytes,
                                   size_t n_rows, const uint32_t* __restrict__ tokens,
                                   uint8_t* __restrict__ out, int* __restrict__ bad) {
    rf_chain_wait();
    const uint32_t id = tokens[blockIdx.x];
    if (id >= n_rows) {
        if (threadIdx.x == 0) *bad = 1;
        return;
    }
    const uint8_t* src = table + (size_t)id * row_bytes;
    uint8_t* dst = out + (size_t)blockIdx.x * row_bytes;
    for (size_t i = threadIdx.x; i < row_bytes; i += blockDim.x) dst[i] = src[i];
}

__global__ void scale_kernel(float* __restrict__ x, size_t n, float s) {
    rf_chain_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// x = cap · tanh(x · (1/cap)): the final logits' soft cap (Gemma 2, some Gemma 3).
__global__ void softcap_kernel(float* __restrict__ x, size_t n, float cap) {
    rf_chain_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = tanhf(x[i] * (1.0f / cap)) * cap;
}

// x[at[i]] += values[i] for i < count: a sparse addition (a request's logit biases),
// one thread an entry. The indices are distinct, so no two threads touch one value.
__global__ void add_at_kernel(float* __restrict__ x, const int* __restrict__ at,
                              const float* __restrict__ values, int count) {
    rf_chain_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[at[i]] += values[i];
}

constexpr int kArgmaxThreads = 1024;

// For each row (a workgroup each) of n values: the index of the largest value (the
// smallest index among equals), written to token[row]; a NaN or +inf anywhere in the row
// writes UINT32_MAX instead.
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const float* __restrict__ x, int n, uint32_t* __restrict__ token) {
    rf_chain_wait();
    x += (size_t)blockIdx.x * n;
    token += blockIdx.x;
    __shared__ float best_v[kArgmaxThreads / 32];
    __shared__ int best_i[kArgmaxThreads / 32];
    __shared__ int bad;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    float v = -INFINITY;
    int idx = n;
    bool local_bad = false;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float xi = x[i];
        if (xi != xi || xi == INFINITY) local_bad = true;
        if (xi > v || (xi == v && i < idx)) {
            v = xi;
            idx = i;
        }
    }
    if (local_bad) bad = 1;
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) {
        const float ov = rf_shfl_xor(v, mask);
        const int oi = rf_shfl_xor(idx, mask);
        if (ov > v || (ov == v && oi < idx)) {
            v = ov;
            idx = oi;
        }
    }
    const int group = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) {
        best_v[group] = v;
        best_i[group] = idx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int g = 1; g < (int)(blockDim.x / 32); ++g) {
            if (best_v[g] > v || (best_v[g] == v && best_i[g] < idx)) {
                v = best_v[g];
                idx = best_i[g];
            }
        }
        *token = (bad || idx >= n) ? 0xFFFFFFFFu : (uint32_t)idx;
    }
}

// dst row r = src row rows[r], `dim` values each (a workgroup per row).
__global__ void select_rows_kernel(const float* __restrict__ src, int dim,
                                   const int* __restrict__ rows, float* __restrict__ dst) {
    rf_chain_wait();
    const float* s = src + (size_t)rows[blockIdx.x] * dim;
    float* d = dst + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) d[i] = s[i];
}

__global__ void advance_kernel(int* pos, int n) {
    rf_chain_wait();
    *pos += n;
}

}  // namespace rf

using namespace rf;

static inline unsigned blocks_for(size_t n, unsigned threads) {
    return (unsigned)((n + threads - 1) / threads);
}

extern "C" {

int rf_rms_norm(const void* x, const void* w, int w_type, int n_tokens, int dim, float eps,
                void* out, int add, void* out_q8, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    // About four values a thread, in whole 32-lane groups.
    const int threads = min(kNormMaxThreads, max(32, ((dim + 3) / 4 + 31) / 32 * 32));
    rfLaunchChained(rms_norm_kernel, dim3(n_tokens), dim3(threads), 0, (hipStream_t)stream,
                       (const float*)x, w, w_type, dim, eps, (float*)out, add, out_q8);
    return (int)hipGetLastError();
}

int rf_qk_rope_kv(void* q, const void* k, const void* v, const void* bq, const void* bk,
                  const void* bv, const void* q_norm, const void* k_norm, int norm_type,
                  int n_tokens, int head_dim, int head_dim_v, int n_heads, int n_kv_heads,
                  int rope_dims, int neox, float theta_scale, float freq_scale,
                  float attn_factor, const void* freq_factors, float q_scale, float eps,
                  const void* pos,
                  const void* positions, const void* table_start, const void* tables,
                  int shift, void* k_cache, void* v_cache, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    RopeArgs a = {head_dim, head_dim_v, n_heads, n_kv_heads, rope_dims, neox, theta_scale,
                  freq_scale, attn_factor, (const float*)freq_factors, q_scale, eps};
    const Pages pg = {(const int*)positions, (const int*)table_start, (const int*)tables, shift};
    // A workgroup a head for a few tokens (a decode step's few heads fill the device
    // that way); for a prompt's chunk, runs of heads of one token, which compute its RoPE
    // turns once: on the H200, a 7B's 512-token chunk took 43 us a layer with one head
    // per workgroup.
    const int heads = n_heads + n_kv_heads;
    const int per_group = (long long)heads * n_tokens >= 4096 ? 8 : 1;
    rfLaunchChained(qk_rope_kv_kernel, dim3((heads + per_group - 1) / per_group, n_tokens),
                       dim3(kHeadThreads), 0, (hipStream_t)stream, (float*)q, (const float*)k,
                       (const float*)v, (const float*)bq, (const float*)bk, (const float*)bv,
                       q_norm, k_norm, norm_type, a, (const int*)pos, pg, (__half*)k_cache,
                       (__half*)v_cache, per_group);
    return (int)hipGetLastError();
}

int rf_attention(const void* q, const void* k_cache, const void* v_cache, int n_tokens,
                 int n_heads, int n_kv_heads, int head_dim, int head_dim_v, int window,
                 float scale, float softcap, int n_chunks, int chunk, const void* pos,
                 const void* positions,
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
    AttnArgs a = {n_heads, n_kv_heads, head_dim, head_dim_v, window, scale, softcap, n_chunks,
                  chunk};
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

// allow_mma: whether the queries may take the matrix units where the device has them
// (0 measures or tests the other kernel on such a device).
int rf_flash_attention(const void* q, const void* k_cache, const void* v_cache, int n_tokens,
                       int n_heads, int n_kv_heads, int head_dim, int head_dim_v, int window,
                       float scale, float softcap, const void* pos, const void* table, int shift,
                       void* out, int allow_mma,
                       int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    const int widest = max(head_dim, head_dim_v);
    if (n_tokens < 1 || n_kv_heads < 1 || n_heads % n_kv_heads != 0 || head_dim % 8 != 0 ||
        head_dim_v % 2 != 0 || head_dim < 8 || head_dim_v < 2 || widest > kAttnMaxHead) {
        return (int)hipErrorInvalidValue;
    }
    FlashArgs a = {n_tokens, n_heads, n_kv_heads, head_dim, head_dim_v, window, scale, softcap};
    const int rows = n_tokens * (n_heads / n_kv_heads);
    const hipStream_t s = (hipStream_t)stream;
    const dim3 block(kFlashThreads);
    const __half* kc = (const __half*)k_cache;
    const __half* vc = (const __half*)v_cache;
    // On the matrix units where the device has them and the keys and values are heads
    // of the same whole k-steps.
    if (allow_mma && rf_mma_available() && head_dim == head_dim_v &&
        (head_dim == 32 || head_dim == 64 || head_dim == 128)) {
        const dim3 grid((rows + kFmRows - 1) / kFmRows, n_kv_heads);
        const dim3 mma_block(kFmWarps * 32);
        const int* pp = (const int*)pos;
        const int* tp = (const int*)table;
        float* o = (float*)out;
        const float* qp = (const float*)q;
        if (head_dim == 32) {
            rfLaunchChained(flash_mma_kernel<32>, grid, mma_block, 0, s, qp, kc, vc, a, pp, tp,
                            shift, o);
        } else if (head_dim == 64) {
            rfLaunchChained(flash_mma_kernel<64>, grid, mma_block, 0, s, qp, kc, vc, a, pp, tp,
                            shift, o);
        } else {
            rfLaunchChained(flash_mma_kernel<128>, grid, mma_block, 0, s, qp, kc, vc, a, pp, tp,
                            shift, o);
        }
        return (int)hipGetLastError();
    }
    // The instance whose rows are the widest head's: 64 rows a workgroup for heads up to
    // 64 wide, 32 up to 128, 16 up to 256.
    if (widest <= 64) {
        rfLaunchChained((flash_attention_kernel<16, 1>), dim3((rows + 63) / 64, n_kv_heads), block,
                        0, s, (const float*)q, kc, vc, a, (const int*)pos, (const int*)table, shift, (float*)out);
    } else if (widest <= 128) {
        rfLaunchChained((flash_attention_kernel<8, 2>), dim3((rows + 31) / 32, n_kv_heads), block,
                        0, s, (const float*)q, kc, vc, a, (const int*)pos, (const int*)table, shift, (float*)out);
    } else {
        rfLaunchChained((flash_attention_kernel<4, 4>), dim3((rows + 15) / 16, n_kv_heads), block,
                        0, s, (const float*)q, kc, vc, a, (const int*)pos, (const int*)table, shift, (float*)out);
    }
    return (int)hipGetLastError();
}

int rf_gated(const void* gate, const void* up, size_t n, int gelu, void* out, void* out_q8,
             int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    rfLaunchChained(gated_kernel, dim3(blocks_for(n, 256)), dim3(256), 0,
                       (hipStream_t)stream, (const float*)gate, (const float*)up, n, gelu,
                       (float*)out, out_q8);
    return (int)hipGetLastError();
}

int rf_gather_rows(const void* table, size_t row_bytes, size_t n_rows, const void* tokens,
                   int n_tokens, void* out, void* bad, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    rfLaunchChained(gather_rows_kernel, dim3(n_tokens), dim3(256), 0, (hipStream_t)stream,
                       (const uint8_t*)table, row_bytes, n_rows, (const uint32_t*)tokens,
                       (uint8_t*)out, (int*)bad);
    return (int)hipGetLastError();
}

int rf_scale(void* x, size_t n, float s, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    rfLaunchChained(scale_kernel, dim3(blocks_for(n, 256)), dim3(256), 0,
                       (hipStream_t)stream, (float*)x, n, s);
    return (int)hipGetLastError();
}

int rf_softcap(void* x, size_t n, float cap, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (!(cap > 0.0f)) return (int)hipErrorInvalidValue;
    rfLaunchChained(softcap_kernel, dim3(blocks_for(n, 256)), dim3(256), 0,
                    (hipStream_t)stream, (float*)x, n, cap);
    return (int)hipGetLastError();
}

int rf_argmax(const void* x, int n, int n_rows, void* token, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    rfLaunchChained(argmax_kernel, dim3(n_rows), dim3(kArgmaxThreads), 0, (hipStream_t)stream,
                       (const float*)x, n, (uint32_t*)token);
    return (int)hipGetLastError();
}

int rf_add_at(void* x, const void* at, const void* values, int count, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (count < 1) return (int)hipErrorInvalidValue;
    rfLaunchChained(add_at_kernel, dim3(blocks_for((size_t)count, 256)), dim3(256), 0,
                    (hipStream_t)stream, (float*)x, (const int*)at, (const float*)values, count);
    return (int)hipGetLastError();
}

int rf_select_rows(const void* src, int dim, const void* rows, int n_rows, void* dst, int device,
                   void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    rfLaunchChained(select_rows_kernel, dim3(n_rows), dim3(256), 0, (hipStream_t)stream,
                    (const float*)src, dim, (const int*)rows, (float*)dst);
    return (int)hipGetLastError();
}

int rf_advance(void* pos, int n, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    rfLaunchChained(advance_kernel, dim3(1), dim3(1), 0, (hipStream_t)stream, (int*)pos, n);
    return (int)hipGetLastError();
}

}  // extern "C"
