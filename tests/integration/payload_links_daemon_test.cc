// The UCX payload links (transport/ucx_link.h) against a real kvcompd on loopback: a put's
// blocks pipelined through BlockPipe over the link router, a get into caller memory through
// it, what the daemon offers per direction and the links chosen for device memory (ucx-cuda in
// place, else ucx staged), and device memory refused by capability (typed kMemoryNotMappable,
// nothing sent) where this UCX has no CUDA memory and the memory cannot be staged.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/payload_link.h"
#include "kvcomp/transport/protocol.h"
#include "kvcomp/transport/ucx.h"
#include "kvcomp/transport/ucx_link.h"

namespace kvcomp {
namespace testing {
namespace {

namespace wire = transport::wire;
using transport::BlockPipe;
using transport::Direction;
using transport::GetRequest;
using transport::LinkKind;
using transport::MemoryKind;
using transport::MemoryRegion;
using transport::UcxLinks;

class PayloadLinksDaemonTest : public DaemonFixture {
 protected:
  // UCX's links on their own (shared memory, offered on one host, has its own test).
  PayloadLinksDaemonTest() { shared_memory_ = false; }
  static constexpr uint64_t kTokens = 64;
  const KvLayout layout_{4, 2, 2, 64, DType::kF16};

  wire::PutBegin Begin(const std::string& key) const {
    wire::PutBegin begin;
    begin.layout = layout_;
    begin.num_tokens = kTokens;
    begin.model_id = "m";
    begin.key = key;
    CompressionPolicy lossless;
    lossless.ratio = 0;
    lossless.moments = false;
    begin.has_policy = true;
    begin.policy = lossless;
    return begin;
  }
  // Finite f16 values in [1, 2), different per layer.
  std::vector<uint8_t> Layer(uint32_t layer) const {
    std::vector<uint8_t> kv(2 * layout_.LayerBytes(kTokens));
    for (size_t i = 0; i + 1 < kv.size(); i += 2) {
      kv[i] = static_cast<uint8_t>(i * 7 + 3 + layer);
      kv[i + 1] = static_cast<uint8_t>(0x3c | ((i / 2 + layer) & 3));
    }
    return kv;
  }
  // Every layer's keys and values as blocks of 16 tokens' worth (both parts, packed), in a
  // window of two blocks. Returns the blocks sent.
  absl::StatusOr<uint64_t> PutThroughPipe(transport::UcxClient& c, uint64_t put_id,
                                          std::vector<std::shared_ptr<std::string>>* keep) {
    const UcxLinks links(&c);
    const uint64_t part = layout_.LayerBytes(16);
    BlockPipe pipe(links, 2 * 2 * part);
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      const std::vector<uint8_t> kv = Layer(l);
      const uint64_t row = layout_.head_dim * 2;
      for (uint64_t t = 0; t < kTokens; t += 16) {
        auto packed = std::make_shared<std::string>(2 * part, '\0');
        for (uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
          const uint64_t src = (uint64_t{h} * kTokens + t) * row;
          std::memcpy(packed->data() + h * 16 * row, kv.data() + src, 16 * row);
          std::memcpy(packed->data() + part + h * 16 * row,
                      kv.data() + layout_.LayerBytes(kTokens) + src, 16 * row);
        }
        wire::Block b;
        b.put_id = put_id;
        b.layer_begin = l;
        b.layer_end = l + 1;
        b.token_begin = t;
        b.token_end = t + 16;
        b.parts = wire::kPartBoth;
        b.key_bytes = part;
        b.value_bytes = part;
        pipe.Send(b, {packed->data(), part, MemoryKind::kHost},
                  {packed->data() + part, part, MemoryKind::kHost}, packed);
        keep->push_back(packed);
      }
    }
    KVCOMP_RETURN_IF_ERROR(pipe.Wait());
    EXPECT_EQ(pipe.link(), LinkKind::kUcxHost);
    return pipe.sent();
  }
};

TEST_F(PayloadLinksDaemonTest, AHostPutAndGetGoThroughTheUcxLink) {
  auto d = StartDaemon();
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  absl::StatusOr<uint64_t> put = c->PutBegin(Begin("k"));
  ASSERT_TRUE(put.ok()) << put.status();
  std::vector<std::shared_ptr<std::string>> keep;
  absl::StatusOr<uint64_t> sent = PutThroughPipe(*c, *put, &keep);
  ASSERT_TRUE(sent.ok()) << sent.status();
  EXPECT_EQ(*sent, layout_.num_layers * kTokens / 16);
  absl::StatusOr<wire::CacheSummary> sum = c->PutCommit(*put, *sent);
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(sum->total_kept, kTokens * layout_.num_kv_heads * layout_.num_layers);

  // Read back through the link into caller memory: the same bytes as a plain get.
  absl::StatusOr<transport::FetchedCache> stored = c->Get("m", "k");
  ASSERT_TRUE(stored.ok()) << stored.status();
  absl::StatusOr<transport::FetchedCache> plain = c->Get("m", "k", wire::Representation::kDecoded);
  ASSERT_TRUE(plain.ok()) << plain.status();
  const UcxLinks links(c.get());
  std::vector<char> into(std::max(stored->bytes.size(), plain->bytes.size()) + 100);
  LinkKind used = LinkKind::kNccl;
  const GetRequest request{"m", "k", wire::Representation::kStored};
  absl::StatusOr<uint64_t> n = links.GetInto(
      request, {into.data(), into.size(), MemoryKind::kHost}, absl::InfiniteFuture(), &used);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(used, LinkKind::kUcxHost);
  ASSERT_EQ(*n, stored->bytes.size());
  EXPECT_EQ(std::string(into.data(), *n), std::string(stored->bytes.view()));
  // The decoded form, as the daemon's plain decoded get sends it.
  const GetRequest decoded{"m", "k", wire::Representation::kDecoded};
  n = links.GetInto(decoded, {into.data(), into.size(), MemoryKind::kHost},
                    absl::InfiniteFuture());
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(std::string(into.data(), *n), std::string(plain->bytes.view()));

  // The daemon's answers come back as they are: too small, absent.
  n = links.GetInto(request, {into.data(), 16, MemoryKind::kHost}, absl::InfiniteFuture());
  EXPECT_TRUE(absl::IsOutOfRange(n.status())) << n.status();
  n = links.GetInto({"m", "absent", wire::Representation::kStored},
                    {into.data(), into.size(), MemoryKind::kHost}, absl::InfiniteFuture());
  EXPECT_TRUE(absl::IsNotFound(n.status())) << n.status();
}

// The blocks of a put out of device memory (the SDK's, where no GPU channel carries it): each
// layer's keys and values a block of their own over every token. Staged through host memory
// (the ucx link) they reach the daemon as such host blocks; the cache is the one sent.
TEST_F(PayloadLinksDaemonTest, KeysAndValuesAsBlocksOfTheirOwnMakeTheCache) {
  auto d = StartDaemon();
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  absl::StatusOr<uint64_t> put = c->PutBegin(Begin("parts"));
  ASSERT_TRUE(put.ok()) << put.status();
  const uint64_t part = layout_.LayerBytes(kTokens);
  std::vector<std::vector<uint8_t>> layers;
  for (uint32_t l = 0; l < layout_.num_layers; ++l) layers.push_back(Layer(l));
  uint64_t sent = 0;
  {
    const UcxLinks links(c.get());
    BlockPipe pipe(links, 2 * part);
    const MemoryRegion none{nullptr, 0, MemoryKind::kHost};
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      wire::Block b;
      b.put_id = *put;
      b.layer_begin = l;
      b.layer_end = l + 1;
      b.token_end = kTokens;
      for (const bool values : {false, true}) {
        b.parts = values ? wire::kPartValues : wire::kPartKeys;
        b.key_bytes = values ? 0 : part;
        b.value_bytes = values ? part : 0;
        const MemoryRegion data{layers[l].data() + (values ? part : 0), part, MemoryKind::kHost};
        pipe.Send(b, values ? none : data, values ? data : none);
      }
    }
    ASSERT_TRUE(pipe.Wait().ok());
    sent = pipe.sent();
  }
  EXPECT_EQ(sent, 2 * layout_.num_layers);
  absl::StatusOr<wire::CacheSummary> sum = c->PutCommit(*put, sent);
  ASSERT_TRUE(sum.ok()) << sum.status();
  absl::StatusOr<transport::FetchedCache> got =
      c->Get("m", "parts", wire::Representation::kDecoded);
  ASSERT_TRUE(got.ok()) << got.status();
  absl::StatusOr<CompressedCache> cache = format::ParseCache(got->bytes.view());
  ASSERT_TRUE(cache.ok()) << cache.status();
  std::vector<uint8_t> dense(layout_.CacheBytes(kTokens));
  ASSERT_TRUE(cache->WriteDenseKv(dense.data()).ok());
  for (uint32_t l = 0; l < layout_.num_layers; ++l) {
    EXPECT_EQ(0, std::memcmp(dense.data() + l * part, layers[l].data(), part)) << "keys " << l;
    EXPECT_EQ(0, std::memcmp(dense.data() + (layout_.num_layers + l) * part,
                             layers[l].data() + part, part))
        << "values " << l;
  }
}

TEST_F(PayloadLinksDaemonTest, TheDaemonOffersPerDirectionWhatItsHelloSays) {
  auto d = StartDaemon();
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  const bool cuda = (c->server_info().server_flags & wire::kServerCudaMemory) != 0;
  const transport::LinkOffer send = transport::UcxPeerOffer(c->server_info(), Direction::kSend);
  const transport::LinkOffer receive =
      transport::UcxPeerOffer(c->server_info(), Direction::kReceive);
  EXPECT_TRUE(send.Has(LinkKind::kUcxHost));
  EXPECT_EQ(send.Has(LinkKind::kUcxCuda), cuda);
  // A get's bytes leave the daemon from host memory: ucx-cuda is offered whatever its UCX.
  EXPECT_TRUE(receive.Has(LinkKind::kUcxCuda));
  EXPECT_FALSE(send.Has(LinkKind::kNccl) || send.Has(LinkKind::kCudaIpc));
  const UcxLinks links(c.get());
  EXPECT_EQ(links.For(Direction::kSend).local().Has(LinkKind::kUcxCuda), c->LocalCudaMemory());
  // Device memory: ucx-cuda in place where both ends' UCX has CUDA memory, and always the
  // ucx link after it, which stages it through host memory.
  for (const Direction dir : {Direction::kSend, Direction::kReceive}) {
    std::vector<LinkKind> chosen;
    for (transport::PayloadLink* l :
         links.For(dir).Choose({MemoryKind::kCuda, transport::Locality::kUnknown})) {
      chosen.push_back(l->kind());
    }
    const bool in_place = c->LocalCudaMemory() && (dir == Direction::kReceive || cuda);
    EXPECT_EQ(chosen, in_place ? (std::vector<LinkKind>{LinkKind::kUcxCuda, LinkKind::kUcxHost})
                               : (std::vector<LinkKind>{LinkKind::kUcxHost}));
  }
}

TEST_F(PayloadLinksDaemonTest, DeviceMemoryIsRefusedByCapabilityWithoutCudaUcx) {
  absl::StatusOr<transport::UcxCapabilities> caps = transport::QueryUcxCapabilities();
  ASSERT_TRUE(caps.ok()) << caps.status();
  if (caps->cuda_memory) GTEST_SKIP() << "this UCX has CUDA memory";
  auto d = StartDaemon();
  auto c = Connect(*d);
  ASSERT_NE(c, nullptr);
  ASSERT_FALSE(c->LocalCudaMemory());
  const UcxLinks links(c.get());
  // No link both ends offer reaches device memory in place: typed, and nothing was asked.
  std::vector<char> buf(4096);
  absl::StatusOr<uint64_t> n =
      links.GetInto({"m", "k", wire::Representation::kStored},
                    {buf.data(), buf.size(), MemoryKind::kCuda}, absl::InfiniteFuture());
  ASSERT_FALSE(n.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(n.status())) << n.status();
  EXPECT_EQ(DetailOf(n.status()), ErrorDetail::kMemoryNotMappable) << n.status();
  EXPECT_EQ(transport::AfterLinkFailure(n.status()), transport::LinkVerdict::kNextLink);
  // ucx, which stages device memory through host memory, was asked too and said why not (no
  // CUDA driver here, or memory the driver does not know).
  EXPECT_TRUE(absl::StrContains(n.status().message(), "ucx link cannot reach CUDA memory"))
      << n.status();

  // A put's blocks claimed as device memory: refused before sending, the put stays empty.
  absl::StatusOr<uint64_t> put = c->PutBegin(Begin("dev"));
  ASSERT_TRUE(put.ok()) << put.status();
  {
    BlockPipe pipe(links, 1 << 20);
    wire::Block b;
    b.put_id = *put;
    b.layer_begin = 0;
    b.layer_end = 1;
    b.token_end = kTokens;
    b.parts = wire::kPartKeys;
    b.key_bytes = layout_.LayerBytes(kTokens);
    std::vector<char> keys(b.key_bytes);
    pipe.Send(b, {keys.data(), keys.size(), MemoryKind::kCuda}, {nullptr, 0, MemoryKind::kCuda});
    const absl::Status s = pipe.Wait();
    EXPECT_EQ(DetailOf(s), ErrorDetail::kMemoryNotMappable) << s;
  }
  EXPECT_TRUE(c->PutAbort(*put).ok());
  EXPECT_TRUE(absl::IsNotFound(c->Lookup("m", "dev").status()));
  // The connection still serves host memory.
  EXPECT_TRUE(c->Ping().ok());
}

}  // namespace
}  // namespace testing
}  // namespace kvcomp
