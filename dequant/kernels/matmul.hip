// matmul.hip: products of a quantized weight matrix with many tokens' activations (a
// prompt, or several sequences' tokens) on the matrix units, for batches past what the
// decode products (matvec.hip) take.
//
// The build compiles this file once per weight type, with RF_MATMUL_TYPE (its ggml code)
// and RF_MATMUL_NAME (its name in the launchers' names) defined, and once with
// RF_MATMUL_COMMON for the activations' conversion; each unit first gets the IQ tables
// (see build.rs), so every type the decoders handle multiplies here too. Each unit is a
// module of its own, and the runtimes load a module's code whole at the first use of any
// of its kernels: a model waits only for its own types' products (see build.rs).
//
// Activations. rf_row_scales turns each token's f32 activations into f16 once per
// product input (not once per weight tile): divided by a power of two per token (the one
// that brings the token's largest magnitude into [2^14, 2^15)), so that nothing
// overflows f16's range (65504), and rounded to f16. The products multiply their results
// by the same power of two: both steps are exact apart from the f16 rounding.
//
// Tiles. A workgroup of kMmThreads threads (8 warps) computes a tile of BM weight rows
// (128, or 64 when the matrix gives too few tiles to fill the device) for kMmTokens
// tokens, over steps of kMmK columns, through two shared-memory stages: while the matrix
// units multiply one step's tiles, the next step's activations arrive by asynchronous
// copies and its weights are decoded to f16 from their blocks (each thread eight values
// at a time, with the type's decode8) into the other stage. No weight is expanded
// outside shared memory. With the matrix units, the blocks themselves come ahead of
// their decoding: the raw bytes of the tile's rows for a chunk of kChunk columns (a
// super-block, or four blocks of 32) are copied asynchronously into shared memory one
// chunk ahead, so the decoders read shared memory and no step waits for device memory.
// The first weights are requested before the chained-launch wait: no kernel writes
// weights.
//
// Matrix units. On NVIDIA sm_80 and later: mma.sync m16n8k16 (f16 in, f32 accumulated),
// operands loaded with ldmatrix; each warp holds a (BM/2) × 32 block of the results in
// registers and writes it out itself. Elsewhere (AMD for now, older NVIDIA targets)
// the same tiles feed a loop of f32 multiply-adds: the same function, slower.
//
// Launchers (return the platform's native status):
//   rf_row_scales(x, n_tokens, cols, scales, x16, device, stream)      (common unit,
//   rf_quantize_q8k(x, n_tokens, cols, out, device, stream)             activations.h)
//   rf_matmul_NAME(weights, outs, rows, n_mats, cols, x16, scales, n_tokens, accumulate,
//                  partials, partial_floats, counters, n_counters, kernel, device, stream)
//             (partials/counters: room to split the columns, or null; kernel: 0 the
//             fastest for the type and count, 1 the tiled kernel, 2 the skinny one of
//             skinny.hip, refused where it does not apply)
//   rf_matmul_experts_NAME(weights, outs, n_mats, rows, cols, expert_bytes, experts,
//                  tiles, n_tiles, tile_tokens, order, slot_div, x16, scales, device,
//                  stream)
//   rf_matmul_experts_q8_NAME(weights, outs, n_mats, rows, cols, expert_bytes, tiles,
//                  n_tiles, tile_tokens, order, slot_div, xq, n_x, device, stream)
//             (MXFP4's from Q8 input, on the int8 matrix units: skinny_q8.h)
//             (a mixture of experts' routed products, by tiles of slots: see ExpertTiles)
//   rf_matmul_q8k_NAME(weights, outs, rows, n_mats, cols, xq, n_tokens, accumulate, device,
//                  stream)
//             (Q4_K's from Q8_K input, on the int8 matrix units: tiles_q8k.h)
// Each output: n_tokens × rows f32, token-major, as rf_matvec_NAME writes it.
#include "common.h"
#include "decode_legacy.h"
#include "decode_kquants.h"
#include "decode_iquants.h"

#include <atomic>
#include <type_traits>

#if defined(ROCMFORGE_HIP_MMA)
#define RF_MM_MMA 1
#endif

