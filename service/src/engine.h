// Engine: kvcompd's compression workers. A fixed pool of threads, each with its own Backend
// (CUDA on engine.cuda_device when present or asked for, else CPU), made once when the engine is
// created and kept until it ends; a task runs on a worker with that worker's backend. Tasks are
// queued per tenant and taken in turn (TaskPool); TrySubmit refuses work beyond the queue's
// capacity or the tenant's share of it, and the caller answers Busy.
//
// A block-wise put keeps compressor state on one backend from its first block to its commit,
// so it leases a stream backend (LeaseStream) instead: stream backends are made on first need and
// reused by later block-wise puts, never made per put. They are CPU backends on every engine:
// the block-wise compressor keeps its working set in host memory (kvcomp/kernels/pipeline.h).
//
// On a GPU the engine also owns the device side of a put's data path: one DeviceUploader (a
// stream and page-locked staging buffers, made once) through which every put's blocks reach the
// device as they arrive; what a put holds there is drawn from the device's budget in the
// daemon's DeviceEnv (device_env.h; ReserveDevice). A CUDA error that leaves the device unusable (a sticky error: the context is
// lost) marks the engine failed (failed(), failure()): it takes no more puts, and the daemon
// reports not ready, drains and exits for its supervisor to restart it.
//
// An engine runs on one device (cuda_device(); -1 on the CPU). A daemon with several GPUs has
// one engine per device, and an EngineSet (engine_set.h) that places each put on one of them.
//
// Thread-safety: every method may be called from any thread.
#ifndef KVCOMP_SERVICE_SRC_ENGINE_H_
#define KVCOMP_SERVICE_SRC_ENGINE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "device_env.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/pipeline.h"
#include "kvcomp/service/options.h"
#include "task_pool.h"

namespace kvcomp {
namespace service {

class Engine {
 public:
  // Makes the workers' backends (engine.* options; `tenant_share` of the queue per tenant); an
  // engine that cannot make one fails here, not at the first put. InvalidArgument (unknown
  // backend), FailedPrecondition (cuda asked for, none present).
  // `env`: the daemon's DeviceEnv; null = one of the engine's own (budget
  // engine.gpu_memory_bytes, CUDA driver memory).
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options,
                                                        double tenant_share = 1.0,
                                                        std::shared_ptr<DeviceEnv> env = nullptr);
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

  // GPU memory held by one put, returned to the DeviceEnv when the reservation ends.
  using DeviceReservation = DeviceEnv::Grant;
  // Draws `bytes` for one put from this engine's device's budget (DeviceEnv, drawer kPuts).
  // ResourceExhausted when the budget (engine.gpu_memory_bytes) would be exceeded; Unavailable
  // once the engine has failed. A CPU engine counts reservations too (what its open
  // whole-sequence puts hold, for placement) but has no budget.
  absl::StatusOr<DeviceReservation> ReserveDevice(uint64_t bytes);
  // The GPU memory a whole-sequence put of `layout` x `num_tokens` holds on the device at most:
  // its K and V, the keys' sums of the staging, the compressed arrays (bounded by every token
  // kept), positions, one layer's evicted lists, the moments, and the encoded cache a GPU-tier
  // put writes beside them.
  static uint64_t DeviceBytesForPut(const KvLayout& layout, uint64_t num_tokens,
                                    bool moments);
  // What this engine's device holds in all (every drawer), and its budget (0 = none; always 0
  // on the CPU).
  uint64_t device_reserved_bytes() const { return env_->held_bytes(cuda_device()); }
  uint64_t device_cap_bytes() const { return use_cuda_ ? env_->budget_bytes() : 0; }
  // The env this engine draws from, shared by the engines of one EngineSet.
  DeviceEnv& device_env() const { return *env_; }
  // The uploader every put's blocks go through on a GPU engine; null on the CPU.
  DeviceUploader* uploader() const { return uploader_.get(); }

  // After a put failed on `backend` with `error`: a CUDA error is probed (a synchronisation of
  // the backend's stream); when the device no longer answers, the engine is marked failed.
  // Returns true when the engine is (now) failed.
  bool CheckAfterError(Backend& backend, const absl::Status& error);
  bool failed() const { return failed_.load(); }
  std::string failure() const;
  // Test hook, as no real way to lose a CUDA context on purpose exists: from now on the next
  // compression fails at FaultPoint() and CheckAfterError finds the device lost, as after a
  // sticky CUDA error. kvcompd arms it when KVCOMP_ENGINE_TEST_STICKY_FAULT is set (tests only).
  void InjectStickyFaultForTest() { inject_sticky_.store(true); }
  // Internal while an injected fault is armed, else OK; called where a compression starts.
  absl::Status FaultPoint() const;

  // "cpu (N threads)" or the CUDA device.
  const std::string& description() const { return description_; }
  bool uses_gpu() const { return use_cuda_; }
  // The CUDA device this engine runs on; -1 on the CPU.
  int cuda_device() const { return use_cuda_ ? options_.cuda_device : -1; }
  size_t queue_depth() const { return pool_ ? pool_->depth() : 0; }
  bool WaitIdle(absl::Duration timeout) const { return pool_->WaitIdle(timeout); }
  // Runs what is queued, then joins the workers.
  void Shutdown();

 private:
  explicit Engine(const EngineOptions& options) : options_(options) {}
  absl::StatusOr<std::unique_ptr<Backend>> NewBackend(bool cpu = false) const;

  const EngineOptions options_;
  bool use_cuda_ = false;
  int threads_per_backend_ = 1;
  std::string description_;
  std::vector<std::unique_ptr<Backend>> worker_backends_;  // one per worker, index = worker
  std::unique_ptr<TaskPool> pool_;
  std::unique_ptr<DeviceUploader> uploader_;
  std::shared_ptr<DeviceEnv> env_;
  std::atomic<bool> failed_{false};
  std::atomic<bool> inject_sticky_{false};
  mutable absl::Mutex failure_mu_;
  std::string failure_ ABSL_GUARDED_BY(failure_mu_);
  absl::Mutex stream_mu_;
  std::vector<std::unique_ptr<Backend>> idle_streams_ ABSL_GUARDED_BY(stream_mu_);
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_ENGINE_H_
