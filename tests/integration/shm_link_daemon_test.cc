// The same-host shared-memory link (transport/shm_link.h) against a real kvcompd on loopback:
// puts and gets through it bit-exact with UCX's, the fallbacks (daemon or client with it off,
// a cache larger than the client's region), what the daemon refuses to map (unknown or
// withdrawn tokens, descriptors that are not sealed, fully allocated memfds, sizes out of
// bounds), blocks and gets naming ranges outside the connection's own regions, tenants kept
// apart, a client killed in the middle of a put (its put aborted, its regions unmapped), and a
// direct get split over the daemon's copy threads.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/payload_link.h"
#include "kvcomp/transport/protocol.h"
#include "kvcomp/transport/shm_link.h"
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
using transport::UcxLinks;

// Lines of /proc/<pid>/maps that map a client's shared region.
int SharedMappings(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  int n = 0;
  while (std::getline(in, line)) n += absl::StrContains(line, "memfd:kvcomp-shm") ? 1 : 0;
  return n;
}

// Descriptors of process `pid` that are pidfds (the daemon holds one per registered peer).
int Pidfds(int pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd/";
  int n = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    char target[256];
    const ssize_t len = readlink((dir + std::to_string(fd)).c_str(), target, sizeof(target) - 1);
    if (len > 0 && absl::StrContains(absl::string_view(target, len), "pidfd")) ++n;
  }
  return n;
}

// The daemon's count of cache requests of `op` ("get", "lookup"), every result and label summed.
double Requests(const KvcompdProcess& d, const std::string& op) {
  std::istringstream in(HttpGet(d.ports().metrics, "/metrics").body);
  std::string line;
  double n = 0;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "kvcomp_cache_requests_total{") &&
        absl::StrContains(line, "op=\"" + op + "\"")) {
      n += std::atof(line.c_str() + line.rfind(' ') + 1);
    }
  }
  return n;
}

// Sends one block of layer `l`, tokens [t, t + n): K then V, `part` bytes each, from `packed`.
void SendLayerBlock(BlockPipe& pipe, uint64_t put, uint32_t l, uint64_t t, uint64_t n,
                    uint64_t part, std::shared_ptr<std::string> packed) {
  wire::Block b;
  b.put_id = put;
  b.layer_begin = l;
  b.layer_end = l + 1;
  b.token_begin = t;
  b.token_end = t + n;
  b.parts = wire::kPartBoth;
  b.key_bytes = b.value_bytes = part;
  char* kv = packed->data();  // before `packed` is moved into the call
  pipe.Send(b, {kv, part, transport::MemoryKind::kHost},
            {kv + part, part, transport::MemoryKind::kHost}, std::move(packed));
}

class ShmLinkDaemonTest : public DaemonFixture {
 protected:
  static constexpr uint64_t kTokens = 64;
  const KvLayout layout_{4, 2, 2, 64, DType::kF16};

