// rocmforge_hip.h: the one header every ROCmForge HIP source includes.
//
// The project writes GPU code once, in HIP. Built with ROCm's hipcc (AMD), this header
// simply includes <hip/hip_runtime.h>. Built with nvcc (NVIDIA), it maps the HIP names the
// project uses to their CUDA twins instead, because HIP's own NVIDIA headers call CUDA APIs
// that CUDA 12 removed and no longer compile.
//
// Rule for new code: use a HIP name here only if it is mapped below (or is spelled the same
// in CUDA: __global__, __device__, __shared__, threadIdx, blockIdx, blockDim, gridDim,
// __syncthreads, dim3, <<<...>>>). Add the mapping next to its kind when you need a new one.
//
// Also defined on both platforms:
//   ROCMFORGE_HIP_AMD or ROCMFORGE_HIP_NVIDIA   which platform this is built for
//   RF_WARP_SIZE                                threads per warp (wavefront) on the target
//   rf_shfl_xor(value, lane_mask)               butterfly shuffle across the whole warp
//   rf_shfl32(value, src_lane)                  lane src_lane's value within the
//                                               caller's group of 32 lanes (every lane
//                                               of the warp must call it)
//   rf_max32_u(value), rf_min32_u(value)        the largest or smallest unsigned value
//                                               of the caller's group of 32 lanes, to
//                                               every lane of it (every lane must call)
//   rfLaunchChained(kernel, grid, block, shared_bytes, stream, args...)
//   rf_chain_wait()                             chained launches, below
//
// Chained launches. A kernel launched with rfLaunchChained may start while the kernel
// before it in its stream is still finishing (NVIDIA's programmatic dependent launch, on
// devices of compute capability 9.0 and later, in builds whose every target is sm_90 or
// later). It may do first whatever depends on no earlier work (loading weights, which no
// kernel writes), and must then call rf_chain_wait(), on every path and before it reads or
// writes any memory that earlier kernels read or write: that waits until the kernel before
// it has finished and its writes are visible, then lets the next chained kernel start.
// Since every chained kernel finishes only after that wait, each one still finishes after
// everything before it in the stream, as plain launches do; what is saved is the launch
// latency and the tail of the kernel before. Everywhere else (AMD, older NVIDIA devices or
// targets, or once the program has called hip_backend::set_chained_launch(false), which
// reaches rfhip_set_chained_launch in the runtime shim) rfLaunchChained is a plain launch
// and rf_chain_wait() does nothing: the stream orders the kernels by itself.
#ifndef ROCMFORGE_HIP_H
#define ROCMFORGE_HIP_H

#if defined(__CUDACC__) && !defined(__HIP__)
// ---------------------------------------------------------------- NVIDIA (nvcc) ----------
#define ROCMFORGE_HIP_NVIDIA 1
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Status codes.
#define hipError_t cudaError_t
#define hipSuccess cudaSuccess
#define hipErrorNotReady cudaErrorNotReady
#define hipErrorNoDevice cudaErrorNoDevice
#define hipErrorInvalidDevice cudaErrorInvalidDevice
#define hipErrorInvalidValue cudaErrorInvalidValue
#define hipErrorOutOfMemory cudaErrorMemoryAllocation
#define hipErrorInsufficientDriver cudaErrorInsufficientDriver
#define hipGetErrorName cudaGetErrorName
#define hipGetErrorString cudaGetErrorString
#define hipGetLastError cudaGetLastError
#define hipPeekAtLastError cudaPeekAtLastError

// Devices.
#define hipDeviceProp_t cudaDeviceProp
#define hipGetDeviceCount cudaGetDeviceCount
#define hipGetDevice cudaGetDevice
#define hipSetDevice cudaSetDevice
#define hipGetDeviceProperties cudaGetDeviceProperties
#define hipFuncSetAttribute cudaFuncSetAttribute
#define hipFuncAttributes cudaFuncAttributes
#define hipFuncGetAttributes cudaFuncGetAttributes
#define hipOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define hipFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define hipDeviceSynchronize cudaDeviceSynchronize
#define hipMemGetInfo cudaMemGetInfo
#define hipRuntimeGetVersion cudaRuntimeGetVersion
#define hipDriverGetVersion cudaDriverGetVersion

