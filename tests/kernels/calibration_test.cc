// KVSplice calibration: the basis matches the data's spectrum, the error falls with rank as the
// spectrum predicts, the auto-tuner meets its budget on held-out data, projections serialize.
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/codec_test_util.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/calibration.h"
#include "kvcomp/kernels/projection.h"

namespace kvcomp {
namespace {

std::unique_ptr<Backend> Cpu() {
  auto b = MakeCpuBackend(CpuBackendOptions{2});
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(*b);
}

Calibrator Calibrate(Backend* be, const testing::LowRankData& data, uint64_t seed,
                     uint32_t samples, bool with_keys = false) {
  auto cal =
      Calibrator::Create({"model", data.layers, data.heads, data.d, samples, 128, seed}, be);
  EXPECT_TRUE(cal.ok()) << cal.status();
  const std::vector<float> v = data.Make(seed);
  // Keys 4x larger than values: attention as peaky as in real models (a flat softmax over
  // zero-mean synthetic values makes the attention-output error a noisy ratio of tiny averages).
  std::vector<float> k = data.Make(seed + 1000);
  for (float& x : k) x *= 4.0f;
  for (uint32_t l = 0; l < data.layers; ++l) {
    const HeadsView kv = data.LayerView(k, l);
    EXPECT_TRUE(cal->AddLayer(l, data.LayerView(v, l), with_keys ? &kv : nullptr).ok());
  }
  return std::move(*cal);
}

std::vector<LayerSamples> SamplesOf(const Calibrator& c) {
  std::vector<LayerSamples> s;
  for (uint32_t l = 0; l < c.options().num_layers; ++l) s.push_back(c.samples(l));
  return s;
}

TEST(Calibration, BasisIsOrthonormalAndEigenvaluesMatchTheSpectrum) {
  auto be = Cpu();
  testing::LowRankData data;
  data.tokens = 8192;
  Calibrator cal = Calibrate(be.get(), data, 1, 0);
  auto p = cal.Finish(data.d);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NE(p->version, 0u);
  EXPECT_EQ(p->samples, data.tokens);
  const auto spectrum = data.Spectrum();
  for (uint64_t h = 0; h < p->num_heads(); ++h) {
    const float* b = p->head_basis(h);
    for (uint32_t i = 0; i < data.d; ++i) {
      for (uint32_t j = 0; j < data.d; ++j) {
        double dot = 0;
        for (uint32_t k = 0; k < data.d; ++k) dot += b[i * data.d + k] * b[j * data.d + k];
        ASSERT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-4) << i << " " << j;
      }
    }
    for (uint32_t j = 0; j < data.true_rank; ++j) {
      EXPECT_NEAR(p->eigenvalues[h * data.d + j], spectrum[j], 0.1 * spectrum[j] + 1e-3) << j;
      EXPECT_GE(p->eigenvalues[h * data.d + j], p->eigenvalues[h * data.d + j + 1]);
      EXPECT_NEAR(p->head_gamma(h)[j], std::sqrt(p->eigenvalues[h * data.d + j]), 1e-4);
    }
  }
}

TEST(Calibration, ReconstructionErrorFallsWithRankAsTheSpectrumSays) {
  auto be = Cpu();
  testing::LowRankData data;
  data.tokens = 4096;
  Calibrator cal = Calibrate(be.get(), data, 1, 0);
  Calibrator held_out = Calibrate(be.get(), data, 77, 2048);  // fresh tokens, same heads
  auto p = cal.Finish(data.d);
  ASSERT_TRUE(p.ok());
  double prev = 1e9;
  for (uint32_t r : {1u, 2u, 4u, 8u, 12u, 16u, 24u, 32u, 48u}) {
    ValueCodecParams params{ValueCodec::kOrthogonal, r, 32, false};
    auto err = MeasureError(*p, params, ErrorMetric::kValueReconstruction, SamplesOf(held_out));
    ASSERT_TRUE(err.ok()) << err.status();
    const double predicted = data.PredictedError(r);
    for (double e : *err) {
      EXPECT_NEAR(e, predicted, 0.08 * predicted + 2e-3) << "rank " << r;
      EXPECT_LT(e, prev) << "rank " << r;
    }
    prev = *std::max_element(err->begin(), err->end());
  }
  // At the true rank only the noise is left: the error is at the noise floor.
  ValueCodecParams at_true{ValueCodec::kOrthogonal, data.true_rank, 32, false};
  auto err = MeasureError(*p, at_true, ErrorMetric::kValueReconstruction, SamplesOf(held_out));
  ASSERT_TRUE(err.ok());
  const double floor = data.PredictedError(data.true_rank);
  for (double e : *err) EXPECT_LE(e, 1.05 * floor);
  // int8 in the latent space adds almost nothing; int4 adds a visible but bounded amount.
  ValueCodecParams i8{ValueCodec::kOrthogonalInt8, data.true_rank, 32, true};
  auto e8 = MeasureError(*p, i8, ErrorMetric::kValueReconstruction, SamplesOf(held_out));
  ASSERT_TRUE(e8.ok());
  for (double e : *e8) EXPECT_LE(e, 1.1 * floor);
}

TEST(Calibration, AutoTunerMeetsTheBudgetOnHeldOutData) {
  auto be = Cpu();
  testing::LowRankData data;
  data.tokens = 4096;
  data.layers = 3;
  data.true_rank = 40;
  data.decay = 0.93;
  Calibrator cal = Calibrate(be.get(), data, 1, 1536, /*with_keys=*/true);
  Calibrator held_out = Calibrate(be.get(), data, 99, 1536, /*with_keys=*/true);
  for (ErrorMetric metric : {ErrorMetric::kValueReconstruction, ErrorMetric::kAttentionOutput}) {
    for (ValueCodec codec : {ValueCodec::kOrthogonalInt8, ValueCodec::kOrthogonalInt4}) {
      TuneOptions opt;
      opt.metric = metric;
      opt.budget = 0.15;
      opt.codec = codec;
      auto tuned = AutoTune(cal, opt);
      ASSERT_TRUE(tuned.ok()) << tuned.status();
      const Projection& p = tuned->projection;
      EXPECT_EQ(p.rows, tuned->max_rank);
      EXPECT_EQ(p.tuned_rank, tuned->rank);
      for (uint32_t l = 0; l < data.layers; ++l) {
        const uint32_t r = tuned->rank[l];
        EXPECT_TRUE(tuned->met[l]);
        EXPECT_LE(tuned->error[l], opt.budget);
        EXPECT_LT(r, data.d);
        // Ranks in the default steps: whole column groups of the CUDA expand.
        const uint32_t step = codec == ValueCodec::kOrthogonalInt4 ? 8 : 4;
        EXPECT_EQ(r % step, 0u);
        // Smallest: one step less misses the budget on the calibration data.
        ValueCodecParams less{codec, r - step, 32, true};
        auto e_less = MeasureError(p, less, metric, SamplesOf(cal));
        ASSERT_TRUE(e_less.ok());
        EXPECT_GT((*e_less)[l], opt.budget) << "layer " << l << " rank " << r;
        // Held-out tokens: the budget holds within sampling noise.
        ValueCodecParams at{codec, r, 32, true};
        auto e_held = MeasureError(p, at, metric, SamplesOf(held_out));
        ASSERT_TRUE(e_held.ok());
        EXPECT_LE((*e_held)[l], 1.05 * opt.budget)
            << ErrorMetricName(metric) << " " << ValueCodecName(codec) << " layer " << l;
      }
    }
  }
  // A finer step when asked for; an odd one for int4 is refused.
  TuneOptions fine;
  fine.budget = 0.15;
  fine.rank_step = 1;
  auto f = AutoTune(cal, fine);
  ASSERT_TRUE(f.ok()) << f.status();
  TuneOptions coarse = fine;
  coarse.rank_step = 0;
  auto c = AutoTune(cal, coarse);
  ASSERT_TRUE(c.ok());
  for (uint32_t l = 0; l < data.layers; ++l) {
    EXPECT_LE(f->rank[l], c->rank[l]);
    EXPECT_GT(f->rank[l] + 4, c->rank[l]);  // the same search, rounded up to a step of 4
  }
  TuneOptions odd;
  odd.codec = ValueCodec::kOrthogonalInt4;
  odd.rank_step = 3;
  EXPECT_EQ(AutoTune(cal, odd).status().code(), absl::StatusCode::kInvalidArgument);
  TuneOptions impossible;
  impossible.budget = 1e-6;
  auto t = AutoTune(cal, impossible);
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->met[0]);
  EXPECT_EQ(t->rank[0], data.d);
}

