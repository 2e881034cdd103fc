// The calibrated basis codec (kvcomp/codecs/pq.h) on one CPU thread: the calibration (Fit) of
// one head's basis, then EncodeRows and DecodeRows of f32 rows at 3 and 2 bits per element (the
// measured 6.4x point: 3-bit keys, 2-bit values), and 4 and 1. Rows: a steep spectrum (deviation
// falling by 0.97 per component) in a fixed random rotation, d = 128. GB/s over the f32 rows read
// or written plus the records; a bf16 cache holds half the f32 bytes. One RESULT line per width;
// median of repetitions. Then 3-bit records of the same rows as bf16 on every hardware thread.
//
//   kvcomp_bench_cpu_pq [rows] [calibration_rows]   (defaults 16384, 8192)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "common/bench_util.h"
#include "kvcomp/codecs/pq.h"

namespace {

std::vector<float> Rows(uint64_t n, uint32_t d, uint64_t seed) {
  std::mt19937_64 rng(1);  // the same rotation for calibration and coded rows
  std::normal_distribution<float> nd;
  std::vector<float> R(uint64_t{d} * d);
  for (float& v : R) v = nd(rng) / std::sqrt(static_cast<float>(d));
  std::mt19937_64 r2(seed);
  std::vector<float> x(n * d), z(d);
  for (uint64_t r = 0; r < n; ++r) {
    for (uint32_t i = 0; i < d; ++i) z[i] = std::pow(0.97f, static_cast<float>(i)) * nd(r2);
    for (uint32_t j = 0; j < d; ++j) {
      float v = 0;
      for (uint32_t i = 0; i < d; ++i) v += z[i] * R[uint64_t{i} * d + j];
      x[r * d + j] = v;
    }
  }
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvcomp;
  const uint64_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 16384;
  const uint64_t ncal = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 8192;
  const uint32_t d = 128;
  const std::vector<float> cal = Rows(ncal, d, 2), x = Rows(n, d, 3);
  std::vector<float> y(n * d);
  for (uint32_t bits : {4u, 3u, 2u, 1u}) {
    absl::StatusOr<pq::Basis> b;
    const auto t0 = std::chrono::steady_clock::now();
    b = pq::Fit(cal, ncal, 1, 1, d, bits * d);
    const double fit_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!b.ok()) {
      std::fprintf(stderr, "%s\n", b.status().ToString().c_str());
      return 1;
    }
    std::vector<uint8_t> rec(n * b->RecordBytes());
    const double enc = kvcomp::bench::MedianSeconds(3, [&] {
      if (!pq::EncodeRows(*b, 0, x.data(), n, rec.data()).ok()) std::abort();
    });
    const double dec = kvcomp::bench::MedianSeconds(3, [&] {
      if (!pq::DecodeRows(*b, 0, rec.data(), n, y.data()).ok()) std::abort();
    });
    double err = 0, tot = 0;
    for (uint64_t i = 0; i < n * d; ++i) {
      err += (y[i] - x[i]) * (y[i] - x[i]);
      tot += x[i] * x[i];
    }
    const double io = static_cast<double>(rec.size()) + n * d * 4.0;
    std::printf(
        "RESULT bench=cpu_pq bits=%u d=%u rows=%llu threads=1 fit_ms=%.1f (%llu rows) "
        "encode_ms=%.1f encode_GBps=%.3f encode_Mrows_s=%.3f decode_ms=%.1f decode_GBps=%.3f "
        "decode_Mrows_s=%.3f rel_mse=%.5f record_bytes=%llu\n",
        bits, d, static_cast<unsigned long long>(n), fit_s * 1e3,
        static_cast<unsigned long long>(ncal), enc * 1e3, io / enc / 1e9, n / enc / 1e6, dec * 1e3,
        io / dec / 1e9, n / dec / 1e6, err / tot,
        static_cast<unsigned long long>(b->RecordBytes()));
  }
  // bf16 rows (as a cache holds them) on every hardware thread, 3-bit records
  {
    auto b = pq::Fit(cal, ncal, 1, 1, d, 3 * d);
    if (!b.ok()) return 1;
    std::vector<uint16_t> xb(n * d), yb(n * d);
    for (uint64_t i = 0; i < n * d; ++i) xb[i] = FloatToBf16(x[i]);
    std::vector<uint8_t> rec(n * b->RecordBytes());
    const double enc = kvcomp::bench::MedianSeconds(3, [&] {
      if (!pq::EncodeRows(*b, 0, xb.data(), DType::kBF16, n, rec.data(), 0).ok()) std::abort();
    });
    const double dec = kvcomp::bench::MedianSeconds(3, [&] {
      if (!pq::DecodeRows(*b, 0, rec.data(), n, yb.data(), DType::kBF16, 0).ok()) std::abort();
    });
    const double io = static_cast<double>(rec.size()) + n * d * 2.0;
    std::printf(
        "RESULT bench=cpu_pq_bf16 bits=3 d=%u rows=%llu threads=%u encode_ms=%.1f "
        "encode_GBps=%.3f encode_Mrows_s=%.3f decode_ms=%.1f decode_GBps=%.3f "
        "decode_Mrows_s=%.3f\n",
        d, static_cast<unsigned long long>(n),
        std::min(32u, std::max(1u, std::thread::hardware_concurrency())), enc * 1e3, io / enc / 1e9,
        n / enc / 1e6, dec * 1e3, io / dec / 1e9, n / dec / 1e6);
  }
  return 0;
}
