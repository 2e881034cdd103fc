#include "kvcomp/service/daemon.h"

#include <malloc.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <thrift/TOutput.h>
#include <thrift/concurrency/ThreadFactory.h>
#include <thrift/concurrency/ThreadManager.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/server/TNonblockingServer.h>
#include <thrift/transport/TNonblockingSSLServerSocket.h>
#include <thrift/transport/TNonblockingServerSocket.h>
#include <thrift/transport/TSSLSocket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "cache_repository.h"
#include "cache_service.h"
#include "data_plane.h"
#include "engine.h"
#include "engine_set.h"
#include "gpu_channel.h"
#include "handlers.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/service/auth.h"
#include "kvcomp/service/config.h"
#include "kvcomp/service/metric_names.h"
#include "kvcomp/service/metrics.h"
#include "kvcomp/service/policy_store.h"
#include "kvcomp/storage/tiered_store.h"
#include "kvsplice_glue.h"
#include "log.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace kvcomp {
namespace service {

namespace {

// Damaged data the store met in RocksDB's files (kvcomp_store_corruptions_total): compactions
// that failed on it, damaged log stretches skipped and table files taken out at start, and a
// MANIFEST that ended in part of a record.
uint64_t StoreCorruptions(const storage::StoreStats& st) {
  return st.background_corruptions + st.log_damage + st.tables_dropped + st.manifest_tails;
}

using apache::thrift::TProcessorEventHandler;
using apache::thrift::concurrency::ThreadFactory;
using apache::thrift::concurrency::ThreadManager;
using apache::thrift::protocol::TBinaryProtocolFactory;
using apache::thrift::protocol::TProtocol;
using apache::thrift::server::TNonblockingServer;
using apache::thrift::server::TServerEventHandler;
using apache::thrift::transport::TNonblockingServerSocket;
using apache::thrift::transport::TNonblockingSSLServerSocket;
using apache::thrift::transport::TSSLSocketFactory;

absl::Status MakeDirs(const std::string& path) {
  std::string partial;
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      if (!partial.empty() && mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
        return absl::PermissionDeniedError(absl::StrCat("cannot create ", partial));
      }
    }
    if (i < path.size()) partial += path[i];
  }
  return absl::OkStatus();
}

storage::TierKind TierOf(const std::string& name) {
  if (name == "device") return storage::TierKind::kDevice;
  if (name == "rocksdb") return storage::TierKind::kRocksDb;
  return storage::TierKind::kHost;
}

// Raises the soft RLIMIT_NOFILE to the hard limit (connections, RocksDB files); logs both.
void RaiseFdLimit() {
  rlimit rl = {};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  const rlim_t before = rl.rlim_cur;
  if (rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) rl.rlim_cur = before;
  }
  Log(LogLevel::kInfo, "file descriptors: soft limit ", rl.rlim_cur, " (was ", before,
      ", hard limit ", rl.rlim_max, ")");
}

// Descriptors one UCX connection over TCP costs in the daemon (its socket, the endpoint's
// lanes and event descriptors; about 3 measured), rounded up.
constexpr uint64_t kFdsPerDataConnection = 4;
// Descriptors kept for everything but connections: RocksDB's table, blob and log files, the
// metrics endpoint, the engines.
constexpr uint64_t kFdsForTheRest = 256;

