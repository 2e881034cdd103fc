#include "data_plane.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cache_service.h"
#include "engine.h"
#include "gpu_channel.h"
#include "kvcomp/core/status.h"
#include "kvcomp/service/daemon.h"
#include "kvcomp/service/metric_names.h"
#include "kvcomp/service/metrics.h"
#include "kvcomp/transport/gpu_link.h"
#include "kvcomp/transport/server.h"
#include "log.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "put.h"
#include "service_context.h"

namespace kvcomp {
namespace service {

namespace wire = transport::wire;

namespace {

// The transport keeps this with its record of the put: the put's one owner.
struct AttachedPut : transport::PutHandle {
  explicit AttachedPut(std::shared_ptr<OpenPut> p) : put(std::move(p)) {}
  std::shared_ptr<OpenPut> put;
  // Nanoseconds the put's link blocks took on the GPU channel (the commit reply says it).
  std::shared_ptr<std::atomic<uint64_t>> link_ns = std::make_shared<std::atomic<uint64_t>>(0);
};

OpenPut* PutOf(const transport::PutContext& ctx) {
  auto* attached = static_cast<AttachedPut*>(ctx.handle);
  return attached == nullptr ? nullptr : attached->put.get();
}

// A block the transport checked against its put, as views of each layer's K and V.
BlockData ViewsOf(const KvLayout& layout, const wire::Block& block, transport::Buffer payload,
                  MemorySpace space) {
  auto memory = std::make_shared<transport::Buffer>(std::move(payload));
  const uint8_t* base = memory->bytes();
  const uint64_t tokens = block.token_end - block.token_begin;
  BlockData out;
  out.layer_begin = block.layer_begin;
  out.layer_end = block.layer_end;
  out.token_begin = block.token_begin;
  out.token_end = block.token_end;
  out.bytes = block.payload_bytes();
  for (uint32_t l = block.layer_begin; l < block.layer_end; ++l) {
    if (block.parts & wire::kPartKeys) {
      out.keys.push_back(HeadsView::Dense(base + block.KeyOffset(layout, l), layout.dtype,
                                          layout.num_kv_heads, tokens, layout.head_dim, space));
    }
    if (block.parts & wire::kPartValues) {
      out.values.push_back(HeadsView::Dense(base + block.ValueOffset(layout, l), layout.dtype,
                                            layout.num_kv_heads, tokens, layout.head_dim,
                                            space));
    }
  }
  out.memory = std::move(memory);
  return out;
}

wire::CacheSummary ToWire(const CacheSummary& s) {
  wire::CacheSummary w;
  w.layout = s.layout;
  w.key_codec = s.key_codec;
  w.value_codec = s.value_codec;
  w.tier = static_cast<uint8_t>(s.tier);
  w.original_tokens = s.original_tokens;
  w.total_kept = s.total_kept;
  w.original_bytes = s.original_bytes;
  w.stored_bytes = s.stored_bytes;
  return w;
}

Representation FromWire(wire::Representation rep) {
  return rep == wire::Representation::kDecoded ? Representation::kDecoded : Representation::kStored;
}

// A key of the session's tenant, or InvalidArgument.
absl::StatusOr<CacheKey> TenantKey(const transport::Session& session, const std::string& model,
                                   const std::string& key) {
  CacheKey k{session.tenant, model, key};
  KVCOMP_RETURN_IF_ERROR(k.Validate());
  return k;
}

// Device receive buffers of the data plane on one GPU, reused from block to block. A buffer
// the transport is done with goes back to the pool with a fence on the engine's uploader stream
// (the put's copy out of it is queued there before the buffer is let go) and is handed out
// again once the fence says that copy is complete; nothing here waits for the device. The
// buffers are drawn from the device's budget (DeviceEnv, drawer kLinks) while they exist and
// bounded by `cap_bytes` together. Freeing, which waits for the device, runs only on the pool's
// own thread (buffers idle for kIdle, or making room for a size that does not fit) and when the
// pool is destroyed after the data plane stopped.
class DeviceRecvPool : public std::enable_shared_from_this<DeviceRecvPool> {
 public:
  static constexpr size_t kGranule = size_t{2} << 20;  // capacities are multiples of 2 MiB
  static constexpr absl::Duration kIdle = absl::Seconds(10);

