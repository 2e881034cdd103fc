// The payload links' choice (ChooseLinks: what both ends offer, the transfer's memory and
// locality, in preference order), what a failed link call means (AfterLinkFailure: read
// from the status's code and typed detail, never its message), a completion's report, and the
// router's fallback by capability over links that refuse memory (links of this test that
// refuse or take what they are given; the UCX links against a real kvcompd are in
// tests/client/payload_links_test.cc).
#include "kvcomp/transport/payload_link.h"

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/gpu_link.h"
#include "kvcomp/transport/ucx_link.h"

namespace kvcomp {
namespace transport {
namespace {

using K = LinkKind;

TEST(PayloadLinkTest, NamesAreTheResultPaths) {
  EXPECT_EQ(LinkName(K::kCudaIpc), "ipc");
  EXPECT_EQ(LinkName(K::kNccl), "nccl");
  EXPECT_EQ(LinkName(K::kUcxCuda), "ucx-cuda");
  EXPECT_EQ(LinkName(K::kShm), "shm");
  EXPECT_EQ(LinkName(K::kUcxHost), "ucx");
}

TEST(PayloadLinkTest, DeviceMemoryTakesTheBestLinkBothEndsOfferThenFallsBackByCapability) {
  const TransferNeed same{MemoryKind::kCuda, Locality::kSameDevice};
  const TransferNeed other{MemoryKind::kCuda, Locality::kOtherDevice};
  const TransferNeed unknown{MemoryKind::kCuda, Locality::kUnknown};
  const LinkOffer all = LinkOffer::All();
  // The same GPU: IPC, never NCCL (one GPU cannot be both ranks); another GPU: NCCL, never IPC.
  EXPECT_EQ(ChooseLinks(all, all, same), (std::vector<K>{K::kCudaIpc, K::kUcxCuda, K::kUcxHost}));
  EXPECT_EQ(ChooseLinks(all, all, other), (std::vector<K>{K::kNccl, K::kUcxCuda, K::kUcxHost}));
  EXPECT_EQ(ChooseLinks(all, all, unknown),
            (std::vector<K>{K::kCudaIpc, K::kNccl, K::kUcxCuda, K::kUcxHost}));
  // A link one end lacks is skipped, whichever end lacks it.
  const LinkOffer no_nccl{K::kCudaIpc, K::kUcxCuda, K::kUcxHost};
  EXPECT_EQ(ChooseLinks(no_nccl, all, other), (std::vector<K>{K::kUcxCuda, K::kUcxHost}));
  EXPECT_EQ(ChooseLinks(all, no_nccl, other), (std::vector<K>{K::kUcxCuda, K::kUcxHost}));
  // Without CUDA-aware UCX on either side, device memory is staged through host memory.
  const LinkOffer host_only{K::kUcxHost};
  EXPECT_EQ(ChooseLinks(all, host_only, same), (std::vector<K>{K::kUcxHost}));
  // Nothing in common: no link.
  EXPECT_TRUE(ChooseLinks(LinkOffer{K::kNccl}, LinkOffer{K::kCudaIpc}, unknown).empty());
  EXPECT_TRUE(ChooseLinks(LinkOffer(), all, unknown).empty());
}

TEST(PayloadLinkTest, HostMemoryGoesOnlyOverLinksThatReadHostMemory) {
  const LinkOffer all = LinkOffer::All();
  // Shared memory first where both ends offer it (a region attached: the same host), else ucx.
  EXPECT_EQ(ChooseLinks(all, all, {MemoryKind::kHost, Locality::kUnknown}),
            (std::vector<K>{K::kShm, K::kUcxHost}));
  EXPECT_EQ(ChooseLinks(all, LinkOffer{K::kUcxHost}, {MemoryKind::kHost, Locality::kUnknown}),
            (std::vector<K>{K::kUcxHost}));
  // Device memory never goes over shm (it reads host memory only, nothing staged).
  EXPECT_EQ(ChooseLinks(LinkOffer{K::kShm}, all, {MemoryKind::kCuda, Locality::kUnknown}),
            (std::vector<K>{}));
  EXPECT_EQ(ChooseLinks(all, LinkOffer{K::kCudaIpc, K::kNccl, K::kUcxHost},
                        {MemoryKind::kHost, Locality::kOtherDevice}),
            (std::vector<K>{K::kUcxHost}));
}

TEST(PayloadLinkTest, OfferAddsAndRemoves) {
  LinkOffer o;
  EXPECT_TRUE(o.empty());
  o.Add(K::kNccl);
  EXPECT_TRUE(o.Has(K::kNccl));
  EXPECT_FALSE(o.Has(K::kCudaIpc));
  o.Remove(K::kNccl);
  EXPECT_TRUE(o.empty());
}

TEST(PayloadLinkTest, FailuresAreJudgedByTypedDetailNotText) {
  // A gone link is reopened, whatever its code.
  EXPECT_EQ(AfterLinkFailure(WithDetail(absl::NotFoundError("x"), ErrorDetail::kLinkGone)),
            LinkVerdict::kReopen);
  EXPECT_EQ(AfterLinkFailure(WithDetail(absl::UnavailableError("x"), ErrorDetail::kLinkGone)),
            LinkVerdict::kReopen);
  // Memory the peer cannot map: the next link.
  EXPECT_EQ(AfterLinkFailure(WithDetail(absl::FailedPreconditionError("x"),
                                        ErrorDetail::kMemoryNotMappable)),
            LinkVerdict::kNextLink);
  // Busy is the peer's answer (back-pressure), not a broken link.
  EXPECT_EQ(AfterLinkFailure(BusyError("serve queue full")), LinkVerdict::kAnswer);
  // A dropped connection or a draining peer: reopen.
  EXPECT_EQ(AfterLinkFailure(absl::UnavailableError("connection reset")), LinkVerdict::kReopen);
  // Text that once decided now decides nothing.
  EXPECT_EQ(AfterLinkFailure(absl::NotFoundError("no GPU channel 3 open for this tenant")),
            LinkVerdict::kAnswer);
  EXPECT_EQ(AfterLinkFailure(absl::FailedPreconditionError("mapping the client's memory: x")),
            LinkVerdict::kAnswer);
  EXPECT_EQ(AfterLinkFailure(absl::UnavailableError("[busy] x")), LinkVerdict::kReopen);
  EXPECT_EQ(AfterLinkFailure(absl::InvalidArgumentError("bad layout")), LinkVerdict::kAnswer);
}

TEST(PayloadLinkTest, ACompletionReportsOnceToWaitersCheckersAndCallbacks) {
  std::shared_ptr<Completion> c = Completion::Pending();
  EXPECT_FALSE(c->Check().has_value());
  EXPECT_TRUE(absl::IsDeadlineExceeded(c->Wait(absl::Now() + absl::Milliseconds(20))));
  std::atomic<int> called{0};
  c->Then([&](const absl::Status& s) {
    EXPECT_TRUE(absl::IsDataLoss(s));
    ++called;
  });
  std::thread finisher([c] { c->Finish(absl::DataLossError("torn"), 7); });
  EXPECT_TRUE(absl::IsDataLoss(c->Wait()));
  finisher.join();
  c->Finish(absl::OkStatus(), 9);  // the first outcome stays
  EXPECT_TRUE(absl::IsDataLoss(*c->Check()));
  EXPECT_EQ(c->bytes(), 7u);
  EXPECT_EQ(called.load(), 1);
  // A callback given after the end runs at once.
  c->Then([&](const absl::Status&) { ++called; });
  EXPECT_EQ(called.load(), 2);

  std::shared_ptr<Completion> done = Completion::Done(absl::OkStatus(), 3);
  EXPECT_TRUE(done->Check()->ok());
  EXPECT_EQ(done->bytes(), 3u);

  int waits = 0;
  std::shared_ptr<Completion> waited = Completion::ByWaiting(
      [&](absl::Time) {
        ++waits;
        return absl::OkStatus();
      },
      5);
  EXPECT_FALSE(waited->Check().has_value());  // known only by waiting
  EXPECT_TRUE(waited->Wait().ok());
  EXPECT_TRUE(waited->Wait().ok());
  EXPECT_EQ(waits, 1);
  EXPECT_EQ(waited->bytes(), 5u);
}

// A link of a given kind that takes the memory kinds it is told to and counts what it posts, or
// fails its posts with `post_error`.
class TestLink : public PayloadLink {
 public:
  TestLink(LinkKind kind, bool takes_cuda, bool takes_host, absl::Status post_error = {})
      : kind_(kind), cuda_(takes_cuda), host_(takes_host), post_error_(post_error) {}
  LinkKind kind() const override { return kind_; }
  absl::StatusOr<Registration> Register(const MemoryRegion& r) override {
    if ((r.kind == MemoryKind::kCuda && !cuda_) || (r.kind == MemoryKind::kHost && !host_)) {
      return MemoryNotServed(kind_, r.kind, "not in this test");
    }
    ++registered;
    return Registration{r, "descriptor"};
  }
  absl::StatusOr<std::shared_ptr<Completion>> Post(const Transfer& t) override {
    if (!post_error_.ok()) return post_error_;
    ++posted;
    return Completion::Done(absl::OkStatus(), t.regions.empty() ? 0 : t.regions[0].bytes);
  }
  int registered = 0;
  int posted = 0;

