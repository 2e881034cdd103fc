#include "kvcomp/codecs/projection_store.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
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
  KVCOMP_ASSIGN_OR_RETURN(std::vector<std::string> raw,
                          store_->ListCalibration(ProjectionKeyPrefix(model_id)));
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
  auto keys = List(model);
  if (absl::IsFailedPrecondition(keys.status())) return 0;  // no RocksDB tier: none stored
  KVCOMP_RETURN_IF_ERROR(keys.status());
  // The latest (highest sequence number) of each tenant/model.
  absl::flat_hash_map<std::string, uint32_t> latest;
  for (const auto& k : *keys) {
    auto [it, inserted] = latest.emplace(k.model_id, k.layer);
    if (!inserted) it->second = std::max(it->second, k.layer);
  }
  uint64_t deleted = 0;
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
  auto keys = store_->ListCalibration(ProjectionKeyPrefix(""));
  if (absl::IsFailedPrecondition(keys.status())) return 0;
  KVCOMP_RETURN_IF_ERROR(keys.status());
  return keys->size();
}

absl::StatusOr<CompressedCache> DecodeToRaw(CompressedCache cache,
                                            const std::string& projection_model,
                                            ProjectionStore* projections, Backend* backend) {
  if (cache.key_codec == KeyCodec::kRaw && cache.value_codec == ValueCodec::kRaw) return cache;
  std::shared_ptr<const Projection> projection;
  if (IsProjectionCodec(cache.value_codec)) {
    KVCOMP_ASSIGN_OR_RETURN(projection,
                            projections->Get(projection_model, cache.projection_version));
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
  if (backend != nullptr) return DecodeToRawCodecs(*backend, cache, projection.get());
  absl::MutexLock lock(&pool->mu);
  if (pool->backend == nullptr) {
    KVCOMP_ASSIGN_OR_RETURN(pool->backend, MakeCpuBackend(CpuBackendOptions{0}));
  }
  return DecodeToRawCodecs(*pool->backend, cache, projection.get());
}

}  // namespace codecs
}  // namespace kvcomp
