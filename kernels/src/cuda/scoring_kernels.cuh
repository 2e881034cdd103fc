// Templated CUDA kernels of the scoring engine. Each kernel is templated on the element
// type T (float, __half, __nv_bfloat16) and, where it reads rows, the head dimension D; the
// launchers in scoring_launch.cu validate arguments, dispatch runtime dtype x head_dim to these,
// and turn cudaError_t into Status. Rows are read with 16-byte vector loads: the launcher
// guarantees 16-byte aligned rows (it repacks a view that is not).
//
// The stages of one layer, [H, n, D] keys (and values):
//   Stats     per (head, segment, chunk) fp32 partial sums of k (or k/||k|| for keydiff)
//   Centres   per (head, segment) the mean (fp64 sum of the partials; its norm in Score)
//   Score     per token: knorm, keydiff, (windowed) manifold, streaming, random; NaN/Inf check
//   Radix*    exact k-th largest effective score per segment (head, or the whole layer for
//             AdaKV's second stage): three digit passes of a most-significant-digit radix select
//   Count     per (head, tile): tokens pre-kept (AdaKV safeguard), above and equal to the
//             threshold
//   Plan      one block: per-tile output offsets, tie ranks, per-head counts
//   Gather    per tile: keep flags, ascending kept indices, and the K/V row copies
// and for a uniform budget, instead of Radix* to Gather:
//   BlockSelect  the whole selection of a head in shared memory, kept and evicted indices: one
//                block per head up to 8192 tokens (and a varlen batch's heads), one
//                thread-block cluster per head beyond (sm_90)
//   GatherRows   the kept K/V rows and the evicted values' check, by the whole grid
// Score also checks the values for NaN/Inf in the same launch (a second half of its grid).
#ifndef KVCOMP_KERNELS_SRC_CUDA_SCORING_KERNELS_CUH_
#define KVCOMP_KERNELS_SRC_CUDA_SCORING_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "kvcomp/kernels/scoring_ops.h"
#include "select_plan.h"

namespace kvcomp {
namespace cuda {

// ---------------------------------------------------------------------------------------------
// Shared constants and small device helpers
// ---------------------------------------------------------------------------------------------

inline constexpr int kThreads = 256;       // threads of every row-reading kernel
inline constexpr int kStatsRows = 256;     // rows per Stats block
inline constexpr int kScoreRows = 256;     // rows per Score block
inline constexpr int kTile = 1024;         // tokens per Count/Gather tile
inline constexpr int kRadixBins = 2048;    // 11-bit digits
inline constexpr int kRadixPasses = 3;     // 11 + 11 + 10 bits
inline constexpr uint32_t kProtectedKey = 0xFFFFFFFFu;

__host__ __device__ inline int RadixShift(int pass) { return pass == 0 ? 21 : pass == 1 ? 10 : 0; }
__host__ __device__ inline int RadixBits(int pass) { return pass == 2 ? 10 : 11; }

// First bad (head * n + token) of each kind; ~0 when none. Zeroed with 0xFF bytes.
struct ErrorSlots {
  unsigned long long bad_key;    // a key row with NaN/Inf or a squared norm beyond float32
  unsigned long long bad_query;  // the same for snapkv queries
  unsigned long long bad_score;  // a non-finite score given to Select
  unsigned long long bad_value;  // a value row with NaN/Inf or a squared norm beyond float32
};

// Selection state of one segment (a head, or the whole layer).
struct SegmentState {
  uint32_t prefix;  // key bits fixed so far; after the last pass, the threshold key
  uint32_t need;    // tokens still to take at or below `prefix`; after the last pass, how many
                    // threshold-equal tokens are kept (in index order)
  uint32_t active;  // 0: this segment keeps nothing in this stage
  uint32_t pad;
};

// Counts of one tile, written by Count and read by Plan.
struct TileCounts {
  uint32_t pre;  // tokens kept by an earlier stage (AdaKV safeguard)
  uint32_t gt;   // tokens above the threshold
  uint32_t eq;   // tokens equal to the threshold
  uint32_t pad;
};

// Output placement of one tile, written by Plan and read by Gather.
struct TilePlan {
  unsigned long long out_base;  // first output row of the tile's kept tokens
  uint32_t eq_base;             // threshold-equal tokens before this tile in its segment
  uint32_t pad;
};

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static constexpr int kPerVec = 4;
  __device__ static inline void Unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
};
template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kPerVec = 8;
  __device__ static inline void Unpack(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  }
};
template <>
struct Elem<__half> {
  static constexpr int kPerVec = 8;
  __device__ static inline void Unpack(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
};

// How a warp covers rows of D elements of T with 16-byte vectors: kLanes lanes per row (a power
// of two <= 32), kVecs vectors per lane, kRowsPerWarp rows per warp step, kF floats per lane.
template <typename T, int D>
struct RowShape {
  static constexpr int kPerVec = Elem<T>::kPerVec;
  static constexpr int kVecsPerRow = D / kPerVec;
  // Two vectors per lane where the row allows: more bytes in flight per load instruction group
  // and one shuffle fewer per row reduction.
  static constexpr int kLanes = kVecsPerRow / 2 < 32 ? kVecsPerRow / 2 : 32;
  static constexpr int kVecs = kVecsPerRow / kLanes;
  static constexpr int kRowsPerWarp = 32 / kLanes;
  static constexpr int kF = kVecs * kPerVec;
  static constexpr int kRowBytes = D * static_cast<int>(sizeof(T));
  // Element index (within the row) of float j of lane `lane`.
  __device__ static inline int Col(int lane, int j) {
    return ((j / kPerVec) * kLanes + lane) * kPerVec + (j % kPerVec);
  }
};

// The lane's raw 16-byte vectors of a row (unpacked at use, so registers hold 16-bit data).
template <typename T, int D>
__device__ inline void LoadRaw(const T* row, int lane, uint4* raw) {
  using S = RowShape<T, D>;
  const uint4* v = reinterpret_cast<const uint4*>(row);
#pragma unroll
  for (int j = 0; j < S::kVecs; ++j) raw[j] = __ldg(v + j * S::kLanes + lane);
}

// Sum over the kLanes lanes of a row group (the groups are aligned, so xor stays inside).
template <int kLanes>
__device__ inline float RowSum(float x) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
  return x;
}

// A row's squared norm from the lanes' raw vectors, summed as the score pass sums it; every lane
// of the warp must call it (shuffles).
template <typename T, int D>
__device__ inline float RawSqNorm(const uint4* raw) {
  using S = RowShape<T, D>;
  float f[S::kF];
#pragma unroll
  for (int j = 0; j < S::kVecs; ++j) Elem<T>::Unpack(raw[j], f + j * S::kPerVec);
  float sq = 0.0f;
#pragma unroll
  for (int j = 0; j < S::kF; ++j) sq = fmaf(f[j], f[j], sq);
  return RowSum<S::kLanes>(sq);
}

__device__ inline uint32_t OrderKey(float s) {
  if (s == 0.0f) s = 0.0f;  // -0 and +0 alike
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ inline bool SqNormBad(float sq) { return !(sq <= FLT_MAX); }

__device__ inline void ReportBad(unsigned long long* slot, unsigned long long flat) {
  atomicMin(slot, flat);
}

// Position and protection of token i of head h (see TokenPositions / IsProtected).
struct PositionInfo {
  const uint32_t* data;  // [H, n] or null
  uint64_t offset;
  uint64_t sequence_length;  // 0 = derived per head
  uint64_t n;

  __device__ inline uint64_t Position(uint32_t h, uint64_t i) const {
    return data != nullptr ? data[uint64_t{h} * n + i] : offset + i;
  }
  __device__ inline uint64_t SequenceLength(uint32_t h) const {
    if (sequence_length != 0) return sequence_length;
    return data != nullptr ? uint64_t{data[uint64_t{h} * n + n - 1]} + 1 : offset + n;
  }
};

// One (request, head) of a varlen batch (ScoreSelectCompactVarlen): the kernels' "heads" are
// then these, request-major. Null in the kernels' params = one view of equal heads.
struct VarHead {
  uint64_t key_offset;  // elements from the keys' start to its token 0
  uint64_t v_offset;    // the same in the values
  uint64_t flat;        // its token 0 in the flat [request, head, token] order (scores, errors)
  uint64_t out_row;     // its first kept row (indices and K/V outputs)
  uint32_t n;           // its tokens
  uint32_t kept;        // tokens it keeps
  uint32_t head;        // its head within the request (the random scorer's head)
  uint32_t pad;
};

__device__ inline uint32_t EffectiveKey(float score, uint64_t position, uint64_t seq_len,
                                        const SelectParams& sel) {
  return IsProtected(position, seq_len, sel) ? kProtectedKey : OrderKey(score);
}

// ---------------------------------------------------------------------------------------------
// Block-wide scans
// ---------------------------------------------------------------------------------------------

// Exclusive prefix sum over the block (blockDim.x == kThreads); returns the thread's exclusive
// prefix and writes the block total to *total. `scratch` holds kThreads / 32 + 1 words.
__device__ inline uint32_t BlockExclusiveScan(uint32_t x, uint32_t* scratch, uint32_t* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  uint32_t inc = x;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const uint32_t y = __shfl_up_sync(0xFFFFFFFFu, inc, o);
    if (lane >= o) inc += y;
  }
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x >> 5;
    uint32_t w = lane < nw ? scratch[lane] : 0;
    uint32_t wi = w;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const uint32_t y = __shfl_up_sync(0xFFFFFFFFu, wi, o);
      if (lane >= o) wi += y;
    }
    if (lane < nw) scratch[lane] = wi - w;
    if (lane == nw - 1) scratch[32] = wi;
  }
  __syncthreads();
  const uint32_t result = scratch[warp] + inc - x;
  *total = scratch[32];
  __syncthreads();
  return result;
}

