// First-fit allocator of byte ranges [0, capacity) with coalescing of freed neighbours: the
// device tier's allocator over its one cudaMalloc'ed pool. Host-only bookkeeping, so it is
// tested without a GPU. Not thread-safe; the owner locks.
#ifndef KVCOMP_STORAGE_SRC_RANGE_ALLOCATOR_H_
#define KVCOMP_STORAGE_SRC_RANGE_ALLOCATOR_H_

#include <cstdint>
#include <map>

#include "absl/status/statusor.h"

namespace kvcomp {
namespace storage {

class RangeAllocator {
 public:
  // `alignment` must be a power of two; capacity is rounded down to it.
  RangeAllocator(uint64_t capacity, uint64_t alignment);

  // Offset of a free range of at least `size` bytes (rounded up to the alignment).
  // ResourceExhausted when no free range is big enough; InvalidArgument for size 0.
  absl::StatusOr<uint64_t> Allocate(uint64_t size);
  // Returns a range from Allocate (same size). Double or foreign frees are InvalidArgument.
  absl::Status Free(uint64_t offset, uint64_t size);

  uint64_t capacity() const { return capacity_; }
  uint64_t used() const { return used_; }
  uint64_t largest_free() const;
  size_t free_ranges() const { return free_.size(); }

 private:
  uint64_t Round(uint64_t size) const { return (size + alignment_ - 1) & ~(alignment_ - 1); }

  uint64_t capacity_;
  uint64_t alignment_;
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> free_;  // offset -> length, disjoint, never adjacent
};

}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_STORAGE_SRC_RANGE_ALLOCATOR_H_