 private:
  const LinkKind kind_;
  const bool cuda_, host_;
  const absl::Status post_error_;
};

TEST(PayloadLinkTest, TheRouterTakesTheFirstLinkThatAcceptsAndFallsBackByCapability) {
  TestLink ipc(K::kCudaIpc, /*takes_cuda=*/false, false);  // e.g. memory of another device
  TestLink nccl(K::kNccl, true, false);
  TestLink ucx(K::kUcxHost, false, true);
  LinkRouter router(LinkOffer::All());
  router.Add(&ipc);
  router.Add(&nccl);
  router.Add(&ucx);
  EXPECT_TRUE(router.local().Has(K::kNccl));
  char buf[16];
  Transfer t;
  t.regions = {{buf, sizeof(buf), MemoryKind::kCuda}};
  // The same device: ipc is chosen first and refuses the memory; ucx (staged) is next: it refuses
  // device memory in place too, so nothing carries it, and the error names both refusals.
  K used = K::kUcxCuda;
  absl::StatusOr<std::shared_ptr<Completion>> r =
      router.Post({MemoryKind::kCuda, Locality::kSameDevice}, t, &used);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(AfterLinkFailure(r.status()), LinkVerdict::kNextLink) << r.status();
  EXPECT_EQ(ipc.posted + nccl.posted + ucx.posted, 0);
  // Locality unknown: ipc refuses, nccl takes it.
  r = router.Post({MemoryKind::kCuda, Locality::kUnknown}, t, &used);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(used, K::kNccl);
  EXPECT_EQ(nccl.posted, 1);
  EXPECT_EQ((*r)->bytes(), sizeof(buf));
  // The peer offers no nccl: the same transfer has no link.
  LinkRouter no_nccl(LinkOffer{K::kCudaIpc, K::kUcxHost});
  no_nccl.Add(&ipc);
  no_nccl.Add(&nccl);
  no_nccl.Add(&ucx);
  EXPECT_EQ(no_nccl.Choose({MemoryKind::kCuda, Locality::kUnknown}).size(), 2u);  // ipc, ucx
  EXPECT_FALSE(no_nccl.Post({MemoryKind::kCuda, Locality::kUnknown}, t).ok());
  // Host memory goes over ucx only.
  t.regions[0].kind = MemoryKind::kHost;
  r = router.Post({MemoryKind::kHost, Locality::kUnknown}, t, &used);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(used, K::kUcxHost);
}

TEST(PayloadLinkTest, OnlyARefusalOfTheMemoryMovesTheRouterToTheNextLink) {
  char buf[4];
  Transfer t;
  t.regions = {{buf, sizeof(buf), MemoryKind::kCuda}};
  const TransferNeed need{MemoryKind::kCuda, Locality::kOtherDevice};
  // The first link fails its post with a busy answer, a gone link or a refusal given as text
  // only: the caller gets it, and the next link is not tried.
  for (const absl::Status& failure :
       {BusyError("queue full"), WithDetail(absl::NotFoundError("x"), ErrorDetail::kLinkGone),
        absl::FailedPreconditionError("cannot map the memory: another device")}) {
    TestLink nccl(K::kNccl, true, true, failure);
    TestLink ucx_cuda(K::kUcxCuda, true, true);
    LinkRouter router(LinkOffer::All());
    router.Add(&nccl);
    router.Add(&ucx_cuda);
    absl::StatusOr<std::shared_ptr<Completion>> r = router.Post(need, t);
    EXPECT_EQ(r.status(), failure);
    EXPECT_EQ(ucx_cuda.posted, 0) << failure;
  }
  // The same post failing with kMemoryNotMappable: the next link carries it.
  TestLink nccl(K::kNccl, true, true,
                WithDetail(absl::FailedPreconditionError("x"), ErrorDetail::kMemoryNotMappable));
  TestLink ucx_cuda(K::kUcxCuda, true, true);
  LinkRouter router(LinkOffer::All());
  router.Add(&nccl);
  router.Add(&ucx_cuda);
  K used = K::kNccl;
  ASSERT_TRUE(router.Post(need, t, &used).ok());
  EXPECT_EQ(used, K::kUcxCuda);
  EXPECT_EQ(ucx_cuda.posted, 1);
}

// The GPU links' checks that need no device: host memory is refused as not served (the router's
// cue for the next link), a CUDA IPC transfer must name the peer's regions, one for one and of
// the same sizes (at least those sizes where the peer's may be larger) before anything is mapped,
// and an NCCL transfer names none. Their transfers run on the GPU machine only.
TEST(PayloadLinkTest, GpuLinksRefuseHostMemoryAsNotServed) {
  NcclPayloadLink nccl(nullptr);
  CudaIpcLink ipc(nullptr, nullptr, nullptr);
  EXPECT_EQ(nccl.kind(), K::kNccl);
  EXPECT_EQ(ipc.kind(), K::kCudaIpc);
  char buf[8];
  for (PayloadLink* link : std::vector<PayloadLink*>{&nccl, &ipc}) {
    absl::StatusOr<Registration> r = link->Register({buf, sizeof(buf), MemoryKind::kHost});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(AfterLinkFailure(r.status()), LinkVerdict::kNextLink) << r.status();
    EXPECT_FALSE(link->caps().host_memory);
    EXPECT_TRUE(link->caps().cuda_memory);
  }
  Transfer t;
  t.regions = {{buf, 4, MemoryKind::kCuda}, {buf + 4, 4, MemoryKind::kCuda}};
  EXPECT_TRUE(absl::IsInvalidArgument(ipc.Post(t).status()));  // no peer named
  IpcMemory peer;
  peer.handles = {std::string(64, 'h')};
  peer.regions = {{0, 0, 4}};
  std::string named = EncodeIpcMemory(peer);
  t.peer = named;
  EXPECT_TRUE(absl::IsInvalidArgument(ipc.Post(t).status()));  // one region of two
  peer.regions = {{0, 0, 4}, {0, 4, 2}};
  named = EncodeIpcMemory(peer);
  t.peer = named;
  EXPECT_TRUE(absl::IsInvalidArgument(ipc.Post(t).status()));  // smaller
  t.peer_may_be_larger = true;
  EXPECT_TRUE(absl::IsInvalidArgument(ipc.Post(t).status()));  // smaller still
  t.peer = "garbage";
  EXPECT_FALSE(ipc.Post(t).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(nccl.Post(t).status()));  // nccl names no peer memory
}

// The ucx link takes CUDA memory by staging it through pinned host memory: only where it can
// copy it (a CUDA driver, and device memory at the address), else it refuses the memory as not
// served, so that the router reports no link instead of failing mid-transfer; a part a block
// lacks (0 bytes) is taken whatever its kind. The ucx-cuda link takes CUDA memory only.
TEST(PayloadLinkTest, IpcMemoryDescriptorsRoundTripAndBadOnesAreRefused) {
  IpcMemory m;
  m.handles = {std::string(64, 'a'), std::string(64, 'b')};
  m.regions = {{0, 0, 4096}, {1, 8192, 4096}, {0, 4096, 100}};
  const std::string bytes = EncodeIpcMemory(m);
  EXPECT_EQ(bytes.size(), 8 + 2 * 64 + 3 * 24u);
  absl::StatusOr<IpcMemory> back = DecodeIpcMemory(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->handles, m.handles);
  ASSERT_EQ(back->regions.size(), 3u);
  EXPECT_EQ(back->regions[1].handle, 1u);
  EXPECT_EQ(back->regions[1].offset, 8192u);
  EXPECT_EQ(back->regions[2].bytes, 100u);
  EXPECT_FALSE(DecodeIpcMemory("").ok());
  EXPECT_FALSE(DecodeIpcMemory(bytes.substr(0, bytes.size() - 1)).ok());
  EXPECT_FALSE(DecodeIpcMemory(bytes + "x").ok());
  IpcMemory bad = m;
  bad.regions[0].handle = 2;  // no such handle
  EXPECT_TRUE(absl::IsInvalidArgument(DecodeIpcMemory(EncodeIpcMemory(bad)).status()));
  bad = m;
  bad.regions[2].bytes = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(DecodeIpcMemory(EncodeIpcMemory(bad)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(DecodeIpcMemory(EncodeIpcMemory(IpcMemory{})).status()));
}

TEST(PayloadLinkTest, TheUcxLinkStagesOnlyCudaMemoryItCanCopy) {
  UcxLink ucx(nullptr, K::kUcxHost);
  UcxLink ucx_cuda(nullptr, K::kUcxCuda);
  EXPECT_TRUE(ucx.caps().staged);
  EXPECT_FALSE(ucx_cuda.caps().staged);
  std::vector<char> host(4096);
  EXPECT_TRUE(ucx.Register({host.data(), host.size(), MemoryKind::kHost}).ok());
  EXPECT_TRUE(ucx.Register({nullptr, 0, MemoryKind::kCuda}).ok());
  // Host memory claimed as device memory: on this machine either no CUDA driver or a driver
  // that does not know the address; refused either way, with the reason.
  absl::StatusOr<Registration> r = ucx.Register({host.data(), host.size(), MemoryKind::kCuda});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(AfterLinkFailure(r.status()), LinkVerdict::kNextLink) << r.status();
  EXPECT_EQ(DetailOf(r.status()), ErrorDetail::kMemoryNotMappable) << r.status();
  const bool driver = GpuRuntime::Get().ok();
  EXPECT_TRUE(absl::StrContains(r.status().message(),
                                driver ? "not CUDA device memory" : "no CUDA driver to stage it"))
      << r.status();
  absl::StatusOr<Registration> in_place =
      ucx_cuda.Register({host.data(), host.size(), MemoryKind::kHost});
  EXPECT_EQ(AfterLinkFailure(in_place.status()), LinkVerdict::kNextLink) << in_place.status();

  // The router over both: CUDA memory is offered to ucx-cuda first, then to the staging ucx;
  // each refusal is named in the one typed answer.
  LinkRouter router(LinkOffer{K::kUcxCuda, K::kUcxHost});
  router.Add(&ucx);
  router.Add(&ucx_cuda);
  const TransferNeed cuda{MemoryKind::kCuda, Locality::kUnknown};
  std::vector<K> chosen;
  for (PayloadLink* l : router.Choose(cuda)) chosen.push_back(l->kind());
  EXPECT_EQ(chosen, (std::vector<K>{K::kUcxCuda, K::kUcxHost}));
  // A daemon whose UCX cannot take device payloads: only the staging link.
  chosen.clear();
  LinkRouter host_peer(LinkOffer{K::kUcxHost});
  host_peer.Add(&ucx);
  host_peer.Add(&ucx_cuda);
  for (PayloadLink* l : host_peer.Choose(cuda)) chosen.push_back(l->kind());
  EXPECT_EQ(chosen, (std::vector<K>{K::kUcxHost}));
}

}  // namespace
}  // namespace transport
}  // namespace kvcomp
