#include "kvcomp/kernels/device_crc32c.h"

#include "crc32c_gf2.h"

namespace kvcomp {
namespace {

const uint32_t* Powers() {
  static const auto* table = [] {
    auto* t = new uint32_t[crc32c_gf2::kPowers];
    crc32c_gf2::PowersOfX(t);
    return t;
  }();
  return table;
}

}  // namespace

uint32_t Crc32cShift(uint32_t reg, uint64_t n) {
  return crc32c_gf2::MulMod(crc32c_gf2::XPow8(n, Powers()), reg);
}

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return Crc32cShift(crc_a, len_b) ^ crc_b;
}

uint32_t Crc32cOfZeros(uint64_t n) { return ~Crc32cShift(~uint32_t{0}, n); }

#if !defined(KVCOMP_HAVE_CUDA)
absl::Status DeviceCrc32c(absl::Span<const DeviceCrcRange>, void*) {
  return absl::FailedPreconditionError("DeviceCrc32c: this build has no CUDA");
}
#endif

}  // namespace kvcomp
