#include "pool.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace client {
namespace {

constexpr absl::string_view kDnsScheme = "dns:///";
constexpr absl::Duration kMinRefreshSpacing = absl::Milliseconds(500);

absl::Status BadDns(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(
      "endpoint '", text, "': ", why, " (want dns:///NAME:DATA_PORT[,CONTROL_PORT])"));
}

bool ParsePort(absl::string_view s, uint16_t* port) {
  uint32_t p = 0;
  if (!absl::SimpleAtoi(s, &p) || p == 0 || p > 65535) return false;
  *port = static_cast<uint16_t>(p);
  return true;
}

bool ValidDnsName(absl::string_view name) {
  if (name.empty() || name.size() > 254) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '-' && c != '.' && c != '_') return false;
  }
  return name.front() != '.' && absl::StrContains(name, "..") == false;
}

// Members of `fixed` then each DNS name's addresses, without repeating a data address; states
// of members already in `previous` are kept.
std::shared_ptr<const Members> BuildMembers(const std::vector<EndpointAddress>& addresses,
                                            const Members* previous, absl::Status empty_reason) {
  auto m = std::make_shared<Members>();
  for (const EndpointAddress& a : addresses) {
    if (std::find(m->names.begin(), m->names.end(), a.data) != m->names.end()) continue;
    std::shared_ptr<EndpointState> state;
    if (previous != nullptr) {
      for (const auto& s : previous->states) {
        if (s->address().data == a.data && s->address().control == a.control) state = s;
      }
    }
    if (state == nullptr) {
      auto data = transport::Endpoint::Parse(a.data);
      if (!data.ok()) continue;  // parsed before; resolved literals always parse
      state = std::make_shared<EndpointState>(a, *std::move(data));
    }
    m->names.push_back(a.data);
    m->states.push_back(std::move(state));
  }
  if (m->states.empty()) m->empty_reason = std::move(empty_reason);
  return m;
}

}  // namespace

EndpointAddress DnsEndpoint::At(absl::string_view ip) const {
  transport::Endpoint e;
  e.host = std::string(ip);
  e.port = data_port;
  EndpointAddress a;
  a.data = e.ToString();
  if (control_port != 0) {
    e.port = control_port;
    a.control = e.ToString();
  }
  return a;
}

absl::StatusOr<std::optional<DnsEndpoint>> ParseDnsEndpoint(absl::string_view text) {
  if (!absl::StartsWith(text, "dns:")) return std::nullopt;
  if (!absl::StartsWith(text, kDnsScheme)) {
    if (absl::StartsWith(text, "dns://")) {
      return BadDns(text, "a DNS server in the URI is not supported; set the dns_server option");
    }
    return BadDns(text, "malformed DNS endpoint");
  }
  const absl::string_view rest = text.substr(kDnsScheme.size());
  std::vector<absl::string_view> parts = absl::StrSplit(rest, ',');
  if (parts.size() > 2) return BadDns(text, "too many ports");
  const size_t colon = parts[0].rfind(':');
  if (colon == absl::string_view::npos) return BadDns(text, "no data port");
  DnsEndpoint d;
  d.spec = std::string(text);
  d.name = std::string(parts[0].substr(0, colon));
  if (!ValidDnsName(d.name)) return BadDns(text, absl::StrCat("bad DNS name '", d.name, "'"));
  if (!ParsePort(parts[0].substr(colon + 1), &d.data_port)) return BadDns(text, "bad data port");
  if (parts.size() == 2 && !ParsePort(parts[1], &d.control_port)) {
    return BadDns(text, "bad control port");
  }
  return d;
}

