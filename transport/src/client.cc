#include "kvcomp/transport/client.h"

#include <netdb.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/gpu_link.h"
#include "kvcomp/transport/shm_link.h"
#include "transport/src/ucx_util.h"

namespace kvcomp {
namespace transport {
namespace {

// A reply as the client's callers see it: the frame (body copied) and any payload.
struct Reply {
  wire::FrameHeader header;
  std::string body;
  Buffer payload;
  wire::Frame frame() const { return wire::Frame{header, body}; }
};
using ReplyCallback = absl::AnyInvocable<void(absl::StatusOr<Reply>)>;

// A request waiting for its reply (and for its send to complete: UCX may still reference the
// payload until then).
struct Pending {
  uint64_t request_id = 0;
  std::string frame;
  std::string owned_payload;  // a payload the request holds itself (a link descriptor)
  ucp_dt_iov_t iov[2] = {};
  int iov_count = 0;  // 0: no payload
  uint64_t payload_bytes = 0;
  MemoryType payload_memory = MemoryType::kHost;
  bool device_bound = false;  // the payload's CUDA context made current on the loop thread
  absl::Time deadline;
  absl::Duration backoff;
  // Set once the server answered busy: a request timing out while retrying fails with this
  // BusyError (the header's promise), not DeadlineExceeded.
  absl::Status busy;
  bool sending = false;
  absl::Time resend_at = absl::InfinitePast();
  bool resend_due = false;
  // Get replies land here when set (else in a new host buffer).
  void* dst = nullptr;
  size_t capacity = 0;
  MemoryType dst_memory = MemoryType::kHost;
  std::unique_ptr<Reply> reply;  // arrived, waiting for the send to complete
  bool receiving = false;        // reply payload being received
  bool raw = false;              // SendRawForTesting: busy replies are not retried
  absl::Status failure;          // set: deliver this once UCX lets go of the request
  ReplyCallback callback;

  // The request carries `data` (a link's descriptor) as its payload, held by the request.
  void HoldPayload(std::string data) {
    owned_payload = std::move(data);
    if (owned_payload.empty()) return;
    iov[0] = {owned_payload.data(), owned_payload.size()};
    iov_count = 1;
    payload_bytes = owned_payload.size();
  }
};

class ClientImpl;
// A connection to `endpoint` that had been made was lost: a client on UCX before 1.14 forgets
// that the endpoint wanted CM_USE_ALL_DEVICES=n ("UCX releases", below).
void ForgetOneDevice(const std::string& endpoint);

// Process-wide counts behind UcxClientStats().
std::atomic<uint64_t> contexts_created{0};
std::atomic<uint64_t> workers_created{0};
std::atomic<uint64_t> workers_live{0};
std::atomic<uint64_t> endpoints_created{0};
std::atomic<uint64_t> endpoints_open{0};

// The UCX context, worker and progress thread shared by every client of this process with the
// same settings. A connection is an endpoint on it: connecting and reconnecting create and
// close endpoints only. (UCX 1.13 aborts a process that created and destroyed a few thousand
// workers while peers failed: a missed event of a released async handler reaching another
// worker's handler.) Made at the first connection, kept until the process exits.
//
// Replies of all connections arrive at one active-message handler and are matched to their
// request by id: request ids are unique among the outstanding requests of the worker.
class ClientWorker {
 public:
  static absl::StatusOr<std::shared_ptr<ClientWorker>> Get(const ClientOptions& options);
  ~ClientWorker();

  WorkerLoop& loop() { return *loop_; }
  // Ids the clients pick themselves; SendRawForTesting's (small, chosen by tests) stay clear.
  uint64_t NextRequestId() { return next_request_id_.fetch_add(1); }

  // ---- loop thread ----
  void Add(std::shared_ptr<ClientImpl> client);
  // Claims `request_id` for `client`: false while another outstanding request holds it.
  bool Claim(uint64_t request_id, ClientImpl* client);
  void Release(uint64_t request_id) { requests_.erase(request_id); }
  // Drops `client` soon (after the running callback) if it is closed and done with UCX.
  void ScheduleRemove(ClientImpl* client);
  // The endpoints whose failures reach their client. UCX 1.13 may report a failure of an
  // endpoint after its forced close completed: such a report finds no client and is dropped.
  void AddEndpoint(ucp_ep_h ep, ClientImpl* client) { endpoints_[ep] = client; }
  void RemoveEndpoint(ucp_ep_h ep) { endpoints_.erase(ep); }
  // The error handler of every endpoint, `arg` the worker.
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);

 private:
  ClientWorker() = default;
  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param);
  static void ShutdownAll();
  static void DestroyIdleBeforeFork();
  void Tick();
  void RemoveIfDone(ClientImpl* client);
  // Closes every connection at exit: endpoints closed, requests failed.
  void CloseAll();

  std::shared_ptr<WorkerLoop> loop_;
  std::atomic<uint64_t> next_request_id_{uint64_t{1} << 32};
  // Loop-thread state: the clients with an endpoint open or closing, and who owns each
  // outstanding request id.
  absl::flat_hash_map<ClientImpl*, std::shared_ptr<ClientImpl>> clients_;
  absl::flat_hash_map<uint64_t, ClientImpl*> requests_;
  absl::flat_hash_map<ucp_ep_h, ClientImpl*> endpoints_;
};

struct RecvContext {
  ClientImpl* client;
  uint64_t request_id;
  std::unique_ptr<Reply> reply;
};

// Copies `n` host bytes to device memory `dst` (a small reply that arrived eagerly), through
// the CUDA driver opened at run time, on the legacy stream, and waits for that copy only.
absl::Status CopyToDevice(void* dst, const void* src, size_t n) {
  KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, GpuRuntime::Get());
  KVCOMP_ASSIGN_OR_RETURN(int device, rt->DeviceOf(dst));
  KVCOMP_RETURN_IF_ERROR(rt->SetDevice(device));
  KVCOMP_RETURN_IF_ERROR(rt->CopyAsync(dst, src, n, GpuRuntime::Copy::kHostToDevice, nullptr));
  return rt->WaitStream(nullptr, absl::Now() + absl::Seconds(30));
}

class ClientImpl : public UcxClient, public std::enable_shared_from_this<ClientImpl> {
 public:
  ClientImpl(const ClientOptions& options, std::shared_ptr<ClientWorker> worker)
      : options_(options), worker_(std::move(worker)) {}

  absl::Status Connect(const Endpoint& endpoint, absl::string_view tenant,
                       absl::string_view token);

  const wire::HelloOk& server_info() const override { return hello_ok_; }
  bool connected() const override { return connected_.load(); }
  absl::Status DevicePayloads() const override;
  bool LocalCudaMemory() const override { return worker_->loop().cuda_memory(); }
  absl::StatusOr<uint64_t> PutBegin(const wire::PutBegin& begin) override;
  absl::Status SendBlock(const wire::Block& block, const void* keys, const void* values,
                         MemoryType memory) override;
  void SendBlockAsync(const wire::Block& block, const void* keys, const void* values,
                      absl::AnyInvocable<void(absl::Status)> done, MemoryType memory) override;
  absl::StatusOr<wire::CacheSummary> PutCommit(uint64_t put_id, uint64_t num_blocks) override;
  absl::Status PutAbort(uint64_t put_id) override;
  absl::StatusOr<FetchedCache> Get(absl::string_view model_id, absl::string_view key,
                                   wire::Representation representation,
                                   absl::Time deadline) override;
  absl::StatusOr<size_t> GetInto(absl::string_view model_id, absl::string_view key,
                                 wire::Representation representation, void* dst,
                                 size_t capacity, MemoryType memory,
                                 absl::Time deadline) override;
  absl::StatusOr<wire::CacheSummary> Lookup(absl::string_view model_id, absl::string_view key,
                                            absl::Time deadline) override;
  absl::Status Delete(absl::string_view model_id, absl::string_view key) override;
  absl::Status Ping() override;
  // The channel lives in the handle callers hold (ClientHandle), which outlives requests.
  ShmChannel* SharedMemory() override { return nullptr; }
  void SendSharedBlockAsync(const wire::Block& block,
                            absl::AnyInvocable<void(absl::Status)> done) override;
  void SendLinkBlockAsync(const wire::Block& block, std::string descriptor,
                          absl::AnyInvocable<void(absl::Status)> done) override;
  absl::StatusOr<wire::GetReply> GetOverLink(const wire::Get& get, std::string descriptor,
                                             absl::Time deadline) override;
  uint64_t GetSharedAsync(const wire::Get& get, void* dst, size_t capacity, absl::Time deadline,
                          absl::AnyInvocable<void(absl::StatusOr<SharedGet>)> done) override;
  const ClientOptions& options() const { return options_; }
  // The connection failed because the server's UCX refused the connection request itself
  // (UCS_ERR_REJECTED), before any hello.
  bool RejectedByPeer() const { return ep_failure_.load() == UCS_ERR_REJECTED; }
  // The connection failed before UCX delivered the hello: its send failed, or the endpoint
  // failed while the send was still waiting for UCX to wire the endpoint up (a server on UCX
  // before 1.14 whose CM_USE_ALL_DEVICES differs from this side's closes such a connection at
  // its hello timeout). Not a refused request (RejectedByPeer).
  // A connect that ran out of connect_timeout on its own is not counted.
  bool NeverWiredUp() const { return never_wired_.load(); }
  // The server closed the connection before the hello got through, `after` or longer after the
  // connect began: what a server before 1.14 that never sees the hello does at its hello
  // timeout. UCX reports it as a reset (UCS_ERR_CONNECTION_RESET) or, where the endpoint
  // learns of the close only by its own timeout, as UCS_ERR_ENDPOINT_TIMEOUT; both seen on
  // loopback with UCX 1.13.1.
  bool ClosedBeforeHelloAfter(absl::Duration after) const {
    const int64_t ns = failed_after_ns_.load();
    auto closed = [](int status) {
      return status == UCS_ERR_CONNECTION_RESET || status == UCS_ERR_ENDPOINT_TIMEOUT;
    };
    return NeverWiredUp() && ns >= 0 && absl::Nanoseconds(ns) >= after &&
           (closed(ep_failure_.load()) || closed(hello_send_.load()));
  }
  absl::StatusOr<RawReply> SendRawForTesting(uint64_t request_id, std::string frame,
                                             absl::string_view payload) override;
  void Close() override;

