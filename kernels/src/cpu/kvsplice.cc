#include "kvcomp/kernels/kvsplice.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "kvcomp/codecs/hq.h"
#include "kvcomp/core/status.h"
#include "kvsplice_internal.h"

namespace kvcomp {
namespace kvsplice_internal {

absl::Status CheckProjectionLayout(const Projection& p, const KvLayout& layout) {
  if (p.num_layers != layout.num_layers || p.num_kv_heads != layout.num_kv_heads ||
      p.head_dim != layout.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "kvsplice: projection %016x is for %u layers x %u kv heads x dim %u, the cache has "
        "%u x %u x %u",
        p.version, p.num_layers, p.num_kv_heads, p.head_dim, layout.num_layers,
        layout.num_kv_heads, layout.head_dim));
  }
  return absl::OkStatus();
}

absl::StatusOr<ValuePlan> PlanValueCodec(const CompressionPolicy& policy,
                                         const Projection* projection, const KvLayout& layout) {
  if (projection == nullptr) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "kvsplice: value codec %s needs a calibrated projection (none given)",
        ValueCodecName(policy.value_codec)));
  }
  KVCOMP_RETURN_IF_ERROR(CheckProjectionLayout(*projection, layout));
  ValuePlan plan;
  KVCOMP_ASSIGN_OR_RETURN(plan.ranks, ChooseLayerRanks(policy, *projection));
  plan.uniform = std::all_of(plan.ranks.begin(), plan.ranks.end(),
                             [&](uint32_t r) { return r == plan.ranks[0]; });
  plan.params.codec = policy.value_codec;
  plan.params.rank = *std::max_element(plan.ranks.begin(), plan.ranks.end());
  plan.params.group_size = policy.group_size;
  plan.params.gamma_aware = policy.gamma_aware;
  return plan;
}

std::vector<LayerRows> SplitLayers(const std::vector<uint64_t>& offsets, uint32_t kv_heads,
                                   const ValueCodecParams& base,
                                   const std::vector<uint32_t>& ranks) {
  std::vector<LayerRows> layers(ranks.size());
  uint64_t latent = 0, scales = 0;
  for (size_t l = 0; l < ranks.size(); ++l) {
    LayerRows& L = layers[l];
    L.first_head = l * kv_heads;
    L.first_row = offsets[L.first_head];
    L.offsets.resize(kv_heads + 1);
    for (uint32_t i = 0; i <= kv_heads; ++i) L.offsets[i] = offsets[L.first_head + i] - L.first_row;
    L.params = base;
    L.params.rank = ranks[l];
    L.latent_byte = latent;
    L.scale_elem = scales;
    latent += L.offsets.back() * L.params.LatentBytes();
    scales += L.offsets.back() * L.params.Groups();
  }
  return layers;
}

}  // namespace kvsplice_internal

