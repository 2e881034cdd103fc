// CUDA ScoringOps beyond the fused conformance suite: the three separate ops agree bit for bit
// with the fused one; strided and unaligned views (repacked) give the dense results; explicit
// token positions against the CPU; bad data and bad arguments give clear statuses; an injected
// allocator that poisons and counts its memory sees every workspace returned. gpu label; 77
// without a device.
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/gpu.h"
#include "gtest/gtest.h"
#include "kvcomp/kernels/backend.h"
#include "scoring_test_util.h"

#if defined(KVCOMP_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

KVCOMP_GPU_TEST_BINARY();

namespace kvcomp {
namespace {

using testing::DeviceArray;
using testing::ElemSize;
using testing::HostHeads;
using testing::RandomHeads;

struct Outputs {
  absl::Status status;
  std::vector<uint8_t> scores, counts, indices, keys, values;
};

std::unique_ptr<Backend> Cuda(const CudaBackendOptions& o = {}) {
  auto b = MakeCudaBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

// Runs either the fused op or Score, Select and Compact in turn; `kv` views given.
Outputs RunOps(Backend& b, const HeadsView& k, const HeadsView& v, const ScoreParams& sp,
               const SelectParams& sel, const TokenPositions& pos, bool fused,
               bool compact = true) {
  Outputs o;
  const uint64_t hn = uint64_t{k.num_heads} * k.num_tokens;
  const uint64_t cap = KeptCapacity(k.num_heads, k.num_tokens, sel.kept_per_head);
  const size_t row = k.head_dim * ElemSize(k.dtype);
  DeviceArray scores(b, hn * 4), counts(b, k.num_heads * 4), idx(b, cap * 4), ko(b, cap * row),
      vo(b, cap * row);
  for (DeviceArray* a : {&scores, &counts, &idx, &ko, &vo}) a->Poison();
  auto* sc = static_cast<float*>(scores.data());
  KeptIndices kept{static_cast<uint32_t*>(counts.data()), static_cast<uint32_t*>(idx.data())};
  if (fused) {
    ScoreSelectCompactArgs a;
    a.keys = k;
    a.values = v;
    a.score = sp;
    a.select = sel;
    a.positions = pos;
    a.scores = sc;
    a.kept = kept;
    a.keys_out = compact ? ko.data() : nullptr;
    a.values_out = compact ? vo.data() : nullptr;
    a.compact = compact;
    o.status = b.scoring().ScoreSelectCompact(a);
  } else {
    o.status = b.scoring().Score(k, sp, pos, sc);
    if (o.status.ok()) {
      o.status = b.scoring().Select(sc, k.num_heads, k.num_tokens, sel, pos, kept);
    }
    if (o.status.ok()) {
      o.status = b.scoring().Compact(k, v, kept.counts, kept.indices, ko.data(), vo.data());
    }
  }
  if (!o.status.ok()) return o;
  o.status = b.Synchronize();
  o.scores = scores.Download();
  o.counts = counts.Download();
  o.indices = idx.Download();
  o.keys = ko.Download();
  o.values = vo.Download();
  return o;
}

// A device copy of `h` with `token_pad` extra elements per row and `head_pad` per head, starting
// `shift` elements into the allocation (so rows may be unaligned).
struct StridedCopy {
  std::unique_ptr<DeviceArray> mem;
  HeadsView view;
};
StridedCopy Strided(Backend& b, const HostHeads& h, uint32_t token_pad, uint32_t head_pad,
                    uint32_t shift) {
  const size_t e = ElemSize(h.dtype);
  const uint64_t ts = h.head_dim + token_pad;
  const uint64_t hs = h.tokens * ts + head_pad;
  std::vector<uint8_t> host((shift + h.heads * hs) * e, 0x7F);
  for (uint32_t i = 0; i < h.heads; ++i) {
    for (uint64_t t = 0; t < h.tokens; ++t) {
      std::memcpy(host.data() + (shift + i * hs + t * ts) * e,
                  h.bytes.data() + (uint64_t{i} * h.tokens + t) * h.head_dim * e, h.head_dim * e);
    }
  }
  StridedCopy c;
  c.mem = std::make_unique<DeviceArray>(b, host.size());
  c.mem->Upload(host.data());
  c.view = HeadsView{static_cast<const char*>(c.mem->data()) + shift * e,
                     h.dtype,
                     h.heads,
                     h.tokens,
                     h.head_dim,
                     ts,
                     hs,
                     MemorySpace::kDevice};
  return c;
}

void ExpectSame(const Outputs& a, const Outputs& b) {
  ASSERT_TRUE(a.status.ok()) << a.status;
  ASSERT_TRUE(b.status.ok()) << b.status;
  EXPECT_EQ(a.scores, b.scores);
  EXPECT_EQ(a.counts, b.counts);
  EXPECT_EQ(a.indices, b.indices);
  EXPECT_EQ(a.keys, b.keys);
  EXPECT_EQ(a.values, b.values);
}

TEST(ScoringCudaTest, SeparateOpsMatchFusedExactly) {
  auto b = Cuda();
  ASSERT_NE(b, nullptr);
  uint64_t seed = 500;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (uint32_t d : {64u, 256u}) {
      for (Scorer s : {Scorer::kKnorm, Scorer::kKeyDiff, Scorer::kWindowedManifold,
                       Scorer::kRandom}) {
        for (HeadBudget hb : {HeadBudget::kUniform, HeadBudget::kAdaKV}) {
          SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " d=" << d << " "
                                            << ScorerName(s) << " " << HeadBudgetName(hb));
          const HostHeads k = RandomHeads(dt, 5, 2999, d, seed++);
          const HostHeads v = RandomHeads(dt, 5, 2999, d, seed++);
          DeviceArray dk(*b, k.bytes.size()), dv(*b, v.bytes.size());
          dk.Upload(k.bytes.data());
          dv.Upload(v.bytes.data());
          const HeadsView kv =
              HeadsView::Dense(dk.data(), dt, 5, 2999, d, MemorySpace::kDevice);
          const HeadsView vv =
              HeadsView::Dense(dv.data(), dt, 5, 2999, d, MemorySpace::kDevice);
          ScoreParams sp;
          sp.scorer = s;
          sp.window = 1000;
          sp.seed = seed;
          SelectParams sel;
          sel.kept_per_head = 1234;
          sel.head_budget = hb;
          sel.n_recent = 7;
          ExpectSame(RunOps(*b, kv, vv, sp, sel, {}, true), RunOps(*b, kv, vv, sp, sel, {}, false));
        }
      }
    }
  }
}

// compact = false: the fused op's scores, counts and indices, short heads (one-block selection)
// and long ones (tiled), uniform and AdaKV budgets; the row outputs are left alone and the
// values are not read (NaN in them is no error).
TEST(ScoringCudaTest, SelectOnlyMatchesTheFusedSelection) {
  auto b = Cuda();
  ASSERT_NE(b, nullptr);
  uint64_t seed = 900;
  for (uint64_t n : {uint64_t{2999}, uint64_t{20000}}) {
    for (Scorer s : {Scorer::kKnorm, Scorer::kManifold, Scorer::kStreaming}) {
      for (HeadBudget hb : {HeadBudget::kUniform, HeadBudget::kAdaKV}) {
        SCOPED_TRACE(::testing::Message() << n << " " << ScorerName(s) << " "
                                          << HeadBudgetName(hb));
        const HostHeads k = RandomHeads(DType::kBF16, 4, n, 128, seed++);
        HostHeads v = RandomHeads(DType::kBF16, 4, n, 128, seed++);
        DeviceArray dk(*b, k.bytes.size()), dv(*b, v.bytes.size());
        dk.Upload(k.bytes.data());
        dv.Upload(v.bytes.data());
        const HeadsView kv = HeadsView::Dense(dk.data(), DType::kBF16, 4, n, 128,
                                              MemorySpace::kDevice);
        const HeadsView vv = HeadsView::Dense(dv.data(), DType::kBF16, 4, n, 128,
                                              MemorySpace::kDevice);
        ScoreParams sp;
        sp.scorer = s;
        SelectParams sel;
        sel.kept_per_head = n / 3;
        sel.head_budget = hb;
        const Outputs fused = RunOps(*b, kv, vv, sp, sel, {}, true);
        const Outputs only = RunOps(*b, kv, vv, sp, sel, {}, true, /*compact=*/false);
        ASSERT_TRUE(fused.status.ok()) << fused.status;
        ASSERT_TRUE(only.status.ok()) << only.status;
        EXPECT_EQ(only.scores, fused.scores);
        EXPECT_EQ(only.counts, fused.counts);
        EXPECT_EQ(only.indices, fused.indices);
        EXPECT_NE(only.keys, fused.keys);  // still the poison: nothing was written
        // NaN in a value: the select-only op does not read V.
        std::vector<uint8_t> bad = v.bytes;
        StoreFromFloat(bad.data(), DType::kBF16, 5 * 128 + 3, NAN);
        dv.Upload(bad.data());
        EXPECT_TRUE(RunOps(*b, kv, vv, sp, sel, {}, true, false).status.ok());
        EXPECT_EQ(RunOps(*b, kv, vv, sp, sel, {}, true, true).status.code(),
                  absl::StatusCode::kInvalidArgument);
      }
    }
  }
}

TEST(ScoringCudaTest, StridedAndUnalignedViewsMatchDense) {
  auto b = Cuda();
  ASSERT_NE(b, nullptr);
  uint64_t seed = 700;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (uint32_t shift : {0u, 1u}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " shift=" << shift);
      const HostHeads k = RandomHeads(dt, 3, 777, 128, seed++);
      const HostHeads v = RandomHeads(dt, 3, 777, 128, seed++);
      StridedCopy dk = Strided(*b, k, 8, 24, 0), dv = Strided(*b, v, 3, 5, shift);
      StridedCopy sk = Strided(*b, k, 0, 0, shift);
      StridedCopy dense_k = Strided(*b, k, 0, 0, 0), dense_v = Strided(*b, v, 0, 0, 0);
      ScoreParams sp;
      sp.scorer = Scorer::kManifold;
      SelectParams sel;
      sel.kept_per_head = 300;
      const Outputs want = RunOps(*b, dense_k.view, dense_v.view, sp, sel, {}, true);
      ExpectSame(want, RunOps(*b, dk.view, dv.view, sp, sel, {}, true));
      ExpectSame(want, RunOps(*b, sk.view, dv.view, sp, sel, {}, false));
    }
  }
}

