#include "kvcomp/transport/gpu_link.h"

#include <dlfcn.h>
#include <glob.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "transport/src/gpu_abi.h"

namespace kvcomp {
namespace transport {

namespace {

using abi::CUcontext;
using abi::CUdeviceptr;
using abi::CUevent;
using abi::CUstream;

template <typename Fn>
bool Bind(void* handle, const char* name, Fn* fn, std::string* missing) {
  void* sym = dlsym(handle, name);
  if (sym == nullptr) {
    if (!missing->empty()) missing->append(", ");
    missing->append(name);
    return false;
  }
  *fn = reinterpret_cast<Fn>(sym);
  return true;
}

std::string DlError() {
  const char* e = dlerror();
  return e == nullptr ? "unknown error" : e;
}

// Where PyTorch's NCCL wheel (nvidia-nccl-cu*) puts the library, under a few usual prefixes.
std::vector<std::string> PythonNcclCandidates() {
  std::vector<std::string> patterns;
  auto prefix = [&patterns](const std::string& p) {
    if (p.empty()) return;
    for (const char* dir : {"site-packages", "dist-packages"}) {
      patterns.push_back(absl::StrCat(p, "/lib/python3*/", dir, "/nvidia/nccl/lib/libnccl.so.2"));
    }
  };
  for (const char* env : {"VIRTUAL_ENV", "CONDA_PREFIX"}) {
    if (const char* v = std::getenv(env)) prefix(v);
  }
  prefix("/usr/local");
  prefix("/usr");
  if (const char* home = std::getenv("HOME")) prefix(absl::StrCat(home, "/.local"));
  if (const char* pp = std::getenv("PYTHONPATH")) {
    for (absl::string_view entry : absl::StrSplit(pp, ':', absl::SkipEmpty())) {
      patterns.push_back(absl::StrCat(entry, "/nvidia/nccl/lib/libnccl.so.2"));
    }
  }
  std::vector<std::string> out;
  for (const std::string& pattern : patterns) {
    glob_t g;
    if (glob(pattern.c_str(), 0, nullptr, &g) == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) out.push_back(g.gl_pathv[i]);
    }
    globfree(&g);
  }
  return out;
}

struct NcclLibrary {
  absl::Status status = absl::FailedPreconditionError("NCCL not loaded");
  abi::Nccl api{};
  int version = 0;
  std::string path;
};

absl::Status BindNccl(void* handle, NcclLibrary* lib) {
  std::string missing;
  abi::Nccl& n = lib->api;
  Bind(handle, "ncclGetVersion", &n.ncclGetVersion, &missing);
  Bind(handle, "ncclGetUniqueId", &n.ncclGetUniqueId, &missing);
  Bind(handle, "ncclCommInitRankConfig", &n.ncclCommInitRankConfig, &missing);
  Bind(handle, "ncclSend", &n.ncclSend, &missing);
  Bind(handle, "ncclRecv", &n.ncclRecv, &missing);
  Bind(handle, "ncclGroupStart", &n.ncclGroupStart, &missing);
  Bind(handle, "ncclGroupEnd", &n.ncclGroupEnd, &missing);
  Bind(handle, "ncclCommGetAsyncError", &n.ncclCommGetAsyncError, &missing);
  Bind(handle, "ncclCommAbort", &n.ncclCommAbort, &missing);
  Bind(handle, "ncclCommDestroy", &n.ncclCommDestroy, &missing);
  Bind(handle, "ncclGetErrorString", &n.ncclGetErrorString, &missing);
  if (!missing.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(lib->path, " is not a usable NCCL (missing ", missing, ")"));
  }
  if (n.ncclGetVersion(&lib->version) != abi::kNcclSuccess) {
    return absl::FailedPreconditionError(absl::StrCat(lib->path, ": ncclGetVersion failed"));
  }
  if (lib->version < abi::kNcclMinVersion) {
    return absl::FailedPreconditionError(absl::StrCat(lib->path, " is NCCL ", lib->version,
                                                      "; 2.14.3 or later is needed"));
  }
  return absl::OkStatus();
}

NcclLibrary LoadNcclLibrary() {
  NcclLibrary lib;
  std::vector<std::string> candidates;
  std::string tried;
  if (const char* env = std::getenv("KVCOMP_NCCL_LIBRARY"); env != nullptr && *env != '\0') {
    candidates.push_back(env);  // named explicitly: only there
  } else {
    candidates.push_back("libnccl.so.2");
    for (std::string& c : PythonNcclCandidates()) candidates.push_back(std::move(c));
  }
  for (const std::string& c : candidates) {
    void* handle = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      absl::StrAppend(&tried, tried.empty() ? "" : "; ", DlError());
      continue;
    }
    lib.path = c;
    lib.status = BindNccl(handle, &lib);
    if (lib.status.ok()) return lib;
    absl::StrAppend(&tried, tried.empty() ? "" : "; ", lib.status.message());
    dlclose(handle);
  }
  lib.path.clear();
  lib.version = 0;
  lib.status = absl::FailedPreconditionError(
      absl::StrCat("NCCL not found (KVCOMP_NCCL_LIBRARY, the loader path, Python's "
                   "nvidia/nccl/lib): ",
                   tried));
  return lib;
}