  // ---- loop thread ----
  static void OnSendDone(void* request, ucs_status_t status, void* user_data);
  static void OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data);
  void EndpointFailed(ucs_status_t status);
  static void OnEpClosed(void* request, ucs_status_t status, void* user_data);
  void ReplyArrived(const void* header, size_t header_length, void* data, size_t length,
                    bool rndv);
  void Tick();
  // Starts closing: outstanding requests fail with `why` (their callbacks run once UCX lets go
  // of them), the endpoint is closed.
  void BeginClose(const absl::Status& why);
  // Closed, the endpoint's close complete and no request outstanding.
  bool Done() const { return closing_ && !ep_open_ && pending_.empty(); }
  // Delivers every outstanding request's failure now (at exit, whatever UCX still holds).
  void AbandonAll();
  void NotifyClosed();

 private:
  uint64_t NextRequestId() { return worker_->NextRequestId(); }
  // Queues `p` for sending; its callback runs on the loop thread exactly once.
  void Submit(std::unique_ptr<Pending> p);
  // Sends `frame` with no payload and waits for the reply.
  absl::StatusOr<Reply> Call(uint64_t request_id, std::string frame,
                             absl::Duration timeout);
  absl::StatusOr<Reply> Wait(std::unique_ptr<Pending> p);
  absl::StatusOr<Reply> GetReply(absl::string_view model_id, absl::string_view key,
                                 wire::Representation representation, void* dst,
                                 size_t capacity, MemoryType memory, absl::Time deadline);
  // The request timeout from now, or `deadline` when sooner.
  absl::Time RequestDeadline(absl::Time deadline) const {
    return std::min(absl::Now() + options_.request_timeout, deadline);
  }

  void StartSend(Pending* p);
  void SendCompleted(uint64_t request_id, ucs_status_t status);
  // Records when the connection first failed (failed_after_ns_), once.
  void NoteFailure() {
    int64_t none = -1;
    failed_after_ns_.compare_exchange_strong(
        none, std::max<int64_t>(0, absl::ToInt64Nanoseconds(absl::Now() - connect_start_)));
  }
  void ReplyPayloadDone(RecvContext* ctx, ucs_status_t status);
  // Finishes a pending request whose reply (or failure) is complete.
  void MaybeComplete(uint64_t request_id);
  void Fail(uint64_t request_id, absl::Status status);
  // Fails every outstanding request with `why`.
  void FailOutstanding(const absl::Status& why);
  // Removes a request from the outstanding ones (and its id from the worker's).
  std::unique_ptr<Pending> Take(absl::flat_hash_map<uint64_t, std::unique_ptr<Pending>>::iterator it);
  // Closes the endpoint (forced: what UCX holds of it is cancelled).
  void CloseEndpoint();
  void EndpointClosed();
  // FailedPrecondition on the worker's progress thread, where a synchronous call would wait for
  // itself (a SendBlockAsync callback).
  absl::Status CheckNotLoopThread(absl::string_view what) const;

  const ClientOptions options_;
  const std::shared_ptr<ClientWorker> worker_;
  wire::HelloOk hello_ok_;
  std::atomic<bool> connected_{false};
  std::atomic<int> ep_failure_{UCS_OK};  // the status UCX failed the endpoint with
  std::atomic<uint64_t> hello_id_{0};     // the hello's request id, once sent
  std::atomic<int> hello_send_{UCS_INPROGRESS};  // how UCX completed the hello's send
  std::atomic<bool> never_wired_{false};           // NeverWiredUp()
  absl::Time connect_start_;                       // set by Connect before the endpoint exists
  std::atomic<int64_t> failed_after_ns_{-1};       // its first failure, after connect_start_
  std::string endpoint_key_;  // Endpoint::ToString() of the server, set by Connect
  std::atomic<uint64_t> next_put_id_{1};
  absl::Mutex close_mu_;
  bool registered_ ABSL_GUARDED_BY(close_mu_) = false;  // the endpoint was made
  bool closed_ ABSL_GUARDED_BY(close_mu_) = false;

  // Loop-thread state.
  ucp_ep_h ep_ = nullptr;
  bool ep_open_ = false;  // made, its close not yet complete
  absl::flat_hash_map<uint64_t, std::unique_ptr<Pending>> pending_;
  absl::Status broken_;  // why the connection is gone; OK while usable
  bool closing_ = false;  // Close() ran on the loop
  std::shared_ptr<absl::Notification> closed_note_;  // notified once Done()
};

absl::Status ClientImpl::Connect(const Endpoint& endpoint, absl::string_view tenant,
                                 absl::string_view token) {
  KVCOMP_RETURN_IF_ERROR(CheckNotLoopThread("connect"));
  endpoint_key_ = endpoint.ToString();
  addrinfo hints = {};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = absl::StrCat(endpoint.port);
  if (int rc = getaddrinfo(endpoint.host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("connect ", endpoint.ToString(), ": ", gai_strerror(rc)));
  }
  if (absl::Status st = CheckAddressFamilySupported(
          res->ai_family, absl::StrCat("connect ", endpoint.ToString()));
      !st.ok()) {
    freeaddrinfo(res);
    return st;
  }
  ucp_ep_params_t ep = {};
  ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = res->ai_addr;
  ep.sockaddr.addrlen = res->ai_addrlen;
  ep.err_mode =
      options_.ucx.peer_error_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  ep.err_handler.cb = &ClientWorker::OnEpError;
  ep.err_handler.arg = worker_.get();
  connect_start_ = absl::Now();
  ucs_status_t s = UCS_ERR_CANCELED;
  absl::Notification made;
  const bool posted = worker_->loop().Post([this, self = shared_from_this(), &ep, &s, &made] {
    s = ucp_ep_create(worker_->loop().worker(), &ep, &ep_);
    if (s == UCS_OK) {
      ep_open_ = true;
      worker_->AddEndpoint(ep_, this);
      endpoints_created.fetch_add(1);
      endpoints_open.fetch_add(1);
      worker_->Add(std::move(self));
    }
    made.Notify();
  });
  if (posted) made.WaitForNotification();
  freeaddrinfo(res);
  if (!posted) {
    return absl::UnavailableError(
        absl::StrCat("connect ", endpoint.ToString(), ": the process is exiting"));
  }
  if (s != UCS_OK) return UcsStatusToStatus(s, absl::StrCat("connect ", endpoint.ToString()));
  {
    absl::MutexLock l(&close_mu_);
    registered_ = true;
  }
  connected_.store(true);

  if (!options_.send_hello) return absl::OkStatus();
  wire::Hello hello;
  hello.tenant = std::string(tenant);
  hello.token = std::string(token);
  hello.client_name = options_.client_name;
  const uint64_t rid = NextRequestId();
  hello_id_.store(rid);
  absl::StatusOr<Reply> r = Call(rid, wire::Encode(rid, hello), options_.connect_timeout);
  if (!r.ok()) {
    absl::Status st = Annotate(r.status(), absl::StrCat("connect ", endpoint.ToString()));
    auto tls = options_.ucx.overrides.find("TLS");
    const char* env = std::getenv("UCX_TLS");
    const std::string tls_value =
        tls != options_.ucx.overrides.end() ? tls->second : (env != nullptr ? env : "");
    if (!tls_value.empty() && tls_value.find("tcp") == std::string::npos &&
        tls_value != "all") {
      st = Annotate(st, absl::StrCat("UCX_TLS=", tls_value,
                                     " lacks tcp, which sockaddr connections need "
                                     "(use e.g. sm,tcp; docs/protocol.md)"));
    }
    return st;
  }
  if (r->header.type == wire::MessageType::kStatus) {
    wire::StatusReply st;
    KVCOMP_RETURN_IF_ERROR(wire::Decode(r->frame(), &st));
    absl::Status status = st.ToStatus();
    if (status.ok()) status = absl::InternalError("hello answered OK without hello-ok");
    return status;
  }
  KVCOMP_RETURN_IF_ERROR(wire::Decode(r->frame(), &hello_ok_));
  if (std::getenv("KVCOMP_UCX_EP_INFO") != nullptr) {
    // Which UCX transports carry which lanes of this connection (diagnostics).
    absl::Notification printed;
    if (worker_->loop().Post([this, &printed] {
          if (ep_ != nullptr) ucp_ep_print_info(ep_, stderr);
          printed.Notify();
        })) {
      printed.WaitForNotification();
    }
  }
  return absl::OkStatus();
}

