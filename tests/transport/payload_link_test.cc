// The payload links' choice (ChooseLinks: what both ends offer, the transfer's memory and
// locality, in preference order) and what a failed link call means (AfterLinkFailure: read
// from the status's code and typed detail, never its message).
#include "kvcomp/transport/payload_link.h"

#include <vector>

#include "gtest/gtest.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace transport {
namespace {

using K = LinkKind;

TEST(PayloadLinkTest, NamesAreTheResultPaths) {
  EXPECT_EQ(LinkName(K::kCudaIpc), "ipc");
  EXPECT_EQ(LinkName(K::kNccl), "nccl");
  EXPECT_EQ(LinkName(K::kUcxCuda), "ucx-cuda");
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
  EXPECT_EQ(ChooseLinks(all, all, {MemoryKind::kHost, Locality::kUnknown}),
            (std::vector<K>{K::kUcxCuda, K::kUcxHost}));
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

}  // namespace
}  // namespace transport
}  // namespace kvcomp
