#include "gpu_path.h"

#include <cstdio>
#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "control.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/gpu_link.h"
#include "kvcomp/transport/payload_link.h"

namespace kvcomp {
namespace client {

using transport::AfterLinkFailure;
using transport::Completion;
using transport::Direction;
using transport::GpuRuntime;
using transport::LinkVerdict;
using transport::MemoryRegion;
using transport::NcclLink;
using transport::NcclPayloadLink;
using transport::UcxClient;
namespace wire = transport::wire;

struct GpuPath::Channel {
  std::string control;
  std::string data;
  int device = 0;
  uint64_t id = 0;
  uint64_t max_transfer_bytes = 0;
  absl::Duration transfer_timeout;
  bool ipc = false;              // mode "ipc": the daemon is on this GPU; no communicator
  void* ipc_event = nullptr;     // mode "ipc": recorded on the caller's stream per transfer
  absl::Mutex mu;
  bool busy ABSL_GUARDED_BY(mu) = false;  // one transfer at a time (a Turn)
  // Mode "nccl", used by the Turn's holder only: the communicator, and the payload link over it
  // that times each whole transfer on the caller's stream.
  std::unique_ptr<NcclLink> link;
  std::unique_ptr<GpuRuntime::Timer> timer;
  std::unique_ptr<NcclPayloadLink> nccl;

  ~Channel() {
    if (ipc_event != nullptr) {
      absl::StatusOr<GpuRuntime*> rt = GpuRuntime::Get();
      if (rt.ok()) (*rt)->DestroyEvent(ipc_event);
    }
  }
};

namespace {

// Posts `chunks` (transfer order) on `link` on `stream` and waits until they are on it (the
// daemon posted its side); the completion says when they are done.
absl::StatusOr<std::shared_ptr<Completion>> PostOn(NcclPayloadLink& link, Direction direction,
                                                   absl::Span<const NcclLink::Chunk> chunks,
                                                   void* stream, absl::Time deadline) {
  transport::Transfer t;
  t.direction = direction;
  for (const NcclLink::Chunk& c : chunks) {
    t.regions.push_back({c.data, c.bytes, transport::MemoryKind::kCuda});
  }
  t.stream = stream;
  t.deadline = deadline;
  KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<Completion> done, link.Post(t));
  KVCOMP_RETURN_IF_ERROR(link.Enqueued(deadline));
  return done;
}

}  // namespace

// A channel's turn: one transfer at a time, held across calls by the layer-by-layer streams.
class GpuPath::Turn {
 public:
  explicit Turn(std::shared_ptr<Channel> c) : c_(std::move(c)) {
    absl::MutexLock lock(&c_->mu);
    c_->mu.Await(absl::Condition(
        +[](bool* busy) { return !*busy; }, &c_->busy));
    c_->busy = true;
  }
  ~Turn() {
    absl::MutexLock lock(&c_->mu);
    c_->busy = false;
  }
  Turn(const Turn&) = delete;
  Turn& operator=(const Turn&) = delete;
  Channel& operator*() const { return *c_; }
  Channel* operator->() const { return c_.get(); }
  const std::shared_ptr<Channel>& channel() const { return c_; }