TEST(ScoringCudaTest, ExplicitPositionsAgainstCpu) {
  auto cuda = Cuda();
  auto cpu = MakeCpuBackend();
  ASSERT_NE(cuda, nullptr);
  ASSERT_TRUE(cpu.ok());
  const uint32_t heads = 2;
  const uint64_t n = 513;
  std::vector<uint32_t> pos(heads * n);
  for (uint32_t h = 0; h < heads; ++h) {
    for (uint64_t t = 0; t < n; ++t) pos[h * n + t] = static_cast<uint32_t>(3 * t + h);
  }
  // Streaming and random scores are exact formulas of the positions: bit-equal across backends.
  for (Scorer s : {Scorer::kStreaming, Scorer::kRandom}) {
    SCOPED_TRACE(ScorerName(s));
    const HostHeads k = RandomHeads(DType::kF16, heads, n, 64, 900 + static_cast<int>(s));
    ScoreParams sp;
    sp.scorer = s;
    sp.n_sink = 6;
    sp.seed = 42;
    SelectParams sel;
    sel.kept_per_head = 100;
    sel.n_sink = 5;
    sel.n_recent = 30;
    std::vector<std::vector<uint8_t>> got;
    for (Backend* b : {cuda.get(), cpu->get()}) {
      DeviceArray dk(*b, k.bytes.size()), dp(*b, pos.size() * 4), sc(*b, heads * n * 4),
          cnt(*b, heads * 4), idx(*b, heads * 100 * 4);
      dk.Upload(k.bytes.data());
      dp.Upload(pos.data());
      idx.Poison();
      TokenPositions tp;
      tp.data = static_cast<const uint32_t*>(dp.data());
      tp.sequence_length = 3 * n + 10;
      const HeadsView kv = HeadsView::Dense(dk.data(), DType::kF16, heads, n, 64, b->space());
      ASSERT_TRUE(b->scoring().Score(kv, sp, tp, static_cast<float*>(sc.data())).ok());
      ASSERT_TRUE(b->scoring()
                      .Select(static_cast<float*>(sc.data()), heads, n, sel, tp,
                              {static_cast<uint32_t*>(cnt.data()),
                               static_cast<uint32_t*>(idx.data())})
                      .ok());
      ASSERT_TRUE(b->Synchronize().ok());
      got.push_back(idx.Download());
      got.push_back(sc.Download());
    }
    EXPECT_EQ(got[0], got[2]);  // indices
    EXPECT_EQ(got[1], got[3]);  // scores, bit for bit
  }
}

