// experts.hip: a mixture of experts' feed-forward block on the GPU, around the routed
// products (dequant's rf_matvec_experts_NAME in kernels/matvec_experts.hip for a few
// tokens, rf_matmul_experts_NAME in kernels/matmul.hip for prompts and batches): the
// router's choice of experts per token (for one token also with its norm and the
// router's product, in one cluster of workgroups), the grouping of the chosen slots by
// expert into tiles, and the weighted sum of the experts' outputs (with a shared
// expert's, behind its gate) added to the residual stream. Nothing comes back to the
// host: a decode step stays one graph.
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
#include "norm.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include <type_traits>
#if defined(ROCMFORGE_HIP_NVIDIA) && defined(RF_CHAINED_LAUNCH)
#include <cooperative_groups.h>
#endif

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

// A score's place in the ranking as one unsigned key: a larger key ranks first, equal
// keys go to the smaller index. -0 and +0 take the same key, a NaN ranks below every
// number (key 1), and 0 stands for no score (an expert already chosen, or none).
__device__ __forceinline__ uint32_t rank_key(float v) {
    if (isnan(v)) return 1u;
    const uint32_t u = v == 0.0f ? 0u : __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The score a key was made from (+0 for either zero, a NaN for a NaN).
__device__ __forceinline__ float key_score(uint32_t key) {
    if (key == 1u) return NAN;
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
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
// route_token: token t's routing, from its logits `row`, by one 32-lane group; the
// kernels below call it.
struct RouteArgs {
    const float* bias;
    int n_experts, k, gating, renorm;
    int* ids;
    float* weights;
    int* tiles;
    int* order;
};

template <int kPerLane>
__device__ __forceinline__ void route_token(const float* row, int t, const RouteArgs& a) {
    const int n_experts = a.n_experts, k = a.k, gating = a.gating;
    const float* bias = a.bias;
    const int lane = threadIdx.x & 31;
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
    // Rank r's choice stays in lane r's registers (k ≤ 32, checked by the launcher). Each
    // rank takes the largest key of the group, then the smallest expert holding it: two
    // reductions of the 32 lanes' best (one instruction each from sm_80 on).
    uint32_t key[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) key[i] = lane + 32 * i < n_experts ? rank_key(v[i]) : 0u;
    float my_w = 0.0f;
    int my_id = 0;
    for (int r = 0; r < k; ++r) {
        uint32_t best = 0u;
        int best_i = 0;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            if (key[i] > best) {  // among equal keys the first, the smaller expert
                best = key[i];
                best_i = i;
            }
        }
        const uint32_t top = rf_max32_u(best);
        const uint32_t e = rf_min32_u(best == top ? (uint32_t)(lane + 32 * best_i) : 0xffffffffu);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            if ((uint32_t)(lane + 32 * i) == e) key[i] = 0u;
        }
        if (lane == r) {
            my_w = key_score(top);
            my_id = (int)e;
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
    } else if (a.renorm) {
        float sum = 0.0f;
        for (int r = 0; r < k; ++r) sum += rf_shfl32(my_w, r);
        my_w = my_w / fmaxf(sum, 6.103515625e-5f);
    }
    if (lane >= k) return;
    const int s = t * k + lane;
    a.ids[s] = my_id;
    a.weights[s] = my_w;
    if (a.tiles) {
        a.tiles[3 * s] = my_id;
        a.tiles[3 * s + 1] = s;
        a.tiles[3 * s + 2] = 1;
        a.order[s] = s;
    }
}

template <int kPerLane>
__global__ void __launch_bounds__(kRouteThreads)
    route_kernel(const float* __restrict__ logits, int n_tokens, RouteArgs a) {
    rf_chain_wait();
    const int t = blockIdx.x * (kRouteThreads / 32) + threadIdx.x / 32;
    if (t >= n_tokens) return;  // whole 32-lane groups leave together
    route_token<kPerLane>(logits + (size_t)t * a.n_experts, t, a);
}

#if defined(ROCMFORGE_HIP_NVIDIA) && defined(RF_CHAINED_LAUNCH)
// One token's router behind its norm, and its routing, in one launch of one cluster of
// kRouterCluster workgroups (thread block clusters: compute capability 9.0 and later).
// Workgroup c takes the router's rows c·per .. c·per + per - 1 (per = n_experts /
// kRouterCluster, at most a row a 32-lane group): it reads them before the chained wait
// (no kernel writes them, so they arrive while the kernel before runs), norms the
// token's row of x as rms_norm_kernel does (the same bits: norm.h), and puts each row's
// dot product with it into the first workgroup's shared memory. After the cluster's
// barrier the first workgroup routes the token (route_token) and writes the normed row
// (`out`, `out_q8`) and the logits.
constexpr int kRouterCluster = 8;
// The router's values a lane keeps from before the wait; wider rows read the rest after.
constexpr int kRouterPre = 64;
// Most threads a workgroup (so that a lane's kRouterPre values stay in registers): rows
// the norm takes on more threads (wider than 2,048) go through rms_norm_router instead.
constexpr int kRouterThreads = 512;

template <int kPerLane>
__global__ void __cluster_dims__(kRouterCluster, 1, 1) __launch_bounds__(kRouterThreads)
    router_route_kernel(const float* __restrict__ x, const void* __restrict__ norm_w,
                        int w_type, int dim, float eps, const float* __restrict__ router,
                        float* __restrict__ logits, float* __restrict__ out,
                        void* __restrict__ out_q8, RouteArgs a) {
    namespace cg = cooperative_groups;
    extern __shared__ float h_shared[];  // the normed row (dim values)
    __shared__ float scores[kMaxExperts];
    const cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank();
    const int lane = threadIdx.x & 31, group = threadIdx.x / 32;
    const int per = a.n_experts / kRouterCluster;
    const int e = rank * per + group;
    const bool has_row = group < per;
    const float* r = router + (size_t)e * dim;
    float rv[kRouterPre];
#pragma unroll
    for (int j = 0; j < kRouterPre; ++j) {
        const int i = lane + 32 * j;
        rv[j] = has_row && i < dim ? r[i] : 0.0f;
    }
    float v[rf::kNormPer], wv[rf::kNormPer];
#pragma unroll
    for (int j = 0; j < rf::kNormPer; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        wv[j] = i < dim ? rf::weight_at(norm_w, w_type, i) : 0.0f;
    }
    rf_chain_wait();
    const float scale = rf::norm_scale([&](int i) { return x[i]; }, dim, eps, v);
#pragma unroll
    for (int j = 0; j < rf::kNormPer; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < dim) h_shared[i] = v[j] * scale * wv[j];
    }
    for (int i = threadIdx.x + rf::kNormPer * blockDim.x; i < dim; i += blockDim.x) {
        h_shared[i] = x[i] * scale * rf::weight_at(norm_w, w_type, i);
    }
    __syncthreads();
    if (has_row) {
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < kRouterPre; ++j) {
            const int i = lane + 32 * j;
            if (i < dim) dot += rv[j] * h_shared[i];
        }
        for (int i = lane + 32 * kRouterPre; i < dim; i += 32) dot += r[i] * h_shared[i];
        dot = sum32(dot);
        if (lane == 0) *cluster.map_shared_rank(&scores[e], 0) = dot;
    }
    cluster.sync();
    if (rank != 0) return;  // the whole workgroup leaves together
    for (int i = threadIdx.x; i < a.n_experts; i += blockDim.x) logits[i] = scores[i];
    if (group == 0) route_token<kPerLane>(scores, 0, a);
    const rf::Q8Out q = rf::q8_layout(out_q8, (size_t)dim);
    rf::store_normed(v, wv, x, norm_w, w_type, dim, scale, out, 0, q, out_q8 != nullptr, 0);
}
#endif

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

