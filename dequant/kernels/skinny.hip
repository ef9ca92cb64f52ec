// skinny.hip: batch products of few tokens (a decode step of several sequences, up to a
// few dozen tokens) on the matrix units, straight from the weights' blocks into the
// matrix instructions' registers.
//
// Included by matmul.hip, which launches these kernels for batches of up to
// kSkinnyMaxTokens tokens on NVIDIA sm_80 and later, for the types with loads of their
// own below (skinny_takes); its inputs (the f16 activations and per-token scales of
// rf_row_scales), its outputs and its room to split the columns are the tiled kernel's.
//
// Why another kernel. With few tokens a product is bound by reading its weights once,
// not by arithmetic: the tiled kernel's barrier and decode into shared memory every 32
// columns, with two stages and 128-token tiles (mostly empty), leave the device waiting
// on each step's chain of copies. Here a workgroup of kSkWarps warps takes kSkRows rows
// (16 a warp, one m16n8k16 tile) and walks their columns in chunks of a super-block (or
// of eight 32-value blocks) with one barrier a chunk: the raw blocks of each chunk and
// the activations of its columns arrive in shared memory by asynchronous copies, two
// chunks ahead where there is room (kSkStages), while each warp decodes the chunk before
// them from shared memory straight to f16 in registers, in the very places the matrix
// instruction wants them: no f16 weight tile, no second pass through shared memory.
//
// Layout. A warp computes its 16 rows × 8·NT tokens over steps of 64 columns, four to a
// chunk. The grid is token groups × row tiles × column splits: when the row tiles alone
// would leave the device idle (a matrix of few rows) and the caller gives room, each
// split takes its own run of chunks, leaves its sums in the room, and the last of a
// tile to finish adds them in split order, as the tiled kernel does: results repeat bit
// for bit.
//
// Columns in any order. A sum over k does not care in which order k is visited, as long
// as both operands visit it in the same one. Lane (g, q) of an m16n8k16 instruction holds
// the weights of rows g and g + 8 at k-slots {2q, 2q+1, 2q+8, 2q+9} and the activations
// of token g at the same slots; here those slots mean the columns 4i + {0, 1, 2, 3} of
// the 16 consecutive columns 16q … 16q + 15 of the step (instruction i = 0 … 3). So each
// lane decodes 16 consecutive values of each of its two rows (a block's natural unit),
// and reads 32 consecutive bytes of each token's activations.
//
// The types with loads of their own, and each type's loads and decoders, are in
// skinny_rows.h.
#include <type_traits>

#include "skinny_rows.h"

