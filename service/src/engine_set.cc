#include "engine_set.h"

#include <algorithm>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/backend.h"
#include "kvcomp/service/config.h"

namespace kvcomp {
namespace service {

namespace {

// What is left of the engine's cap; without a cap, the most that can be left less what is held.
uint64_t Headroom(const Engine& e) {
  const uint64_t held = e.device_reserved_bytes();
  const uint64_t cap = e.device_cap_bytes();
  if (cap == 0) return std::numeric_limits<uint64_t>::max() - held;
  return cap > held ? cap - held : 0;
}

std::string DeviceName(const Engine& e) {
  return e.cuda_device() >= 0 ? absl::StrCat("cuda:", e.cuda_device()) : std::string("cpu");
}

}  // namespace

absl::StatusOr<std::unique_ptr<EngineSet>> EngineSet::Create(const EngineOptions& options,
                                                             double tenant_share,
                                                             std::shared_ptr<DeviceEnv> env) {
  KVCOMP_ASSIGN_OR_RETURN(const std::vector<int> devices, EngineCudaDevices(options));
  const bool gpu =
      options.backend == "cuda" || (options.backend == "auto" && CudaAvailable());
  // One DeviceEnv for every engine: each device's budget, drawn from by the engines' puts and
  // the links' buffers on it.
  if (env == nullptr) {
    env = std::make_shared<DeviceEnv>(options.gpu_memory_bytes, DeviceEnv::CudaMemory());
  }
  std::vector<std::unique_ptr<Engine>> engines;
  for (const int device : gpu ? devices : std::vector<int>{-1}) {  // -1: the one CPU engine
    EngineOptions o = options;
    if (device >= 0) o.cuda_device = device;
    auto e = Engine::Create(o, tenant_share, env);
    if (!e.ok() && devices.size() > 1 && gpu) {
      return Annotate(e.status(), absl::StrCat("engine on cuda:", device));
    }
    if (!e.ok()) return e.status();
    engines.push_back(*std::move(e));
  }
  return std::make_unique<EngineSet>(std::move(engines));
}

EngineSet::EngineSet(std::vector<std::unique_ptr<Engine>> engines)
    : engines_(std::move(engines)) {}

EngineSet::~EngineSet() { Shutdown(); }

Engine* EngineSet::OnDevice(int device) const {
  for (const auto& e : engines_) {
    if (e->cuda_device() == device) return e.get();
  }
  return nullptr;
}

std::vector<size_t> EngineSet::Order(int device) const {
  const size_t n = engines_.size();
  const size_t start = next_.load() % n;
  // (headroom, queue, distance from the tie-break cursor) of each candidate.
  std::vector<std::tuple<uint64_t, size_t, size_t, size_t>> keyed;
  for (size_t i = 0; i < n; ++i) {
    const Engine& e = *engines_[i];
    if (e.failed() || (device >= 0 && e.cuda_device() != device)) continue;
    keyed.emplace_back(Headroom(e), e.queue_depth(), (i + n - start) % n, i);
  }
  std::sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) {
    if (std::get<0>(a) != std::get<0>(b)) return std::get<0>(a) > std::get<0>(b);
    if (std::get<1>(a) != std::get<1>(b)) return std::get<1>(a) < std::get<1>(b);
    return std::get<2>(a) < std::get<2>(b);
  });
  std::vector<size_t> order;
  for (const auto& k : keyed) order.push_back(std::get<3>(k));
  return order;
}

absl::StatusOr<EngineSet::Placement> EngineSet::Place(uint64_t bytes, int device) {
  if (device >= 0 && OnDevice(device) == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("no engine runs on cuda:", device, " (engine.cuda_devices)"));
  }
  const std::vector<size_t> order = Order(device);
  if (order.empty()) {
    const std::string why = device >= 0 ? OnDevice(device)->failure() : failure();
    return absl::UnavailableError(absl::StrCat("engine failed (", why, "): kvcompd is draining"));
  }
  std::vector<std::string> refusals;
  absl::Status last;
  for (size_t i : order) {
    Engine& e = *engines_[i];
    // A GPU whose driver reports less free memory than the put needs (other processes' memory
    // counted) is passed over: reservations alone do not see what is not kvcompd's.
    if (bytes > 0 && e.uses_gpu()) {
      absl::StatusOr<DeviceMemory> mem = QueryDeviceMemory(e.cuda_device());
      if (mem.ok() && mem->free_bytes < bytes) {
        last = absl::ResourceExhaustedError(
            absl::StrCat("put needs ", bytes, " bytes of GPU memory; the device has ",
                         mem->free_bytes, " free"));
        refusals.push_back(absl::StrCat(DeviceName(e), ": ", last.message()));
        continue;
      }
    }
    absl::StatusOr<Engine::DeviceReservation> r = e.ReserveDevice(bytes);
    if (r.ok()) {
      next_.store(i + 1);
      Placement p;
      p.engine = &e;
      p.reservation = *std::move(r);
      return p;
    }
    last = r.status();
    refusals.push_back(absl::StrCat(DeviceName(e), ": ", r.status().message()));
  }
  // One candidate: its own answer, as a daemon with one engine gives it.
  if (refusals.size() == 1) return last;
  if (absl::IsResourceExhausted(last)) {
    return absl::ResourceExhaustedError(absl::StrCat("no engine has room for the put (",
                                                     absl::StrJoin(refusals, "; "), ")"));
  }
  return absl::Status(last.code(), absl::StrJoin(refusals, "; "));
}

Engine* EngineSet::Pick() {
  const std::vector<size_t> order = Order(-1);
  if (order.empty()) return nullptr;
  next_.store(order[0] + 1);
  return engines_[order[0]].get();
}

bool EngineSet::failed() const {
  for (const auto& e : engines_) {
    if (e->failed()) return true;
  }
  return false;
}

std::string EngineSet::failure() const {
  for (const auto& e : engines_) {
    if (e->failed()) return e->failure();
  }
  return "";
}

std::string EngineSet::description() const {
  std::vector<std::string> parts;
  for (const auto& e : engines_) parts.push_back(e->description());
  return absl::StrJoin(parts, "; ");
}

size_t EngineSet::queue_depth() const {
  size_t depth = 0;
  for (const auto& e : engines_) depth += e->queue_depth();
  return depth;
}

bool EngineSet::WaitIdle(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  for (const auto& e : engines_) {
    if (!e->WaitIdle(std::max(deadline - absl::Now(), absl::ZeroDuration()))) return false;
  }
  return true;
}

void EngineSet::Shutdown() {
  for (const auto& e : engines_) e->Shutdown();
}

}  // namespace service
}  // namespace kvcomp
