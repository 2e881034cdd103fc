// Admission of the data plane's resources: a budget of units (bytes, puts, connections) with a
// total limit and a per-tenant share, consulted before a resource exists; the file-descriptor
// headroom of the process; and a rate limiter for repeated log lines (UCX's included).
#ifndef KVCOMP_TRANSPORT_SRC_ADMISSION_H_
#define KVCOMP_TRANSPORT_SRC_ADMISSION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvcomp {
namespace transport {

// Units held per tenant against a total limit and a per-tenant limit. TryReserve admits a
// request only when both hold afterwards; Release returns what a reservation took. Thread-safe
// (reservations are released from any thread, e.g. when a block's buffer is freed).
class TenantBudget {
 public:
  // `tenant_limit` <= `total`: see ShareOf.
  TenantBudget(uint64_t total, uint64_t tenant_limit) : total_(total), tenant_limit_(tenant_limit) {}
  // Per-tenant limit of a share in (0, 1] of `total`, at least `floor` and at most `total`.
  static uint64_t ShareOf(uint64_t total, double share, uint64_t floor);

  // Why a reservation failed.
  enum class Refusal { kNone, kTotal, kTenant };
  Refusal TryReserve(absl::string_view tenant, uint64_t units);
  void Release(absl::string_view tenant, uint64_t units);

  uint64_t total_limit() const { return total_; }
  uint64_t tenant_limit() const { return tenant_limit_; }
  uint64_t used() const;
  uint64_t used_by(absl::string_view tenant) const;

 private:
  const uint64_t total_;
  const uint64_t tenant_limit_;
  mutable absl::Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, uint64_t> by_tenant_ ABSL_GUARDED_BY(mu_);
};

// The process's open file descriptors and its soft RLIMIT_NOFILE.
struct FdUsage {
  uint64_t open = 0;
  uint64_t limit = 0;  // 0 when unknown
  uint64_t free() const { return limit > open ? limit - open : 0; }
};
FdUsage CurrentFdUsage();

// Lets through at most `burst` lines per `period` for each key; the first line after a quiet
// period reports how many were suppressed. Thread-safe.
class LogRateLimiter {
 public:
  LogRateLimiter(int burst, absl::Duration period) : burst_(burst), period_(period) {}
  // True when a line for `key` may be written now; `suppressed` gets the count of lines dropped
  // for this key since the last one written.
  bool Allow(absl::string_view key, uint64_t* suppressed);

 private:
  struct Window {
    absl::Time start;
    int count = 0;
    uint64_t suppressed = 0;
  };
  const int burst_;
  const absl::Duration period_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Window> windows_ ABSL_GUARDED_BY(mu_);
};

// Routes UCX's own log lines through a LogRateLimiter (per source line: at most 5 a second),
// once per process; lines that report a failed accept() (the listener ran out of file
// descriptors) also call every registered listener-trouble hook. Idempotent.
void InstallUcxLogLimiter();
// Registers `hook` (called on UCX's thread; keep it short) for accept failures; returns an id for
// RemoveAcceptFailureHook.
uint64_t AddAcceptFailureHook(absl::AnyInvocable<void()> hook);
void RemoveAcceptFailureHook(uint64_t id);

}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_SRC_ADMISSION_H_