namespace {

using kvsplice_internal::CheckProjectionLayout;
using kvsplice_internal::kOutlierFloor;
using kvsplice_internal::LayerRows;
using kvsplice_internal::OutlierCap;
using kvsplice_internal::SplitLayers;


RowSpan AllHeads(const std::vector<uint64_t>& offsets) {
  RowSpan rows;
  rows.first_head = 0;
  rows.row_offsets = offsets;
  return rows;
}

// Whether the outlier rule can pick any row of `c` under `policy`.
bool AnyOutlierRows(const CompressedCache& c, const CompressionPolicy& policy) {
  for (uint64_t h = 0; h < c.num_heads(); ++h) {
    if (OutlierCap(c.kept[h], policy.value_raw_fraction) > 0) return true;
  }
  return false;
}

// The outlier rule of kvsplice_internal (OutlierCap) on a host cache, from each row's energy
// and lost (EncodeValueLayers' measure). Returns ascending row indices.
std::vector<uint64_t> PickRawValueRows(const CompressedCache& c, const std::vector<float>& energy,
                                       const std::vector<float>& lost,
                                       const CompressionPolicy& policy) {
  std::vector<uint64_t> out;
  const std::vector<uint64_t> off = c.TokenOffsets();
  std::vector<std::pair<float, uint64_t>> worst;
  std::vector<float> median;
  for (uint64_t h = 0; h < c.num_heads(); ++h) {
    const uint64_t n = c.kept[h];
    const uint64_t cap = OutlierCap(n, policy.value_raw_fraction);
    if (cap == 0) continue;
    const float* hl = lost.data() + off[h];
    const float* he = energy.data() + off[h];
    median.assign(hl, hl + n);
    std::nth_element(median.begin(), median.begin() + n / 2, median.end());
    const float median_lost = median[n / 2];
    median.assign(he, he + n);
    std::nth_element(median.begin(), median.begin() + n / 2, median.end());
    const float limit =
        std::max(kOutlierFloor * median[n / 2],
                 static_cast<float>(policy.value_outlier_factor * median_lost));
    worst.clear();
    for (uint64_t i = 0; i < n; ++i) {
      if (hl[i] > limit) worst.emplace_back(-hl[i], off[h] + i);
    }
    if (worst.size() > cap) {
      std::partial_sort(worst.begin(), worst.begin() + cap, worst.end());
      worst.resize(cap);
    }
    for (const auto& w : worst) out.push_back(w.second);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The calibration a pq cache names, checked against the one given.
absl::Status CheckPqDecode(const CompressedCache& cache,
                           const pq::Calibration* pq) {
  if (!IsPq(cache.key_codec) && !IsPq(cache.value_codec)) return absl::OkStatus();
  if (pq == nullptr) {
    return absl::NotFoundError(absl::StrFormat(
        "pq: the cache was encoded with pq calibration %016x, which was not given: it cannot be "
        "decoded without it",
        cache.projection_version));
  }
  if (pq->version != cache.projection_version ||
      (IsPq(cache.key_codec) && pq->key_fingerprint != cache.pq_key_basis) ||
      (IsPq(cache.value_codec) && pq->value_fingerprint != cache.pq_value_basis)) {
    return absl::NotFoundError(absl::StrFormat(
        "pq: the cache was encoded with pq calibration %016x (keys' basis %016x, values' "
        "%016x), the calibration given is %016x: decoding through another basis would return "
        "garbage",
        cache.projection_version, cache.pq_key_basis, cache.pq_value_basis, pq->version));
  }
  if (pq->keys.num_layers != cache.layout.num_layers ||
      pq->keys.num_kv_heads != cache.layout.num_kv_heads ||
      pq->keys.head_dim != cache.layout.head_dim) {
    return absl::InvalidArgumentError("pq: the calibration's shape is not the cache's");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckPqCodecs(const Backend& /*backend*/, const CompressionPolicy& policy,
                           const pq::Calibration* pq, const KvLayout& layout) {
  const bool kpq = IsPq(policy.key_codec), vpq = IsPq(policy.value_codec);
  if (!kpq && !vpq) return absl::OkStatus();
  if (pq == nullptr) {
    return absl::FailedPreconditionError(
        "pq: the pq codecs need the model's pq calibration (kvcomp.calibrate_pq in Python; "
        "kvcompd: the Calibrate call with value_codec \"pq\"), none given");
  }
  if (pq->keys.num_layers != layout.num_layers || pq->keys.num_kv_heads != layout.num_kv_heads ||
      pq->keys.head_dim != layout.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pq: calibration %016x is for %u layers x %u kv heads x dim %u, the cache has "
        "%u x %u x %u",
        pq->version, pq->keys.num_layers, pq->keys.num_kv_heads, pq->keys.head_dim,
        layout.num_layers, layout.num_kv_heads, layout.head_dim));
  }
  const uint64_t d = layout.head_dim;
  if (kpq && pq->keys.bits_total != policy.key_bits * d) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "pq: calibration %016x codes keys at %u bits per row, the policy's key_bits %u needs "
        "%u: calibrate at key_bits %u",
        pq->version, pq->keys.bits_total, policy.key_bits, policy.key_bits * d,
        policy.key_bits));
  }
  if (vpq && pq->values.bits_total != policy.value_bits * d) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "pq: calibration %016x codes values at %u bits per row, the policy's value_bits %u "
        "needs %u: calibrate at value_bits %u",
        pq->version, pq->values.bits_total, policy.value_bits, policy.value_bits * d,
        policy.value_bits));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint32_t>> ChooseLayerRanks(const CompressionPolicy& policy,
                                                       const Projection& projection) {
  KVCOMP_ASSIGN_OR_RETURN(const uint32_t rank, ChooseRank(policy, projection));
  std::vector<uint32_t> ranks(projection.num_layers, rank);
  if (rank == 0 || policy.rank != 0) return ranks;
  if (projection.tuned_rank.size() != projection.num_layers) return ranks;
  for (uint32_t r : projection.tuned_rank) {
    if (r == 0) return ranks;  // a layer the tuner did not reach: one rank for all
  }
  for (uint32_t l = 0; l < projection.num_layers; ++l) {
    uint32_t r = projection.tuned_rank[l];
    if (policy.value_codec == ValueCodec::kOrthogonalInt4 && r % 2 != 0) ++r;
    ranks[l] = std::min(r, rank);
  }
  return ranks;
}

