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

absl::StatusOr<std::unique_ptr<Tier>> NewDeviceTier(const DeviceTierOptions&) {
  return absl::FailedPreconditionError("device tier: this build has no CUDA");
}

}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_HAVE_CUDA
