// A write-ahead log damaged in its middle (a media fault, not a crash's torn tail), on a real
// RocksDB in a temporary directory. The database is brought, through crash-like exits of child
// processes (no close, no flush), to the state where the quarantine family has table files and
// has moved past a log that the meta and payload families still replay; then a record in the
// middle of that log is damaged (bytes flipped, or the file cut short) and the tier is opened.
// RocksDB's point-in-time recovery refuses such an open ("SST file is ahead of WALs"); the tier
// must open, serve every acknowledged cache whose record is intact byte-exact, read the damaged
// ones as misses, and report the damage.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/storage/tiered_store.h"
#include "rocksdb_tier.h"
#include "storage_test_util.h"

namespace kvcomp {
namespace storage {
namespace {

using testing::TempDir;
using testing::MetaFor;

RocksDbTierOptions Options(const std::string& path) {
  RocksDbTierOptions o;
  o.enabled = true;
  o.path = path;
  o.capacity_bytes = 64 << 20;
  o.min_blob_size = 4096;
  o.reserve_bytes = 1 << 20;
  return o;
}

// Payload i: 3,000 bytes (below min_blob_size, one log record each) of a pattern of its own.
std::string Bytes(int i) {
  std::string s = "payload " + std::to_string(1000 + i) + " ";  // unique first 13 bytes
  s.resize(3000);
  for (size_t j = 13; j < s.size(); ++j) s[j] = static_cast<char>(i * 31 + j * 7);
  return s;
}

// The steps run by a child process: the test binary run again with kChildEnv set to
// "<step> <dir>". A child exits without closing the database, as a SIGKILL would leave it
// (what was written is in the files, nothing is flushed at close), except the first step's.
constexpr char kChildEnv[] = "KVCOMP_LOG_DAMAGE_STEP";

void InChild(const std::string& step, const std::string& dir) {
  const std::string value = step + " " + dir;
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    setenv(kChildEnv, value.c_str(), 1);
    execl("/proc/self/exe", "log_damage_step", static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "step " << step << " failed";
}

bool PutAll(RocksDbTier& tier, int from, int to) {
  for (int i = from; i < to; ++i) {
    Payload p = Payload::Copy(Bytes(i));
    if (!tier.Put("k" + std::to_string(i), MetaFor(p), p, /*sync=*/true).ok()) return false;
  }
  return true;
}

std::vector<std::filesystem::path> Logs(const std::string& dir) {
  std::vector<std::filesystem::path> logs;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() == ".log") logs.push_back(e.path());
  }
  std::sort(logs.begin(), logs.end());
  return logs;
}

std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The log file holding `bytes`' first 64 bytes, "" when none does.
std::filesystem::path LogHolding(const std::string& dir, const std::string& bytes) {
  for (const auto& log : Logs(dir)) {
    if (ReadFile(log).find(bytes.substr(0, 13)) != std::string::npos) return log;
  }
  return {};
}

enum class Damage { kFlip, kCut };

constexpr int kInLogN = 24;  // k0..k23 in log N (about 74 KiB: three of RocksDB's 32 KiB blocks)
constexpr int kInLogN1 = 2;  // k24, k25 in log N+1

// Leaves `dir` with: "q" quarantined and flushed (the quarantine family has a table file);
// k0..k23 synced into log N by a process that died; k24, k25 synced into log N+1 by a second
// one that replayed log N without flushing it. Then damages k2's record in the middle of log N.
// Returns the offset in log N where the damage starts.
void MakeDamagedDatabase(const std::string& dir, Damage damage, size_t* damaged_at) {
  InChild("quarantine", dir);
  if (::testing::Test::HasFatalFailure()) return;
  InChild("log-n", dir);
  if (::testing::Test::HasFatalFailure()) return;
  const std::filesystem::path log_n = LogHolding(dir, Bytes(0));
  ASSERT_FALSE(log_n.empty());
  InChild("log-n1", dir);
  if (::testing::Test::HasFatalFailure()) return;
  ASSERT_EQ(LogHolding(dir, Bytes(0)), log_n);  // still there
  const std::filesystem::path log_n1 = LogHolding(dir, Bytes(kInLogN));
  ASSERT_FALSE(log_n1.empty());
  ASSERT_LT(log_n, log_n1);
  std::vector<std::filesystem::path> logs = {log_n};
  std::string bytes = ReadFile(logs[0]);
  const size_t at = bytes.find(Bytes(2).substr(0, 13));
  ASSERT_NE(at, std::string::npos);
  *damaged_at = at + 100;
  if (damage == Damage::kFlip) {
    for (size_t j = 100; j < 140; ++j) bytes[at + j] ^= 0x5a;
    std::ofstream out(logs[0], std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  } else {
    std::filesystem::resize_file(logs[0], at + 1000);
  }
}

void ExpectServed(RocksDbTier& tier, int i) {
  auto got = tier.Get("k" + std::to_string(i));
  ASSERT_TRUE(got.ok()) << "k" << i << ": " << got.status();
  EXPECT_EQ(got->view(), Bytes(i)) << "k" << i;
}

void ExpectMiss(RocksDbTier& tier, int i) {
  auto got = tier.Get("k" + std::to_string(i));
  EXPECT_TRUE(absl::IsNotFound(got.status())) << "k" << i << ": " << got.status();
}

// Where payload i's bytes sit in log N, npos when not there.
std::vector<size_t> OffsetsInLog(const std::filesystem::path& log) {
  const std::string bytes = ReadFile(log);
  std::vector<size_t> at;
  for (int i = 0; i < kInLogN; ++i) at.push_back(bytes.find(Bytes(i).substr(0, 13)));
  return at;
}

void CheckOpenAfter(Damage damage) {
  TempDir dir;
  const std::string path = dir.path();
  std::vector<size_t> offsets;
  size_t damaged_at = 0;
  {
    // Where each record sits, from an undamaged copy made the same way.
    TempDir probe;
    MakeDamagedDatabase(probe.path(), Damage::kFlip, &damaged_at);
    if (::testing::Test::HasFatalFailure()) return;
    offsets = OffsetsInLog(LogHolding(probe.path(), Bytes(0)));
  }
  MakeDamagedDatabase(path, damage, &damaged_at);
  if (::testing::Test::HasFatalFailure()) return;
  constexpr size_t kBlock = 32768;  // RocksDB's log block
  {
    auto tier = RocksDbTier::Open(Options(path));
    ASSERT_TRUE(tier.ok()) << tier.status();
    RocksDbTier& t = **tier;
    std::vector<std::string> recovered;
    std::vector<QuarantinedCache> quarantined;
    ASSERT_TRUE(t.Recover(
                     /*verify=*/true,
                     [&](absl::string_view key, const CacheMeta&) {
                       recovered.emplace_back(key);
                     },
                     &quarantined)
                    .ok());
    EXPECT_TRUE(quarantined.empty());
    int served = 0;
    for (int i = 0; i < kInLogN; ++i) {
      const std::string key = "k" + std::to_string(i);
      auto got = t.Get(key);
      // Never other bytes: each cache is served whole and exact, or is a miss.
      if (got.ok()) {
        EXPECT_EQ(got->view(), Bytes(i)) << key;
        ++served;
      } else {
        EXPECT_TRUE(absl::IsNotFound(got.status())) << key << ": " << got.status();
      }
      // Written before the damage: kept. The damaged record: a miss.
      if (offsets[i] + Bytes(i).size() < damaged_at) {
        ExpectServed(t, i);
      }
      if (i == 2) ExpectMiss(t, i);
      // A record that starts in a later 32 KiB block than the damage: kept after flipped bytes
      // (RocksDB drops the rest of the damaged block, then reads on), gone after a cut.
      const bool later_block = offsets[i] >= (damaged_at / kBlock + 1) * kBlock + 64;
      if (later_block && damage == Damage::kFlip) {
        ExpectServed(t, i);
      }
      if (offsets[i] >= damaged_at && damage == Damage::kCut) {
        ExpectMiss(t, i);
      }
    }
    // The log after the damaged one: kept.
    for (int i = kInLogN; i < kInLogN + kInLogN1; ++i) ExpectServed(t, i);
    EXPECT_EQ(recovered.size(), static_cast<size_t>(served + kInLogN1));
    if (damage == Damage::kFlip) {
      EXPECT_GE(served, 2 + 8);
    }
    // What the open skipped is reported. (A log cut short reads to RocksDB as a crash's torn
    // tail, which it does not report: its records after the cut are lost all the same.)
    std::cerr << "log damage: " << t.log_damage().regions << " stretch(es), "
              << t.log_damage().bytes << " bytes; last: " << t.log_damage().last << "\n";
    if (damage == Damage::kFlip) {
      EXPECT_GE(t.log_damage().regions, 1u);
      EXPECT_GT(t.log_damage().bytes, 0u);
      EXPECT_NE(t.log_damage().last.find(".log: dropping"), std::string::npos)
          << t.log_damage().last;
    }
    auto q = t.ListQuarantine();
    ASSERT_TRUE(q.ok());
    ASSERT_EQ(q->size(), 1u);
    EXPECT_EQ((*q)[0].encoded_key, "q");
    // Writable.
    Payload p = Payload::Copy(Bytes(99));
    ASSERT_TRUE(t.Put("k99", MetaFor(p), p, true).ok());
  }
  // A reported damaged log was retired: a later open finds no damage and the same caches.
  if (damage == Damage::kFlip) {
    EXPECT_TRUE(LogHolding(path, Bytes(0)).empty());
  }
  auto tier = RocksDbTier::Open(Options(path));
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_EQ((*tier)->log_damage().regions, 0u);
  for (int i : {0, 1, kInLogN, kInLogN + 1, 99}) ExpectServed(**tier, i);
  ExpectMiss(**tier, 2);
}

TEST(LogDamage, BytesFlippedInTheMiddleOfALiveLog) { CheckOpenAfter(Damage::kFlip); }

TEST(LogDamage, ALiveLogCutInItsMiddle) { CheckOpenAfter(Damage::kCut); }

// The same damage through the store: it opens with its RocksDB tier, counts the damage among
// the store's corruptions, and serves what is intact.
TEST(LogDamage, TheStoreOpensWithItsDiskTierAndCountsTheDamage) {
  TempDir dir;
  size_t damaged_at = 0;
  MakeDamagedDatabase(dir.path(), Damage::kFlip, &damaged_at);
  if (::testing::Test::HasFatalFailure()) return;
  StoreOptions o;
  o.host.capacity_bytes = 1 << 20;
  o.rocksdb = Options(dir.path());
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status();
  const StoreStats st = (*store)->Stats();
  EXPECT_TRUE(st.tier(TierKind::kRocksDb).present) << st.tier(TierKind::kRocksDb).error;
  EXPECT_GE(st.log_damage, 1u);
  EXPECT_NE(st.last_log_damage.find(".log"), std::string::npos) << st.last_log_damage;
}

// A child's step; the exit code says whether it worked.
// Payload i of the fragmented case: 80,000 bytes, so its log record spans three of RocksDB's
// 32 KiB blocks (a first, middle and last fragment).
std::string BigBytes(int i) {
  std::string s = "big payload " + std::to_string(100 + i) + " ";  // unique first 16 bytes
  s.resize(80000);
  for (size_t j = 16; j < s.size(); ++j) s[j] = static_cast<char>(i * 13 + j * 5);
  return s;
}
constexpr int kBig = 6;

// RocksDB 7.8's log reader carries the checksum of a record it dropped for damage in its middle
// into the next record of several fragments, which then fails and refused the whole open
// ("Write batch content corrupted"). The damaged log is cut where the damage starts: the
// records before it are served, the damaged one and those after it in that log are misses,
// nothing is served wrong, and the tier opens and takes writes.
TEST(LogDamage, ADamagedRecordOfSeveralFragmentsFollowedByAnother) {
  TempDir dir;
  InChild("big", dir.path());
  if (::testing::Test::HasFatalFailure()) return;
  const std::filesystem::path log = LogHolding(dir.path(), BigBytes(0));
  ASSERT_FALSE(log.empty());
  std::string bytes = ReadFile(log);
  const size_t at = bytes.find(BigBytes(2).substr(0, 16));
  ASSERT_NE(at, std::string::npos);
  ASSERT_NE(bytes.find(BigBytes(kBig - 1).substr(0, 16)), std::string::npos);
  for (size_t j = 40000; j < 40040; ++j) bytes[at + j] ^= 0x5a;  // inside k2's middle fragment
  {
    std::ofstream out(log, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  auto tier = RocksDbTier::Open(Options(dir.path()));
  ASSERT_TRUE(tier.ok()) << tier.status();
  for (int i = 0; i < kBig; ++i) {
    auto got = (*tier)->Get("b" + std::to_string(i));
    if (i < 2) {
      ASSERT_TRUE(got.ok()) << "b" << i << ": " << got.status();
      EXPECT_EQ(got->view(), BigBytes(i)) << "b" << i;
    } else {
      EXPECT_TRUE(absl::IsNotFound(got.status())) << "b" << i << ": " << got.status();
    }
  }
  EXPECT_GE((*tier)->log_damage().regions, 1u);
  EXPECT_TRUE(absl::StrContains((*tier)->log_damage().last, "cut from"))
      << (*tier)->log_damage().last;
  Payload p = Payload::Copy(BigBytes(kBig));
  ASSERT_TRUE((*tier)->Put("b" + std::to_string(kBig), MetaFor(p), p, true).ok());
  tier->reset();
  auto again = RocksDbTier::Open(Options(dir.path()));
  ASSERT_TRUE(again.ok()) << again.status();
  auto got = (*again)->Get("b" + std::to_string(kBig));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->view(), BigBytes(kBig));
  EXPECT_EQ((*again)->log_damage().regions, 0u);
}

int RunStep(const std::string& step, const std::string& dir) {
  auto tier = RocksDbTier::Open(Options(dir));
  if (!tier.ok()) return 2;
  if (step == "quarantine") {
    Payload p = Payload::Copy(std::string(500, 'q'));
    if (!(*tier)->Put("q", MetaFor(p), p, true).ok()) return 3;
    if (!(*tier)->Quarantine("q", "set aside by the test").ok()) return 4;
    tier->reset();  // a clean close: every family flushed, so "quarantine" has a table file
    return 0;
  }
  if (step == "log-n") {
    if (!PutAll(**tier, 0, kInLogN)) return 5;
    _exit(0);  // crash: k0..k23 are in log N only
  }
  if (step == "big") {
    for (int i = 0; i < kBig; ++i) {
      Payload p = Payload::Copy(BigBytes(i));
      if (!(*tier)->Put("b" + std::to_string(i), MetaFor(p), p, /*sync=*/true).ok()) return 8;
    }
    _exit(0);  // crash: b0..b5 are in one log only
  }
  if (step == "log-n1") {
    if (!PutAll(**tier, kInLogN, kInLogN + kInLogN1)) return 6;
    _exit(0);  // crash: log N replayed, not flushed, still live; k24, k25 in log N+1
  }
  return 7;
}

}  // namespace
}  // namespace storage
}  // namespace kvcomp

int main(int argc, char** argv) {
  if (const char* step = std::getenv(kvcomp::storage::kChildEnv)) {
    const std::string s(step);
    const size_t space = s.find(' ');
    _exit(kvcomp::storage::RunStep(s.substr(0, space), s.substr(space + 1)));
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
