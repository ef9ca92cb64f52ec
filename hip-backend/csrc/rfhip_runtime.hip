// The runtime shim: plain C functions, named rfhip_*, that the Rust crate declares in
// src/sys.rs. Built by hipcc against the HIP runtime (AMD) or by nvcc against the static
// CUDA runtime (NVIDIA), through include/rocmforge_hip.h, so Rust sees one set of symbols
// on both platforms.
//
// Conventions: every function returns the platform's native status code (hipError_t or
// cudaError_t) as an int, 0 meaning success, and writes results through out-pointers.
// Streams and events cross the boundary as opaque void pointers. rfhip_status_kind()
// sorts a native code into the portable kinds below, so Rust never hard-codes either
// platform's numbering.
#include "rocmforge_hip.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

// Keep in step with the RFHIP_KIND_* constants in src/sys.rs.
enum {
    RFHIP_KIND_SUCCESS = 0,
    RFHIP_KIND_NOT_READY = 1,
    RFHIP_KIND_NO_DEVICE = 2,
    RFHIP_KIND_NO_DRIVER = 3,
    RFHIP_KIND_OUT_OF_MEMORY = 4,
    RFHIP_KIND_OTHER = 5,
};

// Keep in step with `RfhipDeviceProps` in src/sys.rs.
typedef struct {
    char name[256];
    char arch[64];
    size_t total_memory;
    int multiprocessor_count;
    int warp_size;
    int major;
    int minor;
    int pci_domain;
    int pci_bus;
    int pci_device;
} rfhip_device_props_t;

static inline hipStream_t as_stream(void* stream) { return (hipStream_t)stream; }
static inline hipEvent_t as_event(void* event) { return (hipEvent_t)event; }