// Scores of five distinct values: the threshold is shared by a fifth of every head's tokens,
// across all the blocks (and slices) that select it, so the tie ranks decide most of the kept
// set. Lengths for one, two and eight blocks per head and for the tiled path beyond; kept counts
// that cut the tied run at its start, middle and end; protection on and off.
TEST(ScoringCudaTest, SelectOfHeavyTiesAgainstCpu) {
  auto cuda = Cuda();
  auto cpu = MakeCpuBackend();
  ASSERT_NE(cuda, nullptr);
  ASSERT_TRUE(cpu.ok());
  const uint32_t heads = 3;
  for (uint64_t n : {777ull, 2049ull, 70001ull, 400000ull}) {
    for (uint64_t kept : {uint64_t{1}, n / 5, n / 2 + 3, n - 1}) {
      for (bool protect : {false, true}) {
        SCOPED_TRACE(absl::StrFormat("n %u kept %u protect %d", n, kept, protect));
        std::vector<float> scores(heads * n);
        for (uint64_t i = 0; i < scores.size(); ++i) {
          scores[i] = static_cast<float>((i * 7919 + i / n) % 5) - 2.0f;
        }
        SelectParams sel;
        sel.kept_per_head = kept;
        sel.protect = protect;
        sel.n_sink = 4;
        sel.n_recent = 64;
        std::vector<std::vector<uint8_t>> got;
        for (Backend* b : {cuda.get(), cpu->get()}) {
          DeviceArray sc(*b, scores.size() * 4), cnt(*b, heads * 4),
              idx(*b, KeptCapacity(heads, n, kept) * 4);
          sc.Upload(scores.data());
          idx.Poison();
          cnt.Poison();
          ASSERT_TRUE(b->scoring()
                          .Select(static_cast<float*>(sc.data()), heads, n, sel, {},
                                  {static_cast<uint32_t*>(cnt.data()),
                                   static_cast<uint32_t*>(idx.data())})
                          .ok());
          ASSERT_TRUE(b->Synchronize().ok());
          got.push_back(cnt.Download());
          got.push_back(idx.Download());
        }
        EXPECT_EQ(got[0], got[2]);  // counts
        EXPECT_EQ(got[1], got[3]);  // indices
      }
    }
  }
}

