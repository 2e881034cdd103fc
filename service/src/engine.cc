#include "engine.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace service {

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options,
                                                       double tenant_share) {
  std::unique_ptr<Engine> e(new Engine(options));
  if (options.backend == "cuda") {
    if (!CudaAvailable()) {
      return absl::FailedPreconditionError(
          "engine.backend is cuda but this build has no CUDA or no GPU is visible");
    }
    e->use_cuda_ = true;
  } else if (options.backend == "auto") {
    e->use_cuda_ = CudaAvailable();
  } else if (options.backend != "cpu") {
    return absl::InvalidArgumentError(absl::StrCat("unknown backend ", options.backend));
  }
  const int workers = std::max(1, options.workers);
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  e->threads_per_backend_ =
      options.cpu_threads > 0 ? options.cpu_threads : std::max(1, hw / workers);
  for (int i = 0; i < workers; ++i) {
    KVCOMP_ASSIGN_OR_RETURN(std::unique_ptr<Backend> b, e->NewBackend());
    e->worker_backends_.push_back(std::move(b));
  }
  e->description_ = e->worker_backends_[0]->Describe();
  e->pool_ = std::make_unique<TaskPool>(workers, options.queue_capacity, nullptr, tenant_share);
  return e;
}

Engine::~Engine() { Shutdown(); }

void Engine::Shutdown() {
  if (pool_) pool_->Shutdown();
}

absl::StatusOr<std::unique_ptr<Backend>> Engine::NewBackend() const {
  if (use_cuda_) {
    CudaBackendOptions o;
    o.device = options_.cuda_device;
    return MakeCudaBackend(o);
  }
  CpuBackendOptions o;
  o.num_threads = threads_per_backend_;
  return MakeCpuBackend(o);
}

bool Engine::TrySubmit(absl::string_view tenant, Task task) {
  return pool_->TrySubmitToWorker(tenant, [this, task = std::move(task)](int worker) mutable {
    task(*worker_backends_[worker]);
  });
}

void Engine::Submit(absl::string_view tenant, Task task) {
  pool_->SubmitToWorker(tenant, [this, task = std::move(task)](int worker) mutable {
    task(*worker_backends_[worker]);
  });
}

absl::StatusOr<Engine::StreamLease> Engine::LeaseStream() {
  {
    absl::MutexLock lock(&stream_mu_);
    if (!idle_streams_.empty()) {
      std::unique_ptr<Backend> b = std::move(idle_streams_.back());
      idle_streams_.pop_back();
      return StreamLease(this, std::move(b));
    }
  }
  KVCOMP_ASSIGN_OR_RETURN(std::unique_ptr<Backend> b, NewBackend());
  return StreamLease(this, std::move(b));
}

Engine::StreamLease::~StreamLease() {
  if (backend_ == nullptr) return;
  absl::MutexLock lock(&engine_->stream_mu_);
  engine_->idle_streams_.push_back(std::move(backend_));
}

}  // namespace service
}  // namespace kvcomp
