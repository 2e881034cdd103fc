#include "peer_probe.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace kvcomp {
namespace client {

namespace {

int RemainingMs(absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  return static_cast<int>(std::clamp<int64_t>(ms, 0, 1 << 30));
}

// A framed Thrift binary call of method "kvcomp_probe" (seqid 0, no arguments): a Thrift
// service answers it with an UNKNOWN_METHOD exception; an HTTP server with an error status.
std::string ThriftProbe() {
  const std::string name = "kvcomp_probe";
  std::string body;
  auto put32 = [&body](uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) body.push_back(static_cast<char>((v >> s) & 0xff));
  };
  put32(0x80010001u);  // version 1, T_CALL
  put32(static_cast<uint32_t>(name.size()));
  body += name;
  put32(0);          // seqid
  body.push_back(0);  // T_STOP: empty argument struct
  std::string frame;
  const uint32_t n = static_cast<uint32_t>(body.size());
  for (int s = 24; s >= 0; s -= 8) frame.push_back(static_cast<char>((n >> s) & 0xff));
  return frame + body;
}

}  // namespace

std::string QuoteBytes(absl::string_view bytes, size_t max_chars) {
  std::string out;
  for (unsigned char c : bytes) {
    if (out.size() >= max_chars) {
      out += "...";
      break;
    }
    if (c == '\r' || c == '\n') {
      if (!out.empty() && out.back() != ' ') out.push_back(' ');
      continue;
    }
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&out, "\\x%02x", c);
    }
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

bool LooksLikeThriftReply(absl::string_view bytes) {
  return bytes.size() >= 6 && static_cast<unsigned char>(bytes[4]) == 0x80 &&
         static_cast<unsigned char>(bytes[5]) == 0x01;
}

namespace {

// One connection: connect, send `payload`, read until a line, a Thrift reply, close or
// `deadline`. Fills `out` with the connection's failure, or returns what was read (`closed`
// when the peer closed first).
bool Exchange(const std::string& host, int port, absl::Time deadline, const std::string& payload,
              PeerAnswer* out, std::string* got, bool* closed) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0) {
    out->kind = PeerAnswer::kUnreachable;
    out->description = absl::StrCat("the name does not resolve (", gai_strerror(rc), ")");
    return false;
  }
  int fd = -1;
  int last_errno = 0;
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last_errno = errno;
      close(fd);
      fd = -1;
      continue;
    }
    pollfd p{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof(err);
    if (poll(&p, 1, RemainingMs(deadline)) != 1 ||
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      last_errno = err != 0 ? err : ETIMEDOUT;
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd < 0) {
    out->kind = last_errno == ECONNREFUSED ? PeerAnswer::kRefused : PeerAnswer::kUnreachable;
    out->description = last_errno == ECONNREFUSED
                           ? std::string("nothing listens there (connection refused)")
                           : absl::StrCat("no connection (", std::strerror(last_errno), ")");
    return false;
  }
  ssize_t sent = send(fd, payload.data(), payload.size(), MSG_NOSIGNAL);
  (void)sent;  // a peer that closes at once is described by what the read finds
  *closed = false;
  while (got->size() < 256) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, RemainingMs(deadline)) != 1) break;
    char buf[256];
    const ssize_t n = recv(fd, buf, sizeof(buf) - got->size(), 0);
    if (n <= 0) {
      *closed = true;
      break;
    }
    got->append(buf, static_cast<size_t>(n));
    if (got->find('\n') != std::string::npos || LooksLikeThriftReply(*got)) break;
  }
  close(fd);
  return true;
}

void Describe(const std::string& got, bool closed, absl::Duration waited, PeerAnswer* out) {
  if (LooksLikeThriftReply(got)) {
    out->kind = PeerAnswer::kThrift;
    out->description = "a Thrift service (as a kvcompd control port answers)";
  } else if (absl::StartsWith(got, "HTTP/")) {
    out->kind = PeerAnswer::kHttp;
    const size_t eol = got.find_first_of("\r\n");
    out->description =
        absl::StrCat("an HTTP server (\"", QuoteBytes(got.substr(0, eol)), "\")");
  } else if (!got.empty()) {
    out->kind = PeerAnswer::kOther;
    out->description = absl::StrCat("a service that sent \"", QuoteBytes(got), "\"");
  } else if (closed) {
    out->kind = PeerAnswer::kClosed;
    out->description = "a service that accepted the connection and closed it without answering";
  } else {
    out->kind = PeerAnswer::kSilent;
    out->description = absl::StrCat("a service that accepted the connection and sent nothing in ",
                                    absl::FormatDuration(waited));
  }
}

}  // namespace

PeerAnswer ProbePeer(const std::string& host, int port, absl::Duration timeout) {
  // A Thrift call first (a Thrift service answers it); then, when nothing came back, an HTTP
  // request (an HTTP server answers it, where it may close on Thrift's bytes without a word).
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  PeerAnswer out;
  std::string got;
  bool closed = false;
  if (!Exchange(host, port, start + timeout / 2, ThriftProbe(), &out, &got, &closed)) return out;
  Describe(got, closed, timeout / 2, &out);
  if (out.kind != PeerAnswer::kClosed && out.kind != PeerAnswer::kSilent) return out;
  std::string http;
  bool http_closed = false;
  PeerAnswer second;
  if (Exchange(host, port, deadline, "GET / HTTP/1.0\r\n\r\n", &second, &http,
               &http_closed) &&
      absl::StartsWith(http, "HTTP/")) {
    Describe(http, http_closed, timeout, &out);
  }
  return out;
}

}  // namespace client
}  // namespace kvcomp