TEST(Calibration, RejectsBadInput) {
  auto be = Cpu();
  EXPECT_FALSE(Calibrator::Create({"m", 0, 2, 64}, be.get()).ok());
  EXPECT_FALSE(Calibrator::Create({"m", 2, 2, 65}, be.get()).ok());
  EXPECT_FALSE(Calibrator::Create({"m", 2, 2, 64}, nullptr).ok());
  auto cal = Calibrator::Create({"m", 2, 2, 64}, be.get());
  ASSERT_TRUE(cal.ok());
  std::vector<float> v(2 * 8 * 64, 1.0f);
  EXPECT_EQ(cal->AddLayer(2, HeadsView::Dense(v.data(), DType::kF32, 2, 8, 64)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cal->AddLayer(0, HeadsView::Dense(v.data(), DType::kF32, 1, 16, 64)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cal->AddLayer(0, HeadsView::Dense(v.data(), DType::kInt8, 2, 8, 64)).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(cal->AddLayer(0, HeadsView::Dense(v.data(), DType::kF32, 2, 8, 64)).ok());
  EXPECT_EQ(cal->Finish(16).status().code(), absl::StatusCode::kFailedPrecondition);  // layer 1
  ASSERT_TRUE(cal->AddLayer(1, HeadsView::Dense(v.data(), DType::kF32, 2, 8, 64)).ok());
  EXPECT_EQ(cal->Finish(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cal->Finish(65).status().code(), absl::StatusCode::kInvalidArgument);
  auto p = cal->Finish(16);  // a rank-1 (all-ones) value distribution still makes a basis
  ASSERT_TRUE(p.ok()) << p.status();
  TuneOptions bad;
  bad.budget = -1;
  EXPECT_EQ(AutoTune(*cal, bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Projection, SerializesTruncatesAndDetectsCorruption) {
  auto be = Cpu();
  testing::LowRankData data;
  data.tokens = 256;
  Calibrator cal = Calibrate(be.get(), data, 3, 64);
  TuneOptions opt;
  opt.budget = 0.2;
  auto tuned = AutoTune(cal, opt);
  ASSERT_TRUE(tuned.ok());
  const Projection& p = tuned->projection;
  const std::string bytes = p.Serialize();
  auto back = Projection::Parse(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->version, p.version);
  EXPECT_EQ(back->basis, p.basis);
  EXPECT_EQ(back->tuned_rank, p.tuned_rank);
  EXPECT_EQ(back->model_id, "model");
  for (size_t i = 0; i < bytes.size(); i += 97) {
    std::string bad = bytes;
    bad[i] ^= 0x10;
    EXPECT_FALSE(Projection::Parse(bad).ok()) << i;
  }
  for (size_t n : {size_t{0}, size_t{3}, bytes.size() / 2, bytes.size() - 1}) {
    EXPECT_FALSE(Projection::Parse(bytes.substr(0, n)).ok()) << n;
  }
  auto t = p.Truncated(4);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->rows, 4u);
  EXPECT_NE(t->version, p.version);
  EXPECT_EQ(t->basis[4 * data.d], p.basis[p.rows * data.d]);  // head 1 row 0
  EXPECT_FALSE(p.Truncated(p.rows + 1).ok());
}

}  // namespace
}  // namespace kvcomp