namespace rf {

constexpr int kMmThreads = 256;
constexpr int kMmTokens = 128;
constexpr int kMmK = 32;
// Row pitch of the f16 tiles in halves: 80 bytes, so the eight 16-byte rows a matrix
// load reads fall in distinct banks.
constexpr int kMmPitch = kMmK + 8;
constexpr int kMmStages = 2;

// Up to three matrices of one type and width multiplied in one launch (a layer's q, k
// and v, or gate and up): their row tiles are numbered one matrix after the other.
constexpr int kMmMaxMats = 3;
struct MatmulMats {
    const uint8_t* w[kMmMaxMats];
    float* y[kMmMaxMats];
    int rows[kMmMaxMats];
    int n;
};

// The matrix (0 to 2) of `mats` that row tile `tile` of a launch falls in, tiles of
// `tile_rows` rows numbered one matrix after the other; `tile` becomes the tile's index
// within that matrix. (Constant indices only, so that the arguments stay in the parameter
// space.)
__device__ __forceinline__ int matrix_of_tile(const MatmulMats& mats, int tile_rows, int& tile) {
    const int tiles0 = (mats.rows[0] + tile_rows - 1) / tile_rows;
    const int tiles1 = (mats.rows[1] + tile_rows - 1) / tile_rows;
    if (mats.n > 1 && tile >= tiles0) {
        tile -= tiles0;
        if (mats.n > 2 && tile >= tiles1) {
            tile -= tiles1;
            return 2;
        }
        return 1;
    }
    return 0;
}

}  // namespace rf

#include "matmul_decode.h"