extern "C" {

const char* rfhip_platform_name(void) {
#ifdef ROCMFORGE_HIP_NVIDIA
    return "nvidia";
#else
    return "amd";
#endif
}

int rfhip_status_kind(int code) {
    switch ((hipError_t)code) {
        case hipSuccess: return RFHIP_KIND_SUCCESS;
        case hipErrorNotReady: return RFHIP_KIND_NOT_READY;
        case hipErrorNoDevice: return RFHIP_KIND_NO_DEVICE;
        case hipErrorInsufficientDriver: return RFHIP_KIND_NO_DRIVER;
#ifdef ROCMFORGE_HIP_NVIDIA
        // The CUDA driver stub library was loaded instead of a real driver (a container
        // without a GPU): as good as no driver.
        case cudaErrorStubLibrary: return RFHIP_KIND_NO_DRIVER;
#endif
        case hipErrorOutOfMemory: return RFHIP_KIND_OUT_OF_MEMORY;
        default: return RFHIP_KIND_OTHER;
    }
}

const char* rfhip_error_name(int code) { return hipGetErrorName((hipError_t)code); }
const char* rfhip_error_string(int code) { return hipGetErrorString((hipError_t)code); }

int rfhip_runtime_version(int* version) { return (int)hipRuntimeGetVersion(version); }
int rfhip_driver_version(int* version) { return (int)hipDriverGetVersion(version); }

int rfhip_device_count(int* count) {
    *count = 0;
    return (int)hipGetDeviceCount(count);
}
int rfhip_set_device(int ordinal) { return (int)hipSetDevice(ordinal); }
int rfhip_device_synchronize(void) { return (int)hipDeviceSynchronize(); }
int rfhip_mem_get_info(size_t* free_bytes, size_t* total_bytes) {
    return (int)hipMemGetInfo(free_bytes, total_bytes);
}

// Host memory registered where it lies (page-locked, mapped), for memory the host only
// reads while registered: a read-only file mapping on NVIDIA. HIP 5.2 has no read-only
// flag; there the registration asks for a mapping alone.
int rfhip_host_register_read_only(void* ptr, size_t bytes) {
#ifdef ROCMFORGE_HIP_NVIDIA
    return (int)cudaHostRegister(ptr, bytes, cudaHostRegisterMapped | cudaHostRegisterReadOnly);
#else
    return (int)hipHostRegister(ptr, bytes, hipHostRegisterMapped);
#endif
}
// Host memory the process mapped itself and writes (the region a ring of page-locked
// buffers shares), registered where it lies: page-locked for every device, like
// rfhip_host_alloc's memory.
int rfhip_host_register(void* ptr, size_t bytes) {
#ifdef ROCMFORGE_HIP_NVIDIA
    return (int)cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
#else
    return (int)hipHostRegister(ptr, bytes, hipHostRegisterPortable);
#endif
}
int rfhip_host_unregister(void* ptr) { return (int)hipHostUnregister(ptr); }
// The address kernels read registered (mapped) host memory at.
int rfhip_host_device_pointer(void** device, void* host) {
    *device = nullptr;
#ifdef ROCMFORGE_HIP_NVIDIA
    return (int)cudaHostGetDevicePointer(device, host, 0);
#else
    return (int)hipHostGetDevicePointer(device, host, 0);
#endif
}

int rfhip_device_props(int ordinal, rfhip_device_props_t* out) {
    memset(out, 0, sizeof(*out));
    hipDeviceProp_t prop;
    memset(&prop, 0, sizeof(prop));
    hipError_t status = hipGetDeviceProperties(&prop, ordinal);
    if (status != hipSuccess) return (int)status;
    snprintf(out->name, sizeof(out->name), "%s", prop.name);
#ifdef ROCMFORGE_HIP_NVIDIA
    snprintf(out->arch, sizeof(out->arch), "sm_%d%d", prop.major, prop.minor);
#else
    snprintf(out->arch, sizeof(out->arch), "%s", prop.gcnArchName);
#endif
    out->total_memory = prop.totalGlobalMem;
    out->multiprocessor_count = prop.multiProcessorCount;
    out->warp_size = prop.warpSize;
    out->major = prop.major;
    out->minor = prop.minor;
    out->pci_domain = prop.pciDomainID;
    out->pci_bus = prop.pciBusID;
    out->pci_device = prop.pciDeviceID;
    return (int)hipSuccess;
}

int rfhip_malloc(void** ptr, size_t bytes) {
    *ptr = NULL;
    return (int)hipMalloc(ptr, bytes);
}
int rfhip_free(void* ptr) { return (int)hipFree(ptr); }
// Portable: page-locked for every device, not only the current one.
int rfhip_host_alloc(void** ptr, size_t bytes) {
    *ptr = NULL;
    return (int)hipHostMalloc(ptr, bytes, hipHostMallocPortable);
}
int rfhip_host_free(void* ptr) { return (int)hipHostFree(ptr); }

int rfhip_memcpy_h2d_async(void* dst, const void* src, size_t bytes, void* stream) {
    return (int)hipMemcpyAsync(dst, src, bytes, hipMemcpyHostToDevice, as_stream(stream));
}
int rfhip_memcpy_d2h_async(void* dst, const void* src, size_t bytes, void* stream) {
    return (int)hipMemcpyAsync(dst, src, bytes, hipMemcpyDeviceToHost, as_stream(stream));
}
int rfhip_memcpy_d2d_async(void* dst, const void* src, size_t bytes, void* stream) {
    return (int)hipMemcpyAsync(dst, src, bytes, hipMemcpyDeviceToDevice, as_stream(stream));
}
// A copy between two devices' memory (or within one), ordered on `stream`: over the
// devices' link where peer access is on, staged through the host by the runtime otherwise.
int rfhip_memcpy_peer_async(void* dst, int dst_device, const void* src, int src_device,
                            size_t bytes, void* stream) {
    return (int)hipMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, as_stream(stream));
}
int rfhip_device_can_access_peer(int* can, int device, int peer) {
    *can = 0;
    return (int)hipDeviceCanAccessPeer(can, device, peer);
}
// Lets the current device read and write `peer`'s memory; done already is success.
int rfhip_device_enable_peer_access(int peer) {
    hipError_t status = hipDeviceEnablePeerAccess(peer, 0);
    if (status == hipErrorPeerAccessAlreadyEnabled) {
        (void)hipGetLastError();
        return (int)hipSuccess;
    }
    return (int)status;
}
int rfhip_memset_async(void* dst, int byte_value, size_t bytes, void* stream) {
    return (int)hipMemsetAsync(dst, byte_value, bytes, as_stream(stream));
}

