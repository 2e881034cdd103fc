// The CUDA side of the store (compiled only with CUDA): pinned host memory and the device tier,
// one pool per device (DeviceTierOptions::pool_memory, or cudaMalloc) carved by RangeAllocator.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "cuda_memory.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/status.h"
#include "kvcomp/storage/tier.h"
#include "mutex.h"
#include "range_allocator.h"

namespace kvcomp {
namespace storage {
namespace {

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  const std::string msg = absl::StrCat("device tier: ", what, ": ", cudaGetErrorString(e));
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::UnavailableError(msg);
}

absl::StatusOr<Payload> CopyToHost(const void* src, int device, uint64_t size) {
  KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<uint8_t> host, Payload::NewHostBuffer(size));
  cudaSetDevice(device);
  cudaError_t e = cudaMemcpy(host.get(), src, size, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) return CudaError(e, "copy to host");
  return Payload(std::move(host), size);
}

cudaError_t CopyOnDevice(void* dst, int dst_device, const DeviceBytes& src) {
  cudaStream_t stream = cudaStreamPerThread;
  cudaError_t e =
      src.device == dst_device
          ? cudaMemcpyAsync(dst, src.data.get(), src.size, cudaMemcpyDeviceToDevice, stream)
          : cudaMemcpyPeerAsync(dst, dst_device, src.data.get(), src.device, src.size, stream);
  return e == cudaSuccess ? cudaStreamSynchronize(stream) : e;
}

// One pool per device (DeviceTierOptions::pool_memory, or cudaMalloc). Each entry lives in one
// pool; Get and ReadInto copy from that pool's device.
class DeviceTier final : public Tier {
 public:
  struct PoolSpec {
    int device;
    std::shared_ptr<void> memory;
  };
  DeviceTier(const DeviceTierOptions& options, std::vector<PoolSpec> pools) {
    for (PoolSpec& p : pools) {
      pools_.push_back(Pool{p.device, static_cast<uint8_t*>(p.memory.get()), std::move(p.memory),
                            RangeAllocator(options.capacity_bytes, options.alignment_bytes)});
    }
  }

  TierKind kind() const override { return TierKind::kDevice; }
  uint64_t capacity_bytes() const override {
    uint64_t total = 0;  // capacities never change
    for (const Pool& p : pools_) total += p.alloc.capacity();
    return total;
  }
  uint64_t used_bytes() const override {
    ReaderLock lock(&mu_);
    return bytes_;
  }
  uint64_t entries() const override {
    ReaderLock lock(&mu_);
    return map_.size();
  }

  absl::Status Put(absl::string_view key, const CacheMeta&, const Payload& payload, bool) override {
    const uint64_t n = payload.size() > 0 ? payload.size() : 1;
    const int from = payload.on_device() ? payload.device_bytes()->device : -1;
    Range r{};
    {
      WriterLock lock(&mu_);
      absl::Status last = absl::ResourceExhaustedError("device tier: no pool");
      bool placed = false;
      for (size_t i : PoolOrderLocked(from)) {
        auto off = pools_[i].alloc.Allocate(n);
        if (off.ok()) {
          r = Range{i, *off, payload.size()};
          placed = true;
          break;
        }
        last = off.status();
      }
      if (!placed) return last;
    }
    const Pool& pool = pools_[r.pool];
    uint8_t* dst = pool.base + r.offset;
    cudaSetDevice(pool.device);
    // A payload on the device: one copy on the device (or from a peer), waited for before its
    // owner may free it. From the host: one upload.
    cudaError_t e = payload.on_device()
                        ? CopyOnDevice(dst, pool.device, *payload.device_bytes())
                        : cudaMemcpy(dst, payload.data(), payload.size(), cudaMemcpyHostToDevice);
    WriterLock lock(&mu_);
    if (e != cudaSuccess) {
      pools_[r.pool].alloc.Free(r.offset, n).IgnoreError();
      return CudaError(e, "copy to device");
    }
    auto [it, inserted] = map_.try_emplace(std::string(key), r);
    if (!inserted) {
      FreeLocked(it->second);
      it->second = r;
    }
    bytes_ += payload.size();
    return absl::OkStatus();
  }

