// MomentKV on the CUDA backend against the CPU backend on the same inputs (gpu label): moments
// through the gather and the fused compaction pass (tensor cores for 16-bit inputs), merges, and
// the corrected decode attention; plus bad input on the device.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "common/gpu.h"
#include "cpu/moments_aware.h"
#include "gtest/gtest.h"
#include "kernels/moments_test_util.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/moment_ops.h"

KVCOMP_GPU_TEST_BINARY();

namespace kvcomp {
namespace {

using testing::HostMoments;

class MomentsCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto c = MakeCpuBackend(CpuBackendOptions{2});
    ASSERT_TRUE(c.ok()) << c.status();
    cpu_ = std::move(*c);
    auto g = MakeCudaBackend();
    ASSERT_TRUE(g.ok()) << g.status();
    gpu_ = std::move(*g);
  }
  // A device copy of a host vector.
  template <typename T>
  Buffer Up(const std::vector<T>& v) {
    auto b = Buffer::Allocate(gpu_->allocator(), std::max<size_t>(1, v.size() * sizeof(T)));
    EXPECT_TRUE(b.ok());
    if (!v.empty()) {
      EXPECT_TRUE(gpu_->CopyFromHost(b->data(), v.data(), v.size() * sizeof(T)).ok());
    }
    return std::move(*b);
  }
  template <typename T>
  std::vector<T> Down(const Buffer& b, size_t n) {
    std::vector<T> v(n);
    EXPECT_TRUE(gpu_->CopyToHost(v.data(), b.data(), n * sizeof(T)).ok());
    return v;
  }
  // Zeroed device moments.
  struct DevMoments {
    Buffer count, ks, vs, s;
    MomentsView view;
  };
  DevMoments Zeros(uint32_t heads, uint32_t d) {
    HostMoments z(heads, d);
    DevMoments m{Up(z.count), Up(z.ks), Up(z.vs), Up(z.s), {}};
    m.view = MomentsView{
        m.count.as<uint64_t>(), m.ks.as<float>(), m.vs.as<float>(), m.s.as<float>(), heads, d,
        MemorySpace::kDevice};
    return m;
  }
  HostMoments Host(const DevMoments& m, uint32_t heads, uint32_t d) {
    HostMoments h(heads, d);
    h.count = Down<uint64_t>(m.count, heads);
    h.ks = Down<float>(m.ks, size_t{heads} * d);
    h.vs = Down<float>(m.vs, size_t{heads} * d);
    h.s = Down<float>(m.s, size_t{heads} * d * d);
    return h;
  }
  double AttentionGap(DType dtype, DType qtype, uint32_t d, uint64_t nq, bool correct,
                      float q_scale = 1.0f, float k_scale = 1.0f);
  std::unique_ptr<Backend> cpu_, gpu_;
};

// Raw input of `dtype` from N(offset, 1) floats, times `scale`.
std::vector<uint8_t> Random(DType dtype, size_t n, std::mt19937_64& rng, float offset = 0.0f,
                            float scale = 1.0f) {
  std::normal_distribution<float> g(offset, 1.0f);
  std::vector<uint8_t> out(DTypeBytes(dtype, n));
  for (size_t i = 0; i < n; ++i) StoreFromFloat(out.data(), dtype, i, scale * g(rng));
  return out;
}

void ExpectClose(const HostMoments& a, const HostMoments& b, double tol) {
  EXPECT_EQ(a.count, b.count);
  auto check = [&](const std::vector<float>& x, const std::vector<float>& y, const char* what) {
    double worst = 0.0, scale = 1.0;
    for (size_t i = 0; i < x.size(); ++i) scale = std::max(scale, std::fabs(double{y[i]}));
    for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::fabs(double{x[i]} - y[i]));
    EXPECT_LT(worst / scale, tol) << what;
  };
  check(a.ks, b.ks, "key_sum");
  check(a.vs, b.vs, "value_sum");
  check(a.s, b.s, "vk_sum");
}

