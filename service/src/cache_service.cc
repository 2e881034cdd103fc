#include "cache_service.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/dtype.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/fp16_range.h"
#include "kvcomp/kernels/pipeline.h"
#include "log.h"

namespace kvcomp {
namespace service {

namespace {

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// Keys of a block that the fp16 key codec would turn into Inf (a finite key beyond the half
// range): InvalidArgument naming the first, so the put is refused, with the same message
// whichever engine would compress it and whichever memory the keys arrived in (host keys are
// scanned here on the CPU, device keys by a kernel on the device that holds them, when the put
// has a device path; without one its device blocks are refused anyway). Input in f16 always
// fits; NaN and Inf are the scoring pass's to refuse.
absl::Status CheckFp16KeyRange(const BlockData& block, const CompressionPolicy& policy,
                               bool device_path) {
  if (policy.key_codec != KeyCodec::kFp16) return absl::OkStatus();
  for (size_t i = 0; i < block.keys.size(); ++i) {
    const HeadsView& k = block.keys[i];
    if (k.dtype == DType::kF16 || (k.space != MemorySpace::kHost && !device_path)) continue;
    KVCOMP_ASSIGN_OR_RETURN(const Fp16Overflow o, FindFp16KeyOverflow(k));
    if (o.found) {
      return Fp16KeyRangeError(o, block.layer_begin + static_cast<uint32_t>(i),
                               block.token_begin);
    }
  }
  return absl::OkStatus();
}

}  // namespace

// ---- a put ----

OpenPut::OpenPut(CacheService* service, Engine* engine, PutRequest request,
                 std::shared_ptr<const Projection> projection,
                 std::shared_ptr<const pq::Calibration> pq, std::unique_ptr<DeviceKv> device_kv,
                 Engine::DeviceReservation reservation)
    : service_(service),
      engine_(engine),
      request_(std::move(request)),
      projection_(std::move(projection)),
      pq_(std::move(pq)),
      assembler_(request_.layout, request_.num_tokens,
                 PutAssembler::KeySumsHelp(request_.policy.get())),
      device_kv_(std::move(device_kv)),
      reservation_(std::move(reservation)) {
  service_->open_puts_.fetch_add(1);
}

OpenPut::~OpenPut() {
  {
    absl::MutexLock stream(&stream_mu_);
    compressor_.reset();  // before its backend goes back to the engine
    stream_.reset();
  }
  service_->open_puts_.fetch_sub(1);
  service_->UpdateGauges();
}

void OpenPut::AddBlock(BlockData block, Done done) {
  if (request_.block_wise && (!block.has_keys() || !block.has_values())) {
    done(absl::InvalidArgumentError("block-wise puts need K and V in the same block"));
    return;
  }
  if (absl::Status s = CheckFp16KeyRange(block, request_.policy.get(), device_kv_ != nullptr);
      !s.ok()) {
    done(s);
    return;
  }
  const uint64_t size = block.bytes;
  bool schedule_drain = false;
  {
    absl::MutexLock lock(&mu_);
    if (committing_ || aborted_) {
      done(absl::FailedPreconditionError("block for a put that is committing or aborted"));
      return;
    }
    if (device_kv_ != nullptr) {
      // Copied to the device now; the block's memory goes when this returns.
      absl::Status s = assembler_.Cover(block);
      if (s.ok()) {
        const absl::Time copy_begun = absl::Now();
        s = AddToDevice(block);
        to_device_seconds_ += Seconds(absl::Now() - copy_begun);
        // Its tokens count as received: a put missing them must not commit.
        if (!s.ok() && device_error_.ok()) device_error_ = s;
        last_block_ = absl::Now();
      }
      block.memory.reset();
      if (s.ok()) service_->metrics_->AddReceivedBytes(size);
      done(s);
      return;
    }
    if (block.space() != MemorySpace::kHost) {
      done(absl::InvalidArgumentError(
          request_.block_wise
              ? "block-wise puts take blocks in host memory"
              : "device-memory blocks need kvcompd's engine on a GPU (engine.backend cuda)"));
      return;
    }
    if (absl::Status s = assembler_.Add(std::move(block)); !s.ok()) {
      done(s);
      return;
    }
    last_block_ = absl::Now();
    if (request_.block_wise && !drain_scheduled_) {
      drain_scheduled_ = true;
      schedule_drain = true;
    }
  }
  service_->metrics_->AddReceivedBytes(size);
  done(absl::OkStatus());
  if (schedule_drain) {
    engine_->Submit(request_.key.tenant, [self = shared_from_this()](Backend&) {
      {
        absl::MutexLock lock(&self->mu_);
        self->drain_scheduled_ = false;
      }
      absl::MutexLock stream(&self->stream_mu_);
      absl::Status s = self->DrainBlockWise();
      if (!s.ok() && self->stream_error_.ok()) self->stream_error_ = s;
    });
  }
}

absl::Status OpenPut::AddToDevice(const BlockData& block) {
  const bool host = block.space() == MemorySpace::kHost;
  for (uint32_t l = block.layer_begin; l < block.layer_end; ++l) {
    const uint32_t i = l - block.layer_begin;
    if (block.has_keys()) {
      KVCOMP_RETURN_IF_ERROR(host ? device_kv_->AddHost(l, false, block.token_begin, block.keys[i])
                                  : device_kv_->AddDevice(l, false, block.token_begin,
                                                          block.keys[i]));
    }
    if (block.has_values()) {
      KVCOMP_RETURN_IF_ERROR(host ? device_kv_->AddHost(l, true, block.token_begin,
                                                        block.values[i])
                                  : device_kv_->AddDevice(l, true, block.token_begin,
                                                          block.values[i]));
    }
  }
  return absl::OkStatus();
}

absl::Status OpenPut::DrainBlockWise() {
  if (!stream_error_.ok()) return stream_error_;
  const CompressionPolicy& policy = request_.policy.get();
  if (compressor_ == nullptr) {
    KVCOMP_ASSIGN_OR_RETURN(Engine::StreamLease lease, engine_->LeaseStream());
    stream_.emplace(std::move(lease));
    BlockCompressorOptions bo;
    bo.expected_tokens = request_.num_tokens;
    bo.projection = projection_;
    bo.pq = pq_;
    KVCOMP_ASSIGN_OR_RETURN(
        compressor_, BlockCompressor::Create(stream_->backend(), request_.layout, policy, bo));
  }
  const size_t es = DTypeBytes(request_.layout.dtype, 1);
  const uint32_t chunk = policy.block_size;
  while (true) {
    BlockData next;
    {
      absl::MutexLock lock(&mu_);
      if (aborted_ || !assembler_.TakeNext(&next)) return absl::OkStatus();
    }
    absl::Time t0 = absl::Now();
    for (uint32_t l = next.layer_begin; l < next.layer_end; ++l) {
      const HeadsView& k = next.keys[l - next.layer_begin];
      const HeadsView& v = next.values[l - next.layer_begin];
      for (uint64_t c0 = 0; c0 < k.num_tokens; c0 += chunk) {
        const uint64_t c1 = std::min<uint64_t>(k.num_tokens, c0 + chunk);
        HeadsView kc = k, vc = v;
        kc.data = static_cast<const uint8_t*>(k.data) + c0 * k.token_stride * es;
        vc.data = static_cast<const uint8_t*>(v.data) + c0 * v.token_stride * es;
        kc.num_tokens = vc.num_tokens = c1 - c0;
        KVCOMP_RETURN_IF_ERROR(compressor_->Append(l, kc, vc));
      }
    }
    const double secs = Seconds(absl::Now() - t0);
    service_->metrics_->ObserveStage(Stage::kCompress, secs);
    if (engine_->uses_gpu()) service_->metrics_->AddGpuSeconds(secs);
    next.memory.reset();  // appended: its bytes go back to the data plane's budget
  }
}

void OpenPut::Commit(CommitDone done) {
  {
    absl::MutexLock lock(&mu_);
    if (committing_) {
      done(absl::FailedPreconditionError("put is already committing"));
      return;
    }
    committing_ = true;
  }
  // The done callback must run exactly once: park it where both outcomes can reach it.
  auto shared_done = std::make_shared<CommitDone>(std::move(done));
  auto run = [self = shared_from_this(), shared_done](Backend& backend) {
    self->RunCommit(backend, std::move(*shared_done));
  };
  if (!engine_->TrySubmit(request_.key.tenant, std::move(run))) {
    {
      absl::MutexLock lock(&mu_);
      committing_ = false;
    }
    service_->metrics_->CountError("put", BusyError(""));
    (*shared_done)(
        BusyError("compression queue full (engine.queue_capacity, or this tenant's share of it)"));
    return;
  }
  service_->UpdateGauges();
}

void OpenPut::RunCommit(Backend& backend, CommitDone done) {
  Metrics* metrics = service_->metrics_;
  absl::StatusOr<CacheSummary> result = [&]() -> absl::StatusOr<CacheSummary> {
    {
      absl::MutexLock lock(&mu_);
      metrics->ObserveStage(Stage::kReceive, Seconds(last_block_ - begun_));
      if (device_kv_ != nullptr) metrics->ObserveStage(Stage::kToDevice, to_device_seconds_);
      if (aborted_) return absl::CancelledError("put was aborted");
      KVCOMP_RETURN_IF_ERROR(device_error_);
      KVCOMP_RETURN_IF_ERROR(assembler_.CheckComplete());
    }
    CompressedCache cache;
    TransferBytes transfers;
    KVCOMP_RETURN_IF_ERROR(engine_->FaultPoint());
    absl::Time t0 = absl::Now();
    bool on_device;
    {
      absl::MutexLock lock(&mu_);
      on_device = device_kv_ != nullptr;
    }
    // A cache whose codecs the device does not encode (kernels' DeviceEncodes: the hq codecs
    // with KVCOMP_HQ_DEVICE_ENCODE=0) is selected on the device and encoded on the host
    // (Compress), then stored from host memory.
    const CompressionPolicy& policy = request_.policy.get();
    if (on_device && DeviceEncodes(policy)) {
      return CommitOnDevice(backend, &transfers);
    }
    if (request_.block_wise) {
      absl::MutexLock stream(&stream_mu_);
      KVCOMP_RETURN_IF_ERROR(DrainBlockWise());
      KVCOMP_RETURN_IF_ERROR(stream_error_);
      {
        absl::MutexLock lock(&mu_);
        if (assembler_.held_blocks() > 0) {
          return absl::InternalError("block-wise put has blocks that never became appendable");
        }
      }
      KVCOMP_ASSIGN_OR_RETURN(cache, compressor_->Finish());
    } else {
      KVCOMP_ASSIGN_OR_RETURN(cache, CompressWhole(backend, &transfers));
    }
    const double secs = Seconds(absl::Now() - t0);
    // A GPU compression's one download of the cache and the codecs are stages of their own.
    const double download = std::min(transfers.to_host_seconds, secs);
    const double codecs = std::min(transfers.encode_seconds, secs - download);
    metrics->ObserveStage(Stage::kCompress, secs - download - codecs);
    if (download > 0) metrics->ObserveStage(Stage::kDownload, download);
    if (engine_->uses_gpu()) metrics->AddGpuSeconds(secs - download);
    {
      // Compressed: the put's device memory goes before the cache is stored.
      absl::MutexLock lock(&mu_);
      device_kv_.reset();
      reservation_ = Engine::DeviceReservation();
    }
    // The store's upload into the GPU tier, when it goes there, is counted in `transfers`.
    KVCOMP_ASSIGN_OR_RETURN(
        CacheSummary summary,
        service_->repository_->Store(request_.key, cache,
                                     request_.layout.CacheBytes(request_.num_tokens),
                                     &transfers));
    // The codecs (above) and the cache's bytes in the stored format.
    metrics->ObserveStage(Stage::kEncode, transfers.encode_seconds);
    summary.h2d_bytes = transfers.to_device;
    summary.d2h_bytes = transfers.to_host;
    metrics->AddTransferBytes(summary.h2d_bytes, summary.d2h_bytes);
    return summary;
  }();
  {
    // The put is finished either way; its buffers go.
    absl::MutexLock lock(&mu_);
    assembler_.Clear();
    device_kv_.reset();
    reservation_ = Engine::DeviceReservation();
  }
  if (!result.ok() && engine_->CheckAfterError(backend, result.status())) {
    Log(LogLevel::kError, "engine failed: ", engine_->failure(),
        "; kvcompd takes no more puts and drains");
  }
  if (result.ok()) {
    metrics->ObserveOp(Op::kPut, Seconds(absl::Now() - begun_));
  } else {
    metrics->CountError("put", result.status());
  }
  service_->UpdateGauges();
  done(std::move(result));
}

absl::StatusOr<KvCacheView> OpenPut::ViewForCommit(Backend& backend, TransferBytes* transfers) {
  // Once committing_ is set nothing adds to or removes from the assembler (or the device
  // buffer) until RunCommit ends, so its view stays valid through the compression without the
  // lock.
  absl::MutexLock lock(&mu_);
  if (device_kv_ == nullptr) return assembler_.View();
  transfers->to_device += device_kv_->uploaded_bytes();
  return device_kv_->View(backend);
}

absl::StatusOr<CompressedCache> OpenPut::CompressWhole(Backend& backend,
                                                      TransferBytes* transfers) {
  KVCOMP_ASSIGN_OR_RETURN(KvCacheView view, ViewForCommit(backend, transfers));
  CompressOptions co;
  co.projection = projection_;
  co.pq = pq_;
  co.transfers = transfers;
  return Compress(backend, view, request_.policy.get(), co);
}

absl::StatusOr<CacheSummary> OpenPut::CommitOnDevice(Backend& backend, TransferBytes* transfers) {
  Metrics* metrics = service_->metrics_;
  absl::Time t0 = absl::Now();
  KVCOMP_ASSIGN_OR_RETURN(KvCacheView view, ViewForCommit(backend, transfers));
  CompressOptions co;
  co.projection = projection_;
  co.pq = pq_;
  co.transfers = transfers;
  KVCOMP_ASSIGN_OR_RETURN(DeviceCompressedCache cache,
                          CompressToDevice(backend, view, request_.policy.get(), co));
  const double secs = Seconds(absl::Now() - t0);
  const double codecs = std::min(transfers->encode_seconds, secs);
  metrics->ObserveStage(Stage::kCompress, secs - codecs);
  metrics->AddGpuSeconds(secs);
  {
    // The K and V go now; the reservation covers the encoding until the cache is stored.
    absl::MutexLock lock(&mu_);
    device_kv_.reset();
  }
  // Encoded on the device and handed to the store there: the GPU tier keeps it with one copy on
  // the device; the host tier, RocksDB (a disk-durable put, or a spill) get the encoded bytes
  // copied to the host once. Every byte between host and device is counted in `transfers`.
  KVCOMP_ASSIGN_OR_RETURN(
      CacheSummary summary,
      service_->repository_->StoreFromDevice(request_.key, backend, cache,
                                             request_.layout.CacheBytes(request_.num_tokens),
                                             transfers));
  // The codecs on the device (above) and the cache laid out in the format's sections there.
  metrics->ObserveStage(Stage::kEncode, transfers->encode_seconds);
  summary.h2d_bytes = transfers->to_device;
  summary.d2h_bytes = transfers->to_host;
  metrics->AddTransferBytes(summary.h2d_bytes, summary.d2h_bytes);
  return summary;
}

void OpenPut::Abort() {
  absl::MutexLock lock(&mu_);
  aborted_ = true;
  if (!committing_) {
    assembler_.Clear();
    device_kv_.reset();
    reservation_ = Engine::DeviceReservation();
  }
}

// ---- the service ----

CacheService::CacheService(const ServiceOptions& options, EngineSet* engines,
                           CacheRepository* repository, Metrics* metrics)
    : options_(options),
      engines_(engines),
      repository_(repository),
      metrics_(metrics),
      serve_pool_(std::make_unique<TaskPool>(options.serve_threads, options.serve_queue_capacity,
                                             nullptr, options.tenant_share)) {}

CacheService::~CacheService() { Shutdown(); }

void CacheService::Shutdown() {
  engines_->Shutdown();
  if (serve_pool_) serve_pool_->Shutdown();
}

void CacheService::UpdateGauges() {
  metrics_->SetQueueDepth(static_cast<int64_t>(queue_depth()));
  metrics_->SetPutsInProgress(static_cast<int64_t>(open_puts()));
}

bool CacheService::WaitIdle(absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (open_puts() == 0 && queue_depth() == 0 && serve_pool_->depth() == 0) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

absl::StatusOr<std::shared_ptr<OpenPut>> CacheService::BeginPut(PutRequest request, int device) {
  if (draining()) return absl::UnavailableError("draining: kvcompd is shutting down");
  const uint64_t bytes = request.layout.CacheBytes(request.num_tokens);
  if (bytes > options_.max_put_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("cache of ", bytes,
                                                   " bytes exceeds data_plane.max_put_bytes (",
                                                   options_.max_put_bytes, ")"));
  }
  std::shared_ptr<const Projection> projection;
  if (IsProjectionCodec(request.policy.get().value_codec)) {
    // Pinned while the put lives, so the version is not collected before the cache naming it
    // is stored.
    KVCOMP_ASSIGN_OR_RETURN(projection, repository_->PinProjection(request.key));
  }
  std::shared_ptr<const pq::Calibration> pq;
  const CompressionPolicy& policy = request.policy.get();
  if (IsPq(policy.key_codec) || IsPq(policy.value_codec)) {
    // Pinned the same way: the latest pq calibration at the policy's bits.
    KVCOMP_ASSIGN_OR_RETURN(pq,
                            repository_->PinPq(request.key, policy.key_bits, policy.value_bits));
  }
  // The engine, and what the put holds there: a whole-sequence put its K and V (on a GPU engine
  // in device memory, reserved against the cap before any block arrives); a block-wise put
  // nothing (its working set is host memory).
  const uint64_t holds =
      request.block_wise ? 0
                         : Engine::DeviceBytesForPut(request.layout, request.num_tokens,
                                                     request.policy.get().moments);
  KVCOMP_ASSIGN_OR_RETURN(EngineSet::Placement placed, engines_->Place(holds, device));
  std::unique_ptr<DeviceKv> device_kv;
  if (placed.engine->uploader() != nullptr && !request.block_wise) {
    KVCOMP_ASSIGN_OR_RETURN(device_kv, DeviceKv::Create(*placed.engine->uploader(),
                                                        request.layout, request.num_tokens));
  }
  std::shared_ptr<OpenPut> put(new OpenPut(this, placed.engine, std::move(request),
                                           std::move(projection), std::move(pq),
                                           std::move(device_kv),
                                           std::move(placed.reservation)));
  UpdateGauges();
  return put;
}

void CacheService::Get(const CacheKey& key, Representation rep, GetDone done) {
  auto shared_done = std::make_shared<GetDone>(std::move(done));
  const absl::Time t0 = absl::Now();
  // Counted and answered once, on whichever thread the get ends (a serve thread, or the GPU
  // engine worker that decoded it).
  auto finish = [this, key, t0, shared_done](absl::StatusOr<storage::Payload> result) {
    const double secs = Seconds(absl::Now() - t0);
    metrics_->ObserveStage(Stage::kServe, secs);
    metrics_->ObserveOp(Op::kGet, secs);
    if (result.ok()) {
      metrics_->AddServedBytes(result->size());
    } else {
      metrics_->CountError("get", result.status());
    }
    if (result.ok() || absl::IsNotFound(result.status())) {
      metrics_->CountRead("get", key.tenant, key.model_id, 1, result.ok() ? 1 : 0);
    }
    (*shared_done)(std::move(result));
  };
  bool queued = serve_pool_->TrySubmit(key.tenant, [this, key, rep, finish]() mutable {
    absl::StatusOr<storage::Payload> stored = repository_->Get(key, Representation::kStored);
    if (!stored.ok() || rep != Representation::kDecoded) return finish(std::move(stored));
    absl::StatusOr<bool> decode = CacheRepository::NeedsDecode(*stored);
    if (!decode.ok()) return finish(decode.status());
    if (!*decode) return finish(std::move(stored));  // raw codecs: already the decoded form
    // An encoded cache decodes on a GPU engine's worker when the daemon has one (its codecs on
    // the device, the cache staged there and the decoded arrays copied back); on the shared
    // CPU decoder when it has none, or when that engine's queue is full.
    Engine* gpu = engines_->uses_gpu() ? engines_->Pick() : nullptr;
    if (gpu != nullptr) {
      auto held = std::make_shared<storage::Payload>(*std::move(stored));
      auto on_gpu = std::make_shared<decltype(finish)>(std::move(finish));
      if (gpu->TrySubmit(key.tenant, [this, key, gpu, held, on_gpu](Backend& backend) {
            absl::StatusOr<storage::Payload> out = repository_->Decode(key, *held, &backend);
            if (!out.ok()) gpu->CheckAfterError(backend, out.status());
            (*on_gpu)(std::move(out));
          })) {
        return;
      }
      return (*on_gpu)(repository_->Decode(key, *held, nullptr));
    }
    finish(repository_->Decode(key, *stored, nullptr));
  });
  if (!queued) {
    metrics_->CountError("get", BusyError(""));
    (*shared_done)(BusyError("serve queue full"));
  }
}

void CacheService::Lookup(const CacheKey& key, LookupDone done) {
  auto shared_done = std::make_shared<LookupDone>(std::move(done));
  bool queued = serve_pool_->TrySubmit(key.tenant, [this, key, shared_done] {
    absl::Time t0 = absl::Now();
    absl::StatusOr<CacheSummary> result = repository_->Summarize(key);
    metrics_->ObserveOp(Op::kLookup, Seconds(absl::Now() - t0));
    if (!result.ok()) metrics_->CountError("lookup", result.status());
    if (result.ok() || absl::IsNotFound(result.status())) {
      metrics_->CountRead("lookup", key.tenant, key.model_id, 1, result.ok() ? 1 : 0);
    }
    (*shared_done)(std::move(result));
  });
  if (!queued) {
    metrics_->CountError("lookup", BusyError(""));
    (*shared_done)(BusyError("serve queue full"));
  }
}

void CacheService::Delete(const CacheKey& key, Done done) {
  auto shared_done = std::make_shared<Done>(std::move(done));
  bool queued = serve_pool_->TrySubmit(key.tenant, [this, key, shared_done] {
    absl::Time t0 = absl::Now();
    absl::Status s = repository_->Delete(key);
    metrics_->ObserveOp(Op::kDelete, Seconds(absl::Now() - t0));
    if (!s.ok()) metrics_->CountError("delete", s);
    (*shared_done)(s);
  });
  if (!queued) {
    metrics_->CountError("delete", BusyError(""));
    (*shared_done)(BusyError("serve queue full"));
  }
}

}  // namespace service
}  // namespace kvcomp
