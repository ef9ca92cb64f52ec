// matvec.hip: products of quantized weight matrices with a few tokens' activations, on
// the weights' own blocks (the decode path of a forward pass on the GPU).
//
// Activations. Before a product the activations are quantized once to Q8 activation
// blocks of 32 values (x ≈ d·q), by rf_quantize_q8 or by a kernel that fuses it (a norm,
// an activation function). Layout for n tokens of n_cols values: the n·n_cols int8
// values first, token by token (so each block's 32 bytes are 16-byte aligned), then one
// f32 scale d per block, then per block the sums of its two halves' q (16 values each,
// |sum| ≤ 2032) packed in one int: the first half's in the low 16 bits.
//
// Weights. Every thread takes tasks of 32 or 64 weights of a row (see matvec_tasks.h),
// read with the widest loads the block's alignment allows. Each weight type describes a
// task's weights as small integers w (four packed in a 32-bit word) and, per 16 weights,
// two f32 factors a, b such that the weights are a·w + b: Q4_0 is d·n - 8d, Q4_K d·sc·n -
// dmin·m, Q6_K d·sc·q - 32·d·sc, and so on. Each 16 weights then meet the activations of
// the same columns, d_x·q_x, in integer dot products of four lanes (dp4a on NVIDIA,
// sdot4 on AMD):
//     Σ (a·w + b)·d_x·q_x = d_x · (a · Σ w·q_x + b · Σ q_x).
// The sums of q_x come with the activations, computed once where they are quantized, so
// offsets and minimums cost no dot products of their own (with several tokens a thread
// would otherwise take those sums for every task of every row) and stay exact in
// integers. Float weights (F32, F16, BF16) meet f32
// activations in f32.
//
// The grid formats take w from lattice grids, one entry per run of 8 values (two of 4
// for IQ3): the decoders' tables, which the build script writes into this file's
// translation unit, in global memory. MXFP4 takes it from a 16-entry table.
//   IQ3_XXS  grid magnitudes, each run's signs applied   a = d·(0.5 + ls)·0.5   b = 0
//   IQ3_S    grid magnitudes, each run's signs applied   a = d·(1 + 2·ls)       b = 0
//   IQ2_XXS  grid magnitudes, each run's signs applied   a = d·(0.5 + ls)·0.25  b = 0
//   IQ2_XS   as IQ2_XXS, with a scale ls per 16 values
//   IQ2_S    as IQ2_XS
//   IQ1_S    the grid's values -1, 0, 1                  a = dl = d·(2·ls + 1)  b = dl·δ
//   IQ1_M    8g ± 1 (the shift δ = ±1/8 of each run)     a = dl/8               b = 0
//   MXFP4    the E2M1 values, doubled                    a = 2^(e - 128)        b = 0
//
// Shape. A workgroup of kMatvecThreads threads computes kRows rows (1, 2 or 4; more rows
// per workgroup for narrow matrices; 8 for the routed experts of one slot a tile), each
// row by kMatvecThreads/kRows threads (a multiple of 32, or 16), for NT tokens at once (1
// to 8): a weight task is decoded once and meets every token's activations. Partial sums
// are reduced in 32-lane groups with shuffles (which works for 32- and 64-lane wavefronts
// alike), then across the groups in shared memory; a row of 16 threads by shuffles alone.
// Up to three matrices of one type and width (a layer's q, k and v, or gate and up) run in
// one launch: rows are numbered across them.
//
// Units. The build compiles this file once per weight type, with RF_MATVEC_TYPE (its
// ggml code) and RF_MATVEC_NAME (its name in the launchers' names) defined, and once
// with RF_MATVEC_COMMON for the activations' quantizer. Each unit is a module of its
// own, and the runtimes load a module's code whole at the first use of any of its
// kernels: a model waits only for its own types' products (see build.rs).
//
// Experts. The routed experts' products of a mixture of experts, built on the same tasks,
// dot products and reductions, are in matvec_experts.hip, which each type's unit
// includes at its end (so they share the type's module).
//
// Launchers, all returning the platform's native status (0 on success):
//   rf_quantize_q8(x, n_tokens, n_cols, out, device, stream)       (common unit)
//   rf_matvec_NAME(mats, n_mats, n_cols, xq_or_x, n_tokens, accumulate, device, stream)
//   rf_matvec_load_NAME(n_cols, n_tokens, device)
//   rf_matvec_experts_NAME, rf_matvec_experts_sum_NAME        (see matvec_experts.hip)
// The Rust wrappers in src/gpu/matvec.rs are their only callers and check every length.
#include "common.h"

