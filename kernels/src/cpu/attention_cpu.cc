// CPU decode attention over kept tokens plus the evicted set's virtual token. Work items are
// (kv head, range of kept tokens): each reads its keys and values once for all the q heads of the
// group and all queries, keeping an online softmax (running max, sum, fp32 accumulator) per row.
// The ranges of a head are merged at the end with the virtual token, computed in double.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvcomp/core/status.h"
#include "moments_cpu_internal.h"

namespace kvcomp {
namespace moments_internal {

namespace {

constexpr size_t kKeyTile = 128;       // kept tokens per dense product
constexpr size_t kMinPartKeys = 4096;  // smallest key range worth its own item

// Online-softmax state of `rows` query rows.
struct RowState {
  std::vector<float> max, sum, acc;  // acc: rows x d
  void Init(size_t rows, size_t d) {
    max.assign(rows, -std::numeric_limits<float>::infinity());
    sum.assign(rows, 0.0f);
    acc.assign(rows * d, 0.0f);
  }
};

// Adds one extra (logit, value) pair to row r of a state, in double.
void FoldDouble(double logit, const double* value, size_t d, double* m, double* l, double* acc) {
  if (*l == 0.0) {
    *m = logit;
    *l = 1.0;
    for (size_t x = 0; x < d; ++x) acc[x] = value[x];
    return;
  }
  const double mx = std::max(*m, logit);
  const double c = std::exp(*m - mx), w = std::exp(logit - mx);
  *l = *l * c + w;
  for (size_t x = 0; x < d; ++x) acc[x] = acc[x] * c + w * value[x];
  *m = mx;
}

}  // namespace

absl::Status CpuMomentOps::Attention(const AttentionParams& p) {
  KVCOMP_RETURN_IF_ERROR(CheckAttention(p, MemorySpace::kHost));
  KVCOMP_RETURN_IF_ERROR(CheckRaggedOffsets(p.kv));
  const HeadsView& qv = p.queries;
  const RaggedKv& kv = p.kv;
  const size_t d = kv.head_dim;
  const uint32_t hk = kv.num_kv_heads;
  const uint32_t group = qv.num_heads / hk;
  const size_t nq = qv.num_tokens;
  const size_t rows = size_t{group} * nq;  // rows of one kv head: (q head in group, query)
  if (nq == 0) return absl::OkStatus();
  const float t = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(d));
  const bool correct = p.correct && p.moments.count != nullptr;
  const size_t eb = DTypeBytes(kv.dtype, 1);
  const size_t qeb = DTypeBytes(qv.dtype, 1);

  // Queries per kv head, fp32, rows x d (unscaled).
  std::vector<float> q(size_t{hk} * rows * d);
  for (uint32_t g = 0; g < qv.num_heads; ++g) {
    for (size_t i = 0; i < nq; ++i) {
      RowToFloat(static_cast<const uint8_t*>(qv.data) + qv.offset(g, i) * qeb, qv.dtype, d,
                 q.data() + (size_t{g} * nq + i) * d);
    }
  }

  struct Item {
    uint32_t head;
    uint64_t begin, end;
  };
  std::vector<Item> items;
  std::vector<size_t> first_item(hk + 1);
  const size_t max_parts = std::max<size_t>(1, (2 * workers_ + hk - 1) / hk);
  for (uint32_t h = 0; h < hk; ++h) {
    first_item[h] = items.size();
    const uint64_t a = kv.offsets[h], n = kv.offsets[h + 1] - a;
    const size_t parts =
        std::max<size_t>(1, std::min<size_t>(max_parts, (n + kMinPartKeys - 1) / kMinPartKeys));
    for (size_t i = 0; i < parts; ++i)
      items.push_back({h, a + n * i / parts, a + n * (i + 1) / parts});
  }
  first_item[hk] = items.size();

