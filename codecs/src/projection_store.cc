#include "kvcomp/codecs/projection_store.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvcomp/core/byte_coder.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/kvsplice.h"

namespace kvcomp {
namespace codecs {
namespace {

using byte_coder::GetBe;
using byte_coder::PutBe;

std::string CacheName(absl::string_view model, uint64_t version) {
  return absl::StrCat(model, "#", version);
}

std::string PqCacheName(absl::string_view model, uint64_t version) {
  return absl::StrCat("pq:", model, "#", version);
}

constexpr char kPqKeyTag = '\x01';  // projection keys start with 0x00 (their model's length)

std::string PqKeyPrefix(absl::string_view model) {
  std::string out(1, kPqKeyTag);
  if (model.empty()) return out;
  PutBe(&out, model.size(), 2);
  out.append(model.data(), model.size());
  return out;
}

// Every projection key starts with the high byte of its model's length: 0 (at most 128 bytes).
std::string AllProjectionsPrefix() { return std::string(1, '\0'); }

// Caches name their projection under their own model id, without the tenant.
absl::string_view CacheModel(absl::string_view projection_model) {
  const size_t slash = projection_model.find('/');
  return slash == absl::string_view::npos ? projection_model : projection_model.substr(slash + 1);
}

}  // namespace

absl::Status ValidateProjectionKey(const ProjectionKey& key) {
  if (key.model_id.empty() || key.model_id.size() > ProjectionKey::kMaxModelBytes) {
    return absl::InvalidArgumentError(absl::StrCat("projection: model id of ", key.model_id.size(),
                                                   " bytes, want 1..",
                                                   ProjectionKey::kMaxModelBytes));
  }
  if (key.version == 0) return absl::InvalidArgumentError("projection: version must be >= 1");
  return absl::OkStatus();
}

std::string ProjectionKeyPrefix(absl::string_view model_id) {
  std::string out;
  if (model_id.empty()) return out;
  PutBe(&out, model_id.size(), 2);
  out.append(model_id.data(), model_id.size());
  return out;
}

std::string EncodeProjectionKey(const ProjectionKey& key) {
  std::string out = ProjectionKeyPrefix(key.model_id);
  PutBe(&out, key.layer, 4);
  PutBe(&out, key.kv_head, 4);
  PutBe(&out, key.version, 8);
  return out;
}

absl::StatusOr<ProjectionKey> DecodeProjectionKey(absl::string_view b) {
  if (b.size() < 2) return absl::DataLossError("projection key too short");
  const size_t n = GetBe(b.data(), 2);
  if (b.size() != 2 + n + 16) return absl::DataLossError("projection key of wrong size");
  ProjectionKey k;
  k.model_id = std::string(b.substr(2, n));
  k.layer = static_cast<uint32_t>(GetBe(b.data() + 2 + n, 4));
  k.kv_head = static_cast<uint32_t>(GetBe(b.data() + 6 + n, 4));
  k.version = GetBe(b.data() + 10 + n, 8);
  return k;
}

absl::StatusOr<std::string> ProjectionModel(const std::string& tenant, const std::string& model) {
  std::string name = absl::StrCat(tenant, "/", model);
  if (name.size() > ProjectionKey::kMaxModelBytes) {
    return absl::InvalidArgumentError(
        "tenant and model_id together are too long to name a projection (128 bytes)");
  }
  return name;
}

absl::StatusOr<std::vector<ProjectionKey>> TieredProjectionStore::List(absl::string_view model_id) {
  const std::string prefix =
      model_id.empty() ? AllProjectionsPrefix() : ProjectionKeyPrefix(model_id);
  KVCOMP_ASSIGN_OR_RETURN(std::vector<std::string> raw, store_->ListCalibration(prefix));
  std::vector<ProjectionKey> keys;
  keys.reserve(raw.size());
  for (const std::string& r : raw) {
    // The prefix holds the model id's length, so it matches that model id exactly.
    KVCOMP_ASSIGN_OR_RETURN(ProjectionKey k, DecodeProjectionKey(r));
    keys.push_back(std::move(k));
  }
  return keys;
}

absl::Status TieredProjectionStore::Put(const Projection& projection) {
  if (projection.version == 0) return absl::InvalidArgumentError("projection is not sealed");
  KVCOMP_ASSIGN_OR_RETURN(auto keys, List(projection.model_id));
  uint32_t seq = 0;
  for (const auto& k : keys) {
    if (k.model_id != projection.model_id) continue;
    if (k.version == projection.version) return absl::OkStatus();
    seq = std::max(seq, k.layer + 1);
  }
  ProjectionKey key{projection.model_id, seq, 0, projection.version};
  KVCOMP_RETURN_IF_ERROR(ValidateProjectionKey(key));
  KVCOMP_RETURN_IF_ERROR(store_->PutCalibration(EncodeProjectionKey(key), projection.Serialize()));
  absl::MutexLock lock(&mu_);
  cache_[CacheName(projection.model_id, projection.version)] =
      std::make_shared<const Projection>(projection);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Projection>> TieredProjectionStore::Get(
    absl::string_view model_id, uint64_t version) {
  {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(CacheName(model_id, version));
    if (it != cache_.end()) return it->second;
  }
  KVCOMP_ASSIGN_OR_RETURN(auto keys, List(model_id));
  for (const auto& k : keys) {
    if (k.model_id != model_id || k.version != version) continue;
    KVCOMP_ASSIGN_OR_RETURN(std::string bytes, store_->GetCalibration(EncodeProjectionKey(k)));
    KVCOMP_ASSIGN_OR_RETURN(Projection p, Projection::Parse(bytes));
    auto shared = std::make_shared<const Projection>(std::move(p));
    absl::MutexLock lock(&mu_);
    cache_[CacheName(model_id, version)] = shared;
    return shared;
  }
  return MissingProjectionError(model_id, version);
}

absl::StatusOr<uint64_t> TieredProjectionStore::Latest(absl::string_view model_id) {
  KVCOMP_ASSIGN_OR_RETURN(auto keys, List(model_id));
  const ProjectionKey* best = nullptr;
  for (const auto& k : keys) {
    if (k.model_id == model_id && (best == nullptr || k.layer > best->layer)) best = &k;
  }
  if (best == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("no KVSplice projection for this model yet: run Calibrate first (model ",
                     model_id.substr(model_id.find('/') + 1), ")"));
  }
  return best->version;
}

absl::Status TieredProjectionStore::Delete(absl::string_view model_id, uint64_t version) {
  absl::MutexLock gc(&gc_mu_);
  KVCOMP_ASSIGN_OR_RETURN(auto keys, List(model_id));
  for (const auto& k : keys) {
    if (k.model_id != model_id || k.version != version) continue;
    const uint64_t refs = store_->ProjectionReferences(CacheModel(model_id), version);
    if (refs > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "projection ", model_id, " version ", version, " is used by ", refs, " stored caches"));
    }
    KVCOMP_RETURN_IF_ERROR(store_->DeleteCalibration(EncodeProjectionKey(k)));
    absl::MutexLock lock(&mu_);
    cache_.erase(CacheName(model_id, version));
    return absl::OkStatus();
  }
  return MissingProjectionError(model_id, version);
}

