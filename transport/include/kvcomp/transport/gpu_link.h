// The GPU channel's payload link: CUDA device memory moved between two processes with NCCL
// point-to-point (ncclSend / ncclRecv on a two-rank communicator), and the few CUDA driver calls
// around it (device of a pointer, device and pinned memory, streams, events). docs/protocol.md,
// "GPU channel", says how kvcompd and the SDK use it.
//
// Nothing here links against CUDA or NCCL at build time: the CUDA driver (libcuda.so.1) and
// NCCL (libnccl.so.2) are opened at run time, the first time a process asks for them, so CPU
// builds, CI and wheels need neither. NCCL is found, in order, at the path in the environment
// variable KVCOMP_NCCL_LIBRARY (only there, when it is set), through the loader
// (LD_LIBRARY_PATH, ldconfig, or a copy the process has loaded already, e.g. PyTorch's), then in
// the nvidia/nccl/lib folder of a Python installation's site-packages (PyTorch's wheel
// dependency nvidia-nccl-cu*), looked for under $VIRTUAL_ENV, $CONDA_PREFIX, /usr/local, /usr,
// ~/.local and the entries of $PYTHONPATH. NCCL 2.14.3 or later is required (non-blocking
// communicators).
//
// Errors: FailedPrecondition when a library is missing or too old (the message names what was
// tried), Unavailable when no CUDA device is present or the peer fails, DeadlineExceeded when a
// communicator does not form or a transfer does not finish in time (the communicator is then
// aborted), InvalidArgument for bad arguments (host memory where device memory is expected).
//
// Threads: GpuRuntime's methods are thread-safe. An NcclLink is used by one thread at a time.
#ifndef KVCOMP_TRANSPORT_GPU_LINK_H_
#define KVCOMP_TRANSPORT_GPU_LINK_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvcomp/core/layout.h"
#include "kvcomp/transport/payload_link.h"

namespace kvcomp {
namespace transport {

class GpuRuntime {
 public:
  // The process's CUDA driver, opened and initialised once (the first outcome is kept).
  // FailedPrecondition without libcuda.so.1, Unavailable without a CUDA device.
  static absl::StatusOr<GpuRuntime*> Get();

  // NCCL, opened once per process on first use (the first outcome is kept); OK when loaded.
  // Needs no CUDA driver (so a machine without one still says why NCCL is missing).
  static absl::Status LoadNccl();
  // NCCL's version code (e.g. 22703 for 2.27.3) and the file it was loaded from; 0 and "" until
  // LoadNccl succeeded.
  static int nccl_version();
  static std::string nccl_path();

  int device_count() const { return device_count_; }
  // Makes `device`'s primary context current on the calling thread (every call below acts on
  // the current device). InvalidArgument for an ordinal out of range.
  absl::Status SetDevice(int device);
  // The device whose memory `ptr` is; InvalidArgument for host memory or an unknown pointer.
  absl::StatusOr<int> DeviceOf(const void* ptr);
  // The device's 16-byte UUID, raw.
  absl::StatusOr<std::string> DeviceUuid(int device);
  // A new NCCL unique id (128 bytes): the caller becomes rank 0 of the communicator it names
  // and listens for the other rank's bootstrap connection. Needs LoadNccl.
  absl::StatusOr<std::string> NewUniqueId();

  // Memory and streams on the current device. Free functions accept null.
  absl::StatusOr<void*> AllocDevice(size_t bytes);
  void FreeDevice(void* ptr);
  absl::StatusOr<void*> AllocPinned(size_t bytes);
  void FreePinned(void* ptr);
  absl::StatusOr<void*> NewStream();  // non-blocking with respect to the legacy stream
  void DestroyStream(void* stream);

  enum class Copy { kDeviceToHost, kHostToDevice, kDeviceToDevice };
  absl::Status CopyAsync(void* dst, const void* src, size_t bytes, Copy kind, void* stream);
  // Copies between devices (cudaMemcpyPeer) on `stream`, a stream of `src_device`, which is the
  // current device afterwards.
  absl::Status CopyPeerAsync(void* dst, int dst_device, const void* src, int src_device,
                             size_t bytes, void* stream);
  // Lets `device` read and write `peer`'s memory directly (NVLink / PCIe P2P); OK when already
  // enabled. `device` is the current device afterwards.
  absl::Status EnablePeerAccess(int device, int peer);
  // Makes `waiter` wait for the work queued on `producer` so far (an event; the host does not
  // wait). Either stream may be null (the legacy default stream).
  absl::Status StreamWaitStream(void* waiter, void* producer);
  // Waits on the host until the work queued on `stream` so far is done (an event recorded
  // there; never the whole device), polling until `deadline` (DeadlineExceeded).
  absl::Status WaitStream(void* stream, absl::Time deadline);

