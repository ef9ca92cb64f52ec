// decode_kquants.h: decoders of the 256-value super-block formats without a lattice grid:
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_XS, TQ1_0 and TQ2_0. Same contract as
// decode_legacy.h: decode8(b, j, y) gives values j..j+8 (j a multiple of 8) of the block
// at b with the reference decoder's f32 operations in its order.
#ifndef ROCMFORGE_DEQUANT_KQUANTS_H
#define ROCMFORGE_DEQUANT_KQUANTS_H

#include "common.h"

namespace rf {

// The 2-bit field of value i in a 64-byte array of crumbs laid out as ggml's k-quants
// lay them: each half of 128 values uses 32 bytes, shifted by 0, 2, 4, 6 per 32 values.
__device__ __forceinline__ uint32_t crumb(const uint8_t* qs, int i) {
    return (qs[32 * (i / 128) + (i % 32)] >> (2 * ((i % 128) / 32))) & 3;
}

// Q2_K {scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16}: per 16 values,
// (d * sc) * q - (dmin * m) with sc and m the low and high nibbles of scales[i / 16].
struct Q2_K {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 84;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const uint32_t sc = b[j / 16];
        const float dl = mul(f16_at(b + 80), small_int_f32((int)(sc & 0x0F)));
        const float ml = mul(f16_at(b + 82), small_int_f32((int)(sc >> 4)));
#pragma unroll
        for (int k = 0; k < kGroup; ++k) y[k] = sub(mul(dl, small_int_f32((int)crumb(b + 16, j + k))), ml);
    }
};

// Q3_K {hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16}: per 16 values,
// (d * (sc - 32)) * q with q = crumb - 4 unless the value's hmask bit is set.
struct Q3_K {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 110;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const uint8_t* scales = b + 96;
        const int s = j / 16;
        const uint32_t low = (scales[s % 8] >> (4 * (s / 8))) & 0x0F;
        const uint32_t high = (scales[8 + s % 4] >> (2 * (s / 4))) & 0x03;
        const float dl = mul(f16_at(b + 108), small_int_f32((int)(low | (high << 4)) - 32));
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
            const int i = j + k;
            const int hbit = ((b[i % 32] >> (i / 32)) & 1) ^ 1;
            const int q = (int)crumb(b + 32, i) - 4 * hbit;
            y[k] = mul(dl, small_int_f32(q));
        }
    }
};

// The 6-bit scale and min of group g (0..8) of Q4_K and Q5_K, from their 12 packed bytes.
__device__ __forceinline__ void k_scale_min(const uint8_t* p, int g, uint32_t& sc, uint32_t& m) {
    if (g < 4) {
        sc = p[g] & 0x3F;
        m = p[g + 4] & 0x3F;
    } else {
        sc = (p[g + 4] & 0x0F) | ((p[g - 4] >> 2) & 0x30);
        m = (p[g + 4] >> 4) | ((p[g] >> 2) & 0x30);
    }
}

// Q4_K {d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]} and
// Q5_K {d, dmin, scales, qh: [u8; 32], qs: [u8; 128]}: per 32 values (group g),
// (d * sc) * q - (dmin * m); q's low four bits are the low (even g) or high (odd g)
// nibbles of qs[32 * (g / 2)..], Q5_K's fifth bit is bit g of qh[value % 32].
template <bool kFifthBit>
struct KQuant {
    static constexpr int kValues = 256;
    static constexpr int kBytes = kFifthBit ? 176 : 144;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const int g = j / 32;
        uint32_t sc, m;
        k_scale_min(b + 4, g, sc, m);
        const float dl = mul(f16_at(b), small_int_f32((int)sc));
        const float ml = mul(f16_at(b + 2), small_int_f32((int)m));
        const uint8_t* qs = b + (kFifthBit ? 48 : 16) + 32 * (g / 2);
        const int shift = 4 * (g % 2);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
            const int l = (j % 32) + k;
            uint32_t q = (qs[l] >> shift) & 0x0F;
            if (kFifthBit) q |= ((b[16 + l] >> g) & 1) << 4;
            y[k] = sub(mul(dl, small_int_f32((int)q)), ml);
        }
    }
};
using Q4_K = KQuant<false>;
using Q5_K = KQuant<true>;

