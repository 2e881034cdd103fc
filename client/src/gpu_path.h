// The SDK's device-memory calls (Client::PutDevice, GetKvIntoDevice, GetIntoDevice and the
// layer-by-layer streams): over the GPU channel, negotiated on the control plane, when the
// endpoint offers one (NCCL between two GPUs; CUDA IPC when the daemon is on the caller's GPU;
// a put is a data-plane put whose one block's K and V go over the channel, a get a data-plane
// get whose reply names the channel's transfer), else over the
// data plane, asked once: its payload links move the device memory in place
// (ucx-cuda) or stage it through host memory (ucx). Channels are kept per (endpoint, device) for
// the client's life; a channel whose transfer fails is aborted and dropped, and an endpoint that
// refused one is not asked again for a while (it is asked again after `down_for` x 15).
//
// Thread-safety: every method is thread-safe; transfers on one channel take turns.
#ifndef KVCOMP_CLIENT_SRC_GPU_PATH_H_
#define KVCOMP_CLIENT_SRC_GPU_PATH_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "control.h"
#include "kvcomp/client/client.h"
#include "kvcomp/transport/client.h"
#include "kvcomp/transport/gpu_link.h"
#include "kvcomp/transport/protocol.h"

namespace kvcomp {
namespace client {

// What a get over the channel asks for: the cache as stored, decoded, or its dense K and V.
enum class GpuGetForm { kStored, kDecoded, kDenseKv };

class GpuPath {
 public:
  // The key's endpoints in ranking order (data and control addresses).
  using RankingFn = std::function<absl::StatusOr<std::vector<EndpointAddress>>(
      absl::string_view model_id, absl::string_view key)>;
  // A put out of device memory over the data plane (ucx-cuda or ucx, the links' choice).
  using DataPutFn = std::function<absl::StatusOr<PutResult>(
      absl::string_view model_id, absl::string_view key, const KvLayout& layout,
      uint64_t num_tokens, const std::vector<DeviceLayerData>& layers, void* stream,
      const PutOptions& options)>;
  // The cache's bytes, as stored or decoded, into device memory over the data plane.
  using DataGetFn = std::function<absl::StatusOr<DeviceGetResult>(
      absl::string_view model_id, absl::string_view key, bool decoded, void* dst, size_t capacity,
      void* stream)>;
  // The data-plane connection to an endpoint (a channel's puts go over it).
  using ConnectFn = std::function<absl::StatusOr<std::shared_ptr<transport::UcxClient>>(
      const EndpointAddress& endpoint)>;
  // `self` (the client that owns this: lookups), `put` and `get` carry what no GPU channel
  // does.
  GpuPath(const ClientOptions& options, Client* self, RankingFn ranking, DataPutFn put,
          DataGetFn get, ConnectFn connect);
  ~GpuPath();

  absl::StatusOr<PutResult> Put(absl::string_view model_id, absl::string_view key,
                                const KvLayout& layout, uint64_t num_tokens,
                                const std::vector<DeviceLayerData>& layers, void* stream,
                                const PutOptions& options);
  absl::StatusOr<DeviceGetResult> GetKv(absl::string_view model_id, absl::string_view key,
                                        const KvLayout& layout, uint64_t num_tokens,
                                        const std::vector<DeviceLayerOut>& layers, void* stream);
  absl::StatusOr<DeviceGetResult> GetBytes(absl::string_view model_id, absl::string_view key,
                                           void* dst, size_t capacity, void* stream,
                                           bool decoded);
  absl::Status Probe(const EndpointAddress& endpoint, int device);
  GpuChannelStats Stats() const;
  absl::StatusOr<std::unique_ptr<DevicePutStream>> OpenPutStream(absl::string_view model_id,
                                                                 absl::string_view key,
                                                                 const KvLayout& layout,
                                                                 uint64_t num_tokens, int device,
                                                                 const PutOptions& options);
  absl::StatusOr<std::unique_ptr<DeviceGetStream>> OpenGetStream(
      absl::string_view model_id, absl::string_view key, const KvLayout& layout,
      uint64_t num_tokens, const std::vector<DeviceLayerOut>& layers, void* stream);

