#include "kvcomp/core/format.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "absl/strings/str_format.h"
#include "kvcomp/core/byte_coder.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace format {
namespace {

// Header field offsets (docs/format.md).
enum HeaderOffset : uint32_t {
  kOffMagic = 0,
  kOffMajor = 4,
  kOffMinor = 6,
  kOffHeaderBytes = 8,
  kOffFlags = 12,
  kOffTotalBytes = 16,
  kOffLayers = 24,
  kOffKvHeads = 28,
  kOffQHeads = 32,
  kOffHeadDim = 36,
  kOffDType = 40,
  kOffKeyCodec = 41,
  kOffValueCodec = 42,
  kOffRank = 44,
  kOffGroupSize = 48,
  kOffNumSections = 52,
  kOffOriginalTokens = 56,
  kOffTotalKept = 64,
  kOffProjection = 72,
  kOffTableCrc = 80,
  kOffPqKeyBasis = 84,    // 1.5: pq keys' basis fingerprint, else 0
  kOffPqValueBasis = 92,  // 1.5: pq values' basis fingerprint, else 0
  kOffPqKeyBits = 100,    // 1.5: pq keys' bits per row, else 0
  kOffPqValueBits = 104,  // 1.5: pq values' bits per row, else 0
  kOffReserved = 108,     // 108..123 zero
  kOffHeaderCrc = 124,
};
constexpr uint32_t kFlagMoments = 1;
constexpr uint32_t kFlagValueGamma = 2;  // latents divided by the projection's gamma
constexpr uint32_t kMaxSections = 64;

using byte_coder::LoadLe;
using byte_coder::StoreLe;

bool AllZero(const uint8_t* p, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

uint64_t AlignUp(uint64_t x) { return (x + kAlignment - 1) / kAlignment * kAlignment; }

// Multiplies with overflow detection; false on overflow.
bool MulOk(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

absl::Status Truncated(absl::string_view what, uint64_t need, uint64_t have) {
  return absl::DataLossError(absl::StrFormat(
      "cache format: truncated: %s needs %u bytes, %u present", what, need, have));
}

// ---- policy TLV: one record per field of policy_fields.def ----
// How a declared type is stored: enums as their number and booleans as 0/1 in one byte,
// numbers as themselves (little-endian).
template <typename T>
using TlvWire = std::conditional_t<std::is_enum_v<T> || std::is_same_v<T, bool>, uint8_t, T>;

template <typename T>
TlvWire<T> ToTlv(T v) {
  return static_cast<TlvWire<T>>(v);
}

template <typename T>
T FromTlv(TlvWire<T> w) {
  if constexpr (std::is_same_v<T, bool>) {
    return w != 0;
  } else {
    return static_cast<T>(w);
  }
}

constexpr uint16_t MaxPolicyTag() {
  uint16_t max = 0;
#define KVCOMP_POLICY_FIELD(name, type, tlv_tag, thrift_id, default_value, range, unit, doc) \
  max = max > (tlv_tag) ? max : (tlv_tag);
#include "kvcomp/core/policy_fields.def"
#undef KVCOMP_POLICY_FIELD
  return max;
}

class TlvWriter {
 public:
  template <typename T>
  void Add(uint16_t tag, T v) {
    const size_t at = out_.size();
    out_.resize(at + 4 + sizeof(T));
    StoreLe<uint16_t>(out_.data(), at, tag);
    StoreLe<uint16_t>(out_.data(), at + 2, sizeof(T));
    StoreLe<T>(out_.data(), at + 4, v);
  }
  std::vector<uint8_t> Take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

// Records in tag order, whatever the declaration's order (a duplicate tag does not compile).
std::vector<uint8_t> EncodePolicy(const CompressionPolicy& p) {
  TlvWriter w;
  for (uint16_t tag = 1; tag <= MaxPolicyTag(); ++tag) {
    switch (tag) {
#define KVCOMP_POLICY_FIELD(name, type, tlv_tag, thrift_id, default_value, range, unit, doc) \
  case tlv_tag:                                                                              \
    w.Add<TlvWire<type>>(tlv_tag, ToTlv<type>(p.name));                                      \
    break;
#include "kvcomp/core/policy_fields.def"
#undef KVCOMP_POLICY_FIELD
      default:
        break;  // a retired tag
    }
  }
  return w.Take();
}

// Absent records keep the field's absent value (AbsentFieldPolicy: what a writer that did not
// write the tag meant, which is not always today's default); unknown tags are skipped (a newer
// writer's field: docs/format.md, "Compatibility").
absl::StatusOr<CompressionPolicy> DecodePolicy(const uint8_t* p, uint64_t n) {
  CompressionPolicy pol = AbsentFieldPolicy();
  uint64_t at = 0;
  while (at < n) {
    if (n - at < 4) return absl::InvalidArgumentError("cache format: policy record truncated");
    const uint16_t tag = LoadLe<uint16_t>(p, at);
    const uint16_t len = LoadLe<uint16_t>(p, at + 2);
    at += 4;
    if (n - at < len) return absl::InvalidArgumentError("cache format: policy value truncated");
    const uint8_t* v = p + at;
    at += len;
    auto want = [&](size_t size) -> absl::Status {
      if (len == size) return absl::OkStatus();
      return absl::InvalidArgumentError(
          absl::StrFormat("cache format: policy tag %u has %u bytes, expected %u", tag, len, size));
    };
    switch (tag) {
#define KVCOMP_POLICY_FIELD(name, type, tlv_tag, thrift_id, default_value, range, unit, doc) \
  case tlv_tag:                                                                              \
    KVCOMP_RETURN_IF_ERROR(want(sizeof(TlvWire<type>)));                                     \
    pol.name = FromTlv<type>(LoadLe<TlvWire<type>>(v, 0));                                      \
    break;
#include "kvcomp/core/policy_fields.def"
#undef KVCOMP_POLICY_FIELD
      default:
        break;
    }
  }
  if (absl::Status s = pol.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache format: stored policy invalid: ", s.message()));
  }
  return pol;
}

struct Section {
  uint32_t id;
  const void* data;
  uint64_t size;
};

std::vector<Section> SectionsOf(const CompressedCache& c, const std::string& policy) {
  std::vector<Section> s;
  s.push_back({kHeads, c.kept.data(), c.kept.size() * sizeof(uint32_t)});
  s.push_back({kPolicy, policy.data(), policy.size()});
  s.push_back({kPositions, c.positions.data(), c.positions.size() * sizeof(uint32_t)});
  s.push_back({kKeys, c.keys.data(), c.keys.size()});
  if (c.key_codec == KeyCodec::kInt8 || c.key_codec == KeyCodec::kInt4) {
    s.push_back({kKeyScales, c.key_scales.data(), c.key_scales.size() * sizeof(float)});
  }
  s.push_back({kValues, c.values.data(), c.values.size()});
  if (c.ValueGroups() > 0) {
    s.push_back({kValueScales, c.value_scales.data(), c.value_scales.size() * sizeof(uint16_t)});
  }
  if (c.has_moments) {
    s.push_back({kMomentCount, c.moment_count.data(), c.moment_count.size() * sizeof(uint64_t)});
    s.push_back({kMomentKeySum, c.moment_key_sum.data(), c.moment_key_sum.size() * sizeof(float)});
    s.push_back(
        {kMomentValueSum, c.moment_value_sum.data(), c.moment_value_sum.size() * sizeof(float)});
    s.push_back({kMomentVkSum, c.moment_vk_sum.data(), c.moment_vk_sum.size() * sizeof(float)});
  }
  if (!c.layer_rank.empty()) {
    s.push_back({kLayerRanks, c.layer_rank.data(), c.layer_rank.size() * sizeof(uint32_t)});
  }
  if (!c.raw_value_rows.empty()) {
    s.push_back(
        {kRawValueRows, c.raw_value_rows.data(), c.raw_value_rows.size() * sizeof(uint64_t)});
    s.push_back({kRawValues, c.raw_values.data(), c.raw_values.size()});
  }
  return s;
}

// The sections' ids and sizes from the counts alone, in table order (SectionsOf's order).
std::vector<SectionSpan> SectionSizes(const CompressedCache& c, uint64_t policy_bytes,
                                      uint64_t raw_rows) {
  const uint64_t h = c.num_heads(), d = c.layout.head_dim, t = c.total_kept();
  std::vector<SectionSpan> s;
  s.push_back({kHeads, 0, h * sizeof(uint32_t)});
  s.push_back({kPolicy, 0, policy_bytes});
  s.push_back({kPositions, 0, t * sizeof(uint32_t)});
  s.push_back({kKeys, 0, t * c.KeyTokenBytes()});
  if (c.key_codec == KeyCodec::kInt8 || c.key_codec == KeyCodec::kInt4) {
    s.push_back({kKeyScales, 0, c.KeyScaleCount() * sizeof(float)});
  }
  s.push_back({kValues, 0, c.ValueBytes()});
  if (c.ValueGroups() > 0) {
    s.push_back({kValueScales, 0, c.ValueScaleCount() * sizeof(uint16_t)});
  }
  if (c.has_moments) {
    s.push_back({kMomentCount, 0, h * sizeof(uint64_t)});
    s.push_back({kMomentKeySum, 0, h * d * sizeof(float)});
    s.push_back({kMomentValueSum, 0, h * d * sizeof(float)});
    s.push_back({kMomentVkSum, 0, h * d * d * sizeof(float)});
  }
  if (!c.layer_rank.empty()) {
    s.push_back({kLayerRanks, 0, c.layer_rank.size() * sizeof(uint32_t)});
  }
  if (raw_rows > 0) {
    s.push_back({kRawValueRows, 0, raw_rows * sizeof(uint64_t)});
    s.push_back({kRawValues, 0, raw_rows * DTypeBytes(c.layout.dtype, d)});
  }
  return s;
}

// Parsed view of the fixed header and the section table.
struct Parsed {
  CacheInfo info;
  uint32_t group_size = 0;
  struct Entry {
    uint32_t id, flags;
    uint64_t offset, size;
  };
  std::vector<Entry> entries;
};

// `bytes` is the whole encoding of `n` bytes, or, without `sections`, its first bytes through
// the section table (the sections are then neither read nor checked).
absl::StatusOr<Parsed> ParseHeaderAndTable(absl::string_view bytes, uint64_t n, bool sections) {
  const auto* b = reinterpret_cast<const uint8_t*>(bytes.data());
  const uint64_t have = bytes.size();
  if (have < kHeaderBytes) return Truncated("the fixed header", kHeaderBytes, have);
  if (LoadLe<uint32_t>(b, kOffMagic) != kMagic) {
    return absl::InvalidArgumentError("cache format: bad magic (not a kvcomp compressed cache)");
  }
  const uint16_t major = LoadLe<uint16_t>(b, kOffMajor);
  const uint16_t minor = LoadLe<uint16_t>(b, kOffMinor);
  if (major > kMajorVersion) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cache format: version %u.%u is newer than this reader (%u.%u)", major, minor,
        kMajorVersion, kMinorVersion));
  }
  if (major == 0) return absl::InvalidArgumentError("cache format: version 0 is invalid");
  if (Crc32c(b, kOffHeaderCrc) != LoadLe<uint32_t>(b, kOffHeaderCrc)) {
    return absl::DataLossError("cache format: header checksum mismatch");
  }
  if (LoadLe<uint32_t>(b, kOffHeaderBytes) != kHeaderBytes) {
    return absl::InvalidArgumentError("cache format: header size is not 128");
  }
  for (uint32_t off = kOffReserved; off < kOffHeaderCrc; ++off) {
    if (b[off] != 0) return absl::InvalidArgumentError("cache format: reserved header bytes set");
  }
  if (b[43] != 0) return absl::InvalidArgumentError("cache format: reserved header byte set");
  Parsed p;
  CacheInfo& info = p.info;
  const uint32_t flags = LoadLe<uint32_t>(b, kOffFlags);
  if ((flags & ~(kFlagMoments | kFlagValueGamma)) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat("cache format: unknown flags 0x%x", flags));
  }
  info.has_moments = (flags & kFlagMoments) != 0;
  info.value_gamma = (flags & kFlagValueGamma) != 0;
  info.total_bytes = LoadLe<uint64_t>(b, kOffTotalBytes);
  if (info.total_bytes != n) {
    if (info.total_bytes > n) return Truncated("the cache", info.total_bytes, n);
    return absl::DataLossError(absl::StrFormat(
        "cache format: %u bytes given, header says %u", n, info.total_bytes));
  }
  info.layout.num_layers = LoadLe<uint32_t>(b, kOffLayers);
  info.layout.num_kv_heads = LoadLe<uint32_t>(b, kOffKvHeads);
  info.layout.num_q_heads = LoadLe<uint32_t>(b, kOffQHeads);
  info.layout.head_dim = LoadLe<uint32_t>(b, kOffHeadDim);
  const uint8_t dtype = b[kOffDType], kc = b[kOffKeyCodec], vc = b[kOffValueCodec];
  if (!IsValidDType(dtype)) return absl::InvalidArgumentError("cache format: unknown dtype");
  info.layout.dtype = static_cast<DType>(dtype);
  KVCOMP_RETURN_IF_ERROR(Annotate(info.layout.Validate(), "cache format"));
  if (kc > kMaxKeyCodec || vc > kMaxValueCodec) {
    return absl::InvalidArgumentError("cache format: unknown key or value codec");
  }
  info.key_codec = static_cast<KeyCodec>(kc);
  info.value_codec = static_cast<ValueCodec>(vc);
  info.rank = LoadLe<uint32_t>(b, kOffRank);
  p.group_size = LoadLe<uint32_t>(b, kOffGroupSize);
  info.original_tokens = LoadLe<uint64_t>(b, kOffOriginalTokens);
  info.total_kept = LoadLe<uint64_t>(b, kOffTotalKept);
  info.projection_version = LoadLe<uint64_t>(b, kOffProjection);
  info.pq_key_basis = LoadLe<uint64_t>(b, kOffPqKeyBasis);
  info.pq_value_basis = LoadLe<uint64_t>(b, kOffPqValueBasis);
  info.pq_key_bits = LoadLe<uint32_t>(b, kOffPqKeyBits);
  info.pq_value_bits = LoadLe<uint32_t>(b, kOffPqValueBits);
  {
    const bool kpq = IsPq(info.key_codec), vpq = IsPq(info.value_codec);
    const uint64_t max_bits = uint64_t{8} * info.layout.head_dim;
    if (kpq != (info.pq_key_basis != 0) || kpq != (info.pq_key_bits != 0) ||
        vpq != (info.pq_value_basis != 0) || vpq != (info.pq_value_bits != 0) ||
        info.pq_key_bits > max_bits || info.pq_value_bits > max_bits) {
      return absl::InvalidArgumentError(
          "cache format: pq basis or bits fields do not match the codecs");
    }
    if ((kpq || vpq) && (info.projection_version == 0 || IsProjectionCodec(info.value_codec))) {
      return absl::InvalidArgumentError(
          "cache format: pq codecs without their calibration version, or beside a projection");
    }
  }
  if (info.original_tokens > KvLayout::kMaxTokens) {
    return absl::InvalidArgumentError("cache format: original_tokens beyond the limit");
  }
  uint64_t max_kept;
  if (!MulOk(info.original_tokens, info.layout.num_heads_total(), &max_kept) ||
      info.total_kept > max_kept) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cache format: total_kept %u exceeds heads x original tokens", info.total_kept));
  }
  const uint32_t num_sections = LoadLe<uint32_t>(b, kOffNumSections);
  if (num_sections == 0 || num_sections > kMaxSections) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cache format: %u sections (1..%u allowed)", num_sections, kMaxSections));
  }
  const uint64_t table_end = kHeaderBytes + uint64_t{kSectionEntryBytes} * num_sections;
  if (table_end > have) return Truncated("the section table", table_end, have);
  if (Crc32c(b + kHeaderBytes, table_end - kHeaderBytes) != LoadLe<uint32_t>(b, kOffTableCrc)) {
    return absl::DataLossError("cache format: section table checksum mismatch");
  }
  uint64_t prev_end = table_end;
  uint32_t prev_id = 0;
  for (uint32_t i = 0; i < num_sections; ++i) {
    const uint8_t* e = b + kHeaderBytes + uint64_t{kSectionEntryBytes} * i;
    Parsed::Entry en{LoadLe<uint32_t>(e, 0), LoadLe<uint32_t>(e, 4), LoadLe<uint64_t>(e, 8),
                     LoadLe<uint64_t>(e, 16)};
    if (en.id <= prev_id) {
      return absl::InvalidArgumentError("cache format: section ids not strictly ascending");
    }
    if (en.offset % kAlignment != 0 || en.offset < prev_end || en.offset > n ||
        en.size > n - en.offset) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "cache format: section %u at [%u, +%u) is misaligned, overlapping or out of bounds",
          en.id, en.offset, en.size));
    }
    if ((en.flags & ~kSectionRequired) != 0 || LoadLe<uint32_t>(e, 28) != 0) {
      return absl::InvalidArgumentError("cache format: section entry has reserved bits set");
    }
    if (sections && Crc32c(b + en.offset, en.size) != LoadLe<uint32_t>(e, 24)) {
      return absl::DataLossError(absl::StrFormat("cache format: section %u checksum mismatch", en.id));
    }
    if (en.id > kRawValues && (en.flags & kSectionRequired)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "cache format: required section %u unknown to this reader", en.id));
    }
    if (sections && !AllZero(b + prev_end, en.offset - prev_end)) {
      return absl::InvalidArgumentError("cache format: non-zero padding before a section");
    }
    prev_end = en.offset + en.size;
    prev_id = en.id;
    if (en.id == kLayerRanks) p.info.layer_ranks = true;
    if (en.id == kRawValueRows) p.info.raw_value_rows = en.size / sizeof(uint64_t);
    p.entries.push_back(en);
  }
  if (sections && !AllZero(b + prev_end, n - prev_end)) {
    return absl::InvalidArgumentError("cache format: non-zero bytes after the last section");
  }
  return p;
}

