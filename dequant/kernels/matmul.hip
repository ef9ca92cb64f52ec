// matmul.hip: products of a quantized weight matrix with many tokens' activations (a
// prompt, or several sequences' tokens) on the matrix units, for batches past what the
// decode products (matvec.hip) take.
//
// Included by dequant.hip's translation unit, after the decoders and the IQ tables, so
// every type the decoders handle multiplies here too.
//
// Tiles. A workgroup of kMmThreads threads computes kMmRows weight rows for kMmTokens
// tokens. For each step of kMmK columns it decodes its rows' weights to f16 into shared
// memory (each thread eight values at a time, with the type's decode8, straight from the
// blocks: neighbouring threads read neighbouring bytes, which the cache serves) and
// converts the tokens' f32 activations to f16 beside them, then multiplies the two tiles
// with f32 accumulation. No weight is expanded outside shared memory.
//
// Matrix units. On NVIDIA, warp matrix instructions (16 × 16 × 16, f16 in, f32
// accumulated; sm_70 and later). Elsewhere (AMD for now, where the same tiles feed a
// plain loop of f32 multiply-adds) the result is the same function, slower.
//
// Precision: weights and activations are rounded to f16 (11 significant bits) before
// the product, sums are f32. So that no activation overflows f16's range (65504), each
// token's activations are first divided by a power of two (rf_row_scales: the one that
// brings the token's largest magnitude into [2^14, 2^15)), and its results multiplied
// by it: both exact.
//
// Launchers (return the platform's native status):
//   rf_row_scales(x, n_tokens, cols, scales, device, stream)
//   rf_matmul(type, w, rows, cols, x, scales, n_tokens, y, accumulate, device, stream)
// y: n_tokens × rows f32, token-major, as rf_matvec writes it.
#include "common.h"

#if defined(ROCMFORGE_HIP_NVIDIA) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700)
#include <mma.h>
#define RF_MM_WMMA 1
#endif

namespace rf {

constexpr int kMmThreads = 256;
constexpr int kMmRows = 64;
constexpr int kMmTokens = 128;
constexpr int kMmK = 64;
// Row pitch of the f16 tiles (padding keeps the matrix loads off one bank).
constexpr int kMmPitch = kMmK + 8;
// Pitch of the f32 result tile (token-major: one token's kMmRows results together).
constexpr int kMmOutPitch = kMmRows + 4;

constexpr int kMmTileBytes = (kMmRows + kMmTokens) * kMmPitch * 2;
constexpr int kMmOutBytes = kMmTokens * kMmOutPitch * 4;
constexpr int kMmSharedBytes = kMmTileBytes > kMmOutBytes ? kMmTileBytes : kMmOutBytes;

// Plain element types as blocks of eight values, for decode8.
template <typename P>
struct PlainBlocks {
    static constexpr int kValues = kGroup;
    static constexpr int kBytes = kGroup * (int)sizeof(typename P::Elem);
    static __device__ __forceinline__ void decode8(const uint8_t* b, int, float (&y)[kGroup]) {
        typename P::Elem e[kGroup];
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
            // Rows of plain elements are aligned for their element (GpuMatrix checks).
            e[k] = reinterpret_cast<const typename P::Elem*>(b)[k];
        }
#pragma unroll
        for (int k = 0; k < kGroup; ++k) y[k] = P::to_f32(e[k]);
    }
};

template <typename F>
__global__ void __launch_bounds__(kMmThreads)
    matmul_kernel(const uint8_t* __restrict__ w, int rows, int cols, const float* __restrict__ x,
                  const float* __restrict__ scales, int n_tokens, float* __restrict__ y,
                  int accumulate) {
    static_assert(kMmK % kGroup == 0 && kMmK % 16 == 0, "whole groups and matrix steps");
    __shared__ __align__(16) uint8_t smem[kMmSharedBytes];
    __half* wt = reinterpret_cast<__half*>(smem);   // kMmRows × kMmPitch
    __half* xt = wt + kMmRows * kMmPitch;           // kMmTokens × kMmPitch
    float* out = reinterpret_cast<float*>(smem);    // kMmTokens × kMmOutPitch, at the end
    const int row0 = blockIdx.x * kMmRows, tok0 = blockIdx.y * kMmTokens;
    const size_t row_bytes = (size_t)(cols / F::kValues) * F::kBytes;
    rf_chain_wait();

#if defined(RF_MM_WMMA) && defined(__CUDA_ARCH__)
    using namespace nvcuda;
    // Warp wp: rows 16·(wp % 4), tokens 64·(wp / 4) in four 16-token fragments.
    const int wp = threadIdx.x / 32;
    const int wr = (wp % 4) * 16, wc = (wp / 4) * 64;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4];
