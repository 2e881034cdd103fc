// The control plane's GPU channel calls (service/thrift/kvcomp.thrift): opening and closing a
// channel (the link's negotiation) and its gets. Each authenticates, checks its arguments into
// the service's types and hands them to GpuChannels, which checks that the channel belongs to
// the caller's tenant. A put over the channel is a data-plane put (data_plane.cc).
#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu_channel.h"
#include "handlers.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/status.h"
#include "kvcomp/storage/types.h"
#include "log.h"

namespace kvcomp {
namespace service {

namespace {

// The channel's owner: the authenticated tenant, or the status to answer.
#define KVCOMP_GPU_AUTH(tenant_var, out)         \
  auto tenant_var##_or = Authenticate(auth);     \
  if (!tenant_var##_or.ok()) {                   \
    out.status = ToRpc(tenant_var##_or.status()); \
    return;                                      \
  }                                              \
  const std::string tenant_var = *tenant_var##_or

absl::Status NoChannels(const ServiceContext* ctx) {
  return ctx->gpu == nullptr ? absl::FailedPreconditionError("no GPU channel on this daemon")
                             : absl::OkStatus();
}

absl::StatusOr<uint64_t> ChannelId(int64_t id) {
  if (id <= 0) return absl::InvalidArgumentError("channel_id must be positive");
  return static_cast<uint64_t>(id);
}

// The client's memory of a transfer in mode "ipc", checked for shape (the daemon checks it
// against the transfer and the allocations when it maps them).
absl::StatusOr<GpuIpcSpec> IpcFromRpc(const rpc::GpuIpcPayload& p) {
  constexpr size_t kHandleBytes = 64;
  constexpr size_t kMaxItems = 1 << 16;
  if (p.buffers.empty() || p.chunks.empty()) {
    return absl::InvalidArgumentError("ipc: buffers and chunks must not be empty");
  }
  if (p.buffers.size() > kMaxItems || p.chunks.size() > kMaxItems) {
    return absl::InvalidArgumentError("ipc: too many buffers or chunks");
  }
  GpuIpcSpec out;
  for (const std::string& h : p.buffers) {
    if (h.size() != kHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat("ipc: a memory handle has ", h.size(),
                                                     " bytes; 64 expected"));
    }
    out.buffers.push_back(h);
  }
  for (const rpc::GpuIpcChunk& c : p.chunks) {
    if (c.buffer < 0 || static_cast<size_t>(c.buffer) >= p.buffers.size()) {
      return absl::InvalidArgumentError(absl::StrCat("ipc: chunk names buffer ", c.buffer, " of ",
                                                     p.buffers.size()));
    }
    if (c.offset < 0 || c.bytes <= 0) {
      return absl::InvalidArgumentError("ipc: chunk offsets must be >= 0 and sizes positive");
    }
    out.chunks.push_back({static_cast<uint32_t>(c.buffer), static_cast<uint64_t>(c.offset),
                          static_cast<uint64_t>(c.bytes)});
  }
  return out;
}

rpc::Layout LayoutToRpc(const KvLayout& l) {
  rpc::Layout r;
  r.num_layers = static_cast<int32_t>(l.num_layers);
  r.num_kv_heads = static_cast<int32_t>(l.num_kv_heads);
  r.num_q_heads = static_cast<int32_t>(l.num_q_heads);
  r.head_dim = static_cast<int32_t>(l.head_dim);
  r.dtype = std::string(DTypeName(l.dtype));
  return r;
}

}  // namespace

void ControlHandler::OpenGpuChannel(rpc::GpuChannelResponse& out, const rpc::Auth& auth,
                                    const rpc::GpuChannelRequest& request) {
  KVCOMP_GPU_AUTH(tenant, out);
  absl::Status s = NoChannels(ctx_);
  if (s.ok() && request.device_uuid.size() != 16) {
    s = absl::InvalidArgumentError("device_uuid must be the 16-byte CUDA device UUID");
  }
  if (s.ok() && request.__isset.ipc_event && request.ipc_event.size() != 64) {
    s = absl::InvalidArgumentError("ipc_event must be a 64-byte CUDA IPC event handle");
  }
  // Puts over the channel are data-plane puts (link blocks, protocol 1.4): an SDK that does not
  // send them so goes over the data plane's own links.
  if (s.ok() && ctx_->gpu->available() &&
      !(request.__isset.data_plane_puts && request.data_plane_puts)) {
    s = absl::FailedPreconditionError(
        "this kvcompd takes GPU channel puts as link blocks on the data plane (protocol 1.4), "
        "which this SDK predates: device memory goes over the data plane");
  }
  if (!s.ok()) {
    out.status = ToRpc(s);
    return;
  }
  auto info = ctx_->gpu->Open(tenant, request.nccl_version, request.device_uuid,
                              request.__isset.ipc_event ? request.ipc_event : std::string());
  if (!info.ok()) {
    if (!absl::IsFailedPrecondition(info.status())) ctx_->metrics->CountError("gpu_channel", info.status());
    out.status = ToRpc(info.status());
    return;
  }
  out.channel_id = static_cast<int64_t>(info->channel_id);
  out.nccl_unique_id = info->nccl_unique_id;
  out.nccl_version = info->nccl_version;
  out.daemon_device = info->device;
  out.max_transfer_bytes = static_cast<int64_t>(info->max_transfer_bytes);
  out.transfer_timeout_ms = static_cast<int32_t>(absl::ToInt64Milliseconds(info->transfer_timeout));
  out.__set_mode(info->ipc ? "ipc" : "nccl");
  out.__set_data_plane_puts(true);
}

void ControlHandler::CloseGpuChannel(rpc::GpuCloseResponse& out, const rpc::Auth& auth,
                                     int64_t channel_id) {
  KVCOMP_GPU_AUTH(tenant, out);
  absl::Status s = NoChannels(ctx_);
  absl::StatusOr<uint64_t> id = ChannelId(channel_id);
  if (s.ok()) s = id.status();
  if (s.ok()) s = ctx_->gpu->Close(tenant, *id);
  out.status = ToRpc(s);
}

void ControlHandler::GpuGet(rpc::GpuTransferResponse& out, const rpc::Auth& auth,
                            int64_t channel_id, const rpc::GpuGetRequest& request) {
  KVCOMP_GPU_AUTH(tenant, out);
  ctx_->gets_total.fetch_add(1);
  auto begin = [&]() -> absl::StatusOr<GpuGetBegun> {
    KVCOMP_RETURN_IF_ERROR(NoChannels(ctx_));
    KVCOMP_ASSIGN_OR_RETURN(uint64_t id, ChannelId(channel_id));
    CacheKey key{tenant, request.ref.model_id, request.ref.key};
    KVCOMP_RETURN_IF_ERROR(key.Validate());
    if (request.capacity <= 0) return absl::InvalidArgumentError("capacity must be positive");
    GpuGetForm form;
    switch (request.form) {
      case rpc::GpuGetForm::STORED: form = GpuGetForm::kStored; break;
      case rpc::GpuGetForm::DECODED: form = GpuGetForm::kDecoded; break;
      case rpc::GpuGetForm::DENSE_KV: form = GpuGetForm::kDenseKv; break;
      default: return absl::InvalidArgumentError("unknown GPU get form");
    }
    GpuIpcSpec ipc;
    GpuTransferShape shape;
    shape.layer_major = request.__isset.layer_major && request.layer_major;
    if (shape.layer_major && form != GpuGetForm::kDenseKv) {
      return absl::InvalidArgumentError("layer_major is for DENSE_KV gets");
    }
    if (request.__isset.ipc) {
      KVCOMP_ASSIGN_OR_RETURN(ipc, IpcFromRpc(request.ipc));
      shape.ipc = &ipc;
    }
    return ctx_->gpu->GetBegin(tenant, id, key, form, static_cast<uint64_t>(request.capacity),
                               shape);
  };
  absl::StatusOr<GpuGetBegun> r = begin();
  if (!r.ok()) {
    absl::Status e = r.status();
    if (absl::IsNotFound(e) && DetailOf(e) != ErrorDetail::kLinkGone) {
      e = absl::NotFoundError("cache not found");  // another tenant's reads as absent
    }
    ctx_->metrics->CountError("get", e);
    out.status = ToRpc(e);
    return;
  }
  out.transfer_id = static_cast<int64_t>(r->transfer_id);
  out.payload_bytes = static_cast<int64_t>(r->payload_bytes);
  out.layout = LayoutToRpc(r->layout);
  out.num_tokens = static_cast<int64_t>(r->num_tokens);
  if (r->copy_seconds > 0) out.__set_copy_seconds(r->copy_seconds);
  if (r->transfer_id != 0) out.__set_finish_optional(true);  // the daemon collects its send
}

void ControlHandler::GpuGetFinish(rpc::GpuCloseResponse& out, const rpc::Auth& auth,
                                  int64_t channel_id, int64_t transfer_id) {
  KVCOMP_GPU_AUTH(tenant, out);
  absl::Status s = NoChannels(ctx_);
  absl::StatusOr<uint64_t> id = ChannelId(channel_id);
  if (s.ok()) s = id.status();
  if (s.ok()) s = ctx_->gpu->GetFinish(tenant, *id, static_cast<uint64_t>(transfer_id));
  if (!s.ok()) ctx_->metrics->CountError("get", s);
  out.status = ToRpc(s);
}

}  // namespace service
}  // namespace kvcomp
