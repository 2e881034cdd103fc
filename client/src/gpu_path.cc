#include "gpu_path.h"

#include <cstdio>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "control.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/gpu_link.h"

namespace kvcomp {
namespace client {

using transport::GpuRuntime;
using transport::NcclLink;

struct GpuPath::Channel {
  std::string control;
  std::string data;
  int device = 0;
  uint64_t id = 0;
  uint64_t max_transfer_bytes = 0;
  absl::Duration transfer_timeout;
  absl::Mutex mu;  // one transfer at a time
  std::unique_ptr<NcclLink> link ABSL_GUARDED_BY(mu);
};

namespace {

absl::StatusOr<GpuRuntime*> Runtime() {
  absl::StatusOr<GpuRuntime*> rt = GpuRuntime::Get();
  if (!rt.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("device memory needs a CUDA driver and device: ", rt.status().message()));
  }
  return rt;
}

// The one device all `ptrs` are on.
absl::StatusOr<int> DeviceOfAll(GpuRuntime* rt, const std::vector<const void*>& ptrs) {
  int device = -1;
  for (size_t i = 0; i < ptrs.size(); ++i) {
    if (ptrs[i] == nullptr) return absl::InvalidArgumentError(absl::StrCat("null pointer ", i));
    absl::StatusOr<int> d = rt->DeviceOf(ptrs[i]);
    if (!d.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("pointer ", i, " is not CUDA device memory: ", d.status().message()));
    }
    if (device >= 0 && *d != device) {
      return absl::InvalidArgumentError(
          absl::StrCat("pointers on CUDA devices ", device, " and ", *d, ": one device expected"));
    }
    device = *d;
  }
  return device;
}

// The one device every layer's keys and values are on (DeviceLayerData or DeviceLayerOut).
template <typename Layer>
absl::StatusOr<int> DeviceOfLayers(GpuRuntime* rt, const std::vector<Layer>& layers) {
  std::vector<const void*> ptrs;
  for (const Layer& l : layers) {
    ptrs.push_back(l.keys);
    ptrs.push_back(l.values);
  }
  return DeviceOfAll(rt, ptrs);
}

absl::Status CheckShape(const KvLayout& layout, uint64_t num_tokens, size_t layers) {
  KVCOMP_RETURN_IF_ERROR(layout.Validate());
  if (num_tokens == 0 || num_tokens > KvLayout::kMaxTokens) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens ", num_tokens, " out of range"));
  }
  if (layers != layout.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("got ", layers, " layers, the layout has ", layout.num_layers));
  }
  return absl::OkStatus();
}

bool SameLayout(const KvLayout& a, const KvLayout& b) {
  return a.num_layers == b.num_layers && a.num_kv_heads == b.num_kv_heads &&
         a.num_q_heads == b.num_q_heads && a.head_dim == b.head_dim && a.dtype == b.dtype;
}

// Pinned host memory for a fallback copy, freed on scope exit.
struct Pinned {
  GpuRuntime* rt;
  void* ptr = nullptr;
  ~Pinned() { rt->FreePinned(ptr); }
  uint8_t* bytes() const { return static_cast<uint8_t*>(ptr); }
};

// A decoded cache that kept every token as dense K then V (each [layer][head][token][dim]).
absl::Status DenseFromCache(const CompressedCache& cache, const KvLayout& layout,
                            uint64_t num_tokens, uint8_t* out) {
  if (!SameLayout(cache.layout, layout) || cache.original_tokens != num_tokens) {
    return absl::InvalidArgumentError("the cache's layout or token count differs from the call's");
  }
  return cache.WriteDenseKv(out);
}

// The timed transfer's seconds; 0 when the timer cannot tell.
double SecondsOf(GpuRuntime::Timer& timer) {
  absl::StatusOr<double> secs = timer.Seconds(absl::Now() + absl::Seconds(1));
  return secs.ok() ? *secs : 0;
}

