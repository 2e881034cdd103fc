// The work lists of the KVSplice CUDA kernels (codec_kernels.cuh), host code: a tile is a run of
// one head's rows, one thread block each.
#ifndef KVCOMP_KERNELS_SRC_CUDA_CODEC_TILES_H_
#define KVCOMP_KERNELS_SRC_CUDA_CODEC_TILES_H_

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvcomp {
namespace codec_cuda {

struct Tile {
  uint32_t head;  // relative to the call's first head
  uint32_t rows;  // rows in the tile
  uint64_t begin;
};

// Tiles of tile_rows rows (the last of a head shorter) over each head's rows (row_offsets,
// heads + 1 entries).
inline std::vector<Tile> UniformTiles(const uint64_t* row_offsets, uint64_t heads,
                                      uint64_t tile_rows) {
  std::vector<Tile> tiles;
  for (uint64_t h = 0; h < heads; ++h) {
    for (uint64_t b = row_offsets[h]; b < row_offsets[h + 1]; b += tile_rows) {
      tiles.push_back({static_cast<uint32_t>(h),
                       static_cast<uint32_t>(std::min(tile_rows, row_offsets[h + 1] - b)), b});
    }
  }
  return tiles;
}

// Tiles of the pipelined expand: each head's rows (row_offsets, heads + 1 entries) cut into
// equal tiles of whole sub-tiles (m rows, at least two per tile: each block stages its head's
// decode matrix once). `slots` is how many blocks the device runs at once (blocks per SM from
// the occupancy of the instantiation, times the SMs): the tile size is the largest whose tile
// count fills at least 90% of the slots of its last wave (the best one found otherwise), so a
// grid never ends on a nearly empty wave.
inline std::vector<Tile> ExpandTiles(const uint64_t* row_offsets, uint64_t heads, uint64_t m,
                                     uint64_t slots) {
  const uint64_t n = heads == 0 ? 0 : row_offsets[heads];
  slots = std::max<uint64_t>(slots, 1);
  auto per_tile = [&](uint64_t target, uint64_t len) {
    const uint64_t pieces = (len + target - 1) / target;
    return ((len + pieces - 1) / pieces + m - 1) / m * m;
  };
  auto count = [&](uint64_t target) {
    uint64_t c = 0;
    for (uint64_t h = 0; h < heads; ++h) {
      const uint64_t len = row_offsets[h + 1] - row_offsets[h];
      if (len > 0) c += (len + per_tile(target, len) - 1) / per_tile(target, len);
    }
    return c;
  };
  uint64_t best = std::max<uint64_t>(2 * m, n);
  double best_fill = 0.0;
  for (uint64_t waves = 1; waves <= 16; ++waves) {
    const uint64_t target = std::max<uint64_t>(2 * m, (n + waves * slots - 1) / (waves * slots));
    const uint64_t c = count(target);
    if (c == 0) break;
    const double fill = static_cast<double>(c) / (((c + slots - 1) / slots) * slots);
    if (fill > best_fill + 1e-9) {
      best_fill = fill;
      best = target;
    }
    if (fill >= 0.9 || target == 2 * m) break;
  }
  std::vector<Tile> tiles;
  for (uint64_t h = 0; h < heads; ++h) {
    const uint64_t begin = row_offsets[h], len = row_offsets[h + 1] - begin;
    if (len == 0) continue;
    const uint64_t per = per_tile(best, len);
    for (uint64_t b = 0; b < len; b += per) {
      tiles.push_back({static_cast<uint32_t>(h), static_cast<uint32_t>(std::min(per, len - b)),
                       begin + b});
    }
  }
  return tiles;
}

}  // namespace codec_cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_CODEC_TILES_H_
