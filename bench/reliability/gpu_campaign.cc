// Faults on the GPU links, against a real kvcompd on a GPU machine, through the C++ SDK's device
// calls (Client::PutDevice, GetKvIntoDevice). Run by bench/gpu/run.sh (daemon step, part
// "faults") from the GPU bundle; exits 77 where the machine lacks the GPUs a link needs.
//
//   kvcomp_gpu_campaign --dir=DIR [--kvcompd=PATH] [--links=nccl,ipc] [--seconds=120]
//
// For each link, one kvcompd (NCCL: the daemon on GPU 1 and every client on GPU 0; IPC: both on
// GPU 0) and for `--seconds`:
// - a healthy client puts small lossless caches from device memory (2 layers, 2 kv heads, 32
//   tokens, d 128, bf16: 64 KiB of K and V), gets each back into other device memory and
//   compares the bytes; every 16th round trip also reads back an older cache; a bounded window
//   of its caches stays stored (the oldest deleted);
// - meanwhile the fault loop runs other client processes (this binary, --mode=child) and cuts
//   them, in turn: (0) SIGKILL at a random moment of a series of device puts (while the channel
//   opens, the NCCL communicator joins, the payload moves, or the put commits), (1) SIGKILL at
//   a random moment of a series of device gets of a cache that must survive them, (2) SIGSTOP
//   in the middle of its puts, held past the daemon's GPU transfer timeout, then SIGKILL.
//   After each cut: every put the child saw acknowledged is served byte for byte, every other
//   put is served whole or is a miss (never partial), the cache the gets read is unchanged,
//   kvcomp puts in progress come back to 0 (the time it took is recorded), the daemon runs, and
//   during a stall the healthy client keeps being served.
// Counts: round trips, reads, faults by kind, wrong outputs (must be 0), clean errors, misses.
// Exit status 1 on a wrong output, a daemon that died, a put never released or a healthy client
// starved; 0 otherwise.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "integration/kvcompd_process.h"
#include "kvcomp/client/client.h"
#include "kvcomp/transport/gpu_link.h"

namespace kvcomp {
namespace {

using Clock = std::chrono::steady_clock;
using client::Client;
using client::DeviceLayerData;
using client::DeviceLayerOut;
using testing::KvcompdProcess;
using transport::GpuRuntime;

struct Flags {
  std::string mode = "campaign";
  std::string kvcompd = KVCOMPD_PATH;
  std::string dir;
  std::vector<std::string> links = {"nccl", "ipc"};
  double seconds = 120;
  uint64_t seed = 1;
  int window = 64;
  // child mode
  std::string endpoint, op, key;
  int device = 0, count = 0;
};

KvLayout Bf16Layout(uint32_t layers, uint32_t kv_heads, uint32_t q_heads) {
  KvLayout l;
  l.num_layers = layers;
  l.num_kv_heads = kv_heads;
  l.num_q_heads = q_heads;
  l.head_dim = 128;
  l.dtype = DType::kBF16;
  return l;
}
// The healthy client's caches: 64 KiB of K and V.
KvLayout SmallLayout() { return Bf16Layout(2, 2, 8); }
constexpr uint64_t kSmallTokens = 32;
// The cut clients' caches: 32 MiB, a transfer that takes some time.
KvLayout ChildLayout() { return Bf16Layout(4, 8, 32); }
constexpr uint64_t kChildTokens = 2048;

size_t TotalBytes(const KvLayout& l, uint64_t tokens) {
  return 2 * static_cast<size_t>(l.num_layers) * l.LayerBytes(tokens);
}

// Finite bf16 values from `seed`: K layers then V layers.
std::string Content(uint64_t seed, size_t bytes) {
  std::string out(bytes, '\0');
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i + 1 < bytes; i += 2) {
    const uint32_t r = static_cast<uint32_t>(rng());
    const uint16_t bf = static_cast<uint16_t>((r & 0x8000u) | ((0x70u + (r >> 16) % 32) << 7) |
                                              (r & 0x7Fu));
    std::memcpy(&out[i], &bf, 2);
  }
  return out;
}

uint64_t SeedOf(const std::string& key) { return std::hash<std::string>()(key) | 1; }

// Device memory for one cache of `layout` and `tokens` on `device`, with its layer views.
class DeviceCache {
 public:
  DeviceCache(GpuRuntime* rt, int device, const KvLayout& layout, uint64_t tokens)
      : rt_(rt), layout_(layout), layer_(layout.LayerBytes(tokens)) {
    ok_ = rt->SetDevice(device).ok();
    auto p = rt->AllocDevice(TotalBytes(layout, tokens));
    ok_ = ok_ && p.ok();
    if (p.ok()) base_ = static_cast<char*>(*p);
  }
  ~DeviceCache() {
    if (base_ != nullptr) rt_->FreeDevice(base_);
  }
  bool ok() const { return ok_; }
  size_t bytes() const { return 2 * layout_.num_layers * layer_; }
  std::vector<DeviceLayerData> In() const {
    std::vector<DeviceLayerData> v;
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      v.push_back({base_ + l * layer_, base_ + (layout_.num_layers + l) * layer_});
    }
    return v;
  }
  std::vector<DeviceLayerOut> Out() const {
    std::vector<DeviceLayerOut> v;
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      v.push_back({base_ + l * layer_, base_ + (layout_.num_layers + l) * layer_});
    }
    return v;
  }
  absl::Status Upload(const std::string& host, void* stream) {
    if (auto s = rt_->CopyAsync(base_, host.data(), host.size(),
                                GpuRuntime::Copy::kHostToDevice, stream);
        !s.ok()) {
      return s;
    }
    return rt_->WaitStream(stream, absl::Now() + absl::Seconds(30));
  }
  absl::StatusOr<std::string> Download(void* stream) {
    std::string out(bytes(), '\0');
    if (auto s = rt_->CopyAsync(out.data(), base_, out.size(),
                                GpuRuntime::Copy::kDeviceToHost, stream);
        !s.ok()) {
      return s;
    }
    if (auto s = rt_->WaitStream(stream, absl::Now() + absl::Seconds(30)); !s.ok()) return s;
    return out;
  }
  // Poisons the memory so that a get that writes nothing cannot pass for a good one.
  absl::Status Poison(void* stream) { return Upload(std::string(bytes(), '\x5a'), stream); }

 private:
  GpuRuntime* rt_;
  KvLayout layout_;
  size_t layer_;
  char* base_ = nullptr;
  bool ok_ = false;
};

