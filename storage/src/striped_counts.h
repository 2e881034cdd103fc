// Counters keyed by K (tenant bytes, projection references) split over stripes, each with its
// own lock, so no single lock serialises the store. Thread-safe.
#ifndef KVCOMP_STORAGE_SRC_STRIPED_COUNTS_H_
#define KVCOMP_STORAGE_SRC_STRIPED_COUNTS_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "kvcomp/storage/types.h"
#include "mutex.h"

namespace kvcomp {
namespace storage {

template <typename K>
class StripedCounts {
 public:
  // Adds `delta` unless the result would pass `limit` (0 = no limit); true when added. A
  // negative delta is always applied. Counts that reach zero are dropped.
  bool TryAdd(const K& key, int64_t delta, uint64_t limit = 0) {
    Stripe& s = StripeOf(key);
    WriterLock lock(&s.mu);
    int64_t& v = s.counts[key];
    if (delta > 0 && limit > 0 && static_cast<uint64_t>(v + delta) > limit) {
      if (v == 0) s.counts.erase(key);
      return false;
    }
    v += delta;
    if (v <= 0) s.counts.erase(key);
    return true;
  }
  void Add(const K& key, int64_t delta) { TryAdd(key, delta, 0); }
  uint64_t Get(const K& key) const {
    const Stripe& s = StripeOf(key);
    ReaderLock lock(&s.mu);
    auto it = s.counts.find(key);
    return it == s.counts.end() ? 0 : static_cast<uint64_t>(it->second);
  }

 private:
  static constexpr int kStripes = 16;
  struct Stripe {
    mutable SharedMutex mu;
    absl::flat_hash_map<K, int64_t> counts ABSL_GUARDED_BY(mu);
  };
  Stripe& StripeOf(const K& key) { return stripes_[absl::Hash<K>()(key) % kStripes]; }
  const Stripe& StripeOf(const K& key) const { return stripes_[absl::Hash<K>()(key) % kStripes]; }
  Stripe stripes_[kStripes];
};

// Per-tenant totals (caches, stored and original bytes) split over stripes like StripedCounts.
// Thread-safe.
class TenantUsageTable {
 public:
  // Adds (sign +1) or removes (sign -1) one cache of `stored` and `original` bytes.
  void Add(const std::string& tenant, int sign, uint64_t stored, uint64_t original) {
    Stripe& s = stripes_[absl::Hash<std::string>()(tenant) % kStripes];
    WriterLock lock(&s.mu);
    Totals& t = s.totals[tenant];
    t.caches += sign;
    t.stored += sign * static_cast<int64_t>(stored);
    t.original += sign * static_cast<int64_t>(original);
    if (t.caches <= 0) s.totals.erase(tenant);
  }
  // Every tenant with at least one cache, sorted by tenant.
  std::vector<TenantUsage> Snapshot() const {
    std::vector<TenantUsage> out;
    for (const Stripe& s : stripes_) {
      ReaderLock lock(&s.mu);
      for (const auto& [tenant, t] : s.totals) {
        out.push_back({tenant, static_cast<uint64_t>(t.caches), static_cast<uint64_t>(t.stored),
                       static_cast<uint64_t>(t.original)});
      }
    }
    std::sort(out.begin(), out.end(),
              [](const TenantUsage& a, const TenantUsage& b) { return a.tenant < b.tenant; });
    return out;
  }

 private:
  static constexpr int kStripes = 16;
  struct Totals {
    int64_t caches = 0, stored = 0, original = 0;
  };
  struct Stripe {
    mutable SharedMutex mu;
    absl::flat_hash_map<std::string, Totals> totals ABSL_GUARDED_BY(mu);
  };
  Stripe stripes_[kStripes];
};

}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_STORAGE_SRC_STRIPED_COUNTS_H_
