// skinny_q8.h: a mixture's routed MXFP4 products on the int8 matrix units, from the Q8
// activation blocks the decode products take (matvec.hip: for n rows of `cols` values,
// the n·cols int8 values row by row, then one f32 scale per block of 32). Included by
// matmul.hip after skinny.hip; NVIDIA sm_80 and later.
//
// Why. MXFP4's values are E2M1 numbers, which doubled are the integers 0, ±1, ±2, ±3,
// ±4, ±6, ±8, ±12 (matvec_tasks.h's mxfp4_words turns four of them into int8 with a few
// byte permutes), and a block of 32 values shares one E8M0 scale: one m16n8k32 int8
// instruction covers exactly one block of 16 rows against one block of 8 tokens, and
// the two blocks' scales multiply its 32-bit sums afterwards, as the CPU's MXFP4 × Q8_0
// dot product applies them. The f16 path (skinny.hip) spends about six integer and half
// operations a weight turning it into f16; this one about one, and its instruction
// multiplies twice the values.
//
// Layout. As the skinny kernel's: a workgroup of kSkWarps warps takes one tile of up to
// 8·NT slots of one expert (ExpertTiles) and kSkRows of its rows, 16 a warp, and walks
// their columns in chunks of eight blocks with one barrier a chunk, the raw blocks and
// the slots' Q8 blocks arriving in shared memory by asynchronous copies two chunks
// ahead. Lane (g, q) takes bytes 4q .. 4q + 3 of each of its rows' blocks (whose low
// nibbles are the block's values 4q .. 4q + 3, their high ones 16 + 4q .. 16 + 4q + 3:
// the instruction's columns for a lane) and the same values of each token's Q8 block.
// A slot's staged chunk is its 256 int8 values, then the chunk's eight scales.
#ifndef ROCMFORGE_DEQUANT_SKINNY_Q8_H
#define ROCMFORGE_DEQUANT_SKINNY_Q8_H

#include "matvec_tasks.h"

