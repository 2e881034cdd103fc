// Device memory from the stream-ordered pool (cudaMallocAsync / cudaFreeAsync on one stream):
// allocation and release are ordered on that stream, so a workspace freed at the end of an op is
// reused by the next op without a device-wide synchronisation. Used by the CUDA backend and by
// the device uploader of a put, each on its own stream.
#ifndef KVCOMP_KERNELS_SRC_CUDA_STREAM_ALLOCATOR_H_
#define KVCOMP_KERNELS_SRC_CUDA_STREAM_ALLOCATOR_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cuda_status.h"
#include "kvcomp/kernels/allocator.h"

namespace kvcomp {

class StreamAllocator final : public Allocator {
 public:
  StreamAllocator(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  MemorySpace space() const override { return MemorySpace::kDevice; }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    void* p = nullptr;
    const cudaError_t err = cudaMallocAsync(&p, bytes, stream_);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(err, absl::StrCat("cudaMallocAsync(", bytes, " bytes)").c_str());
    }
    return p;
  }
  void Deallocate(void* ptr, size_t /*bytes*/) override {
    if (ptr == nullptr) return;
    cudaSetDevice(device_);
    cudaFreeAsync(ptr, stream_);
  }

 private:
  int device_;
  cudaStream_t stream_;
};

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_STREAM_ALLOCATOR_H_