uint64_t OpenFds() {
  uint64_t n = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

// Caps both planes' connection counts to what the process's descriptor limit can hold, so that
// connections (a tenant holds at most its share of them) cannot take the descriptors the
// listeners, the store and the other tenants need: of what is left after the descriptors open
// now, twice data_plane.fd_reserve and kFdsForTheRest, the control plane may use a quarter (one
// descriptor per connection) and the data plane the rest (kFdsPerDataConnection each).
void BudgetDescriptors(Options* o) {
  rlimit rl = {};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return;
  const uint64_t held = OpenFds() + 2 * uint64_t{o->data_plane.fd_reserve} + kFdsForTheRest;
  const uint64_t budget = rl.rlim_cur > held ? rl.rlim_cur - held : 0;
  // At least a few of each whatever the limit (a limit that low fails elsewhere first).
  const uint64_t control = std::min<uint64_t>(o->control_plane.max_connections,
                                              std::max<uint64_t>(16, budget / 4));
  const uint64_t data = std::min<uint64_t>(
      o->data_plane.max_connections,
      std::max<uint64_t>(8, (budget > control ? budget - control : 0) / kFdsPerDataConnection));
  if (control < o->control_plane.max_connections || data < o->data_plane.max_connections) {
    Log(LogLevel::kWarning, "file descriptors: a limit of ", rl.rlim_cur,
        " holds control_plane.max_connections ", control, " (configured ",
        o->control_plane.max_connections, ") and data_plane.max_connections ", data,
        " (configured ", o->data_plane.max_connections, ", ", kFdsPerDataConnection,
        " descriptors each); raise the limit (ulimit -n) for more");
  }
  o->control_plane.max_connections = static_cast<uint32_t>(control);
  o->control_plane.max_unauthenticated_connections =
      std::min(o->control_plane.max_unauthenticated_connections, o->control_plane.max_connections);
  o->data_plane.max_connections = static_cast<uint32_t>(data);
}

// `devices`: the engines' CUDA devices (EngineCudaDevices); the GPU tier keeps a pool of
// storage.device_capacity_bytes on each.
storage::StoreOptions StoreOptionsOf(const Options& o, const std::vector<int>& devices) {
  const StorageOptions& s = o.storage;
  storage::StoreOptions so;
  so.device.enabled = s.device_capacity_bytes > 0;
  so.device.device = devices[0];
  if (devices.size() > 1) so.device.devices = devices;
  so.device.capacity_bytes = s.device_capacity_bytes;
  so.host.enabled = s.host_capacity_bytes > 0;
  so.host.capacity_bytes = s.host_capacity_bytes;
  so.rocksdb.enabled = s.rocksdb_enabled;
  so.rocksdb.path = s.data_dir + "/rocksdb";
  so.rocksdb.capacity_bytes = s.rocksdb_capacity_bytes;
  so.rocksdb.reserve_bytes = s.rocksdb_reserve_bytes;
  so.behind_max_bytes = s.behind_max_bytes;
  so.rocksdb.verify_checksums_on_open = s.verify_checksums_on_open;
  so.rocksdb.verify_in_background = true;  // a restart does not read every payload first
  so.default_tier = TierOf(s.put_tier);
  so.high_watermark = s.high_watermark;
  so.low_watermark = s.low_watermark;
  so.promote_on_read = s.promote_on_read && so.host.enabled && s.put_tier != "rocksdb";
  so.promote_to = storage::TierKind::kHost;
  so.default_ttl = absl::Seconds(s.ttl_seconds);
  so.default_tenant_quota_bytes = s.tenant_quota_bytes;
  return so;
}

// What the control plane lets a connection hold (ControlPlaneOptions, resolved).
struct ControlLimits {
  uint32_t max_connections = 0;
  uint32_t max_unauthenticated = 0;
  uint32_t tenant_connections = 0;  // 0: no per-tenant bound (open mode)
};

// The Thrift server's connections, seen through its event hooks: the descriptor of each
// (reported by the listening socket at accept, on the thread that then creates the
// connection), whether a call is running on it, whether one of its calls authenticated (and as
// which tenant), and when its last authenticated call ended. A connection is a stranger until a
// call on it authenticates: strangers hold at most max_unauthenticated connections (a new one
// beyond it closes the oldest stranger with no call running) and are closed after the
// authentication deadline whatever they send; an authenticated connection is bound to its
// tenant, which holds at most tenant_connections of them, and only authenticated calls keep it
// from the idle timeout. Closing shuts the socket down; Thrift then sees end of stream and
// closes it itself. A connection's context is deleted (under mu_) before Thrift closes its
// descriptor, so a descriptor found in conns_ under mu_ is still that connection's.
class ControlConnections : public TServerEventHandler, public TProcessorEventHandler {
 public:
  explicit ControlConnections(ControlLimits limits) : limits_(limits) {}

  // TServerEventHandler
  void preServe() override { started.Notify(); }
  void* createContext(std::shared_ptr<TProtocol>, std::shared_ptr<TProtocol>) override {
    auto* c = new Connection;
    absl::MutexLock lock(&mu_);
    c->fd = pending_fd_;
    c->accepted = c->last_active = absl::Now();
    pending_fd_ = -1;
    conns_.insert(c);
    EvictStrangers();
    return c;
  }
  void deleteContext(void* context, std::shared_ptr<TProtocol>,
                     std::shared_ptr<TProtocol>) override {
    auto* c = static_cast<Connection*>(context);
    absl::MutexLock lock(&mu_);
    conns_.erase(c);
    delete c;
  }

  // TProcessorEventHandler: brackets every call (the context is the connection's); the call
  // runs on this thread in between.
  void* getContext(const char*, void* connection) override {
    if (connection == nullptr) return nullptr;
    current_ = static_cast<Connection*>(connection);
    absl::MutexLock lock(&mu_);
    ++current_->calls;
    return connection;
  }
  void freeContext(void* connection, const char*) override {
    current_ = nullptr;
    if (connection == nullptr) return;
    auto* c = static_cast<Connection*>(connection);
    absl::MutexLock lock(&mu_);
    --c->calls;
    if (c->call_authenticated) c->last_active = absl::Now();
    c->call_authenticated = false;
  }

  // The running call's authentication (on its thread): binds a stranger's connection to the
  // tenant, or refuses the call when the tenant holds its share of connections.
  absl::Status CallAuthenticated(const absl::StatusOr<std::string>& tenant) {
    Connection* c = current_;
    if (c == nullptr) return absl::OkStatus();
    absl::MutexLock lock(&mu_);
    if (!tenant.ok()) {
      c->failed_auth = true;
      return absl::OkStatus();
    }
    if (!c->authenticated) {
      if (limits_.tenant_connections > 0) {
        uint32_t held = 0;
        for (const Connection* o : conns_) held += o->authenticated && !o->shut && o->tenant == *tenant;
        if (held >= limits_.tenant_connections) {
          ++tenant_refused_;
          return absl::ResourceExhaustedError(absl::StrCat(
              "tenant holds its share of control connections (", held,
              "); close one or reuse it"));
        }
      }
      c->authenticated = true;
      c->tenant = *tenant;
    }
    c->call_authenticated = true;
    return absl::OkStatus();
  }

  // The listening socket's accept callback, before Thrift admits or drops the connection (it
  // drops it when max_connections are open).
  void Accepted(int fd) {
    absl::MutexLock lock(&mu_);
    pending_fd_ = fd;
    if (conns_.size() >= limits_.max_connections) ++refused_;
  }

  // Shuts down strangers accepted more than `auth_deadline` ago and authenticated connections
  // whose last authenticated call ended more than `idle` ago (zero: never), none with a call
  // running; returns how many.
  uint64_t CloseIdle(absl::Duration idle, absl::Duration auth_deadline) {
    const absl::Time now = absl::Now();
    uint64_t closed = 0;
    absl::MutexLock lock(&mu_);
    for (Connection* c : conns_) {
      if (c->fd < 0 || c->calls > 0 || c->shut) continue;
      if (!c->authenticated) {
        if (now - c->accepted <= auth_deadline) continue;
        ++unauthenticated_closed_;
      } else {
        if (idle <= absl::ZeroDuration() || now - c->last_active <= idle) continue;
        ++idle_closed_;
      }
      ::shutdown(c->fd, SHUT_RDWR);
      c->shut = true;
      ++closed;
    }
    return closed;
  }

  size_t open() const {
    absl::MutexLock lock(&mu_);
    return conns_.size();
  }
  // Open connections no call has authenticated.
  size_t strangers() const {
    absl::MutexLock lock(&mu_);
    size_t n = 0;
    for (const Connection* c : conns_) n += !c->authenticated && !c->shut;
    return n;
  }
  uint64_t refused() const {
    absl::MutexLock lock(&mu_);
    return refused_;
  }
  uint64_t idle_closed() const {
    absl::MutexLock lock(&mu_);
    return idle_closed_;
  }
  uint64_t unauthenticated_closed() const {
    absl::MutexLock lock(&mu_);
    return unauthenticated_closed_;
  }
  uint64_t tenant_refused() const {
    absl::MutexLock lock(&mu_);
    return tenant_refused_;
  }
  uint64_t malformed_closed() const {
    absl::MutexLock lock(&mu_);
    return malformed_closed_;
  }
  void CountMalformed() {
    absl::MutexLock lock(&mu_);
    ++malformed_closed_;
  }

  // Shuts down the socket of `connection` (a context of createContext): Thrift then sees end of
  // stream and closes it.
  void Close(void* connection) {
    if (connection == nullptr) return;
    auto* c = static_cast<Connection*>(connection);
    absl::MutexLock lock(&mu_);
    if (c->fd < 0 || c->shut) return;
    ::shutdown(c->fd, SHUT_RDWR);
    c->shut = true;
  }

  absl::Notification started;

 private:
  struct Connection {
    int fd = -1;
    int calls = 0;
    bool shut = false;
    bool authenticated = false;       // a call on it authenticated; bound to `tenant`
    bool failed_auth = false;         // a call on it failed authentication
    bool call_authenticated = false;  // the running call authenticated
    std::string tenant;
    absl::Time accepted;
    absl::Time last_active;  // accepted, or the end of its last authenticated call
  };

  // Keeps strangers within max_unauthenticated: closes the oldest with no call running, those
  // that failed authentication first.
  void EvictStrangers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    size_t strangers = 0;
    for (const Connection* c : conns_) strangers += !c->authenticated && !c->shut;
    while (strangers > limits_.max_unauthenticated) {
      Connection* victim = nullptr;
      for (Connection* c : conns_) {
        if (c->authenticated || c->shut || c->calls > 0 || c->fd < 0) continue;
        if (victim == nullptr || std::make_pair(!c->failed_auth, c->accepted) <
                                     std::make_pair(!victim->failed_auth, victim->accepted)) {
          victim = c;
        }
      }
      if (victim == nullptr) return;
      ::shutdown(victim->fd, SHUT_RDWR);
      victim->shut = true;
      ++unauthenticated_closed_;
      --strangers;
    }
  }

  static thread_local Connection* current_;  // the connection of this thread's running call
  const ControlLimits limits_;
  mutable absl::Mutex mu_;
  absl::flat_hash_set<Connection*> conns_ ABSL_GUARDED_BY(mu_);
  int pending_fd_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t idle_closed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t unauthenticated_closed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t tenant_refused_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t malformed_closed_ ABSL_GUARDED_BY(mu_) = 0;
};

