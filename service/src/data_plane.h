// DataPlane: kvcompd's UCX data plane, and the one part of the service that speaks the
// transport's types (the header-dependency check, scripts/check_service_layers.sh, holds every
// other service file to that). It starts the transport's UcxServer with the daemon's
// data_plane options and answers its requests: a put-begin becomes a validated PutRequest (the
// tenant's default policy when the client sent none) and an OpenPut that the transport keeps
// with its record of the put; a block becomes a BlockData of per-layer views; commits, gets,
// lookups and deletes go to the CacheService and their results back into wire messages.
#ifndef KVCOMP_SERVICE_SRC_DATA_PLANE_H_
#define KVCOMP_SERVICE_SRC_DATA_PLANE_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvcomp/service/metrics.h"
#include "kvcomp/service/options.h"

namespace kvcomp {
namespace service {

struct ServiceContext;

class DataPlane {
 public:
  // Listens on options.data_plane's address and port. `ctx` (its tokens, policies, service and
  // metrics) outlives the data plane.
  static absl::StatusOr<std::unique_ptr<DataPlane>> Start(const Options& options,
                                                          ServiceContext* ctx);
  virtual ~DataPlane() = default;

  virtual uint16_t port() const = 0;
  // New connections and puts are refused; open puts, gets and lookups continue.
  virtual void Drain() = 0;
  // Waits until no put is open and no reply is pending (DeadlineExceeded after `timeout`).
  virtual absl::Status WaitIdle(absl::Duration timeout) = 0;
  // Closes every connection (open puts aborted). Idempotent.
  virtual void Stop() = 0;
  // The errors and busy replies the transport answered itself (op "transport"), into
  // `metrics`, from its running totals.
  virtual void ExportMetrics(Metrics* metrics) const = 0;

  // The data-plane protocol's major version.
  static int ProtocolVersion();
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_DATA_PLANE_H_
