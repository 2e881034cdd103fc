// Many readers and writers on one store at once: puts, gets (with promotion), deletes, pins,
// lookups, lists and expiry from several threads, with entries demoted and evicted underneath.
// Every payload read must be one that was written for that key, whole; handles held across
// deletes stay valid; afterwards the per-tier byte counts agree with the index. Also built with
// ThreadSanitizer (scripts/run_tests.sh).
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kvcomp/storage/tiered_store.h"
#include "storage_test_util.h"

namespace kvcomp {
namespace storage {
namespace {

using testing::TempDir;

// A payload that names its key and version, so a reader can check it is whole and its own.
std::string Value(int key, uint32_t version, size_t size) {
  std::string v(std::max<size_t>(size, 16), '\0');
  const uint32_t k = static_cast<uint32_t>(key);
  std::memcpy(v.data(), &k, 4);
  std::memcpy(v.data() + 4, &version, 4);
  for (size_t i = 8; i < v.size(); ++i) v[i] = static_cast<char>((k * 31 + version * 7 + i) & 0xff);
  return v;
}

bool Intact(const Payload& p, int key) {
  if (p.size() < 16) return false;
  uint32_t k, version;
  std::memcpy(&k, p.data(), 4);
  std::memcpy(&version, p.data() + 4, 4);
  return k == static_cast<uint32_t>(key) && p.view() == Value(key, version, p.size());
}

CacheKey Key(int i) { return CacheKey{"t" + std::to_string(i % 3), "m", "k" + std::to_string(i)}; }

void Hammer(const StoreOptions& o, int threads, int ops_per_thread) {
  auto store_or = TieredStore::Open(o);
  ASSERT_TRUE(store_or.ok()) << store_or.status();
  TieredStore& store = **store_or;
  constexpr int kKeys = 48;
  std::atomic<uint32_t> version{1};
  std::atomic<int> bad{0};
  std::mutex first_mu;
  std::string first;
  auto fail = [&](const std::string& what) {
    if (bad++ == 0) {
      std::lock_guard<std::mutex> lock(first_mu);
      first = what;
    }
  };
  std::atomic<uint64_t> ok_gets{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      PutOptions raw;
      raw.validate = false;
      std::vector<std::pair<int, Payload>> held;
      std::vector<int> pinned;
      for (int i = 0; i < ops_per_thread; ++i) {
        const int k = static_cast<int>(rng() % kKeys);
        const int op = static_cast<int>(rng() % 100);
        if (op < 35) {
          PutOptions po = raw;
          po.durability =
              (o.rocksdb.enabled && rng() % 4 == 0) ? Durability::kDisk : Durability::kMemory;
          if (rng() % 10 == 0) po.ttl = absl::Milliseconds(1 + rng() % 5);  // expiry sweeps
          const absl::Status st = store.Put(Key(k), Value(k, version++, 64 + rng() % 3000), {}, po);
          if (!st.ok() && !absl::IsResourceExhausted(st)) fail("put: " + st.ToString());
        } else if (op < 75) {
          auto got = store.Get(Key(k));
          if (got.ok()) {
            ++ok_gets;
            if (!Intact(got->payload, k)) fail("get: not intact");
            if (rng() % 8 == 0) held.emplace_back(k, got->payload);
          } else if (!absl::IsNotFound(got.status()) && !absl::IsUnavailable(got.status())) {
            fail("get: " + got.status().ToString());
          }
        } else if (op < 85) {
          const absl::Status st = store.Delete(Key(k));
          if (!st.ok() && !absl::IsNotFound(st)) fail("delete: " + st.ToString());
        } else if (op < 90) {
          if (store.Pin(Key(k)).ok()) pinned.push_back(k);
        } else if (op < 95) {
          if (!pinned.empty()) {
            // Deleted (and maybe put again, unpinned) by another thread meanwhile is fine.
            const absl::Status st = store.Unpin(Key(pinned.back()));
            if (!st.ok() && !absl::IsNotFound(st) && !absl::IsFailedPrecondition(st)) {
              fail("unpin: " + st.ToString());
            }
            pinned.pop_back();
          }
        } else if (op < 98) {
          auto look = store.Lookup(Key(k));
          if (!look.ok() && !absl::IsNotFound(look.status())) fail("lookup");
        } else {
          if (!store.List("t" + std::to_string(k % 3)).ok()) fail("list");
          store.ExpireNow();
        }
      }
      for (int k : pinned) {
        // A pinned entry may have been deleted meanwhile; otherwise the unpin succeeds.
        const absl::Status st = store.Unpin(Key(k));
        if (!st.ok() && !absl::IsNotFound(st) && !absl::IsFailedPrecondition(st)) {
          fail("final unpin: " + st.ToString());
        }
      }
      for (const auto& [k, p] : held) {
        if (!Intact(p, k)) fail("held: not intact");
      }
    });
  }
  for (auto& th : pool) th.join();
  EXPECT_EQ(bad.load(), 0) << first;
  EXPECT_GT(ok_gets.load(), 0u);
  // Every TTL (at most 5 ms) has passed: remove those entries, so the index holds live ones.
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  store.ExpireNow();
  EXPECT_GT(store.Stats().expired, 0u);