namespace rf {

// The routed experts of a mixture of experts (rf_matmul_experts_NAME): token tile
// blockIdx.x is the tile (expert, first, count) of `tiles`, its tokens the slots
// order[first .. first + count) (at most kMmTokens), each matrix `experts` matrices one
// after the other, expert_bytes apart. A slot's activations are row slot / slot_div of
// the input (its token's, or with slot_div 1 its own), its results row `slot` of the
// output. A tile with no slots does nothing (the grid is sized for the most tiles a
// routing can take).
struct ExpertTiles {
    const int* tiles;
    const int* order;
    int slot_div;
    size_t expert_bytes;
};

// One result: y[token][row] = v · scale (+ what y holds).
__device__ __forceinline__ void put(float* __restrict__ y, int rows, int row, int tok,
                                    float v, const float* __restrict__ scales, int accumulate) {
    float* dst = y + (size_t)tok * rows + row;
    const float s = v * scales[tok];
    *dst = accumulate ? *dst + s : s;
}

// BM rows (64 or 128) × kMmTokens tokens a workgroup. Grid: x = token tiles (so that the
// workgroups sharing a weight tile run together and its blocks come from L2), y = row
// tiles. Dynamic shared memory: shared_bytes<F, BM>(staged) with staged = the matrix
// units' path (sm_80 and later).
//
// Split columns. With too few tiles to fill the device (a few tokens against a matrix of
// few rows), grid.z = `splits` workgroups share each tile, each over its own run of
// whole chunks of columns. They leave their sums in `partials` (one slot of kMmThreads ×
// the sums a thread holds, per split and tile, laid out so that each thread finds its
// own), count themselves in `counters[tile]` (zero between launches; the last resets
// it), and the last of a tile to finish adds the splits' sums in split order, so the
// result does not depend on which finished when, and writes the tile.
template <typename F>
__host__ __device__ constexpr int split_cols() {
    return Staging<F>::kBlocks ? Staging<F>::kChunk : kMmK;
}

//
// With kExperts, the workgroup's tokens are one tile of routed slots (ExpertTiles).
template <typename F, int BM, bool kExperts = false>
__global__ void __launch_bounds__(kMmThreads, 128 / BM + 1)
    matmul_kernel(MatmulMats mats, int cols, const __half* __restrict__ x,
                  const float* __restrict__ scales, int n_tokens, int accumulate, int splits,
                  float* partials, unsigned* counters, ExpertTiles et) {
    static_assert(kMmK % kGroup == 0 && kMmK % 16 == 0, "whole groups and matrix steps");
    // Weight groups of eight a step, per thread.
    constexpr int kWGroups = BM * (kMmK / kGroup) / kMmThreads;
    static_assert(kWGroups * kMmThreads == BM * (kMmK / kGroup), "whole weight groups");
    // 16-byte activation pieces a step, per thread.
    constexpr int kXPieces = kMmTokens * (kMmK / 8) / kMmThreads;
    static_assert(kXPieces * kMmThreads == kMmTokens * (kMmK / 8), "whole pieces");
    extern __shared__ __align__(16) uint8_t smem[];
    // Stage st's tiles (computed, not indexed: an array of pointers indexed at run time
    // would live in local memory).
    __half* const tiles = reinterpret_cast<__half*>(smem);
    auto wt = [&](int st) { return tiles + st * BM * kMmPitch; };
    auto xt = [&](int st) {
        return tiles + kMmStages * BM * kMmPitch + st * kMmTokens * kMmPitch;
    };

    // A tile of routed slots: its expert's matrices, and its slots in shared memory (the
    // tiles are written by the kernel before, so they are read after the wait). The
    // tokens are then numbered within the tile.
    int tok0 = blockIdx.x * kMmTokens;
    size_t expert_offset = 0;
    const int* slot_of = nullptr;
    if constexpr (kExperts) {
        rf_chain_wait();
        const int expert = et.tiles[3 * blockIdx.x];
        const int first = et.tiles[3 * blockIdx.x + 1];
        const int count = et.tiles[3 * blockIdx.x + 2];
        if (count <= 0) return;  // the whole workgroup leaves together
        __shared__ int slots[kMmTokens];
        for (int t = threadIdx.x; t < count; t += kMmThreads) slots[t] = et.order[first + t];
        __syncthreads();
        slot_of = slots;
        expert_offset = (size_t)expert * et.expert_bytes;
        tok0 = 0;
        n_tokens = count;
    }
    // The row of the input that token t of the tile reads.
    auto x_row = [&](int t) {
        if constexpr (kExperts) {
            return slot_of[t] / et.slot_div;
        } else {
            return tok0 + t;
        }
    };

    // The matrix this workgroup's row tile falls in, and the tile within it (chosen with
    // constant indices only, so that the arguments stay in the parameter space).
    int tile = (int)blockIdx.y;
    const int m = matrix_of_tile(mats, BM, tile);
    const uint8_t* __restrict__ w =
        (m == 0 ? mats.w[0] : (m == 1 ? mats.w[1] : mats.w[2])) + expert_offset;
    float* __restrict__ y = m == 0 ? mats.y[0] : (m == 1 ? mats.y[1] : mats.y[2]);
    const int rows = m == 0 ? mats.rows[0] : (m == 1 ? mats.rows[1] : mats.rows[2]);
    const int row0 = tile * BM;
    const size_t row_bytes = (size_t)(cols / F::kValues) * F::kBytes;
    const int steps = (cols + kMmK - 1) / kMmK;
    // This workgroup's steps: its split's run of whole units of split_cols columns.
    constexpr int kUnitSteps = split_cols<F>() / kMmK;
    const int units = (cols + split_cols<F>() - 1) / split_cols<F>();
    const int split = (int)blockIdx.z;
    const int s0 = min(steps, split * units / splits * kUnitSteps);
    const int s1 = min(steps, (split + 1) * units / splits * kUnitSteps);

#if defined(RF_MM_MMA)
    using S = Staging<F>;
    constexpr bool kStaged = S::kBlocks;
    constexpr int kStepsPerChunk = kStaged ? S::kChunk / kMmK : 1;
    // Chunk c's raw blocks: raw(c % 2).
    auto raw = [&](int c) { return smem + tile_bytes<BM>() + (c & 1) * BM * S::kPitch; };
    const uint8_t* w_end = w + (size_t)rows * row_bytes;
    // The raw blocks of chunk c of the tile's rows into raw[c % 2], as one copy group.
    auto request = [&](int c) {
        if (kStaged && c * S::kChunk < cols) {
            constexpr int kPieces = S::kPieces;
            for (int p = threadIdx.x; p < BM * kPieces; p += kMmThreads) {
                const int r = p / kPieces, j = p % kPieces;
                const uint8_t* first =
                    w + (size_t)min(row0 + r, rows - 1) * row_bytes + (size_t)c * S::kBytes;
                const uint8_t* src =
                    reinterpret_cast<const uint8_t*>((uintptr_t)first & ~(uintptr_t)15) + 16 * j;
                const long long left = (long long)(w_end - src);
                const int bytes = left <= 0 ? 0 : (left >= 16 ? 16 : (int)left);
                copy16_async(raw(c) + r * S::kPitch + 16 * j, bytes ? src : w, bytes);
            }
        }
        copies_commit();
    };
#endif

    // This thread's weight groups: row r, columns kk..kk+8 of each step, consecutive in
    // the row (so that two of them share their block's scales).
    const uint8_t* wrow[kWGroups];
    int wr[kWGroups], wk[kWGroups];
#pragma unroll
    for (int i = 0; i < kWGroups; ++i) {
        const int g = threadIdx.x * kWGroups + i;
        wr[i] = g / (kMmK / kGroup);
        wk[i] = (g % (kMmK / kGroup)) * kGroup;
        // A row past the end decodes the last row again; its results are dropped.
        const int row = min(row0 + wr[i], rows - 1);
        wrow[i] = w + (size_t)row * row_bytes;
    }
    // The block that holds column k of group i's row.
    auto block_at = [&](int i, int k) {
        const uint8_t* blk = wrow[i] + (size_t)(k / F::kValues) * F::kBytes;
#if defined(RF_MM_MMA)
        if (kStaged) {
            // The same block in its chunk's staged copy.
            const int c = k / S::kChunk;
            const uint8_t* first = wrow[i] + (size_t)c * S::kBytes;
            blk = raw(c) + wr[i] * S::kPitch + ((uintptr_t)first & 15) +
                  (k % S::kChunk) / F::kValues * F::kBytes;
        }
#endif
        return blk;
    };
    uint4 staged[kWGroups];
    auto decode = [&](int step) {
        if constexpr (HalfDecode<F>::kHas && kWGroups == 2) {
            // Sixteen values of one block (blocks of these types hold whole multiples of
            // 32 columns, and cols is a multiple of 32).
            const int k = step * kMmK + wk[0];
            if (k < cols) {
                HalfDecode<F>::decode16h(block_at(0, k), k % F::kValues, staged);
            } else {
                staged[0] = staged[1] = make_uint4(0u, 0u, 0u, 0u);
            }
            return;
        }
#pragma unroll
        for (int i = 0; i < kWGroups; ++i) {
            const int k = step * kMmK + wk[i];
            float v[kGroup];
            if (k < cols) {
                const uint8_t* blk = block_at(i, k);
                if constexpr (HalfDecode<F>::kHas) {
                    staged[i] = HalfDecode<F>::decode8h(blk, k % F::kValues);
                    continue;
                }
                F::decode8(blk, k % F::kValues, v);
            } else {
#pragma unroll
                for (int j = 0; j < kGroup; ++j) v[j] = 0.0f;
            }
            staged[i] = pack8(v);
        }
    };
    auto store = [&](int stage) {
#pragma unroll
        for (int i = 0; i < kWGroups; ++i) {
            *reinterpret_cast<uint4*>(&wt(stage)[wr[i] * kMmPitch + wk[i]]) = staged[i];
        }
    };
    // Activations: 16-byte pieces (eight values) of the step's kMmK columns per token.
    auto fetch = [&](int step, int stage) {
#pragma unroll
        for (int i = 0; i < kXPieces; ++i) {
            const int p = threadIdx.x + i * kMmThreads;
            const int t = p / (kMmK / 8), kk = (p % (kMmK / 8)) * 8;
            const int k = step * kMmK + kk;
            // A token past the batch reads as zeros, not as a copy of the last token's
            // values: every workgroup reading that one row for all its empty places
            // would queue them all on one slice of the L2 cache (a batch of 16 took
            // three times as long as one of 128).
            const bool valid = k < cols && tok0 + t < n_tokens;
            const __half* src = valid ? x + (size_t)x_row(t) * cols + k : x;
            __half* dst = &xt(stage)[t * kMmPitch + kk];
#if defined(RF_MM_MMA)
            copy16_async(dst, src, valid ? 16 : 0);
#else
            *reinterpret_cast<uint4*>(dst) =
                valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#endif
        }
    };

#if defined(RF_MM_MMA)
    // Copy groups, in the order committed: the first two chunks, the first activations;
    // then each step the next step's activations and (maybe empty) the chunk after next.
    // At the end of a step all but the newest group have landed: the next activations,
    // and the chunk the next decode reads (requested a whole chunk of steps before).
    request(s0 / kStepsPerChunk);
    request(s0 / kStepsPerChunk + 1);
    copies_wait<1>();
    __syncthreads();  // the first chunk, copied by every thread, is complete for all
    decode(s0);
    rf_chain_wait();
    store(0);
    fetch(s0, 0);
    copies_commit();
    copies_wait<0>();
#else
    decode(s0);
    rf_chain_wait();
    store(0);
    fetch(s0, 0);
#endif

#if defined(RF_MM_MMA)
    // Warp wp: rows wrow0 .. + BM/2, tokens wtok0 .. + 32; MT tiles of 16 rows × four of 8
    // tokens.
    constexpr int MT = BM / 32;
    const int lane = threadIdx.x % 32, wp = threadIdx.x / 32;
    const int wrow0 = (wp % 2) * (BM / 2), wtok0 = (wp / 2) * 32;
    float acc[MT][4][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;
        }
    }
#else
    // Thread t: row t % BM, tokens (t / BM) · TPT .. + TPT.
    constexpr int TPT = kMmTokens * BM / kMmThreads;
    const int fr = threadIdx.x % BM, fc = (threadIdx.x / BM) * TPT;
    float acc[TPT];
#pragma unroll
    for (int i = 0; i < TPT; ++i) acc[i] = 0.0f;
#endif
    __syncthreads();