namespace rf {

// Tokens a launch of the skinny kernel takes at most: the switch-over from the tiled
// kernel (measured on the H100 and H200: bench gpu_decode --products).
constexpr int kSkinnyMaxTokens = 64;
constexpr int kSkinnyK = 64;
constexpr int kSkWarps = 8;
constexpr int kSkThreads = 32 * kSkWarps;
constexpr int kSkRows = 16 * kSkWarps;

// A chunk of a type: the columns a workgroup stages at a time (a super-block, or eight
// blocks of 32, or 128 plain values), their bytes in a row, and the pitch of a row's copy
// in shared memory (room for the chunk from the 16-byte boundary at or before its first
// byte, in whole 16-byte pieces).
template <typename F>
struct SkChunk {
    static constexpr int kValues = F::kValues >= 32 ? 256 : 128;
    static constexpr int kBytes = kValues / F::kValues * F::kBytes;
    static constexpr int kPitch = (kBytes + 15 + 15) / 16 * 16;
    static constexpr int kSteps = kValues / kSkinnyK;
};

// Shared memory of a workgroup: kSkStages stages, each the chunk's blocks of kSkRows rows
// and its activations for 8·NT tokens (a row of kValues + 8 halves each, so that the
// eight tokens a quarter-warp reads fall in distinct banks). Three stages where they fit
// in a third of a multiprocessor's shared memory (about 113 KB), else two.
template <typename F, int NT>
struct SkLayout {
    static constexpr int kXPitch = SkChunk<F>::kValues + 8;
    static constexpr int kWBytes = kSkRows * SkChunk<F>::kPitch;
    static constexpr int kXBytes = 8 * NT * kXPitch * 2;
    static constexpr int kStageBytes = kWBytes + kXBytes;
    static constexpr int kStages = 3 * kStageBytes <= 113 * 1024 ? 3 : 2;
    static constexpr int kBytes = kStages * kStageBytes;
};

// The skinny product. Grid: x = token groups of 8·NT, y = tiles of kSkRows rows of the
// matrices (numbered one matrix after the other), z = column splits; kSkThreads threads;
// dynamic shared memory SkLayout<F, NT>::kBytes.
//
// With kExperts, a mixture's routed products: x is the tile (expert, first, count) of
// `et.tiles` (at most 8·NT slots, the slots order[first ..]), the matrices are the
// expert's (et.expert_bytes apart), slot s reads row s / et.slot_div of the input and
// writes row s of the output; unsplit. A tile with no slots does nothing.
template <typename F, int NT, bool kExperts = false>
__global__ void __launch_bounds__(kSkThreads)
    skinny_kernel(MatmulMats mats, int cols, const __half* __restrict__ x,
                  const float* __restrict__ scales, int n_tokens, int accumulate, int splits,
                  float* partials, unsigned* counters, ExpertTiles et) {
#if defined(RF_MM_MMA)
    using R = SkinnyRow<F>;
    using C = SkChunk<F>;
    using L = SkLayout<F, NT>;
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, q = lane % 4;

    int tile = (int)blockIdx.y;
    const int m = matrix_of_tile(mats, kSkRows, tile);
    // A tile of routed slots: its expert, and its slots in shared memory (the tiles are
    // written by the kernel before, so they are read after the wait, and no weight can
    // be asked for before it). Its tokens are then numbered within the tile.
    int tok0 = (int)blockIdx.x * 8 * NT;
    size_t expert_offset = 0;
    __shared__ int slot_of[kExperts ? 8 * NT : 1];
    if constexpr (kExperts) {
        rf_chain_wait();
        const int expert = et.tiles[3 * blockIdx.x];
        const int first = et.tiles[3 * blockIdx.x + 1];
        const int count = min(et.tiles[3 * blockIdx.x + 2], 8 * NT);
        if (count <= 0) return;  // the whole workgroup leaves together
        for (int t = threadIdx.x; t < count; t += kSkThreads) slot_of[t] = et.order[first + t];
        __syncthreads();
        expert_offset = (size_t)expert * et.expert_bytes;
        tok0 = 0;
        n_tokens = count;
    }
    // The row of the input that token t (counted from the launch's first) reads.
    auto x_row = [&](int t) {
        if constexpr (kExperts) {
            return slot_of[t] / et.slot_div;
        } else {
            return t;
        }
    };
    const uint8_t* __restrict__ w =
        (m == 0 ? mats.w[0] : (m == 1 ? mats.w[1] : mats.w[2])) + expert_offset;
    float* __restrict__ y = m == 0 ? mats.y[0] : (m == 1 ? mats.y[1] : mats.y[2]);
    const int rows = m == 0 ? mats.rows[0] : (m == 1 ? mats.rows[1] : mats.rows[2]);
    const int tile_row0 = tile * kSkRows, row0 = tile_row0 + 16 * warp;
    const size_t row_bytes = (size_t)(cols / F::kValues) * F::kBytes;
    const uint8_t* w_end = w + (size_t)rows * row_bytes;
    const int chunks = (cols + C::kValues - 1) / C::kValues;
    const int split = (int)blockIdx.z;
    const int c0 = split * chunks / splits, c1 = (split + 1) * chunks / splits;

    auto w_stage = [&](int st) { return smem + st * L::kStageBytes; };
    auto x_stage = [&](int st) {
        return reinterpret_cast<__half*>(smem + st * L::kStageBytes + L::kWBytes);
    };
    // The raw blocks of chunk c of the tile's rows (rows past the end copy the last row
    // again; bytes past the matrix read as zeros), 16-byte pieces from the boundary at or
    // before each row's first byte of the chunk.
    auto copy_weights = [&](int c, int st) {
        if (c >= c1) return;
        constexpr int kPieces = C::kPitch / 16;
        for (int p = threadIdx.x; p < kSkRows * kPieces; p += kSkThreads) {
            const int r = p / kPieces, j = p % kPieces;
            const uint8_t* first = w + (size_t)min(tile_row0 + r, rows - 1) * row_bytes +
                                   (size_t)c * C::kBytes;
            const uint8_t* src =
                reinterpret_cast<const uint8_t*>((uintptr_t)first & ~(uintptr_t)15) + 16 * j;
            const long long left = (long long)(w_end - src);
            const int bytes = left <= 0 ? 0 : (left >= 16 ? 16 : (int)left);
            copy16_async(w_stage(st) + r * C::kPitch + 16 * j, bytes ? src : w, bytes);
        }
    };
    // The activations of chunk c's columns: eight values a piece, zeros past the batch
    // and past the row.
    auto copy_acts = [&](int c, int st) {
        if (c >= c1) return;
        constexpr int kPieces = C::kValues / 8;
        for (int p = threadIdx.x; p < 8 * NT * kPieces; p += kSkThreads) {
            const int t = p / kPieces, kk = (p % kPieces) * 8;
            const int k = c * C::kValues + kk;
            const bool valid = k < cols && tok0 + t < n_tokens;
            const __half* src = valid ? x + (size_t)x_row(tok0 + t) * cols + k : x;
            copy16_async(x_stage(st) + t * L::kXPitch + kk, src, valid ? 16 : 0);
        }
    };

    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
    }
    // The token groups of 8 this workgroup has any of (the others skip their work), and
    // whether this warp has any rows (the others only copy and keep the books).
    const int live = min(NT, (n_tokens - tok0 + 7) / 8);
    const bool busy = row0 < rows;

