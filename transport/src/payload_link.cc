#include "kvcomp/transport/payload_link.h"

#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/status.h"

namespace kvcomp {
namespace transport {

absl::string_view LinkName(LinkKind kind) {
  switch (kind) {
    case LinkKind::kCudaIpc:
      return "ipc";
    case LinkKind::kNccl:
      return "nccl";
    case LinkKind::kUcxCuda:
      return "ucx-cuda";
    case LinkKind::kUcxHost:
      return "ucx";
  }
  return "unknown";
}

LinkCaps CapsOf(LinkKind kind) {
  LinkCaps c;
  switch (kind) {
    case LinkKind::kCudaIpc:
      c.cuda_memory = true;
      c.same_device = true;
      break;
    case LinkKind::kNccl:
      c.cuda_memory = true;
      c.other_device = true;  // one GPU cannot be both ranks of a communicator
      break;
    case LinkKind::kUcxCuda:
      c.cuda_memory = c.host_memory = true;
      c.same_device = c.other_device = true;
      break;
    case LinkKind::kUcxHost:
      c.host_memory = true;
      c.same_device = c.other_device = true;
      c.staged = true;
      break;
  }
  return c;
}

LinkOffer::LinkOffer(std::initializer_list<LinkKind> kinds) {
  for (LinkKind k : kinds) Add(k);
}

LinkOffer LinkOffer::All() {
  return LinkOffer{LinkKind::kCudaIpc, LinkKind::kNccl, LinkKind::kUcxCuda, LinkKind::kUcxHost};
}

std::vector<LinkKind> ChooseLinks(const LinkOffer& local, const LinkOffer& remote,
                                  const TransferNeed& need) {
  std::vector<LinkKind> out;
  for (int i = 0; i < kLinkKinds; ++i) {
    const LinkKind kind = static_cast<LinkKind>(i);
    if (!local.Has(kind) || !remote.Has(kind)) continue;
    const LinkCaps caps = CapsOf(kind);
    const bool memory = need.memory == MemoryKind::kHost
                            ? caps.host_memory
                            : caps.cuda_memory || caps.staged;
    const bool reaches = need.locality == Locality::kUnknown ||
                         (need.locality == Locality::kSameDevice ? caps.same_device
                                                                 : caps.other_device);
    if (memory && reaches) out.push_back(kind);
  }
  return out;
}

LinkVerdict AfterLinkFailure(const absl::Status& failure) {
  if (IsBusy(failure)) return LinkVerdict::kAnswer;
  switch (DetailOf(failure)) {
    case ErrorDetail::kLinkGone:
      return LinkVerdict::kReopen;
    case ErrorDetail::kMemoryNotMappable:
      return LinkVerdict::kNextLink;
    default:
      break;
  }
  return absl::IsUnavailable(failure) ? LinkVerdict::kReopen : LinkVerdict::kAnswer;
}

}  // namespace transport
}  // namespace kvcomp
