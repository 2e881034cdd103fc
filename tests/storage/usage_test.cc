// TieredStore follow-up features: per-tenant Usage() kept without scans (checked against a
// List()-based recount after random operation mixes and after reopen), and purging the
// quarantine (one entry, or all of them; durably).
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvcomp/storage/tiered_store.h"
#include "rocksdb_tier.h"
#include "storage_test_util.h"

namespace kvcomp {
namespace storage {
namespace {

using testing::EncodedCache;
using testing::TempDir;

const char* const kTenants[] = {"", "t1", "t2", "team.b"};

std::unique_ptr<TieredStore> MustOpen(const StoreOptions& o) {
  auto s = TieredStore::Open(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

// Usage() recomputed the slow way: List() of every tenant the test uses.
std::map<std::string, TenantUsage> Recount(TieredStore& store) {
  std::map<std::string, TenantUsage> out;
  for (const char* tenant : kTenants) {
    auto list = store.List(tenant);
    EXPECT_TRUE(list.ok()) << list.status();
    if (!list.ok()) continue;
    for (const ListedCache& c : *list) {
      const std::string name = c.key.tenant.empty() ? "default" : c.key.tenant;
      TenantUsage& u = out[name];
      u.tenant = name;
      u.caches += 1;
      u.stored_bytes += c.info.meta.stored_bytes;
      u.original_bytes += c.info.meta.original_bytes;
    }
  }
  return out;
}

void ExpectUsageMatchesRecount(TieredStore& store, const std::string& where) {
  const std::map<std::string, TenantUsage> want = Recount(store);
  const std::vector<TenantUsage> got = store.Usage();
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < got.size(); ++i) {
    if (i > 0) {
      EXPECT_LT(got[i - 1].tenant, got[i].tenant) << where;  // sorted, unique
    }
    auto it = want.find(got[i].tenant);
    ASSERT_NE(it, want.end()) << where << ": unexpected tenant " << got[i].tenant;
    EXPECT_EQ(got[i].caches, it->second.caches) << where << " " << got[i].tenant;
    EXPECT_EQ(got[i].stored_bytes, it->second.stored_bytes) << where << " " << got[i].tenant;
    EXPECT_EQ(got[i].original_bytes, it->second.original_bytes) << where << " " << got[i].tenant;
  }
}

// A random mix of puts (sizes, durabilities, tiers, pins, TTLs, overwrites), gets, deletes,
// pins, unpins, clock steps and expiry sweeps over a store small enough that entries are
// demoted and evicted. Usage() must equal the recount after every sweep (expired entries count
// until removed, so the comparison follows ExpireNow).
void RandomMix(TieredStore& store, absl::Time* now, bool has_rocks, uint64_t seed, int ops) {
  std::mt19937_64 rng(seed);
  std::vector<std::string> caches;
  for (int i = 0; i < 6; ++i) caches.push_back(EncodedCache(seed * 31 + i, 8 + 40 * i));
  for (int op = 0; op < ops; ++op) {
    const CacheKey key{kTenants[rng() % 4], "m", "k" + std::to_string(rng() % 24)};
    switch (rng() % 10) {
      case 0:
      case 1:
      case 2:
      case 3: {
        PutOptions po;
        if (has_rocks && rng() % 3 == 0) po.durability = Durability::kDisk;
        if (has_rocks && rng() % 4 == 0) po.tier = static_cast<int>(TierKind::kRocksDb);
        po.pin = rng() % 12 == 0;
        if (rng() % 3 == 0) po.ttl = absl::Seconds(1 + rng() % 20);
        CacheMeta meta;
        if (rng() % 2 == 0) meta.original_bytes = 1000 + rng() % 100000;
        store.Put(key, caches[rng() % caches.size()], meta, po).IgnoreError();
        break;
      }
      case 4:
      case 5:
        store.Get(key).IgnoreError();
        break;
      case 6:
        store.Delete(key).IgnoreError();
        break;
      case 7:
        if (rng() % 2 == 0) {
          store.Pin(key).IgnoreError();
        } else {
          store.Unpin(key).IgnoreError();
        }
        break;
      case 8:
        *now += absl::Seconds(rng() % 4);
        break;
      default:
        store.ExpireNow();
        ExpectUsageMatchesRecount(store, "op " + std::to_string(op));
        if (::testing::Test::HasFatalFailure()) return;
        break;
    }
  }
  store.ExpireNow();
  ExpectUsageMatchesRecount(store, "end");
}

TEST(Usage, EmptyStoreHasNoTenants) {
  StoreOptions o;
  o.host.capacity_bytes = 1 << 20;
  auto store = MustOpen(o);
  EXPECT_TRUE(store->Usage().empty());
}

TEST(Usage, CountsPutsOverwritesDeletesAndEvictionsPerTenant) {
  const std::string a = EncodedCache(1), b = EncodedCache(2, 200);
  StoreOptions o;
  o.host.capacity_bytes = 4 * b.size();
  auto store = MustOpen(o);
  CacheMeta meta;
  meta.original_bytes = 1000;
  ASSERT_TRUE(store->Put({"", "m", "x"}, a, meta, {}).ok());
  ASSERT_TRUE(store->Put({"t1", "m", "x"}, a, meta, {}).ok());
  ASSERT_TRUE(store->Put({"t1", "m", "y"}, a, {}, {}).ok());
  std::vector<TenantUsage> u = store->Usage();
  ASSERT_EQ(u.size(), 2u);
  EXPECT_EQ(u[0].tenant, "default");
  EXPECT_EQ(u[0].caches, 1u);
  EXPECT_EQ(u[0].stored_bytes, a.size());
  EXPECT_EQ(u[0].original_bytes, 1000u);
  EXPECT_EQ(u[1].tenant, "t1");
  EXPECT_EQ(u[1].caches, 2u);
  EXPECT_EQ(u[1].stored_bytes, 2 * a.size());
  EXPECT_EQ(u[1].original_bytes, 1000u + store->Lookup({"t1", "m", "y"})->meta.original_bytes);
  // Overwrite: one cache, new sizes.
  ASSERT_TRUE(store->Put({"t1", "m", "x"}, b, meta, {}).ok());
  u = store->Usage();
  EXPECT_EQ(u[1].caches, 2u);
  EXPECT_EQ(u[1].stored_bytes, a.size() + b.size());
  ASSERT_TRUE(store->Delete({"", "m", "x"}).ok());
  u = store->Usage();
  ASSERT_EQ(u.size(), 1u);
  EXPECT_EQ(u[0].tenant, "t1");
  // Evictions from the last tier leave the counts.
  for (int i = 0; i < 6; ++i)
    ASSERT_TRUE(store->Put({"t2", "m", std::to_string(i)}, b, {}, {}).ok());
  EXPECT_GT(store->Stats().tier(TierKind::kHost).evictions, 0u);
  ExpectUsageMatchesRecount(*store, "after evictions");
}

TEST(Usage, EqualsAListRecountAfterRandomOperationsInMemory) {
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    auto now = std::make_shared<absl::Time>(absl::FromUnixSeconds(2000000));
    StoreOptions o;
    o.host.capacity_bytes = 6 * EncodedCache(0, 208).size();
    o.clock = [now] { return *now; };
    auto store = MustOpen(o);
    RandomMix(*store, now.get(), /*has_rocks=*/false, seed, 600);
    if (HasFatalFailure()) return;
  }
}

TEST(Usage, EqualsAListRecountAfterRandomOperationsOnDiskAndAfterReopen) {
  for (uint64_t seed = 11; seed <= 13; ++seed) {
    TempDir dir;
    auto now = std::make_shared<absl::Time>(absl::FromUnixSeconds(3000000));
    const uint64_t big = EncodedCache(0, 208).size();
    StoreOptions o;
    o.host.capacity_bytes = 4 * big;
    o.rocksdb.enabled = true;
    o.rocksdb.path = dir.path();
    o.rocksdb.capacity_bytes = 10 * big;  // small: the disk tier evicts too
    o.rocksdb.min_blob_size = 4096;
    o.clock = [now] { return *now; };
    {
      auto store = MustOpen(o);
      RandomMix(*store, now.get(), /*has_rocks=*/true, seed, 500);
      if (HasFatalFailure()) return;
      const StoreStats st = store->Stats();
      EXPECT_GT(st.tier(TierKind::kHost).demotions, 0u) << seed;
      EXPECT_GT(st.tier(TierKind::kRocksDb).evictions, 0u) << seed;
    }
    // Recovery rebuilds the counts from RocksDB (what was persisted, minus what expired).
    *now += absl::Seconds(3);
    auto store = MustOpen(o);
    EXPECT_GT(store->Stats().recovered, 0u) << seed;
    ExpectUsageMatchesRecount(*store, "reopen seed " + std::to_string(seed));
    RandomMix(*store, now.get(), /*has_rocks=*/true, seed + 100, 200);
  }
}

}  // namespace
}  // namespace storage
}  // namespace kvcomp
