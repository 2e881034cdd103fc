#include "kvcomp/core/crc32c.h"

#include <random>
#include <string>

#include "gtest/gtest.h"

namespace kvcomp {
namespace {

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 B.4
  std::string ones(32, '\xff');
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62A8AB43u);
}

TEST(Crc32c, ExtendEqualsWhole) {
  std::mt19937 rng(7);
  std::string s(1000, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  for (size_t cut : {0, 1, 7, 8, 9, 500, 999, 1000}) {
    uint32_t a = Crc32c(s.data(), cut);
    a = Crc32cExtend(a, s.data() + cut, s.size() - cut);
    EXPECT_EQ(a, Crc32c(s.data(), s.size())) << cut;
  }
}

}  // namespace
}  // namespace kvcomp
