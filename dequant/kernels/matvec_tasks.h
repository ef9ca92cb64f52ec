// matvec_tasks.h: the weight tasks of the decode products, one struct per weight type:
// how a thread loads 32 or 64 weights of a block and unpacks them into small integers
// with their factors (see matvec.hip, "Weights"). Included by matvec.hip, after
// common.h and the unit's grid tables.
#ifndef ROCMFORGE_DEQUANT_MATVEC_TASKS_H
#define ROCMFORGE_DEQUANT_MATVEC_TASKS_H

namespace rf {

// ------------------------------------------------------------------ weight tasks ------
// A task is what one thread takes of a weight block at a time: 32 or 64 weights, whose
// quantized values it loads with as few and as wide loads as the block's alignment allows
// and unpacks into small integers w (four to a 32-bit word), with per-16-weight factors a
// and b such that the weights are a·w + b. `xb[i]` says which 32-weight activation block
// of the weight block the task's i-th 32 weights meet. Types whose factors are the same
// for all 32 weights of such a piece say so (kScale32): row_dots then takes one dot
// product of the piece and one pair of float operations, not two.
//
// Blocks of 18, 22, 34 or 210 bytes sit at 2-byte aligned addresses: their bytes are read
// as aligned 32-bit words and shifted into place (common.h's load_words), never past the
// block.

// n consecutive 32-bit words at a 16-byte aligned address.
template <int N>
__device__ __forceinline__ void load_words16(const uint8_t* p, int (&out)[N]) {
    static_assert(N % 4 == 0, "whole 16-byte words");
    const int4* v = reinterpret_cast<const int4*>(p);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        const int4 x = v[i];
        out[4 * i] = x.x;
        out[4 * i + 1] = x.y;
        out[4 * i + 2] = x.z;
        out[4 * i + 3] = x.w;
    }
}

__device__ __forceinline__ float half_at(const uint8_t* p) {
    return __half2float(*reinterpret_cast<const __half*>(p));
}

// Legacy 4-bit blocks: 16 bytes of nibbles, values 0-15 low, 16-31 high.
__device__ __forceinline__ void nibbles16(const int (&q)[4], int (&w)[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[i] = q[i] & 0x0F0F0F0F;
        w[i + 4] = (q[i] >> 4) & 0x0F0F0F0F;
    }
}

struct MQ4_0 {
    static constexpr int kValues = 32, kBytes = 18, kTasks = 1, kX = 1;
    static constexpr bool kScale32 = true;
    __device__ static void task(const uint8_t* blk, int, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        int q[4];
        load_words<4>(blk + 2, q);
        nibbles16(q, w);
        const float d = half_at(blk);
        a[0] = a[1] = d;
        b[0] = b[1] = -8.0f * d;
        xb[0] = 0;
    }
};

struct MQ4_1 {
    static constexpr int kValues = 32, kBytes = 20, kTasks = 1, kX = 1;
    static constexpr bool kScale32 = true;
    __device__ static void task(const uint8_t* blk, int, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        const int* p = reinterpret_cast<const int*>(blk);
        const int q[4] = {p[1], p[2], p[3], p[4]};
        nibbles16(q, w);
        a[0] = a[1] = half_at(blk);
        b[0] = b[1] = half_at(blk + 2);
        xb[0] = 0;
    }
};

struct MQ5_0 {
    static constexpr int kValues = 32, kBytes = 22, kTasks = 1, kX = 1;
    static constexpr bool kScale32 = true;
    __device__ static void task(const uint8_t* blk, int, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        int q[5];
        load_words<5>(blk + 2, q);  // qh, then the 16 bytes of nibbles
        const int n[4] = {q[1], q[2], q[3], q[4]};
        nibbles16(n, w);
        const uint32_t qh = (uint32_t)q[0];
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] |= spread4(qh, 4 * i);
        const float d = half_at(blk);
        a[0] = a[1] = d;
        b[0] = b[1] = -16.0f * d;
        xb[0] = 0;
    }
};

