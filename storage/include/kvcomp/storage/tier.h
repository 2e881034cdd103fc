// One storage tier: a map from encoded cache keys (CacheKey::Encode()) to payloads, with a byte
// capacity. TieredStore keeps the index, LRU order, quotas and TTLs above the tiers; a tier only
// holds bytes. All methods are thread-safe.
#ifndef KVCOMP_STORAGE_TIER_H_
#define KVCOMP_STORAGE_TIER_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcomp/storage/options.h"
#include "kvcomp/storage/types.h"

namespace kvcomp {
namespace storage {

class Tier {
 public:
  virtual ~Tier() = default;

  virtual TierKind kind() const = 0;
  virtual uint64_t capacity_bytes() const = 0;
  virtual uint64_t used_bytes() const = 0;  // payload bytes held now
  virtual uint64_t entries() const = 0;

  // Stores `payload` under `key`, replacing any value there; `meta` goes with it where the tier
  // persists metadata (rocksdb), in one atomic write. Only the device tier takes a payload in
  // device memory (Payload::OnDevice; one copy on the device); the others refuse one
  // (InvalidArgument). With `sync` the write is durable on return
  // (rocksdb: WAL synced). Errors: ResourceExhausted when it does not fit in the capacity or the
  // disk is full, Unavailable/Internal for other device or disk failures. On error nothing of
  // the new value is visible.
  virtual absl::Status Put(absl::string_view key, const CacheMeta& meta, const Payload& payload,
                           bool sync) = 0;
  // The payload under `key` (a host buffer; the device tier copies to host). NotFound if absent.
  virtual absl::StatusOr<Payload> Get(absl::string_view key) = 0;
  // Copies the payload under `key` into device memory and returns its size, once the copy is
  // done. The device tier copies device to device; the others (this default) read the payload
  // and copy it host to device. NotFound if absent; OutOfRange when target.capacity is smaller
  // than the payload (nothing copied); FailedPrecondition in a build without CUDA.
  virtual absl::StatusOr<uint64_t> ReadInto(absl::string_view key, const DeviceTarget& target);
  // Removes `key`; OK if it was absent.
  virtual absl::Status Delete(absl::string_view key, bool sync) = 0;
};

// Host memory. Buffers are page-locked when options.pinned and CUDA with a GPU are present;
// otherwise Put shares the caller's Payload without copying. InvalidArgument for a zero capacity.
absl::StatusOr<std::unique_ptr<Tier>> NewHostTier(const HostTierOptions& options);

// GPU memory: one pool of options.capacity_bytes on each device (options.devices, or
// options.device; from options.pool_memory, else cudaMalloc) with a first-fit allocator; each
// entry lives in one pool and is read on that pool's device. FailedPrecondition when the build
// has no CUDA or a device is absent; InvalidArgument for a zero capacity, an alignment that is
// not a power of two, or a device listed twice.
absl::StatusOr<std::unique_ptr<Tier>> NewDeviceTier(const DeviceTierOptions& options);

// True when this build has CUDA and a GPU is visible.
bool CudaDeviceAvailable();

}  // namespace storage
}  // namespace kvcomp

#endif  // KVCOMP_STORAGE_TIER_H_