  DeviceRecvPool(int device, Engine* engine, uint64_t cap_bytes)
      : device_(device), engine_(engine), cap_(cap_bytes) {
    releaser_ = std::thread([this] { ReleaserLoop(); });
  }

  ~DeviceRecvPool() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    releaser_.join();
    for (auto* list : {&pending_, &free_, &doomed_}) list->clear();
  }

  uint64_t cap_bytes() const { return cap_; }

  // On the progress thread: a device buffer of at least `size` bytes, or an error when the
  // pool has no room (the caller takes host memory then).
  absl::StatusOr<transport::Buffer> Acquire(size_t size) {
    const size_t capacity = (size + kGranule - 1) / kGranule * kGranule;
    std::unique_ptr<Slot> slot;
    {
      absl::MutexLock lock(&mu_);
      PollPendingLocked();
      // The smallest free buffer that holds `size`, unless it is more than twice as large.
      size_t best = free_.size();
      for (size_t i = 0; i < free_.size(); ++i) {
        const size_t c = free_[i]->capacity;
        if (c >= size && c <= 2 * capacity && (best == free_.size() || c < free_[best]->capacity)) {
          best = i;
        }
      }
      if (best < free_.size()) {
        slot = std::move(free_[best]);
        free_.erase(free_.begin() + static_cast<ptrdiff_t>(best));
      } else if (held_ + capacity > cap_) {
        // Full: free buffers of other sizes make room for later blocks (on the pool's thread).
        for (std::unique_ptr<Slot>& s : free_) doomed_.push_back(std::move(s));
        free_.clear();
        return absl::ResourceExhaustedError("device receive pool full");
      } else {
        held_ += capacity;  // counted before the allocation, given back if it fails
      }
    }
    if (slot == nullptr) {
      absl::StatusOr<std::shared_ptr<uint8_t>> memory =
          engine_->device_env().Allocate(device_, capacity, DeviceEnv::Drawer::kLinks);
      if (!memory.ok()) {
        absl::MutexLock lock(&mu_);
        held_ -= capacity;
        return memory.status();
      }
      slot = std::make_unique<Slot>();
      slot->memory = *std::move(memory);
      slot->capacity = capacity;
    }
    void* const ptr = slot->memory.get();
    return transport::Buffer::Wrap(
        ptr, size, transport::MemoryType::kCuda,
        [pool = shared_from_this(), slot = std::move(slot)]() mutable {
          pool->Return(std::move(slot));
        });
  }

 private:
  struct Slot {
    std::shared_ptr<uint8_t> memory;  // drawn from the DeviceEnv, freed with the slot
    size_t capacity = 0;
    std::unique_ptr<DeviceUploader::Fence> fence;  // the copies out of it, while pending
    absl::Time idle_since;
  };

  // Any thread: the buffer's last user let it go, after queueing its copy on the uploader.
  void Return(std::unique_ptr<Slot> slot) {
    DeviceUploader* uploader = engine_->uploader();
    absl::StatusOr<std::unique_ptr<DeviceUploader::Fence>> fence =
        uploader != nullptr
            ? uploader->MarkCopies()
            : absl::StatusOr<std::unique_ptr<DeviceUploader::Fence>>(
                  absl::FailedPreconditionError("no uploader"));
    absl::MutexLock lock(&mu_);
    if (fence.ok()) {
      slot->fence = *std::move(fence);
      pending_.push_back(std::move(slot));
    } else {
      doomed_.push_back(std::move(slot));  // freed on the pool's thread: waits for the copy
    }
  }

  void PollPendingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < pending_.size();) {
      absl::StatusOr<bool> done = pending_[i]->fence->Done();
      if (done.ok() && !*done) {
        ++i;
        continue;
      }
      std::unique_ptr<Slot> slot = std::move(pending_[i]);
      pending_.erase(pending_.begin() + static_cast<ptrdiff_t>(i));
      slot->fence.reset();
      slot->idle_since = now;
      (done.ok() ? free_ : doomed_).push_back(std::move(slot));
    }
  }

  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !doomed_.empty(); }

  void ReleaserLoop() {
    for (;;) {
      std::vector<std::unique_ptr<Slot>> doomed;
      {
        absl::MutexLock lock(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(this, &DeviceRecvPool::HasWork), absl::Seconds(1));
        if (stop_) return;
        PollPendingLocked();
        const absl::Time now = absl::Now();
        for (size_t i = 0; i < free_.size();) {
          if (now - free_[i]->idle_since < kIdle) {
            ++i;
            continue;
          }
          doomed_.push_back(std::move(free_[i]));
          free_.erase(free_.begin() + static_cast<ptrdiff_t>(i));
        }
        doomed.swap(doomed_);
      }
      if (doomed.empty()) continue;
      uint64_t freed = 0;
      for (std::unique_ptr<Slot>& slot : doomed) {
        freed += slot->capacity;
        slot.reset();  // freed (waits for the copy queued before it), its draw given back
      }
      absl::MutexLock lock(&mu_);
      held_ -= freed;
    }
  }

  const int device_;
  Engine* const engine_;
  const uint64_t cap_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Slot>> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Slot>> free_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Slot>> doomed_ ABSL_GUARDED_BY(mu_);
  uint64_t held_ ABSL_GUARDED_BY(mu_) = 0;  // capacity of every buffer not yet freed
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread releaser_;
};

