// The conformance suite on the GPU: the CUDA ScoringOps against the CPU reference on fresh random
// inputs (every dtype and head_dim, odd lengths, n below the budget, n = 1, exact ties, every
// scorer, uniform and AdaKV), outputs poisoned before each run. Skipped (77) without a device.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/gpu.h"
#include "gtest/gtest.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/pipeline.h"
#include "scoring_test_util.h"

KVCOMP_GPU_TEST_BINARY();

namespace kvcomp {
namespace {

// Heads of `tokens` tokens, `kept` of them kept per head.
struct Shape {
  uint64_t tokens;
  uint32_t heads;
  uint64_t kept;
};

// A uniform budget over the shape's heads, scored by `s` (the rest as ConformanceCase has it).
testing::ConformanceCase UniformCase(const Shape& sh, Scorer s) {
  testing::ConformanceCase c;
  c.heads = sh.heads;
  c.tokens = sh.tokens;
  c.score.scorer = s;
  c.select.kept_per_head = sh.kept;
  c.select.head_budget = HeadBudget::kUniform;
  return c;
}

TEST(ScoringConformanceGpuTest, CudaAgainstCpu) {
  auto cpu = MakeCpuBackend();
  auto cuda = MakeCudaBackend();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  for (const auto& c : testing::StandardConformanceCases()) {
    testing::CheckConformance(**cuda, **cpu, c);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(ScoringConformanceGpuTest, RecentFractionPoliciesAgainstCpu) {
  auto cpu = MakeCpuBackend();
  auto cuda = MakeCudaBackend();
  ASSERT_TRUE(cpu.ok() && cuda.ok());
  for (const auto& c : testing::RecentFractionConformanceCases()) {
    testing::CheckConformance(**cuda, **cpu, c);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Uniform budgets of short heads take the one-block-per-head selection and the row gather (by
// default up to 8192 tokens: 300, 2048 and 8191 here), longer ones the cluster selection on sm_90
// and the tiled path with KVCOMP_CUDA_CLUSTER_SELECT=0 (the test's second ctest entry; 32768,
// 32769). Ties, protection on and off, a kept count above and below half, many heads (the
// batched layout), every row-reading scorer.
TEST(ScoringConformanceGpuTest, ShortSelectionAgainstCpu) {
  auto cpu = MakeCpuBackend();
  auto cuda = MakeCudaBackend();
  ASSERT_TRUE(cpu.ok() && cuda.ok());
  uint64_t seed = 9500;
  const Shape shapes[] = {
      {2048, 64, 1024}, {8191, 8, 2731}, {32768, 3, 16384}, {32769, 2, 20000}, {300, 5, 299}};
  for (Scorer s : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold,
                   Scorer::kStreaming, Scorer::kRandom}) {
    for (const Shape& sh : shapes) {
      testing::ConformanceCase c = UniformCase(sh, s);
      c.dtype = (seed % 3 == 0) ? DType::kF16 : DType::kBF16;
      c.head_dim = (seed % 5 == 0) ? 64 : 128;
      c.score.window = 1000;
      c.score.seed = seed;
      c.score.stream = 3;
      c.select.protect = (seed % 2) == 0;
      c.select.n_recent = 17;
      c.data.tie_every = (seed % 4 == 1) ? 5 : 0;
      c.seed = seed++;
      testing::CheckConformance(**cuda, **cpu, c);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// The cluster selection's shapes (KVCOMP_CUDA_SHORT_SELECT_MAX_TOKENS=0 in the environment sends
// the short heads there too): one block per head (1, 5 and 1000 tokens), two (1025: slices of
// 513 and 512), eight with slices that end inside a warp's 32 tokens (8193, 100003), slices of
// exactly the largest size (327680 = 8 x 40960) and one token beyond it (the tiled path); kept
// counts of 1, all but one and all; ties; positions protected at both ends.
TEST(ScoringConformanceGpuTest, ClusterSelectionShapesAgainstCpu) {
  auto cpu = MakeCpuBackend();
  auto cuda = MakeCudaBackend();
  ASSERT_TRUE(cpu.ok() && cuda.ok());
  uint64_t seed = 9700;
  const Shape shapes[] = {{1, 3, 1},          {5, 2, 2},          {1000, 4, 999},
                          {1025, 4, 513},     {8193, 3, 1},       {8193, 2, 8193},
                          {100003, 2, 50001}, {327680, 1, 163840}, {327681, 1, 100000}};
  for (const Shape& sh : shapes) {
    for (Scorer s : {Scorer::kKnorm, Scorer::kStreaming}) {
      testing::ConformanceCase c = UniformCase(sh, s);
      c.dtype = DType::kBF16;
      c.head_dim = 64;
      c.select.protect = (seed % 2) == 0;
      c.select.n_recent = 33;
      c.data.tie_every = (seed % 3 == 0) ? 3 : 0;
      c.seed = seed++;
      SCOPED_TRACE(absl::StrFormat("%u x %u, kept %u", sh.heads, sh.tokens, sh.kept));
      testing::CheckConformance(**cuda, **cpu, c);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// Streaming keeps its two ends in one pass, without scores' selection, when the budget covers
// the sinks and the protected tokens (StreamingKeepsEnds): budgets at that bound, above it and one
// below it (the score pass and the selection), scorer and protection sinks of different sizes,
// recent tokens protected or not, one head under AdaKV, each dtype and head_dim, lengths from one
// token to the cluster selection's; a key row with NaN found at its place in both paths.
TEST(ScoringConformanceGpuTest, StreamingEndsAgainstCpu) {
  auto cpu = MakeCpuBackend();
  auto cuda = MakeCudaBackend();
  ASSERT_TRUE(cpu.ok() && cuda.ok());
  struct Setting {
    uint32_t score_sink, protect_sink;
    bool protect;
    uint32_t recent;
  };
  const Setting settings[] = {{4, 4, true, 0},    {0, 4, false, 0},  {64, 4, true, 17},
                              {4, 100, true, 500}, {0, 0, true, 0},  {7, 3, false, 40}};
  uint64_t seed = 9900;
  for (uint64_t n : {1ull, 300ull, 4097ull, 40000ull}) {
    for (const Setting& st : settings) {
      const uint64_t ends = std::min<uint64_t>(
          n, std::max<uint32_t>(st.score_sink, st.protect ? st.protect_sink : 0));
      const uint64_t recent = st.protect ? std::min<uint64_t>(st.recent, n) : 0;
      for (int64_t delta : {-1, 0, 5}) {
        const int64_t kept = static_cast<int64_t>(ends + recent) + delta;
        if (kept < 1) continue;
        testing::ConformanceCase c;
        c.dtype = seed % 3 == 0 ? DType::kF32 : seed % 3 == 1 ? DType::kF16 : DType::kBF16;
        c.head_dim = n > 30000 ? 128 : (seed % 3 == 0 ? 64 : seed % 3 == 1 ? 128 : 256);
        c.heads = seed % 5 == 0 ? 1 : (n > 30000 ? 2 : 5);
        c.tokens = n;
        c.score.scorer = Scorer::kStreaming;
        c.score.n_sink = st.score_sink;
        c.select.kept_per_head = static_cast<uint64_t>(kept);
        c.select.head_budget = c.heads == 1 ? HeadBudget::kAdaKV : HeadBudget::kUniform;
        c.select.protect = st.protect;
        c.select.n_sink = st.protect_sink;
        c.select.n_recent = st.recent;
        c.seed = seed++;
        testing::CheckConformance(**cuda, **cpu, c);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
  // A bad key row in the evicted middle and one in the kept tail: the lowest is reported.
  for (uint64_t n : {4097ull, 40000ull}) {
    testing::ConformanceCase c;
    c.heads = 2;
    c.tokens = n;
    c.score.scorer = Scorer::kStreaming;
    c.select.kept_per_head = n / 2;
    SCOPED_TRACE(c.Name());
    testing::HostHeads k = testing::RandomHeads(c.dtype, 2, n, c.head_dim, 11);
    const testing::HostHeads v = testing::RandomHeads(c.dtype, 2, n, c.head_dim, 12);
    k.Set((uint64_t{1} * n + n - 3) * c.head_dim + 5, NAN);  // head 1, kept
    k.Set((uint64_t{1} * n + 1000) * c.head_dim + 9, NAN);   // head 1, evicted
    for (Backend* b : {cpu->get(), cuda->get()}) {
      const testing::RunOutput o = testing::RunFused(*b, c, k, v, nullptr);
      EXPECT_EQ(o.status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(o.status.message().find(absl::StrFormat(
                    "keys: NaN or Inf (or a squared norm beyond float32) at head 1, token 1000")),
                std::string::npos)
          << o.status;
    }
  }
}

TEST(ScoringConformanceGpuTest, LongSequencesAgainstCpu) {
  auto cpu = MakeCpuBackend();
  auto cuda = MakeCudaBackend();
  ASSERT_TRUE(cpu.ok() && cuda.ok());
  uint64_t seed = 9000;
  for (Scorer s :
       {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold}) {
    for (HeadBudget hb : {HeadBudget::kUniform, HeadBudget::kAdaKV}) {
      testing::ConformanceCase c;
      c.dtype = DType::kBF16;
      c.head_dim = 128;
      c.heads = 8;
      c.tokens = 70001;
      c.score.scorer = s;
      c.score.window = 4096;
      c.select.kept_per_head = 35000;
      c.select.head_budget = hb;
      c.seed = seed++;
      testing::CheckConformance(**cuda, **cpu, c);
    }
  }
}

// The keys' sums accumulated by the device staging as a put's blocks arrive (DeviceKv: blocks of
// uneven sizes that straddle the sums' chunks, out of order, from host and from device memory),
// handed to the scorer: the same scores, bit for bit, and the same kept set as the scorer that
// sums the keys itself, and the CPU twin's result on fresh random inputs. A window that is not
// a multiple of the chunk falls back to the scorer's own sums; a knorm call ignores them.
TEST(ScoringConformanceGpuTest, KeySumsFromStagingAgainstCpu) {
  auto cpu = MakeCpuBackend();
  auto cuda = MakeCudaBackend();
  ASSERT_TRUE(cpu.ok() && cuda.ok());
  auto uploader = DeviceUploader::Create(0, 1 << 20, 3);
  ASSERT_TRUE(uploader.ok()) << uploader.status();
  struct Shape {
    DType dtype;
    uint32_t head_dim;
    uint32_t heads;
    uint64_t tokens;
    uint32_t window;
  };
  const Shape shapes[] = {{DType::kBF16, 128, 8, 3001, 512},
                          {DType::kF16, 64, 3, 20000, 4096},
                          {DType::kBF16, 128, 2, 9000, 1000},
                          {DType::kF32, 256, 2, 256, 256},
                          {DType::kBF16, 128, 4, 77, 4096}};
  uint64_t seed = 9700;
  for (const Shape& sh : shapes) {
    for (Scorer scorer :
         {Scorer::kManifold, Scorer::kKeyDiff, Scorer::kWindowedManifold, Scorer::kKnorm}) {
      testing::ConformanceCase c;
      c.dtype = sh.dtype;
      c.head_dim = sh.head_dim;
      c.heads = sh.heads;
      c.tokens = sh.tokens;
      c.score.scorer = scorer;
      c.score.window = sh.window;
      c.select.kept_per_head = (sh.tokens + 1) / 2;
      c.select.head_budget = (seed % 2) ? HeadBudget::kUniform : HeadBudget::kAdaKV;
      c.seed = seed++;
      SCOPED_TRACE(c.Name());
      const testing::HostHeads k =
          testing::RandomHeads(c.dtype, c.heads, c.tokens, c.head_dim, c.seed);
      const testing::HostHeads v =
          testing::RandomHeads(c.dtype, c.heads, c.tokens, c.head_dim, c.seed + 1000);

      // The put: every block of keys and values once, in a shuffled order.
      KvLayout layout;
      layout.num_layers = 1;
      layout.num_kv_heads = c.heads;
      layout.num_q_heads = c.heads;
      layout.head_dim = c.head_dim;
      layout.dtype = c.dtype;
      auto kv = DeviceKv::Create(**uploader, layout, c.tokens);
      ASSERT_TRUE(kv.ok()) << kv.status();
      testing::DeviceArray dk((**cuda), k.bytes.size()), dv((**cuda), v.bytes.size());
      dk.Upload(k.bytes.data());
      dv.Upload(v.bytes.data());
      ASSERT_TRUE((*cuda)->Synchronize().ok());
      std::mt19937_64 rng(c.seed);
      std::vector<std::pair<uint64_t, uint64_t>> blocks;  // [begin, end)
      for (uint64_t b = 0; b < c.tokens;) {
        const uint64_t e = std::min<uint64_t>(c.tokens, b + 1 + rng() % 700);
        blocks.emplace_back(b, e);
        b = e;
      }
      std::shuffle(blocks.begin(), blocks.end(), rng);
      const size_t es = testing::ElemSize(c.dtype);
      for (size_t i = 0; i < blocks.size(); ++i) {
        const auto [b, e] = blocks[i];
        for (bool values : {false, true}) {
          const bool host = (i + values) % 2 == 0;
          const void* base =
              host ? (values ? v.bytes.data() : k.bytes.data()) : (values ? dv.data() : dk.data());
          HeadsView part{static_cast<const uint8_t*>(base) + b * c.head_dim * es,
                         c.dtype,
                         c.heads,
                         e - b,
                         c.head_dim,
                         c.head_dim,
                         c.tokens * c.head_dim,
                         host ? MemorySpace::kHost : MemorySpace::kDevice};
          const absl::Status st =
              host ? (*kv)->AddHost(0, values, b, part) : (*kv)->AddDevice(0, values, b, part);
          ASSERT_TRUE(st.ok()) << st;
        }
      }
      auto view = (*kv)->View(**cuda);
      ASSERT_TRUE(view.ok()) << view.status();
      ASSERT_EQ(view->key_sums.size(), 1u);
      const KeySums sums = view->key_sums[0];
      ASSERT_NE(sums.sums, nullptr);
      ASSERT_NE(sums.unit_sums, nullptr);
      ASSERT_EQ(sums.num_tokens, c.tokens);

      const testing::RunOutput ref = testing::RunFused(**cpu, c, k, v, nullptr);
      const testing::RunOutput own = testing::RunFused(**cuda, c, k, v, nullptr);
      const testing::RunOutput given = testing::RunFused(**cuda, c, k, v, nullptr, &sums);
      ASSERT_TRUE(given.status.ok()) << given.status;
      ASSERT_EQ(own.scores.size(), given.scores.size());
      for (size_t i = 0; i < own.scores.size(); ++i) {
        ASSERT_EQ(own.scores[i], given.scores[i]) << "score " << i;
      }
      EXPECT_EQ(own.counts, given.counts);
      EXPECT_EQ(own.indices, given.indices);
      testing::CompareRuns(c, k, v, ref, given);
      if (::testing::Test::HasFatalFailure()) return;
      ASSERT_TRUE((*cuda)->Synchronize().ok());
    }
  }

  // Sums of another length are refused.
  testing::ConformanceCase c;
  c.tokens = 300;
  c.select.kept_per_head = 100;
  const testing::HostHeads k = testing::RandomHeads(c.dtype, c.heads, c.tokens, c.head_dim, 1);
  KeySums wrong;
  wrong.sums = reinterpret_cast<const float*>(k.bytes.data());
  wrong.num_tokens = 299;
  EXPECT_EQ(testing::RunFused(**cuda, c, k, k, nullptr, &wrong).status.code(),
            absl::StatusCode::kInvalidArgument);
}

// One varlen call on `b` over packed host K and V ([H, total, d]), outputs poisoned first.
struct VarlenRun {
  absl::Status status;
  std::vector<float> scores;
  std::vector<uint32_t> counts, indices;
  std::vector<uint8_t> keys, values;
};

VarlenRun RunVarlen(Backend& b, const std::vector<uint8_t>& k, const std::vector<uint8_t>& v,
                    DType dtype, uint32_t heads, uint32_t d, const std::vector<uint64_t>& cu,
                    const std::vector<uint64_t>& kept, const ScoreParams& score,
                    const SelectParams& select) {
  VarlenRun out;
  const uint32_t requests = static_cast<uint32_t>(kept.size());
  const uint64_t total = cu.back();
  uint64_t rows = 0;
  for (uint32_t r = 0; r < requests; ++r) {
    rows += uint64_t{heads} * std::min(kept[r], cu[r + 1] - cu[r]);
  }
  const size_t row = d * testing::ElemSize(dtype);
  testing::DeviceArray dk(b, k.size()), dv(b, v.size()), sc(b, heads * total * 4),
      counts(b, uint64_t{requests} * heads * 4), idx(b, rows * 4), ko(b, rows * row),
      vo(b, rows * row);
  dk.Upload(k.data());
  dv.Upload(v.data());
  for (testing::DeviceArray* a : {&sc, &counts, &idx, &ko, &vo}) a->Poison();
  ScoreSelectCompactVarlenArgs a;
  a.keys = HeadsView::Dense(dk.data(), dtype, heads, total, d, b.space());
  a.values = HeadsView::Dense(dv.data(), dtype, heads, total, d, b.space());
  a.cu_seqlens = cu.data();
  a.requests = requests;
  a.score = score;
  a.select = select;
  a.kept_per_head = kept.data();
  a.scores = static_cast<float*>(sc.data());
  a.kept = {static_cast<uint32_t*>(counts.data()), static_cast<uint32_t*>(idx.data())};
  a.keys_out = ko.data();
  a.values_out = vo.data();
  out.status = b.scoring().ScoreSelectCompactVarlen(a);
  if (!out.status.ok()) return out;
  out.status = b.Synchronize();
  auto raw = sc.Download();
  out.scores.resize(heads * total);
  std::memcpy(out.scores.data(), raw.data(), raw.size());
  raw = counts.Download();
  out.counts.resize(uint64_t{requests} * heads);
  std::memcpy(out.counts.data(), raw.data(), raw.size());
  raw = idx.Download();
  out.indices.resize(rows);
  std::memcpy(out.indices.data(), raw.data(), raw.size());
  out.keys = ko.Download();
  out.values = vo.Download();
  return out;
}

// Many requests of different lengths in one call (cu_seqlens): the CUDA one-launch path (and
// its request-by-request fallback: a window shorter than a request) against the CPU reference,
// one ScoreSelectCompact per request, on fresh random inputs; a NaN key names the same request,
// head and token on both.
TEST(ScoringConformanceGpuTest, VarlenBatchAgainstCpu) {
  auto cpu = MakeCpuBackend();
  auto cuda = MakeCudaBackend();
  ASSERT_TRUE(cpu.ok() && cuda.ok());
  uint64_t seed = 9900;
  struct Scoring {
    Scorer scorer;
    uint32_t window;
  };
  const Scoring scorings[] = {{Scorer::kKnorm, 4096},
                              {Scorer::kKeyDiff, 4096},
                              {Scorer::kManifold, 4096},
                              {Scorer::kWindowedManifold, 8192},
                              {Scorer::kWindowedManifold, 1000},
                              {Scorer::kStreaming, 4096},
                              {Scorer::kRandom, 4096}};
  for (const Scoring& sc : scorings) {
    std::mt19937_64 rng(seed);
    const DType dtype = seed % 2 ? DType::kF16 : DType::kBF16;
    const uint32_t d = seed % 3 == 0 ? 64 : 128;
    const uint32_t heads = 1 + seed % 4;
    const uint32_t requests = 9 + seed % 7;
    std::vector<uint64_t> cu{0}, kept;
    std::vector<testing::HostHeads> ks, vs;
    for (uint32_t r = 0; r < requests; ++r) {
      const uint64_t n = r == 0 ? 8192 : r == 1 ? 1 : 1 + rng() % 6000;
      cu.push_back(cu.back() + n);
      kept.push_back(1 + rng() % (n + 3));
      ks.push_back(testing::RandomHeads(dtype, heads, n, d, seed * 100 + r));
      vs.push_back(testing::RandomHeads(dtype, heads, n, d, seed * 100 + 50 + r));
    }
    const uint64_t total = cu.back();
    const size_t row = d * testing::ElemSize(dtype);
    std::vector<uint8_t> k(heads * total * row), v(heads * total * row);
    for (uint32_t r = 0; r < requests; ++r) {
      const uint64_t n = cu[r + 1] - cu[r];
      for (uint32_t h = 0; h < heads; ++h) {
        std::memcpy(k.data() + (h * total + cu[r]) * row, ks[r].bytes.data() + h * n * row,
                    n * row);
        std::memcpy(v.data() + (h * total + cu[r]) * row, vs[r].bytes.data() + h * n * row,
                    n * row);
      }
    }
    ScoreParams score;
    score.scorer = sc.scorer;
    score.window = sc.window;
    score.seed = seed;
    score.stream = 7;
    SelectParams select;
    select.protect = seed % 2 == 0;
    select.n_recent = 9;
    SCOPED_TRACE(absl::StrFormat("%s window %u, %s d=%u H=%u, %u requests", ScorerName(sc.scorer),
                                 sc.window, DTypeName(dtype), d, heads, requests));
    const VarlenRun ref = RunVarlen(**cpu, k, v, dtype, heads, d, cu, kept, score, select);
    const VarlenRun got = RunVarlen(**cuda, k, v, dtype, heads, d, cu, kept, score, select);
    ASSERT_TRUE(ref.status.ok()) << ref.status;
    ASSERT_TRUE(got.status.ok()) << got.status;
    uint64_t rows = 0;
    for (uint32_t r = 0; r < requests; ++r) {
      const uint64_t n = cu[r + 1] - cu[r];
      testing::ConformanceCase c;
      c.dtype = dtype;
      c.head_dim = d;
      c.heads = heads;
      c.tokens = n;
      c.score = score;
      c.select = select;
      c.select.kept_per_head = kept[r];
      SCOPED_TRACE(absl::StrFormat("request %u", r));
      auto slice = [&](const VarlenRun& x) {
        testing::RunOutput o;
        o.scores.assign(x.scores.begin() + heads * cu[r], x.scores.begin() + heads * cu[r + 1]);
        o.counts.assign(x.counts.begin() + uint64_t{r} * heads,
                        x.counts.begin() + uint64_t{r + 1} * heads);
        uint64_t m = 0;
        for (uint32_t cnt : o.counts) m += cnt;
        const uint64_t at = std::min<uint64_t>(rows, x.indices.size());
        const uint64_t end = std::min<uint64_t>(at + m, x.indices.size());
        o.indices.assign(x.indices.begin() + at, x.indices.begin() + end);
        o.keys.assign(x.keys.begin() + at * row, x.keys.begin() + end * row);
        o.values.assign(x.values.begin() + at * row, x.values.begin() + end * row);
        return o;
      };
      const testing::RunOutput a = slice(ref), b = slice(got);
      ASSERT_EQ(b.indices.size(), heads * std::min(kept[r], n));
      testing::CompareRuns(c, ks[r], vs[r], a, b);
      if (::testing::Test::HasFatalFailure()) return;
      rows += heads * std::min(kept[r], n);
    }
    if (sc.scorer == Scorer::kManifold) {
      // A NaN key in request 3: the same message from both.
      const uint64_t t = (cu[4] - cu[3]) / 2;
      const uint32_t h = heads - 1;
      std::vector<uint8_t> bad = k;
      std::memset(bad.data() + (h * total + cu[3] + t) * row, 0xFF, row);
      const VarlenRun rb = RunVarlen(**cpu, bad, v, dtype, heads, d, cu, kept, score, select);
      const VarlenRun gb = RunVarlen(**cuda, bad, v, dtype, heads, d, cu, kept, score, select);
      EXPECT_EQ(rb.status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(rb.status, gb.status);
      EXPECT_NE(rb.status.message().find(absl::StrFormat("request 3: keys: NaN")),
                std::string::npos)
          << rb.status;
      // NaN values in requests 2 and 6 (one row each; kept or evicted): request 2 is named.
      std::vector<uint8_t> badv = v;
      for (uint32_t r : {6u, 2u}) {
        const uint64_t tv = (cu[r + 1] - cu[r]) / 3;
        std::memset(badv.data() + (cu[r] + tv) * row, 0xFF, row);  // head 0
      }
      const VarlenRun rv = RunVarlen(**cpu, k, badv, dtype, heads, d, cu, kept, score, select);
      const VarlenRun gv = RunVarlen(**cuda, k, badv, dtype, heads, d, cu, kept, score, select);
      EXPECT_EQ(rv.status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(rv.status, gv.status);
      EXPECT_NE(rv.status.message().find("request 2: values: NaN"), std::string::npos) << rv.status;
    }
    ++seed;
  }
  // Bad batches are refused by both alike.
  std::vector<uint8_t> k(2 * 100 * 128 * 2, 0x3C);
  ScoreParams score;
  SelectParams select;
  for (const auto& [cu, kept] :
       {std::pair{std::vector<uint64_t>{0, 60, 60, 100}, std::vector<uint64_t>{5, 5, 5}},
        std::pair{std::vector<uint64_t>{5, 60, 100}, std::vector<uint64_t>{5, 5}},
        std::pair{std::vector<uint64_t>{0, 60, 100}, std::vector<uint64_t>{5, 0}}}) {
    const VarlenRun rb = RunVarlen(**cpu, k, k, DType::kBF16, 2, 128, cu, kept, score, select);
    const VarlenRun gb = RunVarlen(**cuda, k, k, DType::kBF16, 2, 128, cu, kept, score, select);
    EXPECT_EQ(rb.status.code(), absl::StatusCode::kInvalidArgument) << rb.status;
    EXPECT_EQ(rb.status, gb.status);
  }
}

// The values' data check runs in the compaction (kept rows as they are copied, evicted rows
// after): a bad value row is found whether its token is kept or evicted, on the one-block
// selection (301 tokens) and the tiled one (9000 tokens, uniform and AdaKV), and the first bad
// row (lowest head, then token) is the one named. Streaming keeps the sinks and the latest
// tokens, so which rows are kept is known.
TEST(ScoringConformanceGpuTest, ValueCheckInCompactionFindsKeptAndEvictedRows) {
  auto cuda = MakeCudaBackend();
  ASSERT_TRUE(cuda.ok());
  struct Case {
    uint64_t tokens;
    HeadBudget budget;
    std::vector<std::pair<uint32_t, uint64_t>> bad;  // (head, token)
    std::pair<uint32_t, uint64_t> expect;
  };
  const Case cases[] = {
      {301, HeadBudget::kUniform, {{1, 150}}, {1, 150}},            // evicted
      {301, HeadBudget::kUniform, {{1, 250}}, {1, 250}},            // kept
      {301, HeadBudget::kUniform, {{1, 250}, {1, 150}}, {1, 150}},  // both: the first
      {301, HeadBudget::kUniform, {{0, 290}, {1, 20}}, {0, 290}},   // lower head first
      {9000, HeadBudget::kUniform, {{1, 3000}}, {1, 3000}},         // evicted, tiled
      {9000, HeadBudget::kUniform, {{1, 7000}}, {1, 7000}},         // kept, tiled
      {9000, HeadBudget::kUniform, {{1, 7000}, {1, 3000}}, {1, 3000}},
      {9000, HeadBudget::kAdaKV, {{1, 3000}}, {1, 3000}},
      {9000, HeadBudget::kAdaKV, {{0, 8000}, {1, 2}}, {0, 8000}},
      // Long heads: the cluster selection's compaction (the tiled path without clusters).
      {40000, HeadBudget::kUniform, {{1, 3000}}, {1, 3000}},                // evicted
      {40000, HeadBudget::kUniform, {{1, 39000}}, {1, 39000}},              // kept
      {40000, HeadBudget::kUniform, {{1, 3000}, {0, 39500}}, {0, 39500}},   // lower head first
  };
  for (const Case& cs : cases) {
    for (DType dt : {DType::kBF16, DType::kF32}) {
      testing::ConformanceCase c;
      c.dtype = dt;
      c.head_dim = dt == DType::kF32 ? 64 : 128;
      c.heads = 2;
      c.tokens = cs.tokens;
      c.score.scorer = Scorer::kStreaming;
      c.select.kept_per_head = cs.tokens / 3;
      c.select.head_budget = cs.budget;
      SCOPED_TRACE(c.Name());
      const testing::HostHeads k = testing::RandomHeads(dt, 2, cs.tokens, c.head_dim, 5);
      testing::HostHeads v = testing::RandomHeads(dt, 2, cs.tokens, c.head_dim, 6);
      for (const auto& [h, t] : cs.bad) {
        v.Set((uint64_t{h} * cs.tokens + t) * c.head_dim + 3, NAN);
      }
      const testing::RunOutput o = testing::RunFused(**cuda, c, k, v, nullptr);
      EXPECT_EQ(o.status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(o.status.message().find(absl::StrFormat(
                    "values: NaN or Inf (or a squared norm beyond float32) at head %u, token %u",
                    cs.expect.first, cs.expect.second)),
                std::string::npos)
          << o.status;
    }
  }
}

}  // namespace
}  // namespace kvcomp
