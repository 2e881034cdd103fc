#include "kvcomp/decode/attention.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/kvsplice.h"
#include "../../src/env_switch.h"
#include "dense_decode.h"
#include "latent_attention.h"
#include "scatter_rows.h"

namespace kvcomp {
namespace decode {

absl::Status ScatterRows(Backend& backend, void* dst, const uint64_t* rows, const void* src,
                         uint64_t num_rows, uint64_t row_bytes) {
  if (backend.space() == MemorySpace::kHost) {
    auto* out = static_cast<uint8_t*>(dst);
    const auto* in = static_cast<const uint8_t*>(src);
    for (uint64_t i = 0; i < num_rows; ++i) {
      std::memcpy(out + rows[i] * row_bytes, in + i * row_bytes, row_bytes);
    }
    return absl::OkStatus();
  }
#if defined(KVCOMP_HAVE_CUDA)
  return ScatterRowsCuda(backend.native_stream(), dst, rows, src, num_rows, row_bytes);
#else
  return absl::FailedPreconditionError("decode: device backend in a build without CUDA");
#endif
}

namespace {

#if defined(KVCOMP_HAVE_CUDA)
// The stream-ordered dense decode (dense_decode.h) unless KVCOMP_DECODE_PREPARED=0, which keeps
// every layer on the codec ops (for comparisons).
bool PreparedDecode() {
  static const bool on = internal::SwitchOn("KVCOMP_DECODE_PREPARED");
  return on;
}
#endif

absl::Status CheckProjection(const CompressedCache& cache, const Projection* projection) {
  if (cache.value_codec == ValueCodec::kRaw) return absl::OkStatus();
  if (projection == nullptr) {
    return absl::NotFoundError(absl::StrFormat(
        "decode: the cache's values were encoded with projection %016x, which was not given",
        cache.projection_version));
  }
  if (projection->version != cache.projection_version) {
    return absl::NotFoundError(absl::StrFormat(
        "decode: the cache was encoded with projection %016x, the projection given is %016x",
        cache.projection_version, projection->version));
  }
  const KvLayout& l = cache.layout;
  if (projection->num_layers != l.num_layers || projection->num_kv_heads != l.num_kv_heads ||
      projection->head_dim != l.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "decode: projection %016x is for %u layers x %u kv heads x dim %u, the cache has "
        "%u x %u x %u",
        projection->version, projection->num_layers, projection->num_kv_heads, projection->head_dim,
        l.num_layers, l.num_kv_heads, l.head_dim));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ResidentCache>> ResidentCache::Place(
    Backend& backend, const CompressedCache& cache, std::shared_ptr<const Projection> projection,
    const PlaceOptions& options) {
  KVCOMP_RETURN_IF_ERROR(cache.Validate());
  if (IsPq(cache.key_codec) || IsPq(cache.value_codec)) {
    return absl::FailedPreconditionError(
        "decode: a cache of the pq codecs is read through its calibration: decode it first "
        "(DecodeToRawCodecs / kvcomp.decompress with its pq calibration) and place the raw cache");
  }
  if (HqBits(cache.key_codec) != 0 || HqBits(cache.value_codec) != 0) {
    // No attention kernel reads the hq codecs: their rows are decoded once, here, and the cache
    // is placed with raw codecs (its layout's dtype; memory as a raw cache of the kept tokens).
    KVCOMP_ASSIGN_OR_RETURN(CompressedCache raw,
                            DecodeToRawCodecs(backend, cache, projection.get()));
    auto decoded = std::make_unique<const CompressedCache>(std::move(raw));
    KVCOMP_ASSIGN_OR_RETURN(std::unique_ptr<ResidentCache> rc,
                            Place(backend, *decoded, nullptr, options));
    rc->decoded_ = std::move(decoded);
    return rc;
  }
  KVCOMP_RETURN_IF_ERROR(CheckProjection(cache, projection.get()));
  const KvLayout& layout = cache.layout;
  if (options.first_layer >= layout.num_layers ||
      uint64_t{options.first_layer} + options.num_layers > layout.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("decode: layers [%u, +%u) outside the cache's %u layers",
                        options.first_layer, options.num_layers, layout.num_layers));
  }
  const uint32_t end =
      options.num_layers == 0 ? layout.num_layers : options.first_layer + options.num_layers;
  std::unique_ptr<ResidentCache> rc(new ResidentCache());
  rc->backend_ = &backend;
  rc->layout_ = layout;
  rc->key_codec_ = cache.key_codec;
  rc->value_codec_ = cache.value_codec;
  rc->has_moments_ = cache.has_moments;
  if (cache.value_codec != ValueCodec::kRaw) rc->projection_ = std::move(projection);
  rc->layers_.resize(layout.num_layers);
  rc->host_rows_.resize(layout.num_layers);
  rc->host_expand_.resize(layout.num_layers);
  const std::vector<uint64_t> off = cache.TokenOffsets();
  uint64_t latent_byte = 0, scale_elem = 0;
  for (uint32_t l = 0; l < end; ++l) {
    const uint64_t first_row = off[uint64_t{l} * layout.num_kv_heads];
    if (l >= options.first_layer) {
      KVCOMP_RETURN_IF_ERROR(rc->PlaceLayer(cache, l, first_row, latent_byte, scale_elem));
    }
    const uint64_t rows = off[uint64_t{l + 1} * layout.num_kv_heads] - first_row;
    latent_byte += rows * cache.ValueTokenBytes(l);
    scale_elem += rows * cache.ValueGroups(l);
  }
  return rc;
}

absl::StatusOr<const void*> ResidentCache::CopyIn(const void* src, uint64_t bytes) {
  if (bytes == 0) return static_cast<const void*>(nullptr);
  if (backend_->space() == MemorySpace::kHost) return src;
  KVCOMP_ASSIGN_OR_RETURN(Buffer b, Buffer::Allocate(backend_->allocator(), bytes));
  KVCOMP_RETURN_IF_ERROR(backend_->CopyFromHost(b.data(), src, bytes));
  transfers_.host_to_device_bytes += bytes;
  buffers_.push_back(std::move(b));
  return const_cast<const void*>(buffers_.back().data());
}

absl::Status ResidentCache::PlaceLayer(const CompressedCache& cache, uint32_t layer,
                                       uint64_t first_row, uint64_t latent_byte,
                                       uint64_t scale_elem) {
  const uint32_t hk = layout_.num_kv_heads, d = layout_.head_dim;
  const uint64_t h0 = uint64_t{layer} * hk;
  LayerSections& s = layers_[layer];
  s.offsets.resize(hk + 1);
  for (uint32_t h = 0; h <= hk; ++h) s.offsets[h] = cache.token_offset(h0 + h) - first_row;
  s.rows = s.offsets[hk];
  max_layer_rows_ = std::max(max_layer_rows_, s.rows);
  KVCOMP_ASSIGN_OR_RETURN(const void* doff, CopyIn(s.offsets.data(), (hk + 1) * sizeof(uint64_t)));
  s.device_offsets = static_cast<const uint64_t*>(doff);
  const uint64_t key_row = cache.KeyTokenBytes();
  KVCOMP_ASSIGN_OR_RETURN(s.keys,
                          CopyIn(cache.keys.data() + first_row * key_row, s.rows * key_row));
  if (cache.key_codec == KeyCodec::kInt8 || cache.key_codec == KeyCodec::kInt4) {
    const uint64_t ks0 = cache.KeyScaleOffset(h0), ks1 = cache.KeyScaleOffset(h0 + hk);
    KVCOMP_ASSIGN_OR_RETURN(const void* ks,
                            CopyIn(cache.key_scales.data() + ks0, (ks1 - ks0) * sizeof(float)));
    s.key_scales = static_cast<const float*>(ks);
  }
#if defined(KVCOMP_HAVE_CUDA)
  // A CUDA backend's layers get the dense decode's launch tables (dense_decode.h).
  const bool prepared = backend_->space() != MemorySpace::kHost &&
                        backend_->native_stream() != nullptr && PreparedDecode();
  if (prepared) {
    const KeyDecodeTable t = KeyDecodeTableFor(s, cache.key_codec);
    KVCOMP_ASSIGN_OR_RETURN(s.key_tiles, CopyIn(t.tiles.data(), t.tiles.size()));
    s.num_key_tiles = t.num_tiles;
  }
#endif
  KVCOMP_ASSIGN_OR_RETURN(
      s.values, CopyIn(cache.values.data() + latent_byte, s.rows * cache.ValueTokenBytes(layer)));
  if (cache.value_codec != ValueCodec::kRaw) {
    s.value_params = CacheValueParams(cache);
    s.value_params.rank = cache.LayerRank(layer);
    const uint64_t groups = cache.ValueGroups(layer);
    if (groups > 0) {
      KVCOMP_ASSIGN_OR_RETURN(const void* vs, CopyIn(cache.value_scales.data() + scale_elem,
                                                     s.rows * groups * sizeof(uint16_t)));
      s.value_scales = static_cast<const uint16_t*>(vs);
    }
    // The outliers of this layer: raw_value_rows is ascending over the whole cache.
    const auto& all = cache.raw_value_rows;
    const auto lo = std::lower_bound(all.begin(), all.end(), first_row);
    const auto hi = std::lower_bound(lo, all.end(), first_row + s.rows);
    std::vector<uint64_t>& rows = host_rows_[layer];
    for (auto it = lo; it != hi; ++it) rows.push_back(*it - first_row);
    s.num_raw_rows = rows.size();
    // The expand matrices of the layer's heads (the first `rank` basis rows, times gamma when
    // the codec divided by it).
    const Projection& proj = *projection_;
    const uint32_t rank = s.value_params.rank;
    const bool gamma = s.value_params.UsesGamma();
    std::vector<float>& ex = host_expand_[layer];
    ex.resize(uint64_t{hk} * rank * d);
    for (uint32_t h = 0; h < hk; ++h) {
      const float* basis = proj.head_basis(h0 + h);
      const float* g = proj.head_gamma(h0 + h);
      for (uint32_t j = 0; j < rank; ++j) {
        const float scale = gamma ? g[j] : 1.0f;
        float* dst = ex.data() + (uint64_t{h} * rank + j) * d;
        for (uint32_t c = 0; c < d; ++c) dst[c] = basis[uint64_t{j} * d + c] * scale;
      }
    }
    KVCOMP_ASSIGN_OR_RETURN(const void* e, CopyIn(ex.data(), ex.size() * sizeof(float)));
    s.expand = static_cast<const float*>(e);
#if defined(KVCOMP_HAVE_CUDA)
    if (prepared) {
      const ExpandTable t = ExpandTableFor(s, d, layout_.dtype, ex);
      if (t.num_tiles > 0) {
        KVCOMP_ASSIGN_OR_RETURN(s.expand_f16, CopyIn(t.expand_f16.data(), t.expand_f16.size() * 2));
        KVCOMP_ASSIGN_OR_RETURN(s.expand_tiles, CopyIn(t.tiles.data(), t.tiles.size()));
        s.num_expand_tiles = t.num_tiles;
      }
    }
#endif
    if (!rows.empty()) {
      const uint64_t raw_row = DTypeBytes(layout_.dtype, d);
      KVCOMP_ASSIGN_OR_RETURN(const void* rr, CopyIn(rows.data(), rows.size() * sizeof(uint64_t)));
      s.raw_rows = static_cast<const uint64_t*>(rr);
      KVCOMP_ASSIGN_OR_RETURN(
          s.raw_values,
          CopyIn(cache.raw_values.data() + (lo - all.begin()) * raw_row, rows.size() * raw_row));
    }
  }
  if (cache.has_moments) {
    KVCOMP_ASSIGN_OR_RETURN(const void* c, CopyIn(cache.moment_count.data() + h0, hk * 8));
    KVCOMP_ASSIGN_OR_RETURN(const void* ks,
                            CopyIn(cache.moment_key_sum.data() + h0 * d, uint64_t{hk} * d * 4));
    KVCOMP_ASSIGN_OR_RETURN(const void* vs,
                            CopyIn(cache.moment_value_sum.data() + h0 * d, uint64_t{hk} * d * 4));
    KVCOMP_ASSIGN_OR_RETURN(
        const void* vk, CopyIn(cache.moment_vk_sum.data() + h0 * d * d, uint64_t{hk} * d * d * 4));
    s.moments.count = static_cast<const uint64_t*>(c);
    s.moments.key_sum = static_cast<const float*>(ks);
    s.moments.value_sum = static_cast<const float*>(vs);
    s.moments.vk_sum = static_cast<const float*>(vk);
    s.moments.num_heads = hk;
    s.moments.head_dim = d;
    s.moments.space = backend_->space();
  }
  s.placed = true;
  return absl::OkStatus();
}

absl::StatusOr<void*> Decoder::Workspace(Buffer* buffer, uint64_t bytes) {
  if (buffer->size() < bytes) {
    buffer->Reset();
    KVCOMP_ASSIGN_OR_RETURN(*buffer, Buffer::Allocate(backend_->allocator(), bytes));
  }
  return buffer->data();
}

absl::StatusOr<const void*> Decoder::DecodeKeys(const ResidentCache& cache,
                                                const LayerSections& l) {
  if (cache.key_codec() == KeyCodec::kRaw) return l.keys;
  const KvLayout& layout = cache.layout();
  KVCOMP_ASSIGN_OR_RETURN(void* out,
                          Workspace(&keys_, DTypeBytes(layout.dtype, l.rows * layout.head_dim)));
#if defined(KVCOMP_HAVE_CUDA)
  if (l.key_tiles != nullptr) {
    KVCOMP_RETURN_IF_ERROR(DecodeKeysCuda(backend_->native_stream(), l, cache.key_codec(),
                                          layout.head_dim, layout.dtype, out));
    return const_cast<const void*>(out);
  }
#endif
  RowSpan rows;
  rows.row_offsets = l.offsets;
  KVCOMP_RETURN_IF_ERROR(backend_->codec().DecodeKeys(cache.key_codec(), rows, layout.head_dim,
                                                      l.keys, layout.dtype, l.key_scales, out,
                                                      layout.dtype));
  return const_cast<const void*>(out);
}

absl::StatusOr<const void*> Decoder::DecodeValues(const ResidentCache& cache, uint32_t layer,
                                                  const LayerSections& l) {
  if (cache.value_codec() == ValueCodec::kRaw) return l.values;
  const KvLayout& layout = cache.layout();
  const uint64_t row_bytes = DTypeBytes(layout.dtype, layout.head_dim);
  KVCOMP_ASSIGN_OR_RETURN(void* out, Workspace(&values_, l.rows * row_bytes));
#if defined(KVCOMP_HAVE_CUDA)
  if (l.expand_tiles != nullptr) {
    KVCOMP_RETURN_IF_ERROR(
        DecodeValuesCuda(backend_->native_stream(), l, layout.head_dim, layout.dtype, out));
  } else
#endif
  {
    RowSpan rows;
    rows.first_head = uint64_t{layer} * layout.num_kv_heads;
    rows.row_offsets = l.offsets;
    KVCOMP_RETURN_IF_ERROR(backend_->codec().DecodeValues(*cache.projection(), l.value_params,
                                                          rows, l.values, l.value_scales, out,
                                                          layout.dtype));
  }
  KVCOMP_RETURN_IF_ERROR(
      ScatterRows(*backend_, out, l.raw_rows, l.raw_values, l.num_raw_rows, row_bytes));
  return const_cast<const void*>(out);
}

absl::Status Decoder::Attend(const ResidentCache& cache, const AttendParams& params) {
  if (&cache.backend() != backend_) {
    return absl::InvalidArgumentError("decode: the cache was placed on another backend");
  }
  const KvLayout& layout = cache.layout();
  if (params.layer >= layout.num_layers || !cache.layer(params.layer).placed) {
    return absl::InvalidArgumentError(
        absl::StrFormat("decode: layer %u is not placed (the cache has %u layers)", params.layer,
                        layout.num_layers));
  }
  const HeadsView& q = params.queries;
  const uint32_t hk = layout.num_kv_heads, d = layout.head_dim;
  if (q.head_dim != d) {
    return absl::InvalidArgumentError(
        absl::StrFormat("decode: queries have head_dim %u, the cache %u", q.head_dim, d));
  }
  if (q.num_heads == 0 || q.num_heads % hk != 0 ||
      (layout.num_q_heads != 0 && q.num_heads != layout.num_q_heads)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("decode: %u query heads for %u kv heads (layout: %u q heads)", q.num_heads,
                        hk, layout.num_q_heads));
  }
  if (params.out == nullptr) return absl::InvalidArgumentError("decode: null output");
  const MemorySpace space = backend_->space();
  if (params.out_space != space && params.out_space != MemorySpace::kHost) {
    return absl::InvalidArgumentError("decode: the output is in a space the backend cannot write");
  }
  const LayerSections& l = cache.layer(params.layer);

