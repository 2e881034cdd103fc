#include "kvcomp/core/compressed_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kvcomp/core/format.h"

namespace kvcomp {
namespace {

absl::Status Inconsistent(absl::string_view what, uint64_t got, uint64_t want) {
  return absl::InvalidArgumentError(
      absl::StrFormat("compressed cache: %s has %u elements, expected %u", what, got, want));
}

bool AllFinite(const std::vector<float>& v) {
  for (float x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

}  // namespace

void CompressedCache::Reset(const KvLayout& new_layout, uint64_t tokens) {
  layout = new_layout;
  original_tokens = tokens;
  const uint64_t h = layout.num_heads_total();
  kept.assign(h, 0);
  positions.clear();
  keys.clear();
  values.clear();
  value_scales.clear();
  layer_rank.clear();
  raw_value_rows.clear();
  raw_values.clear();
  key_scales.clear();
  if (key_codec == KeyCodec::kInt8) key_scales.assign(h * layout.head_dim, 0.0f);
  moment_count.clear();
  moment_key_sum.clear();
  moment_value_sum.clear();
  moment_vk_sum.clear();
  if (has_moments) {
    moment_count.assign(h, 0);
    moment_key_sum.assign(h * layout.head_dim, 0.0f);
    moment_value_sum.assign(h * layout.head_dim, 0.0f);
    moment_vk_sum.assign(h * layout.head_dim * layout.head_dim, 0.0f);
  }
}

uint64_t CompressedCache::total_kept() const {
  return std::accumulate(kept.begin(), kept.end(), uint64_t{0});
}

uint64_t CompressedCache::token_offset(uint64_t h) const {
  uint64_t off = 0;
  for (uint64_t i = 0; i < h && i < kept.size(); ++i) off += kept[i];
  return off;
}

std::vector<uint64_t> CompressedCache::TokenOffsets() const {
  std::vector<uint64_t> off(kept.size() + 1, 0);
  for (size_t i = 0; i < kept.size(); ++i) off[i + 1] = off[i] + kept[i];
  return off;
}

absl::Status CompressedCache::WriteDenseKv(uint8_t* out) const {
  if (key_codec != KeyCodec::kRaw || value_codec != ValueCodec::kRaw) {
    return absl::FailedPreconditionError("dense gets need raw codecs");
  }
  const uint64_t T = original_tokens;
  for (uint64_t h = 0; h < num_heads(); ++h) {
    if (kept[h] != T) {
      return absl::FailedPreconditionError(
          absl::StrCat("the cache kept ", kept[h], " of ", T, " tokens in head ", h,
                       ": a dense get needs every token (ratio 0); get the cache instead"));
    }
  }
  const uint64_t row = KeyTokenBytes();
  const uint64_t layer = layout.LayerBytes(T);
  const std::vector<uint64_t> offsets = TokenOffsets();
  for (uint32_t l = 0; l < layout.num_layers; ++l) {
    for (uint32_t kh = 0; kh < layout.num_kv_heads; ++kh) {
      const uint64_t h = head_index(l, kh);
      uint8_t* k = out + l * layer + uint64_t{kh} * T * row;
      uint8_t* v = out + (layout.num_layers + l) * layer + uint64_t{kh} * T * row;
      for (uint64_t i = 0; i < T; ++i) {
        const uint64_t t = offsets[h] + i;
        std::memcpy(k + uint64_t{positions[t]} * row, keys.data() + t * row, row);
        std::memcpy(v + uint64_t{positions[t]} * row, values.data() + t * row, row);
      }
    }
  }
  return absl::OkStatus();
}

uint64_t CompressedCache::KeyTokenBytes() const {
  switch (key_codec) {
    case KeyCodec::kRaw:
      return DTypeBytes(layout.dtype, layout.head_dim);
    case KeyCodec::kFp16:
      return 2ull * layout.head_dim;
    case KeyCodec::kInt8:
      return layout.head_dim;
    case KeyCodec::kInt4:
      return (layout.head_dim + 1ull) / 2;
    case KeyCodec::kHq4:
    case KeyCodec::kHq3:
      return 4 + uint64_t{layout.head_dim} * HqBits(key_codec) / 8;
    case KeyCodec::kPq:
      return (uint64_t{pq_key_bits} + 7) / 8;
  }
  return 0;
}

uint64_t CompressedCache::KeyScaleOffset(uint64_t h) const {
  uint64_t groups = 0;
  for (uint64_t i = 0; i < h && i < kept.size(); ++i) groups += KeyScaleGroups(key_codec, kept[i]);
  return groups * layout.head_dim;
}

namespace {

uint64_t LatentTokenBytes(ValueCodec codec, const KvLayout& layout, uint32_t r,
                          uint32_t pq_bits) {
  switch (codec) {
    case ValueCodec::kRaw:
      return DTypeBytes(layout.dtype, layout.head_dim);
    case ValueCodec::kOrthogonal:
      return 2ull * r;
    case ValueCodec::kOrthogonalInt8:
      return r;
    case ValueCodec::kOrthogonalInt4:
      return (r + 1ull) / 2;
    case ValueCodec::kHq4:
    case ValueCodec::kHq3:
      return 4 + uint64_t{layout.head_dim} * HqBits(codec) / 8;
    case ValueCodec::kPq:
      return (uint64_t{pq_bits} + 7) / 8;
  }
  return 0;
}

uint64_t LatentGroups(ValueCodec codec, uint32_t group_size, uint32_t r) {
  if (codec != ValueCodec::kOrthogonalInt8 && codec != ValueCodec::kOrthogonalInt4) return 0;
  return group_size == 0 ? 0 : (uint64_t{r} + group_size - 1) / group_size;
}

}  // namespace

uint64_t CompressedCache::ValueTokenBytes() const {
  return LatentTokenBytes(value_codec, layout, rank, pq_value_bits);
}

uint64_t CompressedCache::ValueGroups() const {
  return LatentGroups(value_codec, group_size, rank);
}

uint64_t CompressedCache::ValueTokenBytes(uint32_t layer) const {
  return LatentTokenBytes(value_codec, layout, LayerRank(layer), pq_value_bits);
}

uint64_t CompressedCache::ValueGroups(uint32_t layer) const {
  return LatentGroups(value_codec, group_size, LayerRank(layer));
}

namespace {

// Sum over heads of kept[h] x per_token(layer of h).
template <typename PerToken>
uint64_t SumOverHeads(const CompressedCache& c, PerToken per_token) {
  uint64_t n = 0;
  for (uint64_t h = 0; h < c.kept.size(); ++h) {
    n += c.kept[h] * per_token(static_cast<uint32_t>(h / c.layout.num_kv_heads));
  }
  return n;
}

}  // namespace

uint64_t CompressedCache::ValueBytes() const {
  if (layer_rank.empty()) return total_kept() * ValueTokenBytes();
  return SumOverHeads(*this, [this](uint32_t l) { return ValueTokenBytes(l); });
}

uint64_t CompressedCache::ValueScaleCount() const {
  if (layer_rank.empty()) return total_kept() * ValueGroups();
  return SumOverHeads(*this, [this](uint32_t l) { return ValueGroups(l); });
}

absl::Status CompressedCache::Validate() const {
  if (absl::Status s = layout.Validate(); !s.ok()) return s;
  if (original_tokens > KvLayout::kMaxTokens) {
    return absl::InvalidArgumentError(
        absl::StrFormat("compressed cache: original_tokens %u exceeds %u", original_tokens,
                        KvLayout::kMaxTokens));
  }
  if (static_cast<uint8_t>(key_codec) > kMaxKeyCodec ||
      static_cast<uint8_t>(value_codec) > kMaxValueCodec) {
    return absl::InvalidArgumentError("compressed cache: unknown codec");
  }
  if (HqBits(key_codec) != 0 || HqBits(value_codec) != 0) {
    const uint32_t d = layout.head_dim;
    if ((d & (d - 1)) != 0 || d < 8 || d > 256) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "compressed cache: the hq codecs need a head_dim that is a power of two in [8, 256], "
          "got %u",
          d));
    }
  }
  {
    // pq: each pq tensor names its basis and bits, the cache the calibration (never beside a
    // KVSplice projection); a tensor of another codec carries neither.
    const uint64_t max_bits = uint64_t{8} * layout.head_dim;
    const bool kpq = IsPq(key_codec), vpq = IsPq(value_codec);
    if (kpq != (pq_key_basis != 0) || kpq != (pq_key_bits != 0) ||
        vpq != (pq_value_basis != 0) || vpq != (pq_value_bits != 0)) {
      return absl::InvalidArgumentError(
          "compressed cache: pq basis and bits must be set exactly for the pq codecs");
    }
    if (pq_key_bits > max_bits || pq_value_bits > max_bits) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "compressed cache: pq bits per row %u / %u beyond 8 x head_dim %u", pq_key_bits,
          pq_value_bits, layout.head_dim));
    }
    if ((kpq || vpq) && (projection_version == 0 || IsProjectionCodec(value_codec))) {
      return absl::InvalidArgumentError(
          "compressed cache: pq codecs need the pq calibration's version and no projection "
          "codec");
    }
  }
  if (HqBits(value_codec) != 0 || IsPq(value_codec)) {
    if (rank != 0 || (!IsPq(key_codec) && !IsPq(value_codec) && projection_version != 0) ||
        !layer_rank.empty() || value_gamma) {
      return absl::InvalidArgumentError(
          "compressed cache: hq and pq values carry no rank, projection version or gamma");
    }
  } else if (value_codec == ValueCodec::kRaw) {
    if (rank != 0 || (!IsPq(key_codec) && projection_version != 0)) {
      return absl::InvalidArgumentError(
          "compressed cache: raw values carry no rank or projection version");
    }
  } else {
    if (rank == 0 || rank > layout.head_dim) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "compressed cache: rank %u outside [1, head_dim %u]", rank, layout.head_dim));
    }
    if (value_codec == ValueCodec::kOrthogonalInt4 && rank % 2 != 0) {
      return absl::InvalidArgumentError("compressed cache: int4 latents need an even rank");
    }
    if (projection_version == 0) {
      return absl::InvalidArgumentError("compressed cache: encoded values name no projection");
    }
  }
  if (!layer_rank.empty()) {
    if (value_codec == ValueCodec::kRaw) {
      return absl::InvalidArgumentError("compressed cache: raw values carry no layer ranks");
    }
    if (layer_rank.size() != layout.num_layers) {
      return Inconsistent("layer_rank", layer_rank.size(), layout.num_layers);
    }
    uint32_t largest = 0;
    for (uint32_t r : layer_rank) {
      if (r == 0 || r > rank) {
        return absl::InvalidArgumentError(
            absl::StrFormat("compressed cache: layer rank %u outside [1, rank %u]", r, rank));
      }
      if (value_codec == ValueCodec::kOrthogonalInt4 && r % 2 != 0) {
        return absl::InvalidArgumentError("compressed cache: int4 latents need even layer ranks");
      }
      largest = std::max(largest, r);
    }
    if (largest != rank) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "compressed cache: rank %u is not the largest layer rank %u", rank, largest));
    }
  }
  if (value_gamma && ValueGroups() == 0) {
    return absl::InvalidArgumentError(
        "compressed cache: gamma-aware latents need an int8 or int4 value codec");
  }
  if (ValueGroups() > 0 && (group_size == 0 || group_size > 256)) {
    return absl::InvalidArgumentError("compressed cache: group_size outside [1, 256]");
  }
  const uint64_t h = num_heads();
  const uint64_t d = layout.head_dim;
  if (kept.size() != h) return Inconsistent("kept", kept.size(), h);
  uint64_t total = 0;
  for (uint64_t i = 0; i < h; ++i) {
    if (kept[i] > original_tokens) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "compressed cache: head %u keeps %u of %u tokens", i, kept[i], original_tokens));
    }
    total += kept[i];
  }
  if (positions.size() != total) return Inconsistent("positions", positions.size(), total);
  uint64_t off = 0;
  for (uint64_t i = 0; i < h; ++i) {
    for (uint64_t j = 0; j < kept[i]; ++j) {
      const uint32_t p = positions[off + j];
      if (p >= original_tokens || (j > 0 && p <= positions[off + j - 1])) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "compressed cache: head %u positions not ascending within [0, %u)", i,
            original_tokens));
      }
    }
    off += kept[i];
  }
  if (keys.size() != total * KeyTokenBytes()) {
    return Inconsistent("keys (bytes)", keys.size(), total * KeyTokenBytes());
  }
  const uint64_t want_key_scales = KeyScaleCount();
  if (key_scales.size() != want_key_scales) {
    return Inconsistent("key_scales", key_scales.size(), want_key_scales);
  }
  if (values.size() != ValueBytes()) {
    return Inconsistent("values (bytes)", values.size(), ValueBytes());
  }
  if (value_scales.size() != ValueScaleCount()) {
    return Inconsistent("value_scales", value_scales.size(), ValueScaleCount());
  }
  if (!raw_value_rows.empty() && !IsProjectionCodec(value_codec)) {
    return absl::InvalidArgumentError(
        "compressed cache: raw value rows belong to the projection codecs only");
  }
  for (size_t i = 0; i < raw_value_rows.size(); ++i) {
    if (raw_value_rows[i] >= total || (i > 0 && raw_value_rows[i] <= raw_value_rows[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrFormat("compressed cache: raw value rows not ascending within [0, %u)", total));
    }
  }
  const uint64_t raw_row_bytes = DTypeBytes(layout.dtype, d);
  if (raw_values.size() != raw_value_rows.size() * raw_row_bytes) {
    return Inconsistent("raw_values (bytes)", raw_values.size(),
                        raw_value_rows.size() * raw_row_bytes);
  }
  if (!AllFinite(key_scales)) {
    return absl::InvalidArgumentError("compressed cache: non-finite key scale");
  }
  for (uint16_t s : value_scales) {
    if ((s & 0x7c00u) == 0x7c00u) {
      return absl::InvalidArgumentError("compressed cache: non-finite value scale");
    }
  }
  // Hadamard rows: each record's f16 minimum and step finite, the step not negative.
  auto check_hq = [](const std::vector<uint8_t>& rows, uint64_t row_bytes,
                     absl::string_view what) -> absl::Status {
    for (uint64_t at = 0; at + 4 <= rows.size(); at += row_bytes) {
      const uint16_t lo = static_cast<uint16_t>(rows[at] | (rows[at + 1] << 8));
      const uint16_t step = static_cast<uint16_t>(rows[at + 2] | (rows[at + 3] << 8));
      if ((lo & 0x7c00u) == 0x7c00u || (step & 0x7c00u) == 0x7c00u || (step & 0x8000u) != 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "compressed cache: hq %s row %u has minimum 0x%04x, step 0x%04x (finite halves, "
            "step >= +0)",
            what, at / row_bytes, lo, step));
      }
    }
    return absl::OkStatus();
  };
  if (HqBits(key_codec) != 0) {
    if (absl::Status s = check_hq(keys, KeyTokenBytes(), "key"); !s.ok()) return s;
  }
  // pq records: the bits after a row's codes are zero (every byte of a record is covered).
  auto check_pq = [](const std::vector<uint8_t>& rows, uint32_t bits,
                     absl::string_view what) -> absl::Status {
    const uint64_t row_bytes = (uint64_t{bits} + 7) / 8;
    if (bits % 8 == 0 || row_bytes == 0) return absl::OkStatus();
    const uint8_t spare = static_cast<uint8_t>(0xffu << (bits % 8));
    for (uint64_t at = row_bytes - 1; at < rows.size(); at += row_bytes) {
      if ((rows[at] & spare) != 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "compressed cache: pq %s row %u has bits set after its %u bits of codes", what,
            at / row_bytes, bits));
      }
    }
    return absl::OkStatus();
  };
  if (IsPq(key_codec)) {
    if (absl::Status s = check_pq(keys, pq_key_bits, "key"); !s.ok()) return s;
  }
  if (IsPq(value_codec)) {
    if (absl::Status s = check_pq(values, pq_value_bits, "value"); !s.ok()) return s;
  }
  if (HqBits(value_codec) != 0) {
    if (absl::Status s = check_hq(values, ValueTokenBytes(), "value"); !s.ok()) return s;
  }
  if (!AllFinite(moment_key_sum) || !AllFinite(moment_value_sum) || !AllFinite(moment_vk_sum)) {
    return absl::InvalidArgumentError("compressed cache: non-finite moment sum");
  }
  if (has_moments) {
    if (moment_count.size() != h) return Inconsistent("moment_count", moment_count.size(), h);
    if (moment_key_sum.size() != h * d) {
      return Inconsistent("moment_key_sum", moment_key_sum.size(), h * d);
    }
    if (moment_value_sum.size() != h * d) {
      return Inconsistent("moment_value_sum", moment_value_sum.size(), h * d);
    }
    if (moment_vk_sum.size() != h * d * d) {
      return Inconsistent("moment_vk_sum", moment_vk_sum.size(), h * d * d);
    }
    for (uint64_t i = 0; i < h; ++i) {
      if (moment_count[i] + kept[i] != original_tokens) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "compressed cache: head %u keeps %u and summarises %u tokens, but the sequence has %u",
            i, kept[i], moment_count[i], original_tokens));
      }
    }
  } else if (!moment_count.empty() || !moment_key_sum.empty() || !moment_value_sum.empty() ||
             !moment_vk_sum.empty()) {
    return absl::InvalidArgumentError("compressed cache: moments present but has_moments unset");
  }
  return absl::OkStatus();
}

