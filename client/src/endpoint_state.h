// One kvcompd as the SDK sees it: its addresses, a lazily made UCX connection, and when it may
// be tried again after a failure. Shared by the pool's member sets and by puts in flight, so a
// member that leaves the pool stays usable until the last request holding it is done.
#ifndef KVCOMP_CLIENT_SRC_ENDPOINT_STATE_H_
#define KVCOMP_CLIENT_SRC_ENDPOINT_STATE_H_

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvcomp/client/client.h"
#include "kvcomp/transport/client.h"

namespace kvcomp {
namespace client {

// Failures worth trying another endpoint (or the same one later) for.
inline bool Retryable(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
}

// Thread-safe.
class EndpointState {
 public:
  EndpointState(EndpointAddress address, transport::Endpoint data)
      : address_(std::move(address)), data_(std::move(data)) {}

  const EndpointAddress& address() const { return address_; }

  // The live connection, connecting when there is none. Unavailable while marked down.
  absl::StatusOr<std::shared_ptr<transport::UcxClient>> Connection(const ClientOptions& o);

  // Forgets the connection after it failed, and skips the endpoint for a while.
  void MarkDown(const ClientOptions& o, const absl::Status& why);

 private:
  const EndpointAddress address_;
  const transport::Endpoint data_;
  absl::Mutex mu_;
  std::shared_ptr<transport::UcxClient> conn_ ABSL_GUARDED_BY(mu_);
  absl::Time down_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Status last_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace client
}  // namespace kvcomp

#endif  // KVCOMP_CLIENT_SRC_ENDPOINT_STATE_H_
