// A RequestHandler for transport tests: per-tenant tokens, puts assembled in memory from their
// blocks, commit builds a real format-v1 cache that keeps every token (raw codecs), gets return
// its bytes. Completions run on a thread of its own (as the daemon's pool would) after an optional
// delay, so back-pressure and asynchronous replies are exercised.
#ifndef KVCOMP_TESTS_TRANSPORT_MEMORY_HANDLER_H_
#define KVCOMP_TESTS_TRANSPORT_MEMORY_HANDLER_H_

#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvcomp/core/compressed_cache.h"
#include "kvcomp/core/error_detail.h"
#include "kvcomp/core/format.h"
#include "kvcomp/transport/server.h"

namespace kvcomp {
namespace testing {

class MemoryHandler : public transport::RequestHandler {
 public:
  // tenant -> token; empty map: any credentials accepted.
  explicit MemoryHandler(std::map<std::string, std::string> tokens = {})
      : tokens_(std::move(tokens)), worker_([this] { Run(); }) {}
  ~MemoryHandler() override {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    worker_.join();
  }

  // Each OnBlock completes after this delay (on its completion thread).
  void set_block_delay(absl::Duration d) { block_delay_ns_ = absl::ToInt64Nanoseconds(d); }

  // Takes link blocks (wire::kBlockLinkPayload) of link `channel` over a stand-in link whose
  // descriptor carries the K and V themselves, moved on the completion thread; link `channel` + 1
  // is gone (NotFound with ErrorDetail::kLinkGone); any other link block gets the transport's
  // default answer.
  void set_link(uint64_t channel) { link_channel_ = channel; }

  void ReceiveOverLink(const transport::PutContext& put, const transport::wire::Block& block,
                       transport::Buffer descriptor, transport::LinkReceived received) override {
    if (link_channel_.load() != 0 && block.link_channel == link_channel_.load() + 1) {
      received(WithDetail(absl::NotFoundError("link gone"), ErrorDetail::kLinkGone));
      return;
    }
    if (link_channel_.load() == 0 || block.link_channel != link_channel_.load()) {
      RequestHandler::ReceiveOverLink(put, block, std::move(descriptor), std::move(received));
      return;
    }
    auto moved = std::make_shared<transport::Buffer>(std::move(descriptor));
    Later(absl::Nanoseconds(block_delay_ns_.load()),
          [moved, received = std::move(received)]() mutable { received(std::move(*moved)); });
  }

  // The stand-in link's get: it "moves" the descriptor's bytes (the answer names as many), after
  // the block delay; link_channel + 1 is a link that is gone.
  void SendOverLink(const transport::Session& session, const transport::wire::Get& get,
                    std::string descriptor, transport::LinkSent sent) override {
    if (link_channel_.load() != 0 && get.link_channel == link_channel_.load() + 1) {
      sent(WithDetail(absl::NotFoundError("link gone"), ErrorDetail::kLinkGone));
      return;
    }
    if (link_channel_.load() == 0 || get.link_channel != link_channel_.load()) {
      RequestHandler::SendOverLink(session, get, std::move(descriptor), std::move(sent));
      return;
    }
    transport::wire::GetReply reply;
    reply.representation = get.representation;
    reply.link_payload_bytes = descriptor.size();
    reply.num_tokens = get.link_capacity;
    reply.link_ns = 1;
    Later(absl::Nanoseconds(block_delay_ns_.load()),
          [reply, sent = std::move(sent)]() mutable { sent(reply); });
  }

  absl::StatusOr<std::string> OnHello(const transport::Session& session,
                                      const transport::wire::Hello& hello) override {
    const std::string tenant = hello.tenant.empty() ? "default" : hello.tenant;
    if (!tokens_.empty()) {
      auto it = tokens_.find(tenant);
      if (it == tokens_.end() || it->second != hello.token) {
        return absl::UnauthenticatedError("bad tenant or token");
      }
    }
    return tenant;
  }