void ClientImpl::Close() {
  {
    absl::MutexLock l(&close_mu_);
    if (closed_ || !registered_) return;
    closed_ = true;
  }
  connected_.store(false);
  auto closed = std::make_shared<absl::Notification>();
  const bool posted = worker_->loop().Post([self = shared_from_this(), closed] {
    self->closed_note_ = closed;
    self->BeginClose(absl::UnavailableError("client closed"));
    self->worker_->ScheduleRemove(self.get());
  });
  // On the progress thread (a callback closing a client) there is nothing to wait for: the
  // close completes after the callback returns.
  if (!posted || worker_->loop().InLoopThread()) return;
  // UCX completes a forced close at once in practice; past this bound the endpoint finishes
  // closing in the background.
  closed->WaitForNotificationWithTimeout(absl::Seconds(2));
}

void ClientImpl::BeginClose(const absl::Status& why) {
  closing_ = true;
  if (broken_.ok()) broken_ = why;
  FailOutstanding(why);
  CloseEndpoint();
}

void ClientImpl::FailOutstanding(const absl::Status& why) {
  std::vector<uint64_t> ids;
  for (const auto& [id, p] : pending_) ids.push_back(id);
  for (uint64_t id : ids) Fail(id, why);
}

void ClientImpl::CloseEndpoint() {
  if (ep_ == nullptr) return;
  ucp_request_param_t p = {};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  p.cb.send = &ClientImpl::OnEpClosed;
  p.user_data = this;
  ucp_ep_h ep = ep_;
  ep_ = nullptr;
  worker_->RemoveEndpoint(ep);
  void* req = ucp_ep_close_nbx(ep, &p);
  if (!UCS_PTR_IS_PTR(req)) EndpointClosed();
}

void ClientImpl::OnEpClosed(void* request, ucs_status_t status, void* user_data) {
  ucp_request_free(request);
  static_cast<ClientImpl*>(user_data)->EndpointClosed();
}

void ClientImpl::EndpointClosed() {
  if (!ep_open_) return;
  ep_open_ = false;
  endpoints_open.fetch_sub(1);
  if (closing_) worker_->ScheduleRemove(this);
}

void ClientImpl::NotifyClosed() {
  if (closed_note_ != nullptr) closed_note_->Notify();
  closed_note_.reset();
}

void ClientImpl::AbandonAll() {
  while (!pending_.empty()) {
    std::unique_ptr<Pending> p = Take(pending_.begin());
    p->callback(p->failure.ok() ? broken_ : p->failure);
  }
}

std::unique_ptr<Pending> ClientImpl::Take(
    absl::flat_hash_map<uint64_t, std::unique_ptr<Pending>>::iterator it) {
  std::unique_ptr<Pending> p = std::move(it->second);
  pending_.erase(it);
  worker_->Release(p->request_id);
  if (closing_ && pending_.empty()) worker_->ScheduleRemove(this);
  return p;
}

absl::Status ClientImpl::CheckNotLoopThread(absl::string_view what) const {
  if (!worker_->loop().InLoopThread()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what, " on the client's progress thread (from a SendBlockAsync callback) would wait for "
            "itself; call it from another thread"));
}

// ---- request plumbing ----

void ClientImpl::Submit(std::unique_ptr<Pending> p) {
  std::shared_ptr<Pending> holder(p.release());
  const bool posted = worker_->loop().Post([this, self = shared_from_this(), holder]() mutable {
    auto p = std::make_unique<Pending>(std::move(*holder));
    if (!broken_.ok()) {
      p->callback(broken_);
      return;
    }
    if (!worker_->Claim(p->request_id, this)) {
      p->callback(absl::AlreadyExistsError(absl::StrCat(
          "request id ", p->request_id, " is in use by another outstanding request")));
      return;
    }
    Pending* raw = p.get();
    pending_[raw->request_id] = std::move(p);
    StartSend(raw);
  });
  if (!posted) holder->callback(absl::UnavailableError("client closed"));
}


struct SendTag {
  ClientImpl* client;
  uint64_t request_id;
};

void ClientImpl::StartSend(Pending* p) {
  auto* tag = new SendTag{this, p->request_id};
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &ClientImpl::OnSendDone;
  param.user_data = tag;
  param.flags = UCP_AM_SEND_FLAG_REPLY;
  const void* buffer = nullptr;
  size_t count = 0;
  if (p->iov_count == 1) {
    buffer = p->iov[0].buffer;
    count = p->iov[0].length;
  } else if (p->iov_count == 2) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = ucp_dt_make_iov();
    buffer = p->iov;
    count = 2;
  }
  if (p->payload_memory == MemoryType::kCuda && p->iov_count == 1) {
    // Sent out of the caller's device memory, stated as CUDA memory. UCX registers the
    // allocation through its registration cache (cuda_ipc / cuda_copy), which its memory hooks
    // keep in step with cuMemFree / cudaFree: the caller's long-lived KV buffers are registered
    // once, and a freed one is never named by a stale registration.
    if (!p->device_bound) {
      if (absl::Status s = BindDeviceContext(p->iov[0].buffer); !s.ok()) {
        delete tag;
        Fail(p->request_id, Annotate(s, "send from device memory"));
        return;
      }
      p->device_bound = true;
    }
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  p->sending = true;
  p->resend_due = false;
  void* req = ucp_am_send_nbx(ep_, wire::kAmIdRequest, p->frame.data(), p->frame.size(), buffer,
                              count, &param);
  if (UCS_PTR_IS_PTR(req)) return;
  delete tag;
  SendCompleted(p->request_id, UCS_PTR_STATUS(req));
}

void ClientImpl::OnSendDone(void* request, ucs_status_t status, void* user_data) {
  std::unique_ptr<SendTag> tag(static_cast<SendTag*>(user_data));
  ucp_request_free(request);
  tag->client->SendCompleted(tag->request_id, status);
}

void ClientImpl::SendCompleted(uint64_t request_id, ucs_status_t status) {
  if (request_id == hello_id_.load()) {
    hello_send_.store(status);
    if (status != UCS_OK && status != UCS_ERR_CANCELED && status != UCS_ERR_REJECTED) {
      NoteFailure();
      never_wired_.store(true);
    }
  }
  auto it = pending_.find(request_id);
  if (it == pending_.end()) return;
  it->second->sending = false;
  if (status != UCS_OK) {
    Fail(request_id, UcsStatusToStatus(status, "send"));
    return;
  }
  MaybeComplete(request_id);
}

void ClientImpl::Fail(uint64_t request_id, absl::Status status) {
  auto it = pending_.find(request_id);
  if (it == pending_.end()) return;
  Pending& p = *it->second;
  if (p.failure.ok()) p.failure = std::move(status);
  p.resend_due = false;
  MaybeComplete(request_id);  // waits while UCX still references the request's memory
}

void ClientImpl::MaybeComplete(uint64_t request_id) {
  auto it = pending_.find(request_id);
  if (it == pending_.end()) return;
  Pending& p = *it->second;
  if (p.sending || p.receiving) return;
  if (!p.failure.ok()) {
    std::unique_ptr<Pending> failed = Take(it);
    failed->callback(std::move(failed->failure));
    return;
  }
  if (p.reply == nullptr) return;
  if (p.reply->header.type == wire::MessageType::kBusy && !p.raw) {
    wire::Busy busy;
    absl::Status s = wire::Decode(p.reply->frame(), &busy);
    p.reply.reset();
    const absl::Time now = absl::Now();
    absl::Duration wait = p.backoff == absl::ZeroDuration()
                              ? absl::Microseconds(std::max<uint32_t>(busy.retry_after_us, 50))
                              : std::min(p.backoff * 2, options_.max_busy_backoff);
    p.backoff = wait;
    if (s.ok()) {
      p.busy = BusyError(
          absl::StrFormat("server busy (%u of %u bytes in flight) until the request timeout",
                          busy.inflight_bytes, busy.limit_bytes));
    }
    if (s.ok() && now + wait < p.deadline) {
      p.resend_at = now + wait;
      p.resend_due = true;
      return;
    }
    Fail(request_id, s.ok() ? p.busy : s);
    return;
  }
  std::unique_ptr<Pending> done = Take(it);
  done->callback(std::move(*done->reply));
}

