// Argument validation shared by every ScoringOps backend, and parameters from a policy.
#include "kvcomp/kernels/scoring_ops.h"

#include "absl/strings/str_format.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace {

absl::Status Bad(const std::string& message) { return absl::InvalidArgumentError(message); }

const char* SpaceName(MemorySpace s) { return s == MemorySpace::kHost ? "host" : "device"; }

}  // namespace

absl::Status CheckHeadsView(const HeadsView& v, MemorySpace space, const char* what) {
  if (!IsInputDType(v.dtype)) {
    return Bad(absl::StrFormat("%s: dtype %s unsupported (f32, f16 or bf16)", what,
                               IsValidDType(static_cast<uint8_t>(v.dtype))
                                   ? std::string(DTypeName(v.dtype))
                                   : absl::StrFormat("#%d", static_cast<int>(v.dtype))));
  }
  if (!IsSupportedHeadDim(v.head_dim)) {
    return Bad(absl::StrFormat("%s: head_dim %u unsupported (64, 128 or 256)", what, v.head_dim));
  }
  if (v.num_heads == 0) return Bad(absl::StrFormat("%s: zero heads", what));
  if (v.num_tokens == 0) return Bad(absl::StrFormat("%s: empty sequence (zero tokens)", what));
  if (v.num_tokens > KvLayout::kMaxTokens) {
    return Bad(absl::StrFormat("%s: %u tokens exceed the limit %u", what, v.num_tokens,
                               KvLayout::kMaxTokens));
  }
  if (v.data == nullptr) return Bad(absl::StrFormat("%s: null data", what));
  if (v.token_stride < v.head_dim) {
    return Bad(
        absl::StrFormat("%s: token_stride %u < head_dim %u", what, v.token_stride, v.head_dim));
  }
  if (v.num_heads > 1 && v.head_stride < v.head_dim) {
    return Bad(
        absl::StrFormat("%s: head_stride %u < head_dim %u", what, v.head_stride, v.head_dim));
  }
  if (v.space != space) {
    return Bad(absl::StrFormat("%s: %s memory given to a %s backend", what, SpaceName(v.space),
                               SpaceName(space)));
  }
  return absl::OkStatus();
}

