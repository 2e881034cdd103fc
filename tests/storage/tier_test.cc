// Each tier on its own: the range allocator under the device tier, the host tier, the RocksDB
// tier (atomic meta+payload, accounting across reopen, quarantine, projections, disk full), and
// the device tier where a GPU is present.
#include "kvcomp/storage/tier.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kvcomp/core/crc32c.h"
#include "range_allocator.h"
#include "rocksdb_tier.h"
#include "storage_test_util.h"

namespace kvcomp {
namespace storage {
namespace {

using testing::DiskFullFileSystem;
using testing::TempDir;
using testing::MetaFor;

TEST(RangeAllocator, AllocatesFirstFitAndCoalesces) {
  RangeAllocator a(4096, 256);
  auto x = a.Allocate(100);
  auto y = a.Allocate(300);
  auto z = a.Allocate(256);
  ASSERT_TRUE(x.ok() && y.ok() && z.ok());
  EXPECT_EQ(*x, 0u);
  EXPECT_EQ(*y, 256u);
  EXPECT_EQ(*z, 768u);
  EXPECT_EQ(a.used(), 1024u);
  ASSERT_TRUE(a.Free(*y, 300).ok());
  EXPECT_EQ(*a.Allocate(512), 256u);  // first fit reuses the hole
  ASSERT_TRUE(a.Free(256, 512).ok());
  ASSERT_TRUE(a.Free(*x, 100).ok());
  ASSERT_TRUE(a.Free(*z, 256).ok());
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.free_ranges(), 1u);
  EXPECT_EQ(a.largest_free(), 4096u);
}

TEST(RangeAllocator, RejectsBadRequestsAndDoubleFrees) {
  RangeAllocator a(1024, 256);
  EXPECT_TRUE(absl::IsInvalidArgument(a.Allocate(0).status()));
  EXPECT_TRUE(absl::IsResourceExhausted(a.Allocate(2048).status()));
  auto x = a.Allocate(1024);
  ASSERT_TRUE(x.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(a.Allocate(1).status()));
  ASSERT_TRUE(a.Free(*x, 1024).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(a.Free(*x, 1024)));  // double free
  EXPECT_TRUE(absl::IsInvalidArgument(a.Free(7, 10)));     // misaligned
  EXPECT_TRUE(absl::IsInvalidArgument(a.Free(0, 4096)));   // beyond the pool
}

TEST(RangeAllocator, RandomSequencesKeepTheInvariants) {
  std::mt19937_64 rng(5);
  RangeAllocator a(1 << 20, 256);
  std::vector<std::pair<uint64_t, uint64_t>> live;
  for (int i = 0; i < 5000; ++i) {
    if (live.empty() || rng() % 2 == 0) {
      const uint64_t n = 1 + rng() % 20000;
      auto off = a.Allocate(n);
      if (!off.ok()) continue;
      for (const auto& [o, s] : live) {
        const uint64_t end = o + ((s + 255) & ~uint64_t{255});
        ASSERT_TRUE(*off >= end || *off + n <= o) << "overlap";
      }
      live.emplace_back(*off, n);
    } else {
      const size_t k = rng() % live.size();
      ASSERT_TRUE(a.Free(live[k].first, live[k].second).ok());
      live.erase(live.begin() + k);
    }
  }
  for (const auto& [o, s] : live) ASSERT_TRUE(a.Free(o, s).ok());
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.free_ranges(), 1u);
}

TEST(HostTier, PutGetDeleteAndCapacity) {
  HostTierOptions o;
  o.capacity_bytes = 1000;
  auto tier = NewHostTier(o);
  ASSERT_TRUE(tier.ok());
  Tier& t = **tier;
  EXPECT_EQ(t.kind(), TierKind::kHost);
  Payload a = Payload::Copy(std::string(600, 'a'));
  Payload b = Payload::Copy(std::string(500, 'b'));
  ASSERT_TRUE(t.Put("a", MetaFor(a), a, false).ok());
  EXPECT_EQ(t.used_bytes(), 600u);
  EXPECT_TRUE(absl::IsResourceExhausted(t.Put("b", MetaFor(b), b, false)));
  EXPECT_EQ(t.used_bytes(), 600u);  // a failed put leaves nothing behind
  EXPECT_TRUE(absl::IsNotFound(t.Get("b").status()));
  auto got = t.Get("a");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->view(), std::string(600, 'a'));
  ASSERT_TRUE(t.Delete("a", false).ok());
  EXPECT_EQ(t.used_bytes(), 0u);
  EXPECT_EQ(t.entries(), 0u);
  // The reader's handle outlives the delete.
  EXPECT_EQ(got->view(), std::string(600, 'a'));
  ASSERT_TRUE(t.Put("b", MetaFor(b), b, false).ok());
  Payload c = Payload::Copy(std::string(400, 'c'));
  ASSERT_TRUE(t.Put("b", MetaFor(c), c, false).ok());  // replace
  EXPECT_EQ(t.used_bytes(), 400u);
  EXPECT_EQ(t.entries(), 1u);
  EXPECT_TRUE(t.Delete("missing", false).ok());
}