    for (int step = s0; step < s1; ++step) {
        const int cur = (step - s0) & 1, next = cur ^ 1;
        const bool more = step + 1 < s1;
#if defined(RF_MM_MMA)
        if (more) fetch(step + 1, next);
        copies_commit();
        // The step before a chunk's first requests the chunk after it, into the buffer
        // of the chunk this step has finished decoding from.
        if ((step + 1) % kStepsPerChunk == 0) {
            request((step + 1) / kStepsPerChunk + 1);
        } else {
            copies_commit();
        }
        if (more) decode(step + 1);
        // A warp whose tokens are all past the batch has nothing to multiply (the decode
        // above is the whole workgroup's, so it still takes part in that), and one whose
        // tokens end inside its 32 multiplies the groups of 16 that hold any. The loops
        // of a warp with all 32 carry no test, so that they unroll whole.
        auto multiply = [&](auto whole) {
#pragma unroll
            for (int ks = 0; ks < kMmK; ks += 16) {
                uint32_t a[MT][4];
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    const int r = wrow0 + 16 * m + (lane & 15);
                    rf_ldmatrix_x4(a[m], &wt(cur)[r * kMmPitch + ks + (lane >> 4) * 8]);
                }
#pragma unroll
                for (int n = 0; n < 4; n += 2) {
                    if (!decltype(whole)::value && tok0 + wtok0 + 8 * n >= n_tokens) break;
                    // Tokens wtok0 + 8n .. + 16: (k 0-7, k 8-15) of the first 8, then of
                    // the next.
                    uint32_t b[4];
                    const int t = wtok0 + 8 * n + (lane & 7) + ((lane >> 4) << 3);
                    rf_ldmatrix_x4(b, &xt(cur)[t * kMmPitch + ks + ((lane >> 3) & 1) * 8]);
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        rf_mma_16816(acc[m][n], a[m], b[0], b[1]);
                        rf_mma_16816(acc[m][n + 1], a[m], b[2], b[3]);
                    }
                }
            }
        };
        if (tok0 + wtok0 + 32 <= n_tokens) {
            multiply(std::true_type{});
        } else if (tok0 + wtok0 < n_tokens) {
            multiply(std::false_type{});
        }
        if (more) store(next);
        copies_wait<1>();
