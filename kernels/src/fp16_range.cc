#include "kvcomp/kernels/fp16_range.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/dtype.h"

namespace kvcomp {

namespace fp16_range_internal {
// The device scan (cuda/fp16_range_cuda.cu; FailedPrecondition without CUDA).
absl::StatusOr<Fp16Overflow> FindOnDevice(const HeadsView& keys, void* stream);
}  // namespace fp16_range_internal

absl::StatusOr<Fp16Overflow> FindFp16KeyOverflow(const HeadsView& keys, void* stream) {
  if (keys.dtype != DType::kF32 && keys.dtype != DType::kF16 && keys.dtype != DType::kBF16) {
    return absl::InvalidArgumentError("fp16 key range: keys must be f32, f16 or bf16");
  }
  Fp16Overflow none;
  if (keys.num_heads == 0 || keys.num_tokens == 0 || keys.head_dim == 0) return none;
  if (keys.data == nullptr) return absl::InvalidArgumentError("fp16 key range: null keys");
  if (keys.dtype == DType::kF16) return none;  // every finite half fits
  if (keys.space == MemorySpace::kDevice) return fp16_range_internal::FindOnDevice(keys, stream);
  for (uint32_t h = 0; h < keys.num_heads; ++h) {
    for (uint64_t t = 0; t < keys.num_tokens; ++t) {
      const uint64_t row = keys.offset(h, t);
      for (uint32_t c = 0; c < keys.head_dim; ++c) {
        const float x = LoadAsFloat(keys.data, keys.dtype, row + c);
        if (std::isfinite(x) && std::fabs(x) > kFp16Max) return Fp16Overflow{true, h, t, c, x};
      }
    }
  }
  return none;
}

absl::Status Fp16KeyRangeError(const Fp16Overflow& o, uint32_t layer, uint64_t token_begin) {
  return absl::InvalidArgumentError(absl::StrCat(
      "keys: ", o.value, " at layer ", layer, ", head ", o.head, ", token ", token_begin + o.token,
      " is beyond the fp16 key codec's range (", kFp16Max,
      "); use key_codec raw or int8 for this model"));
}

#if !defined(KVCOMP_HAVE_CUDA)
namespace fp16_range_internal {
absl::StatusOr<Fp16Overflow> FindOnDevice(const HeadsView&, void*) {
  return absl::FailedPreconditionError("fp16 key range: device keys need a CUDA build");
}
}  // namespace fp16_range_internal
#endif

}  // namespace kvcomp