  // Quiescent: the index and the tiers agree.
  uint64_t bytes[kNumTiers] = {0, 0, 0};
  uint64_t entries[kNumTiers] = {0, 0, 0};
  for (int k = 0; k < kKeys; ++k) {
    auto look = store.Lookup(Key(k));
    if (!look.ok()) continue;
    EXPECT_EQ(look->pin_count, 0u);
    const int t = static_cast<int>(look->tier);
    bytes[t] += look->meta.stored_bytes;
    entries[t] += 1;
    if (look->persisted && t != static_cast<int>(TierKind::kRocksDb)) {
      bytes[2] += look->meta.stored_bytes;
      entries[2] += 1;
    }
  }
  const StoreStats st = store.Stats();
  if (o.rocksdb.enabled) {
    EXPECT_GT(st.tier(TierKind::kRocksDb).evictions, 0u)
        << "RocksDB never evicted (synced batches)";
  }
  for (int t = 0; t < kNumTiers; ++t) {
    if (!st.tiers[t].present) continue;
    EXPECT_EQ(st.tiers[t].bytes, bytes[t]) << TierName(static_cast<TierKind>(t));
    EXPECT_EQ(st.tiers[t].entries, entries[t]) << TierName(static_cast<TierKind>(t));
    EXPECT_LE(st.tiers[t].bytes, st.tiers[t].capacity);
  }
  // Per-tenant usage, kept incrementally under all of the above, equals a recount of the index.
  std::map<std::string, TenantUsage> want;
  for (int k = 0; k < kKeys; ++k) {
    auto look = store.Lookup(Key(k));
    if (!look.ok()) continue;
    TenantUsage& u = want[Key(k).tenant];
    u.tenant = Key(k).tenant;
    u.caches += 1;
    u.stored_bytes += look->meta.stored_bytes;
    u.original_bytes += look->meta.original_bytes;
  }
  const std::vector<TenantUsage> usage = store.Usage();
  ASSERT_EQ(usage.size(), want.size());
  for (const TenantUsage& u : usage) {
    EXPECT_EQ(u.caches, want[u.tenant].caches) << u.tenant;
    EXPECT_EQ(u.stored_bytes, want[u.tenant].stored_bytes) << u.tenant;
    EXPECT_EQ(u.original_bytes, want[u.tenant].original_bytes) << u.tenant;
  }
  for (int k = 0; k < kKeys; ++k) {
    if (!store.Lookup(Key(k)).ok()) continue;
    auto got = store.Get(Key(k));  // may promote, so after the counts above
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(Intact(got->payload, k));
  }
}

TEST(Concurrency, HostOnlyUnderPressure) {
  StoreOptions o;
  o.host.capacity_bytes = 40000;
  o.num_shards = 8;
  Hammer(o, 6, 4000);
}

TEST(Concurrency, HostOverRocksDbWithPromotion) {
  TempDir dir;
  StoreOptions o;
  o.host.capacity_bytes = 30000;
  o.rocksdb.enabled = true;
  o.rocksdb.path = dir.path();
  o.rocksdb.capacity_bytes = 60000;
  o.rocksdb.min_blob_size = 1024;
  o.promote_on_read = true;
  o.num_shards = 4;
  Hammer(o, 4, 1500);
}

TEST(Concurrency, RocksDbOnlyEvictingInSyncedBatches) {
  TempDir dir;
  StoreOptions o;
  o.host.enabled = false;
  o.default_tier = TierKind::kRocksDb;
  o.rocksdb.enabled = true;
  o.rocksdb.path = dir.path();
  o.rocksdb.capacity_bytes = 40000;
  o.rocksdb.min_blob_size = 1024;
  o.num_shards = 4;
  Hammer(o, 4, 800);
}

}  // namespace
}  // namespace storage
}  // namespace kvcomp
