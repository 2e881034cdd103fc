// Internal factories of the CUDA backend's op groups (compiled only when KVCOMP_HAVE_CUDA). The
// CUDA backend (cuda/cuda_backend.cc, engine-CUDA) builds one CudaContext per Backend and hands it
// to each factory; the op groups keep the pointer (the context outlives them), issue all work on
// `stream`, and take workspace from `allocator` (device memory).
//
//   scoring: cuda/scoring_cuda.cu   moments: cuda/moments_cuda.cu
//   codec:   cuda/codec_cuda.cu
#ifndef KVCOMP_KERNELS_SRC_CUDA_CUDA_OPS_H_
#define KVCOMP_KERNELS_SRC_CUDA_CUDA_OPS_H_

#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/statusor.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/moment_ops.h"
#include "kvcomp/kernels/scoring_ops.h"

namespace kvcomp {

struct CudaContext {
  int device = 0;                       // CUDA device ordinal
  cudaStream_t stream = nullptr;        // every op is ordered on this stream
  cudaDeviceProp properties{};          // of `device`
  Allocator* allocator = nullptr;       // device memory; never null in a backend
  // True when `allocator` releases memory in stream order (the backend's own cudaMallocAsync
  // pool on `stream`): a workspace may then be released right after the kernels that use it are
  // enqueued. An injected allocator may hand memory out again at once, so ops wait first.
  bool stream_ordered_free = false;
  Allocator* host_allocator = nullptr;  // pinned host memory for staging; may be null
};

std::unique_ptr<ScoringOps> NewCudaScoringOps(CudaContext* context);
std::unique_ptr<MomentOps> NewCudaMomentOps(CudaContext* context);
std::unique_ptr<CodecOps> NewCudaCodecOps(CudaContext* context);

// Implemented by cuda/cuda_backend.cc; backend.cc forwards MakeCudaBackend/CudaAvailable here.
absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const CudaBackendOptions& options);
bool CudaDevicePresent();
absl::StatusOr<DeviceMemory> CudaDeviceMemory(int device);

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_CUDA_OPS_H_
