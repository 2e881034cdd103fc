// Per-tenant tokens for both planes (UCX hello and every Thrift call).
//
// Mode: with no token source configured (auth.token_file empty) the daemon is open and
// single-tenant: every request acts as tenant "default", whatever credentials it sends (for
// local use; the daemon says so loudly at start). Once a token source is configured,
// authentication is required, and nothing read from the source can lower that: the source must
// hold at least one valid token at Open, and a reload that finds it missing, unreadable, not a
// regular file or directory, empty, comments only or malformed keeps the previous tokens and
// returns the error (the caller logs and counts it).
//
// Sources: auth.token_file names either a YAML map file (`tenant: token` per line) or a
// directory, as Kubernetes mounts a Secret: every regular file not starting with '.' is a
// tenant named after the file, its content (trimmed) the token.
//
// Reload: Reload() re-reads the source (SIGHUP); MaybeReload() does so when a modification time
// changed since the last load.
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

enum class AuthMode {
  kOpen,      // no token source configured: every request is tenant "default"
  kRequired,  // a token source is configured: every request needs a tenant's token
};

class TokenStore {
 public:
  // Loads `path` ("" = open mode). With a path: NotFound when it does not exist,
  // FailedPrecondition when it cannot be read, is neither a regular file nor a directory, or
  // holds no token (empty, comments only, empty directory), InvalidArgument when malformed (bad
  // YAML, a tenant name CacheKey would reject, an empty token). The daemon refuses to start on
  // any of these.
  static absl::StatusOr<std::unique_ptr<TokenStore>> Open(const std::string& path);

  // The tenant a request acts for: in open mode "default"; otherwise `tenant` ("" reads as
  // "default") when `token` is that tenant's token (constant-time comparison).
  // Unauthenticated (missing token, unknown tenant or wrong token; one message for all, so a
  // caller learns nothing about which tenants exist).
  absl::StatusOr<std::string> Authenticate(absl::string_view tenant, absl::string_view token) const;

  AuthMode mode() const { return path_.empty() ? AuthMode::kOpen : AuthMode::kRequired; }
  bool open_mode() const { return mode() == AuthMode::kOpen; }
  std::vector<std::string> tenants() const;  // sorted; {"default"} in open mode
  // Re-reads the source. On any error (the cases of Open) the previous tokens stay in force.
  absl::Status Reload();
  // Reloads when the source's modification time changed; returns whether it reloaded. A failed
  // reload is not retried (nor reported again) until the source changes again or Reload runs.
  absl::StatusOr<bool> MaybeReload();
  const std::string& path() const { return path_; }

  // The tokens of a token file's text (the YAML map form), tenant -> token, with the checks of
  // Open less the file system and the "no token" rule; `source` names it in errors.
  static absl::StatusOr<absl::flat_hash_map<std::string, std::string>> ParseTokenFile(
      absl::string_view text, const std::string& source);

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