// Copies section `id` into `out` (resized), checking its size is `want_bytes`.
template <typename T>
absl::Status TakeSection(const Parsed& p, absl::string_view bytes, uint32_t id, bool present,
                         uint64_t want_elems, std::vector<T>* out) {
  const Parsed::Entry* e = nullptr;
  for (const auto& en : p.entries) {
    if (en.id == id) e = &en;
  }
  if (!present) {
    if (e != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("cache format: section %u present but the header does not use it", id));
    }
    out->clear();
    return absl::OkStatus();
  }
  if (e == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("cache format: section %u missing", id));
  }
  uint64_t want_bytes;
  if (!MulOk(want_elems, sizeof(T), &want_bytes) || e->size != want_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cache format: section %u has %u bytes, the counts need %u", id, e->size, want_bytes));
  }
  out->resize(want_elems);
  if (want_bytes > 0) std::memcpy(out->data(), bytes.data() + e->offset, want_bytes);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<EncodingPlan> PlanEncoding(const CompressedCache& shape, uint64_t raw_value_rows) {
  KVCOMP_RETURN_IF_ERROR(Annotate(shape.layout.Validate(), "cache format"));
  if (shape.kept.size() != shape.num_heads()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cache format: %u kept counts for %u heads", shape.kept.size(), shape.num_heads()));
  }
  if (!shape.layer_rank.empty() && shape.layer_rank.size() != shape.layout.num_layers) {
    return absl::InvalidArgumentError("cache format: layer ranks do not match the layer count");
  }
  if (raw_value_rows > 0 &&
      (!IsProjectionCodec(shape.value_codec) || raw_value_rows > shape.total_kept())) {
    return absl::InvalidArgumentError(
        "cache format: raw value rows with raw values or beyond the kept tokens");
  }
  EncodingPlan plan;
  plan.policy = EncodePolicyRecords(shape.policy);
  plan.sections = SectionSizes(shape, plan.policy.size(), raw_value_rows);
  uint64_t at = AlignUp(plan.table_end());
  for (SectionSpan& sec : plan.sections) {
    sec.offset = at;
    at = AlignUp(at + sec.size);
  }
  plan.total_bytes = at;
  return plan;
}

