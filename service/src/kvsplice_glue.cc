#include "kvsplice_glue.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/kvsplice.h"
#include "service_context.h"

namespace kvcomp {
namespace service {

absl::StatusOr<CalibrationResult> CalibrateFromStore(storage::TieredStore* store,
                                                     codecs::TieredProjectionStore* projections,
                                                     const CalibrationRequest& request) {
  KVCOMP_ASSIGN_OR_RETURN(std::string pmodel,
                          codecs::ProjectionModel(request.tenant, request.model_id));
  KVCOMP_ASSIGN_OR_RETURN(ValueCodec codec, ParseValueCodec(request.value_codec));
  if (!IsProjectionCodec(codec)) {
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

}  // namespace service
}  // namespace kvcomp
