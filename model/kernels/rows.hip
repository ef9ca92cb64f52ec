// rows.hip: the element-wise and row operations: the gated activations fused with
// quantization, biases, the embedding row gather, scaling, the final logits' soft cap, sparse
// additions, greedy argmax on the device, row selection, and the position counter.
// Shared helpers and conventions: transformer_common.h.
#include "transformer_common.h"

namespace rf {

// act(g)·u element-wise, f32 out and/or Q8 blocks (32 lanes a block). act 0: SiLU; 1:
// GELU's tanh form; 2: gpt-oss's clamped SwiGLU, g capped at kOaiLimit from above and u
// clamped to ±kOaiLimit, then g·sigmoid(kOaiAlpha·g)·(u + 1) (the host's ops::swiglu_oai).
// Without a gate (experts that have none), silu(u) or gelu_tanh(u) alone. With `ids`
// (a mixture of experts' slots, rows of `width`), each row's expert's bias rows of
// gate_bias and up_bias (either may be null) are added to g and u first; an id past
// n_bias_rows adds nothing (the router never writes one).
constexpr float kOaiAlpha = 1.702f;
constexpr float kOaiLimit = 7.0f;

__global__ void gated_kernel(const float* __restrict__ gate, const float* __restrict__ up,
                             size_t n, int act_kind, float* __restrict__ out,
                             void* __restrict__ out_q8, const float* __restrict__ gate_bias,
                             const float* __restrict__ up_bias, const int* __restrict__ ids,
                             int width, int n_bias_rows) {
    rf_chain_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;  // n is a multiple of 32: whole groups leave together
    float g = gate ? gate[i] : up[i];
    float u = gate ? up[i] : 1.0f;
    if (ids) {
        const size_t r = i / width, c = i % width;
        const int e = ids[r];
        if (e >= 0 && e < n_bias_rows) {
            const size_t at = (size_t)e * width + c;
            if (gate && gate_bias) g += gate_bias[at];
            if (up_bias) (gate ? u : g) += up_bias[at];
        }
    }
    float act;
    if (act_kind == 1) {
        const float c = 0.7978845608028654f;  // sqrt(2/pi)
        act = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
    } else if (act_kind == 2) {
        g = fminf(g, kOaiLimit);
        u = fminf(fmaxf(u, -kOaiLimit), kOaiLimit) + 1.0f;
        act = g / (1.0f + expf(kOaiAlpha * -g));
    } else {
        act = g / (1.0f + expf(-g));
    }
    const float y = act * u;
    if (out) out[i] = y;
    if (out_q8) quantize32(y, q8_layout(out_q8, n), i);
}

// x[r] += bias for each of the rows of `width` values (a projection's bias).
__global__ void add_bias_kernel(float* __restrict__ x, size_t n, int width,
                                const float* __restrict__ bias) {
    rf_chain_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i % width];
}

// Copies rows tokens[t] (row_bytes each) of `table` to out[t]; a token past n_rows
// copies nothing and sets *bad.
__global__ void gather_rows_kernel(const uint8_t* __restrict__ table, size_t row_bytes,
                                   size_t n_rows, const uint32_t* __restrict__ tokens,
                                   uint8_t* __restrict__ out, int* __restrict__ bad) {
    rf_chain_wait();
    const uint32_t id = tokens[blockIdx.x];
    if (id >= n_rows) {
        if (threadIdx.x == 0) *bad = 1;
        return;
    }
    const uint8_t* src = table + (size_t)id * row_bytes;
    uint8_t* dst = out + (size_t)blockIdx.x * row_bytes;
    for (size_t i = threadIdx.x; i < row_bytes; i += blockDim.x) dst[i] = src[i];
}

