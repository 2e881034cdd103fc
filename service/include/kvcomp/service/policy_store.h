// Per-tenant and per-model compression policies, set over the control plane and kept durable
// so they survive restarts: each change is one small record appended to <path>.log and synced
// before Set returns; the log is folded into the YAML snapshot at <path> (replaced atomically)
// once it holds more records than the live policies and kMinCompactRecords. A record torn by a
// crash (the log's last line) is ignored at open. Resolution for a put: the put's own policy,
// else (tenant, model), else (tenant, ""), else the daemon's default_policy. Thread-safe;
// Resolve never waits for a write to reach the disk.
#ifndef KVCOMP_SERVICE_POLICY_STORE_H_
#define KVCOMP_SERVICE_POLICY_STORE_H_

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kvcomp/core/policy.h"

namespace kvcomp {
namespace service {

// What one tenant may do to its policies.
struct PolicyLimits {
  // Policies (models, plus the tenant's default) one tenant may hold; 0 = no bound.
  uint32_t max_per_tenant = 0;
  // SetPolicy calls per second one tenant may make (a burst of twice as many, at least 1);
  // 0 = no bound.
  double updates_per_second = 0;
};

class PolicyStore {
 public:
  // Loads `path` and replays `<path>.log` if they exist (InvalidArgument when the snapshot is
  // malformed). An empty path keeps policies in memory only.
  static absl::StatusOr<std::unique_ptr<PolicyStore>> Open(const std::string& path,
                                                           const CompressionPolicy& fallback,
                                                           PolicyLimits limits = {});
  ~PolicyStore();

  // The policy in force for (tenant, model) and whether it is the daemon default.
  std::pair<CompressionPolicy, bool> Resolve(absl::string_view tenant,
                                             absl::string_view model_id) const;
  // Validates and stores (model_id "" = the tenant's default) once its record is synced.
  // ResourceExhausted when the tenant holds max_per_tenant policies and this is a new one, or
  // calls faster than updates_per_second; Internal when the record cannot be written.
  absl::Status Set(absl::string_view tenant, absl::string_view model_id,
                   const CompressionPolicy& policy);

  // Records in the log not yet folded into the snapshot.
  uint64_t log_records() const;
  static constexpr uint64_t kMinCompactRecords = 1024;

  // Policy <-> YAML map of its fields (names as in default_policy.* of the configuration).
  static std::string PolicyToYaml(const CompressionPolicy& policy);

 private:
  PolicyStore(std::string path, CompressionPolicy fallback, PolicyLimits limits)
      : path_(std::move(path)), log_path_(path_.empty() ? "" : path_ + ".log"),
        fallback_(std::move(fallback)), limits_(limits) {}
  // Replays the log's records over the snapshot; the count of good ones goes to log_records_.
  absl::Status ReplayLog() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_, mu_);
  // Appends and syncs one record.
  absl::Status Append(const std::string& tenant, const std::string& model,
                      const CompressionPolicy& policy) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // Writes the snapshot of every policy, then empties the log.
  absl::Status Compact() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // Takes one of the tenant's update tokens; false when it has none.
  bool TakeUpdateToken(const std::string& tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);

  const std::string path_;
  const std::string log_path_;
  const CompressionPolicy fallback_;
  const PolicyLimits limits_;
  // Held by writers (Set) across the record's write and sync; Resolve takes only mu_.
  mutable absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  int log_fd_ ABSL_GUARDED_BY(write_mu_) = -1;
  uint64_t log_records_ ABSL_GUARDED_BY(write_mu_) = 0;
  struct Bucket {
    double tokens = 0;
    int64_t last_ns = 0;
  };
  std::map<std::string, Bucket> buckets_ ABSL_GUARDED_BY(write_mu_);
  mutable absl::Mutex mu_;
  // tenant -> model ("" = tenant default) -> policy
  std::map<std::string, std::map<std::string, CompressionPolicy>> policies_ ABSL_GUARDED_BY(mu_);
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_POLICY_STORE_H_
