// Kills a writing process (storage_crash_writer) with SIGKILL at random moments, over many
// cycles on one database, and after each kill reopens the store and checks that every
// acknowledged put is there with its exact bytes, every acknowledged delete is gone, and nothing
// is visible that was never written. KVCOMP_CRASH_CYCLES overrides the number of cycles.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "crash_common.h"
#include "gtest/gtest.h"
#include "kvcomp/storage/tiered_store.h"
#include "storage_test_util.h"

namespace kvcomp {
namespace storage {
namespace {

struct Log {
  std::set<uint64_t> put_intent, put_acked, delete_intent, delete_acked;
};

Log ReadLog(const std::string& path) {
  Log log;
  std::ifstream in(path);
  char tag;
  uint64_t id;
  while (in >> tag >> id) {
    switch (tag) {
      case 'I':
        log.put_intent.insert(id);
        break;
      case 'A':
        log.put_acked.insert(id);
        break;
      case 'X':
        log.delete_intent.insert(id);
        break;
      case 'D':
        log.delete_acked.insert(id);
        break;
      default:
        break;
    }
  }
  return log;
}

pid_t StartWriter(const std::string& db, const std::string& log, uint64_t first, uint64_t seed) {
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string first_s = std::to_string(first), seed_s = std::to_string(seed);
    execl(KVCOMP_CRASH_WRITER, KVCOMP_CRASH_WRITER, db.c_str(), log.c_str(), first_s.c_str(),
          seed_s.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// crash::Bytes(id), built once per id (building is slower than comparing).
const std::string& Expected(uint64_t id) {
  static auto* memo = new std::map<uint64_t, std::string>();
  auto it = memo->find(id);
  if (it == memo->end()) it = memo->emplace(id, crash::Bytes(id)).first;
  return it->second;
}

TEST(Crash, SigkilledWriterLosesNothingAcknowledged) {
  testing::TempDir dir;
  const std::string db = dir.Sub("db"), log_path = dir.Sub("log");
  const char* env = std::getenv("KVCOMP_CRASH_CYCLES");
  const int cycles = env != nullptr ? std::atoi(env) : 30;
  std::mt19937_64 rng(20261126);
  uint64_t total_acked = 0;
  int killed_mid_put = 0;  // cycles whose last put had an intent but no ack
  for (int cycle = 0; cycle < cycles; ++cycle) {
    const pid_t pid = StartWriter(db, log_path, 1 + cycle * 1000000ull, rng());
    ASSERT_GT(pid, 0);
    // Random moments: sometimes during the writer's own recovery, mostly mid-write.
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 500));
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status))
        << "writer exited by itself with status " << WEXITSTATUS(status) << " in cycle " << cycle;

    const Log log = ReadLog(log_path);
    if (!log.put_intent.empty() && !log.put_acked.count(*log.put_intent.rbegin())) {
      ++killed_mid_put;
    }
    auto store = TieredStore::Open(crash::Options(db));
    ASSERT_TRUE(store.ok()) << "cycle " << cycle << ": " << store.status();
    EXPECT_EQ((*store)->Stats().quarantined, 0u) << "cycle " << cycle;
    for (uint64_t id : log.put_acked) {
      auto got = (*store)->Get(crash::Key(id));
      if (log.delete_acked.count(id)) {
        ASSERT_TRUE(absl::IsNotFound(got.status()))
            << "cycle " << cycle << ": deleted " << id << " is back";
        continue;
      }
      if (log.delete_intent.count(id) && absl::IsNotFound(got.status())) continue;
      ASSERT_TRUE(got.ok()) << "cycle " << cycle << ": acknowledged " << id
                            << " lost: " << got.status();
      ASSERT_EQ(got->payload.view(), Expected(id)) << "cycle " << cycle << " id " << id;
    }
    uint64_t visible = 0;
    for (const char* tenant : {"t0", "t1", "t2"}) {
      auto list = (*store)->List(tenant);
      ASSERT_TRUE(list.ok());
      for (const auto& c : *list) {
        ++visible;
        const uint64_t id = std::stoull(c.key.key.substr(6));
        ASSERT_TRUE(log.put_intent.count(id))
            << "cycle " << cycle << ": " << id << " visible but never written";
        ASSERT_FALSE(log.delete_acked.count(id)) << "cycle " << cycle << ": " << id;
        auto got = (*store)->Get(c.key);
        ASSERT_TRUE(got.ok()) << got.status();
        ASSERT_EQ(got->payload.view(), Expected(id)) << "half-written " << id;
      }
    }
    total_acked = log.put_acked.size();
    RecordProperty("cycle_" + std::to_string(cycle) + "_visible", static_cast<int>(visible));
  }
  // The test must have exercised something: acknowledged puts across the cycles.
  EXPECT_GE(total_acked, static_cast<uint64_t>(cycles / 3));
  std::printf("crash test: %d cycles (%d killed mid-put), %llu acknowledged puts, all intact\n",
              cycles, killed_mid_put, static_cast<unsigned long long>(total_acked));
}

}  // namespace
}  // namespace storage
}  // namespace kvcomp
