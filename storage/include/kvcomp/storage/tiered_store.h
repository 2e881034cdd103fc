// TieredStore: compressed caches (the encoded bytes of a kvcomp::CompressedCache, format.h) in
// device memory, host memory and RocksDB, moved down under pressure (LRU between watermarks),
// optionally promoted on read, with per-tenant quotas, TTLs, pins, and calibration data (keys and
// bytes the codecs give meaning to) with counts of the caches that name each codec version.
//
// Durability: a put returns OK only once its Durability holds. With the RocksDB tier, metadata
// and payload go in one atomic WriteBatch; Open rebuilds the index from RocksDB and verifies
// every payload's CRC32C, quarantining (never serving) those that fail. Nothing half-written is
// ever visible.
//
// Thread-safety: every method may be called from many threads at once. The index is sharded,
// each shard with its own lock; there is no global lock. Payloads are shared buffers: a
// StoredCache returned by Get stays valid after the entry is demoted, evicted or deleted.
//
// Errors common to all methods taking a CacheKey: InvalidArgument when the key does not
// Validate() (empty or too long parts, e.g. a key over CacheKey::kMaxKeyBytes).
#ifndef KVCOMP_STORAGE_TIERED_STORE_H_
#define KVCOMP_STORAGE_TIERED_STORE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/storage/options.h"
#include "kvcomp/storage/types.h"

namespace kvcomp {
namespace storage {

class TieredStore {
 public:
  // Opens the configured tiers and, with RocksDB, recovers its entries. Errors:
  // InvalidArgument for inconsistent options (no tier enabled, zero capacity, watermarks out of
  // order, default_tier or promote_to not enabled, empty RocksDB path). A tier that cannot start
  // (FailedPrecondition: device tier without CUDA or GPU; Unavailable/Internal/DataLoss: RocksDB
  // cannot open) fails Open only when options.open_without_failed_tiers is false or no tier
  // starts; otherwise the store runs without it and Stats() reports the error.
  static absl::StatusOr<std::unique_ptr<TieredStore>> Open(const StoreOptions& options);

  virtual ~TieredStore() = default;

  // Stores `encoded` (CompressedCache bytes) under `key`. `meta` supplies original_bytes and
  // projection_version (0 = read from the header); the store fills in the rest. Errors:
  // InvalidArgument (bad key, bytes that fail format::PeekCache when options.validate, bad
  // tier), AlreadyExists (overwrite false), ResourceExhausted (tenant quota exceeded, or no tier
  // has room, or disk full), FailedPrecondition (Durability::kDisk without a RocksDB tier).
  // Overwriting a cache that has a copy in RocksDB replaces or removes that copy with a synced
  // write before returning, so no crash can bring the older value back (docs/storage.md).
  //
  // `encoded` may be in device memory (Payload::OnDevice): the device tier takes it with one
  // copy on the device, nothing through the host; wherever else the cache goes (its tier, a
  // spill to the next tier, the RocksDB copy of a disk-durable put) its bytes are copied to host
  // memory exactly once for the whole put, and that copy is checked against the CRC32C the
  // payload carries (DataLoss on a mismatch; nothing stored). options.copies counts the copies.
  virtual absl::Status Put(const CacheKey& key, Payload encoded, const CacheMeta& meta,
                           const PutOptions& options) = 0;
  absl::Status Put(const CacheKey& key, absl::string_view encoded, const CacheMeta& meta,
                   const PutOptions& options) {
    return Put(key, Payload::Copy(encoded), meta, options);
  }

  // The cache under `key`. NotFound if absent or expired; DataLoss if its bytes fail their
  // checksum (the entry is then quarantined and gone from the index).
  virtual absl::StatusOr<StoredCache> Get(const CacheKey& key) = 0;

  // The cache under `key` copied into device memory (`target`), for a caller that serves it from
  // there (a GPU-to-GPU channel): from the device tier one copy on the device, nothing through
  // the host (the key's puts, deletes and demotions wait for it); from the host tier or RocksDB
  // read as Get reads it, then one copy to the device. Returns the cache's meta (meta.stored_bytes
  // bytes were written) once the copy is done, and adds the copy to `copies` (may be null).
  // Errors: those of Get; OutOfRange when target.capacity is below the cache's size (Lookup
  // gives it; nothing written); InvalidArgument for a null target; FailedPrecondition in a
  // build without CUDA.
  virtual absl::StatusOr<CacheMeta> GetInto(const CacheKey& key, const DeviceTarget& target,
                                            DeviceCopies* copies) = 0;

