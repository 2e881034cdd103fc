// Test data for the KVSplice codec: values that are low-rank plus isotropic noise, with a known
// spectrum, and helpers to build projections and calibrators on the CPU backend.
#ifndef KVCOMP_TESTS_KERNELS_CODEC_TEST_UTIL_H_
#define KVCOMP_TESTS_KERNELS_CODEC_TEST_UTIL_H_

#include <cmath>
#include <random>
#include <vector>

#include "kvcomp/kernels/calibration.h"

namespace kvcomp {
namespace testing {

// A per-head random orthonormal basis (Gram-Schmidt of Gaussian vectors), d x d, rows.
inline std::vector<double> RandomBasis(uint32_t d, std::mt19937_64& rng) {
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<double> b(uint64_t{d} * d);
  for (uint32_t i = 0; i < d; ++i) {
    double* r = &b[uint64_t{i} * d];
    for (;;) {
      for (uint32_t k = 0; k < d; ++k) r[k] = n(rng);
      for (uint32_t j = 0; j < i; ++j) {
        const double* q = &b[uint64_t{j} * d];
        double dot = 0;
        for (uint32_t k = 0; k < d; ++k) dot += r[k] * q[k];
        for (uint32_t k = 0; k < d; ++k) r[k] -= dot * q[k];
      }
      double norm = 0;
      for (uint32_t k = 0; k < d; ++k) norm += r[k] * r[k];
      if (norm > 1e-6) {
        for (uint32_t k = 0; k < d; ++k) r[k] /= std::sqrt(norm);
        break;
      }
    }
  }
  return b;
}

// Values of `layers` x `heads` heads, [layer][head][tokens][d] f32: v = sum_{j < true_rank}
// z_j sigma_j b_j + noise * N(0, I), sigma_j = decay^j, with a fixed basis per head (seed
// `basis_seed`) and fresh z and noise (seed `seed`). The population second moment has
// eigenvalues sigma_j^2 + noise^2 (j < true_rank) and noise^2 (the rest).
struct LowRankData {
  uint32_t layers = 2, heads = 2, tokens = 512, d = 64, true_rank = 16;
  double decay = 0.9, noise = 0.02;
  uint64_t basis_seed = 1;

  std::vector<double> Spectrum() const {
    std::vector<double> s(d, noise * noise);
    for (uint32_t j = 0; j < true_rank; ++j) s[j] += std::pow(decay, 2.0 * j);
    return s;
  }
  // Predicted relative reconstruction error at rank r: sqrt(sum_{j >= r} s_j / sum s_j).
  double PredictedError(uint32_t r) const {
    const auto s = Spectrum();
    double tail = 0, all = 0;
    for (uint32_t j = 0; j < d; ++j) {
      all += s[j];
      if (j >= r) tail += s[j];
    }
    return std::sqrt(tail / all);
  }
  std::vector<float> Make(uint64_t seed) const {
    std::mt19937_64 brng(basis_seed), rng(seed);
    std::normal_distribution<double> n(0.0, 1.0);
    std::vector<float> out(uint64_t{layers} * heads * tokens * d);
    for (uint32_t h = 0; h < layers * heads; ++h) {
      const std::vector<double> b = RandomBasis(d, brng);
      for (uint32_t t = 0; t < tokens; ++t) {
        float* v = &out[(uint64_t{h} * tokens + t) * d];
        std::vector<double> acc(d, 0.0);
        for (uint32_t j = 0; j < true_rank; ++j) {
          const double z = n(rng) * std::pow(decay, j);
          for (uint32_t k = 0; k < d; ++k) acc[k] += z * b[uint64_t{j} * d + k];
        }
        for (uint32_t k = 0; k < d; ++k) v[k] = static_cast<float>(acc[k] + noise * n(rng));
      }
    }
    return out;
  }
  HeadsView LayerView(const std::vector<float>& data, uint32_t layer) const {
    return HeadsView::Dense(data.data() + uint64_t{layer} * heads * tokens * d, DType::kF32, heads,
                            tokens, d);
  }
};

}  // namespace testing
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_KERNELS_CODEC_TEST_UTIL_H_