NcclLibrary& Nccl() {
  static NcclLibrary* lib = new NcclLibrary(LoadNcclLibrary());
  return *lib;
}

// Poll interval while waiting for the GPU: short at first, then up to 1 ms.
void Backoff(int* spins) {
  if (++*spins < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(std::min(1000, *spins * 4)));
  }
}

}  // namespace

struct GpuRuntime::Api {
  abi::CudaDriver cu{};
  absl::Mutex mu;
  std::vector<CUcontext> contexts ABSL_GUARDED_BY(mu);
};

absl::StatusOr<GpuRuntime*> GpuRuntime::Get() {
  static absl::StatusOr<GpuRuntime*>* runtime = [] {
    auto* rt = new GpuRuntime();
    absl::Status s = rt->Init();
    if (!s.ok()) {
      delete rt;
      return new absl::StatusOr<GpuRuntime*>(s);
    }
    return new absl::StatusOr<GpuRuntime*>(rt);
  }();
  return *runtime;
}

absl::Status GpuRuntime::Init() {
  cuda_handle_ = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (cuda_handle_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA driver (libcuda.so.1): ", DlError()));
  }
  api_ = std::make_unique<Api>();
  abi::CudaDriver& c = api_->cu;
  std::string missing;
  Bind(cuda_handle_, "cuInit", &c.cuInit, &missing);
  Bind(cuda_handle_, "cuDeviceGet", &c.cuDeviceGet, &missing);
  Bind(cuda_handle_, "cuDeviceGetCount", &c.cuDeviceGetCount, &missing);
  Bind(cuda_handle_, "cuDeviceGetUuid", &c.cuDeviceGetUuid, &missing);
  Bind(cuda_handle_, "cuDevicePrimaryCtxRetain", &c.cuDevicePrimaryCtxRetain, &missing);
  Bind(cuda_handle_, "cuCtxSetCurrent", &c.cuCtxSetCurrent, &missing);
  Bind(cuda_handle_, "cuPointerGetAttribute", &c.cuPointerGetAttribute, &missing);
  Bind(cuda_handle_, "cuStreamCreate", &c.cuStreamCreate, &missing);
  Bind(cuda_handle_, "cuStreamDestroy_v2", &c.cuStreamDestroy, &missing);
  Bind(cuda_handle_, "cuStreamWaitEvent", &c.cuStreamWaitEvent, &missing);
  Bind(cuda_handle_, "cuStreamSynchronize", &c.cuStreamSynchronize, &missing);
  Bind(cuda_handle_, "cuEventCreate", &c.cuEventCreate, &missing);
  Bind(cuda_handle_, "cuEventDestroy_v2", &c.cuEventDestroy, &missing);
  Bind(cuda_handle_, "cuEventRecord", &c.cuEventRecord, &missing);
  Bind(cuda_handle_, "cuEventQuery", &c.cuEventQuery, &missing);
  Bind(cuda_handle_, "cuEventElapsedTime", &c.cuEventElapsedTime, &missing);
  Bind(cuda_handle_, "cuMemAlloc_v2", &c.cuMemAlloc, &missing);
  Bind(cuda_handle_, "cuMemFree_v2", &c.cuMemFree, &missing);
  Bind(cuda_handle_, "cuMemAllocHost_v2", &c.cuMemAllocHost, &missing);
  Bind(cuda_handle_, "cuMemFreeHost", &c.cuMemFreeHost, &missing);
  Bind(cuda_handle_, "cuMemcpyDtoHAsync_v2", &c.cuMemcpyDtoHAsync, &missing);
  Bind(cuda_handle_, "cuMemcpyHtoDAsync_v2", &c.cuMemcpyHtoDAsync, &missing);
  Bind(cuda_handle_, "cuMemcpyDtoDAsync_v2", &c.cuMemcpyDtoDAsync, &missing);
  Bind(cuda_handle_, "cuMemcpyPeerAsync", &c.cuMemcpyPeerAsync, &missing);
  Bind(cuda_handle_, "cuCtxEnablePeerAccess", &c.cuCtxEnablePeerAccess, &missing);
  Bind(cuda_handle_, "cuGetErrorString", &c.cuGetErrorString, &missing);
  if (!missing.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("libcuda.so.1 lacks ", missing, " (driver too old)"));
  }
  std::string no_ipc;
  Bind(cuda_handle_, "cuMemGetAddressRange_v2", &c.cuMemGetAddressRange, &no_ipc);
  Bind(cuda_handle_, "cuIpcGetMemHandle", &c.cuIpcGetMemHandle, &no_ipc);
  Bind(cuda_handle_, "cuIpcOpenMemHandle_v2", &c.cuIpcOpenMemHandle, &no_ipc);
  Bind(cuda_handle_, "cuIpcCloseMemHandle", &c.cuIpcCloseMemHandle, &no_ipc);
  Bind(cuda_handle_, "cuIpcGetEventHandle", &c.cuIpcGetEventHandle, &no_ipc);
  Bind(cuda_handle_, "cuIpcOpenEventHandle", &c.cuIpcOpenEventHandle, &no_ipc);
  has_ipc_ = no_ipc.empty();
  if (int r = c.cuInit(0); r != abi::kCudaSuccess) {
    return absl::UnavailableError(CudaError(r, "no usable CUDA device: cuInit").message());
  }
  if (int r = c.cuDeviceGetCount(&device_count_); r != abi::kCudaSuccess || device_count_ < 1) {
    return absl::UnavailableError("no CUDA device present");
  }
  std::vector<CUcontext> contexts(static_cast<size_t>(device_count_), nullptr);
  absl::MutexLock lock(&api_->mu);
  api_->contexts = std::move(contexts);
  return absl::OkStatus();
}

