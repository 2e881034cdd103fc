// The compression pipeline on the CUDA backend as kvcompd runs it today, stage by stage, for a
// Llama-3.1-8B-shaped cache (32 layers, 8 kv heads, head_dim 128, bf16) at each token count
// given (default 8192 and 32768): the copy of K and V to the device from pageable and from
// pinned host memory, kvcomp::Compress from host memory (what the daemon's compress stage runs:
// it stages each layer to the device itself) and from device memory (the same work without the
// upload), the cache's serialisation, for eviction alone (manifold, ratio 0.5, moments) and
// with KVSplice (int8 keys, int8 latents at the default rank, outliers kept raw) on a
// projection calibrated from the same values. Each GPU time is set against the transfer time
// its bytes saved buy back on a 400 Gb/s link (50 GB/s), and against a device-to-device copy
// of the cache. Also the daemon's device path: the staging of the cache in 1 MiB blocks
// through DeviceUploader/DeviceKv, the bytes Compress moves across (TransferBytes), its one
// download timed alone, and the device work's GB/s over its minimal bytes against the
// device-to-device copy. Wall-clock medians of --reps runs; one RESULT line per figure set.
//
// --device-only: CompressToDevice alone (the device work of a put whose cache is already on the
// GPU, nothing downloaded), from the plain device view and from the staged one with the keys'
// sums, in GB/s over its minimal bytes (read K and V, write the result) against the
// device-to-device copy; the host-side figures are skipped.
//
// Usage: kvcomp_bench_gpu_pipeline [--tokens 8192,32768] [--reps 3] [--device-only]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/bench_util.h"
#include "common/engine_bench.h"
#include "kvcomp/core/format.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/pipeline.h"

namespace {

using kvcomp::HeadsView;
using kvcomp::KvLayout;
using kvcomp::bench::ExitIfError;
using kvcomp::bench::MedianSeconds;
using kvcomp::bench::ValueOrExit;

struct Run {
  double seconds_host = 0, seconds_device = 0, encode_seconds = 0;
  uint64_t stored = 0;
};

}  // namespace