bool Refused(const absl::Status& s) {
  return absl::IsUnauthenticated(s) || absl::IsPermissionDenied(s);
}

}  // namespace

GpuPath::GpuPath(const ClientOptions& options, Client* self, RankingFn ranking, FetchFn fetch)
    : options_(options), self_(self), ranking_(std::move(ranking)), fetch_(std::move(fetch)) {}

GpuPath::~GpuPath() {
  std::map<std::pair<std::string, int>, std::shared_ptr<Channel>> channels;
  {
    absl::MutexLock lock(&mu_);
    channels.swap(channels_);
  }
  ClientOptions quick = options_;
  quick.request_timeout = std::min(options_.request_timeout, absl::Seconds(2));
  for (auto& [key, c] : channels) {
    (void)ControlCloseGpuChannel(c->control, quick, c->id);  // the daemon's side goes first
    absl::MutexLock lock(&c->mu);
    if (c->link) c->link->Abort();
  }
}

GpuChannelStats GpuPath::Stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void GpuPath::NoteFallback(const std::string& endpoint, const absl::Status& why, bool put) {
  std::string reason(why.message());
  bool log = false;
  {
    absl::MutexLock lock(&mu_);
    (put ? stats_.fallback_puts : stats_.fallback_gets)++;
    stats_.last_fallback_reason = reason;
    std::string& last = logged_[endpoint];
    log = last != reason;
    last = reason;
  }
  if (log) {
    std::fprintf(stderr,
                 "kvcomp: no GPU channel to %s (%s); device puts and gets go through host memory "
                 "over UCX\n",
                 endpoint.c_str(), reason.c_str());
  }
}

void GpuPath::Drop(const std::shared_ptr<Channel>& channel, const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    auto it = channels_.find({channel->control, channel->device});
    if (it != channels_.end() && it->second == channel) channels_.erase(it);
    stats_.channel_failures++;
  }
  std::fprintf(stderr, "kvcomp: GPU channel %llu to %s closed: %s\n",
               static_cast<unsigned long long>(channel->id), channel->data.c_str(),
               std::string(why.message()).c_str());
}

absl::StatusOr<std::shared_ptr<GpuPath::Channel>> GpuPath::ChannelFor(
    const EndpointAddress& endpoint, int device, bool* hard) {
  const std::pair<std::string, int> key{endpoint.control, device};
  {
    absl::MutexLock lock(&mu_);
    auto it = channels_.find(key);
    if (it != channels_.end()) return it->second;
    auto r = refused_.find(key);
    if (r != refused_.end() && absl::Now() < r->second.until) return r->second.why;
  }
  auto refuse = [&](absl::Status why) {
    absl::MutexLock lock(&mu_);
    refused_[key] = Refusal{why, absl::Now() + options_.down_for * 15};
    return why;
  };
  if (endpoint.control.empty()) {
    return refuse(absl::FailedPreconditionError(absl::StrCat(
        "endpoint ", endpoint.data,
        " has no control address (give \"data,control\"): the GPU channel is negotiated there")));
  }
  if (absl::Status s = GpuRuntime::LoadNccl(); !s.ok()) return refuse(s);
  KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, Runtime());
  KVCOMP_ASSIGN_OR_RETURN(std::string uuid, rt->DeviceUuid(device));
  absl::StatusOr<GpuChannelGrant> grant =
      ControlOpenGpuChannel(endpoint.control, options_, rt->nccl_version(), uuid);
  if (!grant.ok()) {
    if (Refused(grant.status())) {
      *hard = true;
      return grant.status();
    }
    return refuse(absl::Status(grant.status().code(),
                               absl::StrCat("the daemon refused the GPU channel: ",
                                            grant.status().message())));
  }
  absl::StatusOr<std::unique_ptr<NcclLink>> link =
      NcclLink::Join(grant->nccl_unique_id, 1, device, grant->transfer_timeout);
  if (!link.ok()) {
    (void)ControlCloseGpuChannel(endpoint.control, options_, grant->channel_id);
    return refuse(absl::UnavailableError(absl::StrCat(
        "the daemon's GPU is not reachable over NCCL: ", link.status().message())));
  }
  auto channel = std::make_shared<Channel>();
  channel->control = endpoint.control;
  channel->data = endpoint.data;
  channel->device = device;
  channel->id = grant->channel_id;
  channel->max_transfer_bytes = grant->max_transfer_bytes;
  channel->transfer_timeout = grant->transfer_timeout;
  {
    absl::MutexLock lock(&channel->mu);
    channel->link = *std::move(link);
  }
  absl::MutexLock lock(&mu_);
  refused_.erase(key);
  auto [it, inserted] = channels_.emplace(key, channel);
  if (inserted) stats_.channels_opened++;
  return it->second;  // a channel another thread opened meanwhile wins; ours is destroyed
}