  // `direct`: let the daemon copy straight from and to this process's memory (the kernel
  // allows it here: same user); false: through the regions only.
  std::unique_ptr<transport::UcxClient> ConnectWith(const KvcompdProcess& d, bool shared,
                                                    const std::string& tenant = "",
                                                    const std::string& token = "",
                                                    uint64_t max_get_region = uint64_t{1} << 30,
                                                    bool direct = true) {
    transport::ClientOptions o;
    o.ucx.overrides["TLS"] = "tcp";
    o.shared_memory = shared;
    o.shm_direct = direct;
    o.shm_put_region_bytes = 64 << 10;  // a ring of 8 blocks: it wraps during a put
    o.shm_max_get_region_bytes = max_get_region;
    auto c = transport::UcxClient::Connect(*transport::Endpoint::Parse(d.data_endpoint()), tenant,
                                           token, o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

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
  // Finite f16 values, different per layer and per `seed`.
  std::vector<uint8_t> Layer(uint32_t layer, uint32_t seed = 0) const {
    std::vector<uint8_t> kv(2 * layout_.LayerBytes(kTokens));
    for (size_t i = 0; i + 1 < kv.size(); i += 2) {
      kv[i] = static_cast<uint8_t>(i * 7 + 3 + layer + seed * 13);
      kv[i + 1] = static_cast<uint8_t>(0x3c | ((i / 2 + layer) & 3));
    }
    return kv;
  }
  // Puts every layer as blocks of 16 tokens through the connection's links; the link the blocks
  // took. `layers` < num_layers leaves the put open (no commit).
  absl::StatusOr<LinkKind> Put(transport::UcxClient& c, const std::string& key,
                               uint32_t layers, uint32_t seed = 0) {
    KVCOMP_ASSIGN_OR_RETURN(const uint64_t put_id, c.PutBegin(Begin(key)));
    const UcxLinks links(&c);
    const uint64_t part = layout_.LayerBytes(16);
    LinkKind used;
    {
      BlockPipe pipe(links, 8 * 2 * part);
      std::vector<std::shared_ptr<std::string>> keep;
      for (uint32_t l = 0; l < layers; ++l) {
        const std::vector<uint8_t> kv = Layer(l, seed);
        const uint64_t row = layout_.head_dim * 2;
        for (uint64_t t = 0; t < kTokens; t += 16) {
          auto packed = std::make_shared<std::string>(2 * part, '\0');
          for (uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
            const uint64_t src = (uint64_t{h} * kTokens + t) * row;
            std::memcpy(packed->data() + h * 16 * row, kv.data() + src, 16 * row);
            std::memcpy(packed->data() + part + h * 16 * row,
                        kv.data() + layout_.LayerBytes(kTokens) + src, 16 * row);
          }
          SendLayerBlock(pipe, put_id, l, t, 16, part, packed);
        }
      }
      KVCOMP_RETURN_IF_ERROR(pipe.Wait());
      used = pipe.link();
      if (layers < layout_.num_layers) return used;
      KVCOMP_RETURN_IF_ERROR(c.PutCommit(put_id, pipe.sent()).status());
    }
    return used;
  }
};

TEST_F(ShmLinkDaemonTest, PutsAndGetsGoThroughSharedMemoryBitExact) {
  auto d = StartDaemon();
  for (bool direct : {true, false}) {
  SCOPED_TRACE(direct ? "direct" : "regions");
  const std::string k = direct ? "over-shm" : "over-regions";
  auto shm = ConnectWith(*d, true, "", "", uint64_t{1} << 30, direct);
  auto ucx = ConnectWith(*d, false);
  ASSERT_NE(shm, nullptr);
  ASSERT_NE(ucx, nullptr);
  ASSERT_TRUE(shm->server_info().server_flags & wire::kServerSharedMemory);
  ASSERT_NE(shm->SharedMemory(), nullptr);
  EXPECT_EQ(ucx->SharedMemory(), nullptr);  // this client said no
  EXPECT_TRUE(transport::UcxPeerOffer(shm->server_info(), Direction::kSend).Has(LinkKind::kShm));

  // The same data put over each link: the daemon stores the same bytes.
  absl::StatusOr<LinkKind> a = Put(*shm, k, layout_.num_layers);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, LinkKind::kShm);
  absl::StatusOr<LinkKind> b = Put(*ucx, k + "-ucx", layout_.num_layers);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, LinkKind::kUcxHost);
  absl::StatusOr<transport::FetchedCache> via_shm = ucx->Get("m", k);
  absl::StatusOr<transport::FetchedCache> via_ucx = ucx->Get("m", k + "-ucx");
  ASSERT_TRUE(via_shm.ok() && via_ucx.ok()) << via_shm.status() << via_ucx.status();
  EXPECT_EQ(via_shm->bytes.view(), via_ucx->bytes.view());
  absl::StatusOr<transport::FetchedCache> decoded =
      ucx->Get("m", k, wire::Representation::kDecoded);
  ASSERT_TRUE(decoded.ok()) << decoded.status();

  // Gets into caller memory through the get region: the bytes UCX's get returns, stored and
  // decoded, twice (the region is reused).
  const UcxLinks links(shm.get());
  std::vector<char> into(decoded->bytes.size() + 100);
  for (int round = 0; round < 2; ++round) {
    LinkKind used = LinkKind::kNccl;
    absl::StatusOr<uint64_t> n =
        links.GetInto({"m", k, wire::Representation::kStored},
                      {into.data(), into.size(), MemoryKind::kHost}, absl::InfiniteFuture(), &used);
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(used, LinkKind::kShm);
    EXPECT_EQ(absl::string_view(into.data(), *n), via_shm->bytes.view());
    n = links.GetInto({"m", k, wire::Representation::kDecoded},
                      {into.data(), into.size(), MemoryKind::kHost}, absl::InfiniteFuture(), &used);
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(used, LinkKind::kShm);
    EXPECT_EQ(absl::string_view(into.data(), *n), decoded->bytes.view());
  }
  // The daemon's answers come back as they are: too small, absent.
  absl::StatusOr<uint64_t> n =
      links.GetInto({"m", k, wire::Representation::kStored},
                    {into.data(), 16, MemoryKind::kHost}, absl::InfiniteFuture());
  EXPECT_TRUE(absl::IsOutOfRange(n.status())) << n.status();
  n = links.GetInto({"m", "absent", wire::Representation::kStored},
                    {into.data(), into.size(), MemoryKind::kHost}, absl::InfiniteFuture());
  EXPECT_TRUE(absl::IsNotFound(n.status())) << n.status();
  EXPECT_TRUE(shm->SharedMemory()->usable()) << shm->SharedMemory()->why();
  EXPECT_EQ(shm->SharedMemory()->direct(), direct);

  // Get (a new buffer, its size unknown beforehand) through shared memory: the same bytes, one
  // get request each (no lookup first), an absent key a get miss.
  const double gets = Requests(*d, "get"), lookups = Requests(*d, "lookup");
  const transport::ShmChannel::Stats before = shm->SharedMemory()->stats();
  for (int round = 0; round < 2; ++round) {
    absl::StatusOr<transport::FetchedCache> g = shm->Get("m", k);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->bytes.view(), via_shm->bytes.view());
    EXPECT_EQ(g->representation, wire::Representation::kStored);
    g = shm->Get("m", k, wire::Representation::kDecoded);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->bytes.view(), decoded->bytes.view());
  }
  EXPECT_TRUE(absl::IsNotFound(shm->Get("m", "absent").status()));
  EXPECT_EQ(shm->SharedMemory()->stats().gets_shared, before.gets_shared + 4);
  EXPECT_EQ(shm->SharedMemory()->stats().gets_as_payload, before.gets_as_payload);
  EXPECT_EQ(Requests(*d, "get"), gets + 5);
  EXPECT_EQ(Requests(*d, "lookup"), lookups);
  }
}

TEST_F(ShmLinkDaemonTest, ADaemonWithItOffOffersOnlyUcx) {
  // The daemon with it off: not offered, the links are UCX's.
  auto off = StartDaemon({"--data_plane.shared_memory=false"});
  auto c = ConnectWith(*off, true);
  ASSERT_NE(c, nullptr);
  EXPECT_FALSE(c->server_info().server_flags & wire::kServerSharedMemory);
  EXPECT_EQ(c->SharedMemory(), nullptr);
  absl::StatusOr<LinkKind> used = Put(*c, "k", layout_.num_layers);
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_EQ(*used, LinkKind::kUcxHost);
}

