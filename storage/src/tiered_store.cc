#include "kvcomp/storage/tiered_store.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cuda_memory.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/storage/tier.h"
#include "mutex.h"
#include "rocksdb_tier.h"
#include "striped_counts.h"

namespace kvcomp {
namespace storage {
namespace {

constexpr int kKeyStripes = 1024;
constexpr size_t kEvictBatch = 256;  // most keys one synced eviction write removes
constexpr int kNoTier = -1;
constexpr int kRocks = static_cast<int>(TierKind::kRocksDb);

// "<key>: <reason>" for the log line of a quarantined cache (StoreStats::last_quarantined); a
// key that does not decode is shown escaped, cut at 64 bytes.
std::string DescribeQuarantined(absl::string_view ek, absl::string_view reason) {
  auto key = CacheKey::Decode(ek);
  return absl::StrCat(key.ok() ? key->DebugString() : absl::CHexEscape(ek.substr(0, 64)), ": ",
                      reason);
}

// The index record of one cache. meta.tier is the fastest tier holding it; while unpinned the
// entry sits in that tier's LRU map of its shard under `tick`.
struct Entry {
  std::string tenant;
  std::string model;
  CacheMeta meta;
  bool persisted = false;  // a copy is in RocksDB
  uint32_t pins = 0;
  uint64_t tick = 0;  // last access (store-wide counter)
  bool unverified = false;  // recovered; payload not checked yet (background verification)
};

struct Shard {
  SharedMutex mu;
  absl::flat_hash_map<std::string, Entry> map ABSL_GUARDED_BY(mu);
  std::map<uint64_t, std::string> lru[kNumTiers] ABSL_GUARDED_BY(mu);  // tick -> key, oldest 1st
};

struct TierCounters {
  std::atomic<uint64_t> hits{0}, misses{0}, puts{0}, demotions{0}, promotions{0}, evictions{0};
};

using ProjectionRef = std::pair<std::string, uint64_t>;  // (model, version)

int TierIndex(TierKind k) { return static_cast<int>(k); }

// A failure of the disk or device underneath (counted in StoreStats::write_errors), as opposed
// to a full tier or a quota, which are ResourceExhausted without the kDiskFull detail.
bool IsDiskError(const absl::Status& s) {
  if (absl::IsResourceExhausted(s)) return DetailOf(s) == ErrorDetail::kDiskFull;
  return absl::IsUnavailable(s) || absl::IsDataLoss(s) || absl::IsInternal(s);
}

class TieredStoreImpl final : public TieredStore {
 public:
  explicit TieredStoreImpl(const StoreOptions& options) : options_(options) {
    int n = 1;
    while (n < std::max(1, std::min(options.num_shards, 4096))) n <<= 1;
    shards_.reserve(n);
    for (int i = 0; i < n; ++i) shards_.push_back(std::make_unique<Shard>());
    key_stripes_ = std::make_unique<SharedMutex[]>(kKeyStripes);
  }

  ~TieredStoreImpl() override {
    if (rocks_ != nullptr) rocks_->StopRepairs();  // its handler uses the index
    {
      // The persister drains its queue first: a clean close loses no kBehind put.
      std::lock_guard<std::mutex> lock(behind_mu_);
      stop_behind_ = true;
    }
    behind_cv_.notify_all();
    if (persister_.joinable()) persister_.join();
    stop_verifying_ = true;
    if (verifier_.joinable()) verifier_.join();
  }

  absl::Status Init();

  absl::Status Put(const CacheKey& key, Payload encoded, const CacheMeta& meta,
                   const PutOptions& options) override;
  absl::StatusOr<StoredCache> Get(const CacheKey& key) override;
  absl::StatusOr<CacheMeta> GetInto(const CacheKey& key, const DeviceTarget& target,
                                    DeviceCopies* copies) override;
  absl::StatusOr<LookupResult> Lookup(const CacheKey& key) override;
  absl::Status Delete(const CacheKey& key) override;
  absl::StatusOr<std::vector<ListedCache>> List(absl::string_view tenant) override;
  absl::Status Pin(const CacheKey& key) override;
  absl::Status Unpin(const CacheKey& key) override;
  uint64_t ExpireNow() override;
  StoreStats Stats() const override;
  std::vector<TenantUsage> Usage() const override { return usage_.Snapshot(); }
  std::vector<QuarantinedCache> Quarantined() const override;
  absl::Status PurgeQuarantined(absl::string_view encoded_key) override;
  absl::StatusOr<uint64_t> PurgeAllQuarantined() override;
  void FlushBehind() override;

  absl::Status PutCalibration(absl::string_view key, absl::string_view bytes) override;
  absl::StatusOr<std::string> GetCalibration(absl::string_view key) override;
  absl::StatusOr<std::vector<std::string>> ListCalibration(absl::string_view prefix) override;
  absl::Status DeleteCalibration(absl::string_view key) override;
  uint64_t ProjectionReferences(absl::string_view model_id, uint64_t version) const override;

 private:
  int64_t NowMs() const {
    return absl::ToUnixMillis(options_.clock ? options_.clock() : absl::Now());
  }
  static bool Expired(const Entry& e, int64_t now_ms) {
    return e.meta.ttl_ms > 0 && e.pins == 0 && now_ms >= e.meta.created_unix_ms + e.meta.ttl_ms;
  }
  Shard& ShardOf(absl::string_view ek) {
    return *shards_[absl::Hash<absl::string_view>()(ek) & (shards_.size() - 1)];
  }
  static int StripeIndex(absl::string_view ek) {
    // A different hash from the shard's, so a stripe spans shards.
    return static_cast<int>(absl::Hash<std::pair<absl::string_view, int>>()({ek, 7}) % kKeyStripes);
  }
  SharedMutex& Stripe(int i) { return key_stripes_[i]; }
  int NextLower(int t) const {
    for (int l = t + 1; l < kNumTiers; ++l) {
      if (tiers_[l] != nullptr) return l;
    }
    return kNoTier;
  }
  uint64_t QuotaOf(absl::string_view tenant) const {
    auto it = options_.tenant_quota_bytes.find(tenant);
    return it != options_.tenant_quota_bytes.end() ? it->second
                                                   : options_.default_tenant_quota_bytes;
  }
  uint64_t Watermark(int t, double fraction) const {
    return static_cast<uint64_t>(std::floor(fraction * tiers_[t]->capacity_bytes()));
  }
  uint64_t SyncFor(int t, Durability d) const {
    return t == kRocks && (d == Durability::kDisk || d == Durability::kBehind ||
                           options_.rocksdb.sync_memory_durability_puts);
  }

  // Demotes from tier t until used + incoming <= low watermark, when used + incoming passes the
  // capacity (room for a put) or, with incoming 0, when used passes the high watermark.
  // Keys whose stripes the calling thread holds (at most two: a put's key and a victim being
  // moved). Demotion never picks them, and moves other keys of those stripes without locking.
  struct Held {
    const std::string* keys[2] = {nullptr, nullptr};
    bool Contains(const std::string& k) const {
      return (keys[0] != nullptr && *keys[0] == k) || (keys[1] != nullptr && *keys[1] == k);
    }
    bool HoldsStripe(int stripe) const {
      return (keys[0] != nullptr && StripeIndex(*keys[0]) == stripe) ||
             (keys[1] != nullptr && StripeIndex(*keys[1]) == stripe);
    }
    Held With(const std::string* k) const {
      Held h = *this;
      h.keys[h.keys[0] == nullptr ? 0 : 1] = k;
      return h;
    }
  };
  void MakeRoom(int t, uint64_t incoming, const Held& held);
  void RelieveIfAboveHigh(int t, const Held& held);
  void Demote(int t, uint64_t target_bytes, const Held& held);
  // Demote for the RocksDB tier (the last): evicts LRU entries with their removal from RocksDB
  // synced, up to kEvictBatch keys per write, so a sweep costs one WAL sync, not one per entry.
  void EvictFromDisk(uint64_t target_bytes, const Held& held);
  // Moves `ek` from tier t to the next tier that takes it, or evicts it. The key's stripe is
  // held. False when the entry is no longer a candidate (gone, moved, pinned).
  bool MoveDown(int t, const std::string& ek, const Held& held);
  void Promote(const std::string& ek, const CacheMeta& meta, const Payload& payload);
  // Removes `ek` from the index and its accounting; returns the removed entry. The key's stripe
  // is held.
  bool RemoveFromIndex(const std::string& ek, Entry* removed);
  void Unaccount(const Entry& e);
  absl::Status DeleteLocked(const std::string& ek, bool only_if_expired, bool* deleted);
  absl::Status QuarantineOnRead(const std::string& ek, const CacheMeta& meta,
                                absl::string_view reason);
  // QuarantineOnRead with the key's stripe held. False when the entry changed meanwhile.
  bool QuarantineLocked(const std::string& ek, const CacheMeta& meta, absl::string_view reason);
  // The background verification pass over the recovered entries (verify_in_background).
  void VerifyRecovered(std::vector<std::string> keys);
  void WaitVerified() const;
  void TouchLocked(Shard& s, const std::string& ek, Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);

