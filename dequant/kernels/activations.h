// activations.h: the batch products' input from the activations, once per input (the
// common unit of matmul.hip): rf_row_scales' per-token power of two and f16 values for
// the f16 tiles, and rf_quantize_q8k's Q8_K blocks for the int8 tiles (tiles_q8k.h).
#ifndef ROCMFORGE_DEQUANT_ACTIVATIONS_H
#define ROCMFORGE_DEQUANT_ACTIVATIONS_H

namespace rf {

// One workgroup per token: the power of two 2^e with the token's largest magnitude in
// [2^14, 2^15) once divided by it (1 for a token of zeros or with a non-finite value,
// which then reaches the results as it is), and the token's values divided by it, in f16.
// Up to kRowScalesThreads threads (a multiple of 32); four values at a time where the
// rows allow (a width that is a multiple of 4 from aligned buffers keeps every row of
// the input 16-byte aligned and of the output 8-byte aligned).
constexpr int kRowScalesThreads = 1024;
__global__ void __launch_bounds__(kRowScalesThreads)
    row_scales_kernel(const float* __restrict__ x, int cols, float* __restrict__ scales,
                      __half* __restrict__ x16) {
    rf_chain_wait();
    __shared__ float partial[kRowScalesThreads / 32];
    __shared__ float shared_scale;
    const float* row = x + (size_t)blockIdx.x * cols;
    const bool quads = cols % 4 == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)x16 & 7) == 0;
    const int n_quads = quads ? cols / 4 : 0;
    float amax = 0.0f;
    for (int i = threadIdx.x; i < n_quads; i += blockDim.x) {
        const float4 v = reinterpret_cast<const float4*>(row)[i];
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    for (int i = 4 * n_quads + threadIdx.x; i < cols; i += blockDim.x) {
        amax = fmaxf(amax, fabsf(row[i]));
    }
    // Groups of 32 lanes (a wave of 64 reduces as two).
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) amax = fmaxf(amax, rf_shfl_xor(amax, mask));
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = amax;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = 0.0f;
        for (int g = 0; g < (int)(blockDim.x / 32); ++g) m = fmaxf(m, partial[g]);
        float scale = 1.0f;
        if (m > 0.0f && m <= 3.4e38f) scale = ldexpf(1.0f, ilogbf(m) - 14);
        scales[blockIdx.x] = scale;
        shared_scale = scale;
    }
    __syncthreads();
    const float inv = 1.0f / shared_scale;  // a power of two: exact
    __half* out = x16 + (size_t)blockIdx.x * cols;
    for (int i = threadIdx.x; i < n_quads; i += blockDim.x) {
        const float4 v = reinterpret_cast<const float4*>(row)[i];
        const __half2 lo = __floats2half2_rn(v.x * inv, v.y * inv);
        const __half2 hi = __floats2half2_rn(v.z * inv, v.w * inv);
        reinterpret_cast<uint2*>(out)[i] = make_uint2(half2_bits(lo), half2_bits(hi));
    }
    for (int i = 4 * n_quads + threadIdx.x; i < cols; i += blockDim.x) {
        out[i] = __float2half(row[i] * inv);
    }
}

// Each 32 lanes one block of 256 values of a token (8 lanes' groups a workgroup of 256
// threads): the block's scale d = its largest magnitude / 127, its values x / d rounded
// to the nearest integer (within ±127), and each sub-block's sum of them (exact, then
// rounded to f16): the q8k_bytes layout. A block of zeros, or with a non-finite value,
// gets d = 0 and zeros (its products are then zero, where the f16 tiles would carry the
// non-finite value through).
constexpr int kQuantizeQ8kThreads = 256;
__global__ void __launch_bounds__(kQuantizeQ8kThreads)
    quantize_q8k_kernel(const float* __restrict__ x, int n_tokens, int cols,
                        uint8_t* __restrict__ out) {
    rf_chain_wait();
    const int blocks = cols / kQkBlock;
    const long long block = (long long)blockIdx.x * (kQuantizeQ8kThreads / 32) + threadIdx.x / 32;
    if (block >= (long long)n_tokens * blocks) return;
    const int lane = threadIdx.x % 32;
    const float* src = x + block * kQkBlock + 8 * lane;
    const float4 v0 = reinterpret_cast<const float4*>(src)[0];
    const float4 v1 = reinterpret_cast<const float4*>(src)[1];
    const float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) amax = fmaxf(amax, rf_shfl_xor(amax, mask));
    const bool finite = amax > 0.0f && amax <= 3.4e38f;
    const float inv = finite ? 127.0f / amax : 0.0f;
    uint32_t words[2] = {0u, 0u};
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int qv = max(-127, min(127, __float2int_rn(v[i] * inv)));
        sum += qv;
        words[i / 4] |= (uint32_t)(qv & 0xff) << (8 * (i % 4));
    }
    sum += rf_shfl_xor(sum, 1);
    sum += rf_shfl_xor(sum, 2);
    const size_t n = (size_t)n_tokens, c = (size_t)cols;
    reinterpret_cast<uint2*>(out + block * kQkBlock)[lane] = make_uint2(words[0], words[1]);
    if (lane == 0) {
        reinterpret_cast<float*>(out + q8k_scales_at(n, c))[block] = finite ? amax / 127.0f : 0.0f;
    }
    if (lane % 4 == 0) {
        reinterpret_cast<__half*>(out + q8k_sums_at(n, c))[block * 8 + lane / 4] =
            __int2half_rn(sum);
    }
}

}  // namespace rf

extern "C" int rf_row_scales(const void* x, int n_tokens, int cols, void* scales, void* x16,
                             int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n_tokens < 1 || cols < 1) return (int)hipErrorInvalidValue;
    // A few tokens get the most threads each (a decode batch's 32 tokens would leave the
    // device idle with 256), a prompt's many the fewest that keep it busy.
    const int threads = n_tokens <= 128 ? rf::kRowScalesThreads : 256;
    rfLaunchChained(rf::row_scales_kernel, dim3((unsigned)n_tokens), dim3(threads), 0,
                    (hipStream_t)stream, (const float*)x, cols, (float*)scales, (__half*)x16);
    return (int)hipGetLastError();
}

// `n_tokens` rows of `cols` f32 values (a multiple of 256, from a 16-byte aligned `x`) as
// Q8_K blocks into `out` (q8k_bytes(n_tokens, cols) bytes, 16-byte aligned).
extern "C" int rf_quantize_q8k(const void* x, int n_tokens, int cols, void* out, int device,
                               void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n_tokens < 1 || cols < 1 || cols % rf::kQkBlock != 0 || (uintptr_t)x % 16 != 0 ||
        (uintptr_t)out % 16 != 0) {
        return (int)hipErrorInvalidValue;
    }
    const long long blocks = (long long)n_tokens * (cols / rf::kQkBlock);
    constexpr int kPerGroup = rf::kQuantizeQ8kThreads / 32;
    rfLaunchChained(rf::quantize_q8k_kernel, dim3((unsigned)((blocks + kPerGroup - 1) / kPerGroup)),
                    dim3(rf::kQuantizeQ8kThreads), 0, (hipStream_t)stream, (const float*)x,
                    n_tokens, cols, (uint8_t*)out);
    return (int)hipGetLastError();
}

#endif  // ROCMFORGE_DEQUANT_ACTIVATIONS_H
