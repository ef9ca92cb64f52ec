// common.h: what every decoder of dequant.hip shares: byte loads, f16 conversions, f32
// arithmetic that is never contracted, and the staging and store helpers of the kernels;
// and what the products share: blocks read as 32-bit words.
//
// Exactness. The CPU reference decoders (src/decode/scalar) compute every value with a
// fixed sequence of rounded f32 operations: products such as `d * q`, then at most one
// sum (`d * q + m`, `dl * q - ml`). A GPU compiler may fuse such a product and sum into one
// fused multiply-add, which rounds once instead of twice and can change the last bit. The
// helpers rf_mul/rf_add/rf_sub below forbid that: on NVIDIA they are the __fmul_rn family,
// which nvcc never contracts; on AMD the `fp contract(off)` pragma below covers every
// arithmetic expression that follows it in the translation unit (clang honours it in HIP
// code). Denormals are kept on both platforms (no -ftz / flush-denormals flags are used),
// as on the CPU. Conversions (f16 -> f32, int -> f32, f64 -> f32, f32 -> f16) round to
// nearest even on both sides.
#ifndef ROCMFORGE_DEQUANT_COMMON_H
#define ROCMFORGE_DEQUANT_COMMON_H

#include "rocmforge_hip.h"

#include <stddef.h>
#include <stdint.h>

#if defined(ROCMFORGE_HIP_AMD)
#pragma clang fp contract(off)
#endif

