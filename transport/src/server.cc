#include "kvcomp/transport/server.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/shm_link.h"
#include "transport/src/admission.h"
#include "transport/src/buffer_cache.h"
#include "transport/src/ucx_util.h"

namespace kvcomp {
namespace transport {
namespace {

// An open put. Shared with completion callbacks, which may outlive the connection.
struct PutState {
  wire::PutBegin begin;
  std::unique_ptr<PutHandle> handle;  // the handler's state for this put
  absl::Time last_activity;
  uint64_t blocks_acked = 0;
  uint64_t blocks_pending = 0;  // received or being received, not yet acknowledged
  uint64_t blocks_receiving = 0;  // of those, bytes still arriving (a rendezvous in flight)
  bool committing = false;
};

struct Connection {
  uint64_t id = 0;
  ucp_ep_h ep = nullptr;
  Session session;
  bool authenticated = false;
  bool closed = false;
  absl::Time created;
  absl::Time last_activity;
  uint64_t inflight_bytes = 0;
  // The client said minor >= 1 and this server's UCX is CUDA-aware: hello-ok told it
  // kServerCudaMemory, and its blocks may be device payloads.
  bool device_payloads = false;
  // The client said minor >= 4 at hello: its status replies carry typed error details.
  bool error_details = false;
  // Same-host shared memory offered at hello (client minor >= 2, server option on): the
  // regions this connection attached. Withdrawn when the connection closes.
  std::shared_ptr<ShmGrant> shm;
  uint64_t pending_work = 0;  // handler completions and receives outstanding
  absl::flat_hash_map<uint64_t, std::shared_ptr<PutState>> puts;
};

struct Counters {
  std::atomic<uint64_t> connections_accepted{0}, connections_rejected{0}, connections_open{0},
      connections_evicted{0}, listener_pauses{0}, capacity_busy_replies{0},
      tenant_busy_replies{0}, hello_rejected{0}, messages_received{0}, malformed_messages{0}, bytes_received{0},
      bytes_sent{0}, busy_replies{0}, checksum_failures{0}, puts_begun{0}, puts_committed{0},
      puts_aborted{0}, puts_timed_out{0}, connections_timed_out{0}, inflight_bytes{0},
      inflight_busy_replies{0}, device_payload_blocks{0}, blocks_into_device{0}, shm_blocks{0},
      shm_gets{0}, link_blocks{0}, link_gets{0};
  std::atomic<uint64_t> rejected[kNumStatusCodes] = {};  // by absl::StatusCode
};

class ServerImpl;

// A reply in flight: the frame and payload live until UCX is done with them.
struct SendContext {
  std::string frame;
  Buffer payload;
};

// A block payload being received by rendezvous.
struct RecvContext {
  ServerImpl* server;
  std::shared_ptr<Connection> conn;
  std::shared_ptr<PutState> put;
  uint64_t request_id;
  wire::Block block;
  Buffer payload;
  std::unique_ptr<UcpMemReg> reg;  // device payloads: registered for the receive
  absl::Status failure;            // set when the receive could not be posted
  bool verified = false;           // its checksums were checked on the copy threads
};

class ServerImpl;
// The descriptor of a link get arriving by rendezvous.
struct LinkGetContext {
  ServerImpl* server;
  std::shared_ptr<Connection> conn;
  uint64_t request_id;
  wire::Get get;
  std::string descriptor;
};

class ServerImpl : public UcxServer {
 public:
  ServerImpl(const ServerOptions& options, RequestHandler* handler)
      : options_(options),
        handler_(handler),
        buffers_(std::make_shared<TenantBudget>(
            options.max_buffered_bytes,
            TenantBudget::ShareOf(options.max_buffered_bytes, options.tenant_share,
                                  options.max_payload_bytes))),
        puts_budget_(options.max_open_puts,
                     TenantBudget::ShareOf(options.max_open_puts, options.tenant_share, 1)),
        conns_budget_(options.max_connections,
                      TenantBudget::ShareOf(options.max_connections, options.tenant_share, 1)) {}
  ~ServerImpl() override { Stop(); }

  absl::Status Init();

  bool cuda_memory() const override { return loop_ != nullptr && loop_->cuda_memory(); }
  uint16_t port() const override { return port_; }
  std::string address() const override { return address_; }
  void Drain() override { draining_.store(true); }
  absl::Status WaitIdle(absl::Duration timeout) override;
  void Stop() override;
  ServerStats stats() const override;

  // ---- loop thread ----
  static void OnConnRequest(ucp_conn_request_h request, void* arg);
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param);
  static void OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data);
  static void OnSendDone(void* request, ucs_status_t status, void* user_data);

 private:
  void AcceptConnection(ucp_conn_request_h request);
  // Closes the oldest connection still waiting for its hello; false when there is none.
  bool EvictOldestPreHello();
  absl::Status Listen();
  void PauseListener(const char* why);
  // Pauses or resumes the listener by the process's free file descriptors.
  void CheckFds();
  // Busy (counted) for a refused reservation.
  void SendRefusal(Connection& conn, uint64_t request_id, TenantBudget::Refusal why);
  void Report(const std::string& line) {
    if (options_.report) {
      options_.report(line);
    } else {
      std::string l = line + "\n";
      ssize_t ignored = write(STDERR_FILENO, l.data(), l.size());
      (void)ignored;
    }
  }
  // A put leaves the open set (committed or aborted).
  void PutEnded(const Connection& conn) {
    open_puts_--;
    puts_budget_.Release(conn.session.tenant, 1);
  }
  void HandleMessage(const std::shared_ptr<Connection>& conn, absl::string_view header,
                     void* data, size_t length, bool rndv);
  void HandleHello(Connection& conn, const wire::Frame& f);
  void HandlePutBegin(const std::shared_ptr<Connection>& conn, const wire::Frame& f);
  void HandleBlock(const std::shared_ptr<Connection>& conn, const wire::Frame& f, void* data,
                   size_t length, bool rndv);
  void HandleCommit(const std::shared_ptr<Connection>& conn, const wire::Frame& f);
  void HandleAbort(const std::shared_ptr<Connection>& conn, const wire::Frame& f);
  void HandleGet(const std::shared_ptr<Connection>& conn, const wire::Frame& f);
  // A link get whose descriptor travels as the frame's data part: received, then GetOverLink.
  void HandleLinkGet(const std::shared_ptr<Connection>& conn, const wire::Frame& f, void* data,
                     size_t length, bool rndv);
  void LinkGetReceived(LinkGetContext* ctx, ucs_status_t status);
  void GetOverLink(const std::shared_ptr<Connection>& conn, uint64_t request_id,
                   const wire::Get& get, std::string descriptor);
  void HandleLookup(const std::shared_ptr<Connection>& conn, const wire::Frame& f);
  void HandleDelete(const std::shared_ptr<Connection>& conn, const wire::Frame& f);
  void BlockReceived(RecvContext* ctx, ucs_status_t status);
  // A received block to the handler's OnBlock (its answer then goes to BlockDone).
  void PassBlock(const std::shared_ptr<Connection>& conn, const std::shared_ptr<PutState>& put,
                 uint64_t request_id, const wire::Block& block, uint64_t bytes, Buffer payload);
  // A link block's transfer is complete (or failed): its memory goes to OnBlock.
  void BlockOverLink(const std::shared_ptr<Connection>& conn,
                     const std::shared_ptr<PutState>& put, uint64_t request_id,
                     const wire::Block& block, uint64_t bytes, absl::StatusOr<Buffer> payload);
  void BlockDone(const std::shared_ptr<Connection>& conn, const std::shared_ptr<PutState>& put,
                 uint64_t request_id, uint64_t bytes, const absl::Status& status);
  void Tick();

  void SendFrame(Connection& conn, std::string frame, Buffer payload = Buffer());
  void SendStatus(Connection& conn, uint64_t request_id, const absl::Status& status);
  // Counts an error the server answers itself (ServerStats::rejected_by_code).
  void CountRejected(const absl::Status& status) {
    const int code = static_cast<int>(status.code());
    if (code > 0 && code < kNumStatusCodes) counters_.rejected[code]++;
  }
  // Answers `status` (an error of the server's own, not the handler's) and counts it.
  void Reject(Connection& conn, uint64_t request_id, const absl::Status& status) {
    CountRejected(status);
    SendStatus(conn, request_id, status);
  }
  // Decodes `f`'s body into `msg`; a malformed body is counted and answered with its status.
  template <typename M>
  bool DecodeOrReject(Connection& conn, const wire::Frame& f, M* msg) {
    if (absl::Status s = wire::Decode(f, msg); !s.ok()) {
      counters_.malformed_messages++;
      Reject(conn, f.header.request_id, s);
      return false;
    }
    return true;
  }
  void SendBusy(Connection& conn, uint64_t request_id);
  void AbortPut(Connection& conn, uint64_t put_id, const absl::Status& reason);
  void CloseConnection(const std::shared_ptr<Connection>& conn, const absl::Status& reason);
  void ReleaseInflight(Connection& conn, uint64_t bytes);
  PutContext MakePutContext(const Connection& conn, const PutState& put) const {
    return PutContext{conn.session, put.begin.put_id, &put.begin, nullptr, put.handle.get()};
  }
  // Posts `fn` to the loop from a handler completion; drops it when the server has stopped.
  template <typename F>
  void PostCompletion(F fn) {
    std::shared_ptr<WorkerLoop> loop = loop_;
    loop->Post(std::move(fn));
  }