#include <type_traits>

namespace rf {


constexpr int kMatvecThreads = 128;
constexpr int kMaxTokens = 8;
constexpr int kMaxMats = 3;

struct MatvecMats {
    const uint8_t* w[kMaxMats];
    float* y[kMaxMats];
    int rows[kMaxMats];
};

// ------------------------------------------------------------------ integer dots ------

__device__ __forceinline__ int dot4(int a, int b, int acc) {
#if defined(ROCMFORGE_HIP_NVIDIA)
    return __dp4a(a, b, acc);
#elif defined(__gfx906__) || defined(__gfx908__) || defined(__gfx90a__) || \
    defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) ||    \
    defined(__gfx1030__) || defined(__gfx1031__) || defined(__gfx1032__) || \
    defined(__gfx1034__) || defined(__gfx1035__) || defined(__gfx1036__)
    return __builtin_amdgcn_sdot4(a, b, acc, false);
#else
    // Targets without a 4-lane dot instruction: the same sum, lane by lane.
    const int8_t* x = reinterpret_cast<const int8_t*>(&a);
    const int8_t* y = reinterpret_cast<const int8_t*>(&b);
    return acc + x[0] * y[0] + x[1] * y[1] + x[2] * y[2] + x[3] * y[3];
#endif
}

}  // namespace rf

#include "matvec_tasks.h"
#include "matvec_rows.h"

