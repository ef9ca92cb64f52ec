// experts.hip: a mixture of experts' feed-forward block on the GPU, around the routed
// products (dequant's rf_matvec_experts_NAME in kernels/matvec_experts.hip for a few
// tokens, rf_matmul_experts_NAME in kernels/matmul.hip for prompts and batches): the
// router's choice of experts per token, the grouping of the chosen slots by expert into
// tiles, and the weighted sum of the experts' outputs (with a shared expert's, behind its
// gate) added to the residual stream. Nothing comes back to the host: a decode step stays
// one graph.
//
// A slot is one token's choice of one expert: token t's slots are t·k .. t·k + k - 1, in
// the order the router ranks them. Tiles are (expert, first, count) triples over `order`,
// the slots listed expert by expert.
//
// Like the transformer kernels (norm_rope.hip and the others): reductions in 32-lane
// groups with xor shuffles, every kernel launched chained and calling rf_chain_wait()
// before it reads what others write, every launcher returning the platform's status;
// the wrappers in src/gpu/kernels/experts.rs are their only callers and check every
// length.
#include "rocmforge_hip.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

namespace rf_moe {

// Most experts a router ranks (model's MAX_EXPERTS): 32 a lane.
constexpr int kMaxExperts = 1024;
// Most experts a token uses (the routing keeps rank r in lane r).
constexpr int kMaxUsed = 32;
constexpr int kRouteThreads = 128;
constexpr int kTileThreads = 1024;

__device__ __forceinline__ float max32(float v) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) v = fmaxf(v, rf_shfl_xor(v, mask));
    return v;
}

__device__ __forceinline__ float sum32(float v) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) v += rf_shfl_xor(v, mask);
    return v;
}

// Whether (va, ia) ranks before (vb, ib): the larger value, the smaller index among
// equals; a NaN ranks last.
__device__ __forceinline__ bool ranks_before(float va, int ia, float vb, int ib) {
    if (isnan(vb)) return !isnan(va) ? true : ia < ib;
    if (isnan(va)) return false;
    return va > vb || (va == vb && ia < ib);
}

// One 32-lane group per token: the k experts of the largest scores, in rank order, and
// their weights. The logits are the router's products plus its `bias` (gpt-oss), when
// given. gating 0: the scores are the softmax of the logits over every expert
// (Qwen, Mixtral), the weights the chosen probabilities, divided by their sum (clamped
// below at 2^-14, as llama.cpp does) when `renorm`. gating 1: the scores are the logits,
// the weights their softmax over the k chosen (gpt-oss). With `tiles` (tiles of one slot,
// for a few tokens) each slot is its own tile and order[s] = s. Each lane holds kPerLane
// experts' scores (the launcher takes the fewest that hold n_experts): the choice of
// each of the k ranks visits them all.
template <int kPerLane>
__global__ void __launch_bounds__(kRouteThreads)
    route_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                 int n_tokens, int n_experts, int k,
                 int gating, int renorm, int* __restrict__ ids, float* __restrict__ weights,
                 int* __restrict__ tiles, int* __restrict__ order) {
    rf_chain_wait();
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (kRouteThreads / 32) + threadIdx.x / 32;
    if (t >= n_tokens) return;  // whole 32-lane groups leave together
    const float* row = logits + (size_t)t * n_experts;
    float v[kPerLane];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < n_experts ? (bias ? row[e] + bias[e] : row[e]) : -INFINITY;
        if (e < n_experts) mx = fmaxf(mx, v[i]);
    }
    mx = max32(mx);
    if (gating == 0) {
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            const int e = lane + 32 * i;
            v[i] = e < n_experts ? expf(v[i] - mx) : 0.0f;
            sum += v[i];
        }
        const float inv = 1.0f / sum32(sum);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) v[i] *= inv;
    }
    // Rank r's choice stays in lane r's registers (k ≤ 32, checked by the launcher).
    uint32_t taken = 0;
    float my_w = 0.0f;
    int my_id = 0;
    for (int r = 0; r < k; ++r) {
        float best = NAN;
        int best_e = INT32_MAX;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            const int e = lane + 32 * i;
            if (e < n_experts && !(taken >> i & 1u) && ranks_before(v[i], e, best, best_e)) {
                best = v[i];
                best_e = e;
            }
        }
