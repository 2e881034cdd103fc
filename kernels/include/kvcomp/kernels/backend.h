// The compression engine's backend: one interface, a CPU implementation (the reference and the
// embedded default) and a CUDA implementation. Operations are grouped by concern, each group an
// interface of its own so the groups can evolve independently:
//   scoring()  token scores, budgets, selection and compaction   (kvcomp/kernels/scoring_ops.h)
//   moments()  MomentKV summaries and corrected decode attention (kvcomp/kernels/moment_ops.h)
//   codec()    KVSplice value/key encoding and decoding           (kvcomp/kernels/codec_ops.h)
// A Backend is not thread-safe: use one per thread (or per CUDA stream). Ops read and write
// memory in the backend's space (host for CPU; device for CUDA) and return InvalidArgument for
// views in the other space.
#ifndef KVCOMP_KERNELS_BACKEND_H_
#define KVCOMP_KERNELS_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/tensor.h"

namespace kvcomp {

class ScoringOps;
class MomentOps;
class CodecOps;

enum class BackendKind : uint8_t { kCpu = 0, kCuda = 1 };

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendKind kind() const = 0;
  // The memory space the ops read and write.
  virtual MemorySpace space() const = 0;
  // "cpu (16 threads)" or "cuda:0 NVIDIA H100 80GB HBM3".
  virtual std::string Describe() const = 0;

  virtual ScoringOps& scoring() = 0;
  virtual MomentOps& moments() = 0;
  virtual CodecOps& codec() = 0;

  // Memory of space() for workspaces and outputs (the injected one, or the backend's own).
  virtual Allocator& allocator() = 0;
  // Copies `bytes` between host memory and the backend's space; return when the copy is done
  // (on CUDA: after the stream's earlier work, which makes op results visible to the host).
  virtual absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) = 0;
  virtual absl::Status CopyFromHost(void* dst, const void* host_src, size_t bytes) = 0;
  // Waits for every op issued so far (no-op on the CPU). Reports asynchronous device errors.
  virtual absl::Status Synchronize() = 0;
  // The CUDA stream every op is ordered on (a cudaStream_t), for code that launches its own
  // kernels in order with the backend's; nullptr on the CPU.
  virtual void* native_stream() const { return nullptr; }
};

struct CpuBackendOptions {
  // Worker threads; 0 = every hardware thread. Default 0.
  int num_threads = 0;
  // Host allocator for workspaces and outputs; nullptr = HostAllocator(). Not owned.
  Allocator* allocator = nullptr;
};
absl::StatusOr<std::unique_ptr<Backend>> MakeCpuBackend(const CpuBackendOptions& options = {});

struct CudaBackendOptions {
  int device = 0;  // CUDA device ordinal. Default 0.
  // Device allocator; nullptr = the backend's own (cudaMallocAsync on its stream). Not owned.
  // An injected allocator may hand memory out again as soon as it is deallocated, so ops that
  // release a workspace wait for their kernels first (the backend's own pool needs no wait).
  Allocator* allocator = nullptr;
  // The cudaStream_t every op is issued on, owned by the caller and alive until the backend is
  // destroyed; nullptr = a non-blocking stream of the backend's own. A caller that runs kvcomp on
  // its framework's stream (torch's current stream) gets kvcomp's reads ordered after the
  // framework's writes, and the framework's later kernels after kvcomp's writes, without any
  // device-wide synchronisation. Default nullptr.
  void* stream = nullptr;
  // With the backend's own allocator: freed device memory its pool keeps mapped for later ops
  // instead of returning it to the driver at each host wait (the pool's release threshold). A
  // workspace mapped afresh costs tens of microseconds, more than the kernels of a short op.
  // Default 64 MiB; 0 returns every freed byte.
  uint64_t pool_keep_bytes = uint64_t{64} << 20;
};
// FailedPrecondition ("no CUDA device: ...") when kvcomp was built without CUDA or no device is
// present (a missing GPU is a property of the machine, not a transient failure).
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const CudaBackendOptions& options = {});
// True when MakeCudaBackend can succeed (built with CUDA and a device is visible).
bool CudaAvailable();

// Free and total memory of CUDA device `device` as the driver reports them (cudaMemGetInfo: every
// process's allocations counted). FailedPrecondition without CUDA or without that device.
struct DeviceMemory {
  uint64_t free_bytes = 0;
  uint64_t total_bytes = 0;
};
absl::StatusOr<DeviceMemory> QueryDeviceMemory(int device);

// "cpu" or "cuda".
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(absl::string_view name);

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_BACKEND_H_