TEST_F(MomentsCudaTest, AccumulateAndCompactMatchCpu) {
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (uint32_t d : {64u, 128u, 256u}) {
      const uint32_t heads = 3;
      const uint64_t tokens = 3000;
      std::mt19937_64 rng(d + static_cast<int>(dtype));
      const auto k = Random(dtype, size_t{heads} * tokens * d, rng, 0.3f);
      const auto v = Random(dtype, size_t{heads} * tokens * d, rng);
      std::vector<uint32_t> kept, ev;
      std::vector<uint64_t> ko{0}, eo{0};
      for (uint32_t h = 0; h < heads; ++h) {
        testing::RandomSplit(tokens, 0.2 + 0.3 * h, rng, &kept, &ev);
        ko.push_back(kept.size());
        eo.push_back(ev.size());
      }
      const HeadsView hk = HeadsView::Dense(k.data(), dtype, heads, tokens, d);
      const HeadsView hv = HeadsView::Dense(v.data(), dtype, heads, tokens, d);
      HostMoments want(heads, d);
      ASSERT_TRUE(cpu_->moments()
                      .Accumulate(hk, hv, TokenLists{ev.data(), eo.data(), heads}, want.view())
                      .ok());
      Buffer dk = Up(k), dv = Up(v), dki = Up(kept), dko = Up(ko), dei = Up(ev), deo = Up(eo);
      const HeadsView gk =
          HeadsView::Dense(dk.data(), dtype, heads, tokens, d, MemorySpace::kDevice);
      const HeadsView gv =
          HeadsView::Dense(dv.data(), dtype, heads, tokens, d, MemorySpace::kDevice);
      DevMoments gather = Zeros(heads, d), fused = Zeros(heads, d);
      ASSERT_TRUE(gpu_->moments()
                      .Accumulate(gk, gv,
                                  TokenLists{dei.as<uint32_t>(), deo.as<uint64_t>(), heads,
                                             MemorySpace::kDevice},
                                  gather.view)
                      .ok());
      const size_t row = DTypeBytes(dtype, d);
      auto out_k = Buffer::Allocate(gpu_->allocator(), kept.size() * row);
      auto out_v = Buffer::Allocate(gpu_->allocator(), kept.size() * row);
      ASSERT_TRUE(out_k.ok() && out_v.ok());
      absl::Status s = gpu_->moments().CompactAndAccumulate(
          gk, gv, TokenLists{dki.as<uint32_t>(), dko.as<uint64_t>(), heads, MemorySpace::kDevice},
          out_k->data(), out_v->data(), fused.view);
      ASSERT_TRUE(s.ok()) << s;
      // 16-bit inputs go through the tensor cores with fp32 accumulation: same order of error
      // as the CPU's fp32 sums.
      const double tol = 2e-4;
      ExpectClose(Host(gather, heads, d), want, tol);
      ExpectClose(Host(fused, heads, d), want, tol);
      const auto got_k = Down<uint8_t>(*out_k, kept.size() * row);
      const auto got_v = Down<uint8_t>(*out_v, kept.size() * row);
      for (uint32_t h = 0; h < heads; ++h) {
        for (uint64_t i = ko[h]; i < ko[h + 1]; ++i) {
          ASSERT_EQ(0, std::memcmp(&got_k[i * row], &k[(h * tokens + kept[i]) * row], row));
          ASSERT_EQ(0, std::memcmp(&got_v[i * row], &v[(h * tokens + kept[i]) * row], row));
        }
      }
      // Merge on the device: gather + fused = 2 x want.
      ASSERT_TRUE(gpu_->moments().Merge(gather.view, fused.view).ok());
      HostMoments twice = want;
      ASSERT_TRUE(cpu_->moments().Merge(twice.view(), want.view()).ok());
      ExpectClose(Host(gather, heads, d), twice, tol);
    }
  }
}

