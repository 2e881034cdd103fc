#include "handlers.h"

#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/strings/str_format.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/service/config.h"
#include "kvcomp/service/daemon.h"
#include "data_plane.h"
#include "log.h"
#include "policy_rpc.h"

namespace kvcomp {
namespace service {

// ---------------------------------------------------------------------------------------------
// Control plane

rpc::Status ToRpc(const absl::Status& status) { return StatusToRpc(status); }

rpc::Policy ToRpc(const CompressionPolicy& p) { return PolicyToRpc(p); }

absl::StatusOr<CompressionPolicy> FromRpc(const rpc::Policy& r) { return PolicyFromRpc(r); }

absl::StatusOr<std::string> ControlHandler::Authenticate(const rpc::Auth& auth) {
  auto tenant = ctx_->tokens->Authenticate(auth.tenant, auth.token);
  if (!tenant.ok()) ctx_->metrics->CountAuthFailure("control");
  if (ctx_->control_authenticated) {
    absl::Status admitted = ctx_->control_authenticated(tenant);
    if (!admitted.ok()) return admitted;
  }
  return tenant;
}

#define KVCOMP_CONTROL_AUTH(tenant_var, out)      \
  auto tenant_var##_or = Authenticate(auth);      \
  if (!tenant_var##_or.ok()) {                    \
    out.status = ToRpc(tenant_var##_or.status()); \
    return;                                       \
  }                                               \
  const std::string tenant_var = *tenant_var##_or

void ControlHandler::Health(rpc::HealthResponse& out, const rpc::Auth& auth) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  out.live = true;
  out.ready = ctx_->ready.load();
  out.draining = ctx_->draining.load();
  out.uptime_seconds = absl::ToDoubleSeconds(absl::Now() - ctx_->started);
}

void ControlHandler::Stats(rpc::StatsResponse& out, const rpc::Auth& auth) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  // The store keeps each tenant's totals as caches come and go: no listing per call.
  for (const storage::TenantUsage& u : ctx_->store->Usage()) {
    if (u.tenant != tenant) continue;
    out.caches = static_cast<int64_t>(u.caches);
    out.original_bytes = static_cast<int64_t>(u.original_bytes);
    out.stored_bytes = static_cast<int64_t>(u.stored_bytes);
  }
  storage::StoreStats st = ctx_->store->Stats();
  for (int i = 0; i < storage::kNumTiers; ++i) {
    const storage::TierStats& t = st.tiers[i];
    if (!t.present) continue;
    rpc::TierStats r;
    r.tier = storage::TierName(static_cast<storage::TierKind>(i));
    r.entries = static_cast<int64_t>(t.entries);
    r.stored_bytes = static_cast<int64_t>(t.bytes);
    r.capacity_bytes = static_cast<int64_t>(t.capacity);
    r.hits = static_cast<int64_t>(t.hits);
    r.misses = static_cast<int64_t>(t.misses);
    r.demotions = static_cast<int64_t>(t.demotions);
    r.evictions = static_cast<int64_t>(t.evictions);
    out.tiers.push_back(r);
  }
  out.queue_depth = static_cast<int64_t>(ctx_->service->queue_depth());
  out.puts_in_progress = static_cast<int64_t>(ctx_->service->open_puts());
  out.puts_total = static_cast<int64_t>(ctx_->puts_total.load());
  out.gets_total = static_cast<int64_t>(ctx_->gets_total.load());
  out.errors_total = static_cast<int64_t>(ctx_->errors_total.load());
}

void ControlHandler::Lookup(rpc::LookupResponse& out, const rpc::Auth& auth,
                            const rpc::CacheRef& ref) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  absl::Time t0 = absl::Now();
  CacheKey key{tenant, ref.model_id, ref.key};
  absl::Status s = key.Validate();
  absl::StatusOr<CacheRepository::Description> desc =
      s.ok() ? ctx_->service->repository()->Describe(key)
             : absl::StatusOr<CacheRepository::Description>(s);
  ctx_->metrics->ObserveOp(Op::kLookup, absl::ToDoubleSeconds(absl::Now() - t0));
  if (!desc.ok()) {
    absl::Status e =
        absl::IsNotFound(desc.status()) ? absl::NotFoundError("cache not found") : desc.status();
    ctx_->metrics->CountError("lookup", e);
    out.status = ToRpc(e);
    return;
  }
  const storage::LookupResult* where = &desc->where;
  const format::CacheInfo* info = &desc->info;
  out.tier = storage::TierName(where->tier);
  out.original_bytes = static_cast<int64_t>(where->meta.original_bytes);
  out.stored_bytes = static_cast<int64_t>(where->meta.stored_bytes);
  out.original_tokens = static_cast<int64_t>(info->original_tokens);
  out.kept_tokens = static_cast<int64_t>(info->total_kept);
  out.layout.num_layers = static_cast<int32_t>(info->layout.num_layers);
  out.layout.num_kv_heads = static_cast<int32_t>(info->layout.num_kv_heads);
  out.layout.num_q_heads = static_cast<int32_t>(info->layout.num_q_heads);
  out.layout.head_dim = static_cast<int32_t>(info->layout.head_dim);
  out.layout.dtype = std::string(DTypeName(info->layout.dtype));
  out.key_codec = std::string(KeyCodecName(info->key_codec));
  out.value_codec = std::string(ValueCodecName(info->value_codec));
}

