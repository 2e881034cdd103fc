// kvcompd's Prometheus metrics (names in kvcomp/service/metric_names.h, meanings in
// docs/metrics.md) and the HTTP endpoint that serves them with the Kubernetes probes:
//   GET /metrics  Prometheus text format 0.0.4
//   GET /healthz  200 "ok" while the process serves requests (liveness)
//   GET /readyz   200 "ready" when it takes new work, else 503 with the reason (readiness)
//
// Thread-safe: every method of Metrics may be called from any thread.
#ifndef KVCOMP_SERVICE_METRICS_H_
#define KVCOMP_SERVICE_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace kvcomp {
namespace service {

enum class Op { kPut, kGet, kLookup, kDelete };
// kToDevice: a GPU engine's copies of a put's blocks into its device buffer, as they arrive
// (overlapped with kReceive). kDownload: a GPU engine's one copy of a compressed cache to host
// memory (not in kCompress). kEncode: the kept tokens to the stored format's bytes (key and
// value codecs, on the device on a GPU engine; not in kStore). kDecode: a get of the decoded
// representation of an encoded cache, its decode to raw codecs (on a GPU engine's device when
// the daemon has one; part of kServe).
enum class Stage { kReceive, kCompress, kStore, kServe, kDownload, kToDevice, kEncode, kDecode };
absl::string_view OpName(Op op);  // "put", "get", "lookup", "delete"
// "receive", "to_device", "compress", "download", "encode", "store", "serve", "decode"
absl::string_view StageName(Stage s);
// The {code} label of kvcomp_errors_total: "busy" for BusyError, else absl's code in snake
// case ("invalid_argument", "not_found", ...).
std::string ErrorCodeLabel(const absl::Status& status);

// Current values of one tier, for the tier gauges (counters are set from running totals).
struct TierSample {
  std::string tier;  // "device", "host", "rocksdb"
  uint64_t stored_bytes = 0;
  uint64_t capacity_bytes = 0;
  uint64_t entries = 0;
  uint64_t demotions_total = 0;
  uint64_t evictions_total = 0;
};

class Metrics {
 public:
  Metrics(const std::string& version, const std::string& backend);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  void AddReceivedBytes(uint64_t bytes);
  // A cache was stored: counters of original, stored and saved bytes, the ratio histogram.
  void AddStoredCache(uint64_t original_bytes, uint64_t stored_bytes);
  void AddServedBytes(uint64_t bytes);
  void ObserveOp(Op op, double seconds);
  void ObserveStage(Stage stage, double seconds);
  // A failed request. NotFound of a get or lookup is a miss (CountRead), not an error: it is
  // not counted here.
  void CountError(absl::string_view op, const absl::Status& status);
  // A read of caches: `op` "get", "lookup", "prefix_lookup" or "chunk_get"; `asked` keys of
  // which the leading `held` are held (1 and 0 or 1 for a get or lookup). Counts
  // kvcomp_cache_requests_total{result = hit, partial or miss} and, for prefix lookups and
  // chunk gets, kvcomp_prefix_keys_total. Nothing for asked == 0.
  void CountRead(absl::string_view op, absl::string_view tenant, absl::string_view model_id,
                 uint64_t asked, uint64_t held);
  // Raises kvcomp_errors_total{op, code} to `total` when it is lower (for running totals kept
  // elsewhere, e.g. the transport's own error counts; `code` as ErrorCodeLabel gives it).
  void AdvanceErrors(absl::string_view op, const std::string& code, uint64_t total);
  void CountAuthFailure(absl::string_view plane);  // "data" or "control"
  void SetAuthRequired(bool required);
  void CountAuthReloadFailure();
  void SetControlConnections(int64_t connections);
  // Raises kvcomp_control_connections_closed_total{reason} ("limit" or "idle") to `total`.
  void AdvanceControlConnectionsClosed(absl::string_view reason, uint64_t total);
  void AddGpuSeconds(double seconds);
  // Bytes copied host -> GPU and GPU -> host by the data path.
  void AddTransferBytes(uint64_t to_device, uint64_t to_host);
  void SetQueueDepth(int64_t depth);
  void SetPutsInProgress(int64_t puts);
  void SetReady(bool ready);
  void SetTier(const TierSample& sample);
  // The RocksDB tier's disk: kvcomp_store_read_only, kvcomp_disk_free_bytes and
  // kvcomp_disk_reserve_bytes.
  void SetDisk(bool read_only, uint64_t free_bytes, uint64_t reserve_bytes);
  // Raises kvcomp_store_quarantined_total, kvcomp_store_corruptions_total and
  // kvcomp_store_repairs_total to the store's running totals.
  void AdvanceStoreDamage(uint64_t quarantined, uint64_t corruptions, uint64_t repairs);
  // Totals over the caches stored now (gauges kvcomp_caches_stored,
  // kvcomp_resident_original_bytes, kvcomp_resident_saved_bytes).
  void SetStoredTotals(uint64_t caches, uint64_t original_bytes, uint64_t stored_bytes);
  // kvcomp_projections and kvcomp_projections_deleted_total.
  void SetProjections(uint64_t versions);
  // kvcomp_pq_calibrations.
  void SetPqCalibrations(uint64_t versions);
  void AddProjectionsDeleted(uint64_t versions);

  // Runs `hook` (if set) and serialises the registry in the text format.
  std::string Scrape();
  // Called at the start of every Scrape (e.g. to refresh tier gauges from the store).
  void SetScrapeHook(std::function<void()> hook);

  prometheus::Registry& registry();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The HTTP server of /metrics, /healthz and /readyz (civetweb).
class HttpEndpoint {
 public:
  struct Handlers {
    std::function<std::string()> metrics;  // body of /metrics
    std::function<bool()> live;
    // Readiness and, when not ready, why (for the 503 body).
    std::function<bool(std::string* reason)> ready;
  };
  // Listens on address:port (0 = ephemeral). Unavailable when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpEndpoint>> Start(const std::string& address,
                                                             uint16_t port, Handlers handlers);
  ~HttpEndpoint();
  uint16_t port() const { return port_; }

 private:
  HttpEndpoint() = default;
  struct Context;
  std::unique_ptr<Context> ctx_;
  uint16_t port_ = 0;
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_METRICS_H_