TEST_F(ShmLinkDaemonTest, ACacheLargerThanTheClientsGetRegionComesOverUcx) {
  auto on = StartDaemon();
  auto small = ConnectWith(*on, true, "", "", /*max_get_region=*/128 << 10, /*direct=*/false);
  ASSERT_NE(small, nullptr);
  absl::StatusOr<LinkKind> used = Put(*small, "big", layout_.num_layers);
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_EQ(*used, LinkKind::kShm);
  absl::StatusOr<transport::FetchedCache> whole = small->Get("m", "big");
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_GT(whole->bytes.size(), (128u << 10) - transport::kShmGetDataOffset);
  std::vector<char> into(whole->bytes.size());
  LinkKind got = LinkKind::kNccl;
  absl::StatusOr<uint64_t> n =
      UcxLinks(small.get())
          .GetInto({"m", "big", wire::Representation::kStored},
                   {into.data(), into.size(), MemoryKind::kHost}, absl::InfiniteFuture(), &got);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(absl::string_view(into.data(), *n), whole->bytes.view());
  // It came as the reply's payload within the one get (the daemon counts one request).
  EXPECT_EQ(got, LinkKind::kShm);
  EXPECT_EQ(small->SharedMemory()->stats().gets_as_payload, 2u);  // Get above and GetInto
  EXPECT_EQ(Requests(*on, "get"), 2);
}

TEST_F(ShmLinkDaemonTest, AGetLargerThanTheRoomComesAsAPayloadInTheSameRequest) {
  auto d = StartDaemon();
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "direct" : "regions");
    // Room for 128 KiB: the cache is larger, the decoded one far larger.
    auto c = ConnectWith(*d, true, "", "", /*max_get_region=*/128 << 10, direct);
    auto ucx = ConnectWith(*d, false);
    ASSERT_NE(c, nullptr);
    ASSERT_NE(ucx, nullptr);
    const std::string k = direct ? "big-direct" : "big-regions";
    ASSERT_TRUE(Put(*c, k, layout_.num_layers, 3).ok());
    absl::StatusOr<transport::FetchedCache> want = ucx->Get("m", k);
    absl::StatusOr<transport::FetchedCache> want_decoded =
        ucx->Get("m", k, wire::Representation::kDecoded);
    ASSERT_TRUE(want.ok() && want_decoded.ok());
    ASSERT_GT(want_decoded->bytes.size(), 128u << 10);
    const double gets = Requests(*d, "get");
    for (int round = 0; round < 2; ++round) {
      absl::StatusOr<transport::FetchedCache> g = c->Get("m", k, wire::Representation::kDecoded);
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ(g->bytes.view(), want_decoded->bytes.view());
      g = c->Get("m", k);
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ(g->bytes.view(), want->bytes.view());
    }
    EXPECT_EQ(Requests(*d, "get"), gets + 4);
    EXPECT_EQ(c->SharedMemory()->direct(), direct);
    const transport::ShmChannel::Stats st = c->SharedMemory()->stats();
    EXPECT_GE(st.gets_as_payload, 2u);
    EXPECT_EQ(st.gets_shared + st.gets_as_payload, 4u);
    EXPECT_TRUE(absl::IsNotFound(c->Get("m", "absent").status()));
  }
}

TEST_F(ShmLinkDaemonTest, AGetGivenUpOnLeavesNothingTheDaemonCouldStillWriteInto) {
  auto d = StartDaemon();
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "direct" : "regions");
    auto c = ConnectWith(*d, true, "", "", uint64_t{1} << 30, direct);
    ASSERT_NE(c, nullptr);
    const std::string k = direct ? "late-direct" : "late-regions";
    ASSERT_TRUE(Put(*c, k, layout_.num_layers, 5).ok());
    absl::StatusOr<transport::FetchedCache> want = c->Get("m", k);  // decides the mode
    ASSERT_TRUE(want.ok()) << want.status();
    // A stopped daemon: the get ends at its deadline, whatever the daemon does later.
    d->Signal(SIGSTOP);
    const absl::Time t0 = absl::Now();
    absl::StatusOr<transport::FetchedCache> late =
        c->Get("m", k, wire::Representation::kStored, absl::Now() + absl::Milliseconds(300));
    EXPECT_TRUE(absl::IsDeadlineExceeded(late.status())) << late.status();
    EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
    d->Signal(SIGCONT);
    // The daemon then answers the abandoned get into what the client left reserved (direct:
    // an inaccessible range; regions: a region no longer used); later gets are whole.
    for (int i = 0; i < 3; ++i) {
      absl::StatusOr<transport::FetchedCache> g = c->Get("m", k);
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ(g->bytes.view(), want->bytes.view());
    }
    EXPECT_EQ(c->SharedMemory()->direct(), direct);
  }
}