#pragma unroll
        for (int mask = 16; mask > 0; mask >>= 1) {
            const float ov = rf_shfl_xor(best, mask);
            const int oe = rf_shfl_xor(best_e, mask);
            if (ranks_before(ov, oe, best, best_e)) {
                best = ov;
                best_e = oe;
            }
        }
        if (best_e % 32 == lane) taken |= 1u << (best_e / 32);
        if (lane == r) {
            my_w = best;
            my_id = best_e;
        }
    }
    // The weights. Every sum runs over the ranks in order, as the host's does.
    if (gating == 1) {
        // Softmax over the chosen logits (the first is the largest).
        const float top = rf_shfl32(my_w, 0);
        my_w = expf(my_w - top);
        float sum = 0.0f;
        for (int r = 0; r < k; ++r) sum += rf_shfl32(my_w, r);
        my_w *= 1.0f / sum;
    } else if (renorm) {
        float sum = 0.0f;
        for (int r = 0; r < k; ++r) sum += rf_shfl32(my_w, r);
        my_w = my_w / fmaxf(sum, 6.103515625e-5f);
    }
    if (lane >= k) return;
    const int s = t * k + lane;
    ids[s] = my_id;
    weights[s] = my_w;
    if (tiles) {
        tiles[3 * s] = my_id;
        tiles[3 * s + 1] = s;
        tiles[3 * s + 2] = 1;
        order[s] = s;
    }
}

// Inclusive prefix sums of a[0 .. n) (n ≤ kTileThreads) in shared memory, by the whole
// workgroup.
__device__ void scan(int* a, int n) {
    for (int step = 1; step < n; step <<= 1) {
        int add = 0;
        if ((int)threadIdx.x < n && (int)threadIdx.x >= step) add = a[threadIdx.x - step];
        __syncthreads();
        if ((int)threadIdx.x < n) a[threadIdx.x] += add;
        __syncthreads();
    }
}

// One workgroup: the slots grouped by expert (order) and cut into tiles of at most
// tile_tokens; the tiles past the routing's own, up to max_tiles, get a count of 0. A
// slot whose id is not an expert's (negative: a route computed elsewhere) is left out.
// The order of slots within an expert follows the atomics and does not change any
// result (each slot's products are its own).
__global__ void __launch_bounds__(kTileThreads)
    tiles_kernel(const int* __restrict__ ids, int n_slots, int n_experts, int tile_tokens,
                 int max_tiles, int* __restrict__ tiles, int* __restrict__ order) {
    __shared__ int count[kMaxExperts];
    __shared__ int slot_end[kMaxExperts];
    __shared__ int tile_end[kMaxExperts];
    rf_chain_wait();
    const int tid = threadIdx.x;
    for (int e = tid; e < n_experts; e += kTileThreads) count[e] = 0;
    __syncthreads();
    for (int s = tid; s < n_slots; s += kTileThreads) {
        const int e = ids[s];
        if (e >= 0 && e < n_experts) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    for (int e = tid; e < n_experts; e += kTileThreads) {
        slot_end[e] = count[e];
        tile_end[e] = (count[e] + tile_tokens - 1) / tile_tokens;
    }
    __syncthreads();
    scan(slot_end, n_experts);
    scan(tile_end, n_experts);
    for (int e = tid; e < n_experts; e += kTileThreads) {
        const int c = count[e];
        const int first_slot = slot_end[e] - c;
        int tile = tile_end[e] - (c + tile_tokens - 1) / tile_tokens;
        for (int j = 0; j < c; j += tile_tokens, ++tile) {
            tiles[3 * tile] = e;
            tiles[3 * tile + 1] = first_slot + j;
            tiles[3 * tile + 2] = min(tile_tokens, c - j);
        }
        count[e] = first_slot;  // from here on: the next free place of the expert's slots
    }
    for (int tile = tile_end[n_experts - 1] + tid; tile < max_tiles; tile += kTileThreads) {
        tiles[3 * tile] = 0;
        tiles[3 * tile + 1] = 0;
        tiles[3 * tile + 2] = 0;
    }
    __syncthreads();
    for (int s = tid; s < n_slots; s += kTileThreads) {
        const int e = ids[s];
        if (e >= 0 && e < n_experts) order[atomicAdd(&count[e], 1)] = s;
    }
}

// x[t] += Σ_r w[t, r] · (y[t·k + r] + bias[ids[t·k + r]]) (rank by rank; the bias rows
// of down's experts when given, gpt-oss), plus sigmoid(g[t]) · shared[t] when a shared
// expert is given. A slot weighted 0 is skipped: its output may never have been written
// (a route computed elsewhere, whose slot the products left out).
__global__ void combine_kernel(const float* __restrict__ y, const float* __restrict__ w,
                               int n_tokens, int k, int d, const float* __restrict__ shared,
                               const float* __restrict__ shared_gate,
                               const float* __restrict__ bias, const int* __restrict__ ids,
                               int n_bias_rows, float* __restrict__ x) {
    rf_chain_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_tokens * d) return;
    const size_t t = i / d, c = i % d;
    float s = 0.0f;
    for (int r = 0; r < k; ++r) {
        const float weight = w[t * k + r];
        if (weight == 0.0f) continue;
        float v = y[(t * k + r) * d + c];
        if (bias) {
            const int e = ids[t * k + r];
            if (e >= 0 && e < n_bias_rows) v += bias[(size_t)e * d + c];
        }
        s += v * weight;
    }
    if (shared) s += shared[i] * (1.0f / (1.0f + expf(-shared_gate[t])));
    x[i] += s;
}

}  // namespace rf_moe

