// norm.h: RMSNorm's workgroup-wide parts, shared by the kernels that norm a row
// (norm_rope.hip's, and experts.hip's router behind its norm): the scale, and the normed
// row written as f32 and as Q8 blocks. Every kernel that norms a row this way, with the
// threads norm_threads gives, gets the same bits for it.
#pragma once

#include "transformer_common.h"

namespace rf {

constexpr int kNormMaxThreads = 1024;
// Values each thread keeps in registers; wider rows read the rest twice.
constexpr int kNormPer = 4;

// The norm's scale, 1 / sqrt(mean(x²) + eps), of one row whose value i is load(i), by
// the whole workgroup: each thread keeps its first kNormPer values (i = thread + j ·
// blockDim) in v and adds their squares in that order, then the rest; the block sums
// them (block_sum_once: a kernel takes one norm's scale).
template <typename Load>
__device__ __forceinline__ float norm_scale(Load load, int dim, float eps, float (&v)[kNormPer]) {
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < kNormPer; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        v[k] = i < dim ? load(i) : 0.0f;
        ss += v[k] * v[k];
    }
    for (int i = threadIdx.x + kNormPer * blockDim.x; i < dim; i += blockDim.x) {
        const float xi = load(i);
        ss += xi * xi;
    }
    ss = block_sum_once(ss);
    return rsqrtf(ss / (float)dim + eps);
}

// y = x · scale · w of one row (its first values in v, the norm weights' in wv, the rest
// read again from `row`), into `o` (y, or y added to it) and as Q8 blocks into q from
// value `first` of the whole activation, by the whole workgroup.
__device__ __forceinline__ void store_normed(const float (&v)[kNormPer],
                                             const float (&wv)[kNormPer], const float* row,
                                             const void* w, int w_type, int dim, float scale,
                                             float* o, int add, const Q8Out& q, bool q8,
                                             size_t first) {
    // Whole 32-lane groups step together (the bound is rounded up to 32), so each group
    // covers one Q8 block per step.
    const int padded = (dim + 31) / 32 * 32;
    auto emit = [&](int i, float xi, float wi) {
        float y = 0.0f;
        if (i < dim) {
            y = xi * scale * wi;
            if (o) o[i] = add ? o[i] + y : y;
        }
        if (q8) quantize32(y, q, first + i);
    };
#pragma unroll
    for (int k = 0; k < kNormPer; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < padded) emit(i, v[k], wv[k]);
    }
    for (int i = threadIdx.x + kNormPer * blockDim.x; i < padded; i += blockDim.x) {
        const bool in = i < dim;
        emit(i, in ? row[i] : 0.0f, in ? weight_at(w, w_type, i) : 0.0f);
    }
}

// The threads of a norm's workgroup: about kNormPer values a thread, in whole 32-lane
// groups.
inline int norm_threads(int dim) {
    return min(kNormMaxThreads, max(32, ((dim + kNormPer - 1) / kNormPer + 31) / 32 * 32));
}

}  // namespace rf
