// Moment-aware eviction's rescoring (cpu/moments_aware.h: MomentAwareRescore) on the device, for
// a group of heads whose keys and scores are in device memory, in six or seven launches:
//  1. one block per head finds the provisional eviction by radix select over the effective
//     scores (the kept-th largest, then the equal ones by lower index; the keys staged in shared
//     memory up to kStagedTokens) and marks the evicted tokens;
//  2. the evicted keys are summed in f64 per chunk of kMomentAwareMeanChunk tokens in token
//     order, and the chunks in chunk order (the reference's sum, so the same mean to the bit);
//  3. each token's distance to its head's mean, summed in f64 in channel order and rounded to
//     f32, is its distance key;
//  4. every token's rank in both orders (ties by lower index): each tile of kBlockSortTokens
//     tokens of a head sorts each key set in one block (a stable block radix sort in shared
//     memory, one block per tile, head and set); heads of up to kMaxRankTiles tiles then add to
//     each token's place in its tile the keys before it in the other tiles (a merge of the
//     tiles' sorted keys: one binary search and galloping steps a thread and tile), longer heads
//     (or all of more than one tile with KVCOMP_RESCORE_TILED_RANKS=0) go through one stable
//     device radix sort of both sets, (set, head, 32-bit key) with the layer-wide index as
//     payload;
//  5. the combined scores are written from the two ranks.
// So the rescored f32 scores are the reference's bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <cub/block/block_radix_sort.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/util_type.cuh>
#include <limits>
#include <type_traits>

#include "../cpu/moments_aware.h"
#include "block_radix_select.cuh"
#include "../env_switch.h"
#include "absl/strings/str_format.h"
#include "cuda_status.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/allocator.h"

