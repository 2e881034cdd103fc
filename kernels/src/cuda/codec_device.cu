// KVSplice outlier rows on the device: one block per head finds its medians and, when more rows
// than the cap exceed the limit, the cap-th largest loss by radix select (8 bits a pass over the
// head's rows, which stay in L2), and marks the rows; a scan packs them in row order and a gather
// copies their raw values. (A segmented radix sort of every head's rows, twice, did the same
// work in several passes over all of them.)
#include <cuda_runtime.h>

#include <algorithm>

#include <cub/device/device_scan.cuh>

#include "absl/strings/str_format.h"
#include "block_radix_select.cuh"
#include "codec_device.h"
#include "cuda_status.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace codec_device {
namespace {

constexpr unsigned kPickThreads = 1024;  // one block per head
constexpr unsigned kPickWarps = kPickThreads / 32;

using PickShared = block_select::RadixSelectShared<kPickWarps>;

__device__ __forceinline__ uint32_t OrderKey(float x) { return block_select::FloatOrderKey(x); }

// The key of rank `k` (0-based, ascending) among OrderKey(x[0 .. n)).
__device__ uint32_t SelectKey(const float* x, uint32_t n, uint32_t k, PickShared& sh) {
  return block_select::BlockRadixSelect<uint32_t>(n, k, sh,
                                                  [&](uint32_t i) { return OrderKey(x[i]); });
}

// The number of rows i < n with pred(i), summed over the block (every thread gets it).
template <typename Pred>
__device__ uint32_t CountRows(uint32_t n, PickShared& sh, Pred pred) {
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  uint32_t mine = 0;
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) mine += pred(i) ? 1u : 0u;
  for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);
  if ((threadIdx.x & 31) == 0 && mine != 0) atomicAdd(&sh.count, mine);
  __syncthreads();
  const uint32_t total = sh.count;
  __syncthreads();
  return total;
}

// One block per head: the limit from the medians (the rows' lost and energy of rank n / 2),
// the rows above it; when more than the cap, the cap worst of them: every row whose lost is
// above the cap-th largest, then those equal to it by lower row until the cap is full (the
// order of a stable sort by falling lost, as the CPU's partial sort on (-lost, row)).
__global__ void __launch_bounds__(kPickThreads) PickOutliersKernel(
    const int* off, const float* lost, const float* energy, double fraction, double factor,
    float floor_factor, uint32_t* flags) {
  __shared__ PickShared sh;
  const int b = off[blockIdx.x];
  const uint32_t n = static_cast<uint32_t>(off[blockIdx.x + 1] - b);
  const uint64_t cap64 = n > 0 ? static_cast<uint64_t>(static_cast<double>(n) * fraction) : 0;
  if (cap64 == 0) return;
  const uint32_t cap = static_cast<uint32_t>(cap64 < n ? cap64 : n);
  const float* hl = lost + b;
  const float* he = energy + b;
  uint32_t* f = flags + b;
  const uint32_t ml = SelectKey(hl, n, n / 2, sh);
  const uint32_t me = SelectKey(he, n, n / 2, sh);
  // Back from the order keys to the values (the keys of non-negative values are u | sign).
  auto value_of = [](uint32_t key) {
    return __uint_as_float((key & 0x80000000u) != 0 ? (key & 0x7fffffffu) : ~key);
  };
  const float a = floor_factor * value_of(me);
  const float c = static_cast<float>(factor * static_cast<double>(value_of(ml)));
  const float limit = a < c ? c : a;
  const uint32_t above = CountRows(n, sh, [&](uint32_t i) { return hl[i] > limit; });
  if (above == 0) return;
  if (above <= cap) {
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
      if (hl[i] > limit) f[i] = 1;
    }
    return;
  }
  // The cap-th largest key; the rows above it all go, then the equal ones by lower row.
  const uint32_t kth = SelectKey(hl, n, n - cap, sh);
  const uint32_t greater = CountRows(n, sh, [&](uint32_t i) { return OrderKey(hl[i]) > kth; });
  const uint32_t need = cap - greater;
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (OrderKey(hl[i]) > kth) f[i] = 1;
  }
  // The equal rows in row order, a block-wide chunk at a time, until `need` are marked.
  uint32_t taken = 0;  // equal rows seen so far (the same in every thread)
  for (uint32_t base = 0; base < n && taken < need; base += blockDim.x) {
    const uint32_t i = base + threadIdx.x;
    const bool eq = i < n && OrderKey(hl[i]) == kth;
    const uint32_t ballot = __ballot_sync(0xffffffffu, eq);
    const uint32_t lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) sh.warp[w] = __popc(ballot);
    __syncthreads();
    uint32_t before = taken, all = taken;
    for (uint32_t j = 0; j < kPickWarps; ++j) {
      if (j < w) before += sh.warp[j];
      all += sh.warp[j];
    }
    before += __popc(ballot & ((1u << lane) - 1u));
    if (eq && before < need) f[i] = 1;
    taken = all;
    __syncthreads();  // sh.warp read before the next chunk writes it
  }
}

