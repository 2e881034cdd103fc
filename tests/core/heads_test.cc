#include "kvcomp/core/heads.h"

#include <string>
#include <vector>

#include "common/random_cache.h"
#include "gtest/gtest.h"
#include "kvcomp/core/format.h"

namespace kvcomp {
namespace {

using testing::RandomCache;
using testing::RandomCacheOptions;

std::vector<RandomCacheOptions> Variants() {
  std::vector<RandomCacheOptions> out;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (KeyCodec kc : {KeyCodec::kRaw, KeyCodec::kFp16, KeyCodec::kInt8, KeyCodec::kInt4}) {
      for (bool moments : {false, true}) {
        RandomCacheOptions o;
        o.layout = KvLayout{3, 4, 8, 64, dt};
        o.key_codec = kc;
        o.moments = moments;
        out.push_back(o);
      }
    }
  }
  return out;
}

CompressedCache Merged(const std::vector<CompressedCache>& parts) {
  auto m = MergeHeads(parts);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *m : CompressedCache{};
}

TEST(Heads, SplitThenMergeIsTheCache) {
  uint64_t seed = 1;
  for (const auto& o : Variants()) {
    const CompressedCache c = RandomCache(o, seed++);
    for (uint32_t parts : {1u, 2u, 4u}) {
      auto split = SplitHeads(c, parts);
      ASSERT_TRUE(split.ok()) << split.status();
      ASSERT_EQ(split->size(), parts);
      for (const auto& p : *split) {
        EXPECT_EQ(p.layout.num_kv_heads, 4 / parts);
        EXPECT_EQ(p.layout.num_q_heads, 8 / parts);
        EXPECT_TRUE(p.Validate().ok());
      }
      EXPECT_TRUE(Merged(*split) == c) << "parts " << parts;
    }
  }
}

TEST(Heads, PutSplitTwoWaysReadsBackSplitAnotherWay) {
  // Each part goes through the byte format (as a put and a get do); the merged parts split
  // four ways are the whole cache split four ways, byte for byte.
  uint64_t seed = 100;
  for (const auto& o : Variants()) {
    const CompressedCache c = RandomCache(o, seed++);
    auto two = SplitHeads(c, 2);
    ASSERT_TRUE(two.ok());
    std::vector<CompressedCache> read;
    for (const auto& p : *two) {
      auto bytes = format::EncodeCache(p);
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      auto back = format::ParseCache(*bytes);
      ASSERT_TRUE(back.ok()) << back.status();
      read.push_back(*back);
    }
    const CompressedCache whole = Merged(read);
    EXPECT_TRUE(whole == c);
    EXPECT_EQ(*format::EncodeCache(whole), *format::EncodeCache(c));
    auto four = SplitHeads(whole, 4);
    auto want = SplitHeads(c, 4);
    ASSERT_TRUE(four.ok() && want.ok());
    for (size_t i = 0; i < 4; ++i) EXPECT_TRUE((*four)[i] == (*want)[i]) << i;
    // a middle range on its own
    auto mid = SliceHeads(c, 1, 3);
    ASSERT_TRUE(mid.ok());
    EXPECT_TRUE(Merged({(*four)[1], (*four)[2]}) == *mid);
  }
}

TEST(Heads, BadSplitsAndMismatchedPartsAreErrors) {
  RandomCacheOptions o;
  o.layout = KvLayout{2, 4, 8, 64, DType::kBF16};
  const CompressedCache c = RandomCache(o, 7);
  EXPECT_EQ(SplitHeads(c, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SplitHeads(c, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SliceHeads(c, 2, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SliceHeads(c, 3, 5).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MergeHeads({}).status().code(), absl::StatusCode::kInvalidArgument);

  RandomCacheOptions other = o;
  other.original_tokens = o.original_tokens + 1;
  const CompressedCache d = RandomCache(other, 8);
  auto m = MergeHeads({c, d});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(m.status().message()).find("original token count"), std::string::npos);
  other = o;
  other.key_codec = KeyCodec::kInt8;
  EXPECT_EQ(MergeHeads({c, RandomCache(other, 9)}).status().code(),
            absl::StatusCode::kInvalidArgument);

  RandomCacheOptions kv = o;
  kv.value_codec = ValueCodec::kOrthogonalInt8;
  kv.rank = 32;
  const CompressedCache e = RandomCache(kv, 10);
  EXPECT_EQ(SplitHeads(e, 2).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(MergeHeads({e}).status().code(), absl::StatusCode::kFailedPrecondition);

  CompressedCache broken = c;
  broken.positions.pop_back();
  EXPECT_EQ(SplitHeads(broken, 2).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcomp
