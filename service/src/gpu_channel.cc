#include "gpu_channel.h"

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "cache_repository.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/codec_ops.h"
#include "kvcomp/storage/types.h"
#include "kvcomp/transport/gpu_link.h"
#include "kvcomp/transport/payload_link.h"
#include "log.h"
#include "task_pool.h"

namespace kvcomp {
namespace service {

namespace {

using transport::Completion;
using transport::Direction;
using transport::GpuRuntime;
using transport::LinkKind;
using transport::MemoryRegion;
using transport::NcclLink;
using Regions = std::vector<MemoryRegion>;

// Regions of a K/V payload (staged as every layer's keys, then every layer's values) in the
// order both sides post them: each layer's keys, then each layer's values; or, layer-major,
// K0, V0, K1, V1, ... (NCCL matches sends and receives one to one, so the order is part of the
// protocol).
Regions LayerRegions(void* memory, const KvLayout& layout, uint64_t tokens, bool layer_major) {
  const uint64_t layer = layout.LayerBytes(tokens);
  const uint32_t n = layout.num_layers;
  Regions regions;
  for (uint32_t i = 0; i < 2 * n; ++i) {
    const uint32_t slot = layer_major ? (i % 2) * n + i / 2 : i;
    regions.push_back({static_cast<uint8_t*>(memory) + slot * layer, layer,
                       transport::MemoryKind::kCuda});
  }
  return regions;
}

// The devices channels use: each GPU engine's, or engine.cuda_device beside a CPU engine.
std::vector<int> ChannelDevices(const Options& options, const EngineSet& engines) {
  if (!engines.uses_gpu()) return {options.engine.cuda_device};
  std::vector<int> devices;
  for (size_t i = 0; i < engines.size(); ++i) devices.push_back(engines.at(i).cuda_device());
  return devices;
}

struct Channel {
  uint64_t id = 0;
  std::string tenant;
  int device = 0;
  bool ipc = false;              // mode "ipc": no communicator; copies on the device
  void* client_event = nullptr;  // mode "ipc": the client's interprocess event, opened here

  // Forming the communicator (a thread of its own: the client joins after Open returns).
  absl::Mutex join_mu;
  bool joined ABSL_GUARDED_BY(join_mu) = false;
  absl::Status join_status ABSL_GUARDED_BY(join_mu);
  std::thread joiner;

  // Everything below is used under op_mu: one operation at a time.
  absl::Mutex op_mu;
  std::unique_ptr<NcclLink> link;
  void* stream = nullptr;
  std::unique_ptr<GpuRuntime::Timer> timer;
  // The channel's payload link (CudaIpcLink or NcclPayloadLink over `link`), made with `stream`.
  std::unique_ptr<transport::PayloadLink> payload;
  // What puts receive into: the channel's device memory, handed to the put with its K and V
  // (a new one is made while a put still holds the last); what gets send from, likewise.
  std::shared_ptr<uint8_t> recv;
  size_t recv_bytes = 0;
  std::shared_ptr<uint8_t> send;
  size_t send_bytes = 0;

  std::atomic<int64_t> last_used_ns{0};
  std::atomic<bool> dead{false};

  ~Channel() {
    if (joiner.joinable()) joiner.join();
  }
};

class GpuChannelsImpl : public GpuChannels {
 public:
  GpuChannelsImpl(const Options& options, CacheService* service, Metrics* metrics)
      : service_(service),
        metrics_(metrics),
        devices_(ChannelDevices(options, *service->engines())),
        max_channels_(options.data_plane.gpu_max_channels),
        tenant_share_(options.data_plane.tenant_share),
        timeout_(absl::Seconds(options.data_plane.gpu_transfer_timeout_seconds)),
        idle_timeout_(absl::Seconds(options.data_plane.gpu_idle_timeout_seconds)),
        max_transfer_bytes_(std::min(options.data_plane.max_put_bytes,
                                     options.data_plane.max_buffered_bytes)) {
    reason_ = Probe(options);
    if (reason_.empty()) {
      // Each receive waits on its channel's link (one transfer per channel at a time); more
      // than a channel each queue, and past that the block is answered busy.
      const int threads = static_cast<int>(std::min<uint32_t>(16, max_channels_));
      absl::MutexLock lock(&mu_);
      transfers_ =
          std::make_unique<TaskPool>(threads, std::max<size_t>(threads, 4 * size_t{max_channels_}));
      reaper_ = std::thread([this] { Reap(); });
    }
  }

  ~GpuChannelsImpl() override { Stop(); }

  bool available() const override { return reason_.empty(); }
  std::string unavailable_reason() const override { return reason_; }
  size_t open_channels() const override {
    absl::MutexLock lock(&mu_);
    return channels_.size();
  }

  // Why no link serves a channel to the client's GPU, naming the end that lacks it.
  absl::Status NoLink(bool same_device, const transport::LinkOffer& ours,
                      const transport::LinkOffer& theirs) const {
    if (same_device) {
      return absl::FailedPreconditionError(
          !theirs.Has(LinkKind::kCudaIpc)
              ? "the client's GPU is the daemon's: NCCL needs two devices and the client offered "
                "no CUDA IPC (use the data plane)"
              : "the client's GPU is the daemon's and this CUDA driver has no IPC");
    }
    if (!ours.Has(LinkKind::kNccl)) return absl::FailedPreconditionError(nccl_reason_);
    return absl::FailedPreconditionError(
        "the client has no NCCL and its GPU is not the daemon's (use the data plane)");
  }

  absl::StatusOr<GpuChannelInfo> Open(const std::string& tenant, int client_nccl_version,
                                      const std::string& client_device_uuid,
                                      const std::string& client_ipc_event) override {
    if (!reason_.empty()) return absl::FailedPreconditionError(reason_);
    if (draining_.load()) return absl::UnavailableError("draining: no new GPU channels");
    // A client on one of the daemon's GPUs shares it over CUDA IPC; any other client gets the
    // device of the engine its puts will run on (EngineSet::Pick), whose memory holds the
    // channel's buffers.
    int device = -1;
    for (size_t i = 0; i < devices_.size(); ++i) {
      if (client_device_uuid == device_uuids_[i]) device = devices_[i];
    }
    const bool same_device = device >= 0;
    if (!same_device) {
      if (!service_->engines()->uses_gpu()) {
        device = devices_[0];
      } else {
        Engine* engine = service_->engines()->Pick();
        if (engine == nullptr) {
          return absl::UnavailableError(absl::StrCat(
              "engine failed (", service_->engines()->failure(), "): kvcompd is draining"));
        }
        device = engine->cuda_device();
      }
    }
    // The channel's link: the first that both ends offer and that reaches the client's GPU
    // from this one (payload_link.h); the data plane's links stay the client's fallback.
    transport::LinkOffer ours, theirs;
    if (rt_->has_ipc()) ours.Add(LinkKind::kCudaIpc);
    if (nccl_reason_.empty()) ours.Add(LinkKind::kNccl);
    if (!client_ipc_event.empty()) theirs.Add(LinkKind::kCudaIpc);
    if (client_nccl_version > 0) theirs.Add(LinkKind::kNccl);
    const std::vector<LinkKind> links = transport::ChooseLinks(
        ours, theirs,
        {transport::MemoryKind::kCuda,
         same_device ? transport::Locality::kSameDevice : transport::Locality::kOtherDevice});
    if (links.empty()) return NoLink(same_device, ours, theirs);
    const bool ipc = links.front() == LinkKind::kCudaIpc;
    if (!ipc && client_nccl_version / 100 != rt_->nccl_version() / 100) {
      Log(LogLevel::kInfo, "GPU channel: client NCCL ", client_nccl_version, ", daemon NCCL ",
          rt_->nccl_version());
    }
    auto channel = std::make_shared<Channel>();
    channel->tenant = tenant;
    channel->device = device;
    channel->ipc = ipc;
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return absl::UnavailableError("stopping");
      const size_t tenant_max = std::max<size_t>(1, static_cast<size_t>(max_channels_ * tenant_share_));
      size_t of_tenant = 0;
      for (const auto& [id, c] : channels_) of_tenant += c->tenant == tenant;
      if (channels_.size() >= max_channels_ || of_tenant >= tenant_max) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "GPU channels: ", channels_.size(), " open (", of_tenant, " of this tenant; limits ",
            max_channels_, " and ", tenant_max, ")"));
      }
      channel->id = next_id_++;
      channels_[channel->id] = channel;
    }
    absl::Status s = rt_->SetDevice(device);
    GpuChannelInfo info;
    info.channel_id = channel->id;
    info.ipc = ipc;
    info.device = device;
    info.max_transfer_bytes = max_transfer_bytes_;
    info.transfer_timeout = timeout_;
    channel->last_used_ns.store(absl::ToUnixNanos(absl::Now()));
    if (ipc) {
      absl::StatusOr<void*> ev = s.ok() ? rt_->OpenEvent(client_ipc_event)
                                        : absl::StatusOr<void*>(s);
      if (!ev.ok()) {
        Remove(channel->id);
        return WithDetail(absl::FailedPreconditionError(absl::StrCat(
                              "the client's CUDA IPC event cannot be opened here: ",
                              ev.status().message())),
                          ErrorDetail::kMemoryNotMappable);
      }
      channel->client_event = *ev;
      absl::MutexLock lock(&channel->join_mu);
      channel->joined = true;
      Log(LogLevel::kInfo, "GPU channel ", channel->id, " opened for tenant '", tenant,
          "' on cuda:", device, " (CUDA IPC: the client shares this GPU)");
      return info;
    }
    absl::StatusOr<std::string> uid = s.ok() ? rt_->NewUniqueId() : absl::StatusOr<std::string>(s);
    if (!uid.ok()) {
      Remove(channel->id);
      return uid.status();
    }
    const std::string id_bytes = *uid;
    const absl::Duration timeout = timeout_;
    Channel* c = channel.get();
    channel->joiner = std::thread([c, id_bytes, timeout, device] {
      absl::StatusOr<std::unique_ptr<NcclLink>> link = NcclLink::Join(id_bytes, 0, device, timeout);
      absl::Status st = link.status();
      if (link.ok()) {
        absl::MutexLock op(&c->op_mu);
        c->link = *std::move(link);
      }
      absl::MutexLock lock(&c->join_mu);
      c->join_status = st;
      c->joined = true;
    });
    info.nccl_unique_id = id_bytes;
    info.nccl_version = rt_->nccl_version();
    Log(LogLevel::kInfo, "GPU channel ", channel->id, " opened for tenant '", tenant, "' on cuda:",
        device);
    return info;
  }

  absl::StatusOr<int> DeviceOf(const std::string& tenant, uint64_t id) override {
    KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<Channel> c, Find(tenant, id));
    return c->device;
  }

  absl::Status Close(const std::string& tenant, uint64_t id) override {
    KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<Channel> c, Find(tenant, id));
    Remove(id);
    Destroy(c, "closed by the client");
    return absl::OkStatus();
  }

  void Receive(const std::string& tenant, uint64_t id, GpuLinkReceive r,
               GpuReceivedFn done) override {
    const uint64_t bytes = r.layout.CacheBytes(r.num_tokens);
    auto refuse = [&]() -> absl::Status {
      if (bytes > max_transfer_bytes_) {
        return absl::InvalidArgumentError(absl::StrCat("payload of ", bytes,
                                                       " bytes exceeds the GPU channel's limit (",
                                                       max_transfer_bytes_, ")"));
      }
      if (draining_.load()) return absl::UnavailableError("draining: no new puts");
      return absl::OkStatus();
    };
    absl::Status s = refuse();
    absl::StatusOr<std::shared_ptr<Channel>> c =
        s.ok() ? Find(tenant, id) : absl::StatusOr<std::shared_ptr<Channel>>(s);
    if (!c.ok()) {
      done(c.status());
      return;
    }
    absl::MutexLock lock(&mu_);
    if (stopped_ || transfers_ == nullptr) {
      done(absl::UnavailableError("stopping: no new puts"));
      return;
    }
    // The caller's `done` stays here until the task takes it (TrySubmit may refuse).
    auto pending = std::make_shared<GpuReceivedFn>(std::move(done));
    if (!transfers_->TrySubmit([this, c = *std::move(c), r = std::move(r), pending]() mutable {
          (*pending)(ReceiveNow(c, r));
        })) {
      (*pending)(BusyError("GPU channel receives queued at their bound"));
    }
  }

  void Send(const std::string& tenant, uint64_t id, GpuLinkSend r, GpuSentFn done) override {
    absl::StatusOr<std::shared_ptr<Channel>> c = Find(tenant, id);
    if (c.ok() && draining_.load()) c = absl::UnavailableError("draining: no new gets");
    if (!c.ok()) {
      done(c.status());
      return;
    }
    auto job = std::make_shared<GetJob>();
    job->c = *std::move(c);
    job->r = std::move(r);
    job->done = std::move(done);
    Touch(*job->c);
    Then(job, [this, job] { Start(job); }, /*admit=*/true);
  }

  // A get's steps, each on a thread of transfers_ (or of the service, or of an engine, which
  // hand the next step back here): where the payload comes from, then PostSend.
  struct GetJob {
    std::shared_ptr<Channel> c;
    GpuLinkSend r;
    GpuGetBegun out;
    std::shared_ptr<uint8_t> memory;  // the payload, device memory of the channel's device
    std::shared_ptr<void> stored;     // a stored cache read into device memory (dense gets)
    GpuSentFn done;
  };
  using Job = std::shared_ptr<GetJob>;

  // Runs `step` on a thread of transfers_; `admit`: a new get, refused busy past the pool's
  // bound (a later step always queues: its get was admitted).
  void Then(const Job& job, absl::AnyInvocable<void()> step, bool admit = false) {
    absl::MutexLock lock(&mu_);
    bool queued = false;
    if (!stopped_ && transfers_ != nullptr) {
      if (admit) {
        queued = transfers_->TrySubmit(std::move(step));
      } else {
        transfers_->Submit(std::move(step));
        queued = true;
      }
    }
    if (!queued) {
      Finish(job, stopped_ || transfers_ == nullptr
                      ? absl::UnavailableError("stopping: no new gets")
                      : BusyError("GPU channel transfers queued at their bound"));
    }
  }

  // Answers the get (once).
  static void Finish(const Job& job, absl::StatusOr<GpuGetBegun> out) {
    if (job->done) std::exchange(job->done, nullptr)(std::move(out));
  }

  // A step that holds the channel: `step` runs under its op_mu with the channel usable; an
  // error answers the get.
  void Hold(const Job& job, absl::FunctionRef<absl::Status()> step) {
    Channel& c = *job->c;
    absl::MutexLock op(&c.op_mu);
    absl::Status s = Usable(job->c);
    if (s.ok()) s = step();
    if (!s.ok()) Finish(job, s);
  }

  void Start(const Job& job) {
    if (absl::Status s = AwaitJoin(*job->c); !s.ok()) return Finish(job, s);
    const GpuLinkSend& r = job->r;
    if (r.form != GpuGetForm::kDecoded && service_->engine()->uses_gpu()) {
      // From the store on the device: a STORED get read straight into the channel's memory
      // (from the GPU tier one copy on the device), a dense one densified or decoded there.
      // The repository answers on this thread: no wait on the service's serve pool.
      absl::StatusOr<CacheSummary> sum = service_->repository()->Summarize(r.key);
      if (!sum.ok()) return Finish(job, sum.status());
      absl::StatusOr<bool> served = r.form == GpuGetForm::kStored ? StoredOnDevice(job, *sum)
                                                                   : DenseOnDevice(job, *sum);
      if (!served.ok()) return Finish(job, served.status());
      if (*served) return;
    }
    FromHost(job);
  }

  // The cache read by the service into host memory; the next step copies it up.
  void FromHost(const Job& job) {
    const Representation rep =
        job->r.form == GpuGetForm::kStored ? Representation::kStored : Representation::kDecoded;
    service_->Get(job->r.key, rep, [this, job](absl::StatusOr<storage::Payload> payload) mutable {
      if (!payload.ok()) return Finish(job, payload.status());
      Then(job, [this, job, payload = *std::move(payload)] { UpFromHost(job, payload); });
    });
  }

  void UpFromHost(const Job& job, const storage::Payload& payload) {
    GpuGetBegun& out = job->out;
    std::shared_ptr<uint8_t> host;
    absl::Status s;
    bool whole = true;
    if (job->r.form == GpuGetForm::kDenseKv) {
      absl::StatusOr<CompressedCache> cache = format::ParseCache(payload.view());
      if (!cache.ok()) return Finish(job, cache.status());
      out.layout = cache->layout;
      out.num_tokens = cache->original_tokens;
      out.payload_bytes = cache->layout.CacheBytes(cache->original_tokens);
      if (out.payload_bytes > job->r.capacity) return Finish(job, TooLarge(out, job->r.capacity));
      s = Pinned(job->c->device, out.payload_bytes, &host);
      if (s.ok()) s = cache->WriteDenseKv(host.get());
      whole = false;
    } else {
      absl::StatusOr<format::CacheInfo> info = format::PeekCache(payload.view());
      if (info.ok()) {
        out.layout = info->layout;
        out.num_tokens = info->original_tokens;
      }
      out.payload_bytes = payload.size();
      if (out.payload_bytes > job->r.capacity) return Finish(job, TooLarge(out, job->r.capacity));
      s = Pinned(job->c->device, out.payload_bytes, &host);
      if (s.ok()) std::memcpy(host.get(), payload.data(), payload.size());
    }
    if (!s.ok()) return Finish(job, s);
    Up(job, {{host.get(), out.payload_bytes}}, whole);
  }

  // Host memory `parts`, one after another, copied up into the channel's memory and sent
  // (whole, or as the dense K and V). In device memory before the answer: the client's receive
  // then waits only for the transfer (and `parts` may go).
  void Up(const Job& job, std::initializer_list<std::pair<const void*, uint64_t>> parts,
          bool whole) {
    Hold(job, [&]() -> absl::Status {
      Channel& c = *job->c;
      absl::Status s = SendBuffer(*job, job->out.payload_bytes);
      uint64_t at = 0;
      for (const auto& [from, bytes] : parts) {
        if (s.ok()) {
          s = rt_->CopyAsync(job->memory.get() + at, from, bytes, GpuRuntime::Copy::kHostToDevice,
                             c.stream);
        }
        at += bytes;
      }
      if (s.ok()) s = rt_->WaitStream(c.stream, absl::Now() + timeout_);
      if (!s.ok()) return Fail(job->c, s);
      metrics_->AddTransferBytes(job->out.payload_bytes, 0);
      return PostSend(job, whole);
    });
  }

  // A STORED get read from the store into the channel's memory (CacheRepository::GetInto) and
  // sent. false: the store cannot serve it on the device here (the host path serves it).
  absl::StatusOr<bool> StoredOnDevice(const Job& job, const CacheSummary& sum) {
    if (sum.stored_bytes > job->r.capacity) {
      return absl::OutOfRangeError(absl::StrCat("the payload is ", sum.stored_bytes,
                                                " bytes; the client can take ", job->r.capacity));
    }
    bool served = false;
    Hold(job, [&]() -> absl::Status {
      absl::Status s = SendBuffer(*job, sum.stored_bytes);
      if (!s.ok()) return Fail(job->c, s);
      KVCOMP_ASSIGN_OR_RETURN(std::optional<storage::CacheMeta> meta,
                              ReadOnDevice(*job->c, job->r.key, job->memory.get(),
                                           sum.stored_bytes));
      if (!meta.has_value()) return absl::OkStatus();
      served = true;
      job->out.payload_bytes = meta->stored_bytes;
      job->out.layout = sum.layout;
      job->out.num_tokens = sum.original_tokens;
      return PostSend(job, /*whole=*/true);
    });
    return served || job->done == nullptr;
  }

  // A dense get served on the device, of a cache that kept every token (else false), from the
  // stored bytes read into device memory: raw sections (the dense K or V already, in layer,
  // head, token order) are copied into the channel's memory on its stream; Hadamard ones (hq4 /
  // hq3) are decoded row by row straight into it by a worker of the engine on the channel's
  // device (its CUDA backend), which hands the next step back to transfers_; nothing but the
  // header crosses to the host. Other codecs (int8 / int4 keys, KVSplice values) are read and
  // parsed on the host, decoded to raw codecs there by the engine's backend, and their sections
  // copied up. false: no GPU engine on the channel's device for a cache to decode, its queue
  // full, no device memory for the stored copy, or the cache not such a cache after all
  // (replaced meanwhile): the host path serves it, or says why it has no dense form.
  absl::StatusOr<bool> DenseOnDevice(const Job& job, const CacheSummary& sum) {
    if (sum.total_kept != sum.layout.num_heads_total() * sum.original_tokens) return false;
    GpuGetBegun& out = job->out;
    out.layout = sum.layout;
    out.num_tokens = sum.original_tokens;
    out.payload_bytes = sum.layout.CacheBytes(sum.original_tokens);
    if (out.payload_bytes > job->r.capacity) return TooLarge(out, job->r.capacity);
    Engine* engine = service_->engines()->OnDevice(job->c->device);
    const bool raw = sum.key_codec == KeyCodec::kRaw && sum.value_codec == ValueCodec::kRaw;
    if (!raw && (engine == nullptr || !engine->uses_gpu() || engine->failed())) return false;
    const bool rows = (sum.key_codec == KeyCodec::kRaw || HqBits(sum.key_codec) != 0) &&
                      (sum.value_codec == ValueCodec::kRaw || HqBits(sum.value_codec) != 0);
    if (rows) {
      std::optional<format::DenseSections> d;
      Hold(job, [&]() -> absl::Status {
        KVCOMP_ASSIGN_OR_RETURN(uint64_t stored, ReadStored(job, sum));
        if (stored == 0) return absl::OkStatus();
        std::string head(
            std::min<uint64_t>(stored, format::kHeaderBytes + 64 * format::kSectionEntryBytes),
            '\0');
        absl::Status s = rt_->CopyAsync(head.data(), job->stored.get(), head.size(),
                                        GpuRuntime::Copy::kDeviceToHost, job->c->stream);
        if (s.ok()) s = rt_->WaitStream(job->c->stream, absl::Now() + timeout_);
        if (!s.ok()) return Fail(job->c, s);
        absl::StatusOr<format::DenseSections> dense = format::DenseRowSections(head, stored);
        if (dense.ok() && dense->info.layout == out.layout &&
            dense->info.original_tokens == out.num_tokens) {
          d = *std::move(dense);
        }
        return absl::OkStatus();
      });
      if (job->done == nullptr) return true;  // answered (failed)
      if (d.has_value() && raw) {
        CopyRawSections(job, *d);
        return true;
      }
      if (d.has_value() &&
          engine->TrySubmit(job->r.key.tenant, [this, job, engine, d = *d](Backend& backend) {
            DecodeRows(job, engine, d, backend);
          })) {
        return true;
      }
      job->stored.reset();
    }
    if (raw) return false;  // replaced meanwhile: the host path serves it
    // Read by the repository on this thread (no wait on the service's serve pool).
    KVCOMP_ASSIGN_OR_RETURN(storage::Payload stored,
                            service_->repository()->Get(job->r.key, Representation::kStored));
    KVCOMP_ASSIGN_OR_RETURN(CompressedCache cache, format::ParseCache(stored.view()));
    const uint64_t tokens = cache.original_tokens;
    if (cache.layout != out.layout || tokens != out.num_tokens ||
        cache.positions.size() != cache.layout.num_heads_total() * tokens) {
      return false;
    }
    for (size_t i = 0; i < cache.positions.size(); ++i) {
      if (cache.positions[i] != i % tokens) return false;
    }
    auto parsed = std::make_shared<CompressedCache>(std::move(cache));
    return engine->TrySubmit(job->r.key.tenant, [this, job, engine, parsed](Backend& backend) {
      absl::StatusOr<CompressedCache> raw =
          service_->repository()->DecodeParsed(job->r.key, std::move(*parsed), &backend);
      if (!raw.ok()) engine->CheckAfterError(backend, raw.status());
      Then(job, [this, job, raw = std::move(raw)] { UpDecoded(job, raw); });
    });
  }

  // On the engine's worker: the hq sections decoded from the stored copy into the channel's
  // memory (this device's primary context; the backend waits for its stream before it
  // returns), then the rest on transfers_.
  void DecodeRows(const Job& job, Engine* engine, const format::DenseSections& d,
                  Backend& backend) {
    const absl::Time t0 = absl::Now();
    const GpuGetBegun& out = job->out;
    const uint64_t half = out.payload_bytes / 2, rows = d.info.total_kept;
    const uint8_t* from = static_cast<const uint8_t*>(job->stored.get());
    uint8_t* base = job->memory.get();
    CodecOps& ops = backend.codec();
    absl::Status s;
    if (const uint32_t bits = HqBits(d.info.key_codec); bits != 0) {
      s = ops.DecodeHq(bits, rows, out.layout.head_dim, from + d.keys.offset, base,
                       out.layout.dtype);
    }
    if (const uint32_t bits = HqBits(d.info.value_codec); s.ok() && bits != 0) {
      s = ops.DecodeHq(bits, rows, out.layout.head_dim, from + d.values.offset, base + half,
                       out.layout.dtype);
    }
    if (!s.ok()) engine->CheckAfterError(backend, s);
    const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
    metrics_->ObserveStage(Stage::kDecode, seconds);
    metrics_->AddGpuSeconds(seconds);
    Then(job, [this, job, s, d] {
      if (!s.ok()) return Finish(job, s);
      CopyRawSections(job, d);
    });
  }

  // The raw sections of the stored copy (the dense K or V already) copied into the channel's
  // memory, one copy on the device each, then the payload sent.
  void CopyRawSections(const Job& job, const format::DenseSections& d) {
    Hold(job, [&]() -> absl::Status {
      Channel& c = *job->c;
      const uint64_t half = job->out.payload_bytes / 2;
      const uint8_t* from = static_cast<const uint8_t*>(job->stored.get());
      uint8_t* base = job->memory.get();
      absl::Status st;
      if (d.info.key_codec == KeyCodec::kRaw) {
        st = rt_->CopyAsync(base, from + d.keys.offset, half, GpuRuntime::Copy::kDeviceToDevice,
                            c.stream);
      }
      if (st.ok() && d.info.value_codec == ValueCodec::kRaw) {
        st = rt_->CopyAsync(base + half, from + d.values.offset, half,
                            GpuRuntime::Copy::kDeviceToDevice, c.stream);
      }
      if (st.ok()) st = rt_->WaitStream(c.stream, absl::Now() + timeout_);
      if (!st.ok()) return Fail(job->c, st);
      return PostSend(job, /*whole=*/false);
    });
  }

  // The decoded keys and values (the dense K and V) copied up into the channel's memory, sent.
  void UpDecoded(const Job& job, const absl::StatusOr<CompressedCache>& raw) {
    if (!raw.ok()) return Finish(job, raw.status());
    const uint64_t half = job->out.payload_bytes / 2;
    if (raw->keys.size() != half || raw->values.size() != half) {
      return Finish(job, absl::InternalError("GPU channel: a decoded dense cache has the wrong size"));
    }
    Up(job, {{raw->keys.data(), half}, {raw->values.data(), half}}, /*whole=*/false);
  }

  // Sends the payload in the channel's memory to the client on the channel's link: whole (the
  // client's buffer may be larger), or as the dense K and V in the order the client asked for.
  // Over CUDA IPC the copy into its memory is done before the answer; over NCCL the answer goes
  // as soon as the send is posted (the client then posts its receive) and this thread collects
  // the send by the transfer timeout (past it, or on an NCCL error, the channel fails: a client
  // that died leaves nothing waiting). The caller holds the channel's op_mu, so the channel's
  // next transfer comes after this one.
  absl::Status PostSend(const Job& job, bool whole) {
    Channel& c = *job->c;
    GpuGetBegun& out = job->out;
    const Regions regions =
        whole ? Regions{{job->memory.get(), out.payload_bytes, transport::MemoryKind::kCuda}}
              : LayerRegions(job->memory.get(), out.layout, out.num_tokens, job->r.layer_major);
    Touch(c);
    absl::StatusOr<std::shared_ptr<Completion>> sent =
        Post(c, Direction::kSend, regions, job->r.descriptor, /*peer_may_be_larger=*/whole);
    if (!sent.ok()) return Refused(job->c, sent.status());
    if (c.ipc) {
      absl::Status s = (*sent)->Wait(absl::Now() + timeout_);
      if (!s.ok()) return Fail(job->c, s);
      out.copy_seconds = SecondsOf(*c.timer);
      Finish(job, out);
    } else {
      Finish(job, out);
      absl::Status s = (*sent)->Wait(absl::Now() + timeout_);
      if (!s.ok()) (void)Fail(job->c, s);
    }
    Touch(c);
    // Freed once the transfer is done (cuMemFree may wait for the device: kept out of the
    // get's path).
    job->memory.reset();
    job->stored.reset();
    return absl::OkStatus();
  }

  static absl::Status TooLarge(const GpuGetBegun& out, uint64_t capacity) {
    return absl::OutOfRangeError(absl::StrCat("the payload is ", out.payload_bytes,
                                              " bytes; the client can take ", capacity));
  }

  // The channel's send memory of at least `bytes` for `job`: its own when no get holds it any
  // more, else a new one. Caller holds c.op_mu.
  absl::Status SendBuffer(GetJob& job, uint64_t bytes) {
    KVCOMP_ASSIGN_OR_RETURN(job.memory, Reusable(job.c->send, job.c->send_bytes, job.c->device,
                                                 bytes));
    return absl::OkStatus();
  }

  // The stored cache read into fresh device memory (job->stored) and the channel's memory made
  // ready for the dense payload; the stored bytes, or 0 when there is no device memory for it or
  // the store cannot serve it there (the caller's other paths serve the get). Caller holds
  // c.op_mu.
  absl::StatusOr<uint64_t> ReadStored(const Job& job, const CacheSummary& sum) {
    absl::Status s = SendBuffer(*job, job->out.payload_bytes);
    if (!s.ok()) return Fail(job->c, s);
    absl::StatusOr<std::shared_ptr<uint8_t>> p =
        Env().Allocate(job->c->device, sum.stored_bytes, DeviceEnv::Drawer::kLinks);
    if (!p.ok()) {
      Log(LogLevel::kWarning, "GPU channel: no device memory to serve a get from device memory (",
          p.status().ToString(), "); it goes through host memory");
      return 0;
    }
    job->stored = *p;
    KVCOMP_ASSIGN_OR_RETURN(std::optional<storage::CacheMeta> meta,
                            ReadOnDevice(*job->c, job->r.key, p->get(), sum.stored_bytes));
    if (!meta.has_value()) {
      job->stored.reset();
      return 0;
    }
    return meta->stored_bytes;
  }

  // The stored cache read into device memory at `dst` on the channel's stream (from the GPU
  // tier one copy on the device). nullopt when the store cannot serve it there (a build without
  // CUDA, a device error, or the cache replaced meanwhile by a larger one): the caller reads it
  // through host memory.
  absl::StatusOr<std::optional<storage::CacheMeta>> ReadOnDevice(Channel& c, const CacheKey& key,
                                                                 void* dst, uint64_t capacity) {
    storage::DeviceTarget target;
    target.data = dst;
    target.capacity = capacity;
    target.device = c.device;
    target.stream = c.stream;
    absl::StatusOr<storage::CacheMeta> meta = service_->repository()->GetInto(key, target);
    if (meta.ok()) return std::optional<storage::CacheMeta>(*meta);
    if (absl::IsNotFound(meta.status())) return meta.status();
    if (!absl::IsOutOfRange(meta.status())) {
      Log(LogLevel::kWarning, "GPU channel: a get from device memory failed (",
          meta.status().ToString(), "); it goes through host memory");
    }
    return std::optional<storage::CacheMeta>();
  }

  // A put's K and V received over the channel (a thread of transfers_): posted into the
  // channel's receive memory, waited for, then handed over as they are (the put's engine runs
  // on this device) or copied to pinned host memory.
  absl::StatusOr<GpuReceived> ReceiveNow(const std::shared_ptr<Channel>& c,
                                         const GpuLinkReceive& r) {
    KVCOMP_RETURN_IF_ERROR(AwaitJoin(*c));
    absl::MutexLock op(&c->op_mu);
    KVCOMP_RETURN_IF_ERROR(Usable(c));
    const uint64_t bytes = r.layout.CacheBytes(r.num_tokens);
    const bool reused = c->recv != nullptr && c->recv.use_count() == 1 && c->recv_bytes >= bytes;
    absl::StatusOr<std::shared_ptr<uint8_t>> memory = Reusable(c->recv, c->recv_bytes, c->device, bytes);
    // The last put let the memory go once its copy out of it was queued on its engine's
    // uploader: this receive overwrites it only after that copy.
    absl::Status s = memory.ok() && reused ? AfterUploads(c->device) : memory.status();
    if (!s.ok()) return Fail(c, s);
    const Regions regions = LayerRegions(memory->get(), r.layout, r.num_tokens, r.layer_major);
    absl::StatusOr<std::shared_ptr<Completion>> received =
        Post(*c, Direction::kReceive, regions, r.descriptor, /*peer_may_be_larger=*/false);
    if (!received.ok()) return Refused(c, received.status());
    s = (*received)->Wait(absl::Now() + timeout_);
    if (!s.ok()) return Fail(c, s);
    Touch(*c);
    GpuReceived out;
    out.bytes = bytes;
    out.seconds = SecondsOf(*c->timer);
    metrics_->ObserveStage(Stage::kReceive, out.seconds);
    if (r.engine_device == c->device) {
      out.memory = *std::move(memory);
      out.space = MemorySpace::kDevice;
      return out;
    }
    s = Pinned(c->device, bytes, &out.memory);
    if (s.ok()) {
      s = rt_->CopyAsync(out.memory.get(), memory->get(), bytes, GpuRuntime::Copy::kDeviceToHost,
                         c->stream);
    }
    if (s.ok()) s = rt_->WaitStream(c->stream, absl::Now() + timeout_);
    if (!s.ok()) return Fail(c, s);
    return out;
  }

  // The channel's memory in `slot` of at least `bytes`: its own when nothing else holds it any
  // more, else a new one (the old goes with its last holder). Caller holds the channel's op_mu.
  absl::StatusOr<std::shared_ptr<uint8_t>> Reusable(std::shared_ptr<uint8_t>& slot,
                                                    size_t& slot_bytes, int device,
                                                    uint64_t bytes) {
    if (slot != nullptr && slot.use_count() == 1 && slot_bytes >= bytes) return slot;
    slot.reset();
    slot_bytes = 0;
    KVCOMP_ASSIGN_OR_RETURN(slot, Env().Allocate(device, bytes, DeviceEnv::Drawer::kLinks));
    slot_bytes = bytes;
    return slot;
  }

  // Waits until the copies queued so far on the uploader of `device`'s engine are done (none:
  // no GPU engine there). DeadlineExceeded past the transfer timeout.
  absl::Status AfterUploads(int device) {
    Engine* engine = service_->engines()->OnDevice(device);
    DeviceUploader* uploader = engine != nullptr ? engine->uploader() : nullptr;
    if (uploader == nullptr) return absl::OkStatus();
    KVCOMP_ASSIGN_OR_RETURN(std::unique_ptr<DeviceUploader::Fence> fence, uploader->MarkCopies());
    const absl::Time deadline = absl::Now() + timeout_;
    for (;;) {
      KVCOMP_ASSIGN_OR_RETURN(const bool done, fence->Done());
      if (done) return absl::OkStatus();
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError("a put's copy out of the channel's memory did not end");
      }
      absl::SleepFor(absl::Microseconds(20));
    }
  }

  // The daemon's device memory: every channel buffer is drawn from its device's budget.
  DeviceEnv& Env() const { return service_->engine()->device_env(); }
  // Page-locked host memory for one transfer's copies with `device`, from the same env.
  absl::Status Pinned(int device, uint64_t bytes, std::shared_ptr<uint8_t>* out) {
    KVCOMP_ASSIGN_OR_RETURN(*out, Env().AllocatePinned(device, bytes));
    return absl::OkStatus();
  }

  void Drain() override { draining_.store(true); }

  void Stop() override {
    std::vector<std::shared_ptr<Channel>> all;
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return;
      stopped_ = true;
      for (auto& [id, c] : channels_) all.push_back(c);
      channels_.clear();
    }
    stop_.Notify();
    if (reaper_.joinable()) reaper_.join();
    for (auto& c : all) c->dead.store(true);
    // Receives queued fail (their channels are dead); one in progress ends by its deadline.
    std::unique_ptr<TaskPool> transfers;
    {
      absl::MutexLock lock(&mu_);
      transfers = std::move(transfers_);
    }
    transfers.reset();
    for (auto& c : all) Destroy(c, "daemon stopping");
  }

 private:
  // Why no channel at all can be had (empty: channels can); nccl_reason_ says why a client on
  // another GPU cannot have one (a client on this GPU needs no NCCL: CUDA IPC).
  std::string Probe(const Options& options) {
    if (!options.data_plane.gpu_channel) return "the GPU channel is off (data_plane.gpu_channel)";
    if (absl::Status s = GpuRuntime::LoadNccl(); !s.ok()) {
      nccl_reason_ = absl::StrCat("no GPU channel: ", s.message());
    }
    absl::StatusOr<GpuRuntime*> rt = GpuRuntime::Get();
    if (!rt.ok()) {
      return nccl_reason_.empty() ? absl::StrCat("no GPU channel: ", rt.status().message())
                                  : absl::StrCat(nccl_reason_, "; ", rt.status().message());
    }
    rt_ = *rt;
    for (int device : devices_) {
      if (absl::Status s = rt_->SetDevice(device); !s.ok()) {
        return absl::StrCat("no GPU channel: cuda:", device, ": ", s.message());
      }
      absl::StatusOr<std::string> uuid = rt_->DeviceUuid(device);
      if (!uuid.ok()) {
        return absl::StrCat("no GPU channel: cuda:", device, ": ", uuid.status().message());
      }
      device_uuids_.push_back(*uuid);
    }
    const std::string on = absl::StrCat("cuda:", absl::StrJoin(devices_, ", cuda:"));
    if (nccl_reason_.empty()) {
      Log(LogLevel::kInfo, "GPU channel: NCCL ", rt_->nccl_version(), " (", rt_->nccl_path(),
          ") on ", on, rt_->has_ipc() ? "; CUDA IPC for clients on these GPUs" : "");
    } else {
      Log(LogLevel::kInfo, "GPU channel: CUDA IPC only, for clients on ", on, " (", nccl_reason_,
          ")");
    }
    return "";
  }

  absl::StatusOr<std::shared_ptr<Channel>> Find(const std::string& tenant, uint64_t id) {
    absl::MutexLock lock(&mu_);
    auto it = channels_.find(id);
    // Another tenant's channel reads as absent, as a closed one does.
    if (it == channels_.end() || it->second->tenant != tenant || it->second->dead.load()) {
      return WithDetail(
          absl::NotFoundError(absl::StrCat("no GPU channel ", id, " open for this tenant")),
          ErrorDetail::kLinkGone);
    }
    return it->second;
  }

  void Remove(uint64_t id) {
    absl::MutexLock lock(&mu_);
    channels_.erase(id);
  }

  absl::Status AwaitJoin(Channel& c) {
    absl::MutexLock lock(&c.join_mu);
    const absl::Time deadline = absl::Now() + timeout_ + absl::Seconds(1);
    while (!c.joined) {
      if (c.join_mu.AwaitWithDeadline(absl::Condition(&c.joined), deadline)) break;
      return absl::DeadlineExceededError("the GPU channel's communicator did not form in time");
    }
    if (!c.join_status.ok()) {
      return WithDetail(Annotate(absl::UnavailableError(c.join_status.message()),
                                 "the GPU channel's communicator failed"),
                        ErrorDetail::kLinkGone);
    }
    return absl::OkStatus();
  }

  // Posts a transfer between the channel's memory `regions` and the client on the channel's
  // link; `peer`: the client's side as its request described it (its memory, over CUDA IPC).
  // Caller holds c.op_mu.
  absl::StatusOr<std::shared_ptr<Completion>> Post(Channel& c, Direction direction,
                                                   const Regions& regions, absl::string_view peer,
                                                   bool peer_may_be_larger) {
    transport::Transfer t;
    t.direction = direction;
    t.regions = regions;
    t.stream = c.stream;
    t.deadline = absl::Now() + timeout_;
    t.peer = peer;
    t.peer_may_be_larger = peer_may_be_larger;
    return c.payload->Post(t);
  }

  // A transfer the link refused as the client's mistake (a description of its memory that does
  // not fit the transfer or the link, memory it cannot map) leaves the channel usable; any other
  // failure to post fails it.
  absl::Status Refused(const std::shared_ptr<Channel>& c, const absl::Status& why) {
    const bool clients = absl::IsInvalidArgument(why) ||
                         transport::AfterLinkFailure(why) == transport::LinkVerdict::kNextLink;
    return clients ? why : Fail(c, why);
  }

  // The channel ready for a transfer: open, its stream and link made. Caller holds c->op_mu.
  absl::Status Usable(const std::shared_ptr<Channel>& c) {
    if (c->dead.load() || (!c->ipc && (c->link == nullptr || c->link->broken()))) {
      return WithDetail(absl::UnavailableError("the GPU channel is closed"),
                        ErrorDetail::kLinkGone);
    }
    KVCOMP_RETURN_IF_ERROR(rt_->SetDevice(c->device));
    if (c->stream == nullptr) {
      KVCOMP_ASSIGN_OR_RETURN(c->stream, rt_->NewStream());
      KVCOMP_ASSIGN_OR_RETURN(c->timer, rt_->NewTimer());
      if (c->ipc) {
        c->payload = std::make_unique<transport::CudaIpcLink>(rt_, c->stream, c->client_event,
                                                              c->timer.get());
      } else {
        c->payload = std::make_unique<transport::NcclPayloadLink>(c->link.get(), c->timer.get());
      }
    }
    return absl::OkStatus();
  }

  void Touch(Channel& c) { c.last_used_ns.store(absl::ToUnixNanos(absl::Now())); }

  // The channel failed (caller holds c->op_mu): its communicator is aborted and it goes.
  // Returns `why`.
  absl::Status Fail(const std::shared_ptr<Channel>& c, const absl::Status& why) {
    metrics_->CountError("gpu_channel", why);
    Log(LogLevel::kWarning, "GPU channel ", c->id, " of tenant '", c->tenant,
        "' closed: ", why.ToString());
    c->dead.store(true);
    if (c->link) c->link->Abort();
    return why;  // the reaper removes and tears it down (Find already treats it as absent)
  }

  // Tears a removed channel down: waits for its joiner and any transfer in progress, frees.
  void Destroy(const std::shared_ptr<Channel>& c, const char* why) {
    c->dead.store(true);
    if (c->joiner.joinable()) c->joiner.join();
    absl::MutexLock op(&c->op_mu);
    if (rt_ != nullptr && rt_->SetDevice(c->device).ok()) {
      c->link.reset();  // destroys a healthy communicator, aborts a broken one
      if (c->stream != nullptr) (void)rt_->WaitStream(c->stream, absl::Now() + absl::Seconds(5));
      c->payload.reset();  // over CUDA IPC: unmaps the client's memory
      c->timer.reset();
      rt_->DestroyEvent(c->client_event);
      c->client_event = nullptr;
      c->recv.reset();  // freed here unless a put still holds it
      c->send.reset();  // likewise a get
      rt_->DestroyStream(c->stream);
      c->stream = nullptr;
    }
    Log(LogLevel::kInfo, "GPU channel ", c->id, " closed: ", why);
  }

  // The seconds the channel's timer measured; 0 when it cannot tell.
  static double SecondsOf(GpuRuntime::Timer& timer) {
    absl::StatusOr<double> secs = timer.Seconds(absl::Now() + absl::Seconds(1));
    return secs.ok() ? *secs : 0;
  }

  // Closes channels idle past the idle timeout, failed or closed (a transfer's own thread
  // fails its channel past the transfer timeout: the abort ends the daemon's kernels), and all
  // once draining.
  void Reap() {
    while (!stop_.WaitForNotificationWithTimeout(absl::Milliseconds(250))) {
      const int64_t now = absl::ToUnixNanos(absl::Now());
      std::vector<std::shared_ptr<Channel>> expired;
      {
        absl::MutexLock lock(&mu_);
        for (auto& [id, c] : channels_) {
          const bool idle = idle_timeout_ > absl::ZeroDuration() &&
                            now - c->last_used_ns.load() > absl::ToInt64Nanoseconds(idle_timeout_);
          bool failed = false;
          {
            absl::MutexLock j(&c->join_mu);
            failed = c->joined && !c->join_status.ok();
          }
          if (idle || failed || c->dead.load() || draining_.load()) expired.push_back(c);
        }
        for (auto& c : expired) channels_.erase(c->id);
      }
      for (auto& c : expired) {
        Destroy(c, draining_.load() ? "draining" : "idle, failed or closed after a failure");
      }
    }
  }

  CacheService* const service_;
  Metrics* const metrics_;
  // The daemon's devices a channel may use (one per GPU engine; on a CPU daemon
  // engine.cuda_device), and their CUDA UUIDs in the same order.
  const std::vector<int> devices_;
  const uint32_t max_channels_;
  const double tenant_share_;
  const absl::Duration timeout_;
  const absl::Duration idle_timeout_;
  const uint64_t max_transfer_bytes_;
  GpuRuntime* rt_ = nullptr;
  std::vector<std::string> device_uuids_;
  std::string reason_;
  std::string nccl_reason_;
  std::atomic<bool> draining_{false};
  absl::Notification stop_;
  std::thread reaper_;

  mutable absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Channel>> channels_ ABSL_GUARDED_BY(mu_);
  // The transfers' steps: puts' receives, gets' reads, copies and sends.
  std::unique_ptr<TaskPool> transfers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<GpuChannels> GpuChannels::Create(const Options& options, CacheService* service,
                                                 Metrics* metrics) {
  return std::make_unique<GpuChannelsImpl>(options, service, metrics);
}

}  // namespace service
}  // namespace kvcomp
