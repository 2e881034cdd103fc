#include "kvcomp/service/policy_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kvcomp/core/crc32c.h"
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

// A log record: "<crc32c of the rest, 8 hex digits> <tenant>\t<model>\t<policy YAML>\n", each
// field C-escaped (so neither holds a tab or a newline).
std::string EncodeRecord(const std::string& tenant, const std::string& model,
                         const CompressionPolicy& policy) {
  const std::string body = absl::StrCat(absl::CEscape(tenant), "\t", absl::CEscape(model), "\t",
                                        absl::CEscape(PolicyStore::PolicyToYaml(policy)));
  return absl::StrCat(absl::StrFormat("%08x", Crc32c(body.data(), body.size())), " ", body, "\n");
}

struct Record {
  std::string tenant, model;
  CompressionPolicy policy;
};

// One line of the log (without its newline), or why it is not a record.
absl::StatusOr<Record> DecodeRecord(absl::string_view line) {
  if (line.size() < 10 || line[8] != ' ') return absl::DataLossError("short record");
  const absl::string_view body = line.substr(9);
  uint32_t crc = 0;
  if (!absl::SimpleHexAtoi(line.substr(0, 8), &crc) || crc != Crc32c(body.data(), body.size())) {
    return absl::DataLossError("record checksum mismatch");
  }
  std::vector<absl::string_view> parts = absl::StrSplit(body, '\t');
  if (parts.size() != 3) return absl::DataLossError("record without three fields");
  Record r;
  std::string yaml;
  if (!absl::CUnescape(parts[0], &r.tenant) || !absl::CUnescape(parts[1], &r.model) ||
      !absl::CUnescape(parts[2], &yaml)) {
    return absl::DataLossError("record with a bad escape");
  }
  try {
    // A record without a field was written before the field (or its default) changed.
    KVCOMP_ASSIGN_OR_RETURN(r.policy, PolicyFromYaml(YAML::Load(yaml), AbsentFieldPolicy()));
  } catch (const YAML::Exception& e) {
    return absl::DataLossError(absl::StrCat("record policy: ", e.what()));
  }
  return r;
}

absl::Status SyncDirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot open ", dir));
  const int rc = fsync(fd);
  ::close(fd);
  return rc == 0 ? absl::OkStatus() : absl::InternalError(absl::StrCat("cannot sync ", dir));
}

}  // namespace

std::string PolicyStore::PolicyToYaml(const CompressionPolicy& policy) {
  YAML::Emitter out;
  out << PolicyNode(policy);
  return out.c_str();
}

absl::StatusOr<std::unique_ptr<PolicyStore>> PolicyStore::Open(const std::string& path,
                                                               const CompressionPolicy& fallback,
                                                               PolicyLimits limits) {
  std::unique_ptr<PolicyStore> store(new PolicyStore(path, fallback, limits));
  if (path.empty()) return store;
  absl::MutexLock write_lock(&store->write_mu_);
  absl::MutexLock lock(&store->mu_);
  std::ifstream in(path);
  if (in) {
    std::stringstream ss;
    ss << in.rdbuf();
    try {
      YAML::Node root = YAML::Load(ss.str());
      if (!root.IsNull() && !root.IsMap()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": not a map"));
      }
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
  }
  KVCOMP_RETURN_IF_ERROR(store->ReplayLog());
  store->log_fd_ = ::open(store->log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (store->log_fd_ < 0) {
    return absl::PermissionDeniedError(absl::StrCat("cannot open ", store->log_path_));
  }
  return store;
}

PolicyStore::~PolicyStore() {
  absl::MutexLock lock(&write_mu_);
  if (log_fd_ >= 0) ::close(log_fd_);
}

absl::Status PolicyStore::ReplayLog() {
  std::ifstream in(log_path_);
  if (!in) return absl::OkStatus();
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  size_t pos = 0;
  uint64_t good = 0, bad = 0;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) {
      // The last record, torn by a crash before its sync (never acknowledged): cut off, so the
      // next record starts a line of its own.
      ++bad;
      if (truncate(log_path_.c_str(), static_cast<off_t>(pos)) != 0) {
        return absl::InternalError(absl::StrCat("cannot cut the torn record off ", log_path_));
      }
      break;
    }
    absl::StatusOr<Record> r = DecodeRecord(absl::string_view(text).substr(pos, nl - pos));
    pos = nl + 1;
    if (!r.ok()) {
      ++bad;
      continue;
    }
    policies_[r->tenant][r->model] = r->policy;
    ++good;
  }
  log_records_ = good + bad;
  if (bad > 0) {
    std::fprintf(stderr, "policies: %llu unreadable record(s) in %s skipped\n",
                 static_cast<unsigned long long>(bad), log_path_.c_str());
  }
  return absl::OkStatus();
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

