#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "cuda_memory.h"
#include "kvcomp/storage/tier.h"
#include "mutex.h"

namespace kvcomp {
namespace storage {
namespace {

constexpr int kShards = 16;

class HostTier final : public Tier {
 public:
  HostTier(const HostTierOptions& options, bool pinned)
      : capacity_(options.capacity_bytes), pinned_(pinned) {}

  TierKind kind() const override { return TierKind::kHost; }
  uint64_t capacity_bytes() const override { return capacity_; }
  uint64_t used_bytes() const override { return used_.load(std::memory_order_relaxed); }
  uint64_t entries() const override { return entries_.load(std::memory_order_relaxed); }

  absl::Status Put(absl::string_view key, const CacheMeta&, const Payload& payload, bool) override {
    if (payload.on_device()) {
      return absl::InvalidArgumentError("host tier: payload in device memory");
    }
    const uint64_t n = payload.size();
    if (!Reserve(n)) {
      return absl::ResourceExhaustedError(absl::StrCat("host tier: ", n, " bytes do not fit (",
                                                       used_bytes(), " of ", capacity_, " used)"));
    }
    Payload held = payload;
    if (pinned_) {
      auto pinned = CopyToPinned(payload);
      if (!pinned.ok()) {
        used_.fetch_sub(n);
        return pinned.status();
      }
      held = *std::move(pinned);
    }
    Shard& s = ShardOf(key);
    Payload old;
    bool replaced = false;
    {
      WriterLock lock(&s.mu);
      auto [it, inserted] = s.map.try_emplace(std::string(key), held);
      if (!inserted) {
        old = std::move(it->second);
        it->second = std::move(held);
        replaced = true;
      }
    }
    if (replaced) {
      used_.fetch_sub(old.size());
    } else {
      entries_.fetch_add(1);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Payload> Get(absl::string_view key) override {
    Shard& s = ShardOf(key);
    ReaderLock lock(&s.mu);
    auto it = s.map.find(key);
    if (it == s.map.end()) return absl::NotFoundError("host tier: no such key");
    return it->second;
  }

  absl::Status Delete(absl::string_view key, bool) override {
    Shard& s = ShardOf(key);
    Payload old;
    {
      WriterLock lock(&s.mu);
      auto it = s.map.find(key);
      if (it == s.map.end()) return absl::OkStatus();
      old = std::move(it->second);
      s.map.erase(it);
    }
    used_.fetch_sub(old.size());
    entries_.fetch_sub(1);
    return absl::OkStatus();
  }

 private:
  struct Shard {
    SharedMutex mu;
    absl::flat_hash_map<std::string, Payload> map ABSL_GUARDED_BY(mu);
  };

  bool Reserve(uint64_t n) {
    uint64_t cur = used_.load(std::memory_order_relaxed);
    do {
      if (n > capacity_ || cur > capacity_ - n) return false;
    } while (!used_.compare_exchange_weak(cur, cur + n));
    return true;
  }

  static absl::StatusOr<Payload> CopyToPinned(const Payload& payload) {
    void* p = PinnedAlloc(payload.size() > 0 ? payload.size() : 1);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("host tier: cannot pin ", payload.size(), " bytes"));
    }
    if (!payload.empty()) std::memcpy(p, payload.data(), payload.size());
    std::shared_ptr<const uint8_t> data(static_cast<const uint8_t*>(p), [](const uint8_t* q) {
      PinnedFree(const_cast<uint8_t*>(q));
    });
    return Payload(std::move(data), payload.size());
  }

  Shard& ShardOf(absl::string_view key) {
    return shards_[absl::Hash<absl::string_view>()(key) % kShards];
  }

  const uint64_t capacity_;
  const bool pinned_;
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> entries_{0};
  Shard shards_[kShards];
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tier>> NewHostTier(const HostTierOptions& options) {
  if (options.capacity_bytes == 0) {
    return absl::InvalidArgumentError("host tier: capacity_bytes must be > 0");
  }
  const bool pinned = options.pinned && CudaDeviceAvailable();
  return std::unique_ptr<Tier>(new HostTier(options, pinned));
}

}  // namespace storage
}  // namespace kvcomp
