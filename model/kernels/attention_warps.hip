// attention_warps.hip: a few queries' attention over f16 caches whose heads are 32, 64
// or 128 values wide, a key a lane in 32-lane groups (attention.hip's launcher picks it;
// the chunks and their merge are attention_chunks.h's). Shared helpers and conventions:
// transformer_common.h.
#include "attention_chunks.h"

namespace rf {

// Value halves a lane holds of a head of D values, loaded as one word: 1, 2 or 4.
template <int D>
struct ValueWord;
template <>
struct ValueWord<32> {
    unsigned short w;
    __device__ void expand(float (&v)[1]) const { v[0] = __half2float(__ushort_as_half(w)); }
};
template <>
struct ValueWord<64> {
    uint32_t w;
    __device__ void expand(float (&v)[2]) const {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
        v[0] = f.x;
        v[1] = f.y;
    }
};
template <>
struct ValueWord<128> {
    uint2 w;
    __device__ void expand(float (&v)[4]) const {
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&w.x));
        const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&w.y));
        v[0] = a.x;
        v[1] = a.y;
        v[2] = b.x;
        v[3] = b.y;
    }
};

// Attention of one query over one chunk of an f16 cache whose key and value heads are D
// values (32, 64 or 128), for a decode step's few queries: each 32-lane group takes
// blocks of 32 keys, and after the scores a key a lane. A key row is loaded by D/8
// lanes, 16 bytes each (one run a row), each lane keeping its piece of D/8 keys; a
// butterfly over those lanes that halves the keys each lane holds at every step leaves
// each lane one key's score (D/8 - 1 shuffles). The block's softmax is then two 32-lane
// reductions, and its weights meet the values with a lane holding D/32 dimensions of
// every key: no barrier between the loads and the group's running (maximum, sum,
// Σ weight·value), which are merged across the four groups once at the end. Every load
// of a block (its keys, and the lane's dimensions of the 32 value rows) is issued
// before any is used. Chunks that do not hold every key the query sees merge as
// attention_kernel's do (merge_chunks).
template <bool kPaged, int D>
__global__ void __launch_bounds__(kAttnThreads)
    attention_warps_kernel(const float* __restrict__ q, CacheView k_cache, CacheView v_cache,
                           AttnArgs a, const int* __restrict__ pos, Pages pg, float* part_ml,
                           float* part_acc, unsigned* done, float* __restrict__ out,
                           void* __restrict__ out_q8) {
    constexpr int kGroups = kAttnThreads / 32;
    constexpr int KP = D / 8;   // 16-byte pieces of a key row
    constexpr int R = D / 32;   // value dimensions a lane holds
    __shared__ float group_m[kGroups], group_l[kGroups];
    __shared__ float group_acc[kGroups][D];
    rf_chain_wait();
    const ChunkOf at = chunk_of<kPaged>(a, pos, pg);
    if (!at.sees) return;  // sees none of the keys
    const int group = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int n = at.hi - at.lo;
    const int blocks = (n + 31) / 32;
    const __half* kc = reinterpret_cast<const __half*>(k_cache.data);
    const __half* vc = reinterpret_cast<const __half*>(v_cache.data);
    const size_t k_first = (size_t)at.kvh * D, v_first = (size_t)at.kvh * D + lane * R;
    // Lanes a key row spreads over for its loads (KP, a piece each, so that they read
    // the row as one run) and rows one load instruction reads: 32 / KP.
    constexpr int kRowsPerLoad = 32 / KP;
    // The lane whose key is key k of a block: the lane that ends up with its score.
    auto lane_of = [](int k) { return (k % kRowsPerLoad) * KP + k / kRowsPerLoad; };
    // After the scores' reduction, lane l holds key (l % KP)·kRowsPerLoad + l / KP.
    const int my_key = (lane % KP) * kRowsPerLoad + lane / KP;
    uint4 kraw[KP];
    ValueWord<D> vraw[32];
    bool valid = false;
    // The loads of block b: load j of a lane reads its piece (lane % KP) of key
    // j·kRowsPerLoad + lane / KP, and every lane its dimensions of every key's value. A
    // key past the chunk's reads the chunk's first key again; its weight is 0.
    auto load_block = [&](int b) {
        valid = 32 * b + my_key < n;
        const int i = valid ? 32 * b + my_key : 0;
        const unsigned row = (unsigned)(kPaged ? cache_row(at.table, pg.shift, at.lo + i)
                                               : (size_t)(at.lo + i));
#pragma unroll
        for (int j = 0; j < KP; ++j) {
            const size_t rj = (unsigned)rf_shfl32((int)row, (lane & ~(KP - 1)) + j);
            kraw[j] = *reinterpret_cast<const uint4*>(kc + rj * k_cache.dim + k_first +
                                                      8 * (lane % KP));
        }
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            const size_t rk = (unsigned)rf_shfl32((int)row, lane_of(k));
            vraw[k] = *reinterpret_cast<const ValueWord<D>*>(vc + rk * v_cache.dim + v_first);
        }
    };
    if (group < blocks) load_block(group);
    // The lane's piece of the query.
    float qv[8];
    {
        const float4* qh = reinterpret_cast<const float4*>(q + at.query * a.head_dim +
                                                           8 * (lane % KP));
        const float4 q0 = qh[0], q1 = qh[1];
        qv[0] = q0.x, qv[1] = q0.y, qv[2] = q0.z, qv[3] = q0.w;
        qv[4] = q1.x, qv[5] = q1.y, qv[6] = q1.z, qv[7] = q1.w;
    }
    float m_run = -INFINITY, l_run = 0.0f, acc[R] = {};
    for (int b = group; b < blocks; b += kGroups) {
        if (b != group) load_block(b);
        // Each lane's piece of its KP keys, then the sums over the KP lanes of a row
        // halving the keys a lane holds at each step (KP - 1 shuffles in all).
        float part[KP];
#pragma unroll
        for (int j = 0; j < KP; ++j) {
            Piece<kCacheF16> piece;
            piece.w = kraw[j];
            float kf[8];
            expand_unscaled(piece, kf);
            float t = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; e += 2) t += qv[e] * kf[e] + qv[e + 1] * kf[e + 1];
            part[j] = t;
        }
