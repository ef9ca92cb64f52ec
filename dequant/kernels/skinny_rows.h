// skinny_rows.h: how the skinny kernel (skinny.hip) reads and decodes each type's rows:
// which types have loads of their own (SkinnyFast), the alignment those loads need
// (SkinnyAlign), and per type the loads of a lane's 16 values of a row from the row's
// copy in shared memory and their decoding straight to f16 pairs (SkinnyRow). Included
// by skinny.hip.
#ifndef ROCMFORGE_DEQUANT_SKINNY_ROWS_H
#define ROCMFORGE_DEQUANT_SKINNY_ROWS_H

#include <type_traits>

namespace rf {

// The types with loads and decoders of their own here (SkinnyRow), and the alignment in
// bytes their loads need of the matrices (a row's size is a multiple of it).
template <typename F>
struct SkinnyFast : std::false_type {};
template <typename F>
struct SkinnyAlign : std::integral_constant<int, 2> {};
template <>
struct SkinnyFast<Q4_0> : std::true_type {};
template <>
struct SkinnyFast<Q4_1> : std::true_type {};
template <>
struct SkinnyFast<Q5_0> : std::true_type {};
template <>
struct SkinnyFast<Q5_1> : std::true_type {};
template <>
struct SkinnyFast<Q8_0> : std::true_type {};
template <>
struct SkinnyFast<Q4_K> : std::true_type {};
template <>
struct SkinnyFast<Q5_K> : std::true_type {};
template <>
struct SkinnyFast<Q6_K> : std::true_type {};
template <>
struct SkinnyFast<MXFP4> : std::true_type {};
template <>
struct SkinnyAlign<Q4_1> : std::integral_constant<int, 4> {};
template <>
struct SkinnyAlign<Q5_1> : std::integral_constant<int, 8> {};
template <>
struct SkinnyAlign<Q4_K> : std::integral_constant<int, 16> {};
template <>
struct SkinnyAlign<Q5_K> : std::integral_constant<int, 16> {};
// MXFP4's 17-byte blocks fall at any byte: its loads below take any alignment.
template <>
struct SkinnyAlign<MXFP4> : std::integral_constant<int, 1> {};

#if defined(RF_MM_MMA)
// The loads below read a chunk's blocks from shared memory, where each row's copy keeps
// the alignment its bytes have in device memory (modulo 16).

// 16 bytes at a 2-byte aligned address, or any other (common.h's load_words).
__device__ __forceinline__ uint4 load16_a2(const uint8_t* p) {
    int w[4];
    load_words<4>(p, w);
    return make_uint4((uint32_t)w[0], (uint32_t)w[1], (uint32_t)w[2], (uint32_t)w[3]);
}

// 16 bytes at a 4-, 8- or 16-byte aligned address.
__device__ __forceinline__ uint4 load16_a4(const uint8_t* p) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p);
    return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ uint4 load16_a8(const uint8_t* p) {
    const uint2* w = reinterpret_cast<const uint2*>(p);
    const uint2 a = w[0], b = w[1];
    return make_uint4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ uint4 load16_a16(const uint8_t* p) {
    return *reinterpret_cast<const uint4*>(p);
}
// The two bytes at a 2-byte aligned address.
__device__ __forceinline__ uint32_t load2(const uint8_t* p) {
    return *reinterpret_cast<const unsigned short*>(p);
}

__device__ __forceinline__ __half2 half2_of_bits(uint32_t bits) {
    return __half2half2(__ushort_as_half((unsigned short)(bits & 0xFFFF)));
}

// Sixteen small integers q (one a byte) as f16 pairs: ((q - offset) · scale) · d + add,
// or (q - offset) · scale without the multiply-add; eight pairs, values 0..7 in `lo`,
// 8..15 in `hi`. `off` is 1024 + offset: each byte becomes the half 1024 + q first.
__device__ __forceinline__ void halves16(uint4 q, __half2 off, __half2 scale, __half2 d,
                                         __half2 add, bool fma, uint4& lo, uint4& hi) {
    uint32_t out[8];
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        __half2 a, b;
        bytes_to_halves(words[i], a, b);
        a = __hmul2(__hsub2(a, off), scale);
        b = __hmul2(__hsub2(b, off), scale);
        if (fma) {
            a = __hfma2(a, d, add);
            b = __hfma2(b, d, add);
        }
        out[2 * i] = half2_bits(a);
        out[2 * i + 1] = half2_bits(b);
    }
    lo = make_uint4(out[0], out[1], out[2], out[3]);
    hi = make_uint4(out[4], out[5], out[6], out[7]);
}

