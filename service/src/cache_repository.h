// CacheRepository: compressed caches as kvcompd keeps them. It encodes a cache in the format
// (docs/format.md) and stores it in the tiered store with the configured durability and tier,
// serves it back (stored, or decoded with the projection it names), describes it (where it is,
// what its header says, without reading it again when its header is remembered), deletes it, and
// pins the KVSplice projection a put encodes with. Tenant isolation is the caller's key: a key
// is always the authenticated tenant's, and another tenant's cache reads as missing.
//
// Blocking (store I/O); thread-safe.
#ifndef KVCOMP_SERVICE_SRC_CACHE_REPOSITORY_H_
#define KVCOMP_SERVICE_SRC_CACHE_REPOSITORY_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/core/format.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/pipeline.h"
#include "kvcomp/kernels/projection.h"
#include "kvcomp/service/metrics.h"
#include "kvcomp/storage/tiered_store.h"
#include "kvsplice_glue.h"
#include "put.h"

namespace kvcomp {
namespace service {

struct RepositoryOptions {
  storage::Durability durability = storage::Durability::kDisk;
  int put_tier = -1;  // storage::TierKind, or -1 for the store's default
};

class CacheRepository {
 public:
  // `store`, `projections` (over `store`) and `metrics` outlive the repository.
  CacheRepository(const RepositoryOptions& options, storage::TieredStore* store,
                  codecs::TieredProjectionStore* projections, Metrics* metrics)
      : options_(options), store_(store), projections_(projections), metrics_(metrics) {}

  // The latest projection of `key`'s tenant and model, for a put whose value codec encodes
  // with it; the version is not collected while the pointer lives. FailedPrecondition before
  // any calibration.
  absl::StatusOr<std::shared_ptr<const Projection>> PinProjection(const CacheKey& key);
  // The same for the pq codecs: the latest pq calibration of `key`'s tenant and model fitted at
  // key_bits / value_bits per element, pinned while the pointer lives. FailedPrecondition naming
  // the calibration call when there is none at those bits.
  absl::StatusOr<std::shared_ptr<const pq::Calibration>> PinPq(const CacheKey& key,
                                                               uint32_t key_bits,
                                                               uint32_t value_bits);

  // Encodes and stores `cache` as `key` (replacing an older one); returns what was stored.
  // `original_bytes` is the uncompressed size of the put. The store's copies between host and
  // device (into the GPU tier) are added to `transfers` when given.
  absl::StatusOr<CacheSummary> Store(const CacheKey& key, const CompressedCache& cache,
                                     uint64_t original_bytes, TransferBytes* transfers = nullptr);

  // Encodes `cache` (compressed on the device, its arrays in `backend`'s device memory) on the
  // device and stores the encoded bytes from there: the GPU tier takes them with one copy on the
  // device; a copy to host memory is made once, only for a tier other than the GPU tier or the
  // RocksDB copy of a disk-durable put. Adds every byte copied between host and device (the
  // encoding's control bytes, the store's download) to `transfers`.
  absl::StatusOr<CacheSummary> StoreFromDevice(const CacheKey& key, Backend& backend,
                                               const DeviceCompressedCache& cache,
                                               uint64_t original_bytes, TransferBytes* transfers);

  // The stored bytes of `key` copied into device memory (storage::TieredStore::GetInto): from
  // the GPU tier one copy on the device, from host memory or RocksDB one upload, counted in the
  // transfer metrics. For a caller that serves from device memory (the GPU channel). NotFound
  // ("cache not found") when absent; OutOfRange when target.capacity is below the cache's size.
  absl::StatusOr<storage::CacheMeta> GetInto(const CacheKey& key,
                                             const storage::DeviceTarget& target);

  // The cache's bytes in `rep`, decoded here on the shared CPU decoder when `rep` is kDecoded
  // and its codecs are not raw. NotFound ("cache not found") when absent.
  absl::StatusOr<storage::Payload> Get(const CacheKey& key, Representation rep);
  // Whether a get of the decoded representation of `stored` (a cache's stored bytes) must
  // decode it: its key or value codec is not raw (raw caches are their own decoded form).
  static absl::StatusOr<bool> NeedsDecode(const storage::Payload& stored);
  // `stored` (the stored bytes of `key`) decoded to raw codecs (codecs::DecodeToRaw) and
  // encoded again: on `backend` when given (a GPU engine worker's: the codecs run on its device),
  // else on the shared CPU decoder.
  absl::StatusOr<storage::Payload> Decode(const CacheKey& key, const storage::Payload& stored,
                                          Backend* backend);
  // The same for a cache already parsed: its kept keys and values decoded to the layout's dtype
  // (raw codecs), not encoded again, for a caller that uses the arrays themselves (a dense get).
  absl::StatusOr<CompressedCache> DecodeParsed(const CacheKey& key, CompressedCache cache,
                                               Backend* backend);

  // Where a cache is and what its header says. NotFound when absent.
  struct Description {
    storage::LookupResult where;
    format::CacheInfo info;
  };
  absl::StatusOr<Description> Describe(const CacheKey& key);
  absl::StatusOr<CacheSummary> Summarize(const CacheKey& key);

  // Deletes `key`, then what only it kept (see Deleted). NotFound when absent.
  absl::Status Delete(const CacheKey& key);
  // After `key` was deleted (here or through the store): drops what Describe remembers of it
  // and deletes the projection versions of its tenant/model that no stored cache names any
  // more (except the latest).
  void Deleted(const CacheKey& key);

  // The caches of `tenant` (of `model_id` only, when not empty), in key order.
  absl::StatusOr<std::vector<CacheKey>> List(const std::string& tenant,
                                             const std::string& model_id = "");

 private:
  // Puts `payload` (host or device bytes) and says what was stored.
  absl::StatusOr<CacheSummary> Put(const CacheKey& key, storage::Payload payload,
                                   const format::CacheInfo& info, uint64_t original_bytes,
                                   TransferBytes* transfers, absl::Time began,
                                   std::optional<uint32_t> crc32c);
  void Remember(const CacheKey& key, const format::CacheInfo& info);
  void Forget(const CacheKey& key);

  const RepositoryOptions options_;
  storage::TieredStore* const store_;
  codecs::TieredProjectionStore* const projections_;
  Metrics* const metrics_;

  // Headers of stored caches by CacheKey::Encode(); bounded (cleared when full).
  static constexpr size_t kMaxRememberedInfos = 1 << 20;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, format::CacheInfo> infos_ ABSL_GUARDED_BY(mu_);
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_CACHE_REPOSITORY_H_
