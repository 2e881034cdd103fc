#include "kvcomp/client/client.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "control.h"
#include "endpoint_state.h"
#include "gpu_path.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/client.h"
#include "kvcomp/transport/gpu_link.h"
#include "kvcomp/transport/ucx_link.h"
#include "pool.h"
#include "prefix.h"
#include "rendezvous.h"
#include "resolver.h"

namespace kvcomp {
namespace client {
namespace {

using transport::UcxClient;
namespace wire = transport::wire;

absl::Status ValidateShape(const KvLayout& layout, uint64_t num_tokens) {
  KVCOMP_RETURN_IF_ERROR(layout.Validate());
  if (num_tokens == 0 || num_tokens > KvLayout::kMaxTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens ", num_tokens, " outside [1, ", KvLayout::kMaxTokens, "]"));
  }
  return absl::OkStatus();
}

class ClientImpl;

// One put on one endpoint: begin, blocks (pipelined within the connection's in-flight bound,
// over the connection's payload links), commit. Packed copies of partial token ranges live until
// their send completes.
class EndpointPut {
 public:
  EndpointPut(std::shared_ptr<UcxClient> conn, std::shared_ptr<EndpointState> ep,
              uint64_t max_block)
      : conn_(std::move(conn)), ep_(std::move(ep)), links_(conn_.get()) {
    const auto& info = conn_->server_info();
    max_block_ = std::max<uint64_t>(1, std::min<uint64_t>(max_block, info.max_payload_bytes));
    pipe_.emplace(links_, std::max<uint64_t>(max_block_, info.max_inflight_bytes / 2));
  }
  ~EndpointPut() {
    WaitAll().IgnoreError();
    if (put_id_ != 0 && !committed_) conn_->PutAbort(put_id_).IgnoreError();
  }

  EndpointState* endpoint() const { return ep_.get(); }
  uint64_t max_block() const { return max_block_; }

  absl::Status Begin(const wire::PutBegin& begin) {
    KVCOMP_ASSIGN_OR_RETURN(put_id_, conn_->PutBegin(begin));
    layout_ = begin.layout;
    return absl::OkStatus();
  }

  // Sends one block of `layer`, tokens [t0, t0+n). `k`/`v` point at [heads, n, d] data that
  // stays valid until WaitAll (the caller's arrays or `owned`).
  void Send(uint32_t layer, uint64_t t0, uint64_t n, const void* k, const void* v,
            std::shared_ptr<std::string> owned) {
    wire::Block b;
    b.put_id = put_id_;
    b.layer_begin = layer;
    b.layer_end = layer + 1;
    b.token_begin = t0;
    b.token_end = t0 + n;
    b.parts = wire::kPartBoth;
    b.key_bytes = layout_.LayerBytes(n);
    b.value_bytes = b.key_bytes;
    pipe_->Send(b, {const_cast<void*>(k), b.key_bytes, transport::MemoryKind::kHost},
                {const_cast<void*>(v), b.value_bytes, transport::MemoryKind::kHost},
                std::move(owned));
  }

  // Sends `layer`'s tokens [t0, t0+n) out of device memory (`k`/`v`: [heads, n, d] each, read
  // after `stream`'s work so far, valid until WaitAll), keys and values a block each: UCX moves
  // device keys and values as one block only when adjacent. The send router picks the link:
  // ucx-cuda in place where both ends' UCX has CUDA memory, else ucx staged through host memory.
  void SendDevice(uint32_t layer, uint64_t t0, uint64_t n, const void* k, const void* v,
                  void* stream) {
    wire::Block b;
    b.put_id = put_id_;
    b.layer_begin = layer;
    b.layer_end = layer + 1;
    b.token_begin = t0;
    b.token_end = t0 + n;
    const uint64_t bytes = layout_.LayerBytes(n);
    const transport::MemoryRegion none{nullptr, 0, transport::MemoryKind::kCuda};
    for (const bool values : {false, true}) {
      b.parts = values ? wire::kPartValues : wire::kPartKeys;
      b.key_bytes = values ? 0 : bytes;
      b.value_bytes = values ? bytes : 0;
      const transport::MemoryRegion data{const_cast<void*>(values ? v : k), bytes,
                                         transport::MemoryKind::kCuda};
      pipe_->Send(b, values ? none : data, values ? data : none, nullptr, stream);
    }
  }
  // The largest part a device block may carry (the daemon's bound: nothing is packed).
  uint64_t max_device_block() const { return conn_->server_info().max_payload_bytes; }
  // The link the last block took.
  transport::LinkKind link() { return pipe_->link(); }

  absl::Status WaitAll() { return pipe_->Wait(); }

  absl::StatusOr<wire::CacheSummary> Commit() {
    KVCOMP_RETURN_IF_ERROR(WaitAll());
    KVCOMP_ASSIGN_OR_RETURN(wire::CacheSummary s, conn_->PutCommit(put_id_, pipe_->sent()));
    committed_ = true;
    return s;
  }

  absl::Status Abort() {
    WaitAll().IgnoreError();
    if (put_id_ == 0 || committed_) return absl::OkStatus();
    committed_ = true;  // nothing more to abort
    return conn_->PutAbort(put_id_);
  }

 private:
  std::shared_ptr<UcxClient> conn_;
  std::shared_ptr<EndpointState> ep_;
  const transport::UcxLinks links_;
  std::optional<transport::BlockPipe> pipe_;  // declared after links_: destroyed first
  KvLayout layout_;
  uint64_t max_block_ = 0;
  uint64_t put_id_ = 0;
  bool committed_ = false;
};

class PutStreamImpl : public PutStream {
 public:
  PutStreamImpl(KvLayout layout, uint64_t tokens, std::vector<std::unique_ptr<EndpointPut>> puts,
                const ClientOptions& options, std::shared_ptr<Pool> pool)
      : layout_(layout),
        tokens_(tokens),
        puts_(std::move(puts)),
        options_(options),
        pool_(std::move(pool)) {}
  ~PutStreamImpl() override { Abort().IgnoreError(); }

