// Reconnects under daemon kills, the client side of the fault campaign made cheap: a child
// process runs a UcxServer (the transport's in-memory test handler, no storage) on a loopback
// port and is SIGKILLed and restarted every 150-600 ms, while `threads` client threads connect,
// put small caches and reconnect when their connection breaks, until `connections` connects
// were attempted. Prints the count, the time and the UCX contexts, workers and endpoints the
// client side made (transport::GetUcxClientStats). A client process that made a UCX worker per
// connection aborted here with UCX 1.13.1 after a few thousand connections
// (bench/results/reliability-reconnect-2026-11-26.md).
//
//   kvcomp_reconnect_storm <connections> <threads> <port>   (UCX over TCP on 127.0.0.1)
//   kvcomp_reconnect_storm --server <port>                  (the child, run by the above)
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvcomp/transport/client.h"
#include "kvcomp/transport/server.h"
#include "transport/memory_handler.h"

namespace kvcomp {
namespace {

using transport::ClientOptions;
using transport::Endpoint;
using transport::UcxClient;

int Serve(int port) {
  testing::MemoryHandler handler(std::map<std::string, std::string>{{"storm", "secret"}});
  transport::ServerOptions so;
  so.ucx.overrides["TLS"] = "tcp";
  so.port = static_cast<uint16_t>(port);
  so.report = [](const std::string&) {};
  auto s = transport::UcxServer::Start(so, &handler);
  if (!s.ok()) {
    std::fprintf(stderr, "server: %s\n", s.status().ToString().c_str());
    return 1;
  }
  pause();
  return 0;
}

pid_t Spawn(int port) {
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string p = std::to_string(port);
    execl("/proc/self/exe", "kvcomp_reconnect_storm", "--server", p.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// Connects, then puts small caches until the connection breaks or 20 are stored.
void PutUntilBroken(UcxClient& c, int thread, int round) {
  const KvLayout layout{4, 2, 2, 64, DType::kBF16};
  const uint64_t tokens = 16;
  const size_t half = layout.num_layers * layout.LayerBytes(tokens);
  std::vector<uint8_t> kv(2 * half, static_cast<uint8_t>(thread));
  for (int k = 0; k < 20 && c.connected(); ++k) {
    transport::wire::PutBegin b;
    b.layout = layout;
    b.num_tokens = tokens;
    b.model_id = "storm";
    b.key = "t" + std::to_string(thread) + "r" + std::to_string(round) + "k" + std::to_string(k);
    auto put = c.PutBegin(b);
    if (!put.ok()) return;
    transport::wire::Block blk;
    blk.put_id = *put;
    blk.layer_end = layout.num_layers;
    blk.token_end = tokens;
    blk.key_bytes = blk.value_bytes = half;
    if (!c.SendBlock(blk, kv.data(), kv.data() + half).ok()) return;
    if (!c.PutCommit(*put, 1).ok()) return;
  }
}

int Storm(int connections, int threads, int port) {
  std::atomic<int> attempted{0}, connected{0};
  std::atomic<bool> stop{false};
  std::atomic<pid_t> child{Spawn(port)};
  std::thread killer([&] {
    std::mt19937 rng(1);
    while (!stop.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(150 + rng() % 450));
      const pid_t c = child.load();
      kill(c, SIGKILL);
      waitpid(c, nullptr, 0);
      child = Spawn(port);
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      ClientOptions o;
      o.ucx.overrides["TLS"] = "tcp";
      o.connect_timeout = absl::Seconds(1);
      o.request_timeout = absl::Seconds(1);
      for (int round = 0;; ++round) {
        const int i = attempted.fetch_add(1) + 1;
        if (i > connections) return;
        auto c = UcxClient::Connect(Endpoint{"127.0.0.1", static_cast<uint16_t>(port)}, "storm",
                                    "secret", o);
        if (i % 1000 == 0) {
          const transport::UcxClientStats s = transport::GetUcxClientStats();
          std::printf("connects %d (%d connected), %.1f s, UCX workers made %llu\n", i,
                      connected.load(), seconds(),
                      static_cast<unsigned long long>(s.workers_created));
          std::fflush(stdout);
        }
        if (!c.ok()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
          continue;
        }
        ++connected;
        PutUntilBroken(**c, t, round);
      }
    });
  }
  for (auto& w : workers) w.join();
  stop = true;
  killer.join();
  kill(child.load(), SIGKILL);
  waitpid(child.load(), nullptr, 0);
  const transport::UcxClientStats s = transport::GetUcxClientStats();
  std::printf(
      "done: %d connects (%d connected) by %d threads in %.1f s; UCX contexts made %llu, "
      "workers made %llu, endpoints made %llu (%llu not yet closed)\n",
      connections, connected.load(), threads, seconds(),
      static_cast<unsigned long long>(s.contexts_created),
      static_cast<unsigned long long>(s.workers_created),
      static_cast<unsigned long long>(s.endpoints_created),
      static_cast<unsigned long long>(s.endpoints_open));
  return 0;
}

}  // namespace
}  // namespace kvcomp

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--server") return kvcomp::Serve(std::atoi(argv[2]));
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <connections> <threads> <port>\n", argv[0]);
    return 2;
  }
  return kvcomp::Storm(std::atoi(argv[1]), std::atoi(argv[2]), std::atoi(argv[3]));
}
