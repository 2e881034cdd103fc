// The CUDA backend: one device, one stream, one device allocator (cudaMallocAsync on the stream
// unless the caller injects one) and a pinned host allocator for staging. Op groups are built by
// their owners' factories (cuda_ops.h) over the shared CudaContext.
#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "cuda_ops.h"
#include "cuda_status.h"
#include "kvcomp/core/status.h"
#include "stream_allocator.h"

namespace kvcomp {
namespace {

// Page-locked host memory (cudaMallocHost) for staging copies.
class PinnedHostAllocator final : public Allocator {
 public:
  MemorySpace space() const override { return MemorySpace::kHost; }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    const cudaError_t err = cudaMallocHost(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(err, absl::StrCat("cudaMallocHost(", bytes, " bytes)").c_str());
    }
    return p;
  }
  void Deallocate(void* ptr, size_t /*bytes*/) override {
    if (ptr != nullptr) cudaFreeHost(ptr);
  }
};

class CudaBackend final : public Backend {
 public:
  ~CudaBackend() override {
    // Op groups may free workspace on the stream in their destructors: drop them first.
    codec_.reset();
    moments_.reset();
    scoring_.reset();
    if (ctx_.stream != nullptr) {
      cudaSetDevice(ctx_.device);
      if (owns_stream_) {
        cudaStreamSynchronize(ctx_.stream);
        own_allocator_.reset();
        cudaStreamDestroy(ctx_.stream);
      }
    }
  }

  absl::Status Init(const CudaBackendOptions& options) {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      cudaGetLastError();
      return absl::FailedPreconditionError(absl::StrCat(
          "no CUDA device: ", err == cudaSuccess ? "none visible" : cudaGetErrorString(err)));
    }
    if (options.device < 0 || options.device >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("CUDA device ", options.device, " out of range (", count, " visible)"));
    }
    ctx_.device = options.device;
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_.device));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&ctx_.properties, ctx_.device));
    if (options.stream != nullptr) {  // the caller's: never synchronised or destroyed here
      ctx_.stream = static_cast<cudaStream_t>(options.stream);
    } else {
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&ctx_.stream, cudaStreamNonBlocking));
      owns_stream_ = true;
    }
    if (options.allocator != nullptr) {
      if (options.allocator->space() != MemorySpace::kDevice) {
        return absl::InvalidArgumentError("CUDA backend needs a device-memory allocator");
      }
      ctx_.allocator = options.allocator;
    } else {
      KVCOMP_ASSIGN_OR_RETURN(own_allocator_, StreamAllocator::Create(ctx_.device, ctx_.stream,
                                                                      options.pool_keep_bytes));
      ctx_.allocator = own_allocator_.get();
      ctx_.stream_ordered_free = true;
    }
    ctx_.host_allocator = &pinned_;
    scoring_ = NewCudaScoringOps(&ctx_);
    moments_ = NewCudaMomentOps(&ctx_);
    codec_ = NewCudaCodecOps(&ctx_);
    return absl::OkStatus();
  }

  BackendKind kind() const override { return BackendKind::kCuda; }
  MemorySpace space() const override { return MemorySpace::kDevice; }
  std::string Describe() const override {
    return absl::StrCat("cuda:", ctx_.device, " ", ctx_.properties.name);
  }
  ScoringOps& scoring() override { return *scoring_; }
  MomentOps& moments() override { return *moments_; }
  CodecOps& codec() override { return *codec_; }
  Allocator& allocator() override { return *ctx_.allocator; }

  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    if (host_dst == nullptr || src == nullptr) {
      return absl::InvalidArgumentError("CopyToHost: null pointer");
    }
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_.device));
    KVCOMP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, ctx_.stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_.stream));
    return absl::OkStatus();
  }
  absl::Status CopyFromHost(void* dst, const void* host_src, size_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr || host_src == nullptr) {
      return absl::InvalidArgumentError("CopyFromHost: null pointer");
    }
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_.device));
    KVCOMP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, ctx_.stream));
    // The caller may free host_src as soon as we return.
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_.stream));
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_.device));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_.stream));
    KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return absl::OkStatus();
  }
  void* native_stream() const override { return ctx_.stream; }

 private:
  CudaContext ctx_;
  bool owns_stream_ = false;
  std::unique_ptr<Allocator> own_allocator_;
  PinnedHostAllocator pinned_;
  std::unique_ptr<ScoringOps> scoring_;
  std::unique_ptr<MomentOps> moments_;
  std::unique_ptr<CodecOps> codec_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const CudaBackendOptions& options) {
  auto backend = std::make_unique<CudaBackend>();
  KVCOMP_RETURN_IF_ERROR(backend->Init(options));
  return std::unique_ptr<Backend>(std::move(backend));
}

bool CudaDevicePresent() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
}

absl::StatusOr<DeviceMemory> CudaDeviceMemory(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device, " absent"));
  }
  // The caller's current device is left as it was.
  int current = 0;
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes);
  cudaSetDevice(current);
  KVCOMP_CUDA_RETURN_IF_ERROR(e);
  return DeviceMemory{free_bytes, total_bytes};
}

}  // namespace kvcomp