  absl::Status Append(uint32_t layer, uint64_t token_begin, uint64_t num_tokens,
                      const void* keys, const void* values) override {
    if (done_) return absl::FailedPreconditionError("put stream already committed or aborted");
    if (layer >= layout_.num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer, " outside the layout's ", layout_.num_layers));
    }
    if (num_tokens == 0 || token_begin > tokens_ || num_tokens > tokens_ - token_begin) {
      return absl::InvalidArgumentError(absl::StrCat("tokens [", token_begin, ", +", num_tokens,
                                                     ") outside the sequence of ", tokens_));
    }
    if (keys == nullptr || values == nullptr) {
      return absl::InvalidArgumentError("null keys or values");
    }
    const uint64_t row = DTypeBytes(layout_.dtype, layout_.head_dim);
    uint64_t max_block = UINT64_MAX;
    for (const auto& p : puts_) max_block = std::min(max_block, p->max_block());
    const uint64_t per_token = 2 * row * layout_.num_kv_heads;
    const uint64_t chunk = std::max<uint64_t>(1, max_block / per_token);
    for (uint64_t t = 0; t < num_tokens; t += chunk) {
      const uint64_t n = std::min(chunk, num_tokens - t);
      const void* k = keys;
      const void* v = values;
      std::shared_ptr<std::string> owned;
      if (n != num_tokens) {  // gather [heads, n, d] out of [heads, num_tokens, d]
        owned = std::make_shared<std::string>(2 * layout_.LayerBytes(n), '\0');
        char* dk = owned->data();
        char* dv = dk + layout_.LayerBytes(n);
        for (uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
          const uint64_t src = (uint64_t{h} * num_tokens + t) * row;
          std::memcpy(dk + h * n * row, static_cast<const char*>(keys) + src, n * row);
          std::memcpy(dv + h * n * row, static_cast<const char*>(values) + src, n * row);
        }
        k = dk;
        v = dv;
      }
      for (auto& p : puts_) p->Send(layer, token_begin + t, n, k, v, owned);
      if (owned == nullptr) {
        // Caller memory: the block must be out before Append returns.
        for (auto& p : puts_) KVCOMP_RETURN_IF_ERROR(p->WaitAll());
      }
    }
    return absl::OkStatus();
  }

  // Every token of `layer` out of device memory (GpuPath's put where no GPU channel carries
  // it): `keys` and `values` ([heads, tokens, d], on one device, read after `stream`'s work so
  // far) stay valid until Commit. A part larger than a block goes in token ranges gathered on the
  // device (on `stream`) into memory of this call's.
  absl::Status AppendDevice(uint32_t layer, const void* keys, const void* values, void* stream) {
    if (done_) return absl::FailedPreconditionError("put stream already committed or aborted");
    const uint64_t row = DTypeBytes(layout_.dtype, layout_.head_dim);
    const uint64_t per_token = row * layout_.num_kv_heads;
    uint64_t max_block = UINT64_MAX;
    for (const auto& p : puts_) max_block = std::min(max_block, p->max_device_block());
    const uint64_t chunk = std::max<uint64_t>(1, max_block / per_token);
    if (chunk >= tokens_) {
      for (auto& p : puts_) p->SendDevice(layer, 0, tokens_, keys, values, stream);
      return absl::OkStatus();
    }
    using transport::GpuRuntime;
    KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, GpuRuntime::Get());
    KVCOMP_ASSIGN_OR_RETURN(const int device, rt->DeviceOf(keys));
    KVCOMP_RETURN_IF_ERROR(rt->SetDevice(device));
    KVCOMP_ASSIGN_OR_RETURN(void* scratch, rt->AllocDevice(2 * chunk * per_token));
    const transport::ScopedDeviceMemory release(rt, scratch);
    for (uint64_t t = 0; t < tokens_; t += chunk) {
      const uint64_t n = std::min(chunk, tokens_ - t);
      auto* dk = static_cast<uint8_t*>(scratch);
      uint8_t* dv = dk + n * per_token;
      for (uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
        const uint64_t src = (uint64_t{h} * tokens_ + t) * row;
        KVCOMP_RETURN_IF_ERROR(rt->CopyAsync(dk + h * n * row,
                                             static_cast<const uint8_t*>(keys) + src, n * row,
                                             GpuRuntime::Copy::kDeviceToDevice, stream));
        KVCOMP_RETURN_IF_ERROR(rt->CopyAsync(dv + h * n * row,
                                             static_cast<const uint8_t*>(values) + src, n * row,
                                             GpuRuntime::Copy::kDeviceToDevice, stream));
      }
      for (auto& p : puts_) p->SendDevice(layer, t, n, dk, dv, stream);
      for (auto& p : puts_) KVCOMP_RETURN_IF_ERROR(p->WaitAll());  // `scratch` is reused
    }
    return absl::OkStatus();
  }
  // Waits until every block sent so far is acknowledged; the first failure.
  absl::Status WaitSent() {
    for (auto& p : puts_) KVCOMP_RETURN_IF_ERROR(p->WaitAll());
    return absl::OkStatus();
  }
  // The link the first endpoint's last block took.
  transport::LinkKind link() {
    return puts_.empty() ? transport::LinkKind::kUcxHost : puts_.front()->link();
  }

  absl::StatusOr<PutResult> Commit() override {
    if (done_) return absl::FailedPreconditionError("put stream already committed or aborted");
    done_ = true;
    PutResult r;
    absl::Status first_error;
    for (auto& p : puts_) {
      auto s = p->Commit();
      if (!s.ok()) {
        if (first_error.ok()) first_error = s.status();
        if (Retryable(s.status())) {
          p->endpoint()->MarkDown(options_, s.status());
          pool_->RefreshSoon();
        }
        continue;
      }
      r.original_bytes = s->original_bytes;
      r.stored_bytes = s->stored_bytes;
      r.total_kept = s->total_kept;
      r.endpoints.push_back(p->endpoint()->address().data);
    }
    puts_.clear();
    if (r.endpoints.empty()) return first_error;
    return r;
  }

