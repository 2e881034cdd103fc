#include "ingest.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/kernels/pipeline.h"
#include "log.h"

namespace kvcomp {
namespace service {

namespace wire = transport::wire;
using transport::Buffer;

namespace {

// Block-wise puts whose policy gives no block size are fed in blocks of this many tokens.
constexpr uint32_t kDefaultStreamBlockTokens = 1024;

// The backend of the compression worker running on this thread (set when the worker starts).
thread_local Backend* tls_worker_backend = nullptr;
thread_local absl::Status tls_worker_backend_error;

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// Covered token ranges of one (layer, part): begin -> end, disjoint.
class Coverage {
 public:
  // Adds [b, e) unless it overlaps what is there.
  bool Add(uint64_t b, uint64_t e) {
    auto next = ranges_.lower_bound(b);
    if (next != ranges_.end() && next->first < e) return false;
    if (next != ranges_.begin() && std::prev(next)->second > b) return false;
    ranges_.emplace(b, e);
    tokens_ += e - b;
    return true;
  }
  uint64_t tokens() const { return tokens_; }

 private:
  std::map<uint64_t, uint64_t> ranges_;
  uint64_t tokens_ = 0;
};

struct ReceivedBlock {
  wire::Block block;
  Buffer payload;
};

// Byte offsets inside a block's payload.
uint64_t KeyOffset(const KvLayout& layout, const wire::Block& b, uint32_t layer) {
  return uint64_t{layer - b.layer_begin} * layout.LayerBytes(b.token_end - b.token_begin);
}
uint64_t ValueOffset(const KvLayout& layout, const wire::Block& b, uint32_t layer) {
  return b.key_bytes + KeyOffset(layout, b, layer);
}

}  // namespace

struct IngestPipeline::PutState {
  PutId id;
  PutSpec spec;
  absl::Time begun = absl::Now();

  absl::Mutex mu;
  absl::Time last_block ABSL_GUARDED_BY(mu) = absl::Now();
  std::vector<ReceivedBlock> blocks ABSL_GUARDED_BY(mu);  // block-wise: those not yet appended
  std::vector<Coverage> key_cov ABSL_GUARDED_BY(mu), value_cov ABSL_GUARDED_BY(mu);
  uint64_t received_bytes ABSL_GUARDED_BY(mu) = 0;
  bool committing ABSL_GUARDED_BY(mu) = false;
  bool aborted ABSL_GUARDED_BY(mu) = false;

