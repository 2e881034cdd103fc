// The CPU scorers given the keys' sums (ScoreParams::key_sums, made by SumKeysOnHost) against
// the same scorers summing the keys themselves, and the row kernels' run-time builds (AVX-512,
// AVX2, portable) against each other and a float64 reference.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_format.h"
#include "gemm_kernels.h"
#include "gtest/gtest.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/scoring_ops.h"
#include "scoring_kernels.h"
#include "scoring_test_util.h"

namespace kvcomp {
namespace {

using testing::HostHeads;
using testing::RandomHeads;
using testing::RefScores;

std::unique_ptr<Backend> Cpu(int threads) {
  CpuBackendOptions o;
  o.num_threads = threads;
  auto b = MakeCpuBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(*b);
}

uint64_t Chunks(uint64_t n) { return (n + kKeySumChunkTokens - 1) / kKeySumChunkTokens; }

// Both sums of every chunk of k.
struct Sums {
  std::vector<float> sums, unit;
  KeySums view(uint64_t n) const { return KeySums{sums.data(), unit.data(), n}; }
};
Sums SumsOf(const HostHeads& k) {
  Sums s;
  s.sums.assign(uint64_t{k.heads} * Chunks(k.tokens) * k.head_dim, NAN);
  s.unit.assign(s.sums.size(), NAN);
  const absl::Status st =
      SumKeysOnHost(k.view(), 0, Chunks(k.tokens), s.sums.data(), s.unit.data());
  EXPECT_TRUE(st.ok()) << st;
  return s;
}

std::vector<float> ScoreOn(Backend& b, const HostHeads& k, const ScoreParams& p) {
  std::vector<float> s(uint64_t{k.heads} * k.tokens, NAN);
  const absl::Status st = b.scoring().Score(k.view(), p, TokenPositions{}, s.data());
  EXPECT_TRUE(st.ok()) << st;
  return s;
}

void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    ASSERT_EQ(x, y) << "token " << i << ": " << a[i] << " vs " << b[i];
  }
}

TEST(ScoringKeySumsTest, SumsMatchFloat64PerChunk) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    const HostHeads k = RandomHeads(dt, 3, 1000, 64, 7);
    const Sums s = SumsOf(k);
    const uint64_t chunks = Chunks(k.tokens);
    for (uint32_t h = 0; h < k.heads; ++h) {
      for (uint64_t c = 0; c < chunks; ++c) {
        for (uint32_t j = 0; j < k.head_dim; ++j) {
          double sum = 0.0, unit = 0.0;
          for (uint64_t t = c * kKeySumChunkTokens;
               t < std::min<uint64_t>(k.tokens, (c + 1) * kKeySumChunkTokens); ++t) {
            double norm = 0.0;
            for (uint32_t i = 0; i < k.head_dim; ++i) norm += double{k.at(h, t, i)} * k.at(h, t, i);
            sum += k.at(h, t, j);
            unit += k.at(h, t, j) / std::max(std::sqrt(norm), 1e-8);
          }
          const uint64_t at = (h * chunks + c) * k.head_dim + j;
          ASSERT_NEAR(s.sums[at], sum, 1e-4 * std::max(1.0, std::fabs(sum)));
          ASSERT_NEAR(s.unit[at], unit, 1e-4 * std::max(1.0, std::fabs(unit)));
        }
      }
    }
  }
}

// Given sums: the same bits as without, on the per-head and the chunked paths (1 and 4 threads
// for 2 heads), for every dtype and head_dim, lengths around the chunk size, and the scores
// still match float64.
TEST(ScoringKeySumsTest, GivenSumsGiveTheSameScoresBitForBit) {
  uint64_t seed = 11;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (uint32_t d : {64u, 128u, 256u}) {
      for (uint64_t n :
           {uint64_t{1}, uint64_t{255}, uint64_t{256}, uint64_t{2049}, uint64_t{5000}}) {
        const HostHeads k = RandomHeads(dt, 2, n, d, seed++);
        const Sums sums = SumsOf(k);
        for (int threads : {1, 4}) {
          auto cpu = Cpu(threads);
          for (Scorer s : {Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold}) {
            for (uint32_t window : {512u, 1000u, 8192u}) {
              if (s != Scorer::kWindowedManifold && window != 512) continue;
              SCOPED_TRACE(absl::StrFormat("%s d=%u n=%u threads=%d %s window=%u", DTypeName(dt), d,
                                           n, threads, ScorerName(s), window));
              ScoreParams p;
              p.scorer = s;
              p.window = window;
              const std::vector<float> own = ScoreOn(*cpu, k, p);
              p.key_sums = sums.view(n);
              const std::vector<float> given = ScoreOn(*cpu, k, p);
              ExpectSameBits(given, own);
              const std::vector<double> ref = RefScores(k, p);
              for (size_t i = 0; i < ref.size(); ++i) {
                ASSERT_NEAR(given[i], ref[i], 1e-5 * std::max(1.0, std::fabs(ref[i]))) << i;
              }
            }
          }
        }
      }
    }
  }
}

