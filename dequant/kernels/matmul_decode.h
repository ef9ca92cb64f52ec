// matmul_decode.h: how the batch products turn weight blocks into f16 tiles: plain
// element types as blocks, the f16 decoders of the common formats (HalfDecode), the
// staging of raw blocks in shared memory and its asynchronous copies. Included by
// matmul.hip, after the decoders (decode_*.h) and its tile constants.
#ifndef ROCMFORGE_DEQUANT_MATMUL_DECODE_H
#define ROCMFORGE_DEQUANT_MATMUL_DECODE_H

namespace rf {

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

// Eight f32 values as eight f16 (each rounded to nearest even) in one 16-byte word, two
// to a conversion.
__device__ __forceinline__ uint4 pack8(const float (&v)[kGroup]) {
    uint4 out;
    uint32_t* words = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2 pair = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
        words[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    return out;
}

// ------------------------------------------------------------ f16 decoders -------------
// The formats of most downloaded files decode straight to f16 pairs: four bytes of
// quants become two pairs of halves 1024 + q (the byte under the exponent of 1024, whose
// unit in the last place is 1: exact), the offset comes off exactly, and one half-pair
// multiply (or multiply-add) applies the scale. A value costs about a quarter of the
// instructions of decode8 and pack8, and the decode is what bounds these products.
//
// Q8_0 and Q4_0 give decode8's values, bit for bit: q · d is exact in f32 and rounds once
// to f16 on either path. Q4_K and Q6_K may differ from decode8's rounded value by a unit
// in the last place: Q4_K's minimum (dmin · m) is rounded to f16 before it is taken off,
// Q6_K's scale (d · sc) before it multiplies.
template <typename F>
struct HalfDecode {
    static constexpr bool kHas = false;
};

// Eight and sixteen bytes at p (any alignment), little-endian words. Off a word
// boundary, from the aligned words that overlap them (an aligned word holding a byte of a
// buffer lies in that buffer's page and allocation), shifted into place: a staged Q6_K
// block (210 bytes) is often only 2-byte aligned, and byte loads cost four times as many
// shared-memory reads.
__device__ __forceinline__ uint2 load8(const uint8_t* p) {
    const uintptr_t a = (uintptr_t)p;
    const uint32_t* w = reinterpret_cast<const uint32_t*>(a & ~(uintptr_t)3);
    const uint32_t s = 8 * (uint32_t)(a & 3);
    if (s == 0) return make_uint2(w[0], w[1]);
    const uint32_t w0 = w[0], w1 = w[1], w2 = w[2];
    return make_uint2(__funnelshift_r(w0, w1, s), __funnelshift_r(w1, w2, s));
}
__device__ __forceinline__ uint4 load16(const uint8_t* p) {
    const uintptr_t a = (uintptr_t)p;
    if ((a & 15) == 0) return *reinterpret_cast<const uint4*>(p);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(a & ~(uintptr_t)3);
    const uint32_t s = 8 * (uint32_t)(a & 3);
    if (s == 0) return make_uint4(w[0], w[1], w[2], w[3]);
    const uint32_t w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3], w4 = w[4];
    return make_uint4(__funnelshift_r(w0, w1, s), __funnelshift_r(w1, w2, s),
                      __funnelshift_r(w2, w3, s), __funnelshift_r(w3, w4, s));
}

// The four bytes of `bytes` (each below 1024) as halves 1024 + byte, two pairs.
__device__ __forceinline__ void bytes_to_halves(uint32_t bytes, __half2& lo, __half2& hi) {
    const uint32_t a = __byte_perm(bytes, 0x64646464u, 0x4140);
    const uint32_t b = __byte_perm(bytes, 0x64646464u, 0x4342);
    lo = *reinterpret_cast<const __half2*>(&a);
    hi = *reinterpret_cast<const __half2*>(&b);
}

__device__ __forceinline__ uint32_t half2_bits(__half2 h) {
    return *reinterpret_cast<const uint32_t*>(&h);
}

// Eight quant bytes (two words) as f16 pairs (q - offset) · scale.
__device__ __forceinline__ uint4 scaled_halves(uint2 q, float offset, __half2 scale) {
    const __half2 off = __float2half2_rn(1024.0f + offset);
    __half2 h[4];
    bytes_to_halves(q.x, h[0], h[1]);
    bytes_to_halves(q.y, h[2], h[3]);
    uint4 out;
    out.x = half2_bits(__hmul2(__hsub2(h[0], off), scale));
    out.y = half2_bits(__hmul2(__hsub2(h[1], off), scale));
    out.z = half2_bits(__hmul2(__hsub2(h[2], off), scale));
    out.w = half2_bits(__hmul2(__hsub2(h[3], off), scale));
    return out;
}

// Each specialization decodes eight values at j (decode8h) and sixteen at j, a multiple
// of 16 (decode16h): the sixteen share their block's and sub-block's scales, worked out
// once. decode16h gives decode8h's values at j and j + 8, bit for bit.
template <>
struct HalfDecode<Q8_0> {
    static constexpr bool kHas = true;
    static __device__ __forceinline__ __half2 scale(const uint8_t* b) {
        return __half2half2(__ushort_as_half((unsigned short)u16_at(b)));
    }
    static __device__ __forceinline__ uint4 decode8h(const uint8_t* b, int j) {
        // Signed bytes as q + 128.
        const uint2 q = load8(b + 2 + j);
        return scaled_halves(make_uint2(q.x ^ 0x80808080u, q.y ^ 0x80808080u), 128.0f, scale(b));
    }
    static __device__ __forceinline__ void decode16h(const uint8_t* b, int j, uint4 (&out)[2]) {
        const __half2 d = scale(b);
        const uint4 q = load16(b + 2 + j);
        out[0] = scaled_halves(make_uint2(q.x ^ 0x80808080u, q.y ^ 0x80808080u), 128.0f, d);
        out[1] = scaled_halves(make_uint2(q.z ^ 0x80808080u, q.w ^ 0x80808080u), 128.0f, d);
    }
};

template <>
struct HalfDecode<Q4_0> {
    static constexpr bool kHas = true;
    static __device__ __forceinline__ uint2 nibbles(uint32_t x, uint32_t y, int shift) {
        return make_uint2((x >> shift) & 0x0F0F0F0Fu, (y >> shift) & 0x0F0F0F0Fu);
    }
    static __device__ __forceinline__ uint4 decode8h(const uint8_t* b, int j) {
        const __half2 d = HalfDecode<Q8_0>::scale(b);
        const uint2 raw = load8(b + 2 + (j & 15));
        return scaled_halves(nibbles(raw.x, raw.y, (j & 16) ? 4 : 0), 8.0f, d);
    }
    static __device__ __forceinline__ void decode16h(const uint8_t* b, int j, uint4 (&out)[2]) {
        const __half2 d = HalfDecode<Q8_0>::scale(b);
        const uint4 raw = load16(b + 2);
        const int shift = (j & 16) ? 4 : 0;
        out[0] = scaled_halves(nibbles(raw.x, raw.y, shift), 8.0f, d);
        out[1] = scaled_halves(nibbles(raw.z, raw.w, shift), 8.0f, d);
    }
};

template <>
struct HalfDecode<Q6_K> {
    static constexpr bool kHas = true;
    // Eight quants at l of the 32 that share quarter `quarter` of half h: their low four
    // bits from `low`, their high two from `high`.
    static __device__ __forceinline__ uint2 quants(uint32_t lx, uint32_t ly, uint32_t hx,
                                                   uint32_t hy, int quarter) {
        const int s1 = 4 * (quarter / 2), s2 = 2 * quarter;
        return make_uint2(((lx >> s1) & 0x0F0F0F0Fu) | (((hx >> s2) & 0x03030303u) << 4),
                          ((ly >> s1) & 0x0F0F0F0Fu) | (((hy >> s2) & 0x03030303u) << 4));
    }
    static __device__ __forceinline__ __half2 scale(const uint8_t* b, int j) {
        return __float2half2_rn(mul(f16_at(b + 208), small_int_f32((int8_t)b[192 + j / 16])));
    }
    static __device__ __forceinline__ uint4 decode8h(const uint8_t* b, int j) {
        const int h = j / 128, quarter = (j % 128) / 32, l = j % 32;
        const uint2 low = load8(b + 64 * h + 32 * (quarter % 2) + l);
        const uint2 high = load8(b + 128 + 32 * h + l);
        return scaled_halves(quants(low.x, low.y, high.x, high.y, quarter), 32.0f, scale(b, j));
    }
    static __device__ __forceinline__ void decode16h(const uint8_t* b, int j, uint4 (&out)[2]) {
        const __half2 dl = scale(b, j);
        const int h = j / 128, quarter = (j % 128) / 32, l = j % 32;
        const uint4 low = load16(b + 64 * h + 32 * (quarter % 2) + l);
        const uint4 high = load16(b + 128 + 32 * h + l);
        out[0] = scaled_halves(quants(low.x, low.y, high.x, high.y, quarter), 32.0f, dl);
        out[1] = scaled_halves(quants(low.z, low.w, high.z, high.w, quarter), 32.0f, dl);
    }
};

template <>
struct HalfDecode<Q4_K> {
    static constexpr bool kHas = true;
    // Sub-block g's factors: sc · q = q' · sc - 1024 · sc for q' = 1024 + q (one fused
    // multiply-add, exact: the result is an integer below 2^10, and 1024 · sc is exact),
    // then d · (sc · q) - dmin · m rounded once.
    struct Factors {
        __half2 scale, neg_offset, d, neg_min;
    };
    static __device__ __forceinline__ Factors factors(const uint8_t* b, int g) {
        uint32_t sc, m;
        k_scale_min(b + 4, g, sc, m);
        Factors f;
        f.scale = __float2half2_rn(small_int_f32((int)sc));
        f.neg_offset = __float2half2_rn(-1024.0f * small_int_f32((int)sc));
        f.d = __half2half2(__ushort_as_half((unsigned short)u16_at(b)));
        f.neg_min = __float2half2_rn(-mul(f16_at(b + 2), small_int_f32((int)m)));
        return f;
    }
    static __device__ __forceinline__ uint4 halves(const Factors& f, uint32_t x, uint32_t y,
                                                   int shift) {
        __half2 h[4];
        bytes_to_halves((x >> shift) & 0x0F0F0F0Fu, h[0], h[1]);
        bytes_to_halves((y >> shift) & 0x0F0F0F0Fu, h[2], h[3]);
        uint4 out;
        uint32_t* words = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            words[i] = half2_bits(__hfma2(__hfma2(h[i], f.scale, f.neg_offset), f.d, f.neg_min));
        }
        return out;
    }
    static __device__ __forceinline__ uint4 decode8h(const uint8_t* b, int j) {
        const int g = j / 32;
        const uint2 raw = load8(b + 16 + 32 * (g / 2) + (j % 32));
        return halves(factors(b, g), raw.x, raw.y, 4 * (g % 2));
    }
    static __device__ __forceinline__ void decode16h(const uint8_t* b, int j, uint4 (&out)[2]) {
        const int g = j / 32;
        const Factors f = factors(b, g);
        const uint4 raw = load16(b + 16 + 32 * (g / 2) + (j % 32));
        out[0] = halves(f, raw.x, raw.y, 4 * (g % 2));
        out[1] = halves(f, raw.z, raw.w, 4 * (g % 2));
    }
};

