// CPU benchmark of Engine I: score + select + compact of one layer, 8 kv heads,
// head_dim 128, bf16, 8K / 64K / 128K tokens, ratio 0.5, for knorm, keydiff, manifold,
// windowed_manifold and streaming, on 1 thread and on every core; the mean-based scorers also
// given the keys' sums (ScoreParams::key_sums, as kvcompd's assembler makes them while it puts a
// layer's blocks together), so that they read K once. Bytes are bytes moved (read + written): the
// op's minimal bytes are read K and V once and write the kept K and V; memcpy's are read K and V
// and write them. The op's benchmark also times a memcpy of the same K and V right after each
// iteration (timing paused, same threads) and reports it as memcpy_bytes_per_second: both see the
// same machine state, which matters on a shared host. BM_Memcpy is the standalone reference.
//   bench/cpu/run.sh writes the results to bench/results/.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvcomp/core/dtype.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/moment_ops.h"
#include "kvcomp/kernels/scoring_ops.h"

namespace kvcomp {
namespace {

constexpr uint32_t kHeads = 8;
constexpr uint32_t kHeadDim = 128;
constexpr size_t kRow = kHeadDim * 2;  // bf16

struct Data {
  uint64_t tokens = 0;
  std::vector<uint16_t> k, v;
};

// One input per length, built once (never zeros: bf16 of N(0.3, 1)).
const Data& InputFor(uint64_t tokens) {
  static std::vector<std::unique_ptr<Data>> cache;
  for (const auto& d : cache) {
    if (d->tokens == tokens) return *d;
  }
  auto d = std::make_unique<Data>();
  d->tokens = tokens;
  const uint64_t n = uint64_t{kHeads} * tokens * kHeadDim;
  d->k.resize(n);
  d->v.resize(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.3f, 1.0f);
  for (uint64_t i = 0; i < n; ++i) {
    d->k[i] = FloatToBf16(normal(rng));
    d->v[i] = FloatToBf16(normal(rng));
  }
  cache.push_back(std::move(d));
  return *cache.back();
}

int AllThreads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

// Copies K and V to (dk, dv), split over `threads` threads (the caller is one of them).
void ParallelMemcpy(void* dk, const void* k, void* dv, const void* v, uint64_t bytes, int threads) {
  const uint64_t part = (bytes + threads - 1) / threads;
  auto copy = [&](int t) {
    const uint64_t b = t * part, e = std::min(bytes, b + part);
    if (b >= e) return;
    std::memcpy(static_cast<char*>(dk) + b, static_cast<const char*>(k) + b, e - b);
    std::memcpy(static_cast<char*>(dv) + b, static_cast<const char*>(v) + b, e - b);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(copy, t);
  copy(0);
  for (auto& th : pool) th.join();
}

// The keys' sums of a whole input (KeySums layout), made once per length.
const std::vector<float>& SumsFor(uint64_t tokens) {
  static std::vector<std::pair<uint64_t, std::unique_ptr<std::vector<float>>>> cache;
  for (const auto& c : cache) {
    if (c.first == tokens) return *c.second;
  }
  const Data& d = InputFor(tokens);
  const uint64_t chunks = (tokens + kKeySumChunkTokens - 1) / kKeySumChunkTokens;
  auto s = std::make_unique<std::vector<float>>(2 * kHeads * chunks * kHeadDim);
  const absl::Status st = SumKeysOnHost(
      HeadsView::Dense(d.k.data(), DType::kBF16, kHeads, tokens, kHeadDim), 0, chunks, s->data(),
      s->data() + kHeads * chunks * kHeadDim);
  if (!st.ok()) std::abort();
  cache.emplace_back(tokens, std::move(s));
  return *cache.back().second;
}

// args: tokens, scorer, threads (0 = all), sums (1 = the keys' sums given)
void BM_ScoreSelectCompact(benchmark::State& state) {
  const uint64_t tokens = state.range(0);
  const auto scorer = static_cast<Scorer>(state.range(1));
  const int threads = state.range(2) == 0 ? AllThreads() : static_cast<int>(state.range(2));
  const bool sums = state.range(3) != 0;
  const Data& d = InputFor(tokens);
  CpuBackendOptions options;
  options.num_threads = threads;
  auto backend = std::move(*MakeCpuBackend(options));
  const uint64_t kept = static_cast<uint64_t>(static_cast<double>(tokens) * 0.5);
  const uint64_t cap = KeptCapacity(kHeads, tokens, kept);
  std::vector<uint32_t> counts(kHeads), idx(cap);
  std::vector<uint8_t> ko(cap * kRow, 1), vo(cap * kRow, 1);
  std::vector<float> scores(uint64_t{kHeads} * tokens);
  ScoreSelectCompactArgs a;
  a.keys = HeadsView::Dense(d.k.data(), DType::kBF16, kHeads, tokens, kHeadDim);
  a.values = HeadsView::Dense(d.v.data(), DType::kBF16, kHeads, tokens, kHeadDim);
  a.score.scorer = scorer;
  a.score.window = 4096;
  if (sums) {
    const std::vector<float>& s = SumsFor(tokens);
    a.score.key_sums = KeySums{s.data(), s.data() + s.size() / 2, tokens};
  }
  a.select.kept_per_head = kept;
  a.scores = scores.data();
  a.kept = {counts.data(), idx.data()};
  a.keys_out = ko.data();
  a.values_out = vo.data();
  const uint64_t kv_bytes = uint64_t{kHeads} * tokens * kRow;
  std::vector<uint8_t> ck(kv_bytes, 1), cv(kv_bytes, 1);
  double memcpy_seconds = 0.0;
  for (auto _ : state) {
    absl::Status s = backend->scoring().ScoreSelectCompact(a);
    if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
    benchmark::DoNotOptimize(ko.data());
    state.PauseTiming();
    const auto t0 = std::chrono::steady_clock::now();
    ParallelMemcpy(ck.data(), d.k.data(), cv.data(), d.v.data(), kv_bytes, threads);
    memcpy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    benchmark::DoNotOptimize(ck.data());
    state.ResumeTiming();
  }
  const uint64_t minimal = 2 * kv_bytes + 2 * cap * kRow;
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * minimal));
  state.counters["workers"] = threads;
  state.counters["memcpy_bytes_per_second"] = static_cast<double>(state.iterations()) * 4.0 *
                                              static_cast<double>(kv_bytes) / memcpy_seconds;
  state.SetLabel(std::string(ScorerName(scorer)) + (sums ? ", sums given" : ""));
}

// The op's stages one at a time over the whole layer (the profile of the fused op, whose
// per-head path runs the same stages head by head): 0 = Score, 1 = Select, 2 = CheckFinite of
// V (the values' check the fused compaction does), 3 = Compact (the gather alone). Bytes are each
// stage's own minimal bytes; memcpy of K and V timed in the same loop as in BM_ScoreSelectCompact.
// args: tokens, scorer, stage, threads (0 = all), sums (1 = the keys' sums given to Score)
void BM_Stage(benchmark::State& state) {
  const uint64_t tokens = state.range(0);
  const auto scorer = static_cast<Scorer>(state.range(1));
  const int stage = static_cast<int>(state.range(2));
  const int threads = state.range(3) == 0 ? AllThreads() : static_cast<int>(state.range(3));
  const bool sums = state.range(4) != 0;
  const Data& d = InputFor(tokens);
  CpuBackendOptions options;
  options.num_threads = threads;
  auto backend = std::move(*MakeCpuBackend(options));
  ScoringOps& ops = backend->scoring();
  const uint64_t kept = static_cast<uint64_t>(static_cast<double>(tokens) * 0.5);
  const uint64_t cap = KeptCapacity(kHeads, tokens, kept);
  std::vector<uint32_t> counts(kHeads), idx(cap);
  std::vector<uint8_t> ko(cap * kRow, 1), vo(cap * kRow, 1);
  std::vector<float> scores(uint64_t{kHeads} * tokens);
  const HeadsView keys = HeadsView::Dense(d.k.data(), DType::kBF16, kHeads, tokens, kHeadDim);
  const HeadsView values = HeadsView::Dense(d.v.data(), DType::kBF16, kHeads, tokens, kHeadDim);
  ScoreParams score;
  score.scorer = scorer;
  score.window = 4096;
  if (sums) {
    const std::vector<float>& s = SumsFor(tokens);
    score.key_sums = KeySums{s.data(), s.data() + s.size() / 2, tokens};
  }
  SelectParams select;
  select.kept_per_head = kept;
  const KeptIndices out{counts.data(), idx.data()};
  auto check = [&](const absl::Status& s) {
    if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
  };
  check(ops.Score(keys, score, {}, scores.data()));
  check(ops.Select(scores.data(), kHeads, tokens, select, {}, out));
  const uint64_t kv_bytes = uint64_t{kHeads} * tokens * kRow;
  std::vector<uint8_t> ck(kv_bytes, 1), cv(kv_bytes, 1);
  double memcpy_seconds = 0.0;
  for (auto _ : state) {
    switch (stage) {
      case 0: check(ops.Score(keys, score, {}, scores.data())); break;
      case 1: check(ops.Select(scores.data(), kHeads, tokens, select, {}, out)); break;
      case 2: check(ops.CheckFinite(values, "values")); break;
      default:
        check(ops.Compact(keys, values, counts.data(), idx.data(), ko.data(), vo.data()));
    }
    benchmark::DoNotOptimize(ko.data());
    state.PauseTiming();
    const auto t0 = std::chrono::steady_clock::now();
    ParallelMemcpy(ck.data(), d.k.data(), cv.data(), d.v.data(), kv_bytes, threads);
    memcpy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    benchmark::DoNotOptimize(ck.data());
    state.ResumeTiming();
  }
  const uint64_t hn = uint64_t{kHeads} * tokens;
  const uint64_t minimal[] = {kv_bytes + hn * 4, hn * 4 + cap * 4, kv_bytes, 2 * cap * kRow * 2};
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * minimal[std::min(stage, 3)]));
  state.counters["workers"] = threads;
  state.counters["memcpy_bytes_per_second"] = static_cast<double>(state.iterations()) * 4.0 *
                                              static_cast<double>(kv_bytes) / memcpy_seconds;
  static const char* const kStages[] = {"score", "select", "check_values", "gather"};
  state.SetLabel(std::string(ScorerName(scorer)) + " " + kStages[std::min(stage, 3)] +
                 (sums ? ", sums given" : ""));
}