// ---------------------------------------------------------------------------------------------
// Stats and centres
// ---------------------------------------------------------------------------------------------

struct StatsParams {
  const void* keys;
  uint64_t token_stride;  // elements
  uint64_t head_stride;   // elements
  uint64_t n;
  uint64_t segment;          // tokens per segment (window, or n)
  uint32_t segments;         // ceil(n / segment)
  uint32_t chunks;           // chunks per segment: ceil(min(segment, n) / kStatsRows)
  bool normalize;            // keydiff: sum k / max(||k||, eps)
  uint32_t head0;            // first head of this launch (heads are processed in groups)
  float* partial;            // [H, segments, chunks, D]
  ErrorSlots* errors;
  // First chunk of this launch within each segment (the key sums of a block that just arrived
  // cover a range of chunks); 0 for a whole pass.
  uint32_t chunk0;
  const VarHead* var;  // varlen: one segment per head, `chunks` the longest head's
};

// grid (chunks, segments, H), kThreads threads.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 3) StatsKernel(StatsParams p) {
  using S = RowShape<T, D>;
  __shared__ float red[kThreads / 32][D];
  const uint32_t h = p.head0 + blockIdx.z;
  const uint64_t n = p.var != nullptr ? p.var[h].n : p.n;
  const uint64_t flat0 = p.var != nullptr ? p.var[h].flat : uint64_t{h} * p.n;
  const uint64_t seg0 = uint64_t{blockIdx.y} * p.segment;
  const uint64_t seg_end = p.var != nullptr ? n : min(n, seg0 + p.segment);
  const uint32_t chunk = p.chunk0 + blockIdx.x;
  const uint64_t r0 = seg0 + uint64_t{chunk} * kStatsRows;
  const uint64_t r1 = min(seg_end, r0 + kStatsRows);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane % S::kLanes;
  const int group = lane / S::kLanes;
  const T* base = static_cast<const T*>(p.keys) +
                  (p.var != nullptr ? p.var[h].key_offset : uint64_t{h} * p.head_stride);

  float acc[S::kF];
#pragma unroll
  for (int j = 0; j < S::kF; ++j) acc[j] = 0.0f;
  constexpr int kStep = (kThreads / 32) * S::kRowsPerWarp;
  constexpr int kUnroll = 4;
  // The loop bound is uniform over the warp (shuffles below need every lane); rows past r1
  // are zeros.
  for (uint64_t rw = r0 + warp * S::kRowsPerWarp; rw < r1; rw += kStep * kUnroll) {
    const uint64_t r = rw + group;
    uint4 raw[kUnroll][S::kVecs];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t row = r + static_cast<uint64_t>(u) * kStep;
      if (row < r1) {
        LoadRaw<T, D>(base + row * p.token_stride, sub, raw[u]);
      } else {
#pragma unroll
        for (int j = 0; j < S::kVecs; ++j) raw[u][j] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t row = r + static_cast<uint64_t>(u) * kStep;
      float f[S::kF];
#pragma unroll
      for (int j = 0; j < S::kVecs; ++j) Elem<T>::Unpack(raw[u][j], f + j * S::kPerVec);
      float sq = 0.0f;
#pragma unroll
      for (int j = 0; j < S::kF; ++j) sq = fmaf(f[j], f[j], sq);
      sq = RowSum<S::kLanes>(sq);
      float scale = 1.0f;
      if (row < r1 && SqNormBad(sq)) {
        if (sub == 0) ReportBad(&p.errors->bad_key, flat0 + row);
        scale = 0.0f;
      } else if (p.normalize) {
        scale = 1.0f / fmaxf(sqrtf(sq), kKeyDiffEps);
      }
#pragma unroll
      for (int j = 0; j < S::kF; ++j) acc[j] = fmaf(f[j], scale, acc[j]);
    }
  }
  // Row groups of a warp hold the same columns: fold them, then fold the warps.
#pragma unroll
  for (int o = S::kLanes; o < 32; o *= 2) {
#pragma unroll
    for (int j = 0; j < S::kF; ++j) acc[j] += __shfl_xor_sync(0xFFFFFFFFu, acc[j], o);
  }
  if (group == 0) {
#pragma unroll
    for (int j = 0; j < S::kF; ++j) red[warp][S::Col(sub, j)] = acc[j];
  }
  __syncthreads();
  float* out = p.partial +
               ((uint64_t{h} * p.segments + blockIdx.y) * p.chunks + chunk) * D;
  for (int c = threadIdx.x; c < D; c += kThreads) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) s += red[w][c];
    out[c] = s;
  }
}

struct CentreParams {
  const float* partial;  // [H, segments, chunks, D]
  uint64_t n;
  uint64_t segment;
  uint32_t segments;
  uint32_t chunks;
  uint32_t d;
  uint32_t head0;
  uint32_t heads;  // heads of this launch
  float* centres;  // [H, segments, D]
  // Chunk strides of `partial`: 0 = the Stats layout [H, segments, chunks, D]; else chunks from
  // one head's first to the next (head_chunks) and from one segment's first to the next
  // (segment_chunks): the KeySums layout [H, ceil(n / kStatsRows), D], segments a multiple of
  // kStatsRows tokens. Either way a segment's chunks past its rows count as zeros.
  uint64_t head_chunks;
  uint64_t segment_chunks;
  const VarHead* var;  // varlen: one segment per head, each of its own length
};

inline constexpr int kCentreThreads = 256;

// One warp per (head, segment, column): lane l sums chunks l, l + 32, ... in fp64 (four
// independent accumulators, so the partials' loads overlap), then a fixed shuffle tree. Many
// warps per head, so a launch over one head group fills the chip (the former one block per
// (segment, head) took 14 us at 8 x 128K and made per-group launches slow). The centre's norm
// (keydiff) is taken by the score pass from the centre itself.
// grid ceil(heads * segments * d / (kCentreThreads / 32)), kCentreThreads threads.
__global__ void __launch_bounds__(kCentreThreads) CentreKernel(CentreParams p) {
  const uint64_t warp = (uint64_t{blockIdx.x} * kCentreThreads + threadIdx.x) / 32;
  const uint32_t lane = threadIdx.x & 31;
  const uint64_t total = uint64_t{p.heads} * p.segments * p.d;
  if (warp >= total) return;  // whole warps leave together
  const uint32_t j = static_cast<uint32_t>(warp % p.d);
  const uint64_t hs_local = warp / p.d;  // (head - head0) * segments + segment
  const uint32_t s = static_cast<uint32_t>(hs_local % p.segments);
  const uint64_t hs = uint64_t{p.head0} * p.segments + hs_local;
  const uint64_t seg0 = uint64_t{s} * p.segment;
  const uint64_t len =
      p.var != nullptr ? p.var[hs].n : min(p.n, seg0 + p.segment) - seg0;
  const uint64_t first_chunk = p.head_chunks == 0
                                   ? hs * p.chunks
                                   : (hs / p.segments) * p.head_chunks + s * p.segment_chunks;
  const float* part = p.partial + first_chunk * p.d + j;
  // The same additions in the same order for both layouts: chunks past the segment's rows add 0.
  const uint32_t real = static_cast<uint32_t>((len + kStatsRows - 1) / kStatsRows);
  auto at = [&](uint32_t c) -> double { return c < real ? part[uint64_t{c} * p.d] : 0.0; };
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  uint32_t c = lane;
  for (; c + 96 < p.chunks; c += 128) {
#pragma unroll
    for (int u = 0; u < 4; ++u) acc[u] += at(c + u * 32);
  }
  for (; c < p.chunks; c += 32) acc[0] += at(c);
  double sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
  if (lane == 0) p.centres[hs * p.d + j] = static_cast<float>(sum / static_cast<double>(len));
}

