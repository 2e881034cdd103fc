// What the crash writer writes and the crash test checks: the store's options, and the key and
// bytes of cache number `id` (a pure function of id, so the checker can rebuild them).
#ifndef KVCOMP_TESTS_STORAGE_CRASH_COMMON_H_
#define KVCOMP_TESTS_STORAGE_CRASH_COMMON_H_

#include <cstdint>
#include <string>

#include "common/random_cache.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/core/format.h"
#include "kvcomp/storage/options.h"

namespace kvcomp {
namespace storage {
namespace crash {

inline StoreOptions Options(const std::string& path) {
  StoreOptions o;
  o.host.capacity_bytes = 4 << 20;  // small: some caches live only on disk
  o.rocksdb.enabled = true;
  o.rocksdb.path = path;
  o.rocksdb.capacity_bytes = 1ull << 32;
  o.rocksdb.write_buffer_bytes = 1 << 20;  // small memtables: flushes happen during the test
  return o;
}

// The writer's "direct" mode: the large caches (hundreds of KiB) are direct files.
inline StoreOptions DirectOptions(const std::string& path) {
  StoreOptions o = Options(path);
  o.rocksdb.direct_min_bytes = 64 << 10;
  return o;
}

// The writer's "behind" mode: puts are Durability::kBehind with a small loss window, so the
// window fills and some puts are written through.
inline constexpr uint64_t kBehindWindow = 512 << 10;
inline StoreOptions BehindOptions(const std::string& path) {
  StoreOptions o = Options(path);
  o.behind_max_bytes = kBehindWindow;
  return o;
}

inline CacheKey Key(uint64_t id) {
  return CacheKey{"t" + std::to_string(id % 3), "model", "cache-" + std::to_string(id)};
}

// Every seventh cache is large (hundreds of KiB, a blob file); the rest are a few KiB.
inline std::string Bytes(uint64_t id) {
  kvcomp::testing::RandomCacheOptions o;
  o.original_tokens = id % 7 == 0 ? 600 : 20 + id % 50;
  return *format::EncodeCache(kvcomp::testing::RandomCache(o, id));
}

// --- "stale" mode: overwrites, deletes and evictions of disk-durable caches under power loss ---
// A small store on `slots` keys, so values are overwritten (with disk or memory durability),
// deleted, demoted and evicted from RocksDB all the time. Version `v` of a slot holds
// StaleBytes(v) (a few KiB; every eleventh up to about 60 KiB).
inline constexpr uint64_t kStaleSlots = 32;

inline StoreOptions StaleOptions(const std::string& path) {
  StoreOptions o;
  o.host.capacity_bytes = 48 << 10;
  o.rocksdb.enabled = true;
  o.rocksdb.path = path;
  o.rocksdb.capacity_bytes = 160 << 10;  // about half of what the slots hold: evictions
  o.rocksdb.write_buffer_bytes = 1 << 20;
  return o;
}

inline CacheKey StaleKey(uint64_t slot) {
  return CacheKey{"s" + std::to_string(slot % 3), "model", "slot-" + std::to_string(slot)};
}

inline std::string StaleBytes(uint64_t version) {
  kvcomp::testing::RandomCacheOptions o;
  o.original_tokens = version % 11 == 0 ? 64 : 4 + version % 12;
  o.moments = false;
  return *format::EncodeCache(kvcomp::testing::RandomCache(o, version));
}

}  // namespace crash
}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_STORAGE_CRASH_COMMON_H_
