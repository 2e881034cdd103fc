#include "cache_repository.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/device_format.h"
#include "log.h"

namespace kvcomp {
namespace service {

namespace {

// Another tenant's key and a missing key must read the same.
absl::Status NotFoundAsMissing(const absl::Status& s) {
  if (absl::IsNotFound(s)) return absl::NotFoundError("cache not found");
  return s;
}

CacheSummary SummaryOf(const format::CacheInfo& info, const storage::LookupResult& where) {
  CacheSummary s;
  s.layout = info.layout;
  s.key_codec = info.key_codec;
  s.value_codec = info.value_codec;
  s.tier = where.tier;
  s.original_tokens = info.original_tokens;
  s.total_kept = info.total_kept;
  s.original_bytes = where.meta.original_bytes;
  s.stored_bytes = where.meta.stored_bytes;
  return s;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Projection>> CacheRepository::PinProjection(
    const CacheKey& key) {
  KVCOMP_ASSIGN_OR_RETURN(std::string model, codecs::ProjectionModel(key.tenant, key.model_id));
  return projections_->AcquireLatest(model);
}

absl::StatusOr<std::shared_ptr<const pq::Calibration>> CacheRepository::PinPq(
    const CacheKey& key, uint32_t key_bits, uint32_t value_bits) {
  KVCOMP_ASSIGN_OR_RETURN(std::string model, codecs::ProjectionModel(key.tenant, key.model_id));
  return projections_->AcquireLatestPq(model, key_bits, value_bits);
}

absl::StatusOr<CacheSummary> CacheRepository::Store(const CacheKey& key,
                                                    const CompressedCache& cache,
                                                    uint64_t original_bytes,
                                                    TransferBytes* transfers) {
  absl::Time t0 = absl::Now();
  // Written once into fresh memory on huge pages (not zeroed first); its CRC32C computed as it
  // is written: the header and table are read back, the sections are not read again.
  KVCOMP_ASSIGN_OR_RETURN(const uint64_t size, format::EncodedSize(cache));
  KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<uint8_t> buffer, storage::Payload::NewHostBuffer(size));
  uint32_t crc = 0;
  KVCOMP_RETURN_IF_ERROR(
      format::EncodeCacheInto(cache, absl::MakeSpan(buffer.get(), size), &crc));
  storage::Payload bytes(std::move(buffer), size);
  KVCOMP_ASSIGN_OR_RETURN(format::CacheInfo info, format::PeekHeader(bytes.view(), size));
  const absl::Time encoded = absl::Now();
  if (transfers != nullptr) transfers->encode_seconds += absl::ToDoubleSeconds(encoded - t0);
  return Put(key, std::move(bytes), info, original_bytes, transfers, encoded, crc);
}

absl::StatusOr<CacheSummary> CacheRepository::StoreFromDevice(const CacheKey& key,
                                                              Backend& backend,
                                                              const DeviceCompressedCache& cache,
                                                              uint64_t original_bytes,
                                                              TransferBytes* transfers) {
  absl::Time t0 = absl::Now();
  KVCOMP_ASSIGN_OR_RETURN(DeviceEncodedCache encoded, EncodeOnDevice(backend, cache, transfers));
  KVCOMP_ASSIGN_OR_RETURN(format::CacheInfo info,
                          format::PeekHeader(encoded.header, encoded.size));
  const absl::Time encode_done = absl::Now();
  if (transfers != nullptr) transfers->encode_seconds += absl::ToDoubleSeconds(encode_done - t0);
  // The payload owns the device buffer; it goes back to the backend's allocator once the store
  // no longer needs it (when Put returns: the GPU tier copies it into its pool).
  auto held = std::make_shared<Buffer>(std::move(encoded.bytes));
  storage::DeviceBytes d;
  d.data = std::shared_ptr<const void>(held, held->data());
  d.size = encoded.size;
  d.device = encoded.device;
  d.crc32c = encoded.crc32c;
  d.header = std::move(encoded.header);
  return Put(key, storage::Payload::OnDevice(std::move(d)), info, original_bytes, transfers,
             encode_done, std::nullopt);
}

absl::StatusOr<CacheSummary> CacheRepository::Put(const CacheKey& key, storage::Payload payload,
                                                  const format::CacheInfo& info,
                                                  uint64_t original_bytes,
                                                  TransferBytes* transfers, absl::Time began,
                                                  std::optional<uint32_t> crc32c) {
  const uint64_t stored = payload.size();
  storage::CacheMeta meta;
  meta.original_bytes = original_bytes;
  meta.projection_version = info.projection_version;
  storage::DeviceCopies copies;
  storage::PutOptions po;
  po.tier = options_.put_tier;
  po.durability = options_.durability;
  po.copies = &copies;
  // The repository encoded these bytes itself and read their header back (`info`): the store
  // need not parse them again, nor checksum host bytes whose CRC the encoder gave.
  po.validate = false;
  po.crc32c = crc32c;
  KVCOMP_RETURN_IF_ERROR(store_->Put(key, std::move(payload), meta, po));
  if (transfers != nullptr) {
    transfers->to_device += copies.to_device;
    transfers->to_host += copies.to_host;
  }
  metrics_->ObserveStage(Stage::kStore, absl::ToDoubleSeconds(absl::Now() - began));
  metrics_->AddStoredCache(original_bytes, stored);
  Remember(key, info);
  storage::LookupResult where;
  where.meta.original_bytes = original_bytes;
  where.meta.stored_bytes = stored;
  auto found = store_->Lookup(key);
  where.tier = found.ok() ? found->tier : storage::TierKind::kDevice;
  return SummaryOf(info, where);
}

absl::StatusOr<storage::CacheMeta> CacheRepository::GetInto(const CacheKey& key,
                                                            const storage::DeviceTarget& target) {
  storage::DeviceCopies copies;
  auto got = store_->GetInto(key, target, &copies);
  if (!got.ok()) return NotFoundAsMissing(got.status());
  metrics_->AddTransferBytes(copies.to_device, copies.to_host);
  return got;
}

absl::StatusOr<storage::Payload> CacheRepository::Get(const CacheKey& key, Representation rep) {
  auto got = store_->Get(key);
  if (!got.ok()) return NotFoundAsMissing(got.status());
  // The GPU tier copies the cache to host memory once per get (device_tier_cuda.cc).
  if (got->meta.tier == storage::TierKind::kDevice) {
    metrics_->AddTransferBytes(0, got->payload.size());
  }
  if (rep == Representation::kDecoded) {
    KVCOMP_ASSIGN_OR_RETURN(const bool decode, NeedsDecode(got->payload));
    if (decode) return Decode(key, got->payload, nullptr);
    // Raw codecs: the stored bytes are already the decoded form.
  }
  return got->payload;
}

absl::StatusOr<bool> CacheRepository::NeedsDecode(const storage::Payload& stored) {
  KVCOMP_ASSIGN_OR_RETURN(format::CacheInfo info, format::PeekCache(stored.view()));
  return info.key_codec != KeyCodec::kRaw || info.value_codec != ValueCodec::kRaw;
}

absl::StatusOr<storage::Payload> CacheRepository::Decode(const CacheKey& key,
                                                         const storage::Payload& stored,
                                                         Backend* backend) {
  KVCOMP_ASSIGN_OR_RETURN(CompressedCache cache, format::ParseCache(stored.view()));
  KVCOMP_ASSIGN_OR_RETURN(CompressedCache raw, DecodeParsed(key, std::move(cache), backend));
  // Written once into fresh memory (huge pages, not zeroed first), as a put's encoding is.
  KVCOMP_ASSIGN_OR_RETURN(const uint64_t size, format::EncodedSize(raw));
  KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<uint8_t> buffer, storage::Payload::NewHostBuffer(size));
  KVCOMP_RETURN_IF_ERROR(format::EncodeCacheInto(raw, absl::MakeSpan(buffer.get(), size)));
  return storage::Payload(std::move(buffer), size);
}

absl::StatusOr<CompressedCache> CacheRepository::DecodeParsed(const CacheKey& key,
                                                              CompressedCache cache,
                                                              Backend* backend) {
  const absl::Time t0 = absl::Now();
  KVCOMP_ASSIGN_OR_RETURN(std::string model, codecs::ProjectionModel(key.tenant, key.model_id));
  // On a device, the codecs' inputs go up (keys, latents and their scales) and the decoded keys
  // and values come down; the projection is uploaded once per backend and not counted here.
  const uint64_t up = cache.keys.size() + cache.values.size() +
                      cache.key_scales.size() * sizeof(cache.key_scales[0]) +
                      cache.value_scales.size() * sizeof(cache.value_scales[0]);
  KVCOMP_ASSIGN_OR_RETURN(CompressedCache raw,
                          codecs::DecodeToRaw(std::move(cache), model, projections_, backend,
                                                      projections_));
  const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  if (backend != nullptr && backend->kind() == BackendKind::kCuda) {
    metrics_->AddTransferBytes(up, raw.keys.size() + raw.values.size());
    metrics_->AddGpuSeconds(seconds);
  }
  metrics_->ObserveStage(Stage::kDecode, seconds);
  return raw;
}

void CacheRepository::Remember(const CacheKey& key, const format::CacheInfo& info) {
  absl::MutexLock lock(&mu_);
  if (infos_.size() >= kMaxRememberedInfos) infos_.clear();
  infos_[key.Encode()] = info;
}

void CacheRepository::Forget(const CacheKey& key) {
  absl::MutexLock lock(&mu_);
  infos_.erase(key.Encode());
}

absl::StatusOr<CacheRepository::Description> CacheRepository::Describe(const CacheKey& key) {
  Description d;
  auto where = store_->Lookup(key);
  if (!where.ok()) {
    Forget(key);
    return NotFoundAsMissing(where.status());
  }
  d.where = *where;
  {
    absl::MutexLock lock(&mu_);
    auto it = infos_.find(key.Encode());
    if (it != infos_.end() && it->second.total_bytes == where->meta.stored_bytes) {
      d.info = it->second;
      return d;
    }
  }
  // Not remembered (e.g. stored before a restart): read it once.
  auto got = store_->Get(key);
  if (!got.ok()) return NotFoundAsMissing(got.status());
  KVCOMP_ASSIGN_OR_RETURN(d.info, format::PeekCache(got->payload.view()));
  Remember(key, d.info);
  return d;
}

absl::StatusOr<CacheSummary> CacheRepository::Summarize(const CacheKey& key) {
  KVCOMP_ASSIGN_OR_RETURN(Description d, Describe(key));
  return SummaryOf(d.info, d.where);
}

absl::Status CacheRepository::Delete(const CacheKey& key) {
  absl::Status s = NotFoundAsMissing(store_->Delete(key));
  if (s.ok()) {
    Deleted(key);
  } else {
    Forget(key);
  }
  return s;
}

void CacheRepository::Deleted(const CacheKey& key) {
  Forget(key);
  // The cache may have been the last to name an older projection version of its model.
  auto model = codecs::ProjectionModel(key.tenant, key.model_id);
  if (!model.ok()) return;
  auto collected = projections_->Collect(*model);
  if (!collected.ok()) {
    Log(LogLevel::kWarning, "projection cleanup of ", *model, ": ", collected.status().ToString());
  } else if (*collected > 0) {
    metrics_->AddProjectionsDeleted(*collected);
    Log(LogLevel::kDebug, "deleted ", *collected, " unused projection version(s) of ", *model);
  }
}

absl::StatusOr<std::vector<CacheKey>> CacheRepository::List(const std::string& tenant,
                                                            const std::string& model_id) {
  KVCOMP_ASSIGN_OR_RETURN(std::vector<storage::ListedCache> listed, store_->List(tenant));
  std::vector<CacheKey> out;
  for (storage::ListedCache& c : listed) {
    if (!model_id.empty() && c.key.model_id != model_id) continue;
    out.push_back(std::move(c.key));
  }
  std::sort(out.begin(), out.end(),
            [](const CacheKey& a, const CacheKey& b) { return a.Encode() < b.Encode(); });
  return out;
}

}  // namespace service
}  // namespace kvcomp