  const ServerOptions options_;
  RequestHandler* const handler_;
  // Shared with the buffers it admitted, which may outlive the server.
  const std::shared_ptr<TenantBudget> buffers_;
  TenantBudget puts_budget_;
  TenantBudget conns_budget_;  // connections that said hello, by tenant
  std::shared_ptr<WorkerLoop> loop_;
  std::unique_ptr<ShmAcceptor> shm_;  // null when shared memory is off or unavailable
  // The copy threads (shm_copy_lanes): shared-memory blocks' copies (shm_'s) and received
  // blocks' checksums.
  std::shared_ptr<CopyPool> copy_pool_;
  ucp_listener_h listener_ = nullptr;
  uint64_t accept_hook_ = 0;
  std::atomic<bool> fd_check_posted_{false};
  std::atomic<bool> listener_paused_{false};
  absl::Time listen_not_before_ = absl::InfinitePast();  // after an accept failure
  uint16_t port_ = 0;
  std::string address_;
  std::atomic<bool> draining_{false};
  std::atomic<bool> stopped_{false};
  absl::Mutex stop_mu_;
  Counters counters_;
  std::atomic<uint64_t> open_puts_{0};
  std::atomic<uint64_t> pending_work_{0};

  // Loop-thread state.
  uint64_t next_connection_id_ = 1;
  uint64_t pre_hello_ = 0;  // connections without a successful hello
  absl::flat_hash_map<ucp_ep_h, std::shared_ptr<Connection>> connections_;
  std::vector<void*> closing_requests_;
};

absl::Status ServerImpl::Init() {
  if (handler_ == nullptr) return absl::InvalidArgumentError("UcxServer: handler is null");
  if (options_.max_payload_bytes == 0 || options_.max_inflight_bytes < options_.max_payload_bytes ||
      options_.max_buffered_bytes < options_.max_payload_bytes) {
    return absl::InvalidArgumentError(
        "UcxServer: need 0 < max_payload_bytes <= max_inflight_bytes and max_buffered_bytes");
  }
  if (options_.max_open_puts == 0 || options_.max_connections == 0 ||
      options_.max_pre_hello_connections == 0 || !(options_.tenant_share > 0) ||
      options_.tenant_share > 1) {
    return absl::InvalidArgumentError(
        "UcxServer: max_open_puts, max_connections and max_pre_hello_connections must be > 0 "
        "and tenant_share in (0, 1]");
  }
  // UCX reads the connection manager's settings from the environment only (a context setting
  // is ignored as "invalid configuration"); one already there wins.
  if (options_.reuse_address) setenv("UCX_TCP_CM_REUSEADDR", "y", /*overwrite=*/0);
  CurrentFdUsage();  // opens what counting descriptors needs while there are some
  // How connections are made on a UCX release before 1.14 (ucx.h, UcxOneDeviceSettings): said
  // at start either way; a UCX_ variable or data-plane setting of the user's stands.
  UcxConfig ucx = options_.ucx;
  const UcxVersion release = LocalUcxVersion();
  if (!UcxOneDeviceSettings(release).empty()) {
    const char* env = std::getenv("UCX_CM_USE_ALL_DEVICES");
    auto user = options_.ucx.overrides.find("CM_USE_ALL_DEVICES");
    std::string line;
    if (env != nullptr || user != options_.ucx.overrides.end()) {
      line = absl::StrCat("UCX_CM_USE_ALL_DEVICES=",
                          user != options_.ucx.overrides.end() ? user->second : env,
                          " as set (ucx_interop does not apply)");
    } else if (options_.ucx_interop) {
      for (const auto& [name, value] : UcxOneDeviceSettings(release)) {
        ucx.overrides[name] = value;
      }
      line = "ucx_interop auto: UCX_CM_USE_ALL_DEVICES=n (clients on UCX 1.14 or later connect; "
             "clients of earlier kvcomp releases on UCX before 1.14 do not)";
    } else {
      line = "ucx_interop defaults: UCX's defaults (clients of earlier kvcomp releases on UCX before "
             "1.14 connect; clients on UCX 1.14 or later do not)";
    }
    Report(absl::StrCat("data plane: UCX ", release.ToString(), ": ", line,
                        "; docs/protocol.md, \"UCX releases\""));
  }
  KVCOMP_ASSIGN_OR_RETURN(loop_, WorkerLoop::Create(ucx, options_.poll_spin));

  KVCOMP_RETURN_IF_ERROR(loop_->SetAmHandler(wire::kAmIdRequest, &ServerImpl::OnAm, this));
  copy_pool_ = std::make_shared<CopyPool>(ShmCopyLanes(options_.shm_copy_lanes));
  if (options_.shared_memory) {
    absl::StatusOr<std::unique_ptr<ShmAcceptor>> shm = ShmAcceptor::Start(
        options_.shm_max_region_bytes, [this](const std::string& line) { Report(line); },
        copy_pool_);
    if (shm.ok()) {
      shm_ = *std::move(shm);
    } else {
      Report(absl::StrCat("shared memory not offered: ", shm.status().message()));
    }
  }

  InstallUcxLogLimiter();
  KVCOMP_RETURN_IF_ERROR(Listen());
  address_ = Endpoint{options_.listen_address, port_}.ToString();

  absl::Duration tick = std::min({absl::Milliseconds(100), options_.put_timeout / 4,
                                  options_.idle_timeout / 4, options_.hello_timeout / 4});
  tick = std::max(tick, absl::Milliseconds(5));
  loop_->Start([this] { Tick(); }, tick);
  // UCX's listener retries a failed accept() at once, for as long as the descriptors are short:
  // close it from the loop thread as soon as UCX reports one.
  accept_hook_ = AddAcceptFailureHook([this] {
    if (fd_check_posted_.exchange(true)) return;
    loop_->Post([this] {
      fd_check_posted_.store(false);
      listen_not_before_ = absl::Now() + absl::Seconds(1);
      PauseListener("accept() failed (file descriptors exhausted)");
    });
  });
  return absl::OkStatus();
}

absl::Status ServerImpl::Listen() {
  // Once bound, the listener reopens on the same port (port 0 picked it the first time).
  const uint16_t listen_port = port_ != 0 ? port_ : options_.port;
  addrinfo hints = {};
  hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port_str = absl::StrCat(listen_port);
  if (int rc = getaddrinfo(options_.listen_address.c_str(), port_str.c_str(), &hints, &res);
      rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("UcxServer: listen address \"",
                                                   options_.listen_address,
                                                   "\": ", gai_strerror(rc)));
  }
  if (absl::Status st = CheckAddressFamilySupported(res->ai_family, "UcxServer: listen");
      !st.ok()) {
    freeaddrinfo(res);
    return st;
  }
  if (port_ == 0) {  // the first time only: a resumed listener keeps the address that worked
    if (absl::Status st = CheckListenAddressServesDataLanes(res->ai_addr, "UcxServer: listen");
        !st.ok()) {
      freeaddrinfo(res);
      return st;
    }
  }
  ucp_listener_params_t lp = {};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = res->ai_addr;
  lp.sockaddr.addrlen = res->ai_addrlen;
  lp.conn_handler.cb = &ServerImpl::OnConnRequest;
  lp.conn_handler.arg = this;
  ucs_status_t s = ucp_listener_create(loop_->worker(), &lp, &listener_);
  freeaddrinfo(res);
  if (s != UCS_OK) {
    return UcsStatusToStatus(s, absl::StrCat("UcxServer: listen on ", options_.listen_address,
                                             ":", listen_port));
  }
  if (port_ != 0) return absl::OkStatus();  // listening again on the port it had
  ucp_listener_attr_t la = {};
  la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  s = ucp_listener_query(listener_, &la);
  if (s != UCS_OK) return UcsStatusToStatus(s, "ucp_listener_query");
  const auto* sa = reinterpret_cast<const sockaddr*>(&la.sockaddr);
  if (sa->sa_family == AF_INET) {
    port_ = ntohs(reinterpret_cast<const sockaddr_in*>(sa)->sin_port);
  } else {
    port_ = ntohs(reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port);
  }
  return absl::OkStatus();
}