struct MQ5_1 {
    static constexpr int kValues = 32, kBytes = 24, kTasks = 1, kX = 1;
    static constexpr bool kScale32 = true;
    __device__ static void task(const uint8_t* blk, int, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        const int* p = reinterpret_cast<const int*>(blk);
        const int n[4] = {p[2], p[3], p[4], p[5]};
        nibbles16(n, w);
        const uint32_t qh = (uint32_t)p[1];
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] |= spread4(qh, 4 * i);
        a[0] = a[1] = half_at(blk);
        b[0] = b[1] = half_at(blk + 2);
        xb[0] = 0;
    }
};

struct MQ8_0 {
    static constexpr int kValues = 32, kBytes = 34, kTasks = 1, kX = 1;
    static constexpr bool kScale32 = true;
    __device__ static void task(const uint8_t* blk, int, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        load_words<8>(blk + 2, w);
        a[0] = a[1] = half_at(blk);
        b[0] = b[1] = 0.0f;
        xb[0] = 0;
    }
};

// acc + the dot product of a's four bytes, unsigned, with b's, signed (kUnsignedDot:
// whether that is one instruction, NVIDIA's dp4a.u32.s32; only tasks that say
// kHighInPlace, which needs it, meet their words through it).
#if defined(ROCMFORGE_HIP_NVIDIA)
constexpr bool kUnsignedDot = true;
__device__ __forceinline__ int dot4_unsigned(int a, int b, int acc) {
    int out;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(acc));
    return out;
}
#else
constexpr bool kUnsignedDot = false;
__device__ __forceinline__ int dot4_unsigned(int a, int b, int acc) {
    const uint8_t* x = reinterpret_cast<const uint8_t*>(&a);
    const int8_t* y = reinterpret_cast<const int8_t*>(&b);
    return acc + x[0] * y[0] + x[1] * y[1] + x[2] * y[2] + x[3] * y[3];
}
#endif

// Q4_K and Q5_K: a task is one 64-weight chunk c, whose 32 bytes hold sub-block 2c in
// their low nibbles and 2c+1 in their high ones, each with its factors. With an unsigned
// dot product at hand, Q4_K's high nibbles stay in place, 16 times their values, and
// meet the activations through it, their factor a divided by 16 (a power of two: the
// same products), which saves a shift a word (kHighInPlace).
template <bool kFive>
struct MQK {
    static constexpr int kValues = 256, kBytes = kFive ? 176 : 144, kTasks = 4, kX = 2;
    static constexpr bool kScale32 = true;
    static constexpr bool kHighInPlace = !kFive && kUnsignedDot;
    __device__ static void task(const uint8_t* blk, int c, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        int q[8], head[4];
        load_words16<8>(blk + (kFive ? 48 : 16) + 32 * c, q);
        // d and dmin, then 12 bytes of 6-bit scales and minimums.
        load_words16<4>(blk, head);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            w[i] = q[i] & 0x0F0F0F0F;
            w[i + 8] = kHighInPlace ? (int)((uint32_t)q[i] & 0xF0F0F0F0u)
                                    : (q[i] >> 4) & 0x0F0F0F0F;
        }
        if (kFive) {
            int h[8];
            load_words16<8>(blk + 16, h);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                w[i] |= (int)((((uint32_t)h[i] >> (2 * c)) & 0x01010101u) << 4);
                w[i + 8] |= (int)((((uint32_t)h[i] >> (2 * c + 1)) & 0x01010101u) << 4);
            }
        }
        const uint32_t dm = (uint32_t)head[0];
        const float d = __half2float(__ushort_as_half((unsigned short)(dm & 0xFFFF)));
        const float dmin = __half2float(__ushort_as_half((unsigned short)(dm >> 16)));
        // Sub-blocks 2c and 2c+1's scales and minimums (k_scale_min's, without its branch,
        // which lanes of different c would both take): bytes 0-3 hold sub-blocks 0-3's
        // low six bits, bytes 8-11 sub-blocks 4-7's low four, with their top two in the
        // top bits of bytes 0-7.
        const uint32_t s0 = (uint32_t)head[1], s1 = (uint32_t)head[2], s2 = (uint32_t)head[3];
        const bool first = c < 2;
        const uint32_t scw = first ? s0 & 0x3F3F3F3Fu
                                   : (s2 & 0x0F0F0F0Fu) | ((s0 >> 2) & 0x30303030u);
        const uint32_t mw = first ? s1 & 0x3F3F3F3Fu
                                  : ((s2 >> 4) & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u);
        const int shift = 16 * (c & 1);
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            const int sc = (int)((scw >> (shift + 8 * x)) & 0xFF);
            const int m = (int)((mw >> (shift + 8 * x)) & 0xFF);
            const float f = (kHighInPlace && x == 1) ? 0.0625f : 1.0f;
            a[2 * x] = a[2 * x + 1] = d * (float)sc * f;
            b[2 * x] = b[2 * x + 1] = -dmin * (float)m;
            xb[x] = 2 * c + x;
        }
    }
};
using MQ4_K = MQK<false>;
using MQ5_K = MQK<true>;