namespace kvcomp {
namespace moments_internal {
namespace {

constexpr unsigned kEvictThreads = 1024;  // one block per head
constexpr unsigned kEvictWarps = kEvictThreads / 32;
constexpr unsigned kMeanThreads = 256;
constexpr uint64_t kStagedTokens = 40960;  // effective keys in shared memory (160 KiB) up to this
constexpr unsigned kSortThreads = 512;
constexpr unsigned kSortItems = 16;
constexpr uint64_t kBlockSortTokens = kSortThreads * kSortItems;  // a tile ranked by one block
constexpr uint64_t kMaxRankTiles = 8;  // longer heads go through the device sort

template <typename T>
__device__ __forceinline__ double LoadD(const T* p);
template <>
__device__ __forceinline__ double LoadD<float>(const float* p) { return *p; }
template <>
__device__ __forceinline__ double LoadD<__half>(const __half* p) { return __half2float(*p); }
template <>
__device__ __forceinline__ double LoadD<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}

using block_select::BlockRadixSelect;
using EvictShared = block_select::RadixSelectShared<kEvictWarps>;

// Unsigned bits that order like the float (no NaN; -0 taken as +0 by the caller).
__device__ __forceinline__ uint32_t OrderBits(float x) { return block_select::FloatOrderKey(x); }

// One block per head: the provisional eviction (all but the `kept` highest effective scores,
// protected tokens +inf, ties by lower index: the reference's nth_element order) as a byte per
// token; with `keys` set, also the scores' sort keys (set 0: (head, rising score)) with the
// layer-wide index. kStaged: the effective keys read once into dynamic shared memory, eight
// reads a thread in flight. After the radix select, each warp takes one contiguous segment of
// the tokens: it counts the keys above and equal to the selected one in its segment, a block
// prefix of the warps' equal counts gives each segment its first equal token's place among the
// head's, and a second walk marks the tokens (three block barriers in all, not two a step).
constexpr uint32_t kStageBatch = 8;

// kMatch: BlockRadixSelect's digit matching (KVCOMP_RESCORE_SELECT_MATCH=1; by default the
// lanes of the first counted lane's digit add once, the others one each).
template <bool kStaged, bool kMatch>
__global__ void __launch_bounds__(kEvictThreads) EvictKernel(
    const float* scores, uint32_t heads, uint64_t n, uint64_t kept, const uint32_t* positions,
    uint64_t offset, uint64_t seq, SelectParams select, uint8_t* evicted, uint64_t* keys,
    uint32_t* idx) {
  __shared__ EvictShared sh;
  __shared__ uint32_t equal_before[kEvictWarps];
  extern __shared__ uint32_t staged[];
  const uint64_t h = blockIdx.x;
  const float* s = scores + h * n;
  const uint32_t* p = positions != nullptr ? positions + h * n : nullptr;
  auto plain_of = [](float x) { return OrderBits(x == 0.0f ? 0.0f : x); };
  auto eff_of = [&](uint64_t t) {
    const uint64_t pos = p != nullptr ? p[t] : offset + t;
    return IsProtected(pos, seq, select) ? OrderBits(std::numeric_limits<float>::infinity())
                                         : plain_of(s[t]);
  };
  if (kStaged || keys != nullptr) {
    for (uint64_t t0 = 0; t0 < n; t0 += uint64_t{kStageBatch} * blockDim.x) {
      // The batch's reads first (all in flight), then its writes.
      float x[kStageBatch];
      uint64_t pos[kStageBatch];
#pragma unroll
      for (uint32_t j = 0; j < kStageBatch; ++j) {
        const uint64_t t = t0 + j * blockDim.x + threadIdx.x;
        x[j] = t < n ? s[t] : 0.0f;
        pos[j] = t < n && p != nullptr ? p[t] : offset + t;
      }
#pragma unroll
      for (uint32_t j = 0; j < kStageBatch; ++j) {
        const uint64_t t = t0 + j * blockDim.x + threadIdx.x;
        if (t >= n) break;
        const uint32_t plain = plain_of(x[j]);
        if (kStaged) {
          staged[t] = IsProtected(pos[j], seq, select)
                          ? OrderBits(std::numeric_limits<float>::infinity())
                          : plain;
        }
        if (keys != nullptr) {
          keys[h * n + t] = (h << 32) | plain;
          idx[h * n + t] = static_cast<uint32_t>(h * n + t);
        }
      }
    }
    __syncthreads();
  }
  auto eff = [&](uint64_t t) { return kStaged ? staged[t] : eff_of(t); };
  // The kept-th largest effective key; tokens above it stay, those below go, and of the equal
  // ones the `need` of lowest index stay.
  const uint32_t kth = BlockRadixSelect<uint64_t, kEvictWarps, decltype(eff), kMatch>(
      n, n - kept, sh, eff);
  const uint32_t lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  // Warp w's segment: [w seg, (w + 1) seg), whole steps of 32 tokens.
  const uint64_t seg = (n + 32 * kEvictWarps - 1) / (32 * kEvictWarps) * 32;
  const uint64_t s0 = min(n, uint64_t{w} * seg), s1 = min(n, s0 + seg);
  uint32_t above = 0, equal = 0;
  for (uint64_t t0 = s0; t0 < s1; t0 += 32) {
    const uint64_t t = t0 + lane;
    const uint32_t key = t < s1 ? eff(t) : 0;
    above += __popc(__ballot_sync(0xffffffffu, t < s1 && key > kth));
    equal += __popc(__ballot_sync(0xffffffffu, t < s1 && key == kth));
  }
  if (lane == 0) {
    sh.warp[w] = equal;
    if (above != 0) atomicAdd(&sh.count, above);
  }
  __syncthreads();
  if (w == 0) {
    // Exclusive prefix of the warps' equal counts.
    const uint32_t mine = lane < kEvictWarps ? sh.warp[lane] : 0;
    uint32_t incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t up = __shfl_up_sync(0xffffffffu, incl, o);
      if (static_cast<int>(lane) >= o) incl += up;
    }
    if (lane < kEvictWarps) equal_before[lane] = incl - mine;
  }
  __syncthreads();
  const uint64_t need = kept - sh.count;
  uint64_t before = equal_before[w];  // equal tokens before this step of the segment
  uint8_t* e = evicted + h * n;
  for (uint64_t t0 = s0; t0 < s1; t0 += 32) {
    const uint64_t t = t0 + lane;
    const uint32_t key = t < s1 ? eff(t) : 0;
    const bool eq = t < s1 && key == kth;
    const uint32_t ballot = __ballot_sync(0xffffffffu, eq);
    const uint64_t rank = before + __popc(ballot & ((1u << lane) - 1u));
    if (t < s1) e[t] = key < kth || (eq && rank >= need) ? 1 : 0;
    before += __popc(ballot);
  }
}

// The f64 sums of each chunk's evicted keys in token order (kMomentAwareMeanChunk tokens a
// chunk): a thread sums V channels of one chunk; a block holds kMeanThreads / lanes chunks of
// one head (blockIdx.x the chunk group, blockIdx.y the head).
template <typename T, uint32_t V>
__global__ void __launch_bounds__(kMeanThreads) MeanPartialKernel(
    const T* keys, uint64_t head_stride, uint64_t token_stride, uint32_t d, uint64_t n,
    uint64_t chunks, uint32_t lanes, const uint8_t* evicted, double* partial) {
  const uint64_t h = blockIdx.y;
  const uint32_t lane = threadIdx.x % lanes;
  const uint64_t c = uint64_t{blockIdx.x} * (kMeanThreads / lanes) + threadIdx.x / lanes;
  if (c >= chunks || threadIdx.x / lanes >= kMeanThreads / lanes) return;
  const uint64_t t0 = c * kMomentAwareMeanChunk;
  const uint64_t t1 = min(n, t0 + kMomentAwareMeanChunk);
  const T* kh = keys + h * head_stride;
  const uint8_t* e = evicted + h * n;
  double* out = partial + (h * chunks + c) * d;
  constexpr uint32_t kBatch = V > 1 ? 16 : 8;  // rows in flight a thread, added in token order
  for (uint32_t x0 = lane * V; x0 < d; x0 += lanes * V) {
    double acc[V];
#pragma unroll
    for (uint32_t j = 0; j < V; ++j) acc[j] = 0.0;
    for (uint64_t tb = t0; tb < t1; tb += kBatch) {
      using Piece = std::conditional_t<(V > 1), uint4, T>;
      Piece w[kBatch];
      uint32_t on = 0;  // bit b: row tb + b is evicted
#pragma unroll
      for (uint32_t b = 0; b < kBatch; ++b) {
        const uint64_t t = tb + b;
        if (t < t1 && e[t] != 0) {
          on |= 1u << b;
          w[b] = __ldg(reinterpret_cast<const Piece*>(kh + t * token_stride + x0));
        }
      }
#pragma unroll
      for (uint32_t b = 0; b < kBatch; ++b) {
        if (((on >> b) & 1u) == 0) continue;
        const T* v = reinterpret_cast<const T*>(&w[b]);
#pragma unroll
        for (uint32_t j = 0; j < V; ++j) acc[j] = __dadd_rn(acc[j], LoadD(v + j));
      }
    }
#pragma unroll
    for (uint32_t j = 0; j < V; ++j) out[x0 + j] = acc[j];
  }
}

// mu = (sum of the chunks' sums in chunk order, from +0) / count.
__global__ void MeanKernel(const double* partial, uint32_t d, uint64_t chunks, uint64_t count,
                           double* mu) {
  const uint64_t h = blockIdx.x;
  for (uint32_t x = threadIdx.x; x < d; x += blockDim.x) {
    double acc = 0.0;
#pragma unroll 8
    for (uint64_t c = 0; c < chunks; ++c) acc = __dadd_rn(acc, partial[(h * chunks + c) * d + x]);
    mu[h * d + x] = acc / static_cast<double>(count);
  }
}

// ||k_t - mu|| per token in f64, channels in order (the reference's sum), rounded to f32: the
// distance key (distances are >= +0, so their bits order like them), written as set 1's sort key
// ((heads + head, rising distance) with the layer-wide index) when `sort_keys` is set, else as
// 32 bits into `dist`. One thread per token reads its row itself, 128 bytes at a time as eight
// 16-byte loads when rows are 16-byte aligned (`vec`); the head's mean comes from L1.
template <typename T>
__global__ void __launch_bounds__(256) DistanceKernel(const T* keys, uint64_t head_stride,
                                                      uint64_t token_stride, uint32_t d,
                                                      uint32_t heads, uint64_t n,
                                                      const double* mu, bool vec,
                                                      uint64_t* sort_keys, uint32_t* idx,
                                                      uint32_t* dist) {
  constexpr uint32_t kLoads = 8;
  const uint64_t total = uint64_t{heads} * n;
  const uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const uint64_t h = i / n, t = i - h * n;
  const T* k = keys + h * head_stride + t * token_stride;
  const double* m = mu + h * d;
  double acc = 0.0;
  if (vec) {
    constexpr uint32_t kVec = 16 / sizeof(T);
    for (uint32_t x0 = 0; x0 < d; x0 += kLoads * kVec) {
      uint4 w[kLoads];
#pragma unroll
      for (uint32_t j = 0; j < kLoads; ++j) {
        w[j] = x0 + j * kVec < d ? __ldg(reinterpret_cast<const uint4*>(k + x0 + j * kVec))
                                 : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (uint32_t j = 0; j < kLoads; ++j) {
        if (x0 + j * kVec >= d) break;
        const T* e = reinterpret_cast<const T*>(&w[j]);
#pragma unroll
        for (uint32_t q = 0; q < kVec; ++q) {
          const double diff = __dsub_rn(LoadD(e + q), __ldg(m + x0 + j * kVec + q));
          acc = __dadd_rn(acc, __dmul_rn(diff, diff));
        }
      }
    }
  } else {
    for (uint32_t x = 0; x < d; ++x) {
      const double diff = __dsub_rn(LoadD(k + x), __ldg(m + x));
      acc = __dadd_rn(acc, __dmul_rn(diff, diff));
    }
  }
  const uint32_t bits = __float_as_uint(__double2float_rn(sqrt(acc)));
  if (sort_keys != nullptr) {
    sort_keys[total + i] = ((uint64_t{heads} + h) << 32) | bits;
    idx[total + i] = static_cast<uint32_t>(i);
  } else {
    dist[i] = bits;
  }
}

// The 32-bit key token i (layer-wide index) is ranked by: its score's order bits (set 0) or
// its distance key (set 1).
__device__ __forceinline__ uint32_t RankKey(const float* scores, const uint32_t* dist,
                                            bool distances, uint64_t i) {
  if (distances) return dist[i];
  const float x = scores[i];
  return OrderBits(x == 0.0f ? 0.0f : x);
}

// Ranks within tiles of kBlockSortTokens tokens: block (b, t) sorts tile t of b's keys (b <
// heads: head b's scores, set 0; heads + h: head h's distances, set 1) by a stable block radix
// sort of the 32-bit keys with the token as payload (tokens past the tile's end sort last: the
// largest key, later in the input) and writes each token's place in its tile into `rank`; with
// `sorted` (heads of several tiles), also the tile's keys in that order, for MergeRankKernel. A
// head of one tile is ranked here.
__global__ void __launch_bounds__(kSortThreads, 1) BlockRankKernel(const float* scores,
                                                                   const uint32_t* dist,
                                                                   uint32_t heads, uint64_t n,
                                                                   uint32_t tiles, uint32_t* rank,
                                                                   uint32_t* sorted) {
  using Sort = cub::BlockRadixSort<uint32_t, kSortThreads, kSortItems, uint32_t>;
  __shared__ typename Sort::TempStorage temp;
  const uint32_t b = blockIdx.x, tile = blockIdx.y;
  const bool distances = b >= heads;
  const uint64_t h = distances ? b - heads : b;
  const uint64_t total = uint64_t{heads} * n;
  const uint64_t t0 = uint64_t{tile} * kBlockSortTokens;
  const uint64_t len = n - t0 < kBlockSortTokens ? n - t0 : kBlockSortTokens;
  uint32_t key[kSortItems], token[kSortItems];
#pragma unroll
  for (uint32_t j = 0; j < kSortItems; ++j) {
    const uint32_t t = threadIdx.x * kSortItems + j;
    token[j] = t;
    key[j] = t < len ? RankKey(scores, dist, distances, h * n + t0 + t) : 0xffffffffu;
  }
  Sort(temp).Sort(key, token);
  uint32_t* r = rank + (distances ? total : 0) + h * n + t0;
  // The tile's keys in order, then (a block of as many words on) their tokens.
  uint32_t* out = sorted != nullptr ? sorted + (uint64_t{b} * tiles + tile) * 2 * kBlockSortTokens
                                    : nullptr;
#pragma unroll
  for (uint32_t j = 0; j < kSortItems; ++j) {
    const uint32_t p = threadIdx.x * kSortItems + j;
    if (token[j] < len) r[token[j]] = p;
    if (out != nullptr && p < len) {
      out[p] = key[j];
      out[kBlockSortTokens + p] = token[j];
    }
  }
}

// Heads of several tiles (after BlockRankKernel): a token's rank is its place in its tile plus,
// in each other tile, the keys that rank before it (a tile before its own: keys at most its
// key, as lower indices rank first on ties; a tile after it: keys below its key). Block (b, t)
// takes tile t of b's keys in their sorted order, kSortItems consecutive keys a thread; the other
// tiles' sorted keys are staged in shared memory one at a time, and as a thread's keys rise so do
// their counts: its first key's count is a binary search, each next one a galloping search
// onward from the last (a few steps where the tiles interleave).
__global__ void __launch_bounds__(kSortThreads) MergeRankKernel(uint32_t heads, uint64_t n,
                                                               uint32_t tiles,
                                                               const uint32_t* sorted,
                                                               uint32_t* rank) {
  __shared__ uint32_t other[kBlockSortTokens];
  const uint32_t b = blockIdx.x, tile = blockIdx.y;
  const bool distances = b >= heads;
  const uint64_t h = distances ? b - heads : b;
  const uint64_t total = uint64_t{heads} * n;
  const uint64_t t0 = uint64_t{tile} * kBlockSortTokens;
  const uint32_t len = static_cast<uint32_t>(n - t0 < kBlockSortTokens ? n - t0 : kBlockSortTokens);
  const uint32_t* own = sorted + (uint64_t{b} * tiles + tile) * 2 * kBlockSortTokens;
  const uint32_t p0 = threadIdx.x * kSortItems;
  uint32_t key[kSortItems], add[kSortItems];
#pragma unroll
  for (uint32_t j = 0; j < kSortItems; ++j) {
    key[j] = p0 + j < len ? own[p0 + j] : 0xffffffffu;
    add[j] = 0;
  }
  for (uint32_t u = 0; u < tiles; ++u) {
    if (u == tile) continue;  // the same for the whole block
    const uint64_t u0 = uint64_t{u} * kBlockSortTokens;
    const uint32_t ulen = static_cast<uint32_t>(n - u0 < kBlockSortTokens ? n - u0 : kBlockSortTokens);
    const uint32_t* src = sorted + (uint64_t{b} * tiles + u) * 2 * kBlockSortTokens;
    __syncthreads();  // the previous tile's searches are done
    for (uint32_t i = threadIdx.x; i < ulen; i += kSortThreads) other[i] = src[i];
    __syncthreads();
    if (p0 >= len) continue;
    const bool before = u < tile;
    auto ranks_first = [&](uint32_t v, uint32_t k) { return before ? v <= k : v < k; };
    // The first key: the count of keys in `other` that rank before it, by binary search.
    uint32_t lo = 0, hi = ulen;
    while (lo < hi) {
      const uint32_t mid = (lo + hi) >> 1;
      if (ranks_first(other[mid], key[0])) lo = mid + 1; else hi = mid;
    }
    add[0] += lo;
#pragma unroll
    for (uint32_t j = 1; j < kSortItems; ++j) {
      // key[j] >= key[j - 1]: its count is at least lo. Gallop: [lo, hi) brackets it.
      uint32_t step = 1;
      hi = lo;
      while (hi < ulen && ranks_first(other[hi], key[j])) {
        lo = hi + 1;
        hi += step;
        step <<= 1;
      }
      if (hi > ulen) hi = ulen;
      while (lo < hi) {
        const uint32_t mid = (lo + hi) >> 1;
        if (ranks_first(other[mid], key[j])) lo = mid + 1; else hi = mid;
      }
      add[j] += lo;
    }
  }
  uint32_t* r = rank + (distances ? total : 0) + h * n + t0;
#pragma unroll
  for (uint32_t j = 0; j < kSortItems; ++j) {
    if (p0 + j < len) r[own[kBlockSortTokens + p0 + j]] = p0 + j + add[j];
  }
}

// Each token's rank within its head in both rising orders: sorted place p holds set/head
// p / n (every head has n tokens), rank p % n.
__global__ void RankKernel(const uint32_t* order, uint64_t total, uint64_t n, uint32_t heads,
                           uint32_t* rank) {
  for (uint64_t p = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; p < 2 * total;
       p += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t seg = p / n;
    rank[(seg >= heads ? total : 0) + order[p]] = static_cast<uint32_t>(p - seg * n);
  }
}

// score'_t = (1 - beta) pct(score_t) + beta pct(dist_t), pct = rank / (n - 1).
__global__ void WriteScoresKernel(const uint32_t* rank_s, const uint32_t* rank_d, uint64_t total,
                                  uint64_t n, double beta, float* scores) {
  const double denom = n > 1 ? static_cast<double>(n - 1) : 1.0;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const double ps = static_cast<double>(rank_s[i]) / denom;
    const double pd = static_cast<double>(rank_d[i]) / denom;
    scores[i] = static_cast<float>(__dadd_rn(__dmul_rn(1.0 - beta, ps), __dmul_rn(beta, pd)));
  }
}

unsigned Blocks(uint64_t n) {
  return static_cast<unsigned>(std::max<uint64_t>(1, std::min<uint64_t>((n + 255) / 256, 65535)));
}

template <typename T, uint32_t V>
void LaunchMean(cudaStream_t stream, const T* k, const HeadsView& keys, uint64_t chunks,
                const uint8_t* evicted, double* partial) {
  const uint32_t d = keys.head_dim;
  const uint32_t lanes = std::min<uint32_t>(kMeanThreads, (d + V - 1) / V);
  const uint64_t per_block = kMeanThreads / lanes;
  const dim3 grid(static_cast<unsigned>((chunks + per_block - 1) / per_block), keys.num_heads);
  MeanPartialKernel<T, V><<<grid, kMeanThreads, 0, stream>>>(
      k, keys.head_stride, keys.token_stride, d, keys.num_tokens, chunks, lanes, evicted,
      partial);
}

template <typename T>
absl::Status Rescore(cudaStream_t stream, Allocator& allocator, const HeadsView& keys,
                     const SelectParams& select, const TokenPositions& positions,
                     uint64_t kept, float* scores) {
  const uint32_t heads = keys.num_heads, d = keys.head_dim;
  const uint64_t n = keys.num_tokens, total = uint64_t{heads} * n;
  const uint64_t seq =
      positions.sequence_length > 0 ? positions.sequence_length : positions.offset + n;
  const uint64_t chunks = (n + kMomentAwareMeanChunk - 1) / kMomentAwareMeanChunk;
  // Heads of one tile are ranked by one block a set, heads of up to kMaxRankTiles tiles too
  // (one block a tile, then a merge of the tiles' counts); KVCOMP_RESCORE_TILED_RANKS=0 ranks
  // those through the device sort (for comparison).
  static const bool tiled_ranks = internal::SwitchOn("KVCOMP_RESCORE_TILED_RANKS");
  const uint64_t tiles = (n + kBlockSortTokens - 1) / kBlockSortTokens;
  const bool block_sort = tiles == 1 || (tiled_ranks && tiles <= kMaxRankTiles);
  // The tiles' sorted keys and their tokens, both sets.
  const uint64_t sorted_words = block_sort && tiles > 1 ? 4 * heads * tiles * kBlockSortTokens : 0;
  int seg_bits = 1;
  while ((uint64_t{1} << seg_bits) < 2 * uint64_t{heads}) ++seg_bits;
  auto alloc = [&](uint64_t bytes) { return Buffer::Allocate(allocator, bytes); };
  // Ranks of both sets and the eviction bytes; the distance keys (block sort) or the device
  // sort's keys and payloads of both sets (double buffers).
  const uint64_t words = (block_sort ? 3 * total + sorted_words : 6 * total);
  KVCOMP_ASSIGN_OR_RETURN(Buffer u32, alloc(words * sizeof(uint32_t) + total));
  Buffer u64;
  if (!block_sort) {
    KVCOMP_ASSIGN_OR_RETURN(u64, alloc(4 * total * sizeof(uint64_t)));
  }
  KVCOMP_ASSIGN_OR_RETURN(Buffer mu_buf,
                          alloc((uint64_t{heads} * chunks + heads) * d * sizeof(double)));
  uint32_t* rank = u32.as<uint32_t>();
  uint32_t* val_a = rank + 2 * total;  // the distance keys under the block sort
  uint32_t* val_b = val_a + 2 * total;
  uint32_t* sorted = sorted_words > 0 ? rank + 3 * total : nullptr;  // the tiles' sorted keys
  uint8_t* evicted = reinterpret_cast<uint8_t*>(rank + words);
  uint64_t* key_a = block_sort ? nullptr : u64.as<uint64_t>();
  uint64_t* key_b = block_sort ? nullptr : key_a + 2 * total;
  double* partial = mu_buf.as<double>();
  double* mu = partial + uint64_t{heads} * chunks * d;
  cub::DoubleBuffer<uint64_t> sort_keys(key_a, key_b);
  cub::DoubleBuffer<uint32_t> sort_vals(val_a, val_b);
  const int items = static_cast<int>(2 * total);
  const int bits = 32 + seg_bits;
  size_t temp_bytes = 0;
  Buffer temp;
  if (!block_sort) {
    KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
        nullptr, temp_bytes, sort_keys, sort_vals, items, 0, bits, stream));
    KVCOMP_ASSIGN_OR_RETURN(temp, alloc(std::max<size_t>(temp_bytes, 1)));
  }

  // The effective keys in shared memory when the device's opt-in limit holds them (the
  // attribute always set to the same bound, so concurrent callers agree on it).
  int device = 0, optin = 0;
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  KVCOMP_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const uint64_t staged_max = std::min<uint64_t>(
      kStagedTokens, optin > 4096 ? (static_cast<uint64_t>(optin) - 4096) / sizeof(uint32_t) : 0);
  // The select without digit matching; KVCOMP_RESCORE_SELECT_MATCH=1 matches (for comparison).
  static const bool match = [] {
    const char* env = std::getenv("KVCOMP_RESCORE_SELECT_MATCH");
    return env != nullptr && std::strcmp(env, "1") == 0;
  }();
  auto evict = [&](auto staged_tag, auto match_tag) -> cudaError_t {
    constexpr bool kStaged = decltype(staged_tag)::value, kMatch = decltype(match_tag)::value;
    if (kStaged) {
      const cudaError_t e = cudaFuncSetAttribute(EvictKernel<true, kMatch>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(staged_max * sizeof(uint32_t)));
      if (e != cudaSuccess) return e;
    }
    EvictKernel<kStaged, kMatch><<<heads, kEvictThreads, kStaged ? n * sizeof(uint32_t) : 0,
                                   stream>>>(scores, heads, n, kept, positions.data,
                                             positions.offset, seq, select, evicted, key_a, val_a);
    return cudaGetLastError();
  };
  using True = std::true_type;
  using False = std::false_type;
  const bool staged = n <= staged_max;
  KVCOMP_CUDA_RETURN_IF_ERROR(staged ? (match ? evict(True{}, True{}) : evict(True{}, False{}))
                                     : (match ? evict(False{}, True{}) : evict(False{}, False{})));
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const T* k = static_cast<const T*>(keys.data);
  const bool vec = d % (16 / sizeof(T)) == 0 && (keys.token_stride * sizeof(T)) % 16 == 0 &&
                   (keys.head_stride * sizeof(T)) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(keys.data) % 16 == 0;
  if (vec) {
    LaunchMean<T, 16 / sizeof(T)>(stream, k, keys, chunks, evicted, partial);
  } else {
    LaunchMean<T, 1>(stream, k, keys, chunks, evicted, partial);
  }
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  MeanKernel<<<heads, std::min<unsigned>(256, (d + 31) / 32 * 32), 0, stream>>>(
      partial, d, chunks, n - kept, mu);
  DistanceKernel<T><<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(
      k, keys.head_stride, keys.token_stride, d, heads, n, mu, vec, key_a, val_a, val_a);
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (block_sort) {
    const dim3 grid(2 * heads, static_cast<unsigned>(tiles));
    BlockRankKernel<<<grid, kSortThreads, 0, stream>>>(scores, val_a, heads, n,
                                                       static_cast<uint32_t>(tiles), rank, sorted);
    if (tiles > 1) {
      KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      MergeRankKernel<<<grid, kSortThreads, 0, stream>>>(heads, n, static_cast<uint32_t>(tiles),
                                                         sorted, rank);
    }
  } else {
    // Both ranks from one stable sort: (set, head) above the 32-bit key, payload the index.
    KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
        temp.data(), temp_bytes, sort_keys, sort_vals, items, 0, bits, stream));
    RankKernel<<<Blocks(2 * total), 256, 0, stream>>>(sort_vals.Current(), total, n, heads,
                                                      rank);
  }
  WriteScoresKernel<<<Blocks(total), 256, 0, stream>>>(rank, rank + total, total, n,
                                                       kMomentAwareBeta, scores);
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace

