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
#ifndef ROCMFORGE_HIP_H
#define ROCMFORGE_HIP_H

#if defined(__CUDACC__) && !defined(__HIP__)
// ---------------------------------------------------------------- NVIDIA (nvcc) ----------
#define ROCMFORGE_HIP_NVIDIA 1
#include <cuda_runtime.h>
#include <cuda_fp16.h>

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
#define hipMemcpy cudaMemcpy
#define hipMemcpyAsync cudaMemcpyAsync
#define hipMemsetAsync cudaMemsetAsync
#define hipMemcpyKind cudaMemcpyKind
#define hipMemcpyHostToDevice cudaMemcpyHostToDevice
#define hipMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define hipMemcpyDeviceToDevice cudaMemcpyDeviceToDevice

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

#endif
#endif  // ROCMFORGE_HIP_H
