// Engine: kvcompd's compression workers. A fixed pool of threads, each with its own Backend
// (CUDA on engine.cuda_device when present or asked for, else CPU), made once when the engine is
// created and kept until it ends; a task runs on a worker with that worker's backend. Tasks are
// queued per tenant and taken in turn (TaskPool); TrySubmit refuses work beyond the queue's
// capacity or the tenant's share of it, and the caller answers Busy.
//
// A block-wise put keeps compressor state on one backend from its first block to its commit,
// so it leases a stream backend (LeaseStream) instead: stream backends are made on first need and
// reused by later block-wise puts, never made per put.
//
// Thread-safety: every method may be called from any thread.
#ifndef KVCOMP_SERVICE_SRC_ENGINE_H_
#define KVCOMP_SERVICE_SRC_ENGINE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/service/options.h"
#include "task_pool.h"

namespace kvcomp {
namespace service {

class Engine {
 public:
  // Makes the workers' backends (engine.* options; `tenant_share` of the queue per tenant); an
  // engine that cannot make one fails here, not at the first put. InvalidArgument (unknown
  // backend), FailedPrecondition (cuda asked for, none present).
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options,
                                                        double tenant_share = 1.0);
  ~Engine();

  using Task = absl::AnyInvocable<void(Backend& backend)>;
  // Queues `task`; false when the queue or `tenant`'s share of it is full.
  bool TrySubmit(absl::string_view tenant, Task task);
  // Queues follow-up work whose memory is bounded elsewhere (block-wise appends): never
  // refused, but counted in the tenant's share.
  void Submit(absl::string_view tenant, Task task);

  // A backend for one block-wise put, returned to the engine when the lease ends.
  class StreamLease {
   public:
    StreamLease(StreamLease&&) = default;
    StreamLease& operator=(StreamLease&&) = default;
    ~StreamLease();
    Backend& backend() const { return *backend_; }

   private:
    friend class Engine;
    StreamLease(Engine* engine, std::unique_ptr<Backend> backend)
        : engine_(engine), backend_(std::move(backend)) {}
    Engine* engine_;
    std::unique_ptr<Backend> backend_;
  };
  absl::StatusOr<StreamLease> LeaseStream();

  // "cpu (N threads)" or the CUDA device.
  const std::string& description() const { return description_; }
  bool uses_gpu() const { return use_cuda_; }
  size_t queue_depth() const { return pool_ ? pool_->depth() : 0; }
  bool WaitIdle(absl::Duration timeout) const { return pool_->WaitIdle(timeout); }
  // Runs what is queued, then joins the workers.
  void Shutdown();

 private:
  explicit Engine(const EngineOptions& options) : options_(options) {}
  absl::StatusOr<std::unique_ptr<Backend>> NewBackend() const;

  const EngineOptions options_;
  bool use_cuda_ = false;
  int threads_per_backend_ = 1;
  std::string description_;
  std::vector<std::unique_ptr<Backend>> worker_backends_;  // one per worker, index = worker
  std::unique_ptr<TaskPool> pool_;
  absl::Mutex stream_mu_;
  std::vector<std::unique_ptr<Backend>> idle_streams_ ABSL_GUARDED_BY(stream_mu_);
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_ENGINE_H_
