// CompressToDevice on the CUDA backend, with nothing downloaded: the device work of a
// compression (score, select, compact, moments, the moment-aware rescoring, the key codecs and
// KVSplice encoding with its outlier search), timed until the cache's arrays are complete in
// device memory, then the cache's format written on the device (EncodeOnDevice, what kvcompd's
// store stage does next) and its one Download, each timed alone. A Llama-3.1-8B-shaped cache
// (32 layers, 8 kv heads, head_dim 128, bf16), manifold 0.5 + moments, at each token count
// given, for: eviction alone, moment-aware eviction, KVSplice int8 (int8 keys, int8 latents,
// outliers raw) and KVSplice int4 (int4 keys, int4 latents at per-layer ranks), each from two
// inputs: input=layers, one device buffer per layer (the layer-by-layer loop), and input=put,
// the cache staged as kvcompd stages a put (one DeviceKv: the layers one view, compressed in
// layer groups, with the keys' sums the staging made). The projection is calibrated on the CPU
// from the same values, not timed. Each time is set against the link time the cache's saved
// bytes (original less the encoded bytes) buy back at 50 GB/s (400 Gb/s) and against a
// device-to-device copy of its minimal bytes (K and V read, the cache written). Wall-clock
// medians of --reps runs after one untimed run; one RESULT line per policy, input and token
// count (codec_stage_s: the key codecs and KVSplice encoding with its outlier search, to their
// end, from separate runs; put_device_s: compress_to_device_s + format_s).
// Then the codec ops alone on the kept rows of a put (half the tokens of every layer and head,
// device memory): the value encoder of every layer in one call (int8 at rank 64, with the
// outlier measure, and int4 at the tuned per-layer ranks) and the int8 key encoder, each over
// the bytes it reads and writes against the same device copy (bench=device_codec_op), and the
// Hadamard codec's encoder (hq4, hq3) and decoder over the same rows, with the CPU reference's
// time on them and whether its records equal the device's (op=hq*_host_reference).
//
// Last, the calibrated basis codec's device encoder and decoder on every row of a put (PqOps).
//
// Usage: kvcomp_bench_gpu_device_codec [--tokens 8192,32768] [--reps 5] [--put-only]
//            [--profile] [--keep-pool] [--pq-only]
//   --pq-only    the calibrated basis codec's ops alone (PqOps)
//   --put-only   the staged put only: no layer-loop input, no download, no codec ops
//   --profile    one more put of each variant (staged input) between cudaProfilerStart and
//                cudaProfilerStop, for a profiler started with its capture off (ncu
//                --profile-from-start off; bench/gpu/ncu_profile.sh's "put" case)
//   --keep-pool  the backend's pool keeps 16 GiB of freed memory mapped (default 64 MiB)
//   KVCOMP_BENCH_VARIANTS=int8,aware runs only the variants whose names contain one of these
//   (an entry ending in '$' names one variant exactly: manifold0.5+moments$ is the eviction).
#include <cuda_profiler_api.h>
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
#include "absl/strings/str_format.h"
#include "kvcomp/codecs/hq.h"
#include "kvcomp/codecs/pq.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/device_format.h"
#include "kvcomp/kernels/pipeline.h"

namespace {

using Clock = std::chrono::steady_clock;
using kvcomp::KvLayout;
using kvcomp::bench::ExitIfError;
using kvcomp::bench::Median;

// KVCOMP_BENCH_VARIANTS: a comma-separated list; a variant runs when its name contains one of
// them, or is one ending in '$' without it (unset: every variant).
bool Selected(const std::string& name) {
  const char* env = std::getenv("KVCOMP_BENCH_VARIANTS");
  if (env == nullptr || *env == '\0') return true;
  std::string list = env;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string want = list.substr(at, comma - at);
    if (!want.empty() && want.back() == '$') {
      if (name == want.substr(0, want.size() - 1)) return true;
    } else if (!want.empty() && name.find(want) != std::string::npos) {
      return true;
    }
    at = comma + 1;
  }
  return false;
}