__global__ void CountKernel(const uint32_t* flags, const uint32_t* pos, uint64_t n,
                            uint32_t* count) {
  *count = pos[n - 1] + flags[n - 1];
}

__global__ void ScatterRowsKernel(const uint32_t* flags, const uint32_t* pos, uint64_t n,
                                  uint64_t* rows) {
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    if (flags[i] != 0) rows[pos[i]] = i;
  }
}

// Row r of `out` = row rows[r] of `in`, `words` 32-bit words a row.
__global__ void GatherRowsKernel(const uint64_t* rows, uint64_t count, uint64_t words,
                                 const uint32_t* in, uint32_t* out) {
  const uint64_t total = count * words;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t r = i / words, w = i % words;
    out[i] = in[rows[r] * words + w];
  }
}

__global__ void GatherBytesKernel(const uint64_t* rows, uint64_t count, uint64_t bytes,
                                  const uint8_t* in, uint8_t* out) {
  const uint64_t total = count * bytes;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += uint64_t{gridDim.x} * blockDim.x) {
    out[i] = in[rows[i / bytes] * bytes + i % bytes];
  }
}

unsigned Blocks(uint64_t n) {
  return static_cast<unsigned>(std::max<uint64_t>(1, std::min<uint64_t>((n + 255) / 256, 65535)));
}

}  // namespace

absl::Status PickRawValueRows(void* stream_ptr, Allocator& allocator, const float* energy,
                              const float* lost, const std::vector<uint64_t>& offsets,
                              double fraction, double factor, const void* values,
                              uint64_t row_bytes, Buffer* rows, Buffer* raw_values,
                              uint64_t* count) {
  *count = 0;
  rows->Reset();
  raw_values->Reset();
  if (offsets.size() < 2 || offsets.back() == 0 || !(fraction > 0.0)) return absl::OkStatus();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const uint64_t n = offsets.back();
  const int heads = static_cast<int>(offsets.size() - 1);
  if (n >= (uint64_t{1} << 31)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kvsplice (CUDA): %u kept rows, more than the outlier search takes", n));
  }
  std::vector<int> off(offsets.begin(), offsets.end());
  auto alloc = [&](uint64_t bytes) { return Buffer::Allocate(allocator, bytes); };
  KVCOMP_ASSIGN_OR_RETURN(Buffer d_off, alloc(off.size() * sizeof(int)));
  KVCOMP_ASSIGN_OR_RETURN(Buffer flags, alloc((2 * n + 1) * sizeof(uint32_t)));
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_off.data(), off.data(), off.size() * sizeof(int),
                                              cudaMemcpyHostToDevice, stream));
  const int* o = d_off.as<int>();
  uint32_t* f = flags.as<uint32_t>();
  uint32_t* pos = f + n;
  uint32_t* d_count = f + 2 * n;
  const int items = static_cast<int>(n);
  size_t t3 = 0;
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(nullptr, t3, f, pos, items, stream));
  KVCOMP_ASSIGN_OR_RETURN(Buffer temp, alloc(std::max(t3, size_t{1})));
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(f, 0, n * sizeof(uint32_t), stream));
  PickOutliersKernel<<<static_cast<unsigned>(heads), kPickThreads, 0, stream>>>(
      o, lost, energy, fraction, factor, 0.01f, f);
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  size_t t = t3;
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(temp.data(), t, f, pos, items, stream));
  CountKernel<<<1, 1, 0, stream>>>(f, pos, n, d_count);
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  uint32_t host_count = 0;
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&host_count, d_count, sizeof(uint32_t),
                                              cudaMemcpyDeviceToHost, stream));
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  *count = host_count;
  if (host_count == 0) return absl::OkStatus();
  KVCOMP_ASSIGN_OR_RETURN(*rows, alloc(uint64_t{host_count} * sizeof(uint64_t)));
  KVCOMP_ASSIGN_OR_RETURN(*raw_values, alloc(uint64_t{host_count} * row_bytes));
  ScatterRowsKernel<<<Blocks(n), 256, 0, stream>>>(f, pos, n, rows->as<uint64_t>());
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (row_bytes % 4 == 0) {
    GatherRowsKernel<<<Blocks(host_count * row_bytes / 4), 256, 0, stream>>>(
        rows->as<uint64_t>(), host_count, row_bytes / 4, static_cast<const uint32_t*>(values),
        raw_values->as<uint32_t>());
  } else {
    GatherBytesKernel<<<Blocks(host_count * row_bytes), 256, 0, stream>>>(
        rows->as<uint64_t>(), host_count, row_bytes, static_cast<const uint8_t*>(values),
        raw_values->as<uint8_t>());
  }
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace codec_device
}  // namespace kvcomp