absl::Status GpuRuntime::CudaError(int result, const char* what) const {
  const char* text = nullptr;
  if (api_ && api_->cu.cuGetErrorString) api_->cu.cuGetErrorString(result, &text);
  return absl::InternalError(
      absl::StrCat(what, ": CUDA error ", result, text ? absl::StrCat(" (", text, ")") : ""));
}

#define KVCOMP_CU(call, what)                                      \
  do {                                                             \
    if (int kvcomp_cu_r = (call); kvcomp_cu_r != abi::kCudaSuccess) \
      return CudaError(kvcomp_cu_r, what);                         \
  } while (0)

absl::Status GpuRuntime::LoadNccl() { return Nccl().status; }
int GpuRuntime::nccl_version() { return Nccl().status.ok() ? Nccl().version : 0; }
std::string GpuRuntime::nccl_path() { return Nccl().status.ok() ? Nccl().path : ""; }

absl::Status GpuRuntime::SetDevice(int device) {
  if (device < 0 || device >= device_count_) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", device, " out of range (", device_count_, " present)"));
  }
  CUcontext ctx;
  {
    absl::MutexLock lock(&api_->mu);
    ctx = api_->contexts[static_cast<size_t>(device)];
    if (ctx == nullptr) {
      abi::CUdevice dev;
      KVCOMP_CU(api_->cu.cuDeviceGet(&dev, device), "cuDeviceGet");
      KVCOMP_CU(api_->cu.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
      api_->contexts[static_cast<size_t>(device)] = ctx;  // kept for the process's life
    }
  }
  KVCOMP_CU(api_->cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  return absl::OkStatus();
}

absl::StatusOr<int> GpuRuntime::DeviceOf(const void* ptr) {
  if (ptr == nullptr) return absl::InvalidArgumentError("null pointer");
  unsigned type = 0;
  const auto p = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr));
  if (api_->cu.cuPointerGetAttribute(&type, abi::kPointerAttributeMemoryType, p) !=
          abi::kCudaSuccess ||
      type != abi::kMemoryTypeDevice) {
    return absl::InvalidArgumentError("not CUDA device memory");
  }
  int ordinal = -1;
  KVCOMP_CU(api_->cu.cuPointerGetAttribute(&ordinal, abi::kPointerAttributeDeviceOrdinal, p),
            "cuPointerGetAttribute(device ordinal)");
  return ordinal;
}

absl::StatusOr<std::string> GpuRuntime::DeviceUuid(int device) {
  if (device < 0 || device >= device_count_) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device, " out of range"));
  }
  abi::CUdevice dev;
  KVCOMP_CU(api_->cu.cuDeviceGet(&dev, device), "cuDeviceGet");
  abi::CUuuid uuid;
  KVCOMP_CU(api_->cu.cuDeviceGetUuid(&uuid, dev), "cuDeviceGetUuid");
  return std::string(uuid.bytes, sizeof(uuid.bytes));
}

absl::StatusOr<std::string> GpuRuntime::NewUniqueId() {
  KVCOMP_RETURN_IF_ERROR(LoadNccl());
  abi::ncclUniqueId id;
  const int r = Nccl().api.ncclGetUniqueId(&id);
  if (r != abi::kNcclSuccess) {
    return absl::UnavailableError(
        absl::StrCat("ncclGetUniqueId: ", Nccl().api.ncclGetErrorString(r)));
  }
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<void*> GpuRuntime::AllocDevice(size_t bytes) {
  CUdeviceptr p = 0;
  if (int r = api_->cu.cuMemAlloc(&p, std::max<size_t>(bytes, 1)); r != abi::kCudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat(CudaError(r, "cuMemAlloc").message(), " of ", bytes, " bytes"));
  }
  return reinterpret_cast<void*>(static_cast<uintptr_t>(p));
}

void GpuRuntime::FreeDevice(void* ptr) {
  if (ptr != nullptr) api_->cu.cuMemFree(static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr)));
}

