// Test helpers of Engine I: random KV data that is never zero, float64 reference
// formulas of every scorer, a reference selection, and the conformance harness that runs any
// Backend's ScoringOps against the CPU one on the same fresh inputs (outputs poisoned first).
// The CUDA tests reuse RunConformanceCase with their backend as the candidate.
#ifndef KVCOMP_TESTS_KERNELS_SCORING_TEST_UTIL_H_
#define KVCOMP_TESTS_KERNELS_SCORING_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/kernels/scoring_ops.h"

namespace kvcomp {
namespace testing {

inline size_t ElemSize(DType d) { return d == DType::kF32 ? 4 : 2; }

// A dense [heads, tokens, head_dim] array in `dtype`, with its float values (as stored).
struct HostHeads {
  DType dtype = DType::kBF16;
  uint32_t heads = 0;
  uint64_t tokens = 0;
  uint32_t head_dim = 0;
  std::vector<uint8_t> bytes;
  std::vector<float> f;  // the stored values read back as float

  HeadsView view() const { return HeadsView::Dense(bytes.data(), dtype, heads, tokens, head_dim); }
  float at(uint32_t h, uint64_t t, uint32_t j) const {
    return f[(uint64_t{h} * tokens + t) * head_dim + j];
  }
  void Set(uint64_t i, float x) {
    StoreFromFloat(bytes.data(), dtype, i, x);
    f[i] = LoadAsFloat(bytes.data(), dtype, i);
  }
};

struct RandomHeadsOptions {
  // Mean offset per channel (keys of real models are not centred), spread, and a fraction of
  // outlier tokens scaled by `outlier_scale`.
  float offset = 0.5f;
  float spread = 1.0f;
  double outlier_fraction = 0.02;
  float outlier_scale = 4.0f;
  // Copy every `tie_every`-th token onto the next one (exact score ties); 0 = none.
  uint32_t tie_every = 0;
};

// Never zero: every element is offset + spread * N(0,1) with no exact zero.
inline HostHeads RandomHeads(DType dtype, uint32_t heads, uint64_t tokens, uint32_t head_dim,
                             uint64_t seed, const RandomHeadsOptions& o = {}) {
  HostHeads a;
  a.dtype = dtype;
  a.heads = heads;
  a.tokens = tokens;
  a.head_dim = head_dim;
  const uint64_t n = uint64_t{heads} * tokens * head_dim;
  a.bytes.resize(n * ElemSize(dtype));
  a.f.resize(n);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<float> chan(head_dim);
  for (auto& c : chan) c = o.offset * normal(rng);
  for (uint32_t h = 0; h < heads; ++h) {
    for (uint64_t t = 0; t < tokens; ++t) {
      const float scale = u(rng) < o.outlier_fraction ? o.outlier_scale : 1.0f;
      for (uint32_t j = 0; j < head_dim; ++j) {
        float x = chan[j] + o.spread * scale * normal(rng);
        if (x == 0.0f) x = 0.125f;
        a.Set((uint64_t{h} * tokens + t) * head_dim + j, x);
      }
    }
  }
  if (o.tie_every > 0) {
    for (uint32_t h = 0; h < heads; ++h) {
      for (uint64_t t = 0; t + 1 < tokens; t += o.tie_every) {
        for (uint32_t j = 0; j < head_dim; ++j) {
          const uint64_t i = (uint64_t{h} * tokens + t) * head_dim + j;
          a.Set(i + head_dim, a.f[i]);
        }
      }
    }
  }
  return a;
}

// --- float64 references of the scorers ---
inline std::vector<double> RefScores(const HostHeads& k, const ScoreParams& p,
                                     const HostHeads* q = nullptr) {
  const uint32_t d = k.head_dim;
  const uint64_t n = k.tokens;
  std::vector<double> s(uint64_t{k.heads} * n);
  auto norm = [&](uint32_t h, uint64_t t) {
    double a = 0;
    for (uint32_t j = 0; j < d; ++j) a += double{k.at(h, t, j)} * k.at(h, t, j);
    return std::sqrt(a);
  };
  auto mean = [&](uint32_t h, uint64_t b, uint64_t e, bool normalize) {
    std::vector<double> m(d, 0.0);
    for (uint64_t t = b; t < e; ++t) {
      const double sc = normalize ? 1.0 / std::max(norm(h, t), double{kKeyDiffEps}) : 1.0;
      for (uint32_t j = 0; j < d; ++j) m[j] += k.at(h, t, j) * sc;
    }
    for (auto& x : m) x /= static_cast<double>(e - b);
    return m;
  };
  auto dist = [&](uint32_t h, uint64_t t, const std::vector<double>& m) {
    double a = 0;
    for (uint32_t j = 0; j < d; ++j) a += (k.at(h, t, j) - m[j]) * (k.at(h, t, j) - m[j]);
    return std::sqrt(a);
  };
  for (uint32_t h = 0; h < k.heads; ++h) {
    double* out = s.data() + uint64_t{h} * n;
    switch (p.scorer) {
      case Scorer::kKnorm:
        for (uint64_t t = 0; t < n; ++t) out[t] = -norm(h, t);
        break;
      case Scorer::kManifold: {
        const auto m = mean(h, 0, n, false);
        for (uint64_t t = 0; t < n; ++t) out[t] = dist(h, t, m);
        break;
      }
      case Scorer::kWindowedManifold:
        for (uint64_t b = 0; b < n; b += p.window) {
          const uint64_t e = std::min<uint64_t>(n, b + p.window);
          const auto m = mean(h, b, e, false);
          for (uint64_t t = b; t < e; ++t) out[t] = dist(h, t, m);
        }
        break;
      case Scorer::kKeyDiff: {
        const auto a = mean(h, 0, n, true);
        double an = 0;
        for (double x : a) an += x * x;
        an = std::max(std::sqrt(an), double{kKeyDiffEps});
        for (uint64_t t = 0; t < n; ++t) {
          double dot = 0;
          for (uint32_t j = 0; j < d; ++j) dot += k.at(h, t, j) * a[j];
          out[t] = -dot / (std::max(norm(h, t), double{kKeyDiffEps}) * an);
        }
        break;
      }
      case Scorer::kStreaming:
        for (uint64_t t = 0; t < n; ++t) out[t] = StreamingScore(t, p.n_sink);
        break;
      case Scorer::kRandom:
        for (uint64_t t = 0; t < n; ++t) out[t] = RandomScore(p.seed, p.stream, h, t);
        break;
      case Scorer::kSnapKV:
        break;  // below, needs all heads
    }
  }
  if (p.scorer == Scorer::kSnapKV) {
    const uint64_t w = q->tokens, prefix = n - w;
    const uint32_t group = q->heads / k.heads;
    const int64_t half = p.snapkv_pool / 2;
    double mx = prefix == 0 ? 1.0 : -1e300;
    for (uint32_t h = 0; h < k.heads; ++h) {
      std::vector<double> grp(prefix, 0.0);
      for (uint32_t g = 0; g < group; ++g) {
        const uint32_t jq = h * group + g;
        std::vector<double> acc(prefix, 0.0);
        for (uint64_t r = 0; r < w; ++r) {
          const uint64_t vis = prefix + r + 1;
          std::vector<double> l(vis);
          double m = -1e300;
          for (uint64_t t = 0; t < vis; ++t) {
            double dot = 0;
            for (uint32_t j = 0; j < d; ++j) dot += double{q->at(jq, r, j)} * k.at(h, t, j);
            l[t] = dot / std::sqrt(static_cast<double>(d));
            m = std::max(m, l[t]);
          }
          double z = 0;
          for (auto& x : l) z += (x = std::exp(x - m));
          for (uint64_t t = 0; t < prefix; ++t) acc[t] += l[t] / z;
        }
        for (uint64_t t = 0; t < prefix; ++t) {
          double a = 0;
          for (int64_t u = static_cast<int64_t>(t) - half; u <= static_cast<int64_t>(t) + half;
               ++u) {
            if (u >= 0 && u < static_cast<int64_t>(prefix)) a += acc[u];
          }
          grp[t] += a / w / p.snapkv_pool / group;
        }
      }
      for (uint64_t t = 0; t < prefix; ++t) {
        s[uint64_t{h} * n + t] = grp[t];
        mx = std::max(mx, grp[t]);
      }
    }
    for (uint32_t h = 0; h < k.heads; ++h) {
      for (uint64_t t = prefix; t < n; ++t) s[uint64_t{h} * n + t] = mx;
    }
  }
  return s;
}

// The documented selection rule applied to `scores` (any backend's): per head kept index lists.
inline std::vector<std::vector<uint32_t>> RefSelect(const std::vector<float>& scores,
                                                    uint32_t heads, uint64_t n,
                                                    const SelectParams& p,
                                                    uint64_t sequence_length = 0) {
  if (sequence_length == 0) sequence_length = n;
  const uint64_t k = std::min<uint64_t>(p.kept_per_head, n);
  auto eff = [&](uint32_t h, uint64_t t) {
    return IsProtected(t, sequence_length, p) ? INFINITY
                                              : static_cast<double>(scores[uint64_t{h} * n + t]);
  };
  std::vector<std::vector<uint32_t>> kept(heads);
  std::vector<std::vector<uint8_t>> flag(heads, std::vector<uint8_t>(n, 0));
  auto top = [&](uint32_t h, uint64_t count) {
    std::vector<uint32_t> idx;
    for (uint64_t t = 0; t < n; ++t) {
      if (!flag[h][t]) idx.push_back(static_cast<uint32_t>(t));
    }
    std::stable_sort(idx.begin(), idx.end(),
                     [&](uint32_t a, uint32_t b) { return eff(h, a) > eff(h, b); });
    for (uint64_t i = 0; i < count && i < idx.size(); ++i) flag[h][idx[i]] = 1;
  };
  if (p.head_budget == HeadBudget::kUniform || heads == 1) {
    for (uint32_t h = 0; h < heads; ++h) top(h, k);
  } else {
    const uint64_t safe =
        std::min<uint64_t>(k, static_cast<uint64_t>(static_cast<double>(k) * p.alpha_safeguard));
    for (uint32_t h = 0; h < heads; ++h) top(h, safe);
    struct C {
      double s;
      uint32_t h, t;
    };
    std::vector<C> c;
    for (uint32_t h = 0; h < heads; ++h) {
      for (uint64_t t = 0; t < n; ++t) {
        if (!flag[h][t]) c.push_back({eff(h, t), h, static_cast<uint32_t>(t)});
      }
    }
    std::stable_sort(c.begin(), c.end(), [](const C& a, const C& b) { return a.s > b.s; });
    const uint64_t rem = heads * k - heads * safe;
    for (uint64_t i = 0; i < rem && i < c.size(); ++i) flag[c[i].h][c[i].t] = 1;
  }
  for (uint32_t h = 0; h < heads; ++h) {
    for (uint64_t t = 0; t < n; ++t) {
      if (flag[h][t]) kept[h].push_back(static_cast<uint32_t>(t));
    }
  }
  return kept;
}

// ---- Conformance: candidate backend vs the CPU reference on the same inputs ----

struct ConformanceCase {
  DType dtype = DType::kBF16;
  uint32_t head_dim = 128;
  uint32_t heads = 4;
  uint64_t tokens = 257;
  ScoreParams score;
  SelectParams select;
  uint32_t q_heads = 8;    // snapkv
  uint32_t q_window = 16;  // snapkv
  RandomHeadsOptions data;
  uint64_t seed = 1;

