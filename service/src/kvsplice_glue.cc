#include "kvsplice_glue.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvcomp/codecs/pq.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/kvsplice.h"
#include "service_context.h"

namespace kvcomp {
namespace service {

namespace {

// Rows per (layer, kv head) a pq calibration fits on at most (the first stored caches' kept
// tokens, in list order).
constexpr uint64_t kPqCalibrationRows = 4096;

// The pq calibration of (tenant, model): both bases fitted on the kept keys and values of its
// stored caches whose keys and values are raw, `request.key_bits` / `value_bits` per element.
absl::StatusOr<CalibrationResult> CalibratePqFromStore(storage::TieredStore* store,
                                                       codecs::TieredProjectionStore* projections,
                                                       const CalibrationRequest& request,
                                                       const std::string& pmodel) {
  for (uint32_t bits : {request.key_bits, request.value_bits}) {
    if (bits < 1 || bits > pq::kMaxWidth) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pq calibration: key_bits and value_bits must be in 1..", pq::kMaxWidth, ", got ",
          request.key_bits, " and ", request.value_bits));
    }
  }
  KVCOMP_ASSIGN_OR_RETURN(auto listed, store->List(request.tenant));
  std::optional<KvLayout> layout;
  std::vector<std::vector<float>> keys, values;  // per head, rows x d
  uint64_t rows = 0, used = 0;
  const uint64_t max_caches = request.max_caches == 0 ? 64 : request.max_caches;
  for (const auto& entry : listed) {
    if (used >= max_caches || rows >= kPqCalibrationRows) break;
    if (entry.key.model_id != request.model_id) continue;
    auto got = store->Get(entry.key);
    if (!got.ok()) continue;
    auto cache = format::ParseCache(got->payload.view());
    if (!cache.ok() || cache->key_codec != KeyCodec::kRaw ||
        cache->value_codec != ValueCodec::kRaw) {
      continue;
    }
    if (!layout.has_value()) {
      layout = cache->layout;
      keys.resize(layout->num_heads_total());
      values.resize(layout->num_heads_total());
    } else if (cache->layout.num_layers != layout->num_layers ||
               cache->layout.num_kv_heads != layout->num_kv_heads ||
               cache->layout.head_dim != layout->head_dim) {
      continue;  // another shape under the same model id
    }
    // As many rows from every head (the fit takes n rows per head): n the fewest any head kept
    // (AdaKV), within the row cap, spread evenly over each head's kept tokens (row
    // floor(j x kept / n) for j < n), so a long cache under the cap gives its whole length,
    // not its first tokens only.
    uint64_t n = kPqCalibrationRows - rows;
    for (uint32_t k : cache->kept) n = std::min<uint64_t>(n, k);
    if (n == 0) continue;
    const auto offsets = cache->TokenOffsets();
    const uint64_t d = cache->layout.head_dim;
    const DType dt = cache->layout.dtype;
    for (uint64_t h = 0; h < cache->num_heads(); ++h) {
      const uint64_t kept = cache->kept[h];
      for (uint64_t j = 0; j < n; ++j) {
        const uint64_t row = offsets[h] + j * kept / n;
        for (uint64_t i = 0; i < d; ++i) {
          keys[h].push_back(LoadAsFloat(cache->keys.data(), dt, row * d + i));
          values[h].push_back(LoadAsFloat(cache->values.data(), dt, row * d + i));
        }
      }
    }
    rows += n;
    ++used;
  }
  if (!layout.has_value() || rows < 2) {
    return absl::FailedPreconditionError(
        "no stored caches of this model with raw keys and values to calibrate pq on (at least "
        "2 kept tokens in every head)");
  }
  std::vector<float> k_all, v_all;
  for (uint64_t h = 0; h < keys.size(); ++h) {
    k_all.insert(k_all.end(), keys[h].begin(), keys[h].end());
    v_all.insert(v_all.end(), values[h].begin(), values[h].end());
  }
  KVCOMP_ASSIGN_OR_RETURN(
      pq::Calibration calibration,
      pq::FitCalibration(k_all, v_all, rows, layout->num_layers, layout->num_kv_heads,
                         layout->head_dim, request.key_bits, request.value_bits));
  calibration.model_id = request.model_id;
  KVCOMP_RETURN_IF_ERROR(projections->PutPq(pmodel, calibration));
  CalibrationResult result;
  result.projection_version = calibration.version;
  result.caches_used = used;
  return result;
}

}  // namespace

absl::StatusOr<CalibrationResult> CalibrateFromStore(storage::TieredStore* store,
                                                     codecs::TieredProjectionStore* projections,
                                                     const CalibrationRequest& request) {
  KVCOMP_ASSIGN_OR_RETURN(std::string pmodel,
                          codecs::ProjectionModel(request.tenant, request.model_id));
  KVCOMP_ASSIGN_OR_RETURN(ValueCodec codec, ParseValueCodec(request.value_codec));
  if (IsPq(codec)) return CalibratePqFromStore(store, projections, request, pmodel);
  if (!IsProjectionCodec(codec)) {
    return absl::InvalidArgumentError(
        "calibration needs an orthogonal value codec (a KVSplice projection) or pq (the "
        "calibrated basis codec's keys' and values' bases)");
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