absl::StatusOr<void*> GpuRuntime::AllocPinned(size_t bytes) {
  void* p = nullptr;
  if (int r = api_->cu.cuMemAllocHost(&p, std::max<size_t>(bytes, 1)); r != abi::kCudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat(CudaError(r, "cuMemAllocHost").message(), " of ", bytes, " bytes"));
  }
  return p;
}

void GpuRuntime::FreePinned(void* ptr) {
  if (ptr != nullptr) api_->cu.cuMemFreeHost(ptr);
}

absl::StatusOr<void*> GpuRuntime::NewStream() {
  CUstream s = nullptr;
  KVCOMP_CU(api_->cu.cuStreamCreate(&s, abi::kStreamNonBlocking), "cuStreamCreate");
  return static_cast<void*>(s);
}

void GpuRuntime::DestroyStream(void* stream) {
  if (stream != nullptr) api_->cu.cuStreamDestroy(static_cast<CUstream>(stream));
}

absl::Status GpuRuntime::CopyAsync(void* dst, const void* src, size_t bytes, Copy kind,
                                   void* stream) {
  if (bytes == 0) return absl::OkStatus();
  auto dev = [](const void* p) { return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p)); };
  auto s = static_cast<CUstream>(stream);
  switch (kind) {
    case Copy::kDeviceToHost:
      KVCOMP_CU(api_->cu.cuMemcpyDtoHAsync(dst, dev(src), bytes, s), "cuMemcpyDtoHAsync");
      break;
    case Copy::kHostToDevice:
      KVCOMP_CU(api_->cu.cuMemcpyHtoDAsync(dev(dst), src, bytes, s), "cuMemcpyHtoDAsync");
      break;
    case Copy::kDeviceToDevice:
      KVCOMP_CU(api_->cu.cuMemcpyDtoDAsync(dev(dst), dev(src), bytes, s), "cuMemcpyDtoDAsync");
      break;
  }
  return absl::OkStatus();
}

absl::Status GpuRuntime::CopyPeerAsync(void* dst, int dst_device, const void* src,
                                       int src_device, size_t bytes, void* stream) {
  // SetDevice retains both primary contexts; the source's stays current.
  KVCOMP_RETURN_IF_ERROR(SetDevice(dst_device));
  KVCOMP_RETURN_IF_ERROR(SetDevice(src_device));
  CUcontext dctx, sctx;
  {
    absl::MutexLock lock(&api_->mu);
    dctx = api_->contexts[static_cast<size_t>(dst_device)];
    sctx = api_->contexts[static_cast<size_t>(src_device)];
  }
  auto dev = [](const void* p) { return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p)); };
  KVCOMP_CU(api_->cu.cuMemcpyPeerAsync(dev(dst), dctx, dev(src), sctx, bytes,
                                       static_cast<CUstream>(stream)),
            "cuMemcpyPeerAsync");
  return absl::OkStatus();
}

absl::Status GpuRuntime::EnablePeerAccess(int device, int peer) {
  KVCOMP_RETURN_IF_ERROR(SetDevice(peer));
  KVCOMP_RETURN_IF_ERROR(SetDevice(device));
  CUcontext ctx;
  {
    absl::MutexLock lock(&api_->mu);
    ctx = api_->contexts[static_cast<size_t>(peer)];
  }
  const int r = api_->cu.cuCtxEnablePeerAccess(ctx, 0);
  if (r != abi::kCudaSuccess && r != abi::kCudaErrorPeerAccessAlreadyEnabled) {
    return CudaError(r, "cuCtxEnablePeerAccess");
  }
  return absl::OkStatus();
}

absl::Status GpuRuntime::StreamWaitStream(void* waiter, void* producer) {
  CUevent ev = nullptr;
  KVCOMP_CU(api_->cu.cuEventCreate(&ev, abi::kEventDisableTiming), "cuEventCreate");
  int r = api_->cu.cuEventRecord(ev, static_cast<CUstream>(producer));
  if (r == abi::kCudaSuccess) r = api_->cu.cuStreamWaitEvent(static_cast<CUstream>(waiter), ev, 0);
  api_->cu.cuEventDestroy(ev);  // released once the wait is done
  KVCOMP_CU(r, "cuStreamWaitEvent");
  return absl::OkStatus();
}

absl::Status GpuRuntime::WaitEvent(void* event, absl::Time deadline,
                                   const std::function<absl::Status()>& poll) {
  int spins = 0;
  for (;;) {
    const int r = api_->cu.cuEventQuery(static_cast<CUevent>(event));
    if (r == abi::kCudaSuccess) return absl::OkStatus();
    if (r != abi::kCudaErrorNotReady) return CudaError(r, "cuEventQuery");
    if (poll) KVCOMP_RETURN_IF_ERROR(poll());
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError("GPU work did not finish in time");
    }
    Backoff(&spins);
  }
}

