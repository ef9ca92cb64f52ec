// tiles_q8k.h: Q4_K's prompt products on the int8 matrix units, from activations quantized
// once per token to 8 bits in blocks of 256 (rf_quantize_q8k: the CPU's Q8_K layout, the
// input its own Q4_K dot products take); also a batch of decoding sequences. Included by
// matmul.hip after matmul_launch.h; NVIDIA sm_80 and later.
//
// Why. The f16 tiles (matmul.hip) spend most of their issue slots turning each weight into
// f16 with its sub-block's scale and minimum, once per 32 columns of 128 tokens. Here a
// weight is its 4-bit value: a lane's four bytes of a super-block give two m16n8k32
// operands with one mask and one shift, and the scales enter later, as the CPU applies
// them. Over one super-block of a row and a token (eight sub-blocks s of 32 values, x's
// block scale dx and per-sub-block sums Σx_s of its 8-bit values x):
//     Σ w·x = dx · (d · Σ_s sc_s · (q_s · x_s) − dmin · Σ_s m_s · Σx_s)
// q_s · x_s is one int8 instruction; its 32-bit sums are weighted by the 6-bit sc_s with
// integer multiply-adds and stay exact across the super-block; Σ_s m_s · Σx_s is one f16
// m16n8k8 instruction per super-block (m_s < 64 exact, Σx_s rounded to f16 above 2048);
// the floats meet once per super-block.
//
// Layout. A workgroup of kQkThreads threads (8 warps) takes kQkRows rows (128) of one of up
// to three matrices and kQkTokens tokens (64); warp w the rows 32·(w % 4) .. + 31 and the
// tokens 32·(w / 4) .. + 31 (two by four instructions' tiles). Chunks of one super-block of
// columns arrive by asynchronous copies in kStages shared-memory stages (three where the
// device lends the bytes, else two), with one barrier a chunk: the tile's raw Q4_K blocks
// (144 bytes a row: 36 words, so the eight rows of a quarter-warp's loads fall in distinct
// banks) and the tokens' 256 int8 values, eight f16 sums and f32 scale (kQkXPitch bytes
// apart: an odd count of 16-byte pieces, so ldmatrix's eight rows miss each other).
//
// Column splits. A product of few tokens (a batch of decoding sequences) has too few
// tiles to fill the device; then, where the caller gives room, the grid's z splits the
// columns: each split takes its own run of super-blocks, leaves its sums in the room,
// and the last workgroup of a tile to finish adds them in split order (results repeat
// bit for bit), as the skinny kernel does.
#ifndef ROCMFORGE_DEQUANT_TILES_Q8K_H
#define ROCMFORGE_DEQUANT_TILES_Q8K_H