  // The present tier closest to t: t itself, else the next one down, else the next one up.
  int PresentTierNear(int t) const {
    if (tiers_[t] != nullptr) return t;
    const int lower = NextLower(t);
    if (lower != kNoTier) return lower;
    for (int u = t - 1; u >= 0; --u) {
      if (tiers_[u] != nullptr) return u;
    }
    return kNoTier;
  }

  const StoreOptions options_;
  std::unique_ptr<Tier> tiers_[kNumTiers];
  std::string tier_errors_[kNumTiers];  // why an enabled tier did not start
  int default_tier_ = 0;
  bool promote_ = false;
  RocksDbTier* rocks_ = nullptr;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::unique_ptr<SharedMutex[]> key_stripes_;
  SharedMutex demote_mu_[kNumTiers];
  std::atomic<uint64_t> tick_{0};
  TierCounters counters_[kNumTiers];
  std::atomic<uint64_t> expired_{0}, quarantined_{0}, quota_rejections_{0}, write_errors_{0},
      recovered_{0}, unverified_{0};
  std::thread verifier_;
  std::atomic<bool> stop_verifying_{false};
  // Durability::kBehind: puts acknowledged in a memory tier, queued for the persister thread,
  // which writes each to RocksDB (synced) in order. behind_bytes_ counts the queued bytes plus
  // those reserved by puts in progress (bounded by StoreOptions::behind_max_bytes).
  struct BehindItem {
    std::string ek;
    int64_t created_ms = 0;
    uint32_t crc32c = 0;
    uint64_t bytes = 0;
  };
  void PersistBehind();
  void PersistOne(const BehindItem& item);
  std::thread persister_;
  mutable std::mutex behind_mu_;
  std::condition_variable behind_cv_;
  std::deque<BehindItem> behind_;  // guarded by behind_mu_
  uint64_t behind_bytes_ = 0;      // guarded by behind_mu_
  uint64_t behind_busy_ = 0;       // guarded by behind_mu_: items being written now
  bool stop_behind_ = false;       // guarded by behind_mu_
  std::atomic<uint64_t> behind_failed_{0};
  mutable std::mutex verified_mu_;
  mutable std::condition_variable verified_cv_;
  bool verified_ = true;  // guarded by verified_mu_: the background pass is done (or none)
  mutable SharedMutex quarantine_mu_;
  std::vector<QuarantinedCache> quarantine_ ABSL_GUARDED_BY(quarantine_mu_);
  std::string last_quarantined_ ABSL_GUARDED_BY(quarantine_mu_);  // StoreStats::last_quarantined
  StripedCounts<std::string> tenant_bytes_;  // quota accounting (reserved before placement)
  TenantUsageTable usage_;                   // Usage(): entries in the index
  StripedCounts<ProjectionRef> projection_refs_;
};

absl::Status ValidateOptions(const StoreOptions& o) {
  if (!o.device.enabled && !o.host.enabled && !o.rocksdb.enabled) {
    return absl::InvalidArgumentError("store: no tier is enabled");
  }
  if (!(o.low_watermark > 0 && o.low_watermark <= o.high_watermark && o.high_watermark <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("store: watermarks must satisfy 0 < low <= high <= 1, got low ",
                     o.low_watermark, " high ", o.high_watermark));
  }
  auto enabled = [&](TierKind k) {
    switch (k) {
      case TierKind::kDevice:
        return o.device.enabled;
      case TierKind::kHost:
        return o.host.enabled;
      case TierKind::kRocksDb:
        return o.rocksdb.enabled;
    }
    return false;
  };
  if (static_cast<int>(o.default_tier) >= kNumTiers || !enabled(o.default_tier)) {
    return absl::InvalidArgumentError(
        absl::StrCat("store: default_tier ", TierName(o.default_tier), " is not enabled"));
  }
  if (o.promote_on_read && (static_cast<int>(o.promote_to) >= kNumTiers || !enabled(o.promote_to) ||
                            o.promote_to == TierKind::kRocksDb)) {
    return absl::InvalidArgumentError(absl::StrCat("store: promote_to ", TierName(o.promote_to),
                                                   " must be an enabled memory tier"));
  }
  if (o.num_shards < 1) return absl::InvalidArgumentError("store: num_shards must be >= 1");
  if (o.rocksdb.enabled && o.rocksdb.path.empty()) {
    return absl::InvalidArgumentError("store: rocksdb.path is empty");
  }
  if ((o.device.enabled && o.device.capacity_bytes == 0) ||
      (o.host.enabled && o.host.capacity_bytes == 0) ||
      (o.rocksdb.enabled && o.rocksdb.capacity_bytes == 0)) {
    return absl::InvalidArgumentError("store: an enabled tier has capacity_bytes 0");
  }
  const uint64_t a = o.device.alignment_bytes;
  if (o.device.enabled && (a == 0 || (a & (a - 1)) != 0)) {
    return absl::InvalidArgumentError("store: device.alignment_bytes must be a power of two");
  }
  return absl::OkStatus();
}

absl::Status TieredStoreImpl::Init() {
  absl::Status first_error;
  // A tier that fails to start is left out (and reported) when the options allow it.
  auto failed = [&](int t, const absl::Status& st) {
    if (first_error.ok()) first_error = st;
    tier_errors_[t] = st.ToString();
    return !options_.open_without_failed_tiers;
  };
  if (options_.device.enabled) {
    auto tier = NewDeviceTier(options_.device);
    if (tier.ok()) {
      tiers_[TierIndex(TierKind::kDevice)] = *std::move(tier);
    } else if (failed(TierIndex(TierKind::kDevice), tier.status())) {
      return tier.status();
    }
  }
  if (options_.host.enabled) {
    KVCOMP_ASSIGN_OR_RETURN(tiers_[TierIndex(TierKind::kHost)], NewHostTier(options_.host));
  }
  if (options_.rocksdb.enabled) {
    auto rocks = RocksDbTier::Open(options_.rocksdb);
    if (rocks.ok()) {
      rocks_ = rocks->get();
      tiers_[kRocks] = *std::move(rocks);
    } else if (failed(kRocks, rocks.status())) {
      return rocks.status();
    }
  }
  int present = 0;
  for (const auto& t : tiers_) present += t != nullptr;
  if (present == 0) return first_error;
  default_tier_ = PresentTierNear(TierIndex(options_.default_tier));
  promote_ = options_.promote_on_read && tiers_[TierIndex(options_.promote_to)] != nullptr;
  if (rocks_ == nullptr) return absl::OkStatus();

  struct Found {
    std::string ek;
    CacheKey key;
    CacheMeta meta;
  };
  std::vector<Found> found;
  std::vector<std::string> undecodable;
  std::vector<QuarantinedCache> quarantined;
  const bool background =
      options_.rocksdb.verify_checksums_on_open && options_.rocksdb.verify_in_background;
  KVCOMP_RETURN_IF_ERROR(rocks_->Recover(
      options_.rocksdb.verify_checksums_on_open && !background,
      [&](absl::string_view ek, const CacheMeta& meta) {
        auto key = CacheKey::Decode(ek);
        if (!key.ok()) {
          undecodable.emplace_back(ek);
          return;
        }
        found.push_back({std::string(ek), *std::move(key), meta});
      },
      &quarantined));
  // Read-only (disk full at Open): nothing can be moved or deleted now; entries that would be
  // are left out of the index, and the first open with room moves them.
  const bool read_only = rocks_->read_only();
  for (const auto& ek : undecodable) {
    if (!read_only) KVCOMP_RETURN_IF_ERROR(rocks_->Quarantine(ek, "key does not decode"));
  }
  quarantined_ += quarantined.size() + undecodable.size();
  KVCOMP_ASSIGN_OR_RETURN(std::vector<QuarantinedCache> all, rocks_->ListQuarantine());
  {
    WriterLock lock(&quarantine_mu_);
    quarantine_ = std::move(all);
    if (!undecodable.empty()) {
      last_quarantined_ = DescribeQuarantined(undecodable.back(), "key does not decode");
    } else if (!quarantined.empty()) {
      last_quarantined_ = DescribeQuarantined(quarantined.back().encoded_key,
                                              quarantined.back().reason);
    }
  }
  // Older caches are less recently used: LRU order after a restart follows creation time.
  std::stable_sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return a.meta.created_unix_ms < b.meta.created_unix_ms;
  });
  const int64_t now = NowMs();
  std::vector<std::string> expired;
  std::vector<std::string> to_verify;
  if (background) to_verify.reserve(found.size());
  for (auto& f : found) {
    Entry e;
    e.unverified = background;
    e.tenant = f.key.tenant.empty() ? "default" : f.key.tenant;
    e.model = f.key.model_id;
    e.meta = f.meta;
    e.meta.tier = TierKind::kRocksDb;
    e.persisted = true;
    if (Expired(e, now)) {
      expired.push_back(f.ek);
      continue;
    }
    tenant_bytes_.Add(e.tenant, static_cast<int64_t>(e.meta.stored_bytes));
    usage_.Add(e.tenant, +1, e.meta.stored_bytes, e.meta.original_bytes);
    if (e.meta.projection_version != 0)
      projection_refs_.Add({e.model, e.meta.projection_version}, 1);
    Shard& s = ShardOf(f.ek);
    WriterLock lock(&s.mu);
    e.tick = ++tick_;
    s.lru[kRocks][e.tick] = f.ek;
    s.map[f.ek] = std::move(e);
    recovered_ += 1;
    if (background) to_verify.push_back(f.ek);
  }
  // Synced: an expired entry must not come back, even expired, under a newer value of its key.
  if (!read_only) {
    KVCOMP_RETURN_IF_ERROR(rocks_->DeleteMany(expired, /*sync=*/true));
    expired_ += expired.size();
  }
  // Damage met by RocksDB's compactions: each damaged cache leaves the index and goes to the
  // quarantine (if it is still the version that was read), so puts go on.
  if (!read_only) {
    rocks_->EnableRepairs([this](const std::string& ek, const CacheMeta& meta,
                                 absl::string_view reason) {
      WriterLock stripe(&Stripe(StripeIndex(ek)));
      return QuarantineLocked(ek, meta, reason);
    });
  }
  if (rocks_ != nullptr) persister_ = std::thread([this] { PersistBehind(); });
  if (!to_verify.empty()) {
    unverified_ = to_verify.size();
    verified_ = false;
    verifier_ = std::thread([this, keys = std::move(to_verify)]() mutable {
      VerifyRecovered(std::move(keys));
    });
  }
  return absl::OkStatus();
}

void TieredStoreImpl::VerifyRecovered(std::vector<std::string> keys) {
  for (const std::string& ek : keys) {
    if (stop_verifying_.load()) break;
    // The stripe keeps puts, deletes and quarantines of this key out while its bytes are read.
    WriterLock stripe(&Stripe(StripeIndex(ek)));
    CacheMeta meta;
    {
      Shard& s = ShardOf(ek);
      ReaderLock lock(&s.mu);
      auto it = s.map.find(ek);
      if (it == s.map.end() || !it->second.unverified) continue;  // gone, replaced or checked
      meta = it->second.meta;
    }
    auto payload = rocks_->Get(ek);
    std::string reason;
    if (!payload.ok()) {
      reason = absl::StrCat("payload unreadable: ", payload.status().ToString());
    } else if (payload->size() != meta.stored_bytes ||
               Crc32c(payload->data(), payload->size()) != meta.crc32c) {
      reason = "payload checksum mismatch";
    }
    if (!reason.empty() && QuarantineLocked(ek, meta, reason)) continue;
    Shard& s = ShardOf(ek);
    WriterLock lock(&s.mu);
    auto it = s.map.find(ek);
    if (it != s.map.end() && it->second.unverified) {
      it->second.unverified = false;
      unverified_ -= 1;
    }
  }
  std::lock_guard<std::mutex> lock(verified_mu_);
  verified_ = true;
  verified_cv_.notify_all();
}

void TieredStoreImpl::WaitVerified() const {
  std::unique_lock<std::mutex> lock(verified_mu_);
  verified_cv_.wait(lock, [this] { return verified_; });
}

void TieredStoreImpl::TouchLocked(Shard& s, const std::string& ek, Entry& e) {
  const int t = TierIndex(e.meta.tier);
  if (e.pins == 0) s.lru[t].erase(e.tick);
  e.tick = ++tick_;
  if (e.pins == 0) s.lru[t][e.tick] = ek;
}

void TieredStoreImpl::MakeRoom(int t, uint64_t incoming, const Held& held) {
  const uint64_t cap = tiers_[t]->capacity_bytes();
  if (tiers_[t]->used_bytes() + incoming <= cap) return;
  const uint64_t low = Watermark(t, options_.low_watermark);
  Demote(t, low > incoming ? low - incoming : 0, held);
}

void TieredStoreImpl::RelieveIfAboveHigh(int t, const Held& held) {
  if (tiers_[t] == nullptr) return;
  if (tiers_[t]->used_bytes() <= Watermark(t, options_.high_watermark)) return;
  Demote(t, Watermark(t, options_.low_watermark), held);
}

void TieredStoreImpl::Demote(int t, uint64_t target_bytes, const Held& held) {
  WriterLock demoting(&demote_mu_[t]);
  if (t == kRocks) {
    EvictFromDisk(target_bytes, held);
    return;
  }
  absl::flat_hash_set<std::string> skipped;
  while (tiers_[t]->used_bytes() > target_bytes) {
    // The least recently used unpinned entry of the tier: the oldest head of the shards' LRUs.
    std::string victim;
    uint64_t oldest = UINT64_MAX;
    for (auto& shard : shards_) {
      ReaderLock lock(&shard->mu);
      for (const auto& [tick, ek] : shard->lru[t]) {
        if (skipped.contains(ek)) continue;
        if (tick < oldest) {
          oldest = tick;
          victim = ek;
        }
        break;
      }
    }
    if (oldest == UINT64_MAX) return;  // everything left is pinned or busy
    if (held.Contains(victim)) {
      skipped.insert(victim);
      continue;
    }
    const int stripe = StripeIndex(victim);
    const bool lock_here = !held.HoldsStripe(stripe);
    // Try-lock only: a thread holding this stripe may be waiting for this demotion.
    if (lock_here && !Stripe(stripe).TryLock()) {
      skipped.insert(victim);
      continue;
    }
    const bool moved = MoveDown(t, victim, held.With(&victim));
    if (lock_here) Stripe(stripe).Unlock();
    if (!moved) skipped.insert(victim);
  }
}

void TieredStoreImpl::EvictFromDisk(uint64_t target_bytes, const Held& held) {
  absl::flat_hash_set<std::string> skipped;
  std::vector<int> locked;  // stripes this call holds (try-locked), released at the end
  std::vector<std::string> victims;
  uint64_t freeing = 0;
  // Removes the victims from RocksDB in one synced write, then from the index. On a write error
  // nothing is evicted (the entries stay whole and visible) and the sweep stops.
  auto flush = [&]() {
    if (victims.empty()) return true;
    absl::Status st = rocks_->DeleteMany(victims, /*sync=*/true);
    if (!st.ok()) {
      if (IsDiskError(st)) write_errors_ += 1;
      victims.clear();
      return false;
    }
    for (const std::string& ek : victims) {
      Entry removed;
      if (RemoveFromIndex(ek, &removed)) counters_[kRocks].evictions += 1;
    }
    victims.clear();
    freeing = 0;
    return true;
  };
  bool ok = true;
  while (ok && tiers_[kRocks]->used_bytes() > target_bytes + freeing) {
    std::string victim;
    uint64_t oldest = UINT64_MAX;
    for (auto& shard : shards_) {
      ReaderLock lock(&shard->mu);
      for (const auto& [tick, ek] : shard->lru[kRocks]) {
        if (skipped.contains(ek)) continue;
        if (tick < oldest) {
          oldest = tick;
          victim = ek;
        }
        break;
      }
    }
    if (oldest == UINT64_MAX) break;  // everything left is pinned, busy or already chosen
    skipped.insert(victim);
    if (held.Contains(victim)) continue;
    const int stripe = StripeIndex(victim);
    const bool have =
        held.HoldsStripe(stripe) || std::find(locked.begin(), locked.end(), stripe) != locked.end();
    // Try-lock only: a thread holding this stripe may be waiting for this demotion.
    if (!have) {
      if (!Stripe(stripe).TryLock()) continue;
      locked.push_back(stripe);
    }
    uint64_t size = 0;
    {
      Shard& s = ShardOf(victim);
      ReaderLock lock(&s.mu);
      auto it = s.map.find(victim);
      if (it == s.map.end() || it->second.meta.tier != TierKind::kRocksDb || it->second.pins > 0) {
        continue;
      }
      size = it->second.meta.stored_bytes;
    }
    victims.push_back(victim);
    freeing += size;
    if (victims.size() >= kEvictBatch) ok = flush();
  }
  if (ok) flush();
  for (int stripe : locked) Stripe(stripe).Unlock();
}

bool TieredStoreImpl::MoveDown(int t, const std::string& ek, const Held& held) {
  Entry e;
  {
    Shard& s = ShardOf(ek);
    ReaderLock lock(&s.mu);
    auto it = s.map.find(ek);
    if (it == s.map.end() || TierIndex(it->second.meta.tier) != t || it->second.pins > 0) {
      return false;
    }
    e = it->second;
  }
  int dest = kNoTier;
  Payload payload;
  for (int l = NextLower(t); l != kNoTier; l = NextLower(l)) {
    if (l == kRocks && e.persisted) {
      dest = l;
      break;
    }
    if (payload.empty() && e.meta.stored_bytes > 0) {
      auto p = tiers_[t]->Get(ek);
      if (!p.ok()) break;
      payload = *std::move(p);
    }
    MakeRoom(l, payload.size(), held);
    absl::Status st = tiers_[l]->Put(ek, e.meta, payload, SyncFor(l, Durability::kMemory));
    if (st.ok()) {
      dest = l;
      counters_[l].puts += 1;
      break;
    }
    if (l == kRocks && IsDiskError(st)) write_errors_ += 1;
  }
  Shard& s = ShardOf(ek);
  if (dest != kNoTier) {
    {
      WriterLock lock(&s.mu);
      auto it = s.map.find(ek);
      if (it != s.map.end()) {
        Entry& cur = it->second;
        s.lru[t].erase(cur.tick);
        cur.meta.tier = static_cast<TierKind>(dest);
        cur.persisted = cur.persisted || dest == kRocks;
        if (cur.pins == 0) s.lru[dest][cur.tick] = ek;
      }
    }
    tiers_[t]->Delete(ek, false).IgnoreError();
    counters_[t].demotions += 1;
    RelieveIfAboveHigh(dest, held);
    return true;
  }
  // Evicted. A copy in RocksDB goes first, durably, so it cannot come back after a crash.
  if (e.persisted && !rocks_->Delete(ek, /*sync=*/true).ok()) return false;
  Entry removed;
  if (!RemoveFromIndex(ek, &removed)) return false;
  tiers_[t]->Delete(ek, false).IgnoreError();
  counters_[t].evictions += 1;
  return true;
}

bool TieredStoreImpl::RemoveFromIndex(const std::string& ek, Entry* removed) {
  Shard& s = ShardOf(ek);
  {
    WriterLock lock(&s.mu);
    auto it = s.map.find(ek);
    if (it == s.map.end()) return false;
    *removed = std::move(it->second);
    if (removed->pins == 0) s.lru[TierIndex(removed->meta.tier)].erase(removed->tick);
    s.map.erase(it);
  }
  Unaccount(*removed);
  return true;
}

void TieredStoreImpl::Unaccount(const Entry& e) {
  if (e.unverified) unverified_ -= 1;
  tenant_bytes_.Add(e.tenant, -static_cast<int64_t>(e.meta.stored_bytes));
  usage_.Add(e.tenant, -1, e.meta.stored_bytes, e.meta.original_bytes);
  if (e.meta.projection_version != 0) {
    projection_refs_.Add({e.model, e.meta.projection_version}, -1);
  }
}

absl::Status TieredStoreImpl::Put(const CacheKey& key, Payload encoded, const CacheMeta& meta_in,
                                  const PutOptions& options) {
  KVCOMP_RETURN_IF_ERROR(key.Validate());
  int target = options.tier < 0 ? default_tier_ : options.tier;
  if (target >= kNumTiers || (tiers_[target] == nullptr && tier_errors_[target].empty())) {
    return absl::InvalidArgumentError(absl::StrCat("put: tier ", options.tier, " is not enabled"));
  }
  target = PresentTierNear(target);  // a tier that failed at Open hands its puts on
  Durability durability = options.durability;
  if (durability != Durability::kMemory && rocks_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "put: ", durability == Durability::kDisk ? "disk" : "behind",
        " durability needs the rocksdb tier",
        tier_errors_[kRocks].empty() ? "" : ", which failed at open: ", tier_errors_[kRocks]));
  }
  CacheMeta meta = meta_in;
  const DeviceBytes* on_device = encoded.device_bytes();
  if (options.validate) {
    auto info = on_device != nullptr ? format::PeekHeader(on_device->header, on_device->size)
                                     : format::PeekCache(encoded.view());
    if (!info.ok()) return Annotate(info.status(), "put: not a valid encoded cache");
    if (meta.original_bytes == 0)
      meta.original_bytes = info->layout.CacheBytes(info->original_tokens);
    if (meta.projection_version == 0) meta.projection_version = info->projection_version;
  }
  const uint64_t n = encoded.size();
  // kBehind: the put's bytes are reserved in the persister's bound, or it is written through.
  struct BehindReservation {
    TieredStoreImpl* store;
    uint64_t bytes = 0;  // 0 once the queue owns them (or none were reserved)
    ~BehindReservation() {
      if (bytes == 0) return;
      std::lock_guard<std::mutex> lock(store->behind_mu_);
      store->behind_bytes_ -= bytes;
    }
  } behind{this};
  if (durability == Durability::kBehind && target != kRocks) {
    std::lock_guard<std::mutex> lock(behind_mu_);
    if (behind_bytes_ + n <= options_.behind_max_bytes) {
      behind_bytes_ += n;
      behind.bytes = n;
    } else {
      durability = Durability::kDisk;  // the loss window is full: written through
    }
  }
  meta.stored_bytes = n;
  meta.crc32c = on_device != nullptr ? on_device->crc32c
                : options.crc32c     ? *options.crc32c
                                     : Crc32c(encoded.data(), n);
  // The bytes as tier `t` takes them: a payload on the device goes to the device tier as it is
  // and is copied to the host once, the first time another tier needs it.
  Payload host_copy;
  bool downloaded = false;
  auto bytes_for = [&](int t) -> absl::StatusOr<Payload> {
    if (on_device == nullptr || t == TierIndex(TierKind::kDevice)) return encoded;
    if (!downloaded) {
      KVCOMP_ASSIGN_OR_RETURN(host_copy, DownloadDeviceBytes(*on_device));
      downloaded = true;
      if (options.copies != nullptr) options.copies->to_host += n;
    }
    return host_copy;
  };
  meta.created_unix_ms = NowMs();
  const absl::Duration ttl =
      options.ttl > absl::ZeroDuration() ? options.ttl : options_.default_ttl;
  meta.ttl_ms =
      ttl > absl::ZeroDuration() ? std::max<int64_t>(1, absl::ToInt64Milliseconds(ttl)) : 0;
  const std::string tenant = key.tenant.empty() ? "default" : key.tenant;
  const std::string ek = key.Encode();

  MakeRoom(target, n, Held());
  const int stripe = StripeIndex(ek);
  Stripe(stripe).Lock();
  struct Unlocker {
    SharedMutex* mu;
    ~Unlocker() { mu->Unlock(); }
  } unlock{&Stripe(stripe)};

  Shard& s = ShardOf(ek);
  bool had_old = false;
  Entry old;
  {
    ReaderLock lock(&s.mu);
    auto it = s.map.find(ek);
    if (it != s.map.end()) {
      had_old = true;
      old = it->second;
    }
  }
  if (had_old && !options.overwrite && !Expired(old, meta.created_unix_ms)) {
    return absl::AlreadyExistsError(absl::StrCat("put: ", key.DebugString(), " exists"));
  }
  const int64_t delta = static_cast<int64_t>(n) - (had_old ? old.meta.stored_bytes : 0);
  if (!tenant_bytes_.TryAdd(tenant, delta, QuotaOf(tenant))) {
    quota_rejections_ += 1;
    return absl::ResourceExhaustedError(
        absl::StrCat("put: tenant '", tenant, "' quota of ", QuotaOf(tenant), " bytes exceeded (",
                     tenant_bytes_.Get(tenant), " used, ", n, " more asked)"));
  }
  auto fail = [&](absl::Status st) {
    tenant_bytes_.Add(tenant, -delta);
    if (IsDiskError(st)) write_errors_ += 1;
    return st;
  };

  // An older value with a copy in RocksDB may be durable there. A new value that will not
  // replace that copy in one write (memory durability, placed in a memory tier) first removes it
  // with a synced write, so a crash can never bring the older value back after this put is
  // acknowledged; a new value written into RocksDB over it is written synced for the same reason.
  bool old_on_disk = had_old && old.persisted;
  bool dropped_old_disk = false;
  if (old_on_disk && durability != Durability::kDisk && target != kRocks) {
    absl::Status st = rocks_->Delete(ek, /*sync=*/true);
    if (!st.ok()) return fail(Annotate(st, "put: removing the older disk-durable value"));
    old_on_disk = false;
    dropped_old_disk = true;
  }

  bool persisted = false;
  int placed = kNoTier;
  if (durability == Durability::kDisk) {
    auto bytes = bytes_for(kRocks);
    if (!bytes.ok()) return fail(Annotate(bytes.status(), "put"));
    MakeRoom(kRocks, n, Held().With(&ek));
    absl::Status st = rocks_->Put(ek, meta, *bytes, /*sync=*/true);
    if (!st.ok()) return fail(Annotate(st, "put"));
    persisted = true;
    counters_[kRocks].puts += 1;
  }
  absl::Status last = absl::ResourceExhaustedError("put: no tier has room");
  for (int t = target; t != kNoTier; t = NextLower(t)) {
    if (t == kRocks && persisted) {
      placed = t;
      break;
    }
    auto bytes = bytes_for(t);
    if (!bytes.ok()) {
      last = bytes.status();
      break;
    }
    if (t != target) MakeRoom(t, n, Held().With(&ek));
    absl::Status st =
        tiers_[t]->Put(ek, meta, *bytes, SyncFor(t, durability) || (t == kRocks && old_on_disk));
    if (st.ok()) {
      placed = t;
      persisted = persisted || t == kRocks;
      counters_[t].puts += 1;
      if (options.copies != nullptr && t == TierIndex(TierKind::kDevice)) {
        (on_device != nullptr ? options.copies->on_device : options.copies->to_device) += n;
      }
      break;
    }
    last = st;
    if (!absl::IsResourceExhausted(st)) break;
    if (t == kRocks) break;
  }
  if (placed == kNoTier) {
    if (dropped_old_disk) {
      // The old value lost its disk copy above: it stays in its memory tier, no longer
      // persisted, or, if it was only on disk, it is gone.
      if (old.meta.tier == TierKind::kRocksDb) {
        Entry removed;
        RemoveFromIndex(ek, &removed);
      } else {
        WriterLock lock(&s.mu);
        auto it = s.map.find(ek);
        if (it != s.map.end()) it->second.persisted = false;
      }
    }
    return fail(Annotate(last, "put"));
  }

  // Drop the memory copy of the old value that the new one did not replace (its disk copy, if
  // any, was replaced or removed above).
  if (had_old) {
    const int old_tier = TierIndex(old.meta.tier);
    if (old_tier != placed && old_tier != kRocks) tiers_[old_tier]->Delete(ek, false).IgnoreError();
  }
  meta.tier = static_cast<TierKind>(placed);
  {
    WriterLock lock(&s.mu);
    Entry& e = s.map[ek];
    if (had_old && e.pins == 0) s.lru[TierIndex(e.meta.tier)].erase(e.tick);
    const uint32_t pins = (had_old ? e.pins : 0) + (options.pin ? 1 : 0);
    if (e.unverified) unverified_ -= 1;  // replaced before the background check reached it
    e.unverified = false;
    e.tenant = tenant;
    e.model = key.model_id;
    e.meta = meta;
    e.persisted = persisted;
    e.pins = pins;
    e.tick = ++tick_;
    if (pins == 0) s.lru[placed][e.tick] = ek;
  }
  if (had_old) usage_.Add(old.tenant, -1, old.meta.stored_bytes, old.meta.original_bytes);
  usage_.Add(tenant, +1, meta.stored_bytes, meta.original_bytes);
  if (had_old && old.meta.projection_version != 0) {
    projection_refs_.Add({old.model, old.meta.projection_version}, -1);
  }
  if (meta.projection_version != 0)
    projection_refs_.Add({key.model_id, meta.projection_version}, 1);
  RelieveIfAboveHigh(placed, Held().With(&ek));
  if (persisted && placed != kRocks) RelieveIfAboveHigh(kRocks, Held().With(&ek));
  if (behind.bytes != 0 && !persisted) {
    {
      std::lock_guard<std::mutex> lock(behind_mu_);
      behind_.push_back({ek, meta.created_unix_ms, meta.crc32c, n});
    }
    behind.bytes = 0;  // the queue holds the reservation now
    behind_cv_.notify_all();
  }
  return absl::OkStatus();
}