  // A timer of work on one stream: Start and Stop record events; Seconds waits for Stop.
  class Timer {
   public:
    ~Timer();
    absl::Status Start(void* stream);
    absl::Status Stop(void* stream);
    absl::StatusOr<double> Seconds(absl::Time deadline);

   private:
    friend class GpuRuntime;
    explicit Timer(GpuRuntime* rt) : rt_(rt) {}
    GpuRuntime* rt_;
    void* start_ = nullptr;
    void* stop_ = nullptr;
  };
  absl::StatusOr<std::unique_ptr<Timer>> NewTimer();

  // --- CUDA IPC: memory and events shared with another process on the same device ---
  // Whether the driver has the IPC entry points (every Linux driver does).
  bool has_ipc() const { return has_ipc_; }
  // The allocation that holds device pointer `ptr`: an IPC handle of it (64 bytes), the
  // offset of `ptr` in it and its size. InvalidArgument for memory that is not CUDA device
  // memory of cuMemAlloc (cudaMalloc, PyTorch's caching allocator), FailedPrecondition for
  // memory the driver cannot export (e.g. made by cuMemCreate without a shareable handle).
  struct ExportedMemory {
    std::string handle;
    size_t offset = 0;
    size_t allocation_bytes = 0;
  };
  absl::StatusOr<ExportedMemory> ExportMemory(const void* ptr);
  // Maps another process's allocation (ExportMemory's handle) on the current device; its size
  // in `bytes`. Unmapped with CloseMemory. InvalidArgument for a malformed handle,
  // FailedPrecondition when the driver refuses it (another device, a freed allocation).
  absl::StatusOr<void*> OpenMemory(const std::string& handle, size_t* bytes);
  void CloseMemory(void* ptr);
  // An interprocess event on the current device (no timing) and its 64-byte handle; another
  // process opens it with OpenEvent and waits for its latest record with StreamWaitEvent.
  absl::StatusOr<void*> NewIpcEvent(std::string* handle);
  // An event of this process on the current device (no timing), for RecordEvent and
  // StreamWaitEvent; freed with DestroyEvent.
  absl::StatusOr<void*> NewEvent();
  absl::StatusOr<void*> OpenEvent(const std::string& handle);
  void DestroyEvent(void* event);
  absl::Status RecordEvent(void* event, void* stream);
  // Makes `stream` wait for `event`'s latest record (no host wait).
  absl::Status StreamWaitEvent(void* stream, void* event);

  // The driver's message for a CUresult, with `what` in front.
  absl::Status CudaError(int result, const char* what) const;

 private:
  friend class NcclLink;
  GpuRuntime() = default;
  absl::Status Init();
  absl::Status WaitEvent(void* event, absl::Time deadline, const std::function<absl::Status()>& poll);

  void* cuda_handle_ = nullptr;
  struct Api;
  std::unique_ptr<Api> api_;
  int device_count_ = 0;
  bool has_ipc_ = false;
};

// Device memory from GpuRuntime::AllocDevice, freed on scope exit.
class ScopedDeviceMemory {
 public:
  ScopedDeviceMemory(GpuRuntime* rt, void* ptr) : rt_(rt), ptr_(ptr) {}
  ~ScopedDeviceMemory() { rt_->FreeDevice(ptr_); }
  ScopedDeviceMemory(const ScopedDeviceMemory&) = delete;
  ScopedDeviceMemory& operator=(const ScopedDeviceMemory&) = delete;
  void* get() const { return ptr_; }