namespace rf {

constexpr int kQkThreads = 256;
constexpr int kQkRows = 128;
constexpr int kQkTokens = 64;
constexpr int kQkBlock = 256;
constexpr int kQkBlockBytes = 144;  // a Q4_K super-block
constexpr int kQkWPitch = kQkBlockBytes;
constexpr int kQkSumsAt = kQkBlock;       // 8 f16 sums of the sub-blocks' int8 values
constexpr int kQkScaleAt = kQkBlock + 16;  // the block's f32 scale
constexpr int kQkXPitch = 304;
constexpr int kQkWBytes = kQkRows * kQkWPitch;
constexpr int kQkXBytes = kQkTokens * kQkXPitch;
constexpr int kQkStageBytes = kQkWBytes + kQkXBytes;

// The Q8_K input of n tokens of `cols` values (a multiple of 256): the int8 values token
// by token; from q8k_scales_at, one f32 scale a block, token by token; from q8k_sums_at
// (16-byte aligned), one f16 sum a sub-block of 32 values, token by token.
__host__ __device__ inline size_t q8k_scales_at(size_t n, size_t cols) { return n * cols; }
__host__ __device__ inline size_t q8k_sums_at(size_t n, size_t cols) {
    return n * cols + (n * (cols / kQkBlock) * 4 + 15) / 16 * 16;
}
__host__ __device__ inline size_t q8k_bytes(size_t n, size_t cols) {
    return q8k_sums_at(n, cols) + n * (cols / 32) * 2;
}

#if defined(RF_MM_MMA)
// c += a · b for a 16 × 8 f16 tile a (row-major: lane l row l / 4 in a0, l / 4 + 8 in
// a1, columns 2·(l % 4), + 1) and an 8 × 8 tile b (column l / 4, rows 2·(l % 4), + 1).
__device__ __forceinline__ void mma_1688(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

// Two bytes of a word (the pair at byte 2·`pair`) as two f16 values.
__device__ __forceinline__ uint32_t byte_pair_f16(uint32_t word, int pair) {
    const uint32_t v = word >> (16 * pair);
    return half2_bits(__halves2half2(__uint2half_rn(v & 0xff), __uint2half_rn((v >> 8) & 0xff)));
}
#endif

// y (+)= x · W for the Q4_K matrices `mats` from the Q8_K input `xq` of n_tokens tokens
// (q8k_bytes): grid x = tiles of kQkTokens tokens, y = tiles of kQkRows rows (numbered one
// matrix after the other), z = column splits (`splits`; past one, `partials` holds
// kQkSlot floats per split and workgroup and `counters` one zero per workgroup of a
// split, zero again when the launch ends); kQkThreads threads; kStages · kQkStageBytes
// bytes of dynamic shared memory. Weights must start 16-byte aligned and `cols` be a
// multiple of 256.
constexpr int kQkSlot = kQkThreads * 32;
template <int kStages>
__global__ void __launch_bounds__(kQkThreads, 2)
    tiles_q8k_kernel(MatmulMats mats, int cols, const uint8_t* __restrict__ xq, int n_tokens,
                     int accumulate, int splits, float* partials, unsigned* counters) {
#if defined(RF_MM_MMA)
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, q = lane % 4;
    const int wr = 32 * (warp % 4), wt = 32 * (warp / 4);

    int tile = (int)blockIdx.y;
    const int m = matrix_of_tile(mats, kQkRows, tile);
    const uint8_t* __restrict__ w = m == 0 ? mats.w[0] : (m == 1 ? mats.w[1] : mats.w[2]);
    float* __restrict__ y = m == 0 ? mats.y[0] : (m == 1 ? mats.y[1] : mats.y[2]);
    const int rows = m == 0 ? mats.rows[0] : (m == 1 ? mats.rows[1] : mats.rows[2]);
    const int row0 = tile * kQkRows, tok0 = (int)blockIdx.x * kQkTokens;
    const int chunks = cols / kQkBlock;
    const size_t row_bytes = (size_t)chunks * kQkBlockBytes;
    // This split's run of super-blocks.
    const int split = (int)blockIdx.z;
    const int c0 = split * chunks / splits, c1 = (split + 1) * chunks / splits;
    const float* __restrict__ xd =
        reinterpret_cast<const float*>(xq + q8k_scales_at(n_tokens, cols));
    const __half* __restrict__ xs =
        reinterpret_cast<const __half*>(xq + q8k_sums_at(n_tokens, cols));

    auto w_stage = [&](int st) { return smem + st * kQkStageBytes; };
    auto x_stage = [&](int st) { return smem + st * kQkStageBytes + kQkWBytes; };
    // Each thread's share of a chunk's copies, in 16-byte pieces that consecutive threads
    // take consecutively (so that each copy instruction reads whole runs of a row): the
    // tile's raw super-blocks (rows past the end copy the last row again, their sums
    // never written), piece p of the tile at byte 16p of the stage (the pitch is whole
    // pieces); the tokens' values, sixteen threads a token; then the sums and the scale
    // of a token a thread (zeros past the last token).
    const uint8_t* wtile = w + (size_t)row0 * row_bytes;
    const int last_row = rows - 1 - row0;
    const int at = threadIdx.x / 16, aj = threadIdx.x % 16;
    const uint8_t* xsrc = xq + (size_t)(tok0 + at) * cols + 16 * aj;
    const int st_tok = threadIdx.x % kQkTokens;
    const bool st_valid = tok0 + st_tok < n_tokens;
    const size_t st_at = st_valid ? (size_t)(tok0 + st_tok) * chunks : 0;
    auto copy_weights = [&](int c, int st) {
        constexpr int kPieces = kQkRows * kQkBlockBytes / 16;
        const uint8_t* src = wtile + (size_t)c * kQkBlockBytes;
#pragma unroll
        for (int k = 0; k < (kPieces + kQkThreads - 1) / kQkThreads; ++k) {
            const int p = (int)threadIdx.x + kQkThreads * k;
            if (p < kPieces) {
                const int r = p / (kQkBlockBytes / 16);
                const int j = p - r * (kQkBlockBytes / 16);
                copy16_async(w_stage(st) + 16 * p,
                             src + (size_t)min(r, last_row) * row_bytes + 16 * j, 16);
            }
        }
    };
    auto copy_acts = [&](int c, int st) {
        uint8_t* dst = x_stage(st) + at * kQkXPitch + 16 * aj;
        const uint8_t* src = xsrc + (size_t)c * kQkBlock;
        constexpr int kRounds = kQkTokens * 16 / kQkThreads;
#pragma unroll
        for (int k = 0; k < kRounds; ++k) {
            const int t = at + k * (kQkThreads / 16);
            const bool valid = tok0 + t < n_tokens;
            copy16_async(dst + k * (kQkThreads / 16) * kQkXPitch,
                         valid ? src + (size_t)k * (kQkThreads / 16) * cols : xq, valid ? 16 : 0);
        }
        uint8_t* tok_dst = x_stage(st) + st_tok * kQkXPitch;
        if (threadIdx.x < kQkTokens) {
            copy16_async(tok_dst + kQkSumsAt,
                         reinterpret_cast<const uint8_t*>(xs + (st_at + c) * 8),
                         st_valid ? 16 : 0);
        } else if (threadIdx.x < 2 * kQkTokens) {
            copy4_async(tok_dst + kQkScaleAt, xd + st_at + c, st_valid ? 4 : 0);
        }
    };

    // Lane (g, q) holds rows wr + 16·i + g (+ 8) and tokens wt + 8·j + 2q (+ 1).
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
        }
    }
    const bool busy = row0 + wr < rows && tok0 + wt < n_tokens;