  absl::StatusOr<Payload> Get(absl::string_view key) override {
    // The reader lock keeps the range allocated (Delete and Put take the writer lock).
    ReaderLock lock(&mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return absl::NotFoundError("device tier: no such key");
    const Range r = it->second;
    const Pool& pool = pools_[r.pool];
    return CopyToHost(pool.base + r.offset, pool.device, r.size);
  }

  absl::StatusOr<uint64_t> ReadInto(absl::string_view key, const DeviceTarget& target) override {
    ReaderLock lock(&mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return absl::NotFoundError("device tier: no such key");
    const Range r = it->second;
    if (r.size > target.capacity) {
      return absl::OutOfRangeError(absl::StrCat("device tier: the cache has ", r.size,
                                                " bytes, the target ", target.capacity));
    }
    const Pool& pool = pools_[r.pool];
    cudaSetDevice(target.device);
    auto stream = static_cast<cudaStream_t>(target.stream);
    if (stream == nullptr) stream = cudaStreamPerThread;
    cudaError_t e =
        target.device == pool.device
            ? cudaMemcpyAsync(target.data, pool.base + r.offset, r.size, cudaMemcpyDeviceToDevice,
                              stream)
            : cudaMemcpyPeerAsync(target.data, target.device, pool.base + r.offset, pool.device,
                                  r.size, stream);
    // Waited for under the lock: the range stays the cache's until the copy is done.
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) return CudaError(e, "copy on the device");
    return r.size;
  }

  absl::Status Delete(absl::string_view key, bool) override {
    WriterLock lock(&mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return absl::OkStatus();
    FreeLocked(it->second);
    map_.erase(it);
    return absl::OkStatus();
  }

 private:
  struct Pool {
    int device;
    uint8_t* base;
    std::shared_ptr<void> memory;  // base's owner
    RangeAllocator alloc;
  };
  struct Range {
    size_t pool;
    uint64_t offset;
    uint64_t size;
  };

  // The pools a cache is tried in: the one on `device` first (the device holding the payload;
  // -1 for a payload in host memory), then the others, most free bytes first.
  std::vector<size_t> PoolOrderLocked(int device) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    std::vector<size_t> order(pools_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const bool a_own = pools_[a].device == device, b_own = pools_[b].device == device;
      if (a_own != b_own) return a_own;
      return pools_[a].alloc.capacity() - pools_[a].alloc.used() >
             pools_[b].alloc.capacity() - pools_[b].alloc.used();
    });
    return order;
  }

  void FreeLocked(const Range& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    pools_[r.pool].alloc.Free(r.offset, r.size > 0 ? r.size : 1).IgnoreError();
    bytes_ -= r.size;
  }

  mutable SharedMutex mu_;
  std::vector<Pool> pools_;  // the vector is fixed after construction; allocators under mu_
  absl::flat_hash_map<std::string, Range> map_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

absl::StatusOr<Payload> DownloadDeviceBytes(const DeviceBytes& bytes) {
  KVCOMP_ASSIGN_OR_RETURN(Payload p, CopyToHost(bytes.data.get(), bytes.device, bytes.size));
  if (Crc32c(p.data(), p.size()) != bytes.crc32c) {
    return absl::DataLossError(
        "device payload: its bytes copied to the host do not match the CRC32C it carries");
  }
  return p;
}

absl::Status CopyToDeviceTarget(const DeviceTarget& target, const void* src, uint64_t n) {
  cudaSetDevice(target.device);
  auto stream = static_cast<cudaStream_t>(target.stream);
  if (stream == nullptr) stream = cudaStreamPerThread;
  cudaError_t e = cudaMemcpyAsync(target.data, src, n, cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return CudaError(e, "copy to device memory");
  return absl::OkStatus();
}

bool CudaDeviceAvailable() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

void* PinnedAlloc(size_t bytes) {
  void* p = nullptr;
  if (cudaHostAlloc(&p, bytes, cudaHostAllocDefault) != cudaSuccess) return nullptr;
  return p;
}

void PinnedFree(void* p) {
  if (p != nullptr) cudaFreeHost(p);
}

// A pool of the CUDA runtime (no DeviceTierOptions::pool_memory: the store on its own).
absl::StatusOr<std::shared_ptr<void>> CudaPool(int device, uint64_t bytes) {
  cudaSetDevice(device);
  void* pool = nullptr;
  if (cudaError_t e = cudaMalloc(&pool, bytes); e != cudaSuccess) return CudaError(e, "cudaMalloc");
  return std::shared_ptr<void>(pool, [device](void* p) {
    cudaSetDevice(device);
    cudaFree(p);
  });
}

absl::StatusOr<std::unique_ptr<Tier>> NewDeviceTier(const DeviceTierOptions& options) {
  if (options.capacity_bytes == 0) {
    return absl::InvalidArgumentError("device tier: capacity_bytes must be > 0");
  }
  const uint64_t a = options.alignment_bytes;
  if (a == 0 || (a & (a - 1)) != 0) {
    return absl::InvalidArgumentError("device tier: alignment_bytes must be a power of two");
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    return absl::FailedPreconditionError("device tier: no CUDA device present");
  }
  const std::vector<int> devices =
      options.devices.empty() ? std::vector<int>{options.device} : options.devices;
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i] < 0 || devices[i] >= n) {
      return absl::FailedPreconditionError(
          absl::StrCat("device tier: device ", devices[i], " absent (", n, " devices)"));
    }
    if (std::find(devices.begin(), devices.begin() + i, devices[i]) != devices.begin() + i) {
      return absl::InvalidArgumentError(
          absl::StrCat("device tier: device ", devices[i], " listed twice"));
    }
  }
  std::vector<DeviceTier::PoolSpec> pools;
  for (int device : devices) {
    absl::StatusOr<std::shared_ptr<void>> pool =
        options.pool_memory ? options.pool_memory(device, options.capacity_bytes)
                            : CudaPool(device, options.capacity_bytes);
    if (!pool.ok()) {
      return Annotate(pool.status(), absl::StrCat("pool of ", options.capacity_bytes,
                                                  " bytes on device ", device));
    }
    pools.push_back({device, *std::move(pool)});
  }
  return std::unique_ptr<Tier>(new DeviceTier(options, std::move(pools)));
}

}  // namespace storage
}  // namespace kvcomp