#pragma unroll
    for (int f = 0; f < 4; ++f) wmma::fill_fragment(acc[f], 0.0f);
#else
    // Thread t: row t % 64, tokens 32·(t / 64) .. + 32.
    const int fr = threadIdx.x % kMmRows, fc = (threadIdx.x / kMmRows) * 32;
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
#endif

    for (int k0 = 0; k0 < cols; k0 += kMmK) {
        // Weights: kMmRows × kMmK values, eight a thread at a time.
        for (int g = threadIdx.x; g < kMmRows * (kMmK / kGroup); g += kMmThreads) {
            const int r = g / (kMmK / kGroup), kk = (g % (kMmK / kGroup)) * kGroup;
            const int row = row0 + r, k = k0 + kk;
            float v[kGroup];
            if (row < rows && k < cols) {
                const uint8_t* blk = w + (size_t)row * row_bytes + (size_t)(k / F::kValues) * F::kBytes;
                F::decode8(blk, k % F::kValues, v);
            } else {
#pragma unroll
                for (int i = 0; i < kGroup; ++i) v[i] = 0.0f;
            }
#pragma unroll
            for (int i = 0; i < kGroup; ++i) wt[r * kMmPitch + kk + i] = __float2half(v[i]);
        }
        // Activations: kMmTokens × kMmK values, four a thread at a time.
        for (int g = threadIdx.x; g < kMmTokens * (kMmK / 4); g += kMmThreads) {
            const int t = g / (kMmK / 4), kk = (g % (kMmK / 4)) * 4;
            const int tok = tok0 + t, k = k0 + kk;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (tok < n_tokens && k < cols) {
                v = *reinterpret_cast<const float4*>(x + (size_t)tok * cols + k);
                const float inv = 1.0f / scales[tok];  // a power of two: exact
                v = make_float4(v.x * inv, v.y * inv, v.z * inv, v.w * inv);
            }
            __half* d = xt + t * kMmPitch + kk;
            d[0] = __float2half(v.x);
            d[1] = __float2half(v.y);
            d[2] = __float2half(v.z);
            d[3] = __float2half(v.w);
        }
        __syncthreads();
#if defined(RF_MM_WMMA) && defined(__CUDA_ARCH__)
#pragma unroll
        for (int ks = 0; ks < kMmK; ks += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
            wmma::load_matrix_sync(a, wt + wr * kMmPitch + ks, kMmPitch);
#pragma unroll
            for (int f = 0; f < 4; ++f) {
                // The activations tile is token-major: as k × tokens, column-major.
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
                wmma::load_matrix_sync(b, xt + (wc + 16 * f) * kMmPitch + ks, kMmPitch);
                wmma::mma_sync(acc[f], a, b, acc[f]);
            }
        }
#else
        for (int kk = 0; kk < kMmK; ++kk) {
            const float a = __half2float(wt[fr * kMmPitch + kk]);
#pragma unroll
            for (int i = 0; i < 32; ++i) acc[i] += a * __half2float(xt[(fc + i) * kMmPitch + kk]);
        }
#endif
        __syncthreads();  // the tiles are read before the next step overwrites them
    }

    // Results through shared memory, token-major, then out to y row-contiguous.
#if defined(RF_MM_WMMA) && defined(__CUDA_ARCH__)
#pragma unroll
    for (int f = 0; f < 4; ++f) {
        wmma::store_matrix_sync(out + (wc + 16 * f) * kMmOutPitch + wr, acc[f], kMmOutPitch,
                                wmma::mem_col_major);
    }
#else
#pragma unroll
    for (int i = 0; i < 32; ++i) out[(fc + i) * kMmOutPitch + fr] = acc[i];
#endif
    __syncthreads();
    for (int i = threadIdx.x; i < kMmTokens * kMmRows; i += kMmThreads) {
        const int t = i / kMmRows, r = i % kMmRows;
        const int tok = tok0 + t, row = row0 + r;
        if (tok < n_tokens && row < rows) {
            float* dst = y + (size_t)tok * rows + row;
            const float v = out[t * kMmOutPitch + r] * scales[tok];
            *dst = accumulate ? *dst + v : v;
        }
    }
}

