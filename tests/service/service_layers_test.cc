// The service's layers without a daemon or a transport: PutAssembler on its own, then an Engine
// (CPU), a CacheRepository over a real TieredStore (host tier and RocksDB in a temporary
// directory) and a CacheService, with puts handed in as PutRequest and BlockData values.
#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "assembler.h"
#include "cache_repository.h"
#include "cache_service.h"
#include "engine.h"
#include "gtest/gtest.h"
#include "kvcomp/core/format.h"
#include "kvcomp/core/status.h"
#include "kvcomp/service/metrics.h"
#include "kvcomp/storage/tiered_store.h"
#include "kvsplice_glue.h"
#include "put.h"
#include "service_context.h"
#include "service_test_util.h"

namespace kvcomp {
namespace service {
namespace {

const KvLayout kLayout{2, 2, 4, 64, DType::kF32};
constexpr uint64_t kTokens = 48;

using testutil::MakeBlock;

// K and V of kLayout over kTokens.
struct Tensor : testutil::KvTensor {
  explicit Tensor(uint64_t seed) : KvTensor(kLayout, kTokens, seed) {}
};

CompressionPolicy HalfPolicy() {
  CompressionPolicy p;
  p.ratio = 0.5;
  return p;
}

PutRequest Request(const std::string& tenant, const std::string& key, bool block_wise = false,
                   CompressionPolicy policy = HalfPolicy()) {
  absl::StatusOr<PutRequest> r =
      PutRequest::Make(CacheKey{tenant, "m", key}, kLayout, kTokens, policy, block_wise);
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

// ---- PutAssembler on its own ----

TEST(PutAssemblerTest, OneBlockPerLayerIsReadInPlaceAndSplitLayersAreJoined) {
  Tensor x(1);
  PutAssembler a(kLayout, kTokens);
  // Layer 0 in one block; layer 1 split over two token ranges, keys and values apart.
  BlockData whole = MakeBlock(x, 0, 1, 0, kTokens);
  const void* in_place = whole.keys[0].data;
  ASSERT_TRUE(a.Add(std::move(whole)).ok());
  ASSERT_TRUE(a.Add(MakeBlock(x, 1, 2, 0, 20, true, false)).ok());
  ASSERT_TRUE(a.Add(MakeBlock(x, 1, 2, 20, kTokens, true, false)).ok());
  absl::Status short_of_values = a.CheckComplete();
  EXPECT_EQ(short_of_values.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(short_of_values.message().find("layer 1 has K for 48 and V for 0 of 48 tokens"),
            std::string::npos)
      << short_of_values;
  ASSERT_TRUE(a.Add(MakeBlock(x, 1, 2, 0, kTokens, false, true)).ok());
  ASSERT_TRUE(a.CheckComplete().ok());

  absl::StatusOr<KvCacheView> view = a.View();
  ASSERT_TRUE(view.ok()) << view.status();
  ASSERT_TRUE(view->Validate().ok()) << view->Validate();
  EXPECT_EQ(view->keys[0].data, in_place);
  for (uint32_t l = 0; l < 2; ++l) {
    for (uint32_t h = 0; h < kLayout.num_kv_heads; ++h) {
      for (uint64_t t : {uint64_t{0}, uint64_t{19}, uint64_t{20}, kTokens - 1}) {
        const float* k = static_cast<const float*>(view->keys[l].data) + view->keys[l].offset(h, t);
        const float* v =
            static_cast<const float*>(view->values[l].data) + view->values[l].offset(h, t);
        EXPECT_EQ(k[5], x.at(x.keys, l, h, t)[5]) << l << " " << h << " " << t;
        EXPECT_EQ(v[7], x.at(x.values, l, h, t)[7]) << l << " " << h << " " << t;
      }
    }
  }
}

TEST(PutAssemblerTest, OverlapsAndBadViewsAreRefusedWithoutTrace) {
  Tensor x(2);
  PutAssembler a(kLayout, kTokens);
  ASSERT_TRUE(a.Add(MakeBlock(x, 0, 2, 0, 16)).ok());
  absl::Status overlap = a.Add(MakeBlock(x, 1, 2, 8, 24));
  EXPECT_EQ(overlap.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(overlap.message().find("overlaps"), std::string::npos) << overlap;
  EXPECT_EQ(a.held_blocks(), 1u);
  // The refused block left no coverage: its non-overlapping tokens are still accepted.
  EXPECT_TRUE(a.Add(MakeBlock(x, 0, 2, 16, 24)).ok());

  BlockData beyond = MakeBlock(x, 0, 1, 40, kTokens);
  beyond.token_end = kTokens + 1;
  EXPECT_EQ(a.Add(std::move(beyond)).code(), absl::StatusCode::kInvalidArgument);
  BlockData wrong_heads = MakeBlock(x, 0, 1, 24, 32);
  wrong_heads.keys[0].num_heads = 1;
  EXPECT_EQ(a.Add(std::move(wrong_heads)).code(), absl::StatusCode::kInvalidArgument);
  BlockData empty = MakeBlock(x, 0, 1, 24, 32, false, false);
  EXPECT_EQ(a.Add(std::move(empty)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a.held_blocks(), 2u);
}

TEST(PutAssemblerTest, TakeNextFollowsTokenOrder) {
  Tensor x(3);
  PutAssembler a(kLayout, kTokens);
  ASSERT_TRUE(a.Add(MakeBlock(x, 0, 2, 32, kTokens)).ok());
  ASSERT_TRUE(a.Add(MakeBlock(x, 0, 2, 16, 32)).ok());
  BlockData next;
  EXPECT_FALSE(a.TakeNext(&next));  // tokens 0..16 have not arrived
  ASSERT_TRUE(a.Add(MakeBlock(x, 0, 2, 0, 16)).ok());
  std::vector<uint64_t> order;
  while (a.TakeNext(&next)) order.push_back(next.token_begin);
  EXPECT_EQ(order, (std::vector<uint64_t>{0, 16, 32}));
  EXPECT_EQ(a.held_blocks(), 0u);
}

TEST(PutRequestTest, ThePolicyIsCheckedWhereTheRequestIsMade) {
  CompressionPolicy bad = HalfPolicy();
  bad.ratio = 1.5;
  auto r = PutRequest::Make(CacheKey{"t", "m", "k"}, kLayout, kTokens, bad, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  CompressionPolicy snap = HalfPolicy();
  snap.scorer = Scorer::kSnapKV;
  r = PutRequest::Make(CacheKey{"t", "m", "k"}, kLayout, kTokens, snap, true);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  r = PutRequest::Make(CacheKey{"t", "m", "k"}, kLayout, 0, HalfPolicy(), false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  r = PutRequest::Make(CacheKey{"t", "m", ""}, kLayout, kTokens, HalfPolicy(), false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  // Fields in range, but a rank beyond the layout's head_dim: the check that needs the layout.
  CompressionPolicy wide = HalfPolicy();
  wide.value_codec = ValueCodec::kOrthogonal;
  wide.rank = 2 * kLayout.head_dim;
  ASSERT_TRUE(wide.Validate().ok());
  r = PutRequest::Make(CacheKey{"t", "m", "k"}, kLayout, kTokens, wide, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  KvLayout odd = kLayout;
  odd.head_dim = 65;
  r = PutRequest::Make(CacheKey{"t", "m", "k"}, odd, kTokens, HalfPolicy(), false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  // Block-wise without a block size: the stream block default.
  r = PutRequest::Make(CacheKey{"t", "m", "k"}, kLayout, kTokens, HalfPolicy(), true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->policy.get().block_size, ValidPolicy::kDefaultStreamBlockTokens);
}

// ---- the service over a real store ----

class ServiceTest : public testutil::ServiceFixture {
 protected:
  void SetUp() override {
    storage::StoreOptions so;
    so.host.enabled = true;
    so.host.capacity_bytes = 64 << 20;
    so.rocksdb.enabled = true;
    so.rocksdb.capacity_bytes = 256 << 20;
    so.rocksdb.reserve_bytes = 1;
    EngineOptions eo;
    eo.backend = "cpu";
    eo.workers = 1;
    eo.cpu_threads = 1;
    eo.queue_capacity = 4;
    RepositoryOptions ro;
    ro.durability = storage::Durability::kDisk;
    ServiceOptions svo;
    svo.max_put_bytes = 1 << 20;
    svo.serve_threads = 2;
    Open(so, eo, ro, svo);
  }

  // A whole put of `x` in two blocks (tokens split), committed.
  absl::StatusOr<CacheSummary> PutCache(const std::string& tenant, const std::string& key,
                                        const Tensor& x) {
    KVCOMP_ASSIGN_OR_RETURN(std::shared_ptr<OpenPut> put, service_->BeginPut(Request(tenant, key)));
    KVCOMP_RETURN_IF_ERROR(Add(*put, MakeBlock(x, 0, 2, 24, kTokens)));
    KVCOMP_RETURN_IF_ERROR(Add(*put, MakeBlock(x, 0, 2, 0, 24)));
    return Commit(*put);
  }
  absl::StatusOr<CacheSummary> Lookup(const CacheKey& key) {
    absl::StatusOr<CacheSummary> out = absl::UnknownError("not done");
    absl::Notification done;
    service_->Lookup(key, [&](absl::StatusOr<CacheSummary> r) {
      out = std::move(r);
      done.Notify();
    });
    done.WaitForNotification();
    return out;
  }
  absl::Status Delete(const CacheKey& key) {
    absl::Status out = absl::UnknownError("not done");
    absl::Notification done;
    service_->Delete(key, [&](absl::Status s) {
      out = s;
      done.Notify();
    });
    done.WaitForNotification();
    return out;
  }
};

TEST_F(ServiceTest, PutThenGetLookupDescribeListDelete) {
  Tensor x(10);
  absl::StatusOr<CacheSummary> s = PutCache("alice", "k1", x);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->original_tokens, kTokens);
  EXPECT_EQ(s->original_bytes, kLayout.CacheBytes(kTokens));
  // Half of each head's tokens kept (ratio 0.5), over every layer and head.
  EXPECT_EQ(s->total_kept, kTokens / 2 * kLayout.num_layers * kLayout.num_kv_heads);
  // The put ends once its worker lets it go, right after the answer.
  EXPECT_TRUE(service_->WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(service_->open_puts(), 0u);

  const CacheKey key{"alice", "m", "k1"};
  absl::StatusOr<storage::Payload> got = Get(key);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->size(), s->stored_bytes);
  absl::StatusOr<CompressedCache> cache = format::ParseCache(got->view());
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(cache->original_tokens, kTokens);
  EXPECT_EQ(cache->total_kept(), s->total_kept);
  // Raw codecs: the decoded representation is the stored one.
  absl::StatusOr<storage::Payload> decoded = Get(key, Representation::kDecoded);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->view(), got->view());

  absl::StatusOr<CacheSummary> looked = Lookup(key);
  ASSERT_TRUE(looked.ok()) << looked.status();
  EXPECT_EQ(looked->total_kept, s->total_kept);
  EXPECT_EQ(looked->stored_bytes, s->stored_bytes);
  EXPECT_EQ(looked->tier, storage::TierKind::kHost);
  absl::StatusOr<CacheRepository::Description> d = repository_->Describe(key);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->where.persisted);  // durability disk: in RocksDB before the put's answer
  EXPECT_EQ(d->info.layout.num_layers, kLayout.num_layers);

  ASSERT_TRUE(PutCache("alice", "k2", x).ok());
  absl::StatusOr<std::vector<CacheKey>> listed = repository_->List("alice");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].key, "k1");
  EXPECT_EQ((*listed)[1].key, "k2");

  ASSERT_TRUE(Delete(key).ok());
  EXPECT_EQ(Get(key).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Lookup(key).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(repository_->Describe(key).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Delete(key).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(repository_->List("alice")->size(), 1u);
}

// A get of the decoded representation of a KVSplice cache on a CPU engine: decoded on the shared
// CPU decoder (the same bytes as CacheRepository::Decode without a backend), raw codecs, the
// decode stage observed once, no byte counted across a device.
TEST_F(ServiceTest, ADecodedGetOfAnEncodedCacheDecodesOnTheCpuWithoutAGpu) {
  Tensor x(12);
  ASSERT_TRUE(PutCache("alice", "raw0", x).ok());
  ASSERT_TRUE(PutCache("alice", "raw1", x).ok());
  absl::Status calibrated = CalibrateOrthogonalInt8(kLayout.head_dim / 2);
  ASSERT_TRUE(calibrated.ok()) << calibrated;
  CompressionPolicy splice = HalfPolicy();
  splice.key_codec = KeyCodec::kInt8;
  splice.value_codec = ValueCodec::kOrthogonalInt8;
  splice.rank = kLayout.head_dim / 2;
  auto put = service_->BeginPut(Request("alice", "splice", false, splice));
  ASSERT_TRUE(put.ok()) << put.status();
  ASSERT_TRUE(Add(**put, MakeBlock(x, 0, 2, 0, kTokens)).ok());
  ASSERT_TRUE(Commit(**put).ok());

  const CacheKey key{"alice", "m", "splice"};
  absl::StatusOr<storage::Payload> stored = Get(key);
  ASSERT_TRUE(stored.ok()) << stored.status();
  const std::string before = metrics_->Scrape();
  absl::StatusOr<storage::Payload> decoded = Get(key, Representation::kDecoded);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  const std::string after = metrics_->Scrape();
  absl::StatusOr<CompressedCache> cache = format::ParseCache(decoded->view());
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(cache->key_codec, KeyCodec::kRaw);
  EXPECT_EQ(cache->value_codec, ValueCodec::kRaw);
  absl::StatusOr<storage::Payload> twin = repository_->Decode(key, *stored, nullptr);
  ASSERT_TRUE(twin.ok()) << twin.status();
  EXPECT_TRUE(decoded->view() == twin->view());
  auto counter = [](const std::string& text, const std::string& name) {
    return Scraped(text, name, 0.0);
  };
  const std::string decode_count = "kvcomp_stage_duration_seconds_count{stage=\"decode\"}";
  EXPECT_EQ(counter(after, decode_count) - counter(before, decode_count), 1.0);
  EXPECT_EQ(counter(after, "kvcomp_d2h_bytes_total"), counter(before, "kvcomp_d2h_bytes_total"));
}

TEST_F(ServiceTest, TenantsSeeOnlyTheirOwnCaches) {
  Tensor x(11);
  ASSERT_TRUE(PutCache("alice", "shared-name", x).ok());
  const CacheKey as_bob{"bob", "m", "shared-name"};
  absl::StatusOr<storage::Payload> got = Get(as_bob);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(got.status().message(), "cache not found");
  EXPECT_EQ(Lookup(as_bob).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Delete(as_bob).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(repository_->List("bob")->empty());
  // Bob's put of the same name is his own cache; alice's is untouched.
  Tensor y(12);
  ASSERT_TRUE(PutCache("bob", "shared-name", y).ok());
  ASSERT_TRUE(Delete(as_bob).ok());
  EXPECT_TRUE(Get(CacheKey{"alice", "m", "shared-name"}).ok());
}

TEST_F(ServiceTest, BlockWisePutAppendsInTokenOrderAndReleasesBlocksAsItGoes) {
  Tensor x(13);
  CompressionPolicy p = HalfPolicy();
  p.block_size = 16;
  auto put = service_->BeginPut(Request("alice", "stream", true, p));
  ASSERT_TRUE(put.ok()) << put.status();
  auto early = std::make_shared<std::atomic<bool>>(false);
  auto first = std::make_shared<std::atomic<bool>>(false);
  ASSERT_TRUE(Add(**put, MakeBlock(x, 0, 2, 32, kTokens, true, true, early)).ok());
  ASSERT_TRUE(Add(**put, MakeBlock(x, 0, 2, 0, 16, true, true, first)).ok());
  ASSERT_TRUE(engine_->WaitIdle(absl::Seconds(30)));
  EXPECT_TRUE(first->load());   // appended: its memory is gone
  EXPECT_FALSE(early->load());  // waits for tokens 16..32
  // K and V apart are refused for a block-wise put.
  EXPECT_EQ(Add(**put, MakeBlock(x, 0, 2, 16, 32, true, false)).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(Add(**put, MakeBlock(x, 0, 2, 16, 32)).ok());
  absl::StatusOr<CacheSummary> s = Commit(**put);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(early->load());
  EXPECT_EQ(s->original_tokens, kTokens);
  EXPECT_EQ(s->total_kept, kTokens / 2 * kLayout.num_layers * kLayout.num_kv_heads);
  EXPECT_TRUE(Get(CacheKey{"alice", "m", "stream"}).ok());
}

TEST_F(ServiceTest, ErrorsAreStatusesAndNothingIsStored) {
  Tensor x(14);
  // Incomplete: layer 1's values missing.
  auto put = service_->BeginPut(Request("alice", "partial"));
  ASSERT_TRUE(put.ok()) << put.status();
  ASSERT_TRUE(Add(**put, MakeBlock(x, 0, 1, 0, kTokens)).ok());
  ASSERT_TRUE(Add(**put, MakeBlock(x, 1, 2, 0, kTokens, true, false)).ok());
  EXPECT_EQ(Add(**put, MakeBlock(x, 0, 1, 10, 20)).code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<CacheSummary> s = Commit(**put);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  EXPECT_EQ(Get(CacheKey{"alice", "m", "partial"}).status().code(), absl::StatusCode::kNotFound);

  // Aborted, then committed: cancelled; its blocks went at the abort.
  auto released = std::make_shared<std::atomic<bool>>(false);
  auto aborted = service_->BeginPut(Request("alice", "aborted"));
  ASSERT_TRUE(aborted.ok());
  ASSERT_TRUE(Add(**aborted, MakeBlock(x, 0, 2, 0, kTokens, true, true, released)).ok());
  (*aborted)->Abort();
  EXPECT_TRUE(released->load());
  EXPECT_EQ(Commit(**aborted).status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(Add(**aborted, MakeBlock(x, 0, 2, 0, 8)).code(), absl::StatusCode::kFailedPrecondition);

  // Larger than max_put_bytes.
  absl::StatusOr<PutRequest> big =
      PutRequest::Make(CacheKey{"alice", "m", "big"}, kLayout, 4096, HalfPolicy(), false);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(service_->BeginPut(*std::move(big)).status().code(),
            absl::StatusCode::kInvalidArgument);

  // A value codec before any calibration of the model.
  CompressionPolicy splice = HalfPolicy();
  splice.value_codec = ValueCodec::kOrthogonal;
  splice.rank = 16;
  absl::StatusOr<std::shared_ptr<OpenPut>> uncalibrated =
      service_->BeginPut(Request("alice", "splice", false, splice));
  EXPECT_EQ(uncalibrated.status().code(), absl::StatusCode::kFailedPrecondition)
      << uncalibrated.status();

  // Draining: no new puts.
  service_->Drain();
  EXPECT_EQ(service_->BeginPut(Request("alice", "late")).status().code(),
            absl::StatusCode::kUnavailable);
  // Idle once the puts' owners let them go.
  EXPECT_FALSE(service_->WaitIdle(absl::Milliseconds(20)));
  *put = nullptr;
  *aborted = nullptr;
  EXPECT_EQ(service_->open_puts(), 0u);
  EXPECT_TRUE(service_->WaitIdle(absl::Seconds(10)));
}

TEST_F(ServiceTest, AWholePutReleasesItsBlocksWhenItEnds) {
  Tensor x(15);
  auto released = std::make_shared<std::atomic<bool>>(false);
  {
    auto put = service_->BeginPut(Request("alice", "k"));
    ASSERT_TRUE(put.ok());
    EXPECT_EQ(service_->open_puts(), 1u);
    ASSERT_TRUE(Add(**put, MakeBlock(x, 0, 2, 0, kTokens, true, true, released)).ok());
    EXPECT_FALSE(released->load());
    ASSERT_TRUE(Commit(**put).ok());
    EXPECT_TRUE(released->load());  // compressed and stored: the bytes are not held
  }
  EXPECT_TRUE(service_->WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(service_->open_puts(), 0u);
}

TEST_F(ServiceTest, DeviceMemoryBlocksAreRefusedByACpuEngine) {
  Tensor x(16);
  auto put = service_->BeginPut(Request("alice", "k"));
  ASSERT_TRUE(put.ok());
  BlockData b = MakeBlock(x, 0, 2, 0, kTokens);
  for (HeadsView& v : b.keys) v.space = MemorySpace::kDevice;
  for (HeadsView& v : b.values) v.space = MemorySpace::kDevice;
  absl::Status s = Add(**put, std::move(b));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  // A CPU engine counts no bytes across a device.
  ASSERT_TRUE(Add(**put, MakeBlock(x, 0, 2, 0, kTokens)).ok());
  absl::StatusOr<CacheSummary> c = Commit(**put);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->h2d_bytes, 0u);
  EXPECT_EQ(c->d2h_bytes, 0u);
}

// The engine's failure path, as a sticky device error drives it (injected: no real error can
// be made on purpose): the put that meets it fails, the engine is failed and refuses new puts,
// stored caches are still served.
TEST_F(ServiceTest, AnEngineFailureFailsThePutAndRefusesLaterOnes) {
  Tensor x(17);
  ASSERT_TRUE(PutCache("alice", "before", x).ok());
  EXPECT_FALSE(engine_->failed());
  engine_->InjectStickyFaultForTest();
  absl::StatusOr<CacheSummary> s = PutCache("alice", "during", x);
  EXPECT_TRUE(absl::IsInternal(s.status())) << s.status();
  EXPECT_TRUE(engine_->failed());
  EXPECT_NE(engine_->failure().find("injected"), std::string::npos) << engine_->failure();
  EXPECT_TRUE(absl::IsNotFound(Get(CacheKey{"alice", "m", "during"}).status()));
  auto after = service_->BeginPut(Request("alice", "after"));
  EXPECT_TRUE(absl::IsUnavailable(after.status())) << after.status();
  EXPECT_TRUE(Get(CacheKey{"alice", "m", "before"}).ok());
}

}  // namespace
}  // namespace service
}  // namespace kvcomp