thread_local ControlConnections::Connection* ControlConnections::current_ = nullptr;

// Follows a control connection's framing over the bytes its socket returns and throws at a
// zero-length frame: Thrift's nonblocking server would wait for more bytes after one, holding the
// connection until a timeout. The server reads a frame's 4-byte size, then exactly its body; the
// throw makes it close the connection at once. Used by the plain and the TLS sockets alike.
class FrameChecker {
 public:
  explicit FrameChecker(std::shared_ptr<ControlConnections> connections)
      : connections_(std::move(connections)) {}

  void Saw(const uint8_t* buf, uint32_t got) {
    for (uint32_t i = 0; i < got;) {
      if (body_left_ > 0) {
        const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(body_left_, got - i));
        body_left_ -= n;
        i += n;
        continue;
      }
      size_bytes_[size_have_++] = buf[i++];
      if (size_have_ < 4) continue;
      size_have_ = 0;
      body_left_ = (uint32_t{size_bytes_[0]} << 24) | (uint32_t{size_bytes_[1]} << 16) |
                   (uint32_t{size_bytes_[2]} << 8) | size_bytes_[3];
      if (body_left_ == 0) {
        connections_->CountMalformed();
        throw apache::thrift::transport::TTransportException(
            apache::thrift::transport::TTransportException::CORRUPTED_DATA, "zero-length frame");
      }
    }
  }

 private:
  const std::shared_ptr<ControlConnections> connections_;
  uint8_t size_bytes_[4] = {};
  uint32_t size_have_ = 0;
  uint64_t body_left_ = 0;
};

// A plain-TCP control connection's socket.
class FrameCheckingSocket : public apache::thrift::transport::TSocket {
 public:
  FrameCheckingSocket(THRIFT_SOCKET fd, std::shared_ptr<ControlConnections> connections)
      : TSocket(fd), checker_(std::move(connections)) {}

  uint32_t read(uint8_t* buf, uint32_t len) override {
    const uint32_t got = TSocket::read(buf, len);
    checker_.Saw(buf, got);
    return got;
  }

 private:
  FrameChecker checker_;
};

// The control plane's plain-TCP listening socket, handing out FrameCheckingSockets.
class FrameCheckingServerSocket : public TNonblockingServerSocket {
 public:
  FrameCheckingServerSocket(const std::string& address, int port,
                            std::shared_ptr<ControlConnections> connections)
      : TNonblockingServerSocket(address, port), connections_(std::move(connections)) {}

 protected:
  std::shared_ptr<apache::thrift::transport::TSocket> createSocket(THRIFT_SOCKET fd) override {
    return std::make_shared<FrameCheckingSocket>(fd, connections_);
  }

 private:
  const std::shared_ptr<ControlConnections> connections_;
};

// A TLS control connection's socket: the checker sees the decrypted bytes.
class FrameCheckingSslSocket : public apache::thrift::transport::TSSLSocket {
 public:
  FrameCheckingSslSocket(std::shared_ptr<apache::thrift::transport::SSLContext> ctx,
                         THRIFT_SOCKET fd, std::shared_ptr<ControlConnections> connections)
      : TSSLSocket(std::move(ctx), fd), checker_(std::move(connections)) {}

  uint32_t read(uint8_t* buf, uint32_t len) override {
    const uint32_t got = TSSLSocket::read(buf, len);
    checker_.Saw(buf, got);
    return got;
  }

  // The SSL context of any socket `factory` makes (the factory keeps it to itself; a socket
  // holds it as a protected member, reached through a pointer to that member).
  static std::shared_ptr<apache::thrift::transport::SSLContext> ContextOf(
      apache::thrift::transport::TSSLSocketFactory& factory) {
    std::shared_ptr<apache::thrift::transport::TSSLSocket> probe = factory.createSocket();
    return (*probe).*(&FrameCheckingSslSocket::ctx_);
  }

 private:
  FrameChecker checker_;
};

// Makes the TLS listener's sockets FrameCheckingSslSockets, set up as the base factory sets up
// its server-side sockets.
class FrameCheckingSslSocketFactory : public apache::thrift::transport::TSSLSocketFactory {
 public:
  explicit FrameCheckingSslSocketFactory(std::shared_ptr<ControlConnections> connections)
      : connections_(std::move(connections)) {}

  using TSSLSocketFactory::createSocket;
  std::shared_ptr<apache::thrift::transport::TSSLSocket> createSocket(THRIFT_SOCKET fd) override {
    std::call_once(ctx_once_, [this] { ctx_ = FrameCheckingSslSocket::ContextOf(*this); });
    auto socket = std::make_shared<FrameCheckingSslSocket>(ctx_, fd, connections_);
    socket->server(server());
    return socket;
  }

 private:
  const std::shared_ptr<ControlConnections> connections_;
  std::once_flag ctx_once_;
  std::shared_ptr<apache::thrift::transport::SSLContext> ctx_;
};

// The control plane's processor, closing a connection whose request cannot be decoded (a bad
// message header, argument structs that do not parse, a frame shorter than what it announces).
// Thrift's nonblocking server would neither answer such a request nor close its connection, so
// the peer would wait for the idle timeout. Anything else a call does is answered by the
// generated processor (a handler's exception becomes a TApplicationException reply), so what
// escapes process(), or makes it return false, is a decoding failure.
class ClosingProcessor : public apache::thrift::TProcessor {
 public:
  ClosingProcessor(std::shared_ptr<apache::thrift::TProcessor> inner,
                   std::shared_ptr<ControlConnections> connections)
      : inner_(std::move(inner)), connections_(std::move(connections)) {}

