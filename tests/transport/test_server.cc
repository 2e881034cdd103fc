// The server process of client_reconnect_test: a UcxServer (UCX over TCP on 127.0.0.1, an
// ephemeral port) over MemoryHandler with tenant "acme" / token "secret". Prints the port on a
// line of its own, then serves until killed. A server in a process of its own keeps the test's
// client process to one UCX worker, as a real client process is.
//   transport_test_server
#include <unistd.h>

#include <cstdio>

#include "kvcomp/transport/server.h"
#include "transport/memory_handler.h"

int main() {
  using kvcomp::transport::ServerOptions;
  using kvcomp::transport::UcxServer;
  kvcomp::testing::MemoryHandler handler(
      std::map<std::string, std::string>{{"acme", "secret"}});
  ServerOptions so;
  so.ucx.overrides["TLS"] = "tcp";
  so.report = [](const std::string&) {};
  auto s = UcxServer::Start(so, &handler);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
    return 1;
  }
  std::printf("%u\n", static_cast<unsigned>((*s)->port()));
  std::fflush(stdout);
  for (;;) pause();
}