  std::string Name() const {
    return absl::StrFormat("%s d=%u H=%u n=%u scorer=%s k=%u %s", DTypeName(dtype), head_dim, heads,
                           tokens, ScorerName(score.scorer), select.kept_per_head,
                           HeadBudgetName(select.head_budget));
  }
};

// Memory in a backend's space, filled from / read back to host vectors.
class DeviceArray {
 public:
  DeviceArray(Backend& b, size_t bytes) : backend_(b), bytes_(bytes) {
    auto buf = Buffer::Allocate(b.allocator(), std::max<size_t>(bytes, 1));
    EXPECT_TRUE(buf.ok()) << buf.status();
    if (buf.ok()) buf_ = std::move(*buf);
  }
  void* data() const { return buf_.data(); }
  void Upload(const void* host) { ASSERT_TRUE(backend_.CopyFromHost(data(), host, bytes_).ok()); }
  // Fills with 0xFF bytes: NaN for floats, 0xFFFFFFFF for indices (poison).
  void Poison() {
    std::vector<uint8_t> p(bytes_, 0xFF);
    Upload(p.data());
  }
  std::vector<uint8_t> Download() {
    std::vector<uint8_t> out(bytes_);
    EXPECT_TRUE(backend_.CopyToHost(out.data(), data(), bytes_).ok());
    return out;
  }

