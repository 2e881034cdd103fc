// Moment-aware eviction's rescoring (cpu/moments_aware.h: MomentAwareRescore) on the device, for
// a layer whose keys and scores are in device memory. The steps follow the CPU reference one to
// one: the provisional eviction and both percentile ranks are stable radix sorts over the whole
// layer (CUB; the head in the key's high bits, so every head sorts at once; equal keys keep the
// lower index first, as the reference's ties), the summary mean and the distances are summed in
// f64, so the ranks, and with them the rescored f32 scores, are the reference's but where two
// distances agree to f64 rounding.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cub/device/device_radix_sort.cuh>
#include <limits>

#include "../cpu/moments_aware.h"
#include "absl/strings/str_format.h"
#include "cuda_status.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/allocator.h"

namespace kvcomp {
namespace moments_internal {
namespace {

constexpr int kMuChunks = 32;  // blocks per head summing the provisionally evicted keys

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

// Unsigned bits that order like the float (no NaN; -0 taken as +0 by the caller).
__device__ __forceinline__ uint32_t OrderBits(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

// Sort keys of each token: (head, falling effective score) and (head, rising score), the
// effective score +inf where protected; the token's layer-wide index as payload.
__global__ void PrepareKernel(const float* scores, uint32_t heads, uint64_t n,
                              const uint32_t* positions, uint64_t offset, uint64_t seq,
                              SelectParams select, uint64_t* eff_keys, uint64_t* plain_keys,
                              uint32_t* idx) {
  const uint64_t total = uint64_t{heads} * n;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t h = i / n, t = i % n;
    const uint64_t pos = positions != nullptr ? positions[i] : offset + t;
    const float s = scores[i] == 0.0f ? 0.0f : scores[i];
    const float e = IsProtected(pos, seq, select) ? std::numeric_limits<float>::infinity() : s;
    eff_keys[i] = (h << 32) | ~OrderBits(e);
    plain_keys[i] = (h << 32) | OrderBits(s);
    idx[i] = static_cast<uint32_t>(i);
  }
}

// Partial f64 sums of the provisionally evicted keys (falling order [kept, n) of each head):
// block (h, c) sums its chunk, one thread per channel.
template <typename T>
__global__ void MuPartialKernel(const T* keys, uint64_t head_stride, uint64_t token_stride,
                                uint32_t d, uint64_t n, uint64_t kept, const uint32_t* order,
                                double* partial) {
  const uint32_t h = blockIdx.x, c = blockIdx.y;
  const uint64_t evicted = n - kept;
  const uint64_t per = (evicted + kMuChunks - 1) / kMuChunks;
  const uint64_t lo = kept + c * per, hi = min(n, lo + per);
  const uint32_t* o = order + uint64_t{h} * n;
  const T* kh = keys + uint64_t{h} * head_stride;
  for (uint32_t x = threadIdx.x; x < d; x += blockDim.x) {
    double acc = 0.0;
    for (uint64_t r = lo; r < hi; ++r) {
      const uint64_t t = o[r] - uint64_t{h} * n;
      acc = __dadd_rn(acc, LoadD(kh + t * token_stride + x));
    }
    partial[(uint64_t{h} * kMuChunks + c) * d + x] = acc;
  }
}

__global__ void MuKernel(const double* partial, uint32_t d, uint64_t count, double* mu) {
  const uint32_t h = blockIdx.x;
  for (uint32_t x = threadIdx.x; x < d; x += blockDim.x) {
    double acc = 0.0;
    for (int c = 0; c < kMuChunks; ++c) {
      acc = __dadd_rn(acc, partial[(uint64_t{h} * kMuChunks + c) * d + x]);
    }
    mu[uint64_t{h} * d + x] = acc / static_cast<double>(count);
  }
}

// ||k_t - mu|| per token in f64, channels in order (the reference's sum). Distances are >= +0,
// so their bits order like them. One thread per token: it finds its head and row once and reads
// the row itself, 64 bytes at a time as four 16-byte loads when rows are 16-byte aligned (`vec`),
// so a warp's loads use whole sectors; the head's mean comes from L1.
template <typename T>
__global__ void __launch_bounds__(256) DistanceKernel(const T* keys, uint64_t head_stride,
                                                      uint64_t token_stride, uint32_t d,
                                                      uint32_t heads, uint64_t n,
                                                      const double* mu, bool vec, double* dist) {
  const uint64_t total = uint64_t{heads} * n;
  const uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const uint64_t h = i / n, t = i - h * n;
  const T* k = keys + h * head_stride + t * token_stride;
  const double* m = mu + h * d;
  double acc = 0.0;
  if (vec) {
    constexpr uint32_t kVec = 16 / sizeof(T);
    for (uint32_t x0 = 0; x0 < d; x0 += 4 * kVec) {
      uint4 w[4];
#pragma unroll
      for (uint32_t j = 0; j < 4; ++j) {
        w[j] = x0 + j * kVec < d ? __ldg(reinterpret_cast<const uint4*>(k + x0 + j * kVec))
                                 : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (uint32_t j = 0; j < 4; ++j) {
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
  dist[i] = sqrt(acc);
}

// The head of each token in distance order, the key of the second (stable) pass.
__global__ void HeadKeyKernel(const uint32_t* idx, uint64_t total, uint64_t n, uint32_t* head) {
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += uint64_t{gridDim.x} * blockDim.x) {
    head[i] = static_cast<uint32_t>(idx[i] / n);
  }
}

// Each token's rank within its head in the two rising orders (orders of layer-wide indices,
// grouped by head).
__global__ void RankKernel(const uint32_t* order_s, const uint32_t* order_d, uint64_t total,
                           uint64_t n, uint32_t* rank_s, uint32_t* rank_d) {
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t r = static_cast<uint32_t>(i % n);
    rank_s[order_s[i]] = r;
    rank_d[order_d[i]] = r;
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

template <typename T>
absl::Status Rescore(cudaStream_t stream, Allocator& allocator, const HeadsView& keys,
                     const SelectParams& select, const TokenPositions& positions,
                     uint64_t kept, float* scores) {
  const uint32_t heads = keys.num_heads, d = keys.head_dim;
  const uint64_t n = keys.num_tokens, total = uint64_t{heads} * n;
  const uint64_t seq =
      positions.sequence_length > 0 ? positions.sequence_length : positions.offset + n;
  int head_bits = 1;
  while ((uint64_t{1} << head_bits) < heads) ++head_bits;
  auto alloc = [&](uint64_t bytes) { return Buffer::Allocate(allocator, bytes); };
  KVCOMP_ASSIGN_OR_RETURN(Buffer u64, alloc(3 * total * sizeof(uint64_t)));
  KVCOMP_ASSIGN_OR_RETURN(Buffer u32, alloc(9 * total * sizeof(uint32_t)));
  KVCOMP_ASSIGN_OR_RETURN(Buffer f64, alloc(total * sizeof(double)));
  KVCOMP_ASSIGN_OR_RETURN(
      Buffer mu_buf, alloc((uint64_t{heads} * kMuChunks + heads) * d * sizeof(double)));
  uint64_t* eff_keys = u64.as<uint64_t>();
  uint64_t* plain_keys = eff_keys + total;
  uint64_t* sorted_keys = plain_keys + total;
  uint32_t* idx = u32.as<uint32_t>();
  uint32_t* order_e = idx + total;
  uint32_t* order_s = order_e + total;
  uint32_t* by_dist = order_s + total;
  uint32_t* order_d = by_dist + total;
  uint32_t* rank_s = order_d + total;
  uint32_t* rank_d = rank_s + total;
  uint32_t* head_key = rank_d + total;
  uint32_t* head_sorted = head_key + total;
  double* dist = f64.as<double>();
  const uint64_t* dist_bits = reinterpret_cast<const uint64_t*>(dist);
  double* partial = mu_buf.as<double>();
  double* mu = partial + uint64_t{heads} * kMuChunks * d;
  const int items = static_cast<int>(total);
  const int score_bits = 32 + head_bits;
  size_t t1 = 0, t2 = 0, t3 = 0;
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      nullptr, t1, eff_keys, sorted_keys, idx, order_e, items, 0, score_bits, stream));
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      nullptr, t2, dist_bits, sorted_keys, idx, by_dist, items, 0, 64, stream));
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      nullptr, t3, head_key, head_sorted, by_dist, order_d, items, 0, head_bits, stream));
  KVCOMP_ASSIGN_OR_RETURN(Buffer temp, alloc(std::max({t1, t2, t3, size_t{1}})));
  size_t t = 0;

