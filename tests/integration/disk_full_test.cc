// kvcompd on a real full disk: its data directory is a tmpfs the test mounts (root, as CI runs;
// a refused mount fails the test). Real puts over UCX fill it; then puts are refused with
// RESOURCE_EXHAUSTED ("disk full") while the daemon keeps running and serving every
// acknowledged cache; after a SIGKILL the daemon starts on the still-full disk, says loudly that
// its RocksDB tier is read-only, and serves every cache; when the filesystem grows, puts resume
// with no restart. Its metrics say so throughout (kvcomp_store_read_only, kvcomp_disk_free_bytes
// against kvcomp_disk_reserve_bytes).
#include <gtest/gtest.h>
#include <signal.h>

#include <map>
#include <string>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "daemon_fixture.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/transport/client.h"
#include "kvcompd_process.h"
#include "low_rank_put.h"
#include "storage/tmpfs_mount.h"

namespace kvcomp {
namespace testing {
namespace {

namespace wire = transport::wire;

constexpr uint64_t kMiB = 1 << 20;
// 2 MiB of K and V per cache (4 layers, 4 kv heads, 512 tokens, head_dim 64, f16).
const KvLayout kLayout{4, 4, 4, 64, DType::kF16};
constexpr uint64_t kTokens = 512;

wire::PutBegin Begin(const std::string& key) {
  wire::PutBegin b;
  b.layout = kLayout;
  b.num_tokens = kTokens;
  b.model_id = "m";
  b.key = key;
  return b;
}

struct Acked {
  uint64_t stored_bytes = 0;
  uint32_t crc = 0;  // of the bytes first read back
};

class DiskFullTest : public DaemonFixture {
 protected:
  DiskFullTest() {
    default_flags_ = {"--data_plane.max_block_bytes=1Mi", "--data_plane.max_put_bytes=64Mi",
                      "--storage.sweep_interval_seconds=0"};
  }

  // Puts caches until the daemon refuses one; returns the refusal.
  absl::Status FillUntilRefused(transport::UcxClient& c, int* next) {
    for (int i = 0; i < 400; ++i, ++*next) {
      const std::string key = "k" + std::to_string(*next);
      auto s = PutLowRankCache(c, Begin(key), *next);
      if (!s.ok()) return s.status();
      acked_[key].stored_bytes = s->stored_bytes;
    }
    return absl::OkStatus();
  }

  // Every acknowledged cache reads back whole (and the same as the last time it was read).
  void ExpectAllServed(transport::UcxClient& c) {
    ASSERT_FALSE(acked_.empty());
    for (auto& [key, a] : acked_) {
      auto got = c.Get("m", key);
      ASSERT_TRUE(got.ok()) << key << ": " << got.status();
      ASSERT_EQ(got->bytes.size(), a.stored_bytes) << key;
      const uint32_t crc = Crc32c(got->bytes.data(), got->bytes.size());
      if (a.crc == 0) a.crc = crc;
      EXPECT_EQ(crc, a.crc) << key;
    }
  }

  std::map<std::string, Acked> acked_;
};

struct DiskMetrics {
  double read_only = -1, free = -1, reserve = -1;
};

DiskMetrics ScrapeDisk(const KvcompdProcess& d) {
  const std::string m = HttpGet(d.ports().metrics, "/metrics").body;
  return {MetricValue(m, "kvcomp_store_read_only"), MetricValue(m, "kvcomp_disk_free_bytes"),
          MetricValue(m, "kvcomp_disk_reserve_bytes")};
}

TEST_F(DiskFullTest, PutsAreRefusedReadsGoOnRestartOnAFullDiskAndWritesResume) {
  // The daemon's data directory is the small filesystem; its log and ready file sit beside it.
  TmpfsMount fs(dir_.path() + "/data", 128 * kMiB);
  ASSERT_TRUE(fs.ok()) << fs.error();

  auto d = StartDaemon();
  DiskMetrics m = ScrapeDisk(*d);
  EXPECT_EQ(m.read_only, 0);
  EXPECT_EQ(m.reserve, 64.0 * kMiB);  // storage.rocksdb_reserve_bytes' default
  EXPECT_GT(m.free, m.reserve);
  EXPECT_LE(m.free, 128.0 * kMiB);
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  int next = 0;
  absl::Status refusal = FillUntilRefused(*c, &next);
  ASSERT_FALSE(refusal.ok()) << "128 MiB took 400 caches";
  EXPECT_EQ(refusal.code(), absl::StatusCode::kResourceExhausted) << refusal;
  EXPECT_TRUE(absl::StrContains(refusal.message(), "disk full")) << refusal;
  EXPECT_GT(acked_.size(), 5u);
  // Refused cleanly every time; the daemon stays up and serves everything acknowledged.
  for (int i = 0; i < 3; ++i) {
    auto again = PutLowRankCache(*c, Begin("refused-" + std::to_string(i)), 1000 + i);
    EXPECT_EQ(again.status().code(), absl::StatusCode::kResourceExhausted) << again.status();
  }
  ASSERT_TRUE(d->running()) << d->Log();
  ExpectAllServed(*c);

  // Killed, and something else takes the rest of the disk meanwhile.
  c.reset();
  d->Kill(SIGKILL);
  fs.Fill("filler", 256 * 1024);
  ASSERT_TRUE(d->Start()) << "kvcompd did not start on a full disk:\n" << d->Log();
  const std::string log = d->Log();
  EXPECT_TRUE(absl::StrContains(log, "READ-ONLY")) << log;
  EXPECT_TRUE(absl::StrContains(log, std::to_string(acked_.size()) + " cache(s) recovered"))
      << log;
  c = Connect(*d);
  ASSERT_NE(c, nullptr);
  ExpectAllServed(*c);
  auto refused = PutLowRankCache(*c, Begin("while-read-only"), 2000);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  m = ScrapeDisk(*d);
  EXPECT_EQ(m.read_only, 1);
  EXPECT_GE(m.free, 0);
  EXPECT_LT(m.free, m.reserve);

  // The filesystem grows: puts resume by themselves, no restart.
  ASSERT_EQ(fs.Resize(512 * kMiB), "");
  absl::StatusOr<wire::CacheSummary> put = absl::UnknownError("not tried");
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    put = PutLowRankCache(*c, Begin("after-growth"), 3000);
    if (put.ok()) break;
    absl::SleepFor(absl::Milliseconds(300));
  }
  ASSERT_TRUE(put.ok()) << put.status() << "\n" << d->Log();
  acked_["after-growth"].stored_bytes = put->stored_bytes;
  m = ScrapeDisk(*d);
  EXPECT_EQ(m.read_only, 0);
  EXPECT_GT(m.free, m.reserve);
  ExpectAllServed(*c);

  // And all of it survives one more restart.
  c.reset();
  d->Kill(SIGKILL);
  ASSERT_TRUE(d->Start()) << d->Log();
  c = Connect(*d);
  ASSERT_NE(c, nullptr);
  ExpectAllServed(*c);
}

}  // namespace
}  // namespace testing
}  // namespace kvcomp