TEST_F(ShmLinkDaemonTest, TheDaemonMapsOnlySealedAllocatedMemfdsOfAKnownConnection) {
  auto d = StartDaemon();
  auto c = ConnectWith(*d, true);
  ASSERT_NE(c, nullptr);
  const wire::HelloOk& hello = c->server_info();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  const uint64_t bytes = 1 << 20;
  auto memfd = [&](bool allocate, unsigned seals) {
    const int fd = memfd_create("kvcomp-shm-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, bytes), 0);
    if (allocate) {
      EXPECT_EQ(fallocate(fd, 0, 0, bytes), 0);
    }
    if (seals != 0) {
      EXPECT_EQ(fcntl(fd, F_ADD_SEALS, seals), 0);
    }
    return fd;
  };
  const int good = memfd(true, F_SEAL_SHRINK | F_SEAL_GROW);
  // A stranger: a token no connection holds.
  std::string forged = hello.shm_token;
  forged[0] ^= 1;
  absl::Status s = transport::SendShmAttach(hello.shm_socket, forged, 0, bytes, good, deadline);
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  // No descriptor, a pipe, an unsealed memfd, one not allocated, a wrong size, a bad region id.
  s = transport::SendShmAttach(hello.shm_socket, hello.shm_token, 0, bytes, -1, deadline);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  s = transport::SendShmAttach(hello.shm_socket, hello.shm_token, 0, bytes, pipefd[0], deadline);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  close(pipefd[0]);
  close(pipefd[1]);
  const int unsealed = memfd(true, 0);
  s = transport::SendShmAttach(hello.shm_socket, hello.shm_token, 0, bytes, unsealed, deadline);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  const int sparse = memfd(false, F_SEAL_SHRINK);
  s = transport::SendShmAttach(hello.shm_socket, hello.shm_token, 0, bytes, sparse, deadline);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  s = transport::SendShmAttach(hello.shm_socket, hello.shm_token, 0, bytes * 2, good, deadline);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  s = transport::SendShmAttach(hello.shm_socket, hello.shm_token, 7, bytes, good, deadline);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  // Larger than the daemon maps (its bound comes in hello-ok).
  s = transport::SendShmAttach(hello.shm_socket, hello.shm_token, 0,
                               hello.shm_max_region_bytes + 4096, good, deadline);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(SharedMappings(d->ports().pid), 0);
  // The proper one is taken.
  s = transport::SendShmAttach(hello.shm_socket, hello.shm_token, 0, bytes, good, deadline);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(SharedMappings(d->ports().pid), 1);
  // The token dies with its connection (and the mapping with it).
  const std::string token = hello.shm_token;
  const std::string socket = hello.shm_socket;
  c->Close();
  c.reset();
  for (int i = 0; i < 100 && SharedMappings(d->ports().pid) > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(SharedMappings(d->ports().pid), 0);
  s = transport::SendShmAttach(socket, token, 0, bytes, good, deadline);
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  for (int fd : {good, unsealed, sparse}) close(fd);
}

TEST_F(ShmLinkDaemonTest, BlocksAndGetsOutsideTheConnectionsRegionsAreRefused) {
  auto d = StartDaemon();
  auto c = ConnectWith(*d, true);
  ASSERT_NE(c, nullptr);
  absl::StatusOr<uint64_t> put = c->PutBegin(Begin("raw"));
  ASSERT_TRUE(put.ok()) << put.status();
  wire::Block b;
  b.put_id = *put;
  b.layer_begin = 0;
  b.layer_end = 1;
  b.token_begin = 0;
  b.token_end = 16;
  b.parts = wire::kPartBoth;
  b.key_bytes = b.value_bytes = layout_.LayerBytes(16);
  b.flags = wire::kBlockSharedMemory;
  auto send = [&](const wire::Block& blk) {
    absl::StatusOr<transport::RawReply> r =
        c->SendRawForTesting(4242, wire::Encode(4242, blk), "");
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->status : r.status();
  };
  // No put region attached yet.
  absl::Status s = send(b);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  absl::StatusOr<std::unique_ptr<transport::ShmRegion>> region = transport::ShmRegion::Attach(
      c->server_info(), transport::kShmPutRegion, 1 << 20, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(region.ok()) << region.status();
  // Past the end, wrapping around 2^64, straddling the end.
  for (uint64_t offset : {uint64_t{2} << 20, ~uint64_t{0} - 100, (uint64_t{1} << 20) - 4096}) {
    b.shm_offset = offset;
    s = send(b);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << offset << ": " << s;
  }
  // Checksums on a shared block, or a payload beside it: malformed.
  b.shm_offset = 0;
  wire::Block crc = b;
  crc.key_crc = 1;
  s = send(crc);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  std::string frame = wire::Encode(4243, b);
  absl::StatusOr<transport::RawReply> r = c->SendRawForTesting(4243, frame, "payload");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->status.ok());
  // In range: taken (the block's bytes are whatever the region holds).
  s = send(b);
  EXPECT_TRUE(s.ok()) << s;
  // Holes punched in the region after it was attached (the seals allow it): the daemon would
  // allocate the client's pages by touching them, so it refuses the block.
  ASSERT_EQ(madvise((*region)->data() + (512 << 10), 64 << 10, MADV_REMOVE), 0);
  b.token_begin = 16;
  b.token_end = 32;
  s = send(b);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  // A get beyond the get region (none attached yet, then past its end).
  wire::Get g{wire::Representation::kStored, "m", "raw", true, transport::kShmGetDataOffset,
              1 << 20};
  r = c->SendRawForTesting(4244, wire::Encode(4244, g), "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(absl::IsFailedPrecondition(r->status)) << r->status;
  absl::StatusOr<std::unique_ptr<transport::ShmRegion>> get_region =
      transport::ShmRegion::Attach(c->server_info(), transport::kShmGetRegion, 1 << 20,
                                   absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(get_region.ok()) << get_region.status();
  r = c->SendRawForTesting(4245, wire::Encode(4245, g), "");  // 4096 + 1 MiB > 1 MiB
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(absl::IsInvalidArgument(r->status)) << r->status;
  // The connection serves on.
  EXPECT_TRUE(c->Ping().ok());
  EXPECT_TRUE(c->PutAbort(*put).ok());
}

TEST_F(ShmLinkDaemonTest, DirectModeTouchesOnlyTheRegisteredPeersOwnMemory) {
  auto d = StartDaemon();
  auto c = ConnectWith(*d, true);
  ASSERT_NE(c, nullptr);
  const wire::HelloOk& hello = c->server_info();
  absl::StatusOr<uint64_t> put = c->PutBegin(Begin("direct"));
  ASSERT_TRUE(put.ok()) << put.status();
  std::vector<char> kv(2 * layout_.LayerBytes(16), 1);
  wire::Block b;
  b.put_id = *put;
  b.layer_end = 1;
  b.token_end = 16;
  b.parts = wire::kPartBoth;
  b.key_bytes = b.value_bytes = layout_.LayerBytes(16);
  b.flags = wire::kBlockPeerMemory;
  b.shm_offset = reinterpret_cast<uint64_t>(kv.data());
  b.peer_values = b.shm_offset + b.key_bytes;
  auto send = [&](const wire::Block& blk) {
    absl::StatusOr<transport::RawReply> r = c->SendRawForTesting(99, wire::Encode(99, blk), "");
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->status : r.status();
  };
  // Before the peer registers: refused.
  absl::Status s = send(b);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  // A registration with a descriptor, or with a probe the daemon cannot read: refused.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  const int fd = memfd_create("x", MFD_CLOEXEC);
  s = transport::SendShmAttach(hello.shm_socket, hello.shm_token, transport::kShmPeer, 0, fd,
                               deadline);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  close(fd);
  s = transport::SendShmAttach(hello.shm_socket, hello.shm_token, transport::kShmPeer, 0, -1,
                               deadline, /*probe=*/8);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  // A stranger's token registers nothing.
  std::string forged = hello.shm_token;
  forged[3] ^= 0x40;
  const uint64_t word = 0x1122334455667788;
  uint64_t read = 0;
  s = transport::SendShmAttach(hello.shm_socket, forged, transport::kShmPeer, 0, -1, deadline,
                               reinterpret_cast<uint64_t>(&word), &read);
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  s = send(b);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  // The proper registration: the daemon reads the probe back.
  s = transport::SendShmAttach(hello.shm_socket, hello.shm_token, transport::kShmPeer, 0, -1,
                               deadline, reinterpret_cast<uint64_t>(&word), &read);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(read, word);
  // Addresses that are not this process's memory: refused, the connection serves on.
  wire::Block bad = b;
  bad.shm_offset = 8;
  s = send(bad);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  bad = b;
  bad.peer_values = ~uint64_t{0} - 16;
  s = send(bad);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  s = send(b);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(c->PutAbort(*put).ok());
  // A stored cache: a direct get into an address that is not memory is refused; into memory
  // it holds the cache.
  absl::StatusOr<LinkKind> used = Put(*c, "stored", layout_.num_layers);
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_EQ(*used, LinkKind::kShm);
  wire::Get g{wire::Representation::kStored, "m", "stored", false, 8, 1 << 20, true};
  absl::StatusOr<transport::RawReply> r = c->SendRawForTesting(100, wire::Encode(100, g), "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(absl::IsInvalidArgument(r->status)) << r->status;
  absl::StatusOr<transport::FetchedCache> plain = c->Get("m", "stored");
  ASSERT_TRUE(plain.ok()) << plain.status();
  std::vector<char> into(plain->bytes.size());
  g.shm_offset = reinterpret_cast<uint64_t>(into.data());
  g.shm_capacity = into.size() - 1;  // one byte short
  r = c->SendRawForTesting(101, wire::Encode(101, g), "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(absl::IsOutOfRange(r->status)) << r->status;
  g.shm_capacity = into.size();
  r = c->SendRawForTesting(102, wire::Encode(102, g), "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->status.ok()) << r->status;
  EXPECT_EQ(absl::string_view(into.data(), into.size()), plain->bytes.view());
  EXPECT_TRUE(c->Ping().ok());
}

// The daemon's shared-memory copy threads (data_plane.shm_copy_lanes; 1 = one thread): blocks
// put directly and through the regions, several copied at once, store the bytes a put over UCX
// stores; a direct get of several lanes' bytes is split over the threads: the bytes UCX's get
// returns, into the caller's memory (GetInto) and into a new buffer (Get); a destination whose
// last page is read-only fails the whole get with InvalidArgument (the lanes before it have
// written), and the daemon and the connection serve on.
TEST_F(ShmLinkDaemonTest, ADirectGetSplitOverCopyLanesIsBitExact) {
  const KvLayout big{4, 4, 4, 128, DType::kF16};
  const uint64_t tokens = 5120, chunk = 1024;  // 40 MiB of K and V: five lanes' worth
  const uint64_t part = big.LayerBytes(chunk);
  for (int lanes : {3, 1}) {
    SCOPED_TRACE(::testing::Message() << lanes << " lanes");
    auto d = StartDaemon({"--data_plane.shm_copy_lanes=" + std::to_string(lanes)});
    auto shm = ConnectWith(*d, true);
    auto ucx = ConnectWith(*d, false);
    ASSERT_NE(shm, nullptr);
    ASSERT_NE(ucx, nullptr);
    ASSERT_NE(shm->SharedMemory(), nullptr);
    ASSERT_TRUE(shm->SharedMemory()->direct()) << shm->SharedMemory()->why();
    auto put_big = [&](transport::UcxClient& c, const std::string& key) -> absl::Status {
      wire::PutBegin begin = Begin(key);
      begin.layout = big;
      begin.num_tokens = tokens;
      KVCOMP_ASSIGN_OR_RETURN(const uint64_t put, c.PutBegin(begin));
      const UcxLinks links(&c);
      BlockPipe pipe(links, 8 * 2 * part);
      for (uint32_t l = 0; l < big.num_layers; ++l) {
        for (uint64_t t = 0; t < tokens; t += chunk) {
          // Finite f16 values, different per layer, token and element.
          auto packed = std::make_shared<std::string>(2 * part, '\0');
          for (size_t i = 0; i + 1 < packed->size(); i += 2) {
            (*packed)[i] = static_cast<char>(i * 131 + l * 7 + t / chunk);
            (*packed)[i + 1] = static_cast<char>(0x3c | ((i / 2 + l) & 3));
          }
          SendLayerBlock(pipe, put, l, t, chunk, part, packed);
        }
      }
      KVCOMP_RETURN_IF_ERROR(pipe.Wait());
      return c.PutCommit(put, pipe.sent()).status();
    };
    auto regions = ConnectWith(*d, true, "", "", uint64_t{1} << 30, /*direct=*/false);
    ASSERT_NE(regions, nullptr);
    ASSERT_TRUE(put_big(*shm, "big").ok());
    ASSERT_TRUE(put_big(*regions, "big-regions").ok());
    ASSERT_TRUE(put_big(*ucx, "big-ucx").ok());
    absl::StatusOr<transport::FetchedCache> over_ucx = ucx->Get("m", "big-ucx");
    absl::StatusOr<transport::FetchedCache> over_regions = ucx->Get("m", "big-regions");
    ASSERT_TRUE(over_ucx.ok() && over_regions.ok()) << over_ucx.status() << over_regions.status();
    EXPECT_TRUE(over_regions->bytes.view() == over_ucx->bytes.view());
    absl::StatusOr<transport::FetchedCache> ref = ucx->Get("m", "big");
    ASSERT_TRUE(ref.ok()) << ref.status();
    const uint64_t n = ref->bytes.size();
    ASSERT_GE(n, 3 * transport::kShmMinLaneBytes);
    EXPECT_TRUE(ref->bytes.view() == over_ucx->bytes.view());

    const UcxLinks links(shm.get());
    std::vector<char> into(n + 100, 0);
    for (int round = 0; round < 2; ++round) {
      LinkKind used = LinkKind::kNccl;
      absl::StatusOr<uint64_t> got =
          links.GetInto({"m", "big", wire::Representation::kStored},
                        {into.data(), into.size(), MemoryKind::kHost}, absl::InfiniteFuture(),
                        &used);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(used, LinkKind::kShm);
      ASSERT_EQ(*got, n);
      EXPECT_TRUE(absl::string_view(into.data(), n) == ref->bytes.view());
      absl::StatusOr<transport::FetchedCache> fresh = shm->Get("m", "big");
      ASSERT_TRUE(fresh.ok()) << fresh.status();
      EXPECT_TRUE(fresh->bytes.view() == ref->bytes.view());
    }
    EXPECT_EQ(shm->SharedMemory()->stats().gets_as_payload, 0u);

    // The last page of the destination read-only: the get fails as a whole.
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uint64_t len = (n + page - 1) / page * page;
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(m, MAP_FAILED);
    std::memset(m, 0, len);
    ASSERT_EQ(mprotect(static_cast<char*>(m) + len - page, page, PROT_READ), 0);
    wire::Get g{wire::Representation::kStored, "m", "big", false, reinterpret_cast<uint64_t>(m),
                n, true};
    absl::StatusOr<transport::RawReply> r = shm->SendRawForTesting(200, wire::Encode(200, g), "");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(absl::IsInvalidArgument(r->status)) << r->status;
    EXPECT_TRUE(absl::string_view(static_cast<char*>(m), 1 << 20) ==
                ref->bytes.view().substr(0, 1 << 20));
    munmap(m, len);
    EXPECT_TRUE(shm->Ping().ok());
    std::fill(into.begin(), into.end(), 0);
    absl::StatusOr<uint64_t> again =
        links.GetInto({"m", "big", wire::Representation::kStored},
                      {into.data(), into.size(), MemoryKind::kHost}, absl::InfiniteFuture());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(absl::string_view(into.data(), n) == ref->bytes.view());
  }
}

// The client's copy lanes (ClientOptions::shm_copy_lanes): through the regions, a block of
// several lanes' worth is copied into the put region on that many threads at once, the ring
// wrapping during the put; the same cache put with one lane, with three and over UCX stores
// the same bytes. A client killed while its lanes copy leaves no put and no mapping.
TEST_F(ShmLinkDaemonTest, BlocksCopiedOnSeveralClientLanesStoreTheSameBytes) {
  const KvLayout big{4, 4, 4, 128, DType::kF16};
  const uint64_t tokens = 2048, chunk = 512;  // blocks of 1 MiB: K 512 KiB, V 512 KiB
  const uint64_t part = big.LayerBytes(chunk);
  auto d = StartDaemon();
  const int daemon_pid = d->ports().pid;
  auto connect = [&](bool shared, uint32_t lanes) -> std::unique_ptr<transport::UcxClient> {
    transport::ClientOptions o;
    o.ucx.overrides["TLS"] = "tcp";
    o.shared_memory = shared;
    o.shm_direct = false;
    o.shm_put_region_bytes = 6 << 20;  // a ring of 6 blocks: it wraps during a put
    o.shm_copy_lanes = lanes;
    auto c = transport::UcxClient::Connect(*transport::Endpoint::Parse(d->data_endpoint()), "",
                                           "", o);
    return c.ok() ? std::move(*c) : nullptr;
  };
  // Puts `layers` of the cache (all: committed); the link its blocks took.
  auto put_big = [&](transport::UcxClient& c, const std::string& key,
                     uint32_t layers) -> absl::StatusOr<LinkKind> {
    wire::PutBegin begin = Begin(key);
    begin.layout = big;
    begin.num_tokens = tokens;
    KVCOMP_ASSIGN_OR_RETURN(const uint64_t put, c.PutBegin(begin));
    const UcxLinks links(&c);
    BlockPipe pipe(links, 4 * 2 * part);
    for (uint32_t l = 0; l < layers; ++l) {
      for (uint64_t t = 0; t < tokens; t += chunk) {
        auto packed = std::make_shared<std::string>(2 * part, '\0');
        for (size_t i = 0; i + 1 < packed->size(); i += 2) {
          (*packed)[i] = static_cast<char>(i * 29 + l * 5 + t / chunk);
          (*packed)[i + 1] = static_cast<char>(0x38 | ((i / 2 + l + t) & 7));
        }
        SendLayerBlock(pipe, put, l, t, chunk, part, packed);
      }
    }
    KVCOMP_RETURN_IF_ERROR(pipe.Wait());
    if (layers < big.num_layers) return pipe.link();
    KVCOMP_RETURN_IF_ERROR(c.PutCommit(put, pipe.sent()).status());
    return pipe.link();
  };
  const uint64_t blocks = big.num_layers * (tokens / chunk);
  auto ucx = connect(false, 0);
  ASSERT_NE(ucx, nullptr);
  ASSERT_TRUE(put_big(*ucx, "lanes-ucx", big.num_layers).ok());
  absl::StatusOr<transport::FetchedCache> ref = ucx->Get("m", "lanes-ucx");
  ASSERT_TRUE(ref.ok()) << ref.status();
  for (uint32_t lanes : {1u, 3u}) {
    SCOPED_TRACE(::testing::Message() << lanes << " client lanes");
    auto c = connect(true, lanes);
    ASSERT_NE(c, nullptr);
    ASSERT_NE(c->SharedMemory(), nullptr);
    EXPECT_FALSE(c->SharedMemory()->direct());
    EXPECT_EQ(c->SharedMemory()->copy_lanes(), static_cast<int>(lanes));
    const std::string key = "lanes-" + std::to_string(lanes);
    absl::StatusOr<LinkKind> used = put_big(*c, key, big.num_layers);
    ASSERT_TRUE(used.ok()) << used.status();
    EXPECT_EQ(*used, LinkKind::kShm);
    const transport::ShmChannel::Stats st = c->SharedMemory()->stats();
    EXPECT_EQ(st.blocks_copied, blocks);
    EXPECT_EQ(st.blocks_split, lanes > 1 ? blocks : 0u);
    absl::StatusOr<transport::FetchedCache> got = ucx->Get("m", key);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->bytes.view() == ref->bytes.view());
  }

  // Killed while its lanes copy (2 of 4 layers sent, no commit).
  int status = 0;
  ucx.reset();
  for (int attempt = 0; attempt < 20; ++attempt) {
    for (int i = 0; i < 100 && transport::GetUcxClientStats().endpoints_open > 0; ++i) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      auto c = connect(true, 3);
      if (c == nullptr || c->SharedMemory() == nullptr) _exit(3);
      absl::StatusOr<LinkKind> used = put_big(*c, "lanes-vanished", 2);
      if (!used.ok() || *used != LinkKind::kShm) _exit(4);
      if (c->SharedMemory()->stats().blocks_split == 0) _exit(6);
      raise(SIGKILL);
      _exit(5);
    }
    ASSERT_EQ(waitpid(child, &status, 0), child);
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 3)) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
      << "child exit " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  for (int i = 0; i < 200 && SharedMappings(daemon_pid) > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(SharedMappings(daemon_pid), 0);
  auto after = connect(true, 3);
  ASSERT_NE(after, nullptr);
  EXPECT_TRUE(absl::IsNotFound(after->Lookup("m", "lanes-vanished").status()));
  absl::StatusOr<LinkKind> used = put_big(*after, "lanes-after", big.num_layers);
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_EQ(*used, LinkKind::kShm);
  absl::StatusOr<transport::FetchedCache> got = after->Get("m", "lanes-after");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->bytes.view() == ref->bytes.view());
}

TEST_F(ShmLinkDaemonTest, TenantsStayApartOnSharedMemory) {
  WriteTokens("alpha: secret-a\nbeta: secret-b\n");
  auto d = StartDaemon({"--auth.token_file=" + tokens_path()});
  auto alpha = ConnectWith(*d, true, "alpha", "secret-a");
  auto beta = ConnectWith(*d, true, "beta", "secret-b");
  ASSERT_NE(alpha, nullptr);
  ASSERT_NE(beta, nullptr);
  EXPECT_NE(alpha->server_info().shm_token, beta->server_info().shm_token);
  absl::StatusOr<LinkKind> used = Put(*alpha, "secret", layout_.num_layers);
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_EQ(*used, LinkKind::kShm);
  // Beta's get of alpha's key through its own region: not found, nothing written.
  std::vector<char> into(1 << 20, 'x');
  absl::StatusOr<uint64_t> n =
      UcxLinks(beta.get())
          .GetInto({"m", "secret", wire::Representation::kStored},
                   {into.data(), into.size(), MemoryKind::kHost}, absl::InfiniteFuture());
  EXPECT_TRUE(absl::IsNotFound(n.status())) << n.status();
  EXPECT_TRUE(std::all_of(into.begin(), into.end(), [](char ch) { return ch == 'x'; }));
  // Alpha's regions are attached; a shared block of beta's reads only beta's own region (it has
  // a get region from the get above, no put region): refused.
  absl::StatusOr<uint64_t> put = beta->PutBegin(Begin("b"));
  ASSERT_TRUE(put.ok()) << put.status();
  wire::Block b;
  b.put_id = *put;
  b.layer_end = 1;
  b.token_end = 16;
  b.parts = wire::kPartBoth;
  b.key_bytes = b.value_bytes = layout_.LayerBytes(16);
  b.flags = wire::kBlockSharedMemory;
  absl::StatusOr<transport::RawReply> r = beta->SendRawForTesting(77, wire::Encode(77, b), "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(absl::IsFailedPrecondition(r->status)) << r->status;
  // A region offered with alpha's token lands in alpha's connection only; beta cannot name it.
  // Beta's own shared get of its own (absent) key is answered as over UCX.
  n = UcxLinks(beta.get())
          .GetInto({"m", "b", wire::Representation::kStored},
                   {into.data(), into.size(), MemoryKind::kHost}, absl::InfiniteFuture());
  EXPECT_TRUE(absl::IsNotFound(n.status())) << n.status();
  // Alpha still reads its cache through shared memory.
  LinkKind got = LinkKind::kNccl;
  n = UcxLinks(alpha.get())
          .GetInto({"m", "secret", wire::Representation::kStored},
                   {into.data(), into.size(), MemoryKind::kHost}, absl::InfiniteFuture(), &got);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(got, LinkKind::kShm);

  // Get into a new buffer, both ways through shared memory: beta's of alpha's key is not found
  // and beta's channel was written nothing; alpha's returns its cache.
  absl::StatusOr<transport::FetchedCache> mine = alpha->Get("m", "secret");
  ASSERT_TRUE(mine.ok()) << mine.status();
  std::unique_ptr<transport::UcxClient> beta_regions;
  for (bool direct : {true, false}) {
    auto b2 = ConnectWith(*d, true, "beta", "secret-b", uint64_t{1} << 30, direct);
    ASSERT_NE(b2, nullptr);
    EXPECT_TRUE(absl::IsNotFound(b2->Get("m", "secret").status()));
    EXPECT_TRUE(absl::IsNotFound(b2->Get("m", "secret", wire::Representation::kDecoded).status()));
    EXPECT_EQ(b2->SharedMemory()->direct(), direct);
    EXPECT_EQ(b2->SharedMemory()->stats().gets_shared, 0u);
    EXPECT_EQ(b2->SharedMemory()->stats().gets_as_payload, 0u);
    if (!direct) beta_regions = std::move(b2);  // it attached a get region for those gets
  }
  // Nor does a raw shared get with or-payload and no room fetch it as a payload.
  wire::Get raw{wire::Representation::kStored, "m", "secret", true, transport::kShmGetDataOffset, 0};
  raw.or_payload = true;
  r = beta_regions->SendRawForTesting(78, wire::Encode(78, raw), "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(absl::IsNotFound(r->status)) << r->status;
  EXPECT_EQ(r->payload_bytes, 0u);
  // Alpha's own such get: its cache as the reply's payload.
  auto regions = ConnectWith(*d, true, "alpha", "secret-a", uint64_t{1} << 30, false);
  ASSERT_NE(regions, nullptr);
  absl::StatusOr<transport::FetchedCache> again = regions->Get("m", "secret");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->bytes.view(), mine->bytes.view());
  r = regions->SendRawForTesting(79, wire::Encode(79, raw), "");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->status.ok()) << r->status;
  EXPECT_EQ(r->header.type, wire::MessageType::kGetReply);
  EXPECT_EQ(r->payload_bytes, mine->bytes.size());
}

TEST_F(ShmLinkDaemonTest, AClientKilledMidPutLeavesNoPutAndNoMapping) {
  auto d = StartDaemon();
  const int daemon_pid = d->ports().pid;
  for (bool direct : {false, true}) {
    SCOPED_TRACE(direct ? "direct" : "regions");
    const std::string key = direct ? "vanished-direct" : "vanished";
    // The child connects on its own: no client of this process may be open, or still closing,
    // while it forks (the last iteration's is let go by the worker's next tick): a child that
    // could not connect (exit 3) is forked again.
    int status = 0;
    for (int attempt = 0; attempt < 20; ++attempt) {
      for (int i = 0; i < 100 && transport::GetUcxClientStats().endpoints_open > 0; ++i) {
        absl::SleepFor(absl::Milliseconds(50));
      }
      const pid_t child = fork();
      ASSERT_GE(child, 0);
      if (child == 0) {
        auto c = ConnectWith(*d, true, "", "", uint64_t{1} << 30, direct);
        if (c == nullptr || c->SharedMemory() == nullptr) _exit(3);
        absl::StatusOr<LinkKind> used = Put(*c, key, 2);  // 2 of 4 layers, no commit
        if (!used.ok() || *used != LinkKind::kShm) _exit(4);
        if (c->SharedMemory()->direct() != direct) _exit(6);
        raise(SIGKILL);
        _exit(5);
      }
      ASSERT_EQ(waitpid(child, &status, 0), child);
      if (!(WIFEXITED(status) && WEXITSTATUS(status) == 3)) break;
      absl::SleepFor(absl::Milliseconds(200));
    }
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "child exit " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    // The daemon sees the connection go, aborts the put, unmaps the regions and lets go of
    // the peer.
    for (int i = 0; i < 200 && (SharedMappings(daemon_pid) > 0 || Pidfds(daemon_pid) > 0); ++i) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_EQ(SharedMappings(daemon_pid), 0);
    EXPECT_EQ(Pidfds(daemon_pid), 0);
    auto c = ConnectWith(*d, true, "", "", uint64_t{1} << 30, direct);
    ASSERT_NE(c, nullptr);
    EXPECT_TRUE(absl::IsNotFound(c->Lookup("m", key).status()));
    // The daemon serves on, through shared memory.
    absl::StatusOr<LinkKind> used = Put(*c, key, layout_.num_layers);
    ASSERT_TRUE(used.ok()) << used.status();
    EXPECT_EQ(*used, LinkKind::kShm);
    EXPECT_TRUE(c->Lookup("m", key).ok());
  }
}

}  // namespace
}  // namespace testing
}  // namespace kvcomp
