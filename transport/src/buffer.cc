#include "kvcomp/transport/buffer.h"

#include <cstdlib>
#include <new>

namespace kvcomp {
namespace transport {

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = other.data_;
    size_ = other.size_;
    memory_ = other.memory_;
    release_ = std::move(other.release_);
    other.data_ = nullptr;
    other.size_ = 0;
    other.memory_ = MemoryType::kHost;
    other.release_ = nullptr;
  }
  return *this;
}

void Buffer::Reset() {
  if (release_) {
    absl::AnyInvocable<void()> release = std::move(release_);
    release_ = nullptr;
    release();
  }
  data_ = nullptr;
  size_ = 0;
  memory_ = MemoryType::kHost;
}

Buffer Buffer::Allocate(size_t size) {
  if (size == 0) return Buffer();
  const size_t rounded = (size + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) throw std::bad_alloc();
  return Wrap(p, size, MemoryType::kHost, [p] { std::free(p); });
}

Buffer Buffer::FromString(std::string bytes) {
  auto owner = std::make_unique<std::string>(std::move(bytes));
  void* data = owner->data();
  const size_t size = owner->size();
  return Wrap(data, size, MemoryType::kHost, [o = std::move(owner)]() mutable { o.reset(); });
}

Buffer Buffer::Wrap(void* data, size_t size, MemoryType memory,
                    absl::AnyInvocable<void()> release) {
  Buffer b;
  b.data_ = data;
  b.size_ = size;
  b.memory_ = memory;
  b.release_ = std::move(release);
  return b;
}

}  // namespace transport
}  // namespace kvcomp
