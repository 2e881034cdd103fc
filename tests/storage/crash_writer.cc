// The writer half of storage_crash_test: opens a store on disk and puts (and sometimes deletes)
// caches with disk durability until it is killed. Before each operation it appends an intent
// line to the log ("I id" / "X id"); after the store acknowledges it, an ack line ("A id" /
// "D id") that is fsynced before the next operation starts.
//   storage_crash_writer <db dir> <log file> <first id> <seed> [stale|direct|behind]
//
// With "direct" it runs on crash::DirectOptions (the large caches as direct files); with
// "behind" on crash::BehindOptions, every put Durability::kBehind (acknowledged in the host tier,
// persisted behind) and no deletes.
//
// With "stale" it runs on crash::StaleOptions through a file system that keeps unsynced WAL bytes
// in memory (power_loss_fs.h), so the SIGKILL acts as a power cut on them, and it overwrites,
// deletes and evicts instead: on kStaleSlots keys it puts version v (unique, from <first id>)
// with disk durability ("P slot v" / ack "p slot v"), with memory durability into host ("M"/"m")
// or into RocksDB ("R"/"r"), or deletes ("X slot" / "x slot"). After each operation, before its
// ack, it lists the store and logs "E slot" for every slot that vanished (evicted).
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "crash_common.h"
#include "kvcomp/storage/tiered_store.h"
#include "power_loss_fs.h"
#include "rocksdb/env.h"

namespace {

void Log(int fd, char tag, uint64_t id, bool sync) {
  const std::string line = std::string(1, tag) + " " + std::to_string(id) + "\n";
  if (write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) std::abort();
  if (sync && fdatasync(fd) != 0) std::abort();
}

void LogLine(int fd, const std::string& line, bool sync) {
  if (write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) std::abort();
  if (sync && fdatasync(fd) != 0) std::abort();
}

// Slots present in the store now, from List().
std::set<uint64_t> Present(kvcomp::storage::TieredStore& store) {
  std::set<uint64_t> out;
  for (const char* tenant : {"s0", "s1", "s2"}) {
    auto list = store.List(tenant);
    if (!list.ok()) std::abort();
    for (const auto& c : *list) out.insert(std::stoull(c.key.key.substr(5)));
  }
  return out;
}

int RunStale(const char* db, int fd, uint64_t first, std::mt19937_64& rng) {
  using namespace kvcomp::storage;
  auto fs = std::make_shared<testing::PowerLossFileSystem>(rocksdb::FileSystem::Default());
  std::unique_ptr<rocksdb::Env> env = rocksdb::NewCompositeEnv(fs);
  StoreOptions options = crash::StaleOptions(db);
  options.rocksdb.env = env.get();
  options.rocksdb.verify_checksums_on_open = false;
  auto opened = TieredStore::Open(options);
  if (!opened.ok()) {
    std::fprintf(stderr, "open: %s\n", opened.status().ToString().c_str());
    return 4;
  }
  TieredStore& store = **opened;
  std::set<uint64_t> present = Present(store);
  auto evictions = [&store] {
    const StoreStats st = store.Stats();
    return st.tier(TierKind::kHost).evictions + st.tier(TierKind::kRocksDb).evictions;
  };
  uint64_t seen_evictions = evictions();
  for (uint64_t v = first;; ++v) {
    const uint64_t slot = rng() % crash::kStaleSlots;
    const std::string s = std::to_string(slot), vs = std::to_string(v);
    const uint64_t what = rng() % 20;
    std::string ack;
    if (what < 4) {
      LogLine(fd, "X " + s + "\n", false);
      const absl::Status st = store.Delete(crash::StaleKey(slot));
      if (!st.ok() && !absl::IsNotFound(st)) {
        std::fprintf(stderr, "delete %s: %s\n", s.c_str(), st.ToString().c_str());
        return 5;
      }
      present.erase(slot);
      ack = "x " + s + "\n";
    } else {
      PutOptions po;
      char tag = 'P';
      if (what < 12) {
        po.durability = Durability::kDisk;
      } else if (what < 17) {
        tag = 'M';
      } else {
        tag = 'R';
        po.tier = static_cast<int>(TierKind::kRocksDb);
      }
      LogLine(fd, std::string(1, tag) + " " + s + " " + vs + "\n", false);
      const absl::Status st = store.Put(crash::StaleKey(slot), crash::StaleBytes(v), {}, po);
      if (!st.ok()) {
        std::fprintf(stderr, "put %s: %s\n", s.c_str(), st.ToString().c_str());
        return 5;
      }
      present.insert(slot);
      ack = std::string(1, static_cast<char>(tag - 'A' + 'a')) + " " + s + " " + vs + "\n";
    }
    if (evictions() != seen_evictions) {
      seen_evictions = evictions();
      const std::set<uint64_t> now = Present(store);
      for (uint64_t gone : present) {
        if (!now.count(gone)) LogLine(fd, "E " + std::to_string(gone) + "\n", false);
      }
      present = now;
    }
    LogLine(fd, ack, true);
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvcomp::storage;
  const std::string mode = argc == 6 ? argv[5] : "";
  if ((argc != 5 && argc != 6) ||
      (argc == 6 && mode != "stale" && mode != "direct" && mode != "behind")) {
    std::fprintf(stderr, "usage: %s <db dir> <log file> <first id> <seed> [stale|direct|behind]\n",
                 argv[0]);
    return 2;
  }
  const int fd = open(argv[2], O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) return 3;
  const uint64_t first = std::strtoull(argv[3], nullptr, 10);
  std::mt19937_64 rng(std::strtoull(argv[4], nullptr, 10));
  if (mode == "stale") return RunStale(argv[1], fd, first, rng);
  StoreOptions options = mode == "direct"   ? crash::DirectOptions(argv[1])
                         : mode == "behind" ? crash::BehindOptions(argv[1])
                                            : crash::Options(argv[1]);
  // The checker verifies every payload when it opens; the writer skips that to write sooner.
  options.rocksdb.verify_checksums_on_open = false;
  auto store = TieredStore::Open(options);
  if (!store.ok()) {
    std::fprintf(stderr, "open: %s\n", store.status().ToString().c_str());
    return 4;
  }
  PutOptions durable;
  durable.durability = mode == "behind" ? Durability::kBehind : Durability::kDisk;
  std::vector<uint64_t> acked;
  for (uint64_t id = first;; ++id) {
    if (mode != "behind" && !acked.empty() && rng() % 5 == 0) {
      const size_t i = rng() % acked.size();
      const uint64_t victim = acked[i];
      acked.erase(acked.begin() + i);
      Log(fd, 'X', victim, false);
      if ((*store)->Delete(crash::Key(victim)).ok()) Log(fd, 'D', victim, true);
    }
    Log(fd, 'I', id, false);
    const absl::Status st = (*store)->Put(crash::Key(id), crash::Bytes(id), {}, durable);
    if (!st.ok()) {
      std::fprintf(stderr, "put %llu: %s\n", static_cast<unsigned long long>(id),
                   st.ToString().c_str());
      return 5;
    }
    Log(fd, 'A', id, true);
    acked.push_back(id);
  }
}