// The calibrated basis codec (the codec preset: pq keys at 3 bits, values at 2) on a whole put's
// rows, every token of every layer and kv head (T rows a head, bf16, device memory): the encoder
// of each tensor in one call and the decoder back to bf16, as rows/s and GB/s of bf16 input
// (output=records for the encoder, bf16 rows for the decoder) against the device copy. The bases
// are fitted on the CPU on the first 1024 tokens of the first head (not timed) and used for
// every head; host_s is the CPU library (pq::EncodeRows on the machine's threads) on the first
// 4 heads' rows, whose records must equal the device's (records_identical).
void PqOps(kvcomp::Backend& gpu, const KvLayout& llama, uint64_t T,
           const std::vector<uint16_t>& k, const std::vector<uint16_t>& v, int reps,
           double copy_gbps) {
  const uint32_t heads = llama.num_layers * llama.num_kv_heads, d = llama.head_dim;
  const uint64_t n = uint64_t{heads} * T, fit_rows = std::min<uint64_t>(T, 1024);
  std::vector<uint64_t> off(heads + 1);
  for (uint32_t h = 0; h <= heads; ++h) off[h] = uint64_t{h} * T;
  std::vector<float> kf(fit_rows * d), vf(fit_rows * d);
  for (uint64_t i = 0; i < fit_rows * d; ++i) {
    kf[i] = kvcomp::Bf16ToFloat(k[i]);
    vf[i] = kvcomp::Bf16ToFloat(v[i]);
  }
  auto one = kvcomp::pq::FitCalibration(kf, vf, fit_rows, 1, 1, d, 3, 2);
  ExitIfError(one.status(), "pq fit");
  kvcomp::pq::Calibration cal;
  for (int t = 0; t < 2; ++t) {
    const kvcomp::pq::Basis& src = t == 0 ? one->keys : one->values;
    kvcomp::pq::Basis& b = t == 0 ? cal.keys : cal.values;
    b.num_layers = llama.num_layers;
    b.num_kv_heads = llama.num_kv_heads;
    b.head_dim = d;
    b.bits_total = src.bits_total;
    for (uint32_t h = 0; h < heads; ++h) {
      b.mean.insert(b.mean.end(), src.mean.begin(), src.mean.end());
      b.scale.insert(b.scale.end(), src.scale.begin(), src.scale.end());
      b.inv_scale.insert(b.inv_scale.end(), src.inv_scale.begin(), src.inv_scale.end());
      b.widths.insert(b.widths.end(), src.widths.begin(), src.widths.end());
      b.basis.insert(b.basis.end(), src.basis.begin(), src.basis.end());
    }
  }
  ExitIfError(cal.Seal(), "pq seal");
  auto time_op = [&](const std::function<absl::Status()>& op) {
    std::vector<double> t;
    for (int rep = 0; rep <= reps; ++rep) {
      ExitIfError(gpu.Synchronize(), "synchronize");
      const Clock::time_point t0 = Clock::now();
      ExitIfError(op(), "op");
      ExitIfError(gpu.Synchronize(), "synchronize");
      if (rep > 0) t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return Median(t);
  };
  const uint64_t layer_bytes = uint64_t{llama.num_kv_heads} * T * d * 2;
  auto in = kvcomp::Buffer::Allocate(gpu.allocator(), n * d * 2);
  auto back = kvcomp::Buffer::Allocate(gpu.allocator(), n * d * 2);
  ExitIfError(in.status(), "pq rows");
  ExitIfError(back.status(), "pq decoded");
  for (int t = 0; t < 2; ++t) {
    const std::vector<uint16_t>& src = t == 0 ? k : v;
    const kvcomp::pq::Basis& b = t == 0 ? cal.keys : cal.values;
    const uint64_t fp = t == 0 ? cal.key_fingerprint : cal.value_fingerprint;
    const char* name = t == 0 ? "k3" : "v2";
    for (uint32_t l = 0; l < llama.num_layers; ++l) {
      ExitIfError(gpu.CopyFromHost(in->as<uint8_t>() + l * layer_bytes, src.data(), layer_bytes),
                  "upload");
    }
    const uint64_t rb = b.RecordBytes();
    auto rec = kvcomp::Buffer::Allocate(gpu.allocator(), n * rb);
    ExitIfError(rec.status(), "pq records");
    // The first call uploads the basis (once per fingerprint); its time is reported apart.
    const Clock::time_point u0 = Clock::now();
    ExitIfError(gpu.codec().EncodePq(b, fp, off, in->data(), kvcomp::DType::kBF16, rec->data()),
                "pq encode");
    ExitIfError(gpu.Synchronize(), "synchronize");
    const double first_s = std::chrono::duration<double>(Clock::now() - u0).count();
    const double enc_s = time_op([&] {
      return gpu.codec().EncodePq(b, fp, off, in->data(), kvcomp::DType::kBF16, rec->data());
    });
    const double dec_s = time_op([&] {
      return gpu.codec().DecodePq(b, fp, off, rec->data(), back->data(), kvcomp::DType::kBF16);
    });
    const uint64_t check_rows = 4 * T;
    std::vector<uint8_t> host_rows(check_rows * d * 2), host_rec(check_rows * rb),
        dev_rec(check_rows * rb);
    ExitIfError(gpu.CopyToHost(host_rows.data(), in->data(), host_rows.size()), "download");
    ExitIfError(gpu.CopyToHost(dev_rec.data(), rec->data(), dev_rec.size()), "download");
    const Clock::time_point h0 = Clock::now();
    for (uint32_t h = 0; h < 4; ++h) {
      ExitIfError(kvcomp::pq::EncodeRows(b, h, host_rows.data() + h * T * d * 2,
                                         kvcomp::DType::kBF16, T, host_rec.data() + h * T * rb,
                                         /*threads=*/0),
                  "host pq encode");
    }
    const double host_s = std::chrono::duration<double>(Clock::now() - h0).count();
    const double in_bytes = static_cast<double>(n * d * 2);
    for (int which = 0; which < 2; ++which) {
      const double secs = which == 0 ? enc_s : dec_s;
      const double moved = in_bytes + static_cast<double>(n * rb);
      std::printf(
          "RESULT bench=device_codec_op tokens=%llu op=%s_pq_%s rows=%llu s=%.5f "
          "rows_per_s=%.3g input_GBps=%.1f GBps=%.1f d2d_copy_GBps=%.1f vs_copy=%.1f%%%s\n",
          static_cast<unsigned long long>(T), which == 0 ? "encode" : "decode", name,
          static_cast<unsigned long long>(n), secs, static_cast<double>(n) / secs,
          in_bytes / secs / 1e9, moved / secs / 1e9, copy_gbps,
          100.0 * (moved / secs / 1e9) / copy_gbps,
          which == 0 ? absl::StrFormat(" first_call_s=%.4f", first_s).c_str() : "");
    }
    std::printf(
        "RESULT bench=device_codec_op tokens=%llu op=pq_%s_host_reference rows=%llu host_s=%.4f "
        "device_over_host=%.1fx records_identical=%d\n",
        static_cast<unsigned long long>(T), name, static_cast<unsigned long long>(check_rows),
        host_s, host_s / (enc_s * static_cast<double>(check_rows) / static_cast<double>(n)),
        dev_rec == host_rec ? 1 : 0);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  kvcomp::bench::TokensAndReps args{{8192, 32768},
                                    5,
                                    {{"--put-only", false},
                                     {"--profile", false},
                                     {"--keep-pool", false},
                                     {"--pq-only", false}}};
  if (!kvcomp::bench::ParseTokensAndReps(argc, argv, "kvcomp_bench_gpu_device_codec", &args))
    return 2;
  const int reps = args.reps;
  const bool put_only = args.switches["--put-only"];
  const bool profile = args.switches["--profile"];
  const bool pq_only = args.switches["--pq-only"];
  kvcomp::bench::Backends backends = kvcomp::bench::MakeBackends();
  // --keep-pool: the backend's pool keeps 16 GiB of freed memory mapped across host waits (the
  // default keeps 64 MiB), to see what mapping a put's memory afresh costs.
  kvcomp::CudaBackendOptions cuda_options;
  if (args.switches["--keep-pool"]) {
    cuda_options.pool_keep_bytes = uint64_t{16} << 30;
    backends.gpu = kvcomp::bench::ValueOrExit(kvcomp::MakeCudaBackend(cuda_options), "cuda");
  }
  const uint64_t pool_keep = cuda_options.pool_keep_bytes;
  kvcomp::Backend& gpu = *backends.gpu;
  const KvLayout llama = kvcomp::bench::Llama8bLayout();
  constexpr double kLinkBytesPerSecond = 50e9;

  for (const uint64_t T : args.tokens) {
    // Every layer its own random K and V (values of a decaying spectrum, so the projection has
    // structure to find), generated once per layer pair and uploaded.
    const uint64_t layer_elems = uint64_t{llama.num_kv_heads} * T * llama.head_dim;
    std::vector<uint16_t> k(layer_elems), v(layer_elems);
    std::mt19937 rng(11);
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (uint64_t i = 0; i < layer_elems; ++i) {
      k[i] = kvcomp::FloatToBf16(g(rng) + 0.5f);
      v[i] = kvcomp::FloatToBf16(g(rng) * std::pow(0.97f, static_cast<float>(i % 128)));
    }
    const kvcomp::KvCacheView host = kvcomp::bench::SameLayersView(llama, T, k.data(), v.data());
    const kvcomp::bench::DeviceCache on_device = kvcomp::bench::Upload(gpu, host);
    const kvcomp::KvCacheView& device = on_device.view;
    const uint64_t original = llama.CacheBytes(T);

    // A device-to-device copy of the original bytes, for the copy-speed comparison.
    const double copy_s = kvcomp::bench::DeviceCopySeconds(gpu, on_device, reps);
    const double copy_gbps = static_cast<double>(2 * original) / copy_s / 1e9;
    if (pq_only) {
      PqOps(gpu, llama, T, k, v, reps, copy_gbps);
      continue;
    }

    const auto projection = kvcomp::bench::CalibrateProjection(*backends.cpu, host);
    auto tuned = std::make_shared<kvcomp::Projection>(*projection);
    tuned->tuned_rank.assign(llama.num_layers, 0);
    tuned->tuned_error.assign(llama.num_layers, 0.01);
    for (uint32_t l = 0; l < llama.num_layers; ++l) tuned->tuned_rank[l] = 32 + 2 * (l % 16);
    ExitIfError(tuned->Seal(), "seal");

    kvcomp::CompressionPolicy evict;
    evict.scorer = kvcomp::Scorer::kManifold;
    evict.ratio = 0.5;
    evict.moments = true;
    struct Variant {
      const char* name;
      kvcomp::CompressionPolicy policy;
      std::shared_ptr<const kvcomp::Projection> projection;
    };
    std::vector<Variant> variants;
    variants.push_back({"manifold0.5+moments", evict, nullptr});
    kvcomp::CompressionPolicy aware = evict;
    aware.moment_aware = true;
    variants.push_back({"manifold0.5+moments+moment_aware", aware, nullptr});
    kvcomp::CompressionPolicy int8 = evict;
    int8.key_codec = kvcomp::KeyCodec::kInt8;
    int8.value_codec = kvcomp::ValueCodec::kOrthogonalInt8;
    variants.push_back({"manifold0.5+moments+kvsplice_int8", int8, projection});
    kvcomp::CompressionPolicy int4 = evict;
    int4.key_codec = kvcomp::KeyCodec::kInt4;
    int4.value_codec = kvcomp::ValueCodec::kOrthogonalInt4;
    variants.push_back({"manifold0.5+moments+kvsplice_int4_tuned_ranks", int4, tuned});

    // The put as kvcompd stages it: one DeviceKv, the layers one view, the keys' sums made
    // while the blocks arrived (staging not timed).
    const kvcomp::bench::StagedCache staged = kvcomp::bench::StageAsPut(gpu, host);

    for (const Variant& var : variants) {
      if (!Selected(var.name)) continue;
      kvcomp::CompressOptions options;
      options.projection = var.projection;
      for (int input = 0; input < 2; ++input) {
        // input 0: one buffer per layer (the layer loop); 1: the staged put (layer groups).
        const kvcomp::KvCacheView& view = input == 0 ? device : staged.view;
        if (input == 0 && put_only) continue;
        kvcomp::TransferBytes moved;
        kvcomp::CompressedCache cache;
        uint64_t encoded_bytes = 0;
        std::vector<double> work, format, download, codec_stage;
        for (int rep = 0; rep <= reps; ++rep) {  // the first run untimed
          const Clock::time_point t0 = Clock::now();
          auto dc = kvcomp::CompressToDevice(gpu, view, var.policy, options);
          ExitIfError(dc.status(), "compress to device");
          ExitIfError(gpu.Synchronize(), "synchronize");
          const Clock::time_point t1 = Clock::now();
          // The cache's format on the device (what the daemon's store stage does next).
          auto enc = kvcomp::EncodeOnDevice(gpu, *dc);
          ExitIfError(enc.status(), "encode on device");
          const Clock::time_point t2 = Clock::now();
          encoded_bytes = enc->size;
          if (rep > 0) {
            work.push_back(std::chrono::duration<double>(t1 - t0).count());
            format.push_back(std::chrono::duration<double>(t2 - t1).count());
          }
          if (!put_only) {
            const Clock::time_point t3 = Clock::now();
            moved = {};
            auto c = dc->Download(gpu, &moved);
            ExitIfError(c.status(), "download");
            if (rep > 0) {
              download.push_back(std::chrono::duration<double>(Clock::now() - t3).count());
            }
            cache = std::move(*c);
          }
        }
        for (int rep = 0; rep < reps; ++rep) {  // the codec stage alone (it waits at its end)
          kvcomp::TransferBytes t;
          kvcomp::CompressOptions o = options;
          o.transfers = &t;
          auto dc = kvcomp::CompressToDevice(gpu, view, var.policy, o);
          ExitIfError(dc.status(), "compress to device (codec stage)");
          ExitIfError(gpu.Synchronize(), "synchronize");
          codec_stage.push_back(t.encode_seconds);
        }
        if (profile && input == 1) {
          // One more put for a profiler that starts at cudaProfilerStart (ncu
          // --profile-from-start off): the compression and the format, nothing else.
          ExitIfError(gpu.Synchronize(), "synchronize");
          cudaProfilerStart();
          auto dc = kvcomp::CompressToDevice(gpu, view, var.policy, options);
          ExitIfError(dc.status(), "compress to device (profiled)");
          auto enc = kvcomp::EncodeOnDevice(gpu, *dc);
          ExitIfError(enc.status(), "encode on device (profiled)");
          ExitIfError(gpu.Synchronize(), "synchronize");
          cudaProfilerStop();
        }
        const double work_s = Median(work);
        const double format_s = Median(format);
        const double put_s = work_s + format_s;
        const uint64_t stored = encoded_bytes;
        const double saved_s = static_cast<double>(original - std::min(original, stored)) /
                               kLinkBytesPerSecond;
        const double minimal = static_cast<double>(original + stored);
        std::printf(
            "RESULT bench=device_codec tokens=%llu variant=%s input=%s original_MB=%.1f "
            "stored_MB=%.1f ratio=%.2fx outlier_rows=%lld compress_to_device_s=%.4f "
            "codec_stage_s=%.4f format_s=%.4f put_device_s=%.4f download_s=%.4f "
            "link_saved_s=%.4f work_vs_saved=%.1f%% put_vs_saved=%.1f%% work_GBps=%.1f "
            "d2d_copy_GBps=%.1f work_vs_copy=%.1f%% pool_keep_MiB=%llu\n",
            static_cast<unsigned long long>(T), var.name, input == 0 ? "layers" : "put",
            original / 1e6, stored / 1e6,
            static_cast<double>(original) / static_cast<double>(stored),
            put_only ? -1LL : static_cast<long long>(cache.raw_value_rows.size()), work_s,
            Median(codec_stage), format_s, put_s, download.empty() ? 0.0 : Median(download),
            saved_s, 100.0 * work_s / saved_s, 100.0 * put_s / saved_s,
            minimal / work_s / 1e9, copy_gbps, 100.0 * (minimal / work_s / 1e9) / copy_gbps,
            static_cast<unsigned long long>(pool_keep >> 20));
        std::fflush(stdout);
      }
    }
    if (put_only) continue;

    // The codec ops alone on a put's kept rows: every layer's first T / 2 tokens of each head.
    {
      const uint32_t heads = llama.num_layers * llama.num_kv_heads, d = llama.head_dim;
      const uint64_t kept = T / 2, n = uint64_t{heads} * kept;
      std::vector<uint64_t> off(heads + 1);
      for (uint32_t h = 0; h <= heads; ++h) off[h] = uint64_t{h} * kept;
      auto in = kvcomp::Buffer::Allocate(gpu.allocator(), n * d * 2);
      ExitIfError(in.status(), "rows");
      for (uint32_t l = 0; l < llama.num_layers; ++l) {  // the layer's values, half its tokens
        const uint64_t bytes = n / llama.num_layers * d * 2;
        ExitIfError(gpu.CopyFromHost(in->as<uint8_t>() + l * bytes, v.data(), bytes), "upload");
      }
      auto time_op = [&](const std::function<absl::Status()>& op) {
        std::vector<double> t;
        for (int rep = 0; rep <= reps; ++rep) {
          ExitIfError(gpu.Synchronize(), "synchronize");
          const Clock::time_point t0 = Clock::now();
          ExitIfError(op(), "op");
          ExitIfError(gpu.Synchronize(), "synchronize");
          if (rep > 0) t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        }
        return Median(t);
      };
      auto report = [&](const char* op, double secs, double bytes) {
        const double gbps = bytes / secs / 1e9;
        std::printf(
            "RESULT bench=device_codec_op tokens=%llu op=%s rows=%llu s=%.5f GBps=%.1f "
            "d2d_copy_GBps=%.1f vs_copy=%.1f%%\n",
            static_cast<unsigned long long>(T), op, static_cast<unsigned long long>(n), secs,
            gbps, copy_gbps, 100.0 * gbps / copy_gbps);
        std::fflush(stdout);
      };
      for (int which = 0; which < 2; ++which) {
        kvcomp::ValueCodecParams params;
        params.codec = which == 0 ? kvcomp::ValueCodec::kOrthogonalInt8
                                  : kvcomp::ValueCodec::kOrthogonalInt4;
        const kvcomp::Projection& proj = which == 0 ? *projection : *tuned;
        std::vector<uint32_t> ranks(llama.num_layers, 64);
        if (which == 1) ranks = tuned->tuned_rank;
        params.rank = *std::max_element(ranks.begin(), ranks.end());
        uint64_t lat = 0, sc = 0;
        for (uint32_t r : ranks) {
          kvcomp::ValueCodecParams lp = params;
          lp.rank = r;
          lat += n / llama.num_layers * lp.LatentBytes();
          sc += n / llama.num_layers * lp.Groups();
        }
        auto out = kvcomp::Buffer::Allocate(gpu.allocator(), lat + 2 * sc + 8 * n + 64);
        ExitIfError(out.status(), "latents");
        uint8_t* latent = out->as<uint8_t>();
        auto* scales = reinterpret_cast<uint16_t*>(latent + (lat + 15) / 16 * 16);
        auto* energy = reinterpret_cast<float*>(latent + (lat + 2 * sc + 31) / 16 * 16);
        float* lost = energy + n;
        const double secs = time_op([&] {
          return gpu.codec().EncodeValueLayers(proj, params, ranks, off, in->data(),
                                               kvcomp::DType::kBF16, latent, scales, energy,
                                               lost);
        });
        report(which == 0 ? "encode_values_int8_rank64" : "encode_values_int4_tuned_ranks", secs,
               static_cast<double>(n * d * 2 + lat + 2 * sc + 8 * n));
      }
      auto keys_out = kvcomp::Buffer::Allocate(gpu.allocator(), n * d + heads * d * 4 + 64);
      ExitIfError(keys_out.status(), "keys");
      kvcomp::RowSpan rows;
      rows.row_offsets = off;
      const double key_s = time_op([&] {
        return gpu.codec().EncodeKeys(kvcomp::KeyCodec::kInt8, rows, d, in->data(),
                                      kvcomp::DType::kBF16, keys_out->data(),
                                      reinterpret_cast<float*>(keys_out->as<uint8_t>() + n * d));
      });
      report("encode_keys_int8", key_s, static_cast<double>(n * d * 3 + heads * d * 4));

      // The Hadamard codec (the codec and balanced presets: hq4 keys, hq3 values): every row of
      // the put in one launch, and the decoder back to bf16; host_s is the CPU reference
      // (hq::EncodeRows over the machine's threads) on the same rows from host memory, one run.
      std::vector<uint8_t> host_rows(n * d * 2);
      ExitIfError(gpu.CopyToHost(host_rows.data(), in->data(), host_rows.size()), "download");
      for (uint32_t bits : {4u, 3u}) {
        const uint64_t rb = kvcomp::hq::RowBytes(bits, d);
        auto rec = kvcomp::Buffer::Allocate(gpu.allocator(), n * rb);
        ExitIfError(rec.status(), "records");
        const double enc_s = time_op([&] {
          return gpu.codec().EncodeHq(bits, n, d, in->data(), kvcomp::DType::kBF16, rec->data());
        });
        std::vector<uint8_t> host_rec(n * rb);
        const Clock::time_point h0 = Clock::now();
        ExitIfError(kvcomp::hq::EncodeRows(host_rows.data(), kvcomp::DType::kBF16, n, d, bits,
                                           host_rec.data()),
                    "host encode");
        const double host_s = std::chrono::duration<double>(Clock::now() - h0).count();
        std::vector<uint8_t> dev_rec(n * rb);
        ExitIfError(gpu.CopyToHost(dev_rec.data(), rec->data(), dev_rec.size()), "download");
        const bool same = dev_rec == host_rec;
        std::printf("RESULT bench=device_codec_op tokens=%llu op=hq%u_host_reference rows=%llu "
                    "host_s=%.4f device_over_host=%.1fx records_identical=%d\n",
                    static_cast<unsigned long long>(T), bits, static_cast<unsigned long long>(n),
                    host_s, host_s / enc_s, same ? 1 : 0);
        report(bits == 4 ? "encode_hq4" : "encode_hq3", enc_s,
               static_cast<double>(n * d * 2 + n * rb));
        auto back = kvcomp::Buffer::Allocate(gpu.allocator(), n * d * 2);
        ExitIfError(back.status(), "decoded");
        const double dec_s = time_op([&] {
          return gpu.codec().DecodeHq(bits, n, d, rec->data(), back->data(),
                                      kvcomp::DType::kBF16);
        });
        report(bits == 4 ? "decode_hq4" : "decode_hq3", dec_s,
               static_cast<double>(n * d * 2 + n * rb));
      }
    }
    PqOps(gpu, llama, T, k, v, reps, copy_gbps);
  }
  return 0;
}
