// Value types of the tiered store: tier kinds, the shared payload buffer, the metadata stored
// with every cache, put options, lookup results, and statistics.
#ifndef KVCOMP_STORAGE_TYPES_H_
#define KVCOMP_STORAGE_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvcomp/core/cache_key.h"

namespace kvcomp {
namespace storage {

// The tiers, fastest first. The numeric values are stored on disk; never renumber.
enum class TierKind : uint8_t {
  kDevice = 0,   // GPU memory (only with CUDA and a GPU)
  kHost = 1,     // host memory, pinned when CUDA is present
  kRocksDb = 2,  // RocksDB on local disk
};
inline constexpr int kNumTiers = 3;
const char* TierName(TierKind kind);  // "device", "host", "rocksdb"

// Encoded bytes in CUDA device memory, as a GPU engine makes them (kvcomp/kernels/
// device_format.h): what a put hands the store so that the device tier takes them without a
// copy through host memory. Their producer computed their CRC32C on the device and keeps a host
// copy of their header and section table, so the store neither reads nor copies them to check
// and index the put.
struct DeviceBytes {
  std::shared_ptr<const void> data;  // `size` bytes of device memory of CUDA device `device`;
                                     // the deleter frees them (the store keeps no pointer after
                                     // the put returns)
  uint64_t size = 0;
  int device = 0;
  uint32_t crc32c = 0;  // CRC32C of the `size` bytes
  std::string header;   // their first bytes, through the section table (format::PeekHeader)
};

// An immutable byte buffer with shared ownership: the encoded bytes of a CompressedCache
// (kvcomp/core/format.h). Copies share the bytes; the bytes live as long as any copy, so a reader
// holding a Payload never sees it vanish while the entry is demoted or deleted. Thread-safe.
//
// A payload made by OnDevice holds device memory instead (on_device()): data() is null and
// view() empty, device_bytes() says where the bytes are. Only TieredStore::Put takes one (it
// copies the bytes to the host once if the cache goes anywhere but the device tier); every
// payload the store returns is in host memory.
class Payload {
 public:
  Payload() = default;
  // Shares `data` (`size` bytes); the deleter of `data` frees it.
  Payload(std::shared_ptr<const uint8_t> data, size_t size) : data_(std::move(data)), size_(size) {}
  // Takes ownership of `bytes` without copying them.
  static Payload FromString(std::string bytes);
  // Copies `bytes` into a new heap buffer.
  static Payload Copy(absl::string_view bytes);
  // Bytes in device memory (see DeviceBytes).
  static Payload OnDevice(DeviceBytes bytes);
  // Fresh host memory for `size` bytes about to be written once (not zeroed), on transparent huge
  // pages where the kernel allows them: a cache is hundreds of MB, and 4 KiB first-touch faults
  // would cost more than writing it. ResourceExhausted without memory.
  static absl::StatusOr<std::shared_ptr<uint8_t>> NewHostBuffer(size_t size);

