// The RocksDB tier: column families "meta" (CacheMeta records), "payload" (encoded caches, blob
// files for large values), "calibration" (codec data, keys and bytes) and "quarantine" (entries
// whose checksum failed, kept for inspection). A cache's meta and payload are written in one
// WriteBatch. Thread-safe.
//
// Large payloads (at least RocksDbTierOptions::direct_min_bytes) skip the write-ahead log: each
// is written once, with direct I/O where the filesystem takes it, to its own file under
// <path>/direct and synced (fdatasync), and then its meta and a small record naming the file
// (column family "direct") are written in one synced WriteBatch, so a put acknowledges only once
// both are durable. The files are created ahead, several with one directory sync, so a put pays
// two syncs; concurrent puts share them (RocksDB's group commit writes and syncs the records of
// the writers waiting together once, and the filesystem's journal commits their files' syncs
// together). A file no record names (made ahead and never used, a put that crashed between the
// two writes, or an overwrite or delete that crashed before removing the old file) is removed at
// the next read-write Open.
//
// Disk space: every write is admitted against the filesystem's measured free space (statvfs)
// before RocksDB sees it, so RocksDB never meets a full disk on the write path (Debian's RocksDB
// 7.8 can abort inside the library when it does). A write that adds data needs its bytes twice
// (WAL now, flush later), plus the memtables not yet flushed, plus the reserve; a write that only
// removes needs half the reserve. RocksDB's SST and blob files are bounded by an SstFileManager.
// When the disk is short at Open (or a read-write open fails for lack of space), the database
// opens read-only: reads work, writes are ResourceExhausted ("disk full"), and the next write
// once space has returned reopens it read-write by itself.
#ifndef KVCOMP_STORAGE_SRC_ROCKSDB_TIER_H_
#define KVCOMP_STORAGE_SRC_ROCKSDB_TIER_H_

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvcomp/storage/options.h"
#include "kvcomp/storage/tier.h"
#include "kvcomp/storage/types.h"
#include "mutex.h"

namespace rocksdb {
class Cache;
class ColumnFamilyHandle;
class DB;
class FileSystem;
class FSRandomAccessFile;
class EventListener;
class SstFileManager;
class Status;
}  // namespace rocksdb

namespace kvcomp {
namespace storage {

// The stored form of CacheMeta: 52 little-endian bytes, versioned, with their own CRC32C.
std::string EncodeMeta(const CacheMeta& meta);
absl::StatusOr<CacheMeta> DecodeMeta(absl::string_view bytes);

// A rocksdb::Status as a kvcomp status: NoSpace -> ResourceExhausted ("disk full"),
// NotFound -> NotFound, Corruption -> DataLoss, IOError -> Unavailable, others Internal.
absl::Status FromRocksDb(const rocksdb::Status& s, absl::string_view context);

class RocksDbTier final : public Tier {
 public:
  static absl::StatusOr<std::unique_ptr<RocksDbTier>> Open(const RocksDbTierOptions& options);
  ~RocksDbTier() override;

  TierKind kind() const override { return TierKind::kRocksDb; }
  uint64_t capacity_bytes() const override { return capacity_; }
  uint64_t used_bytes() const override { return used_.load(std::memory_order_relaxed); }
  uint64_t entries() const override { return entries_.load(std::memory_order_relaxed); }

  absl::Status Put(absl::string_view key, const CacheMeta& meta, const Payload& payload,
                   bool sync) override;
  absl::StatusOr<Payload> Get(absl::string_view key) override;
  absl::Status Delete(absl::string_view key, bool sync) override;

  // Removes every key of `keys` (absent ones are fine) in one WriteBatch: one WAL sync for all
  // of them with `sync`. On error none is removed.
  absl::Status DeleteMany(const std::vector<std::string>& keys, bool sync);

  absl::StatusOr<CacheMeta> GetMeta(absl::string_view key);

  // True while the database is open read-only (disk short at Open); why, in read_only_reason().
  bool read_only() const;
  std::string read_only_reason() const;
  // Free bytes of the filesystem under the database (statvfs), 0 when it cannot be measured.
  uint64_t free_bytes() const;

  // Calls `fn` for every stored (key, meta) in key order, after verifying (when `verify`) that
  // the payload is present and matches meta's size and CRC32C. Entries that fail are moved to
  // the quarantine (left in place while read-only) and reported through `quarantined` instead.
  // Used once, at Open.
  absl::Status Recover(bool verify,
                       const std::function<void(absl::string_view, const CacheMeta&)>& fn,
                       std::vector<QuarantinedCache>* quarantined);

  // Moves `key`'s meta and payload into the quarantine family, with `reason`, in one write.
  absl::Status Quarantine(absl::string_view key, absl::string_view reason);
  // Every quarantined entry, from disk.
  absl::StatusOr<std::vector<QuarantinedCache>> ListQuarantine();
  // Removes `key`'s reason, meta and payload from the quarantine family in one synced write.
  // True when something was there.
  absl::StatusOr<bool> PurgeQuarantine(absl::string_view key);
  // Removes every quarantined entry in one synced write; returns their keys.
  absl::StatusOr<std::vector<std::string>> PurgeAllQuarantine();