#else
        if (more) {
            fetch(step + 1, next);
            decode(step + 1);
        }
        for (int kk = 0; kk < kMmK; ++kk) {
            const float a = __half2float(wt(cur)[fr * kMmPitch + kk]);
#pragma unroll
            for (int i = 0; i < TPT; ++i) {
                acc[i] += a * __half2float(xt(cur)[(fc + i) * kMmPitch + kk]);
            }
        }
        if (more) store(next);
#endif
        // The next stage is complete, and this one read, before anyone goes on.
        __syncthreads();
    }

    if (splits > 1) {
        // Each thread's sums, visited in one fixed order with constant indices (so that
        // they stay in registers).
        auto each_sum = [&](auto&& f) {
#if defined(RF_MM_MMA)
#pragma unroll
            for (int m = 0; m < MT; ++m) {
#pragma unroll
                for (int n = 0; n < 4; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) f(acc[m][n][e], (m * 4 + n) * 4 + e);
                }
            }
#else
#pragma unroll
            for (int i = 0; i < TPT; ++i) f(acc[i], i);
#endif
        };
#if defined(RF_MM_MMA)
        constexpr int kSums = MT * 16;
#else
        constexpr int kSums = TPT;
#endif
        const int n_tiles = (int)(gridDim.x * gridDim.y);
        const int tile_id = (int)(blockIdx.y * gridDim.x + blockIdx.x);
        const size_t slot = (size_t)kMmThreads * kSums;
        float* mine = partials + ((size_t)split * n_tiles + tile_id) * slot + threadIdx.x;
        each_sum([&](float& v, int i) { mine[(size_t)i * kMmThreads] = v; });
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
        each_sum([&](float& v, int i) {
            float sum = 0.0f;
            for (int z = 0; z < splits; ++z) sum += all[z * split_stride + (size_t)i * kMmThreads];
            v = sum;
        });
    }