    // Copy groups, one per chunk, in order: chunk c's activations (and, in the first
    // group, the weights of the first kSkStages - 1 chunks, requested before the
    // chained-launch wait: no kernel writes weights).
#pragma unroll
    for (int i = 0; i < L::kStages - 1; ++i) copy_weights(c0 + i, i);
    if constexpr (!kExperts) rf_chain_wait();
#pragma unroll
    for (int i = 0; i < L::kStages - 1; ++i) {
        copy_acts(c0 + i, i);
        copies_commit();
    }
    for (int c = c0; c < c1; ++c) {
        const int st = (c - c0) % L::kStages;
        // Chunk c has landed for every thread, and every warp is done with chunk c - 1,
        // whose stage the next request refills.
        copies_wait<L::kStages - 2>();
        __syncthreads();
        const int next = c + L::kStages - 1, next_st = (next - c0) % L::kStages;
        copy_weights(next, next_st);
        copy_acts(next, next_st);
        copies_commit();
        if (!busy) continue;
        const uint8_t* wst = w_stage(st);
        const uint8_t* first_lo = w + (size_t)min(row0 + g, rows - 1) * row_bytes +
                                  (size_t)c * C::kBytes;
        const uint8_t* first_hi = w + (size_t)min(row0 + g + 8, rows - 1) * row_bytes +
                                  (size_t)c * C::kBytes;
        const uint8_t* s_lo = wst + (16 * warp + g) * C::kPitch + ((uintptr_t)first_lo & 15);
        const uint8_t* s_hi = wst + (16 * warp + g + 8) * C::kPitch + ((uintptr_t)first_hi & 15);
        const __half* xs = x_stage(st);
        const int cols_left = cols - c * C::kValues;
#pragma unroll
        for (int j = 0; j < C::kSteps; ++j) {
            const int k = j * kSkinnyK + 16 * q;
            uint4 a_lo0, a_lo1, a_hi0, a_hi1;  // rows g and g + 8: values k..k+7, k+8..k+15
            R::decode(R::load(s_lo, k, cols_left), cols_left, a_lo0, a_lo1);
            R::decode(R::load(s_hi, k, cols_left), cols_left, a_hi0, a_hi1);
            const uint32_t a0[4] = {a_lo0.x, a_hi0.x, a_lo0.y, a_hi0.y};
            const uint32_t a1[4] = {a_lo0.z, a_hi0.z, a_lo0.w, a_hi0.w};
            const uint32_t a2[4] = {a_lo1.x, a_hi1.x, a_lo1.y, a_hi1.y};
            const uint32_t a3[4] = {a_lo1.z, a_hi1.z, a_lo1.w, a_hi1.w};
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                if (n >= live) break;
                const __half* xr = xs + (8 * n + g) * L::kXPitch + k;
                const uint4 b0 = *reinterpret_cast<const uint4*>(xr);
                const uint4 b1 = *reinterpret_cast<const uint4*>(xr + 8);
                rf_mma_16816(acc[n], a0, b0.x, b0.y);
                rf_mma_16816(acc[n], a1, b0.z, b0.w);
                rf_mma_16816(acc[n], a2, b1.x, b1.y);
                rf_mma_16816(acc[n], a3, b1.z, b1.w);
            }
        }
    }
    copies_wait<0>();

    if (splits > 1) {
        // Each thread's sums into its slot of this split's room, then the last workgroup
        // of the tile to finish adds every split's, in split order.
        const int n_tiles = (int)(gridDim.x * gridDim.y);
        const int tile_id = (int)(blockIdx.y * gridDim.x + blockIdx.x);
        const size_t slot = (size_t)kSkThreads * NT * 4;
        float* mine = partials + ((size_t)split * n_tiles + tile_id) * slot + threadIdx.x;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) mine[(size_t)(n * 4 + e) * kSkThreads] = acc[n][e];
        }
        __shared__ int last;
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned before = atomicAdd(&counters[tile_id], 1u);
            last = before == (unsigned)(splits - 1);
            if (last) counters[tile_id] = 0u;
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
        // The other splits' sums were written by other workgroups during this launch:
        // read them past this workgroup's cache, in split order.
        const volatile float* all = partials + (size_t)tile_id * slot + threadIdx.x;
        const size_t split_stride = (size_t)n_tiles * slot;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float sum = 0.0f;
                for (int z = 0; z < splits; ++z) {
                    sum += all[z * split_stride + (size_t)(n * 4 + e) * kSkThreads];
                }
                acc[n][e] = sum;
            }
        }
    }
    // Element e of token tile n: row g + 8·(e / 2), token 2q + e % 2.
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + g + 8 * (e / 2);
            const int tok = tok0 + 8 * n + 2 * q + (e % 2);
            if (row < rows && tok < n_tokens) {
                if constexpr (kExperts) {
                    y[(size_t)slot_of[tok] * rows + row] = acc[n][e] * scales[x_row(tok)];
                } else {
                    put(y, rows, row, tok, acc[n][e], scales, accumulate);
                }
            }
        }
    }