absl::StatusOr<std::shared_ptr<Pool>> Pool::Create(const std::vector<std::string>& endpoints,
                                                   const ClientOptions& options,
                                                   std::unique_ptr<Resolver> resolver) {
  std::vector<EndpointAddress> fixed;
  std::vector<DnsEndpoint> dns;
  for (const std::string& text : endpoints) {
    KVCOMP_ASSIGN_OR_RETURN(std::optional<DnsEndpoint> d, ParseDnsEndpoint(text));
    if (d.has_value()) {
      for (const auto& other : dns) {
        if (other.name == d->name && other.data_port == d->data_port) {
          return absl::InvalidArgumentError(absl::StrCat("endpoint ", text, " listed twice"));
        }
      }
      dns.push_back(*std::move(d));
      continue;
    }
    KVCOMP_ASSIGN_OR_RETURN(EndpointAddress a, EndpointAddress::Parse(text));
    for (const auto& f : fixed) {
      if (f.data == a.data) {
        return absl::InvalidArgumentError(absl::StrCat("endpoint ", a.data, " listed twice"));
      }
    }
    fixed.push_back(std::move(a));
  }
  if (!dns.empty() && resolver == nullptr) {
    return absl::InvalidArgumentError("DNS endpoints need a resolver");
  }
  std::shared_ptr<Pool> pool(
      new Pool(options, std::move(fixed), std::move(dns), std::move(resolver)));
  pool->Refresh();
  if (pool->has_dns()) pool->refresher_ = std::thread([p = pool.get()] { p->RefreshLoop(); });
  return pool;
}

Pool::Pool(const ClientOptions& options, std::vector<EndpointAddress> fixed,
           std::vector<DnsEndpoint> dns, std::unique_ptr<Resolver> resolver)
    : options_(options),
      fixed_(std::move(fixed)),
      dns_(std::move(dns)),
      resolver_(std::move(resolver)),
      resolved_(dns_.size()),
      resolve_errors_(dns_.size()),
      current_(std::make_shared<Members>()) {}

Pool::~Pool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (refresher_.joinable()) refresher_.join();
}

std::shared_ptr<const Members> Pool::Current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

void Pool::RefreshSoon() {
  if (dns_.empty()) return;
  absl::MutexLock lock(&mu_);
  refresh_requested_ = true;
}

void Pool::Refresh() {
  absl::MutexLock refresh_lock(&refresh_mu_);
  std::vector<EndpointAddress> addresses = fixed_;
  std::string reasons;
  for (size_t i = 0; i < dns_.size(); ++i) {
    absl::StatusOr<std::vector<std::string>> r = resolver_->Resolve(dns_[i].name);
    if (r.ok()) {
      resolved_[i] = *std::move(r);
      resolve_errors_[i] = absl::OkStatus();
    } else {
      // The DNS saying "no such name" empties the name's members; a DNS outage keeps them.
      if (absl::IsNotFound(r.status())) resolved_[i].clear();
      resolve_errors_[i] = r.status();
    }
    for (const std::string& ip : resolved_[i]) addresses.push_back(dns_[i].At(ip));
    if (resolved_[i].empty()) {
      absl::StrAppend(&reasons, reasons.empty() ? "" : "; ", dns_[i].spec, ": ",
                      resolve_errors_[i].ok() ? "no address"
                                              : std::string(resolve_errors_[i].message()));
    }
  }
  absl::Status empty_reason = absl::UnavailableError(
      absl::StrCat("no kvcompd in the pool (", reasons.empty() ? "no endpoints" : reasons, ")"));
  std::shared_ptr<const Members> previous = Current();
  std::shared_ptr<const Members> next =
      BuildMembers(addresses, previous.get(), std::move(empty_reason));
  if (next->names == previous->names && !next->names.empty()) return;
  absl::MutexLock lock(&mu_);
  current_ = std::move(next);
}

void Pool::RefreshLoop() {
  const absl::Duration interval = options_.dns_refresh_interval;
  const absl::Duration spacing =
      interval > absl::ZeroDuration() ? std::min(interval, kMinRefreshSpacing) : kMinRefreshSpacing;
  absl::Time last = absl::Now();
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      const absl::Time periodic =
          interval > absl::ZeroDuration() ? last + interval : absl::InfiniteFuture();
      // Wake for stop, for the periodic refresh, or for a request once the spacing has passed.
      const absl::Time earliest = last + spacing;
      auto due = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        const absl::Time now = absl::Now();
        return stop_ || now >= periodic || (refresh_requested_ && now >= earliest);
      };
      while (!due()) {
        const bool requested = refresh_requested_;
        const absl::Time wake = requested ? std::min(earliest, periodic) : periodic;
        // Wakes early on stop or on a new request.
        auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stop_ || refresh_requested_ != requested;
        };
        mu_.AwaitWithDeadline(absl::Condition(&changed), wake);
      }
      if (stop_) return;
      refresh_requested_ = false;
    }
    Refresh();
    last = absl::Now();
  }
}

}  // namespace client
}  // namespace kvcomp