// The fused op's per-head path (heads of >= 4 MiB) offsets each head's sums: the same kept set,
// rows and scores as without sums.
TEST(ScoringKeySumsTest, FusedOpWithSumsEqualsWithout) {
  const uint64_t n = 5000;
  for (uint32_t heads : {2u, 3u}) {
    const HostHeads k = RandomHeads(DType::kF32, heads, n, 256, 40 + heads);  // 5 MB per head
    const HostHeads v = RandomHeads(DType::kF32, heads, n, 256, 50 + heads);
    const Sums sums = SumsOf(k);
    for (int threads : {1, 4}) {
      auto cpu = Cpu(threads);
      for (Scorer s : {Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold}) {
        SCOPED_TRACE(absl::StrFormat("heads=%u threads=%d %s", heads, threads, ScorerName(s)));
        struct Out {
          std::vector<uint32_t> counts, idx;
          std::vector<uint8_t> ko, vo;
          std::vector<float> scores;
        };
        auto run = [&](bool with_sums) {
          Out o;
          const uint64_t kept = n / 2;
          const uint64_t cap = KeptCapacity(heads, n, kept);
          o.counts.resize(heads);
          o.idx.resize(cap);
          o.ko.resize(cap * 256 * 4);
          o.vo.resize(cap * 256 * 4);
          o.scores.resize(uint64_t{heads} * n);
          ScoreSelectCompactArgs a;
          a.keys = k.view();
          a.values = v.view();
          a.score.scorer = s;
          a.score.window = 1024;
          if (with_sums) a.score.key_sums = sums.view(n);
          a.select.kept_per_head = kept;
          a.scores = o.scores.data();
          a.kept = {o.counts.data(), o.idx.data()};
          a.keys_out = o.ko.data();
          a.values_out = o.vo.data();
          const absl::Status st = cpu->scoring().ScoreSelectCompact(a);
          EXPECT_TRUE(st.ok()) << st;
          return o;
        };
        const Out own = run(false), given = run(true);
        ExpectSameBits(given.scores, own.scores);
        EXPECT_EQ(given.counts, own.counts);
        EXPECT_EQ(given.idx, own.idx);
        EXPECT_EQ(given.ko, own.ko);
        EXPECT_EQ(given.vo, own.vo);
      }
    }
  }
}

// Windows not on chunk boundaries cannot use the sums: the scorer sums the keys itself (sums
// poisoned with NaN would show if they were read).
TEST(ScoringKeySumsTest, UnalignedWindowsIgnoreTheSums) {
  const HostHeads k = RandomHeads(DType::kBF16, 2, 3000, 128, 3);
  std::vector<float> poison(2 * Chunks(3000) * 128, NAN);
  auto cpu = Cpu(2);
  ScoreParams p;
  p.scorer = Scorer::kWindowedManifold;
  p.window = 1000;
  const std::vector<float> own = ScoreOn(*cpu, k, p);
  p.key_sums = KeySums{poison.data(), poison.data(), 3000};
  ExpectSameBits(ScoreOn(*cpu, k, p), own);
}

// The data check still runs when the sums are given (one pass reads every row's norm).
TEST(ScoringKeySumsTest, GivenSumsStillRefuseNaNKeys) {
  HostHeads k = RandomHeads(DType::kF32, 2, 3000, 128, 5);
  const Sums sums = SumsOf(k);
  k.Set((uint64_t{1} * 3000 + 2100) * 128 + 7, NAN);
  for (int threads : {1, 2}) {
    auto cpu = Cpu(threads);
    for (Scorer s : {Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold}) {
      ScoreParams p;
      p.scorer = s;
      p.window = 512;
      p.key_sums = sums.view(3000);
      std::vector<float> out(2 * 3000);
      const absl::Status st = cpu->scoring().Score(k.view(), p, TokenPositions{}, out.data());
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << ScorerName(s);
      EXPECT_NE(st.message().find("at head 1, token 2100"), std::string::npos) << st;
    }
  }
}