TEST(HostTier, RejectsZeroCapacity) {
  HostTierOptions o;
  o.capacity_bytes = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(NewHostTier(o).status()));
}

TEST(DeviceTier, AbsentWithoutAGpuElseWorks) {
  DeviceTierOptions o;
  o.enabled = true;
  o.capacity_bytes = 1 << 20;
  auto tier = NewDeviceTier(o);
  if (!CudaDeviceAvailable()) {
    EXPECT_TRUE(absl::IsFailedPrecondition(tier.status())) << tier.status();
    return;
  }
  ASSERT_TRUE(tier.ok()) << tier.status();
  Tier& t = **tier;
  Payload a = Payload::Copy(std::string(70000, 'x'));
  ASSERT_TRUE(t.Put("a", MetaFor(a), a, false).ok());
  auto got = t.Get("a");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->view(), a.view());
  ASSERT_TRUE(t.Delete("a", false).ok());
  EXPECT_EQ(t.used_bytes(), 0u);
}

RocksDbTierOptions RocksOptions(const std::string& path) {
  RocksDbTierOptions o;
  o.enabled = true;
  o.path = path;
  o.capacity_bytes = 64 << 20;
  o.min_blob_size = 4096;
  return o;
}

TEST(RocksDbTier, MetaCodecRoundTripsAndDetectsDamage) {
  CacheMeta m;
  m.original_bytes = 1 << 30;
  m.stored_bytes = 12345;
  m.tier = TierKind::kRocksDb;
  m.created_unix_ms = 1700000000123;
  m.ttl_ms = 60000;
  m.projection_version = 7;
  m.crc32c = 0xdeadbeef;
  std::string enc = EncodeMeta(m);
  auto back = DecodeMeta(enc);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->original_bytes, m.original_bytes);
  EXPECT_EQ(back->stored_bytes, m.stored_bytes);
  EXPECT_EQ(back->created_unix_ms, m.created_unix_ms);
  EXPECT_EQ(back->ttl_ms, m.ttl_ms);
  EXPECT_EQ(back->projection_version, 7u);
  EXPECT_EQ(back->crc32c, m.crc32c);
  enc[10] ^= 1;
  EXPECT_TRUE(absl::IsDataLoss(DecodeMeta(enc).status()));
  EXPECT_TRUE(absl::IsDataLoss(DecodeMeta("short").status()));
}

TEST(RocksDbTier, PutGetDeleteSurviveReopen) {
  TempDir dir;
  const std::string small(100, 's'), big(200000, 'b');
  {
    auto tier = RocksDbTier::Open(RocksOptions(dir.path()));
    ASSERT_TRUE(tier.ok()) << tier.status();
    Payload s = Payload::Copy(small), b = Payload::Copy(big);
    ASSERT_TRUE((*tier)->Put("small", MetaFor(s), s, true).ok());
    ASSERT_TRUE((*tier)->Put("big", MetaFor(b), b, true).ok());  // a blob file
    ASSERT_TRUE((*tier)->Put("gone", MetaFor(s), s, true).ok());
    ASSERT_TRUE((*tier)->Delete("gone", true).ok());
    EXPECT_EQ((*tier)->used_bytes(), small.size() + big.size());
    EXPECT_EQ((*tier)->entries(), 2u);
  }
  auto tier = RocksDbTier::Open(RocksOptions(dir.path()));
  ASSERT_TRUE(tier.ok());
  EXPECT_EQ((*tier)->used_bytes(), small.size() + big.size());
  EXPECT_EQ((*tier)->Get("small")->view(), small);
  EXPECT_EQ((*tier)->Get("big")->view(), big);
  EXPECT_TRUE(absl::IsNotFound((*tier)->Get("gone").status()));
  auto meta = (*tier)->GetMeta("big");
  ASSERT_TRUE(meta.ok());
  EXPECT_EQ(meta->stored_bytes, big.size());
  EXPECT_EQ(meta->tier, TierKind::kRocksDb);
  std::vector<std::string> seen;
  std::vector<QuarantinedCache> bad;
  ASSERT_TRUE(
      (*tier)
          ->Recover(
              true, [&](absl::string_view k, const CacheMeta&) { seen.emplace_back(k); }, &bad)
          .ok());
  EXPECT_EQ(seen, (std::vector<std::string>{"big", "small"}));
  EXPECT_TRUE(bad.empty());
}