void ServerImpl::Stop() {
  absl::MutexLock l(&stop_mu_);
  if (stopped_.exchange(true) || loop_ == nullptr) return;
  if (accept_hook_ != 0) RemoveAcceptFailureHook(accept_hook_);
  draining_.store(true);
  loop_->Shutdown([this] {
    if (listener_ != nullptr) {
      ucp_listener_destroy(listener_);
      listener_ = nullptr;
    }
    std::vector<std::shared_ptr<Connection>> conns;
    for (auto& [ep, c] : connections_) conns.push_back(c);
    for (auto& c : conns) CloseConnection(c, absl::UnavailableError("server stopping"));
    loop_->ProgressUntil(
        [this] {
          for (auto it = closing_requests_.begin(); it != closing_requests_.end();) {
            if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
              ucp_request_free(*it);
              it = closing_requests_.erase(it);
            } else {
              ++it;
            }
          }
          return closing_requests_.empty();
        },
        absl::Seconds(2));
  });
  shm_.reset();  // every connection closed: no grant is left to attach to
  if (copy_pool_ != nullptr) copy_pool_->Stop();
}

absl::Status ServerImpl::WaitIdle(absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (open_puts_.load() > 0 || pending_work_.load() > 0) {
    if (absl::Now() >= end) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "UcxServer: %u puts open and %u operations pending after %s", open_puts_.load(),
          pending_work_.load(), absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  return absl::OkStatus();
}

ServerStats ServerImpl::stats() const {
  ServerStats s;
  const Counters& c = counters_;
  s.connections_accepted = c.connections_accepted;
  s.connections_rejected = c.connections_rejected;
  s.connections_open = c.connections_open;
  s.hello_rejected = c.hello_rejected;
  s.messages_received = c.messages_received;
  s.malformed_messages = c.malformed_messages;
  s.bytes_received = c.bytes_received;
  s.bytes_sent = c.bytes_sent;
  s.busy_replies = c.busy_replies;
  s.checksum_failures = c.checksum_failures;
  s.puts_begun = c.puts_begun;
  s.puts_committed = c.puts_committed;
  s.puts_aborted = c.puts_aborted;
  s.puts_timed_out = c.puts_timed_out;
  s.connections_timed_out = c.connections_timed_out;
  s.inflight_bytes = c.inflight_bytes;
  s.inflight_busy_replies = c.inflight_busy_replies;
  s.connections_evicted = c.connections_evicted;
  s.listener_pauses = c.listener_pauses;
  s.listener_paused = listener_paused_.load() ? 1 : 0;
  s.capacity_busy_replies = c.capacity_busy_replies;
  s.tenant_busy_replies = c.tenant_busy_replies;
  s.buffered_bytes = buffers_->used();
  s.cuda_memory = loop_ != nullptr && loop_->cuda_memory() ? 1 : 0;
  s.device_payload_blocks = c.device_payload_blocks;
  s.blocks_into_device = c.blocks_into_device;
  s.shared_memory = shm_ != nullptr ? 1 : 0;
  if (shm_ != nullptr) {
    const ShmAcceptorStats a = shm_->stats();
    s.shm_regions_attached = a.attached;
    s.shm_attach_refused = a.refused;
  }
  s.shm_blocks = c.shm_blocks;
  s.shm_gets = c.shm_gets;
  s.link_blocks = c.link_blocks;
  s.link_gets = c.link_gets;
  for (int i = 0; i < kNumStatusCodes; ++i) s.rejected_by_code[i] = c.rejected[i];
  return s;
}

// ---- connections ----

void ServerImpl::OnConnRequest(ucp_conn_request_h request, void* arg) {
  static_cast<ServerImpl*>(arg)->AcceptConnection(request);
}

void ServerImpl::AcceptConnection(ucp_conn_request_h request) {
  // Endpoints that never say hello must not keep out those that will: the oldest silent one
  // makes room.
  if (pre_hello_ >= options_.max_pre_hello_connections ||
      connections_.size() >= options_.max_connections) {
    EvictOldestPreHello();
  }
  if (draining_.load() || connections_.size() >= options_.max_connections) {
    counters_.connections_rejected++;
    ucp_listener_reject(listener_, request);
    return;
  }
  auto conn = std::make_shared<Connection>();
  ucp_conn_request_attr_t attr = {};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  const bool addressed = ucp_conn_request_query(request, &attr) == UCS_OK;
  if (addressed) {
    conn->session.peer = SockaddrToString(reinterpret_cast<const sockaddr*>(&attr.client_address));
  }
  ucp_ep_params_t ep = {};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = request;
  ep.err_mode =
      options_.ucx.peer_error_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  ep.err_handler.cb = &ServerImpl::OnEpError;
  ep.err_handler.arg = this;
  ucs_status_t s = ucp_ep_create(loop_->worker(), &ep, &conn->ep);
  if (s != UCS_OK) {
    // UCX rejects the request itself (the client learns UCS_ERR_REJECTED). Most often a client
    // on a UCX release whose connection requests this one cannot read (docs/protocol.md, "UCX
    // releases"): said once in a while, not per request.
    if (counters_.connections_rejected++ % 1000 == 0) {
      const auto* from = reinterpret_cast<const sockaddr*>(&attr.client_address);
      Report(absl::StrCat("data plane: a connection request from ",
                          addressed ? SockaddrToString(from) : std::string(),
                          " failed: ", UcsStatusToStatus(s, "ucp_ep_create").message(),
                          " (a client on an incompatible UCX release? UCX ",
                          LocalUcxVersion().ToString(), " here",
                          options_.ucx_interop || UcxOneDeviceSettings(LocalUcxVersion()).empty()
                              ? ""
                              : ", where clients on UCX 1.14 or later connect only with "
                                "ucx_interop auto",
                          "; docs/protocol.md, \"UCX releases\")"));
    }
    return;
  }
  conn->id = next_connection_id_++;
  conn->session.connection_id = conn->id;
  conn->created = conn->last_activity = absl::Now();
  connections_[conn->ep] = conn;
  pre_hello_++;
  counters_.connections_accepted++;
  counters_.connections_open++;
}

bool ServerImpl::EvictOldestPreHello() {
  std::shared_ptr<Connection> oldest;
  for (const auto& [ep, c] : connections_) {
    if (!c->authenticated && (oldest == nullptr || c->id < oldest->id)) oldest = c;
  }
  if (oldest == nullptr) return false;
  counters_.connections_evicted++;
  CloseConnection(oldest, absl::ResourceExhaustedError("closed to admit a newer connection: too "
                                                       "many connections without hello"));
  return true;
}

void ServerImpl::PauseListener(const char* why) {
  if (listener_ == nullptr || stopped_.load()) return;
  ucp_listener_destroy(listener_);
  listener_ = nullptr;
  listener_paused_.store(true);
  counters_.listener_pauses++;
  // Those still waiting for hello hold descriptors and may never speak.
  while (EvictOldestPreHello()) {
  }
  const FdUsage fds = CurrentFdUsage();
  uint64_t suppressed = 0;
  static LogRateLimiter limiter(1, absl::Seconds(10));
  if (limiter.Allow("pause", &suppressed)) {
    Report(absl::StrFormat(
        "data plane: listener closed, new connections refused: %s; %u of %u file descriptors "
        "open (%u earlier pause(s) not reported)",
        why, fds.open, fds.limit, suppressed));
  }
}

void ServerImpl::CheckFds() {
  if (options_.fd_reserve == 0 || stopped_.load()) return;
  const FdUsage fds = CurrentFdUsage();
  if (fds.limit == 0) return;
  if (listener_ != nullptr) {
    if (fds.free() < options_.fd_reserve) PauseListener("few file descriptors left");
    return;
  }
  if (draining_.load() || absl::Now() < listen_not_before_ ||
      fds.free() < uint64_t{2} * options_.fd_reserve) {
    return;
  }
  if (absl::Status s = Listen(); !s.ok()) {
    listen_not_before_ = absl::Now() + absl::Seconds(1);
    return;
  }
  listener_paused_.store(false);
  Report(absl::StrFormat("data plane: listening again on %s (%u of %u file descriptors open)",
                         address_, fds.open, fds.limit));
}

void ServerImpl::OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<ServerImpl*>(arg);
  auto it = self->connections_.find(ep);
  if (it == self->connections_.end()) return;
  std::shared_ptr<Connection> conn = it->second;
  self->CloseConnection(conn, absl::UnavailableError(absl::StrCat(
                                  "client disconnected: UCX: ", ucs_status_string(status))));
}

