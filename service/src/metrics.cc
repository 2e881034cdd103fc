#include "kvcomp/service/metrics.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <map>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvcomp/core/status.h"
#include "kvcomp/service/metric_names.h"

namespace kvcomp {
namespace service {
namespace mn = metric_names;

absl::string_view OpName(Op op) {
  switch (op) {
    case Op::kPut:
      return "put";
    case Op::kGet:
      return "get";
    case Op::kLookup:
      return "lookup";
    case Op::kDelete:
      return "delete";
  }
  return "unknown";
}

absl::string_view StageName(Stage s) {
  switch (s) {
    case Stage::kReceive:
      return "receive";
    case Stage::kCompress:
      return "compress";
    case Stage::kStore:
      return "store";
    case Stage::kServe:
      return "serve";
    case Stage::kDownload:
      return "download";
    case Stage::kToDevice:
      return "to_device";
    case Stage::kEncode:
      return "encode";
    case Stage::kDecode:
      return "decode";
  }
  return "unknown";
}

std::string ErrorCodeLabel(const absl::Status& status) {
  if (IsBusy(status)) return "busy";
  return absl::AsciiStrToLower(absl::StatusCodeToString(status.code()));
}

namespace {

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
}

}  // namespace

struct Metrics::Impl {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  prometheus::Counter* received;
  prometheus::Counter* original_total;
  prometheus::Counter* stored_total;
  prometheus::Counter* saved_total;
  prometheus::Counter* served_total;
  prometheus::Gauge* saved;
  prometheus::Gauge* original;
  prometheus::Gauge* caches;
  prometheus::Histogram* ratio;
  prometheus::Family<prometheus::Histogram>* op_family;
  prometheus::Family<prometheus::Histogram>* stage_family;
  std::map<Op, prometheus::Histogram*> ops;
  std::map<Stage, prometheus::Histogram*> stages;
  prometheus::Gauge* queue_depth;
  prometheus::Gauge* puts_in_progress;
  prometheus::Family<prometheus::Counter>* errors;
  prometheus::Family<prometheus::Counter>* reads = nullptr;
  prometheus::Family<prometheus::Counter>* prefix_keys = nullptr;
  // Bounded label values: the first values seen keep their own, later ones read "other".
  absl::Mutex labels_mu;
  absl::flat_hash_set<std::string> tenants ABSL_GUARDED_BY(labels_mu);
  absl::flat_hash_set<std::string> model_classes ABSL_GUARDED_BY(labels_mu);
  std::string Bounded(absl::flat_hash_set<std::string>& seen, absl::string_view value,
                      size_t cap) ABSL_EXCLUSIVE_LOCKS_REQUIRED(labels_mu) {
    std::string v(value.empty() ? absl::string_view("default") : value);
    if (seen.contains(v)) return v;
    if (seen.size() >= cap) return "other";
    seen.insert(v);
    return v;
  }
  prometheus::Family<prometheus::Counter>* auth_failures;
  prometheus::Gauge* auth_required = nullptr;
  prometheus::Counter* auth_reload_failures = nullptr;
  prometheus::Gauge* control_connections = nullptr;
  prometheus::Family<prometheus::Counter>* control_closed = nullptr;
  prometheus::Counter* gpu_seconds;
  prometheus::Counter* h2d_bytes;
  prometheus::Counter* d2h_bytes;
  prometheus::Gauge* projections;
  prometheus::Gauge* pq_calibrations;
  prometheus::Counter* projections_deleted;
  prometheus::Gauge* ready;
  prometheus::Family<prometheus::Gauge>* tier_stored;
  prometheus::Family<prometheus::Gauge>* tier_capacity;
  prometheus::Family<prometheus::Gauge>* tier_entries;
  prometheus::Family<prometheus::Counter>* tier_demotions;
  prometheus::Family<prometheus::Counter>* tier_evictions;
  prometheus::Gauge* store_read_only;
  prometheus::Gauge* disk_free;
  prometheus::Gauge* disk_reserve;
  prometheus::Counter* store_quarantined = nullptr;
  prometheus::Counter* store_corruptions = nullptr;
  prometheus::Counter* store_repairs = nullptr;

