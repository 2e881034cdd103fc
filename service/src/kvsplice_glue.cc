#include "kvsplice_glue.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "handlers.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/kvsplice.h"

namespace kvcomp {
namespace service {

absl::StatusOr<std::string> ProjectionModel(const std::string& tenant, const std::string& model) {
  std::string name = absl::StrCat(tenant, "/", model);
  if (name.size() > storage::ProjectionKey::kMaxModelBytes) {
    return absl::InvalidArgumentError(
        "tenant and model_id together are too long to name a projection (128 bytes)");
  }
  return name;
}

namespace {

std::string CacheName(absl::string_view model, uint64_t version) {
  return absl::StrCat(model, "#", version);
}

}  // namespace

absl::Status StoreProjections::Put(const Projection& projection) {
  if (projection.version == 0) return absl::InvalidArgumentError("projection is not sealed");
  KVCOMP_ASSIGN_OR_RETURN(auto keys, store_->ListProjections(projection.model_id));
  uint32_t seq = 0;
  for (const auto& k : keys) {
    if (k.model_id != projection.model_id) continue;
    if (k.version == projection.version) return absl::OkStatus();
    seq = std::max(seq, k.layer + 1);
  }
  storage::ProjectionKey key{projection.model_id, seq, 0, projection.version};
  KVCOMP_RETURN_IF_ERROR(store_->PutProjection(key, projection.Serialize()));
  absl::MutexLock lock(&mu_);
  cache_[CacheName(projection.model_id, projection.version)] =
      std::make_shared<const Projection>(projection);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Projection>> StoreProjections::Get(absl::string_view model_id,
                                                                        uint64_t version) {
  {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(CacheName(model_id, version));
    if (it != cache_.end()) return it->second;
  }
  KVCOMP_ASSIGN_OR_RETURN(auto keys, store_->ListProjections(model_id));
  for (const auto& k : keys) {
    if (k.model_id != model_id || k.version != version) continue;
    KVCOMP_ASSIGN_OR_RETURN(std::string bytes, store_->GetProjection(k));
    KVCOMP_ASSIGN_OR_RETURN(Projection p, Projection::Parse(bytes));
    auto shared = std::make_shared<const Projection>(std::move(p));
    absl::MutexLock lock(&mu_);
    cache_[CacheName(model_id, version)] = shared;
    return shared;
  }
  return MissingProjectionError(model_id, version);
}

absl::StatusOr<uint64_t> StoreProjections::Latest(absl::string_view model_id) {
  KVCOMP_ASSIGN_OR_RETURN(auto keys, store_->ListProjections(model_id));
  const storage::ProjectionKey* best = nullptr;
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

absl::Status StoreProjections::Delete(absl::string_view model_id, uint64_t version) {
  KVCOMP_ASSIGN_OR_RETURN(auto keys, store_->ListProjections(model_id));
  for (const auto& k : keys) {
    if (k.model_id == model_id && k.version == version) {
      KVCOMP_RETURN_IF_ERROR(store_->DeleteProjection(k));
      absl::MutexLock lock(&mu_);
      cache_.erase(CacheName(model_id, version));
      return absl::OkStatus();
    }
  }
  return MissingProjectionError(model_id, version);
}

absl::StatusOr<std::shared_ptr<const Projection>> StoreProjections::AcquireLatest(
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

void StoreProjections::Release(const std::string& model, uint64_t version) {
  absl::MutexLock gc(&gc_mu_);
  auto it = pins_.find(CacheName(model, version));
  if (it != pins_.end() && --it->second == 0) pins_.erase(it);
}

absl::StatusOr<uint64_t> StoreProjections::Collect(absl::string_view model) {
  absl::MutexLock gc(&gc_mu_);
  auto keys = store_->ListProjections(model);
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
    // Caches name their projection under their own model id, without the tenant.
    const size_t slash = k.model_id.find('/');
    if (slash == std::string::npos) continue;  // not a name of ours: leave it
    const absl::string_view cache_model = absl::string_view(k.model_id).substr(slash + 1);
    if (store_->ProjectionReferences(cache_model, k.version) > 0) continue;
    absl::Status s = store_->DeleteProjection(k);
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

absl::StatusOr<uint64_t> StoreProjections::Count() {
  auto keys = store_->ListProjections("");
  if (absl::IsFailedPrecondition(keys.status())) return 0;
  KVCOMP_RETURN_IF_ERROR(keys.status());
  return keys->size();
}

absl::StatusOr<CalibrationResult> CalibrateFromStore(storage::TieredStore* store,
                                                     StoreProjections* projections,
                                                     const CalibrationRequest& request) {
  KVCOMP_ASSIGN_OR_RETURN(std::string pmodel, ProjectionModel(request.tenant, request.model_id));
  KVCOMP_ASSIGN_OR_RETURN(ValueCodec codec, ParseValueCodec(request.value_codec));
  if (codec == ValueCodec::kRaw) {
    return absl::InvalidArgumentError("calibration needs an orthogonal value codec");
  }
  KVCOMP_ASSIGN_OR_RETURN(auto listed, store->List(request.tenant));
  KVCOMP_ASSIGN_OR_RETURN(auto backend, MakeCpuBackend());
  std::unique_ptr<Calibrator> calibrator;
  KvLayout layout;
  uint64_t used = 0;
  const uint64_t max_caches = request.max_caches == 0 ? 64 : request.max_caches;
  for (const auto& entry : listed) {
    if (used >= max_caches) break;
    if (entry.key.model_id != request.model_id) continue;
    auto got = store->Get(entry.key);
    if (!got.ok()) continue;
    auto cache = format::ParseCache(got->payload.view());
    if (!cache.ok() || cache->value_codec != ValueCodec::kRaw) continue;
    if (calibrator == nullptr) {
      layout = cache->layout;
      CalibrationOptions co;
      co.model_id = pmodel;
      co.num_layers = layout.num_layers;
      co.num_kv_heads = layout.num_kv_heads;
      co.head_dim = layout.head_dim;
      KVCOMP_ASSIGN_OR_RETURN(Calibrator c, Calibrator::Create(co, backend.get()));
      calibrator = std::make_unique<Calibrator>(std::move(c));
    } else if (cache->layout != layout) {
      continue;  // another shape under the same model id
    }
    // Heads of a layer may keep different counts (AdaKV): use the smallest, densely copied.
    const auto offsets = cache->TokenOffsets();
    const uint64_t row = cache->ValueTokenBytes();
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
      uint64_t n = UINT64_MAX;
      for (uint32_t h = 0; h < layout.num_kv_heads; ++h) {
        n = std::min<uint64_t>(n, cache->kept[cache->head_index(l, h)]);
      }
      if (n == 0) continue;
      std::vector<uint8_t> dense(layout.num_kv_heads * n * row);
      for (uint32_t h = 0; h < layout.num_kv_heads; ++h) {
        std::memcpy(dense.data() + h * n * row,
                    cache->values.data() + offsets[cache->head_index(l, h)] * row, n * row);
      }
      HeadsView v =
          HeadsView::Dense(dense.data(), layout.dtype, layout.num_kv_heads, n, layout.head_dim);
      KVCOMP_RETURN_IF_ERROR(calibrator->AddLayer(l, v));
    }
    ++used;
  }
  if (calibrator == nullptr) {
    return absl::FailedPreconditionError(
        "no stored caches of this model with raw values to calibrate on");
  }
  CalibrationResult result;
  result.caches_used = used;
  Projection projection;
  if (request.rank > 0) {
    KVCOMP_ASSIGN_OR_RETURN(projection, calibrator->Finish(request.rank));
    result.rank = request.rank;
    result.layer_ranks.assign(projection.num_layers, request.rank);
  } else {
    TuneOptions to;
    to.codec = codec;
    to.budget = request.error_budget > 0 ? request.error_budget : 0.05;
    KVCOMP_ASSIGN_OR_RETURN(TuneResult tuned, AutoTune(*calibrator, to));
    projection = std::move(tuned.projection);
    result.rank = tuned.max_rank;
    result.layer_ranks = tuned.rank;
    for (double e : tuned.error) result.achieved_error = std::max(result.achieved_error, e);
  }
  KVCOMP_RETURN_IF_ERROR(projections->Put(projection));
  result.projection_version = projection.version;
  return result;
}

absl::StatusOr<CompressedCache> DecodeToRaw(CompressedCache cache,
                                            const std::string& projection_model,
                                            StoreProjections* projections) {
  if (cache.key_codec == KeyCodec::kRaw && cache.value_codec == ValueCodec::kRaw) return cache;
  std::shared_ptr<const Projection> projection;
  if (cache.value_codec != ValueCodec::kRaw) {
    KVCOMP_ASSIGN_OR_RETURN(projection,
                            projections->Get(projection_model, cache.projection_version));
  }
  // One CPU backend with every hardware thread decodes one cache at a time: the codecs split the
  // cache's rows over its threads, so a decoded get takes every core for a short time rather
  // than one core for long (the serve threads' decodes queue here).
  struct DecodePool {
    absl::Mutex mu;
    std::unique_ptr<Backend> backend ABSL_GUARDED_BY(mu);
  };
  static DecodePool* const pool = new DecodePool;
  DecodedKept d;
  {
    absl::MutexLock lock(&pool->mu);
    if (pool->backend == nullptr) {
      KVCOMP_ASSIGN_OR_RETURN(pool->backend, MakeCpuBackend(CpuBackendOptions{0}));
    }
    KVCOMP_ASSIGN_OR_RETURN(
        d, DecodeKept(*pool->backend, cache, projection.get(), cache.layout.dtype));
  }
  CompressedCache raw = cache;
  raw.key_codec = KeyCodec::kRaw;
  raw.value_codec = ValueCodec::kRaw;
  raw.rank = 0;
  raw.layer_rank.clear();
  raw.raw_value_rows.clear();
  raw.raw_values.clear();
  raw.projection_version = 0;
  raw.value_gamma = false;
  raw.key_scales.clear();
  raw.value_scales.clear();
  raw.positions = std::move(d.positions);
  raw.keys = std::move(d.keys);
  raw.values = std::move(d.values);
  KVCOMP_RETURN_IF_ERROR(raw.Validate());
  return raw;
}

}  // namespace service
}  // namespace kvcomp
