#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "../../src/cuda/codec_kernels.cuh"
#include "absl/strings/str_cat.h"
#include "dense_decode.h"

namespace kvcomp {
namespace decode {
namespace {

using codec_cuda::KindOf;
using codec_cuda::Tile;

std::vector<uint8_t> Bytes(const std::vector<Tile>& tiles) {
  std::vector<uint8_t> b(tiles.size() * sizeof(Tile));
  if (!tiles.empty()) std::memcpy(b.data(), tiles.data(), b.size());
  return b;
}

codec_cuda::DecodeParams ParamsOf(const LayerSections& s, void* out) {
  const ValueCodecParams& v = s.value_params;
  return codec_cuda::DecodeParams{static_cast<const Tile*>(s.expand_tiles),
                                  static_cast<const uint8_t*>(s.values),
                                  s.value_scales,
                                  static_cast<const __half*>(s.expand_f16),
                                  out,
                                  v.rank,
                                  (v.rank + 15) / 16 * 16,  // expand_f16's rows per head
                                  v.group_size,
                                  static_cast<uint32_t>(v.Groups()),
                                  static_cast<uint32_t>(v.LatentBytes()),
                                  KindOf(v.codec),
                                  true};
}

// The stream's device made current (a thread may drive backends on several devices); a stream
// handle the runtime cannot place (a special one) leaves the current device as it is.
absl::Status UseStreamDevice(cudaStream_t stream) {
  int device = 0;
  if (cudaStreamGetDevice(stream, &device) != cudaSuccess) {
    cudaGetLastError();
    return absl::OkStatus();
  }
  const cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("decode (CUDA): ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace

KeyDecodeTable KeyDecodeTableFor(const LayerSections& s, KeyCodec key_codec) {
  KeyDecodeTable t;
  const uint64_t heads = s.offsets.empty() ? 0 : s.offsets.size() - 1;
  if (s.rows == 0 || heads == 0 || (key_codec != KeyCodec::kInt8 && key_codec != KeyCodec::kFp16)) {
    return t;
  }
  const std::vector<Tile> kt = codec_cuda::UniformTiles(s.offsets.data(), heads, 64);
  t.tiles = Bytes(kt);
  t.num_tiles = kt.size();
  return t;
}

ExpandTable ExpandTableFor(const LayerSections& s, uint32_t head_dim, DType dtype,
                           const std::vector<float>& expand_f32) {
  ExpandTable t;
  const uint64_t heads = s.offsets.empty() ? 0 : s.offsets.size() - 1;
  const ValueCodecParams& v = s.value_params;
  if (s.rows == 0 || heads == 0 || s.expand == nullptr ||
      !(head_dim == 64 || head_dim == 128 || head_dim == 256) ||
      !codec_cuda::ExpandEligible(v.rank, v.group_size, static_cast<uint32_t>(v.LatentBytes()),
                                  KindOf(v.codec), reinterpret_cast<uintptr_t>(s.values))) {
    return t;
  }
  const absl::StatusOr<uint64_t> slots = codec_cuda::ExpandSlots(ParamsOf(s, nullptr), head_dim,
                                                                 dtype);
  if (!slots.ok()) return t;  // the codec ops decode this layer
  const uint64_t m = head_dim == 64    ? codec_cuda::ExpandShape<64>::M
                     : head_dim == 128 ? codec_cuda::ExpandShape<128>::M
                                       : codec_cuda::ExpandShape<256>::M;
  const std::vector<Tile> xt = codec_cuda::ExpandTiles(s.offsets.data(), heads, m, *slots);
  t.tiles = Bytes(xt);
  t.num_tiles = xt.size();
  // [heads][r_pad][head_dim], rows past the rank zero.
  const uint64_t r = v.rank, r_pad = (r + 15) / 16 * 16;
  t.expand_f16.assign(heads * r_pad * head_dim, 0);
  for (uint64_t h = 0; h < heads; ++h) {
    for (uint64_t i = 0; i < r * head_dim; ++i) {
      t.expand_f16[(h * r_pad) * head_dim + i] =
          __half_as_ushort(__float2half_rn(expand_f32[h * r * head_dim + i]));
    }
  }
  return t;
}

absl::Status DecodeValuesCuda(void* stream, const LayerSections& s, uint32_t head_dim,
                              DType dtype, void* out) {
  if (absl::Status st = UseStreamDevice(static_cast<cudaStream_t>(stream)); !st.ok()) return st;
  return codec_cuda::LaunchExpandValues(static_cast<cudaStream_t>(stream), ParamsOf(s, out),
                                        s.num_expand_tiles, head_dim, dtype);
}

absl::Status DecodeKeysCuda(void* stream, const LayerSections& s, KeyCodec key_codec,
                            uint32_t head_dim, DType dtype, void* out) {
  if (absl::Status st = UseStreamDevice(static_cast<cudaStream_t>(stream)); !st.ok()) return st;
  return codec_cuda::LaunchDecodeKeys(static_cast<cudaStream_t>(stream),
                                      static_cast<const Tile*>(s.key_tiles), s.num_key_tiles,
                                      s.keys, DType::kF16, head_dim, s.key_scales,
                                      key_codec == KeyCodec::kInt8, out, dtype);
}

}  // namespace decode
}  // namespace kvcomp