void ControlHandler::Delete(rpc::DeleteResponse& out, const rpc::Auth& auth,
                            const rpc::CacheRef& ref) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  absl::Time t0 = absl::Now();
  CacheKey key{tenant, ref.model_id, ref.key};
  absl::Status s = key.Validate();
  if (s.ok()) s = ctx_->store->Delete(key);
  if (s.ok()) ctx_->service->repository()->Deleted(key);
  if (absl::IsNotFound(s)) s = absl::NotFoundError("cache not found");
  ctx_->metrics->ObserveOp(Op::kDelete, absl::ToDoubleSeconds(absl::Now() - t0));
  if (!s.ok()) ctx_->metrics->CountError("delete", s);
  out.status = ToRpc(s);
}

void ControlHandler::List(rpc::ListResponse& out, const rpc::Auth& auth,
                          const std::string& model_id, const std::string& cursor, int32_t limit) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  auto listed = ctx_->store->List(tenant);
  if (!listed.ok()) {
    out.status = ToRpc(listed.status());
    return;
  }
  const size_t max = limit <= 0 ? 1000 : static_cast<size_t>(std::min(limit, 10000));
  bool more = false;
  for (const auto& c : *listed) {
    if (!model_id.empty() && c.key.model_id != model_id) continue;
    std::string enc = c.key.Encode();
    if (!cursor.empty() && enc <= cursor) continue;
    if (out.caches.size() == max) {
      more = true;
      break;
    }
    rpc::CacheRef r;
    r.model_id = c.key.model_id;
    r.key = c.key.key;
    out.caches.push_back(r);
    out.next_cursor = enc;
  }
  if (!more) out.next_cursor.clear();
}

void ControlHandler::GetPolicy(rpc::PolicyResponse& out, const rpc::Auth& auth,
                               const std::string& model_id) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  auto [policy, is_default] = ctx_->policies->Resolve(tenant, model_id);
  out.policy = ToRpc(policy);
  out.is_default = is_default;
}

void ControlHandler::SetPolicy(rpc::PolicyResponse& out, const rpc::Auth& auth,
                               const std::string& model_id, const rpc::Policy& policy) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  if (model_id.size() > CacheKey::kMaxModelBytes) {
    out.status = ToRpc(absl::InvalidArgumentError("model_id too long"));
    return;
  }
  auto p = FromRpc(policy);
  absl::Status s = p.ok() ? ctx_->policies->Set(tenant, model_id, *p) : p.status();
  out.status = ToRpc(s);
  if (s.ok()) {
    out.policy = ToRpc(*p);
    out.is_default = false;
  }
}

void ControlHandler::Calibrate(rpc::CalibrateResponse& out, const rpc::Auth& auth,
                               const rpc::CalibrateRequest& request) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  if (!ctx_->calibrate) {
    out.status = ToRpc(absl::UnimplementedError(
        "calibration is not available in this build (KVSplice and pq calibration)"));
    return;
  }
  CalibrationRequest req;
  req.tenant = tenant;
  req.model_id = request.model_id;
  req.value_codec = request.value_codec;
  req.rank = static_cast<uint32_t>(std::max<int64_t>(0, request.rank));
  req.error_budget = request.error_budget;
  req.max_caches = static_cast<uint64_t>(std::max<int64_t>(0, request.max_caches));
  req.key_bits = static_cast<uint32_t>(std::max<int32_t>(0, request.key_bits));
  req.value_bits = static_cast<uint32_t>(std::max<int32_t>(0, request.value_bits));
  auto r = ctx_->calibrate(req);
  if (!r.ok()) {
    out.status = ToRpc(r.status());
    return;
  }
  out.projection_version = static_cast<int64_t>(r->projection_version);
  out.rank = r->rank;
  out.layer_ranks.assign(r->layer_ranks.begin(), r->layer_ranks.end());
  out.achieved_error = r->achieved_error;
  out.caches_used = static_cast<int64_t>(r->caches_used);
}