__global__ void scale_kernel(float* __restrict__ x, size_t n, float s) {
    rf_chain_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// x = cap · tanh(x · (1/cap)): the final logits' soft cap (Gemma 2, some Gemma 3).
__global__ void softcap_kernel(float* __restrict__ x, size_t n, float cap) {
    rf_chain_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = tanhf(x[i] * (1.0f / cap)) * cap;
}

// x[at[i]] += values[i] for i < count: a sparse addition (a request's logit biases),
// one thread an entry. The indices are distinct, so no two threads touch one value.
__global__ void add_at_kernel(float* __restrict__ x, const int* __restrict__ at,
                              const float* __restrict__ values, int count) {
    rf_chain_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[at[i]] += values[i];
}

// Row rows[k] of x (rows of n values) keeps the values whose bit is set in mask k
// (bit i % 32 of word i / 32, n_words words a mask); the others become -inf. A grammar's
// mask before the argmax; grid (blocks of 256 values, masks).
__global__ void mask_rows_kernel(float* __restrict__ x, int n, const int* __restrict__ rows,
                                 const uint32_t* __restrict__ words, int n_words) {
    rf_chain_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint32_t word = words[(size_t)blockIdx.y * n_words + (i >> 5)];
    if (!((word >> (i & 31)) & 1u)) x[(size_t)rows[blockIdx.y] * n + i] = -INFINITY;
}

constexpr int kArgmaxThreads = 1024;

// For each row (a workgroup each) of n values: the index of the largest value (the
// smallest index among equals), written to token[row]; a NaN or +inf anywhere in the row,
// or no value above -inf (every token masked), writes UINT32_MAX instead.
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const float* __restrict__ x, int n, uint32_t* __restrict__ token) {
    rf_chain_wait();
    x += (size_t)blockIdx.x * n;
    token += blockIdx.x;
    __shared__ float best_v[kArgmaxThreads / 32];
    __shared__ int best_i[kArgmaxThreads / 32];
    __shared__ int bad;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    float v = -INFINITY;
    int idx = n;
    bool local_bad = false;
    // Eight loads in flight a thread before their comparisons: a vocabulary's row is
    // tens of loads a thread, which one at a time would each wait for memory.
    constexpr int kAhead = 8;
    for (int first = threadIdx.x; first < n; first += kAhead * blockDim.x) {
        float xs[kAhead];
#pragma unroll
        for (int k = 0; k < kAhead; ++k) {
            const int i = first + k * blockDim.x;
            xs[k] = i < n ? x[i] : -INFINITY;
        }
#pragma unroll
        for (int k = 0; k < kAhead; ++k) {
            const int i = first + k * blockDim.x;
            const float xi = xs[k];
            if (xi != xi || xi == INFINITY) local_bad = true;
            if (i < n && (xi > v || (xi == v && i < idx))) {
                v = xi;
                idx = i;
            }
        }
    }
    if (local_bad) bad = 1;
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) {
        const float ov = rf_shfl_xor(v, mask);
        const int oi = rf_shfl_xor(idx, mask);
        if (ov > v || (ov == v && oi < idx)) {
            v = ov;
            idx = oi;
        }
    }
    const int group = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) {
        best_v[group] = v;
        best_i[group] = idx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int g = 1; g < (int)(blockDim.x / 32); ++g) {
            if (best_v[g] > v || (best_v[g] == v && best_i[g] < idx)) {
                v = best_v[g];
                idx = best_i[g];
            }
        }
        *token = (bad || idx >= n || v == -INFINITY) ? 0xFFFFFFFFu : (uint32_t)idx;
    }
}

// dst row r = src row rows[r], `dim` values each (a workgroup per row).
__global__ void select_rows_kernel(const float* __restrict__ src, int dim,
                                   const int* __restrict__ rows, float* __restrict__ dst) {
    rf_chain_wait();
    const float* s = src + (size_t)rows[blockIdx.x] * dim;
    float* d = dst + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) d[i] = s[i];
}

__global__ void advance_kernel(int* pos, int n) {
    rf_chain_wait();
    *pos += n;
}

}  // namespace rf

using namespace rf;

static inline unsigned blocks_for(size_t n, unsigned threads) {
    return (unsigned)((n + threads - 1) / threads);
}