void ServerImpl::CloseConnection(const std::shared_ptr<Connection>& conn,
                                 const absl::Status& reason) {
  if (conn->closed) return;
  conn->closed = true;
  std::vector<uint64_t> open;
  for (const auto& [id, put] : conn->puts) {
    if (!put->committing) open.push_back(id);
  }
  for (uint64_t id : open) AbortPut(*conn, id, reason);
  conn->puts.clear();
  handler_->OnDisconnect(conn->session);
  if (conn->shm != nullptr) {
    shm_->Withdraw(*conn->shm);
    conn->shm.reset();  // mappings go with the last get still writing into one
  }
  if (conn->authenticated) {
    conns_budget_.Release(conn->session.tenant, 1);
  } else {
    pre_hello_--;
  }
  connections_.erase(conn->ep);
  counters_.connections_open--;
  ucp_request_param_t p = {};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  void* req = ucp_ep_close_nbx(conn->ep, &p);
  if (UCS_PTR_IS_PTR(req)) closing_requests_.push_back(req);
}

void ServerImpl::AbortPut(Connection& conn, uint64_t put_id, const absl::Status& reason) {
  auto it = conn.puts.find(put_id);
  if (it == conn.puts.end()) return;
  std::shared_ptr<PutState> put = it->second;
  conn.puts.erase(it);
  PutEnded(conn);
  counters_.puts_aborted++;
  handler_->OnPutAbort(MakePutContext(conn, *put), reason);
}

void ServerImpl::Tick() {
  CheckFds();
  const absl::Time now = absl::Now();
  std::vector<std::shared_ptr<Connection>> to_close, stalled_conns;
  for (auto& [ep, conn] : connections_) {
    if (!conn->authenticated && now - conn->created > options_.hello_timeout) {
      to_close.push_back(conn);
      continue;
    }
    if (conn->pending_work == 0 && now - conn->last_activity > options_.idle_timeout) {
      to_close.push_back(conn);
      continue;
    }
    std::vector<uint64_t> expired;
    bool stalled = false;
    for (const auto& [id, put] : conn->puts) {
      if (put->committing || now - put->last_activity <= options_.put_timeout) continue;
      if (put->blocks_pending == 0) {
        expired.push_back(id);
      } else if (put->blocks_receiving > 0) {
        // A block's bytes have not come for put_timeout: the peer stalls mid-transfer (stopped,
        // or its network gone without a reset). Only closing the endpoint cancels the receive
        // and gives its buffer back.
        stalled = true;
      }
    }
    if (stalled) {
      counters_.puts_timed_out++;
      stalled_conns.push_back(conn);
      continue;
    }
    for (uint64_t id : expired) {
      counters_.puts_timed_out++;
      AbortPut(*conn, id,
               absl::DeadlineExceededError(absl::StrCat(
                   "put ", id, " timed out: no block or commit for ",
                   absl::FormatDuration(options_.put_timeout))));
    }
  }
  for (auto& conn : to_close) {
    counters_.connections_timed_out++;
    CloseConnection(conn, absl::DeadlineExceededError(
                              conn->authenticated ? "connection idle" : "no hello in time"));
  }
  for (auto& conn : stalled_conns) {
    counters_.connections_timed_out++;
    CloseConnection(conn, absl::DeadlineExceededError(absl::StrCat(
                              "a block's bytes did not arrive for ",
                              absl::FormatDuration(options_.put_timeout), ": the peer stalled")));
  }
  for (auto it = closing_requests_.begin(); it != closing_requests_.end();) {
    if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
      ucp_request_free(*it);
      it = closing_requests_.erase(it);
    } else {
      ++it;
    }
  }
}

// ---- sending ----

void ServerImpl::OnSendDone(void* request, ucs_status_t status, void* user_data) {
  delete static_cast<SendContext*>(user_data);
  ucp_request_free(request);
}

void ServerImpl::SendFrame(Connection& conn, std::string frame, Buffer payload) {
  if (conn.closed) return;
  auto* ctx = new SendContext{std::move(frame), std::move(payload)};
  ucp_request_param_t p = {};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &ServerImpl::OnSendDone;
  p.user_data = ctx;
  if (ctx->payload.memory_type() == MemoryType::kCuda) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    p.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  counters_.bytes_sent += ctx->payload.size();
  void* req = ucp_am_send_nbx(conn.ep, wire::kAmIdReply, ctx->frame.data(), ctx->frame.size(),
                              ctx->payload.data(), ctx->payload.size(), &p);
  if (!UCS_PTR_IS_PTR(req)) delete ctx;  // done at once, or failed (the ep error handler runs)
}

void ServerImpl::SendStatus(Connection& conn, uint64_t request_id, const absl::Status& status) {
  if (IsBusy(status)) {
    SendBusy(conn, request_id);
    return;
  }
  wire::StatusReply reply = wire::StatusReply::FromStatus(status);
  if (!conn.error_details) reply.detail = 0;  // an older client reads no detail
  SendFrame(conn, wire::Encode(request_id, reply));
}

void ServerImpl::SendBusy(Connection& conn, uint64_t request_id) {
  counters_.busy_replies++;
  wire::Busy b;
  b.retry_after_us = options_.busy_retry_after_us;
  b.inflight_bytes = conn.inflight_bytes;
  b.limit_bytes = options_.max_inflight_bytes;
  SendFrame(conn, wire::Encode(request_id, b));
}

void ServerImpl::SendRefusal(Connection& conn, uint64_t request_id, TenantBudget::Refusal why) {
  if (why == TenantBudget::Refusal::kTenant) {
    counters_.tenant_busy_replies++;
  } else {
    counters_.capacity_busy_replies++;
  }
  SendBusy(conn, request_id);
}

// ---- receiving ----

ucs_status_t ServerImpl::OnAm(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<ServerImpl*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  std::shared_ptr<Connection> conn;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) {
    auto it = self->connections_.find(param->reply_ep);
    if (it != self->connections_.end()) conn = it->second;
  }
  if (conn == nullptr || conn->closed) {
    if (rndv) DropRendezvous(self->loop_->worker(), data);
    return UCS_OK;
  }
  self->HandleMessage(conn, absl::string_view(static_cast<const char*>(header), header_length),
                      data, length, rndv);
  return UCS_OK;
}

void ServerImpl::HandleMessage(const std::shared_ptr<Connection>& conn, absl::string_view header,
                               void* data, size_t length, bool rndv) {
  counters_.messages_received++;
  conn->last_activity = absl::Now();
  absl::StatusOr<wire::Frame> f = wire::ParseFrame(header, length);
  if (!f.ok()) {
    counters_.malformed_messages++;
    if (rndv) DropRendezvous(loop_->worker(), data);
    Reject(*conn, wire::PeekRequestId(header), f.status());
    return;
  }
  const wire::MessageType type = f->header.type;
  if (type == wire::MessageType::kBlock) {
    HandleBlock(conn, *f, data, length, rndv);  // owns the rendezvous descriptor
    return;
  }
  if (type == wire::MessageType::kGet && length > 0 && conn->authenticated) {
    HandleLinkGet(conn, *f, data, length, rndv);  // owns the rendezvous descriptor
    return;
  }
  if (rndv) DropRendezvous(loop_->worker(), data);
  if (length > 0) {
    counters_.malformed_messages++;
    Reject(*conn, f->header.request_id,
           absl::InvalidArgumentError(
               absl::StrCat("protocol: ", wire::MessageTypeName(type), " carries no payload")));
    return;
  }
  if (type == wire::MessageType::kHello) {
    HandleHello(*conn, *f);
    return;
  }
  if (!conn->authenticated) {
    Reject(*conn, f->header.request_id,
           absl::UnauthenticatedError("hello with valid credentials required first"));
    return;
  }
  switch (type) {
    case wire::MessageType::kPutBegin:
      HandlePutBegin(conn, *f);
      break;
    case wire::MessageType::kPutCommit:
      HandleCommit(conn, *f);
      break;
    case wire::MessageType::kPutAbort:
      HandleAbort(conn, *f);
      break;
    case wire::MessageType::kGet:
      HandleGet(conn, *f);
      break;
    case wire::MessageType::kLookup:
      HandleLookup(conn, *f);
      break;
    case wire::MessageType::kDelete:
      HandleDelete(conn, *f);
      break;
    case wire::MessageType::kPing: {
      wire::Ping ping;
      absl::Status s = wire::Decode(*f, &ping);
      if (!s.ok()) {
        counters_.malformed_messages++;
        CountRejected(s);
      }
      SendStatus(*conn, f->header.request_id, s);
      break;
    }
    default:
      counters_.malformed_messages++;
      Reject(*conn, f->header.request_id,
             absl::InvalidArgumentError(
                 absl::StrCat("protocol: a client may not send ", wire::MessageTypeName(type))));
      break;
  }
}