CompressionPolicy Lossless() {
  CompressionPolicy p;
  p.ratio = 0;
  p.moments = false;
  return p;
}

std::unique_ptr<Client> Connect(const std::string& endpoint) {
  client::ClientOptions o;
  o.tenant = "alpha";
  o.token = "secret-a";
  o.request_timeout = absl::Seconds(20);
  o.ucx_overrides = {{"TLS", "tcp"}};
  auto c = Client::Connect({endpoint}, o);
  if (!c.ok()) {
    std::fprintf(stderr, "connect %s: %s\n", endpoint.c_str(), c.status().ToString().c_str());
    return nullptr;
  }
  return std::move(*c);
}

// ---------------------------------------------------------------------------------------------
// child mode: a client process the campaign cuts. op "put": `count` device puts of the child
// layout under KEY-0, KEY-1, ...; op "get": `count` dense gets of KEY into device memory. It
// says each step on stdout ("connected", "acked N", "got N") as soon as it is done.
int Child(const Flags& f) {
  auto rt = GpuRuntime::Get();
  if (!rt.ok()) return 2;
  auto c = Connect(f.endpoint);
  if (c == nullptr) return 1;
  if (!(*rt)->SetDevice(f.device).ok()) return 1;
  auto stream = (*rt)->NewStream();
  if (!stream.ok()) return 1;
  std::printf("connected\n");
  std::fflush(stdout);
  const KvLayout layout = ChildLayout();
  DeviceCache buf(*rt, f.device, layout, kChildTokens);
  if (!buf.ok()) return 1;
  client::PutOptions po;
  po.policy = Lossless();
  for (int i = 0; i < f.count; ++i) {
    if (f.op == "put") {
      const std::string key = f.key + "-" + std::to_string(i);
      if (!buf.Upload(Content(SeedOf(key), buf.bytes()), *stream).ok()) return 1;
      auto put = c->PutDevice("m", key, layout, kChildTokens, buf.In(), *stream, po);
      if (!put.ok()) {
        std::printf("error %d %s\n", i, put.status().ToString().c_str());
      } else {
        std::printf("acked %d %s\n", i, put->path.c_str());
      }
    } else {
      auto got = c->GetKvIntoDevice("m", f.key, layout, kChildTokens, buf.Out(), *stream);
      std::printf(got.ok() ? "got %d\n" : "error %d\n", i);
    }
    std::fflush(stdout);
  }
  while (true) pause();  // the campaign kills it
}