extern "C" {

int rf_gated(const void* gate, const void* up, size_t n, int act_kind, void* out, void* out_q8,
             const void* gate_bias, const void* up_bias, const void* ids, int width,
             int n_bias_rows, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (act_kind < 0 || act_kind > 2 || (act_kind == 2 && !gate)) return (int)hipErrorInvalidValue;
    if (ids && (width < 1 || n_bias_rows < 1 || n % (size_t)width != 0))
        return (int)hipErrorInvalidValue;
    rfLaunchChained(gated_kernel, dim3(blocks_for(n, 256)), dim3(256), 0,
                       (hipStream_t)stream, (const float*)gate, (const float*)up, n, act_kind,
                       (float*)out, out_q8, (const float*)gate_bias, (const float*)up_bias,
                       (const int*)ids, width, n_bias_rows);
    return (int)hipGetLastError();
}

int rf_add_bias(void* x, size_t n, int width, const void* bias, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (width < 1 || n % (size_t)width != 0) return (int)hipErrorInvalidValue;
    if (n == 0) return (int)hipSuccess;
    rfLaunchChained(add_bias_kernel, dim3(blocks_for(n, 256)), dim3(256), 0, (hipStream_t)stream,
                    (float*)x, n, width, (const float*)bias);
    return (int)hipGetLastError();
}

int rf_gather_rows(const void* table, size_t row_bytes, size_t n_rows, const void* tokens,
                   int n_tokens, void* out, void* bad, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    rfLaunchChained(gather_rows_kernel, dim3(n_tokens), dim3(256), 0, (hipStream_t)stream,
                       (const uint8_t*)table, row_bytes, n_rows, (const uint32_t*)tokens,
                       (uint8_t*)out, (int*)bad);
    return (int)hipGetLastError();
}

int rf_scale(void* x, size_t n, float s, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    rfLaunchChained(scale_kernel, dim3(blocks_for(n, 256)), dim3(256), 0,
                       (hipStream_t)stream, (float*)x, n, s);
    return (int)hipGetLastError();
}

int rf_softcap(void* x, size_t n, float cap, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (!(cap > 0.0f)) return (int)hipErrorInvalidValue;
    rfLaunchChained(softcap_kernel, dim3(blocks_for(n, 256)), dim3(256), 0,
                    (hipStream_t)stream, (float*)x, n, cap);
    return (int)hipGetLastError();
}

int rf_argmax(const void* x, int n, int n_rows, void* token, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    rfLaunchChained(argmax_kernel, dim3(n_rows), dim3(kArgmaxThreads), 0, (hipStream_t)stream,
                       (const float*)x, n, (uint32_t*)token);
    return (int)hipGetLastError();
}

int rf_add_at(void* x, const void* at, const void* values, int count, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (count < 1) return (int)hipErrorInvalidValue;
    rfLaunchChained(add_at_kernel, dim3(blocks_for((size_t)count, 256)), dim3(256), 0,
                    (hipStream_t)stream, (float*)x, (const int*)at, (const float*)values, count);
    return (int)hipGetLastError();
}

int rf_mask_rows(void* x, int n, const void* rows, const void* words, int n_words, int n_masks,
                 int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n < 1 || n_masks < 1 || n_words < (n + 31) / 32) return (int)hipErrorInvalidValue;
    rfLaunchChained(mask_rows_kernel, dim3(blocks_for((size_t)n, 256), n_masks), dim3(256), 0,
                    (hipStream_t)stream, (float*)x, n, (const int*)rows, (const uint32_t*)words,
                    n_words);
    return (int)hipGetLastError();
}

int rf_select_rows(const void* src, int dim, const void* rows, int n_rows, void* dst, int device,
                   void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    rfLaunchChained(select_rows_kernel, dim3(n_rows), dim3(256), 0, (hipStream_t)stream,
                    (const float*)src, dim, (const int*)rows, (float*)dst);
    return (int)hipGetLastError();
}

int rf_advance(void* pos, int n, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    rfLaunchChained(advance_kernel, dim3(1), dim3(1), 0, (hipStream_t)stream, (int*)pos, n);
    return (int)hipGetLastError();
}

}  // extern "C"