absl::Status GpuPath::Probe(const EndpointAddress& endpoint, int device) {
  bool hard = false;
  return ChannelFor(endpoint, device, &hard).status();
}

absl::StatusOr<PutResult> GpuPath::Put(absl::string_view model_id, absl::string_view key,
                                       const KvLayout& layout, uint64_t num_tokens,
                                       const std::vector<DeviceLayerData>& layers, void* stream,
                                       const PutOptions& options) {
  KVCOMP_RETURN_IF_ERROR(CheckShape(layout, num_tokens, layers.size()));
  if (options.block_wise) {
    return absl::InvalidArgumentError("block-wise puts are streamed: use OpenPutStream");
  }
  if (options.policy) KVCOMP_RETURN_IF_ERROR(options.policy->ValidateFor(layout.head_dim));
  KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, Runtime());
  KVCOMP_ASSIGN_OR_RETURN(int device, DeviceOfLayers(rt, layers));
  KVCOMP_ASSIGN_OR_RETURN(std::vector<EndpointAddress> ranking, ranking_(model_id, key));
  const uint64_t layer_bytes = layout.LayerBytes(num_tokens);
  const uint64_t payload = layout.CacheBytes(num_tokens);

  absl::Status why;
  std::string fallback_endpoint = ranking.empty() ? "" : ranking[0].data;
  if (options_.replicas > 1) {
    why = absl::FailedPreconditionError("replicas > 1: copies go over the data plane");
  } else if (ranking.empty()) {
    why = absl::UnavailableError("no endpoint");
  }
  for (int attempt = 0; why.ok() && attempt < 2; ++attempt) {
    bool hard = false;
    absl::StatusOr<std::shared_ptr<Channel>> channel = ChannelFor(ranking[0], device, &hard);
    if (!channel.ok()) {
      if (hard) return channel.status();
      why = channel.status();
      break;
    }
    Channel& c = **channel;
    if (payload > c.max_transfer_bytes) {
      why = absl::FailedPreconditionError(absl::StrCat(
          "a payload of ", payload, " bytes exceeds the GPU channel's ", c.max_transfer_bytes));
      break;
    }
    absl::MutexLock lock(&c.mu);
    if (c.link == nullptr || c.link->broken()) {
      Drop(*channel, absl::UnavailableError("link broken"));
      continue;
    }
    GpuPutHeader header{std::string(model_id), std::string(key), layout, num_tokens,
                        options.policy, payload};
    absl::StatusOr<uint64_t> transfer = ControlGpuPutBegin(c.control, options_, c.id, header);
    if (!transfer.ok()) {
      if (absl::IsNotFound(transfer.status()) || absl::IsUnavailable(transfer.status())) {
        c.link->Abort();  // the daemon closed it (idle, timeout, restart)
        Drop(*channel, transfer.status());
        continue;
      }
      return transfer.status();  // the daemon refused the put itself: say why
    }
    KVCOMP_RETURN_IF_ERROR(rt->SetDevice(device));
    KVCOMP_ASSIGN_OR_RETURN(std::unique_ptr<GpuRuntime::Timer> timer, rt->NewTimer());
    std::vector<NcclLink::Chunk> chunks;
    for (const DeviceLayerData& l : layers) chunks.push_back({const_cast<void*>(l.keys), layer_bytes});
    for (const DeviceLayerData& l : layers) {
      chunks.push_back({const_cast<void*>(l.values), layer_bytes});
    }
    const absl::Time deadline = absl::Now() + c.transfer_timeout;
    absl::Status s = timer->Start(stream);
    if (s.ok()) s = c.link->Send(chunks, stream);
    if (s.ok()) s = c.link->Enqueued(deadline);
    if (s.ok()) s = timer->Stop(stream);
    absl::StatusOr<PutResult> result =
        s.ok() ? ControlGpuPutFinish(c.control, options_, c.id, *transfer)
               : absl::StatusOr<PutResult>(s);
    if (!result.ok()) {
      // The transfer failed or the daemon went away mid-transfer: abort, so that nothing stays
      // queued on the caller's stream waiting for a peer that is gone.
      c.link->Abort();
      Drop(*channel, result.status());
      return result.status();
    }
    s = c.link->Wait(stream, deadline + c.transfer_timeout);
    if (!s.ok()) Drop(*channel, s);  // acknowledged by the daemon: the put stands
    result->transfer_seconds = SecondsOf(*timer);
    result->path = "nccl";
    result->endpoints = {c.data};
    absl::MutexLock stats(&mu_);
    stats_.nccl_puts++;
    return result;
  }
  if (why.ok()) why = absl::UnavailableError("the GPU channel failed twice");
  NoteFallback(fallback_endpoint, why, /*put=*/true);

  // Through host memory: copied on the caller's stream, then an ordinary put.
  KVCOMP_RETURN_IF_ERROR(rt->SetDevice(device));
  KVCOMP_ASSIGN_OR_RETURN(void* host, rt->AllocPinned(payload));
  Pinned pinned{rt, host};
  std::vector<LayerData> host_layers(layout.num_layers);
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    uint8_t* k = pinned.bytes() + l * layer_bytes;
    uint8_t* v = pinned.bytes() + (layout.num_layers + l) * layer_bytes;
    KVCOMP_RETURN_IF_ERROR(rt->CopyAsync(k, layers[l].keys, layer_bytes,
                                         GpuRuntime::Copy::kDeviceToHost, stream));
    KVCOMP_RETURN_IF_ERROR(rt->CopyAsync(v, layers[l].values, layer_bytes,
                                         GpuRuntime::Copy::kDeviceToHost, stream));
    host_layers[l] = LayerData{k, v};
  }
  KVCOMP_RETURN_IF_ERROR(rt->WaitStream(stream, absl::Now() + options_.request_timeout));
  KVCOMP_ASSIGN_OR_RETURN(PutResult r,
                          self_->Put(model_id, key, layout, num_tokens, host_layers, options));
  r.path = "ucx";
  return r;
}

