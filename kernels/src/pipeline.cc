// Whole-sequence compression: per layer ScoreSelectCompact on the backend, then the eviction
// hook, the moment stage and (at the end) the codec stage.
#include "kvcomp/kernels/pipeline.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"
#include "cpu/moments_aware.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/allocator.h"
#include "kvcomp/kernels/scoring_ops.h"
#include "pipeline_stages.h"

namespace kvcomp {
namespace {

using pipeline_internal::LayerEviction;

size_t ElemBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

bool IsDense(const HeadsView& v) {
  return v.token_stride == v.head_dim &&
         (v.num_heads == 1 || v.head_stride == v.num_tokens * v.head_dim);
}

// `view` in the backend's space: itself, or a dense copy made from host memory.
absl::StatusOr<HeadsView> Stage(Backend& backend, const HeadsView& view, Buffer* owner) {
  if (view.space == backend.space()) return view;
  if (view.space != MemorySpace::kHost) {
    return absl::InvalidArgumentError("device memory given to a host backend");
  }
  const size_t row = view.head_dim * ElemBytes(view.dtype);
  const uint64_t bytes = uint64_t{view.num_heads} * view.num_tokens * row;
  KVCOMP_ASSIGN_OR_RETURN(*owner, Buffer::Allocate(backend.allocator(), bytes));
  if (IsDense(view)) {
    KVCOMP_RETURN_IF_ERROR(backend.CopyFromHost(owner->data(), view.data, bytes));
  } else {
    std::vector<char> packed(bytes);
    for (uint32_t h = 0; h < view.num_heads; ++h) {
      for (uint64_t t = 0; t < view.num_tokens; ++t) {
        std::memcpy(packed.data() + (uint64_t{h} * view.num_tokens + t) * row,
                    static_cast<const char*>(view.data) + view.offset(h, t) * ElemBytes(view.dtype),
                    row);
      }
    }
    KVCOMP_RETURN_IF_ERROR(backend.CopyFromHost(owner->data(), packed.data(), bytes));
  }
  return HeadsView::Dense(owner->data(), view.dtype, view.num_heads, view.num_tokens, view.head_dim,
                          backend.space());
}

// Head h's evicted indices: the complement of its (ascending) kept indices in [0, n).
void Complement(const uint32_t* counts, const uint32_t* kept, uint32_t heads, uint64_t n,
                LayerEviction* e) {
  e->offsets.assign(heads + 1, 0);
  e->evicted.clear();
  uint64_t k_off = 0;
  for (uint32_t h = 0; h < heads; ++h) {
    const uint32_t* k = kept + k_off;
    uint64_t j = 0;
    for (uint64_t t = 0; t < n; ++t) {
      if (j < counts[h] && k[j] == t) {
        ++j;
      } else {
        e->evicted.push_back(static_cast<uint32_t>(t));
      }
    }
    k_off += counts[h];
    e->offsets[h + 1] = e->evicted.size();
  }
}

absl::Status CallHook(const EvictionHook& hook, const LayerEviction& e) {
  for (uint32_t h = 0; h < e.keys.num_heads; ++h) {
    absl::Span<const uint32_t> rows(e.evicted.data() + e.offsets[h],
                                    e.offsets[h + 1] - e.offsets[h]);
    EvictedTokens t{e.layer, h, e.keys, e.values, rows, rows};
    KVCOMP_RETURN_IF_ERROR(hook(t));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status KvCacheView::Validate() const {
  KVCOMP_RETURN_IF_ERROR(layout.Validate());
  if (num_tokens == 0) return absl::InvalidArgumentError("empty sequence (zero tokens)");
  if (keys.size() != layout.num_layers || values.size() != layout.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%u key and %u value layers for a layout of %u layers", keys.size(),
                        values.size(), layout.num_layers));
  }
  if (!queries.empty() && queries.size() != layout.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%u query layers for %u layers", queries.size(), layout.num_layers));
  }
  const MemorySpace space = keys[0].space;
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    for (const HeadsView* v : {&keys[l], &values[l]}) {
      const char* what = v == &keys[l] ? "keys" : "values";
      KVCOMP_RETURN_IF_ERROR(
          Annotate(CheckHeadsView(*v, space, what), absl::StrFormat("layer %u", l)));
      if (v->dtype != layout.dtype || v->num_heads != layout.num_kv_heads ||
          v->num_tokens != num_tokens || v->head_dim != layout.head_dim) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "layer %u %s: [%u, %u, %u] %s, expected [%u, %u, %u] %s", l, what, v->num_heads,
            v->num_tokens, v->head_dim, DTypeName(v->dtype), layout.num_kv_heads, num_tokens,
            layout.head_dim, DTypeName(layout.dtype)));
      }
    }
    if (!queries.empty()) {
      KVCOMP_RETURN_IF_ERROR(Annotate(CheckHeadsView(queries[l], space, "snapkv queries"),
                                      absl::StrFormat("layer %u", l)));
      if (queries[l].num_heads != layout.num_q_heads) {
        return absl::InvalidArgumentError(
            absl::StrFormat("layer %u: %u query heads, layout says %u", l, queries[l].num_heads,
                            layout.num_q_heads));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CompressedCache> Compress(Backend& backend, const KvCacheView& cache,
                                         const CompressionPolicy& policy,
                                         const CompressOptions& options) {
  KVCOMP_RETURN_IF_ERROR(policy.Validate());
  KVCOMP_RETURN_IF_ERROR(cache.Validate());
  KVCOMP_RETURN_IF_ERROR(policy.ValidateFor(cache.layout.head_dim));
  if (policy.scorer == Scorer::kSnapKV && cache.queries.empty()) {
    return absl::InvalidArgumentError("snapkv needs the observation window's queries");
  }
  KVCOMP_RETURN_IF_ERROR(
      pipeline_internal::CodecsAvailable(backend, policy, options.projection.get()));
  KVCOMP_ASSIGN_OR_RETURN(SelectParams select, SelectParamsFromPolicy(policy, cache.num_tokens));

  const KvLayout& layout = cache.layout;
  const uint32_t heads = layout.num_kv_heads;
  const uint64_t n = cache.num_tokens;
  const size_t row = layout.head_dim * ElemBytes(layout.dtype);
  const uint64_t cap = KeptCapacity(heads, n, select.kept_per_head);
  const bool host = backend.space() == MemorySpace::kHost;

  CompressedCache out;
  out.policy = policy;
  out.has_moments = policy.moments && pipeline_internal::MomentsAvailable(backend);
  out.Reset(layout, n);
  out.positions.resize(layout.num_layers * cap);
  out.keys.resize(layout.num_layers * cap * row);
  out.values.resize(layout.num_layers * cap * row);

  Buffer dev_counts, dev_idx, dev_k, dev_v;
  if (!host) {
    Allocator& a = backend.allocator();
    KVCOMP_ASSIGN_OR_RETURN(dev_counts, Buffer::Allocate(a, heads * sizeof(uint32_t)));
    KVCOMP_ASSIGN_OR_RETURN(dev_idx, Buffer::Allocate(a, cap * sizeof(uint32_t)));
    KVCOMP_ASSIGN_OR_RETURN(dev_k, Buffer::Allocate(a, cap * row));
    KVCOMP_ASSIGN_OR_RETURN(dev_v, Buffer::Allocate(a, cap * row));
  }
  uint64_t offset = 0;  // kept tokens written so far
  LayerEviction eviction;
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    Buffer kb, vb, qb;
    ScoreSelectCompactArgs args;
    KVCOMP_ASSIGN_OR_RETURN(args.keys, Stage(backend, cache.keys[l], &kb));
    KVCOMP_ASSIGN_OR_RETURN(args.values, Stage(backend, cache.values[l], &vb));
    HeadsView queries;
    if (policy.scorer == Scorer::kSnapKV) {
      KVCOMP_ASSIGN_OR_RETURN(queries, Stage(backend, cache.queries[l], &qb));
    }
    args.score = ScoreParamsFromPolicy(policy, l, queries);
    args.select = select;
    uint32_t* counts = out.kept.data() + uint64_t{l} * heads;
    uint32_t* positions = out.positions.data() + offset;
    if (host) {
      args.kept = {counts, positions};
      args.keys_out = out.keys.data() + offset * row;
      args.values_out = out.values.data() + offset * row;
    } else {
      args.kept = {dev_counts.as<uint32_t>(), dev_idx.as<uint32_t>()};
      args.keys_out = dev_k.data();
      args.values_out = dev_v.data();
    }
    KVCOMP_RETURN_IF_ERROR(Annotate(
        policy.moment_aware ? moments_internal::MomentAwareScoreSelectCompact(backend, args)
                            : backend.scoring().ScoreSelectCompact(args),
        absl::StrFormat("layer %u", l)));
    uint64_t total = 0;
    if (host) {
      for (uint32_t h = 0; h < heads; ++h) total += counts[h];
    } else {
      KVCOMP_RETURN_IF_ERROR(backend.CopyToHost(counts, dev_counts.data(), heads * 4));
      for (uint32_t h = 0; h < heads; ++h) total += counts[h];
      KVCOMP_RETURN_IF_ERROR(backend.CopyToHost(positions, dev_idx.data(), total * 4));
      KVCOMP_RETURN_IF_ERROR(
          backend.CopyToHost(out.keys.data() + offset * row, dev_k.data(), total * row));
      KVCOMP_RETURN_IF_ERROR(
          backend.CopyToHost(out.values.data() + offset * row, dev_v.data(), total * row));
    }
    if (options.on_evict || out.has_moments) {
      eviction.layer = l;
      eviction.keys = args.keys;
      eviction.values = args.values;
      Complement(counts, positions, heads, n, &eviction);
      if (options.on_evict) KVCOMP_RETURN_IF_ERROR(CallHook(options.on_evict, eviction));
      if (out.has_moments) {
        KVCOMP_RETURN_IF_ERROR(Annotate(pipeline_internal::MomentStage(backend, eviction, &out),
                                        absl::StrFormat("moments of layer %u", l)));
      }
    }
    offset += total;
  }
  out.positions.resize(offset);
  out.keys.resize(offset * row);
  out.values.resize(offset * row);
  KVCOMP_RETURN_IF_ERROR(
      pipeline_internal::CodecStage(backend, policy, options.projection.get(), &out));
  return out;
}

absl::StatusOr<std::vector<float>> ScoreLayer(Backend& backend, const HeadsView& keys,
                                              const CompressionPolicy& policy, uint32_t layer,
                                              const HeadsView& queries) {
  KVCOMP_RETURN_IF_ERROR(policy.Validate());
  KVCOMP_RETURN_IF_ERROR(CheckHeadsView(keys, keys.space, "keys"));
  Buffer kb, qb, sb;
  KVCOMP_ASSIGN_OR_RETURN(HeadsView k, Stage(backend, keys, &kb));
  HeadsView q;
  if (policy.scorer == Scorer::kSnapKV) {
    if (queries.data == nullptr) {
      return absl::InvalidArgumentError("snapkv needs the observation window's queries");
    }
    KVCOMP_ASSIGN_OR_RETURN(q, Stage(backend, queries, &qb));
  }
  const uint64_t count = uint64_t{keys.num_heads} * keys.num_tokens;
  std::vector<float> scores(count);
  float* dst = scores.data();
  if (backend.space() != MemorySpace::kHost) {
    KVCOMP_ASSIGN_OR_RETURN(sb, Buffer::Allocate(backend.allocator(), count * sizeof(float)));
    dst = sb.as<float>();
  }
  KVCOMP_RETURN_IF_ERROR(
      backend.scoring().Score(k, ScoreParamsFromPolicy(policy, layer, q), TokenPositions{}, dst));
  if (dst != scores.data()) {
    KVCOMP_RETURN_IF_ERROR(backend.CopyToHost(scores.data(), dst, count * sizeof(float)));
  }
  return scores;
}

}  // namespace kvcomp