  absl::Status Abort() override {
    if (done_) return absl::OkStatus();
    done_ = true;
    absl::Status first;
    for (auto& p : puts_) {
      absl::Status s = p->Abort();
      if (first.ok()) first = s;
    }
    puts_.clear();
    return first;
  }

  const KvLayout& layout() const override { return layout_; }
  uint64_t num_tokens() const override { return tokens_; }

 private:
  const KvLayout layout_;
  const uint64_t tokens_;
  std::vector<std::unique_ptr<EndpointPut>> puts_;
  const ClientOptions options_;
  const std::shared_ptr<Pool> pool_;
  bool done_ = false;
};

class ClientImpl : public Client {
 public:
  ClientImpl(ClientOptions options, std::shared_ptr<Pool> pool)
      : options_(std::move(options)), pool_(std::move(pool)) {
    gpu_ = std::make_unique<GpuPath>(
        options_, this,
        [this](absl::string_view model_id,
               absl::string_view key) -> absl::StatusOr<std::vector<EndpointAddress>> {
          KVCOMP_RETURN_IF_ERROR(CheckKey(model_id, key));
          KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<const Members> members, LiveMembers());
          std::vector<EndpointAddress> out;
          for (size_t i : Rank(*members, model_id, key)) {
            out.push_back(members->states[i]->address());
          }
          return out;
        },
        [this](absl::string_view model_id, absl::string_view key, const KvLayout& layout,
               uint64_t num_tokens, const std::vector<DeviceLayerData>& layers, void* stream,
               const PutOptions& options) {
          return PutDeviceData(model_id, key, layout, num_tokens, layers, stream, options);
        },
        [this](absl::string_view model_id, absl::string_view key, bool decoded, void* dst,
               size_t capacity, void* stream) {
          return GetDeviceData(model_id, key, decoded, dst, capacity, stream);
        },
        [this](const EndpointAddress& endpoint)
            -> absl::StatusOr<std::shared_ptr<transport::UcxClient>> {
          KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<const Members> members, LiveMembers());
          for (const std::shared_ptr<EndpointState>& e : members->states) {
            if (e->address().data == endpoint.data) return e->Connection(options_);
          }
          return absl::UnavailableError(
              absl::StrCat("endpoint ", endpoint.data, " is no longer a member"));
        });
  }

  // Device memory: GpuPath (the GPU channel, else the data plane's links: PutDeviceData,
  // GetDeviceData).
  absl::StatusOr<PutResult> PutDevice(absl::string_view model_id, absl::string_view key,
                                      const KvLayout& layout, uint64_t num_tokens,
                                      const std::vector<DeviceLayerData>& layers, void* stream,
                                      const PutOptions& options) override {
    KVCOMP_RETURN_IF_ERROR(CheckKey(model_id, key));
    return gpu_->Put(model_id, key, layout, num_tokens, layers, stream, options);
  }
  absl::StatusOr<DeviceGetResult> GetKvIntoDevice(absl::string_view model_id,
                                                  absl::string_view key, const KvLayout& layout,
                                                  uint64_t num_tokens,
                                                  const std::vector<DeviceLayerOut>& layers,
                                                  void* stream) override {
    KVCOMP_RETURN_IF_ERROR(CheckKey(model_id, key));
    return gpu_->GetKv(model_id, key, layout, num_tokens, layers, stream);
  }
  absl::StatusOr<DeviceGetResult> GetIntoDevice(absl::string_view model_id,
                                                absl::string_view key, void* dst,
                                                size_t capacity, void* stream,
                                                bool decoded) override {
    KVCOMP_RETURN_IF_ERROR(CheckKey(model_id, key));
    return gpu_->GetBytes(model_id, key, dst, capacity, stream, decoded);
  }
  absl::Status ProbeGpuChannel(const std::string& endpoint, int device) override {
    KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<const Members> members, LiveMembers());
    for (size_t i = 0; i < members->states.size(); ++i) {
      if (members->names[i] == endpoint) return gpu_->Probe(members->states[i]->address(), device);
    }
    return absl::NotFoundError(absl::StrCat("no member ", endpoint));
  }
  GpuChannelStats GpuStats() const override { return gpu_->Stats(); }
  absl::StatusOr<std::unique_ptr<DevicePutStream>> OpenDevicePutStream(
      absl::string_view model_id, absl::string_view key, const KvLayout& layout,
      uint64_t num_tokens, int device, const PutOptions& options) override {
    KVCOMP_RETURN_IF_ERROR(CheckKey(model_id, key));
    return gpu_->OpenPutStream(model_id, key, layout, num_tokens, device, options);
  }
  absl::StatusOr<std::unique_ptr<DeviceGetStream>> OpenDeviceGetStream(
      absl::string_view model_id, absl::string_view key, const KvLayout& layout,
      uint64_t num_tokens, const std::vector<DeviceLayerOut>& layers, void* stream) override {
    KVCOMP_RETURN_IF_ERROR(CheckKey(model_id, key));
    return gpu_->OpenGetStream(model_id, key, layout, num_tokens, layers, stream);
  }

  absl::Status ConnectAll() {
    KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<const Members> members, LiveMembers());
    absl::Status first;
    for (auto& e : members->states) {
      auto c = e->Connection(options_);
      if (c.ok()) return absl::OkStatus();
      if (!Retryable(c.status())) return c.status();  // refused credentials: say so now
      if (first.ok()) first = c.status();
    }
    return first;
  }

  std::vector<std::string> Ranking(absl::string_view model_id,
                                   absl::string_view key) const override {
    std::shared_ptr<const Members> members = pool_->Current();
    std::vector<std::string> out;
    for (size_t i : Rank(*members, model_id, key)) out.push_back(members->names[i]);
    return out;
  }

  absl::StatusOr<PutResult> Put(absl::string_view model_id, absl::string_view key,
                                const KvLayout& layout, uint64_t num_tokens,
                                const std::vector<LayerData>& layers,
                                const PutOptions& options) override {
    KVCOMP_RETURN_IF_ERROR(ValidateShape(layout, num_tokens));
    if (layers.size() != layout.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("got ", layers.size(),
                                                     " layers, the layout has ",
                                                     layout.num_layers));
    }
    for (size_t l = 0; l < layers.size(); ++l) {
      if (layers[l].keys == nullptr || layers[l].values == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", l, ": null keys or values"));
      }
    }
    KVCOMP_ASSIGN_OR_RETURN(auto stream, OpenPutStream(model_id, key, layout, num_tokens, options));
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
      KVCOMP_RETURN_IF_ERROR(stream->AppendLayer(l, layers[l].keys, layers[l].values));
    }
    return stream->Commit();
  }

  absl::StatusOr<std::unique_ptr<PutStream>> OpenPutStream(absl::string_view model_id,
                                                           absl::string_view key,
                                                           const KvLayout& layout,
                                                           uint64_t num_tokens,
                                                           const PutOptions& options) override {
    KVCOMP_RETURN_IF_ERROR(CheckKey(model_id, key));
    KVCOMP_RETURN_IF_ERROR(ValidateShape(layout, num_tokens));
    if (options.policy) KVCOMP_RETURN_IF_ERROR(options.policy->ValidateFor(layout.head_dim));
    wire::PutBegin begin;
    begin.layout = layout;
    begin.num_tokens = num_tokens;
    begin.model_id = std::string(model_id);
    begin.key = std::string(key);
    begin.has_policy = options.policy.has_value();
    if (options.policy) begin.policy = *options.policy;
    begin.block_wise = options.block_wise;
    KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<const Members> members, LiveMembers());
    const int want = std::max(1, std::min<int>(options_.replicas, members->states.size()));
    std::vector<std::unique_ptr<EndpointPut>> puts;
    absl::Status first_error;
    // Walk the key's ranking: the first `want` endpoints that accept the put hold the copies.
    for (size_t i : Rank(*members, model_id, key)) {
      if (static_cast<int>(puts.size()) == want) break;
      const std::shared_ptr<EndpointState>& ep = members->states[i];
      auto conn = ep->Connection(options_);
      if (!conn.ok()) {
        if (!Retryable(conn.status())) return conn.status();
        pool_->RefreshSoon();
        if (first_error.ok()) first_error = conn.status();
        continue;
      }
      auto put = std::make_unique<EndpointPut>(*conn, ep, options_.max_block_bytes);
      absl::Status s = put->Begin(begin);
      if (!s.ok()) {
        if (!Retryable(s)) return s;  // the daemon refused the put itself: say why
        ep->MarkDown(options_, s);
        pool_->RefreshSoon();
        if (first_error.ok()) first_error = s;
        continue;
      }
      puts.push_back(std::move(put));
    }
    if (puts.empty()) {
      return first_error.ok() ? absl::UnavailableError("no endpoint accepted the put")
                              : first_error;
    }
    return std::unique_ptr<PutStream>(
        new PutStreamImpl(layout, num_tokens, std::move(puts), options_, pool_));
  }

  // A put out of device memory over the data plane (GpuPath, where no GPU channel carries
  // it): the put of OpenPutStream with CUDA regions, which each connection's send router gives
  // to ucx-cuda (in place) or ucx (staged through host memory on `stream`). `path` names it.
  absl::StatusOr<PutResult> PutDeviceData(absl::string_view model_id, absl::string_view key,
                                          const KvLayout& layout, uint64_t num_tokens,
                                          const std::vector<DeviceLayerData>& layers,
                                          void* stream, const PutOptions& options) {
    KVCOMP_ASSIGN_OR_RETURN(std::unique_ptr<PutStream> opened,
                            OpenPutStream(model_id, key, layout, num_tokens, options));
    auto& put = static_cast<PutStreamImpl&>(*opened);  // OpenPutStream makes no other
    const absl::Time t0 = absl::Now();
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
      KVCOMP_RETURN_IF_ERROR(put.AppendDevice(l, layers[l].keys, layers[l].values, stream));
    }
    KVCOMP_RETURN_IF_ERROR(put.WaitSent());
    const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
    const transport::LinkKind link = put.link();
    KVCOMP_ASSIGN_OR_RETURN(PutResult r, put.Commit());
    r.path = std::string(transport::LinkName(link));
    r.transfer_seconds = seconds;
    return r;
  }

  // The cache's bytes (stored, or decoded when `decoded`) into device memory `dst` of
  // `capacity` bytes over the data plane, after `stream`'s work so far, on the link each
  // connection's receive router picks (ucx-cuda in place, else ucx staged through host memory).
  absl::StatusOr<DeviceGetResult> GetDeviceData(absl::string_view model_id, absl::string_view key,
                                                bool decoded, void* dst, size_t capacity,
                                                void* stream) {
    const absl::Time deadline = absl::Now() + options_.get_timeout;
    const transport::GetRequest request{
        std::string(model_id), std::string(key),
        decoded ? wire::Representation::kDecoded : wire::Representation::kStored};
    const transport::MemoryRegion into{dst, capacity, transport::MemoryKind::kCuda};
    transport::LinkKind used = transport::LinkKind::kUcxHost;
    absl::Time t0;
    KVCOMP_ASSIGN_OR_RETURN(const size_t n,
                            OnRanking<size_t>(
                                model_id, key,
                                [&](UcxClient& c) -> absl::StatusOr<size_t> {
                                  t0 = absl::Now();
                                  return transport::UcxLinks(&c).GetInto(request, into, deadline,
                                                                         &used, stream);
                                },
                                deadline));
    DeviceGetResult out;
    out.bytes = n;
    out.path = std::string(transport::LinkName(used));
    out.transfer_seconds = absl::ToDoubleSeconds(absl::Now() - t0);
    return out;
  }

  absl::StatusOr<std::string> GetBytes(absl::string_view model_id, absl::string_view key,
                                       const ReadOptions& read) override {
    KVCOMP_ASSIGN_OR_RETURN(const absl::Time deadline, Deadline(read, options_.get_timeout));
    KVCOMP_ASSIGN_OR_RETURN(auto fetched,
                            Fetch(model_id, key, wire::Representation::kStored, deadline));
    return std::string(fetched.bytes.view());
  }

  absl::StatusOr<CompressedCache> Get(absl::string_view model_id, absl::string_view key,
                                      const ReadOptions& read) override {
    KVCOMP_ASSIGN_OR_RETURN(const absl::Time deadline, Deadline(read, options_.get_timeout));
    KVCOMP_ASSIGN_OR_RETURN(auto fetched,
                            Fetch(model_id, key, wire::Representation::kStored, deadline));
    return format::ParseCache(fetched.bytes.view());
  }

  absl::StatusOr<CompressedCache> GetDecoded(absl::string_view model_id, absl::string_view key,
                                             const ReadOptions& read) override {
    KVCOMP_ASSIGN_OR_RETURN(const absl::Time deadline, Deadline(read, options_.get_timeout));
    KVCOMP_ASSIGN_OR_RETURN(auto fetched,
                            Fetch(model_id, key, wire::Representation::kDecoded, deadline));
    return format::ParseCache(fetched.bytes.view());
  }

  absl::StatusOr<size_t> GetInto(absl::string_view model_id, absl::string_view key, void* dst,
                                 size_t capacity, bool device, const ReadOptions& read) override {
    if (dst == nullptr) return absl::InvalidArgumentError("null destination");
    KVCOMP_ASSIGN_OR_RETURN(const absl::Time deadline, Deadline(read, options_.get_timeout));
    const transport::GetRequest request{std::string(model_id), std::string(key),
                                        wire::Representation::kStored};
    const transport::MemoryRegion into{
        dst, capacity, device ? transport::MemoryKind::kCuda : transport::MemoryKind::kHost};
    return OnRanking<size_t>(
        model_id, key,
        [&](UcxClient& c) -> absl::StatusOr<size_t> {
          return transport::UcxLinks(&c).GetInto(request, into, deadline);
        },
        deadline);
  }

  absl::StatusOr<LookupResult> Lookup(absl::string_view model_id, absl::string_view key,
                                      const ReadOptions& read) override {
    KVCOMP_ASSIGN_OR_RETURN(const absl::Time deadline, Deadline(read, options_.get_timeout));
    std::string answered;
    KVCOMP_ASSIGN_OR_RETURN(
        wire::CacheSummary s,
        OnRanking<wire::CacheSummary>(
            model_id, key, [&](UcxClient& c) { return c.Lookup(model_id, key, deadline); },
            deadline, &answered));
    LookupResult r;
    r.layout = s.layout;
    r.endpoint = answered;
    static const char* const kTiers[] = {"device", "host", "disk"};
    r.tier = s.tier < 3 ? kTiers[s.tier] : "unknown";
    r.original_tokens = s.original_tokens;
    r.total_kept = s.total_kept;
    r.original_bytes = s.original_bytes;
    r.stored_bytes = s.stored_bytes;
    r.key_codec = s.key_codec;
    r.value_codec = s.value_codec;
    return r;
  }

  absl::Status Delete(absl::string_view model_id, absl::string_view key) override {
    KVCOMP_RETURN_IF_ERROR(CheckKey(model_id, key));
    KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<const Members> members, LiveMembers());
    bool deleted = false;
    absl::Status unreachable;
    for (size_t i : Rank(*members, model_id, key)) {
      absl::Status s = WithRetries(*members->states[i], [&](UcxClient& c) {
        return c.Delete(model_id, key);
      });
      if (s.ok()) {
        deleted = true;
      } else if (Retryable(s)) {
        unreachable = s;
      } else if (!absl::IsNotFound(s)) {
        return s;
      }
    }
    if (deleted) return absl::OkStatus();
    if (!unreachable.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "cache not found on reachable endpoints; some are unreachable: ",
          unreachable.message()));
    }
    return absl::NotFoundError("cache not found");
  }

  std::vector<EndpointStats> Stats() override {
    std::vector<EndpointStats> out;
    absl::StatusOr<std::shared_ptr<const Members>> members = LiveMembers();
    if (!members.ok()) {
      EndpointStats s;
      s.status = members.status();
      out.push_back(std::move(s));
      return out;
    }
    for (const auto& e : (*members)->states) {
      EndpointStats s;
      s.endpoint = e->address().data;
      if (e->address().control.empty()) {
        s.status = absl::UnimplementedError("no control address configured for this endpoint");
      } else {
        auto r = ControlStats(e->address().control, options_);
        if (r.ok()) {
          s = *r;
          s.endpoint = e->address().data;
        } else {
          s.status = r.status();
        }
      }
      out.push_back(std::move(s));
    }
    return out;
  }

  absl::StatusOr<std::vector<CalibrateResult>> Calibrate(
      absl::string_view model_id, const CalibrateOptions& calibrate) override {
    if (model_id.empty()) return absl::InvalidArgumentError("calibrate: empty model id");
    if (calibrate.value_codec != "pq" && calibrate.rank == 0 &&
        !(calibrate.error_budget > 0.0 && calibrate.error_budget < 1.0)) {
      return absl::InvalidArgumentError(
          "calibrate: give a rank, or an error budget in (0, 1) to pick per-layer ranks");
    }
    if (calibrate.rank != 0 && calibrate.error_budget != 0.0) {
      return absl::InvalidArgumentError("calibrate: give a rank or an error budget, not both");
    }
    KVCOMP_ASSIGN_OR_RETURN(const ValueCodec codec, ParseValueCodec(calibrate.value_codec));
    if (codec == ValueCodec::kRaw) {
      return absl::InvalidArgumentError("calibrate: value codec none needs no projection");
    }
    KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<const Members> members, LiveMembers());
    std::vector<CalibrateResult> out;
    for (const auto& e : members->states) {
      CalibrateResult r;
      if (e->address().control.empty()) {
        r.status = absl::UnimplementedError("no control address configured for this endpoint");
      } else {
        auto c = ControlCalibrate(e->address().control, options_, model_id, calibrate);
        if (c.ok()) {
          r = *c;
        } else {
          r.status = c.status();
        }
      }
      r.endpoint = e->address().data;
      out.push_back(std::move(r));
    }
    return out;
  }

  absl::StatusOr<size_t> LookupPrefix(absl::string_view model_id,
                                      const std::vector<std::string>& keys,
                                      const ReadOptions& read) override {
    KVCOMP_ASSIGN_OR_RETURN(const absl::Time deadline, Deadline(read, options_.lookup_timeout));
    KVCOMP_ASSIGN_OR_RETURN(PrefixPlan plan, PlanPrefix(model_id, keys));
    return LeadingHeld(plan.rankings, [&](size_t ep, const std::vector<size_t>& positions) {
      return AskLookupPrefix(*plan.members->states[ep], model_id, keys, positions, deadline);
    });
  }

  absl::StatusOr<std::vector<std::string>> GetChunkBytes(absl::string_view model_id,
                                                         const std::vector<std::string>& keys,
                                                         bool decoded,
                                                         const ReadOptions& read) override {
    KVCOMP_ASSIGN_OR_RETURN(const absl::Time deadline, Deadline(read, options_.get_timeout));
    KVCOMP_ASSIGN_OR_RETURN(PrefixPlan plan, PlanPrefix(model_id, keys));
    std::vector<std::string> bytes(keys.size());  // each slot written by one endpoint's thread
    KVCOMP_ASSIGN_OR_RETURN(
        size_t held,
        LeadingHeld(plan.rankings, [&](size_t ep, const std::vector<size_t>& positions) {
          return AskGetChunks(*plan.members->states[ep], model_id, keys, positions, decoded,
                              deadline, &bytes);
        }));
    bytes.resize(held);
    return bytes;
  }

  absl::StatusOr<std::vector<CompressedCache>> GetChunks(absl::string_view model_id,
                                                         const std::vector<std::string>& keys,
                                                         bool decoded,
                                                         const ReadOptions& read) override {
    KVCOMP_ASSIGN_OR_RETURN(std::vector<std::string> bytes,
                            GetChunkBytes(model_id, keys, decoded, read));
    std::vector<CompressedCache> out;
    out.reserve(bytes.size());
    for (const std::string& b : bytes) {
      KVCOMP_ASSIGN_OR_RETURN(CompressedCache c, format::ParseCache(b));
      out.push_back(std::move(c));
    }
    return out;
  }

 private:
  struct PrefixPlan {
    std::shared_ptr<const Members> members;
    std::vector<std::vector<size_t>> rankings;  // per key: endpoints, best first
  };

  absl::StatusOr<PrefixPlan> PlanPrefix(absl::string_view model_id,
                                        const std::vector<std::string>& keys) const {
    for (const std::string& k : keys) KVCOMP_RETURN_IF_ERROR(CheckKey(model_id, k));
    PrefixPlan plan;
    if (keys.empty()) return plan;
    KVCOMP_ASSIGN_OR_RETURN(plan.members, LiveMembers());
    for (const auto& e : plan.members->states) {
      if (e->address().control.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "prefix lookups use the control plane; endpoint ", e->address().data,
            " has no control address (give \"data,control\")"));
      }
    }
    plan.rankings.reserve(keys.size());
    for (const std::string& k : keys) plan.rankings.push_back(Rank(*plan.members, model_id, k));
    return plan;
  }

  // The keys at `positions`, in runs of at most kMaxPrefixKeys.
  static std::vector<std::vector<std::string>> PrefixBatches(
      const std::vector<std::string>& keys, const std::vector<size_t>& positions, size_t from) {
    std::vector<std::vector<std::string>> out;
    for (size_t i = from; i < positions.size(); ++i) {
      if (out.empty() || out.back().size() == kMaxPrefixKeys) out.emplace_back();
      out.back().push_back(keys[positions[i]]);
    }
    return out;
  }

  absl::StatusOr<size_t> AskLookupPrefix(EndpointState& ep, absl::string_view model_id,
                                         const std::vector<std::string>& keys,
                                         const std::vector<size_t>& positions,
                                         absl::Time deadline) {
    size_t held = 0;
    for (const std::vector<std::string>& batch : PrefixBatches(keys, positions, 0)) {
      absl::StatusOr<size_t> h =
          ControlLookupPrefix(ep.address().control, options_, model_id, batch, deadline);
      if (!h.ok()) {
        if (Retryable(h.status())) pool_->RefreshSoon();
        return h.status();
      }
      held += *h;
      if (*h < batch.size()) break;
    }
    return held;
  }

  absl::StatusOr<size_t> AskGetChunks(EndpointState& ep, absl::string_view model_id,
                                      const std::vector<std::string>& keys,
                                      const std::vector<size_t>& positions, bool decoded,
                                      absl::Time deadline, std::vector<std::string>* bytes) {
    size_t got = 0;
    while (got < positions.size()) {
      std::vector<std::string> batch = PrefixBatches(keys, positions, got).front();
      absl::StatusOr<ChunkReply> r =
          ControlGetChunks(ep.address().control, options_, model_id, batch, decoded, deadline);
      if (absl::IsResourceExhausted(r.status())) {
        // The next chunk alone passes the daemon's reply bound (control_plane.max_reply_bytes),
        // or this tenant's replies in progress hold theirs: that chunk comes over the data plane.
        const std::string& key = keys[positions[got]];
        absl::StatusOr<transport::FetchedCache> one = WithRetries(
            ep,
            [&](UcxClient& c) {
              return c.Get(model_id, key,
                           decoded ? wire::Representation::kDecoded
                                   : wire::Representation::kStored,
                           deadline);
            },
            deadline);
        if (one.ok()) {
          (*bytes)[positions[got++]] = std::string(one->bytes.view());
          continue;
        }
        if (absl::IsNotFound(one.status())) break;  // the run ends here
        if (got > 0) return got;
        return one.status();
      }
      if (!r.ok()) {
        if (Retryable(r.status())) pool_->RefreshSoon();
        if (got > 0 && (Retryable(r.status()) || IsBusy(r.status()))) return got;
        return r.status();
      }
      for (std::string& c : r->caches) (*bytes)[positions[got++]] = std::move(c);
      const bool whole_batch = r->caches.size() == batch.size();
      if (!(whole_batch || (r->truncated && !r->caches.empty()))) break;  // one went missing
    }
    return got;
  }

  static constexpr size_t kMaxPrefixKeys = 1024;  // the IDL's MAX_PREFIX_KEYS

  absl::Status CheckKey(absl::string_view model_id, absl::string_view key) const {
    CacheKey k{options_.tenant, std::string(model_id), std::string(key)};
    return k.Validate();
  }

  std::vector<size_t> Rank(const Members& members, absl::string_view model_id,
                           absl::string_view key) const {
    CacheKey k{options_.tenant, std::string(model_id), std::string(key)};
    return RendezvousRank(members.names, k.Encode());
  }

  // The current members; Unavailable (saying why) when the pool has none.
  absl::StatusOr<std::shared_ptr<const Members>> LiveMembers() const {
    std::shared_ptr<const Members> members = pool_->Current();
    if (members->states.empty()) {
      pool_->RefreshSoon();
      return members->empty_reason;
    }
    return members;
  }

  // The end of a read: now + the call's timeout, or + `fallback` (the client's) when it gives
  // none. InvalidArgument for a timeout outside [1 ms, 24 h].
  static absl::StatusOr<absl::Time> Deadline(const ReadOptions& read, absl::Duration fallback) {
    if (read.timeout == absl::ZeroDuration()) return absl::Now() + fallback;
    if (read.timeout < absl::Milliseconds(1) || read.timeout > absl::Hours(24)) {
      return absl::InvalidArgumentError(absl::StrCat("the call's timeout is ",
                                                     absl::FormatDuration(read.timeout),
                                                     "; it must be in [1ms, 24h]"));
    }
    return absl::Now() + read.timeout;
  }

  // DeadlineExceeded with ErrorDetail::kCallDeadline naming the last error (`last` itself when
  // it is one already).
  static absl::Status DeadlinePassed(const absl::Status& last) {
    if (DetailOf(last) == ErrorDetail::kCallDeadline) return last;
    return WithDetail(absl::DeadlineExceededError(
                          last.ok() ? std::string("the call's deadline passed")
                                    : absl::StrCat("the call's deadline passed; last: ",
                                                   last.message())),
                      ErrorDetail::kCallDeadline);
  }

  // Runs `fn` on one endpoint's connection, retrying retryable failures with backoff, until
  // `deadline` (connecting included: the connect timeout is cut to what is left of it).
  template <typename Fn>
  auto WithRetries(EndpointState& ep, Fn fn, absl::Time deadline = absl::InfiniteFuture())
      -> decltype(fn(std::declval<UcxClient&>())) {
    absl::Duration backoff = options_.initial_backoff;
    decltype(fn(std::declval<UcxClient&>())) result = absl::UnknownError("not attempted");
    for (int attempt = 0; attempt < std::max(1, options_.attempts_per_endpoint); ++attempt) {
      if (attempt > 0) {
        absl::SleepFor(std::min(backoff, deadline - absl::Now()));
        backoff = std::min(backoff * 2, options_.max_backoff);
      }
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return attempt == 0 ? DeadlinePassed(absl::OkStatus()) : DeadlinePassed(StatusOf(result));
      }
      ClientOptions within = options_;
      within.connect_timeout = std::min(options_.connect_timeout, left);
      auto conn = ep.Connection(within);
      if (!conn.ok()) {
        result = conn.status();
        if (!Retryable(conn.status())) return result;
        pool_->RefreshSoon();
        continue;
      }
      result = fn(**conn);
      absl::Status s = StatusOf(result);
      if (s.ok() || !(Retryable(s) || IsBusy(s))) return result;
      if (!(*conn)->connected()) {
        ep.MarkDown(options_, s);
        pool_->RefreshSoon();
      }
    }
    return result;
  }

  static absl::Status StatusOf(const absl::Status& s) { return s; }
  template <typename T>
  static absl::Status StatusOf(const absl::StatusOr<T>& s) {
    return s.status();
  }

  // Tries the key's ranking in order until one endpoint has the cache, until `deadline`
  // (DeadlineExceeded, naming the last endpoint's error, when it passes first).
  template <typename T, typename Fn>
  absl::StatusOr<T> OnRanking(absl::string_view model_id, absl::string_view key, Fn fn,
                              absl::Time deadline, std::string* answered = nullptr) {
    KVCOMP_RETURN_IF_ERROR(CheckKey(model_id, key));
    KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<const Members> members, LiveMembers());
    absl::Status unreachable;
    for (size_t i : Rank(*members, model_id, key)) {
      if (absl::Now() >= deadline) return DeadlinePassed(unreachable);
      absl::StatusOr<T> r = WithRetries(*members->states[i], fn, deadline);
      if (r.ok()) {
        if (answered != nullptr) *answered = members->names[i];
        return r;
      }
      if (absl::IsNotFound(r.status())) continue;
      if (Retryable(r.status()) || IsBusy(r.status())) {
        unreachable = DetailOf(r.status()) == ErrorDetail::kCallDeadline
                          ? r.status()
                          : Annotate(r.status(), members->names[i]);
        continue;
      }
      return r.status();
    }
    if (!unreachable.ok()) {
      if (absl::Now() >= deadline) return DeadlinePassed(unreachable);
      return absl::UnavailableError(absl::StrCat(
          "cache not found on reachable endpoints; some are unreachable: ",
          unreachable.message()));
    }
    return absl::NotFoundError("cache not found");
  }

  absl::StatusOr<transport::FetchedCache> Fetch(absl::string_view model_id, absl::string_view key,
                                                wire::Representation rep, absl::Time deadline) {
    return OnRanking<transport::FetchedCache>(
        model_id, key, [&](UcxClient& c) { return c.Get(model_id, key, rep, deadline); },
        deadline);
  }

  const ClientOptions options_;
  const std::shared_ptr<Pool> pool_;
  std::unique_ptr<GpuPath> gpu_;
};

}  // namespace