void ServerImpl::HandleHello(Connection& conn, const wire::Frame& f) {
  wire::Hello hello;
  if (!DecodeOrReject(conn, f, &hello)) return;
  if (conn.authenticated) {
    Reject(conn, f.header.request_id,
           absl::FailedPreconditionError("hello: connection already authenticated"));
    return;
  }
  absl::StatusOr<std::string> tenant = handler_->OnHello(conn.session, hello);
  if (!tenant.ok()) {
    counters_.hello_rejected++;
    SendStatus(conn, f.header.request_id, tenant.status());
    return;
  }
  if (conns_budget_.TryReserve(*tenant, 1) != TenantBudget::Refusal::kNone) {
    counters_.hello_rejected++;
    Reject(conn, f.header.request_id,
           absl::ResourceExhaustedError(absl::StrFormat(
               "tenant '%s' has its share of connections open (%u)", *tenant,
               conns_budget_.tenant_limit())));
    return;
  }
  pre_hello_--;
  conn.authenticated = true;
  conn.session.tenant = *tenant;
  wire::HelloOk ok;
  ok.max_payload_bytes = options_.max_payload_bytes;
  ok.max_inflight_bytes = options_.max_inflight_bytes;
  ok.tenant = *tenant;
  ok.server_name = options_.server_name;
  // Only a client of minor >= 1 reads server_flags (an older one checks the byte is zero).
  conn.device_payloads = f.header.minor >= 1 && loop_->cuda_memory();
  conn.error_details = f.header.minor >= 4;
  if (conn.device_payloads) ok.server_flags |= wire::kServerCudaMemory;
  // Shared memory only for a client of minor >= 2 (an older one could not read the fields).
  if (f.header.minor >= 2 && shm_ != nullptr) {
    conn.shm = shm_->Enroll();
    ok.server_flags |= wire::kServerSharedMemory;
    ok.shm_socket = shm_->name();
    ok.shm_token = conn.shm->token();
    ok.shm_max_region_bytes = shm_->max_region_bytes();
  }
  // The UCX release, for a client of minor >= 3 (an older one checks the bytes are zero): a
  // client on another UCX release sets what the pair needs (ucx.h, UcxInteropSettings).
  if (f.header.minor >= 3) {
    const UcxVersion v = LocalUcxVersion();
    ok.ucx_major = v.major;
    ok.ucx_minor = v.minor;
    ok.ucx_release = v.release;
  }
  SendFrame(conn, wire::Encode(f.header.request_id, ok));
}

void ServerImpl::HandlePutBegin(const std::shared_ptr<Connection>& conn, const wire::Frame& f) {
  auto put = std::make_shared<PutState>();
  if (!DecodeOrReject(*conn, f, &put->begin)) return;
  if (draining_.load()) {
    Reject(*conn, f.header.request_id, absl::UnavailableError("server draining: no new puts"));
    return;
  }
  const uint64_t id = put->begin.put_id;
  if (conn->puts.contains(id)) {
    Reject(*conn, f.header.request_id,
           absl::AlreadyExistsError(absl::StrCat("put ", id, " is already open")));
    return;
  }
  put->last_activity = absl::Now();
  if (auto why = puts_budget_.TryReserve(conn->session.tenant, 1);
      why != TenantBudget::Refusal::kNone) {
    SendRefusal(*conn, f.header.request_id, why);
    return;
  }
  PutContext begin_ctx = MakePutContext(*conn, *put);
  begin_ctx.attach = &put->handle;
  if (absl::Status s = handler_->OnPutBegin(begin_ctx); !s.ok()) {
    put->handle.reset();
    puts_budget_.Release(conn->session.tenant, 1);
    SendStatus(*conn, f.header.request_id, s);
    return;
  }
  conn->puts[id] = put;
  open_puts_++;
  counters_.puts_begun++;
  SendStatus(*conn, f.header.request_id, absl::OkStatus());
}

