// The engine's memory seam: every workspace and output buffer an op or the pipeline allocates
// comes from an Allocator, so tests can count, poison or fail allocations, and services can plug
// in a pool. Each Backend owns (or is given) one allocator for its memory space.
//
// Thread-safety: implementations must be thread-safe (the CPU backend allocates from worker
// threads). Buffer is a move-only owner and not thread-safe.
#ifndef KVCOMP_KERNELS_ALLOCATOR_H_
#define KVCOMP_KERNELS_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "kvcomp/kernels/tensor.h"

namespace kvcomp {

class Allocator {
 public:
  // Every pointer Allocate returns is aligned to at least this many bytes.
  static constexpr size_t kAlignment = 256;

  virtual ~Allocator() = default;
  // The memory space of the returned pointers.
  virtual MemorySpace space() const = 0;
  // At least `bytes` bytes aligned to kAlignment; nullptr for 0 bytes. ResourceExhausted when the
  // memory is not there. Never throws.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  // Returns memory from Allocate with the same `bytes`. nullptr is a no-op.
  virtual void Deallocate(void* ptr, size_t bytes) = 0;
};

// The process-wide host allocator (aligned operator new). Thread-safe; never destroyed.
Allocator& HostAllocator();

// A move-only owner of one allocation, or of a share in one (Buffer::Part).
class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      Reset();
      std::swap(allocator_, other.allocator_);
      std::swap(data_, other.data_);
      std::swap(bytes_, other.bytes_);
      std::swap(owner_, other.owner_);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { Reset(); }

  // `bytes` from `allocator` (which must outlive the buffer).
  static absl::StatusOr<Buffer> Allocate(Allocator& allocator, size_t bytes) {
    absl::StatusOr<void*> p = allocator.Allocate(bytes);
    if (!p.ok()) return p.status();
    Buffer b;
    b.allocator_ = &allocator;
    b.data_ = *p;
    b.bytes_ = bytes;
    return b;
  }

  // `bytes` bytes at `offset` in `whole`'s memory, which stays allocated while `whole` or any
  // part of it is held (the last holder frees it). `whole` must be non-null and hold the range.
  static Buffer Part(std::shared_ptr<const Buffer> whole, size_t offset, size_t bytes) {
    Buffer b;
    b.data_ = static_cast<char*>(whole->data()) + offset;
    b.bytes_ = bytes;
    b.owner_ = std::move(whole);
    return b;
  }

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return bytes_; }
  void Reset() {
    if (allocator_ != nullptr) allocator_->Deallocate(data_, bytes_);
    owner_.reset();
    allocator_ = nullptr;
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  Allocator* allocator_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::shared_ptr<const Buffer> owner_;  // a Part's allocation (allocator_ is then null)
};

}  // namespace kvcomp

#endif  // KVCOMP_KERNELS_ALLOCATOR_H_