absl::Status CheckScoreArgs(const HeadsView& keys, const ScoreParams& p,
                            const TokenPositions& positions, MemorySpace space) {
  if (absl::Status s = CheckHeadsView(keys, space, "keys"); !s.ok()) return s;
  if (static_cast<uint8_t>(p.scorer) > static_cast<uint8_t>(Scorer::kSnapKV)) {
    return Bad(absl::StrFormat("unknown scorer #%d", static_cast<int>(p.scorer)));
  }
  if (p.scorer == Scorer::kWindowedManifold && p.window == 0) {
    return Bad("windowed_manifold: window must be at least 1 token");
  }
  if (positions.data == nullptr && positions.offset + keys.num_tokens > (uint64_t{1} << 32)) {
    return Bad("positions beyond 2^32");
  }
  if ((p.key_sums.sums != nullptr || p.key_sums.unit_sums != nullptr) &&
      p.key_sums.num_tokens != keys.num_tokens) {
    return Bad(absl::StrFormat("key sums cover %u tokens, the keys %u", p.key_sums.num_tokens,
                               keys.num_tokens));
  }
  if (p.scorer == Scorer::kSnapKV) {
    const HeadsView& q = p.queries;
    if (q.data == nullptr) return Bad("snapkv needs the observation window's queries");
    if (absl::Status s = CheckHeadsView(q, space, "snapkv queries"); !s.ok()) return s;
    if (q.dtype != keys.dtype || q.head_dim != keys.head_dim) {
      return Bad(absl::StrFormat("snapkv queries are %s x %u, keys %s x %u", DTypeName(q.dtype),
                                 q.head_dim, DTypeName(keys.dtype), keys.head_dim));
    }
    if (q.num_heads % keys.num_heads != 0) {
      return Bad(absl::StrFormat("snapkv: %u query heads not a multiple of %u kv heads",
                                 q.num_heads, keys.num_heads));
    }
    if (q.num_tokens > keys.num_tokens) {
      return Bad(absl::StrFormat("snapkv: window of %u queries longer than the %u tokens",
                                 q.num_tokens, keys.num_tokens));
    }
    if (p.snapkv_pool == 0 || p.snapkv_pool % 2 == 0) {
      return Bad(absl::StrFormat("snapkv_pool %u must be odd", p.snapkv_pool));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSelectArgs(uint32_t num_heads, uint64_t num_tokens, const SelectParams& p) {
  if (num_heads == 0) return Bad("select: zero heads");
  if (num_tokens == 0) return Bad("select: empty sequence (zero tokens)");
  if (p.kept_per_head == 0) return Bad("budget of zero tokens per head: nothing would be kept");
  if (static_cast<uint8_t>(p.head_budget) > static_cast<uint8_t>(HeadBudget::kAdaKV)) {
    return Bad("unknown head_budget");
  }
  if (!(p.alpha_safeguard >= 0.0 && p.alpha_safeguard <= 1.0)) {
    return Bad(absl::StrFormat("alpha_safeguard %g outside [0, 1]", p.alpha_safeguard));
  }
  return absl::OkStatus();
}

absl::Status CheckCompactArgs(const HeadsView& keys, const HeadsView& values, MemorySpace space) {
  if (absl::Status s = CheckHeadsView(keys, space, "keys"); !s.ok()) return s;
  if (absl::Status s = CheckHeadsView(values, space, "values"); !s.ok()) return s;
  if (keys.dtype != values.dtype || keys.num_heads != values.num_heads ||
      keys.num_tokens != values.num_tokens || keys.head_dim != values.head_dim) {
    return Bad(absl::StrFormat(
        "keys [%u, %u, %u] %s and values [%u, %u, %u] %s differ in shape or dtype", keys.num_heads,
        keys.num_tokens, keys.head_dim, DTypeName(keys.dtype), values.num_heads, values.num_tokens,
        values.head_dim, DTypeName(values.dtype)));
  }
  return absl::OkStatus();
}

absl::Status DeferredCheckStatus(const DeferredCheck& e, uint64_t n, uint64_t q_tokens) {
  constexpr uint64_t kNone = DeferredCheck::kNone;
  const uint64_t rows = n == 0 ? 1 : n;
  const uint64_t q_rows = q_tokens == 0 ? 1 : q_tokens;
  if (e.bad_key != kNone) {
    return absl::InvalidArgumentError(
        absl::StrFormat("keys: NaN or Inf (or a squared norm beyond float32) at head %u, token %u",
                        e.bad_key / rows, e.bad_key % rows));
  }
  if (e.bad_value != kNone) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "values: NaN or Inf (or a squared norm beyond float32) at head %u, token %u",
        e.bad_value / rows, e.bad_value % rows));
  }
  if (e.bad_query != kNone) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "snapkv queries: NaN or Inf (or a squared norm beyond float32) at head %u, token %u",
        e.bad_query / q_rows, e.bad_query % q_rows));
  }
  if (e.bad_score != kNone) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "select: non-finite score at head %u, token %u", e.bad_score / rows, e.bad_score % rows));
  }
  return absl::OkStatus();
}

absl::Status CheckScoreSelectCompactArgs(const ScoreSelectCompactArgs& a, MemorySpace space) {
  if (absl::Status s = CheckCompactArgs(a.keys, a.values, space); !s.ok()) return s;
  if (absl::Status s = CheckScoreArgs(a.keys, a.score, a.positions, space); !s.ok()) return s;
  if (absl::Status s = CheckSelectArgs(a.keys.num_heads, a.keys.num_tokens, a.select); !s.ok()) {
    return s;
  }
  if (a.kept.counts == nullptr || a.kept.indices == nullptr) return Bad("null kept outputs");
  if (a.compact && (a.keys_out == nullptr || a.values_out == nullptr)) {
    return Bad("null key/value outputs");
  }
  return absl::OkStatus();
}