absl::Status WriteHeaderAndTable(const CompressedCache& cache, const EncodingPlan& plan,
                                 absl::Span<const uint32_t> section_crcs,
                                 absl::Span<uint8_t> out) {
  const std::vector<SectionSpan>& sections = plan.sections;
  if (section_crcs.size() != sections.size() || out.size() < plan.table_end()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cache format: %u checksums and %u bytes for a table of %u sections",
        section_crcs.size(), out.size(), sections.size()));
  }
  uint8_t* b = out.data();
  std::memset(b, 0, plan.table_end());
  StoreLe<uint32_t>(b, kOffMagic, kMagic);
  StoreLe<uint16_t>(b, kOffMajor, kMajorVersion);
  StoreLe<uint16_t>(b, kOffMinor, kMinorVersion);
  StoreLe<uint32_t>(b, kOffHeaderBytes, kHeaderBytes);
  StoreLe<uint32_t>(b, kOffFlags, (cache.has_moments ? kFlagMoments : 0) |
                                 (cache.value_gamma ? kFlagValueGamma : 0));
  StoreLe<uint64_t>(b, kOffTotalBytes, plan.total_bytes);
  StoreLe<uint32_t>(b, kOffLayers, cache.layout.num_layers);
  StoreLe<uint32_t>(b, kOffKvHeads, cache.layout.num_kv_heads);
  StoreLe<uint32_t>(b, kOffQHeads, cache.layout.num_q_heads);
  StoreLe<uint32_t>(b, kOffHeadDim, cache.layout.head_dim);
  b[kOffDType] = static_cast<uint8_t>(cache.layout.dtype);
  b[kOffKeyCodec] = static_cast<uint8_t>(cache.key_codec);
  b[kOffValueCodec] = static_cast<uint8_t>(cache.value_codec);
  StoreLe<uint32_t>(b, kOffRank, cache.rank);
  StoreLe<uint32_t>(b, kOffGroupSize, cache.ValueGroups() > 0 ? cache.group_size : 0);
  StoreLe<uint32_t>(b, kOffNumSections, static_cast<uint32_t>(sections.size()));
  StoreLe<uint64_t>(b, kOffOriginalTokens, cache.original_tokens);
  StoreLe<uint64_t>(b, kOffTotalKept, cache.total_kept());
  StoreLe<uint64_t>(b, kOffProjection, cache.projection_version);
  StoreLe<uint64_t>(b, kOffPqKeyBasis, cache.pq_key_basis);
  StoreLe<uint64_t>(b, kOffPqValueBasis, cache.pq_value_basis);
  StoreLe<uint32_t>(b, kOffPqKeyBits, cache.pq_key_bits);
  StoreLe<uint32_t>(b, kOffPqValueBits, cache.pq_value_bits);
  for (size_t i = 0; i < sections.size(); ++i) {
    uint8_t* e = b + kHeaderBytes + kSectionEntryBytes * i;
    StoreLe<uint32_t>(e, 0, sections[i].id);
    StoreLe<uint32_t>(e, 4, kSectionRequired);
    StoreLe<uint64_t>(e, 8, sections[i].offset);
    StoreLe<uint64_t>(e, 16, sections[i].size);
    StoreLe<uint32_t>(e, 24, section_crcs[i]);
  }
  StoreLe<uint32_t>(b, kOffTableCrc,
                Crc32c(b + kHeaderBytes, uint64_t{kSectionEntryBytes} * sections.size()));
  StoreLe<uint32_t>(b, kOffHeaderCrc, Crc32c(b, kOffHeaderCrc));
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> EncodedSize(const CompressedCache& cache) {
  KVCOMP_RETURN_IF_ERROR(cache.Validate());
  KVCOMP_ASSIGN_OR_RETURN(EncodingPlan plan, PlanEncoding(cache, cache.raw_value_rows.size()));
  return plan.total_bytes;
}

