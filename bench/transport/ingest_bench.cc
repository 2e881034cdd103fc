// Ingest throughput of the data plane: a client pushes 1 MiB blocks (K then V, 512 KiB each)
// through UcxClient to a UcxServer whose handler acknowledges each block at once, so the figure
// is the transport's own (framing, checksums, rendezvous, acknowledgements). Run as two
// processes, like ucx_perftest, by bench/transport/run.sh:
//
//   kvcomp_transport_bench server [--verify=1] [--peer_errors=1] [--shm_copy_lanes=0]
//                                                       prints "PORT <n>", serves until killed
//   kvcomp_transport_bench client <port> [--blocks=N] [--window=W] [--block_bytes=B]
//                                        [--peer_errors=1] [--shm_copy_lanes=0]
//   kvcomp_transport_bench server --get_bytes=B; client <port> --gets=N
//                                                       get latency p50/p99 of a B-byte cache
//                                                       prints "RESULT ... GBps=<x>"
//   client ... --link=shm                               the same through same-host shared
//                                                       memory (shm_link.h) instead of UCX
//   kvcomp_transport_bench stored <host:port> --tokens=T [--gets=N] [--link=shm|ucx]
//                                        [--modes=shm-direct,shm-regions,ucx]
//                                                       against a running kvcompd: puts one
//                                                       Llama-3.1-8B-shaped cache of T tokens
//                                                       (bf16, the daemon's default policy),
//                                                       then times gets of its stored bytes
//                                                       into caller memory
//   kvcomp_transport_bench crc                          one thread's CRC32C and memcpy GB/s
//                                                       over 1 MiB pieces out of the caches
//
// UCX_TLS etc. come from the environment.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/transport/client.h"
#include "kvcomp/transport/server.h"
#include "kvcomp/transport/shm_link.h"
#include "kvcomp/transport/ucx_link.h"

namespace kvcomp {
namespace transport {
namespace {

// Accepts everything; blocks are acknowledged as soon as they are received and verified.
class SinkHandler : public RequestHandler {
 public:
  absl::StatusOr<std::string> OnHello(const Session&, const wire::Hello& h) override {
    return h.tenant.empty() ? std::string("default") : h.tenant;
  }
  absl::Status OnPutBegin(const PutContext&) override { return absl::OkStatus(); }
  void OnBlock(const PutContext&, const wire::Block&, Buffer payload, Done done) override {
    done(absl::OkStatus());
  }
  void OnPutCommit(const PutContext& put, CommitDone done) override {
    wire::CacheSummary s;
    s.layout = put.begin->layout;
    s.original_tokens = put.begin->num_tokens;
    done(s);
  }
  void OnPutAbort(const PutContext&, const absl::Status&) override {}
  // Gets return `get_bytes` bytes (a fixed buffer, lent without a copy).
  void OnGet(const Session&, const wire::Get&, GetDone done) override {
    if (get_bytes_.empty()) {
      done(absl::NotFoundError("sink"));
      return;
    }
    GetResult r;
    r.bytes = Buffer::Wrap(get_bytes_.data(), get_bytes_.size(), MemoryType::kHost, nullptr);
    done(std::move(r));
  }
  void set_get_bytes(size_t n) { get_bytes_.assign(n, 0x5a); }
  void OnLookup(const Session&, const wire::Lookup&, LookupDone done) override {
    if (get_bytes_.empty()) {
      done(absl::NotFoundError("sink"));
      return;
    }
    wire::CacheSummary s;
    s.layout = KvLayout{32, 8, 32, 128, DType::kBF16};
    s.stored_bytes = get_bytes_.size();
    done(s);
  }
  void OnDelete(const Session&, const wire::Delete&, Done done) override {
    done(absl::NotFoundError("sink"));
  }