// memcpy of K and V (the same bytes) split over the same threads: the standalone reference.
void BM_Memcpy(benchmark::State& state) {
  const uint64_t tokens = state.range(0);
  const int threads = state.range(1) == 0 ? AllThreads() : static_cast<int>(state.range(1));
  const Data& d = InputFor(tokens);
  const uint64_t bytes = uint64_t{kHeads} * tokens * kRow;
  std::vector<uint8_t> dk(bytes, 1), dv(bytes, 1);
  for (auto _ : state) {
    ParallelMemcpy(dk.data(), d.k.data(), dv.data(), d.v.data(), bytes, threads);
    benchmark::DoNotOptimize(dk.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * 4 * bytes));
  state.counters["workers"] = threads;
}

// What the keys' sums cost where they are made: one layer's K put together from blocks of
// `block` tokens, head by head (as kvcompd's assembler copies a layer split over blocks), and
// SumKeysOnHost of each chunk right after the copy that completes it: none (0), the sums (1),
// the sums and the unit sums (2). Bytes: K read and written. One thread (the assembler's).
// args: tokens, block tokens, sums
void BM_AssembleKeys(benchmark::State& state) {
  const uint64_t tokens = state.range(0);
  const uint64_t block = state.range(1);
  const int sums = static_cast<int>(state.range(2));
  const Data& d = InputFor(tokens);
  const uint64_t chunks = (tokens + kKeySumChunkTokens - 1) / kKeySumChunkTokens;
  const uint64_t kv_bytes = uint64_t{kHeads} * tokens * kRow;
  std::vector<uint8_t> out(kv_bytes, 1);
  std::vector<float> s(2 * kHeads * chunks * kHeadDim);
  for (auto _ : state) {
    for (uint32_t h = 0; h < kHeads; ++h) {
      uint8_t* head = out.data() + uint64_t{h} * tokens * kRow;
      const auto* src = reinterpret_cast<const uint8_t*>(d.k.data()) + uint64_t{h} * tokens * kRow;
      uint64_t summed = 0;
      for (uint64_t t = 0; t < tokens; t += block) {
        const uint64_t e = std::min(tokens, t + block);
        std::memcpy(head + t * kRow, src + t * kRow, (e - t) * kRow);
        const uint64_t complete = e == tokens ? chunks : e / kKeySumChunkTokens;
        if (!sums || complete <= summed) continue;
        const uint64_t at = uint64_t{h} * chunks * kHeadDim;
        (void)SumKeysOnHost(HeadsView::Dense(head, DType::kBF16, 1, tokens, kHeadDim), summed,
                            complete, s.data() + at,
                            sums == 2 ? s.data() + (kHeads + h) * chunks * kHeadDim : nullptr);
        summed = complete;
      }
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(s.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * 2 * kv_bytes));
  static const char* const kWhat[] = {"copy", "copy + sums", "copy + sums + unit sums"};
  state.SetLabel(kWhat[std::min(sums, 2)]);
}

void Lengths(benchmark::internal::Benchmark* b, bool scorers) {
  for (int64_t n : {8192, 65536, 131072}) {
    for (int64_t t : {1, 0}) {
      if (!scorers) {
        b->Args({n, t});
        continue;
      }
      for (Scorer s : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold,
                       Scorer::kWindowedManifold, Scorer::kStreaming}) {
        b->Args({n, static_cast<int64_t>(s), t, 0});
      }
      for (Scorer s : {Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold}) {
        b->Args({n, static_cast<int64_t>(s), t, 1});
      }
    }
  }
}