absl::StatusOr<std::shared_ptr<const Projection>> TieredProjectionStore::AcquireLatest(
    absl::string_view model) {
  absl::MutexLock gc(&gc_mu_);
  KVCOMP_ASSIGN_OR_RETURN(uint64_t version, Latest(model));
  KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<const Projection> projection, Get(model, version));
  std::string name = CacheName(model, version);
  ++pins_[name];
  // The returned pointer shares the projection and releases the pin when its last copy goes.
  return std::shared_ptr<const Projection>(
      projection.get(), [this, projection, m = std::string(model), version](const Projection*) {
        Release(m, version);
      });
}

void TieredProjectionStore::Release(const std::string& model, uint64_t version) {
  absl::MutexLock gc(&gc_mu_);
  auto it = pins_.find(CacheName(model, version));
  if (it != pins_.end() && --it->second == 0) pins_.erase(it);
}

absl::StatusOr<uint64_t> TieredProjectionStore::Collect(absl::string_view model) {
  absl::MutexLock gc(&gc_mu_);
  KVCOMP_ASSIGN_OR_RETURN(uint64_t deleted, CollectPq(model));
  auto keys = List(model);
  if (absl::IsFailedPrecondition(keys.status())) return deleted;  // no RocksDB tier: none stored
  KVCOMP_RETURN_IF_ERROR(keys.status());
  // The latest (highest sequence number) of each tenant/model.
  absl::flat_hash_map<std::string, uint32_t> latest;
  for (const auto& k : *keys) {
    auto [it, inserted] = latest.emplace(k.model_id, k.layer);
    if (!inserted) it->second = std::max(it->second, k.layer);
  }
  for (const auto& k : *keys) {
    if (k.layer == latest[k.model_id]) continue;
    if (pins_.contains(CacheName(k.model_id, k.version))) continue;
    if (k.model_id.find('/') == std::string::npos) continue;  // not a name of ours: leave it
    if (store_->ProjectionReferences(CacheModel(k.model_id), k.version) > 0) continue;
    absl::Status s = store_->DeleteCalibration(EncodeProjectionKey(k));
    if (absl::IsNotFound(s)) continue;
    KVCOMP_RETURN_IF_ERROR(s);
    {
      absl::MutexLock lock(&mu_);
      cache_.erase(CacheName(k.model_id, k.version));
    }
    ++deleted;
  }
  return deleted;
}

