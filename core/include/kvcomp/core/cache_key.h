// The name of a stored cache: an opaque key (a request id or a prefix hash) scoped by tenant and
// model. The service never interprets `key`.
#ifndef KVCOMP_CORE_CACHE_KEY_H_
#define KVCOMP_CORE_CACHE_KEY_H_

#include <cstddef>
#include <string>

#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcomp {

struct CacheKey {
  static constexpr size_t kMaxTenantBytes = 64;   // [A-Za-z0-9_.-]+, empty means "default"
  static constexpr size_t kMaxModelBytes = 128;   // printable ASCII, no '/' control chars
  static constexpr size_t kMaxKeyBytes = 1024;    // any bytes, 1..1024

  std::string tenant;    // namespace; empty is normalised to "default"
  std::string model_id;  // e.g. "meta-llama/Llama-3.1-8B"
  std::string key;       // opaque bytes

  // OK, or InvalidArgument saying which part is empty, too long or has a forbidden byte.
  absl::Status Validate() const;

  // A canonical, order-preserving byte string: tenant, model and key each length-prefixed
  // (u16 big-endian). All keys of one tenant share the prefix TenantPrefix(tenant).
  std::string Encode() const;
  static absl::StatusOr<CacheKey> Decode(absl::string_view encoded);
  static std::string TenantPrefix(absl::string_view tenant);

  // For logs: tenant/model/hex of up to 16 key bytes.
  std::string DebugString() const;

  friend bool operator==(const CacheKey& a, const CacheKey& b) {
    return a.tenant == b.tenant && a.model_id == b.model_id && a.key == b.key;
  }
  friend bool operator!=(const CacheKey& a, const CacheKey& b) { return !(a == b); }
  template <typename H>
  friend H AbslHashValue(H h, const CacheKey& k) {
    return H::combine(std::move(h), k.tenant, k.model_id, k.key);
  }
};

}  // namespace kvcomp

#endif  // KVCOMP_CORE_CACHE_KEY_H_