// Q6_K: a task is 32 weights of value group k and 32 of group k+2 (k in 0..1) of half h,
// which share their low-bit bytes (low and high nibbles) and high-bit bytes. (Whole
// halves of 128 weights, each byte read once, measured slower on an H100: fewer tasks a
// row leave more threads idle.)
struct MQ6_K {
    static constexpr int kValues = 256, kBytes = 210, kTasks = 4, kX = 2;
    __device__ static void task(const uint8_t* blk, int t, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        const int h = t >> 1, k = t & 1;
        int ql[8], qh[8];
        load_words<8>(blk + 64 * h + 32 * k, ql);
        load_words<8>(blk + 128 + 32 * h, qh);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            w[i] = (ql[i] & 0x0F0F0F0F) | (int)((((uint32_t)qh[i] >> (2 * k)) & 0x03030303u) << 4);
            w[i + 8] = ((ql[i] >> 4) & 0x0F0F0F0F) |
                       (int)((((uint32_t)qh[i] >> (2 * k + 4)) & 0x03030303u) << 4);
        }
        const float d = half_at(blk + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192 + 8 * h + 2 * k);
#pragma unroll
        for (int x = 0; x < 2; ++x) {
#pragma unroll
            for (int half16 = 0; half16 < 2; ++half16) {
                const float f = d * (float)sc[4 * x + half16];
                a[2 * x + half16] = f;
                b[2 * x + half16] = -32.0f * f;
            }
            xb[x] = 4 * h + k + 2 * x;
        }
    }
};

// Q2_K: 84-byte super-blocks (4-byte aligned): 16 scale bytes (scale low nibble, minimum
// high nibble, per 16 weights), 64 bytes of 2-bit values, d, dmin. Value v of half n
// (128 weights) sits in byte 32n + v%32 at bits 2·(v/32 % 4). A task is 64 weights of
// half h = t/2: bit pairs j = 2·(t%2) and j + 1 of its 32 bytes.
struct MQ2_K {
    static constexpr int kValues = 256, kBytes = 84, kTasks = 4, kX = 2;
    __device__ static void task(const uint8_t* blk, int t, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        const int h = t >> 1, j0 = 2 * (t & 1);
        const int* q = reinterpret_cast<const int*>(blk + 16 + 32 * h);
        int qw[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) qw[i] = q[i];
        const float d = half_at(blk + 80), dmin = half_at(blk + 82);
        const int* sw = reinterpret_cast<const int*>(blk);
        // Scale bytes 8h + 2j and 8h + 2j + 1 for j = j0, j0 + 1: four consecutive bytes.
        const uint32_t sc = (uint32_t)sw[(8 * h + 2 * j0) / 4];
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            const int shift = 2 * (j0 + x);
#pragma unroll
            for (int i = 0; i < 8; ++i) w[8 * x + i] = (qw[i] >> shift) & 0x03030303;
#pragma unroll
            for (int half16 = 0; half16 < 2; ++half16) {
                const uint32_t s = (sc >> (8 * (2 * x + half16))) & 0xFF;
                a[2 * x + half16] = d * (float)(s & 0xF);
                b[2 * x + half16] = -dmin * (float)(s >> 4);
            }
            xb[x] = 4 * h + j0 + x;
        }
    }
};

