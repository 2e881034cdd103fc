// The GPU channel on two GPUs: a Llama-3.1-8B-shaped cache (32 layers, 8 kv heads, head_dim
// 128, bf16; --tokens, default 32768: 4 GiB of K and V) put from device memory of GPU 0 into a
// kvcompd on GPU 1 and fetched back, against the two ways the same bytes can cross between the
// same GPUs in this process, measured in the same run:
//   - ncclSend/ncclRecv of the same chunks (one per layer and part) on a two-rank communicator,
//     nccl-tests style (both ranks here, one thread each);
//   - cudaMemcpyPeer of the whole payload (cuMemcpyPeerAsync, peer access on).
// For the channel, "transfer" is the payload's time on the caller's stream (events around the
// sends or receives); "put" and "get" are the whole calls (control round trips, the daemon's
// copy to host memory and the compression, or the daemon's read and copy to its GPU). The
// lossless policy (ratio 0, raw codecs) keeps every token, so the dense get returns the bytes
// put; the default policy's put (manifold 0.5 + moments) is timed beside it, and the same cache
// put and fetched layer by layer (DevicePutStream, DeviceGetStream).
// kvcompd runs with --backend (default cuda: the CUDA engine) and --tier (default device: the
// GPU tier). With --one_gpu the daemon shares GPU 0 with this client: the channel is in CUDA IPC
// mode and the reference is a device-to-device copy of the payload on that GPU.
//
//   kvcomp_gpu_channel_bench --kvcompd PATH [--tokens N] [--reps N] [--default_puts N]
//                            [--backend cuda|cpu] [--tier device|host] [--one_gpu]
// Prints RESULT lines. Needs two CUDA devices and NCCL (kvcomp/transport/gpu_link.h), or one
// device with --one_gpu.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/bench_util.h"
#include "common/sdk_device_bench.h"
#include "kvcomp/client/client.h"
#include "kvcomp/transport/gpu_link.h"
#include "kvcompd_process.h"

namespace {

using kvcomp::KvLayout;
using kvcomp::bench::Best;
using kvcomp::bench::ValueOrExit;
using kvcomp::client::Client;
using kvcomp::transport::GpuRuntime;
using kvcomp::transport::NcclLink;

void Report(const char* name, double bytes, const std::vector<double>& secs) {
  kvcomp::bench::PrintRate("gpu_channel", 28, name, bytes, secs);
}

}  // namespace