absl::StatusOr<StoredCache> TieredStoreImpl::Get(const CacheKey& key) {
  KVCOMP_RETURN_IF_ERROR(key.Validate());
  const std::string ek = key.Encode();
  Shard& s = ShardOf(ek);
  int first = 0;
  while (tiers_[first] == nullptr) ++first;
  for (int attempt = 0; attempt < 8; ++attempt) {
    CacheMeta meta;
    bool expired = false;
    bool unverified = false;
    {
      WriterLock lock(&s.mu);
      auto it = s.map.find(ek);
      if (it == s.map.end()) {
        counters_[first].misses += 1;
        return absl::NotFoundError(absl::StrCat("get: ", key.DebugString(), " not found"));
      }
      if (Expired(it->second, NowMs())) {
        expired = true;
      } else {
        meta = it->second.meta;
        unverified = it->second.unverified;
        TouchLocked(s, ek, it->second);
      }
    }
    if (expired) {
      const int stripe = StripeIndex(ek);
      WriterLock lock(&Stripe(stripe));
      bool deleted = false;
      DeleteLocked(ek, /*only_if_expired=*/true, &deleted).IgnoreError();
      counters_[first].misses += 1;
      return absl::NotFoundError(absl::StrCat("get: ", key.DebugString(), " expired"));
    }
    const int t = TierIndex(meta.tier);
    auto payload = tiers_[t]->Get(ek);
    if (t == kRocks && (absl::IsDataLoss(payload.status()) ||
                        (unverified && absl::IsNotFound(payload.status())))) {
      // The payload record on disk is damaged, or gone with a damaged table taken out at open
      // (docs/storage.md, "Damaged table files"): quarantined now rather than at every get.
      // (QuarantineOnRead waits on the key's stripe, so a delete or eviction in progress is
      // seen as such: the entry has left the index and the next look reports a miss.)
      absl::Status st = QuarantineOnRead(
          ek, meta, absl::StrCat("payload unreadable: ", payload.status().message()));
      if (absl::IsUnavailable(st)) continue;  // replaced or removed meanwhile: look again
      if (!unverified) return st;
      counters_[first].misses += 1;
      return absl::NotFoundError(
          absl::StrCat("get: ", key.DebugString(), " not found (quarantined at recovery)"));
    }
    if (absl::IsNotFound(payload.status())) {
      // Moved, replaced or being removed meanwhile: wait for whoever holds the key's stripe
      // (a demotion, eviction or delete, possibly syncing the WAL), then look again.
      ReaderLock wait(&Stripe(StripeIndex(ek)));
      continue;
    }
    if (!payload.ok()) return Annotate(payload.status(), "get");
    if (payload->size() != meta.stored_bytes ||
        (t == kRocks && Crc32c(payload->data(), payload->size()) != meta.crc32c)) {
      if (unverified) {
        // Not checked since Open yet: what a check at Open would have done, quarantined unseen.
        absl::Status st = QuarantineOnRead(ek, meta, "payload checksum mismatch");
        if (absl::IsUnavailable(st)) continue;  // replaced or quarantined meanwhile: look again
        counters_[first].misses += 1;
        return absl::NotFoundError(
            absl::StrCat("get: ", key.DebugString(), " not found (quarantined at recovery)"));
      }
      return QuarantineOnRead(ek, meta, "payload checksum mismatch on read");
    }
    counters_[t].hits += 1;
    if (promote_ && t > TierIndex(options_.promote_to)) {
      Promote(ek, meta, *payload);
    }
    return StoredCache{meta, *std::move(payload)};
  }
  return absl::UnavailableError("get: the entry kept moving; retry");
}