// Calls go(integral_constant<kPerLane>) with the fewest experts a lane that hold n_experts.
template <typename Go>
hipError_t with_per_lane(int n_experts, Go go) {
    if (n_experts <= 32) return go(std::integral_constant<int, 1>{});
    if (n_experts <= 64) return go(std::integral_constant<int, 2>{});
    if (n_experts <= 128) return go(std::integral_constant<int, 4>{});
    if (n_experts <= 256) return go(std::integral_constant<int, 8>{});
    return go(std::integral_constant<int, 32>{});
}

// A pass that reads missed experts in place stages them first: the expert of slot s,
// where its matrices lie in the mapped range [lo, hi) (host memory read over the link),
// is copied into slot s's room of `staged` (the first slot routed to it copies it), in
// loads of 16 bytes of consecutive lanes: whole lines over the link, about twice the
// rate of the products' own loads there. `pass` gets the table the products read: each
// staged expert's room, every other entry as in `tables`. Grid: x over matrix m's
// chunks of kStageChunk bytes (m = blockIdx.x / chunks), y over the slots, the last y
// writing `pass`.
constexpr int kStageThreads = 256;
constexpr size_t kStageChunk = 64 * 1024;
constexpr int kMaxStagedMats = 3;

struct StageShape {
    int n_mats;
    int count;
    int chunks;  // chunks of the largest matrix
    size_t mat_bytes[kMaxStagedMats];
    size_t mat_at[kMaxStagedMats];  // within a slot's room
    size_t room;                    // a slot's room
    uint64_t lo, hi;
};

