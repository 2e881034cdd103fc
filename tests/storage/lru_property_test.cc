// Property tests of placement, watermarks and LRU demotion: random sequences of puts, gets,
// deletes, pins and unpins run against the store and against a small model of the documented
// rules; after every step each key's tier, pin count, and each tier's bytes and counters agree.
//
// The rules (docs/storage.md): a put into tier T first demotes T's least recently used unpinned
// entries when the new bytes would pass T's capacity, until used + new <= low watermark; a put
// that still does not fit goes to the next tier. After the put, if T is above its high
// watermark, it demotes LRU entries (never the one just put) down to the low watermark. A
// demoted entry keeps its recency and goes to the next tier (which makes room the same way), or
// is evicted from the last tier. Gets touch recency; pins take entries out of the LRU.
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "kvcomp/storage/tiered_store.h"
#include "storage_test_util.h"

namespace kvcomp {
namespace storage {
namespace {

using testing::TempDir;

struct Config {
  bool host;
  uint64_t host_cap;
  bool rocks;
  uint64_t rocks_cap;
};

class Model {
 public:
  explicit Model(const Config& c, double low, double high) : c_(c), low_(low), high_(high) {}

  struct Entry {
    int tier;
    uint64_t size;
    uint32_t pins = 0;
    uint64_t tick;
  };

  bool Put(const std::string& k, uint64_t size) {
    const int target = c_.host ? kHost : kRocks;
    MakeRoom(target, size, nullptr);
    std::optional<Entry> old;
    if (auto it = e_.find(k); it != e_.end()) old = it->second;
    int placed = -1;
    for (int t = target; t != -1; t = Lower(t)) {
      if (t != target) MakeRoom(t, size, &k);
      const uint64_t old_here = (old && old->tier == t && t == kRocks) ? old->size : 0;
      if (Used(t) - old_here + size <= Cap(t)) {
        placed = t;
        break;
      }
    }
    if (placed == -1) return false;
    Entry n{placed, size, old ? old->pins : 0, ++tick_};
    e_[k] = n;
    Relieve(placed, &k);
    return true;
  }
  bool Get(const std::string& k) {
    auto it = e_.find(k);
    if (it == e_.end()) return false;
    it->second.tick = ++tick_;
    return true;
  }
  bool Delete(const std::string& k) { return e_.erase(k) > 0; }
  bool Pin(const std::string& k) {
    auto it = e_.find(k);
    if (it == e_.end()) return false;
    ++it->second.pins;
    return true;
  }
  int Unpin(const std::string& k) {  // 0 ok, 1 not found, 2 not pinned
    auto it = e_.find(k);
    if (it == e_.end()) return 1;
    if (it->second.pins == 0) return 2;
    if (--it->second.pins == 0) Relieve(it->second.tier, nullptr);
    return 0;
  }

  const std::map<std::string, Entry>& entries() const { return e_; }
  uint64_t Used(int t) const {
    uint64_t u = 0;
    for (const auto& [k, e] : e_) u += e.tier == t ? e.size : 0;
    return u;
  }
  uint64_t demotions[3] = {0, 0, 0};
  uint64_t evictions[3] = {0, 0, 0};
  static constexpr int kHost = 1;
  static constexpr int kRocks = 2;

 private:
  uint64_t Cap(int t) const { return t == kHost ? c_.host_cap : c_.rocks_cap; }
  int Lower(int t) const { return t == kHost && c_.rocks ? kRocks : -1; }
  uint64_t Mark(int t, double f) const { return static_cast<uint64_t>(std::floor(f * Cap(t))); }
  void MakeRoom(int t, uint64_t incoming, const std::string* held) {
    if (Used(t) + incoming <= Cap(t)) return;
    const uint64_t low = Mark(t, low_);
    Demote(t, low > incoming ? low - incoming : 0, held);
  }
  void Relieve(int t, const std::string* held) {
    if (Used(t) > Mark(t, high_)) Demote(t, Mark(t, low_), held);
  }
  void Demote(int t, uint64_t target, const std::string* held) {
    while (Used(t) > target) {
      const std::string* victim = nullptr;
      uint64_t oldest = UINT64_MAX;
      for (const auto& [k, e] : e_) {
        if (e.tier != t || e.pins > 0 || (held != nullptr && k == *held)) continue;
        if (e.tick < oldest) {
          oldest = e.tick;
          victim = &k;
        }
      }
      if (victim == nullptr) return;
      const std::string v = *victim;
      Entry& ve = e_[v];
      const int l = Lower(t);
      if (l != -1) {
        MakeRoom(l, ve.size, &v);
        if (Used(l) + e_[v].size <= Cap(l)) {
          e_[v].tier = l;
          ++demotions[t];
          Relieve(l, &v);
          continue;
        }
      }
      e_.erase(v);
      ++evictions[t];
    }
  }

