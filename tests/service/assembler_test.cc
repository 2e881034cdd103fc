// PutAssembler's keys' sums: a layer split over blocks (in any order, of any sizes) is copied
// into one buffer and its KeySums (plain sums) are taken on the way; they equal SumKeysOnHost over the joined
// keys bit for bit, match a float64 sum per chunk, and a compression given them stores the same
// cache as one that sums the keys itself.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "assembler.h"
#include "gtest/gtest.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/pipeline.h"
#include "kvcomp/kernels/scoring_ops.h"
#include "put.h"
#include "service_test_util.h"

namespace kvcomp {
namespace service {
namespace {

using testutil::KvTensor;
using testutil::MakeBlock;

constexpr uint64_t kTokens = 1500;  // 6 chunks of 256, the last short
const KvLayout kLayout{3, 2, 4, 64, DType::kF32};

uint64_t Chunks(uint64_t n) { return (n + kKeySumChunkTokens - 1) / kKeySumChunkTokens; }

// Layer 0 in one block; layers 1 and 2 in blocks of uneven sizes (not on chunk boundaries),
// added out of order, keys and values of layer 2 apart.
PutAssembler Assemble(const KvTensor& x, bool sum_keys = true) {
  PutAssembler a(kLayout, kTokens, sum_keys);
  EXPECT_TRUE(a.Add(MakeBlock(x, 0, 1, 0, kTokens)).ok());
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = {
      {700, 1100}, {0, 100}, {1100, 1500}, {100, 300}, {300, 700}};
  for (const auto& [b, e] : ranges) EXPECT_TRUE(a.Add(MakeBlock(x, 1, 2, b, e)).ok());
  for (const auto& [b, e] : ranges) {
    EXPECT_TRUE(a.Add(MakeBlock(x, 2, 3, b, e, /*keys=*/false, /*values=*/true)).ok());
  }
  for (uint64_t t = 0; t < kTokens; t += 37) {
    EXPECT_TRUE(
        a.Add(MakeBlock(x, 2, 3, t, std::min(kTokens, t + 37), /*keys=*/true, /*values=*/false))
            .ok());
  }
  EXPECT_TRUE(a.CheckComplete().ok());
  return a;
}

TEST(PutAssemblerKeySumsTest, SplitLayersCarryTheKeysSums) {
  const KvTensor x(kLayout, kTokens, 3);
  PutAssembler a = Assemble(x);
  absl::StatusOr<KvCacheView> view = a.View();
  ASSERT_TRUE(view.ok()) << view.status();
  ASSERT_EQ(view->key_sums.size(), kLayout.num_layers);
  // Layer 0 is read in place: no sums (the scorer sums it).
  EXPECT_EQ(view->key_sums[0].sums, nullptr);
  EXPECT_EQ(view->key_sums[0].unit_sums, nullptr);
  const uint32_t H = kLayout.num_kv_heads, D = kLayout.head_dim;
  const uint64_t chunks = Chunks(kTokens);
  for (uint32_t l = 1; l < kLayout.num_layers; ++l) {
    SCOPED_TRACE(l);
    const KeySums& got = view->key_sums[l];
    ASSERT_NE(got.sums, nullptr);
    EXPECT_EQ(got.unit_sums, nullptr);  // keydiff sums its keys itself
    EXPECT_EQ(got.num_tokens, kTokens);
    // The joined keys are the tensor's.
    ASSERT_EQ(std::memcmp(view->keys[l].data, x.at(x.keys, l, 0, 0), H * kTokens * D * 4), 0);
    // Bit for bit the sums a direct computation over the joined keys gives.
    std::vector<float> sums(H * chunks * D);
    ASSERT_TRUE(SumKeysOnHost(view->keys[l], 0, chunks, sums.data(), nullptr).ok());
    ASSERT_EQ(std::memcmp(got.sums, sums.data(), sums.size() * 4), 0);
    // And a float64 sum of each chunk.
    for (uint32_t h = 0; h < H; ++h) {
      for (uint64_t c = 0; c < chunks; ++c) {
        for (uint32_t j = 0; j < D; ++j) {
          double s = 0.0;
          for (uint64_t t = c * kKeySumChunkTokens;
               t < std::min(kTokens, (c + 1) * kKeySumChunkTokens); ++t) {
            s += x.at(x.keys, l, h, t)[j];
          }
          const uint64_t at = (h * chunks + c) * D + j;
          ASSERT_NEAR(got.sums[at], s, 1e-4 * std::max(1.0, std::fabs(s)));
        }
      }
    }
  }
}

// The CPU engine's Compress over the assembler's view (sums given for layers 1 and 2) stores
// exactly what it stores without them, for every scorer that reads them.
TEST(PutAssemblerKeySumsTest, CompressionGivenTheSumsEqualsWithout) {
  const KvTensor x(kLayout, kTokens, 4);
  PutAssembler a = Assemble(x);
  absl::StatusOr<KvCacheView> view = a.View();
  ASSERT_TRUE(view.ok()) << view.status();
  KvCacheView bare = *view;
  bare.key_sums.clear();
  for (int threads : {1, 3}) {
    CpuBackendOptions o;
    o.num_threads = threads;
    auto backend = MakeCpuBackend(o);
    ASSERT_TRUE(backend.ok()) << backend.status();
    for (Scorer s : {Scorer::kManifold, Scorer::kKeyDiff, Scorer::kWindowedManifold}) {
      for (uint32_t window : {512u, 600u}) {
        SCOPED_TRACE(absl::StrCat(ScorerName(s), " window ", window, " threads ", threads));
        CompressionPolicy p;
        p.scorer = s;
        p.ratio = 0.5;
        p.window = window;
        p.moments = true;
        absl::StatusOr<CompressedCache> with = Compress(**backend, *view, p);
        absl::StatusOr<CompressedCache> without = Compress(**backend, bare, p);
        ASSERT_TRUE(with.ok()) << with.status();
        ASSERT_TRUE(without.ok()) << without.status();
        EXPECT_EQ(with->kept, without->kept);
        EXPECT_EQ(with->positions, without->positions);
        EXPECT_EQ(with->keys, without->keys);
        EXPECT_EQ(with->values, without->values);
        EXPECT_EQ(with->moment_key_sum, without->moment_key_sum);
      }
    }
  }
}

// The engine does read the sums: changed after View, they change what is kept.
TEST(PutAssemblerKeySumsTest, TheScorerReadsTheSums) {
  const KvTensor x(kLayout, kTokens, 5);
  PutAssembler a = Assemble(x);
  absl::StatusOr<KvCacheView> view = a.View();
  ASSERT_TRUE(view.ok()) << view.status();
  auto backend = MakeCpuBackend(CpuBackendOptions{});
  ASSERT_TRUE(backend.ok());
  CompressionPolicy p;
  p.scorer = Scorer::kManifold;
  p.ratio = 0.5;
  absl::StatusOr<CompressedCache> before = Compress(**backend, *view, p);
  ASSERT_TRUE(before.ok()) << before.status();
  // Move layer 1's mean far along the first channel (the assembler's own buffer).
  float* sums = const_cast<float*>(view->key_sums[1].sums);
  for (uint64_t i = 0; i < kLayout.num_kv_heads * Chunks(kTokens); ++i) {
    sums[i * kLayout.head_dim] += 1e4f;
  }
  absl::StatusOr<CompressedCache> after = Compress(**backend, *view, p);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_NE(after->positions, before->positions);
}

// Keys that break the data rule are still refused with their sums given.
TEST(PutAssemblerKeySumsTest, KeysAreStillCheckedWithTheSumsGiven) {
  KvTensor x(kLayout, kTokens, 5);
  x.keys[((uint64_t{1} * kLayout.num_kv_heads + 1) * kTokens + 900) * kLayout.head_dim] =
      NAN;  // layer 1, head 1, token 900
  PutAssembler a = Assemble(x);
  absl::StatusOr<KvCacheView> view = a.View();
  ASSERT_TRUE(view.ok()) << view.status();
  ASSERT_NE(view->key_sums[1].sums, nullptr);
  auto backend = MakeCpuBackend(CpuBackendOptions{});
  ASSERT_TRUE(backend.ok());
  for (Scorer s : {Scorer::kManifold, Scorer::kWindowedManifold}) {
    CompressionPolicy p;
    p.scorer = s;
    p.ratio = 0.5;
    absl::StatusOr<CompressedCache> c = Compress(**backend, *view, p);
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("layer 1"), std::string::npos) << c.status();
    EXPECT_NE(c.status().message().find("at head 1, token 900"), std::string::npos) << c.status();
  }
}

TEST(PutAssemblerKeySumsTest, OnlyTheScorersOfTheKeysMeanGetSums) {
  CompressionPolicy p;
  for (Scorer s : {Scorer::kManifold, Scorer::kWindowedManifold}) {
    p.scorer = s;
    EXPECT_TRUE(PutAssembler::KeySumsHelp(p)) << static_cast<int>(s);
  }
  for (Scorer s : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kStreaming, Scorer::kRandom,
                   Scorer::kSnapKV}) {
    p.scorer = s;
    EXPECT_FALSE(PutAssembler::KeySumsHelp(p)) << static_cast<int>(s);
  }
  // Made without sums: split layers are joined as before and carry none.
  const KvTensor x(kLayout, kTokens, 7);
  PutAssembler a = Assemble(x, /*sum_keys=*/false);
  absl::StatusOr<KvCacheView> view = a.View();
  ASSERT_TRUE(view.ok()) << view.status();
  for (uint32_t l = 0; l < kLayout.num_layers; ++l) {
    EXPECT_EQ(view->key_sums[l].sums, nullptr) << l;
    EXPECT_EQ(view->key_sums[l].unit_sums, nullptr) << l;
  }
  PutAssembler b = Assemble(x);
  absl::StatusOr<KvCacheView> with = b.View();
  ASSERT_TRUE(with.ok()) << with.status();
  const size_t bytes = kLayout.LayerBytes(kTokens);
  for (uint32_t l = 1; l < kLayout.num_layers; ++l) {  // the joined layers (dense)
    EXPECT_EQ(std::memcmp(view->keys[l].data, with->keys[l].data, bytes), 0) << l;
    EXPECT_EQ(std::memcmp(view->values[l].data, with->values[l].data, bytes), 0) << l;
  }
}

TEST(PutAssemblerKeySumsTest, ClearDropsTheSums) {
  const KvTensor x(kLayout, kTokens, 6);
  PutAssembler a = Assemble(x);
  ASSERT_TRUE(a.View().ok());
  a.Clear();
  EXPECT_EQ(a.held_blocks(), 0u);
}

}  // namespace
}  // namespace service
}  // namespace kvcomp
