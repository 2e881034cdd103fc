// Device-side helpers of the whole-sequence pipeline (pipeline.cc), built only with CUDA.
#ifndef KVCOMP_KERNELS_SRC_PIPELINE_DEVICE_H_
#define KVCOMP_KERNELS_SRC_PIPELINE_DEVICE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "env_switch.h"
#include "kvcomp/kernels/backend.h"

namespace kvcomp {
namespace pipeline_internal {

using internal::SwitchOn;

// On `stream`: the tokens of [0, n) each head did NOT keep, as TokenLists (ascending per head).
// `counts` [heads] and `kept` (head h's ascending indices from the prefix sum of counts) are
// the selection's outputs in device memory; writes `offsets` [heads + 1] (u64) and
// `evicted` (capacity heads * n) in device memory, and the kept lists' offsets to
// `kept_offsets` [heads + 1]. offsets and evicted null: the kept offsets alone. No host
// synchronisation.
absl::Status LaunchEvictedLists(void* stream, const uint32_t* counts, const uint32_t* kept,
                                uint32_t heads, uint64_t n, uint64_t* kept_offsets,
                                uint64_t* offsets, uint32_t* evicted);

// Zeroes `bytes` of `backend`'s device memory in its stream order (no host wait).
absl::Status ZeroDevice(Backend& backend, void* dst, uint64_t bytes);
// Sets every byte of `bytes` of `backend`'s device memory to `value`, in stream order.
absl::Status FillDevice(Backend& backend, void* dst, uint8_t value, uint64_t bytes);
// Queues a device-to-host copy on `stream` (a cudaStream_t); complete after the stream
// synchronises. `dst` may be pageable.
absl::Status DownloadAsync(void* stream, void* dst, const void* src, uint64_t bytes);

}  // namespace pipeline_internal
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_PIPELINE_DEVICE_H_
