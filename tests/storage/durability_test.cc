// Removals that must survive a power cut, checked in-process: the store runs on a file system
// that keeps unsynced WAL bytes in memory (power_loss_fs.h); SimulatePowerLoss() drops them, the
// store is closed and reopened from what is on disk. An older disk-durable value must never come
// back after a memory-durable overwrite, a delete or an eviction was acknowledged. Also: the
// quarantine purge, durable across reopen.
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvcomp/storage/tiered_store.h"
#include "power_loss_fs.h"
#include "rocksdb/env.h"
#include "rocksdb_tier.h"
#include "storage_test_util.h"

namespace kvcomp {
namespace storage {
namespace {

using testing::EncodedCache;
using testing::PowerLossFileSystem;
using testing::TempDir;

CacheKey Key(const std::string& k) { return CacheKey{"t1", "llama-8b", k}; }

StoreOptions HostAndDisk(const std::string& path, uint64_t host_capacity,
                         uint64_t disk_capacity = 1ull << 30) {
  StoreOptions o;
  o.host.capacity_bytes = host_capacity;
  o.rocksdb.enabled = true;
  o.rocksdb.path = path;
  o.rocksdb.capacity_bytes = disk_capacity;
  o.rocksdb.min_blob_size = 4096;
  return o;
}

// A store on a power-loss file system; Cut() drops what was not synced and closes it.
class CuttableStore {
 public:
  explicit CuttableStore(StoreOptions o)
      : fs_(std::make_shared<PowerLossFileSystem>(rocksdb::FileSystem::Default())),
        env_(rocksdb::NewCompositeEnv(fs_)) {
    o.rocksdb.env = env_.get();
    auto s = TieredStore::Open(o);
    EXPECT_TRUE(s.ok()) << s.status();
    if (s.ok()) store_ = *std::move(s);
  }
  TieredStore* operator->() { return store_.get(); }
  PowerLossFileSystem& fs() { return *fs_; }
  void Cut() {
    fs_->SimulatePowerLoss();
    store_.reset();
  }