// The pool's bound: KVCOMP_DEVICE_RECV_POOL_BYTES when set (0: no pool, one buffer allocated
// and freed per block), else 1 GiB, at most a quarter of engine.gpu_memory_bytes.
uint64_t DeviceRecvPoolCap(const Engine& engine) {
  if (const char* env = std::getenv("KVCOMP_DEVICE_RECV_POOL_BYTES"); env != nullptr) {
    return std::strtoull(env, nullptr, 10);
  }
  uint64_t cap = uint64_t{1} << 30;
  if (engine.device_cap_bytes() > 0) cap = std::min(cap, engine.device_cap_bytes() / 4);
  return cap;
}

class DataHandler : public transport::RequestHandler {
 public:
  explicit DataHandler(ServiceContext* ctx) : ctx_(ctx) {}

  // Device payloads land in GPU memory of the engine's device when the data plane's UCX is
  // CUDA-aware and the engine runs on a GPU; set once at start, before any connection.
  void EnableDeviceBlocks(int device) {
    device_blocks_ = true;
    Engine* engine = ctx_->service->engine();
    const uint64_t cap = DeviceRecvPoolCap(*engine);
    if (cap > 0 && engine->uploader() != nullptr) {
      pool_ = std::make_shared<DeviceRecvPool>(device, engine, cap);
    }
  }
  uint64_t device_pool_bytes() const { return pool_ == nullptr ? 0 : pool_->cap_bytes(); }

  // A block the client sent from its device memory (no CRC32C: see wire::kBlockDevicePayload)
  // goes to GPU memory of the engine's device, drawn from its budget (DeviceEnv), for a
  // whole-sequence put on a GPU engine: OpenPut::AddBlock then copies it once on the device.
  // Everything else, and a device block when the cap or the device has no room, lands in host
  // memory (verified against its CRC32C when it has one, then staged to the GPU as before).
  absl::StatusOr<transport::Buffer> AllocateBlock(const transport::PutContext& put,
                                                  const wire::Block& block,
                                                  size_t size) override {
    OpenPut* open = PutOf(put);
    if (!device_blocks_ || open == nullptr || open->request().block_wise ||
        !(block.flags & wire::kBlockDevicePayload) || !open->engine().uses_gpu()) {
      return transport::Buffer::Allocate(size);
    }
    // The put's engine's device (one of several with engine.cuda_devices); the pool serves the
    // first engine's.
    Engine& engine = open->engine();
    if (pool_ != nullptr && &engine == ctx_->service->engine()) {
      absl::StatusOr<transport::Buffer> pooled = pool_->Acquire(size);
      return pooled.ok() ? *std::move(pooled) : transport::Buffer::Allocate(size);
    }
    absl::StatusOr<std::shared_ptr<uint8_t>> memory =
        engine.device_env().Allocate(engine.cuda_device(), size, DeviceEnv::Drawer::kLinks);
    if (!memory.ok()) return transport::Buffer::Allocate(size);
    // Freeing waits for the device work queued before it (the put's copy out of this block).
    return transport::Buffer::Wrap(memory->get(), size, transport::MemoryType::kCuda,
                                   [memory = *std::move(memory)]() mutable { memory.reset(); });
  }

  absl::StatusOr<std::string> OnHello(const transport::Session& session,
                                      const wire::Hello& hello) override {
    auto tenant = ctx_->tokens->Authenticate(hello.tenant, hello.token);
    if (!tenant.ok()) {
      ctx_->metrics->CountAuthFailure("data");
      static LogRate rate(5, absl::Seconds(1));
      LogLimited(rate, LogLevel::kWarning, "data plane: refused hello from ", session.peer,
                 " (tenant '", hello.tenant, "')");
    }
    return tenant;
  }

