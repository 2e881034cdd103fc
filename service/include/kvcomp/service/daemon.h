// kvcompd as a library: Daemon::Start wires the token store, the tiered store, the policy store,
// the ingest pipeline, the UCX data plane, the Thrift control plane and the HTTP metrics endpoint
// from one Options, and Shutdown takes them down in order. main() only parses the command line,
// handles signals and calls these.
//
// Lifecycle: Start returns once every listener is up and the daemon is ready. Drain() (SIGTERM)
// stops taking new puts and connections while in-flight work finishes; Shutdown(grace) then
// waits for open puts, the compression queue and the serve queue (at most `grace`), stops the
// listeners and closes the store (RocksDB flushed). Acknowledged puts are durable per
// storage.durability whatever happens after the acknowledgement.
//
// Thread-safety: Drain, ReloadTokens and the accessors may be called from any thread;
// Shutdown once.
#ifndef KVCOMP_SERVICE_DAEMON_H_
#define KVCOMP_SERVICE_DAEMON_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvcomp/service/options.h"

namespace kvcomp {
namespace service {

// The daemon's version string ("0.1.0").
const char* Version();

class Daemon {
 public:
  // Errors: whatever a component reports at start (store, ports in use, bad token file, ...),
  // annotated with the component.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const Options& options);
  virtual ~Daemon() = default;

  // Bound ports (the ephemeral ones when configured 0); metrics 0 when disabled.
  virtual uint16_t data_port() const = 0;
  virtual uint16_t control_port() const = 0;
  virtual uint16_t metrics_port() const = 0;
  // "cpu (2 threads)" or the CUDA device.
  virtual std::string backend() const = 0;

  virtual bool ready() const = 0;
  virtual void Drain() = 0;
  // Drains (if not yet), waits up to `grace` for in-flight work, stops everything.
  // DeadlineExceeded when work was still in flight at the deadline (it is then cancelled).
  virtual absl::Status Shutdown(absl::Duration grace) = 0;
  // Re-reads the token file (SIGHUP); on error the previous tokens stay.
  virtual absl::Status ReloadTokens() = 0;
  // Periodic housekeeping (token file mtime check); call about once a second.
  virtual void Tick() = 0;
  // True once the compression engine has failed (a sticky GPU error): the daemon is draining
  // and not ready; the caller shuts it down and exits non-zero for its supervisor to restart it.
  virtual bool failed() const { return false; }
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_DAEMON_H_
