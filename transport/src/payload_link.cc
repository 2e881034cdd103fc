#include "kvcomp/transport/payload_link.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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
    case LinkKind::kShm:
      return "shm";
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
      c.cuda_memory = true;  // host memory goes over ucx: the same bytes, named for what they are
      c.same_device = c.other_device = true;
      break;
    case LinkKind::kShm:
      // Host memory of a peer on the same host (offered only once a region is attached, which
      // proves it): either device locality, as for ucx.
      c.host_memory = true;
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
  return LinkOffer{LinkKind::kCudaIpc, LinkKind::kNccl, LinkKind::kUcxCuda, LinkKind::kShm,
                   LinkKind::kUcxHost};
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

absl::Status MemoryNotServed(LinkKind link, MemoryKind memory, absl::string_view why) {
  return WithDetail(
      absl::FailedPreconditionError(absl::StrCat(
          LinkName(link), " link cannot reach ", memory == MemoryKind::kCuda ? "CUDA" : "host",
          " memory in place", why.empty() ? "" : ": ", why)),
      ErrorDetail::kMemoryNotMappable);
}

std::shared_ptr<Completion> Completion::Pending() {
  return std::shared_ptr<Completion>(new Completion());
}

std::shared_ptr<Completion> Completion::Done(absl::Status status, uint64_t bytes) {
  std::shared_ptr<Completion> c = Pending();
  c->Finish(std::move(status), bytes);
  return c;
}

std::shared_ptr<Completion> Completion::ByWaiting(
    absl::AnyInvocable<absl::Status(absl::Time deadline)> wait, uint64_t bytes) {
  std::shared_ptr<Completion> c = Pending();
  absl::MutexLock lock(&c->mu_);
  c->wait_ = std::move(wait);
  c->bytes_ = bytes;
  return c;
}

void Completion::Finish(absl::Status status, uint64_t bytes) {
  std::vector<absl::AnyInvocable<void(const absl::Status&)>> then;
  {
    absl::MutexLock lock(&mu_);
    if (done_) return;
    done_ = true;
    status_ = std::move(status);
    if (bytes != 0) bytes_ = bytes;
    then.swap(then_);
  }
  // status_ no longer changes once done_.
  for (auto& f : then) f(status_);
}

std::optional<absl::Status> Completion::Check() {
  absl::MutexLock lock(&mu_);
  if (!done_) return std::nullopt;
  return status_;
}

absl::Status Completion::Wait(absl::Time deadline) {
  absl::AnyInvocable<absl::Status(absl::Time)> wait;
  {
    absl::MutexLock lock(&mu_);
    wait.swap(wait_);
    if (wait == nullptr) {
      if (!mu_.AwaitWithDeadline(absl::Condition(&done_), deadline)) {
        return absl::DeadlineExceededError("the transfer did not complete in time");
      }
      return status_;
    }
  }
  Finish(wait(deadline));
  absl::MutexLock lock(&mu_);
  return status_;
}

void Completion::Then(absl::AnyInvocable<void(const absl::Status&)> done) {
  {
    absl::MutexLock lock(&mu_);
    if (!done_) {
      then_.push_back(std::move(done));
      return;
    }
  }
  done(status_);
}

uint64_t Completion::bytes() {
  absl::MutexLock lock(&mu_);
  return done_ ? bytes_ : 0;
}

void LinkRouter::Add(PayloadLink* link) {
  local_.Add(link->kind());
  links_.push_back(link);
}

std::vector<PayloadLink*> LinkRouter::Choose(const TransferNeed& need) const {
  std::vector<PayloadLink*> out;
  for (LinkKind kind : ChooseLinks(local_, remote_, need)) {
    for (PayloadLink* link : links_) {
      if (link->kind() == kind) out.push_back(link);
    }
  }
  return out;
}

absl::StatusOr<std::shared_ptr<Completion>> LinkRouter::Post(const TransferNeed& need,
                                                             const Transfer& transfer,
                                                             LinkKind* used) const {
  std::string refusals;
  for (PayloadLink* link : Choose(need)) {
    absl::Status refused;
    for (const MemoryRegion& r : transfer.regions) {
      absl::StatusOr<Registration> reg = link->Register(r);
      if (!reg.ok()) {
        refused = reg.status();
        break;
      }
    }
    absl::StatusOr<std::shared_ptr<Completion>> posted =
        refused.ok() ? link->Post(transfer)
                     : absl::StatusOr<std::shared_ptr<Completion>>(std::move(refused));
    if (posted.ok()) {
      if (used != nullptr) *used = link->kind();
      return posted;
    }
    if (AfterLinkFailure(posted.status()) != LinkVerdict::kNextLink) return posted.status();
    absl::StrAppend(&refusals, refusals.empty() ? "" : "; ", posted.status().message());
  }
  return WithDetail(
      absl::FailedPreconditionError(absl::StrCat(
          "no payload link both ends offer can carry ",
          need.memory == MemoryKind::kCuda ? "CUDA" : "host", " memory",
          refusals.empty() ? "" : ": ", refusals)),
      ErrorDetail::kMemoryNotMappable);
}

}  // namespace transport
}  // namespace kvcomp
