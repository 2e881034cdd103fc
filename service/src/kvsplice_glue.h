// The daemon's side of KVSplice: projections kept in the tiered store's calibration
// family, the Calibrate control call, and decoding encoded caches for gets of the decoded
// representation.
//
// Projections are per tenant and model (a tenant's data never shapes another tenant's basis): the
// store key's model_id is "<tenant>/<model>". The kernels' Projection covers every layer and kv
// head of a model, so it is stored whole under layer = a per-model sequence number (so the latest
// calibration is the highest), kv_head = 0. Thread-safe.
//
// Lifetime (docs/kvsplice.md, "Projection lifetime in kvcompd"): a version is deleted once it is
// not its tenant/model's latest, no open put holds it (AcquireLatest) and no stored cache names
// it. The store's reference count is per cache model id (without the tenant), so a version is
// kept while any tenant's cache of that model names it; versions are content fingerprints, so
// that only ever keeps a version longer, never deletes one a cache still names.
#ifndef KVCOMP_SERVICE_SRC_KVSPLICE_GLUE_H_
#define KVCOMP_SERVICE_SRC_KVSPLICE_GLUE_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/kernels/projection.h"
#include "kvcomp/storage/tiered_store.h"

namespace kvcomp {
namespace service {

struct CalibrationRequest;
struct CalibrationResult;

// The name projections of (tenant, model) are kept under, or InvalidArgument when too long.
absl::StatusOr<std::string> ProjectionModel(const std::string& tenant, const std::string& model);

class StoreProjections : public ProjectionStore {
 public:
  explicit StoreProjections(storage::TieredStore* store) : store_(store) {}
  absl::Status Put(const Projection& projection) override;
  absl::StatusOr<std::shared_ptr<const Projection>> Get(absl::string_view model_id,
                                                        uint64_t version) override;
  absl::StatusOr<uint64_t> Latest(absl::string_view model_id) override;
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

 private:
  void Release(const std::string& model, uint64_t version);

  storage::TieredStore* const store_;
  // Held across "latest and pin" (AcquireLatest) and "check and delete" (Collect), so a put
  // never pins a version Collect is deleting.
  absl::Mutex gc_mu_;
  absl::flat_hash_map<std::string, uint64_t> pins_ ABSL_GUARDED_BY(gc_mu_);  // CacheName -> n
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Projection>> cache_ ABSL_GUARDED_BY(mu_);
};

// Calibrates (tenant, model) from its stored caches whose values are raw (their kept values),
// stores the projection and returns what was made. FailedPrecondition without such caches.
absl::StatusOr<CalibrationResult> CalibrateFromStore(storage::TieredStore* store,
                                                     StoreProjections* projections,
                                                     const CalibrationRequest& request);

// `cache` with its kept keys and values decoded to the layout's dtype and raw codecs, the
// projection looked up under `projection_model` (ProjectionModel(tenant, model)); caches already
// raw come back unchanged. NotFound when the projection is missing.
absl::StatusOr<CompressedCache> DecodeToRaw(CompressedCache cache,
                                            const std::string& projection_model,
                                            StoreProjections* projections);

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_KVSPLICE_GLUE_H_