absl::StatusOr<CacheMeta> TieredStoreImpl::GetInto(const CacheKey& key,
                                                   const DeviceTarget& target,
                                                   DeviceCopies* copies) {
  KVCOMP_RETURN_IF_ERROR(key.Validate());
  if (target.data == nullptr) return absl::InvalidArgumentError("get into: null device target");
  const std::string ek = key.Encode();
  const int dev = TierIndex(TierKind::kDevice);
  if (tiers_[dev] != nullptr) {
    // Held as a reader through the copy: the key's put, delete, demotion or quarantine (writers
    // of the stripe) wait for it, so the bytes copied are the meta's.
    ReaderLock stripe(&Stripe(StripeIndex(ek)));
    CacheMeta meta;
    bool here = false;
    {
      Shard& s = ShardOf(ek);
      WriterLock lock(&s.mu);
      auto it = s.map.find(ek);
      if (it != s.map.end() && !Expired(it->second, NowMs()) &&
          it->second.meta.tier == TierKind::kDevice) {
        meta = it->second.meta;
        here = true;
        TouchLocked(s, ek, it->second);
      }
    }
    if (here) {
      absl::StatusOr<uint64_t> n = tiers_[dev]->ReadInto(ek, target);
      if (!n.ok()) return Annotate(n.status(), "get into device memory");
      if (*n != meta.stored_bytes) {
        return absl::InternalError(
            "get into device memory: the device tier's size is not the meta's");
      }
      counters_[dev].hits += 1;
      if (copies != nullptr) copies->on_device += *n;
      return meta;
    }
  }
  // Not on the device: read as Get reads it (checks, expiry, promotion), then one upload.
  KVCOMP_ASSIGN_OR_RETURN(StoredCache got, Get(key));
  if (got.payload.size() > target.capacity) {
    return absl::OutOfRangeError(absl::StrCat("get into device memory: the cache has ",
                                              got.payload.size(), " bytes, the target ",
                                              target.capacity));
  }
  KVCOMP_RETURN_IF_ERROR(CopyToDeviceTarget(target, got.payload.data(), got.payload.size()));
  if (copies != nullptr) copies->to_device += got.payload.size();
  return got.meta;
}