  // Block-wise state; used under `stream_mu` by one worker at a time.
  absl::Mutex stream_mu;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<BlockCompressor> compressor;
  std::vector<uint64_t> next_token;  // per layer: first token not yet appended
  absl::Status stream_error;
  bool drain_scheduled ABSL_GUARDED_BY(mu) = false;
};

absl::StatusOr<std::unique_ptr<IngestPipeline>> IngestPipeline::Create(
    const IngestOptions& options, storage::TieredStore* store, StoreProjections* projections,
    Metrics* metrics) {
  std::unique_ptr<IngestPipeline> p(new IngestPipeline(options, store, projections, metrics));
  if (options.backend == "cuda") {
    if (!CudaAvailable()) {
      return absl::FailedPreconditionError(
          "engine.backend is cuda but this build has no CUDA or no GPU is visible");
    }
    p->use_cuda_ = true;
  } else if (options.backend == "auto") {
    p->use_cuda_ = CudaAvailable();
  } else if (options.backend != "cpu") {
    return absl::InvalidArgumentError(absl::StrCat("unknown backend ", options.backend));
  }
  int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  p->threads_per_backend_ = options.cpu_threads > 0
                                ? options.cpu_threads
                                : std::max(1, hw / std::max(1, options.workers));
  // Probe one backend now so a broken engine fails the start, not the first put.
  KVCOMP_ASSIGN_OR_RETURN(auto probe, p->NewBackend(p->threads_per_backend_));
  p->backend_description_ = probe->Describe();
  probe.reset();
  p->worker_backends_.resize(options.workers);
  p->worker_backend_status_.resize(options.workers);
  IngestPipeline* self = p.get();
  p->compress_pool_ =
      std::make_unique<TaskPool>(options.workers, options.queue_capacity, [self](int i) {
        auto b = self->NewBackend(self->threads_per_backend_);
        if (b.ok()) {
          self->worker_backends_[i] = std::move(*b);
          tls_worker_backend = self->worker_backends_[i].get();
        } else {
          tls_worker_backend_error = b.status();
          Log(LogLevel::kError, "compression worker ", i, ": ", b.status().ToString());
        }
      }, options.tenant_share);
  p->serve_pool_ = std::make_unique<TaskPool>(options.serve_threads, options.serve_queue_capacity,
                                              nullptr, options.tenant_share);
  return p;
}

IngestPipeline::~IngestPipeline() { Shutdown(); }

void IngestPipeline::Shutdown() {
  if (compress_pool_) compress_pool_->Shutdown();
  if (serve_pool_) serve_pool_->Shutdown();
  absl::MutexLock lock(&mu_);
  puts_.clear();
}

absl::StatusOr<std::unique_ptr<Backend>> IngestPipeline::NewBackend(int threads) const {
  if (use_cuda_) {
    CudaBackendOptions o;
    o.device = options_.cuda_device;
    return MakeCudaBackend(o);
  }
  CpuBackendOptions o;
  o.num_threads = threads;
  return MakeCpuBackend(o);
}

size_t IngestPipeline::open_puts() const {
  absl::MutexLock lock(&mu_);
  return puts_.size();
}

void IngestPipeline::UpdateGauges() {
  metrics_->SetQueueDepth(static_cast<int64_t>(queue_depth()));
  metrics_->SetPutsInProgress(static_cast<int64_t>(open_puts()));
}

std::shared_ptr<IngestPipeline::PutState> IngestPipeline::Find(PutId id) {
  absl::MutexLock lock(&mu_);
  auto it = puts_.find(id);
  return it == puts_.end() ? nullptr : it->second;
}

std::shared_ptr<IngestPipeline::PutState> IngestPipeline::Take(PutId id) {
  std::shared_ptr<PutState> put;
  {
    absl::MutexLock lock(&mu_);
    auto it = puts_.find(id);
    if (it == puts_.end()) return nullptr;
    put = std::move(it->second);
    puts_.erase(it);
  }
  UpdateGauges();
  return put;
}


absl::Status IngestPipeline::BeginPut(PutId id, PutSpec spec) {
  if (draining()) return absl::UnavailableError("draining: kvcompd is shutting down");
  KVCOMP_RETURN_IF_ERROR(spec.key.Validate());
  KVCOMP_RETURN_IF_ERROR(spec.layout.Validate());
  if (spec.num_tokens == 0 || spec.num_tokens > KvLayout::kMaxTokens) {
    return absl::InvalidArgumentError("num_tokens out of range");
  }
  const uint64_t bytes = spec.layout.CacheBytes(spec.num_tokens);
  if (bytes > options_.max_put_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("cache of ", bytes,
                                                   " bytes exceeds data_plane.max_put_bytes (",
                                                   options_.max_put_bytes, ")"));
  }
  KVCOMP_RETURN_IF_ERROR(spec.policy.ValidateFor(spec.layout.head_dim));
  if (spec.block_wise) {
    if (spec.policy.scorer == Scorer::kSnapKV) {
      return absl::InvalidArgumentError("block-wise puts cannot use the snapkv scorer");
    }
    if (spec.policy.block_size == 0) spec.policy.block_size = kDefaultStreamBlockTokens;
  }
  if (spec.policy.value_codec != ValueCodec::kRaw) {
    KVCOMP_ASSIGN_OR_RETURN(std::string model, ProjectionModel(spec.key.tenant, spec.key.model_id));
    // Pinned while the put lives (the spec holds it), so the version is not collected before
    // the cache naming it is stored.
    KVCOMP_ASSIGN_OR_RETURN(spec.projection, projections_->AcquireLatest(model));
  }
  auto put = std::make_shared<PutState>();
  put->id = id;
  {
    absl::MutexLock plock(&put->mu);
    put->key_cov.resize(spec.layout.num_layers);
    put->value_cov.resize(spec.layout.num_layers);
  }
  put->next_token.assign(spec.layout.num_layers, 0);
  put->spec = std::move(spec);
  {
    absl::MutexLock lock(&mu_);
    if (puts_.contains(id)) return absl::AlreadyExistsError("put id already open");
    puts_.emplace(id, std::move(put));
  }
  UpdateGauges();
  return absl::OkStatus();
}

void IngestPipeline::AddBlock(PutId id, const wire::Block& block, Buffer payload,
                              transport::Done done) {
  std::shared_ptr<PutState> put = Find(id);
  if (put == nullptr) {
    done(absl::NotFoundError("block for a put that is not open"));
    return;
  }
  // The transport checked the block against the put's layout and admitted its bytes against
  // data_plane.max_buffered_bytes before allocating `payload`; the payload's own release returns
  // them, whenever this pipeline drops it.
  const PutSpec& spec = put->spec;
  absl::Status valid;
  if (payload.size() != block.payload_bytes()) {
    valid = absl::InvalidArgumentError("block payload size does not match key_bytes+value_bytes");
  }
  if (valid.ok() && payload.memory_type() != transport::MemoryType::kHost) {
    valid = absl::UnimplementedError("device-memory blocks are not supported by this daemon");
  }
  if (valid.ok() && spec.block_wise && block.parts != wire::kPartBoth) {
    valid = absl::InvalidArgumentError("block-wise puts need K and V in the same block");
  }
  if (!valid.ok()) {
    done(valid);
    return;
  }
  const uint64_t size = payload.size();
  bool schedule_drain = false;
  {
    absl::MutexLock lock(&put->mu);
    if (put->committing || put->aborted) {
      done(absl::FailedPreconditionError("block for a put that is committing or aborted"));
      return;
    }
    for (uint32_t l = block.layer_begin; l < block.layer_end; ++l) {
      bool ok = true;
      // Check both parts before adding, so a refused block leaves no trace.
      Coverage k = put->key_cov[l], v = put->value_cov[l];
      if (block.parts & wire::kPartKeys) ok = ok && k.Add(block.token_begin, block.token_end);
      if (block.parts & wire::kPartValues) ok = ok && v.Add(block.token_begin, block.token_end);
      if (!ok) {
        // Roll back layers added so far by rebuilding nothing: coverage is only committed below.
        done(absl::InvalidArgumentError(
            absl::StrCat("block overlaps tokens already received (layer ", l, ", tokens ",
                         block.token_begin, "..", block.token_end, ")")));
        return;
      }
    }
    for (uint32_t l = block.layer_begin; l < block.layer_end; ++l) {
      if (block.parts & wire::kPartKeys) put->key_cov[l].Add(block.token_begin, block.token_end);
      if (block.parts & wire::kPartValues) {
        put->value_cov[l].Add(block.token_begin, block.token_end);
      }
    }
    put->blocks.push_back(ReceivedBlock{block, std::move(payload)});
    put->received_bytes += size;
    put->last_block = absl::Now();
    if (spec.block_wise && !put->drain_scheduled) {
      put->drain_scheduled = true;
      schedule_drain = true;
    }
  }
  metrics_->AddReceivedBytes(size);
  done(absl::OkStatus());
  if (schedule_drain) {
    compress_pool_->Submit(spec.key.tenant, [this, put] {
      {
        absl::MutexLock lock(&put->mu);
        put->drain_scheduled = false;
      }
      absl::MutexLock stream(&put->stream_mu);
      absl::Status s = DrainBlockWise(*put);
      if (!s.ok() && put->stream_error.ok()) put->stream_error = s;
    });
  }
}

// Appends every block that is next in token order for all its layers. Caller holds stream_mu.
absl::Status IngestPipeline::DrainBlockWise(PutState& put) {
  if (!put.stream_error.ok()) return put.stream_error;
  const PutSpec& spec = put.spec;
  if (put.compressor == nullptr) {
    KVCOMP_ASSIGN_OR_RETURN(put.backend, NewBackend(threads_per_backend_));
    BlockCompressorOptions bo;
    bo.expected_tokens = spec.num_tokens;
    bo.projection = spec.projection;
    KVCOMP_ASSIGN_OR_RETURN(put.compressor,
                            BlockCompressor::Create(*put.backend, spec.layout, spec.policy, bo));
  }
  const KvLayout& layout = spec.layout;
  const uint32_t chunk = spec.policy.block_size;
  while (true) {
    ReceivedBlock next;
    bool found = false;
    {
      absl::MutexLock lock(&put.mu);
      if (put.aborted) return absl::OkStatus();
      for (size_t i = 0; i < put.blocks.size(); ++i) {
        const wire::Block& b = put.blocks[i].block;
        bool ready = true;
        for (uint32_t l = b.layer_begin; l < b.layer_end; ++l) {
          ready = ready && put.next_token[l] == b.token_begin;
        }
        if (ready) {
          next = std::move(put.blocks[i]);
          put.blocks.erase(put.blocks.begin() + static_cast<long>(i));
          found = true;
          break;
        }
      }
    }
    if (!found) return absl::OkStatus();
    const wire::Block& b = next.block;
    const uint64_t bt = b.token_end - b.token_begin;
    const size_t es = DTypeBytes(layout.dtype, 1);
    absl::Time t0 = absl::Now();
    for (uint32_t l = b.layer_begin; l < b.layer_end; ++l) {
      const uint8_t* kbase = next.payload.bytes() + KeyOffset(layout, b, l);
      const uint8_t* vbase = next.payload.bytes() + ValueOffset(layout, b, l);
      for (uint64_t c0 = 0; c0 < bt; c0 += chunk) {
        uint64_t c1 = std::min<uint64_t>(bt, c0 + chunk);
        HeadsView k{kbase + c0 * layout.head_dim * es,
                    layout.dtype,
                    layout.num_kv_heads,
                    c1 - c0,
                    layout.head_dim,
                    layout.head_dim,
                    bt * layout.head_dim,
                    MemorySpace::kHost};
        HeadsView v = k;
        v.data = vbase + c0 * layout.head_dim * es;
        KVCOMP_RETURN_IF_ERROR(put.compressor->Append(l, k, v));
      }
      put.next_token[l] = b.token_end;
    }
    double secs = Seconds(absl::Now() - t0);
    metrics_->ObserveStage(Stage::kCompress, secs);
    if (use_cuda_) metrics_->AddGpuSeconds(secs);
    next.payload.Reset();  // appended: its bytes go back to the data plane's budget
  }
}

void IngestPipeline::Commit(PutId id, transport::CommitDone done) {
  std::shared_ptr<PutState> put = Find(id);
  if (put == nullptr) {
    metrics_->CountError("put", absl::NotFoundError(""));
    done(absl::NotFoundError("commit for a put that is not open"));
    return;
  }
  {
    absl::MutexLock lock(&put->mu);
    if (put->committing) {
      done(absl::FailedPreconditionError("put is already committing"));
      return;
    }
    put->committing = true;
  }
  // The done callback must run exactly once: park it where both outcomes can reach it.
  auto shared_done = std::make_shared<transport::CommitDone>(std::move(done));
  bool queued = compress_pool_->TrySubmit(
      put->spec.key.tenant,
      [this, put, shared_done] { RunCommit(put, std::move(*shared_done), 0); });
  if (!queued) {
    {
      absl::MutexLock lock(&put->mu);
      put->committing = false;
    }
    metrics_->CountError("put", BusyError(""));
    (*shared_done)(BusyError(
        "compression queue full (engine.queue_capacity, or this tenant's share of it)"));
    return;
  }
  UpdateGauges();
}

void IngestPipeline::RunCommit(const std::shared_ptr<PutState>& put, transport::CommitDone done,
                               int /*worker*/) {
  absl::StatusOr<wire::CacheSummary> result = [&]() -> absl::StatusOr<wire::CacheSummary> {
    const PutSpec& spec = put->spec;
    {
      absl::MutexLock lock(&put->mu);
      metrics_->ObserveStage(Stage::kReceive, Seconds(put->last_block - put->begun));
      if (put->aborted) return absl::CancelledError("put was aborted");
      for (uint32_t l = 0; l < spec.layout.num_layers; ++l) {
        if (put->key_cov[l].tokens() != spec.num_tokens ||
            put->value_cov[l].tokens() != spec.num_tokens) {
          return absl::FailedPreconditionError(absl::StrCat(
              "put incomplete: layer ", l, " has K for ", put->key_cov[l].tokens(), " and V for ",
              put->value_cov[l].tokens(), " of ", spec.num_tokens, " tokens"));
        }
      }
    }
    CompressedCache cache;
    absl::Time t0 = absl::Now();
    if (spec.block_wise) {
      absl::MutexLock stream(&put->stream_mu);
      KVCOMP_RETURN_IF_ERROR(DrainBlockWise(*put));
      KVCOMP_RETURN_IF_ERROR(put->stream_error);
      {
        absl::MutexLock lock(&put->mu);
        if (!put->blocks.empty()) {
          return absl::InternalError("block-wise put has blocks that never became appendable");
        }
      }
      KVCOMP_ASSIGN_OR_RETURN(cache, put->compressor->Finish());
    } else {
      KVCOMP_ASSIGN_OR_RETURN(cache, CompressWhole(*put, 0));
    }
    double secs = Seconds(absl::Now() - t0);
    metrics_->ObserveStage(Stage::kCompress, secs);
    if (use_cuda_) metrics_->AddGpuSeconds(secs);
    return Store(*put, std::move(cache));
  }();
  // The put is finished either way; its buffers go.
  std::shared_ptr<PutState> taken = Take(put->id);
  {
    absl::MutexLock lock(&put->mu);
    put->blocks.clear();
  }
  if (result.ok()) {
    metrics_->ObserveOp(Op::kPut, Seconds(absl::Now() - put->begun));
  } else {
    metrics_->CountError("put", result.status());
  }
  UpdateGauges();
  done(std::move(result));
}

absl::StatusOr<CompressedCache> IngestPipeline::CompressWhole(PutState& put, int /*worker*/) {
  const PutSpec& spec = put.spec;
  const KvLayout& layout = spec.layout;
  const uint64_t T = spec.num_tokens;
  const uint64_t D = layout.head_dim;
  const size_t es = DTypeBytes(layout.dtype, 1);
  KvCacheView view;
  view.layout = layout;
  view.num_tokens = T;
  view.keys.resize(layout.num_layers);
  view.values.resize(layout.num_layers);
  std::vector<std::unique_ptr<uint8_t[]>> assembled;
  // After `committing` is set nothing adds to or removes from put.blocks until RunCommit ends,
  // so the blocks can be read without holding the lock through the compression.
  std::vector<const ReceivedBlock*> blocks;
  {
    absl::MutexLock lock(&put.mu);
    for (const auto& rb : put.blocks) blocks.push_back(&rb);
  }
  for (int part = 0; part < 2; ++part) {
    const uint8_t mask = part == 0 ? wire::kPartKeys : wire::kPartValues;
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
      std::vector<const ReceivedBlock*> covering;
      for (const ReceivedBlock* rb : blocks) {
        if ((rb->block.parts & mask) && rb->block.layer_begin <= l && l < rb->block.layer_end) {
          covering.push_back(rb);
        }
      }
      auto offset = [&](const ReceivedBlock& rb) {
        return part == 0 ? KeyOffset(layout, rb.block, l) : ValueOffset(layout, rb.block, l);
      };
      HeadsView& dst = part == 0 ? view.keys[l] : view.values[l];
      if (covering.size() == 1) {
        // One block holds the whole layer: read it in place.
        dst = HeadsView::Dense(covering[0]->payload.bytes() + offset(*covering[0]), layout.dtype,
                               layout.num_kv_heads, T, layout.head_dim);
        continue;
      }
      auto buf = std::unique_ptr<uint8_t[]>(new uint8_t[layout.LayerBytes(T)]);
      for (const ReceivedBlock* rb : covering) {
        const uint64_t tb = rb->block.token_begin;
        const uint64_t bt = rb->block.token_end - tb;
        const uint8_t* src = rb->payload.bytes() + offset(*rb);
        for (uint32_t h = 0; h < layout.num_kv_heads; ++h) {
          std::memcpy(buf.get() + (uint64_t{h} * T + tb) * D * es, src + uint64_t{h} * bt * D * es,
                      bt * D * es);
        }
      }
      dst = HeadsView::Dense(buf.get(), layout.dtype, layout.num_kv_heads, T, layout.head_dim);
      assembled.push_back(std::move(buf));
    }
  }
  if (tls_worker_backend == nullptr) {
    return absl::InternalError(
        absl::StrCat("compression worker has no backend: ", tls_worker_backend_error.ToString()));
  }
  CompressOptions co;
  co.projection = spec.projection;
  return Compress(*tls_worker_backend, view, spec.policy, co);
}