 private:
  std::shared_ptr<PowerLossFileSystem> fs_;
  std::unique_ptr<rocksdb::Env> env_;
  std::unique_ptr<TieredStore> store_;
};

std::unique_ptr<TieredStore> MustOpen(const StoreOptions& o) {
  auto s = TieredStore::Open(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

PutOptions Disk() {
  PutOptions p;
  p.durability = Durability::kDisk;
  return p;
}

TEST(PowerLoss, TheHarnessLosesUnsyncedWrites) {
  // Without this, the tests below would prove nothing.
  TempDir dir;
  {
    CuttableStore store(HostAndDisk(dir.path(), 1 << 20));
    PutOptions to_disk;
    to_disk.tier = static_cast<int>(TierKind::kRocksDb);
    ASSERT_TRUE(store->Put(Key("unsynced"), EncodedCache(1), {}, to_disk).ok());
    ASSERT_TRUE(store->Put(Key("synced"), EncodedCache(2), {}, Disk()).ok());
    ASSERT_TRUE(store->Put(Key("unsynced-after"), EncodedCache(3), {}, to_disk).ok());
    store.Cut();
  }
  auto store = MustOpen(HostAndDisk(dir.path(), 1 << 20));
  EXPECT_TRUE(store->Get(Key("unsynced")).ok());  // made durable by the later sync (WAL order)
  EXPECT_EQ(store->Get(Key("synced"))->payload.view(), EncodedCache(2));
  EXPECT_TRUE(absl::IsNotFound(store->Get(Key("unsynced-after")).status()));
}

TEST(PowerLoss, AMemoryOverwriteOfADiskDurableCacheNeverBringsTheOldValueBack) {
  TempDir dir;
  const std::string v1 = EncodedCache(10), v2 = EncodedCache(11), v3 = EncodedCache(12);
  {
    CuttableStore store(HostAndDisk(dir.path(), 1 << 20));
    // In host + RocksDB (write-through), then overwritten in host only.
    ASSERT_TRUE(store->Put(Key("host"), v1, {}, Disk()).ok());
    ASSERT_TRUE(store->Put(Key("host"), v2, {}, {}).ok());
    EXPECT_FALSE(store->Lookup(Key("host"))->persisted);
    // In RocksDB only, then overwritten in RocksDB with memory durability.
    PutOptions on_disk = Disk();
    on_disk.tier = static_cast<int>(TierKind::kRocksDb);
    ASSERT_TRUE(store->Put(Key("rocks"), v1, {}, on_disk).ok());
    PutOptions memory_to_disk;
    memory_to_disk.tier = static_cast<int>(TierKind::kRocksDb);
    ASSERT_TRUE(store->Put(Key("rocks"), v3, {}, memory_to_disk).ok());
    // On disk only, then replaced in host.
    ASSERT_TRUE(store->Put(Key("demoted"), v1, {}, on_disk).ok());
    ASSERT_TRUE(store->Put(Key("demoted"), v2, {}, {}).ok());
    store.Cut();
  }
  auto store = MustOpen(HostAndDisk(dir.path(), 1 << 20));
  // The memory-durable value is gone with the power; the older durable one must not return.
  EXPECT_TRUE(absl::IsNotFound(store->Get(Key("host")).status()));
  EXPECT_TRUE(absl::IsNotFound(store->Get(Key("demoted")).status()));
  // Written into RocksDB over a durable value: synced, so it is the new value that survives.
  auto rocks = store->Get(Key("rocks"));
  ASSERT_TRUE(rocks.ok()) << rocks.status();
  EXPECT_EQ(rocks->payload.view(), v3);
}

TEST(PowerLoss, AcknowledgedDeletesStayDeleted) {
  TempDir dir;
  const std::string bytes = EncodedCache(20);
  {
    CuttableStore store(HostAndDisk(dir.path(), 3 * bytes.size()));
    ASSERT_TRUE(store->Put(Key("durable"), bytes, {}, Disk()).ok());
    // Memory-durable puts that get demoted into RocksDB (unsynced writes).
    for (int i = 0; i < 6; ++i) ASSERT_TRUE(store->Put(Key(std::to_string(i)), bytes, {}, {}).ok());
    ASSERT_TRUE(store->Lookup(Key("0"))->persisted);
    ASSERT_TRUE(store->Put(Key("sync point"), bytes, {}, Disk()).ok());  // makes them durable
    ASSERT_TRUE(store->Delete(Key("durable")).ok());
    ASSERT_TRUE(store->Delete(Key("0")).ok());
    store.Cut();
  }
  auto store = MustOpen(HostAndDisk(dir.path(), 3 * bytes.size()));
  EXPECT_TRUE(absl::IsNotFound(store->Get(Key("durable")).status()));
  EXPECT_TRUE(absl::IsNotFound(store->Get(Key("0")).status()));
  EXPECT_TRUE(store->Get(Key("1")).ok());
  EXPECT_TRUE(store->Get(Key("sync point")).ok());
}

TEST(PowerLoss, EvictionsFromRocksDbAreDurableAndCostOneSyncPerSweep) {
  TempDir dir;
  const std::string bytes = EncodedCache(30);
  const uint64_t n = bytes.size();
  StoreOptions o = HostAndDisk(dir.path(), 1 << 20, 20 * n);  // RocksDB: high 18n, low 15n
  o.host.enabled = false;
  o.default_tier = TierKind::kRocksDb;
  {
    CuttableStore store(o);
    for (int i = 0; i < 18; ++i) {
      ASSERT_TRUE(store->Put(Key(std::to_string(i)), bytes, {}, Disk()).ok());
    }
    EXPECT_EQ(store->Stats().tier(TierKind::kRocksDb).evictions, 0u);
    const uint64_t before = store.fs().wal_syncs();
    // 19n > 18n: evict the four least recently used (0..3) down to 15n, in one synced write.
    ASSERT_TRUE(store->Put(Key("18"), bytes, {}, Disk()).ok());
    EXPECT_EQ(store->Stats().tier(TierKind::kRocksDb).evictions, 4u);
    EXPECT_EQ(store.fs().wal_syncs() - before, 2u) << "the put's sync and one for the sweep";
    // A value written (unsynced, memory durability) after the sweep is lost; the sweep is not.
    PutOptions memory;
    ASSERT_TRUE(store->Put(Key("late"), bytes, {}, memory).ok());
    store.Cut();
  }
  o.rocksdb.env = nullptr;
  auto store = MustOpen(o);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(absl::IsNotFound(store->Get(Key(std::to_string(i))).status())) << i << " is back";
  }
  for (int i = 4; i <= 18; ++i) EXPECT_TRUE(store->Get(Key(std::to_string(i))).ok()) << i;
  EXPECT_TRUE(absl::IsNotFound(store->Get(Key("late")).status()));
}

TEST(PowerLoss, ADemotionSweepIntoAFullDiskTierSyncsOnce) {
  TempDir dir;
  const std::string bytes = EncodedCache(31);
  const uint64_t n = bytes.size();
  StoreOptions o = HostAndDisk(dir.path(), 10 * n, 10 * n);  // both: high 9n, low 7.5n
  CuttableStore store(o);
  for (int i = 0; i < 9; ++i) {
    ASSERT_TRUE(store->Put(Key("d" + std::to_string(i)), bytes, {}, Disk()).ok());
  }
  for (int i = 0; i < 9; ++i) {
    ASSERT_TRUE(store->Put(Key("m" + std::to_string(i)), bytes, {}, {}).ok());
  }
  const uint64_t before_evictions = store->Stats().tier(TierKind::kRocksDb).evictions;
  const uint64_t before = store.fs().wal_syncs();
  // The host sweep moves several memory-only entries into RocksDB, which evicts to make room.
  for (int i = 9; i < 12; ++i) {
    ASSERT_TRUE(store->Put(Key("m" + std::to_string(i)), bytes, {}, {}).ok());
  }
  const uint64_t evicted = store->Stats().tier(TierKind::kRocksDb).evictions - before_evictions;
  EXPECT_GT(evicted, 1u);
  EXPECT_LT(store.fs().wal_syncs() - before, evicted) << "evictions are batched";
}

TEST(PowerLoss, ExpiryIsDurableAndCostsOneSyncPerSweep) {
  TempDir dir;
  auto now = std::make_shared<absl::Time>(absl::FromUnixSeconds(5000000));
  StoreOptions o = HostAndDisk(dir.path(), 1 << 20);
  o.clock = [now] { return *now; };
  const absl::Time start = *now;
  {
    CuttableStore store(o);
    PutOptions ttl = Disk();
    ttl.ttl = absl::Seconds(10);
    for (int i = 0; i < 10; ++i) {
      ASSERT_TRUE(store->Put(Key(std::to_string(i)), EncodedCache(50 + i), {}, ttl).ok());
    }
    ASSERT_TRUE(store->Put(Key("forever"), EncodedCache(60), {}, Disk()).ok());
    *now += absl::Seconds(11);
    const uint64_t before = store.fs().wal_syncs();
    EXPECT_EQ(store->ExpireNow(), 10u);
    EXPECT_EQ(store.fs().wal_syncs() - before, 1u);
    store.Cut();
  }
  // Reopened with the clock back before the expiry: had the deletes been lost, the entries
  // would be live again.
  *now = start;
  auto store = MustOpen(o);
  for (int i = 0; i < 10; ++i) {
    EXPECT_TRUE(absl::IsNotFound(store->Get(Key(std::to_string(i))).status())) << i;
  }
  EXPECT_TRUE(store->Get(Key("forever")).ok());
  EXPECT_EQ(store->Stats().recovered, 1u);
}

TEST(Quarantine, PurgeOneAndAllDurably) {
  TempDir dir;
  const std::string good = EncodedCache(40), bad = EncodedCache(41);
  auto o = HostAndDisk(dir.path(), 1 << 20);
  {
    auto store = MustOpen(o);
    PutOptions durable = Disk();
    durable.tier = static_cast<int>(TierKind::kRocksDb);
    ASSERT_TRUE(store->Put(Key("good"), good, {}, durable).ok());
    for (const char* k : {"bad1", "bad2", "bad3"}) {
      ASSERT_TRUE(store->Put(Key(k), bad, {}, durable).ok());
    }
  }
  {
    // Damage three payloads behind the store's back.
    auto tier = RocksDbTier::Open(o.rocksdb);
    ASSERT_TRUE(tier.ok());
    std::string flipped = bad;
    flipped[bad.size() / 3] ^= 0x11;
    for (const char* k : {"bad1", "bad2", "bad3"}) {
      const std::string ek = Key(k).Encode();
      auto meta = (*tier)->GetMeta(ek);
      ASSERT_TRUE(meta.ok());
      ASSERT_TRUE((*tier)->Put(ek, *meta, Payload::Copy(flipped), true).ok());
    }
  }
  {
    auto store = MustOpen(o);
    ASSERT_EQ(store->Quarantined().size(), 3u);
    EXPECT_TRUE(absl::IsNotFound(store->PurgeQuarantined(Key("good").Encode())));
    EXPECT_TRUE(absl::IsNotFound(store->PurgeQuarantined("")));
    ASSERT_TRUE(store->PurgeQuarantined(Key("bad1").Encode()).ok());
    EXPECT_TRUE(absl::IsNotFound(store->PurgeQuarantined(Key("bad1").Encode())));
    ASSERT_EQ(store->Quarantined().size(), 2u);
    for (const QuarantinedCache& q : store->Quarantined())
      EXPECT_NE(q.encoded_key, Key("bad1").Encode());
    // The key itself is free for a new cache.
    ASSERT_TRUE(store->Put(Key("bad1"), good, {}, Disk()).ok());
  }
  {
    auto store = MustOpen(o);  // the purge was durable
    ASSERT_EQ(store->Quarantined().size(), 2u);
    EXPECT_EQ(store->Get(Key("bad1"))->payload.view(), good);
    auto purged = store->PurgeAllQuarantined();
    ASSERT_TRUE(purged.ok()) << purged.status();
    EXPECT_EQ(*purged, 2u);
    EXPECT_TRUE(store->Quarantined().empty());
    EXPECT_EQ(*store->PurgeAllQuarantined(), 0u);
  }
  auto store = MustOpen(o);
  EXPECT_TRUE(store->Quarantined().empty());
  EXPECT_EQ(store->Get(Key("good"))->payload.view(), good);
  EXPECT_EQ(store->Stats().recovered, 2u);
}

TEST(Quarantine, PurgeWithoutRocksDbTouchesOnlyTheList) {
  StoreOptions o;
  o.host.capacity_bytes = 1 << 20;
  auto store = MustOpen(o);
  EXPECT_TRUE(absl::IsNotFound(store->PurgeQuarantined("x")));
  EXPECT_EQ(*store->PurgeAllQuarantined(), 0u);
}

}  // namespace
}  // namespace storage
}  // namespace kvcomp
