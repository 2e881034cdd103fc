#include "kvcomp/transport/buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <new>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "transport/src/buffer_cache.h"

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

namespace {

// Large buffers are mapped from the system and unmapped when released (never left in the
// allocator's arenas, which would keep their pages after the blocks are gone). Recently released
// ones are kept by exact rounded size, so that a stream of same-sized blocks reuses memory instead
// of mapping and faulting in fresh pages for every block; at most `limit` bytes are kept
// (LimitBufferCache: a server keeps no more than a share of its buffer budget).
class BufferCache {
 public:
  static constexpr size_t kMinBytes = 64 << 10;
  static constexpr size_t kDefaultLimitBytes = size_t{256} << 20;

  static BufferCache& Get() {
    static BufferCache* cache = new BufferCache();  // never destroyed: buffers may outlive main
    return *cache;
  }
  void* Take(size_t rounded) {
    {
      absl::MutexLock l(&mu_);
      auto it = free_.find(rounded);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= rounded;
        return p;
      }
    }
    void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  void Give(void* p, size_t rounded) {
    {
      absl::MutexLock l(&mu_);
      if (cached_bytes_ + rounded <= limit_) {
        free_[rounded].push_back(p);
        cached_bytes_ += rounded;
        return;
      }
    }
    munmap(p, rounded);
  }
  void SetLimit(size_t bytes) {
    std::vector<std::pair<void*, size_t>> drop;
    {
      absl::MutexLock l(&mu_);
      limit_ = bytes;
      for (auto& [size, list] : free_) {
        while (cached_bytes_ > limit_ && !list.empty()) {
          drop.emplace_back(list.back(), size);
          list.pop_back();
          cached_bytes_ -= size;
        }
      }
    }
    for (auto& [p, size] : drop) munmap(p, size);
  }

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<size_t, std::vector<void*>> free_ ABSL_GUARDED_BY(mu_);
  size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t limit_ ABSL_GUARDED_BY(mu_) = kDefaultLimitBytes;
};

}  // namespace

void LimitBufferCache(size_t bytes) { BufferCache::Get().SetLimit(bytes); }

Buffer Buffer::Allocate(size_t size) {
  if (size == 0) return Buffer();
  const size_t rounded = (size + 63) / 64 * 64;
  if (rounded < BufferCache::kMinBytes) {
    void* p = std::aligned_alloc(64, rounded);
    if (p == nullptr) throw std::bad_alloc();
    return Wrap(p, size, MemoryType::kHost, [p] { std::free(p); });
  }
  void* p = BufferCache::Get().Take(rounded);
  if (p == nullptr) throw std::bad_alloc();
  return Wrap(p, size, MemoryType::kHost, [p, rounded] { BufferCache::Get().Give(p, rounded); });
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