absl::Status TieredStoreImpl::QuarantineOnRead(const std::string& ek, const CacheMeta& meta,
                                               absl::string_view reason) {
  const int stripe = StripeIndex(ek);
  WriterLock lock(&Stripe(stripe));
  if (!QuarantineLocked(ek, meta, reason)) {
    return absl::UnavailableError("get: the entry changed while read; retry");
  }
  return absl::DataLossError(absl::StrCat("get: ", reason, "; entry quarantined"));
}

bool TieredStoreImpl::QuarantineLocked(const std::string& ek, const CacheMeta& meta,
                                       absl::string_view reason) {
  Shard& s = ShardOf(ek);
  {
    ReaderLock shard_lock(&s.mu);
    auto it = s.map.find(ek);
    if (it == s.map.end() || it->second.meta.crc32c != meta.crc32c ||
        it->second.meta.created_unix_ms != meta.created_unix_ms) {
      return false;
    }
  }
  // Moved aside on disk when it can be (not while read-only); never served again either way.
  if (meta.tier == TierKind::kRocksDb) rocks_->Quarantine(ek, reason).IgnoreError();
  Entry removed;
  if (RemoveFromIndex(ek, &removed)) {
    if (removed.meta.tier != TierKind::kRocksDb) {
      tiers_[TierIndex(removed.meta.tier)]->Delete(ek, false).IgnoreError();
    }
  }
  quarantined_ += 1;
  {
    WriterLock qlock(&quarantine_mu_);
    quarantine_.push_back({ek, std::string(reason)});
    last_quarantined_ = DescribeQuarantined(ek, reason);
  }
  return true;
}