// The first slot before n_slots routed to expert e, or -1.
__device__ __forceinline__ int first_slot(const int* ids, int n_slots, int e) {
    for (int s = 0; s < n_slots; ++s) {
        if (ids[s] == e) return s;
    }
    return -1;
}

__global__ void __launch_bounds__(kStageThreads)
    stage_kernel(const int* __restrict__ ids, int n_slots, const uint64_t* __restrict__ tables,
                 StageShape shape, uint8_t* __restrict__ staged, uint64_t* __restrict__ pass) {
    rf_chain_wait();  // the routes and the tables come from the work before
    const int s = blockIdx.y;
    if (s == n_slots) {
        const int entries = shape.n_mats * shape.count;
        for (int i = threadIdx.x; i < entries; i += kStageThreads) {
            const int m = i / shape.count, e = i % shape.count;
            const uint64_t at = tables[i];
            const int first = (at >= shape.lo && at < shape.hi) ? first_slot(ids, n_slots, e) : -1;
            pass[i] = first < 0 ? at
                                : (uint64_t)(staged + (size_t)first * shape.room + shape.mat_at[m]);
        }
        return;
    }
    const int m = blockIdx.x / shape.chunks;
    const size_t from = (size_t)(blockIdx.x % shape.chunks) * kStageChunk;
    const int e = ids[s];
    if (m >= shape.n_mats || from >= shape.mat_bytes[m] || e < 0 || e >= shape.count) return;
    const uint64_t at = tables[m * shape.count + e];
    if (at < shape.lo || at >= shape.hi || first_slot(ids, s, e) >= 0) return;
    const size_t len = min(kStageChunk, shape.mat_bytes[m] - from);
    const uint8_t* src = reinterpret_cast<const uint8_t*>(at) + from;
    uint8_t* dst = staged + (size_t)s * shape.room + shape.mat_at[m] + from;
    if ((((uintptr_t)src | (uintptr_t)dst | len) & 15) == 0) {
        const uint4* src16 = reinterpret_cast<const uint4*>(src);
        uint4* dst16 = reinterpret_cast<uint4*>(dst);
        for (size_t i = threadIdx.x; i < len / 16; i += kStageThreads) dst16[i] = src16[i];
    } else {
        for (size_t i = threadIdx.x; i < len; i += kStageThreads) dst[i] = src[i];
    }
}

}  // namespace rf_moe