int main(int argc, char** argv) {
  kvcomp::bench::TokensAndReps args{{8192, 32768}, 3, {{"--device-only", false}}};
  if (!kvcomp::bench::ParseTokensAndReps(argc, argv, "kvcomp_bench_gpu_pipeline", &args)) return 2;
  const bool device_only = args.switches["--device-only"];
  const int reps = args.reps;
  const kvcomp::bench::Backends backends = kvcomp::bench::MakeBackends();
  kvcomp::Backend& gpu = *backends.gpu;
  const KvLayout llama = kvcomp::bench::Llama8bLayout();
  constexpr double kLinkBytesPerSecond = 50e9;  // 400 Gb/s

  for (const uint64_t T : args.tokens) {
    // One random layer of K and V, bf16 [kv_heads][T][d], used for every layer (the values do
    // not change the work; the calibration sees the same data every layer).
    const uint64_t layer_elems = uint64_t{llama.num_kv_heads} * T * llama.head_dim;
    const uint64_t layer_bytes = layer_elems * 2;
    std::vector<uint16_t> k(layer_elems), v(layer_elems);
    std::mt19937 rng(7);
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (uint64_t i = 0; i < layer_elems; ++i) {
      k[i] = kvcomp::FloatToBf16(g(rng));
      v[i] = kvcomp::FloatToBf16(g(rng) * (1.0f + 0.25f * static_cast<float>(i % 128 < 16)));
    }
    const kvcomp::KvCacheView host = kvcomp::bench::SameLayersView(llama, T, k.data(), v.data());
    const uint64_t original = llama.CacheBytes(T);

    // The cache on the device: every layer its own K and V.
    const kvcomp::bench::DeviceCache on_device = kvcomp::bench::Upload(gpu, host);
    const std::vector<kvcomp::Buffer>& dev = on_device.buffers;
    const kvcomp::KvCacheView& device = on_device.view;

    // Host to device: pageable (as the pipeline's staging copies today) and pinned.
    const double pageable_s = MedianSeconds(reps, [&] {
      for (uint32_t l = 0; l < llama.num_layers; ++l) {
        ExitIfError(gpu.CopyFromHost(dev[2 * l].data(), k.data(), layer_bytes), "h2d");
        ExitIfError(gpu.CopyFromHost(dev[2 * l + 1].data(), v.data(), layer_bytes), "h2d");
      }
    });
    void* pinned = nullptr;
    if (cudaMallocHost(&pinned, layer_bytes) != cudaSuccess) {
      std::fprintf(stderr, "cudaMallocHost failed\n");
      return 1;
    }
    std::copy(k.begin(), k.end(), static_cast<uint16_t*>(pinned));
    const double pinned_s = MedianSeconds(reps, [&] {
      for (uint32_t l = 0; l < 2 * llama.num_layers; ++l) {
        ExitIfError(gpu.CopyFromHost(dev[l].data(), pinned, layer_bytes), "h2d pinned");
      }
    });
    cudaFreeHost(pinned);
    // Device-to-device copy of the whole cache (bytes read + written = 2 x original).
    const double d2d_s = kvcomp::bench::DeviceCopySeconds(gpu, on_device, reps);

    // The daemon's staging: the cache from pageable host memory in 1 MiB blocks (as a put's
    // blocks arrive) through the uploader's page-locked ring into one device buffer.
    auto uploader = kvcomp::DeviceUploader::Create(0);
    ExitIfError(uploader.status(), "uploader");
    const uint64_t block_tokens = std::max<uint64_t>(1, (1u << 20) / (2 * 8 * 128 * 2));
    auto stage = [&] {
      std::unique_ptr<kvcomp::DeviceKv> kv =
          ValueOrExit(kvcomp::DeviceKv::Create(**uploader, llama, T), "device kv");
      for (uint32_t l = 0; l < llama.num_layers; ++l) {
        for (uint64_t t0 = 0; t0 < T; t0 += block_tokens) {
          const uint64_t n = std::min(block_tokens, T - t0);
          for (int part = 0; part < 2; ++part) {
            HeadsView src = part == 0 ? host.keys[l] : host.values[l];
            src.data = static_cast<const uint16_t*>(src.data) + t0 * 128;
            src.num_tokens = n;  // strides stay those of the whole layer
            ExitIfError(kv->AddHost(l, part == 1, t0, src), "stage");
          }
        }
      }
      return kv;
    };
    const double staged_s = MedianSeconds(reps, [&] {
      std::unique_ptr<kvcomp::DeviceKv> kv = stage();
      auto view = kv->View(gpu);
      ExitIfError(view.status(), "view");
      ExitIfError(gpu.Synchronize(), "staged");
    });
    // One staged cache kept for Compress: its view carries the keys' sums the staging
    // accumulated (KeySums), so the mean-based scorer reads each layer's keys once.
    const std::unique_ptr<kvcomp::DeviceKv> staged = stage();
    auto staged_view = staged->View(gpu);
    ExitIfError(staged_view.status(), "view");
    const bool have_sums = !staged_view->key_sums.empty() &&
                           staged_view->key_sums[0].sums != nullptr;

    kvcomp::CompressionPolicy evict;  // manifold, ratio 0.5 (the daemon's default) with moments
    evict.moments = true;
    kvcomp::CompressionPolicy splice = evict;
    splice.key_codec = kvcomp::KeyCodec::kInt8;
    splice.value_codec = kvcomp::ValueCodec::kOrthogonalInt8;

    if (device_only) {
      // The device work alone: CompressToDevice (its one wait for the check records included,
      // the result left on the device), for the daemon's default policy.
      uint64_t result_bytes = 0;
      auto to_device = [&](const kvcomp::KvCacheView& view) {
        return MedianSeconds(reps, [&] {
          auto c = kvcomp::CompressToDevice(gpu, view, evict);
          ExitIfError(c.status(), "compress to device");
          result_bytes = 0;
          for (const kvcomp::Buffer* b :
               {&c->positions, &c->keys, &c->values, &c->moment_count, &c->moment_key_sum,
                &c->moment_value_sum, &c->moment_vk_sum}) {
            result_bytes += b->size();
          }
          ExitIfError(gpu.Synchronize(), "sync");
        });
      };
      const double plain_s = to_device(device);
      const double staged_to_device_s = to_device(*staged_view);
      const double minimal = static_cast<double>(original + result_bytes);
      const double copy_gbps = 2.0 * original / d2d_s / 1e9;
      std::printf(
          "RESULT bench=pipeline_to_device tokens=%llu variant=manifold0.5+moments key_sums=%d "
          "device_input_ms=%.3f staged_input_ms=%.3f minimal_MB=%.1f d2d_copy_GBps=%.1f "
          "device_input_pct_copy=%.1f staged_input_pct_copy=%.1f\n",
          static_cast<unsigned long long>(T), have_sums ? 1 : 0, 1e3 * plain_s,
          1e3 * staged_to_device_s, minimal / 1e6, copy_gbps,
          100.0 * minimal / plain_s / 1e9 / copy_gbps,
          100.0 * minimal / staged_to_device_s / 1e9 / copy_gbps);
      std::fflush(stdout);
      continue;
    }

    // The projection, calibrated on the CPU from the same values (as kvcompd calibrates from
    // stored caches); not timed.
    const auto projection = kvcomp::bench::CalibrateProjection(*backends.cpu, host);

    for (int variant = 0; variant < 2; ++variant) {
      const kvcomp::CompressionPolicy& policy = variant == 0 ? evict : splice;
      kvcomp::CompressOptions options;
      if (variant == 1) options.projection = projection;
      Run r;
      kvcomp::CompressedCache cache;
      r.seconds_host = MedianSeconds(reps, [&] {
        auto c = kvcomp::Compress(gpu, host, policy, options);
        ExitIfError(c.status(), "compress (host input)");
        cache = std::move(*c);
      });
      kvcomp::TransferBytes moved;
      r.seconds_device = MedianSeconds(reps, [&] {
        moved = {};
        kvcomp::CompressOptions o = options;
        o.transfers = &moved;
        auto c = kvcomp::Compress(gpu, device, policy, o);
        ExitIfError(c.status(), "compress (device input)");
      });
      kvcomp::TransferBytes moved_staged;
      const double staged_compress_s = MedianSeconds(reps, [&] {
        moved_staged = {};
        kvcomp::CompressOptions o = options;
        o.transfers = &moved_staged;
        auto c = kvcomp::Compress(gpu, *staged_view, policy, o);
        ExitIfError(c.status(), "compress (staged input)");
      });
      // The device work as the compress time less its own download: a difference of two
      // timings, reported as nan where it is within their spread (under 5% of the compress
      // time; bench=pipeline_to_device times the device work alone).
      auto less_download = [](double whole, double download) {
        const double d = whole - download;
        return d > 0.05 * whole ? d : std::nan("");
      };
      std::printf(
          "RESULT bench=pipeline_keysums tokens=%llu variant=%s key_sums=%d "
          "compress_device_input_s=%.4f compress_staged_input_s=%.4f less_download_s=%.4f "
          "staged_less_download_s=%.4f\n",
          static_cast<unsigned long long>(T), variant == 0 ? "manifold0.5+moments"
                                                           : "manifold0.5+moments+kvsplice_int8",
          have_sums ? 1 : 0, r.seconds_device, staged_compress_s,
          less_download(r.seconds_device, moved.to_host_seconds),
          less_download(staged_compress_s, moved_staged.to_host_seconds));
      // Its one download alone (the same bytes to pageable memory), to split the device work
      // from the copy to the host.
      std::vector<uint8_t> sink(moved.to_host);
      kvcomp::Buffer src = std::move(*kvcomp::Buffer::Allocate(gpu.allocator(), moved.to_host));
      const double download_s = MedianSeconds(reps, [&] {
        ExitIfError(gpu.CopyToHost(sink.data(), src.data(), sink.size()), "download");
      });
      std::string bytes;
      r.encode_seconds = MedianSeconds(reps, [&] {
        auto b = kvcomp::format::EncodeCache(cache);
        ExitIfError(b.status(), "encode");
        bytes = std::move(*b);
      });
      r.stored = bytes.size();
      const double saved_s = static_cast<double>(original - r.stored) / kLinkBytesPerSecond;
      // The device work, timed alone: CompressToDevice on the device input with this variant's
      // policy and projection (its waits for the check records included, the result left on
      // the device), over its minimal bytes (read K and V, write the kept rows and moments),
      // against a device-to-device copy (2 x original bytes). The compress time less its own
      // download (above) is a difference of two timings and nan where the download is most of
      // the compress, as it is for eviction alone.
      const double device_work_s = MedianSeconds(reps, [&] {
        auto c = kvcomp::CompressToDevice(gpu, device, policy, options);
        ExitIfError(c.status(), "compress to device");
        ExitIfError(gpu.Synchronize(), "sync");
      });
      const double minimal_bytes = static_cast<double>(original + moved.to_host);
      const double work_gbps = minimal_bytes / device_work_s / 1e9;
      const double copy_gbps = 2.0 * original / d2d_s / 1e9;
      std::printf(
          "RESULT bench=pipeline_device tokens=%llu variant=%s staged_1MiB_blocks_s=%.4f "
          "staged_GBps=%.1f h2d_bytes=%llu d2h_bytes=%llu download_in_compress_s=%.4f "
          "copy_to_written_host_s=%.4f device_work_s=%.4f "
          "device_work_GBps=%.1f d2d_copy_GBps=%.1f work_vs_copy=%.1f%% "
          "device_work_vs_saved=%.1f%% compress_device_input_vs_saved=%.1f%%\n",
          static_cast<unsigned long long>(T), variant == 0 ? "manifold0.5+moments"
                                                           : "manifold0.5+moments+kvsplice_int8",
          staged_s, original / staged_s / 1e9, static_cast<unsigned long long>(moved.to_device),
          static_cast<unsigned long long>(moved.to_host), moved.to_host_seconds, download_s,
          device_work_s, work_gbps,
          copy_gbps, 100.0 * work_gbps / copy_gbps, 100.0 * device_work_s / saved_s,
          100.0 * r.seconds_device / saved_s);
      std::printf(
          "RESULT bench=pipeline tokens=%llu variant=%s original_MB=%.1f stored_MB=%.1f "
          "ratio=%.2fx h2d_pageable_s=%.4f h2d_pinned_s=%.4f d2d_copy_s=%.4f "
          "compress_host_input_s=%.4f compress_device_input_s=%.4f serialize_s=%.4f "
          "link_saved_s=%.4f gpu_vs_saved_host_input=%.1f%% gpu_vs_saved_device_input=%.1f%%\n",
          static_cast<unsigned long long>(T), variant == 0 ? "manifold0.5+moments"
                                                           : "manifold0.5+moments+kvsplice_int8",
          original / 1e6, r.stored / 1e6, static_cast<double>(original) / r.stored, pageable_s,
          pinned_s, d2d_s, r.seconds_host, r.seconds_device, r.encode_seconds, saved_s,
          100.0 * r.seconds_host / saved_s, 100.0 * r.seconds_device / saved_s);
      std::fflush(stdout);
    }
  }
  return 0;
}