// Q3_K: 110-byte super-blocks (2-byte aligned): 32 bytes of high bits, 64 bytes of low
// bit pairs, 12 bytes of 6-bit scales (one per 16 weights, offset by 32), d. Value v of
// half n is (low pair of byte 32n + v%32 at bits 2j, j = v/32 % 4) + 4·(bit 4n + j of
// high byte v%32) - 4, times d·(scale - 32). A task is 64 weights of half h = t/2, pairs
// j = 2·(t%2) and j + 1.
struct MQ3_K {
    static constexpr int kValues = 256, kBytes = 110, kTasks = 4, kX = 2;
    __device__ static void task(const uint8_t* blk, int t, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        const int h = t >> 1, j0 = 2 * (t & 1);
        int ql[8], hm[8], sw[3];
        load_words<8>(blk + 32 + 32 * h, ql);
        load_words<8>(blk, hm);
        load_words<3>(blk + 96, sw);
        const float d = half_at(blk + 108);
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            const int j = j0 + x;
            const int hbit = 4 * h + j;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int low = (ql[i] >> (2 * j)) & 0x03030303;
                const int high = (int)((((uint32_t)hm[i] >> hbit) & 0x01010101u) << 2);
                w[8 * x + i] = low | high;
            }
#pragma unroll
            for (int half16 = 0; half16 < 2; ++half16) {
                // Scale k (0-15): low nibble from byte k % 8 (high nibble when k ≥ 8),
                // high bits from byte 8 + k % 4, at bits 2·(k / 4).
                const int k = 8 * h + 2 * j + half16;
                const int lo = (scale_byte(sw, k % 8) >> (4 * (k / 8))) & 0xF;
                const int hi = (scale_byte(sw, 8 + k % 4) >> (2 * (k / 4))) & 3;
                const float f = d * (float)((lo | (hi << 4)) - 32);
                a[2 * x + half16] = f;
                b[2 * x + half16] = -4.0f * f;
            }
            xb[x] = 4 * h + j;
        }
    }
};

// IQ4_NL and IQ4_XS: 4-bit indices into a table of 16 int8 values (the non-linear grid).
__device__ __forceinline__ uint32_t iq4_value(uint32_t n) {
    // The table, eight values a 64-bit word.
    const uint64_t lo = 0xF6EADDCFBFAD9881ull;  // -127 -104 -83 -65 -49 -35 -22 -10
    const uint64_t hi = 0x7159453526190D01ull;  //    1   13  25  38  53  69  89 113
    return (uint32_t)(((n < 8 ? lo : hi) >> (8 * (n & 7))) & 0xFF);
}

// Four nibble indices (bits 4k..4k+3 of the low or high nibbles of four bytes) to four
// table values packed as int8.
__device__ __forceinline__ int iq4_word(uint32_t q, int high) {
    const uint32_t n = high ? (q >> 4) & 0x0F0F0F0Fu : q & 0x0F0F0F0Fu;
    return (int)(iq4_value(n & 0xF) | (iq4_value((n >> 8) & 0xF) << 8) |
                 (iq4_value((n >> 16) & 0xF) << 16) | (iq4_value(n >> 24) << 24));
}

// IQ4_NL: 18-byte blocks (2-byte aligned): d, then 16 bytes of indices (values 0-15 low
// nibbles, 16-31 high).
struct MIQ4_NL {
    static constexpr int kValues = 32, kBytes = 18, kTasks = 1, kX = 1;
    static constexpr bool kScale32 = true;
    __device__ static void task(const uint8_t* blk, int, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        int q[4];
        load_words<4>(blk + 2, q);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[i] = iq4_word((uint32_t)q[i], 0);
            w[i + 4] = iq4_word((uint32_t)q[i], 1);
        }
        a[0] = a[1] = half_at(blk);
        b[0] = b[1] = 0.0f;
        xb[0] = 0;
    }
};

