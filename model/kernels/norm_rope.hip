// norm_rope.hip: RMSNorm, fused with the quantization of its output to Q8 blocks (and,
// where asked, with a mixture of experts' weighted sum before it or its router's product
// after it), and per-head Q/K norms, biases, RoPE and the KV-cache write, in one kernel.
// Shared helpers and conventions: transformer_common.h.
#include "norm.h"

namespace rf {

// One workgroup per token: y = x / sqrt(mean(x²) + eps) · w. `out` (f32) gets y, or y added
// to it; `out_q8` (optional) gets y quantized. The row is read once into registers.
// With `slot_y`, a mixture of experts' weighted sum is added to x first (and x written
// back): x[t] += Σ_r slot_w[t·used + r] · slot_y[t·used + r], rank by rank, a slot
// weighted 0 skipped, as experts.hip's combine_kernel adds it.
__global__ void __launch_bounds__(kNormMaxThreads)
    rms_norm_kernel(float* x, const void* __restrict__ w, int w_type, int dim, float eps,
                    float* out, int add, void* __restrict__ out_q8,
                    const float* __restrict__ slot_y, const float* __restrict__ slot_w, int used) {
    float* row = x + (size_t)blockIdx.x * dim;
    // The weights (which no kernel writes) are loaded before the chained wait, the row
    // before the reduction, so that no global read waits behind it.
    float v[kNormPer], wv[kNormPer];
#pragma unroll
    for (int k = 0; k < kNormPer; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        wv[k] = i < dim ? weight_at(w, w_type, i) : 0.0f;
    }
    rf_chain_wait();
    // Element i of the row, with the experts' sum added and written back when given (a
    // row's values past those kept in registers are read again by the thread that wrote
    // them).
    const size_t slot0 = (size_t)blockIdx.x * used;
    auto load = [&](int i) {
        float xi = row[i];
        if (slot_y) {
            float s = 0.0f;
            for (int r = 0; r < used; ++r) {
                const float weight = slot_w[slot0 + r];
                if (weight == 0.0f) continue;
                s += slot_y[(slot0 + r) * dim + i] * weight;
            }
            xi += s;
            row[i] = xi;
        }
        return xi;
    };
    const float scale = norm_scale(load, dim, eps, v);
    float* o = out ? out + (size_t)blockIdx.x * dim : nullptr;
    const Q8Out q = q8_layout(out_q8, (size_t)gridDim.x * dim);
    store_normed(v, wv, row, w, w_type, dim, scale, o, add, q, out_q8 != nullptr,
                 (size_t)blockIdx.x * dim);
}

// A mixture of experts' router behind its norm, in one launch: workgroup (e, t) norms
// token t's row of x as rms_norm_kernel does (the same bits), and writes the dot
// product of the router's row e (f32) with it to logits[t · n_experts + e]. Workgroup
// (0, t) also writes the normed row to `out` and its Q8 blocks to `out_q8`, as
// rms_norm_kernel would. Each workgroup norms the row again instead of waiting for a
// launch of its own to do it once.
__global__ void __launch_bounds__(kNormMaxThreads)
    rms_norm_router_kernel(const float* __restrict__ x, const void* __restrict__ w, int w_type,
                           int dim, float eps, const float* __restrict__ router, int n_experts,
                           float* __restrict__ logits, float* __restrict__ out,
                           void* __restrict__ out_q8) {
    const int e = blockIdx.x, t = blockIdx.y;
    const float* row = x + (size_t)t * dim;
    const float* r = router + (size_t)e * dim;
    float v[kNormPer], wv[kNormPer], rv[kNormPer];
#pragma unroll
    for (int k = 0; k < kNormPer; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        wv[k] = i < dim ? weight_at(w, w_type, i) : 0.0f;
        rv[k] = i < dim ? r[i] : 0.0f;
    }
    rf_chain_wait();
    const float scale = norm_scale([&](int i) { return row[i]; }, dim, eps, v);
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < kNormPer; ++k) dot += rv[k] * (v[k] * scale * wv[k]);
    for (int i = threadIdx.x + kNormPer * blockDim.x; i < dim; i += blockDim.x) {
        dot += r[i] * (row[i] * scale * weight_at(w, w_type, i));
    }
    dot = block_sum(dot);
    if (threadIdx.x == 0) logits[(size_t)t * n_experts + e] = dot;
    if (e != 0) return;  // the whole workgroup leaves together
    const Q8Out q = q8_layout(out_q8, (size_t)gridDim.y * dim);
    store_normed(v, wv, row, w, w_type, dim, scale, out ? out + (size_t)t * dim : nullptr, 0, q,
                 out_q8 != nullptr, (size_t)t * dim);
}