  absl::Status OnPutBegin(const transport::PutContext& put) override {
    absl::MutexLock l(&mu_);
    Put& p = puts_[PutKey(put)];
    p.begin = *put.begin;
    p.tenant = put.session.tenant;
    const uint64_t bytes = put.begin->layout.CacheBytes(put.begin->num_tokens) / 2;
    p.keys.assign(bytes, 0);
    p.values.assign(bytes, 0);
    return absl::OkStatus();
  }

  void OnBlock(const transport::PutContext& put, const transport::wire::Block& block,
               transport::Buffer payload, transport::Done done) override {
    {
      absl::MutexLock l(&mu_);
      auto it = puts_.find(PutKey(put));
      if (it == puts_.end()) {
        done(absl::NotFoundError("put unknown to the handler"));
        return;
      }
      Put& p = it->second;
      const KvLayout& lay = p.begin.layout;
      const uint64_t row = DTypeBytes(lay.dtype, lay.head_dim);
      const uint64_t n = p.begin.num_tokens, bt = block.token_end - block.token_begin;
      const uint8_t* src = payload.bytes();
      auto scatter = [&](std::vector<uint8_t>& dst) {
        for (uint32_t l = block.layer_begin; l < block.layer_end; ++l) {
          for (uint32_t h = 0; h < lay.num_kv_heads; ++h) {
            uint8_t* d = dst.data() + ((uint64_t{l} * lay.num_kv_heads + h) * n +
                                       block.token_begin) * row;
            std::memcpy(d, src, bt * row);
            src += bt * row;
          }
        }
      };
      if (block.parts & transport::wire::kPartKeys) scatter(p.keys);
      if (block.parts & transport::wire::kPartValues) scatter(p.values);
      blocks_received_++;
    }
    Later(absl::Nanoseconds(block_delay_ns_.load()),
          [done = std::move(done)]() mutable { done(absl::OkStatus()); });
  }

  void OnPutCommit(const transport::PutContext& put, transport::CommitDone done) override {
    absl::StatusOr<transport::wire::CacheSummary> result;
    {
      absl::MutexLock l(&mu_);
      auto it = puts_.find(PutKey(put));
      if (it == puts_.end()) {
        result = absl::NotFoundError("put unknown to the handler");
      } else {
        result = Store(it->second);
        puts_.erase(it);
      }
    }
    Later(absl::ZeroDuration(), [done = std::move(done), r = std::move(result)]() mutable {
      done(std::move(r));
    });
  }

  void OnPutAbort(const transport::PutContext& put, const absl::Status& reason) override {
    absl::MutexLock l(&mu_);
    puts_.erase(PutKey(put));
    aborts_.push_back(reason);
  }

  void OnGet(const transport::Session& session, const transport::wire::Get& get,
             transport::GetDone done) override {
    absl::StatusOr<transport::GetResult> r = absl::NotFoundError("no such cache");
    {
      absl::MutexLock l(&mu_);
      auto it = store_.find(StoreKey(session.tenant, get.model_id, get.key));
      if (it != store_.end()) {
        transport::GetResult g;
        g.bytes = transport::Buffer::FromString(it->second);
        g.representation = get.representation;
        r = std::move(g);
      }
    }
    Later(absl::ZeroDuration(),
          [done = std::move(done), r = std::move(r)]() mutable { done(std::move(r)); });
  }

  void OnLookup(const transport::Session& session, const transport::wire::Lookup& lookup,
                transport::LookupDone done) override {
    absl::StatusOr<transport::wire::CacheSummary> r = absl::NotFoundError("no such cache");
    {
      absl::MutexLock l(&mu_);
      auto it = store_.find(StoreKey(session.tenant, lookup.model_id, lookup.key));
      if (it != store_.end()) r = Summary(it->second);
    }
    done(std::move(r));  // synchronous completion is allowed too
  }

