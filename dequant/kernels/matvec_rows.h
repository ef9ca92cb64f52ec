// matvec_rows.h: a thread's share of the decode products' rows and their reduction: the
// dot products of a thread's tasks with the Q8 activations (row_dots) and the sums over a
// row's threads (reduce_row). Included by matvec.hip, after matvec_tasks.h.
#ifndef ROCMFORGE_DEQUANT_MATVEC_ROWS_H
#define ROCMFORGE_DEQUANT_MATVEC_ROWS_H

namespace rf {

// ------------------------------------------------------------------ reductions --------

// Sums v over the 32-lane group of the calling thread (lanes 0-31 or 32-63 of a wave64).
__device__ __forceinline__ float sum32(float v) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) v += rf_shfl_xor(v, mask);
    return v;
}

// Whether reduce_row uses shared memory for rows of tpr threads: a workgroup that
// reduces again must then pass a barrier first.
__host__ __device__ constexpr bool reduce_needs_barrier(int tpr) { return tpr > 32; }

// Sums acc[0..NT) over the threads of one row (tpr threads, 16 or a multiple of 32,
// starting at a multiple of tpr) and writes row results through `write(token, value)`
// from the row's first thread.
template <int NT, typename Write>
__device__ __forceinline__ void reduce_row(float (&acc)[NT], int tpr, Write write) {
    if (tpr <= 32) {
        // A row of at most 32 threads (16: a narrow matrix's, with_group_rows): within its
        // lanes, by sum32's additions when it takes a whole group of 32. No shared memory,
        // so the callers need no barrier after it (reduce_needs_barrier).
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            for (int mask = tpr / 2; mask > 0; mask >>= 1) acc[j] += rf_shfl_xor(acc[j], mask);
        }
        if (threadIdx.x % tpr == 0) {
#pragma unroll
            for (int j = 0; j < NT; ++j) write(j, acc[j]);
        }
        return;
    }
    __shared__ float partial[kMatvecThreads / 32][NT];
    const int lane_group = threadIdx.x / 32;
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j] = sum32(acc[j]);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int j = 0; j < NT; ++j) partial[lane_group][j] = acc[j];
    }
    __syncthreads();
    const int groups_per_row = tpr / 32;
    if (threadIdx.x % tpr == 0) {
        const int first = lane_group;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            float s = 0.0f;
            for (int g = 0; g < groups_per_row; ++g) s += partial[first + g][j];
            write(j, s);
        }
    }
}

// Traits of a weight task, false unless W says otherwise: kScale32, one factor pair a
// piece of 32 weights (a[2x] == a[2x + 1], b likewise); kHighInPlace, piece 1's words
// are unsigned bytes met by dot4_unsigned.
template <typename W, typename = void>
struct Scale32 : std::false_type {};
template <typename W>
struct Scale32<W, std::void_t<decltype(W::kScale32)>> : std::integral_constant<bool, W::kScale32> {};
template <typename W, typename = void>
struct HighInPlace : std::false_type {};
template <typename W>
struct HighInPlace<W, std::void_t<decltype(W::kHighInPlace)>>
    : std::integral_constant<bool, W::kHighInPlace> {};

// A thread's share of the dot products of RPT rows with NT tokens' activations: the
// tasks lane, lane + tpr, ... of each row (`rows`: the rows' first bytes; `work` false
// takes none). Token j's activations are row xrow(j) of the Q8 input, whose int8 values
// (`xqs`), scales (`xd`) and half sums (`xsums`) are each laid out row by row.
// kPreload: the first task's weights, which no kernel writes, are decoded before the
// chained wait, while the kernel before this one finishes; activations after it.
template <typename W, int NT, int RPT, bool kPreload, typename XRow>
__device__ __forceinline__ void row_dots(const uint8_t* const (&rows)[RPT], bool work, int lane,
                                         int tpr, int n_cols, const int8_t* __restrict__ xqs,
                                         const float* __restrict__ xd,
                                         const int* __restrict__ xsums, XRow xrow,
                                         float (&acc)[RPT][NT]) {
    const int blocks = n_cols / W::kValues;
    const int tasks = blocks * W::kTasks;
    constexpr int kXPerBlock = W::kValues / 32;
    const int xblocks = n_cols / 32;
#pragma unroll
    for (int rr = 0; rr < RPT; ++rr) {
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[rr][j] = 0.0f;
    }
    // A task's weights, decoded into w, a, b, xb.
    int w[RPT][8 * W::kX], xb[W::kX];
    float a[RPT][2 * W::kX], b[RPT][2 * W::kX];
    auto decode = [&](int task) {
        const int blk = task / W::kTasks;
#pragma unroll
        for (int rr = 0; rr < RPT; ++rr) {
            W::task(rows[rr] + (size_t)blk * W::kBytes, task % W::kTasks, w[rr], a[rr], b[rr],
                    xb);
        }
    };
    // The decoded task meets every token's activations.
    auto consume = [&](int task) {
        const int blk = task / W::kTasks;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const size_t xr = (size_t)xrow(j);
#pragma unroll
            for (int x = 0; x < W::kX; ++x) {
                const int xi = blk * kXPerBlock + xb[x];
                int v[8];
                load_words16<8>(reinterpret_cast<const uint8_t*>(xqs + xr * n_cols + 32 * xi),
                                v);
                const float dx = xd[xr * xblocks + xi];
                const int packed = xsums[xr * xblocks + xi];
                const int sum[2] = {(int)(int16_t)(packed & 0xFFFF), packed >> 16};
                if constexpr (Scale32<W>::value) {
                    // One factor pair for the piece's 32 weights: one dot product.
                    const float whole = (float)(sum[0] + sum[1]);
                    const bool raw = HighInPlace<W>::value && x == 1;
#pragma unroll
                    for (int rr = 0; rr < RPT; ++rr) {
                        int dot = 0;
#pragma unroll
                        for (int i = 0; i < 8; ++i) {
                            dot = raw ? dot4_unsigned(w[rr][8 * x + i], v[i], dot)
                                      : dot4(w[rr][8 * x + i], v[i], dot);
                        }
                        acc[rr][j] += dx * (a[rr][2 * x] * (float)dot + b[rr][2 * x] * whole);
                    }
                    continue;
                }
#pragma unroll
                for (int rr = 0; rr < RPT; ++rr) {
                    float part = 0.0f;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        int dot = 0;
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            dot = dot4(w[rr][8 * x + 4 * h + i], v[4 * h + i], dot);
                        }
                        part += a[rr][2 * x + h] * (float)dot + b[rr][2 * x + h] * (float)sum[h];
                    }
                    acc[rr][j] += dx * part;
                }
            }
        }
    };
    work = work && lane < tasks;
    if (work) decode(lane);
    if (kPreload) rf_chain_wait();
    if (work) {
        consume(lane);
        for (int task = lane + tpr; task < tasks; task += tpr) {
            decode(task);
            consume(task);
        }
    }
}

}  // namespace rf

#endif  // ROCMFORGE_DEQUANT_MATVEC_ROWS_H