// One attention case on both backends (hq = 8 q heads over hk = 4 kv heads, some heads with
// several chunks, one empty, moments of 500 evicted tokens but for the last head): the worst
// absolute difference of the outputs. Also checks that the host copy of the offsets gives the
// same output bit for bit.
double MomentsCudaTest::AttentionGap(DType dtype, DType qtype, uint32_t d, uint64_t nq,
                                     bool correct, float q_scale, float k_scale) {
  const uint32_t hq = 8, hk = 4;
  std::mt19937_64 rng(7 * d + nq + 1000 * static_cast<int>(qtype));
  const uint64_t tokens = 1500 + 700 * nq;
  std::vector<uint64_t> off{0};
  for (uint32_t h = 0; h < hk; ++h) off.push_back(off.back() + (h == 2 ? 0 : tokens / (h + 1)));
  const auto k = Random(dtype, off.back() * d, rng, 0.2f, k_scale);
  const auto v = Random(dtype, off.back() * d, rng);
  const auto q = Random(qtype, size_t{hq} * nq * d, rng, 0.0f, q_scale);
  const uint64_t ev = 500;
  const auto ek = Random(dtype, size_t{hk} * ev * d, rng, 0.2f, k_scale);
  const auto evv = Random(dtype, size_t{hk} * ev * d, rng);
  std::vector<uint32_t> idx;
  std::vector<uint64_t> eo{0};
  for (uint32_t h = 0; h < hk; ++h) {
    for (uint32_t t = 0; t < (h == 3 ? 0u : ev); ++t) idx.push_back(t);
    eo.push_back(idx.size());
  }
  HostMoments m(hk, d);
  EXPECT_TRUE(cpu_->moments()
                  .Accumulate(HeadsView::Dense(ek.data(), dtype, hk, ev, d),
                              HeadsView::Dense(evv.data(), dtype, hk, ev, d),
                              TokenLists{idx.data(), eo.data(), hk}, m.view())
                  .ok());
  std::vector<float> want(size_t{hq} * nq * d), got(want.size());
  AttentionParams p;
  p.queries = HeadsView::Dense(q.data(), qtype, hq, nq, d);
  p.kv = RaggedKv{k.data(), v.data(), dtype, off.data(), hk, d};
  p.moments = m.view();
  p.correct = correct;
  p.out = want.data();
  EXPECT_TRUE(cpu_->moments().Attention(p).ok());
  Buffer dq = Up(q), dk = Up(k), dv = Up(v), doff = Up(off), dc = Up(m.count), dks = Up(m.ks),
         dvs = Up(m.vs), ds = Up(m.s), dout = Up(got);
  p.queries = HeadsView::Dense(dq.data(), qtype, hq, nq, d, MemorySpace::kDevice);
  p.kv = RaggedKv{dk.data(), dv.data(), dtype, doff.as<uint64_t>(), hk, d, MemorySpace::kDevice};
  p.moments = ConstMomentsView(MomentsView{dc.as<uint64_t>(), dks.as<float>(), dvs.as<float>(),
                                           ds.as<float>(), hk, d, MemorySpace::kDevice});
  p.out = dout.as<float>();
  absl::Status s = gpu_->moments().Attention(p);
  EXPECT_TRUE(s.ok()) << s;
  got = Down<float>(dout, got.size());
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::fabs(double{got[i]} - want[i]));
  }
  p.kv.host_offsets = off.data();
  EXPECT_TRUE(gpu_->moments().Attention(p).ok());
  EXPECT_EQ(Down<float>(dout, got.size()), got);
  return worst;
}

// 1, 4, 5, 8, 9 and 16 queries x 2 q heads: 2 to 32 rows per kv head, the decode kernels (one
// and two m-tiles of the tensor-core kernel, rows filling an m-tile and one beyond); 40: the
// general kernel's two row blocks. f32 queries and, for 16-bit caches, queries of the cache's
// dtype.
TEST_F(MomentsCudaTest, AttentionMatchesCpu) {
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (DType qtype : {DType::kF32, dtype}) {
      if (qtype == dtype && dtype == DType::kF32) continue;
      for (uint32_t d : {64u, 128u, 256u}) {
        for (uint64_t nq : {1u, 4u, 5u, 8u, 9u, 16u, 40u}) {
          for (bool correct : {true, false}) {
            EXPECT_LT(AttentionGap(dtype, qtype, d, nq, correct), 2e-4)
                << DTypeName(dtype) << " queries " << DTypeName(qtype) << " d=" << d
                << " nq=" << nq << " correct=" << correct;
          }
        }
      }
    }
  }
}