// Memory.
#define hipMalloc cudaMalloc
#define hipFree cudaFree
#define hipHostMalloc cudaHostAlloc
#define hipHostFree cudaFreeHost
#define hipHostMallocDefault cudaHostAllocDefault
#define hipHostMallocPortable cudaHostAllocPortable
#define hipHostUnregister cudaHostUnregister
#define hipMemcpy cudaMemcpy
#define hipMemcpyAsync cudaMemcpyAsync
#define hipMemsetAsync cudaMemsetAsync
#define hipMemcpyKind cudaMemcpyKind
#define hipMemcpyHostToDevice cudaMemcpyHostToDevice
#define hipMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define hipMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define hipMemcpyPeerAsync cudaMemcpyPeerAsync
#define hipDeviceCanAccessPeer cudaDeviceCanAccessPeer
#define hipDeviceEnablePeerAccess cudaDeviceEnablePeerAccess
#define hipErrorPeerAccessAlreadyEnabled cudaErrorPeerAccessAlreadyEnabled

// Streams and events.
#define hipStream_t cudaStream_t
#define hipStreamCreateWithFlags cudaStreamCreateWithFlags
#define hipStreamNonBlocking cudaStreamNonBlocking
#define hipStreamDestroy cudaStreamDestroy
#define hipStreamSynchronize cudaStreamSynchronize
#define hipStreamQuery cudaStreamQuery
#define hipStreamWaitEvent cudaStreamWaitEvent
#define hipEvent_t cudaEvent_t
#define hipEventCreateWithFlags cudaEventCreateWithFlags
#define hipEventDefault cudaEventDefault
#define hipEventDisableTiming cudaEventDisableTiming
#define hipEventDestroy cudaEventDestroy
#define hipEventRecord cudaEventRecord
#define hipEventSynchronize cudaEventSynchronize
#define hipEventQuery cudaEventQuery
#define hipEventElapsedTime cudaEventElapsedTime

// Graphs.
#define hipGraph_t cudaGraph_t
#define hipGraphExec_t cudaGraphExec_t
#define hipStreamBeginCapture cudaStreamBeginCapture
#define hipStreamCaptureModeRelaxed cudaStreamCaptureModeRelaxed
#define hipStreamEndCapture cudaStreamEndCapture
#define hipGraphDestroy cudaGraphDestroy
#define hipGraphLaunch cudaGraphLaunch
#define hipGraphExecDestroy cudaGraphExecDestroy

// Kernels. hipLaunchKernelGGL(kernel, grid, block, shared_bytes, stream, args...).
#define hipLaunchKernelGGL(kernel, grid, block, shared_bytes, stream, ...) \
    kernel<<<(grid), (block), (shared_bytes), (stream)>>>(__VA_ARGS__)

#define RF_WARP_SIZE 32
template <typename T>
__device__ __forceinline__ T rf_shfl_xor(T value, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, value, lane_mask, RF_WARP_SIZE);
}
template <typename T>
__device__ __forceinline__ T rf_shfl32(T value, int src_lane) {
    return __shfl_sync(0xffffffffu, value, src_lane, 32);
}

// One instruction a reduction from sm_80 on, else butterflies.
__device__ __forceinline__ unsigned rf_max32_u(unsigned value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return __reduce_max_sync(0xffffffffu, value);
#else
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) value = max(value, rf_shfl_xor(value, mask));
    return value;
#endif
}
__device__ __forceinline__ unsigned rf_min32_u(unsigned value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return __reduce_min_sync(0xffffffffu, value);
#else
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) value = min(value, rf_shfl_xor(value, mask));
    return value;
#endif
}

// Chained launches (see the top of this file). RF_CHAINED_LAUNCH is defined by the build
// when every target it compiles for is sm_90 or later, so that no kernel of the binary
// lacks the wait.
#if defined(RF_CHAINED_LAUNCH)
// In hip-backend's runtime shim (csrc/rfhip_runtime.hip): whether the program allows
// chained launches (hip_backend::set_chained_launch), 1 unless it said otherwise.
extern "C" int rfhip_chained_launch_allowed(void);