 private:
  std::shared_ptr<Channel> c_;
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

// The timed transfer's seconds; 0 when the timer cannot tell.
double SecondsOf(GpuRuntime::Timer& timer) {
  absl::StatusOr<double> secs = timer.Seconds(absl::Now() + absl::Seconds(1));
  return secs.ok() ? *secs : 0;
}

bool Refused(const absl::Status& s) {
  return absl::IsUnauthenticated(s) || absl::IsPermissionDenied(s);
}

// The caller's memory of a transfer over CUDA IPC, as the link's description of it
// (CudaIpcLink::Describe); the daemon's copies wait for `c`'s event, recorded here on `stream`
// (after the caller's work so far). Memory the driver cannot share is kMemoryNotMappable (the
// next link moves it).
absl::StatusOr<std::string> Describe(GpuRuntime* rt, const GpuPath::Channel& c,
                                     const std::vector<NcclLink::Chunk>& chunks, void* stream) {
  std::vector<MemoryRegion> regions;
  for (const NcclLink::Chunk& k : chunks) {
    regions.push_back({k.data, k.bytes, transport::MemoryKind::kCuda});
  }
  KVCOMP_ASSIGN_OR_RETURN(std::string described, transport::CudaIpcLink::Describe(rt, regions));
  KVCOMP_RETURN_IF_ERROR(rt->RecordEvent(c.ipc_event, stream));
  return described;
}

// K and V chunks of `layers` in transfer order: every layer's keys then every layer's values,
// or layer by layer.
template <typename Layer>
std::vector<NcclLink::Chunk> ChunksOf(const std::vector<Layer>& layers, uint64_t layer_bytes,
                                      bool layer_major) {
  std::vector<NcclLink::Chunk> chunks;
  auto ptr = [](auto p) { return const_cast<void*>(static_cast<const void*>(p)); };
  if (layer_major) {
    for (const Layer& l : layers) {
      chunks.push_back({ptr(l.keys), layer_bytes});
      chunks.push_back({ptr(l.values), layer_bytes});
    }
    return chunks;
  }
  for (const Layer& l : layers) chunks.push_back({ptr(l.keys), layer_bytes});
  for (const Layer& l : layers) chunks.push_back({ptr(l.values), layer_bytes});
  return chunks;
}

// The data plane's put-begin of a device put.
wire::PutBegin BeginOf(absl::string_view model_id, absl::string_view key, const KvLayout& layout,
                       uint64_t num_tokens, const PutOptions& options) {
  wire::PutBegin b;
  b.layout = layout;
  b.num_tokens = num_tokens;
  b.model_id = std::string(model_id);
  b.key = std::string(key);
  b.has_policy = options.policy.has_value();
  if (options.policy) b.policy = *options.policy;
  return b;
}

// A data-plane put whose one block's K and V go over channel `c` (wire::kBlockLinkPayload):
// PutBegin on `conn` (the channel's endpoint), then the block, sent before this side posts its
// transfer (the daemon posts its side when the block arrives); over CUDA IPC the block names
// the caller's memory. Then the block's answer (the daemon has the K and V) and the commit:
// the put's one lifecycle, admission and replies are the data plane's.
class LinkPut {
 public:
  // Over CUDA IPC `chunks` are the caller's memory (transfer order) and its event is recorded
  // on `stream` first; over NCCL the caller posts the sends after this returns.
  static absl::StatusOr<std::unique_ptr<LinkPut>> Open(std::shared_ptr<UcxClient> conn,
                                                       GpuRuntime* rt, const GpuPath::Channel& c,
                                                       const wire::PutBegin& begin,
                                                       const std::vector<NcclLink::Chunk>& chunks,
                                                       void* stream, bool layer_major) {
    std::string descriptor;
    if (c.ipc) {
      KVCOMP_ASSIGN_OR_RETURN(descriptor, Describe(rt, c, chunks, stream));
    }
    wire::PutBegin linked = begin;
    linked.link_channel = c.id;  // the daemon places the put on the channel's device
    KVCOMP_ASSIGN_OR_RETURN(const uint64_t put_id, conn->PutBegin(linked));
    auto put = std::unique_ptr<LinkPut>(new LinkPut(std::move(conn), put_id));
    wire::Block b;
    b.put_id = put_id;
    b.layer_begin = 0;
    b.layer_end = begin.layout.num_layers;
    b.token_begin = 0;
    b.token_end = begin.num_tokens;
    b.parts = wire::kPartBoth;
    b.key_bytes = begin.layout.CacheBytes(begin.num_tokens) / 2;
    b.value_bytes = b.key_bytes;
    b.flags = wire::kBlockLinkPayload;
    b.link_channel = c.id;
    b.link_layer_major = layer_major;
    std::shared_ptr<Answer> answer = put->answer_;
    put->conn_->SendLinkBlockAsync(b, std::move(descriptor), [answer](absl::Status s) {
      answer->status = std::move(s);
      answer->done.Notify();
    });
    return put;
  }
  ~LinkPut() {
    if (!done_) Abort();
  }

  // The block's answer: OK once the daemon has the K and V (the put is forgotten there after a
  // failure).
  absl::Status Received() {
    answer_->done.WaitForNotification();
    if (!answer_->status.ok()) Abort();
    return answer_->status;
  }
  // After Received: the commit (a failed one is aborted by the daemon).
  absl::StatusOr<PutResult> Commit() {
    done_ = true;
    KVCOMP_ASSIGN_OR_RETURN(wire::CacheSummary sum, conn_->PutCommit(put_id_, 1));
    PutResult out;
    out.original_bytes = sum.original_bytes;
    out.stored_bytes = sum.stored_bytes;
    out.total_kept = sum.total_kept;
    out.transfer_seconds = static_cast<double>(sum.link_ns) * 1e-9;  // the daemon's side
    return out;
  }
  // Forgets the put on the daemon (a block in flight is answered NotFound there).
  void Abort() {
    done_ = true;
    (void)conn_->PutAbort(put_id_);
  }

 private:
  struct Answer {
    absl::Notification done;
    absl::Status status;
  };
  LinkPut(std::shared_ptr<UcxClient> conn, uint64_t put_id)
      : conn_(std::move(conn)), put_id_(put_id) {}

