// The compressed cache of one sequence, in memory. For every (layer, kv head) it holds the
// positions of the kept tokens, their keys and values (raw or encoded) and, optionally, the
// MomentKV summary of the evicted tokens. Heads keep different counts (AdaKV): all per-token
// arrays are ragged, concatenated in head order h = layer * num_kv_heads + kv_head, and
// head h's tokens are [token_offset(h), token_offset(h) + kept(h)).
//
// A value type: copyable, movable, no hidden sharing. Not thread-safe for concurrent mutation;
// const access from many threads is fine. The byte format is in kvcomp/core/format.h.
#ifndef KVCOMP_CORE_COMPRESSED_CACHE_H_
#define KVCOMP_CORE_COMPRESSED_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/core/policy.h"

namespace kvcomp {

// Where the bytes of an encoded cache go, so users see what costs memory.
struct CacheBytes {
  uint64_t header = 0;        // fixed header, section table, head table, policy, padding
  uint64_t positions = 0;     // kept token positions
  uint64_t keys = 0;          // kept keys
  uint64_t key_scales = 0;    // int8 / int4 key scales
  uint64_t values = 0;        // kept values or their latents
  uint64_t value_scales = 0;  // latent group scales
  uint64_t raw_values = 0;    // KVSplice outliers: row indices and raw values
  uint64_t moments = 0;       // MomentKV summaries
  uint64_t total() const {
    return header + positions + keys + key_scales + values + value_scales + raw_values + moments;
  }
};

class CompressedCache {
 public:
  // --- header ---
  KvLayout layout;
  uint64_t original_tokens = 0;  // tokens of the sequence before eviction
  CompressionPolicy policy;      // the policy that made this cache (informational)
  // The encoding of the kept tokens; these, not policy's fields, say how to decode.
  KeyCodec key_codec = KeyCodec::kRaw;
  ValueCodec value_codec = ValueCodec::kRaw;
  uint32_t rank = 0;                // latent rank for orthogonal value codecs, else 0; with
                                    // layer_rank, the largest of the layers' ranks
  uint32_t group_size = 32;         // latent elements per scale for int8/int4
  // The calibration the codecs decode with: the KVSplice projection's version for the
  // orthogonal value codecs, the pq calibration's (kvcomp/codecs/pq.h Calibration::version) when
  // a codec is pq (the two never go together); else 0.
  uint64_t projection_version = 0;
  // pq codecs (format 1.5): each basis' fingerprint and bits per row (the record of a row is
  // ceil(bits / 8) bytes); 0 for a tensor whose codec is not pq.
  uint64_t pq_key_basis = 0;
  uint64_t pq_value_basis = 0;
  uint32_t pq_key_bits = 0;
  uint32_t pq_value_bits = 0;
  // int8/int4 latents were divided by the projection's per-direction gamma before quantizing
  // (gamma-aware); decoding multiplies it back. Only with a quantized value codec.
  bool value_gamma = false;
  // Per-layer latent ranks (the auto-tuner's choice): empty when every layer uses
  // `rank`; else one per layer, each in [1, rank] (even for int4), the largest equal to `rank`.
  // A layer's tokens carry LayerRank(layer) latent elements and ceil(LayerRank / group_size)
  // scales each, so the value arrays are ragged by layer too.
  std::vector<uint32_t> layer_rank;

  // --- per head (size num_heads_total()) ---
  std::vector<uint32_t> kept;  // tokens kept by each head

  // --- ragged per-token arrays ---
  std::vector<uint32_t> positions;  // ascending within each head, < original_tokens
  std::vector<uint8_t> keys;        // total_kept * KeyTokenBytes()
  // int8 keys: num_heads * head_dim; int4 keys: per head, KeyScaleGroups(kInt4, kept) groups
  // of head_dim (group-major, head order); else empty.
  std::vector<float> key_scales;
  std::vector<uint8_t> values;      // total_kept * ValueTokenBytes()
  std::vector<uint16_t> value_scales;  // int8/int4: total_kept * ValueGroups() f16, else empty
  // KVSplice outliers (encoded values only): kept rows, ascending indices into the ragged
  // arrays, whose values the projection does not hold; their values raw (layout.dtype,
  // head_dim each, in row order) replace the decoded latents. Usually empty.
  std::vector<uint64_t> raw_value_rows;
  std::vector<uint8_t> raw_values;

  // --- MomentKV summaries of the evicted tokens, fp32; empty when has_moments is false ---
  bool has_moments = false;
  std::vector<uint64_t> moment_count;  // per head: evicted tokens n
  std::vector<float> moment_key_sum;    // per head: sum of k, head_dim
  std::vector<float> moment_value_sum;  // per head: sum of v, head_dim
  std::vector<float> moment_vk_sum;     // per head: sum of v k^T, head_dim x head_dim row-major
                                        // (element [i][j] = sum v_i k_j)

  // Shapes kept[], key_scales and moments for `layout` with zero kept tokens, clearing data.
  void Reset(const KvLayout& layout, uint64_t original_tokens);

  uint64_t num_heads() const { return layout.num_heads_total(); }
  uint32_t head_index(uint32_t layer, uint32_t kv_head) const {
    return layer * layout.num_kv_heads + kv_head;
  }
  uint64_t total_kept() const;
  // First token of head h in the ragged arrays (prefix sum of kept; O(h), see TokenOffsets()).
  uint64_t token_offset(uint64_t h) const;
  // Prefix sums of kept, size num_heads()+1.
  std::vector<uint64_t> TokenOffsets() const;

  // Bytes per kept token in `keys` and `values`, and f16 scales per token in value_scales. The
  // value figures without a layer are those at `rank` (every layer's, unless layer_rank is set).
  uint64_t KeyTokenBytes() const;
  // First element of head h's key scales in key_scales, and their count over all heads.
  uint64_t KeyScaleOffset(uint64_t h) const;
  uint64_t KeyScaleCount() const { return KeyScaleOffset(kept.size()); }
  uint64_t ValueTokenBytes() const;
  uint64_t ValueGroups() const;
  uint32_t LayerRank(uint32_t layer) const { return layer_rank.empty() ? rank : layer_rank[layer]; }
  uint64_t ValueTokenBytes(uint32_t layer) const;
  uint64_t ValueGroups(uint32_t layer) const;
  // Sizes of `values` (bytes) and `value_scales` (f16 elements) the kept counts and ranks imply.
  uint64_t ValueBytes() const;
  uint64_t ValueScaleCount() const;

  // Checks that every array's size matches the layout, codecs and kept counts, positions are
  // ascending and in range, moment counts add up to the evicted tokens. InvalidArgument on the
  // first inconsistency. Format encoding and parsing both run it.
  absl::Status Validate() const;

  // Writes a cache that kept every token with raw codecs as dense K then V, each
  // [layer][head][token][dim] in original token order (layout.CacheBytes(original_tokens) bytes
  // at `out`). FailedPrecondition for other codecs or when a head evicted tokens.
  absl::Status WriteDenseKv(uint8_t* out) const;

  // Bytes of the encoded form, by part (the format's EncodedSize split up).
  CacheBytes Breakdown() const;
  // Bytes of the uncompressed K and V this cache came from.
  uint64_t original_bytes() const { return layout.CacheBytes(original_tokens); }

  std::string DebugString() const;
};

// Equality of every field and byte (for round-trip tests).
bool operator==(const CompressedCache& a, const CompressedCache& b);
inline bool operator!=(const CompressedCache& a, const CompressedCache& b) { return !(a == b); }

}  // namespace kvcomp

#endif  // KVCOMP_CORE_COMPRESSED_CACHE_H_
