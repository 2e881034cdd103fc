// Throughput of the storage tiers, printed one JSON object per line:
//   rocksdb mode: put and get GB/s of the RocksDB tier (RocksDbTier directly, and through
//     TieredStore, which adds the CRC32C, format check and index) for one value size, with the
//     options bench/storage/run.sh also gives db_bench.
//   host mode: put (copy in from the caller's buffer) and get (shared handle, then one read
//     pass) of the host tier next to plain memcpy of the same sizes.
//   churn mode: what durable removals cost (docs/storage.md, "Durability"): memory-durable
//     puts through host into a full RocksDB tier (each demotion sweep evicts from RocksDB, one
//     synced batch per sweep); disk-durable puts into a full RocksDB-only store (evictions on
//     top of each put's own sync); and memory-durable overwrites of disk-durable caches (the old
//     disk copy is deleted with a synced write). Reports ops/s and evictions.
// Usage: storage_bench --mode=rocksdb|host|churn --dir=DIR --value_size=BYTES --num=N --sync=0|1
//   [--only=CASE] (churn mode: one case, e.g. to count its syncs with strace)
//   [--direct_min=BYTES] (RocksDbTierOptions::direct_min_bytes; 0 = every payload through the WAL)
//   [--threads=N] (rocksdb mode: N threads put disjoint keys, as concurrent kvcompd puts do;
//     default 1) [--aligned=0|1] (rocksdb mode: the value's bytes page-aligned, as kvcompd's
//     encodings are; default 1)
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/storage/tier.h"
#include "kvcomp/storage/tiered_store.h"
#include "rocksdb_tier.h"