  const uint8_t* data() const { return data_.get(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  absl::string_view view() const {
    return absl::string_view(reinterpret_cast<const char*>(data_.get()), data_ ? size_ : 0);
  }
  bool on_device() const { return device_ != nullptr; }
  const DeviceBytes* device_bytes() const { return device_.get(); }

 private:
  std::shared_ptr<const uint8_t> data_;
  size_t size_ = 0;
  std::shared_ptr<const DeviceBytes> device_;
};

// Bytes a store call copied between host and device memory (the device tier's copies).
struct DeviceCopies {
  uint64_t to_device = 0;  // host memory -> device memory
  uint64_t to_host = 0;    // device memory -> host memory
  uint64_t on_device = 0;  // device memory -> device memory
};

// Device memory a cache is read into (TieredStore::GetInto).
struct DeviceTarget {
  void* data = nullptr;    // device memory of CUDA device `device`
  uint64_t capacity = 0;   // bytes at `data`
  int device = 0;
  void* stream = nullptr;  // a cudaStream_t of `device` the copy is ordered on (after the
                           // work already queued there); nullptr = the calling thread's default
                           // stream. The call waits for the copy on it before it returns.
};

// How long a put must survive before it is acknowledged.
enum class Durability : uint8_t {
  kMemory = 0,  // acknowledged once in a memory tier (lost on restart)
  kDisk = 1,    // acknowledged once in RocksDB with its write-ahead log synced (survives a crash)
  // Acknowledged once in its first tier, as kMemory, and written to RocksDB (synced) behind the
  // put by the store's persister, in order. Loss window: a crash loses the puts acknowledged and
  // not yet persisted, at most StoreOptions::behind_max_bytes of them (a put past that bound is
  // written through, as kDisk); a clean close persists them all. For caches that can be
  // recomputed. A put whose first tier is RocksDB is written synced.
  kBehind = 2,
};

// What is stored with every cache. Fields marked "(store)" are filled in by the store on Put and
// ignored in the caller's copy; the others come from the caller, or, when left 0, from the
// cache's header (format::PeekCache).
struct CacheMeta {
  uint64_t original_bytes = 0;      // bytes of the uncompressed K and V (0: from the header)
  uint64_t stored_bytes = 0;        // (store) bytes of the encoded cache
  TierKind tier = TierKind::kHost;  // (store) fastest tier holding it
  int64_t created_unix_ms = 0;      // (store) when it was put, ms since the Unix epoch
  int64_t ttl_ms = 0;               // (store) time to live from creation in ms, 0 = forever
  uint64_t projection_version = 0;  // projection the values were encoded with, 0 = none
                                    // (0: from the header)
  uint32_t crc32c = 0;              // (store) CRC32C of the encoded bytes
};

struct PutOptions {
  // Tier the put lands in; unset (-1) = StoreOptions::default_tier. A full tier first demotes its
  // least recently used entries; a put that still does not fit goes to the next tier down.
  int tier = -1;  // -1 or a TierKind value
  Durability durability = Durability::kMemory;
  absl::Duration ttl = absl::ZeroDuration();  // zero = StoreOptions::default_ttl
  bool pin = false;                           // pin once stored (as Pin()), so never demoted
  bool overwrite = true;                      // false: AlreadyExists when the key is present
  // Check the encoded bytes' header and section table (format::PeekCache) before storing; for
  // a payload on the device, its header copy (format::PeekHeader).
  bool validate = true;
  // The CRC32C of a host payload when the caller has it (format::EncodeCache gives it as it
  // encodes): taken as it is instead of reading the bytes again. A payload on the device
  // carries its own.
  std::optional<uint32_t> crc32c;
  // When set, the bytes this put copied between host and device memory for its own cache are
  // added to it (not those of demotions it caused). Not owned. Default none.
  DeviceCopies* copies = nullptr;
};

// One cache read back: its metadata and a shared handle on its bytes.
struct StoredCache {
  CacheMeta meta;
  Payload payload;
};

// Where a key lives and how big it is, without reading its bytes.
struct LookupResult {
  TierKind tier = TierKind::kHost;  // fastest tier holding it
  bool persisted = false;           // a copy is in RocksDB (survives a restart)
  uint32_t pin_count = 0;
  CacheMeta meta;
};

// One entry of List(tenant).
struct ListedCache {
  CacheKey key;
  LookupResult info;
};

// Counters of one tier since Open (entries/bytes are current values).
struct TierStats {
  bool present = false;     // the tier is configured and running
  uint64_t entries = 0;     // caches whose fastest copy is here (plus RocksDB copies of
                            // caches held faster, for the rocksdb tier)
  uint64_t bytes = 0;       // stored bytes held by the tier
  uint64_t capacity = 0;    // configured capacity in bytes
  uint64_t hits = 0;        // gets served from this tier
  uint64_t misses = 0;      // gets for keys found in no tier (counted on the first tier)
  uint64_t puts = 0;        // caches written into this tier (puts, demotions, promotions)
  uint64_t demotions = 0;   // entries moved from this tier to a slower one
  uint64_t promotions = 0;  // entries copied into this tier on read
  uint64_t evictions = 0;   // entries dropped from the store for lack of room in this tier
  std::string error;        // why an enabled tier is not present (failed at Open), else empty
  bool read_only = false;   // rocksdb: opened read-only (disk short at Open); writes are
                            // refused until space returns, then it reopens read-write by itself
  std::string read_only_reason;  // why it is read-only, else empty
  uint64_t disk_free_bytes = 0;  // rocksdb: free bytes of its filesystem (statvfs)
};

struct StoreStats {
  TierStats tiers[kNumTiers];  // indexed by TierKind
  uint64_t expired = 0;        // entries removed because their TTL passed
  uint64_t quarantined = 0;    // entries whose checksum failed, moved aside
  uint64_t quota_rejections = 0;
  uint64_t write_errors = 0;  // puts failed by the disk (e.g. disk full)
  uint64_t recovered = 0;     // entries found again in RocksDB at Open
  uint64_t unverified = 0;    // recovered entries the background check has not read yet
  uint64_t behind_bytes = 0;  // Durability::kBehind puts acknowledged, not yet on disk
  uint64_t behind_failed = 0;  // kBehind puts the persister could not write (left in memory)
  uint64_t background_corruptions = 0;  // RocksDB compactions that failed on damaged data (a
                                        // flipped byte in a blob file); writes went on
  uint64_t damage_repairs = 0;          // passes that read every payload after such a failure
                                        // and quarantined the damaged ones
  std::string last_damage_repair;       // what the last pass found, "" before the first
  uint64_t log_damage = 0;        // damaged stretches of the write-ahead log that the open's
                                  // replay skipped (a media fault mid-log: the writes whose
                                  // records it hit are lost, read as misses; later ones kept)
  uint64_t log_damage_bytes = 0;  // log bytes dropped with them
  std::string last_log_damage;    // RocksDB's report of the last one, "" when none
  uint64_t tables_dropped = 0;    // damaged RocksDB table files taken out at open (the caches
                                  // whose records they held are lost: misses; the others kept)
  uint64_t orphans_removed = 0;   // direct-file records left without their meta by that, removed
  std::string last_table_dropped;  // which table, its family and level, and why; "" when none
  uint64_t manifest_tails = 0;     // the MANIFEST ended in part of a record at open: RocksDB
                                   // ignored that edit (harmless after a crash that tore it; a
                                   // cut of a whole edit loses the tables it added)
  std::string last_manifest_tail;  // which MANIFEST and where, "" when none
  std::string last_quarantined;  // the latest cache quarantined since Open and why
                                // ("<key>: <reason>"), "" when none was
  const TierStats& tier(TierKind k) const { return tiers[static_cast<int>(k)]; }
};

// An entry whose bytes failed their checksum, moved to the quarantine at Open or on Get.
struct QuarantinedCache {
  std::string encoded_key;  // CacheKey::Encode() of the entry (it may not decode)
  std::string reason;
};

// What one tenant holds in the store now (TieredStore::Usage): every live cache counted once,
// whatever tier(s) hold it. Maintained incrementally and rebuilt at Open.
struct TenantUsage {
  std::string tenant;           // "default" for the empty tenant
  uint64_t caches = 0;          // stored caches
  uint64_t stored_bytes = 0;    // sum of CacheMeta::stored_bytes (compressed)
  uint64_t original_bytes = 0;  // sum of CacheMeta::original_bytes (uncompressed K and V)
};

// The longest key of the calibration family (TieredStore::PutCalibration).
inline constexpr size_t kMaxCalibrationKeyBytes = 1024;

}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_STORAGE_TYPES_H_