TEST(ScoringKeySumsTest, BadArgumentsAreRefused) {
  const HostHeads k = RandomHeads(DType::kBF16, 1, 600, 128, 9);
  std::vector<float> s(Chunks(600) * 128);
  EXPECT_TRUE(SumKeysOnHost(k.view(), 1, 3, s.data(), nullptr).ok());
  EXPECT_EQ(SumKeysOnHost(k.view(), 0, 4, s.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SumKeysOnHost(k.view(), 2, 1, s.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  HeadsView dev = k.view();
  dev.space = MemorySpace::kDevice;
  EXPECT_EQ(SumKeysOnHost(dev, 0, 1, s.data(), nullptr).code(), absl::StatusCode::kInvalidArgument);
  // Sums of another length are refused by the scorer.
  auto cpu = Cpu(1);
  ScoreParams p;
  p.key_sums = KeySums{s.data(), nullptr, 599};
  std::vector<float> out(600);
  EXPECT_EQ(cpu->scoring().Score(k.view(), p, TokenPositions{}, out.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

// Run-time dispatch: the build RowKernelsFor picks is the best this CPU supports (capped by
// KVCOMP_CPU_ISA), and every build the CPU can run agrees with float64 on every kernel.
TEST(ScoringIsaTest, DispatchPicksTheBestSupportedBuild) {
  std::string best = "generic";
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    best = __builtin_cpu_supports("avx512f") ? "avx512" : "avx2";
  }
#endif
  const char* cap = std::getenv("KVCOMP_CPU_ISA");
  if (cap != nullptr && std::string(cap) == "generic") best = "generic";
  if (cap != nullptr && std::string(cap) == "avx2" && best == "avx512") best = "avx2";
  EXPECT_EQ(cpu::RowKernelsIsa(), best);
  std::printf("row kernels: %s\n", cpu::RowKernelsIsa());
}

struct Build {
  const char* name;
  const cpu::RowKernels* (*table)(DType, uint32_t);
  bool runs;
};

// Every build of the row kernels, and whether this CPU can run it.
std::vector<Build> Builds() {
  std::vector<Build> builds = {{"generic", &cpu::generic::Table, true}};
#if defined(__x86_64__)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  builds.push_back({"avx2", &cpu::avx2::Table, avx2});
  builds.push_back({"avx512", &cpu::avx512::Table, avx2 && __builtin_cpu_supports("avx512f")});
#endif
  return builds;
}

TEST(ScoringIsaTest, EveryBuildAgreesWithFloat64) {
  const std::vector<Build> builds = Builds();
  uint64_t seed = 100;
  for (const Build& b : builds) {
    if (!b.runs) {
      std::printf("%s: not supported by this CPU, not run\n", b.name);
      continue;
    }
    for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (uint32_t d : {64u, 128u, 256u}) {
        SCOPED_TRACE(absl::StrFormat("%s %s d=%u", b.name, DTypeName(dt), d));
        const uint64_t n = 300;
        const HostHeads k = RandomHeads(dt, 1, n, d, seed++);
        const cpu::RowKernels* t = b.table(dt, d);
        ASSERT_NE(t, nullptr);
        std::vector<float> mu(d);
        for (uint32_t j = 0; j < d; ++j) mu[j] = 0.25f * static_cast<float>(j % 7) - 0.5f;
        std::vector<float> sq(n), sq2(n), sq3(n), dist(n), dist2(n), dots(n), dots2(n), sum(d, 0),
            unit(d, 0), row(d);
        t->sq_norms(k.bytes.data(), d, n, sq.data());
        t->sq_norms_and_sum(k.bytes.data(), d, n, false, 0.0f, sq2.data(), sum.data());
        t->sq_norms_and_sum(k.bytes.data(), d, n, true, kKeyDiffEps, sq3.data(), unit.data());
        std::vector<float> plain(d, 0.0f);
        t->sums(k.bytes.data(), d, n, plain.data());
        ExpectSameBits(plain, sum);
        t->distances(k.bytes.data(), d, n, mu.data(), dist.data());
        t->dots(k.bytes.data(), d, n, mu.data(), dots.data());
        std::vector<float> sq4(n), sq5(n);
        t->distances_and_sq(k.bytes.data(), d, n, mu.data(), dist2.data(), sq4.data());
        t->dots_and_sq(k.bytes.data(), d, n, mu.data(), dots2.data(), sq5.data());
        ExpectSameBits(sq2, sq);
        ExpectSameBits(sq3, sq);
        ExpectSameBits(sq4, sq);
        ExpectSameBits(sq5, sq);
        ExpectSameBits(dist2, dist);
        ExpectSameBits(dots2, dots);
        std::vector<double> rsum(d, 0.0), runit(d, 0.0);
        for (uint64_t i = 0; i < n; ++i) {
          double s = 0.0, dd = 0.0, dot = 0.0;
          for (uint32_t j = 0; j < d; ++j) {
            const double x = k.at(0, i, j);
            s += x * x;
            dd += (x - mu[j]) * (x - mu[j]);
            dot += x * mu[j];
          }
          ASSERT_NEAR(sq[i], s, 1e-5 * s);
          ASSERT_NEAR(dist[i], std::sqrt(dd), 1e-5 * std::sqrt(dd));
          ASSERT_NEAR(dots[i], dot, 1e-4 * std::max(1.0, std::sqrt(s)));
          for (uint32_t j = 0; j < d; ++j) {
            rsum[j] += k.at(0, i, j);
            runit[j] += k.at(0, i, j) / std::sqrt(s);
          }
        }
        for (uint32_t j = 0; j < d; ++j) {
          ASSERT_NEAR(sum[j], rsum[j], 1e-4 * std::max(1.0, std::fabs(rsum[j])));
          ASSERT_NEAR(unit[j], runit[j], 1e-4 * std::max(1.0, std::fabs(runit[j])));
        }
        t->to_float(k.bytes.data(), row.data());
        for (uint32_t j = 0; j < d; ++j) ASSERT_EQ(row[j], k.at(0, 0, j));
      }
    }
  }
}

// The compaction's kernels copy rows byte for byte, with and without streaming stores, to
// destinations aligned to 64 bytes and to 16 only; the multi-run chunk sums give the bits of one
// call per run; sq_norms_and_copy's norms are sq_norms'.
TEST(ScoringIsaTest, EveryBuildCopiesExactRowsAndSumsRunsAsOneByOne) {
  uint64_t seed = 500;
  for (const Build& b : Builds()) {
    if (!b.runs) continue;
    for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (uint32_t d : {64u, 128u, 256u}) {
        SCOPED_TRACE(absl::StrFormat("%s %s d=%u", b.name, DTypeName(dt), d));
        const uint64_t n = 2500, t0 = 300, len = 2100;  // rows [t0, t0 + len) of n
        const HostHeads k = RandomHeads(dt, 1, n, d, seed++);
        const cpu::RowKernels* t = b.table(dt, d);
        ASSERT_NE(t, nullptr);
        const size_t row = d * testing::ElemSize(dt);
        std::mt19937 rng(static_cast<uint32_t>(seed));
        std::vector<uint32_t> kept;
        for (uint32_t i = t0; i < t0 + len; ++i) {
          if (rng() % 2 == 0) kept.push_back(i);
        }
        std::vector<uint8_t> out_bytes(kept.size() * row + 128);
        for (size_t misalign : {size_t{0}, size_t{16}}) {
          uint8_t* out = out_bytes.data() +
                         (64 - reinterpret_cast<uintptr_t>(out_bytes.data()) % 64) % 64 + misalign;
          for (bool stream : {false, true}) {
            SCOPED_TRACE(absl::StrFormat("misaligned by %u, stream %d", misalign, stream));
            std::memset(out, 0, kept.size() * row);
            t->gather(k.bytes.data(), d, kept.data(), kept.size(), out, stream);
            for (size_t r = 0; r < kept.size(); ++r) {
              ASSERT_EQ(0, std::memcmp(out + r * row, k.bytes.data() + kept[r] * row, row)) << r;
            }
            std::memset(out, 0, kept.size() * row);
            std::vector<float> sq(len), ref(len);
            t->sq_norms_and_copy(k.bytes.data() + t0 * row, d, t0, len, kept.data(), kept.size(),
                                 out, stream, sq.data());
            t->sq_norms(k.bytes.data() + t0 * row, d, len, ref.data());
            ExpectSameBits(sq, ref);
            for (size_t r = 0; r < kept.size(); ++r) {
              ASSERT_EQ(0, std::memcmp(out + r * row, k.bytes.data() + kept[r] * row, row)) << r;
            }
          }
        }
        for (uint64_t runs = 1; runs <= cpu::kMaxSumRuns; ++runs) {
          for (bool unit : {false, true}) {
            const uint64_t rows = 256;
            std::vector<float> sq(runs * rows), sums(runs * d, 0.0f);
            std::vector<float> sq1(runs * rows), sums1(runs * d, 0.0f);
            t->sq_norms_and_sums(k.bytes.data(), d, rows, runs, unit, kKeyDiffEps, sq.data(),
                                 sums.data());
            for (uint64_t j = 0; j < runs; ++j) {
              t->sq_norms_and_sum(k.bytes.data() + j * rows * row, d, rows, unit, kKeyDiffEps,
                                  sq1.data() + j * rows, sums1.data() + j * d);
            }
            ExpectSameBits(sq, sq1);
            ExpectSameBits(sums, sums1);
          }
        }
      }
    }
  }
}

// The AVX2 and AVX-512 builds of the moment and attention tiles' dense products (Eigen compiled
// with those flags) against float64, on tile shapes and odd ones; WideGemm takes the build the
// row kernels take.
TEST(GemmIsaTest, EveryBuildMatchesFloat64) {
#if defined(__x86_64__) && defined(KVCOMP_HAVE_WIDE_GEMM)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  struct GemmBuild {
    const char* name;
    const cpu::GemmKernels* table;
    bool runs;
  };
  const GemmBuild builds[] = {
      {"avx2", cpu::avx2::GemmTable(), avx2},
      {"avx512", cpu::avx512::GemmTable(), avx2 && __builtin_cpu_supports("avx512f")}};
  const std::string isa = cpu::RowKernelsIsa();
  EXPECT_EQ(cpu::WideGemm(), isa == "avx512" ? builds[1].table
                             : isa == "avx2" ? builds[0].table
                                             : nullptr);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const GemmBuild& b : builds) {
    if (!b.runs) continue;
    for (const auto& [m, p, q] : {std::tuple<size_t, size_t, size_t>{128, 128, 128},
                                  {37, 65, 129},
                                  {1, 64, 256},
                                  {300, 3, 5}}) {
      SCOPED_TRACE(absl::StrFormat("%s m=%u p=%u q=%u", b.name, m, p, q));
      std::vector<float> a(m * p), bt(m * q), bq(q * p), bp(p * q);
      for (float* v : {a.data(), bt.data()}) {
        for (size_t i = 0; i < (v == a.data() ? a.size() : bt.size()); ++i) v[i] = u(rng);
      }
      for (float& x : bq) x = u(rng);
      for (float& x : bp) x = u(rng);
      // C[p x q] += A^T B, from a start of ones.
      std::vector<float> c1(p * q, 1.0f);
      b.table->add_at_b(a.data(), bt.data(), c1.data(), m, p, q);
      for (size_t i = 0; i < p; ++i) {
        for (size_t j = 0; j < q; ++j) {
          double r = 1.0;
          for (size_t t = 0; t < m; ++t) r += double{a[t * p + i]} * bt[t * q + j];
          ASSERT_NEAR(c1[i * q + j], r, 1e-4 * (1.0 + std::sqrt(double(m))));
        }
      }
      // C[m x q] = A B^T (B is q x p), and C += A B (B is p x q).
      std::vector<float> c2(m * q, 5.0f), c3(m * q, 1.0f);
      b.table->a_bt(a.data(), bq.data(), c2.data(), m, p, q);
      b.table->add_a_b(a.data(), bp.data(), c3.data(), m, p, q);
      for (size_t i = 0; i < m; ++i) {
        for (size_t j = 0; j < q; ++j) {
          double r2 = 0.0, r3 = 1.0;
          for (size_t x = 0; x < p; ++x) {
            r2 += double{a[i * p + x]} * bq[j * p + x];
            r3 += double{a[i * p + x]} * bp[x * q + j];
          }
          ASSERT_NEAR(c2[i * q + j], r2, 1e-4 * (1.0 + std::sqrt(double(p))));
          ASSERT_NEAR(c3[i * q + j], r3, 1e-4 * (1.0 + std::sqrt(double(p))));
        }
      }
    }
  }
#else
  GTEST_SKIP() << "the wide builds of the dense products are x86-64 with Eigen only";
#endif
}

}  // namespace
}  // namespace kvcomp