  bool process(std::shared_ptr<TProtocol> in, std::shared_ptr<TProtocol> out,
               void* connection) override {
    std::string why;
    try {
      const bool called = inner_->process(std::move(in), std::move(out), connection);
      ReplyWritten();
      if (called) return true;
      why = "not a call";  // the processor's only false: a message type other than call
    } catch (const apache::thrift::TException& e) {
      ReplyWritten();
      why = e.what();
    }
    Log(LogLevel::kDebug, "control: malformed request (", why, "); connection closed");
    connections_->CountMalformed();
    connections_->Close(connection);
    return false;
  }

 private:
  // The call's reply is serialized into the connection's write buffer: what its handler held
  // for it is released, and after a large reply the freed heap pages go back to the system
  // (the reply's gathered copies sit below the allocator's mmap threshold).
  static void ReplyWritten() {
    if (ReplyBudget::ReleaseHeldReplies() >= kTrimAfterBytes) malloc_trim(0);
  }
  static constexpr uint64_t kTrimAfterBytes = uint64_t{8} << 20;

  const std::shared_ptr<apache::thrift::TProcessor> inner_;
  const std::shared_ptr<ControlConnections> connections_;
};

// What a control connection keeps between calls (buffers above it are freed after the call).
constexpr size_t kIdleReadBufferBytes = size_t{64} << 10;
constexpr size_t kIdleWriteBufferBytes = size_t{256} << 10;

class DaemonImpl : public Daemon {
 public:
  ~DaemonImpl() override { (void)Shutdown(absl::ZeroDuration()); }

  // Init failed with `why`: the shutdown that follows stops what had started and says so.
  void FailedToStart(absl::Status why) { start_failure_ = std::move(why); }

  absl::Status Init(const Options& options);

  uint16_t data_port() const override { return ctx_.data_port.load(); }
  uint16_t control_port() const override { return control_port_; }
  uint16_t metrics_port() const override { return ctx_.metrics_port.load(); }
  std::string backend() const override { return engines_->description(); }
  bool ready() const override { return ctx_.ready.load(); }

  void Drain() override {
    if (ctx_.draining.exchange(true)) return;
    if (start_failure_.ok()) {  // after a failed start nothing is in flight: nothing to say
      Log(LogLevel::kInfo, "draining: no new puts or connections; finishing in-flight work");
    }
    ctx_.ready.store(false);
    metrics_->SetReady(false);
    if (service_) service_->Drain();
    if (data_plane_) data_plane_->Drain();
    if (gpu_) gpu_->Drain();
  }

  absl::Status Shutdown(absl::Duration grace) override;

  absl::Status ReloadTokens() override {
    absl::Status s = tokens_->Reload();
    if (s.ok()) {
      Log(LogLevel::kInfo, "tokens reloaded: ", TenancyLine());
    } else {
      metrics_->CountAuthReloadFailure();
      Log(LogLevel::kError, "token reload failed (previous tokens kept): ", s.ToString());
    }
    return s;
  }

  // Any engine's sticky failure fails the daemon (it drains and exits for a restart).
  bool failed() const override { return engines_ != nullptr && engines_->failed(); }

  void Tick() override {
    absl::Time now = absl::Now();
    if (failed() && !ctx_.draining.load()) {
      Log(LogLevel::kError, "engine failed: ", engines_->failure(),
          "; not ready, draining, then exiting for a restart");
      if (metrics_ != nullptr) metrics_->SetReady(false);
      Drain();
    }
    const double sweep = options_.storage.sweep_interval_seconds;
    if (sweep > 0 && now - last_sweep_ >= absl::Seconds(sweep)) {
      last_sweep_ = now;
      Sweep();
    }
    ControlPlaneTick();
    StoreDamageTick();
    if (options_.auth.reload_interval_seconds <= 0) return;
    if (now - last_token_check_ < absl::Seconds(options_.auth.reload_interval_seconds)) return;
    last_token_check_ = now;
    auto r = tokens_->MaybeReload();
    if (!r.ok()) {
      metrics_->CountAuthReloadFailure();
      Log(LogLevel::kError, "token reload failed (previous tokens kept): ", r.status().ToString());
    } else if (*r) {
      Log(LogLevel::kInfo, "token file changed, reloaded: ", TenancyLine());
    }
  }

 private:
  std::string TenancyLine() const {
    if (tokens_->open_mode()) {
      return "OPEN single-tenant mode, AUTHENTICATION OFF: no auth.token_file configured, every "
             "request acts as tenant 'default' whatever its credentials (set auth.token_file to "
             "require tokens; never expose this daemon beyond localhost)";
    }
    return absl::StrCat("multi-tenant, authentication required: ", tokens_->tenants().size(),
                        " tenant(s) from ", tokens_->path());
  }
  absl::Status StartThrift();
  // The Thrift serving thread ended on its own: readiness goes, the log says why.
  void ControlPlaneDied(const std::string& why);
  // Closes idle control connections, releases a dead Thrift server's connections, and
  // publishes the connection gauges.
  void ControlPlaneTick();
  // Logs damage the store met since the last tick (caches quarantined, RocksDB background work
  // that failed on damaged data, repair passes) and raises the store's damage counters.
  void StoreDamageTick();
  // Why the control plane stopped serving ("" while it serves).
  std::string ControlPlaneFailure() const;
  void RefreshGauges();
  // The per-engine gauges (label {device}), registered once the engines exist.
  void RegisterEngineGauges();
  // Removes expired caches, then the projection versions no stored cache names (not the latest
  // of their tenant/model, not held by an open put).
  void Sweep();
  absl::Status WriteReadyFile() const;

  Options options_;
  ServiceContext ctx_;
  std::unique_ptr<TokenStore> tokens_;
  std::shared_ptr<DeviceEnv> device_env_;  // the device seam (device_env.h)
  std::unique_ptr<storage::TieredStore> store_;
  std::unique_ptr<PolicyStore> policies_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<codecs::TieredProjectionStore> projections_;
  // The layers of the data path, inside out: the engines' workers (one engine per GPU, or the
  // CPU engine) and the cache repository, the service over them, and the data plane (the
  // transport and its facade) in front.
  std::unique_ptr<EngineSet> engines_;
  struct EngineGauges {
    prometheus::Gauge* queue_depth = nullptr;
    std::array<prometheus::Gauge*, DeviceEnv::kNumDrawers> held{};  // GPU engines only
    prometheus::Gauge* failed = nullptr;
  };
  std::vector<EngineGauges> engine_gauges_;  // index = engine
  std::unique_ptr<CacheRepository> repository_;
  std::unique_ptr<CacheService> service_;
  std::unique_ptr<DataPlane> data_plane_;
  std::unique_ptr<GpuChannels> gpu_;  // the GPU channel, beside the data plane
  std::shared_ptr<TNonblockingServer> thrift_;
  std::shared_ptr<ThreadManager> thrift_workers_;
  std::shared_ptr<ControlConnections> control_;
  std::thread thrift_thread_;
  std::atomic<bool> thrift_stopping_{false};
  std::atomic<bool> thrift_dead_{false};
  mutable absl::Mutex thrift_mu_;
  std::string thrift_failure_ ABSL_GUARDED_BY(thrift_mu_);
  uint16_t control_port_ = 0;
  std::unique_ptr<HttpEndpoint> http_;
  absl::Time last_token_check_ = absl::Now();
  absl::Time last_sweep_ = absl::Now();
  absl::Time last_totals_ = absl::InfinitePast();
  struct DamageTotals {
    uint64_t quarantined = 0, corruptions = 0, repairs = 0;
  };
  DamageTotals logged_damage_;  // what StoreDamageTick has logged (Tick's thread only)
  bool shut_down_ = false;
  absl::Status start_failure_;  // why Init failed, else OK
};

