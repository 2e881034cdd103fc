#include "range_allocator.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace kvcomp {
namespace storage {

RangeAllocator::RangeAllocator(uint64_t capacity, uint64_t alignment)
    : capacity_(capacity & ~(alignment - 1)), alignment_(alignment) {
  if (capacity_ > 0) free_[0] = capacity_;
}

absl::StatusOr<uint64_t> RangeAllocator::Allocate(uint64_t size) {
  if (size == 0) return absl::InvalidArgumentError("allocation of 0 bytes");
  if (size > capacity_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("allocation of ", size, " bytes exceeds the pool of ", capacity_));
  }
  const uint64_t n = Round(size);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < n) continue;
    const uint64_t offset = it->first;
    const uint64_t rest = it->second - n;
    free_.erase(it);
    if (rest > 0) free_[offset + n] = rest;
    used_ += n;
    return offset;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("no free range of ", n, " bytes (", used_, " of ", capacity_, " bytes used)"));
}

absl::Status RangeAllocator::Free(uint64_t offset, uint64_t size) {
  const uint64_t n = Round(size);
  if (size == 0 || offset % alignment_ != 0 || offset > capacity_ || n > capacity_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat("bad free of [", offset, ", +", size, ")"));
  }
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first < offset + n) {
    return absl::InvalidArgumentError(
        absl::StrCat("free of [", offset, ", +", size, ") overlaps a free range"));
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("free of [", offset, ", +", size, ") overlaps a free range"));
    }
  }
  uint64_t start = offset;
  uint64_t len = n;
  if (next != free_.end() && next->first == offset + n) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      start = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  free_[start] = len;
  used_ -= n;
  return absl::OkStatus();
}

uint64_t RangeAllocator::largest_free() const {
  uint64_t best = 0;
  for (const auto& [off, len] : free_) best = std::max(best, len);
  return best;
}

}  // namespace storage
}  // namespace kvcomp