  struct Channel;
  class Turn;
  // For the layer-by-layer streams.
  void DropChannel(const std::shared_ptr<Channel>& channel, const absl::Status& why);
  void CountNcclPut();
  void CountNcclGet();

 private:
  // The channel to `endpoint` for `device`: cached, or opened now. An error says why none can be
  // had; `hard` is set when the error must reach the caller (refused credentials) instead of
  // falling back.
  absl::StatusOr<std::shared_ptr<Channel>> ChannelFor(const EndpointAddress& endpoint, int device,
                                                      bool* hard);
  void Drop(const std::shared_ptr<Channel>& channel, const absl::Status& why);
  void NoteFallback(const std::string& endpoint, const absl::Status& why, bool put);
  // The device chunks a granted get is received into; an error refuses the grant.
  using ChunksFn = absl::StatusOr<std::vector<transport::NcclLink::Chunk>>(
      const transport::wire::GetReply& grant);
  // A get over the GPU channel to the first endpoint of `ranking` (two tries), a data-plane get
  // naming the channel: asks for `form` up to `capacity` bytes and receives it into the chunks
  // `place` gives for the answer (an error
  // from `place` aborts the transfer and is returned); in mode "ipc" the daemon writes `offer`
  // (the caller's memory, in transfer order) and `place` checks the grant afterwards. nullopt:
  // the fallback is noted and the get goes through host memory.
  absl::StatusOr<std::optional<DeviceGetResult>> ChannelGet(
      const std::vector<EndpointAddress>& ranking, transport::GpuRuntime* rt, int device,
      absl::string_view model_id, absl::string_view key, GpuGetForm form, uint64_t capacity,
      void* stream, const std::vector<transport::NcclLink::Chunk>& offer,
      absl::FunctionRef<ChunksFn> place);
  // A dense get over the data plane: the decoded cache (raw codecs; every token, or the call
  // fails) is read into device memory of this call's, and its keys and values sections (the
  // dense K and V, layer after layer) are copied into the caller's layers on `stream`.
  absl::StatusOr<DeviceGetResult> DenseOverDataPlane(
      transport::GpuRuntime* rt, int device, absl::string_view model_id, absl::string_view key,
      const KvLayout& layout, uint64_t num_tokens, const std::vector<DeviceLayerOut>& layers,
      void* stream);
  // A turn of the GPU channel to ranking[0] for `device`, and the daemon's answer to `begin`
  // (the transfer's request, made on that turn: nullopt when it is not for this channel). Tried
  // twice: a channel that is gone (broken, or AfterLinkFailure kReopen) is dropped and another
  // opened. nullopt, with `why`, when the channel does not carry the transfer and the next link
  // moves it: none can be had, `begin` declined, the memory cannot be shared (kNextLink), or the
  // cache is not on that endpoint (NotFound: the data plane walks the ranking). An error: the
  // daemon answered the request itself (busy, refused, invalid) or refused the credentials.
  template <typename T>
  absl::StatusOr<std::optional<std::pair<std::unique_ptr<Turn>, T>>> BeginOn(
      const std::vector<EndpointAddress>& ranking, int device,
      absl::FunctionRef<absl::StatusOr<std::optional<T>>(Channel&)> begin, absl::Status* why);
  // A put of `chunks` (transfer order) over the first endpoint's channel; nullopt when no
  // channel carried it (`why` says why: the caller falls back).
  absl::StatusOr<std::optional<PutResult>> ChannelPut(
      const std::vector<EndpointAddress>& ranking, transport::GpuRuntime* rt, int device,
      const transport::wire::PutBegin& begin,
      const std::vector<transport::NcclLink::Chunk>& chunks, void* stream, absl::Status* why);

  const ClientOptions options_;
  Client* const self_;
  const RankingFn ranking_;
  const DataPutFn put_;
  const DataGetFn get_;
  const ConnectFn connect_;

  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, int>, std::shared_ptr<Channel>> channels_ ABSL_GUARDED_BY(mu_);
  struct Refusal {
    absl::Status why;
    absl::Time until;
  };
  std::map<std::pair<std::string, int>, Refusal> refused_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> logged_ ABSL_GUARDED_BY(mu_);  // endpoint -> last reason
  GpuChannelStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace client
}  // namespace kvcomp

#endif  // KVCOMP_CLIENT_SRC_GPU_PATH_H_