int main(int argc, char** argv) {
  std::string kvcompd;
  uint64_t tokens = 32768;
  int reps = 5;
  int default_puts = 2;  // puts with the default policy (the first warms up); 0 = none
  std::string backend = "cuda";
  std::string tier = "device";
  bool one_gpu = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--one_gpu") {
      one_gpu = true;
      continue;
    }
    if (i + 1 >= argc) break;
    const char* v = argv[++i];
    if (a == "--kvcompd") kvcompd = v;
    if (a == "--tokens") tokens = std::strtoull(v, nullptr, 10);
    if (a == "--reps") reps = std::atoi(v);
    if (a == "--default_puts") default_puts = std::atoi(v);
    if (a == "--backend") backend = v;
    if (a == "--tier") tier = v;
  }
  GpuRuntime* rt = ValueOrExit(GpuRuntime::Get(), "CUDA");
  if (!one_gpu) KVCOMP_BENCH_CHECK_OK(GpuRuntime::LoadNccl());
  if (rt->device_count() < (one_gpu ? 1 : 2)) {
    std::fprintf(stderr, "needs %d CUDA device(s)\n", one_gpu ? 1 : 2);
    return 77;
  }
  const int dd = one_gpu ? 0 : 1;  // the daemon's device
  const KvLayout layout = kvcomp::bench::Llama8bLayout();
  const size_t layer = layout.LayerBytes(tokens);
  const size_t payload = layout.CacheBytes(tokens);
  std::printf("# %llu tokens, %.2f GiB of K and V, %zu chunks of %.1f MiB; NCCL %d (%s)\n",
              static_cast<unsigned long long>(tokens), payload / 1073741824.0,
              size_t{2} * layout.num_layers, layer / 1048576.0, GpuRuntime::nccl_version(),
              GpuRuntime::nccl_path().c_str());

  // Source on GPU 0 (finite bf16: 0x3f80 = 1.0 with a varying low byte), destination on GPU 1.
  KVCOMP_BENCH_CHECK_OK(rt->SetDevice(0));
  void* src = ValueOrExit(rt->AllocDevice(payload), "alloc src");
  void* back = ValueOrExit(rt->AllocDevice(payload), "alloc back");
  void* s0 = ValueOrExit(rt->NewStream(), "stream 0");
  {
    std::vector<uint16_t> pattern(layer / 2);
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint16_t>(0x3f00 | (i & 0x7f));
    for (size_t c = 0; c < 2 * layout.num_layers; ++c) {
      KVCOMP_BENCH_CHECK_OK(rt->CopyAsync(static_cast<char*>(src) + c * layer, pattern.data(),
                                          layer, GpuRuntime::Copy::kHostToDevice, s0));
      KVCOMP_BENCH_CHECK_OK(rt->WaitStream(s0, absl::Now() + absl::Seconds(60)));
    }
  }
  KVCOMP_BENCH_CHECK_OK(rt->SetDevice(dd));
  void* dst = ValueOrExit(rt->AllocDevice(payload), "alloc dst");
  void* s1 = ValueOrExit(rt->NewStream(), "stream 1");
  auto chunks = [&](void* base) {
    std::vector<NcclLink::Chunk> v;
    for (size_t c = 0; c < 2 * layout.num_layers; ++c) {
      v.push_back({static_cast<char*>(base) + c * layer, layer});
    }
    return v;
  };

  // One GPU: a device-to-device copy of the payload on it (cuMemcpyDtoDAsync).
  std::vector<double> peer_s, nccl_s;
  if (one_gpu) {
    KVCOMP_BENCH_CHECK_OK(rt->SetDevice(0));
    peer_s = kvcomp::bench::StreamSeconds(
        *rt, s0, reps,
        [&] { return rt->CopyAsync(dst, src, payload, GpuRuntime::Copy::kDeviceToDevice, s0); },
        "d2d copy");
    Report("device-to-device copy", payload, peer_s);
  }
  // cudaMemcpyPeer, GPU 0 -> GPU 1.
  if (!one_gpu) {
    KVCOMP_BENCH_CHECK_OK(rt->EnablePeerAccess(0, 1));
    KVCOMP_BENCH_CHECK_OK(rt->EnablePeerAccess(1, 0));
  }
  if (!one_gpu) {
    KVCOMP_BENCH_CHECK_OK(rt->SetDevice(0));
    peer_s = kvcomp::bench::StreamSeconds(
        *rt, s0, reps, [&] { return rt->CopyPeerAsync(dst, 1, src, 0, payload, s0); }, "peer copy");
  }
  if (!one_gpu) Report("cudaMemcpyPeer", payload, peer_s);

  // ncclSend/ncclRecv between the same GPUs, the channel's chunks.
  if (!one_gpu) {
    KVCOMP_BENCH_CHECK_OK(rt->SetDevice(1));
    const std::string id = ValueOrExit(rt->NewUniqueId(), "unique id");
    std::unique_ptr<NcclLink> recv_link, send_link;
    std::thread t(
        [&] { recv_link = ValueOrExit(NcclLink::Join(id, 0, 1, absl::Seconds(60)), "join 0"); });
    send_link = ValueOrExit(NcclLink::Join(id, 1, 0, absl::Seconds(60)), "join 1");
    t.join();
    KVCOMP_BENCH_CHECK_OK(rt->SetDevice(0));
    auto timer = ValueOrExit(rt->NewTimer(), "timer");
    for (int r = 0; r < reps + 1; ++r) {
      std::thread rx([&] {
        KVCOMP_BENCH_CHECK_OK(recv_link->Recv(chunks(dst), s1));
        KVCOMP_BENCH_CHECK_OK(recv_link->Wait(s1, absl::Now() + absl::Seconds(60)));
      });
      KVCOMP_BENCH_CHECK_OK(rt->SetDevice(0));
      KVCOMP_BENCH_CHECK_OK(timer->Start(s0));
      KVCOMP_BENCH_CHECK_OK(send_link->Send(chunks(src), s0));
      KVCOMP_BENCH_CHECK_OK(send_link->Enqueued(absl::Now() + absl::Seconds(60)));
      KVCOMP_BENCH_CHECK_OK(timer->Stop(s0));
      KVCOMP_BENCH_CHECK_OK(send_link->Wait(s0, absl::Now() + absl::Seconds(60)));
      rx.join();
      double s = ValueOrExit(timer->Seconds(absl::Now() + absl::Seconds(5)), "nccl");
      if (r > 0) nccl_s.push_back(s);
    }
  }
  if (!one_gpu) Report("ncclSend/Recv", payload, nccl_s);
  KVCOMP_BENCH_CHECK_OK(rt->SetDevice(dd));
  rt->FreeDevice(dst);  // the daemon needs its GPU's memory

  // The channel: kvcompd on GPU 1, this client on GPU 0.
  kvcomp::testing::TempDir dir;
  kvcomp::testing::KvcompdProcess daemon(
      kvcompd, dir.path() + "/d",
      {"--engine.backend=" + backend, "--engine.cuda_device=" + std::to_string(dd),
       "--engine.cpu_threads=0", "--storage.durability=memory",
       "--storage.rocksdb_enabled=false", "--storage.put_tier=" + tier,
       "--storage.device_capacity_bytes=24Gi",
       "--storage.host_capacity_bytes=64Gi", "--data_plane.max_buffered_bytes=16Gi",
       "--data_plane.max_put_bytes=16Gi", "--data_plane.gpu_transfer_timeout_seconds=120"});
  daemon.SetEnv("NCCL_NVLS_ENABLE=0");
  if (!daemon.Start(120)) {
    std::fprintf(stderr, "kvcompd did not start:\n%s\n", daemon.Log().c_str());
    return 1;
  }
  std::printf("# kvcompd %s\n",
              kvcomp::bench::LogLine(daemon.Log(), "engine: ", "(no engine line)").c_str());
  kvcomp::client::ClientOptions o;
  o.request_timeout = absl::Seconds(300);
  o.ucx_overrides = {{"TLS", "tcp"}};
  auto client = ValueOrExit(Client::Connect({daemon.client_endpoint()}, o), "connect");
  const auto [in, out] = kvcomp::bench::SplitLayers(src, back, layout, tokens);
  const kvcomp::client::PutOptions lossless = kvcomp::bench::LosslessPut();
  std::vector<double> put_xfer, put_wall, get_xfer, get_wall, full_wall;
  std::string path;
  for (int r = 0; r < reps + 1; ++r) {
    const std::string key = "bench-" + std::to_string(r);
    auto t0 = absl::Now();
    auto put =
        ValueOrExit(client->PutDevice("llama-8b", key, layout, tokens, in, s0, lossless), "put");
    const double wall = absl::ToDoubleSeconds(absl::Now() - t0);
    path = put.path;
    t0 = absl::Now();
    auto got =
        ValueOrExit(client->GetKvIntoDevice("llama-8b", key, layout, tokens, out, s0), "get");
    const double gwall = absl::ToDoubleSeconds(absl::Now() - t0);
    if (r > 0) {
      put_xfer.push_back(put.transfer_seconds);
      put_wall.push_back(wall);
      get_xfer.push_back(got.transfer_seconds);
      get_wall.push_back(gwall);
    }
    (void)client->Delete("llama-8b", key);
  }
  // The bytes that came back are the bytes that went (the last round).
  {
    std::string a(payload, '\0'), b(payload, '\0');
    KVCOMP_BENCH_CHECK_OK(rt->SetDevice(0));
    KVCOMP_BENCH_CHECK_OK(
        rt->CopyAsync(a.data(), src, payload, GpuRuntime::Copy::kDeviceToHost, s0));
    KVCOMP_BENCH_CHECK_OK(
        rt->CopyAsync(b.data(), back, payload, GpuRuntime::Copy::kDeviceToHost, s0));
    KVCOMP_BENCH_CHECK_OK(rt->WaitStream(s0, absl::Now() + absl::Seconds(60)));
    std::printf("# round trip %s\n", a == b ? "bit-identical" : "DIFFERS");
  }
  std::printf("# path %s\n", path.c_str());
  Report("channel put transfer", payload, put_xfer);
  Report("channel get transfer", payload, get_xfer);
  Report("channel put (lossless, whole)", payload, put_wall);
  Report("channel get (dense, whole)", payload, get_wall);

  // Layer by layer: a put stream fed one layer at a time, then a get handed back one layer at
  // a time (the time until layer 0 is usable on this stream beside the whole get).
  {
    std::vector<double> sput_wall, sput_xfer, sget_wall, sget_first;
    std::string spath, gpath;
    void* first = ValueOrExit(rt->NewEvent(), "event");
    for (int r = 0; r < reps + 1; ++r) {
      const std::string key = "layers-" + std::to_string(r);
      auto t0 = absl::Now();
      auto ps = ValueOrExit(
          client->OpenDevicePutStream("llama-8b", key, layout, tokens, 0, lossless), "put stream");
      spath = ps->path();
      for (uint32_t l = 0; l < layout.num_layers; ++l)
        KVCOMP_BENCH_CHECK_OK(ps->AppendLayer(l, in[l], s0));
      auto put = ValueOrExit(ps->Commit(), "put stream commit");
      const double wall = absl::ToDoubleSeconds(absl::Now() - t0);
      t0 = absl::Now();
      auto gs = ValueOrExit(client->OpenDeviceGetStream("llama-8b", key, layout, tokens, out, s0),
                            "get stream");
      KVCOMP_BENCH_CHECK_OK(rt->SetDevice(0));
      KVCOMP_BENCH_CHECK_OK(gs->WaitLayer(0, s0));
      KVCOMP_BENCH_CHECK_OK(rt->RecordEvent(first, s0));
      KVCOMP_BENCH_CHECK_OK(rt->WaitStream(s0, absl::Now() + absl::Seconds(60)));
      const double first_s = absl::ToDoubleSeconds(absl::Now() - t0);
      auto got = ValueOrExit(gs->Finish(), "get stream finish");
      gpath = got.path;
      const double gwall = absl::ToDoubleSeconds(absl::Now() - t0);
      if (r > 0) {
        sput_wall.push_back(wall);
        sput_xfer.push_back(put.transfer_seconds);
        sget_wall.push_back(gwall);
        sget_first.push_back(first_s);
      }
      (void)client->Delete("llama-8b", key);
    }
    rt->DestroyEvent(first);
    std::string a(payload, '\0'), b(payload, '\0');
    KVCOMP_BENCH_CHECK_OK(
        rt->CopyAsync(a.data(), src, payload, GpuRuntime::Copy::kDeviceToHost, s0));
    KVCOMP_BENCH_CHECK_OK(
        rt->CopyAsync(b.data(), back, payload, GpuRuntime::Copy::kDeviceToHost, s0));
    KVCOMP_BENCH_CHECK_OK(rt->WaitStream(s0, absl::Now() + absl::Seconds(60)));
    std::printf("# layer by layer: put path %s, get path %s, round trip %s\n", spath.c_str(),
                gpath.c_str(), a == b ? "bit-identical" : "DIFFERS");
    Report("layered put (whole)", payload, sput_wall);
    Report("layered put transfer", payload, sput_xfer);
    Report("layered get (whole)", payload, sget_wall);
    std::printf("RESULT gpu_channel layered get: layer 0 usable after %.3f s (best), whole %.3f s\n",
                Best(sget_first), Best(sget_wall));
  }
  for (int r = 0; r < default_puts; ++r) {
    const std::string key = "default-" + std::to_string(r);
    auto t0 = absl::Now();
    auto put =
        ValueOrExit(client->PutDevice("llama-8b", key, layout, tokens, in, s0), "default put");
    if (r > 0) full_wall.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
    std::printf("# default policy put: %.3f s, transfer %.3f s, %.2f GB -> %.2f GB\n",
                absl::ToDoubleSeconds(absl::Now() - t0), put.transfer_seconds,
                put.original_bytes / 1e9, put.stored_bytes / 1e9);
    (void)client->Delete("llama-8b", key);
  }
  if (!full_wall.empty()) Report("channel put (default, whole)", payload, full_wall);
  const double best_ref = std::max(nccl_s.empty() ? 0.0 : payload / Best(nccl_s),
                                   payload / Best(peer_s));
  std::printf("RESULT gpu_channel put transfer / best reference = %.0f%%, get = %.0f%% (target 80%%)\n",
              100.0 * payload / Best(put_xfer) / best_ref, 100.0 * payload / Best(get_xfer) / best_ref);
  const kvcomp::client::GpuChannelStats st = client->GpuStats();
  std::printf("# client: %llu nccl puts, %llu nccl gets, %llu ipc puts, %llu ipc gets, "
              "%llu fallbacks\n",
              static_cast<unsigned long long>(st.nccl_puts),
              static_cast<unsigned long long>(st.nccl_gets),
              static_cast<unsigned long long>(st.ipc_puts),
              static_cast<unsigned long long>(st.ipc_gets),
              static_cast<unsigned long long>(st.fallback_puts + st.fallback_gets));
  return 0;
}