void ThriftLog(const char* message) { Log(LogLevel::kDebug, "thrift: ", message); }

absl::Status DaemonImpl::Init(const Options& options) {
  options_ = options;
  SetLogLevel(options.process.log_level);
  SetLogFormat(options.process.log_format);
  RaiseFdLimit();
  BudgetDescriptors(&options_);
  ctx_.options = options_;
  apache::thrift::GlobalOutput.setOutputFunction(ThriftLog);
  KVCOMP_RETURN_IF_ERROR(MakeDirs(options.storage.data_dir));

  auto tokens = TokenStore::Open(options.auth.token_file);
  if (!tokens.ok()) {
    return Annotate(tokens.status(),
                    "auth (a configured token source must hold valid tokens; refusing to start)");
  }
  tokens_ = std::move(*tokens);
  Log(tokens_->open_mode() ? LogLevel::kWarning : LogLevel::kInfo, TenancyLine());

  auto devices = EngineCudaDevices(options.engine);
  if (!devices.ok()) return devices.status();
  // The device seam: each GPU's budget, which the engines' puts, the links' buffers and the GPU
  // tier's pools draw from, and through which those pools and buffers are allocated.
  device_env_ =
      std::make_shared<DeviceEnv>(options.engine.gpu_memory_bytes, DeviceEnv::CudaMemory());
  storage::StoreOptions so = StoreOptionsOf(options, *devices);
  auto over_budget = std::make_shared<absl::Status>();
  so.device.pool_memory = [env = device_env_, over_budget](int device, uint64_t bytes)
      -> absl::StatusOr<std::shared_ptr<void>> {
    const bool fits = env->budget_bytes() == 0 || env->held_bytes(device) + bytes <= env->budget_bytes();
    absl::StatusOr<std::shared_ptr<uint8_t>> pool =
        env->Allocate(device, bytes, DeviceEnv::Drawer::kGpuTier);
    if (!pool.ok() && !fits) {
      *over_budget = Annotate(pool.status(), "storage.device_capacity_bytes is drawn from "
                                             "engine.gpu_memory_bytes: the GPU tier does not fit");
    }
    if (!pool.ok()) return pool.status();
    return std::shared_ptr<void>(*std::move(pool));
  };
  auto store = storage::TieredStore::Open(so);
  if (!store.ok()) return Annotate(store.status(), "storage");
  store_ = std::move(*store);
  // A pool larger than its device's budget stops the start (any other failure of the GPU tier
  // leaves it out, as with every tier, and is reported).
  KVCOMP_RETURN_IF_ERROR(*over_budget);
  storage::StoreStats st = store_->Stats();
  Log(LogLevel::kInfo, "storage open under ", options.storage.data_dir, ": ", st.recovered,
      " cache(s) recovered, ", st.quarantined, " quarantined; durability ",
      options.storage.durability);
  const storage::TierStats& rocks = st.tier(storage::TierKind::kRocksDb);
  if (options.storage.rocksdb_enabled && !rocks.present) {
    Log(LogLevel::kError, "storage: the RocksDB tier under ", options.storage.data_dir,
        "/rocksdb did not open (", rocks.error, "): caches stored there are NOT served and ",
        "disk-durable puts are refused until a restart opens it");
  } else if (rocks.read_only) {
    Log(LogLevel::kWarning, "storage: the RocksDB tier is open READ-ONLY (",
        rocks.read_only_reason, "): its ", st.recovered, " cache(s) are served; puts that need ",
        "the disk are refused (RESOURCE_EXHAUSTED) and resume by themselves once space returns");
  }
  if (st.quarantined > 0) {
    Log(LogLevel::kWarning, "storage: ", st.quarantined,
        " damaged cache(s) quarantined at start (never served; kvcomp_store_quarantined_total), "
        "the latest ", st.last_quarantined);
  }
  if (st.log_damage > 0) {
    Log(LogLevel::kWarning, "storage: the RocksDB write-ahead log was damaged: its replay skipped ",
        st.log_damage, " damaged stretch(es), ", st.log_damage_bytes,
        " bytes (kvcomp_store_corruptions_total); the caches written there are lost (misses), "
        "the rest are served; the last: ",
        st.last_log_damage);
  }
  if (st.tables_dropped > 0) {
    Log(LogLevel::kWarning, "storage: ", st.tables_dropped,
        " damaged RocksDB table file(s) taken out at start (kvcomp_store_corruptions_total); the "
        "caches recorded there are lost (misses), the rest are served; the last: ",
        st.last_table_dropped);
  }
  if (st.manifest_tails > 0) {
    Log(LogLevel::kWarning, "storage: ", st.last_manifest_tail,
        " (kvcomp_store_corruptions_total)");
  }
  logged_damage_ = {st.quarantined, StoreCorruptions(st), st.damage_repairs};
  if (st.unverified > 0) {
    Log(LogLevel::kInfo, "storage: checking the payloads of ", st.unverified,
        " recovered cache(s) in the background; a damaged one is quarantined, never served");
  }

  PolicyLimits policy_limits;
  policy_limits.max_per_tenant = options.control_plane.max_policies_per_tenant;
  policy_limits.updates_per_second = options.control_plane.policy_updates_per_second;
  KVCOMP_ASSIGN_OR_RETURN(policies_, PolicyStore::Open(options.storage.data_dir + "/policies.yaml",
                                                       options.default_policy, policy_limits));

  const std::string& backend = options.engine.backend;
  const bool cuda = backend == "cuda" || (backend == "auto" && CudaAvailable());
  metrics_ = std::make_unique<Metrics>(Version(), cuda ? "cuda" : "cpu");
  metrics_->SetAuthRequired(!tokens_->open_mode());
  projections_ = std::make_unique<codecs::TieredProjectionStore>(store_.get());
  auto engines = EngineSet::Create(options.engine, options.data_plane.tenant_share, device_env_);
  if (!engines.ok()) return Annotate(engines.status(), "engine");
  engines_ = std::move(*engines);
  for (size_t i = 0; i < engines_->size(); ++i) {
    Log(LogLevel::kInfo, "engine: ", engines_->at(i).description(), ", ", options.engine.workers,
        " worker(s), queue ", options.engine.queue_capacity);
  }
  if (!cuda && !options.engine.cuda_devices.empty()) {
    Log(LogLevel::kInfo, "engine.cuda_devices ", options.engine.cuda_devices,
        " not used: no GPU is visible, one CPU engine runs");
  }
  RegisterEngineGauges();
  RepositoryOptions ro;
  ro.durability = options.storage.durability == "disk"     ? storage::Durability::kDisk
                  : options.storage.durability == "behind" ? storage::Durability::kBehind
                                                           : storage::Durability::kMemory;
  ro.put_tier = static_cast<int>(TierOf(options.storage.put_tier));
  repository_ =
      std::make_unique<CacheRepository>(ro, store_.get(), projections_.get(), metrics_.get());
  ServiceOptions svo;
  svo.max_put_bytes = options.data_plane.max_put_bytes;
  svo.tenant_share = options.data_plane.tenant_share;
  service_ =
      std::make_unique<CacheService>(svo, engines_.get(), repository_.get(), metrics_.get());

  ctx_.tokens = tokens_.get();
  ctx_.store = store_.get();
  ctx_.policies = policies_.get();
  ctx_.service = service_.get();
  ctx_.metrics = metrics_.get();
  gpu_ = GpuChannels::Create(options, service_.get(), metrics_.get());
  ctx_.gpu = gpu_.get();
  if (!gpu_->available()) Log(LogLevel::kInfo, gpu_->unavailable_reason());
  ctx_.calibrate = [this](const CalibrationRequest& request) -> absl::StatusOr<CalibrationResult> {
    KVCOMP_ASSIGN_OR_RETURN(CalibrationResult r,
                            CalibrateFromStore(store_.get(), projections_.get(), request));
    // The previous latest version may be named by no stored cache: it goes now.
    auto model = codecs::ProjectionModel(request.tenant, request.model_id);
    auto collected = model.ok() ? projections_->Collect(*model) : model.status();
    if (!collected.ok()) {
      Log(LogLevel::kWarning,
          "projection cleanup after Calibrate: ", collected.status().ToString());
    } else {
      metrics_->AddProjectionsDeleted(*collected);
    }
    return r;
  };
  metrics_->SetScrapeHook([this] { RefreshGauges(); });

  auto data_plane = DataPlane::Start(options_, &ctx_);
  if (!data_plane.ok()) return Annotate(data_plane.status(), "data plane (UCX)");
  data_plane_ = std::move(*data_plane);
  ctx_.data_port.store(data_plane_->port());

  KVCOMP_RETURN_IF_ERROR(Annotate(StartThrift(), "control plane (Thrift)"));

  if (options.metrics.enabled) {
    HttpEndpoint::Handlers h;
    h.metrics = [this] { return metrics_->Scrape(); };
    // A control plane that stopped serving never comes back: the process is not live either,
    // so an orchestrator restarts it.
    h.live = [this] { return !thrift_dead_.load(); };
    h.ready = [this](std::string* reason) {
      if (thrift_dead_.load()) {
        *reason = ControlPlaneFailure();
        return false;
      }
      if (control_ != nullptr && control_->open() >= options_.control_plane.max_connections) {
        *reason = absl::StrCat("control plane full: ", control_->open(),
                               " connections open (control_plane.max_connections); new ones "
                               "are closed on accept");
        return false;
      }
      if (engines_->failed()) {
        *reason = "engine failed: " + engines_->failure();
        return false;
      }
      if (ctx_.draining.load()) {
        *reason = "draining";
        return false;
      }
      if (!ctx_.ready.load()) {
        *reason = "starting";
        return false;
      }
      return true;
    };
    auto http = HttpEndpoint::Start(options.metrics.address, options.metrics.port, std::move(h));
    if (!http.ok()) return Annotate(http.status(), "metrics");
    http_ = std::move(*http);
    ctx_.metrics_port.store(http_->port());
  }
  ctx_.ready.store(!thrift_dead_.load());
  metrics_->SetReady(!thrift_dead_.load());
  Log(LogLevel::kInfo, "listening: data ", options.data_plane.address, ":", data_port(),
      " control ", options.control_plane.address, ":", control_port_, " metrics ",
      options.metrics.address, ":", metrics_port(), " (ready)");
  return WriteReadyFile();
}