// IQ4_XS: 136-byte super-blocks (8-byte aligned): d, 2 bytes of scales' high bit pairs,
// 4 bytes of scales' low nibbles, 128 bytes of indices, 16 per 32 weights. A task is
// one 32-weight sub-block.
struct MIQ4_XS {
    static constexpr int kValues = 256, kBytes = 136, kTasks = 8, kX = 1;
    static constexpr bool kScale32 = true;
    __device__ static void task(const uint8_t* blk, int t, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        const int* q = reinterpret_cast<const int*>(blk + 8 + 16 * t);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[i] = iq4_word((uint32_t)q[i], 0);
            w[i + 4] = iq4_word((uint32_t)q[i], 1);
        }
        const int* words = reinterpret_cast<const int*>(blk);
        const uint32_t head = (uint32_t)words[0], low = (uint32_t)words[1];
        const float d = __half2float(__ushort_as_half((unsigned short)(head & 0xFFFF)));
        const int ls = (int)((low >> (4 * t)) & 0xF) | (int)(((head >> (16 + 2 * t)) & 3) << 4);
        a[0] = a[1] = d * (float)(ls - 32);
        b[0] = b[1] = 0.0f;
        xb[0] = t;
    }
};

// The grid formats pick each run of 8 values from a lattice grid: one entry of 8 bytes
// (IQ2, IQ1) or two of 4 (IQ3). The grids rf_iq*_grid are the decoders' tables
// (src/decode/grids.rs), which the build script writes into this file's translation unit
// in global memory (a warp's lanes read different entries, which NVIDIA's constant cache
// would serve one at a time). A task is one sub-block of 32 values: four runs.

// Bits 0-3 of s to bit 0 of bytes 0-3 (the four shifted copies of s never overlap).
__device__ __forceinline__ uint32_t bits_to_bytes(uint32_t s) {
    return ((s & 0xFu) * 0x00204081u) & 0x01010101u;
}

// Four grid magnitudes (bytes of g, none of them 0) as int8, negated where bits 0-3 of s
// are set: -g = (g ^ 0xFF) + 1 per byte, which for g ≥ 1 carries into no other byte.
__device__ __forceinline__ int signed_grid4(uint32_t g, uint32_t s) {
    const uint32_t ones = bits_to_bytes(s);
    return (int)((g ^ (ones * 0xFFu)) + ones);
}

// The IQ2_XXS / IQ2_XS / IQ3_XXS sign byte of a 7-bit sign index: its seven bits and,
// as the eighth, their parity (the decoders' table rf_ksigns_iq2xs, computed).
__device__ __forceinline__ uint32_t ksigns(uint32_t s7) {
    return s7 | (((uint32_t)__popc(s7) & 1u) << 7);
}

// IQ3_XXS: 98-byte super-blocks (2-byte aligned): d, 64 grid indices (4 values each),
// then per sub-block a u32 of four 7-bit sign indices (one per run) and a 4-bit scale
// ls in the top bits: values d·(0.5 + ls)·0.5·(±grid). Task t: indices 8t..8t+7, word t.
struct MIQ3_XXS {
    static constexpr int kValues = 256, kBytes = 98, kTasks = 8, kX = 1;
    __device__ static void task(const uint8_t* blk, int t, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        int q[2], s[1];
        load_words<2>(blk + 2 + 8 * t, q);
        load_words<1>(blk + 66 + 4 * t, s);
        const uint32_t aux = (uint32_t)s[0];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint32_t idx = (uint32_t)q[k / 2] >> (16 * (k % 2));
            const uint32_t signs = ksigns((aux >> (7 * k)) & 0x7F);
            w[2 * k] = signed_grid4(rf_iq3xxs_grid[idx & 0xFF], signs);
            w[2 * k + 1] = signed_grid4(rf_iq3xxs_grid[(idx >> 8) & 0xFF], signs >> 4);
        }
        a[0] = a[1] = half_at(blk) * (0.5f + (float)(aux >> 28)) * 0.5f;
        b[0] = b[1] = 0.0f;
        xb[0] = t;
    }
};