  std::vector<RowState> states(items.size());
  parallel_(items.size(), [&](size_t i) {
    const Item& it = items[i];
    RowState& st = states[i];
    st.Init(rows, d);
    std::vector<float> qs(rows * d);
    const float* qh = q.data() + size_t{it.head} * rows * d;
    for (size_t x = 0; x < rows * d; ++x) qs[x] = qh[x] * t;
    std::vector<float> kt(kKeyTile * d), vt(kKeyTile * d), logits(rows * kKeyTile);
    for (uint64_t b = it.begin; b < it.end; b += kKeyTile) {
      const size_t m = static_cast<size_t>(std::min<uint64_t>(kKeyTile, it.end - b));
      for (size_t j = 0; j < m; ++j) {
        RowToFloat(static_cast<const uint8_t*>(kv.keys) + (b + j) * d * eb, kv.dtype, d,
                   kt.data() + j * d);
        RowToFloat(static_cast<const uint8_t*>(kv.values) + (b + j) * d * eb, kv.dtype, d,
                   vt.data() + j * d);
      }
      ABt(qs.data(), kt.data(), logits.data(), rows, d, m);
      for (size_t r = 0; r < rows; ++r) {
        float* lr = logits.data() + r * m;
        float mx = st.max[r];
        for (size_t j = 0; j < m; ++j) mx = std::max(mx, lr[j]);
        const float c = std::exp(st.max[r] - mx);  // 0 when the old max is -inf
        float s = 0.0f;
        for (size_t j = 0; j < m; ++j) {
          lr[j] = std::exp(lr[j] - mx);
          s += lr[j];
        }
        st.sum[r] = st.sum[r] * c + s;
        st.max[r] = mx;
        float* ar = st.acc.data() + r * d;
        for (size_t x = 0; x < d; ++x) ar[x] *= c;
      }
      AddAB(logits.data(), vt.data(), st.acc.data(), rows, m, d);
    }
  });

  // Per kv head: merge its ranges and the virtual token, in double, and write the output.
  parallel_(hk, [&](size_t h) {
    std::vector<double> acc(d), value(d), mu_k(d), mu_v(d), sq(d);
    const uint64_t n = correct ? p.moments.count[h] : 0;
    if (n > 0) {
      for (size_t x = 0; x < d; ++x) {
        mu_k[x] = p.moments.key_sum[h * d + x] / static_cast<double>(n);
        mu_v[x] = p.moments.value_sum[h * d + x] / static_cast<double>(n);
      }
    }
    const float* s_vk = n > 0 ? p.moments.vk_sum + h * d * d : nullptr;
    for (size_t r = 0; r < rows; ++r) {
      double m = 0.0, l = 0.0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (size_t i = first_item[h]; i < first_item[h + 1]; ++i) {
        const RowState& st = states[i];
        if (st.sum[r] == 0.0f) continue;
        for (size_t x = 0; x < d; ++x) value[x] = st.acc[r * d + x] / st.sum[r];
        // A range with softmax sum s and max mx weighs like one token of logit mx + ln s.
        FoldDouble(static_cast<double>(st.max[r]) + std::log(static_cast<double>(st.sum[r])),
                   value.data(), d, &m, &l, acc.data());
      }
      const float* qr = q.data() + (h * rows + r) * d;
      if (n > 0) {
        double qmu = 0.0;
        for (size_t x = 0; x < d; ++x) qmu += qr[x] * mu_k[x];
        // C q = S q / n - mu_v (mu_k . q)
        for (size_t i = 0; i < d; ++i) {
          double s = 0.0;
          const float* si = s_vk + i * d;
          for (size_t x = 0; x < d; ++x) s += static_cast<double>(si[x]) * qr[x];
          value[i] = mu_v[i] + t * (s / static_cast<double>(n) - mu_v[i] * qmu);
        }
        FoldDouble(t * qmu + std::log(static_cast<double>(n)), value.data(), d, &m, &l, acc.data());
      }
      // Row r is (q head g = h*group + r/nq, query r%nq); output is [q heads, queries, d].
      float* o = p.out + (h * rows + r) * d;
      for (size_t x = 0; x < d; ++x) o[x] = l > 0.0 ? static_cast<float>(acc[x] / l) : 0.0f;
    }
  });
  return absl::OkStatus();
}

}  // namespace moments_internal
}  // namespace kvcomp
