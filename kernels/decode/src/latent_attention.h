// Decode attention over KVSplice latents, the values never expanded per token. With the values
// of head h written V = Z E (Z: the dequantized latents, [rows][rank]; E = diag(gamma) P_r, the
// head's expand matrix, [rank][head_dim]), the softmax-weighted sum of the values is
//   sum_t w_t v_t = (sum_t w_t z_t) E
// so the kernels attend over the codes (rank numbers per token instead of head_dim) and apply E
// once per query row. Outlier rows (stored raw) are left out of the latent sum and added with
// their own values; the virtual token of the evicted set (kvcomp/kernels/moment_ops.h) is added
// in dense space. Same formula as decoding first and attending (MomentOps::Attention).
#ifndef KVCOMP_KERNELS_DECODE_SRC_LATENT_ATTENTION_H_
#define KVCOMP_KERNELS_DECODE_SRC_LATENT_ATTENTION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/moment_ops.h"
#include "kvcomp/kernels/tensor.h"

namespace kvcomp {
namespace decode {

struct LatentAttentionArgs {
  // [num_q_heads, num_queries, head_dim], f32, f16 or bf16, dense, in the backend's space.
  HeadsView queries;
  // Dense kept keys of the layer, [rows][head_dim] of key_dtype, ragged per kv head.
  const void* keys = nullptr;
  DType key_dtype = DType::kBF16;
  absl::Span<const uint64_t> host_offsets;  // [num_kv_heads + 1], host
  const uint64_t* offsets = nullptr;        // the same in the backend's space
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  // Latents as stored: rows x value.LatentBytes(), f16 scales rows x value.Groups().
  const void* latent = nullptr;
  const uint16_t* scales = nullptr;
  ValueCodecParams value;
  const float* expand = nullptr;  // [num_kv_heads][value.rank][head_dim], f32
  // Outlier rows of the layer (ascending) and their values, [num_raw_rows][head_dim] of
  // key_dtype (the layout's dtype).
  uint64_t num_raw_rows = 0;
  const uint64_t* raw_rows = nullptr;
  const void* raw_values = nullptr;
  ConstMomentsView moments;  // count == null: no virtual token
  bool correct = true;
  float scale = 0.0f;  // 0 = 1 / sqrt(head_dim)
  float* out = nullptr;  // [num_q_heads, num_queries, head_dim] f32, backend's space
};

// Host memory.
absl::Status LatentAttentionCpu(const LatentAttentionArgs& args);

#if defined(KVCOMP_HAVE_CUDA)
// Device memory, ordered on `stream` (a cudaStream_t). `workspace` receives the partial sums:
// at least LatentAttentionWorkspaceBytes(args) bytes of device memory.
uint64_t LatentAttentionWorkspaceBytes(const LatentAttentionArgs& args);
absl::Status LatentAttentionCuda(void* stream, const LatentAttentionArgs& args, void* workspace);
#endif

}  // namespace decode
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_DECODE_SRC_LATENT_ATTENTION_H_
