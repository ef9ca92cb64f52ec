// flash_attention.hip: attention of a prompt's chunk, tiled over queries and keys with
// an online softmax, on the vector units or on the matrix units where the device has
// them; a quantized cache's tiles are expanded to f16 as they are staged in shared
// memory. Shared helpers and conventions: transformer_common.h.
#include "transformer_common.h"

#include <atomic>
#if defined(ROCMFORGE_HIP_NVIDIA)
#include <cuda_pipeline_primitives.h>
#endif

namespace rf {

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
    int k_type, v_type;  // the caches' element types (kCache*)
    int window;  // 0: none
    float scale;
    float softcap;  // 0: none
    // One logit per query head that joins the softmax's denominator and nothing else
    // (gpt-oss's sinks); null: none. A sink far above the scores makes the sum
    // infinite and the output 0, its limit.
    const float* sinks;
};

// Values first..first + width - 1 (first and width multiples of 32) of keys k0..
// (kKeys of them) of a quantized cache of type T (row of key j:
// cache_row(table, shift, j)), as f16 pairs into shared words `pitch` apart; keys at or
// past k0 + `valid` become zeros.
template <int T, int kKeys>
__device__ __forceinline__ void flash_stage_blocks(const CacheView& src, const int* table,
                                                   int shift, int k0, int first, int width,
                                                   int valid, uint32_t* dst, int pitch) {
    constexpr int N = Piece<T>::kValues;
    const int pieces = width / N;
    for (int idx = threadIdx.x; idx < kKeys * pieces; idx += blockDim.x) {
        const int j = idx / pieces, c = idx % pieces;
        float v[N] = {};
        if (j < valid) expand(load_piece<T>(src, cache_row(table, shift, k0 + j), first + N * c), v);
        uint32_t* d = dst + j * pitch + (N / 2) * c;
#pragma unroll
        for (int e = 0; e < N / 2; ++e) {
            const __half2 h = __floats2half2_rn(v[2 * e], v[2 * e + 1]);
            d[e] = *reinterpret_cast<const uint32_t*>(&h);
        }
    }
}