absl::StatusOr<std::optional<DeviceGetResult>> GpuPath::NcclGet(
    const std::vector<EndpointAddress>& ranking, GpuRuntime* rt, int device,
    absl::string_view model_id, absl::string_view key, GpuGetForm form, uint64_t capacity,
    void* stream, absl::FunctionRef<ChunksFn> place) {
  absl::Status why = ranking.empty() ? absl::UnavailableError("no endpoint") : absl::OkStatus();
  bool log = true;
  for (int attempt = 0; why.ok() && attempt < 2; ++attempt) {
    bool hard = false;
    absl::StatusOr<std::shared_ptr<Channel>> channel = ChannelFor(ranking[0], device, &hard);
    if (!channel.ok()) {
      if (hard) return channel.status();
      why = channel.status();
      break;
    }
    Channel& c = **channel;
    absl::MutexLock lock(&c.mu);
    if (c.link == nullptr || c.link->broken()) {
      Drop(*channel, absl::UnavailableError("link broken"));
      continue;
    }
    absl::StatusOr<GpuGetGrant> grant =
        ControlGpuGet(c.control, options_, c.id, model_id, key, form, capacity);
    if (!grant.ok()) {
      const absl::Status& e = grant.status();
      const bool channel_gone =
          (absl::IsNotFound(e) && e.message().find("GPU channel") != absl::string_view::npos) ||
          absl::IsUnavailable(e);
      if (channel_gone) {
        c.link->Abort();
        Drop(*channel, e);
        continue;
      }
      if (absl::IsNotFound(e)) {  // not on the first endpoint: the data plane walks the ranking
        why = e;
        log = false;
        break;
      }
      return e;
    }
    absl::StatusOr<std::vector<NcclLink::Chunk>> chunks = place(*grant);
    if (!chunks.ok()) {
      c.link->Abort();  // its send is posted and will not be received
      Drop(*channel, chunks.status());
      return chunks.status();
    }
    KVCOMP_RETURN_IF_ERROR(rt->SetDevice(device));
    KVCOMP_ASSIGN_OR_RETURN(std::unique_ptr<GpuRuntime::Timer> timer, rt->NewTimer());
    const absl::Time deadline = absl::Now() + c.transfer_timeout;
    absl::Status s = timer->Start(stream);
    if (s.ok()) s = c.link->Recv(*chunks, stream);
    if (s.ok()) s = c.link->Enqueued(deadline);
    if (s.ok()) s = timer->Stop(stream);
    if (s.ok()) s = c.link->Wait(stream, deadline);
    if (!s.ok()) {
      Drop(*channel, s);
      return s;
    }
    (void)ControlGpuGetFinish(c.control, options_, c.id, grant->transfer_id);
    DeviceGetResult out;
    out.bytes = grant->payload_bytes;
    out.path = "nccl";
    out.transfer_seconds = SecondsOf(*timer);
    absl::MutexLock stats(&mu_);
    stats_.nccl_gets++;
    return out;
  }
  if (why.ok()) why = absl::UnavailableError("the GPU channel failed twice");
  if (log) {
    NoteFallback(ranking.empty() ? "" : ranking[0].data, why, /*put=*/false);
  } else {
    absl::MutexLock stats(&mu_);
    stats_.fallback_gets++;
  }
  return std::nullopt;
}