absl::StatusOr<PutResult> Client::PutDevice(absl::string_view, absl::string_view,
                                            const KvLayout&, uint64_t,
                                            const std::vector<DeviceLayerData>&, void*,
                                            const PutOptions&) {
  return absl::UnimplementedError("device puts are not implemented by this client");
}
absl::StatusOr<DeviceGetResult> Client::GetKvIntoDevice(absl::string_view, absl::string_view,
                                                        const KvLayout&, uint64_t,
                                                        const std::vector<DeviceLayerOut>&,
                                                        void*) {
  return absl::UnimplementedError("device gets are not implemented by this client");
}
absl::StatusOr<DeviceGetResult> Client::GetIntoDevice(absl::string_view, absl::string_view,
                                                      void*, size_t, void*, bool) {
  return absl::UnimplementedError("device gets are not implemented by this client");
}
absl::Status Client::ProbeGpuChannel(const std::string&, int) {
  return absl::UnimplementedError("no GPU channel in this client");
}
GpuChannelStats Client::GpuStats() const { return {}; }
absl::StatusOr<std::unique_ptr<DevicePutStream>> Client::OpenDevicePutStream(
    absl::string_view, absl::string_view, const KvLayout&, uint64_t, int, const PutOptions&) {
  return absl::UnimplementedError("device put streams are not implemented by this client");
}
absl::StatusOr<std::unique_ptr<DeviceGetStream>> Client::OpenDeviceGetStream(
    absl::string_view, absl::string_view, const KvLayout&, uint64_t,
    const std::vector<DeviceLayerOut>&, void*) {
  return absl::UnimplementedError("device get streams are not implemented by this client");
}

