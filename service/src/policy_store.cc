#include "kvcomp/service/policy_store.h"

#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/policy_fields.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace service {
namespace {

// A policy as a YAML map of its fields, spelled as core declares them (policy_fields.def): the
// keys and text of default_policy.* in the configuration; doubles in their shortest exact form.
absl::StatusOr<CompressionPolicy> PolicyFromYaml(const YAML::Node& node,
                                                 const CompressionPolicy& base) {
  CompressionPolicy p = base;
  if (!node.IsMap()) return absl::InvalidArgumentError("a policy must be a YAML map");
  for (const auto& kv : node) {
    const std::string key = kv.first.Scalar();
    const PolicyFieldInfo* f = FindPolicyField(key);
    if (f == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown policy field ", key));
    KVCOMP_RETURN_IF_ERROR(Annotate(f->set(p, kv.second.Scalar()), "policy"));
  }
  KVCOMP_RETURN_IF_ERROR(p.Validate());
  return p;
}

YAML::Node PolicyNode(const CompressionPolicy& policy) {
  YAML::Node node;
  for (const PolicyFieldInfo& f : PolicyFields()) node[std::string(f.name)] = f.text(policy);
  return node;
}

}  // namespace

std::string PolicyStore::PolicyToYaml(const CompressionPolicy& policy) {
  YAML::Emitter out;
  out << PolicyNode(policy);
  return out.c_str();
}

absl::StatusOr<std::unique_ptr<PolicyStore>> PolicyStore::Open(const std::string& path,
                                                               const CompressionPolicy& fallback) {
  std::unique_ptr<PolicyStore> store(new PolicyStore(path, fallback));
  if (path.empty()) return store;
  std::ifstream in(path);
  if (!in) return store;  // none yet
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    YAML::Node root = YAML::Load(ss.str());
    if (root.IsNull()) return store;
    if (!root.IsMap()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a map"));
    absl::MutexLock lock(&store->mu_);
    for (const auto& tenant : root) {
      for (const auto& model : tenant.second) {
        auto p = PolicyFromYaml(model.second, CompressionPolicy());
        if (!p.ok()) return Annotate(p.status(), path);
        std::string model_id = model.first.Scalar();
        if (model_id == "*") model_id.clear();
        store->policies_[tenant.first.Scalar()][model_id] = *p;
      }
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  return store;
}

std::pair<CompressionPolicy, bool> PolicyStore::Resolve(absl::string_view tenant,
                                                        absl::string_view model_id) const {
  absl::MutexLock lock(&mu_);
  auto t = policies_.find(std::string(tenant));
  if (t != policies_.end()) {
    auto m = t->second.find(std::string(model_id));
    if (m != t->second.end()) return {m->second, false};
    m = t->second.find("");
    if (m != t->second.end()) return {m->second, false};
  }
  return {fallback_, true};
}

absl::Status PolicyStore::Set(absl::string_view tenant, absl::string_view model_id,
                              const CompressionPolicy& policy) {
  KVCOMP_RETURN_IF_ERROR(policy.Validate());
  absl::MutexLock lock(&mu_);
  auto& models = policies_[std::string(tenant)];
  const std::string model(model_id);
  auto it = models.find(model);
  std::optional<CompressionPolicy> previous;
  if (it != models.end()) previous = it->second;
  models[model] = policy;
  absl::Status s = Persist();
  if (!s.ok()) {
    if (previous) {
      models[model] = *previous;
    } else {
      models.erase(model);
    }
  }
  return s;
}

absl::Status PolicyStore::Persist() const {
  if (path_.empty()) return absl::OkStatus();
  YAML::Node root;
  for (const auto& [tenant, models] : policies_) {
    for (const auto& [model, policy] : models) {
      root[tenant][model.empty() ? std::string("*") : model] = PolicyNode(policy);
    }
  }
  YAML::Emitter out;
  out << root;
  std::string tmp = path_ + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << "# kvcompd per-tenant policies (written by SetPolicy; '*' = the tenant's default)\n"
      << out.c_str() << "\n";
    f.flush();
    if (!f) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (FILE* fp = std::fopen(tmp.c_str(), "r")) {
    fsync(fileno(fp));
    std::fclose(fp);
  }
  if (std::rename(tmp.c_str(), path_.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot replace ", path_));
  }
  return absl::OkStatus();
}

}  // namespace service
}  // namespace kvcomp