 private:
  GpuRuntime* const rt_;
  void* const ptr_;
};

// The dense K and V of a cache whose stored bytes (docs/format.md) lie in device memory of the
// current device (`stored`, `stored_bytes`), copied on the device on `stream` into `keys[l]`
// and `values[l]` (layer l's [kv head][token][dim], layout.LayerBytes(num_tokens) bytes each;
// one copy per layer, so each destination may be an allocation of its own). Used by kvcompd's
// dense gets and the SDK's dense gets over UCX. The header and section table are read on the host
// first (format::DenseKvSections); returns once the copies are done, so `stored` may be freed.
// false, nothing copied: the bytes are not a cache of `layout` and `num_tokens` that kept every
// token with raw codecs (another cache, or one replaced meanwhile). Errors: the driver's,
// DeadlineExceeded past `deadline`, InvalidArgument when the spans do not have one entry per
// layer.
absl::StatusOr<bool> CopyDenseKv(GpuRuntime* rt, const void* stored, uint64_t stored_bytes,
                                 const KvLayout& layout, uint64_t num_tokens,
                                 absl::Span<void* const> keys, absl::Span<void* const> values,
                                 void* stream, absl::Time deadline);

// A two-rank NCCL communicator between this process and one peer, on one device of this
// process. Payloads go as ncclSend / ncclRecv of bytes, enqueued on a caller's stream.
class NcclLink {
 public:
  // Joins the communicator that `unique_id` (GpuRuntime::NewUniqueId, made by rank 0) names, as
  // `rank` (0 or 1) on `device`, with NCCL's non-blocking initialisation: returns once both
  // ranks have joined, or DeadlineExceeded after `timeout` (the half-formed communicator is
  // aborted), or NCCL's error (Unavailable). Needs GpuRuntime::LoadNccl.
  static absl::StatusOr<std::unique_ptr<NcclLink>> Join(const std::string& unique_id, int rank,
                                                        int device, absl::Duration timeout);
  // Frees the communicator (ncclCommAbort: never waits for the peer; a transfer in flight
  // fails on both sides).
  ~NcclLink();

  struct Chunk {
    void* data;    // device memory of this link's device
    size_t bytes;  // may be 0 (skipped)
  };
  // Posts, for `stream` (of this link's device), one NCCL group that sends `chunks` to the peer,
  // in order; the peer receives them with Recv of chunks of the same sizes (NCCL matches each
  // send with one receive, so sizes must agree chunk by chunk). Returns without waiting for the
  // peer: with a non-blocking communicator the group may still be being enqueued (the first
  // transfer also connects the two ranks, which needs the peer to post its side), so work meant
  // to follow it on `stream` (an event, a copy) waits for Enqueued first.
  absl::Status Send(absl::Span<const Chunk> chunks, void* stream);
  absl::Status Recv(absl::Span<const Chunk> chunks, void* stream);
  // Waits until the last group posted is on its stream; past `deadline` (the peer never posted
  // its side) or on an NCCL error the communicator is aborted and the link is broken.
  absl::Status Enqueued(absl::Time deadline);
  // Waits (Enqueued first) until what is queued on `stream` so far has finished, watching the
  // communicator's asynchronous error. On an NCCL error (Unavailable) or past `deadline` (DeadlineExceeded) it
  // aborts the communicator, which stops its kernels so `stream` drains, and the link is broken.
  absl::Status Wait(void* stream, absl::Time deadline);
  // Aborts the communicator (kernels stop, peers see an error). Idempotent.
  void Abort();

  bool broken() const { return broken_; }
  int device() const { return device_; }
  int rank() const { return rank_; }

 private:
  NcclLink(GpuRuntime* rt, void* comm, int device, int rank)
      : rt_(rt), comm_(comm), device_(device), rank_(rank) {}
  absl::Status Post(absl::Span<const Chunk> chunks, void* stream, bool send);
  absl::Status AsyncError();
  absl::Status NcclError(int result, const char* what) const;

  GpuRuntime* const rt_;
  void* comm_;
  const int device_;
  const int rank_;
  bool broken_ = false;
  bool pending_ = false;    // ops posted and not yet waited for
  bool enqueuing_ = false;  // the last group posted may not be on its stream yet
};

// The GPU links behind PayloadLink (payload_link.h). Both move CUDA memory of one device, in
// place, in transfer order on the transfer's stream; what the peer's side is (its regions of
// the same sizes, its IPC handles and event) is agreed beforehand on the control plane
// (docs/protocol.md, "GPU channel"). Their completions are learned by waiting on the stream.
// With a timer, a transfer is timed on its stream (Timer::Seconds after the completion).
//
// NcclPayloadLink: one NcclLink. A send or receive is one group of ncclSend / ncclRecv of the
// regions (Transfer::regions); Post returns once it is posted, before the peer posts its side
// (a receive is posted before the peer is told to send). Enqueued waits until the group is on
// its stream (the peer posted its side; the timer stops there); the completion waits for that,
// then for the stream (NcclLink::Wait: past its deadline or on an NCCL error the communicator
// is aborted). One thread at a time, as NcclLink; the link outlives its completions.
class NcclPayloadLink final : public PayloadLink {
 public:
  explicit NcclPayloadLink(NcclLink* link, GpuRuntime::Timer* timer = nullptr)
      : link_(link), timer_(timer) {}
  LinkKind kind() const override { return LinkKind::kNccl; }
  // CUDA memory only (the device is the caller's to match: NCCL fails the group otherwise).
  absl::StatusOr<Registration> Register(const MemoryRegion& region) override;
  absl::StatusOr<std::shared_ptr<Completion>> Post(const Transfer& transfer) override;
  absl::Status Enqueued(absl::Time deadline);