absl::StatusOr<wire::CacheSummary> IngestPipeline::Store(PutState& put, CompressedCache cache) {
  const PutSpec& spec = put.spec;
  absl::Time t0 = absl::Now();
  KVCOMP_ASSIGN_OR_RETURN(std::string bytes, format::EncodeCache(cache));
  KVCOMP_ASSIGN_OR_RETURN(format::CacheInfo info, format::PeekCache(bytes));
  const uint64_t original = spec.layout.CacheBytes(spec.num_tokens);
  const uint64_t stored = bytes.size();
  storage::CacheMeta meta;
  meta.original_bytes = original;
  storage::PutOptions po;
  po.tier = options_.put_tier;
  po.durability = options_.durability;
  KVCOMP_RETURN_IF_ERROR(
      store_->Put(spec.key, storage::Payload::FromString(std::move(bytes)), meta, po));
  metrics_->ObserveStage(Stage::kStore, Seconds(absl::Now() - t0));
  metrics_->AddStoredCache(original, stored);
  RememberInfo(spec.key, info);
  wire::CacheSummary s;
  s.layout = spec.layout;
  s.key_codec = cache.key_codec;
  s.value_codec = cache.value_codec;
  auto where = store_->Lookup(spec.key);
  s.tier = where.ok() ? static_cast<uint8_t>(where->tier) : 0;
  s.original_tokens = cache.original_tokens;
  s.total_kept = cache.total_kept();
  s.original_bytes = original;
  s.stored_bytes = stored;
  return s;
}