void TieredStoreImpl::Promote(const std::string& ek, const CacheMeta& meta,
                              const Payload& payload) {
  const int to = TierIndex(options_.promote_to);
  const int from = TierIndex(meta.tier);
  MakeRoom(to, payload.size(), Held());
  const int stripe = StripeIndex(ek);
  WriterLock lock(&Stripe(stripe));
  Shard& s = ShardOf(ek);
  {
    ReaderLock shard_lock(&s.mu);
    auto it = s.map.find(ek);
    if (it == s.map.end() || TierIndex(it->second.meta.tier) != from ||
        it->second.meta.crc32c != meta.crc32c ||
        it->second.meta.created_unix_ms != meta.created_unix_ms) {
      return;
    }
  }
  if (!tiers_[to]->Put(ek, meta, payload, false).ok()) return;
  {
    WriterLock shard_lock(&s.mu);
    Entry& e = s.map[ek];
    if (e.pins == 0) s.lru[from].erase(e.tick);
    e.meta.tier = static_cast<TierKind>(to);
    if (e.pins == 0) s.lru[to][e.tick] = ek;
  }
  if (from != kRocks) tiers_[from]->Delete(ek, false).IgnoreError();
  counters_[to].promotions += 1;
  counters_[to].puts += 1;
  RelieveIfAboveHigh(to, Held().With(&ek));
}

