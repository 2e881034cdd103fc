// CudaIpcLink (gpu_link.h): CUDA IPC between two processes on one GPU, and the description of
// one end's memory that the other end maps (IpcMemory). The link's whole code, on both sides of
// the interface (payload_link.h): what it registers, what the peer sends, how it maps, copies
// and unmaps.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/byte_coder.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/status.h"
#include "kvcomp/transport/gpu_link.h"

namespace kvcomp {
namespace transport {

std::string EncodeIpcMemory(const IpcMemory& memory) {
  byte_coder::ByteWriter w;
  w.Put<uint32_t>(static_cast<uint32_t>(memory.handles.size()));
  w.Put<uint32_t>(static_cast<uint32_t>(memory.regions.size()));
  for (const std::string& h : memory.handles) w.Raw(h);
  for (const IpcMemory::Region& r : memory.regions) {
    w.Put<uint32_t>(r.handle);
    w.Zeros(4);
    w.Put<uint64_t>(r.offset);
    w.Put<uint64_t>(r.bytes);
  }
  return w.Take();
}

absl::StatusOr<IpcMemory> DecodeIpcMemory(absl::string_view bytes) {
  constexpr size_t kHandleBytes = 64;
  byte_coder::ByteReader r(bytes, "ipc memory");
  const uint32_t handles = r.Get<uint32_t>("handles");
  const uint32_t regions = r.Get<uint32_t>("regions");
  if (r.ok() && (handles == 0 || regions == 0)) {
    return absl::InvalidArgumentError("ipc memory: no handle or no region");
  }
  if (r.ok() && (handles > r.left() / kHandleBytes || regions > r.left() / 24)) {
    return absl::DataLossError("ipc memory: truncated");
  }
  IpcMemory out;
  for (uint32_t i = 0; r.ok() && i < handles; ++i) {
    out.handles.push_back(r.Bytes(kHandleBytes, "handle"));
  }
  for (uint32_t i = 0; r.ok() && i < regions; ++i) {
    IpcMemory::Region g;
    g.handle = r.Get<uint32_t>("region handle");
    r.Skip(4, "reserved");
    g.offset = r.Get<uint64_t>("region offset");
    g.bytes = r.Get<uint64_t>("region bytes");
    if (r.ok() && (g.handle >= handles || g.bytes == 0)) {
      return absl::InvalidArgumentError(absl::StrCat("ipc memory: region ", i, " names handle ",
                                                     g.handle, " of ", handles, " with ",
                                                     g.bytes, " bytes"));
    }
    out.regions.push_back(g);
  }
  KVCOMP_RETURN_IF_ERROR(r.Finish());
  return out;
}

absl::StatusOr<std::string> CudaIpcLink::Describe(GpuRuntime* rt,
                                                  absl::Span<const MemoryRegion> regions) {
  IpcMemory m;
  for (const MemoryRegion& r : regions) {
    if (r.kind != MemoryKind::kCuda) {
      return MemoryNotServed(LinkKind::kCudaIpc, r.kind, "CUDA IPC shares device memory");
    }
    absl::StatusOr<GpuRuntime::ExportedMemory> e = rt->ExportMemory(r.data);
    if (!e.ok()) {
      return WithDetail(Annotate(e.status(), "exporting memory for CUDA IPC"),
                        ErrorDetail::kMemoryNotMappable);
    }
    uint32_t index = 0;
    while (index < m.handles.size() && m.handles[index] != e->handle) ++index;
    if (index == m.handles.size()) m.handles.push_back(e->handle);
    m.regions.push_back({index, e->offset, r.bytes});
  }
  return EncodeIpcMemory(m);
}

absl::StatusOr<Registration> CudaIpcLink::Register(const MemoryRegion& region) {
  KVCOMP_ASSIGN_OR_RETURN(std::string descriptor, Describe(rt_, {region}));
  return Registration{region, std::move(descriptor)};
}

absl::StatusOr<std::vector<MemoryRegion>> CudaIpcLink::MapPeer(const Transfer& t) {
  if (t.peer.empty()) {
    return absl::InvalidArgumentError("a CUDA IPC transfer must name the peer's memory");
  }
  KVCOMP_ASSIGN_OR_RETURN(IpcMemory m, DecodeIpcMemory(t.peer));
  if (m.regions.size() != t.regions.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the peer's memory has ", m.regions.size(),
                                                   " regions; the transfer has ",
                                                   t.regions.size()));
  }
  for (size_t i = 0; i < m.regions.size(); ++i) {
    const uint64_t want = t.regions[i].bytes, got = m.regions[i].bytes;
    if (t.peer_may_be_larger ? got < want : got != want) {
      return absl::InvalidArgumentError(
          absl::StrCat("CUDA IPC region ", i, " has ", got, " bytes; the transfer's has ", want));
    }
  }
  Unmap();
  std::vector<size_t> sizes;
  for (const std::string& h : m.handles) {
    size_t bytes = 0;
    absl::StatusOr<void*> p = rt_->OpenMemory(h, &bytes);
    if (!p.ok()) {
      Unmap();
      return WithDetail(Annotate(p.status(), "mapping the peer's memory"),
                        ErrorDetail::kMemoryNotMappable);
    }
    mapped_.push_back(*p);
    sizes.push_back(bytes);
  }
  std::vector<MemoryRegion> peer;
  for (size_t i = 0; i < m.regions.size(); ++i) {
    const IpcMemory::Region& g = m.regions[i];
    if (g.offset > sizes[g.handle] || t.regions[i].bytes > sizes[g.handle] - g.offset) {
      Unmap();
      return absl::InvalidArgumentError(
          absl::StrCat("CUDA IPC region ", i, " lies outside its allocation"));
    }
    peer.push_back({static_cast<uint8_t*>(mapped_[g.handle]) + g.offset, t.regions[i].bytes,
                    MemoryKind::kCuda});
  }
  return peer;
}

void CudaIpcLink::Unmap() {
  for (void* p : mapped_) rt_->CloseMemory(p);
  mapped_.clear();
}

absl::StatusOr<std::shared_ptr<Completion>> CudaIpcLink::Post(const Transfer& t) {
  KVCOMP_ASSIGN_OR_RETURN(const std::vector<MemoryRegion> peer, MapPeer(t));
  if (peer_event_ != nullptr) KVCOMP_RETURN_IF_ERROR(rt_->StreamWaitEvent(stream_, peer_event_));
  if (timer_ != nullptr) KVCOMP_RETURN_IF_ERROR(timer_->Start(stream_));
  for (size_t i = 0; i < peer.size(); ++i) {
    const bool send = t.direction == Direction::kSend;
    KVCOMP_RETURN_IF_ERROR(rt_->CopyAsync(send ? peer[i].data : t.regions[i].data,
                                          send ? t.regions[i].data : peer[i].data,
                                          t.regions[i].bytes, GpuRuntime::Copy::kDeviceToDevice,
                                          stream_));
  }
  if (timer_ != nullptr) KVCOMP_RETURN_IF_ERROR(timer_->Stop(stream_));
  return Completion::ByWaiting([this](absl::Time deadline) {
    absl::Status s = rt_->WaitStream(stream_, deadline);
    if (s.ok()) Unmap();  // the copies are done
    return s;
  });
}

}  // namespace transport
}  // namespace kvcomp