absl::StatusOr<DeviceGetResult> GpuPath::GetKv(absl::string_view model_id, absl::string_view key,
                                               const KvLayout& layout, uint64_t num_tokens,
                                               const std::vector<DeviceLayerOut>& layers,
                                               void* stream) {
  KVCOMP_RETURN_IF_ERROR(CheckShape(layout, num_tokens, layers.size()));
  KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, Runtime());
  KVCOMP_ASSIGN_OR_RETURN(int device, DeviceOfLayers(rt, layers));
  KVCOMP_ASSIGN_OR_RETURN(std::vector<EndpointAddress> ranking, ranking_(model_id, key));
  const uint64_t layer_bytes = layout.LayerBytes(num_tokens);
  const uint64_t payload = layout.CacheBytes(num_tokens);

  KVCOMP_ASSIGN_OR_RETURN(
      std::optional<DeviceGetResult> nccl,
      NcclGet(ranking, rt, device, model_id, key, GpuGetForm::kDenseKv, payload, stream,
              [&](const GpuGetGrant& grant) -> absl::StatusOr<std::vector<NcclLink::Chunk>> {
                if (!SameLayout(grant.layout, layout) || grant.num_tokens != num_tokens ||
                    grant.payload_bytes != payload) {
                  return absl::InvalidArgumentError(absl::StrCat(
                      "the cache has ", grant.num_tokens, " tokens of another layout than the "
                      "call's (", grant.payload_bytes, " bytes, ", payload, " expected)"));
                }
                std::vector<NcclLink::Chunk> chunks;
                for (const DeviceLayerOut& l : layers) chunks.push_back({l.keys, layer_bytes});
                for (const DeviceLayerOut& l : layers) chunks.push_back({l.values, layer_bytes});
                return chunks;
              }));
  if (nccl) return *std::move(nccl);

  KVCOMP_ASSIGN_OR_RETURN(CompressedCache cache, self_->GetDecoded(model_id, key));
  KVCOMP_RETURN_IF_ERROR(rt->SetDevice(device));
  KVCOMP_ASSIGN_OR_RETURN(void* host, rt->AllocPinned(payload));
  Pinned pinned{rt, host};
  KVCOMP_RETURN_IF_ERROR(DenseFromCache(cache, layout, num_tokens, pinned.bytes()));
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    KVCOMP_RETURN_IF_ERROR(rt->CopyAsync(layers[l].keys, pinned.bytes() + l * layer_bytes,
                                         layer_bytes, GpuRuntime::Copy::kHostToDevice, stream));
    KVCOMP_RETURN_IF_ERROR(
        rt->CopyAsync(layers[l].values, pinned.bytes() + (layout.num_layers + l) * layer_bytes,
                      layer_bytes, GpuRuntime::Copy::kHostToDevice, stream));
  }
  // The pinned copy must outlive the copies: wait for them (an event on the caller's stream).
  KVCOMP_RETURN_IF_ERROR(rt->WaitStream(stream, absl::Now() + options_.request_timeout));
  DeviceGetResult out;
  out.bytes = payload;
  out.path = "ucx";
  return out;
}