ValueCodecParams CacheValueParams(const CompressedCache& cache) {
  ValueCodecParams p;
  p.codec = cache.value_codec;
  p.rank = cache.rank;
  p.group_size = cache.group_size;
  p.gamma_aware = cache.value_gamma;
  return p;
}

absl::StatusOr<uint32_t> ChooseRank(const CompressionPolicy& policy, const Projection& projection) {
  if (!IsProjectionCodec(policy.value_codec)) return 0u;
  uint32_t rank = policy.rank;
  if (rank == 0) rank = projection.MaxTunedRank();
  if (rank == 0) rank = DefaultRank(policy.value_codec, projection.head_dim);
  if (policy.value_codec == ValueCodec::kOrthogonalInt4 && rank % 2 != 0) ++rank;
  if (rank > projection.rows) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "kvsplice: rank %u needs a projection with at least %u rows per head; projection %016x "
        "keeps %u (calibrate with more rows)",
        rank, rank, projection.version, projection.rows));
  }
  return rank;
}

absl::Status EncodeKept(Backend& backend, const CompressionPolicy& policy,
                        const Projection* projection, CompressedCache* cache,
                        const pq::Calibration* pq) {
  KVCOMP_RETURN_IF_ERROR(policy.ValidateFor(cache->layout.head_dim));
  if (cache->key_codec != KeyCodec::kRaw || cache->value_codec != ValueCodec::kRaw) {
    return absl::FailedPreconditionError("kvsplice: the cache is already encoded");
  }
  KVCOMP_RETURN_IF_ERROR(cache->Validate());
  KVCOMP_RETURN_IF_ERROR(CheckPqCodecs(backend, policy, pq, cache->layout));
  const KvLayout& layout = cache->layout;
  const uint64_t d = layout.head_dim, total = cache->total_kept();
  const std::vector<uint64_t> offsets = cache->TokenOffsets();
  const RowSpan rows = AllHeads(offsets);
  CodecOps& ops = backend.codec();

  if (IsPq(policy.value_codec)) {
    // The calibrated basis codec: one record per kept row against its head's basis.
    std::vector<uint8_t> out(total * pq->values.RecordBytes());
    KVCOMP_RETURN_IF_ERROR(ops.EncodePq(pq->values, pq->value_fingerprint, offsets,
                                        cache->values.data(), layout.dtype, out.data()));
    cache->values = std::move(out);
    cache->value_scales.clear();
    cache->value_codec = ValueCodec::kPq;
    cache->rank = 0;
    cache->layer_rank.clear();
    cache->group_size = 32;
    cache->value_gamma = false;
    cache->pq_value_basis = pq->value_fingerprint;
    cache->pq_value_bits = pq->values.bits_total;
  } else if (const uint32_t bits = HqBits(policy.value_codec); bits != 0) {
    // The Hadamard codec: per-token records on the host, no projection.
    std::vector<uint8_t> out(total * hq::RowBytes(bits, layout.head_dim));
    KVCOMP_RETURN_IF_ERROR(hq::EncodeRows(cache->values.data(), layout.dtype, total,
                                          layout.head_dim, bits, out.data()));
    cache->values = std::move(out);
    cache->value_scales.clear();
    cache->value_codec = policy.value_codec;
    cache->rank = 0;
    cache->layer_rank.clear();
    cache->group_size = 32;
    cache->value_gamma = false;
    cache->projection_version = 0;
  } else if (policy.value_codec != ValueCodec::kRaw) {
    KVCOMP_ASSIGN_OR_RETURN(const kvsplice_internal::ValuePlan plan,
                            kvsplice_internal::PlanValueCodec(policy, projection, layout));
    const std::vector<uint32_t>& ranks = plan.ranks;
    const ValueCodecParams& p = plan.params;
    const uint32_t rank = p.rank;
    const bool uniform = plan.uniform;
    // One pass over every layer: latents, scales and (when the policy keeps outliers raw) each
    // row's outlier measure.
    const std::vector<LayerRows> layers = SplitLayers(offsets, layout.num_kv_heads, p, ranks);
    const LayerRows& last = layers.back();
    std::vector<uint8_t> latent(last.latent_byte + last.offsets.back() * last.params.LatentBytes());
    std::vector<uint16_t> scales(last.scale_elem + last.offsets.back() * last.params.Groups());
    const bool outliers = AnyOutlierRows(*cache, policy);
    std::vector<float> energy(outliers ? total : 0), lost(outliers ? total : 0);
    KVCOMP_RETURN_IF_ERROR(ops.EncodeValueLayers(
        *projection, p, ranks, offsets, cache->values.data(), layout.dtype, latent.data(),
        scales.empty() ? nullptr : scales.data(), outliers ? energy.data() : nullptr,
        outliers ? lost.data() : nullptr));
    std::vector<uint64_t> raw_rows;
    if (outliers) raw_rows = PickRawValueRows(*cache, energy, lost, policy);
    std::vector<uint8_t> raw_values(raw_rows.size() * DTypeBytes(layout.dtype, d));
    const uint64_t in_row = DTypeBytes(layout.dtype, d);
    for (size_t i = 0; i < raw_rows.size(); ++i) {
      std::memcpy(raw_values.data() + i * in_row, cache->values.data() + raw_rows[i] * in_row,
                  in_row);
    }
    cache->values = std::move(latent);
    cache->value_scales = std::move(scales);
    cache->value_codec = p.codec;
    cache->rank = rank;
    if (uniform) {
      cache->layer_rank.clear();
    } else {
      cache->layer_rank = ranks;
    }
    cache->raw_value_rows = std::move(raw_rows);
    cache->raw_values = std::move(raw_values);
    cache->group_size = p.Groups() > 0 ? p.group_size : 32;
    cache->value_gamma = p.UsesGamma();
    cache->projection_version = projection->version;
  }
  if (IsPq(policy.key_codec)) {
    std::vector<uint8_t> out(total * pq->keys.RecordBytes());
    KVCOMP_RETURN_IF_ERROR(ops.EncodePq(pq->keys, pq->key_fingerprint, offsets,
                                        cache->keys.data(), layout.dtype, out.data()));
    cache->keys = std::move(out);
    cache->key_scales.clear();
    cache->key_codec = KeyCodec::kPq;
    cache->pq_key_basis = pq->key_fingerprint;
    cache->pq_key_bits = pq->keys.bits_total;
  } else if (const uint32_t bits = HqBits(policy.key_codec); bits != 0) {
    std::vector<uint8_t> out(total * hq::RowBytes(bits, layout.head_dim));
    KVCOMP_RETURN_IF_ERROR(hq::EncodeRows(cache->keys.data(), layout.dtype, total,
                                          layout.head_dim, bits, out.data()));
    cache->keys = std::move(out);
    cache->key_scales.clear();
    cache->key_codec = policy.key_codec;
  } else if (policy.key_codec != KeyCodec::kRaw) {
    const KeyCodec raw_codec = cache->key_codec;
    cache->key_codec = policy.key_codec;  // sizes of the encoded keys and scales
    std::vector<uint8_t> out(total * cache->KeyTokenBytes());
    std::vector<float> key_scales(cache->KeyScaleCount());
    cache->key_codec = raw_codec;
    KVCOMP_RETURN_IF_ERROR(ops.EncodeKeys(policy.key_codec, rows, layout.head_dim,
                                          cache->keys.data(), layout.dtype, out.data(),
                                          key_scales.empty() ? nullptr : key_scales.data()));
    cache->keys = std::move(out);
    cache->key_scales = std::move(key_scales);
    cache->key_codec = policy.key_codec;
  }
  if (IsPq(policy.key_codec) || IsPq(policy.value_codec)) cache->projection_version = pq->version;
  return cache->Validate();
}