absl::Status GpuRuntime::WaitStream(void* stream, absl::Time deadline) {
  CUevent ev = nullptr;
  KVCOMP_CU(api_->cu.cuEventCreate(&ev, abi::kEventDisableTiming), "cuEventCreate");
  absl::Status s;
  if (int r = api_->cu.cuEventRecord(ev, static_cast<CUstream>(stream)); r != abi::kCudaSuccess) {
    s = CudaError(r, "cuEventRecord");
  } else {
    s = WaitEvent(ev, deadline, nullptr);
  }
  api_->cu.cuEventDestroy(ev);
  return s;
}

absl::StatusOr<GpuRuntime::ExportedMemory> GpuRuntime::ExportMemory(const void* ptr) {
  if (!has_ipc_) return absl::FailedPreconditionError("the CUDA driver has no IPC entry points");
  KVCOMP_ASSIGN_OR_RETURN(int device, DeviceOf(ptr));
  KVCOMP_RETURN_IF_ERROR(SetDevice(device));
  const auto p = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr));
  CUdeviceptr base = 0;
  size_t size = 0;
  if (int r = api_->cu.cuMemGetAddressRange(&base, &size, p); r != abi::kCudaSuccess) {
    return absl::InvalidArgumentError(CudaError(r, "cuMemGetAddressRange").message());
  }
  abi::CUipcMemHandle h;
  if (int r = api_->cu.cuIpcGetMemHandle(&h, base); r != abi::kCudaSuccess) {
    return absl::FailedPreconditionError(CudaError(r, "cuIpcGetMemHandle").message());
  }
  ExportedMemory out;
  out.handle.assign(h.reserved, sizeof(h.reserved));
  out.offset = static_cast<size_t>(p - base);
  out.allocation_bytes = size;
  return out;
}

absl::StatusOr<void*> GpuRuntime::OpenMemory(const std::string& handle, size_t* bytes) {
  if (!has_ipc_) return absl::FailedPreconditionError("the CUDA driver has no IPC entry points");
  if (handle.size() != abi::kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA IPC memory handle of ", handle.size(),
                                                   " bytes; ", abi::kIpcHandleBytes,
                                                   " expected"));
  }
  abi::CUipcMemHandle h;
  std::memcpy(h.reserved, handle.data(), sizeof(h.reserved));
  CUdeviceptr p = 0;
  if (int r = api_->cu.cuIpcOpenMemHandle(&p, h, abi::kIpcMemLazyEnablePeerAccess);
      r != abi::kCudaSuccess) {
    return absl::FailedPreconditionError(CudaError(r, "cuIpcOpenMemHandle").message());
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  if (int r = api_->cu.cuMemGetAddressRange(&base, &size, p); r != abi::kCudaSuccess) {
    api_->cu.cuIpcCloseMemHandle(p);
    return CudaError(r, "cuMemGetAddressRange");
  }
  *bytes = size - static_cast<size_t>(p - base);
  return reinterpret_cast<void*>(static_cast<uintptr_t>(p));
}

void GpuRuntime::CloseMemory(void* ptr) {
  if (ptr != nullptr && has_ipc_) {
    api_->cu.cuIpcCloseMemHandle(static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr)));
  }
}

absl::StatusOr<void*> GpuRuntime::NewIpcEvent(std::string* handle) {
  if (!has_ipc_) return absl::FailedPreconditionError("the CUDA driver has no IPC entry points");
  CUevent ev = nullptr;
  KVCOMP_CU(api_->cu.cuEventCreate(&ev, abi::kEventDisableTiming | abi::kEventInterprocess),
            "cuEventCreate(interprocess)");
  abi::CUipcEventHandle h;
  if (int r = api_->cu.cuIpcGetEventHandle(&h, ev); r != abi::kCudaSuccess) {
    api_->cu.cuEventDestroy(ev);
    return CudaError(r, "cuIpcGetEventHandle");
  }
  handle->assign(h.reserved, sizeof(h.reserved));
  return static_cast<void*>(ev);
}

absl::StatusOr<void*> GpuRuntime::NewEvent() {
  CUevent ev = nullptr;
  KVCOMP_CU(api_->cu.cuEventCreate(&ev, abi::kEventDisableTiming), "cuEventCreate");
  return static_cast<void*>(ev);
}

absl::StatusOr<void*> GpuRuntime::OpenEvent(const std::string& handle) {
  if (!has_ipc_) return absl::FailedPreconditionError("the CUDA driver has no IPC entry points");
  if (handle.size() != abi::kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA IPC event handle of ", handle.size(),
                                                   " bytes; ", abi::kIpcHandleBytes,
                                                   " expected"));
  }
  abi::CUipcEventHandle h;
  std::memcpy(h.reserved, handle.data(), sizeof(h.reserved));
  CUevent ev = nullptr;
  if (int r = api_->cu.cuIpcOpenEventHandle(&ev, h); r != abi::kCudaSuccess) {
    return absl::FailedPreconditionError(CudaError(r, "cuIpcOpenEventHandle").message());
  }
  return static_cast<void*>(ev);
}

void GpuRuntime::DestroyEvent(void* event) {
  if (event != nullptr) api_->cu.cuEventDestroy(static_cast<CUevent>(event));
}

