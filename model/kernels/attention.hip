// attention.hip: attention of a few queries against the KV cache (f16, Q8_0 or Q4_0),
// split along the keys, each query's chunks merged by the last of them to finish;
// Gemma 2's optional soft cap on the scores; the rotation that turns the output of a
// quantized value cache back. Shared helpers and conventions: transformer_common.h.
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
    // The run of the Walsh-Hadamard rotation the value cache's rows hold (a quantized
    // cache's), which the output is turned back by; 0: none.
    int v_rot;
};


// Sum over groups of `width` lanes (a power of two up to 32) of a 32-lane group.
__device__ __forceinline__ float sum_lanes(float v, int width) {
    for (int mask = width / 2; mask > 0; mask >>= 1) v += rf_shfl_xor(v, mask);
    return v;
}

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
// Scores: each key's dot product is taken by a few lanes (a piece a lane at a time: 8
// halves, or 16 quants with their scale, `Piece`), so a 128-thread workgroup scores many
// keys at once; where a lane takes one piece of each key (heads of 64, 128 or 256), it
// loads the pieces of kAttnUnroll keys before it multiplies any, so that their loads are
// in flight together. Values: each thread takes a piece of every G-th key, G = 128 /
// (head_dim_v / piece), again kAttnUnroll keys' loads ahead (f16 heads of other widths:
// two dimensions, one key at a time), and the G partial sums meet in shared memory.
//
// KT, VT: the caches' element types (kCache*); a quantized value cache needs value heads
// of whole blocks, so its values always take the eight-dimension path.
template <bool kPaged, int KT, int VT>
__global__ void __launch_bounds__(kAttnThreads)
    attention_kernel(const float* __restrict__ q, CacheView k_cache, CacheView v_cache,
                     AttnArgs a, const int* __restrict__ pos,
                     Pages pg, float* part_ml, float* part_acc, unsigned* done, float* __restrict__ out,
                     void* __restrict__ out_q8) {
    rf_chain_wait();
    __shared__ float qs[kAttnMaxHead];
    __shared__ float scores[kAttnMaxChunk];
    __shared__ float red[kAttnThreads / 32];
    // Values a piece of a key or value row holds.
    constexpr int KN = Piece<KT>::kValues, VN = Piece<VT>::kValues;
    __shared__ float pv[kAttnThreads * VN];
    const ChunkOf at = chunk_of<kPaged>(a, pos, pg);
    if (!at.sees) return;  // sees none of the keys
    const int h = at.h, kvh = at.kvh, lo = at.lo, hi = at.hi;
    const int first_chunk = at.first_chunk, last_chunk = at.last_chunk;
    const int* table = at.table;
    const size_t query = at.query, slot = at.slot;
    const float* qh = q + query * a.head_dim;
    for (int i = threadIdx.x; i < a.head_dim; i += blockDim.x) qs[i] = qh[i];
    __syncthreads();
    const int n = hi - lo;
    // Lanes per key: pieces per head, rounded down to a power of two, ≤ 32.
    const int pieces = a.head_dim / KN;
    int lanes = 1;
    while (lanes * 2 <= pieces && lanes < 32) lanes *= 2;
    const int per_pass = blockDim.x / lanes;
    const int sub = threadIdx.x % lanes, slot_in_pass = threadIdx.x / lanes;
    // The dot product of piece c (dimensions KN·c..KN·c + KN - 1) of a key with the query.
    // (A quantized piece's scale is taken once, on the sum.)
    auto piece_dot = [&](const Piece<KT>& raw, int c) {
        float kf[KN];
        expand_unscaled(raw, kf);
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < KN; e += 2) s += qs[KN * c + e] * kf[e] + qs[KN * c + e + 1] * kf[e + 1];
        return s * piece_scale(raw);
    };
    auto row_of = [&](int i) -> size_t {
        return kPaged ? cache_row(table, pg.shift, lo + i) : (size_t)(lo + i);
    };
    const int k_first = kvh * a.head_dim;
    if (pieces == lanes) {
        for (int base = 0; base < n; base += per_pass * kAttnUnroll) {
            Piece<KT> raw[kAttnUnroll];
#pragma unroll
            for (int u = 0; u < kAttnUnroll; ++u) {
                const int i = base + u * per_pass + slot_in_pass;
                raw[u] = i < n ? load_piece<KT>(k_cache, row_of(i), k_first + KN * sub)
                               : zero_piece<KT>();
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
                const size_t row = row_of(i);
                for (int c = sub; c < pieces; c += lanes) {
                    s += piece_dot(load_piece<KT>(k_cache, row, k_first + KN * c), c);
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
    // Values: thread (run of `width` dimensions d, key group g): a piece of each row,
    // else (f16 heads of other widths) two dimensions.
    const int width = a.head_dim_v % VN == 0 ? VN : 2;
    const int runs = a.head_dim_v / width;
    const int groups = blockDim.x / runs;
    const int d0 = (threadIdx.x % runs) * width, g = threadIdx.x / runs;
    const int v_first = kvh * a.head_dim_v + d0;
    if (g < groups && width == VN) {
        float acc[VN] = {};
        for (int base = g; base < n; base += groups * kAttnUnroll) {
            Piece<VT> raw[kAttnUnroll];
#pragma unroll
            for (int u = 0; u < kAttnUnroll; ++u) {
                const int i = base + u * groups;
                raw[u] = i < n ? load_piece<VT>(v_cache, row_of(i), v_first) : zero_piece<VT>();
            }
#pragma unroll
            for (int u = 0; u < kAttnUnroll; ++u) {
                const int i = base + u * groups;
                // The weight times the piece's scale, once.
                const float p_i = (i < n ? scores[i] : 0.0f) * piece_scale(raw[u]);
                float vf[VN];
                expand_unscaled(raw[u], vf);
#pragma unroll
                for (int e = 0; e < VN; ++e) acc[e] += p_i * vf[e];
            }
        }
#pragma unroll
        for (int e = 0; e < VN; ++e) pv[VN * threadIdx.x + e] = acc[e];
    } else if (g < groups) {
        if constexpr (VT == kCacheF16) {
            const __half* vc = reinterpret_cast<const __half*>(v_cache.data);
            float2 acc = make_float2(0.0f, 0.0f);
            for (int i = g; i < n; i += groups) {
                const float2 vf = __half22float2(
                    *reinterpret_cast<const __half2*>(vc + row_of(i) * v_cache.dim + v_first));
                acc.x += scores[i] * vf.x;
                acc.y += scores[i] * vf.y;
            }
            pv[VN * threadIdx.x] = acc.x;
            pv[VN * threadIdx.x + 1] = acc.y;
        }
    }
    __syncthreads();
    // One chunk covers every key: this is the output, and no merge follows.
    const bool alone = first_chunk == last_chunk;
    const size_t first = query * a.head_dim_v;
    const Q8Out q8 = q8_layout(out_q8, (size_t)gridDim.z * a.n_heads * a.head_dim_v);
    // The output, complete in `ys` (the scores' room, done with): turned back where the
    // values are rotated, then written (and quantized).
    float* ys = scores;
    auto emit = [&]() {
        __syncthreads();
        if (a.v_rot > 0) fwht_shared(ys, a.head_dim_v, a.v_rot);
        for (int d = threadIdx.x; d < a.head_dim_v; d += blockDim.x) {
            out[first + d] = ys[d];
            if (out_q8) quantize32(ys[d], q8, first + d);
        }
    };
    for (int d = threadIdx.x; d < a.head_dim_v; d += blockDim.x) {
        float total = 0.0f;
        for (int gg = 0; gg < groups; ++gg) total += pv[VN * (gg * runs + d / width) + d % width];
        if (alone && VT == kCacheF16) {
            // (An f16 cache is never rotated: written as it is.)
            const float y = total / (a.sinks ? l + expf(a.sinks[h] - m) : l);
            out[first + d] = y;
            if (out_q8) quantize32(y, q8, first + d);
        } else if (alone) {
            ys[d] = total / (a.sinks ? l + expf(a.sinks[h] - m) : l);
        } else {
            part_acc[slot * a.head_dim_v + d] = total;
        }
    }
    if (alone) {
        if constexpr (VT != kCacheF16) emit();
        return;
    }
    const bool merges = merge_chunks(a, h, query, slot, first_chunk, last_chunk, m, l, part_ml,
                                     part_acc, done, [&](int d, float y) {
                                         if constexpr (VT == kCacheF16) {
                                             out[first + d] = y;
                                             if (out_q8) quantize32(y, q8, first + d);
                                         } else {
                                             ys[d] = y;
                                         }
                                     });
    if constexpr (VT != kCacheF16) {
        if (merges) emit();
    }
}

// Keys a chunk of attention_warps_kernel holds at least: a 32-key block for each of its
// four 32-lane groups.
constexpr int kWarpsChunk = 128;

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

// x (n values, n a multiple of 64) multiplied in runs of 64 by the normalised 64 × 64
// Walsh-Hadamard matrix, in place: the output of attention over a value cache that
// holds rotated values, turned back. A 32-lane group a run, two values a lane (i and
// i + 32), in the order of the host's kv_type::fwht.
__global__ void __launch_bounds__(128) hadamard64_kernel(float* __restrict__ x, size_t runs) {
    rf_chain_wait();
    const size_t run = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (run >= runs) return;  // whole groups leave together
    const int lane = threadIdx.x & 31;
    float* r = x + run * 64;
    const float scale = 1.0f / sqrtf(64.0f);
    float lo = r[lane] * scale, hi = r[lane + 32] * scale;
    for (int h = 1; h < 32; h <<= 1) {
        const float plo = rf_shfl_xor(lo, h), phi = rf_shfl_xor(hi, h);
        const bool upper = (lane & h) != 0;
        lo = upper ? plo - lo : lo + plo;
        hi = upper ? phi - hi : hi + phi;
    }
    r[lane] = lo + hi;
    r[lane + 32] = lo - hi;
}

// Launches attention_kernel's instance for the cache types KT, VT.
template <int KT, int VT>
static void launch_attention(dim3 grid, hipStream_t stream, bool paged, const float* q,
                             CacheView kc, CacheView vc, AttnArgs a, const int* pos, Pages pg,
                             float* part_ml, float* part_acc, unsigned* done, float* out,
                             void* out_q8) {
    if (paged) {
        rfLaunchChained((attention_kernel<true, KT, VT>), grid, dim3(kAttnThreads), 0, stream, q,
                        kc, vc, a, pos, pg, part_ml, part_acc, done, out, out_q8);
    } else {
        rfLaunchChained((attention_kernel<false, KT, VT>), grid, dim3(kAttnThreads), 0, stream, q,
                        kc, vc, a, pos, pg, part_ml, part_acc, done, out, out_q8);
    }
}

template <int KT>
static void launch_attention_v(int v_type, dim3 grid, hipStream_t stream, bool paged,
                               const float* q, CacheView kc, CacheView vc, AttnArgs a,
                               const int* pos, Pages pg, float* part_ml, float* part_acc,
                               unsigned* done, float* out, void* out_q8) {
    if (v_type == kCacheQ8) {
        launch_attention<KT, kCacheQ8>(grid, stream, paged, q, kc, vc, a, pos, pg, part_ml,
                                       part_acc, done, out, out_q8);
    } else if (v_type == kCacheQ4) {
        launch_attention<KT, kCacheQ4>(grid, stream, paged, q, kc, vc, a, pos, pg, part_ml,
                                       part_acc, done, out, out_q8);
    } else {
        launch_attention<KT, kCacheF16>(grid, stream, paged, q, kc, vc, a, pos, pg, part_ml,
                                        part_acc, done, out, out_q8);
    }
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

static void launch_attention_warps(int head, dim3 grid, hipStream_t stream, bool paged,
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

using namespace rf;

extern "C" {

int rf_attention(const void* q, const void* k_cache, const void* v_cache, int k_type,
                 int v_type, int cache_positions, int v_rot, int n_tokens, int n_heads, int n_kv_heads,
                 int head_dim, int head_dim_v, int window, float scale, float softcap,
                 const void* sinks, int n_chunks, int chunk, const void* pos,
                 const void* positions, const void* table_start, const void* tables, int shift,
                 void* part_ml, void* part_acc, void* done, void* out, void* out_q8, int warps,
                 int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (chunk < 1 || chunk > kAttnMaxChunk) return (int)hipErrorInvalidValue;
    if ((k_type != kCacheF16 && head_dim % 32 != 0) ||
        (v_type != kCacheF16 && head_dim_v % 32 != 0)) {
        return (int)hipErrorInvalidValue;
    }
    // f16 caches with key and value heads of 32, 64 or 128 values: attention_warps_kernel,
    // whose chunks hold at least a block of keys for each 32-lane group.
    const int warps_head = warps && k_type == kCacheF16 && v_type == kCacheF16 && v_rot == 0 &&
                                   head_dim == head_dim_v &&
                                   (head_dim == 32 || head_dim == 64 || head_dim == 128)
                               ? head_dim
                               : 0;
    // Chunks twice as long (each query's scratch then holds fewer) while the launch
    // would have more workgroups than it aims at, or while they are shorter than the
    // kernel takes.
    const long long keys = (long long)n_chunks * chunk;
    while (warps_head != 0 && chunk < kWarpsChunk) {
        chunk *= 2;
        n_chunks = (int)((keys + chunk - 1) / chunk);
    }
    while (2 * chunk <= kAttnMaxChunk &&
           (long long)n_tokens * n_heads * n_chunks > kAttnTargetWorkgroups) {
        chunk *= 2;
        n_chunks = (int)((keys + chunk - 1) / chunk);
    }
    if (v_rot != 0 && (v_rot > head_dim_v || head_dim_v % v_rot != 0 || (v_rot & (v_rot - 1)))) {
        return (int)hipErrorInvalidValue;
    }
    AttnArgs a = {n_heads, n_kv_heads, head_dim, head_dim_v, window, scale,
                  softcap, n_chunks,   chunk,    (const float*)sinks, v_rot};
    const Pages pg = {(const int*)positions, (const int*)table_start, (const int*)tables, shift};
    const dim3 grid(n_chunks, n_heads, n_tokens);
    const CacheView kc = cache_view(k_cache, k_type, cache_positions, n_kv_heads * head_dim);
    const CacheView vc = cache_view(v_cache, v_type, cache_positions, n_kv_heads * head_dim_v);
    const hipStream_t s = (hipStream_t)stream;
    const bool paged = positions != nullptr;
    const float* qp = (const float*)q;
    const int* pp = (const int*)pos;
    float* ml = (float*)part_ml;
    float* acc = (float*)part_acc;
    unsigned* dn = (unsigned*)done;
    float* o = (float*)out;
    if (warps_head != 0) {
        launch_attention_warps(warps_head, grid, s, paged, qp, kc, vc, a, pp, pg, ml, acc, dn, o,
                               out_q8);
    } else if (k_type == kCacheQ8) {
        launch_attention_v<kCacheQ8>(v_type, grid, s, paged, qp, kc, vc, a, pp, pg, ml, acc, dn,
                                     o, out_q8);
    } else if (k_type == kCacheQ4) {
        launch_attention_v<kCacheQ4>(v_type, grid, s, paged, qp, kc, vc, a, pp, pg, ml, acc, dn,
                                     o, out_q8);
    } else {
        launch_attention_v<kCacheF16>(v_type, grid, s, paged, qp, kc, vc, a, pp, pg, ml, acc, dn,
                                      o, out_q8);
    }
    return (int)hipGetLastError();
}

int rf_hadamard64(void* x, size_t n, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n % 64 != 0) return (int)hipErrorInvalidValue;
    const size_t runs = n / 64;
    if (runs == 0) return (int)hipSuccess;
    rfLaunchChained(hadamard64_kernel, dim3((unsigned)((runs + 3) / 4)), dim3(128), 0,
                    (hipStream_t)stream, (float*)x, runs);
    return (int)hipGetLastError();
}

}  // extern "C"