  // The calibration family: opaque keys and bytes (TieredStore::PutCalibration and the rest).
  absl::Status PutCalibration(absl::string_view key, absl::string_view bytes);
  absl::StatusOr<std::string> GetCalibration(absl::string_view key);
  absl::StatusOr<std::vector<std::string>> ListCalibration(absl::string_view prefix);
  absl::Status DeleteCalibration(absl::string_view key);

  // Damaged data met by RocksDB's background work. A compaction that reads a damaged blob (blob
  // garbage collection relocating it) fails with Corruption, which RocksDB would keep as a
  // background error refusing every later write, across restarts. The tier keeps the database
  // writable instead (from Open on) and, once repairs are enabled, a repair thread reads every
  // stored payload,
  // quarantines the ones that fail (through `handler` when given: it quarantines the key if its
  // meta is still `meta` and returns true; else, or when it returns false, the tier does so
  // itself if the key's meta record is unchanged), then compacts the payload family so the
  // damaged references are dropped and compactions go on. Call once, after recovery.
  using DamageHandler = std::function<bool(const std::string& key, const CacheMeta& meta,
                                           absl::string_view reason)>;
  void EnableRepairs(DamageHandler handler);
  // Stops the repair thread (waits for a pass in progress). Idempotent; the destructor calls it.
  void StopRepairs();
  // Compactions that failed on damaged data (each one a background error kept from stopping
  // writes), repair passes run, and caches those passes quarantined.
  uint64_t background_corruptions() const;
  uint64_t repairs() const { return repairs_.load(); }
  uint64_t repaired_quarantined() const { return repaired_quarantined_.load(); }
  // What the last repair pass did, for the log ("" before the first).
  std::string last_repair() const;

  // Damage to the write-ahead log met by the read-write Open. The log is replayed record by
  // record past a damaged stretch (RocksDB's kSkipAnyCorruptedRecords), so a media fault in the
  // middle of a log loses only the writes whose records it hit (each put is one record: meta,
  // payload and direct-file name together, so it is whole or absent, and its payload's CRC32C is
  // checked before it is served) instead of refusing the open or dropping every later log.
  // Counted here; an open that met damage flushes at once, so the damaged log is retired.
  struct LogDamage {
    uint64_t regions = 0;  // damaged stretches skipped (one per RocksDB corruption report)
    uint64_t bytes = 0;    // log bytes dropped with them
    std::string last;      // RocksDB's report of the last one ("<log file>: dropping ...")
  };
  const LogDamage& log_damage() const { return log_damage_; }

  // Damaged table files (.sst) met by Open: one RocksDB refuses to open (footer, index or
  // properties damaged, the file cut short) or one whose data blocks fail their checksums while
  // the tier's families are read at open. Each is taken out of the database (an edit appended
  // to the MANIFEST removes it; the file is moved to <path>/damaged/) and the database opened
  // again: the caches whose records it held are lost (a miss; a delete or overwrite recorded
  // only there is undone, the older cache served whole and checked), every other table is
  // served. Direct-file records its loss leaves without their meta are removed with their files.
  // A damaged table met later (a get, a compaction) is noted in <path>/damaged/pending and
  // taken out at the next open.
  struct TableDamage {
    uint64_t tables = 0;   // tables taken out
    uint64_t salvaged = 0;  // records read from them and written again before they went
    uint64_t orphans = 0;  // direct-file and payload records removed with no meta left
    // Key ranges of the payload tables taken out at this open (for RemoveOrphans).
    std::vector<std::pair<std::string, std::string>> payload_ranges;
    std::string last;      // what the last one was and why
    // A MANIFEST that ended in part of a record at open (RocksDB ignores that edit): 1 or 0.
    uint64_t manifest_tails = 0;
    std::string last_manifest_tail;
  };
  const TableDamage& table_damage() const { return table_damage_; }


 private:
  // One open instance of the database: read-write, or read-only while the disk is short. The
  // tier swaps a read-only instance for a read-write one when space returns; calls in flight
  // keep the instance they started with.
  struct Db;
  enum class WriteKind { kAdds, kRemoves };
  // Shared with the event listener of every Db instance.
  struct DamageSignal {
    std::mutex mu;
    std::condition_variable cv;
    bool enabled = true;  // compaction corruption is kept from stopping writes
    bool pending = false;
    bool stop = false;
    uint64_t events = 0;
    std::string last_error;
  };