// ---------------------------------------------------------------------------------------------
// campaign

struct Counts {
  uint64_t round_trips = 0, reads = 0, wrong = 0, errors = 0, misses = 0;
  uint64_t faults[3] = {0, 0, 0};
  uint64_t child_acked = 0, child_unacked_whole = 0, child_unacked_missing = 0;
  uint64_t transfers_aborted = 0, starved = 0, not_released = 0, daemon_died = 0;
  std::vector<double> release_ms, rt_ms, stall_rt_ms;
  std::map<std::string, uint64_t> paths;
  std::vector<std::string> problems, error_samples;
};

double Pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

class Campaign {
 public:
  Campaign(const Flags& f, const char* self, GpuRuntime* rt, std::string link)
      : f_(f), self_(self), rt_(rt), link_(std::move(link)),
        daemon_device_(link_ == "nccl" ? 1 : 0) {}

  // The daemon (its data directory and log under DIR/LINK) and the cycles; the counts in `*out`.
  int Run(Counts* out) {
    std::filesystem::create_directories(f_.dir + "/" + link_);
    std::ofstream(f_.dir + "/" + link_ + "/tokens.yaml") << "alpha: secret-a\n";
    d_ = std::make_unique<KvcompdProcess>(
        f_.kvcompd, f_.dir + "/" + link_ + "/data",
        std::vector<std::string>{"--auth.token_file=" + f_.dir + "/" + link_ + "/tokens.yaml",
                                 "--engine.cuda_device=" + std::to_string(daemon_device_),
                                 "--data_plane.gpu_transfer_timeout_seconds=3",
                                 "--storage.durability=memory"});
    d_->SetEnv("NCCL_NVLS_ENABLE=0");
    if (!d_->Start(60)) {
      std::fprintf(stderr, "kvcompd did not start:\n%s\n", d_->Log().c_str());
      return 1;
    }
    healthy_ = Connect(d_->client_endpoint());
    checker_ = Connect(d_->client_endpoint());
    if (healthy_ == nullptr || checker_ == nullptr) return 1;
    std::thread worker([this] { Healthy(); });
    std::mt19937_64 rng(f_.seed);
    const auto t0 = Clock::now();
    for (int cycle = 0; Seconds(t0) < f_.seconds; ++cycle) {
      if (!d_->running()) {
        Problem("kvcompd died", &c_.daemon_died);
        break;
      }
      const int kind = cycle % 3;
      if (kind == 1) {
        CutGets(cycle, rng);
      } else {
        CutPuts(cycle, rng, kind == 2);
      }
      ++c_.faults[kind];
      WaitReleased();
    }
    stop_ = true;
    worker.join();
    // Every cache the healthy client still holds, once more.
    std::map<std::string, uint64_t> live;
    {
      std::lock_guard<std::mutex> l(mu_);
      live = live_;
    }
    for (const auto& [key, seed] : live) CheckSmall(key, seed);
    const std::string log = d_->Log();
    for (size_t at = log.find("transfer timed out"); at != std::string::npos;
         at = log.find("transfer timed out", at + 1)) {
      ++c_.transfers_aborted;
    }
    if (!d_->running()) Problem("kvcompd died", &c_.daemon_died);
    *out = c_;
    return 0;
  }

 private:
  static double Seconds(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }
  void Problem(const std::string& what, uint64_t* counter = nullptr) {
    std::lock_guard<std::mutex> l(mu_);
    if (counter != nullptr) ++*counter;
    if (c_.problems.size() < 20) c_.problems.push_back(what);
    std::fprintf(stderr, "[%s] %s\n", link_.c_str(), what.c_str());
  }
  void Error(const std::string& what) {
    std::lock_guard<std::mutex> l(mu_);
    ++c_.errors;
    if (c_.error_samples.size() < 10) c_.error_samples.push_back(what);
  }

