// GpuChannels: kvcompd's side of the GPU channel (docs/protocol.md, "GPU channel"). A client
// whose KV cache lives in GPU memory opens a channel over the control plane; the daemon makes an
// NCCL unique id and joins the two-rank communicator as rank 0 on the engine's CUDA device. The
// channel is then a payload link: a put is a data-plane put (PutBegin, one link block, Commit:
// the transport server's admission, ledger, deadlines and asynchronous replies) whose block's K
// and V the channel receives (Receive, called by the data plane for wire::kBlockLinkPayload);
// a get is a data-plane get naming the channel, whose payload the channel sends (Send). This
// file is the second place (beside data_plane.cc) where the service meets the transport:
// gpu_channel.cc alone includes the GPU link.
//
// A client on the daemon's own GPU cannot be an NCCL peer: its channel is in mode "ipc"
// instead. The client names its device memory by CUDA IPC handles in each transfer; the daemon
// maps them, copies on the device after the client's interprocess event (recorded on the
// caller's stream), and unmaps them before it answers.
//
// With several GPU engines (engine.cuda_devices) each channel is bound to one device when it
// opens: the client's own GPU when it is one of the daemon's (mode "ipc"), else the device of
// the engine EngineSet::Pick chooses (the most free reservation headroom, then the shortest
// queue). The channel's communicator, stream and buffers live on that device. A put's K and V
// stay in the channel's device memory when the put's engine runs on that device (one copy on
// the device into the engine's); otherwise they are copied to pinned host memory first.
//
// A get is a data-plane get that names the channel (Send): a chain of steps on the channels'
// threads (the service's and the engines' work hands the next step back), then the link's send.
// A STORED get on a GPU engine is read from the store straight into the channel's device memory
// (CacheRepository::GetInto: from the GPU tier one copy on the device); other gets are read into
// host memory and copied up.
//
// Lifetime: channels are closed by the client (Close), when a transfer fails or passes the
// transfer timeout (the communicator is aborted, so a peer that died leaves nothing waiting),
// after the idle timeout, and all at once by Stop. Drain refuses new channels and transfers.
//
// Thread-safety: every method may be called from any thread; transfers on one channel
// serialise.
#ifndef KVCOMP_SERVICE_SRC_GPU_CHANNEL_H_
#define KVCOMP_SERVICE_SRC_GPU_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache_service.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/service/metrics.h"
#include "kvcomp/service/options.h"
#include "put.h"

namespace kvcomp {
namespace service {

struct GpuChannelInfo {
  uint64_t channel_id = 0;
  bool ipc = false;            // mode "ipc" (same GPU): no NCCL communicator
  std::string nccl_unique_id;  // 128 bytes; the daemon is rank 0 (mode "nccl")
  int nccl_version = 0;
  int device = 0;
  uint64_t max_transfer_bytes = 0;
  absl::Duration transfer_timeout;
};

// A put's K and V coming over a channel (the data plane's link block of the whole cache).
struct GpuLinkReceive {
  KvLayout layout;
  uint64_t num_tokens = 0;
  bool layer_major = false;  // the client sends K0, V0, K1, V1, ... (a put stream)
  std::string descriptor;    // mode "ipc": the client's memory (transport::EncodeIpcMemory)
  int engine_device = -1;    // the put's GPU engine's device; -1: the put takes host memory
};

// What came over the channel: every layer's keys, then every layer's values.
struct GpuReceived {
  std::shared_ptr<uint8_t> memory;
  uint64_t bytes = 0;
  MemorySpace space = MemorySpace::kHost;  // kDevice: the channel's device (= engine_device)
  double seconds = 0;                      // the transfer, as the channel's stream timed it
};
using GpuReceivedFn = absl::AnyInvocable<void(absl::StatusOr<GpuReceived>)>;

enum class GpuGetForm { kStored, kDecoded, kDenseKv };

// A get over a channel (the data plane's get naming it): the cache's bytes as stored or decoded
// (whole: the client's buffer may be larger), or the dense K and V, every layer's keys then
// every layer's values, or layer by layer.
struct GpuLinkSend {
  CacheKey key;
  GpuGetForm form = GpuGetForm::kStored;
  uint64_t capacity = 0;     // bytes the client can take; a larger payload is OutOfRange
  bool layer_major = false;  // dense: K0, V0, K1, V1, ...
  std::string descriptor;    // mode "ipc": the client's memory (transport::EncodeIpcMemory)
};

// What a get sent: the payload's size and the cache's layout and tokens (dense gets: of each
// head); over CUDA IPC the copy's seconds, as the channel's stream timed it.
struct GpuGetBegun {
  uint64_t payload_bytes = 0;
  KvLayout layout;
  uint64_t num_tokens = 0;
  double copy_seconds = 0;
};
using GpuSentFn = absl::AnyInvocable<void(absl::StatusOr<GpuGetBegun>)>;

class GpuChannels {
 public:
  // Never fails: when the channel is off, or no CUDA device or NCCL is present, every Open
  // answers why (available() is false). `service` and `metrics` outlive the channels.
  static std::unique_ptr<GpuChannels> Create(const Options& options, CacheService* service,
                                             Metrics* metrics);
  virtual ~GpuChannels() = default;

