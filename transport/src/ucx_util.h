// UCX plumbing shared by the server and the client: owning handles for the context and worker,
// and WorkerLoop, the progress thread that owns a worker and runs posted work on it.
#ifndef KVCOMP_TRANSPORT_SRC_UCX_UTIL_H_
#define KVCOMP_TRANSPORT_SRC_UCX_UTIL_H_

#include <ucp/api/ucp.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/ucx.h"

namespace kvcomp {
namespace transport {

class UcpContext {
 public:
  // A context with active messages (and wakeup when `wakeup`), configured by `config` on top of
  // the UCX_* environment.
  static absl::StatusOr<UcpContext> Create(const UcxConfig& config, bool wakeup);
  UcpContext() = default;
  UcpContext(UcpContext&& o) noexcept : h_(o.h_) { o.h_ = nullptr; }
  UcpContext& operator=(UcpContext&& o) noexcept {
    std::swap(h_, o.h_);
    return *this;
  }
  ~UcpContext() {
    if (h_ != nullptr) ucp_cleanup(h_);
  }
  ucp_context_h get() const { return h_; }

 private:
  ucp_context_h h_ = nullptr;
};

class UcpWorker {
 public:
  static absl::StatusOr<UcpWorker> Create(ucp_context_h context, bool wakeup);
  UcpWorker() = default;
  UcpWorker(UcpWorker&& o) noexcept : h_(o.h_) { o.h_ = nullptr; }
  UcpWorker& operator=(UcpWorker&& o) noexcept {
    std::swap(h_, o.h_);
    return *this;
  }
  ~UcpWorker() {
    if (h_ != nullptr) ucp_worker_destroy(h_);
  }
  ucp_worker_h get() const { return h_; }

 private:
  ucp_worker_h h_ = nullptr;
};

// A registration of memory with a context (ucp_mem_map of existing memory, its memory type
// stated), unmapped when destroyed. The server registers the device buffers its handler gives
// for a block's receive for the time of that receive (a handler's buffer may be freed once the
// block is consumed). Use on the thread that owns the context's worker.
class UcpMemReg {
 public:
  static absl::StatusOr<std::unique_ptr<UcpMemReg>> Map(ucp_context_h context, void* data,
                                                        size_t size, ucs_memory_type_t type);
  ~UcpMemReg() {
    if (h_ != nullptr) ucp_mem_unmap(context_, h_);
  }
  ucp_mem_h get() const { return h_; }

 private:
  UcpMemReg(ucp_context_h c, ucp_mem_h h) : context_(c), h_(h) {}
  ucp_context_h context_;
  ucp_mem_h h_;
};

// Owns a context, a worker and the thread that progresses it. Everything touching the worker
// runs on that thread: Post() queues work there from any thread. Held by shared_ptr so that
// completion callbacks of the server's handler can post after the owner stopped (dropped).
class WorkerLoop {
 public:
  static absl::StatusOr<std::shared_ptr<WorkerLoop>> Create(const UcxConfig& config,
                                                           absl::Duration poll_spin);
  ~WorkerLoop();

  ucp_context_h context() const { return context_.get(); }
  ucp_worker_h worker() const { return worker_.get(); }
  // True when the context can send from and receive into CUDA memory.
  bool cuda_memory() const { return cuda_memory_; }
  // Registers `cb(arg, ...)` for whole active messages of id `am_id` on the worker. Call before
  // Start().
  absl::Status SetAmHandler(unsigned am_id, ucp_am_recv_callback_t cb, void* arg);

  // Starts the thread; `tick` runs on it about every `tick_period`.
  void Start(absl::AnyInvocable<void()> tick, absl::Duration tick_period);
  // Runs `fn` on the loop thread. False (fn dropped, not run) once the loop stopped.
  bool Post(absl::AnyInvocable<void()> fn);
  // Runs `fn` on the loop thread, then ends the thread after `fn` returns and joins it.
  // `fn` may call ProgressUntil to finish outstanding UCX work. Idempotent.
  void Shutdown(absl::AnyInvocable<void()> fn);
  // On the loop thread: progresses the worker until `done()` or `timeout`.
  template <typename F>
  void ProgressUntil(F done, absl::Duration timeout) {
    const absl::Time end = absl::Now() + timeout;
    while (!done() && absl::Now() < end) ucp_worker_progress(worker_.get());
  }
  bool InLoopThread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  WorkerLoop() = default;
  void Run();
  bool RunPosted();
  void Sleep(absl::Duration max_wait);

  UcpContext context_;
  UcpWorker worker_;
  int efd_ = -1;
  bool cuda_memory_ = false;
  absl::Duration poll_spin_;
  absl::AnyInvocable<void()> tick_;
  absl::Duration tick_period_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  std::vector<absl::AnyInvocable<void()>> posted_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> has_posted_{false};
  std::atomic<bool> sleeping_{false};  // the loop thread may be blocked in poll()
};

// Unimplemented for IPv6 socket addresses on UCX <= 1.13, whose tcp sockaddr connection manager
// corrupts memory when it handles them; OK otherwise.
absl::Status CheckAddressFamilySupported(int family, absl::string_view what);

// FailedPrecondition for an IPv4 listen address that UCX clients could not finish connecting
// to: one that is no interface's address (127.0.0.2 when lo has only 127.0.0.1), or not the
// first IPv4 address of its interface, or on an interface that is down. UCX's TCP transport
// listens for the data lanes on the first address of the interface a connection arrived on,
// while the client dials the address it connected to. OK for the wildcard and for IPv6.
absl::Status CheckListenAddressServesDataLanes(const struct sockaddr* addr, absl::string_view what);

// Makes the primary CUDA context of the device that owns `device_ptr` current on the calling
// thread (the loop thread, before UCX touches that memory: UCX's CUDA transports work in the
// calling thread's context). The CUDA driver is opened at run time (gpu_link.h).
absl::Status BindDeviceContext(const void* device_ptr);

// Refuses a rendezvous message without receiving its data (the sender's request completes).
void DropRendezvous(ucp_worker_h worker, void* data_desc);

// The IP address and port of a sockaddr as "ip:port" / "[ip6]:port".
std::string SockaddrToString(const struct sockaddr* sa);

}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_SRC_UCX_UTIL_H_
