// The daemon's side of KVSplice and pq: the Calibrate control call over the stored caches. The
// projections themselves are kept by codecs::TieredProjectionStore
// (kvcomp/codecs/projection_store.h), which also decodes encoded caches for gets of the decoded
// representation.
#ifndef KVCOMP_SERVICE_SRC_KVSPLICE_GLUE_H_
#define KVCOMP_SERVICE_SRC_KVSPLICE_GLUE_H_

#include "absl/status/statusor.h"
#include "kvcomp/codecs/projection_store.h"
#include "kvcomp/storage/tiered_store.h"

namespace kvcomp {
namespace service {

struct CalibrationRequest;
struct CalibrationResult;

// Calibrates (tenant, model) from its stored caches whose values are raw (their kept values),
// stores the projection and returns what was made. FailedPrecondition without such caches.
absl::StatusOr<CalibrationResult> CalibrateFromStore(storage::TieredStore* store,
                                                     codecs::TieredProjectionStore* projections,
                                                     const CalibrationRequest& request);

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_KVSPLICE_GLUE_H_