#if defined(RF_MM_MMA)
    // Fragment element e of tile (m, n): row + 8·(e / 2), token + e % 2.
    const int g = lane / 4, q = lane % 4;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row0 + wrow0 + 16 * m + g + 8 * (e / 2);
                const int tok = tok0 + wtok0 + 8 * n + 2 * q + (e % 2);
                if (row < rows && tok < n_tokens) {
                    if constexpr (kExperts) {
                        y[(size_t)slot_of[tok] * rows + row] = acc[m][n][e] * scales[x_row(tok)];
                    } else {
                        put(y, rows, row, tok, acc[m][n][e], scales, accumulate);
                    }
                }
            }
        }
    }
#else
    const int row = row0 + fr;
#pragma unroll
    for (int i = 0; i < TPT; ++i) {
        const int tok = tok0 + fc + i;
        if (row < rows && tok < n_tokens) {
            if constexpr (kExperts) {
                y[(size_t)slot_of[tok] * rows + row] = acc[i] * scales[x_row(tok)];
            } else {
                put(y, rows, row, tok, acc[i], scales, accumulate);
            }
        }
    }
#endif
}

// What the launches need to know of a device, asked once: its multiprocessors, and
// whether its code takes the matrix units' path (NVIDIA compute capability 8.0 and later),
// which stages the blocks in more shared memory.
struct DeviceFacts {
    int multiprocessors;
    bool staged;
};
inline DeviceFacts device_facts(int device) {
    static std::atomic<int> known[64];  // per device: 0 not asked, else facts + 1
    if (device < 0 || device >= 64) return DeviceFacts{0, false};
    int v = known[device].load(std::memory_order_relaxed);
    if (v == 0) {
        hipDeviceProp_t props;
        if (hipGetDeviceProperties(&props, device) != hipSuccess) return DeviceFacts{0, false};
        bool staged = false;
#if defined(ROCMFORGE_HIP_NVIDIA)
        staged = props.major >= 8;
#endif
        v = 1 + 2 * props.multiProcessorCount + (staged ? 1 : 0);
        known[device].store(v, std::memory_order_relaxed);
    }
    return DeviceFacts{(v - 1) / 2, ((v - 1) & 1) != 0};
}

}  // namespace rf

#include "skinny.hip"
#include "skinny_q8.h"
#include "matmul_launch.h"
#include "tiles_q8k.h"

#if defined(RF_MATMUL_COMMON)

#include "activations.h"

// Whether the skinny kernels run on `device` (1) or not (0): NVIDIA, compute capability
// 8.0 and later.
extern "C" int rf_matmul_skinny_available(int device) {
#if defined(ROCMFORGE_HIP_NVIDIA)
    return rf::device_facts(device).staged ? 1 : 0;
#else
    (void)device;
    return 0;
#endif
}

#elif defined(RF_MATMUL_TYPE) && defined(RF_MATMUL_NAME)