constexpr int kHeadThreads = 128;

// One workgroup per token and run of `heads_per_group` heads of the queries and of the
// keys (heads n_heads..n_heads + n_kv_heads-1 are the keys): bias, per-head RMSNorm,
// RoPE, the query scale; keys and values then go to the cache at their positions (with
// a quantized cache, the values as heads of their own after the keys). The token's RoPE
// turns are computed once for its heads in the workgroup.
struct RopeArgs {
    int head_dim, head_dim_v, n_heads, n_kv_heads;
    int rope_dims, neox;
    float theta_scale, freq_scale;
    float attn_factor;  // multiplies the cosines and sines (Phi-3's long-context models)
    const float* freq_factors;
    float q_scale, eps;
    // YaRN's ramp (the host's ops::RopeMix): pair i's angle mixes the extrapolated angle
    // with weight (1 - clamp((i - low) / max(0.001, high - low), 0, 1)) · ext_factor; an
    // ext_factor of 0: no mix.
    float yarn_low, yarn_high, ext_factor;
    // The caches' element types (kCache*), and the runs of the Walsh-Hadamard rotation a
    // quantized cache takes (0: none): queries and keys by k_rot, values by v_rot.
    int k_type, v_type, k_rot, v_rot;
};

// RoPE's (cos, sin) · attn_factor of pair i (of rope_dims/2) at position p: the pair
// turns by p·theta_scale^i / factor_i · freq_scale (mixed with the unscaled angle by
// YaRN's ramp where it applies), the angle accumulated by multiplication as the CPU
// path (and ggml) does; the cosine and sine are multiplied by attn_factor, as the CPU
// path's table holds them.
__device__ __forceinline__ float2 rope_turn(const RopeArgs& a, int p, int i) {
    float theta = (float)p;
    for (int j = 0; j < i; ++j) theta *= a.theta_scale;
    const float factor = a.freq_factors ? a.freq_factors[i] : 1.0f;
    const float extrap = theta / factor;
    float angle = a.freq_scale * extrap;
    if (a.ext_factor != 0.0f) {
        const float ramp = ((float)i - a.yarn_low) / fmaxf(0.001f, a.yarn_high - a.yarn_low);
        const float mix = (1.0f - fminf(fmaxf(ramp, 0.0f), 1.0f)) * a.ext_factor;
        angle = fmaf(angle, 1.0f - mix, extrap * mix);
    }
    return make_float2(cosf(angle) * a.attn_factor, sinf(angle) * a.attn_factor);
}

