// TieredStore behaviour, one feature per test: placement, lookups, demotion and eviction, pins,
// promotion, TTL, quotas, bad input, durability across reopen, checksum quarantine, disk full,
// misconfiguration, projections and their references.
#include "kvcomp/storage/tiered_store.h"

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/format.h"
#include "kvcomp/storage/tier.h"
#include "rocksdb_tier.h"
#include "storage_test_util.h"

namespace kvcomp {
namespace storage {
namespace {

using testing::DiskFullFileSystem;
using testing::EncodedCache;
using testing::TempDir;

CacheKey Key(const std::string& k, const std::string& tenant = "t1") {
  return CacheKey{tenant, "llama-8b", k};
}

StoreOptions HostOnly(uint64_t capacity) {
  StoreOptions o;
  o.host.capacity_bytes = capacity;
  return o;
}

StoreOptions HostAndDisk(const std::string& path, uint64_t host_capacity) {
  StoreOptions o;
  o.host.capacity_bytes = host_capacity;
  o.rocksdb.enabled = true;
  o.rocksdb.path = path;
  o.rocksdb.capacity_bytes = 1ull << 30;
  o.rocksdb.min_blob_size = 4096;
  return o;
}

std::unique_ptr<TieredStore> MustOpen(const StoreOptions& o) {
  auto s = TieredStore::Open(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

TEST(TieredStore, PutGetLookupDeleteRoundTrip) {
  auto store = MustOpen(HostOnly(1 << 20));
  const std::string bytes = EncodedCache(1);
  const auto info = *format::PeekCache(bytes);
  ASSERT_TRUE(store->Put(Key("a"), bytes, {}, {}).ok());
  auto got = store->Get(Key("a"));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->payload.view(), bytes);
  EXPECT_TRUE(format::ParseCache(got->payload.view()).ok());
  EXPECT_EQ(got->meta.stored_bytes, bytes.size());
  EXPECT_EQ(got->meta.original_bytes, info.layout.CacheBytes(info.original_tokens));
  EXPECT_EQ(got->meta.crc32c, Crc32c(bytes.data(), bytes.size()));
  EXPECT_GT(got->meta.created_unix_ms, 0);
  auto look = store->Lookup(Key("a"));
  ASSERT_TRUE(look.ok());
  EXPECT_EQ(look->tier, TierKind::kHost);
  EXPECT_FALSE(look->persisted);
  EXPECT_EQ(look->meta.stored_bytes, bytes.size());
  ASSERT_TRUE(store->Delete(Key("a")).ok());
  EXPECT_TRUE(absl::IsNotFound(store->Get(Key("a")).status()));
  EXPECT_TRUE(absl::IsNotFound(store->Lookup(Key("a")).status()));
  EXPECT_TRUE(absl::IsNotFound(store->Delete(Key("a"))));
  // A reader's handle stays valid after the delete.
  EXPECT_EQ(got->payload.view(), bytes);
  const StoreStats st = store->Stats();
  EXPECT_EQ(st.tier(TierKind::kHost).hits, 1u);
  EXPECT_EQ(st.tier(TierKind::kHost).misses, 1u);
  EXPECT_EQ(st.tier(TierKind::kHost).entries, 0u);
  EXPECT_FALSE(st.tier(TierKind::kRocksDb).present);
}

TEST(TieredStore, BadInputIsAClearStatusAndTheStoreKeepsServing) {
  auto store = MustOpen(HostOnly(1 << 20));
  ASSERT_TRUE(store->Put(Key("ok"), EncodedCache(2), {}, {}).ok());
  const std::string long_key(CacheKey::kMaxKeyBytes + 1, 'k');
  absl::Status st = store->Put(Key(long_key), EncodedCache(3), {}, {});
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_TRUE(absl::IsInvalidArgument(store->Get(Key(long_key)).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(store->Put(Key("x", "bad tenant!"), EncodedCache(3), {}, {})));
  st = store->Put(Key("garbage"), std::string(500, 'g'), {}, {});
  EXPECT_TRUE(absl::IsInvalidArgument(st) || absl::IsDataLoss(st)) << st;
  PutOptions to_disk;
  to_disk.tier = static_cast<int>(TierKind::kRocksDb);
  EXPECT_TRUE(absl::IsInvalidArgument(store->Put(Key("y"), EncodedCache(3), {}, to_disk)));
  PutOptions durable;
  durable.durability = Durability::kDisk;
  EXPECT_TRUE(absl::IsFailedPrecondition(store->Put(Key("y"), EncodedCache(3), {}, durable)));
  PutOptions no_overwrite;
  no_overwrite.overwrite = false;
  EXPECT_TRUE(absl::IsAlreadyExists(store->Put(Key("ok"), EncodedCache(4), {}, no_overwrite)));
  EXPECT_EQ(store->Get(Key("ok"))->payload.view(), EncodedCache(2));
  EXPECT_TRUE(absl::IsFailedPrecondition(store->PutCalibration("m", "p")));
}

// Without a GPU (or a device tier) a payload in device memory cannot be read: a put of one is a
// clear error and stores nothing; a malformed header is refused before any copy; the host tier
// refuses one outright. (The device paths run in storage_device_payload_test on a GPU.)
TEST(TieredStore, ADevicePayloadWithoutAGpuIsAClearErrorAndStoresNothing) {
  auto store = MustOpen(HostOnly(1 << 20));
  const std::string bytes = EncodedCache(21);
  DeviceBytes d;
  d.data = std::shared_ptr<const void>(reinterpret_cast<const void*>(0x1000), [](const void*) {});
  d.size = bytes.size();
  d.crc32c = Crc32c(bytes.data(), bytes.size());
  d.header = bytes.substr(0, 512);
  if (!CudaDeviceAvailable()) {
    DeviceCopies copies;
    PutOptions po;
    po.copies = &copies;
    absl::Status st = store->Put(CacheKey{"t", "m", "dev"}, Payload::OnDevice(d), CacheMeta{}, po);
    EXPECT_FALSE(st.ok());
    EXPECT_EQ(copies.to_host + copies.to_device + copies.on_device, 0u);
    EXPECT_TRUE(absl::IsNotFound(store->Lookup(CacheKey{"t", "m", "dev"}).status()));
  }
  DeviceBytes bad = d;
  bad.header = bytes.substr(0, 100);  // shorter than the header
  absl::Status st =
      store->Put(CacheKey{"t", "m", "bad"}, Payload::OnDevice(bad), CacheMeta{}, PutOptions{});
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(absl::IsNotFound(store->Lookup(CacheKey{"t", "m", "bad"}).status()));
  HostTierOptions ho;
  auto host = NewHostTier(ho);
  ASSERT_TRUE(host.ok());
  EXPECT_TRUE(
      absl::IsInvalidArgument((*host)->Put("k", CacheMeta{}, Payload::OnDevice(d), false)));
}

TEST(TieredStore, MisconfiguredTiersFailAtOpen) {
  StoreOptions none;
  none.host.enabled = false;
  EXPECT_TRUE(absl::IsInvalidArgument(TieredStore::Open(none).status()));
  StoreOptions marks = HostOnly(100);
  marks.low_watermark = 0.95;
  marks.high_watermark = 0.9;
  EXPECT_TRUE(absl::IsInvalidArgument(TieredStore::Open(marks).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(TieredStore::Open(HostOnly(0)).status()));
  StoreOptions wrong_default = HostOnly(100);
  wrong_default.default_tier = TierKind::kRocksDb;
  EXPECT_TRUE(absl::IsInvalidArgument(TieredStore::Open(wrong_default).status()));
  StoreOptions no_path = HostOnly(100);
  no_path.rocksdb.enabled = true;
  EXPECT_TRUE(absl::IsInvalidArgument(TieredStore::Open(no_path).status()));
  StoreOptions bad_path = HostOnly(100);
  bad_path.rocksdb.enabled = true;
  bad_path.rocksdb.path = "/proc/kvcomp-no";
  bad_path.open_without_failed_tiers = false;
  EXPECT_FALSE(TieredStore::Open(bad_path).ok());
  StoreOptions only_device;
  only_device.host.enabled = false;
  only_device.device.enabled = true;
  only_device.device.capacity_bytes = 1 << 20;
  only_device.default_tier = TierKind::kDevice;
  if (!CudaDeviceAvailable()) {
    // No tier at all would start.
    EXPECT_TRUE(absl::IsFailedPrecondition(TieredStore::Open(only_device).status()));
  }
  StoreOptions promote = HostOnly(100);
  promote.promote_on_read = true;
  promote.promote_to = TierKind::kDevice;
  EXPECT_TRUE(absl::IsInvalidArgument(TieredStore::Open(promote).status()));
}

TEST(TieredStore, ATierThatCannotStartIsLeftOutAndReported) {
  StoreOptions o = HostOnly(1 << 20);
  o.device.enabled = true;
  o.device.capacity_bytes = 1 << 20;
  o.default_tier = TierKind::kDevice;
  o.rocksdb.enabled = true;
  o.rocksdb.path = "/proc/kvcomp-cannot-write-here";
  o.open_without_failed_tiers = false;
  EXPECT_FALSE(TieredStore::Open(o).ok());
  o.open_without_failed_tiers = true;
  auto store = MustOpen(o);
  ASSERT_NE(store, nullptr);
  const StoreStats st = store->Stats();
  EXPECT_FALSE(st.tier(TierKind::kRocksDb).present);
  EXPECT_NE(st.tier(TierKind::kRocksDb).error.find("kvcomp-cannot-write-here"), std::string::npos)
      << st.tier(TierKind::kRocksDb).error;
  EXPECT_TRUE(st.tier(TierKind::kHost).present);
  EXPECT_TRUE(st.tier(TierKind::kHost).error.empty());
  if (!CudaDeviceAvailable()) {
    EXPECT_FALSE(st.tier(TierKind::kDevice).present);
    EXPECT_FALSE(st.tier(TierKind::kDevice).error.empty());
  }
  // The store serves from the tiers it has: puts for the device go to host.
  ASSERT_TRUE(store->Put(Key("a"), EncodedCache(1), {}, {}).ok());
  EXPECT_EQ(store->Lookup(Key("a"))->tier,
            CudaDeviceAvailable() ? TierKind::kDevice : TierKind::kHost);
  EXPECT_EQ(store->Get(Key("a"))->payload.view(), EncodedCache(1));
  PutOptions durable;
  durable.durability = Durability::kDisk;
  absl::Status put = store->Put(Key("b"), EncodedCache(2), {}, durable);
  EXPECT_TRUE(absl::IsFailedPrecondition(put)) << put;
  EXPECT_TRUE(absl::IsFailedPrecondition(store->PutCalibration("m", "p")));
}

TEST(TieredStore, DemotesLeastRecentlyUsedToDiskBetweenWatermarks) {
  TempDir dir;
  const std::string bytes = EncodedCache(5);
  const uint64_t n = bytes.size();
  auto o = HostAndDisk(dir.path(), 10 * n);  // high 9n, low 7.5n
  auto store = MustOpen(o);
  for (int i = 0; i < 9; ++i) ASSERT_TRUE(store->Put(Key(std::to_string(i)), bytes, {}, {}).ok());
  EXPECT_EQ(store->Stats().tier(TierKind::kHost).demotions, 0u);
  ASSERT_TRUE(store->Get(Key("0")).ok());                 // 0 becomes the most recently used
  ASSERT_TRUE(store->Put(Key("9"), bytes, {}, {}).ok());  // 10n > 9n: demote down to 7.5n
  const StoreStats st = store->Stats();
  EXPECT_EQ(st.tier(TierKind::kHost).demotions, 3u);
  EXPECT_EQ(st.tier(TierKind::kHost).bytes, 7 * n);
  for (const char* k : {"1", "2", "3"}) {
    EXPECT_EQ(store->Lookup(Key(k))->tier, TierKind::kRocksDb) << k;
    EXPECT_TRUE(store->Lookup(Key(k))->persisted);
  }
  for (const char* k : {"0", "4", "9"}) EXPECT_EQ(store->Lookup(Key(k))->tier, TierKind::kHost);
  auto got = store->Get(Key("2"));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->payload.view(), bytes);
  EXPECT_EQ(store->Stats().tier(TierKind::kRocksDb).hits, 1u);
}

TEST(TieredStore, EvictsFromTheLastTierAndNeverMovesPinnedEntries) {
  const std::string bytes = EncodedCache(6);
  const uint64_t n = bytes.size();
  auto store = MustOpen(HostOnly(4 * n));  // high 3.6n, low 3n
  PutOptions pin;
  pin.pin = true;
  ASSERT_TRUE(store->Put(Key("p"), bytes, {}, pin).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(store->Put(Key(std::to_string(i)), bytes, {}, {}).ok());
  // 4n > 3.6n: evict the oldest unpinned (0) to reach 3n.
  EXPECT_TRUE(store->Lookup(Key("p")).ok());
  EXPECT_EQ(store->Lookup(Key("p"))->pin_count, 1u);
  EXPECT_TRUE(absl::IsNotFound(store->Lookup(Key("0")).status()));
  EXPECT_EQ(store->Stats().tier(TierKind::kHost).evictions, 1u);
  ASSERT_TRUE(store->Pin(Key("1")).ok());
  ASSERT_TRUE(store->Pin(Key("2")).ok());
  // 3n held, all pinned: a put of 1.5n finds no room and nothing to demote.
  PutOptions raw;
  raw.validate = false;
  const std::string big(n + n / 2, 'b');
  EXPECT_TRUE(absl::IsResourceExhausted(store->Put(Key("x"), big, {}, raw)));
  EXPECT_TRUE(absl::IsNotFound(store->Lookup(Key("x")).status()));
  ASSERT_TRUE(store->Unpin(Key("1")).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(store->Unpin(Key("1"))));
  ASSERT_TRUE(store->Put(Key("x"), big, {}, raw).ok());  // now 1 is evicted to make room
  EXPECT_TRUE(absl::IsNotFound(store->Lookup(Key("1")).status()));
  EXPECT_TRUE(store->Lookup(Key("2")).ok());
  EXPECT_TRUE(store->Lookup(Key("p")).ok());
  EXPECT_EQ(store->Stats().tier(TierKind::kHost).evictions, 2u);
}

TEST(TieredStore, PromotesOnReadWhenAsked) {
  TempDir dir;
  const std::string bytes = EncodedCache(7);
  auto o = HostAndDisk(dir.path(), 1 << 20);
  o.promote_on_read = true;
  auto store = MustOpen(o);
  PutOptions disk;
  disk.tier = static_cast<int>(TierKind::kRocksDb);
  ASSERT_TRUE(store->Put(Key("a"), bytes, {}, disk).ok());
  EXPECT_EQ(store->Lookup(Key("a"))->tier, TierKind::kRocksDb);
  ASSERT_EQ(store->Get(Key("a"))->payload.view(), bytes);
  auto look = store->Lookup(Key("a"));
  EXPECT_EQ(look->tier, TierKind::kHost);
  EXPECT_TRUE(look->persisted);  // the disk copy stays
  EXPECT_EQ(store->Stats().tier(TierKind::kHost).promotions, 1u);
  ASSERT_EQ(store->Get(Key("a"))->payload.view(), bytes);
  EXPECT_EQ(store->Stats().tier(TierKind::kHost).hits, 1u);
}

TEST(TieredStore, TtlHidesAndRemovesExpiredEntriesButNotPinnedOnes) {
  auto now = std::make_shared<absl::Time>(absl::FromUnixSeconds(1000000));
  auto o = HostOnly(1 << 20);
  o.clock = [now] { return *now; };
  o.default_ttl = absl::Seconds(10);
  auto store = MustOpen(o);
  PutOptions longer;
  longer.ttl = absl::Seconds(100);
  ASSERT_TRUE(store->Put(Key("short"), EncodedCache(8), {}, {}).ok());
  ASSERT_TRUE(store->Put(Key("pinned"), EncodedCache(8), {}, {}).ok());
  ASSERT_TRUE(store->Put(Key("long"), EncodedCache(8), {}, longer).ok());
  ASSERT_TRUE(store->Pin(Key("pinned")).ok());
  EXPECT_EQ(store->Lookup(Key("short"))->meta.ttl_ms, 10000);
  *now += absl::Seconds(11);
  EXPECT_TRUE(absl::IsNotFound(store->Lookup(Key("short")).status()));
  EXPECT_TRUE(absl::IsNotFound(store->Get(Key("short")).status()));
  EXPECT_TRUE(store->Lookup(Key("pinned")).ok());
  EXPECT_EQ(store->List("t1")->size(), 2u);
  ASSERT_TRUE(store->Unpin(Key("pinned")).ok());
  EXPECT_EQ(store->ExpireNow(), 1u);
  EXPECT_EQ(store->Stats().expired, 2u);
  EXPECT_EQ(store->Stats().tier(TierKind::kHost).entries, 1u);
  *now += absl::Seconds(100);
  EXPECT_EQ(store->ExpireNow(), 1u);
  EXPECT_EQ(store->Stats().tier(TierKind::kHost).bytes, 0u);
}

TEST(TieredStore, TenantQuotasRejectPutsBeyondThem) {
  const std::string bytes = EncodedCache(9);
  auto o = HostOnly(1 << 20);
  o.tenant_quota_bytes["small"] = 2 * bytes.size();
  auto store = MustOpen(o);
  ASSERT_TRUE(store->Put(Key("a", "small"), bytes, {}, {}).ok());
  ASSERT_TRUE(store->Put(Key("b", "small"), bytes, {}, {}).ok());
  absl::Status st = store->Put(Key("c", "small"), bytes, {}, {});
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_NE(st.message().find("quota"), std::string::npos);
  ASSERT_TRUE(store->Put(Key("b", "small"), bytes, {}, {}).ok());  // replacing fits
  ASSERT_TRUE(store->Put(Key("c", "other"), bytes, {}, {}).ok());  // other tenants unaffected
  ASSERT_TRUE(store->Delete(Key("a", "small")).ok());
  ASSERT_TRUE(store->Put(Key("c", "small"), bytes, {}, {}).ok());
  EXPECT_EQ(store->Stats().quota_rejections, 1u);
}

TEST(TieredStore, ListIsPerTenantInKeyOrder) {
  auto store = MustOpen(HostOnly(1 << 20));
  for (const char* k : {"b", "a", "c"})
    ASSERT_TRUE(store->Put(Key(k), EncodedCache(1), {}, {}).ok());
  ASSERT_TRUE(store->Put(Key("z", "t2"), EncodedCache(1), {}, {}).ok());
  ASSERT_TRUE(store->Put(Key("d", ""), EncodedCache(1), {}, {}).ok());
  auto list = store->List("t1");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 3u);
  EXPECT_EQ((*list)[0].key.key, "a");
  EXPECT_EQ((*list)[2].key.key, "c");
  EXPECT_EQ((*list)[1].info.tier, TierKind::kHost);
  EXPECT_EQ(store->List("t2")->size(), 1u);
  EXPECT_EQ(store->List("")->size(), 1u);
  EXPECT_EQ(store->List("default")->size(), 1u);
  EXPECT_TRUE(absl::IsInvalidArgument(store->List("bad tenant").status()));
}

TEST(TieredStore, DiskDurablePutsSurviveReopenWithTheirMetadata) {
  TempDir dir;
  const std::string a = EncodedCache(10), b = EncodedCache(11, 400), c = EncodedCache(12);
  {
    auto store = MustOpen(HostAndDisk(dir.path(), 1 << 20));
    PutOptions durable;
    durable.durability = Durability::kDisk;
    CacheMeta meta;
    meta.projection_version = 3;
    ASSERT_TRUE(store->Put(Key("a"), a, meta, durable).ok());
    ASSERT_TRUE(store->Put(Key("b", "t2"), b, {}, durable).ok());
    ASSERT_TRUE(store->Put(Key("mem"), c, {}, {}).ok());  // memory durability: gone on restart
    EXPECT_EQ(store->Lookup(Key("a"))->tier, TierKind::kHost);
    EXPECT_TRUE(store->Lookup(Key("a"))->persisted);
    ASSERT_TRUE(store->Put(Key("del"), c, {}, durable).ok());
    ASSERT_TRUE(store->Delete(Key("del")).ok());
  }
  auto store = MustOpen(HostAndDisk(dir.path(), 1 << 20));
  EXPECT_EQ(store->Stats().recovered, 2u);
  auto got = store->Get(Key("a"));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->payload.view(), a);
  EXPECT_EQ(got->meta.projection_version, 3u);
  EXPECT_EQ(got->meta.tier, TierKind::kRocksDb);
  EXPECT_EQ(store->Get(Key("b", "t2"))->payload.view(), b);
  EXPECT_TRUE(absl::IsNotFound(store->Get(Key("mem")).status()));
  EXPECT_TRUE(absl::IsNotFound(store->Get(Key("del")).status()));
  EXPECT_EQ(store->ProjectionReferences("llama-8b", 3), 1u);
  EXPECT_EQ(store->List("t2")->size(), 1u);
}

TEST(TieredStore, ChecksumFailuresAreQuarantinedAtOpenAndOnRead) {
  TempDir dir;
  const std::string good = EncodedCache(13), bad = EncodedCache(14);
  {
    auto store = MustOpen(HostAndDisk(dir.path(), 1 << 20));
    PutOptions durable;
    durable.durability = Durability::kDisk;
    durable.tier = static_cast<int>(TierKind::kRocksDb);
    ASSERT_TRUE(store->Put(Key("good"), good, {}, durable).ok());
    ASSERT_TRUE(store->Put(Key("bad1"), bad, {}, durable).ok());
    ASSERT_TRUE(store->Put(Key("bad2"), bad, {}, durable).ok());
  }
  {
    // Damage two payloads behind the store's back: same size, one byte flipped.
    auto o = HostAndDisk(dir.path(), 1 << 20);
    auto tier = RocksDbTier::Open(o.rocksdb);
    ASSERT_TRUE(tier.ok());
    std::string flipped = bad;
    flipped[bad.size() / 2] ^= 0x40;
    for (const char* k : {"bad1", "bad2"}) {
      const std::string ek = Key(k).Encode();
      auto meta = (*tier)->GetMeta(ek);
      ASSERT_TRUE(meta.ok());
      ASSERT_TRUE((*tier)->Put(ek, *meta, Payload::Copy(flipped), true).ok());
    }
  }
  // Open with verification off finds bad1 and bad2; the read then catches them.
  {
    auto o = HostAndDisk(dir.path(), 1 << 20);
    o.rocksdb.verify_checksums_on_open = false;
    auto store = MustOpen(o);
    EXPECT_EQ(store->Stats().recovered, 3u);
    absl::Status st = store->Get(Key("bad1")).status();
    EXPECT_TRUE(absl::IsDataLoss(st)) << st;
    EXPECT_TRUE(absl::IsNotFound(store->Get(Key("bad1")).status()));
    EXPECT_EQ(store->Stats().quarantined, 1u);
    ASSERT_EQ(store->Quarantined().size(), 1u);
    EXPECT_EQ(store->Quarantined()[0].encoded_key, Key("bad1").Encode());
    EXPECT_EQ(store->Get(Key("good"))->payload.view(), good);
  }
  // Open with verification on quarantines bad2 before anyone reads it.
  auto store = MustOpen(HostAndDisk(dir.path(), 1 << 20));
  EXPECT_EQ(store->Stats().recovered, 1u);
  EXPECT_EQ(store->Stats().quarantined, 1u);
  EXPECT_EQ(store->Quarantined().size(), 2u);  // both, from disk
  EXPECT_TRUE(absl::IsNotFound(store->Lookup(Key("bad2")).status()));
  EXPECT_EQ(store->Get(Key("good"))->payload.view(), good);
}

TEST(TieredStore, BackgroundVerificationQuarantinesDamagedPayloadsAndNeverServesThem) {
  TempDir dir;
  const std::string good = EncodedCache(23), bad = EncodedCache(24);
  PutOptions durable;
  durable.durability = Durability::kDisk;
  durable.tier = static_cast<int>(TierKind::kRocksDb);
  {
    auto store = MustOpen(HostAndDisk(dir.path(), 1 << 20));
    ASSERT_TRUE(store->Put(Key("good"), good, {}, durable).ok());
    for (int i = 0; i < 40; ++i) {
      ASSERT_TRUE(store->Put(Key("bad" + std::to_string(i)), bad, {}, durable).ok());
    }
    ASSERT_TRUE(store->Put(Key("replaced"), bad, {}, durable).ok());
  }
  {
    auto tier = RocksDbTier::Open(HostAndDisk(dir.path(), 1 << 20).rocksdb);
    ASSERT_TRUE(tier.ok());
    std::string flipped = bad;
    flipped[bad.size() / 2] ^= 0x40;
    std::vector<std::string> damaged = {"replaced"};
    for (int i = 0; i < 40; ++i) damaged.push_back("bad" + std::to_string(i));
    for (const std::string& k : damaged) {
      const std::string ek = Key(k).Encode();
      auto meta = (*tier)->GetMeta(ek);
      ASSERT_TRUE(meta.ok());
      ASSERT_TRUE((*tier)->Put(ek, *meta, Payload::Copy(flipped), true).ok());
    }
  }
  auto o = HostAndDisk(dir.path(), 1 << 20);
  o.rocksdb.verify_in_background = true;
  auto store = MustOpen(o);
  EXPECT_EQ(store->Stats().recovered, 42u);
  // Whether the background pass or the read finds them first, a damaged cache reads NotFound,
  // as if quarantined at Open, and a cache replaced meanwhile is the new one.
  ASSERT_TRUE(store->Put(Key("replaced"), good, {}, durable).ok());
  for (int i = 39; i >= 0; --i) {
    absl::Status st = store->Get(Key("bad" + std::to_string(i))).status();
    EXPECT_TRUE(absl::IsNotFound(st)) << i << ": " << st;
  }
  EXPECT_EQ(store->Get(Key("good"))->payload.view(), good);
  EXPECT_EQ(store->Get(Key("replaced"))->payload.view(), good);
  EXPECT_EQ(store->Quarantined().size(), 40u);  // waits for the pass
  StoreStats stats = store->Stats();
  EXPECT_EQ(stats.quarantined, 40u);
  EXPECT_EQ(stats.unverified, 0u);
  EXPECT_EQ(stats.tier(TierKind::kRocksDb).entries, 2u);
  store.reset();
  store = MustOpen(o);
  EXPECT_EQ(store->Stats().recovered, 2u);
  EXPECT_EQ(store->Quarantined().size(), 40u);
}

TEST(TieredStore, DiskFullFailsPutsClearlyWhileReadsGoOn) {
  TempDir dir;
  auto fs = std::make_shared<DiskFullFileSystem>(rocksdb::FileSystem::Default());
  std::unique_ptr<rocksdb::Env> env = rocksdb::NewCompositeEnv(fs);
  auto o = HostAndDisk(dir.path(), 1 << 20);
  o.rocksdb.env = env.get();
  auto store = MustOpen(o);
  PutOptions durable;
  durable.durability = Durability::kDisk;
  ASSERT_TRUE(store->Put(Key("a"), EncodedCache(15), {}, durable).ok());
  fs->SetFull(true);
  absl::Status st = store->Put(Key("b"), EncodedCache(16), {}, durable);
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_TRUE(absl::IsNotFound(store->Lookup(Key("b")).status()));
  EXPECT_EQ(store->Get(Key("a"))->payload.view(), EncodedCache(15));
  ASSERT_TRUE(store->Put(Key("m"), EncodedCache(17), {}, {}).ok());  // memory puts go on
  EXPECT_GE(store->Stats().write_errors, 1u);
  fs->SetFull(false);
  // The tier resumes RocksDB itself on the next write: the first put after space returns lands.
  st = store->Put(Key("b"), EncodedCache(16), {}, durable);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(store->Get(Key("b"))->payload.view(), EncodedCache(16));
}

// Durability::kBehind: acknowledged in the host tier, written to RocksDB behind the put; a
// clean close persists what is queued; a full loss window writes the put through; a delete
// before the persister reaches a put leaves nothing on disk.
TEST(TieredStore, BehindPutsReachTheDiskAfterTheirAcknowledgement) {
  TempDir dir;
  PutOptions behind;
  behind.durability = Durability::kBehind;
  const std::string a = EncodedCache(31), b = EncodedCache(32), c = EncodedCache(33);
  {
    auto store = MustOpen(HostAndDisk(dir.path(), 1 << 20));
    ASSERT_TRUE(store->Put(Key("a"), a, {}, behind).ok());
    store->FlushBehind();
    auto l = store->Lookup(Key("a"));
    ASSERT_TRUE(l.ok());
    EXPECT_EQ(l->tier, TierKind::kHost);
    EXPECT_TRUE(l->persisted);
    EXPECT_EQ(store->Stats().behind_bytes, 0u);
    EXPECT_EQ(store->Stats().tier(TierKind::kRocksDb).entries, 1u);
    ASSERT_TRUE(store->Put(Key("gone"), c, {}, behind).ok());
    ASSERT_TRUE(store->Delete(Key("gone")).ok());
    ASSERT_TRUE(store->Put(Key("b"), b, {}, behind).ok());  // queued when the store closes
  }
  {
    auto store = MustOpen(HostAndDisk(dir.path(), 1 << 20));
    EXPECT_EQ(store->Get(Key("a"))->payload.view(), a);
    EXPECT_EQ(store->Get(Key("b"))->payload.view(), b);
    EXPECT_TRUE(absl::IsNotFound(store->Get(Key("gone")).status()));
    EXPECT_EQ(store->Stats().behind_failed, 0u);
  }
  // A loss window smaller than the put: written through, persisted on return.
  StoreOptions small = HostAndDisk(dir.path(), 1 << 20);
  small.behind_max_bytes = c.size() - 1;
  auto store = MustOpen(small);
  ASSERT_TRUE(store->Put(Key("c"), c, {}, behind).ok());
  auto l = store->Lookup(Key("c"));
  ASSERT_TRUE(l.ok());
  EXPECT_TRUE(l->persisted);
  EXPECT_EQ(store->Stats().behind_bytes, 0u);
  // Without the RocksDB tier there is nothing to write behind to.
  auto host_only = MustOpen(HostOnly(1 << 20));
  EXPECT_TRUE(absl::IsFailedPrecondition(host_only->Put(Key("d"), c, {}, behind)));
}

TEST(TieredStore, CountsTheCachesThatNameACodecVersionBesideItsCalibrationBytes) {
  TempDir dir;
  auto store = MustOpen(HostAndDisk(dir.path(), 1 << 20));
  const std::string p = "llama-8b projection 4";
  ASSERT_TRUE(store->PutCalibration(p, "projection bytes").ok());
  CacheMeta meta;
  meta.projection_version = 4;
  ASSERT_TRUE(store->Put(Key("a"), EncodedCache(18), meta, {}).ok());
  ASSERT_TRUE(store->Put(Key("b"), EncodedCache(19), meta, {}).ok());
  EXPECT_EQ(store->ProjectionReferences("llama-8b", 4), 2u);
  ASSERT_TRUE(store->Delete(Key("a")).ok());
  ASSERT_TRUE(store->Put(Key("b"), EncodedCache(19), {}, {}).ok());  // replaced, no projection
  EXPECT_EQ(store->ProjectionReferences("llama-8b", 4), 0u);
  EXPECT_EQ(*store->GetCalibration(p), "projection bytes");
  EXPECT_EQ(store->ListCalibration("llama-8b")->size(), 1u);
  ASSERT_TRUE(store->DeleteCalibration(p).ok());
  EXPECT_TRUE(absl::IsNotFound(store->GetCalibration(p).status()));
}

TEST(TieredStore, AReaderKeepsItsBytesWhileTheEntryIsDemotedAndDeleted) {
  TempDir dir;
  const std::string bytes = EncodedCache(20);
  auto store = MustOpen(HostAndDisk(dir.path(), 4 * bytes.size()));
  ASSERT_TRUE(store->Put(Key("held"), bytes, {}, {}).ok());
  auto held = store->Get(Key("held"));
  ASSERT_TRUE(held.ok());
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(store->Put(Key(std::to_string(i)), bytes, {}, {}).ok());
  EXPECT_EQ(store->Lookup(Key("held"))->tier, TierKind::kRocksDb);
  ASSERT_TRUE(store->Delete(Key("held")).ok());
  EXPECT_EQ(held->payload.view(), bytes);
}

}  // namespace
}  // namespace storage
}  // namespace kvcomp
