// End-to-end benchmark of kvcompd: starts a real daemon (embedded defaults plus the flags given
// after `--`), pushes a Llama-3.1-8B-shaped cache over UCX and measures
//   ingest: PutBegin -> every block acknowledged (receive GB/s over the K+V bytes) and
//           PutBegin -> commit acknowledged (end-to-end put GB/s, compression and store included),
//           with 1 MiB blocks pipelined (SendBlockAsync, a window of blocks in flight);
//   get:    latency of fetching the stored cache (GetInto a preallocated host buffer), p50/p99.
// Prints one YAML document on stdout.
//
// With --clients N it measures instead the latency of concurrent puts: N connections, each putting
// --puts caches of --put_tokens tokens one after another (p50/p99 of begin -> commit acknowledged).
//
// Usage: kvcompd_bench --kvcompd PATH [--tls tcp|posix,tcp] [--tokens N] [--ingest_tokens N]
//                      [--gets N] [--window N] [--clients N --puts N --put_tokens N]
//                      [-- kvcompd flags...]
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/transport/client.h"
#include "kvcompd_process.h"

namespace {

using kvcomp::DType;
using kvcomp::KvLayout;
namespace wire = kvcomp::transport::wire;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Args {
  std::string kvcompd;
  std::string tls = "tcp";
  uint64_t tokens = 32768;         // get benchmark cache
  uint64_t ingest_tokens = 32768;  // ingest benchmark cache
  int gets = 30;
  int window = 16;
  uint64_t block_bytes = 1 << 20;
  // Concurrent puts: `clients` connections, each putting `puts` caches of `put_tokens` tokens
  // one after another; per-put latency (begin to commit acknowledged) p50/p99. 0 = skip.
  int clients = 0;
  int puts = 10;
  uint64_t put_tokens = 1024;
  std::vector<std::string> flags;
};

// A cache's K and V for one layer, bf16 [kv_heads][tokens][head_dim]; the same random layer is
// reused for every layer (the bytes' values do not change the data path's cost).
struct LayerData {
  std::vector<uint16_t> k, v;
};

LayerData MakeLayer(const KvLayout& layout, uint64_t tokens) {
  LayerData d;
  size_t n = uint64_t{layout.num_kv_heads} * tokens * layout.head_dim;
  d.k.resize(n);
  d.v.resize(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) {
    d.k[i] = kvcomp::FloatToBf16(g(rng));
    d.v[i] = kvcomp::FloatToBf16(g(rng));
  }
  return d;
}

struct PutTiming {
  double received_s = 0, committed_s = 0;
  uint64_t bytes = 0, stored = 0;
  bool ok = false;
  std::string error;
};

// Blocks of one layer: [kv_heads][block tokens][head_dim] per half; every layer sends the same.
struct Prepared {
  wire::Block block;
  std::vector<uint16_t> k, v;
};

std::vector<Prepared> PrepareLayerBlocks(const KvLayout& layout, uint64_t tokens,
                                         uint64_t block_tokens) {
  LayerData layer = MakeLayer(layout, tokens);
  std::vector<Prepared> per_layer;
  const uint32_t D = layout.head_dim;
  for (uint64_t tb = 0; tb < tokens; tb += block_tokens) {
    uint64_t te = std::min(tokens, tb + block_tokens);
    Prepared p;
    for (uint32_t h = 0; h < layout.num_kv_heads; ++h) {
      size_t at = (uint64_t{h} * tokens + tb) * D;
      p.k.insert(p.k.end(), layer.k.begin() + at, layer.k.begin() + at + (te - tb) * D);
      p.v.insert(p.v.end(), layer.v.begin() + at, layer.v.begin() + at + (te - tb) * D);
    }
    p.block.token_begin = tb;
    p.block.token_end = te;
    p.block.key_bytes = p.block.value_bytes = layout.LayerBytes(te - tb);
    per_layer.push_back(std::move(p));
  }
  return per_layer;
}

// Puts `tokens` tokens of `layout` from `per_layer` (PrepareLayerBlocks), keeping up to
// `window` blocks in flight.
PutTiming SendPut(kvcomp::transport::UcxClient& c, const KvLayout& layout, uint64_t tokens,
                  const std::vector<Prepared>& per_layer, int window, const std::string& key) {
  PutTiming t;
  wire::PutBegin begin;
  begin.layout = layout;
  begin.num_tokens = tokens;
  begin.model_id = "meta-llama/Llama-3.1-8B";
  begin.key = key;
  Clock::time_point t0 = Clock::now();
  auto id = c.PutBegin(begin);
  if (!id.ok()) {
    t.error = id.status().ToString();
    return t;
  }
  absl::Mutex mu;
  int in_flight = 0;
  uint64_t sent = 0;
  absl::Status first_error;
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    for (const Prepared& p : per_layer) {
      wire::Block b = p.block;
      b.put_id = *id;
      b.layer_begin = l;
      b.layer_end = l + 1;
      {
        absl::MutexLock lock(&mu);
        auto room = [&]() { return in_flight < window; };
        mu.Await(absl::Condition(&room));
        ++in_flight;
      }
      c.SendBlockAsync(b, p.k.data(), p.v.data(), [&](absl::Status s) {
        absl::MutexLock lock(&mu);
        --in_flight;
        if (!s.ok() && first_error.ok()) first_error = s;
      });
      ++sent;
      t.bytes += b.payload_bytes();
    }
  }
  {
    absl::MutexLock lock(&mu);
    auto drained = [&]() { return in_flight == 0; };
    mu.Await(absl::Condition(&drained));
  }
  t.received_s = Since(t0);
  if (!first_error.ok()) {
    t.error = first_error.ToString();
    return t;
  }
  auto summary = c.PutCommit(*id, sent);
  t.committed_s = Since(t0);
  if (!summary.ok()) {
    t.error = summary.status().ToString();
    return t;
  }
  t.stored = summary->stored_bytes;
  t.ok = true;
  return t;
}