// ---------------------------------------------------------------------------------------------
// Scores
// ---------------------------------------------------------------------------------------------

struct ScoreKernelParams {
  const void* keys;
  uint64_t token_stride;
  uint64_t head_stride;
  uint64_t n;
  Scorer scorer;
  uint64_t segment;  // window (windowed_manifold) or n
  uint32_t segments;
  const float* centres;  // [H, segments, D] (manifold, windowed, keydiff)
  uint32_t n_sink;       // streaming
  uint64_t seed;         // random
  uint64_t stream;
  PositionInfo positions;
  uint32_t head0;
  float* scores;  // [H, n]
  ErrorSlots* errors;
  // Optional: the layer's values, checked for NaN/Inf in the same launch (blocks with
  // blockIdx.y >= heads; bad rows to errors->bad_value, no score written). Null = keys only.
  const void* values;
  uint64_t v_token_stride;
  uint64_t v_head_stride;
  uint32_t heads;  // key heads of the launch (gridDim.y is 2 * heads with values)
  const VarHead* var;  // varlen: the heads' lengths and places (one segment each)
};

// What a scorer reads of each row: only its norm (knorm, streaming, random: the NaN/Inf check),
// its distance to a centre (manifold, windowed_manifold), or its dot product with a centre
// (keydiff).
enum class RowKind { kNorm = 0, kDistance = 1, kDot = 2 };

inline RowKind RowKindOf(Scorer s) {
  switch (s) {
    case Scorer::kManifold:
    case Scorer::kWindowedManifold:
      return RowKind::kDistance;
    case Scorer::kKeyDiff:
      return RowKind::kDot;
    default:
      return RowKind::kNorm;
  }
}