TEST(RocksDbTier, PayloadsOutliveTheTier) {
  TempDir dir;
  Payload small, big;
  {
    auto o = RocksOptions(dir.path());
    auto tier = RocksDbTier::Open(o);
    ASSERT_TRUE(tier.ok());
    Payload s = Payload::Copy(std::string(300, 's')), b = Payload::Copy(std::string(9000, 'b'));
    ASSERT_TRUE((*tier)->Put("s", MetaFor(s), s, false).ok());
    ASSERT_TRUE((*tier)->Put("b", MetaFor(b), b, false).ok());
    // Reopen so the values come from SST and blob files, not the memtable.
    tier->reset();
    tier = RocksDbTier::Open(o);
    ASSERT_TRUE(tier.ok());
    small = *(*tier)->Get("s");
    big = *(*tier)->Get("b");
  }
  EXPECT_EQ(small.view(), std::string(300, 's'));
  EXPECT_EQ(big.view(), std::string(9000, 'b'));
}

TEST(RocksDbTier, CapacityIsEnforced) {
  TempDir dir;
  auto o = RocksOptions(dir.path());
  o.capacity_bytes = 1000;
  auto tier = RocksDbTier::Open(o);
  ASSERT_TRUE(tier.ok());
  Payload a = Payload::Copy(std::string(800, 'a'));
  ASSERT_TRUE((*tier)->Put("a", MetaFor(a), a, false).ok());
  EXPECT_TRUE(absl::IsResourceExhausted((*tier)->Put("b", MetaFor(a), a, false)));
  EXPECT_TRUE((*tier)->Put("a", MetaFor(a), a, false).ok());  // replacing fits
}

TEST(RocksDbTier, RecoverQuarantinesAPayloadThatFailsItsChecksum) {
  TempDir dir;
  auto tier = RocksDbTier::Open(RocksOptions(dir.path()));
  ASSERT_TRUE(tier.ok());
  Payload good = Payload::Copy("good bytes");
  CacheMeta wrong = MetaFor(good);
  wrong.crc32c ^= 0x5a5a;  // the stored payload no longer matches its meta
  ASSERT_TRUE((*tier)->Put("good", MetaFor(good), good, true).ok());
  ASSERT_TRUE((*tier)->Put("bad", wrong, good, true).ok());
  std::vector<std::string> seen;
  std::vector<QuarantinedCache> bad;
  ASSERT_TRUE(
      (*tier)
          ->Recover(
              true, [&](absl::string_view k, const CacheMeta&) { seen.emplace_back(k); }, &bad)
          .ok());
  EXPECT_EQ(seen, std::vector<std::string>{"good"});
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_EQ(bad[0].encoded_key, "bad");
  EXPECT_TRUE(absl::IsNotFound((*tier)->Get("bad").status()));
  auto q = (*tier)->ListQuarantine();
  ASSERT_TRUE(q.ok());
  ASSERT_EQ(q->size(), 1u);
  EXPECT_EQ((*q)[0].reason, "payload checksum mismatch");
  EXPECT_EQ((*tier)->entries(), 1u);
}

// The files under <path>/direct that hold a payload; with `made_ahead`, also the empty ones the
// tier creates ahead of its puts (so a put syncs no directory).
std::vector<std::string> DirectFiles(const std::string& path, bool made_ahead = false) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(path + "/direct", ec)) {
    if (made_ahead || std::filesystem::file_size(f.path()) > 0) {
      out.push_back(f.path().filename().string());
    }
  }
  return out;
}

