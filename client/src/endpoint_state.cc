#include "endpoint_state.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvcomp/core/status.h"

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
  for (const auto& [k, v] : o.ucx_overrides) to.ucx.overrides[k] = v;
  auto c = transport::UcxClient::Connect(data_, o.tenant, o.token, to);
  if (!c.ok()) {
    // Refused credentials are final, not an outage.
    if (Retryable(c.status())) {
      down_until_ = now + o.down_for;
      last_error_ = c.status();
    }
    return Annotate(c.status(), absl::StrCat("connect ", address_.data));
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
