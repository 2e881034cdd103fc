#include "kvcomp/service/auth.h"

#include <dirent.h>
#include <sys/stat.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "kvcomp/core/cache_key.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace service {
namespace {

constexpr char kDefaultTenant[] = "default";

int64_t MtimeNs(const struct stat& st) {
  return int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
}

// Reads a regular file (never blocks on a FIFO or a device: those are refused).
absl::StatusOr<std::string> ReadFile(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot read ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a regular file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot read ", path, ": ", std::strerror(errno)));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::FailedPreconditionError(absl::StrCat("cannot read ", path));
  return ss.str();
}

absl::Status CheckTenant(const std::string& tenant, const std::string& token,
                         const std::string& source) {
  CacheKey probe{tenant, "m", "k"};
  if (tenant.empty() || !probe.Validate().ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": tenant name '", tenant, "' is not [A-Za-z0-9_.-]{1,64}"));
  }
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": tenant '", tenant, "' has an empty token"));
  }
  return absl::OkStatus();
}

// Compares without an early exit, so timing does not reveal a matching prefix.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? a[i] : 0;
    unsigned char y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

}  // namespace

absl::StatusOr<absl::flat_hash_map<std::string, std::string>> TokenStore::ParseTokenFile(
    absl::string_view text, const std::string& source) {
  absl::flat_hash_map<std::string, std::string> tokens;
  YAML::Node root;
  try {
    root = YAML::Load(std::string(text));
    if (root.IsNull()) return tokens;
    if (!root.IsMap()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": expected `tenant: token` lines"));
    }
    for (const auto& kv : root) {
      if (!kv.first.IsScalar() || !kv.second.IsScalar()) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": every entry must be `tenant: token` (two strings)"));
      }
      std::string tenant = kv.first.Scalar();
      std::string token = kv.second.Scalar();
      KVCOMP_RETURN_IF_ERROR(CheckTenant(tenant, token, source));
      if (!tokens.emplace(tenant, token).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": tenant '", tenant, "' is listed twice"));
      }
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", e.what()));
  }
  return tokens;
}

absl::StatusOr<TokenStore::Loaded> TokenStore::Load() const {
  Loaded loaded;
  if (path_.empty()) return loaded;
  struct stat st;
  if (stat(path_.c_str(), &st) != 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("auth.token_file ", path_, " does not exist"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("auth.token_file ", path_, ": ", std::strerror(errno)));
  }
  loaded.mtime_ns = MtimeNs(st);
  if (S_ISDIR(st.st_mode)) {
    DIR* dir = opendir(path_.c_str());
    if (dir == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot list ", path_, ": ", std::strerror(errno)));
    }
    std::vector<std::string> names;
    while (struct dirent* e = readdir(dir)) {
      if (e->d_name[0] != '.') names.push_back(e->d_name);
    }
    closedir(dir);
    for (const auto& name : names) {
      std::string file = path_ + "/" + name;
      struct stat fst;
      if (stat(file.c_str(), &fst) != 0 || !S_ISREG(fst.st_mode)) continue;
      loaded.mtime_ns = std::max(loaded.mtime_ns, MtimeNs(fst));
      KVCOMP_ASSIGN_OR_RETURN(std::string token, ReadFile(file));
      token = std::string(absl::StripAsciiWhitespace(token));
      KVCOMP_RETURN_IF_ERROR(CheckTenant(name, token, file));
      loaded.tokens[name] = token;
    }
  } else {
    KVCOMP_ASSIGN_OR_RETURN(std::string text, ReadFile(path_));
    KVCOMP_ASSIGN_OR_RETURN(loaded.tokens, ParseTokenFile(text, path_));
  }
  if (loaded.tokens.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "auth.token_file ", path_,
        " holds no token: authentication stays required once a token source is configured "
        "(leave auth.token_file unset to run an open single-tenant daemon)"));
  }
  return loaded;
}

absl::StatusOr<std::unique_ptr<TokenStore>> TokenStore::Open(const std::string& path) {
  std::unique_ptr<TokenStore> store(new TokenStore(path));
  KVCOMP_RETURN_IF_ERROR(store->Reload());
  return store;
}

absl::Status TokenStore::Reload() {
  KVCOMP_ASSIGN_OR_RETURN(Loaded loaded, Load());
  absl::MutexLock lock(&mu_);
  tokens_ = std::move(loaded.tokens);
  mtime_ns_ = loaded.mtime_ns;
  return absl::OkStatus();
}

absl::StatusOr<bool> TokenStore::MaybeReload() {
  if (path_.empty()) return false;
  int64_t now = 0;
  struct stat st;
  if (stat(path_.c_str(), &st) == 0) {
    now = MtimeNs(st);
    if (S_ISDIR(st.st_mode)) {
      // A Secret update swaps a symlink inside the directory; look at the files too.
      if (DIR* dir = opendir(path_.c_str())) {
        while (struct dirent* e = readdir(dir)) {
          struct stat fst;
          std::string f = path_ + "/" + e->d_name;
          if (e->d_name[0] != '.' && stat(f.c_str(), &fst) == 0) now = std::max(now, MtimeNs(fst));
        }
        closedir(dir);
      }
    }
  }
  {
    absl::MutexLock lock(&mu_);
    if (now == mtime_ns_) return false;
  }
  absl::Status s = Reload();
  if (!s.ok()) {
    // Keep the previous tokens, and do not retry (and log) until the source changes again.
    absl::MutexLock lock(&mu_);
    mtime_ns_ = now;
    return s;
  }
  return true;
}

std::vector<std::string> TokenStore::tenants() const {
  if (open_mode()) return {kDefaultTenant};
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const auto& [t, _] : tokens_) out.push_back(t);
  std::sort(out.begin(), out.end());
  return out;
}

absl::StatusOr<std::string> TokenStore::Authenticate(absl::string_view tenant,
                                                     absl::string_view token) const {
  if (open_mode()) return std::string(kDefaultTenant);
  absl::MutexLock lock(&mu_);
  std::string name = tenant.empty() ? std::string(kDefaultTenant) : std::string(tenant);
  auto it = tokens_.find(name);
  // Compare against something even for unknown tenants, to keep timing uniform.
  bool ok = ConstantTimeEquals(it == tokens_.end() ? absl::string_view("\x01") : it->second, token);
  if (it == tokens_.end() || token.empty() || !ok) {
    return absl::UnauthenticatedError(
        "authentication failed: unknown tenant or wrong token (see docs/security.md)");
  }
  return name;
}

}  // namespace service
}  // namespace kvcomp