  std::shared_ptr<UcxClient> conn_;
  const uint64_t put_id_;
  std::shared_ptr<Answer> answer_ = std::make_shared<Answer>();
  bool done_ = false;
};

// A get whose payload goes over channel `c` (a data-plane get naming it, protocol 1.5) on
// `conn`, the channel's endpoint: over CUDA IPC the get names the caller's memory `offer`
// (transfer order) and the daemon's copies into it are done when it answers; over NCCL the
// daemon's send is posted when it answers and the caller posts its receive.
absl::StatusOr<wire::GetReply> LinkGet(UcxClient& conn, GpuRuntime* rt, const GpuPath::Channel& c,
                                       absl::string_view model_id, absl::string_view key,
                                       GpuGetForm form, uint64_t capacity,
                                       const std::vector<NcclLink::Chunk>& offer, void* stream,
                                       bool layer_major) {
  std::string descriptor;
  if (c.ipc) {
    KVCOMP_ASSIGN_OR_RETURN(descriptor, Describe(rt, c, offer, stream));
  }
  wire::Get g;
  g.representation = form == GpuGetForm::kDecoded ? wire::Representation::kDecoded
                                                   : wire::Representation::kStored;
  g.model_id = std::string(model_id);
  g.key = std::string(key);
  g.link_channel = c.id;
  g.link_capacity = capacity;
  g.link_dense = form == GpuGetForm::kDenseKv;
  g.link_layer_major = layer_major;
  return conn.GetOverLink(g, std::move(descriptor), absl::InfiniteFuture());
}

// A dense get whose cache has the call's bytes but not its layout: both layouts named (most
// often the q heads: a put's num_q_heads that the get did not repeat).
absl::Status LayoutMismatch(const wire::GetReply& grant, const KvLayout& layout,
                            uint64_t num_tokens, uint64_t payload) {
  return absl::InvalidArgumentError(absl::StrCat(
      "the cache is ", grant.layout.DebugString(), " x ", grant.num_tokens, " tokens (",
      grant.link_payload_bytes, " bytes); the call asked for ", layout.DebugString(), " x ",
      num_tokens, " tokens (", payload, " bytes): pass the num_q_heads the cache was put with"));
}

}  // namespace

GpuPath::GpuPath(const ClientOptions& options, Client* self, RankingFn ranking, DataPutFn put,
                 DataGetFn get, ConnectFn connect)
    : options_(options),
      self_(self),
      ranking_(std::move(ranking)),
      put_(std::move(put)),
      get_(std::move(get)),
      connect_(std::move(connect)) {}

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
    Turn turn(c);
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
                 "kvcomp: no GPU channel to %s (%s); device puts and gets go over UCX (out of "
                 "device memory where both sides' UCX has CUDA memory, else through host "
                 "memory)\n",
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
  const absl::Status nccl = GpuRuntime::LoadNccl();
  absl::StatusOr<GpuRuntime*> rt_or = Runtime();
  if (!rt_or.ok()) return refuse(nccl.ok() ? rt_or.status() : nccl);
  GpuRuntime* rt = *rt_or;
  KVCOMP_ASSIGN_OR_RETURN(std::string uuid, rt->DeviceUuid(device));
  // CUDA IPC is offered with an interprocess event of this device: the daemon takes it when it
  // shares the GPU, NCCL otherwise.
  auto channel = std::make_shared<Channel>();
  std::string ipc_event;
  if (rt->has_ipc() && rt->SetDevice(device).ok()) {
    absl::StatusOr<void*> ev = rt->NewIpcEvent(&ipc_event);
    if (ev.ok()) {
      channel->ipc_event = *ev;
    } else {
      ipc_event.clear();
    }
  }
  if (!nccl.ok() && channel->ipc_event == nullptr) return refuse(nccl);
  absl::StatusOr<GpuChannelGrant> grant = ControlOpenGpuChannel(
      endpoint.control, options_, nccl.ok() ? rt->nccl_version() : 0, uuid, ipc_event);
  if (!grant.ok()) {
    if (Refused(grant.status())) {
      *hard = true;
      return grant.status();
    }
    return refuse(Annotate(grant.status(), "the daemon refused the GPU channel"));
  }
  channel->control = endpoint.control;
  channel->data = endpoint.data;
  channel->device = device;
  channel->id = grant->channel_id;
  channel->max_transfer_bytes = grant->max_transfer_bytes;
  channel->transfer_timeout = grant->transfer_timeout;
  channel->ipc = grant->ipc;
  if (!grant->data_plane) {
    (void)ControlCloseGpuChannel(endpoint.control, options_, grant->channel_id);
    return refuse(absl::FailedPreconditionError(
        "the daemon predates GPU channel gets on the data plane (protocol 1.5)"));
  }
  if (!grant->ipc) {
    rt->DestroyEvent(channel->ipc_event);
    channel->ipc_event = nullptr;
    absl::StatusOr<std::unique_ptr<NcclLink>> link =
        NcclLink::Join(grant->nccl_unique_id, 1, device, grant->transfer_timeout);
    if (!link.ok()) {
      (void)ControlCloseGpuChannel(endpoint.control, options_, grant->channel_id);
      return refuse(absl::UnavailableError(absl::StrCat(
          "the daemon's GPU is not reachable over NCCL: ", link.status().message())));
    }
    channel->link = *std::move(link);
    absl::StatusOr<std::unique_ptr<GpuRuntime::Timer>> timer = rt->NewTimer();
    if (!timer.ok()) return timer.status();
    channel->timer = *std::move(timer);
    channel->nccl = std::make_unique<NcclPayloadLink>(channel->link.get(), channel->timer.get());
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

template <typename T>
absl::StatusOr<std::optional<std::pair<std::unique_ptr<GpuPath::Turn>, T>>> GpuPath::BeginOn(
    const std::vector<EndpointAddress>& ranking, int device,
    absl::FunctionRef<absl::StatusOr<std::optional<T>>(Channel&)> begin, absl::Status* why) {
  if (ranking.empty()) *why = absl::UnavailableError("no endpoint");
  for (int attempt = 0; why->ok() && attempt < 2; ++attempt) {
    bool hard = false;
    absl::StatusOr<std::shared_ptr<Channel>> channel = ChannelFor(ranking[0], device, &hard);
    if (!channel.ok()) {
      if (hard) return channel.status();
      *why = channel.status();
      break;
    }
    auto turn = std::make_unique<Turn>(*channel);
    Channel& c = **turn;
    if (!c.ipc && (c.link == nullptr || c.link->broken())) {
      Drop(*channel, absl::UnavailableError("link broken"));
      continue;
    }
    absl::StatusOr<std::optional<T>> answer = begin(c);
    if (answer.ok()) {
      if (!answer->has_value()) break;  // not over this channel (`begin` says why)
      return std::make_optional(std::make_pair(std::move(turn), **std::move(answer)));
    }
    const absl::Status& e = answer.status();
    const LinkVerdict verdict = AfterLinkFailure(e);
    if (verdict == LinkVerdict::kReopen) {
      if (c.link) c.link->Abort();  // the daemon closed it (idle, timeout, restart)
      Drop(*channel, e);
      continue;
    }
    // The memory cannot be shared (the next link moves it), or the cache is not on the first
    // endpoint (the data plane walks the ranking); any other answer is the caller's.
    if (verdict == LinkVerdict::kAnswer && !absl::IsNotFound(e)) return e;
    *why = e;
    break;
  }
  if (why->ok()) *why = absl::UnavailableError("the GPU channel failed twice");
  return std::nullopt;
}

absl::StatusOr<std::optional<PutResult>> GpuPath::ChannelPut(
    const std::vector<EndpointAddress>& ranking, GpuRuntime* rt, int device,
    const wire::PutBegin& begin, const std::vector<NcclLink::Chunk>& chunks, void* stream,
    absl::Status* why) {
  if (options_.replicas > 1) {
    *why = absl::FailedPreconditionError("replicas > 1: copies go over the data plane");
    return std::nullopt;
  }
  const uint64_t payload = begin.layout.CacheBytes(begin.num_tokens);
  KVCOMP_ASSIGN_OR_RETURN(
      auto done,
      BeginOn<PutResult>(
          ranking, device,
          [&](Channel& c) -> absl::StatusOr<std::optional<PutResult>> {
            if (payload > c.max_transfer_bytes) {
              *why = absl::FailedPreconditionError(absl::StrCat(
                  "a payload of ", payload, " bytes exceeds the GPU channel's ",
                  c.max_transfer_bytes));
              return std::nullopt;
            }
            absl::StatusOr<std::shared_ptr<UcxClient>> conn = connect_(ranking[0]);
            if (!conn.ok()) {  // the data plane walks the ranking
              *why = conn.status();
              return std::nullopt;
            }
            KVCOMP_ASSIGN_OR_RETURN(std::unique_ptr<LinkPut> put,
                                    LinkPut::Open(*std::move(conn), rt, c, begin, chunks, stream,
                                                  /*layer_major=*/false));
            // Over NCCL the payload goes on the caller's stream once the block is on its way;
            // over CUDA IPC the daemon copies out of the caller's memory.
            const absl::Time deadline = absl::Now() + c.transfer_timeout;
            absl::StatusOr<std::shared_ptr<Completion>> sent = std::shared_ptr<Completion>();
            if (!c.ipc) {
              absl::Status s = rt->SetDevice(device);
              sent = s.ok() ? PostOn(*c.nccl, Direction::kSend, chunks, stream, deadline)
                            : absl::StatusOr<std::shared_ptr<Completion>>(s);
            }
            absl::Status received = sent.ok() ? put->Received() : sent.status();
            if (!received.ok()) {
              // Nothing may stay queued on the caller's stream waiting for a peer that will
              // not post its side: the communicator goes (the channel with it, next turn).
              if (c.link) c.link->Abort();
              return received;
            }
            // Received by the daemon: its answer stands whatever this wait says.
            if (!c.ipc && !(*sent)->Wait(deadline + c.transfer_timeout).ok()) c.link->Abort();
            absl::StatusOr<PutResult> result = put->Commit();
            if (!result.ok()) return result.status();
            if (!c.ipc) result->transfer_seconds = SecondsOf(*c.timer);
            result->path = c.ipc ? "ipc" : "nccl";
            result->endpoints = {c.data};
            return std::optional<PutResult>(*std::move(result));
          },
          why));
  if (!done) return std::nullopt;
  absl::MutexLock stats(&mu_);
  (done->second.path == "ipc" ? stats_.ipc_puts : stats_.nccl_puts)++;
  return std::optional<PutResult>(std::move(done->second));
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
  const wire::PutBegin begin = BeginOf(model_id, key, layout, num_tokens, options);
  absl::Status why;
  KVCOMP_ASSIGN_OR_RETURN(std::optional<PutResult> sent,
                          ChannelPut(ranking, rt, device, begin,
                                     ChunksOf(layers, layer_bytes, /*layer_major=*/false), stream,
                                     &why));
  if (sent) return *std::move(sent);
  NoteFallback(ranking.empty() ? "" : ranking[0].data, why, /*put=*/true);
  // The data plane: its links pick ucx-cuda (in place) or ucx (staged on `stream`).
  return put_(model_id, key, layout, num_tokens, layers, stream, options);
}

absl::StatusOr<std::optional<DeviceGetResult>> GpuPath::ChannelGet(
    const std::vector<EndpointAddress>& ranking, GpuRuntime* rt, int device,
    absl::string_view model_id, absl::string_view key, GpuGetForm form, uint64_t capacity,
    void* stream, const std::vector<NcclLink::Chunk>& offer, absl::FunctionRef<ChunksFn> place) {
  absl::Status why;
  KVCOMP_ASSIGN_OR_RETURN(
      auto begun,
      BeginOn<wire::GetReply>(
          ranking, device,
          [&](Channel& c) -> absl::StatusOr<std::optional<wire::GetReply>> {
            absl::StatusOr<std::shared_ptr<UcxClient>> conn = connect_(ranking[0]);
            if (!conn.ok()) {  // the data plane walks the ranking
              why = conn.status();
              return std::nullopt;
            }
            return LinkGet(**conn, rt, c, model_id, key, form, capacity, offer, stream, false);
          },
          &why));
  if (!begun) {
    if (absl::IsNotFound(why)) {  // not on the first endpoint: no GPU channel fault to note
      absl::MutexLock stats(&mu_);
      stats_.fallback_gets++;
    } else {
      NoteFallback(ranking.empty() ? "" : ranking[0].data, why, /*put=*/false);
    }
    return std::nullopt;
  }
  const std::unique_ptr<Turn>& c = begun->first;
  const wire::GetReply& grant = begun->second;
  absl::StatusOr<std::vector<NcclLink::Chunk>> chunks = place(grant);
  DeviceGetResult out;
  out.bytes = grant.link_payload_bytes;
  if ((*c)->ipc) {
    // Already written (the daemon copied before answering): a mismatch is only reported.
    if (!chunks.ok()) return chunks.status();
    out.path = "ipc";
    out.transfer_seconds = static_cast<double>(grant.link_ns) * 1e-9;
    absl::MutexLock stats(&mu_);
    stats_.ipc_gets++;
    return std::optional<DeviceGetResult>(out);
  }
  if (!chunks.ok()) {
    (*c)->link->Abort();  // its send is posted and will not be received
    Drop(c->channel(), chunks.status());
    return chunks.status();
  }
  KVCOMP_RETURN_IF_ERROR(rt->SetDevice(device));
  const absl::Time deadline = absl::Now() + (*c)->transfer_timeout;
  absl::StatusOr<std::shared_ptr<Completion>> got =
      PostOn(*(*c)->nccl, Direction::kReceive, *chunks, stream, deadline);
  absl::Status s = got.ok() ? (*got)->Wait(deadline) : got.status();
  if (!s.ok()) {
    Drop(c->channel(), s);
    return s;
  }
  out.path = "nccl";
  out.transfer_seconds = SecondsOf(*(*c)->timer);
  absl::MutexLock stats(&mu_);
  stats_.nccl_gets++;
  return std::optional<DeviceGetResult>(out);
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
  const std::vector<NcclLink::Chunk> chunks = ChunksOf(layers, layer_bytes, false);

  KVCOMP_ASSIGN_OR_RETURN(
      std::optional<DeviceGetResult> nccl,
      ChannelGet(ranking, rt, device, model_id, key, GpuGetForm::kDenseKv, payload, stream,
                 chunks,
                 [&](const wire::GetReply& grant) -> absl::StatusOr<std::vector<NcclLink::Chunk>> {
                if (grant.layout != layout || grant.num_tokens != num_tokens ||
                    grant.link_payload_bytes != payload) {
                  return LayoutMismatch(grant, layout, num_tokens, payload);
                }
                return chunks;
              }));
  if (nccl) return *std::move(nccl);
  return DenseOverDataPlane(rt, device, model_id, key, layout, num_tokens, layers, stream);
}

absl::StatusOr<DeviceGetResult> GpuPath::DenseOverDataPlane(
    GpuRuntime* rt, int device, absl::string_view model_id, absl::string_view key,
    const KvLayout& layout, uint64_t num_tokens, const std::vector<DeviceLayerOut>& layers,
    void* stream) {
  KVCOMP_ASSIGN_OR_RETURN(LookupResult found, self_->Lookup(model_id, key));
  if (found.layout != layout || found.original_tokens != num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the cache is ", found.layout.DebugString(), " x ", found.original_tokens,
        " tokens; the call asked for ", layout.DebugString(), " x ", num_tokens, " tokens"));
  }
  const uint64_t every = layout.num_heads_total() * num_tokens;
  if (found.total_kept != every) {
    return absl::FailedPreconditionError(
        absl::StrCat("the cache kept ", found.total_kept, " of ", every,
                     " head tokens: a dense get needs every token (ratio 0); get the cache "
                     "instead"));
  }
  // The decoded form (raw codecs) holds the dense K and V and, besides them, no more than the
  // stored form does (header, table, heads and positions), with room for sections' padding.
  const uint64_t capacity = found.original_bytes + found.stored_bytes + (uint64_t{64} << 10);
  KVCOMP_RETURN_IF_ERROR(rt->SetDevice(device));
  KVCOMP_ASSIGN_OR_RETURN(void* decoded, rt->AllocDevice(capacity));
  transport::ScopedDeviceMemory release(rt, decoded);
  KVCOMP_ASSIGN_OR_RETURN(DeviceGetResult got,
                          get_(model_id, key, /*decoded=*/true, decoded, capacity, stream));
  std::vector<void*> keys(layout.num_layers), values(layout.num_layers);
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    keys[l] = layers[l].keys;
    values[l] = layers[l].values;
  }
  KVCOMP_ASSIGN_OR_RETURN(bool dense,
                          transport::CopyDenseKv(rt, decoded, got.bytes, layout, num_tokens, keys,
                                                 values, stream,
                                                 absl::Now() + options_.request_timeout));
  if (!dense) {
    return absl::FailedPreconditionError(
        "the cache was replaced meanwhile by one without every token of this layout");
  }
  got.bytes = layout.CacheBytes(num_tokens);
  return got;
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
      ChannelGet(ranking, rt, device, model_id, key,
                 decoded ? GpuGetForm::kDecoded : GpuGetForm::kStored, capacity, stream,
                 {{dst, capacity}},
                 [&](const wire::GetReply& grant)
                     -> absl::StatusOr<std::vector<NcclLink::Chunk>> {
                   return std::vector<NcclLink::Chunk>{
                       {dst, static_cast<size_t>(grant.link_payload_bytes)}};
                 }));
  if (nccl) return *std::move(nccl);
  return get_(model_id, key, decoded, dst, capacity, stream);
}

