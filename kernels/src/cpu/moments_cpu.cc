// CPU MomentOps: moments of evicted tokens (alone or in the compaction pass) and their merge.
// Work is split into (head, token range) items so a few long heads still use every thread; each
// item sums into its own fp32 partial, reduced per head at the end. The v k^T sum of a tile of
// tokens is one dense product (Eigen's GEMM when available).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "cpu_ops.h"
#include "gemm_kernels.h"
#include "kvcomp/core/status.h"
#include "moments_cpu_internal.h"
#include "scoring_kernels.h"

namespace kvcomp {
namespace moments_internal {

namespace {

constexpr size_t kTile = 128;            // tokens per dense product
constexpr size_t kMinPartTokens = 2048;  // smallest token range worth its own partial

absl::Status WrongSpace(const char* what) {
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: memory is in the wrong space for this backend", what));
}

size_t ElemBytes(DType d) { return DTypeBytes(d, 1); }

}  // namespace

absl::Status CheckMomentsView(const MomentsView& m, uint32_t heads, uint32_t head_dim,
                              MemorySpace space, const char* what) {
  if (m.count == nullptr || m.key_sum == nullptr || m.value_sum == nullptr || m.vk_sum == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: null moment array", what));
  }
  if (m.num_heads != heads || m.head_dim != head_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: moments have %u heads of dim %u, expected %u of dim %u", what,
                        m.num_heads, m.head_dim, heads, head_dim));
  }
  if (m.space != space) return WrongSpace(what);
  return absl::OkStatus();
}

absl::Status CheckConstMomentsView(const ConstMomentsView& m, uint32_t heads, uint32_t head_dim,
                                   MemorySpace space, const char* what) {
  MomentsView v{const_cast<uint64_t*>(m.count),
                const_cast<float*>(m.key_sum),
                const_cast<float*>(m.value_sum),
                const_cast<float*>(m.vk_sum),
                m.num_heads,
                m.head_dim,
                m.space};
  return CheckMomentsView(v, heads, head_dim, space, what);
}

absl::Status CheckKvPair(const HeadsView& k, const HeadsView& v, MemorySpace space) {
  if (k.data == nullptr || v.data == nullptr) {
    if (k.num_tokens != 0 || v.num_tokens != 0) {
      return absl::InvalidArgumentError("moments: null key or value data");
    }
  }
  if (!IsInputDType(k.dtype) || k.dtype != v.dtype) {
    return absl::InvalidArgumentError(
        absl::StrFormat("moments: keys (%s) and values (%s) must share one of f32, f16, bf16",
                        DTypeName(k.dtype), DTypeName(v.dtype)));
  }
  if (k.num_heads != v.num_heads || k.num_tokens != v.num_tokens || k.head_dim != v.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "moments: keys [%u, %u, %u] and values [%u, %u, %u] differ in shape", k.num_heads,
        k.num_tokens, k.head_dim, v.num_heads, v.num_tokens, v.head_dim));
  }
  if (k.head_dim == 0 || k.head_dim > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat("moments: head_dim %u", k.head_dim));
  }
  for (const HeadsView* x : {&k, &v}) {
    if (x->token_stride < x->head_dim) {
      return absl::InvalidArgumentError("moments: token stride smaller than a row");
    }
    if (x->space != space) return WrongSpace("moments: keys/values");
  }
  return absl::OkStatus();
}

absl::Status CheckTokenLists(const TokenLists& l, uint32_t heads, MemorySpace space,
                             const char* what) {
  if (l.num_heads != heads) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %u token lists for %u heads", what, l.num_heads, heads));
  }
  if (l.offsets == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: null offsets", what));
  }
  if (l.space != space) return WrongSpace(what);
  return absl::OkStatus();
}

absl::Status CheckCompactArgs(const HeadsView& k, const HeadsView& v, const TokenLists& kept,
                              const MomentsView& out, MemorySpace space) {
  KVCOMP_RETURN_IF_ERROR(CheckKvPair(k, v, space));
  KVCOMP_RETURN_IF_ERROR(CheckTokenLists(kept, k.num_heads, space, "moments: kept"));
  if (out.count == nullptr) return absl::OkStatus();
  return CheckMomentsView(out, k.num_heads, k.head_dim, space, "moments: out");
}

