// Every address of a DNS name, for pool discovery (a headless Service has one record per ready
// daemon). The resolver behind NewAresResolver is c-ares: it reads /etc/resolv.conf (servers,
// search domains, ndots) and /etc/hosts like the system resolver, or asks the servers it is
// given. It keeps no cache, so each call sees the records as they are now.
#ifndef KVCOMP_CLIENT_SRC_RESOLVER_H_
#define KVCOMP_CLIENT_SRC_RESOLVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvcomp {
namespace client {

struct ResolverOptions {
  // DNS servers as "host[:port]" or "[v6]:port", comma-separated; empty: /etc/resolv.conf's.
  std::string servers;
  // Bound on one Resolve call, retries included.
  absl::Duration timeout = absl::Seconds(5);
};

class Resolver {
 public:
  virtual ~Resolver() = default;
  // The IPv4 and IPv6 addresses of `name` as literals, sorted, without duplicates. Thread-safe.
  // NotFound when the name has no address (no such name, or no A/AAAA records); Unavailable
  // when no server answered in time or the servers failed (refused, SERVFAIL); InvalidArgument
  // for a malformed name.
  virtual absl::StatusOr<std::vector<std::string>> Resolve(absl::string_view name) = 0;
};

// InvalidArgument for a malformed server list.
absl::StatusOr<std::unique_ptr<Resolver>> NewAresResolver(const ResolverOptions& options);

}  // namespace client
}  // namespace kvcomp

#endif  // KVCOMP_CLIENT_SRC_RESOLVER_H_