namespace rf {

// The matrix a global row index falls in: its weights, output and row count, and the
// row within it; false past the end. The arguments are read with constant indices only,
// so they stay in the kernel's parameter space (a run-time index would copy them to a
// stack frame).
struct RowOf {
    const uint8_t* w;
    float* y;
    int rows;
    int local;
};
__device__ __forceinline__ bool locate(const MatvecMats& mats, int n_mats, int row, RowOf& out) {
#pragma unroll
    for (int m = 0; m < kMaxMats; ++m) {
        if (m < n_mats && row >= 0 && row < mats.rows[m]) {
            out = RowOf{mats.w[m], mats.y[m], mats.rows[m], row};
            return true;
        }
        row -= mats.rows[m];
    }
    out = RowOf{nullptr, nullptr, 0, 0};
    return false;
}

// ------------------------------------------------------------------ kernels -----------

// kRows row groups a workgroup, each thread taking its tasks in RPT consecutive rows:
// a task's activations, loaded once, meet RPT rows' weights (at one token the
// activations are most of what a thread reads through L1).
template <typename W, int NT, int kRows, int RPT>
__global__ void __launch_bounds__(kMatvecThreads)
    matvec_q_kernel(MatvecMats mats, int n_mats, int n_cols, const uint8_t* __restrict__ xq,
                    int accumulate) {
    constexpr int tpr = kMatvecThreads / kRows;
    const int sub = threadIdx.x / tpr, lane = threadIdx.x % tpr;
    RowOf r[RPT];
    bool live[RPT];
    bool any = false;
#pragma unroll
    for (int rr = 0; rr < RPT; ++rr) {
        live[rr] = locate(mats, n_mats, (blockIdx.x * kRows + sub) * RPT + rr, r[rr]);
        any = any || live[rr];
    }
    const int blocks = n_cols / W::kValues;
    const uint8_t* rows[RPT];
#pragma unroll
    for (int rr = 0; rr < RPT; ++rr) {
        // A row past the end reads the first live row again (its result is dropped).
        const RowOf& src = live[rr] ? r[rr] : r[0];
        rows[rr] = src.w + (size_t)src.local * blocks * W::kBytes;
    }
    // Activations: every token's int8 values, then every block's f32 scale, then every
    // block's half sums.
    const int8_t* xqs = reinterpret_cast<const int8_t*>(xq);
    const float* xd = reinterpret_cast<const float*>(xq + (size_t)NT * n_cols);
    const int* xsums = reinterpret_cast<const int*>(xd + (size_t)NT * (n_cols / 32));
    float acc[RPT][NT];
    row_dots<W, NT, RPT, true>(rows, any, lane, tpr, n_cols, xqs, xd, xsums,
                               [](int j) { return j; }, acc);
#pragma unroll
    for (int rr = 0; rr < RPT; ++rr) {
        reduce_row<NT>(acc[rr], tpr, [&](int j, float s) {
            if (!live[rr]) return;
            float* y = r[rr].y + (size_t)j * r[rr].rows + r[rr].local;
            *y = accumulate ? *y + s : s;
        });
        // The reduction's shared memory is used again for the next row.
        if constexpr (reduce_needs_barrier(tpr)) __syncthreads();
    }
}

struct FF32 {
    __device__ static float at(const uint8_t* row, int i) {
        return reinterpret_cast<const float*>(row)[i];
    }
    static constexpr int kBytes = 4;
};
struct FF16 {
    __device__ static float at(const uint8_t* row, int i) {
        return __half2float(reinterpret_cast<const __half*>(row)[i]);
    }
    static constexpr int kBytes = 2;
};
struct FBF16 {
    __device__ static float at(const uint8_t* row, int i) {
        const uint32_t bits = (uint32_t)reinterpret_cast<const uint16_t*>(row)[i] << 16;
        return __uint_as_float(bits);
    }
    static constexpr int kBytes = 2;
};

// Float weights: NT tokens a workgroup, the grid's y the groups of NT tokens (the float
// products take any count of tokens, in groups of kMaxTokens and one of the rest).
template <typename F, int NT, int kRows>
__global__ void __launch_bounds__(kMatvecThreads)
    matvec_f_kernel(MatvecMats mats, int n_mats, int n_cols, const float* __restrict__ x,
                    int accumulate) {
    constexpr int tpr = kMatvecThreads / kRows;
    const int sub = threadIdx.x / tpr, lane = threadIdx.x % tpr;
    rf_chain_wait();
    RowOf r;
    const bool live = locate(mats, n_mats, blockIdx.x * kRows + sub, r);
    const size_t first = (size_t)blockIdx.y * NT;
    x += first * n_cols;
    float acc[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j] = 0.0f;
    if (live) {
        const uint8_t* row = r.w + (size_t)r.local * n_cols * F::kBytes;
        // Unrolled so that several loads are in flight a thread (the sums keep their order).
#pragma unroll 4
        for (int i = lane; i < n_cols; i += tpr) {
            const float w = F::at(row, i);
#pragma unroll
            for (int j = 0; j < NT; ++j) acc[j] += w * x[(size_t)j * n_cols + i];
        }
    }
    reduce_row<NT>(acc, tpr, [&](int j, float s) {
        if (!live) return;
        float* y = r.y + (first + j) * r.rows + r.local;
        *y = accumulate ? *y + s : s;
    });
}

#if defined(RF_MATVEC_COMMON)
// One 32-lane group per Q8 activation block: amax by shuffles, then each lane its value.
// Layout: all int8 values first (token by token), then one f32 scale per block.
__global__ void quantize_q8_kernel(const float* __restrict__ x, size_t n_blocks,
                                   int8_t* __restrict__ qs, float* __restrict__ ds,
                                   int* __restrict__ sums) {
    rf_chain_wait();
    const size_t blk = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x & 31;
    if (blk >= n_blocks) return;  // whole 32-lane groups leave together
    const float v = x[blk * 32 + lane];
    float amax = fabsf(v);
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) amax = fmaxf(amax, rf_shfl_xor(amax, mask));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = __float2int_rn(v * id);
    qs[blk * 32 + lane] = (int8_t)q;
    const int packed = rf_q8_half_sums(q);
    if (lane == 0) {
        ds[blk] = d;
        sums[blk] = packed;
    }
}
#endif  // RF_MATVEC_COMMON