  // Whether channels can be opened, and if not, why.
  virtual bool available() const = 0;
  virtual std::string unavailable_reason() const = 0;
  virtual size_t open_channels() const = 0;

  // Opens a channel for `tenant`: mode "ipc" when the client's GPU is the daemon's and it gave
  // an interprocess event (`client_ipc_event`, 64 bytes), else "nccl". FailedPrecondition (no
  // channel possible here: no CUDA device, no NCCL for a peer GPU, the client's GPU without
  // IPC, the event not openable), Unavailable (draining), ResourceExhausted (too many).
  virtual absl::StatusOr<GpuChannelInfo> Open(const std::string& tenant, int client_nccl_version,
                                              const std::string& client_device_uuid,
                                              const std::string& client_ipc_event) = 0;
  // NotFound when no channel `id` of `tenant` is open.
  virtual absl::Status Close(const std::string& tenant, uint64_t id) = 0;
  // The device channel `id` of `tenant` is bound to (a put over it is placed there); NotFound +
  // kLinkGone when no such channel is open.
  virtual absl::StatusOr<int> DeviceOf(const std::string& tenant, uint64_t id) = 0;

  // Receives a put's K and V over channel `id` of `tenant` and calls `done` once, on a thread
  // of the channels', when they are here (or with the failure, which is the block's answer):
  // NotFound + kLinkGone (no such channel), InvalidArgument (sizes; a descriptor that does not
  // fit the channel's mode, does not decode or does not match the layout), FailedPrecondition +
  // kMemoryNotMappable (the client's memory cannot be mapped here: the channel stays),
  // Unavailable (draining). A transfer that fails or passes the transfer timeout closes the
  // channel.
  virtual void Receive(const std::string& tenant, uint64_t id, GpuLinkReceive receive,
                       GpuReceivedFn done) = 0;
  // Reads the cache and sends its payload over channel `id` of `tenant`, calling `done` once
  // from any thread: over CUDA IPC once the payload is in the client's memory; over NCCL once
  // the send is posted (the client then posts its receive; the channel's thread collects the
  // send by the transfer timeout, past which the channel fails). NotFound + kLinkGone (no such
  // channel), NotFound (cache), OutOfRange (larger than the capacity), FailedPrecondition (dense
  // form of a cache that evicted tokens; kMemoryNotMappable: the client's memory cannot be
  // mapped here), InvalidArgument (a descriptor that does not fit the channel's mode or the
  // payload), Unavailable (draining), busy (the channels' transfers at their bound).
  virtual void Send(const std::string& tenant, uint64_t id, GpuLinkSend send, GpuSentFn done) = 0;

  // No new channels or transfers; transfers in progress finish.
  virtual void Drain() = 0;
  // Closes every channel (transfers in progress are aborted). Idempotent.
  virtual void Stop() = 0;
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_GPU_CHANNEL_H_