  // The one place a put's request is checked: key, layout, tokens and the policy (the put's or
  // the tenant's default) become a PutRequest.
  absl::Status OnPutBegin(const transport::PutContext& put) override {
    const wire::PutBegin& b = *put.begin;
    const std::string& tenant = put.session.tenant;
    CompressionPolicy policy =
        b.has_policy ? b.policy : ctx_->policies->Resolve(tenant, b.model_id).first;
    absl::StatusOr<PutRequest> request =
        PutRequest::Make(CacheKey{tenant, b.model_id, b.key}, b.layout, b.num_tokens,
                         std::move(policy), b.block_wise);
    // A put whose K and V come over a GPU channel runs on the engine of the channel's device:
    // they stay in that device's memory.
    absl::StatusOr<int> device = -1;
    if (request.ok() && b.link_channel != 0) {
      device = ctx_->gpu != nullptr
                   ? ctx_->gpu->DeviceOf(tenant, b.link_channel)
                   : absl::StatusOr<int>(absl::FailedPreconditionError("no GPU channel here"));
      if (device.ok() && !ctx_->service->engines()->uses_gpu()) device = -1;
    }
    absl::StatusOr<std::shared_ptr<OpenPut>> open =
        !request.ok() ? absl::StatusOr<std::shared_ptr<OpenPut>>(request.status())
        : !device.ok() ? absl::StatusOr<std::shared_ptr<OpenPut>>(device.status())
                       : ctx_->service->BeginPut(*std::move(request), *device);
    if (!open.ok()) {
      ctx_->metrics->CountError("put", open.status());
      ctx_->errors_total.fetch_add(1);
      return open.status();
    }
    *put.attach = std::make_unique<AttachedPut>(*std::move(open));
    return absl::OkStatus();
  }

  // A put's K and V over the GPU channel the block names (wire::kBlockLinkPayload): the whole
  // cache in one block. The channel receives them (GpuChannels::Receive) into the memory the
  // put's engine takes (its GPU's, when the channel is on it; else pinned host memory); the
  // transport then hands them to OnBlock as any block.
  void ReceiveOverLink(const transport::PutContext& put, const wire::Block& block,
                       transport::Buffer descriptor, transport::LinkReceived received) override {
    auto* attached = static_cast<AttachedPut*>(put.handle);
    OpenPut* open = PutOf(put);
    const uint32_t layers = open == nullptr ? 0 : open->request().layout.num_layers;
    absl::Status s;
    if (ctx_->gpu == nullptr) {
      s = absl::FailedPreconditionError("no GPU channel on this daemon");
    } else if (open == nullptr) {
      s = absl::NotFoundError("block for a put that is not open");
    } else if (block.layer_begin != 0 || block.layer_end != layers || block.token_begin != 0 ||
               block.token_end != open->request().num_tokens || block.parts != wire::kPartBoth) {
      s = absl::InvalidArgumentError("a block over the GPU channel carries the whole cache");
    }
    if (!s.ok()) {
      ctx_->metrics->CountError("put", s);
      received(s);
      return;
    }
    GpuLinkReceive r;
    r.layout = open->request().layout;
    r.num_tokens = open->request().num_tokens;
    r.layer_major = block.link_layer_major;
    r.descriptor = std::string(descriptor.view());
    Engine& engine = open->engine();
    r.engine_device = engine.uses_gpu() && !open->request().block_wise ? engine.cuda_device() : -1;
    ServiceContext* ctx = ctx_;
    ctx_->gpu->Receive(
        put.session.tenant, block.link_channel, std::move(r),
        [ctx, link_ns = attached->link_ns,
         received = std::move(received)](absl::StatusOr<GpuReceived> got) mutable {
          if (!got.ok()) {
            ctx->metrics->CountError("put", got.status());
            received(got.status());
            return;
          }
          link_ns->fetch_add(static_cast<uint64_t>(got->seconds * 1e9));
          uint8_t* data = got->memory.get();
          received(transport::Buffer::Wrap(
              data, got->bytes,
              got->space == MemorySpace::kDevice ? transport::MemoryType::kCuda
                                                 : transport::MemoryType::kHost,
              [memory = std::move(got->memory)]() mutable { memory.reset(); }));
        });
  }

