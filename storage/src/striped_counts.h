// Counters keyed by K (tenant bytes, projection references) split over stripes, each with its
// own lock, so no single lock serialises the store. Thread-safe.
#ifndef KVCOMP_STORAGE_SRC_STRIPED_COUNTS_H_
#define KVCOMP_STORAGE_SRC_STRIPED_COUNTS_H_

#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
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

}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_STORAGE_SRC_STRIPED_COUNTS_H_