    // Weights first: no kernel writes them; the input after the chained launch's wait.
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
        if (c0 + i < c1) copy_weights(c0 + i, i);
    }
    rf_chain_wait();
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
        if (c0 + i < c1) copy_acts(c0 + i, i);
        copies_commit();
    }
    for (int c = c0; c < c1; ++c) {
        const int st = (c - c0) % kStages;
        copies_wait<kStages - 2>();
        __syncthreads();
        const int next = c + kStages - 1;
        if (next < c1) {
            copy_weights(next, (next - c0) % kStages);
            copy_acts(next, (next - c0) % kStages);
        }
        copies_commit();
        if (!busy) continue;
        const uint8_t* ws = w_stage(st);
        const uint8_t* xst = x_stage(st);
        // The rows' 6-bit sub-block scales, four a word (their minimums and the
        // super-block's scales are read again at the end, to keep registers).
        uint32_t sc[2][2][2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint4 head = *reinterpret_cast<const uint4*>(
                    ws + (wr + 16 * i + 8 * h + g) * kQkWPitch);
                sc[i][h][0] = head.y & 0x3f3f3f3fu;
                sc[i][h][1] = (head.w & 0x0f0f0f0fu) | ((head.y >> 2) & 0x30303030u);
            }
        }
        int isum[2][4][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) isum[i][j][e] = 0;
            }
        }
        // Pairs of sub-blocks: 32 bytes of a row, low nibbles the first, high the second.
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            uint32_t a[2][2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const uint8_t* r = ws + (wr + 16 * i + g) * kQkWPitch + 16 + 32 * p + 4 * q;
                const uint32_t w00 = *reinterpret_cast<const uint32_t*>(r);
                const uint32_t w10 = *reinterpret_cast<const uint32_t*>(r + 8 * kQkWPitch);
                const uint32_t w01 = *reinterpret_cast<const uint32_t*>(r + 16);
                const uint32_t w11 = *reinterpret_cast<const uint32_t*>(r + 8 * kQkWPitch + 16);
                a[i][0][0] = w00 & 0x0f0f0f0fu;
                a[i][0][1] = w10 & 0x0f0f0f0fu;
                a[i][0][2] = w01 & 0x0f0f0f0fu;
                a[i][0][3] = w11 & 0x0f0f0f0fu;
                a[i][1][0] = (w00 >> 4) & 0x0f0f0f0fu;
                a[i][1][1] = (w10 >> 4) & 0x0f0f0f0fu;
                a[i][1][2] = (w01 >> 4) & 0x0f0f0f0fu;
                a[i][1][3] = (w11 >> 4) & 0x0f0f0f0fu;
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                uint32_t b[4];
                rf_ldmatrix_x4(b, reinterpret_cast<const __half*>(
                                      xst + (wt + 8 * j + (lane & 7)) * kQkXPitch + 64 * p +
                                      16 * (lane >> 3)));
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    const int sub = 2 * p + s;
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        int sums[4] = {0, 0, 0, 0};
                        rf_mma_16832_s8(sums, a[i][s], b[2 * s], b[2 * s + 1]);
                        const int s0 = (int)((sc[i][0][sub / 4] >> (8 * (sub % 4))) & 0xff);
                        const int s1 = (int)((sc[i][1][sub / 4] >> (8 * (sub % 4))) & 0xff);
                        isum[i][j][0] += s0 * sums[0];
                        isum[i][j][1] += s0 * sums[1];
                        isum[i][j][2] += s1 * sums[2];
                        isum[i][j][3] += s1 * sums[3];
                    }
                }
            }
        }
        // The minimums against the sub-blocks' sums (an 8-deep product), then the floats.
        uint32_t am[2][2];
        float d[2][2], dmin[2][2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint4 head = *reinterpret_cast<const uint4*>(
                    ws + (wr + 16 * i + 8 * h + g) * kQkWPitch);
                const __half2 dd = *reinterpret_cast<const __half2*>(&head.x);
                d[i][h] = __low2float(dd);
                dmin[i][h] = __high2float(dd);
                const uint32_t mins =
                    q < 2 ? head.z & 0x3f3f3f3fu
                          : ((head.w >> 4) & 0x0f0f0f0fu) | ((head.z >> 2) & 0x30303030u);
                am[i][h] = byte_pair_f16(mins, q % 2);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint8_t* tg = xst + (wt + 8 * j + g) * kQkXPitch;
            const uint32_t bs = *reinterpret_cast<const uint32_t*>(tg + kQkSumsAt + 4 * q);
            const uint8_t* t0 = xst + (wt + 8 * j + 2 * q) * kQkXPitch;
            const float dx0 = *reinterpret_cast<const float*>(t0 + kQkScaleAt);
            const float dx1 = *reinterpret_cast<const float*>(t0 + kQkXPitch + kQkScaleAt);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float mins[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_1688(mins, am[i][0], am[i][1], bs);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int h = e / 2;
                    const float v = fmaf(d[i][h], (float)isum[i][j][e], -dmin[i][h] * mins[e]);
                    acc[i][j][e] = fmaf(e % 2 ? dx1 : dx0, v, acc[i][j][e]);
                }
            }
        }
    }
    copies_wait<0>();
    if (splits > 1) {
        // Each busy warp's sums into this split's room, a thread's four sums of an (i, j)
        // fragment as one 16-byte store (consecutive threads, consecutive pieces); then
        // the last workgroup of the tile to finish adds every split's, in split order.
        // Other workgroups of this launch wrote them: read through L2 (ld.cg), past this
        // multiprocessor's cache, all of a split's eight pieces in flight at once.
        const int n_tiles = (int)(gridDim.x * gridDim.y);
        const int tile_id = (int)(blockIdx.y * gridDim.x + blockIdx.x);
        float4* mine =
            reinterpret_cast<float4*>(partials + ((size_t)split * n_tiles + tile_id) * kQkSlot) +
            threadIdx.x;
        if (busy) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    mine[(i * 4 + j) * kQkThreads] =
                        make_float4(acc[i][j][0], acc[i][j][1], acc[i][j][2], acc[i][j][3]);
                }
            }
        }
        __shared__ int last;
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned before = atomicAdd(&counters[tile_id], 1u);
            last = before == (unsigned)(splits - 1);
            if (last) counters[tile_id] = 0u;
        }
        __syncthreads();
        if (!last || !busy) return;
        __threadfence();
        const float4* all =
            reinterpret_cast<const float4*>(partials + (size_t)tile_id * kQkSlot) + threadIdx.x;
        const size_t split_stride = (size_t)n_tiles * (kQkSlot / 4);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
            }
        }
        for (int z = 0; z < splits; ++z) {
            float4 piece[8];
#pragma unroll
            for (int q = 0; q < 8; ++q) piece[q] = __ldcg(all + z * split_stride + q * kQkThreads);
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                float* a = acc[q / 4][q % 4];
                a[0] += piece[q].x;
                a[1] += piece[q].y;
                a[2] += piece[q].z;
                a[3] += piece[q].w;
            }
        }
    }
    if (!busy) return;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row0 + wr + 16 * i + g + 8 * (e / 2);
                const int tok = tok0 + wt + 8 * j + 2 * q + (e % 2);
                if (row < rows && tok < n_tokens) {
                    float* dst = y + (size_t)tok * rows + row;
                    *dst = accumulate ? *dst + acc[i][j][e] : acc[i][j][e];
                }
            }
        }
    }