 private:
  Backend& backend_;
  size_t bytes_;
  Buffer buf_;
};

struct RunOutput {
  absl::Status status;
  std::vector<float> scores;
  std::vector<uint32_t> counts;
  std::vector<uint32_t> indices;  // ragged
  std::vector<uint8_t> keys, values;
};

// Runs the fused op on `b` with poisoned outputs (with `key_sums` for the scorer when given).
inline RunOutput RunFused(Backend& b, const ConformanceCase& c, const HostHeads& k,
                          const HostHeads& v, const HostHeads* q,
                          const KeySums* key_sums = nullptr) {
  RunOutput r;
  const uint64_t hn = uint64_t{c.heads} * c.tokens;
  const uint64_t cap = KeptCapacity(c.heads, c.tokens, c.select.kept_per_head);
  const size_t row = c.head_dim * ElemSize(c.dtype);
  DeviceArray dk(b, k.bytes.size()), dv(b, v.bytes.size());
  dk.Upload(k.bytes.data());
  dv.Upload(v.bytes.data());
  DeviceArray dq(b, q != nullptr ? q->bytes.size() : 1);
  DeviceArray scores(b, hn * 4), counts(b, c.heads * 4), idx(b, cap * 4), ko(b, cap * row),
      vo(b, cap * row);
  for (DeviceArray* a : {&scores, &counts, &idx, &ko, &vo}) a->Poison();
  ScoreSelectCompactArgs a;
  a.keys = HeadsView::Dense(dk.data(), c.dtype, c.heads, c.tokens, c.head_dim, b.space());
  a.values = HeadsView::Dense(dv.data(), c.dtype, c.heads, c.tokens, c.head_dim, b.space());
  a.score = c.score;
  if (key_sums != nullptr) a.score.key_sums = *key_sums;
  if (q != nullptr) {
    dq.Upload(q->bytes.data());
    a.score.queries =
        HeadsView::Dense(dq.data(), c.dtype, q->heads, q->tokens, c.head_dim, b.space());
  }
  a.select = c.select;
  a.scores = static_cast<float*>(scores.data());
  a.kept = {static_cast<uint32_t*>(counts.data()), static_cast<uint32_t*>(idx.data())};
  a.keys_out = ko.data();
  a.values_out = vo.data();
  r.status = b.scoring().ScoreSelectCompact(a);
  if (!r.status.ok()) return r;
  r.status = b.Synchronize();
  auto s = scores.Download();
  r.scores.resize(hn);
  std::memcpy(r.scores.data(), s.data(), hn * 4);
  auto cn = counts.Download();
  r.counts.resize(c.heads);
  std::memcpy(r.counts.data(), cn.data(), c.heads * 4);
  uint64_t total = 0;
  for (uint32_t x : r.counts) total += x;
  if (total > cap) {
    r.status = absl::InternalError(absl::StrFormat("kept %u > capacity %u", total, cap));
    return r;
  }
  auto ix = idx.Download();
  r.indices.resize(total);
  std::memcpy(r.indices.data(), ix.data(), total * 4);
  r.keys = ko.Download();
  r.keys.resize(total * row);
  r.values = vo.Download();
  r.values.resize(total * row);
  return r;
}

// Relative tolerance of scores between backends (fp32 accumulation in different orders).
inline double ScoreTolerance(const ConformanceCase& c) {
  return c.score.scorer == Scorer::kSnapKV ? 2e-3 : 1e-4;
}

inline void CompareRuns(const ConformanceCase& c, const HostHeads& k, const HostHeads& v,
                        const RunOutput& ref, const RunOutput& got);

// Runs one case on `candidate` and `reference` and checks: same status code; scores within
// tolerance; per head the same kept set up to (near-)exact ties at the threshold; ascending
// indices; gathered rows byte-identical to the inputs' rows.
inline void CheckConformance(Backend& candidate, Backend& reference, const ConformanceCase& c) {
  SCOPED_TRACE(c.Name());
  const HostHeads k = RandomHeads(c.dtype, c.heads, c.tokens, c.head_dim, c.seed, c.data);
  RandomHeadsOptions vo = c.data;
  vo.tie_every = 0;
  const HostHeads v = RandomHeads(c.dtype, c.heads, c.tokens, c.head_dim, c.seed + 1000, vo);
  HostHeads q;
  if (c.score.scorer == Scorer::kSnapKV) {
    q = RandomHeads(c.dtype, c.q_heads, c.q_window, c.head_dim, c.seed + 2000);
  }
  const HostHeads* qp = c.score.scorer == Scorer::kSnapKV ? &q : nullptr;
  RunOutput ref = RunFused(reference, c, k, v, qp);
  RunOutput got = RunFused(candidate, c, k, v, qp);
  CompareRuns(c, k, v, ref, got);
}

// The checks of CheckConformance on two runs of the same inputs.
inline void CompareRuns(const ConformanceCase& c, const HostHeads& k, const HostHeads& v,
                        const RunOutput& ref, const RunOutput& got) {
  ASSERT_EQ(ref.status.code(), got.status.code()) << ref.status << " vs " << got.status;
  if (!ref.status.ok()) return;
  const double tol = ScoreTolerance(c);
  for (uint64_t i = 0; i < ref.scores.size(); ++i) {
    ASSERT_NEAR(got.scores[i], ref.scores[i], tol * std::max(1.0, std::fabs(double{ref.scores[i]})))
        << "score " << i;
  }
  const size_t row = c.head_dim * ElemSize(c.dtype);
  uint64_t roff = 0, goff = 0;
  uint64_t ref_total = 0, got_total = 0;
  for (uint32_t x : ref.counts) ref_total += x;
  for (uint32_t x : got.counts) got_total += x;
  ASSERT_EQ(ref_total, got_total);
  for (uint32_t h = 0; h < c.heads; ++h) {
    std::vector<uint32_t> a(ref.indices.begin() + roff, ref.indices.begin() + roff + ref.counts[h]);
    std::vector<uint32_t> b(got.indices.begin() + goff, got.indices.begin() + goff + got.counts[h]);
    ASSERT_TRUE(std::is_sorted(b.begin(), b.end())) << "head " << h;
    ASSERT_TRUE(std::adjacent_find(b.begin(), b.end()) == b.end()) << "duplicate, head " << h;
    for (uint64_t r = 0; r < b.size(); ++r) {
      ASSERT_LT(b[r], c.tokens);
      ASSERT_EQ(0, std::memcmp(got.keys.data() + (goff + r) * row,
                               k.bytes.data() + (uint64_t{h} * c.tokens + b[r]) * row, row))
          << "key row " << r << " of head " << h;
      ASSERT_EQ(0, std::memcmp(got.values.data() + (goff + r) * row,
                               v.bytes.data() + (uint64_t{h} * c.tokens + b[r]) * row, row))
          << "value row " << r << " of head " << h;
    }
    if (a != b) {
      // Differences are allowed only between tokens whose reference scores tie (within the
      // score tolerance) and sit at the selection threshold.
      std::vector<uint32_t> only_a, only_b;
      std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(only_a));
      std::set_difference(b.begin(), b.end(), a.begin(), a.end(), std::back_inserter(only_b));
      double lo = INFINITY, hi = -INFINITY;
      for (uint32_t t : only_a) lo = std::min<double>(lo, ref.scores[uint64_t{h} * c.tokens + t]);
      for (uint32_t t : only_b) hi = std::max<double>(hi, ref.scores[uint64_t{h} * c.tokens + t]);
      for (uint32_t t : only_a) hi = std::max<double>(hi, ref.scores[uint64_t{h} * c.tokens + t]);
      for (uint32_t t : only_b) lo = std::min<double>(lo, ref.scores[uint64_t{h} * c.tokens + t]);
      ASSERT_LE(hi - lo, 2 * tol * std::max(1.0, std::fabs(hi)))
          << "head " << h << ": kept sets differ beyond ties (" << only_a.size() << " tokens)";
    }
    roff += ref.counts[h];
    goff += got.counts[h];
  }
}

// The standard case list: every dtype and head_dim, odd lengths, n below the budget, n = 1,
// exact ties, every scorer, uniform and AdaKV budgets, protection on and off.
inline std::vector<ConformanceCase> StandardConformanceCases() {
  std::vector<ConformanceCase> cases;
  uint64_t seed = 100;
  const Scorer scorers[] = {
      Scorer::kKnorm,     Scorer::kKeyDiff, Scorer::kManifold, Scorer::kWindowedManifold,
      Scorer::kStreaming, Scorer::kRandom,  Scorer::kSnapKV};
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (uint32_t d : {64u, 128u, 256u}) {
      for (Scorer s : scorers) {
        for (uint64_t n : {uint64_t{1}, uint64_t{37}, uint64_t{1001}}) {
          ConformanceCase c;
          c.dtype = dt;
          c.head_dim = d;
          c.heads = 3;
          c.tokens = n;
          c.score.scorer = s;
          c.score.window = 100;
          c.score.seed = seed;
          c.score.stream = 2;
          c.q_window = static_cast<uint32_t>(std::min<uint64_t>(n, 16));
          c.q_heads = 6;
          c.select.kept_per_head = n == 37 ? 50 : std::max<uint64_t>(1, n / 2);  // 37: below
          c.select.n_recent = 3;
          c.select.head_budget = (seed % 2) ? HeadBudget::kAdaKV : HeadBudget::kUniform;
          c.select.protect = (seed % 3) != 0;
          c.data.tie_every = (seed % 4 == 0) ? 3 : 0;
          c.seed = seed++;
          cases.push_back(c);
        }
      }
    }
  }
  return cases;
}