TEST(ScoringCudaTest, NonFiniteKeysAreInvalidArgument) {
  auto b = Cuda();
  ASSERT_NE(b, nullptr);
  for (Scorer s : {Scorer::kKnorm, Scorer::kManifold, Scorer::kKeyDiff,
                   Scorer::kWindowedManifold, Scorer::kStreaming, Scorer::kRandom}) {
    for (float bad : {NAN, INFINITY, 3e38f}) {
      HostHeads k = RandomHeads(DType::kF32, 2, 301, 64, 77);
      k.Set((uint64_t{1} * 301 + 200) * 64 + 5, bad);
      const HostHeads v = RandomHeads(DType::kF32, 2, 301, 64, 78);
      DeviceArray dk(*b, k.bytes.size()), dv(*b, v.bytes.size());
      dk.Upload(k.bytes.data());
      dv.Upload(v.bytes.data());
      ScoreParams sp;
      sp.scorer = s;
      sp.window = 64;
      SelectParams sel;
      sel.kept_per_head = 100;
      const Outputs o = RunOps(
          *b, HeadsView::Dense(dk.data(), DType::kF32, 2, 301, 64, MemorySpace::kDevice),
          HeadsView::Dense(dv.data(), DType::kF32, 2, 301, 64, MemorySpace::kDevice), sp, sel, {},
          true);
      EXPECT_EQ(o.status.code(), absl::StatusCode::kInvalidArgument) << ScorerName(s) << bad;
      EXPECT_NE(o.status.message().find("head 1, token 200"), std::string::npos)
          << ScorerName(s) << " " << bad << ": " << o.status;
    }
  }
}