absl::StatusOr<uint64_t> TieredProjectionStore::Count() {
  auto keys = store_->ListCalibration(AllProjectionsPrefix());
  if (absl::IsFailedPrecondition(keys.status())) return 0;
  KVCOMP_RETURN_IF_ERROR(keys.status());
  return keys->size();
}

absl::StatusOr<uint64_t> TieredProjectionStore::CountPq() {
  auto keys = store_->ListCalibration(PqKeyPrefix(""));
  if (absl::IsFailedPrecondition(keys.status())) return 0;
  KVCOMP_RETURN_IF_ERROR(keys.status());
  return keys->size();
}

namespace {

std::string EncodePqKey(absl::string_view model, uint32_t sequence, uint32_t key_bits,
                        uint32_t value_bits, uint64_t version) {
  std::string out = PqKeyPrefix(model);
  PutBe(&out, sequence, 4);
  PutBe(&out, (uint64_t{key_bits} << 16) | value_bits, 4);
  PutBe(&out, version, 8);
  return out;
}

}  // namespace

absl::StatusOr<std::vector<TieredProjectionStore::PqKey>> TieredProjectionStore::ListPq(
    absl::string_view model) {
  KVCOMP_ASSIGN_OR_RETURN(std::vector<std::string> raw,
                          store_->ListCalibration(PqKeyPrefix(model)));
  std::vector<PqKey> keys;
  for (const std::string& r : raw) {
    if (r.size() < 3) return absl::DataLossError("pq calibration key too short");
    const size_t n = GetBe(r.data() + 1, 2);
    if (r.size() != 3 + n + 16) return absl::DataLossError("pq calibration key of wrong size");
    PqKey k;
    k.model = r.substr(3, n);
    k.sequence = static_cast<uint32_t>(GetBe(r.data() + 3 + n, 4));
    const uint32_t bits = static_cast<uint32_t>(GetBe(r.data() + 7 + n, 4));
    k.key_bits = bits >> 16;
    k.value_bits = bits & 0xffff;
    k.version = GetBe(r.data() + 11 + n, 8);
    keys.push_back(std::move(k));
  }
  return keys;
}