// grid (ceil(n / kScoreRows), H, or 2 H with values), kThreads threads.
template <typename T, int D, RowKind kKind>
__global__ void __launch_bounds__(kThreads, 3) ScoreKernel(ScoreKernelParams p) {
  using S = RowShape<T, D>;
  // Key blocks first (values, when given, after them), each in reverse: key blocks run last
  // rows first, since the Stats pass just before ended on those, so they may still be in L2.
  const bool value_rows = blockIdx.y >= p.heads;
  const uint32_t y = value_rows ? blockIdx.y - p.heads : blockIdx.y;
  const uint32_t h = p.head0 + (p.heads - 1 - y);
  const uint64_t n = p.var != nullptr ? p.var[h].n : p.n;
  const uint64_t flat0 = p.var != nullptr ? p.var[h].flat : uint64_t{h} * p.n;
  const uint32_t head = p.var != nullptr ? p.var[h].head : h;  // the random scorer's head
  const uint64_t r0 = uint64_t{gridDim.x - 1 - blockIdx.x} * kScoreRows;
  if (r0 >= n) return;  // varlen: past this head's tokens (the whole block)
  const uint64_t r1 = min(n, r0 + kScoreRows);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane % S::kLanes;
  const int group = lane / S::kLanes;
  const uint64_t token_stride = value_rows ? p.v_token_stride : p.token_stride;
  const uint64_t offset =
      p.var != nullptr ? (value_rows ? p.var[h].v_offset : p.var[h].key_offset)
                       : uint64_t{h} * (value_rows ? p.v_head_stride : p.head_stride);
  const T* base = static_cast<const T*>(value_rows ? p.values : p.keys) + offset;

  float mu[S::kF];
#pragma unroll
  for (int j = 0; j < S::kF; ++j) mu[j] = 0.0f;
  float mu_norm = 1.0f;
  uint64_t mu_seg = ~uint64_t{0};
  constexpr int kStep = (kThreads / 32) * S::kRowsPerWarp;
  constexpr int kUnroll = 4;
  for (uint64_t rw = r0 + warp * S::kRowsPerWarp; rw < r1; rw += kStep * kUnroll) {
    const uint64_t r = rw + group;
    uint4 raw[kUnroll][S::kVecs];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t row = r + static_cast<uint64_t>(u) * kStep;
      if (row < r1) {
        LoadRaw<T, D>(base + row * token_stride, sub, raw[u]);
      } else {
#pragma unroll
        for (int j = 0; j < S::kVecs; ++j) raw[u][j] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t row = r + static_cast<uint64_t>(u) * kStep;
      // Every lane of a row group takes the same branches (same row); rows past r1 still run
      // the shuffles, with zeros.
      if (kKind != RowKind::kNorm) {
        const uint64_t seg = p.segments == 1 ? 0 : min(row, n - 1) / p.segment;
        if (seg != mu_seg) {
          const float* c = p.centres + (uint64_t{h} * p.segments + seg) * D;
#pragma unroll
          for (int j = 0; j < S::kF; ++j) mu[j] = c[S::Col(sub, j)];
          if (kKind == RowKind::kDot) {
            // ||centre|| from the lanes of the row group (together they hold the whole centre):
            // the same order in every block, so every token sees the same norm.
            float m2 = 0.0f;
#pragma unroll
            for (int j = 0; j < S::kF; ++j) m2 = fmaf(mu[j], mu[j], m2);
            mu_norm = fmaxf(sqrtf(RowSum<S::kLanes>(m2)), kKeyDiffEps);
          }
          mu_seg = seg;
        }
      }
      float f[S::kF];
#pragma unroll
      for (int j = 0; j < S::kVecs; ++j) Elem<T>::Unpack(raw[u][j], f + j * S::kPerVec);
      float sq = 0.0f, other = 0.0f;
#pragma unroll
      for (int j = 0; j < S::kF; ++j) sq = fmaf(f[j], f[j], sq);
      if (kKind == RowKind::kDistance) {
#pragma unroll
        for (int j = 0; j < S::kF; ++j) {
          const float x = f[j] - mu[j];
          other = fmaf(x, x, other);
        }
      } else if (kKind == RowKind::kDot) {
#pragma unroll
        for (int j = 0; j < S::kF; ++j) other = fmaf(f[j], mu[j], other);
      }
      sq = RowSum<S::kLanes>(sq);
      if (kKind != RowKind::kNorm) other = RowSum<S::kLanes>(other);
      if (row >= r1 || sub != 0) continue;
      if (value_rows) {
        if (SqNormBad(sq)) ReportBad(&p.errors->bad_value, flat0 + row);
        continue;
      }
      if (SqNormBad(sq)) ReportBad(&p.errors->bad_key, flat0 + row);
      float s;
      if (kKind == RowKind::kDistance) {
        s = sqrtf(other);
      } else if (kKind == RowKind::kDot) {
        s = -(other / (fmaxf(sqrtf(sq), kKeyDiffEps) * mu_norm));
      } else if (p.scorer == Scorer::kStreaming) {
        s = StreamingScore(p.positions.Position(h, row), p.n_sink);
      } else if (p.scorer == Scorer::kRandom) {
        s = RandomScore(p.seed, p.stream, head, p.positions.Position(h, row));
      } else {
        s = -sqrtf(sq);
      }
      p.scores[flat0 + row] = s;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Selection: radix select, counts, plan
// ---------------------------------------------------------------------------------------------

struct SelectKernelParams {
  const float* scores;  // [H, n]
  uint32_t heads;
  uint64_t n;
  PositionInfo positions;
  SelectParams select;
  const uint8_t* pre;   // [H, n] tokens kept by an earlier stage (excluded here), or null
  bool per_head;        // segments are heads (else one segment: the whole layer)
  SegmentState* state;  // [segments]
  uint32_t* hist;       // [segments, kRadixBins]
  ErrorSlots* errors;
};

// Tiles per histogram block. 8 was measured slower on the H200 (22 vs 11 us a pass at 8 x 128K:
// too few blocks, each thread's loads in series), so one.
inline constexpr int kHistTiles = 1;

// One digit pass. grid (ceil(n / (kTile * kHistTiles)), H), kThreads threads.
__global__ void __launch_bounds__(kThreads) RadixHistKernel(SelectKernelParams p, int pass) {
  __shared__ uint32_t hist[kRadixBins];
  const uint32_t h = blockIdx.y;
  const uint32_t seg = p.per_head ? h : 0;
  const SegmentState st = p.state[seg];
  if (!st.active) return;
  for (int b = threadIdx.x; b < kRadixBins; b += kThreads) hist[b] = 0;
  __syncthreads();
  const int shift = RadixShift(pass);
  const uint32_t digit_mask = (1u << RadixBits(pass)) - 1;
  const int high = shift + RadixBits(pass);  // bits at and above `high` are fixed
  const uint64_t seq_len = p.positions.SequenceLength(h);
  const uint64_t t0 = uint64_t{blockIdx.x} * kTile * kHistTiles;
  const uint64_t t1 = min(p.n, t0 + uint64_t{kTile} * kHistTiles);
  for (uint64_t t = t0 + threadIdx.x; t < t1; t += kThreads) {
    const uint64_t flat = uint64_t{h} * p.n + t;
    if (p.pre != nullptr && p.pre[flat]) continue;
    const float s = p.scores[flat];
    if (pass == 0 && !(fabsf(s) <= FLT_MAX)) ReportBad(&p.errors->bad_score, flat);
    const uint32_t key = EffectiveKey(s, p.positions.Position(h, t), seq_len, p.select);
    if (high < 32 && (key >> high) != (st.prefix >> high)) continue;
    atomicAdd(&hist[(key >> shift) & digit_mask], 1u);
  }
  __syncthreads();
  uint32_t* g = p.hist + uint64_t{seg} * kRadixBins;
  for (int b = threadIdx.x; b < kRadixBins; b += kThreads) {
    if (hist[b] != 0) atomicAdd(&g[b], hist[b]);
  }
}

// Picks the digit holding the need-th largest key. grid (segments), kThreads threads.
__global__ void __launch_bounds__(kThreads) RadixFindKernel(SegmentState* state, uint32_t* hist,
                                                            int pass) {
  __shared__ uint32_t scratch[33];
  __shared__ uint32_t found_digit, found_above;
  const uint32_t seg = blockIdx.x;
  SegmentState* st = state + seg;
  uint32_t* g = hist + uint64_t{seg} * kRadixBins;
  if (!st->active) return;
  if (threadIdx.x == 0) {
    found_digit = 0;
    found_above = 0;
  }
  const int bins = 1 << RadixBits(pass);
  constexpr int kPer = kRadixBins / kThreads;  // 8 bins per thread, from the top digit down
  uint32_t c[kPer];
  uint32_t sum = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int d = bins - 1 - (threadIdx.x * kPer + i);
    c[i] = d >= 0 ? g[d] : 0;
    sum += c[i];
  }
  uint32_t total;
  const uint32_t before = BlockExclusiveScan(sum, scratch, &total);
  const uint32_t need = st->need;
  if (before < need && need <= before + sum) {
    uint32_t acc = before;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (acc < need && need <= acc + c[i]) {
        found_digit = bins - 1 - (threadIdx.x * kPer + i);
        found_above = acc;
      }
      acc += c[i];
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kRadixBins; b += kThreads) g[b] = 0;
  if (threadIdx.x == 0) {
    st->prefix |= found_digit << RadixShift(pass);
    st->need = need - found_above;
  }
}

struct CountParams {
  SelectKernelParams sel;  // scores, positions, pre, per_head, state
  uint32_t tiles;          // tiles per head
  TileCounts* counts;      // [H, tiles]
};

__device__ inline void Classify(const SelectKernelParams& p, uint32_t h, uint64_t t,
                                uint64_t seq_len, const SegmentState& st, uint32_t* pre,
                                uint32_t* gt, uint32_t* eq) {
  const uint64_t flat = uint64_t{h} * p.n + t;
  *pre = *gt = *eq = 0;
  if (p.pre != nullptr && p.pre[flat]) {
    *pre = 1;
    return;
  }
  if (!st.active) return;
  const uint32_t key = EffectiveKey(p.scores[flat], p.positions.Position(h, t), seq_len, p.select);
  *gt = key > st.prefix;
  *eq = key == st.prefix;
}

// grid (tiles, H), kThreads threads.
__global__ void __launch_bounds__(kThreads) CountKernel(CountParams c) {
  __shared__ uint32_t red[3][kThreads / 32];
  const SelectKernelParams& p = c.sel;
  const uint32_t h = blockIdx.y;
  const SegmentState st = p.state[p.per_head ? h : 0];
  const uint64_t seq_len = p.positions.SequenceLength(h);
  const uint64_t t0 = uint64_t{blockIdx.x} * kTile;
  const uint64_t t1 = min(p.n, t0 + kTile);
  uint32_t pre = 0, gt = 0, eq = 0;
  for (uint64_t t = t0 + threadIdx.x; t < t1; t += kThreads) {
    uint32_t a, b, e;
    Classify(p, h, t, seq_len, st, &a, &b, &e);
    pre += a;
    gt += b;
    eq += e;
  }
  for (int o = 16; o > 0; o /= 2) {
    pre += __shfl_xor_sync(0xFFFFFFFFu, pre, o);
    gt += __shfl_xor_sync(0xFFFFFFFFu, gt, o);
    eq += __shfl_xor_sync(0xFFFFFFFFu, eq, o);
  }
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    red[0][warp] = pre;
    red[1][warp] = gt;
    red[2][warp] = eq;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    TileCounts out{0, 0, 0, 0};
    for (int w = 0; w < kThreads / 32; ++w) {
      out.pre += red[0][w];
      out.gt += red[1][w];
      out.eq += red[2][w];
    }
    c.counts[uint64_t{h} * c.tiles + blockIdx.x] = out;
  }
}

struct PlanParams {
  const TileCounts* counts;  // [H, tiles]
  const SegmentState* state;
  bool per_head;
  // Non-zero when every head keeps exactly this many tokens (a per-head stage with nothing
  // pre-kept): head h's rows then start at h * rows_per_head and heads are planned in parallel,
  // one block each.
  uint64_t rows_per_head;
  uint32_t heads;
  uint32_t tiles;
  TilePlan* plan;             // [H, tiles]
  uint32_t* kept_counts;      // [H] (the caller's KeptIndices::counts)
  unsigned long long* total;  // total kept rows (workspace)
};

// One block of kThreads threads walks the tiles in (head, tile) order; with rows_per_head, one
// block per head (grid (H)).
__global__ void __launch_bounds__(kThreads) PlanKernel(PlanParams p) {
  __shared__ uint32_t scratch[33];
  const bool parallel = p.rows_per_head != 0;
  unsigned long long out_base = parallel ? blockIdx.x * p.rows_per_head : 0;
  uint32_t eq_running = 0;
  const uint32_t h_begin = parallel ? blockIdx.x : 0;
  const uint32_t h_end = parallel ? blockIdx.x + 1 : p.heads;
  for (uint32_t h = h_begin; h < h_end; ++h) {
    const SegmentState st = p.state[p.per_head ? h : 0];
    if (p.per_head) eq_running = 0;
    uint32_t kept_head = 0;
    for (uint32_t t0 = 0; t0 < p.tiles; t0 += kThreads) {
      const uint32_t t = t0 + threadIdx.x;
      TileCounts c{0, 0, 0, 0};
      if (t < p.tiles) c = p.counts[uint64_t{h} * p.tiles + t];
      uint32_t eq_total;
      const uint32_t eq_before = eq_running + BlockExclusiveScan(c.eq, scratch, &eq_total);
      const uint32_t need = st.active ? st.need : 0;
      const uint32_t eq_kept =
          eq_before >= need ? 0 : (need - eq_before < c.eq ? need - eq_before : c.eq);
      const uint32_t kept = c.pre + c.gt + eq_kept;
      uint32_t kept_total;
      const uint32_t kept_before = BlockExclusiveScan(kept, scratch, &kept_total);
      if (t < p.tiles) {
        p.plan[uint64_t{h} * p.tiles + t] = TilePlan{out_base + kept_head + kept_before, eq_before,
                                                     0};
      }
      eq_running += eq_total;
      kept_head += kept_total;
    }
    if (threadIdx.x == 0) p.kept_counts[h] = kept_head;
    out_base += kept_head;
  }
  if (threadIdx.x == 0 && !parallel) *p.total = out_base;
}

// ---------------------------------------------------------------------------------------------
// Gather: keep flags, indices and the row copies
// ---------------------------------------------------------------------------------------------

struct GatherParams {
  CountParams count;  // selection inputs and tiles
  const TilePlan* plan;
  uint8_t* mark;       // optional [H, n]: set to 1 for kept tokens (AdaKV's safeguard stage)
  uint32_t* indices;   // optional: kept indices (ragged, ascending per head)
  const void* keys;    // optional: rows to copy (with values)
  const void* values;
  uint64_t token_stride;
  uint64_t head_stride;
  uint64_t v_token_stride;
  uint64_t v_head_stride;
  void* keys_out;
  void* values_out;
  // Rows the outputs hold: a row beyond is never written, whatever the selection says.
  uint64_t capacity;
  // Optional: the values' data check, here instead of in the score pass, so V is read once: the
  // kept rows as they are copied, then the tile's evicted rows; the first bad row (head * n +
  // token) goes here.
  unsigned long long* bad_value;
};

__device__ inline void CopyRow16(const uint4* src, uint4* dst, int sub, int vecs, int lanes) {
  for (int v = sub; v < vecs; v += lanes) __stcs(dst + v, __ldcs(src + v));
}

// grid (tiles, H), kThreads threads; kTile / kThreads tokens per thread.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) GatherKernel(GatherParams g) {
  using S = RowShape<T, D>;
  constexpr int kPer = kTile / kThreads;
  __shared__ uint32_t scratch[33];
  __shared__ uint32_t src_row[kTile];
  __shared__ uint32_t ev_row[kTile];  // the tile's evicted tokens (values' check only)
  __shared__ uint32_t n_kept;
  const SelectKernelParams& p = g.count.sel;
  const uint32_t h = blockIdx.y;
  const SegmentState st = p.state[p.per_head ? h : 0];
  const uint64_t seq_len = p.positions.SequenceLength(h);
  const uint64_t t0 = uint64_t{blockIdx.x} * kTile;
  const TilePlan plan = g.plan[uint64_t{h} * g.count.tiles + blockIdx.x];
  // Thread i owns tokens t0 + i*kPer .. + kPer (consecutive, so index order is scan order).
  uint32_t pre[kPer], gt[kPer], eq[kPer];
  uint32_t eq_sum = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const uint64_t t = t0 + threadIdx.x * kPer + k;
    pre[k] = gt[k] = eq[k] = 0;
    if (t < p.n) Classify(p, h, t, seq_len, st, &pre[k], &gt[k], &eq[k]);
    eq_sum += eq[k];
  }
  uint32_t eq_total;
  uint32_t eq_rank = plan.eq_base + BlockExclusiveScan(eq_sum, scratch, &eq_total);
  const uint32_t need = st.active ? st.need : 0;
  uint32_t keep_bits = 0, keep_sum = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    bool keep = pre[k] || gt[k];
    if (eq[k]) {
      keep = keep || eq_rank < need;
      ++eq_rank;
    }
    keep_bits |= static_cast<uint32_t>(keep) << k;
    keep_sum += keep;
  }
  uint32_t kept_total;
  uint32_t pos = BlockExclusiveScan(keep_sum, scratch, &kept_total);
  const uint32_t tile_len = static_cast<uint32_t>(min(static_cast<uint64_t>(kTile), p.n - t0));
  // Tokens before this thread's that are not kept (every token before it is in range).
  uint32_t ev = min(tile_len, static_cast<uint32_t>(threadIdx.x) * kPer) - pos;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const uint32_t t = static_cast<uint32_t>(t0 + threadIdx.x * kPer + k);
    if (keep_bits & (1u << k)) {
      src_row[pos] = t;
      if (g.indices != nullptr && plan.out_base + pos < g.capacity) {
        g.indices[plan.out_base + pos] = t;
      }
      if (g.mark != nullptr) g.mark[uint64_t{h} * p.n + t] = 1;
      ++pos;
    } else if (g.bad_value != nullptr && t < p.n) {
      ev_row[ev++] = t;
    }
  }
  if (threadIdx.x == 0) n_kept = kept_total;
  __syncthreads();
  if (g.keys_out == nullptr) return;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane % S::kLanes;
  const int group = lane / S::kLanes;
  constexpr int kVecsPerRow = S::kVecsPerRow;
  const T* kbase = static_cast<const T*>(g.keys) + uint64_t{h} * g.head_stride;
  const T* vbase = static_cast<const T*>(g.values) + uint64_t{h} * g.v_head_stride;
  uint4* kout = reinterpret_cast<uint4*>(g.keys_out);
  uint4* vout = reinterpret_cast<uint4*>(g.values_out);
  constexpr int kStep = (kThreads / 32) * S::kRowsPerWarp;
  const uint32_t total = n_kept;
  const bool check = g.bad_value != nullptr;
  constexpr int kUnroll = 4;
  // Warp-uniform loop bounds (the values' check shuffles); rows past the end are zeros.
  for (uint32_t eb = warp * S::kRowsPerWarp; eb < total; eb += kStep * kUnroll) {
    const uint32_t e = eb + group;
    uint4 kv[kUnroll][S::kVecs], vv[kUnroll][S::kVecs];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t ee = e + u * kStep;
      if (ee < total) {
        const uint64_t t = src_row[ee];
        const uint4* ks = reinterpret_cast<const uint4*>(kbase + t * g.token_stride);
        const uint4* vs = reinterpret_cast<const uint4*>(vbase + t * g.v_token_stride);
#pragma unroll
        for (int j = 0; j < S::kVecs; ++j) {
          kv[u][j] = __ldcs(ks + j * S::kLanes + sub);
          vv[u][j] = __ldcs(vs + j * S::kLanes + sub);
        }
      } else {
#pragma unroll
        for (int j = 0; j < S::kVecs; ++j) vv[u][j] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t ee = e + u * kStep;
      if (check) {
        const float sq = RawSqNorm<T, D>(vv[u]);
        if (ee < total && sub == 0 && SqNormBad(sq)) {
          ReportBad(g.bad_value, uint64_t{h} * p.n + src_row[ee]);
        }
      }
      if (ee < total && plan.out_base + ee < g.capacity) {
        const uint64_t out_row = plan.out_base + ee;
#pragma unroll
        for (int j = 0; j < S::kVecs; ++j) {
          __stcs(kout + out_row * kVecsPerRow + j * S::kLanes + sub, kv[u][j]);
          __stcs(vout + out_row * kVecsPerRow + j * S::kLanes + sub, vv[u][j]);
        }
      }
    }
  }
  if (!check) return;
  const uint32_t n_ev = tile_len - total;
  for (uint32_t eb = warp * S::kRowsPerWarp; eb < n_ev; eb += kStep * kUnroll) {
    const uint32_t e = eb + group;
    uint4 vv[kUnroll][S::kVecs];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t ee = e + u * kStep;
#pragma unroll
      for (int j = 0; j < S::kVecs; ++j) {
        vv[u][j] = ee < n_ev ? __ldcs(reinterpret_cast<const uint4*>(
                                          vbase + uint64_t{ev_row[ee]} * g.v_token_stride) +
                                      j * S::kLanes + sub)
                             : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t ee = e + u * kStep;
      const float sq = RawSqNorm<T, D>(vv[u]);
      if (ee < n_ev && sub == 0 && SqNormBad(sq)) {
        ReportBad(g.bad_value, uint64_t{h} * p.n + ev_row[ee]);
      }
    }
  }
}