template <typename F>
hipError_t launch_matmul(const uint8_t* w, int rows, int cols, const float* x,
                         const float* scales, int n_tokens, float* y, int accumulate,
                         hipStream_t stream) {
    const dim3 grid((unsigned)((rows + kMmRows - 1) / kMmRows),
                    (unsigned)((n_tokens + kMmTokens - 1) / kMmTokens));
    rfLaunchChained(matmul_kernel<F>, grid, dim3(kMmThreads), 0, stream, w, rows, cols, x,
                    scales, n_tokens, y, accumulate);
    return hipGetLastError();
}

// One workgroup per token: the power of two 2^e with the token's largest magnitude in
// [2^14, 2^15) once divided by it; 1 for a token of zeros or with a non-finite value
// (which then reaches the results as it is).
__global__ void __launch_bounds__(256)
    row_scales_kernel(const float* __restrict__ x, int cols, float* __restrict__ scales) {
    rf_chain_wait();
    __shared__ float partial[256 / 32];
    const float* row = x + (size_t)blockIdx.x * cols;
    float amax = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) amax = fmaxf(amax, fabsf(row[i]));
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) amax = fmaxf(amax, rf_shfl_xor(amax, mask));
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = amax;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = 0.0f;
        for (int g = 0; g < (int)(blockDim.x / 32); ++g) m = fmaxf(m, partial[g]);
        float scale = 1.0f;
        if (m > 0.0f && m <= 3.4e38f) scale = ldexpf(1.0f, ilogbf(m) - 14);
        scales[blockIdx.x] = scale;
    }
}

}  // namespace rf

// Weight type codes as ggml numbers them (GgmlType in gguf-format).
extern "C" int rf_row_scales(const void* x, int n_tokens, int cols, void* scales, int device,
                             void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n_tokens < 1 || cols < 1) return (int)hipErrorInvalidValue;
    rfLaunchChained(rf::row_scales_kernel, dim3((unsigned)n_tokens), dim3(256), 0,
                    (hipStream_t)stream, (const float*)x, cols, (float*)scales);
    return (int)hipGetLastError();
}

extern "C" int rf_matmul(int type, const void* w, int rows, int cols, const void* x,
                         const void* scales, int n_tokens, void* y, int accumulate, int device,
                         void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (rows < 1 || cols < 1 || n_tokens < 1 || cols % rf::kGroup != 0) {
        return (int)hipErrorInvalidValue;
    }
    const uint8_t* wb = (const uint8_t*)w;
    const float* xf = (const float*)x;
    const float* sf = (const float*)scales;
    float* yf = (float*)y;
    hipStream_t s = (hipStream_t)stream;
    using namespace rf;
#define RF_MM_CASE(code, Format) \
    case code: return (int)launch_matmul<Format>(wb, rows, cols, xf, sf, n_tokens, yf, accumulate, s);
    switch (type) {
        RF_MM_CASE(0, PlainBlocks<PlainF32>)
        RF_MM_CASE(1, PlainBlocks<PlainF16>)
        RF_MM_CASE(2, Q4_0)
        RF_MM_CASE(3, Q4_1)
        RF_MM_CASE(6, Q5_0)
        RF_MM_CASE(7, Q5_1)
        RF_MM_CASE(8, Q8_0)
        RF_MM_CASE(10, Q2_K)
        RF_MM_CASE(11, Q3_K)
        RF_MM_CASE(12, Q4_K)
        RF_MM_CASE(13, Q5_K)
        RF_MM_CASE(14, Q6_K)
        RF_MM_CASE(16, IQ2_XXS)
        RF_MM_CASE(17, IQ2_XS)
        RF_MM_CASE(18, IQ3_XXS)
        RF_MM_CASE(19, IQ1_S)
        RF_MM_CASE(20, IQ4_NL)
        RF_MM_CASE(21, IQ3_S)
        RF_MM_CASE(22, IQ2_S)
        RF_MM_CASE(23, IQ4_XS)
        RF_MM_CASE(29, IQ1_M)
        RF_MM_CASE(30, PlainBlocks<PlainBF16>)
        RF_MM_CASE(39, MXFP4)
        default: return (int)hipErrorInvalidValue;
    }
#undef RF_MM_CASE
}
