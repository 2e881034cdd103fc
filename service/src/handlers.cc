#include "handlers.h"

#include <algorithm>
#include <utility>

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

rpc::Status ToRpc(const absl::Status& status) {
  rpc::Status out;
  out.code = static_cast<rpc::StatusCode::type>(static_cast<int>(status.code()));
  out.message = std::string(status.message());
  return out;
}

rpc::Policy ToRpc(const CompressionPolicy& p) { return PolicyToRpc(p); }

absl::StatusOr<CompressionPolicy> FromRpc(const rpc::Policy& r) { return PolicyFromRpc(r); }

absl::StatusOr<std::string> ControlHandler::Authenticate(const rpc::Auth& auth) {
  auto tenant = ctx_->tokens->Authenticate(auth.tenant, auth.token);
  if (!tenant.ok()) ctx_->metrics->CountAuthFailure("control");
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
  auto listed = ctx_->store->List(tenant);
  if (!listed.ok()) {
    out.status = ToRpc(listed.status());
    return;
  }
  out.caches = static_cast<int64_t>(listed->size());
  for (const auto& c : *listed) {
    out.original_bytes += static_cast<int64_t>(c.info.meta.original_bytes);
    out.stored_bytes += static_cast<int64_t>(c.info.meta.stored_bytes);
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
        "calibration is not available in this build (KVSplice calibration)"));
    return;
  }
  CalibrationRequest req;
  req.tenant = tenant;
  req.model_id = request.model_id;
  req.value_codec = request.value_codec;
  req.rank = static_cast<uint32_t>(std::max<int64_t>(0, request.rank));
  req.error_budget = request.error_budget;
  req.max_caches = static_cast<uint64_t>(std::max<int64_t>(0, request.max_caches));
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

void ControlHandler::ListQuarantined(rpc::ListQuarantinedResponse& out, const rpc::Auth& auth) {
  KVCOMP_CONTROL_AUTH(tenant, out);
  for (const storage::QuarantinedCache& q : QuarantinedOf(tenant)) {
    rpc::QuarantinedEntry e;
    auto key = CacheKey::Decode(q.encoded_key);
    if (key.ok()) {
      e.model_id = key->model_id;
      e.key = key->key;
    } else {
      e.key = q.encoded_key;
    }
    e.reason = q.reason;
    out.entries.push_back(std::move(e));
  }
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

}  // namespace

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
  out.held = held;
}

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
  const int64_t limit = max_bytes <= 0 ? kDefaultChunkReplyBytes : max_bytes;
  const Representation rep = decoded ? Representation::kDecoded : Representation::kStored;
  int64_t gathered = 0;
  for (size_t begin = 0; begin < cache_keys->size(); begin += kChunkGetWave) {
    const size_t n = std::min(kChunkGetWave, cache_keys->size() - begin);
    std::vector<absl::StatusOr<storage::Payload>> got;
    got.reserve(n);
    for (size_t i = 0; i < n; ++i) got.emplace_back(absl::UnknownError("not served"));
    absl::BlockingCounter pending(static_cast<int>(n));
    for (size_t i = 0; i < n; ++i) {
      ctx_->service->Get((*cache_keys)[begin + i], rep,
                         [&got, &pending, i](absl::StatusOr<storage::Payload> r) {
                           got[i] = std::move(r);
                           pending.DecrementCount();
                         });
    }
    pending.Wait();
    ctx_->gets_total.fetch_add(n);
    for (size_t i = 0; i < n; ++i) {
      if (!got[i].ok()) {
        if (absl::IsNotFound(got[i].status())) return;  // the run ends here
        ctx_->errors_total.fetch_add(1);
        if (out.caches.empty()) {
          out.status = ToRpc(got[i].status());
        } else {
          out.truncated = true;  // what was gathered is good; the caller asks for the rest
        }
        return;
      }
      const storage::Payload& bytes = *got[i];
      out.caches.emplace_back(bytes.view());
      gathered += static_cast<int64_t>(bytes.size());
      if (gathered >= limit && begin + i + 1 < cache_keys->size()) {
        out.truncated = true;
        return;
      }
    }
  }
}

}  // namespace service
}  // namespace kvcomp