// Gather of given (counts, indices): grid (ceil(max rows / kTile), H). Row offsets from `offsets`
// ([H + 1], device). Used by ScoringOps::Compact.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) CompactKernel(const T* keys, const T* values,
                                                          uint64_t token_stride,
                                                          uint64_t head_stride,
                                                          uint64_t v_token_stride,
                                                          uint64_t v_head_stride,
                                                          const unsigned long long* offsets,
                                                          const uint32_t* indices, T* keys_out,
                                                          T* values_out) {
  using S = RowShape<T, D>;
  const uint32_t h = blockIdx.y;
  const unsigned long long begin = offsets[h];
  const unsigned long long end = offsets[h + 1];
  const uint64_t r0 = begin + uint64_t{blockIdx.x} * kTile;
  if (r0 >= end) return;
  const uint64_t r1 = min(static_cast<uint64_t>(end), r0 + kTile);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane % S::kLanes;
  const int group = lane / S::kLanes;
  constexpr int kStep = (kThreads / 32) * S::kRowsPerWarp;
  for (uint64_t r = r0 + warp * S::kRowsPerWarp + group; r < r1; r += kStep) {
    const uint64_t t = indices[r];
    const uint4* ks = reinterpret_cast<const uint4*>(keys + uint64_t{h} * head_stride +
                                                     t * token_stride);
    const uint4* vs = reinterpret_cast<const uint4*>(values + uint64_t{h} * v_head_stride +
                                                     t * v_token_stride);
    uint4* kd = reinterpret_cast<uint4*>(keys_out + r * D);
    uint4* vd = reinterpret_cast<uint4*>(values_out + r * D);
    CopyRow16(ks, kd, sub, S::kVecsPerRow, S::kLanes);
    CopyRow16(vs, vd, sub, S::kVecsPerRow, S::kLanes);
  }
}

