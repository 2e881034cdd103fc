// KVSplice's projections (calibration data) kept durably in the tiered store, and the decode of
// encoded caches to their raw form. The store sees only keys and bytes (TieredStore's
// calibration family); the names, their encoding and the rules of a projection's lifetime live
// here, beside the engine that encodes and decodes with them.
//
// Projections are per tenant and model (a tenant's data never shapes another tenant's basis): the
// key's model_id is "<tenant>/<model>" (ProjectionModel). The engine's Projection covers every
// layer and kv head of a model, so it is stored whole under layer = a per-model sequence number
// (so the latest calibration is the highest), kv_head = 0.
//
// The same store keeps each tenant/model's pq calibrations (kvcomp/codecs/pq.h: the keys' and
// values' bases of the calibrated basis codec) under keys of their own (a leading 0x01 byte,
// then the model, a per-model sequence number, the bits per element and the version), with the
// same lifetime rules; a cache names its pq calibration's version where a KVSplice cache names
// its projection's (the header's calibration version, CacheMeta::projection_version), so the
// store's reference counts cover both (both versions are content fingerprints).
//
// Lifetime (docs/kvsplice.md, "Projection lifetime in kvcompd"): a version is deleted once it is
// not its tenant/model's latest, no open put holds it (AcquireLatest) and no stored cache names
// it. The store's reference count is per cache model id (without the tenant), so a version is
// kept while any tenant's cache of that model names it; versions are content fingerprints, so
// that only ever keeps a version longer, never deletes one a cache still names.
#ifndef KVCOMP_CODECS_PROJECTION_STORE_H_
#define KVCOMP_CODECS_PROJECTION_STORE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kvcomp/codecs/pq.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/projection.h"
#include "kvcomp/storage/tiered_store.h"

namespace kvcomp {
namespace codecs {

// The name of one stored projection: per (model, layer, kv_head), versioned.
struct ProjectionKey {
  static constexpr size_t kMaxModelBytes = CacheKey::kMaxModelBytes;
  std::string model_id;
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  uint64_t version = 0;  // >= 1; caches record it as CacheMeta::projection_version

  friend bool operator==(const ProjectionKey& a, const ProjectionKey& b) {
    return a.model_id == b.model_id && a.layer == b.layer && a.kv_head == b.kv_head &&
           a.version == b.version;
  }
};

// InvalidArgument for an empty or too long model id or version 0.
absl::Status ValidateProjectionKey(const ProjectionKey& key);
// The order-preserving calibration key of a projection: model (u16 BE length + bytes), layer,
// kv_head (u32 BE) and version (u64 BE). The byte order of keys is (model, layer, kv_head,
// version) order.
std::string EncodeProjectionKey(const ProjectionKey& key);
// DataLoss for bytes that are no projection key.
absl::StatusOr<ProjectionKey> DecodeProjectionKey(absl::string_view bytes);
// The calibration-key prefix of every projection of `model_id` (empty: of every model).
std::string ProjectionKeyPrefix(absl::string_view model_id);

// The name projections of (tenant, model) are kept under, or InvalidArgument when too long.
absl::StatusOr<std::string> ProjectionModel(const std::string& tenant, const std::string& model);

// The engine's ProjectionStore over a TieredStore's calibration family. Thread-safe.
class TieredProjectionStore : public ProjectionStore {
 public:
  explicit TieredProjectionStore(storage::TieredStore* store) : store_(store) {}
  absl::Status Put(const Projection& projection) override;
  absl::StatusOr<std::shared_ptr<const Projection>> Get(absl::string_view model_id,
                                                        uint64_t version) override;
  absl::StatusOr<uint64_t> Latest(absl::string_view model_id) override;
  // FailedPrecondition while a stored cache names the version (ProjectionReferences).
  absl::Status Delete(absl::string_view model_id, uint64_t version) override;

  // The latest projection of `model` (a ProjectionModel name) for a put that encodes with it:
  // the version is not collected while the returned pointer (or a copy) lives. FailedPrecondition
  // before any calibration of the model.
  absl::StatusOr<std::shared_ptr<const Projection>> AcquireLatest(absl::string_view model);
  // Deletes every version of `model` (of every model when empty) that is not the model's latest,
  // not held by AcquireLatest and named by no stored cache. Returns how many were deleted.
  absl::StatusOr<uint64_t> Collect(absl::string_view model = "");
  // Projection versions stored now (all tenants and models).
  absl::StatusOr<uint64_t> Count();

  // --- pq calibrations, per tenant/model (a ProjectionModel name) ---
  // Stores a sealed calibration as `model`'s latest at its bits per element (InvalidArgument
  // when not sealed; storing the same version again keeps it where it is).
  absl::Status PutPq(absl::string_view model, const pq::Calibration& calibration);
  // NotFound naming the model and version when absent.
  absl::StatusOr<std::shared_ptr<const pq::Calibration>> GetPq(absl::string_view model,
                                                               uint64_t version);
  // The latest calibration of `model` fitted at key_bits / value_bits per element, pinned as
  // AcquireLatest pins a projection. FailedPrecondition naming the calibration call when there
  // is none (or none at those bits).
  absl::StatusOr<std::shared_ptr<const pq::Calibration>> AcquireLatestPq(absl::string_view model,
                                                                         uint32_t key_bits,
                                                                         uint32_t value_bits);
  // pq calibration versions stored now (all tenants and models).
  absl::StatusOr<uint64_t> CountPq();

 private:
  struct PqKey {
    std::string model;
    uint32_t sequence = 0;
    uint32_t key_bits = 0, value_bits = 0;
    uint64_t version = 0;
  };
  absl::StatusOr<std::vector<PqKey>> ListPq(absl::string_view model);
  absl::StatusOr<uint64_t> CollectPq(absl::string_view model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(gc_mu_);

  absl::StatusOr<std::vector<ProjectionKey>> List(absl::string_view model_id);
  void Release(const std::string& model, uint64_t version);

  storage::TieredStore* const store_;
  // Held across "latest and pin" (AcquireLatest) and "check and delete" (Collect, Delete), so a
  // put never pins a version that is being deleted.
  absl::Mutex gc_mu_;
  absl::flat_hash_map<std::string, uint64_t> pins_ ABSL_GUARDED_BY(gc_mu_);  // CacheName -> n
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Projection>> cache_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<const pq::Calibration>> pq_cache_
      ABSL_GUARDED_BY(mu_);
};

// `cache` with its kept keys and values decoded to the layout's dtype and raw codecs, the
// projection looked up under `projection_model` (ProjectionModel(tenant, model)); caches already
// raw come back unchanged. NotFound when the projection is missing. The codecs run on `backend`
// when given (a caller's own, e.g. a GPU engine worker's CUDA backend: the cache's host arrays
// are staged to the device and the decoded ones copied back), else on one shared CPU backend
// with every hardware thread, one cache at a time.
// A cache of the pq codecs takes its calibration from `pq_store` (the same model name; NotFound
// when missing, or when no store is given) and decodes on `backend` like the other codecs (the
// CUDA twin on a GPU engine's backend: the same rows bit for bit).
absl::StatusOr<CompressedCache> DecodeToRaw(CompressedCache cache,
                                            const std::string& projection_model,
                                            ProjectionStore* projections,
                                            Backend* backend = nullptr,
                                            TieredProjectionStore* pq_store = nullptr);

}  // namespace codecs
}  // namespace kvcomp

#endif  // KVCOMP_CODECS_PROJECTION_STORE_H_
