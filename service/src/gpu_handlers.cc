// The control plane's GPU channel calls (service/thrift/kvcomp.thrift): opening and closing a
// channel, the link's negotiation. Each authenticates, checks its arguments into the service's
// types and hands them to GpuChannels, which checks that the channel belongs to the caller's
// tenant. Puts and gets over the channel are data-plane requests (data_plane.cc).
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
  // Puts and gets over the channel are data-plane requests (link blocks, protocol 1.4; link
  // gets, 1.5): an SDK that does not send them so goes over the data plane's own links.
  if (s.ok() && ctx_->gpu->available() &&
      !(request.__isset.data_plane_gets && request.data_plane_gets)) {
    s = absl::FailedPreconditionError(
        "this kvcompd serves GPU channel puts and gets on the data plane (protocol 1.5), which "
        "this SDK predates: device memory goes over the data plane");
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
  out.__set_data_plane_gets(true);
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

}  // namespace service
}  // namespace kvcomp