// ---------------------------------------------------------------------------------------------
// The whole selection of a head in shared memory: one block, or one thread-block cluster (sm_90)
// ---------------------------------------------------------------------------------------------
//
// BlockSelectKernel<false>: one block per head (up to kShortSelectCapacity tokens; a varlen
// batch's heads too). BlockSelectKernel<true>: longer heads split over the C blocks of a cluster
// (C = 1..8, consecutive slices of about n / C tokens, each held in its block's shared memory).
// The keys are read with 16-byte loads, all of a thread's in flight at once. A radix pass builds
// each block's histogram of its slice, a thread adding a run of keys that fall in one bin once
// (scores crowd into a few bins of the first digit, and lanes adding to one bin serialise). In a
// cluster, block r then sums bins [r, r + 1) * 2048 / C over the cluster's histograms (one load
// from each block per bin, all in flight, through distributed shared memory), and every block
// finds the digit from the C shares' totals and the bins of the one share that holds it. The
// closing pass ranks the kept and evicted tokens a warp's 32 tokens at a time (ballots), so the
// index writes are coalesced; the earlier slices' counts come from the other blocks as atomic
// adds. One launch instead of the tiled path's ten.

inline constexpr int kSelectThreads = 1024;
inline constexpr int kSelectWarps = kSelectThreads / 32;

__host__ inline size_t BlockSelectSmem(uint64_t slice) { return slice * sizeof(uint32_t); }

struct BlockSelectParams {
  const float* scores;  // [H, n]
  uint32_t heads;
  uint64_t n;
  uint32_t kept;  // tokens kept per head, min(kept_per_head, n), >= 1
  PositionInfo positions;
  SelectParams select;
  uint32_t* counts;   // [H]: kept
  uint32_t* indices;  // [H * kept], head h's ascending indices at h * kept
  ErrorSlots* errors;
  const VarHead* var;  // varlen (one block per head only): each head's tokens, budget, place
  // Optional: the evicted tokens ascending, for the values' check in GatherRows: head h's at
  // h * (n - kept) ([H, n - kept]), a varlen head's at its `flat`.
  uint32_t* evicted;
};

// The group operations of BlockSelectKernel: a thread-block cluster's (sm_90), or for one block
// the block's own. Below sm_90 the cluster form traps (the host launches it only where clusters
// exist).
template <bool kCluster>
struct SelectGroup {
  __device__ static uint32_t Blocks() { return 1; }
  __device__ static uint32_t Rank() { return 0; }
  __device__ static uint32_t* At(uint32_t* a, uint32_t) { return a; }  // rank q's copy of a
  __device__ static void Sync() { __syncthreads(); }
  __device__ static void Arrive() {}
  __device__ static void Wait() {}
};
template <>
struct SelectGroup<true> {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  __device__ static uint32_t Blocks() { return cooperative_groups::this_cluster().num_blocks(); }
  __device__ static uint32_t Rank() { return cooperative_groups::this_cluster().block_rank(); }
  __device__ static uint32_t* At(uint32_t* a, uint32_t q) {
    return cooperative_groups::this_cluster().map_shared_rank(a, q);
  }
  __device__ static void Sync() { cooperative_groups::this_cluster().sync(); }
  __device__ static void Arrive() { cooperative_groups::this_cluster().barrier_arrive(); }
  __device__ static void Wait() { cooperative_groups::this_cluster().barrier_wait(); }
#else
  __device__ static uint32_t Blocks() {
    __trap();
    return 1;
  }
  __device__ static uint32_t Rank() { return 0; }
  __device__ static uint32_t* At(uint32_t* a, uint32_t) { return a; }
  __device__ static void Sync() {}
  __device__ static void Arrive() {}
  __device__ static void Wait() {}
#endif
};