void ClientImpl::Tick() {
  const absl::Time now = absl::Now();
  std::vector<uint64_t> expired, resend;
  for (const auto& [id, p] : pending_) {
    if (!p->failure.ok()) continue;
    if (now > p->deadline) {
      expired.push_back(id);
    } else if (p->resend_due && !p->sending && now >= p->resend_at) {
      resend.push_back(id);
    }
  }
  for (uint64_t id : resend) {
    auto it = pending_.find(id);
    if (it != pending_.end() && broken_.ok()) StartSend(it->second.get());
  }
  for (uint64_t id : expired) {
    auto it = pending_.find(id);
    if (it == pending_.end()) continue;
    // Still retrying busy replies when time ran out: busy it stays.
    absl::Status busy = it->second->busy;
    Fail(id, !busy.ok() ? busy
                        : absl::DeadlineExceededError(absl::StrCat(
                              "request ", id,
                              ": no reply within the request timeout or the call's deadline")));
  }
}

// ---- receiving ----

void ClientImpl::EndpointFailed(ucs_status_t status) {
  connected_.store(false);
  NoteFailure();
  ep_failure_.store(status);
  if (status != UCS_ERR_REJECTED && hello_id_.load() != 0 && hello_send_.load() != UCS_OK) {
    never_wired_.store(true);
  }
  // A connection that worked is gone (the daemon restarted, perhaps with other settings): the
  // next connect starts from UCX's defaults again.
  if (hello_send_.load() == UCS_OK) ForgetOneDevice(endpoint_key_);
  if (broken_.ok()) {
    broken_ = absl::UnavailableError(
        absl::StrCat("connection lost: UCX: ", ucs_status_string(status)));
  }
  FailOutstanding(broken_);
  // Closing cancels what UCX still holds, which completes the failed requests.
  CloseEndpoint();
}

void ClientImpl::ReplyArrived(const void* header, size_t header_length, void* data,
                              size_t length, bool rndv) {
  const absl::string_view hv(static_cast<const char*>(header), header_length);
  absl::StatusOr<wire::Frame> f = wire::ParseFrame(hv, length);
  if (!f.ok()) {
    if (rndv) DropRendezvous(worker_->loop().worker(), data);
    const uint64_t rid = wire::PeekRequestId(hv);
    if (rid != 0) Fail(rid, Annotate(f.status(), "malformed reply"));
    return;
  }
  auto it = pending_.find(f->header.request_id);
  if (it == pending_.end() || it->second->reply != nullptr || it->second->receiving ||
      !it->second->failure.ok()) {
    if (rndv) DropRendezvous(worker_->loop().worker(), data);
    return;  // late reply of a request that already failed
  }
  Pending& p = *it->second;
  auto reply = std::make_unique<Reply>();
  reply->header = f->header;
  reply->body = std::string(f->body);
  if (length == 0) {
    p.reply = std::move(reply);
    MaybeComplete(p.request_id);
    return;
  }
  if (f->header.type != wire::MessageType::kGetReply) {
    if (rndv) DropRendezvous(worker_->loop().worker(), data);
    Fail(p.request_id, absl::DataLossError("reply carries an unexpected payload"));
    return;
  }
  if (p.dst != nullptr) {
    if (length > p.capacity) {
      if (rndv) DropRendezvous(worker_->loop().worker(), data);
      Fail(p.request_id, absl::OutOfRangeError(absl::StrFormat(
                             "cache of %u bytes does not fit the %u-byte buffer", length,
                             p.capacity)));
      return;
    }
    reply->payload = Buffer::Wrap(p.dst, length, p.dst_memory, nullptr);
  } else {
    reply->payload = Buffer::Allocate(length);
  }
  if (!rndv) {
    if (reply->payload.memory_type() == MemoryType::kCuda) {
      // A small reply arrives whole in host memory: one copy to the device.
      if (absl::Status s = CopyToDevice(reply->payload.data(), data, length); !s.ok()) {
        Fail(p.request_id, s);
        return;
      }
    } else {
      std::memcpy(reply->payload.data(), data, length);
    }
    p.reply = std::move(reply);
    MaybeComplete(p.request_id);
    return;
  }
  auto* ctx = new RecvContext{this, p.request_id, std::move(reply)};
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.recv_am = &ClientImpl::OnRecvDone;
  param.user_data = ctx;
  if (ctx->reply->payload.memory_type() == MemoryType::kCuda) {
    // The caller's memory, registered through UCX's registration cache as for sends.
    if (absl::Status bound = BindDeviceContext(ctx->reply->payload.data()); !bound.ok()) {
      delete ctx;
      DropRendezvous(worker_->loop().worker(), data);
      Fail(p.request_id, Annotate(bound, "receive into device memory"));
      return;
    }
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  p.receiving = true;
  void* req =
      ucp_am_recv_data_nbx(worker_->loop().worker(), data, ctx->reply->payload.data(), length,
                           &param);
  if (req == nullptr) {
    ReplyPayloadDone(ctx, UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    ReplyPayloadDone(ctx, UCS_PTR_STATUS(req));
  }
}

void ClientImpl::OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data) {
  auto* ctx = static_cast<RecvContext*>(user_data);
  ucp_request_free(request);
  ctx->client->ReplyPayloadDone(ctx, status);
}

void ClientImpl::ReplyPayloadDone(RecvContext* raw, ucs_status_t status) {
  std::unique_ptr<RecvContext> ctx(raw);
  auto it = pending_.find(ctx->request_id);
  if (it == pending_.end()) return;
  it->second->receiving = false;
  if (status != UCS_OK) {
    Fail(ctx->request_id, UcsStatusToStatus(status, "receive of the cache"));
    return;
  }
  it->second->reply = std::move(ctx->reply);
  MaybeComplete(ctx->request_id);
}

// ---- synchronous calls ----

absl::StatusOr<Reply> ClientImpl::Wait(std::unique_ptr<Pending> p) {
  KVCOMP_RETURN_IF_ERROR(CheckNotLoopThread("a synchronous call"));
  absl::Notification done;
  absl::StatusOr<Reply> result = absl::UnknownError("no reply");
  p->callback = [&done, &result](absl::StatusOr<Reply> r) {
    result = std::move(r);
    done.Notify();
  };
  Submit(std::move(p));
  done.WaitForNotification();
  return result;
}

absl::StatusOr<Reply> ClientImpl::Call(uint64_t request_id, std::string frame,
                                       absl::Duration timeout) {
  auto p = std::make_unique<Pending>();
  p->request_id = request_id;
  p->frame = std::move(frame);
  p->deadline = absl::Now() + timeout;
  return Wait(std::move(p));
}

absl::Status ValidateKey(absl::string_view model_id, absl::string_view key) {
  CacheKey k;
  k.tenant = "default";
  k.model_id = std::string(model_id);
  k.key = std::string(key);
  return k.Validate();
}

// The status of a reply that must be kStatus (OK or an error).
absl::Status StatusOfReply(const Reply& r) {
  if (r.header.type != wire::MessageType::kStatus) {
    return absl::InternalError(absl::StrCat("unexpected reply ",
                                            wire::MessageTypeName(r.header.type)));
  }
  wire::StatusReply st;
  KVCOMP_RETURN_IF_ERROR(wire::Decode(r.frame(), &st));
  return st.ToStatus();
}

absl::StatusOr<wire::CacheSummary> SummaryOfReply(const Reply& r) {
  if (r.header.type == wire::MessageType::kStatus) {
    absl::Status s = StatusOfReply(r);
    if (s.ok()) s = absl::InternalError("status OK where a cache summary was expected");
    return s;
  }
  wire::CacheSummary summary;
  KVCOMP_RETURN_IF_ERROR(wire::Decode(r.frame(), &summary));
  return summary;
}

absl::StatusOr<uint64_t> ClientImpl::PutBegin(const wire::PutBegin& begin) {
  wire::PutBegin b = begin;
  if (b.put_id == 0) b.put_id = next_put_id_.fetch_add(1);
  KVCOMP_RETURN_IF_ERROR(b.layout.Validate());
  if (b.num_tokens == 0 || b.num_tokens > KvLayout::kMaxTokens) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens ", b.num_tokens, " out of range"));
  }
  KVCOMP_RETURN_IF_ERROR(ValidateKey(b.model_id, b.key));
  if (b.has_policy) KVCOMP_RETURN_IF_ERROR(b.policy.ValidateFor(b.layout.head_dim));
  const uint64_t rid = NextRequestId();
  KVCOMP_ASSIGN_OR_RETURN(Reply r, Call(rid, wire::Encode(rid, b), options_.request_timeout));
  KVCOMP_RETURN_IF_ERROR(StatusOfReply(r));
  return b.put_id;
}

