// Rendezvous (highest-random-weight) ranking of endpoints for a key. The hash is fixed (FNV-1a
// 64 with a splitmix64 finaliser), not absl::Hash, so every client process ranks alike.
#ifndef KVCOMP_CLIENT_SRC_RENDEZVOUS_H_
#define KVCOMP_CLIENT_SRC_RENDEZVOUS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace kvcomp {
namespace client {

uint64_t StableHash64(absl::string_view a, absl::string_view b);

// Indices of `endpoints` from highest to lowest weight for `key` (ties by index).
std::vector<size_t> RendezvousRank(const std::vector<std::string>& endpoints,
                                   absl::string_view key);

}  // namespace client
}  // namespace kvcomp

#endif  // KVCOMP_CLIENT_SRC_RENDEZVOUS_H_