// Large payloads skip the WAL: one file each under <path>/direct, named by a synced record;
// overwrites and deletes remove the old file, and everything survives a reopen.
TEST(RocksDbTier, DirectPayloadsAreFilesOfTheirOwnThatSurviveAReopen) {
  TempDir dir;
  auto o = RocksOptions(dir.path());
  o.direct_min_bytes = 64 << 10;
  std::string big(3 * 1048576 + 1234, 'x'), other(200000, 'o');
  for (size_t i = 0; i < big.size(); i += 4093) big[i] = static_cast<char>(i / 4093);
  {
    auto tier = RocksDbTier::Open(o);
    ASSERT_TRUE(tier.ok()) << tier.status();
    Payload b = Payload::Copy(big), s = Payload::Copy(std::string(100, 's'));
    ASSERT_TRUE((*tier)->Put("big", MetaFor(b), b, /*sync=*/false).ok());
    ASSERT_TRUE((*tier)->Put("small", MetaFor(s), s, false).ok());
    EXPECT_EQ(DirectFiles(dir.path()).size(), 1u);
    EXPECT_EQ((*tier)->Get("big")->view(), big);
    EXPECT_EQ((*tier)->used_bytes(), big.size() + 100);
    // Overwrites: direct -> direct (a new file, the old one removed), small -> direct.
    Payload ob = Payload::Copy(other);
    ASSERT_TRUE((*tier)->Put("other", MetaFor(ob), ob, false).ok());
    ASSERT_TRUE((*tier)->Put("small", MetaFor(ob), ob, false).ok());
    EXPECT_EQ(DirectFiles(dir.path()).size(), 3u);
    ASSERT_TRUE((*tier)->Put("other", MetaFor(b), b, false).ok());
    EXPECT_EQ(DirectFiles(dir.path()).size(), 3u);
    // direct -> small: the file goes, the value is inline again.
    ASSERT_TRUE((*tier)->Put("small", MetaFor(s), s, false).ok());
    EXPECT_EQ(DirectFiles(dir.path()).size(), 2u);
    EXPECT_EQ((*tier)->Get("small")->view(), std::string(100, 's'));
  }
  auto tier = RocksDbTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_EQ((*tier)->Get("big")->view(), big);
  EXPECT_EQ((*tier)->Get("other")->view(), big);
  EXPECT_EQ((*tier)->Get("small")->view(), std::string(100, 's'));
  EXPECT_EQ((*tier)->entries(), 3u);
  std::vector<std::string> seen;
  std::vector<QuarantinedCache> bad;
  ASSERT_TRUE(
      (*tier)
          ->Recover(
              true, [&](absl::string_view k, const CacheMeta&) { seen.emplace_back(k); }, &bad)
          .ok());
  EXPECT_EQ(seen, (std::vector<std::string>{"big", "other", "small"}));
  EXPECT_TRUE(bad.empty());
  ASSERT_TRUE((*tier)->Delete("big", true).ok());
  ASSERT_TRUE((*tier)->DeleteMany({"other", "absent"}, true).ok());
  EXPECT_TRUE(DirectFiles(dir.path()).empty());
  EXPECT_TRUE(absl::IsNotFound((*tier)->Get("big").status()));
  EXPECT_EQ((*tier)->used_bytes(), 100u);
}