__device__ __forceinline__ void rf_chain_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether a launch on the current device is chained: the program has not switched chained
// launches off (looked at every launch), and the device has compute capability 9.0 or
// later (asked once per device).
inline bool rf_chained_launch_enabled() {
    if (!rfhip_chained_launch_allowed()) return false;
    static int state[64];  // per device: 0 not asked yet, 1 on, 2 off
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return false;
    int s = __atomic_load_n(&state[device], __ATOMIC_RELAXED);
    if (s == 0) {
        int major = 0;
        const bool on = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                               device) == cudaSuccess &&
                        major >= 9;
        s = on ? 1 : 2;
        __atomic_store_n(&state[device], s, __ATOMIC_RELAXED);
    }
    return s == 1;
}

// Whether the current device has the matrix instructions of ROCMFORGE_HIP_MMA (compute
// capability 8.0 or later), for launchers that pick a kernel written for them. Asked
// once per device.
inline bool rf_mma_available() {
    static int state[64];  // per device: 0 not asked yet, 1 yes, 2 no
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return false;
    int s = __atomic_load_n(&state[device], __ATOMIC_RELAXED);
    if (s == 0) {
        int major = 0;
        const bool yes = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                                device) == cudaSuccess &&
                         major >= 8;
        s = yes ? 1 : 2;
        __atomic_store_n(&state[device], s, __ATOMIC_RELAXED);
    }
    return s == 1;
}

// A launch error is left for cudaGetLastError, as with <<<...>>>.
template <typename... Params, typename... Args>
inline void rf_launch_chained(void (*kernel)(Params...), dim3 grid, dim3 block,
                              size_t shared_bytes, cudaStream_t stream, Args... args) {
    if (!rf_chained_launch_enabled()) {
        kernel<<<grid, block, shared_bytes, stream>>>(args...);
        return;
    }
    cudaLaunchAttribute attribute[1] = {};
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = shared_bytes;
    config.stream = stream;
    config.attrs = attribute;
    config.numAttrs = 1;
    (void)cudaLaunchKernelEx(&config, kernel, args...);
}
#define rfLaunchChained(kernel, grid, block, shared_bytes, stream, ...) \
    rf_launch_chained((kernel), dim3(grid), dim3(block), (shared_bytes), (stream), __VA_ARGS__)
#else
__device__ __forceinline__ void rf_chain_wait() {}
#define rfLaunchChained hipLaunchKernelGGL
#endif

// Matrix units, in the device pass for sm_80 and later: ROCMFORGE_HIP_MMA is defined and
// these wrap the instructions the kernels tile with.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define ROCMFORGE_HIP_MMA 1
// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t rf_smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
// Four 8 × 8 f16 matrices from shared memory; lane l gives the address of row l % 8 of
// matrix l / 8 (16 bytes, 16-byte aligned).
__device__ __forceinline__ void rf_ldmatrix_x4(uint32_t (&r)[4], const __half* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(rf_smem_addr(p)));
}
// As rf_ldmatrix_x4, each matrix transposed: rows stored in memory become columns.
__device__ __forceinline__ void rf_ldmatrix_x4_trans(uint32_t (&r)[4], const __half* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(rf_smem_addr(p)));
}
// c += a · b for a 16 × 16 f16 tile a (row-major) and a 16 × 8 tile b (column-major),
// f32 accumulated. Lane l holds c at rows l / 4 (c[0], c[1]) and l / 4 + 8 (c[2], c[3]),
// columns 2·(l % 4) and 2·(l % 4) + 1; a in the same pattern over its two 16 × 8 halves.
__device__ __forceinline__ void rf_mma_16816(float (&c)[4], const uint32_t (&a)[4],
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// c += a · b for a 16 × 32 int8 tile a (row-major) and a 32 × 8 tile b (column-major),
// int32 accumulated: the f16 instruction's pattern with four int8 values where it has
// two f16 ones (lane l: a[0] row l / 4, columns 4·(l % 4) .. + 3; a[1] row l / 4 + 8;
// a[2], a[3] the same 16 columns on; b0 and b1 column l / 4 of b, rows as a's columns).
__device__ __forceinline__ void rf_mma_16832_s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

#else
// ---------------------------------------------------------------- AMD (hipcc) ------------
#define ROCMFORGE_HIP_AMD 1
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>

#ifdef __HIP_DEVICE_COMPILE__
#define RF_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
// Host code must ask the device (hipDeviceProp_t::warpSize); 64 is the CDNA value.
#define RF_WARP_SIZE 64
#endif
template <typename T>
__device__ __forceinline__ T rf_shfl_xor(T value, int lane_mask) {
    return __shfl_xor(value, lane_mask, RF_WARP_SIZE);
}
template <typename T>
__device__ __forceinline__ T rf_shfl32(T value, int src_lane) {
    return __shfl(value, src_lane, 32);
}

__device__ __forceinline__ unsigned rf_max32_u(unsigned value) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) value = max(value, rf_shfl_xor(value, mask));
    return value;
}
__device__ __forceinline__ unsigned rf_min32_u(unsigned value) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) value = min(value, rf_shfl_xor(value, mask));
    return value;
}

