// Disk full on a real filesystem: a tmpfs of a few MiB mounted by the test, filled through the
// store's own puts. Puts are refused with ResourceExhausted ("disk full") before RocksDB meets
// the full disk, every acknowledged cache stays readable, writes resume by themselves when the
// filesystem grows or a file is removed, and a store opened on a full disk opens its RocksDB
// tier read-only, serves every cache, and turns writable again once space returns.
#include <gtest/gtest.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/storage/tiered_store.h"
#include "storage_test_util.h"
#include "tmpfs_mount.h"

namespace kvcomp {
namespace storage {
namespace {

using kvcomp::testing::TmpfsMount;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kTokens = 400;  // about 340 KiB per cache: stored in blob files

CacheKey Key(int i) { return CacheKey{"t", "m", "k" + std::to_string(i)}; }

StoreOptions SmallDiskOptions(const std::string& path) {
  StoreOptions o;
  o.host.capacity_bytes = 64 * kMiB;
  o.rocksdb.enabled = true;
  o.rocksdb.path = path + "/rocksdb";
  o.rocksdb.capacity_bytes = 1ull << 30;  // the disk, not the tier, is the limit here
  o.rocksdb.write_buffer_bytes = 1 * kMiB;
  o.rocksdb.block_cache_bytes = 1 * kMiB;
  o.rocksdb.reserve_bytes = 1 * kMiB;
  o.default_tier = TierKind::kHost;
  return o;
}

PutOptions Durable() {
  PutOptions p;
  p.durability = Durability::kDisk;
  return p;
}

std::unique_ptr<TieredStore> MustOpen(const StoreOptions& o) {
  auto s = TieredStore::Open(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

// Puts disk-durable caches until the store refuses five in a row over a quarter of a second (a
// refusal alone may pass once a flush has turned the WAL into blob files and freed it); returns
// the acknowledged ones and the last refusal.
std::map<int, std::string> FillUntilRefused(TieredStore& store, int first, absl::Status* refusal) {
  std::map<int, std::string> acked;
  int refused_in_a_row = 0;
  *refusal = absl::OkStatus();
  for (int i = first; i < first + 2000 && refused_in_a_row < 5;) {
    std::string bytes = storage::testing::EncodedCache(i, kTokens);
    absl::Status st = store.Put(Key(i), bytes, {}, Durable());
    if (st.ok()) {
      acked.emplace(i, std::move(bytes));
      refused_in_a_row = 0;
      ++i;
      continue;
    }
    *refusal = st;
    ++refused_in_a_row;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return acked;
}

void ExpectAllReadable(TieredStore& store, const std::map<int, std::string>& acked) {
  for (const auto& [i, bytes] : acked) {
    auto got = store.Get(Key(i));
    ASSERT_TRUE(got.ok()) << "cache " << i << ": " << got.status();
    EXPECT_EQ(got->payload.view(), bytes) << "cache " << i;
  }
}

TEST(DiskFull, PutsAreRefusedCleanlyOnARealFullFilesystemAndResumeWhenItGrows) {
  TmpfsMount fs(8 * kMiB);
  ASSERT_TRUE(fs.ok()) << fs.error();
  auto store = MustOpen(SmallDiskOptions(fs.path()));
  ASSERT_NE(store, nullptr);

  absl::Status refusal;
  std::map<int, std::string> acked = FillUntilRefused(*store, 0, &refusal);
  ASSERT_FALSE(refusal.ok()) << "8 MiB took 2000 caches of ~100 KiB";
  EXPECT_TRUE(absl::IsResourceExhausted(refusal)) << refusal;
  EXPECT_TRUE(absl::StrContains(refusal.message(), "disk full")) << refusal;
  // What code decides on is the typed detail, not the text.
  EXPECT_EQ(DetailOf(refusal), ErrorDetail::kDiskFull) << refusal;
  EXPECT_GT(acked.size(), 10u);
  EXPECT_GE(store->Stats().write_errors, 1u);

  // Reads go on from both tiers; puts that need no disk go on.
  ExpectAllReadable(*store, acked);
  const std::string memory_only = storage::testing::EncodedCache(77, kTokens);
  ASSERT_TRUE(store->Put(Key(200000), memory_only, {}, {}).ok());
  EXPECT_EQ(store->Get(Key(200000))->payload.view(), memory_only);

  // More room: the next disk-durable put lands, with no restart.
  ASSERT_EQ(fs.Resize(32 * kMiB), "");
  const std::string after = storage::testing::EncodedCache(5000, kTokens);
  absl::Status st = store->Put(Key(5000), after, {}, Durable());
  ASSERT_TRUE(st.ok()) << st;
  acked.emplace(5000, after);
  EXPECT_TRUE(store->Lookup(Key(5000))->persisted);

  // Everything acknowledged survives a reopen.
  store.reset();
  store = MustOpen(SmallDiskOptions(fs.path()));
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->Stats().recovered, acked.size());
  ExpectAllReadable(*store, acked);
}

TEST(DiskFull, AStoreOpenedOnAFullDiskServesReadsAndTurnsWritableWhenSpaceReturns) {
  TmpfsMount fs(16 * kMiB);
  ASSERT_TRUE(fs.ok()) << fs.error();
  std::map<int, std::string> acked;
  {
    auto store = MustOpen(SmallDiskOptions(fs.path()));
    ASSERT_NE(store, nullptr);
    for (int i = 0; i < 12; ++i) {  // about 4 MiB
      std::string bytes = storage::testing::EncodedCache(i, kTokens);
      absl::Status st = store->Put(Key(i), bytes, {}, Durable());
      ASSERT_TRUE(st.ok()) << i << ": " << st;
      acked.emplace(i, std::move(bytes));
    }
  }
  // Something else takes the rest of the disk while the store is down.
  fs.Fill("filler");
  ASSERT_LT(fs.FreeBytes(), 64 * 1024u);

  auto store = MustOpen(SmallDiskOptions(fs.path()));
  ASSERT_NE(store, nullptr);
  StoreStats stats = store->Stats();
  const TierStats& rocks = stats.tier(TierKind::kRocksDb);
  ASSERT_TRUE(rocks.present) << rocks.error;
  EXPECT_TRUE(rocks.read_only);
  EXPECT_TRUE(absl::StrContains(rocks.read_only_reason, "disk full")) << rocks.read_only_reason;
  EXPECT_EQ(stats.recovered, acked.size());
  ExpectAllReadable(*store, acked);

  absl::Status st =
      store->Put(Key(9000), storage::testing::EncodedCache(9000, kTokens), {}, Durable());
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "read-only")) << st;
  EXPECT_EQ(DetailOf(st), ErrorDetail::kDiskFull) << st;
  EXPECT_TRUE(absl::IsResourceExhausted(store->Delete(Key(0))));  // nothing removable either
  EXPECT_TRUE(store->Get(Key(0)).ok());

  // The filler goes: within a few attempts (reopen is tried at most once a second) the store
  // reopens RocksDB read-write by itself and the put lands.
  ASSERT_EQ(unlink((fs.path() + "/filler").c_str()), 0);
  const std::string bytes = storage::testing::EncodedCache(9000, kTokens);
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    st = store->Put(Key(9000), bytes, {}, Durable());
    if (st.ok()) break;
    absl::SleepFor(absl::Milliseconds(200));
  } while (absl::Now() < deadline);
  ASSERT_TRUE(st.ok()) << st;
  acked.emplace(9000, bytes);
  EXPECT_FALSE(store->Stats().tier(TierKind::kRocksDb).read_only);
  ExpectAllReadable(*store, acked);
  ASSERT_TRUE(store->Delete(Key(0)).ok());
  acked.erase(0);

  store.reset();
  store = MustOpen(SmallDiskOptions(fs.path()));
  ASSERT_NE(store, nullptr);
  EXPECT_FALSE(store->Stats().tier(TierKind::kRocksDb).read_only);
  EXPECT_EQ(store->Stats().recovered, acked.size());
  ExpectAllReadable(*store, acked);
}

}  // namespace
}  // namespace storage
}  // namespace kvcomp