void ServerImpl::HandleBlock(const std::shared_ptr<Connection>& conn, const wire::Frame& f,
                             void* data, size_t length, bool rndv) {
  wire::Block block;
  absl::Status s = wire::Decode(f, &block);
  std::shared_ptr<PutState> put;
  std::shared_ptr<ShmMapping> shared;  // the put region a shared-memory block lies in
  if (s.ok() && !conn->authenticated) {
    s = absl::UnauthenticatedError("hello with valid credentials required first");
  }
  if (s.ok()) {
    auto it = conn->puts.find(block.put_id);
    if (it == conn->puts.end()) {
      s = absl::NotFoundError(absl::StrCat("block for put ", block.put_id,
                                           ", which is not open (never begun, committed, "
                                           "aborted or timed out)"));
    } else if (it->second->committing) {
      s = absl::FailedPreconditionError(absl::StrCat("put ", block.put_id, " is committing"));
    } else {
      put = it->second;
      s = block.ValidateAgainst(put->begin.layout, put->begin.num_tokens);
    }
    if (s.ok() && (block.flags & wire::kBlockSharedMemory)) {
      // The payload's place in this connection's own put region, checked before anything is
      // admitted; it is copied into the block's buffer below.
      shared = conn->shm != nullptr ? conn->shm->Region(kShmPutRegion) : nullptr;
      if (shared == nullptr) {
        s = absl::FailedPreconditionError(
            conn->shm == nullptr
                ? "shared-memory block on a connection without shared memory (not offered at "
                  "hello)"
                : "shared-memory block, but the connection attached no put region");
      } else {
        s = CheckShmRange(block.shm_offset, block.payload_bytes(), shared->size(),
                          "shared-memory block");
        if (s.ok()) s = shared->Intact();
      }
    }
    if (s.ok() && (block.flags & wire::kBlockPeerMemory)) {
      // Read from the client's own memory below (one copy), once the block is admitted.
      if (conn->shm == nullptr || !conn->shm->has_peer()) {
        s = absl::FailedPreconditionError(
            "peer-memory block on a connection whose peer is not registered");
      }
    }
    if (s.ok() && (block.flags & wire::kBlockDevicePayload) && !conn->device_payloads) {
      s = absl::FailedPreconditionError(
          loop_->cuda_memory()
              ? "device payload on a connection whose hello did not negotiate device payloads "
                "(protocol minor 0)"
              : "device payload, but this server's UCX has no CUDA memory support: send host "
                "memory with its CRC32C");
    }
  } else {
    counters_.malformed_messages++;
  }
  // A link block's K and V are the link's to bound (the GPU channel's transfer limit); its
  // frame carries the descriptor only.
  const bool link = s.ok() && (block.flags & wire::kBlockLinkPayload) != 0;
  if (s.ok() && !link && block.payload_bytes() > options_.max_payload_bytes) {
    s = absl::InvalidArgumentError(absl::StrFormat(
        "block of %u bytes exceeds the server's limit of %u", block.payload_bytes(),
        options_.max_payload_bytes));
  }
  if (!s.ok()) {
    if (rndv) DropRendezvous(loop_->worker(), data);
    Reject(*conn, f.header.request_id, s);
    return;
  }
  put->last_activity = absl::Now();
  // What travels in this frame: admitted, buffered and counted in flight (a link block's K and
  // V are in the link's memory).
  const uint64_t bytes = link ? block.wire_bytes() : block.payload_bytes();
  if (conn->inflight_bytes + bytes > options_.max_inflight_bytes) {
    if (rndv) DropRendezvous(loop_->worker(), data);
    counters_.inflight_busy_replies++;
    SendBusy(*conn, f.header.request_id);
    return;
  }
  // Admitted before any memory is taken for it; the reservation goes with the buffer.
  const std::string& tenant = conn->session.tenant;
  if (auto why = buffers_->TryReserve(tenant, bytes); why != TenantBudget::Refusal::kNone) {
    if (rndv) DropRendezvous(loop_->worker(), data);
    SendRefusal(*conn, f.header.request_id, why);
    return;
  }
  const PutContext pctx = MakePutContext(*conn, *put);
  // An eager payload is already in host memory: it is copied into host memory.
  absl::StatusOr<Buffer> buf = rndv && !link ? handler_->AllocateBlock(pctx, block, bytes)
                                             : absl::StatusOr<Buffer>(Buffer::Allocate(bytes));
  if (buf.ok()) {
    Buffer raw = *std::move(buf);
    void* const raw_data = raw.data();
    const size_t raw_size = raw.size();
    const MemoryType raw_type = raw.memory_type();
    buf = Buffer::Wrap(raw_data, raw_size, raw_type,
                       [raw = std::move(raw), budget = buffers_, tenant, bytes]() mutable {
                         raw.Reset();
                         budget->Release(tenant, bytes);
                       });
  } else {
    buffers_->Release(tenant, bytes);
  }
  if (buf.ok() && buf->size() < bytes) {
    buf = absl::InternalError("AllocateBlock returned a buffer that is too small");
  } else if (buf.ok() && buf->memory_type() == MemoryType::kCuda && !loop_->cuda_memory()) {
    buf = absl::FailedPreconditionError(
        "AllocateBlock returned CUDA memory, but this UCX build is not CUDA-aware");
  }
  if (!buf.ok()) {
    if (rndv) DropRendezvous(loop_->worker(), data);
    Reject(*conn, f.header.request_id, buf.status());
    return;
  }
  conn->inflight_bytes += bytes;
  counters_.inflight_bytes += bytes;
  conn->pending_work++;
  pending_work_++;
  put->blocks_pending++;
  auto* ctx = new RecvContext{this, conn, put, f.header.request_id, block, *std::move(buf)};
  put->blocks_receiving++;
  if (shared != nullptr || (block.flags & wire::kBlockPeerMemory)) {
    // Copied out of the client's memory on the shared-memory copy threads, several blocks at
    // once, while this thread serves on; received here afterwards. The region's mapping and the
    // peer's grant stay alive until the copy is done. The client may still write its region:
    // what is copied is what the put gets.
    std::shared_ptr<ShmGrant> grant = conn->shm;
    std::shared_ptr<WorkerLoop> loop = loop_;
    shm_->RunCopy([this, loop, ctx, shared = std::move(shared), grant = std::move(grant)] {
      absl::Status read;
      const wire::Block& b = ctx->block;
      if (shared != nullptr) {
        std::memcpy(ctx->payload.data(), shared->data() + b.shm_offset, b.payload_bytes());
      } else {
        read = grant->ReadPeer(b.shm_offset, ctx->payload.data(), b.key_bytes);
        if (read.ok()) {
          read = grant->ReadPeer(b.peer_values, ctx->payload.bytes() + b.key_bytes,
                                 b.value_bytes);
        }
      }
      loop->Post([this, ctx, read = std::move(read)] {
        if (read.ok()) {
          counters_.shm_blocks++;
        } else {
          ctx->failure = read;
        }
        BlockReceived(ctx, read.ok() ? UCS_OK : UCS_ERR_INVALID_PARAM);
      });
    });
    return;
  }
  if (!rndv) {
    if (bytes > 0) std::memcpy(ctx->payload.data(), data, bytes);
    BlockReceived(ctx, UCS_OK);
    return;
  }
  ucp_request_param_t p = {};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = &ServerImpl::OnRecvDone;
  p.user_data = ctx;
  if (ctx->payload.memory_type() == MemoryType::kCuda) {
    // Registered as CUDA memory for this receive (the rendezvous lands in it directly).
    absl::Status bound = BindDeviceContext(ctx->payload.data());
    absl::StatusOr<std::unique_ptr<UcpMemReg>> reg =
        !bound.ok() ? absl::StatusOr<std::unique_ptr<UcpMemReg>>(bound) : UcpMemReg::Map(
        loop_->context(), ctx->payload.data(), bytes, UCS_MEMORY_TYPE_CUDA);
    if (!reg.ok()) {
      DropRendezvous(loop_->worker(), data);
      ctx->failure = Annotate(reg.status(), "block into device memory");
      BlockReceived(ctx, UCS_ERR_INVALID_PARAM);
      return;
    }
    ctx->reg = *std::move(reg);
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FIELD_MEMH;
    p.memory_type = UCS_MEMORY_TYPE_CUDA;
    p.memh = ctx->reg->get();
  }
  void* req = ucp_am_recv_data_nbx(loop_->worker(), data, ctx->payload.data(), bytes, &p);
  if (req == nullptr) {
    BlockReceived(ctx, UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    BlockReceived(ctx, UCS_PTR_STATUS(req));
  }
}

void ServerImpl::OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data) {
  auto* ctx = static_cast<RecvContext*>(user_data);
  ctx->server->BlockReceived(ctx, status);
  ucp_request_free(request);
}

void ServerImpl::BlockReceived(RecvContext* raw, ucs_status_t status) {
  if (status == UCS_OK && raw->failure.ok() && !raw->verified && options_.verify_checksums &&
      (raw->block.flags & (wire::kBlockDevicePayload | wire::kBlockSharedMemory |
                           wire::kBlockPeerMemory | wire::kBlockLinkPayload)) == 0 &&
      raw->payload.memory_type() == MemoryType::kHost &&
      copy_pool_ != nullptr) {
    // The checksums on a copy thread, several blocks at once, while this thread receives the
    // next ones; back here with the outcome.
    raw->verified = true;
    std::shared_ptr<WorkerLoop> loop = loop_;
    copy_pool_->Run([this, loop, raw] {
      const wire::Block& b = raw->block;
      const uint8_t* p = raw->payload.bytes();
      absl::Status s;
      if ((b.parts & wire::kPartKeys) && Crc32c(p, b.key_bytes) != b.key_crc) {
        s = absl::DataLossError(
            absl::StrCat("block of put ", b.put_id, ": key checksum mismatch"));
      } else if ((b.parts & wire::kPartValues) &&
                 Crc32c(p + b.key_bytes, b.value_bytes) != b.value_crc) {
        s = absl::DataLossError(
            absl::StrCat("block of put ", b.put_id, ": value checksum mismatch"));
      }
      loop->Post([this, raw, s = std::move(s)] {
        if (!s.ok()) {
          counters_.checksum_failures++;
          raw->failure = s;
        }
        BlockReceived(raw, UCS_OK);
      });
    });
    return;
  }
  std::unique_ptr<RecvContext> ctx(raw);
  ctx->put->blocks_receiving--;
  const bool link = (ctx->block.flags & wire::kBlockLinkPayload) != 0;
  const uint64_t bytes = link ? ctx->block.wire_bytes() : ctx->block.payload_bytes();
  Connection& conn = *ctx->conn;
  absl::Status s = !ctx->failure.ok() ? ctx->failure : UcsStatusToStatus(status, "block receive");
  const bool device_payload = (ctx->block.flags & wire::kBlockDevicePayload) != 0;
  const bool shared_payload =
      (ctx->block.flags & (wire::kBlockSharedMemory | wire::kBlockPeerMemory)) != 0;
  if (s.ok() && device_payload) counters_.device_payload_blocks++;
  if (s.ok() && ctx->payload.memory_type() == MemoryType::kCuda) counters_.blocks_into_device++;
  if (s.ok() && options_.verify_checksums && !ctx->verified && !device_payload &&
      !shared_payload && !link && ctx->payload.memory_type() == MemoryType::kHost) {
    const wire::Block& b = ctx->block;
    const uint8_t* p = ctx->payload.bytes();
    if ((b.parts & wire::kPartKeys) && Crc32c(p, b.key_bytes) != b.key_crc) {
      s = absl::DataLossError(absl::StrCat("block of put ", b.put_id, ": key checksum mismatch"));
    } else if ((b.parts & wire::kPartValues) &&
               Crc32c(p + b.key_bytes, b.value_bytes) != b.value_crc) {
      s = absl::DataLossError(
          absl::StrCat("block of put ", b.put_id, ": value checksum mismatch"));
    }
    if (!s.ok()) counters_.checksum_failures++;
  }
  // The put may have been aborted (timeout, abort, disconnect) while the bytes arrived.
  auto it = conn.puts.find(ctx->block.put_id);
  if (s.ok() && (conn.closed || it == conn.puts.end() || it->second != ctx->put)) {
    s = absl::NotFoundError(absl::StrCat("put ", ctx->block.put_id, " ended during the block"));
  }
  if (!s.ok()) {
    CountRejected(s);
    BlockDone(ctx->conn, ctx->put, ctx->request_id, bytes, s);
    return;
  }
  if (link) {
    // The descriptor is here: the handler posts the link's receive; its memory, once the
    // transfer is complete, is the block's payload (BlockOverLink, on this thread).
    std::shared_ptr<WorkerLoop> loop = loop_;
    LinkReceived received = [this, loop, conn = ctx->conn, put = ctx->put,
                             rid = ctx->request_id, block = ctx->block,
                             bytes](absl::StatusOr<Buffer> payload) mutable {
      loop->Post([this, conn = std::move(conn), put = std::move(put), rid, block, bytes,
                  payload = std::move(payload)]() mutable {
        BlockOverLink(conn, put, rid, block, bytes, std::move(payload));
      });
    };
    handler_->ReceiveOverLink(MakePutContext(conn, *ctx->put), ctx->block,
                              std::move(ctx->payload), std::move(received));
    return;
  }
  counters_.bytes_received += bytes;
  PassBlock(ctx->conn, ctx->put, ctx->request_id, ctx->block, bytes, std::move(ctx->payload));
}