absl::Status TieredProjectionStore::PutPq(absl::string_view model,
                                          const pq::Calibration& calibration) {
  if (calibration.version == 0) return absl::InvalidArgumentError("pq calibration is not sealed");
  if (model.empty() || model.size() > ProjectionKey::kMaxModelBytes) {
    return absl::InvalidArgumentError(absl::StrCat("pq calibration: model name of ", model.size(),
                                                   " bytes, want 1..",
                                                   ProjectionKey::kMaxModelBytes));
  }
  KVCOMP_ASSIGN_OR_RETURN(auto keys, ListPq(model));
  uint32_t seq = 0;
  for (const auto& k : keys) {
    if (k.version == calibration.version) return absl::OkStatus();
    seq = std::max(seq, k.sequence + 1);
  }
  KVCOMP_RETURN_IF_ERROR(store_->PutCalibration(
      EncodePqKey(model, seq, calibration.key_bits(), calibration.value_bits(),
                  calibration.version),
      calibration.Serialize()));
  absl::MutexLock lock(&mu_);
  pq_cache_[PqCacheName(model, calibration.version)] =
      std::make_shared<const pq::Calibration>(calibration);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const pq::Calibration>> TieredProjectionStore::GetPq(
    absl::string_view model, uint64_t version) {
  {
    absl::MutexLock lock(&mu_);
    auto it = pq_cache_.find(PqCacheName(model, version));
    if (it != pq_cache_.end()) return it->second;
  }
  KVCOMP_ASSIGN_OR_RETURN(auto keys, ListPq(model));
  for (const auto& k : keys) {
    if (k.version != version) continue;
    KVCOMP_ASSIGN_OR_RETURN(std::string bytes,
                            store_->GetCalibration(EncodePqKey(k.model, k.sequence, k.key_bits,
                                                               k.value_bits, k.version)));
    KVCOMP_ASSIGN_OR_RETURN(pq::Calibration c, pq::Calibration::Parse(bytes));
    auto shared = std::make_shared<const pq::Calibration>(std::move(c));
    absl::MutexLock lock(&mu_);
    pq_cache_[PqCacheName(model, version)] = shared;
    return shared;
  }
  return absl::NotFoundError(absl::StrFormat(
      "pq calibration %016x of model %s is not stored (the cache names a calibration that is "
      "gone)",
      version, CacheModel(model)));
}

absl::StatusOr<std::shared_ptr<const pq::Calibration>> TieredProjectionStore::AcquireLatestPq(
    absl::string_view model, uint32_t key_bits, uint32_t value_bits) {
  absl::MutexLock gc(&gc_mu_);
  auto keys = ListPq(model);
  if (absl::IsFailedPrecondition(keys.status())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no pq calibration for this model: kvcompd keeps calibrations in its rocksdb tier, "
        "which is not enabled (model ", CacheModel(model), ")"));
  }
  KVCOMP_RETURN_IF_ERROR(keys.status());
  const PqKey* best = nullptr;
  std::string others;
  for (const auto& k : *keys) {
    if (k.key_bits == key_bits && k.value_bits == value_bits) {
      if (best == nullptr || k.sequence > best->sequence) best = &k;
    } else {
      absl::StrAppend(&others, others.empty() ? "" : ", ", "k", k.key_bits, "v", k.value_bits);
    }
  }
  if (best == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no pq calibration for this model at key_bits ", key_bits, " and value_bits ",
        value_bits, ": run Calibrate with value_codec \"pq\" and those bits first (model ",
        CacheModel(model), others.empty() ? "" : "; calibrated at ", others, ")"));
  }
  KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<const pq::Calibration> c, GetPq(model, best->version));
  const uint64_t version = best->version;
  ++pins_[PqCacheName(model, version)];
  return std::shared_ptr<const pq::Calibration>(
      c.get(), [this, c, m = std::string(model), version](const pq::Calibration*) {
        absl::MutexLock gc(&gc_mu_);
        auto it = pins_.find(PqCacheName(m, version));
        if (it != pins_.end() && --it->second == 0) pins_.erase(it);
      });
}

