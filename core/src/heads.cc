#include "kvcomp/core/heads.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace {

absl::Status Movable(const CompressedCache& c) {
  if (c.value_codec != ValueCodec::kRaw) {
    return absl::FailedPreconditionError(
        "heads: values encoded by a KVSplice projection are per (layer, kv head) of the "
        "projection; decode them (or keep the heads together) before splitting or merging");
  }
  if (IsPq(c.key_codec)) {
    return absl::FailedPreconditionError(
        "heads: pq keys are coded against a basis per (layer, kv head) of the model's pq "
        "calibration; decode them (or keep the heads together) before splitting or merging");
  }
  return c.Validate();
}

// Where each head's data starts in the ragged arrays of one cache.
struct HeadOffsets {
  std::vector<uint64_t> tokens;      // size num_heads + 1
  std::vector<uint64_t> key_scales;  // size num_heads + 1, in floats
};

HeadOffsets OffsetsOf(const CompressedCache& c) {
  HeadOffsets o;
  o.tokens = c.TokenOffsets();
  o.key_scales.assign(c.kept.size() + 1, 0);
  for (size_t h = 0; h < c.kept.size(); ++h) {
    o.key_scales[h + 1] =
        o.key_scales[h] + KeyScaleGroups(c.key_codec, c.kept[h]) * c.layout.head_dim;
  }
  return o;
}

template <typename T>
void AppendRange(const std::vector<T>& src, uint64_t begin, uint64_t end, std::vector<T>* dst) {
  dst->insert(dst->end(), src.begin() + begin, src.begin() + end);
}

// Appends head h of `src` to `dst` (whose header fields are already set).
void AppendHead(const CompressedCache& src, const HeadOffsets& off, uint64_t h,
                CompressedCache* dst) {
  const uint64_t d = src.layout.head_dim;
  const uint64_t t0 = off.tokens[h], t1 = off.tokens[h + 1];
  dst->kept.push_back(src.kept[h]);
  AppendRange(src.positions, t0, t1, &dst->positions);
  const uint64_t kb = src.KeyTokenBytes(), vb = src.ValueTokenBytes();
  AppendRange(src.keys, t0 * kb, t1 * kb, &dst->keys);
  AppendRange(src.values, t0 * vb, t1 * vb, &dst->values);
  AppendRange(src.key_scales, off.key_scales[h], off.key_scales[h + 1], &dst->key_scales);
  if (src.has_moments) {
    dst->moment_count.push_back(src.moment_count[h]);
    AppendRange(src.moment_key_sum, h * d, (h + 1) * d, &dst->moment_key_sum);
    AppendRange(src.moment_value_sum, h * d, (h + 1) * d, &dst->moment_value_sum);
    AppendRange(src.moment_vk_sum, h * d * d, (h + 1) * d * d, &dst->moment_vk_sum);
  }
}

// `src`'s header with no heads: the arrays are filled head by head.
CompressedCache EmptyLike(const CompressedCache& src, uint32_t kv_heads) {
  CompressedCache c;
  c.layout = src.layout;
  c.layout.num_kv_heads = kv_heads;
  c.layout.num_q_heads = kv_heads * src.layout.group_size();
  c.original_tokens = src.original_tokens;
  c.policy = src.policy;
  c.key_codec = src.key_codec;
  c.value_codec = src.value_codec;
  c.rank = src.rank;
  c.group_size = src.group_size;
  c.projection_version = src.projection_version;
  c.pq_key_basis = src.pq_key_basis;
  c.pq_value_basis = src.pq_value_basis;
  c.pq_key_bits = src.pq_key_bits;
  c.pq_value_bits = src.pq_value_bits;
  c.value_gamma = src.value_gamma;
  c.layer_rank = src.layer_rank;
  c.has_moments = src.has_moments;
  return c;
}

