// CacheService: what kvcompd does with a request once it has entered, without any transport
// type. A put is opened from a validated PutRequest (BeginPut) and lives as one OpenPut, owned
// by whoever holds the put (the data-plane facade attaches it to the transport's record of the
// put); its blocks go to a PutAssembler, its commit to a worker of the Engine the put was placed
// on (EngineSet::Place: one engine per GPU, or the CPU engine), which compresses the assembled
// view (or finishes the block-wise compressor) and hands the cache to the CacheRepository. Gets,
// lookups and deletes run on a separate serve pool, tenants in turn.
//
// Thread-safety: every method may be called from any thread; completions run on pool threads
// (or inside the call, for refusals).
#ifndef KVCOMP_SERVICE_SRC_CACHE_SERVICE_H_
#define KVCOMP_SERVICE_SRC_CACHE_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "assembler.h"
#include "cache_repository.h"
#include "engine.h"
#include "engine_set.h"
#include "kvcomp/kernels/pipeline.h"
#include "kvcomp/service/metrics.h"
#include "put.h"
#include "task_pool.h"

namespace kvcomp {
namespace service {

struct ServiceOptions {
  uint64_t max_put_bytes = uint64_t{16} << 30;
  int serve_threads = 4;
  uint32_t serve_queue_capacity = 4096;
  double tenant_share = 0.5;  // of the serve queue, per tenant
};

using Done = absl::AnyInvocable<void(absl::Status)>;
using CommitDone = absl::AnyInvocable<void(absl::StatusOr<CacheSummary>)>;
using GetDone = absl::AnyInvocable<void(absl::StatusOr<storage::Payload>)>;
using LookupDone = absl::AnyInvocable<void(absl::StatusOr<CacheSummary>)>;

class CacheService;

// One open put: its request, the engine it runs on, its blocks (PutAssembler), its block-wise
// compressor and the projection it encodes with. Its blocks' memory goes when the put ends (commit done, abort)
// or, block-wise, as each block is appended. On a GPU engine a whole-sequence put holds its K
// and V in device memory instead (DeviceKv, reserved against engine.gpu_memory_bytes when the
// put begins): each block is copied there as it arrives and its memory released at once; the
// commit compresses and encodes on the device and stores from there: the GPU tier keeps the
// cache on the device; host memory or RocksDB get it copied to the host once (docs/engine.md,
// "Where each byte goes").
class OpenPut : public std::enable_shared_from_this<OpenPut> {
 public:
  ~OpenPut();

  const PutRequest& request() const { return request_; }
  // The engine the put was placed on, for its whole life: its blocks go to that engine's device
  // (a GPU engine) and its commit to that engine's workers.
  Engine& engine() const { return *engine_; }
  // Keeps `block`; `done` runs once it is accounted for, before AddBlock returns
  // (InvalidArgument for an overlapping or malformed block, FailedPrecondition once committing
  // or aborted).
  void AddBlock(BlockData block, Done done);
  // Compresses and stores the put on an engine worker; Busy when the queue is full (the put
  // stays open: the client may commit again).
  void Commit(CommitDone done);
  // The put ends without commit: its blocks go now, or when a running commit ends.
  void Abort();

 private:
  friend class CacheService;
  OpenPut(CacheService* service, Engine* engine, PutRequest request,
          std::shared_ptr<const Projection> projection,
          std::shared_ptr<const pq::Calibration> pq, std::unique_ptr<DeviceKv> device_kv,
          Engine::DeviceReservation reservation);
  // Copies `block` (its coverage already admitted) into the put's device buffer. Caller holds
  // mu_.
  absl::Status AddToDevice(const BlockData& block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunCommit(Backend& backend, CommitDone done);
  // The put's K and V as the compression reads them (the device buffer's view after its uploads,
  // counted in `transfers`, or the assembled host blocks).
  absl::StatusOr<KvCacheView> ViewForCommit(Backend& backend, TransferBytes* transfers);
  absl::StatusOr<CompressedCache> CompressWhole(Backend& backend, TransferBytes* transfers);
  // A whole put on a GPU engine: compressed and encoded on the device and stored from there
  // (CacheRepository::StoreFromDevice): the cache reaches the host once, and only when it goes
  // to host memory or RocksDB.
  absl::StatusOr<CacheSummary> CommitOnDevice(Backend& backend, TransferBytes* transfers);
  // Appends every block that is next in token order. Caller holds stream_mu_.
  absl::Status DrainBlockWise() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stream_mu_);

