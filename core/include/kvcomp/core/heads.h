// A compressed cache's kv heads in contiguous ranges, and ranges merged back: what a
// tensor-parallel rank holds (its share of every layer's kv heads) is a cache of its own, and
// caches of adjacent ranges merge into the cache of their union. The result is byte for byte
// what compressing those heads produced: positions, encoded keys and their scales, values and
// the MomentKV summaries of each head move unchanged, so a cache put by one split is read back
// whole, or split another way, exactly.
//
// Values encoded by a KVSplice projection are refused (FailedPrecondition): the projection is
// per (layer, kv head), and a range of heads would need the projection's range with it.
// Free functions on value types; thread-compatible.
#ifndef KVCOMP_CORE_HEADS_H_
#define KVCOMP_CORE_HEADS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvcomp/core/compressed_cache.h"

namespace kvcomp {

// kv heads [begin, end) of every layer of `cache` (which must Validate()), with
// (end - begin) * group_size query heads. InvalidArgument for an empty or out-of-range range,
// FailedPrecondition for KVSplice-encoded values.
absl::StatusOr<CompressedCache> SliceHeads(const CompressedCache& cache, uint32_t begin,
                                           uint32_t end);

// `cache` split into `parts` equal ranges of kv heads, in head order (part i holds heads
// [i * n, (i + 1) * n), n = num_kv_heads / parts). InvalidArgument when parts is 0 or does not
// divide num_kv_heads; errors of SliceHeads otherwise.
absl::StatusOr<std::vector<CompressedCache>> SplitHeads(const CompressedCache& cache,
                                                        uint32_t parts);

// The cache whose kv heads are those of `parts` in order (every layer: part 0's heads, then
// part 1's, ...). The parts must agree on everything but their heads: layers, head dim, dtype,
// query heads per kv head, original tokens, policy, codecs and moments (InvalidArgument naming
// the first difference); FailedPrecondition for KVSplice-encoded values.
absl::StatusOr<CompressedCache> MergeHeads(absl::Span<const CompressedCache> parts);

}  // namespace kvcomp

#endif  // KVCOMP_CORE_HEADS_H_
