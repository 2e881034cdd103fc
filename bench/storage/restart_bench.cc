// How long a store takes to open as it grows: fills a RocksDB-only store with --num caches of
// --value_size bytes (once, with --fill), then opens it --repeat times and reports the time of
// TieredStore::Open and, with background verification, the time until every payload is checked
// (Quarantined() returns once the pass is done). Run by bench/storage/restart.sh.
//
// Usage: restart_bench --dir=DIR --num=N --value_size=BYTES [--fill] [--repeat=R]
//                      [--verify=sync|background|off]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "kvcomp/storage/tiered_store.h"

namespace kvcomp {
namespace storage {
namespace {

struct Args {
  std::string dir;
  uint64_t num = 500;
  uint64_t value_size = 96 * 1024;
  bool fill = false;
  int repeat = 3;
  std::string verify = "background";
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string p = absl::StrFormat("--%s=", name);
      return absl::StartsWith(s, p) ? argv[i] + p.size() : nullptr;
    };
    if (const char* v = value("dir")) a.dir = v;
    else if (const char* v = value("num")) a.num = std::strtoull(v, nullptr, 10);
    else if (const char* v = value("value_size")) a.value_size = std::strtoull(v, nullptr, 10);
    else if (const char* v = value("repeat")) a.repeat = std::atoi(v);
    else if (const char* v = value("verify")) a.verify = v;
    else if (s == "--fill") a.fill = true;
    else {
      std::fprintf(stderr, "unknown argument %s\n", s.c_str());
      std::exit(2);
    }
  }
  if (a.dir.empty()) {
    std::fprintf(stderr, "--dir is required\n");
    std::exit(2);
  }
  return a;
}

StoreOptions Options(const Args& a) {
  StoreOptions o;
  o.host.enabled = false;
  o.rocksdb.enabled = true;
  o.rocksdb.path = a.dir + "/rocksdb";
  o.rocksdb.capacity_bytes = 1ull << 40;
  o.default_tier = TierKind::kRocksDb;
  o.rocksdb.verify_checksums_on_open = a.verify != "off";
  o.rocksdb.verify_in_background = a.verify == "background";
  return o;
}

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int Fill(const Args& a) {
  auto store = TieredStore::Open(Options(a));
  if (!store.ok()) {
    std::fprintf(stderr, "open: %s\n", store.status().ToString().c_str());
    return 1;
  }
  std::mt19937_64 rng(1);
  std::string value(a.value_size, '\0');
  PutOptions po;
  po.validate = false;  // the payload's bytes do not matter here, only their size and count
  for (uint64_t i = 0; i < a.num; ++i) {
    for (auto& c : value) c = static_cast<char>(rng());
    CacheMeta meta;
    meta.original_bytes = 4 * a.value_size;
    absl::Status st =
        (*store)->Put(CacheKey{"bench", "model", absl::StrFormat("req-%08d", i)}, value, meta, po);
    if (!st.ok()) {
      std::fprintf(stderr, "put %llu: %s\n", static_cast<unsigned long long>(i),
                   st.ToString().c_str());
      return 1;
    }
  }
  return 0;
}

int Run(const Args& a) {
  if (a.fill) {
    if (int rc = Fill(a); rc != 0) return rc;
    // One open and close after the fill flushes the WAL, as a daemon that ran a while has.
    auto settle = TieredStore::Open(Options(a));
    if (!settle.ok()) return 1;
  }
  for (int r = 0; r < a.repeat; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    auto store = TieredStore::Open(Options(a));
    const double open_s = Since(t0);
    if (!store.ok()) {
      std::fprintf(stderr, "open: %s\n", store.status().ToString().c_str());
      return 1;
    }
    const StoreStats st = (*store)->Stats();
    (*store)->Quarantined();  // returns once every payload is checked
    const double verified_s = Since(t0);
    std::printf(
        "{\"caches\": %llu, \"value_size\": %llu, \"verify\": \"%s\", \"open_s\": %.4f, "
        "\"all_verified_s\": %.4f, \"recovered\": %llu, \"unverified_at_open\": %llu}\n",
        static_cast<unsigned long long>(a.num), static_cast<unsigned long long>(a.value_size),
        a.verify.c_str(), open_s, a.verify == "off" ? 0.0 : verified_s,
        static_cast<unsigned long long>(st.recovered),
        static_cast<unsigned long long>(st.unverified));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace storage
}  // namespace kvcomp

int main(int argc, char** argv) { return kvcomp::storage::Run(kvcomp::storage::Parse(argc, argv)); }
