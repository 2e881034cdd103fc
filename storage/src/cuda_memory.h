// The few CUDA runtime calls the store makes, behind functions that exist in every build: with
// CUDA they call the runtime (cuda_memory_cuda.cc), without it they report "no CUDA".
#ifndef KVCOMP_STORAGE_SRC_CUDA_MEMORY_H_
#define KVCOMP_STORAGE_SRC_CUDA_MEMORY_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "kvcomp/storage/types.h"

namespace kvcomp {
namespace storage {

// Page-locked host memory of `bytes`, or null (no CUDA, no GPU, or the allocation failed).
void* PinnedAlloc(size_t bytes);
void PinnedFree(void* p);

// The bytes of a device payload copied once into fresh host memory, their CRC32C checked against
// the one they carry (DataLoss on a mismatch: the producer's device CRC and the bytes disagree).
// FailedPrecondition without CUDA; Unavailable/ResourceExhausted when the copy fails.
absl::StatusOr<Payload> DownloadDeviceBytes(const DeviceBytes& bytes);

// Copies `n` bytes of host memory at `src` into `target` (n <= target.capacity) on its stream
// and waits for it. FailedPrecondition without CUDA.
absl::Status CopyToDeviceTarget(const DeviceTarget& target, const void* src, uint64_t n);

}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_STORAGE_SRC_CUDA_MEMORY_H_