absl::Status CheckTokenIndices(const TokenLists& l, uint64_t tokens, bool ascending,
                               const char* what) {
  if (l.offsets[0] != 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: offsets[0] must be 0", what));
  }
  for (uint32_t h = 0; h < l.num_heads; ++h) {
    const uint64_t a = l.offsets[h], b = l.offsets[h + 1];
    if (b < a) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: offsets decrease at head %u", what, h));
    }
    if (b > a && l.indices == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: null indices", what));
    }
    if (ascending && b - a > tokens) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: head %u lists %u tokens of %u", what, h, b - a, tokens));
    }
    for (uint64_t i = a; i < b; ++i) {
      if (l.indices[i] >= tokens) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: head %u token %u out of range (%u tokens)", what, h, l.indices[i], tokens));
      }
      if (ascending && i > a && l.indices[i] <= l.indices[i - 1]) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: head %u tokens not strictly ascending", what, h));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckRaggedOffsets(const RaggedKv& kv) {
  if (kv.offsets[0] != 0) return absl::InvalidArgumentError("attention: offsets[0] must be 0");
  for (uint32_t h = 0; h < kv.num_kv_heads; ++h) {
    if (kv.offsets[h + 1] < kv.offsets[h]) {
      return absl::InvalidArgumentError(
          absl::StrFormat("attention: kept offsets decrease at kv head %u", h));
    }
  }
  if (kv.offsets[kv.num_kv_heads] > 0 && (kv.keys == nullptr || kv.values == nullptr)) {
    return absl::InvalidArgumentError("attention: null kept keys or values");
  }
  return absl::OkStatus();
}

absl::Status CheckAttention(const AttentionParams& p, MemorySpace space) {
  const HeadsView& q = p.queries;
  const RaggedKv& kv = p.kv;
  if (!IsInputDType(q.dtype) || !IsInputDType(kv.dtype)) {
    return absl::InvalidArgumentError("attention: queries and kept K/V must be f32, f16 or bf16");
  }
  if (kv.num_kv_heads == 0 || q.num_heads == 0 || q.num_heads % kv.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("attention: %u query heads is not a positive multiple of %u kv heads",
                        q.num_heads, kv.num_kv_heads));
  }
  if (q.head_dim != kv.head_dim || q.head_dim == 0 || q.head_dim > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "attention: query head_dim %u vs kept head_dim %u", q.head_dim, kv.head_dim));
  }
  if (q.num_tokens > 0 && q.data == nullptr) {
    return absl::InvalidArgumentError("attention: null queries");
  }
  if (q.token_stride < q.head_dim) return absl::InvalidArgumentError("attention: query stride");
  if (p.out == nullptr && q.num_tokens > 0) {
    return absl::InvalidArgumentError("attention: null output");
  }
  if (kv.offsets == nullptr) return absl::InvalidArgumentError("attention: null kept offsets");
  if (!std::isfinite(p.scale) || p.scale < 0.0f) {
    return absl::InvalidArgumentError("attention: scale must be finite and >= 0");
  }
  if (q.space != space || kv.space != space) return WrongSpace("attention: queries/kept K/V");
  if (p.correct && p.moments.count != nullptr) {
    KVCOMP_RETURN_IF_ERROR(CheckConstMomentsView(p.moments, kv.num_kv_heads, kv.head_dim, space,
                                                 "attention: moments"));
  }
  return absl::OkStatus();
}

void RowToFloat(const void* src, DType dtype, size_t n, float* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      break;
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]);
      break;
    }
    case DType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = HalfToFloat(s[i]);
      break;
    }
    default:
      std::fill(dst, dst + n, 0.0f);
  }
}

}  // namespace moments_internal

namespace cpu {
const GemmKernels* WideGemm() {
#if defined(KVCOMP_HAVE_WIDE_GEMM)
  static const GemmKernels* const chosen = [] {
    const std::string isa = RowKernelsIsa();
    if (isa == "avx512") return avx512::GemmTable();
    if (isa == "avx2") return avx2::GemmTable();
    return static_cast<const GemmKernels*>(nullptr);
  }();
  return chosen;
#else
  return nullptr;
#endif
}
#if defined(KVCOMP_HAVE_EIGEN)
const GemmKernels& Gemm() {
  const GemmKernels* wide = WideGemm();
  return wide != nullptr ? *wide : *generic::GemmTable();
}
#endif
}  // namespace cpu

