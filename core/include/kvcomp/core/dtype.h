// Element types: f32, f16 and bf16 come in from serving engines; int8 and int4 are what the
// encoders write. Conversions between f32 and the 16-bit floats round to nearest even.
#ifndef KVCOMP_CORE_DTYPE_H_
#define KVCOMP_CORE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcomp {

// Values are part of the cache format and the wire protocol: never renumber.
enum class DType : uint8_t {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
  kInt8 = 3,
  kInt4 = 4,
};

// "f32", "f16", "bf16", "int8", "int4".
absl::string_view DTypeName(DType dtype);
// Parses the names above (also "float32", "float16", "bfloat16"); InvalidArgument otherwise.
absl::StatusOr<DType> ParseDType(absl::string_view name);
// True for the types a KV cache may arrive in (f32, f16, bf16).
bool IsInputDType(DType dtype);
// Bits per element: 32, 16, 16, 8, 4.
int DTypeBits(DType dtype);
// Bytes for `n` elements, int4 packed two to a byte (rounded up).
inline size_t DTypeBytes(DType dtype, size_t n) {
  return (n * static_cast<size_t>(DTypeBits(dtype)) + 7) / 8;
}
// True when `value` names a DType (for validating bytes read off the wire or disk).
bool IsValidDType(uint8_t value);

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// bfloat16 <-> float, round to nearest even; NaN stays NaN.
inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// IEEE half <-> float, round to nearest even, with subnormals, infinities and NaN.
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);

// Reads element `i` of a buffer of `dtype` (f32, f16 or bf16) as float.
inline float LoadAsFloat(const void* data, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(data)[i];
    case DType::kF16:
      return HalfToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
    default:
      return 0.0f;
  }
}
// Writes `v` as element `i` of a buffer of `dtype` (f32, f16 or bf16).
inline void StoreFromFloat(void* data, DType dtype, size_t i, float v) {
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(data)[i] = v;
      break;
    case DType::kF16:
      static_cast<uint16_t*>(data)[i] = FloatToHalf(v);
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(data)[i] = FloatToBf16(v);
      break;
    default:
      break;
  }
}

}  // namespace kvcomp

#endif  // KVCOMP_CORE_DTYPE_H_