  PrepareKernel<<<Blocks(total), 256, 0, stream>>>(scores, heads, n, positions.data,
                                                   positions.offset, seq, select, eff_keys,
                                                   plain_keys, idx);
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  t = t1;  // (head, falling effective score): the provisional eviction
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      temp.data(), t, eff_keys, sorted_keys, idx, order_e, items, 0, score_bits, stream));
  t = t1;  // (head, rising score): the scores' percentile ranks
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      temp.data(), t, plain_keys, sorted_keys, idx, order_s, items, 0, score_bits, stream));
  const T* k = static_cast<const T*>(keys.data);
  const unsigned threads = std::min<unsigned>(256, (d + 31) / 32 * 32);
  MuPartialKernel<T><<<dim3(heads, kMuChunks), threads, 0, stream>>>(
      k, keys.head_stride, keys.token_stride, d, n, kept, order_e, partial);
  MuKernel<<<heads, threads, 0, stream>>>(partial, d, n - kept, mu);
  const bool vec = d % (16 / sizeof(T)) == 0 && (keys.token_stride * sizeof(T)) % 16 == 0 &&
                   (keys.head_stride * sizeof(T)) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(keys.data) % 16 == 0;
  DistanceKernel<T><<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(
      k, keys.head_stride, keys.token_stride, d, heads, n, mu, vec, dist);
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // The distances' ranks: rising distance (ties by lower index), then stably by head.
  t = t2;
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      temp.data(), t, dist_bits, sorted_keys, idx, by_dist, items, 0, 64, stream));
  HeadKeyKernel<<<Blocks(total), 256, 0, stream>>>(by_dist, total, n, head_key);
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  t = t3;
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      temp.data(), t, head_key, head_sorted, by_dist, order_d, items, 0, head_bits, stream));
  RankKernel<<<Blocks(total), 256, 0, stream>>>(order_s, order_d, total, n, rank_s, rank_d);
  WriteScoresKernel<<<Blocks(total), 256, 0, stream>>>(rank_s, rank_d, total, n,
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
  if (uint64_t{keys.num_heads} * n >= (uint64_t{1} << 31)) {
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