absl::Status GpuRuntime::RecordEvent(void* event, void* stream) {
  KVCOMP_CU(api_->cu.cuEventRecord(static_cast<CUevent>(event), static_cast<CUstream>(stream)),
            "cuEventRecord");
  return absl::OkStatus();
}

absl::Status GpuRuntime::StreamWaitEvent(void* stream, void* event) {
  KVCOMP_CU(api_->cu.cuStreamWaitEvent(static_cast<CUstream>(stream), static_cast<CUevent>(event), 0),
            "cuStreamWaitEvent");
  return absl::OkStatus();
}

GpuRuntime::Timer::~Timer() {
  if (start_) rt_->api_->cu.cuEventDestroy(static_cast<CUevent>(start_));
  if (stop_) rt_->api_->cu.cuEventDestroy(static_cast<CUevent>(stop_));
}

absl::StatusOr<std::unique_ptr<GpuRuntime::Timer>> GpuRuntime::NewTimer() {
  std::unique_ptr<Timer> t(new Timer(this));
  CUevent a = nullptr, b = nullptr;
  KVCOMP_CU(api_->cu.cuEventCreate(&a, 0), "cuEventCreate");
  t->start_ = a;
  KVCOMP_CU(api_->cu.cuEventCreate(&b, 0), "cuEventCreate");
  t->stop_ = b;
  return t;
}

absl::Status GpuRuntime::Timer::Start(void* stream) {
  if (int r = rt_->api_->cu.cuEventRecord(static_cast<CUevent>(start_), static_cast<CUstream>(stream));
      r != abi::kCudaSuccess) {
    return rt_->CudaError(r, "cuEventRecord");
  }
  return absl::OkStatus();
}

absl::Status GpuRuntime::Timer::Stop(void* stream) {
  if (int r = rt_->api_->cu.cuEventRecord(static_cast<CUevent>(stop_), static_cast<CUstream>(stream));
      r != abi::kCudaSuccess) {
    return rt_->CudaError(r, "cuEventRecord");
  }
  return absl::OkStatus();
}

absl::StatusOr<double> GpuRuntime::Timer::Seconds(absl::Time deadline) {
  KVCOMP_RETURN_IF_ERROR(rt_->WaitEvent(stop_, deadline, nullptr));
  float ms = 0;
  if (int r = rt_->api_->cu.cuEventElapsedTime(&ms, static_cast<CUevent>(start_),
                                               static_cast<CUevent>(stop_));
      r != abi::kCudaSuccess) {
    return rt_->CudaError(r, "cuEventElapsedTime");
  }
  return ms / 1e3;
}

// ---------------------------------------------------------------------------------------------

absl::Status NcclLink::NcclError(int result, const char* what) const {
  return absl::UnavailableError(
      absl::StrCat(what, ": NCCL error ", result, " (", Nccl().api.ncclGetErrorString(result), ")"));
}

absl::StatusOr<std::unique_ptr<NcclLink>> NcclLink::Join(const std::string& unique_id, int rank,
                                                         int device, absl::Duration timeout) {
  KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, GpuRuntime::Get());
  KVCOMP_RETURN_IF_ERROR(rt->LoadNccl());
  if (unique_id.size() != abi::kNcclUniqueIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL unique id of ", unique_id.size(),
                                                   " bytes; ", abi::kNcclUniqueIdBytes,
                                                   " expected"));
  }
  if (rank != 0 && rank != 1) return absl::InvalidArgumentError("rank must be 0 or 1");
  KVCOMP_RETURN_IF_ERROR(rt->SetDevice(device));
  const abi::Nccl& n = Nccl().api;
  abi::ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  abi::ncclConfig config{sizeof(abi::ncclConfig),
                         abi::kNcclConfigMagic,
                         abi::kNcclConfigVersion,
                         /*blocking=*/0,
                         abi::kNcclConfigUndefInt,
                         abi::kNcclConfigUndefInt,
                         abi::kNcclConfigUndefInt,
                         nullptr};
  abi::ncclComm_t comm = nullptr;
  int r = n.ncclCommInitRankConfig(&comm, 2, id, rank, &config);
  if (r != abi::kNcclSuccess && r != abi::kNcclInProgress) {
    if (comm != nullptr) n.ncclCommAbort(comm);
    return absl::UnavailableError(
        absl::StrCat("ncclCommInitRankConfig: NCCL error ", r, " (", n.ncclGetErrorString(r), ")"));
  }
  std::unique_ptr<NcclLink> link(new NcclLink(rt, comm, device, rank));
  const absl::Time deadline = absl::Now() + timeout;
  int spins = 0;
  for (;;) {
    abi::ncclResult_t state = abi::kNcclSuccess;
    r = n.ncclCommGetAsyncError(comm, &state);
    if (r != abi::kNcclSuccess) state = r;
    if (state == abi::kNcclSuccess) break;
    if (state != abi::kNcclInProgress) {
      link->Abort();
      return link->NcclError(state, "forming the NCCL communicator");
    }
    if (absl::Now() > deadline) {
      link->Abort();
      return absl::DeadlineExceededError(absl::StrCat(
          "the NCCL communicator did not form within ", absl::FormatDuration(timeout),
          " (peer not reachable?)"));
    }
    Backoff(&spins);
  }
  return link;
}

