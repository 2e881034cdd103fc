#include "control.h"

#include <algorithm>
#include <climits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/status.h"
#include "kvcomp/rpc/KvcompControl.h"
#include "kvcomp/transport/ucx.h"
#include "peer_probe.h"
#include "policy_rpc.h"
#include "thrift/TConfiguration.h"
#include "thrift/protocol/TBinaryProtocol.h"
#include "thrift/transport/TBufferTransports.h"
#include "thrift/transport/TSocket.h"
#include "thrift/transport/TTransportException.h"

namespace kvcomp {
namespace client {

namespace {

using apache::thrift::protocol::TBinaryProtocol;
using apache::thrift::transport::TFramedTransport;
using apache::thrift::transport::TSocket;
using apache::thrift::transport::TTransportException;

// A socket that keeps the first bytes the peer sent, so that a failed call can say what
// answered (another service's banner or error, not a Thrift reply).
class RecordingSocket : public TSocket {
 public:
  using TSocket::TSocket;
  uint32_t read_virt(uint8_t* buf, uint32_t len) override {
    const uint32_t n = TSocket::read(buf, len);
    Record(buf, n);
    return n;
  }
  uint32_t readAll_virt(uint8_t* buf, uint32_t len) override {
    uint32_t got = 0;
    while (got < len) {
      const uint32_t n = TSocket::read(buf + got, len - got);
      if (n == 0) {
        throw TTransportException(TTransportException::END_OF_FILE, "No more data to read.");
      }
      Record(buf + got, n);
      got += n;
    }
    return got;
  }
  const std::string& first_bytes() const { return first_; }