  // The healthy client's loop (its own thread and stream).
  void Healthy() {
    const KvLayout layout = SmallLayout();
    if (!rt_->SetDevice(0).ok()) return;
    auto stream = rt_->NewStream();
    if (!stream.ok()) return;
    DeviceCache in(rt_, 0, layout, kSmallTokens), out(rt_, 0, layout, kSmallTokens);
    std::deque<std::string> order;
    client::PutOptions po;
    po.policy = Lossless();
    std::mt19937_64 rng(f_.seed * 7919);
    for (uint64_t i = 0; !stop_; ++i) {
      const std::string key = "h-" + std::to_string(i);
      const uint64_t seed = rng();
      const std::string bytes = Content(seed, in.bytes());
      const auto t0 = Clock::now();
      if (!in.Upload(bytes, *stream).ok() || !out.Poison(*stream).ok()) {
        Problem("device copy failed in the healthy client");
        return;
      }
      auto put = healthy_->PutDevice("m", key, layout, kSmallTokens, in.In(), *stream, po);
      if (!put.ok()) {
        Error("healthy put: " + put.status().ToString());
        continue;
      }
      auto got = healthy_->GetKvIntoDevice("m", key, layout, kSmallTokens, out.Out(), *stream);
      if (!got.ok()) {
        Error("healthy get: " + got.status().ToString());
        continue;
      }
      auto back = out.Download(*stream);
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      {
        std::lock_guard<std::mutex> l(mu_);
        ++c_.round_trips;
        ++c_.paths[put->path + "/" + got->path];
        c_.rt_ms.push_back(ms);
        if (stalled_) c_.stall_rt_ms.push_back(ms);
        live_[key] = seed;
      }
      if (!back.ok() || *back != bytes) Problem("wrong bytes in a round trip of " + key, &c_.wrong);
      order.push_back(key);
      if (static_cast<int>(order.size()) > f_.window) {
        if (healthy_->Delete("m", order.front()).ok()) {
          std::lock_guard<std::mutex> l(mu_);
          live_.erase(order.front());
        }
        order.pop_front();
      }
      if (i % 16 == 15) {
        const std::string& old = order[rng() % order.size()];
        uint64_t old_seed;
        {
          std::lock_guard<std::mutex> l(mu_);
          old_seed = live_.count(old) ? live_[old] : 0;
        }
        if (old_seed != 0 && !ReadBack(*healthy_, old, old_seed, out, *stream, "read-back")) {
          Problem("device copy failed in the healthy client");
          return;
        }
      }
    }
    rt_->DestroyStream(*stream);
  }

  // A small cache read back through `c` into `out` (poisoned first) and compared with the bytes
  // of `seed`: counted as a read, a clean error or a wrong output (`what` names the read). False
  // only where the device copies themselves failed.
  bool ReadBack(Client& c, const std::string& key, uint64_t seed, DeviceCache& out, void* stream,
                const std::string& what) {
    if (!out.Poison(stream).ok()) return false;
    auto got = c.GetKvIntoDevice("m", key, SmallLayout(), kSmallTokens, out.Out(), stream);
    if (!got.ok()) {
      Error(what + " of " + key + ": " + got.status().ToString());
      return true;
    }
    auto b = out.Download(stream);
    std::lock_guard<std::mutex> l(mu_);
    ++c_.reads;
    if (!b.ok() || *b != Content(seed, out.bytes())) {
      ++c_.wrong;
      c_.problems.push_back("wrong bytes in the " + what + " of " + key);
    }
    return b.ok();
  }

  void CheckSmall(const std::string& key, uint64_t seed) {
    if (!rt_->SetDevice(0).ok()) return;
    auto stream = rt_->NewStream();
    if (!stream.ok()) return;
    DeviceCache out(rt_, 0, SmallLayout(), kSmallTokens);
    if (!ReadBack(*checker_, key, seed, out, *stream, "final read")) {
      Problem("device copy failed in the final read of " + key);
    }
    rt_->DestroyStream(*stream);
  }

  // A child cache under `key`: "whole" (served byte for byte), "miss", or "error" (a clean
  // error); a wrong or partial cache counts as wrong.
  std::string CheckChild(const std::string& key) {
    const KvLayout layout = ChildLayout();
    if (!rt_->SetDevice(0).ok()) return "error";
    auto stream = rt_->NewStream();
    if (!stream.ok()) return "error";
    DeviceCache out(rt_, 0, layout, kChildTokens);
    std::string verdict = "error";
    if (out.ok() && out.Poison(*stream).ok()) {
      auto got = checker_->GetKvIntoDevice("m", key, layout, kChildTokens, out.Out(), *stream);
      if (absl::IsNotFound(got.status())) {
        verdict = "miss";
      } else if (!got.ok()) {
        Error("checking " + key + ": " + got.status().ToString());
      } else {
        auto b = out.Download(*stream);
        if (b.ok() && *b == Content(SeedOf(key), out.bytes())) {
          verdict = "whole";
        } else {
          Problem("wrong bytes served for " + key, &c_.wrong);
          verdict = "wrong";
        }
      }
    }
    rt_->DestroyStream(*stream);
    return verdict;
  }