absl::Status EncodeCacheInto(const CompressedCache& cache, absl::Span<uint8_t> out,
                             uint32_t* crc32c) {
  KVCOMP_RETURN_IF_ERROR(cache.Validate());
  KVCOMP_ASSIGN_OR_RETURN(EncodingPlan plan, PlanEncoding(cache, cache.raw_value_rows.size()));
  const std::vector<Section> data = SectionsOf(cache, plan.policy);
  if (data.size() != plan.sections.size()) {
    return absl::InternalError("cache format: the plan and the arrays disagree on the sections");
  }
  if (out.size() != plan.total_bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cache format: output buffer is %u bytes, encoding needs %u", out.size(),
                        plan.total_bytes));
  }
  uint8_t* b = out.data();
  std::vector<uint32_t> crcs(data.size());
  for (size_t i = 0; i < data.size(); ++i) {
    const SectionSpan& at = plan.sections[i];
    if (data[i].id != at.id || data[i].size != at.size) {
      return absl::InternalError(absl::StrFormat(
          "cache format: section %u holds %u bytes, its counts give %u", at.id, data[i].size,
          at.size));
    }
    // Copied and checksummed a piece at a time: the CRC reads what the copy has just written,
    // from cache, instead of reading the whole section from memory a second time.
    constexpr uint64_t kPiece = uint64_t{256} << 10;
    const auto* src = static_cast<const uint8_t*>(data[i].data);
    uint32_t crc = 0;
    for (uint64_t done = 0; done < at.size; done += kPiece) {
      const uint64_t n = std::min(kPiece, at.size - done);
      std::memcpy(b + at.offset + done, src + done, n);
      crc = Crc32cExtend(crc, b + at.offset + done, n);
    }
    const uint64_t end = at.offset + at.size;
    const uint64_t next = i + 1 < data.size() ? plan.sections[i + 1].offset : plan.total_bytes;
    std::memset(b + end, 0, next - end);
    crcs[i] = crc;
  }
  const uint64_t first = plan.sections.empty() ? plan.total_bytes : plan.sections[0].offset;
  std::memset(b + plan.table_end(), 0, first - plan.table_end());
  KVCOMP_RETURN_IF_ERROR(WriteHeaderAndTable(cache, plan, crcs, out));
  if (crc32c != nullptr) {
    // The header, table and padding read here (bytes), each section's CRC combined, then the
    // zero padding after it.
    uint32_t all = Crc32c(b, first);
    for (size_t i = 0; i < plan.sections.size(); ++i) {
      const SectionSpan& at = plan.sections[i];
      all = Crc32cCombine(all, crcs[i], at.size);
      const uint64_t end = at.offset + at.size;
      const uint64_t next =
          i + 1 < plan.sections.size() ? plan.sections[i + 1].offset : plan.total_bytes;
      all = Crc32cExtend(all, b + end, next - end);
    }
    *crc32c = all;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> EncodeCache(const CompressedCache& cache, uint32_t* crc32c) {
  KVCOMP_ASSIGN_OR_RETURN(const uint64_t size, EncodedSize(cache));
  std::string out(size, '\0');
  KVCOMP_RETURN_IF_ERROR(EncodeCacheInto(
      cache, absl::MakeSpan(reinterpret_cast<uint8_t*>(out.data()), size), crc32c));
  return out;
}

absl::StatusOr<CacheInfo> PeekCache(absl::string_view bytes) {
  KVCOMP_ASSIGN_OR_RETURN(Parsed p, ParseHeaderAndTable(bytes, bytes.size(), true));
  return p.info;
}

absl::StatusOr<CacheInfo> PeekHeader(absl::string_view header_and_table, uint64_t total_bytes,
                                     std::vector<SectionSpan>* sections) {
  KVCOMP_ASSIGN_OR_RETURN(Parsed p, ParseHeaderAndTable(header_and_table, total_bytes, false));
  if (sections != nullptr) {
    sections->clear();
    for (const Parsed::Entry& e : p.entries) sections->push_back({e.id, e.offset, e.size});
  }
  return p.info;
}

absl::StatusOr<DenseSections> DenseRowSections(absl::string_view header_and_table,
                                               uint64_t total_bytes) {
  std::vector<SectionSpan> spans;
  DenseSections out;
  KVCOMP_ASSIGN_OR_RETURN(out.info, PeekHeader(header_and_table, total_bytes, &spans));
  const CacheInfo& info = out.info;
  const bool key_rows = info.key_codec == KeyCodec::kRaw || HqBits(info.key_codec) != 0;
  const bool value_rows = info.value_codec == ValueCodec::kRaw || HqBits(info.value_codec) != 0;
  if (!key_rows || !value_rows ||
      info.total_kept != info.layout.num_heads_total() * info.original_tokens) {
    return absl::FailedPreconditionError(
        "the cache has no dense rows in place: it evicted tokens or encodes them by head");
  }
  const uint64_t rows = info.total_kept, d = info.layout.head_dim;
  const uint64_t raw_row = DTypeBytes(info.layout.dtype, d);
  const uint64_t key_bytes =
      rows * (HqBits(info.key_codec) != 0 ? 4 + d * HqBits(info.key_codec) / 8 : raw_row);
  const uint64_t value_bytes =
      rows * (HqBits(info.value_codec) != 0 ? 4 + d * HqBits(info.value_codec) / 8 : raw_row);
  bool keys = false, values = false;
  for (const SectionSpan& span : spans) {
    if (span.id == kKeys) {
      out.keys = span;
      keys = span.size == key_bytes;
    } else if (span.id == kValues) {
      out.values = span;
      values = span.size == value_bytes;
    }
  }
  if (!keys || !values) {
    return absl::DataLossError("keys or values section of a dense cache has the wrong size");
  }
  return out;
}

absl::StatusOr<DenseSections> DenseKvSections(absl::string_view header_and_table,
                                              uint64_t total_bytes) {
  KVCOMP_ASSIGN_OR_RETURN(DenseSections out, DenseRowSections(header_and_table, total_bytes));
  if (out.info.key_codec != KeyCodec::kRaw || out.info.value_codec != ValueCodec::kRaw) {
    return absl::FailedPreconditionError(
        "the cache has no dense form in place: it evicted tokens or encodes them");
  }
  return out;
}

absl::StatusOr<CompressedCache> ParseCache(absl::string_view bytes) {
  KVCOMP_ASSIGN_OR_RETURN(Parsed p, ParseHeaderAndTable(bytes, bytes.size(), true));
  const CacheInfo& info = p.info;
  CompressedCache c;
  c.layout = info.layout;
  c.original_tokens = info.original_tokens;
  c.key_codec = info.key_codec;
  c.value_codec = info.value_codec;
  c.rank = info.rank;
  c.group_size = p.group_size;
  c.projection_version = info.projection_version;
  c.pq_key_basis = info.pq_key_basis;
  c.pq_value_basis = info.pq_value_basis;
  c.pq_key_bits = info.pq_key_bits;
  c.pq_value_bits = info.pq_value_bits;
  c.has_moments = info.has_moments;
  c.value_gamma = info.value_gamma;
  if (!IsProjectionCodec(c.value_codec)) {
    const bool pq = IsPq(c.key_codec) || IsPq(c.value_codec);
    if (c.rank != 0 || (!pq && c.projection_version != 0)) {
      return absl::InvalidArgumentError(
          "cache format: raw or hq values with a rank or projection");
    }
  } else if (c.rank == 0 || c.rank > c.layout.head_dim) {
    return absl::InvalidArgumentError("cache format: rank outside [1, head_dim]");
  }
  if (c.ValueGroups() == 0 && IsProjectionCodec(c.value_codec) &&
      c.value_codec != ValueCodec::kOrthogonal) {
    return absl::InvalidArgumentError("cache format: quantized values need a group size");
  }
  if (c.ValueGroups() == 0) {  // raw, orthogonal, hq: no latent groups
    if (p.group_size != 0) return absl::InvalidArgumentError("cache format: stray group size");
    c.group_size = 32;  // unused by these codecs; the in-memory default
  } else if (p.group_size > 256) {
    return absl::InvalidArgumentError("cache format: group size above 256");
  }
  const uint64_t h = info.layout.num_heads_total();
  const uint64_t d = info.layout.head_dim;
  KVCOMP_RETURN_IF_ERROR(TakeSection(p, bytes, kHeads, true, h, &c.kept));
  if (c.total_kept() != info.total_kept) {
    return absl::InvalidArgumentError("cache format: head counts do not add up to total_kept");
  }
  std::vector<uint8_t> policy;
  const Parsed::Entry* pe = nullptr;
  for (const auto& e : p.entries) {
    if (e.id == kPolicy) pe = &e;
  }
  if (pe == nullptr) return absl::InvalidArgumentError("cache format: policy section missing");
  KVCOMP_ASSIGN_OR_RETURN(
      c.policy,
      DecodePolicy(reinterpret_cast<const uint8_t*>(bytes.data()) + pe->offset, pe->size));
  const uint64_t t = info.total_kept;
  if (info.layer_ranks) {
    if (!IsProjectionCodec(c.value_codec)) {
      return absl::InvalidArgumentError("cache format: layer ranks without a projection codec");
    }
    KVCOMP_RETURN_IF_ERROR(
        TakeSection(p, bytes, kLayerRanks, true, info.layout.num_layers, &c.layer_rank));
    for (uint32_t r : c.layer_rank) {
      if (r == 0 || r > c.rank) {
        return absl::InvalidArgumentError("cache format: layer rank outside [1, rank]");
      }
    }
  }
  // Ranks are at most head_dim (256) and kept counts at most 2^31 per head, so these products
  // fit; the multiplications are still checked.
  uint64_t key_bytes, value_bytes = 0, scale_elems = 0, key_scale_elems = 0;
  if (!MulOk(t, c.KeyTokenBytes(), &key_bytes)) {
    return absl::InvalidArgumentError("cache format: section sizes overflow");
  }
  for (uint64_t head = 0; head < h; ++head) {
    const auto layer = static_cast<uint32_t>(head / info.layout.num_kv_heads);
    uint64_t vb, sc, ks;
    if (!MulOk(KeyScaleGroups(c.key_codec, c.kept[head]), d, &ks) ||
        __builtin_add_overflow(key_scale_elems, ks, &key_scale_elems) ||
        !MulOk(c.kept[head], c.ValueTokenBytes(layer), &vb) ||
        !MulOk(c.kept[head], c.ValueGroups(layer), &sc) ||
        __builtin_add_overflow(value_bytes, vb, &value_bytes) ||
        __builtin_add_overflow(scale_elems, sc, &scale_elems)) {
      return absl::InvalidArgumentError("cache format: section sizes overflow");
    }
  }
  KVCOMP_RETURN_IF_ERROR(TakeSection(p, bytes, kPositions, true, t, &c.positions));
  KVCOMP_RETURN_IF_ERROR(TakeSection(p, bytes, kKeys, true, key_bytes, &c.keys));
  KVCOMP_RETURN_IF_ERROR(TakeSection(p, bytes, kKeyScales,
                                     c.key_codec == KeyCodec::kInt8 ||
                                         c.key_codec == KeyCodec::kInt4,
                                     key_scale_elems, &c.key_scales));
  KVCOMP_RETURN_IF_ERROR(TakeSection(p, bytes, kValues, true, value_bytes, &c.values));
  KVCOMP_RETURN_IF_ERROR(
      TakeSection(p, bytes, kValueScales, c.ValueGroups() > 0, scale_elems, &c.value_scales));
  // KVSplice outliers: sections 13 and 14 come together; 13's size gives the count.
  bool raw_rows = false;
  for (const auto& e : p.entries) raw_rows = raw_rows || e.id == kRawValueRows;
  if (raw_rows && !IsProjectionCodec(c.value_codec)) {
    return absl::InvalidArgumentError("cache format: raw value rows without a projection codec");
  }
  uint64_t raw_rows_n = 0, raw_bytes = 0;
  for (const auto& e : p.entries) {
    if (e.id == kRawValueRows) {
      if (e.size == 0 || e.size % sizeof(uint64_t) != 0) {
        return absl::InvalidArgumentError("cache format: section 13 is not whole u64 entries");
      }
      raw_rows_n = e.size / sizeof(uint64_t);
    }
  }
  if (raw_rows_n > t || !MulOk(raw_rows_n, DTypeBytes(info.layout.dtype, d), &raw_bytes)) {
    return absl::InvalidArgumentError("cache format: more raw value rows than kept tokens");
  }
  KVCOMP_RETURN_IF_ERROR(
      TakeSection(p, bytes, kRawValueRows, raw_rows, raw_rows_n, &c.raw_value_rows));
  KVCOMP_RETURN_IF_ERROR(TakeSection(p, bytes, kRawValues, raw_rows, raw_bytes, &c.raw_values));
  const bool m = c.has_moments;
  KVCOMP_RETURN_IF_ERROR(TakeSection(p, bytes, kMomentCount, m, h, &c.moment_count));
  KVCOMP_RETURN_IF_ERROR(TakeSection(p, bytes, kMomentKeySum, m, h * d, &c.moment_key_sum));
  KVCOMP_RETURN_IF_ERROR(TakeSection(p, bytes, kMomentValueSum, m, h * d, &c.moment_value_sum));
  KVCOMP_RETURN_IF_ERROR(TakeSection(p, bytes, kMomentVkSum, m, h * d * d, &c.moment_vk_sum));
  if (absl::Status s = c.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cache format: ", s.message()));
  }
  return c;
}

std::string EncodePolicyRecords(const CompressionPolicy& policy) {
  const std::vector<uint8_t> r = EncodePolicy(policy);
  return std::string(r.begin(), r.end());
}

absl::StatusOr<CompressionPolicy> DecodePolicyRecords(absl::string_view records) {
  return DecodePolicy(reinterpret_cast<const uint8_t*>(records.data()), records.size());
}

}  // namespace format
}  // namespace kvcomp