 private:
  void Record(const uint8_t* buf, uint32_t n) {
    const size_t room = first_.size() < 64 ? 64 - first_.size() : 0;
    first_.append(reinterpret_cast<const char*>(buf), std::min<size_t>(room, n));
  }
  std::string first_;
};

// The error of a control call that failed in transport: what answered when it was not a
// kvcompd control port (FailedPrecondition, never retried as an outage), DeadlineExceeded when
// nothing answered in time, Unavailable otherwise.
absl::Status ControlFailure(const std::string& address, const transport::Endpoint& ep,
                            const RecordingSocket& socket, bool opened, const std::exception& e,
                            int wait_ms) {
  const auto* te = dynamic_cast<const TTransportException*>(&e);
  const std::string& got = socket.first_bytes();
  if (!got.empty() && !LooksLikeThriftReply(got)) {
    // Another protocol answered; ask it again on a fresh connection to read a whole line.
    const PeerAnswer peer = ProbePeer(ep.host, ep.port, absl::Milliseconds(500));
    const std::string what = peer.kind == PeerAnswer::kHttp || peer.kind == PeerAnswer::kOther
                                 ? peer.description
                                 : absl::StrCat("a service that sent "", QuoteBytes(got), """);
    return absl::FailedPreconditionError(absl::StrCat(
        "control ", address, ": not a kvcompd control port: ", what, " answered"));
  }
  if (got.empty() && te != nullptr && te->getType() == TTransportException::TIMED_OUT) {
    return absl::DeadlineExceededError(
        absl::StrCat("control ", address, ": no answer within ", wait_ms, " ms", 
                     opened ? " (connected; the daemon did not reply)" : " (connecting)"));
  }
  if (got.empty() && opened && te != nullptr &&
      te->getType() == TTransportException::END_OF_FILE) {
    // Closed without a byte: a kvcompd restarting does this too, so look before saying "wrong".
    const PeerAnswer peer = ProbePeer(ep.host, ep.port, absl::Milliseconds(500));
    if (peer.kind == PeerAnswer::kHttp || peer.kind == PeerAnswer::kOther) {
      return absl::FailedPreconditionError(absl::StrCat(
          "control ", address, ": not a kvcompd control port: ", peer.description, " answered"));
    }
    if (peer.kind == PeerAnswer::kClosed || peer.kind == PeerAnswer::kSilent) {
      return absl::FailedPreconditionError(
          absl::StrCat("control ", address, ": not a kvcompd control port: ", peer.description,
                       " (a kvcompd data port does this; the control port is the one after "
                       "the comma in \"data,control\")"));
    }
  }
  if (!opened && te != nullptr && te->getType() == TTransportException::NOT_OPEN) {
    const PeerAnswer peer = ProbePeer(ep.host, ep.port, absl::Milliseconds(200));
    if (peer.kind == PeerAnswer::kRefused) {
      return absl::UnavailableError(
          absl::StrCat("control ", address, ": nothing listens there (connection refused)"));
    }
  }
  return absl::UnavailableError(absl::StrCat("control ", address, ": ", e.what()));
}

// One control call: connects with the client's timeouts (cut to what is left before
// `deadline`), runs `call(control, auth)` and turns transport exceptions into statuses
// (ControlFailure). `call` returns the response's status.
// `max_reply_bytes` > 0 raises Thrift's client-side frame and message bounds (16 MB and 100 MB
// by default) for replies that carry caches.
template <typename Call>
absl::Status WithControl(const std::string& address, const ClientOptions& options, Call call,
                         int max_reply_bytes = 0, absl::Time deadline = absl::InfiniteFuture()) {
  auto ep = transport::Endpoint::Parse(address);
  if (!ep.ok()) return ep.status();
  int64_t connect_ms = absl::ToInt64Milliseconds(options.connect_timeout);
  int64_t request_ms = absl::ToInt64Milliseconds(options.request_timeout);
  if (deadline != absl::InfiniteFuture()) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) {
      return WithDetail(absl::DeadlineExceededError(absl::StrCat(
                            "control ", address, ": the call's deadline passed before asking")),
                        ErrorDetail::kCallDeadline);
    }
    connect_ms = std::min(connect_ms, left);
    request_ms = std::min(request_ms, left);
  }
  // Thrift reads 0 as "wait forever".
  connect_ms = std::max<int64_t>(1, std::min<int64_t>(connect_ms, INT_MAX));
  request_ms = std::max<int64_t>(1, std::min<int64_t>(request_ms, INT_MAX));
  std::shared_ptr<apache::thrift::TConfiguration> config;
  if (max_reply_bytes > 0) {
    config = std::make_shared<apache::thrift::TConfiguration>(max_reply_bytes, max_reply_bytes);
  }
  std::shared_ptr<RecordingSocket> socket;
  bool opened = false;
  try {
    socket = std::make_shared<RecordingSocket>(ep->host, ep->port, config);
    socket->setConnTimeout(static_cast<int>(connect_ms));
    socket->setRecvTimeout(static_cast<int>(request_ms));
    socket->setSendTimeout(static_cast<int>(request_ms));
    auto transport = std::make_shared<TFramedTransport>(socket, config);
    auto protocol = std::make_shared<TBinaryProtocol>(transport);
    rpc::KvcompControlClient control(protocol);
    transport->open();
    opened = true;
    rpc::Auth auth;
    auth.__set_tenant(options.tenant);
    auth.__set_token(options.token);
    const rpc::Status st = call(control, auth);
    transport->close();
    return service::StatusFromRpc(st);
  } catch (const std::exception& e) {
    if (socket == nullptr) {
      return absl::UnavailableError(absl::StrCat("control ", address, ": ", e.what()));
    }
    return ControlFailure(address, *ep, *socket, opened, e,
                          static_cast<int>(opened ? request_ms : connect_ms));
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
  req.__set_key_bits(static_cast<int32_t>(calibrate.key_bits));
  req.__set_value_bits(static_cast<int32_t>(calibrate.value_bits));
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
                                           const std::vector<std::string>& keys,
                                           absl::Time deadline) {
  rpc::LookupPrefixResponse r;
  KVCOMP_RETURN_IF_ERROR(WithControl(
      address, options,
      [&](auto& control, const auto& auth) {
        control.LookupPrefix(r, auth, std::string(model_id), keys);
        return r.status;
      },
      0, deadline));
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
                                            absl::Time deadline, int64_t max_bytes) {
  rpc::GetChunksResponse r;
  KVCOMP_RETURN_IF_ERROR(WithControl(
      address, options,
      [&](auto& control, const auto& auth) {
        control.GetChunks(r, auth, std::string(model_id), keys, decoded, max_bytes);
        return r.status;
      },
      kMaxChunkReplyFrame, deadline));
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

absl::StatusOr<GpuChannelGrant> ControlOpenGpuChannel(const std::string& address,
                                                      const ClientOptions& options,
                                                      int nccl_version,
                                                      const std::string& device_uuid,
                                                      const std::string& ipc_event) {
  rpc::GpuChannelRequest req;
  req.__set_nccl_version(nccl_version);
  req.__set_device_uuid(device_uuid);
  if (!ipc_event.empty()) req.__set_ipc_event(ipc_event);
  req.__set_data_plane_puts(true);
  req.__set_data_plane_gets(true);
  rpc::GpuChannelResponse r;
  KVCOMP_RETURN_IF_ERROR(WithControl(address, options, [&](auto& control, const auto& auth) {
    control.OpenGpuChannel(r, auth, req);
    return r.status;
  }));
  const bool ipc = r.__isset.mode && r.mode == "ipc";
  if (r.channel_id <= 0 || (!ipc && r.nccl_unique_id.size() != 128)) {
    return absl::InternalError(absl::StrCat("control ", address,
                                            ": OpenGpuChannel answered no usable channel"));
  }
  GpuChannelGrant g;
  g.channel_id = static_cast<uint64_t>(r.channel_id);
  g.nccl_unique_id = r.nccl_unique_id;
  g.nccl_version = r.nccl_version;
  g.daemon_device = r.daemon_device;
  g.max_transfer_bytes = static_cast<uint64_t>(std::max<int64_t>(0, r.max_transfer_bytes));
  g.transfer_timeout = absl::Milliseconds(std::max(1, r.transfer_timeout_ms));
  g.ipc = ipc;
  g.data_plane = r.__isset.data_plane_gets && r.data_plane_gets;
  return g;
}

absl::Status ControlCloseGpuChannel(const std::string& address, const ClientOptions& options,
                                    uint64_t channel_id) {
  rpc::GpuCloseResponse r;
  return WithControl(address, options, [&](auto& control, const auto& auth) {
    control.CloseGpuChannel(r, auth, static_cast<int64_t>(channel_id));
    return r.status;
  });
}

}  // namespace client
}  // namespace kvcomp