// kCluster false: grid (H), BlockSelectSmem(longest head) bytes of dynamic shared memory, slice
// ignored. kCluster true: grid (C * H) in clusters of C, BlockSelectSmem(slice) bytes, slice =
// ceil(n / C) rounded up to a multiple of 4, p.var null. kSelectThreads threads.
template <bool kCluster>
__global__ void __launch_bounds__(kSelectThreads)
    BlockSelectKernel(BlockSelectParams p, uint32_t slice) {
  using G = SelectGroup<kCluster>;
  extern __shared__ __align__(16) uint32_t keys[];
  __shared__ uint32_t local[kRadixBins];   // this slice's histogram
  __shared__ uint32_t summed[kCluster ? kRadixBins : 1];  // this block's share, over the cluster
  __shared__ uint32_t scratch[33];
  __shared__ uint32_t share_total;         // the sum of summed[]
  __shared__ uint32_t totals[kClusterMaxBlocks];  // every block's share_total
  __shared__ uint32_t earlier[2];          // above / equal to the threshold in earlier slices
  __shared__ uint32_t warp_counts[kSelectWarps][2];
  __shared__ uint32_t found_digit, found_above;
  const uint32_t blocks = G::Blocks();
  const uint32_t rank = G::Rank();
  const uint32_t h = blockIdx.x / blocks;
  const VarHead* var = kCluster ? nullptr : p.var;
  const uint32_t n = static_cast<uint32_t>(var != nullptr ? var[h].n : p.n);
  const uint32_t kept_n = var != nullptr ? var[h].kept : p.kept;
  const uint64_t flat0 = var != nullptr ? var[h].flat : uint64_t{h} * p.n;
  // A varlen head's positions are 0..n-1 of its own request.
  const PositionInfo pos = var != nullptr ? PositionInfo{nullptr, 0, 0, n} : p.positions;
  const uint64_t seq_len = pos.SequenceLength(h);
  if constexpr (!kCluster) slice = n;
  const uint32_t s0 = min(n, rank * slice);
  const uint32_t len = min(n, s0 + slice) - s0;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int b = threadIdx.x; b < kRadixBins; b += kSelectThreads) local[b] = 0;
  if (threadIdx.x < 2) earlier[threadIdx.x] = 0;
  // Every block's `earlier` is zero (and every block has started) before another adds to it;
  // the wait comes after the loads.
  G::Arrive();
  // The slice's effective keys, four scores per 16-byte load where the slice starts on one
  // (the host makes cluster slices a multiple of 4 tokens), kLoads loads of a thread in flight.
  constexpr int kLoads = 4;
  const float* src = p.scores + flat0 + s0;
  // The effective key of the slice's score i (a non-finite score reported).
  auto key_of = [&](float f, uint32_t i) {
    const uint64_t t = s0 + i;
    if (!(fabsf(f) <= FLT_MAX)) ReportBad(&p.errors->bad_score, flat0 + t);
    return EffectiveKey(f, pos.Position(h, t), seq_len, p.select);
  };
  const bool vector = (reinterpret_cast<uintptr_t>(src) & 15) == 0;
  const uint32_t head_len = vector ? len / 4 * 4 : 0;  // scores taken four at a time
  for (uint32_t base = 0; base < head_len; base += kSelectThreads * kLoads * 4) {
    float4 s[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const uint32_t i = base + (u * kSelectThreads + threadIdx.x) * 4;
      s[u] = i < head_len ? __ldcg(reinterpret_cast<const float4*>(src + i))
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const uint32_t i = base + (u * kSelectThreads + threadIdx.x) * 4;
      if (i >= head_len) continue;
      const float f[4] = {s[u].x, s[u].y, s[u].z, s[u].w};
      uint32_t kw[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) kw[e] = key_of(f[e], i + e);
      *reinterpret_cast<uint4*>(keys + i) = make_uint4(kw[0], kw[1], kw[2], kw[3]);
    }
  }
  for (uint32_t i = head_len + threadIdx.x; i < len; i += kSelectThreads) {
    keys[i] = key_of(__ldcg(src + i), i);
  }
  __syncthreads();
  G::Wait();
  const uint32_t share = kRadixBins / blocks;  // bins [rank * share, (rank + 1) * share)
  uint32_t prefix = 0, need = kept_n;
  for (int pass = 0; pass < kRadixPasses; ++pass) {
    const int shift = RadixShift(pass);
    const uint32_t digit_mask = (1u << RadixBits(pass)) - 1;
    const int high = shift + RadixBits(pass);
    uint32_t run_bin = 0, run = 0;
    for (uint32_t i = threadIdx.x; i < len; i += kSelectThreads) {
      const uint32_t key = keys[i];
      if (high < 32 && (key >> high) != (prefix >> high)) continue;
      const uint32_t bin = (key >> shift) & digit_mask;
      if (run != 0 && bin == run_bin) {
        ++run;
        continue;
      }
      if (run != 0) atomicAdd(&local[run_bin], run);
      run_bin = bin;
      run = 1;
    }
    if (run != 0) atomicAdd(&local[run_bin], run);
    G::Sync();  // every block's histogram is complete
    uint32_t qs = 0, share_above = 0;  // the share holding the need-th largest key
    const uint32_t* bins = local;
    if constexpr (kCluster) {
      uint32_t part = 0;
      for (uint32_t j = threadIdx.x; j < share; j += kSelectThreads) {
        const uint32_t b = rank * share + j;
        uint32_t v[kClusterMaxBlocks];
#pragma unroll
        for (uint32_t q = 0; q < kClusterMaxBlocks; ++q) {
          v[q] = q < blocks ? G::At(local, q)[b] : 0;
        }
        uint32_t x = 0;
#pragma unroll
        for (uint32_t q = 0; q < kClusterMaxBlocks; ++q) x += v[q];
        summed[j] = x;
        part += x;
      }
      uint32_t share_sum;
      BlockExclusiveScan(part, scratch, &share_sum);
      if (threadIdx.x == 0) share_total = share_sum;
      G::Sync();  // every share is summed; no block reads the histograms any more
      for (int b = threadIdx.x; b < kRadixBins; b += kSelectThreads) local[b] = 0;
      if (threadIdx.x < blocks) totals[threadIdx.x] = *G::At(&share_total, threadIdx.x);
      __syncthreads();
      // Shares from the top digit down.
      for (uint32_t q = blocks, acc = 0; q-- > 0;) {
        if (acc + totals[q] >= need) {
          qs = q;
          share_above = acc;
          break;
        }
        acc += totals[q];
      }
      bins = G::At(summed, qs);
    }
    // The digit, bins of the share from its top down.
    constexpr int kPer = kRadixBins / kSelectThreads;  // a share has at most 2048 bins
    uint32_t c[kPer];
    uint32_t sum = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int j = static_cast<int>(share) - 1 - (static_cast<int>(threadIdx.x) * kPer + i);
      c[i] = j >= 0 ? bins[j] : 0;
      sum += c[i];
    }
    uint32_t total;
    const uint32_t before = share_above + BlockExclusiveScan(sum, scratch, &total);
    if (before < need && need <= before + sum) {
      uint32_t acc = before;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        if (acc < need && need <= acc + c[i]) {
          found_digit = qs * share + share - 1 - (threadIdx.x * kPer + i);
          found_above = acc;
        }
        acc += c[i];
      }
    }
    if constexpr (!kCluster) {  // read above (the scan's barriers order it before this)
      for (int b = threadIdx.x; b < kRadixBins; b += kSelectThreads) local[b] = 0;
    }
    __syncthreads();
    prefix |= found_digit << shift;
    need -= found_above;
    __syncthreads();  // found_* are rewritten by the next pass
  }
  // prefix is the threshold key; the first `need` tokens of the head equal to it are kept.
  // Warp w owns the consecutive keys [w * per, (w + 1) * per) of the slice, 32 at a time.
  const uint32_t per = (len + kSelectWarps * 32 - 1) / (kSelectWarps * 32) * 32;
  const uint32_t w0 = min(len, warp * per), w1 = min(len, w0 + per);
  uint32_t gt = 0, eq = 0;
  for (uint32_t i = w0 + lane; i < w1; i += 32) {
    const uint32_t key = keys[i];
    gt += key > prefix;
    eq += key == prefix;
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    gt += __shfl_xor_sync(0xFFFFFFFFu, gt, o);
    eq += __shfl_xor_sync(0xFFFFFFFFu, eq, o);
  }
  if (lane == 0) {
    warp_counts[warp][0] = gt;
    warp_counts[warp][1] = eq;
  }
  __syncthreads();
  uint32_t gt_warp = 0, eq_warp = 0, gt_block = 0, eq_block = 0;  // before this warp; the block's
  for (int w = 0; w < kSelectWarps; ++w) {
    if (w == warp) {
      gt_warp = gt_block;
      eq_warp = eq_block;
    }
    gt_block += warp_counts[w][0];
    eq_block += warp_counts[w][1];
  }
  if constexpr (kCluster) {
    // This slice's counts into every later block's.
    if (threadIdx.x > rank && threadIdx.x < blocks) {
      uint32_t* other = G::At(earlier, threadIdx.x);
      if (gt_block != 0) atomicAdd(other, gt_block);
      if (eq_block != 0) atomicAdd(other + 1, eq_block);
    }
    G::Sync();  // the last access to another block's shared memory is before this
  }
  uint32_t eq_rank = earlier[1] + eq_warp;  // equal tokens of the head before the warp's next
  const uint32_t gt_before = earlier[0] + gt_warp;
  uint32_t kept_at = gt_before + min(eq_rank, need);
  uint32_t ev_at = s0 + w0 - kept_at;
  uint32_t* out = p.indices + (var != nullptr ? var[h].out_row : uint64_t{h} * kept_n);
  uint32_t* ev_out = p.evicted == nullptr ? nullptr
                     : var != nullptr     ? p.evicted + flat0
                                          : p.evicted + uint64_t{h} * (n - kept_n);
  const uint32_t lower = (1u << lane) - 1;
  for (uint32_t base = w0; base < w1; base += 32) {
    const uint32_t i = base + lane;
    const bool valid = i < w1;
    const uint32_t key = valid ? keys[i] : 0;
    const bool is_eq = valid && key == prefix;
    const uint32_t eq_mask = __ballot_sync(0xFFFFFFFFu, is_eq);
    const bool keep =
        valid && (key > prefix || (is_eq && eq_rank + __popc(eq_mask & lower) < need));
    const uint32_t keep_mask = __ballot_sync(0xFFFFFFFFu, keep);
    const uint32_t drop_mask = __ballot_sync(0xFFFFFFFFu, valid && !keep);
    if (keep) {
      const uint32_t at = kept_at + __popc(keep_mask & lower);
      if (at < kept_n) out[at] = s0 + i;
    } else if (valid && ev_out != nullptr) {
      const uint32_t at = ev_at + __popc(drop_mask & lower);
      if (at < n - kept_n) ev_out[at] = s0 + i;
    }
    kept_at += __popc(keep_mask);
    ev_at += __popc(drop_mask);
    eq_rank += __popc(eq_mask);
  }
  if (rank == 0 && threadIdx.x == 0) p.counts[h] = kept_n;
}

inline constexpr int kGatherRowsPerBlock = 128;

struct GatherRowsParams {
  const void* keys;
  const void* values;
  uint64_t token_stride, head_stride, v_token_stride, v_head_stride;  // elements
  uint32_t kept;              // rows per head
  const uint32_t* indices;    // [H * kept]
  void* keys_out;             // [H * kept, D]
  void* values_out;
  const VarHead* var;  // varlen: each head's budget, rows and output place
  // Optional: the values' check here, so V is read once: the kept rows as they are copied, and
  // blocks past ceil(kept / kGatherRowsPerBlock) check the evicted rows listed in `evicted`
  // (BlockSelect's layout); the first bad row (head * n + token, a varlen head's flat + token)
  // goes to bad_value.
  unsigned long long* bad_value;
  const uint32_t* evicted;
  uint64_t n;
};

