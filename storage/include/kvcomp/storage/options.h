// Options of the tiered store: a plain struct per tier and one for the store. Every field says
// its unit and default. YAML, flags and Helm values are mapped onto these in service/ only.
#ifndef KVCOMP_STORAGE_OPTIONS_H_
#define KVCOMP_STORAGE_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvcomp/storage/types.h"

namespace rocksdb {
class Env;
}  // namespace rocksdb

namespace kvcomp {
namespace storage {

// GPU memory: one pool per device allocated at Open, carved up by the store's own allocator.
struct DeviceTierOptions {
  bool enabled = false;            // default off; Open fails (FailedPrecondition) when on and
                                   // the build has no CUDA or the machine no GPU
  int device = 0;                  // CUDA device ordinal
  // Several devices: one pool of capacity_bytes on each (the tier's capacity is their sum). A
  // cache in device memory goes to the pool of its own device (another device's, copied peer
  // to peer, only when that one is full); a cache from host memory to the pool with the most
  // room. Empty = {device}. Default empty.
  std::vector<int> devices;
  uint64_t capacity_bytes = 0;     // pool size in bytes (per device); required (> 0) when enabled
  uint64_t alignment_bytes = 256;  // allocation granularity in bytes (power of two)
  // Where each device's pool comes from: `bytes` of device memory on `device`, freed when the
  // last holder lets go (kvcompd: its device seam, which draws the pool from the device's
  // budget and allocates it through its one CUDA wrapper). Empty: the CUDA runtime's
  // cudaMalloc. Its error fails Open, annotated with the device.
  std::function<absl::StatusOr<std::shared_ptr<void>>(int device, uint64_t bytes)> pool_memory;
};

// Host memory.
struct HostTierOptions {
  bool enabled = true;                   // default on
  uint64_t capacity_bytes = 1ull << 30;  // bytes, default 1 GiB
  bool pinned = true;                    // page-locked buffers when CUDA and a GPU are
                                         // present (ignored otherwise); default true
};

// RocksDB on local disk: column families "meta" (CacheMeta), "payload" (encoded bytes, blob
// files for large values), "direct" (the files of payloads past direct_min_bytes),
// "calibration" (codec data) and "quarantine".
struct RocksDbTierOptions {
  bool enabled = false;                       // default off
  std::string path;                           // database directory; required when enabled
  uint64_t capacity_bytes = 64ull << 30;      // bytes of payload kept on disk, default 64 GiB
  bool create_if_missing = true;              // default true
  bool enable_blob_files = true;              // payload CF: large values in blob files
  uint64_t min_blob_size = 64 * 1024;         // bytes; values at least this big go to blobs
  uint64_t write_buffer_bytes = 64ull << 20;  // memtable size in bytes, default 64 MiB
  // Write-ahead log bytes kept before the column families holding the oldest log are flushed
  // (what a restart after a crash replays). Default 256 MiB.
  uint64_t max_wal_bytes = 256ull << 20;
  // Payloads of at least this many bytes skip the write-ahead log: written once to a file of
  // their own under <path>/direct (direct I/O where the filesystem takes it; files created ahead,
  // their names already durable) and synced, then named in a small synced record; the others go
  // through the WAL (and blob files). A put of a direct payload is durable when it returns,
  // whatever `sync`. 0 = never. Default 4 MiB.
  uint64_t direct_min_bytes = 4ull << 20;
  uint64_t block_cache_bytes = 256ull << 20;  // block cache in bytes, default 256 MiB
  bool sync_memory_durability_puts = false;   // sync the WAL even for Durability::kMemory puts
                                              // that land here (default false)
  bool verify_checksums_on_open = true;       // read every payload at Open and check its CRC32C;
                                              // mismatches are quarantined (default true)
  // With verify_checksums_on_open: Open loads the index from the meta records alone (one scan
  // of 52-byte records, no payload read) and a background thread reads and checks the payloads
  // afterwards, so Open's time does not grow with the stored bytes. Until an entry is checked,
  // a Get checks it (as every RocksDB read does) and one that fails is quarantined and reads
  // NotFound, as if quarantined at Open; Quarantined() and the purges wait for the whole pass.
  // Default false (everything checked inside Open).
  bool verify_in_background = false;
  int max_background_jobs = 2;                // RocksDB flush/compaction threads, default 2
  // Free space kept on the filesystem under `path`, in bytes. Every write is admitted against
  // the measured free space (statvfs) first: one that adds data needs twice its bytes (WAL, then
  // flush) plus the memtables not yet flushed plus this reserve; one that only removes needs half
  // of it. Refused writes are ResourceExhausted ("disk full: ..."). Also the space kept free for
  // compactions. Default 64 MiB.
  uint64_t reserve_bytes = 64ull << 20;
  // Bound on RocksDB's table and blob files (SstFileManager), in bytes; writes are refused past
  // it. 0 = 2 * capacity_bytes + 1 GiB (room for garbage not yet collected). Default 0.
  uint64_t max_space_bytes = 0;
  // Filesystem seam for tests (fault injection); null = rocksdb::Env::Default(). Not owned;
  // must outlive the store.
  rocksdb::Env* env = nullptr;
};

struct StoreOptions {
  DeviceTierOptions device;
  HostTierOptions host;
  RocksDbTierOptions rocksdb;

  // Tier a put lands in when PutOptions::tier is unset; must be enabled. Default host.
  TierKind default_tier = TierKind::kHost;
  // When a tier's bytes pass high_watermark * capacity, its least recently used unpinned entries
  // move down (or, from the last tier, are evicted) until bytes <= low_watermark * capacity.
  // Fractions, 0 < low <= high <= 1. Defaults 0.90 and 0.75.
  double high_watermark = 0.90;
  double low_watermark = 0.75;
  // A get served from a slower tier copies the cache into promote_to (which must be faster and
  // enabled). Default off.
  bool promote_on_read = false;
  TierKind promote_to = TierKind::kHost;
  // Durability::kBehind: bytes of puts acknowledged and not yet on disk, at most; a put that
  // would pass it is written through (as kDisk). The loss window of a crash. Default 1 GiB.
  uint64_t behind_max_bytes = 1ull << 30;
  // Time to live for puts that give none; zero = forever. Default zero.
  absl::Duration default_ttl = absl::ZeroDuration();
  // Bytes a tenant may hold over all tiers (stored bytes, one count per cache); tenants not
  // listed get default_tenant_quota_bytes; 0 = unlimited. Defaults: none listed, unlimited.
  absl::flat_hash_map<std::string, uint64_t> tenant_quota_bytes;
  uint64_t default_tenant_quota_bytes = 0;
  // A tier that is enabled but cannot start (device tier without CUDA or GPU, RocksDB that
  // cannot open its path) is left out and its error reported in TierStats::error, instead of
  // failing Open, as long as one tier starts. Puts for a missing tier go to the next tier down
  // (or the nearest one up); disk-durable puts without RocksDB are FailedPrecondition. Option
  // errors (watermarks, capacities, paths left empty) always fail Open. Default true.
  bool open_without_failed_tiers = true;
  // Index shards (each with its own lock); rounded up to a power of two. Default 64.
  int num_shards = 64;
  // Clock seam for TTL tests; null = absl::Now.
  std::function<absl::Time()> clock;
};

}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_STORAGE_OPTIONS_H_
