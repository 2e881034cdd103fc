// The Hadamard codec (kvcomp/codecs/hq.h) on CUDA: one launch encodes (or decodes) every row of a
// call, rows of head_dim d in [8, 256] (a power of two), each row held by d / E lanes of a warp
// (E = 1, 2, 4 or 8 elements per lane), the transform's butterflies in registers and by warp
// shuffles, every arithmetic step the round-to-nearest intrinsic of the CPU reference's one IEEE
// operation in the same order, so codes, records and decoded values are the CPU's bits.
//
// Errors: `error` (device, one u64, set to all ones before the launch) receives the smallest key
// of a failing row (atomicMin), so the host reports the lowest failing row as the CPU does:
//   encode  row << 16 | kind << 9 | element   (kind 0: element not finite, 1: the rotated row
//           leaves the f16 range, 2: the row's range leaves the f16 range)
//   decode  row << 32 | lo bits << 16 | step bits   (a record DecodeRow refuses)
#ifndef KVCOMP_KERNELS_SRC_CUDA_HQ_CUDA_H_
#define KVCOMP_KERNELS_SRC_CUDA_HQ_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kvcomp/core/dtype.h"

namespace kvcomp {
namespace hq_cuda {

inline constexpr uint64_t kNoError = ~uint64_t{0};

// rows x d elements of dtype (f32, f16, bf16) at src into rows records at out (device memory).
// d and bits must pass hq::CheckHeadDim / hq::CheckBits; c is hq::Normalizer(d).
absl::Status LaunchEncode(cudaStream_t stream, int max_blocks, const void* src, DType dtype,
                          uint64_t rows, uint32_t d, uint32_t bits, float c, uint8_t* out,
                          unsigned long long* error);
// rows records at in into rows x d elements of dtype at dst (device memory).
absl::Status LaunchDecode(cudaStream_t stream, int max_blocks, const uint8_t* in, uint64_t rows,
                          uint32_t d, uint32_t bits, float c, void* dst, DType dtype,
                          unsigned long long* error);

// The status the CPU reference returns for the error key (kNoError: OK).
absl::Status EncodeError(uint64_t key);
absl::Status DecodeError(uint64_t key);

}  // namespace hq_cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_HQ_CUDA_H_