namespace rf {

// The format of each ggml type code (GgmlType in gguf-format) that has products.
template <int kCode>
struct MatmulFormat;
#define RF_MATMUL_FORMAT_OF(code, F) \
    template <>                      \
    struct MatmulFormat<code> {      \
        using Format = F;            \
    };
RF_MATMUL_FORMAT_OF(0, PlainBlocks<PlainF32>)
RF_MATMUL_FORMAT_OF(1, PlainBlocks<PlainF16>)
RF_MATMUL_FORMAT_OF(2, Q4_0)
RF_MATMUL_FORMAT_OF(3, Q4_1)
RF_MATMUL_FORMAT_OF(6, Q5_0)
RF_MATMUL_FORMAT_OF(7, Q5_1)
RF_MATMUL_FORMAT_OF(8, Q8_0)
RF_MATMUL_FORMAT_OF(10, Q2_K)
RF_MATMUL_FORMAT_OF(11, Q3_K)
RF_MATMUL_FORMAT_OF(12, Q4_K)
RF_MATMUL_FORMAT_OF(13, Q5_K)
RF_MATMUL_FORMAT_OF(14, Q6_K)
RF_MATMUL_FORMAT_OF(16, IQ2_XXS)
RF_MATMUL_FORMAT_OF(17, IQ2_XS)
RF_MATMUL_FORMAT_OF(18, IQ3_XXS)
RF_MATMUL_FORMAT_OF(19, IQ1_S)
RF_MATMUL_FORMAT_OF(20, IQ4_NL)
RF_MATMUL_FORMAT_OF(21, IQ3_S)
RF_MATMUL_FORMAT_OF(22, IQ2_S)
RF_MATMUL_FORMAT_OF(23, IQ4_XS)
RF_MATMUL_FORMAT_OF(29, IQ1_M)
RF_MATMUL_FORMAT_OF(30, PlainBlocks<PlainBF16>)
RF_MATMUL_FORMAT_OF(39, MXFP4)
#undef RF_MATMUL_FORMAT_OF

using UnitFormat = MatmulFormat<RF_MATMUL_TYPE>::Format;

}  // namespace rf

#define RF_MATMUL_JOIN2(a, b) a##_##b
#define RF_MATMUL_JOIN(a, b) RF_MATMUL_JOIN2(a, b)

// `weights`, `outs` and `rows` hold n_mats (1 to 3) matrices of this unit's type and one
// width.
extern "C" int RF_MATMUL_JOIN(rf_matmul, RF_MATMUL_NAME)(
    const void* const* weights, void* const* outs, const int* rows, int n_mats, int cols,
    const void* x16, const void* scales, int n_tokens, int accumulate, void* partials,
    long long partial_floats, void* counters, int n_counters, int kernel, int device,
    void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n_mats < 1 || n_mats > rf::kMmMaxMats || cols < 1 || n_tokens < 1 ||
        cols % rf::kGroup != 0 || kernel < rf::kMatmulAuto || kernel > rf::kMatmulSkinny) {
        return (int)hipErrorInvalidValue;
    }
    rf::MatmulMats mats = {};
    mats.n = n_mats;
    for (int m = 0; m < n_mats; ++m) {
        if (rows[m] < 1) return (int)hipErrorInvalidValue;
        mats.w[m] = (const uint8_t*)weights[m];
        mats.y[m] = (float*)outs[m];
        mats.rows[m] = rows[m];
    }
    const rf::SplitRoom room = {(float*)partials, partial_floats, (unsigned*)counters,
                                n_counters};
    return (int)rf::launch_matmul<rf::UnitFormat>(mats, cols, (const __half*)x16,
                                                  (const float*)scales, n_tokens, accumulate,
                                                  room, kernel, device, (hipStream_t)stream);
}

// The routed experts' products (ExpertTiles): `weights` and `outs` hold n_mats (1 or
// 2) tensors of `experts` matrices of `rows` × `cols`, expert_bytes apart; `tiles` holds
// n_tiles triples (at most tile_tokens slots each, at most kMmTokens), `order` the slots,
// `x16` and `scales` the input's rows as rf_row_scales makes them (row slot / slot_div
// for a slot). Each output: one row of `rows` f32 per slot.
extern "C" int RF_MATMUL_JOIN(rf_matmul_experts, RF_MATMUL_NAME)(
    const void* const* weights, void* const* outs, int n_mats, int rows, int cols,
    size_t expert_bytes, int experts, const void* tiles, int n_tiles, int tile_tokens,
    const void* order, int slot_div, const void* x16, const void* scales, int device,
    void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n_mats < 1 || n_mats > 2 || rows < 1 || cols < 1 || cols % rf::kGroup != 0 ||
        experts < 1 || n_tiles < 1 || slot_div < 1 || tile_tokens < 1 ||
        tile_tokens > rf::kMmTokens) {
        return (int)hipErrorInvalidValue;
    }
    rf::MatmulMats mats = {};
    mats.n = n_mats;
    for (int m = 0; m < n_mats; ++m) {
        mats.w[m] = (const uint8_t*)weights[m];
        mats.y[m] = (float*)outs[m];
        mats.rows[m] = rows;
    }
    const rf::ExpertTiles et = {(const int*)tiles, (const int*)order, slot_div, expert_bytes};
    return (int)rf::launch_matmul_experts<rf::UnitFormat>(
        mats, cols, (const __half*)x16, (const float*)scales, n_tiles, tile_tokens, experts, et,
        device, (hipStream_t)stream);
}

