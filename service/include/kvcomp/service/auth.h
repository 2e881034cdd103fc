// Per-tenant tokens for both planes (UCX hello and every Thrift call).
//
// Sources: auth.token_file names either a YAML map file (`tenant: token` per line) or a
// directory, as Kubernetes mounts a Secret: every regular file not starting with '.' is a
// tenant named after the file, its content (trimmed) the token. An empty path, an empty file or
// an empty directory means an open, single-tenant daemon: every request acts as tenant
// "default", whatever credentials it sends.
//
// Reload: Reload() re-reads the source (SIGHUP); MaybeReload() does so when a modification time
// changed since the last load. A reload that fails keeps the previous tokens (and says why).
//
// Thread-safe: Authenticate may run on any thread concurrently with a reload.
#ifndef KVCOMP_SERVICE_AUTH_H_
#define KVCOMP_SERVICE_AUTH_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace kvcomp {
namespace service {

class TokenStore {
 public:
  // Loads `path` ("" = open mode). InvalidArgument for a malformed file (bad YAML, a tenant name
  // CacheKey would reject, an empty token); NotFound when the path does not exist.
  static absl::StatusOr<std::unique_ptr<TokenStore>> Open(const std::string& path);

  // The tenant a request acts for: in open mode "default"; otherwise `tenant` ("" reads as
  // "default") when `token` is that tenant's token (constant-time comparison).
  // Unauthenticated (missing token, unknown tenant or wrong token; one message for all, so a
  // caller learns nothing about which tenants exist).
  absl::StatusOr<std::string> Authenticate(absl::string_view tenant, absl::string_view token) const;

  bool open_mode() const;
  std::vector<std::string> tenants() const;  // sorted; {"default"} in open mode
  absl::Status Reload();
  // Reloads when the source's modification time changed; returns whether it reloaded.
  absl::StatusOr<bool> MaybeReload();
  const std::string& path() const { return path_; }

 private:
  explicit TokenStore(std::string path) : path_(std::move(path)) {}
  struct Loaded {
    absl::flat_hash_map<std::string, std::string> tokens;
    int64_t mtime_ns = 0;
  };
  absl::StatusOr<Loaded> Load() const;

  const std::string path_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> tokens_ ABSL_GUARDED_BY(mu_);
  int64_t mtime_ns_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_AUTH_H_