namespace kvcomp {
namespace storage {
namespace {

struct Args {
  std::string mode = "rocksdb";
  std::string dir = "/tmp/kvcomp_storage_bench";
  uint64_t value_size = 1 << 20;
  uint64_t num = 256;
  bool sync = false;
  std::string only;  // churn mode: run only the case of this name (empty: all)
  int64_t direct_min = -1;  // RocksDbTierOptions::direct_min_bytes; -1 = its default
  int threads = 1;          // rocksdb mode: concurrent putters
  bool aligned = true;      // rocksdb mode: the value page-aligned
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    absl::string_view s(argv[i]);
    auto value = [&](absl::string_view name) -> absl::string_view {
      return s.substr(name.size() + 3);
    };
    if (absl::StartsWith(s, "--mode="))
      a.mode = std::string(value("mode"));
    else if (absl::StartsWith(s, "--dir="))
      a.dir = std::string(value("dir"));
    else if (absl::StartsWith(s, "--value_size="))
      (void)absl::SimpleAtoi(value("value_size"), &a.value_size);
    else if (absl::StartsWith(s, "--num="))
      (void)absl::SimpleAtoi(value("num"), &a.num);
    else if (absl::StartsWith(s, "--sync="))
      a.sync = value("sync") == "1";
    else if (absl::StartsWith(s, "--only="))
      a.only = std::string(value("only"));
    else if (absl::StartsWith(s, "--direct_min="))
      (void)absl::SimpleAtoi(value("direct_min"), &a.direct_min);
    else if (absl::StartsWith(s, "--threads="))
      (void)absl::SimpleAtoi(value("threads"), &a.threads);
    else if (absl::StartsWith(s, "--aligned="))
      a.aligned = value("aligned") == "1";
    else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      std::exit(2);
    }
  }
  return a;
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Report(const Args& a, absl::string_view what, uint64_t bytes, double seconds) {
  std::printf(
      "{\"bench\":\"%s\",\"value_size\":%llu,\"num\":%llu,\"sync\":%d,"
      "\"direct_min\":%lld,\"threads\":%d,\"aligned\":%d,\"seconds\":%.4f,"
      "\"gb_per_s\":%.4f}\n",
      std::string(what).c_str(), static_cast<unsigned long long>(a.value_size),
      static_cast<unsigned long long>(a.num), a.sync ? 1 : 0,
      static_cast<long long>(a.direct_min >= 0 ? a.direct_min
                                               : RocksDbTierOptions().direct_min_bytes),
      a.threads, a.aligned ? 1 : 0, seconds, bytes / seconds / 1e9);
  std::fflush(stdout);
}

std::vector<uint64_t> Shuffled(uint64_t n, uint64_t seed) {
  std::vector<uint64_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  std::shuffle(v.begin(), v.end(), std::mt19937_64(seed));
  return v;
}

std::string KeyOf(uint64_t i) { return absl::StrFormat("%016x", i * 0x9E3779B97F4A7C15ull); }

// A value of `n` bytes that is not all one byte (RocksDB does not compress here anyway).
std::string MakeValue(uint64_t n, uint64_t seed) {
  std::string v(n, '\0');
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i + 8 <= n; i += 8) {
    const uint64_t x = rng();
    std::memcpy(v.data() + i, &x, 8);
  }
  return v;
}

// Runs put(i) for every i of `order`, spread over a.threads threads (interleaved); false when
// a put failed (its status printed).
bool PutAll(const Args& a, const std::vector<uint64_t>& order,
            const std::function<absl::Status(uint64_t)>& put) {
  std::atomic<bool> ok{true};
  auto run = [&](int t) {
    for (size_t j = static_cast<size_t>(t); j < order.size() && ok.load();
         j += static_cast<size_t>(a.threads)) {
      absl::Status st = put(order[j]);
      if (!st.ok()) {
        std::fprintf(stderr, "%s\n", st.ToString().c_str());
        ok.store(false);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 1; t < a.threads; ++t) threads.emplace_back(run, t);
  run(0);
  for (auto& th : threads) th.join();
  return ok.load();
}

// The bench's value: MakeValue's bytes, page-aligned unless --aligned=0.
Payload MakePayload(const Args& a) {
  const std::string v = MakeValue(a.value_size, 1);
  if (!a.aligned) return Payload::FromString(v);
  void* raw = nullptr;
  if (posix_memalign(&raw, 4096, std::max<uint64_t>(v.size(), 1) + 4096) != 0) std::abort();
  std::memcpy(raw, v.data(), v.size());
  std::shared_ptr<const uint8_t> bytes(static_cast<const uint8_t*>(raw),
                                       [](const uint8_t* p) { std::free(const_cast<uint8_t*>(p)); });
  return Payload(std::move(bytes), v.size());
}

RocksDbTierOptions RocksOptions(const Args& a, const std::string& path) {
  RocksDbTierOptions o;  // the defaults, which run.sh mirrors for db_bench
  o.enabled = true;
  o.path = path;
  o.capacity_bytes = 1ull << 40;
  if (a.direct_min >= 0) o.direct_min_bytes = static_cast<uint64_t>(a.direct_min);
  return o;
}

int RunRocksDb(const Args& a) {
  const Payload value = MakePayload(a);
  const uint64_t total = a.value_size * a.num;
  {
    std::system(absl::StrCat("rm -rf '", a.dir, "/tier'").c_str());
    auto tier = RocksDbTier::Open(RocksOptions(a, a.dir + "/tier"));
    if (!tier.ok()) {
      std::fprintf(stderr, "%s\n", tier.status().ToString().c_str());
      return 1;
    }
    CacheMeta meta;
    meta.stored_bytes = value.size();
    meta.crc32c = Crc32c(value.data(), value.size());
    const auto order = Shuffled(a.num, 2);
    sync();  // start with no dirty pages from earlier runs being written back
    auto t0 = std::chrono::steady_clock::now();
    if (!PutAll(a, order,
                [&](uint64_t i) { return (*tier)->Put(KeyOf(i), meta, value, a.sync); })) {
      return 1;
    }
    Report(a, "rocksdb_tier_put", total, Seconds(t0));
    const auto reads = Shuffled(a.num, 3);
    uint64_t check = 0;
    t0 = std::chrono::steady_clock::now();
    for (uint64_t i : reads) {
      auto got = (*tier)->Get(KeyOf(i));
      if (!got.ok()) return 1;
      check += got->data()[got->size() - 1];
    }
    Report(a, "rocksdb_tier_get", total, Seconds(t0));
    if (check == 1) std::fprintf(stderr, " ");
  }
  {
    // Through the store: adds CRC32C on put and get, the format check is off (raw values).
    std::system(absl::StrCat("rm -rf '", a.dir, "/store'").c_str());
    StoreOptions o;
    o.host.enabled = false;
    o.rocksdb = RocksOptions(a, a.dir + "/store");
    o.default_tier = TierKind::kRocksDb;
    auto store = TieredStore::Open(o);
    if (!store.ok()) return 1;
    PutOptions po;
    po.validate = false;
    po.durability = a.sync ? Durability::kDisk : Durability::kMemory;
    auto key = [](uint64_t i) { return CacheKey{"bench", "model", KeyOf(i)}; };
    const auto order = Shuffled(a.num, 2);
    sync();
    auto t0 = std::chrono::steady_clock::now();
    if (!PutAll(a, order, [&](uint64_t i) { return (*store)->Put(key(i), value, {}, po); })) {
      return 1;
    }
    Report(a, "store_rocksdb_put", total, Seconds(t0));
    if (a.sync) {
      // As kvcompd puts: the encoder hands over the payload's CRC32C (PutOptions::crc32c), so
      // the store does not read the bytes once more before writing them.
      PutOptions given = po;
      given.crc32c = Crc32c(value.data(), value.size());
      auto key2 = [](uint64_t i) { return CacheKey{"bench", "model2", KeyOf(i)}; };
      sync();
      t0 = std::chrono::steady_clock::now();
      if (!PutAll(a, order,
                  [&](uint64_t i) { return (*store)->Put(key2(i), value, {}, given); })) {
        return 1;
      }
      Report(a, "store_rocksdb_put_crc_given", total, Seconds(t0));
      for (uint64_t i : order) (void)(*store)->Delete(key2(i));
    }
    const auto reads = Shuffled(a.num, 3);
    t0 = std::chrono::steady_clock::now();
    for (uint64_t i : reads) {
      if (!(*store)->Get(key(i)).ok()) return 1;
    }
    Report(a, "store_rocksdb_get", total, Seconds(t0));
  }
  std::system(absl::StrCat("rm -rf '", a.dir, "/tier' '", a.dir, "/store'").c_str());
  return 0;
}

void ReportOps(const Args& a, absl::string_view what, uint64_t ops, double seconds,
               uint64_t evictions) {
  std::printf(
      "{\"bench\":\"%s\",\"value_size\":%llu,\"num\":%llu,\"seconds\":%.4f,"
      "\"ops_per_s\":%.1f,\"gb_per_s\":%.4f,\"evictions\":%llu}\n",
      std::string(what).c_str(), static_cast<unsigned long long>(a.value_size),
      static_cast<unsigned long long>(ops), seconds, ops / seconds,
      ops * a.value_size / seconds / 1e9, static_cast<unsigned long long>(evictions));
  std::fflush(stdout);
}

int RunChurn(const Args& a) {
  const std::string value = MakeValue(a.value_size, 1);
  auto key = [](uint64_t i) { return CacheKey{"bench", "model", KeyOf(i)}; };
  PutOptions memory;
  memory.validate = false;
  PutOptions disk = memory;
  disk.durability = Durability::kDisk;
  const std::string path = a.dir + "/churn";
  auto fresh = [&](bool host) {
    std::system(absl::StrCat("rm -rf '", path, "'").c_str());
    StoreOptions o;
    o.host.enabled = host;
    o.host.capacity_bytes = 32 * a.value_size;
    o.rocksdb = RocksOptions(a, path);
    o.rocksdb.capacity_bytes = 128 * a.value_size;
    if (!host) o.default_tier = TierKind::kRocksDb;
    return TieredStore::Open(o);
  };
  if (a.only.empty() || a.only == "churn_memory_puts_demote_evict") {
    // Memory-durable puts of new keys: host demotes into RocksDB, which evicts when full.
    auto store = fresh(true);
    if (!store.ok()) return 1;
    sync();
    auto t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < a.num; ++i) {
      if (!(*store)->Put(key(i), value, {}, memory).ok()) return 1;
    }
    ReportOps(a, "churn_memory_puts_demote_evict", a.num, Seconds(t0),
              (*store)->Stats().tier(TierKind::kRocksDb).evictions);
  }
  if (a.only.empty() || a.only == "churn_disk_puts_evict") {
    // Disk-durable puts into a full RocksDB-only store.
    auto store = fresh(false);
    if (!store.ok()) return 1;
    sync();
    auto t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < a.num; ++i) {
      if (!(*store)->Put(key(i), value, {}, disk).ok()) return 1;
    }
    ReportOps(a, "churn_disk_puts_evict", a.num, Seconds(t0),
              (*store)->Stats().tier(TierKind::kRocksDb).evictions);
  }
  if (a.only.empty() || a.only == "overwrite_disk_with_memory") {
    // Memory-durable overwrites of disk-durable caches (placed in host).
    auto store = fresh(true);
    if (!store.ok()) return 1;
    const uint64_t n = std::min<uint64_t>(a.num, 96);  // all fit in RocksDB: no evictions
    for (uint64_t i = 0; i < n; ++i) {
      if (!(*store)->Put(key(i), value, {}, disk).ok()) return 1;
    }
    sync();
    auto t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < n; ++i) {
      if (!(*store)->Put(key(i), value, {}, memory).ok()) return 1;
    }
    ReportOps(a, "overwrite_disk_with_memory", n, Seconds(t0),
              (*store)->Stats().tier(TierKind::kRocksDb).evictions);
  }
  if (a.only.empty() || a.only == "overwrite_disk_with_memory_4_threads") {
    // The same from 4 threads on disjoint keys: RocksDB's group commit shares the syncs.
    auto store = fresh(true);
    if (!store.ok()) return 1;
    const uint64_t n = std::min<uint64_t>(a.num, 96);
    for (uint64_t i = 0; i < n; ++i) {
      if (!(*store)->Put(key(i), value, {}, disk).ok()) return 1;
    }
    sync();
    std::atomic<int> failures{0};
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (uint64_t t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (uint64_t i = t; i < n; i += 4) {
          if (!(*store)->Put(key(i), value, {}, memory).ok()) ++failures;
        }
      });
    }
    for (auto& th : threads) th.join();
    if (failures.load() != 0) return 1;
    ReportOps(a, "overwrite_disk_with_memory_4_threads", n, Seconds(t0),
              (*store)->Stats().tier(TierKind::kRocksDb).evictions);
  }
  std::system(absl::StrCat("rm -rf '", path, "'").c_str());
  return 0;
}

