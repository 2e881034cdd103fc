#include "device_ucx.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/gpu_link.h"
#include "kvcomp/transport/ucx.h"
#include "kvcomp/transport/ucx_link.h"

namespace kvcomp {
namespace client {

namespace wire = transport::wire;
using transport::GpuRuntime;
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
    const transport::UcxLinks links(c.get());
    transport::BlockPipe blocks(links, window);
    const absl::Time t0 = absl::Now();
    // Each layer's keys and values a block of their own, from device memory (ucx-cuda).
    wire::Block b;
    b.put_id = put_id;
    b.token_end = num_tokens;
    const transport::MemoryRegion none{nullptr, 0, transport::MemoryKind::kCuda};
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
      b.layer_begin = l;
      b.layer_end = l + 1;
      for (const bool values : {false, true}) {
        b.parts = values ? wire::kPartValues : wire::kPartKeys;
        b.key_bytes = values ? 0 : layer_bytes;
        b.value_bytes = values ? layer_bytes : 0;
        const transport::MemoryRegion data{
            const_cast<void*>(values ? layers[l].values : layers[l].keys), layer_bytes,
            transport::MemoryKind::kCuda};
        blocks.Send(b, values ? none : data, values ? data : none);
      }
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
  const transport::GetRequest request{
      std::string(model_id), std::string(key),
      decoded ? wire::Representation::kDecoded : wire::Representation::kStored};
  const transport::MemoryRegion into{dst, capacity, transport::MemoryKind::kCuda};
  absl::Status last = absl::NotFoundError(absl::StrCat("no cache ", model_id, "/", key));
  for (const auto& c : conns) {
    const absl::Time t0 = absl::Now();
    absl::StatusOr<uint64_t> n =
        transport::UcxLinks(c.get()).GetInto(request, into, absl::InfiniteFuture());
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