  // Starts a child; its stdout comes back through `*fd`.
  pid_t Spawn(const std::string& op, const std::string& key, int count, int* fd) {
    int p[2];
    if (pipe(p) != 0) return -1;
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(p[1], STDOUT_FILENO);
      close(p[0]);
      const std::string a[] = {"--mode=child", "--endpoint=" + d_->client_endpoint(),
                               "--op=" + op, "--key=" + key, "--count=" + std::to_string(count),
                               "--device=0"};
      execl(self_, self_, a[0].c_str(), a[1].c_str(), a[2].c_str(), a[3].c_str(), a[4].c_str(),
            a[5].c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(p[1]);
    *fd = p[0];
    return pid;
  }
  static void ReadFor(int fd, int ms, std::string* said) {
    const auto end = Clock::now() + std::chrono::milliseconds(ms);
    while (Clock::now() < end) {
      const int left = static_cast<int>(
          std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count());
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, std::max(left, 1)) <= 0) continue;
      char buf[512];
      const ssize_t n = read(fd, buf, sizeof(buf));
      if (n <= 0) return;
      said->append(buf, static_cast<size_t>(n));
    }
  }
  // Waits until the child said `what` (or `ms` passed).
  static bool ReadUntil(int fd, const std::string& what, int ms, std::string* said) {
    const auto end = Clock::now() + std::chrono::milliseconds(ms);
    while (said->find(what) == std::string::npos && Clock::now() < end) ReadFor(fd, 20, said);
    return said->find(what) != std::string::npos;
  }

  // Kind 0 (kill) and 2 (stall, then kill): a child's series of puts cut at a random moment.
  void CutPuts(int cycle, std::mt19937_64& rng, bool stall) {
    const std::string key = "cut-" + std::to_string(cycle);
    constexpr int kPuts = 3;
    int fd = -1;
    const pid_t pid = Spawn("put", key, kPuts, &fd);
    if (pid < 0) return;
    std::string said;
    ReadUntil(fd, "connected", 20000, &said);
    // The first put opens the channel (and joins the communicator): a random moment within
    // the first two seconds lands in any of its steps or a later put.
    ReadFor(fd, static_cast<int>(rng() % 2000), &said);
    if (stall) {
      kill(pid, SIGSTOP);
      const uint64_t before = RoundTrips();
      {
        std::lock_guard<std::mutex> l(mu_);
        stalled_ = true;
      }
      std::this_thread::sleep_for(std::chrono::seconds(5));  // past the 3 s transfer timeout
      {
        std::lock_guard<std::mutex> l(mu_);
        stalled_ = false;
      }
      if (RoundTrips() == before) {
        Problem("the healthy client was not served while a peer was stalled (cycle " +
                    std::to_string(cycle) + ")",
                &c_.starved);
      }
    }
    kill(pid, SIGKILL);
    if (stall) kill(pid, SIGCONT);
    waitpid(pid, nullptr, 0);
    ReadFor(fd, 10, &said);
    close(fd);
    for (int i = 0; i < kPuts; ++i) {
      const std::string k = key + "-" + std::to_string(i);
      const bool acked = said.find("acked " + std::to_string(i) + " ") != std::string::npos;
      const std::string v = CheckChild(k);
      std::lock_guard<std::mutex> l(mu_);
      if (acked) {
        ++c_.child_acked;
        if (v == "miss") {
          ++c_.wrong;
          c_.problems.push_back("an acknowledged put is missing: " + k);
        }
      } else if (v == "whole") {
        ++c_.child_unacked_whole;
      } else if (v == "miss") {
        ++c_.child_unacked_missing;
        ++c_.misses;
      }
    }
  }

  // Kind 1: a child's series of gets of a stored cache cut at a random moment; the cache must
  // be unchanged afterwards.
  void CutGets(int cycle, std::mt19937_64& rng) {
    const std::string key = "read-" + std::to_string(cycle);
    {
      if (!rt_->SetDevice(0).ok()) return;
      auto stream = rt_->NewStream();
      if (!stream.ok()) return;
      DeviceCache in(rt_, 0, ChildLayout(), kChildTokens);
      client::PutOptions po;
      po.policy = Lossless();
      if (!in.Upload(Content(SeedOf(key), in.bytes()), *stream).ok()) return;
      auto put = checker_->PutDevice("m", key, ChildLayout(), kChildTokens, in.In(), *stream, po);
      rt_->DestroyStream(*stream);
      if (!put.ok()) {
        Error("put for the cut gets: " + put.status().ToString());
        return;
      }
    }
    int fd = -1;
    const pid_t pid = Spawn("get", key, 1000, &fd);
    if (pid < 0) return;
    std::string said;
    ReadUntil(fd, "connected", 20000, &said);
    ReadFor(fd, static_cast<int>(rng() % 2000), &said);
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    close(fd);
    const std::string v = CheckChild(key);
    if (v != "whole") Problem("the cache the cut gets read is " + v + " afterwards: " + key);
    (void)checker_->Delete("m", key);
  }

  uint64_t RoundTrips() {
    std::lock_guard<std::mutex> l(mu_);
    return c_.round_trips;
  }

  // Until the daemon holds no open put (the cut one aborted and its buffers released).
  void WaitReleased() {
    const auto t0 = Clock::now();
    testing::ControlClient raw(d_->ports().control);
    while (Seconds(t0) < 30) {
      rpc::StatsResponse st;
      try {
        raw->Stats(st, testing::MakeAuth("alpha", "secret-a"));
      } catch (const std::exception& e) {
        Problem(std::string("Stats failed: ") + e.what());
        return;
      }
      if (st.puts_in_progress == 0) {
        std::lock_guard<std::mutex> l(mu_);
        c_.release_ms.push_back(Seconds(t0) * 1000);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    Problem("a cut put was not released within 30 s", &c_.not_released);
  }

  const Flags& f_;
  const char* self_;
  GpuRuntime* rt_;
  std::string link_;
  int daemon_device_;
  std::unique_ptr<KvcompdProcess> d_;
  std::unique_ptr<Client> healthy_, checker_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  bool stalled_ = false;
  std::map<std::string, uint64_t> live_;
  Counts c_;
};

void Report(const std::string& link, const Counts& c, double seconds) {
  std::printf("link: %s\n", link.c_str());
  std::printf("  seconds: %.0f\n", seconds);
  std::printf("  round_trips: %llu\n  reads: %llu\n", static_cast<unsigned long long>(c.round_trips),
              static_cast<unsigned long long>(c.reads));
  for (const auto& [p, n] : c.paths) {
    std::printf("  path_%s: %llu\n", p.c_str(), static_cast<unsigned long long>(n));
  }
  std::printf("  faults_killed_puts: %llu\n  faults_killed_gets: %llu\n  faults_stalled_puts: %llu\n",
              static_cast<unsigned long long>(c.faults[0]),
              static_cast<unsigned long long>(c.faults[1]),
              static_cast<unsigned long long>(c.faults[2]));
  std::printf("  cut_puts_acked: %llu\n  cut_puts_unacked_whole: %llu\n"
              "  cut_puts_unacked_missing: %llu\n",
              static_cast<unsigned long long>(c.child_acked),
              static_cast<unsigned long long>(c.child_unacked_whole),
              static_cast<unsigned long long>(c.child_unacked_missing));
  std::printf("  transfers_aborted_by_daemon: %llu\n",
              static_cast<unsigned long long>(c.transfers_aborted));
  std::printf("  wrong: %llu\n  clean_errors: %llu\n  misses: %llu\n",
              static_cast<unsigned long long>(c.wrong), static_cast<unsigned long long>(c.errors),
              static_cast<unsigned long long>(c.misses));
  std::printf("  starved_during_stall: %llu\n  not_released: %llu\n  daemon_died: %llu\n",
              static_cast<unsigned long long>(c.starved),
              static_cast<unsigned long long>(c.not_released),
              static_cast<unsigned long long>(c.daemon_died));
  std::printf("  release_ms_p50: %.0f\n  release_ms_max: %.0f\n", Pct(c.release_ms, 0.5),
              Pct(c.release_ms, 1.0));
  std::printf("  round_trip_ms_p50: %.2f\n  round_trip_ms_p99: %.2f\n  round_trip_ms_max: %.1f\n",
              Pct(c.rt_ms, 0.5), Pct(c.rt_ms, 0.99), Pct(c.rt_ms, 1.0));
  std::printf("  round_trip_ms_during_stalls_p50: %.2f\n  round_trip_ms_during_stalls_max: %.1f\n",
              Pct(c.stall_rt_ms, 0.5), Pct(c.stall_rt_ms, 1.0));
  for (const std::string& e : c.error_samples) std::printf("  # error: %s\n", e.c_str());
  for (const std::string& p : c.problems) std::printf("  # problem: %s\n", p.c_str());
  std::printf("RESULT bench=gpu_faults link=%s seconds=%.0f round_trips=%llu reads=%llu "
              "faults=%llu wrong=%llu clean_errors=%llu misses=%llu not_released=%llu "
              "starved=%llu daemon_died=%llu\n",
              link.c_str(), seconds, static_cast<unsigned long long>(c.round_trips),
              static_cast<unsigned long long>(c.reads),
              static_cast<unsigned long long>(c.faults[0] + c.faults[1] + c.faults[2]),
              static_cast<unsigned long long>(c.wrong), static_cast<unsigned long long>(c.errors),
              static_cast<unsigned long long>(c.misses),
              static_cast<unsigned long long>(c.not_released),
              static_cast<unsigned long long>(c.starved),
              static_cast<unsigned long long>(c.daemon_died));
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    if (a.rfind("--", 0) != 0 || eq == std::string::npos) {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
    const std::string k = a.substr(2, eq - 2), v = a.substr(eq + 1);
    if (k == "mode") f.mode = v;
    else if (k == "kvcompd") f.kvcompd = v;
    else if (k == "dir") f.dir = v;
    else if (k == "links") f.links = absl::StrSplit(v, ',', absl::SkipEmpty());
    else if (k == "seconds") f.seconds = std::atof(v.c_str());
    else if (k == "seed") f.seed = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "window") f.window = std::max(1, std::atoi(v.c_str()));
    else if (k == "endpoint") f.endpoint = v;
    else if (k == "op") f.op = v;
    else if (k == "key") f.key = v;
    else if (k == "count") f.count = std::atoi(v.c_str());
    else if (k == "device") f.device = std::atoi(v.c_str());
    else {
      std::fprintf(stderr, "unknown flag --%s\n", k.c_str());
      return 2;
    }
  }
  if (f.mode == "child") return Child(f);
  if (f.mode != "campaign" || f.dir.empty()) {
    std::fprintf(stderr, "usage: kvcomp_gpu_campaign --dir=DIR [--links=nccl,ipc] "
                         "[--seconds=S] [--kvcompd=PATH] [--seed=N] [--window=N]\n");
    return 2;
  }
  auto rt = GpuRuntime::Get();
  if (!rt.ok()) {
    std::printf("skipped: no CUDA driver (%s)\n", rt.status().ToString().c_str());
    return 77;
  }
  int ran = 0, rc = 0;
  for (const std::string& link : f.links) {
    if (link != "nccl" && link != "ipc") {
      std::fprintf(stderr, "--links: nccl or ipc, not %s\n", link.c_str());
      return 2;
    }
    if (link == "nccl" && ((*rt)->device_count() < 2 || !GpuRuntime::LoadNccl().ok())) {
      std::printf("link: nccl\n  skipped: needs two GPUs and NCCL\n");
      continue;
    }
    if (link == "ipc" && !(*rt)->has_ipc()) {
      std::printf("link: ipc\n  skipped: no CUDA IPC\n");
      continue;
    }
    Counts c;
    const auto t0 = Clock::now();
    Campaign run(f, argv[0], *rt, link);
    if (run.Run(&c) != 0) return 1;
    Report(link, c, std::chrono::duration<double>(Clock::now() - t0).count());
    ++ran;
    if (c.wrong > 0 || c.daemon_died > 0 || c.not_released > 0 || c.starved > 0) {
      rc = 1;  // its daemon's data and log stay for a look
    } else {
      std::error_code ec;
      std::filesystem::remove_all(f.dir + "/" + link, ec);
    }
  }
  return ran == 0 ? 77 : rc;
}

}  // namespace
}  // namespace kvcomp

int main(int argc, char** argv) { return kvcomp::Main(argc, argv); }
