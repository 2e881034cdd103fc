#include "kvcomp/core/crc32c.h"

#include <algorithm>
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

// Long inputs take the three-stream path; pieces below 24 KiB take the one-stream path: both
// must agree, whatever the alignment and length.
TEST(Crc32c, LongInputsMatchPiecewise) {
  std::mt19937 rng(11);
  std::string s(300000, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  for (size_t len : {size_t{24576}, size_t{24577}, size_t{49152 + 5}, size_t{299990}}) {
    for (size_t off : {size_t{0}, size_t{3}}) {
      uint32_t piecewise = 0;
      for (size_t at = 0; at < len;) {
        const size_t n = std::min<size_t>(len - at, 1000 + rng() % 20000);
        piecewise = Crc32cExtend(piecewise, s.data() + off + at, n);
        at += n;
      }
      EXPECT_EQ(Crc32c(s.data() + off, len), piecewise) << len << " " << off;
    }
  }
}

}  // namespace
}  // namespace kvcomp