  void OnDelete(const transport::Session& session, const transport::wire::Delete& del,
                transport::Done done) override {
    absl::MutexLock l(&mu_);
    const bool erased = store_.erase(StoreKey(session.tenant, del.model_id, del.key)) > 0;
    done(erased ? absl::OkStatus() : absl::NotFoundError("no such cache"));
  }

  void OnDisconnect(const transport::Session& session) override { disconnects_++; }

  int open_puts() {
    absl::MutexLock l(&mu_);
    return static_cast<int>(puts_.size());
  }
  std::vector<absl::Status> aborts() {
    absl::MutexLock l(&mu_);
    return aborts_;
  }
  int disconnects() const { return disconnects_.load(); }
  int blocks_received() {
    absl::MutexLock l(&mu_);
    return blocks_received_;
  }

 private:
  struct Put {
    transport::wire::PutBegin begin;
    std::string tenant;
    std::vector<uint8_t> keys, values;  // [layer][kv_head][token][head_dim]
  };

  static std::string PutKey(const transport::PutContext& put) {
    return absl::StrCat(put.session.connection_id, "/", put.put_id);
  }
  static std::string StoreKey(absl::string_view tenant, absl::string_view model,
                              absl::string_view key) {
    return absl::StrCat(tenant, "\n", model, "\n", key);
  }

  absl::StatusOr<transport::wire::CacheSummary> Store(const Put& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    CompressedCache c;
    c.has_moments = false;
    c.Reset(p.begin.layout, p.begin.num_tokens);
    const uint64_t n = p.begin.num_tokens;
    for (auto& k : c.kept) k = static_cast<uint32_t>(n);
    for (uint64_t h = 0; h < c.num_heads(); ++h) {
      for (uint64_t t = 0; t < n; ++t) c.positions.push_back(static_cast<uint32_t>(t));
    }
    c.keys = p.keys;
    c.values = p.values;
    absl::StatusOr<std::string> bytes = format::EncodeCache(c);
    if (!bytes.ok()) return bytes.status();
    const std::string key = StoreKey(p.tenant, p.begin.model_id, p.begin.key);
    store_[key] = *std::move(bytes);
    return Summary(store_[key]);
  }

  static absl::StatusOr<transport::wire::CacheSummary> Summary(const std::string& bytes) {
    absl::StatusOr<format::CacheInfo> info = format::PeekCache(bytes);
    if (!info.ok()) return info.status();
    transport::wire::CacheSummary s;
    s.layout = info->layout;
    s.key_codec = info->key_codec;
    s.value_codec = info->value_codec;
    s.tier = 1;
    s.original_tokens = info->original_tokens;
    s.total_kept = info->total_kept;
    s.original_bytes = info->layout.CacheBytes(info->original_tokens);
    s.stored_bytes = bytes.size();
    return s;
  }

  void Later(absl::Duration delay, absl::AnyInvocable<void()> fn) {
    absl::MutexLock l(&mu_);
    queue_.push_back({absl::Now() + delay, std::move(fn)});
  }

  void Run() {
    for (;;) {
      std::deque<std::pair<absl::Time, absl::AnyInvocable<void()>>> batch;
      {
        absl::MutexLock l(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(
                                 +[](MemoryHandler* h) { return h->stop_ || !h->queue_.empty(); },
                                 this),
                             absl::Milliseconds(50));
        if (stop_ && queue_.empty()) return;
        batch.swap(queue_);
      }
      for (auto& [when, fn] : batch) {
        const absl::Duration wait = when - absl::Now();
        if (wait > absl::ZeroDuration()) absl::SleepFor(wait);
        fn();
      }
    }
  }

  const std::map<std::string, std::string> tokens_;
  std::atomic<int64_t> block_delay_ns_{0};
  std::atomic<uint64_t> link_channel_{0};
  std::atomic<int> disconnects_{0};
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, Put> puts_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> store_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> aborts_ ABSL_GUARDED_BY(mu_);
  int blocks_received_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::pair<absl::Time, absl::AnyInvocable<void()>>> queue_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;
};

}  // namespace testing
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_TRANSPORT_MEMORY_HANDLER_H_