// The low (shift 0) or high (shift 4) nibbles of 16 bytes.
__device__ __forceinline__ uint4 nibbles(uint4 v, int shift) {
    return make_uint4((v.x >> shift) & 0x0F0F0F0Fu, (v.y >> shift) & 0x0F0F0F0Fu,
                      (v.z >> shift) & 0x0F0F0F0Fu, (v.w >> shift) & 0x0F0F0F0Fu);
}

// How a lane reads and decodes its 16 values of a row for a step, from the row's copy in
// shared memory (`row`: the chunk's first block; `k`: the column within the chunk):
// `load` takes the raw bytes with the widest loads their alignment allows, `decode`
// turns them into f16 pairs: for Q8_0, Q4_0, Q4_K and Q6_K the values HalfDecode gives,
// for the others decode8's values rounded to f16 (but for a rare double rounding: Q4_1
// and Q5_1 take d·q + m in one f16 multiply-add). Values past the row's end (`cols`,
// counted from the chunk's start too; a multiple of 8) read as zeros. The general form
// serves forced launches (comparisons, tests) of the types without a form of their own,
// with the tiled kernel's decoders.
template <typename F, typename Enable = void>
struct SkinnyRow {
    struct Raw {
        const uint8_t* row;
        int k;
    };
    static __device__ __forceinline__ Raw load(const uint8_t* row, int k, int) {
        return Raw{row, k};
    }
    static __device__ __forceinline__ uint4 eight(const uint8_t* row, int k) {
        const uint8_t* blk = row + (size_t)(k / F::kValues) * F::kBytes;
        if constexpr (HalfDecode<F>::kHas) {
            return HalfDecode<F>::decode8h(blk, k % F::kValues);
        } else {
            float v[kGroup];
            F::decode8(blk, k % F::kValues, v);
            return pack8(v);
        }
    }
    static __device__ __forceinline__ void decode(const Raw& r, int cols, uint4& lo, uint4& hi) {
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        lo = r.k < cols ? eight(r.row, r.k) : zero;
        hi = r.k + 8 < cols ? eight(r.row, r.k + 8) : zero;
    }
};

// The legacy 32-value blocks: a lane's 16 values are the low (first half of the block)
// or high (second half) nibbles of the block's 16 quant bytes, or half of Q8_0's 32.
// `head` holds d (and m, above it), `qh` the fifth bits of Q5_0/Q5_1. Rows of 32-value
// blocks end on a whole block, so a lane's values are all inside the row or all past it.
struct LegacyRaw {
    uint4 q;
    uint32_t head, qh;
    int half;  // 0: values 0..15 of the block, 1: 16..31; -1: past the row's end
};

// The 5-bit values of a Q5_0/Q5_1 lane: its nibbles, and bits v .. v + 15 of qh.
__device__ __forceinline__ uint4 five_bit_values(const LegacyRaw& r) {
    const int v = r.half > 0 ? 16 : 0;
    const uint4 q = nibbles(r.q, r.half > 0 ? 4 : 0);
    return make_uint4(q.x | (uint32_t)spread4(r.qh, v), q.y | (uint32_t)spread4(r.qh, v + 4),
                      q.z | (uint32_t)spread4(r.qh, v + 8), q.w | (uint32_t)spread4(r.qh, v + 12));
}

