// The CPU ScoringOps: the reference implementation and the embedded default. Work is split into
// (head, chunk) tasks over the backend's pool; the inner loops are the vectorised row kernels.
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "absl/strings/str_format.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include "cpu_ops.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/allocator.h"
#include "scoring_kernels.h"

namespace kvcomp {
namespace {

// Tokens per task for the streaming passes: big enough to amortise scheduling, small enough to
// balance 2-128 threads over 8 heads of 8K tokens.
constexpr uint64_t kChunkTokens = 2048;
static_assert(kChunkTokens % kKeySumChunkTokens == 0, "a task holds whole KeySums chunks");

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

size_t ElemBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

const char* ElemPtr(const HeadsView& v, uint32_t head, uint64_t token) {
  return static_cast<const char*>(v.data) + v.offset(head, token) * ElemBytes(v.dtype);
}

// Records the first (head, token) whose squared norm is not finite; threads race benignly to
// the smallest flat index.
class BadTokenFlag {
 public:
  void Report(uint64_t flat) {
    uint64_t cur = first_.load(std::memory_order_relaxed);
    while (flat < cur && !first_.compare_exchange_weak(cur, flat, std::memory_order_relaxed)) {
    }
  }
  // Checks sq[0..n) of tokens [token0, token0 + n) of head `head` (n tokens per head `tokens`).
  void Check(const float* sq, uint64_t n, uint32_t head, uint64_t token0, uint64_t tokens) {
    for (uint64_t i = 0; i < n; ++i) {
      if (!(sq[i] <= FLT_MAX)) {
        Report(uint64_t{head} * tokens + token0 + i);
        return;
      }
    }
  }
  absl::Status ToStatus(const char* what, uint64_t tokens, uint32_t head_base) const {
    const uint64_t flat = first_.load();
    if (flat == kNone) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: NaN or Inf (or a squared norm beyond float32) at head %u, token %u",
                        what, head_base + flat / tokens, flat % tokens));
  }

 private:
  static constexpr uint64_t kNone = std::numeric_limits<uint64_t>::max();
  std::atomic<uint64_t> first_{kNone};
};

