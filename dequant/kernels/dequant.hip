// dequant.hip: GPU decoders of every ggml type the CPU decodes, to f32 and to f16.
//
// The build script compiles this file through a generated translation unit that first
// includes the IQ lookup tables (constant memory, generated from src/decode/grids.rs),
// so the GPU and the CPU decode with the same tables.
//
// Kernels. Block formats run decode_tiles: each workgroup of 256 threads takes a tile of
// 2048 output values, copies the tile's blocks into shared memory with coalesced (16-byte
// when the source is aligned) loads, then each thread decodes one group of 8 values and
// writes it with 16-byte stores when the destination is aligned. Plain element types run
// convert_tiles: every thread converts 8 values, a warp reading and writing consecutive
// elements. Both loop over tiles, so a grid of at most kMaxGrid workgroups covers any
// length.
//
// Launchers. For each type NAME there are two C functions,
//   int rf_dequant_NAME_f32(const void* src, size_t n_blocks, void* dst, int device, void* stream)
//   int rf_dequant_NAME_f16(const void* src, size_t n_blocks, void* dst, int device, void* stream)
// src: n_blocks blocks of the type (any alignment for block formats; aligned to the
// element for plain types); dst: n_blocks * values-per-block f32 values or f16 bits (4-
// or 2-byte aligned); device: the ordinal the stream belongs to (made current before the
// launch); stream: a hipStream_t / cudaStream_t. They return the launch's status as the
// platform's native error code (0 on success). The Rust wrappers in src/gpu/kernels.rs
// are their only callers and check every length before calling.
#include "common.h"
#include "decode_legacy.h"
#include "decode_kquants.h"
#include "decode_iquants.h"

namespace rf {

template <typename F, typename Out>
__device__ __forceinline__ void decode_tiles(const uint8_t* __restrict__ src, size_t n_blocks,
                                             Out* __restrict__ dst) {
    static_assert(kTileValues % F::kValues == 0, "a tile holds whole blocks");
    constexpr int kBlocks = kTileValues / F::kValues;
    constexpr int kTileBytes = kBlocks * F::kBytes;
    static_assert(kTileBytes % 16 == 0, "tiles start 16-byte aligned when src is");
    constexpr int kGroupsPerBlock = F::kValues / kGroup;

    __shared__ uint4 tile_words[kTileBytes / 16];
    uint8_t* tile_bytes = reinterpret_cast<uint8_t*>(tile_words);
    const bool src_vec = aligned16(src);
    const bool dst_vec = aligned16(dst);
    const size_t n_tiles = (n_blocks + kBlocks - 1) / kBlocks;

    for (size_t tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        const size_t first = tile * kBlocks;
        const size_t left = n_blocks - first;
        const int blocks = left < (size_t)kBlocks ? (int)left : kBlocks;
        __syncthreads();  // the previous tile's values have all been read
        stage_bytes(tile_bytes, src + first * F::kBytes, blocks * F::kBytes, src_vec);
        __syncthreads();
        const int group = threadIdx.x;
        if (group < blocks * kGroupsPerBlock) {
            const int block = group / kGroupsPerBlock;
            const int j = (group % kGroupsPerBlock) * kGroup;
            float y[kGroup];
            F::decode8(tile_bytes + block * F::kBytes, j, y);
            store8(dst + (first * F::kValues + (size_t)group * kGroup), y, dst_vec);
        }
    }
}

template <typename P, typename Out>
__device__ __forceinline__ void convert_tiles(const typename P::Elem* __restrict__ src, size_t n,
                                              Out* __restrict__ dst) {
    const size_t n_tiles = (n + kTileValues - 1) / kTileValues;
    for (size_t tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        const size_t base = tile * kTileValues + threadIdx.x;
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
            const size_t i = base + (size_t)k * kThreads;
            if (i < n) {
                const typename P::Elem x = src[i];
                if constexpr (sizeof(Out) == 4) {
                    dst[i] = P::to_f32(x);
                } else {
                    dst[i] = (uint16_t)P::to_f16_bits(x);
                }
            }
        }
    }
}

// Workgroups for a launch over n_tiles tiles.
static inline unsigned grid_for(size_t n_tiles) {
    return (unsigned)(n_tiles < kMaxGrid ? n_tiles : kMaxGrid);
}

// Makes `device` current and launches `kernel` over the tiles of n_values values.
template <typename Kernel, typename Src, typename Dst>
static int launch(Kernel kernel, size_t n_tiles, const void* src, size_t n, void* dst,
                  int device, void* stream) {
    if (n == 0) return 0;
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    hipLaunchKernelGGL(kernel, dim3(grid_for(n_tiles)), dim3(kThreads), 0, (hipStream_t)stream,
                       static_cast<const Src*>(src), n, static_cast<Dst*>(dst));
    return (int)hipGetLastError();
}

}  // namespace rf