absl::Status ClientImpl::DevicePayloads() const {
  if (!worker_->loop().cuda_memory()) {
    return absl::FailedPreconditionError(
        "this client's UCX has no CUDA memory support (no cuda_copy / cuda_ipc transports; "
        "Debian's UCX is built without CUDA)");
  }
  if (!(hello_ok_.server_flags & wire::kServerCudaMemory)) {
    return absl::FailedPreconditionError(
        hello_ok_.server_minor < 1
            ? "the server speaks protocol 1.0, without device payloads"
            : "the server's UCX has no CUDA memory support");
  }
  return absl::OkStatus();
}

void ClientImpl::SendBlockAsync(const wire::Block& block, const void* keys, const void* values,
                                absl::AnyInvocable<void(absl::Status)> done, MemoryType memory) {
  wire::Block b = block;
  auto p = std::make_unique<Pending>();
  p->request_id = NextRequestId();
  const bool has_k = b.parts & wire::kPartKeys, has_v = b.parts & wire::kPartValues;
  if ((has_k && keys == nullptr) || (has_v && values == nullptr) || b.parts == 0 ||
      b.parts > wire::kPartBoth) {
    done(absl::InvalidArgumentError("SendBlock: parts and key/value pointers disagree"));
    return;
  }
  if (!has_k) b.key_bytes = 0;
  if (!has_v) b.value_bytes = 0;
  const bool adjacent =
      has_k && has_v && static_cast<const uint8_t*>(keys) + b.key_bytes == values;
  if (memory == MemoryType::kCuda) {
    if (absl::Status s = DevicePayloads(); !s.ok()) {
      done(Annotate(s, "SendBlock from device memory"));
      return;
    }
    if (has_k && has_v && !adjacent) {
      done(absl::InvalidArgumentError(
          "SendBlock from device memory: keys and values not adjacent; send them as two blocks"));
      return;
    }
    // No host copy to sum: the block says so, and the transport carries its integrity.
    b.flags = wire::kBlockDevicePayload;
    b.key_crc = 0;
    b.value_crc = 0;
    p->payload_memory = MemoryType::kCuda;
  } else {
    b.flags = 0;
    b.key_crc = has_k ? Crc32c(keys, b.key_bytes) : 0;
    b.value_crc = has_v ? Crc32c(values, b.value_bytes) : 0;
  }
  if (adjacent) {
    p->iov[0] = {const_cast<void*>(keys), b.key_bytes + b.value_bytes};  // adjacent: contiguous
    p->iov_count = 1;
  } else if (has_k && has_v) {
    p->iov[0] = {const_cast<void*>(keys), b.key_bytes};
    p->iov[1] = {const_cast<void*>(values), b.value_bytes};
    p->iov_count = 2;
  } else {
    p->iov[0] = {const_cast<void*>(has_k ? keys : values), has_k ? b.key_bytes : b.value_bytes};
    p->iov_count = 1;
  }
  p->payload_bytes = b.payload_bytes();
  p->frame = wire::Encode(p->request_id, b);
  p->deadline = absl::Now() + options_.request_timeout;
  p->callback = [done = std::move(done)](absl::StatusOr<Reply> r) mutable {
    done(r.ok() ? StatusOfReply(*r) : r.status());
  };
  Submit(std::move(p));
}

absl::Status ClientImpl::SendBlock(const wire::Block& block, const void* keys,
                                   const void* values, MemoryType memory) {
  KVCOMP_RETURN_IF_ERROR(CheckNotLoopThread("SendBlock"));
  absl::Notification n;
  absl::Status result;
  SendBlockAsync(
      block, keys, values,
      [&](absl::Status s) {
        result = std::move(s);
        n.Notify();
      },
      memory);
  n.WaitForNotification();
  return result;
}

absl::StatusOr<wire::CacheSummary> ClientImpl::PutCommit(uint64_t put_id, uint64_t num_blocks) {
  const uint64_t rid = NextRequestId();
  KVCOMP_ASSIGN_OR_RETURN(Reply r, Call(rid, wire::Encode(rid, wire::PutCommit{put_id, num_blocks}),
                                        options_.request_timeout));
  return SummaryOfReply(r);
}

absl::Status ClientImpl::PutAbort(uint64_t put_id) {
  const uint64_t rid = NextRequestId();
  KVCOMP_ASSIGN_OR_RETURN(
      Reply r, Call(rid, wire::Encode(rid, wire::PutAbort{put_id}), options_.request_timeout));
  return StatusOfReply(r);
}

absl::StatusOr<Reply> ClientImpl::GetReply(absl::string_view model_id, absl::string_view key,
                                           wire::Representation representation, void* dst,
                                           size_t capacity, MemoryType memory,
                                           absl::Time deadline) {
  KVCOMP_RETURN_IF_ERROR(ValidateKey(model_id, key));
  wire::Get get{representation, std::string(model_id), std::string(key)};
  auto p = std::make_unique<Pending>();
  p->request_id = NextRequestId();
  p->frame = wire::Encode(p->request_id, get);
  p->deadline = RequestDeadline(deadline);
  p->dst = dst;
  p->capacity = capacity;
  p->dst_memory = memory;
  KVCOMP_ASSIGN_OR_RETURN(Reply r, Wait(std::move(p)));
  if (r.header.type == wire::MessageType::kStatus) {
    absl::Status s = StatusOfReply(r);
    if (s.ok()) s = absl::InternalError("get answered OK without the cache");
    return s;
  }
  wire::GetReply gr;
  KVCOMP_RETURN_IF_ERROR(wire::Decode(r.frame(), &gr));
  if (gr.has_crc && r.payload.memory_type() == MemoryType::kHost &&
      Crc32c(r.payload.data(), r.payload.size()) != gr.payload_crc) {
    return absl::DataLossError("get: checksum mismatch of the received cache");
  }
  return r;
}

absl::StatusOr<FetchedCache> ClientImpl::Get(absl::string_view model_id, absl::string_view key,
                                             wire::Representation representation,
                                             absl::Time deadline) {
  KVCOMP_ASSIGN_OR_RETURN(Reply r, GetReply(model_id, key, representation, nullptr, 0,
                                            MemoryType::kHost, deadline));
  wire::GetReply gr;
  KVCOMP_RETURN_IF_ERROR(wire::Decode(r.frame(), &gr));
  return FetchedCache{std::move(r.payload), gr.representation};
}

absl::StatusOr<size_t> ClientImpl::GetInto(absl::string_view model_id, absl::string_view key,
                                           wire::Representation representation, void* dst,
                                           size_t capacity, MemoryType memory,
                                           absl::Time deadline) {
  if (dst == nullptr && capacity > 0) return absl::InvalidArgumentError("GetInto: null buffer");
  if (memory == MemoryType::kCuda && !worker_->loop().cuda_memory()) {
    return absl::FailedPreconditionError(
        "GetInto: this UCX build is not CUDA-aware (Debian's UCX is built without CUDA); "
        "receive into host memory and copy to the GPU");
  }
  KVCOMP_ASSIGN_OR_RETURN(Reply r,
                          GetReply(model_id, key, representation, dst, capacity, memory,
                                   deadline));
  return r.payload.size();
}

absl::StatusOr<wire::CacheSummary> ClientImpl::Lookup(absl::string_view model_id,
                                                      absl::string_view key,
                                                      absl::Time deadline) {
  KVCOMP_RETURN_IF_ERROR(ValidateKey(model_id, key));
  const uint64_t rid = NextRequestId();
  wire::Lookup m{std::string(model_id), std::string(key)};
  KVCOMP_ASSIGN_OR_RETURN(Reply r,
                          Call(rid, wire::Encode(rid, m), RequestDeadline(deadline) - absl::Now()));
  return SummaryOfReply(r);
}

absl::Status ClientImpl::Delete(absl::string_view model_id, absl::string_view key) {
  KVCOMP_RETURN_IF_ERROR(ValidateKey(model_id, key));
  const uint64_t rid = NextRequestId();
  wire::Delete m{std::string(model_id), std::string(key)};
  KVCOMP_ASSIGN_OR_RETURN(Reply r, Call(rid, wire::Encode(rid, m), options_.request_timeout));
  return StatusOfReply(r);
}

absl::Status ClientImpl::Ping() {
  const uint64_t rid = NextRequestId();
  KVCOMP_ASSIGN_OR_RETURN(Reply r,
                          Call(rid, wire::Encode(rid, wire::Ping{}), options_.request_timeout));
  return StatusOfReply(r);
}

