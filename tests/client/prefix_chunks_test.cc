// Prefix and chunk reuse through the C++ SDK against real kvcompd processes on loopback: chunk
// caches keyed by chained hashes spread over three daemons, LookupPrefix fanned out to them,
// GetChunks of a run, composition (lossless chunks assemble to the whole cache bit for bit;
// the moments of a run are the sum of its chunks'), tenant scoping and a daemon going away.
#include <signal.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/random_kv.h"
#include "gtest/gtest.h"
#include "integration/kvcompd_process.h"
#include "kvcomp/client/client.h"
#include "kvcomp/core/crc32c.h"
#include "kvcomp/core/format.h"

namespace kvcomp {
namespace client {
namespace {

using testing::KvcompdProcess;
using testing::TempDir;

constexpr char kModel[] = "test/prefix-model";
constexpr uint64_t kChunk = 16;   // tokens per chunk
constexpr uint64_t kChunks = 6;

// A prompt's cache [layers][heads, tokens, d] in f16.
struct Prompt {
  KvLayout layout{2, 2, 4, 64, DType::kF16};
  uint64_t tokens = kChunk * kChunks;
  std::vector<std::vector<uint16_t>> k, v;
  explicit Prompt(uint32_t seed) { testing::RandomLayersF16(layout, tokens, seed, &k, &v); }
  // Tokens [t0, t0 + n) of every layer, dense [heads, n, d] per layer.
  std::vector<std::vector<uint16_t>> Slice(const std::vector<std::vector<uint16_t>>& a,
                                           uint64_t t0, uint64_t n) const {
    const uint64_t d = layout.head_dim;
    std::vector<std::vector<uint16_t>> out;
    for (const auto& layer : a) {
      out.emplace_back(layout.num_kv_heads * n * d);
      for (uint32_t h = 0; h < layout.num_kv_heads; ++h) {
        std::memcpy(out.back().data() + h * n * d, layer.data() + (h * tokens + t0) * d,
                    n * d * 2);
      }
    }
    return out;
  }
  float K(uint32_t layer, uint32_t head, uint64_t t, uint64_t i) const {
    return HalfToFloat(k[layer][(head * tokens + t) * layout.head_dim + i]);
  }
  float V(uint32_t layer, uint32_t head, uint64_t t, uint64_t i) const {
    return HalfToFloat(v[layer][(head * tokens + t) * layout.head_dim + i]);
  }
};

// Chained block hashes, as engines compute them: key i names tokens [0, (i+1) * kChunk).
std::vector<std::string> ChainedKeys(uint32_t seed, size_t n) {
  std::vector<std::string> keys;
  uint32_t h = seed;
  for (size_t i = 0; i < n; ++i) {
    const std::string block = absl::StrCat("block-", seed, "-", i);
    h = Crc32cExtend(h, block.data(), block.size());
    keys.push_back(absl::StrCat("h", h, "-", i));
  }
  return keys;
}

CompressionPolicy Lossless() {
  CompressionPolicy p;
  p.ratio = 0;
  p.moments = false;
  return p;
}

class PrefixChunksTest : public ::testing::Test {
 protected:
  void StartPool(std::vector<std::string> flags = {}, const std::string& tenant = "",
                 const std::string& token = "") {
    for (int i = 0; i < 3; ++i) {
      daemons_.push_back(std::make_unique<KvcompdProcess>(
          KVCOMPD_PATH, dir_.path() + "/d" + std::to_string(i), flags));
      ASSERT_TRUE(daemons_.back()->Start()) << daemons_.back()->Log();
      endpoints_.push_back(daemons_.back()->client_endpoint());
    }
    client_ = Connect(tenant, token);
    ASSERT_NE(client_, nullptr);
  }
  std::unique_ptr<Client> Connect(const std::string& tenant, const std::string& token) {
    ClientOptions o;
    o.tenant = tenant;
    o.token = token;
    o.connect_timeout = absl::Seconds(2);
    o.request_timeout = absl::Seconds(10);
    o.ucx_overrides = {{"TLS", "tcp"}};
    auto c = Client::Connect(endpoints_, o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  // Stores chunk i of `p` under keys[i] with `policy`.
  void PutChunks(Client& c, const Prompt& p, const std::vector<std::string>& keys,
                 const CompressionPolicy& policy, size_t n) {
    PutOptions o;
    o.policy = policy;
    for (size_t i = 0; i < n; ++i) {
      auto k = p.Slice(p.k, i * kChunk, kChunk);
      auto v = p.Slice(p.v, i * kChunk, kChunk);
      std::vector<LayerData> layers;
      for (size_t l = 0; l < k.size(); ++l) layers.push_back({k[l].data(), v[l].data()});
      auto r = c.Put(kModel, keys[i], p.layout, kChunk, layers, o);
      ASSERT_TRUE(r.ok()) << r.status();
    }
  }

  TempDir dir_;
  std::vector<std::unique_ptr<KvcompdProcess>> daemons_;
  std::vector<std::string> endpoints_;
  std::unique_ptr<Client> client_;
};

TEST_F(PrefixChunksTest, LookupPrefixCountsLeadingChunksAcrossDaemons) {
  StartPool();
  Prompt p(1);
  const std::vector<std::string> keys = ChainedKeys(7, kChunks + 2);
  std::set<std::string> owners;
  for (const auto& k : keys) owners.insert(client_->Ranking(kModel, k).front());
  ASSERT_GE(owners.size(), 2u) << "the chunks should spread over the pool";

  auto none = client_->LookupPrefix(kModel, keys);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, 0u);
  EXPECT_EQ(*client_->LookupPrefix(kModel, {}), 0u);

  PutChunks(*client_, p, keys, Lossless(), kChunks);
  auto held = client_->LookupPrefix(kModel, keys);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(*held, kChunks);
  EXPECT_EQ(*client_->LookupPrefix(kModel, {keys.begin(), keys.begin() + 3}), 3u);

  // A hole ends the prefix, wherever the missing chunk lives.
  ASSERT_TRUE(client_->Delete(kModel, keys[2]).ok());
  EXPECT_EQ(*client_->LookupPrefix(kModel, keys), 2u);
  ASSERT_TRUE(client_->Delete(kModel, keys[0]).ok());
  EXPECT_EQ(*client_->LookupPrefix(kModel, keys), 0u);

  // Longer runs than one request carries are split per daemon.
  std::vector<std::string> many = ChainedKeys(9, 2500);
  EXPECT_EQ(*client_->LookupPrefix(kModel, many), 0u);

  EXPECT_EQ(client_->LookupPrefix(kModel, {""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->LookupPrefix("", keys).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(PrefixChunksTest, ChunksLargerThanTheReplyBoundComeOverTheDataPlane) {
  // 64 KiB replies: each 96-token chunk (96 KiB of K and V) passes the bound alone.
  StartPool({"--control_plane.max_reply_bytes=64Ki", "--control_plane.tenant_reply_bytes=128Ki"});
  Prompt p(5);
  const std::vector<std::string> keys = ChainedKeys(21, 3);
  PutOptions o;
  o.policy = Lossless();
  std::vector<LayerData> layers;
  for (size_t l = 0; l < p.k.size(); ++l) layers.push_back({p.k[l].data(), p.v[l].data()});
  for (const std::string& k : keys) {
    ASSERT_TRUE(client_->Put(kModel, k, p.layout, p.tokens, layers, o).ok());
  }
  auto stored = client_->GetChunkBytes(kModel, keys, /*decoded=*/false);
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_EQ(stored->size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    auto whole = client_->GetBytes(kModel, keys[i]);
    ASSERT_TRUE(whole.ok()) << whole.status();
    EXPECT_GT(whole->size(), size_t{64} << 10);
    EXPECT_EQ((*stored)[i], *whole) << i;
  }
  auto decoded = client_->GetChunks(kModel, keys, /*decoded=*/true);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->size(), keys.size());
  // A missing chunk still ends the run.
  ASSERT_TRUE(client_->Delete(kModel, keys[1]).ok());
  auto run = client_->GetChunkBytes(kModel, keys, false);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->size(), 1u);
}

TEST_F(PrefixChunksTest, LosslessChunksAssembleToTheWholeCache) {
  StartPool();
  Prompt p(2);
  const std::vector<std::string> keys = ChainedKeys(11, kChunks);
  PutChunks(*client_, p, keys, Lossless(), kChunks);
  PutOptions whole;
  whole.policy = Lossless();
  std::vector<LayerData> layers;
  for (size_t l = 0; l < p.k.size(); ++l) layers.push_back({p.k[l].data(), p.v[l].data()});
  ASSERT_TRUE(client_->Put(kModel, "whole", p.layout, p.tokens, layers, whole).ok());
  auto w = client_->GetDecoded(kModel, "whole");
  ASSERT_TRUE(w.ok()) << w.status();

  for (bool decoded : {false, true}) {
    auto chunks = client_->GetChunks(kModel, keys, decoded);
    ASSERT_TRUE(chunks.ok()) << chunks.status();
    ASSERT_EQ(chunks->size(), kChunks);
    // Per head, the chunks' kept tokens in order are the whole cache's, byte for byte.
    const uint64_t row = p.layout.head_dim * 2;
    const std::vector<uint64_t> woff = w->TokenOffsets();
    for (uint64_t h = 0; h < w->num_heads(); ++h) {
      uint64_t t = 0;
      for (size_t c = 0; c < chunks->size(); ++c) {
        const CompressedCache& ch = (*chunks)[c];
        ASSERT_EQ(ch.original_tokens, kChunk);
        const uint64_t off = ch.token_offset(h);
        for (uint32_t i = 0; i < ch.kept[h]; ++i, ++t) {
          ASSERT_EQ(ch.positions[off + i] + c * kChunk, w->positions[woff[h] + t]);
          ASSERT_EQ(std::memcmp(ch.keys.data() + (off + i) * row,
                                w->keys.data() + (woff[h] + t) * row, row),
                    0);
          ASSERT_EQ(std::memcmp(ch.values.data() + (off + i) * row,
                                w->values.data() + (woff[h] + t) * row, row),
                    0);
        }
      }
      EXPECT_EQ(t, w->kept[h]);
    }
  }
  // One missing chunk: the run stops before it.
  ASSERT_TRUE(client_->Delete(kModel, keys[4]).ok());
  auto run = client_->GetChunks(kModel, keys);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->size(), 4u);
}

TEST_F(PrefixChunksTest, MomentsOfARunAreTheSumOfItsChunks) {
  StartPool();
  Prompt p(3);
  const std::vector<std::string> keys = ChainedKeys(13, kChunks);
  CompressionPolicy evict;
  evict.scorer = Scorer::kKnorm;
  evict.ratio = 0.5;
  evict.n_sink = 0;
  evict.moments = true;
  PutChunks(*client_, p, keys, evict, kChunks);
  auto chunks = client_->GetChunks(kModel, keys);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), kChunks);
  const uint64_t d = p.layout.head_dim;
  const uint64_t heads = p.layout.num_heads_total();
  // The run's moments: the chunks' summed; checked against the raw tokens the run evicted.
  std::vector<uint64_t> count(heads, 0);
  std::vector<double> ksum(heads * d, 0), vsum(heads * d, 0), vk(heads * d * d, 0);
  std::vector<std::vector<bool>> evicted(heads, std::vector<bool>(p.tokens, true));
  for (size_t c = 0; c < kChunks; ++c) {
    const CompressedCache& ch = (*chunks)[c];
    ASSERT_TRUE(ch.has_moments);
    for (uint64_t h = 0; h < heads; ++h) {
      count[h] += ch.moment_count[h];
      for (uint64_t i = 0; i < d; ++i) {
        ksum[h * d + i] += ch.moment_key_sum[h * d + i];
        vsum[h * d + i] += ch.moment_value_sum[h * d + i];
      }
      for (uint64_t i = 0; i < d * d; ++i) vk[h * d * d + i] += ch.moment_vk_sum[h * d * d + i];
      const uint64_t off = ch.token_offset(h);
      for (uint32_t i = 0; i < ch.kept[h]; ++i) evicted[h][c * kChunk + ch.positions[off + i]] = false;
    }
  }
  for (uint64_t h = 0; h < heads; ++h) {
    const uint32_t layer = h / p.layout.num_kv_heads, head = h % p.layout.num_kv_heads;
    uint64_t n = 0;
    std::vector<double> ek(d, 0), ev(d, 0), evk(d * d, 0);
    for (uint64_t t = 0; t < p.tokens; ++t) {
      if (!evicted[h][t]) continue;
      ++n;
      for (uint64_t i = 0; i < d; ++i) {
        ek[i] += p.K(layer, head, t, i);
        ev[i] += p.V(layer, head, t, i);
        for (uint64_t j = 0; j < d; ++j) evk[i * d + j] += p.V(layer, head, t, i) * p.K(layer, head, t, j);
      }
    }
    ASSERT_EQ(count[h], n);
    ASSERT_EQ(n, p.tokens / 2);
    for (uint64_t i = 0; i < d; ++i) {
      ASSERT_NEAR(ksum[h * d + i], ek[i], 1e-3);
      ASSERT_NEAR(vsum[h * d + i], ev[i], 1e-3);
    }
    for (uint64_t i = 0; i < d * d; ++i) ASSERT_NEAR(vk[h * d * d + i], evk[i], 1e-3);
  }
}

TEST_F(PrefixChunksTest, LookupsAreScopedToTheTenant) {
  std::ofstream(dir_.path() + "/tokens.yaml") << "alpha: secret-a\nbeta: secret-b\n";
  StartPool({"--auth.token_file=" + dir_.path() + "/tokens.yaml"}, "alpha", "secret-a");
  Prompt p(4);
  const std::vector<std::string> keys = ChainedKeys(17, kChunks);
  PutChunks(*client_, p, keys, Lossless(), kChunks);
  EXPECT_EQ(*client_->LookupPrefix(kModel, keys), kChunks);
  auto beta = Connect("beta", "secret-b");
  ASSERT_NE(beta, nullptr);
  auto seen = beta->LookupPrefix(kModel, keys);
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(*seen, 0u);
  auto got = beta->GetChunks(kModel, keys);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->empty());
  ClientOptions bad;
  bad.tenant = "beta";
  bad.token = "wrong";
  bad.ucx_overrides = {{"TLS", "tcp"}};
  auto wrong = Client::Connect(endpoints_, bad, /*connect_now=*/false);
  ASSERT_TRUE(wrong.ok());
  EXPECT_EQ((*wrong)->LookupPrefix(kModel, keys).status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST_F(PrefixChunksTest, StoppedDaemonCountsAsMissingAndEndpointsNeedControl) {
  StartPool();
  Prompt p(5);
  const std::vector<std::string> keys = ChainedKeys(19, kChunks);
  PutChunks(*client_, p, keys, Lossless(), kChunks);
  const std::string first_owner = client_->Ranking(kModel, keys[0]).front();
  size_t victim = 0;
  for (size_t i = 0; i < daemons_.size(); ++i) {
    if (daemons_[i]->data_endpoint() == first_owner) victim = i;
  }
  daemons_[victim]->Kill(SIGKILL);
  // Chunk 0's daemon is gone (one copy): nothing can be reused, and nothing fails.
  auto held = client_->LookupPrefix(kModel, keys);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(*held, 0u);

  ClientOptions o;
  o.ucx_overrides = {{"TLS", "tcp"}};
  auto data_only = Client::Connect({daemons_[(victim + 1) % 3]->data_endpoint()}, o, false);
  ASSERT_TRUE(data_only.ok());
  EXPECT_EQ((*data_only)->LookupPrefix(kModel, keys).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace client
}  // namespace kvcomp
