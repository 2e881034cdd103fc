#include "endpoint_state.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvcomp/core/status.h"
#include "peer_probe.h"

namespace kvcomp {
namespace client {

absl::StatusOr<std::shared_ptr<transport::UcxClient>> EndpointState::Connection(
    const ClientOptions& o) {
  absl::MutexLock lock(&mu_);
  if (conn_ != nullptr && conn_->connected()) return conn_;
  conn_.reset();
  const absl::Time now = absl::Now();
  if (now < down_until_) {
    return absl::UnavailableError(
        absl::StrCat("endpoint ", address_.data, " is down (", last_error_.message(), ")"));
  }
  transport::ClientOptions to;
  to.connect_timeout = o.connect_timeout;
  to.request_timeout = o.request_timeout;
  to.shared_memory = o.shared_memory;
  to.shm_direct = o.shm_direct;
  to.shm_copy_lanes = o.shm_copy_lanes;
  for (const auto& [k, v] : o.ucx_overrides) to.ucx.overrides[k] = v;
  auto c = transport::UcxClient::Connect(data_, o.tenant, o.token, to);
  if (!c.ok()) {
    absl::Status st = c.status();
    if (Retryable(st)) {
      // Say what is at the address: nothing, or a service that is not a kvcompd data port
      // (then the error is final, not an outage to wait out).
      const PeerAnswer peer = ProbePeer(data_.host, data_.port,
                                        std::min(o.connect_timeout, absl::Milliseconds(500)));
      if (peer.kind == PeerAnswer::kThrift || peer.kind == PeerAnswer::kHttp ||
          peer.kind == PeerAnswer::kOther) {
        st = absl::FailedPreconditionError(absl::StrCat(
            "data ", address_.data, ": not a kvcompd data port: ", peer.description,
            " answered", peer.kind == PeerAnswer::kThrift
                             ? " (a kvcompd control port? give \"data,control\", data first)"
                             : ""));
      } else if (peer.kind == PeerAnswer::kRefused) {
        st = absl::UnavailableError(absl::StrCat(
            "data ", address_.data, ": nothing listens there (connection refused)"));
      }
    }
    // Refused credentials and wrong ports are final, not an outage.
    if (Retryable(st)) {
      down_until_ = now + o.down_for;
      last_error_ = st;
    }
    if (!absl::StrContains(st.message(), address_.data)) {
      st = Annotate(st, absl::StrCat("connect ", address_.data));
    }
    return st;
  }
  conn_ = std::shared_ptr<transport::UcxClient>(std::move(*c));
  return conn_;
}

void EndpointState::MarkDown(const ClientOptions& o, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  conn_.reset();
  down_until_ = absl::Now() + o.down_for;
  last_error_ = why;
}

}  // namespace client
}  // namespace kvcomp