// grid (ceil(kept / kGatherRowsPerBlock), H), kThreads threads: every row load of a thread is
// issued before its stores.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) GatherRowsKernel(GatherRowsParams g) {
  using S = RowShape<T, D>;
  constexpr int kStep = (kThreads / 32) * S::kRowsPerWarp;
  constexpr int kUnroll = 4;
  const uint32_t h = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane % S::kLanes;
  const int group = lane / S::kLanes;
  const bool var = g.var != nullptr;
  const uint32_t kept = var ? g.var[h].kept : g.kept;
  const bool check = g.bad_value != nullptr;
  const uint64_t n = var ? g.var[h].n : g.n;
  const uint64_t flat0 = var ? g.var[h].flat : uint64_t{h} * g.n;  // of the head's token 0
  const uint32_t kept_blocks = (kept + kGatherRowsPerBlock - 1) / kGatherRowsPerBlock;
  const T* vbase = static_cast<const T*>(g.values) +
                   (var ? g.var[h].v_offset : uint64_t{h} * g.v_head_stride);
  if (check && blockIdx.x >= kept_blocks) {  // the evicted rows' values check
    const uint32_t n_ev = static_cast<uint32_t>(n) - kept;
    const uint32_t e0 = (blockIdx.x - kept_blocks) * kGatherRowsPerBlock;
    if (e0 >= n_ev) return;
    const uint32_t e1 = min(n_ev, e0 + kGatherRowsPerBlock);
    const uint32_t* ev = g.evicted + (var ? flat0 : uint64_t{h} * n_ev);
    for (uint32_t eb = e0 + warp * S::kRowsPerWarp; eb < e1; eb += kStep * kUnroll) {
      uint4 vv[kUnroll][S::kVecs];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t e = eb + group + u * kStep;
#pragma unroll
        for (int j = 0; j < S::kVecs; ++j) {
          vv[u][j] = e < e1 ? __ldcs(reinterpret_cast<const uint4*>(
                                         vbase + uint64_t{ev[e]} * g.v_token_stride) +
                                     j * S::kLanes + sub)
                            : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t e = eb + group + u * kStep;
        const float sq = RawSqNorm<T, D>(vv[u]);
        if (e < e1 && sub == 0 && SqNormBad(sq)) ReportBad(g.bad_value, flat0 + ev[e]);
      }
    }
    return;
  }
  const uint32_t r0 = blockIdx.x * kGatherRowsPerBlock;
  if (r0 >= kept) return;
  const uint32_t r1 = min(kept, r0 + kGatherRowsPerBlock);
  const T* kbase = static_cast<const T*>(g.keys) +
                   (var ? g.var[h].key_offset : uint64_t{h} * g.head_stride);
  const uint64_t out0 = var ? g.var[h].out_row : uint64_t{h} * g.kept;
  uint4* kout = reinterpret_cast<uint4*>(g.keys_out);
  uint4* vout = reinterpret_cast<uint4*>(g.values_out);
  // Warp-uniform loop bounds (the values' check shuffles); rows past r1 are zeros.
  for (uint32_t rw = r0 + warp * S::kRowsPerWarp; rw < r1; rw += kStep * kUnroll) {
    const uint32_t rb = rw + group;
    uint4 kv[kUnroll][S::kVecs], vv[kUnroll][S::kVecs];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t r = rb + u * kStep;
      if (r < r1) {
        const uint64_t t = g.indices[out0 + r];
        const uint4* ks = reinterpret_cast<const uint4*>(kbase + t * g.token_stride);
        const uint4* vs = reinterpret_cast<const uint4*>(vbase + t * g.v_token_stride);
#pragma unroll
        for (int j = 0; j < S::kVecs; ++j) {
          kv[u][j] = __ldcs(ks + j * S::kLanes + sub);
          vv[u][j] = __ldcs(vs + j * S::kLanes + sub);
        }
      } else {
#pragma unroll
        for (int j = 0; j < S::kVecs; ++j) vv[u][j] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t r = rb + u * kStep;
      if (check) {
        const float sq = RawSqNorm<T, D>(vv[u]);
        if (r < r1 && sub == 0 && SqNormBad(sq)) {
          ReportBad(g.bad_value, flat0 + g.indices[out0 + r]);
        }
      }
      if (r < r1) {
        const uint64_t o = (out0 + r) * S::kVecsPerRow;
#pragma unroll
        for (int j = 0; j < S::kVecs; ++j) {
          __stcs(kout + o + j * S::kLanes + sub, kv[u][j]);
          __stcs(vout + o + j * S::kLanes + sub, vv[u][j]);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Streaming in one pass: the kept set known from the positions alone
// ---------------------------------------------------------------------------------------------

inline constexpr int kEndsRowsPerBlock = 256;

struct StreamingEndsParams {
  const void* keys;
  const void* values;
  uint64_t token_stride, head_stride, v_token_stride, v_head_stride;  // elements
  uint64_t n;
  uint32_t kept;   // per head, <= n
  uint32_t sinks;  // tokens [0, sinks) kept, then the last kept - sinks
  uint32_t n_sink;  // the scorer's (StreamingScore)
  float* scores;    // optional [H, n]
  uint32_t* counts;
  uint32_t* indices;  // [H * kept]
  void* keys_out;     // [H * kept, D]
  void* values_out;
  ErrorSlots* errors;
};

// grid (ceil(n / kEndsRowsPerBlock), H), kThreads threads. Every key and value row is read once
// and held to the data check (bad_key, bad_value: head * n + token, lowest first); rows
// [0, sinks) and [n - (kept - sinks), n) are copied out with their indices, as the selection of
// the streaming scores keeps them (StreamingKeepsEnds on the host); the scores, when asked for,
// are the scorer's (the position, or the sink score).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) StreamingEndsKernel(StreamingEndsParams p) {
  using S = RowShape<T, D>;
  constexpr int kStep = (kThreads / 32) * S::kRowsPerWarp;
  constexpr int kUnroll = 2;
  const uint32_t h = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane % S::kLanes;
  const int group = lane / S::kLanes;
  const uint64_t r0 = uint64_t{blockIdx.x} * kEndsRowsPerBlock;
  if (blockIdx.x == 0 && threadIdx.x == 0) p.counts[h] = p.kept;
  if (r0 >= p.n) return;
  const uint64_t r1 = min(p.n, r0 + kEndsRowsPerBlock);
  const uint64_t tail0 = p.n - (p.kept - p.sinks);  // first token of the kept tail
  const uint64_t flat0 = uint64_t{h} * p.n;
  const uint64_t out0 = uint64_t{h} * p.kept;
  const T* kbase = static_cast<const T*>(p.keys) + uint64_t{h} * p.head_stride;
  const T* vbase = static_cast<const T*>(p.values) + uint64_t{h} * p.v_head_stride;
  uint4* kout = reinterpret_cast<uint4*>(p.keys_out);
  uint4* vout = reinterpret_cast<uint4*>(p.values_out);
  // Warp-uniform loop bounds (the row norms shuffle); rows past r1 are zeros.
  for (uint64_t rw = r0 + warp * S::kRowsPerWarp; rw < r1; rw += kStep * kUnroll) {
    uint4 kv[kUnroll][S::kVecs], vv[kUnroll][S::kVecs];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t r = rw + group + u * kStep;
      const uint4* ks = reinterpret_cast<const uint4*>(kbase + r * p.token_stride);
      const uint4* vs = reinterpret_cast<const uint4*>(vbase + r * p.v_token_stride);
#pragma unroll
      for (int j = 0; j < S::kVecs; ++j) {
        kv[u][j] = r < r1 ? __ldcs(ks + j * S::kLanes + sub) : make_uint4(0, 0, 0, 0);
        vv[u][j] = r < r1 ? __ldcs(vs + j * S::kLanes + sub) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t r = rw + group + u * kStep;
      const float ksq = RawSqNorm<T, D>(kv[u]);
      const float vsq = RawSqNorm<T, D>(vv[u]);
      if (r >= r1) continue;
      if (sub == 0) {
        if (SqNormBad(ksq)) ReportBad(&p.errors->bad_key, flat0 + r);
        if (SqNormBad(vsq)) ReportBad(&p.errors->bad_value, flat0 + r);
        if (p.scores != nullptr) p.scores[flat0 + r] = StreamingScore(r, p.n_sink);
      }
      const bool keep = r < p.sinks || r >= tail0;
      if (!keep) continue;
      const uint64_t j = out0 + (r < p.sinks ? r : p.sinks + (r - tail0));
      if (sub == 0) p.indices[j] = static_cast<uint32_t>(r);
      const uint64_t o = j * S::kVecsPerRow;
#pragma unroll
      for (int w = 0; w < S::kVecs; ++w) {
        __stcs(kout + o + w * S::kLanes + sub, kv[u][w]);
        __stcs(vout + o + w * S::kLanes + sub, vv[u][w]);
      }
    }
  }
}

}  // namespace cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_SCORING_KERNELS_CUH_