// Rows a thread takes in the quantized kernels: two for one token (see matvec_q_kernel).
template <int NT>
constexpr int kRowsPerThread = NT == 1 ? 2 : 1;

// The kernel that runs NT tokens with kRows rows per workgroup: the quantized (Q8
// activations) or the float one.
template <typename T, int NT, int kRows, typename X>
const void* kernel_of() {
    if constexpr (std::is_same<X, uint8_t>::value) {
        return (const void*)matvec_q_kernel<T, NT, kRows, kRowsPerThread<NT>>;
    } else {
        return (const void*)matvec_f_kernel<T, NT, kRows>;
    }
}

template <typename T, int NT, int kRows, typename X>
void launch_kernel(unsigned grid, const MatvecMats& mats, int n_mats, int n_cols, const X* x,
                   int accumulate, hipStream_t stream, unsigned groups = 1) {
    if constexpr (std::is_same<X, uint8_t>::value) {
        constexpr int rpt = kRowsPerThread<NT>;
        rfLaunchChained((matvec_q_kernel<T, NT, kRows, rpt>), dim3((grid + rpt - 1) / rpt),
                           dim3(kMatvecThreads), 0, stream, mats, n_mats, n_cols, x, accumulate);
    } else {
        rfLaunchChained((matvec_f_kernel<T, NT, kRows>), dim3(grid, groups),
                           dim3(kMatvecThreads), 0, stream, mats, n_mats, n_cols, x, accumulate);
    }
}

// Calls f with std::integral_constant<int, kRows>: the rows a workgroup takes of rows
// n_cols wide. 1, 2 or 4 rows a workgroup (128, 64 or 32 threads a row): the one that
// leaves the fewest threads idle in the last pass over a row (a 172-task Q6_K row of
// 11,008 columns keeps 90% busy with 64 threads, 67% with 128). Among equals, more rows a
// workgroup (more tasks a thread, more loads in flight) while a thread makes at most two
// passes; measured on an H100: a 64-task Q4_K row of 4,096 columns streams 6% faster with
// 32 threads than with 64, a 172-task Q6_K row slower with 32 than 64.
//
// Float matrices of at most kFewFloatRows rows (a mixture of experts' router) take one row
// a workgroup whatever their width: packed four rows a workgroup, gpt-oss's router of 32
// rows by 2,880 ran in 8 workgroups, each thread's 23 loads one after another (10.7 µs a
// layer under ncu on an H200).
constexpr unsigned kFewFloatRows = 512;

// The routed experts' products of one slot a tile (matvec_experts.hip) may also take 8
// rows a workgroup, 16 threads a row (kMaxRows = kOneTokenMaxRows), by the same rule: a
// 12-task Q6_K row of 768 columns (Qwen3-30B-A3B's experts' down) keeps 75% of 16 threads
// busy, 38% of 32, and its 8 slots' 16,384 rows then take half the workgroups, where the
// kernel's 104 registers a thread leave room for 4 workgroups of 128 threads on each of an
// H200's 132 multiprocessors: 2,048 workgroups ran in four waves. On an H200 that shape
// then decoded one token 7% faster, 8 sequences 17% and 32 sequences 33% faster;
// gpt-oss-20b's rows (2,880 columns, 90 tasks) keep 4 rows either way. The dense products
// keep 4: with 8, a SmolLM2-135M shape's tg64 fell from 1,555 to 1,466 tokens/s and a
// 7B's from 441 to 426 (docs/measurements.md).
constexpr int kOneTokenMaxRows = 8;

