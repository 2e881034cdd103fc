// The engine-level demo: a generated Llama-3.1-8B-shaped cache (32 layers, 8 kv heads, 32 q
// heads, head_dim 128, bf16) compressed on the CPU backend with the default policy, encoded to
// the cache format, parsed back and checked, with sizes and stage times printed. `make demo`
// runs the daemon demo once it exists; this is the path beneath it.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kvcomp/core/dtype.h"
#include "kvcomp/core/format.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/pipeline.h"

namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Keys near a 16-dimensional subspace with two outlier channels and RoPE applied by position;
// values low-rank plus noise. Written as bf16.
void Generate(const kvcomp::KvLayout& l, uint64_t tokens, uint32_t layer,
              std::vector<uint16_t>* k, std::vector<uint16_t>* v) {
  std::mt19937 rng(1234 + layer);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  const uint32_t d = l.head_dim, r = 16;
  k->resize(uint64_t{l.num_kv_heads} * tokens * d);
  v->resize(k->size());
  std::vector<float> bk(r * d), bv(r * d), coef(r), row(d);
  for (uint32_t h = 0; h < l.num_kv_heads; ++h) {
    for (auto& x : bk) x = n01(rng);
    for (auto& x : bv) x = n01(rng);
    for (uint64_t t = 0; t < tokens; ++t) {
      for (auto& c : coef) c = n01(rng) * (t == 0 ? 4.0f : 1.0f);
      for (uint32_t i = 0; i < d; ++i) {
        float s = 0.1f * n01(rng);
        for (uint32_t j = 0; j < r; ++j) s += coef[j] * bk[j * d + i];
        row[i] = s + (i == 7 || i == 71 ? 12.0f : 0.0f);
      }
      for (uint32_t i = 0; i < d / 2; ++i) {  // RoPE, base 500000 as Llama 3
        const double theta = t * std::pow(500000.0, -2.0 * i / d);
        const float c = static_cast<float>(std::cos(theta)), s = static_cast<float>(std::sin(theta));
        const float a = row[i], b = row[i + d / 2];
        row[i] = a * c - b * s;
        row[i + d / 2] = a * s + b * c;
      }
      const uint64_t base = (uint64_t{h} * tokens + t) * d;
      for (uint32_t i = 0; i < d; ++i) (*k)[base + i] = kvcomp::FloatToBf16(row[i]);
      for (uint32_t i = 0; i < d; ++i) {
        float s = 0.05f * n01(rng);
        for (uint32_t j = 0; j < r; ++j) s += coef[j] * bv[j * d + i] * 0.3f;
        (*v)[base + i] = kvcomp::FloatToBf16(s);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t tokens = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 4096;
  const kvcomp::KvLayout layout{32, 8, 32, 128, kvcomp::DType::kBF16};
  std::printf("kvcomp engine demo: Llama-3.1-8B-shaped cache, %llu tokens, %s\n",
              static_cast<unsigned long long>(tokens), layout.DebugString().c_str());

  auto t0 = Clock::now();
  std::vector<std::vector<uint16_t>> ks(layout.num_layers), vs(layout.num_layers);
  kvcomp::KvCacheView view;
  view.layout = layout;
  view.num_tokens = tokens;
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    Generate(layout, tokens, l, &ks[l], &vs[l]);
    view.keys.push_back(kvcomp::HeadsView::Dense(ks[l].data(), layout.dtype, layout.num_kv_heads,
                                                 tokens, layout.head_dim));
    view.values.push_back(kvcomp::HeadsView::Dense(vs[l].data(), layout.dtype,
                                                   layout.num_kv_heads, tokens, layout.head_dim));
  }
  auto t1 = Clock::now();

  auto backend = kvcomp::MakeCpuBackend();
  if (!backend.ok()) {
    std::fprintf(stderr, "backend: %s\n", backend.status().ToString().c_str());
    return 1;
  }
  kvcomp::CompressionPolicy policy;  // defaults: manifold, ratio 0.5, moments on
  auto cache = kvcomp::Compress(**backend, view, policy);
  if (!cache.ok()) {
    std::fprintf(stderr, "compress: %s\n", cache.status().ToString().c_str());
    return 1;
  }
  auto t2 = Clock::now();
  auto bytes = kvcomp::format::EncodeCache(*cache);
  if (!bytes.ok()) {
    std::fprintf(stderr, "encode: %s\n", bytes.status().ToString().c_str());
    return 1;
  }
  auto t3 = Clock::now();
  auto back = kvcomp::format::ParseCache(*bytes);
  auto t4 = Clock::now();
  if (!back.ok() || !(*back == *cache)) {
    std::fprintf(stderr, "round trip failed: %s\n", back.status().ToString().c_str());
    return 1;
  }
  const kvcomp::CacheBytes b = cache->Breakdown();
  const double orig = static_cast<double>(cache->original_bytes());
  std::printf("\n%-28s %14s\n", "part", "bytes");
  std::printf("%-28s %14.0f\n", "original K+V", orig);
  std::printf("%-28s %14llu\n", "stored (encoded)", static_cast<unsigned long long>(bytes->size()));
  std::printf("%-28s %14llu\n", "  kept keys", static_cast<unsigned long long>(b.keys));
  std::printf("%-28s %14llu\n", "  kept values", static_cast<unsigned long long>(b.values));
  std::printf("%-28s %14llu\n", "  positions", static_cast<unsigned long long>(b.positions));
  std::printf("%-28s %14llu\n", "  moments", static_cast<unsigned long long>(b.moments));
  std::printf("%-28s %14llu\n", "  header/policy/padding", static_cast<unsigned long long>(b.header));
  std::printf("%-28s %14.2fx\n", "ratio original/stored", orig / bytes->size());
  std::printf("%-28s %14.0f\n", "memory saved", orig - bytes->size());
  std::printf("\n%-28s %10s\n", "stage", "seconds");
  std::printf("%-28s %10.3f\n", "generate", Seconds(t0, t1));
  std::printf("%-28s %10.3f\n", "compress (cpu)", Seconds(t1, t2));
  std::printf("%-28s %10.3f\n", "encode", Seconds(t2, t3));
  std::printf("%-28s %10.3f\n", "parse + verify", Seconds(t3, t4));
  std::printf("\nround trip: parsed cache equals the compressed one (%llu kept tokens of %llu)\n",
              static_cast<unsigned long long>(cache->total_kept()),
              static_cast<unsigned long long>(cache->num_heads() * tokens));
  return 0;
}
