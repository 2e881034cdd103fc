// The work lists of the KVSplice CUDA kernels (kernels/src/cuda/codec_tiles.h), host code: every
// row of every head in exactly one tile, in order; the pipelined expand's tiles in whole
// sub-tiles, equal within a head, and a last wave that is not nearly empty.
#include "cuda/codec_tiles.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

namespace kvcomp {
namespace codec_cuda {
namespace {

// Every row once, heads in order, tiles within their head and contiguous.
void ExpectCover(const std::vector<uint64_t>& off, const std::vector<Tile>& tiles) {
  const uint64_t heads = off.size() - 1;
  uint64_t next = 0, head = 0;
  for (const Tile& t : tiles) {
    ASSERT_GT(t.rows, 0u);
    while (head < heads && off[head + 1] <= next) ++head;
    ASSERT_LT(head, heads);
    EXPECT_EQ(t.head, head);
    EXPECT_EQ(t.begin, next);
    EXPECT_LE(t.begin + t.rows, off[head + 1]);
    next = t.begin + t.rows;
  }
  EXPECT_EQ(next, off.back());
}

std::vector<uint64_t> Offsets(const std::vector<uint64_t>& lens) {
  std::vector<uint64_t> off(lens.size() + 1, 0);
  for (size_t h = 0; h < lens.size(); ++h) off[h + 1] = off[h] + lens[h];
  return off;
}

TEST(CodecTiles, UniformTilesCoverRaggedHeads) {
  const std::vector<uint64_t> off = Offsets({700, 0, 333, 1, 64});
  const std::vector<Tile> t = UniformTiles(off.data(), off.size() - 1, 64);
  ExpectCover(off, t);
  for (const Tile& x : t) EXPECT_LE(x.rows, 64u);
  EXPECT_EQ(t.size(), 11u + 0 + 6 + 1 + 1);
}

TEST(CodecTiles, ExpandTilesAreWholeSubTilesAndFillTheLastWave) {
  std::mt19937_64 rng(3);
  for (uint64_t m : {32u, 64u, 128u}) {
    for (uint64_t slots : {132u * 2, 132u * 3, 132u * 4, 7u}) {
      for (int trial = 0; trial < 6; ++trial) {
        std::vector<uint64_t> lens;
        const int heads = trial < 3 ? 256 : 8 + trial;
        std::uniform_int_distribution<uint64_t> len(0, trial % 2 == 0 ? 4096 : 40000);
        for (int h = 0; h < heads; ++h) lens.push_back(trial == 0 ? 4096 : len(rng));
        const std::vector<uint64_t> off = Offsets(lens);
        const std::vector<Tile> t = ExpandTiles(off.data(), lens.size(), m, slots);
        SCOPED_TRACE(::testing::Message() << "m " << m << " slots " << slots << " trial " << trial);
        ExpectCover(off, t);
        // Within a head: every tile but the last has the same size, a multiple of m and at
        // least two sub-tiles (or the whole head).
        for (size_t i = 0; i + 1 < t.size(); ++i) {
          if (t[i + 1].head != t[i].head) continue;
          EXPECT_EQ(t[i].rows % m, 0u);
          EXPECT_GE(t[i].rows, 2 * m);
          if (i > 0 && t[i - 1].head == t[i].head) {
            EXPECT_EQ(t[i - 1].rows, t[i].rows);
          }
        }
      }
    }
  }
  // Equal heads of 4096 rows: the tile count fills its last wave to at least 90%.
  for (uint64_t slots : {132u * 2, 132u * 3, 132u * 4}) {
    const std::vector<uint64_t> off = Offsets(std::vector<uint64_t>(256, 4096));
    const std::vector<Tile> t = ExpandTiles(off.data(), 256, 64, slots);
    const uint64_t waves = (t.size() + slots - 1) / slots;
    EXPECT_GE(static_cast<double>(t.size()) / (waves * slots), 0.9) << slots << " " << t.size();
  }
  // Nothing to do: no tiles.
  const std::vector<uint64_t> empty = Offsets({0, 0});
  EXPECT_TRUE(ExpandTiles(empty.data(), 2, 64, 264).empty());
}

}  // namespace
}  // namespace codec_cuda
}  // namespace kvcomp
