// The writer half of storage_crash_test: opens a store on disk and puts (and sometimes deletes)
// caches with disk durability until it is killed. Before each operation it appends an intent
// line to the log ("I id" / "X id"); after the store acknowledges it, an ack line ("A id" /
// "D id") that is fsynced before the next operation starts.
//   storage_crash_writer <db dir> <log file> <first id> <seed>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "crash_common.h"
#include "kvcomp/storage/tiered_store.h"

namespace {

void Log(int fd, char tag, uint64_t id, bool sync) {
  const std::string line = std::string(1, tag) + " " + std::to_string(id) + "\n";
  if (write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) std::abort();
  if (sync && fdatasync(fd) != 0) std::abort();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvcomp::storage;
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s <db dir> <log file> <first id> <seed>\n", argv[0]);
    return 2;
  }
  const int fd = open(argv[2], O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) return 3;
  const uint64_t first = std::strtoull(argv[3], nullptr, 10);
  std::mt19937_64 rng(std::strtoull(argv[4], nullptr, 10));
  StoreOptions options = crash::Options(argv[1]);
  // The checker verifies every payload when it opens; the writer skips that to write sooner.
  options.rocksdb.verify_checksums_on_open = false;
  auto store = TieredStore::Open(options);
  if (!store.ok()) {
    std::fprintf(stderr, "open: %s\n", store.status().ToString().c_str());
    return 4;
  }
  PutOptions durable;
  durable.durability = Durability::kDisk;
  std::vector<uint64_t> acked;
  for (uint64_t id = first;; ++id) {
    if (!acked.empty() && rng() % 5 == 0) {
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
