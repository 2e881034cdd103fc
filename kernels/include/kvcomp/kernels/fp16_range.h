// The fp16 key codec's range: a finite key beyond +-65504 (the largest finite IEEE half) becomes
// Inf when the codec stores it, a silently wrong cache. A put whose policy stores keys in fp16
// is refused when any of its keys lies beyond, with the same error whichever memory its keys
// arrive in: host views are scanned on the CPU, device views (MemorySpace::kDevice, CUDA) by a
// kernel on the device, which reports the same first key (lowest head, then token, then
// channel) and its value, so Fp16KeyRangeError gives the same text on both paths. Keys in f16
// always fit; NaN and Inf are not reported here (the scoring pass refuses them).
//
// Thread-safety: reentrant. The device scan runs on `stream` (a cudaStream_t, nullptr = the
// calling thread's default stream) of the device that holds the keys, and waits for its result.
#ifndef KVCOMP_KERNELS_FP16_RANGE_H_
#define KVCOMP_KERNELS_FP16_RANGE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvcomp/kernels/tensor.h"

namespace kvcomp {

// The largest finite IEEE half.
inline constexpr float kFp16Max = 65504.0f;

// The first key of a view beyond the fp16 range, if any.
struct Fp16Overflow {
  bool found = false;
  uint32_t head = 0;
  uint64_t token = 0;    // within the view
  uint32_t channel = 0;
  float value = 0.0f;    // the key, as f32
};

// Scans `keys` (f32, f16 or bf16; any strides; host or device memory). InvalidArgument for a
// null pointer with a non-empty view or another dtype; for device views, FailedPrecondition in
// a build without CUDA and Internal when the device fails.
absl::StatusOr<Fp16Overflow> FindFp16KeyOverflow(const HeadsView& keys, void* stream = nullptr);

// InvalidArgument naming the key (its layer, head and token in the cache: `token_begin` is the
// view's first token) and the remedy; the text a refused put carries.
absl::Status Fp16KeyRangeError(const Fp16Overflow& overflow, uint32_t layer,
                               uint64_t token_begin);

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_FP16_RANGE_H_