 private:
  NcclLink* const link_;
  GpuRuntime::Timer* const timer_;
  void* stream_ = nullptr;  // of the last transfer posted
  bool stop_ = false;       // its timer not stopped yet
};

// The memory of one transfer over CUDA IPC as the end that offers it describes it to the
// other (a link block's descriptor, wire::kBlockLinkPayload): the IPC handles of its
// allocations and where each region of the transfer lies in them, in transfer order.
struct IpcMemory {
  struct Region {
    uint32_t handle = 0;  // index into `handles`
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  std::vector<std::string> handles;  // 64-byte CUDA IPC memory handles
  std::vector<Region> regions;
};
// u32 handles, u32 regions, the handles, then per region u32 handle, u32 zero, u64 offset,
// u64 bytes; little-endian.
std::string EncodeIpcMemory(const IpcMemory& memory);
// InvalidArgument (or DataLoss for truncated bytes) for anything else: no handle or region, a
// region naming a handle that is not there, an empty region, trailing bytes.
absl::StatusOr<IpcMemory> DecodeIpcMemory(absl::string_view bytes);

// CudaIpcLink: CUDA IPC on one device. The end that offers its memory describes it (Describe,
// or Register for one region: the IPC handles of the allocations holding the regions and where
// each lies in them, EncodeIpcMemory). At the end that maps the peer's memory (kvcompd), a
// transfer names the peer's regions so (Transfer::peer); Post checks them against this end's
// `regions` (InvalidArgument: another count or size, a region outside its allocation), maps the
// peer's allocations (FailedPrecondition with kMemoryNotMappable when the driver refuses one)
// and copies on `stream`, after the peer's event (its producer's work on its stream); a send
// writes the peer's memory, a receive reads it; the timer covers the copies. The completion
// waits for the stream, then unmaps the peer's memory (else it stays mapped until the next Post
// or the link's end). Thread-safe as GpuRuntime; one transfer at a time per stream; the current
// device is the link's at every call and at its end.
class CudaIpcLink final : public PayloadLink {
 public:
  // `peer_event` (an opened IPC event, or null for none) and `stream` belong to the current
  // device; both outlive the link.
  CudaIpcLink(GpuRuntime* rt, void* stream, void* peer_event, GpuRuntime::Timer* timer = nullptr)
      : rt_(rt), stream_(stream), peer_event_(peer_event), timer_(timer) {}
  ~CudaIpcLink() override { Unmap(); }
  LinkKind kind() const override { return LinkKind::kCudaIpc; }
  absl::StatusOr<Registration> Register(const MemoryRegion& region) override;
  absl::StatusOr<std::shared_ptr<Completion>> Post(const Transfer& transfer) override;
  // What the peer needs to map `regions` (CUDA memory of this process, transfer order), as
  // Transfer::peer. kMemoryNotMappable for memory the driver cannot export; MemoryNotServed for
  // host memory.
  static absl::StatusOr<std::string> Describe(GpuRuntime* rt,
                                              absl::Span<const MemoryRegion> regions);

 private:
  absl::StatusOr<std::vector<MemoryRegion>> MapPeer(const Transfer& t);
  void Unmap();

  GpuRuntime* const rt_;
  void* const stream_;
  void* const peer_event_;
  GpuRuntime::Timer* const timer_;
  std::vector<void*> mapped_;  // the peer's allocations of the last transfer
};

}  // namespace transport
}  // namespace kvcomp

#endif  // KVCOMP_TRANSPORT_GPU_LINK_H_