#endif
}

// Whether the skinny kernel takes a product of `n_tokens` tokens of this type: on the
// matrix units' path (`mma`), up to kSkinnyMaxTokens tokens, with rows of the alignment
// the type's loads need; and, unless `forced`, for the types with loads of their own
// (the others decode from device memory a byte at a time: slower than the tiled kernel).
template <typename F>
bool skinny_takes(const MatmulMats& mats, int n_tokens, bool mma, bool forced) {
#if defined(ROCMFORGE_HIP_NVIDIA)
    if (!mma || n_tokens > kSkinnyMaxTokens || !(forced || SkinnyFast<F>::value)) return false;
    for (int m = 0; m < mats.n; ++m) {
        if ((uintptr_t)mats.w[m] % SkinnyAlign<F>::value != 0) return false;
    }
    return true;
#else
    (void)mats;
    (void)n_tokens;
    (void)mma;
    (void)forced;
    return false;
#endif
}

template <typename F, int NT>
hipError_t launch_skinny_nt(const MatmulMats& mats, int cols, const __half* x,
                            const float* scales, int n_tokens, int accumulate, int multiprocessors,
                            float* partials, long long partial_floats, unsigned* counters,
                            int n_counters, hipStream_t stream) {
    long long tiles = 0;
    for (int m = 0; m < mats.n; ++m) tiles += (mats.rows[m] + kSkRows - 1) / kSkRows;
    const long long groups = (n_tokens + 8 * NT - 1) / (8 * NT);
    const long long chunks = (cols + SkChunk<F>::kValues - 1) / SkChunk<F>::kValues;
    const int bytes = SkLayout<F, NT>::kBytes;
#if defined(ROCMFORGE_HIP_NVIDIA)
    // Past 48 KB a kernel's dynamic shared memory needs raising its limit, once a device.
    static std::atomic<unsigned long long> raised{0};
    if (bytes > 48 * 1024) {
        const hipError_t status = rf_raise_shared_memory(skinny_kernel<F, NT>, bytes, raised);
        if (status != hipSuccess) return status;
    }
#endif
    // Splits, by waves: the grid runs in waves of the workgroups the device holds at once,
    // and a split of s takes ceil(chunks / s) chunks and about a chunk's time more
    // (filling its stages, handing its sums over), so the product takes about
    // ceil(wgs · s / resident) · (ceil(chunks / s) + 1) chunk times. The fewest of
    // those (the fewest splits on a tie), each split a run of at least two chunks, within
    // the room given. Splitting until the device held two workgroups a multiprocessor
    // left a 7B's products at 64 tokens 1.2-1.45 waves, the last mostly idle; by waves,
    // on the H200, batched decoding of 8 and 32 sequences went 8% and 5% faster.
    long long splits = 1;
    const long long wgs = tiles * groups;
    if (partials && counters && wgs <= n_counters) {
        const long long per_sm = rf_resident_workgroups<skinny_kernel<F, NT>>(kSkThreads, bytes);
        const long long resident = (long long)multiprocessors * per_sm;
        const long long fit = partial_floats / (wgs * kSkThreads * NT * 4);
        const long long most = max(1LL, min(min(chunks / 2, fit), 16LL));
        long long best = -1;
        for (long long s = 1; s <= most; ++s) {
            const long long waves = (wgs * s + resident - 1) / resident;
            const long long cost = waves * ((chunks + s - 1) / s + 1);
            if (best < 0 || cost < best) {
                best = cost;
                splits = s;
            }
        }
    }
    const dim3 grid((unsigned)groups, (unsigned)tiles, (unsigned)splits);
    rfLaunchChained((skinny_kernel<F, NT>), grid, dim3(kSkThreads), (size_t)bytes, stream, mats,
                    cols, x, scales, n_tokens, accumulate, (int)splits, partials, counters,
                    ExpertTiles{});
    return hipGetLastError();
}

