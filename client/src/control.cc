#include "control.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "kvcomp/rpc/KvcompControl.h"
#include "kvcomp/transport/ucx.h"
#include "thrift/protocol/TBinaryProtocol.h"
#include "thrift/transport/TBufferTransports.h"
#include "thrift/transport/TSocket.h"

namespace kvcomp {
namespace client {

absl::StatusOr<EndpointStats> ControlStats(const std::string& address,
                                           const ClientOptions& options) {
  auto ep = transport::Endpoint::Parse(address);
  if (!ep.ok()) return ep.status();
  using apache::thrift::protocol::TBinaryProtocol;
  using apache::thrift::transport::TFramedTransport;
  using apache::thrift::transport::TSocket;
  try {
    auto socket = std::make_shared<TSocket>(ep->host, ep->port);
    const int connect_ms = static_cast<int>(absl::ToInt64Milliseconds(options.connect_timeout));
    const int request_ms = static_cast<int>(absl::ToInt64Milliseconds(options.request_timeout));
    socket->setConnTimeout(connect_ms);
    socket->setRecvTimeout(request_ms);
    socket->setSendTimeout(request_ms);
    auto transport = std::make_shared<TFramedTransport>(socket);
    auto protocol = std::make_shared<TBinaryProtocol>(transport);
    rpc::KvcompControlClient control(protocol);
    transport->open();
    rpc::Auth auth;
    auth.__set_tenant(options.tenant);
    auth.__set_token(options.token);
    rpc::StatsResponse r;
    control.Stats(r, auth);
    transport->close();
    if (r.status.code != rpc::StatusCode::OK) {
      return absl::Status(static_cast<absl::StatusCode>(r.status.code), r.status.message);
    }
    EndpointStats s;
    s.caches = static_cast<uint64_t>(r.caches);
    s.original_bytes = static_cast<uint64_t>(r.original_bytes);
    s.stored_bytes = static_cast<uint64_t>(r.stored_bytes);
    s.queue_depth = static_cast<uint64_t>(r.queue_depth);
    return s;
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("control ", address, ": ", e.what()));
  }
}

}  // namespace client
}  // namespace kvcomp
