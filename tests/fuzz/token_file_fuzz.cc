// libFuzzer target for the token file parser (TokenStore::ParseTokenFile, the YAML map form of
// auth.token_file). Any input gets a status, never a crash; a file it accepts holds only valid
// tenant names with non-empty tokens, each listed once.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kvcomp/core/cache_key.h"
#include "kvcomp/service/auth.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto parsed = kvcomp::service::TokenStore::ParseTokenFile(text, "fuzz");
  if (!parsed.ok()) return 0;
  for (const auto& [tenant, token] : *parsed) {
    kvcomp::CacheKey probe{tenant, "m", "k"};
    if (tenant.empty() || !probe.Validate().ok() || token.empty()) std::abort();
  }
  return 0;
}