absl::StatusOr<DeviceGetResult> GpuPath::GetBytes(absl::string_view model_id,
                                                  absl::string_view key, void* dst,
                                                  size_t capacity, void* stream, bool decoded) {
  if (capacity == 0) return absl::InvalidArgumentError("zero capacity");
  KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, Runtime());
  KVCOMP_ASSIGN_OR_RETURN(int device, DeviceOfAll(rt, {dst}));
  KVCOMP_ASSIGN_OR_RETURN(std::vector<EndpointAddress> ranking, ranking_(model_id, key));
  KVCOMP_ASSIGN_OR_RETURN(
      std::optional<DeviceGetResult> nccl,
      NcclGet(ranking, rt, device, model_id, key,
              decoded ? GpuGetForm::kDecoded : GpuGetForm::kStored, capacity, stream,
              [&](const GpuGetGrant& grant) -> absl::StatusOr<std::vector<NcclLink::Chunk>> {
                return std::vector<NcclLink::Chunk>{
                    {dst, static_cast<size_t>(grant.payload_bytes)}};
              }));
  if (nccl) return *std::move(nccl);
  KVCOMP_ASSIGN_OR_RETURN(std::string bytes, fetch_(model_id, key, decoded));
  if (bytes.size() > capacity) {
    return absl::OutOfRangeError(
        absl::StrCat("the cache is ", bytes.size(), " bytes; the buffer holds ", capacity));
  }
  KVCOMP_RETURN_IF_ERROR(rt->SetDevice(device));
  KVCOMP_ASSIGN_OR_RETURN(void* host, rt->AllocPinned(bytes.size()));
  Pinned pinned{rt, host};
  std::memcpy(pinned.bytes(), bytes.data(), bytes.size());
  KVCOMP_RETURN_IF_ERROR(rt->CopyAsync(dst, pinned.bytes(), bytes.size(),
                                       GpuRuntime::Copy::kHostToDevice, stream));
  KVCOMP_RETURN_IF_ERROR(rt->WaitStream(stream, absl::Now() + options_.request_timeout));
  DeviceGetResult out;
  out.bytes = bytes.size();
  out.path = "ucx";
  return out;
}

}  // namespace client
}  // namespace kvcomp