#else
    (void)mats;
    (void)cols;
    (void)xq;
    (void)n_tokens;
    (void)accumulate;
    (void)splits;
    (void)partials;
    (void)counters;
#endif
}

template <int kStages>
hipError_t launch_tiles_q8k_stages(const MatmulMats& mats, int cols, const uint8_t* xq,
                                   int n_tokens, int accumulate, int multiprocessors,
                                   const SplitRoom& room, hipStream_t stream) {
    static std::atomic<unsigned long long> raised{0};
    const int bytes = kStages * kQkStageBytes;
    const hipError_t status = rf_raise_shared_memory(tiles_q8k_kernel<kStages>, bytes, raised);
    if (status != hipSuccess) return status;
    long long tiles = 0;
    for (int m = 0; m < mats.n; ++m) tiles += (mats.rows[m] + kQkRows - 1) / kQkRows;
    const long long token_tiles = (n_tokens + kQkTokens - 1) / kQkTokens;
    // Splits by waves, as the skinny kernel's (launch_skinny_nt): a split of s takes
    // ceil(chunks / s) super-blocks and about one more (filling its stages, handing its
    // sums over), so the product takes about ceil(wgs · s / resident) · (ceil(chunks / s)
    // + 1) chunk times; the fewest (the fewest splits on a tie), each split at least two
    // super-blocks, within the room given.
    const long long chunks = cols / kQkBlock;
    const long long wgs = tiles * token_tiles;
    long long splits = 1;
    if (room.partials && room.counters && wgs <= room.n_counters &&
        (uintptr_t)room.partials % 16 == 0) {
        const long long per_sm = rf_resident_workgroups<tiles_q8k_kernel<kStages>>(kQkThreads, bytes);
        const long long resident = (long long)multiprocessors * per_sm;
        const long long fit = room.partial_floats / (wgs * kQkSlot);
        const long long most = max(1LL, min(min(chunks / 2, fit), 16LL));
        long long best = -1;
        for (long long s = 1; s <= most; ++s) {
            const long long waves = (wgs * s + resident - 1) / resident;
            const long long cost = waves * ((chunks + s - 1) / s + 1);
            if (best < 0 || cost < best) {
                best = cost;
                splits = s;
            }
        }
    }
    const dim3 grid((unsigned)token_tiles, (unsigned)tiles, (unsigned)splits);
    rfLaunchChained((tiles_q8k_kernel<kStages>), grid, dim3(kQkThreads), (size_t)bytes, stream,
                    mats, cols, xq, n_tokens, accumulate, (int)splits, room.partials,
                    room.counters);
    return hipGetLastError();
}