// IQ3_S: 110-byte super-blocks (2-byte aligned): d, 64 low index bytes, 8 bytes of ninth
// index bits (bit j of byte t for index 8t + j), 32 sign bytes (one per run), 4 bytes of
// 4-bit scales ls: values d·(1 + 2·ls)·(±grid). Task t: index bytes 8t..8t+7, sign
// bytes 4t..4t+3.
struct MIQ3_S {
    static constexpr int kValues = 256, kBytes = 110, kTasks = 8, kX = 1;
    __device__ static void task(const uint8_t* blk, int t, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        int q[2], s[1];
        load_words<2>(blk + 2 + 8 * t, q);
        load_words<1>(blk + 74 + 4 * t, s);
        const uint32_t high = (uint32_t)blk[66 + t] << 8;  // bit j at bit 8 + j
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint32_t idx = (uint32_t)q[k / 2] >> (16 * (k % 2));
            const uint32_t i0 = (idx & 0xFF) | ((high >> (2 * k)) & 0x100);
            const uint32_t i1 = ((idx >> 8) & 0xFF) | ((high >> (2 * k + 1)) & 0x100);
            const uint32_t signs = (uint32_t)s[0] >> (8 * k);
            w[2 * k] = signed_grid4(rf_iq3s_grid[i0], signs);
            w[2 * k + 1] = signed_grid4(rf_iq3s_grid[i1], signs >> 4);
        }
        const uint32_t ls = (blk[106 + t / 2] >> (4 * (t % 2))) & 0xF;
        a[0] = a[1] = half_at(blk) * (float)(1 + 2 * ls);
        b[0] = b[1] = 0.0f;
        xb[0] = t;
    }
};

// A run of 8 grid magnitudes (bytes of g) with its sign byte applied, as two words.
__device__ __forceinline__ void signed_grid8(uint64_t g, uint32_t signs, int& lo, int& hi) {
    lo = signed_grid4((uint32_t)g, signs);
    hi = signed_grid4((uint32_t)(g >> 32), signs >> 4);
}

// IQ2_XXS: 66-byte super-blocks (2-byte aligned): d, then per sub-block 8 bytes: four
// grid indices (one per run), and a u32 of four 7-bit sign indices and a 4-bit scale ls
// in the top bits: values d·(0.5 + ls)·0.25·(±grid). Task t: bytes 8t..8t+7.
struct MIQ2_XXS {
    static constexpr int kValues = 256, kBytes = 66, kTasks = 8, kX = 1;
    __device__ static void task(const uint8_t* blk, int t, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        int q[2];
        load_words<2>(blk + 2 + 8 * t, q);
        const uint32_t aux = (uint32_t)q[1];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint64_t g = rf_iq2xxs_grid[((uint32_t)q[0] >> (8 * k)) & 0xFF];
            signed_grid8(g, ksigns((aux >> (7 * k)) & 0x7F), w[2 * k], w[2 * k + 1]);
        }
        a[0] = a[1] = half_at(blk) * (0.5f + (float)(aux >> 28)) * 0.25f;
        b[0] = b[1] = 0.0f;
        xb[0] = t;
    }
};

// IQ2_XS: 74-byte super-blocks (2-byte aligned): d, 32 u16 (per run a 9-bit grid index
// and a 7-bit sign index), 8 scale bytes (per sub-block, the low nibble ls for its first
// 16 values, the high one for the rest): values d·(0.5 + ls)·0.25·(±grid). Task t: u16s
// 4t..4t+3 and scale byte t.
struct MIQ2_XS {
    static constexpr int kValues = 256, kBytes = 74, kTasks = 8, kX = 1;
    __device__ static void task(const uint8_t* blk, int t, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        int q[2];
        load_words<2>(blk + 2 + 8 * t, q);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint32_t e = ((uint32_t)q[k / 2] >> (16 * (k % 2))) & 0xFFFF;
            signed_grid8(rf_iq2xs_grid[e & 511], ksigns(e >> 9), w[2 * k], w[2 * k + 1]);
        }
        const float d = half_at(blk);
        const uint32_t sc = blk[66 + t];
        a[0] = d * (0.5f + (float)(sc & 0xF)) * 0.25f;
        a[1] = d * (0.5f + (float)(sc >> 4)) * 0.25f;
        b[0] = b[1] = 0.0f;
        xb[0] = t;
    }
};