template <typename T, typename X, int kMaxRows = 4, typename F>
hipError_t with_group_rows(int n_cols, F&& f, unsigned total_rows = ~0u) {
    static_assert(kMaxRows == 4 || kMaxRows == kOneTokenMaxRows, "4 or 8 rows at most");
    if constexpr (!std::is_same<X, uint8_t>::value) {
        if (total_rows <= kFewFloatRows) return f(std::integral_constant<int, 1>{});
    }
    // Work items per row: tasks of the quantized kernels, 4 values of the float ones.
    int work = n_cols / 4;
    if constexpr (std::is_same<X, uint8_t>::value) work = n_cols / T::kValues * T::kTasks;
    int best_rows = 1;
    float best = 0.0f;
    for (int rows = 1; rows <= kMaxRows; rows *= 2) {
        const int tpr = kMatvecThreads / rows;
        const int passes = (work + tpr - 1) / tpr;
        const float busy = (float)work / (float)(passes * tpr);
        if (busy > best + 1e-3f || (busy >= best - 1e-3f && passes <= 2)) {
            best = busy;
            best_rows = rows;
        }
    }
    if constexpr (kMaxRows == kOneTokenMaxRows) {
        if (best_rows == kOneTokenMaxRows) {
            return f(std::integral_constant<int, kOneTokenMaxRows>{});
        }
    }
    if (best_rows == 4) return f(std::integral_constant<int, 4>{});
    if (best_rows == 2) return f(std::integral_constant<int, 2>{});
    return f(std::integral_constant<int, 1>{});
}

// Calls f with std::integral_constant<int, NT> for n_tokens (1 to kMaxTokens).
template <typename F>
hipError_t with_tokens(int n_tokens, F&& f) {
    switch (n_tokens) {
        case 1: return f(std::integral_constant<int, 1>{});
        case 2: return f(std::integral_constant<int, 2>{});
        case 3: return f(std::integral_constant<int, 3>{});
        case 4: return f(std::integral_constant<int, 4>{});
        case 5: return f(std::integral_constant<int, 5>{});
        case 6: return f(std::integral_constant<int, 6>{});
        case 7: return f(std::integral_constant<int, 7>{});
        case 8: return f(std::integral_constant<int, 8>{});
        default: return hipErrorInvalidValue;
    }
}

// Most tokens the float products take: the groups of kMaxTokens fill the grid's y.
constexpr int kMaxFloatTokens = 65535 * kMaxTokens;

template <typename T, typename X>
hipError_t launch_tokens(const MatvecMats& mats, int n_mats, int n_cols, const X* x,
                         int n_tokens, int accumulate, hipStream_t stream) {
    unsigned total = 0;
    for (int m = 0; m < n_mats; ++m) total += (unsigned)mats.rows[m];
    if constexpr (!std::is_same<X, uint8_t>::value) {
        // Float weights past kMaxTokens tokens: one launch of the whole groups, one of
        // the tokens left.
        if (n_tokens > kMaxTokens) {
            const int groups = n_tokens / kMaxTokens;
            const hipError_t status = with_group_rows<T, X>(
                n_cols,
                [&](auto rows) {
                    constexpr int kRows = decltype(rows)::value;
                    launch_kernel<T, kMaxTokens, kRows>((total + kRows - 1) / kRows, mats,
                                                        n_mats, n_cols, x, accumulate, stream,
                                                        (unsigned)groups);
                    return hipGetLastError();
                },
                total);
            const int whole = groups * kMaxTokens;
            if (status != hipSuccess || whole == n_tokens) return status;
            MatvecMats rest = mats;
            for (int m = 0; m < n_mats; ++m) rest.y[m] += (size_t)whole * mats.rows[m];
            return launch_tokens<T, X>(rest, n_mats, n_cols, x + (size_t)whole * n_cols,
                                       n_tokens - whole, accumulate, stream);
        }
    }
    return with_tokens(n_tokens, [&](auto nt) {
        return with_group_rows<T, X>(
            n_cols,
            [&](auto rows) {
                constexpr int kRows = decltype(rows)::value;
                launch_kernel<T, decltype(nt)::value, kRows>((total + kRows - 1) / kRows, mats,
                                                             n_mats, n_cols, x, accumulate,
                                                             stream);
                return hipGetLastError();
            },
            total);
    });
}

