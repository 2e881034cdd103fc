// Device puts and gets over the UCX data plane with a CUDA-aware UCX: K and V go out of the
// caller's GPU memory and gets land in it, with no host copy on the client, where both sides
// negotiated device payloads (transport::UcxClient::DevicePayloads: this process's UCX has
// cuda_copy / cuda_ipc and the daemon's hello-ok offered kServerCudaMemory). Where either side
// lacks them these return nullopt with the reason, and the caller stages through host memory.
//
// Used by the SDK's device calls when no GPU channel serves them (gpu_path.cc's fallbacks).
#ifndef KVCOMP_CLIENT_SRC_DEVICE_UCX_H_
#define KVCOMP_CLIENT_SRC_DEVICE_UCX_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcomp/client/client.h"
#include "kvcomp/transport/client.h"

namespace kvcomp {
namespace client {

// Whether this process's UCX can send from and receive into CUDA memory (asked once).
bool LocalUcxCudaMemory();

// The data-plane connections of the key's ranking on `self` (a client made by Client::Create),
// in ranking order, at most `want`, skipping endpoints that cannot be reached. Unavailable when
// none can; refused credentials are returned as they are.
absl::StatusOr<std::vector<std::shared_ptr<transport::UcxClient>>> RankedConnections(
    Client& self, absl::string_view model_id, absl::string_view key, int want);

// A put of device-resident layers over UCX, each layer's keys and values a block of their own
// sent from device memory, to the first `replicas` endpoints of the ranking. The caller's
// `stream` is waited for first (an event on it, never the device). nullopt and `*why` when an
// endpoint did not negotiate device payloads or a layer exceeds its block limit (nothing was
// sent then); an error when the put failed.
absl::StatusOr<std::optional<PutResult>> PutDeviceOverUcx(
    Client& self, absl::string_view model_id, absl::string_view key, const KvLayout& layout,
    uint64_t num_tokens, const std::vector<DeviceLayerData>& layers, void* stream,
    const PutOptions& options, int replicas, std::string* why);

// The cache's bytes (stored, or decoded when `decoded`) received over UCX straight into device
// memory `dst` of `capacity` bytes, after `stream`'s work so far. nullopt and `*why` when this
// process's UCX is not CUDA-aware.
absl::StatusOr<std::optional<DeviceGetResult>> GetIntoDeviceOverUcx(
    Client& self, absl::string_view model_id, absl::string_view key, void* dst, size_t capacity,
    void* stream, bool decoded, std::string* why);

}  // namespace client
}  // namespace kvcomp

#endif  // KVCOMP_CLIENT_SRC_DEVICE_UCX_H_