absl::StatusOr<LookupResult> TieredStoreImpl::Lookup(const CacheKey& key) {
  KVCOMP_RETURN_IF_ERROR(key.Validate());
  const std::string ek = key.Encode();
  Shard& s = ShardOf(ek);
  ReaderLock lock(&s.mu);
  auto it = s.map.find(ek);
  if (it == s.map.end() || Expired(it->second, NowMs())) {
    return absl::NotFoundError(absl::StrCat("lookup: ", key.DebugString(), " not found"));
  }
  const Entry& e = it->second;
  return LookupResult{e.meta.tier, e.persisted, e.pins, e.meta};
}

absl::Status TieredStoreImpl::DeleteLocked(const std::string& ek, bool only_if_expired,
                                           bool* deleted) {
  *deleted = false;
  Shard& s = ShardOf(ek);
  Entry e;
  {
    ReaderLock lock(&s.mu);
    auto it = s.map.find(ek);
    if (it == s.map.end()) return absl::OkStatus();
    if (only_if_expired && !Expired(it->second, NowMs())) return absl::OkStatus();
    e = it->second;
  }
  // The durable copy goes first: if that fails the entry stays, whole and visible.
  if (e.persisted) KVCOMP_RETURN_IF_ERROR(rocks_->Delete(ek, /*sync=*/true));
  Entry removed;
  if (!RemoveFromIndex(ek, &removed)) return absl::OkStatus();
  if (removed.meta.tier != TierKind::kRocksDb) {
    tiers_[TierIndex(removed.meta.tier)]->Delete(ek, false).IgnoreError();
  }
  if (only_if_expired) expired_ += 1;
  *deleted = true;
  return absl::OkStatus();
}