absl::Status DaemonImpl::StartThrift() {
  const ControlPlaneOptions& c = options_.control_plane;
  auto handler = std::make_shared<ControlHandler>(&ctx_);
  auto processor = std::make_shared<rpc::KvcompControlProcessor>(handler);
  std::shared_ptr<TNonblockingServerSocket> socket;
  try {
    ControlLimits limits;
    limits.max_connections = c.max_connections;
    limits.max_unauthenticated = std::min(c.max_unauthenticated_connections, c.max_connections);
    if (!tokens_->open_mode() && c.tenant_share < 1) {
      limits.tenant_connections = std::max<uint32_t>(
          1, static_cast<uint32_t>(c.tenant_share * static_cast<double>(c.max_connections)));
    }
    control_ = std::make_shared<ControlConnections>(limits);
    // Both listeners close a connection at a zero-length frame.
    if (c.tls) {
      auto factory = std::make_shared<FrameCheckingSslSocketFactory>(control_);
      factory->loadCertificate(c.tls_cert_file.c_str());
      factory->loadPrivateKey(c.tls_key_file.c_str());
      if (!c.tls_ca_file.empty()) {
        factory->loadTrustedCertificates(c.tls_ca_file.c_str());
        factory->authenticate(true);
      } else {
        factory->authenticate(false);
      }
      socket = std::make_shared<TNonblockingSSLServerSocket>(c.address, c.port, factory);
    } else {
      socket = std::make_shared<FrameCheckingServerSocket>(c.address, c.port, control_);
    }
    ctx_.control_authenticated = [control = control_](const absl::StatusOr<std::string>& t) {
      return control->CallAuthenticated(t);
    };
    processor->setEventHandler(control_);
    socket->setAcceptCallback([control = control_](THRIFT_SOCKET fd) { control->Accepted(fd); });
    thrift_workers_ = ThreadManager::newSimpleThreadManager(c.worker_threads);
    thrift_workers_->threadFactory(std::make_shared<ThreadFactory>());
    thrift_workers_->start();
    // No string or list read from a frame may claim more than the frame holds: Thrift checks
    // such sizes against its 100 MB message default, not the frame, so a 30-byte request could
    // make it allocate 800 MB before any credential is checked. A list element of a request
    // takes at least 4 bytes on the wire.
    auto protocol = std::make_shared<TBinaryProtocolFactory>(
        static_cast<int32_t>(c.max_frame_bytes), static_cast<int32_t>(c.max_frame_bytes / 4),
        false, true);
    thrift_ = std::make_shared<TNonblockingServer>(
        std::make_shared<ClosingProcessor>(processor, control_), protocol, socket,
        thrift_workers_);
    thrift_->setNumIOThreads(static_cast<size_t>(c.io_threads));
    // Nothing is buffered for a peer beyond one frame of at most max_frame_bytes (every frame
    // is read whole before its credentials can be checked); a larger frame closes the
    // connection. Connections beyond max_connections are closed on accept (the overload test
    // is "more than max open", hence max - 1; hysteresis 1: admission resumes below the cap).
    thrift_->setMaxFrameSize(static_cast<size_t>(c.max_frame_bytes));
    // A connection's read and write buffers shrink back after every call that grew them past
    // these (Thrift's default checks every 512 calls, so a connection kept the largest reply it
    // ever sent): memory returns once a large reply is sent.
    thrift_->setResizeBufferEveryN(1);
    thrift_->setIdleReadBufferLimit(kIdleReadBufferBytes);
    thrift_->setIdleWriteBufferLimit(kIdleWriteBufferBytes);
    thrift_->setMaxConnections(c.max_connections - 1);
    thrift_->setOverloadAction(apache::thrift::server::T_OVERLOAD_CLOSE_ON_ACCEPT);
    thrift_->setOverloadHysteresis(1.0);
    thrift_->setServerEventHandler(control_);
    auto events = control_;
    auto failure = std::make_shared<std::string>();
    thrift_thread_ = std::thread([this, server = thrift_, events, failure] {
      std::string why;
      try {
        server->serve();
        why = "its serving loop returned";
      } catch (const std::exception& e) {
        why = e.what();
      }
      if (!events->started.HasBeenNotified()) {
        *failure = why;
        events->started.Notify();
        return;
      }
      if (thrift_stopping_.load()) return;
      ControlPlaneDied(why);
    });
    if (!events->started.WaitForNotificationWithTimeout(absl::Seconds(10))) {
      return absl::DeadlineExceededError("Thrift server did not start");
    }
    if (!failure->empty()) {
      thrift_thread_.join();
      thrift_.reset();
      return absl::UnavailableError(
          absl::StrCat("cannot serve on ", c.address, ":", c.port, ": ", *failure));
    }
    control_port_ = static_cast<uint16_t>(socket->getListenPort());
  } catch (const std::exception& e) {
    return absl::UnavailableError(e.what());
  }
  return absl::OkStatus();
}

