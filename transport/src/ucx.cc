#include "kvcomp/transport/ucx.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "transport/src/ucx_util.h"

namespace kvcomp {
namespace transport {

absl::Status UcsStatusToStatus(int ucs_status, absl::string_view context) {
  const ucs_status_t s = static_cast<ucs_status_t>(ucs_status);
  if (s == UCS_OK) return absl::OkStatus();
  absl::StatusCode code;
  switch (s) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_EXCEEDS_LIMIT:
      code = absl::StatusCode::kResourceExhausted;
      break;
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT:
      code = absl::StatusCode::kDeadlineExceeded;
      break;
    case UCS_ERR_CANCELED:
      code = absl::StatusCode::kCancelled;
      break;
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      code = absl::StatusCode::kInvalidArgument;
      break;
    case UCS_ERR_UNSUPPORTED:
      code = absl::StatusCode::kUnimplemented;
      break;
    case UCS_ERR_MESSAGE_TRUNCATED:
      code = absl::StatusCode::kDataLoss;
      break;
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_BUSY:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_SHMEM_SEGMENT:
      code = absl::StatusCode::kUnavailable;
      break;
    default:
      code = absl::StatusCode::kInternal;
      break;
  }
  return absl::Status(code, absl::StrCat(context, ": UCX: ", ucs_status_string(s)));
}

absl::StatusOr<Endpoint> Endpoint::Parse(absl::string_view text) {
  Endpoint e;
  absl::string_view port;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return absl::InvalidArgumentError(absl::StrCat("endpoint \"", text, "\": want [ipv6]:port"));
    }
    e.host = std::string(text.substr(1, close - 1));
    port = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos || text.find(':') != colon) {
      return absl::InvalidArgumentError(
          absl::StrCat("endpoint \"", text, "\": want host:port or [ipv6]:port"));
    }
    e.host = std::string(text.substr(0, colon));
    port = text.substr(colon + 1);
  }
  uint32_t p = 0;
  if (e.host.empty() || !absl::SimpleAtoi(port, &p) || p == 0 || p > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("endpoint \"", text, "\": bad host or port"));
  }
  e.port = static_cast<uint16_t>(p);
  return e;
}

std::string Endpoint::ToString() const {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

std::string UcxVersion::ToString() const {
  if (!known()) return "unknown";
  return absl::StrFormat("%u.%u.%u", major, minor, release);
}

UcxVersion LocalUcxVersion() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  UcxVersion v;
  v.major = static_cast<uint8_t>(std::min(major, 255u));
  v.minor = static_cast<uint8_t>(std::min(minor, 255u));
  v.release = static_cast<uint8_t>(std::min(release, 255u));
  return v;
}

namespace {
// UCX 1.14 changed what a client puts into the connection request when it uses all devices
// (CM_USE_ALL_DEVICES=y, the default): the transports' resource indices (commit f2c16512,
// "Always pack TL resource indices into CM private data"). Releases on either side of it cannot
// read each other's requests then, and both sides must agree on the setting.
bool Before114(UcxVersion v) { return v.major == 1 && v.minor < 14; }
}  // namespace

std::map<std::string, std::string> UcxInteropSettings(UcxVersion local, UcxVersion peer) {
  std::map<std::string, std::string> s;
  if (!local.known()) return s;
  // A 1.14+ process facing one before 1.14: connections on one device (no resource indices in
  // either direction), and UCX's older protocol selection (the newer one's rendezvous cannot use
  // the older peer's memory keys: "Unsupported operation").
  if (!Before114(local) && peer.known() && Before114(peer)) {
    s["CM_USE_ALL_DEVICES"] = "n";
    s["PROTO_ENABLE"] = "n";
  }
  return s;
}

std::map<std::string, std::string> UcxOneDeviceSettings(UcxVersion local) {
  std::map<std::string, std::string> s;
  // Both ends of a connection must agree on it: a 1.13 process on UCX's default (y) and one
  // with n do not connect (docs/protocol.md, "UCX releases").
  if (local.known() && Before114(local)) s["CM_USE_ALL_DEVICES"] = "n";
  return s;
}

std::map<std::string, std::string> UnlessUserSet(std::map<std::string, std::string> settings,
                                                 const UcxConfig& config) {
  for (auto it = settings.begin(); it != settings.end();) {
    const std::string env = absl::StrCat("UCX_", it->first);
    if (config.overrides.count(it->first) > 0 || std::getenv(env.c_str()) != nullptr) {
      it = settings.erase(it);
    } else {
      ++it;
    }
  }
  return settings;
}

absl::StatusOr<UcxCapabilities> QueryUcxCapabilities(const UcxConfig& config) {
  UcxCapabilities caps;
  unsigned major, minor, release;
  ucp_get_version(&major, &minor, &release);
  caps.version = absl::StrFormat("%u.%u.%u", major, minor, release);
  KVCOMP_ASSIGN_OR_RETURN(UcpContext ctx, UcpContext::Create(config, /*wakeup=*/false));
  ucp_context_attr_t attr = {};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  ucs_status_t s = ucp_context_query(ctx.get(), &attr);
  if (s != UCS_OK) return UcsStatusToStatus(s, "ucp_context_query");
  caps.memory_types = attr.memory_types;
  caps.cuda_memory = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  KVCOMP_ASSIGN_OR_RETURN(UcpWorker worker, UcpWorker::Create(ctx.get(), /*wakeup=*/false));
  ucp_worker_attr_t wattr = {};
  wattr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  s = ucp_worker_query(worker.get(), &wattr);
  if (s != UCS_OK) return UcsStatusToStatus(s, "ucp_worker_query");
  caps.max_am_header = wattr.max_am_header;
  return caps;
}

}  // namespace transport
}  // namespace kvcomp
