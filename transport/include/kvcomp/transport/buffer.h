// Buffer: a move-only span of bytes with its owner, used for payloads that cross the transport
// (a received block, a cache to send). Host memory by default; device memory only where the UCX
// build is CUDA-aware (see UcxCapabilities in kvcomp/transport/ucx.h).
//
// Not thread-safe; hand a Buffer from thread to thread by moving it.
#ifndef KVCOMP_TRANSPORT_BUFFER_H_
#define KVCOMP_TRANSPORT_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/strings/string_view.h"

namespace kvcomp {
namespace transport {

enum class MemoryType : uint8_t {
  kHost = 0,
  kCuda = 1,  // CUDA device memory
};

class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { Reset(); }

  // `size` bytes of uninitialised host memory, 64-byte aligned.
  static Buffer Allocate(size_t size);
  // Takes ownership of a string's bytes (no copy).
  static Buffer FromString(std::string bytes);
  // Borrows `size` bytes at `data` in `memory`; `release` (may be empty) runs once when the
  // Buffer is destroyed or reset. The bytes must stay valid until then.
  static Buffer Wrap(void* data, size_t size, MemoryType memory,
                     absl::AnyInvocable<void()> release);

  void* data() const { return data_; }
  uint8_t* bytes() const { return static_cast<uint8_t*>(data_); }
  size_t size() const { return size_; }
  MemoryType memory_type() const { return memory_; }
  bool empty() const { return size_ == 0; }
  // The bytes as a string_view (host memory only).
  absl::string_view view() const {
    return absl::string_view(static_cast<const char*>(data_), size_);
  }
  // Releases the bytes and leaves an empty buffer.
  void Reset();

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  MemoryType memory_ = MemoryType::kHost;
  absl::AnyInvocable<void()> release_;
};

}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_BUFFER_H_
