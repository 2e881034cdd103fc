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
#include <sstream>
#include <string>
#include <thread>
#include <vector>

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

// mode: "" (disk-durable puts), "stale", "direct" or "behind" (crash_writer.cc).
pid_t StartWriter(const std::string& db, const std::string& log, uint64_t first, uint64_t seed,
                  const char* mode = "") {
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string first_s = std::to_string(first), seed_s = std::to_string(seed);
    execl(KVCOMP_CRASH_WRITER, KVCOMP_CRASH_WRITER, db.c_str(), log.c_str(), first_s.c_str(),
          seed_s.c_str(), *mode != '\0' ? mode : static_cast<char*>(nullptr),
          static_cast<char*>(nullptr));
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

// Kill cycles of the writer in `mode` ("", "direct" or "behind"). In behind mode an acknowledged
// put may be lost, but the lost ones of a cycle hold at most crash::kBehindWindow bytes.
void KillCycles(const char* mode, int default_cycles) {
  testing::TempDir dir;
  const std::string db = dir.Sub("db"), log_path = dir.Sub("log");
  const char* env = std::getenv("KVCOMP_CRASH_CYCLES");
  const int cycles = env != nullptr ? std::atoi(env) : default_cycles;
  const bool behind = std::string(mode) == "behind";
  const StoreOptions options = behind                              ? crash::BehindOptions(db)
                               : std::string(mode) == "direct" ? crash::DirectOptions(db)
                                                               : crash::Options(db);
  std::mt19937_64 rng(20261126);
  uint64_t total_acked = 0, behind_lost = 0;
  std::set<uint64_t> lost_before;  // behind mode: acknowledged puts lost in earlier cycles
  int killed_mid_put = 0;  // cycles whose last put had an intent but no ack
  for (int cycle = 0; cycle < cycles; ++cycle) {
    const pid_t pid = StartWriter(db, log_path, 1 + cycle * 1000000ull, rng(), mode);
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
    auto store = TieredStore::Open(options);
    ASSERT_TRUE(store.ok()) << "cycle " << cycle << ": " << store.status();
    EXPECT_EQ((*store)->Stats().quarantined, 0u) << "cycle " << cycle;
    uint64_t lost_bytes = 0;  // behind mode: acknowledged bytes of this cycle not on disk
    for (uint64_t id : log.put_acked) {
      auto got = (*store)->Get(crash::Key(id));
      if (log.delete_acked.count(id)) {
        ASSERT_TRUE(absl::IsNotFound(got.status()))
            << "cycle " << cycle << ": deleted " << id << " is back";
        continue;
      }
      if (log.delete_intent.count(id) && absl::IsNotFound(got.status())) continue;
      if (behind && absl::IsNotFound(got.status())) {
        if (lost_before.insert(id).second) {
          lost_bytes += Expected(id).size();
          ++behind_lost;
        }
        continue;
      }
      ASSERT_TRUE(got.ok()) << "cycle " << cycle << ": acknowledged " << id
                            << " lost: " << got.status();
      ASSERT_EQ(got->payload.view(), Expected(id)) << "cycle " << cycle << " id " << id;
    }
    // The loss window: what a kill lost of the puts acknowledged behind.
    ASSERT_LE(lost_bytes, crash::kBehindWindow) << "cycle " << cycle;
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
    ::testing::Test::RecordProperty(std::string(mode) + "cycle_" + std::to_string(cycle) +
                                        "_visible",
                                    static_cast<int>(visible));
  }
  // The test must have exercised something: acknowledged puts across the cycles.
  EXPECT_GE(total_acked, static_cast<uint64_t>(cycles / 3));
  std::printf(
      "crash test%s%s: %d cycles (%d killed mid-put), %llu acknowledged puts, %llu acknowledged "
      "behind and lost (within the window), the rest intact\n",
      *mode != '\0' ? " " : "", mode, cycles, killed_mid_put,
      static_cast<unsigned long long>(total_acked), static_cast<unsigned long long>(behind_lost));
}

TEST(Crash, SigkilledWriterLosesNothingAcknowledged) { KillCycles("", 30); }

// The same with the large caches written as direct files (the file and its record).
TEST(Crash, SigkilledDirectFileWriterLosesNothingAcknowledged) { KillCycles("direct", 15); }

// Durability::kBehind: a kill loses at most the loss window of acknowledged puts.
TEST(Crash, SigkilledBehindWriterLosesAtMostTheWindow) { KillCycles("behind", 15); }

// What the checker may find in a slot after a crash: nothing, or one of the allowed versions.
struct SlotState {
  std::set<uint64_t> versions;  // allowed versions
  bool may_be_absent = true;
  std::vector<uint64_t> history;  // every version ever written to the slot, for messages
};

// The stale-data crash test: the writer overwrites (disk- and memory-durable), deletes and evicts
// on a few keys through a file system that drops unsynced WAL bytes on SIGKILL (a power cut for
// the WAL). After every kill the store is reopened and every slot checked against the log: a
// slot whose last acknowledged event is a disk-durable put of v holds v; a memory-durable put of
// v holds v or nothing; an acknowledged delete or an observed eviction holds nothing. The
// operation in flight at the kill may have happened or not (and, if a put, may have evicted
// other slots unobserved, so any slot may then be empty). Never may a slot hold an older
// version: that would be stale data served as current. KVCOMP_STALE_CYCLES overrides the cycles.
TEST(Crash, NothingDeletedOverwrittenOrEvictedComesBackAfterPowerLoss) {
  testing::TempDir dir;
  const std::string db = dir.Sub("db"), log_path = dir.Sub("log");
  const char* env = std::getenv("KVCOMP_STALE_CYCLES");
  const int cycles = env != nullptr ? std::atoi(env) : 20;
  std::mt19937_64 rng(20261127);
  std::map<uint64_t, SlotState> slots;
  for (uint64_t i = 0; i < crash::kStaleSlots; ++i) slots[i];
  size_t log_pos = 0;  // lines of the log already applied
  uint64_t acked_disk = 0, acked_memory = 0, acked_deletes = 0, evictions = 0, checked_gone = 0;
  uint64_t present_after_crash = 0;
  for (int cycle = 0; cycle < cycles; ++cycle) {
    const pid_t pid = StartWriter(db, log_path, 1 + cycle * 1000000ull, rng(), "stale");
    ASSERT_GT(pid, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 400));
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status))
        << "writer exited by itself with status " << WEXITSTATUS(status) << " in cycle " << cycle;

    // Apply this cycle's log lines in order.
    std::vector<std::string> lines;
    {
      std::ifstream in(log_path);
      for (std::string line; std::getline(in, line);) lines.push_back(line);
    }
    bool pending = false;  // an intent without its ack: the operation in flight at the kill
    char pending_tag = 0;
    uint64_t pending_slot = 0, pending_version = 0;
    for (size_t i = log_pos; i < lines.size(); ++i) {
      std::istringstream in(lines[i]);
      char tag = 0;
      uint64_t slot = 0, version = 0;
      in >> tag >> slot >> version;
      ASSERT_LT(slot, crash::kStaleSlots) << lines[i];
      SlotState& st = slots[slot];
      switch (tag) {
        case 'P':
        case 'M':
        case 'R':
        case 'X':
          pending = true;
          pending_tag = tag;
          pending_slot = slot;
          pending_version = version;
          if (tag != 'X') st.history.push_back(version);
          break;
        case 'p':
          st.versions = {version};
          st.may_be_absent = false;
          pending = false;
          ++acked_disk;
          break;
        case 'm':
        case 'r':
          st.versions = {version};
          st.may_be_absent = true;
          pending = false;
          ++acked_memory;
          break;
        case 'x':
          st.versions.clear();
          st.may_be_absent = true;
          pending = false;
          ++acked_deletes;
          break;
        case 'E':
          st.versions.clear();
          st.may_be_absent = true;
          ++evictions;
          break;
        default:
          FAIL() << "bad log line " << lines[i];
      }
    }
    log_pos = lines.size();
    std::map<uint64_t, SlotState> allowed = slots;
    if (pending) {
      SlotState& st = allowed[pending_slot];
      st.may_be_absent = true;
      if (pending_tag != 'X') st.versions.insert(pending_version);
      if (pending_tag != 'X') {
        for (auto& [slot, s] : allowed) s.may_be_absent = true;  // unobserved evictions
      }
    }

    auto store = TieredStore::Open(crash::StaleOptions(db));
    ASSERT_TRUE(store.ok()) << "cycle " << cycle << ": " << store.status();
    EXPECT_EQ((*store)->Stats().quarantined, 0u) << "cycle " << cycle;
    for (auto& [slot, st] : allowed) {
      auto got = (*store)->Get(crash::StaleKey(slot));
      SlotState& now = slots[slot];
      if (absl::IsNotFound(got.status())) {
        ASSERT_TRUE(st.may_be_absent) << "cycle " << cycle << ": slot " << slot
                                      << " lost its disk-durable version " << *st.versions.begin();
        if (st.versions.empty()) ++checked_gone;
        now.versions.clear();
        now.may_be_absent = true;
        continue;
      }
      ASSERT_TRUE(got.ok()) << "cycle " << cycle << " slot " << slot << ": " << got.status();
      uint64_t found = 0;
      for (uint64_t v : st.versions) {
        if (got->payload.view() == crash::StaleBytes(v)) found = v;
      }
      if (found == 0) {
        std::string which = "bytes of no version ever written";
        for (uint64_t v : st.history) {
          if (got->payload.view() == crash::StaleBytes(v))
            which = "older version " + std::to_string(v);
        }
        FAIL() << "cycle " << cycle << ": slot " << slot << " came back with " << which
               << " (allowed: " << (st.may_be_absent ? "nothing" : "") << " "
               << (st.versions.empty() ? std::string() : std::to_string(*st.versions.rbegin()))
               << ")";
      }
      ++present_after_crash;
      // What the checker found is on disk now: the next cycle starts from it.
      now.versions = {found};
      now.may_be_absent = false;
    }
  }
  EXPECT_GT(acked_disk, 0u);
  EXPECT_GT(acked_memory + acked_deletes, 0u);
  std::printf(
      "stale-data crash test: %d cycles; acknowledged %llu disk puts, %llu memory puts, "
      "%llu deletes; %llu evictions observed; %llu slots found empty as required, "
      "%llu present slots checked; nothing stale\n",
      cycles, static_cast<unsigned long long>(acked_disk),
      static_cast<unsigned long long>(acked_memory), static_cast<unsigned long long>(acked_deletes),
      static_cast<unsigned long long>(evictions), static_cast<unsigned long long>(checked_gone),
      static_cast<unsigned long long>(present_after_crash));
}

}  // namespace
}  // namespace storage
}  // namespace kvcomp
