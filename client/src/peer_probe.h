// What answers at an address that did not behave as a kvcompd port: the SDK's errors name it
// ("an HTTP server", "a Thrift service", the first bytes it sent, nothing listening), so a
// client pointed at the wrong port fails saying so instead of finding nothing.
#ifndef KVCOMP_CLIENT_SRC_PEER_PROBE_H_
#define KVCOMP_CLIENT_SRC_PEER_PROBE_H_

#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvcomp {
namespace client {

struct PeerAnswer {
  enum Kind {
    kRefused,      // nothing listens there (connection refused)
    kUnreachable,  // the connection could not be made (timeout, no route, bad name)
    kThrift,       // a Thrift service (framed binary): how kvcompd's control port answers
    kHttp,         // an HTTP server (kvcompd's metrics port is one)
    kOther,        // something else sent bytes
    kClosed,       // accepted the connection and closed it without a byte
    kSilent,       // accepted the connection and sent nothing within the timeout
  };
  Kind kind = kUnreachable;
  std::string description;  // e.g. "an HTTP server (\"HTTP/1.1 400 Bad Request\")"
};

// Connects to `host`:`port` over TCP, sends a framed Thrift call of a method no service has,
// and reads what comes back within `timeout` (connect included).
PeerAnswer ProbePeer(const std::string& host, int port, absl::Duration timeout);

// The first bytes a peer sent, quoted for an error message (printable ASCII kept, the rest as
// \xNN), e.g. "HTTP/1.1 400 Bad Request".
std::string QuoteBytes(absl::string_view bytes, size_t max_chars = 48);

// True when `bytes` start like a framed Thrift binary reply (a 4-byte frame size, then the
// strict binary protocol's version word 0x8001).
bool LooksLikeThriftReply(absl::string_view bytes);

}  // namespace client
}  // namespace kvcomp

#endif  // KVCOMP_CLIENT_SRC_PEER_PROBE_H_
