#include "engine.h"

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/scoring_ops.h"

namespace kvcomp {
namespace service {

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options,
                                                       double tenant_share,
                                                       std::shared_ptr<DeviceEnv> env) {
  std::unique_ptr<Engine> e(new Engine(options));
  e->env_ = env != nullptr ? std::move(env)
                           : std::make_shared<DeviceEnv>(options.gpu_memory_bytes,
                                                         DeviceEnv::CudaMemory());
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
  if (e->use_cuda_) {
    KVCOMP_ASSIGN_OR_RETURN(e->uploader_, DeviceUploader::Create(options.cuda_device));
  }
  if (const char* f = std::getenv("KVCOMP_ENGINE_TEST_STICKY_FAULT"); f != nullptr && *f != 0) {
    e->inject_sticky_.store(true);
  }
  e->pool_ = std::make_unique<TaskPool>(workers, options.queue_capacity, nullptr, tenant_share);
  return e;
}

Engine::~Engine() { Shutdown(); }

void Engine::Shutdown() {
  if (pool_) pool_->Shutdown();
}

absl::StatusOr<std::unique_ptr<Backend>> Engine::NewBackend(bool cpu) const {
  if (use_cuda_ && !cpu) {
    CudaBackendOptions o;
    o.device = options_.cuda_device;
    // The device memory a put's compression and encoding freed stays mapped in the worker's
    // pool for the next put (a put at 32K tokens takes gigabytes, and mapping them afresh cost
    // about as much as the put's kernels on an H200): up to the worker's share of
    // engine.gpu_memory_bytes, or without a cap a sixteenth of the device's memory per worker.
    // A worker whose pool cannot serve a request hands what it keeps back and asks again.
    const uint64_t workers = static_cast<uint64_t>(std::max(1, options_.workers));
    uint64_t keep = options_.gpu_memory_bytes / workers;
    if (options_.gpu_memory_bytes == 0) {
      absl::StatusOr<DeviceMemory> mem = QueryDeviceMemory(options_.cuda_device);
      keep = mem.ok() ? mem->total_bytes / 16 : 0;
    }
    o.pool_keep_bytes = std::max(o.pool_keep_bytes, keep);
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

uint64_t Engine::DeviceBytesForPut(const KvLayout& layout, uint64_t num_tokens, bool moments) {
  const uint64_t input = layout.CacheBytes(num_tokens);
  // Kept keys and values (at most every token), positions and counts, the evicted lists of every
  // layer (the layers are compressed together) and the moments of every head.
  const uint64_t heads = uint64_t{layout.num_layers} * layout.num_kv_heads;
  uint64_t out = input + heads * num_tokens * 4 + heads * 4 + heads * num_tokens * 4;
  if (moments) {
    out += heads * (8 + 2 * uint64_t{layout.head_dim} * 4 +
                    uint64_t{layout.head_dim} * layout.head_dim * 4);
  }
  // The keys' sums the staging accumulates as blocks arrive (DeviceKv: per layer, sums and unit
  // sums of each 256-token chunk of every head), and the encoded cache a GPU-tier put writes
  // on the device while its compressed arrays are still held (no larger than those arrays).
  const uint64_t chunks = (num_tokens + kKeySumChunkTokens - 1) / kKeySumChunkTokens;
  const uint64_t key_sums = heads * 2 * chunks * layout.head_dim * 4 + 256;
  return input + key_sums + 2 * out;
}

absl::StatusOr<Engine::DeviceReservation> Engine::ReserveDevice(uint64_t bytes) {
  if (failed()) return absl::UnavailableError(absl::StrCat("engine failed: ", failure()));
  return env_->Reserve(cuda_device(), bytes, DeviceEnv::Drawer::kPuts);
}

bool Engine::CheckAfterError(Backend& backend, const absl::Status& error) {
  if (failed()) return true;
  if (error.ok()) return false;
  absl::Status probe;
  if (inject_sticky_.exchange(false)) {
    probe = absl::InternalError("injected sticky device error (test hook)");
  } else {
    // Refusals of the input and of the memory cap are the put's; only what CUDA reports can
    // reach the device (CudaStatus: Internal; Unavailable from the store's device tier).
    if (!use_cuda_ || !(absl::IsInternal(error) || absl::IsUnavailable(error))) return false;
    probe = backend.Synchronize();
    if (probe.ok()) return false;  // recoverable: that put failed, the device still answers
  }
  {
    absl::MutexLock lock(&failure_mu_);
    failure_ = absl::StrCat(description_, ": ", probe.message(), " (after: ", error.message(),
                            ")");
  }
  failed_.store(true);
  return true;
}

absl::Status Engine::FaultPoint() const {
  if (inject_sticky_.load()) return absl::InternalError("injected sticky device error (test hook)");
  return absl::OkStatus();
}

std::string Engine::failure() const {
  absl::MutexLock lock(&failure_mu_);
  return failure_;
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
  // The block-wise compressor keeps its working set in host memory and runs on the CPU
  // backend, on a GPU engine too.
  KVCOMP_ASSIGN_OR_RETURN(std::unique_ptr<Backend> b, NewBackend(/*cpu=*/true));
  return StreamLease(this, std::move(b));
}

Engine::StreamLease::~StreamLease() {
  if (backend_ == nullptr) return;
  absl::MutexLock lock(&engine_->stream_mu_);
  engine_->idle_streams_.push_back(std::move(backend_));
}

}  // namespace service
}  // namespace kvcomp
