// The stream-ordered dense decode of a placed layer on a CUDA backend: the keys' and values'
// decode kernels launched straight on the backend's stream from launch tables prepared once
// when the layer is placed, instead of through the codec ops (which build and upload their tile
// tables per call and wait for the stream at their end). Layers whose layout the kernels do not
// take (int4 keys; ranks not a multiple of 4, int4 ranks not a multiple of 8, group sizes not a
// multiple of 16) keep the codec ops.
#ifndef KVCOMP_KERNELS_DECODE_SRC_DENSE_DECODE_H_
#define KVCOMP_KERNELS_DECODE_SRC_DENSE_DECODE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/decode/attention.h"

namespace kvcomp {
namespace decode {

#if defined(KVCOMP_HAVE_CUDA)
// Host copies of a layer's launch tables (dense_decode_cuda.cu), as bytes to place on the
// device; empty where the layer keeps the codec ops.
struct KeyDecodeTable {
  std::vector<uint8_t> tiles;  // tiles of the key decode
  uint64_t num_tiles = 0;
};
struct ExpandTable {
  std::vector<uint8_t> tiles;        // tiles of the pipelined expand
  uint64_t num_tiles = 0;
  std::vector<uint16_t> expand_f16;  // [num_kv_heads][rank rounded up to 16][head_dim], f16 of
                                     // the expand matrices, rows past the rank zero
};

// `s` as placed (device sections, host offsets, value params), with the backend's device
// current. Keys: int8 or fp16 keys. Values: encoded values whose layout the pipelined expand
// takes; expand_f32 the layer's expand matrices [num_kv_heads][rank][head_dim], dtype the
// cache's (the decode's output).
KeyDecodeTable KeyDecodeTableFor(const LayerSections& s, KeyCodec key_codec);
ExpandTable ExpandTableFor(const LayerSections& s, uint32_t head_dim, DType dtype,
                           const std::vector<float>& expand_f32);

// The decode of the layer's values (s.expand_tiles set) or keys (s.key_tiles set) into `out`
// ([s.rows][head_dim] of dtype), ordered on `stream`.
absl::Status DecodeValuesCuda(void* stream, const LayerSections& s, uint32_t head_dim,
                              DType dtype, void* out);
absl::Status DecodeKeysCuda(void* stream, const LayerSections& s, KeyCodec key_codec,
                            uint32_t head_dim, DType dtype, void* out);
#endif

}  // namespace decode
}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_DECODE_SRC_DENSE_DECODE_H_
