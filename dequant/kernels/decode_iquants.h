// decode_iquants.h: decoders of the lattice-grid formats IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
// IQ3_S, IQ1_S and IQ1_M. Same contract as decode_legacy.h.
//
// Every group of 8 values is one grid entry (two for the 4-value grids of IQ3), so a
// thread reads its entry once from constant memory: rf_iq*_grid, rf_ksigns_iq2xs and
// RF_IQ1S_DELTA come from the header the build script generates from the CPU decoders'
// own tables (src/decode/grids.rs). A grid entry packs value k in byte k.
#ifndef ROCMFORGE_DEQUANT_IQUANTS_H
#define ROCMFORGE_DEQUANT_IQUANTS_H

#include "common.h"

namespace rf {

// y[k] = ±(scale * grid byte k), negated where bit k of signs is set.
__device__ __forceinline__ void put_signed(float (&y)[kGroup], float scale, uint64_t grid,
                                           uint32_t signs) {
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
        const float v = mul(scale, small_int_f32((int)((grid >> (8 * k)) & 0xFF)));
        y[k] = (signs >> k) & 1 ? -v : v;
    }
}

// (d * (0.5 + ls)) * step: the group scale of the IQ2 (step 0.25) and IQ3_XXS (0.5) formats.
__device__ __forceinline__ float half_step_scale(float d, uint32_t ls, float step) {
    return mul(mul(d, add(0.5f, small_int_f32((int)ls))), step);
}

// IQ2_XXS {d: f16, qs: [u16; 32]}: per 32 values, a u32 of four grid indices and a u32
// of four 7-bit sign indices plus a 4-bit scale.
struct IQ2_XXS {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 66;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const uint8_t* q = b + 2 + 8 * (j / 32);
        const int k = (j % 32) / 8;
        const uint32_t aux = u32_at(q + 4);
        const float db = half_step_scale(f16_at(b), aux >> 28, 0.25f);
        const uint32_t signs = rf_ksigns_iq2xs[(aux >> (7 * k)) & 0x7F];
        put_signed(y, db, rf_iq2xxs_grid[q[k]], signs);
    }
};

// The 4-bit scale of IQ2_XS / IQ2_S for the 8 values of entry i (one per 16 values).
__device__ __forceinline__ uint32_t iq2_scale(const uint8_t* scales, int i) {
    return (scales[i / 4] >> (4 * ((i / 2) % 2))) & 0x0F;
}

// IQ2_XS {d: f16, qs: [u16; 32], scales: [u8; 8]}: each u16 a 9-bit grid index and a
// 7-bit sign index.
struct IQ2_XS {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 74;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const int i = j / 8;
        const uint32_t q = u16_at(b + 2 + 2 * i);
        const float db = half_step_scale(f16_at(b), iq2_scale(b + 66, i), 0.25f);
        put_signed(y, db, rf_iq2xs_grid[q & 511], rf_ksigns_iq2xs[q >> 9]);
    }
};

// IQ2_S {d: f16, qs: [u8; 64], qh: [u8; 8], scales: [u8; 8]}: qs holds 32 low index bytes
// then 32 sign bytes; qh two high index bits per entry.
struct IQ2_S {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 82;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const int i = j / 8;
        const uint32_t high = (b[66 + i / 4] >> (2 * (i % 4))) & 0x03;
        const uint32_t index = b[2 + i] | (high << 8);
        const float db = half_step_scale(f16_at(b), iq2_scale(b + 74, i), 0.25f);
        put_signed(y, db, rf_iq2s_grid[index], b[2 + 32 + i]);
    }
};

// IQ3_XXS {d: f16, qs: [u8; 96]}: 64 grid indices (4 values each), then per 32 values a
// u32 of four 7-bit sign indices plus a 4-bit scale.
struct IQ3_XXS {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 98;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const uint8_t* qs = b + 2;
        const int ib = j / 32;
        const int k = (j % 32) / 8;
        const uint32_t aux = u32_at(qs + 64 + 4 * ib);
        const float db = half_step_scale(f16_at(b), aux >> 28, 0.5f);
        const int i = 8 * ib + 2 * k;
        const uint64_t grid =
            (uint64_t)rf_iq3xxs_grid[qs[i]] | ((uint64_t)rf_iq3xxs_grid[qs[i + 1]] << 32);
        put_signed(y, db, grid, rf_ksigns_iq2xs[(aux >> (7 * k)) & 0x7F]);
    }
};

