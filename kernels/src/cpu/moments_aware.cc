#include "moments_aware.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kvcomp/core/status.h"
#include "kvcomp/kernels/allocator.h"
#include "moments_cpu_internal.h"

namespace kvcomp {
namespace moments_internal {
namespace {

// rank / (n - 1) of each value, ties by lower index.
void PercentileRanks(const std::vector<double>& x, std::vector<double>* out) {
  const size_t n = x.size();
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::sort(order.begin(), order.end(),
            [&](uint32_t a, uint32_t b) { return x[a] < x[b] || (x[a] == x[b] && a < b); });
  out->resize(n);
  const double denom = n > 1 ? static_cast<double>(n - 1) : 1.0;
  for (size_t r = 0; r < n; ++r) (*out)[order[r]] = static_cast<double>(r) / denom;
}

}  // namespace

absl::Status MomentAwareRescore(const HeadsView& keys, const SelectParams& select,
                                const TokenPositions& positions, const uint64_t* prior_count,
                                const float* prior_key_sum, float* scores) {
  if (keys.space != MemorySpace::kHost || !IsInputDType(keys.dtype) || keys.head_dim == 0 ||
      keys.token_stride < keys.head_dim || scores == nullptr) {
    return absl::InvalidArgumentError("moment-aware eviction: bad keys or scores");
  }
  const uint64_t n = keys.num_tokens;
  const uint32_t d = keys.head_dim;
  const uint64_t kept = std::min<uint64_t>(select.kept_per_head, n);
  if (kept == 0) return absl::InvalidArgumentError("moment-aware eviction: budget of zero");
  if (kept >= n) return absl::OkStatus();
  const uint64_t seq =
      positions.sequence_length > 0 ? positions.sequence_length : positions.offset + n;
  const size_t eb = DTypeBytes(keys.dtype, 1);
  std::vector<uint32_t> order(n);
  std::vector<double> eff(n), dist(n), pct_s, pct_d;
  std::vector<float> row(d);
  std::vector<double> mu(d), part(d);
  std::vector<uint8_t> evicted(n);
  for (uint32_t h = 0; h < keys.num_heads; ++h) {
    float* s = scores + uint64_t{h} * n;
    const uint32_t* prow = positions.data != nullptr ? positions.data + uint64_t{h} * n : nullptr;
    for (uint64_t i = 0; i < n; ++i) {
      eff[i] = IsProtected(positions.position(prow, i), seq, select)
                   ? std::numeric_limits<double>::infinity()
                   : static_cast<double>(s[i]);
    }
    // Provisional eviction: all but the `kept` highest effective scores.
    std::iota(order.begin(), order.end(), 0u);
    std::nth_element(order.begin(), order.begin() + kept, order.end(), [&](uint32_t a, uint32_t b) {
      return eff[a] > eff[b] || (eff[a] == eff[b] && a < b);
    });
    uint64_t count = prior_count != nullptr ? prior_count[h] : 0;
    for (uint32_t x = 0; x < d; ++x) {
      mu[x] = prior_key_sum != nullptr ? prior_key_sum[uint64_t{h} * d + x] : 0.0;
    }
    auto load = [&](uint64_t t) {
      RowToFloat(static_cast<const uint8_t*>(keys.data) + keys.offset(h, t) * eb, keys.dtype, d,
                 row.data());
    };
    // The provisionally evicted keys summed in f64, in token order a chunk of
    // kMomentAwareMeanChunk tokens at a time (each chunk from +0), the chunks' sums added to the
    // prior in chunk order: a sum fixed by the tokens, which the device sums chunk by chunk.
    std::fill(evicted.begin(), evicted.end(), uint8_t{0});
    for (uint64_t r = kept; r < n; ++r) evicted[order[r]] = 1;
    for (uint64_t c0 = 0; c0 < n; c0 += kMomentAwareMeanChunk) {
      std::fill(part.begin(), part.end(), 0.0);
      const uint64_t c1 = std::min<uint64_t>(n, c0 + kMomentAwareMeanChunk);
      for (uint64_t t = c0; t < c1; ++t) {
        if (evicted[t] == 0) continue;
        load(t);
        for (uint32_t x = 0; x < d; ++x) part[x] += static_cast<double>(row[x]);
      }
      for (uint32_t x = 0; x < d; ++x) mu[x] += part[x];
    }
    count += n - kept;
    for (uint32_t x = 0; x < d; ++x) mu[x] /= static_cast<double>(count);
    // Distances summed in f64 in channel order, ranked by their rounding to f32 (ties by lower
    // index, as the scores'): 32-bit keys for the device's sort, the same ranks on both.
    for (uint64_t t = 0; t < n; ++t) {
      load(t);
      double acc = 0.0;
      for (uint32_t x = 0; x < d; ++x) acc += (row[x] - mu[x]) * (row[x] - mu[x]);
      dist[t] = static_cast<double>(static_cast<float>(std::sqrt(acc)));
      eff[t] = s[t];
    }
    PercentileRanks(eff, &pct_s);
    PercentileRanks(dist, &pct_d);
    for (uint64_t t = 0; t < n; ++t) {
      s[t] = static_cast<float>((1.0 - kMomentAwareBeta) * pct_s[t] + kMomentAwareBeta * pct_d[t]);
    }
  }
  return absl::OkStatus();
}

#if !defined(KVCOMP_HAVE_CUDA)
absl::Status MomentAwareRescoreOnDevice(void*, Allocator&, const HeadsView&, const SelectParams&,
                                        const TokenPositions&, float*) {
  return absl::FailedPreconditionError("moment-aware eviction: this build has no CUDA");
}
#endif

absl::Status MomentAwareScoreSelectCompact(Backend& backend, const ScoreSelectCompactArgs& args) {
  KVCOMP_RETURN_IF_ERROR(CheckScoreSelectCompactArgs(args, backend.space()));
  const HeadsView& k = args.keys;
  const uint64_t count = uint64_t{k.num_heads} * k.num_tokens;
  const bool host = backend.space() == MemorySpace::kHost;
  Buffer score_buf;
  float* scores = args.scores;
  if (scores == nullptr) {
    KVCOMP_ASSIGN_OR_RETURN(score_buf, Buffer::Allocate(backend.allocator(), count * 4));
    scores = score_buf.as<float>();
  }
  KVCOMP_RETURN_IF_ERROR(backend.scoring().CheckFinite(args.values, "values"));
  KVCOMP_RETURN_IF_ERROR(backend.scoring().Score(k, args.score, args.positions, scores));
  if (host) {
    KVCOMP_RETURN_IF_ERROR(
        MomentAwareRescore(k, args.select, args.positions, nullptr, nullptr, scores));
  } else {
    KVCOMP_RETURN_IF_ERROR(MomentAwareRescoreOnDevice(backend.native_stream(), backend.allocator(),
                                                      k, args.select, args.positions, scores));
  }
  KVCOMP_RETURN_IF_ERROR(backend.scoring().Select(scores, k.num_heads, k.num_tokens, args.select,
                                                  args.positions, args.kept));
  return backend.scoring().Compact(k, args.values, args.kept.counts, args.kept.indices,
                                   args.keys_out, args.values_out);
}

}  // namespace moments_internal
}  // namespace kvcomp