  CacheService* const service_;
  Engine* const engine_;
  const PutRequest request_;
  const std::shared_ptr<const Projection> projection_;  // pinned while the put lives
  const std::shared_ptr<const pq::Calibration> pq_;    // pinned while the put lives
  const absl::Time begun_ = absl::Now();

  absl::Mutex mu_;
  PutAssembler assembler_ ABSL_GUARDED_BY(mu_);
  absl::Time last_block_ ABSL_GUARDED_BY(mu_) = absl::Now();
  bool committing_ ABSL_GUARDED_BY(mu_) = false;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  bool drain_scheduled_ ABSL_GUARDED_BY(mu_) = false;
  // GPU engine, whole-sequence put: K and V on the device. The reservation is what the put
  // holds on its engine (GPU memory on a GPU engine) from its begin to the end of its commit.
  std::unique_ptr<DeviceKv> device_kv_ ABSL_GUARDED_BY(mu_);
  Engine::DeviceReservation reservation_ ABSL_GUARDED_BY(mu_);
  absl::Status device_error_ ABSL_GUARDED_BY(mu_);
  // Wall seconds the block handlers spent copying blocks into device_kv_ (staging and issuing
  // the copies; what is still in flight at commit is waited for in the compression).
  double to_device_seconds_ ABSL_GUARDED_BY(mu_) = 0;

  // Block-wise state, used by one worker at a time.
  absl::Mutex stream_mu_;
  std::optional<Engine::StreamLease> stream_ ABSL_GUARDED_BY(stream_mu_);
  std::unique_ptr<BlockCompressor> compressor_ ABSL_GUARDED_BY(stream_mu_);
  absl::Status stream_error_ ABSL_GUARDED_BY(stream_mu_);
};

class CacheService {
 public:
  // `engines`, `repository` and `metrics` outlive the service and every OpenPut it made.
  CacheService(const ServiceOptions& options, EngineSet* engines, CacheRepository* repository,
               Metrics* metrics);
  ~CacheService();

  // Opens a put on the engine EngineSet::Place chooses (on CUDA device `device` when >= 0: the
  // GPU channel's, whose buffers live there). InvalidArgument (larger than max_put_bytes),
  // FailedPrecondition (a value codec and no calibrated projection; no engine on `device`),
  // Unavailable (draining, or every candidate engine failed), ResourceExhausted (no GPU engine
  // with room for the put's K and V: beyond engine.gpu_memory_bytes, or the device's memory is
  // full); nothing of a refused put is kept.
  absl::StatusOr<std::shared_ptr<OpenPut>> BeginPut(PutRequest request, int device = -1);

  void Get(const CacheKey& key, Representation rep, GetDone done);
  void Lookup(const CacheKey& key, LookupDone done);
  void Delete(const CacheKey& key, Done done);

  EngineSet* engines() const { return engines_; }
  // The first engine (the only one of a CPU or one-GPU daemon).
  Engine* engine() const { return &engines_->primary(); }
  CacheRepository* repository() const { return repository_; }

  // Stops taking new puts (Unavailable); everything open continues.
  void Drain() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  // Waits until no put is open and the queues are empty.
  bool WaitIdle(absl::Duration timeout);
  void Shutdown();

  size_t queue_depth() const { return engines_->queue_depth(); }
  size_t open_puts() const { return open_puts_.load(); }

 private:
  friend class OpenPut;
  void UpdateGauges();

  const ServiceOptions options_;
  EngineSet* const engines_;
  CacheRepository* const repository_;
  Metrics* const metrics_;
  std::atomic<bool> draining_{false};
  std::atomic<size_t> open_puts_{0};
  std::unique_ptr<TaskPool> serve_pool_;
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_CACHE_SERVICE_H_