TEST(ScoringCudaTest, NonFiniteValuesAreInvalidArgumentLikeKeys) {
  auto b = Cuda();
  ASSERT_NE(b, nullptr);
  for (Scorer s : {Scorer::kKnorm, Scorer::kManifold, Scorer::kKeyDiff,
                   Scorer::kWindowedManifold, Scorer::kStreaming, Scorer::kRandom}) {
    for (float bad : {NAN, INFINITY, 3e38f}) {
      const HostHeads k = RandomHeads(DType::kF32, 2, 301, 64, 77);
      HostHeads v = RandomHeads(DType::kF32, 2, 301, 64, 78);
      v.Set((uint64_t{1} * 301 + 200) * 64 + 5, bad);
      DeviceArray dk(*b, k.bytes.size()), dv(*b, v.bytes.size());
      dk.Upload(k.bytes.data());
      dv.Upload(v.bytes.data());
      ScoreParams sp;
      sp.scorer = s;
      sp.window = 64;
      SelectParams sel;
      sel.kept_per_head = 100;
      const HeadsView vv =
          HeadsView::Dense(dv.data(), DType::kF32, 2, 301, 64, MemorySpace::kDevice);
      const Outputs o = RunOps(
          *b, HeadsView::Dense(dk.data(), DType::kF32, 2, 301, 64, MemorySpace::kDevice), vv, sp,
          sel, {}, true);
      EXPECT_EQ(o.status.code(), absl::StatusCode::kInvalidArgument) << ScorerName(s) << bad;
      EXPECT_NE(o.status.message().find(
                    "values: NaN or Inf (or a squared norm beyond float32) at head 1, token 200"),
                std::string::npos)
          << ScorerName(s) << " " << bad << ": " << o.status;
      const absl::Status direct = b->scoring().CheckFinite(vv, "values");
      EXPECT_EQ(direct.code(), absl::StatusCode::kInvalidArgument) << direct;
      EXPECT_NE(direct.message().find("head 1, token 200"), std::string::npos) << direct;
    }
  }
  const HostHeads ok = RandomHeads(DType::kBF16, 2, 64, 128, 79);
  DeviceArray dok(*b, ok.bytes.size());
  dok.Upload(ok.bytes.data());
  EXPECT_TRUE(b->scoring()
                  .CheckFinite(HeadsView::Dense(dok.data(), DType::kBF16, 2, 64, 128,
                                                MemorySpace::kDevice),
                               "values")
                  .ok());
}

TEST(ScoringCudaTest, NonFiniteScoresInSelectAreInvalidArgument) {
  auto b = Cuda();
  ASSERT_NE(b, nullptr);
  std::vector<float> s(2 * 50, 1.0f);
  s[77] = NAN;
  DeviceArray ds(*b, s.size() * 4), cnt(*b, 8), idx(*b, 2 * 10 * 4);
  ds.Upload(s.data());
  SelectParams sel;
  sel.kept_per_head = 10;
  const absl::Status st = b->scoring().Select(
      static_cast<float*>(ds.data()), 2, 50, sel, {},
      {static_cast<uint32_t*>(cnt.data()), static_cast<uint32_t*>(idx.data())});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("head 1, token 27"), std::string::npos) << st;
}