extern "C" {

int rf_moe_route(const void* logits, const void* bias, int n_tokens, int n_experts, int k,
                 int gating, int renorm, void* ids, void* weights, void* tiles, void* order,
                 int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n_tokens < 1 || n_experts < 1 || n_experts > rf_moe::kMaxExperts || k < 1 ||
        k > n_experts || k > rf_moe::kMaxUsed)
        return (int)hipErrorInvalidValue;
    const int per_block = rf_moe::kRouteThreads / 32;
    const dim3 grid((n_tokens + per_block - 1) / per_block);
#define RF_MOE_ROUTE(per_lane)                                                                 \
    rfLaunchChained(rf_moe::route_kernel<per_lane>, grid, dim3(rf_moe::kRouteThreads), 0,    \
                    (hipStream_t)stream, (const float*)logits, (const float*)bias, n_tokens,   \
                    n_experts, k, gating,                                                      \
                    renorm, (int*)ids, (float*)weights, (int*)tiles, (int*)order)
    if (n_experts <= 32) {
        RF_MOE_ROUTE(1);
    } else if (n_experts <= 64) {
        RF_MOE_ROUTE(2);
    } else if (n_experts <= 128) {
        RF_MOE_ROUTE(4);
    } else if (n_experts <= 256) {
        RF_MOE_ROUTE(8);
    } else {
        RF_MOE_ROUTE(32);
    }
#undef RF_MOE_ROUTE
    return (int)hipGetLastError();
}

int rf_moe_tiles(const void* ids, int n_slots, int n_experts, int tile_tokens, int max_tiles,
                 void* tiles, void* order, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n_slots < 1 || n_experts < 1 || n_experts > rf_moe::kMaxExperts || tile_tokens < 1)
        return (int)hipErrorInvalidValue;
    rfLaunchChained(rf_moe::tiles_kernel, dim3(1), dim3(rf_moe::kTileThreads), 0,
                    (hipStream_t)stream, (const int*)ids, n_slots, n_experts, tile_tokens,
                    max_tiles, (int*)tiles, (int*)order);
    return (int)hipGetLastError();
}

int rf_moe_combine(const void* y, const void* w, int n_tokens, int k, int d, const void* shared,
                   const void* shared_gate, const void* bias, const void* ids, int n_bias_rows,
                   void* x, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    const size_t n = (size_t)n_tokens * d;
    if (n == 0) return (int)hipSuccess;
    if (bias && (!ids || n_bias_rows < 1)) return (int)hipErrorInvalidValue;
    rfLaunchChained(rf_moe::combine_kernel, dim3((unsigned)((n + 255) / 256)), dim3(256), 0,
                    (hipStream_t)stream, (const float*)y, (const float*)w, n_tokens, k, d,
                    (const float*)shared, (const float*)shared_gate, (const float*)bias,
                    (const int*)ids, n_bias_rows, (float*)x);
    return (int)hipGetLastError();
}

}  // extern "C"