  void OnBlock(const transport::PutContext& put, const wire::Block& block,
               transport::Buffer payload, transport::Done done) override {
    ServiceContext* ctx = ctx_;
    auto count = [ctx, done = std::move(done)](absl::Status s) mutable {
      if (!s.ok()) {
        ctx->metrics->CountError("put", s);
        ctx->errors_total.fetch_add(1);
      }
      done(std::move(s));
    };
    OpenPut* open = PutOf(put);
    if (open == nullptr) {
      count(absl::NotFoundError("block for a put that is not open"));
      return;
    }
    // Device-memory blocks become device views; OpenPut::AddBlock copies them on the GPU (or
    // refuses them on a CPU engine).
    const MemorySpace space = payload.memory_type() == transport::MemoryType::kHost
                                  ? MemorySpace::kHost
                                  : MemorySpace::kDevice;
    open->AddBlock(ViewsOf(open->request().layout, block, std::move(payload), space),
                   std::move(count));
  }

  void OnPutCommit(const transport::PutContext& put, transport::CommitDone done) override {
    ServiceContext* ctx = ctx_;
    OpenPut* open = PutOf(put);
    if (open == nullptr) {
      done(absl::NotFoundError("commit for a put that is not open"));
      return;
    }
    open->Commit([ctx, link_ns = static_cast<AttachedPut*>(put.handle)->link_ns,
                  done = std::move(done)](absl::StatusOr<CacheSummary> r) mutable {
      if (!r.ok()) {
        ctx->errors_total.fetch_add(1);
        done(r.status());
        return;
      }
      ctx->puts_total.fetch_add(1);
      wire::CacheSummary out = ToWire(*r);
      out.link_ns = link_ns->load();
      done(out);
    });
  }

  void OnPutAbort(const transport::PutContext& put, const absl::Status& reason) override {
    Log(LogLevel::kDebug, "put ", put.put_id, " of ", put.session.peer,
        " aborted: ", reason.ToString());
    if (OpenPut* open = PutOf(put)) open->Abort();
  }

  void OnGet(const transport::Session& session, const wire::Get& get,
             transport::GetDone done) override {
    ctx_->gets_total.fetch_add(1);
    auto key = TenantKey(session, get.model_id, get.key);
    if (!key.ok()) {
      ctx_->metrics->CountError("get", key.status());
      done(key.status());
      return;
    }
    const wire::Representation rep = get.representation;
    ctx_->service->Get(*key, FromWire(rep),
                       [rep, done = std::move(done)](absl::StatusOr<storage::Payload> r) mutable {
                         if (!r.ok()) {
                           done(r.status());
                           return;
                         }
                         storage::Payload payload = *std::move(r);
                         transport::GetResult out;
                         out.representation = rep;
                         void* data = const_cast<uint8_t*>(payload.data());
                         const size_t size = payload.size();
                         out.bytes = transport::Buffer::Wrap(
                             data, size, transport::MemoryType::kHost,
                             [payload]() mutable { payload = storage::Payload(); });
                         done(std::move(out));
                       });
  }

  // A get over the GPU channel (wire::Get::link_channel): the channel reads the cache and sends
  // its bytes, or its dense K and V, on its link (GpuChannels::Send); the answer names the
  // transfer. Another tenant's channel is NotFound + kLinkGone, another tenant's cache
  // NotFound, as for any get.
  void SendOverLink(const transport::Session& session, const wire::Get& get,
                    std::string descriptor, transport::LinkSent sent) override {
    ctx_->gets_total.fetch_add(1);
    auto key = TenantKey(session, get.model_id, get.key);
    absl::Status s = key.status();
    if (s.ok() && ctx_->gpu == nullptr) {
      s = absl::FailedPreconditionError("no GPU channel on this daemon");
    }
    if (!s.ok()) {
      ctx_->metrics->CountError("get", s);
      sent(s);
      return;
    }
    GpuLinkSend r;
    r.key = *std::move(key);
    r.form = get.link_dense ? GpuGetForm::kDenseKv
                            : (get.representation == wire::Representation::kStored
                                   ? GpuGetForm::kStored
                                   : GpuGetForm::kDecoded);
    r.capacity = get.link_capacity;
    r.layer_major = get.link_layer_major;
    r.descriptor = std::move(descriptor);
    ServiceContext* ctx = ctx_;
    ctx_->gpu->Send(session.tenant, get.link_channel, std::move(r),
                    [ctx, rep = get.representation,
                     sent = std::move(sent)](absl::StatusOr<GpuGetBegun> got) mutable {
                      if (!got.ok()) {
                        ctx->metrics->CountError("get", got.status());
                        sent(got.status());
                        return;
                      }
                      wire::GetReply reply;
                      reply.representation = rep;
                      reply.link_payload_bytes = got->payload_bytes;
                      reply.layout = got->layout;
                      reply.num_tokens = got->num_tokens;
                      reply.link_ns = static_cast<uint64_t>(got->copy_seconds * 1e9);
                      sent(std::move(reply));
                    });
  }