absl::Status CheckScoreSelectCompactVarlenArgs(const ScoreSelectCompactVarlenArgs& a,
                                               MemorySpace space) {
  if (absl::Status s = CheckCompactArgs(a.keys, a.values, space); !s.ok()) return s;
  if (a.requests == 0 || a.cu_seqlens == nullptr || a.kept_per_head == nullptr) {
    return Bad("varlen: no requests, or null cu_seqlens / kept_per_head");
  }
  if (a.cu_seqlens[0] != 0) return Bad("varlen: cu_seqlens[0] must be 0");
  for (uint32_t r = 0; r < a.requests; ++r) {
    if (a.cu_seqlens[r + 1] <= a.cu_seqlens[r]) {
      return Bad(absl::StrFormat("varlen: request %u is empty or cu_seqlens descends", r));
    }
    if (a.kept_per_head[r] == 0) {
      return Bad(absl::StrFormat("varlen: request %u has a budget of zero", r));
    }
  }
  if (a.cu_seqlens[a.requests] != a.keys.num_tokens) {
    return Bad(absl::StrFormat("varlen: cu_seqlens ends at %u, the view has %u tokens",
                               a.cu_seqlens[a.requests], a.keys.num_tokens));
  }
  if (a.select.head_budget != HeadBudget::kUniform) return Bad("varlen: uniform budgets only");
  if (a.score.scorer == Scorer::kSnapKV) return Bad("varlen: snapkv is not supported");
  if (a.kept.counts == nullptr || a.kept.indices == nullptr) return Bad("null kept outputs");
  if (a.keys_out == nullptr || a.values_out == nullptr) return Bad("null key/value outputs");
  return absl::OkStatus();
}

ScoreSelectCompactArgs VarlenRequestArgs(const ScoreSelectCompactVarlenArgs& a, uint32_t r,
                                         uint64_t rows_before) {
  const uint64_t t0 = a.cu_seqlens[r];
  const uint64_t n = a.cu_seqlens[r + 1] - t0;
  const size_t es = DTypeBytes(a.keys.dtype, 1);
  const uint32_t heads = a.keys.num_heads;
  ScoreSelectCompactArgs s;
  s.keys = a.keys;
  s.keys.data = static_cast<const char*>(a.keys.data) + t0 * a.keys.token_stride * es;
  s.keys.num_tokens = n;
  s.values = a.values;
  s.values.data = static_cast<const char*>(a.values.data) + t0 * a.values.token_stride * es;
  s.values.num_tokens = n;
  s.score = a.score;
  s.score.key_sums = KeySums{};
  s.select = a.select;
  s.select.kept_per_head = a.kept_per_head[r];
  s.scores = a.scores != nullptr ? a.scores + uint64_t{heads} * t0 : nullptr;
  s.kept.counts = a.kept.counts + uint64_t{r} * heads;
  s.kept.indices = a.kept.indices + rows_before;
  s.keys_out = static_cast<char*>(a.keys_out) + rows_before * a.keys.head_dim * es;
  s.values_out = static_cast<char*>(a.values_out) + rows_before * a.keys.head_dim * es;
  return s;
}

absl::Status ScoringOps::ScoreSelectCompactVarlen(const ScoreSelectCompactVarlenArgs& a) {
  KVCOMP_RETURN_IF_ERROR(CheckScoreSelectCompactVarlenArgs(a, a.keys.space));
  uint64_t rows = 0;
  for (uint32_t r = 0; r < a.requests; ++r) {
    const ScoreSelectCompactArgs s = VarlenRequestArgs(a, r, rows);
    if (absl::Status st = ScoreSelectCompact(s); !st.ok()) {
      return absl::Status(st.code(), absl::StrFormat("request %u: %s", r, st.message()));
    }
    rows += KeptCapacity(a.keys.num_heads, s.keys.num_tokens, s.select.kept_per_head);
  }
  return absl::OkStatus();
}

ScoreParams ScoreParamsFromPolicy(const CompressionPolicy& policy, uint32_t layer,
                                  const HeadsView& queries) {
  ScoreParams p;
  p.scorer = policy.scorer;
  p.window = policy.window;
  p.n_sink = policy.n_sink;
  p.seed = policy.seed;
  p.stream = layer;
  p.queries = queries;
  p.snapkv_pool = policy.snapkv_pool;
  return p;
}

absl::StatusOr<SelectParams> SelectParamsFromPolicy(const CompressionPolicy& policy,
                                                    uint64_t num_tokens) {
  if (absl::Status s = policy.Validate(); !s.ok()) return s;
  SelectParams p;
  p.kept_per_head = policy.KeptPerHead(num_tokens);
  if (p.kept_per_head == 0) {
    return Bad(absl::StrFormat(
        "budget of zero: %u tokens at ratio %g keep none per head (lower the ratio or set a "
        "token_budget)",
        num_tokens, policy.ratio));
  }
  p.head_budget = policy.head_budget;
  p.alpha_safeguard = policy.alpha_safeguard;
  p.protect = policy.protect;
  p.n_sink = policy.n_sink;
  // The recent window scales with the per-head budget (under AdaKV, the uniform one).
  p.n_recent = policy.EffectiveRecent(p.kept_per_head);
  return p;
}

}  // namespace kvcomp
