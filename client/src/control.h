// The SDK's calls to kvcompd's Thrift control plane (service/thrift/kvcomp.thrift). Thrift's
// exceptions stop here and become statuses.
#ifndef KVCOMP_CLIENT_SRC_CONTROL_H_
#define KVCOMP_CLIENT_SRC_CONTROL_H_

#include <string>

#include "absl/status/statusor.h"
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

}  // namespace client
}  // namespace kvcomp

#endif  // KVCOMP_CLIENT_SRC_CONTROL_H_
