// DeviceEnv: the one owner of kvcompd's GPU memory budget (in the spirit of LevelDB's Env: the
// daemon's parts ask it, never CUDA, for device memory). Each CUDA device has one budget,
// engine.gpu_memory_bytes (0 = none: the device's own memory is the limit), and every byte the
// daemon holds there is drawn from it by one of its drawers and given back to it:
//   kPuts   an engine's reservation for one put's working set (Engine::ReserveDevice; the
//           engine's backends allocate it, the env only counts it);
//   kLinks  receive and send buffers of the payload links: the data plane's device receive pool
//           and its unpooled device blocks, the GPU channels' receive, send and stored-copy
//           memory (Allocate: counted and allocated here);
//   kGpuTier the GPU tier's pool (storage.device_capacity_bytes), allocated here for the store
//           when its device tier opens (storage::DeviceTierOptions::pool_memory) and held until
//           the store closes.
// A draw that would exceed the budget is refused with ResourceExhausted (nothing is allocated);
// a failed allocation returns what it drew. The accounting per device and drawer is what the
// daemon's metrics show (kvcomp_device_memory_bytes, kvcomp_device_memory_budget_bytes).
//
// The raw memory under the env is injectable (Memory): the CUDA driver (GpuRuntime) in kvcompd,
// a stand-in in tests, so the budget's accounting runs without a GPU. The page-locked host
// memory of the daemon's device copies comes from it too (AllocatePinned: not counted).
//
// A grant, and memory from Allocate, keep an env that a std::shared_ptr owns alive until they
// end: the daemon's parts (engines, GPU channels, the GPU tier's draw) may let go of it in any
// order.
//
// Thread-safety: every method may be called from any thread.
#ifndef KVCOMP_SERVICE_SRC_DEVICE_ENV_H_
#define KVCOMP_SERVICE_SRC_DEVICE_ENV_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvcomp {
namespace service {

class DeviceEnv : public std::enable_shared_from_this<DeviceEnv> {
 public:
  enum class Drawer : int { kPuts = 0, kLinks = 1, kGpuTier = 2 };
  static constexpr int kNumDrawers = 3;
  static const char* DrawerName(Drawer d);  // "puts", "links", "gpu_tier"

  // Device memory as the env gets it: allocated on and freed from one device.
  class Memory {
   public:
    virtual ~Memory() = default;
    virtual absl::StatusOr<void*> Alloc(int device, size_t bytes) = 0;
    virtual void Free(int device, void* ptr) = 0;  // may wait for the device's queued work
    // Page-locked host memory for copies to and from `device`.
    virtual absl::StatusOr<void*> AllocPinned(int device, size_t bytes) = 0;
    virtual void FreePinned(int device, void* ptr) = 0;
  };
  // The CUDA driver's memory (transport::GpuRuntime, opened on first use; without a driver or a
  // GPU every Alloc fails with its reason).
  static std::unique_ptr<Memory> CudaMemory();

  // `budget_bytes` per device, 0 = none.
  DeviceEnv(uint64_t budget_bytes, std::unique_ptr<Memory> memory);
  DeviceEnv(const DeviceEnv&) = delete;
  DeviceEnv& operator=(const DeviceEnv&) = delete;

  // Bytes drawn from one device's budget, given back when the grant ends.
  class Grant {
   public:
    Grant() = default;
    Grant(Grant&& o) noexcept { *this = std::move(o); }
    Grant& operator=(Grant&& o) noexcept {
      std::swap(env_, o.env_);
      std::swap(device_, o.device_);
      std::swap(drawer_, o.drawer_);
      std::swap(bytes_, o.bytes_);
      std::swap(keep_, o.keep_);
      return *this;
    }
    ~Grant();
    uint64_t bytes() const { return bytes_; }

   private:
    friend class DeviceEnv;
    DeviceEnv* env_ = nullptr;
    std::shared_ptr<DeviceEnv> keep_;  // env_ when a shared_ptr owns it, else empty
    int device_ = -1;
    Drawer drawer_ = Drawer::kPuts;
    uint64_t bytes_ = 0;
  };

  // Draws `bytes` from `device`'s budget for `drawer`. ResourceExhausted when the budget would
  // be exceeded (the message says how much is held by whom). Device -1 (a CPU engine's
  // accounting) has no budget.
  absl::StatusOr<Grant> Reserve(int device, uint64_t bytes, Drawer drawer);
  // Draws `bytes` and allocates them on `device`: the memory is freed and the draw given back
  // with its last holder (on that holder's thread: Free may wait for the device). Errors:
  // Reserve's, then the allocator's (its draw given back).
  absl::StatusOr<std::shared_ptr<uint8_t>> Allocate(int device, uint64_t bytes, Drawer drawer);
  // Page-locked host memory of `bytes` for copies with `device` (no budget), freed with its last
  // holder. Errors: the allocator's.
  absl::StatusOr<std::shared_ptr<uint8_t>> AllocatePinned(int device, uint64_t bytes);

  uint64_t budget_bytes() const { return budget_; }
  uint64_t held_bytes(int device) const;
  uint64_t held_bytes(int device, Drawer drawer) const;

 private:
  using Held = std::array<uint64_t, kNumDrawers>;
  void Return(int device, Drawer drawer, uint64_t bytes);

  const uint64_t budget_;
  const std::unique_ptr<Memory> memory_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, Held> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_DEVICE_ENV_H_
