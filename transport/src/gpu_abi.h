// The few entry points of the CUDA driver (libcuda.so.1) and NCCL (libnccl.so.2) that the GPU
// link calls, declared here from their stable C ABIs so that nothing links against either at
// build time: CPU builds, CI and wheels need neither library, and a process finds them at run
// time (gpu_link.cc). Only types and signatures the link uses are declared; the numeric values
// are those of the vendors' public headers, which keep them stable across releases.
#ifndef KVCOMP_TRANSPORT_SRC_GPU_ABI_H_
#define KVCOMP_TRANSPORT_SRC_GPU_ABI_H_

#include <cstddef>
#include <cstdint>

namespace kvcomp {
namespace transport {
namespace abi {

// --- CUDA driver API (cuda.h) ---
using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUdeviceptr = unsigned long long;  // NOLINT(runtime/int): the driver's own type
struct CUuuid {
  char bytes[16];
};
// CUDA IPC handles (CU_IPC_HANDLE_SIZE bytes), passed by value.
constexpr int kIpcHandleBytes = 64;
struct CUipcMemHandle {
  char reserved[kIpcHandleBytes];
};
struct CUipcEventHandle {
  char reserved[kIpcHandleBytes];
};
constexpr unsigned kIpcMemLazyEnablePeerAccess = 1;  // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
constexpr unsigned kEventInterprocess = 4;           // CU_EVENT_INTERPROCESS
constexpr CUresult kCudaSuccess = 0;
constexpr CUresult kCudaErrorNotReady = 600;
constexpr int kPointerAttributeMemoryType = 2;     // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kPointerAttributeDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr unsigned kMemoryTypeDevice = 2;          // CU_MEMORYTYPE_DEVICE
constexpr unsigned kStreamNonBlocking = 1;         // CU_STREAM_NON_BLOCKING
constexpr unsigned kEventDisableTiming = 2;        // CU_EVENT_DISABLE_TIMING

struct CudaDriver {
  CUresult (*cuInit)(unsigned flags);
  CUresult (*cuDeviceGet)(CUdevice* device, int ordinal);
  CUresult (*cuDeviceGetCount)(int* count);
  CUresult (*cuDeviceGetUuid)(CUuuid* uuid, CUdevice device);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext* ctx, CUdevice device);
  CUresult (*cuCtxSetCurrent)(CUcontext ctx);
  CUresult (*cuPointerGetAttribute)(void* data, int attribute, CUdeviceptr ptr);
  CUresult (*cuStreamCreate)(CUstream* stream, unsigned flags);
  CUresult (*cuStreamDestroy)(CUstream stream);               // cuStreamDestroy_v2
  CUresult (*cuStreamWaitEvent)(CUstream stream, CUevent event, unsigned flags);
  CUresult (*cuStreamSynchronize)(CUstream stream);
  CUresult (*cuEventCreate)(CUevent* event, unsigned flags);
  CUresult (*cuEventDestroy)(CUevent event);                  // cuEventDestroy_v2
  CUresult (*cuEventRecord)(CUevent event, CUstream stream);
  CUresult (*cuEventQuery)(CUevent event);
  CUresult (*cuEventElapsedTime)(float* ms, CUevent start, CUevent end);
  CUresult (*cuMemAlloc)(CUdeviceptr* ptr, size_t bytes);     // cuMemAlloc_v2
  CUresult (*cuMemFree)(CUdeviceptr ptr);                     // cuMemFree_v2
  CUresult (*cuMemAllocHost)(void** ptr, size_t bytes);       // cuMemAllocHost_v2
  CUresult (*cuMemFreeHost)(void* ptr);
  CUresult (*cuMemcpyDtoHAsync)(void* dst, CUdeviceptr src, size_t bytes,
                                CUstream stream);             // cuMemcpyDtoHAsync_v2
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr dst, const void* src, size_t bytes,
                                CUstream stream);             // cuMemcpyHtoDAsync_v2
  CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr dst, CUdeviceptr src, size_t bytes,
                                CUstream stream);             // cuMemcpyDtoDAsync_v2
  CUresult (*cuMemcpyPeerAsync)(CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src,
                                CUcontext src_ctx, size_t bytes, CUstream stream);
  CUresult (*cuCtxEnablePeerAccess)(CUcontext peer, unsigned flags);
  CUresult (*cuGetErrorString)(CUresult error, const char** text);
  // CUDA IPC between processes on one device (optional: bound when the driver has them).
  CUresult (*cuMemGetAddressRange)(CUdeviceptr* base, size_t* size,
                                   CUdeviceptr ptr);  // cuMemGetAddressRange_v2
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle* handle, CUdeviceptr ptr);
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr* ptr, CUipcMemHandle handle,
                                 unsigned flags);  // cuIpcOpenMemHandle_v2
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr ptr);
  CUresult (*cuIpcGetEventHandle)(CUipcEventHandle* handle, CUevent event);
  CUresult (*cuIpcOpenEventHandle)(CUevent* event, CUipcEventHandle handle);
};
constexpr CUresult kCudaErrorPeerAccessAlreadyEnabled = 704;

// --- NCCL (nccl.h), the API stable since 2.14 ---
using ncclResult_t = int;
using ncclComm_t = struct ncclComm*;
constexpr ncclResult_t kNcclSuccess = 0;
constexpr ncclResult_t kNcclInProgress = 7;
constexpr int kNcclUint8 = 1;  // ncclUint8
constexpr int kNcclUniqueIdBytes = 128;
struct ncclUniqueId {
  char internal[kNcclUniqueIdBytes];
};
// ncclConfig_t as NCCL 2.14 defines it; later releases read a config by its `version` and
// `size`, so this prefix stays valid.
struct ncclConfig {
  size_t size;
  unsigned int magic;    // 0xcafebeef
  unsigned int version;  // NCCL_VERSION(2, 14, 3)
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
};
constexpr unsigned kNcclConfigMagic = 0xcafebeef;
constexpr unsigned kNcclConfigVersion = 21403;
constexpr int kNcclConfigUndefInt = INT32_MIN;
constexpr int kNcclMinVersion = 21403;  // ncclCommInitRankConfig and non-blocking communicators

struct Nccl {
  ncclResult_t (*ncclGetVersion)(int* version);
  ncclResult_t (*ncclGetUniqueId)(ncclUniqueId* id);
  ncclResult_t (*ncclCommInitRankConfig)(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                         ncclConfig* config);
  ncclResult_t (*ncclSend)(const void* buf, size_t count, int datatype, int peer, ncclComm_t comm,
                           CUstream stream);
  ncclResult_t (*ncclRecv)(void* buf, size_t count, int datatype, int peer, ncclComm_t comm,
                           CUstream stream);
  ncclResult_t (*ncclGroupStart)();
  ncclResult_t (*ncclGroupEnd)();
  ncclResult_t (*ncclCommGetAsyncError)(ncclComm_t comm, ncclResult_t* state);
  ncclResult_t (*ncclCommAbort)(ncclComm_t comm);
  ncclResult_t (*ncclCommDestroy)(ncclComm_t comm);
  const char* (*ncclGetErrorString)(ncclResult_t result);
};

}  // namespace abi
}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_SRC_GPU_ABI_H_
