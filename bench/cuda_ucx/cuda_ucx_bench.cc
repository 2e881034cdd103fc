// Device puts and gets over the UCX data plane with a CUDA-aware UCX (docs/protocol.md,
// "CUDA-aware UCX"), on a GPU machine: a Llama-3.1-8B-shaped cache (32 layers, 8 kv heads,
// head_dim 128, bf16; --tokens, default 32768: 4 GiB of K and V) put from cuMemAlloc'd device
// memory into a kvcompd whose engine runs on a GPU (--daemon_device, default 0: the client's
// own GPU; 1: the other GPU of a two-GPU machine) and fetched back. The GPU channel is switched
// off in the daemon (data_plane.gpu_channel false), so the SDK's device calls take the data
// plane: straight out of and into device memory where both sides' UCX has CUDA memory.
//
// Checks (exit 1 when one fails): the put's path is "ucx-cuda" and the daemon received its
// blocks into GPU memory (kvcomp_data_plane_blocks_into_device_total); under a lossless policy
// (ratio 0, raw codecs) the decoded cache fetched straight into device memory
// (GetIntoDevice, path "ucx-cuda") holds exactly the K and V put, and so does the dense get
// (GetKvIntoDevice, through host memory); another tenant cannot read the cache.
// Then times --reps puts: "transfer" is from the first block sent to the last acknowledged (the
// daemon has each block in the put's device buffer), "put" the whole call (commit included);
// and the decoded get straight into device memory. A device-to-device copy of the payload on
// the client's GPU (or cuMemcpyPeer to the daemon's) is the reference in the same run;
// ucx_perftest with CUDA memory is run beside it by bench/cuda_ucx/run.sh.
//
//   kvcomp_cuda_ucx_bench --kvcompd PATH [--tokens N] [--reps N] [--daemon_device D]
// Prints RESULT and CHECK lines.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/bench_util.h"
#include "common/sdk_device_bench.h"
#include "kvcomp/client/client.h"
#include "kvcomp/core/format.h"
#include "kvcomp/transport/gpu_link.h"
#include "kvcompd_process.h"

namespace {

using kvcomp::KvLayout;
using kvcomp::bench::ValueOrExit;
using kvcomp::client::Client;
using kvcomp::transport::GpuRuntime;

int failures = 0;

void Check(bool ok, const std::string& what) {
  std::printf("CHECK %s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  if (!ok) ++failures;
}

void Report(const char* name, double bytes, const std::vector<double>& secs) {
  kvcomp::bench::PrintRate("cuda_ucx", 32, name, bytes, secs);
}

}  // namespace

int main(int argc, char** argv) {
  std::string kvcompd;
  uint64_t tokens = 32768;
  int reps = 2;
  int dd = 0;  // the daemon's device
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--kvcompd") kvcompd = v;
    if (a == "--tokens") tokens = std::strtoull(v, nullptr, 10);
    if (a == "--reps") reps = std::atoi(v);
    if (a == "--daemon_device") dd = std::atoi(v);
  }
  GpuRuntime* rt = ValueOrExit(GpuRuntime::Get(), "CUDA");
  if (rt->device_count() <= dd) {
    std::fprintf(stderr, "needs %d CUDA device(s)\n", dd + 1);
    return 77;
  }
  const KvLayout layout = kvcomp::bench::Llama8bLayout();
  const size_t payload = layout.CacheBytes(tokens);
  std::printf("# %llu tokens, %.2f GiB of K and V; client on GPU 0, kvcompd on GPU %d\n",
              static_cast<unsigned long long>(tokens), payload / 1073741824.0, dd);