// As flash_stage_blocks for a cache of any type (`type`; kQuant: either cache of the
// launch may be quantized, else both are f16): an f16 row's `width` halves (a multiple
// of 2) copied as they are.
template <bool kQuant, int kKeys = kFlashKeys>
__device__ __forceinline__ void flash_stage(const CacheView& cache, int type, const int* table,
                                            int shift, int k0, int first, int width, int valid,
                                            uint32_t* dst, int pitch) {
    if constexpr (kQuant) {
        if (type == kCacheQ8) {
            flash_stage_blocks<kCacheQ8, kKeys>(cache, table, shift, k0, first, width, valid, dst, pitch);
            return;
        }
        if (type == kCacheQ4) {
            flash_stage_blocks<kCacheQ4, kKeys>(cache, table, shift, k0, first, width, valid, dst, pitch);
            return;
        }
    }
    const __half* src = reinterpret_cast<const __half*>(cache.data) + first;
    const int stride = cache.dim;
    if (width % 8 == 0) {
        const int pieces = width / 8;
        for (int idx = threadIdx.x; idx < kKeys * pieces; idx += blockDim.x) {
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
        for (int idx = threadIdx.x; idx < kKeys * words; idx += blockDim.x) {
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
template <int kRows, int kPairs, bool kQuant>
__global__ void __launch_bounds__(kFlashThreads)
    flash_attention_kernel(const float* __restrict__ q, CacheView k_cache, CacheView v_cache,
                           FlashArgs a,
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
        flash_stage<kQuant>(k_cache, a.k_type, table, shift, k0, kvh * a.head_dim, a.head_dim, valid,
                    kv, kPitch);
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
        flash_stage<kQuant>(v_cache, a.v_type, table, shift, k0, kvh * a.head_dim_v, a.head_dim_v,
                    valid, kv, kPitch);
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
        const float inv = 1.0f / (a.sinks ? total + expf(a.sinks[h] - m[i]) : total);
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
// key head (the layout above), a warp 16 of them, and walks the keys in tiles of kFmKeys
// staged in shared memory as f16, the queries staged once as f16 and kept in registers.
// Per tile a warp computes its 16 × kFmKeys scores with mma m16n8k16 (queries the
// row-major operand, keys the column-major one), applies the masks (only on tiles that
// some row of the warp does not see whole) and the online softmax to them in registers
// (the four lanes that hold one row meet through shuffles; maxima and sums in base 2),
// and multiplies the probabilities, turned to f16 in place (a score tile's registers are
// the next product's row-major operand), with the value tile (loaded transposed) into its
// 16 × D accumulators.
//
// Staging. Two stages of a key tile and a value tile in dynamic shared memory: the next
// tile is requested before the current one is multiplied, so that its reads overlap the
// products. From f16 caches as asynchronous 16-byte copies (keys past the chunk's last
// position copy the last position's row again: finite values, masked out); from a
// quantized cache expanded by flash_stage, as it is read. The queries pass through the
// second stage's key tile before its first tile lands there. Workgroups are numbered
// from the last row tile down, so that the tiles with the most keys start first.
constexpr int kFmWarps = 4;
constexpr int kFmRows = 16 * kFmWarps;
constexpr int kFmKeys = 64;
static_assert(kFmRows <= kFmKeys, "the queries are staged in a key tile's place");

// Halves between the rows of a staged tile: rows 16-byte aligned for the matrix loads,
// eight consecutive rows in distinct banks.
template <int D>
__host__ __device__ constexpr int fm_pitch() {
    return D + 8;
}
// Dynamic shared memory of flash_mma_kernel<D>: two stages of a key and a value tile.
template <int D>
__host__ __device__ constexpr int fm_shared_bytes() {
    return 4 * kFmKeys * fm_pitch<D>() * (int)sizeof(__half);
}

#if defined(ROCMFORGE_HIP_MMA)
// Keys k0 .. k0 + kFmKeys - 1 of an f16 cache, values first .. first + D - 1 of each, into
// the tile `dst` as asynchronous copies (the caller commits them); keys at or past
// k0 + `valid` copy key k0 + valid - 1 again.
template <int D>
__device__ __forceinline__ void fm_stage_async(const CacheView& cache, const int* table,
                                               int shift, int k0, int first, int valid,
                                               __half* dst) {
    constexpr int kPieces = D / 8;  // 16-byte pieces a row
    constexpr int kRounds = kFmKeys * kPieces / (kFmWarps * 32);
    static_assert(kRounds * kFmWarps * 32 == kFmKeys * kPieces, "whole rounds of copies");
    const __half* src = reinterpret_cast<const __half*>(cache.data) + first;
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
        const int idx = (int)threadIdx.x + i * kFmWarps * 32;
        const int j = idx / kPieces, c = idx % kPieces;
        const size_t row = cache_row(table, shift, k0 + min(j, valid - 1));
        __pipeline_memcpy_async(dst + j * fm_pitch<D>() + 8 * c, src + row * cache.dim + 8 * c,
                                16);
    }
}
#endif

__device__ __forceinline__ uint32_t pack_half2(float x, float y) {
    const __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&h);
}

constexpr float kLog2e = 1.4426950408889634f;

template <int D, bool kQuant>
__global__ void __launch_bounds__(kFmWarps * 32)
    flash_mma_kernel(const float* __restrict__ q, CacheView k_cache, CacheView v_cache,
                     FlashArgs a,
                     const int* __restrict__ pos, const int* __restrict__ table, int shift,
                     float* __restrict__ out) {
#if defined(ROCMFORGE_HIP_MMA)
    static_assert(D % 16 == 0 && D <= 128, "heads of whole k-steps");
    constexpr int kPitch = fm_pitch<D>();
    constexpr int kTile = kFmKeys * kPitch;  // halves of a staged tile
    extern __shared__ __align__(16) __half fm_smem[];
    rf_chain_wait();
    const int group = a.n_heads / a.n_kv_heads;
    const int kvh = blockIdx.y;
    const int row0 = (gridDim.x - 1 - blockIdx.x) * kFmRows;
    const int rows_here = min(kFmRows, a.n_tokens * group - row0);
    const int base = pos[0];
    const int first_pos = base + row0 / group;
    const int last_pos = base + (row0 + rows_here - 1) / group;
    const int lo_tile = a.window > 0 ? max(0, first_pos - a.window + 1) : 0;
    const int tiles = (last_pos - lo_tile) / kFmKeys + 1;

    // Tile t's keys and values into stage t % 2, as one group of copies.
    auto stage = [&](int t) {
        const int k0 = lo_tile + t * kFmKeys;
        const int valid = min(kFmKeys, last_pos - k0 + 1);
        __half* kt = fm_smem + (t & 1) * 2 * kTile;
        if constexpr (kQuant) {
            flash_stage<true, kFmKeys>(k_cache, a.k_type, table, shift, k0, kvh * D, D, valid,
                                       reinterpret_cast<uint32_t*>(kt), kPitch / 2);
            flash_stage<true, kFmKeys>(v_cache, a.v_type, table, shift, k0, kvh * D, D, valid,
                                       reinterpret_cast<uint32_t*>(kt + kTile), kPitch / 2);
        } else {
            fm_stage_async<D>(k_cache, table, shift, k0, kvh * D, valid, kt);
            fm_stage_async<D>(v_cache, table, shift, k0, kvh * D, valid, kt + kTile);
        }
        __pipeline_commit();
    };
    stage(0);

    // The queries as f16 into the second stage's key tile, four values a thread a round,
    // every round's read in flight before the first is stored.
    __half* const qs = fm_smem + 2 * kTile;
    constexpr int kQRounds = kFmRows * (D / 4) / (kFmWarps * 32);
    static_assert(kQRounds * kFmWarps * 32 == kFmRows * (D / 4), "whole rounds of queries");
    float4 qv[kQRounds];
#pragma unroll
    for (int i = 0; i < kQRounds; ++i) {
        const int idx = (int)threadIdx.x + i * kFmWarps * 32;
        const int r = idx / (D / 4), c = idx % (D / 4);
        qv[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < rows_here) {
            const int row = row0 + r;
            const int token = row / group, h = kvh * group + row % group;
            qv[i] = *reinterpret_cast<const float4*>(q + ((size_t)token * a.n_heads + h) * D + 4 * c);
        }
    }
#pragma unroll
    for (int i = 0; i < kQRounds; ++i) {
        const int idx = (int)threadIdx.x + i * kFmWarps * 32;
        const int r = idx / (D / 4), c = idx % (D / 4);
        *reinterpret_cast<uint2*>(&qs[r * kPitch + 4 * c]) =
            make_uint2(pack_half2(qv[i].x, qv[i].y), pack_half2(qv[i].z, qv[i].w));
    }
    __syncthreads();
    const int w = threadIdx.x / 32, lane = threadIdx.x & 31;
    uint32_t qa[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        rf_ldmatrix_x4(qa[kk], &qs[(16 * w + (lane & 15)) * kPitch + 16 * kk + (lane >> 4) * 8]);
    }
    __syncthreads();  // the queries are read before the second tile lands in their place
    // This lane's two rows (16w + lane/4, and 8 below): their visible keys, running maxima
    // (base 2) and this lane's share of their sums.
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
    const int seen_lo = max(lo[0], lo[1]), seen_hi = min(hi[0], hi[1]);
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
    }
    const float scale2 = a.scale * kLog2e;

    for (int t = 0; t < tiles; ++t) {
        if (t + 1 < tiles) {
            stage(t + 1);
        } else {
            __pipeline_commit();  // an empty group keeps the count of groups in flight
        }
        __pipeline_wait_prior(1);
        __syncthreads();
        const int k0 = lo_tile + t * kFmKeys;
        const __half* ks = fm_smem + (t & 1) * 2 * kTile;
        const __half* vs = ks + kTile;
        // Scores: keys 8n .. 8n + 7 of the tile in s[n].
        float s[kFmKeys / 8][4];
#pragma unroll
        for (int n = 0; n < kFmKeys / 8; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) s[n][i] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int n = 0; n < kFmKeys / 8; n += 2) {
                uint32_t b[4];
                const int key = 8 * n + (lane & 7) + ((lane >> 4) << 3);
                rf_ldmatrix_x4(b, &ks[key * kPitch + 16 * kk + ((lane >> 3) & 1) * 8]);
                rf_mma_16816(s[n], qa[kk], b[0], b[1]);
                rf_mma_16816(s[n + 1], qa[kk], b[2], b[3]);
            }
        }
        // Whether every row of the warp sees every key of the tile (no masks to apply).
        const bool whole =
            __all_sync(0xffffffffu, k0 >= seen_lo && k0 + kFmKeys - 1 <= seen_hi);
        // Online softmax of each of the two rows over the tile, in base 2.
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int n = 0; n < kFmKeys / 8; ++n) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int key = k0 + 8 * n + 2 * (lane & 3) + c;
                    const bool seen = whole || (key >= lo[e] && key <= hi[e]);
                    const float raw = s[n][2 * e + c];
                    const float v = !seen ? -INFINITY
                                    : a.softcap > 0.0f
                                        ? scaled_score(raw, a.softcap, a.scale) * kLog2e
                                        : raw * scale2;
                    s[n][2 * e + c] = v;
                    tile_max = fmaxf(tile_max, v);
                }
            }
            tile_max = fmaxf(tile_max, rf_shfl_xor(tile_max, 1));
            tile_max = fmaxf(tile_max, rf_shfl_xor(tile_max, 2));
            const float m_new = fmaxf(m[e], tile_max);
            // No key of this row yet (m_new = -inf): nothing to rescale, nothing to add.
            const float corr = m_new == -INFINITY ? 1.0f : exp2f(m[e] - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < kFmKeys / 8; ++n) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float v = s[n][2 * e + c];
                    const float p = v == -INFINITY ? 0.0f : exp2f(v - m_new);
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
        for (int j = 0; j < kFmKeys / 16; ++j) {
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
        __syncthreads();  // every warp is done with this stage before it is staged again
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
        const float inv =
            1.0f / (a.sinks ? total + exp2f(a.sinks[h] * kLog2e - m[e]) : total);
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

// flash_mma_kernel<D, kQuant> on `grid`, its shared memory limit raised first (once a
// device).
template <int D, bool kQuant>
static hipError_t launch_flash_mma(dim3 grid, hipStream_t s, const float* q, CacheView kc,
                                   CacheView vc, const FlashArgs& a, const int* pos,
                                   const int* table, int shift, float* out) {
    static std::atomic<unsigned long long> raised{0};
    constexpr int bytes = fm_shared_bytes<D>();
    const hipError_t status = rf_raise_shared_memory(flash_mma_kernel<D, kQuant>, bytes, raised);
    if (status != hipSuccess) return status;
    rfLaunchChained((flash_mma_kernel<D, kQuant>), grid, dim3(kFmWarps * 32), (size_t)bytes, s,
                    q, kc, vc, a, pos, table, shift, out);
    return hipGetLastError();
}

// Launches the instance of the tiled kernels for the shapes: the launch's status.
template <bool kQuant>
static hipError_t launch_flash(const void* q, CacheView kc, CacheView vc, FlashArgs a, int rows,
                               int widest, const void* pos, const void* table, int shift,
                               void* out, int allow_mma, hipStream_t s) {
    const int head_dim = a.head_dim, head_dim_v = a.head_dim_v, n_kv_heads = a.n_kv_heads;
    const dim3 block(kFlashThreads);
    // On the matrix units where the device has them and the keys and values are heads
    // of the same whole k-steps.
    if (allow_mma && rf_mma_available() && head_dim == head_dim_v &&
        (head_dim == 32 || head_dim == 64 || head_dim == 128)) {
        const dim3 grid((rows + kFmRows - 1) / kFmRows, n_kv_heads);
        const int* pp = (const int*)pos;
        const int* tp = (const int*)table;
        float* o = (float*)out;
        const float* qp = (const float*)q;
        if (head_dim == 32) return launch_flash_mma<32, kQuant>(grid, s, qp, kc, vc, a, pp, tp, shift, o);
        if (head_dim == 64) return launch_flash_mma<64, kQuant>(grid, s, qp, kc, vc, a, pp, tp, shift, o);
        return launch_flash_mma<128, kQuant>(grid, s, qp, kc, vc, a, pp, tp, shift, o);
    }
    // The instance whose rows are the widest head's: 64 rows a workgroup for heads up to
    // 64 wide, 32 up to 128, 16 up to 256.
    if (widest <= 64) {
        rfLaunchChained((flash_attention_kernel<16, 1, kQuant>), dim3((rows + 63) / 64, n_kv_heads), block,
                        0, s, (const float*)q, kc, vc, a, (const int*)pos, (const int*)table, shift, (float*)out);
    } else if (widest <= 128) {
        rfLaunchChained((flash_attention_kernel<8, 2, kQuant>), dim3((rows + 31) / 32, n_kv_heads), block,
                        0, s, (const float*)q, kc, vc, a, (const int*)pos, (const int*)table, shift, (float*)out);
    } else {
        rfLaunchChained((flash_attention_kernel<4, 4, kQuant>), dim3((rows + 15) / 16, n_kv_heads), block,
                        0, s, (const float*)q, kc, vc, a, (const int*)pos, (const int*)table, shift, (float*)out);
    }
    return hipGetLastError();
}

}  // namespace rf