void ClientImpl::SendSharedBlockAsync(const wire::Block& block,
                                      absl::AnyInvocable<void(absl::Status)> done) {
  if (!(block.flags & (wire::kBlockSharedMemory | wire::kBlockPeerMemory))) {
    done(absl::InvalidArgumentError(
        "SendSharedBlockAsync: the block is not flagged shared or peer memory"));
    return;
  }
  auto p = std::make_unique<Pending>();
  p->request_id = NextRequestId();
  p->frame = wire::Encode(p->request_id, block);
  p->deadline = absl::Now() + options_.request_timeout;
  p->callback = [done = std::move(done)](absl::StatusOr<Reply> r) mutable {
    done(r.ok() ? StatusOfReply(*r) : r.status());
  };
  Submit(std::move(p));
}

void ClientImpl::SendLinkBlockAsync(const wire::Block& block, std::string descriptor,
                                    absl::AnyInvocable<void(absl::Status)> done) {
  if (block.flags != wire::kBlockLinkPayload || block.link_channel == 0 ||
      descriptor.size() > wire::kMaxLinkDescriptorBytes) {
    done(absl::InvalidArgumentError(
        "SendLinkBlockAsync: the block must be flagged link payload alone, name its link, and "
        "its descriptor fit kMaxLinkDescriptorBytes"));
    return;
  }
  wire::Block b = block;
  b.key_crc = 0;
  b.value_crc = 0;
  b.link_bytes = static_cast<uint32_t>(descriptor.size());
  auto p = std::make_unique<Pending>();
  p->request_id = NextRequestId();
  p->HoldPayload(std::move(descriptor));
  p->frame = wire::Encode(p->request_id, b);
  p->deadline = absl::Now() + options_.request_timeout;
  p->callback = [done = std::move(done)](absl::StatusOr<Reply> r) mutable {
    done(r.ok() ? StatusOfReply(*r) : r.status());
  };
  Submit(std::move(p));
}

absl::StatusOr<wire::GetReply> ClientImpl::GetOverLink(const wire::Get& get,
                                                       std::string descriptor,
                                                       absl::Time deadline) {
  KVCOMP_RETURN_IF_ERROR(ValidateKey(get.model_id, get.key));
  if (hello_ok_.server_minor < 5) {
    return absl::FailedPreconditionError(
        "the server predates link gets (protocol 1.5): the cache goes over the data plane");
  }
  if (get.link_channel == 0 || get.link_capacity == 0 || get.shared || get.direct ||
      descriptor.size() > wire::kMaxLinkDescriptorBytes) {
    return absl::InvalidArgumentError(
        "GetOverLink: the get must name its link and capacity, not be shared or direct, and its "
        "descriptor fit kMaxLinkDescriptorBytes");
  }
  wire::Get g = get;
  g.link_bytes = static_cast<uint32_t>(descriptor.size());
  auto p = std::make_unique<Pending>();
  p->request_id = NextRequestId();
  p->HoldPayload(std::move(descriptor));
  p->frame = wire::Encode(p->request_id, g);
  p->deadline = RequestDeadline(deadline);
  KVCOMP_ASSIGN_OR_RETURN(Reply r, Wait(std::move(p)));
  if (r.header.type == wire::MessageType::kStatus) {
    absl::Status s = StatusOfReply(r);
    return s.ok() ? absl::InternalError("link get answered OK without naming the transfer") : s;
  }
  wire::GetReply reply;
  KVCOMP_RETURN_IF_ERROR(wire::Decode(r.frame(), &reply));
  if (!reply.link) return absl::InternalError("link get answered with a payload");
  return reply;
}

uint64_t ClientImpl::GetSharedAsync(const wire::Get& get, void* dst, size_t capacity,
                                    absl::Time deadline,
                                    absl::AnyInvocable<void(absl::StatusOr<SharedGet>)> done) {
  auto p = std::make_unique<Pending>();
  p->request_id = NextRequestId();
  const uint64_t rid = p->request_id;
  if (absl::Status s = ValidateKey(get.model_id, get.key); !s.ok()) {
    done(s);
    return rid;
  }
  p->frame = wire::Encode(p->request_id, get);
  p->deadline = RequestDeadline(deadline);
  p->dst = dst;
  p->capacity = capacity;
  p->callback = [done = std::move(done)](absl::StatusOr<Reply> r) mutable {
    if (!r.ok()) {
      done(r.status());
      return;
    }
    if (r->header.type == wire::MessageType::kStatus) {
      absl::Status s = StatusOfReply(*r);
      if (s.ok()) s = absl::InternalError("get answered OK without the cache");
      done(s);
      return;
    }
    wire::GetReply gr;
    if (absl::Status s = wire::Decode(r->frame(), &gr); !s.ok()) {
      done(s);
      return;
    }
    if (gr.shared) {
      done(SharedGet{gr.shm_bytes, true});
      return;
    }
    if (gr.has_crc && Crc32c(r->payload.data(), r->payload.size()) != gr.payload_crc) {
      done(absl::DataLossError("get: checksum mismatch of the received cache"));
      return;
    }
    const uint64_t n = r->payload.size();
    done(SharedGet{n, false, std::move(r->payload)});
  };
  Submit(std::move(p));
  return rid;
}

absl::StatusOr<RawReply> ClientImpl::SendRawForTesting(uint64_t request_id, std::string frame,
                                                       absl::string_view payload) {
  auto p = std::make_unique<Pending>();
  p->request_id = request_id;
  p->frame = std::move(frame);
  p->raw = true;
  if (!payload.empty()) {
    p->iov[0] = {const_cast<char*>(payload.data()), payload.size()};
    p->iov_count = 1;
  }
  p->deadline = absl::Now() + options_.request_timeout;
  KVCOMP_ASSIGN_OR_RETURN(Reply r, Wait(std::move(p)));
  RawReply raw;
  raw.header = r.header;
  raw.body = r.body;
  raw.payload_bytes = r.payload.size();
  if (r.header.type == wire::MessageType::kStatus) {
    raw.status = StatusOfReply(r);
  } else if (r.header.type == wire::MessageType::kBusy) {
    raw.status = BusyError("server busy");
  }
  return raw;
}

// ---- the shared worker ----

struct WorkerRegistry {
  absl::Mutex mu;
  bool exiting ABSL_GUARDED_BY(mu) = false;
  bool at_exit_registered ABSL_GUARDED_BY(mu) = false;
  pid_t pid ABSL_GUARDED_BY(mu) = 0;  // the process whose threads drive `workers`
  // This process was forked while a client held a worker: UCX's async thread was alive then and
  // is missing here, so no connection could complete.
  bool forked_while_connected ABSL_GUARDED_BY(mu) = false;
  std::map<std::string, std::shared_ptr<ClientWorker>> workers ABSL_GUARDED_BY(mu);

  // A child made by fork() inherits the workers but not their progress threads: it leaves them
  // alone (never posted to, shut down or destroyed) and makes its own at its first Connect.
  void ForgetInheritedWorkers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (pid == getpid()) return;
    if (!workers.empty()) forked_while_connected = true;
    for (auto& [key, w] : workers) new std::shared_ptr<ClientWorker>(std::move(w));  // kept
    workers.clear();
    pid = getpid();
  }
};

WorkerRegistry& Registry() {
  static WorkerRegistry* const registry = new WorkerRegistry();  // never destroyed: see ShutdownAll
  return *registry;
}

absl::Duration TickPeriod(const ClientOptions& options) {
  return std::max(absl::Milliseconds(1),
                  std::min(absl::Milliseconds(20), options.max_busy_backoff));
}

absl::StatusOr<std::shared_ptr<ClientWorker>> ClientWorker::Get(const ClientOptions& options) {
  const absl::Duration tick = TickPeriod(options);
  // Clients share a worker where its context and thread would be set up alike.
  std::string key = absl::StrCat("poll_spin=", absl::FormatDuration(options.poll_spin),
                                 ";tick=", absl::FormatDuration(tick));
  for (const auto& [name, value] : options.ucx.overrides) {
    absl::StrAppend(&key, ";", name.size(), ":", name, "=", value.size(), ":", value);
  }
  WorkerRegistry& r = Registry();
  absl::MutexLock l(&r.mu);
  if (r.exiting) return absl::UnavailableError("the process is exiting");
  r.ForgetInheritedWorkers();
  if (r.forked_while_connected) {
    return absl::FailedPreconditionError(
        "UCX cannot be used in a process forked while a kvcomp client of its parent was "
        "connected (UCX's async thread is not inherited); fork before connecting, or close the "
        "parent's clients first, or exec");
  }
  auto it = r.workers.find(key);
  if (it != r.workers.end()) return it->second;
  std::shared_ptr<ClientWorker> w(new ClientWorker());
  KVCOMP_ASSIGN_OR_RETURN(w->loop_, WorkerLoop::Create(options.ucx, options.poll_spin));
  contexts_created.fetch_add(1);
  workers_created.fetch_add(1);
  workers_live.fetch_add(1);
  KVCOMP_RETURN_IF_ERROR(
      w->loop_->SetAmHandler(wire::kAmIdReply, &ClientWorker::OnAm, w.get()));
  ClientWorker* raw = w.get();
  w->loop_->Start([raw] { raw->Tick(); }, tick);
  if (!r.at_exit_registered) {
    // Before UCX's own teardown at exit (registered earlier, so run later): the progress
    // threads stop and the endpoints close while UCX is whole.
    std::atexit(&ClientWorker::ShutdownAll);
    pthread_atfork(&ClientWorker::DestroyIdleBeforeFork, nullptr, nullptr);
    r.at_exit_registered = true;
  }
  r.workers.emplace(key, w);
  return w;
}

