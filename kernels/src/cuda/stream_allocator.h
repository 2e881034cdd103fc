// Device memory from a pool of the allocator's own, allocated and released in the order of one
// stream (cudaMallocFromPoolAsync / cudaFreeAsync): a workspace freed at the end of an op is reused
// by the next op without a device-wide synchronisation. The pool keeps up to `keep_bytes` of freed
// memory mapped across host waits (its release threshold). The device's default pool keeps none:
// there, every op that follows a host wait maps its workspace afresh, which costs more than the
// kernels of a short op. Used by the CUDA backend and by the device uploader of a put, each on its
// own stream.
#ifndef KVCOMP_KERNELS_SRC_CUDA_STREAM_ALLOCATOR_H_
#define KVCOMP_KERNELS_SRC_CUDA_STREAM_ALLOCATOR_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cuda_status.h"
#include "kvcomp/kernels/allocator.h"

namespace kvcomp {

class StreamAllocator final : public Allocator {
 public:
  static absl::StatusOr<std::unique_ptr<StreamAllocator>> Create(int device, cudaStream_t stream,
                                                                 uint64_t keep_bytes) {
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&pool, &props));
    auto a = std::unique_ptr<StreamAllocator>(new StreamAllocator(device, stream, pool));
    uint64_t keep = keep_bytes;  // the attribute is a cuuint64_t (64-bit unsigned)
    KVCOMP_CUDA_RETURN_IF_ERROR(
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    return a;
  }
  ~StreamAllocator() override {
    // Memory still allocated (or freed in stream order but not yet released) keeps the pool
    // until it is returned; the driver then releases it.
    if (pool_ != nullptr) cudaMemPoolDestroy(pool_);
  }
  StreamAllocator(const StreamAllocator&) = delete;
  StreamAllocator& operator=(const StreamAllocator&) = delete;

  MemorySpace space() const override { return MemorySpace::kDevice; }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    void* p = nullptr;
    cudaError_t err = cudaMallocFromPoolAsync(&p, bytes, pool_, stream_);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (err == cudaErrorMemoryAllocation &&
        cudaStreamIsCapturing(stream_, &capture) == cudaSuccess &&
        capture == cudaStreamCaptureStatusNone) {
      // The memory the pool keeps may be in pieces too small for this request: hand back all
      // that is free (what later ops have not yet taken) and ask once more. Not while the stream
      // is captured into a graph, where a wait would end the capture.
      cudaGetLastError();
      cudaStreamSynchronize(stream_);
      cudaMemPoolTrimTo(pool_, 0);
      err = cudaMallocFromPoolAsync(&p, bytes, pool_, stream_);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(err, absl::StrCat("cudaMallocFromPoolAsync(", bytes, " bytes)").c_str());
    }
    return p;
  }
  void Deallocate(void* ptr, size_t /*bytes*/) override {
    if (ptr == nullptr) return;
    cudaSetDevice(device_);
    cudaFreeAsync(ptr, stream_);
  }

 private:
  StreamAllocator(int device, cudaStream_t stream, cudaMemPool_t pool)
      : device_(device), stream_(stream), pool_(pool) {}
  int device_;
  cudaStream_t stream_;
  cudaMemPool_t pool_;
};

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_STREAM_ALLOCATOR_H_
