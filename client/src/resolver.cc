#include "resolver.h"

#include <ares.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcomp {
namespace client {
namespace {

using ChannelPtr = std::unique_ptr<ares_channeldata, decltype(&ares_destroy)>;

absl::Status LibraryInit() {
  static absl::once_flag once;
  static int rc = ARES_SUCCESS;
  absl::call_once(once, [] { rc = ares_library_init(ARES_LIB_INIT_ALL); });
  if (rc != ARES_SUCCESS) {
    return absl::InternalError(absl::StrCat("c-ares init: ", ares_strerror(rc)));
  }
  return absl::OkStatus();
}

// A channel per call: c-ares channels are not thread-safe, and a fresh one picks up a changed
// /etc/resolv.conf.
absl::StatusOr<ChannelPtr> OpenChannel(const ResolverOptions& o) {
  if (absl::Status s = LibraryInit(); !s.ok()) return s;
  ares_options opts = {};
  // Two tries (c-ares doubles the second's timeout) fit within the call's bound, which the
  // poll loop enforces anyway.
  opts.timeout = static_cast<int>(std::max<int64_t>(20, absl::ToInt64Milliseconds(o.timeout) / 4));
  opts.tries = 2;
  ares_channel ch = nullptr;
  const int rc = ares_init_options(&ch, &opts, ARES_OPT_TIMEOUTMS | ARES_OPT_TRIES);
  if (rc != ARES_SUCCESS) {
    return absl::UnavailableError(absl::StrCat("c-ares channel: ", ares_strerror(rc)));
  }
  ChannelPtr channel(ch, &ares_destroy);
  if (!o.servers.empty()) {
    const int src = ares_set_servers_ports_csv(ch, o.servers.c_str());
    if (src != ARES_SUCCESS) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dns server list \"", o.servers, "\": ", ares_strerror(src),
          " (want ip[:port] or [ipv6]:port, comma-separated)"));
    }
  }
  return channel;
}

struct Outcome {
  bool done = false;
  int status = ARES_SUCCESS;
  std::vector<std::string> addresses;
};

void OnAddrInfo(void* arg, int status, int /*timeouts*/, ares_addrinfo* result) {
  auto* out = static_cast<Outcome*>(arg);
  out->done = true;
  out->status = status;
  if (result == nullptr) return;
  for (const ares_addrinfo_node* n = result->nodes; n != nullptr; n = n->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* addr = nullptr;
    if (n->ai_family == AF_INET) {
      addr = &reinterpret_cast<const sockaddr_in*>(n->ai_addr)->sin_addr;
    } else if (n->ai_family == AF_INET6) {
      addr = &reinterpret_cast<const sockaddr_in6*>(n->ai_addr)->sin6_addr;
    }
    if (addr != nullptr && inet_ntop(n->ai_family, addr, text, sizeof(text)) != nullptr) {
      out->addresses.emplace_back(text);
    }
  }
  ares_freeaddrinfo(result);
}

// Drives the channel until the query completes or `deadline` passes (then cancels it, which
// completes it with ARES_ECANCELLED).
absl::Status RunUntilDone(ares_channel ch, const Outcome& out, absl::Time deadline) {
  while (!out.done) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      ares_cancel(ch);
      break;
    }
    ares_socket_t socks[ARES_GETSOCK_MAXNUM];
    const int bits = ares_getsock(ch, socks, ARES_GETSOCK_MAXNUM);
    pollfd fds[ARES_GETSOCK_MAXNUM];
    nfds_t n = 0;
    for (int i = 0; i < ARES_GETSOCK_MAXNUM; ++i) {
      const bool r = ARES_GETSOCK_READABLE(bits, i);
      const bool w = ARES_GETSOCK_WRITABLE(bits, i);
      if (!r && !w) continue;
      fds[n].fd = socks[i];
      fds[n].events = static_cast<short>((r ? POLLIN : 0) | (w ? POLLOUT : 0));
      fds[n].revents = 0;
      ++n;
    }
    timeval max_wait = absl::ToTimeval(left);
    timeval buf;
    const timeval* wait = ares_timeout(ch, &max_wait, &buf);
    const int ms = static_cast<int>(wait->tv_sec * 1000 + (wait->tv_usec + 999) / 1000);
    const int rc = poll(fds, n, ms);
    if (rc < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ares_cancel(ch);
      return absl::InternalError(absl::StrCat("poll: ", std::strerror(err)));
    }
    if (rc == 0) {
      ares_process_fd(ch, ARES_SOCKET_BAD, ARES_SOCKET_BAD);  // retransmits and timeouts
      continue;
    }
    for (nfds_t i = 0; i < n; ++i) {
      const bool r = (fds[i].revents & (POLLIN | POLLERR | POLLHUP)) != 0;
      const bool w = (fds[i].revents & POLLOUT) != 0;
      if (r || w) {
        ares_process_fd(ch, r ? fds[i].fd : ARES_SOCKET_BAD, w ? fds[i].fd : ARES_SOCKET_BAD);
      }
    }
  }
  return absl::OkStatus();
}

class AresResolver : public Resolver {
 public:
  explicit AresResolver(ResolverOptions options) : options_(std::move(options)) {}

  absl::StatusOr<std::vector<std::string>> Resolve(absl::string_view name) override {
    if (name.empty()) return absl::InvalidArgumentError("empty DNS name");
    auto channel = OpenChannel(options_);
    if (!channel.ok()) return channel.status();
    const std::string host(name);
    ares_addrinfo_hints hints = {};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = ARES_AI_NOSORT;  // sorted below; no probing connects
    Outcome out;
    const absl::Time deadline = absl::Now() + options_.timeout;
    ares_getaddrinfo(channel->get(), host.c_str(), nullptr, &hints, &OnAddrInfo, &out);
    if (absl::Status s = RunUntilDone(channel->get(), out, deadline); !s.ok()) return s;
    const std::string what = absl::StrCat("resolve ", host, via());
    switch (out.status) {
      case ARES_SUCCESS:
        break;
      case ARES_ENOTFOUND:
      case ARES_ENODATA:
        return absl::NotFoundError(
            absl::StrCat(what, ": the name has no address (", ares_strerror(out.status), ")"));
      case ARES_EBADNAME:
        return absl::InvalidArgumentError(absl::StrCat(what, ": ", ares_strerror(out.status)));
      case ARES_ECANCELLED:
        return absl::UnavailableError(absl::StrCat(what, ": no answer within ",
                                                   absl::FormatDuration(options_.timeout)));
      default:
        return absl::UnavailableError(absl::StrCat(what, ": ", ares_strerror(out.status)));
    }
    std::sort(out.addresses.begin(), out.addresses.end());
    out.addresses.erase(std::unique(out.addresses.begin(), out.addresses.end()),
                        out.addresses.end());
    if (out.addresses.empty()) {
      return absl::NotFoundError(absl::StrCat(what, ": the name has no address"));
    }
    return std::move(out.addresses);
  }

  std::string via() const {
    return options_.servers.empty() ? "" : absl::StrCat(" (dns server ", options_.servers, ")");
  }

 private:
  const ResolverOptions options_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Resolver>> NewAresResolver(const ResolverOptions& options) {
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("dns timeout must be positive");
  }
  // Checks the server list once, so a malformed one fails at construction.
  auto channel = OpenChannel(options);
  if (!channel.ok()) return channel.status();
  return std::unique_ptr<Resolver>(new AresResolver(options));
}

}  // namespace client
}  // namespace kvcomp