  absl::Mutex mu;
  std::function<void()> scrape_hook ABSL_GUARDED_BY(mu);
  absl::Mutex scrape_mu;  // one scrape at a time (the hook sets counters from deltas)
};

Metrics::Metrics(const std::string& version, const std::string& backend)
    : impl_(std::make_unique<Impl>()) {
  auto& r = *impl_->registry;
  auto counter = [&r](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(r).Add({});
  };
  auto gauge = [&r](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(r).Add({});
  };
  Impl& m = *impl_;
  m.received = counter(mn::kReceivedBytesTotal, "Block payload bytes received (K and V).");
  m.original_total =
      counter(mn::kOriginalBytesTotal, "Uncompressed bytes (K and V) of every cache stored.");
  m.stored_total = counter(mn::kStoredBytesTotal, "Compressed bytes written to the store.");
  m.saved_total =
      counter(mn::kSavedBytesTotal, "Original minus stored bytes of every cache stored.");
  m.served_total = counter(mn::kServedBytesTotal, "Cache bytes sent to clients by gets.");
  m.saved =
      gauge(mn::kResidentSavedBytes, "Original minus stored bytes of the caches stored now.");
  m.original = gauge(mn::kResidentOriginalBytes, "Uncompressed bytes of the caches stored now.");
  m.reads = &prometheus::BuildCounter()
                 .Name(mn::kCacheRequestsTotal)
                 .Help("Reads of caches by operation and outcome (hit, partial, miss).")
                 .Register(r);
  m.prefix_keys = &prometheus::BuildCounter()
                       .Name(mn::kPrefixKeysTotal)
                       .Help("Keys of prefix lookups and chunk gets, held or missing.")
                       .Register(r);
  m.caches = gauge(mn::kCachesStored, "Caches stored now.");
  m.ratio = &prometheus::BuildHistogram()
                 .Name(mn::kCompressionRatio)
                 .Help("Original over stored bytes of each cache stored.")
                 .Register(r)
                 .Add({}, prometheus::Histogram::BucketBoundaries{1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6,
                                                                  8, 10, 12, 16, 24, 32});
  m.op_family = &prometheus::BuildHistogram()
                     .Name(mn::kOperationDurationSeconds)
                     .Help("Duration of a data-plane request in the daemon, by operation.")
                     .Register(r);
  for (Op op : {Op::kPut, Op::kGet, Op::kLookup, Op::kDelete}) {
    m.ops[op] = &m.op_family->Add({{mn::kLabelOp, std::string(OpName(op))}}, LatencyBuckets());
  }
  m.stage_family = &prometheus::BuildHistogram()
                        .Name(mn::kStageDurationSeconds)
                        .Help("Duration of one pipeline stage of one cache.")
                        .Register(r);
  for (Stage s : {Stage::kReceive, Stage::kToDevice, Stage::kCompress, Stage::kDownload,
                  Stage::kEncode, Stage::kStore, Stage::kServe, Stage::kDecode}) {
    m.stages[s] =
        &m.stage_family->Add({{mn::kLabelStage, std::string(StageName(s))}}, LatencyBuckets());
  }
  m.queue_depth = gauge(mn::kQueueDepth, "Committed puts waiting for or in compression.");
  m.puts_in_progress = gauge(mn::kPutsInProgress, "Puts receiving blocks.");
  m.errors = &prometheus::BuildCounter()
                  .Name(mn::kErrorsTotal)
                  .Help("Failed requests by operation and status code.")
                  .Register(r);
  m.auth_failures = &prometheus::BuildCounter()
                         .Name(mn::kAuthFailuresTotal)
                         .Help("Requests refused for missing or wrong credentials, by plane.")
                         .Register(r);
  m.auth_failures->Add({{mn::kLabelPlane, "data"}});
  m.auth_failures->Add({{mn::kLabelPlane, "control"}});
  m.auth_required = gauge(mn::kAuthRequired, "1 when every request needs a tenant's token.");
  m.auth_reload_failures = counter(mn::kAuthReloadFailuresTotal,
                                   "Token reloads refused; the previous tokens stayed in force.");
  m.control_connections = gauge(mn::kControlConnections, "Open Thrift control connections.");
  m.control_closed = &prometheus::BuildCounter()
                          .Name(mn::kControlConnectionsClosedTotal)
                          .Help("Control connections closed by the daemon, by reason.")
                          .Register(r);
  m.control_closed->Add({{mn::kLabelReason, "limit"}});
  m.control_closed->Add({{mn::kLabelReason, "idle"}});
  m.control_closed->Add({{mn::kLabelReason, "malformed"}});
  m.control_closed->Add({{mn::kLabelReason, "unauthenticated"}});
  m.gpu_seconds = counter(mn::kGpuSecondsTotal, "Seconds of GPU work (compression, decoding).");
  m.h2d_bytes = counter(mn::kH2dBytesTotal, "Bytes the data path copied from host memory to the GPU.");
  m.d2h_bytes = counter(mn::kD2hBytesTotal, "Bytes the data path copied from the GPU to host memory.");
  m.ready = gauge(mn::kReady, "1 when the daemon takes new work, else 0.");
  m.projections = gauge(mn::kProjections, "KVSplice projection versions stored.");
  m.pq_calibrations = gauge(mn::kPqCalibrations, "pq calibrations (basis codec bases) stored.");
  m.projections_deleted =
      counter(mn::kProjectionsDeletedTotal,
              "Projection versions deleted: no stored cache named them and a newer one existed.");
  auto tier_gauge = [&r](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(r);
  };
  auto tier_counter = [&r](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(r);
  };
  m.tier_stored = tier_gauge(mn::kTierStoredBytes, "Stored bytes held by each tier.");
  m.tier_capacity = tier_gauge(mn::kTierCapacityBytes, "Configured capacity of each tier.");
  m.tier_entries = tier_gauge(mn::kTierEntries, "Caches held by each tier.");
  m.tier_demotions =
      tier_counter(mn::kTierDemotionsTotal, "Caches moved from each tier to a slower one.");
  m.store_read_only = gauge(mn::kStoreReadOnly,
                            "1 while the RocksDB tier is read-only for a full disk, else 0.");
  m.disk_free = gauge(mn::kDiskFreeBytes, "Free bytes of the RocksDB tier's filesystem.");
  m.disk_reserve = gauge(mn::kDiskReserveBytes,
                         "Free bytes a put must leave on the RocksDB tier's filesystem.");
  m.tier_evictions =
      tier_counter(mn::kTierEvictionsTotal, "Caches dropped for lack of room in each tier.");
  m.store_quarantined = counter(
      mn::kStoreQuarantinedTotal,
      "Caches found damaged (checksum failed or unreadable) and quarantined, never served.");
  m.store_corruptions = counter(
      mn::kStoreCorruptionsTotal,
      "RocksDB compactions that met damaged data (each starts a repair pass, writes go on), "
      "damaged stretches of the write-ahead log skipped at open, damaged table files taken out "
      "at open, and a MANIFEST that ended in part of a record at open.");
  m.store_repairs = counter(mn::kStoreRepairsTotal,
                            "Repair passes run after damaged data was met (every payload read).");
  prometheus::BuildGauge()
      .Name(mn::kBuildInfo)
      .Help("Always 1; labels say the version and the compression backend.")
      .Register(r)
      .Add({{mn::kLabelVersion, version}, {mn::kLabelBackend, backend}})
      .Set(1);
}

Metrics::~Metrics() = default;

prometheus::Registry& Metrics::registry() { return *impl_->registry; }

void Metrics::AddReceivedBytes(uint64_t bytes) { impl_->received->Increment(bytes); }

void Metrics::AddStoredCache(uint64_t original_bytes, uint64_t stored_bytes) {
  impl_->original_total->Increment(original_bytes);
  impl_->stored_total->Increment(stored_bytes);
  if (original_bytes > stored_bytes) {
    impl_->saved_total->Increment(original_bytes - stored_bytes);
  }
  if (stored_bytes > 0) {
    impl_->ratio->Observe(static_cast<double>(original_bytes) / stored_bytes);
  }
}

void Metrics::AddServedBytes(uint64_t bytes) { impl_->served_total->Increment(bytes); }
void Metrics::ObserveOp(Op op, double seconds) { impl_->ops.at(op)->Observe(seconds); }
void Metrics::ObserveStage(Stage stage, double seconds) {
  impl_->stages.at(stage)->Observe(seconds);
}

void Metrics::CountError(absl::string_view op, const absl::Status& status) {
  if (absl::IsNotFound(status) && (op == "get" || op == "lookup")) return;  // a miss
  impl_->errors
      ->Add({{metric_names::kLabelOp, std::string(op)},
             {metric_names::kLabelCode, ErrorCodeLabel(status)}})
      .Increment();
}

void Metrics::CountRead(absl::string_view op, absl::string_view tenant,
                        absl::string_view model_id, uint64_t asked, uint64_t held) {
  if (asked == 0) return;
  held = std::min(held, asked);
  std::string t, mc;
  {
    absl::MutexLock lock(&impl_->labels_mu);
    t = impl_->Bounded(impl_->tenants, tenant, mn::kMaxLabelTenants);
    mc = impl_->Bounded(impl_->model_classes, model_id, mn::kMaxLabelModelClasses);
  }
  const char* result = held == asked ? "hit" : held == 0 ? "miss" : "partial";
  impl_->reads
      ->Add({{mn::kLabelOp, std::string(op)},
             {mn::kLabelResult, result},
             {mn::kLabelTenant, t},
             {mn::kLabelModelClass, mc}})
      .Increment();
  if (op == "prefix_lookup" || op == "chunk_get") {
    auto& keys_held = impl_->prefix_keys->Add({{mn::kLabelOp, std::string(op)},
                                               {mn::kLabelResult, "held"},
                                               {mn::kLabelTenant, t},
                                               {mn::kLabelModelClass, mc}});
    auto& keys_missing = impl_->prefix_keys->Add({{mn::kLabelOp, std::string(op)},
                                                  {mn::kLabelResult, "missing"},
                                                  {mn::kLabelTenant, t},
                                                  {mn::kLabelModelClass, mc}});
    keys_held.Increment(static_cast<double>(held));
    keys_missing.Increment(static_cast<double>(asked - held));
  }
}

void Metrics::AdvanceErrors(absl::string_view op, const std::string& code, uint64_t total) {
  prometheus::Counter& c = impl_->errors->Add(
      {{metric_names::kLabelOp, std::string(op)}, {metric_names::kLabelCode, code}});
  const double now = c.Value();
  if (static_cast<double>(total) > now) c.Increment(static_cast<double>(total) - now);
}

void Metrics::CountAuthFailure(absl::string_view plane) {
  impl_->auth_failures->Add({{metric_names::kLabelPlane, std::string(plane)}}).Increment();
}

void Metrics::SetAuthRequired(bool required) { impl_->auth_required->Set(required ? 1 : 0); }
void Metrics::CountAuthReloadFailure() { impl_->auth_reload_failures->Increment(); }
void Metrics::SetControlConnections(int64_t connections) {
  impl_->control_connections->Set(static_cast<double>(connections));
}
void Metrics::AdvanceControlConnectionsClosed(absl::string_view reason, uint64_t total) {
  prometheus::Counter& c =
      impl_->control_closed->Add({{metric_names::kLabelReason, std::string(reason)}});
  const double now = c.Value();
  if (static_cast<double>(total) > now) c.Increment(static_cast<double>(total) - now);
}

void Metrics::AddGpuSeconds(double seconds) { impl_->gpu_seconds->Increment(seconds); }
void Metrics::AddTransferBytes(uint64_t to_device, uint64_t to_host) {
  if (to_device > 0) impl_->h2d_bytes->Increment(static_cast<double>(to_device));
  if (to_host > 0) impl_->d2h_bytes->Increment(static_cast<double>(to_host));
}
void Metrics::SetQueueDepth(int64_t depth) { impl_->queue_depth->Set(depth); }
void Metrics::SetPutsInProgress(int64_t puts) { impl_->puts_in_progress->Set(puts); }
void Metrics::SetReady(bool ready) { impl_->ready->Set(ready ? 1 : 0); }

void Metrics::SetTier(const TierSample& s) {
  const prometheus::Labels labels{{metric_names::kLabelTier, s.tier}};
  Impl& m = *impl_;
  m.tier_stored->Add(labels).Set(static_cast<double>(s.stored_bytes));
  m.tier_capacity->Add(labels).Set(static_cast<double>(s.capacity_bytes));
  m.tier_entries->Add(labels).Set(static_cast<double>(s.entries));
  auto advance = [](prometheus::Counter& c, uint64_t total) {
    double now = c.Value();
    if (static_cast<double>(total) > now) c.Increment(static_cast<double>(total) - now);
  };
  advance(m.tier_demotions->Add(labels), s.demotions_total);
  advance(m.tier_evictions->Add(labels), s.evictions_total);
}

void Metrics::SetDisk(bool read_only, uint64_t free_bytes, uint64_t reserve_bytes) {
  impl_->store_read_only->Set(read_only ? 1 : 0);
  impl_->disk_free->Set(static_cast<double>(free_bytes));
  impl_->disk_reserve->Set(static_cast<double>(reserve_bytes));
}

void Metrics::AdvanceStoreDamage(uint64_t quarantined, uint64_t corruptions, uint64_t repairs) {
  auto advance = [](prometheus::Counter* c, uint64_t total) {
    const double now = c->Value();
    if (static_cast<double>(total) > now) c->Increment(static_cast<double>(total) - now);
  };
  advance(impl_->store_quarantined, quarantined);
  advance(impl_->store_corruptions, corruptions);
  advance(impl_->store_repairs, repairs);
}

void Metrics::SetStoredTotals(uint64_t caches, uint64_t original_bytes, uint64_t stored_bytes) {
  impl_->caches->Set(static_cast<double>(caches));
  impl_->original->Set(static_cast<double>(original_bytes));
  impl_->saved->Set(
      original_bytes > stored_bytes ? static_cast<double>(original_bytes - stored_bytes) : 0.0);
}

void Metrics::SetProjections(uint64_t versions) {
  impl_->projections->Set(static_cast<double>(versions));
}

void Metrics::SetPqCalibrations(uint64_t versions) {
  impl_->pq_calibrations->Set(static_cast<double>(versions));
}

void Metrics::AddProjectionsDeleted(uint64_t versions) {
  impl_->projections_deleted->Increment(static_cast<double>(versions));
}

void Metrics::SetScrapeHook(std::function<void()> hook) {
  absl::MutexLock lock(&impl_->mu);
  impl_->scrape_hook = std::move(hook);
}

std::string Metrics::Scrape() {
  absl::MutexLock scrape(&impl_->scrape_mu);
  std::function<void()> hook;
  {
    absl::MutexLock lock(&impl_->mu);
    hook = impl_->scrape_hook;
  }
  if (hook) hook();
  return prometheus::TextSerializer().Serialize(impl_->registry->Collect());
}

// ---------------------------------------------------------------------------------------------

// The HTTP endpoint is Boost.Beast on one thread of our own. Not civetweb: Debian's civetweb
// starts its workers with a fixed 100 KiB stack, and in a CUDA build the static TLS of cuBLAS,
// cuBLASLt and cuSOLVER alone is about 100 KiB, so its pthread_create fails (EINVAL) and the
// daemon could not start on GPU nodes. Scrapes and probes are small and rare: one thread
// serving connections one at a time, each with a deadline, is enough.
namespace {

namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace asio = boost::asio;
using tcp = boost::asio::ip::tcp;

class HttpSession : public std::enable_shared_from_this<HttpSession> {
 public:
  HttpSession(tcp::socket socket, const HttpEndpoint::Handlers* handlers)
      : stream_(std::move(socket)), handlers_(handlers) {}