  // Where `key` lives and its sizes, without reading the bytes or touching LRU order. NotFound
  // if absent or expired.
  virtual absl::StatusOr<LookupResult> Lookup(const CacheKey& key) = 0;

  // Removes `key` from every tier (durably when it was persisted). NotFound if absent.
  virtual absl::Status Delete(const CacheKey& key) = 0;

  // Every live cache of `tenant` (empty = "default"), in CacheKey::Encode() order.
  virtual absl::StatusOr<std::vector<ListedCache>> List(absl::string_view tenant) = 0;

  // Pins keep an entry in its tier: it is never demoted, evicted or expired while pinned.
  // Pins nest. NotFound if absent; Unpin of an unpinned key is FailedPrecondition.
  virtual absl::Status Pin(const CacheKey& key) = 0;
  virtual absl::Status Unpin(const CacheKey& key) = 0;

  // Removes every expired, unpinned entry now (Get/Lookup/List already hide them). Returns how
  // many were removed.
  virtual uint64_t ExpireNow() = 0;

  virtual StoreStats Stats() const = 0;
  // Per-tenant totals of the caches in the store, one element per tenant holding at least one
  // cache, sorted by tenant. No scan: counts are kept on every put, overwrite, delete, expiry,
  // eviction and quarantine, and rebuilt from RocksDB at Open. An entry whose TTL has passed is
  // counted until it is removed (ExpireNow, or a Get/Delete of it); List hides it at once.
  virtual std::vector<TenantUsage> Usage() const = 0;

  // Entries moved aside because their checksum failed (at Open or on Get).
  virtual std::vector<QuarantinedCache> Quarantined() const = 0;
  // Removes the quarantined entry `encoded_key` (QuarantinedCache::encoded_key) for good: its
  // reason, meta and payload leave RocksDB's quarantine family in one synced write, and
  // Quarantined() no longer lists it. NotFound if nothing is quarantined under that key.
  virtual absl::Status PurgeQuarantined(absl::string_view encoded_key) = 0;
  // Removes every quarantined entry the same way (one synced write); returns how many.
  virtual absl::StatusOr<uint64_t> PurgeAllQuarantined() = 0;

  // Waits until every Durability::kBehind put queued so far has been written to RocksDB or has
  // failed to be (StoreStats::behind_failed). Returns at once without such puts.
  virtual void FlushBehind() = 0;

  // --- calibration data: keys and bytes in RocksDB's "calibration" family ---
  // The codecs give keys and bytes their meaning (KVSplice's projections:
  // kvcomp/codecs/projection_store.h); the store keeps them durably and counts the caches that
  // name a codec version. All but ProjectionReferences return FailedPrecondition when the RocksDB
  // tier is not enabled; keys are 1..kMaxCalibrationKeyBytes bytes (InvalidArgument otherwise).

  // Stores `bytes` under `key`, durably (a synced write). AlreadyExists if `key` holds different
  // bytes (an entry is immutable); OK if it holds the same bytes.
  virtual absl::Status PutCalibration(absl::string_view key, absl::string_view bytes) = 0;
  // NotFound when absent.
  virtual absl::StatusOr<std::string> GetCalibration(absl::string_view key) = 0;
  // Every key that starts with `prefix` (all when empty), in byte order.
  virtual absl::StatusOr<std::vector<std::string>> ListCalibration(absl::string_view prefix) = 0;
  // Removes `key` in a synced write; NotFound if absent. Whoever deletes codec data that caches
  // may still need checks ProjectionReferences first.
  virtual absl::Status DeleteCalibration(absl::string_view key) = 0;
  // Stored caches of `model_id` that record `version` as CacheMeta::projection_version (rebuilt
  // at Open from the recovered caches).
  virtual uint64_t ProjectionReferences(absl::string_view model_id, uint64_t version) const = 0;
};

}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_STORAGE_TIERED_STORE_H_