absl::Status MomentAwareRescoreOnDevice(void* stream, Allocator& allocator, const HeadsView& keys,
                                        const SelectParams& select,
                                        const TokenPositions& positions, float* scores) {
  if (keys.space != MemorySpace::kDevice || !IsInputDType(keys.dtype) || keys.head_dim == 0 ||
      keys.token_stride < keys.head_dim || scores == nullptr) {
    return absl::InvalidArgumentError("moment-aware eviction: bad keys or scores");
  }
  const uint64_t n = keys.num_tokens;
  const uint64_t kept = std::min<uint64_t>(select.kept_per_head, n);
  if (kept == 0) return absl::InvalidArgumentError("moment-aware eviction: budget of zero");
  if (kept >= n || keys.num_heads == 0) return absl::OkStatus();
  // Both sets of sort keys go through one sort of int-counted items; the heads are a grid row.
  if (uint64_t{keys.num_heads} * n >= (uint64_t{1} << 30) || keys.num_heads > 65535) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "moment-aware eviction (CUDA): %u heads x %u tokens in one layer is too many",
        keys.num_heads, n));
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (keys.dtype) {
    case DType::kF32:
      return Rescore<float>(s, allocator, keys, select, positions, kept, scores);
    case DType::kF16:
      return Rescore<__half>(s, allocator, keys, select, positions, kept, scores);
    default:
      return Rescore<__nv_bfloat16>(s, allocator, keys, select, positions, kept, scores);
  }
}

}  // namespace moments_internal
}  // namespace kvcomp