  HeadsView queries = q;
  if (q.space != space) {
    if (q.space != MemorySpace::kHost) {
      return absl::InvalidArgumentError("decode: queries in a space the backend cannot read");
    }
    if (q.token_stride != d || q.head_stride != q.num_tokens * d) {
      return absl::InvalidArgumentError("decode: host queries for a device backend must be dense");
    }
    const uint64_t bytes = DTypeBytes(q.dtype, uint64_t{q.num_heads} * q.num_tokens * d);
    KVCOMP_ASSIGN_OR_RETURN(void* dq, Workspace(&queries_, bytes));
    KVCOMP_RETURN_IF_ERROR(backend_->CopyFromHost(dq, q.data, bytes));
    transfers_.host_to_device_bytes += bytes;
    queries = HeadsView::Dense(dq, q.dtype, q.num_heads, q.num_tokens, d, space);
  }
  KVCOMP_ASSIGN_OR_RETURN(const void* keys, DecodeKeys(cache, l));
  const uint64_t out_bytes = uint64_t{q.num_heads} * q.num_tokens * d * sizeof(float);
  const bool copy_out = params.out_space != space;
  float* out = params.out;
  if (copy_out) {
    KVCOMP_ASSIGN_OR_RETURN(void* o, Workspace(&out_, out_bytes));
    out = static_cast<float*>(o);
  }
  if (cache.value_codec() != ValueCodec::kRaw && params.expand_in_attention) {
    KVCOMP_RETURN_IF_ERROR(AttendLatent(cache, params, queries, keys, out));
  } else {
    KVCOMP_RETURN_IF_ERROR(AttendDense(cache, params, queries, keys, out));
  }
  if (copy_out && out_bytes > 0) {
    KVCOMP_RETURN_IF_ERROR(backend_->CopyToHost(params.out, out, out_bytes));
    transfers_.device_to_host_bytes += out_bytes;
  }
  return absl::OkStatus();
}

absl::Status Decoder::AttendLatent(const ResidentCache& cache, const AttendParams& params,
                                   const HeadsView& queries, const void* keys, float* out) {
  const KvLayout& layout = cache.layout();
  const LayerSections& l = cache.layer(params.layer);
  LatentAttentionArgs a;
  a.queries = queries;
  a.keys = keys;
  a.key_dtype = layout.dtype;
  a.host_offsets = l.offsets;
  a.offsets = l.device_offsets;
  a.num_kv_heads = layout.num_kv_heads;
  a.head_dim = layout.head_dim;
  a.latent = l.values;
  a.scales = l.value_scales;
  a.value = l.value_params;
  a.expand = l.expand;
  a.num_raw_rows = l.num_raw_rows;
  a.raw_rows = l.raw_rows;
  a.raw_values = l.raw_values;
  if (cache.has_moments()) a.moments = l.moments;
  a.correct = params.correct;
  a.scale = params.scale;
  a.out = out;
  if (backend_->space() == MemorySpace::kHost) return LatentAttentionCpu(a);
#if defined(KVCOMP_HAVE_CUDA)
  const uint64_t ws = LatentAttentionWorkspaceBytes(a);
  KVCOMP_ASSIGN_OR_RETURN(void* part, Workspace(&partials_, std::max<uint64_t>(ws, 16)));
  return LatentAttentionCuda(backend_->native_stream(), a, part);
#else
  return absl::FailedPreconditionError("decode: device backend in a build without CUDA");
#endif
}

absl::Status Decoder::AttendDense(const ResidentCache& cache, const AttendParams& params,
                                  const HeadsView& queries, const void* keys, float* out) {
  const KvLayout& layout = cache.layout();
  const LayerSections& l = cache.layer(params.layer);
  const uint32_t hk = layout.num_kv_heads, d = layout.head_dim;
  const MemorySpace space = backend_->space();
  KVCOMP_ASSIGN_OR_RETURN(const void* values, DecodeValues(cache, params.layer, l));
  AttentionParams p;
  p.queries = queries;
  p.kv = RaggedKv{keys, values, layout.dtype, l.device_offsets, hk, d, space};
  p.kv.host_offsets = l.offsets.data();  // the resident cache's host copy: no read-back
  if (cache.has_moments()) p.moments = l.moments;
  p.correct = params.correct;
  p.scale = params.scale;
  p.out = out;
  return backend_->moments().Attention(p);
}

absl::Status AttendOnce(Decoder& decoder, const CompressedCache& cache,
                        std::shared_ptr<const Projection> projection, const AttendParams& params) {
  if (params.layer >= cache.layout.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat("decode: layer %u outside %u layers",
                                                      params.layer, cache.layout.num_layers));
  }
  ResidentCache::Options one;
  one.first_layer = params.layer;
  one.num_layers = 1;
  KVCOMP_ASSIGN_OR_RETURN(
      std::unique_ptr<ResidentCache> resident,
      ResidentCache::Place(decoder.backend(), cache, std::move(projection), one));
  return decoder.Attend(*resident, params);
}

}  // namespace decode
}  // namespace kvcomp