absl::Status TieredStoreImpl::Delete(const CacheKey& key) {
  KVCOMP_RETURN_IF_ERROR(key.Validate());
  const std::string ek = key.Encode();
  WriterLock lock(&Stripe(StripeIndex(ek)));
  bool deleted = false;
  absl::Status st = DeleteLocked(ek, false, &deleted);
  if (!st.ok()) {
    if (IsDiskError(st)) write_errors_ += 1;
    return Annotate(st, "delete");
  }
  if (!deleted)
    return absl::NotFoundError(absl::StrCat("delete: ", key.DebugString(), " not found"));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ListedCache>> TieredStoreImpl::List(absl::string_view tenant) {
  if (!tenant.empty()) {
    CacheKey probe{std::string(tenant), "m", "k"};
    KVCOMP_RETURN_IF_ERROR(probe.Validate());
  }
  const std::string prefix = CacheKey::TenantPrefix(tenant);
  const int64_t now = NowMs();
  std::vector<std::pair<std::string, LookupResult>> found;
  for (auto& shard : shards_) {
    ReaderLock lock(&shard->mu);
    for (const auto& [ek, e] : shard->map) {
      if (!absl::StartsWith(ek, prefix) || Expired(e, now)) continue;
      found.emplace_back(ek, LookupResult{e.meta.tier, e.persisted, e.pins, e.meta});
    }
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<ListedCache> out;
  out.reserve(found.size());
  for (auto& [ek, info] : found) {
    KVCOMP_ASSIGN_OR_RETURN(CacheKey k, CacheKey::Decode(ek));
    out.push_back({std::move(k), info});
  }
  return out;
}

absl::Status TieredStoreImpl::Pin(const CacheKey& key) {
  KVCOMP_RETURN_IF_ERROR(key.Validate());
  const std::string ek = key.Encode();
  WriterLock stripe_lock(&Stripe(StripeIndex(ek)));
  Shard& s = ShardOf(ek);
  WriterLock lock(&s.mu);
  auto it = s.map.find(ek);
  if (it == s.map.end() || Expired(it->second, NowMs())) {
    return absl::NotFoundError(absl::StrCat("pin: ", key.DebugString(), " not found"));
  }
  Entry& e = it->second;
  if (e.pins++ == 0) s.lru[TierIndex(e.meta.tier)].erase(e.tick);
  return absl::OkStatus();
}

absl::Status TieredStoreImpl::Unpin(const CacheKey& key) {
  KVCOMP_RETURN_IF_ERROR(key.Validate());
  const std::string ek = key.Encode();
  int tier;
  bool unpinned;
  {
    WriterLock stripe_lock(&Stripe(StripeIndex(ek)));
    Shard& s = ShardOf(ek);
    WriterLock lock(&s.mu);
    auto it = s.map.find(ek);
    if (it == s.map.end()) {
      return absl::NotFoundError(absl::StrCat("unpin: ", key.DebugString(), " not found"));
    }
    Entry& e = it->second;
    if (e.pins == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("unpin: ", key.DebugString(), " is not pinned"));
    }
    tier = TierIndex(e.meta.tier);
    unpinned = --e.pins == 0;
    if (unpinned) s.lru[tier][e.tick] = ek;
  }
  if (unpinned) RelieveIfAboveHigh(tier, Held());
  return absl::OkStatus();
}

uint64_t TieredStoreImpl::ExpireNow() {
  const int64_t now = NowMs();
  std::vector<std::string> expired;
  for (auto& shard : shards_) {
    ReaderLock lock(&shard->mu);
    for (const auto& [ek, e] : shard->map) {
      if (Expired(e, now)) expired.push_back(ek);
    }
  }
  // In batches: the batch's key stripes are taken in ascending order (so two sweeps cannot
  // deadlock; every other path holds at most one stripe while it blocks), the persisted ones are
  // deleted from RocksDB in one synced write, then all leave the index. One WAL sync per batch.
  uint64_t n = 0;
  for (size_t begin = 0; begin < expired.size(); begin += kEvictBatch) {
    const size_t end = std::min(expired.size(), begin + kEvictBatch);
    std::vector<int> stripes;
    for (size_t i = begin; i < end; ++i) stripes.push_back(StripeIndex(expired[i]));
    std::sort(stripes.begin(), stripes.end());
    stripes.erase(std::unique(stripes.begin(), stripes.end()), stripes.end());
    for (int stripe : stripes) Stripe(stripe).Lock();
    std::vector<std::string> gone, on_disk;
    const int64_t check = NowMs();
    for (size_t i = begin; i < end; ++i) {
      Shard& s = ShardOf(expired[i]);
      ReaderLock lock(&s.mu);
      auto it = s.map.find(expired[i]);
      if (it == s.map.end() || !Expired(it->second, check)) continue;  // replaced or pinned
      gone.push_back(expired[i]);
      if (it->second.persisted) on_disk.push_back(expired[i]);
    }
    absl::Status st = on_disk.empty() ? absl::OkStatus() : rocks_->DeleteMany(on_disk, true);
    if (st.ok()) {
      for (const std::string& ek : gone) {
        Entry removed;
        if (!RemoveFromIndex(ek, &removed)) continue;
        if (removed.meta.tier != TierKind::kRocksDb) {
          tiers_[TierIndex(removed.meta.tier)]->Delete(ek, false).IgnoreError();
        }
        expired_ += 1;
        ++n;
      }
    } else if (IsDiskError(st)) {
      write_errors_ += 1;  // the entries stay (hidden, expired) until a later sweep
    }
    for (int stripe : stripes) Stripe(stripe).Unlock();
  }
  return n;
}

void TieredStoreImpl::PersistBehind() {
  std::unique_lock<std::mutex> lock(behind_mu_);
  for (;;) {
    behind_cv_.wait(lock, [&] { return stop_behind_ || !behind_.empty(); });
    if (behind_.empty()) return;  // stopping, and everything queued is written
    BehindItem item = std::move(behind_.front());
    behind_.pop_front();
    ++behind_busy_;
    lock.unlock();
    PersistOne(item);
    lock.lock();
    --behind_busy_;
    behind_bytes_ -= item.bytes;
    behind_cv_.notify_all();
  }
}

void TieredStoreImpl::PersistOne(const BehindItem& item) {
  const std::string& ek = item.ek;
  // The stripe keeps puts, deletes and demotions of this key out while it is written.
  WriterLock stripe(&Stripe(StripeIndex(ek)));
  Shard& s = ShardOf(ek);
  Entry e;
  {
    ReaderLock lock(&s.mu);
    auto it = s.map.find(ek);
    // Gone, replaced by a newer put, or on disk already (demoted, or written through).
    if (it == s.map.end() || it->second.persisted ||
        it->second.meta.created_unix_ms != item.created_ms ||
        it->second.meta.crc32c != item.crc32c) {
      return;
    }
    e = it->second;
  }
  const int t = TierIndex(e.meta.tier);
  if (t == kRocks) return;
  auto payload = tiers_[t]->Get(ek);  // host bytes (the device tier's Get copies to the host)
  if (!payload.ok()) {
    behind_failed_ += 1;
    return;
  }
  MakeRoom(kRocks, payload->size(), Held().With(&ek));
  absl::Status st = rocks_->Put(ek, e.meta, *payload, /*sync=*/true);
  if (!st.ok()) {
    if (IsDiskError(st)) write_errors_ += 1;
    behind_failed_ += 1;
    return;
  }
  counters_[kRocks].puts += 1;
  {
    WriterLock lock(&s.mu);
    auto it = s.map.find(ek);
    if (it != s.map.end() && it->second.meta.created_unix_ms == item.created_ms) {
      it->second.persisted = true;
    }
  }
  RelieveIfAboveHigh(kRocks, Held().With(&ek));
}

void TieredStoreImpl::FlushBehind() {
  std::unique_lock<std::mutex> lock(behind_mu_);
  behind_cv_.wait(lock, [&] { return behind_.empty() && behind_busy_ == 0; });
}

StoreStats TieredStoreImpl::Stats() const {
  StoreStats out;
  if (rocks_ != nullptr) {
    out.background_corruptions = rocks_->background_corruptions();
    out.damage_repairs = rocks_->repairs();
    out.last_damage_repair = rocks_->last_repair();
    out.log_damage = rocks_->log_damage().regions;
    out.log_damage_bytes = rocks_->log_damage().bytes;
    out.last_log_damage = rocks_->log_damage().last;
    out.tables_dropped = rocks_->table_damage().tables;
    out.orphans_removed = rocks_->table_damage().orphans;
    out.last_table_dropped = rocks_->table_damage().last;
    out.manifest_tails = rocks_->table_damage().manifest_tails;
    out.last_manifest_tail = rocks_->table_damage().last_manifest_tail;
  }
  for (int t = 0; t < kNumTiers; ++t) {
    TierStats& ts = out.tiers[t];
    const TierCounters& c = counters_[t];
    ts.error = tier_errors_[t];
    if (tiers_[t] != nullptr) {
      ts.present = true;
      ts.entries = tiers_[t]->entries();
      ts.bytes = tiers_[t]->used_bytes();
      ts.capacity = tiers_[t]->capacity_bytes();
    }
    if (t == kRocks && rocks_ != nullptr) {
      ts.read_only = rocks_->read_only();
      ts.read_only_reason = rocks_->read_only_reason();
      ts.disk_free_bytes = rocks_->free_bytes();
    }
    ts.hits = c.hits;
    ts.misses = c.misses;
    ts.puts = c.puts;
    ts.demotions = c.demotions;
    ts.promotions = c.promotions;
    ts.evictions = c.evictions;
  }
  out.expired = expired_;
  out.quarantined = quarantined_;
  out.quota_rejections = quota_rejections_;
  out.write_errors = write_errors_;
  out.recovered = recovered_;
  out.unverified = unverified_;
  {
    std::lock_guard<std::mutex> lock(behind_mu_);
    out.behind_bytes = behind_bytes_;
  }
  out.behind_failed = behind_failed_;
  {
    ReaderLock lock(&quarantine_mu_);
    out.last_quarantined = last_quarantined_;
  }
  return out;
}

std::vector<QuarantinedCache> TieredStoreImpl::Quarantined() const {
  WaitVerified();
  ReaderLock lock(&quarantine_mu_);
  return quarantine_;
}

absl::Status TieredStoreImpl::PurgeQuarantined(absl::string_view encoded_key) {
  WaitVerified();
  bool found = false;
  if (rocks_ != nullptr) {
    auto purged = rocks_->PurgeQuarantine(encoded_key);
    if (!purged.ok()) return Annotate(purged.status(), "purge quarantined");
    found = *purged;
  }
  {
    WriterLock lock(&quarantine_mu_);
    const size_t before = quarantine_.size();
    quarantine_.erase(
        std::remove_if(quarantine_.begin(), quarantine_.end(),
                       [&](const QuarantinedCache& q) { return q.encoded_key == encoded_key; }),
        quarantine_.end());
    found = found || quarantine_.size() != before;
  }
  if (!found) return absl::NotFoundError("purge quarantined: no such quarantined entry");
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> TieredStoreImpl::PurgeAllQuarantined() {
  WaitVerified();
  absl::flat_hash_set<std::string> keys;
  if (rocks_ != nullptr) {
    auto purged = rocks_->PurgeAllQuarantine();
    if (!purged.ok()) return Annotate(purged.status(), "purge quarantined");
    keys.insert(purged->begin(), purged->end());
  }
  // Entries quarantined from a memory tier were never on disk; each key counts once.
  WriterLock lock(&quarantine_mu_);
  for (const QuarantinedCache& q : quarantine_) keys.insert(q.encoded_key);
  quarantine_.clear();
  return keys.size();
}

absl::Status TieredStoreImpl::PutCalibration(absl::string_view key, absl::string_view bytes) {
  if (rocks_ == nullptr) return absl::FailedPreconditionError("calibration needs the rocksdb tier");
  return rocks_->PutCalibration(key, bytes);
}

absl::StatusOr<std::string> TieredStoreImpl::GetCalibration(absl::string_view key) {
  if (rocks_ == nullptr) return absl::FailedPreconditionError("calibration needs the rocksdb tier");
  return rocks_->GetCalibration(key);
}

absl::StatusOr<std::vector<std::string>> TieredStoreImpl::ListCalibration(
    absl::string_view prefix) {
  if (rocks_ == nullptr) return absl::FailedPreconditionError("calibration needs the rocksdb tier");
  return rocks_->ListCalibration(prefix);
}

absl::Status TieredStoreImpl::DeleteCalibration(absl::string_view key) {
  if (rocks_ == nullptr) return absl::FailedPreconditionError("calibration needs the rocksdb tier");
  return rocks_->DeleteCalibration(key);
}

uint64_t TieredStoreImpl::ProjectionReferences(absl::string_view model_id, uint64_t version) const {
  return projection_refs_.Get({std::string(model_id), version});
}

}  // namespace

absl::StatusOr<std::unique_ptr<TieredStore>> TieredStore::Open(const StoreOptions& options) {
  KVCOMP_RETURN_IF_ERROR(ValidateOptions(options));
  auto store = std::make_unique<TieredStoreImpl>(options);
  KVCOMP_RETURN_IF_ERROR(store->Init());
  return std::unique_ptr<TieredStore>(std::move(store));
}

}  // namespace storage
}  // namespace kvcomp