// Monotone map of a float to u32 (larger float -> larger u32); -0 and +0 map alike.
inline uint32_t OrderKey(float s) {
  if (s == 0.0f) s = 0.0f;
  uint32_t u;
  std::memcpy(&u, &s, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
constexpr uint32_t kProtectedKey = 0xFFFFFFFFu;  // above every finite score

class CpuScoringOps final : public ScoringOps {
 public:
  explicit CpuScoringOps(CpuContext* context) : ctx_(context) {}

  absl::Status Score(const HeadsView& keys, const ScoreParams& params,
                     const TokenPositions& positions, float* scores) override {
    KVCOMP_RETURN_IF_ERROR(CheckScoreArgs(keys, params, positions, MemorySpace::kHost));
    if (scores == nullptr) return absl::InvalidArgumentError("null scores output");
    return ScoreImpl(keys, params, positions, scores);
  }

  absl::Status CheckFinite(const HeadsView& view, const char* what) override {
    KVCOMP_RETURN_IF_ERROR(CheckHeadsView(view, MemorySpace::kHost, what));
    KVCOMP_ASSIGN_OR_RETURN(
        Buffer sq, Buffer::Allocate(*ctx_->allocator,
                                    uint64_t{view.num_heads} * view.num_tokens * sizeof(float)));
    return SqNormsChecked(view, what, sq.as<float>());
  }

  absl::Status Select(const float* scores, uint32_t num_heads, uint64_t num_tokens,
                      const SelectParams& params, const TokenPositions& positions,
                      KeptIndices out) override {
    KVCOMP_RETURN_IF_ERROR(CheckSelectArgs(num_heads, num_tokens, params));
    if (scores == nullptr) return absl::InvalidArgumentError("null scores");
    if (out.counts == nullptr || out.indices == nullptr) {
      return absl::InvalidArgumentError("null kept outputs");
    }
    return SelectImpl(scores, num_heads, num_tokens, params, positions, out);
  }

  absl::Status Compact(const HeadsView& keys, const HeadsView& values, const uint32_t* counts,
                       const uint32_t* indices, void* keys_out, void* values_out) override {
    KVCOMP_RETURN_IF_ERROR(CheckCompactArgs(keys, values, MemorySpace::kHost));
    if (counts == nullptr || indices == nullptr || keys_out == nullptr || values_out == nullptr) {
      return absl::InvalidArgumentError("null compact argument");
    }
    return CompactImpl(keys, values, counts, indices, keys_out, values_out);
  }

  absl::Status ScoreSelectCompact(const ScoreSelectCompactArgs& a) override {
    KVCOMP_RETURN_IF_ERROR(CheckScoreSelectCompactArgs(a, MemorySpace::kHost));
    const uint32_t h = a.keys.num_heads;
    const uint64_t n = a.keys.num_tokens;
    float* scores = a.scores;
    if (scores == nullptr) {
      KVCOMP_ASSIGN_OR_RETURN(void* ws, Scratch(&scores_ws_, uint64_t{h} * n * sizeof(float)));
      scores = static_cast<float*>(ws);
    }
    // Values are held to the keys' data check, in the compaction pass (V is read once).
    if (a.compact && PerHeadPays(a) && !a.rescore) return PerHead(a, scores);
    KVCOMP_RETURN_IF_ERROR(ScoreImpl(a.keys, a.score, a.positions, scores));
    if (a.rescore) KVCOMP_RETURN_IF_ERROR(a.rescore(scores));
    KVCOMP_RETURN_IF_ERROR(SelectImpl(scores, h, n, a.select, a.positions, a.kept));
    if (!a.compact) return absl::OkStatus();
    return CompactImpl(a.keys, a.values, a.kept.counts, a.kept.indices, a.keys_out, a.values_out,
                       /*check_values=*/true);
  }

  uint64_t WorkspaceBytes(const ScoreSelectCompactArgs& a) const override {
    const uint64_t hn = uint64_t{a.keys.num_heads} * a.keys.num_tokens;
    uint64_t bytes = a.scores == nullptr ? hn * sizeof(float) : 0;
    const uint64_t chunks = a.keys.num_heads * CeilDiv(a.keys.num_tokens, kKeySumChunkTokens);
    bytes += chunks * a.keys.head_dim * sizeof(float);  // partial sums
    bytes += hn * sizeof(uint32_t);  // order keys
    if (a.select.head_budget == HeadBudget::kAdaKV) bytes += hn + hn * 16;  // flags, candidates
    return bytes;
  }

 private:
  // Heads whose keys are large (>= 4 MiB) and independent (uniform budget, not snapkv) run one
  // at a time through all three steps, so the second scoring pass and the gather find the head's
  // keys in the last-level cache instead of DRAM. Same results as the phased path.
  static bool PerHeadPays(const ScoreSelectCompactArgs& a) {
    const uint64_t head_bytes =
        a.keys.num_tokens * a.keys.head_dim * (a.keys.dtype == DType::kF32 ? 4 : 2);
    return a.keys.num_heads > 1 && head_bytes >= (uint64_t{4} << 20) &&
           a.select.head_budget == HeadBudget::kUniform && a.score.scorer != Scorer::kSnapKV;
  }
  absl::Status PerHead(const ScoreSelectCompactArgs& a, float* scores) {
    const uint64_t n = a.keys.num_tokens;
    const uint64_t kept = std::min<uint64_t>(a.select.kept_per_head, n);
    const size_t row = a.keys.head_dim * (a.keys.dtype == DType::kF32 ? 4 : 2);
    for (uint32_t h = 0; h < a.keys.num_heads; ++h) {
      HeadsView k = a.keys, v = a.values;
      k.data = ElemPtr(a.keys, h, 0);
      v.data = ElemPtr(a.values, h, 0);
      k.num_heads = v.num_heads = 1;
      TokenPositions pos = a.positions;
      if (pos.data != nullptr) pos.data += uint64_t{h} * n;
      float* s = scores + uint64_t{h} * n;
      KeptIndices out{a.kept.counts + h, a.kept.indices + h * kept};
      ScoreParams score = a.score;
      if (score.key_sums.num_tokens == n) {  // the head's own chunk sums
        const uint64_t at = uint64_t{h} * CeilDiv(n, kKeySumChunkTokens) * a.keys.head_dim;
        if (score.key_sums.sums != nullptr) score.key_sums.sums += at;
        if (score.key_sums.unit_sums != nullptr) score.key_sums.unit_sums += at;
      }
      head_base_ = h;
      absl::Status st = ScoreImpl(k, score, pos, s);
      head_base_ = 0;
      KVCOMP_RETURN_IF_ERROR(st);
      KVCOMP_RETURN_IF_ERROR(SelectImpl(s, 1, n, a.select, pos, out));
      head_base_ = h;
      st = CompactImpl(k, v, out.counts, out.indices,
                       static_cast<char*>(a.keys_out) + h * kept * row,
                       static_cast<char*>(a.values_out) + h * kept * row, /*check_values=*/true);
      head_base_ = 0;
      KVCOMP_RETURN_IF_ERROR(st);
    }
    return absl::OkStatus();
  }

  absl::Status ScoreImpl(const HeadsView& keys, const ScoreParams& params,
                         const TokenPositions& positions, float* scores);
  absl::Status ScoreMeanBased(const HeadsView& keys, const ScoreParams& params, bool keydiff,
                              float* scores);
  absl::Status ScoreWindowed(const HeadsView& keys, const ScoreParams& params, float* scores);
  absl::Status ScoreSnapKV(const HeadsView& keys, const ScoreParams& params, float* scores);
  // Squared norms of all keys into scores (tokens x heads) and the NaN/Inf check.
  absl::Status SqNormsChecked(const HeadsView& keys, const char* what, float* sq);

  // One head's kept indices (uniform budget), its tokens split over the pool; the same output
  // as the per-head pass of SelectImpl.
  void SelectHeadSplit(const uint32_t* ord, uint64_t n, uint64_t kept, uint32_t* dst);
  absl::Status SelectImpl(const float* scores, uint32_t num_heads, uint64_t num_tokens,
                          const SelectParams& params, const TokenPositions& positions,
                          KeptIndices out);
  // check_values: also the values' data check (every row's squared norm finite), in the same
  // pass that copies the kept rows, so ScoreSelectCompact reads V once ("values: ..." error).
  absl::Status CompactImpl(const HeadsView& keys, const HeadsView& values, const uint32_t* counts,
                           const uint32_t* indices, void* keys_out, void* values_out,
                           bool check_values = false);

  // A grow-only scratch buffer: a backend runs one op at a time, so repeated calls reuse the
  // pages of the last one instead of mapping (and faulting in) fresh ones each time. Held until
  // the backend goes; at most the largest call's scores, order keys, flags and partial sums.
  absl::StatusOr<void*> Scratch(Buffer* b, uint64_t bytes) {
    if (b->size() < bytes) {
      b->Reset();
      KVCOMP_ASSIGN_OR_RETURN(*b, Buffer::Allocate(*ctx_->allocator, bytes));
    }
    return b->data();
  }

  CpuContext* ctx_;
  Buffer scores_ws_, partial_ws_, ord_ws_, flag_ws_;
  // Index of the view's head 0 in the caller's layer (the per-head path): random scores and
  // error messages use the caller's head numbers.
  uint32_t head_base_ = 0;
};

absl::Status CpuScoringOps::SqNormsChecked(const HeadsView& keys, const char* what, float* sq) {
  const cpu::RowKernels* k = cpu::RowKernelsFor(keys.dtype, keys.head_dim);
  const uint64_t n = keys.num_tokens;
  const uint64_t chunks = CeilDiv(n, kChunkTokens);
  BadTokenFlag bad;
  ctx_->ParallelFor(keys.num_heads * chunks, [&](size_t task) {
    const uint32_t h = static_cast<uint32_t>(task / chunks);
    const uint64_t t0 = (task % chunks) * kChunkTokens;
    const uint64_t len = std::min(kChunkTokens, n - t0);
    float* out = sq + uint64_t{h} * n + t0;
    k->sq_norms(ElemPtr(keys, h, t0), keys.token_stride, len, out);
    bad.Check(out, len, h, t0, n);
  });
  return bad.ToStatus(what, n, head_base_);
}

absl::Status CpuScoringOps::ScoreImpl(const HeadsView& keys, const ScoreParams& params,
                                      const TokenPositions& positions, float* scores) {
  const uint32_t heads = keys.num_heads;
  const uint64_t n = keys.num_tokens;
  switch (params.scorer) {
    case Scorer::kKnorm: {
      KVCOMP_RETURN_IF_ERROR(SqNormsChecked(keys, "keys", scores));
      const uint64_t total = uint64_t{heads} * n;
      ctx_->ParallelFor(CeilDiv(total, kChunkTokens * 8), [&](size_t task) {
        const uint64_t b = task * kChunkTokens * 8;
        const uint64_t e = std::min(total, b + kChunkTokens * 8);
        for (uint64_t i = b; i < e; ++i) scores[i] = -std::sqrt(scores[i]);
      });
      return absl::OkStatus();
    }
    case Scorer::kManifold:
      return ScoreMeanBased(keys, params, /*keydiff=*/false, scores);
    case Scorer::kKeyDiff:
      return ScoreMeanBased(keys, params, /*keydiff=*/true, scores);
    case Scorer::kWindowedManifold:
      return ScoreWindowed(keys, params, scores);
    case Scorer::kStreaming:
    case Scorer::kRandom: {
      KVCOMP_RETURN_IF_ERROR(SqNormsChecked(keys, "keys", scores));
      const bool streaming = params.scorer == Scorer::kStreaming;
      ctx_->ParallelFor(heads, [&](size_t hi) {
        const uint32_t h = static_cast<uint32_t>(hi);
        const uint32_t* row = positions.data == nullptr ? nullptr : positions.data + h * n;
        float* out = scores + uint64_t{h} * n;
        for (uint64_t i = 0; i < n; ++i) {
          const uint64_t pos = positions.position(row, i);
          out[i] = streaming ? StreamingScore(pos, params.n_sink)
                             : RandomScore(params.seed, params.stream, head_base_ + h, pos);
        }
      });
      return absl::OkStatus();
    }
    case Scorer::kSnapKV:
      return ScoreSnapKV(keys, params, scores);
  }
  return absl::InvalidArgumentError("unknown scorer");
}

// The keys' sums of one chunk of kKeySumChunkTokens rows (the last one short) from row t0 of
// head h, summed in float from zero in row order (the KeySums of that chunk); their squared norms
// into sq. unit: each row scaled by 1 / max(||k||, kKeyDiffEps) (keydiff).
void ChunkSum(const cpu::RowKernels* k, const HeadsView& keys, uint32_t h, uint64_t t0,
              uint64_t len, bool unit, float* sq, float* sum) {
  std::fill(sum, sum + keys.head_dim, 0.0f);
  k->sq_norms_and_sum(ElemPtr(keys, h, t0), keys.token_stride, len, unit, kKeyDiffEps, sq, sum);
}

// ChunkSum of every chunk of rows [t0, t0 + len) of head h (t0 on a chunk boundary; the last
// chunk may be short), chunk c into sums + c * head_dim, squared norms into sq. Full chunks are
// summed kMaxSumRuns at a time, their rows read in turn: the same bits as one at a time.
void ChunkSums(const cpu::RowKernels* k, const HeadsView& keys, uint32_t h, uint64_t t0,
               uint64_t len, bool unit, float* sq, float* sums) {
  const uint32_t d = keys.head_dim;
  const uint64_t full = len / kKeySumChunkTokens;
  std::fill(sums, sums + CeilDiv(len, kKeySumChunkTokens) * d, 0.0f);
  for (uint64_t c = 0; c < full; c += cpu::kMaxSumRuns) {
    const uint64_t t = c * kKeySumChunkTokens;
    k->sq_norms_and_sums(ElemPtr(keys, h, t0 + t), keys.token_stride, kKeySumChunkTokens,
                         std::min(cpu::kMaxSumRuns, full - c), unit, kKeyDiffEps, sq + t,
                         sums + c * d);
  }
  if (const uint64_t rest = len % kKeySumChunkTokens; rest != 0) {
    const uint64_t t = full * kKeySumChunkTokens;
    k->sq_norms_and_sum(ElemPtr(keys, h, t0 + t), keys.token_stride, rest, unit, kKeyDiffEps,
                        sq + t, sums + full * d);
  }
}

// The mean of `rows` rows from their double sum, rounded to float. Returns its norm floored at
// kKeyDiffEps (keydiff's).
float MeanOfSum(const double* sum, uint32_t d, uint64_t rows, float* mean) {
  double norm2 = 0.0;
  for (uint32_t j = 0; j < d; ++j) {
    mean[j] = static_cast<float>(sum[j] / static_cast<double>(rows));
    norm2 += static_cast<double>(mean[j]) * mean[j];
  }
  return std::fmax(static_cast<float>(std::sqrt(norm2)), kKeyDiffEps);
}

// The mean of `count` chunk sums (consecutive, d floats each) over `rows` rows: summed in double
// in chunk order (MeanOfSum).
float MeanOfChunks(const float* sums, uint64_t count, uint32_t d, uint64_t rows, float* mean) {
  std::vector<double> sum(d, 0.0);
  for (uint64_t c = 0; c < count; ++c) {
    for (uint32_t j = 0; j < d; ++j) sum[j] += sums[c * d + j];
  }
  return MeanOfSum(sum.data(), d, rows, mean);
}

// Every head's mean and its norm from the heads' chunk sums ([heads, count, d]).
void MeansOfHeads(const float* sums, uint32_t heads, uint64_t count, uint32_t d, uint64_t rows,
                  std::vector<float>* centre, std::vector<float>* centre_norm) {
  centre->resize(uint64_t{heads} * d);
  centre_norm->resize(heads);
  for (uint32_t h = 0; h < heads; ++h) {
    (*centre_norm)[h] = MeanOfChunks(sums + uint64_t{h} * count * d, count, d, rows,
                                     centre->data() + uint64_t{h} * d);
  }
}

// The sums a centred scorer can take from the caller (ScoreParams::key_sums), or null. Windows
// must start on chunk boundaries.
const float* GivenSums(const ScoreParams& p, uint64_t n) {
  if (p.key_sums.num_tokens != n) return nullptr;
  switch (p.scorer) {
    case Scorer::kManifold: return p.key_sums.sums;
    case Scorer::kKeyDiff: return p.key_sums.unit_sums;
    case Scorer::kWindowedManifold:
      return p.window >= n || p.window % kKeySumChunkTokens == 0 ? p.key_sums.sums : nullptr;
    default: return nullptr;
  }
}

// manifold: s = ||k - mu||, mu = mean k.  keydiff: s = -cos(k, a), a = mean k/||k||.
// The mean is the double sum, in chunk order, of float sums over chunks of kKeySumChunkTokens
// rows (KeySums), given by the caller or computed here. Given: one pass reads each row once for
// its squared norm (the data check; keydiff's denominator) and its distance or dot product.
// Computed: pass 1 per chunk gives the squared norms (kept in `scores`) and the chunk sums;
// pass 2 reads the keys again. With at least as many heads as workers, each head is one task
// (both passes on one core, the second reading the head from that core's cache when it fits);
// otherwise every (head, kChunkTokens rows) is a task of each pass. Every order gives the same
// bits (the same chunk sums summed in the same order).
absl::Status CpuScoringOps::ScoreMeanBased(const HeadsView& keys, const ScoreParams& params,
                                           bool keydiff, float* scores) {
  const cpu::RowKernels* k = cpu::RowKernelsFor(keys.dtype, keys.head_dim);
  const uint32_t heads = keys.num_heads;
  const uint32_t d = keys.head_dim;
  const uint64_t n = keys.num_tokens;
  const uint64_t chunks = CeilDiv(n, kChunkTokens);
  const uint64_t sum_chunks = CeilDiv(n, kKeySumChunkTokens);
  const uint64_t tasks = heads * chunks;
  // Turns pass 2's dot products (in out) into keydiff scores; sq holds the squared norms.
  auto keydiff_scores = [](const float* dots, const float* sq, uint64_t len, float centre_norm,
                           float* out) {
    for (uint64_t i = 0; i < len; ++i) {
      const float denom = std::fmax(std::sqrt(sq[i]), kKeyDiffEps) * centre_norm;
      out[i] = -(dots[i] / denom);
    }
  };
  // Pass 2 of the computed means over rows [t0, t0 + len) of head h: scores into out, which
  // holds pass 1's squared norms.
  auto score_rows = [&](uint32_t h, uint64_t t0, uint64_t len, const float* c, float c_norm) {
    float* out = scores + uint64_t{h} * n + t0;
    if (!keydiff) {
      k->distances(ElemPtr(keys, h, t0), keys.token_stride, len, c, out);
      return;
    }
    float dots[kChunkTokens];
    k->dots(ElemPtr(keys, h, t0), keys.token_stride, len, c, dots);
    keydiff_scores(dots, out, len, c_norm, out);
  };
  std::vector<float> centre, centre_norm;
  if (const float* given = GivenSums(params, n); given != nullptr) {
    MeansOfHeads(given, heads, sum_chunks, d, n, &centre, &centre_norm);
    BadTokenFlag bad;
    ctx_->ParallelFor(tasks, [&](size_t task) {
      const uint32_t h = static_cast<uint32_t>(task / chunks);
      const uint64_t t0 = (task % chunks) * kChunkTokens;
      const uint64_t len = std::min(kChunkTokens, n - t0);
      float* out = scores + uint64_t{h} * n + t0;
      const float* c = centre.data() + uint64_t{h} * d;
      float sq[kChunkTokens];
      if (!keydiff) {
        k->distances_and_sq(ElemPtr(keys, h, t0), keys.token_stride, len, c, out, sq);
      } else {
        float dots[kChunkTokens];
        k->dots_and_sq(ElemPtr(keys, h, t0), keys.token_stride, len, c, dots, sq);
        keydiff_scores(dots, sq, len, centre_norm[h], out);
      }
      bad.Check(sq, len, h, t0, n);
    });
    return bad.ToStatus("keys", n, head_base_);
  }
  if (heads >= static_cast<uint32_t>(ctx_->num_threads())) {
    BadTokenFlag bad;
    ctx_->ParallelFor(heads, [&](size_t hi) {
      const uint32_t h = static_cast<uint32_t>(hi);
      std::vector<float> part(sum_chunks * d), head_centre(d);
      float* sq = scores + uint64_t{h} * n;
      ChunkSums(k, keys, h, 0, n, keydiff, sq, part.data());
      bad.Check(sq, n, h, 0, n);
      const float head_norm = MeanOfChunks(part.data(), sum_chunks, d, n, head_centre.data());
      for (uint64_t t0 = 0; t0 < n; t0 += kChunkTokens) {
        score_rows(h, t0, std::min(kChunkTokens, n - t0), head_centre.data(), head_norm);
      }
    });
    return bad.ToStatus("keys", n, head_base_);
  }
  KVCOMP_ASSIGN_OR_RETURN(void* partial_ws,
                          Scratch(&partial_ws_, heads * sum_chunks * d * sizeof(float)));
  float* const partial = static_cast<float*>(partial_ws);
  constexpr uint64_t kSumsPerTask = kChunkTokens / kKeySumChunkTokens;
  BadTokenFlag bad;
  ctx_->ParallelFor(tasks, [&](size_t task) {
    const uint32_t h = static_cast<uint32_t>(task / chunks);
    const uint64_t c0 = (task % chunks) * kSumsPerTask;
    const uint64_t t0 = c0 * kKeySumChunkTokens;
    const uint64_t len = std::min(kChunkTokens, n - t0);
    float* sq = scores + uint64_t{h} * n + t0;
    ChunkSums(k, keys, h, t0, len, keydiff, sq, partial + (h * sum_chunks + c0) * d);
    bad.Check(sq, len, h, t0, n);
  });
  KVCOMP_RETURN_IF_ERROR(bad.ToStatus("keys", n, head_base_));

  MeansOfHeads(partial, heads, sum_chunks, d, n, &centre, &centre_norm);
  ctx_->ParallelFor(tasks, [&](size_t task) {
    const uint32_t h = static_cast<uint32_t>(task / chunks);
    const uint64_t t0 = (task % chunks) * kChunkTokens;
    score_rows(h, t0, std::min(kChunkTokens, n - t0), centre.data() + uint64_t{h} * d,
               centre_norm[h]);
  });
  return absl::OkStatus();
}

// Window w covers rows [w*W, min(n, (w+1)*W)); its mean is summed in float per chunk of
// kKeySumChunkTokens rows from the window's start and in double across them (the KeySums'
// chunks when W is a multiple of kKeySumChunkTokens or covers the view). Given those sums, one
// pass reads each row once; else pass 2 runs while the window is in cache.
absl::Status CpuScoringOps::ScoreWindowed(const HeadsView& keys, const ScoreParams& params,
                                          float* scores) {
  const cpu::RowKernels* k = cpu::RowKernelsFor(keys.dtype, keys.head_dim);
  const uint32_t heads = keys.num_heads;
  const uint32_t d = keys.head_dim;
  const uint64_t n = keys.num_tokens;
  const uint64_t window = params.window;
  const uint64_t windows = CeilDiv(n, window);
  const uint64_t sum_chunks = CeilDiv(n, kKeySumChunkTokens);
  const float* given = GivenSums(params, n);
  BadTokenFlag bad;
  ctx_->ParallelFor(heads * windows, [&](size_t task) {
    const uint32_t h = static_cast<uint32_t>(task / windows);
    const uint64_t w0 = (task % windows) * window;
    const uint64_t wlen = std::min<uint64_t>(window, n - w0);
    std::vector<float> mean(d);
    if (given != nullptr) {
      const uint64_t c0 = w0 / kKeySumChunkTokens;
      MeanOfChunks(given + (uint64_t{h} * sum_chunks + c0) * d,
                   CeilDiv(wlen, kKeySumChunkTokens), d, wlen, mean.data());
      for (uint64_t t0 = w0; t0 < w0 + wlen; t0 += kChunkTokens) {
        const uint64_t len = std::min(kChunkTokens, w0 + wlen - t0);
        float sq[kChunkTokens];
        k->distances_and_sq(ElemPtr(keys, h, t0), keys.token_stride, len, mean.data(),
                            scores + uint64_t{h} * n + t0, sq);
        bad.Check(sq, len, h, t0, n);
      }
      return;
    }
    const uint64_t wchunks = CeilDiv(wlen, kKeySumChunkTokens);
    std::vector<float> part(wchunks * d);
    float* sq = scores + uint64_t{h} * n + w0;
    ChunkSums(k, keys, h, w0, wlen, false, sq, part.data());
    bad.Check(sq, wlen, h, w0, n);
    MeanOfChunks(part.data(), wchunks, d, wlen, mean.data());
    k->distances(ElemPtr(keys, h, w0), keys.token_stride, wlen, mean.data(),
                 scores + uint64_t{h} * n + w0);
  });
  return bad.ToStatus("keys", n, head_base_);
}

// kvpress's SnapKV: the last w queries attend (causally, softmax in f32) over all keys; the
// weights on the first n - w tokens are averaged over the queries, average-pooled over tokens
// (zero padding, divided by the width), averaged over the GQA group; the window's own tokens get
// the layer's maximum score so they are kept.
absl::Status CpuScoringOps::ScoreSnapKV(const HeadsView& keys, const ScoreParams& params,
                                        float* scores) {
  const HeadsView& q = params.queries;
  KVCOMP_RETURN_IF_ERROR(SqNormsChecked(keys, "keys", scores));
  {
    std::vector<float> qsq(uint64_t{q.num_heads} * q.num_tokens);
    KVCOMP_RETURN_IF_ERROR(SqNormsChecked(q, "snapkv queries", qsq.data()));
  }
  const cpu::RowKernels* k = cpu::RowKernelsFor(keys.dtype, keys.head_dim);
  const uint32_t heads = keys.num_heads;
  const uint32_t d = keys.head_dim;
  const uint64_t n = keys.num_tokens;
  const uint64_t w = q.num_tokens;
  const uint64_t prefix = n - w;
  const uint32_t group = q.num_heads / heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t half = params.snapkv_pool / 2;

  // pooled[j * prefix + t]: per query head, before the group mean.
  std::vector<float> pooled(uint64_t{q.num_heads} * prefix);
  ctx_->ParallelFor(prefix == 0 ? 0 : q.num_heads, [&](size_t jq) {
    const uint32_t j = static_cast<uint32_t>(jq);
    const uint32_t h = j / group;
    std::vector<float> qf(d), logits(n);
    std::vector<double> acc(prefix, 0.0);
    for (uint64_t r = 0; r < w; ++r) {
      k->to_float(ElemPtr(q, j, r), qf.data());
      const uint64_t visible = prefix + r + 1;  // causal: query at position prefix + r
      k->dots(ElemPtr(keys, h, 0), keys.token_stride, visible, qf.data(), logits.data());
      float m = -FLT_MAX;
      for (uint64_t t = 0; t < visible; ++t) {
        logits[t] *= scale;
        m = std::max(m, logits[t]);
      }
      float z = 0.0f;
      for (uint64_t t = 0; t < visible; ++t) {
        logits[t] = std::exp(logits[t] - m);
        z += logits[t];
      }
      const float inv = 1.0f / z;
      for (uint64_t t = 0; t < prefix; ++t) acc[t] += logits[t] * inv;
    }
    float* out = pooled.data() + uint64_t{j} * prefix;
    for (uint64_t t = 0; t < prefix; ++t) {
      double s = 0.0;
      const int64_t lo = std::max<int64_t>(0, static_cast<int64_t>(t) - half);
      const int64_t hi =
          std::min<int64_t>(static_cast<int64_t>(prefix) - 1, static_cast<int64_t>(t) + half);
      for (int64_t u = lo; u <= hi; ++u) s += acc[u];
      out[t] = static_cast<float>(s / static_cast<double>(w) / params.snapkv_pool);
    }
  });
  float max_score = prefix == 0 ? 1.0f : -FLT_MAX;
  for (uint32_t h = 0; h < heads; ++h) {
    float* out = scores + uint64_t{h} * n;
    for (uint64_t t = 0; t < prefix; ++t) {
      double s = 0.0;
      for (uint32_t g = 0; g < group; ++g) s += pooled[uint64_t{h * group + g} * prefix + t];
      out[t] = static_cast<float>(s / group);
      max_score = std::max(max_score, out[t]);
    }
  }
  for (uint32_t h = 0; h < heads; ++h) {
    std::fill(scores + uint64_t{h} * n + prefix, scores + uint64_t{h} * n + n, max_score);
  }
  return absl::OkStatus();
}

// Position of the `k`-th largest (1-based, 1 <= k <= n) of the (order key, lower index first)
// ranking of ord[0..n): returns the threshold key T and how many tokens with key == T are kept
// (the first ones by index). Two 16-bit radix passes, no sort; short heads take a selection
// over a copy of their keys instead (same T, same count).
struct Threshold {
  uint32_t key = 0;
  uint64_t take_equal = 0;  // tokens with key == T kept, lowest indices first
};
// Up to this many tokens a head's threshold comes from std::nth_element over a copy of its keys
// (linear in n): the radix passes fill and scan two 65,536-bucket histograms (256 KiB each)
// whatever n is, about a thousand times the work of the selection itself for the 64-128 tokens
// of a small put. bench/cpu/select_small_bench.cc measures both sides.
constexpr uint64_t kNthElementMaxTokens = 4096;
Threshold RadixThreshold(const uint32_t* ord, uint64_t n, uint64_t k, std::vector<uint32_t>* hist) {
  if (n <= kNthElementMaxTokens) {
    hist->assign(ord, ord + n);
    const auto nth = hist->begin() + static_cast<std::ptrdiff_t>(k - 1);
    std::nth_element(hist->begin(), nth, hist->end(), std::greater<uint32_t>());
    const uint32_t key = *nth;
    uint64_t above = 0;
    for (uint64_t i = 0; i < n; ++i) above += ord[i] > key;
    return Threshold{key, k - above};
  }
  hist->assign(65536, 0);
  for (uint64_t i = 0; i < n; ++i) ++(*hist)[ord[i] >> 16];
  uint64_t above = 0;  // tokens with a larger high half
  uint32_t hi = 65535;
  for (;; --hi) {
    if (above + (*hist)[hi] >= k) break;
    above += (*hist)[hi];
  }
  hist->assign(65536, 0);
  for (uint64_t i = 0; i < n; ++i) {
    if ((ord[i] >> 16) == hi) ++(*hist)[ord[i] & 0xFFFF];
  }
  uint32_t lo = 65535;
  for (;; --lo) {
    if (above + (*hist)[lo] >= k) break;
    above += (*hist)[lo];
  }
  return Threshold{(hi << 16) | lo, k - above};
}

// Tokens per slice when one head's selection is split over the pool.
constexpr uint64_t kSliceTokens = 8192;

void CpuScoringOps::SelectHeadSplit(const uint32_t* o, uint64_t n, uint64_t kept, uint32_t* dst) {
  const uint64_t slices = CeilDiv(n, kSliceTokens);
  constexpr int kBits[3] = {11, 11, 10};
  constexpr int kShift[3] = {21, 10, 0};
  std::vector<uint32_t> hist(slices * 2048);
  uint64_t prefix = 0, above = 0;
  for (int l = 0; l < 3; ++l) {
    const uint32_t mask = (1u << kBits[l]) - 1;
    const int up = kShift[l] + kBits[l];
    ctx_->ParallelFor(slices, [&](size_t sl) {
      uint32_t* hs = hist.data() + sl * 2048;
      std::fill(hs, hs + 2048, 0u);
      const uint64_t e = std::min(n, (sl + 1) * kSliceTokens);
      for (uint64_t i = sl * kSliceTokens; i < e; ++i) {
        const uint64_t v = o[i];
        if ((v >> up) == prefix) ++hs[(v >> kShift[l]) & mask];
      }
    });
    uint64_t b = mask;
    for (;; --b) {
      uint64_t count = 0;
      for (uint64_t sl = 0; sl < slices; ++sl) count += hist[sl * 2048 + b];
      if (above + count >= kept) break;
      above += count;
    }
    prefix = (prefix << kBits[l]) | b;
  }
  const uint32_t key = static_cast<uint32_t>(prefix);
  const uint64_t take_equal = kept - above;
  // Per slice: tokens above the key and equal to it; then each slice's start and its share of
  // the equal ones (lowest indices first), as the one-thread pass would give.
  std::vector<uint64_t> gt(slices), eq(slices);
  ctx_->ParallelFor(slices, [&](size_t sl) {
    uint64_t g = 0, q = 0;
    const uint64_t e = std::min(n, (sl + 1) * kSliceTokens);
    for (uint64_t i = sl * kSliceTokens; i < e; ++i) {
      g += o[i] > key;
      q += o[i] == key;
    }
    gt[sl] = g;
    eq[sl] = q;
  });
  std::vector<uint64_t> start(slices), take(slices);
  uint64_t c = 0, equal = 0;
  for (uint64_t sl = 0; sl < slices; ++sl) {
    start[sl] = c;
    take[sl] = std::min(eq[sl], take_equal - std::min(take_equal, equal));
    equal += eq[sl];
    c += gt[sl] + take[sl];
  }
  ctx_->ParallelFor(slices, [&](size_t sl) {
    uint64_t c = start[sl], equal = 0;
    const uint64_t end = c + gt[sl] + take[sl];
    for (uint64_t i = sl * kSliceTokens; c < end; ++i) {
      const uint32_t v = o[i];
      const uint64_t over = v > key;
      const uint64_t at = v == key;
      const uint64_t room = equal < take[sl];
      dst[c] = static_cast<uint32_t>(i);
      c += over | (at & room);
      equal += at;
    }
  });
}

absl::Status CpuScoringOps::SelectImpl(const float* scores, uint32_t num_heads, uint64_t num_tokens,
                                       const SelectParams& params, const TokenPositions& positions,
                                       KeptIndices out) {
  const uint64_t n = num_tokens;
  const uint64_t kept = std::min<uint64_t>(params.kept_per_head, n);
  const uint64_t hn = uint64_t{num_heads} * n;
  // Order keys of the effective scores: larger key = kept first (protected = kProtectedKey).
  KVCOMP_ASSIGN_OR_RETURN(void* ord_ws, Scratch(&ord_ws_, hn * 4));
  uint32_t* ord = static_cast<uint32_t*>(ord_ws);
  std::atomic<uint64_t> bad{std::numeric_limits<uint64_t>::max()};
  const uint64_t chunks = CeilDiv(n, kChunkTokens * 8);
  ctx_->ParallelFor(num_heads * chunks, [&](size_t task) {
    const uint64_t h = task / chunks;
    const uint64_t b = (task % chunks) * kChunkTokens * 8;
    const uint64_t e = std::min(n, b + kChunkTokens * 8);
    const float* s = scores + h * n;
    const uint32_t* prow = positions.data == nullptr ? nullptr : positions.data + h * n;
    uint64_t seq_len = positions.sequence_length;
    if (seq_len == 0) seq_len = prow != nullptr ? uint64_t{prow[n - 1]} + 1 : positions.offset + n;
    uint32_t* o = ord + h * n;
    // Branch-free over the chunk; the first bad score and the protected tokens after.
    bool finite = true;
    for (uint64_t i = b; i < e; ++i) {
      finite &= std::fabs(s[i]) <= FLT_MAX;
      o[i] = OrderKey(s[i]);
    }
    if (!finite) {
      uint64_t i = b;
      while (std::fabs(s[i]) <= FLT_MAX) ++i;
      uint64_t cur = bad.load();
      const uint64_t flat = h * n + i;
      while (flat < cur && !bad.compare_exchange_weak(cur, flat)) {
      }
    }
    if (!params.protect) return;
    auto protect = [&](uint64_t from, uint64_t to) {
      for (uint64_t i = from; i < to; ++i) {
        if (IsProtected(positions.position(prow, i), seq_len, params)) o[i] = kProtectedKey;
      }
    };
    if (prow != nullptr) {
      protect(b, e);
      return;
    }
    // Identity positions (offset + i): the sinks lead, the recent tokens close the view.
    const uint64_t off = positions.offset;
    const uint64_t sinks = params.n_sink > off ? params.n_sink - off : 0;
    protect(b, std::min(e, std::max(b, sinks)));
    if (params.n_recent > 0) {
      const uint64_t first = seq_len > params.n_recent + off ? seq_len - params.n_recent - off : 0;
      protect(std::max(b, std::min(e, first)), e);
    }
  });
  if (bad.load() != std::numeric_limits<uint64_t>::max()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "select: non-finite score at head %u, token %u", bad.load() / n, bad.load() % n));
  }
  // Marks head h's top `k` tokens in flag (1) by the selection rule.
  auto mark_top = [&](uint64_t h, uint64_t k, uint8_t* flag, std::vector<uint32_t>* hist) {
    const uint32_t* o = ord + h * n;
    if (k == 0) return;
    const Threshold t = RadixThreshold(o, n, k, hist);
    uint64_t equal = 0;
    for (uint64_t i = 0; i < n; ++i) {
      flag[i] = o[i] > t.key || (o[i] == t.key && equal++ < t.take_equal);
    }
  };

  if ((params.head_budget == HeadBudget::kUniform || num_heads == 1) &&
      num_heads < static_cast<uint32_t>(ctx_->num_threads()) && kept < n &&
      n >= 2 * kSliceTokens) {
    // Fewer heads than workers: each head's tokens are split over the pool.
    for (uint32_t h = 0; h < num_heads; ++h) {
      out.counts[h] = static_cast<uint32_t>(kept);
      SelectHeadSplit(ord + uint64_t{h} * n, n, kept, out.indices + uint64_t{h} * kept);
    }
    return absl::OkStatus();
  }
  if (params.head_budget == HeadBudget::kUniform || num_heads == 1) {
    ctx_->ParallelFor(num_heads, [&](size_t h) {
      uint32_t* dst = out.indices + h * kept;
      out.counts[h] = static_cast<uint32_t>(kept);
      if (kept == n) {
        for (uint64_t i = 0; i < n; ++i) dst[i] = static_cast<uint32_t>(i);
        return;
      }
      const uint32_t* o = ord + h * n;
      thread_local std::vector<uint32_t> hist;  // 256 KiB: kept per thread, not mapped per call
      const Threshold t = RadixThreshold(o, n, kept, &hist);
      // Branch-free (about half the tokens are kept, in no pattern); exactly `kept` are taken,
      // so the loop ends on the last one and every store stays below dst + kept.
      uint64_t c = 0, equal = 0;
      for (uint64_t i = 0; c < kept; ++i) {
        const uint32_t v = o[i];
        const uint64_t gt = v > t.key;
        const uint64_t eq = v == t.key;
        const uint64_t room = equal < t.take_equal;
        dst[c] = static_cast<uint32_t>(i);
        c += gt | (eq & room);
        equal += eq;
      }
    });
    return absl::OkStatus();
  }

  // AdaKV: safeguard per head, then the layer's remaining budget to its best tokens overall.
  const uint64_t safe = std::min<uint64_t>(
      kept, static_cast<uint64_t>(static_cast<double>(kept) * params.alpha_safeguard));
  KVCOMP_ASSIGN_OR_RETURN(void* flag_ws, Scratch(&flag_ws_, hn));
  uint8_t* flag = static_cast<uint8_t*>(flag_ws);
  std::memset(flag, 0, hn);
  ctx_->ParallelFor(num_heads, [&](size_t h) {
    thread_local std::vector<uint32_t> hist;
    mark_top(h, safe, flag + h * n, &hist);
  });
  const uint64_t remaining = num_heads * kept - num_heads * safe;
  if (remaining > 0) {
    // (order key, ~head, ~index) compared lexicographically, larger first.
    struct Cand {
      uint64_t hi;  // ord << 32 | ~head
      uint32_t lo;  // ~index
    };
    std::vector<Cand> cands;
    cands.reserve(hn - num_heads * safe);
    for (uint64_t h = 0; h < num_heads; ++h) {
      for (uint64_t i = 0; i < n; ++i) {
        if (flag[h * n + i]) continue;
        cands.push_back({(uint64_t{ord[h * n + i]} << 32) | (0xFFFFFFFFu - h),
                         0xFFFFFFFFu - static_cast<uint32_t>(i)});
      }
    }
    auto greater = [](const Cand& a, const Cand& b) {
      return a.hi != b.hi ? a.hi > b.hi : a.lo > b.lo;
    };
    std::nth_element(cands.begin(), cands.begin() + (remaining - 1), cands.end(), greater);
    for (uint64_t c = 0; c < remaining; ++c) {
      const uint64_t h = 0xFFFFFFFFu - (cands[c].hi & 0xFFFFFFFFu);
      const uint64_t i = 0xFFFFFFFFu - cands[c].lo;
      flag[h * n + i] = 1;
    }
  }
  uint64_t offset = 0;
  for (uint64_t h = 0; h < num_heads; ++h) {
    uint32_t c = 0;
    for (uint64_t i = 0; i < n; ++i) {
      if (flag[h * n + i]) out.indices[offset + c++] = static_cast<uint32_t>(i);
    }
    out.counts[h] = c;
    offset += c;
  }
  return absl::OkStatus();
}

