#include "kvcomp/transport/ucx_link.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/gpu_link.h"
#include "kvcomp/transport/shm_link.h"

namespace kvcomp {
namespace transport {

// Pinned host buffers that stage CUDA memory for ucx, kept for reuse until the last holder (the
// link, or a send in flight) lets go. Thread-safe; gives back without a CUDA call (on a progress
// thread), frees in the destructor.
class PinnedPool {
 public:
  struct Buffer {
    uint8_t* data = nullptr;
    uint64_t bytes = 0;
  };
  PinnedPool() = default;
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;
  ~PinnedPool() {
    for (const Buffer& b : free_) rt_->FreePinned(b.data);
  }

  // The smallest kept buffer of at least `bytes`, or a new one (the current device's context).
  absl::StatusOr<Buffer> Take(GpuRuntime* rt, uint64_t bytes) {
    {
      absl::MutexLock lock(&mu_);
      rt_ = rt;
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->bytes >= bytes && (best == free_.end() || it->bytes < best->bytes)) best = it;
      }
      if (best != free_.end()) {
        Buffer b = *best;
        free_.erase(best);
        return b;
      }
    }
    KVCOMP_ASSIGN_OR_RETURN(void* p, rt->AllocPinned(bytes));
    return Buffer{static_cast<uint8_t*>(p), bytes};
  }
  void Give(Buffer b) {
    absl::MutexLock lock(&mu_);
    free_.push_back(b);
  }

 private:
  absl::Mutex mu_;
  GpuRuntime* rt_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::vector<Buffer> free_ ABSL_GUARDED_BY(mu_);
};

namespace {

MemoryType TypeOf(MemoryKind kind) {
  return kind == MemoryKind::kCuda ? MemoryType::kCuda : MemoryType::kHost;
}

// How long a CUDA transfer waits for the work queued on its stream before it.
absl::Time StreamDeadline(const Transfer& t) {
  return std::min(t.deadline, absl::Now() + absl::Minutes(1));
}

}  // namespace

UcxLink::UcxLink(UcxClient* client, LinkKind kind)
    : client_(client), kind_(kind), staging_(std::make_shared<PinnedPool>()) {}

absl::StatusOr<Registration> UcxLink::Register(const MemoryRegion& region) {
  if (kind_ == LinkKind::kUcxHost && region.kind == MemoryKind::kCuda && region.bytes > 0) {
    // Staged through pinned host memory: needs the driver, and device memory to copy from.
    absl::StatusOr<GpuRuntime*> rt = GpuRuntime::Get();
    if (!rt.ok()) {
      return MemoryNotServed(
          kind_, region.kind,
          absl::StrCat("no CUDA driver to stage it through host memory: ", rt.status().message()));
    }
    if (absl::StatusOr<int> device = (*rt)->DeviceOf(region.data); !device.ok()) {
      return MemoryNotServed(kind_, region.kind,
                             absl::StrCat("not CUDA device memory: ", device.status().message()));
    }
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
  if (t.direction == Direction::kSend && (t.block == nullptr || t.regions.size() != 2)) {
    return absl::InvalidArgumentError("a ucx send is one put block: its keys and values");
  }
  if (t.direction == Direction::kReceive && (t.get == nullptr || t.regions.size() != 1)) {
    return absl::InvalidArgumentError("a ucx receive is one get into one region");
  }
  if (memory == MemoryKind::kCuda && kind_ == LinkKind::kUcxHost) return PostStaged(t);
  if (memory == MemoryKind::kCuda) {
    if (t.direction == Direction::kSend) {
      if (absl::Status s = client_->DevicePayloads(); !s.ok()) {
        return MemoryNotServed(kind_, memory, s.message());
      }
    }
    // UCX reads and writes the device memory outside any stream: the stream's work first.
    KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, GpuRuntime::Get());
    KVCOMP_RETURN_IF_ERROR(rt->WaitStream(t.stream, StreamDeadline(t)));
  }
  if (t.direction == Direction::kSend) {
    std::shared_ptr<Completion> done = Completion::Pending();
    client_->SendBlockAsync(
        *t.block, t.regions[0].data, t.regions[1].data,
        [done](absl::Status s) { done->Finish(std::move(s)); }, TypeOf(memory));
    return done;
  }
  absl::StatusOr<size_t> n =
      client_->GetInto(t.get->model_id, t.get->key, t.get->representation, t.regions[0].data,
                       t.regions[0].bytes, TypeOf(memory), t.deadline);
  if (!n.ok()) return Completion::Done(n.status());
  return Completion::Done(absl::OkStatus(), *n);
}

absl::StatusOr<std::shared_ptr<Completion>> UcxLink::PostStaged(const Transfer& t) {
  KVCOMP_ASSIGN_OR_RETURN(GpuRuntime * rt, GpuRuntime::Get());
  uint64_t total = 0;
  for (const MemoryRegion& r : t.regions) {
    if (r.bytes == 0) continue;
    total += r.bytes;
    KVCOMP_ASSIGN_OR_RETURN(int device, rt->DeviceOf(r.data));
    KVCOMP_RETURN_IF_ERROR(rt->SetDevice(device));  // the pinned memory's and copies' context
  }
  KVCOMP_ASSIGN_OR_RETURN(PinnedPool::Buffer staged, staging_->Take(rt, total));
  // The copies into or out of `staged` go on the stream and are waited for; where that wait
  // fails a copy may still use `staged`, which is then left out of the pool (not reused).
  if (t.direction == Direction::kSend) {
    void* parts[2] = {nullptr, nullptr};
    uint64_t at = 0;
    absl::Status s;
    for (int i = 0; i < 2 && s.ok(); ++i) {
      const MemoryRegion& r = t.regions[i];
      if (r.bytes == 0) continue;
      parts[i] = staged.data + at;
      s = rt->CopyAsync(parts[i], r.data, r.bytes, GpuRuntime::Copy::kDeviceToHost, t.stream);
      at += r.bytes;
    }
    const absl::Status waited = rt->WaitStream(t.stream, StreamDeadline(t));
    if (s.ok()) s = waited;
    if (!s.ok()) {
      if (waited.ok()) staging_->Give(staged);  // else a copy may still write it: kept out
      return s;
    }
    std::shared_ptr<Completion> done = Completion::Pending();
    client_->SendBlockAsync(
        *t.block, parts[0], parts[1],
        [done, pool = staging_, staged](absl::Status s) {
          pool->Give(staged);
          done->Finish(std::move(s));
        },
        MemoryType::kHost);
    return done;
  }
  const MemoryRegion& into = t.regions[0];
  absl::StatusOr<size_t> n =
      client_->GetInto(t.get->model_id, t.get->key, t.get->representation, staged.data, into.bytes,
                       MemoryType::kHost, t.deadline);
  absl::Status s = n.status();
  if (n.ok() && *n > 0) {
    s = rt->CopyAsync(into.data, staged.data, *n, GpuRuntime::Copy::kHostToDevice, t.stream);
    const absl::Status waited = rt->WaitStream(t.stream, StreamDeadline(t));
    if (!waited.ok()) return Completion::Done(waited);
  }
  staging_->Give(staged);
  if (!s.ok()) return Completion::Done(std::move(s));
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
                                           absl::Time deadline, LinkKind* used,
                                           void* stream) const {
  Transfer t;
  t.direction = Direction::kReceive;
  t.regions = {into};
  t.get = &request;
  t.stream = stream;
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
                     const MemoryRegion& values, std::shared_ptr<const void> keep,
                     void* stream) {
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
  t.stream = stream;
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