// Each case runs twice and reports the second pass, so every variant copies into memory the
// allocator has already faulted in (main() keeps freed memory in the heap).
int RunHost(const Args& a) {
  const std::string src = MakeValue(a.value_size, 1);
  const uint64_t total = a.value_size * a.num;
  std::unique_ptr<uint8_t[]> out(new uint8_t[a.value_size]);
  for (int pass = 0; pass < 2; ++pass) {
    const bool report = pass == 1;
    std::vector<std::unique_ptr<uint8_t[]>> dst(a.num);
    auto t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < a.num; ++i) {
      dst[i].reset(new uint8_t[a.value_size]);
      std::memcpy(dst[i].get(), src.data(), a.value_size);
    }
    if (report) Report(a, "memcpy_new_buffer", total, Seconds(t0));
    t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < a.num; ++i) std::memcpy(out.get(), dst[i].get(), a.value_size);
    if (report) Report(a, "memcpy_out", total, Seconds(t0));
  }
  for (int pass = 0; pass < 2; ++pass) {
    const bool report = pass == 1;
    HostTierOptions ho;
    ho.capacity_bytes = total + (1 << 20);
    auto tier = NewHostTier(ho);
    if (!tier.ok()) return 1;
    CacheMeta meta;
    auto t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < a.num; ++i) {
      // Payload::Copy is the copy the store makes of a caller's string_view.
      if (!(*tier)->Put(KeyOf(i), meta, Payload::Copy(src), false).ok()) return 1;
    }
    if (report) Report(a, "host_tier_put_copy", total, Seconds(t0));
    t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < a.num; ++i) {
      auto got = (*tier)->Get(KeyOf(i));
      if (!got.ok()) return 1;
      std::memcpy(out.get(), got->data(), got->size());  // the reader consumes the bytes
    }
    if (report) Report(a, "host_tier_get_and_copy_out", total, Seconds(t0));
  }
  for (int pass = 0; pass < 2; ++pass) {
    const bool report = pass == 1;
    StoreOptions o;
    o.host.capacity_bytes = total + (1 << 20);
    o.high_watermark = o.low_watermark = 1.0;  // everything stays resident
    auto store = TieredStore::Open(o);
    if (!store.ok()) return 1;
    PutOptions po;
    po.validate = false;
    auto key = [](uint64_t i) { return CacheKey{"bench", "model", KeyOf(i)}; };
    auto t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < a.num; ++i) {
      if (!(*store)->Put(key(i), src, {}, po).ok()) return 1;
    }
    if (report) Report(a, "store_host_put", total, Seconds(t0));
    t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < a.num; ++i) {
      auto got = (*store)->Get(key(i));
      if (!got.ok()) return 1;
      std::memcpy(out.get(), got->payload.data(), got->payload.size());
    }
    if (report) Report(a, "store_host_get_and_copy_out", total, Seconds(t0));
  }
  return 0;
}

}  // namespace
}  // namespace storage
}  // namespace kvcomp

int main(int argc, char** argv) {
  // Keep freed memory in the heap, so passes after the first do not pay page faults.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, -1);
  const auto a = kvcomp::storage::Parse(argc, argv);
  if (a.mode == "rocksdb") return kvcomp::storage::RunRocksDb(a);
  if (a.mode == "host") return kvcomp::storage::RunHost(a);
  if (a.mode == "churn") return kvcomp::storage::RunChurn(a);
  std::fprintf(stderr, "unknown mode %s\n", a.mode.c_str());
  return 2;
}