void IngestPipeline::Abort(PutId id) {
  std::shared_ptr<PutState> put = Take(id);
  if (put == nullptr) return;
  absl::MutexLock lock(&put->mu);
  put->aborted = true;
  if (!put->committing) put->blocks.clear();
}

bool IngestPipeline::WaitIdle(absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (open_puts() == 0 && queue_depth() == 0 && serve_pool_->depth() == 0) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

// ---- serving ----

namespace {

wire::CacheSummary SummaryOf(const format::CacheInfo& info, const storage::CacheMeta& meta,
                             storage::TierKind tier) {
  wire::CacheSummary s;
  s.layout = info.layout;
  s.key_codec = info.key_codec;
  s.value_codec = info.value_codec;
  s.tier = static_cast<uint8_t>(tier);
  s.original_tokens = info.original_tokens;
  s.total_kept = info.total_kept;
  s.original_bytes = meta.original_bytes;
  s.stored_bytes = meta.stored_bytes;
  return s;
}

// Another tenant's key and a missing key must read the same.
absl::Status NotFoundAsMissing(const absl::Status& s) {
  if (absl::IsNotFound(s)) return absl::NotFoundError("cache not found");
  return s;
}

}  // namespace

void IngestPipeline::Get(const CacheKey& key, wire::Representation rep, transport::GetDone done) {
  auto shared_done = std::make_shared<transport::GetDone>(std::move(done));
  bool queued = serve_pool_->TrySubmit(key.tenant, [this, key, rep, shared_done] {
    absl::Time t0 = absl::Now();
    absl::StatusOr<transport::GetResult> result = [&]() -> absl::StatusOr<transport::GetResult> {
      auto got = store_->Get(key);
      if (!got.ok()) return NotFoundAsMissing(got.status());
      if (rep == wire::Representation::kDecoded) {
        KVCOMP_ASSIGN_OR_RETURN(format::CacheInfo info, format::PeekCache(got->payload.view()));
        if (info.key_codec != KeyCodec::kRaw || info.value_codec != ValueCodec::kRaw) {
          KVCOMP_ASSIGN_OR_RETURN(CompressedCache cache, format::ParseCache(got->payload.view()));
          KVCOMP_ASSIGN_OR_RETURN(std::string model, ProjectionModel(key.tenant, key.model_id));
          KVCOMP_ASSIGN_OR_RETURN(CompressedCache raw,
                                  DecodeToRaw(std::move(cache), model, projections_));
          KVCOMP_ASSIGN_OR_RETURN(std::string bytes, format::EncodeCache(raw));
          transport::GetResult r;
          r.representation = rep;
          r.bytes = Buffer::FromString(std::move(bytes));
          return r;
        }
        // Raw codecs: the stored bytes are already the decoded form.
      }
      storage::Payload payload = got->payload;
      transport::GetResult r;
      r.representation = rep;
      void* data = const_cast<uint8_t*>(payload.data());
      size_t size = payload.size();
      r.bytes = Buffer::Wrap(data, size, transport::MemoryType::kHost,
                             [payload]() mutable { payload = storage::Payload(); });
      return r;
    }();
    double secs = Seconds(absl::Now() - t0);
    metrics_->ObserveStage(Stage::kServe, secs);
    metrics_->ObserveOp(Op::kGet, secs);
    if (result.ok()) {
      metrics_->AddServedBytes(result->bytes.size());
    } else {
      metrics_->CountError("get", result.status());
    }
    (*shared_done)(std::move(result));
  });
  if (!queued) {
    metrics_->CountError("get", BusyError(""));
    (*shared_done)(BusyError("serve queue full"));
  }
}

void IngestPipeline::RememberInfo(const CacheKey& key, const format::CacheInfo& info) {
  absl::MutexLock lock(&info_mu_);
  if (infos_.size() >= kMaxRememberedInfos) infos_.clear();
  infos_[key.Encode()] = info;
}

void IngestPipeline::ForgetInfo(const CacheKey& key) {
  absl::MutexLock lock(&info_mu_);
  infos_.erase(key.Encode());
}

absl::StatusOr<IngestPipeline::Description> IngestPipeline::Describe(const CacheKey& key) {
  Description d;
  auto where = store_->Lookup(key);
  if (!where.ok()) {
    ForgetInfo(key);
    return NotFoundAsMissing(where.status());
  }
  d.where = *where;
  {
    absl::MutexLock lock(&info_mu_);
    auto it = infos_.find(key.Encode());
    if (it != infos_.end() && it->second.total_bytes == where->meta.stored_bytes) {
      d.info = it->second;
      return d;
    }
  }
  // Not remembered (e.g. stored before a restart): read it once.
  auto got = store_->Get(key);
  if (!got.ok()) return NotFoundAsMissing(got.status());
  KVCOMP_ASSIGN_OR_RETURN(d.info, format::PeekCache(got->payload.view()));
  RememberInfo(key, d.info);
  return d;
}

void IngestPipeline::Lookup(const CacheKey& key, transport::LookupDone done) {
  auto shared_done = std::make_shared<transport::LookupDone>(std::move(done));
  bool queued = serve_pool_->TrySubmit(key.tenant, [this, key, shared_done] {
    absl::Time t0 = absl::Now();
    absl::StatusOr<wire::CacheSummary> result = [&]() -> absl::StatusOr<wire::CacheSummary> {
      KVCOMP_ASSIGN_OR_RETURN(Description d, Describe(key));
      return SummaryOf(d.info, d.where.meta, d.where.tier);
    }();
    metrics_->ObserveOp(Op::kLookup, Seconds(absl::Now() - t0));
    if (!result.ok()) metrics_->CountError("lookup", result.status());
    (*shared_done)(std::move(result));
  });
  if (!queued) {
    metrics_->CountError("lookup", BusyError(""));
    (*shared_done)(BusyError("serve queue full"));
  }
}

void IngestPipeline::Deleted(const CacheKey& key) {
  ForgetInfo(key);
  // The cache may have been the last to name an older projection version of its model.
  auto model = ProjectionModel(key.tenant, key.model_id);
  if (!model.ok()) return;
  auto collected = projections_->Collect(*model);
  if (!collected.ok()) {
    Log(LogLevel::kWarning, "projection cleanup of ", *model, ": ", collected.status().ToString());
  } else if (*collected > 0) {
    metrics_->AddProjectionsDeleted(*collected);
    Log(LogLevel::kDebug, "deleted ", *collected, " unused projection version(s) of ", *model);
  }
}

void IngestPipeline::Delete(const CacheKey& key, transport::Done done) {
  auto shared_done = std::make_shared<transport::Done>(std::move(done));
  bool queued = serve_pool_->TrySubmit(key.tenant, [this, key, shared_done] {
    absl::Time t0 = absl::Now();
    absl::Status s = NotFoundAsMissing(store_->Delete(key));
    if (s.ok()) {
      Deleted(key);
    } else {
      ForgetInfo(key);
    }
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
