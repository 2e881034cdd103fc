// The evicted set of a layer computed on the device from its kept indices, so the moment
// stage of a device compression never brings the selection back to the host.
#include <cuda_runtime_api.h>

#include "cuda/cuda_status.h"
#include "pipeline_device.h"

namespace kvcomp {
namespace pipeline_internal {
namespace {

// One thread: prefix sums of the kept counts and of the evicted counts (heads is small).
__global__ void EvictedOffsetsKernel(const uint32_t* counts, uint32_t heads, uint64_t n,
                                     uint64_t* kept_offsets, uint64_t* offsets) {
  uint64_t k = 0, e = 0;
  for (uint32_t h = 0; h < heads; ++h) {
    kept_offsets[h] = k;
    if (offsets != nullptr) offsets[h] = e;
    const uint64_t c = counts[h] < n ? counts[h] : n;
    k += counts[h];
    e += n - c;
  }
  kept_offsets[heads] = k;
  if (offsets != nullptr) offsets[heads] = e;
}

// Token t of head h (grid y) is evicted when it is not in h's ascending kept list; its slot in
// the evicted list is t minus the kept tokens before it.
__global__ void EvictedListKernel(const uint32_t* counts, const uint32_t* kept,
                                  const uint64_t* kept_offsets, const uint64_t* offsets,
                                  uint64_t n, uint32_t* evicted) {
  const uint32_t h = blockIdx.y;
  const uint64_t t = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const uint32_t* k = kept + kept_offsets[h];
  uint64_t lo = 0, hi = counts[h];
  while (lo < hi) {
    const uint64_t mid = (lo + hi) / 2;
    if (k[mid] < t) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo < counts[h] && k[lo] == t) return;
  evicted[offsets[h] + t - lo] = static_cast<uint32_t>(t);
}

}  // namespace

absl::Status LaunchEvictedLists(void* stream, const uint32_t* counts, const uint32_t* kept,
                                uint32_t heads, uint64_t n, uint64_t* kept_offsets,
                                uint64_t* offsets, uint32_t* evicted) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  EvictedOffsetsKernel<<<1, 1, 0, s>>>(counts, heads, n, kept_offsets, offsets);
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (n == 0 || heads == 0 || evicted == nullptr) return absl::OkStatus();
  const dim3 grid(static_cast<unsigned>((n + 255) / 256), heads);
  EvictedListKernel<<<grid, 256, 0, s>>>(counts, kept, kept_offsets, offsets, n, evicted);
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace pipeline_internal
}  // namespace kvcomp
