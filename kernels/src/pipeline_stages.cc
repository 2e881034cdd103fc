#include "pipeline_stages.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvcomp/codecs/hq.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/kvsplice.h"
#include "kvcomp/kernels/moment_ops.h"
#include "cpu/kvsplice_internal.h"
#if defined(KVCOMP_HAVE_CUDA)
#include "cuda/codec_device.h"
#endif

namespace kvcomp {
namespace pipeline_internal {
namespace {

// Copies a host array into a fresh buffer of the backend's space (or points at it on the CPU).
template <typename T>
absl::StatusOr<const T*> ToBackend(Backend& backend, const std::vector<T>& host, Buffer* owner) {
  if (backend.space() == MemorySpace::kHost) return host.data();
  KVCOMP_ASSIGN_OR_RETURN(*owner, Buffer::Allocate(backend.allocator(), host.size() * sizeof(T)));
  KVCOMP_RETURN_IF_ERROR(backend.CopyFromHost(owner->data(), host.data(), host.size() * sizeof(T)));
  return owner->as<T>();
}

}  // namespace

// Every backend now carries MomentOps; keep this the single switch should one not.
bool MomentsAvailable(Backend& /*backend*/) { return true; }

bool StoresMoments(Backend& backend, const CompressionPolicy& policy, uint64_t kept_per_head,
                   uint64_t num_tokens) {
  if (!policy.moments || !MomentsAvailable(backend)) return false;
  if (policy.token_budget == 0 && policy.ratio <= 0.0) return false;
  return num_tokens == 0 || kept_per_head < num_tokens;
}

absl::Status MomentStage(Backend& backend, const LayerEviction& e, CompressedCache* cache) {
  const uint32_t heads = e.keys.num_heads;
  const uint32_t d = e.keys.head_dim;
  const uint64_t h0 = uint64_t{e.layer} * heads;
  Buffer idx_buf, off_buf;
  KVCOMP_ASSIGN_OR_RETURN(const uint32_t* idx, ToBackend(backend, e.evicted, &idx_buf));
  KVCOMP_ASSIGN_OR_RETURN(const uint64_t* off, ToBackend(backend, e.offsets, &off_buf));
  TokenLists lists{idx, off, heads, backend.space()};
  if (backend.space() == MemorySpace::kHost) {
    MomentsView out{cache->moment_count.data() + h0,
                    cache->moment_key_sum.data() + h0 * d,
                    cache->moment_value_sum.data() + h0 * d,
                    cache->moment_vk_sum.data() + h0 * d * d,
                    heads,
                    d,
                    MemorySpace::kHost};
    return backend.moments().Accumulate(e.keys, e.values, lists, out);
  }
  // Device: accumulate into zeroed device moments, then add them to the cache's on the host.
  const uint64_t cnt_bytes = heads * sizeof(uint64_t);
  const uint64_t vec_bytes = uint64_t{heads} * d * sizeof(float);
  const uint64_t mat_bytes = vec_bytes * d;
  KVCOMP_ASSIGN_OR_RETURN(
      Buffer dev, Buffer::Allocate(backend.allocator(), cnt_bytes + 2 * vec_bytes + mat_bytes));
  std::vector<uint8_t> zeros(cnt_bytes + 2 * vec_bytes + mat_bytes, 0);
  KVCOMP_RETURN_IF_ERROR(backend.CopyFromHost(dev.data(), zeros.data(), zeros.size()));
  char* p = dev.as<char>();
  MomentsView out{reinterpret_cast<uint64_t*>(p),
                  reinterpret_cast<float*>(p + cnt_bytes),
                  reinterpret_cast<float*>(p + cnt_bytes + vec_bytes),
                  reinterpret_cast<float*>(p + cnt_bytes + 2 * vec_bytes),
                  heads,
                  d,
                  backend.space()};
  KVCOMP_RETURN_IF_ERROR(backend.moments().Accumulate(e.keys, e.values, lists, out));
  KVCOMP_RETURN_IF_ERROR(backend.CopyToHost(zeros.data(), dev.data(), zeros.size()));
  const uint64_t* cnt = reinterpret_cast<const uint64_t*>(zeros.data());
  const float* ks = reinterpret_cast<const float*>(zeros.data() + cnt_bytes);
  const float* vs = reinterpret_cast<const float*>(zeros.data() + cnt_bytes + vec_bytes);
  const float* vk = reinterpret_cast<const float*>(zeros.data() + cnt_bytes + 2 * vec_bytes);
  for (uint32_t h = 0; h < heads; ++h) cache->moment_count[h0 + h] += cnt[h];
  for (uint64_t i = 0; i < uint64_t{heads} * d; ++i) {
    cache->moment_key_sum[h0 * d + i] += ks[i];
    cache->moment_value_sum[h0 * d + i] += vs[i];
  }
  for (uint64_t i = 0; i < uint64_t{heads} * d * d; ++i)
    cache->moment_vk_sum[h0 * d * d + i] += vk[i];
  return absl::OkStatus();
}

absl::Status CodecsAvailable(Backend& backend, const CompressionPolicy& policy,
                             const Projection* projection, const pq::Calibration* pq,
                             const KvLayout& layout) {
  KVCOMP_RETURN_IF_ERROR(CheckPqCodecs(backend, policy, pq, layout));
  if (!IsProjectionCodec(policy.value_codec)) return absl::OkStatus();  // raw, hq, pq
  if (projection == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "value_codec ", ValueCodecName(policy.value_codec),
        " needs a calibrated projection (CompressOptions::projection; see kvcomp.calibrate)"));
  }
  return ChooseRank(policy, *projection).status();
}

