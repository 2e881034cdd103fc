// Decode-side attention over a compressed cache: the kept tokens of one layer plus the MomentKV
// correction (kvcomp/kernels/moment_ops.h gives the formula), on a Backend the caller keeps for
// as long as it decodes.
//
//   ResidentCache  a CompressedCache placed in one backend's memory space once, section by
//                  section as stored: KVSplice latents, int8 keys and their scales stay encoded.
//   Decoder        attends over a ResidentCache layer by layer, reusing its workspaces; it never
//                  copies the cache again. Encoded keys are decoded into a per-layer workspace
//                  in the backend's space right before the attention kernel. KVSplice values are
//                  either decoded the same way (the default) or never expanded per token: with
//                  AttendParams::expand_in_attention the attention runs over their latent codes
//                  and applies each head's expand matrix once per query row (out = (w . Z) E).
//                  Dense values never reach host memory.
//
// Usage (CUDA; the same code runs on the CPU backend):
//   auto backend = MakeCudaBackend();                       // once per thread / stream
//   Decoder decoder(**backend);
//   auto resident = ResidentCache::Place(**backend, cache, projection);  // one upload
//   for each decode step, for each layer:
//     decoder.Attend(**resident, {queries, layer, /*correct=*/true, 0.0f, out, space});
//
// Thread-safety: neither class is thread-safe; a ResidentCache may be read by several Decoders of
// the same backend one after another, never at the same time as it is destroyed.
#ifndef KVCOMP_DECODE_ATTENTION_H_
#define KVCOMP_DECODE_ATTENTION_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/kvsplice.h"
#include "kvcomp/kernels/moment_ops.h"
#include "kvcomp/kernels/projection.h"
#include "kvcomp/kernels/tensor.h"

namespace kvcomp {
namespace decode {

// Bytes a Decoder or ResidentCache moved between host memory and a device backend's memory (both
// stay 0 on the CPU backend, whose space is host memory).
struct TransferCounters {
  uint64_t host_to_device_bytes = 0;
  uint64_t device_to_host_bytes = 0;
};

// The sections of one layer in the backend's space (views; the ResidentCache owns the memory).
struct LayerSections {
  bool placed = false;
  uint64_t rows = 0;                         // kept tokens of the layer, all kv heads
  std::vector<uint64_t> offsets;             // host, [num_kv_heads + 1], rows per head, from 0
  const uint64_t* device_offsets = nullptr;  // the same in the backend's space
  const void* keys = nullptr;                // rows x KeyTokenBytes(), as stored
  const float* key_scales = nullptr;         // int8 keys: [num_kv_heads][head_dim]
  const void* values = nullptr;              // rows x ValueTokenBytes(layer), as stored
  const uint16_t* value_scales = nullptr;    // int8/int4 latents: rows x ValueGroups(layer) f16
  ValueCodecParams value_params;             // encoded values: the layer's codec, rank, group size
  uint64_t num_raw_rows = 0;                 // KVSplice outliers of the layer
  const uint64_t* raw_rows = nullptr;        // their rows within the layer, ascending
  const void* raw_values = nullptr;          // their values, layout.dtype, head_dim each
  // Encoded values: each kv head's expand matrix E = diag(gamma) P_rank (the projection's basis
  // rows scaled as the codec decodes them), [num_kv_heads][rank][head_dim] f32.
  const float* expand = nullptr;
  ConstMomentsView moments;                  // count == null without moments
  // CUDA backends: the launch tables of the dense decode, read on the device by its kernels
  // (null where the layer decodes through the codec ops): the expand matrices in f16 and the
  // expand's tiles, the key decode's tiles.
  const void* expand_f16 = nullptr;
  const void* expand_tiles = nullptr;
  uint64_t num_expand_tiles = 0;
  const void* key_tiles = nullptr;
  uint64_t num_key_tiles = 0;
};

// Which layers ResidentCache::Place copies.
struct PlaceOptions {
  // Layers to place, [first_layer, first_layer + num_layers); num_layers 0 = through the last.
  uint32_t first_layer = 0;
  uint32_t num_layers = 0;
};

// A CompressedCache in a backend's memory space.
class ResidentCache {
 public:
  using Options = PlaceOptions;

  // Places the sections of the chosen layers in `backend`'s space. A device backend gets one
  // copy of each section (nothing is decoded); on a host backend the ResidentCache views the
  // cache's own arrays, so `cache` must then outlive it. A cache in the hq codecs is decoded
  // to raw rows first (kept by the ResidentCache: the kept tokens' raw size). `projection` is needed when the values
  // are encoded: NotFound when it is null or of another version than the cache names,
  // InvalidArgument when its shape is not the cache's. InvalidArgument when the cache fails
  // Validate() or the layer range is outside it; ResourceExhausted when device memory is short.
  // `backend` must outlive the ResidentCache.
  static absl::StatusOr<std::unique_ptr<ResidentCache>> Place(
      Backend& backend, const CompressedCache& cache,
      std::shared_ptr<const Projection> projection = nullptr,
      const PlaceOptions& options = PlaceOptions());

  ResidentCache(const ResidentCache&) = delete;
  ResidentCache& operator=(const ResidentCache&) = delete;