// Puts `tokens` tokens of `layout`, in blocks of `block_tokens` tokens of one layer, keeping
// up to `window` blocks in flight. Block payloads are gathered up front.
PutTiming Put(kvcomp::transport::UcxClient& c, const KvLayout& layout, uint64_t tokens,
              uint64_t block_tokens, int window, const std::string& key) {
  return SendPut(c, layout, tokens, PrepareLayerBlocks(layout, tokens, block_tokens), window,
                 key);
}

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(q * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&]() { return std::string(i + 1 < argc ? argv[++i] : ""); };
    if (s == "--") {
      for (++i; i < argc; ++i) a.flags.push_back(argv[i]);
    } else if (s == "--kvcompd") {
      a.kvcompd = next();
    } else if (s == "--tls") {
      a.tls = next();
    } else if (s == "--tokens") {
      a.tokens = std::stoull(next());
    } else if (s == "--ingest_tokens") {
      a.ingest_tokens = std::stoull(next());
    } else if (s == "--gets") {
      a.gets = std::stoi(next());
    } else if (s == "--window") {
      a.window = std::stoi(next());
    } else if (s == "--clients") {
      a.clients = std::stoi(next());
    } else if (s == "--puts") {
      a.puts = std::stoi(next());
    } else if (s == "--put_tokens") {
      a.put_tokens = std::stoull(next());
    }
  }
  if (a.kvcompd.empty()) {
    std::fprintf(stderr, "usage: kvcompd_bench --kvcompd PATH [...] [-- kvcompd flags]\n");
    return 2;
  }
  kvcomp::testing::TempDir dir;
  std::vector<std::string> flags = {
      "--storage.host_capacity_bytes=16Gi", "--data_plane.max_buffered_bytes=12Gi",
      "--data_plane.ucx_tls=" + a.tls, "--engine.workers=1", "--engine.cpu_threads=0"};
  flags.insert(flags.end(), a.flags.begin(), a.flags.end());
  kvcomp::testing::KvcompdProcess d(a.kvcompd, dir.path() + "/data", flags);
  if (!d.Start(120)) {
    std::fprintf(stderr, "kvcompd did not start:\n%s\n", d.Log().c_str());
    return 1;
  }
  kvcomp::transport::ClientOptions o;
  o.ucx.overrides["TLS"] = a.tls;
  o.request_timeout = absl::Seconds(600);
  auto c = kvcomp::transport::UcxClient::Connect(
      *kvcomp::transport::Endpoint::Parse(d.data_endpoint()), "", "", o);
  if (!c.ok()) {
    std::fprintf(stderr, "connect: %s\n", c.status().ToString().c_str());
    return 1;
  }
  const KvLayout llama{32, 8, 32, 128, DType::kBF16};
  // 1 MiB blocks: K+V of one layer, block_tokens tokens.
  const uint64_t block_tokens = a.block_bytes / (2 * llama.LayerBytes(1));

  std::printf("transport: \"%s\"\nlayout: \"%s\"\nblock_bytes: %llu\nwindow: %d\n", a.tls.c_str(),
              llama.DebugString().c_str(), static_cast<unsigned long long>(a.block_bytes),
              a.window);
  if (a.clients > 0) {
    // Concurrent puts from several clients; the latency tail is the figure.
    const std::vector<Prepared> blocks = PrepareLayerBlocks(llama, a.put_tokens, block_tokens);
    std::vector<std::unique_ptr<kvcomp::transport::UcxClient>> clients;
    for (int i = 0; i < a.clients; ++i) {
      auto ci = kvcomp::transport::UcxClient::Connect(
          *kvcomp::transport::Endpoint::Parse(d.data_endpoint()), "", "", o);
      if (!ci.ok()) {
        std::fprintf(stderr, "connect: %s\n", ci.status().ToString().c_str());
        return 1;
      }
      clients.push_back(std::move(*ci));
    }
    absl::Mutex mu;
    std::vector<double> lat;
    int failed = 0;
    std::string first_error;
    Clock::time_point t0 = Clock::now();
    std::vector<std::thread> threads;
    for (int i = 0; i < a.clients; ++i) {
      threads.emplace_back([&, i] {
        for (int p = 0; p < a.puts; ++p) {
          PutTiming t = SendPut(*clients[i], llama, a.put_tokens, blocks, a.window,
                                "c" + std::to_string(i) + "-" + std::to_string(p));
          absl::MutexLock lock(&mu);
          if (t.ok) {
            lat.push_back(t.committed_s);
          } else {
            ++failed;
            if (first_error.empty()) first_error = t.error;
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    const double wall = Since(t0);
    if (lat.empty()) {
      std::fprintf(stderr, "every concurrent put failed: %s\n", first_error.c_str());
      return 1;
    }
    std::printf(
        "concurrent_puts:\n  clients: %d\n  puts_per_client: %d\n  tokens: %llu\n"
        "  bytes_per_put: %llu\n  ok: %zu\n  failed: %d\n  wall_s: %.2f\n  puts_per_s: %.2f\n"
        "  p50_ms: %.1f\n  p99_ms: %.1f\n  max_ms: %.1f\n",
        a.clients, a.puts, static_cast<unsigned long long>(a.put_tokens),
        static_cast<unsigned long long>(llama.CacheBytes(a.put_tokens)), lat.size(), failed,
        wall, lat.size() / wall, Percentile(lat, 0.5) * 1e3, Percentile(lat, 0.99) * 1e3,
        Percentile(lat, 1.0) * 1e3);
    if (!first_error.empty()) std::printf("  first_error: \"%s\"\n", first_error.c_str());
    clients.clear();
    c->reset();
    d.Kill(SIGTERM);
    return 0;
  }
  // Ingest: two warm-up-free puts, each reported.
  std::printf("ingest:\n");
  for (int rep = 0; rep < 2; ++rep) {
    PutTiming t =
        Put(**c, llama, a.ingest_tokens, block_tokens, a.window, "ingest-" + std::to_string(rep));
    if (!t.ok) {
      std::fprintf(stderr, "ingest put failed: %s\n%s\n", t.error.c_str(), d.Log().c_str());
      return 1;
    }
    std::printf(
        "  - tokens: %llu\n    bytes: %llu\n    stored_bytes: %llu\n"
        "    receive_s: %.4f\n    receive_gbps: %.3f\n    put_s: %.4f\n"
        "    put_gbps: %.3f\n",
        static_cast<unsigned long long>(a.ingest_tokens), static_cast<unsigned long long>(t.bytes),
        static_cast<unsigned long long>(t.stored), t.received_s, t.bytes / t.received_s / 1e9,
        t.committed_s, t.bytes / t.committed_s / 1e9);
    std::fflush(stdout);
  }
  // Get latency of a 32K-token cache.
  PutTiming t = Put(**c, llama, a.tokens, block_tokens * 128, a.window, "get-target");
  if (!t.ok) {
    std::fprintf(stderr, "put for gets failed: %s\n", t.error.c_str());
    return 1;
  }
  std::vector<uint8_t> dst(t.stored);
  std::vector<double> lat;
  for (int i = 0; i < a.gets + 1; ++i) {
    Clock::time_point t0 = Clock::now();
    auto n = (*c)->GetInto("meta-llama/Llama-3.1-8B", "get-target", wire::Representation::kStored,
                           dst.data(), dst.size());
    double s = Since(t0);
    if (!n.ok() || *n != t.stored) {
      std::fprintf(stderr, "get failed: %s\n", n.status().ToString().c_str());
      return 1;
    }
    if (i > 0) lat.push_back(s);  // the first get warms up the registration
  }
  std::printf(
      "get:\n  tokens: %llu\n  original_bytes: %llu\n  stored_bytes: %llu\n"
      "  samples: %zu\n  p50_ms: %.2f\n  p99_ms: %.2f\n  min_ms: %.2f\n"
      "  max_ms: %.2f\n  p50_gbps: %.3f\n",
      static_cast<unsigned long long>(a.tokens),
      static_cast<unsigned long long>(llama.CacheBytes(a.tokens)),
      static_cast<unsigned long long>(t.stored), lat.size(), Percentile(lat, 0.5) * 1e3,
      Percentile(lat, 0.99) * 1e3, Percentile(lat, 0.0) * 1e3, Percentile(lat, 1.0) * 1e3,
      t.stored / Percentile(lat, 0.5) / 1e9);
  // Where the daemon spent its time, from its own histograms.
  std::string m = kvcomp::testing::HttpGet(d.ports().metrics, "/metrics").body;
  std::printf("daemon_stage_seconds_sum:\n");
  for (const char* stage : {"receive", "compress", "download", "store", "serve"}) {
    std::string series = std::string("kvcomp_stage_duration_seconds_sum{stage=\"") + stage + "\"}";
    std::printf("  %s: %.4f\n", stage, kvcomp::testing::MetricValue(m, series));
  }
  std::printf("daemon_backend: \"%s\"\n",
              d.Log().find("engine: cuda") != std::string::npos ? "cuda" : "cpu");
  c->reset();
  d.Kill(SIGTERM);
  return 0;
}
