// DeviceCrc32c against the CPU CRC32C (its twin) on fresh random inputs of many lengths and
// alignments, one range and many in one call, and its argument checks (gpu label).
#include <algorithm>
#include <cstring>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/gpu.h"
#include "gtest/gtest.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/device_crc32c.h"

namespace kvcomp {
namespace {

KVCOMP_GPU_TEST_BINARY();

class DeviceCrc32cTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto b = MakeCudaBackend();
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
  }
  // `bytes` on the device in one buffer; returns its base.
  uint8_t* Upload(const std::string& bytes) {
    auto buf = Buffer::Allocate(backend_->allocator(), std::max<size_t>(bytes.size(), 1));
    EXPECT_TRUE(buf.ok());
    EXPECT_TRUE(backend_->CopyFromHost(buf->data(), bytes.data(), bytes.size()).ok());
    held_.push_back(*std::move(buf));
    return held_.back().as<uint8_t>();
  }
  uint32_t* Words(size_t n) {
    auto buf = Buffer::Allocate(backend_->allocator(), n * 4);
    EXPECT_TRUE(buf.ok());
    held_.push_back(*std::move(buf));
    return held_.back().as<uint32_t>();
  }
  std::vector<uint32_t> Read(const uint32_t* words, size_t n) {
    std::vector<uint32_t> out(n);
    EXPECT_TRUE(backend_->CopyToHost(out.data(), words, n * 4).ok());
    return out;
  }

  std::unique_ptr<Backend> backend_;
  std::vector<Buffer> held_;
};

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i + 8 <= n; i += 8) {
    const uint64_t w = rng();
    std::memcpy(&s[i], &w, 8);
  }
  for (size_t i = n & ~size_t{7}; i < n; ++i) s[i] = static_cast<char>(rng());
  return s;
}

// Every length from 0 to 2100 bytes (chunk edges at 512) at every offset 0..17 from a 256-byte
// aligned base, one range per call batch of 16 (several launches per call).
TEST_F(DeviceCrc32cTest, SmallLengthsAtEveryAlignment) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string data = RandomBytes(rng, 2100 + 64);
  const uint8_t* dev = Upload(data);
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 2100; n += (n < 70 ? 1 : 13)) lengths.push_back(n);
  for (size_t n : {511, 512, 513, 1023, 1024, 1025, 1535, 1536, 2048}) lengths.push_back(n);
  for (size_t off = 0; off < 18; ++off) {
    std::vector<DeviceCrcRange> ranges;
    uint32_t* words = Words(lengths.size());
    for (size_t i = 0; i < lengths.size(); ++i) {
      ranges.push_back({dev + off, lengths[i], words + i});
    }
    ASSERT_TRUE(DeviceCrc32c(ranges, backend_->native_stream()).ok());
    const std::vector<uint32_t> got = Read(words, lengths.size());
    for (size_t i = 0; i < lengths.size(); ++i) {
      ASSERT_EQ(got[i], Crc32c(data.data() + off, lengths[i]))
          << "length " << lengths[i] << " offset " << off;
    }
  }
}

// Random lengths up to 40 MB (many blocks of either kernel, a last block part full) at random
// offsets, fresh bytes each round, many ranges in one call.
TEST_F(DeviceCrc32cTest, LargeRandomRangesMatchTheCpu) {
  std::mt19937_64 rng(std::random_device{}());
  for (int round = 0; round < 4; ++round) {
    const size_t total = (size_t{40} << 20) + rng() % 100000;
    const std::string data = RandomBytes(rng, total);
    const uint8_t* dev = Upload(data);
    std::vector<DeviceCrcRange> ranges;
    std::vector<std::pair<size_t, size_t>> spans;
    uint32_t* words = Words(40);
    for (int i = 0; i < 40; ++i) {
      const size_t off = rng() % 4096;
      const size_t cap = i == 0 ? total - off : std::min<size_t>(total - off, size_t{3} << 20);
      const size_t len = i == 0 ? cap : rng() % (cap + 1);
      spans.emplace_back(off, len);
      ranges.push_back({dev + off, len, words + i});
    }
    ASSERT_TRUE(DeviceCrc32c(ranges, backend_->native_stream()).ok());
    const std::vector<uint32_t> got = Read(words, ranges.size());
    for (size_t i = 0; i < spans.size(); ++i) {
      ASSERT_EQ(got[i], Crc32c(data.data() + spans[i].first, spans[i].second))
          << "round " << round << " range " << i << ": " << spans[i].second << " bytes at +"
          << spans[i].first;
    }
  }
}

