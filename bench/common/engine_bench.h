// What the in-process benchmarks of the engine on the CUDA backend share (bench/gpu): a cache
// whose every layer holds the same host K and V, its copy into device memory, the device copy it
// is measured against, and a KVSplice projection calibrated from its values on the CPU.
// Header-only: its users link kvcomp::kernels and CUDA::cudart themselves.
#ifndef KVCOMP_BENCH_COMMON_ENGINE_BENCH_H_
#define KVCOMP_BENCH_COMMON_ENGINE_BENCH_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "common/bench_util.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/pipeline.h"

namespace kvcomp {
namespace bench {

// The CUDA backend a benchmark measures and the CPU backend it calibrates on; exits when either
// cannot be made.
struct Backends {
  std::unique_ptr<Backend> gpu;
  std::unique_ptr<Backend> cpu;
};

inline Backends MakeBackends() {
  Backends b;
  b.gpu = ValueOrExit(MakeCudaBackend(), "cuda backend");
  b.cpu = ValueOrExit(MakeCpuBackend(), "cpu backend");
  return b;
}

// A host view of `tokens` tokens in which every layer's keys are `k` and values `v`, each dense
// [num_kv_heads][tokens][head_dim] of layout.dtype.
inline KvCacheView SameLayersView(const KvLayout& layout, uint64_t tokens, const void* k,
                                  const void* v) {
  KvCacheView view;
  view.layout = layout;
  view.num_tokens = tokens;
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    view.keys.push_back(
        HeadsView::Dense(k, layout.dtype, layout.num_kv_heads, tokens, layout.head_dim));
    view.values.push_back(
        HeadsView::Dense(v, layout.dtype, layout.num_kv_heads, tokens, layout.head_dim));
  }
  return view;
}

// A cache in device memory: one buffer per layer and part (K then V of each layer) and the
// device view over them.
struct DeviceCache {
  std::vector<Buffer> buffers;
  KvCacheView view;
};

// Copies every layer of the dense host view `host` into fresh buffers of `gpu`; exits on failure.
inline DeviceCache Upload(Backend& gpu, const KvCacheView& host) {
  const KvLayout& layout = host.layout;
  const uint64_t layer_bytes = layout.LayerBytes(host.num_tokens);
  DeviceCache d;
  d.view = host;
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    for (int part = 0; part < 2; ++part) {
      auto b = Buffer::Allocate(gpu.allocator(), layer_bytes);
      ExitIfError(b.status(), "device buffer");
      const HeadsView& src = part == 0 ? host.keys[l] : host.values[l];
      ExitIfError(gpu.CopyFromHost(b->data(), src.data, layer_bytes), "upload");
      HeadsView& view = part == 0 ? d.view.keys[l] : d.view.values[l];
      view = HeadsView::Dense(b->data(), layout.dtype, layout.num_kv_heads, host.num_tokens,
                              layout.head_dim, MemorySpace::kDevice);
      d.buffers.push_back(std::move(*b));
    }
  }
  return d;
}

// A cache staged as kvcompd stages a put's blocks: through a DeviceUploader into one DeviceKv
// (every layer's keys, then every layer's values: the layers are one view), in blocks of about
// 1 MiB from the dense host view, with the keys' sums the staging accumulates. `view` is what
// the daemon's CompressToDevice reads.
struct StagedCache {
  std::unique_ptr<DeviceUploader> uploader;
  std::unique_ptr<DeviceKv> kv;
  KvCacheView view;
};

// Stages the dense host view `host` for `gpu` (device 0); exits on failure.
inline StagedCache StageAsPut(Backend& gpu, const KvCacheView& host) {
  const KvLayout& layout = host.layout;
  const uint64_t T = host.num_tokens;
  StagedCache s;
  s.uploader = ValueOrExit(DeviceUploader::Create(0), "uploader");
  s.kv = ValueOrExit(DeviceKv::Create(*s.uploader, layout, T), "device kv");
  const uint64_t token_bytes = uint64_t{2} * layout.num_kv_heads * layout.head_dim *
                               DTypeBytes(layout.dtype, 1);
  const uint64_t block_tokens = std::max<uint64_t>(1, (uint64_t{1} << 20) / token_bytes);
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    for (uint64_t t0 = 0; t0 < T; t0 += block_tokens) {
      const uint64_t n = std::min(block_tokens, T - t0);
      for (int part = 0; part < 2; ++part) {
        HeadsView src = part == 0 ? host.keys[l] : host.values[l];
        src.data = static_cast<const char*>(src.data) +
                   DTypeBytes(layout.dtype, t0 * layout.head_dim);
        src.num_tokens = n;  // strides stay those of the whole layer
        ExitIfError(s.kv->AddHost(l, part == 1, t0, src), "stage");
      }
    }
  }
  s.view = ValueOrExit(s.kv->View(gpu), "staged view");
  ExitIfError(gpu.Synchronize(), "staged");
  return s;
}

// Median seconds (MedianSeconds) of a device-to-device copy of every buffer of `c` into one
// scratch buffer on `gpu`'s stream: the cache's bytes read and as many written.
inline double DeviceCopySeconds(Backend& gpu, const DeviceCache& c, int reps) {
  const uint64_t layer_bytes = c.view.layout.LayerBytes(c.view.num_tokens);
  auto scratch = Buffer::Allocate(gpu.allocator(), layer_bytes);
  ExitIfError(scratch.status(), "copy buffer");
  return MedianSeconds(reps, [&] {
    for (const Buffer& b : c.buffers) {
      cudaMemcpyAsync(scratch->data(), b.data(), layer_bytes, cudaMemcpyDeviceToDevice,
                      static_cast<cudaStream_t>(gpu.native_stream()));
    }
    ExitIfError(gpu.Synchronize(), "copy");
  });
}

// A projection calibrated on `cpu` from the values of every layer of the host view `host`, at
// full rank (head_dim), no samples kept: as kvcompd calibrates from stored caches.
inline std::shared_ptr<const Projection> CalibrateProjection(Backend& cpu,
                                                             const KvCacheView& host) {
  const KvLayout& layout = host.layout;
  auto cal = Calibrator::Create(
      {"bench", layout.num_layers, layout.num_kv_heads, layout.head_dim, 0, 0, 0}, &cpu);
  ExitIfError(cal.status(), "calibrator");
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    ExitIfError(cal->AddLayer(l, host.values[l]), "cal");
  }
  auto proj = cal->Finish(layout.head_dim);
  ExitIfError(proj.status(), "projection");
  return std::make_shared<const Projection>(std::move(*proj));
}

}  // namespace bench
}  // namespace kvcomp

#endif  // KVCOMP_BENCH_COMMON_ENGINE_BENCH_H_
