#include "data_plane.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_service.h"
#include "handlers.h"
#include "kvcomp/core/status.h"
#include "kvcomp/service/daemon.h"
#include "kvcomp/transport/server.h"
#include "log.h"
#include "put.h"

namespace kvcomp {
namespace service {

namespace wire = transport::wire;

namespace {

// The transport keeps this with its record of the put: the put's one owner.
struct AttachedPut : transport::PutHandle {
  explicit AttachedPut(std::shared_ptr<OpenPut> p) : put(std::move(p)) {}
  std::shared_ptr<OpenPut> put;
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

class DataHandler : public transport::RequestHandler {
 public:
  explicit DataHandler(ServiceContext* ctx) : ctx_(ctx) {}

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
    absl::StatusOr<std::shared_ptr<OpenPut>> open =
        request.ok() ? ctx_->service->BeginPut(*std::move(request))
                     : absl::StatusOr<std::shared_ptr<OpenPut>>(request.status());
    if (!open.ok()) {
      ctx_->metrics->CountError("put", open.status());
      ctx_->errors_total.fetch_add(1);
      return open.status();
    }
    *put.attach = std::make_unique<AttachedPut>(*std::move(open));
    return absl::OkStatus();
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
    open->Commit([ctx, done = std::move(done)](absl::StatusOr<CacheSummary> r) mutable {
      if (!r.ok()) {
        ctx->errors_total.fetch_add(1);
        done(r.status());
        return;
      }
      ctx->puts_total.fetch_add(1);
      done(ToWire(*r));
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
};

// The {op} label of the errors the data-plane transport answers without the daemon.
constexpr char kTransportOp[] = "transport";

class UcxDataPlane : public DataPlane {
 public:
  explicit UcxDataPlane(ServiceContext* ctx) : handler_(ctx) {}

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
    so.report = [](const std::string& line) { Log(LogLevel::kWarning, line); };
    so.put_timeout = absl::Seconds(d.put_timeout_seconds);
    so.server_name = absl::StrCat("kvcompd ", Version());
    if (!d.ucx_tls.empty()) so.ucx.overrides["TLS"] = d.ucx_tls;
    if (!d.ucx_net_devices.empty()) so.ucx.overrides["NET_DEVICES"] = d.ucx_net_devices;
    KVCOMP_ASSIGN_OR_RETURN(server_, transport::UcxServer::Start(so, &handler_));
    return absl::OkStatus();
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
  }

 private:
  DataHandler handler_;
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
