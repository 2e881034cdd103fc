#include "device_ucx.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/gpu_link.h"
#include "kvcomp/transport/ucx.h"

namespace kvcomp {
namespace client {

namespace wire = transport::wire;
using transport::GpuRuntime;
using transport::MemoryType;
using transport::UcxClient;

bool LocalUcxCudaMemory() {
  static const bool cuda = [] {
    absl::StatusOr<transport::UcxCapabilities> caps = transport::QueryUcxCapabilities();
    return caps.ok() && caps->cuda_memory;
  }();
  return cuda;
}

namespace {

constexpr char kNoLocalCuda[] =
    "this process's UCX has no CUDA memory support (no cuda_copy / cuda_ipc transports)";

// The blocks of one put on one connection, pipelined within half the connection's in-flight
// bound (as the host path's puts are).
class DeviceBlocks {
 public:
  DeviceBlocks(UcxClient& conn, uint64_t put_id, uint64_t window)
      : conn_(conn), put_id_(put_id), window_(window) {}

  void Send(uint32_t layer, uint64_t num_tokens, uint64_t bytes, bool values, const void* data) {
    wire::Block b;
    b.put_id = put_id_;
    b.layer_begin = layer;
    b.layer_end = layer + 1;
    b.token_begin = 0;
    b.token_end = num_tokens;
    b.parts = values ? wire::kPartValues : wire::kPartKeys;
    (values ? b.value_bytes : b.key_bytes) = bytes;
    {
      absl::MutexLock lock(&mu_);
      auto room = [&] { return inflight_ + bytes <= window_ || inflight_ == 0; };
      mu_.Await(absl::Condition(&room));
      inflight_ += bytes;
      ++sent_;
    }
    conn_.SendBlockAsync(
        b, values ? nullptr : data, values ? data : nullptr,
        [this, bytes](absl::Status s) {
          absl::MutexLock lock(&mu_);
          inflight_ -= bytes;
          if (!s.ok() && error_.ok()) error_ = s;
        },
        MemoryType::kCuda);
  }

  // Waits until every block is acknowledged; the first failure.
  absl::Status Wait() {
    absl::MutexLock lock(&mu_);
    auto idle = [&] { return inflight_ == 0; };
    mu_.Await(absl::Condition(&idle));
    return error_;
  }
  uint64_t sent() {
    absl::MutexLock lock(&mu_);
    return sent_;
  }

 private:
  UcxClient& conn_;
  const uint64_t put_id_;
  const uint64_t window_;
  absl::Mutex mu_;
  uint64_t inflight_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t sent_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::optional<PutResult>> PutDeviceOverUcx(
    Client& self, absl::string_view model_id, absl::string_view key, const KvLayout& layout,
    uint64_t num_tokens, const std::vector<DeviceLayerData>& layers, void* stream,
    const PutOptions& options, int replicas, std::string* why) {
  if (!LocalUcxCudaMemory()) {
    *why = kNoLocalCuda;
    return std::nullopt;
  }
  KVCOMP_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<UcxClient>> conns,
                          RankedConnections(self, model_id, key, std::max(1, replicas)));
  const uint64_t layer_bytes = layout.LayerBytes(num_tokens);
  for (const auto& c : conns) {
    if (absl::Status s = c->DevicePayloads(); !s.ok()) {
      *why = std::string(s.message());
      return std::nullopt;
    }
    if (layer_bytes > c->server_info().max_payload_bytes) {
      *why = absl::StrCat("a layer's keys (", layer_bytes, " bytes) exceed the daemon's block "
                          "limit of ", c->server_info().max_payload_bytes, " bytes");
      return std::nullopt;
    }
  }
  // UCX reads the device memory outside any stream: the producer's work on `stream` first.
  KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, GpuRuntime::Get());
  KVCOMP_RETURN_IF_ERROR(rt->WaitStream(stream, absl::Now() + absl::Minutes(1)));

  wire::PutBegin begin;
  begin.layout = layout;
  begin.num_tokens = num_tokens;
  begin.model_id = std::string(model_id);
  begin.key = std::string(key);
  begin.has_policy = options.policy.has_value();
  if (options.policy) begin.policy = *options.policy;
  PutResult result;
  result.path = "ucx-cuda";
  double transfer = 0;
  for (const auto& c : conns) {
    KVCOMP_ASSIGN_OR_RETURN(uint64_t put_id, c->PutBegin(begin));
    const uint64_t window = std::max(layer_bytes, c->server_info().max_inflight_bytes / 2);
    DeviceBlocks blocks(*c, put_id, window);
    const absl::Time t0 = absl::Now();
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
      blocks.Send(l, num_tokens, layer_bytes, /*values=*/false, layers[l].keys);
      blocks.Send(l, num_tokens, layer_bytes, /*values=*/true, layers[l].values);
    }
    if (absl::Status s = blocks.Wait(); !s.ok()) {
      c->PutAbort(put_id).IgnoreError();
      return s;
    }
    transfer = std::max(transfer, absl::ToDoubleSeconds(absl::Now() - t0));
    KVCOMP_ASSIGN_OR_RETURN(wire::CacheSummary summary, c->PutCommit(put_id, blocks.sent()));
    result.original_bytes = summary.original_bytes;
    result.stored_bytes = summary.stored_bytes;
    result.total_kept = summary.total_kept;
  }
  result.transfer_seconds = transfer;
  return result;
}

absl::StatusOr<std::optional<DeviceGetResult>> GetIntoDeviceOverUcx(
    Client& self, absl::string_view model_id, absl::string_view key, void* dst, size_t capacity,
    void* stream, bool decoded, std::string* why) {
  if (!LocalUcxCudaMemory()) {
    *why = kNoLocalCuda;
    return std::nullopt;
  }
  KVCOMP_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<UcxClient>> conns,
                          RankedConnections(self, model_id, key, 1 << 20));
  // The receive writes `dst` outside any stream: work queued on it before goes first.
  KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, GpuRuntime::Get());
  KVCOMP_RETURN_IF_ERROR(rt->WaitStream(stream, absl::Now() + absl::Minutes(1)));
  const wire::Representation rep =
      decoded ? wire::Representation::kDecoded : wire::Representation::kStored;
  absl::Status last = absl::NotFoundError(absl::StrCat("no cache ", model_id, "/", key));
  for (const auto& c : conns) {
    const absl::Time t0 = absl::Now();
    absl::StatusOr<size_t> n = c->GetInto(model_id, key, rep, dst, capacity, MemoryType::kCuda);
    if (n.ok()) {
      DeviceGetResult out;
      out.bytes = *n;
      out.path = "ucx-cuda";
      out.transfer_seconds = absl::ToDoubleSeconds(absl::Now() - t0);
      return out;
    }
    if (!absl::IsNotFound(n.status()) && !absl::IsUnavailable(n.status()) &&
        !absl::IsDeadlineExceeded(n.status())) {
      return n.status();
    }
    if (!absl::IsNotFound(n.status())) last = n.status();
  }
  return last;
}

}  // namespace client
}  // namespace kvcomp