absl::Status CpuScoringOps::CompactImpl(const HeadsView& keys, const HeadsView& values,
                                        const uint32_t* counts, const uint32_t* indices,
                                        void* keys_out, void* values_out, bool check_values) {
  const uint32_t heads = keys.num_heads;
  const uint64_t n = keys.num_tokens;
  std::vector<uint64_t> offsets(heads + 1, 0);
  for (uint32_t h = 0; h < heads; ++h) {
    if (counts[h] > n) {
      return absl::InvalidArgumentError(
          absl::StrFormat("compact: head %u keeps %u of %u tokens", h, counts[h], n));
    }
    offsets[h + 1] = offsets[h] + counts[h];
  }
  const uint64_t total = offsets[heads];
  for (uint64_t i = 0; i < total; ++i) {
    if (indices[i] >= n) {
      return absl::InvalidArgumentError(
          absl::StrFormat("compact: index %u out of range (%u tokens)", indices[i], n));
    }
  }
  const size_t row_bytes = keys.head_dim * ElemBytes(keys.dtype);  // >= 128, a multiple of 64
  char* kout = static_cast<char*>(keys_out);
  char* vout = static_cast<char*>(values_out);
  // Streaming stores pay off once the output outgrows the caches, and need 16-byte alignment.
  const bool stream = total * row_bytes * 2 >= (uint64_t{8} << 20) &&
                      reinterpret_cast<uintptr_t>(kout) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(vout) % 16 == 0;
  // The row kernels copy; both tensors share dtype and head_dim (the caller checks).
  const cpu::RowKernels* k = cpu::RowKernelsFor(keys.dtype, keys.head_dim);
  auto fence = [stream] {
#if defined(__SSE2__)
    if (stream) _mm_sfence();
#else
    (void)stream;
#endif
  };
  if (check_values) {
    // Per (head, chunk of kChunkTokens tokens): the chunk's kept keys gathered, then every value
    // row of the chunk read once, in order: its squared norm checked (the data rule) and the
    // kept ones copied while in L1. Kept lists are ascending (SelectImpl's output).
    const uint64_t chunks = CeilDiv(n, kChunkTokens);
    BadTokenFlag bad;
    ctx_->ParallelFor(uint64_t{heads} * chunks, [&](size_t task) {
      const uint32_t h = static_cast<uint32_t>(task / chunks);
      const uint64_t t0 = (task % chunks) * kChunkTokens;
      const uint64_t len = std::min(kChunkTokens, n - t0);
      const uint32_t* first = indices + offsets[h];
      const uint32_t* last = indices + offsets[h + 1];
      const uint32_t* lo = std::lower_bound(first, last, static_cast<uint32_t>(t0));
      const uint32_t* hi = std::lower_bound(lo, last, static_cast<uint32_t>(t0 + len));
      const uint64_t dst = offsets[h] + (lo - first);
      k->gather(ElemPtr(keys, h, 0), keys.token_stride, lo, hi - lo, kout + dst * row_bytes,
                stream);
      float sq[kChunkTokens];
      k->sq_norms_and_copy(ElemPtr(values, h, t0), values.token_stride, t0, len, lo, hi - lo,
                           vout + dst * row_bytes, stream, sq);
      bad.Check(sq, len, h, t0, n);
      fence();
    });
    return bad.ToStatus("values", n, head_base_);
  }
  constexpr uint64_t kRowsPerTask = 1024;
  std::vector<uint64_t> task_start(heads + 1, 0);
  for (uint32_t h = 0; h < heads; ++h) {
    task_start[h + 1] = task_start[h] + CeilDiv(counts[h], kRowsPerTask);
  }
  ctx_->ParallelFor(task_start[heads], [&](size_t task) {
    const uint32_t h = static_cast<uint32_t>(
        std::upper_bound(task_start.begin(), task_start.end(), task) - task_start.begin() - 1);
    const uint64_t r0 = (task - task_start[h]) * kRowsPerTask;
    const uint64_t r1 = std::min<uint64_t>(counts[h], r0 + kRowsPerTask);
    const uint64_t dst = offsets[h] + r0;
    k->gather(ElemPtr(keys, h, 0), keys.token_stride, indices + dst, r1 - r0,
              kout + dst * row_bytes, stream);
    k->gather(ElemPtr(values, h, 0), values.token_stride, indices + dst, r1 - r0,
              vout + dst * row_bytes, stream);
    fence();
  });
  return absl::OkStatus();
}

}  // namespace