  void Start() { Read(); }

 private:
  void Read() {
    request_ = {};
    stream_.expires_after(std::chrono::seconds(10));
    http::async_read(stream_, buffer_, request_,
                     [self = shared_from_this()](beast::error_code ec, size_t) {
                       if (!ec) self->Respond();
                     });
  }

  void Respond() {
    const std::string target(request_.target());
    const std::string path = target.substr(0, target.find('?'));
    http::status code = http::status::ok;
    std::string type = "text/plain";
    std::string body;
    if (request_.method() != http::verb::get && request_.method() != http::verb::head) {
      code = http::status::method_not_allowed;
      body = "GET only\n";
    } else if (path == "/metrics") {
      type = "text/plain; version=0.0.4; charset=utf-8";
      body = handlers_->metrics();
    } else if (path == "/healthz") {
      const bool live = handlers_->live();
      code = live ? http::status::ok : http::status::service_unavailable;
      body = live ? "ok\n" : "not live\n";
    } else if (path == "/readyz") {
      std::string reason;
      const bool ready = handlers_->ready(&reason);
      code = ready ? http::status::ok : http::status::service_unavailable;
      body = ready ? "ready\n" : "not ready: " + reason + "\n";
    } else {
      code = http::status::not_found;
      body = "not found (/metrics, /healthz, /readyz)\n";
    }
    auto res = std::make_shared<http::response<http::string_body>>(code, request_.version());
    res->set(http::field::content_type, type);
    res->keep_alive(request_.keep_alive());
    res->body() = request_.method() == http::verb::head ? std::string() : std::move(body);
    res->prepare_payload();
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res](beast::error_code ec, size_t) {
                        if (ec) return;
                        if (res->keep_alive()) {
                          self->Read();
                        } else {
                          beast::error_code ignored;
                          self->stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
                        }
                      });
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  http::request<http::string_body> request_;
  const HttpEndpoint::Handlers* handlers_;
};

}  // namespace