absl::StatusOr<uint64_t> TieredProjectionStore::CollectPq(absl::string_view model) {
  auto keys = ListPq(model);
  if (absl::IsFailedPrecondition(keys.status())) return 0;
  KVCOMP_RETURN_IF_ERROR(keys.status());
  // The latest of each tenant/model at each bit budget.
  absl::flat_hash_map<std::string, uint32_t> latest;
  auto budget = [](const PqKey& k) {
    return absl::StrCat(k.model, "#k", k.key_bits, "v", k.value_bits);
  };
  for (const auto& k : *keys) {
    auto [it, inserted] = latest.emplace(budget(k), k.sequence);
    if (!inserted) it->second = std::max(it->second, k.sequence);
  }
  uint64_t deleted = 0;
  for (const auto& k : *keys) {
    if (k.sequence == latest[budget(k)]) continue;
    if (pins_.contains(PqCacheName(k.model, k.version))) continue;
    if (k.model.find('/') == std::string::npos) continue;
    if (store_->ProjectionReferences(CacheModel(k.model), k.version) > 0) continue;
    absl::Status s = store_->DeleteCalibration(
        EncodePqKey(k.model, k.sequence, k.key_bits, k.value_bits, k.version));
    if (absl::IsNotFound(s)) continue;
    KVCOMP_RETURN_IF_ERROR(s);
    {
      absl::MutexLock lock(&mu_);
      pq_cache_.erase(PqCacheName(k.model, k.version));
    }
    ++deleted;
  }
  return deleted;
}

absl::StatusOr<CompressedCache> DecodeToRaw(CompressedCache cache,
                                            const std::string& projection_model,
                                            ProjectionStore* projections, Backend* backend,
                                            TieredProjectionStore* pq_store) {
  if (cache.key_codec == KeyCodec::kRaw && cache.value_codec == ValueCodec::kRaw) return cache;
  std::shared_ptr<const Projection> projection;
  if (IsProjectionCodec(cache.value_codec)) {
    KVCOMP_ASSIGN_OR_RETURN(projection,
                            projections->Get(projection_model, cache.projection_version));
  }
  std::shared_ptr<const pq::Calibration> calibration;
  if (IsPq(cache.key_codec) || IsPq(cache.value_codec)) {
    if (pq_store == nullptr) {
      return absl::NotFoundError(absl::StrFormat(
          "the cache was encoded with pq calibration %016x and no pq calibrations are kept here",
          cache.projection_version));
    }
    KVCOMP_ASSIGN_OR_RETURN(calibration,
                            pq_store->GetPq(projection_model, cache.projection_version));
  }
  // Without a caller's backend, one CPU backend with every hardware thread decodes one cache at a
  // time: the codecs split the
  // cache's rows over its threads, so a decoded get takes every core for a short time rather than
  // one core for long (the serve threads' decodes queue here).
  struct DecodePool {
    absl::Mutex mu;
    std::unique_ptr<Backend> backend ABSL_GUARDED_BY(mu);
  };
  static DecodePool* const pool = new DecodePool;
  if (backend != nullptr) {
    return DecodeToRawCodecs(*backend, cache, projection.get(), calibration.get());
  }
  absl::MutexLock lock(&pool->mu);
  if (pool->backend == nullptr) {
    KVCOMP_ASSIGN_OR_RETURN(pool->backend, MakeCpuBackend(CpuBackendOptions{0}));
  }
  return DecodeToRawCodecs(*pool->backend, cache, projection.get(), calibration.get());
}

}  // namespace codecs
}  // namespace kvcomp
