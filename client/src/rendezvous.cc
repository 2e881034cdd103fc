#include "rendezvous.h"

#include <algorithm>
#include <numeric>

namespace kvcomp {
namespace client {
namespace {

uint64_t Fnv1a(uint64_t h, absl::string_view s) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t Mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

uint64_t StableHash64(absl::string_view a, absl::string_view b) {
  uint64_t h = Fnv1a(0xcbf29ce484222325ull, a);
  h = Fnv1a(h ^ 0xff, b);  // separator so ("ab","c") and ("a","bc") differ
  return Mix(h);
}

std::vector<size_t> RendezvousRank(const std::vector<std::string>& endpoints,
                                   absl::string_view key) {
  std::vector<uint64_t> w(endpoints.size());
  for (size_t i = 0; i < endpoints.size(); ++i) w[i] = StableHash64(endpoints[i], key);
  std::vector<size_t> order(endpoints.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return w[a] != w[b] ? w[a] > w[b] : a < b;
  });
  return order;
}

}  // namespace client
}  // namespace kvcomp