// f32 queries far beyond f16's range against an f16 cache of small keys (moderate logits): the
// tensor-core kernel scales each query row into f16's range by a power of two.
TEST_F(MomentsCudaTest, AttentionOfWideQueriesOverF16Cache) {
  for (uint32_t d : {64u, 128u}) {
    for (uint64_t nq : {1u, 9u}) {
      for (bool correct : {true, false}) {
        EXPECT_LT(AttentionGap(DType::kF16, DType::kF32, d, nq, correct, 3.0e5f, 1.0e-5f), 2e-4)
            << "d=" << d << " nq=" << nq << " correct=" << correct;
      }
    }
  }
}

// The deferred one-pass form against the CPU's: kept rows byte for byte, moments within the
// tensor cores' tolerance, the values' check (NaN and Inf in kept and evicted rows, the lowest
// head * tokens + token reported) and the error word for malformed lists, for every dtype and
// head_dim, with heads long enough for several CTAs and a tail tile.
TEST_F(MomentsCudaTest, DeferredCompactionMatchesCpu) {
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (uint32_t d : {64u, 128u, 256u}) {
      SCOPED_TRACE(::testing::Message() << "dtype " << static_cast<int>(dtype) << " d " << d);
      const uint32_t heads = 3;
      const uint64_t tokens = 5000 + d;
      std::mt19937_64 rng(7 * d + static_cast<int>(dtype));
      const auto k = Random(dtype, size_t{heads} * tokens * d, rng, 0.3f);
      auto v = Random(dtype, size_t{heads} * tokens * d, rng);
      std::vector<uint32_t> kept, ev;
      std::vector<uint64_t> ko{0};
      for (uint32_t h = 0; h < heads; ++h) {
        // head 0 keeps a contiguous run too (whole tiles kept), head 2 keeps most tokens
        if (h == 0) {
          for (uint32_t t = 0; t < tokens; ++t) {
            if (t < 1000 || t % 3 == 0) kept.push_back(t);
          }
        } else {
          testing::RandomSplit(tokens, h == 1 ? 0.3 : 0.9, rng, &kept, &ev);
        }
        ko.push_back(kept.size());
      }
      const size_t row = DTypeBytes(dtype, d);
      auto run_cpu = [&](const std::vector<uint8_t>& vals, uint32_t* error, uint64_t* bad,
                         HostMoments* m, std::vector<uint8_t>* kk, std::vector<uint8_t>* vk) {
        kk->assign(kept.size() * row, 0);
        vk->assign(kept.size() * row, 0);
        return cpu_->moments().CompactAndAccumulateDeferred(
            HeadsView::Dense(k.data(), dtype, heads, tokens, d),
            HeadsView::Dense(vals.data(), dtype, heads, tokens, d),
            TokenLists{kept.data(), ko.data(), heads}, kk->data(), vk->data(), error, bad,
            m->view());
      };
      auto run_gpu = [&](const std::vector<uint8_t>& vals, const std::vector<uint32_t>& list,
                         uint32_t* error, uint64_t* bad, HostMoments* m,
                         std::vector<uint8_t>* kk, std::vector<uint8_t>* vk) {
        Buffer dk = Up(k), dv = Up(vals), dl = Up(list), dko = Up(ko);
        Buffer de = Up(std::vector<uint32_t>{0});
        Buffer db = Up(std::vector<uint64_t>{~uint64_t{0}});
        DevMoments dm = Zeros(heads, d);
        Buffer out_k = Up(std::vector<uint8_t>(kept.size() * row, 0));
        Buffer out_v = Up(std::vector<uint8_t>(kept.size() * row, 0));
        absl::Status s = gpu_->moments().CompactAndAccumulateDeferred(
            HeadsView::Dense(dk.data(), dtype, heads, tokens, d, MemorySpace::kDevice),
            HeadsView::Dense(dv.data(), dtype, heads, tokens, d, MemorySpace::kDevice),
            TokenLists{dl.as<uint32_t>(), dko.as<uint64_t>(), heads, MemorySpace::kDevice},
            out_k.data(), out_v.data(), de.as<uint32_t>(), db.as<uint64_t>(), dm.view);
        EXPECT_TRUE(s.ok()) << s;
        *error = Down<uint32_t>(de, 1)[0];
        *bad = Down<uint64_t>(db, 1)[0];
        *m = Host(dm, heads, d);
        *kk = Down<uint8_t>(out_k, kept.size() * row);
        *vk = Down<uint8_t>(out_v, kept.size() * row);
      };
      HostMoments want(heads, d), got(heads, d);
      std::vector<uint8_t> wk, wv, gk, gv;
      uint32_t werr = 0, gerr = 0;
      uint64_t wbad = ~uint64_t{0}, gbad = 0;
      ASSERT_TRUE(run_cpu(v, &werr, &wbad, &want, &wk, &wv).ok());
      run_gpu(v, kept, &gerr, &gbad, &got, &gk, &gv);
      EXPECT_EQ(gerr, 0u);
      EXPECT_EQ(gbad, ~uint64_t{0});
      EXPECT_EQ(gk, wk);
      EXPECT_EQ(gv, wv);
      ExpectClose(got, want, 2e-4);
      // Bad values: NaN in a kept row of head 2, Inf in an evicted row of head 1 and NaN in a
      // later one: the CPU's finding, head 1's first bad row.
      const uint64_t first = 1 * tokens + ev[ev.size() / 2 + 3];
      StoreFromFloat(v.data(), dtype, (2 * tokens + kept[ko[2] + 5]) * d + 1, NAN);
      StoreFromFloat(v.data(), dtype, first * d + d - 1, INFINITY);
      StoreFromFloat(v.data(), dtype, (first + 40) * d + 2, NAN);
      wbad = ~uint64_t{0};
      ASSERT_TRUE(run_cpu(v, &werr, &wbad, &want, &wk, &wv).ok());
      run_gpu(v, kept, &gerr, &gbad, &got, &gk, &gv);
      EXPECT_EQ(wbad, first);
      EXPECT_EQ(gbad, first);
      // A list out of order: the error word, nothing copied.
      std::vector<uint32_t> swapped = kept;
      std::swap(swapped[ko[1] + 2], swapped[ko[1] + 3]);
      run_gpu(v, swapped, &gerr, &gbad, &got, &gk, &gv);
      EXPECT_EQ(gerr, 1u);
      EXPECT_EQ(got.count, std::vector<uint64_t>(heads, 0));
      EXPECT_EQ(gk, std::vector<uint8_t>(kept.size() * row, 0));
    }
  }
}