namespace {

// What both decoders check first: a consistent cache, an output dtype they write.
absl::Status CheckDecode(const CompressedCache& cache, DType dtype) {
  KVCOMP_RETURN_IF_ERROR(cache.Validate());
  if (!IsInputDType(dtype)) {
    return absl::InvalidArgumentError("kvsplice: decode into f32, f16 or bf16");
  }
  return absl::OkStatus();
}

// DecodeKept's work on a cache CheckDecode passed: the kept rows decoded into `keys` and
// `values` (total_kept x head_dim of `dtype`), host memory when `on_backend` is false, else
// memory of the backend's space.
absl::Status DecodeRowsTo(Backend& backend, const CompressedCache& cache,
                          const Projection* projection, DType dtype, uint8_t* keys,
                          uint8_t* values, bool on_backend, const pq::Calibration* pq) {
  const KvLayout& layout = cache.layout;
  const std::vector<uint64_t> offsets = cache.TokenOffsets();
  const uint64_t total = cache.total_kept(), d = layout.head_dim;
  if (total == 0) return absl::OkStatus();
  if (keys == nullptr || values == nullptr) {
    return absl::InvalidArgumentError("kvsplice: null destination for the decoded rows");
  }
  const RowSpan rows = AllHeads(offsets);
  CodecOps& ops = backend.codec();
  KVCOMP_RETURN_IF_ERROR(CheckPqDecode(cache, pq));
  if (IsPq(cache.value_codec)) {
    KVCOMP_RETURN_IF_ERROR(ops.DecodePq(pq->values, pq->value_fingerprint, offsets,
                                        cache.values.data(), values, dtype));
  } else if (const uint32_t bits = HqBits(cache.value_codec); bits != 0) {
    KVCOMP_RETURN_IF_ERROR(
        ops.DecodeHq(bits, total, layout.head_dim, cache.values.data(), values, dtype));
  } else if (cache.value_codec != ValueCodec::kRaw) {
    if (projection == nullptr) {
      return absl::NotFoundError(absl::StrFormat(
          "kvsplice: the cache's values were encoded with projection %016x, which was not given: "
          "they cannot be decoded without it",
          cache.projection_version));
    }
    if (projection->version != cache.projection_version) {
      return absl::NotFoundError(absl::StrFormat(
          "kvsplice: the cache was encoded with projection %016x, the projection given is "
          "%016x: decoding through another basis would return garbage",
          cache.projection_version, projection->version));
    }
    KVCOMP_RETURN_IF_ERROR(CheckProjectionLayout(*projection, layout));
    if (cache.layer_rank.empty()) {
      KVCOMP_RETURN_IF_ERROR(
          ops.DecodeValues(*projection, CacheValueParams(cache), rows, cache.values.data(),
                           cache.value_scales.empty() ? nullptr : cache.value_scales.data(),
                           values, dtype));
    } else {
      const std::vector<LayerRows> layers =
          SplitLayers(offsets, layout.num_kv_heads, CacheValueParams(cache), cache.layer_rank);
      const uint64_t row_bytes = DTypeBytes(dtype, d);
      for (const LayerRows& L : layers) {
        if (L.offsets.back() == 0) continue;
        KVCOMP_RETURN_IF_ERROR(ops.DecodeValues(
            *projection, L.params, L.span(), cache.values.data() + L.latent_byte,
            cache.value_scales.empty() ? nullptr : cache.value_scales.data() + L.scale_elem,
            values + L.first_row * row_bytes, dtype));
      }
    }
    // KVSplice outliers: their raw values replace what the latents gave.
    const uint64_t in_row = DTypeBytes(layout.dtype, d), out_row = DTypeBytes(dtype, d);
    const bool copy_up = on_backend && backend.space() != MemorySpace::kHost;
    if (copy_up && !cache.raw_value_rows.empty()) KVCOMP_RETURN_IF_ERROR(backend.Synchronize());
    std::vector<uint8_t> row(out_row);
    for (size_t i = 0; i < cache.raw_value_rows.size(); ++i) {
      uint8_t* dst = values + cache.raw_value_rows[i] * out_row;
      const uint8_t* src = cache.raw_values.data() + i * in_row;
      uint8_t* to = copy_up ? row.data() : dst;
      if (dtype == layout.dtype) {
        std::memcpy(to, src, in_row);
      } else {
        for (uint64_t k = 0; k < d; ++k) {
          StoreFromFloat(to, dtype, k, LoadAsFloat(src, layout.dtype, k));
        }
      }
      if (copy_up) KVCOMP_RETURN_IF_ERROR(backend.CopyFromHost(dst, row.data(), out_row));
    }
  } else {
    KVCOMP_RETURN_IF_ERROR(ops.DecodeKeys(KeyCodec::kRaw, rows, layout.head_dim,
                                          cache.values.data(), layout.dtype, nullptr, values,
                                          dtype));
  }
  if (IsPq(cache.key_codec)) {
    return ops.DecodePq(pq->keys, pq->key_fingerprint, offsets, cache.keys.data(), keys, dtype);
  }
  if (const uint32_t bits = HqBits(cache.key_codec); bits != 0) {
    return ops.DecodeHq(bits, total, layout.head_dim, cache.keys.data(), keys, dtype);
  }
  return ops.DecodeKeys(cache.key_codec, rows, layout.head_dim, cache.keys.data(), layout.dtype,
                        cache.key_scales.empty() ? nullptr : cache.key_scales.data(), keys,
                        dtype);
}

}  // namespace