// f16 caches and no per-head norms, any count of tokens: a thread a pair of a query or key
// head (values i0, i1: 2j and 2j + 1, or j and j + rope_dims/2 for halves-style pairs
// j < rope_dims/2), biased, rotated where the pair is and scaled as qk_rope_kv_kernel
// does (the same operations in the same order), or two values of a value head; no
// shared memory and no barrier. The thread's turn is taken before the chained wait:
// the position changes only between passes (rf_advance, the layout's copy), and the
// chain starts a kernel no earlier than the second kernel before it has finished.
__global__ void __launch_bounds__(kHeadThreads)
    rope_kv_pairs_kernel(float* __restrict__ q, const float* __restrict__ k,
                         const float* __restrict__ v, const float* __restrict__ bq,
                         const float* __restrict__ bk, const float* __restrict__ bv, RopeArgs a,
                         const int* __restrict__ pos, Pages pg, CacheView k_cache,
                         CacheView v_cache) {
    const int token = blockIdx.y;
    const int half = a.head_dim / 2, half_v = a.head_dim_v / 2, pairs = a.rope_dims / 2;
    const int qk_pairs = (a.n_heads + a.n_kv_heads) * half;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int p = token_position(pg, pos, token);
    const int h = t / half, j = t % half;
    const bool rotated = t < qk_pairs && j < pairs;
    const float2 turn = rotated ? rope_turn(a, p, j) : make_float2(1.0f, 0.0f);
    rf_chain_wait();
    const size_t row = cache_row(token_table(pg, token), pg.shift, p);
    if (t < qk_pairs) {
        const bool is_key = h >= a.n_heads;
        const int hh = is_key ? h - a.n_heads : h;
        const int i0 = rotated && a.neox ? j : 2 * j;
        const int i1 = rotated && a.neox ? j + pairs : 2 * j + 1;
        const size_t first = is_key ? (size_t)token * a.n_kv_heads * a.head_dim
                                    : (size_t)token * a.n_heads * a.head_dim;
        const float* src = (is_key ? k : q) + first + hh * a.head_dim;
        const float* bias = is_key ? bk : bq;
        const float x0 = src[i0] + (bias ? bias[hh * a.head_dim + i0] : 0.0f);
        const float x1 = src[i1] + (bias ? bias[hh * a.head_dim + i1] : 0.0f);
        float y0 = x0, y1 = x1;
        if (rotated) {
            y0 = x0 * turn.x - x1 * turn.y;
            y1 = x0 * turn.y + x1 * turn.x;
        }
        if (is_key) {
            __half* kc = reinterpret_cast<__half*>(const_cast<void*>(k_cache.data)) +
                         row * k_cache.dim + hh * a.head_dim;
            kc[i0] = __float2half(y0);
            kc[i1] = __float2half(y1);
        } else {
            float* dst = q + first + hh * a.head_dim;
            dst[i0] = y0 * a.q_scale;
            dst[i1] = y1 * a.q_scale;
        }
        return;
    }
    const int u = t - qk_pairs;
    if (u >= a.n_kv_heads * half_v) return;
    const int hv = u / half_v, e = 2 * (u % half_v);
    const float* vs = v + (size_t)token * a.n_kv_heads * a.head_dim_v + hv * a.head_dim_v;
    __half* vc = reinterpret_cast<__half*>(const_cast<void*>(v_cache.data)) + row * v_cache.dim +
                 hv * a.head_dim_v;
#pragma unroll
    for (int d = e; d < e + 2; ++d) vc[d] = __float2half(vs[d] + (bv ? bv[hv * a.head_dim_v + d] : 0.0f));
}

