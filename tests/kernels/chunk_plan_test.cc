// How the CUDA attention and moment kernels split heads into chunks (kernels/src/cuda/
// chunk_plan.h), host code: the chunks cover the longest head in whole tiles, none lies wholly
// past it, the partials stay within the combine kernel's slots, and a grid sized by the wave
// (not by the smallest chunk) fits one wave with the virtual token's CTAs beside it.
#include "cuda/chunk_plan.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace kvcomp {
namespace {

TEST(ChunkPlanTest, AttentionChunksCoverTheLongestHeadInOneWave) {
  using namespace attention_cuda;
  const std::vector<uint64_t> lengths{0,    1,     63,    64,     65,     1000,   2048,
                                      8192, 32768, 65536, 131072, 524288, 4000000};
  for (uint32_t rows : {1u, 4u, 8u, 9u, 16u, 17u, 32u, 33u, 80u}) {
    for (bool sixteen_bit : {true, false}) {
      for (uint32_t d : {64u, 128u, 256u}) {
        for (uint32_t sms : {8u, 132u}) {
          for (uint32_t kv_heads : {1u, 8u, 64u}) {
            for (bool virtual_token : {false, true}) {
              for (uint64_t kept : lengths) {
                SCOPED_TRACE(::testing::Message()
                             << "rows " << rows << " 16-bit " << sixteen_bit << " d " << d
                             << " sms " << sms << " kv heads " << kv_heads << " virtual "
                             << virtual_token << " kept " << kept);
                const bool mma = MmaDecode(rows, sixteen_bit, d);
                EXPECT_EQ(mma, sixteen_bit && d <= 128 && rows <= 32u);
                const Chunking c =
                    PartialChunking(rows, sixteen_bit, d, sms, kv_heads, kept, virtual_token);
                ASSERT_GE(c.chunks, 1u);
                EXPECT_EQ(c.chunk % (mma ? kMmaTile : 32), 0u);
                EXPECT_GE(c.chunk * c.chunks, kept);                     // every token covered
                if (kept > 0) {
                  EXPECT_LT(c.chunk * (c.chunks - 1), kept);  // no chunk wholly past the head
                }
                const uint32_t slots = c.chunks + (virtual_token ? 1 : 0);
                EXPECT_LE(slots, kMaxSlots);
                // A chunk above its floor was sized by the wave: chunks and virtual CTAs of every
                // (kv head, row block) fit the CTAs the multiprocessors hold at once.
                const bool decode = !mma && sixteen_bit && rows <= uint32_t{kDecodeRows};
                const uint64_t least = mma ? kMmaTile : decode ? 128 : 256;
                const uint64_t per_sm =
                    mma ? kMmaCtasPerSm : (decode && d <= 128 ? kDecodeCtasPerSm : 2);
                const uint64_t row_blocks = mma ? 1 : (rows + kRows - 1) / kRows;
                const uint64_t ctas = (uint64_t{c.chunks} + (virtual_token ? VirtualCtas(d) : 0)) *
                                      kv_heads * row_blocks;
                if (c.chunk > least && ctas > per_sm * sms) {
                  // Only where the wave cannot even hold one chunk per head besides the
                  // virtual CTAs, or the slot limit caps the chunks.
                  EXPECT_TRUE(per_sm * sms / (kv_heads * row_blocks) <=
                                  (virtual_token ? VirtualCtas(d) : 0) + 1 ||
                              c.chunks >= kMaxSlots - 1);
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(VirtualCtas(64) * kVirtualCols, 64u);
  EXPECT_EQ(VirtualCtas(128) * kVirtualCols, 128u);
  EXPECT_EQ(VirtualCtas(256) * kVirtualCols, 256u);
}

TEST(ChunkPlanTest, MomentChunksAreWholeTilesInOneWave) {
  using namespace moments_cuda;
  for (uint64_t span : {1ull, 64ull, 511ull, 2048ull, 8192ull, 32768ull, 131072ull, 3000000ull}) {
    for (uint32_t heads : {0u, 1u, 3u, 8u, 256u}) {
      for (uint32_t sblocks : {1u, 4u}) {
        for (int sms : {0, 8, 132}) {
          SCOPED_TRACE(::testing::Message() << "span " << span << " heads " << heads
                                            << " sblocks " << sblocks << " sms " << sms);
          const uint64_t chunk = MomentChunk(span, heads, sblocks, sms);
          EXPECT_EQ(chunk % kTileT, 0u);
          EXPECT_GE(chunk, kMinShortMomentChunk);
          const uint64_t chunks = (span + chunk - 1) / chunk;
          const uint64_t groups = std::max<uint64_t>(1, uint64_t{heads} * sblocks);
          const uint64_t sm = static_cast<uint64_t>(std::max(sms, 1));
          // At most one wave: two CTAs per SM over the heads' S blocks.
          EXPECT_LE(chunks, std::max<uint64_t>(1, 2 * sm / groups));
          if (chunk < kMinMomentChunk && chunk > kMinShortMomentChunk) {
            // A lowered floor: a tile less would give more than one CTA per SM.
            EXPECT_LT((chunk - kTileT) * sm, groups * span);
          }
          if (chunk < kMinMomentChunk) {
            // Lowered only where 512-token chunks leave SMs without a CTA.
            EXPECT_LT(groups * span, kMinMomentChunk * sm);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvcomp
