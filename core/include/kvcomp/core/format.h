// The compressed-cache byte format, version 1: one little-endian layout, the same on the wire
// and on disk, described byte by byte in docs/format.md. The parser validates everything
// (magic, version, sizes, counts against the layout, checksums, overflow) and never reads out
// of bounds; a malformed input is a DataLoss or InvalidArgument status, never a crash.
#ifndef KVCOMP_CORE_FORMAT_H_
#define KVCOMP_CORE_FORMAT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvcomp/core/compressed_cache.h"

namespace kvcomp {
namespace format {

inline constexpr uint32_t kMagic = 0x4343564B;  // "KVCC" in file order
inline constexpr uint16_t kMajorVersion = 1;
// 1.1 added sections 12 to 14 (KVSplice); 1.2 the policy's recent fraction (tag 23); 1.3 the
// int4 key codec (key codec 3, key scales per group of kept tokens); 1.4 the Hadamard codecs
// (key and value codecs 4 and 5: per-token records in the keys and values sections, no scale
// sections; kvcomp/codecs/hq.h). A 1.3 reader refuses 1.4 caches that use them (unknown codec)
// and reads the others; 1.5 the calibrated basis codec (key and value codecs 6, "pq": fixed-size
// records against the model's pq calibration, whose version the header's calibration field and
// whose bases' fingerprints and bits per row header bytes 84..107 name; kvcomp/codecs/pq.h). A
// 1.4 reader refuses 1.5 caches that use it (reserved header bytes set) and reads the others.
inline constexpr uint16_t kMinorVersion = 5;
inline constexpr uint32_t kHeaderBytes = 128;
inline constexpr uint32_t kSectionEntryBytes = 32;
inline constexpr uint32_t kAlignment = 64;  // every section starts on a 64-byte boundary
inline constexpr uint64_t kMaxEncodedBytes = uint64_t{1} << 40;

// Section ids (docs/format.md). Never renumber.
enum SectionId : uint32_t {
  kHeads = 1,         // u32 kept per head
  kPolicy = 2,        // TLV records of the policy
  kPositions = 3,     // u32 per kept token
  kKeys = 4,          // kept keys
  kKeyScales = 5,     // f32 per (head, channel), int8 keys only
  kValues = 6,        // kept values or latents
  kValueScales = 7,   // f16 per (token, group), int8/int4 latents only
  kMomentCount = 8,   // u64 per head
  kMomentKeySum = 9,  // f32 per (head, channel)
  kMomentValueSum = 10,
  kMomentVkSum = 11,   // f32 per (head, d, d)
  kLayerRanks = 12,    // u32 latent rank per layer, only when the layers' ranks differ (1.1)
  kRawValueRows = 13,  // u64 kept-row index per KVSplice outlier, ascending (1.1)
  kRawValues = 14,     // their values in the input dtype (1.1)
};
inline constexpr uint32_t kSectionRequired = 1;  // flag: a reader that does not know it must fail

// What the fixed header and section table say, without the sections (cheap; for lookups).
struct CacheInfo {
  KvLayout layout;
  uint64_t original_tokens = 0;
  uint64_t total_kept = 0;
  uint64_t total_bytes = 0;
  uint64_t projection_version = 0;  // the calibration version (projection or pq), 0 = none
  uint64_t pq_key_basis = 0;        // pq keys' basis fingerprint (1.5), else 0
  uint64_t pq_value_basis = 0;      // pq values' basis fingerprint (1.5), else 0
  uint32_t pq_key_bits = 0;         // pq keys' bits per row (1.5), else 0
  uint32_t pq_value_bits = 0;       // pq values' bits per row (1.5), else 0
  KeyCodec key_codec = KeyCodec::kRaw;
  ValueCodec value_codec = ValueCodec::kRaw;
  uint32_t rank = 0;         // the largest layer's when the ranks differ per layer
  bool layer_ranks = false;  // section 12 present: per-layer ranks
  uint64_t raw_value_rows = 0;  // KVSplice outliers (section 13 entries)
  bool has_moments = false;
  bool value_gamma = false;
};

// Bytes EncodeCache will produce for `cache` (which must Validate()).
absl::StatusOr<uint64_t> EncodedSize(const CompressedCache& cache);
// Encodes `cache` (validated first). InvalidArgument if it is inconsistent. With `crc32c`, also
// the CRC32C of all the bytes, from the sections' own (Crc32cCombine), without another pass.
absl::StatusOr<std::string> EncodeCache(const CompressedCache& cache, uint32_t* crc32c = nullptr);
// Encodes into `out`, which must hold exactly EncodedSize(cache) bytes; `crc32c` as above.
absl::Status EncodeCacheInto(const CompressedCache& cache, absl::Span<uint8_t> out,
                             uint32_t* crc32c = nullptr);

// ---- the layout in parts, for encoders whose arrays are not in host memory ----
// EncodeCacheInto and the device encoder (kvcomp/kernels/device_format.h) both place sections
// by PlanEncoding and write the header and table with WriteHeaderAndTable, so their bytes agree.

// One section of an encoding.
struct SectionSpan {
  uint32_t id = 0;      // SectionId
  uint64_t offset = 0;  // from the first byte of the encoding; a multiple of kAlignment
  uint64_t size = 0;    // bytes, before the zero padding up to the next multiple of kAlignment
};

// Where everything of an encoding goes.
struct EncodingPlan {
  std::vector<SectionSpan> sections;  // in table order (the order of the bytes)
  uint64_t total_bytes = 0;
  std::string policy;  // the policy section's bytes (EncodePolicyRecords)
  // End of the section table: the header and table are bytes [0, table_end()).
  uint64_t table_end() const {
    return kHeaderBytes + uint64_t{kSectionEntryBytes} * sections.size();
  }
};

// The plan of the encoding of a cache with `shape`'s header fields, policy, kept counts and
// layer ranks. Its arrays are not read (they may be empty): their sizes follow from the counts
// and codecs, with `raw_value_rows` KVSplice outlier rows. For a cache that Validate()s,
// PlanEncoding(cache, cache.raw_value_rows.size()) is the layout EncodeCacheInto writes.
// InvalidArgument when the fields disagree (layout, head count, layer ranks, outliers).
absl::StatusOr<EncodingPlan> PlanEncoding(const CompressedCache& shape, uint64_t raw_value_rows);
// Writes the fixed header and the section table of `plan` for `shape` into out[0,
// plan.table_end()), `section_crcs[i]` being the CRC32C of section i's bytes, with the table's
// and the header's own checksums. The rest of `out` is not touched. InvalidArgument when `out`
// is shorter or the CRC count is not the section count.
absl::Status WriteHeaderAndTable(const CompressedCache& shape, const EncodingPlan& plan,
                                 absl::Span<const uint32_t> section_crcs, absl::Span<uint8_t> out);

// Parses and fully validates `bytes`. DataLoss for checksum mismatches and truncation,
// InvalidArgument for malformed fields, FailedPrecondition for a version from the future.
absl::StatusOr<CompressedCache> ParseCache(absl::string_view bytes);
// Validates the header and section table (and their checksums) only.
absl::StatusOr<CacheInfo> PeekCache(absl::string_view bytes);
// The same from the first bytes of an encoding of `total_bytes` bytes (at least through its
// section table), for bytes that are elsewhere (device memory): the header, the table and their
// checksums are checked, the sections are not read, so their checksums and padding are not.
// With `sections`, also where each section lies (in table order), to read them in place.
absl::StatusOr<CacheInfo> PeekHeader(absl::string_view header_and_table, uint64_t total_bytes,
                                     std::vector<SectionSpan>* sections = nullptr);
// Where the dense K and V of an encoding lie, when every head kept every token with raw codecs:
// its keys and values sections are then exactly the dense K and V ([layer][kv head][token][dim]
// each, as CompressedCache::WriteDenseKv writes them), to be copied from where they are (device
// memory). From the header and table alone, checked as PeekHeader does. FailedPrecondition for
// a cache that evicted tokens or encodes them.
struct DenseSections {
  CacheInfo info;
  SectionSpan keys;
  SectionSpan values;
};
absl::StatusOr<DenseSections> DenseKvSections(absl::string_view header_and_table,
                                              uint64_t total_bytes);
// The same for a cache that kept every token with raw or Hadamard (hq4 / hq3) codecs: its keys
// and values sections hold one row per (layer, head, token) in that order, raw or one hq record
// each, so decoding each section row by row writes the dense K or V. FailedPrecondition:
// evictions, or another codec (int8 / int4 / fp16 keys, KVSplice values); DataLoss: a section
// of the wrong size.
absl::StatusOr<DenseSections> DenseRowSections(absl::string_view header_and_table,
                                               uint64_t total_bytes);

// The policy as the format's TLV records (docs/format.md, policy section), shared with the wire
// protocol's put-begin. Decoding skips unknown tags and validates the policy (InvalidArgument).
std::string EncodePolicyRecords(const CompressionPolicy& policy);
absl::StatusOr<CompressionPolicy> DecodePolicyRecords(absl::string_view records);

}  // namespace format
}  // namespace kvcomp

#endif  // KVCOMP_CORE_FORMAT_H_