#pragma unroll
        for (int step = 1; step < KP; step *= 2) {
            const int m = KP / (2 * step);
            const bool upper = (lane & m) != 0;
#pragma unroll
            for (int j = 0; j < m; ++j) {
                const float send = upper ? part[j] : part[j + m];
                const float keep = upper ? part[j + m] : part[j];
                part[j] = keep + rf_shfl_xor(send, m);
            }
        }
        float s = part[0];
        s = valid ? scaled_score(s, a.softcap, a.scale) : -INFINITY;
        // Lane 0's key is always in the chunk: the block's maximum is finite.
        const float m_new = fmaxf(m_run, max32(s));
        const float factor = expf(m_run - m_new);
        const float w = valid ? expf(s - m_new) : 0.0f;
        l_run = l_run * factor + sum32(w);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] *= factor;
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            const float wk = rf_shfl32(w, lane_of(k));
            float v[R];
            vraw[k].expand(v);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] += wk * v[r];
        }
        m_run = m_new;
    }
    if (lane == 0) {
        group_m[group] = m_run;
        group_l[group] = l_run;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) group_acc[group][lane * R + r] = acc[r];
    __syncthreads();
    // The groups' results merged: a group without keys has m = -inf, l = 0 and sums 0.
    float m = -INFINITY;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) m = fmaxf(m, group_m[g]);
    float l = 0.0f, total = 0.0f;
    const int d = threadIdx.x;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
        const float f = expf(group_m[g] - m);
        l += group_l[g] * f;
        if (d < D) total += group_acc[g][d] * f;
    }
    const size_t first = at.query * D;
    const Q8Out q8 = q8_layout(out_q8, (size_t)gridDim.z * a.n_heads * D);
    if (at.first_chunk == at.last_chunk) {
        // One chunk covers every key: this is the output, and no merge follows.
        if (d < D) {
            const float y = total / (a.sinks ? l + expf(a.sinks[at.h] - m) : l);
            out[first + d] = y;
            if (out_q8) quantize32(y, q8, first + d);
        }
        return;
    }
    if (d < D) part_acc[at.slot * D + d] = total;
    merge_chunks(a, at.h, at.query, at.slot, at.first_chunk, at.last_chunk, m, l, part_ml,
                 part_acc, done, [&](int dd, float y) {
                     out[first + dd] = y;
                     if (out_q8) quantize32(y, q8, first + dd);
                 });
}

// Launches attention_warps_kernel's instance for heads of D values (32, 64 or 128).
template <int D>
static void launch_warps(dim3 grid, hipStream_t stream, bool paged, const float* q, CacheView kc,
                         CacheView vc, AttnArgs a, const int* pos, Pages pg, float* part_ml,
                         float* part_acc, unsigned* done, float* out, void* out_q8) {
    if (paged) {
        rfLaunchChained((attention_warps_kernel<true, D>), grid, dim3(kAttnThreads), 0, stream, q,
                        kc, vc, a, pos, pg, part_ml, part_acc, done, out, out_q8);
    } else {
        rfLaunchChained((attention_warps_kernel<false, D>), grid, dim3(kAttnThreads), 0, stream, q,
                        kc, vc, a, pos, pg, part_ml, part_acc, done, out, out_q8);
    }
}

void launch_attention_warps(int head, dim3 grid, hipStream_t stream, bool paged,
                            const float* q, CacheView kc, CacheView vc, AttnArgs a,
                            const int* pos, Pages pg, float* part_ml, float* part_acc,
                            unsigned* done, float* out, void* out_q8) {
    if (head == 32) {
        launch_warps<32>(grid, stream, paged, q, kc, vc, a, pos, pg, part_ml, part_acc, done, out,
                         out_q8);
    } else if (head == 64) {
        launch_warps<64>(grid, stream, paged, q, kc, vc, a, pos, pg, part_ml, part_acc, done, out,
                         out_q8);
    } else {
        launch_warps<128>(grid, stream, paged, q, kc, vc, a, pos, pg, part_ml, part_acc, done,
                          out, out_q8);
    }
}

}  // namespace rf