void ServerImpl::PassBlock(const std::shared_ptr<Connection>& conn,
                           const std::shared_ptr<PutState>& put, uint64_t request_id,
                           const wire::Block& block, uint64_t bytes, Buffer payload) {
  std::shared_ptr<WorkerLoop> loop = loop_;
  Done done = [this, loop, conn, put, rid = request_id, bytes](absl::Status st) mutable {
    loop->Post([this, conn = std::move(conn), put = std::move(put), rid, bytes,
                st = std::move(st)] { BlockDone(conn, put, rid, bytes, st); });
  };
  handler_->OnBlock(MakePutContext(*conn, *put), block, std::move(payload), std::move(done));
}

void ServerImpl::BlockOverLink(const std::shared_ptr<Connection>& conn,
                               const std::shared_ptr<PutState>& put, uint64_t request_id,
                               const wire::Block& block, uint64_t bytes,
                               absl::StatusOr<Buffer> payload) {
  absl::Status s = payload.status();
  if (s.ok() && payload->size() < block.payload_bytes()) {
    s = absl::InternalError("the link's memory is smaller than the block");
  }
  // The put may have ended (timeout, abort, disconnect) while the link moved the bytes.
  auto it = conn->puts.find(block.put_id);
  if (s.ok() && (conn->closed || it == conn->puts.end() || it->second != put)) {
    s = absl::NotFoundError(absl::StrCat("put ", block.put_id, " ended during the block"));
  }
  if (!s.ok()) {
    CountRejected(s);
    BlockDone(conn, put, request_id, bytes, s);
    return;
  }
  counters_.link_blocks++;
  counters_.bytes_received += block.payload_bytes();
  PassBlock(conn, put, request_id, block, bytes, *std::move(payload));
}

void ServerImpl::BlockDone(const std::shared_ptr<Connection>& conn,
                           const std::shared_ptr<PutState>& put, uint64_t request_id,
                           uint64_t bytes, const absl::Status& status) {
  ReleaseInflight(*conn, bytes);
  put->blocks_pending--;
  put->last_activity = absl::Now();
  if (status.ok()) put->blocks_acked++;
  SendStatus(*conn, request_id, status);
}

void ServerImpl::ReleaseInflight(Connection& conn, uint64_t bytes) {
  conn.inflight_bytes -= bytes;
  counters_.inflight_bytes -= bytes;
  conn.pending_work--;
  pending_work_--;
}

void ServerImpl::HandleCommit(const std::shared_ptr<Connection>& conn, const wire::Frame& f) {
  wire::PutCommit commit;
  if (!DecodeOrReject(*conn, f, &commit)) return;
  auto it = conn->puts.find(commit.put_id);
  if (it == conn->puts.end()) {
    Reject(
        *conn, f.header.request_id,
        absl::NotFoundError(absl::StrCat("commit of put ", commit.put_id, ", which is not open")));
    return;
  }
  std::shared_ptr<PutState> put = it->second;
  if (put->committing) {
    Reject(*conn, f.header.request_id,
           absl::FailedPreconditionError(
               absl::StrCat("put ", commit.put_id, " is already committing")));
    return;
  }
  if (put->blocks_pending > 0 || put->blocks_acked != commit.num_blocks) {
    Reject(*conn, f.header.request_id,
           absl::FailedPreconditionError(absl::StrFormat(
               "commit of put %u after %u blocks, but the server acknowledged %u and has %u "
               "in flight",
               commit.put_id, commit.num_blocks, put->blocks_acked, put->blocks_pending)));
    return;
  }
  put->committing = true;
  put->last_activity = absl::Now();
  conn->pending_work++;
  pending_work_++;
  std::shared_ptr<WorkerLoop> loop = loop_;
  const uint64_t rid = f.header.request_id;
  CommitDone done = [this, loop, conn, put, rid](absl::StatusOr<wire::CacheSummary> r) mutable {
    loop->Post([this, conn = std::move(conn), put = std::move(put), rid, r = std::move(r)] {
      conn->pending_work--;
      pending_work_--;
      put->committing = false;
      const uint64_t id = put->begin.put_id;
      auto pit = conn->puts.find(id);
      const bool still_open = pit != conn->puts.end() && pit->second == put;
      if (r.ok()) {
        counters_.puts_committed++;
        if (still_open) conn->puts.erase(pit);
        PutEnded(*conn);
        SendFrame(*conn, wire::Encode(rid, *r));
        return;
      }
      if (IsBusy(r.status()) && still_open) {
        SendStatus(*conn, rid, r.status());  // the client may commit again
        return;
      }
      if (still_open) {
        AbortPut(*conn, id, r.status());
      } else {
        // Closed while committing: CloseConnection left this put to us.
        PutEnded(*conn);
        counters_.puts_aborted++;
        handler_->OnPutAbort(MakePutContext(*conn, *put), r.status());
      }
      SendStatus(*conn, rid, r.status());
    });
  };
  handler_->OnPutCommit(MakePutContext(*conn, *put), std::move(done));
}

void ServerImpl::HandleAbort(const std::shared_ptr<Connection>& conn, const wire::Frame& f) {
  wire::PutAbort abort;
  if (!DecodeOrReject(*conn, f, &abort)) return;
  auto it = conn->puts.find(abort.put_id);
  if (it == conn->puts.end()) {
    Reject(*conn, f.header.request_id,
           absl::NotFoundError(absl::StrCat("abort of put ", abort.put_id, ", which is not open")));
    return;
  }
  if (it->second->committing) {
    Reject(*conn, f.header.request_id,
           absl::FailedPreconditionError(absl::StrCat("put ", abort.put_id, " is committing")));
    return;
  }
  AbortPut(*conn, abort.put_id, absl::CancelledError("put aborted by the client"));
  SendStatus(*conn, f.header.request_id, absl::OkStatus());
}

void ServerImpl::HandleLinkGet(const std::shared_ptr<Connection>& conn, const wire::Frame& f,
                               void* data, size_t length, bool rndv) {
  wire::Get get;
  if (!DecodeOrReject(*conn, f, &get)) {  // a data part only with a link get's descriptor
    if (rndv) DropRendezvous(loop_->worker(), data);
    return;
  }
  if (!rndv) {
    GetOverLink(conn, f.header.request_id, get,
                std::string(static_cast<const char*>(data), length));
    return;
  }
  auto* ctx = new LinkGetContext{this, conn, f.header.request_id, get, std::string(length, '\0')};
  conn->pending_work++;
  pending_work_++;
  ucp_request_param_t p = {};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user_data) {
    auto* c = static_cast<LinkGetContext*>(user_data);
    c->server->LinkGetReceived(c, status);
    ucp_request_free(request);
  };
  p.user_data = ctx;
  void* req = ucp_am_recv_data_nbx(loop_->worker(), data, ctx->descriptor.data(), length, &p);
  if (req == nullptr) {
    LinkGetReceived(ctx, UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    LinkGetReceived(ctx, UCS_PTR_STATUS(req));
  }
}

void ServerImpl::LinkGetReceived(LinkGetContext* raw, ucs_status_t status) {
  std::unique_ptr<LinkGetContext> ctx(raw);
  ctx->conn->pending_work--;
  pending_work_--;
  absl::Status s = UcsStatusToStatus(status, "link get descriptor receive");
  if (ctx->conn->closed) return;
  if (!s.ok()) {
    Reject(*ctx->conn, ctx->request_id, s);
    return;
  }
  GetOverLink(ctx->conn, ctx->request_id, ctx->get, std::move(ctx->descriptor));
}

