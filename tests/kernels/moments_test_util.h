// Float64 reference of MomentKV (moments and the corrected attention of docs/moments.md) and the
// data the moments/attention tests share.
#ifndef KVCOMP_TESTS_KERNELS_MOMENTS_TEST_UTIL_H_
#define KVCOMP_TESTS_KERNELS_MOMENTS_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kvcomp/core/dtype.h"
#include "kvcomp/kernels/moment_ops.h"

namespace kvcomp {
namespace testing {

// One kv head's keys/values, fp32 rows [tokens, d].
struct HeadData {
  std::vector<float> k, v;
};

// Moments in double of rows `idx` of a head.
struct RefMoments {
  uint64_t n = 0;
  std::vector<double> ks, vs, s;  // s: d x d, s[i*d+j] = sum v_i k_j
};

inline RefMoments RefMomentsOf(const HeadData& h, const std::vector<uint32_t>& idx, size_t d) {
  RefMoments m;
  m.n = idx.size();
  m.ks.assign(d, 0.0);
  m.vs.assign(d, 0.0);
  m.s.assign(d * d, 0.0);
  for (uint32_t t : idx) {
    for (size_t i = 0; i < d; ++i) {
      m.ks[i] += h.k[t * d + i];
      m.vs[i] += h.v[t * d + i];
      for (size_t j = 0; j < d; ++j) m.s[i * d + j] += double{h.v[t * d + i]} * h.k[t * d + j];
    }
  }
  return m;
}

// softmax over kept rows (+ the virtual token when `m` has n > 0 and correct) of query q.
inline std::vector<double> RefAttention(const float* q, const HeadData& h,
                                        const std::vector<uint32_t>& kept, const RefMoments* m,
                                        bool correct, size_t d) {
  const double t = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> logits;
  std::vector<std::vector<double>> values;
  for (uint32_t j : kept) {
    double s = 0.0;
    for (size_t x = 0; x < d; ++x) s += double{q[x]} * h.k[j * d + x];
    logits.push_back(t * s);
    values.emplace_back(h.v.begin() + j * d, h.v.begin() + (j + 1) * d);
  }
  if (correct && m != nullptr && m->n > 0) {
    const double n = static_cast<double>(m->n);
    std::vector<double> mu_k(d), mu_v(d), val(d);
    double qmu = 0.0;
    for (size_t x = 0; x < d; ++x) {
      mu_k[x] = m->ks[x] / n;
      mu_v[x] = m->vs[x] / n;
      qmu += q[x] * mu_k[x];
    }
    for (size_t i = 0; i < d; ++i) {
      double cq = 0.0;  // (S/n - mu_v mu_k^T) q
      for (size_t j = 0; j < d; ++j) cq += (m->s[i * d + j] / n - mu_v[i] * mu_k[j]) * q[j];
      val[i] = mu_v[i] + t * cq;
    }
    logits.push_back(t * qmu + std::log(n));
    values.push_back(val);
  }
  std::vector<double> out(d, 0.0);
  if (logits.empty()) return out;
  const double mx = *std::max_element(logits.begin(), logits.end());
  double z = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const double w = std::exp(logits[i] - mx);
    z += w;
    for (size_t x = 0; x < d; ++x) out[x] += w * values[i][x];
  }
  for (double& o : out) o /= z;
  return out;
}

// Relative L2 error of `got` against `want`.
inline double RelErr(const float* got, const std::vector<double>& want) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// Splits [0, tokens) into ascending kept and evicted lists, keeping about `keep_fraction`.
inline void RandomSplit(uint64_t tokens, double keep_fraction, std::mt19937_64& rng,
                        std::vector<uint32_t>* kept, std::vector<uint32_t>* evicted) {
  std::bernoulli_distribution keep(keep_fraction);
  for (uint32_t t = 0; t < tokens; ++t) (keep(rng) ? kept : evicted)->push_back(t);
}

// Owned host moments of `heads` heads.
struct HostMoments {
  std::vector<uint64_t> count;
  std::vector<float> ks, vs, s;
  uint32_t heads = 0, d = 0;
  HostMoments(uint32_t h, uint32_t dim)
      : count(h, 0),
        ks(size_t{h} * dim, 0.0f),
        vs(size_t{h} * dim, 0.0f),
        s(size_t{h} * dim * dim, 0.0f),
        heads(h),
        d(dim) {}
  MomentsView view() {
    return MomentsView{count.data(), ks.data(), vs.data(), s.data(), heads, d, MemorySpace::kHost};
  }
};

}  // namespace testing
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_KERNELS_MOMENTS_TEST_UTIL_H_
