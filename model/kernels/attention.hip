// attention.hip: attention of a few queries against the KV cache (f16, Q8_0 or Q4_0),
// split along the keys, each query's chunks merged by the last of them to finish;
// Gemma 2's optional soft cap on the scores; the rotation that turns the output of a
// quantized value cache back. Shared helpers and conventions: transformer_common.h.
#include "attention_chunks.h"

namespace rf {

// Keys whose loads a lane issues together before using any (attention_kernel).
constexpr int kAttnUnroll = 4;
// Workgroups an attention launch aims at, at most: a launch of many queries (a paged
// batch of many sequences) takes longer chunks of keys than its cache's, so that each
// workgroup has loads enough to keep in flight rather than many workgroups of few.
constexpr long long kAttnTargetWorkgroups = 4096;
// The same for a paged batch's queries in attention_warps_kernel: each query's keys in
// one chunk where they fit, with no merge after it, once the batch alone gives the
// device this many workgroups.
constexpr long long kWarpsBatchTargetWorkgroups = 1024;
// Most keys a chunk may hold (the chunk size is an argument, chosen by the caller from
// the cache's capacity: small chunks give short contexts more workgroups).
constexpr int kAttnMaxChunk = 256;

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
    const bool paged = positions != nullptr;
    const long long target =
        warps_head != 0 && paged ? kWarpsBatchTargetWorkgroups : kAttnTargetWorkgroups;
    while (2 * chunk <= kAttnMaxChunk && (long long)n_tokens * n_heads * n_chunks > target) {
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