// Chained launches (see the top of this file): plain launches on AMD.
__device__ __forceinline__ void rf_chain_wait() {}
#define rfLaunchChained hipLaunchKernelGGL
// No kernel is written for AMD's matrix instructions yet.
inline bool rf_mma_available() { return false; }

#endif

// Raises `kernel`'s limit of dynamic shared memory to `bytes` on the calling thread's
// current device, once a device: the limit is each device's own, so a process that runs
// kernels on several devices raises it on each. `raised` holds a bit a device (past 64
// devices it is set at every call, which is harmless).
#include <atomic>
template <typename Kernel>
inline hipError_t rf_raise_shared_memory(Kernel kernel, int bytes,
                                         std::atomic<unsigned long long>& raised) {
    int device = 0;
    hipError_t status = hipGetDevice(&device);
    if (status != hipSuccess) return status;
    const unsigned long long bit = device >= 0 && device < 64 ? 1ULL << device : 0;
    if (bit != 0 && (raised.load(std::memory_order_relaxed) & bit) != 0) return hipSuccess;
    status = hipFuncSetAttribute((const void*)kernel, hipFuncAttributeMaxDynamicSharedMemorySize,
                                 bytes);
    if (status == hipSuccess) raised.fetch_or(bit, std::memory_order_relaxed);
    return status;
}

// Workgroups of kKernel, launched with `threads` threads and `bytes` of dynamic shared
// memory, that a multiprocessor of the calling thread's current device holds at once:
// asked once per kernel and device (1 where the runtime cannot say; past 64 devices, at
// every call). A kernel past 48 KB of shared memory must have had its limit raised first
// (rf_raise_shared_memory).
template <auto kKernel>
inline int rf_resident_workgroups(int threads, int bytes) {
    static std::atomic<int> known[64];  // per device: 0 not asked
    int device = 0;
    if (hipGetDevice(&device) != hipSuccess) return 1;
    const bool cached = device >= 0 && device < 64;
    int n = cached ? known[device].load(std::memory_order_relaxed) : 0;
    if (n == 0) {
        if (hipOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, threads, (size_t)bytes) !=
                hipSuccess ||
            n < 1) {
            n = 1;
        }
        if (cached) known[device].store(n, std::memory_order_relaxed);
    }
    return n;
}

// The half sums of a Q8 activation block (dequant's kernels/matvec.hip reads them after
// the blocks' scales): each lane of a 32-lane group gives its block's quantized value;
// every lane gets the sums of lanes 0–15 and 16–31 packed in one int, the first in the
// low 16 bits (|sum| ≤ 16 · 127 fits).
__device__ __forceinline__ int rf_q8_half_sums(int q) {
    int s = q;
#pragma unroll
    for (int mask = 1; mask < 16; mask <<= 1) s += rf_shfl_xor(s, mask);
    const int other = rf_shfl_xor(s, 16);
    const bool upper = (threadIdx.x & 16) != 0;
    const int lo = upper ? other : s, hi = upper ? s : other;
    return (int)(((uint32_t)lo & 0xFFFFu) | ((uint32_t)hi << 16));
}
#endif  // ROCMFORGE_HIP_H