// The routed experts' products from Q8 input on the int8 matrix units (skinny_q8.h): as
// rf_matmul_experts_NAME, with `xq` the input's n_x rows of Q8 activation blocks and tiles of
// at most 64 slots. MXFP4 only, on NVIDIA sm_80 and later, for widths of whole pairs of
// blocks: elsewhere hipErrorInvalidValue.
extern "C" int RF_MATMUL_JOIN(rf_matmul_experts_q8, RF_MATMUL_NAME)(
    const void* const* weights, void* const* outs, int n_mats, int rows, int cols,
    size_t expert_bytes, const void* tiles, int n_tiles, int tile_tokens, const void* order,
    int slot_div, const void* xq, int n_x, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n_mats < 1 || n_mats > 2 || rows < 1 || cols < 1 || n_tiles < 1 || slot_div < 1 ||
        tile_tokens < 1 || n_x < 1) {
        return (int)hipErrorInvalidValue;
    }
    if constexpr (std::is_same<rf::UnitFormat, rf::MXFP4>::value) {
        rf::MatmulMats mats = {};
        mats.n = n_mats;
        for (int m = 0; m < n_mats; ++m) {
            mats.w[m] = (const uint8_t*)weights[m];
            mats.y[m] = (float*)outs[m];
            mats.rows[m] = rows;
        }
        const rf::ExpertTiles et = {(const int*)tiles, (const int*)order, slot_div,
                                    expert_bytes};
        return (int)rf::launch_skinny_q8<rf::MXFP4>(mats, cols, (const uint8_t*)xq, n_x,
                                                    n_tiles, tile_tokens, et,
                                                    rf::device_facts(device).staged,
                                                    (hipStream_t)stream);
    } else {
        (void)weights;
        (void)outs;
        (void)expert_bytes;
        (void)tiles;
        (void)order;
        (void)xq;
        (void)stream;
        return (int)hipErrorInvalidValue;
    }
}

// The products from Q8_K input on the int8 matrix units (tiles_q8k.h): as rf_matmul_NAME,
// with `xq` the n_tokens rows as rf_quantize_q8k makes them (and partials/counters the
// room to split the columns, or null). Q4_K only, on NVIDIA sm_80 and later, for widths
// of whole super-blocks from 16-byte aligned weights and input: elsewhere
// hipErrorInvalidValue.
extern "C" int RF_MATMUL_JOIN(rf_matmul_q8k, RF_MATMUL_NAME)(
    const void* const* weights, void* const* outs, const int* rows, int n_mats, int cols,
    const void* xq, int n_tokens, int accumulate, void* partials, long long partial_floats,
    void* counters, int n_counters, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n_mats < 1 || n_mats > rf::kMmMaxMats || cols < 1 || n_tokens < 1) {
        return (int)hipErrorInvalidValue;
    }
    if constexpr (std::is_same<rf::UnitFormat, rf::Q4_K>::value) {
        rf::MatmulMats mats = {};
        mats.n = n_mats;
        for (int m = 0; m < n_mats; ++m) {
            if (rows[m] < 1) return (int)hipErrorInvalidValue;
            mats.w[m] = (const uint8_t*)weights[m];
            mats.y[m] = (float*)outs[m];
            mats.rows[m] = rows[m];
        }
        const rf::SplitRoom room = {(float*)partials, partial_floats, (unsigned*)counters,
                                    n_counters};
        return (int)rf::launch_tiles_q8k<rf::Q4_K>(mats, cols, (const uint8_t*)xq, n_tokens,
                                                   accumulate, rf::device_facts(device), room,
                                                   (hipStream_t)stream);
    } else {
        (void)weights;
        (void)outs;
        (void)rows;
        (void)xq;
        (void)accumulate;
        (void)partials;
        (void)partial_floats;
        (void)counters;
        (void)n_counters;
        (void)stream;
        return (int)hipErrorInvalidValue;
    }
}

#else
#error "matmul.hip is built per unit: define RF_MATMUL_COMMON, or RF_MATMUL_TYPE and RF_MATMUL_NAME"
#endif
