#include "control.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/status.h"
#include "kvcomp/rpc/KvcompControl.h"
#include "kvcomp/transport/ucx.h"
#include "thrift/TConfiguration.h"
#include "thrift/protocol/TBinaryProtocol.h"
#include "thrift/transport/TBufferTransports.h"
#include "thrift/transport/TSocket.h"

namespace kvcomp {
namespace client {

namespace {

using apache::thrift::protocol::TBinaryProtocol;
using apache::thrift::transport::TFramedTransport;
using apache::thrift::transport::TSocket;

// One control call: connects with the client's timeouts, runs `call(control, auth)` and turns
// transport exceptions into Unavailable. `call` returns the response's status.
// `max_reply_bytes` > 0 raises Thrift's client-side frame and message bounds (16 MB and 100 MB
// by default) for replies that carry caches.
template <typename Call>
absl::Status WithControl(const std::string& address, const ClientOptions& options, Call call,
                         int max_reply_bytes = 0) {
  auto ep = transport::Endpoint::Parse(address);
  if (!ep.ok()) return ep.status();
  try {
    std::shared_ptr<apache::thrift::TConfiguration> config;
    if (max_reply_bytes > 0) {
      config = std::make_shared<apache::thrift::TConfiguration>(max_reply_bytes, max_reply_bytes);
    }
    auto socket = std::make_shared<TSocket>(ep->host, ep->port, config);
    const int connect_ms = static_cast<int>(absl::ToInt64Milliseconds(options.connect_timeout));
    const int request_ms = static_cast<int>(absl::ToInt64Milliseconds(options.request_timeout));
    socket->setConnTimeout(connect_ms);
    socket->setRecvTimeout(request_ms);
    socket->setSendTimeout(request_ms);
    auto transport = std::make_shared<TFramedTransport>(socket, config);
    auto protocol = std::make_shared<TBinaryProtocol>(transport);
    rpc::KvcompControlClient control(protocol);
    transport->open();
    rpc::Auth auth;
    auth.__set_tenant(options.tenant);
    auth.__set_token(options.token);
    const rpc::Status st = call(control, auth);
    transport->close();
    if (st.code != rpc::StatusCode::OK) {
      return absl::Status(static_cast<absl::StatusCode>(st.code), st.message);
    }
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("control ", address, ": ", e.what()));
  }
}

}  // namespace

absl::StatusOr<EndpointStats> ControlStats(const std::string& address,
                                           const ClientOptions& options) {
  rpc::StatsResponse r;
  KVCOMP_RETURN_IF_ERROR(WithControl(address, options, [&](auto& control, const auto& auth) {
    control.Stats(r, auth);
    return r.status;
  }));
  EndpointStats s;
  s.caches = static_cast<uint64_t>(r.caches);
  s.original_bytes = static_cast<uint64_t>(r.original_bytes);
  s.stored_bytes = static_cast<uint64_t>(r.stored_bytes);
  s.queue_depth = static_cast<uint64_t>(r.queue_depth);
  return s;
}

absl::StatusOr<CalibrateResult> ControlCalibrate(const std::string& address,
                                                 const ClientOptions& options,
                                                 absl::string_view model_id,
                                                 const CalibrateOptions& calibrate) {
  rpc::CalibrateRequest req;
  req.__set_model_id(std::string(model_id));
  req.__set_value_codec(calibrate.value_codec);
  req.__set_rank(calibrate.rank);
  req.__set_error_budget(calibrate.error_budget);
  req.__set_max_caches(calibrate.max_caches);
  rpc::CalibrateResponse r;
  KVCOMP_RETURN_IF_ERROR(WithControl(address, options, [&](auto& control, const auto& auth) {
    control.Calibrate(r, auth, req);
    return r.status;
  }));
  CalibrateResult out;
  out.projection_version = static_cast<uint64_t>(r.projection_version);
  out.rank = static_cast<uint32_t>(r.rank);
  out.layer_ranks.assign(r.layer_ranks.begin(), r.layer_ranks.end());
  out.achieved_error = r.achieved_error;
  out.caches_used = static_cast<uint64_t>(r.caches_used);
  return out;
}

absl::StatusOr<size_t> ControlLookupPrefix(const std::string& address,
                                           const ClientOptions& options,
                                           absl::string_view model_id,
                                           const std::vector<std::string>& keys) {
  rpc::LookupPrefixResponse r;
  KVCOMP_RETURN_IF_ERROR(WithControl(address, options, [&](auto& control, const auto& auth) {
    control.LookupPrefix(r, auth, std::string(model_id), keys);
    return r.status;
  }));
  if (r.held < 0 || static_cast<size_t>(r.held) > keys.size()) {
    return absl::InternalError(absl::StrCat("control ", address, ": LookupPrefix answered ",
                                            r.held, " held of ", keys.size()));
  }
  return static_cast<size_t>(r.held);
}

absl::StatusOr<ChunkReply> ControlGetChunks(const std::string& address,
                                            const ClientOptions& options,
                                            absl::string_view model_id,
                                            const std::vector<std::string>& keys, bool decoded,
                                            int64_t max_bytes) {
  rpc::GetChunksResponse r;
  KVCOMP_RETURN_IF_ERROR(WithControl(
      address, options,
      [&](auto& control, const auto& auth) {
        control.GetChunks(r, auth, std::string(model_id), keys, decoded, max_bytes);
        return r.status;
      },
      kMaxChunkReplyFrame));
  if (r.caches.size() > keys.size()) {
    return absl::InternalError(absl::StrCat("control ", address, ": GetChunks answered ",
                                            r.caches.size(), " caches for ", keys.size(),
                                            " keys"));
  }
  ChunkReply out;
  out.caches = std::move(r.caches);
  out.truncated = r.truncated;
  return out;
}

}  // namespace client
}  // namespace kvcomp