// Q6_K {ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16}: per 16 values,
// (d * sc) * (q - 32) with q's low four bits from ql and high two from qh.
struct Q6_K {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 210;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const float dl = mul(f16_at(b + 208), small_int_f32((int8_t)b[192 + j / 16]));
        const int h = j / 128;
        const int quarter = (j % 128) / 32;
        const uint8_t* ql = b + 64 * h + 32 * (quarter % 2);
        const uint8_t* qh = b + 128 + 32 * h;
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
            const int l = (j % 32) + k;
            const uint32_t low = (ql[l] >> (4 * (quarter / 2))) & 0x0F;
            const uint32_t high = (qh[l] >> (2 * quarter)) & 0x03;
            y[k] = mul(dl, small_int_f32((int)(low | (high << 4)) - 32));
        }
    }
};

// Q8_K {d: f32, qs: [i8; 256], bsums: [i16; 16]}: d * q.
struct Q8_K {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 292;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const float d = __uint_as_float(u32_at(b));
#pragma unroll
        for (int k = 0; k < kGroup; ++k) y[k] = mul(d, small_int_f32((int8_t)b[4 + j + k]));
    }
};

// IQ4_XS {d: f16, scales_h: u16, scales_l: [u8; 4], qs: [u8; 128]}: per 32 values (group
// g), (d * (ls - 32)) * kvalues_iq4nl[q], q laid out per group as in IQ4_NL.
struct IQ4_XS {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 136;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const int g = j / 32;
        const uint32_t low = (b[4 + g / 2] >> (4 * (g % 2))) & 0x0F;
        const uint32_t high = (u16_at(b + 2) >> (2 * g)) & 0x03;
        const float dl = mul(f16_at(b), small_int_f32((int)(low | (high << 4)) - 32));
        const uint8_t* qs = b + 8 + 16 * g + (j & 15);
        const int shift = (j & 16) ? 4 : 0;
#pragma unroll
        for (int k = 0; k < kGroup; ++k)
            y[k] = mul(dl, small_int_f32(rf_kvalues_iq4nl[(qs[k] >> shift) & 0x0F]));
    }
};

// TQ1_0 {qs: [u8; 48], qh: [u8; 4], d: f16}: d * (t - 1) with t the base-3 digit of a
// byte: values 0..160 are digit i / 32 of qs[i % 32], values 160..240 digit (i - 160) / 16
// of qs[32 + i % 16], values 240..256 digit (i - 240) / 4 of qh[i % 4].
struct TQ1_0 {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 54;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const float d = f16_at(b + 52);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
            const int i = j + k;
            uint32_t byte, digit;
            if (i < 160) {
                byte = b[i % 32];
                digit = i / 32;
            } else if (i < 240) {
                byte = b[32 + (i - 160) % 16];
                digit = (i - 160) / 16;
            } else {
                byte = b[48 + (i - 240) % 4];
                digit = (i - 240) / 4;
            }
            const uint32_t pow3 = digit == 0 ? 1 : digit == 1 ? 3 : digit == 2 ? 9 : digit == 3 ? 27 : 81;
            // The product wraps to a byte, as ggml's uint8_t arithmetic does.
            const uint32_t t = (((byte * pow3) & 0xFF) * 3) >> 8;
            y[k] = mul(d, small_int_f32((int)t - 1));
        }
    }
};

// TQ2_0 {qs: [u8; 64], d: f16}: d * (q - 1) with q a crumb as in Q2_K.
struct TQ2_0 {
    static constexpr int kValues = 256;
    static constexpr int kBytes = 66;
    static __device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&y)[kGroup]) {
        const float d = f16_at(b + 64);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) y[k] = mul(d, small_int_f32((int)crumb(b, j + k) - 1));
    }
};

}  // namespace rf

#endif  // ROCMFORGE_DEQUANT_KQUANTS_H