using namespace rf;

extern "C" {

// allow_mma: whether the queries may take the matrix units where the device has them
// (0 measures or tests the other kernel on such a device).
int rf_flash_attention(const void* q, const void* k_cache, const void* v_cache, int k_type,
                       int v_type, int cache_positions, int n_tokens, int n_heads,
                       int n_kv_heads, int head_dim, int head_dim_v, int window, float scale,
                       float softcap, const void* sinks, const void* pos, const void* table,
                       int shift, void* out, int allow_mma, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    const int widest = max(head_dim, head_dim_v);
    if (n_tokens < 1 || n_kv_heads < 1 || n_heads % n_kv_heads != 0 || head_dim % 8 != 0 ||
        head_dim_v % 2 != 0 || head_dim < 8 || head_dim_v < 2 || widest > kAttnMaxHead ||
        (k_type != kCacheF16 && head_dim % 32 != 0) ||
        (v_type != kCacheF16 && head_dim_v % 32 != 0)) {
        return (int)hipErrorInvalidValue;
    }
    FlashArgs a = {n_tokens, n_heads, n_kv_heads, head_dim, head_dim_v, k_type,
                   v_type,   window,  scale,      softcap,  (const float*)sinks};
    const int rows = n_tokens * (n_heads / n_kv_heads);
    const hipStream_t s = (hipStream_t)stream;
    const CacheView kc = cache_view(k_cache, k_type, cache_positions, n_kv_heads * head_dim);
    const CacheView vc = cache_view(v_cache, v_type, cache_positions, n_kv_heads * head_dim_v);
    if (k_type != kCacheF16 || v_type != kCacheF16) {
        return (int)launch_flash<true>(q, kc, vc, a, rows, widest, pos, table, shift, out,
                                       allow_mma, s);
    }
    return (int)launch_flash<false>(q, kc, vc, a, rows, widest, pos, table, shift, out,
                                    allow_mma, s);
}

}  // extern "C"
