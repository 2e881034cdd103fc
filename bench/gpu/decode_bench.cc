// One decode step of kvcomp::decode on the CUDA backend: attention of one query per q head over
// every layer of a Llama-3.1-8B-shaped compressed cache (32 layers, 8 kv heads, 32 q heads,
// head_dim 128, bf16; manifold, ratio 0.5, moments) placed on the device once, for the raw
// cache (plain and with the moment correction) and for its KVSplice encoding (int8 keys, int8
// latents, outliers raw), decoded on the device layer by layer before the dense attention kernel
// (kvsplice_int8_corrected, Decoder::Attend's default) and attended over its latent codes
// (kvsplice_int8_corrected_latent, AttendParams::expand_in_attention). Queries and outputs stay in device memory. Median of
// --reps steps, after a warm-up step; the bytes of the cache each step reads are set against a
// device copy of the same bytes; waited_step_ms is the same step waiting for the stream after
// every layer. One RESULT line per (tokens, variant).
//
// Usage: kvcomp_bench_gpu_decode [--tokens 8192,32768] [--reps 20]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/bench_util.h"
#include "common/engine_bench.h"
#include "kvcomp/decode/attention.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/pipeline.h"

namespace {

using Clock = std::chrono::steady_clock;
using kvcomp::DType;
using kvcomp::HeadsView;
using kvcomp::KvLayout;
using kvcomp::bench::ExitIfError;

}  // namespace

int main(int argc, char** argv) {
  kvcomp::bench::TokensAndReps args{{8192, 32768}, 20};
  if (!kvcomp::bench::ParseTokensAndReps(argc, argv, "kvcomp_bench_gpu_decode", &args)) return 2;
  const kvcomp::bench::Backends backends = kvcomp::bench::MakeBackends();
  kvcomp::Backend& gpu = *backends.gpu;
  const KvLayout llama = kvcomp::bench::Llama8bLayout();
  const auto stream = static_cast<cudaStream_t>(gpu.native_stream());

  for (const uint64_t T : args.tokens) {
    const uint64_t layer_elems = uint64_t{llama.num_kv_heads} * T * llama.head_dim;
    std::vector<uint16_t> k(layer_elems), v(layer_elems);
    std::mt19937 rng(11);
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (uint64_t i = 0; i < layer_elems; ++i) {
      k[i] = kvcomp::FloatToBf16(g(rng));
      v[i] = kvcomp::FloatToBf16(g(rng));
    }
    const kvcomp::KvCacheView view = kvcomp::bench::SameLayersView(llama, T, k.data(), v.data());
    const auto projection = kvcomp::bench::CalibrateProjection(*backends.cpu, view);

    kvcomp::CompressionPolicy evict;  // manifold, ratio 0.5, with moments (the correction)
    evict.moments = true;
    auto raw = kvcomp::Compress(gpu, view, evict);
    ExitIfError(raw.status(), "compress");
    kvcomp::CompressionPolicy splice = evict;
    splice.key_codec = kvcomp::KeyCodec::kInt8;
    splice.value_codec = kvcomp::ValueCodec::kOrthogonalInt8;
    kvcomp::CompressOptions with_projection;
    with_projection.projection = projection;
    auto encoded = kvcomp::Compress(gpu, view, splice, with_projection);
    ExitIfError(encoded.status(), "compress kvsplice");

    // Queries and outputs on the device: [32 q heads][1][128].
    const uint64_t q_elems = uint64_t{llama.num_q_heads} * 128;
    std::vector<float> q(q_elems);
    for (float& x : q) x = g(rng);
    auto dq = kvcomp::Buffer::Allocate(gpu.allocator(), q_elems * 4);
    auto dout = kvcomp::Buffer::Allocate(gpu.allocator(), q_elems * 4);
    ExitIfError(dq.status(), "queries");
    ExitIfError(dout.status(), "out");
    ExitIfError(gpu.CopyFromHost(dq->data(), q.data(), q_elems * 4), "queries");

    struct Variant {
      const char* name;
      const kvcomp::CompressedCache* cache;
      bool correct;
      bool expand_in_attention;
    };
    const Variant variants[] = {{"raw_plain", &*raw, false, true},
                                {"raw_corrected", &*raw, true, true},
                                {"kvsplice_int8_corrected", &*encoded, true, false},
                                {"kvsplice_int8_corrected_latent", &*encoded, true, true}};
    for (const Variant& var : variants) {
      const Clock::time_point p0 = Clock::now();
      auto placed = kvcomp::decode::ResidentCache::Place(gpu, *var.cache, projection);
      ExitIfError(placed.status(), "place");
      const double place_s = std::chrono::duration<double>(Clock::now() - p0).count();
      kvcomp::decode::Decoder decoder(gpu);
      kvcomp::decode::AttendParams p;
      p.queries = HeadsView::Dense(dq->data(), DType::kF32, llama.num_q_heads, 1, 128,
                                   kvcomp::MemorySpace::kDevice);
      p.correct = var.correct;
      p.expand_in_attention = var.expand_in_attention;
      p.out = dout->as<float>();
      p.out_space = kvcomp::MemorySpace::kDevice;
      // One step; `each_layer`: waiting for the stream after every layer (as the attention op
      // did before it left its workspace to the stream-ordered pool), what the host waits cost.
      auto step = [&](bool each_layer) {
        for (uint32_t l = 0; l < llama.num_layers; ++l) {
          p.layer = l;
          ExitIfError(decoder.Attend(**placed, p), "attend");
          if (each_layer) ExitIfError(gpu.Synchronize(), "sync");
        }
        ExitIfError(gpu.Synchronize(), "sync");
      };
      const double step_ms = 1e3 * kvcomp::bench::MedianSeconds(args.reps, [&] { step(false); });
      const double waited_ms =
          1e3 * kvcomp::bench::MedianSeconds(args.reps, [&] { step(true); });
      // The cache bytes one step reads: every section Place copied.
      const uint64_t bytes = (*placed)->transfers().host_to_device_bytes;
      // A device copy of as many bytes (read + write), for scale.
      void* a = nullptr;
      void* b = nullptr;
      cudaMalloc(&a, bytes);
      cudaMalloc(&b, bytes);
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream);
      cudaEventRecord(e0, stream);
      for (int r = 0; r < 5; ++r) cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream);
      cudaEventRecord(e1, stream);
      cudaEventSynchronize(e1);
      float copy_ms = 0;
      cudaEventElapsedTime(&copy_ms, e0, e1);
      copy_ms /= 5;
      cudaFree(a);
      cudaFree(b);
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
      std::printf(
          "RESULT bench=decode tokens=%llu kept_per_head=%llu variant=%s cache_MB=%.1f "
          "place_s=%.3f step_ms=%.3f per_layer_us=%.1f copy_same_bytes_ms=%.3f "
          "step_vs_copy=%.1fx waited_step_ms=%.3f h2d_per_step=%llu d2h_per_step=%llu\n",
          static_cast<unsigned long long>(T),
          static_cast<unsigned long long>(var.cache->total_kept() / var.cache->num_heads()),
          var.name, bytes / 1e6, place_s, step_ms, 1e3 * step_ms / llama.num_layers, copy_ms,
          step_ms / copy_ms, waited_ms,
          static_cast<unsigned long long>(decoder.transfers().host_to_device_bytes),
          static_cast<unsigned long long>(decoder.transfers().device_to_host_bytes));
      std::fflush(stdout);
    }
  }
  return 0;
}