  Backend& backend() const { return *backend_; }
  const KvLayout& layout() const { return layout_; }
  KeyCodec key_codec() const { return key_codec_; }
  ValueCodec value_codec() const { return value_codec_; }
  bool has_moments() const { return has_moments_; }
  // The projection the values need (null for raw values).
  const std::shared_ptr<const Projection>& projection() const { return projection_; }
  // The layer's sections; placed == false for a layer outside Options' range.
  const LayerSections& layer(uint32_t layer) const { return layers_[layer]; }
  // The largest kept-token count of any placed layer (all kv heads together).
  uint64_t max_layer_rows() const { return max_layer_rows_; }
  // Bytes copied to the backend by Place (0 on a host backend).
  const TransferCounters& transfers() const { return transfers_; }

 private:
  ResidentCache() = default;
  absl::Status PlaceLayer(const CompressedCache& cache, uint32_t layer, uint64_t first_row,
                          uint64_t latent_byte, uint64_t scale_elem);
  // `bytes` of host memory at `src` in the backend's space: a copy kept alive by this object
  // on a device backend, `src` itself on a host backend.
  absl::StatusOr<const void*> CopyIn(const void* src, uint64_t bytes);

  Backend* backend_ = nullptr;
  KvLayout layout_;
  KeyCodec key_codec_ = KeyCodec::kRaw;
  ValueCodec value_codec_ = ValueCodec::kRaw;
  bool has_moments_ = false;
  std::shared_ptr<const Projection> projection_;
  std::vector<LayerSections> layers_;
  std::vector<std::vector<uint64_t>> host_rows_;  // host backends: per-layer raw rows
  std::vector<std::vector<float>> host_expand_;   // per-layer expand matrices (host copies)
  std::vector<Buffer> buffers_;
  // A cache decoded at Place (the hq codecs, which no attention kernel reads): the host
  // backend's views point into it.
  std::unique_ptr<const CompressedCache> decoded_;
  uint64_t max_layer_rows_ = 0;
  TransferCounters transfers_;
};

struct AttendParams {
  // Queries [num_q_heads, num_queries, head_dim] of f32, or of the cache's dtype on a device
  // backend (f32, f16 or bf16 on the CPU); num_q_heads a multiple of the kv heads (GQA) and the
  // layout's num_q_heads when the layout names one. Host memory or the backend's space; host
  // queries for a device backend must be dense and are copied into a reused workspace.
  HeadsView queries;
  uint32_t layer = 0;
  bool correct = true;  // add the virtual token of the evicted set (when the cache has moments)
  float scale = 0.0f;   // logit scale; 0 = 1/sqrt(head_dim)
  // Output [num_q_heads, num_queries, head_dim], fp32, dense, in `out_space`: the backend's
  // space is written in place (asynchronously on CUDA: Backend::Synchronize before reading it
  // elsewhere), host memory for a device backend gets a copy once the kernels are done.
  float* out = nullptr;
  MemorySpace out_space = MemorySpace::kHost;
  // KVSplice-encoded values: attend over the latent codes and expand once per query row (true),
  // or decode the layer's values into a workspace and run the dense attention (false). Both
  // compute the same formula; the fused form reads rank numbers per token instead of head_dim
  // and writes no per-token values (it also skips their rounding to the layout's dtype). Off by
  // default: on an H100 its kernels are still slower than decoding first (docs/engine.md).
  bool expand_in_attention = false;
};

class Decoder {
 public:
  // `backend` is not owned and must outlive the decoder.
  explicit Decoder(Backend& backend) : backend_(&backend) {}
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  Backend& backend() const { return *backend_; }

  // Attention of `params.queries` over layer `params.layer` of `cache`. InvalidArgument on a
  // cache of another backend, a layer not placed, query shapes that do not fit the layout, a
  // null output, or memory of a space the backend cannot read; errors of the codec and
  // attention ops as they return them.
  absl::Status Attend(const ResidentCache& cache, const AttendParams& params);

  // Queries and outputs this decoder copied between host and device (the cache's own bytes are
  // counted by ResidentCache::transfers, once).
  const TransferCounters& transfers() const { return transfers_; }

 private:
  // A workspace of at least `bytes` in the backend's space, grown (never shrunk) as needed.
  absl::StatusOr<void*> Workspace(Buffer* buffer, uint64_t bytes);
  absl::StatusOr<const void*> DecodeKeys(const ResidentCache& cache, const LayerSections& l);
  absl::StatusOr<const void*> DecodeValues(const ResidentCache& cache, uint32_t layer,
                                           const LayerSections& l);

  Backend* backend_;
  absl::Status AttendLatent(const ResidentCache& cache, const AttendParams& params,
                            const HeadsView& queries, const void* keys, float* out);
  absl::Status AttendDense(const ResidentCache& cache, const AttendParams& params,
                           const HeadsView& queries, const void* keys, float* out);

  Buffer queries_, out_, keys_, values_, partials_;
  TransferCounters transfers_;
};

// One call for a caller that holds a host CompressedCache (the Python binding): places only
// `params.layer` of it on the decoder's backend and attends. Every call copies that layer again;
// hold a ResidentCache to decode more than once from the same cache.
absl::Status AttendOnce(Decoder& decoder, const CompressedCache& cache,
                        std::shared_ptr<const Projection> projection, const AttendParams& params);

}  // namespace decode
}  // namespace kvcomp

#endif  // KVCOMP_DECODE_ATTENTION_H_