absl::Status SameButHeads(const CompressedCache& a, const CompressedCache& b, size_t i) {
  auto bad = [i](const char* what) {
    return absl::InvalidArgumentError(
        absl::StrFormat("heads: part %u differs from part 0 in its %s", i, what));
  };
  if (a.layout.num_layers != b.layout.num_layers) return bad("layer count");
  if (a.layout.head_dim != b.layout.head_dim) return bad("head_dim");
  if (a.layout.dtype != b.layout.dtype) return bad("dtype");
  if (a.layout.group_size() != b.layout.group_size()) return bad("query heads per kv head");
  if (a.original_tokens != b.original_tokens) return bad("original token count");
  if (!(a.policy == b.policy)) return bad("policy");
  if (a.key_codec != b.key_codec || a.value_codec != b.value_codec) return bad("codecs");
  if (a.group_size != b.group_size) return bad("scale group size");
  if (a.has_moments != b.has_moments) return bad("moments");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CompressedCache> SliceHeads(const CompressedCache& cache, uint32_t begin,
                                           uint32_t end) {
  KVCOMP_RETURN_IF_ERROR(Movable(cache));
  if (begin >= end || end > cache.layout.num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrFormat("heads: range [%u, %u) of %u kv heads", begin,
                                                      end, cache.layout.num_kv_heads));
  }
  const HeadOffsets off = OffsetsOf(cache);
  CompressedCache out = EmptyLike(cache, end - begin);
  for (uint32_t l = 0; l < cache.layout.num_layers; ++l) {
    for (uint32_t kh = begin; kh < end; ++kh) AppendHead(cache, off, cache.head_index(l, kh), &out);
  }
  KVCOMP_RETURN_IF_ERROR(out.Validate());
  return out;
}

absl::StatusOr<std::vector<CompressedCache>> SplitHeads(const CompressedCache& cache,
                                                        uint32_t parts) {
  const uint32_t heads = cache.layout.num_kv_heads;
  if (parts == 0 || heads % parts != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("heads: %u kv heads do not split into %u equal parts", heads, parts));
  }
  std::vector<CompressedCache> out;
  out.reserve(parts);
  const uint32_t n = heads / parts;
  for (uint32_t i = 0; i < parts; ++i) {
    KVCOMP_ASSIGN_OR_RETURN(CompressedCache part, SliceHeads(cache, i * n, (i + 1) * n));
    out.push_back(std::move(part));
  }
  return out;
}

absl::StatusOr<CompressedCache> MergeHeads(absl::Span<const CompressedCache> parts) {
  if (parts.empty()) return absl::InvalidArgumentError("heads: nothing to merge");
  uint64_t heads = 0;
  std::vector<HeadOffsets> offs;
  for (size_t i = 0; i < parts.size(); ++i) {
    KVCOMP_RETURN_IF_ERROR(Movable(parts[i]));
    KVCOMP_RETURN_IF_ERROR(SameButHeads(parts[0], parts[i], i));
    heads += parts[i].layout.num_kv_heads;
    offs.push_back(OffsetsOf(parts[i]));
  }
  if (heads > KvLayout::kMaxKvHeads) {
    return absl::InvalidArgumentError(
        absl::StrFormat("heads: %u kv heads merged, at most %u", heads, KvLayout::kMaxKvHeads));
  }
  CompressedCache out = EmptyLike(parts[0], static_cast<uint32_t>(heads));
  KVCOMP_RETURN_IF_ERROR(out.layout.Validate());
  for (uint32_t l = 0; l < out.layout.num_layers; ++l) {
    for (size_t i = 0; i < parts.size(); ++i) {
      for (uint32_t kh = 0; kh < parts[i].layout.num_kv_heads; ++kh) {
        AppendHead(parts[i], offs[i], parts[i].head_index(l, kh), &out);
      }
    }
  }
  KVCOMP_RETURN_IF_ERROR(out.Validate());
  return out;
}

}  // namespace kvcomp