void ClientWorker::ShutdownAll() {
  std::map<std::string, std::shared_ptr<ClientWorker>> workers;
  {
    WorkerRegistry& r = Registry();
    absl::MutexLock l(&r.mu);
    r.exiting = true;
    r.ForgetInheritedWorkers();
    workers.swap(r.workers);
  }
  for (auto& [key, w] : workers) {
    ClientWorker* raw = w.get();
    w->loop_->Shutdown([raw] { raw->CloseAll(); });
  }
  // A worker that no client holds any more is destroyed here; one held by a client that is
  // still alive goes with that client.
}

// A child made by fork() can use UCX only if the parent had no UCX worker alive then (UCX's
// async thread is not inherited). Workers no client holds are destroyed before a fork, so a
// child forked while no connection is open connects as the parent would; the parent makes a new
// worker at its next Connect.
void ClientWorker::DestroyIdleBeforeFork() {
  std::vector<std::shared_ptr<ClientWorker>> idle;
  {
    WorkerRegistry& r = Registry();
    absl::MutexLock l(&r.mu);
    r.ForgetInheritedWorkers();
    for (auto it = r.workers.begin(); it != r.workers.end();) {
      // Only the registry holds it: no client, no connection closing.
      if (it->second.use_count() == 1) {
        idle.push_back(std::move(it->second));
        r.workers.erase(it++);
      } else {
        ++it;
      }
    }
  }
}

ClientWorker::~ClientWorker() {
  if (loop_ == nullptr) return;  // WorkerLoop::Create failed
  loop_->Shutdown([this] { CloseAll(); });
  loop_.reset();
  workers_live.fetch_sub(1);
}

void ClientWorker::Add(std::shared_ptr<ClientImpl> client) {
  ClientImpl* raw = client.get();
  clients_.emplace(raw, std::move(client));
}

bool ClientWorker::Claim(uint64_t request_id, ClientImpl* client) {
  return requests_.emplace(request_id, client).second;
}

void ClientWorker::ScheduleRemove(ClientImpl* client) {
  // Run later, outside the callback that asked: removing may destroy the client.
  loop_->Post([this, client] { RemoveIfDone(client); });
}

void ClientWorker::RemoveIfDone(ClientImpl* client) {
  auto it = clients_.find(client);
  if (it == clients_.end() || !it->second->Done()) return;
  std::shared_ptr<ClientImpl> c = std::move(it->second);
  clients_.erase(it);
  c->NotifyClosed();
}

void ClientWorker::Tick() {
  std::vector<std::shared_ptr<ClientImpl>> clients;
  clients.reserve(clients_.size());
  for (const auto& [raw, c] : clients_) clients.push_back(c);
  for (const auto& c : clients) {
    c->Tick();
    if (c->Done()) RemoveIfDone(c.get());
  }
}

void ClientWorker::CloseAll() {
  std::vector<std::shared_ptr<ClientImpl>> clients;
  for (const auto& [raw, c] : clients_) clients.push_back(c);
  for (const auto& c : clients) {
    c->BeginClose(absl::UnavailableError("client closed: the process is exiting"));
  }
  loop_->ProgressUntil(
      [&clients] {
        return std::all_of(clients.begin(), clients.end(),
                           [](const std::shared_ptr<ClientImpl>& c) { return c->Done(); });
      },
      absl::Seconds(2));
  for (const auto& c : clients) {
    c->AbandonAll();
    c->NotifyClosed();
  }
  clients_.clear();
  requests_.clear();
  endpoints_.clear();
}

void ClientWorker::OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<ClientWorker*>(arg);
  auto it = self->endpoints_.find(ep);
  if (it != self->endpoints_.end()) it->second->EndpointFailed(status);
}

ucs_status_t ClientWorker::OnAm(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<ClientWorker*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  const uint64_t rid =
      wire::PeekRequestId(absl::string_view(static_cast<const char*>(header), header_length));
  auto it = self->requests_.find(rid);
  if (it == self->requests_.end()) {
    // A late reply of a request that already failed, or one no request of ours matches.
    if (rndv) DropRendezvous(self->loop_->worker(), data);
    return UCS_OK;
  }
  it->second->ReplyArrived(header, header_length, data, length, rndv);
  return UCS_OK;
}

// What callers hold: closes the connection when dropped. The connection itself lives on while
// UCX still references it (its endpoint closing, its requests completing).
class ClientHandle : public UcxClient {
 public:
  explicit ClientHandle(std::shared_ptr<ClientImpl> impl) : impl_(std::move(impl)) {}
  ~ClientHandle() override { impl_->Close(); }

  const wire::HelloOk& server_info() const override { return impl_->server_info(); }
  bool connected() const override { return impl_->connected(); }
  absl::Status DevicePayloads() const override { return impl_->DevicePayloads(); }
  bool LocalCudaMemory() const override { return impl_->LocalCudaMemory(); }
  absl::StatusOr<uint64_t> PutBegin(const wire::PutBegin& begin) override {
    return impl_->PutBegin(begin);
  }
  absl::Status SendBlock(const wire::Block& block, const void* keys, const void* values,
                         MemoryType memory) override {
    return impl_->SendBlock(block, keys, values, memory);
  }
  void SendBlockAsync(const wire::Block& block, const void* keys, const void* values,
                      absl::AnyInvocable<void(absl::Status)> done, MemoryType memory) override {
    impl_->SendBlockAsync(block, keys, values, std::move(done), memory);
  }
  absl::StatusOr<wire::CacheSummary> PutCommit(uint64_t put_id, uint64_t num_blocks) override {
    return impl_->PutCommit(put_id, num_blocks);
  }
  absl::Status PutAbort(uint64_t put_id) override { return impl_->PutAbort(put_id); }
  absl::StatusOr<FetchedCache> Get(absl::string_view model_id, absl::string_view key,
                                   wire::Representation representation,
                                   absl::Time deadline) override {
    // Same-host shared memory where the connection has it: one get request either way (the
    // daemon sends a cache larger than the room there as the reply's payload).
    ShmChannel* shm = SharedMemory();
    if (shm != nullptr && shm->usable()) {
      absl::StatusOr<FetchedCache> r =
          shm->Get({std::string(model_id), std::string(key), representation}, deadline);
      if (r.ok() || AfterLinkFailure(r.status()) != LinkVerdict::kNextLink) return r;
    }
    return impl_->Get(model_id, key, representation, deadline);
  }
  absl::StatusOr<size_t> GetInto(absl::string_view model_id, absl::string_view key,
                                 wire::Representation representation, void* dst,
                                 size_t capacity, MemoryType memory,
                                 absl::Time deadline) override {
    return impl_->GetInto(model_id, key, representation, dst, capacity, memory, deadline);
  }
  absl::StatusOr<wire::CacheSummary> Lookup(absl::string_view model_id, absl::string_view key,
                                            absl::Time deadline) override {
    return impl_->Lookup(model_id, key, deadline);
  }
  absl::Status Delete(absl::string_view model_id, absl::string_view key) override {
    return impl_->Delete(model_id, key);
  }
  absl::Status Ping() override { return impl_->Ping(); }
  absl::StatusOr<RawReply> SendRawForTesting(uint64_t request_id, std::string frame,
                                             absl::string_view payload) override {
    return impl_->SendRawForTesting(request_id, std::move(frame), payload);
  }
  ShmChannel* SharedMemory() override {
    const ClientOptions& o = impl_->options();
    if (!o.shared_memory || !(impl_->server_info().server_flags & wire::kServerSharedMemory)) {
      return nullptr;
    }
    absl::MutexLock lock(&shm_mu_);
    if (shm_ == nullptr) {
      shm_ = std::make_unique<ShmChannel>(
          this,
          ShmChannelOptions{o.shm_put_region_bytes, o.shm_max_get_region_bytes, o.shm_direct,
                            o.shm_copy_lanes});
    }
    return shm_.get();
  }
  void SendSharedBlockAsync(const wire::Block& block,
                            absl::AnyInvocable<void(absl::Status)> done) override {
    impl_->SendSharedBlockAsync(block, std::move(done));
  }
  void SendLinkBlockAsync(const wire::Block& block, std::string descriptor,
                          absl::AnyInvocable<void(absl::Status)> done) override {
    impl_->SendLinkBlockAsync(block, std::move(descriptor), std::move(done));
  }
  absl::StatusOr<wire::GetReply> GetOverLink(const wire::Get& get, std::string descriptor,
                                             absl::Time deadline) override {
    return impl_->GetOverLink(get, std::move(descriptor), deadline);
  }
  uint64_t GetSharedAsync(const wire::Get& get, void* dst, size_t capacity, absl::Time deadline,
                          absl::AnyInvocable<void(absl::StatusOr<SharedGet>)> done) override {
    return impl_->GetSharedAsync(get, dst, capacity, deadline, std::move(done));
  }
  void Close() override { impl_->Close(); }