//
// kQuant: either cache is quantized (its rows rotated and written a block at a time);
// otherwise both are f16, written value by value.
template <bool kQuant>
__global__ void __launch_bounds__(kHeadThreads)
    qk_rope_kv_kernel(float* __restrict__ q, const float* __restrict__ k,
                      const float* __restrict__ v, const float* __restrict__ bq,
                      const float* __restrict__ bk, const float* __restrict__ bv,
                      const void* __restrict__ q_norm, const void* __restrict__ k_norm,
                      int norm_type, RopeArgs a, const int* __restrict__ pos, Pages pg,
                      CacheView k_cache, CacheView v_cache, int heads_per_group) {
    rf_chain_wait();
    __shared__ float head[512];
    // (cos, sin) · attn_factor of each pair: rope_dims / 2 <= head_dim / 2 <= 256.
    __shared__ float2 turn[256];
    const int token = blockIdx.y;
    const int q_dim = a.n_heads * a.head_dim, kv_dim = a.n_kv_heads * a.head_dim;
    const int v_dim = a.n_kv_heads * a.head_dim_v;
    const int p = token_position(pg, pos, token);
    const int pairs = a.rope_dims / 2;
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) turn[i] = rope_turn(a, p, i);
    // (The first head's barrier below orders these writes before any read.)
    const int first = blockIdx.x * heads_per_group;
    const int last = min(first + heads_per_group,
                         a.n_heads + a.n_kv_heads + (kQuant ? a.n_kv_heads : 0));
    for (int h = first; h < last; ++h) {
        if constexpr (kQuant) {
            // Heads past the keys are the values', written by workgroups of their own
            // so that they do not wait behind the keys' turns: biased, rotated, then
            // stored a block at a time.
            if (h >= a.n_heads + a.n_kv_heads) {
                const int hv = h - a.n_heads - a.n_kv_heads;
                const float* vs = v + (size_t)token * v_dim + hv * a.head_dim_v;
                for (int i = threadIdx.x; i < a.head_dim_v; i += blockDim.x) {
                    head[i] = vs[i] + (bv ? bv[hv * a.head_dim_v + i] : 0.0f);
                }
                __syncthreads();
                if (a.v_rot > 0) fwht_shared(head, a.head_dim_v, a.v_rot);
                const size_t row = cache_row(token_table(pg, token), pg.shift, p);
                const size_t v0 = row * v_dim + hv * a.head_dim_v;
                void* vd = const_cast<void*>(v_cache.data);
                __half* vsc = const_cast<__half*>(v_cache.scales);
                for (int i = threadIdx.x; i < a.head_dim_v; i += blockDim.x) {
                    store_cached(vd, vsc, a.v_type, v0 + i, head[i]);
                }
                __syncthreads();  // every thread is done with `head`
                continue;
            }
        }
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
        if constexpr (kQuant) {
            // A quantized key cache holds rotated keys, met by queries rotated alike.
            if (a.k_rot > 0) fwht_shared(head, a.head_dim, a.k_rot);
        }
        if (is_key) {
            const size_t row = cache_row(token_table(pg, token), pg.shift, p);
            const size_t k0 = row * kv_dim + hh * a.head_dim;
            if constexpr (!kQuant) {
                const size_t v0 = row * v_dim + hh * a.head_dim_v;
                __half* kc = reinterpret_cast<__half*>(const_cast<void*>(k_cache.data)) + k0;
                for (int i = threadIdx.x; i < a.head_dim; i += blockDim.x) {
                    kc[i] = __float2half(head[i]);
                }
                const float* vs = v + (size_t)token * v_dim + hh * a.head_dim_v;
                __half* vc = reinterpret_cast<__half*>(const_cast<void*>(v_cache.data)) + v0;
                for (int i = threadIdx.x; i < a.head_dim_v; i += blockDim.x) {
                    vc[i] = __float2half(vs[i] + (bv ? bv[hh * a.head_dim_v + i] : 0.0f));
                }
            } else {
                // (Whole 32-lane groups step together over a quantized row's blocks.)
                void* kd = const_cast<void*>(k_cache.data);
                __half* ks = const_cast<__half*>(k_cache.scales);
                for (int i = threadIdx.x; i < a.head_dim; i += blockDim.x) {
                    store_cached(kd, ks, a.k_type, k0 + i, head[i]);
                }
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

}  // namespace rf

using namespace rf;

extern "C" {

int rf_rms_norm(void* x, const void* w, int w_type, int n_tokens, int dim, float eps,
                void* out, int add, void* out_q8, const void* slot_y, const void* slot_w, int used,
                int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (slot_y && (!slot_w || used < 1)) return (int)hipErrorInvalidValue;
    rfLaunchChained(rms_norm_kernel, dim3(n_tokens), dim3(norm_threads(dim)), 0, (hipStream_t)stream,
                    (float*)x, w, w_type, dim, eps, (float*)out, add, out_q8,
                    (const float*)slot_y, (const float*)slot_w, used);
    return (int)hipGetLastError();
}

int rf_rms_norm_router(const void* x, const void* w, int w_type, int n_tokens, int dim,
                       float eps, const void* router, int n_experts, void* logits, void* out,
                       void* out_q8, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n_tokens < 1 || n_experts < 1 || dim < 1) return (int)hipErrorInvalidValue;
    rfLaunchChained(rms_norm_router_kernel, dim3(n_experts, n_tokens), dim3(norm_threads(dim)), 0,
                    (hipStream_t)stream, (const float*)x, w, w_type, dim, eps,
                    (const float*)router, n_experts, (float*)logits, (float*)out, out_q8);
    return (int)hipGetLastError();
}

int rf_qk_rope_kv(void* q, const void* k, const void* v, const void* bq, const void* bk,
                  const void* bv, const void* q_norm, const void* k_norm, int norm_type,
                  int n_tokens, int head_dim, int head_dim_v, int n_heads, int n_kv_heads,
                  int rope_dims, int neox, float theta_scale, float freq_scale,
                  float attn_factor, const void* freq_factors, float q_scale, float eps,
                  float yarn_low, float yarn_high, float ext_factor, const void* pos,
                  const void* positions, const void* table_start, const void* tables,
                  int shift, void* k_cache, void* v_cache, int k_type, int v_type,
                  int cache_positions, int k_rot, int v_rot, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    RopeArgs a = {head_dim,  head_dim_v, n_heads, n_kv_heads, rope_dims,
                  neox,      theta_scale, freq_scale, attn_factor, (const float*)freq_factors,
                  q_scale,   eps,        yarn_low, yarn_high,  ext_factor,
                  k_type,    v_type,     k_rot,    v_rot};
    const CacheView kc = cache_view(k_cache, k_type, cache_positions, n_kv_heads * head_dim);
    const CacheView vc = cache_view(v_cache, v_type, cache_positions, n_kv_heads * head_dim_v);
    const Pages pg = {(const int*)positions, (const int*)table_start, (const int*)tables, shift};
    // f16 caches without per-head norms take a thread a pair at every count of tokens
    // (on the H200, a 7B's 64-token decode step of a batch took 15 us a layer with runs
    // of heads a workgroup, and a 512-token chunk 31 us). Otherwise a workgroup a head for
    // a few tokens (a decode step's few heads fill the device that way); for a prompt's
    // chunk, runs of heads of one token, which compute its RoPE turns once (a 7B's
    // 512-token chunk took 43 us a layer with one head per workgroup).
    const bool quant = k_type != kCacheF16 || v_type != kCacheF16;
    // A quantized cache's values are heads of their own.
    const int heads = n_heads + n_kv_heads + (quant ? n_kv_heads : 0);
    const int per_group = (long long)heads * n_tokens >= 4096 ? 8 : 1;
    if (quant && head_dim_v > 4 * kHeadThreads) {
        return (int)hipErrorInvalidValue;
    }
    if (!quant && !q_norm && !k_norm) {
        const int work = (n_heads + n_kv_heads) * (head_dim / 2) + n_kv_heads * (head_dim_v / 2);
        rfLaunchChained(rope_kv_pairs_kernel, dim3((work + kHeadThreads - 1) / kHeadThreads, n_tokens),
                        dim3(kHeadThreads), 0, (hipStream_t)stream, (float*)q, (const float*)k,
                        (const float*)v, (const float*)bq, (const float*)bk, (const float*)bv, a,
                        (const int*)pos, pg, kc, vc);
        return (int)hipGetLastError();
    }
    rfLaunchChained(quant ? qk_rope_kv_kernel<true> : qk_rope_kv_kernel<false>,
                       dim3((heads + per_group - 1) / per_group, n_tokens),
                       dim3(kHeadThreads), 0, (hipStream_t)stream, (float*)q, (const float*)k,
                       (const float*)v, (const float*)bq, (const float*)bk, (const float*)bv,
                       q_norm, k_norm, norm_type, a, (const int*)pos, pg, kc, vc, per_group);
    return (int)hipGetLastError();
}

}  // extern "C"