template <typename F>
hipError_t launch_skinny(const MatmulMats& mats, int cols, const __half* x, const float* scales,
                         int n_tokens, int accumulate, int multiprocessors, float* partials,
                         long long partial_floats, unsigned* counters, int n_counters,
                         hipStream_t stream) {
#define RF_SKINNY_NT(nt)                                                                       \
    return launch_skinny_nt<F, nt>(mats, cols, x, scales, n_tokens, accumulate, multiprocessors, \
                                   partials, partial_floats, counters, n_counters, stream)
    // Past 32 tokens, groups of 32 (the weights of a tile come from L2 for the second):
    // on the H200 a 7B's Q6_K products at 64 tokens took 0.68-0.77x the time of groups of
    // 64 (which fit two stages and one workgroup a multiprocessor), its Q4_K ones 0.80x
    // to 1.10x, and batched decoding of 64 sequences went 6% faster.
    if (n_tokens <= 8) RF_SKINNY_NT(1);
    if (n_tokens <= 16) RF_SKINNY_NT(2);
    RF_SKINNY_NT(4);
#undef RF_SKINNY_NT
}

// Whether the skinny kernel takes a mixture's routed products in tiles of up to
// `tile_tokens` slots: as skinny_takes, with every expert's matrix aligned as the
// type's loads need.
template <typename F>
bool skinny_experts_take(const MatmulMats& mats, const ExpertTiles& et, int tile_tokens,
                         bool mma) {
    return tile_tokens <= kSkinnyMaxTokens && et.expert_bytes % SkinnyAlign<F>::value == 0 &&
           skinny_takes<F>(mats, tile_tokens, mma, false);
}

// The routed products of `n_tiles` tiles of up to `tile_tokens` slots (at most
// kSkinnyMaxTokens): grid x the tiles, y the row tiles of each matrix.
template <typename F, int NT>
hipError_t launch_skinny_experts_nt(const MatmulMats& mats, int cols, const __half* x,
                                    const float* scales, int n_tiles, const ExpertTiles& et,
                                    hipStream_t stream) {
    long long tiles = 0;
    for (int m = 0; m < mats.n; ++m) tiles += (mats.rows[m] + kSkRows - 1) / kSkRows;
    const int bytes = SkLayout<F, NT>::kBytes;
#if defined(ROCMFORGE_HIP_NVIDIA)
    static std::atomic<unsigned long long> raised{0};
    if (bytes > 48 * 1024) {
        const hipError_t status =
            rf_raise_shared_memory(skinny_kernel<F, NT, true>, bytes, raised);
        if (status != hipSuccess) return status;
    }
#endif
    const dim3 grid((unsigned)n_tiles, (unsigned)tiles, 1u);
    rfLaunchChained((skinny_kernel<F, NT, true>), grid, dim3(kSkThreads), (size_t)bytes, stream,
                    mats, cols, x, scales, 0, 0, 1, (float*)nullptr, (unsigned*)nullptr, et);
    return hipGetLastError();
}

template <typename F>
hipError_t launch_skinny_experts(const MatmulMats& mats, int cols, const __half* x,
                                 const float* scales, int n_tiles, int tile_tokens,
                                 const ExpertTiles& et, hipStream_t stream) {
#define RF_SKINNY_EXPERTS_NT(nt) \
    return launch_skinny_experts_nt<F, nt>(mats, cols, x, scales, n_tiles, et, stream)
    if (tile_tokens <= 8) RF_SKINNY_EXPERTS_NT(1);
    if (tile_tokens <= 16) RF_SKINNY_EXPERTS_NT(2);
    if (tile_tokens <= 32) RF_SKINNY_EXPERTS_NT(4);
    RF_SKINNY_EXPERTS_NT(8);
#undef RF_SKINNY_EXPERTS_NT
}

}  // namespace rf