 private:
  const std::shared_ptr<ClientImpl> impl_;
  absl::Mutex shm_mu_;
  // Declared last: destroyed first, while the connection can still complete its blocks.
  std::unique_ptr<ShmChannel> shm_ ABSL_GUARDED_BY(shm_mu_);
};

}  // namespace

// ---- UCX releases ----

namespace {

using UcxSettings = std::map<std::string, std::string>;

// The UCX settings (UcxInteropSettings) that connected to each server this process reached, by
// endpoint: a reconnect uses them from the start.
struct KnownServers {
  absl::Mutex mu;
  std::map<std::string, UcxSettings> settings ABSL_GUARDED_BY(mu);
};
KnownServers& Known() {
  static KnownServers* const known = new KnownServers();
  return *known;
}

// `options` plus `settings`, less what the user chose (UnlessUserSet).
ClientOptions With(const ClientOptions& options, const UcxSettings& settings) {
  ClientOptions o = options;
  for (const auto& [name, value] : UnlessUserSet(settings, options.ucx)) {
    o.ucx.overrides[name] = value;
  }
  return o;
}

// How a connection attempt failed, where it tells something about the server's UCX settings.
// The least hello timeout a kvcompd can have (data_plane.hello_timeout_seconds >= 0.1): a
// connection closed before its hello got through sooner than this after the connect was not
// closed by a daemon's hello timeout.
constexpr absl::Duration kShortestHelloTimeout = absl::Milliseconds(100);

struct ConnectFailure {
  bool rejected = false;  // the server's UCX refused the connection request (RejectedByPeer)
  bool unwired = false;   // the connection failed before the hello got through (NeverWiredUp)
  // ... and the server closed it (a reset or an endpoint timeout), no sooner than
  // kShortestHelloTimeout after the connect: what a daemon with CM_USE_ALL_DEVICES=n does at its
  // hello timeout to a client before 1.14 on UCX's defaults (ClosedBeforeHelloAfter).
  bool closed_at_hello_timeout = false;
};

absl::StatusOr<std::shared_ptr<ClientImpl>> ConnectOnce(const Endpoint& endpoint,
                                                        absl::string_view tenant,
                                                        absl::string_view token,
                                                        const ClientOptions& options,
                                                        ConnectFailure* failure) {
  *failure = ConnectFailure{};
  KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<ClientWorker> worker, ClientWorker::Get(options));
  auto client = std::make_shared<ClientImpl>(options, std::move(worker));
  if (absl::Status s = client->Connect(endpoint, tenant, token); !s.ok()) {
    client->Close();
    failure->rejected = client->RejectedByPeer();
    failure->unwired = client->NeverWiredUp();
    failure->closed_at_hello_timeout = client->ClosedBeforeHelloAfter(kShortestHelloTimeout);
    return s;
  }
  return client;
}

bool Before114(UcxVersion v) { return v.known() && v.major == 1 && v.minor < 14; }

// A client on UCX before 1.14 forgets CM_USE_ALL_DEVICES=n for an endpoint when a connection
// made there is lost (the daemon closed it, or exited): if the daemon there was restarted on
// UCX's defaults (y), a connect with n would make UCX 1.13 abort the process. Its next connect
// starts from UCX's defaults. Clients on 1.14 or later keep what connected.
void ForgetOneDevice(const std::string& endpoint) {
  if (!Before114(LocalUcxVersion())) return;
  KnownServers& k = Known();
  absl::MutexLock l(&k.mu);
  auto it = k.settings.find(endpoint);
  if (it != k.settings.end() && it->second.count("CM_USE_ALL_DEVICES") > 0) k.settings.erase(it);
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxClient>> UcxClient::Connect(const Endpoint& endpoint,
                                                              absl::string_view tenant,
                                                              absl::string_view token,
                                                              const ClientOptions& options) {
  // The two ends' UCX releases and the server's settings may need settings on this side
  // (docs/protocol.md, "UCX releases"). Every first try is on UCX's defaults; then:
  // - on 1.14 or later: a server before 1.14 refuses the request (UCS_ERR_REJECTED, before any
  //   hello, within milliseconds); the client connects again with CM_USE_ALL_DEVICES=n and
  //   PROTO_ENABLE=n, which a server before 1.14 with ucx_interop auto (n) answers;
  // - before 1.14: a server on the same release with ucx_interop auto (n) never answers the
  //   hello and closes the connection at its hello timeout; the client connects again with
  //   CM_USE_ALL_DEVICES=n, only after that failure (the hello not through, the connection
  //   reset by the server, no sooner than the shortest hello timeout). Never the other way
  //   round (n first), nor after any other failure: UCX 1.13 aborts the process when its n
  //   endpoint meets a server on its default (y).
  // Hello-ok says the server's release; what connected is kept for the endpoint.
  const std::string where = endpoint.ToString();
  const UcxVersion local = LocalUcxVersion();
  UcxSettings settings = UcxInteropSettings(local, UcxVersion{});
  {
    KnownServers& k = Known();
    absl::MutexLock l(&k.mu);
    auto it = k.settings.find(where);
    if (it != k.settings.end()) settings = it->second;
  }
  ClientOptions o = With(options, settings);
  ConnectFailure failure;
  absl::StatusOr<std::shared_ptr<ClientImpl>> c =
      ConnectOnce(endpoint, tenant, token, o, &failure);
  if (!c.ok() && failure.rejected && !Before114(local)) {
    const UcxSettings older = UcxInteropSettings(local, UcxVersion{1, 13, 0});
    if (With(options, older).ucx.overrides != o.ucx.overrides) {
      settings = older;
      o = With(options, settings);
      c = ConnectOnce(endpoint, tenant, token, o, &failure);
    }
    if (!c.ok() && !absl::IsUnauthenticated(c.status()) &&
        !absl::IsPermissionDenied(c.status())) {
      return absl::Status(
          c.status().code(),
          absl::StrCat(c.status().message(), " (the daemon's UCX refused the connection ",
                       "request itself: the daemon is draining or at its connection limit, or ",
                       "it runs UCX before 1.14, which takes clients on UCX ", local.ToString(),
                       " only with data_plane.ucx_interop auto; docs/protocol.md, \"UCX ",
                       "releases\")"));
    }
  } else if (!c.ok() && failure.closed_at_hello_timeout && Before114(local)) {
    const UcxSettings one_device = UcxOneDeviceSettings(local);
    if (With(options, one_device).ucx.overrides != o.ucx.overrides) {
      settings = one_device;
      o = With(options, settings);
      c = ConnectOnce(endpoint, tenant, token, o, &failure);
    }
  } else if (!c.ok() && failure.rejected && Before114(local)) {
    return absl::Status(
        c.status().code(),
        absl::StrCat(c.status().message(), " (the daemon's UCX refused the connection ",
                     "request itself: the daemon is draining or at its connection limit, or ",
                     "it runs UCX 1.14 or later, which does not accept clients on UCX ",
                     local.ToString(), "; docs/protocol.md, \"UCX releases\")"));
  }
  if (!c.ok()) return c.status();
  std::shared_ptr<ClientImpl> client = *std::move(c);
  // Connected; the server's release may need more than was set (where the user set some of
  // it): add what is missing and connect once more.
  const wire::HelloOk& hello = client->server_info();
  UcxSettings needed = settings;
  for (const auto& [name, value] :
       UcxInteropSettings(local, UcxVersion{hello.ucx_major, hello.ucx_minor, hello.ucx_release})) {
    needed.emplace(name, value);
  }
  if (With(options, needed).ucx.overrides != o.ucx.overrides) {
    client->Close();
    settings = needed;
    o = With(options, settings);
    KVCOMP_ASSIGN_OR_RETURN(client, ConnectOnce(endpoint, tenant, token, o, &failure));
  }
  {
    KnownServers& k = Known();
    absl::MutexLock l(&k.mu);
    k.settings[where] = settings;
  }
  return std::unique_ptr<UcxClient>(new ClientHandle(std::move(client)));
}

UcxClientStats GetUcxClientStats() {
  UcxClientStats s;
  s.contexts_created = contexts_created.load();
  s.workers_created = workers_created.load();
  s.workers_live = workers_live.load();
  s.endpoints_created = endpoints_created.load();
  s.endpoints_open = endpoints_open.load();
  return s;
}

}  // namespace transport
}  // namespace kvcomp