template <>
struct SkinnyRow<Q4_0> {
    using Raw = LegacyRaw;
    static __device__ __forceinline__ Raw load(const uint8_t* row, int k, int cols) {
        Raw r{};
        r.half = k < cols ? (k % 32) / 16 : -1;
        if (r.half < 0) return r;
        const uint8_t* blk = row + (size_t)(k / 32) * 18;
        r.head = load2(blk);
        r.q = load16_a2(blk + 2);
        return r;
    }
    static __device__ __forceinline__ void decode(const Raw& r, int, uint4& lo, uint4& hi) {
        const __half2 d = half2_of_bits(r.head), zero = __float2half2_rn(0.0f);
        halves16(nibbles(r.q, r.half > 0 ? 4 : 0), __float2half2_rn(1024.0f + 8.0f), d, zero,
                 zero, false, lo, hi);
        if (r.half < 0) lo = hi = make_uint4(0u, 0u, 0u, 0u);
    }
};

template <>
struct SkinnyRow<Q4_1> {
    using Raw = LegacyRaw;
    static __device__ __forceinline__ Raw load(const uint8_t* row, int k, int cols) {
        Raw r{};
        r.half = k < cols ? (k % 32) / 16 : -1;
        if (r.half < 0) return r;
        const uint8_t* blk = row + (size_t)(k / 32) * 20;
        r.head = *reinterpret_cast<const uint32_t*>(blk);
        r.q = load16_a4(blk + 4);
        return r;
    }
    static __device__ __forceinline__ void decode(const Raw& r, int, uint4& lo, uint4& hi) {
        const __half2 one = __float2half2_rn(1.0f);
        halves16(nibbles(r.q, r.half > 0 ? 4 : 0), __float2half2_rn(1024.0f), one,
                 half2_of_bits(r.head), half2_of_bits(r.head >> 16), true, lo, hi);
        if (r.half < 0) lo = hi = make_uint4(0u, 0u, 0u, 0u);
    }
};

template <>
struct SkinnyRow<Q5_0> {
    using Raw = LegacyRaw;
    static __device__ __forceinline__ Raw load(const uint8_t* row, int k, int cols) {
        Raw r{};
        r.half = k < cols ? (k % 32) / 16 : -1;
        if (r.half < 0) return r;
        const uint8_t* blk = row + (size_t)(k / 32) * 22;
        r.head = load2(blk);
        r.qh = load2(blk + 2) | (load2(blk + 4) << 16);
        r.q = load16_a2(blk + 6);
        return r;
    }
    static __device__ __forceinline__ void decode(const Raw& r, int, uint4& lo, uint4& hi) {
        const uint4 q = five_bit_values(r);
        const __half2 zero = __float2half2_rn(0.0f);
        halves16(q, __float2half2_rn(1024.0f + 16.0f), half2_of_bits(r.head), zero, zero, false,
                 lo, hi);
        if (r.half < 0) lo = hi = make_uint4(0u, 0u, 0u, 0u);
    }
};

template <>
struct SkinnyRow<Q5_1> {
    using Raw = LegacyRaw;
    static __device__ __forceinline__ Raw load(const uint8_t* row, int k, int cols) {
        Raw r{};
        r.half = k < cols ? (k % 32) / 16 : -1;
        if (r.half < 0) return r;
        const uint8_t* blk = row + (size_t)(k / 32) * 24;
        const uint2 head = *reinterpret_cast<const uint2*>(blk);
        r.head = head.x;
        r.qh = head.y;
        r.q = load16_a8(blk + 8);
        return r;
    }
    static __device__ __forceinline__ void decode(const Raw& r, int, uint4& lo, uint4& hi) {
        const uint4 q = five_bit_values(r);
        const __half2 one = __float2half2_rn(1.0f);
        halves16(q, __float2half2_rn(1024.0f), one, half2_of_bits(r.head),
                 half2_of_bits(r.head >> 16), true, lo, hi);
        if (r.half < 0) lo = hi = make_uint4(0u, 0u, 0u, 0u);
    }
};