namespace moments_internal {

#ifdef KVCOMP_HAVE_EIGEN
void AddAtB(const float* a, const float* b, float* c, size_t m, size_t p, size_t q) {
  cpu::Gemm().add_at_b(a, b, c, m, p, q);
}
void ABt(const float* a, const float* b, float* c, size_t m, size_t p, size_t q) {
  cpu::Gemm().a_bt(a, b, c, m, p, q);
}
void AddAB(const float* a, const float* b, float* c, size_t m, size_t p, size_t q) {
  cpu::Gemm().add_a_b(a, b, c, m, p, q);
}
#else
void AddAtB(const float* a, const float* b, float* c, size_t m, size_t p, size_t q) {
  for (size_t t = 0; t < m; ++t) {
    for (size_t i = 0; i < p; ++i) {
      const float ai = a[t * p + i];
      float* ci = c + i * q;
      const float* bt = b + t * q;
      for (size_t j = 0; j < q; ++j) ci[j] += ai * bt[j];
    }
  }
}
void ABt(const float* a, const float* b, float* c, size_t m, size_t p, size_t q) {
  for (size_t i = 0; i < m; ++i) {
    for (size_t j = 0; j < q; ++j) {
      float s = 0.0f;
      for (size_t x = 0; x < p; ++x) s += a[i * p + x] * b[j * p + x];
      c[i * q + j] = s;
    }
  }
}
void AddAB(const float* a, const float* b, float* c, size_t m, size_t p, size_t q) {
  for (size_t i = 0; i < m; ++i) {
    for (size_t x = 0; x < p; ++x) {
      const float ax = a[i * p + x];
      for (size_t j = 0; j < q; ++j) c[i * q + j] += ax * b[x * q + j];
    }
  }
}
#endif

namespace {

// fp32 moments of one head being built by one work item.
struct Partial {
  uint64_t count = 0;
  std::vector<float> ks, vs, s;
  void Init(size_t d) {
    ks.assign(d, 0.0f);
    vs.assign(d, 0.0f);
    s.assign(d * d, 0.0f);
  }
};

// Collects token rows into fp32 tiles and folds full tiles into a Partial.
class TileSummer {
 public:
  TileSummer(const HeadsView& k, const HeadsView& v, uint32_t head, Partial* out)
      : k_(k),
        v_(v),
        head_(head),
        d_(k.head_dim),
        out_(out),
        kt_(kTile * k.head_dim),
        vt_(kTile * k.head_dim) {}
  void Add(uint64_t token) {
    const size_t eb = ElemBytes(k_.dtype);
    RowToFloat(static_cast<const uint8_t*>(k_.data) + k_.offset(head_, token) * eb, k_.dtype, d_,
               kt_.data() + m_ * d_);
    RowToFloat(static_cast<const uint8_t*>(v_.data) + v_.offset(head_, token) * eb, v_.dtype, d_,
               vt_.data() + m_ * d_);
    if (++m_ == kTile) Flush();
  }
  void Flush() {
    if (m_ == 0) return;
    for (size_t t = 0; t < m_; ++t) {
      const float* kr = kt_.data() + t * d_;
      const float* vr = vt_.data() + t * d_;
      for (size_t i = 0; i < d_; ++i) {
        out_->ks[i] += kr[i];
        out_->vs[i] += vr[i];
      }
    }
    AddAtB(vt_.data(), kt_.data(), out_->s.data(), m_, d_, d_);
    out_->count += m_;
    m_ = 0;
  }

