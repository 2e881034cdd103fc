// The host arithmetic of the device CRC32C (Crc32cCombine, Crc32cOfZeros, Crc32cShift) against
// the CPU CRC32C on random data: the kernels fold chunk CRCs with the same multiplications.
#include <cstdint>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/kernels/device_crc32c.h"

namespace kvcomp {
namespace {

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

TEST(Crc32cCombine, OfTwoPiecesIsTheCrcOfTheWhole) {
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t a = rng() % 3000, b = trial % 7 == 0 ? 0 : rng() % 3000;
    const std::string s = RandomBytes(rng, a + b);
    const uint32_t ca = Crc32c(s.data(), a), cb = Crc32c(s.data() + a, b);
    EXPECT_EQ(Crc32cCombine(ca, cb, b), Crc32c(s.data(), s.size())) << a << " + " << b;
  }
}

TEST(Crc32cCombine, ZerosOfAnyLength) {
  for (uint64_t n : {0ull, 1ull, 3ull, 64ull, 511ull, 512ull, 4097ull, 1000003ull}) {
    const std::string z(n, '\0');
    EXPECT_EQ(Crc32cOfZeros(n), Crc32c(z.data(), z.size())) << n;
  }
  // Lengths far beyond any buffer here: shifting by a + b is shifting by a, then by b.
  const uint64_t a = (uint64_t{1} << 40) + 12345, b = (uint64_t{1} << 33) + 7;
  EXPECT_EQ(Crc32cShift(Crc32cShift(0xDEADBEEFu, a), b), Crc32cShift(0xDEADBEEFu, a + b));
  EXPECT_EQ(Crc32cCombine(Crc32cOfZeros(a), Crc32cOfZeros(b), b), Crc32cOfZeros(a + b));
}

TEST(Crc32cCombine, ShiftIsTheRegisterAfterZeros) {
  // A register r followed by n zero bytes: the CRC of (data, zeros) from the CRC of data.
  std::mt19937_64 rng(2);
  const std::string s = RandomBytes(rng, 777);
  const std::string z(300, '\0');
  const uint32_t c = Crc32c(s.data(), s.size());
  // Crc32c keeps ~register; the register after the zeros is Shift(register, n).
  EXPECT_EQ(~Crc32cShift(~c, z.size()), Crc32cExtend(c, z.data(), z.size()));
  EXPECT_EQ(Crc32cShift(0, 12345), 0u);
  EXPECT_EQ(Crc32cShift(0x12345678u, 0), 0x12345678u);
}

}  // namespace
}  // namespace kvcomp