struct HttpEndpoint::Context {
  Handlers handlers;
  asio::io_context io{1};
  std::unique_ptr<tcp::acceptor> acceptor;
  asio::steady_timer retry{io};
  std::thread thread;

  // A failed accept (out of descriptors, above all) is retried after a pause: retrying at once
  // would spin on the same error until descriptors are freed.
  void Accept() {
    acceptor->async_accept([this](beast::error_code ec, tcp::socket socket) {
      if (!acceptor->is_open()) return;
      if (!ec) {
        std::make_shared<HttpSession>(std::move(socket), &handlers)->Start();
        Accept();
        return;
      }
      retry.expires_after(std::chrono::milliseconds(100));
      retry.async_wait([this](beast::error_code wait_ec) {
        if (!wait_ec && acceptor->is_open()) Accept();
      });
    });
  }
};

absl::StatusOr<std::unique_ptr<HttpEndpoint>> HttpEndpoint::Start(const std::string& address,
                                                                  uint16_t port,
                                                                  Handlers handlers) {
  std::unique_ptr<HttpEndpoint> ep(new HttpEndpoint());
  ep->ctx_ = std::make_unique<Context>();
  Context* c = ep->ctx_.get();
  c->handlers = std::move(handlers);
  beast::error_code ec;
  const asio::ip::address addr = asio::ip::make_address(address, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics: bad listen address '", address, "': ", ec.message()));
  }
  const tcp::endpoint where(addr, port);
  c->acceptor = std::make_unique<tcp::acceptor>(c->io);
  c->acceptor->open(where.protocol(), ec);
  if (!ec) c->acceptor->set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) c->acceptor->bind(where, ec);
  if (!ec) c->acceptor->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on ", address, ":", port, ": ", ec.message()));
  }
  ep->port_ = c->acceptor->local_endpoint().port();
  c->Accept();
  c->thread = std::thread([c] { c->io.run(); });
  return ep;
}

HttpEndpoint::~HttpEndpoint() {
  if (!ctx_) return;
  asio::post(ctx_->io, [c = ctx_.get()] {
    beast::error_code ignored;
    c->retry.cancel();
    c->acceptor->close(ignored);
  });
  ctx_->io.stop();
  if (ctx_->thread.joinable()) ctx_->thread.join();
}

}  // namespace service
}  // namespace kvcomp
