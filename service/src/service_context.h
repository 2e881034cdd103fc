// ServiceContext: the daemon's parts that the control plane (handlers.h) and the data plane
// (data_plane.h) both use: credentials, store, policies, the cache service, metrics, the
// calibration hook, the GPU channels, and the daemon's state and running totals. The daemon
// fills it at start and owns everything it points to; neither plane owns any of it.
#ifndef KVCOMP_SERVICE_SRC_SERVICE_CONTEXT_H_
#define KVCOMP_SERVICE_SRC_SERVICE_CONTEXT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache_service.h"
#include "kvcomp/service/auth.h"
#include "kvcomp/service/metrics.h"
#include "kvcomp/service/options.h"
#include "kvcomp/service/policy_store.h"
#include "kvcomp/storage/tiered_store.h"

namespace kvcomp {
namespace service {

// A calibration request as the engine hook sees it (kvsplice_glue.h provides the implementation).
struct CalibrationRequest {
  std::string tenant;
  std::string model_id;
  std::string value_codec;
  uint32_t rank = 0;
  double error_budget = 0;
  uint64_t max_caches = 0;
  // value_codec "pq": the bits per element the keys' and values' bases are fitted at.
  uint32_t key_bits = 3;
  uint32_t value_bits = 2;
};
struct CalibrationResult {
  uint64_t projection_version = 0;  // value_codec "pq": the pq calibration's version
  uint32_t rank = 0;                 // the largest layer's
  std::vector<uint32_t> layer_ranks;  // per layer (all `rank` with a fixed rank)
  double achieved_error = 0;
  uint64_t caches_used = 0;
};
using CalibrateHook =
    std::function<absl::StatusOr<CalibrationResult>(const CalibrationRequest& request)>;

class GpuChannels;  // gpu_channel.h

// What both planes share. Pointers are owned by the daemon and outlive the handlers.
struct ServiceContext {
  Options options;
  TokenStore* tokens = nullptr;
  storage::TieredStore* store = nullptr;
  PolicyStore* policies = nullptr;
  CacheService* service = nullptr;
  Metrics* metrics = nullptr;
  CalibrateHook calibrate;
  GpuChannels* gpu = nullptr;  // the GPU channel (gpu_channel.h); null: none
  // Told of every control call's authentication, on the calling thread (the daemon binds the
  // call's connection to its tenant); a status other than OK is the call's answer. Unset: none.
  std::function<absl::Status(const absl::StatusOr<std::string>& tenant)> control_authenticated;
  absl::Time started = absl::Now();
  std::atomic<bool> ready{false};
  std::atomic<bool> draining{false};
  std::atomic<uint16_t> data_port{0};
  std::atomic<uint16_t> metrics_port{0};
  std::atomic<uint64_t> puts_total{0};
  std::atomic<uint64_t> gets_total{0};
  std::atomic<uint64_t> errors_total{0};
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_SERVICE_CONTEXT_H_
