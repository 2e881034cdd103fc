// The C++ SDK in a serving engine, in brief: connect, push a cache layer by layer, fetch it
// back, look it up and delete it.
//
//   put_get 127.0.0.1:7470[,127.0.0.1:7471] [tokens]
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kvcomp/client/client.h"
#include "kvcomp/core/dtype.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s ENDPOINT [tokens]\n", argv[0]);
    return 2;
  }
  const uint64_t tokens = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1024;
  const kvcomp::KvLayout layout{4, 8, 32, 128, kvcomp::DType::kBF16};

  auto client = kvcomp::client::Client::Connect({argv[1]});
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  kvcomp::client::PutOptions put_options;
  put_options.policy = kvcomp::CompressionPolicy{};  // ManifoldKV, ratio 0.5, moments
  auto stream = (*client)->OpenPutStream("meta-llama/Llama-3.1-8B", "cpp-example", layout,
                                         tokens, put_options);
  if (!stream.ok()) {
    std::fprintf(stderr, "open: %s\n", stream.status().ToString().c_str());
    return 1;
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> n01;
  std::vector<uint16_t> k(layout.num_kv_heads * tokens * layout.head_dim);
  std::vector<uint16_t> v(k.size());
  for (uint32_t layer = 0; layer < layout.num_layers; ++layer) {  // as prefill produces them
    for (auto& x : k) x = kvcomp::FloatToBf16(n01(rng));
    for (auto& x : v) x = kvcomp::FloatToBf16(n01(rng));
    if (auto s = (*stream)->AppendLayer(layer, k.data(), v.data()); !s.ok()) {
      std::fprintf(stderr, "append: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  auto put = (*stream)->Commit();
  if (!put.ok()) {
    std::fprintf(stderr, "commit: %s\n", put.status().ToString().c_str());
    return 1;
  }
  auto cache = (*client)->Get("meta-llama/Llama-3.1-8B", "cpp-example");
  auto info = (*client)->Lookup("meta-llama/Llama-3.1-8B", "cpp-example");
  if (!cache.ok() || !info.ok()) {
    std::fprintf(stderr, "get/lookup failed\n");
    return 1;
  }
  std::printf("stored %llu of %llu bytes (%.2fx), %llu tokens kept, tier %s\n",
              static_cast<unsigned long long>(put->stored_bytes),
              static_cast<unsigned long long>(put->original_bytes),
              static_cast<double>(put->original_bytes) / put->stored_bytes,
              static_cast<unsigned long long>(cache->total_kept()), info->tier.c_str());
  if (auto s = (*client)->Delete("meta-llama/Llama-3.1-8B", "cpp-example"); !s.ok()) {
    std::fprintf(stderr, "delete: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
