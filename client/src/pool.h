// The set of kvcompd instances a Client shards over: endpoints listed by address, plus every
// address of each "dns:///NAME:DATA_PORT[,CONTROL_PORT]" endpoint (a headless Service: one
// record per ready daemon; every member listens on the same ports). DNS names are resolved
// when the pool is made, every `dns_refresh_interval` on a background thread, and soon after a
// request reports a failed member (RefreshSoon). A name that the DNS says has no address
// empties its part of the pool; a DNS server that does not answer leaves the last known members
// in place.
//
// Members are named by their data address ("10.0.0.7:7420", "[fd00::7]:7420"), which is what
// rendezvous hashing ranks, so a key moves only when the member it ranks first joins or leaves.
// A member that stays keeps its EndpointState (and its connection) across refreshes.
//
// Thread-safe.
#ifndef KVCOMP_CLIENT_SRC_POOL_H_
#define KVCOMP_CLIENT_SRC_POOL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "endpoint_state.h"
#include "kvcomp/client/client.h"
#include "resolver.h"

namespace kvcomp {
namespace client {

// A parsed "dns:///NAME:DATA_PORT[,CONTROL_PORT]".
struct DnsEndpoint {
  std::string spec;  // as given
  std::string name;
  uint16_t data_port = 0;
  uint16_t control_port = 0;  // 0: no control address
  // The member at address literal `ip`.
  EndpointAddress At(absl::string_view ip) const;
};

// nullopt when `text` does not start with "dns:"; InvalidArgument when it does but is malformed.
absl::StatusOr<std::optional<DnsEndpoint>> ParseDnsEndpoint(absl::string_view text);

// One consistent view of the pool.
struct Members {
  std::vector<std::shared_ptr<EndpointState>> states;
  std::vector<std::string> names;  // states[i]->address().data
  // Why `states` is empty (Unavailable, naming the DNS names and their last errors).
  absl::Status empty_reason;
};

class Pool {
 public:
  // Parses `endpoints` (InvalidArgument for malformed ones or an address listed twice), resolves
  // the DNS names once and, when there are any, starts refreshing them. `resolver` may be null
  // when no endpoint is a DNS name.
  static absl::StatusOr<std::shared_ptr<Pool>> Create(const std::vector<std::string>& endpoints,
                                                      const ClientOptions& options,
                                                      std::unique_ptr<Resolver> resolver);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // The current members (never null).
  std::shared_ptr<const Members> Current() const;
  // Asks for the DNS names to be resolved again soon (at most every 500 ms, or every refresh
  // interval when shorter). Returns at once; a no-op without DNS names.
  void RefreshSoon();
  bool has_dns() const { return !dns_.empty(); }

 private:
  Pool(const ClientOptions& options, std::vector<EndpointAddress> fixed,
       std::vector<DnsEndpoint> dns, std::unique_ptr<Resolver> resolver);
  // Resolves every DNS name and publishes the new member set if it changed.
  void Refresh();
  void RefreshLoop();

  const ClientOptions options_;
  const std::vector<EndpointAddress> fixed_;
  const std::vector<DnsEndpoint> dns_;
  const std::unique_ptr<Resolver> resolver_;

  // Refresh's own state: one Refresh at a time.
  absl::Mutex refresh_mu_;
  std::vector<std::vector<std::string>> resolved_ ABSL_GUARDED_BY(refresh_mu_);  // per name
  std::vector<absl::Status> resolve_errors_ ABSL_GUARDED_BY(refresh_mu_);       // per name

  mutable absl::Mutex mu_;
  std::shared_ptr<const Members> current_ ABSL_GUARDED_BY(mu_);
  bool refresh_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread refresher_;
};

}  // namespace client
}  // namespace kvcomp

#endif  // KVCOMP_CLIENT_SRC_POOL_H_
