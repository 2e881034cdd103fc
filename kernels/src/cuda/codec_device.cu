// KVSplice outlier rows on the device: segmented radix sorts (CUB) give each head's medians and
// its rows by falling residual, one block per head marks the worst ones, a scan packs them in
// row order and a gather copies their raw values.
#include <cuda_runtime.h>

#include <algorithm>

#include <cub/device/device_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "absl/strings/str_format.h"
#include "codec_device.h"
#include "cuda_status.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace codec_device {
namespace {

__global__ void IotaKernel(uint32_t* idx, uint64_t n) {
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    idx[i] = static_cast<uint32_t>(i);
  }
}

// One block per head: the limit from the medians, the count above it, the first min(cap,
// count) rows of the falling order marked.
__global__ void MarkOutliersKernel(const int* off, const float* lost_desc,
                                   const uint32_t* idx_desc, const float* energy_asc,
                                   double fraction, double factor, float floor_factor,
                                   uint32_t* flags) {
  const int b = off[blockIdx.x];
  const uint64_t n = static_cast<uint64_t>(off[blockIdx.x + 1] - b);
  const uint64_t cap = n > 0 ? static_cast<uint64_t>(static_cast<double>(n) * fraction) : 0;
  if (cap == 0) return;
  __shared__ uint64_t take;
  if (threadIdx.x == 0) {
    const float median_lost = lost_desc[b + (n - 1 - n / 2)];
    const float median_energy = energy_asc[b + n / 2];
    const float a = floor_factor * median_energy;
    const float c = static_cast<float>(factor * static_cast<double>(median_lost));
    const float limit = a < c ? c : a;
    uint64_t lo = 0, hi = n;  // rows [0, lo) of the falling order exceed the limit
    while (lo < hi) {
      const uint64_t mid = (lo + hi) / 2;
      if (lost_desc[b + mid] > limit) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    take = lo < cap ? lo : cap;
  }
  __syncthreads();
  for (uint64_t i = threadIdx.x; i < take; i += blockDim.x) flags[idx_desc[b + i]] = 1;
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
  KVCOMP_ASSIGN_OR_RETURN(Buffer idx, alloc(2 * n * sizeof(uint32_t)));
  KVCOMP_ASSIGN_OR_RETURN(Buffer sorted, alloc(2 * n * sizeof(float)));
  KVCOMP_ASSIGN_OR_RETURN(Buffer flags, alloc((2 * n + 1) * sizeof(uint32_t)));
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_off.data(), off.data(), off.size() * sizeof(int),
                                              cudaMemcpyHostToDevice, stream));
  const int* o = d_off.as<int>();
  uint32_t* idx_in = idx.as<uint32_t>();
  uint32_t* idx_desc = idx_in + n;
  float* lost_desc = sorted.as<float>();
  float* energy_asc = lost_desc + n;
  uint32_t* f = flags.as<uint32_t>();
  uint32_t* pos = f + n;
  uint32_t* d_count = f + 2 * n;
  const int items = static_cast<int>(n);
  size_t t1 = 0, t2 = 0, t3 = 0;
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, t1, lost, lost_desc, idx_in, idx_desc, items, heads, o, o + 1, 0, 32, stream));
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceSegmentedRadixSort::SortKeys(
      nullptr, t2, energy, energy_asc, items, heads, o, o + 1, 0, 32, stream));
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(nullptr, t3, f, pos, items, stream));
  KVCOMP_ASSIGN_OR_RETURN(Buffer temp, alloc(std::max({t1, t2, t3, size_t{1}})));
  IotaKernel<<<Blocks(n), 256, 0, stream>>>(idx_in, n);
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(f, 0, n * sizeof(uint32_t), stream));
  size_t t = t1;
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      temp.data(), t, lost, lost_desc, idx_in, idx_desc, items, heads, o, o + 1, 0, 32, stream));
  t = t2;
  KVCOMP_CUDA_RETURN_IF_ERROR(cub::DeviceSegmentedRadixSort::SortKeys(
      temp.data(), t, energy, energy_asc, items, heads, o, o + 1, 0, 32, stream));
  MarkOutliersKernel<<<static_cast<unsigned>(heads), 128, 0, stream>>>(
      o, lost_desc, idx_desc, energy_asc, fraction, factor, 0.01f, f);
  KVCOMP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  t = t3;
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