int rfhip_stream_create(void** stream) {
    hipStream_t created = NULL;
    hipError_t status = hipStreamCreateWithFlags(&created, hipStreamNonBlocking);
    *stream = (void*)created;
    return (int)status;
}
int rfhip_stream_destroy(void* stream) { return (int)hipStreamDestroy(as_stream(stream)); }
int rfhip_stream_synchronize(void* stream) {
    return (int)hipStreamSynchronize(as_stream(stream));
}
int rfhip_stream_query(void* stream) { return (int)hipStreamQuery(as_stream(stream)); }
int rfhip_stream_wait_event(void* stream, void* event) {
    return (int)hipStreamWaitEvent(as_stream(stream), as_event(event), 0);
}

int rfhip_event_create(void** event, int enable_timing) {
    hipEvent_t created = NULL;
    hipError_t status =
        hipEventCreateWithFlags(&created, enable_timing ? hipEventDefault : hipEventDisableTiming);
    *event = (void*)created;
    return (int)status;
}
int rfhip_event_destroy(void* event) { return (int)hipEventDestroy(as_event(event)); }
int rfhip_event_record(void* event, void* stream) {
    return (int)hipEventRecord(as_event(event), as_stream(stream));
}
int rfhip_event_synchronize(void* event) { return (int)hipEventSynchronize(as_event(event)); }
int rfhip_event_query(void* event) { return (int)hipEventQuery(as_event(event)); }
int rfhip_event_elapsed_ms(float* milliseconds, void* start, void* end) {
    *milliseconds = 0.0f;
    return (int)hipEventElapsedTime(milliseconds, as_event(start), as_event(end));
}


// Graphs: the work queued on a stream between begin and end of a capture becomes a graph
// that replays with one launch. Capture is per stream (relaxed mode: other threads may
// keep using the runtime while this stream captures).
int rfhip_stream_begin_capture(void* stream) {
    return (int)hipStreamBeginCapture(as_stream(stream), hipStreamCaptureModeRelaxed);
}
// Ends the capture and instantiates the graph. On success *exec is the executable graph;
// the graph itself is released at once (the executable does not need it).
int rfhip_stream_end_capture(void* stream, void** exec) {
    *exec = NULL;
    hipGraph_t graph = NULL;
    hipError_t status = hipStreamEndCapture(as_stream(stream), &graph);
    if (status != hipSuccess) {
        if (graph != NULL) hipGraphDestroy(graph);
        return (int)status;
    }
    hipGraphExec_t instance = NULL;
#ifdef ROCMFORGE_HIP_NVIDIA
    status = cudaGraphInstantiate(&instance, graph, 0ULL);
#else
    status = hipGraphInstantiate(&instance, graph, NULL, NULL, 0);
#endif
    hipGraphDestroy(graph);
    *exec = (void*)instance;
    return (int)status;
}
int rfhip_graph_launch(void* exec, void* stream) {
    return (int)hipGraphLaunch((hipGraphExec_t)exec, as_stream(stream));
}
int rfhip_graph_destroy(void* exec) { return (int)hipGraphExecDestroy((hipGraphExec_t)exec); }

// Whether rfLaunchChained may chain launches where the device and the build allow it
// (rocmforge_hip.h): 1 unless rfhip_set_chained_launch(0) was called. Read at every
// chained launch, so a change applies from the next launch on.
static int chained_launch_allowed = 1;
void rfhip_set_chained_launch(int allowed) {
    __atomic_store_n(&chained_launch_allowed, allowed ? 1 : 0, __ATOMIC_RELAXED);
}
int rfhip_chained_launch_allowed(void) {
    return __atomic_load_n(&chained_launch_allowed, __ATOMIC_RELAXED);
}

}  // extern "C"