// Loads the code of the module launch_tokens launches for n_tokens tokens of rows
// n_cols wide. The runtimes load a module whole at the first use of one of its kernels,
// which a launch pays for; asking for a kernel's attributes is such a use (this one asks
// for the kernel of many rows: which of the unit's kernels does not matter).
template <typename T, typename X>
hipError_t load_tokens(int n_cols, int n_tokens) {
    return with_tokens(n_tokens, [&](auto nt) {
        return with_group_rows<T, X>(n_cols, [&](auto rows) {
            hipFuncAttributes attributes;
            return hipFuncGetAttributes(
                &attributes, kernel_of<T, decltype(nt)::value, decltype(rows)::value, X>());
        });
    });
}

}  // namespace rf

// Weight type codes, as ggml numbers them (GgmlType in gguf-format).
enum {
    RF_T_F32 = 0,
    RF_T_F16 = 1,
    RF_T_Q4_0 = 2,
    RF_T_Q4_1 = 3,
    RF_T_Q5_0 = 6,
    RF_T_Q5_1 = 7,
    RF_T_Q8_0 = 8,
    RF_T_Q4_K = 12,
    RF_T_Q5_K = 13,
    RF_T_Q6_K = 14,
    RF_T_Q2_K = 10,
    RF_T_Q3_K = 11,
    RF_T_IQ4_NL = 20,
    RF_T_IQ4_XS = 23,
    RF_T_IQ3_XXS = 18,
    RF_T_IQ3_S = 21,
    RF_T_IQ2_XXS = 16,
    RF_T_IQ2_XS = 17,
    RF_T_IQ2_S = 22,
    RF_T_IQ1_S = 19,
    RF_T_IQ1_M = 29,
    RF_T_MXFP4 = 39,
    RF_T_BF16 = 30,
};

#if defined(RF_MATVEC_COMMON)

extern "C" {

// x: n_tokens × n_cols f32 (n_cols a multiple of 32); out: n_tokens × n_cols/32 blocks.
int rf_quantize_q8(const void* x, size_t n_tokens, size_t n_cols, void* out, int device,
                   void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    const size_t n_blocks = n_tokens * (n_cols / 32);
    if (n_blocks == 0) return (int)hipSuccess;
    const unsigned threads = 256;
    const size_t grid = (n_blocks * 32 + threads - 1) / threads;
    int8_t* qs = (int8_t*)out;
    float* ds = (float*)(qs + n_blocks * 32);
    int* sums = (int*)(ds + n_blocks);
    rfLaunchChained(rf::quantize_q8_kernel, dim3((unsigned)grid), dim3(threads), 0,
                       (hipStream_t)stream, (const float*)x, n_blocks, qs, ds, sums);
    return (int)hipGetLastError();
}

}  // extern "C"

#elif defined(RF_MATVEC_TYPE) && defined(RF_MATVEC_NAME)

