// Builds without CUDA: no GPU, no pinned memory, no device tier.
#ifndef KVCOMP_HAVE_CUDA

#include <memory>

#include "cuda_memory.h"
#include "kvcomp/storage/tier.h"

namespace kvcomp {
namespace storage {

void* PinnedAlloc(size_t) { return nullptr; }
void PinnedFree(void*) {}
bool CudaDeviceAvailable() { return false; }

absl::StatusOr<Payload> DownloadDeviceBytes(const DeviceBytes&) {
  return absl::FailedPreconditionError("a payload in device memory: this build has no CUDA");
}

absl::Status CopyToDeviceTarget(const DeviceTarget&, const void*, uint64_t) {
  return absl::FailedPreconditionError("a copy to device memory: this build has no CUDA");
}

absl::StatusOr<std::unique_ptr<Tier>> NewDeviceTier(const DeviceTierOptions&) {
  return absl::FailedPreconditionError("device tier: this build has no CUDA");
}

}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_HAVE_CUDA