// MXFP4 {e: E8M0, qs: [u8; 16]}: value k is qs[k]'s low nibble, k + 16 its high one; a
// nibble's low three bits index E2M1's doubled magnitudes {0, 1, 2, 3, 4, 6, 8, 12} (one
// byte permutation picks four), its top bit is the sign, and the block's scale is
// 2^(e - 128). While the scale and 12 times it are normal halves (e in 114 ..= 140, the
// range of released models) each value is exact in f16 and equals decode8's rounded
// one, bit for bit (a zero keeps decode8's positive sign); other blocks take decode8.
template <>
struct HalfDecode<MXFP4> {
    static constexpr bool kHas = true;
    // Four values from four nibbles (one per byte of n) as two half pairs times d.
    static __device__ __forceinline__ void four(uint32_t n, __half2 d, uint32_t& lo,
                                                uint32_t& hi) {
        const uint32_t idx = n & 0x07070707u;
        const uint32_t s = idx | (idx >> 4);
        const uint32_t sel = (s & 0xFFu) | ((s >> 8) & 0xFF00u);
        const uint32_t mags = __byte_perm(0x03020100u, 0x0C080604u, sel);
        // The sign where the magnitude is not zero.
        const uint32_t nonzero = ((idx + 0x7F7F7F7Fu) & 0x80808080u) >> 4;
        const uint32_t sg = n & nonzero;
        __half2 a, b;
        bytes_to_halves(mags, a, b);
        const __half2 base = __float2half2_rn(1024.0f);
        lo = half2_bits(__hmul2(__hsub2(a, base), d)) ^ (((sg & 0x08u) << 12) | ((sg & 0x0800u) << 20));
        hi = half2_bits(__hmul2(__hsub2(b, base), d)) ^
             (((sg & 0x080000u) >> 4) | ((sg & 0x08000000u) << 4));
    }
    static __device__ __forceinline__ bool in_range(const uint8_t* b) {
        return b[0] >= 114 && b[0] <= 140;
    }
    static __device__ __forceinline__ __half2 scale(const uint8_t* b) {
        return __half2half2(__ushort_as_half((unsigned short)(((uint32_t)b[0] - 113u) << 10)));
    }
    static __device__ __forceinline__ uint4 eight(uint2 raw, int shift, __half2 d) {
        uint4 out;
        four((raw.x >> shift) & 0x0F0F0F0Fu, d, out.x, out.y);
        four((raw.y >> shift) & 0x0F0F0F0Fu, d, out.z, out.w);
        return out;
    }
    static __device__ __forceinline__ uint4 decode8h(const uint8_t* b, int j) {
        if (!in_range(b)) {
            float v[kGroup];
            MXFP4::decode8(b, j, v);
            return pack8(v);
        }
        return eight(load8(b + 1 + (j & 15)), (j & 16) ? 4 : 0, scale(b));
    }
    static __device__ __forceinline__ void decode16h(const uint8_t* b, int j, uint4 (&out)[2]) {
        if (!in_range(b)) {
            out[0] = decode8h(b, j);
            out[1] = decode8h(b, j + 8);
            return;
        }
        const __half2 d = scale(b);
        const uint4 raw = load16(b + 1);
        const int shift = (j & 16) ? 4 : 0;
        out[0] = eight(make_uint2(raw.x, raw.y), shift, d);
        out[1] = eight(make_uint2(raw.z, raw.w), shift, d);
    }
};