extern "C" {

// Stages the missed experts of a pass read in place (see stage_kernel): tables holds
// n_mats tables of `count` addresses (mat_bytes[m] bytes each), [lo, hi) the mapped
// range, staged room for n_slots slots of `room` bytes (each matrix at mat_at[m]),
// pass the table the products read.
int rf_moe_stage(const void* ids, int n_slots, const void* tables, int n_mats, int count,
                 const size_t* mat_bytes, const size_t* mat_at, size_t room, uint64_t lo,
                 uint64_t hi, void* staged, void* pass, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n_slots < 1 || n_slots > 65534 || n_mats < 1 || n_mats > rf_moe::kMaxStagedMats ||
        count < 1)
        return (int)hipErrorInvalidValue;
    rf_moe::StageShape shape = {};
    shape.n_mats = n_mats;
    shape.count = count;
    size_t largest = 0;
    for (int m = 0; m < n_mats; ++m) {
        shape.mat_bytes[m] = mat_bytes[m];
        shape.mat_at[m] = mat_at[m];
        largest = largest > mat_bytes[m] ? largest : mat_bytes[m];
    }
    shape.chunks = (int)((largest + rf_moe::kStageChunk - 1) / rf_moe::kStageChunk);
    if (shape.chunks < 1) shape.chunks = 1;
    shape.room = room;
    shape.lo = lo;
    shape.hi = hi;
    rfLaunchChained(rf_moe::stage_kernel, dim3((unsigned)(shape.chunks * n_mats), (unsigned)n_slots + 1),
                    dim3(rf_moe::kStageThreads), 0, (hipStream_t)stream, (const int*)ids, n_slots,
                    (const uint64_t*)tables, shape, (uint8_t*)staged, (uint64_t*)pass);
    return (int)hipGetLastError();
}


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
    const rf_moe::RouteArgs a = {(const float*)bias, n_experts, k,          gating,
                                 renorm,             (int*)ids, (float*)weights, (int*)tiles,
                                 (int*)order};
    return (int)rf_moe::with_per_lane(n_experts, [&](auto per_lane) {
        constexpr int kPerLane = decltype(per_lane)::value;
        rfLaunchChained(rf_moe::route_kernel<kPerLane>, grid, dim3(rf_moe::kRouteThreads), 0,
                        (hipStream_t)stream, (const float*)logits, n_tokens, a);
        return hipGetLastError();
    });
}

// Whether rf_moe_router_route runs on the current device: a build whose every target has
// thread block clusters (sm_90 and later), on a device that has them.
int rf_moe_router_route_available(int device) {
#if defined(ROCMFORGE_HIP_NVIDIA) && defined(RF_CHAINED_LAUNCH)
    int major = 0;
    return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
                   cudaSuccess &&
               major >= 9
               ? 1
               : 0;
#else
    (void)device;
    return 0;
#endif
}

// One token's norm, router (F32 rows) and routing in one launch (router_route_kernel);
// hipErrorInvalidValue where it does not run (rf_moe_router_route_available) or for
// shapes it does not take: n_experts a multiple of the cluster's workgroups, each of them
// a row a 32-lane group.
int rf_moe_router_route(const void* x, const void* norm_w, int w_type, int dim, float eps,
                        const void* router, const void* bias, int n_experts, int k, int gating,
                        int renorm, void* logits, void* out, void* out_q8, void* ids,
                        void* weights, void* tiles, void* order, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
#if defined(ROCMFORGE_HIP_NVIDIA) && defined(RF_CHAINED_LAUNCH)
    const int threads = rf::norm_threads(dim);
    if (!rf_moe_router_route_available(device) || dim < 1 || n_experts < 1 ||
        n_experts > rf_moe::kMaxExperts || n_experts % rf_moe::kRouterCluster != 0 ||
        threads > rf_moe::kRouterThreads || n_experts / rf_moe::kRouterCluster > threads / 32 ||
        k < 1 || k > n_experts ||
        k > rf_moe::kMaxUsed)
        return (int)hipErrorInvalidValue;
    const rf_moe::RouteArgs a = {(const float*)bias, n_experts, k,          gating,
                                 renorm,             (int*)ids, (float*)weights, (int*)tiles,
                                 (int*)order};
    const size_t shared = (size_t)dim * sizeof(float);
    return (int)rf_moe::with_per_lane(n_experts, [&](auto per_lane) {
        constexpr int kPerLane = decltype(per_lane)::value;
        auto kernel = rf_moe::router_route_kernel<kPerLane>;
        if (shared > 48 * 1024) {
            const hipError_t e = cudaFuncSetAttribute(
                kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared);
            if (e != hipSuccess) return e;
        }
        rfLaunchChained(kernel, dim3(rf_moe::kRouterCluster), dim3(threads), shared,
                        (hipStream_t)stream, (const float*)x, norm_w, w_type, dim, eps,
                        (const float*)router, (float*)logits, (float*)out, out_q8, a);
        return hipGetLastError();
    });
#else
    (void)x, (void)norm_w, (void)w_type, (void)dim, (void)eps, (void)router, (void)bias;
    (void)n_experts, (void)k, (void)gating, (void)renorm, (void)logits, (void)out, (void)out_q8;
    (void)ids, (void)weights, (void)tiles, (void)order, (void)stream;
    return (int)hipErrorInvalidValue;
#endif
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
