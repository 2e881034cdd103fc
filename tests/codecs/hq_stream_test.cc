// The hq codec's entropy-coded stream (kvcomp/codecs/hq_stream.h): records back bit-identically
// in both modes, the header's layout and version, and damaged or malformed streams refused.
#include "kvcomp/codecs/hq_stream.h"

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvcomp/codecs/hq.h"
#include "kvcomp/core/dtype.h"

namespace kvcomp {
namespace {

// `rows` encoded rows of head_dim d: Gaussian rows, and when `repeats` is set, rows drawn from a
// small set of vectors (as a first layer's values are: one vector per token byte).
std::vector<uint8_t> Records(uint64_t rows, uint32_t d, uint32_t bits, uint64_t seed,
                             int distinct = 0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<std::vector<float>> pool(distinct > 0 ? distinct : 0, std::vector<float>(d));
  for (auto& v : pool)
    for (float& x : v) x = n(rng);
  std::vector<uint8_t> out(rows * hq::RowBytes(bits, d));
  std::vector<float> x(d);
  for (uint64_t r = 0; r < rows; ++r) {
    if (distinct > 0) {
      x = pool[rng() % distinct];
    } else {
      for (float& v : x) v = n(rng);
    }
    EXPECT_TRUE(hq::EncodeRow(x.data(), d, bits, out.data() + r * hq::RowBytes(bits, d)).ok());
  }
  return out;
}

TEST(HqStream, RoundTripIsBitIdenticalInBothModes) {
  for (uint32_t bits : {2u, 3u, 4u}) {
    for (uint32_t d : {8u, 64u, 128u, 256u}) {
      for (int distinct : {0, 16}) {
        const uint64_t rows = 777;
        auto rec = Records(rows, d, bits, 11 * bits + d, distinct);
        auto s = hq::PackStream(rec.data(), rows, d, bits, 3);
        ASSERT_TRUE(s.ok()) << s.status();
        std::vector<uint8_t> back;
        auto info = hq::UnpackStream(s->data(), s->size(), &back);
        ASSERT_TRUE(info.ok()) << info.status();
        EXPECT_EQ(back, rec) << bits << " bits d " << d << " distinct " << distinct;
        EXPECT_EQ(info->bits, bits);
        EXPECT_EQ(info->head_dim, d);
        EXPECT_EQ(info->rows, rows);
        const uint64_t packed = rows * d * bits / 8;
        if (distinct > 0) {  // repeated rows: zstd wins, by far on rows of 64 codes or more
          EXPECT_EQ(info->mode, hq::StreamMode::kZstd);
          EXPECT_LT(info->payload_bytes, d >= 64 ? packed / 4 : packed);
        }
        // Never larger than the records plus the header and the size field.
        EXPECT_LE(s->size(), rec.size() + hq::kStreamHeaderBytes + 8);
        if (info->mode == hq::StreamMode::kPacked) {
          EXPECT_EQ(info->payload_bytes, packed);
        } else {
          EXPECT_LT(info->payload_bytes, packed);
        }
      }
    }
  }
}

TEST(HqStream, GaussianCodesCompressBelowTheirWidth) {
  // Rotated Gaussian rows fill the grid unevenly (the extremes are rare), so the order-0 entropy
  // of 4-bit codes is below 4 bits (3.63) and zstd at its default level here (19) finds it.
  const uint64_t rows = 4096;
  auto rec = Records(rows, 128, 4, 5);
  auto s = hq::PackStream(rec.data(), rows, 128, 4);
  ASSERT_TRUE(s.ok());
  auto info = hq::ReadStreamHeader(s->data(), s->size());
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->mode, hq::StreamMode::kZstd);
  EXPECT_LT(info->payload_bytes, rows * 128 * 4 / 8);
}

TEST(HqStream, HeaderLayoutAndVersion) {
  auto rec = Records(3, 8, 3, 1);
  auto s = hq::PackStream(rec.data(), 3, 8, 3);
  ASSERT_TRUE(s.ok());
  const std::vector<uint8_t>& b = *s;
  EXPECT_EQ(std::memcmp(b.data(), "KVHZ", 4), 0);
  EXPECT_EQ(b[4], 1);  // format version 1
  EXPECT_EQ(b[5], 3);
  EXPECT_EQ(b[6] | b[7] << 8, 8);
  EXPECT_EQ(b[8], 3);
  for (int i = 9; i < 16; ++i) EXPECT_EQ(b[i], 0);
  EXPECT_EQ(b[17] | b[18] | b[19], 0);
  for (int r = 0; r < 3; ++r) {  // the side data is each record's first four bytes
    EXPECT_EQ(std::memcmp(&b[20 + 4 * r], &rec[r * hq::RowBytes(3, 8)], 4), 0);
  }
  // 3 rows of 8 3-bit codes: 9 bytes packed; zstd cannot beat that, so mode 0.
  EXPECT_EQ(b[16], 0);
  EXPECT_EQ(b.size(), 20u + 12 + 8 + 9);
  EXPECT_EQ(std::memcmp(&b[40], &rec[4], 3), 0);

  std::vector<uint8_t> other = b, back;
  other[4] = 2;  // a later version is refused, not misread
  auto st = hq::UnpackStream(other.data(), other.size(), &back);
  EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.status().message().find("version 2"), std::string::npos) << st.status();
}