namespace rf {

// Blocks of 32 values a chunk.
constexpr int kSq8Blocks = 8;


// Shared memory: stages of the chunk's raw MXFP4 blocks of kSkRows rows (a row's copy
// from the 16-byte boundary at or before its first byte: 136 bytes and up to 15 before
// them, and room for the last block's shifted word; 176 bytes apart, so that the eight
// rows a quarter-warp reads fall in distinct banks) and the chunk's int8 values and
// scales of 8·NT slots (304 bytes apart, for the same reason).
template <int NT>
struct Sq8Layout {
    static constexpr int kWPitch = 176;
    static constexpr int kScalesAt = kSq8Blocks * 32;
    static constexpr int kXPitch = kScalesAt + 4 * kSq8Blocks + 16;
    static constexpr int kWBytes = kSkRows * kWPitch;
    static constexpr int kXBytes = 8 * NT * kXPitch;
    static constexpr int kStageBytes = kWBytes + kXBytes;
    static constexpr int kStages = 3 * kStageBytes <= 113 * 1024 ? 3 : 2;
    static constexpr int kBytes = kStages * kStageBytes;
};

// The routed products of MXFP4 experts from Q8 input: grid x = the tiles of `et` (at most
// 8·NT slots each; a tile with no slots does nothing), y = tiles of kSkRows rows of the
// matrices (numbered one matrix after the other); kSkThreads threads; dynamic shared
// memory Sq8Layout<NT>::kBytes. Slot s reads row s / et.slot_div of the n_x rows of `xq`
// and writes row s of the output.
template <int NT>
__global__ void __launch_bounds__(kSkThreads)
    skinny_q8_kernel(MatmulMats mats, int cols, const uint8_t* __restrict__ xq, int n_x,
                     ExpertTiles et) {
#if defined(RF_MM_MMA)
    using L = Sq8Layout<NT>;
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int slot_of[8 * NT];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, q = lane % 4;

    int tile = (int)blockIdx.y;
    const int m = matrix_of_tile(mats, kSkRows, tile);
    // The tile's expert and slots (written by the kernel before: read after the wait).
    rf_chain_wait();
    const int expert = et.tiles[3 * blockIdx.x];
    const int first = et.tiles[3 * blockIdx.x + 1];
    const int count = min(et.tiles[3 * blockIdx.x + 2], 8 * NT);
    if (count <= 0) return;  // the whole workgroup leaves together
    for (int t = threadIdx.x; t < count; t += kSkThreads) slot_of[t] = et.order[first + t];
    __syncthreads();

    const uint8_t* __restrict__ w = (m == 0 ? mats.w[0] : (m == 1 ? mats.w[1] : mats.w[2])) +
                                    (size_t)expert * et.expert_bytes;
    float* __restrict__ y = m == 0 ? mats.y[0] : (m == 1 ? mats.y[1] : mats.y[2]);
    const int rows = m == 0 ? mats.rows[0] : (m == 1 ? mats.rows[1] : mats.rows[2]);
    const int tile_row0 = tile * kSkRows, row0 = tile_row0 + 16 * warp;
    const int n_blocks = cols / 32;
    const size_t row_bytes = (size_t)n_blocks * 17;
    const float* __restrict__ xd = reinterpret_cast<const float*>(xq + (size_t)n_x * cols);
    const uint8_t* w_end = w + (size_t)rows * row_bytes;
    const int chunks = (n_blocks + kSq8Blocks - 1) / kSq8Blocks;
    constexpr int kChunkBytes = kSq8Blocks * 17;

    auto w_stage = [&](int st) { return smem + st * L::kStageBytes; };
    auto x_stage = [&](int st) { return smem + st * L::kStageBytes + L::kWBytes; };
    // The raw blocks of chunk c of the tile's rows (rows past the end copy the last row
    // again; bytes past the expert's matrix read as zeros).
    auto copy_weights = [&](int c, int st) {
        if (c >= chunks) return;
        constexpr int kPieces = (kChunkBytes + 15 + 15) / 16;
        for (int p = threadIdx.x; p < kSkRows * kPieces; p += kSkThreads) {
            const int r = p / kPieces, j = p % kPieces;
            const uint8_t* at = w + (size_t)min(tile_row0 + r, rows - 1) * row_bytes +
                                (size_t)c * kChunkBytes;
            const uint8_t* src =
                reinterpret_cast<const uint8_t*>((uintptr_t)at & ~(uintptr_t)15) + 16 * j;
            const long long left = (long long)(w_end - src);
            const int bytes = left <= 0 ? 0 : (left >= 16 ? 16 : (int)left);
            copy16_async(w_stage(st) + r * L::kWPitch + 16 * j, bytes ? src : w, bytes);
        }
    };
    // The slots' int8 values of chunk c, in 16-byte pieces (the input starts 16-byte
    // aligned and its rows are a multiple of 64 values), and their scales, four bytes
    // each; zeros past the tile and past the row.
    auto copy_acts = [&](int c, int st) {
        if (c >= chunks) return;
        constexpr int kPieces = kSq8Blocks * 32 / 16;
        for (int p = threadIdx.x; p < 8 * NT * kPieces; p += kSkThreads) {
            const int t = p / kPieces, j = p % kPieces;
            const int k = c * kSq8Blocks * 32 + 16 * j;
            const bool valid = t < count && k < cols;
            const uint8_t* src =
                valid ? xq + (size_t)(slot_of[t] / et.slot_div) * cols + k : xq;
            copy16_async(x_stage(st) + t * L::kXPitch + 16 * j, src, valid ? 16 : 0);
        }
        for (int p = threadIdx.x; p < 8 * NT * kSq8Blocks; p += kSkThreads) {
            const int t = p / kSq8Blocks, b = c * kSq8Blocks + p % kSq8Blocks;
            const bool valid = t < count && b < n_blocks;
            const float* src =
                valid ? xd + (size_t)(slot_of[t] / et.slot_div) * n_blocks + b : xd;
            copy4_async(x_stage(st) + t * L::kXPitch + L::kScalesAt + 4 * (p % kSq8Blocks), src,
                        valid ? 4 : 0);
        }
    };

    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
    }
    const int live = min(NT, (count + 7) / 8);
    const bool busy = row0 < rows;

#pragma unroll
    for (int i = 0; i < L::kStages - 1; ++i) {
        copy_weights(i, i);
        copy_acts(i, i);
        copies_commit();
    }
    for (int c = 0; c < chunks; ++c) {
        const int st = c % L::kStages;
        copies_wait<L::kStages - 2>();
        __syncthreads();
        const int next = c + L::kStages - 1, next_st = next % L::kStages;
        copy_weights(next, next_st);
        copy_acts(next, next_st);
        copies_commit();
        if (!busy) continue;
        const uint8_t* at_lo =
            w + (size_t)min(row0 + g, rows - 1) * row_bytes + (size_t)c * kChunkBytes;
        const uint8_t* at_hi =
            w + (size_t)min(row0 + g + 8, rows - 1) * row_bytes + (size_t)c * kChunkBytes;
        const uint8_t* s_lo =
            w_stage(st) + (16 * warp + g) * L::kWPitch + ((uintptr_t)at_lo & 15);
        const uint8_t* s_hi =
            w_stage(st) + (16 * warp + g + 8) * L::kWPitch + ((uintptr_t)at_hi & 15);
        const uint8_t* xs = x_stage(st);
        const int blocks = min(kSq8Blocks, n_blocks - c * kSq8Blocks);
#pragma unroll
        for (int j = 0; j < kSq8Blocks; ++j) {
            if (j >= blocks) break;
            int lo[1], hi[1];
            load_words<1>(s_lo + 17 * j + 1 + 4 * q, lo);
            load_words<1>(s_hi + 17 * j + 1 + 4 * q, hi);
            uint32_t a[4];
            int v[4];
            mxfp4_words((uint32_t)lo[0], v[0], v[2]);
            mxfp4_words((uint32_t)hi[0], v[1], v[3]);
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = (uint32_t)v[i];
            const float d_lo = e8m0_to_f32_half(s_lo[17 * j]);
            const float d_hi = e8m0_to_f32_half(s_hi[17 * j]);
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                if (n >= live) break;
                const uint8_t* xb = xs + (8 * n + g) * L::kXPitch + 32 * j;
                const uint32_t b0 = *reinterpret_cast<const uint32_t*>(xb + 4 * q);
                const uint32_t b1 = *reinterpret_cast<const uint32_t*>(xb + 16 + 4 * q);
                int sums[4] = {0, 0, 0, 0};
                rf_mma_16832_s8(sums, a, b0, b1);
                const uint8_t* sd = xs + (8 * n + 2 * q) * L::kXPitch + L::kScalesAt + 4 * j;
                const float dx0 = *reinterpret_cast<const float*>(sd);
                const float dx1 = *reinterpret_cast<const float*>(sd + L::kXPitch);
                acc[n][0] = fmaf(d_lo * dx0, (float)sums[0], acc[n][0]);
                acc[n][1] = fmaf(d_lo * dx1, (float)sums[1], acc[n][1]);
                acc[n][2] = fmaf(d_hi * dx0, (float)sums[2], acc[n][2]);
                acc[n][3] = fmaf(d_hi * dx1, (float)sums[3], acc[n][3]);
            }
        }
    }
    copies_wait<0>();
    // Element e of token group n: row g + 8·(e / 2), token 2q + e % 2.
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + g + 8 * (e / 2);
            const int tok = 8 * n + 2 * q + (e % 2);
            if (row < rows && tok < count) y[(size_t)slot_of[tok] * rows + row] = acc[n][e];
        }
    }