// How a type's blocks are staged in shared memory ahead of their decoding: chunks of
// kChunk columns (one super-block, or four blocks of 32 values), kBytes a row, copied as
// 16-byte pieces from the 16-byte boundary at or before the chunk's first byte, into a
// row pitch of kPitch bytes. Plain element types are decoded from device memory.
//
// The pitch of a super-block's chunk is an odd number of 16-byte pieces: a warp's
// decoders read the same bytes (the scales) of 16 consecutive rows at once, and an odd
// count of pieces puts eight consecutive rows in eight distinct groups of four banks
// (two rows a bank for the 16), where an even one put them in four or fewer (Q4_K's 160
// bytes: four rows a bank). On the H200, a 7B's Q4_K products at 512 tokens took 3-5%
// less time for it. The chunks of four 32-value blocks keep the shortest pitch: the
// same rule slowed a 135M model's prompt (Q4_1 and Q8_0, 576 columns) by 5%.
template <typename F>
struct Staging {
    static constexpr bool kBlocks = F::kValues >= 32;
    static constexpr int kChunk = F::kValues > 128 ? F::kValues : 128;
    static constexpr int kBytes = kChunk / F::kValues * F::kBytes;
    // The 16-byte pieces a row's chunk spans at most, from the boundary before it.
    static constexpr int kPieces = (kBytes + 15 + 15) / 16;
    static constexpr int kPitch =
        (F::kValues > 128 && kPieces % 2 == 0 ? kPieces + 1 : kPieces) * 16;
    static_assert(!kBlocks || kChunk % kMmK == 0, "whole steps a chunk");
};

// Shared memory of a workgroup: the f16 weight and activation tiles of both stages,
// then, when blocks are staged, two chunks of raw blocks.
template <int BM>
__host__ __device__ constexpr int tile_bytes() {
    return kMmStages * (BM + kMmTokens) * kMmPitch * 2;
}
template <typename F, int BM>
__host__ __device__ constexpr int shared_bytes(bool staged) {
    return tile_bytes<BM>() + (staged && Staging<F>::kBlocks ? 2 * BM * Staging<F>::kPitch : 0);
}

#if defined(RF_MM_MMA)
// The first `bytes` (0 to 16) of 16 bytes from global to shared memory, asynchronously;
// the rest of the 16 are zeros. Both addresses are 16-byte aligned.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(rf_smem_addr(dst)),
                 "l"(src), "r"(bytes)
                 : "memory");
}
// Four bytes, as copy16_async (through L1: `cg` takes only 16-byte copies).
__device__ __forceinline__ void copy4_async(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(rf_smem_addr(dst)),
                 "l"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void copies_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void copies_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

#endif

}  // namespace rf

#endif  // ROCMFORGE_DEQUANT_MATMUL_DECODE_H