absl::Status PutStream::AppendLayer(uint32_t layer, const void* keys, const void* values) {
  return Append(layer, 0, num_tokens(), keys, values);
}

absl::StatusOr<EndpointAddress> EndpointAddress::Parse(absl::string_view text) {
  std::vector<std::string> parts = absl::StrSplit(text, ',');
  if (parts.empty() || parts.size() > 2 || parts[0].empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("endpoint '", text, "': expected host:port[,control_host:port]"));
  }
  EndpointAddress a;
  KVCOMP_RETURN_IF_ERROR(transport::Endpoint::Parse(parts[0]).status());
  a.data = parts[0];
  if (parts.size() == 2) {
    KVCOMP_RETURN_IF_ERROR(transport::Endpoint::Parse(parts[1]).status());
    a.control = parts[1];
  }
  return a;
}

namespace {

// `value` within [lo, hi], or InvalidArgument naming the option.
absl::Status InRange(const char* name, absl::Duration value, absl::Duration lo, absl::Duration hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(name, " is ", absl::FormatDuration(value),
                                                 "; it must be in [", absl::FormatDuration(lo),
                                                 ", ", absl::FormatDuration(hi), "]"));
}

absl::Status ValidateOptions(const ClientOptions& o) {
  if (o.replicas < 1 || o.replicas > 64) {
    return absl::InvalidArgumentError(absl::StrCat("replicas is ", o.replicas, "; it must be in [1, 64]"));
  }
  if (o.attempts_per_endpoint < 1 || o.attempts_per_endpoint > 100) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attempts_per_endpoint is ", o.attempts_per_endpoint, "; it must be in [1, 100]"));
  }
  if (o.max_block_bytes < 4096 || o.max_block_bytes > (uint64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_block_bytes is ", o.max_block_bytes, "; it must be in [4096, 1Gi]"));
  }
  if (o.shm_copy_lanes > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm_copy_lanes is ", o.shm_copy_lanes, "; it must be in [0, 16]"));
  }
  KVCOMP_RETURN_IF_ERROR(
      InRange("connect_timeout", o.connect_timeout, absl::Milliseconds(1), absl::Hours(1)));
  KVCOMP_RETURN_IF_ERROR(
      InRange("request_timeout", o.request_timeout, absl::Milliseconds(1), absl::Hours(24)));
  KVCOMP_RETURN_IF_ERROR(
      InRange("max_backoff", o.max_backoff, absl::ZeroDuration(), absl::Minutes(10)));
  KVCOMP_RETURN_IF_ERROR(
      InRange("initial_backoff", o.initial_backoff, absl::ZeroDuration(), o.max_backoff));
  KVCOMP_RETURN_IF_ERROR(InRange("down_for", o.down_for, absl::ZeroDuration(), absl::Hours(1)));
  KVCOMP_RETURN_IF_ERROR(
      InRange("lookup_timeout", o.lookup_timeout, absl::Milliseconds(1), absl::Hours(1)));
  KVCOMP_RETURN_IF_ERROR(
      InRange("get_timeout", o.get_timeout, absl::Milliseconds(1), absl::Hours(24)));
  // Zero: no periodic refresh. Otherwise at least 100 ms: a shorter period would send DNS
  // queries as fast as the resolver answers.
  if (o.dns_refresh_interval != absl::ZeroDuration()) {
    KVCOMP_RETURN_IF_ERROR(InRange("dns_refresh_interval", o.dns_refresh_interval,
                                   absl::Milliseconds(100), absl::Hours(24)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::vector<std::string>& endpoints,
                                                        const ClientOptions& options,
                                                        bool connect_now) {
  if (endpoints.empty()) return absl::InvalidArgumentError("no endpoints given");
  KVCOMP_RETURN_IF_ERROR(ValidateOptions(options));
  CacheKey probe{options.tenant, "m", "k"};
  KVCOMP_RETURN_IF_ERROR(probe.Validate());
  std::unique_ptr<Resolver> resolver;
  for (const std::string& text : endpoints) {
    KVCOMP_ASSIGN_OR_RETURN(std::optional<DnsEndpoint> dns, ParseDnsEndpoint(text));
    if (!dns.has_value() || resolver != nullptr) continue;
    ResolverOptions ro;
    ro.servers = options.dns_server;
    ro.timeout = std::max(options.connect_timeout, absl::Milliseconds(100));
    KVCOMP_ASSIGN_OR_RETURN(resolver, NewAresResolver(ro));
  }
  KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool,
                          Pool::Create(endpoints, options, std::move(resolver)));
  auto client = std::make_unique<ClientImpl>(options, std::move(pool));
  if (connect_now) KVCOMP_RETURN_IF_ERROR(client->ConnectAll());
  return std::unique_ptr<Client>(std::move(client));
}

}  // namespace client
}  // namespace kvcomp