namespace rf {

// The weight type of each ggml code, and its activations' element: Q8 blocks (uint8_t)
// for quantized types, f32 values for float ones.
template <int kCode>
struct MatvecType;
#define RF_MATVEC_TYPE_OF(code, T, X) \
    template <>                       \
    struct MatvecType<code> {         \
        using Type = T;               \
        using Input = X;              \
    };
RF_MATVEC_TYPE_OF(RF_T_Q4_0, MQ4_0, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_Q4_1, MQ4_1, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_Q5_0, MQ5_0, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_Q5_1, MQ5_1, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_Q8_0, MQ8_0, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_Q4_K, MQ4_K, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_Q5_K, MQ5_K, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_Q6_K, MQ6_K, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_Q2_K, MQ2_K, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_Q3_K, MQ3_K, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_IQ4_NL, MIQ4_NL, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_IQ4_XS, MIQ4_XS, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_IQ3_XXS, MIQ3_XXS, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_IQ3_S, MIQ3_S, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_IQ2_XXS, MIQ2_XXS, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_IQ2_XS, MIQ2_XS, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_IQ2_S, MIQ2_S, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_IQ1_S, MIQ1_S, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_IQ1_M, MIQ1_M, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_MXFP4, MMXFP4, uint8_t)
RF_MATVEC_TYPE_OF(RF_T_F32, FF32, float)
RF_MATVEC_TYPE_OF(RF_T_F16, FF16, float)
RF_MATVEC_TYPE_OF(RF_T_BF16, FBF16, float)
#undef RF_MATVEC_TYPE_OF

using UnitType = MatvecType<RF_MATVEC_TYPE>::Type;
using UnitInput = MatvecType<RF_MATVEC_TYPE>::Input;

}  // namespace rf

#define RF_MATVEC_JOIN2(a, b) a##_##b
#define RF_MATVEC_JOIN(a, b) RF_MATVEC_JOIN2(a, b)

extern "C" {

// weights[i]: rows[i] × n_cols of this unit's type; outs[i]: n_tokens × rows[i] f32
// (token-major). x: Q8 activation blocks (quantized types: 1 to kMaxTokens tokens) or
// f32 values (float types: 1 to kMaxFloatTokens), n_tokens × n_cols. accumulate: add to
// outs instead of overwriting.
int RF_MATVEC_JOIN(rf_matvec, RF_MATVEC_NAME)(const void* const* weights, void* const* outs,
                                              const int* rows, int n_mats, int n_cols,
                                              const void* x, int n_tokens, int accumulate,
                                              int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    const int max_tokens =
        std::is_same<rf::UnitInput, uint8_t>::value ? rf::kMaxTokens : rf::kMaxFloatTokens;
    if (n_mats < 1 || n_mats > rf::kMaxMats || n_tokens < 1 || n_tokens > max_tokens)
        return (int)hipErrorInvalidValue;
    rf::MatvecMats mats = {};
    for (int m = 0; m < n_mats; ++m) {
        mats.w[m] = (const uint8_t*)weights[m];
        mats.y[m] = (float*)outs[m];
        mats.rows[m] = rows[m];
    }
    return (int)rf::launch_tokens<rf::UnitType>(mats, n_mats, n_cols, (const rf::UnitInput*)x,
                                                n_tokens, accumulate, (hipStream_t)stream);
}

// Loads the code of the kernel rf_matvec_NAME launches for n_tokens tokens of rows n_cols
// wide, so that its first launch does not wait for it. Returns at once once loaded.
int RF_MATVEC_JOIN(rf_matvec_load, RF_MATVEC_NAME)(int n_cols, int n_tokens, int device) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n_tokens < 1 || n_tokens > rf::kMaxTokens) return (int)hipErrorInvalidValue;
    return (int)rf::load_tokens<rf::UnitType, rf::UnitInput>(n_cols, n_tokens);
}

}  // extern "C"

#include "matvec_experts.hip"

#else
#error "matvec.hip is built per unit: define RF_MATVEC_COMMON, or RF_MATVEC_TYPE and RF_MATVEC_NAME"
#endif
