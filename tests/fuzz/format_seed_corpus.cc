// Writes valid encoded caches (every key and value codec, with and without moments) into the
// directory given as argv[1], each prefixed with the fuzz target's mode byte.
#include <cstdio>
#include <fstream>
#include <string>

#include "common/random_cache.h"
#include "kvcomp/core/format.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  int n = 0;
  for (auto kc : {kvcomp::KeyCodec::kRaw, kvcomp::KeyCodec::kFp16, kvcomp::KeyCodec::kInt8,
                  kvcomp::KeyCodec::kInt4}) {
    for (auto vc : {kvcomp::ValueCodec::kRaw, kvcomp::ValueCodec::kOrthogonal,
                    kvcomp::ValueCodec::kOrthogonalInt8, kvcomp::ValueCodec::kOrthogonalInt4}) {
      for (bool moments : {false, true}) {
        kvcomp::testing::RandomCacheOptions o;
        o.layout = kvcomp::KvLayout{1, 2, 2, 64, kvcomp::DType::kF16};
        o.original_tokens = 4;
        o.key_codec = kc;
        o.value_codec = vc;
        o.rank = vc == kvcomp::ValueCodec::kRaw ? 0 : 8;
        o.group_size = 4;
        o.moments = moments;
        auto bytes = kvcomp::format::EncodeCache(kvcomp::testing::RandomCache(o, n));
        if (!bytes.ok()) return 1;
        for (char mode : {'\0', '\1'}) {
          std::ofstream f(std::string(argv[1]) + "/seed" + std::to_string(n++), std::ios::binary);
          f << mode << *bytes;
        }
      }
    }
  }
  // A policy with a budget-relative recent window (policy tag 23, format 1.2).
  {
    kvcomp::testing::RandomCacheOptions o;
    o.layout = kvcomp::KvLayout{1, 2, 2, 64, kvcomp::DType::kF16};
    o.original_tokens = 4;
    auto c = kvcomp::testing::RandomCache(o, n);
    c.policy.recent_fraction = 0.5;
    c.policy.n_recent = 1;
    auto bytes = kvcomp::format::EncodeCache(c);
    if (!bytes.ok()) return 1;
    for (char mode : {'\0', '\1'}) {
      std::ofstream f(std::string(argv[1]) + "/seed" + std::to_string(n++), std::ios::binary);
      f << mode << *bytes;
    }
  }
  std::printf("wrote %d seeds\n", n);
  return 0;
}