BENCHMARK(BM_Memcpy)
    ->Apply([](benchmark::internal::Benchmark* b) { Lengths(b, false); })
    ->ArgNames({"tokens", "threads"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
// Stages at 128K on one thread (a profile, not part of the table: filter BM_Stage to run it).
BENCHMARK(BM_Stage)
    ->Apply([](benchmark::internal::Benchmark* b) {
      for (Scorer s : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold,
                       Scorer::kWindowedManifold, Scorer::kStreaming}) {
        b->Args({131072, static_cast<int64_t>(s), 0, 1, 0});
      }
      for (Scorer s : {Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold}) {
        b->Args({131072, static_cast<int64_t>(s), 0, 1, 1});
      }
      for (int64_t stage : {1, 2, 3}) b->Args({131072, 0, stage, 1, 0});
    })
    ->ArgNames({"tokens", "scorer", "stage", "threads", "sums"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
// MomentKV summaries of the evicted half of a layer (every other token of each head) on the CPU:
// counts, key and value sums and the d x d sum of v k^T, whose dense products dominate. GFLOP/s
// counts the v k^T products (2 d^2 per evicted row). Run with KVCOMP_CPU_ISA=generic to time the
// portable build of the products against the one this CPU takes (filter BM_Moments to run it).
void BM_Moments(benchmark::State& state) {
  const uint64_t tokens = state.range(0);
  const int threads = state.range(1) == 0 ? AllThreads() : static_cast<int>(state.range(1));
  const Data& d = InputFor(tokens);
  CpuBackendOptions options;
  options.num_threads = threads;
  auto backend = std::move(*MakeCpuBackend(options));
  const HeadsView keys = HeadsView::Dense(d.k.data(), DType::kBF16, kHeads, tokens, kHeadDim);
  const HeadsView values = HeadsView::Dense(d.v.data(), DType::kBF16, kHeads, tokens, kHeadDim);
  std::vector<uint32_t> evicted;
  std::vector<uint64_t> offsets = {0};
  for (uint32_t h = 0; h < kHeads; ++h) {
    for (uint32_t t = 1; t < tokens; t += 2) evicted.push_back(t);
    offsets.push_back(evicted.size());
  }
  const TokenLists lists{evicted.data(), offsets.data(), kHeads, MemorySpace::kHost};
  std::vector<uint64_t> count(kHeads);
  std::vector<float> ks(kHeads * kHeadDim), vs(kHeads * kHeadDim),
      vk(uint64_t{kHeads} * kHeadDim * kHeadDim);
  const MomentsView m{count.data(), ks.data(), vs.data(), vk.data(), kHeads, kHeadDim,
                      MemorySpace::kHost};
  for (auto _ : state) {
    const absl::Status st = backend->moments().Accumulate(keys, values, lists, m);
    if (!st.ok()) state.SkipWithError(std::string(st.message()).c_str());
    benchmark::DoNotOptimize(vk.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * kHeadDim * kHeadDim * static_cast<double>(evicted.size()) * state.iterations() / 1e9,
      benchmark::Counter::kIsRate);
  state.counters["workers"] = threads;
}

// The keys' sums where the assembler makes them (filter BM_AssembleKeys to run it).
BENCHMARK(BM_AssembleKeys)
    ->Apply([](benchmark::internal::Benchmark* b) {
      for (int64_t n : {8192, 131072}) {
        for (int64_t block : {256, 4096}) {
          for (int64_t sums : {0, 1, 2}) b->Args({n, block, sums});
        }
      }
    })
    ->ArgNames({"tokens", "block", "sums"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Moments)
    ->Args({8192, 1})
    ->Args({8192, 0})
    ->Args({65536, 1})
    ->ArgNames({"tokens", "threads"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ScoreSelectCompact)
    ->Apply([](benchmark::internal::Benchmark* b) { Lengths(b, true); })
    ->ArgNames({"tokens", "scorer", "threads", "sums"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvcomp

BENCHMARK_MAIN();
