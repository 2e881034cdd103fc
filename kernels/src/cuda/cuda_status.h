// CUDA errors become kvcomp statuses at the edge (STYLE.md): the message keeps CUDA's own name
// and text and says which call failed. Shared by every CUDA op group.
#ifndef KVCOMP_KERNELS_SRC_CUDA_CUDA_STATUS_H_
#define KVCOMP_KERNELS_SRC_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvcomp {

// OK for cudaSuccess; ResourceExhausted for out-of-memory; Internal otherwise.
inline absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(what, ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

}  // namespace kvcomp

// Returns the status of a CUDA call (or of a kernel launch: pass cudaGetLastError()) when it
// failed, naming the expression.
#define KVCOMP_CUDA_RETURN_IF_ERROR(expr)                               \
  do {                                                                  \
    cudaError_t kvcomp_cuda_err_ = (expr);                              \
    if (kvcomp_cuda_err_ != cudaSuccess) {                              \
      return ::kvcomp::CudaStatus(kvcomp_cuda_err_, #expr);             \
    }                                                                   \
  } while (0)

#endif  // KVCOMP_KERNELS_SRC_CUDA_CUDA_STATUS_H_
