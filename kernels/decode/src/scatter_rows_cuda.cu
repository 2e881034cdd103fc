#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "scatter_rows.h"

namespace kvcomp {
namespace decode {
namespace {

// One thread per Word of a row; rows are spread over the grid.
template <typename Word>
__global__ void ScatterRowsKernel(Word* dst, const uint64_t* rows, const Word* src,
                                  uint64_t num_rows, uint64_t row_words) {
  const uint64_t total = num_rows * row_words;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < total;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t r = i / row_words, w = i % row_words;
    dst[rows[r] * row_words + w] = src[i];
  }
}

template <typename Word>
cudaError_t Launch(cudaStream_t s, void* dst, const uint64_t* rows, const void* src, uint64_t n,
                   uint64_t row_bytes) {
  const uint64_t words = row_bytes / sizeof(Word), total = n * words;
  const unsigned blocks =
      static_cast<unsigned>((total + 255) / 256 < 4096 ? (total + 255) / 256 : 4096);
  ScatterRowsKernel<Word><<<blocks, 256, 0, s>>>(static_cast<Word*>(dst), rows,
                                                 static_cast<const Word*>(src), n, words);
  return cudaGetLastError();
}

}  // namespace

absl::Status ScatterRowsCuda(void* stream, void* dst, const uint64_t* rows, const void* src,
                             uint64_t num_rows, uint64_t row_bytes) {
  if (num_rows == 0 || row_bytes == 0) return absl::OkStatus();
  const auto s = static_cast<cudaStream_t>(stream);
  const bool aligned = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(src) % 16 == 0;
  const cudaError_t err = aligned ? Launch<uint4>(s, dst, rows, src, num_rows, row_bytes)
                                  : Launch<uint8_t>(s, dst, rows, src, num_rows, row_bytes);
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("decode: outlier rows kernel: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace decode
}  // namespace kvcomp