// --- Layer by layer ---

namespace {

// Destroys the SDK's stream and events of a layered transfer once its work is done.
struct StreamAndEvents {
  GpuRuntime* rt = nullptr;
  void* stream = nullptr;
  std::vector<void*> events;
  ~StreamAndEvents() {
    if (rt == nullptr) return;
    if (stream != nullptr) (void)rt->WaitStream(stream, absl::Now() + absl::Seconds(10));
    for (void* e : events) rt->DestroyEvent(e);
    rt->DestroyStream(stream);
  }
};

}  // namespace

class GpuPathPutStream : public DevicePutStream {
 public:
  GpuPathPutStream(GpuPath* path, GpuRuntime* rt, std::string model_id, std::string key,
                   const KvLayout& layout, uint64_t num_tokens, int device, PutOptions options)
      : path_(path),
        rt_(rt),
        model_id_(std::move(model_id)),
        key_(std::move(key)),
        layout_(layout),
        num_tokens_(num_tokens),
        device_(device),
        options_(std::move(options)) {}

  ~GpuPathPutStream() override {
    if (nccl_ && !done_) Abandon(absl::CancelledError("the put stream was destroyed"));
  }

  // The SDK's stream (the sends, or the copies at Commit, follow the callers' streams on it)
  // and, over NCCL, the put opened on the data plane with its link block sent.
  absl::Status Start(std::unique_ptr<GpuPath::Turn> turn, std::unique_ptr<LinkPut> put,
                     const ClientOptions& client_options) {
    own_.rt = rt_;
    client_options_ = client_options;
    if (turn != nullptr) {
      turn_ = std::move(turn);
      put_ = std::move(put);
      nccl_ = true;
    }
    absl::Status s = rt_->SetDevice(device_);
    if (s.ok()) {
      absl::StatusOr<void*> st = rt_->NewStream();
      s = st.status();
      if (st.ok()) own_.stream = *st;
    }
    if (!s.ok()) {
      if (nccl_) Abandon(s);
      return s;
    }
    if (nccl_) {
      deadline_ = absl::Now() + (*turn_)->transfer_timeout;
      KVCOMP_ASSIGN_OR_RETURN(timer_, rt_->NewTimer());
      link_ = std::make_unique<NcclPayloadLink>((*turn_)->link.get());  // timed here, as a whole
    }
    return absl::OkStatus();
  }
  void set_ipc(bool ipc) { ipc_ = ipc; }