  explicit RocksDbTier(const RocksDbTierOptions& options);
  std::shared_ptr<Db> db() const;
  // `log_damage`, when not null, receives what the replay of the log skipped.
  static absl::StatusOr<std::shared_ptr<Db>> OpenDb(const RocksDbTierOptions& o,
                                                    const std::shared_ptr<rocksdb::Cache>& cache,
                                                    bool read_only,
                                                    const std::shared_ptr<DamageSignal>& damage,
                                                    LogDamage* log_damage = nullptr,
                                                    TableDamage* table_damage = nullptr);
  // Reads the families at open: sizes from the meta records, direct-file names, the quarantine
  // and calibration families read through (so a damaged table of any family is met here).
  absl::Status ScanAtOpen();
  // The tables noted in <path>/damaged/pending; whether `table` is part of the open database.
  std::vector<std::string> PendingTables() const;
  bool IsLiveTable(const std::string& table) const;
  // Writes again, into new tables, every record of the damaged `table` that can still be read
  // (the meta, payload and direct-file families; the keys read from the table itself, or for a
  // payload table the meta family's keys in its range): how many.
  absl::StatusOr<uint64_t> Salvage(const std::string& table);
  // Forgets what ScanAtOpen learnt (before the database is opened again).
  void ForgetAll();
  // Removes direct-file records (and their files) whose meta is gone after a table was dropped,
  // and payload records without meta in the key range of a payload table taken out, as far as
  // the families read: a damaged block ends the list (noted, never an error).
  absl::Status RemoveOrphans();
  absl::Status Write(void* batch, bool sync, absl::string_view what, WriteKind kind);
  // Refuses a write that the disk cannot take (ResourceExhausted, "disk full").
  absl::Status AdmitWrite(Db& db, uint64_t bytes, WriteKind kind) const;
  // Reopens a read-only database read-write when the disk has room again (at most once a
  // second). True when the database is writable afterwards.
  bool TryReopenWritable();
  // Bytes RocksDB needs free to open read-write: the reserve plus the WAL it will flush.
  uint64_t BytesToOpenWritable() const;
  absl::StatusOr<Payload> GetFrom(Db& db, absl::string_view key);
  // Direct files: written whole and synced (direct I/O where the filesystem takes it), read
  // whole, removed (absent is fine).
  absl::StatusOr<std::string> WriteDirectFile(const Payload& payload);
  // The name of an empty file under <path>/direct whose directory entry is already durable:
  // files are made kDirectPoolBatch at a time with one directory sync, so a put syncs only its
  // own file and its record (a pool file no record names is removed at the next Open).
  absl::StatusOr<std::string> TakeDirectName();
  absl::StatusOr<Payload> ReadDirectFile(rocksdb::FSRandomAccessFile& file, const std::string& name,
                                         uint64_t size);
  void RemoveDirectFile(const std::string& name);
  // Removes every file under <path>/direct that no record names (read-write opens only).
  absl::Status RemoveUnnamedDirectFiles(Db& db);
  absl::Status QuarantineIn(Db& db, absl::string_view key, absl::string_view reason);
  void RepairLoop();
  void RepairPass();

  const RocksDbTierOptions options_;
  const uint64_t capacity_;
  const uint64_t reserve_;
  const uint64_t max_space_;
  std::shared_ptr<rocksdb::Cache> block_cache_;
  std::shared_ptr<rocksdb::FileSystem> fs_;  // the env's file system (tests inject faults)
  std::string direct_dir_;                   // <path>/direct
  std::atomic<uint64_t> direct_seq_{0};
  std::mutex pool_mu_;
  std::vector<std::string> direct_pool_;  // guarded by pool_mu_
  std::shared_ptr<Db> db_;  // std::atomic_load / atomic_store
  mutable SharedMutex reopen_mu_;
  std::string read_only_reason_ ABSL_GUARDED_BY(reopen_mu_);
  std::atomic<int64_t> last_reopen_ms_{0};
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> entries_{0};
  std::atomic<bool> needs_resume_{false};

  // Sizes of stored payloads, for accounting; per-key writes are serialised by stripe.
  static constexpr int kStripes = 64;
  struct Stripe {
    SharedMutex mu;
    absl::flat_hash_map<std::string, uint64_t> sizes ABSL_GUARDED_BY(mu);
    // Keys whose payload is a direct file: the file's name under <path>/direct.
    absl::flat_hash_map<std::string, std::string> files ABSL_GUARDED_BY(mu);
  };
  Stripe stripes_[kStripes];
  Stripe& StripeOf(absl::string_view key);
  // Drops `key` from the accounting (its stripe's sizes, used_, entries_) if it is there.
  void ForgetSize(Stripe& st, absl::string_view key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(st.mu);
  // Quarantine with the key's stripe held; `expect_meta`, when not null, must still be the key's
  // meta record (else nothing is done and false is returned).
  absl::StatusOr<bool> QuarantineLocked(Db& db, Stripe& st, absl::string_view key,
                                        absl::string_view reason, const std::string* expect_meta)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(st.mu);
  SharedMutex calibration_mu_;  // serialises PutCalibration's read-compare-write
  SharedMutex quarantine_mu_;   // serialises the purges' read-delete

  std::shared_ptr<DamageSignal> damage_ = std::make_shared<DamageSignal>();
  DamageHandler damage_handler_;
  std::thread repairer_;
  std::atomic<uint64_t> repairs_{0};
  std::atomic<uint64_t> repaired_quarantined_{0};
  LogDamage log_damage_;  // set by Open, read-only afterwards
  TableDamage table_damage_;  // likewise
  mutable std::mutex repair_report_mu_;
  std::string last_repair_;
};

}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_STORAGE_SRC_ROCKSDB_TIER_H_