// A file no record names (a put that crashed between its file and its record) is removed at
// Open; a named file that went missing or short is found by Recover and quarantined, and the
// purge removes what is left.
TEST(RocksDbTier, UnnamedDirectFilesGoAtOpenAndDamagedOnesAreQuarantined) {
  TempDir dir;
  auto o = RocksOptions(dir.path());
  o.direct_min_bytes = 4096;
  const std::string v(100000, 'v');
  {
    auto tier = RocksDbTier::Open(o);
    ASSERT_TRUE(tier.ok());
    Payload p = Payload::Copy(v);
    ASSERT_TRUE((*tier)->Put("a", MetaFor(p), p, true).ok());
    ASSERT_TRUE((*tier)->Put("b", MetaFor(p), p, true).ok());
  }
  std::vector<std::string> files = DirectFiles(dir.path());
  ASSERT_EQ(files.size(), 2u);
  EXPECT_GT(DirectFiles(dir.path(), true).size(), 2u);  // files made ahead, never used
  std::sort(files.begin(), files.end());  // names start with the time: "a" was first
  {
    std::FILE* stray =
        std::fopen((dir.path() + "/direct/0000000000000001-000000.kvd").c_str(), "w");
    ASSERT_NE(stray, nullptr);
    std::fputs("a put that never got its record", stray);
    std::fclose(stray);
  }
  std::filesystem::resize_file(dir.path() + "/direct/" + files[1], 50000);  // "b" short
  auto tier = RocksDbTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  // The stray one is gone, and so are the empty files made ahead.
  EXPECT_EQ(DirectFiles(dir.path(), true).size(), 2u);
  std::vector<std::string> seen;
  std::vector<QuarantinedCache> bad;
  ASSERT_TRUE(
      (*tier)
          ->Recover(
              true, [&](absl::string_view k, const CacheMeta&) { seen.emplace_back(k); }, &bad)
          .ok());
  EXPECT_EQ(seen, std::vector<std::string>{"a"});
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_EQ(bad[0].encoded_key, "b");
  EXPECT_TRUE(absl::IsNotFound((*tier)->Get("b").status()));
  EXPECT_EQ(DirectFiles(dir.path()).size(), 2u);  // kept for inspection while quarantined
  ASSERT_TRUE(*(*tier)->PurgeQuarantine("b"));
  EXPECT_EQ(DirectFiles(dir.path()), std::vector<std::string>{files[0]});
  EXPECT_EQ((*tier)->Get("a")->view(), v);
}