template <>
struct SkinnyRow<Q8_0> {
    using Raw = LegacyRaw;
    static __device__ __forceinline__ Raw load(const uint8_t* row, int k, int cols) {
        Raw r{};
        r.half = k < cols ? (k % 32) / 16 : -1;
        if (r.half < 0) return r;
        const uint8_t* blk = row + (size_t)(k / 32) * 34;
        r.head = load2(blk);
        r.q = load16_a2(blk + 2 + 16 * r.half);
        return r;
    }
    static __device__ __forceinline__ void decode(const Raw& r, int, uint4& lo, uint4& hi) {
        // Signed bytes as q + 128.
        const uint4 q = make_uint4(r.q.x ^ 0x80808080u, r.q.y ^ 0x80808080u,
                                   r.q.z ^ 0x80808080u, r.q.w ^ 0x80808080u);
        const __half2 zero = __float2half2_rn(0.0f);
        halves16(q, __float2half2_rn(1024.0f + 128.0f), half2_of_bits(r.head), zero, zero, false,
                 lo, hi);
        if (r.half < 0) lo = hi = make_uint4(0u, 0u, 0u, 0u);
    }
};

// Q4_K and Q5_K: 144- and 176-byte super-blocks, 16-byte aligned when the row is. The 16
// values of a lane are one half of a sub-block: 16 bytes of qs, one nibble each (and
// Q5_K's fifth bits, bit `sub` of 16 bytes of qh).
template <bool kFive>
struct KRaw {
    uint4 head;  // d, dmin, the 12 scale bytes
    uint4 qs;
    uint4 qh;  // Q5_K only
    int sub;   // the sub-block (0..7)
};

template <bool kFive>
struct SkinnyKRow {
    using Raw = KRaw<kFive>;
    static constexpr int kBytes = kFive ? 176 : 144;
    static __device__ __forceinline__ Raw load(const uint8_t* row, int k, int) {
        const uint8_t* blk = row + (size_t)(k / 256) * kBytes;
        const int v = k % 256, c = v / 64, part = (v % 64) / 16;
        Raw r;
        r.head = load16_a16(blk);
        r.qs = load16_a16(blk + (kFive ? 48 : 16) + 32 * c + 16 * (part % 2));
        if (kFive) r.qh = load16_a16(blk + 16 + 16 * (part % 2));
        r.sub = 2 * c + part / 2;
        return r;
    }
    static __device__ __forceinline__ void decode(const Raw& r, int, uint4& lo, uint4& hi) {
        const int g = r.sub;
        const int words[3] = {(int)r.head.y, (int)r.head.z, (int)r.head.w};
        int sc, m;
        k_scale_min(words, g, sc, m);
        const __half2 d = half2_of_bits(r.head.x);
        const float dmin = f16_bits_to_f32(r.head.x >> 16);
        // As HalfDecode<Q4_K>: sc · q exact in f16, then d · (sc · q) - dmin·m rounded once.
        const __half2 scale = __float2half2_rn(small_int_f32(sc));
        const __half2 neg_min = __float2half2_rn(-mul(dmin, small_int_f32(m)));
        uint4 q = nibbles(r.qs, 4 * (g % 2));
        if (kFive) {
            auto bit = [&](uint32_t h) { return ((h >> g) & 0x01010101u) << 4; };
            q = make_uint4(q.x | bit(r.qh.x), q.y | bit(r.qh.y), q.z | bit(r.qh.z),
                           q.w | bit(r.qh.w));
        }
        halves16(q, __float2half2_rn(1024.0f), scale, d, neg_min, true, lo, hi);
    }
};
template <>
struct SkinnyRow<Q4_K> : SkinnyKRow<false> {};
template <>
struct SkinnyRow<Q5_K> : SkinnyKRow<true> {};