TEST_F(MomentsCudaTest, RejectsBadIndicesOnTheDevice) {
  const uint32_t heads = 2, d = 128;
  const uint64_t tokens = 100;
  std::mt19937_64 rng(1);
  const auto k = Random(DType::kBF16, size_t{heads} * tokens * d, rng);
  Buffer dk = Up(k), dv = Up(k);
  const HeadsView gk =
      HeadsView::Dense(dk.data(), DType::kBF16, heads, tokens, d, MemorySpace::kDevice);
  DevMoments m = Zeros(heads, d);
  std::vector<uint32_t> idx{3, 200};  // 200 out of range
  std::vector<uint64_t> off{0, 1, 2};
  Buffer di = Up(idx), dof = Up(off);
  TokenLists lists{di.as<uint32_t>(), dof.as<uint64_t>(), heads, MemorySpace::kDevice};
  EXPECT_EQ(gpu_->moments().Accumulate(gk, gk, lists, m.view).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<uint32_t> unsorted{5, 4, 1};
  std::vector<uint64_t> off2{0, 2, 3};
  Buffer du = Up(unsorted), dof2 = Up(off2);
  auto out = Buffer::Allocate(gpu_->allocator(), 3 * d * 2);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(gpu_->moments()
                .CompactAndAccumulate(
                    gk, gk,
                    TokenLists{du.as<uint32_t>(), dof2.as<uint64_t>(), heads, MemorySpace::kDevice},
                    out->data(), out->data(), m.view)
                .code(),
            absl::StatusCode::kInvalidArgument);
  // Host memory given to the CUDA backend.
  const HeadsView host = HeadsView::Dense(k.data(), DType::kBF16, heads, tokens, d);
  EXPECT_EQ(gpu_->moments().Accumulate(host, host, lists, m.view).code(),
            absl::StatusCode::kInvalidArgument);
}

// Moment-aware rescoring on the device (one sort of both ranks, the mean summed chunk by chunk)
// against the CPU reference on fresh random inputs: the rescored f32 scores bit for bit, for
// every input dtype, aligned and unaligned rows, padded strides, protected tokens, explicit
// positions, scores with many exact ties (and -0 beside +0), keys with duplicated rows (equal
// distances) and rows one ulp apart (distances that differ in f64 but round to the same f32:
// ranked by index on both), heads from 1 to 64 and tokens from 2 to 70000 (ranked in one block a
// head up to 8192 tokens, in tiles of 8192 merged up to 65536 or, with
// KVCOMP_RESCORE_TILED_RANKS=0, by the device sort, and by the device sort above; the effective
// scores in shared memory up to 40960). The seed is printed (KVCOMP_MOMENTS_SEED replays it).
TEST_F(MomentsCudaTest, MomentAwareRescoreIsTheCpusBitForBit) {
  uint64_t seed = std::random_device{}();
  if (const char* e = std::getenv("KVCOMP_MOMENTS_SEED")) seed = std::strtoull(e, nullptr, 10);
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::printf("moment-aware rescoring seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    DType dtype;
    uint32_t heads;
    uint64_t n;
    uint32_t d;
    uint32_t pad;  // extra elements a token row (unaligned rows when odd)
  };
  const std::vector<Case> cases = {
      {DType::kBF16, 1, 2, 64, 0},      {DType::kBF16, 3, 37, 128, 0},
      {DType::kF16, 5, 255, 128, 0},    {DType::kF32, 4, 256, 64, 0},
      {DType::kBF16, 8, 257, 128, 8},   {DType::kF16, 2, 1000, 36, 0},
      {DType::kBF16, 16, 2049, 128, 0}, {DType::kF32, 3, 3000, 96, 1},
      {DType::kBF16, 64, 700, 128, 0},  {DType::kBF16, 2, 9000, 128, 0},
      {DType::kF16, 6, 4096, 256, 3},    {DType::kBF16, 1, 8192, 128, 0},
      {DType::kBF16, 2, 41000, 64, 0},  {DType::kBF16, 4, 32768, 128, 0},
      {DType::kF16, 1, 70000, 64, 0},
  };
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::normal_distribution<float> g(0.25f, 1.0f);
  for (const Case& c : cases) {
    for (int variant = 0; variant < 3; ++variant) {
      SCOPED_TRACE(::testing::Message() << DTypeName(c.dtype) << " heads " << c.heads << " n "
                                        << c.n << " d " << c.d << " pad " << c.pad
                                        << " variant " << variant);
      const uint64_t stride = c.d + c.pad;
      const uint64_t elems = uint64_t{c.heads} * c.n * stride;
      std::vector<uint8_t> keys(DTypeBytes(c.dtype, elems));
      for (uint64_t i = 0; i < elems; ++i) StoreFromFloat(keys.data(), c.dtype, i, g(rng));
      const size_t eb = DTypeBytes(c.dtype, 1);
      for (uint32_t h = 0; h < c.heads; ++h) {
        for (uint64_t t = 1; t < c.n; ++t) {
          uint8_t* row = keys.data() + (uint64_t{h} * c.n + t) * stride * eb;
          const double r = u(rng);
          if (r < 0.1) {
            std::memcpy(row, row - stride * eb, c.d * eb);  // the same row: equal distances
          } else if (r < 0.15) {
            // One channel moved by one step of the dtype: a distance a hair apart.
            std::memcpy(row, row - stride * eb, c.d * eb);
            const uint32_t x = static_cast<uint32_t>(rng() % c.d);
            if (c.dtype == DType::kF32) {
              uint32_t bits;
              std::memcpy(&bits, row + x * 4, 4);
              bits ^= 1u;
              std::memcpy(row + x * 4, &bits, 4);
            } else {
              row[x * 2] ^= 1u;
            }
          }
        }
      }
      std::vector<float> scores(uint64_t{c.heads} * c.n);
      for (uint64_t i = 0; i < scores.size(); ++i) {
        // variant 0: continuous; 1: few distinct values (many ties, -0 and +0); 2: all equal.
        if (variant == 0) {
          scores[i] = static_cast<float>(u(rng));
        } else if (variant == 1) {
          scores[i] = static_cast<float>(static_cast<int>(u(rng) * 5));
          if (scores[i] == 0.0f && u(rng) < 0.5) scores[i] = -0.0f;
        } else {
          scores[i] = 1.0f;
        }
      }
      SelectParams sel;
      sel.kept_per_head = 1 + rng() % (c.n - 1 > 0 ? c.n - 1 : 1);
      sel.protect = variant != 2 || c.n % 2 == 0;
      sel.n_sink = static_cast<uint32_t>(rng() % 6);
      sel.n_recent = static_cast<uint32_t>(rng() % (c.n / 4 + 1));
      TokenPositions pos;
      std::vector<uint32_t> positions;
      if (variant == 1) {
        // Explicit ascending positions with gaps, the sequence longer than the view.
        positions.resize(scores.size());
        for (uint32_t h = 0; h < c.heads; ++h) {
          uint32_t p = static_cast<uint32_t>(rng() % 3);
          for (uint64_t t = 0; t < c.n; ++t) {
            positions[uint64_t{h} * c.n + t] = p;
            p += 1 + static_cast<uint32_t>(rng() % 3);
          }
        }
        pos.sequence_length = positions.back() + 1 + rng() % 4;
      } else {
        pos.offset = variant == 0 ? rng() % 100 : 0;
      }
      HeadsView hk{keys.data(), c.dtype, c.heads, c.n, c.d, stride, c.n * stride,
                   MemorySpace::kHost};
      std::vector<float> want = scores;
      TokenPositions host_pos = pos;
      host_pos.data = positions.empty() ? nullptr : positions.data();
      ASSERT_TRUE(moments_internal::MomentAwareRescore(hk, sel, host_pos, nullptr, nullptr,
                                                       want.data())
                      .ok());
      Buffer dk = Up(keys), ds = Up(scores), dp = Up(positions);
      HeadsView gk = hk;
      gk.data = dk.data();
      gk.space = MemorySpace::kDevice;
      TokenPositions dev_pos = pos;
      dev_pos.data = positions.empty() ? nullptr : dp.as<uint32_t>();
      ASSERT_TRUE(moments_internal::MomentAwareRescoreOnDevice(
                      gpu_->native_stream(), gpu_->allocator(), gk, sel, dev_pos, ds.as<float>())
                      .ok());
      const std::vector<float> got = Down<float>(ds, scores.size());
      uint64_t differ = 0, first = scores.size();
      for (uint64_t i = 0; i < scores.size(); ++i) {
        if (std::memcmp(&got[i], &want[i], 4) != 0) {
          if (differ++ == 0) first = i;
        }
      }
      EXPECT_EQ(differ, 0u) << "first at head " << first / c.n << " token " << first % c.n
                            << ": " << (first < got.size() ? got[first] : 0.0f) << " vs "
                            << (first < want.size() ? want[first] : 0.0f);
      if (::testing::Test::HasFailure()) return;
    }
  }
}

}  // namespace
}  // namespace kvcomp