  absl::Status AppendLayer(uint32_t layer, const DeviceLayerData& data, void* stream) override {
    if (done_ || failed_) return absl::FailedPreconditionError("the put stream is spent");
    if (layer != layers_.size() || layer >= layout_.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " appended; layer ",
                                                     layers_.size(), " expected next"));
    }
    for (const void* p : {data.keys, data.values}) {
      absl::StatusOr<int> d = p == nullptr ? absl::InvalidArgumentError("null pointer")
                                           : rt_->DeviceOf(p);
      if (!d.ok() || *d != device_) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", layer, ": not CUDA device memory of device ", device_, " (the stream's)"));
      }
    }
    KVCOMP_RETURN_IF_ERROR(rt_->SetDevice(device_));
    KVCOMP_RETURN_IF_ERROR(rt_->StreamWaitStream(own_.stream, stream));
    if (nccl_) {
      const uint64_t bytes = layout_.LayerBytes(num_tokens_);
      absl::Status s = layer == 0 ? timer_->Start(own_.stream) : absl::OkStatus();
      const NcclLink::Chunk chunks[2] = {{const_cast<void*>(data.keys), bytes},
                                         {const_cast<void*>(data.values), bytes}};
      absl::StatusOr<std::shared_ptr<Completion>> sent =
          s.ok() ? PostOn(*link_, Direction::kSend, chunks, own_.stream, deadline_) : s;
      s = sent.status();
      if (s.ok()) sent_ = *std::move(sent);
      if (!s.ok()) {
        Abandon(s);
        return s;
      }
    }
    layers_.push_back(data);
    return absl::OkStatus();
  }

  absl::StatusOr<PutResult> Commit() override {
    if (done_ || failed_) return absl::FailedPreconditionError("the put stream is spent");
    if (layers_.size() != layout_.num_layers) {
      return absl::FailedPreconditionError(absl::StrCat(
          layers_.size(), " of ", layout_.num_layers, " layers appended: append every layer"));
    }
    done_ = true;
    if (!nccl_) {
      // CUDA IPC or host memory: the whole cache now, after every appended layer's work.
      return path_->Put(model_id_, key_, layout_, num_tokens_, layers_, own_.stream, options_);
    }
    GpuPath::Channel& c = **turn_;
    absl::Status s = timer_->Stop(own_.stream);
    if (s.ok()) s = put_->Received();
    if (!s.ok()) {
      c.link->Abort();
      path_->DropChannel(turn_->channel(), s);
      turn_.reset();
      return s;
    }
    s = sent_->Wait(deadline_ + c.transfer_timeout);
    if (!s.ok()) path_->DropChannel(turn_->channel(), s);
    absl::StatusOr<PutResult> result = put_->Commit();
    if (!result.ok()) {
      turn_.reset();
      return result.status();
    }
    absl::StatusOr<double> secs = timer_->Seconds(absl::Now() + absl::Seconds(1));
    result->transfer_seconds = secs.ok() ? *secs : 0;
    result->path = "nccl";
    result->endpoints = {c.data};
    turn_.reset();
    path_->CountNcclPut();
    return result;
  }

  std::string path() const override { return nccl_ ? "nccl" : (ipc_ ? "ipc" : "ucx"); }

 private:
  // A stream that cannot go on: the half-sent put is dropped on both sides (the put aborted,
  // the channel closed: its receive on the daemon fails; nothing is stored).
  void Abandon(const absl::Status& why) {
    failed_ = true;
    if (turn_ == nullptr) return;
    GpuPath::Channel& c = **turn_;
    if (put_ != nullptr) put_->Abort();
    ClientOptions quick = client_options_;
    quick.request_timeout = std::min(client_options_.request_timeout, absl::Seconds(2));
    (void)ControlCloseGpuChannel(c.control, quick, c.id);
    if (c.link) c.link->Abort();
    path_->DropChannel(turn_->channel(), why);
    turn_.reset();
  }

  GpuPath* const path_;
  GpuRuntime* const rt_;
  const std::string model_id_;
  const std::string key_;
  const KvLayout layout_;
  const uint64_t num_tokens_;
  const int device_;
  const PutOptions options_;
  ClientOptions client_options_;
  std::unique_ptr<GpuPath::Turn> turn_;
  std::unique_ptr<GpuRuntime::Timer> timer_;
  std::unique_ptr<NcclPayloadLink> link_;  // over NCCL: the layers' link
  std::shared_ptr<Completion> sent_;       // the last layer's send
  std::unique_ptr<LinkPut> put_;           // over NCCL: the data-plane put
  absl::Time deadline_;
  bool nccl_ = false;
  bool ipc_ = false;
  bool done_ = false;
  bool failed_ = false;
  std::vector<DeviceLayerData> layers_;
  StreamAndEvents own_;  // last: its stream drains before the rest goes
};