void ControlHandler::ServerInfo(rpc::ServerInfoResponse& out, const rpc::Auth& auth) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  const Options& o = ctx_->options;
  out.version = Version();
  out.control_protocol_version = rpc::g_kvcomp_constants.PROTOCOL_VERSION;
  out.data_protocol_version = DataPlane::ProtocolVersion();
  out.backend = ctx_->service->engines()->description();
  out.multi_tenant = !ctx_->tokens->open_mode();
  out.data_address = absl::StrCat(o.data_plane.address, ":", ctx_->data_port.load());
  out.metrics_port = ctx_->metrics_port.load();
  out.durability = o.storage.durability;
  out.max_put_bytes = static_cast<int64_t>(o.data_plane.max_put_bytes);
  out.max_block_bytes = static_cast<int64_t>(o.data_plane.max_block_bytes);
  storage::StoreStats st = ctx_->store->Stats();
  for (int i = 0; i < storage::kNumTiers; ++i) {
    if (st.tiers[i].present)
      out.tiers.push_back(storage::TierName(static_cast<storage::TierKind>(i)));
  }
}

std::vector<storage::QuarantinedCache> ControlHandler::QuarantinedOf(
    const std::string& tenant) const {
  std::vector<storage::QuarantinedCache> out;
  const bool open_mode = ctx_->tokens->open_mode();
  for (storage::QuarantinedCache& q : ctx_->store->Quarantined()) {
    auto key = CacheKey::Decode(q.encoded_key);
    if (key.ok() ? key->tenant == tenant : open_mode) out.push_back(std::move(q));
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.encoded_key < b.encoded_key; });
  return out;
}

void ControlHandler::ListQuarantined(rpc::ListQuarantinedResponse& out, const rpc::Auth& auth,
                                     const std::string& cursor, int32_t limit) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  // A page of entries, like List's: the reply is bounded by `max` entries of a key (CacheKey's
  // bounds; an open-mode entry's raw store key as RocksDB holds it, for PurgeQuarantined) and a
  // reason of at most kMaxReasonBytes.
  constexpr size_t kMaxReasonBytes = 1024;
  const size_t max = limit <= 0 ? 1000 : static_cast<size_t>(std::min(limit, 10000));
  bool more = false;
  for (const storage::QuarantinedCache& q : QuarantinedOf(tenant)) {
    if (!cursor.empty() && q.encoded_key <= cursor) continue;
    if (out.entries.size() == max) {
      more = true;
      break;
    }
    out.next_cursor = q.encoded_key;
    rpc::QuarantinedEntry e;
    auto key = CacheKey::Decode(q.encoded_key);
    if (key.ok()) {
      e.model_id = key->model_id;
      e.key = key->key;
    } else {
      e.key = q.encoded_key;
    }
    size_t n = std::min(q.reason.size(), kMaxReasonBytes);
    while (n > 0 && n < q.reason.size() && (static_cast<uint8_t>(q.reason[n]) & 0xC0) == 0x80) {
      --n;  // not inside a UTF-8 sequence
    }
    e.reason = q.reason.substr(0, n);
    out.entries.push_back(std::move(e));
  }
  if (!more) out.next_cursor.clear();
}