  Config c_;
  double low_, high_;
  uint64_t tick_ = 0;
  std::map<std::string, Entry> e_;
};

void RunRandomSequence(const Config& c, uint64_t seed, int steps) {
  TempDir dir;
  StoreOptions o;
  o.host.enabled = c.host;
  o.host.capacity_bytes = c.host_cap;
  o.rocksdb.enabled = c.rocks;
  o.rocksdb.path = dir.path();
  o.rocksdb.capacity_bytes = c.rocks_cap;
  o.default_tier = c.host ? TierKind::kHost : TierKind::kRocksDb;
  std::mt19937_64 rng(seed);
  o.low_watermark = 0.5 + 0.1 * (rng() % 4);
  o.high_watermark = o.low_watermark + 0.05 * (rng() % 5);
  o.num_shards = 1 << (rng() % 4);
  auto store_or = TieredStore::Open(o);
  ASSERT_TRUE(store_or.ok()) << store_or.status();
  TieredStore& store = **store_or;
  Model model(c, o.low_watermark, o.high_watermark);
  PutOptions raw;
  raw.validate = false;
  const int keys = 12;
  auto key = [](int i) { return CacheKey{"t", "m", "k" + std::to_string(i)}; };
  for (int step = 0; step < steps; ++step) {
    const int i = static_cast<int>(rng() % keys);
    const std::string k = key(i).Encode();
    const int op = static_cast<int>(rng() % 10);
    std::string what;
    if (op < 4) {
      const uint64_t size = 1 + rng() % (c.host ? c.host_cap / 3 : c.rocks_cap / 3);
      const bool expect = model.Put(k, size);
      const absl::Status st = store.Put(key(i), std::string(size, 'a' + i), {}, raw);
      what = "put " + std::to_string(i) + " " + std::to_string(size);
      ASSERT_EQ(st.ok(), expect) << what << " " << st;
      if (!expect) {
        ASSERT_TRUE(absl::IsResourceExhausted(st)) << st;
      }
    } else if (op < 7) {
      const bool expect = model.Get(k);
      auto got = store.Get(key(i));
      what = "get " + std::to_string(i);
      ASSERT_EQ(got.ok(), expect) << what << " " << got.status();
      if (expect) {
        ASSERT_EQ(got->payload.size(), model.entries().at(k).size);
        ASSERT_EQ(got->payload.view(), std::string(got->payload.size(), 'a' + i));
      }
    } else if (op < 8) {
      what = "delete " + std::to_string(i);
      ASSERT_EQ(store.Delete(key(i)).ok(), model.Delete(k)) << what;
    } else if (op < 9) {
      what = "pin " + std::to_string(i);
      ASSERT_EQ(store.Pin(key(i)).ok(), model.Pin(k)) << what;
    } else {
      what = "unpin " + std::to_string(i);
      const int expect = model.Unpin(k);
      const absl::Status st = store.Unpin(key(i));
      ASSERT_EQ(expect == 0, st.ok()) << what;
      if (expect == 2) {
        ASSERT_TRUE(absl::IsFailedPrecondition(st));
      }
    }
    if (getenv("LRU_TRACE")) {
      fprintf(stderr, "%d %s host=%lu |", step, what.c_str(), (unsigned long)model.Used(1));
      for (const auto& [mk, me] : model.entries())
        fprintf(stderr, " %s:t%d s%lu p%u k%lu", mk.substr(mk.size() - 2).c_str(), me.tier,
                (unsigned long)me.size, me.pins, (unsigned long)me.tick);
      fprintf(stderr, "\n");
    }
    for (int j = 0; j < keys; ++j) {
      auto look = store.Lookup(key(j));
      auto it = model.entries().find(key(j).Encode());
      ASSERT_EQ(look.ok(), it != model.entries().end())
          << "step " << step << " after " << what << ": key " << j;
      if (!look.ok()) continue;
      ASSERT_EQ(static_cast<int>(look->tier), it->second.tier) << "step " << step << " key " << j;
      ASSERT_EQ(look->pin_count, it->second.pins);
      ASSERT_EQ(look->meta.stored_bytes, it->second.size);
    }
    const StoreStats st = store.Stats();
    for (int t : {Model::kHost, Model::kRocks}) {
      if (!st.tiers[t].present) continue;
      ASSERT_EQ(st.tiers[t].bytes, model.Used(t)) << "step " << step << " tier " << t;
      ASSERT_EQ(st.tiers[t].demotions, model.demotions[t]) << "step " << step;
      ASSERT_EQ(st.tiers[t].evictions, model.evictions[t]) << "step " << step;
    }
  }
}

TEST(LruProperty, HostOnlyEvictsLeastRecentlyUsed) {
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    SCOPED_TRACE(seed);
    RunRandomSequence({true, 10000, false, 0}, seed, 300);
    if (HasFatalFailure()) return;
  }
}

TEST(LruProperty, HostDemotesToRocksDbWhichEvicts) {
  for (uint64_t seed = 100; seed <= 115; ++seed) {
    SCOPED_TRACE(seed);
    RunRandomSequence({true, 10000, true, 20000}, seed, 250);
    if (HasFatalFailure()) return;
  }
}

TEST(LruProperty, RocksDbAloneEvicts) {
  for (uint64_t seed = 200; seed <= 205; ++seed) {
    SCOPED_TRACE(seed);
    RunRandomSequence({false, 0, true, 10000}, seed, 200);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace storage
}  // namespace kvcomp