NcclLink::~NcclLink() {
  // Abort, not destroy: ncclCommDestroy may wait on the peer's side of the connections, and a
  // peer that is gone must not hold the caller; with nothing in flight, abort only frees.
  Abort();
}

void NcclLink::Abort() {
  broken_ = true;
  if (comm_ == nullptr) return;
  (void)rt_->SetDevice(device_);
  Nccl().api.ncclCommAbort(static_cast<abi::ncclComm_t>(comm_));
  comm_ = nullptr;
}

absl::Status NcclLink::AsyncError() {
  abi::ncclResult_t state = abi::kNcclSuccess;
  int r = Nccl().api.ncclCommGetAsyncError(static_cast<abi::ncclComm_t>(comm_), &state);
  if (r != abi::kNcclSuccess) state = r;
  if (state == abi::kNcclSuccess || state == abi::kNcclInProgress) return absl::OkStatus();
  return NcclError(state, "NCCL transfer");
}

absl::Status NcclLink::Post(absl::Span<const Chunk> chunks, void* stream, bool send) {
  if (broken_ || comm_ == nullptr) {
    return absl::UnavailableError("the NCCL link is broken (aborted after an earlier failure)");
  }
  KVCOMP_RETURN_IF_ERROR(rt_->SetDevice(device_));
  const abi::Nccl& n = Nccl().api;
  auto comm = static_cast<abi::ncclComm_t>(comm_);
  const int peer = 1 - rank_;
  n.ncclGroupStart();
  int r = abi::kNcclSuccess;
  for (const Chunk& c : chunks) {
    if (c.bytes == 0) continue;
    r = send ? n.ncclSend(c.data, c.bytes, abi::kNcclUint8, peer, comm, static_cast<CUstream>(stream))
             : n.ncclRecv(c.data, c.bytes, abi::kNcclUint8, peer, comm, static_cast<CUstream>(stream));
    if (r != abi::kNcclSuccess && r != abi::kNcclInProgress) break;
  }
  const int end = n.ncclGroupEnd();
  if (r == abi::kNcclSuccess || r == abi::kNcclInProgress) r = end;
  pending_ = true;
  if (r != abi::kNcclSuccess && r != abi::kNcclInProgress) {
    absl::Status s = NcclError(r, send ? "ncclSend" : "ncclRecv");
    Abort();
    return s;
  }
  // A non-blocking communicator may still be enqueueing the group (the first transfer between
  // the two ranks also connects them, which needs the peer to post its side): Enqueued waits.
  enqueuing_ = r == abi::kNcclInProgress;
  return absl::OkStatus();
}

absl::Status NcclLink::Enqueued(absl::Time deadline) {
  if (broken_ || comm_ == nullptr) {
    return absl::UnavailableError("the NCCL link is broken (aborted after an earlier failure)");
  }
  if (!enqueuing_) return absl::OkStatus();
  const abi::Nccl& n = Nccl().api;
  int spins = 0;
  for (;;) {
    abi::ncclResult_t state = abi::kNcclSuccess;
    int r = n.ncclCommGetAsyncError(static_cast<abi::ncclComm_t>(comm_), &state);
    if (r != abi::kNcclSuccess) state = r;
    if (state == abi::kNcclSuccess) {
      enqueuing_ = false;
      return absl::OkStatus();
    }
    if (state != abi::kNcclInProgress) {
      absl::Status s = NcclError(state, "enqueueing the NCCL transfer");
      Abort();
      return s;
    }
    if (absl::Now() > deadline) {
      Abort();
      return absl::DeadlineExceededError(
          "NCCL did not enqueue the transfer in time (the peer did not post its side); the "
          "communicator was aborted");
    }
    Backoff(&spins);
  }
}

absl::Status NcclLink::Send(absl::Span<const Chunk> chunks, void* stream) {
  return Post(chunks, stream, /*send=*/true);
}

absl::Status NcclLink::Recv(absl::Span<const Chunk> chunks, void* stream) {
  return Post(chunks, stream, /*send=*/false);
}