  // K then V of every layer, [layer][head][token][dim], finite bf16 with varied low bits.
  KVCOMP_BENCH_CHECK_OK(rt->SetDevice(0));
  void* src = ValueOrExit(rt->AllocDevice(payload), "alloc src");
  void* back = ValueOrExit(rt->AllocDevice(payload), "alloc back");
  void* s0 = ValueOrExit(rt->NewStream(), "stream");
  std::string host_src(payload, '\0');
  {
    // splitmix64, four bf16 values per draw: sign and low mantissa bits vary, exponents stay
    // in [2^-7, 2) (finite, no NaN or Inf).
    uint64_t state = 7;
    auto* p = reinterpret_cast<uint64_t*>(host_src.data());
    for (size_t i = 0; i < payload / 8; ++i) {
      uint64_t z = (state += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      p[i] = (z & 0x83ff83ff83ff83ffull) | 0x3c003c003c003c00ull;
    }
    KVCOMP_BENCH_CHECK_OK(
        rt->CopyAsync(src, host_src.data(), payload, GpuRuntime::Copy::kHostToDevice, s0));
    KVCOMP_BENCH_CHECK_OK(rt->WaitStream(s0, absl::Now() + absl::Seconds(120)));
  }

  // Reference: the payload copied on the client's GPU, or to the daemon's.
  std::vector<double> ref_s;
  {
    void* dst = back;
    if (dd != 0) {
      KVCOMP_BENCH_CHECK_OK(rt->EnablePeerAccess(0, dd));
      KVCOMP_BENCH_CHECK_OK(rt->SetDevice(dd));
      dst = ValueOrExit(rt->AllocDevice(payload), "alloc peer dst");
      KVCOMP_BENCH_CHECK_OK(rt->SetDevice(0));
    }
    ref_s = kvcomp::bench::StreamSeconds(
        *rt, s0, reps,
        [&] {
          return dd == 0 ? rt->CopyAsync(dst, src, payload, GpuRuntime::Copy::kDeviceToDevice, s0)
                         : rt->CopyPeerAsync(dst, dd, src, 0, payload, s0);
        },
        "reference copy");
    if (dd != 0) {
      KVCOMP_BENCH_CHECK_OK(rt->SetDevice(dd));
      rt->FreeDevice(dst);
      KVCOMP_BENCH_CHECK_OK(rt->SetDevice(0));
    }
    Report(dd == 0 ? "device-to-device copy" : "cuMemcpyPeer", payload, ref_s);
  }

  kvcomp::testing::TempDir dir;
  std::ofstream(dir.path() + "/tokens.yaml") << "alpha: secret-a\nbeta: secret-b\n";
  kvcomp::testing::KvcompdProcess daemon(
      kvcompd, dir.path() + "/d",
      {"--engine.backend=cuda", "--engine.cuda_device=" + std::to_string(dd),
       "--engine.cpu_threads=0", "--storage.durability=memory",
       "--storage.rocksdb_enabled=false", "--storage.put_tier=host",
       "--storage.host_capacity_bytes=64Gi", "--data_plane.max_buffered_bytes=16Gi",
       "--data_plane.max_put_bytes=16Gi", "--data_plane.gpu_channel=false",
       "--auth.token_file=" + dir.path() + "/tokens.yaml"});
  if (!daemon.Start(120)) {
    std::fprintf(stderr, "kvcompd did not start:\n%s\n", daemon.Log().c_str());
    return 1;
  }
  for (const char* what : {"engine: ", "data plane: UCX"}) {
    std::printf("# kvcompd %s\n", kvcomp::bench::LogLine(daemon.Log(), what, what).c_str());
  }
  kvcomp::client::ClientOptions o;
  o.request_timeout = absl::Seconds(300);
  o.tenant = "alpha";
  o.token = "secret-a";
  const std::string endpoint = daemon.client_endpoint();
  auto client = ValueOrExit(Client::Connect({endpoint}, o), "connect");
  const auto [in, out] = kvcomp::bench::SplitLayers(src, back, layout, tokens);
  const kvcomp::client::PutOptions lossless = kvcomp::bench::LosslessPut();

  // ---- correctness: one put, the decoded cache straight into device memory, the dense get ----
  {
    auto put = ValueOrExit(client->PutDevice("llama-8b", "check", layout, tokens, in, s0, lossless),
                           "put");
    Check(put.path == "ucx-cuda", "put from device memory went over CUDA UCX (path " +
                                      put.path + ")");
    const std::string metrics = kvcomp::testing::HttpGet(daemon.ports().metrics, "/metrics").body;
    const double into =
        kvcomp::testing::MetricValue(metrics, "kvcomp_data_plane_blocks_into_device_total");
    const double cuda = kvcomp::testing::MetricValue(metrics, "kvcomp_data_plane_cuda_memory");
    Check(cuda == 1, absl::StrFormat("kvcompd reports CUDA memory on the data plane (%g)", cuda));
    Check(into >= 2.0 * layout.num_layers,
          absl::StrFormat("kvcompd received %g blocks straight into GPU memory (%u expected)",
                          into, 2 * layout.num_layers));

    const size_t capacity = payload + (size_t{64} << 20);
    void* dec = ValueOrExit(rt->AllocDevice(capacity), "alloc decoded");
    auto got = ValueOrExit(client->GetIntoDevice("llama-8b", "check", dec, capacity, s0, true),
                           "get decoded into device");
    Check(got.path == "ucx-cuda", "decoded get into device memory over CUDA UCX (path " +
                                      got.path + ")");
    std::string bytes(got.bytes, '\0');
    KVCOMP_BENCH_CHECK_OK(
        rt->CopyAsync(bytes.data(), dec, got.bytes, GpuRuntime::Copy::kDeviceToHost, s0));
    KVCOMP_BENCH_CHECK_OK(rt->WaitStream(s0, absl::Now() + absl::Seconds(60)));
    rt->FreeDevice(dec);
    auto cache = kvcomp::format::ParseCache(bytes);
    bool same = false;
    if (cache.ok()) {
      std::string dense(payload, '\0');
      same = cache->WriteDenseKv(reinterpret_cast<uint8_t*>(dense.data())).ok() &&
             dense == host_src;
    } else {
      std::printf("# parse: %s\n", cache.status().ToString().c_str());
    }
    Check(same, "decoded cache fetched into device memory is bit-identical to the K and V put");

    auto dense = ValueOrExit(client->GetKvIntoDevice("llama-8b", "check", layout, tokens, out, s0),
                             "dense get");
    std::string b(payload, '\0');
    KVCOMP_BENCH_CHECK_OK(
        rt->CopyAsync(b.data(), back, payload, GpuRuntime::Copy::kDeviceToHost, s0));
    KVCOMP_BENCH_CHECK_OK(rt->WaitStream(s0, absl::Now() + absl::Seconds(60)));
    Check(b == host_src, "dense get (path " + dense.path + ") is bit-identical");

    kvcomp::client::ClientOptions other = o;
    other.tenant = "beta";
    other.token = "secret-b";
    auto intruder = Client::Connect({endpoint}, other);
    if (intruder.ok()) {
      void* tmp = ValueOrExit(rt->AllocDevice(capacity), "alloc other");
      auto stolen = (*intruder)->GetIntoDevice("llama-8b", "check", tmp, capacity, s0, true);
      Check(absl::IsNotFound(stolen.status()),
            "another tenant's device get reads NotFound: " + stolen.status().ToString());
      rt->FreeDevice(tmp);
    } else {
      std::printf("# other tenant: %s\n", intruder.status().ToString().c_str());
    }
    (void)client->Delete("llama-8b", "check");
  }

  // ---- timings ----
  std::vector<double> put_xfer, put_wall, get_wall;
  const size_t capacity = payload + (size_t{64} << 20);
  void* dec = ValueOrExit(rt->AllocDevice(capacity), "alloc decoded");
  for (int r = 0; r < reps + 1; ++r) {
    const std::string key = "bench-" + std::to_string(r);
    auto t0 = absl::Now();
    auto put =
        ValueOrExit(client->PutDevice("llama-8b", key, layout, tokens, in, s0, lossless), "put");
    const double wall = absl::ToDoubleSeconds(absl::Now() - t0);
    t0 = absl::Now();
    auto got = ValueOrExit(client->GetIntoDevice("llama-8b", key, dec, capacity, s0, true), "get");
    const double gwall = absl::ToDoubleSeconds(absl::Now() - t0);
    if (r > 0) {
      put_xfer.push_back(put.transfer_seconds);
      put_wall.push_back(wall);
      get_wall.push_back(gwall);
    }
    (void)client->Delete("llama-8b", key);
  }
  Report("put transfer (device -> kvcompd)", payload, put_xfer);
  Report("put (lossless, whole call)", payload, put_wall);
  Report("get decoded into device", payload, get_wall);
  {
    // Blocks that found no device receive buffer land in host memory (and cost an upload).
    const std::string metrics = kvcomp::testing::HttpGet(daemon.ports().metrics, "/metrics").body;
    std::printf("# blocks received straight into GPU memory: %g of %u\n",
                kvcomp::testing::MetricValue(metrics, "kvcomp_data_plane_blocks_into_device_total"),
                2 * layout.num_layers * static_cast<uint32_t>(reps + 2));
  }
  std::printf("# %s\n", failures == 0 ? "all checks passed" : "CHECKS FAILED");
  return failures == 0 ? 0 : 1;
}