// Policies with a budget-relative recent window (recent_fraction), through the host-side
// parameter builders: manifold and keydiff at ratios 0.5, 0.75 and 0.9, uniform and AdaKV, the
// window from 25% to 90% of the per-head budget.
inline std::vector<ConformanceCase> RecentFractionConformanceCases() {
  std::vector<ConformanceCase> cases;
  uint64_t seed = 7000;
  for (Scorer s : {Scorer::kManifold, Scorer::kKeyDiff}) {
    for (double ratio : {0.5, 0.75, 0.9}) {
      for (HeadBudget hb : {HeadBudget::kUniform, HeadBudget::kAdaKV}) {
        for (double fraction : {0.25, 0.5, 0.9}) {
          CompressionPolicy p;
          p.scorer = s;
          p.ratio = ratio;
          p.head_budget = hb;
          p.recent_fraction = fraction;
          ConformanceCase c;
          c.dtype = DType::kBF16;
          c.head_dim = 128;
          c.heads = 4;
          c.tokens = 1001;
          c.score = ScoreParamsFromPolicy(p, 1);
          auto sel = SelectParamsFromPolicy(p, c.tokens);
          EXPECT_TRUE(sel.ok()) << sel.status();
          if (!sel.ok()) return cases;
          c.select = *sel;
          EXPECT_EQ(c.select.n_recent, p.EffectiveRecent(p.KeptPerHead(c.tokens)));
          c.seed = seed++;
          cases.push_back(c);
        }
      }
    }
  }
  return cases;
}

}  // namespace testing
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_KERNELS_SCORING_TEST_UTIL_H_
