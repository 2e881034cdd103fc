// The arithmetic behind combining CRC32C values, shared by the host (Crc32cCombine and friends,
// core/src/crc32c.cc) and the device CRC kernel (kernels/src/cuda/crc32c_cuda.cu). Values are
// bit-reflected as the CRC register keeps them: bit 31 is the coefficient of x^0, bit 0 that of
// x^31.
#ifndef KVCOMP_CORE_CRC32C_GF2_H_
#define KVCOMP_CORE_CRC32C_GF2_H_

#include <cstdint>

#if defined(__CUDACC__)
#define KVCOMP_CRC_HD __host__ __device__
#else
#define KVCOMP_CRC_HD
#endif

namespace kvcomp {
namespace crc32c_gf2 {

inline constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial
inline constexpr uint32_t kOne = 0x80000000u;   // x^0
inline constexpr int kPowers = 64;              // x^(2^k) for k < kPowers

// a * b modulo the polynomial.
KVCOMP_CRC_HD inline uint32_t MulMod(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = kOne; a != 0; bit >>= 1) {
    if (a & bit) {
      product ^= b;
      a ^= bit;
    }
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^(8 n) from `x2n` (x2n[k] = x^(2^k)), n < 2^(kPowers - 3).
KVCOMP_CRC_HD inline uint32_t XPow8(uint64_t n, const uint32_t* x2n) {
  uint32_t p = kOne;
  for (int k = 3; n != 0; ++k, n >>= 1) {
    if (n & 1) p = MulMod(p, x2n[k]);
  }
  return p;
}

// x2n[k] = x^(2^k) for k < kPowers.
inline void PowersOfX(uint32_t* x2n) {
  x2n[0] = kOne >> 1;  // x^1
  for (int k = 1; k < kPowers; ++k) x2n[k] = MulMod(x2n[k - 1], x2n[k - 1]);
}

}  // namespace crc32c_gf2
}  // namespace kvcomp

#endif  // KVCOMP_CORE_CRC32C_GF2_H_