bool PolicyStore::TakeUpdateToken(const std::string& tenant) {
  if (limits_.updates_per_second <= 0) return true;
  const double burst = std::max(1.0, 2 * limits_.updates_per_second);
  const int64_t now = absl::GetCurrentTimeNanos();
  auto [it, fresh] = buckets_.try_emplace(tenant);
  Bucket& b = it->second;
  if (fresh) {
    b.tokens = burst;
  } else {
    b.tokens = std::min(burst, b.tokens + limits_.updates_per_second *
                                              static_cast<double>(now - b.last_ns) * 1e-9);
  }
  b.last_ns = now;
  if (b.tokens < 1) return false;
  b.tokens -= 1;
  return true;
}

absl::Status PolicyStore::Set(absl::string_view tenant_view, absl::string_view model_id,
                              const CompressionPolicy& policy) {
  KVCOMP_RETURN_IF_ERROR(policy.Validate());
  const std::string tenant(tenant_view);
  const std::string model(model_id);
  absl::MutexLock write_lock(&write_mu_);
  if (limits_.max_per_tenant > 0) {
    absl::MutexLock lock(&mu_);
    auto t = policies_.find(tenant);
    if (t != policies_.end() && t->second.count(model) == 0 &&
        t->second.size() >= limits_.max_per_tenant) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the tenant holds ", t->second.size(),
                       " policies (control_plane.max_policies_per_tenant); set an existing "
                       "model's or the tenant default instead"));
    }
  }
  if (!TakeUpdateToken(tenant)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("policy updates faster than control_plane.policy_updates_per_second (",
                     limits_.updates_per_second, ") for this tenant; retry later"));
  }
  if (!path_.empty()) {
    KVCOMP_RETURN_IF_ERROR(Append(tenant, model, policy));
  }
  {
    absl::MutexLock lock(&mu_);
    policies_[tenant][model] = policy;
  }
  if (!path_.empty() && log_records_ >= kMinCompactRecords) {
    uint64_t live = 0;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [t, models] : policies_) live += models.size();
    }
    if (log_records_ > live) {
      // The record is durable already: a failed fold leaves the log to replay.
      absl::Status folded = Compact();
      if (!folded.ok()) {
        std::fprintf(stderr, "policies: folding %s into %s failed: %s\n", log_path_.c_str(),
                     path_.c_str(), folded.ToString().c_str());
      }
    }
  }
  return absl::OkStatus();
}

absl::Status PolicyStore::Append(const std::string& tenant, const std::string& model,
                                 const CompressionPolicy& policy) {
  if (log_fd_ < 0) return absl::InternalError(absl::StrCat(log_path_, " is not open"));
  const std::string record = EncodeRecord(tenant, model, policy);
  size_t done = 0;
  while (done < record.size()) {
    const ssize_t n = ::write(log_fd_, record.data() + done, record.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // A partial record is skipped at open (its checksum fails); the policy is not set.
      return absl::InternalError(absl::StrCat("cannot append to ", log_path_, ": ",
                                              std::strerror(errno)));
    }
    done += static_cast<size_t>(n);
  }
  if (fdatasync(log_fd_) != 0) {
    return absl::InternalError(absl::StrCat("cannot sync ", log_path_, ": ", std::strerror(errno)));
  }
  ++log_records_;
  return absl::OkStatus();
}

uint64_t PolicyStore::log_records() const {
  absl::MutexLock lock(&write_mu_);
  return log_records_;
}

absl::Status PolicyStore::Compact() {
  YAML::Node root;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [tenant, models] : policies_) {
      for (const auto& [model, policy] : models) {
        root[tenant][model.empty() ? std::string("*") : model] = PolicyNode(policy);
      }
    }
  }
  YAML::Emitter out;
  out << root;
  const std::string tmp = path_ + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << "# kvcompd per-tenant policies (SetPolicy; '*' = the tenant's default). Changes since "
         "the last fold are in the .log beside it.\n"
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
  KVCOMP_RETURN_IF_ERROR(SyncDirectoryOf(path_));
  // The snapshot holds every record: the log starts over (replaying it again would be harmless).
  if (ftruncate(log_fd_, 0) != 0 || fdatasync(log_fd_) != 0) {
    return absl::InternalError(absl::StrCat("cannot empty ", log_path_));
  }
  log_records_ = 0;
  return absl::OkStatus();
}

}  // namespace service
}  // namespace kvcomp
