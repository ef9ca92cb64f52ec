// decode_legacy.h: decoders of the 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1,
// IQ4_NL, MXFP4) and of the plain element types (F32, F16, BF16, F64, I8, I16, I32, I64).
//
// A block format is a struct with
//   kValues   values per block,
//   kBytes    bytes per block (the size of the matching struct in src/blocks.rs),
//   decode8(b, j, y)   values j..j+8 of the block whose bytes start at b (j a multiple
//                      of 8), computed with the same f32 operations, in the same order,
//                      as the reference decoder in src/decode/scalar.
// Byte offsets below follow the field order of the structs in src/blocks.rs.
#ifndef ROCMFORGE_DEQUANT_LEGACY_H
#define ROCMFORGE_DEQUANT_LEGACY_H

#include "common.h"

namespace rf {

// Values j..j+8 of a 32-value block take the low nibbles (j < 16) or the high nibbles
// (j >= 16) of the 16 quant bytes starting at qs[j % 16].
__device__ __forceinline__ uint32_t nibble(const uint8_t* qs, int j, int k) {
    return (qs[(j & 15) + k] >> ((j & 16) ? 4 : 0)) & 0x0F;
}

// Q4_0 {d: f16, qs: [u8; 16]}: d * (q - 8).
struct Q4_0 {
    static constexpr int kValues = 32;
    static constexpr int kBytes = 18;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const float d = f16_at(b);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) y[k] = mul(d, small_int_f32((int)nibble(b + 2, j, k) - 8));
    }
};

// Q4_1 {d: f16, m: f16, qs: [u8; 16]}: d * q + m.
struct Q4_1 {
    static constexpr int kValues = 32;
    static constexpr int kBytes = 20;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const float d = f16_at(b);
        const float m = f16_at(b + 2);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) y[k] = add(mul(d, small_int_f32((int)nibble(b + 4, j, k))), m);
    }
};

// The 5-bit quant of value j + k: its nibble, and bit j + k of the little-endian qh.
__device__ __forceinline__ uint32_t five_bit(const uint8_t* qs, uint32_t qh, int j, int k) {
    return nibble(qs, j, k) | (((qh >> (j + k)) & 1) << 4);
}

// Q5_0 {d: f16, qh: [u8; 4], qs: [u8; 16]}: d * (q - 16).
struct Q5_0 {
    static constexpr int kValues = 32;
    static constexpr int kBytes = 22;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const float d = f16_at(b);
        const uint32_t qh = u32_at(b + 2);
#pragma unroll
        for (int k = 0; k < kGroup; ++k)
            y[k] = mul(d, small_int_f32((int)five_bit(b + 6, qh, j, k) - 16));
    }
};

// Q5_1 {d: f16, m: f16, qh: [u8; 4], qs: [u8; 16]}: d * q + m.
struct Q5_1 {
    static constexpr int kValues = 32;
    static constexpr int kBytes = 24;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const float d = f16_at(b);
        const float m = f16_at(b + 2);
        const uint32_t qh = u32_at(b + 4);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) y[k] = add(mul(d, small_int_f32((int)five_bit(b + 8, qh, j, k))), m);
    }
};

// Q8_0 {d: f16, qs: [i8; 32]} and Q8_1 {d: f16, s: f16, qs: [i8; 32]}: q * d.
template <int kQsOffset, int kBlockBytes>
struct Q8Legacy {
    static constexpr int kValues = 32;
    static constexpr int kBytes = kBlockBytes;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const float d = f16_at(b);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) y[k] = mul(small_int_f32((int8_t)b[kQsOffset + j + k]), d);
    }
};
using Q8_0 = Q8Legacy<2, 34>;
using Q8_1 = Q8Legacy<4, 36>;

// IQ4_NL {d: f16, qs: [u8; 16]}: d * kvalues_iq4nl[q].
struct IQ4_NL {
    static constexpr int kValues = 32;
    static constexpr int kBytes = 18;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const float d = f16_at(b);
#pragma unroll
        for (int k = 0; k < kGroup; ++k)
            y[k] = mul(d, small_int_f32(rf_kvalues_iq4nl[nibble(b + 2, j, k)]));
    }
};

// MXFP4 {e: u8, qs: [u8; 16]}: half of 2^(e - 127) times the doubled E2M1 value.
struct MXFP4 {
    static constexpr int kValues = 32;
    static constexpr int kBytes = 17;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const float d = e8m0_to_f32_half(b[0]);
#pragma unroll
        for (int k = 0; k < kGroup; ++k)
            y[k] = mul(d, small_int_f32(rf_kvalues_mxfp4[nibble(b + 1, j, k)]));
    }
};

// ------------------------------------------------------------------ plain types -------
// One value per element: `Elem` is the stored type (the source pointer is aligned for
// it), to_f32 widens or rounds it to f32, and to_f16_bits gives the f16 output's bits.
// F32 and BF16 become f32 by moving bits, so NaN payloads survive as on the CPU; F16
// input is copied to f16 output unchanged, as the CPU decoder copies it.

struct PlainF32 {
    using Elem = uint32_t;
    static __device__ __forceinline__ float to_f32(Elem x) { return __uint_as_float(x); }
    static __device__ __forceinline__ uint32_t to_f16_bits(Elem x) {
        return f32_to_f16_bits(to_f32(x));
    }
};

struct PlainF16 {
    using Elem = uint16_t;
    static __device__ __forceinline__ float to_f32(Elem x) { return f16_bits_to_f32(x); }
    static __device__ __forceinline__ uint32_t to_f16_bits(Elem x) { return x; }
};

struct PlainBF16 {
    using Elem = uint16_t;
    static __device__ __forceinline__ float to_f32(Elem x) {
        return __uint_as_float((uint32_t)x << 16);
    }
    static __device__ __forceinline__ uint32_t to_f16_bits(Elem x) {
        return f32_to_f16_bits(to_f32(x));
    }
};

// The remaining plain types convert with the language's own conversion, which rounds to
// nearest even on the GPU as `as f32` does on the CPU.
template <typename T>
struct PlainConvert {
    using Elem = T;
    static __device__ __forceinline__ float to_f32(Elem x) { return (float)x; }
    static __device__ __forceinline__ uint32_t to_f16_bits(Elem x) {
        return f32_to_f16_bits(to_f32(x));
    }
};
using PlainF64 = PlainConvert<double>;
using PlainI8 = PlainConvert<int8_t>;
using PlainI16 = PlainConvert<int16_t>;
using PlainI32 = PlainConvert<int32_t>;
using PlainI64 = PlainConvert<long long>;

}  // namespace rf

#endif  // ROCMFORGE_DEQUANT_LEGACY_H
