// The ingest pipeline and the serving path of kvcompd: open puts collect blocks (any order,
// checked against the layout, overlaps refused); a commit goes through a bounded queue to a
// worker pool that compresses (each worker owns a Backend: CUDA when present, else CPU),
// encodes and stores the cache, acknowledging per the storage durability. Block-wise puts feed a
// BlockCompressor as their blocks arrive (in token order per layer; early blocks wait), so only
// budget + block tokens per head are held. Gets, lookups and deletes run on a separate pool.
//
// Thread-safety: every method may be called from any thread; completions run on pool threads.
#ifndef KVCOMP_SERVICE_SRC_INGEST_H_
#define KVCOMP_SERVICE_SRC_INGEST_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/projection.h"
#include "kvcomp/service/metrics.h"
#include "kvcomp/storage/tiered_store.h"
#include "kvcomp/transport/server.h"
#include "kvsplice_glue.h"
#include "task_pool.h"

namespace kvcomp {
namespace service {

struct IngestOptions {
  uint64_t max_put_bytes = uint64_t{16} << 30;
  int workers = 2;
  uint32_t queue_capacity = 16;
  // Share of the compression queue and of the serve queue one tenant may hold; workers take the
  // tenants' tasks in turn.
  double tenant_share = 0.5;
  int serve_threads = 4;
  uint32_t serve_queue_capacity = 4096;
  std::string backend = "auto";  // auto, cpu, cuda
  int cuda_device = 0;
  int cpu_threads = 0;  // per backend; 0 = hardware threads / workers
  storage::Durability durability = storage::Durability::kDisk;
  int put_tier = -1;  // TierKind or -1 = store default
};

// A put is named by (connection id, the client's put id).
using PutId = std::pair<uint64_t, uint64_t>;

struct PutSpec {
  CacheKey key;
  KvLayout layout;
  uint64_t num_tokens = 0;
  CompressionPolicy policy;
  bool block_wise = false;
  // Set by BeginPut for value codecs: the tenant/model's latest KVSplice projection.
  std::shared_ptr<const Projection> projection;
};

class IngestPipeline {
 public:
  // `projections` (over `store`) serves value codecs and decoded gets.
  static absl::StatusOr<std::unique_ptr<IngestPipeline>> Create(const IngestOptions& options,
                                                                storage::TieredStore* store,
                                                                StoreProjections* projections,
                                                                Metrics* metrics);
  ~IngestPipeline();

  // "cpu (N threads)" or the CUDA device.
  const std::string& backend_description() const { return backend_description_; }
  bool uses_gpu() const { return use_cuda_; }

  // Opens put `id` (unique among open puts). InvalidArgument (bad key, layout, policy, too
  // large), AlreadyExists (id in use), Unavailable (draining). How many puts may be open is the
  // data plane's to bound (data_plane.max_open_puts, per tenant too).
  absl::Status BeginPut(PutId id, PutSpec spec);
  // A block of put `id`; `done` runs once it is accounted for.
  void AddBlock(PutId id, const transport::wire::Block& block, transport::Buffer payload,
                transport::Done done);
  // Compresses and stores put `id`; Busy when the queue is full (the put stays open, so the
  // client may retry the commit).
  void Commit(PutId id, transport::CommitDone done);
  // Forgets put `id` and its blocks.
  void Abort(PutId id);

  void Get(const CacheKey& key, transport::wire::Representation rep, transport::GetDone done);
  void Lookup(const CacheKey& key, transport::LookupDone done);
  void Delete(const CacheKey& key, transport::Done done);

  // Where a cache is and what its header says, without reading its bytes when the header is
  // remembered (from its put, or an earlier lookup). NotFound when absent. Blocking (store I/O
  // at most once per key); for the control plane and the serve pool.
  struct Description {
    storage::LookupResult where;
    format::CacheInfo info;
  };
  absl::StatusOr<Description> Describe(const CacheKey& key);
  // After `key` was deleted (here or elsewhere): drops what Describe remembers of it and deletes
  // the projection versions of its tenant/model that no stored cache names any more (except the
  // latest). Blocking (store I/O).
  void Deleted(const CacheKey& key);

  // Stops taking new puts (Unavailable); everything open continues.
  void Drain() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  // Waits for open puts to finish and the queues to empty.
  bool WaitIdle(absl::Duration timeout);
  void Shutdown();

  size_t queue_depth() const { return compress_pool_ ? compress_pool_->depth() : 0; }
  size_t open_puts() const;

  struct PutState;

 private:
  IngestPipeline(const IngestOptions& options, storage::TieredStore* store,
                 StoreProjections* projections, Metrics* metrics)
      : options_(options), store_(store), projections_(projections), metrics_(metrics) {}
  absl::StatusOr<std::unique_ptr<Backend>> NewBackend(int threads) const;
  std::shared_ptr<PutState> Find(PutId id);
  std::shared_ptr<PutState> Take(PutId id);
  void RunCommit(const std::shared_ptr<PutState>& put, transport::CommitDone done, int worker);
  absl::StatusOr<CompressedCache> CompressWhole(PutState& put, int worker);
  absl::Status DrainBlockWise(PutState& put);
  absl::StatusOr<transport::wire::CacheSummary> Store(PutState& put, CompressedCache cache);
  void UpdateGauges();

  const IngestOptions options_;
  storage::TieredStore* const store_;
  StoreProjections* const projections_;
  Metrics* const metrics_;
  bool use_cuda_ = false;
  int threads_per_backend_ = 1;
  std::string backend_description_;
  std::atomic<bool> draining_{false};

  // One backend per compression worker, created on the worker's thread.
  std::vector<std::unique_ptr<Backend>> worker_backends_;
  std::vector<absl::Status> worker_backend_status_;
  std::unique_ptr<TaskPool> compress_pool_;
  std::unique_ptr<TaskPool> serve_pool_;

  void RememberInfo(const CacheKey& key, const format::CacheInfo& info);
  void ForgetInfo(const CacheKey& key);

  // Headers of stored caches by CacheKey::Encode(); bounded (cleared when full).
  static constexpr size_t kMaxRememberedInfos = 1 << 20;
  absl::Mutex info_mu_;
  absl::flat_hash_map<std::string, format::CacheInfo> infos_ ABSL_GUARDED_BY(info_mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<PutId, std::shared_ptr<PutState>> puts_ ABSL_GUARDED_BY(mu_);
  size_t committing_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_INGEST_H_
