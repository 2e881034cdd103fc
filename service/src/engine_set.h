// EngineSet: kvcompd's engines, one per GPU it is given (engine.cuda_devices), or one CPU
// engine, and the choice of the engine each put runs on.
//
// Every engine keeps what engine.h says: its own workers and backends, its uploader and its
// failure state; they share one DeviceEnv (device_env.h), the budget of each device
// (engine.gpu_memory_bytes) that puts and the links' buffers draw from. A put is
// placed once, when it begins (Place), and stays on its engine: its K and V are copied to that
// engine's device, it compresses on that engine's workers, and its cache is encoded on that
// device and handed to the store from there (the GPU tier keeps it in that device's pool).
//
// Placement: among the engines that have not failed, the one with the most free reservation
// headroom (its cap minus what is reserved; without a cap, the least reserved); ties go to the
// shortest queue, then to the engine after the last one chosen, so puts that come one at a time
// still alternate. The chosen engine's reservation is taken at once; when that engine has no room
// after all (another put took it meanwhile), the next in the same order is tried. A caller that
// must use one device (the GPU channel, whose buffers live there) names it.
//
// A failed engine takes no puts; the set is failed as soon as any engine is (the daemon then
// reports not ready, drains and exits, as with one engine).
//
// Thread-safety: every method may be called from any thread.
#ifndef KVCOMP_SERVICE_SRC_ENGINE_SET_H_
#define KVCOMP_SERVICE_SRC_ENGINE_SET_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine.h"
#include "kvcomp/service/options.h"

namespace kvcomp {
namespace service {

class EngineSet {
 public:
  // One engine per device of EngineCudaDevices(options) when the backend is cuda (or auto with a
  // GPU present), else one CPU engine. Errors of Engine::Create, annotated with the device;
  // InvalidArgument for a malformed engine.cuda_devices. `env`: the devices' budget the engines
  // draw from (null: a new one of engine.gpu_memory_bytes over the CUDA driver).
  static absl::StatusOr<std::unique_ptr<EngineSet>> Create(
      const EngineOptions& options, double tenant_share = 1.0,
      std::shared_ptr<DeviceEnv> env = nullptr);
  // Over engines made elsewhere (at least one; tests build sets of CPU engines).
  explicit EngineSet(std::vector<std::unique_ptr<Engine>> engines);
  ~EngineSet();

  size_t size() const { return engines_.size(); }
  Engine& at(size_t i) const { return *engines_[i]; }
  // The first engine: the only one of a CPU or one-GPU daemon.
  Engine& primary() const { return *engines_[0]; }
  // The engine on CUDA device `device`, or nullptr.
  Engine* OnDevice(int device) const;

  // Where a put runs, and what it holds there until the reservation ends.
  struct Placement {
    Engine* engine = nullptr;
    Engine::DeviceReservation reservation;
  };
  // Chooses the engine for a put that holds `bytes` on it (0 for a put that holds nothing there,
  // e.g. block-wise) and reserves them. `device` >= 0 restricts the choice to the engine on that
  // CUDA device. Candidates go in order of room left under engine.gpu_memory_bytes, then queue,
  // then turn; a GPU whose driver reports less free memory than `bytes` is passed over.
  // Unavailable when every candidate engine has failed ("engine failed (...)"); ResourceExhausted
  // when none has room for `bytes`; FailedPrecondition when no engine runs on `device`.
  absl::StatusOr<Placement> Place(uint64_t bytes, int device = -1);
  // The engine Place would choose for a put of no bytes (nullptr when all have failed), without
  // reserving anything, moving the tie-break on as Place does: the GPU channel's choice of
  // device for a new channel.
  Engine* Pick();

  bool uses_gpu() const { return primary().uses_gpu(); }
  // True once any engine has failed; failure() says which and why.
  bool failed() const;
  std::string failure() const;
  // "cpu (N threads)", the one CUDA device, or every engine's description joined by "; ".
  std::string description() const;
  // Committed puts waiting for or in compression, over every engine.
  size_t queue_depth() const;
  bool WaitIdle(absl::Duration timeout) const;
  // Runs what is queued on every engine, then joins their workers.
  void Shutdown();

 private:
  // Candidate engines (not failed; on `device` when >= 0) in the order Place tries them.
  std::vector<size_t> Order(int device) const;

  std::vector<std::unique_ptr<Engine>> engines_;
  std::atomic<size_t> next_{0};  // where the last tie-break left off
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_SRC_ENGINE_SET_H_
