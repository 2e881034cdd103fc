// How the CUDA selection in shared memory splits a head (kernels/src/cuda/select_plan.h), host
// code: the cluster's blocks and slices cover every token, stay within shared memory and load
// whole 16-byte groups; many short heads get fewer blocks each; heads too long go to the tiled
// path.
#include "cuda/select_plan.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace kvcomp {
namespace cuda {
namespace {

TEST(SelectPlanTest, SlicesCoverTheHeadWithinSharedMemory) {
  for (uint64_t n = 1; n <= 400000; n = n < 5000 ? n + 1 : n * 21 / 20 + 1) {
    for (uint64_t heads : {1ull, 8ull, 64ull, 512ull}) {
      for (int sms : {8, 132}) {
        SCOPED_TRACE(::testing::Message() << "n " << n << " heads " << heads << " sms " << sms);
        const uint32_t blocks = ClusterBlocks(n, heads, sms);
        if (blocks == 0) {
          // Only a head no cluster of kClusterMaxBlocks holds goes to the tiled path.
          EXPECT_GT((n + kClusterMaxBlocks - 1) / kClusterMaxBlocks, kClusterSliceCapacity);
          continue;
        }
        EXPECT_TRUE(blocks == 1 || blocks == 2 || blocks == 4 || blocks == 8);
        const uint64_t slice = ClusterSlice(n, blocks);
        EXPECT_EQ(slice % 4, 0u);
        EXPECT_LE(slice, kClusterSliceCapacity);
        EXPECT_GE(slice * blocks, n);                  // every token in a slice
        EXPECT_LT(slice * (blocks - 1), n);            // no slice wholly past the head
        if (blocks < kClusterMaxBlocks && (n + blocks - 1) / blocks > kClusterMinSlice) {
          // Fewer blocks than the slices want only to keep the grid near two blocks per SM.
          EXPECT_GT(heads * blocks * 2, 2 * static_cast<uint64_t>(sms));
        }
      }
    }
  }
}

TEST(SelectPlanTest, BlocksFollowTheLength) {
  EXPECT_EQ(ClusterBlocks(1000, 8, 132), 1u);
  EXPECT_EQ(ClusterBlocks(2048, 8, 132), 2u);
  EXPECT_EQ(ClusterBlocks(8193, 8, 132), 8u);
  EXPECT_EQ(ClusterBlocks(131072, 8, 132), 8u);
  EXPECT_EQ(ClusterBlocks(327680, 8, 132), 8u);
  EXPECT_EQ(ClusterBlocks(327681, 8, 132), 0u);
  // 512 heads of 2048: one block each, not two.
  EXPECT_EQ(ClusterBlocks(2048, 512, 132), 1u);
  // 64 heads of 32K on 132 SMs: four blocks each (256 blocks), not eight.
  EXPECT_EQ(ClusterBlocks(32768, 64, 132), 4u);
  // Halving stops where a slice would outgrow shared memory.
  EXPECT_EQ(ClusterBlocks(300000, 512, 132), 8u);
  EXPECT_EQ(ClusterSlice(8193, 8), 1028u);
  EXPECT_EQ(ClusterSlice(327680, 8), kClusterSliceCapacity);
}

}  // namespace
}  // namespace cuda
}  // namespace kvcomp