// With copy_to the kernel writes each range's bytes to its destination as it reads them: the
// same CRCs, the destinations equal to the sources, the bytes around them untouched; lengths
// across chunk edges at several alignments, and a large range of several blocks.
TEST_F(DeviceCrc32cTest, CopiesWhileItReads) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string data = RandomBytes(rng, (size_t{3} << 20) + 4096);
  const uint8_t* src = Upload(data);
  const std::string poison(data.size() + 64, '\x5a');
  std::vector<size_t> lengths = {0, 1, 15, 16, 17, 511, 512, 513, 1536, 70000,
                                 data.size() - 4096};
  for (size_t off : {0, 3, 16, 29}) {
    for (size_t len : lengths) {
      uint8_t* dst = Upload(poison);
      uint32_t* w = Words(1);
      // The destination 32 bytes in, aligned as the source modulo 16.
      uint8_t* to = dst + 32 + off;
      ASSERT_TRUE(
          DeviceCrc32c({{src + off, len, w, to}}, backend_->native_stream()).ok());
      ASSERT_EQ(Read(w, 1)[0], Crc32c(data.data() + off, len)) << len << " at +" << off;
      std::string back(poison.size(), '\0');
      ASSERT_TRUE(backend_->CopyToHost(back.data(), dst, back.size()).ok());
      std::string want = poison;
      std::memcpy(&want[32 + off], data.data() + off, len);
      ASSERT_TRUE(back == want) << len << " bytes at +" << off;
      held_.clear();
      src = Upload(data);
    }
  }
  // Many ranges in one call (more than one launch holds), copied and not, at random places and
  // lengths: each range's CRC and copy, and nothing written outside the copies.
  for (int round = 0; round < 3; ++round) {
    const int count = 20;
    std::vector<DeviceCrcRange> ranges;
    std::vector<uint8_t*> dsts;
    std::vector<size_t> offs, lens;
    uint32_t* words = Words(count);
    for (int i = 0; i < count; ++i) {
      const size_t off = rng() % 64;
      const size_t len = i % 7 == 0 ? rng() % 600 : rng() % (data.size() - 4096);
      offs.push_back(off);
      lens.push_back(len);
      dsts.push_back(Upload(poison));
      ranges.push_back({src + off, len, words + i, i % 4 == 3 ? nullptr : dsts.back() + 32 + off});
    }
    ASSERT_TRUE(DeviceCrc32c(ranges, backend_->native_stream()).ok());
    const std::vector<uint32_t> got = Read(words, count);
    for (int i = 0; i < count; ++i) {
      ASSERT_EQ(got[i], Crc32c(data.data() + offs[i], lens[i])) << "range " << i;
      std::string back(poison.size(), '\0');
      ASSERT_TRUE(backend_->CopyToHost(back.data(), dsts[i], back.size()).ok());
      std::string want = poison;
      if (ranges[i].copy_to != nullptr) {
        std::memcpy(&want[32 + offs[i]], data.data() + offs[i], lens[i]);
      }
      ASSERT_TRUE(back == want) << "range " << i << ": " << lens[i] << " bytes at +" << offs[i];
    }
    held_.clear();
    src = Upload(data);
  }
  uint32_t* w = Words(1);
  uint8_t* dst = Upload(poison);
  EXPECT_TRUE(absl::IsInvalidArgument(
      DeviceCrc32c({{src, 100, w, dst + 1}}, backend_->native_stream())));
}

TEST_F(DeviceCrc32cTest, KnownVectorAndBadArguments) {
  const uint8_t* dev = Upload("123456789");
  uint32_t* w = Words(1);
  ASSERT_TRUE(DeviceCrc32c({{dev, 9, w}}, backend_->native_stream()).ok());
  EXPECT_EQ(Read(w, 1)[0], 0xE3069283u);
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCrc32c({{dev, 9, nullptr}}, nullptr)));
  EXPECT_TRUE(absl::IsInvalidArgument(
      DeviceCrc32c({{dev, 9, reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(w) + 1)}},
                   nullptr)));
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCrc32c({{nullptr, 4, w}}, nullptr)));
  ASSERT_TRUE(DeviceCrc32c({{nullptr, 0, w}}, backend_->native_stream()).ok());
  EXPECT_EQ(Read(w, 1)[0], 0u);
}

}  // namespace
}  // namespace kvcomp