absl::StatusOr<DecodedKept> DecodeKept(Backend& backend, const CompressedCache& cache,
                                       const Projection* projection, DType dtype,
                                       const pq::Calibration* pq) {
  KVCOMP_RETURN_IF_ERROR(CheckDecode(cache, dtype));
  DecodedKept out;
  out.layout = cache.layout;
  out.dtype = dtype;
  out.offsets = cache.TokenOffsets();
  out.positions = cache.positions;
  const uint64_t elems = cache.total_kept() * cache.layout.head_dim;
  out.keys.resize(DTypeBytes(dtype, elems));
  out.values.resize(DTypeBytes(dtype, elems));
  KVCOMP_RETURN_IF_ERROR(DecodeRowsTo(backend, cache, projection, dtype, out.keys.data(),
                                      out.values.data(), /*on_backend=*/false, pq));
  return out;
}

absl::Status DecodeKeptInto(Backend& backend, const CompressedCache& cache,
                            const Projection* projection, DType dtype, void* keys, void* values,
                            const pq::Calibration* pq) {
  KVCOMP_RETURN_IF_ERROR(CheckDecode(cache, dtype));
  KVCOMP_RETURN_IF_ERROR(DecodeRowsTo(backend, cache, projection, dtype,
                                      static_cast<uint8_t*>(keys), static_cast<uint8_t*>(values),
                                      /*on_backend=*/true, pq));
  return backend.Synchronize();
}