// IQ2_S: 82-byte super-blocks (2-byte aligned): d, 32 low index bytes, 32 sign bytes (one
// per run), 8 bytes of high index bit pairs (bits 2k, 2k+1 of byte t for run k of
// sub-block t), 8 scale bytes as IQ2_XS: values d·(0.5 + ls)·0.25·(±grid). Task t: index
// and sign bytes 4t..4t+3, high-bit and scale byte t.
struct MIQ2_S {
    static constexpr int kValues = 256, kBytes = 82, kTasks = 8, kX = 1;
    __device__ static void task(const uint8_t* blk, int t, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        int q[1], s[1];
        load_words<1>(blk + 2 + 4 * t, q);
        load_words<1>(blk + 34 + 4 * t, s);
        const uint32_t high = blk[66 + t];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint32_t i = (((uint32_t)q[0] >> (8 * k)) & 0xFF) | (((high >> (2 * k)) & 3) << 8);
            signed_grid8(rf_iq2s_grid[i], (uint32_t)s[0] >> (8 * k), w[2 * k], w[2 * k + 1]);
        }
        const float d = half_at(blk);
        const uint32_t sc = blk[74 + t];
        a[0] = d * (0.5f + (float)(sc & 0xF)) * 0.25f;
        a[1] = d * (0.5f + (float)(sc >> 4)) * 0.25f;
        b[0] = b[1] = 0.0f;
        xb[0] = t;
    }
};

// IQ1_S: 50-byte super-blocks (2-byte aligned): d, 32 low index bytes, then per sub-block
// a u16: four 3-bit high index parts (one per run), a 3-bit scale ls, the sign of the
// shift δ = ±1/8. The grid's values are -1, 0 and 1 (int8 bytes), so w is the entry
// itself: values dl·(g + δ) with dl = d·(2·ls + 1), a = dl, b = dl·δ. Task t: index
// bytes 4t..4t+3, u16 t.
struct MIQ1_S {
    static constexpr int kValues = 256, kBytes = 50, kTasks = 8, kX = 1;
    __device__ static void task(const uint8_t* blk, int t, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        int q[1];
        load_words<1>(blk + 2 + 4 * t, q);
        const uint32_t qh = *reinterpret_cast<const uint16_t*>(blk + 34 + 2 * t);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint32_t i = (((uint32_t)q[0] >> (8 * k)) & 0xFF) | (((qh >> (3 * k)) & 7) << 8);
            const uint64_t g = rf_iq1s_grid[i];
            w[2 * k] = (int)(uint32_t)g;
            w[2 * k + 1] = (int)(uint32_t)(g >> 32);
        }
        const float dl = half_at(blk) * (float)(2 * ((qh >> 12) & 7) + 1);
        a[0] = a[1] = dl;
        b[0] = b[1] = dl * ((qh & 0x8000) ? -RF_IQ1S_DELTA : RF_IQ1S_DELTA);
        xb[0] = t;
    }
};

// Bytes a + b, each modulo 256 (no carry between bytes).
__device__ __forceinline__ int add_bytes(uint32_t a, uint32_t b) {
    const uint32_t low7 = (a & 0x7F7F7F7Fu) + (b & 0x7F7F7F7Fu);
    return (int)(low7 ^ ((a ^ b) & 0x80808080u));
}

