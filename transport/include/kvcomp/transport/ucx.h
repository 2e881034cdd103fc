// Shared UCX settings of the server and the client: which UCX configuration to use, what the
// installed UCX can do, and how its errors become statuses.
#ifndef KVCOMP_TRANSPORT_UCX_H_
#define KVCOMP_TRANSPORT_UCX_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcomp {
namespace transport {

// UCX configuration for one context. UCX otherwise reads UCX_* environment variables (UCX_TLS,
// UCX_NET_DEVICES, ...); entries here override them for this context only, without the prefix:
// {"TLS", "tcp"}. Connection establishment uses sockaddr (ucp_listener), which needs the tcp
// sockaddr component: UCX_TLS must include tcp (for example "tcp", "posix,tcp", "sm,tcp") or be
// unset; with "posix,tcp" the control wire-up runs over TCP and the data over shared memory.
struct UcxConfig {
  std::map<std::string, std::string> overrides;  // default: none (environment only)
  // UCP_ERR_HANDLING_MODE_PEER on every endpoint: a peer that dies is noticed at once (its
  // puts aborted, its requests failed). UCX 1.13 then leaves out the transports that cannot
  // report peer failures, among them cma (shared-memory zero-copy): rendezvous between two
  // processes on one host goes over tcp. False lets UCX use cma (much faster on one host);
  // a dead peer is then found only by the timeouts (put_timeout, idle_timeout, request
  // timeouts). Both sides should agree. Default true.
  bool peer_error_handling = true;
};

// A UCX release, as ucp_get_version reports it; all zero: unknown (a peer that did not say).
struct UcxVersion {
  uint8_t major = 0;
  uint8_t minor = 0;
  uint8_t release = 0;
  bool known() const { return major != 0 || minor != 0; }
  std::string ToString() const;  // "1.13.1", "unknown"
  friend bool operator==(const UcxVersion& a, const UcxVersion& b) {
    return a.major == b.major && a.minor == b.minor && a.release == b.release;
  }
};
// The UCX library this process loaded.
UcxVersion LocalUcxVersion();

// Settings (names without the UCX_ prefix, as UcxConfig::overrides) that a UCX context on
// release `local` needs to work with a peer on release `peer` (unknown: a client's first try):
// on 1.14 or later facing a peer before 1.14, CM_USE_ALL_DEVICES=n and PROTO_ENABLE=n; nothing
// otherwise (a release before 1.14 keeps UCX's defaults: UcxOneDeviceSettings is what its
// kvcompd may choose instead, and its clients then fall back to). Why: docs/protocol.md, "UCX
// releases".
std::map<std::string, std::string> UcxInteropSettings(UcxVersion local, UcxVersion peer);
// On a release before 1.14, CM_USE_ALL_DEVICES=n (connections on the device they are made on
// only), the setting under which clients on 1.14 or later can connect to it; nothing on 1.14 or
// later. kvcompd applies it with data_plane.ucx_interop auto (ServerOptions::ucx_interop); a
// client before 1.14 connects with it when its first request, on UCX's defaults, is never
// answered by such a daemon.
std::map<std::string, std::string> UcxOneDeviceSettings(UcxVersion local);
// `settings` without those the user chose: named in `config.overrides`, or set in the
// environment as UCX_<name> (either way the user's value stands).
std::map<std::string, std::string> UnlessUserSet(std::map<std::string, std::string> settings,
                                                 const UcxConfig& config);

// What the installed UCX supports (ucp_context_query on a throwaway context).
struct UcxCapabilities {
  std::string version;         // "1.13.1"
  bool cuda_memory = false;    // UCS_MEMORY_TYPE_CUDA: sends from/receives into GPU memory
  uint64_t memory_types = 0;   // bit mask of ucs_memory_type_t
  uint64_t max_am_header = 0;  // largest AM header of a worker (bytes)
};
absl::StatusOr<UcxCapabilities> QueryUcxCapabilities(const UcxConfig& config = {});

// A status for a UCX error: the code mapped to the nearest absl code, with `context` and
// UCX's own message (ucs_status_string). `ucs_status` is a ucs_status_t value.
absl::Status UcsStatusToStatus(int ucs_status, absl::string_view context);

// "host:port", "[v6]:port" or "v6addr" forms of an endpoint.
struct Endpoint {
  std::string host;  // IPv4 or IPv6 literal or a resolvable name
  uint16_t port = 0;
  // Parses "host:port" and "[ipv6]:port". InvalidArgument otherwise.
  static absl::StatusOr<Endpoint> Parse(absl::string_view text);
  std::string ToString() const;
};

}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_UCX_H_
