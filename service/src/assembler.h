// PutAssembler: the blocks of one put, checked and put together. Blocks may come in any order;
// each (layer, K or V) must be covered exactly once (an overlapping block is refused and leaves
// no trace). A whole put becomes one KvCacheView (a layer that one block holds is read in
// place; a layer split over blocks is copied into one buffer). A block-wise put is taken block
// by block in token order instead (TakeNext), so only blocks that arrived early are held.
//
// No locking: the owner of the put (OpenPut, cache_service.h) serialises calls.
#ifndef KVCOMP_SERVICE_SRC_ASSEMBLER_H_
#define KVCOMP_SERVICE_SRC_ASSEMBLER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/kernels/pipeline.h"
#include "put.h"

namespace kvcomp {
namespace service {

class PutAssembler {
 public:
  // `sum_keys`: take the keys' sums of layers split over blocks (see View); worth it only for
  // the scorers that read the keys' mean (KeySumsHelp).
  PutAssembler(const KvLayout& layout, uint64_t num_tokens, bool sum_keys = true);
  // Whether the plain keys' sums save `policy`'s scorer a pass over the keys: manifold and
  // windowed_manifold (keydiff reads unit sums, which the assembler does not take).
  static bool KeySumsHelp(const CompressionPolicy& policy);

  // Keeps `block`. InvalidArgument when its views do not match its ranges and the layout, or
  // when it overlaps tokens already received for a layer and part.
  absl::Status Add(BlockData block);
  // As Add, but keeps only the coverage, not the block: for a put whose blocks are copied to
  // the device as they arrive (the caller consumes the block's memory after this returns OK).
  absl::Status Cover(const BlockData& block);
  // OK once every layer's K and V cover every token; else FailedPrecondition naming the first
  // layer that is short.
  absl::Status CheckComplete() const;

  // The whole cache, after CheckComplete. The views point into the blocks and into buffers the
  // assembler keeps: valid until Clear or the assembler's end. A layer's keys split over
  // blocks are copied into one buffer, and their KeySums (the plain sums, SumKeysOnHost; no unit
  // sums) are taken as each chunk is completed when the assembler was made to (sum_keys), so
  // manifold and windowed_manifold read those keys once; a layer held by one block is read in
  // place and has no sums (the scorer sums it).
  absl::StatusOr<KvCacheView> View();

  // Block-wise: moves into `out` a block that carries K and V and starts, in every layer it
  // covers, where that layer's taken tokens end; false when none is ready.
  bool TakeNext(BlockData* out);
  size_t held_blocks() const { return blocks_.size(); }

  // Drops every block held (and their memory).
  void Clear();

 private:
  // Covered token ranges of one (layer, part): begin -> end, disjoint.
  class Coverage {
   public:
    bool Overlaps(uint64_t b, uint64_t e) const;
    void Add(uint64_t b, uint64_t e);
    uint64_t tokens() const { return tokens_; }

   private:
    std::map<uint64_t, uint64_t> ranges_;
    uint64_t tokens_ = 0;
  };

  const KvLayout layout_;
  const uint64_t num_tokens_;
  const bool sum_keys_;
  std::vector<Coverage> key_cov_, value_cov_;
  std::vector<BlockData> blocks_;
  std::vector<uint64_t> next_token_;  // block-wise, per layer: first token not yet taken
  std::vector<std::unique_ptr<uint8_t[]>> assembled_;
  std::vector<std::unique_ptr<float[]>> key_sums_;  // per assembled layer's keys

  absl::Status Admit(const BlockData& block);
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_ASSEMBLER_H_
