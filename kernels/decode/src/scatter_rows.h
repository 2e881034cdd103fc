// Copies the KVSplice outlier rows of one layer over the values its latents decoded to, in the
// backend's space: dst row rows[i] = src row i, `row_bytes` each.
#ifndef KVCOMP_KERNELS_DECODE_SRC_SCATTER_ROWS_H_
#define KVCOMP_KERNELS_DECODE_SRC_SCATTER_ROWS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kvcomp/kernels/backend.h"

namespace kvcomp {
namespace decode {

absl::Status ScatterRows(Backend& backend, void* dst, const uint64_t* rows, const void* src,
                         uint64_t num_rows, uint64_t row_bytes);

#if defined(KVCOMP_HAVE_CUDA)
// The CUDA launcher (scatter_rows_cuda.cu), ordered on `stream` (a cudaStream_t).
absl::Status ScatterRowsCuda(void* stream, void* dst, const uint64_t* rows, const void* src,
                             uint64_t num_rows, uint64_t row_bytes);
#endif

}  // namespace decode
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_DECODE_SRC_SCATTER_ROWS_H_
