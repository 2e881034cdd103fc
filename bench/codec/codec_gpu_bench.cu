// KVSplice on CUDA: the fused dequantize + expand (DecodeValues) and the encoder (EncodeValues),
// GB/s over the bytes each reads and writes, set next to a device-to-device copy timed in the
// same run (target: decode >= 70% of the copy). Two timings per figure: `op` is the public
// CodecOps call (tile table upload, projection cache lookup, stream sync included); `kern` is the
// kernel the op runs, alone on a prepared tile table (the pipelined tensor-core expand where the
// layout allows it), `wmma` the WMMA kernel it replaces. One RESULT line per configuration.
//
//   kvcomp_bench_gpu_codec [rows_per_head] [heads]   (defaults 4096 and 256: 1M rows)
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../gpu/bench_util.cuh"
#include "cuda/codec_kernels.cuh"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/codec_ops.h"
#include "bench_projection.h"
#include "kvcomp/kernels/projection.h"

using namespace kvcomp;

namespace {

const char* Name(ValueCodec c) {
  return c == ValueCodec::kOrthogonal ? "f16" : c == ValueCodec::kOrthogonalInt8 ? "int8" : "int4";
}

template <codec_cuda::LatentKind K>
double TimeExpand(const codec_cuda::DecodeParams& p, size_t tiles, cudaStream_t stream) {
  const size_t smem = codec_cuda::ExpandSmemLayout<128>(p.r_pad, K, p.groups, 2)
                          .total;
  BENCH_CUDA_CHECK(cudaFuncSetAttribute(codec_cuda::ExpandValuesKernel<__nv_bfloat16, 128, K>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  return bench::MedianMicros(
      [&](int) {
        codec_cuda::ExpandValuesKernel<__nv_bfloat16, 128, K>
            <<<static_cast<unsigned>(tiles), codec_cuda::kExpandThreads, smem, stream>>>(p);
      },
      stream, 3, 20);
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t per_head = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 4096;
  const uint32_t heads = argc > 2 ? static_cast<uint32_t>(std::atoi(argv[2])) : 256;
  const uint32_t d = 128;
  const uint64_t n = per_head * heads;
  auto backend = MakeCudaBackend();
  if (!backend.ok()) {
    std::printf("SKIP no CUDA device: %s\n", backend.status().ToString().c_str());
    return 0;
  }
  CodecOps& ops = (*backend)->codec();
  cudaStream_t stream = nullptr;  // ops run on the backend's stream; events on the legacy stream
                                  // still order against it (the op syncs at its end)
  const Projection proj = bench::MakeBenchProjection(heads, d);
  std::vector<uint64_t> off(heads + 1);
  for (uint32_t h = 0; h <= heads; ++h) off[h] = h * per_head;
  RowSpan rows;
  rows.row_offsets = off;

  // Inputs: bf16 values ~ N(0,1)-ish.
  std::vector<uint16_t> host_v(n * d);
  uint64_t state = 88172645463325252ull;
  for (auto& x : host_v) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    x = FloatToBf16(static_cast<float>(static_cast<int64_t>(state % 2001) - 1000) / 400.0f);
  }
  void *dv, *dout, *dlat, *dsc;
  BENCH_CUDA_CHECK(cudaMalloc(&dv, n * d * 2));
  BENCH_CUDA_CHECK(cudaMalloc(&dout, n * d * 2));
  BENCH_CUDA_CHECK(cudaMalloc(&dlat, n * d * 2));
  BENCH_CUDA_CHECK(cudaMalloc(&dsc, n * (d / 1) * 2));
  BENCH_CUDA_CHECK(cudaMemcpy(dv, host_v.data(), n * d * 2, cudaMemcpyHostToDevice));

  const double copy_gbps = bench::CopyGBps(n * d * 2, stream);
  std::printf("RESULT bench=codec_copy rows=%llu d=%u MiB=%.0f GBps=%.0f\n",
              static_cast<unsigned long long>(n), d, n * d * 2 / 1048576.0, copy_gbps);

  for (ValueCodec codec : {ValueCodec::kOrthogonalInt8, ValueCodec::kOrthogonalInt4,
                           ValueCodec::kOrthogonal}) {
    for (uint32_t rank : {32u, 64u, 96u, 128u}) {
      ValueCodecParams params{codec, rank, 32, true};
      const uint64_t lb = params.LatentBytes(), g = params.Groups();
      // Encode through the op (also produces the latent the decode reads).
      const double enc_us = bench::MedianMicros(
          [&](int) {
            absl::Status s = ops.EncodeValues(proj, params, rows, dv, DType::kBF16, dlat,
                                              static_cast<uint16_t*>(dsc));
            if (!s.ok()) {
              std::fprintf(stderr, "encode: %s\n", s.ToString().c_str());
              std::exit(1);
            }
          },
          stream, 2, 10);
      const double enc_bytes = n * (d * 2.0 + lb + g * 2.0);
      const double dec_us = bench::MedianMicros(
          [&](int) {
            absl::Status s = ops.DecodeValues(proj, params, rows, dlat,
                                              static_cast<const uint16_t*>(dsc), dout,
                                              DType::kBF16);
            if (!s.ok()) {
              std::fprintf(stderr, "decode: %s\n", s.ToString().c_str());
              std::exit(1);
            }
          },
          stream, 3, 20);
      // The kernel alone: the same launch the op makes, on a prepared tile table and matrix.
      using S = codec_cuda::DecodeShape<128>;
      std::vector<codec_cuda::Tile> tiles;
      for (uint32_t h = 0; h < heads; ++h) {
        for (uint64_t b = off[h]; b < off[h + 1]; b += S::kTileRows) {
          tiles.push_back({h, static_cast<uint32_t>(std::min<uint64_t>(S::kTileRows, off[h + 1] - b)), b});
        }
      }
      codec_cuda::Tile* dt;
      BENCH_CUDA_CHECK(cudaMalloc(&dt, tiles.size() * sizeof(codec_cuda::Tile)));
      BENCH_CUDA_CHECK(cudaMemcpy(dt, tiles.data(), tiles.size() * sizeof(codec_cuda::Tile),
                                  cudaMemcpyHostToDevice));
      const uint32_t r_pad = (rank + 15) / 16 * 16;
      std::vector<__half> dec(uint64_t{heads} * r_pad * d, __float2half(0.0f));
      for (uint32_t h = 0; h < heads; ++h) {
        for (uint32_t j = 0; j < rank; ++j) {
          for (uint32_t k = 0; k < d; ++k) {
            dec[(uint64_t{h} * r_pad + j) * d + k] = __float2half(
                proj.head_basis(h)[j * d + k] * proj.head_gamma(h)[j]);
          }
        }
      }
      __half* ddec;
      BENCH_CUDA_CHECK(cudaMalloc(&ddec, dec.size() * 2));
      BENCH_CUDA_CHECK(cudaMemcpy(ddec, dec.data(), dec.size() * 2, cudaMemcpyHostToDevice));
      codec_cuda::DecodeParams p{dt, static_cast<const uint8_t*>(dlat),
                                 static_cast<const uint16_t*>(dsc), ddec, dout, rank, r_pad, 32,
                                 static_cast<uint32_t>(g), static_cast<uint32_t>(lb),
                                 codec_cuda::KindOf(codec),
                                 rank % 8 == 0};
      const size_t smem = codec_cuda::DecodeSmemBytes<128>(r_pad);
      BENCH_CUDA_CHECK(cudaFuncSetAttribute(codec_cuda::DecodeValuesKernel<__nv_bfloat16, 128>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
      const double wmma_us = bench::MedianMicros(
          [&](int) {
            codec_cuda::DecodeValuesKernel<__nv_bfloat16, 128>
                <<<static_cast<unsigned>(tiles.size()), codec_cuda::kDecodeThreads, smem,
                   stream>>>(p);
          },
          stream, 3, 20);
      BENCH_CUDA_CHECK(cudaFree(dt));
      // The pipelined tensor-core expand (what the op runs for these layouts).
      double kern_us = wmma_us;
      if (codec_cuda::ExpandEligible(rank, 32, static_cast<uint32_t>(lb), p.kind,
                                     reinterpret_cast<uintptr_t>(dlat))) {
        const auto slots = codec_cuda::ExpandSlots(p, 128, DType::kBF16);
        if (!slots.ok()) {
          std::fprintf(stderr, "expand: %s\n", slots.status().ToString().c_str());
          return 1;
        }
        const std::vector<codec_cuda::Tile> xt = codec_cuda::ExpandTiles(
            off.data(), heads, codec_cuda::ExpandShape<128>::M, *slots);
        BENCH_CUDA_CHECK(cudaMalloc(&dt, xt.size() * sizeof(codec_cuda::Tile)));
        BENCH_CUDA_CHECK(cudaMemcpy(dt, xt.data(), xt.size() * sizeof(codec_cuda::Tile),
                                    cudaMemcpyHostToDevice));
        p.tiles = dt;
        kern_us = p.kind == codec_cuda::LatentKind::kInt8
                      ? TimeExpand<codec_cuda::LatentKind::kInt8>(p, xt.size(), stream)
                  : p.kind == codec_cuda::LatentKind::kInt4
                      ? TimeExpand<codec_cuda::LatentKind::kInt4>(p, xt.size(), stream)
                      : TimeExpand<codec_cuda::LatentKind::kF16>(p, xt.size(), stream);
        BENCH_CUDA_CHECK(cudaFree(dt));
      }
      BENCH_CUDA_CHECK(cudaFree(ddec));
      const double dec_bytes = n * (lb + g * 2.0 + d * 2.0);
      const double op_gbps = dec_bytes / (dec_us * 1e3), kern_gbps = dec_bytes / (kern_us * 1e3);
      std::printf(
          "RESULT bench=kvsplice_decode codec=%s rank=%u d=%u rows=%llu bytes_per_row=%.0f "
          "op_us=%.1f op_GBps=%.0f kern_us=%.1f kern_GBps=%.0f copy_GBps=%.0f "
          "kern_vs_copy=%.2f op_vs_copy=%.2f wmma_us=%.1f wmma_vs_copy=%.2f\n",
          Name(codec), rank, d, static_cast<unsigned long long>(n), dec_bytes / n, dec_us, op_gbps,
          kern_us, kern_gbps, copy_gbps, kern_gbps / copy_gbps, op_gbps / copy_gbps, wmma_us,
          dec_bytes / (wmma_us * 1e3) / copy_gbps);
      std::printf(
          "RESULT bench=kvsplice_encode codec=%s rank=%u d=%u rows=%llu op_us=%.1f op_GBps=%.0f "
          "Mrows_per_s=%.0f\n",
          Name(codec), rank, d, static_cast<unsigned long long>(n), enc_us,
          enc_bytes / (enc_us * 1e3), n / enc_us);
    }
  }
  cudaFree(dv);
  cudaFree(dout);
  cudaFree(dlat);
  cudaFree(dsc);
  return 0;
}