  void OnLookup(const transport::Session& session, const wire::Lookup& lookup,
                transport::LookupDone done) override {
    auto key = TenantKey(session, lookup.model_id, lookup.key);
    if (!key.ok()) {
      ctx_->metrics->CountError("lookup", key.status());
      done(key.status());
      return;
    }
    ctx_->service->Lookup(*key, [done = std::move(done)](absl::StatusOr<CacheSummary> r) mutable {
      if (!r.ok()) {
        done(r.status());
        return;
      }
      done(ToWire(*r));
    });
  }

  void OnDelete(const transport::Session& session, const wire::Delete& del,
                transport::Done done) override {
    auto key = TenantKey(session, del.model_id, del.key);
    if (!key.ok()) {
      ctx_->metrics->CountError("delete", key.status());
      done(key.status());
      return;
    }
    ctx_->service->Delete(*key, std::move(done));
  }

 private:
  ServiceContext* const ctx_;
  bool device_blocks_ = false;
  std::shared_ptr<DeviceRecvPool> pool_;  // null: one buffer per block (allocated and freed)
};

// The {op} label of the errors the data-plane transport answers without the daemon.
constexpr char kTransportOp[] = "transport";

class UcxDataPlane : public DataPlane {
 public:
  explicit UcxDataPlane(ServiceContext* ctx) : ctx_(ctx), handler_(ctx) {}

  absl::Status Start(const Options& options) {
    const DataPlaneOptions& d = options.data_plane;
    transport::ServerOptions so;
    so.listen_address = d.address;
    so.port = d.port;
    so.max_payload_bytes = d.max_block_bytes;
    so.max_inflight_bytes = std::max(d.max_inflight_bytes_per_connection, d.max_block_bytes);
    so.max_buffered_bytes = std::max(d.max_buffered_bytes, d.max_block_bytes);
    so.max_open_puts = d.max_open_puts;
    so.tenant_share = d.tenant_share;
    so.max_connections = d.max_connections;
    so.max_pre_hello_connections = d.max_pre_hello_connections;
    so.hello_timeout = absl::Seconds(d.hello_timeout_seconds);
    so.idle_timeout = absl::Seconds(d.idle_timeout_seconds);
    so.fd_reserve = d.fd_reserve;
    so.shared_memory = d.shared_memory;
    so.shm_max_region_bytes = d.shm_max_region_bytes;
    so.shm_copy_lanes = d.shm_copy_lanes;
    so.report = [](const std::string& line) { Log(LogLevel::kWarning, line); };
    so.put_timeout = absl::Seconds(d.put_timeout_seconds);
    so.server_name = absl::StrCat("kvcompd ", Version());
    if (!d.ucx_tls.empty()) so.ucx.overrides["TLS"] = d.ucx_tls;
    if (!d.ucx_net_devices.empty()) so.ucx.overrides["NET_DEVICES"] = d.ucx_net_devices;
    so.ucx_interop = d.ucx_interop == "auto";
    SetUpDeviceMemory(options, so.ucx);
    KVCOMP_ASSIGN_OR_RETURN(server_, transport::UcxServer::Start(so, &handler_));
    return absl::OkStatus();
  }