void ControlHandler::PurgeQuarantined(rpc::PurgeQuarantinedResponse& out, const rpc::Auth& auth,
                                      const rpc::CacheRef& ref, bool all) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  const std::vector<storage::QuarantinedCache> mine = QuarantinedOf(tenant);
  std::vector<std::string> purge;
  if (all) {
    for (const auto& q : mine) purge.push_back(q.encoded_key);
  } else {
    // A cache key of the caller's, or (model_id "") a raw store key ListQuarantined showed it.
    const std::string wanted =
        ref.model_id.empty() ? ref.key : CacheKey{tenant, ref.model_id, ref.key}.Encode();
    for (const auto& q : mine) {
      if (q.encoded_key == wanted) purge.push_back(q.encoded_key);
    }
    if (purge.empty()) {
      out.status = ToRpc(absl::NotFoundError("no such quarantined cache"));
      return;
    }
  }
  for (const std::string& k : purge) {
    absl::Status s = ctx_->store->PurgeQuarantined(k);
    if (absl::IsNotFound(s)) continue;  // purged meanwhile by another call
    if (!s.ok()) {
      out.status = ToRpc(s);
      return;
    }
    ++out.purged;
  }
  if (!all && out.purged == 0) out.status = ToRpc(absl::NotFoundError("no such quarantined cache"));
}

// ---------------------------------------------------------------------------------------------
// Prefix reuse: runs of chunk caches keyed by chained block hashes

namespace {

// The keys of a prefix request as the tenant's cache keys, or InvalidArgument.
absl::StatusOr<std::vector<CacheKey>> PrefixKeys(const std::string& tenant,
                                                 const std::string& model_id,
                                                 const std::vector<std::string>& keys) {
  if (keys.size() > static_cast<size_t>(rpc::g_kvcomp_constants.MAX_PREFIX_KEYS)) {
    return absl::InvalidArgumentError(absl::StrCat(keys.size(), " keys in one request; at most ",
                                                   rpc::g_kvcomp_constants.MAX_PREFIX_KEYS));
  }
  std::vector<CacheKey> out;
  out.reserve(keys.size());
  for (const std::string& k : keys) {
    CacheKey key{tenant, model_id, k};
    KVCOMP_RETURN_IF_ERROR(key.Validate());
    out.push_back(std::move(key));
  }
  return out;
}

constexpr int64_t kDefaultChunkReplyBytes = int64_t{64} << 20;
// Chunk gets in flight at once per request (through the serve pool, which keeps tenants fair).
constexpr size_t kChunkGetWave = 8;

thread_local std::vector<ReplyBudget::Reservation> held_for_reply;

}  // namespace

// ---------------------------------------------------------------------------------------------
// ReplyBudget