// A flipped byte in a blob file: the compaction whose blob garbage collection reads it fails
// with Corruption. Puts go on (RocksDB would otherwise refuse every write, across reopens), the
// repair pass quarantines the damaged cache and the other caches stay whole.
TEST(RocksDbTier, ADamagedBlobFileIsQuarantinedAndPutsGoOn) {
  TempDir dir;
  const auto o = RocksOptions(dir.path());
  auto value = [](int round, int i) {
    std::string v(8000, static_cast<char>('a' + round));
    for (size_t j = 0; j < v.size(); j += 97) v[j] = static_cast<char>(i + j);
    return v;
  };
  std::string damaged_file;
  // Four flushes (one per close): four overlapping L0 tables and four blob files; the fourth
  // table starts a compaction that relocates the oldest blob file's blobs (garbage collection cutoff 0.25).
  for (int round = 0; round < 4; ++round) {
    auto tier = RocksDbTier::Open(o);
    ASSERT_TRUE(tier.ok()) << tier.status();
    for (int i = 0; i < 8; ++i) {
      Payload p = Payload::Copy(value(round, i));
      const std::string key = "k" + std::to_string(i) + "-" + std::to_string(round);
      ASSERT_TRUE((*tier)->Put(key, MetaFor(p), p, false).ok()) << key;
    }
    tier->reset();
    if (round == 0) {
      for (const auto& f : std::filesystem::directory_iterator(dir.path())) {
        if (f.path().extension() == ".blob") damaged_file = f.path().string();
      }
      ASSERT_FALSE(damaged_file.empty());
      std::fstream file(damaged_file, std::ios::in | std::ios::out | std::ios::binary);
      const auto at = static_cast<std::streamoff>(std::filesystem::file_size(damaged_file) / 2);
      char b = 0;
      file.seekg(at);
      file.read(&b, 1);
      b ^= 0x10;
      file.seekp(at);
      file.write(&b, 1);
    }
  }
  auto tier = RocksDbTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  (*tier)->EnableRepairs(nullptr);
  for (int i = 0; i < 600 && (*tier)->repairs() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_GE((*tier)->background_corruptions(), 1u);
  ASSERT_GE((*tier)->repairs(), 1u);
  EXPECT_EQ((*tier)->repaired_quarantined(), 1u) << (*tier)->last_repair();
  // New puts are taken, and survive a reopen.
  Payload fresh = Payload::Copy(value(9, 9));
  ASSERT_TRUE((*tier)->Put("fresh", MetaFor(fresh), fresh, true).ok());
  auto q = (*tier)->ListQuarantine();
  ASSERT_TRUE(q.ok());
  ASSERT_EQ(q->size(), 1u);
  EXPECT_TRUE(absl::StrContains((*q)[0].reason, "payload unreadable")) << (*q)[0].reason;
  tier->reset();
  tier = RocksDbTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  Payload again = Payload::Copy(value(9, 8));
  ASSERT_TRUE((*tier)->Put("fresh2", MetaFor(again), again, true).ok());
  EXPECT_EQ((*tier)->Get("fresh")->view(), fresh.view());
  // Every other cache is served whole; the damaged one is a miss, never wrong bytes.
  int missing = 0;
  for (int round = 0; round < 4; ++round) {
    for (int i = 0; i < 8; ++i) {
      const std::string key = "k" + std::to_string(i) + "-" + std::to_string(round);
      auto got = (*tier)->Get(key);
      if (absl::IsNotFound(got.status())) {
        ++missing;
        EXPECT_EQ(key, (*q)[0].encoded_key);
        continue;
      }
      ASSERT_TRUE(got.ok()) << key << ": " << got.status();
      EXPECT_EQ(got->view(), value(round, i)) << key;
    }
  }
  EXPECT_EQ(missing, 1);
  EXPECT_EQ((*tier)->entries(), 4u * 8u - 1u + 2u);
}

TEST(RocksDbTier, CalibrationEntriesAreImmutableAndListedByPrefixInByteOrder) {
  TempDir dir;
  auto tier = RocksDbTier::Open(RocksOptions(dir.path()));
  ASSERT_TRUE(tier.ok());
  RocksDbTier& t = **tier;
  const std::string k("llama\x00\x03", 7);
  ASSERT_TRUE(t.PutCalibration(k, "P1").ok());
  EXPECT_TRUE(t.PutCalibration(k, "P1").ok());  // idempotent
  EXPECT_TRUE(absl::IsAlreadyExists(t.PutCalibration(k, "P2")));
  ASSERT_TRUE(t.PutCalibration("llama\x01", "P0").ok());
  ASSERT_TRUE(t.PutCalibration("llama", "Q").ok());
  ASSERT_TRUE(t.PutCalibration("mistral", "M").ok());
  EXPECT_EQ(*t.GetCalibration(k), "P1");
  EXPECT_TRUE(absl::IsNotFound(t.GetCalibration("llama\x02").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(t.PutCalibration("", "x")));
  const std::string too_long(kMaxCalibrationKeyBytes + 1, 'k');
  EXPECT_TRUE(absl::IsInvalidArgument(t.PutCalibration(too_long, "x")));
  auto list = t.ListCalibration("llama");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 3u);
  EXPECT_EQ((*list)[0], "llama");
  EXPECT_EQ((*list)[1], k);
  EXPECT_EQ((*list)[2], "llama\x01");
  EXPECT_EQ(t.ListCalibration("")->size(), 4u);
  ASSERT_TRUE(t.DeleteCalibration(k).ok());
  EXPECT_TRUE(absl::IsNotFound(t.DeleteCalibration(k)));
  EXPECT_EQ(t.ListCalibration("llama")->size(), 2u);
}

TEST(RocksDbTier, DiskFullIsAClearStatusAndWritesResumeAfterwards) {
  TempDir dir;
  auto fs = std::make_shared<DiskFullFileSystem>(rocksdb::FileSystem::Default());
  std::unique_ptr<rocksdb::Env> env = rocksdb::NewCompositeEnv(fs);
  auto o = RocksOptions(dir.path());
  o.env = env.get();
  auto tier = RocksDbTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  RocksDbTier& t = **tier;
  Payload a = Payload::Copy(std::string(5000, 'a'));
  ASSERT_TRUE(t.Put("a", MetaFor(a), a, true).ok());
  fs->SetFull(true);
  absl::Status st = t.Put("b", MetaFor(a), a, true);
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_NE(st.message().find("disk full"), std::string::npos) << st;
  EXPECT_EQ(t.entries(), 1u);
  EXPECT_EQ(t.Get("a")->view(), a.view());  // reads keep working
  fs->SetFull(false);
  // RocksDB recovers from the write error in the background; writes succeed once it has.
  for (int i = 0; i < 200; ++i) {
    st = t.Put("c", MetaFor(a), a, true);
    if (st.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(t.Get("c")->view(), a.view());
}

TEST(RocksDbTier, OpenFailsClearlyOnABadPath) {
  auto o = RocksOptions("/proc/kvcomp-cannot-write-here");
  EXPECT_FALSE(RocksDbTier::Open(o).ok());
  o.path = "";
  EXPECT_TRUE(absl::IsInvalidArgument(RocksDbTier::Open(o).status()));
}

}  // namespace
}  // namespace storage
}  // namespace kvcomp