#endif
}

template <int NT>
hipError_t launch_skinny_q8_nt(const MatmulMats& mats, int cols, const uint8_t* xq, int n_x,
                               int n_tiles, const ExpertTiles& et, hipStream_t stream) {
    long long tiles = 0;
    for (int m = 0; m < mats.n; ++m) tiles += (mats.rows[m] + kSkRows - 1) / kSkRows;
    const int bytes = Sq8Layout<NT>::kBytes;
#if defined(ROCMFORGE_HIP_NVIDIA)
    static std::atomic<unsigned long long> raised{0};
    if (bytes > 48 * 1024) {
        const hipError_t status = rf_raise_shared_memory(skinny_q8_kernel<NT>, bytes, raised);
        if (status != hipSuccess) return status;
    }
#endif
    const dim3 grid((unsigned)n_tiles, (unsigned)tiles, 1u);
    rfLaunchChained((skinny_q8_kernel<NT>), grid, dim3(kSkThreads), (size_t)bytes, stream, mats,
                    cols, xq, n_x, et);
    return hipGetLastError();
}

// The routed products of `n_tiles` tiles of up to `tile_tokens` slots (at most
// kSkinnyMaxTokens) of MXFP4 experts (F) from the Q8 input's n_x rows, where the device
// has the matrix units' path (`mma`), the width is whole pairs of blocks (so that every
// row of int8 values starts 16-byte aligned) and the input starts 16-byte aligned: else
// hipErrorInvalidValue. (A template, so that only the unit of MXFP4 compiles its kernels.)
template <typename F>
hipError_t launch_skinny_q8(const MatmulMats& mats, int cols, const uint8_t* xq, int n_x,
                            int n_tiles, int tile_tokens, const ExpertTiles& et, bool mma,
                            hipStream_t stream) {
    static_assert(std::is_same<F, MXFP4>::value, "the int8 routed products are MXFP4's");
    if (!mma || tile_tokens > kSkinnyMaxTokens || cols % 64 != 0 ||
        (uintptr_t)xq % 16 != 0) {
        return hipErrorInvalidValue;
    }
#define RF_SKINNY_Q8_NT(nt) \
    return launch_skinny_q8_nt<nt>(mats, cols, xq, n_x, n_tiles, et, stream)
    if (tile_tokens <= 8) RF_SKINNY_Q8_NT(1);
    if (tile_tokens <= 16) RF_SKINNY_Q8_NT(2);
    if (tile_tokens <= 32) RF_SKINNY_Q8_NT(4);
    RF_SKINNY_Q8_NT(8);
#undef RF_SKINNY_Q8_NT
}

}  // namespace rf

#endif  // ROCMFORGE_DEQUANT_SKINNY_Q8_H