TEST(ScoringCudaTest, BadArgumentsAreInvalidArgument) {
  auto b = Cuda();
  ASSERT_NE(b, nullptr);
  const HostHeads k = RandomHeads(DType::kBF16, 2, 64, 128, 5);
  DeviceArray dk(*b, k.bytes.size());
  dk.Upload(k.bytes.data());
  DeviceArray sc(*b, 2 * 64 * 4);
  auto* scores = static_cast<float*>(sc.data());
  // Host memory given to the CUDA backend.
  EXPECT_EQ(b->scoring().Score(k.view(), ScoreParams{}, {}, scores).code(),
            absl::StatusCode::kInvalidArgument);
  HeadsView v = HeadsView::Dense(dk.data(), DType::kBF16, 2, 64, 128, MemorySpace::kDevice);
  HeadsView bad = v;
  bad.head_dim = 96;
  EXPECT_EQ(b->scoring().Score(bad, ScoreParams{}, {}, scores).code(),
            absl::StatusCode::kInvalidArgument);
  bad = v;
  bad.dtype = DType::kInt8;
  EXPECT_EQ(b->scoring().Score(bad, ScoreParams{}, {}, scores).code(),
            absl::StatusCode::kInvalidArgument);
  bad = v;
  bad.num_tokens = 0;
  EXPECT_EQ(b->scoring().Score(bad, ScoreParams{}, {}, scores).code(),
            absl::StatusCode::kInvalidArgument);
  SelectParams sel;  // kept_per_head 0: budget of zero
  DeviceArray cnt(*b, 8), idx(*b, 2 * 64 * 4);
  EXPECT_EQ(b->scoring()
                .Select(scores, 2, 64, sel,
                        {}, {static_cast<uint32_t*>(cnt.data()), static_cast<uint32_t*>(idx.data())})
                .code(),
            absl::StatusCode::kInvalidArgument);
  HeadsView other = v;
  other.num_tokens = 63;
  EXPECT_EQ(b->scoring()
                .Compact(v, other, static_cast<uint32_t*>(cnt.data()),
                         static_cast<uint32_t*>(idx.data()), sc.data(), sc.data())
                .code(),
            absl::StatusCode::kInvalidArgument);
}

#if defined(KVCOMP_HAVE_CUDA)
// Device memory from cudaMalloc, poisoned with 0xFF on allocation; counts what is outstanding.
class PoisoningAllocator final : public Allocator {
 public:
  MemorySpace space() const override { return MemorySpace::kDevice; }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) return absl::ResourceExhaustedError("cudaMalloc");
    cudaMemset(p, 0xFF, bytes);
    cudaDeviceSynchronize();  // the backend's stream does not wait for the legacy stream
    ++allocations;
    outstanding += bytes;
    return p;
  }
  void Deallocate(void* p, size_t bytes) override {
    if (p == nullptr) return;
    cudaFree(p);
    outstanding -= bytes;
  }
  std::atomic<int64_t> allocations{0};
  std::atomic<int64_t> outstanding{0};
};

TEST(ScoringCudaTest, InjectedAllocatorIsUsedAndDrained) {
  PoisoningAllocator alloc;
  {
    CudaBackendOptions o;
    o.allocator = &alloc;
    auto poisoned = Cuda(o);
    auto plain = Cuda();
    ASSERT_NE(poisoned, nullptr);
    ASSERT_NE(plain, nullptr);
    const HostHeads k = RandomHeads(DType::kBF16, 4, 5000, 128, 31);
    const HostHeads v = RandomHeads(DType::kBF16, 4, 5000, 128, 32);
    ScoreParams sp;
    sp.scorer = Scorer::kWindowedManifold;
    sp.window = 999;
    SelectParams sel;
    sel.kept_per_head = 2000;
    sel.head_budget = HeadBudget::kAdaKV;
    std::vector<Outputs> outs;
    for (Backend* b : {poisoned.get(), plain.get()}) {
      DeviceArray dk(*b, k.bytes.size()), dv(*b, v.bytes.size());
      dk.Upload(k.bytes.data());
      dv.Upload(v.bytes.data());
      outs.push_back(RunOps(
          *b, HeadsView::Dense(dk.data(), DType::kBF16, 4, 5000, 128, MemorySpace::kDevice),
          HeadsView::Dense(dv.data(), DType::kBF16, 4, 5000, 128, MemorySpace::kDevice), sp, sel,
          {}, true));
    }
    ExpectSame(outs[0], outs[1]);
    const int64_t before = alloc.allocations;
    ScoreSelectCompactArgs a;
    a.keys = HeadsView::Dense(nullptr, DType::kBF16, 4, 5000, 128, MemorySpace::kDevice);
    a.values = a.keys;
    a.select = sel;
    EXPECT_GT(poisoned->scoring().WorkspaceBytes(a), 0u);
    EXPECT_EQ(alloc.allocations, before);
  }
  EXPECT_GT(alloc.allocations, 0);
  EXPECT_EQ(alloc.outstanding, 0);
}
#endif  // KVCOMP_HAVE_CUDA

}  // namespace
}  // namespace kvcomp