CacheBytes CompressedCache::Breakdown() const {
  CacheBytes b;
  b.positions = positions.size() * sizeof(uint32_t);
  b.keys = keys.size();
  b.key_scales = key_scales.size() * sizeof(float);
  b.values = values.size();
  b.value_scales = value_scales.size() * sizeof(uint16_t);
  b.raw_values = raw_value_rows.size() * sizeof(uint64_t) + raw_values.size();
  b.moments = moment_count.size() * sizeof(uint64_t) +
              (moment_key_sum.size() + moment_value_sum.size() + moment_vk_sum.size()) *
                  sizeof(float);
  auto total = format::EncodedSize(*this);
  b.header = total.ok() ? *total - b.total() : 0;
  return b;
}

std::string CompressedCache::DebugString() const {
  return absl::StrFormat(
      "CompressedCache{%s original_tokens=%u kept=%u key_codec=%s value_codec=%s rank=%u%s "
      "projection=%u moments=%d}",
      layout.DebugString(), original_tokens, total_kept(), KeyCodecName(key_codec),
      ValueCodecName(value_codec), rank,
      layer_rank.empty() ? "" : absl::StrCat(" layer_rank=", absl::StrJoin(layer_rank, ",")),
      projection_version, has_moments);
}

bool operator==(const CompressedCache& a, const CompressedCache& b) {
  return a.layout == b.layout && a.original_tokens == b.original_tokens && a.policy == b.policy &&
         a.key_codec == b.key_codec && a.value_codec == b.value_codec && a.rank == b.rank &&
         (a.ValueGroups() == 0 || a.group_size == b.group_size) &&
         a.projection_version == b.projection_version && a.pq_key_basis == b.pq_key_basis &&
         a.pq_value_basis == b.pq_value_basis && a.pq_key_bits == b.pq_key_bits &&
         a.pq_value_bits == b.pq_value_bits && a.value_gamma == b.value_gamma &&
         a.layer_rank == b.layer_rank && a.raw_value_rows == b.raw_value_rows &&
         a.raw_values == b.raw_values && a.kept == b.kept && a.positions == b.positions &&
         a.keys == b.keys && a.key_scales == b.key_scales && a.values == b.values &&
         a.value_scales == b.value_scales && a.has_moments == b.has_moments &&
         a.moment_count == b.moment_count && a.moment_key_sum == b.moment_key_sum &&
         a.moment_value_sum == b.moment_value_sum && a.moment_vk_sum == b.moment_vk_sum;
}

}  // namespace kvcomp