absl::StatusOr<std::unique_ptr<DevicePutStream>> GpuPath::OpenPutStream(
    absl::string_view model_id, absl::string_view key, const KvLayout& layout,
    uint64_t num_tokens, int device, const PutOptions& options) {
  KVCOMP_RETURN_IF_ERROR(CheckShape(layout, num_tokens, layout.num_layers));
  if (options.block_wise) {
    return absl::InvalidArgumentError("block-wise puts are streamed: use OpenPutStream");
  }
  if (options.policy) KVCOMP_RETURN_IF_ERROR(options.policy->ValidateFor(layout.head_dim));
  KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, Runtime());
  if (device < 0 || device >= rt->device_count()) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device, " out of range"));
  }
  KVCOMP_ASSIGN_OR_RETURN(std::vector<EndpointAddress> ranking, ranking_(model_id, key));
  auto out = std::make_unique<GpuPathPutStream>(this, rt, std::string(model_id), std::string(key),
                                                layout, num_tokens, device, options);
  const uint64_t payload = layout.CacheBytes(num_tokens);
  std::unique_ptr<Turn> turn;
  std::unique_ptr<LinkPut> put;
  absl::Status why;  // Commit notes the fallback
  if (options_.replicas <= 1) {
    const wire::PutBegin begin = BeginOf(model_id, key, layout, num_tokens, options);
    KVCOMP_ASSIGN_OR_RETURN(
        auto begun,
        BeginOn<std::unique_ptr<LinkPut>>(
            ranking, device,
            [&](Channel& c) -> absl::StatusOr<std::optional<std::unique_ptr<LinkPut>>> {
              out->set_ipc(c.ipc);  // CUDA IPC: the whole cache at Commit
              if (c.ipc || payload > c.max_transfer_bytes) return std::nullopt;
              absl::StatusOr<std::shared_ptr<UcxClient>> conn = connect_(ranking[0]);
              if (!conn.ok()) return std::nullopt;  // Commit's put walks the ranking
              // The block goes now; the layers' sends follow as they are appended.
              KVCOMP_ASSIGN_OR_RETURN(std::unique_ptr<LinkPut> p,
                                      LinkPut::Open(*std::move(conn), rt, c, begin, {}, nullptr,
                                                    /*layer_major=*/true));
              return std::optional<std::unique_ptr<LinkPut>>(std::move(p));
            },
            &why));
    if (begun) std::tie(turn, put) = *std::move(begun);
  }
  KVCOMP_RETURN_IF_ERROR(out->Start(std::move(turn), std::move(put), options_));
  return std::unique_ptr<DevicePutStream>(std::move(out));
}

