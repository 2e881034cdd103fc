#include "kvcomp/kernels/backend.h"

#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "cpu/cpu_ops.h"
#include "cpu/thread_pool.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/moment_ops.h"
#include "kvcomp/kernels/scoring_ops.h"

#if defined(KVCOMP_HAVE_CUDA)
#include "cuda/cuda_ops.h"
#endif

namespace kvcomp {
namespace {

class AlignedHostAllocator final : public Allocator {
 public:
  MemorySpace space() const override { return MemorySpace::kHost; }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = ::operator new(bytes, std::align_val_t(kAlignment), std::nothrow);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("host allocation of ", bytes, " bytes"));
    }
    return p;
  }
  void Deallocate(void* ptr, size_t /*bytes*/) override {
    if (ptr != nullptr) ::operator delete(ptr, std::align_val_t(kAlignment));
  }
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& options)
      : pool_(options.num_threads),
        allocator_(options.allocator != nullptr ? options.allocator : &HostAllocator()) {
    context_.pool = &pool_;
    context_.allocator = allocator_;
    scoring_ = NewCpuScoringOps(&context_);
    moments_ = NewCpuMomentOps(&context_);
    codec_ = NewCpuCodecOps(&context_);
  }

  BackendKind kind() const override { return BackendKind::kCpu; }
  MemorySpace space() const override { return MemorySpace::kHost; }
  std::string Describe() const override {
    return absl::StrCat("cpu (", pool_.num_threads(), " threads)");
  }
  ScoringOps& scoring() override { return *scoring_; }
  MomentOps& moments() override { return *moments_; }
  CodecOps& codec() override { return *codec_; }
  Allocator& allocator() override { return *allocator_; }

  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memmove(host_dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyFromHost(void* dst, const void* host_src, size_t bytes) override {
    if (bytes > 0) std::memmove(dst, host_src, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

 private:
  ThreadPool pool_;
  Allocator* allocator_;
  CpuContext context_;
  std::unique_ptr<ScoringOps> scoring_;
  std::unique_ptr<MomentOps> moments_;
  std::unique_ptr<CodecOps> codec_;
};

}  // namespace

Allocator& HostAllocator() {
  static Allocator* const allocator = new AlignedHostAllocator();
  return *allocator;
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCpuBackend(const CpuBackendOptions& options) {
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_threads ", options.num_threads, " is negative (0 = all cores)"));
  }
  if (options.allocator != nullptr && options.allocator->space() != MemorySpace::kHost) {
    return absl::InvalidArgumentError("the CPU backend needs a host allocator");
  }
  return std::unique_ptr<Backend>(new CpuBackend(options));
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const CudaBackendOptions& options) {
#if defined(KVCOMP_HAVE_CUDA)
  return NewCudaBackend(options);
#else
  (void)options;
  return absl::FailedPreconditionError(
      "no CUDA device: kvcomp was built without CUDA (configure with -DKVCOMP_CUDA=ON)");
#endif
}

bool CudaAvailable() {
#if defined(KVCOMP_HAVE_CUDA)
  return CudaDevicePresent();
#else
  return false;
#endif
}

absl::StatusOr<DeviceMemory> QueryDeviceMemory(int device) {
#if defined(KVCOMP_HAVE_CUDA)
  return CudaDeviceMemory(device);
#else
  (void)device;
  return absl::FailedPreconditionError("no CUDA device: kvcomp was built without CUDA");
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(absl::string_view name) {
  if (name == "cpu") return MakeCpuBackend();
  if (name == "cuda") return MakeCudaBackend();
  return absl::InvalidArgumentError(absl::StrCat("unknown backend '", name, "' (cpu or cuda)"));
}

}  // namespace kvcomp