absl::StatusOr<DecodedKept> DecodeKept(Backend& backend, const CompressedCache& cache,
                                       ProjectionStore& store, absl::string_view model_id,
                                       DType dtype) {
  if (!IsProjectionCodec(cache.value_codec)) return DecodeKept(backend, cache, nullptr, dtype);
  KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<const Projection> p,
                          store.Get(model_id, cache.projection_version));
  return DecodeKept(backend, cache, p.get(), dtype);
}

absl::StatusOr<CompressedCache> DecodeToRawCodecs(Backend& backend, const CompressedCache& cache,
                                                  const Projection* projection,
                                                  const pq::Calibration* pq) {
  if (cache.key_codec == KeyCodec::kRaw && cache.value_codec == ValueCodec::kRaw) return cache;
  KVCOMP_ASSIGN_OR_RETURN(DecodedKept d,
                          DecodeKept(backend, cache, projection, cache.layout.dtype, pq));
  CompressedCache raw = cache;
  raw.key_codec = KeyCodec::kRaw;
  raw.value_codec = ValueCodec::kRaw;
  raw.rank = 0;
  raw.layer_rank.clear();
  raw.raw_value_rows.clear();
  raw.raw_values.clear();
  raw.projection_version = 0;
  raw.pq_key_basis = raw.pq_value_basis = 0;
  raw.pq_key_bits = raw.pq_value_bits = 0;
  raw.value_gamma = false;
  raw.key_scales.clear();
  raw.value_scales.clear();
  raw.positions = std::move(d.positions);
  raw.keys = std::move(d.keys);
  raw.values = std::move(d.values);
  KVCOMP_RETURN_IF_ERROR(raw.Validate());
  return raw;
}

}  // namespace kvcomp