class GpuPathGetStream : public DeviceGetStream {
 public:
  GpuPathGetStream(GpuPath* path, GpuRuntime* rt, uint32_t layers, void* caller)
      : path_(path), rt_(rt), layers_(layers), caller_(caller) {
    own_.rt = rt;
  }
  ~GpuPathGetStream() override {
    if (!done_) (void)Finish();
  }

  // Over NCCL: receives every layer on the SDK's stream, one event per layer.
  absl::Status Receive(std::unique_ptr<GpuPath::Turn> turn, const wire::GetReply& grant,
                       const std::vector<DeviceLayerOut>& layers, uint64_t layer_bytes,
                       int device) {
    turn_ = std::move(turn);
    grant_ = grant;
    GpuPath::Channel& c = **turn_;
    deadline_ = absl::Now() + c.transfer_timeout;
    absl::Status s = rt_->SetDevice(device);
    if (s.ok()) {
      absl::StatusOr<void*> st = rt_->NewStream();
      s = st.status();
      if (st.ok()) own_.stream = *st;
    }
    if (s.ok()) s = rt_->StreamWaitStream(own_.stream, caller_);
    if (s.ok()) {
      absl::StatusOr<std::unique_ptr<GpuRuntime::Timer>> t = rt_->NewTimer();
      s = t.status();
      if (t.ok()) timer_ = *std::move(t);
    }
    if (s.ok()) s = timer_->Start(own_.stream);
    link_ = std::make_unique<NcclPayloadLink>(c.link.get());  // timed here, as a whole
    for (size_t l = 0; s.ok() && l < layers.size(); ++l) {
      const NcclLink::Chunk chunks[2] = {{layers[l].keys, layer_bytes},
                                         {layers[l].values, layer_bytes}};
      absl::StatusOr<std::shared_ptr<Completion>> got =
          PostOn(*link_, Direction::kReceive, chunks, own_.stream, deadline_);
      s = got.status();
      if (s.ok()) got_ = *std::move(got);
      absl::StatusOr<void*> ev = s.ok() ? rt_->NewEvent() : absl::StatusOr<void*>(s);
      s = ev.status();
      if (ev.ok()) {
        own_.events.push_back(*ev);
        s = rt_->RecordEvent(*ev, own_.stream);
      }
    }
    if (s.ok()) s = timer_->Stop(own_.stream);
    if (!s.ok()) Fail(s);
    return s;
  }
  // CUDA IPC or host memory: every layer was in place when the stream opened.
  void Done(DeviceGetResult result) { result_ = std::move(result); }

