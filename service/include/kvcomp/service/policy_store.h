// Per-tenant and per-model compression policies, set over the control plane and persisted in a
// YAML file (<data_dir>/policies.yaml, replaced atomically on every change) so they survive
// restarts. Resolution for a put: the put's own policy, else (tenant, model), else (tenant, ""),
// else the daemon's default_policy. Thread-safe.
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

class PolicyStore {
 public:
  // Loads `path` if it exists (InvalidArgument when it is malformed). An empty path keeps
  // policies in memory only.
  static absl::StatusOr<std::unique_ptr<PolicyStore>> Open(const std::string& path,
                                                           const CompressionPolicy& fallback);

  // The policy in force for (tenant, model) and whether it is the daemon default.
  std::pair<CompressionPolicy, bool> Resolve(absl::string_view tenant,
                                             absl::string_view model_id) const;
  // Validates and stores (model_id "" = the tenant's default), then persists.
  absl::Status Set(absl::string_view tenant, absl::string_view model_id,
                   const CompressionPolicy& policy);

  // Policy <-> YAML map of its fields (names as in default_policy.* of the configuration).
  static std::string PolicyToYaml(const CompressionPolicy& policy);

 private:
  PolicyStore(std::string path, CompressionPolicy fallback)
      : path_(std::move(path)), fallback_(std::move(fallback)) {}
  absl::Status Persist() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const CompressionPolicy fallback_;
  mutable absl::Mutex mu_;
  // tenant -> model ("" = tenant default) -> policy
  std::map<std::string, std::map<std::string, CompressionPolicy>> policies_ ABSL_GUARDED_BY(mu_);
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_POLICY_STORE_H_