namespace rf {

// ------------------------------------------------------------------ arithmetic -------

__device__ __forceinline__ float mul(float a, float b) {
#if defined(ROCMFORGE_HIP_NVIDIA)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

__device__ __forceinline__ float add(float a, float b) {
#if defined(ROCMFORGE_HIP_NVIDIA)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

__device__ __forceinline__ float sub(float a, float b) {
#if defined(ROCMFORGE_HIP_NVIDIA)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

// An integer of magnitude below 2^22 as f32: the same value as (float)v, exactly, without
// the conversion unit. v is added to the bits of 1.5·2^23 (whose unit in the last place
// is 1, so the sum's bits are the float 1.5·2^23 + v), then 1.5·2^23 is taken away again;
// both steps are exact. The block decoders convert every value they produce, and the
// conversion unit runs at a fraction of the rate of f32 arithmetic: it bounded the batch
// products, which decode every weight for each tile of tokens.
__device__ __forceinline__ float small_int_f32(int v) {
    return sub(__int_as_float(0x4B400000 + v), 12582912.0f);
}

// ------------------------------------------------------------------ loads -------------
// Blocks have alignment 1 (an 18-byte block sits at any address), so multi-byte fields
// are assembled from bytes, little-endian, as GGUF stores them.

__device__ __forceinline__ uint32_t u16_at(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8);
}

__device__ __forceinline__ uint32_t u32_at(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

__device__ __forceinline__ float f16_bits_to_f32(uint32_t bits) {
    return __half2float(__ushort_as_half((unsigned short)bits));
}

// The IEEE binary16 value stored at p, widened to f32 (exact).
__device__ __forceinline__ float f16_at(const uint8_t* p) { return f16_bits_to_f32(u16_at(p)); }

// The f16 bits nearest to v (ties to even), as half::f16::from_f32 rounds on the CPU.
__device__ __forceinline__ uint32_t f32_to_f16_bits(float v) {
    return (uint32_t)__half_as_ushort(__float2half_rn(v));
}

// Half of the MXFP4 E8M0 scale 2^(e - 127), built from its bits (exponents 0 and 1 give
// subnormals), as the reference decoder builds it (the decoders and the products).
__device__ __forceinline__ float e8m0_to_f32_half(uint32_t e) {
    return __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
}

// ------------------------------------------------------------------ words -------------
// Blocks read as 32-bit words, for the products (matvec.hip's tasks, skinny.hip's rows),
// from device or shared memory.

// n consecutive 32-bit words starting at p (any alignment): aligned words shifted into
// place, never reading past the aligned word that holds the last byte.
template <int N>
__device__ __forceinline__ void load_words(const uint8_t* p, int (&out)[N]) {
    const uint32_t* base = reinterpret_cast<const uint32_t*>((uintptr_t)p & ~(uintptr_t)3);
    const int shift = ((uintptr_t)p & 3) * 8;
    uint32_t w[N + 1];
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = base[i];
    w[N] = shift ? base[N] : 0u;  // the last word only when it holds wanted bytes
#pragma unroll
    for (int i = 0; i < N; ++i) {
        out[i] = (int)(uint32_t)((((uint64_t)w[i + 1] << 32) | w[i]) >> shift);
    }
}

// Bits (v..v+3) of a 32-bit mask, to bit 4 of bytes 0..3.
__device__ __forceinline__ int spread4(uint32_t mask, int v) {
    const uint32_t b = mask >> v;
    return (int)(((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25));
}

// Byte i of the 12 scale bytes of a Q4_K/Q5_K super-block, held as three words (chosen
// by comparisons: a run-time index into a register array would move it to memory).
__device__ __forceinline__ int scale_byte(const int (&sw)[3], int i) {
    const uint32_t word = (uint32_t)(i < 4 ? sw[0] : (i < 8 ? sw[1] : sw[2]));
    return (int)((word >> (8 * (i & 3))) & 0xFF);
}

// The 6-bit scale and minimum of sub-block j of a Q4_K/Q5_K super-block.
__device__ __forceinline__ void k_scale_min(const int (&s)[3], int j, int& sc, int& m) {
    if (j < 4) {
        sc = scale_byte(s, j) & 63;
        m = scale_byte(s, j + 4) & 63;
    } else {
        sc = (scale_byte(s, j + 4) & 0xF) | ((scale_byte(s, j - 4) >> 6) << 4);
        m = (scale_byte(s, j + 4) >> 4) | ((scale_byte(s, j) >> 6) << 4);
    }
}

// ------------------------------------------------------------------ tiles -------------
// A kernel works in tiles of kTileValues output values: 256 threads, each decoding one
// group of 8 consecutive values (every block holds a whole number of such groups, and
// the 8 values of a group share their scales).

constexpr int kThreads = 256;
constexpr int kGroup = 8;
constexpr int kTileValues = kThreads * kGroup;
// Tiles handled by one launch's grid at most; each workgroup loops over the rest.
constexpr size_t kMaxGrid = 8192;

// Copies nbytes from global memory at src into shared memory at dst with every thread
// of the workgroup. vec16: src is 16-byte aligned, so whole 16-byte words are moved
// (dst always is: it is a __shared__ array of uint4).
__device__ __forceinline__ void stage_bytes(uint8_t* dst, const uint8_t* __restrict__ src,
                                            int nbytes, bool vec16) {
    int done = 0;
    if (vec16) {
        const int words = nbytes / 16;
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        for (int i = threadIdx.x; i < words; i += blockDim.x) d[i] = s[i];
        done = words * 16;
    }
    for (int i = done + threadIdx.x; i < nbytes; i += blockDim.x) dst[i] = src[i];
}

// Stores 8 values at dst, as one or two 16-byte stores when vec16 says dst is aligned.
__device__ __forceinline__ void store8(float* __restrict__ dst, const float (&y)[kGroup],
                                       bool vec16) {
    if (vec16) {
        float4* d = reinterpret_cast<float4*>(dst);
        d[0] = make_float4(y[0], y[1], y[2], y[3]);
        d[1] = make_float4(y[4], y[5], y[6], y[7]);
    } else {
#pragma unroll
        for (int k = 0; k < kGroup; ++k) dst[k] = y[k];
    }
}

// f16 output: the values rounded to nearest even, stored as their bits.
__device__ __forceinline__ void store8(uint16_t* __restrict__ dst, const float (&y)[kGroup],
                                       bool vec16) {
    uint32_t h[kGroup];
#pragma unroll
    for (int k = 0; k < kGroup; ++k) h[k] = f32_to_f16_bits(y[k]);
    if (vec16) {
        *reinterpret_cast<uint4*>(dst) =
            make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16),
                       h[6] | (h[7] << 16));
    } else {
#pragma unroll
        for (int k = 0; k < kGroup; ++k) dst[k] = (uint16_t)h[k];
    }
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return ((uintptr_t)p & 15) == 0;
}

}  // namespace rf

#endif  // ROCMFORGE_DEQUANT_COMMON_H