  absl::Status WaitLayer(uint32_t layer, void* stream) override {
    if (layer >= layers_) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " of ", layers_));
    }
    if (!failure_.ok()) return failure_;
    if (turn_ == nullptr || done_) return absl::OkStatus();  // in place already
    return rt_->StreamWaitEvent(stream, own_.events[layer]);
  }

  absl::StatusOr<DeviceGetResult> Finish() override {
    if (done_) return failure_.ok() ? absl::StatusOr<DeviceGetResult>(result_) : failure_;
    done_ = true;
    if (turn_ == nullptr) return failure_.ok() ? absl::StatusOr<DeviceGetResult>(result_) : failure_;
    absl::Status s = got_->Wait(deadline_);
    if (!s.ok()) {
      Fail(s);
      return s;
    }
    s = rt_->StreamWaitStream(caller_, own_.stream);
    turn_.reset();
    if (!s.ok()) return s;
    absl::StatusOr<double> secs = timer_->Seconds(absl::Now() + absl::Seconds(1));
    result_.bytes = grant_.link_payload_bytes;
    result_.path = "nccl";
    result_.transfer_seconds = secs.ok() ? *secs : 0;
    path_->CountNcclGet();
    return result_;
  }

 private:
  void Fail(const absl::Status& why) {
    failure_ = why;
    done_ = true;
    if (turn_ == nullptr) return;
    if ((*turn_)->link) (*turn_)->link->Abort();
    path_->DropChannel(turn_->channel(), why);
    turn_.reset();
  }

  GpuPath* const path_;
  GpuRuntime* const rt_;
  const uint32_t layers_;
  void* const caller_;
  std::unique_ptr<GpuPath::Turn> turn_;
  std::unique_ptr<GpuRuntime::Timer> timer_;
  std::unique_ptr<NcclPayloadLink> link_;  // the layers' link
  std::shared_ptr<Completion> got_;        // the last layer's receive
  wire::GetReply grant_;
  absl::Time deadline_;
  DeviceGetResult result_;
  absl::Status failure_;
  bool done_ = false;
  StreamAndEvents own_;
};

absl::StatusOr<std::unique_ptr<DeviceGetStream>> GpuPath::OpenGetStream(
    absl::string_view model_id, absl::string_view key, const KvLayout& layout,
    uint64_t num_tokens, const std::vector<DeviceLayerOut>& layers, void* stream) {
  KVCOMP_RETURN_IF_ERROR(CheckShape(layout, num_tokens, layers.size()));
  KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, Runtime());
  KVCOMP_ASSIGN_OR_RETURN(int device, DeviceOfLayers(rt, layers));
  KVCOMP_ASSIGN_OR_RETURN(std::vector<EndpointAddress> ranking, ranking_(model_id, key));
  const uint64_t layer_bytes = layout.LayerBytes(num_tokens);
  const uint64_t payload = layout.CacheBytes(num_tokens);
  auto out = std::make_unique<GpuPathGetStream>(this, rt, layout.num_layers, stream);
  absl::Status why;
  KVCOMP_ASSIGN_OR_RETURN(
      auto begun,
      BeginOn<wire::GetReply>(
          ranking, device,
          [&](Channel& c) -> absl::StatusOr<std::optional<wire::GetReply>> {
            if (c.ipc) return std::nullopt;  // GetKv below: every layer at once, on the device
            absl::StatusOr<std::shared_ptr<UcxClient>> conn = connect_(ranking[0]);
            if (!conn.ok()) return std::nullopt;  // GetKv below walks the ranking
            return LinkGet(**conn, rt, c, model_id, key, GpuGetForm::kDenseKv, payload, {},
                           nullptr, /*layer_major=*/true);
          },
          &why));
  if (begun) {
    const wire::GetReply& grant = begun->second;
    if (grant.layout != layout || grant.num_tokens != num_tokens ||
        grant.link_payload_bytes != payload) {
      (*begun->first)->link->Abort();  // its sends are posted and will not be received
      Drop(begun->first->channel(), absl::InvalidArgumentError("layout mismatch"));
      return LayoutMismatch(grant, layout, num_tokens, payload);
    }
    KVCOMP_RETURN_IF_ERROR(
        out->Receive(std::move(begun->first), grant, layers, layer_bytes, device));
    return std::unique_ptr<DeviceGetStream>(std::move(out));
  }
  KVCOMP_ASSIGN_OR_RETURN(DeviceGetResult whole,
                          GetKv(model_id, key, layout, num_tokens, layers, stream));
  out->Done(std::move(whole));
  return std::unique_ptr<DeviceGetStream>(std::move(out));
}

void GpuPath::DropChannel(const std::shared_ptr<Channel>& channel, const absl::Status& why) {
  Drop(channel, why);
}

void GpuPath::CountNcclPut() {
  absl::MutexLock lock(&mu_);
  stats_.nccl_puts++;
}

void GpuPath::CountNcclGet() {
  absl::MutexLock lock(&mu_);
  stats_.nccl_gets++;
}

}  // namespace client
}  // namespace kvcomp
