// The calibrated basis codec (kvcomp/codecs/pq.h) on CUDA: one launch encodes (or decodes) every
// row of every head of a call. A block takes a head and tiles of its rows; each thread a
// component (encode: the serial sum over the channels in the reference's order, its code from
// the width's boundaries in shared memory, its bits OR-ed into the row's record in shared memory)
// or a channel (decode: the serial sum over the components with a width, in increasing order).
// Only the _rn intrinsics do arithmetic (never contracted into fused multiply-adds), so records
// and decoded values are the CPU reference's bits.
//
// Errors: `error` (device, one u64, set to all ones before the launch) receives the smallest key
// of a failing row (atomicMin), so the host reports the lowest failing row as the CPU does:
//   encode  row << 16 | kind << 12 | element   (kind 0: element not finite, 1: the projection
//           overflows to NaN)
//   decode  row   (a record with nonzero bits after bits_total)
#ifndef KVCOMP_KERNELS_SRC_CUDA_PQ_CUDA_H_
#define KVCOMP_KERNELS_SRC_CUDA_PQ_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvcomp/codecs/pq.h"
#include "kvcomp/core/dtype.h"

namespace kvcomp {
namespace pq_cuda {

inline constexpr uint64_t kNoError = ~uint64_t{0};

// One basis in device memory (pointers into one allocation the caller owns), as the kernels
// read it. Per head h (d = head_dim): mean, scale, inv_scale [d] f32; wo [d] u32 (width | bit
// offset << 8: the component's first bit in the record); comps [d] u32 (the components with a
// width, in increasing order, ncomp[h] of them); bt [d][d] (bt[j][c] = basis[c][j], encode) and
// b [d][d] (basis[c][j], decode). tables: the centroids of widths 1..8 (width w from
// 2^w - 2), then the boundaries (width w from 510 + 2^w - w - 1).
struct DeviceBasisView {
  const float* mean = nullptr;
  const float* scale = nullptr;
  const float* inv_scale = nullptr;
  const uint32_t* wo = nullptr;
  const uint32_t* comps = nullptr;
  const uint32_t* ncomp = nullptr;
  const float* bt = nullptr;
  const float* b = nullptr;
  const float* tables = nullptr;
  uint32_t heads = 0;
  uint32_t d = 0;
  uint32_t bits_total = 0;
  uint32_t record_bytes = 0;
};

inline constexpr uint32_t kTableFloats = 510 + 502;

// The bytes of `basis` laid out for DeviceBasisView (Layout gives the offsets): one host image
// the caller uploads as one copy.
struct Layout {
  uint64_t mean = 0, scale = 0, inv_scale = 0, wo = 0, comps = 0, ncomp = 0, bt = 0, b = 0,
           tables = 0, bytes = 0;
};
Layout LayoutOf(const pq::Basis& basis);
std::vector<uint8_t> HostImage(const pq::Basis& basis, const Layout& layout);
DeviceBasisView ViewOf(const pq::Basis& basis, const Layout& layout, const void* device);

// Rows of head h are [offsets[h], offsets[h + 1]) (offsets: device, heads + 1 entries);
// max_rows the most rows of any head. src / dst dense rows of d elements of dtype; records of
// view.record_bytes. Device memory.
absl::Status LaunchEncode(cudaStream_t stream, const DeviceBasisView& view,
                          const uint64_t* offsets, uint64_t max_rows, const void* src,
                          DType dtype, uint8_t* out, unsigned long long* error);
absl::Status LaunchDecode(cudaStream_t stream, const DeviceBasisView& view,
                          const uint64_t* offsets, uint64_t max_rows, const uint8_t* in,
                          void* dst, DType dtype, unsigned long long* error);

// The status the CPU reference returns for the error key (kNoError: OK); host_offsets name the
// head of the row.
absl::Status EncodeError(uint64_t key, absl::Span<const uint64_t> host_offsets);
absl::Status DecodeError(uint64_t key, absl::Span<const uint64_t> host_offsets);

}  // namespace pq_cuda
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_SRC_CUDA_PQ_CUDA_H_