ReplyBudget::Reservation& ReplyBudget::Reservation::operator=(Reservation&& o) noexcept {
  if (this != &o) {
    Release();
    budget_ = o.budget_;
    tenant_ = std::move(o.tenant_);
    bytes_ = o.bytes_;
    o.budget_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

bool ReplyBudget::Reservation::Resize(uint64_t bytes) {
  if (budget_ == nullptr) return false;
  if (bytes > bytes_) {
    if (!budget_->Add(tenant_, bytes - bytes_)) return false;
  } else if (bytes < bytes_) {
    budget_->Sub(tenant_, bytes_ - bytes);
  }
  bytes_ = bytes;
  return true;
}

void ReplyBudget::Reservation::Release() {
  if (budget_ != nullptr && bytes_ > 0) budget_->Sub(tenant_, bytes_);
  budget_ = nullptr;
  bytes_ = 0;
}

bool ReplyBudget::TryReserve(const std::string& tenant, uint64_t bytes, Reservation* out) {
  out->Release();
  if (!Add(tenant, bytes)) return false;
  out->budget_ = this;
  out->tenant_ = tenant;
  out->bytes_ = bytes;
  return true;
}

bool ReplyBudget::Add(const std::string& tenant, uint64_t bytes) {
  if (bytes == 0) return true;
  absl::MutexLock lock(&mu_);
  uint64_t& held = held_[tenant];
  if (bytes > tenant_bytes_ - std::min(held, tenant_bytes_)) {
    if (held == 0) held_.erase(tenant);
    return false;
  }
  held += bytes;
  return true;
}

void ReplyBudget::Sub(const std::string& tenant, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(tenant);
  if (it == held_.end()) return;
  it->second -= std::min(it->second, bytes);  // bytes is never more than was added
  if (it->second == 0) held_.erase(it);
}

uint64_t ReplyBudget::held(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(tenant);
  return it == held_.end() ? 0 : it->second;
}

void ReplyBudget::HoldForReply(Reservation r) {
  if (r.bytes() > 0) held_for_reply.push_back(std::move(r));
}

uint64_t ReplyBudget::ReleaseHeldReplies() {
  uint64_t bytes = 0;
  for (const Reservation& r : held_for_reply) bytes += r.bytes();
  held_for_reply.clear();
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// Prefix calls

void ControlHandler::LookupPrefix(rpc::LookupPrefixResponse& out, const rpc::Auth& auth,
                                  const std::string& model_id,
                                  const std::vector<std::string>& keys) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  absl::Time t0 = absl::Now();
  absl::StatusOr<std::vector<CacheKey>> cache_keys = PrefixKeys(tenant, model_id, keys);
  absl::Status s = cache_keys.status();
  int32_t held = 0;
  if (s.ok()) {
    for (const CacheKey& key : *cache_keys) {
      absl::StatusOr<storage::LookupResult> r = ctx_->store->Lookup(key);
      if (r.ok()) {
        ++held;
        continue;
      }
      if (!absl::IsNotFound(r.status())) s = r.status();
      break;
    }
  }
  ctx_->metrics->ObserveOp(Op::kLookup, absl::ToDoubleSeconds(absl::Now() - t0));
  if (!s.ok()) {
    ctx_->metrics->CountError("lookup", s);
    out.status = ToRpc(s);
    return;
  }
  ctx_->metrics->CountRead("prefix_lookup", tenant, model_id, keys.size(),
                           static_cast<uint64_t>(held));
  out.held = held;
}

// GetChunks gathers its reply in waves of up to kChunkGetWave distinct caches. Before a cache is
// read, its size from the store's index (stored bytes; for a decoded reply its original bytes,
// which bound the decoded K and V) is accounted against the call's bound and the tenant's; once
// read, in its real size. A key repeated in the call is read once and its payload kept until its
// last copy is in the reply; every copy counts against the call's bound. What the tenant holds
// for the reply is released once the reply has been serialized (ReleaseHeldReplies).
void ControlHandler::GetChunks(rpc::GetChunksResponse& out, const rpc::Auth& auth,
                               const std::string& model_id, const std::vector<std::string>& keys,
                               bool decoded, int64_t max_bytes) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  absl::StatusOr<std::vector<CacheKey>> cache_keys = PrefixKeys(tenant, model_id, keys);
  if (!cache_keys.ok()) {
    ctx_->metrics->CountError("get", cache_keys.status());
    out.status = ToRpc(cache_keys.status());
    return;
  }
  const std::vector<CacheKey>& ck = *cache_keys;
  const size_t n = ck.size();
  const uint64_t call_bound = ctx_->options.control_plane.max_reply_bytes;
  const uint64_t soft_limit =
      static_cast<uint64_t>(max_bytes <= 0 ? kDefaultChunkReplyBytes : max_bytes);
  // Hit, partial or miss by the caches answered, unless the request failed or stopped at the
  // reply's bound (the caller asks again for the rest: that request counts).
  absl::Cleanup count_read = [&] {
    if (out.status.code == rpc::StatusCode::OK && !out.truncated) {
      ctx_->metrics->CountRead("chunk_get", tenant, model_id, keys.size(), out.caches.size());
    }
  };
  const Representation rep = decoded ? Representation::kDecoded : Representation::kStored;
  // Ends the reply: an error when nothing was gathered, else a truncated reply.
  auto stop = [&](const absl::Status& why) {
    if (out.caches.empty()) {
      ctx_->metrics->CountError("get", why);
      out.status = ToRpc(why);
    } else {
      out.truncated = true;
    }
  };
  auto over_call_bound = [&](uint64_t bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a reply of ", bytes, " bytes would pass control_plane.max_reply_bytes (",
                     call_bound, "); get the cache over the data plane"));
  };
  auto over_tenant_bound = [&]() {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this tenant's control-plane replies in progress hold ", replies_.held(tenant),
        " bytes of control_plane.tenant_reply_bytes (", replies_.tenant_bytes(), "); retry"));
  };
  absl::flat_hash_map<std::string, size_t> uses;  // copies of each key still to add
  for (const CacheKey& k : ck) ++uses[k.key];
  ReplyBudget::Reservation held;  // the tenant's bytes this call holds: payloads and the reply
  replies_.TryReserve(tenant, 0, &held);
  uint64_t gathered = 0;                                       // bytes in out.caches
  absl::flat_hash_map<std::string, storage::Payload> fetched;  // read, copies still to add
  absl::flat_hash_map<std::string, absl::Status> failed;       // reads that failed
  size_t next = 0;                                             // the next key to add
  // Gathers the reply; returning ends it (the run ends, or stop() said why).
  [&] {
    while (next < n) {
      // Plan a wave from `next`: keys whose sizes fit what the call may still gather, at most
      // kChunkGetWave of them read.
      std::vector<size_t> to_read;
      absl::flat_hash_map<std::string, uint64_t> planned_sizes;
      uint64_t planned = gathered;
      size_t end = next;
      for (; end < n && to_read.size() < kChunkGetWave && planned < soft_limit; ++end) {
        const std::string& k = ck[end].key;
        if (auto it = fetched.find(k); it != fetched.end()) {
          planned += it->second.size();
          continue;
        }
        if (auto it = planned_sizes.find(k); it != planned_sizes.end()) {
          planned += it->second;
          continue;
        }
        absl::StatusOr<storage::LookupResult> where = ctx_->store->Lookup(ck[end]);
        if (!where.ok()) {
          if (end > next) break;  // the next wave starts at it
          if (!absl::IsNotFound(where.status())) stop(where.status());
          return;  // not held: the run ends here
        }
        const uint64_t estimate =
            rep == Representation::kStored
                ? where->meta.stored_bytes
                : std::max(where->meta.original_bytes, where->meta.stored_bytes);
        // The reply's first cache is read when its stored bytes fit (decoding may shrink it); its
        // real size decides below.
        const uint64_t least =
            out.caches.empty() && end == next ? where->meta.stored_bytes : estimate;
        if (planned + least > call_bound) {
          if (end > next) break;
          stop(over_call_bound(planned + least));
          return;
        }
        if (!held.Resize(held.bytes() + std::min(estimate, call_bound))) {
          if (end > next) break;
          stop(over_tenant_bound());
          return;
        }
        planned_sizes[k] = std::min(estimate, call_bound);
        to_read.push_back(end);
        planned += estimate;
      }
      if (!to_read.empty()) {
        std::vector<absl::StatusOr<storage::Payload>> got;
        got.reserve(to_read.size());
        for (size_t i = 0; i < to_read.size(); ++i)
          got.emplace_back(absl::UnknownError("not read"));
        absl::BlockingCounter pending(static_cast<int>(to_read.size()));
        for (size_t i = 0; i < to_read.size(); ++i) {
          ctx_->service->Get(ck[to_read[i]], rep,
                             [&got, &pending, i](absl::StatusOr<storage::Payload> r) {
                               got[i] = std::move(r);
                               pending.DecrementCount();
                             });
        }
        pending.Wait();
        ctx_->gets_total.fetch_add(to_read.size());
        // The reservation follows the real sizes read.
        uint64_t reserved = held.bytes();
        for (size_t i = 0; i < to_read.size(); ++i) {
          const std::string& k = ck[to_read[i]].key;
          reserved -= planned_sizes[k];
          if (got[i].ok()) {
            reserved += got[i]->size();
            fetched.emplace(k, std::move(*got[i]));
          } else {
            failed.emplace(k, got[i].status());
          }
        }
        // Past the tenant's bound only when a read was larger than its estimate: the copies
        // below are still checked one by one.
        held.Resize(reserved);
      }
      // Add keys [next, end) to the reply, in order.
      for (; next < end; ++next) {
        const std::string& k = ck[next].key;
        auto it = fetched.find(k);
        if (it == fetched.end()) {
          auto f = failed.find(k);
          const absl::Status why = f != failed.end() ? f->second : absl::UnknownError("not read");
          if (absl::IsNotFound(why)) return;  // the run ends here
          ctx_->errors_total.fetch_add(1);
          stop(why);
          return;
        }
        const uint64_t size = it->second.size();
        if (gathered + size > call_bound) {
          stop(over_call_bound(gathered + size));
          return;
        }
        if (!held.Resize(held.bytes() + size)) {  // the reply's copy
          stop(over_tenant_bound());
          return;
        }
        out.caches.emplace_back(it->second.view());
        gathered += size;
        if (--uses[k] == 0) {  // its last copy: the payload goes
          held.Resize(held.bytes() - std::min(held.bytes(), size));
          fetched.erase(it);
        }
        if (gathered >= soft_limit && next + 1 < n) {
          out.truncated = true;
          break;
        }
      }
      if (out.truncated) break;
    }
  }();
  // The reply's bytes stay held until it is serialized.
  fetched.clear();
  held.Resize(gathered);
  ReplyBudget::HoldForReply(std::move(held));
}

}  // namespace service
}  // namespace kvcomp