 private:
  std::vector<uint8_t> get_bytes_;
};

std::string StrFlag(int argc, char** argv, const char* name, const char* def) {
  const std::string prefix = std::string("--") + name + "=";
  for (int i = 0; i < argc; ++i) {
    if (absl::StartsWith(argv[i], prefix)) return argv[i] + prefix.size();
  }
  return def;
}

double Pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

uint64_t Flag(int argc, char** argv, const char* name, uint64_t def) {
  const std::string prefix = std::string("--") + name + "=";
  for (int i = 0; i < argc; ++i) {
    if (absl::StartsWith(argv[i], prefix)) {
      uint64_t v;
      if (absl::SimpleAtoi(argv[i] + prefix.size(), &v)) return v;
    }
  }
  return def;
}

int Server(int argc, char** argv) {
  ServerOptions o;
  o.verify_checksums = Flag(argc, argv, "verify", 1) != 0;
  o.ucx.peer_error_handling = Flag(argc, argv, "peer_errors", 1) != 0;
  o.put_timeout = absl::Minutes(5);
  o.shm_copy_lanes = static_cast<uint32_t>(Flag(argc, argv, "shm_copy_lanes", 0));
  SinkHandler handler;
  handler.set_get_bytes(Flag(argc, argv, "get_bytes", 0));
  absl::StatusOr<std::unique_ptr<UcxServer>> server = UcxServer::Start(o, &handler);
  if (!server.ok()) {
    std::fprintf(stderr, "server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("PORT %u\n", (*server)->port());
  std::fflush(stdout);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  int sig = 0;
  sigwait(&set, &sig);
  (*server)->Stop();
  return 0;
}

int Client(int argc, char** argv) {
  if (argc < 3) return 2;
  uint32_t port = 0;
  if (!absl::SimpleAtoi(argv[2], &port)) return 2;
  const uint64_t blocks = Flag(argc, argv, "blocks", 4096);
  const uint64_t window = Flag(argc, argv, "window", 16);
  const uint64_t warmup = Flag(argc, argv, "warmup", 128);
  // Llama-3.1-8B-shaped: 32 layers, 8 kv heads, head_dim 128, bf16; a block is one layer x
  // 256 tokens: 512 KiB of K and 512 KiB of V.
  KvLayout layout{32, 8, 32, 128, DType::kBF16};
  const uint64_t tokens_per_block = Flag(argc, argv, "block_bytes", 1 << 20) / 2 /
                                    layout.LayerBytes(1);
  const uint64_t blocks_per_layer = 32768 / tokens_per_block;
  const uint64_t blocks_per_put = blocks_per_layer * layout.num_layers;
  const uint64_t half = layout.LayerBytes(tokens_per_block);

  const bool shm = StrFlag(argc, argv, "link", "ucx") == "shm";
  ClientOptions co;
  co.request_timeout = absl::Seconds(60);
  co.ucx.peer_error_handling = Flag(argc, argv, "peer_errors", 1) != 0;
  co.shared_memory = shm;
  co.shm_direct = Flag(argc, argv, "shm_direct", 1) != 0;
  co.shm_copy_lanes = static_cast<uint32_t>(Flag(argc, argv, "shm_copy_lanes", 0));
  absl::StatusOr<std::unique_ptr<UcxClient>> c =
      UcxClient::Connect(Endpoint{"127.0.0.1", static_cast<uint16_t>(port)}, "bench", "", co);
  if (!c.ok()) {
    std::fprintf(stderr, "client: %s\n", c.status().ToString().c_str());
    return 1;
  }
  UcxClient& client = **c;
  ShmChannel* channel = shm ? client.SharedMemory() : nullptr;
  if (shm && channel == nullptr) {
    std::fprintf(stderr, "client: the server offers no shared memory\n");
    return 1;
  }
  if (channel != nullptr) {
    std::fprintf(stderr, "client: shared memory, %s, %d copy lanes\n",
                 channel->direct() ? "direct (one copy)" : "through the regions",
                 channel->copy_lanes());
  }
  if (const uint64_t gets = Flag(argc, argv, "gets", 0); shm && gets > 0) {
    // Through the get region: Get = into a fresh host buffer each time, GetInto = one reused.
    std::vector<double> ms, into_ms;
    std::vector<uint8_t> dst;
    const GetRequest request{"bench/llama-3.1-8b", "k", wire::Representation::kStored};
    uint64_t size = 0;
    {
      absl::StatusOr<FetchedCache> first = client.Get("bench/llama-3.1-8b", "k");
      if (!first.ok()) return 1;
      size = first->bytes.size();
    }
    dst.resize(size);
    for (uint64_t i = 0; i < gets + 1; ++i) {
      auto t = std::chrono::steady_clock::now();
      Buffer fresh = Buffer::Allocate(size);
      absl::StatusOr<uint64_t> n0 =
          channel->GetInto(request, fresh.data(), size, absl::InfiniteFuture());
      const double a =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
      t = std::chrono::steady_clock::now();
      absl::StatusOr<uint64_t> n =
          channel->GetInto(request, dst.data(), dst.size(), absl::InfiniteFuture());
      const double b =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
      if (!n0.ok() || !n.ok()) {
        std::fprintf(stderr, "shm get: %s\n",
                     (!n0.ok() ? n0.status() : n.status()).ToString().c_str());
        return 1;
      }
      if (i > 0) {
        ms.push_back(a);
        into_ms.push_back(b);
      }
    }
    std::printf("RESULT get_bytes=%zu gets=%llu get_p50_ms=%.2f get_p99_ms=%.2f "
                "getinto_p50_ms=%.2f getinto_p99_ms=%.2f\n",
                dst.size(), static_cast<unsigned long long>(gets), Pct(ms, 0.5), Pct(ms, 0.99),
                Pct(into_ms, 0.5), Pct(into_ms, 0.99));
    return 0;
  }
  if (const uint64_t gets = Flag(argc, argv, "gets", 0); gets > 0) {
    // Get latency: the server lends a fixed cache of --get_bytes; each get allocates a fresh
    // host buffer (as Get does), GetInto reuses one.
    std::vector<double> ms, into_ms;
    std::vector<uint8_t> dst;
    for (uint64_t i = 0; i < gets + 1; ++i) {
      auto t = std::chrono::steady_clock::now();
      absl::StatusOr<FetchedCache> got = client.Get("bench/llama-3.1-8b", "k");
      const double a =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
      if (!got.ok()) {
        std::fprintf(stderr, "get: %s\n", got.status().ToString().c_str());
        return 1;
      }
      dst.resize(got->bytes.size());
      t = std::chrono::steady_clock::now();
      absl::StatusOr<size_t> n = client.GetInto("bench/llama-3.1-8b", "k",
                                                wire::Representation::kStored, dst.data(),
                                                dst.size());
      const double b =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
      if (!n.ok()) return 1;
      if (i > 0) {  // the first of each warms up
        ms.push_back(a);
        into_ms.push_back(b);
      }
    }
    auto pct = [](std::vector<double> v, double p) {
      std::sort(v.begin(), v.end());
      return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
    };
    std::printf("RESULT get_bytes=%zu gets=%llu get_p50_ms=%.2f get_p99_ms=%.2f "
                "getinto_p50_ms=%.2f getinto_p99_ms=%.2f\n",
                dst.size(), static_cast<unsigned long long>(gets), pct(ms, 0.5), pct(ms, 0.99),
                pct(into_ms, 0.5), pct(into_ms, 0.99));
    return 0;
  }
  // A few distinct source buffers, K and V adjacent (one contiguous 1 MiB payload).
  std::vector<std::vector<uint8_t>> sources(4, std::vector<uint8_t>(2 * half));
  for (size_t s = 0; s < sources.size(); ++s) {
    for (size_t i = 0; i < sources[s].size(); ++i) sources[s][i] = static_cast<uint8_t>(i * 7 + s);
  }

  struct Window {
    uint64_t inflight = 0;
    uint64_t limit = 0;
    absl::Status first;
  } w;
  w.limit = window;
  absl::Mutex mu;
  uint64_t put_id = 0, in_put = 0, sent_total = 0;
  auto begin_put = [&]() -> bool {
    wire::PutBegin b;
    b.layout = layout;
    b.num_tokens = 32768;
    b.model_id = "bench/llama-3.1-8b";
    b.key = "seq-" + std::to_string(sent_total);
    absl::StatusOr<uint64_t> id = client.PutBegin(b);
    if (!id.ok()) {
      std::fprintf(stderr, "put-begin: %s\n", id.status().ToString().c_str());
      return false;
    }
    put_id = *id;
    in_put = 0;
    return true;
  };
  auto drain = [&] {
    absl::MutexLock l(&mu);
    mu.Await(absl::Condition(+[](Window* x) { return x->inflight == 0; }, &w));
  };
  auto commit = [&]() -> bool {
    drain();
    absl::StatusOr<wire::CacheSummary> s = client.PutCommit(put_id, in_put);
    if (!s.ok()) {
      std::fprintf(stderr, "commit: %s\n", s.status().ToString().c_str());
      return false;
    }
    return true;
  };
  auto run = [&](uint64_t n) -> bool {
    for (uint64_t i = 0; i < n; ++i) {
      if (in_put == blocks_per_put) {
        if (!commit() || !begin_put()) return false;
      }
      const uint64_t k = in_put;
      wire::Block b;
      b.put_id = put_id;
      b.layer_begin = static_cast<uint32_t>(k / blocks_per_layer);
      b.layer_end = b.layer_begin + 1;
      b.token_begin = (k % blocks_per_layer) * tokens_per_block;
      b.token_end = b.token_begin + tokens_per_block;
      b.key_bytes = b.value_bytes = half;
      const uint8_t* src = sources[sent_total % sources.size()].data();
      {
        absl::MutexLock l(&mu);
        mu.Await(absl::Condition(+[](Window* x) { return x->inflight < x->limit; }, &w));
        if (!w.first.ok()) break;
        ++w.inflight;
      }
      auto finished = [&](const absl::Status& s) {
        absl::MutexLock l(&mu);
        if (!s.ok() && w.first.ok()) w.first = s;
        --w.inflight;
      };
      if (channel != nullptr) {
        absl::StatusOr<std::shared_ptr<Completion>> posted =
            channel->SendBlock(b, {const_cast<uint8_t*>(src), half, MemoryKind::kHost},
                               {const_cast<uint8_t*>(src) + half, half, MemoryKind::kHost},
                               absl::InfiniteFuture());
        if (!posted.ok()) {
          finished(posted.status());
        } else {
          (*posted)->Then(finished);
        }
      } else {
        client.SendBlockAsync(b, src, src + half, [finished](absl::Status s) { finished(s); });
      }
      ++in_put;
      ++sent_total;
    }
    drain();
    if (!w.first.ok()) {
      std::fprintf(stderr, "block: %s\n", w.first.ToString().c_str());
      return false;
    }
    return true;
  };
  if (!begin_put() || !run(warmup)) return 1;
  const auto t0 = std::chrono::steady_clock::now();
  if (!run(blocks)) return 1;
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!commit()) return 1;
  const double bytes = static_cast<double>(blocks) * 2 * half;
  std::printf(
      "RESULT blocks=%llu block_bytes=%llu window=%llu seconds=%.3f GBps=%.3f MiBps=%.1f\n",
              static_cast<unsigned long long>(blocks),
              static_cast<unsigned long long>(2 * half),
              static_cast<unsigned long long>(window), secs, bytes / secs / 1e9,
              bytes / secs / 1048576.0);
  return 0;
}

// A stored cache through a running kvcompd: put once (the daemon's default policy), then gets of
// its stored bytes into one reused host buffer over each link.
int Stored(int argc, char** argv) {
  if (argc < 3) return 2;
  absl::StatusOr<Endpoint> ep = Endpoint::Parse(argv[2]);
  if (!ep.ok()) return 2;
  const uint64_t tokens = Flag(argc, argv, "tokens", 8192);
  const uint64_t gets = Flag(argc, argv, "gets", 10);
  // Which links the gets take: a comma-separated subset of shm-direct, shm-regions, ucx.
  const std::string modes = StrFlag(argc, argv, "modes", "shm-direct,shm-regions,ucx");
  const KvLayout layout{32, 8, 32, 128, DType::kBF16};
  auto connect = [&](bool shm, bool direct = true) -> std::unique_ptr<UcxClient> {
    ClientOptions co;
    co.request_timeout = absl::Minutes(10);
    co.shared_memory = shm;
    co.shm_direct = direct;
    absl::StatusOr<std::unique_ptr<UcxClient>> c = UcxClient::Connect(*ep, "", "", co);
    if (!c.ok()) {
      std::fprintf(stderr, "connect: %s\n", c.status().ToString().c_str());
      return nullptr;
    }
    return *std::move(c);
  };
  std::unique_ptr<UcxClient> over_shm = connect(true);
  std::unique_ptr<UcxClient> over_ucx = connect(false);
  std::unique_ptr<UcxClient> over_regions = connect(true, false);
  if (over_shm == nullptr || over_ucx == nullptr || over_regions == nullptr) return 1;
  if (over_shm->SharedMemory() == nullptr) {
    std::fprintf(stderr, "stored: the daemon offers no shared memory\n");
    return 1;
  }
  // Finite bf16 values in (-2, 2), one layer's K and V, reused for every layer.
  const uint64_t part = layout.LayerBytes(tokens);
  std::vector<uint16_t> kv(part);  // K then V, part bytes each
  uint32_t x = 12345;
  for (uint16_t& v : kv) {
    x = x * 1664525u + 1013904223u;
    float f = (static_cast<float>(x >> 8) / 16777216.0f) * 4.0f - 2.0f;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>(bits >> 16);
  }
  const uint8_t* keys = reinterpret_cast<const uint8_t*>(kv.data());
  const uint8_t* values = keys + part;
  wire::PutBegin begin;
  begin.layout = layout;
  begin.num_tokens = tokens;
  begin.model_id = "bench/llama-3.1-8b";
  begin.key = "stored-" + std::to_string(tokens);
  absl::StatusOr<uint64_t> put = over_shm->PutBegin(begin);
  if (!put.ok()) {
    std::fprintf(stderr, "put-begin: %s\n", put.status().ToString().c_str());
    return 1;
  }
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t sent = 0;
  LinkKind put_link = LinkKind::kUcxHost;
  {
    const UcxLinks links(over_shm.get());
    BlockPipe pipe(links, uint64_t{64} << 20);
    const uint64_t row = layout.head_dim * 2;
    const uint64_t chunk = 1024;  // tokens per block: 2 MiB of K and of V
    std::vector<std::shared_ptr<std::string>> keep;
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
      for (uint64_t t = 0; t < tokens; t += chunk) {
        const uint64_t n = std::min(chunk, tokens - t);
        auto packed = std::make_shared<std::string>(2 * layout.LayerBytes(n), '\0');
        char* dk = packed->data();
        char* dv = dk + layout.LayerBytes(n);
        for (uint32_t h = 0; h < layout.num_kv_heads; ++h) {
          const uint64_t src = (uint64_t{h} * tokens + t) * row;
          std::memcpy(dk + h * n * row, keys + src, n * row);
          std::memcpy(dv + h * n * row, values + src, n * row);
        }
        wire::Block b;
        b.put_id = *put;
        b.layer_begin = l;
        b.layer_end = l + 1;
        b.token_begin = t;
        b.token_end = t + n;
        b.key_bytes = b.value_bytes = layout.LayerBytes(n);
        pipe.Send(b, {dk, b.key_bytes, MemoryKind::kHost}, {dv, b.value_bytes, MemoryKind::kHost},
                  packed);
      }
    }
    if (absl::Status s = pipe.Wait(); !s.ok()) {
      std::fprintf(stderr, "put: %s\n", s.ToString().c_str());
      return 1;
    }
    sent = pipe.sent();
    put_link = pipe.link();
  }
  absl::StatusOr<wire::CacheSummary> sum = over_shm->PutCommit(*put, sent);
  if (!sum.ok()) {
    std::fprintf(stderr, "commit: %s\n", sum.status().ToString().c_str());
    return 1;
  }
  const double put_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("PUT tokens=%llu original_bytes=%llu stored_bytes=%llu link=%s seconds=%.2f\n",
              static_cast<unsigned long long>(tokens),
              static_cast<unsigned long long>(sum->original_bytes),
              static_cast<unsigned long long>(sum->stored_bytes),
              std::string(LinkName(put_link)).c_str(), put_s);
  std::vector<uint8_t> dst(sum->stored_bytes);
  const GetRequest request{begin.model_id, begin.key, wire::Representation::kStored};
  for (UcxClient* c : {over_shm.get(), over_regions.get(), over_ucx.get()}) {
    const UcxLinks links(c);
    const char* mode = c == over_ucx.get()       ? "ucx"
                       : c == over_regions.get() ? "shm-regions"
                       : (c->SharedMemory() != nullptr && c->SharedMemory()->direct())
                           ? "shm-direct"
                           : "shm-regions";
    if (!absl::StrContains(absl::StrCat(",", modes, ","), absl::StrCat(",", mode, ","))) continue;
    std::vector<double> ms;
    LinkKind used = LinkKind::kUcxHost;
    for (uint64_t i = 0; i < gets + 1; ++i) {
      const auto t = std::chrono::steady_clock::now();
      absl::StatusOr<uint64_t> n = links.GetInto(
          request, {dst.data(), dst.size(), MemoryKind::kHost}, absl::InfiniteFuture(), &used);
      const double a =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
      if (!n.ok() || *n != dst.size()) {
        std::fprintf(stderr, "get: %s\n", n.ok() ? "short" : n.status().ToString().c_str());
        return 1;
      }
      if (i > 0) ms.push_back(a);
    }
    std::printf("RESULT stored_bytes=%llu link=%s mode=%s gets=%llu p50_ms=%.2f p99_ms=%.2f\n",
                static_cast<unsigned long long>(dst.size()), std::string(LinkName(used)).c_str(),
                mode,
                static_cast<unsigned long long>(gets), Pct(ms, 0.5), Pct(ms, 0.99));
    // Get: into a new buffer each time, its size unknown beforehand (the SDK's Get/GetBytes).
    ms.clear();
    for (uint64_t i = 0; i < gets + 1; ++i) {
      const auto t = std::chrono::steady_clock::now();
      absl::StatusOr<FetchedCache> got = c->Get(begin.model_id, begin.key);
      const double a =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
      if (!got.ok() || got->bytes.size() != dst.size()) {
        std::fprintf(stderr, "get: %s\n",
                     got.ok() ? "short" : got.status().ToString().c_str());
        return 1;
      }
      if (i > 0) ms.push_back(a);
    }
    std::printf(
        "RESULT stored_bytes=%llu call=get mode=%s gets=%llu p50_ms=%.2f p99_ms=%.2f\n",
        static_cast<unsigned long long>(dst.size()), mode, static_cast<unsigned long long>(gets),
        Pct(ms, 0.5), Pct(ms, 0.99));
  }
  over_shm->Delete(begin.model_id, begin.key).IgnoreError();
  return 0;
}

// One thread's CRC32C and memcpy rates over 1 MiB pieces of 256 MiB buffers (out of the
// caches, as a block's bytes are): what one core spends per block on either end.
int CrcSpeed() {
  const size_t piece = 1 << 20, span = size_t{256} << 20;
  std::vector<uint8_t> src(span), dst(span);
  for (size_t i = 0; i < span; i += 4096) src[i] = static_cast<uint8_t>(i >> 12);
  std::memset(dst.data(), 1, span);  // both faulted in before timing
  const int n = 2048;
  uint32_t acc = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) acc ^= Crc32c(src.data() + (i * piece) % span, piece);
  const double crc = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    std::memcpy(dst.data() + (i * piece) % span, src.data() + ((i + 7) * piece) % span, piece);
  }
  const double copy =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("RESULT crc32c_GBps=%.3f memcpy_GBps=%.3f (checksum %08x, %02x)\n",
              n * static_cast<double>(piece) / crc / 1e9,
              n * static_cast<double>(piece) / copy / 1e9, acc, dst[12345]);
  return 0;
}

}  // namespace
}  // namespace transport
}  // namespace kvcomp

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "server") == 0) {
    return kvcomp::transport::Server(argc, argv);
  }
  if (argc >= 2 && std::strcmp(argv[1], "client") == 0) {
    return kvcomp::transport::Client(argc, argv);
  }
  if (argc >= 2 && std::strcmp(argv[1], "crc") == 0) return kvcomp::transport::CrcSpeed();
  if (argc >= 2 && std::strcmp(argv[1], "stored") == 0) return kvcomp::transport::Stored(argc, argv);
  std::fprintf(stderr, "usage: %s server [--verify=0|1] | client <port> [--blocks=N] "
                       "[--window=W] [--block_bytes=B] | crc\n", argv[0]);
  return 2;
}