// One kernel and one launcher per (block format, output type).
#define RF_BLOCK_FORMAT(name, Format)                                                          \
    __global__ void __launch_bounds__(rf::kThreads)                                            \
        rf_dequant_##name##_f32_kernel(const uint8_t* __restrict__ src, size_t n_blocks,      \
                                       float* __restrict__ dst) {                              \
        rf::decode_tiles<Format, float>(src, n_blocks, dst);                                   \
    }                                                                                          \
    __global__ void __launch_bounds__(rf::kThreads)                                            \
        rf_dequant_##name##_f16_kernel(const uint8_t* __restrict__ src, size_t n_blocks,      \
                                       uint16_t* __restrict__ dst) {                           \
        rf::decode_tiles<Format, uint16_t>(src, n_blocks, dst);                                \
    }                                                                                          \
    extern "C" int rf_dequant_##name##_f32(const void* src, size_t n_blocks, void* dst,        \
                                           int device, void* stream) {                         \
        constexpr size_t kBlocks = rf::kTileValues / Format::kValues;                          \
        return rf::launch<decltype(&rf_dequant_##name##_f32_kernel), uint8_t, float>(          \
            rf_dequant_##name##_f32_kernel, (n_blocks + kBlocks - 1) / kBlocks, src, n_blocks, \
            dst, device, stream);                                                              \
    }                                                                                          \
    extern "C" int rf_dequant_##name##_f16(const void* src, size_t n_blocks, void* dst,        \
                                           int device, void* stream) {                         \
        constexpr size_t kBlocks = rf::kTileValues / Format::kValues;                          \
        return rf::launch<decltype(&rf_dequant_##name##_f16_kernel), uint8_t, uint16_t>(       \
            rf_dequant_##name##_f16_kernel, (n_blocks + kBlocks - 1) / kBlocks, src, n_blocks, \
            dst, device, stream);                                                              \
    }

// One kernel and one launcher per (plain element type, output type).
#define RF_PLAIN_TYPE(name, Plain)                                                             \
    __global__ void __launch_bounds__(rf::kThreads) rf_dequant_##name##_f32_kernel(           \
        const Plain::Elem* __restrict__ src, size_t n, float* __restrict__ dst) {              \
        rf::convert_tiles<Plain, float>(src, n, dst);                                          \
    }                                                                                          \
    __global__ void __launch_bounds__(rf::kThreads) rf_dequant_##name##_f16_kernel(           \
        const Plain::Elem* __restrict__ src, size_t n, uint16_t* __restrict__ dst) {           \
        rf::convert_tiles<Plain, uint16_t>(src, n, dst);                                       \
    }                                                                                          \
    extern "C" int rf_dequant_##name##_f32(const void* src, size_t n, void* dst, int device,  \
                                           void* stream) {                                     \
        return rf::launch<decltype(&rf_dequant_##name##_f32_kernel), Plain::Elem, float>(      \
            rf_dequant_##name##_f32_kernel, (n + rf::kTileValues - 1) / rf::kTileValues, src,  \
            n, dst, device, stream);                                                           \
    }                                                                                          \
    extern "C" int rf_dequant_##name##_f16(const void* src, size_t n, void* dst, int device,  \
                                           void* stream) {                                     \
        return rf::launch<decltype(&rf_dequant_##name##_f16_kernel), Plain::Elem, uint16_t>(   \
            rf_dequant_##name##_f16_kernel, (n + rf::kTileValues - 1) / rf::kTileValues, src,  \
            n, dst, device, stream);                                                           \
    }

// Keep in step with the table of formats in src/gpu/kernels.rs.
RF_PLAIN_TYPE(f32, rf::PlainF32)
RF_PLAIN_TYPE(f16, rf::PlainF16)
RF_PLAIN_TYPE(bf16, rf::PlainBF16)
RF_PLAIN_TYPE(f64, rf::PlainF64)
RF_PLAIN_TYPE(i8, rf::PlainI8)
RF_PLAIN_TYPE(i16, rf::PlainI16)
RF_PLAIN_TYPE(i32, rf::PlainI32)
RF_PLAIN_TYPE(i64, rf::PlainI64)
RF_BLOCK_FORMAT(q4_0, rf::Q4_0)
RF_BLOCK_FORMAT(q4_1, rf::Q4_1)
RF_BLOCK_FORMAT(q5_0, rf::Q5_0)
RF_BLOCK_FORMAT(q5_1, rf::Q5_1)
RF_BLOCK_FORMAT(q8_0, rf::Q8_0)
RF_BLOCK_FORMAT(q8_1, rf::Q8_1)
RF_BLOCK_FORMAT(q2_k, rf::Q2_K)
RF_BLOCK_FORMAT(q3_k, rf::Q3_K)
RF_BLOCK_FORMAT(q4_k, rf::Q4_K)
RF_BLOCK_FORMAT(q5_k, rf::Q5_K)
RF_BLOCK_FORMAT(q6_k, rf::Q6_K)
RF_BLOCK_FORMAT(q8_k, rf::Q8_K)
RF_BLOCK_FORMAT(iq2_xxs, rf::IQ2_XXS)
RF_BLOCK_FORMAT(iq2_xs, rf::IQ2_XS)
RF_BLOCK_FORMAT(iq2_s, rf::IQ2_S)
RF_BLOCK_FORMAT(iq3_xxs, rf::IQ3_XXS)
RF_BLOCK_FORMAT(iq3_s, rf::IQ3_S)
RF_BLOCK_FORMAT(iq1_s, rf::IQ1_S)
RF_BLOCK_FORMAT(iq1_m, rf::IQ1_M)
RF_BLOCK_FORMAT(iq4_nl, rf::IQ4_NL)
RF_BLOCK_FORMAT(iq4_xs, rf::IQ4_XS)
RF_BLOCK_FORMAT(tq1_0, rf::TQ1_0)
RF_BLOCK_FORMAT(tq2_0, rf::TQ2_0)
RF_BLOCK_FORMAT(mxfp4, rf::MXFP4)
