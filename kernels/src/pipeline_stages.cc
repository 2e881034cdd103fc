#include "pipeline_stages.h"

#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/kvsplice.h"
#include "kvcomp/kernels/moment_ops.h"

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
                             const Projection* projection) {
  if (policy.value_codec == ValueCodec::kRaw) return absl::OkStatus();
  if (projection == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "value_codec ", ValueCodecName(policy.value_codec),
        " needs a calibrated projection (CompressOptions::projection; see kvcomp.calibrate)"));
  }
  return ChooseRank(policy, *projection).status();
}

absl::Status CodecStage(Backend& backend, const CompressionPolicy& policy,
                        const Projection* projection, CompressedCache* cache) {
  if (policy.key_codec == KeyCodec::kRaw && policy.value_codec == ValueCodec::kRaw) {
    return absl::OkStatus();
  }
  return EncodeKept(backend, policy, projection, cache);
}

absl::Status DeviceCodecStage(Backend& backend, const CompressionPolicy& policy,
                              const Projection* projection, DeviceCompressedCache* cache,
                              TransferBytes* transfers) {
  if (policy.key_codec == KeyCodec::kRaw && policy.value_codec == ValueCodec::kRaw) {
    return absl::OkStatus();
  }
  // Encoded on the host arrays, then the encoded arrays copied back to the device.
  KVCOMP_ASSIGN_OR_RETURN(CompressedCache host, cache->Download(backend, transfers));
  KVCOMP_RETURN_IF_ERROR(EncodeKept(backend, policy, projection, &host));
  auto upload = [&](Buffer* dst, const auto& v) -> absl::Status {
    using T = typename std::decay_t<decltype(v)>::value_type;
    dst->Reset();
    if (v.empty()) return absl::OkStatus();
    KVCOMP_ASSIGN_OR_RETURN(*dst, Buffer::Allocate(backend.allocator(), v.size() * sizeof(T)));
    if (transfers != nullptr) transfers->to_device += v.size() * sizeof(T);
    return backend.CopyFromHost(dst->data(), v.data(), v.size() * sizeof(T));
  };
  KVCOMP_RETURN_IF_ERROR(upload(&cache->keys, host.keys));
  KVCOMP_RETURN_IF_ERROR(upload(&cache->key_scales, host.key_scales));
  KVCOMP_RETURN_IF_ERROR(upload(&cache->values, host.values));
  KVCOMP_RETURN_IF_ERROR(upload(&cache->value_scales, host.value_scales));
  KVCOMP_RETURN_IF_ERROR(upload(&cache->raw_value_rows, host.raw_value_rows));
  KVCOMP_RETURN_IF_ERROR(upload(&cache->raw_values, host.raw_values));
  cache->raw_value_row_count = host.raw_value_rows.size();
  CompressedCache& h = cache->host;
  h.key_codec = host.key_codec;
  h.value_codec = host.value_codec;
  h.rank = host.rank;
  h.group_size = host.group_size;
  h.projection_version = host.projection_version;
  h.value_gamma = host.value_gamma;
  h.layer_rank = host.layer_rank;
  return absl::OkStatus();
}

}  // namespace pipeline_internal
}  // namespace kvcomp
