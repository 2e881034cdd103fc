#include "kvcomp/transport/ucx_link.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kvcomp/transport/shm_link.h"

namespace kvcomp {
namespace transport {

namespace {

MemoryType TypeOf(MemoryKind kind) {
  return kind == MemoryKind::kCuda ? MemoryType::kCuda : MemoryType::kHost;
}

}  // namespace

absl::StatusOr<Registration> UcxLink::Register(const MemoryRegion& region) {
  if (kind_ == LinkKind::kUcxHost && region.kind != MemoryKind::kHost) {
    return MemoryNotServed(kind_, region.kind, "it moves host memory");
  }
  if (kind_ == LinkKind::kUcxCuda) {
    if (region.kind != MemoryKind::kCuda) {
      return MemoryNotServed(kind_, region.kind, "host memory goes over ucx");
    }
    if (!client_->LocalCudaMemory()) {
      return MemoryNotServed(kind_, region.kind,
                             "this process's UCX has no CUDA memory support (no cuda_copy / "
                             "cuda_ipc transports)");
    }
  }
  return Registration{region, ""};
}

absl::StatusOr<std::shared_ptr<Completion>> UcxLink::Post(const Transfer& t) {
  const MemoryKind memory = t.regions.empty() ? MemoryKind::kHost : t.regions.front().kind;
  for (const MemoryRegion& r : t.regions) {
    if (r.kind != memory) {
      return absl::InvalidArgumentError("a ucx transfer's regions are of one memory kind");
    }
  }
  if (t.direction == Direction::kSend) {
    if (t.block == nullptr || t.regions.size() != 2) {
      return absl::InvalidArgumentError("a ucx send is one put block: its keys and values");
    }
    if (memory == MemoryKind::kCuda) {
      if (absl::Status s = client_->DevicePayloads(); !s.ok()) {
        return MemoryNotServed(kind_, memory, s.message());
      }
    }
    std::shared_ptr<Completion> done = Completion::Pending();
    client_->SendBlockAsync(
        *t.block, t.regions[0].data, t.regions[1].data,
        [done](absl::Status s) { done->Finish(std::move(s)); }, TypeOf(memory));
    return done;
  }
  if (t.get == nullptr || t.regions.size() != 1) {
    return absl::InvalidArgumentError("a ucx receive is one get into one region");
  }
  absl::StatusOr<size_t> n =
      client_->GetInto(t.get->model_id, t.get->key, t.get->representation, t.regions[0].data,
                       t.regions[0].bytes, TypeOf(memory), t.deadline);
  if (!n.ok()) return Completion::Done(n.status());
  return Completion::Done(absl::OkStatus(), *n);
}

LinkOffer UcxPeerOffer(const wire::HelloOk& hello, Direction direction) {
  LinkOffer offer{LinkKind::kUcxHost};
  if (hello.server_flags & wire::kServerSharedMemory) offer.Add(LinkKind::kShm);
  if (direction == Direction::kReceive || (hello.server_flags & wire::kServerCudaMemory) != 0) {
    offer.Add(LinkKind::kUcxCuda);
  }
  return offer;
}

UcxLinks::UcxLinks(UcxClient* client)
    : host_(client, LinkKind::kUcxHost),
      cuda_(client, LinkKind::kUcxCuda),
      send_(UcxPeerOffer(client->server_info(), Direction::kSend)),
      receive_(UcxPeerOffer(client->server_info(), Direction::kReceive)) {
  if (ShmChannel* channel = client->SharedMemory(); channel != nullptr) {
    shm_.emplace(channel);
  }
  for (LinkRouter* r : {&send_, &receive_}) {
    if (shm_.has_value()) r->Add(&*shm_);
    r->Add(&host_);
    if (client->LocalCudaMemory()) r->Add(&cuda_);
  }
}

absl::StatusOr<uint64_t> UcxLinks::GetInto(const GetRequest& request, const MemoryRegion& into,
                                           absl::Time deadline, LinkKind* used) const {
  Transfer t;
  t.direction = Direction::kReceive;
  t.regions = {into};
  t.get = &request;
  t.deadline = deadline;
  std::shared_ptr<Completion> done;
  {
    absl::StatusOr<std::shared_ptr<Completion>> posted =
        receive_.Post({into.kind, Locality::kUnknown}, t, used);
    if (!posted.ok()) return posted.status();
    done = *std::move(posted);
  }
  if (absl::Status s = done->Wait(deadline); !s.ok()) return s;
  return done->bytes();
}

void BlockPipe::Send(const wire::Block& block, const MemoryRegion& keys,
                     const MemoryRegion& values, std::shared_ptr<const void> keep) {
  const uint64_t bytes = block.payload_bytes();
  {
    absl::MutexLock lock(&mu_);
    if (!error_.ok()) return;
    auto room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return inflight_ + bytes <= window_ || inflight_ == 0;
    };
    mu_.Await(absl::Condition(&room));
    inflight_ += bytes;
    ++sent_;
  }
  Transfer t;
  t.direction = Direction::kSend;
  t.regions = {keys, values};
  t.block = &block;
  LinkKind used = LinkKind::kUcxHost;
  absl::StatusOr<std::shared_ptr<Completion>> posted =
      links_.For(Direction::kSend).Post({keys.kind, Locality::kUnknown}, t, &used);
  if (!posted.ok()) {
    absl::MutexLock lock(&mu_);
    inflight_ -= bytes;
    if (error_.ok()) error_ = posted.status();
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    link_ = used;
  }
  (*posted)->Then([this, bytes, keep = std::move(keep)](const absl::Status& s) {
    absl::MutexLock lock(&mu_);
    inflight_ -= bytes;
    if (!s.ok() && error_.ok()) error_ = s;
  });
}

absl::Status BlockPipe::Wait() {
  absl::MutexLock lock(&mu_);
  auto idle = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return inflight_ == 0; };
  mu_.Await(absl::Condition(&idle));
  return error_;
}

uint64_t BlockPipe::sent() {
  absl::MutexLock lock(&mu_);
  return sent_;
}

LinkKind BlockPipe::link() {
  absl::MutexLock lock(&mu_);
  return link_;
}

}  // namespace transport
}  // namespace kvcomp