absl::Status SumKeysOnHost(const HeadsView& keys, uint64_t chunk_begin, uint64_t chunk_end,
                           float* sums, float* unit_sums) {
  KVCOMP_RETURN_IF_ERROR(CheckHeadsView(keys, MemorySpace::kHost, "keys"));
  const uint64_t n = keys.num_tokens;
  const uint64_t chunks = CeilDiv(n, kKeySumChunkTokens);
  if (chunk_begin > chunk_end || chunk_end > chunks) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "key sums: chunks [%u, %u) of %u tokens (%u chunks)", chunk_begin, chunk_end, n, chunks));
  }
  const cpu::RowKernels* k = cpu::RowKernelsFor(keys.dtype, keys.head_dim);
  const uint32_t d = keys.head_dim;
  float sq[kKeySumChunkTokens];
  for (uint32_t h = 0; h < keys.num_heads; ++h) {
    for (uint64_t c = chunk_begin; c < chunk_end; ++c) {
      const uint64_t t0 = c * kKeySumChunkTokens;
      const uint64_t len = std::min<uint64_t>(kKeySumChunkTokens, n - t0);
      const uint64_t at = (uint64_t{h} * chunks + c) * d;
      if (sums != nullptr) {  // the bits of ChunkSum's, without the squared norms
        std::fill(sums + at, sums + at + d, 0.0f);
        k->sums(ElemPtr(keys, h, t0), keys.token_stride, len, sums + at);
      }
      if (unit_sums != nullptr) ChunkSum(k, keys, h, t0, len, true, sq, unit_sums + at);
    }
  }
  return absl::OkStatus();
}

std::unique_ptr<ScoringOps> NewCpuScoringOps(CpuContext* context) {
  return std::make_unique<CpuScoringOps>(context);
}

}  // namespace kvcomp