void DaemonImpl::ControlPlaneDied(const std::string& why) {
  {
    absl::MutexLock lock(&thrift_mu_);
    thrift_failure_ = absl::StrCat("control plane (Thrift) stopped serving: ", why);
  }
  thrift_dead_.store(true);
  ctx_.ready.store(false);
  if (metrics_ != nullptr) metrics_->SetReady(false);
  Log(LogLevel::kError, ControlPlaneFailure(),
      "; not ready (and not live) from now on: restart the daemon");
}

std::string DaemonImpl::ControlPlaneFailure() const {
  absl::MutexLock lock(&thrift_mu_);
  return thrift_failure_;
}

void DaemonImpl::ControlPlaneTick() {
  if (thrift_dead_.load() && thrift_ != nullptr && !thrift_stopping_.load()) {
    // Close what the dead server still holds (its connections' descriptors, its other I/O
    // threads), so the process's other listeners keep working until it is restarted.
    thrift_->stop();
    if (thrift_thread_.joinable()) thrift_thread_.join();
    if (thrift_workers_) thrift_workers_->stop();
    thrift_.reset();
    Log(LogLevel::kWarning, "control plane released: its connections are closed");
  }
  if (control_ == nullptr || thrift_ == nullptr) return;
  const ControlPlaneOptions& c = options_.control_plane;
  const uint64_t closed = control_->CloseIdle(absl::Seconds(c.idle_timeout_seconds),
                                              absl::Seconds(c.auth_timeout_seconds));
  if (closed > 0) {
    Log(LogLevel::kDebug, "control plane: ", closed,
        " idle or unauthenticated connection(s) closed");
  }
}

void DaemonImpl::StoreDamageTick() {
  if (store_ == nullptr || metrics_ == nullptr) return;
  const storage::StoreStats st = store_->Stats();
  metrics_->AdvanceStoreDamage(st.quarantined, StoreCorruptions(st), st.damage_repairs);
  DamageTotals& logged = logged_damage_;
  if (st.quarantined > logged.quarantined) {
    Log(LogLevel::kWarning, "storage: ", st.quarantined - logged.quarantined,
        " damaged cache(s) quarantined (never served; ", st.quarantined,
        " since start), the latest ", st.last_quarantined);
    logged.quarantined = st.quarantined;
  }
  const uint64_t corruptions = StoreCorruptions(st);
  if (corruptions > logged.corruptions) {
    Log(LogLevel::kWarning, "storage: RocksDB met damaged data in background work ",
        corruptions - logged.corruptions, " time(s) (", st.background_corruptions,
        " since start); writes go on, a repair pass follows");
    logged.corruptions = corruptions;
  }
  if (st.damage_repairs > logged.repairs) {
    Log(LogLevel::kWarning, "storage: repair pass ", st.damage_repairs, ": ",
        st.last_damage_repair);
    logged.repairs = st.damage_repairs;
  }
}

void DaemonImpl::Sweep() {
  const uint64_t expired = store_->ExpireNow();
  auto collected = projections_->Collect();
  if (!collected.ok()) {
    Log(LogLevel::kWarning, "sweep: projection cleanup: ", collected.status().ToString());
    return;
  }
  metrics_->AddProjectionsDeleted(*collected);
  if (expired > 0 || *collected > 0) {
    Log(LogLevel::kDebug, "sweep: ", expired, " expired cache(s) removed, ", *collected,
        " unused projection version(s) deleted");
  }
}

void DaemonImpl::RegisterEngineGauges() {
  namespace mn = metric_names;
  prometheus::Registry& registry = metrics_->registry();
  auto& queue = prometheus::BuildGauge()
                    .Name(mn::kEngineQueueDepth)
                    .Help("Committed puts waiting for or in compression on one engine.")
                    .Register(registry);
  auto& held = prometheus::BuildGauge()
                   .Name(mn::kDeviceMemoryBytes)
                   .Help("GPU memory drawn from one device's budget, by drawer (puts, links).")
                   .Register(registry);
  auto& budget = prometheus::BuildGauge()
                     .Name(mn::kDeviceMemoryBudgetBytes)
                     .Help("engine.gpu_memory_bytes: one device's budget (0 = none).")
                     .Register(registry);
  auto& failed = prometheus::BuildGauge()
                     .Name(mn::kEngineFailed)
                     .Help("1 once the engine has failed (a sticky device error), else 0.")
                     .Register(registry);
  for (size_t i = 0; i < engines_->size(); ++i) {
    const Engine& e = engines_->at(i);
    const std::map<std::string, std::string> label = {
        {mn::kLabelDevice, e.cuda_device() >= 0 ? absl::StrCat(e.cuda_device()) : "cpu"}};
    EngineGauges g;
    g.queue_depth = &queue.Add(label);
    g.failed = &failed.Add(label);
    if (e.uses_gpu()) {
      budget.Add(label).Set(static_cast<double>(e.device_cap_bytes()));
      for (int d = 0; d < DeviceEnv::kNumDrawers; ++d) {
        std::map<std::string, std::string> l = label;
        l[mn::kLabelDrawer] = DeviceEnv::DrawerName(static_cast<DeviceEnv::Drawer>(d));
        g.held[d] = &held.Add(l);
      }
    }
    engine_gauges_.push_back(g);
  }
}