 private:
  const HeadsView& k_;
  const HeadsView& v_;
  uint32_t head_;
  size_t d_;
  Partial* out_;
  std::vector<float> kt_, vt_;
  size_t m_ = 0;
};

struct Item {
  uint32_t head;
  uint64_t begin, end;  // range of the head's list (Accumulate) or of its tokens (Compact)
};

// Splits [0, len_h) of every head into ranges so the total is about `workers`-parallel.
std::vector<Item> SplitHeads(uint32_t heads, size_t workers,
                             const std::function<uint64_t(uint32_t)>& len) {
  std::vector<Item> items;
  const size_t max_parts = std::max<size_t>(1, (2 * workers + heads - 1) / heads);
  for (uint32_t h = 0; h < heads; ++h) {
    const uint64_t n = len(h);
    const size_t parts =
        std::max<size_t>(1, std::min<size_t>(max_parts, (n + kMinPartTokens - 1) / kMinPartTokens));
    for (size_t p = 0; p < parts; ++p) {
      items.push_back({h, n * p / parts, n * (p + 1) / parts});
    }
  }
  return items;
}

// out[head] += partials of that head.
void Reduce(const std::vector<Item>& items, const std::vector<Partial>& parts,
            const MomentsView& out) {
  const size_t d = out.head_dim;
  for (size_t i = 0; i < items.size(); ++i) {
    const Partial& p = parts[i];
    const uint32_t h = items[i].head;
    if (p.count == 0) continue;
    out.count[h] += p.count;
    float* ks = out.key_sum + size_t{h} * d;
    float* vs = out.value_sum + size_t{h} * d;
    float* s = out.vk_sum + size_t{h} * d * d;
    for (size_t x = 0; x < d; ++x) {
      ks[x] += p.ks[x];
      vs[x] += p.vs[x];
    }
    for (size_t x = 0; x < d * d; ++x) s[x] += p.s[x];
  }
}

}  // namespace

CpuMomentOps::CpuMomentOps(ParallelFor parallel, size_t workers)
    : parallel_(std::move(parallel)), workers_(std::max<size_t>(1, workers)) {}

absl::Status CpuMomentOps::Accumulate(const HeadsView& k, const HeadsView& v,
                                      const TokenLists& evicted, const MomentsView& out) {
  KVCOMP_RETURN_IF_ERROR(CheckKvPair(k, v, MemorySpace::kHost));
  KVCOMP_RETURN_IF_ERROR(
      CheckTokenLists(evicted, k.num_heads, MemorySpace::kHost, "moments: evicted"));
  KVCOMP_RETURN_IF_ERROR(
      CheckMomentsView(out, k.num_heads, k.head_dim, MemorySpace::kHost, "moments: out"));
  KVCOMP_RETURN_IF_ERROR(CheckTokenIndices(evicted, k.num_tokens, false, "moments: evicted"));
  const std::vector<Item> items = SplitHeads(k.num_heads, workers_, [&](uint32_t h) {
    return evicted.offsets[h + 1] - evicted.offsets[h];
  });
  std::vector<Partial> parts(items.size());
  parallel_(items.size(), [&](size_t i) {
    const Item& it = items[i];
    parts[i].Init(k.head_dim);
    TileSummer sum(k, v, it.head, &parts[i]);
    const uint32_t* list = evicted.indices + evicted.offsets[it.head];
    for (uint64_t j = it.begin; j < it.end; ++j) sum.Add(list[j]);
    sum.Flush();
  });
  Reduce(items, parts, out);
  return absl::OkStatus();
}

absl::Status CpuMomentOps::CompactAndAccumulate(const HeadsView& k, const HeadsView& v,
                                                const TokenLists& kept, void* kept_k, void* kept_v,
                                                const MomentsView& out) {
  KVCOMP_RETURN_IF_ERROR(CheckCompactArgs(k, v, kept, out, MemorySpace::kHost));
  KVCOMP_RETURN_IF_ERROR(CheckTokenIndices(kept, k.num_tokens, true, "moments: kept"));
  if (kept.offsets[k.num_heads] > 0 && (kept_k == nullptr || kept_v == nullptr)) {
    return absl::InvalidArgumentError("moments: null kept_k or kept_v");
  }
  CompactRows(k, v, kept, kept_k, kept_v, out);
  return absl::OkStatus();
}

void CpuMomentOps::CompactRows(const HeadsView& k, const HeadsView& v, const TokenLists& kept,
                               void* kept_k, void* kept_v, const MomentsView& out) {
  const bool summarize = out.count != nullptr;
  const size_t eb = ElemBytes(k.dtype);
  const size_t row = eb * k.head_dim;
  const std::vector<Item> items =
      SplitHeads(k.num_heads, workers_, [&](uint32_t) { return k.num_tokens; });
  std::vector<Partial> parts(items.size());
  parallel_(items.size(), [&](size_t i) {
    const Item& it = items[i];
    const uint32_t* first = kept.indices + kept.offsets[it.head];
    const uint32_t* last = kept.indices + kept.offsets[it.head + 1];
    const uint32_t* next = std::lower_bound(first, last, it.begin);
    uint64_t out_row = kept.offsets[it.head] + static_cast<uint64_t>(next - first);
    if (summarize) parts[i].Init(k.head_dim);
    TileSummer sum(k, v, it.head, &parts[i]);
    const uint8_t* kb = static_cast<const uint8_t*>(k.data);
    const uint8_t* vb = static_cast<const uint8_t*>(v.data);
    for (uint64_t t = it.begin; t < it.end; ++t) {
      if (next != last && *next == t) {
        std::memcpy(static_cast<uint8_t*>(kept_k) + out_row * row, kb + k.offset(it.head, t) * eb,
                    row);
        std::memcpy(static_cast<uint8_t*>(kept_v) + out_row * row, vb + v.offset(it.head, t) * eb,
                    row);
        ++next;
        ++out_row;
      } else if (summarize) {
        sum.Add(t);
      }
    }
    if (summarize) sum.Flush();
  });
  if (summarize) Reduce(items, parts, out);
}

absl::Status CpuMomentOps::CompactAndAccumulateDeferred(const HeadsView& k, const HeadsView& v,
                                                        const TokenLists& kept, void* kept_k,
                                                        void* kept_v, uint32_t* error,
                                                        uint64_t* bad_value,
                                                        const MomentsView& out) {
  KVCOMP_RETURN_IF_ERROR(CheckCompactArgs(k, v, kept, out, MemorySpace::kHost));
  if (error == nullptr || bad_value == nullptr || kept_k == nullptr || kept_v == nullptr) {
    return absl::InvalidArgumentError("moments: null error word, value check or kept outputs");
  }
  // Malformed lists: the error word, and nothing copied, added or checked (the device contract).
  if (!CheckTokenIndices(kept, k.num_tokens, /*ascending=*/true, "moments: kept").ok()) {
    *error = 1;
    return absl::OkStatus();
  }
  // The values' data check: the first bad row in head-major order, as the device reports it.
  const size_t eb = ElemBytes(v.dtype);
  const uint8_t* vb = static_cast<const uint8_t*>(v.data);
  std::vector<uint64_t> first_bad(k.num_heads, ~uint64_t{0});
  parallel_(k.num_heads, [&](size_t h) {
    std::vector<float> row(v.head_dim);
    for (uint64_t t = 0; t < v.num_tokens; ++t) {
      RowToFloat(vb + v.offset(static_cast<uint32_t>(h), t) * eb, v.dtype, v.head_dim,
                 row.data());
      float sq = 0.0f;
      for (float x : row) sq += x * x;
      if (!(sq <= FLT_MAX)) {
        first_bad[h] = h * v.num_tokens + t;
        return;
      }
    }
  });
  for (uint64_t b : first_bad) *bad_value = std::min<uint64_t>(*bad_value, b);
  CompactRows(k, v, kept, kept_k, kept_v, out);
  return absl::OkStatus();
}

absl::Status CpuMomentOps::Merge(const MomentsView& dst, const ConstMomentsView& src) {
  KVCOMP_RETURN_IF_ERROR(
      CheckMomentsView(dst, dst.num_heads, dst.head_dim, MemorySpace::kHost, "merge: dst"));
  KVCOMP_RETURN_IF_ERROR(
      CheckConstMomentsView(src, dst.num_heads, dst.head_dim, MemorySpace::kHost, "merge: src"));
  const size_t d = dst.head_dim;
  parallel_(dst.num_heads, [&](size_t h) {
    dst.count[h] += src.count[h];
    for (size_t x = 0; x < d; ++x) {
      dst.key_sum[h * d + x] += src.key_sum[h * d + x];
      dst.value_sum[h * d + x] += src.value_sum[h * d + x];
    }
    for (size_t x = 0; x < d * d; ++x) dst.vk_sum[h * d * d + x] += src.vk_sum[h * d * d + x];
  });
  return absl::OkStatus();
}

}  // namespace moments_internal
}  // namespace kvcomp

namespace kvcomp {

std::unique_ptr<MomentOps> NewCpuMomentOps(CpuContext* context) {
  return std::make_unique<moments_internal::CpuMomentOps>(
      [context](size_t n, const std::function<void(size_t)>& fn) { context->ParallelFor(n, fn); },
      static_cast<size_t>(context->num_threads()));
}

}  // namespace kvcomp
