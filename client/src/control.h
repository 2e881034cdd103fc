// The SDK's calls to kvcompd's Thrift control plane (service/thrift/kvcomp.thrift). Thrift's
// exceptions stop here and become statuses: FailedPrecondition naming what answered when the
// address is not a kvcompd control port, DeadlineExceeded when nothing answered in time,
// Unavailable when it cannot be reached.
#ifndef KVCOMP_CLIENT_SRC_CONTROL_H_
#define KVCOMP_CLIENT_SRC_CONTROL_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvcomp/client/client.h"

namespace kvcomp {
namespace client {

// Stats of the calling tenant on the daemon whose control port is `address` ("host:port").
absl::StatusOr<EndpointStats> ControlStats(const std::string& address,
                                           const ClientOptions& options);

// Calibrate on the daemon whose control port is `address`; `endpoint` left empty.
absl::StatusOr<CalibrateResult> ControlCalibrate(const std::string& address,
                                                 const ClientOptions& options,
                                                 absl::string_view model_id,
                                                 const CalibrateOptions& calibrate);

// How many leading `keys` (at most rpc MAX_PREFIX_KEYS) the tenant holds on that daemon,
// answered before `deadline` (DeadlineExceeded otherwise).
absl::StatusOr<size_t> ControlLookupPrefix(const std::string& address,
                                           const ClientOptions& options,
                                           absl::string_view model_id,
                                           const std::vector<std::string>& keys,
                                           absl::Time deadline = absl::InfiniteFuture());

// The stored (or decoded) bytes of the leading `keys` held on that daemon, one request.
struct ChunkReply {
  std::vector<std::string> caches;
  bool truncated = false;  // stopped before a missing key: ask again for the keys after these
};
// Bytes asked for per GetChunks reply, and the frame bound the SDK accepts for one.
constexpr int64_t kChunkReplyBytes = int64_t{64} << 20;
constexpr int kMaxChunkReplyFrame = 1 << 30;
absl::StatusOr<ChunkReply> ControlGetChunks(const std::string& address,
                                            const ClientOptions& options,
                                            absl::string_view model_id,
                                            const std::vector<std::string>& keys, bool decoded,
                                            absl::Time deadline = absl::InfiniteFuture(),
                                            int64_t max_bytes = kChunkReplyBytes);

// The GPU channel's control calls (docs/protocol.md, "GPU channel").
struct GpuChannelGrant {
  uint64_t channel_id = 0;
  std::string nccl_unique_id;
  int nccl_version = 0;
  int daemon_device = 0;
  uint64_t max_transfer_bytes = 0;
  absl::Duration transfer_timeout;
  bool ipc = false;  // mode "ipc": the daemon shares the client's GPU (no NCCL communicator)
  // The daemon takes the channel's puts and gets on the data plane (protocol 1.5); false: an
  // older daemon, whose channel this SDK does not use.
  bool data_plane = false;
};
// `ipc_event`: the handle of the client's interprocess event (offers CUDA IPC); empty: none.
absl::StatusOr<GpuChannelGrant> ControlOpenGpuChannel(const std::string& address,
                                                      const ClientOptions& options,
                                                      int nccl_version,
                                                      const std::string& device_uuid,
                                                      const std::string& ipc_event = "");
absl::Status ControlCloseGpuChannel(const std::string& address, const ClientOptions& options,
                                    uint64_t channel_id);

}  // namespace client
}  // namespace kvcomp

#endif  // KVCOMP_CLIENT_SRC_CONTROL_H_