// IQ1_M: 56-byte super-blocks (8-byte aligned): 32 low index bytes, 16 bytes of nibbles
// (per run: three high index bits, then the sign of its shift δ = ±1/8), 4 u16 of 3-bit
// scales ls (per 16 values s: bits 3·(s % 4) of u16 s / 4) whose top nibbles hold the f16
// d. The shift changes from run to run within 16 values, so it goes into w: dl·(g + δ) =
// (dl/8)·(8g ± 1), so w = 8g ± 1, a = d·(2·ls + 1)/8, b = 0. Task t: index bytes
// 4t..4t+3, nibble bytes 2t, 2t + 1, scales 2t, 2t + 1.
struct MIQ1_M {
    static constexpr int kValues = 256, kBytes = 56, kTasks = 8, kX = 1;
    __device__ static void task(const uint8_t* blk, int t, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        const int* words = reinterpret_cast<const int*>(blk);
        const uint32_t q = (uint32_t)words[t];
        const uint32_t nibbles = *reinterpret_cast<const uint16_t*>(blk + 32 + 2 * t);
        const uint32_t s01 = (uint32_t)words[12], s23 = (uint32_t)words[13];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint32_t n = nibbles >> (4 * k);
            const uint64_t g = rf_iq1s_grid[((q >> (8 * k)) & 0xFF) | ((n & 7) << 8)];
            const uint32_t shift = (n & 8) ? 0xFFFFFFFFu : 0x01010101u;  // -1 or +1 a byte
            // 8g a byte: the bits that leave a byte are masked off.
            w[2 * k] = add_bytes(((uint32_t)g << 3) & 0xF8F8F8F8u, shift);
            w[2 * k + 1] = add_bytes(((uint32_t)(g >> 32) << 3) & 0xF8F8F8F8u, shift);
        }
        const uint32_t bits = ((s01 >> 12) & 0xF) | ((s01 >> 24) & 0xF0) | ((s23 >> 4) & 0xF00) |
                              ((s23 >> 16) & 0xF000);
        const float d = __half2float(__ushort_as_half((unsigned short)bits));
        const uint32_t sc = (t < 4 ? s01 : s23) >> (16 * ((t / 2) % 2) + 6 * (t % 2));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            a[h] = d * (float)(2 * ((sc >> (3 * h)) & 7) + 1) * 0.125f;
            b[h] = 0.0f;
        }
        xb[0] = t;
    }
};

// MXFP4: 17-byte blocks (any alignment; load_words takes any byte offset and reads only
// aligned words that hold bytes of the block): an E8M0 exponent e, then 16 bytes of
// 4-bit indices (values 0-15 low nibbles, 16-31 high) into the E2M1 values, doubled to
// integers (0 1 2 3 4 6 8 12, then their negatives): values 2^(e - 128)·w.
//
// The indices become values by byte permutes, four at a time: a permute's selector takes
// the low three bits of each of its four nibbles, so the 16 bits of two bytes of indices
// (low, high, low, high) look up four magnitudes in the table's positive half and four in
// its negative half, and a third permute takes each byte from one or the other by the
// nibble's top bit (the sign). Two more put the low nibbles' values in one word and the
// high nibbles' in another. Nine permutes and a few logic operations for eight values,
// where a lookup a value took about eight operations each.
__device__ __forceinline__ void mxfp4_words(uint32_t q, int& low, int& high) {
    constexpr uint32_t kPos0 = 0x03020100u, kPos1 = 0x0C080604u;  //  0  1  2  3 |  4  6  8  12
    constexpr uint32_t kNeg0 = 0xFDFEFF00u, kNeg1 = 0xF4F8FAFCu;  //  0 -1 -2 -3 | -4 -6 -8 -12
    uint32_t v[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const uint32_t s = q >> (16 * i);  // indices of bytes 2i and 2i + 1: low, high, low, high
        const uint32_t pos = __byte_perm(kPos0, kPos1, s);
        const uint32_t neg = __byte_perm(kNeg0, kNeg1, s);
        v[i] = __byte_perm(pos, neg, 0x3210u | ((s & 0x8888u) >> 1));
    }
    low = (int)__byte_perm(v[0], v[1], 0x6420u);
    high = (int)__byte_perm(v[0], v[1], 0x7531u);
}

struct MMXFP4 {
    static constexpr int kValues = 32, kBytes = 17, kTasks = 1, kX = 1;
    static constexpr bool kScale32 = true;
    __device__ static void task(const uint8_t* blk, int, int (&w)[8 * kX], float (&a)[2 * kX],
                                float (&b)[2 * kX], int (&xb)[kX]) {
        int q[4];
        load_words<4>(blk + 1, q);
#pragma unroll
        for (int i = 0; i < 4; ++i) mxfp4_words((uint32_t)q[i], w[i], w[i + 4]);
        a[0] = a[1] = e8m0_to_f32_half(blk[0]);
        b[0] = b[1] = 0.0f;
        xb[0] = 0;
    }
};

}  // namespace rf

#endif  // ROCMFORGE_DEQUANT_MATVEC_TASKS_H