void DaemonImpl::RefreshGauges() {
  for (size_t i = 0; engines_ != nullptr && i < engine_gauges_.size(); ++i) {
    const Engine& e = engines_->at(i);
    const EngineGauges& g = engine_gauges_[i];
    g.queue_depth->Set(static_cast<double>(e.queue_depth()));
    g.failed->Set(e.failed() ? 1 : 0);
    for (int d = 0; d < DeviceEnv::kNumDrawers && g.held[d] != nullptr; ++d) {
      g.held[d]->Set(static_cast<double>(
          e.device_env().held_bytes(e.cuda_device(), static_cast<DeviceEnv::Drawer>(d))));
    }
  }
  storage::StoreStats st = store_->Stats();
  for (int i = 0; i < storage::kNumTiers; ++i) {
    const storage::TierStats& t = st.tiers[i];
    if (!t.present) continue;
    TierSample s;
    s.tier = storage::TierName(static_cast<storage::TierKind>(i));
    s.stored_bytes = t.bytes;
    s.capacity_bytes = t.capacity;
    s.entries = t.entries;
    s.demotions_total = t.demotions;
    s.evictions_total = t.evictions;
    metrics_->SetTier(s);
  }
  const storage::TierStats& rocksdb = st.tier(storage::TierKind::kRocksDb);
  if (rocksdb.present) {
    metrics_->SetDisk(rocksdb.read_only, rocksdb.disk_free_bytes,
                      options_.storage.rocksdb_reserve_bytes);
  }
  metrics_->AdvanceStoreDamage(st.quarantined, StoreCorruptions(st), st.damage_repairs);
  metrics_->SetQueueDepth(static_cast<int64_t>(service_->queue_depth()));
  if (control_ != nullptr) {
    metrics_->SetControlConnections(thrift_dead_.load() ? 0
                                                        : static_cast<int64_t>(control_->open()));
    metrics_->AdvanceControlConnectionsClosed("limit", control_->refused());
    metrics_->AdvanceControlConnectionsClosed("idle", control_->idle_closed());
    metrics_->AdvanceControlConnectionsClosed("malformed", control_->malformed_closed());
    metrics_->AdvanceControlConnectionsClosed("unauthenticated",
                                              control_->unauthenticated_closed());
  }
  metrics_->SetPutsInProgress(static_cast<int64_t>(service_->open_puts()));
  // Errors the transport answered itself (malformed frames, checksum mismatches, oversized
  // blocks, ...) never reach the handlers: op "transport", by code, from its running totals.
  if (data_plane_ != nullptr) data_plane_->ExportMetrics(metrics_.get());
  // Totals over the caches of every tenant in the store, token file or not (the store keeps
  // them per tenant as caches come and go: no scan).
  uint64_t caches = 0, original = 0, stored = 0;
  for (const storage::TenantUsage& u : store_->Usage()) {
    caches += u.caches;
    original += u.original_bytes;
    stored += u.stored_bytes;
  }
  metrics_->SetStoredTotals(caches, original, stored);
  // Projections are listed from RocksDB: at most once a second.
  absl::Time now = absl::Now();
  if (now - last_totals_ < absl::Seconds(1)) return;
  last_totals_ = now;
  auto projections = projections_->Count();
  if (projections.ok()) metrics_->SetProjections(*projections);
  auto pq = projections_->CountPq();
  if (pq.ok()) metrics_->SetPqCalibrations(*pq);
}

absl::Status DaemonImpl::WriteReadyFile() const {
  const std::string& path = options_.process.ready_file;
  if (path.empty()) return absl::OkStatus();
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << "data_port: " << data_port() << "\ncontrol_port: " << control_port_
      << "\nmetrics_port: " << metrics_port() << "\npid: " << getpid() << "\n";
    if (!f) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

absl::Status DaemonImpl::Shutdown(absl::Duration grace) {
  if (shut_down_) return absl::OkStatus();
  shut_down_ = true;
  if (metrics_ != nullptr) Drain();
  absl::Status result;
  absl::Time deadline = absl::Now() + grace;
  if (data_plane_) {
    absl::Status s = data_plane_->WaitIdle(grace);
    if (!s.ok()) result = s;
  }
  if (service_ && !service_->WaitIdle(std::max(deadline - absl::Now(), absl::ZeroDuration()))) {
    result = absl::DeadlineExceededError("in-flight work did not finish within the grace period");
  }
  Log(LogLevel::kDebug, "shutdown: in-flight work done");
  if (data_plane_) data_plane_->Stop();
  if (gpu_) gpu_->Stop();
  Log(LogLevel::kDebug, "shutdown: data plane stopped");
  thrift_stopping_.store(true);
  if (thrift_) {
    thrift_->stop();
    if (thrift_thread_.joinable()) thrift_thread_.join();
    thrift_.reset();
  }
  if (thrift_workers_) thrift_workers_->stop();
  Log(LogLevel::kDebug, "shutdown: control plane stopped");
  if (service_) service_->Shutdown();
  data_plane_.reset();  // the open puts it held go before the service they belong to
  service_.reset();
  repository_.reset();
  engines_.reset();
  Log(LogLevel::kDebug, "shutdown: engine stopped");
  store_.reset();  // closes RocksDB (memtables flushed, WAL synced)
  Log(LogLevel::kDebug, "shutdown: store closed");
  http_.reset();
  if (!options_.process.ready_file.empty()) std::remove(options_.process.ready_file.c_str());
  if (!start_failure_.ok()) {
    // Nothing was in flight: what the drain above reports is not why the daemon stops.
    Log(LogLevel::kError, "failed to start: ", start_failure_.ToString(),
        " (what had started is stopped)");
    return start_failure_;
  }
  Log(LogLevel::kInfo, "stopped", result.ok() ? "" : absl::StrCat(" (", result.ToString(), ")"));
  return result;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const Options& options) {
  auto d = std::make_unique<DaemonImpl>();
  if (absl::Status s = d->Init(options); !s.ok()) {
    d->FailedToStart(s);
    return s;
  }
  return std::unique_ptr<Daemon>(std::move(d));
}

}  // namespace service
}  // namespace kvcomp