void ServerImpl::GetOverLink(const std::shared_ptr<Connection>& conn, uint64_t request_id,
                             const wire::Get& get, std::string descriptor) {
  conn->pending_work++;
  pending_work_++;
  std::shared_ptr<WorkerLoop> loop = loop_;
  LinkSent sent = [this, loop, conn, rid = request_id](absl::StatusOr<wire::GetReply> r) mutable {
    loop->Post([this, conn = std::move(conn), rid, r = std::move(r)]() mutable {
      conn->pending_work--;
      pending_work_--;
      if (!r.ok()) {
        SendStatus(*conn, rid, r.status());
        return;
      }
      r->link = true;
      r->shared = false;
      r->has_crc = false;
      r->payload_crc = 0;
      counters_.link_gets++;
      counters_.bytes_sent += r->link_payload_bytes;
      SendFrame(*conn, wire::Encode(rid, *r, 0));
    });
  };
  handler_->SendOverLink(conn->session, get, std::move(descriptor), std::move(sent));
}

void ServerImpl::HandleGet(const std::shared_ptr<Connection>& conn, const wire::Frame& f) {
  wire::Get get;
  if (!DecodeOrReject(*conn, f, &get)) return;
  if (get.link_channel != 0) {
    GetOverLink(conn, f.header.request_id, get, "");
    return;
  }
  // A shared-memory get: the connection's own get region, the range checked now.
  std::shared_ptr<ShmMapping> region;
  std::shared_ptr<ShmGrant> peer;  // direct: the connection's registered peer
  if (get.direct) {
    if (conn->shm == nullptr || !conn->shm->has_peer()) {
      Reject(*conn, f.header.request_id,
             absl::FailedPreconditionError(
                 "direct get on a connection whose peer is not registered"));
      return;
    }
    if (get.shm_offset + get.shm_capacity < get.shm_offset) {
      Reject(*conn, f.header.request_id,
             absl::InvalidArgumentError("direct get: the destination wraps around"));
      return;
    }
    peer = conn->shm;
  }
  if (get.shared) {
    region = conn->shm != nullptr ? conn->shm->Region(kShmGetRegion) : nullptr;
    absl::Status s = region == nullptr
                         ? absl::FailedPreconditionError(
                               conn->shm == nullptr
                                   ? "shared-memory get on a connection without shared memory"
                                   : "shared-memory get, but the connection attached no get "
                                     "region")
                         : CheckShmRange(get.shm_offset, get.shm_capacity, region->size(),
                                         "shared-memory get");
    if (!s.ok()) {
      Reject(*conn, f.header.request_id, s);
      return;
    }
  }
  conn->pending_work++;
  pending_work_++;
  std::shared_ptr<WorkerLoop> loop = loop_;
  const uint64_t rid = f.header.request_id;
  GetDone done = [this, loop, conn, rid, region = std::move(region), peer = std::move(peer),
                  offset = get.shm_offset, capacity = get.shm_capacity,
                  or_payload = get.or_payload](absl::StatusOr<GetResult> r) mutable {
    // The checksum of a large cache (or its copy into shared memory) takes a while: done here,
    // on the completing thread, not on the progress thread that serves every connection.
    uint32_t crc = 0;
    const bool host = r.ok() && r->bytes.memory_type() == MemoryType::kHost;
    uint64_t shared_bytes = 0;
    bool shared = false;
    // A cache larger than the caller's shared room goes back as the reply's payload when the
    // get allows it (or_payload), in this same request.
    if (host && (peer != nullptr || region != nullptr) && or_payload &&
        r->bytes.size() > capacity) {
      peer.reset();
      region.reset();
    }
    if (host && peer != nullptr) {
      // Straight into the caller's memory in the client's process: one copy.
      const uint64_t n = r->bytes.size();
      if (n > capacity) {
        r = absl::OutOfRangeError(absl::StrFormat(
            "cache of %u bytes does not fit the %u-byte buffer", n, capacity));
      } else if (absl::Status w = peer->WritePeer(offset, r->bytes.data(), n,
                                                  ShmCopyLanes(options_.shm_copy_lanes));
                 !w.ok()) {
        r = w;
      } else {
        shared = true;
        shared_bytes = n;
        r->bytes.Reset();
      }
      peer.reset();
    } else if (host && region != nullptr) {
      const uint64_t n = r->bytes.size();
      absl::Status intact;
      if (n > capacity) {
        r = absl::OutOfRangeError(absl::StrFormat(
            "cache of %u bytes does not fit the %u-byte shared get region", n, capacity));
      } else if (intact = region->Intact(); !intact.ok()) {
        r = intact;
      } else {
        // Progress for a client copying behind: the request, then the bytes in place.
        ShmProgress* progress = offset >= sizeof(ShmProgress)
                                    ? reinterpret_cast<ShmProgress*>(region->data())
                                    : nullptr;
        if (progress != nullptr) {
          progress->written.store(0, std::memory_order_relaxed);
          progress->total.store(n, std::memory_order_relaxed);
          progress->request_id.store(rid, std::memory_order_release);
        }
        uint8_t* to = region->data() + offset;
        for (uint64_t done = 0; done < n;) {
          const uint64_t c = std::min<uint64_t>(n - done, uint64_t{4} << 20);
          std::memcpy(to + done, r->bytes.bytes() + done, c);
          done += c;
          if (progress != nullptr) progress->written.store(done, std::memory_order_release);
        }
        shared = true;
        shared_bytes = n;
        r->bytes.Reset();  // the stored bytes are not needed past the copy
      }
      region.reset();
    } else if (host) {
      crc = Crc32c(r->bytes.data(), r->bytes.size());
    }
    loop->Post([this, conn = std::move(conn), rid, r = std::move(r), crc, host, shared,
                shared_bytes]() mutable {
      conn->pending_work--;
      pending_work_--;
      if (!r.ok()) {
        SendStatus(*conn, rid, r.status());
        return;
      }
      if (shared) {
        counters_.shm_gets++;
        counters_.bytes_sent += shared_bytes;
        wire::GetReply reply;
        reply.representation = r->representation;
        reply.shared = true;
        reply.shm_bytes = shared_bytes;
        SendFrame(*conn, wire::Encode(rid, reply, 0));
        return;
      }
      if (r->bytes.memory_type() == MemoryType::kCuda && !loop_->cuda_memory()) {
        Reject(*conn, rid,
               absl::InternalError("get: the cache is in CUDA memory, but this UCX build "
                                   "is not CUDA-aware"));
        return;
      }
      wire::GetReply reply;
      reply.representation = r->representation;
      reply.has_crc = host;
      reply.payload_crc = crc;
      std::string frame = wire::Encode(rid, reply, r->bytes.size());
      SendFrame(*conn, std::move(frame), std::move(r->bytes));
    });
  };
  handler_->OnGet(conn->session, get, std::move(done));
}

void ServerImpl::HandleLookup(const std::shared_ptr<Connection>& conn, const wire::Frame& f) {
  wire::Lookup lookup;
  if (!DecodeOrReject(*conn, f, &lookup)) return;
  conn->pending_work++;
  pending_work_++;
  std::shared_ptr<WorkerLoop> loop = loop_;
  const uint64_t rid = f.header.request_id;
  LookupDone done = [this, loop, conn, rid](absl::StatusOr<wire::CacheSummary> r) mutable {
    loop->Post([this, conn = std::move(conn), rid, r = std::move(r)] {
      conn->pending_work--;
      pending_work_--;
      if (!r.ok()) {
        SendStatus(*conn, rid, r.status());
      } else {
        SendFrame(*conn, wire::EncodeLookupReply(rid, *r));
      }
    });
  };
  handler_->OnLookup(conn->session, lookup, std::move(done));
}

void ServerImpl::HandleDelete(const std::shared_ptr<Connection>& conn, const wire::Frame& f) {
  wire::Delete del;
  if (!DecodeOrReject(*conn, f, &del)) return;
  conn->pending_work++;
  pending_work_++;
  std::shared_ptr<WorkerLoop> loop = loop_;
  const uint64_t rid = f.header.request_id;
  Done done = [this, loop, conn, rid](absl::Status st) mutable {
    loop->Post([this, conn = std::move(conn), rid, st = std::move(st)] {
      conn->pending_work--;
      pending_work_--;
      SendStatus(*conn, rid, st);
    });
  };
  handler_->OnDelete(conn->session, del, std::move(done));
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxServer>> UcxServer::Start(const ServerOptions& options,
                                                            RequestHandler* handler) {
  auto server = std::make_unique<ServerImpl>(options, handler);
  KVCOMP_RETURN_IF_ERROR(server->Init());
  // Released block buffers kept for reuse stay within a quarter of the buffer budget, so the
  // memory of received blocks follows max_buffered_bytes once they are consumed.
  LimitBufferCache(std::min<uint64_t>(uint64_t{256} << 20, options.max_buffered_bytes / 4));
  return std::unique_ptr<UcxServer>(std::move(server));
}

}  // namespace transport
}  // namespace kvcomp
