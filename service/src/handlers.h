// The control plane of kvcompd (ControlHandler, the Thrift service). It shares the daemon's
// parts with the data plane (service_context.h; the data plane's handler is in data_plane.cc):
// both authenticate against the same TokenStore and scope every key by the authenticated tenant.
#ifndef KVCOMP_SERVICE_SRC_HANDLERS_H_
#define KVCOMP_SERVICE_SRC_HANDLERS_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvcomp/rpc/KvcompControl.h"
#include "kvcomp/rpc/kvcomp_constants.h"
#include "kvcomp/service/auth.h"
#include "kvcomp/service/metrics.h"
#include "kvcomp/service/options.h"
#include "kvcomp/service/policy_store.h"
#include "kvcomp/storage/tiered_store.h"
#include "service_context.h"

namespace kvcomp {
namespace service {

// Bytes of control-plane replies each tenant's calls hold at once, from when a handler gathers
// them until the reply has been serialized for sending. A handler reserves what it is about to
// put into a reply (TryReserve); the reservation is handed to the calling thread (HoldForReply)
// and released when that thread's call has written its reply (ReleaseHeldReplies, called by
// the control plane's processor after each call). Thread-safe.
class ReplyBudget {
 public:
  explicit ReplyBudget(uint64_t tenant_bytes) : tenant_bytes_(tenant_bytes) {}

  // One tenant's bytes, released at destruction.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& o) noexcept { *this = std::move(o); }
    Reservation& operator=(Reservation&& o) noexcept;
    ~Reservation() { Release(); }
    uint64_t bytes() const { return bytes_; }
    // Shrinks or grows the reservation to `bytes`; false (nothing changed) when growing would
    // pass the tenant's bound.
    bool Resize(uint64_t bytes);
    void Release();

   private:
    friend class ReplyBudget;
    ReplyBudget* budget_ = nullptr;
    std::string tenant_;
    uint64_t bytes_ = 0;
  };

  // `bytes` more for `tenant`, or an empty reservation (budget_ unset) when that would pass
  // the tenant's bound.
  bool TryReserve(const std::string& tenant, uint64_t bytes, Reservation* out);
  // What `tenant` holds now.
  uint64_t held(const std::string& tenant) const;
  uint64_t tenant_bytes() const { return tenant_bytes_; }

  // Keeps `r` until this thread's current control call has written its reply.
  static void HoldForReply(Reservation r);
  // Releases what this thread holds for its reply; returns the bytes released.
  static uint64_t ReleaseHeldReplies();

 private:
  bool Add(const std::string& tenant, uint64_t bytes);
  void Sub(const std::string& tenant, uint64_t bytes);
  const uint64_t tenant_bytes_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, uint64_t> held_ ABSL_GUARDED_BY(mu_);
};

class ControlHandler : public rpc::KvcompControlIf {
 public:
  explicit ControlHandler(ServiceContext* ctx)
      : ctx_(ctx), replies_(ctx->options.control_plane.tenant_reply_bytes) {}

  void Health(rpc::HealthResponse& out, const rpc::Auth& auth) override;
  void Stats(rpc::StatsResponse& out, const rpc::Auth& auth) override;
  void Lookup(rpc::LookupResponse& out, const rpc::Auth& auth, const rpc::CacheRef& ref) override;
  void Delete(rpc::DeleteResponse& out, const rpc::Auth& auth, const rpc::CacheRef& ref) override;
  void List(rpc::ListResponse& out, const rpc::Auth& auth, const std::string& model_id,
            const std::string& cursor, int32_t limit) override;
  void GetPolicy(rpc::PolicyResponse& out, const rpc::Auth& auth,
                 const std::string& model_id) override;
  void SetPolicy(rpc::PolicyResponse& out, const rpc::Auth& auth, const std::string& model_id,
                 const rpc::Policy& policy) override;
  void Calibrate(rpc::CalibrateResponse& out, const rpc::Auth& auth,
                 const rpc::CalibrateRequest& request) override;
  void ServerInfo(rpc::ServerInfoResponse& out, const rpc::Auth& auth) override;
  void ListQuarantined(rpc::ListQuarantinedResponse& out, const rpc::Auth& auth,
                       const std::string& cursor, int32_t limit) override;
  void PurgeQuarantined(rpc::PurgeQuarantinedResponse& out, const rpc::Auth& auth,
                        const rpc::CacheRef& ref, bool all) override;
  void LookupPrefix(rpc::LookupPrefixResponse& out, const rpc::Auth& auth,
                    const std::string& model_id, const std::vector<std::string>& keys) override;
  void GetChunks(rpc::GetChunksResponse& out, const rpc::Auth& auth, const std::string& model_id,
                 const std::vector<std::string>& keys, bool decoded, int64_t max_bytes) override;
  // GPU channel calls (gpu_handlers.cc).
  void OpenGpuChannel(rpc::GpuChannelResponse& out, const rpc::Auth& auth,
                      const rpc::GpuChannelRequest& request) override;
  void CloseGpuChannel(rpc::GpuCloseResponse& out, const rpc::Auth& auth,
                       int64_t channel_id) override;

 private:
  // The quarantined entries `tenant` may see: those whose key decodes to one of its caches, and
  // in open mode also those whose key does not decode.
  std::vector<storage::QuarantinedCache> QuarantinedOf(const std::string& tenant) const;
  // The caller's tenant, or the status to answer with (counted as an auth failure).
  absl::StatusOr<std::string> Authenticate(const rpc::Auth& auth);
  ServiceContext* const ctx_;
  ReplyBudget replies_;
};

// Conversions between the IDL's types and kvcomp's (exposed for tests of the mapping).
rpc::Status ToRpc(const absl::Status& status);
rpc::Policy ToRpc(const CompressionPolicy& policy);
absl::StatusOr<CompressionPolicy> FromRpc(const rpc::Policy& policy);

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_HANDLERS_H_