// The products of Q4_K matrices from Q8_K input (rf_quantize_q8k) where the device has the
// matrix units' path (`mma`), the width is whole super-blocks and weights and input start
// 16-byte aligned: else hipErrorInvalidValue. Three stages where the device lends their
// shared memory to a workgroup, else two. The columns split where `room` gives the room
// and the tiles alone leave the device idle. (A template, so that only Q4_K's unit
// compiles its kernels.)
template <typename F>
hipError_t launch_tiles_q8k(const MatmulMats& mats, int cols, const uint8_t* xq, int n_tokens,
                            int accumulate, const DeviceFacts& facts, const SplitRoom& room,
                            hipStream_t stream) {
    const bool mma = facts.staged;
    static_assert(std::is_same<F, Q4_K>::value, "the Q8_K tiles are Q4_K's");
    if (!mma || cols % kQkBlock != 0 || (uintptr_t)xq % 16 != 0) return hipErrorInvalidValue;
    for (int m = 0; m < mats.n; ++m) {
        if ((uintptr_t)mats.w[m] % 16 != 0) return hipErrorInvalidValue;
    }
    static std::atomic<int> two_stages{0};  // set where three were refused
    if (two_stages.load(std::memory_order_relaxed) == 0) {
        const hipError_t status =
            launch_tiles_q8k_stages<3>(mats, cols, xq, n_tokens, accumulate,
                                       facts.multiprocessors, room, stream);
        if (status != hipErrorInvalidValue) return status;
        (void)hipGetLastError();
        two_stages.store(1, std::memory_order_relaxed);
    }
    return launch_tiles_q8k_stages<2>(mats, cols, xq, n_tokens, accumulate,
                                      facts.multiprocessors, room, stream);
}

}  // namespace rf

#endif  // ROCMFORGE_DEQUANT_TILES_Q8K_H