absl::Status NcclLink::Wait(void* stream, absl::Time deadline) {
  if (broken_ || comm_ == nullptr) {
    return absl::UnavailableError("the NCCL link is broken (aborted after an earlier failure)");
  }
  KVCOMP_RETURN_IF_ERROR(rt_->SetDevice(device_));
  KVCOMP_RETURN_IF_ERROR(Enqueued(deadline));  // the event must follow the transfer
  CUevent ev = nullptr;
  if (int r = rt_->api_->cu.cuEventCreate(&ev, abi::kEventDisableTiming); r != abi::kCudaSuccess) {
    return rt_->CudaError(r, "cuEventCreate");
  }
  absl::Status s;
  if (int r = rt_->api_->cu.cuEventRecord(ev, static_cast<CUstream>(stream));
      r != abi::kCudaSuccess) {
    s = rt_->CudaError(r, "cuEventRecord");
  } else {
    s = rt_->WaitEvent(ev, deadline, [this] { return AsyncError(); });
  }
  if (s.ok()) {
    pending_ = false;
  } else {
    // A peer that died or stalls: abort, which ends our kernels, and let the stream drain.
    Abort();
    (void)rt_->WaitEvent(ev, absl::Now() + absl::Seconds(10), nullptr);
    if (absl::IsDeadlineExceeded(s)) {
      s = absl::DeadlineExceededError(
          "GPU transfer did not finish in time; the NCCL communicator was aborted");
    }
  }
  rt_->api_->cu.cuEventDestroy(ev);
  return s;
}

namespace {

// Copies `n` layers' spans of `bytes` each from `from` (one after another) to `to[l]`, one copy
// per layer: destinations that lie next to each other may still be separate allocations, and
// the driver refuses a copy that spans two.
absl::Status CopyLayers(GpuRuntime* rt, const uint8_t* from, absl::Span<void* const> to,
                        uint64_t bytes, void* stream) {
  for (size_t l = 0; l < to.size(); ++l) {
    KVCOMP_RETURN_IF_ERROR(rt->CopyAsync(to[l], from + l * bytes, bytes,
                                         GpuRuntime::Copy::kDeviceToDevice, stream));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<bool> CopyDenseKv(GpuRuntime* rt, const void* stored, uint64_t stored_bytes,
                                 const KvLayout& layout, uint64_t num_tokens,
                                 absl::Span<void* const> keys, absl::Span<void* const> values,
                                 void* stream, absl::Time deadline) {
  if (keys.size() != layout.num_layers || values.size() != layout.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("dense K/V of ", layout.num_layers,
                                                   " layers into ", keys.size(), " and ",
                                                   values.size(), " destinations"));
  }
  // The header and the section table (at most 64 sections) say where the two sections lie.
  std::string head(std::min<uint64_t>(stored_bytes, format::kHeaderBytes +
                                                        64 * format::kSectionEntryBytes),
                   '\0');
  KVCOMP_RETURN_IF_ERROR(rt->CopyAsync(head.data(), stored, head.size(),
                                       GpuRuntime::Copy::kDeviceToHost, stream));
  KVCOMP_RETURN_IF_ERROR(rt->WaitStream(stream, deadline));
  absl::StatusOr<format::DenseSections> dense = format::DenseKvSections(head, stored_bytes);
  if (!dense.ok() || dense->info.original_tokens != num_tokens || dense->info.layout != layout) {
    return false;
  }
  const uint64_t layer_bytes = layout.LayerBytes(num_tokens);
  const auto* from = static_cast<const uint8_t*>(stored);
  KVCOMP_RETURN_IF_ERROR(CopyLayers(rt, from + dense->keys.offset, keys, layer_bytes, stream));
  KVCOMP_RETURN_IF_ERROR(
      CopyLayers(rt, from + dense->values.offset, values, layer_bytes, stream));
  // The copies read `stored`: done before the caller frees it.
  KVCOMP_RETURN_IF_ERROR(rt->WaitStream(stream, deadline));
  return true;
}

absl::StatusOr<Registration> NcclPayloadLink::Register(const MemoryRegion& region) {
  if (region.kind != MemoryKind::kCuda) {
    return MemoryNotServed(kind(), region.kind, "NCCL moves device memory");
  }
  return Registration{region, ""};
}

absl::StatusOr<std::shared_ptr<Completion>> NcclPayloadLink::Post(const Transfer& t) {
  if (!t.peer.empty()) {
    return absl::InvalidArgumentError("an NCCL transfer takes no description of the peer's memory");
  }
  std::vector<NcclLink::Chunk> chunks;
  chunks.reserve(t.regions.size());
  for (const MemoryRegion& r : t.regions) chunks.push_back({r.data, r.bytes});
  if (timer_ != nullptr) KVCOMP_RETURN_IF_ERROR(timer_->Start(t.stream));
  KVCOMP_RETURN_IF_ERROR(t.direction == Direction::kSend ? link_->Send(chunks, t.stream)
                                                         : link_->Recv(chunks, t.stream));
  stream_ = t.stream;
  stop_ = timer_ != nullptr;
  return Completion::ByWaiting([this, stream = t.stream](absl::Time deadline) {
    KVCOMP_RETURN_IF_ERROR(Enqueued(deadline));
    return link_->Wait(stream, deadline);
  });
}

absl::Status NcclPayloadLink::Enqueued(absl::Time deadline) {
  KVCOMP_RETURN_IF_ERROR(link_->Enqueued(deadline));
  if (!stop_) return absl::OkStatus();
  stop_ = false;
  return timer_->Stop(stream_);
}

}  // namespace transport
}  // namespace kvcomp
