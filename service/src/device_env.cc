#include "device_env.h"

#include "absl/strings/str_cat.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/gpu_link.h"

namespace kvcomp {
namespace service {
namespace {

class CudaDriverMemory final : public DeviceEnv::Memory {
 public:
  absl::StatusOr<void*> Alloc(int device, size_t bytes) override {
    KVCOMP_ASSIGN_OR_RETURN(transport::GpuRuntime * rt, transport::GpuRuntime::Get());
    KVCOMP_RETURN_IF_ERROR(rt->SetDevice(device));
    return rt->AllocDevice(bytes);
  }
  void Free(int device, void* ptr) override {
    absl::StatusOr<transport::GpuRuntime*> rt = transport::GpuRuntime::Get();
    if (rt.ok() && (*rt)->SetDevice(device).ok()) (*rt)->FreeDevice(ptr);
  }
  absl::StatusOr<void*> AllocPinned(int device, size_t bytes) override {
    KVCOMP_ASSIGN_OR_RETURN(transport::GpuRuntime * rt, transport::GpuRuntime::Get());
    KVCOMP_RETURN_IF_ERROR(rt->SetDevice(device));
    return rt->AllocPinned(bytes);
  }
  void FreePinned(int device, void* ptr) override {
    absl::StatusOr<transport::GpuRuntime*> rt = transport::GpuRuntime::Get();
    if (rt.ok() && (*rt)->SetDevice(device).ok()) (*rt)->FreePinned(ptr);
  }
};

}  // namespace

const char* DeviceEnv::DrawerName(Drawer d) {
  return d == Drawer::kPuts ? "puts" : d == Drawer::kLinks ? "links" : "gpu_tier";
}

std::unique_ptr<DeviceEnv::Memory> DeviceEnv::CudaMemory() {
  return std::make_unique<CudaDriverMemory>();
}

DeviceEnv::DeviceEnv(uint64_t budget_bytes, std::unique_ptr<Memory> memory)
    : budget_(budget_bytes), memory_(std::move(memory)) {}

DeviceEnv::Grant::~Grant() {
  if (env_ != nullptr) env_->Return(device_, drawer_, bytes_);
}

absl::StatusOr<DeviceEnv::Grant> DeviceEnv::Reserve(int device, uint64_t bytes, Drawer drawer) {
  {
    absl::MutexLock lock(&mu_);
    Held& h = held_[device];
    const uint64_t held = h[0] + h[1] + h[2];
    if (device >= 0 && budget_ > 0 && held + bytes > budget_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          DrawerName(drawer), " need ", bytes, " bytes of GPU memory on cuda:", device,
          "; engine.gpu_memory_bytes is ", budget_, " and ", held, " are held (puts ", h[0],
          ", links ", h[1], ", GPU tier ", h[2], ")"));
    }
    h[static_cast<int>(drawer)] += bytes;
  }
  Grant g;
  g.env_ = this;
  g.keep_ = weak_from_this().lock();
  g.device_ = device;
  g.drawer_ = drawer;
  g.bytes_ = bytes;
  return g;
}

absl::StatusOr<std::shared_ptr<uint8_t>> DeviceEnv::Allocate(int device, uint64_t bytes,
                                                             Drawer drawer) {
  KVCOMP_ASSIGN_OR_RETURN(Grant grant, Reserve(device, bytes, drawer));
  KVCOMP_ASSIGN_OR_RETURN(void* p, memory_->Alloc(device, bytes));
  auto held = std::make_shared<Grant>(std::move(grant));
  return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p),
                                  [this, device, held = std::move(held)](uint8_t* q) mutable {
                                    memory_->Free(device, q);
                                    held.reset();
                                  });
}

absl::StatusOr<std::shared_ptr<uint8_t>> DeviceEnv::AllocatePinned(int device, uint64_t bytes) {
  KVCOMP_ASSIGN_OR_RETURN(void* p, memory_->AllocPinned(device, bytes));
  auto keep = weak_from_this().lock();
  return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [this, device, keep](uint8_t* q) {
    memory_->FreePinned(device, q);
  });
}

uint64_t DeviceEnv::held_bytes(int device) const {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(device);
  return it == held_.end() ? 0 : it->second[0] + it->second[1] + it->second[2];
}

uint64_t DeviceEnv::held_bytes(int device, Drawer drawer) const {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(device);
  return it == held_.end() ? 0 : it->second[static_cast<int>(drawer)];
}

void DeviceEnv::Return(int device, Drawer drawer, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  held_[device][static_cast<int>(drawer)] -= bytes;
}

}  // namespace service
}  // namespace kvcomp
