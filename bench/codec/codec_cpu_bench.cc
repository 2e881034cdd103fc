// KVSplice on the CPU backend: EncodeValues and DecodeValues (the fused dequantize + expand)
// GB/s over the bytes each reads and writes, next to a memcpy of the output size in the same run;
// then the Hadamard codec (kvcomp/codecs/hq.h, its rows split over the machine's hardware threads)
// at 4 and 3 bits over the same bf16 rows. One RESULT line per configuration; median of
// repetitions.
//
//   kvcomp_bench_cpu_codec [rows_per_head] [heads] [threads]   (defaults 2048, 64, 0 = all)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "bench_projection.h"
#include "common/bench_util.h"
#include "kvcomp/codecs/hq.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/kernels/projection.h"

using namespace kvcomp;


int main(int argc, char** argv) {
  const uint64_t per_head = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 2048;
  const uint32_t heads = argc > 2 ? static_cast<uint32_t>(std::atoi(argv[2])) : 64;
  const int threads = argc > 3 ? std::atoi(argv[3]) : 0;
  const uint32_t d = 128;
  const uint64_t n = per_head * heads;
  auto be = MakeCpuBackend(CpuBackendOptions{threads});
  if (!be.ok()) return 1;
  CodecOps& ops = (*be)->codec();
  const Projection proj = bench::MakeBenchProjection(heads, d);
  std::vector<uint64_t> off(heads + 1);
  for (uint32_t h = 0; h <= heads; ++h) off[h] = h * per_head;
  RowSpan rows;
  rows.row_offsets = off;
  std::vector<uint16_t> v(n * d), out(n * d), out2(n * d);
  uint64_t s = 88172645463325252ull;
  for (auto& x : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    x = FloatToBf16(static_cast<float>(static_cast<int64_t>(s % 2001) - 1000) / 400.0f);
  }
  std::vector<uint8_t> lat(n * d * 2);
  std::vector<uint16_t> sc(n * d);
  const double copy_s =
      kvcomp::bench::MedianSeconds(5, [&] { std::memcpy(out2.data(), v.data(), n * d * 2); });
  const double copy_gbps = 2.0 * n * d * 2 / copy_s / 1e9;
  std::printf("RESULT bench=cpu_codec_copy rows=%llu d=%u threads=%s GBps=%.1f\n",
              static_cast<unsigned long long>(n), d, (*be)->Describe().c_str(), copy_gbps);
  for (ValueCodec codec :
       {ValueCodec::kOrthogonalInt8, ValueCodec::kOrthogonalInt4, ValueCodec::kOrthogonal}) {
    for (uint32_t rank : {32u, 64u, 128u}) {
      ValueCodecParams p{codec, rank, 32, true};
      const double enc = kvcomp::bench::MedianSeconds(3, [&] {
        if (!ops.EncodeValues(proj, p, rows, v.data(), DType::kBF16, lat.data(), sc.data()).ok()) {
          std::abort();
        }
      });
      const double dec = kvcomp::bench::MedianSeconds(3, [&] {
        if (!ops.DecodeValues(proj, p, rows, lat.data(), sc.data(), out.data(), DType::kBF16)
                 .ok()) {
          std::abort();
        }
      });
      const double lat_bytes = n * (p.LatentBytes() + p.Groups() * 2.0);
      const double io = lat_bytes + n * d * 2.0;
      std::printf(
          "RESULT bench=cpu_kvsplice codec=%s rank=%u d=%u rows=%llu encode_ms=%.1f "
          "encode_GBps=%.2f decode_ms=%.1f decode_GBps=%.2f copy_GBps=%.1f\n",
          codec == ValueCodec::kOrthogonal       ? "f16"
          : codec == ValueCodec::kOrthogonalInt8 ? "int8"
                                                 : "int4",
          rank, d, static_cast<unsigned long long>(n), enc * 1e3, io / enc / 1e9, dec * 1e3,
          io / dec / 1e9, copy_gbps);
    }
  }
  for (uint32_t bits : {4u, 3u}) {
    std::vector<uint8_t> rec(n * hq::RowBytes(bits, d));
    const double enc = kvcomp::bench::MedianSeconds(3, [&] {
      if (!hq::EncodeRows(v.data(), DType::kBF16, n, d, bits, rec.data()).ok()) std::abort();
    });
    const double dec = kvcomp::bench::MedianSeconds(3, [&] {
      if (!hq::DecodeRows(rec.data(), n, d, bits, out.data(), DType::kBF16).ok()) std::abort();
    });
    const double io = static_cast<double>(rec.size()) + n * d * 2.0;
    std::printf(
        "RESULT bench=cpu_hq bits=%u d=%u rows=%llu threads=%u encode_ms=%.1f encode_GBps=%.2f "
        "decode_ms=%.1f decode_GBps=%.2f copy_GBps=%.1f\n",
        bits, d, static_cast<unsigned long long>(n),
        std::min(32u, std::max(1u, std::thread::hardware_concurrency())), enc * 1e3, io / enc / 1e9,
        dec * 1e3, io / dec / 1e9, copy_gbps);
  }
  return 0;
}