// Q6_K: 210-byte super-blocks (2-byte aligned). The 16 values of a lane share one scale;
// their low four bits are 16 bytes of ql (one nibble each), their high two 16 bytes of qh.
template <>
struct SkinnyRow<Q6_K> {
    struct Raw {
        uint4 ql, qh;
        uint32_t tail;  // d (low 16 bits) and the scale byte (bits 16..23)
        int quarter;
    };
    static __device__ __forceinline__ Raw load(const uint8_t* row, int k, int) {
        const uint8_t* blk = row + (size_t)(k / 256) * 210;
        const int v = k % 256, h = v / 128, l = v % 128, quarter = l / 32, i0 = l % 32;
        Raw r;
        r.ql = load16_a2(blk + 64 * h + 32 * (quarter % 2) + i0);
        r.qh = load16_a2(blk + 128 + 32 * h + i0);
        r.tail = load2(blk + 208) | ((uint32_t)blk[192 + v / 16] << 16);
        r.quarter = quarter;
        return r;
    }
    static __device__ __forceinline__ void decode(const Raw& r, int, uint4& lo, uint4& hi) {
        // As HalfDecode<Q6_K>: d · sc rounded to f16 once, then (q - 32) times it.
        const float dl = mul(f16_bits_to_f32(r.tail & 0xFFFF),
                             small_int_f32((int)(int8_t)(uint8_t)(r.tail >> 16)));
        const int s1 = 4 * (r.quarter / 2), s2 = 2 * r.quarter;
        auto six = [&](uint32_t low, uint32_t high) {
            return ((low >> s1) & 0x0F0F0F0Fu) | (((high >> s2) & 0x03030303u) << 4);
        };
        const uint4 q = make_uint4(six(r.ql.x, r.qh.x), six(r.ql.y, r.qh.y), six(r.ql.z, r.qh.z),
                                   six(r.ql.w, r.qh.w));
        const __half2 zero = __float2half2_rn(0.0f);
        halves16(q, __float2half2_rn(1024.0f + 32.0f), __float2half2_rn(dl), zero, zero, false, lo,
                 hi);
    }
};

// MXFP4: 17-byte blocks (the scale byte, then 16 bytes of nibbles) at any byte offset. A
// lane's 16 values are the low (first half of the block) or high (second half) nibbles
// of the block's 16 bytes, read as aligned words of shared memory shifted into place
// (load16_a2, which takes any offset). Values as
// HalfDecode<MXFP4> gives them, blocks whose scale leaves f16's range through decode8.
template <>
struct SkinnyRow<MXFP4> {
    struct Raw {
        uint4 q;
        const uint8_t* blk;
        int half;  // 0: values 0..15 of the block, 1: 16..31; -1: past the row's end
    };
    static __device__ __forceinline__ Raw load(const uint8_t* row, int k, int cols) {
        Raw r{};
        r.half = k < cols ? (k % 32) / 16 : -1;
        if (r.half < 0) return r;
        r.blk = row + (size_t)(k / 32) * 17;
        r.q = load16_a2(r.blk + 1);
        return r;
    }
    static __device__ __forceinline__ void decode(const Raw& r, int, uint4& lo, uint4& hi) {
        using H = HalfDecode<MXFP4>;
        if (r.half < 0) {
            lo = hi = make_uint4(0u, 0u, 0u, 0u);
            return;
        }
        if (!H::in_range(r.blk)) {
            lo = H::decode8h(r.blk, 16 * r.half);
            hi = H::decode8h(r.blk, 16 * r.half + 8);
            return;
        }
        const __half2 d = H::scale(r.blk);
        const int shift = r.half > 0 ? 4 : 0;
        lo = H::eight(make_uint2(r.q.x, r.q.y), shift, d);
        hi = H::eight(make_uint2(r.q.z, r.q.w), shift, d);
    }
};
#endif

}  // namespace rf

#endif  // ROCMFORGE_DEQUANT_SKINNY_ROWS_H