// IQ3_S {d: f16, qs: [u8; 64], qh: [u8; 8], signs: [u8; 32], scales: [u8; 4]}: 9-bit grid
// indices (4 values each), one sign bit per value, per 32 values d * (1 + 2 * ls).
struct IQ3_S {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 110;
    static __device__ __forceinline__ uint32_t index(const uint8_t* b, int i) {
        return b[2 + i] | (((uint32_t)(b[66 + i / 8] >> (i % 8)) & 1) << 8);
    }
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const int ib = j / 32;
        const int k = (j % 32) / 8;
        const uint32_t ls = (b[106 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
        const float db = mul(f16_at(b), small_int_f32((int)(1 + 2 * ls)));
        const int i = 8 * ib + 2 * k;
        const uint64_t grid =
            (uint64_t)rf_iq3s_grid[index(b, i)] | ((uint64_t)rf_iq3s_grid[index(b, i + 1)] << 32);
        put_signed(y, db, grid, b[74 + 4 * ib + k]);
    }
};

// y[k] = scale * (signed grid byte k + delta), the IQ1 formats' values.
__device__ __forceinline__ void put_iq1(float (&y)[kGroup], float scale, uint64_t grid,
                                        float delta) {
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
        const int g = (int8_t)(uint8_t)((grid >> (8 * k)) & 0xFF);
        y[k] = mul(scale, add(small_int_f32(g), delta));
    }
}

// IQ1_S {d: f16, qs: [u8; 32], qh: [u16; 8]}: per 32 values a u16 of four 3-bit high
// index parts, a 3-bit scale and the sign of the shift.
struct IQ1_S {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 50;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const int ib = j / 32;
        const int k = (j % 32) / 8;
        const uint32_t qh = u16_at(b + 34 + 2 * ib);
        const float dl = mul(f16_at(b), small_int_f32((int)(2 * ((qh >> 12) & 7) + 1)));
        const float delta = (qh & 0x8000) ? -RF_IQ1S_DELTA : RF_IQ1S_DELTA;
        const uint32_t index = b[2 + 4 * ib + k] | (((qh >> (3 * k)) & 7) << 8);
        put_iq1(y, dl, rf_iq1s_grid[index], delta);
    }
};

// IQ1_M {qs: [u8; 32], qh: [u8; 16], scales: [u8; 8]}: the f16 super-block scale is
// spread over the top nibbles of the four u16 of scales; per 16 values a 3-bit scale;
// per 8 values a nibble of qh (three high index bits, then the sign of the shift).
struct IQ1_M {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 56;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const uint8_t* scales = b + 48;
        const uint32_t bits = (u16_at(scales) >> 12) | ((u16_at(scales + 2) >> 8) & 0x00F0) |
                              ((u16_at(scales + 4) >> 4) & 0x0F00) | (u16_at(scales + 6) & 0xF000);
        const float d = f16_bits_to_f32(bits);
        const int s = j / 16;
        const uint32_t word = u16_at(scales + 2 * (s / 4));
        const float dl = mul(d, small_int_f32((int)(2 * ((word >> (3 * (s % 4))) & 7) + 1)));
        const int k = j / 8;
        const uint32_t nib = (b[32 + k / 2] >> (4 * (k % 2))) & 0x0F;
        const uint32_t index = b[k] | ((nib & 7) << 8);
        const float delta = (nib & 0x08) ? -RF_IQ1S_DELTA : RF_IQ1S_DELTA;
        put_iq1(y, dl, rf_iq1s_grid[index], delta);
    }
};

}  // namespace rf

#endif  // ROCMFORGE_DEQUANT_IQUANTS_H