  // What the data plane does with device memory, said once at start (a log line and the gauge
  // kvcomp_data_plane_cuda_memory): with a CUDA-aware UCX, clients' device payloads are taken
  // (hello-ok offers them) and, on a GPU engine, received into GPU memory; without one, device
  // memory is staged through host memory on both sides.
  void SetUpDeviceMemory(const Options& options, const transport::UcxConfig& ucx) {
    absl::StatusOr<transport::UcxCapabilities> caps = transport::QueryUcxCapabilities(ucx);
    const bool cuda = caps.ok() && caps->cuda_memory;
    const std::string version = caps.ok() ? caps->version : "?";
    Engine* engine = ctx_->service->engine();
    const bool gpu_engine = engine != nullptr && engine->uses_gpu();
    if (ctx_->metrics != nullptr) {
      prometheus::Registry& registry = ctx_->metrics->registry();
      prometheus::BuildGauge()
          .Name(metric_names::kDataPlaneCudaMemory)
          .Help("1 when the data plane's UCX moves CUDA device memory itself, 0 when device "
                "memory is staged through host memory.")
          .Register(registry)
          .Add({})
          .Set(cuda ? 1 : 0);
      blocks_into_device_ = &prometheus::BuildCounter()
                                 .Name(metric_names::kBlocksIntoDeviceTotal)
                                 .Help("Data-plane blocks received straight into GPU memory.")
                                 .Register(registry)
                                 .Add({});
    }
    if (!cuda) {
      Log(gpu_engine ? LogLevel::kWarning : LogLevel::kInfo, "data plane: UCX ", version,
          " has no CUDA memory support (no cuda_copy / cuda_ipc transports",
          caps.ok() ? std::string() : absl::StrCat(": ", caps.status().message()),
          "): device memory of clients is staged through host memory",
          gpu_engine ? " and blocks reach the GPU through the engine's upload" : "");
      return;
    }
    absl::StatusOr<transport::GpuRuntime*> rt =
        gpu_engine ? transport::GpuRuntime::Get()
                   : absl::StatusOr<transport::GpuRuntime*>(absl::FailedPreconditionError("cpu"));
    const int device = gpu_engine ? engine->cuda_device() : options.engine.cuda_device;
    if (rt.ok()) handler_.EnableDeviceBlocks(device);
    Log(LogLevel::kInfo, "data plane: UCX ", version,
        " is CUDA-aware: clients may send device payloads; they land in ",
        rt.ok() ? absl::StrCat("GPU memory of device ", device,
                               handler_.device_pool_bytes() > 0
                                   ? absl::StrCat(" (receive buffers pooled, at most ",
                                                  handler_.device_pool_bytes() >> 20, " MiB)")
                                   : std::string(" (a receive buffer per block)"))
                : std::string("host memory (the engine runs on the CPU)"));
  }

  ~UcxDataPlane() override { Stop(); }

  uint16_t port() const override { return server_->port(); }
  void Drain() override { server_->Drain(); }
  absl::Status WaitIdle(absl::Duration timeout) override { return server_->WaitIdle(timeout); }
  void Stop() override {
    if (server_) server_->Stop();
  }

  void ExportMetrics(Metrics* metrics) const override {
    const transport::ServerStats ts = server_->stats();
    for (int code = 1; code < transport::kNumStatusCodes; ++code) {
      if (ts.rejected_by_code[code] == 0) continue;
      metrics->AdvanceErrors(kTransportOp,
                             ErrorCodeLabel(absl::Status(static_cast<absl::StatusCode>(code), "")),
                             ts.rejected_by_code[code]);
    }
    // Busy replies of the transport's own bounds: in flight per connection, buffered bytes and
    // open puts (all tenants and per tenant).
    const uint64_t busy =
        ts.inflight_busy_replies + ts.capacity_busy_replies + ts.tenant_busy_replies;
    if (busy > 0) metrics->AdvanceErrors(kTransportOp, "busy", busy);
    if (blocks_into_device_ != nullptr &&
        static_cast<double>(ts.blocks_into_device) > blocks_into_device_->Value()) {
      blocks_into_device_->Increment(static_cast<double>(ts.blocks_into_device) -
                                     blocks_into_device_->Value());
    }
  }

 private:
  ServiceContext* const ctx_;
  DataHandler handler_;
  prometheus::Counter* blocks_into_device_ = nullptr;
  std::unique_ptr<transport::UcxServer> server_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlane>> DataPlane::Start(const Options& options,
                                                            ServiceContext* ctx) {
  auto plane = std::make_unique<UcxDataPlane>(ctx);
  KVCOMP_RETURN_IF_ERROR(plane->Start(options));
  return std::unique_ptr<DataPlane>(std::move(plane));
}

int DataPlane::ProtocolVersion() { return wire::kMajorVersion; }

}  // namespace service
}  // namespace kvcomp