TEST(HqStream, EmptyStream) {
  auto s = hq::PackStream(nullptr, 0, 128, 4);
  ASSERT_TRUE(s.ok()) << s.status();
  std::vector<uint8_t> back(5, 1);
  auto info = hq::UnpackStream(s->data(), s->size(), &back);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->rows, 0u);
  EXPECT_TRUE(back.empty());
}

TEST(HqStream, MalformedInputIsAnError) {
  auto rec = Records(300, 64, 2, 9, 4);
  auto s = hq::PackStream(rec.data(), 300, 64, 2);
  ASSERT_TRUE(s.ok());
  ASSERT_EQ((*s)[16], 1);  // zstd mode
  std::vector<uint8_t> back;
  auto refused = [&](std::vector<uint8_t> b) {
    auto st = hq::UnpackStream(b.data(), b.size(), &back);
    return !st.ok() && st.status().code() == absl::StatusCode::kInvalidArgument;
  };
  auto edit = [&](size_t at, uint8_t v) {
    std::vector<uint8_t> b = *s;
    b[at] = v;
    return b;
  };
  EXPECT_TRUE(refused(edit(0, 'X')));        // magic
  EXPECT_TRUE(refused(edit(5, 5)));          // width
  EXPECT_TRUE(refused(edit(6, 96)));         // head_dim not a power of two
  EXPECT_TRUE(refused(edit(8, 0x2d)));       // rows
  EXPECT_TRUE(refused(edit(16, 2)));         // mode
  EXPECT_TRUE(refused(edit(18, 1)));         // reserved
  EXPECT_TRUE(refused(edit(20 + 3, 0x7e)));  // a row's step: NaN
  EXPECT_TRUE(refused(edit(20 + 3, 0xbc)));  // a negative step (-1.x)
  std::vector<uint8_t> cut(s->begin(), s->end() - 1);
  EXPECT_TRUE(refused(cut));  // payload size does not add up
  std::vector<uint8_t> longer = *s;
  longer.push_back(0);
  EXPECT_TRUE(refused(longer));  // trailing byte
  EXPECT_TRUE(refused(std::vector<uint8_t>(10, 0)));
  {  // a damaged frame body
    std::vector<uint8_t> b = *s;
    b[b.size() - 3] ^= 0xff;
    b[b.size() - 8] ^= 0x5a;
    auto st = hq::UnpackStream(b.data(), b.size(), &back);
    if (st.ok()) {
      EXPECT_NE(back, rec);  // zstd frames carry no checksum here: damage that still decodes
    } else {                 // yields other codes, never a crash
      EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  // Codes >= 2^bits inside a well-formed frame: a stream of 3-bit codes relabelled 2-bit.
  {
    auto r3 = Records(300, 64, 3, 9, 4);
    auto s3 = hq::PackStream(r3.data(), 300, 64, 3);
    ASSERT_TRUE(s3.ok());
    ASSERT_EQ((*s3)[16], 1);
    std::vector<uint8_t> b = *s3;
    b[5] = 2;
    auto st = hq::UnpackStream(b.data(), b.size(), &back);
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.status().message().find("not below 2^2"), std::string::npos) << st.status();
  }
  // Packing refuses bad arguments and bad records.
  EXPECT_FALSE(hq::PackStream(rec.data(), 300, 64, 5).ok());
  EXPECT_FALSE(hq::PackStream(rec.data(), 300, 48, 2).ok());
  EXPECT_FALSE(hq::PackStream(rec.data(), 300, 64, 2, 0).ok());
  EXPECT_FALSE(hq::PackStream(nullptr, 3, 64, 2).ok());
  std::vector<uint8_t> bad = rec;
  bad[hq::RowBytes(2, 64) * 7 + 3] = 0xfe;  // row 7's step: NaN
  auto sb = hq::PackStream(bad.data(), 300, 64, 2);
  ASSERT_FALSE(sb.ok());
  EXPECT_NE(sb.status().message().find("record 7"), std::string::npos) << sb.status();
}

}  // namespace
}  // namespace kvcomp