absl::Status CodecStage(Backend& backend, const CompressionPolicy& policy,
                        const Projection* projection, CompressedCache* cache,
                        const pq::Calibration* pq) {
  if (policy.key_codec == KeyCodec::kRaw && policy.value_codec == ValueCodec::kRaw) {
    return absl::OkStatus();
  }
  return EncodeKept(backend, policy, projection, cache, pq);
}

absl::Status DeviceCodecStage(Backend& backend, const CompressionPolicy& policy,
                              const Projection* projection, DeviceCompressedCache* cache,
                              TransferBytes* /*transfers*/, const pq::Calibration* pq) {
  if (policy.key_codec == KeyCodec::kRaw && policy.value_codec == ValueCodec::kRaw) {
    return absl::OkStatus();
  }
  CompressedCache& host = cache->host;
  if (host.key_codec != KeyCodec::kRaw || host.value_codec != ValueCodec::kRaw) {
    return absl::FailedPreconditionError("kvsplice: the cache is already encoded");
  }
  KVCOMP_RETURN_IF_ERROR(CheckPqCodecs(backend, policy, pq, host.layout));
  if (!DeviceEncodes(policy)) {
    return absl::FailedPreconditionError(
        "the hq codecs' device encoder is switched off (KVCOMP_HQ_DEVICE_ENCODE=0): compress "
        "into host memory (Compress encodes them on the host after the device's selection)");
  }
  const KvLayout& layout = host.layout;
  const uint64_t d = layout.head_dim, total = host.total_kept();
  [[maybe_unused]] const uint64_t row_bytes = DTypeBytes(layout.dtype, d);  // outliers (CUDA)
  const std::vector<uint64_t> offsets = host.TokenOffsets();
  RowSpan rows;
  rows.row_offsets = offsets;
  CodecOps& ops = backend.codec();
  Allocator& a = backend.allocator();
  auto alloc = [&](Buffer* b, uint64_t bytes) -> absl::Status {
    b->Reset();
    if (bytes == 0) return absl::OkStatus();
    KVCOMP_ASSIGN_OR_RETURN(*b, Buffer::Allocate(a, bytes));
    return absl::OkStatus();
  };

  if (IsPq(policy.value_codec)) {
    // The calibrated basis codec: one record per kept row against its head's basis, every head
    // of the cache in one call.
    Buffer out;
    KVCOMP_RETURN_IF_ERROR(alloc(&out, total * pq->values.RecordBytes()));
    KVCOMP_RETURN_IF_ERROR(ops.EncodePq(pq->values, pq->value_fingerprint, offsets,
                                        cache->values.data(), layout.dtype, out.data()));
    cache->values = std::move(out);
    cache->value_scales.Reset();
    cache->raw_value_row_count = 0;
    cache->raw_value_rows.Reset();
    cache->raw_values.Reset();
    host.value_codec = ValueCodec::kPq;
    host.rank = 0;
    host.layer_rank.clear();
    host.group_size = 32;
    host.value_gamma = false;
    host.pq_value_basis = pq->value_fingerprint;
    host.pq_value_bits = pq->values.bits_total;
  } else if (const uint32_t bits = HqBits(policy.value_codec); bits != 0) {
    // The Hadamard codec: one record per kept row, every row of the cache in one call.
    Buffer out;
    KVCOMP_RETURN_IF_ERROR(alloc(&out, total * hq::RowBytes(bits, layout.head_dim)));
    KVCOMP_RETURN_IF_ERROR(ops.EncodeHq(bits, total, layout.head_dim, cache->values.data(),
                                        layout.dtype, out.data()));
    cache->values = std::move(out);
    cache->value_scales.Reset();
    cache->raw_value_row_count = 0;
    cache->raw_value_rows.Reset();
    cache->raw_values.Reset();
    host.value_codec = policy.value_codec;
    host.rank = 0;
    host.layer_rank.clear();
    host.group_size = 32;
    host.value_gamma = false;
    host.projection_version = 0;
  } else if (policy.value_codec != ValueCodec::kRaw) {
    KVCOMP_ASSIGN_OR_RETURN(const kvsplice_internal::ValuePlan plan,
                            kvsplice_internal::PlanValueCodec(policy, projection, layout));
    const std::vector<uint32_t>& ranks = plan.ranks;
    const ValueCodecParams& p = plan.params;
    const uint32_t rank = p.rank;
    const bool uniform = plan.uniform;
    const std::vector<kvsplice_internal::LayerRows> layers =
        kvsplice_internal::SplitLayers(offsets, layout.num_kv_heads, p, ranks);
    bool any_outlier = false;
    for (uint32_t k : host.kept) {
      any_outlier =
          any_outlier || kvsplice_internal::OutlierCap(k, policy.value_raw_fraction) > 0;
    }
    cache->raw_value_row_count = 0;
    cache->raw_value_rows.Reset();
    cache->raw_values.Reset();
    // One pass over every layer at its rank: latents, scales and each row's outlier measure.
    const kvsplice_internal::LayerRows& last = layers.back();
    const uint64_t latent_bytes = last.latent_byte + last.offsets.back() * last.params.LatentBytes();
    const uint64_t scale_count = last.scale_elem + last.offsets.back() * last.params.Groups();
    Buffer latent, scales, residuals;
    KVCOMP_RETURN_IF_ERROR(alloc(&latent, latent_bytes));
    KVCOMP_RETURN_IF_ERROR(alloc(&scales, scale_count * sizeof(uint16_t)));
    if (any_outlier) KVCOMP_RETURN_IF_ERROR(alloc(&residuals, 2 * total * sizeof(float)));
    float* energy = any_outlier ? residuals.as<float>() : nullptr;
    float* lost = any_outlier ? energy + total : nullptr;
    KVCOMP_RETURN_IF_ERROR(ops.EncodeValueLayers(*projection, p, ranks, offsets,
                                                 cache->values.data(), layout.dtype,
                                                 latent.data(), scales.as<uint16_t>(), energy,
                                                 lost));
    if (any_outlier) {
      // KVSplice outliers: the rows picked on the device from the measure above.
#if defined(KVCOMP_HAVE_CUDA)
      KVCOMP_RETURN_IF_ERROR(codec_device::PickRawValueRows(
          backend.native_stream(), a, energy, lost, offsets, policy.value_raw_fraction,
          policy.value_outlier_factor, cache->values.data(), row_bytes, &cache->raw_value_rows,
          &cache->raw_values, &cache->raw_value_row_count));
#else
      return absl::FailedPreconditionError("this build has no CUDA");
#endif
    }
    cache->values = std::move(latent);
    cache->value_scales = std::move(scales);
    host.value_codec = p.codec;
    host.rank = rank;
    if (uniform) {
      host.layer_rank.clear();
    } else {
      host.layer_rank = ranks;
    }
    host.group_size = p.Groups() > 0 ? p.group_size : 32;
    host.value_gamma = p.UsesGamma();
    host.projection_version = projection->version;
  }
  if (IsPq(policy.key_codec)) {
    Buffer keys;
    KVCOMP_RETURN_IF_ERROR(alloc(&keys, total * pq->keys.RecordBytes()));
    KVCOMP_RETURN_IF_ERROR(ops.EncodePq(pq->keys, pq->key_fingerprint, offsets,
                                        cache->keys.data(), layout.dtype, keys.data()));
    cache->keys = std::move(keys);
    cache->key_scales.Reset();
    host.key_codec = KeyCodec::kPq;
    host.pq_key_basis = pq->key_fingerprint;
    host.pq_key_bits = pq->keys.bits_total;
  } else if (const uint32_t bits = HqBits(policy.key_codec); bits != 0) {
    Buffer keys;
    KVCOMP_RETURN_IF_ERROR(alloc(&keys, total * hq::RowBytes(bits, layout.head_dim)));
    KVCOMP_RETURN_IF_ERROR(ops.EncodeHq(bits, total, layout.head_dim, cache->keys.data(),
                                        layout.dtype, keys.data()));
    cache->keys = std::move(keys);
    cache->key_scales.Reset();
    host.key_codec = policy.key_codec;
  } else if (policy.key_codec != KeyCodec::kRaw) {
    host.key_codec = policy.key_codec;  // sizes of the encoded keys and scales
    Buffer keys, key_scales;
    KVCOMP_RETURN_IF_ERROR(alloc(&keys, total * host.KeyTokenBytes()));
    KVCOMP_RETURN_IF_ERROR(alloc(&key_scales, host.KeyScaleCount() * sizeof(float)));
    host.key_codec = KeyCodec::kRaw;
    KVCOMP_RETURN_IF_ERROR(ops.EncodeKeys(policy.key_codec, rows, layout.head_dim,
                                          cache->keys.data(), layout.dtype, keys.data(),
                                          key_scales.as<float>()));
    cache->keys = std::move(keys);
    cache->key_scales = std::move(key_scales);
    host.key_codec = policy.key_codec;
  }
  if (IsPq(policy.key_codec) || IsPq(policy.value_codec)) host.projection_version = pq->version;
  return absl::OkStatus();
}

}  // namespace pipeline_internal
}  // namespace kvcomp
